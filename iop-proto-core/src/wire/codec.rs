//! Length-prefixed framing: a 4-byte big-endian length, then one encoded [`Envelope`].
//!
//! [`FrameDecoder`] is incremental and IO-free: push bytes in any split, pull whole
//! envelopes. It checks a frame's length on its 4-byte header, before it keeps a single
//! byte of the body, and it never reserves memory for a length it has only been promised,
//! so a peer that sends headers alone cannot pin memory. Frames handed over as [`Bytes`]
//! through [`FrameDecoder::push_bytes`] are decoded without copying: the `bytes` fields of
//! the result (tunnel bodies, run inputs) are slices of the input.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message;

use super::Envelope;
use super::tunnel_frame;
use super::tunnel_request::TunnelRequest;

/// Length of the frame header: a big-endian `u32` byte count of the envelope that follows.
pub const HEADER_LEN: usize = 4;

/// Default maximum length of one encoded envelope: 16 MiB.
pub const DEFAULT_MAX_FRAME_LEN: usize = 16 * 1024 * 1024;

/// A tunnel request body or run input at least this long is not copied into its frame
/// by [`encode_split`]: below it, one copy costs less than a second buffer to write.
pub const SPLIT_PAYLOAD_MIN: usize = 16 * 1024;

/// Why an envelope could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The encoded envelope is longer than the peer accepts.
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    FrameTooLarge {
        /// Encoded length of the envelope.
        len: usize,
        /// The limit in force.
        max: usize,
    },
    /// The envelope carries no message; the peer would reject it.
    #[error("envelope has no body")]
    MissingBody,
}

/// Why the byte stream could not be decoded. After any of these the decoder stays failed
/// and the connection should be closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// A frame header announced more bytes than the limit allows.
    #[error("frame length {len} exceeds the maximum of {max} bytes")]
    FrameTooLarge {
        /// The length the header announced.
        len: u64,
        /// The limit in force.
        max: usize,
    },
    /// The frame's bytes are not a valid protobuf `Envelope`.
    #[error("malformed envelope in a {len}-byte frame: {source}")]
    Malformed {
        /// Length of the offending frame.
        len: usize,
        /// What prost found wrong.
        #[source]
        source: prost::DecodeError,
    },
    /// The envelope decoded but carries no message this schema knows (empty or unknown).
    #[error("envelope in a {len}-byte frame has no known body")]
    MissingBody {
        /// Length of the offending frame.
        len: usize,
    },
    /// The stream ended in the middle of a frame.
    #[error("stream ended inside a frame with {buffered} bytes buffered")]
    Truncated {
        /// Bytes received of the incomplete frame.
        buffered: usize,
    },
}

/// Length of `envelope` once framed: header plus encoded body.
#[must_use]
pub fn encoded_frame_len(envelope: &Envelope) -> usize {
    HEADER_LEN + envelope.encoded_len()
}

/// Appends one frame carrying `envelope` to `dst`, refusing frames over
/// [`DEFAULT_MAX_FRAME_LEN`].
pub fn encode(envelope: &Envelope, dst: &mut BytesMut) -> Result<(), EncodeError> {
    encode_with_limit(envelope, dst, DEFAULT_MAX_FRAME_LEN)
}

/// Appends one frame carrying `envelope` to `dst` as [`encode_with_limit`] does, but for
/// the payload of a large tunnel request or run input (at least [`SPLIT_PAYLOAD_MIN`]
/// bytes): the frame's other bytes go into `dst` and the payload is handed back, to be
/// written right after them, so it reaches the socket without a copy. Protobuf takes a
/// message's fields in any order, so the payload is encoded as the frame's last field;
/// the bytes are a frame any decoder reads back into the same envelope. `envelope` is
/// left as it was. On error `dst` is left unchanged.
pub fn encode_split(
    envelope: &mut Envelope,
    dst: &mut BytesMut,
    max_frame_len: usize,
) -> Result<Option<Bytes>, EncodeError> {
    use super::Body;

    // The envelope's field and the payload's field in its message, as in runtime.proto
    // (the round-trip property test fails if they drift).
    match &mut envelope.body {
        Some(Body::ProviderTunnelRequest(tunnel)) if tunnel.body.len() >= SPLIT_PAYLOAD_MIN => {
            split(tunnel, |t| &mut t.body, (9, 7), dst, max_frame_len)
        }
        Some(Body::RunRequest(run)) if run.input.len() >= SPLIT_PAYLOAD_MIN => {
            split(run, |r| &mut r.input, (7, 5), dst, max_frame_len)
        }
        _ => encode_with_limit(envelope, dst, max_frame_len).map(|()| None),
    }
}

/// [`encode_split`] of `message`, whose payload is `payload(message)`: the head into
/// `dst`, the payload handed back and left in place.
fn split<M: Message>(
    message: &mut M,
    payload: fn(&mut M) -> &mut Bytes,
    (outer, inner): (u32, u32),
    dst: &mut BytesMut,
    max_frame_len: usize,
) -> Result<Option<Bytes>, EncodeError> {
    // Taken out for the head's encoding (an empty `bytes` field is not encoded).
    let taken = std::mem::take(payload(message));
    let head = split_head(message, outer, inner, taken.len(), dst, max_frame_len);
    *payload(message) = taken.clone();
    head.map(|()| Some(taken))
}

/// The frame of an envelope whose field `outer` is `message`, but for the message's field
/// `inner` of `payload_len` bytes: everything up to that field's key and length, which
/// end the frame's head (the payload follows them). `message` holds no payload (an empty
/// `bytes` field is not encoded).
fn split_head<M: Message>(
    message: &M,
    outer: u32,
    inner: u32,
    payload_len: usize,
    dst: &mut BytesMut,
    max_frame_len: usize,
) -> Result<(), EncodeError> {
    use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};

    let payload_field = key_len(inner) + encoded_len_varint(payload_len as u64) + payload_len;
    let message_len = message.encoded_len() + payload_field;
    let len = key_len(outer) + encoded_len_varint(message_len as u64) + message_len;
    let header = frame_header(len, max_frame_len)?;
    dst.reserve(HEADER_LEN + len - payload_len);
    dst.put_u32(header);
    encode_key(outer, WireType::LengthDelimited, dst);
    encode_varint(message_len as u64, dst);
    message.encode_raw(dst);
    encode_key(inner, WireType::LengthDelimited, dst);
    encode_varint(payload_len as u64, dst);
    Ok(())
}

/// The header of a frame of `len` bytes, unless that is over `max_frame_len`.
pub(crate) fn frame_header(len: usize, max_frame_len: usize) -> Result<u32, EncodeError> {
    match u32::try_from(len) {
        Ok(header) if len <= max_frame_len => Ok(header),
        _ => Err(EncodeError::FrameTooLarge {
            len,
            max: max_frame_len,
        }),
    }
}

/// Appends one frame carrying `envelope` to `dst`, refusing frames over `max_frame_len`.
/// On error `dst` is left unchanged.
pub fn encode_with_limit(
    envelope: &Envelope,
    dst: &mut BytesMut,
    max_frame_len: usize,
) -> Result<(), EncodeError> {
    use super::field::{delimited_len, put_delimited_head};
    // A tunnel frame, the commonest message, is written by hand: the same bytes.
    if let Some(super::Body::ProviderTunnelFrame(frame)) = &envelope.body
        && let Some(message_len) = tunnel_frame::message_len(frame)
    {
        let len = delimited_len(tunnel_frame::ENVELOPE_FIELD, message_len);
        let header = frame_header(len, max_frame_len)?;
        dst.reserve(HEADER_LEN + len);
        dst.put_u32(header);
        put_delimited_head(dst, tunnel_frame::ENVELOPE_FIELD, message_len);
        tunnel_frame::encode_message(frame, dst);
        return Ok(());
    }
    if envelope.body.is_none() {
        return Err(EncodeError::MissingBody);
    }
    let len = envelope.encoded_len();
    let header = frame_header(len, max_frame_len)?;
    dst.reserve(HEADER_LEN + len);
    dst.put_u32(header);
    envelope.encode_raw(dst);
    Ok(())
}

/// One frame as [`FrameDecoder::next_inbound`] reads it.
#[derive(Debug, Clone, PartialEq)]
pub enum Inbound {
    /// A tunnel request, read in place.
    TunnelRequest(TunnelRequest),
    /// Any other envelope, decoded.
    Envelope(Envelope),
}

impl Inbound {
    /// The message name, for logs (as [`Envelope::kind`]).
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Inbound::TunnelRequest(_) => "provider_tunnel_request",
            Inbound::Envelope(envelope) => envelope.kind(),
        }
    }

    /// The envelope this frame carries, as [`FrameDecoder::next_envelope`] decodes it.
    #[must_use]
    pub fn into_envelope(self) -> Envelope {
        match self {
            Inbound::TunnelRequest(request) => request.into(),
            Inbound::Envelope(envelope) => envelope,
        }
    }
}

/// Incremental, IO-free frame decoder.
///
/// Drive it by pushing whatever the transport delivered ([`push`](Self::push) for a
/// borrowed slice, [`push_bytes`](Self::push_bytes) for an owned buffer, which avoids a
/// copy) and then calling [`next_envelope`](Self::next_envelope) until it returns
/// `Ok(None)`. The first error is sticky: every later call returns it again and further
/// input is dropped.
///
/// ```
/// use bytes::BytesMut;
/// use iop_proto_core::wire::{self, Body, Envelope, FrameDecoder, Heartbeat};
///
/// let mut out = BytesMut::new();
/// let ping = Envelope::new(Body::Heartbeat(Heartbeat { nonce: 7, sent_at_ms: 1 }));
/// wire::encode(&ping, &mut out).unwrap();
///
/// let mut decoder = FrameDecoder::new();
/// let (head, tail) = out.split_at(3);
/// decoder.push(head);
/// assert_eq!(decoder.next_envelope().unwrap(), None); // header incomplete
/// decoder.push(tail);
/// assert_eq!(decoder.next_envelope().unwrap(), Some(ping));
/// ```
#[derive(Debug)]
pub struct FrameDecoder {
    max_frame_len: usize,
    /// Bytes of an incomplete frame, copied from pushed slices.
    buf: BytesMut,
    /// An owned input buffer still being consumed without copying.
    /// Invariant: at most one of `buf` and `chunk` is non-empty.
    chunk: Bytes,
    failed: Option<DecodeError>,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new()
    }
}

/// Frames above this size do not leave the copy buffer sharing their allocation (below
/// it, reusing the buffer is worth pinning up to twice this much per connection).
const RETAIN_LIMIT: usize = 1 << 20;

impl FrameDecoder {
    /// A decoder with the default 16 MiB frame limit.
    #[must_use]
    pub fn new() -> Self {
        Self::with_max_frame_len(DEFAULT_MAX_FRAME_LEN)
    }

    /// A decoder refusing frames longer than `max_frame_len` bytes (header excluded).
    #[must_use]
    pub fn with_max_frame_len(max_frame_len: usize) -> Self {
        FrameDecoder {
            max_frame_len,
            buf: BytesMut::new(),
            chunk: Bytes::new(),
            failed: None,
        }
    }

    /// The frame limit in force.
    #[must_use]
    pub fn max_frame_len(&self) -> usize {
        self.max_frame_len
    }

    /// Changes the limit; it applies to every frame not yet returned (the Edge raises it
    /// once a connection has registered).
    pub fn set_max_frame_len(&mut self, max_frame_len: usize) {
        self.max_frame_len = max_frame_len;
    }

    /// Appends received bytes (copied). Ignored once the decoder has failed.
    pub fn push(&mut self, data: &[u8]) {
        if self.failed.is_some() || data.is_empty() {
            return;
        }
        self.spill_chunk();
        self.buf.extend_from_slice(data);
    }

    /// Appends an owned buffer of received bytes. Whole frames inside it are decoded
    /// without copying; only an incomplete tail is copied. Ignored once failed.
    pub fn push_bytes(&mut self, data: Bytes) {
        if self.failed.is_some() || data.is_empty() {
            return;
        }
        if self.buf.is_empty() && self.chunk.is_empty() {
            self.chunk = data;
        } else {
            self.spill_chunk();
            self.buf.extend_from_slice(&data);
        }
    }

    /// The next whole envelope, `Ok(None)` when more bytes are needed, or the error that
    /// failed the stream.
    pub fn next_envelope(&mut self) -> Result<Option<Envelope>, DecodeError> {
        self.next_decoded(decode_envelope)
    }

    /// The next whole frame as [`next_envelope`](Self::next_envelope) decodes it, but
    /// with a tunnel request read in place ([`TunnelRequest`]) rather than decoded into
    /// owned strings: what the Node reads its frames with.
    pub fn next_inbound(&mut self) -> Result<Option<Inbound>, DecodeError> {
        self.next_decoded(|frame| match TunnelRequest::read_frame(&frame) {
            Some(request) => Ok(Inbound::TunnelRequest(request)),
            None => decode_envelope(frame).map(Inbound::Envelope),
        })
    }

    /// The next whole frame through `decode`; its first error fails the decoder.
    fn next_decoded<T>(
        &mut self,
        decode: impl FnOnce(Bytes) -> Result<T, DecodeError>,
    ) -> Result<Option<T>, DecodeError> {
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        let result = self
            .next_frame()
            .and_then(|frame| frame.map(decode).transpose());
        if let Err(err) = &result {
            self.fail(err.clone());
        }
        result
    }

    /// Declares the end of the stream: an error if it stopped inside a frame or the
    /// decoder had failed.
    pub fn finish(&self) -> Result<(), DecodeError> {
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        match self.buffered_len() {
            0 => Ok(()),
            buffered => Err(DecodeError::Truncated { buffered }),
        }
    }

    /// Bytes received but not yet returned as envelopes.
    #[must_use]
    pub fn buffered_len(&self) -> usize {
        self.buf.len() + self.chunk.len()
    }

    /// Memory the decoder holds for buffered input (capacity of its copy buffer plus the
    /// owned input it still references).
    #[must_use]
    pub fn buffer_capacity(&self) -> usize {
        self.buf.capacity() + self.chunk.len()
    }

    /// The error that failed this decoder, if any.
    #[must_use]
    pub fn error(&self) -> Option<&DecodeError> {
        self.failed.as_ref()
    }

    fn fail(&mut self, err: DecodeError) {
        self.failed = Some(err);
        self.buf = BytesMut::new();
        self.chunk = Bytes::new();
    }

    /// Moves an owned input buffer into the copy buffer, keeping the byte order.
    fn spill_chunk(&mut self) {
        if !self.chunk.is_empty() {
            debug_assert!(self.buf.is_empty());
            self.buf.extend_from_slice(&self.chunk);
            self.chunk = Bytes::new();
        }
    }

    /// Splits the next complete frame body off the input, checking its length first.
    fn next_frame(&mut self) -> Result<Option<Bytes>, DecodeError> {
        let source: &[u8] = if self.chunk.is_empty() {
            &self.buf
        } else {
            &self.chunk
        };
        let Some(header) = source.first_chunk::<HEADER_LEN>() else {
            self.spill_chunk();
            return Ok(None);
        };
        let announced = u32::from_be_bytes(*header);
        let len = usize::try_from(announced).unwrap_or(usize::MAX);
        if len > self.max_frame_len {
            return Err(DecodeError::FrameTooLarge {
                len: u64::from(announced),
                max: self.max_frame_len,
            });
        }
        if source.len() - HEADER_LEN < len {
            self.spill_chunk();
            return Ok(None);
        }
        let frame = if self.chunk.is_empty() {
            self.buf.advance(HEADER_LEN);
            let frame = self.buf.split_to(len).freeze();
            if len > RETAIN_LIMIT {
                // The copy buffer shares the frame's allocation; holding on to it (even
                // empty) would pin up to twice the largest frame for the connection's
                // life. Start a fresh one with whatever followed the frame.
                self.buf = BytesMut::from(&self.buf[..]);
            }
            frame
        } else {
            self.chunk.advance(HEADER_LEN);
            self.chunk.split_to(len)
        };
        Ok(Some(frame))
    }
}

/// Decodes one frame body. `frame` is a `Bytes`, so prost slices it for `bytes` fields.
fn decode_envelope(frame: Bytes) -> Result<Envelope, DecodeError> {
    // A tunnel frame, the commonest message, is read by hand where it can be: the same
    // message prost decodes.
    let frame = match tunnel_frame::read_frame(frame) {
        Ok(tunnel) => return Ok(Envelope::new(super::Body::ProviderTunnelFrame(tunnel))),
        Err(frame) => frame,
    };
    let len = frame.len();
    let envelope =
        Envelope::decode(frame).map_err(|source| DecodeError::Malformed { len, source })?;
    if envelope.body.is_none() {
        return Err(DecodeError::MissingBody { len });
    }
    Ok(envelope)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_frame_assembled_from_pieces_does_not_stay_pinned_by_the_decoder() {
        let body = Bytes::from(vec![7u8; 1 << 20]);
        let envelope = Envelope::new(Body::ProviderTunnelFrame(ProviderTunnelFrame {
            run_id: "run-1".into(),
            sequence: 1,
            kind: TunnelFrameKind::Body as i32,
            body: body.clone(),
            ..ProviderTunnelFrame::default()
        }));
        let mut wire = framed(&[envelope.clone(), heartbeat(1)]);
        let tail = wire.split_off(wire.len() / 2);
        let mut decoder = FrameDecoder::new();
        decoder.push(&wire);
        decoder.push(&tail[..tail.len() - 3]);
        let Some(Body::ProviderTunnelFrame(frame)) =
            decoder.next_envelope().expect("valid").and_then(|e| e.body)
        else {
            panic!("the body frame");
        };
        assert_eq!(frame.body, body);
        assert!(
            frame.body.is_unique(),
            "the decoder still references the large frame's allocation"
        );
        decoder.push(&tail[tail.len() - 3..]);
        assert_eq!(decoder.next_envelope().expect("valid"), Some(heartbeat(1)));
        assert!(decoder.buffer_capacity() < RETAIN_LIMIT);
    }
    use crate::wire::{Body, Heartbeat, ProviderTunnelFrame, TunnelFrameKind};

    fn heartbeat(nonce: u64) -> Envelope {
        Envelope::new(Body::Heartbeat(Heartbeat {
            nonce,
            sent_at_ms: 0,
        }))
    }

    fn framed(envelopes: &[Envelope]) -> BytesMut {
        let mut out = BytesMut::new();
        for envelope in envelopes {
            encode(envelope, &mut out).expect("encodes");
        }
        out
    }

    #[test]
    fn header_claiming_4_gib_is_rejected_without_reserving() {
        let mut decoder = FrameDecoder::new();
        decoder.push(&u32::MAX.to_be_bytes());
        assert_eq!(
            decoder.next_envelope(),
            Err(DecodeError::FrameTooLarge {
                len: u64::from(u32::MAX),
                max: DEFAULT_MAX_FRAME_LEN
            })
        );
        assert!(
            decoder.buffer_capacity() < 64,
            "{}",
            decoder.buffer_capacity()
        );
    }

    #[test]
    fn header_alone_pins_no_memory_even_when_within_limit() {
        let mut decoder = FrameDecoder::new();
        let len = u32::try_from(DEFAULT_MAX_FRAME_LEN).expect("fits");
        decoder.push(&len.to_be_bytes());
        assert_eq!(decoder.next_envelope(), Ok(None));
        decoder.push(&[0u8; 100]);
        assert_eq!(decoder.next_envelope(), Ok(None));
        assert!(
            decoder.buffer_capacity() < 1024,
            "{}",
            decoder.buffer_capacity()
        );
        assert_eq!(decoder.buffered_len(), 104);
    }

    #[test]
    fn limit_is_inclusive_and_configurable() {
        let envelope = heartbeat(1);
        let len = envelope.encoded_len();
        let mut ok = FrameDecoder::with_max_frame_len(len);
        ok.push(&framed(std::slice::from_ref(&envelope)));
        assert_eq!(ok.next_envelope(), Ok(Some(envelope.clone())));

        let mut too_small = FrameDecoder::with_max_frame_len(len - 1);
        too_small.push(&framed(std::slice::from_ref(&envelope)));
        assert!(matches!(
            too_small.next_envelope(),
            Err(DecodeError::FrameTooLarge { .. })
        ));

        let mut out = BytesMut::new();
        assert_eq!(
            encode_with_limit(&envelope, &mut out, len - 1),
            Err(EncodeError::FrameTooLarge { len, max: len - 1 })
        );
        assert!(out.is_empty());
    }

    #[test]
    fn errors_are_sticky_and_drop_buffers() {
        let mut decoder = FrameDecoder::new();
        // Length 3, then three bytes that are not a valid protobuf (field 0 is illegal).
        decoder.push(&[0, 0, 0, 3, 0, 0, 0]);
        let err = decoder.next_envelope().expect_err("malformed");
        assert!(
            matches!(err, DecodeError::Malformed { len: 3, .. }),
            "{err}"
        );
        decoder.push(&framed(&[heartbeat(1)]));
        assert_eq!(decoder.next_envelope(), Err(err.clone()));
        assert_eq!(decoder.buffered_len(), 0);
        assert_eq!(decoder.finish(), Err(err));
    }

    #[test]
    fn empty_or_unknown_body_is_rejected() {
        let mut decoder = FrameDecoder::new();
        decoder.push(&[0, 0, 0, 0]);
        assert_eq!(
            decoder.next_envelope(),
            Err(DecodeError::MissingBody { len: 0 })
        );

        // Field 99 (unknown to this schema), varint 1: prost skips it, leaving no body.
        let mut decoder = FrameDecoder::new();
        decoder.push(&[0, 0, 0, 3, 0x98, 0x06, 0x01]);
        assert_eq!(
            decoder.next_envelope(),
            Err(DecodeError::MissingBody { len: 3 })
        );
    }

    #[test]
    fn encode_refuses_an_empty_envelope() {
        let mut out = BytesMut::new();
        assert_eq!(
            encode(&Envelope::default(), &mut out),
            Err(EncodeError::MissingBody)
        );
    }

    #[test]
    fn truncated_stream_is_reported_on_finish() {
        let mut decoder = FrameDecoder::new();
        let bytes = framed(&[heartbeat(9)]);
        decoder.push(&bytes[..bytes.len() - 1]);
        assert_eq!(decoder.next_envelope(), Ok(None));
        assert_eq!(
            decoder.finish(),
            Err(DecodeError::Truncated {
                buffered: bytes.len() - 1
            })
        );
        decoder.push(&bytes[bytes.len() - 1..]);
        assert_eq!(decoder.next_envelope(), Ok(Some(heartbeat(9))));
        assert_eq!(decoder.finish(), Ok(()));
    }

    #[test]
    fn body_frame_payload_is_a_slice_of_the_input() {
        let payload = Bytes::from(vec![0xAB; 64 * 1024]);
        let envelope = Envelope::new(Body::ProviderTunnelFrame(ProviderTunnelFrame {
            run_id: "run-1".into(),
            sequence: 3,
            kind: TunnelFrameKind::Body as i32,
            body: payload.clone(),
            ..Default::default()
        }));
        let input = framed(&[envelope.clone(), heartbeat(1)]).freeze();
        let range = input.as_ptr() as usize..input.as_ptr() as usize + input.len();

        let mut decoder = FrameDecoder::new();
        decoder.push_bytes(input.clone());
        let Some(Envelope {
            body: Some(Body::ProviderTunnelFrame(frame)),
        }) = decoder.next_envelope().expect("decodes")
        else {
            panic!("expected a tunnel frame");
        };
        assert_eq!(frame.body, payload);
        assert!(
            range.contains(&(frame.body.as_ptr() as usize)),
            "BODY payload was copied instead of sliced"
        );
        assert_eq!(decoder.next_envelope(), Ok(Some(heartbeat(1))));
        assert_eq!(decoder.next_envelope(), Ok(None));
    }

    #[test]
    fn owned_and_borrowed_pushes_interleave_in_order() {
        let envelopes: Vec<_> = (0..5).map(heartbeat).collect();
        let bytes = framed(&envelopes).freeze();
        let mut decoder = FrameDecoder::new();
        decoder.push_bytes(bytes.slice(..5));
        decoder.push(&bytes[5..9]);
        decoder.push_bytes(bytes.slice(9..20));
        decoder.push_bytes(bytes.slice(20..));
        let mut got = Vec::new();
        while let Some(envelope) = decoder.next_envelope().expect("valid") {
            got.push(envelope);
        }
        assert_eq!(got, envelopes);
    }
}
