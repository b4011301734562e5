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
//!
//! [`body`] holds the body framing both sides decode, [`request`] the request heads a
//! server reads and a client writes, [`response`] the response heads a client reads and
//! a server writes.

pub mod body;
pub mod request;
pub mod response;

pub use body::{BodyError, Chunk, Decoded, Framing, MAX_CHUNK_LINE, MAX_TRAILERS};
pub use request::{
    CONTINUE, EncodeError, HeadError, HeadReader, MAX_REQUEST_HEADERS, Opening, RequestHead,
    encode_field, encode_request_line, finish_request_head, is_field_value, is_token, opening,
};
pub use response::{
    BodyFraming, CHUNK_END, LAST_CHUNK, MAX_RESPONSE_HEADERS, ResponseFraming, ResponseHead,
    encode_chunk_start, encode_content_length, encode_response_head, is_framing_field,
    response_framing,
};

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
pub(super) fn span(head: &[u8], part: &[u8]) -> Option<std::ops::Range<usize>> {
    let at = (part.as_ptr() as usize).checked_sub(head.as_ptr() as usize)?;
    let end = at.checked_add(part.len())?;
    (end <= head.len()).then_some(at..end)
}

/// Folds one `Content-Length` field into what earlier ones said: a comma-separated list
/// of one length, repeated (RFC 9110 §8.6); a value that is not a length, or that
/// disagrees with one seen before, refuses the head (a smuggling vector).
pub(super) fn content_length(value: &[u8], seen: &mut Option<u64>) -> Result<(), HeadError> {
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
