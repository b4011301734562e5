//! The API dialects a caller may speak, and the one [`Responder`] a shell holds for a
//! request whichever it speaks: every dialect's responder takes the same events and
//! timers and hands back the same [`Out`] pieces.

use std::time::Duration;

use bytes::Bytes;
use iop_proto_core::edge::RequestEvent;
use iop_proto_core::wire::Usage;

use crate::openai::{ApiError, Out};
use crate::{anthropic, openai, responses};

/// The API a request came in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// OpenAI's: chat completions, completions, embeddings.
    OpenAi,
    /// Anthropic's Messages API.
    Anthropic,
    /// OpenAI's Responses API.
    Responses,
}

impl Dialect {
    /// The name metrics and logs label requests with.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::OpenAi => "openai",
            Dialect::Anthropic => "anthropic",
            Dialect::Responses => "responses",
        }
    }

    /// An error answer in this dialect's shape: its status and JSON body (the Messages
    /// API's statuses differ: 529 when no capacity is left).
    #[must_use]
    pub fn error(self, error: &ApiError, request_id: &str) -> (u16, Bytes) {
        match self {
            Dialect::OpenAi | Dialect::Responses => (error.status, error.body()),
            Dialect::Anthropic => anthropic::error_response(error, request_id),
        }
    }
}

/// A request's responder, in the dialect it came in.
#[derive(Debug)]
pub enum Responder {
    /// OpenAI's.
    OpenAi(openai::Responder),
    /// Anthropic's (boxed: it carries the stream grammar's state).
    Anthropic(Box<anthropic::Responder>),
    /// The Responses API's (boxed alike).
    Responses(Box<responses::Responder>),
}

impl Responder {
    /// The dialect it answers in.
    #[must_use]
    pub fn dialect(&self) -> Dialect {
        match self {
            Responder::OpenAi(_) => Dialect::OpenAi,
            Responder::Anthropic(_) => Dialect::Anthropic,
            Responder::Responses(_) => Dialect::Responses,
        }
    }

    /// One of the request's events.
    pub fn handle_event(&mut self, event: RequestEvent) {
        match self {
            Responder::OpenAi(r) => r.handle_event(event),
            Responder::Anthropic(r) => r.handle_event(event),
            Responder::Responses(r) => r.handle_event(event),
        }
    }

    /// The response deadline passed.
    pub fn handle_timeout(&mut self) {
        match self {
            Responder::OpenAi(r) => r.handle_timeout(),
            Responder::Anthropic(r) => r.handle_timeout(),
            Responder::Responses(r) => r.handle_timeout(),
        }
    }

    /// Nothing happened for `interval` (the shell's keep-alive interval).
    pub fn handle_idle(&mut self, interval: Duration) {
        match self {
            Responder::OpenAi(r) => r.handle_idle(),
            Responder::Anthropic(r) => r.handle_idle(interval),
            Responder::Responses(r) => r.handle_idle(interval),
        }
    }

    /// The next piece of the response.
    pub fn poll_output(&mut self) -> Option<Out> {
        match self {
            Responder::OpenAi(r) => r.poll_output(),
            Responder::Anthropic(r) => r.poll_output(),
            Responder::Responses(r) => r.poll_output(),
        }
    }

    /// Whether the response is complete once what `poll_output` holds is written.
    #[must_use]
    pub fn is_done(&self) -> bool {
        match self {
            Responder::OpenAi(r) => r.is_done(),
            Responder::Anthropic(r) => r.is_done(),
            Responder::Responses(r) => r.is_done(),
        }
    }

    /// Whether the shell must cancel the request once the response is done.
    #[must_use]
    pub fn needs_cancel(&self) -> bool {
        match self {
            Responder::OpenAi(r) => r.needs_cancel(),
            Responder::Anthropic(r) => r.needs_cancel(),
            Responder::Responses(r) => r.needs_cancel(),
        }
    }

    /// The status to record.
    #[must_use]
    pub fn status(&self) -> Option<u16> {
        match self {
            Responder::OpenAi(r) => r.status(),
            Responder::Anthropic(r) => r.status(),
            Responder::Responses(r) => r.status(),
        }
    }

    /// The token usage the provider reported.
    #[must_use]
    pub fn usage(&self) -> Option<&Usage> {
        match self {
            Responder::OpenAi(r) => r.usage(),
            Responder::Anthropic(r) => r.usage(),
            Responder::Responses(r) => r.usage(),
        }
    }
}
