//! Fake providers for tests and benchmarks: local hyper servers that impersonate an
//! OpenAI-compatible server (also vLLM's `/health`) and Ollama, record what they receive,
//! and can stream slowly, hang, fail, reject `tools`, or return native tool calls. They
//! count responses whose client went away before the end ("aborted"), which is how tests
//! see that a cancel reached the upstream request.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// Which API the fake speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// OpenAI-compatible (`/v1/...`, `/health`).
    OpenAi,
    /// Ollama (`/api/...`).
    Ollama,
}

/// How the fake behaves; changeable while it runs.
#[derive(Clone, Debug)]
pub struct Behaviour {
    /// Words streamed (or returned whole).
    pub words: usize,
    /// Delay before each streamed word.
    pub delay: Duration,
    /// Never answer.
    pub hang: bool,
    /// Answer every request with this status and an error body.
    pub status: Option<u16>,
    /// With `status`, a `Retry-After` of this many seconds.
    pub retry_after: Option<u64>,
    /// Answer 400 naming `tools` when a request carries tools.
    pub reject_tools: bool,
    /// Answer requests that carry tools with a native tool call.
    pub tool_calls: bool,
    /// How long a whole (non-streamed) answer takes.
    pub whole_delay: Duration,
}

impl Default for Behaviour {
    fn default() -> Self {
        Behaviour {
            words: 3,
            delay: Duration::from_millis(5),
            hang: false,
            status: None,
            retry_after: None,
            reject_tools: false,
            tool_calls: false,
            whole_delay: Duration::ZERO,
        }
    }
}

/// One request the fake received.
#[derive(Clone, Debug)]
pub struct Recorded {
    /// Method.
    pub method: String,
    /// Path.
    pub path: String,
    /// Headers (lower-case names).
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: Bytes,
}

/// Shared state of a running fake.
#[derive(Debug, Default)]
pub struct State {
    /// Current behaviour.
    pub behaviour: Mutex<Behaviour>,
    /// Requests received.
    pub requests: Mutex<Vec<Recorded>>,
    /// Responses whose client went away before the end.
    pub aborted: AtomicUsize,
    /// Responses sent to the end.
    pub completed: AtomicUsize,
    /// Requests being answered now (a streamed one until its last chunk).
    pub in_flight: AtomicUsize,
    /// The most requests ever answered at once.
    pub max_in_flight: AtomicUsize,
    /// The last comings and goings (at most [`TRAIL`]), and a copy taken whenever
    /// `max_in_flight` rose: what led to the most at once, for a test that finds too many.
    trail: Mutex<std::collections::VecDeque<String>>,
    /// The trail when `max_in_flight` last rose.
    pub at_most: Mutex<Vec<String>>,
}

/// Comings and goings kept in [`State::at_most`].
const TRAIL: usize = 32;

/// Counts one request as being answered while it lives.
struct Busy(Arc<State>);

impl Busy {
    fn enter(state: &Arc<State>, what: &str) -> Busy {
        let mut trail = state.trail.lock().unwrap_or_else(|e| e.into_inner());
        let now = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        trail.push_back(format!("{:?} +{what} = {now}", std::time::Instant::now()));
        if trail.len() > TRAIL {
            trail.pop_front();
        }
        if state.max_in_flight.fetch_max(now, Ordering::SeqCst) < now {
            *state.at_most.lock().unwrap_or_else(|e| e.into_inner()) =
                trail.iter().cloned().collect();
        }
        Busy(state.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut trail = self.0.trail.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.0.in_flight.fetch_sub(1, Ordering::SeqCst) - 1;
        trail.push_back(format!("{:?} - = {now}", std::time::Instant::now()));
        if trail.len() > TRAIL {
            trail.pop_front();
        }
    }
}

impl State {
    /// Changes the behaviour.
    pub fn set(&self, f: impl FnOnce(&mut Behaviour)) {
        if let Ok(mut b) = self.behaviour.lock() {
            f(&mut b);
        }
    }

    /// Requests received so far.
    #[must_use]
    pub fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Responses aborted by their client.
    #[must_use]
    pub fn aborted(&self) -> usize {
        self.aborted.load(Ordering::SeqCst)
    }
}

/// A running fake provider.
#[derive(Debug, Clone)]
pub struct Fake {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its state.
    pub state: Arc<State>,
}

impl Fake {
    /// Its base URL.
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// A body fed through a channel; it counts whether the client read it to the end.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

type Res = Response<http_body_util::Either<http_body_util::Full<Bytes>, ChannelBody>>;

/// Headers an upstream (OpenAI, a LiteLLM proxy) adds that say how it is run: every
/// fake response carries them, and none may reach a caller through the Edge.
pub const LEAKY_HEADERS: [(&str, &str); 6] = [
    ("openai-organization", "org-fake-leak"),
    ("openai-project", "proj_fake_leak"),
    ("openai-processing-ms", "12"),
    ("x-litellm-model-api-base", "http://internal-gpu-17:8000"),
    ("x-ratelimit-remaining-tokens", "149984"),
    ("set-cookie", "__cf_bm=fake-leak; path=/"),
];

/// Headers an upstream adds that a caller may see.
pub const KEPT_HEADERS: [(&str, &str); 1] = [("x-request-id", "req-fake-upstream")];

fn upstream_headers(mut builder: http::response::Builder) -> http::response::Builder {
    for (name, value) in LEAKY_HEADERS.iter().chain(&KEPT_HEADERS) {
        builder = builder.header(*name, *value);
    }
    builder
}

fn whole(status: u16, content_type: &str, body: impl Into<Bytes>) -> Res {
    upstream_headers(Response::builder())
        .status(status)
        .header("content-type", content_type)
        .body(http_body_util::Either::Left(http_body_util::Full::new(
            body.into(),
        )))
        .expect("valid response")
}

/// Streams `chunks`, one per `delay`; counts completion or abort.
fn streamed(state: Arc<State>, content_type: &str, chunks: Vec<Bytes>, delay: Duration) -> Res {
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(async move {
        let _busy = Busy::enter(&state, "stream");
        for chunk in chunks {
            // A zero sleep still waits for the next timer tick (about 1 ms). A client
            // that leaves meanwhile is noticed at once, as a server whose connection
            // closes does: its request no longer counts as in flight.
            if !delay.is_zero() {
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = tx.closed() => {
                        state.aborted.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                }
            }
            if tx.send(chunk).await.is_err() {
                state.aborted.fetch_add(1, Ordering::SeqCst);
                return;
            }
        }
        // Dropping the sender ends the body.
        state.completed.fetch_add(1, Ordering::SeqCst);
    });
    upstream_headers(Response::builder())
        .status(200)
        .header("content-type", content_type)
        .body(http_body_util::Either::Right(ChannelBody(rx)))
        .expect("valid response")
}

/// Counts an abort when a hanging request's future is dropped.
struct HangGuard(Arc<State>);

impl Drop for HangGuard {
    fn drop(&mut self) {
        self.0.aborted.fetch_add(1, Ordering::SeqCst);
    }
}

/// A private CA and a `localhost` server certificate it signed, for TLS fakes.
#[derive(Debug)]
pub struct TestPki {
    /// The CA certificate, PEM (what a node trusts through `tls.ca_file`).
    pub ca_pem: String,
    server: Arc<rustls::ServerConfig>,
}

/// Generates a fresh CA and a server certificate for `localhost`.
#[must_use]
pub fn test_pki() -> TestPki {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca =
        CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("key")).expect("ca");
    let key = KeyPair::generate().expect("key");
    let cert = CertificateParams::new(vec!["localhost".to_owned()])
        .expect("params")
        .signed_by(&key, &ca)
        .expect("signed");
    let key_der = rustls_pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
    let server = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_no_client_auth()
    .with_single_cert(vec![cert.der().clone()], key_der)
    .expect("server config");
    TestPki {
        ca_pem: ca.pem(),
        server: Arc::new(server),
    }
}

/// Starts a fake on a free loopback port.
pub async fn start(flavor: Flavor, behaviour: Behaviour) -> Fake {
    start_with(flavor, behaviour, None).await
}

/// Starts a fake that speaks HTTPS with `pki`'s server certificate.
pub async fn start_tls(flavor: Flavor, behaviour: Behaviour, pki: &TestPki) -> Fake {
    start_with(flavor, behaviour, Some(pki.server.clone())).await
}

async fn start_with(
    flavor: Flavor,
    behaviour: Behaviour,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> Fake {
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let state = Arc::new(State {
        behaviour: Mutex::new(behaviour),
        ..State::default()
    });
    let server_state = state.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let _ = stream.set_nodelay(true);
            let state = server_state.clone();
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let state = state.clone();
                    async move { Ok::<_, Infallible>(handle(flavor, req, state).await) }
                });
                let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                match acceptor {
                    None => {
                        let _ = builder
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    }
                    Some(acceptor) => {
                        if let Ok(tls) = acceptor.accept(stream).await {
                            let _ = builder.serve_connection(TokioIo::new(tls), service).await;
                        }
                    }
                }
            });
        }
    });
    Fake { addr, state }
}

async fn handle(flavor: Flavor, req: Request<Incoming>, state: Arc<State>) -> Res {
    let method = req.method().to_string();
    let path = req.uri().path().to_owned();
    let headers = req
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
        .collect();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    if let Ok(mut requests) = state.requests.lock() {
        requests.push(Recorded {
            method: method.clone(),
            path: path.clone(),
            headers,
            body: body.clone(),
        });
    }
    let behaviour = state
        .behaviour
        .lock()
        .map(|b| b.clone())
        .unwrap_or_default();
    if behaviour.hang {
        let _guard = HangGuard(state.clone());
        std::future::pending::<()>().await;
    }
    if let Some(status) = behaviour.status {
        let mut response = whole(
            status,
            "application/json",
            json!({"error": {"message": format!("fake failure {status}"), "type": "fake"}})
                .to_string(),
        );
        if let Some(seconds) = behaviour.retry_after {
            response.headers_mut().insert(
                "retry-after",
                http::HeaderValue::from_str(&seconds.to_string()).expect("digits"),
            );
        }
        return response;
    }
    let request: Value = serde_json::from_slice(&body).unwrap_or_default();
    let _busy = (request.get("stream").and_then(Value::as_bool) != Some(true))
        .then(|| Busy::enter(&state, &format!("{method} {path}")));
    if !behaviour.whole_delay.is_zero()
        && request.get("stream").and_then(Value::as_bool) != Some(true)
    {
        tokio::time::sleep(behaviour.whole_delay).await;
    }
    let has_tools = request
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    if has_tools && behaviour.reject_tools {
        return whole(400, "application/json", json!({"error": {"message": "this backend does not support tools", "type": "invalid_request_error"}}).to_string());
    }
    let model = request
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    match (flavor, method.as_str(), path.as_str()) {
        (Flavor::OpenAi, "GET", "/health") => whole(200, "text/plain", ""),
        (Flavor::OpenAi, "GET", "/v1/models") => whole(200, "application/json", json!({"object": "list", "data": [{"id": "gpt-x", "object": "model"}]}).to_string()),
        (Flavor::OpenAi, "POST", "/v1/chat/completions") => openai_chat(&state, &behaviour, &request, &model, has_tools),
        (Flavor::OpenAi, "POST", "/v1/completions") => whole(
            200,
            "application/json",
            json!({"id": "cmpl-1", "object": "text_completion", "model": model, "choices": [{"index": 0, "text": "fake completion", "finish_reason": "stop"}], "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}}).to_string(),
        ),
        (Flavor::OpenAi, "POST", "/v1/embeddings") => whole(
            200,
            "application/json",
            json!({"object": "list", "model": model, "data": [{"object": "embedding", "index": 0, "embedding": [0.25, -0.5, 1.0]}], "usage": {"prompt_tokens": 2, "total_tokens": 2}}).to_string(),
        ),
        (Flavor::Ollama, "POST", "/api/chat") => ollama_chat(&state, &behaviour, &model, has_tools),
        (Flavor::Ollama, "GET", "/api/tags") => whole(200, "application/json", json!({"models": [{"name": "llama3:8b"}]}).to_string()),
        (Flavor::Ollama, "GET", "/api/version") => whole(200, "application/json", json!({"version": "0.0.0-fake"}).to_string()),
        _ => whole(404, "application/json", json!({"error": {"message": format!("no route {method} {path}")}}).to_string()),
    }
}

fn words(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("w{i} ")).collect()
}

fn openai_chat(
    state: &Arc<State>,
    b: &Behaviour,
    request: &Value,
    model: &str,
    has_tools: bool,
) -> Res {
    let stream = request.get("stream").and_then(Value::as_bool) == Some(true);
    // A model that received the text tool-call instruction answers with a text tool call.
    let instructed = request
        .pointer("/messages/0/content")
        .and_then(Value::as_str)
        .is_some_and(|c| c.contains("To call tools"));
    let text: String = if instructed {
        json!({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Seoul"}}]}).to_string()
    } else {
        words(b.words).concat()
    };
    let usage =
        json!({"prompt_tokens": 7, "completion_tokens": b.words, "total_tokens": 7 + b.words});
    let calls = json!([{"id": "call_fake", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Seoul\"}"}}]);
    if !stream {
        let message = if has_tools && b.tool_calls {
            json!({"role": "assistant", "content": null, "tool_calls": calls})
        } else {
            json!({"role": "assistant", "content": text})
        };
        return whole(
            200,
            "application/json",
            json!({"id": "chatcmpl-fake", "object": "chat.completion", "created": 1, "model": model, "choices": [{"index": 0, "message": message, "finish_reason": "stop"}], "usage": usage}).to_string(),
        );
    }
    let chunk = |delta: Value, finish: Value| {
        Bytes::from(format!(
            "data: {}\n\n",
            json!({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        ))
    };
    let mut chunks = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    if has_tools && b.tool_calls {
        chunks.push(chunk(json!({"tool_calls": [{"index": 0, "id": "call_fake", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":"}}]}), Value::Null));
        chunks.push(chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"Seoul\"}"}}]}),
            Value::Null,
        ));
    } else if instructed {
        chunks.push(chunk(json!({"content": text}), Value::Null));
    } else {
        for word in words(b.words) {
            chunks.push(chunk(json!({"content": word}), Value::Null));
        }
    }
    chunks.push(chunk(json!({}), json!("stop")));
    chunks.push(Bytes::from(format!(
        "data: {}\n\n",
        json!({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": model, "choices": [], "usage": usage})
    )));
    chunks.push(Bytes::from_static(b"data: [DONE]\n\n"));
    streamed(state.clone(), "text/event-stream", chunks, b.delay)
}

fn ollama_chat(state: &Arc<State>, b: &Behaviour, model: &str, has_tools: bool) -> Res {
    let mut lines = Vec::new();
    if has_tools && b.tool_calls {
        lines.push(json!({"model": model, "message": {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Seoul"}}}]}, "done": false}));
    } else {
        for word in words(b.words) {
            lines.push(json!({"model": model, "message": {"role": "assistant", "content": word}, "done": false}));
        }
    }
    lines.push(json!({"model": model, "message": {"role": "assistant", "content": ""}, "done": true, "prompt_eval_count": 5, "eval_count": b.words}));
    let chunks = lines
        .into_iter()
        .map(|l| Bytes::from(format!("{l}\n")))
        .collect();
    streamed(state.clone(), "application/x-ndjson", chunks, b.delay)
}
