//! One validating pass over a request body that takes the top-level members
//! [`super::inspect`] decides on and counts the prompt's tokens as it goes, where serde's
//! derive and then the estimate's own pass cost the Edge about 3,000 instructions for a
//! 74-byte chat body (BENCHMARKS.md).
//!
//! It accepts a subset of what serde accepts, never more: where it says `None` the body
//! goes to serde, which reads it or says what is wrong with it. Left to serde are a body
//! that is not valid JSON, one nested deeper than [`MAX_DEPTH`], a `\u` escape of a
//! surrogate (serde's reading of those depends on where they sit), a key written with
//! escapes, and a member it decides on given twice (serde refuses that). So on any input
//! [`super::inspect`] answers as serde alone would (`inspect_by_serde`, held to it by the
//! tests).

use super::{Estimate, Members};

/// Deepest nesting the pass reads (serde's own limit is 128).
const MAX_DEPTH: u32 = 100;

/// The members of `text`, a JSON object, and its [`super::estimate_tokens`], when the
/// pass reads it whole; `None` to leave it to serde.
pub(super) fn members(text: &str) -> Option<(Members<'_>, u64)> {
    let mut pass = Pass {
        text,
        b: text.as_bytes(),
        i: 0,
        est: Estimate::default(),
    };
    let mut members = Members::default();
    pass.ws();
    pass.eat(b'{')?;
    pass.items(b'}', |pass| {
        let key = pass.key()?;
        let value = pass.member_value(1)?;
        // serde refuses a member it reads given twice.
        let taken = slot(&mut members, key).and_then(|slot| slot.replace(value));
        taken.is_none().then_some(())
    })?;
    pass.ws();
    (pass.i == pass.b.len()).then(|| {
        pass.est.flush();
        (members, pass.est.tokens)
    })
}

/// Where the member named `key` (as written, without escapes) goes, if it is one
/// [`super::inspect`] decides on.
fn slot<'m, 'a>(members: &'m mut Members<'a>, key: &[u8]) -> Option<&'m mut Option<&'a str>> {
    Some(match key {
        b"model" => &mut members.model,
        b"stream" => &mut members.stream,
        b"stream_options" => &mut members.stream_options,
        b"messages" => &mut members.messages,
        b"prompt" => &mut members.prompt,
        b"input" => &mut members.input,
        b"tools" => &mut members.tools,
        b"max_tokens" => &mut members.max_tokens,
        b"max_completion_tokens" => &mut members.max_completion_tokens,
        b"prompt_cache_key" => &mut members.prompt_cache_key,
        b"user" => &mut members.user,
        _ => return None,
    })
}

struct Pass<'a> {
    text: &'a str,
    b: &'a [u8],
    i: usize,
    /// The token count, as [`super::estimate_tokens`] reads the same text: each string
    /// counted as it is validated, each run of a number's digits one token.
    est: Estimate,
}

impl<'a> Pass<'a> {
    fn next(&mut self) -> Option<u8> {
        let b = *self.b.get(self.i)?;
        self.i += 1;
        Some(b)
    }

    fn eat(&mut self, want: u8) -> Option<()> {
        (self.b.get(self.i) == Some(&want)).then(|| self.i += 1)
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.b.get(self.i) {
            self.i += 1;
        }
    }

    /// A member's key, without its quotes; `None` for one written with escapes.
    fn key(&mut self) -> Option<&'a [u8]> {
        let b = self.b;
        let start = self.i + 1;
        if self.string()? {
            return None;
        }
        b.get(start..self.i - 1)
    }

    /// A string from its opening quote; whether it holds escapes.
    fn string(&mut self) -> Option<bool> {
        self.eat(b'"')?;
        let mut escaped = false;
        loop {
            self.i = self.est.string_run(self.text, self.i)?;
            match self.next()? {
                b'"' => {
                    self.est.flush();
                    return Some(escaped);
                }
                b'\\' => {
                    escaped = true;
                    self.est.escape();
                    match self.next()? {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
                        b'u' => {
                            let hex = self.b.get(self.i..self.i + 4)?;
                            let code = hex.iter().try_fold(0u32, |code, &h| {
                                Some(code << 4 | char::from(h).to_digit(16)?)
                            })?;
                            if (0xD800..0xE000).contains(&code) {
                                return None;
                            }
                            self.i += 4;
                        }
                        _ => return None,
                    }
                }
                // A control character.
                _ => return None,
            }
        }
    }

    /// Any value, at nesting `depth`.
    fn value(&mut self, depth: u32) -> Option<()> {
        match *self.b.get(self.i)? {
            b'"' => self.string().map(drop),
            b'{' => {
                self.deeper(depth)?;
                self.i += 1;
                self.items(b'}', |pass| {
                    pass.string()?;
                    pass.member_value(depth + 1).map(drop)
                })
            }
            b'[' => {
                self.deeper(depth)?;
                self.i += 1;
                self.items(b']', |pass| pass.value(depth + 1))
            }
            b't' => self.word(b"true"),
            b'f' => self.word(b"false"),
            b'n' => self.word(b"null"),
            _ => self.number(),
        }
    }

    /// The items of an object or array whose opening byte was read, to its `close`:
    /// `item` reads one, and a comma or `close` follows each (none after the last).
    /// Inlined, as this and [`Pass::member_value`] were written out in place before: as
    /// calls they cost every small request about 120 instructions more.
    #[inline(always)]
    fn items(&mut self, close: u8, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.ws();
        if self.eat(close).is_some() {
            return Some(());
        }
        loop {
            item(self)?;
            self.ws();
            match self.next()? {
                b',' => self.ws(),
                b if b == close => return Some(()),
                _ => return None,
            }
        }
    }

    /// A member's `:` and value, at nesting `depth`; the value's text.
    #[inline(always)]
    fn member_value(&mut self, depth: u32) -> Option<&'a str> {
        self.ws();
        self.eat(b':')?;
        self.ws();
        let start = self.i;
        self.value(depth)?;
        self.text.get(start..self.i)
    }

    fn deeper(&self, depth: u32) -> Option<()> {
        (depth < MAX_DEPTH).then_some(())
    }

    fn word(&mut self, word: &[u8]) -> Option<()> {
        let end = self.i + word.len();
        (self.b.get(self.i..end)? == word).then(|| self.i = end)
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`
    fn number(&mut self) -> Option<()> {
        let _ = self.eat(b'-');
        match self.next()? {
            b'0' => {}
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        self.est.tokens += 1;
        if self.eat(b'.').is_some() {
            self.some_digits()?;
        }
        if let Some(b'e' | b'E') = self.b.get(self.i) {
            self.i += 1;
            if let Some(b'+' | b'-') = self.b.get(self.i) {
                self.i += 1;
            }
            self.some_digits()?;
        }
        // serde refuses a number run into a digit or letter (`01`, `1x`); those fall to
        // it, as anything after a value but `,` `]` `}` and whitespace does.
        Some(())
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.b.get(self.i) {
            self.i += 1;
        }
    }

    /// A run of digits after `.` or an exponent: a token of the estimate.
    fn some_digits(&mut self) -> Option<()> {
        let start = self.i;
        self.digits();
        self.est.tokens += 1;
        (self.i > start).then_some(())
    }
}
