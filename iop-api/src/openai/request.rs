//! What the Edge reads of an inference request body, the prompt-size estimate, and the
//! byte-exact `model` rewrite of a tunnelled body.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::{ApiError, Endpoint};
use iop_json::nonempty_array_text;

mod plain;

/// The facts of a request body the Edge acts on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
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
    /// The most tokens it may generate (`max_completion_tokens`, else `max_tokens`), when
    /// it says (a key's tokens per minute count it at admission).
    pub max_tokens: Option<u64>,
    /// The session the body names, for placing the request by its conversation:
    /// `prompt_cache_key`, else `user` (the Messages API's `metadata.user_id`).
    pub session: Option<String>,
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
    #[serde(borrow)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    max_completion_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    prompt_cache_key: Option<&'a RawValue>,
    #[serde(borrow)]
    user: Option<&'a RawValue>,
}

/// The session `prompt_cache_key`, else `user`, names (a non-empty string, at most 256
/// bytes: a longer one is not a key).
pub(crate) fn session_of(
    prompt_cache_key: Option<&RawValue>,
    user: Option<&RawValue>,
) -> Option<String> {
    session_in(
        given(prompt_cache_key).map(RawValue::get),
        given(user).map(RawValue::get),
    )
}

/// A present, non-null field.
fn given(v: Option<&RawValue>) -> Option<&RawValue> {
    v.filter(|v| v.get() != "null")
}

/// Reads what the Edge needs from a request body, or the 400 to answer: the body must
/// be a JSON object with a string `model`, the endpoint's input (a non-empty `messages`
/// array for chat, a `prompt`, an `input`), and a boolean `stream` if any.
pub fn inspect(raw: &[u8], endpoint: Endpoint) -> Result<RequestFacts, ApiError> {
    // JSON text is UTF-8 (RFC 8259 section 8.1). Checked once here, so neither the parse
    // nor the token estimate validates it again (for CJK text each pass costs as much as
    // the parse).
    let text = utf8(raw)?;
    // One validating pass takes the members of a plainly written body (most bodies);
    // serde reads the rest, and says what is wrong with a body that is not JSON.
    match plain::members(text) {
        Some((members, prompt_tokens)) => facts(&members, prompt_tokens, endpoint),
        None => facts(&parse(text)?, estimate_text(text), endpoint),
    }
}

/// [`inspect`] by serde alone, as it read every body before the validating pass: the
/// reference the pass is tested against (equal on every input).
#[doc(hidden)]
pub fn inspect_by_serde(raw: &[u8], endpoint: Endpoint) -> Result<RequestFacts, ApiError> {
    let text = utf8(raw)?;
    facts(&parse(text)?, estimate_text(text), endpoint)
}

fn utf8(raw: &[u8]) -> Result<&str, ApiError> {
    std::str::from_utf8(raw)
        .map_err(|_| ApiError::bad_request("invalid JSON: the request body is not UTF-8", None))
}

/// The members serde reads, or the 400 for a body that is not a JSON object.
fn parse(text: &str) -> Result<Members<'_>, ApiError> {
    let head: Head<'_> = match serde_json::from_str(text) {
        Ok(head) => head,
        Err(err) if err.is_data() && text.trim_ascii_start().as_bytes().first() != Some(&b'{') => {
            return Err(ApiError::bad_request(
                "the request body must be a JSON object",
                None,
            ));
        }
        Err(err) => return Err(ApiError::bad_request(format!("invalid JSON: {err}"), None)),
    };
    Ok(Members {
        model: head.model.map(RawValue::get),
        stream: head.stream.map(RawValue::get),
        stream_options: head.stream_options.map(RawValue::get),
        messages: head.messages.map(RawValue::get),
        prompt: head.prompt.map(RawValue::get),
        input: head.input.map(RawValue::get),
        tools: head.tools.map(RawValue::get),
        max_tokens: head.max_tokens.map(RawValue::get),
        max_completion_tokens: head.max_completion_tokens.map(RawValue::get),
        prompt_cache_key: head.prompt_cache_key.map(RawValue::get),
        user: head.user.map(RawValue::get),
    })
}

/// The top-level members [`inspect`] decides on, each as the JSON text of its value (of
/// a validated body).
#[derive(Default)]
struct Members<'a> {
    model: Option<&'a str>,
    stream: Option<&'a str>,
    stream_options: Option<&'a str>,
    messages: Option<&'a str>,
    prompt: Option<&'a str>,
    input: Option<&'a str>,
    tools: Option<&'a str>,
    max_tokens: Option<&'a str>,
    max_completion_tokens: Option<&'a str>,
    prompt_cache_key: Option<&'a str>,
    user: Option<&'a str>,
}

/// What the members of a validated body (of `prompt_tokens`, [`estimate_tokens`]) say,
/// or the 400 to answer.
fn facts(
    m: &Members<'_>,
    prompt_tokens: u64,
    endpoint: Endpoint,
) -> Result<RequestFacts, ApiError> {
    fn given(v: Option<&str>) -> Option<&str> {
        v.filter(|v| *v != "null")
    }
    let model = given(m.model).and_then(string).ok_or_else(|| {
        ApiError::bad_request("you must provide a model parameter", Some("missing_model"))
    })?;
    let present = match endpoint {
        Endpoint::Chat | Endpoint::Tokenize => given(m.messages).is_some_and(nonempty_array_text),
        Endpoint::Completions => given(m.prompt).is_some(),
        Endpoint::Embeddings => given(m.input).is_some(),
    };
    if !present {
        return Err(ApiError::bad_request(
            format!(
                "missing or invalid required parameter: {}",
                super::input_field(endpoint)
            ),
            Some("invalid_value"),
        ));
    }
    let stream = match given(m.stream) {
        None | Some("false") => false,
        Some("true") => true,
        Some(_) => {
            return Err(ApiError::bad_request(
                "stream must be a boolean",
                Some("invalid_value"),
            ));
        }
    };
    #[derive(Deserialize)]
    struct StreamOptions {
        include_usage: Option<bool>,
    }
    let include_usage = given(m.stream_options)
        .and_then(|v| serde_json::from_str::<StreamOptions>(v).ok())
        .and_then(|o| o.include_usage)
        == Some(true);
    let wants_tools = given(m.tools).is_some_and(nonempty_array_text);
    // A count that is not one is the provider's to refuse; here it only weighs less.
    let max_tokens = given(m.max_completion_tokens)
        .or(given(m.max_tokens))
        .and_then(|v| v.parse::<u64>().ok());
    Ok(RequestFacts {
        model,
        stream,
        include_usage,
        wants_tools,
        prompt_tokens,
        max_tokens,
        session: session_in(given(m.prompt_cache_key), given(m.user)),
    })
}

/// The string a validated JSON value is, if it is one: a string written without escapes
/// is its text as it stands (no decoding, one copy).
fn string(value: &str) -> Option<String> {
    match value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
        Some(inner) if !inner.contains('\\') => Some(inner.to_owned()),
        _ => serde_json::from_str::<String>(value).ok(),
    }
}

/// The session `prompt_cache_key`, else `user`, names, from their values' JSON text.
fn session_in(prompt_cache_key: Option<&str>, user: Option<&str>) -> Option<String> {
    [prompt_cache_key, user].into_iter().find_map(|v| {
        let v = string(v?)?;
        (!v.is_empty() && v.len() <= 256).then_some(v)
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
    match std::str::from_utf8(raw) {
        Ok(text) => estimate_text(text),
        Err(_) => (raw.len() as u64).div_ceil(4),
    }
}

/// [`estimate_tokens`] of text already known to be UTF-8.
fn estimate_text(text: &str) -> u64 {
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
        let Some(stop) = est.string_run(text, at) else {
            break;
        };
        at = stop;
        match bytes.get(at) {
            None => break,
            Some(b'"') => {
                est.flush();
                est.in_string = false;
                at += 1;
            }
            Some(b'\\') => {
                est.escape();
                // The escaped character; after `u`, its four hex digits too.
                at += 1;
                let escaped = bytes.get(at).copied();
                at = skip_chars(text, at, 1);
                if escaped == Some(b'u') {
                    at = skip_chars(text, at, 4);
                }
            }
            // A control character: whitespace (tab, line feed...) or a symbol.
            Some(&control) => {
                est.flush();
                est.tokens += u64::from(!matches!(control, b'\t'..=b'\r'));
                at += 1;
            }
        }
    }
    est.flush();
    est.tokens + u64::from(est.number)
}

/// What a byte inside a JSON string is to [`estimate_tokens`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Digit,
    /// The space (the other ASCII whitespace is [`Class::Control`]).
    Space,
    Quote,
    Escape,
    /// A control character (which JSON writes escaped), whitespace ones included.
    Control,
    /// Any other ASCII character: punctuation, symbols, DEL.
    Symbol,
    /// The first or a later byte of a multi-byte character.
    NonAscii,
}

const CLASS: [Class; 256] = {
    let mut table = [Class::NonAscii; 256];
    let mut b = 0;
    while b < 128 {
        table[b] = match b as u8 {
            b'a'..=b'z' | b'A'..=b'Z' => Class::Letter,
            b'0'..=b'9' => Class::Digit,
            b' ' => Class::Space,
            0..0x20 => Class::Control,
            b'"' => Class::Quote,
            b'\\' => Class::Escape,
            _ => Class::Symbol,
        };
        b += 1;
    }
    table
};

/// How many bytes from `at` on are of `class`, a letter or digit run (at least the one at
/// `at`). Eight bytes are classified at once where the body has them (a word is rarely
/// longer, so one step usually finds its end).
fn run_of(bytes: &[u8], at: usize, class: Class) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    debug_assert!(
        matches!(class, Class::Letter | Class::Digit),
        "runs of letters or digits"
    );
    let mut end = at;
    while let Some(chunk) = bytes.get(end..end + 8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let x = u64::from_le_bytes(word);
        // Within ASCII (no high bit) a byte's high bit after adding `0x80 - lo` says it
        // is at least `lo`, and no sum carries into the next byte. A non-ASCII byte may
        // carry, but only into bytes after it, and it is itself outside the run.
        let (y, lo, hi) = match class {
            Class::Letter => (x | (0x20 * ONES), b'a', b'z'),
            _ => (x, b'0', b'9'),
        };
        let at_least_lo = y.wrapping_add(u64::from(0x80 - lo) * ONES);
        let above_hi = y.wrapping_add(u64::from(0x80 - hi - 1) * ONES);
        let outside = (!(at_least_lo & !above_hi) | x) & HIGH;
        if outside != 0 {
            // At least the byte at `at`, whatever the arithmetic says: a miscount, never
            // a scan that stops moving.
            return (end - at + (outside.trailing_zeros() / 8) as usize).max(1);
        }
        end += 8;
    }
    (end - at
        + bytes[end..]
            .iter()
            .position(|&b| CLASS[usize::from(b)] != class)
            .unwrap_or(bytes.len() - end))
    .max(1)
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
    /// Counts the text of a JSON string from `at` up to where it stops being plain: its
    /// closing quote, an escape, a control character, or the end of `text`; that place.
    /// ASCII, most of any body, is classified by a table and read a run at a time: a
    /// word's letters or a number's digits change the count only where they end. `None`
    /// where `at` falls inside a character (never, for a place the count reached).
    fn string_run(&mut self, text: &str, mut at: usize) -> Option<usize> {
        let bytes = text.as_bytes();
        while let Some(&b) = bytes.get(at) {
            match CLASS[usize::from(b)] {
                Class::Letter => {
                    let run = run_of(bytes, at, Class::Letter);
                    if self.digits > 0 {
                        self.flush();
                    }
                    self.word += run as u64;
                    at += run;
                }
                Class::Digit => {
                    let run = run_of(bytes, at, Class::Digit);
                    if self.word > 0 {
                        self.word += run as u64;
                    } else {
                        self.digits += run as u64;
                    }
                    at += run;
                }
                Class::Space => {
                    self.flush();
                    at += 1;
                }
                Class::Quote | Class::Escape | Class::Control => return Some(at),
                Class::Symbol => {
                    self.flush();
                    self.tokens += 1;
                    at += 1;
                }
                Class::NonAscii => {
                    // Ideographs, kana and Hangul are three bytes each, read here without
                    // the general decoding (`text` is UTF-8, so `at` starts a character).
                    if let Some(&[lead @ 0xE0..=0xEF, b1, b2]) = bytes.get(at..at + 3) {
                        let c = (u32::from(lead & 0x0F) << 12)
                            | (u32::from(b1 & 0x3F) << 6)
                            | u32::from(b2 & 0x3F);
                        if is_cjk_code(c) {
                            self.flush();
                            self.tokens += 1;
                            at += 3;
                            continue;
                        }
                        // CJK punctuation (、。「」), which `is_alphabetic` would look up in
                        // its slow tables: no whitespace but U+3000, few letters.
                        if let Some(bit) = c.checked_sub(0x3000).filter(|&bit| bit < 64) {
                            if CJK_PUNCTUATION_LETTERS >> bit & 1 == 1 {
                                self.letter();
                            } else {
                                self.flush();
                                self.tokens += u64::from(bit != 0) * 2;
                            }
                            at += 3;
                            continue;
                        }
                    }
                    let c = text.get(at..)?.chars().next()?;
                    at += c.len_utf8();
                    if is_cjk(c) {
                        // Checked first: cheaper than `is_alphabetic`, and it decides alone.
                        self.flush();
                        self.tokens += 1;
                    } else if c.is_alphabetic() {
                        self.letter();
                    } else if c.is_whitespace() {
                        self.flush();
                    } else {
                        self.flush();
                        self.tokens += if u32::from(c) < 0x2000 { 1 } else { 2 };
                    }
                }
            }
        }
        Some(at)
    }

    /// An escape sequence: a token of its own.
    fn escape(&mut self) {
        self.flush();
        self.tokens += 1;
    }

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
    is_cjk_code(u32::from(c))
}

/// Which of U+3000..=U+303F (CJK symbols and punctuation) are alphabetic, bit `n` for
/// U+3000 + `n`: the iteration and closing marks 々〆〇, the Hangzhou numerals 〡-〩,
/// the kana repeat marks 〱-〵 and 〸-〼 (Unicode's `Alphabetic`; a test checks every one
/// against `char::is_alphabetic`).
const CJK_PUNCTUATION_LETTERS: u64 =
    (0b111 << 0x05) | (0x1FF << 0x21) | (0x1F << 0x31) | (0x1F << 0x38);

/// [`is_cjk`] of a code point.
fn is_cjk_code(c: u32) -> bool {
    matches!(c,
        0x3040..=0x30FF // hiragana, katakana
        | 0x3400..=0x4DBF // CJK extension A
        | 0x4E00..=0x9FFF // CJK unified ideographs
        | 0xAC00..=0xD7AF // Hangul syllables
        | 0xF900..=0xFAFF // CJK compatibility ideographs
        | 0x20000..=0x2FFFF) // CJK extensions B and on
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cjk_punctuation_table_agrees_with_unicode() {
        for code in 0x3000..=0x303F_u32 {
            let c = char::from_u32(code).expect("a character");
            let bit = code - 0x3000;
            assert_eq!(
                CJK_PUNCTUATION_LETTERS >> bit & 1 == 1,
                c.is_alphabetic(),
                "U+{code:04X}"
            );
            assert_eq!(c.is_whitespace(), code == 0x3000, "U+{code:04X}");
            assert!(!is_cjk(c), "U+{code:04X} is read by the general path");
        }
    }
}
