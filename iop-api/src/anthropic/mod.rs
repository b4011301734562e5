//! The Anthropic Messages dialect (`POST /v1/messages`, `/v1/messages/count_tokens`),
//! what Claude Code and every `anthropic` SDK speak, with no IO.
//!
//! A Messages request is translated ([`translate`]) into the OpenAI chat body the core
//! dispatches to any provider: a normalized run reads it as its input, a tunnel sends it
//! to the provider's chat completions. The request's events are rendered back by
//! [`Responder`]: a run's events, or the provider's chat completion (JSON or SSE chunks)
//! re-encoded, as one Messages JSON object or as the Messages event stream. A provider
//! that serves `/v1/messages` itself is sent the caller's body byte for byte, and its
//! answer passes through.
//!
//! Errors take the Messages API's shape and statuses ([`ErrorKind::of`]), so that each
//! maps to the SDK exception a caller expects:
//!
//! ```
//! use iop_api::anthropic::{self, Responder, ResponseOptions, TranslateOptions};
//! use iop_proto_core::wire::{RunEvent, RunEventType};
//! use iop_proto_core::DispatchShape;
//!
//! let body = br#"{"model":"m","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}"#;
//! let asked = anthropic::translate(body, TranslateOptions::default()).map_err(|e| e.message)?;
//! assert!(std::str::from_utf8(&asked.chat)?.contains(r#""messages":[{"role":"user","content":"hi"}]"#));
//! let options = asked.response_options("run-1", "req_1");
//! let mut responder = Responder::new(options);
//! responder.handle_dispatched(DispatchShape::Run, false);
//! for (sequence, kind, delta) in [(0, RunEventType::Start, ""), (1, RunEventType::Delta, "Hello"), (2, RunEventType::Complete, "")] {
//!     responder.handle_run_event(RunEvent {
//!         run_id: "run-1".into(),
//!         sequence,
//!         r#type: kind as i32,
//!         delta: delta.into(),
//!         ..RunEvent::default()
//!     });
//! }
//! let Some(iop_api::openai::Out::Whole { status, body }) = responder.poll_output() else { unreachable!() };
//! assert_eq!(status, 200);
//! let message: serde_json::Value = serde_json::from_slice(&body)?;
//! assert_eq!(message["content"][0]["text"], "Hello");
//! assert_eq!(message["stop_reason"], "end_turn");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod message;
mod request;

pub use crate::translated::{
    MessageUsage, PING_AFTER, ResponseOptions, StopReason, context_overflow,
};
pub use message::Builder;
pub use request::{BILLING_HEADER_PREFIX, TranslateOptions, Translated, translate};

/// Turns a Messages request's events into its Messages response.
pub type Responder = crate::translated::Responder<Builder>;

use bytes::Bytes;
use serde_json::{Value, json};

use crate::openai::ApiError;

/// The path of the Messages endpoint.
pub const MESSAGES_PATH: &str = "/v1/messages";
/// The path of the token counting endpoint.
pub const COUNT_TOKENS_PATH: &str = "/v1/messages/count_tokens";

/// The `error.type` of a Messages error: what the SDKs map to their exceptions, with the
/// HTTP status each goes with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// 400, and any other 4xx without a type of its own.
    InvalidRequest,
    /// 401.
    Authentication,
    /// 403.
    Permission,
    /// 404.
    NotFound,
    /// 413.
    RequestTooLarge,
    /// 429.
    RateLimit,
    /// 504.
    Timeout,
    /// 529: no capacity is left (the queue is full, the wait for capacity ran out, no
    /// provider serves the model now, the Edge holds all it may).
    Overloaded,
    /// Any other 5xx.
    Api,
}

impl ErrorKind {
    /// The wire string.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::Permission => "permission_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::RequestTooLarge => "request_too_large",
            ErrorKind::RateLimit => "rate_limit_error",
            ErrorKind::Timeout => "timeout_error",
            ErrorKind::Overloaded => "overloaded_error",
            ErrorKind::Api => "api_error",
        }
    }

    /// How `error` is answered in this dialect: its status (529 for a lack of capacity,
    /// whatever status the OpenAI dialect gives it) and type.
    #[must_use]
    pub fn of(error: &ApiError) -> (u16, Self) {
        let capacity = matches!(
            error.code.as_deref(),
            Some("capacity_timeout" | "queue_full" | "no_provider" | "overloaded")
        );
        if capacity {
            return (529, ErrorKind::Overloaded);
        }
        let kind = match error.status {
            401 => ErrorKind::Authentication,
            403 => ErrorKind::Permission,
            404 => ErrorKind::NotFound,
            413 => ErrorKind::RequestTooLarge,
            429 => ErrorKind::RateLimit,
            504 => ErrorKind::Timeout,
            529 => ErrorKind::Overloaded,
            s if s >= 500 => ErrorKind::Api,
            _ => ErrorKind::InvalidRequest,
        };
        (error.status, kind)
    }
}

/// The error object: `{"type": "error", "error": {"type", "message"}, "request_id"}`.
#[must_use]
pub fn error_value(error: &ApiError, request_id: &str) -> Value {
    let (_, kind) = ErrorKind::of(error);
    json!({
        "type": "error",
        "error": {"type": kind.as_str(), "message": error.message},
        "request_id": request_id,
    })
}

/// An error answer: its status and JSON body.
#[must_use]
pub fn error_response(error: &ApiError, request_id: &str) -> (u16, Bytes) {
    let (status, _) = ErrorKind::of(error);
    (
        status,
        Bytes::from(error_value(error, request_id).to_string()),
    )
}

/// What `POST /v1/messages/count_tokens` answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenCount {
    /// The model asked about.
    pub model: String,
    /// The prompt's tokens: the Edge's estimate, until a provider's tokenizer counts them.
    pub input_tokens: u64,
    /// The body a provider's tokenizer is asked with for the exact count
    /// ([`crate::tokenize`]).
    pub tokenize: Bytes,
}

impl TokenCount {
    /// The answer's body: `{"input_tokens": N}`.
    #[must_use]
    pub fn body(&self) -> Bytes {
        Bytes::from(json!({"input_tokens": self.input_tokens}).to_string())
    }
}

/// `POST /v1/messages/count_tokens`: the tokens of a Messages body (which needs no
/// `max_tokens`), as the Edge estimates them over the translated prompt (the figure the
/// long-context decision, the context check and a key's token limits use), or the 400 of
/// a bad body.
pub fn count_tokens(raw: &[u8], options: TranslateOptions) -> Result<TokenCount, ApiError> {
    let asked = translate(
        raw,
        TranslateOptions {
            require_max_tokens: false,
            ..options
        },
    )?;
    Ok(TokenCount {
        tokenize: crate::tokenize::request_body(&asked.chat).unwrap_or_default(),
        model: asked.facts.model,
        input_tokens: asked.facts.prompt_tokens,
    })
}
