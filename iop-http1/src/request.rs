//! Request heads, server side (RFC 9112 §2-3, §6, §9.3): found, parsed, and what their
//! fields decide about the body and the connection.

use std::ops::Range;

use crate::body::{Chunk, Framing};
use crate::head::{
    HeadError, HeadReader, content_length, encode_content_length, find_blank_line, lists_token,
    span,
};

/// The most header fields a request head may carry.
pub const MAX_REQUEST_HEADERS: usize = 100;

/// A parsed request head: where its parts lie in the bytes it was parsed from, and what
/// its fields decide about the body and the connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    /// Bytes of the head, the blank line that ends it included.
    pub len: usize,
    /// The method token.
    pub method: Range<usize>,
    /// The request target, as sent.
    pub target: Range<usize>,
    /// HTTP/1.0 (else 1.1).
    pub http10: bool,
    /// Each field's name and value, in the order sent: every name a token
    /// ([`is_token`]), every value a field value ([`is_field_value`]); a head with any
    /// other field is refused.
    pub fields: Vec<(Range<usize>, Range<usize>)>,
    /// How the body is framed.
    pub body: Framing,
    /// Whether the client lets the connection carry another request after this one.
    pub keep_alive: bool,
    /// `Expect: 100-continue`: the client waits for an interim answer before the body.
    pub expect_continue: bool,
}

/// The HTTP/2 connection preface (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What the first bytes of a plaintext connection say it speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opening {
    /// Not enough bytes yet to tell (none, or a prefix of the HTTP/2 preface).
    Undecided,
    /// HTTP/2 with prior knowledge (h2c): the whole preface is in.
    Http2,
    /// Anything else is read as HTTP/1.x (and refused as such if it is not).
    Http1,
}

/// What a plaintext connection that sent `first` speaks.
#[must_use]
pub fn opening(first: &[u8]) -> Opening {
    let seen = first.len().min(H2_PREFACE.len());
    if first.is_empty() || (seen < H2_PREFACE.len() && H2_PREFACE.starts_with(first)) {
        Opening::Undecided
    } else if first.starts_with(H2_PREFACE) {
        Opening::Http2
    } else {
        Opening::Http1
    }
}

impl HeadReader {
    /// The head at the start of `buf` once it is complete; `None` until then. After a
    /// head is returned (or the buffer's start is consumed otherwise), call [`Self::reset`].
    pub fn poll(&mut self, buf: &[u8]) -> Result<Option<RequestHead>, HeadError> {
        // Leading empty lines before a request line are ignored (RFC 9112 §2.2).
        let start = buf
            .iter()
            .position(|b| !matches!(b, b'\r' | b'\n'))
            .unwrap_or(buf.len());
        // Three bytes back, so a terminator split across reads is found.
        let from = self.scanned.saturating_sub(3).max(start).min(buf.len());
        let end = find_blank_line(&buf[from..]).map(|at| from + at);
        self.scanned = buf.len();
        let Some(end) = end else {
            return if buf.len() > self.max_head {
                Err(HeadError::TooLarge)
            } else {
                Ok(None)
            };
        };
        if end > self.max_head {
            return Err(HeadError::TooLarge);
        }
        parse_request_head(&buf[..end]).map(Some)
    }
}

/// Parses a complete request head (`head` ends with its blank line).
fn parse_request_head(head: &[u8]) -> Result<RequestHead, HeadError> {
    let mut slots = [std::mem::MaybeUninit::<httparse::Header<'_>>::uninit(); MAX_REQUEST_HEADERS];
    let mut parsed = httparse::Request::new(&mut []);
    let len = match parsed.parse_with_uninit_headers(head, &mut slots) {
        Ok(httparse::Status::Complete(len)) => len,
        // The blank line is in `head`, so httparse has all it needs.
        Ok(httparse::Status::Partial) => return Err(HeadError::Malformed("incomplete head")),
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooLarge),
        Err(httparse::Error::Version) => {
            return Err(HeadError::Malformed("unsupported HTTP version"));
        }
        Err(_) => return Err(HeadError::Malformed("invalid request head")),
    };
    let range = |part: &[u8]| span(head, part).ok_or(HeadError::Malformed("invalid request head"));
    let (Some(method), Some(target), Some(minor)) = (parsed.method, parsed.path, parsed.version)
    else {
        return Err(HeadError::Malformed("invalid request line"));
    };
    let http10 = minor == 0;
    let mut fields = Vec::with_capacity(parsed.headers.len());
    let mut length: Option<u64> = None;
    let mut coded = false;
    let mut chunked = false;
    let mut close = false;
    let mut keep_alive_token = false;
    let mut expect_continue = false;
    for field in parsed.headers.iter() {
        fields.push((range(field.name.as_bytes())?, range(field.value)?));
        let name = field.name.as_bytes();
        let value = field.value;
        if name.eq_ignore_ascii_case(b"content-length") {
            content_length(value, &mut length)?;
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            // Only `chunked`, alone: every coding listed is one the body was encoded with.
            for coding in value.split(|b| *b == b',').map(<[u8]>::trim_ascii) {
                if coding.is_empty() {
                    continue;
                }
                if chunked || !coding.eq_ignore_ascii_case(b"chunked") {
                    return Err(HeadError::UnsupportedCoding);
                }
                chunked = true;
            }
            coded = true;
        } else if name.eq_ignore_ascii_case(b"connection") {
            close |= lists_token(value, "close");
            keep_alive_token |= lists_token(value, "keep-alive");
        } else if name.eq_ignore_ascii_case(b"expect") {
            expect_continue |= value.trim_ascii().eq_ignore_ascii_case(b"100-continue");
        }
    }
    let body = if coded {
        if http10 {
            return Err(HeadError::Malformed("transfer-encoding on HTTP/1.0"));
        }
        if length.is_some() {
            return Err(HeadError::Malformed(
                "both content-length and transfer-encoding",
            ));
        }
        if !chunked {
            return Err(HeadError::UnsupportedCoding);
        }
        Framing::Chunked(Chunk::Size)
    } else {
        match length {
            Some(0) | None => Framing::Empty,
            Some(n) => Framing::Length(n),
        }
    };
    let keep_alive = !close && (!http10 || keep_alive_token);
    Ok(RequestHead {
        len,
        method: range(method.as_bytes())?,
        target: range(target.as_bytes())?,
        http10,
        fields,
        body,
        keep_alive,
        expect_continue: expect_continue && !http10,
    })
}

// ----- request heads, client side -----

/// Why a request head cannot be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// The method is not a token.
    #[error("invalid method")]
    Method,
    /// The target is not origin-form: a `/` first, visible ASCII, no `#`.
    #[error("invalid request target")]
    Target,
}

/// Whether `text` is a token (RFC 9110 §5.6.2), what a method and a field name are.
#[must_use]
pub fn is_token(text: &[u8]) -> bool {
    !text.is_empty() && text.iter().all(|&b| TOKEN[usize::from(b)])
}

/// Which bytes a token may hold (RFC 9110 `tchar`), one look-up per byte.
static TOKEN: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        #[allow(clippy::cast_possible_truncation)]
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric()
            || matches!(
                c,
                b'!' | b'#'
                    | b'$'
                    | b'%'
                    | b'&'
                    | b'\''
                    | b'*'
                    | b'+'
                    | b'-'
                    | b'.'
                    | b'^'
                    | b'_'
                    | b'`'
                    | b'|'
                    | b'~'
            );
        b += 1;
    }
    table
};

/// Whether `value` can be written as a field value: no control character but HTAB, so
/// no CR, LF or NUL can end the line and start another.
#[must_use]
pub fn is_field_value(value: &[u8]) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    let byte = |b: &u8| *b == b'\t' || (*b >= 0x20 && *b != 0x7f);
    // Eight bytes at a time (every request to a provider writes its fields): whether a
    // byte is below 0x20 or is DEL, exactly (bytes from 0x80 are allowed, and never
    // counted as below). A chunk with one is looked at byte by byte: it may be a tab.
    let below = |v: u64, n: u8| v.wrapping_sub(ONES * u64::from(n)) & !v & HIGHS != 0;
    let mut chunks = value.chunks_exact(8);
    for chunk in &mut chunks {
        let Ok(eight) = <[u8; 8]>::try_from(chunk) else {
            return false;
        };
        let v = u64::from_le_bytes(eight);
        if (below(v, 0x20) || below(v ^ (ONES * 0x7f), 1)) && !chunk.iter().all(byte) {
            return false;
        }
    }
    chunks.remainder().iter().all(byte)
}

/// Writes a request line: `method` and the origin-form target that `target`'s parts make
/// when joined. Nothing is written unless the method is a token and the target starts
/// with `/` and is visible ASCII without `#` (so no space, CR or LF can split the
/// request).
pub fn encode_request_line(
    method: &str,
    target: &[&str],
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    if !is_token(method.as_bytes()) {
        return Err(EncodeError::Method);
    }
    let mut bytes = target.iter().flat_map(|part| part.bytes());
    if bytes.next() != Some(b'/') || !bytes.all(|b| b.is_ascii_graphic() && b != b'#') {
        return Err(EncodeError::Target);
    }
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    for part in target {
        out.extend_from_slice(part.as_bytes());
    }
    out.extend_from_slice(b" HTTP/1.1\r\n");
    Ok(())
}

/// Writes the field line `name: value` when the name is a token and the value a field
/// value; whether it was written (a field that is not is left out).
pub fn encode_field(name: &[u8], value: &[u8], out: &mut Vec<u8>) -> bool {
    if !is_token(name) || !is_field_value(value) {
        return false;
    }
    out.reserve(name.len() + value.len() + 4);
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
    true
}

/// Ends a request head for a body of `body_len` bytes: its `content-length` (also `0` for
/// a method that carries a body; a bodiless `GET`, `HEAD`, `DELETE` or `OPTIONS` sends
/// none), then the blank line.
pub fn finish_request_head(method: &str, body_len: u64, out: &mut Vec<u8>) {
    let bodiless = ["GET", "HEAD", "DELETE", "OPTIONS"].contains(&method);
    if body_len > 0 || !bodiless {
        encode_content_length(body_len, out);
    }
    out.extend_from_slice(b"\r\n");
}

/// The interim answer to `Expect: 100-continue`.
pub const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_holds_exactly_the_tchars_of_rfc_9110() {
        for b in 0..=255u8 {
            let tchar = b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
            assert_eq!(is_token(&[b]), tchar, "byte {b:#04x}");
            assert_eq!(is_token(&[b'a', b, b'z']), tchar, "byte {b:#04x}");
        }
        assert!(!is_token(b""));
    }

    #[test]
    fn a_field_value_is_read_eight_bytes_at_a_time_as_byte_by_byte() {
        let bytewise = |value: &[u8]| {
            value
                .iter()
                .all(|&b| b == b'\t' || (b >= 0x20 && b != 0x7f))
        };
        for len in 1..20 {
            for at in 0..len {
                for b in 0..=255u8 {
                    for fill in [b'a', 0x80, b'\t', 0xff] {
                        let mut value = vec![fill; len];
                        value[at] = b;
                        assert_eq!(
                            is_field_value(&value),
                            bytewise(&value),
                            "{b:#04x} at {at} of {len} among {fill:#04x}"
                        );
                    }
                }
            }
        }
    }

    fn head(text: &str) -> Result<Option<RequestHead>, HeadError> {
        HeadReader::new(8192).poll(text.as_bytes())
    }

    #[test]
    fn a_request_head_is_parsed_with_its_framing_and_connection() {
        let text =
            "POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello";
        let parsed = head(text).unwrap().unwrap();
        assert_eq!(&text[parsed.method.clone()], "POST");
        assert_eq!(&text[parsed.target.clone()], "/v1/chat/completions");
        assert_eq!(parsed.len, text.len() - 5);
        assert_eq!(parsed.body, Framing::Length(5));
        assert!(parsed.keep_alive && !parsed.http10 && !parsed.expect_continue);
        let names: Vec<&str> = parsed
            .fields
            .iter()
            .map(|(n, _)| &text[n.clone()])
            .collect();
        assert_eq!(names, ["Host", "Content-Length"]);
    }

    #[test]
    fn framing_and_connection_fields_decide_as_rfc_9112_says() {
        // (head fields, HTTP/1.0?, expected framing or status, keep-alive)
        let cases: [(&str, bool, Result<Framing, u16>, bool); 16] = [
            ("", false, Ok(Framing::Empty), true),
            ("", true, Ok(Framing::Empty), false),
            ("connection: keep-alive\r\n", true, Ok(Framing::Empty), true),
            ("connection: close\r\n", false, Ok(Framing::Empty), false),
            (
                "connection: upgrade, Close\r\n",
                false,
                Ok(Framing::Empty),
                false,
            ),
            ("content-length: 0\r\n", false, Ok(Framing::Empty), true),
            (
                "content-length: 7, 7\r\ncontent-length: 7\r\n",
                false,
                Ok(Framing::Length(7)),
                true,
            ),
            (
                "content-length: 7\r\ncontent-length: 8\r\n",
                false,
                Err(400),
                true,
            ),
            ("content-length: +7\r\n", false, Err(400), true),
            (
                "content-length: 99999999999999999999\r\n",
                false,
                Err(400),
                true,
            ),
            (
                "transfer-encoding: Chunked\r\n",
                false,
                Ok(Framing::Chunked(Chunk::Size)),
                true,
            ),
            (
                "transfer-encoding: chunked\r\ncontent-length: 5\r\n",
                false,
                Err(400),
                true,
            ),
            (
                "transfer-encoding: gzip, chunked\r\n",
                false,
                Err(501),
                true,
            ),
            (
                "transfer-encoding: chunked, chunked\r\n",
                false,
                Err(501),
                true,
            ),
            ("transfer-encoding: identity\r\n", false, Err(501), true),
            ("transfer-encoding: chunked\r\n", true, Err(400), true),
        ];
        for (fields, http10, want, keep) in cases {
            let version = if http10 { "1.0" } else { "1.1" };
            let text = format!("POST / HTTP/{version}\r\n{fields}\r\n");
            match (head(&text), want) {
                (Ok(Some(parsed)), Ok(framing)) => {
                    assert_eq!(parsed.body, framing, "{text:?}");
                    assert_eq!(parsed.keep_alive, keep, "{text:?}");
                }
                (Err(err), Err(status)) => assert_eq!(err.status(), status, "{text:?}"),
                (got, _) => panic!("{text:?}: {got:?}"),
            }
        }
    }

    #[test]
    fn heads_past_the_limits_and_broken_heads_are_refused() {
        let mut reader = HeadReader::new(64);
        assert_eq!(
            reader.poll(&[b'a'; 65]),
            Err(HeadError::TooLarge),
            "no end in sight"
        );
        let long = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(60));
        assert_eq!(
            HeadReader::new(64).poll(long.as_bytes()),
            Err(HeadError::TooLarge)
        );
        let many: String = (0..=MAX_REQUEST_HEADERS)
            .map(|i| format!("x-{i}: v\r\n"))
            .collect();
        let text = format!("GET / HTTP/1.1\r\n{many}\r\n");
        assert_eq!(head(&text), Err(HeadError::TooLarge));
        for broken in [
            "GET / HTTP/2.0\r\n\r\n",
            "GET /\r\n\r\n",
            "G@T / HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nbad header\r\n\r\n",
            "GET / HTTP/1.1\r\nx: a\r\n folded\r\n\r\n",
            "GET /a b HTTP/1.1\r\n\r\n",
        ] {
            assert_eq!(
                head(broken).map_err(HeadError::status),
                Err(400),
                "{broken:?}"
            );
        }
        // Empty lines before the request line are skipped.
        assert!(head("\r\n\r\nGET / HTTP/1.1\r\n\r\n").unwrap().is_some());
    }

    #[test]
    fn a_connection_opening_with_the_h2_preface_speaks_http2() {
        let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
        for cut in 0..preface.len() {
            assert_eq!(opening(&preface[..cut]), Opening::Undecided, "{cut} bytes");
        }
        assert_eq!(opening(preface), Opening::Http2);
        assert_eq!(
            opening(&[&preface[..], b"\0\0\x04"].concat()),
            Opening::Http2
        );
        assert_eq!(opening(b"POST /v1 HTTP/1.1\r\n"), Opening::Http1);
        assert_eq!(opening(b"PRI * HTTP/1.1\r\n"), Opening::Http1);
    }

    #[test]
    fn a_request_head_written_cannot_be_split_by_what_it_carries() {
        let mut out = Vec::new();
        encode_request_line("POST", &["/base", "/v1/chat?x=1"], &mut out).unwrap();
        assert!(encode_field(b"x-a", b"b\tc", &mut out));
        for (name, value) in [
            (&b"x-split"[..], &b"a\r\nx-injected: 1"[..]),
            (b"x-nul", b"a\0"),
            (b"bad name", b"v"),
            (b"", b"v"),
        ] {
            assert!(!encode_field(name, value, &mut out), "{name:?}");
        }
        finish_request_head("POST", 0, &mut out);
        assert_eq!(
            out,
            b"POST /base/v1/chat?x=1 HTTP/1.1\r\nx-a: b\tc\r\ncontent-length: 0\r\n\r\n"
        );
        let mut get = Vec::new();
        finish_request_head("GET", 0, &mut get);
        assert_eq!(get, b"\r\n", "a bodiless GET says no length");
        for (method, target) in [
            ("NOT A METHOD", &["/"][..]),
            ("", &["/"]),
            ("GET", &["health"]),
            ("GET", &["", "health"]),
            ("GET", &["/a b"]),
            ("GET", &["/a\r\nx: y"]),
            ("GET", &["/a#frag"]),
            ("GET", &["/é"]),
            ("GET", &[]),
        ] {
            let mut out = Vec::new();
            assert!(
                encode_request_line(method, target, &mut out).is_err(),
                "{method:?} {target:?}"
            );
            assert!(out.is_empty(), "nothing written");
        }
    }

    #[test]
    fn a_head_in_pieces_is_found_once_it_is_whole() {
        let text = b"POST /x HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 3\r\n\r\nabc";
        for step in 1..text.len() {
            let mut reader = HeadReader::new(8192);
            let mut found = None;
            let mut have = 0;
            while found.is_none() && have < text.len() {
                have = (have + step).min(text.len());
                found = reader.poll(&text[..have]).unwrap();
            }
            let parsed = found.expect("found");
            assert_eq!(parsed.len, text.len() - 3, "step {step}");
            assert!(parsed.expect_continue);
        }
    }
}
