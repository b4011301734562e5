//! The Responses API stream rules, checked from the bytes a caller reads: what the
//! OpenAI SDKs and Codex rely on, so that the property tests and the fuzz target hold
//! every stream the Edge writes to the same rules.
//!
//! The rules: every frame has an `event:` line equal to its `data.type` and one JSON
//! `data:` line (comment lines, `: keep-alive`, may come between frames); `sequence_number`
//! counts 0, 1, 2... without a gap; `response.created` first, once, then
//! `response.in_progress`; an item is opened by `response.output_item.added` (its
//! `output_index` the next one) and closed once by `response.output_item.done` with the
//! same id, one item at a time; text, reasoning and argument events name the open item;
//! one terminal event (`response.completed`, `response.incomplete`, `response.failed`),
//! last, whose `output` lists every item exactly as its `output_item.done` gave it, ids
//! included; `response.failed` carries an `error.code`; never `[DONE]`.

use serde_json::Value;

/// How a stream ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Ended {
    /// `response.completed` or `response.incomplete`: the response object.
    Response(Value),
    /// `response.failed`: the response object.
    Failed(Value),
    /// The bytes ended before a terminal event.
    Cut,
}

const TERMINAL: [&str; 3] = [
    "response.completed",
    "response.incomplete",
    "response.failed",
];

/// Checks `body`, a whole Responses event stream, against the rules; how it ended, or
/// the first rule it breaks.
pub fn check_stream(body: &[u8]) -> Result<Ended, String> {
    let text = std::str::from_utf8(body).map_err(|_| "the stream is not UTF-8".to_owned())?;
    let mut sequence = 0u64;
    let mut done: Vec<Value> = Vec::new();
    // The open item: its id and output index.
    let mut open: Option<(String, u64)> = None;
    let mut ended = None;
    for frame in text.split("\n\n") {
        let lines: Vec<&str> = frame
            .split('\n')
            .filter(|l| !l.is_empty() && !l.starts_with(':'))
            .collect();
        if lines.is_empty() {
            continue;
        }
        if ended.is_some() {
            return Err(format!("a frame after the terminal event: {frame:?}"));
        }
        let [event, data] = lines[..] else {
            return Err(format!(
                "a frame that is not one event and one data line: {frame:?}"
            ));
        };
        let event = event
            .strip_prefix("event: ")
            .ok_or_else(|| format!("no event line: {frame:?}"))?;
        let data = data
            .strip_prefix("data: ")
            .ok_or_else(|| format!("no data line: {frame:?}"))?;
        if data == "[DONE]" {
            return Err("[DONE] in a Responses stream".to_owned());
        }
        let data: Value =
            serde_json::from_str(data).map_err(|e| format!("data is not JSON ({e}): {data}"))?;
        if data["type"] != event {
            return Err(format!("event {event} carries type {}", data["type"]));
        }
        if data["sequence_number"] != sequence {
            return Err(format!(
                "sequence_number {} where {sequence} was due",
                data["sequence_number"]
            ));
        }
        match (sequence, event) {
            (0, "response.created") | (1, "response.in_progress") => {}
            (0 | 1, other) => return Err(format!("{other} at sequence {sequence}")),
            (_, "response.created" | "response.in_progress") => {
                return Err(format!("a second {event}"));
            }
            _ => {}
        }
        sequence += 1;
        let names_open = |data: &Value| match &open {
            Some((id, index)) => data["item_id"] == id.as_str() && data["output_index"] == *index,
            None => false,
        };
        match event {
            "response.created" | "response.in_progress" => {
                if data["response"]["status"] != "in_progress" {
                    return Err(format!(
                        "{event} with status {}",
                        data["response"]["status"]
                    ));
                }
            }
            "response.output_item.added" => {
                if let Some((id, _)) = &open {
                    return Err(format!("an item added while {id} is open"));
                }
                if data["output_index"] != done.len() as u64 {
                    return Err(format!(
                        "output_index {} for item {}",
                        data["output_index"],
                        done.len()
                    ));
                }
                let id = data["item"]["id"]
                    .as_str()
                    .ok_or("an item without an id")?
                    .to_owned();
                open = Some((id, done.len() as u64));
            }
            "response.output_item.done" => {
                let Some((id, _)) = open.take() else {
                    return Err("output_item.done with no item open".to_owned());
                };
                if data["item"]["id"] != id.as_str() || data["output_index"] != done.len() as u64 {
                    return Err(format!(
                        "output_item.done for {} while {id} is open",
                        data["item"]["id"]
                    ));
                }
                done.push(data["item"].clone());
            }
            "response.content_part.added"
            | "response.content_part.done"
            | "response.output_text.delta"
            | "response.output_text.done"
            | "response.reasoning_text.delta"
            | "response.reasoning_text.done"
            | "response.function_call_arguments.delta"
            | "response.function_call_arguments.done" => {
                if !names_open(&data) {
                    return Err(format!(
                        "{event} names {} but {open:?} is open",
                        data["item_id"]
                    ));
                }
            }
            terminal if TERMINAL.contains(&terminal) => {
                if open.is_some() {
                    return Err(format!("{terminal} with an item open"));
                }
                let response = data["response"].clone();
                if response["output"] != Value::Array(done.clone()) {
                    return Err(format!(
                        "the terminal output differs from the items done: {} vs {:?}",
                        response["output"], done
                    ));
                }
                let status = response["status"].as_str().unwrap_or("");
                let expected = match terminal {
                    "response.completed" => "completed",
                    "response.incomplete" => "incomplete",
                    _ => "failed",
                };
                if status != expected {
                    return Err(format!("{terminal} with status {status}"));
                }
                ended = Some(if terminal == "response.failed" {
                    if !response["error"]["code"].is_string() {
                        return Err("response.failed without an error code".to_owned());
                    }
                    Ended::Failed(response)
                } else {
                    if !response["usage"]["total_tokens"].is_u64() {
                        return Err("a terminal response without integer usage".to_owned());
                    }
                    Ended::Response(response)
                });
            }
            other => return Err(format!("unknown event {other}")),
        }
    }
    Ok(ended.unwrap_or(Ended::Cut))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_created_and_a_gap_are_caught() {
        let created = "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"status\":\"in_progress\"}}\n\n";
        let twice = format!(
            "{created}{}",
            created.replace("\"sequence_number\":0", "\"sequence_number\":1")
        );
        assert!(check_stream(twice.as_bytes()).is_err());
        let gap = created.replace("\"sequence_number\":0", "\"sequence_number\":3");
        assert!(check_stream(gap.as_bytes()).is_err());
        assert_eq!(check_stream(created.as_bytes()), Ok(Ended::Cut));
        assert!(check_stream(b"data: [DONE]\n\n").is_err());
    }
}
