//! HTTP/1.1 message framing, Sans-IO (RFC 9112): what the Edge's public listener reads of
//! a request head and body, what it writes as a response head and body chunks, and the
//! body framing that the Node's provider client decodes too. Bytes in, decisions and bytes
//! out; the shells own the sockets and the timers.
//!
//! Every peer is untrusted:
//! - a request head is refused past its size limit or its header count (431), not
//!   buffered without bound, and a head that arrives a few bytes at a time is searched
//!   once and parsed once ([`HeadReader`]);
//! - a body is framed by one `Content-Length` (equal values repeated are one value) or by
//!   `Transfer-Encoding: chunked` alone: both at once, another coding, or `Transfer-Encoding`
//!   on HTTP/1.0 is refused (400 or 501) and the connection closed, so that no two readers
//!   of one stream can disagree on where a message ends (request smuggling);
//! - chunk-size lines, chunk sizes and trailer sections have limits.

use std::ops::Range;

use bytes::{Bytes, BytesMut};

/// The longest chunk-size line (with extensions) accepted.
pub const MAX_CHUNK_LINE: usize = 4 << 10;
/// The largest trailer section accepted.
pub const MAX_TRAILERS: usize = 16 << 10;
/// The most header fields a request head may carry.
pub const MAX_REQUEST_HEADERS: usize = 100;

/// How a message body that does not end where its framing says is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// The peer closed the connection before the body ended.
    #[error("the connection closed before the body ended")]
    Incomplete,
    /// The body's framing is broken.
    #[error("malformed body: {0}")]
    Malformed(&'static str),
}

/// How a message body ends, and where its decoder stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Framing {
    /// No body (a `HEAD` response, 204, 304, a request without a length).
    Empty,
    /// This many bytes remain.
    Length(u64),
    /// `Transfer-Encoding: chunked`, in this state.
    Chunked(Chunk),
    /// Everything until the peer closes the connection (responses only).
    UntilClose,
    /// Read to its end.
    Done,
}

/// Where a chunked body's decoder stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunk {
    /// Expects a chunk-size line.
    Size,
    /// This many bytes of chunk data remain.
    Data(u64),
    /// Expects the CRLF after chunk data.
    DataEnd,
    /// Expects trailer fields or the final CRLF.
    Trailers,
}

/// One step of a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// Body bytes, a slice of what was read (not copied).
    Data(Bytes),
    /// A chunked body's trailer section: its field lines and the blank line that ends
    /// them, checked to be well-formed fields.
    Trailers(Bytes),
    /// The body ended.
    End,
}

impl Framing {
    /// The next step of the body from what `buf` holds (taken out of it); `None` until
    /// more is read.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Decoded>, BodyError> {
        loop {
            match self {
                Framing::Empty | Framing::Done | Framing::Length(0) => {
                    *self = Framing::Done;
                    return Ok(Some(Decoded::End));
                }
                Framing::Length(left) => {
                    if buf.is_empty() {
                        return Ok(None);
                    }
                    let take = usize::try_from(*left).map_or(buf.len(), |l| l.min(buf.len()));
                    *left -= take as u64;
                    return Ok(Some(Decoded::Data(buf.split_to(take).freeze())));
                }
                Framing::UntilClose => {
                    if buf.is_empty() {
                        return Ok(None);
                    }
                    return Ok(Some(Decoded::Data(buf.split().freeze())));
                }
                Framing::Chunked(chunk) => match chunk {
                    Chunk::Size => {
                        let Some(end) = memchr::memchr(b'\n', buf) else {
                            if buf.len() > MAX_CHUNK_LINE {
                                return Err(BodyError::Malformed("chunk size line too long"));
                            }
                            return Ok(None);
                        };
                        if end > MAX_CHUNK_LINE {
                            return Err(BodyError::Malformed("chunk size line too long"));
                        }
                        let size = chunk_size(&buf[..end])?;
                        let _ = buf.split_to(end + 1);
                        *chunk = if size == 0 {
                            Chunk::Trailers
                        } else {
                            Chunk::Data(size)
                        };
                    }
                    Chunk::Data(left) => {
                        if buf.is_empty() {
                            return Ok(None);
                        }
                        let take = usize::try_from(*left).map_or(buf.len(), |l| l.min(buf.len()));
                        *left -= take as u64;
                        if *left == 0 {
                            *chunk = Chunk::DataEnd;
                        }
                        return Ok(Some(Decoded::Data(buf.split_to(take).freeze())));
                    }
                    Chunk::DataEnd => match line_end(buf) {
                        None => return Ok(None),
                        Some(0) => {
                            return Err(BodyError::Malformed("chunk data longer than its size"));
                        }
                        Some(n) => {
                            let _ = buf.split_to(n);
                            *chunk = Chunk::Size;
                        }
                    },
                    Chunk::Trailers => {
                        match line_end(buf) {
                            None => return Ok(None),
                            Some(0) => {}
                            Some(n) => {
                                let _ = buf.split_to(n);
                                *self = Framing::Done;
                                return Ok(Some(Decoded::End));
                            }
                        }
                        let mut fields = [httparse::EMPTY_HEADER; 32];
                        let len = match httparse::parse_headers(buf, &mut fields) {
                            Ok(httparse::Status::Complete((len, _))) => len,
                            Ok(httparse::Status::Partial) if buf.len() > MAX_TRAILERS => {
                                return Err(BodyError::Malformed("trailers too large"));
                            }
                            Ok(httparse::Status::Partial) => return Ok(None),
                            Err(_) => return Err(BodyError::Malformed("invalid trailers")),
                        };
                        *self = Framing::Done;
                        return Ok(Some(Decoded::Trailers(buf.split_to(len).freeze())));
                    }
                },
            }
        }
    }

    /// What the peer's close of the connection means for this body: its end, or
    /// [`BodyError::Incomplete`].
    pub fn at_eof(&mut self) -> Result<Decoded, BodyError> {
        match self {
            Framing::UntilClose | Framing::Done | Framing::Empty | Framing::Length(0) => {
                *self = Framing::Done;
                Ok(Decoded::End)
            }
            _ => Err(BodyError::Incomplete),
        }
    }

    /// Bytes of body left, when the framing says.
    #[must_use]
    pub fn remaining(&self) -> Option<u64> {
        match self {
            Framing::Empty | Framing::Done => Some(0),
            Framing::Length(n) => Some(*n),
            _ => None,
        }
    }

    /// Whether the body has been read to its end.
    #[must_use]
    pub fn is_done(&self) -> bool {
        matches!(self, Framing::Done | Framing::Empty | Framing::Length(0))
    }
}

/// The length of the CRLF (or bare LF) that `buf` starts with: `Some(0)` if it starts
/// with something else, `None` if it cannot tell yet.
fn line_end(buf: &[u8]) -> Option<usize> {
    match buf {
        [] | [b'\r'] => None,
        [b'\r', b'\n', ..] => Some(2),
        [b'\n', ..] => Some(1),
        _ => Some(0),
    }
}

/// The size of a chunk-size line (without its LF): hex digits, then optional extensions.
fn chunk_size(line: &[u8]) -> Result<u64, BodyError> {
    let invalid = BodyError::Malformed("invalid chunk size");
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    let rest = &line[digits..];
    if digits == 0 || digits > 15 || !(rest.is_empty() || matches!(rest[0], b';' | b' ' | b'\t')) {
        return Err(invalid);
    }
    // Fifteen hex digits fit in a u64 without overflow.
    Ok(line[..digits].iter().fold(0u64, |n, &b| {
        let digit = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            _ => b - b'A' + 10,
        };
        (n << 4) | u64::from(digit)
    }))
}

/// Whether a comma-separated field value lists `token` (case-insensitive).
#[must_use]
pub fn lists_token(value: &[u8], token: &str) -> bool {
    value
        .split(|b| *b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

// ----- requests (server side) -----

/// Why a request head is refused; the connection is closed after the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    /// The head is longer than the limit, or has more than [`MAX_REQUEST_HEADERS`] fields.
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
    /// Each field's name and value.
    pub fields: Vec<(Range<usize>, Range<usize>)>,
    /// How the body is framed.
    pub body: Framing,
    /// Whether the client lets the connection carry another request after this one.
    pub keep_alive: bool,
    /// `Expect: 100-continue`: the client waits for an interim answer before the body.
    pub expect_continue: bool,
}

/// Finds and parses request heads in a connection's read buffer. The buffer is searched
/// for the blank line that ends a head only past what earlier calls searched, and parsed
/// once that line is in, so a head sent a byte at a time costs one pass, not one per byte.
#[derive(Debug, Clone)]
pub struct HeadReader {
    max_head: usize,
    scanned: usize,
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

    /// Starts over for the next head (the buffer's start moved).
    pub fn reset(&mut self) {
        self.scanned = 0;
    }
}

/// The end of the first blank line in `buf` (CRLF CRLF or LF LF, which httparse also
/// accepts, and the mixed forms), just past it.
fn find_blank_line(buf: &[u8]) -> Option<usize> {
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
    let base = head.as_ptr() as usize;
    // Where a slice httparse returned lies in `head`.
    let range = |part: &[u8]| {
        let at = part.as_ptr() as usize - base;
        at..at + part.len()
    };
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
        fields.push((range(field.name.as_bytes()), range(field.value)));
        let name = field.name.as_bytes();
        let value = field.value;
        if name.eq_ignore_ascii_case(b"content-length") {
            for part in value.split(|b| *b == b',') {
                let n = decimal(part.trim_ascii())
                    .ok_or(HeadError::Malformed("invalid content-length"))?;
                if length.is_some_and(|seen| seen != n) {
                    return Err(HeadError::Malformed("conflicting content-length values"));
                }
                length = Some(n);
            }
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
        method: range(method.as_bytes()),
        target: range(target.as_bytes()),
        http10,
        fields,
        body,
        keep_alive,
        expect_continue: expect_continue && !http10,
    })
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

// ----- responses (client side) -----

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
        let found = find_blank_line(&buf[from..]).is_some();
        self.scanned = buf.len();
        if !found {
            return if buf.len() > self.max_head {
                Err(HeadError::TooLarge)
            } else {
                Ok(None)
            };
        }
        let mut start = 0;
        loop {
            let Some(end) = find_blank_line(&buf[start..]).map(|at| start + at) else {
                // Interim answers, and the final head not in yet.
                return Ok(None);
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
    let base = head.as_ptr() as usize;
    let range = |part: &[u8]| {
        let at = part.as_ptr() as usize - base;
        at..at + part.len()
    };
    let http10 = minor == 0;
    let mut fields = Vec::with_capacity(parsed.headers.len());
    let mut length: Option<u64> = None;
    let mut coded = false;
    let mut last_coding: &[u8] = b"";
    let mut close = false;
    for field in parsed.headers.iter() {
        fields.push((range(field.name.as_bytes()), range(field.value)));
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
            for part in field.value.split(|b| *b == b',') {
                let n = decimal(part.trim_ascii())
                    .ok_or(HeadError::Malformed("invalid content-length"))?;
                if length.is_some_and(|seen| seen != n) {
                    return Err(HeadError::Malformed("conflicting content-length values"));
                }
                length = Some(n);
            }
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

/// The interim answer to `Expect: 100-continue`.
pub const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

// ----- responses (server side) -----

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

/// Writes the field line `content-length: <len>` (a head's, request or response).
pub fn encode_content_length(len: u64, out: &mut Vec<u8>) {
    let mut buf = [0u8; 20];
    out.extend_from_slice(b"content-length: ");
    out.extend_from_slice(decimal_text(&mut buf, len));
    out.extend_from_slice(b"\r\n");
}

fn decimal_text(buf: &mut [u8; 20], mut n: u64) -> &[u8] {
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
    }

    #[test]
    fn chunk_sizes_are_hex_within_fifteen_digits() {
        assert_eq!(chunk_size(b"1aF"), Ok(0x1af));
        assert_eq!(chunk_size(b"10;name=value\r"), Ok(16));
        assert_eq!(chunk_size(b"fffffffffffffff"), Ok(0xfff_ffff_ffff_ffff));
        for bad in [&b""[..], b"x", b"-1", b"1x", b"ffffffffffffffff"] {
            assert!(chunk_size(bad).is_err(), "{bad:?}");
        }
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
