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

    /// As [`decode`](Self::decode), but when a chunked body's step is data, the data of
    /// the chunks that `buf` already holds behind it comes out in the same step, copied
    /// into one buffer, up to `max` bytes in all (a first step longer than `max` is not
    /// cut). A stream its sender writes a chunk per event, read many events at once,
    /// then costs one step and one buffer instead of one per chunk. Joining stops before
    /// anything that is not data: trailers, broken framing and a chunk whose size line or
    /// first byte has not arrived are left in `buf` for the next call (the last chunk's
    /// size line is taken, as `decode` takes it, so that it is not read twice). The
    /// bytes, their order and every error are those that [`decode`](Self::decode) gives.
    pub fn decode_joined(
        &mut self,
        buf: &mut BytesMut,
        max: usize,
    ) -> Result<Option<Decoded>, BodyError> {
        let first = match self.decode(buf)? {
            Some(Decoded::Data(first)) => first,
            other => return Ok(other),
        };
        let mut joined = BytesMut::new();
        loop {
            let total = if joined.is_empty() {
                first.len()
            } else {
                joined.len()
            };
            let Framing::Chunked(chunk) = self else {
                break;
            };
            let Some(room) = max.checked_sub(total).filter(|&room| room > 0) else {
                break;
            };
            let Some((start, size)) = next_chunk(*chunk, buf) else {
                break;
            };
            if size == 0 {
                buf.advance(start);
                *chunk = Chunk::Trailers;
                break;
            }
            if joined.is_empty() {
                // One allocation for what is here, bounded by `max`.
                joined.reserve(total + (buf.len() - start).min(room));
                joined.extend_from_slice(&first);
            }
            buf.advance(start);
            let take = buf.len().min(room);
            let take = usize::try_from(size).map_or(take, |size| size.min(take));
            joined.extend_from_slice(&buf[..take]);
            buf.advance(take);
            let left = size - take as u64;
            *chunk = if left == 0 {
                Chunk::DataEnd
            } else {
                Chunk::Data(left)
            };
        }
        Ok(Some(Decoded::Data(if joined.is_empty() {
            first
        } else {
            joined.freeze()
        })))
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

/// Where the data of the next chunk starts in `buf` and the chunk's size, for a decoder
/// in state `chunk`: `Some` only when the CRLF that ends the chunk before it and the
/// chunk's size line are in `buf`, the line is well formed, and at least one byte of its
/// data is here too (or the size is 0: the last chunk, which has none). Nothing is
/// taken: whatever this declines, [`Framing::decode`] reads (and refuses) as it always
/// does.
fn next_chunk(chunk: Chunk, buf: &[u8]) -> Option<(usize, u64)> {
    let line_at = match chunk {
        Chunk::DataEnd => match line_end(buf) {
            Some(n @ 1..) => n,
            _ => return None,
        },
        Chunk::Size => 0,
        Chunk::Data(_) | Chunk::Trailers => return None,
    };
    let rest = &buf[line_at..];
    let end = line_feed(rest).filter(|&end| end <= MAX_CHUNK_LINE)?;
    let size = chunk_size(&rest[..end]).ok()?;
    let start = line_at + end + 1;
    (size == 0 || start < buf.len()).then_some((start, size))
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

    /// Every step of `wire` read at once by [`Framing::decode_joined`] under `max`.
    fn joined_steps(wire: &[u8], max: usize) -> Vec<Result<Decoded, BodyError>> {
        let mut framing = Framing::Chunked(Chunk::Size);
        let mut buf = BytesMut::from(wire);
        let mut out = Vec::new();
        loop {
            match framing.decode_joined(&mut buf, max) {
                Ok(Some(Decoded::End)) => return out,
                Ok(Some(step)) => out.push(Ok(step)),
                Ok(None) => return out,
                Err(err) => {
                    out.push(Err(err));
                    return out;
                }
            }
        }
    }

    #[test]
    fn chunks_read_at_once_come_out_joined_up_to_the_limit() {
        let data = |d: &'static [u8]| Ok(Decoded::Data(Bytes::from_static(d)));
        let wire = b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(joined_steps(wire, 100), vec![data(b"abcde")]);
        // The limit cuts the chunk it reaches; the rest comes next.
        assert_eq!(joined_steps(wire, 4), vec![data(b"abcd"), data(b"e")]);
        // A first chunk past the limit is not cut.
        assert_eq!(joined_steps(wire, 2), vec![data(b"abc"), data(b"de")]);
        // Trailers, broken framing and a chunk not here yet stop the join; the next call
        // reads them as `decode` does.
        assert_eq!(
            joined_steps(b"3\r\nabc\r\n0\r\nX-A: 1\r\n\r\n", 100),
            vec![
                data(b"abc"),
                Ok(Decoded::Trailers(Bytes::from_static(b"X-A: 1\r\n\r\n")))
            ]
        );
        assert_eq!(
            joined_steps(b"3\r\nabc\r\nzz\r\nab\r\n", 100),
            vec![
                data(b"abc"),
                Err(BodyError::Malformed("invalid chunk size"))
            ]
        );
        assert_eq!(
            joined_steps(b"3\r\nabc2\r\nde\r\n0\r\n\r\n", 100),
            vec![
                data(b"abc"),
                Err(BodyError::Malformed("chunk data longer than its size"))
            ]
        );
        assert_eq!(
            joined_steps(b"3\r\nabcX2\r\nde\r\n", 100),
            vec![
                data(b"abc"),
                Err(BodyError::Malformed("chunk data longer than its size"))
            ]
        );
        assert_eq!(joined_steps(b"3\r\nabc\r\n2\r\n", 100), vec![data(b"abc")]);
        assert_eq!(joined_steps(b"3\r\nabc\r", 100), vec![data(b"abc")]);
        // A body framed by length is one step, as `decode` gives it.
        let mut framing = Framing::Length(5);
        let mut buf = BytesMut::from(&b"abcdefg"[..]);
        assert_eq!(
            framing.decode_joined(&mut buf, 2),
            Ok(Some(Decoded::Data(Bytes::from_static(b"abcde"))))
        );
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
