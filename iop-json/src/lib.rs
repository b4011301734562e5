//! Reading and rewriting JSON request bodies without a document tree, for the Edge and the
//! Node alike:
//!
//! - the skim ([`member_value`], [`for_target`], [`rewrite_model`]): where a top-level
//!   member's value sits, found by a forward pass that decodes and allocates nothing, and
//!   a body with its `"model"` replaced, every other byte untouched;
//! - [`last_member_value`]: the last member of a name, found from the object's end (an
//!   answer's `usage`, without reading the `choices` before it);
//! - [`member_start`], where a member's value begins, and [`first_user_message`], where
//!   a chat's first user message and its text sit, by the same skim;
//! - [`nonempty_array`], which reads an array's first bytes only;
//! - [`Object`]: a JSON object's top-level members borrowed from the input, and a body
//!   rewritten member by member from them;
//! - [`continuation`]: the body that continues a chat answer cut short, where that can
//!   be exact; [`read_chunk`] and [`rejoin_chunk`]: a chat stream's chunks read for what
//!   they deliver, and a continuation's chunks joined to the stream its caller has.
//!
//! Bodies are untrusted: nothing here panics or allocates beyond the input's size on any
//! input (the fuzz target for request reading covers the skim).

mod chunk;
mod continuation;
mod object;

use std::ops::Range;

use bytes::Bytes;
use serde_json::value::RawValue;

pub use chunk::{ChunkRead, Joined, read_chunk, rejoin_chunk};
pub use continuation::continuation;
pub use object::{Object, array, elements};

/// Replaces the value of the top-level `"model"` key in a JSON object, leaving every other
/// byte untouched (so a provider sees the caller's body exactly, but for the model it
/// serves). `None` when the body is not a JSON object with a `model` key.
#[must_use]
pub fn rewrite_model(raw: &[u8], target: &str) -> Option<Bytes> {
    splice(raw, member_value(raw, "model")?, target)
}

/// `raw` with the bytes at `value` replaced by `target` as a JSON string: quotes, and
/// escapes where JSON needs them.
fn splice(raw: &[u8], value: Range<usize>, target: &str) -> Option<Bytes> {
    let mut out = Vec::with_capacity(raw.len() + target.len() + 2);
    out.extend_from_slice(&raw[..value.start]);
    serde_json::to_writer(&mut out, target).ok()?;
    out.extend_from_slice(&raw[value.end..]);
    Some(Bytes::from(out))
}

/// The body a provider serving `target` is sent: `raw` with its top-level `"model"`
/// value replaced as [`rewrite_model`] does, or `raw` itself, sharing its bytes, when the
/// value is already `target` written the way the rewrite would write it (a model group
/// whose provider serves it under the public name: no copy of the body) or when there is
/// no such member to rewrite.
#[must_use]
pub fn for_target(raw: Bytes, target: &str) -> Bytes {
    let Some(value) = member_value(&raw, "model") else {
        return raw;
    };
    let written = &raw[value.clone()];
    // The splice's encoding of `target`: quotes around it, escapes where JSON needs them.
    let plain = !target.bytes().any(|b| b == b'"' || b == b'\\' || b < 0x20);
    let same = if plain {
        written.len() == target.len() + 2
            && written.first() == Some(&b'"')
            && written.last() == Some(&b'"')
            && &written[1..written.len() - 1] == target.as_bytes()
    } else {
        serde_json::to_vec(target).is_ok_and(|encoded| encoded == written)
    };
    if same {
        return raw;
    }
    splice(&raw, value, target).unwrap_or(raw)
}

/// Where the value of the first top-level member named `key` sits in `raw`, a JSON
/// object, found by skimming its structure: nothing is decoded or allocated (but a key
/// written with escapes), so it costs a pass over the bytes up to that member however
/// large the rest. A key matches however it is escaped. `None` when `raw` is not an
/// object (as far as the skim reaches) or has no such member; the text is not
/// validated beyond what the skim needs.
#[must_use]
pub fn member_value(raw: &[u8], key: &str) -> Option<std::ops::Range<usize>> {
    let mut scan = member(raw, key)?;
    let start = scan.i;
    scan.value()?;
    Some(start..scan.i)
}

/// Where the value of the first top-level member named `key` starts in `raw`, as
/// [`member_value`] finds it, without reading the value itself (a chat body's
/// `messages` are not skimmed to their end).
#[must_use]
pub fn member_start(raw: &[u8], key: &str) -> Option<usize> {
    member(raw, key).map(|scan| scan.i)
}

/// A scanner at the value of `raw`'s first top-level member named `key`.
fn member<'a>(raw: &'a [u8], key: &str) -> Option<Scanner<'a>> {
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
        if names(written, key) {
            return Some(scan);
        }
        scan.value()?;
        scan.ws();
        match scan.peek()? {
            b',' => scan.i += 1,
            _ => return None,
        }
    }
}

/// Whether `written`, a key as written (quotes included), names `key`. Written without
/// escapes, the key is its bytes; with them it is decoded: the key `"` is written `"\""`,
/// whose inner bytes spell another key, `\"`.
fn names(written: &[u8], key: &str) -> bool {
    if written.contains(&b'\\') {
        serde_json::from_slice::<String>(written).ok().as_deref() == Some(key)
    } else {
        written.get(1..written.len().saturating_sub(1)) == Some(key.as_bytes())
    }
}

/// Where the value of the last top-level member named `key` sits in `raw`, a JSON object
/// (a later member of a name wins, as serde keeps it). Found from the object's end: an
/// answer's `usage` comes last or nearly so, so the few members after it are read and
/// the `choices` before it are not. When the backward skim cannot read the text before
/// it finds the member (the text's end is not an object's; its start is not only that
/// object) the object is skimmed forward instead, and the last member named `key` found
/// before that skim stops is the one. Nothing is decoded or allocated (but a key written
/// with escapes); `None` when there is no such member as far as the skims reach. The text
/// is not validated beyond what the skims need: what comes before a member found from
/// the end is not read at all, so for a text that is not one object (cut after an inner
/// object's end, say) the member found may be one the forward skim would not find.
#[must_use]
pub fn last_member_value(raw: &[u8], key: &str) -> Option<Range<usize>> {
    match (Back {
        s: raw,
        i: raw.len(),
    })
    .last_member(key)
    {
        Some(found) => found,
        None => forward_last_member(raw, key),
    }
}

/// [`last_member_value`] by the forward skim: every member is read.
fn forward_last_member(raw: &[u8], key: &str) -> Option<Range<usize>> {
    let mut scan = Scanner { s: raw, i: 0 };
    let mut found = None;
    scan.ws();
    scan.eat(b'{')?;
    loop {
        scan.ws();
        if scan.peek() == Some(b'}') {
            return found;
        }
        let key_start = scan.i;
        if scan.string().is_none() {
            return found;
        }
        let written = &raw[key_start..scan.i];
        scan.ws();
        if scan.eat(b':').is_none() {
            return found;
        }
        scan.ws();
        let start = scan.i;
        if scan.value().is_none() {
            return found;
        }
        if names(written, key) {
            found = Some(start..scan.i);
        }
        scan.ws();
        if scan.eat(b',').is_none() {
            return found;
        }
    }
}

/// A backward JSON skimmer: reads `s[..i]` from its end. A string is skimmed from its
/// closing quote to the unescaped quote before it (a quote inside a string is always
/// preceded by an odd run of backslashes), so where strings lie is as certain read
/// backward as forward.
struct Back<'a> {
    s: &'a [u8],
    i: usize,
}

impl Skim for Back<'_> {
    const INTO: [u8; 2] = [b'}', b']'];
    const OUT: [u8; 2] = [b'{', b'['];

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i.checked_sub(1)?).copied()
    }

    fn step(&mut self) {
        self.i -= 1;
    }

    fn pos(&self) -> usize {
        self.i
    }

    fn string(&mut self) -> Option<()> {
        self.eat(b'"')?;
        loop {
            let quote = memchr::memrchr(b'"', self.s.get(..self.i)?)?;
            let before = self.s.get(..quote)?;
            let slashes = before.iter().rev().take_while(|&&b| b == b'\\').count();
            self.i = quote;
            if slashes % 2 == 0 {
                return Some(());
            }
        }
    }

    fn ends_scalar(b: u8) -> bool {
        matches!(
            b,
            b',' | b':' | b'{' | b'[' | b'}' | b']' | b'"' | b' ' | b'\t' | b'\r' | b'\n'
        )
    }
}

impl Back<'_> {
    /// The last member named `key`, `Some(None)` when the object has none, or `None` when
    /// the text cannot be read backward as one object.
    fn last_member(mut self, key: &str) -> Option<Option<Range<usize>>> {
        self.ws();
        self.eat(b'}')?;
        loop {
            self.ws();
            if self.peek() == Some(b'{') {
                // Only an empty object (or a comma before its brace, read forward).
                self.i -= 1;
                return self.at_start().then_some(None);
            }
            let end = self.i;
            self.value()?;
            let start = self.i;
            self.ws();
            self.eat(b':')?;
            self.ws();
            let key_end = self.i;
            self.string()?;
            if names(self.s.get(self.i..key_end)?, key) {
                return Some(Some(start..end));
            }
            self.ws();
            match self.peek()? {
                b',' => self.i -= 1,
                b'{' => {
                    self.i -= 1;
                    return self.at_start().then_some(None);
                }
                _ => return None,
            }
        }
    }

    /// Whether only whitespace is left: the object read is the whole text.
    fn at_start(&self) -> bool {
        self.s[..self.i]
            .iter()
            .all(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
    }
}

/// The first message of `messages` (a chat `messages` array, and whatever follows it)
/// whose `role` is `"user"`: where its object starts, and where its `content` string
/// sits (quotes included) when it is one. Members are read in any order; nothing is
/// decoded or allocated. `None` when the text is not an array of objects as far as the
/// skim reaches, or has no user message.
#[must_use]
pub fn first_user_message(messages: &[u8]) -> Option<(usize, Option<std::ops::Range<usize>>)> {
    let mut scan = Scanner { s: messages, i: 0 };
    scan.ws();
    scan.eat(b'[')?;
    loop {
        scan.ws();
        let start = scan.i;
        scan.eat(b'{')?;
        let (mut user, mut content) = (false, None);
        loop {
            scan.ws();
            match scan.peek()? {
                b'}' => {
                    scan.i += 1;
                    break;
                }
                b',' => {
                    scan.i += 1;
                    continue;
                }
                _ => {}
            }
            let key_start = scan.i;
            scan.string()?;
            let key = &messages[key_start..scan.i];
            scan.ws();
            scan.eat(b':')?;
            scan.ws();
            let value = scan.i;
            scan.value()?;
            match key {
                b"\"role\"" => user = &messages[value..scan.i] == b"\"user\"",
                b"\"content\"" if messages.get(value) == Some(&b'"') => {
                    content = Some(value..scan.i);
                }
                _ => {}
            }
        }
        if user {
            return Some((start, content));
        }
        scan.ws();
        scan.eat(b',')?;
    }
}

/// Whether `raw` is an array with at least one element. `raw` is validated JSON (a value
/// of a parsed document), so its first bytes decide it: the array is not parsed again
/// (for a chat body that would be most of the body a second time).
#[must_use]
pub fn nonempty_array(raw: &RawValue) -> bool {
    nonempty_array_text(raw.get())
}

/// [`nonempty_array`] of a value's JSON text, which must be validated JSON.
#[must_use]
pub fn nonempty_array_text(raw: &str) -> bool {
    raw.trim_ascii_start()
        .strip_prefix('[')
        .is_some_and(|rest| !rest.trim_ascii_start().starts_with(']'))
}

/// A forward-only JSON skimmer: enough to find where a top-level value starts and ends.
struct Scanner<'a> {
    s: &'a [u8],
    i: usize,
}

impl Skim for Scanner<'_> {
    const INTO: [u8; 2] = [b'{', b'['];
    const OUT: [u8; 2] = [b'}', b']'];

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn step(&mut self) {
        self.i += 1;
    }

    fn pos(&self) -> usize {
        self.i
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

    fn ends_scalar(b: u8) -> bool {
        matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\r' | b'\n')
    }
}

/// One direction of the skim: forward from a value's first byte ([`Scanner`]) or backward
/// from its last ([`Back`]). What a value is and where it ends is written once, here, for
/// both; a direction gives its steps, its strings and which bytes enter a container.
trait Skim {
    /// The bytes that enter a container when met in this direction (`{` and `[` forward,
    /// `}` and `]` backward).
    const INTO: [u8; 2];
    /// The bytes that leave one.
    const OUT: [u8; 2];

    /// The next byte in this direction.
    fn peek(&self) -> Option<u8>;

    /// Moves past the next byte.
    fn step(&mut self);

    /// Where the skim is.
    fn pos(&self) -> usize;

    /// Moves past the string whose quote is next.
    fn string(&mut self) -> Option<()>;

    /// Whether `b` ends a number or literal read in this direction.
    fn ends_scalar(b: u8) -> bool;

    fn eat(&mut self, b: u8) -> Option<()> {
        (self.peek()? == b).then(|| self.step())
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\r' | b'\n')) {
            self.step();
        }
    }

    /// Moves past the value that is next: a string, a container with everything in it, or
    /// a number or literal (at least one byte).
    fn value(&mut self) -> Option<()> {
        let first = self.peek()?;
        if first == b'"' {
            return self.string();
        }
        if Self::INTO.contains(&first) {
            let mut depth = 0usize;
            loop {
                let b = self.peek()?;
                if b == b'"' {
                    self.string()?;
                    continue;
                }
                if Self::INTO.contains(&b) {
                    depth += 1;
                } else if Self::OUT.contains(&b) {
                    depth = depth.checked_sub(1)?;
                    if depth == 0 {
                        self.step();
                        return Some(());
                    }
                }
                self.step();
            }
        }
        let start = self.pos();
        while self.peek().is_some_and(|b| !Self::ends_scalar(b)) {
            self.step();
        }
        (self.pos() != start).then_some(())
    }
}
