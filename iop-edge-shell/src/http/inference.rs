//! The inference routes: read the body, ask the core task to queue it, then write what
//! the core's [`Responder`] renders from the request's events. Everything decided about
//! the response (its shape, its errors, keep-alive placement) is the `Responder`'s; this
//! module only moves bytes, runs the deadline and keep-alive timers, and notices a caller
//! that left.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use iop_proto_core::RequestId;
use iop_proto_core::openai::{
    ApiError, Endpoint, ErrorType, Out, Responder, ResponseOptions, inspect,
};
use iop_proto_core::wire::Header;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::error;

use super::{Chunk, ResBody, State, api_error, json_response, now_secs};
use crate::config::HttpSettings;
use crate::core_task::{CoreMsg, Events, ReqEvent, Work};
use crate::memory::RequestMemory;
use crate::metrics::Metrics;

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

/// Reads a request body within the size limit, the memory budget and the body deadline,
/// into one buffer (sized from `content-length` when given, so it is never copied again).
async fn read_body(
    body: Incoming,
    content_length: Option<u64>,
    settings: &HttpSettings,
    memory: &RequestMemory,
) -> Result<Bytes, ApiError> {
    let max = settings.max_body_bytes;
    let too_large = || {
        ApiError::new(
            413,
            ErrorType::InvalidRequest,
            format!("request body exceeds {max} bytes"),
            Some("body_too_large"),
        )
    };
    let overloaded = || {
        ApiError::new(
            503,
            ErrorType::Server,
            "the edge is holding as many request bytes as it may; retry shortly",
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
                return Err(ApiError::new(
                    408,
                    ErrorType::InvalidRequest,
                    format!(
                        "the request body did not arrive within {} s",
                        settings.body_read_timeout.as_secs()
                    ),
                    Some("body_timeout"),
                ));
            }
            Ok(None) => break,
            Ok(Some(Err(_))) => {
                return Err(ApiError::bad_request(
                    "could not read the request body",
                    None,
                ));
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

/// `POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings`.
pub(super) async fn inference(
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
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let memory = RequestMemory::new(state.budget.clone());
    // From here the body and everything buffered for the caller count against the budget
    // until the handler is done.
    let (tx, rx) = mpsc::unbounded_channel();
    let events = Events {
        rx,
        memory: memory.clone(),
    };
    let raw = match read_body(req.into_body(), content_length, &settings, &memory).await {
        Ok(raw) => raw,
        Err(refusal) => return api_error(&refusal),
    };
    // The concurrency permit is taken only once the body is in: slow senders cannot hold
    // the permits every other caller needs.
    let Ok(permit) = state.permits.clone().try_acquire_owned() else {
        return api_error(&ApiError::new(
            503,
            ErrorType::Server,
            "too many concurrent requests",
            Some("overloaded"),
        ));
    };
    let asked = match inspect(&raw, endpoint) {
        Ok(asked) => asked,
        Err(refusal) => return api_error(&refusal),
    };

    let (reply, answer) = oneshot::channel();
    let work = Work {
        endpoint,
        raw,
        stream: asked.stream,
        headers,
        timeout: settings.response_timeout,
    };
    let submit = CoreMsg::Submit {
        model: asked.model.clone(),
        prompt_tokens: asked.prompt_tokens,
        work,
        events: tx,
        memory,
        reply,
    };
    if state.core.send(submit).await.is_err() {
        return api_error(&ApiError::shutting_down());
    }
    let mut finish = Finish {
        metrics: state.metrics.clone(),
        model: asked.model.clone(),
        started,
        first_byte: false,
    };
    let request = match answer.await {
        Ok(Ok(request)) => request,
        Ok(Err(refused)) => {
            if matches!(refused, iop_proto_core::SubmitError::UnknownModel(_)) {
                // Unknown names are caller input: keep them out of metric labels.
                finish.model = "_unknown".to_owned();
            }
            let refusal = ApiError::from_submit(&refused, endpoint);
            finish.done(refusal.status);
            return api_error(&refusal);
        }
        Err(_) => return api_error(&ApiError::shutting_down()),
    };
    let guard = CancelGuard {
        core: state.core.clone(),
        request,
        armed: true,
        reason: "caller disconnected",
    };
    let timers = Timers {
        deadline: started + settings.response_timeout,
        keepalive: settings.sse_keepalive,
    };
    let run_id = iop_proto_core::edge::run_id_of(request);
    let responder = Responder::new(ResponseOptions::new(&asked, &run_id, now_secs()));
    respond(events, responder, guard, timers, finish, permit).await
}

/// The response deadline and the keep-alive interval of a request.
#[derive(Clone, Copy)]
struct Timers {
    deadline: Instant,
    keepalive: Duration,
}

/// What a response waits for next.
enum Next {
    /// An event of the request.
    Event(Box<ReqEvent>),
    /// Nothing for one keep-alive interval.
    Idle,
    /// The response deadline passed.
    TimedOut,
    /// The caller is gone (hyper dropped the response body).
    Gone,
}

/// Hands an event of the request to the responder.
fn feed(responder: &mut Responder, event: ReqEvent, finish: &mut Finish) {
    match event {
        ReqEvent::Dispatched { shape, .. } => responder.handle_dispatched(shape),
        ReqEvent::Run(event) => {
            finish.first_byte();
            responder.handle_run_event(event);
        }
        ReqEvent::Frame(frame) => {
            finish.first_byte();
            responder.handle_tunnel_frame(frame);
        }
        ReqEvent::Ended(outcome) => responder.handle_end(&outcome),
    }
}

/// The next event, `Idle` after `keepalive` without one, `TimedOut` at the deadline, or
/// `Gone` as soon as the caller's connection has dropped the body (`tx` closed). Before
/// the response head there is no body: pass `None`, and a caller that leaves drops this
/// whole future instead.
async fn next(events: &mut Events, timers: Timers, tx: Option<&mpsc::Sender<Chunk>>) -> Next {
    let idle = (Instant::now() + timers.keepalive).min(timers.deadline);
    let gone = async {
        match tx {
            Some(tx) => tx.closed().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        () = gone => Next::Gone,
        event = tokio::time::timeout_at(idle, events.rx.recv()) => match event {
            Ok(Some(event)) => {
                events.memory.consumed(crate::core_task::event_size(&event));
                Next::Event(Box::new(event))
            }
            Ok(None) => Next::TimedOut,
            Err(_) if Instant::now() >= timers.deadline => Next::TimedOut,
            Err(_) => Next::Idle,
        },
    }
}

/// Drives the responder until its first output: a whole response is returned as it is;
/// a head starts a task that streams the body while the head goes back to hyper.
async fn respond(
    mut events: Events,
    mut responder: Responder,
    mut guard: CancelGuard,
    timers: Timers,
    mut finish: Finish,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> Response<ResBody> {
    loop {
        match responder.poll_output() {
            Some(Out::Whole { status, body }) => {
                settle(&mut guard, &responder);
                finish.done(status);
                let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
                return json_response(status, body);
            }
            Some(Out::Head { status, headers }) => {
                let (tx, rx) = mpsc::channel::<Chunk>(16);
                let response = match head(status, &headers, rx) {
                    Ok(response) => response,
                    Err(refusal) => {
                        finish.done(refusal.status);
                        return api_error(&refusal);
                    }
                };
                tokio::spawn(stream_body(
                    events, responder, guard, timers, finish, tx, permit,
                ));
                return response;
            }
            Some(other) => {
                // The responder emits a head before any body piece.
                error!(output = ?other, "body output before the response head");
                debug_assert!(false, "body output before the response head");
            }
            None => {}
        }
        match next(&mut events, timers, None).await {
            Next::Event(event) => feed(&mut responder, *event, &mut finish),
            Next::Idle => responder.handle_idle(),
            Next::TimedOut | Next::Gone => {
                guard.reason = "response timeout";
                responder.handle_timeout();
            }
        }
    }
}

/// A response head; a provider header hyper cannot carry is a 502.
fn head(
    status: u16,
    headers: &[Header],
    rx: mpsc::Receiver<Chunk>,
) -> Result<Response<ResBody>, ApiError> {
    let invalid = || {
        ApiError::new(
            502,
            ErrorType::Server,
            "provider sent invalid headers",
            None,
        )
    };
    let mut response = Response::new(ResBody::Stream(rx));
    *response.status_mut() = StatusCode::from_u16(status).map_err(|_| invalid())?;
    for h in headers {
        let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| invalid())?;
        let value = HeaderValue::from_bytes(&h.value).map_err(|_| invalid())?;
        response.headers_mut().append(name, value);
    }
    Ok(response)
}

/// Writes the body of a streamed response until the responder is done or the caller
/// leaves (then the guard cancels the request).
async fn stream_body(
    mut events: Events,
    mut responder: Responder,
    mut guard: CancelGuard,
    timers: Timers,
    mut finish: Finish,
    tx: mpsc::Sender<Chunk>,
    _permit: tokio::sync::OwnedSemaphorePermit,
) {
    loop {
        while let Some(out) = responder.poll_output() {
            let chunk = match out {
                Out::Data(bytes) => Ok(Frame::data(bytes)),
                Out::Abort(message) => Err(std::io::Error::other(message)),
                other => {
                    error!(output = ?other, "a second response head");
                    debug_assert!(false, "a second response head");
                    continue;
                }
            };
            if tx.send(chunk).await.is_err() {
                return; // the caller is gone: the guard cancels upstream
            }
        }
        if responder.is_done() {
            break;
        }
        match next(&mut events, timers, Some(&tx)).await {
            Next::Gone => return,
            Next::Event(event) => feed(&mut responder, *event, &mut finish),
            Next::Idle => responder.handle_idle(),
            Next::TimedOut => {
                guard.reason = "response timeout";
                responder.handle_timeout();
            }
        }
    }
    settle(&mut guard, &responder);
    finish.done(responder.status().unwrap_or(599));
}

/// A response that is done needs no cancel once the core has ended its request.
fn settle(guard: &mut CancelGuard, responder: &Responder) {
    if !responder.needs_cancel() {
        guard.disarm();
    }
}
