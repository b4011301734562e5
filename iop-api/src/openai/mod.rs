//! The OpenAI HTTP surface of the Edge, with no IO: what a request body asks for
//! ([`inspect`]), the token estimate the long-context decision rests on
//! ([`estimate_tokens`]), the one mapping from how a request ended to the HTTP error a
//! caller sees ([`ApiError`]), and [`Responder`], which turns one request's events into
//! the bytes of its response: a whole JSON completion, an SSE stream of chunks, or a raw
//! provider tunnel passed through.
//!
//! A shell reads the request body, calls [`inspect`], submits to the
//! [`EdgeCore`](iop_proto_core::EdgeCore), then feeds every event of the request into a
//! [`Responder`] and writes each [`Out`] it hands back, in order:
//!
//! ```
//! use iop_api::openai::{Endpoint, Out, ResponseOptions, Responder, inspect};
//! use iop_proto_core::wire::{RunEvent, RunEventType};
//! use iop_proto_core::{DispatchShape, Outcome};
//!
//! let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
//! let asked = inspect(body, Endpoint::Chat).map_err(|e| e.message)?;
//! let mut responder = Responder::new(ResponseOptions::new(&asked, "run-1", 1_700_000_000));
//! responder.handle_dispatched(DispatchShape::Run);
//! for (sequence, kind, delta) in [(0, RunEventType::Start, ""), (1, RunEventType::Delta, "Hello"), (2, RunEventType::Complete, "")] {
//!     responder.handle_run_event(RunEvent {
//!         run_id: "run-1".into(),
//!         sequence,
//!         r#type: kind as i32,
//!         delta: delta.into(),
//!         ..RunEvent::default()
//!     });
//! }
//! let Some(Out::Whole { status, body }) = responder.poll_output() else { unreachable!() };
//! assert_eq!(status, 200);
//! assert!(std::str::from_utf8(&body)?.contains(r#""content":"Hello""#));
//! assert!(responder.is_done() && !responder.needs_cancel());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod render;
mod request;

pub use render::{Out, Responder, ResponseOptions, SSE_DONE, SSE_KEEPALIVE, parse_text_tool_calls};
#[doc(hidden)]
pub use request::inspect_by_serde;
pub(crate) use request::session_of;
pub use request::{RequestFacts, estimate_tokens, inspect};

use bytes::Bytes;
use serde_json::json;

use iop_proto_core::edge::{CommandError, Outcome, RequestError, SubmitError};
pub use iop_proto_core::tunnel::Endpoint;
use iop_proto_core::wire::ErrorDetail;

/// The body field of `endpoint` that carries the input, required non-empty.
#[must_use]
pub fn input_field(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Chat | Endpoint::Tokenize => "messages",
        Endpoint::Completions => "prompt",
        Endpoint::Embeddings => "input",
    }
}

/// The `type` of an OpenAI error object: what the official SDKs branch on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorType {
    /// The caller's request is at fault (4xx).
    InvalidRequest,
    /// Too many requests for now (429).
    RateLimit,
    /// The service or a provider behind it failed (5xx).
    Server,
}

impl ErrorType {
    /// The wire string.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorType::InvalidRequest => "invalid_request_error",
            ErrorType::RateLimit => "rate_limit_error",
            ErrorType::Server => "server_error",
        }
    }
}

/// The headers that say a key's rate limits as OpenAI's API does, in the order
/// [`rate_limit_headers`] gives their values: `x-ratelimit-{limit,remaining,reset}-requests`,
/// the same for `-tokens`, then when to try again (`retry-after` in whole seconds,
/// `retry-after-ms`), which OpenAI's SDKs read to back off.
pub const RATE_LIMIT_HEADERS: [&str; 8] = [
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
    "retry-after",
    "retry-after-ms",
];

/// The values of [`RATE_LIMIT_HEADERS`] for `limits` and `retry_after`, each present or
/// not; written on the stack, so that the shell copies each once, into its header.
#[must_use]
pub fn rate_limit_headers(
    limits: &crate::tenant::RateLimits,
    retry_after: Option<std::time::Duration>,
) -> [Option<HeaderText>; 8] {
    let mut out = [None; 8];
    for (at, quota) in [(0, limits.requests), (3, limits.tokens)] {
        if let Some(q) = quota {
            out[at] = Some(HeaderText::number(q.limit));
            out[at + 1] = Some(HeaderText::number(q.remaining));
            out[at + 2] = Some(HeaderText::reset(q.reset));
        }
    }
    if let Some(after) = retry_after {
        let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
        out[6] = Some(HeaderText::number(ms.div_ceil(1000).max(1)));
        out[7] = Some(HeaderText::number(ms.max(1)));
    }
    out
}

/// A short header value written without allocating: a number, or a reset time.
#[derive(Clone, Copy)]
pub struct HeaderText {
    buf: [u8; 32],
    len: u8,
}

impl HeaderText {
    fn write(args: std::fmt::Arguments<'_>) -> Self {
        struct Into<'a>(&'a mut [u8; 32], usize);
        impl std::fmt::Write for Into<'_> {
            fn write_str(&mut self, s: &str) -> std::fmt::Result {
                let end = self.1 + s.len();
                let slot = self.0.get_mut(self.1..end).ok_or(std::fmt::Error)?;
                slot.copy_from_slice(s.as_bytes());
                self.1 = end;
                Ok(())
            }
        }
        let mut buf = [0u8; 32];
        let mut into = Into(&mut buf, 0);
        // Every value written here fits: a u64 is at most 20 digits, a reset text 24.
        let _ = std::fmt::write(&mut into, args);
        let len = u8::try_from(into.1).unwrap_or(0);
        HeaderText { buf, len }
    }

    fn number(n: u64) -> Self {
        Self::write(format_args!("{n}"))
    }

    /// A reset time as OpenAI writes it: `20ms`, `1s`, `6m0s`, `1h2m3s` (seconds rounded
    /// up).
    fn reset(d: std::time::Duration) -> Self {
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        if ms < 1000 {
            return Self::write(format_args!("{ms}ms"));
        }
        let s = ms.div_ceil(1000);
        match (s / 3600, s / 60 % 60, s % 60) {
            (0, 0, s) => Self::write(format_args!("{s}s")),
            (0, m, s) => Self::write(format_args!("{m}m{s}s")),
            (h, m, s) => Self::write(format_args!("{h}h{m}m{s}s")),
        }
    }

    /// The value's text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.buf[..usize::from(self.len)]).unwrap_or("")
    }
}

impl std::fmt::Debug for HeaderText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Display for HeaderText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error answer in OpenAI's shape: the HTTP status and the `error` object
/// (`message`, `type`, `code`). Every way a request can fail maps to one of these here,
/// so a caller sees the same status and code for the same cause on every route.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// `error.type`.
    pub kind: ErrorType,
    /// `error.message`: for a person, may name the model or the provider's words.
    pub message: String,
    /// `error.code`: stable, for programs (`None` serializes as `null`).
    pub code: Option<String>,
}

impl ApiError {
    /// An error of any shape.
    #[must_use]
    pub fn new(
        status: u16,
        kind: ErrorType,
        message: impl Into<String>,
        code: Option<&str>,
    ) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            code: code.map(str::to_owned),
        }
    }

    /// A 400 about the request body.
    #[must_use]
    pub fn bad_request(message: impl Into<String>, code: Option<&str>) -> Self {
        Self::new(400, ErrorType::InvalidRequest, message, code)
    }

    /// The response deadline passed (504 `timeout`).
    #[must_use]
    pub fn timeout() -> Self {
        Self::new(
            504,
            ErrorType::Server,
            "the request timed out",
            Some("timeout"),
        )
    }

    /// A request a client key's limits refused ([`crate::tenant`]): 429 with OpenAI's
    /// codes (`rate_limit_exceeded`, `insufficient_quota` for a spent budget), or the 404
    /// of an unknown model for one the key may not use (which says nothing of whether
    /// the model exists).
    #[must_use]
    pub fn limited(limited: &crate::tenant::Limited, model: &str) -> Self {
        use crate::tenant::Refusal;
        let again = limited
            .retry_after
            .map(|d| format!(" Please try again in {}.", HeaderText::reset(d)))
            .unwrap_or_default();
        let rate = |what: &str, quota: Option<crate::tenant::Quota>| {
            let limit = quota
                .map(|q| format!(": limit {}", q.limit))
                .unwrap_or_default();
            Self::new(
                429,
                ErrorType::RateLimit,
                format!("Rate limit reached for `{model}` on {what}{limit}.{again}"),
                Some("rate_limit_exceeded"),
            )
        };
        match limited.refusal {
            Refusal::Model => Self::model_not_found(model),
            Refusal::Requests => rate("requests per minute", limited.limits.requests),
            Refusal::Tokens => rate("tokens per minute", limited.limits.tokens),
            Refusal::Concurrency => rate("requests at once", None),
            Refusal::Budget => Self::new(
                429,
                ErrorType::RateLimit,
                format!("You exceeded this key's token budget.{again}"),
                Some("insufficient_quota"),
            ),
        }
    }

    /// OpenAI's 404 for a model that does not exist, or that the caller may not use.
    #[must_use]
    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            404,
            ErrorType::InvalidRequest,
            format!("The model `{model}` does not exist or you do not have access to it."),
            Some("model_not_found"),
        )
    }

    /// The Edge is stopping and takes no more work (503).
    #[must_use]
    pub fn shutting_down() -> Self {
        Self::new(503, ErrorType::Server, "edge is shutting down", None)
    }

    /// A provider's error before anything was sent: 504 when the provider timed out,
    /// 502 otherwise, with the provider's code.
    #[must_use]
    pub fn provider(detail: &ErrorDetail) -> Self {
        let status = if detail.code == "timeout" { 504 } else { 502 };
        let code = (!detail.code.is_empty()).then_some(detail.code.as_str());
        Self::new(
            status,
            ErrorType::Server,
            format!("provider error: {}", detail.message),
            code,
        )
    }

    /// How a request that ended before its response started is answered.
    #[must_use]
    pub fn from_outcome(outcome: &Outcome) -> Self {
        match outcome {
            Outcome::Expired => Self::new(
                503,
                ErrorType::Server,
                "no provider capacity became free within the queue wait timeout",
                Some("capacity_timeout"),
            ),
            Outcome::Failed(RequestError::NodeLost { .. }) => Self::new(
                503,
                ErrorType::Server,
                "the node serving this request was lost",
                Some("node_lost"),
            ),
            Outcome::Failed(RequestError::Provider(detail)) => Self::provider(detail),
            Outcome::Failed(RequestError::Unsupported { model }) => Self::bad_request(
                format!("no provider of model `{model}` serves this endpoint any more"),
                Some("unsupported_endpoint"),
            ),
            Outcome::Failed(RequestError::HandingOver) => Self::handing_over(),
            Outcome::Failed(RequestError::Violation(why)) => Self::new(
                502,
                ErrorType::Server,
                format!("node protocol violation: {why}"),
                Some("protocol_violation"),
            ),
            Outcome::Cancelled => Self::new(
                503,
                ErrorType::Server,
                "request cancelled",
                Some("cancelled"),
            ),
            // A completion with nothing rendered: the node ended without a response.
            Outcome::Completed => {
                Self::new(502, ErrorType::Server, "request ended unexpectedly", None)
            }
            // A failure a newer core knows and this crate does not: a server error that
            // says what it was.
            Outcome::Failed(other) => Self::new(
                502,
                ErrorType::Server,
                format!("the request failed: {other:?}"),
                None,
            ),
        }
    }

    /// How a request the Edge machine refused at submit is answered.
    #[must_use]
    pub fn from_submit(refused: &SubmitError, endpoint: Endpoint) -> Self {
        match refused {
            SubmitError::UnknownModel(model) => Self::model_not_found(model),
            SubmitError::QueueFull { .. } => Self::new(
                429,
                ErrorType::RateLimit,
                refused.to_string(),
                Some("queue_full"),
            ),
            SubmitError::NoCandidates(model) if endpoint != Endpoint::Chat => Self::bad_request(
                format!("no provider of model `{model}` serves {}", endpoint.path()),
                Some("unsupported_endpoint"),
            ),
            SubmitError::NoCandidates(_) => Self::new(
                503,
                ErrorType::Server,
                refused.to_string(),
                Some("no_provider"),
            ),
            SubmitError::HandingOver => Self::handing_over(),
            // The Messages API's words, which Claude Code compacts a conversation on.
            SubmitError::PromptTooLong { .. } => {
                Self::bad_request(refused.to_string(), Some("context_length_exceeded"))
            }
            other => Self::new(503, ErrorType::Server, other.to_string(), None),
        }
    }

    /// A request this Edge process could not take because it handed over to its
    /// successor: nothing reached a provider, and a retry (on a new connection) reaches
    /// the successor.
    #[must_use]
    pub fn handing_over() -> Self {
        Self::new(
            503,
            ErrorType::Server,
            "the edge is handing over to a new process; retry",
            Some("edge_handing_over"),
        )
    }

    /// How a node command the Edge machine refused is answered.
    #[must_use]
    pub fn from_command(refused: &CommandError) -> Self {
        match refused {
            CommandError::Invalid(err) => {
                Self::bad_request(err.to_string(), Some("command_not_admitted"))
            }
            CommandError::NotOllama { node, adapter } => Self::bad_request(
                format!(
                    "node {node:?} has no Ollama adapter {adapter:?}: the pass-through serves \
                     Ollama adapters only"
                ),
                Some("not_ollama_adapter"),
            ),
            CommandError::UnknownNode(node) => Self::new(
                404,
                ErrorType::InvalidRequest,
                format!("node {node:?} does not exist"),
                Some("unknown_node"),
            ),
            CommandError::NotReady(_) => Self::new(
                503,
                ErrorType::Server,
                refused.to_string(),
                Some("node_not_ready"),
            ),
            other => Self::new(503, ErrorType::Server, other.to_string(), None),
        }
    }

    /// A node answered a command with a failure (502 `command_failed`).
    #[must_use]
    pub fn command_failed(message: &str) -> Self {
        Self::new(502, ErrorType::Server, message, Some("command_failed"))
    }

    /// The JSON body: `{"error": {"message", "type", "param": null, "code"}}`.
    #[must_use]
    pub fn body(&self) -> Bytes {
        Bytes::from(
            json!({ "error": {
                "message": self.message,
                "type": self.kind.as_str(),
                "param": null,
                "code": self.code,
            } })
            .to_string(),
        )
    }

    /// The same object as one SSE `data:` event, for a stream that already sent its
    /// status (the official SDKs raise on it).
    #[must_use]
    pub fn sse_event(&self) -> Bytes {
        let body = self.body();
        let mut out = Vec::with_capacity(body.len() + 8);
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(&body);
        out.extend_from_slice(b"\n\n");
        Bytes::from(out)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.message)
    }
}

impl std::error::Error for ApiError {}
