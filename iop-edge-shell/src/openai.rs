//! OpenAI wire shapes: the error object, chat completion JSON and SSE chunks rendered from
//! run events, restoring `tool_calls`, and the byte-exact `model` rewrite of tunnel bodies.

use bytes::Bytes;
use serde_json::{Value, json};

/// An OpenAI error body.
#[must_use]
pub fn error_body(message: &str, kind: &str, code: Option<&str>) -> Bytes {
    Bytes::from(
        json!({ "error": { "message": message, "type": kind, "param": null, "code": code } })
            .to_string(),
    )
}

/// The same error as one SSE `data:` event (the official SDKs raise on it).
#[must_use]
pub fn error_event(message: &str, kind: &str, code: Option<&str>) -> Bytes {
    let body = error_body(message, kind, code);
    let mut out = Vec::with_capacity(body.len() + 8);
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(&body);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// One SSE `data:` event carrying `value`.
#[must_use]
pub fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// The closing SSE event.
pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// Replaces the value of the top-level `"model"` key in a JSON object, leaving every other
/// byte untouched. `None` when the body is not a JSON object with a `model` key.
#[must_use]
pub fn rewrite_model(raw: &[u8], target: &str) -> Option<Bytes> {
    let mut scan = Scanner { s: raw, i: 0 };
    scan.ws();
    scan.eat(b'{')?;
    loop {
        scan.ws();
        if scan.peek()? == b'}' {
            return None;
        }
        let key_start = scan.i;
        scan.string()?;
        let key = &raw[key_start..scan.i];
        scan.ws();
        scan.eat(b':')?;
        scan.ws();
        let value_start = scan.i;
        scan.value()?;
        let value_end = scan.i;
        let is_model = key == b"\"model\""
            || (key.contains(&b'\\')
                && serde_json::from_slice::<String>(key).ok().as_deref() == Some("model"));
        if is_model {
            let encoded = serde_json::to_string(target).ok()?;
            let mut out = Vec::with_capacity(raw.len() + encoded.len());
            out.extend_from_slice(&raw[..value_start]);
            out.extend_from_slice(encoded.as_bytes());
            out.extend_from_slice(&raw[value_end..]);
            return Some(Bytes::from(out));
        }
        scan.ws();
        match scan.peek()? {
            b',' => scan.i += 1,
            _ => return None,
        }
    }
}

struct Scanner<'a> {
    s: &'a [u8],
    i: usize,
}

impl Scanner<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn eat(&mut self, b: u8) -> Option<()> {
        (self.peek()? == b).then(|| self.i += 1)
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\r' | b'\n')) {
            self.i += 1;
        }
    }

    fn string(&mut self) -> Option<()> {
        self.eat(b'"')?;
        loop {
            match self.peek()? {
                b'"' => {
                    self.i += 1;
                    return Some(());
                }
                b'\\' => self.i += 2,
                _ => self.i += 1,
            }
        }
    }

    fn value(&mut self) -> Option<()> {
        match self.peek()? {
            b'"' => self.string(),
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match self.peek()? {
                        b'"' => {
                            self.string()?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.i += 1;
                                return Some(());
                            }
                        }
                        _ => {}
                    }
                    self.i += 1;
                }
            }
            _ => {
                let start = self.i;
                while !matches!(
                    self.peek(),
                    None | Some(b',' | b'}' | b']' | b' ' | b'\t' | b'\r' | b'\n')
                ) {
                    self.i += 1;
                }
                (self.i > start).then_some(())
            }
        }
    }
}

/// Tool calls written as text by a model that got the fallback instruction:
/// `{"tool_calls": [{"name": ..., "arguments": {...}}]}`, possibly inside a code fence.
/// Returns OpenAI `tool_calls`.
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

/// A non-streaming chat completion.
#[must_use]
pub fn chat_completion(
    id: &str,
    model: &str,
    created: u64,
    content: Option<&str>,
    tool_calls: Option<&Value>,
    usage: Option<&iop_proto_core::wire::Usage>,
) -> Value {
    let mut message = json!({ "role": "assistant", "content": content });
    let finish = if let Some(calls) = tool_calls {
        message["tool_calls"] = calls.clone();
        "tool_calls"
    } else {
        "stop"
    };
    let mut out = json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{ "index": 0, "message": message, "finish_reason": finish, "logprobs": null }],
    });
    if let Some(u) = usage {
        out["usage"] = usage_json(u);
    }
    out
}

/// An OpenAI usage object.
#[must_use]
pub fn usage_json(u: &iop_proto_core::wire::Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    })
}

/// A streaming chunk.
#[must_use]
pub fn chunk(
    id: &str,
    model: &str,
    created: u64,
    delta: Value,
    finish_reason: Option<&str>,
) -> Value {
    json!({
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{ "index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": null }],
    })
}

/// Streaming `delta.tool_calls` (each call gets its `index`).
#[must_use]
pub fn tool_call_deltas(calls: &Value) -> Value {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_rewrite_touches_only_the_model_value() {
        let raw = br#"{ "messages" : [{"role":"user","content":"say \"model\": x"}],  "model":"public-name" ,"stream":true}"#;
        let out = rewrite_model(raw, "llama3:8b").expect("rewritten");
        assert_eq!(
            std::str::from_utf8(&out).expect("utf8"),
            r#"{ "messages" : [{"role":"user","content":"say \"model\": x"}],  "model":"llama3:8b" ,"stream":true}"#
        );
        let nested = br#"{"meta":{"model":"inner"},"model":null}"#;
        assert_eq!(
            &rewrite_model(nested, "t").expect("rewritten")[..],
            br#"{"meta":{"model":"inner"},"model":"t"}"#
        );
        let escaped = br#"{"mod\u0065l":"x"}"#;
        assert_eq!(
            &rewrite_model(escaped, "y").expect("rewritten")[..],
            br#"{"mod\u0065l":"y"}"#
        );
        assert!(rewrite_model(br#"{"messages":[]}"#, "t").is_none());
        assert!(rewrite_model(b"[1,2]", "t").is_none());
        assert!(rewrite_model(br#"{"model":"#, "t").is_none());
        assert_eq!(
            &rewrite_model(br#"{"model":"a"}"#, "quo\"te").expect("rewritten")[..],
            br#"{"model":"quo\"te"}"#
        );
    }

    #[test]
    fn text_tool_calls_are_restored() {
        let calls = parse_text_tool_calls(
            "```json\n{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Seoul\"}}]}\n```",
            "r1",
        )
        .expect("parsed");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(calls[0]["function"]["arguments"], "{\"city\":\"Seoul\"}");
        assert!(parse_text_tool_calls("just words", "r1").is_none());
        assert!(parse_text_tool_calls("{\"tool_calls\": []}", "r1").is_none());
    }
}
