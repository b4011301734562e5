//! `ollama`: normalized runs over `/api/chat` (streaming NDJSON) with tool calls and
//! usage, and the read-only `OLLAMA_API` pass-through.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use iop_json::nonempty_array;
use iop_proto_core::RunOutput;
use iop_proto_core::wire::{AdapterConfig, Header, ProviderHealth, RunRequest, Usage};
use iop_shell_common::cancel::Cancel;
use serde_json::{Map, Value, json};
use tokio::time::{Instant, timeout_at};

use super::http::{self, HttpClient, Upstream};
use super::json;
use super::sse::Lines;
use super::{Sink, error};

/// An Ollama server.
#[derive(Debug)]
pub struct Ollama {
    upstream: Upstream,
    client: HttpClient,
    default_timeout: Duration,
}

impl Ollama {
    /// The server's health, probed with `/api/version`.
    pub async fn health(&self) -> ProviderHealth {
        http::probe(&self.client, &self.upstream, "/api/version").await
    }
}

/// Converts an OpenAI chat request into an Ollama `/api/chat` request body. Messages are
/// copied byte for byte except those carrying `tool_calls` (OpenAI writes a call's
/// arguments as a JSON string, Ollama as an object) or content parts (Ollama takes one
/// text and its images as base64 beside it): no tree of the whole input is built.
pub fn to_ollama(input: &[u8], target: &str) -> Result<Vec<u8>, String> {
    use std::borrow::Cow;
    let object = json::Object::parse(input)?;
    let messages = match object.get("messages") {
        None => Vec::new(),
        Some(raw) => json::elements(raw).ok_or("messages is not an array")?,
    };
    let mut converted = Vec::with_capacity(messages.len());
    for message in messages {
        let text = message.get();
        if !text.contains("\"tool_calls\"") && !text.contains("\"content\":[") {
            converted.push(Cow::Borrowed(text));
            continue;
        }
        let mut message: Value = serde_json::from_str(text).unwrap_or(Value::Null);
        if let Some(calls) = message.get_mut("tool_calls").and_then(Value::as_array_mut) {
            for call in calls {
                if let Some(args) = call.pointer_mut("/function/arguments")
                    && let Some(text) = args.as_str()
                {
                    *args = serde_json::from_str(text).unwrap_or_else(|_| json!({}));
                }
            }
        }
        if let Some(parts) = message.get("content").and_then(Value::as_array) {
            let (content, images) = ollama_content(parts)?;
            message["content"] = Value::String(content);
            if !images.is_empty() {
                message["images"] = Value::from(images);
            }
        }
        converted.push(Cow::Owned(message.to_string()));
    }
    let messages = json::array(converted);
    let model = Value::from(target).to_string();
    let mut set: Vec<(&str, &str)> = vec![
        ("model", &model),
        ("messages", &messages),
        ("stream", "true"),
    ];
    if let Some(tools) = object.get("tools")
        && nonempty_array(tools)
    {
        set.push(("tools", tools.get()));
    }
    let mut options = Map::new();
    for (from, to) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("max_tokens", "num_predict"),
        ("seed", "seed"),
        ("stop", "stop"),
    ] {
        if let Some(value) = object
            .get(from)
            .and_then(|v| serde_json::from_str(v.get()).ok())
        {
            options.insert(to.to_owned(), value);
        }
    }
    let options = Value::Object(options).to_string();
    if options != "{}" {
        set.push(("options", &options));
    }
    // Only the members Ollama understands: start from an empty object.
    Ok(json::Object::default().write(&set))
}

/// OpenAI content parts as Ollama takes them: the texts joined by newlines, and the
/// images (data URLs) as base64. An image by URL or a file part cannot be: refused.
fn ollama_content(parts: &[Value]) -> Result<(String, Vec<String>), String> {
    let mut texts = Vec::new();
    let mut images = Vec::new();
    for part in parts {
        match part.get("type").and_then(Value::as_str) {
            Some("text") => texts.push(part.get("text").and_then(Value::as_str).unwrap_or("")),
            Some("image_url") => {
                let url = part
                    .pointer("/image_url/url")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let data = url
                    .strip_prefix("data:")
                    .and_then(|rest| rest.split_once(";base64,"))
                    .map(|(_, data)| data)
                    .ok_or("ollama takes images as base64 data, not by URL")?;
                images.push(data.to_owned());
            }
            other => {
                return Err(format!(
                    "ollama takes text and image content parts, not {}",
                    other.unwrap_or("untyped parts")
                ));
            }
        }
    }
    Ok((texts.join("\n"), images))
}

/// Converts Ollama tool calls into OpenAI `tool_calls`.
#[must_use]
pub fn openai_tool_calls(calls: &[Value], first_index: usize) -> Vec<Value> {
    calls
        .iter()
        .enumerate()
        .map(|(i, call)| {
            let name = call
                .pointer("/function/name")
                .and_then(Value::as_str)
                .unwrap_or("");
            let arguments = call
                .pointer("/function/arguments")
                .cloned()
                .unwrap_or_else(|| json!({}));
            let arguments = match arguments {
                Value::String(text) => text,
                other => other.to_string(),
            };
            json!({
                "id": format!("call_{}", first_index + i),
                "type": "function",
                "function": { "name": name, "arguments": arguments },
            })
        })
        .collect()
}

impl Ollama {
    /// An adapter for `config`.
    pub fn new(
        config: &AdapterConfig,
        client: HttpClient,
        default_timeout: Duration,
    ) -> Result<Self, String> {
        Ok(Ollama {
            upstream: Upstream::new(&config.base_url, "")?,
            client,
            default_timeout,
        })
    }

    /// Streams a chat through `/api/chat`.
    pub async fn run(&self, request: RunRequest, sink: Sink, cancel: Cancel) {
        if !sink.run(RunOutput::Start).await {
            return;
        }
        let output = tokio::select! {
            () = cancel.cancelled() => RunOutput::Cancelled,
            output = self.run_inner(&request, &sink) => output,
        };
        let _ = sink.run(output).await;
    }

    async fn run_inner(&self, request: &RunRequest, sink: &Sink) -> RunOutput {
        let deadline = Instant::now() + self.default_timeout;
        let target = request.target.clone();
        let body = match super::convert_input(&request.input, move |input| {
            to_ollama(input, &target)
        })
        .await
        {
            Ok(body) => body,
            Err(err) => return RunOutput::Error(err),
        };
        let mut headers = vec![Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"application/json"),
        }];
        headers.extend(super::http::trace_headers(&request.metadata));
        let upstream = match self
            .upstream
            .request("POST", "/api/chat", &headers, Bytes::from(body))
        {
            Ok(r) => r,
            Err(err) => return RunOutput::Error(error("bad_request", err, false)),
        };
        let sent = self.upstream.send(&self.client, upstream);
        let response = match timeout_at(deadline, sent).await {
            Err(_) => {
                return RunOutput::Error(error("timeout", "ollama did not answer in time", true));
            }
            Ok(Err(err)) => {
                return RunOutput::Error(error(
                    "upstream_unreachable",
                    format!("request failed: {err}"),
                    true,
                ));
            }
            Ok(Ok(response)) => response,
        };
        let status = response.status();
        let mut body = response.into_body();
        if !status.is_success() {
            let text = match timeout_at(deadline, body.collect()).await {
                Ok(Ok(collected)) => String::from_utf8_lossy(&collected.to_bytes()).into_owned(),
                _ => String::new(),
            };
            return RunOutput::Error(error(
                "upstream_status",
                format!("ollama answered {}: {}", status.as_u16(), text.trim()),
                super::provider_failed(status),
            ));
        }
        let mut lines = Lines::default();
        let mut calls: Vec<Value> = Vec::new();
        let mut usage: Option<Usage> = None;
        let mut finish: Option<&'static str> = None;
        let mut ended = false;
        while !ended {
            let data = match timeout_at(deadline, body.frame()).await {
                Err(_) => return RunOutput::Error(error("timeout", "ollama stream stalled", true)),
                // A newline flushes a last line that lacked one.
                Ok(None) => {
                    ended = true;
                    Bytes::from_static(b"\n")
                }
                Ok(Some(Err(err))) => {
                    return RunOutput::Error(error(
                        "upstream_unreachable",
                        format!("stream failed: {err}"),
                        true,
                    ));
                }
                Ok(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => data,
                    Err(_) => continue,
                },
            };
            lines.push(data);
            while let Some(line) = lines.next_line() {
                if line.is_empty() {
                    continue;
                }
                let Ok(chunk) = serde_json::from_slice::<Value>(&line) else {
                    return RunOutput::Error(error(
                        "upstream_protocol",
                        "ollama sent a line that is not JSON",
                        false,
                    ));
                };
                if let Some(message) = chunk.get("error").and_then(Value::as_str) {
                    return RunOutput::Error(error("upstream_error", message, false));
                }
                if let Some(text) = chunk.pointer("/message/content").and_then(Value::as_str)
                    && !text.is_empty()
                    && !sink.run(RunOutput::Delta(text.to_owned())).await
                {
                    return RunOutput::Cancelled;
                }
                if let Some(list) = chunk
                    .pointer("/message/tool_calls")
                    .and_then(Value::as_array)
                {
                    let converted = openai_tool_calls(list, calls.len());
                    calls.extend(converted);
                }
                if chunk.get("done").and_then(Value::as_bool) == Some(true) {
                    // `length` when cut at `num_predict`; Ollama does not say which stop
                    // sequence fired.
                    if let Some(reason) = chunk.get("done_reason").and_then(Value::as_str) {
                        finish = Some(if reason == "length" { "length" } else { "stop" });
                    }
                    let n = |key: &str| chunk.get(key).and_then(Value::as_u64).unwrap_or(0);
                    let (prompt, completion) = (n("prompt_eval_count"), n("eval_count"));
                    usage = Some(Usage {
                        prompt_tokens: prompt,
                        completion_tokens: completion,
                        total_tokens: prompt.saturating_add(completion),
                    });
                }
            }
        }
        let mut metadata = BTreeMap::new();
        if let Some(finish) = finish {
            metadata.insert(
                iop_proto_core::wire::FINISH_REASON_KEY.to_owned(),
                finish.to_owned(),
            );
        }
        if !calls.is_empty() {
            metadata.insert(
                "openai_tool_calls".to_owned(),
                Value::Array(calls).to_string(),
            );
        }
        RunOutput::Complete { usage, metadata }
    }

    /// Read-only pass-through (the session already admitted only the allowed endpoints).
    pub async fn api(&self, method: &str, path: &str, body: Bytes) -> Result<Bytes, String> {
        let headers = [Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"application/json"),
        }];
        let request = self.upstream.request(method, path, &headers, body)?;
        let sent = self.upstream.send(&self.client, request);
        let response = tokio::time::timeout(Duration::from_secs(30), sent)
            .await
            .map_err(|_| "ollama did not answer in time".to_string())?
            .map_err(|err| format!("request failed: {err}"))?;
        let status = response.status();
        let bytes = tokio::time::timeout(Duration::from_secs(30), response.into_body().collect())
            .await
            .map_err(|_| "ollama response stalled".to_string())?
            .map_err(|err| format!("response failed: {err}"))?
            .to_bytes();
        if status.is_success() {
            Ok(bytes)
        } else {
            Err(format!(
                "ollama answered {}: {}",
                status.as_u16(),
                String::from_utf8_lossy(&bytes).trim()
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_requests_become_ollama_requests() {
        let input = json!({
            "model": "public",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}}]}
            ],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "max_tokens": 5
        });
        let out: Value = serde_json::from_slice(
            &to_ollama(input.to_string().as_bytes(), "llama3").expect("converts"),
        )
        .expect("JSON");
        assert_eq!(out["model"], "llama3");
        assert_eq!(out["stream"], true);
        assert_eq!(out["options"]["num_predict"], 5);
        assert_eq!(
            out["messages"][1]["tool_calls"][0]["function"]["arguments"]["x"],
            1
        );
        assert!(out["tools"].is_array());
        assert!(out.get("max_tokens").is_none(), "only Ollama's members");
        assert!(to_ollama(b"[]", "llama3").is_err());
    }

    #[test]
    fn ollama_tool_calls_become_openai_tool_calls() {
        let calls = openai_tool_calls(
            &[json!({"function": {"name": "f", "arguments": {"x": 1}}})],
            0,
        );
        assert_eq!(calls[0]["function"]["arguments"], "{\"x\":1}");
        assert_eq!(calls[0]["id"], "call_0");
    }
}
