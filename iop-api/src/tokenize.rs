//! Exact prompt token counts from a provider's own tokenizer: vLLM's `POST /tokenize`
//! (the core's [`Endpoint::Tokenize`](iop_proto_core::tunnel::Endpoint::Tokenize)), which
//! applies the model's chat template to `messages` (and `tools`) and answers
//! `{"count": N, "max_model_len": M, "tokens": [...]}`.
//!
//! The count routes (`/v1/messages/count_tokens`) ask for it where a provider of the model
//! tokenizes, and answer the Edge's estimate otherwise.

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

/// The most of a tokenizer's answer kept to read its count; the token ids after it are
/// read and dropped (a long prompt's list runs to megabytes).
pub const ANSWER_PREFIX: usize = 64 * 1024;

#[derive(Deserialize)]
struct Chat<'a> {
    #[serde(borrow)]
    model: &'a RawValue,
    #[serde(borrow)]
    messages: &'a RawValue,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
}

/// The `/tokenize` body for a chat completions body: its `model`, `messages` and `tools`,
/// with the generation prompt added as a completion would see it; `None` for a body
/// without them (the chat translations this is given always have both).
#[must_use]
pub fn request_body(chat: &[u8]) -> Option<Bytes> {
    let chat: Chat<'_> = serde_json::from_slice(chat).ok()?;
    let tools = chat.tools.filter(|t| t.get() != "null");
    let mut out = Vec::with_capacity(
        chat.model.get().len()
            + chat.messages.get().len()
            + tools.map_or(0, |t| t.get().len())
            + 80,
    );
    out.extend_from_slice(b"{\"model\":");
    out.extend_from_slice(chat.model.get().as_bytes());
    out.extend_from_slice(b",\"messages\":");
    out.extend_from_slice(chat.messages.get().as_bytes());
    if let Some(tools) = tools {
        out.extend_from_slice(b",\"tools\":");
        out.extend_from_slice(tools.get().as_bytes());
    }
    out.extend_from_slice(b",\"add_generation_prompt\":true}");
    Some(Bytes::from(out))
}

#[derive(Deserialize)]
struct Answer {
    count: Option<u64>,
    #[serde(default)]
    tokens: Option<Vec<serde::de::IgnoredAny>>,
}

/// The count in a tokenizer's answer: `prefix` is its first [`ANSWER_PREFIX`] bytes at
/// most, `whole` whether that is all of it. A whole answer is read as JSON (`count`, or
/// the length of `tokens`); a longer one only where it opens with `{"count":N` (vLLM's
/// field order). Anything else is `None`: the caller answers its estimate.
#[must_use]
pub fn answer_count(prefix: &[u8], whole: bool) -> Option<u64> {
    if whole {
        let answer: Answer = serde_json::from_slice(prefix).ok()?;
        return answer
            .count
            .or_else(|| answer.tokens.map(|t| t.len() as u64));
    }
    let rest = prefix.trim_ascii_start().strip_prefix(b"{")?;
    let rest = rest.trim_ascii_start().strip_prefix(b"\"count\"")?;
    let rest = rest.trim_ascii_start().strip_prefix(b":")?;
    let rest = rest.trim_ascii_start();
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    // The number must end inside the prefix, or it may be cut.
    if digits == 0 || digits > 19 || digits == rest.len() {
        return None;
    }
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_keeps_model_messages_and_tools_and_asks_for_the_generation_prompt() {
        let body = request_body(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"tools":[{"type":"function"}],"stream":true}"#,
        )
        .expect("chat body");
        assert_eq!(
            &body[..],
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}],"add_generation_prompt":true}"#
        );
        let body = request_body(br#"{"model":"m","messages":[],"tools":null}"#).expect("body");
        assert_eq!(
            &body[..],
            br#"{"model":"m","messages":[],"add_generation_prompt":true}"#
        );
        assert!(request_body(br#"{"model":"m"}"#).is_none());
        assert!(request_body(b"not json").is_none());
    }

    #[test]
    fn counts_are_read_from_whole_answers_and_from_vllms_prefix() {
        assert_eq!(
            answer_count(br#"{"count":12,"max_model_len":4096,"tokens":[1,2]}"#, true),
            Some(12)
        );
        // llama.cpp answers the ids alone.
        assert_eq!(answer_count(br#"{"tokens":[5,6,7]}"#, true), Some(3));
        assert_eq!(answer_count(br#"{"error":"x"}"#, true), None);
        assert_eq!(answer_count(b"{\"count\":", true), None);
        // A cut answer: the count must be whole before the cut.
        assert_eq!(
            answer_count(
                b" { \"count\" : 98765 ,\"max_model_len\":1,\"tokens\":[1,2,",
                false
            ),
            Some(98765)
        );
        assert_eq!(answer_count(b"{\"count\":987", false), None);
        assert_eq!(answer_count(b"{\"tokens\":[1,2,3", false), None);
        assert_eq!(
            answer_count(b"{\"count\":99999999999999999999999,", false),
            None
        );
    }
}
