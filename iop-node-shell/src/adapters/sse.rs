//! Incremental line splitting for SSE and NDJSON streams, and usage observation.

use bytes::{Bytes, BytesMut};
use iop_json::last_member_value;
use iop_proto_core::wire::Usage;

/// Longest line kept while waiting for its end; longer lines are dropped (they are still
/// forwarded byte for byte on a tunnel, only not inspected).
const MAX_LINE: usize = 1 << 20;

/// Capacity a split reader keeps for lines that span buffers; a larger one (after a
/// long line) is freed.
const KEEP_PARTIAL: usize = 16 << 10;

/// Splits a byte stream into lines (`\n`, with an optional `\r` removed). A line that
/// arrives whole inside one pushed buffer is a zero-copy slice of it; only a line split
/// across buffers is copied, once.
#[derive(Debug, Default)]
pub struct Lines {
    /// Input not yet split.
    pending: Bytes,
    /// The start of a line whose end has not arrived.
    partial: BytesMut,
    overflow: bool,
}

impl Lines {
    /// Feeds bytes; take the lines they finish with [`Lines::next_line`] before the next
    /// push.
    pub fn push(&mut self, data: Bytes) {
        debug_assert!(self.pending.is_empty(), "lines left unread");
        self.pending = data;
    }

    /// The next complete line, or `None` when the input pushed so far is used up.
    pub fn next_line(&mut self) -> Option<Bytes> {
        loop {
            let Some(end) = memchr::memchr(b'\n', &self.pending) else {
                let rest = std::mem::take(&mut self.pending);
                self.keep(&rest);
                return None;
            };
            let mut line = self.pending.split_to(end + 1);
            line.truncate(end);
            if !self.partial.is_empty() || self.overflow {
                if !self.join(&line) {
                    continue;
                }
                line = self.partial.split().freeze();
            }
            if line.last() == Some(&b'\r') {
                line.truncate(line.len() - 1);
            }
            return Some(line);
        }
    }

    /// Splits `data` as [`Lines::next_line`] would, but lends only the lines that hold
    /// `needle` (which holds no line feed) to `each`, instead of handing out shared
    /// slices: for a reader that looks at some lines only, a buffer costs no reference
    /// counting, and a burst of lines one search for the needle over all of it instead of
    /// a search for a line feed and one for the needle per line. (An empty needle lends
    /// every line.) Do not mix with [`Lines::push`].
    pub fn split_where(
        &mut self,
        mut data: &[u8],
        needle: &memchr::memmem::Finder<'_>,
        mut each: impl FnMut(&[u8]),
    ) {
        debug_assert!(self.pending.is_empty(), "split after push");
        debug_assert!(!needle.needle().contains(&b'\n'));
        if !self.partial.is_empty() || self.overflow {
            // The line begun in earlier input ends first, as `next_line` ends it.
            let Some(end) = memchr::memchr(b'\n', data) else {
                self.keep(data);
                return;
            };
            let line = &data[..end];
            data = &data[end + 1..];
            if self.join(line) {
                let whole = self.partial.strip_suffix(b"\r").unwrap_or(&self.partial);
                if needle.find(whole).is_some() {
                    each(whole);
                }
                if self.partial.capacity() > KEEP_PARTIAL {
                    self.partial = BytesMut::new();
                } else {
                    self.partial.clear();
                }
            }
        }
        // The lines `data` completes end at its last line feed; what follows is kept.
        let Some(last) = memchr::memrchr(b'\n', data) else {
            self.keep(data);
            return;
        };
        let (lines, rest) = data.split_at(last + 1);
        // `from` is where a line starts; each line of `lines` ends with a line feed, and
        // the needle holds none, so a line that holds it ends after it.
        let mut from = 0;
        while from < lines.len()
            && let Some(at) = needle.find(&lines[from..]).map(|at| from + at)
        {
            let start = memchr::memrchr(b'\n', &lines[from..at]).map_or(from, |lf| from + lf + 1);
            let end = memchr::memchr(b'\n', &lines[at..]).map_or(last, |lf| at + lf);
            let line = &lines[start..end];
            each(line.strip_suffix(b"\r").unwrap_or(line));
            from = end + 1;
        }
        self.keep(rest);
    }

    /// Completes the line begun in earlier input with `end`; false (and the line
    /// dropped) when the whole is longer than [`MAX_LINE`].
    fn join(&mut self, end: &[u8]) -> bool {
        let overflow =
            std::mem::take(&mut self.overflow) || self.partial.len() + end.len() > MAX_LINE;
        if overflow {
            self.partial.clear();
            return false;
        }
        self.partial.extend_from_slice(end);
        true
    }

    /// Keeps the start of a line whose end has not arrived (dropped past [`MAX_LINE`]).
    fn keep(&mut self, rest: &[u8]) {
        if self.partial.len() + rest.len() <= MAX_LINE {
            self.partial.extend_from_slice(rest);
        } else {
            self.overflow = true;
            self.partial.clear();
        }
    }

    /// The unterminated last line, at the end of the stream.
    pub fn finish(&mut self) -> Option<Bytes> {
        let rest = std::mem::take(&mut self.pending);
        self.partial.extend_from_slice(&rest);
        (!self.partial.is_empty() && !self.overflow && self.partial.len() <= MAX_LINE)
            .then(|| self.partial.split().freeze())
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
        .unwrap_or(prompt.saturating_add(completion));
    Some(Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: total,
    })
}

/// The `usage` member of a JSON object, read without building a tree of the rest: the
/// last top-level member of the name (as serde keeps it) is located from the object's end
/// by [`last_member_value`], so an answer's `choices` before its `usage` are not read,
/// and only its value is deserialised.
#[must_use]
pub fn usage_in(json: &[u8]) -> Option<Usage> {
    use serde::Deserialize;
    #[derive(serde::Deserialize)]
    struct Counts {
        prompt_tokens: Option<u64>,
        completion_tokens: Option<u64>,
        total_tokens: Option<u64>,
    }
    let value = last_member_value(json, "usage")?;
    let raw = &json[value];
    let [prompt, completion, total] = match plain_counts(raw) {
        Some(counts) => counts,
        None => {
            let mut de = serde_json::Deserializer::from_slice(raw);
            let counts = Option::<Counts>::deserialize(&mut de).ok()??;
            [
                counts.prompt_tokens,
                counts.completion_tokens,
                counts.total_tokens,
            ]
        }
    };
    let (prompt, completion) = (prompt.unwrap_or(0), completion.unwrap_or(0));
    Some(Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: total.unwrap_or(prompt.saturating_add(completion)),
    })
}

/// The counts of a usage object in its plain shape, read without serde: an object of
/// `prompt_tokens`, `completion_tokens` and `total_tokens` only, each at most once, each a
/// plain non-negative integer that fits a u64, keys without escapes. `None` for anything
/// else (other members, other numbers, escapes, duplicates, broken text): serde reads
/// those, so that what is accepted, and what it means, stays serde's.
fn plain_counts(raw: &[u8]) -> Option<[Option<u64>; 3]> {
    const KEYS: [&[u8]; 3] = [b"prompt_tokens", b"completion_tokens", b"total_tokens"];
    let ws = |at: &mut usize| {
        while raw
            .get(*at)
            .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
        {
            *at += 1;
        }
    };
    let mut counts = [None; 3];
    let mut at = 0;
    ws(&mut at);
    if raw.get(at) != Some(&b'{') {
        return None;
    }
    at += 1;
    ws(&mut at);
    if raw.get(at) == Some(&b'}') {
        at += 1;
        ws(&mut at);
        return (at == raw.len()).then_some(counts);
    }
    loop {
        // "key"
        if raw.get(at) != Some(&b'"') {
            return None;
        }
        // One of the keys, then its closing quote (none holds a quote).
        let rest = raw.get(at + 1..)?;
        let slot = KEYS
            .iter()
            .position(|k| rest.starts_with(k) && rest.get(k.len()) == Some(&b'"'))?;
        at += 1 + KEYS[slot].len() + 1;
        ws(&mut at);
        if raw.get(at) != Some(&b':') {
            return None;
        }
        at += 1;
        ws(&mut at);
        // A JSON integer: 0, or a non-zero digit then digits; no sign, fraction or exponent.
        let digits = raw[at..].iter().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 || (digits > 1 && raw[at] == b'0') {
            return None;
        }
        let n = raw[at..at + digits].iter().try_fold(0u64, |n, b| {
            n.checked_mul(10)?.checked_add(u64::from(b - b'0'))
        })?;
        at += digits;
        if matches!(raw.get(at), Some(b'.' | b'e' | b'E')) || counts[slot].is_some() {
            return None;
        }
        counts[slot] = Some(n);
        ws(&mut at);
        match raw.get(at)? {
            b',' => {
                at += 1;
                ws(&mut at);
            }
            b'}' => {
                at += 1;
                ws(&mut at);
                return (at == raw.len()).then_some(counts);
            }
            _ => return None,
        }
    }
}

/// The key a usage-carrying SSE chunk holds, searched for in every `data:` line: built
/// once (a searcher's set-up cost more than the search of a short line).
static USAGE_KEY: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"usage\""));

/// Watches a tunnel's response body for usage: the last SSE chunk carrying `usage`, or a
/// JSON body's `usage` (bodies up to 8 MiB are inspected).
#[derive(Debug)]
pub struct UsageWatcher {
    sse: bool,
    lines: Lines,
    /// A JSON body as it arrived: its chunks are shared, not copied, and joined only
    /// when there is more than one.
    json: Vec<Bytes>,
    json_len: usize,
    json_overflow: bool,
    usage: Option<Usage>,
}

const MAX_JSON: usize = 8 << 20;

impl UsageWatcher {
    /// A watcher for a response of this content type (its bytes as the head has them: no
    /// need to check them as UTF-8 first).
    #[must_use]
    pub fn new(content_type: &[u8]) -> Self {
        UsageWatcher {
            sse: content_type.starts_with(b"text/event-stream"),
            lines: Lines::default(),
            json: Vec::new(),
            json_len: 0,
            // `str::contains` sets up a general searcher, which costs more than looking
            // at a content type's few bytes.
            json_overflow: !content_type.windows(4).any(|w| w == b"json"),
            usage: None,
        }
    }

    /// Observes a body chunk.
    pub fn push(&mut self, data: &Bytes) {
        if self.sse {
            let usage = &mut self.usage;
            // Only a line that mentions the key can carry usage.
            self.lines
                .split_where(data, &USAGE_KEY, |line| observe_data(usage, line));
        } else if !self.json_overflow {
            self.json_len += data.len();
            if self.json_len > MAX_JSON {
                self.json_overflow = true;
                self.json = Vec::new();
            } else {
                self.json.push(data.clone());
            }
        }
    }

    /// The usage seen, at the end of the body.
    pub fn finish(mut self) -> Option<Usage> {
        if self.sse {
            if let Some(line) = self.lines.finish() {
                observe_line(&mut self.usage, &line);
            }
            return self.usage;
        }
        match &self.json[..] {
            _ if self.json_overflow => None,
            [one] => usage_in(one),
            chunks => usage_in(&chunks.concat()),
        }
    }
}

/// Keeps the usage of an SSE line that carries one. Only a line that mentions `"usage"`
/// is parsed, and only into the usage figures.
fn observe_line(usage: &mut Option<Usage>, line: &[u8]) {
    if USAGE_KEY.find(line).is_some() {
        observe_data(usage, line);
    }
}

/// [`observe_line`] for a line known to mention `"usage"` ([`Lines::split_where`] lends
/// only those): not searched again. A `data:` prefix holds no quote, so the key lies in
/// the line's data.
fn observe_data(usage: &mut Option<Usage>, line: &[u8]) {
    if let Some(data) = sse_data(line)
        && let Some(found) = usage_in(data)
    {
        *usage = Some(found);
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
            let mut got = Vec::new();
            for piece in [&text[..cut], &text[cut..]] {
                lines.push(Bytes::copy_from_slice(piece));
                got.extend(std::iter::from_fn(|| lines.next_line()));
            }
            got.extend(lines.finish());
            let got: Vec<&[u8]> = got.iter().map(|b| &b[..]).collect();
            assert_eq!(got, vec![&b"data: a"[..], b"", b"data: b", b"last"]);
        }
    }

    /// Both ways of reading lines, on the same pieces: pushed and taken, with the lines
    /// that do not hold `needle` left out, and lent by [`Lines::split_where`].
    fn both_ways_where(pieces: &[&[u8]], needle: &[u8]) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let finder = memchr::memmem::Finder::new(needle);
        let (mut owned, mut lent) = (Lines::default(), Lines::default());
        let (mut by_push, mut by_split) = (Vec::new(), Vec::new());
        for piece in pieces {
            owned.push(Bytes::copy_from_slice(piece));
            by_push.extend(std::iter::from_fn(|| owned.next_line()).map(|l| l.to_vec()));
            lent.split_where(piece, &finder, |line| by_split.push(line.to_vec()));
        }
        by_push.extend(owned.finish().map(|l| l.to_vec()));
        by_push.retain(|line| finder.find(line).is_some());
        // The unfinished last line is the caller's to look at, as with `push`.
        by_split.extend(
            lent.finish()
                .filter(|line| finder.find(line).is_some())
                .map(|l| l.to_vec()),
        );
        (by_push, by_split)
    }

    /// Both ways of reading every line.
    fn both_ways(pieces: &[&[u8]]) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        both_ways_where(pieces, b"")
    }

    proptest::proptest! {
        /// The lines lent because they hold the needle are the lines taken one by one
        /// that hold it, however the stream is cut.
        #[test]
        fn lines_lent_by_needle_are_the_lines_that_hold_it(
            words in proptest::collection::vec(
                proptest::sample::select(vec![
                    &b"data: "[..], b"\"usage\"", b"\"usa", b"ge\"", b"\n", b"\r\n", b"\r",
                    b"x", b"{\"a\":1}", b"\n\n",
                ]),
                0..40,
            ),
            cuts in proptest::collection::vec(proptest::num::usize::ANY, 0..6),
        ) {
            let text = words.concat();
            let mut at: Vec<usize> = cuts.iter().map(|c| c % (text.len() + 1)).collect();
            at.sort_unstable();
            let mut pieces = Vec::new();
            let mut from = 0;
            for cut in at {
                pieces.push(&text[from..cut]);
                from = cut;
            }
            pieces.push(&text[from..]);
            let (by_push, by_split) = both_ways_where(&pieces, b"\"usage\"");
            proptest::prop_assert_eq!(by_split, by_push);
            let (by_push, by_split) = both_ways(&pieces);
            proptest::prop_assert_eq!(by_split, by_push);
        }
    }

    #[test]
    fn lent_lines_are_the_pushed_lines_at_any_two_cuts() {
        let text = b"data: a\r\n\r\ndata: bb\n\n\rx\r\nlast\r";
        for first in 0..=text.len() {
            for second in first..=text.len() {
                let pieces = [&text[..first], &text[first..second], &text[second..]];
                let (by_push, by_split) = both_ways(&pieces);
                assert_eq!(by_push, by_split, "cut at {first} and {second}");
            }
        }
    }

    #[test]
    fn lent_lines_drop_an_overlong_line_as_pushed_ones_do() {
        let long = vec![b'x'; MAX_LINE - 2];
        let pieces: [&[u8]; 5] = [b"ok\nyy", &long, b"zz", b"zz\nnext\n", b"tail"];
        let (by_push, by_split) = both_ways(&pieces);
        assert_eq!(by_split, by_push);
        assert_eq!(
            by_split,
            vec![b"ok".to_vec(), b"next".to_vec(), b"tail".to_vec()]
        );
        // A line that fits is joined across the pieces.
        let (_, joined) = both_ways(&[b"da", b"ta: ", b"1\n"]);
        assert_eq!(joined, vec![b"data: 1".to_vec()]);
    }

    #[test]
    fn usage_is_found_in_sse_and_json() {
        let mut sse = UsageWatcher::new(b"text/event-stream");
        sse.push(&Bytes::from_static(b"data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\n\ndata: [DONE]\n\n"));
        assert_eq!(sse.finish().map(|u| u.total_tokens), Some(7));
        let mut json = UsageWatcher::new(b"application/json");
        json.push(&Bytes::from_static(b"{\"usage\":{\"prompt_tokens\":1,"));
        json.push(&Bytes::from_static(
            b"\"completion_tokens\":2,\"total_tokens\":3}}",
        ));
        assert_eq!(json.finish().map(|u| u.completion_tokens), Some(2));
        // A usage of null, a usage only mentioned in a string, a line too long to keep.
        let mut odd = UsageWatcher::new(b"text/event-stream");
        odd.push(&Bytes::from_static(
            b"data: {\"usage\":null}\n\ndata: {\"note\":\"\\\"usage\\\"\"}\n\n",
        ));
        assert_eq!(odd.finish(), None);
    }

    #[test]
    fn only_the_top_level_usage_member_counts() {
        let usage = |json: &str| usage_in(json.as_bytes()).map(|u| u.total_tokens);
        // Nested objects, arrays and strings that spell the key do not count.
        assert_eq!(
            usage(
                r#" { "choices": [{"usage": {"total_tokens": 1}}], "note": "\"usage\": {}",
                "x\\": 1, "meta": {"usage": {"total_tokens": 2}}, "usage" : {"total_tokens": 9} }"#
            ),
            Some(9)
        );
        assert_eq!(usage(r#"{"a":{"usage":{"total_tokens":2}}}"#), None);
        assert_eq!(usage(r#"[{"usage":{"total_tokens":2}}]"#), None);
        assert_eq!(usage(r#"{"usage":null}"#), None);
        assert_eq!(usage(r#"{"usage":"many"}"#), None);
        // Members after it, as OpenAI and vLLM write them; named twice, the last counts
        // (as serde keeps it).
        assert_eq!(
            usage(
                r#"{"choices":[],"usage":{"total_tokens":4},"service_tier":"default","system_fingerprint":"fp_}\""}"#
            ),
            Some(4)
        );
        assert_eq!(
            usage(r#"{"usage":{"total_tokens":4},"prompt_logprobs":null,"kv":[{"usage":1}]}"#),
            Some(4)
        );
        assert_eq!(
            usage(r#"{"usage":{"total_tokens":1},"x":2,"usage":{"total_tokens":3}}"#),
            Some(3)
        );
        // Bytes after the object: read forward.
        assert_eq!(usage(r#"{"usage":{"total_tokens":6}} trailing"#), Some(6));
        // Cut short anywhere, it never reads past the end.
        let whole = r#"{"id":"a\"b","usage":{"prompt_tokens":2,"completion_tokens":3}}"#;
        for cut in 0..whole.len() {
            let _ = usage(&whole[..cut]);
        }
        assert_eq!(usage(whole), Some(5));
        // A body that arrived in pieces is read whole.
        let mut json = UsageWatcher::new(b"application/json");
        for piece in whole.as_bytes().chunks(7) {
            json.push(&Bytes::copy_from_slice(piece));
        }
        assert_eq!(json.finish().map(|u| u.total_tokens), Some(5));
    }

    #[test]
    fn an_overlong_line_is_dropped_and_the_next_one_kept() {
        let mut lines = Lines::default();
        lines.push(Bytes::from(vec![b'x'; MAX_LINE + 10]));
        assert_eq!(lines.next_line(), None);
        lines.push(Bytes::from_static(b"yy\nnext\n"));
        assert_eq!(lines.next_line().as_deref(), Some(&b"next"[..]));
        assert_eq!(lines.next_line(), None);
    }

    /// What serde alone reads of a usage object (the reading before the plain-shape path).
    fn usage_by_serde(raw: &[u8]) -> Option<Usage> {
        use serde::Deserialize;
        #[derive(serde::Deserialize)]
        struct Counts {
            prompt_tokens: Option<u64>,
            completion_tokens: Option<u64>,
            total_tokens: Option<u64>,
        }
        let mut de = serde_json::Deserializer::from_slice(raw);
        let counts = Option::<Counts>::deserialize(&mut de).ok()??;
        let (p, c) = (
            counts.prompt_tokens.unwrap_or(0),
            counts.completion_tokens.unwrap_or(0),
        );
        Some(Usage {
            prompt_tokens: p,
            completion_tokens: c,
            total_tokens: counts.total_tokens.unwrap_or(p.saturating_add(c)),
        })
    }

    #[test]
    fn plain_usage_objects_are_read_as_serde_reads_them() {
        for raw in [
            &br#"{"prompt_tokens":5,"completion_tokens":16,"total_tokens":21}"#[..],
            br#"{ "total_tokens" : 0 , "prompt_tokens":18446744073709551615 }"#,
            br#"{}"#,
            br#"{"prompt_tokens":18446744073709551616}"#,
            br#"{"prompt_tokens":05}"#,
            br#"{"prompt_tokens":5.0}"#,
            br#"{"prompt_tokens":-5}"#,
            br#"{"prompt_tokens":5e1}"#,
            br#"{"prompt_tokens":5,"prompt_tokens":6}"#,
            br#"{"prompt\u005ftokens":5}"#,
            br#"{"prompt_tokens":5,"x":[tru]}"#,
            br#"{"prompt_tokens":5,}"#,
            br#"{"prompt_tokens":5} x"#,
            br#"{"prompt_tokens":null}"#,
            br#"null"#,
            // Counts whose sum overflows: the total saturates (a provider cannot make the
            // node panic or wrap).
            br#"{"prompt_tokens":18446744073709551615,"completion_tokens":7}"#,
        ] {
            let body = [&br#"{"id":"x","usage":"#[..], raw, b"}"].concat();
            assert_eq!(
                usage_in(&body),
                iop_json::member_value(&body, "usage").and_then(|v| usage_by_serde(&body[v])),
                "{}",
                String::from_utf8_lossy(raw)
            );
        }
    }

    proptest::proptest! {
        /// Generated usage objects, plain and not, in a body: the same counts as serde.
        #[test]
        fn usage_counts_agree_with_serde(
            members in proptest::collection::vec(
                (
                    proptest::sample::select(vec![
                        "prompt_tokens", "completion_tokens", "total_tokens", "cached", "prompt\\u005ftokens",
                    ]),
                    proptest::sample::select(vec![
                        "0", "7", "42", "007", "-1", "1.5", "2e3", "18446744073709551615",
                        "18446744073709551616", "null", "true", "\"9\"", "{}", "[1]",
                    ]),
                    proptest::sample::select(vec!["", " ", "\n\t"]),
                ),
                0..5,
            ),
            tail in proptest::sample::select(vec!["}", " }", ",}", "", "}}"]),
        ) {
            let mut raw = String::from("{");
            for (i, (key, value, space)) in members.iter().enumerate() {
                if i > 0 {
                    raw.push(',');
                }
                raw.push_str(&format!("{space}\"{key}\"{space}:{space}{value}{space}"));
            }
            raw.push_str(tail);
            let body = format!(r#"{{"id":"x","usage":{raw}}}"#);
            let body = body.as_bytes();
            proptest::prop_assert_eq!(
                usage_in(body),
                iop_json::member_value(body, "usage").and_then(|v| usage_by_serde(&body[v]))
            );
        }
    }
}
