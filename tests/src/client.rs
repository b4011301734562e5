//! An HTTP client for tests, and a small cluster builder that starts an Edge and Nodes
//! with temporary configs tuned for fast tests (short heartbeats and reconnects).

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use crate::{Proc, TempDir, free_port, wait_until};

/// An HTTP/1.1 client bound to one base URL.
#[derive(Clone, Debug)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
    authorization: Option<String>,
    extra: Vec<(String, String)>,
}

/// A response read to the end.
#[derive(Debug)]
pub struct Whole {
    /// Status code.
    pub status: u16,
    /// Content type.
    pub content_type: String,
    /// Every header (lower-case names).
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: Bytes,
}

impl Whole {
    /// The body as JSON.
    #[must_use]
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|err| {
            panic!("not JSON ({err}): {}", String::from_utf8_lossy(&self.body))
        })
    }
}

impl Http {
    /// A client for `http://127.0.0.1:port`.
    #[must_use]
    pub fn new(port: u16) -> Self {
        // Small writes (SSE chunks) must not wait for Nagle's algorithm.
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Http {
            client: Client::builder(TokioExecutor::new()).build(connector),
            base: format!("http://127.0.0.1:{port}"),
            authorization: None,
            extra: Vec::new(),
        }
    }

    /// The same client sending `Authorization: Bearer key`.
    #[must_use]
    pub fn with_key(self, key: &str) -> Self {
        self.with_authorization(&format!("Bearer {key}"))
    }

    /// The same client sending one more header on every request.
    #[must_use]
    pub fn with_header(mut self, name: &str, value: &str) -> Self {
        self.extra.push((name.to_owned(), value.to_owned()));
        self
    }

    /// The same client sending `Authorization: value` as given.
    #[must_use]
    pub fn with_authorization(mut self, value: &str) -> Self {
        self.authorization = Some(value.to_owned());
        self
    }

    async fn send(&self, method: &str, path: &str, body: Bytes) -> http::Response<Incoming> {
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("content-type", "application/json");
        if let Some(value) = &self.authorization {
            builder = builder.header("authorization", value.as_str());
        }
        for (name, value) in &self.extra {
            builder = builder.header(name.as_str(), value.as_str());
        }
        let request = builder.body(Full::new(body)).expect("request");
        tokio::time::timeout(Duration::from_secs(30), self.client.request(request))
            .await
            .expect("response within 30 s")
            .expect("request sent")
    }

    async fn read(response: http::Response<Incoming>) -> Whole {
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let headers = response
            .headers()
            .iter()
            .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
            .collect();
        let body = tokio::time::timeout(Duration::from_secs(30), response.into_body().collect())
            .await
            .expect("body within 30 s")
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        Whole {
            status,
            content_type,
            headers,
            body,
        }
    }

    /// Any method without a body, read to the end.
    pub async fn call(&self, method: &str, path: &str) -> Whole {
        Self::read(self.send(method, path, Bytes::new()).await).await
    }

    /// GET, read to the end.
    pub async fn get(&self, path: &str) -> Whole {
        Self::read(self.send("GET", path, Bytes::new()).await).await
    }

    /// POST a JSON body, read to the end.
    pub async fn post(&self, path: &str, body: &Value) -> Whole {
        Self::read(self.send("POST", path, Bytes::from(body.to_string())).await).await
    }

    /// POST raw bytes, read to the end.
    pub async fn post_raw(&self, path: &str, body: impl Into<Bytes>) -> Whole {
        Self::read(self.send("POST", path, body.into()).await).await
    }

    /// POST and return the response with its body unread (for streams).
    pub async fn post_stream(&self, path: &str, body: &Value) -> http::Response<Incoming> {
        self.send("POST", path, Bytes::from(body.to_string())).await
    }

    /// GET and return the response with its body unread (for event streams).
    pub async fn get_stream(&self, path: &str) -> http::Response<Incoming> {
        self.send("GET", path, Bytes::new()).await
    }

    /// `/v1/status` as JSON.
    pub async fn status(&self) -> Value {
        self.get("/v1/status").await.json()
    }
}

/// POSTs `body` as JSON to `path` on the Edge at `port` over HTTP/2 with prior knowledge
/// (h2c), and returns the response once its head is in.
pub async fn post_h2c(port: u16, path: &str, body: &Value) -> http::Response<Incoming> {
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let request = Request::post(format!("http://127.0.0.1:{port}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let response = client.request(request).await.expect("h2c response");
    assert_eq!(response.version(), http::Version::HTTP_2);
    response
}

/// Reads SSE `data:` payloads until the stream ends or `timeout` passes. Returns the
/// payloads and whether the stream ended (as opposed to timing out or erroring).
pub async fn read_sse(body: &mut Incoming, timeout: Duration) -> (Vec<String>, bool) {
    let mut buffer = String::new();
    let mut events = Vec::new();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return (events, false),
            Ok(None) => return (events, true),
            Ok(Some(Err(_))) => return (events, false),
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    buffer.push_str(&String::from_utf8_lossy(&data));
                    while let Some(end) = buffer.find("\n\n") {
                        let event: String = buffer.drain(..end + 2).collect();
                        for line in event.lines() {
                            if let Some(payload) = line.strip_prefix("data: ") {
                                events.push(payload.to_owned());
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Reads one SSE `data:` payload (or `None` at the end or after `timeout`).
pub async fn next_sse(body: &mut Incoming, timeout: Duration) -> Option<String> {
    let mut buffer = String::new();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let frame = tokio::time::timeout_at(deadline, body.frame())
            .await
            .ok()??
            .ok()?;
        if let Ok(data) = frame.into_data() {
            buffer.push_str(&String::from_utf8_lossy(&data));
            if let Some(start) = buffer.find("data: ")
                && let Some(end) = buffer[start..].find("\n\n")
            {
                return Some(buffer[start + 6..start + end].to_owned());
            }
        }
    }
}

/// Timers for test clusters: heartbeats every 200 ms, lost after 1 s.
pub const HEARTBEAT_MS: u64 = 200;
/// See [`HEARTBEAT_MS`].
pub const HEARTBEAT_TIMEOUT_MS: u64 = 1000;

/// An Edge (and the Nodes started against it) with temporary configs.
#[derive(Debug)]
pub struct Cluster {
    /// Public HTTP port.
    pub http_port: u16,
    /// Node listener port.
    pub node_port: u16,
    /// The edge process.
    pub edge: Proc,
    /// The edge's config file.
    pub edge_config: std::path::PathBuf,
    /// SHA-256 fingerprint of the Edge's node-link certificate (`None`: plaintext link).
    pub fingerprint: Option<String>,
    /// The admin key status helpers send, when the cluster has admin keys.
    pub admin_key: Option<String>,
    link: Link,
    body: String,
    extra_head: String,
    /// Holds configs and logs (the last field: dropped after the Edge, whose log a
    /// failing test prints).
    pub dir: TempDir,
}

/// Node listener security of a test cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    /// TLS with a self-signed certificate made by `iop-edge gen-cert`; nodes pin it.
    Tls,
    /// `listen.nodes_plaintext = true`; nodes set `edge_tls.plaintext = true`.
    Plaintext,
    /// [`Link::Tls`], and node client certificates issued by `nodes-ca.pem` are required
    /// ([`Cluster::node_cert`] issues them).
    MutualTls,
}

/// Runs `iop-edge gen-cert` into `dir` and returns the printed fingerprint.
pub fn gen_cert(dir: &TempDir, stem: &str, names: &[&str], extra: &[&str]) -> String {
    let cert = dir.path().join(format!("{stem}.pem"));
    let key = dir.path().join(format!("{stem}-key.pem"));
    let mut args: Vec<String> = vec![
        "gen-cert".into(),
        "--cert".into(),
        cert.to_string_lossy().into_owned(),
        "--key".into(),
        key.to_string_lossy().into_owned(),
    ];
    for name in names {
        args.push("--name".into());
        args.push((*name).to_owned());
    }
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    let out = std::process::Command::new(crate::binary("iop-edge"))
        .args(&args)
        .output()
        .expect("gen-cert runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "gen-cert failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("SHA-256 fingerprint: "))
        .expect("gen-cert prints the fingerprint")
        .trim()
        .to_owned()
}

impl Cluster {
    /// The edge config text for `body` (nodes and models) and `head` (extra sections),
    /// with a TLS node listener using `edge-cert.pem` beside the config file.
    #[must_use]
    pub fn edge_toml(http_port: u16, node_port: u16, head: &str, body: &str) -> String {
        Self::edge_toml_with(Link::Tls, http_port, node_port, head, body)
    }

    /// [`Cluster::edge_toml`] with a chosen node link.
    #[must_use]
    pub fn edge_toml_with(
        link: Link,
        http_port: u16,
        node_port: u16,
        head: &str,
        body: &str,
    ) -> String {
        let tls =
            "[listen.nodes_tls]\ncert_file = \"edge-cert.pem\"\nkey_file = \"edge-cert-key.pem\"\n";
        let (plaintext, link) = match link {
            Link::Tls => ("", tls.to_owned()),
            Link::MutualTls => ("", format!("{tls}client_ca_file = \"nodes-ca.pem\"\n")),
            Link::Plaintext => ("nodes_plaintext = true\n", String::new()),
        };
        // Admin routes stay open to the test on this host unless it sets admin keys
        // itself: tests read status and metrics from loopback.
        let head = if !head.contains("[auth]") {
            format!("{head}\n[auth]\nadmin_loopback = true\n")
        } else if head.contains("admin_keys") || head.contains("admin_loopback") {
            head.to_owned()
        } else {
            head.replacen("[auth]\n", "[auth]\nadmin_loopback = true\n", 1)
        };
        // A test that sets its own `[heartbeat]` keeps it.
        let heartbeat = if head.contains("[heartbeat]") {
            String::new()
        } else {
            format!(
                "[heartbeat]\ninterval_ms = {HEARTBEAT_MS}\ntimeout_ms = {HEARTBEAT_TIMEOUT_MS}\n\n"
            )
        };
        format!(
            "[listen]\nhttp = \"127.0.0.1:{http_port}\"\nnodes = \"127.0.0.1:{node_port}\"\n{plaintext}{link}\n\
             {heartbeat}\
             [timeouts]\nregister_ms = 2000\nrefresh_ms = 2000\ncancel_grace_ms = 2000\nresponse_sec = 30\n\n\
             {head}\n\n{body}\n"
        )
    }

    /// Starts an Edge with `head` (extra sections such as `[queue]`) and `body`, with a
    /// TLS node link whose certificate the nodes pin.
    pub fn start(head: &str, body: &str) -> Self {
        Self::start_with(Link::Tls, head, body)
    }

    /// [`Cluster::start`] with a chosen node link.
    pub fn start_with(link: Link, head: &str, body: &str) -> Self {
        let dir = TempDir::new("cluster");
        let fingerprint = (link != Link::Plaintext)
            .then(|| gen_cert(&dir, "edge-cert", &["localhost", "127.0.0.1"], &[]));
        if link == Link::MutualTls {
            gen_cert(&dir, "nodes-ca", &["iop-test-ca"], &["--ca"]);
        }
        let (http_port, node_port) = (free_port(), free_port());
        let text = Self::edge_toml_with(link, http_port, node_port, head, body);
        let edge_config = dir.write("edge.toml", &text);
        let path = edge_config.to_string_lossy().into_owned();
        let edge = Proc::start("iop-edge", &["--config", &path], &dir, "edge", &[]);
        let mut cluster = Cluster {
            dir,
            http_port,
            node_port,
            edge,
            edge_config,
            fingerprint,
            admin_key: None,
            link,
            body: body.to_owned(),
            extra_head: head.to_owned(),
        };
        assert!(
            wait_until(Duration::from_secs(10), || std::net::TcpStream::connect((
                "127.0.0.1",
                http_port
            ))
            .is_ok()),
            "edge did not listen: {}",
            cluster.edge.log()
        );
        // Someone else's listener on the HTTP port would pass the check above.
        assert!(
            cluster.edge.running(),
            "edge exited at start: {}",
            cluster.edge.log()
        );
        cluster
    }

    /// Restarts the Edge process on the same ports and config.
    pub fn restart_edge(&mut self) {
        self.edge.signal("KILL");
        let _ = self.edge.wait_exit(Duration::from_secs(5));
        let path = self.edge_config.to_string_lossy().into_owned();
        self.edge = Proc::start(
            "iop-edge",
            &["--config", &path],
            &self.dir,
            "edge-restarted",
            &[],
        );
        let port = self.http_port;
        assert!(wait_until(Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        }));
    }

    /// Stops the Edge as an operator does (`SIGTERM`: it drains and writes what it keeps)
    /// and starts it again on the same ports and config.
    pub fn restart_edge_gracefully(&mut self) {
        self.edge.signal("TERM");
        assert!(
            self.edge.wait_exit(Duration::from_secs(15)).is_some(),
            "edge did not stop on SIGTERM: {}",
            self.edge.log()
        );
        let path = self.edge_config.to_string_lossy().into_owned();
        self.edge = Proc::start(
            "iop-edge",
            &["--config", &path],
            &self.dir,
            "edge-after-stop",
            &[],
        );
        let port = self.http_port;
        assert!(wait_until(Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        }));
    }

    /// Rewrites the edge config with a new body (and the same head and link).
    pub fn rewrite(&mut self, body: &str) {
        self.body = body.to_owned();
        let text = Self::edge_toml_with(
            self.link,
            self.http_port,
            self.node_port,
            &self.extra_head,
            body,
        );
        std::fs::write(&self.edge_config, text).expect("rewrite config");
    }

    /// Rewrites the edge config with new extra sections (`head`) and body.
    pub fn rewrite_head(&mut self, head: &str, body: &str) {
        self.extra_head = head.to_owned();
        self.rewrite(body);
    }

    /// Writes raw text as the edge config.
    pub fn write_raw_config(&self, text: &str) {
        std::fs::write(&self.edge_config, text).expect("rewrite config");
    }

    /// The node config text: the Edge pinned by its fingerprint (or a plaintext link).
    #[must_use]
    pub fn node_toml(&self, node_id: &str, token: &str, reconnect: &str) -> String {
        let (pin, plaintext) = match &self.fingerprint {
            Some(fp) => (format!("edge_cert_sha256 = \"{fp}\"\n"), ""),
            None => (String::new(), "\n[edge_tls]\nplaintext = true\n"),
        };
        format!(
            "node_id = \"{node_id}\"\nedge_addr = \"127.0.0.1:{}\"\ntoken = \"{token}\"\n{pin}\n[reconnect]\n{reconnect}\n\n[timeouts]\nconnect_sec = 1\nhandshake_sec = 3\nshutdown_grace_sec = 2\nrequest_sec = 3\n{plaintext}",
            self.node_port
        )
    }

    /// Starts a node with the default fast reconnect policy.
    pub fn node(&self, node_id: &str, token: &str) -> Proc {
        self.node_with(node_id, token, "max_attempts = 0\ninterval_sec = 0.2")
    }

    /// Starts a node with an explicit `[reconnect]` section body.
    pub fn node_with(&self, node_id: &str, token: &str, reconnect: &str) -> Proc {
        self.node_extra(node_id, token, reconnect, "")
    }

    /// Starts a node whose config ends with `extra` (e.g. a `[tls]` section).
    pub fn node_extra(&self, node_id: &str, token: &str, reconnect: &str, extra: &str) -> Proc {
        let name = format!("node-{node_id}-{}", crate::free_port());
        let text = format!("{}\n{extra}\n", self.node_toml(node_id, token, reconnect));
        let path = self.dir.write(&format!("{name}.toml"), &text);
        let path = path.to_string_lossy().into_owned();
        Proc::start("iop-node", &["--config", &path], &self.dir, &name, &[])
    }

    /// Issues a node client certificate for `name` from the cluster's `nodes-ca.pem`
    /// ([`Link::MutualTls`]); returns the `[edge_tls]` lines that use it.
    #[must_use]
    pub fn node_cert(&self, name: &str) -> String {
        let stem = format!("node-{name}-cert");
        let ca = self.dir.path().join("nodes-ca.pem");
        let ca_key = self.dir.path().join("nodes-ca-key.pem");
        gen_cert(
            &self.dir,
            &stem,
            &[name],
            &[
                "--ca-cert",
                &ca.to_string_lossy(),
                "--ca-key",
                &ca_key.to_string_lossy(),
            ],
        );
        format!("[edge_tls]\ncert_file = \"{stem}.pem\"\nkey_file = \"{stem}-key.pem\"\n")
    }

    /// A client for the public API.
    #[must_use]
    pub fn http(&self) -> Http {
        Http::new(self.http_port)
    }

    /// A client for the operator routes: with the admin key when the cluster has one.
    #[must_use]
    pub fn admin(&self) -> Http {
        match &self.admin_key {
            Some(key) => self.http().with_key(key),
            None => self.http(),
        }
    }

    /// Waits until `node_id` is ready.
    pub async fn wait_ready(&self, node_id: &str) {
        self.wait_node(node_id, true).await;
    }

    /// Waits until `node_id`'s connected flag equals `connected`.
    pub async fn wait_node(&self, node_id: &str, connected: bool) {
        let http = self.admin();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while tokio::time::Instant::now() < deadline {
            let status = http.status().await;
            let found = status["nodes"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|n| n["node_id"] == node_id && n["connected"] == connected);
            if found {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!(
            "node {node_id} never reached connected={connected}\nedge log:\n{}",
            self.edge.log()
        );
    }

    /// The lifecycle events the Edge still keeps, from the start (`Last-Event-ID: 0`).
    pub async fn kept_events(&self) -> Vec<Value> {
        let mut stream = self
            .admin()
            .with_header("last-event-id", "0")
            .get_stream("/v1/events")
            .await;
        let (events, _) = read_sse(stream.body_mut(), Duration::from_secs(1)).await;
        events
            .iter()
            .filter_map(|e| serde_json::from_str(e).ok())
            .collect()
    }

    /// The provider snapshot of `node_id/provider`.
    pub async fn provider(&self, node_id: &str, provider: &str) -> Value {
        let status = self.admin().status().await;
        status["providers"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["node_id"] == node_id && p["provider_id"] == provider)
            .cloned()
            .unwrap_or(Value::Null)
    }
}

/// A TLS client that trusts exactly the certificate(s) in `pem` (an Edge's self-signed
/// `edge-cert.pem`), as a node pinning it would.
#[must_use]
pub fn connector_trusting(pem: &std::path::Path) -> tokio_rustls::TlsConnector {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::CertificateDer::pem_file_iter(pem).expect("pem") {
        roots.add(cert.expect("cert")).expect("root");
    }
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
}
