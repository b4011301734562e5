//! [`Builder`]: an assistant message put together piece by piece (text, thinking, tool
//! calls, the end), written either as the one JSON `message` or as the event stream the
//! SDKs and Claude Code enforce. Whatever order its callers feed it in, the stream it
//! writes keeps the grammar: `message_start` first, blocks with dense indices in start
//! order, each started and stopped once, one `message_delta` with the stop reason and
//! the cumulative usage, then `message_stop`.

use bytes::{BufMut, Bytes, BytesMut};
use serde_json::{Value, json};

use crate::openai::{ApiError, ErrorType};
use crate::translated::{Compose, MessageUsage, ResponseOptions, StopReason};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Text,
    Thinking,
}

/// A content block of a whole message, as it is being put together.
#[derive(Debug)]
enum Block {
    Text(String),
    Thinking(String),
    Tool {
        id: String,
        name: String,
        input: Value,
    },
}

/// Puts one assistant message together; see the module docs.
#[derive(Debug)]
pub struct Builder {
    id: String,
    model: String,
    stream: bool,
    /// Streaming: `message_start` is out.
    started: bool,
    /// Streaming: the open text or thinking block and its index.
    open: Option<(Kind, u32)>,
    /// Blocks started so far (the next block's index).
    blocks: u32,
    /// Whole: the blocks.
    content: Vec<Block>,
    /// Streaming: events not yet taken.
    out: BytesMut,
    /// The prompt's estimated size, reported until the provider's figures arrive.
    input_estimate: u64,
    finished: bool,
}

impl Builder {
    /// A message `msg_{id}` of `model`; `stream` writes events, else one JSON object.
    #[must_use]
    pub fn new(id: &str, model: &str, stream: bool, input_estimate: u64) -> Self {
        Builder {
            id: format!("msg_{id}"),
            model: model.to_owned(),
            stream,
            started: false,
            open: None,
            blocks: 0,
            content: Vec::new(),
            out: BytesMut::new(),
            input_estimate,
            finished: false,
        }
    }

    /// Whether `message_start` went out (a failure after it is an `error` event).
    #[must_use]
    pub fn started(&self) -> bool {
        self.started
    }

    /// Whether the message ended.
    #[must_use]
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// The stream's bytes written since the last call.
    pub fn take(&mut self) -> Option<Bytes> {
        (!self.out.is_empty()).then(|| self.out.split().freeze())
    }

    /// Streaming: `message_start`, once.
    pub fn start(&mut self) {
        if !self.stream || self.started || self.finished {
            return;
        }
        self.started = true;
        let message = json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": null,
            "stop_sequence": null,
            "usage": {"input_tokens": self.input_estimate, "output_tokens": 0},
        });
        self.event(
            "message_start",
            &json!({"type": "message_start", "message": message}),
        );
    }

    /// Text the model wrote.
    pub fn text(&mut self, text: &str) {
        self.piece(Kind::Text, text);
    }

    /// Reasoning the model showed (a provider's `reasoning_content`).
    pub fn thinking(&mut self, text: &str) {
        self.piece(Kind::Thinking, text);
    }

    fn piece(&mut self, kind: Kind, text: &str) {
        if text.is_empty() || self.finished {
            return;
        }
        if !self.stream {
            match (self.content.last_mut(), kind) {
                (Some(Block::Text(t)), Kind::Text) | (Some(Block::Thinking(t)), Kind::Thinking) => {
                    t.push_str(text);
                }
                (_, Kind::Text) => self.content.push(Block::Text(text.to_owned())),
                (_, Kind::Thinking) => self.content.push(Block::Thinking(text.to_owned())),
            }
            return;
        }
        self.start();
        let index = match self.open {
            Some((open, index)) if open == kind => index,
            _ => {
                self.close();
                let index = self.next_index();
                let block = match kind {
                    Kind::Text => json!({"type": "text", "text": ""}),
                    Kind::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                };
                self.block_start(index, &block);
                self.open = Some((kind, index));
                index
            }
        };
        let delta = match kind {
            Kind::Text => json!({"type": "text_delta", "text": text}),
            Kind::Thinking => json!({"type": "thinking_delta", "thinking": text}),
        };
        self.event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": index, "delta": delta}),
        );
    }

    /// A whole tool call: `input` is the arguments as the provider wrote them, used when
    /// they are a JSON object, else `{}` (a model that wrote broken arguments gets an
    /// empty input, which the tool's schema check refuses, never a broken stream).
    pub fn tool(&mut self, id: &str, name: &str, input: &str) {
        if self.finished {
            return;
        }
        let input = match serde_json::from_str::<Value>(input) {
            Ok(object @ Value::Object(_)) => object,
            _ => json!({}),
        };
        if !self.stream {
            self.content.push(Block::Tool {
                id: id.to_owned(),
                name: name.to_owned(),
                input,
            });
            return;
        }
        self.start();
        self.close();
        let index = self.next_index();
        self.block_start(
            index,
            &json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
        );
        self.event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
        );
        self.block_stop(index);
    }

    /// The end of the answer. Streaming: the open block's stop, `message_delta` and
    /// `message_stop` are written, and `None` is returned; whole: the message.
    pub fn finish(
        &mut self,
        reason: StopReason,
        stop_sequence: Option<&str>,
        usage: Option<MessageUsage>,
    ) -> Option<Value> {
        if self.finished {
            return None;
        }
        let usage = usage.unwrap_or(MessageUsage {
            input_tokens: self.input_estimate,
            ..MessageUsage::default()
        });
        let stop_sequence = stop_sequence.filter(|_| reason == StopReason::StopSequence);
        if self.stream {
            self.start();
            self.close();
            self.event(
                "message_delta",
                &json!({"type": "message_delta",
                        "delta": {"stop_reason": reason.as_str(), "stop_sequence": stop_sequence},
                        "usage": usage}),
            );
            self.event("message_stop", &json!({"type": "message_stop"}));
            self.finished = true;
            return None;
        }
        self.finished = true;
        let content: Vec<Value> = std::mem::take(&mut self.content)
            .into_iter()
            .map(|block| match block {
                Block::Text(text) => json!({"type": "text", "text": text}),
                Block::Thinking(thinking) => {
                    json!({"type": "thinking", "thinking": thinking, "signature": ""})
                }
                Block::Tool { id, name, input } => {
                    json!({"type": "tool_use", "id": id, "name": name, "input": input})
                }
            })
            .collect();
        Some(json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason.as_str(),
            "stop_sequence": stop_sequence,
            "usage": usage,
        }))
    }

    /// Streaming, after `message_start`: an `error` event. Nothing follows it (no
    /// `message_stop` is made up for an answer that did not end).
    pub fn fail(&mut self, error: &Value) {
        self.finished = true;
        self.event("error", error);
    }

    /// A `ping` event.
    pub fn ping(&mut self) {
        self.event("ping", &json!({"type": "ping"}));
    }

    fn next_index(&mut self) -> u32 {
        let index = self.blocks;
        self.blocks += 1;
        index
    }

    fn close(&mut self) {
        if let Some((_, index)) = self.open.take() {
            self.block_stop(index);
        }
    }

    fn block_start(&mut self, index: u32, block: &Value) {
        self.event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": block}),
        );
    }

    fn block_stop(&mut self, index: u32) {
        self.event(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": index}),
        );
    }

    /// `event: {name}` and `data: {data}`: every event names its type on both lines (the
    /// SDKs drop data-only frames).
    fn event(&mut self, name: &str, data: &Value) {
        self.out.put_slice(b"event: ");
        self.out.put_slice(name.as_bytes());
        self.out.put_slice(b"\ndata: ");
        let mut writer = (&mut self.out).writer();
        // Writing a `Value` into memory cannot fail.
        let _ = serde_json::to_writer(&mut writer, data);
        self.out.put_slice(b"\n\n");
    }
}

impl Compose for Builder {
    const CALL_ID_PREFIX: &'static str = "toolu";
    const NATIVE_PING: &'static [u8] = b"event: ping\ndata: {\"type\":\"ping\"}\n\n";

    fn new(options: &ResponseOptions) -> Self {
        Builder::new(
            &options.run_id,
            &options.model,
            options.stream,
            options.input_estimate,
        )
    }

    fn started(&self) -> bool {
        Builder::started(self)
    }

    fn finished(&self) -> bool {
        Builder::finished(self)
    }

    fn take(&mut self) -> Option<Bytes> {
        Builder::take(self)
    }

    fn start(&mut self) {
        Builder::start(self);
    }

    fn text(&mut self, text: &str) {
        Builder::text(self, text);
    }

    fn thinking(&mut self, text: &str) {
        Builder::thinking(self, text);
    }

    fn tool(&mut self, id: &str, name: &str, arguments: &str) {
        Builder::tool(self, id, name, arguments);
    }

    fn finish(
        &mut self,
        reason: StopReason,
        stop_sequence: Option<&str>,
        usage: Option<MessageUsage>,
    ) -> Option<Value> {
        Builder::finish(self, reason, stop_sequence, usage)
    }

    fn fail(&mut self, error: &ApiError, request_id: &str) {
        Builder::fail(self, &super::error_value(error, request_id));
    }

    fn ping(&mut self) {
        Builder::ping(self);
    }

    fn error_response(error: &ApiError, request_id: &str) -> (u16, Bytes) {
        super::error_response(error, request_id)
    }

    fn provider_error(status: u16, body: &[u8]) -> ApiError {
        provider_status_error(status, body)
    }
}

/// A provider's error status and body, as the caller is answered: the prompt that did
/// not fit in the Messages API's words (Claude Code compacts on them), else the
/// provider's status and message.
fn provider_status_error(status: u16, body: &[u8]) -> ApiError {
    if let Some((tokens, max)) = crate::translated::context_overflow(body) {
        return ApiError::bad_request(
            format!("prompt is too long: {tokens} tokens > {max} maximum"),
            Some("context_length_exceeded"),
        );
    }
    let message = crate::translated::error_message(body);
    let kind = if status >= 500 {
        ErrorType::Server
    } else if status == 429 {
        ErrorType::RateLimit
    } else {
        ErrorType::InvalidRequest
    };
    ApiError::new(status, kind, message, None)
}
