//! The etcd calls a cluster member makes, through etcd's v3 JSON gateway (`POST /v3/...`
//! on the client port, served by every etcd since 3.4: the same API as gRPC, with
//! base64 keys and values and 64-bit numbers as strings).
//!
//! The gateway keeps gRPC, tonic and a `protoc` at build time out of the Edge: cluster
//! mode is in every binary and the single-Edge quickstart needs nothing new. Every call
//! has a deadline, every answer a size bound (etcd is trusted less than the Edge's own
//! state: a broken or hostile endpoint costs a failed call, never unbounded memory), and
//! endpoints are tried in turn, the last one that answered first.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use bytes::{Buf, Bytes, BytesMut};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use iop_proto_core::cluster::{EtcdRequest, KeyValue, LeaseId, Reply, WatchEvent};
use serde_json::{Value, json};

use crate::config::ClusterSettings;

/// Largest answer read from etcd (a range of the cluster's prefix, one watch message).
const MAX_ANSWER: usize = 16 << 20;

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Why a call to etcd failed.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// No endpoint answered in time.
    #[error("etcd unreachable: {0}")]
    Unreachable(String),
    /// etcd answered with an error.
    #[error("etcd refused: {0}")]
    Refused(String),
    /// The answer was not what the API promises.
    #[error("etcd answered something unreadable: {0}")]
    Malformed(String),
}

/// An etcd client over the JSON gateway.
pub struct Etcd {
    endpoints: Vec<String>,
    /// The endpoint tried first: the last one that answered.
    first: AtomicUsize,
    client: HttpsClient,
    credentials: Option<(String, String)>,
    token: Mutex<Option<String>>,
    timeout: Duration,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd")
            .field("endpoints", &self.endpoints)
            .field("user", &self.credentials.as_ref().map(|(user, _)| user))
            .finish_non_exhaustive()
    }
}

/// Decodes a base64 field of an answer.
fn bytes_of(value: &Value) -> Result<Vec<u8>, EtcdError> {
    match value.as_str() {
        None => Ok(Vec::new()),
        Some(text) => B64
            .decode(text)
            .map_err(|err| EtcdError::Malformed(format!("base64: {err}"))),
    }
}

/// A 64-bit number of an answer (a string in the gateway's JSON; absent is 0).
fn number(value: &Value) -> i64 {
    match value {
        Value::String(text) => text.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

fn revision(answer: &Value) -> u64 {
    u64::try_from(number(&answer["header"]["revision"])).unwrap_or(0)
}

fn key_value(kv: &Value) -> Result<Option<KeyValue>, EtcdError> {
    let Ok(key) = String::from_utf8(bytes_of(&kv["key"])?) else {
        // Not one of ours: every key IOP writes is text.
        return Ok(None);
    };
    Ok(Some(KeyValue {
        key,
        value: bytes_of(&kv["value"])?,
        create_revision: u64::try_from(number(&kv["create_revision"])).unwrap_or(0),
        mod_revision: u64::try_from(number(&kv["mod_revision"])).unwrap_or(0),
        lease: number(&kv["lease"]),
    }))
}

/// The end of the range of every key starting with `prefix` (etcd's `range_end`).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn ttl_of(answer: &Value) -> Duration {
    Duration::from_secs(u64::try_from(number(&answer["TTL"])).unwrap_or(0))
}

impl Etcd {
    /// A client for `settings`' endpoints; fails on unusable TLS files.
    pub fn new(settings: &ClusterSettings) -> Result<Self, String> {
        let roots = match &settings.ca_file {
            Some(path) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in iop_shell_common::tls::read_certs("cluster.ca_file", path)
                    .map_err(|err| err.to_string())?
                {
                    roots
                        .add(cert)
                        .map_err(|err| format!("cluster.ca_file: {err}"))?;
                }
                roots
            }
            None => rustls::RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            },
        };
        let builder =
            rustls::ClientConfig::builder_with_provider(iop_shell_common::tls::provider())
                .with_safe_default_protocol_versions()
                .map_err(|err| err.to_string())?
                .with_root_certificates(roots);
        let tls = match (&settings.cert_file, &settings.key_file) {
            (Some(cert), Some(key)) => builder
                .with_client_auth_cert(
                    iop_shell_common::tls::read_certs("cluster.cert_file", cert)
                        .map_err(|err| err.to_string())?,
                    iop_shell_common::tls::read_key("cluster.key_file", key)
                        .map_err(|err| err.to_string())?,
                )
                .map_err(|err| format!("cluster.cert_file: {err}"))?,
            _ => builder.with_no_client_auth(),
        };
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .build();
        Ok(Etcd {
            endpoints: settings
                .endpoints
                .iter()
                .map(|e| e.trim_end_matches('/').to_owned())
                .collect(),
            first: AtomicUsize::new(0),
            client: Client::builder(TokioExecutor::new()).build(https),
            credentials: settings
                .username
                .clone()
                .map(|user| (user, settings.password.clone().unwrap_or_default())),
            token: Mutex::new(None),
            timeout: settings.request_timeout,
        })
    }

    fn token(&self) -> Option<String> {
        self.token.lock().ok().and_then(|t| t.clone())
    }

    fn set_token(&self, token: Option<String>) {
        if let Ok(mut slot) = self.token.lock() {
            *slot = token;
        }
    }

    /// One POST to one endpoint, under the deadline: the answer, or why not.
    async fn post_to(
        &self,
        base: &str,
        path: &str,
        body: &Value,
        token: Option<&str>,
    ) -> Result<Value, EtcdError> {
        let mut request = http::Request::post(format!("{base}{path}"))
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(token) = token {
            request = request.header(http::header::AUTHORIZATION, token);
        }
        let request = request
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|err| EtcdError::Unreachable(err.to_string()))?;
        let call = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|err| EtcdError::Unreachable(format!("{base}: {err}")))?;
            let status = response.status();
            let bytes = Limited::new(response.into_body(), MAX_ANSWER)
                .collect()
                .await
                .map_err(|err| EtcdError::Unreachable(format!("{base}: {err}")))?
                .to_bytes();
            let answer: Value = serde_json::from_slice(&bytes)
                .map_err(|err| EtcdError::Malformed(format!("{base}{path}: {err}")))?;
            if !status.is_success() || answer.get("error").is_some() {
                let message = answer["message"]
                    .as_str()
                    .or_else(|| answer["error"].as_str())
                    .unwrap_or("no reason given");
                return Err(EtcdError::Refused(format!("{status}: {message}")));
            }
            Ok(answer)
        };
        tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| EtcdError::Unreachable(format!("{base}: no answer in time")))?
    }

    /// POSTs `body` to `path`, trying each endpoint once (the last that answered first),
    /// authenticating first when credentials are set and again once if the token was
    /// refused.
    async fn post(&self, path: &str, body: &Value) -> Result<Value, EtcdError> {
        let n = self.endpoints.len().max(1);
        let start = self.first.load(Ordering::Relaxed);
        let mut last = EtcdError::Unreachable("no endpoint configured".into());
        for k in 0..n {
            let i = (start + k) % n;
            let Some(base) = self.endpoints.get(i) else {
                break;
            };
            match self.post_authenticated(base, path, body).await {
                Ok(answer) => {
                    self.first.store(i, Ordering::Relaxed);
                    return Ok(answer);
                }
                // etcd decided: another endpoint would say the same.
                Err(err @ (EtcdError::Refused(_) | EtcdError::Malformed(_))) => return Err(err),
                Err(err) => last = err,
            }
        }
        Err(last)
    }

    async fn post_authenticated(
        &self,
        base: &str,
        path: &str,
        body: &Value,
    ) -> Result<Value, EtcdError> {
        let Some((user, password)) = &self.credentials else {
            return self.post_to(base, path, body, None).await;
        };
        for fresh in [false, true] {
            let token = match self.token() {
                Some(token) if !fresh => token,
                _ => {
                    let answer = self
                        .post_to(
                            base,
                            "/v3/auth/authenticate",
                            &json!({ "name": user, "password": password }),
                            None,
                        )
                        .await?;
                    let token = answer["token"]
                        .as_str()
                        .ok_or_else(|| EtcdError::Malformed("authenticate: no token".into()))?
                        .to_owned();
                    self.set_token(Some(token.clone()));
                    token
                }
            };
            match self.post_to(base, path, body, Some(&token)).await {
                Err(EtcdError::Refused(reason)) if !fresh && reason.contains("token") => {
                    self.set_token(None);
                }
                other => return other,
            }
        }
        Err(EtcdError::Refused("authentication refused".into()))
    }

    /// Grants a lease of `ttl`.
    pub async fn grant(&self, ttl: Duration) -> Result<(LeaseId, Duration), EtcdError> {
        let answer = self
            .post("/v3/lease/grant", &json!({ "TTL": ttl.as_secs().max(1) }))
            .await?;
        let lease = number(&answer["ID"]);
        if lease == 0 {
            return Err(EtcdError::Malformed("lease grant without an ID".into()));
        }
        Ok((lease, ttl_of(&answer)))
    }

    /// Renews `lease` once; zero when it no longer exists.
    pub async fn keep_alive(&self, lease: LeaseId) -> Result<Duration, EtcdError> {
        let answer = self
            .post("/v3/lease/keepalive", &json!({ "ID": lease.to_string() }))
            .await?;
        Ok(ttl_of(&answer["result"]))
    }

    /// Puts `value` at `key`, attached to `lease` (0: none); the store's revision after.
    pub async fn put(&self, key: &str, value: &[u8], lease: LeaseId) -> Result<u64, EtcdError> {
        let answer = self
            .post(
                "/v3/kv/put",
                &json!({
                    "key": B64.encode(key),
                    "value": B64.encode(value),
                    "lease": lease.to_string(),
                }),
            )
            .await?;
        Ok(revision(&answer))
    }

    /// Puts `value` at `key` only if its mod revision is still `expected` (0: only if
    /// absent): the new revision, or `None` when someone wrote it meanwhile.
    pub async fn put_if(
        &self,
        key: &str,
        value: &[u8],
        expected: u64,
    ) -> Result<Option<u64>, EtcdError> {
        let compare = if expected == 0 {
            json!({ "key": B64.encode(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0" })
        } else {
            json!({ "key": B64.encode(key), "target": "MOD", "result": "EQUAL", "mod_revision": expected.to_string() })
        };
        let answer = self
            .post(
                "/v3/kv/txn",
                &json!({
                    "compare": [compare],
                    "success": [{ "request_put": { "key": B64.encode(key), "value": B64.encode(value) } }],
                }),
            )
            .await?;
        Ok(answer["succeeded"]
            .as_bool()
            .unwrap_or(false)
            .then(|| revision(&answer)))
    }

    /// Every key starting with `prefix`, and the store's revision the read saw.
    pub async fn range(&self, prefix: &str) -> Result<(u64, Vec<KeyValue>), EtcdError> {
        let answer = self
            .post(
                "/v3/kv/range",
                &json!({ "key": B64.encode(prefix), "range_end": B64.encode(prefix_end(prefix)) }),
            )
            .await?;
        let mut kvs = Vec::new();
        for kv in answer["kvs"].as_array().map_or(&[][..], Vec::as_slice) {
            if let Some(kv) = key_value(kv)? {
                kvs.push(kv);
            }
        }
        Ok((revision(&answer), kvs))
    }

    /// One key, if it exists, and the store's revision.
    pub async fn get(&self, key: &str) -> Result<(u64, Option<KeyValue>), EtcdError> {
        let answer = self
            .post("/v3/kv/range", &json!({ "key": B64.encode(key) }))
            .await?;
        let kv = match answer["kvs"].as_array().and_then(|kvs| kvs.first()) {
            Some(kv) => key_value(kv)?,
            None => None,
        };
        Ok((revision(&answer), kv))
    }

    /// Claims `key` for `value` on a new lease of `ttl` (docs/cluster.md): the key as it
    /// is after the transaction, and whether this claim created it. A lease left unused
    /// is revoked.
    pub async fn claim(
        &self,
        key: &str,
        value: &[u8],
        ttl: Duration,
    ) -> Result<(KeyValue, bool), EtcdError> {
        let (lease, _) = self.grant(ttl).await?;
        let k = B64.encode(key);
        let answer = self
            .post(
                "/v3/kv/txn",
                &json!({
                    "compare": [{ "key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0" }],
                    "success": [{ "request_put": { "key": k, "value": B64.encode(value), "lease": lease.to_string() } }],
                    "failure": [{ "request_range": { "key": k } }],
                }),
            )
            .await;
        let answer = match answer {
            Ok(answer) => answer,
            Err(err) => {
                let _ = self.revoke(lease).await;
                return Err(err);
            }
        };
        if answer["succeeded"].as_bool().unwrap_or(false) {
            let at = revision(&answer);
            return Ok((
                KeyValue {
                    key: key.to_owned(),
                    value: value.to_vec(),
                    create_revision: at,
                    mod_revision: at,
                    lease,
                },
                true,
            ));
        }
        let _ = self.revoke(lease).await;
        let holder = answer["responses"][0]["response_range"]["kvs"][0].clone();
        match key_value(&holder)? {
            Some(kv) => Ok((kv, false)),
            // Gone between the compare and the read: a claim again will decide.
            None => Err(EtcdError::Refused("the key went while it was read".into())),
        }
    }

    /// Revokes `lease` (its keys go with it).
    pub async fn revoke(&self, lease: LeaseId) -> Result<(), EtcdError> {
        self.post("/v3/lease/revoke", &json!({ "ID": lease.to_string() }))
            .await
            .map(drop)
    }

    /// What the member asked for, as its [`Reply`] (a failure is [`Reply::Failed`]).
    pub async fn perform(&self, request: EtcdRequest) -> Reply {
        let result = match request {
            EtcdRequest::Grant { ttl } => self
                .grant(ttl)
                .await
                .map(|(lease, ttl)| Reply::Granted { lease, ttl }),
            EtcdRequest::KeepAlive { lease } => self
                .keep_alive(lease)
                .await
                .map(|ttl| Reply::KeptAlive { ttl }),
            EtcdRequest::Put { key, value, lease } => self
                .put(&key, &value, lease)
                .await
                .map(|revision| Reply::Put { revision }),
            EtcdRequest::Claim { key, value, ttl } => self
                .claim(&key, &value, ttl)
                .await
                .map(|(holder, created)| Reply::Claimed { holder, created }),
            EtcdRequest::Sync { prefix } => self
                .range(&prefix)
                .await
                .map(|(revision, kvs)| Reply::Synced { revision, kvs }),
        };
        result.unwrap_or_else(|err| {
            tracing::debug!(error = %err, "etcd request failed");
            Reply::Failed
        })
    }

    /// Watches every key starting with `prefix` from `start` on, handing each delivery's
    /// changes to `deliver` in revision order, until the watch breaks (returned as an
    /// error: the caller reads the prefix again and watches on).
    pub async fn watch(
        &self,
        prefix: &str,
        start: u64,
        mut deliver: impl FnMut(Vec<WatchEvent>),
    ) -> EtcdError {
        let n = self.endpoints.len().max(1);
        let base = match self.endpoints.get(self.first.load(Ordering::Relaxed) % n) {
            Some(base) => base.clone(),
            None => return EtcdError::Unreachable("no endpoint configured".into()),
        };
        let body = json!({ "create_request": {
            "key": B64.encode(prefix),
            "range_end": B64.encode(prefix_end(prefix)),
            "start_revision": start.to_string(),
        }});
        let mut request = http::Request::post(format!("{base}/v3/watch"))
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(token) = self.token() {
            request = request.header(http::header::AUTHORIZATION, token);
        }
        let request = match request.body(Full::new(Bytes::from(body.to_string()))) {
            Ok(request) => request,
            Err(err) => return EtcdError::Unreachable(err.to_string()),
        };
        let response = match tokio::time::timeout(self.timeout, self.client.request(request)).await
        {
            Ok(Ok(response)) if response.status().is_success() => response,
            Ok(Ok(response)) => {
                // An expired token: the next request authenticates afresh.
                self.set_token(None);
                return EtcdError::Refused(format!("watch: {}", response.status()));
            }
            Ok(Err(err)) => return EtcdError::Unreachable(format!("{base}: {err}")),
            Err(_) => return EtcdError::Unreachable(format!("{base}: watch not answered in time")),
        };
        let mut body = response.into_body();
        let mut buf = BytesMut::new();
        loop {
            let frame = match body.frame().await {
                Some(Ok(frame)) => frame,
                Some(Err(err)) => return EtcdError::Unreachable(format!("watch: {err}")),
                None => return EtcdError::Unreachable("watch ended".into()),
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            buf.extend_from_slice(&data);
            if buf.len() > MAX_ANSWER {
                return EtcdError::Malformed("a watch message beyond 16 MiB".into());
            }
            let mut stream = serde_json::Deserializer::from_slice(&buf).into_iter::<Value>();
            let mut used = 0;
            loop {
                match stream.next() {
                    Some(Ok(message)) => {
                        used = stream.byte_offset();
                        let result = &message["result"];
                        if message.get("error").is_some()
                            || result["canceled"].as_bool() == Some(true)
                        {
                            return EtcdError::Refused(format!("watch cancelled: {message}"));
                        }
                        if number(&result["compact_revision"]) != 0 {
                            return EtcdError::Refused("watch compacted".into());
                        }
                        let mut events = Vec::new();
                        for event in result["events"].as_array().map_or(&[][..], Vec::as_slice) {
                            let kv = &event["kv"];
                            if event["type"].as_str() == Some("DELETE") {
                                let Ok(key) = String::from_utf8(match bytes_of(&kv["key"]) {
                                    Ok(key) => key,
                                    Err(err) => return err,
                                }) else {
                                    continue;
                                };
                                events.push(WatchEvent::Delete {
                                    key,
                                    revision: u64::try_from(number(&kv["mod_revision"]))
                                        .unwrap_or(0),
                                });
                            } else {
                                match key_value(kv) {
                                    Ok(Some(kv)) => events.push(WatchEvent::Put(kv)),
                                    Ok(None) => {}
                                    Err(err) => return err,
                                }
                            }
                        }
                        if !events.is_empty() {
                            deliver(events);
                        }
                    }
                    Some(Err(err)) if err.is_eof() => break,
                    Some(Err(err)) => return EtcdError::Malformed(format!("watch: {err}")),
                    None => break,
                }
            }
            buf.advance(used);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_range_ends_past_every_key_under_it() {
        assert_eq!(prefix_end("/iop/"), b"/iop0".to_vec());
        assert_eq!(prefix_end("ab"), b"ac".to_vec());
    }

    #[test]
    fn numbers_come_as_strings_and_absent_is_zero() {
        let kv = json!({ "key": B64.encode("/iop/nodes/a"), "value": B64.encode("7"),
            "create_revision": "12", "mod_revision": "14", "lease": "694d77aa9e38260f" });
        let kv = key_value(&kv).expect("readable").expect("a text key");
        assert_eq!(kv.key, "/iop/nodes/a");
        assert_eq!(kv.value, b"7");
        assert_eq!((kv.create_revision, kv.mod_revision), (12, 14));
        assert_eq!(kv.lease, 0, "not a decimal: unreadable, so none");
        assert!(key_value(&json!({ "key": "!!" })).is_err());
    }
}
