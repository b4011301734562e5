//! The public HTTP surface: OpenAI-compatible routes, status, metrics and health, over
//! HTTP/1.1 and h2c. Handlers talk to the core task only through messages.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use iop_proto_core::wire::{Header, ProviderTunnelFrame, RunEventType, TunnelFrameKind, Usage};
use iop_proto_core::{DispatchShape, NodeState, Outcome, RequestError, RequestId, SubmitError};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::config::HttpSettings;
use crate::core_task::{CoreMsg, Endpoint, Events, ReqEvent, Snapshot, Work};
use crate::memory::RequestMemory;
use crate::metrics::Metrics;
use crate::openai;

type Chunk = Result<Frame<Bytes>, std::io::Error>;

/// A response body: either complete, or fed by a task through a channel.
#[derive(Debug)]
pub enum ResBody {
    /// Whole body.
    Full(Option<Bytes>),
    /// Streamed body.
    Stream(mpsc::Receiver<Chunk>),
}

impl Body for ResBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Chunk>> {
        match &mut *self {
            ResBody::Full(data) => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            ResBody::Stream(rx) => rx.poll_recv(cx),
        }
    }
}

/// Shared state of the HTTP surface.
#[derive(Debug)]
pub struct State {
    /// The core task.
    pub core: mpsc::Sender<CoreMsg>,
    /// Settings; replaced on reload.
    pub settings: RwLock<Arc<HttpSettings>>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Bounds concurrent requests.
    pub permits: Arc<Semaphore>,
    /// Bounds the bytes requests hold.
    pub budget: Arc<crate::memory::Budget>,
}

impl State {
    fn settings(&self) -> Arc<HttpSettings> {
        self.settings
            .read()
            .map(|s| s.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }
}

fn json_response(status: StatusCode, body: Bytes) -> Response<ResBody> {
    let mut response = Response::new(ResBody::Full(Some(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// An OpenAI error response.
fn error(status: StatusCode, message: &str, kind: &str, code: Option<&str>) -> Response<ResBody> {
    json_response(status, openai::error_body(message, kind, code))
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Serves HTTP (and HTTPS when `tls` holds an acceptor) until `shutdown`. At most
/// `max_connections` are open at once (more wait in the kernel's backlog); accept errors
/// (such as running out of file descriptors) back off and are logged a few times per
/// interval, with a count of the rest.
pub async fn serve(
    listener: TcpListener,
    state: Arc<State>,
    tls: crate::nodes::TlsSlot,
    shutdown: CancellationToken,
) {
    let accept_errors = iop_shell_common::logging::LogLimiter::new(Duration::from_secs(10), 3);
    let connections = Arc::new(Semaphore::new(state.settings().max_connections));
    let mut backoff = Duration::from_millis(10);
    loop {
        let Ok(slot) = connections.clone().acquire_owned().await else {
            return;
        };
        let (stream, peer) = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    if let Some(suppressed) = accept_errors.allow() {
                        warn!(%err, suppressed, "http listener: accept failed");
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            },
        };
        backoff = Duration::from_millis(10);
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let acceptor = tls
            .read()
            .map_or(None, |tls| tls.clone().map(tokio_rustls::TlsAcceptor::from));
        tokio::spawn(async move {
            let _slot = slot;
            let settings = state.settings();
            match acceptor {
                None => serve_connection(stream, peer, state, &settings).await,
                Some(acceptor) => {
                    match tokio::time::timeout(
                        settings.header_read_timeout,
                        acceptor.accept(stream),
                    )
                    .await
                    {
                        Ok(Ok(stream)) => serve_connection(stream, peer, state, &settings).await,
                        Ok(Err(err)) => debug!(%peer, %err, "https handshake failed"),
                        Err(_) => debug!(%peer, "https handshake timed out"),
                    }
                }
            }
        });
    }
}

/// What a connection's watchdog knows: requests in progress (their responses included)
/// and when the last one ended.
#[derive(Debug)]
struct Activity {
    active: AtomicUsize,
    served: AtomicUsize,
    last_end: std::sync::Mutex<Instant>,
}

/// Counts a request as in progress until its response body is done or dropped.
#[derive(Debug)]
struct Active(Arc<Activity>);

impl Active {
    fn start(activity: &Arc<Activity>) -> Self {
        activity.active.fetch_add(1, Ordering::AcqRel);
        activity.served.fetch_add(1, Ordering::AcqRel);
        Active(activity.clone())
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        if let Ok(mut last) = self.0.last_end.lock() {
            *last = Instant::now();
        }
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted as active.
struct Tracked {
    body: ResBody,
    _active: Active,
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Chunk>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }
}

async fn serve_connection<S>(
    stream: S,
    peer: std::net::SocketAddr,
    state: Arc<State>,
    settings: &HttpSettings,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let activity = Arc::new(Activity {
        active: AtomicUsize::new(0),
        served: AtomicUsize::new(0),
        last_end: std::sync::Mutex::new(Instant::now()),
    });
    let tracked = activity.clone();
    let service = service_fn(move |req| {
        let state = state.clone();
        let active = Active::start(&tracked);
        async move {
            let response = route(req, state, peer).await;
            Ok::<_, Infallible>(response.map(|body| Tracked {
                body,
                _active: active,
            }))
        }
    });
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(settings.header_read_timeout)
        .max_buf_size(settings.max_header_bytes);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(settings.max_header_bytes).unwrap_or(u32::MAX))
        .max_concurrent_streams(settings.max_streams_per_connection)
        .keep_alive_interval(Some(Duration::from_secs(20)))
        .keep_alive_timeout(Duration::from_secs(20));
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    // The watchdog: a connection that has not sent a first request within the header
    // timeout (an HTTP/2 preface and nothing more), or that sits idle past the idle
    // timeout, is closed. Requests in progress keep it open.
    loop {
        let limit = if activity.served.load(Ordering::Acquire) == 0 {
            settings.header_read_timeout
        } else {
            settings.idle_timeout
        };
        let since = activity
            .last_end
            .lock()
            .map_or_else(|_| Instant::now(), |t| *t);
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(err) = result {
                    debug!(%peer, %err, "http connection ended with an error");
                }
                return;
            }
            () = tokio::time::sleep_until(since + limit) => {
                let idle = activity.active.load(Ordering::Acquire) == 0;
                let unchanged = activity.last_end.lock().is_ok_and(|t| *t == since);
                if idle && unchanged {
                    debug!(%peer, "closing an idle http connection");
                    return;
                }
                if !idle {
                    // Busy: look again after another period.
                    if let Ok(mut last) = activity.last_end.lock() {
                        *last = Instant::now();
                    }
                }
            }
        }
    }
}

/// Who may call a route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Access {
    /// `/healthz`.
    Open,
    /// Inference and `/v1/models`: a client key (or an admin key).
    Client,
    /// Status, metrics, node commands: an admin key.
    Admin,
}

fn access(path: &str) -> Access {
    match path {
        "/healthz" => Access::Open,
        "/metrics" | "/v1/status" => Access::Admin,
        p if p.starts_with("/v1/nodes/") => Access::Admin,
        _ => Access::Client,
    }
}

async fn route(
    req: Request<Incoming>,
    state: Arc<State>,
    peer: std::net::SocketAddr,
) -> Response<ResBody> {
    let path = req.uri().path().to_owned();
    if let Some(denied) = authorize(&req, peer, &state.settings(), access(&path)) {
        return denied;
    }
    if let Some(allow) = allowed_method(&path)
        && req.method().as_str() != allow
    {
        let mut r = error(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("{path} answers {allow} only"),
            "invalid_request_error",
            Some("method_not_allowed"),
        );
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static(allow));
        return r;
    }
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/healthz") => {
            let mut r = Response::new(ResBody::Full(Some(Bytes::from_static(b"ok\n"))));
            r.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
            r
        }
        (Method::GET, "/metrics") => {
            let snapshot = snapshot(&state).await.unwrap_or_default();
            let mut r = Response::new(ResBody::Full(Some(Bytes::from(
                state.metrics.render(&snapshot),
            ))));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            r
        }
        (Method::GET, "/v1/models") => models(&state).await,
        (Method::GET, "/v1/status") => status(&state).await,
        (Method::POST, "/v1/chat/completions") => inference(req, state, Endpoint::Chat).await,
        (Method::POST, "/v1/completions") => inference(req, state, Endpoint::Completions).await,
        (Method::POST, "/v1/embeddings") => inference(req, state, Endpoint::Embeddings).await,
        (_, path) if path.starts_with("/v1/nodes/") => node_command(req, &state).await,
        _ => error(
            StatusCode::NOT_FOUND,
            &format!("no route for {path}"),
            "invalid_request_error",
            Some("unknown_url"),
        ),
    }
}

/// The one method a known route answers (`None` for paths that are no route).
fn allowed_method(path: &str) -> Option<&'static str> {
    match path {
        "/healthz" | "/metrics" | "/v1/models" | "/v1/status" => Some("GET"),
        "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings" => Some("POST"),
        _ => {
            let (_, what) = path.strip_prefix("/v1/nodes/")?.split_once('/')?;
            match what {
                "capabilities" | "transport" => Some("GET"),
                _ => {
                    let (_, api) = what.strip_prefix("ollama/")?.split_once('/')?;
                    iop_proto_core::wire::OLLAMA_API_ENDPOINTS
                        .iter()
                        .find(|(_, p)| p.strip_prefix('/') == Some(api))
                        .map(|(method, _)| *method)
                }
            }
        }
    }
}

/// The token of an `Authorization: Bearer <token>` header; the scheme is
/// case-insensitive (RFC 9110 section 11.1).
fn bearer(req: &Request<Incoming>) -> Option<&str> {
    let value = req.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.trim().split_once([' ', '\t'])?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// `None` when the caller may use a route of `access`; else the 401 or 403 to answer.
fn authorize(
    req: &Request<Incoming>,
    peer: std::net::SocketAddr,
    settings: &HttpSettings,
    access: Access,
) -> Option<Response<ResBody>> {
    use iop_proto_core::TokenVerifier;
    let presented = bearer(req).map(str::as_bytes);
    let is =
        |keys: &[TokenVerifier]| presented.is_some_and(|p| TokenVerifier::find(keys, p).is_some());
    let unauthorized = || {
        let mut r = error(
            StatusCode::UNAUTHORIZED,
            "Incorrect API key provided.",
            "invalid_request_error",
            Some("invalid_api_key"),
        );
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        r
    };
    let forbidden = |message: &str| {
        error(
            StatusCode::FORBIDDEN,
            message,
            "invalid_request_error",
            Some("permission_denied"),
        )
    };
    match access {
        Access::Open => None,
        Access::Client => {
            if settings.api_keys.is_empty() || is(&settings.api_keys) || is(&settings.admin_keys) {
                None
            } else {
                Some(unauthorized())
            }
        }
        Access::Admin if settings.admin_keys.is_empty() => (!peer.ip().is_loopback()).then(|| {
            forbidden(
                "This route is for operators: configure [auth] admin_keys to reach it from \
                 another host.",
            )
        }),
        Access::Admin => {
            if is(&settings.admin_keys) {
                None
            } else if is(&settings.api_keys) {
                Some(forbidden(
                    "This route needs an admin key, not a client key.",
                ))
            } else {
                Some(unauthorized())
            }
        }
    }
}

async fn snapshot(state: &State) -> Option<Snapshot> {
    let (reply, rx) = oneshot::channel();
    state.core.send(CoreMsg::Snapshot { reply }).await.ok()?;
    rx.await.ok()
}

async fn models(state: &State) -> Response<ResBody> {
    let Some(snapshot) = snapshot(state).await else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "edge is shutting down",
            "server_error",
            None,
        );
    };
    let data: Vec<Value> = snapshot
        .queue_by_model
        .iter()
        .map(|(name, _)| json!({ "id": name, "object": "model", "created": 0, "owned_by": "iop" }))
        .collect();
    json_response(
        StatusCode::OK,
        Bytes::from(json!({ "object": "list", "data": data }).to_string()),
    )
}

/// `LocalInference` → `local_inference`: the wire enum names, as configuration spells them.
fn enum_name<E: std::fmt::Debug, X>(value: Result<E, X>) -> String {
    let Ok(value) = value else {
        return "unknown".to_owned();
    };
    let mut out = String::new();
    for (i, c) in format!("{value:?}").chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

async fn status(state: &State) -> Response<ResBody> {
    use iop_proto_core::wire::{ProviderCategory, ProviderHealth, ProviderStatus};
    let Some(snapshot) = snapshot(state).await else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "edge is shutting down",
            "server_error",
            None,
        );
    };
    let nodes: Vec<Value> = snapshot
        .nodes
        .iter()
        .map(|n| {
            // A node id in conflict says so in its state; `connected` still tells
            // whether the connection holding it is ready.
            let state = if n.conflict {
                "conflict".to_owned()
            } else if n.draining {
                "draining".to_owned()
            } else {
                format!("{:?}", n.state).to_lowercase()
            };
            json!({
                "node_id": &*n.node_id,
                "state": state,
                "connected": n.state == NodeState::Ready,
                "conflict": n.conflict,
                "draining": n.draining,
                "tls": n.tls.is_some(),
                "tls_version": n.tls,
                "client_certificate": n.client_certificate,
                "generation": n.generation.map(|g| g.0),
                "config_revision": n.revision,
                "applied_revision": n.applied_revision,
                "last_refresh": n.last_refresh.map(|s| format!("{s:?}").to_lowercase()),
            })
        })
        .collect();
    let providers: Vec<Value> = snapshot
        .providers
        .iter()
        .map(|p| {
            json!({
                "node_id": p.node_id,
                "provider_id": p.provider_id,
                "category": enum_name(ProviderCategory::try_from(p.category)),
                "status": enum_name(ProviderStatus::try_from(p.status)),
                "health": enum_name(ProviderHealth::try_from(p.health)),
                "capacity": p.capacity,
                "long_capacity": p.long_capacity,
                "in_flight": p.in_flight,
                "long_in_flight": p.long_in_flight,
                "queued": p.queued,
                "long_queued": p.long_queued,
                "targets": p.targets,
            })
        })
        .collect();
    let queue: serde_json::Map<String, Value> = snapshot
        .queue_by_model
        .iter()
        .map(|(m, n)| (m.clone(), json!(n)))
        .collect();
    let body = json!({
        "nodes": nodes,
        "providers": providers,
        "queue": queue,
        "open_requests": snapshot.open_requests,
    });
    json_response(StatusCode::OK, Bytes::from(body.to_string()))
}

/// `/v1/nodes/{node}/capabilities`, `/v1/nodes/{node}/transport` and the read-only
/// `/v1/nodes/{node}/ollama/{adapter}/api/...` pass-through: node commands.
async fn node_command(req: Request<Incoming>, state: &State) -> Response<ResBody> {
    use iop_proto_core::CommandError;
    use iop_proto_core::wire::{NodeCommandRequest, NodeCommandType};
    let method = req.method().as_str().to_owned();
    let path = req.uri().path().to_owned();
    let rest = path.trim_start_matches("/v1/nodes/");
    let (node_id, what) = rest.split_once('/').unwrap_or((rest, ""));
    let mut request = NodeCommandRequest {
        method,
        ..NodeCommandRequest::default()
    };
    match what {
        "capabilities" => request.r#type = NodeCommandType::Capabilities as i32,
        "transport" => request.r#type = NodeCommandType::TransportStatus as i32,
        other => match other
            .strip_prefix("ollama/")
            .and_then(|r| r.split_once('/'))
        {
            Some((adapter, api)) => {
                request.r#type = NodeCommandType::OllamaApi as i32;
                request.adapter = adapter.to_owned();
                request.path = format!("/{api}");
            }
            None => {
                return error(
                    StatusCode::NOT_FOUND,
                    &format!("no route for {path}"),
                    "invalid_request_error",
                    Some("unknown_url"),
                );
            }
        },
    }
    let limit = state.settings().max_body_bytes;
    request.body = match Limited::new(req.into_body(), limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request body too large",
                "invalid_request_error",
                None,
            );
        }
    };
    let (reply, answer) = oneshot::channel();
    let sent = state
        .core
        .send(CoreMsg::Command {
            node_id: node_id.to_owned(),
            request,
            reply,
        })
        .await;
    if sent.is_err() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "edge is shutting down",
            "server_error",
            None,
        );
    }
    match answer.await {
        Ok(Ok(response)) if response.ok => {
            let payload = if response.payload.is_empty() {
                Bytes::from_static(b"{}")
            } else {
                response.payload
            };
            json_response(StatusCode::OK, payload)
        }
        Ok(Ok(response)) => error(
            StatusCode::BAD_GATEWAY,
            &response.error,
            "server_error",
            Some("command_failed"),
        ),
        Ok(Err(CommandError::Invalid(err))) => error(
            StatusCode::BAD_REQUEST,
            &err.to_string(),
            "invalid_request_error",
            Some("command_not_admitted"),
        ),
        Ok(Err(CommandError::NotOllama { node, adapter })) => error(
            StatusCode::BAD_REQUEST,
            &format!(
                "node {node:?} has no Ollama adapter {adapter:?}: the pass-through serves Ollama adapters only"
            ),
            "invalid_request_error",
            Some("not_ollama_adapter"),
        ),
        Ok(Err(CommandError::UnknownNode(node))) => error(
            StatusCode::NOT_FOUND,
            &format!("node {node:?} does not exist"),
            "invalid_request_error",
            Some("unknown_node"),
        ),
        Ok(Err(err)) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            &err.to_string(),
            "server_error",
            Some("node_not_ready"),
        ),
        Err(_) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "edge is shutting down",
            "server_error",
            None,
        ),
    }
}

/// Cancels the request when dropped before `disarm` (client gone, write failure, timeout).
struct CancelGuard {
    core: mpsc::Sender<CoreMsg>,
    request: RequestId,
    armed: bool,
    reason: &'static str,
}

impl CancelGuard {
    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let cancel = CoreMsg::Cancel {
            request: self.request,
            reason: self.reason,
        };
        // A cancel must not be lost to a momentarily full inbox: the lease would then be
        // held until the provider finished on its own.
        if let Err(tokio::sync::mpsc::error::TrySendError::Full(cancel)) =
            self.core.try_send(cancel)
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let core = self.core.clone();
            runtime.spawn(async move {
                let _ = core.send(cancel).await;
            });
        }
    }
}

struct Finish {
    metrics: Arc<Metrics>,
    model: String,
    started: Instant,
    first_byte: bool,
}

impl Finish {
    fn first_byte(&mut self) {
        if !self.first_byte {
            self.first_byte = true;
            self.metrics.first_byte(&self.model, self.started.elapsed());
        }
    }

    fn done(&self, status: u16) {
        self.metrics
            .request(&self.model, status, self.started.elapsed());
    }
}

/// What the Edge reads of an inference request body: only the fields it decides on, as
/// borrowed raw JSON (no document tree is built: a body of 300,000 tiny messages costs a
/// scan, not 300,000 maps). Unknown fields are skipped.
#[derive(serde::Deserialize)]
struct Head<'a> {
    #[serde(borrow)]
    model: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    stream: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    stream_options: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    messages: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    prompt: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    input: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    tools: Option<&'a serde_json::value::RawValue>,
}

/// The facts of a request body the Edge acts on.
#[derive(Debug)]
struct Asked {
    model: String,
    stream: bool,
    include_usage: bool,
    wants_tools: bool,
}

/// An OpenAI error answer, rendered only when it is sent.
#[derive(Debug)]
struct Refusal {
    status: StatusCode,
    message: String,
    kind: &'static str,
    code: Option<&'static str>,
}

impl Refusal {
    fn new(
        status: StatusCode,
        message: impl Into<String>,
        kind: &'static str,
        code: Option<&'static str>,
    ) -> Self {
        Refusal {
            status,
            message: message.into(),
            kind,
            code,
        }
    }

    fn response(&self) -> Response<ResBody> {
        error(self.status, &self.message, self.kind, self.code)
    }
}

fn bad_request(message: impl Into<String>, code: Option<&'static str>) -> Refusal {
    Refusal::new(
        StatusCode::BAD_REQUEST,
        message,
        "invalid_request_error",
        code,
    )
}

/// Number of elements of a JSON array, without materialising them (`IgnoredAny` is
/// zero-sized, so the vector never allocates); `None` if `raw` is not an array.
fn array_len(raw: &serde_json::value::RawValue) -> Option<usize> {
    serde_json::from_str::<Vec<serde::de::IgnoredAny>>(raw.get())
        .ok()
        .map(|v| v.len())
}

/// A present, non-null field.
fn given(v: Option<&serde_json::value::RawValue>) -> Option<&serde_json::value::RawValue> {
    v.filter(|v| v.get() != "null")
}

/// Reads what the Edge needs from `raw`, or the 400 to answer.
fn inspect(raw: &[u8], endpoint: Endpoint) -> Result<Asked, Refusal> {
    let head: Head<'_> = match serde_json::from_slice(raw) {
        Ok(head) => head,
        Err(err) if err.is_data() && raw.trim_ascii_start().first() != Some(&b'{') => {
            return Err(bad_request("the request body must be a JSON object", None));
        }
        Err(err) => return Err(bad_request(format!("invalid JSON: {err}"), None)),
    };
    let model = given(head.model)
        .and_then(|m| serde_json::from_str::<String>(m.get()).ok())
        .ok_or_else(|| bad_request("you must provide a model parameter", Some("missing_model")))?;
    let present = match endpoint {
        Endpoint::Chat => (
            "messages",
            given(head.messages)
                .and_then(array_len)
                .is_some_and(|n| n > 0),
        ),
        Endpoint::Completions => ("prompt", given(head.prompt).is_some()),
        Endpoint::Embeddings => ("input", given(head.input).is_some()),
    };
    if !present.1 {
        return Err(bad_request(
            format!("missing or invalid required parameter: {}", present.0),
            Some("invalid_value"),
        ));
    }
    let stream = match given(head.stream) {
        None => false,
        Some(v) => serde_json::from_str::<bool>(v.get())
            .map_err(|_| bad_request("stream must be a boolean", Some("invalid_value")))?,
    };
    #[derive(serde::Deserialize)]
    struct StreamOptions {
        include_usage: Option<bool>,
    }
    let include_usage = given(head.stream_options)
        .and_then(|v| serde_json::from_str::<StreamOptions>(v.get()).ok())
        .and_then(|o| o.include_usage)
        == Some(true);
    let wants_tools = given(head.tools).and_then(array_len).is_some_and(|n| n > 0);
    Ok(Asked {
        model,
        stream,
        include_usage,
        wants_tools,
    })
}

/// Reads a request body within the size limit, the memory budget and the body deadline,
/// into one buffer (sized from `content-length` when given, so it is never copied again).
async fn read_body(
    body: Incoming,
    content_length: Option<u64>,
    settings: &HttpSettings,
    memory: &RequestMemory,
) -> Result<Bytes, Refusal> {
    let max = settings.max_body_bytes;
    let too_large = || {
        Refusal::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body exceeds {max} bytes"),
            "invalid_request_error",
            Some("body_too_large"),
        )
    };
    let overloaded = || {
        Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the edge is holding as many request bytes as it may; retry shortly",
            "server_error",
            Some("overloaded"),
        )
    };
    let declared = match content_length {
        Some(n) if n > max as u64 => return Err(too_large()),
        Some(n) => usize::try_from(n).unwrap_or(max),
        None => 0,
    };
    if !memory.reserve_body(declared) {
        return Err(overloaded());
    }
    let mut reserved = declared;
    let mut buf = bytes::BytesMut::with_capacity(declared);
    let deadline = Instant::now() + settings.body_read_timeout;
    let mut body = body;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => {
                return Err(Refusal::new(
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "the request body did not arrive within {} s",
                        settings.body_read_timeout.as_secs()
                    ),
                    "invalid_request_error",
                    Some("body_timeout"),
                ));
            }
            Ok(None) => break,
            Ok(Some(Err(_))) => {
                return Err(bad_request("could not read the request body", None));
            }
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let len = buf.len() + data.len();
        if len > max {
            return Err(too_large());
        }
        if len > reserved {
            // More than declared (or nothing was): reserve as it comes, in steps.
            let step = (len - reserved).max(64 << 10).min(max - reserved);
            if !memory.reserve_body(step) {
                return Err(overloaded());
            }
            reserved += step;
        }
        buf.extend_from_slice(&data);
    }
    Ok(buf.freeze())
}

async fn inference(
    req: Request<Incoming>,
    state: Arc<State>,
    endpoint: Endpoint,
) -> Response<ResBody> {
    let started = Instant::now();
    let settings = state.settings();
    let headers: Vec<Header> = req
        .headers()
        .iter()
        .filter(|(name, _)| iop_proto_core::tunnel::forwards_request_header(name.as_str()))
        .map(|(name, value)| Header {
            name: name.as_str().to_owned(),
            value: Bytes::copy_from_slice(value.as_bytes()),
        })
        .collect();
    let content_length = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let memory = RequestMemory::new(state.budget.clone());
    // From here the body and everything buffered for the caller count against the budget
    // until the handler is done.
    let (tx, rx) = mpsc::unbounded_channel();
    let mut events = Events {
        rx,
        memory: memory.clone(),
    };
    let raw = match read_body(req.into_body(), content_length, &settings, &memory).await {
        Ok(raw) => raw,
        Err(refusal) => return refusal.response(),
    };
    // The concurrency permit is taken only once the body is in: slow senders cannot hold
    // the permits every other caller needs.
    let Ok(permit) = state.permits.clone().try_acquire_owned() else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many concurrent requests",
            "server_error",
            Some("overloaded"),
        );
    };
    let Asked {
        model,
        stream,
        include_usage,
        wants_tools,
    } = match inspect(&raw, endpoint) {
        Ok(asked) => asked,
        Err(refusal) => return refusal.response(),
    };

    let (reply, answer) = oneshot::channel();
    let work = Work {
        endpoint,
        raw: raw.clone(),
        stream,
        headers,
        timeout: settings.response_timeout,
    };
    let submit = CoreMsg::Submit {
        model: model.clone(),
        prompt_tokens: (raw.len() as u64).div_ceil(4),
        work,
        events: tx,
        memory,
        reply,
    };
    if state.core.send(submit).await.is_err() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "edge is shutting down",
            "server_error",
            None,
        );
    }
    let mut finish = Finish {
        metrics: state.metrics.clone(),
        model: model.clone(),
        started,
        first_byte: false,
    };
    let request = match answer.await {
        Ok(Ok(request)) => request,
        Ok(Err(refused)) => {
            let response = match refused {
                SubmitError::UnknownModel(m) => {
                    // Unknown names are caller input: keep them out of metric labels.
                    finish.model = "_unknown".to_owned();
                    error(
                        StatusCode::NOT_FOUND,
                        &format!("The model `{m}` does not exist or you do not have access to it."),
                        "invalid_request_error",
                        Some("model_not_found"),
                    )
                }
                SubmitError::QueueFull { .. } => error(
                    StatusCode::TOO_MANY_REQUESTS,
                    &refused.to_string(),
                    "rate_limit_error",
                    Some("queue_full"),
                ),
                SubmitError::NoCandidates(_) if endpoint != Endpoint::Chat => error(
                    StatusCode::BAD_REQUEST,
                    &format!("no provider of model `{model}` serves {}", endpoint.path()),
                    "invalid_request_error",
                    Some("unsupported_endpoint"),
                ),
                other => error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &other.to_string(),
                    "server_error",
                    Some("no_provider"),
                ),
            };
            finish.done(response.status().as_u16());
            return response;
        }
        Err(_) => {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "edge is shutting down",
                "server_error",
                None,
            );
        }
    };
    let guard = CancelGuard {
        core: state.core.clone(),
        request,
        armed: true,
        reason: "caller disconnected",
    };
    let deadline = started + settings.response_timeout;
    let ctx = Ctx {
        keepalive: settings.sse_keepalive,
        model,
        run_id: iop_proto_core::edge::run_id_of(request),
        stream,
        include_usage,
        wants_tools,
        deadline,
    };
    let response = respond(&mut events, guard, &ctx, &mut finish, permit).await;
    if let ResBody::Full(_) = response.body() {
        finish.done(response.status().as_u16());
    }
    response
}

struct Ctx {
    /// Interval of SSE comments on an idle stream.
    keepalive: Duration,
    model: String,
    run_id: String,
    stream: bool,
    include_usage: bool,
    wants_tools: bool,
    deadline: Instant,
}

/// What a streaming response waits for next.
enum Next {
    /// An event of the request.
    Event(Box<ReqEvent>),
    /// Nothing for one keep-alive interval: time to send an SSE comment.
    Idle,
    /// The response deadline passed.
    TimedOut,
    /// The caller is gone (hyper dropped the response body).
    Gone,
}

/// The next event of a streamed response, `Idle` after `keepalive` without one, or
/// `Gone` as soon as the caller's connection has dropped the body. Writing a comment on
/// an idle stream is how a caller that left is noticed while the provider is silent: the
/// write fails, hyper drops the body, and the run is cancelled.
async fn next_streamed(
    events: &mut Events,
    deadline: Instant,
    keepalive: Duration,
    tx: &mpsc::Sender<Chunk>,
) -> Next {
    let idle = (Instant::now() + keepalive).min(deadline);
    tokio::select! {
        () = tx.closed() => Next::Gone,
        event = tokio::time::timeout_at(idle, events.rx.recv()) => match event {
            Ok(Some(event)) => {
                events.memory.consumed(crate::core_task::event_size(&event));
                Next::Event(Box::new(event))
            }
            Ok(None) => Next::TimedOut,
            Err(_) if Instant::now() >= deadline => Next::TimedOut,
            Err(_) => Next::Idle,
        },
    }
}

/// The SSE comment sent on idle streams (ignored by every SSE client).
const SSE_KEEPALIVE: &[u8] = b": keep-alive\n\n";

async fn next_event(events: &mut Events, deadline: Instant) -> Option<ReqEvent> {
    match tokio::time::timeout_at(deadline, events.rx.recv()).await {
        Ok(Some(event)) => {
            events.memory.consumed(crate::core_task::event_size(&event));
            Some(event)
        }
        _ => None,
    }
}

fn failure(outcome: &Outcome) -> Response<ResBody> {
    match outcome {
        Outcome::Expired => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "no provider capacity became free within the queue wait timeout",
            "server_error",
            Some("capacity_timeout"),
        ),
        Outcome::Failed(RequestError::NodeLost { .. }) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the node serving this request was lost",
            "server_error",
            Some("node_lost"),
        ),
        Outcome::Failed(RequestError::Provider(detail)) => {
            let status = if detail.code == "timeout" {
                StatusCode::GATEWAY_TIMEOUT
            } else {
                StatusCode::BAD_GATEWAY
            };
            error(
                status,
                &format!("provider error: {}", detail.message),
                "server_error",
                Some(&detail.code),
            )
        }
        Outcome::Failed(RequestError::Unsupported { model }) => error(
            StatusCode::BAD_REQUEST,
            &format!("no provider of model `{model}` serves this endpoint any more"),
            "invalid_request_error",
            Some("unsupported_endpoint"),
        ),
        Outcome::Failed(RequestError::Violation(why)) => error(
            StatusCode::BAD_GATEWAY,
            &format!("node protocol violation: {why}"),
            "server_error",
            Some("protocol_violation"),
        ),
        Outcome::Cancelled => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "request cancelled",
            "server_error",
            Some("cancelled"),
        ),
        Outcome::Failed(_) | Outcome::Completed => error(
            StatusCode::BAD_GATEWAY,
            "request ended unexpectedly",
            "server_error",
            None,
        ),
    }
}

fn timeout_response() -> Response<ResBody> {
    error(
        StatusCode::GATEWAY_TIMEOUT,
        "the request timed out",
        "server_error",
        Some("timeout"),
    )
}

async fn respond(
    events: &mut Events,
    mut guard: CancelGuard,
    ctx: &Ctx,
    finish: &mut Finish,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> Response<ResBody> {
    // Wait for the grant (queueing happens here).
    let shape = loop {
        match next_event(events, ctx.deadline).await {
            None => {
                guard.reason = "response timeout";
                return timeout_response();
            }
            Some(ReqEvent::Dispatched { shape, .. }) => break shape,
            Some(ReqEvent::Ended(outcome)) => {
                guard.disarm();
                return failure(&outcome);
            }
            Some(_) => {}
        }
    };
    match shape {
        DispatchShape::Tunnel => {
            tunnel_response(
                std::mem::replace(events, dummy_events()),
                guard,
                ctx,
                finish,
                permit,
            )
            .await
        }
        DispatchShape::Run if ctx.stream => run_stream(
            std::mem::replace(events, dummy_events()),
            guard,
            ctx,
            finish,
            permit,
        ),
        DispatchShape::Run => run_whole(events, guard, ctx, finish).await,
    }
}

fn dummy_events() -> Events {
    let (_tx, rx) = mpsc::unbounded_channel();
    Events {
        rx,
        memory: RequestMemory::new(Arc::new(crate::memory::Budget::new(0))),
    }
}

async fn tunnel_response(
    mut events: Events,
    mut guard: CancelGuard,
    ctx: &Ctx,
    finish: &mut Finish,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> Response<ResBody> {
    let status_frame: ProviderTunnelFrame = loop {
        match next_event(&mut events, ctx.deadline).await {
            None => {
                guard.reason = "response timeout";
                return timeout_response();
            }
            Some(ReqEvent::Frame(frame)) if frame.kind == TunnelFrameKind::Status as i32 => {
                break frame;
            }
            Some(ReqEvent::Frame(frame)) if frame.kind == TunnelFrameKind::Error as i32 => {
                let detail = frame.error.unwrap_or_default();
                let status = if detail.code == "timeout" {
                    StatusCode::GATEWAY_TIMEOUT
                } else {
                    StatusCode::BAD_GATEWAY
                };
                guard.disarm();
                return error(
                    status,
                    &format!("provider error: {}", detail.message),
                    "server_error",
                    Some(&detail.code),
                );
            }
            Some(ReqEvent::Ended(outcome)) => {
                guard.disarm();
                return failure(&outcome);
            }
            Some(_) => {}
        }
    };
    finish.first_byte();
    let status = StatusCode::from_u16(u16::try_from(status_frame.status_code).unwrap_or(502))
        .unwrap_or(StatusCode::BAD_GATEWAY);
    let mut sse = false;
    let mut builder = Response::builder().status(status);
    // Only the allow-listed provider headers reach the caller, whatever a node sends.
    for h in &status_frame.headers {
        if !iop_proto_core::tunnel::forwards_response_header(&h.name) {
            continue;
        }
        if h.name.eq_ignore_ascii_case("content-type") && h.value.starts_with(b"text/event-stream")
        {
            sse = true;
        }
        builder = builder.header(h.name.as_str(), h.value.as_ref());
    }
    let (tx, rx) = mpsc::channel::<Chunk>(16);
    let response = builder.body(ResBody::Stream(rx)).unwrap_or_else(|_| {
        error(
            StatusCode::BAD_GATEWAY,
            "provider sent invalid headers",
            "server_error",
            None,
        )
    });
    let deadline = ctx.deadline;
    let metrics = finish.metrics.clone();
    let model = ctx.model.clone();
    let started = finish.started;
    let code = status.as_u16();
    let keepalive = ctx.keepalive;
    tokio::spawn(async move {
        let _permit = permit;
        let mut ok = true;
        // A comment may only go between SSE events, never inside one the provider has
        // half sent.
        let mut at_boundary = true;
        loop {
            let event = match next_streamed(&mut events, deadline, keepalive, &tx).await {
                Next::Gone => return, // the guard cancels upstream
                Next::Idle => {
                    if sse && at_boundary {
                        let comment = Ok(Frame::data(Bytes::from_static(SSE_KEEPALIVE)));
                        if tx.send(comment).await.is_err() {
                            return;
                        }
                    }
                    continue;
                }
                Next::TimedOut => None,
                Next::Event(event) => Some(*event),
            };
            if let Some(ReqEvent::Frame(frame)) = &event
                && frame.kind == TunnelFrameKind::Body as i32
                && !frame.body.is_empty()
            {
                at_boundary = frame.body.ends_with(b"\n\n") || frame.body.ends_with(b"\r\n\r\n");
            }
            let chunk: Option<Chunk> = match event {
                None => {
                    guard.reason = "response timeout";
                    ok = false;
                    Some(stream_failure(sse, "the request timed out", "timeout"))
                }
                Some(ReqEvent::Frame(frame)) => match TunnelFrameKind::try_from(frame.kind) {
                    Ok(TunnelFrameKind::Body) => Some(Ok(Frame::data(frame.body))),
                    Ok(TunnelFrameKind::Error) => {
                        ok = false;
                        let detail = frame.error.unwrap_or_default();
                        Some(stream_failure(
                            sse,
                            &format!("provider error: {}", detail.message),
                            &detail.code,
                        ))
                    }
                    _ => None, // USAGE and HEADERS are observations
                },
                Some(ReqEvent::Ended(Outcome::Completed)) => {
                    guard.disarm();
                    break;
                }
                Some(ReqEvent::Ended(outcome)) => {
                    guard.disarm();
                    ok = false;
                    let message = match outcome {
                        Outcome::Failed(RequestError::NodeLost { .. }) => {
                            "the node serving this request was lost"
                        }
                        _ => "the request failed",
                    };
                    Some(stream_failure(sse, message, "stream_failed"))
                }
                Some(_) => None,
            };
            let Some(chunk) = chunk else { continue };
            let last = chunk.is_err() || !ok;
            if tx.send(chunk).await.is_err() {
                return; // client gone: the guard cancels upstream
            }
            if last {
                guard.disarm();
                break;
            }
        }
        metrics.request(&model, if ok { code } else { 599 }, started.elapsed());
    });
    response
}

/// How a stream that already sent its status reports a failure: an SSE error event (the
/// SDKs raise on it), or an aborted body for anything else.
fn stream_failure(sse: bool, message: &str, code: &str) -> Chunk {
    if sse {
        Ok(Frame::data(openai::error_event(
            message,
            "server_error",
            Some(code),
        )))
    } else {
        Err(std::io::Error::other(message.to_owned()))
    }
}

async fn run_whole(
    events: &mut Events,
    mut guard: CancelGuard,
    ctx: &Ctx,
    finish: &mut Finish,
) -> Response<ResBody> {
    let mut content = String::new();
    let mut usage: Option<Usage> = None;
    let mut metadata = std::collections::BTreeMap::new();
    loop {
        match next_event(events, ctx.deadline).await {
            None => {
                guard.reason = "response timeout";
                return timeout_response();
            }
            Some(ReqEvent::Run(event)) => {
                finish.first_byte();
                content.push_str(&event.delta);
                if event.usage.is_some() {
                    usage = event.usage;
                }
                if event.r#type == RunEventType::Complete as i32 {
                    metadata = event.metadata;
                }
            }
            Some(ReqEvent::Ended(Outcome::Completed)) => break,
            Some(ReqEvent::Ended(outcome)) => {
                guard.disarm();
                return failure(&outcome);
            }
            Some(_) => {}
        }
    }
    guard.disarm();
    let tool_calls = restore_tool_calls(&metadata, &content, &ctx.run_id);
    // A fallback's text *was* the tool call; an empty text next to tool calls is null.
    let text_is_call = metadata.contains_key("openai_text_tool_fallback") || content.is_empty();
    let content = if tool_calls.is_some() && text_is_call {
        None
    } else {
        Some(content.as_str())
    };
    let body = openai::chat_completion(
        &format!("chatcmpl-{}", ctx.run_id),
        &ctx.model,
        now_secs(),
        content,
        tool_calls.as_ref(),
        usage.as_ref(),
    );
    json_response(StatusCode::OK, Bytes::from(body.to_string()))
}

/// `tool_calls` from the native metadata key, or parsed from the text only when the node
/// marked the text fallback.
fn restore_tool_calls(
    metadata: &std::collections::BTreeMap<String, String>,
    content: &str,
    run_id: &str,
) -> Option<Value> {
    if let Some(native) = metadata.get("openai_tool_calls")
        && let Ok(calls @ Value::Array(_)) = serde_json::from_str::<Value>(native)
        && calls.as_array().is_some_and(|a| !a.is_empty())
    {
        return Some(calls);
    }
    if metadata
        .get("openai_text_tool_fallback")
        .map(String::as_str)
        == Some("true")
    {
        return openai::parse_text_tool_calls(content, run_id);
    }
    None
}

fn run_stream(
    mut events: Events,
    mut guard: CancelGuard,
    ctx: &Ctx,
    finish: &mut Finish,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> Response<ResBody> {
    let (tx, rx) = mpsc::channel::<Chunk>(16);
    let mut response = Response::new(ResBody::Stream(rx));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    let id = format!("chatcmpl-{}", ctx.run_id);
    let model = ctx.model.clone();
    let run_id = ctx.run_id.clone();
    let deadline = ctx.deadline;
    let keepalive = ctx.keepalive;
    let include_usage = ctx.include_usage;
    // With tools offered, text may turn out to be a fallback tool call: hold it back
    // until the run completes and says.
    let hold_text = ctx.wants_tools;
    let metrics = finish.metrics.clone();
    let started = finish.started;
    tokio::spawn(async move {
        let _permit = permit;
        let created = now_secs();
        let mut held = String::new();
        let mut first = true;
        let mut ok = true;
        let send = |value: Value| Ok(Frame::data(openai::sse(&value)));
        loop {
            let mut out: Vec<Chunk> = Vec::new();
            let next = match next_streamed(&mut events, deadline, keepalive, &tx).await {
                Next::Gone => return, // the guard cancels upstream
                Next::Idle => {
                    if tx
                        .send(Ok(Frame::data(Bytes::from_static(SSE_KEEPALIVE))))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    continue;
                }
                Next::TimedOut => None,
                Next::Event(event) => Some(*event),
            };
            match next {
                None => {
                    guard.reason = "response timeout";
                    ok = false;
                    out.push(Ok(Frame::data(openai::error_event(
                        "the request timed out",
                        "server_error",
                        Some("timeout"),
                    ))));
                }
                Some(ReqEvent::Run(event)) => {
                    if first {
                        first = false;
                        metrics.first_byte(&model, started.elapsed());
                        out.push(send(openai::chunk(
                            &id,
                            &model,
                            created,
                            json!({"role": "assistant", "content": ""}),
                            None,
                        )));
                    }
                    match RunEventType::try_from(event.r#type) {
                        Ok(RunEventType::Delta) if !event.delta.is_empty() => {
                            if hold_text {
                                held.push_str(&event.delta);
                            } else {
                                out.push(send(openai::chunk(
                                    &id,
                                    &model,
                                    created,
                                    json!({"content": event.delta}),
                                    None,
                                )));
                            }
                        }
                        Ok(RunEventType::Complete) => {
                            let calls = restore_tool_calls(&event.metadata, &held, &run_id);
                            let fallback = event.metadata.contains_key("openai_text_tool_fallback");
                            if !held.is_empty() && (calls.is_none() || !fallback) {
                                out.push(send(openai::chunk(
                                    &id,
                                    &model,
                                    created,
                                    json!({"content": held}),
                                    None,
                                )));
                            }
                            let finish_reason = match &calls {
                                Some(calls) => {
                                    out.push(send(openai::chunk(
                                        &id,
                                        &model,
                                        created,
                                        json!({"tool_calls": openai::tool_call_deltas(calls)}),
                                        None,
                                    )));
                                    "tool_calls"
                                }
                                None => "stop",
                            };
                            out.push(send(openai::chunk(
                                &id,
                                &model,
                                created,
                                json!({}),
                                Some(finish_reason),
                            )));
                            if include_usage && let Some(u) = &event.usage {
                                let mut usage_chunk =
                                    openai::chunk(&id, &model, created, json!({}), None);
                                usage_chunk["choices"] = json!([]);
                                usage_chunk["usage"] = openai::usage_json(u);
                                out.push(send(usage_chunk));
                            }
                            out.push(Ok(Frame::data(Bytes::from_static(openai::SSE_DONE))));
                        }
                        Ok(RunEventType::Error) => {
                            ok = false;
                            let detail = event.error.unwrap_or_default();
                            out.push(Ok(Frame::data(openai::error_event(
                                &format!("provider error: {}", detail.message),
                                "server_error",
                                Some(&detail.code),
                            ))));
                        }
                        _ => {}
                    }
                }
                Some(ReqEvent::Ended(Outcome::Completed)) => {
                    guard.disarm();
                    break;
                }
                Some(ReqEvent::Ended(outcome)) => {
                    guard.disarm();
                    if !matches!(outcome, Outcome::Failed(RequestError::Provider(_))) {
                        ok = false;
                        let message = match outcome {
                            Outcome::Failed(RequestError::NodeLost { .. }) => {
                                "the node serving this request was lost".to_owned()
                            }
                            other => format!("the request failed: {other:?}"),
                        };
                        out.push(Ok(Frame::data(openai::error_event(
                            &message,
                            "server_error",
                            Some("stream_failed"),
                        ))));
                    }
                    for chunk in out {
                        if tx.send(chunk).await.is_err() {
                            break;
                        }
                    }
                    break;
                }
                Some(_) => {}
            }
            let stop = !ok;
            for chunk in out {
                if tx.send(chunk).await.is_err() {
                    return; // client gone: the guard cancels upstream
                }
            }
            if stop {
                break;
            }
        }
        metrics.request(&model, if ok { 200 } else { 599 }, started.elapsed());
    });
    response
}
