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

/// `envelope` with its tunnel request body or run input (when it has one) replaced by
/// `len` bytes of a pattern.
fn with_payload(mut envelope: Envelope, len: usize) -> Envelope {
    let payload: Bytes = (0..len)
        .map(|i| (i % 251) as u8)
        .collect::<Vec<u8>>()
        .into();
    match &mut envelope.body {
        Some(wire::Body::ProviderTunnelRequest(tunnel)) => tunnel.body = payload,
        Some(wire::Body::RunRequest(run)) => run.input = payload,
        _ => {}
    }
    envelope
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// A frame whose large payload is handed back for a write of its own is, head and
    /// payload written one after the other, a frame that decodes to the same envelope;
    /// the envelope is left as it was, and a frame with nothing to split is byte for
    /// byte the one `encode` writes.
    #[test]
    fn a_split_frame_decodes_to_the_same_envelope(
        envelope in arb::envelope(),
        len in prop_oneof![
            0usize..64,
            Just(wire::SPLIT_PAYLOAD_MIN - 1),
            Just(wire::SPLIT_PAYLOAD_MIN),
            wire::SPLIT_PAYLOAD_MIN..4 * wire::SPLIT_PAYLOAD_MIN,
        ],
    ) {
        let envelope = with_payload(envelope, len);
        let mut sent = envelope.clone();
        let mut head = BytesMut::from(&b"before"[..]);
        let payload = wire::encode_split(&mut sent, &mut head, wire::DEFAULT_MAX_FRAME_LEN)
            .expect("encodes");
        prop_assert_eq!(&sent, &envelope);
        let head = head.split_off(6).freeze();
        let carries = matches!(
            envelope.body,
            Some(wire::Body::ProviderTunnelRequest(_) | wire::Body::RunRequest(_))
        );
        match &payload {
            Some(payload) => {
                prop_assert!(carries && len >= wire::SPLIT_PAYLOAD_MIN);
                prop_assert_eq!(payload.len(), len);
                prop_assert_eq!(head.len() + len, wire::encoded_frame_len(&envelope));
            }
            None => {
                prop_assert!(!carries || len < wire::SPLIT_PAYLOAD_MIN);
                prop_assert_eq!(&head, &frames(std::slice::from_ref(&envelope)));
            }
        }
        let mut decoder = FrameDecoder::new();
        decoder.push_bytes(head);
        if let Some(payload) = payload {
            decoder.push_bytes(payload);
        }
        prop_assert_eq!(decoder.next_envelope(), Ok(Some(envelope)));
        prop_assert_eq!(decoder.next_envelope(), Ok(None));
    }
}

/// A split frame over the limit is refused like any other: nothing written, the envelope
/// whole.
#[test]
fn a_split_frame_over_the_limit_is_refused_and_nothing_is_taken() {
    let envelope = with_payload(
        Envelope::new(wire::Body::ProviderTunnelRequest(
            wire::ProviderTunnelRequest {
                run_id: "r".into(),
                ..wire::ProviderTunnelRequest::default()
            },
        )),
        wire::SPLIT_PAYLOAD_MIN * 2,
    );
    let mut sent = envelope.clone();
    let mut dst = BytesMut::new();
    let refused = wire::encode_split(&mut sent, &mut dst, wire::SPLIT_PAYLOAD_MIN);
    assert!(matches!(
        refused,
        Err(wire::EncodeError::FrameTooLarge { max, .. }) if max == wire::SPLIT_PAYLOAD_MIN
    ));
    assert!(dst.is_empty());
    assert_eq!(sent, envelope);
}
