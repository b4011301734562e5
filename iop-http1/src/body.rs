//! Message body framing (RFC 9112 §6.3, §7.1): where a body ends and its chunks.

use bytes::{Buf, Bytes, BytesMut};

/// The longest chunk-size line (with extensions) accepted.
pub const MAX_CHUNK_LINE: usize = 4 << 10;
/// The largest trailer section accepted.
pub const MAX_TRAILERS: usize = 16 << 10;
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
                        let Some(end) = line_feed(buf) else {
                            if buf.len() > MAX_CHUNK_LINE {
                                return Err(BodyError::Malformed("chunk size line too long"));
                            }
                            return Ok(None);
                        };
                        if end > MAX_CHUNK_LINE {
                            return Err(BodyError::Malformed("chunk size line too long"));
                        }
                        let size = chunk_size(&buf[..end])?;
                        buf.advance(end + 1);
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
                            buf.advance(n);
                            *chunk = Chunk::Size;
                        }
                    },
                    Chunk::Trailers => {
                        match line_end(buf) {
                            None => return Ok(None),
                            Some(0) => {}
                            Some(n) => {
                                buf.advance(n);
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

    /// Takes what `buf` already holds of a body nobody will read, up to `max` bytes of it,
    /// so that the connection can carry the next message; whether the body ended there.
    /// A longer body, one not all here yet, or broken framing is `false`: the connection
    /// is not used again (after broken framing the body never ends).
    pub fn discard_buffered(&mut self, buf: &mut BytesMut, max: u64) -> bool {
        if self.remaining().is_some_and(|left| left > max) {
            return false;
        }
        let mut taken = 0u64;
        while taken <= max {
            match self.decode(buf) {
                Ok(Some(Decoded::Data(data))) => taken += data.len() as u64,
                Ok(Some(Decoded::Trailers(_))) => {}
                Ok(Some(Decoded::End)) => return true,
                Ok(None) => return false,
                Err(_) => {
                    *self = Framing::Length(u64::MAX);
                    return false;
                }
            }
        }
        false
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

/// Where the first LF in `buf` is. A chunk-size line is a few bytes long: they are looked
/// at one by one before `memchr`'s setup is worth it.
fn line_feed(buf: &[u8]) -> Option<usize> {
    const NEAR: usize = 16;
    match buf.iter().take(NEAR).position(|&b| b == b'\n') {
        Some(at) => Some(at),
        None => memchr::memchr(b'\n', buf.get(NEAR..)?).map(|at| at + NEAR),
    }
}

/// The size of a chunk-size line (without its LF): hex digits, then optional extensions.
fn chunk_size(line: &[u8]) -> Result<u64, BodyError> {
    let invalid = BodyError::Malformed("invalid chunk size");
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let mut size = 0u64;
    let mut digits = 0;
    for &b in line {
        let digit = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            b'A'..=b'F' => b - b'A' + 10,
            _ => break,
        };
        // Fifteen hex digits fit in a u64 without overflow.
        if digits == 15 {
            return Err(invalid);
        }
        size = (size << 4) | u64::from(digit);
        digits += 1;
    }
    let rest = &line[digits..];
    if digits == 0 || !(rest.is_empty() || matches!(rest[0], b';' | b' ' | b'\t')) {
        return Err(invalid);
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unread_body_is_discarded_only_when_it_is_all_here_and_small() {
        let whole = |framing: Framing, wire: &[u8], max: u64| {
            let mut framing = framing;
            let mut buf = BytesMut::from(wire);
            let ended = framing.discard_buffered(&mut buf, max);
            (ended, buf.len())
        };
        // All here: taken, and what follows stays for the next message.
        assert_eq!(whole(Framing::Length(3), b"abcGET", 10), (true, 3));
        assert_eq!(
            whole(Framing::Chunked(Chunk::Size), b"3\r\nabc\r\n0\r\n\r\nX", 10),
            (true, 1)
        );
        // Too long, not all here, or broken: the connection is not reused.
        assert!(!whole(Framing::Length(100), b"abc", 10).0);
        assert!(!whole(Framing::Length(5), b"abc", 10).0);
        assert!(!whole(Framing::Chunked(Chunk::Size), b"400\r\n", 10).0);
        let mut broken = Framing::Chunked(Chunk::Size);
        assert!(!broken.discard_buffered(&mut BytesMut::from(&b"zz\r\n"[..]), 10));
        assert!(!broken.is_done(), "a broken body never ends");
    }

    #[test]
    fn a_line_feed_is_found_near_or_far() {
        for len in 0..40 {
            for at in 0..=len {
                let mut buf = vec![b'a'; len];
                if let Some(slot) = buf.get_mut(at) {
                    *slot = b'\n';
                }
                assert_eq!(line_feed(&buf), memchr::memchr(b'\n', &buf), "{len} {at}");
            }
        }
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
}
