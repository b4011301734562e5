//! The inference routes: read the body, ask the core to queue it, then write what
//! the core's [`Responder`] renders from the request's events. Everything decided about
//! the response (its shape, its errors, keep-alive placement) is the `Responder`'s; this
//! module only moves bytes, runs the deadline and keep-alive timers, and notices a caller
//! that left.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use iop_api::anthropic::{self, TranslateOptions, Translated};
use iop_api::dialect::{Dialect, Responder};
use iop_api::openai::{
    self, ApiError, Endpoint, ErrorType, Out, RATE_LIMIT_HEADERS, RequestFacts, inspect,
    rate_limit_headers,
};
use iop_api::responses;
use iop_api::tenant::{RateLimits, Refusal};
use iop_proto_core::RequestEvent;
use iop_proto_core::wire::{ForwardedHeaders, ForwardedHeadersBuilder, Header};
use iop_shell_common::deadline::PooledSleep;
use iop_shell_common::offload;
use iop_trace::{TRACEPARENT, TRACESTATE};
use tokio::time::{Instant, Sleep};
use tracing::error;

use super::fields::{Fields, Req, text};
use super::{Caller, ReqBody, ResBody, State, dialect_error, json_response, now_secs};
use crate::config::HttpSettings;
use crate::driver::{CoreMsg, Events};
use crate::memory::RequestMemory;
use crate::tenants::Ticket;

/// `limits` (and `retry_after`) as OpenAI's rate-limit headers, each value copied once.
fn insert_rate_limits(
    headers: &mut http::HeaderMap,
    limits: &RateLimits,
    retry_after: Option<Duration>,
) {
    // Names made once; a `&str` name is parsed, and a custom one allocated, per insert.
    static NAMES: [HeaderName; 8] = [
        HeaderName::from_static(RATE_LIMIT_HEADERS[0]),
        HeaderName::from_static(RATE_LIMIT_HEADERS[1]),
        HeaderName::from_static(RATE_LIMIT_HEADERS[2]),
        HeaderName::from_static(RATE_LIMIT_HEADERS[3]),
        HeaderName::from_static(RATE_LIMIT_HEADERS[4]),
        HeaderName::from_static(RATE_LIMIT_HEADERS[5]),
        HeaderName::from_static(RATE_LIMIT_HEADERS[6]),
        HeaderName::from_static(RATE_LIMIT_HEADERS[7]),
    ];
    let values = rate_limit_headers(limits, retry_after);
    headers.reserve(values.iter().flatten().count());
    for (name, value) in NAMES.iter().zip(values) {
        if let Some(value) = value
            && let Ok(value) = HeaderValue::from_str(value.as_str())
        {
            headers.insert(name.clone(), value);
        }
    }
}

/// The response header that names a request; the caller may choose the value.
pub(super) const REQUEST_ID_HEADER: &str = "x-request-id";

/// [`REQUEST_ID_HEADER`] as a header name, made once (a `&str` key is parsed on every
/// lookup, and a custom name allocated on every insert).
static REQUEST_ID: HeaderName = HeaderName::from_static(REQUEST_ID_HEADER);

/// Where a tunnelled provider's own `x-request-id` goes when it differs from ours.
static UPSTREAM_REQUEST_ID: HeaderName = HeaderName::from_static("x-upstream-request-id");

/// An inference route: an OpenAI endpoint, or the Messages API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`.
    OpenAi(Endpoint),
    /// `/v1/messages`.
    Messages,
    /// `/v1/responses`.
    Responses,
}

impl Route {
    /// The dialect its answers are in.
    pub(crate) fn dialect(self) -> Dialect {
        match self {
            Route::OpenAi(_) => Dialect::OpenAi,
            Route::Messages => Dialect::Anthropic,
            Route::Responses => Dialect::Responses,
        }
    }

    /// The OpenAI endpoint its request is dispatched as (Messages: chat, translated).
    fn endpoint(self) -> Endpoint {
        match self {
            Route::OpenAi(endpoint) => endpoint,
            Route::Messages | Route::Responses => Endpoint::Chat,
        }
    }

    /// Its path, for logs and spans.
    pub(crate) fn path(self) -> &'static str {
        match self {
            Route::OpenAi(endpoint) => endpoint.path(),
            Route::Messages => anthropic::MESSAGES_PATH,
            Route::Responses => responses::RESPONSES_PATH,
        }
    }
}

/// What a request body asks, read in its dialect.
enum Asked {
    OpenAi(RequestFacts),
    Anthropic(Translated),
    Responses(Box<responses::Translated>),
}

impl Asked {
    fn facts(&self) -> &RequestFacts {
        match self {
            Asked::OpenAi(facts) => facts,
            Asked::Anthropic(translated) => &translated.facts,
            Asked::Responses(translated) => &translated.facts,
        }
    }
}

/// [`inspect`] (or the Messages translation), off the event loop for a large body
/// ([`offload::run`]): the loop (one thread by default) also carries every open stream
/// and the node link's heartbeats, which must not wait behind megabytes of JSON. More
/// such bodies at once wait their turn for a slot, their bytes already counted against
/// the in-flight budget.
async fn inspect_off_loop(
    raw: &bytes::Bytes,
    route: Route,
    messages: TranslateOptions,
    context: Option<Arc<str>>,
) -> Result<Asked, ApiError> {
    let read = move |body: &[u8]| match route {
        Route::OpenAi(endpoint) => inspect(body, endpoint).map(Asked::OpenAi),
        Route::Messages => anthropic::translate(body, messages).map(Asked::Anthropic),
        // A turn that continues a stored response is translated after its conversation.
        Route::Responses => {
            responses::translate(body, context.as_deref()).map(|t| Asked::Responses(Box::new(t)))
        }
    };
    match offload::run(raw, read).await {
        Ok(inspected) => inspected,
        Err(offload::NotDone::Stopping) => Err(ApiError::shutting_down()),
        Err(offload::NotDone::Panicked) => Err(ApiError::new(
            500,
            ErrorType::Server,
            "the request body could not be inspected",
            None,
        )),
    }
}

/// The caller's `x-request-id` when the contract admits it
/// ([`iop_proto_core::wire::is_request_id`]); else a fresh id.
pub(super) fn request_id(headers: &Fields) -> Arc<str> {
    admitted_request_id(headers.get(REQUEST_ID_HEADER)).unwrap_or_else(fresh_request_id)
}

/// The id of an `x-request-id` value the contract admits.
fn admitted_request_id(given: Option<&[u8]>) -> Option<Arc<str>> {
    given
        .filter(|v| iop_proto_core::wire::is_request_id(v))
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(Arc::from)
}

/// `req_` and 24 hex digits: a per-process prefix and a counter, unique across restarts
/// and cheap to make. Not a secret.
fn fresh_request_id() -> Arc<str> {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU32, Ordering};
    const HEX: &[u8; 16] = b"0123456789abcdef";
    // `req_` and the prefix's 16 digits, written once.
    static HEAD: OnceLock<[u8; 20]> = OnceLock::new();
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let head = HEAD.get_or_init(|| {
        let prefix = iop_shell_common::process::nonce();
        let mut head = *b"req_0000000000000000";
        for (i, byte) in head[4..].iter_mut().rev().enumerate() {
            *byte = HEX[((prefix >> (4 * i)) & 0xF) as usize];
        }
        head
    });
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    // Written by hand: `format!` cost more than the rest of the id's making together.
    let mut id = [0u8; 28];
    id[..20].copy_from_slice(head);
    for (i, byte) in id[20..].iter_mut().rev().enumerate() {
        *byte = HEX[((n >> (4 * i)) & 0xF) as usize];
    }
    Arc::from(std::str::from_utf8(&id).unwrap_or("req_"))
}

/// The body length a request's head declares (`content-length`), if it declares one.
pub(super) fn declared_length(headers: &Fields) -> Option<u64> {
    headers.get("content-length").and_then(content_length)
}

/// A `content-length` value's length: what `str::parse::<u64>` reads (an optional `+`,
/// then decimal digits, in range), digit by digit.
fn content_length(value: &[u8]) -> Option<u64> {
    let digits = value.strip_prefix(b"+").unwrap_or(value);
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &b| {
        let digit = b.checked_sub(b'0').filter(|d| *d < 10)?;
        n.checked_mul(10)?.checked_add(u64::from(digit))
    })
}

/// Reads a request body within the size limit, the memory budget and the body deadline.
/// A body that arrives as one piece of its declared length is kept as it came; pieces are
/// joined into one buffer of the declared size (so it is never copied again).
pub(super) async fn read_body<B: ReqBody>(
    body: B,
    content_length: Option<u64>,
    settings: &HttpSettings,
    memory: &RequestMemory,
    mut deadline: Pin<&mut Sleep>,
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
    // The declared body in one piece is kept as it came (a slice of the connection's read
    // buffer); otherwise the pieces are joined into one buffer of the declared size.
    let mut whole: Option<Bytes> = None;
    let mut buf = bytes::BytesMut::new();
    let mut body = body;
    loop {
        // One timer for the whole body (the request's, see `Live`), not one per frame.
        let mut next = body.frame();
        let frame = std::future::poll_fn(|cx| match Pin::new(&mut next).poll(cx) {
            Poll::Ready(frame) => Poll::Ready(Ok(frame)),
            Poll::Pending => deadline.as_mut().poll(cx).map(Err),
        })
        .await;
        let frame = match frame {
            Err(()) => {
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
        if let Some(first) = whole.take() {
            buf.reserve(declared.max(first.len() + data.len()));
            buf.extend_from_slice(&first);
        }
        if buf.is_empty() && declared > 0 && data.len() == declared {
            whole = Some(data);
            continue;
        }
        if buf.capacity() == 0 {
            buf.reserve(declared);
        }
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
    Ok(whole.unwrap_or_else(|| buf.freeze()))
}

/// `POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/messages`.
/// Every answer, error or not, names the request in `x-request-id` (and, in the Messages
/// dialect, in `request-id`, where the Anthropic SDKs read it).
pub(super) async fn inference<B: ReqBody>(
    req: Req<B>,
    state: Arc<State>,
    route: Route,
    caller: Caller,
) -> Response<ResBody> {
    let settings = state.settings();
    let head = HeadFacts::read(
        req.headers(),
        settings.session_header.as_ref(),
        &state.tracer,
    );
    let id = head.request_id.clone();
    let mut limits = None;
    let mut response = handle(req, state, settings, route, caller, head, &mut limits).await;
    let headers = response.headers_mut();
    // A limited key's limits as its admission left them, on every response it gets (a
    // refusal carries its own).
    if let Some(limits) = limits {
        insert_rate_limits(headers, &limits, None);
    }
    // A provider that names the request its own way (OpenAI's `req_…`) keeps its id
    // visible under another name; the caller's id is the one `x-request-id` carries
    // (the name looked up once for both).
    // The id is one `is_request_id` admits or one made here: always a header value.
    let Ok(value) = HeaderValue::from_str(&id) else {
        return response;
    };
    if route.dialect() == Dialect::Anthropic {
        headers.insert(ANTHROPIC_REQUEST_ID.clone(), value.clone());
    }
    match headers.entry(&REQUEST_ID) {
        http::header::Entry::Occupied(mut given) => {
            let upstream = given.insert(value);
            if upstream.as_bytes() != id.as_bytes() {
                headers.insert(UPSTREAM_REQUEST_ID.clone(), upstream);
            }
        }
        http::header::Entry::Vacant(slot) => {
            slot.insert(value);
        }
    }
    response
}

/// What a request's head says that its handling needs, found in one pass over its
/// fields (a lookup by name hashes the name anew; the five lookups cost more than the
/// pass), with the headers a tunnel forwards written on the way.
struct HeadFacts {
    /// The caller's `x-request-id` when the contract admits it; else a fresh id
    /// ([`request_id`]).
    request_id: Arc<str>,
    /// [`declared_length`].
    content_length: Option<u64>,
    /// The session the headers name ([`SessionPick`]).
    session: Option<String>,
    /// The request's place in a trace ([`RequestTrace::begin`]).
    trace: Option<RequestTrace>,
    /// The headers the provider sees, encoded as the tunnel request carries them: the
    /// forwarded ones in the order sent, the request id (the provider sees the request
    /// under the caller's id, in both logs), then the trace context.
    forward: ForwardedHeadersBuilder,
}

impl HeadFacts {
    fn read(
        headers: &Fields,
        session_header: Option<&HeaderName>,
        tracer: &crate::traces::Tracer,
    ) -> HeadFacts {
        const _: () = assert!(
            fits(&iop_proto_core::tunnel::FORWARDED_REQUEST_HEADERS)
                && fits(&iop_proto_core::edge::SESSION_HEADERS)
                && fits(&[REQUEST_ID_HEADER, "content-length", TRACEPARENT, TRACESTATE]),
            "a name matched below is longer than the buffer it is lower-cased into"
        );
        const REQUEST_ID_NAME: &[u8] = REQUEST_ID_HEADER.as_bytes();
        const TRACEPARENT_NAME: &[u8] = TRACEPARENT.as_bytes();
        const TRACESTATE_NAME: &[u8] = TRACESTATE.as_bytes();
        // One buffer, with room for the usual few and the trace context's two (it grows
        // for more).
        let mut forward = ForwardedHeaders::builder(FORWARDED_CAPACITY);
        let mut session = SessionPick::new(session_header);
        // The first value of each, as `HeaderMap::get` reads it.
        let (mut given, mut length, mut parent, mut tracestate) = (None, None, None, None);
        for (name, value) in headers.iter() {
            // Names come as sent, in any case: matched lower-cased (no name matched here
            // is longer than the buffer; see `fits`).
            let mut buf = [0u8; NAME_ROOM];
            let lower = buf.get_mut(..name.len()).map(|lower| {
                lower.copy_from_slice(name);
                lower.make_ascii_lowercase();
                &*lower
            });
            session.offer(name, lower, value);
            let Some(lower) = lower else { continue };
            match lower {
                REQUEST_ID_NAME => _ = given.get_or_insert(value),
                b"content-length" => _ = length.get_or_insert(value),
                TRACEPARENT_NAME => _ = parent.get_or_insert(value),
                TRACESTATE_NAME => _ = tracestate.get_or_insert(value),
                _ => {
                    if let Some(name) = iop_proto_core::tunnel::FORWARDED_REQUEST_HEADERS
                        .into_iter()
                        .find(|known| known.as_bytes() == lower)
                    {
                        forward.push(name, value);
                    }
                }
            }
        }
        let request_id = admitted_request_id(given).unwrap_or_else(fresh_request_id);
        forward.push(REQUEST_ID_HEADER, request_id.as_bytes());
        let trace = RequestTrace::begin(parent, tracestate, tracer, &mut forward);
        HeadFacts {
            request_id,
            content_length: length.and_then(content_length),
            session: session.take(),
            trace,
            forward,
        }
    }
}

/// Room for the longest header name [`HeadFacts::read`] matches, lower-cased.
const NAME_ROOM: usize = 32;

/// Whether every name in `names` fits [`NAME_ROOM`].
const fn fits(names: &[&str]) -> bool {
    let mut i = 0;
    while i < names.len() {
        if names[i].len() > NAME_ROOM {
            return false;
        }
        i += 1;
    }
    true
}

/// The header the Anthropic SDKs read a request's id from.
/// Bytes first set aside for a request's forwarded headers, encoded: the usual few, the
/// request id and a trace context fit.
const FORWARDED_CAPACITY: usize = 256;

static ANTHROPIC_REQUEST_ID: HeaderName = HeaderName::from_static("request-id");

async fn handle<B: ReqBody>(
    req: Req<B>,
    state: Arc<State>,
    settings: Arc<HttpSettings>,
    route: Route,
    caller: Caller,
    head: HeadFacts,
    limits: &mut Option<RateLimits>,
) -> Response<ResBody> {
    let started = Instant::now();
    let HeadFacts {
        request_id,
        content_length,
        session: session_header,
        trace,
        forward: headers,
    } = head;
    // Until the body names a model the Edge serves, the metric label says `_unknown`.
    let mut finish = Finish {
        metrics: state.metrics.clone(),
        model: crate::metrics::unknown_model(),
        started,
        first_byte: None,
        request_id: request_id.clone(),
        caller,
        route,
        dispatched: None,
        ticket: None,
        trace: None,
        tracer: state.tracer.clone(),
        series: None,
    };
    let dialect = route.dialect();
    let refuse = |finish: &mut Finish, refusal: &ApiError| {
        let response = dialect_error(dialect, refusal, &finish.request_id);
        finish.done(response.status().as_u16(), None);
        response
    };
    // Counted from here to the end of its response, so that a draining Edge waits for
    // it; one that arrives while the Edge drains is refused (after a hand-over, with the
    // successor's retryable answer).
    let mut open = match state.drain.enter() {
        Ok(open) => open,
        Err(crate::drain::Refused::Draining) => {
            return refuse(&mut finish, &ApiError::shutting_down());
        }
        Err(crate::drain::Refused::HandedOver) => {
            return refuse(&mut finish, &ApiError::handing_over());
        }
    };
    // A cluster Edge that has not joined yet holds no node: it answers at once,
    // retryable, rather than hold a request no node here may serve. (One that lost etcd
    // after it joined serves on with the nodes it holds.)
    if state.cluster.as_ref().is_some_and(|c| !c.serves()) {
        let mut response = refuse(
            &mut finish,
            &ApiError::new(
                503,
                ErrorType::Server,
                "this edge has not joined its cluster yet; try another",
                Some("not_a_member"),
            ),
        );
        response
            .headers_mut()
            .insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
        return response;
    }
    finish.trace = trace;
    // A Responses turn may need a stored conversation from another Edge, asked for with
    // the caller's own credential.
    let credential = match route {
        Route::Responses => super::peers::credential(req.headers()),
        _ => None,
    };
    // From here the body and everything buffered for the caller count against the budget
    // until the handler is done.
    let (tx, mut events) = crate::driver::events(state.budget.clone());
    // The body's deadline (the response's is `Live`'s).
    let timer = std::pin::pin!(tokio::time::sleep_until(
        started + settings.body_read_timeout,
    ));
    let raw = match read_body(
        req.into_body(),
        content_length,
        &settings,
        events.memory(),
        timer,
    )
    .await
    {
        Ok(raw) => raw,
        Err(refusal) => return refuse(&mut finish, &refusal),
    };
    // The concurrency permit is taken only once the body is in: slow senders cannot hold
    // the permits every other caller needs.
    let Ok(permit) = state.permits.try_take() else {
        return refuse(
            &mut finish,
            &ApiError::new(
                503,
                ErrorType::Server,
                "too many concurrent requests",
                Some("overloaded"),
            ),
        );
    };
    let translate = TranslateOptions {
        keep_billing_header: settings.keep_billing_header,
        ..TranslateOptions::default()
    };
    let context = match route {
        // Boxed: a peer fetch's state is larger than the rest of this handler's, and
        // every other request's future would carry (and be moved with) its room.
        Route::Responses => {
            match Box::pin(previous_context(
                &state,
                &finish.caller.name,
                credential,
                &raw,
            ))
            .await
            {
                Ok(context) => context,
                Err(refusal) => return refuse(&mut finish, &refusal),
            }
        }
        _ => None,
    };
    let asked = match inspect_off_loop(&raw, route, translate, context).await {
        Ok(asked) => asked,
        Err(refusal) => return refuse(&mut finish, &refusal),
    };
    let facts = asked.facts();
    // The key's models, limits and budget; its usage is counted when the request ends.
    // A caller with no key (no key is required) is not accounted, and pays nothing.
    let estimate = facts
        .prompt_tokens
        .saturating_add(facts.max_tokens.unwrap_or(0));
    let admitted = if finish.caller.keyed {
        state
            .tenants
            .admit(&finish.caller.name, &facts.model, estimate)
            .map(Some)
    } else {
        Ok(None)
    };
    match admitted {
        Ok(ticket) => {
            *limits = ticket
                .as_ref()
                .map(Ticket::limits)
                .filter(|l| l.requests.is_some() || l.tokens.is_some());
            finish.ticket = ticket;
        }
        Err(limited) => {
            let refusal = ApiError::limited(&limited, &facts.model);
            let mut response = refuse(&mut finish, &refusal);
            insert_rate_limits(response.headers_mut(), &limited.limits, limited.retry_after);
            // A spent budget does not come back within a client's retries: the SDKs
            // read this and give up at once.
            if limited.refusal == Refusal::Budget {
                response
                    .headers_mut()
                    .insert("x-should-retry", HeaderValue::from_static("false"));
            }
            return response;
        }
    }

    let model: Arc<str> = Arc::from(facts.model.as_str());
    // A Messages request is dispatched as its chat translation; a provider that serves
    // the Messages API itself is sent the caller's body.
    let (body, native) = match &asked {
        Asked::OpenAi(_) => (raw, None),
        Asked::Responses(translated) => (translated.chat.clone(), None),
        Asked::Anthropic(translated) => (
            translated.chat.clone(),
            Some(iop_proto_core::edge::NativeCall {
                dialect: iop_proto_core::tunnel::Dialect::Messages,
                body: raw,
            }),
        ),
    };
    let submit = CoreMsg::Submit {
        submit: iop_proto_core::Submit {
            model: model.clone(),
            endpoint: route.endpoint(),
            body,
            stream: facts.stream,
            prompt_tokens: facts.prompt_tokens,
            headers: headers.finish(),
            request_id,
            timeout: settings.response_timeout,
            native,
            session: session_header
                .or_else(|| facts.session.clone())
                .map(Arc::from),
        },
        events: tx,
    };
    if state.core.send(submit).is_err() {
        return refuse(&mut finish, &ApiError::shutting_down());
    }
    finish.model = model;
    let answer = events.submitted().await;
    open.submitted();
    let request = match answer {
        Some(Ok(request)) => request,
        Some(Err(refused)) => {
            if matches!(refused, iop_proto_core::SubmitError::UnknownModel(_)) {
                // Unknown names are caller input: keep them out of metric labels.
                finish.model = crate::metrics::unknown_model();
            }
            return refuse(
                &mut finish,
                &ApiError::from_submit(&refused, route.endpoint()),
            );
        }
        None => return refuse(&mut finish, &ApiError::shutting_down()),
    };
    let guard = CancelGuard {
        core: state.core.clone(),
        request,
        armed: true,
        reason: "caller disconnected",
    };
    let run_id = iop_proto_core::edge::run_id_of(request);
    // A stored response is kept once it ends well, for its caller alone.
    let (responder, keep) = match asked {
        Asked::OpenAi(mut facts) => {
            // The request's own model name and run id, moved rather than copied.
            let model = std::mem::take(&mut facts.model);
            let options = openai::ResponseOptions::serving(model, &facts, run_id, now_secs());
            (Responder::OpenAi(openai::Responder::new(options)), None)
        }
        Asked::Anthropic(translated) => (
            Responder::Anthropic(Box::new(anthropic::Responder::new(
                translated.response_options(&run_id, &finish.request_id),
            ))),
            None,
        ),
        Asked::Responses(translated) => (
            Responder::Responses(Box::new(responses::Responder::new(
                translated.response_options(
                    &response_id(&run_id, state.cluster.as_deref()),
                    &finish.request_id,
                    now_secs(),
                ),
            ))),
            translated.store.then(|| Keep {
                store: state.responses.clone(),
                owner: finish.caller.name.clone(),
                asked: translated,
            }),
        ),
    };
    // The timer moves from the body's deadline to the response's (or an earlier
    // keep-alive comment).
    let now = Instant::now();
    let deadline = started + settings.response_timeout;
    let keepalive = settings.sse_keepalive;
    respond(iop_shell_common::in_box!(Live {
        timer: state.timers.sleep_by((now + keepalive).min(deadline)),
        serving: Serving {
            events,
            responder,
            guard,
            finish,
            deadline,
            last_activity: now,
            keepalive,
            recorded: false,
            keep,
            _permit: permit,
            _open: open,
        },
    }))
    .await
}

/// `POST /v1/messages/count_tokens`: a Messages prompt's tokens for a model the caller may
/// use (README, "Claude Code and the Anthropic SDKs"): counted by a provider's tokenizer
/// where one of the model's providers tokenizes ([`exact_count`]), else the Edge's
/// estimate. Nothing is accounted to the caller's key.
pub(super) async fn count_tokens<B: ReqBody>(
    req: Req<B>,
    state: Arc<State>,
    caller: Caller,
) -> Response<ResBody> {
    let id = request_id(req.headers());
    let settings = state.settings();
    let answer = async {
        let memory = RequestMemory::new(state.budget.clone());
        let deadline = tokio::time::sleep(settings.body_read_timeout);
        tokio::pin!(deadline);
        let content_length = declared_length(req.headers());
        let raw = read_body(
            req.into_body(),
            content_length,
            &settings,
            &memory,
            deadline.as_mut(),
        )
        .await?;
        let options = TranslateOptions {
            keep_billing_header: settings.keep_billing_header,
            ..TranslateOptions::default()
        };
        let counted =
            match offload::run(&raw, move |body| anthropic::count_tokens(body, options)).await {
                Ok(counted) => counted?,
                Err(_) => return Err(ApiError::shutting_down()),
            };
        if !settings.display_names.contains_key(&counted.model)
            || !state.tenants.may_use(&caller.name, &counted.model)
        {
            return Err(ApiError::model_not_found(&counted.model));
        }
        let mut counted = counted;
        if let Some(exact) = exact_count(&state, &counted, &id).await {
            counted.input_tokens = exact;
        }
        Ok(counted.body())
    };
    let mut response = match answer.await {
        Ok(body) => json_response(StatusCode::OK, body),
        Err(refusal) => dialect_error(Dialect::Anthropic, &refusal, &id),
    };
    if let Ok(value) = HeaderValue::from_str(&id) {
        response
            .headers_mut()
            .insert(ANTHROPIC_REQUEST_ID.clone(), value.clone());
        response.headers_mut().insert(REQUEST_ID.clone(), value);
    }
    response
}

/// A Responses answer to store once it ends: where, for whom, and what was asked.
struct Keep {
    store: Arc<std::sync::Mutex<responses::Store>>,
    owner: Arc<str>,
    asked: Box<responses::Translated>,
}

/// A response's id stem ([`responses::id_stem`]): the run id behind a per-process
/// nonce, led in a cluster by this Edge's id.
fn response_id(run_id: &str, cluster: Option<&crate::membership::ClusterView>) -> String {
    use std::sync::OnceLock;
    static NONCE: OnceLock<u64> = OnceLock::new();
    let nonce = *NONCE.get_or_init(iop_shell_common::process::nonce);
    let stem = responses::id_stem(cluster.map(|c| c.edge_id.as_str()), nonce, run_id);
    // In a cluster the id is signed, so that another Edge can trust whom it names.
    match cluster.and_then(crate::membership::ClusterView::responses_key) {
        Some(key) => crate::response_ids::sign(key, &stem),
        None => stem,
    }
}

/// The conversation a Responses turn continues (its `previous_response_id`): from this
/// Edge's store, or, in a cluster, from the Edge whose id the response id names, asked
/// with the caller's credential; else the 400 `previous_response_not_found`.
async fn previous_context(
    state: &State,
    owner: &str,
    credential: super::peers::Credential,
    raw: &Bytes,
) -> Result<Option<Arc<str>>, ApiError> {
    // Read off the event loop for a large body, as the translation is.
    let named = offload::run(raw, responses::previous_response_id)
        .await
        .map_err(|_| ApiError::shutting_down())?;
    let Some(id) = named? else {
        return Ok(None);
    };
    let local = state
        .responses
        .lock()
        .ok()
        .and_then(|store| store.get(&id, owner).map(|s| s.conversation.clone()));
    if let Some(conversation) = local {
        return Ok(Some(conversation));
    }
    let not_found = || responses::previous_not_found(&id);
    let cluster = state.cluster.as_ref().ok_or_else(not_found)?;
    // Only a signed id names an Edge to ask: a forged one is refused without a request.
    let signed = cluster
        .responses_key()
        .is_some_and(|key| crate::response_ids::verify(key, &id));
    let edge = responses::owner_of(&id)
        .filter(|edge| signed && *edge != cluster.edge_id)
        .ok_or_else(not_found)?;
    let addr = cluster
        .snapshot()
        .members
        .into_iter()
        .find(|m| m.edge_id == edge)
        .map(|m| m.http_addr)
        .ok_or_else(not_found)?;
    let limit = state.settings().max_body_bytes;
    super::peers::conversation(&addr, &id, credential, limit)
        .await
        .map(Some)
        .ok_or_else(not_found)
}

/// The longest a count waits for a provider's tokenizer before answering its estimate.
const TOKENIZE_WAIT: Duration = Duration::from_secs(3);

/// The session a request's headers name, as the fields go by: the configured header's,
/// else the first of [`iop_proto_core::edge::SESSION_HEADERS`] present (a non-empty value
/// of at most [`iop_proto_core::edge::MAX_SESSION_KEY`] bytes).
struct SessionPick<'h> {
    configured: Option<&'h HeaderName>,
    best: Option<(usize, &'h str)>,
}

impl<'h> SessionPick<'h> {
    fn new(configured: Option<&'h HeaderName>) -> Self {
        SessionPick {
            configured,
            best: None,
        }
    }

    /// A field named `name` (as sent; `lower` lower-cased, unless too long to be a known
    /// one) of `value`.
    fn offer(&mut self, name: &[u8], lower: Option<&[u8]>, value: &'h [u8]) {
        let rank = if self
            .configured
            .is_some_and(|c| c.as_str().as_bytes().eq_ignore_ascii_case(name))
        {
            0
        } else {
            match lower.and_then(|lower| {
                iop_proto_core::edge::SESSION_HEADERS
                    .iter()
                    .position(|known| known.as_bytes() == lower)
            }) {
                Some(at) => at + 1,
                None => return,
            }
        };
        if self.best.is_some_and(|(taken, _)| taken <= rank) {
            return;
        }
        let Some(value) = text(value) else { return };
        let value = value.trim();
        if !value.is_empty() && value.len() <= iop_proto_core::edge::MAX_SESSION_KEY {
            self.best = Some((rank, value));
        }
    }

    fn take(self) -> Option<String> {
        self.best.map(|(_, value)| value.to_owned())
    }
}

/// A prompt's exact token count from one of its model's providers that tokenizes
/// ([`iop_api::tokenize`]), dispatched through the core as any tunnel (the core picks
/// the provider, and refuses at once when none tokenizes); `None`, and the caller's
/// estimate stands, when none does, or none answered with a count within
/// [`TOKENIZE_WAIT`].
async fn exact_count(
    state: &Arc<State>,
    counted: &anthropic::TokenCount,
    request_id: &Arc<str>,
) -> Option<u64> {
    if counted.tokenize.is_empty() {
        return None;
    }
    let (tx, mut events) = crate::driver::events(state.budget.clone());
    let submit = CoreMsg::Submit {
        submit: iop_proto_core::Submit {
            model: Arc::from(counted.model.as_str()),
            endpoint: Endpoint::Tokenize,
            body: counted.tokenize.clone(),
            stream: false,
            prompt_tokens: counted.input_tokens,
            headers: {
                let mut headers = ForwardedHeaders::builder(FORWARDED_CAPACITY);
                headers.push(REQUEST_ID_HEADER, request_id.as_bytes());
                headers.finish()
            },
            request_id: request_id.clone(),
            timeout: TOKENIZE_WAIT,
            native: None,
            session: None,
        },
        events: tx,
    };
    state.core.send(submit).ok()?;
    // Refused (no provider of the model tokenizes): the estimate stands.
    let request = events.submitted().await?.ok()?;
    let mut guard = CancelGuard {
        core: state.core.clone(),
        request,
        armed: true,
        reason: "count abandoned",
    };
    let read = async {
        let mut status = None;
        let mut prefix = Vec::new();
        let mut whole = true;
        loop {
            let event = std::future::poll_fn(|cx| events.rx.poll_recv(cx)).await?;
            events.memory().consumed(crate::driver::event_size(&event));
            let mut take = |part: iop_proto_core::tunnel::TunnelPart| {
                let frame = part.into_frame();
                if status.is_none() && frame.status_code != 0 {
                    status = Some(frame.status_code);
                }
                if !frame.body.is_empty() {
                    let room = iop_api::tokenize::ANSWER_PREFIX.saturating_sub(prefix.len());
                    whole &= frame.body.len() <= room;
                    prefix.extend_from_slice(&frame.body[..frame.body.len().min(room)]);
                }
            };
            match event {
                RequestEvent::Tunnel(part) => take(part),
                RequestEvent::Tunnels(parts) => parts.into_iter().for_each(take),
                RequestEvent::Ended(outcome) => {
                    let complete = matches!(outcome, iop_proto_core::edge::Outcome::Completed);
                    return (status == Some(200_u32) && complete)
                        .then(|| iop_api::tokenize::answer_count(&prefix, whole))
                        .flatten();
                }
                RequestEvent::Dispatched { .. } | RequestEvent::Run(_) => {}
            }
        }
    };
    let counted = tokio::time::timeout(TOKENIZE_WAIT, read)
        .await
        .ok()
        .flatten();
    if counted.is_some() {
        guard.disarm();
    }
    counted
}

/// A request's response in progress: its events, the core's [`Responder`], and the
/// request's one timer (due at the response deadline or for a keep-alive comment on an
/// idle stream, whichever comes first). It is first polled by the handler until the
/// response head, then becomes the response body, which hyper polls directly: no task and
/// no channel between the request's events and the socket. Dropping it (the caller left)
/// cancels the request through its guard.
pub(crate) struct Serving {
    events: Events,
    responder: Responder,
    guard: CancelGuard,
    finish: Finish,
    /// When the response times out.
    deadline: Instant,
    last_activity: Instant,
    keepalive: Duration,
    recorded: bool,
    /// A Responses answer to store once it ends.
    keep: Option<Keep>,
    _permit: crate::limit::Slot,
    _open: crate::drain::Open,
}

pin_project_lite::pin_project! {
    /// A request being answered ([`Serving`]) and its one timer: due at the deadline or
    /// at the latest `keepalive` after the last activity, whichever comes first; moved
    /// lazily (an event only records its time, so a busy stream never touches the
    /// timer). The timer is one the Edge kept ([`State::timers`]), back in the pool when
    /// the request is done, and taken as it is set: a timer that fires early is set
    /// again for what is due, as one the stream's activity passed by is.
    pub(crate) struct Live {
        timer: PooledSleep,
        serving: Serving,
    }
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live")
            .field("responder", &self.serving.responder)
            .finish_non_exhaustive()
    }
}

impl Live {
    /// The next piece of the response: `Ready(None)` once it is complete.
    fn poll_out(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Out>> {
        let this = self.project();
        this.serving.poll_out(this.timer.as_mut(), cx)
    }

    /// The request being answered.
    fn serving(self: Pin<&mut Self>) -> &mut Serving {
        self.project().serving
    }
}

impl Serving {
    /// The next piece of the response: `Ready(None)` once it is complete.
    fn poll_out(&mut self, mut timer: Pin<&mut Sleep>, cx: &mut Context<'_>) -> Poll<Option<Out>> {
        // The events taken in one poll arrived together: one clock read stamps them all.
        let mut received = None;
        loop {
            if let Some(out) = self.responder.poll_output() {
                return Poll::Ready(Some(out));
            }
            if self.responder.is_done() {
                self.settle();
                return Poll::Ready(None);
            }
            match self.events.rx.poll_recv(cx) {
                Poll::Ready(Some(event)) => {
                    self.events
                        .memory()
                        .consumed(crate::driver::event_size(&event));
                    let at = *received.get_or_insert_with(Instant::now);
                    self.last_activity = at;
                    self.feed(event, at);
                    continue;
                }
                Poll::Ready(None) => {
                    // The core is gone: nothing more will come.
                    self.guard.reason = "response timeout";
                    self.responder.handle_timeout();
                    continue;
                }
                Poll::Pending => {}
            }
            if timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let now = Instant::now();
            if now >= self.deadline {
                self.guard.reason = "response timeout";
                self.responder.handle_timeout();
                continue;
            }
            let due = self.last_activity + self.keepalive;
            if due <= now {
                self.responder.handle_idle(self.keepalive);
                self.last_activity = now;
            }
            let next = (self.last_activity + self.keepalive).min(self.deadline);
            timer.as_mut().reset(next);
        }
    }

    /// Takes `event`, which arrived at `at`.
    fn feed(&mut self, event: RequestEvent, at: Instant) {
        match &event {
            // The event comes once the provider that answers is known (its first byte);
            // the request left the queue when it was first dispatched.
            RequestEvent::Dispatched {
                node_id,
                provider_id,
                ..
            } => self.finish.dispatched(
                node_id.clone(),
                provider_id.clone(),
                self.events.first_dispatch().unwrap_or(at),
            ),
            RequestEvent::Run(_) | RequestEvent::Tunnel(_) | RequestEvent::Tunnels(_) => {
                self.finish.first_byte(at);
            }
            RequestEvent::Ended(_) => {}
        }
        self.responder.handle_event(event);
    }

    /// The response is complete: no cancel once the core ended the request; a response
    /// to keep is stored. Its figures are recorded when it is dropped, once its last
    /// bytes are written.
    fn settle(&mut self) {
        if !self.responder.needs_cancel() {
            self.guard.disarm();
        }
        if let (Some(keep), Responder::Responses(responder)) = (self.keep.take(), &self.responder)
            && let Some((id, conversation, response)) = responses::to_store(&keep.asked, responder)
            && let Ok(mut store) = keep.store.lock()
        {
            let stored = responses::Stored {
                owner: keep.owner,
                conversation: Arc::from(conversation),
                response,
            };
            if !store.insert(&id, stored) {
                tracing::warn!(response_id = %id, "response larger than responses.store_max_bytes: not stored");
            }
        }
    }
}

impl Drop for Serving {
    /// Records the request's figures and writes its log line: after the response is
    /// written (the writer drops it then), so that neither delays the caller, and also
    /// for a caller who left before the end (`499` if no head was sent, like nginx).
    fn drop(&mut self) {
        if !std::mem::replace(&mut self.recorded, true) {
            self.finish.done(
                self.responder.status().unwrap_or(499),
                self.responder.usage(),
            );
        }
    }
}

impl http_body::Body for Live {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        loop {
            return match self.as_mut().poll_out(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Ready(Some(Out::Data(bytes))) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
                Poll::Ready(Some(Out::Abort(message))) => {
                    self.as_mut().serving().settle();
                    Poll::Ready(Some(Err(std::io::Error::other(message))))
                }
                Poll::Ready(Some(other)) => {
                    error!(output = ?other, "a second response head");
                    debug_assert!(false, "a second response head");
                    continue;
                }
            };
        }
    }
}

/// Polls `live` until the response head: a whole response is returned as it is; a head
/// becomes a response whose body is `live` itself.
async fn respond(mut live: Pin<Box<Live>>) -> Response<ResBody> {
    loop {
        match std::future::poll_fn(|cx| live.as_mut().poll_out(cx)).await {
            Some(Out::Whole { status, body }) => {
                live.as_mut().serving().settle();
                let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
                let mut response = json_response(status, Bytes::new());
                // The request is recorded once the body is written and dropped.
                *response.body_mut() = ResBody::Done {
                    body: Some(body),
                    _request: live,
                };
                return response;
            }
            Some(Out::Head { status, headers }) => {
                return match head(status, &headers) {
                    Ok(mut response) => {
                        *response.body_mut() = ResBody::Live(live);
                        response
                    }
                    Err(refusal) => {
                        let serving = live.as_mut().serving();
                        let response = dialect_error(
                            serving.responder.dialect(),
                            &refusal,
                            &serving.finish.request_id,
                        );
                        serving
                            .finish
                            .done(response.status().as_u16(), serving.responder.usage());
                        serving.recorded = true;
                        response
                    }
                };
            }
            Some(other) => {
                // The responder emits a head before any body piece.
                error!(output = ?other, "body output before the response head");
                debug_assert!(false, "body output before the response head");
            }
            None => {
                error!("a response ended without a head");
                return dialect_error(
                    live.serving.responder.dialect(),
                    &ApiError::timeout(),
                    &live.serving.finish.request_id,
                );
            }
        }
    }
}

/// A response head; a provider header hyper cannot carry is a 502.
fn head(status: u16, headers: &[Header]) -> Result<Response<ResBody>, ApiError> {
    let invalid = || {
        ApiError::new(
            502,
            ErrorType::Server,
            "provider sent invalid headers",
            None,
        )
    };
    let mut response = Response::new(ResBody::Full(None));
    *response.status_mut() = StatusCode::from_u16(status).map_err(|_| invalid())?;
    for h in headers {
        let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| invalid())?;
        // The frame's bytes are shared, not copied.
        let value = HeaderValue::from_maybe_shared(h.value.clone()).map_err(|_| invalid())?;
        response.headers_mut().append(name, value);
    }
    Ok(response)
}

mod finish;
use finish::{CancelGuard, Finish, RequestTrace};

#[cfg(test)]
mod tests;
