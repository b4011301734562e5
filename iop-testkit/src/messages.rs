//! The Anthropic Messages stream grammar, checked from the bytes a caller reads: what the
//! official SDKs and Claude Code enforce, so that the property tests, the fuzz target and
//! the black-box tests hold every stream the Edge writes to the same rules.
//!
//! The rules: every frame has an `event:` line equal to its `data.type` (the SDKs drop
//! data-only frames) and one JSON `data:` line; `message_start` comes first, once; content
//! blocks have dense indices in start order, and each is started, given deltas of its own
//! kind, and stopped exactly once, one at a time; `input_json_delta` pieces concatenate to
//! a JSON object; one `message_delta` with a known `stop_reason` (and `stop_sequence` only
//! with `stop_sequence`) and the usage, then `message_stop`, and nothing after it; or, in
//! place of the end, one `error` event and nothing after it; `ping` anywhere after the
//! start; never `[DONE]`.

use serde_json::{Map, Value, json};

/// How a stream ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Ended {
    /// `message_stop`: the message as a client reassembles it (what a non-streamed
    /// answer would be).
    Message(Value),
    /// An `error` event: its object.
    Error(Value),
    /// The bytes ended before either (a stream cut short, as a caller sees a connection
    /// that closed).
    Cut,
}

/// The stop reasons a `message_delta` may carry.
const STOP_REASONS: [&str; 6] = [
    "end_turn",
    "max_tokens",
    "stop_sequence",
    "tool_use",
    "refusal",
    "pause_turn",
];

/// Checks `body`, a whole Messages event stream, against the grammar; how it ended, or
/// the first rule it breaks.
pub fn check_stream(body: &[u8]) -> Result<Ended, String> {
    let text = std::str::from_utf8(body).map_err(|_| "the stream is not UTF-8".to_owned())?;
    if text.contains("[DONE]") {
        return Err("[DONE] in a Messages stream".into());
    }
    let mut frames = text.split("\n\n").peekable();
    let mut state = State::default();
    while let Some(frame) = frames.next() {
        if frame.is_empty() && frames.peek().is_none() {
            break;
        }
        if frames.peek().is_none() {
            // The last piece has no blank line after it: the bytes stopped mid-frame.
            return Ok(Ended::Cut);
        }
        let (event, data) = parse_frame(frame)?;
        if let Some(ended) = state.step(&event, data)? {
            if frames.any(|rest| !rest.is_empty()) {
                return Err(format!("bytes after the stream's {event}"));
            }
            return Ok(ended);
        }
    }
    Ok(Ended::Cut)
}

fn parse_frame(frame: &str) -> Result<(String, Value), String> {
    let mut event = None;
    let mut data = None;
    for line in frame.split('\n') {
        if let Some(name) = line.strip_prefix("event:") {
            if event.replace(name.trim().to_owned()).is_some() {
                return Err(format!("two event lines in {frame:?}"));
            }
        } else if let Some(payload) = line.strip_prefix("data:") {
            let value: Value = serde_json::from_str(payload.trim())
                .map_err(|e| format!("data that is not JSON ({e}): {payload:?}"))?;
            if data.replace(value).is_some() {
                return Err(format!("two data lines in {frame:?}"));
            }
        } else if !line.starts_with(':') {
            return Err(format!("a line that is neither event nor data: {line:?}"));
        }
    }
    let event = event.ok_or_else(|| format!("a frame without an event line: {frame:?}"))?;
    let data = data.ok_or_else(|| format!("a frame without data: {frame:?}"))?;
    if data.get("type").and_then(Value::as_str) != Some(event.as_str()) {
        return Err(format!(
            "event {event:?} with data.type {:?}",
            data.get("type")
        ));
    }
    Ok((event, data))
}

#[derive(Default)]
struct State {
    message: Option<Map<String, Value>>,
    blocks: Vec<Value>,
    open: Option<usize>,
    partial_json: String,
    delta_seen: bool,
}

impl State {
    /// One frame; `Some` when it ended the stream.
    fn step(&mut self, event: &str, data: Value) -> Result<Option<Ended>, String> {
        if event == "error" {
            if data
                .pointer("/error/type")
                .and_then(Value::as_str)
                .is_none()
            {
                return Err(format!("an error event without error.type: {data}"));
            }
            return Ok(Some(Ended::Error(data)));
        }
        if self.message.is_none() {
            if event != "message_start" {
                return Err(format!("{event} before message_start"));
            }
            let message = data
                .get("message")
                .and_then(Value::as_object)
                .ok_or("message_start without a message")?;
            if message.get("content") != Some(&json!([])) {
                return Err("message_start with content".into());
            }
            self.message = Some(message.clone());
            return Ok(None);
        }
        match event {
            "ping" => Ok(None),
            "message_start" => Err("a second message_start".into()),
            "content_block_start" => {
                if self.delta_seen {
                    return Err("a block after message_delta".into());
                }
                if let Some(open) = self.open {
                    return Err(format!("block started while {open} is open"));
                }
                let index = index_of(&data)?;
                if index != self.blocks.len() {
                    return Err(format!("block {index} after {} blocks", self.blocks.len()));
                }
                let block = data
                    .get("content_block")
                    .cloned()
                    .ok_or("content_block_start without a block")?;
                match block.get("type").and_then(Value::as_str) {
                    Some("text") if block.get("text") == Some(&json!("")) => {}
                    Some("thinking") if block.get("thinking") == Some(&json!("")) => {}
                    Some("tool_use")
                        if block.get("id").is_some_and(Value::is_string)
                            && block.get("name").is_some_and(Value::is_string)
                            && block.get("input") == Some(&json!({})) => {}
                    _ => return Err(format!("a block that does not start empty: {block}")),
                }
                self.blocks.push(block);
                self.open = Some(index);
                self.partial_json.clear();
                Ok(None)
            }
            "content_block_delta" => {
                let index = index_of(&data)?;
                if self.open != Some(index) {
                    return Err(format!("delta for {index} while {:?} is open", self.open));
                }
                let block = &mut self.blocks[index];
                let delta = data.get("delta").ok_or("a delta without delta")?;
                let kind = block.get("type").and_then(Value::as_str).unwrap_or("");
                let field = |key: &str| {
                    delta
                        .get(key)
                        .and_then(Value::as_str)
                        .map(str::to_owned)
                        .ok_or_else(|| format!("{key} missing in {delta}"))
                };
                match (kind, delta.get("type").and_then(Value::as_str)) {
                    ("text", Some("text_delta")) => append(block, "text", &field("text")?),
                    ("thinking", Some("thinking_delta")) => {
                        append(block, "thinking", &field("thinking")?);
                    }
                    ("thinking", Some("signature_delta")) => {
                        block["signature"] = json!(field("signature")?);
                    }
                    ("tool_use", Some("input_json_delta")) => {
                        self.partial_json.push_str(&field("partial_json")?);
                    }
                    (kind, other) => return Err(format!("a {other:?} delta in a {kind} block")),
                }
                Ok(None)
            }
            "content_block_stop" => {
                let index = index_of(&data)?;
                if self.open != Some(index) {
                    return Err(format!("stop for {index} while {:?} is open", self.open));
                }
                self.open = None;
                let block = &mut self.blocks[index];
                if block.get("type").and_then(Value::as_str) == Some("tool_use")
                    && !self.partial_json.is_empty()
                {
                    let input: Value = serde_json::from_str(&self.partial_json).map_err(|e| {
                        format!(
                            "input_json_delta pieces {:?} are not JSON: {e}",
                            self.partial_json
                        )
                    })?;
                    if !input.is_object() {
                        return Err(format!("tool input {input} is not an object"));
                    }
                    block["input"] = input;
                }
                Ok(None)
            }
            "message_delta" => {
                if self.delta_seen {
                    return Err("a second message_delta".into());
                }
                if let Some(open) = self.open {
                    return Err(format!("message_delta while block {open} is open"));
                }
                self.delta_seen = true;
                let reason = data
                    .pointer("/delta/stop_reason")
                    .and_then(Value::as_str)
                    .ok_or("message_delta without a stop_reason")?;
                if !STOP_REASONS.contains(&reason) {
                    return Err(format!("stop_reason {reason:?}"));
                }
                let sequence = data
                    .pointer("/delta/stop_sequence")
                    .cloned()
                    .unwrap_or(Value::Null);
                if reason != "stop_sequence" && !sequence.is_null() {
                    return Err(format!("stop_sequence {sequence} with {reason}"));
                }
                let usage = data
                    .get("usage")
                    .and_then(Value::as_object)
                    .ok_or("message_delta without usage")?;
                if !usage.get("output_tokens").is_some_and(Value::is_u64) {
                    return Err(format!("usage without output_tokens: {usage:?}"));
                }
                let message = self.message.as_mut().ok_or("no message")?;
                message.insert("stop_reason".into(), json!(reason));
                message.insert("stop_sequence".into(), sequence);
                let totals = message
                    .entry("usage")
                    .or_insert_with(|| json!({}))
                    .as_object_mut()
                    .ok_or("usage is not an object")?;
                for (key, value) in usage {
                    if !value.is_null() {
                        totals.insert(key.clone(), value.clone());
                    }
                }
                Ok(None)
            }
            "message_stop" => {
                if !self.delta_seen {
                    return Err("message_stop without message_delta".into());
                }
                let mut message = self.message.take().ok_or("no message")?;
                message.insert(
                    "content".into(),
                    Value::Array(std::mem::take(&mut self.blocks)),
                );
                Ok(Some(Ended::Message(Value::Object(message))))
            }
            other => Err(format!("unknown event {other:?}")),
        }
    }
}

fn index_of(data: &Value) -> Result<usize, String> {
    data.get("index")
        .and_then(Value::as_u64)
        .and_then(|i| usize::try_from(i).ok())
        .ok_or_else(|| format!("no index in {data}"))
}

fn append(block: &mut Value, key: &str, text: &str) {
    let mut joined = block
        .get(key)
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    joined.push_str(text);
    block[key] = json!(joined);
}
