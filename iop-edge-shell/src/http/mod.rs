//! The public HTTP surface: OpenAI-compatible routes, status, metrics and health, over
//! HTTP/1.1 and h2c (and both over TLS). Handlers talk to the core only through
//! messages; what a response says is decided in `iop_api::openai`.

mod admin;
mod fields;
mod h1;
pub(crate) mod inference;
mod peers;
mod responses;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderValue, Method, Response, StatusCode, header};
use http_body::{Body, Frame};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use iop_api::dialect::Dialect;
use iop_api::openai::{ApiError, Endpoint, ErrorType};
use iop_shell_common::repoll::Repoll;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::config::HttpSettings;
use crate::driver::Core;
use crate::metrics::Metrics;
use fields::Req;

type Chunk = Result<Frame<Bytes>, std::io::Error>;

/// A request body as the handlers read it: hyper's (TLS and h2c connections) or the
/// Edge's own HTTP/1.1 reader's ([`h1`]).
pub(crate) trait ReqBody:
    Body<Data = Bytes, Error: Into<Box<dyn std::error::Error + Send + Sync>>> + Send + Unpin
{
}

impl<T> ReqBody for T where
    T: Body<Data = Bytes, Error: Into<Box<dyn std::error::Error + Send + Sync>>> + Send + Unpin
{
}

/// A response body: either complete, or fed by a task through a channel.
#[derive(Debug)]
pub(crate) enum ResBody {
    /// Whole body.
    Full(Option<Bytes>),
    /// A whole inference answer: its request's figures are recorded when this is
    /// dropped, after it is written.
    Done {
        /// The answer.
        body: Option<Bytes>,
        /// The request, recorded when this is dropped.
        _request: Pin<Box<inference::Live>>,
    },
    /// A streamed response, rendered from its request's events as hyper polls it.
    Live(Pin<Box<inference::Live>>),
    /// `GET /v1/events`: SSE bytes from the event hub; ends when the subscriber is dropped.
    Events(tokio::sync::mpsc::Receiver<Bytes>),
}

impl Body for ResBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Chunk>> {
        match &mut *self {
            ResBody::Full(data) | ResBody::Done { body: data, .. } => {
                Poll::Ready(data.take().map(|d| Ok(Frame::data(d))))
            }
            ResBody::Live(live) => live.as_mut().poll_frame(cx),
            ResBody::Events(rx) => rx
                .poll_recv(cx)
                .map(|bytes| bytes.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, ResBody::Full(None) | ResBody::Done { body: None, .. })
    }

    /// A whole body's length, so that hyper (TLS and h2 connections) sends it as
    /// `content-length` rather than chunked.
    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            ResBody::Full(data) | ResBody::Done { body: data, .. } => {
                http_body::SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            ResBody::Live(_) | ResBody::Events(_) => http_body::SizeHint::default(),
        }
    }
}

/// Shared state of the HTTP surface.
#[derive(Debug)]
pub struct State {
    /// The core.
    pub core: Core,
    /// The client keys' limits, budgets and usage.
    pub tenants: Arc<crate::tenants::TenantBook>,
    /// Where finished requests' spans go.
    pub tracer: Arc<crate::traces::Tracer>,
    /// Settings; replaced on reload.
    pub settings: RwLock<Arc<HttpSettings>>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Bounds concurrent requests (`limits.max_concurrent_requests`; a reload resizes it).
    pub permits: Arc<crate::limit::Limit>,
    /// Bounds open connections on the public listener (`limits.max_connections`; a
    /// reload resizes it).
    pub connections: Arc<crate::limit::Limit>,
    /// Bounds the bytes requests hold.
    pub budget: Arc<crate::memory::Budget>,
    /// Lifecycle events for `GET /v1/events`.
    pub events: Arc<crate::events::EventHub>,
    /// The inference requests open, and whether new ones are taken (not while the Edge
    /// drains on its way out).
    pub drain: Arc<crate::drain::Drain>,
    /// In a cluster: membership and members (`/healthz` answers 503 while not a member).
    pub cluster: Option<Arc<crate::membership::ClusterView>>,
    /// The stored responses (`[responses]`; a reload resizes it).
    pub responses: Arc<std::sync::Mutex<iop_api::responses::Store>>,
    /// The requests' response timers, kept for the next request.
    pub timers: Arc<iop_shell_common::deadline::SleepPool>,
}

impl State {
    /// What the response store holds.
    pub(crate) fn responses_figures(&self) -> iop_api::responses::StoreFigures {
        self.responses
            .lock()
            .map(|store| store.figures())
            .unwrap_or_default()
    }

    pub(crate) fn settings(&self) -> Arc<HttpSettings> {
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
fn api_error(error: &ApiError) -> Response<ResBody> {
    let status = StatusCode::from_u16(error.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(status, error.body())
}

/// An error response in `dialect`'s shape (the Messages API's names the request).
fn dialect_error(dialect: Dialect, error: &ApiError, request_id: &str) -> Response<ResBody> {
    let (status, body) = dialect.error(error, request_id);
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(status, body)
}

/// The dialect a path's answers are in: the Messages API's routes answer as it does.
fn dialect_of(path: &str) -> Dialect {
    if path.starts_with(iop_api::anthropic::MESSAGES_PATH) {
        Dialect::Anthropic
    } else if path.starts_with(iop_api::responses::RESPONSES_PATH) {
        Dialect::Responses
    } else {
        Dialect::OpenAi
    }
}

/// An OpenAI error response of a route.
fn error(
    status: StatusCode,
    message: &str,
    kind: ErrorType,
    code: Option<&str>,
) -> Response<ResBody> {
    api_error(&ApiError::new(status.as_u16(), kind, message, code))
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
    let mut backoff = Duration::from_millis(10);
    loop {
        let Ok(slot) = state.connections.take().await else {
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
        match acceptor {
            // Plaintext: HTTP/1.1 read and written by the Edge itself (h2c goes to hyper).
            None => {
                tokio::spawn(async move {
                    let _slot = slot;
                    let settings = state.settings();
                    h1::serve(stream, peer, state, &settings).await;
                });
            }
            // hyper wakes a connection's task from inside its poll when the service takes
            // a request body; repolled at once, that is not a yield that hands the
            // connection to another worker thread (see `iop_shell_common::repoll`).
            // Boxed: a TLS session and its handshake are kilobytes.
            Some(acceptor) => {
                tokio::spawn(Repoll::new(Box::pin(async move {
                    let _slot = slot;
                    let settings = state.settings();
                    serve_tls(acceptor, stream, peer, state, &settings).await;
                })));
            }
        }
    }
}

/// Serves a plaintext HTTP/1.1 connection that moved here from the Edge process this
/// one took over from ([`crate::upgrade`]), counted against `max_connections` like any.
pub async fn serve_moved(moved: crate::upgrade::Moved, state: Arc<State>) {
    let crate::upgrade::Moved {
        stream,
        peer,
        buffered,
        fresh,
    } = moved;
    let stream = match stream
        .set_nonblocking(true)
        .and_then(|()| tokio::net::TcpStream::from_std(stream))
    {
        Ok(stream) => stream,
        Err(err) => {
            debug!(%peer, %err, "a moved connection cannot be served");
            return;
        }
    };
    let _ = stream.set_nodelay(true);
    let Ok(slot) = state.connections.take().await else {
        return;
    };
    tokio::spawn(async move {
        let _slot = slot;
        let settings = state.settings();
        h1::serve_moved(stream, peer, state, &settings, buffered, fresh).await;
    });
}

async fn serve_tls(
    acceptor: tokio_rustls::TlsAcceptor,
    stream: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    state: Arc<State>,
    settings: &HttpSettings,
) {
    match tokio::time::timeout(settings.header_read_timeout, acceptor.accept(stream)).await {
        Ok(Ok(stream)) => serve_connection(stream, peer, state, settings).await,
        Ok(Err(err)) => debug!(%peer, %err, "https handshake failed"),
        Err(_) => debug!(%peer, "https handshake timed out"),
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

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
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
    let drain = state.drain.clone();
    let service = service_fn(move |req| {
        let state = state.clone();
        let active = Active::start(&tracked);
        async move {
            let response = route(Req::from(req), state, peer).await;
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
    // When the Edge starts to drain: HTTP/2 sends GOAWAY and HTTP/1 closes once the
    // response in progress is out; requests in flight run to their end.
    let began = drain.began();
    tokio::pin!(began);
    let mut closing = false;
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
            () = &mut began, if !closing => {
                closing = true;
                connection.as_mut().graceful_shutdown();
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
        // The page holds no data; what it shows it fetches with the admin key.
        "/healthz" | "/ui" => Access::Open,
        "/metrics" | "/v1/status" | "/v1/events" | "/v1/usage" => Access::Admin,
        p if p.starts_with("/v1/nodes/") => Access::Admin,
        _ => Access::Client,
    }
}

/// Routes one request. The large handlers are boxed: hyper keeps this future's slot
/// allocated for as long as the connection lives, so it should hold little more than a
/// pointer while a response streams or the connection idles.
async fn route<B: ReqBody>(
    req: Req<B>,
    state: Arc<State>,
    peer: std::net::SocketAddr,
) -> Response<ResBody> {
    // The path outlives `req`, which a handler takes: borrowed from a clone of the URI
    // (which shares the request head's bytes) rather than copied out.
    let uri = req.uri().clone();
    let path = uri.path();
    let dialect = dialect_of(path);
    // An error of the Messages API's routes names the request as its answers do.
    let refuse = |req: &Req<B>, error: &ApiError| match dialect {
        Dialect::OpenAi | Dialect::Responses => api_error(error),
        Dialect::Anthropic => {
            let id = inference::request_id(req.headers());
            let mut r = dialect_error(dialect, error, &id);
            if let Ok(value) = HeaderValue::from_str(&id) {
                r.headers_mut().insert("request-id", value.clone());
                r.headers_mut().insert(inference::REQUEST_ID_HEADER, value);
            }
            r
        }
    };
    let caller = match authorize(&req, peer, &state.settings(), access(path)) {
        Ok(caller) => caller,
        Err(denied) => {
            let mut r = refuse(&req, &denied);
            if denied.status == 401 {
                r.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            return r;
        }
    };
    if let Some(allow) = allowed_method(path)
        // Split on a byte, not on the text ", ": a searcher for a text pattern is built
        // per call, and this runs for every request.
        && !allow
            .split(',')
            .any(|m| m.trim_start() == req.method().as_str())
    {
        let mut r = refuse(
            &req,
            &ApiError::new(
                405,
                ErrorType::InvalidRequest,
                format!("{path} answers {allow} only"),
                Some("method_not_allowed"),
            ),
        );
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static(allow));
        return r;
    }
    match (req.method().clone(), path) {
        (Method::GET, "/healthz") => {
            let serves = state.cluster.as_ref().is_none_or(|c| c.serves());
            let body: &'static [u8] = if !serves {
                b"not a cluster member yet (joining through etcd)\n"
            } else if !state.core.takes_callers() {
                b"no node serves any model here (the cluster's other members may)\n"
            } else {
                b"ok\n"
            };
            let mut r = Response::new(ResBody::Full(Some(Bytes::from_static(body))));
            if body != b"ok\n" {
                *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            }
            r.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
            r
        }
        (Method::GET, "/metrics") => {
            let mut snapshot = admin::snapshot(&state).await.unwrap_or_default();
            snapshot.cluster = state.cluster.as_ref().map(|c| c.snapshot());
            snapshot.responses_store = state.responses_figures();
            let mut r = Response::new(ResBody::Full(Some(Bytes::from(
                state.metrics.render(&snapshot),
            ))));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
            );
            r
        }
        (Method::GET, "/v1/models") => admin::models(&state, &caller).await,
        (Method::GET, path) if path.starts_with("/v1/models/") => {
            admin::model(&state, &caller, &path["/v1/models/".len()..]).await
        }
        (Method::GET, "/v1/status") => admin::status(&state).await,
        (Method::GET, "/v1/usage") => admin::usage(&state),
        (Method::GET, "/ui") => dashboard(),
        (Method::GET, "/v1/events") => {
            let keepalive = state.settings().sse_keepalive.max(Duration::from_secs(1));
            // SSE's resume: the events after this id that the Edge still keeps.
            let after = req
                .headers()
                .get_str("last-event-id")
                .and_then(|v| v.trim().parse::<u64>().ok());
            let Some(events) = state.events.subscribe(keepalive, after) else {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "too many event subscribers",
                    ErrorType::Server,
                    Some("overloaded"),
                );
            };
            let mut r = Response::new(ResBody::Events(events));
            let headers = r.headers_mut();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            );
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            r
        }
        (Method::POST, path) if let Some(endpoint) = inference_endpoint(path) => {
            let route = inference::Route::OpenAi(endpoint);
            iop_shell_common::in_box!(inference::inference(req, state, route, caller)).await
        }
        (Method::POST, iop_api::anthropic::MESSAGES_PATH) => {
            let route = inference::Route::Messages;
            iop_shell_common::in_box!(inference::inference(req, state, route, caller)).await
        }
        (Method::POST, iop_api::anthropic::COUNT_TOKENS_PATH) => {
            iop_shell_common::in_box!(inference::count_tokens(req, state, caller)).await
        }
        (Method::POST, iop_api::responses::RESPONSES_PATH) => {
            let route = inference::Route::Responses;
            iop_shell_common::in_box!(inference::inference(req, state, route, caller)).await
        }
        (Method::GET, path) if let Some(id) = path.strip_prefix("/v1/responses/") => {
            responses::get(&state, &caller, id)
        }
        (Method::DELETE, path) if let Some(id) = path.strip_prefix("/v1/responses/") => {
            responses::delete(&state, &caller, id)
        }
        (_, path) if path.starts_with("/v1/nodes/") => {
            iop_shell_common::in_box!(admin::node_command(req, &state)).await
        }
        _ => refuse(
            &req,
            &ApiError::new(
                404,
                ErrorType::InvalidRequest,
                format!("no route for {path}"),
                Some("unknown_url"),
            ),
        ),
    }
}

/// The dashboard: one page embedded in the binary (no CDN, no build step). It asks for
/// an admin key, keeps it in the tab's `sessionStorage` and sends it only in
/// `Authorization` headers to `/v1/status`, `/metrics` and `/v1/events`.
fn dashboard() -> Response<ResBody> {
    const PAGE: &str = include_str!("ui.html");
    let mut r = Response::new(ResBody::Full(Some(Bytes::from_static(PAGE.as_bytes()))));
    let headers = r.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
             connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; \
             base-uri 'none'; form-action 'none'",
        ),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    r
}

/// The OpenAI endpoint a path names.
fn inference_endpoint(path: &str) -> Option<Endpoint> {
    [Endpoint::Chat, Endpoint::Completions, Endpoint::Embeddings]
        .into_iter()
        .find(|endpoint| endpoint.path() == path)
}

/// The one method a known route answers (`None` for paths that are no route).
fn allowed_method(path: &str) -> Option<&'static str> {
    match path {
        "/healthz" | "/metrics" | "/v1/models" | "/v1/status" | "/v1/events" | "/v1/usage"
        | "/ui" => Some("GET"),
        "/v1/chat/completions"
        | "/v1/completions"
        | "/v1/embeddings"
        | iop_api::anthropic::MESSAGES_PATH
        | iop_api::anthropic::COUNT_TOKENS_PATH
        | iop_api::responses::RESPONSES_PATH => Some("POST"),
        p if p.starts_with("/v1/models/") => Some("GET"),
        p if p.starts_with("/v1/responses/") => Some("GET, DELETE"),
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

/// The token of an `Authorization: Bearer <token>` header (the scheme is
/// case-insensitive, RFC 9110 section 11.1), else of an `x-api-key` header (how the
/// Anthropic SDKs send a key): the same keys either way.
fn bearer<B>(req: &Req<B>) -> Option<&str> {
    // One pass over the fields for both names (the first value of each, as a lookup
    // finds it).
    let (mut authorization, mut api_key) = (None, None);
    for (name, value) in req.headers().iter() {
        if name.eq_ignore_ascii_case(b"authorization") {
            authorization.get_or_insert(value);
        } else if name.eq_ignore_ascii_case(b"x-api-key") {
            api_key.get_or_insert(value);
        }
    }
    let bearer = || {
        let value = fields::text(authorization?)?;
        let (scheme, token) = value.trim().split_once([' ', '\t'])?;
        scheme
            .eq_ignore_ascii_case("bearer")
            .then(|| token.trim())
            .filter(|t| !t.is_empty())
    };
    bearer().or_else(|| {
        api_key
            .and_then(fields::text)
            .map(str::trim)
            .filter(|t| !t.is_empty())
    })
}

/// Who is calling: the name of the key that matched (a `[[auth.keys]]` name, or
/// `api_keys[2]`, `admin_keys[0]` for unnamed keys), never the key itself; `anonymous`
/// where no key is required.
#[derive(Clone, Debug)]
pub(crate) struct Caller {
    /// The key's name.
    pub(crate) name: Arc<str>,
    /// A key (named or not): its usage is accounted.
    pub(crate) keyed: bool,
}

impl std::fmt::Display for Caller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

/// Whether a proxy forwarded the request: such a caller is never local, whatever
/// address the connection came from.
fn proxied<B>(req: &Req<B>) -> bool {
    let headers = req.headers();
    ["forwarded", "x-forwarded-for", "x-real-ip"]
        .iter()
        .any(|name| headers.contains(name))
}

/// The caller when it may use a route of `access`; else the 401 or 403 to answer.
fn authorize<B>(
    req: &Req<B>,
    peer: std::net::SocketAddr,
    settings: &HttpSettings,
    access: Access,
) -> Result<Caller, ApiError> {
    use iop_proto_core::TokenVerifier;
    // Hashed once, compared with every configured key in constant time.
    let presented = bearer(req).map(|p| iop_proto_core::token::sha256(p.as_bytes()));
    let admin = presented.and_then(|p| TokenVerifier::find_digest(&settings.admin_keys, &p));
    let client = presented.and_then(|p| {
        if let Some(i) = TokenVerifier::find_digest(settings.keys.iter().map(|k| &k.verifier), &p) {
            return Some(Caller {
                name: settings.keys[i].name.clone(),
                keyed: true,
            });
        }
        TokenVerifier::find_digest(&settings.api_keys, &p).map(|i| Caller {
            name: settings.api_key_names[i].clone(),
            keyed: true,
        })
    });
    let who = || {
        client.clone().unwrap_or_else(|| match admin {
            Some(i) => Caller {
                name: settings.admin_key_names[i].clone(),
                keyed: true,
            },
            None => Caller {
                name: crate::config::anonymous(),
                keyed: false,
            },
        })
    };
    let unauthorized = || {
        ApiError::new(
            401,
            ErrorType::InvalidRequest,
            "Incorrect API key provided.",
            Some("invalid_api_key"),
        )
    };
    let forbidden = |message: &str| {
        ApiError::new(
            403,
            ErrorType::InvalidRequest,
            message,
            Some("permission_denied"),
        )
    };
    match access {
        Access::Open => Ok(who()),
        Access::Client => {
            if !settings.keys_required() || client.is_some() || admin.is_some() {
                Ok(who())
            } else {
                Err(unauthorized())
            }
        }
        Access::Admin if settings.admin_keys.is_empty() => {
            if settings.admin_loopback && peer.ip().is_loopback() && !proxied(req) {
                Ok(who())
            } else {
                Err(forbidden(
                    "This route is for operators and no admin key is configured: set [auth] \
                     admin_keys (or admin_loopback = true to open it to this host alone).",
                ))
            }
        }
        Access::Admin => {
            if admin.is_some() {
                Ok(who())
            } else if client.is_some() {
                Err(forbidden(
                    "This route needs an admin key, not a client key.",
                ))
            } else {
                Err(unauthorized())
            }
        }
    }
}
