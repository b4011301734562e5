//! The pooled HTTP client adapters share, and request helpers.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::connector::ProviderConnector;
use super::h1::RawHead;
pub use super::pool::HttpClient;
use super::pool::{ClientError, Keep, Origin, ProviderBody};
use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, Request};
use hyper_util::client::legacy::connect::HttpConnector;
use iop_http1 as http1;
use iop_proto_core::wire::{Header, HeaderRef, ProviderHealth};

/// Builds the shared client. TLS trusts the Mozilla roots, plus the PEM certificates in
/// `extra_ca` (for providers behind a private CA).
pub fn client(extra_ca: Option<&Path>) -> Result<HttpClient, String> {
    client_keeping(extra_ca, KEEP_PER_PROVIDER)
}

/// [`client`], keeping idle connections as `keep` says.
pub fn client_keeping(extra_ca: Option<&Path>, keep: Keep) -> Result<HttpClient, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = extra_ca {
        // Read within the size limit of every file a configuration names; an empty one
        // is refused.
        for cert in
            iop_shell_common::tls::read_certs("tls.ca_file", path).map_err(|err| err.to_string())?
        {
            roots
                .add(cert)
                .map_err(|err| format!("tls.ca_file {}: {err}", path.display()))?;
        }
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|err| format!("tls: {err}"))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.enforce_http(false);
    connector.set_connect_timeout(Some(Duration::from_secs(10)));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(connector);
    Ok(HttpClient::new(ProviderConnector(https), keep))
}

/// Idle keep-alive connections kept per provider host. A few stay warm for a minute.
/// Under hundreds of concurrent requests every finished connection is kept, up to
/// `most`, so none is dialled per request (with 64 kept, 256 callers made three of four
/// requests dial and wait out dropped SYNs: a p99 near 1 s); once the load ends, those
/// above the warm few close within seconds, since each holds a socket and its buffers
/// (2,000 paced streams once left 2,000 of them open for a minute).
pub const KEEP_PER_PROVIDER: Keep = Keep {
    warm: 64,
    warm_for: Duration::from_secs(60),
    most: 1024,
    surplus_for: Duration::from_secs(3),
};

/// Headers that describe one hop and must not be forwarded.
const HOP_BY_HOP: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
];

/// True for headers that are forwarded through a tunnel in either direction.
#[must_use]
pub fn forwardable(name: &str) -> bool {
    !HOP_BY_HOP.iter().any(|hop| hop.eq_ignore_ascii_case(name))
}

/// The trace context a run's metadata carries (`traceparent`, and `tracestate` beside a
/// valid one), as headers for the provider call; a value that is not a valid one is left
/// out.
#[must_use]
pub fn trace_headers(metadata: &std::collections::BTreeMap<String, String>) -> Vec<Header> {
    use iop_trace::{TRACEPARENT, TRACESTATE, TraceContext, tracestate_ok};
    let Some(parent) = metadata
        .get(TRACEPARENT)
        .filter(|v| TraceContext::parse(v.as_bytes()).is_some())
    else {
        return Vec::new();
    };
    let mut out = vec![Header {
        name: TRACEPARENT.to_owned(),
        value: Bytes::copy_from_slice(parent.as_bytes()),
    }];
    if let Some(state) = metadata
        .get(TRACESTATE)
        .filter(|v| tracestate_ok(v.as_bytes()))
    {
        out.push(Header {
            name: TRACESTATE.to_owned(),
            value: Bytes::copy_from_slice(state.as_bytes()),
        });
    }
    out
}

fn parse_method(method: &str) -> Result<Method, String> {
    Method::from_bytes(method.as_bytes()).map_err(|_| format!("invalid method {method:?}"))
}

/// `Bearer <key>`, marked sensitive (kept out of debug output).
fn bearer(api_key: &str) -> Result<HeaderValue, String> {
    let mut value = HeaderValue::from_str(&format!("Bearer {api_key}"))
        .map_err(|_| "api_key is not a valid header value (control characters?)".to_owned())?;
    value.set_sensitive(true);
    Ok(value)
}

/// Appends the `headers` a provider may see: forwardable ones, never the caller's
/// `Authorization` (the adapter's key replaces it), valid names and values only.
fn forward(map: &mut http::HeaderMap, headers: &[Header]) {
    map.reserve(headers.len() + 2);
    for header in headers {
        if !forwardable(&header.name) || header.name.eq_ignore_ascii_case("authorization") {
            continue;
        }
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(header.name.as_bytes()),
            HeaderValue::from_bytes(&header.value),
        ) else {
            continue;
        };
        map.append(name, value);
    }
}

/// A provider as its adapter calls it, worked out once from the adapter's configuration:
/// the origin its requests go to and its bearer key as a header value. A request then
/// costs no URL parsing and no key formatting.
#[derive(Clone, Debug)]
pub struct Upstream {
    origin: Origin,
    /// `Bearer <api_key>`, or `None` without a key.
    auth: Option<HeaderValue>,
}

impl Upstream {
    /// The provider at `base_url` (`http(s)://host[:port][/prefix]`, which the core
    /// validated with the adapter's config), called with `api_key`; a URL or a key that
    /// cannot be sent is refused here, with the config, not on the first request.
    pub fn new(base_url: &str, api_key: &str) -> Result<Self, String> {
        let origin = Origin::parse(base_url).map_err(|_| {
            format!("base_url {base_url:?} must be http(s)://host[:port][/path], without a query")
        })?;
        let auth = (!api_key.is_empty()).then(|| bearer(api_key)).transpose()?;
        Ok(Upstream { origin, auth })
    }

    /// A request for `path` under the base URL, with a full body, the bearer key and the
    /// forwardable `headers`.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[Header],
        body: Bytes,
    ) -> Result<Request<Bytes>, String> {
        let mut request = Request::new(body);
        *request.method_mut() = parse_method(method)?;
        *request.uri_mut() = self
            .origin
            .target(path)
            .map_err(|err| format!("cannot build request: {err}"))?;
        forward(request.headers_mut(), headers);
        if let Some(auth) = &self.auth {
            request
                .headers_mut()
                .insert(http::header::AUTHORIZATION, auth.clone());
        }
        Ok(request)
    }

    /// The head of a raw tunnel request for `path` under the base URL, written directly
    /// (no `http` request is built) by the core's rules: the method, the target, `Host`,
    /// the forwardable `headers` (never the caller's `Authorization`), the bearer key and
    /// the body's length. A method or target that could not be sent (one that could split
    /// the request) is an error; a header that could not be is left out, as the `http`
    /// types would leave it out.
    pub fn tunnel_head<'a>(
        &self,
        method: &str,
        path: &str,
        headers: impl IntoIterator<Item = HeaderRef<'a>>,
        body_len: usize,
    ) -> Result<Vec<u8>, String> {
        let prefix = self.origin.prefix();
        let mut out = Vec::with_capacity(192 + path.len() + body_len.min(16 << 10));
        http1::encode_request_line(method, &[prefix, path], &mut out)
            .map_err(|err| format!("cannot build request: {err} ({method:?} {prefix}{path:?})"))?;
        http1::encode_field(b"host", self.origin.host(), &mut out);
        for header in headers {
            if forwardable(header.name) && !header.name.eq_ignore_ascii_case("authorization") {
                http1::encode_field(header.name.as_bytes(), header.value, &mut out);
            }
        }
        if let Some(auth) = &self.auth {
            http1::encode_field(b"authorization", auth.as_bytes(), &mut out);
            // The Messages API's own header for the key, for a provider that serves it
            // natively and reads only that.
            if path.starts_with("/v1/messages")
                && let Some(key) = auth.as_bytes().strip_prefix(b"Bearer ")
            {
                http1::encode_field(b"x-api-key", key, &mut out);
            }
        }
        http1::finish_request_head(method, body_len as u64, &mut out);
        Ok(out)
    }

    /// Sends a request whose head [`Upstream::tunnel_head`] wrote; the response head as
    /// read, and its body.
    pub fn send_raw<'a>(
        &self,
        client: &'a HttpClient,
        head: Vec<u8>,
        body: Bytes,
        head_request: bool,
    ) -> impl std::future::Future<Output = Result<(RawHead, ProviderBody), ClientError>> + Send + 'a
    {
        client.send_raw(&self.origin, head, body, head_request)
    }

    /// Sends a request made by [`Upstream::request`].
    pub fn send<'a>(
        &self,
        client: &'a HttpClient,
        request: Request<Bytes>,
    ) -> impl std::future::Future<Output = Result<http::Response<ProviderBody>, ClientError>> + Send + 'a
    {
        client.request_to(&self.origin, request)
    }
}

/// The response headers a tunnel may carry back (see
/// [`iop_proto_core::tunnel::FORWARDED_RESPONSE_HEADERS`]) from a head as read, as wire
/// headers: names lower-cased, values slices of the head's bytes.
#[must_use]
pub fn raw_wire_headers(head: &RawHead) -> Vec<Header> {
    head.parsed
        .fields
        .iter()
        .filter_map(|(name, value)| {
            // Matched as bytes: only a forwarded name, which is ASCII, is made a string.
            let name =
                iop_proto_core::tunnel::forwarded_response_header(&head.bytes[name.clone()])?;
            Some(Header {
                name: name.to_owned(),
                value: head.bytes.slice(value.clone()),
            })
        })
        .collect()
}

/// The response headers a tunnel may carry back (see
/// [`iop_proto_core::tunnel::FORWARDED_RESPONSE_HEADERS`]), as wire headers.
#[must_use]
pub fn wire_headers(headers: &http::HeaderMap) -> Vec<Header> {
    headers
        .iter()
        .filter(|(name, _)| iop_proto_core::tunnel::forwards_response_header(name.as_str()))
        .map(|(name, value)| Header {
            name: name.as_str().to_owned(),
            value: Bytes::copy_from_slice(value.as_bytes()),
        })
        .collect()
}

/// Probes a provider with one `GET path` (2 s at most): healthy on a 2xx answer, degraded
/// when it answers otherwise, offline when it does not answer.
pub async fn probe(client: &HttpClient, upstream: &Upstream, path: &str) -> ProviderHealth {
    let Ok(request) = upstream.request("GET", path, &[], Bytes::new()) else {
        return ProviderHealth::Offline;
    };
    let answer = upstream.send(client, request);
    match tokio::time::timeout(std::time::Duration::from_secs(2), answer).await {
        Ok(Ok(response)) if response.status().is_success() => ProviderHealth::Healthy,
        Ok(Ok(_)) => ProviderHealth::Degraded,
        _ => ProviderHealth::Offline,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refs(headers: &[Header]) -> impl Iterator<Item = HeaderRef<'_>> {
        headers.iter().map(|h| HeaderRef {
            name: &h.name,
            value: &h.value,
        })
    }

    fn header(name: &str, value: &str) -> Header {
        Header {
            name: name.to_owned(),
            value: Bytes::copy_from_slice(value.as_bytes()),
        }
    }

    #[test]
    fn a_provider_ca_file_is_read_within_the_limit_and_must_hold_a_certificate() {
        let err = client(Some(Path::new("/dev/zero"))).expect_err("endless");
        assert!(
            err.starts_with("tls.ca_file: cannot read /dev/zero"),
            "{err}"
        );
        assert!(err.contains("larger than"), "{err}");
        let err = client(Some(Path::new("/dev/null"))).expect_err("empty");
        assert!(err.contains("no PEM certificate"), "{err}");
        assert!(client(None).is_ok());
    }

    #[test]
    fn an_upstream_request_carries_its_key_not_the_callers() {
        let upstream = Upstream::new("http://127.0.0.1:9000/", "sk-upstream").unwrap();
        let headers = [
            header("content-type", "application/json"),
            header("authorization", "Bearer sk-caller"),
            header("x-request-id", "req_1"),
            header("connection", "close"),
        ];
        let request = upstream
            .request(
                "POST",
                "/v1/chat/completions",
                &headers,
                Bytes::from_static(b"{}"),
            )
            .unwrap();
        assert_eq!(request.method(), Method::POST);
        assert_eq!(request.uri(), "/v1/chat/completions");
        let got = request.headers();
        assert_eq!(got["content-type"], "application/json");
        assert_eq!(got["x-request-id"], "req_1");
        assert_eq!(got.get_all(http::header::AUTHORIZATION).iter().count(), 1);
        assert_eq!(got[http::header::AUTHORIZATION], "Bearer sk-upstream");
        assert!(got[http::header::AUTHORIZATION].is_sensitive());
        assert!(got.get("connection").is_none());
        // Nothing else: the caller's key and hop-by-hop fields are gone.
        assert_eq!(got.len(), 3, "{got:?}");

        let keyless = Upstream::new("http://127.0.0.1:9000", "").unwrap();
        let request = keyless
            .request("GET", "/health", &[], Bytes::new())
            .unwrap();
        assert!(request.headers().get(http::header::AUTHORIZATION).is_none());
        assert!(
            keyless
                .request("NOT A METHOD", "/", &[], Bytes::new())
                .is_err()
        );
        assert!(keyless.request("GET", "health", &[], Bytes::new()).is_err());
        // A key that cannot be a header value is refused with the config, said plainly.
        let err = Upstream::new("http://127.0.0.1:9000", "sk\nx").unwrap_err();
        assert!(err.contains("api_key") && !err.contains("sk"), "{err}");
        assert!(Upstream::new("ftp://h", "").is_err());
    }

    /// The raw tunnel head, parsed back as a provider would read it.
    fn parsed(head: &[u8]) -> (String, String, Vec<(String, String)>) {
        let mut fields = [httparse::EMPTY_HEADER; 16];
        let mut request = httparse::Request::new(&mut fields);
        let len = match request.parse(head).expect("a valid head") {
            httparse::Status::Complete(len) => len,
            httparse::Status::Partial => panic!("incomplete"),
        };
        assert_eq!(len, head.len(), "one head, nothing after it");
        (
            request.method.unwrap().to_owned(),
            request.path.unwrap().to_owned(),
            request
                .headers
                .iter()
                .map(|h| {
                    (
                        h.name.to_owned(),
                        String::from_utf8_lossy(h.value).into_owned(),
                    )
                })
                .collect(),
        )
    }

    #[test]
    fn a_raw_tunnel_head_carries_what_the_http_request_carried() {
        let upstream = Upstream::new("http://127.0.0.1:9000/base/", "sk-upstream").unwrap();
        let headers = [
            header("content-type", "application/json"),
            header("authorization", "Bearer sk-caller"),
            header("x-request-id", "req_1"),
            header("connection", "close"),
            header("Host", "evil"),
            header("content-length", "999"),
            header("x-split", "a\r\nx-injected: 1"),
            header("bad name", "v"),
        ];
        let head = upstream
            .tunnel_head("POST", "/v1/chat/completions?x=1", refs(&headers), 2)
            .unwrap();
        let (method, target, fields) = parsed(&head);
        assert_eq!(
            (method.as_str(), target.as_str()),
            ("POST", "/base/v1/chat/completions?x=1")
        );
        let want: Vec<(String, String)> = [
            ("host", "127.0.0.1:9000"),
            ("content-type", "application/json"),
            ("x-request-id", "req_1"),
            ("authorization", "Bearer sk-upstream"),
            ("content-length", "2"),
        ]
        .iter()
        .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
        .collect();
        assert_eq!(fields, want);
        // The same fields the http request carried (its names, its values).
        let request = upstream
            .request(
                "POST",
                "/v1/chat/completions?x=1",
                &headers,
                Bytes::from_static(b"{}"),
            )
            .unwrap();
        for (name, value) in &fields[1..fields.len() - 1] {
            assert_eq!(request.headers()[name.as_str()], value.as_str(), "{name}");
        }

        let keyless = Upstream::new("http://127.0.0.1:9000", "").unwrap();
        let (_, _, fields) = parsed(&keyless.tunnel_head("GET", "/health", [], 0).unwrap());
        assert_eq!(
            fields,
            [("host".to_owned(), "127.0.0.1:9000".to_owned())],
            "no length, no key"
        );
        for (method, path) in [
            ("NOT A METHOD", "/"),
            ("", "/"),
            ("GET", "health"),
            ("GET", "/a b"),
            ("GET", "/a\r\nx: y"),
            ("GET", "/a#frag"),
            ("GET", "/é"),
        ] {
            assert!(
                keyless.tunnel_head(method, path, [], 0).is_err(),
                "{method:?} {path:?}"
            );
        }
    }

    #[test]
    fn only_the_allowed_response_headers_go_back_as_slices_of_the_head() {
        let text = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nset-cookie: s=1\r\nX-Request-Id: up-1\r\nserver: x\r\n\r\n";
        let mut buf = bytes::BytesMut::from(&text[..]);
        let parsed = iop_http1::HeadReader::new(1024)
            .poll_response(&buf, false)
            .unwrap()
            .unwrap();
        let head = RawHead {
            bytes: buf.split_to(parsed.len).freeze(),
            parsed,
        };
        let wire = raw_wire_headers(&head);
        let got: Vec<(&str, &[u8])> = wire
            .iter()
            .map(|h| (h.name.as_str(), &h.value[..]))
            .collect();
        assert_eq!(
            got,
            [
                ("content-type", &b"text/event-stream"[..]),
                ("x-request-id", b"up-1")
            ]
        );
        assert_eq!(head.field("CONTENT-TYPE"), Some(&b"text/event-stream"[..]));
    }
}
