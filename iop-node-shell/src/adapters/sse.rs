//! Incremental line splitting for SSE and NDJSON streams, and usage observation.

use bytes::{Bytes, BytesMut};
use iop_proto_core::wire::Usage;

/// Longest line kept while waiting for its end; longer lines are dropped (they are still
/// forwarded byte for byte on a tunnel, only not inspected).
const MAX_LINE: usize = 1 << 20;

/// Splits a byte stream into lines (`\n`, with an optional `\r` removed).
#[derive(Debug, Default)]
pub struct Lines {
    buf: BytesMut,
    overflow: bool,
}

impl Lines {
    /// Feeds bytes; returns the complete lines they finish.
    pub fn push(&mut self, data: &[u8]) -> Vec<Bytes> {
        let mut lines = Vec::new();
        for &b in data {
            if b == b'\n' {
                let mut line = self.buf.split().freeze();
                if line.last() == Some(&b'\r') {
                    line.truncate(line.len() - 1);
                }
                if !std::mem::take(&mut self.overflow) {
                    lines.push(line);
                }
            } else if self.buf.len() < MAX_LINE {
                self.buf.extend_from_slice(&[b]);
            } else {
                self.overflow = true;
            }
        }
        lines
    }

    /// The unterminated last line, at the end of the stream.
    pub fn finish(&mut self) -> Option<Bytes> {
        (!self.buf.is_empty() && !self.overflow).then(|| self.buf.split().freeze())
    }
}

/// The payload of an SSE `data:` line.
#[must_use]
pub fn sse_data(line: &[u8]) -> Option<&[u8]> {
    let rest = line.strip_prefix(b"data:")?;
    Some(rest.strip_prefix(b" ").unwrap_or(rest))
}

/// Reads an OpenAI `usage` object.
#[must_use]
pub fn usage_of(value: &serde_json::Value) -> Option<Usage> {
    let usage = value.get("usage")?;
    if !usage.is_object() {
        return None;
    }
    let n = |key: &str| {
        usage
            .get(key)
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0)
    };
    let (prompt, completion) = (n("prompt_tokens"), n("completion_tokens"));
    let total = usage
        .get("total_tokens")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(prompt + completion);
    Some(Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: total,
    })
}

/// Watches a tunnel's response body for usage: the last SSE chunk carrying `usage`, or a
/// JSON body's `usage` (bodies up to 8 MiB are inspected).
#[derive(Debug)]
pub struct UsageWatcher {
    sse: bool,
    lines: Lines,
    json: Vec<u8>,
    json_overflow: bool,
    usage: Option<Usage>,
}

const MAX_JSON: usize = 8 << 20;

impl UsageWatcher {
    /// A watcher for a response of this content type.
    #[must_use]
    pub fn new(content_type: &str) -> Self {
        UsageWatcher {
            sse: content_type.starts_with("text/event-stream"),
            lines: Lines::default(),
            json: Vec::new(),
            json_overflow: !content_type.contains("json"),
            usage: None,
        }
    }

    /// Observes a body chunk.
    pub fn push(&mut self, data: &[u8]) {
        if self.sse {
            for line in self.lines.push(data) {
                self.observe_line(&line);
            }
        } else if !self.json_overflow {
            if self.json.len() + data.len() > MAX_JSON {
                self.json_overflow = true;
                self.json = Vec::new();
            } else {
                self.json.extend_from_slice(data);
            }
        }
    }

    fn observe_line(&mut self, line: &[u8]) {
        if let Some(data) = sse_data(line)
            && let Ok(value) = serde_json::from_slice::<serde_json::Value>(data)
            && let Some(usage) = usage_of(&value)
        {
            self.usage = Some(usage);
        }
    }

    /// The usage seen, at the end of the body.
    pub fn finish(mut self) -> Option<Usage> {
        if self.sse {
            if let Some(line) = self.lines.finish() {
                self.observe_line(&line);
            }
            return self.usage;
        }
        if self.json_overflow {
            return None;
        }
        serde_json::from_slice::<serde_json::Value>(&self.json)
            .ok()
            .as_ref()
            .and_then(usage_of)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_survive_any_split() {
        let text = b"data: a\r\n\ndata: b\nlast";
        for cut in 0..text.len() {
            let mut lines = Lines::default();
            let mut got = lines.push(&text[..cut]);
            got.extend(lines.push(&text[cut..]));
            got.extend(lines.finish());
            let got: Vec<&[u8]> = got.iter().map(|b| &b[..]).collect();
            assert_eq!(got, vec![&b"data: a"[..], b"", b"data: b", b"last"]);
        }
    }

    #[test]
    fn usage_is_found_in_sse_and_json() {
        let mut sse = UsageWatcher::new("text/event-stream");
        sse.push(b"data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\n\ndata: [DONE]\n\n");
        assert_eq!(sse.finish().map(|u| u.total_tokens), Some(7));
        let mut json = UsageWatcher::new("application/json");
        json.push(b"{\"usage\":{\"prompt_tokens\":1,");
        json.push(b"\"completion_tokens\":2,\"total_tokens\":3}}");
        assert_eq!(json.finish().map(|u| u.completion_tokens), Some(2));
    }
}
