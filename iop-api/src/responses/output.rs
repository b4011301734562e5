//! [`Builder`]: a Responses API answer put together piece by piece (text, reasoning,
//! function calls, the end), written either as the one `response` object or as the event
//! stream the SDKs and Codex read. Whatever order its callers feed it in, the stream it
//! writes keeps the rules: every event has an `event:` line equal to its `type` and a
//! `sequence_number` counting from 0 without gaps; one `response.created`, then
//! `response.in_progress`; each output item opened by `response.output_item.added` and
//! closed once by `response.output_item.done` (text through `content_part.added`,
//! `output_text.delta`, `output_text.done`, `content_part.done`; calls through
//! `function_call_arguments.delta` and `.done`); one terminal event
//! (`response.completed`, `response.incomplete` or `response.failed`) whose `output`
//! lists every item exactly as its `output_item.done` gave it, ids included; no `[DONE]`.

use bytes::{BufMut, Bytes, BytesMut};
use serde_json::{Map, Value, json};

use crate::openai::{ApiError, ErrorType};
use crate::translated::{Compose, MessageUsage, ResponseOptions, StopReason};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Message,
    Reasoning,
}

/// The item being written: a message's text or a reasoning item's.
#[derive(Debug)]
struct Open {
    kind: Kind,
    id: String,
    index: usize,
    text: String,
}

/// Puts one response together; see the module docs.
#[derive(Debug)]
pub struct Builder {
    id: String,
    run: String,
    model: String,
    created: u64,
    stream: bool,
    started: bool,
    finished: bool,
    /// The next event's `sequence_number`.
    sequence: u64,
    /// Items done, in output order.
    items: Vec<Value>,
    open: Option<Open>,
    out: BytesMut,
    input_estimate: u64,
    /// Request members the response repeats.
    echo: Map<String, Value>,
    /// The final output's items as chat messages (for the response store): the
    /// assistant's text and its calls.
    said: Said,
    /// The response as it ended (completed or incomplete), for the store.
    last: Option<Value>,
}

/// What the answer said, as the assistant's turn of a chat transcript.
#[derive(Debug, Default)]
struct Said {
    text: String,
    calls: Vec<Value>,
}

impl Builder {
    /// A response `resp_{run}` of `model`, made at `created`; `stream` writes events,
    /// else one JSON object.
    #[must_use]
    pub fn new(options: &ResponseOptions) -> Self {
        Builder {
            id: format!("resp_{}", options.run_id),
            run: options.run_id.clone(),
            model: options.model.clone(),
            created: options.created,
            stream: options.stream,
            started: false,
            finished: false,
            sequence: 0,
            items: Vec::new(),
            open: None,
            out: BytesMut::new(),
            input_estimate: options.input_estimate,
            echo: options.echo.clone(),
            said: Said::default(),
            last: None,
        }
    }

    /// The response's id.
    #[must_use]
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The response object once the answer ended well (completed or incomplete).
    #[must_use]
    pub fn final_response(&self) -> Option<&Value> {
        self.last.as_ref()
    }

    /// The assistant's turn as a chat message (its text, then its tool calls), once the
    /// answer ended: what a later turn that names this response continues from.
    #[must_use]
    pub fn transcript(&self) -> Option<Value> {
        if self.last.is_none() || (self.said.text.is_empty() && self.said.calls.is_empty()) {
            return None;
        }
        let mut message = json!({"role": "assistant", "content": self.said.text});
        if !self.said.calls.is_empty() {
            message["tool_calls"] = Value::Array(self.said.calls.clone());
        }
        Some(message)
    }

    fn response(&self, status: &str, usage: Option<Value>) -> Value {
        let mut response = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": null,
            "incomplete_details": null,
            "instructions": null,
            "max_output_tokens": null,
            "model": self.model,
            "output": self.items,
            "parallel_tool_calls": true,
            "previous_response_id": null,
            "reasoning": {"effort": null, "summary": null},
            "store": false,
            "temperature": null,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": null,
            "truncation": "disabled",
            "usage": usage,
            "metadata": {},
        });
        if let Value::Object(members) = &mut response {
            for (key, value) in &self.echo {
                members.insert(key.clone(), value.clone());
            }
        }
        response
    }

    fn piece(&mut self, kind: Kind, text: &str) {
        if text.is_empty() || self.finished {
            return;
        }
        self.start();
        if self.open.as_ref().is_some_and(|open| open.kind != kind) {
            self.close();
        }
        if self.open.is_none() {
            let index = self.items.len();
            let id = match kind {
                Kind::Message => format!("msg_{}_{index}", self.run),
                Kind::Reasoning => format!("rs_{}_{index}", self.run),
            };
            if self.stream {
                let (item, part) = match kind {
                    Kind::Message => (
                        json!({"id": id, "type": "message", "status": "in_progress",
                               "role": "assistant", "content": []}),
                        json!({"type": "output_text", "text": "", "annotations": []}),
                    ),
                    Kind::Reasoning => (
                        json!({"id": id, "type": "reasoning", "summary": []}),
                        json!({"type": "reasoning_text", "text": ""}),
                    ),
                };
                self.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                );
                self.event(
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                );
            }
            self.open = Some(Open {
                kind,
                id,
                index,
                text: String::new(),
            });
        }
        let Some(open) = &mut self.open else { return };
        open.text.push_str(text);
        if kind == Kind::Message {
            self.said.text.push_str(text);
        }
        if self.stream {
            let (id, index) = (open.id.clone(), open.index);
            match kind {
                Kind::Message => self.event(
                    "response.output_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "delta": text, "logprobs": []}),
                ),
                Kind::Reasoning => self.event(
                    "response.reasoning_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "delta": text}),
                ),
            }
        }
    }

    /// Closes the open item: its last events, and its place in the output.
    fn close(&mut self) {
        self.close_as("completed");
    }

    /// Closes the open item with `status` (`incomplete` when the answer failed in it).
    fn close_as(&mut self, status: &str) {
        let Some(open) = self.open.take() else { return };
        let Open {
            kind,
            id,
            index,
            text,
        } = open;
        let (item, part, done, done_event) = match kind {
            Kind::Message => {
                let part = json!({"type": "output_text", "text": text, "annotations": [],
                                  "logprobs": []});
                (
                    json!({"id": id, "type": "message", "status": status,
                           "role": "assistant", "content": [part]}),
                    part,
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "text": text, "logprobs": []}),
                    "response.output_text.done",
                )
            }
            Kind::Reasoning => {
                let part = json!({"type": "reasoning_text", "text": text});
                (
                    json!({"id": id, "type": "reasoning", "summary": [], "content": [part]}),
                    part,
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "text": text}),
                    "response.reasoning_text.done",
                )
            }
        };
        if self.stream {
            self.event(done_event, done);
            self.event(
                "response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            );
            self.event(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            );
        }
        self.items.push(item);
    }

    /// `event: {type}` and `data: {data with type and sequence_number}`.
    fn event(&mut self, kind: &str, mut data: Value) {
        if let Value::Object(members) = &mut data {
            members.insert("type".to_owned(), Value::from(kind));
            members.insert("sequence_number".to_owned(), Value::from(self.sequence));
        }
        self.sequence += 1;
        self.out.put_slice(b"event: ");
        self.out.put_slice(kind.as_bytes());
        self.out.put_slice(b"\ndata: ");
        let mut writer = (&mut self.out).writer();
        // Writing a `Value` into memory cannot fail.
        let _ = serde_json::to_writer(&mut writer, &data);
        self.out.put_slice(b"\n\n");
    }
}

/// The `error.code` a failed response carries: the error's own, else one by its status.
fn failure_code(error: &ApiError) -> String {
    if let Some(code) = &error.code {
        return code.clone();
    }
    match error.status {
        429 => "rate_limit_exceeded",
        408 | 504 => "timeout",
        400..=499 => "invalid_request",
        _ => "server_error",
    }
    .to_owned()
}

impl Compose for Builder {
    const CALL_ID_PREFIX: &'static str = "call";
    const NATIVE_PING: &'static [u8] = b": keep-alive\n\n";

    fn new(options: &ResponseOptions) -> Self {
        Builder::new(options)
    }

    fn started(&self) -> bool {
        self.started
    }

    fn finished(&self) -> bool {
        self.finished
    }

    fn take(&mut self) -> Option<Bytes> {
        (!self.out.is_empty()).then(|| self.out.split().freeze())
    }

    fn start(&mut self) {
        if !self.stream || self.started || self.finished {
            return;
        }
        self.started = true;
        let response = self.response("in_progress", None);
        self.event("response.created", json!({"response": response}));
        self.event("response.in_progress", json!({"response": response}));
    }

    fn text(&mut self, text: &str) {
        self.piece(Kind::Message, text);
    }

    fn thinking(&mut self, text: &str) {
        self.piece(Kind::Reasoning, text);
    }

    fn tool(&mut self, id: &str, name: &str, arguments: &str) {
        if self.finished {
            return;
        }
        self.start();
        self.close();
        let index = self.items.len();
        let item_id = format!("fc_{}_{index}", self.run);
        let arguments = if arguments.trim().is_empty() {
            "{}"
        } else {
            arguments
        };
        if self.stream {
            self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": {"id": item_id, "type": "function_call",
                       "status": "in_progress", "call_id": id, "name": name, "arguments": ""}}),
            );
            self.event(
                "response.function_call_arguments.delta",
                json!({"item_id": item_id, "output_index": index, "delta": arguments}),
            );
            self.event(
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": index, "name": name,
                       "arguments": arguments}),
            );
        }
        let item = json!({"id": item_id, "type": "function_call", "status": "completed",
                          "call_id": id, "name": name, "arguments": arguments});
        if self.stream {
            self.event(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            );
        }
        self.items.push(item);
        self.said.calls.push(json!({"id": id, "type": "function",
            "function": {"name": name, "arguments": arguments}}));
    }

    fn finish(
        &mut self,
        reason: StopReason,
        _stop_sequence: Option<&str>,
        usage: Option<MessageUsage>,
    ) -> Option<Value> {
        if self.finished {
            return None;
        }
        self.start();
        self.close();
        let usage = usage.unwrap_or(MessageUsage {
            input_tokens: self.input_estimate,
            ..MessageUsage::default()
        });
        let cached = usage.cache_read_input_tokens.unwrap_or(0);
        let input = usage.input_tokens + cached;
        let usage = json!({
            "input_tokens": input,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input + usage.output_tokens,
        });
        let incomplete = match reason {
            StopReason::MaxTokens => Some("max_output_tokens"),
            StopReason::Refusal => Some("content_filter"),
            _ => None,
        };
        let mut response = self.response(
            if incomplete.is_some() {
                "incomplete"
            } else {
                "completed"
            },
            Some(usage),
        );
        if let Some(reason) = incomplete {
            response["incomplete_details"] = json!({"reason": reason});
        }
        self.finished = true;
        self.last = Some(response.clone());
        if !self.stream {
            return Some(response);
        }
        let kind = if incomplete.is_some() {
            "response.incomplete"
        } else {
            "response.completed"
        };
        self.event(kind, json!({"response": response}));
        None
    }

    fn fail(&mut self, error: &ApiError, _request_id: &str) {
        if self.finished {
            return;
        }
        // An item still open is closed as incomplete: every item added is done, and the
        // failed response lists them all.
        self.close_as("incomplete");
        self.finished = true;
        let mut response = self.response("failed", None);
        response["error"] = json!({"code": failure_code(error), "message": error.message});
        self.event("response.failed", json!({"response": response}));
    }

    fn ping(&mut self) {
        self.out.put_slice(b": keep-alive\n\n");
    }

    fn error_response(error: &ApiError, _request_id: &str) -> (u16, Bytes) {
        (error.status, error.body())
    }

    fn provider_error(status: u16, body: &[u8]) -> ApiError {
        if let Some((tokens, max)) = crate::translated::context_overflow(body) {
            return ApiError::bad_request(
                format!(
                    "This model's maximum context length is {max} tokens. However, your input resulted in {tokens} tokens."
                ),
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
}
