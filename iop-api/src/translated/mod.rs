//! What every translated dialect shares: a request served as OpenAI chat (a normalized
//! run, or a provider's chat completions through a tunnel) and answered in the caller's
//! dialect. [`Responder`] follows the request's events and reads the provider's chat
//! completion (whole or as SSE chunks); a dialect's [`Compose`] writes the answer, whole
//! or streamed, in its own grammar ([`crate::anthropic::Builder`] for Messages,
//! [`crate::responses::Builder`] for Responses). A provider that serves the dialect
//! itself has its answer passed through.

pub(crate) mod body;
mod chat;
mod render;

pub use chat::context_overflow;
pub(crate) use chat::error_message;
pub use render::{PING_AFTER, Responder};

use bytes::Bytes;
use serde::Serialize;
use serde_json::Value;

use crate::openai::{ApiError, RequestFacts};

/// One dialect's answer, put together piece by piece: whatever order its callers feed it
/// in, what it writes keeps the dialect's grammar. Streaming, it writes events as they
/// come ([`take`](Self::take) hands them out); whole, [`finish`](Self::finish) returns
/// the answer.
pub trait Compose: std::fmt::Debug + Sized {
    /// The prefix of the ids made for tool calls a provider gave none.
    const CALL_ID_PREFIX: &'static str;
    /// A keep-alive event between the events of a provider that serves the dialect
    /// itself.
    const NATIVE_PING: &'static [u8];

    /// An answer to a request with `options`.
    fn new(options: &ResponseOptions) -> Self;
    /// Whether the stream's first event went out (a failure after it is an event too).
    fn started(&self) -> bool;
    /// Whether the answer ended.
    fn finished(&self) -> bool;
    /// The stream's bytes written since the last call.
    fn take(&mut self) -> Option<Bytes>;
    /// Streaming: the first events, once.
    fn start(&mut self);
    /// Text the model wrote.
    fn text(&mut self, text: &str);
    /// Reasoning the model showed (a provider's `reasoning_content`).
    fn thinking(&mut self, text: &str);
    /// A whole tool call, its arguments as the provider wrote them.
    fn tool(&mut self, id: &str, name: &str, arguments: &str);
    /// The end of the answer: streaming, its last events are written and `None` is
    /// returned; whole, the answer.
    fn finish(
        &mut self,
        reason: StopReason,
        stop_sequence: Option<&str>,
        usage: Option<MessageUsage>,
    ) -> Option<Value>;
    /// Streaming, after the start: the failure as the dialect's error event. Nothing
    /// follows it.
    fn fail(&mut self, error: &ApiError, request_id: &str);
    /// Streaming: a keep-alive.
    fn ping(&mut self);
    /// The error answer before anything went out: its status and JSON body.
    fn error_response(error: &ApiError, request_id: &str) -> (u16, Bytes);
    /// A provider's error status and body, as the caller is told.
    fn provider_error(status: u16, body: &[u8]) -> ApiError;
}

/// Why an answer ended (in the Messages API's words, which [`StopReason::as_str`] gives).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model finished its turn.
    EndTurn,
    /// `max_tokens` was reached.
    MaxTokens,
    /// One of `stop_sequences` was generated (the builder is told which).
    StopSequence,
    /// The model called tools.
    ToolUse,
    /// The provider refused to go on (OpenAI's `content_filter`).
    Refusal,
}

impl StopReason {
    /// The wire string.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::EndTurn => "end_turn",
            StopReason::MaxTokens => "max_tokens",
            StopReason::StopSequence => "stop_sequence",
            StopReason::ToolUse => "tool_use",
            StopReason::Refusal => "refusal",
        }
    }

    /// The stop reason of an OpenAI `finish_reason` (`None`: the provider gave none).
    #[must_use]
    pub fn of_finish(finish: Option<&str>) -> Self {
        match finish {
            Some("length") => StopReason::MaxTokens,
            Some("tool_calls" | "function_call") => StopReason::ToolUse,
            Some("content_filter") => StopReason::Refusal,
            _ => StopReason::EndTurn,
        }
    }
}

/// Token usage as the Messages API reports it (the Responses API's is made from it).
/// `input_tokens` excludes the tokens read from the provider's prefix cache, which
/// `cache_read_input_tokens` counts (OpenAI's `prompt_tokens` includes them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MessageUsage {
    /// Prompt tokens not read from a cache.
    pub input_tokens: u64,
    /// Tokens generated.
    pub output_tokens: u64,
    /// Prompt tokens read from the provider's prefix cache, where it reports them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_read_input_tokens: Option<u64>,
}

impl MessageUsage {
    /// From OpenAI's figures: `prompt` tokens of which `cached` came from a cache.
    #[must_use]
    pub fn from_openai(prompt: u64, completion: u64, cached: Option<u64>) -> Self {
        let cached = cached.map(|c| c.min(prompt));
        MessageUsage {
            input_tokens: prompt - cached.unwrap_or(0),
            output_tokens: completion,
            cache_read_input_tokens: cached,
        }
    }
}

/// What a response needs to know of its request.
#[derive(Clone, Debug, PartialEq)]
pub struct ResponseOptions {
    /// The public model name, echoed in the answer.
    pub model: String,
    /// The run id, from which the answer's ids are made.
    pub run_id: String,
    /// The caller's request id, in every error object.
    pub request_id: String,
    /// Stream events rather than one JSON object.
    pub stream: bool,
    /// Tools were offered: a run's text is held while it may still be a tool call the
    /// model wrote as text (a node's fallback), and no longer.
    pub wants_tools: bool,
    /// The request's `stop_sequences`.
    pub stop_sequences: Vec<String>,
    /// The prompt's estimated tokens, reported until the provider's figures arrive.
    pub input_estimate: u64,
    /// When the answer was made (Unix seconds), where the dialect says.
    pub created: u64,
    /// Members of the request the answer repeats, where the dialect does (the Responses
    /// API's `store`, `metadata`, `previous_response_id`, sampling...).
    pub echo: serde_json::Map<String, Value>,
}

impl ResponseOptions {
    /// The options for a translated request of `facts` with `stop_sequences`, served as
    /// `run_id`.
    #[must_use]
    pub fn of(
        facts: &RequestFacts,
        stop_sequences: &[String],
        run_id: &str,
        request_id: &str,
    ) -> Self {
        ResponseOptions {
            model: facts.model.clone(),
            run_id: run_id.to_owned(),
            request_id: request_id.to_owned(),
            stream: facts.stream,
            wants_tools: facts.wants_tools,
            stop_sequences: stop_sequences.to_vec(),
            input_estimate: facts.prompt_tokens,
            created: 0,
            echo: serde_json::Map::new(),
        }
    }

    /// The same, made at `created` (Unix seconds).
    #[must_use]
    pub fn at(mut self, created: u64) -> Self {
        self.created = created;
        self
    }
}
