//! Response heads: read on the client side (RFC 9112 §6.3, §9.3) and written on the
//! server side, with their body's framing and chunks.

use std::ops::Range;

use crate::body::{Chunk, Framing};
use crate::head::{
    HeadError, HeadReader, content_length, encode_content_length, find_blank_line, lists_token,
    span,
};

/// The most header fields a response head may carry.
pub const MAX_RESPONSE_HEADERS: usize = 128;

/// A parsed response head: where its fields lie in the bytes it was parsed from, and what
/// they decide about the body and the connection (RFC 9112 §6.3, §9.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    /// Bytes up to the end of this head, interim (1xx) heads before it included.
    pub len: usize,
    /// The status code (200..=999; interim answers are skipped).
    pub status: u16,
    /// HTTP/1.0 (else 1.1).
    pub http10: bool,
    /// Each field's name and value.
    pub fields: Vec<(Range<usize>, Range<usize>)>,
    /// How the body is framed.
    pub body: Framing,
    /// Whether the connection may carry another request once the body is read: the
    /// framing says where the body ends, on HTTP/1.1, without `connection: close`.
    pub keep_alive: bool,
}

impl HeadReader {
    /// The response head at the start of `buf` once it is complete (interim 1xx answers
    /// before it are skipped); `None` until then. `head_request`: the request was `HEAD`,
    /// so no body follows whatever the fields say. Refusals are [`HeadError::TooLarge`]
    /// and [`HeadError::Malformed`]; the connection is not used again.
    pub fn poll_response(
        &mut self,
        buf: &[u8],
        head_request: bool,
    ) -> Result<Option<ResponseHead>, HeadError> {
        let from = self.scanned.saturating_sub(3).min(buf.len());
        let found = find_blank_line(&buf[from..]).map(|at| from + at);
        self.scanned = buf.len();
        let Some(found) = found else {
            return if buf.len() > self.max_head {
                Err(HeadError::TooLarge)
            } else {
                Ok(None)
            };
        };
        // A search of the whole buffer found the first head's end already (a head that
        // came in one read); after earlier reads it may be a later head's.
        let mut known = (from == 0).then_some(found);
        let mut start = 0;
        loop {
            let end = known
                .take()
                .or_else(|| find_blank_line(&buf[start..]).map(|at| start + at));
            let Some(end) = end else {
                // Interim answers, and the final head not in yet: no more than the limit
                // is held for it either.
                return if buf.len() > self.max_head {
                    Err(HeadError::TooLarge)
                } else {
                    Ok(None)
                };
            };
            if end > self.max_head {
                return Err(HeadError::TooLarge);
            }
            match parse_response_head(&buf[start..end], head_request)? {
                None => start = end,
                Some(mut head) => {
                    for (name, value) in &mut head.fields {
                        *name = name.start + start..name.end + start;
                        *value = value.start + start..value.end + start;
                    }
                    head.len = end;
                    return Ok(Some(head));
                }
            }
        }
    }
}

/// Parses one complete response head; `None` for an interim (1xx) answer.
fn parse_response_head(head: &[u8], head_request: bool) -> Result<Option<ResponseHead>, HeadError> {
    let mut slots = [std::mem::MaybeUninit::<httparse::Header<'_>>::uninit(); MAX_RESPONSE_HEADERS];
    let mut parsed = httparse::Response::new(&mut []);
    match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut parsed,
        head,
        &mut slots,
    ) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(HeadError::Malformed("incomplete head")),
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooLarge),
        Err(_) => return Err(HeadError::Malformed("invalid response head")),
    }
    let (Some(status), Some(minor)) = (parsed.code, parsed.version) else {
        return Err(HeadError::Malformed("invalid status line"));
    };
    if !(100..=999).contains(&status) {
        return Err(HeadError::Malformed("invalid status code"));
    }
    if status == 101 {
        return Err(HeadError::Malformed(
            "101 Switching Protocols to a request without Upgrade",
        ));
    }
    if status < 200 {
        return Ok(None);
    }
    let range = |part: &[u8]| span(head, part).ok_or(HeadError::Malformed("invalid response head"));
    let http10 = minor == 0;
    let mut fields = Vec::with_capacity(parsed.headers.len());
    let mut length: Option<u64> = None;
    let mut coded = false;
    let mut last_coding: &[u8] = b"";
    let mut close = false;
    for field in parsed.headers.iter() {
        fields.push((range(field.name.as_bytes())?, range(field.value)?));
        let name = field.name.as_bytes();
        if name.eq_ignore_ascii_case(b"transfer-encoding") {
            coded = true;
            if let Some(coding) = field
                .value
                .split(|b| *b == b',')
                .map(<[u8]>::trim_ascii)
                .rfind(|coding| !coding.is_empty())
            {
                last_coding = coding;
            }
        } else if name.eq_ignore_ascii_case(b"content-length") {
            content_length(field.value, &mut length)?;
        } else if name.eq_ignore_ascii_case(b"connection") {
            close |= lists_token(field.value, "close");
        }
    }
    let (body, framing_keeps) = if head_request || status == 204 || status == 304 {
        (Framing::Empty, true)
    } else if coded {
        let chunked = last_coding.eq_ignore_ascii_case(b"chunked");
        // With a Content-Length as well, the message may be an attempt at smuggling:
        // Transfer-Encoding wins and the connection is not used again.
        if chunked {
            (Framing::Chunked(Chunk::Size), length.is_none())
        } else {
            (Framing::UntilClose, false)
        }
    } else {
        match length {
            Some(n) => (Framing::Length(n), true),
            None => (Framing::UntilClose, false),
        }
    };
    Ok(Some(ResponseHead {
        len: head.len(),
        status,
        http10,
        fields,
        body,
        keep_alive: framing_keeps && !http10 && !close,
    }))
}

/// How a response's body is framed on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    /// No body is sent (a `HEAD` request, 1xx, 204, 304).
    None,
    /// `Content-Length`.
    Length(u64),
    /// `Transfer-Encoding: chunked` (HTTP/1.1 clients).
    Chunked,
    /// The body runs until the connection closes (HTTP/1.0 clients, no length known).
    Close,
}

/// What a response head says about its body and the connection after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseFraming {
    /// How the body goes out.
    pub body: BodyFraming,
    /// Whether the connection takes another request after this response.
    pub keep_alive: bool,
    /// The client speaks HTTP/1.0: a kept connection is said so (`connection:
    /// keep-alive`), since 1.0 closes by default.
    pub http10: bool,
}

/// Decides how a response goes out: `status` to a request that was `HEAD` (or not), a body
/// of `len` bytes if known, to a client that speaks HTTP/1.0 (or 1.1) and may keep the
/// connection (`keep_alive`).
#[must_use]
pub fn response_framing(
    status: u16,
    head_request: bool,
    len: Option<u64>,
    http10: bool,
    keep_alive: bool,
) -> ResponseFraming {
    let bodiless = head_request || status < 200 || status == 204 || status == 304;
    let body = match (bodiless, len) {
        (true, _) => BodyFraming::None,
        (false, Some(n)) => BodyFraming::Length(n),
        (false, None) if http10 => BodyFraming::Close,
        (false, None) => BodyFraming::Chunked,
    };
    ResponseFraming {
        body,
        // A body that ends with the connection ends it.
        keep_alive: keep_alive && body != BodyFraming::Close,
        http10,
    }
}

/// Whether a response field is one the framing writes itself (the handler's own values
/// for these are not sent).
#[must_use]
pub fn is_framing_field(name: &[u8]) -> bool {
    name.eq_ignore_ascii_case(b"content-length")
        || name.eq_ignore_ascii_case(b"transfer-encoding")
        || name.eq_ignore_ascii_case(b"connection")
        || name.eq_ignore_ascii_case(b"keep-alive")
        || name.eq_ignore_ascii_case(b"date")
}

/// Writes a response head: the status line, `fields` (framing fields among them are left
/// out), `date` when given, then the framing's own fields and the blank line. Names and
/// values must already be valid field names and values (the `http` crate's types are).
pub fn encode_response_head<'a>(
    status: u16,
    reason: &str,
    fields: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
    date: Option<&[u8]>,
    framing: ResponseFraming,
    out: &mut Vec<u8>,
) {
    out.extend_from_slice(b"HTTP/1.1 ");
    let mut digits = [0u8; 3];
    let code = status.min(999);
    digits[0] = b'0' + (code / 100) as u8;
    digits[1] = b'0' + (code / 10 % 10) as u8;
    digits[2] = b'0' + (code % 10) as u8;
    out.extend_from_slice(&digits);
    out.push(b' ');
    out.extend_from_slice(reason.as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in fields {
        if is_framing_field(name) {
            continue;
        }
        out.extend_from_slice(name);
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    match framing.body {
        BodyFraming::Length(n) => encode_content_length(n, out),
        BodyFraming::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        BodyFraming::None | BodyFraming::Close => {}
    }
    if !framing.keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    } else if framing.http10 {
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    if let Some(date) = date {
        out.extend_from_slice(b"date: ");
        out.extend_from_slice(date);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// Writes the line that starts a chunk of `len` bytes (`len` > 0); the chunk's data
/// follows, then [`CHUNK_END`].
pub fn encode_chunk_start(len: usize, out: &mut Vec<u8>) {
    debug_assert!(len > 0, "a chunk of 0 bytes ends the body");
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut buf = [0u8; 16];
    let mut at = buf.len();
    let mut n = len;
    while n > 0 {
        at -= 1;
        buf[at] = HEX[n & 0xF];
        n >>= 4;
    }
    out.extend_from_slice(&buf[at..]);
    out.extend_from_slice(b"\r\n");
}

/// What follows a chunk's data.
pub const CHUNK_END: &[u8] = b"\r\n";

/// The last chunk of a chunked body, with no trailers.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]
        /// A response with interim answers before it, read in pieces of any size: the
        /// head comes out once it is all in, the same as when it is read at once, and
        /// not before.
        #[test]
        fn a_head_read_in_pieces_is_the_head_read_at_once(
            interim in 0usize..3,
            lf_only in any::<bool>(),
            fields in proptest::collection::vec("[a-z]{1,6}", 0..4),
            cuts in proptest::collection::vec(1usize..24, 1..12),
        ) {
            let eol = if lf_only { "\n" } else { "\r\n" };
            let mut text = String::new();
            for _ in 0..interim {
                text.push_str(&format!("HTTP/1.1 103 Early Hints{eol}link: </a>{eol}{eol}"));
            }
            text.push_str(&format!("HTTP/1.1 200 OK{eol}content-length: 2{eol}"));
            for (i, value) in fields.iter().enumerate() {
                text.push_str(&format!("x-{i}: {value}{eol}"));
            }
            text.push_str(&format!("{eol}ok"));
            let wire = text.as_bytes();
            let whole = HeadReader::new(8192).poll_response(wire, false).unwrap().unwrap();
            prop_assert_eq!(whole.len, wire.len() - 2);
            prop_assert_eq!(whole.fields.len(), fields.len() + 1);
            let mut reader = HeadReader::new(8192);
            let mut at = 0;
            let mut cuts = cuts.into_iter().cycle();
            let head = loop {
                at = (at + cuts.next().unwrap_or(1)).min(wire.len());
                match reader.poll_response(&wire[..at], false).unwrap() {
                    Some(head) => break head,
                    None => prop_assert!(at < whole.len, "nothing at {} of {}", at, whole.len),
                }
            };
            prop_assert!(at >= whole.len);
            prop_assert_eq!(head, whole);
        }
    }

    #[test]
    fn response_heads_are_framed_by_the_rfc_after_interim_answers() {
        let text = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-a: b\r\n\r\nhello";
        let head = HeadReader::new(8192)
            .poll_response(text.as_bytes(), false)
            .unwrap()
            .unwrap();
        assert_eq!((head.status, head.len), (200, text.len() - 5));
        assert_eq!(head.body, Framing::Length(5));
        assert!(head.keep_alive);
        let (name, value) = head.fields[1].clone();
        assert_eq!((&text[name], &text[value]), ("x-a", "b"));
        // (fields, HTTP/1.0?, HEAD request?, status, framing, reusable)
        let cases: [(&str, bool, bool, u16, Framing, bool); 9] = [
            (
                "transfer-encoding: chunked\r\n",
                false,
                false,
                200,
                Framing::Chunked(Chunk::Size),
                true,
            ),
            (
                "transfer-encoding: chunked\r\ncontent-length: 3\r\n",
                false,
                false,
                200,
                Framing::Chunked(Chunk::Size),
                false,
            ),
            (
                "transfer-encoding: gzip\r\n",
                false,
                false,
                200,
                Framing::UntilClose,
                false,
            ),
            ("", false, false, 200, Framing::UntilClose, false),
            (
                "content-length: 3\r\nconnection: close\r\n",
                false,
                false,
                200,
                Framing::Length(3),
                false,
            ),
            (
                "content-length: 3\r\n",
                true,
                false,
                200,
                Framing::Length(3),
                false,
            ),
            (
                "content-length: 3\r\n",
                false,
                true,
                200,
                Framing::Empty,
                true,
            ),
            ("", false, false, 204, Framing::Empty, true),
            ("", false, false, 304, Framing::Empty, true),
        ];
        for (fields, http10, head_request, status, framing, reusable) in cases {
            let version = if http10 { "1.0" } else { "1.1" };
            let text = format!("HTTP/{version} {status} X\r\n{fields}\r\n");
            let head = HeadReader::new(8192)
                .poll_response(text.as_bytes(), head_request)
                .unwrap()
                .unwrap();
            assert_eq!(
                (&head.body, head.keep_alive),
                (&framing, reusable),
                "{text:?}"
            );
        }
        for broken in [
            "HTTP/1.1 101 Switching Protocols\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",
            "HTTP/1.1 OK\r\n\r\n",
        ] {
            assert!(
                HeadReader::new(8192)
                    .poll_response(broken.as_bytes(), false)
                    .is_err(),
                "{broken:?}"
            );
        }
        // An interim answer alone, and a head past the limit.
        assert_eq!(
            HeadReader::new(64).poll_response(b"HTTP/1.1 103 Early\r\n\r\n", false),
            Ok(None)
        );
        assert_eq!(
            HeadReader::new(8).poll_response(&[b'x'; 9], false),
            Err(HeadError::TooLarge)
        );
        // An interim answer, then a final head that does not end within the limit, read
        // at once (found by the `http1_response` fuzz target: it was held, unrefused).
        let mut wire = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nx: ".to_vec();
        assert_eq!(HeadReader::new(64).poll_response(&wire, false), Ok(None));
        wire.resize(65, b'a');
        assert_eq!(
            HeadReader::new(64).poll_response(&wire, false),
            Err(HeadError::TooLarge)
        );
    }

    #[test]
    fn response_framing_follows_the_request_and_the_client() {
        let f = |status, head, len, http10, keep| response_framing(status, head, len, http10, keep);
        assert_eq!(
            f(200, false, Some(3), false, true).body,
            BodyFraming::Length(3)
        );
        assert_eq!(f(200, false, None, false, true).body, BodyFraming::Chunked);
        let close = f(200, false, None, true, true);
        assert_eq!((close.body, close.keep_alive), (BodyFraming::Close, false));
        assert_eq!(f(200, true, None, false, true).body, BodyFraming::None);
        assert_eq!(f(204, false, Some(0), false, true).body, BodyFraming::None);
        assert!(!f(200, false, Some(1), false, false).keep_alive);
        let mut out = Vec::new();
        encode_response_head(
            200,
            "OK",
            [],
            None,
            f(200, false, Some(0), true, true),
            &mut out,
        );
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: keep-alive\r\n\r\n"
        );
    }

    #[test]
    fn a_response_head_carries_its_own_framing_fields_only() {
        let mut out = Vec::new();
        let fields: [(&[u8], &[u8]); 3] = [
            (b"content-type", b"text/event-stream"),
            (b"content-length", b"99"),
            (b"connection", b"keep-alive"),
        ];
        let framing = response_framing(200, false, None, false, false);
        encode_response_head(
            200,
            "OK",
            fields,
            Some(b"Wed, 02 Dec 2026 06:00:00 GMT"),
            framing,
            &mut out,
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\
             connection: close\r\ndate: Wed, 02 Dec 2026 06:00:00 GMT\r\n\r\n"
        );
        let mut out = Vec::new();
        encode_chunk_start(0x1a2, &mut out);
        assert_eq!(out, b"1a2\r\n");
    }
}
