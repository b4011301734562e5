//! What the Edge reads of an inference request body, the prompt-size estimate, and the
//! byte-exact `model` rewrite of a tunnelled body.

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{ApiError, Endpoint};

/// The facts of a request body the Edge acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestFacts {
    /// The public model name.
    pub model: String,
    /// `stream: true`.
    pub stream: bool,
    /// `stream_options.include_usage: true`.
    pub include_usage: bool,
    /// A non-empty `tools` array (text may then be a tool call in disguise).
    pub wants_tools: bool,
    /// The prompt's size in tokens, estimated ([`estimate_tokens`]); decides long context.
    pub prompt_tokens: u64,
}

/// The fields decided on, as borrowed raw JSON: no document tree is built, so a body of
/// 300,000 tiny messages costs one scan, not 300,000 maps. Unknown fields are skipped.
#[derive(Deserialize)]
struct Head<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    #[serde(borrow)]
    stream_options: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    input: Option<&'a RawValue>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
}

/// A present, non-null field.
fn given(v: Option<&RawValue>) -> Option<&RawValue> {
    v.filter(|v| v.get() != "null")
}

/// Reads what the Edge needs from a request body, or the 400 to answer: the body must
/// be a JSON object with a string `model`, the endpoint's input (a non-empty `messages`
/// array for chat, a `prompt`, an `input`), and a boolean `stream` if any.
pub fn inspect(raw: &[u8], endpoint: Endpoint) -> Result<RequestFacts, ApiError> {
    let head: Head<'_> = match serde_json::from_slice(raw) {
        Ok(head) => head,
        Err(err) if err.is_data() && raw.trim_ascii_start().first() != Some(&b'{') => {
            return Err(ApiError::bad_request(
                "the request body must be a JSON object",
                None,
            ));
        }
        Err(err) => return Err(ApiError::bad_request(format!("invalid JSON: {err}"), None)),
    };
    let model = given(head.model)
        .and_then(|m| serde_json::from_str::<String>(m.get()).ok())
        .ok_or_else(|| {
            ApiError::bad_request("you must provide a model parameter", Some("missing_model"))
        })?;
    let present = match endpoint {
        Endpoint::Chat => given(head.messages).is_some_and(nonempty_array),
        Endpoint::Completions => given(head.prompt).is_some(),
        Endpoint::Embeddings => given(head.input).is_some(),
    };
    if !present {
        return Err(ApiError::bad_request(
            format!(
                "missing or invalid required parameter: {}",
                endpoint.input_field()
            ),
            Some("invalid_value"),
        ));
    }
    let stream = match given(head.stream) {
        None => false,
        Some(v) => serde_json::from_str::<bool>(v.get()).map_err(|_| {
            ApiError::bad_request("stream must be a boolean", Some("invalid_value"))
        })?,
    };
    #[derive(Deserialize)]
    struct StreamOptions {
        include_usage: Option<bool>,
    }
    let include_usage = given(head.stream_options)
        .and_then(|v| serde_json::from_str::<StreamOptions>(v.get()).ok())
        .and_then(|o| o.include_usage)
        == Some(true);
    let wants_tools = given(head.tools).is_some_and(nonempty_array);
    Ok(RequestFacts {
        model,
        stream,
        include_usage,
        wants_tools,
        prompt_tokens: estimate_tokens(raw),
    })
}

/// Estimates how many tokens a model will see for a JSON request body, in one pass and
/// without allocating. Used to decide whether a request needs a long-context provider,
/// where an estimate off by a few percent is harmless but one off by 3x is not.
///
/// Only text inside JSON strings counts (keys approximate a chat template's per-message
/// overhead); JSON punctuation outside strings is free and a number outside strings
/// (a token id, a parameter) is one token. Inside strings, after the way BPE vocabularies
/// of current models split text:
/// - a word (letters, including accented and non-Latin alphabets) of up to six
///   characters is one token, a longer one a token per five characters;
/// - digits go in groups of three;
/// - each CJK ideograph, kana or Hangul syllable is a token (a bytes/4 guess counts it
///   as 0.75);
/// - each punctuation mark, escape sequence or other symbol is a token (emoji two);
/// - whitespace joins the following word and is free.
///
/// For English chat bodies this lands within about 20% of `cl100k`-style counts, where
/// bytes/4 overshoots JSON-heavy bodies by half and undercounts CJK text by a quarter or
/// more. A body that is not UTF-8 falls back to bytes/4.
#[must_use]
pub fn estimate_tokens(raw: &[u8]) -> u64 {
    let Ok(text) = std::str::from_utf8(raw) else {
        return (raw.len() as u64).div_ceil(4);
    };
    let bytes = text.as_bytes();
    let mut est = Estimate::default();
    let mut at = 0;
    while let Some(&b) = bytes.get(at) {
        if !est.in_string {
            // A number outside strings is one token, however long. No byte of a
            // multi-byte character is a digit or a quote, so bytes serve as characters.
            let digit = b.is_ascii_digit();
            est.tokens += u64::from(est.number && !digit);
            est.number = digit;
            est.in_string = b == b'"';
            at += 1;
            continue;
        }
        if b.is_ascii() {
            // ASCII, most of any body, is classified without decoding a character.
            at += 1;
            match b {
                b'\\' => {
                    est.flush();
                    est.tokens += 1;
                    // The escaped character; after `u`, its four hex digits too.
                    let escaped = bytes.get(at).copied();
                    at = skip_chars(text, at, 1);
                    if escaped == Some(b'u') {
                        at = skip_chars(text, at, 4);
                    }
                }
                b'"' => {
                    est.flush();
                    est.in_string = false;
                }
                b'0'..=b'9' => est.digit(),
                b'a'..=b'z' | b'A'..=b'Z' => est.letter(),
                b' ' | b'\t'..=b'\r' => est.flush(),
                _ => {
                    est.flush();
                    est.tokens += 1;
                }
            }
            continue;
        }
        let Some(c) = text.get(at..).and_then(|rest| rest.chars().next()) else {
            break;
        };
        at += c.len_utf8();
        if c.is_alphabetic() && !is_cjk(c) {
            est.letter();
        } else if c.is_whitespace() {
            est.flush();
        } else {
            est.flush();
            est.tokens += if is_cjk(c) || u32::from(c) < 0x2000 {
                1
            } else {
                2
            };
        }
    }
    est.flush();
    est.tokens + u64::from(est.number)
}

/// The running figures of [`estimate_tokens`].
#[derive(Default)]
struct Estimate {
    tokens: u64,
    /// Letters of the word being read (digits that follow letters belong to it).
    word: u64,
    /// Digits of the number being read inside a string.
    digits: u64,
    in_string: bool,
    /// Whether the last byte outside strings was a digit.
    number: bool,
}

impl Estimate {
    /// Ends the word or number being read.
    fn flush(&mut self) {
        if self.word > 0 {
            self.tokens += if self.word <= 6 {
                1
            } else {
                self.word.div_ceil(5)
            };
            self.word = 0;
        }
        if self.digits > 0 {
            self.tokens += self.digits.div_ceil(3);
            self.digits = 0;
        }
    }

    fn digit(&mut self) {
        if self.word > 0 {
            self.word += 1;
        } else {
            self.digits += 1;
        }
    }

    fn letter(&mut self) {
        if self.digits > 0 {
            self.flush();
        }
        self.word += 1;
    }
}

/// The byte offset `n` characters after `at` in `text` (or its end).
fn skip_chars(text: &str, at: usize, n: usize) -> usize {
    let rest = text.get(at..).unwrap_or("");
    at + rest.chars().take(n).map(char::len_utf8).sum::<usize>()
}

/// Ideographs, kana and Hangul: scripts a tokenizer splits about one token per character.
fn is_cjk(c: char) -> bool {
    matches!(u32::from(c),
        0x3040..=0x30FF // hiragana, katakana
        | 0x3400..=0x4DBF // CJK extension A
        | 0x4E00..=0x9FFF // CJK unified ideographs
        | 0xAC00..=0xD7AF // Hangul syllables
        | 0xF900..=0xFAFF // CJK compatibility ideographs
        | 0x20000..=0x2FFFF) // CJK extensions B and on
}

/// Replaces the value of the top-level `"model"` key in a JSON object, leaving every other
/// byte untouched (so a provider sees the caller's body exactly, but for the model it
/// serves). `None` when the body is not a JSON object with a `model` key.
#[must_use]
pub fn rewrite_model(raw: &[u8], target: &str) -> Option<Bytes> {
    let value = member_value(raw, "model")?;
    let encoded = serde_json::to_string(target).ok()?;
    let mut out = Vec::with_capacity(raw.len() + encoded.len());
    out.extend_from_slice(&raw[..value.start]);
    out.extend_from_slice(encoded.as_bytes());
    out.extend_from_slice(&raw[value.end..]);
    Some(Bytes::from(out))
}

/// Where the value of the first top-level member named `key` sits in `raw`, a JSON
/// object, found by skimming its structure: nothing is decoded or allocated (but a key
/// written with escapes), so it costs a pass over the bytes up to that member however
/// large the rest. A key matches however it is escaped. `None` when `raw` is not an
/// object (as far as the skim reaches) or has no such member; the text is not
/// validated beyond what the skim needs.
#[must_use]
pub fn member_value(raw: &[u8], key: &str) -> Option<std::ops::Range<usize>> {
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
        let written = &raw[key_start..scan.i];
        scan.ws();
        scan.eat(b':')?;
        scan.ws();
        let value_start = scan.i;
        scan.value()?;
        let named = written.get(1..written.len() - 1) == Some(key.as_bytes())
            || (written.contains(&b'\\')
                && serde_json::from_slice::<String>(written).ok().as_deref() == Some(key));
        if named {
            return Some(value_start..scan.i);
        }
        scan.ws();
        match scan.peek()? {
            b',' => scan.i += 1,
            _ => return None,
        }
    }
}

/// Whether `raw` is an array with at least one element. `raw` is validated JSON (a value
/// of a parsed document), so its first bytes decide it: the array is not parsed again
/// (for a chat body that would be most of the body a second time).
#[must_use]
pub fn nonempty_array(raw: &RawValue) -> bool {
    raw.get()
        .trim_ascii_start()
        .strip_prefix('[')
        .is_some_and(|rest| !rest.trim_ascii_start().starts_with(']'))
}

/// A forward-only JSON skimmer: enough to find where a top-level value starts and ends.
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
            // The next quote or backslash; what lies between needs no look.
            self.i += memchr::memchr2(b'"', b'\\', self.s.get(self.i..)?)?;
            if self.peek()? == b'"' {
                self.i += 1;
                return Some(());
            }
            self.i += 2;
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
                            depth = depth.checked_sub(1)?;
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
