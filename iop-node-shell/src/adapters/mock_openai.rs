//! The mock provider as an OpenAI-compatible server, for a mock adapter set to
//! `dispatch = "tunnel"`: it answers the tunnel itself, in process, the way an
//! OpenAI-compatible server would, so the quickstart can try every endpoint with no
//! provider installed.
//!
//! - `POST /v1/chat/completions` and `POST /v1/completions`: the mock's reply, word by
//!   word (SSE with `stream: true`, usage chunk with `stream_options.include_usage`),
//!   cut at `max_tokens` (`finish_reason: "length"`) or at a `stop` sequence (named in
//!   vLLM's `stop_reason`), or a tool call (its arguments streamed in two pieces) when
//!   the mock has `tool_call` set and the request offers tools;
//! - `POST /v1/messages`: the same as the Anthropic Messages API would answer it (JSON,
//!   or its event stream), for a mock the Edge sends Messages requests to as they came;
//! - `POST /v1/embeddings`: a deterministic unit vector per input (the same text always
//!   gets the same vector; `dimensions` from the request, default 16), as floats or,
//!   with `encoding_format: "base64"` (what the OpenAI SDKs ask for), as little-endian
//!   f32 in base64;
//! - anything else: 404 in OpenAI's error shape. A body that is not the JSON an endpoint
//!   needs: 400.

use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use bytes::Bytes;
use iop_proto_core::TunnelOutput;
use iop_proto_core::wire::{Header, TunnelRequest, Usage};
use iop_shell_common::cancel::Cancel;
use serde::Deserialize;
use serde_json::json;

use super::mock::plan::Plan;
use super::mock::{Fail, Mock, injected_failure, usage};
use super::{Sink, error};

/// Most dimensions an embeddings request may ask for.
const MAX_DIMENSIONS: usize = 4096;
/// Most inputs in one embeddings request (OpenAI's own limit).
const MAX_INPUTS: usize = 2048;
const DEFAULT_DIMENSIONS: usize = 16;
/// Most values in one embeddings answer (about 20 MiB of JSON floats).
const MAX_VALUES: usize = 1 << 20;

/// The fields the mock reads from a generation request.
#[derive(Deserialize, Default)]
#[serde(default)]
struct Generate<'a> {
    #[serde(borrow)]
    model: Option<std::borrow::Cow<'a, str>>,
    stream: bool,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    #[serde(borrow)]
    messages: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    prompt: Option<&'a serde_json::value::RawValue>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct StreamOptions {
    include_usage: bool,
}

/// The fields the mock reads from an embeddings request.
#[derive(Deserialize)]
struct Embed<'a> {
    #[serde(borrow, default)]
    model: Option<std::borrow::Cow<'a, str>>,
    input: Input,
    #[serde(default)]
    dimensions: Option<usize>,
    #[serde(borrow, default)]
    encoding_format: Option<std::borrow::Cow<'a, str>>,
}

/// OpenAI's `input`: a string, strings, token ids, or lists of token ids.
#[derive(Deserialize)]
#[serde(untagged)]
enum Input {
    One(String),
    Many(Vec<String>),
    Tokens(Vec<u64>),
    TokenLists(Vec<Vec<u64>>),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Text,
}

impl Mock {
    /// Answers a tunnel as an OpenAI-compatible server would.
    pub async fn tunnel(&self, request: TunnelRequest, sink: Sink, cancel: Cancel) {
        let id = format!("mock-{}", request.run_id());
        let path = request.path().split('?').next().unwrap_or_default();
        let body = request.body();
        let answer = match (request.method(), path) {
            ("POST", "/v1/chat/completions") => {
                self.generate(Endpoint::Chat, &id, &body, &sink, &cancel)
                    .await
            }
            ("POST", "/v1/completions") => {
                self.generate(Endpoint::Text, &id, &body, &sink, &cancel)
                    .await
            }
            ("POST", "/v1/embeddings") => embeddings(&body, &sink).await,
            ("POST", "/v1/messages") => self.messages(&id, &body, &sink, &cancel).await,
            ("POST", "/tokenize") => tokenize(&body, &sink).await,
            _ => Err(Refusal::new(
                404,
                "not_found",
                format!("the mock serves no {} {path}", request.method()),
            )),
        };
        if let Err(refusal) = answer {
            let body = json!({"error": {
                "message": refusal.message,
                "type": if refusal.status == 404 { "not_found_error" } else { "invalid_request_error" },
                "code": refusal.code,
            }});
            whole(&sink, refusal.status, body.to_string().into(), None).await;
        }
    }

    async fn generate(
        &self,
        endpoint: Endpoint,
        id: &str,
        body: &[u8],
        sink: &Sink,
        cancel: &Cancel,
    ) -> Result<(), Refusal> {
        let req: Generate<'_> = serde_json::from_slice(body)
            .map_err(|e| Refusal::new(400, "invalid_request", format!("request body: {e}")))?;
        let input = match endpoint {
            Endpoint::Chat => req.messages,
            Endpoint::Text => req.prompt,
        }
        .ok_or_else(|| {
            let field = if endpoint == Endpoint::Chat {
                "messages"
            } else {
                "prompt"
            };
            Refusal::new(400, "invalid_request", format!("{field} is required"))
        })?;
        if self.fail == Fail::Always {
            return Err(Refusal::new(
                500,
                "mock_failure",
                "injected failure".to_owned(),
            ));
        }
        let model = req.model.as_deref().unwrap_or("mock").to_owned();
        let mut plan = self.plan(body);
        if endpoint == Endpoint::Text {
            plan.tool = None;
        }
        let prompt_tokens = (input.get().len() as u64).div_ceil(4);
        let usage = usage(prompt_tokens, plan.tokens);
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let shape = Shape {
            endpoint,
            id,
            model: &model,
            created,
        };
        if !req.stream {
            let mut text = String::new();
            for (i, piece) in plan.pieces.iter().enumerate() {
                if self.fail == Fail::After(i) {
                    return Err(Refusal::new(
                        500,
                        "mock_failure",
                        format!("injected failure after {i} tokens"),
                    ));
                }
                if self.fail == Fail::Stall(i) {
                    cancel.cancelled().await;
                }
                if !self.pause(cancel).await {
                    cancelled(sink).await;
                    return Ok(());
                }
                text.push_str(piece);
            }
            let body = shape.whole(&text, &plan, &usage);
            whole(sink, 200, body.to_string().into(), Some(usage)).await;
            return Ok(());
        }
        let headers = vec![
            header("content-type", "text/event-stream"),
            header("cache-control", "no-cache"),
        ];
        if !sink
            .tunnel(TunnelOutput::Status {
                status: 200,
                headers,
            })
            .await
        {
            return Ok(());
        }
        if endpoint == Endpoint::Chat
            && !event(
                sink,
                &shape.chunk(Some(json!({"role": "assistant", "content": ""})), None),
            )
            .await
        {
            return Ok(());
        }
        if let Some((name, arguments)) = &plan.tool {
            // The arguments in two pieces, as servers stream them.
            let half = arguments
                .char_indices()
                .map(|(i, _)| i)
                .nth(arguments.chars().count() / 2)
                .unwrap_or(0);
            let (head, tail) = arguments.split_at(half);
            let first = json!({"tool_calls": [{"index": 0, "id": format!("call_{id}"), "type": "function",
                "function": {"name": name, "arguments": head}}]});
            let second = json!({"tool_calls": [{"index": 0, "function": {"arguments": tail}}]});
            if !self.pause(cancel).await {
                cancelled(sink).await;
                return Ok(());
            }
            if !event(sink, &shape.chunk(Some(first), None)).await
                || !event(sink, &shape.chunk(Some(second), None)).await
            {
                return Ok(());
            }
        }
        for (i, piece) in plan.pieces.iter().enumerate() {
            if self.fail == Fail::After(i) {
                let _ = sink.tunnel(TunnelOutput::Error(injected_failure(i))).await;
                return Ok(());
            }
            if self.fail == Fail::Stall(i) {
                cancel.cancelled().await;
            }
            if !self.pause(cancel).await {
                cancelled(sink).await;
                return Ok(());
            }
            let piece = match endpoint {
                Endpoint::Chat => shape.chunk(Some(json!({"content": piece})), None),
                Endpoint::Text => shape.chunk(Some(json!(piece)), None),
            };
            if !event(sink, &piece).await {
                return Ok(());
            }
        }
        let mut last = match endpoint {
            Endpoint::Chat => shape.chunk(Some(json!({})), Some(plan.finish)),
            Endpoint::Text => shape.chunk(Some(json!("")), Some(plan.finish)),
        };
        last["choices"][0]["stop_reason"] = json!(plan.stop_sequence);
        if !event(sink, &last).await {
            return Ok(());
        }
        if req.stream_options.is_some_and(|o| o.include_usage) {
            let mut tail = shape.chunk(None, None);
            tail["usage"] = usage_json(&usage);
            if !event(sink, &tail).await {
                return Ok(());
            }
        }
        if sink
            .tunnel(TunnelOutput::Body(Bytes::from_static(b"data: [DONE]\n\n")))
            .await
            && sink.tunnel(TunnelOutput::Usage(usage)).await
        {
            let _ = sink.tunnel(TunnelOutput::End).await;
        }
        Ok(())
    }
}

impl Mock {
    /// `POST /v1/messages`: the answer as the Anthropic Messages API gives it, so that a
    /// mock declared `native_messages` shows a Messages request passing through the Edge
    /// untranslated (its id starts `msg_native_`).
    async fn messages(
        &self,
        id: &str,
        body: &[u8],
        sink: &Sink,
        cancel: &Cancel,
    ) -> Result<(), Refusal> {
        let req: MessagesIn = serde_json::from_slice(body).map_err(|e| {
            Refusal::new(400, "invalid_request_error", format!("request body: {e}"))
        })?;
        let Some(max_tokens) = req.max_tokens else {
            return Err(Refusal::new(
                400,
                "invalid_request_error",
                "max_tokens: Field required".to_owned(),
            ));
        };
        // The plan reads a chat body: the parts of this one it acts on, in that shape.
        let last_is_result = req.messages.last().is_some_and(|m| {
            m.content
                .as_array()
                .is_some_and(|blocks| blocks.iter().any(|b| b["type"] == "tool_result"))
        });
        let tools: Vec<serde_json::Value> = req
            .tools
            .iter()
            .map(|t| json!({"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}))
            .collect();
        let chat = json!({
            "max_tokens": max_tokens,
            "stop": req.stop_sequences,
            "tools": tools,
            "messages": [{"role": if last_is_result { "tool" } else { "user" }}],
        });
        let plan = self.plan(chat.to_string().as_bytes());
        let model = req.model.unwrap_or_else(|| "mock".to_owned());
        let message_id = format!("msg_native_{id}");
        let input_tokens = (body.len() as u64).div_ceil(4);
        let stop_reason = match plan.finish {
            "length" => "max_tokens",
            "tool_calls" => "tool_use",
            _ if plan.stop_sequence.is_some() => "stop_sequence",
            _ => "end_turn",
        };
        let tool = plan.tool.as_ref().map(|(name, arguments)| {
            let input: serde_json::Value = serde_json::from_str(arguments).unwrap_or(json!({}));
            (format!("toolu_{id}"), name.clone(), input)
        });
        let usage = json!({"input_tokens": input_tokens, "output_tokens": plan.tokens});
        if !req.stream {
            let mut text = String::new();
            for piece in &plan.pieces {
                if !self.pause(cancel).await {
                    cancelled(sink).await;
                    return Ok(());
                }
                text.push_str(piece);
            }
            let mut content = Vec::new();
            if !text.is_empty() {
                content.push(json!({"type": "text", "text": text}));
            }
            if let Some((tool_id, name, input)) = &tool {
                content
                    .push(json!({"type": "tool_use", "id": tool_id, "name": name, "input": input}));
            }
            let body = json!({
                "id": message_id, "type": "message", "role": "assistant", "model": model,
                "content": content, "stop_reason": stop_reason,
                "stop_sequence": plan.stop_sequence, "usage": usage,
            });
            whole(
                sink,
                200,
                body.to_string().into(),
                Some(super::mock::usage(input_tokens, plan.tokens)),
            )
            .await;
            return Ok(());
        }
        let headers = vec![
            header("content-type", "text/event-stream"),
            header("cache-control", "no-cache"),
        ];
        if !sink
            .tunnel(TunnelOutput::Status {
                status: 200,
                headers,
            })
            .await
        {
            return Ok(());
        }
        let start = json!({"type": "message_start", "message": {
            "id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0}}});
        if !named_event(sink, &start).await {
            return Ok(());
        }
        let mut index = 0;
        if !plan.pieces.is_empty() {
            let open = json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}});
            if !named_event(sink, &open).await {
                return Ok(());
            }
            for piece in &plan.pieces {
                if !self.pause(cancel).await {
                    cancelled(sink).await;
                    return Ok(());
                }
                let delta = json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}});
                if !named_event(sink, &delta).await {
                    return Ok(());
                }
            }
            if !named_event(sink, &json!({"type": "content_block_stop", "index": 0})).await {
                return Ok(());
            }
            index = 1;
        }
        if let Some((tool_id, name, input)) = &tool {
            let events = [
                json!({"type": "content_block_start", "index": index, "content_block": {"type": "tool_use", "id": tool_id, "name": name, "input": {}}}),
                json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
                json!({"type": "content_block_stop", "index": index}),
            ];
            for e in &events {
                if !named_event(sink, e).await {
                    return Ok(());
                }
            }
        }
        let end = [
            json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": plan.stop_sequence}, "usage": {"output_tokens": plan.tokens}}),
            json!({"type": "message_stop"}),
        ];
        for e in &end {
            if !named_event(sink, e).await {
                return Ok(());
            }
        }
        if sink
            .tunnel(TunnelOutput::Usage(super::mock::usage(
                input_tokens,
                plan.tokens,
            )))
            .await
        {
            let _ = sink.tunnel(TunnelOutput::End).await;
        }
        Ok(())
    }
}

/// The members of a Messages request the mock reads.
#[derive(Deserialize)]
struct MessagesIn {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stop_sequences: Vec<String>,
    #[serde(default)]
    tools: Vec<serde_json::Value>,
    #[serde(default)]
    messages: Vec<MessageIn>,
}

#[derive(Deserialize)]
struct MessageIn {
    #[serde(default)]
    content: serde_json::Value,
}

/// An SSE event named by its `type`, as the Messages API writes them.
async fn named_event(sink: &Sink, value: &serde_json::Value) -> bool {
    let name = value["type"].as_str().unwrap_or("message");
    let text = format!("event: {name}\ndata: {value}\n\n");
    sink.tunnel(TunnelOutput::Body(text.into())).await
}

/// How responses of one request look: ids, object names and the model echoed back.
struct Shape<'a> {
    endpoint: Endpoint,
    id: &'a str,
    model: &'a str,
    created: u64,
}

impl Shape<'_> {
    fn whole(&self, text: &str, plan: &Plan, usage: &Usage) -> serde_json::Value {
        let finish = plan.finish;
        let (object, mut choice) = match self.endpoint {
            Endpoint::Chat => (
                "chat.completion",
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish}),
            ),
            Endpoint::Text => (
                "text_completion",
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish}),
            ),
        };
        choice["stop_reason"] = json!(plan.stop_sequence);
        if let Some((name, arguments)) = &plan.tool {
            choice["message"]["content"] = serde_json::Value::Null;
            choice["message"]["tool_calls"] = json!([{"id": format!("call_{}", self.id), "type": "function",
                "function": {"name": name, "arguments": arguments}}]);
        }
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [choice], "usage": usage_json(usage),
        })
    }

    /// A stream chunk: `delta` (chat) or `text` (completions); no choices when `None`.
    fn chunk(&self, content: Option<serde_json::Value>, finish: Option<&str>) -> serde_json::Value {
        let (object, choices) = match (self.endpoint, content) {
            (_, None) => (self.chunk_object(), json!([])),
            (Endpoint::Chat, Some(delta)) => (
                "chat.completion.chunk",
                json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]),
            ),
            (Endpoint::Text, Some(text)) => (
                "text_completion",
                json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}]),
            ),
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices})
    }

    fn chunk_object(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Text => "text_completion",
        }
    }
}

/// vLLM's `POST /tokenize` with chat `messages`: the count is the prompt tokens the mock
/// reports for the same messages in a completion's usage, and `tokens` that many ids.
async fn tokenize(body: &[u8], sink: &Sink) -> Result<(), Refusal> {
    let req: Generate<'_> = serde_json::from_slice(body)
        .map_err(|e| Refusal::new(400, "invalid_request", format!("request body: {e}")))?;
    let messages = req
        .messages
        .ok_or_else(|| Refusal::new(400, "invalid_request", "messages is required".to_owned()))?;
    let count = (messages.get().len() as u64).div_ceil(4);
    let mut out = format!("{{\"count\":{count},\"max_model_len\":32768,\"tokens\":[");
    for i in 0..count {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&(i % 50_000).to_string());
    }
    out.push_str("],\"token_strs\":null}");
    whole(sink, 200, out.into(), None).await;
    Ok(())
}

async fn embeddings(body: &[u8], sink: &Sink) -> Result<(), Refusal> {
    let req: Embed<'_> = serde_json::from_slice(body)
        .map_err(|e| Refusal::new(400, "invalid_request", format!("request body: {e}")))?;
    let dimensions = req.dimensions.unwrap_or(DEFAULT_DIMENSIONS);
    if dimensions == 0 || dimensions > MAX_DIMENSIONS {
        return Err(Refusal::new(
            400,
            "invalid_request",
            format!("dimensions must be 1 to {MAX_DIMENSIONS}"),
        ));
    }
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(Refusal::new(
                400,
                "invalid_request",
                format!("encoding_format {other:?} is not float or base64"),
            ));
        }
    };
    // Each input as bytes to hash, and what it counts in prompt tokens.
    let inputs: Vec<(Vec<u8>, u64)> = match req.input {
        Input::One(text) => vec![text_input(text)],
        Input::Many(texts) => texts.into_iter().map(text_input).collect(),
        Input::Tokens(ids) => vec![token_input(&ids)],
        Input::TokenLists(lists) => lists.iter().map(|ids| token_input(ids)).collect(),
    };
    if inputs.is_empty() || inputs.len() > MAX_INPUTS {
        return Err(Refusal::new(
            400,
            "invalid_request",
            format!("input must hold 1 to {MAX_INPUTS} items"),
        ));
    }
    // The answer grows with inputs × dimensions: bound it before building it.
    if inputs.len() * dimensions > MAX_VALUES {
        return Err(Refusal::new(
            400,
            "invalid_request",
            format!("at most {MAX_VALUES} values in all (inputs × dimensions)"),
        ));
    }
    let prompt_tokens = inputs.iter().map(|(_, t)| t).sum();
    let data: Vec<serde_json::Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, (bytes, _))| {
            let vector = unit_vector(bytes, dimensions);
            let embedding = if base64 {
                let raw: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(raw))
            } else {
                json!(vector)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    let usage = usage(prompt_tokens, 0);
    let body = json!({
        "object": "list",
        "data": data,
        "model": req.model.as_deref().unwrap_or("mock"),
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    });
    whole(sink, 200, body.to_string().into(), Some(usage)).await;
    Ok(())
}

fn text_input(text: String) -> (Vec<u8>, u64) {
    let tokens = (text.len() as u64).div_ceil(4);
    (text.into_bytes(), tokens)
}

fn token_input(ids: &[u64]) -> (Vec<u8>, u64) {
    (
        ids.iter().flat_map(|t| t.to_le_bytes()).collect(),
        ids.len() as u64,
    )
}

/// A deterministic unit vector for `bytes`: FNV-1a seeds a xorshift generator.
fn unit_vector(bytes: &[u8], dimensions: usize) -> Vec<f32> {
    let mut state = bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    }) | 1;
    let mut v: Vec<f32> = (0..dimensions)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // The top 24 bits, mapped onto [-1, 1).
            ((state >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v
}

/// A whole JSON response: status, body, usage for the Edge's metrics, end.
async fn whole(sink: &Sink, status: u32, body: Bytes, usage: Option<Usage>) {
    let headers = vec![header("content-type", "application/json")];
    if !sink.tunnel(TunnelOutput::Status { status, headers }).await
        || !sink.tunnel(TunnelOutput::Body(body)).await
    {
        return;
    }
    if let Some(usage) = usage
        && !sink.tunnel(TunnelOutput::Usage(usage)).await
    {
        return;
    }
    let _ = sink.tunnel(TunnelOutput::End).await;
}

async fn event(sink: &Sink, value: &serde_json::Value) -> bool {
    let line = format!("data: {value}\n\n");
    sink.tunnel(TunnelOutput::Body(line.into())).await
}

async fn cancelled(sink: &Sink) {
    let _ = sink
        .tunnel(TunnelOutput::Error(error(
            "cancelled",
            "cancelled by the edge",
            false,
        )))
        .await;
}

fn usage_json(usage: &Usage) -> serde_json::Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    })
}

fn header(name: &str, value: &'static str) -> Header {
    Header {
        name: name.into(),
        value: Bytes::from_static(value.as_bytes()),
    }
}

struct Refusal {
    status: u32,
    code: &'static str,
    message: String,
}

impl Refusal {
    fn new(status: u32, code: &'static str, message: String) -> Self {
        Refusal {
            status,
            code,
            message,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectors_are_deterministic_unit_vectors() {
        let a = unit_vector(b"hello", 32);
        assert_eq!(a, unit_vector(b"hello", 32));
        assert_ne!(a, unit_vector(b"hullo", 32));
        let norm: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "{norm}");
        assert!(a.iter().all(|x| (-1.0..=1.0).contains(x)));
    }

    /// What the mock answers to `method path body`: status, body text, ended cleanly.
    async fn answer(method: &str, path: &str, body: &str) -> (u32, String, bool) {
        let mock = Mock::from_options(&[("token_delay_ms".to_owned(), "0".to_owned())].into())
            .expect("options");
        let (tx, mut rx) = tokio::sync::mpsc::channel(64);
        let request = iop_proto_core::wire::ProviderTunnelRequest {
            run_id: "r1".into(),
            method: method.into(),
            path: path.into(),
            body: Bytes::copy_from_slice(body.as_bytes()),
            ..Default::default()
        };
        mock.tunnel(request.into(), Sink::new("r1".into(), tx), Cancel::new())
            .await;
        let (mut status, mut text, mut ended) = (0, String::new(), false);
        while let Ok(super::super::Output::Tunnel { output, .. }) = rx.try_recv() {
            match output {
                TunnelOutput::Status { status: s, .. } => status = s,
                TunnelOutput::Body(b) => text.push_str(std::str::from_utf8(&b).expect("utf-8")),
                TunnelOutput::End => ended = true,
                _ => {}
            }
        }
        (status, text, ended)
    }

    #[tokio::test]
    async fn answers_like_an_openai_server() {
        let (status, body, ended) = answer(
            "POST",
            "/v1/chat/completions",
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#,
        )
        .await;
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!((status, ended), (200, true));
        assert_eq!(v["choices"][0]["message"]["content"], "Hello from");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["model"], "m");

        let (status, body, _) =
            answer("POST", "/v1/completions", r#"{"prompt":"x","stream":true}"#).await;
        assert_eq!(status, 200);
        assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
        assert!(body.contains(r#""finish_reason":"stop""#), "{body}");

        let (status, body, _) = answer("GET", "/v1/files", "").await;
        assert_eq!(status, 404, "{body}");
        let (status, body, _) =
            answer("POST", "/v1/embeddings", r#"{"input":"x","dimensions":0}"#).await;
        assert_eq!(status, 400, "{body}");
        let many = format!(
            r#"{{"input":[{}],"dimensions":4096}}"#,
            vec![r#""x""#; 2048].join(",")
        );
        let (status, body, _) = answer("POST", "/v1/embeddings", &many).await;
        assert_eq!(
            status, 400,
            "8M floats are refused before they are built: {body}"
        );
        let (status, _, _) = answer("POST", "/v1/chat/completions", "not json").await;
        assert_eq!(status, 400);
        let (status, _, _) = answer("POST", "/v1/completions", r#"{"model":"m"}"#).await;
        assert_eq!(status, 400, "a prompt is required");

        // vLLM's tokenizer: the same count as the usage of a completion of the messages.
        let messages = r#"[{"role":"user","content":"hi"}]"#;
        let (_, body, _) = answer(
            "POST",
            "/v1/chat/completions",
            &format!(r#"{{"model":"m","messages":{messages}}}"#),
        )
        .await;
        let usage: serde_json::Value = serde_json::from_str(&body).expect("json");
        let (status, body, _) = answer(
            "POST",
            "/tokenize",
            &format!(r#"{{"model":"m","messages":{messages},"add_generation_prompt":true}}"#),
        )
        .await;
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(status, 200);
        assert_eq!(v["count"], usage["usage"]["prompt_tokens"]);
        assert_eq!(v["tokens"].as_array().map(Vec::len), Some(8));
    }

    #[test]
    fn inputs_count_tokens() {
        assert_eq!(text_input("abcdefgh".into()).1, 2);
        assert_eq!(token_input(&[1, 2, 3]).1, 3);
    }
}
