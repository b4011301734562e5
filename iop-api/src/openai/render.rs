//! [`Responder`]: one request's events in, the bytes of its OpenAI response out.

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;
use serde_json::{Value, json};

use super::{ApiError, RequestFacts};
use iop_proto_core::edge::{DispatchShape, Outcome, RequestError, RequestEvent};
use iop_proto_core::tunnel::TunnelPart;
use iop_proto_core::wire::{
    Header, ProviderTunnelFrame, RunEvent, RunEventType, TunnelFrameKind, Usage,
};

/// The closing SSE event of a chat stream.
pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// The SSE comment sent on an idle stream (every SSE client ignores it; writing it is how
/// a caller that left is noticed while the provider is silent).
pub const SSE_KEEPALIVE: &[u8] = b": keep-alive\n\n";

/// Metadata key under which a node passes a provider's native `tool_calls` (JSON).
const NATIVE_TOOL_CALLS: &str = "openai_tool_calls";
/// Metadata key a node sets (`"true"`) when the provider had no tool support and the
/// model was asked to write its tool calls as text.
const TEXT_TOOL_FALLBACK: &str = "openai_text_tool_fallback";

/// What a response needs to know of its request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResponseOptions {
    /// The public model name, echoed in every object.
    pub model: String,
    /// The run id: completion ids are `chatcmpl-{run_id}`, restored tool-call ids
    /// `call_{run_id}_{index}`.
    pub run_id: String,
    /// Unix seconds, the `created` of every object.
    pub created: u64,
    /// Stream SSE chunks rather than one JSON object.
    pub stream: bool,
    /// Close a stream with a usage chunk.
    pub include_usage: bool,
    /// Tools were offered: streamed text is held back until the run says whether it was
    /// a tool call written as text.
    pub wants_tools: bool,
}

impl ResponseOptions {
    /// The options for the request `asked`, served as `run_id`, created at `created`.
    #[must_use]
    pub fn new(asked: &RequestFacts, run_id: &str, created: u64) -> Self {
        Self::serving(asked.model.clone(), asked, run_id.to_owned(), created)
    }

    /// As [`new`](Self::new), with the model name and run id the caller already owns
    /// (an Edge has them from the request it admitted), so nothing is copied.
    #[must_use]
    pub fn serving(model: String, asked: &RequestFacts, run_id: String, created: u64) -> Self {
        ResponseOptions {
            model,
            run_id,
            created,
            stream: asked.stream,
            include_usage: asked.include_usage,
            wants_tools: asked.wants_tools,
        }
    }
}

/// One piece of a response, in the order it is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Out {
    /// The whole response, a JSON body with this status. Nothing follows.
    Whole {
        /// HTTP status.
        status: u16,
        /// `application/json` body.
        body: Bytes,
    },
    /// The head of a streamed response; [`Out::Data`] follows.
    Head {
        /// HTTP status.
        status: u16,
        /// Response headers (a tunnel's are the provider's, already allow-listed).
        headers: Vec<Header>,
    },
    /// Body bytes.
    Data(Bytes),
    /// The stream failed after its head and has no way to say so in band (not SSE): end
    /// the body abnormally, so the caller sees a truncated response rather than a
    /// complete-looking one. Nothing follows.
    Abort(String),
}

#[derive(Debug)]
enum Phase {
    /// Queued: nothing dispatched yet.
    Waiting,
    /// A run answered as one JSON object.
    Whole {
        content: String,
        usage: Option<Usage>,
    },
    /// A run answered as SSE chunks; its text held while it may be a tool call the model
    /// wrote as text (`holding`).
    Stream {
        started: bool,
        held: String,
        holding: bool,
    },
    /// A tunnel before the provider's status.
    TunnelHead,
    /// A tunnel passing the provider's body through.
    Tunnel { sse: bool, at_boundary: bool },
    /// Everything is out.
    Done,
}

/// Turns the events of one request into its OpenAI response: feed it what the Edge
/// machine says about the request ([`handle_event`](Self::handle_event), or its parts
/// `handle_dispatched`, `handle_run_event`, `handle_tunnel_frame`, `handle_end`) and what
/// the shell's timers say
/// (`handle_timeout`, `handle_idle`), and write every [`Out`] from
/// [`poll_output`](Responder::poll_output) in order until [`is_done`](Responder::is_done).
///
/// The rules it carries: a run becomes a `chat.completion` or `chat.completion.chunk`s
/// opened by a role chunk and closed by a finish chunk, the usage chunk when asked, and
/// `[DONE]`; tool calls come back from the node's metadata, natively or parsed from text
/// the model wrote under the fallback instruction (held back while streaming so the
/// caller never sees the call as text); a tunnel passes the provider's status,
/// allow-listed headers and body through, with keep-alive comments only between SSE
/// events; a failure before the head is an [`ApiError`] with its status, after the head
/// an SSE error event or an aborted body.
#[derive(Debug)]
pub struct Responder {
    options: ResponseOptions,
    phase: Phase,
    out: VecDeque<Out>,
    /// The status the response went out with, or 599 once it failed after its head.
    status: Option<u16>,
    /// The Edge machine has ended (or is ending) the request on its own.
    settled: bool,
    /// The last token usage the provider reported (run events or tunnel `USAGE` frames).
    usage: Option<Usage>,
}

impl Responder {
    /// A responder for a request that is queued.
    #[must_use]
    pub fn new(options: ResponseOptions) -> Self {
        Responder {
            options,
            phase: Phase::Waiting,
            // Every answer queues a piece: taken at once, the room costs one allocation
            // and not the first push's growth (about 60 instructions more).
            out: VecDeque::with_capacity(4),
            status: None,
            settled: false,
            usage: None,
        }
    }

    /// The token usage the provider reported for this request, if it did (the last
    /// report wins): for request logs and usage metrics. A tunnel's usage is observed
    /// from its `USAGE` frames and never changes the body.
    #[must_use]
    pub fn usage(&self) -> Option<&Usage> {
        self.usage.as_ref()
    }

    /// The next piece of the response to write.
    pub fn poll_output(&mut self) -> Option<Out> {
        self.out.pop_front()
    }

    /// Whether the response is complete once what [`poll_output`](Self::poll_output)
    /// holds is written.
    #[must_use]
    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    /// Whether the Edge machine still has the request open when the response is done
    /// (it timed out, or the response was cut short): the shell must cancel it so its
    /// lease and upstream work are released.
    #[must_use]
    pub fn needs_cancel(&self) -> bool {
        !self.settled
    }

    /// The status to record for the request: the status it was answered with, 599 if a
    /// stream failed after its head, `None` while nothing went out.
    #[must_use]
    pub fn status(&self) -> Option<u16> {
        self.status
    }

    /// One of the request's events, as the Edge machine hands it out
    /// ([`iop_proto_core::EdgeEvent::Request`]).
    pub fn handle_event(&mut self, event: RequestEvent) {
        match event {
            RequestEvent::Dispatched { shape, .. } => self.handle_dispatched(shape),
            RequestEvent::Run(event) => self.handle_run_event(*event),
            RequestEvent::Tunnel(part) => self.handle_tunnel_part(part),
            RequestEvent::Tunnels(parts) => {
                for part in parts {
                    self.handle_tunnel_part(part);
                }
            }
            RequestEvent::Ended(outcome) => self.handle_end(&outcome),
        }
    }

    /// The request was dispatched with `shape` to the provider that answers it.
    pub fn handle_dispatched(&mut self, shape: DispatchShape) {
        if !matches!(self.phase, Phase::Waiting) {
            return;
        }
        self.phase = match shape {
            DispatchShape::Tunnel => Phase::TunnelHead,
            DispatchShape::Run if self.options.stream => {
                self.head(
                    200,
                    vec![
                        header("content-type", "text/event-stream"),
                        header("cache-control", "no-cache"),
                    ],
                );
                Phase::Stream {
                    started: false,
                    held: String::new(),
                    holding: self.options.wants_tools,
                }
            }
            DispatchShape::Run => Phase::Whole {
                content: String::new(),
                usage: None,
            },
        };
    }

    /// A run event of the request, in sequence order (the Edge machine checked it).
    pub fn handle_run_event(&mut self, event: RunEvent) {
        let kind = RunEventType::try_from(event.r#type).ok();
        if event.usage.is_some() {
            self.usage.clone_from(&event.usage);
        }
        match &mut self.phase {
            Phase::Whole { content, usage } => {
                content.push_str(&event.delta);
                if event.usage.is_some() {
                    usage.clone_from(&event.usage);
                }
                match kind {
                    Some(RunEventType::Complete) => self.whole_complete(&event.metadata),
                    Some(RunEventType::Error) => {
                        self.settled = true;
                        self.fail_whole(&ApiError::provider(&event.error.unwrap_or_default()));
                    }
                    Some(RunEventType::Cancelled) => self.settled = true,
                    _ => {}
                }
            }
            Phase::Stream { started, .. } => {
                if !*started {
                    *started = true;
                    let role = json!({"role": "assistant", "content": ""});
                    let chunk = self.chunk(role, None);
                    self.data(chunk);
                }
                self.stream_event(kind, event);
            }
            _ => {}
        }
    }

    /// A tunnel frame as [`TunnelPart::from`] kept it (in sequence order, as for
    /// [`handle_tunnel_frame`](Self::handle_tunnel_frame)).
    ///
    /// The bare parts every answer is made of are read as they are, not rebuilt into
    /// frames first.
    pub fn handle_tunnel_part(&mut self, part: TunnelPart) {
        match part {
            TunnelPart::Body(body) => self.tunnel_body(body),
            TunnelPart::Status { code, headers } => self.tunnel_status(code, headers),
            TunnelPart::Usage(usage) => self.usage = Some(usage),
            TunnelPart::End => self.tunnel_end(),
            TunnelPart::Frame(frame) => self.handle_tunnel_frame(*frame),
        }
    }

    /// A `BODY` frame's bytes: passed through once the head is out.
    fn tunnel_body(&mut self, body: Bytes) {
        if let Phase::Tunnel { at_boundary, .. } = &mut self.phase
            && !body.is_empty()
        {
            *at_boundary = body.ends_with(b"\n\n") || body.ends_with(b"\r\n\r\n");
            self.data(body);
        }
    }

    /// A tunnel frame of the request, in sequence order (the Edge machine checked it).
    pub fn handle_tunnel_frame(&mut self, frame: ProviderTunnelFrame) {
        let kind = TunnelFrameKind::try_from(frame.kind).ok();
        if kind == Some(TunnelFrameKind::Usage) && frame.usage.is_some() {
            self.usage.clone_from(&frame.usage);
        }
        match (&mut self.phase, kind) {
            (_, Some(TunnelFrameKind::Status)) => {
                self.tunnel_status(frame.status_code, frame.headers);
            }
            (Phase::TunnelHead, Some(TunnelFrameKind::Error)) => {
                self.settled = true;
                self.fail_whole(&ApiError::provider(&frame.error.unwrap_or_default()));
            }
            (_, Some(TunnelFrameKind::Body)) => self.tunnel_body(frame.body),
            (Phase::Tunnel { .. }, Some(TunnelFrameKind::Error)) => {
                self.settled = true;
                let detail = frame.error.unwrap_or_default();
                self.fail_stream(&ApiError::provider(&detail));
            }
            (_, Some(TunnelFrameKind::End)) => self.tunnel_end(),
            // Headers and usage are observations; frames after the end change nothing.
            _ => {}
        }
    }

    /// A `STATUS` frame's code and headers: the response head, while it is awaited.
    fn tunnel_status(&mut self, code: u32, headers: Vec<Header>) {
        if !matches!(self.phase, Phase::TunnelHead) {
            return;
        }
        let status = u16::try_from(code)
            .ok()
            .filter(|s| (100..=999).contains(s))
            .unwrap_or(502);
        let mut sse = false;
        let headers = headers
            .into_iter()
            .filter(|h| iop_proto_core::tunnel::forwards_response_header(&h.name))
            .inspect(|h| {
                sse |= h.name.eq_ignore_ascii_case("content-type")
                    && h.value.starts_with(b"text/event-stream");
            })
            .collect();
        self.head(status, headers);
        self.phase = Phase::Tunnel {
            sse,
            at_boundary: true,
        };
    }

    /// An `END` frame: a passed-through answer is complete.
    fn tunnel_end(&mut self) {
        if let Phase::Tunnel { .. } = self.phase {
            self.settled = true;
            self.phase = Phase::Done;
        }
    }

    /// The Edge machine ended the request.
    pub fn handle_end(&mut self, outcome: &Outcome) {
        self.settled = true;
        match (&self.phase, outcome) {
            (Phase::Done, _) => {}
            (Phase::Waiting | Phase::Whole { .. } | Phase::TunnelHead, _) => {
                self.fail_whole(&ApiError::from_outcome(outcome));
            }
            (Phase::Stream { .. } | Phase::Tunnel { .. }, Outcome::Completed) => {
                self.phase = Phase::Done;
            }
            // The provider's error event already went out.
            (Phase::Stream { .. }, Outcome::Failed(RequestError::Provider(_))) => {
                self.phase = Phase::Done;
            }
            (Phase::Stream { .. } | Phase::Tunnel { .. }, outcome) => {
                let message = match outcome {
                    Outcome::Failed(RequestError::NodeLost { .. }) => {
                        "the node serving this request was lost".to_owned()
                    }
                    Outcome::Failed(RequestError::Provider(detail)) => {
                        format!("provider error: {}", detail.message)
                    }
                    Outcome::Failed(RequestError::Violation(why)) => {
                        format!("node protocol violation: {why}")
                    }
                    Outcome::Cancelled => "request cancelled".to_owned(),
                    _ => "the request failed".to_owned(),
                };
                let error = ApiError::new(
                    502,
                    super::ErrorType::Server,
                    message,
                    Some("stream_failed"),
                );
                self.fail_stream(&error);
            }
        }
    }

    /// The response deadline passed: the caller gets a timeout, and the request must be
    /// cancelled ([`needs_cancel`](Self::needs_cancel) stays true).
    pub fn handle_timeout(&mut self) {
        match self.phase {
            Phase::Done => {}
            Phase::Stream { .. } | Phase::Tunnel { .. } => self.fail_stream(&ApiError::timeout()),
            _ => self.fail_whole(&ApiError::timeout()),
        }
    }

    /// Nothing happened for one keep-alive interval: a streamed response gets an SSE
    /// comment, unless it would land inside an event the provider has half sent.
    pub fn handle_idle(&mut self) {
        let comment = match self.phase {
            Phase::Stream { .. } => true,
            Phase::Tunnel { sse, at_boundary } => sse && at_boundary,
            _ => false,
        };
        if comment {
            self.out
                .push_back(Out::Data(Bytes::from_static(SSE_KEEPALIVE)));
        }
    }

    fn head(&mut self, status: u16, headers: Vec<Header>) {
        self.status = Some(status);
        self.out.push_back(Out::Head { status, headers });
    }

    fn data(&mut self, bytes: Bytes) {
        self.out.push_back(Out::Data(bytes));
    }

    fn fail_whole(&mut self, error: &ApiError) {
        self.status = Some(error.status);
        self.out.push_back(Out::Whole {
            status: error.status,
            body: error.body(),
        });
        self.phase = Phase::Done;
    }

    /// A failure after the head: an SSE error event (the SDKs raise on it) or, for a
    /// body that is not SSE, an abort.
    fn fail_stream(&mut self, error: &ApiError) {
        let sse = match self.phase {
            Phase::Stream { .. } => true,
            Phase::Tunnel { sse, .. } => sse,
            _ => false,
        };
        self.status = Some(599);
        if sse {
            self.data(error.sse_event());
        } else {
            self.out.push_back(Out::Abort(error.message.clone()));
        }
        self.phase = Phase::Done;
    }

    fn whole_complete(&mut self, metadata: &BTreeMap<String, String>) {
        self.settled = true;
        let Phase::Whole { content, usage } = std::mem::replace(&mut self.phase, Phase::Done)
        else {
            return;
        };
        let tool_calls = restore_tool_calls(metadata, &content, &self.options.run_id);
        // A fallback's text *was* the tool call; an empty text next to tool calls is null.
        let text_is_call = metadata.contains_key(TEXT_TOOL_FALLBACK) || content.is_empty();
        let content = if tool_calls.is_some() && text_is_call {
            None
        } else {
            Some(content)
        };
        let mut message = json!({ "role": "assistant", "content": content });
        let finish = match tool_calls {
            Some(calls) => {
                message["tool_calls"] = calls;
                "tool_calls"
            }
            None => text_finish(metadata),
        };
        let mut body = json!({
            "id": format!("chatcmpl-{}", self.options.run_id),
            "object": "chat.completion",
            "created": self.options.created,
            "model": self.options.model,
            "choices": [{ "index": 0, "message": message, "finish_reason": finish, "logprobs": null }],
        });
        if let Some(u) = &usage {
            body["usage"] = usage_json(u);
        }
        self.status = Some(200);
        self.out.push_back(Out::Whole {
            status: 200,
            body: Bytes::from(body.to_string()),
        });
    }

    fn stream_event(&mut self, kind: Option<RunEventType>, event: RunEvent) {
        match kind {
            Some(RunEventType::Delta) if !event.delta.is_empty() => {
                let text = match &mut self.phase {
                    Phase::Stream {
                        held,
                        holding: holding @ true,
                        ..
                    } => {
                        held.push_str(&event.delta);
                        // A tool call written as text is JSON from its first byte (or a
                        // code fence): anything else is text, and is held no longer.
                        let start = held.trim_start();
                        if start.is_empty() || start.starts_with(['{', '`']) {
                            return;
                        }
                        *holding = false;
                        std::mem::take(held)
                    }
                    _ => event.delta,
                };
                let chunk = self.chunk(json!({"content": text}), None);
                self.data(chunk);
            }
            Some(RunEventType::Complete) => {
                self.settled = true;
                let held = match &mut self.phase {
                    Phase::Stream { held, .. } => std::mem::take(held),
                    _ => String::new(),
                };
                let calls = restore_tool_calls(&event.metadata, &held, &self.options.run_id);
                let fallback = event.metadata.contains_key(TEXT_TOOL_FALLBACK);
                if !held.is_empty() && (calls.is_none() || !fallback) {
                    let chunk = self.chunk(json!({"content": held}), None);
                    self.data(chunk);
                }
                let finish_reason = match &calls {
                    Some(calls) => {
                        let deltas = json!({"tool_calls": tool_call_deltas(calls)});
                        let chunk = self.chunk(deltas, None);
                        self.data(chunk);
                        "tool_calls"
                    }
                    None => text_finish(&event.metadata),
                };
                let chunk = self.chunk(json!({}), Some(finish_reason));
                self.data(chunk);
                if self.options.include_usage
                    && let Some(u) = &event.usage
                {
                    let mut usage_chunk = self.chunk_value(json!({}), None);
                    usage_chunk["choices"] = json!([]);
                    usage_chunk["usage"] = usage_json(u);
                    self.data(sse(&usage_chunk));
                }
                self.data(Bytes::from_static(SSE_DONE));
                self.phase = Phase::Done;
            }
            Some(RunEventType::Error) => {
                self.settled = true;
                let detail = event.error.unwrap_or_default();
                self.fail_stream(&ApiError::provider(&detail));
            }
            Some(RunEventType::Cancelled) => self.settled = true,
            _ => {}
        }
    }

    fn chunk_value(&self, delta: Value, finish_reason: Option<&str>) -> Value {
        json!({
            "id": format!("chatcmpl-{}", self.options.run_id),
            "object": "chat.completion.chunk",
            "created": self.options.created,
            "model": self.options.model,
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": null }],
        })
    }

    fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> Bytes {
        sse(&self.chunk_value(delta, finish_reason))
    }
}

fn header(name: &str, value: &'static str) -> Header {
    Header {
        name: name.to_owned(),
        value: Bytes::from_static(value.as_bytes()),
    }
}

/// One SSE `data:` event carrying `value`.
fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    })
}

/// The `finish_reason` of an answer of text: `length` when the node says the answer was
/// cut at `max_tokens`, else `stop`.
fn text_finish(metadata: &BTreeMap<String, String>) -> &'static str {
    match metadata
        .get(iop_proto_core::wire::FINISH_REASON_KEY)
        .map(String::as_str)
    {
        Some("length") => "length",
        _ => "stop",
    }
}

/// `tool_calls` from the native metadata key, or parsed from the text only when the node
/// marked the text fallback.
fn restore_tool_calls(
    metadata: &BTreeMap<String, String>,
    content: &str,
    run_id: &str,
) -> Option<Value> {
    if let Some(native) = metadata.get(NATIVE_TOOL_CALLS)
        && let Ok(calls @ Value::Array(_)) = serde_json::from_str::<Value>(native)
        && calls.as_array().is_some_and(|a| !a.is_empty())
    {
        return Some(calls);
    }
    if metadata.get(TEXT_TOOL_FALLBACK).map(String::as_str) == Some("true") {
        return parse_text_tool_calls(content, run_id);
    }
    None
}

/// Streaming `delta.tool_calls` (each call gets its `index`).
fn tool_call_deltas(calls: &Value) -> Value {
    let list = calls.as_array().cloned().unwrap_or_default();
    Value::Array(
        list.into_iter()
            .enumerate()
            .map(|(i, mut call)| {
                call["index"] = json!(i);
                call
            })
            .collect(),
    )
}

/// Tool calls written as text by a model that got the fallback instruction:
/// `{"tool_calls": [{"name": ..., "arguments": {...}}]}`, possibly inside a code fence.
/// Returns OpenAI `tool_calls` with ids `call_{run_id}_{index}`, or `None` when the text
/// is not such a call.
#[must_use]
pub fn parse_text_tool_calls(content: &str, run_id: &str) -> Option<Value> {
    let trimmed = content.trim();
    let inner = trimmed
        .strip_prefix("```json")
        .or_else(|| trimmed.strip_prefix("```"))
        .and_then(|s| s.strip_suffix("```"))
        .unwrap_or(trimmed)
        .trim();
    let value: Value = serde_json::from_str(inner).ok()?;
    let calls = value.get("tool_calls")?.as_array()?;
    if calls.is_empty() {
        return None;
    }
    let converted: Option<Vec<Value>> = calls
        .iter()
        .enumerate()
        .map(|(i, call)| {
            let name = call
                .get("name")
                .or_else(|| call.pointer("/function/name"))?
                .as_str()?;
            let arguments = call
                .get("arguments")
                .or_else(|| call.pointer("/function/arguments"))
                .cloned()
                .unwrap_or_else(|| json!({}));
            let arguments = match arguments {
                Value::String(text) => text,
                other => other.to_string(),
            };
            Some(json!({
                "id": format!("call_{run_id}_{i}"),
                "type": "function",
                "function": { "name": name, "arguments": arguments },
            }))
        })
        .collect();
    converted.map(Value::Array)
}
