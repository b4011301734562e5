//! The body that continues a chat answer cut short: the caller's request with the text
//! already delivered as a final assistant message the provider continues (vLLM's and
//! SGLang's `continue_final_message` with `add_generation_prompt: false`; llama.cpp and
//! Ollama continue a trailing assistant message as it is).

use std::borrow::Cow;

use bytes::Bytes;
use serde::Deserialize;

use crate::{Object, array, elements};

/// Members that constrain the output's form: a continuation could not be held to them
/// exactly (the provider would judge the continuation alone against a schema or a
/// grammar), so such a request is never continued.
const CONSTRAINED: &[&str] = &[
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "grammar",
    "json_schema",
    "logit_bias",
];

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
}

/// The body that continues `raw` (an OpenAI chat completion request) after `delivered`,
/// `produced` output tokens of it already sent: `delivered` as a final assistant message
/// to continue, `max_tokens` / `max_completion_tokens` lowered by `produced`. `None` when
/// the request cannot be continued exactly: more than one choice (`n`), an output format
/// other than text or a grammar, a final assistant message the caller wrote without
/// asking for it to be continued, a token limit already reached, or a body that is not a
/// chat request.
#[must_use]
pub fn continuation(raw: &[u8], delivered: &str, produced: u64) -> Option<Bytes> {
    let object = Object::parse(raw).ok()?;
    if object
        .get("n")
        .is_some_and(|n| n.get().parse::<u64>().ok() != Some(1))
    {
        return None;
    }
    if let Some(format) = object.get("response_format") {
        #[derive(Deserialize)]
        struct Format<'a> {
            #[serde(borrow, rename = "type")]
            kind: Cow<'a, str>,
        }
        let format: Format<'_> = serde_json::from_str(format.get()).ok()?;
        if format.kind != "text" {
            return None;
        }
    }
    if CONSTRAINED.iter().any(|key| object.get(key).is_some()) {
        return None;
    }
    let mut messages = elements(object.get("messages")?)?;
    let last: Message<'_> = serde_json::from_str(messages.last()?.get()).ok()?;
    let caller_prefill = object
        .get("continue_final_message")
        .is_some_and(|v| v.get() == "true");
    let text = if last.role == "assistant" {
        // The caller's own prefill, continued: the answer so far follows it.
        if !caller_prefill {
            return None;
        }
        messages.pop();
        format!("{}{delivered}", last.content?)
    } else {
        delivered.to_owned()
    };
    let prefill = serde_json::json!({"role": "assistant", "content": text}).to_string();
    let mut items: Vec<Cow<'_, str>> = messages.iter().map(|m| Cow::Borrowed(m.get())).collect();
    items.push(Cow::Owned(prefill));
    let messages = array(items);
    let lowered = |key: &str| -> Result<Option<String>, ()> {
        match object.get(key) {
            None => Ok(None),
            Some(v) => {
                let limit: u64 = v.get().parse().map_err(|_| ())?;
                if limit <= produced {
                    return Err(());
                }
                Ok(Some((limit - produced).to_string()))
            }
        }
    };
    let max_tokens = lowered("max_tokens").ok()?;
    let max_completion = lowered("max_completion_tokens").ok()?;
    let mut set: Vec<(&str, &str)> = vec![
        ("messages", &messages),
        ("continue_final_message", "true"),
        ("add_generation_prompt", "false"),
    ];
    if let Some(v) = &max_tokens {
        set.push(("max_tokens", v));
    }
    if let Some(v) = &max_completion {
        set.push(("max_completion_tokens", v));
    }
    Some(Bytes::from(object.write(&set)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn continued(body: &Value, delivered: &str, produced: u64) -> Option<Value> {
        let raw = serde_json::to_vec(body).unwrap();
        continuation(&raw, delivered, produced).map(|b| serde_json::from_slice(&b).unwrap())
    }

    #[test]
    fn the_delivered_text_becomes_a_final_assistant_message_to_continue() {
        let body = json!({"model": "m", "stream": true, "max_tokens": 100,
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi \"there\""}]});
        let out = continued(&body, "Hello, wo", 3).unwrap();
        assert_eq!(
            out["messages"][2],
            json!({"role": "assistant", "content": "Hello, wo"})
        );
        assert_eq!(out["messages"][1], body["messages"][1]);
        assert_eq!(out["continue_final_message"], true);
        assert_eq!(out["add_generation_prompt"], false);
        assert_eq!(out["max_tokens"], 97);
        assert_eq!(out["model"], "m");
        assert_eq!(out["stream"], true);
    }

    #[test]
    fn a_callers_own_prefill_is_continued_with_the_answer_after_it() {
        let body = json!({"continue_final_message": true, "add_generation_prompt": false,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "{\"a\":"}]});
        let out = continued(&body, " 1", 1).unwrap();
        assert_eq!(out["messages"].as_array().unwrap().len(), 2);
        assert_eq!(out["messages"][1]["content"], "{\"a\": 1");
    }

    #[test]
    fn what_cannot_be_continued_exactly_is_not() {
        let base = |extra: Value| {
            let mut body =
                json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            body
        };
        assert!(continued(&base(json!({"n": 2})), "x", 1).is_none());
        assert!(continued(&base(json!({"n": 1})), "x", 1).is_some());
        assert!(
            continued(
                &base(json!({"response_format": {"type": "json_schema", "json_schema": {}}})),
                "x",
                1
            )
            .is_none()
        );
        assert!(
            continued(
                &base(json!({"response_format": {"type": "json_object"}})),
                "x",
                1
            )
            .is_none()
        );
        assert!(continued(&base(json!({"response_format": {"type": "text"}})), "x", 1).is_some());
        assert!(continued(&base(json!({"guided_regex": "a+"})), "x", 1).is_none());
        assert!(
            continued(&base(json!({})), "x", 10).is_none(),
            "the limit is reached"
        );
        let assistant_last = json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]});
        assert!(continued(&assistant_last, "x", 1).is_none());
        assert!(continuation(b"[1,2]", "x", 1).is_none());
        assert!(continuation(b"{\"messages\": 3}", "x", 1).is_none());
        assert!(continuation(b"not json", "x", 1).is_none());
    }
}
