//! What the mock answers a request, decided once from its body and followed word by word
//! by both of its faces (runs and the OpenAI-compatible server): the reply cut at
//! `max_tokens` words or at the first stop sequence it contains, or a tool call when the
//! request offers tools and the conversation does not end with a tool's result.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use super::Mock;
use crate::adapters::json::{Object, elements};

/// Most stop sequences read (OpenAI takes four, vLLM more).
const MAX_STOPS: usize = 16;

/// The answer the mock gives one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The reply's pieces, in order (a word and its trailing space each); empty for a
    /// tool call.
    pub pieces: Vec<String>,
    /// OpenAI's `finish_reason`: `stop`, `length` or `tool_calls`.
    pub finish: &'static str,
    /// The stop sequence that cut the reply.
    pub stop_sequence: Option<String>,
    /// The tool call instead of text: the function's name and its arguments (JSON).
    pub tool: Option<(String, String)>,
    /// Words generated (the completion's tokens).
    pub tokens: u64,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Mock {
    /// The plan for a request body (a chat or a completions body; a body the mock cannot
    /// read is answered as one without options).
    pub fn plan(&self, input: &[u8]) -> Plan {
        let object = Object::parse(input).unwrap_or_default();
        match prefill(&object) {
            Some(prefix) => self.continued(&object, &prefix),
            None => self.plan_of(&object, 0),
        }
    }

    /// The rest of the answer to the conversation before a final assistant message
    /// `prefix` that the request asks to continue: exactly what follows `prefix` in the
    /// answer the mock gives that conversation, when `prefix` begins it (its token limit
    /// counts the words of `prefix`, as the Edge lowered it by them); else the whole
    /// answer, as a model would start over.
    fn continued(&self, object: &Object<'_>, prefix: &str) -> Plan {
        let mut before = 0;
        let mut words = 0u64;
        loop {
            let word = format!("{} ", self.words[words as usize % self.words.len()]);
            if !prefix[before..].starts_with(&word) {
                break;
            }
            before += word.len();
            words += 1;
        }
        let whole = self.plan_of(object, words);
        if whole.tool.is_some() || !whole.pieces.concat().starts_with(prefix) {
            return whole;
        }
        let mut skip = prefix.len();
        let mut pieces = Vec::new();
        for piece in whole.pieces {
            if skip >= piece.len() {
                skip -= piece.len();
                continue;
            }
            pieces.push(piece[skip..].to_owned());
            skip = 0;
        }
        Plan {
            tokens: pieces.len() as u64,
            pieces,
            ..whole
        }
    }

    /// The plan for `object`, its token limit raised by `earlier` words already given.
    fn plan_of(&self, object: &Object<'_>, earlier: u64) -> Plan {
        let number = |key: &str| object.get(key).and_then(|v| v.get().parse::<u64>().ok());
        let limit = number("max_completion_tokens")
            .or_else(|| number("max_tokens"))
            .map(|n| n.saturating_add(earlier));
        let stops: Vec<String> = object
            .get("stop")
            .and_then(|v| serde_json::from_str::<Stop>(v.get()).ok())
            .map(|stop| match stop {
                Stop::One(s) => vec![s],
                Stop::Many(list) => list,
            })
            .unwrap_or_default()
            .into_iter()
            .filter(|s| !s.is_empty())
            .take(MAX_STOPS)
            .collect();
        if let Some(name) = &self.tool_call
            && let Some(arguments) = tool_arguments(object, name)
        {
            return Plan {
                pieces: Vec::new(),
                finish: "tool_calls",
                stop_sequence: None,
                tool: Some((name.clone(), arguments)),
                tokens: 1,
            };
        }
        let count = limit.map_or(self.tokens, |n| {
            self.tokens.min(usize::try_from(n).unwrap_or(usize::MAX))
        });
        let pieces: Vec<String> = (0..count).map(|i| self.word(i, count)).collect();
        // The first place any stop sequence starts in the whole reply.
        let text: String = pieces.concat();
        let cut = stops
            .iter()
            .filter_map(|s| text.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at);
        let Some((at, sequence)) = cut else {
            let finish = if count < self.tokens {
                "length"
            } else {
                "stop"
            };
            return Plan {
                tokens: count as u64,
                pieces,
                finish,
                stop_sequence: None,
                tool: None,
            };
        };
        let mut kept = Vec::new();
        let mut length = 0;
        for piece in pieces {
            if length + piece.len() <= at {
                length += piece.len();
                kept.push(piece);
                continue;
            }
            let part = &piece[..at - length];
            if !part.is_empty() {
                kept.push(part.to_owned());
            }
            break;
        }
        Plan {
            tokens: kept.len() as u64,
            pieces: kept,
            finish: "stop",
            stop_sequence: Some(sequence.clone()),
            tool: None,
        }
    }
}

/// The final assistant message a request asks to continue (`continue_final_message`),
/// when its content is text.
fn prefill(object: &Object<'_>) -> Option<String> {
    if object.get("continue_final_message")?.get() != "true" {
        return None;
    }
    let messages = elements(object.get("messages")?)?;
    let last: Value = serde_json::from_str(messages.last()?.get()).ok()?;
    if last["role"] != "assistant" {
        return None;
    }
    last["content"].as_str().map(str::to_owned)
}

/// The arguments of a call to `name`, when the request offers tools, does not forbid
/// them (`tool_choice: "none"`), and its last message is not a tool's result (the mock
/// answers a result with text, as a model would). The arguments follow the tool's
/// `parameters` schema when the request offers a tool of that name: each property gets
/// a value of its type.
fn tool_arguments(object: &Object<'_>, name: &str) -> Option<String> {
    let tools = elements(object.get("tools")?)?;
    if tools.is_empty()
        || object
            .get("tool_choice")
            .is_some_and(|c| c.get() == "\"none\"")
    {
        return None;
    }
    let last_role = object
        .get("messages")
        .and_then(elements)
        .and_then(|messages| messages.last().copied())
        .and_then(|last| serde_json::from_str::<Role<'_>>(last.get()).ok())
        .map(|r| r.role);
    if last_role.as_deref() == Some("tool") {
        return None;
    }
    let schema = tools.iter().find_map(|tool| {
        let tool: Tool<'_> = serde_json::from_str(tool.get()).ok()?;
        (tool.function.name == name).then_some(tool.function.parameters)?
    });
    let arguments = schema
        .and_then(|s| serde_json::from_str::<Value>(s.get()).ok())
        .map_or_else(|| json!({}), |schema| example(&schema, 0));
    Some(arguments.to_string())
}

#[derive(Deserialize)]
struct Role<'a> {
    #[serde(borrow)]
    role: std::borrow::Cow<'a, str>,
}

#[derive(Deserialize)]
struct Tool<'a> {
    #[serde(borrow)]
    function: Function<'a>,
}

#[derive(Deserialize)]
struct Function<'a> {
    #[serde(borrow)]
    name: std::borrow::Cow<'a, str>,
    #[serde(borrow, default)]
    parameters: Option<&'a RawValue>,
}

/// A value that fits `schema`: its first `enum` value, else one of its type (an object's
/// properties filled in turn, a few levels deep).
fn example(schema: &Value, depth: usize) -> Value {
    if let Some(first) = schema
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|e| e.first())
    {
        return first.clone();
    }
    let kind = match schema.get("type") {
        Some(Value::String(kind)) => kind.as_str(),
        Some(Value::Array(kinds)) => kinds.first().and_then(Value::as_str).unwrap_or("object"),
        _ if schema.get("properties").is_some() => "object",
        _ => "string",
    };
    match kind {
        "integer" => json!(1),
        "number" => json!(1.5),
        "boolean" => json!(true),
        "array" => json!([]),
        "null" => Value::Null,
        "object" if depth < 4 => {
            let mut out = Map::new();
            if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
                for (key, property) in properties {
                    out.insert(key.clone(), example(property, depth + 1));
                }
            }
            Value::Object(out)
        }
        "object" => json!({}),
        _ => json!("example"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// A continuation of any prefix of the mock's answer, cut between words or inside
    /// one, with the limit lowered as the Edge lowers it, gives exactly the rest.
    #[test]
    fn a_continued_answer_is_exactly_the_rest_of_the_whole() {
        let m = mock("one two three four five six", None);
        for limit in [None, Some(4u64), Some(6)] {
            let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
            if let Some(limit) = limit {
                body["max_tokens"] = json!(limit);
            }
            let raw = serde_json::to_vec(&body).unwrap();
            let whole = m.plan(&raw);
            let text = whole.pieces.concat();
            for words in 0..whole.pieces.len() {
                let at = whole.pieces[..words].concat().len();
                for cut in [at, at + 1] {
                    if cut >= text.len() {
                        continue;
                    }
                    let prefix = &text[..cut];
                    let cont = crate::adapters::json::continuation(&raw, prefix, words as u64)
                        .expect("continuable");
                    let rest = m.plan(&cont);
                    assert_eq!(
                        format!("{prefix}{}", rest.pieces.concat()),
                        text,
                        "limit {limit:?}, cut at {cut}"
                    );
                    assert_eq!(rest.finish, whole.finish);
                }
            }
        }
    }

    fn mock(reply: &str, tool: Option<&str>) -> Mock {
        let mut options = BTreeMap::from([("reply".to_owned(), reply.to_owned())]);
        if let Some(tool) = tool {
            options.insert("tool_call".to_owned(), tool.to_owned());
        }
        Mock::from_options(&options).expect("valid options")
    }

    #[test]
    fn the_reply_is_cut_at_max_tokens_or_the_first_stop_sequence() {
        let m = mock("one two three four five", None);
        let plan = m.plan(br#"{"messages":[],"max_tokens":2}"#);
        assert_eq!(plan.pieces.concat(), "one two");
        assert_eq!((plan.finish, plan.tokens), ("length", 2));
        let plan = m.plan(br#"{"messages":[],"stop":["four","hre"]}"#);
        assert_eq!(plan.pieces.concat(), "one two t");
        assert_eq!(plan.finish, "stop");
        assert_eq!(plan.stop_sequence.as_deref(), Some("hre"));
        let plan = m.plan(br#"{"messages":[],"stop":"absent"}"#);
        assert_eq!(plan.pieces.concat(), "one two three four five");
        assert_eq!((plan.finish, plan.stop_sequence), ("stop", None));
    }

    #[test]
    fn a_tool_call_follows_the_schema_and_a_tool_result_gets_text() {
        let m = mock("done", Some("get_weather"));
        let body = json!({
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}, "days": {"type": "integer"}},
            }}}],
        });
        let plan = m.plan(body.to_string().as_bytes());
        let (name, arguments) = plan.tool.expect("a call");
        assert_eq!(name, "get_weather");
        let arguments: Value = serde_json::from_str(&arguments).expect("JSON");
        assert_eq!(
            arguments,
            json!({"city": "example", "unit": "c", "days": 1})
        );
        let mut answered = body.clone();
        answered["messages"]
            .as_array_mut()
            .expect("array")
            .push(json!({"role": "tool", "tool_call_id": "c1", "content": "sunny"}));
        let plan = m.plan(answered.to_string().as_bytes());
        assert!(plan.tool.is_none());
        assert_eq!(plan.pieces.concat(), "done");
        let mut none = body;
        none["tool_choice"] = json!("none");
        assert!(m.plan(none.to_string().as_bytes()).tool.is_none());
    }
}
