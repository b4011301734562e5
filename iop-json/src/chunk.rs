//! Chat completion stream chunks (`data:` payloads of `chat.completion.chunk`), read and
//! rewritten so that a stream continued on another provider reads as one: what a chunk
//! delivered ([`read_chunk`]), and a continuation's chunk joined to the stream its
//! caller already has ([`rejoin_chunk`]).

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::Object;

/// What one chunk of a chat completion stream delivers, as far as continuing the stream
/// is concerned.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ChunkRead {
    /// The chunk's `id`, `created` and `model` as JSON text (what a continuation's chunks
    /// are given).
    pub id: Option<String>,
    /// See `id`.
    pub created: Option<String>,
    /// See `id`.
    pub model: Option<String>,
    /// It names the role (the stream's first chunk).
    pub role: bool,
    /// Text it adds to the answer.
    pub content: Option<String>,
    /// It delivers something other than text (a tool call, reasoning, a refusal, another
    /// choice than the first, an error), or ends the answer: what follows cannot be
    /// continued exactly.
    pub other: bool,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default)]
    index: u64,
    #[serde(default, borrow)]
    delta: Option<&'a RawValue>,
    #[serde(default, borrow)]
    finish_reason: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(default, borrow)]
    role: Option<&'a RawValue>,
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
}

/// Whether a raw value says nothing: `null`, `""`, `[]` or `{}`.
fn empty(raw: &RawValue) -> bool {
    matches!(raw.get().trim(), "null" | "\"\"" | "[]" | "{}")
}

/// What the chunk `payload` delivers; `None` when it is not a JSON object (a stream's
/// `[DONE]`, say).
#[must_use]
pub fn read_chunk(payload: &[u8]) -> Option<ChunkRead> {
    let object = Object::parse(payload).ok()?;
    let text = |key: &str| object.get(key).map(|v| v.get().to_owned());
    let mut read = ChunkRead {
        id: text("id"),
        created: text("created"),
        model: text("model"),
        other: object.get("error").is_some(),
        ..ChunkRead::default()
    };
    let Some(choices) = object.get("choices") else {
        return Some(read);
    };
    let Ok(choices) = serde_json::from_str::<Vec<Choice<'_>>>(choices.get()) else {
        read.other = true;
        return Some(read);
    };
    for choice in &choices {
        if choice.index != 0 || choice.finish_reason.is_some_and(|f| !empty(f)) {
            read.other = true;
        }
        let Some(delta) = choice.delta else { continue };
        let Ok(object) = Object::parse(delta.get().as_bytes()) else {
            read.other = true;
            continue;
        };
        let Ok(fields) = serde_json::from_str::<Delta<'_>>(delta.get()) else {
            read.other = true;
            continue;
        };
        read.role |= fields.role.is_some_and(|r| !empty(r));
        if let Some(content) = fields.content.filter(|c| !c.is_empty()) {
            read.content = Some(content.into_owned());
        }
        read.other |= object
            .members()
            .any(|(key, value)| key != "role" && key != "content" && !empty(value));
    }
    Some(read)
}

/// How a continuation's chunk joins the caller's stream.
#[derive(Debug, Default)]
pub struct Joined<'a> {
    /// The caller's stream's `id`, `created` and `model` (JSON text), given to the chunk
    /// in place of its own.
    pub id: Option<&'a str>,
    /// See `id`.
    pub created: Option<&'a str>,
    /// See `id`.
    pub model: Option<&'a str>,
    /// The caller had a chunk naming the role: the continuation's is not repeated.
    pub role_sent: bool,
    /// Completion tokens of the runs before: added to the chunk's usage.
    pub earlier: u64,
}

/// The chunk `payload` of a continuation as its caller gets it, joined to the stream it
/// has (see [`Joined`]); `None` when the caller gets nothing of it (a chunk that only
/// names the role again). A payload that is not a chunk passes as it is.
#[must_use]
pub fn rejoin_chunk(payload: &[u8], join: &Joined<'_>) -> Option<Vec<u8>> {
    let Ok(object) = Object::parse(payload) else {
        return Some(payload.to_vec());
    };
    let mut set: Vec<(&str, Cow<'_, str>)> = Vec::new();
    for (key, value) in [
        ("id", join.id),
        ("created", join.created),
        ("model", join.model),
    ] {
        if let (Some(value), Some(_)) = (value, object.get(key)) {
            set.push((key, Cow::Borrowed(value)));
        }
    }
    if join.earlier > 0
        && let Some(usage) = object.get("usage")
        && let Ok(mut usage) =
            serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(usage.get())
    {
        for key in ["completion_tokens", "total_tokens"] {
            if let Some(n) = usage.get(key).and_then(serde_json::Value::as_u64) {
                usage.insert(key.to_owned(), (n.saturating_add(join.earlier)).into());
            }
        }
        set.push((
            "usage",
            Cow::Owned(serde_json::Value::Object(usage).to_string()),
        ));
    }
    if join.role_sent
        && let Some(choices) = object.get("choices")
        && let Some(choices) = without_role(choices)
    {
        match choices {
            // Nothing but the role: the chunk goes, unless it carries more than choices.
            None if object.get("usage").is_none() => return None,
            None => set.push(("choices", Cow::Borrowed("[]"))),
            Some(choices) => set.push(("choices", Cow::Owned(choices))),
        }
    }
    let set: Vec<(&str, &str)> = set.iter().map(|(k, v)| (*k, v.as_ref())).collect();
    Some(object.write(&set))
}

/// `choices` with the role taken out of their deltas: `None` inside when nothing is left
/// but an empty first choice, the outer `None` when no delta names a role.
fn without_role(choices: &RawValue) -> Option<Option<String>> {
    let read = read_chunk(format!("{{\"choices\":{}}}", choices.get()).as_bytes())?;
    if !read.role {
        return None;
    }
    let mut choices: Vec<serde_json::Map<String, serde_json::Value>> =
        serde_json::from_str(choices.get()).ok()?;
    for choice in &mut choices {
        if let Some(serde_json::Value::Object(delta)) = choice.get_mut("delta") {
            delta.remove("role");
        }
    }
    // Only the role said anything: the chunk adds nothing for a caller who has one.
    let silent = choices.iter().all(|choice| {
        choice.iter().all(|(key, value)| match key.as_str() {
            "index" => true,
            "delta" => value
                .as_object()
                .is_some_and(|d| d.values().all(|v| v.is_null() || v == "")),
            _ => value.is_null(),
        })
    });
    if silent {
        return Some(None);
    }
    Some(Some(serde_json::Value::from(choices).to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn read(chunk: &Value) -> ChunkRead {
        read_chunk(chunk.to_string().as_bytes()).expect("a chunk")
    }

    #[test]
    fn a_chunk_says_what_it_delivers() {
        let first = read(
            &json!({"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]}),
        );
        assert_eq!(
            first,
            ChunkRead {
                id: Some("\"c1\"".into()),
                created: Some("7".into()),
                model: Some("\"m\"".into()),
                role: true,
                content: None,
                other: false,
            }
        );
        let text = read(
            &json!({"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hel\"lo"}, "finish_reason": null}]}),
        );
        assert_eq!(text.content.as_deref(), Some("Hel\"lo"));
        assert!(!text.other && !text.role);
        for other in [
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]}),
            json!({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}),
            json!({"choices": [{"index": 1, "delta": {"content": "x"}}]}),
            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            json!({"error": {"message": "boom"}}),
            json!({"choices": "nonsense"}),
        ] {
            assert!(read(&other).other, "{other}");
        }
        // Empty extras say nothing.
        let quiet = read(
            &json!({"choices": [{"index": 0, "delta": {"content": "a", "tool_calls": [], "refusal": null}}]}),
        );
        assert!(!quiet.other);
        assert!(read_chunk(b"[DONE]").is_none());
    }

    #[test]
    fn a_continuation_reads_as_the_stream_its_caller_has() {
        let join = Joined {
            id: Some("\"c1\""),
            created: Some("7"),
            model: Some("\"chat\""),
            role_sent: true,
            earlier: 5,
        };
        let rejoin = |chunk: Value| {
            rejoin_chunk(chunk.to_string().as_bytes(), &join)
                .map(|out| String::from_utf8(out).unwrap())
        };
        // The role again: dropped.
        assert_eq!(
            rejoin(
                json!({"id": "c2", "created": 9, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]})
            ),
            None
        );
        // Text: the caller's id, created and model, in their places.
        assert_eq!(
            rejoin_chunk(
                br#"{"id":"c2","object":"chat.completion.chunk","created":9,"model":"m","choices":[{"index":0,"delta":{"content":"lo"}}]}"#,
                &join
            )
            .map(|out| String::from_utf8(out).unwrap())
            .unwrap(),
            r#"{"id":"c1","object":"chat.completion.chunk","created":7,"model":"chat","choices":[{"index":0,"delta":{"content":"lo"}}]}"#
        );
        // A role with text: the text stays.
        let both: Value = serde_json::from_str(
            &rejoin(json!({"id": "c2", "choices": [{"index": 0, "delta": {"role": "assistant", "content": "x"}}]}))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(both["choices"][0]["delta"], json!({"content": "x"}));
        // Usage counts the earlier runs' output.
        let usage: Value = serde_json::from_str(
            &rejoin(json!({"id": "c2", "choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 4, "total_tokens": 34}}))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            usage["usage"],
            json!({"prompt_tokens": 30, "completion_tokens": 9, "total_tokens": 39})
        );
        assert_eq!(usage["id"], "c1");
        // Not a chunk: as it is.
        assert_eq!(rejoin_chunk(b"[DONE]", &join).unwrap(), b"[DONE]");
    }
}
