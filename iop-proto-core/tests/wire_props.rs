//! Properties of the frame codec over arbitrary envelopes of every variant.

mod common;

use bytes::{Bytes, BytesMut};
use common::arb;
use iop_proto_core::wire::{self, Envelope, FrameDecoder};
use proptest::collection::vec;
use proptest::prelude::*;

fn frames(envelopes: &[Envelope]) -> Bytes {
    let mut out = BytesMut::new();
    for envelope in envelopes {
        wire::encode(envelope, &mut out).expect("encodes");
    }
    out.freeze()
}

fn drain(decoder: &mut FrameDecoder) -> Vec<Envelope> {
    let mut out = Vec::new();
    while let Some(envelope) = decoder.next_envelope().expect("valid stream") {
        out.push(envelope);
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Every variant survives encode → decode unchanged.
    #[test]
    fn every_envelope_round_trips(envelope in arb::envelope()) {
        let mut decoder = FrameDecoder::new();
        decoder.push_bytes(frames(std::slice::from_ref(&envelope)));
        prop_assert_eq!(decoder.next_envelope(), Ok(Some(envelope)));
        prop_assert_eq!(decoder.next_envelope(), Ok(None));
        prop_assert_eq!(decoder.finish(), Ok(()));
    }

    /// Any split of a valid concatenated stream, fed through either push method, decodes
    /// to the same envelopes in the same order.
    #[test]
    fn any_split_decodes_the_same(
        envelopes in vec(arb::envelope(), 1..8),
        cuts in vec(any::<prop::sample::Index>(), 0..16),
        owned in vec(any::<bool>(), 17),
    ) {
        let stream = frames(&envelopes);
        let mut points: Vec<usize> = cuts.iter().map(|i| i.index(stream.len() + 1)).collect();
        points.push(0);
        points.push(stream.len());
        points.sort_unstable();
        points.dedup();

        let mut decoder = FrameDecoder::new();
        let mut got = Vec::new();
        for (n, pair) in points.windows(2).enumerate() {
            let piece = stream.slice(pair[0]..pair[1]);
            if owned[n % owned.len()] {
                decoder.push_bytes(piece);
            } else {
                decoder.push(&piece);
            }
            got.extend(drain(&mut decoder));
        }
        prop_assert_eq!(got, envelopes);
        prop_assert_eq!(decoder.finish(), Ok(()));
    }

    /// A decoder never holds memory for bytes it has only been promised.
    #[test]
    fn memory_tracks_received_bytes_not_announced_length(announced in 0u32..=u32::MAX, sent in 0usize..4096) {
        let mut decoder = FrameDecoder::new();
        decoder.push(&announced.to_be_bytes());
        decoder.push(&vec![0u8; sent]);
        let _ = decoder.next_envelope();
        prop_assert!(decoder.buffer_capacity() <= 2 * (sent + 4) + 64);
    }
}
