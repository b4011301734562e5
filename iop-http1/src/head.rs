//! What request and response heads share: the reader that finds a head's end in a read
//! buffer (its [`HeadReader::poll`] for requests is in [`crate::request`], its
//! [`HeadReader::poll_response`] in [`crate::response`]), why a head is refused, and the
//! field helpers both sides use.

/// Why a request head is refused; the connection is closed after the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    /// The head is longer than the limit, or has more than [`crate::MAX_REQUEST_HEADERS`] fields.
    #[error("request header fields too large")]
    TooLarge,
    /// The head does not parse as HTTP/1.x.
    #[error("malformed request: {0}")]
    Malformed(&'static str),
    /// The body is framed by a transfer coding other than `chunked` alone.
    #[error("transfer coding not implemented")]
    UnsupportedCoding,
}

impl HeadError {
    /// The status to answer with.
    #[must_use]
    pub fn status(self) -> u16 {
        match self {
            HeadError::TooLarge => 431,
            HeadError::Malformed(_) => 400,
            HeadError::UnsupportedCoding => 501,
        }
    }
}

/// Finds and parses request heads in a connection's read buffer. The buffer is searched
/// for the blank line that ends a head only past what earlier calls searched, and parsed
/// once that line is in, so a head sent a byte at a time costs one pass, not one per byte.
#[derive(Debug, Clone)]
pub struct HeadReader {
    pub(crate) max_head: usize,
    pub(crate) scanned: usize,
}

impl HeadReader {
    /// A reader that refuses heads longer than `max_head` bytes.
    #[must_use]
    pub fn new(max_head: usize) -> Self {
        HeadReader {
            max_head,
            scanned: 0,
        }
    }

    /// Starts over for the next head (the buffer's start moved).
    pub fn reset(&mut self) {
        self.scanned = 0;
    }
}

/// The end of the first blank line in `buf` (CRLF CRLF or LF LF, which httparse also
/// accepts, and the mixed forms), just past it.
///
/// A blank line is a line feed followed by another or by CRLF, so the first one is the
/// earlier of the first `\n\r\n` and the first `\n\n`: two vectorised searches (the
/// second only as far as the first's find), where a search for each line's feed in
/// turn cost a call per line of the head.
pub(crate) fn find_blank_line(buf: &[u8]) -> Option<usize> {
    use memchr::memmem::Finder;
    use std::sync::LazyLock;
    static LF_CRLF: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\n\r\n"));
    static LF_LF: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\n\n"));
    let crlf = LF_CRLF.find(buf);
    // A `\n\n` that begins at or after `crlf`'s start cannot come first.
    let before = crlf.map_or(buf.len(), |at| (at + 1).min(buf.len()));
    match LF_LF.find(&buf[..before]) {
        Some(at) => Some(at + 2),
        None => crlf.map(|at| at + 3),
    }
}

/// Whether a comma-separated field value lists `token` (case-insensitive).
#[must_use]
pub fn lists_token(value: &[u8], token: &str) -> bool {
    value
        .split(|b| *b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// Where `part`, a slice the parser returned, lies in `head`; `None` if it does not lie
/// there (the parser's slices always do: checked, so that a change in a dependency
/// becomes a refused head, not an out-of-bounds panic).
pub(crate) fn span(head: &[u8], part: &[u8]) -> Option<std::ops::Range<usize>> {
    let at = (part.as_ptr() as usize).checked_sub(head.as_ptr() as usize)?;
    let end = at.checked_add(part.len())?;
    (end <= head.len()).then_some(at..end)
}

/// Folds one `Content-Length` field into what earlier ones said: a comma-separated list
/// of one length, repeated (RFC 9110 §8.6); a value that is not a length, or that
/// disagrees with one seen before, refuses the head (a smuggling vector).
pub(crate) fn content_length(value: &[u8], seen: &mut Option<u64>) -> Result<(), HeadError> {
    for part in value.split(|b| *b == b',') {
        let n = decimal(part.trim_ascii()).ok_or(HeadError::Malformed("invalid content-length"))?;
        if seen.is_some_and(|earlier| earlier != n) {
            return Err(HeadError::Malformed("conflicting content-length values"));
        }
        *seen = Some(n);
    }
    Ok(())
}

/// A `Content-Length` value: decimal digits only, no sign, no overflow.
fn decimal(text: &[u8]) -> Option<u64> {
    if text.is_empty() || text.len() > 19 {
        return None;
    }
    text.iter().try_fold(0u64, |n, &b| {
        b.is_ascii_digit().then(|| n * 10 + u64::from(b - b'0'))
    })
}

/// Writes the field line `content-length: <len>` (a head's, request or response).
pub fn encode_content_length(len: u64, out: &mut Vec<u8>) {
    let mut buf = [0u8; 20];
    out.extend_from_slice(b"content-length: ");
    out.extend_from_slice(decimal_text(&mut buf, len));
    out.extend_from_slice(b"\r\n");
}

/// `n` in decimal, written into the end of `buf` (20 digits hold any `u64`).
pub(crate) fn decimal_text(buf: &mut [u8; 20], mut n: u64) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::find_blank_line;
    use proptest::prelude::*;

    /// The blank line found line by line: each line feed in turn, followed by another
    /// or by CRLF.
    fn line_by_line(buf: &[u8]) -> Option<usize> {
        memchr::memchr_iter(b'\n', buf).find_map(|at| {
            let rest = &buf[at + 1..];
            if rest.starts_with(b"\n") {
                Some(at + 2)
            } else if rest.starts_with(b"\r\n") {
                Some(at + 3)
            } else {
                None
            }
        })
    }

    #[test]
    fn the_first_blank_line_of_each_form_is_found() {
        for (text, end) in [
            (&b"GET / HTTP/1.1\r\nhost: a\r\n\r\nbody"[..], Some(27)),
            (b"GET / HTTP/1.1\nhost: a\n\nbody", Some(24)),
            (b"a\n\r\n\n\n", Some(4)),
            (b"a\n\n\r\n", Some(3)),
            (b"a\r\nb\r\n\r", None),
            (b"\n\n", Some(2)),
            (b"\n", None),
            (b"", None),
        ] {
            assert_eq!(
                find_blank_line(text),
                end,
                "{:?}",
                String::from_utf8_lossy(text)
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]
        /// Heads made of line feeds, carriage returns and text, in any mix: the same end
        /// as the search line by line.
        #[test]
        fn the_blank_line_is_where_a_search_line_by_line_finds_it(
            buf in proptest::collection::vec(prop_oneof![Just(b'\n'), Just(b'\r'), Just(b'a')], 0..64)
        ) {
            prop_assert_eq!(find_blank_line(&buf), line_by_line(&buf));
        }
    }
}
