//! Fuzz entry points. Each takes arbitrary bytes, drives one input surface and panics
//! only when an invariant breaks. The cargo-fuzz targets under `fuzz/` call these, and
//! the crate's tests replay the committed corpus through them on stable.

use bytes::{Bytes, BytesMut};

use crate::wire::{self, DecodeError, Envelope, FrameDecoder, Validate};

/// Feeds `data` to a [`FrameDecoder`] in uneven pieces and checks that:
/// the result does not depend on how the input was split; the decoder never holds more
/// memory than the input warrants; an error is sticky; every decoded envelope validates
/// or fails validation without panicking, and re-encodes to a frame that decodes to the
/// same envelope.
pub fn frame_decoder(data: &[u8]) {
    // Small limit so the fuzzer can reach the oversized path cheaply.
    const MAX: usize = 4096;
    let whole = decode_all(MAX, |decoder| {
        decoder.push_bytes(Bytes::copy_from_slice(data))
    });
    let split = decode_all(MAX, |decoder| {
        // Piece sizes drawn from the data itself: deterministic per input.
        let mut rest = data;
        let mut i = 0usize;
        while !rest.is_empty() {
            let size = 1 + usize::from(data[i % data.len()]) % 7;
            let (piece, tail) = rest.split_at(size.min(rest.len()));
            if i % 2 == 0 {
                decoder.push(piece);
            } else {
                decoder.push_bytes(Bytes::copy_from_slice(piece));
            }
            rest = tail;
            i += 1;
        }
    });
    assert_eq!(whole, split, "decoding depends on how the input was split");

    let (envelopes, outcome) = whole;
    for envelope in &envelopes {
        let _ = envelope.validate();
        let mut out = BytesMut::new();
        wire::encode_with_limit(envelope, &mut out, usize::MAX)
            .expect("decoded envelope re-encodes");
        let mut again = FrameDecoder::new();
        again.push_bytes(out.freeze());
        assert_eq!(again.next_envelope().as_ref(), Ok(&Some(envelope.clone())));
    }
    if let Err(err) = outcome {
        let _ = err.to_string();
    }
}

type Decoded = (Vec<Envelope>, Result<(), DecodeError>);

fn decode_all(max: usize, feed: impl FnOnce(&mut FrameDecoder)) -> Decoded {
    let mut decoder = FrameDecoder::with_max_frame_len(max);
    feed(&mut decoder);
    // Memory held is bounded by what was received, never by what a header promised.
    assert!(decoder.buffer_capacity() <= 2 * decoder.buffered_len() + 64);
    let mut envelopes = Vec::new();
    loop {
        match decoder.next_envelope() {
            Ok(Some(envelope)) => envelopes.push(envelope),
            Ok(None) => return (envelopes, decoder.finish().or_else(truncation_is_ok)),
            Err(err) => {
                assert_eq!(
                    decoder.next_envelope(),
                    Err(err.clone()),
                    "errors are sticky"
                );
                assert_eq!(decoder.buffered_len(), 0);
                return (envelopes, Err(err));
            }
        }
    }
}

fn truncation_is_ok(err: DecodeError) -> Result<(), DecodeError> {
    match err {
        DecodeError::Truncated { .. } => Ok(()),
        other => Err(other),
    }
}
