//! Encode and decode cost of the frame codec, against a plain memcpy of the same bytes
//! measured in the same group (the ratio is what BENCHMARKS.md records).
//!
//! Run: `cargo bench -p iop-proto-core --bench codec`

use std::hint::black_box;

use bytes::{Bytes, BytesMut};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use iop_proto_core::wire::{
    self, Body, Envelope, FrameDecoder, Heartbeat, ProviderTunnelFrame, RunEvent, RunEventType,
    TunnelFrameKind,
};

fn body_frame() -> Envelope {
    Envelope::new(Body::ProviderTunnelFrame(ProviderTunnelFrame {
        run_id: "run-0000000000000001".into(),
        sequence: 17,
        kind: TunnelFrameKind::Body as i32,
        body: Bytes::from(vec![b'x'; 64 * 1024]),
        ..Default::default()
    }))
}

fn small_frames() -> Vec<(&'static str, Envelope)> {
    vec![
        (
            "heartbeat",
            Envelope::new(Body::Heartbeat(Heartbeat {
                nonce: 123_456,
                sent_at_ms: 1_700_000_000_000,
            })),
        ),
        (
            "run_event_delta",
            Envelope::new(Body::RunEvent(RunEvent {
                run_id: "run-0000000000000001".into(),
                sequence: 42,
                r#type: RunEventType::Delta as i32,
                delta: "Hello, wor".into(),
                ..Default::default()
            })),
        ),
    ]
}

fn framed(envelope: &Envelope) -> Bytes {
    let mut out = BytesMut::new();
    wire::encode(envelope, &mut out).expect("encodes");
    out.freeze()
}

fn bench_envelope(c: &mut Criterion, group_name: &str, envelope: &Envelope) {
    let frame = framed(envelope);
    let mut group = c.benchmark_group(group_name);
    group.throughput(Throughput::Bytes(frame.len() as u64));

    let mut scratch = Vec::with_capacity(frame.len());
    group.bench_function("memcpy_baseline", |b| {
        b.iter(|| {
            scratch.clear();
            scratch.extend_from_slice(black_box(&frame));
            black_box(&scratch);
        });
    });

    let mut out = BytesMut::with_capacity(frame.len());
    group.bench_function("encode", |b| {
        b.iter(|| {
            out.clear();
            wire::encode(black_box(envelope), &mut out).expect("encodes");
            black_box(&out);
        });
    });

    let mut decoder = FrameDecoder::new();
    group.bench_function("decode_copied_slice", |b| {
        b.iter(|| {
            decoder.push(black_box(&frame));
            black_box(decoder.next_envelope().expect("valid").expect("whole"));
        });
    });

    let mut decoder = FrameDecoder::new();
    group.bench_function("decode_owned_bytes", |b| {
        b.iter(|| {
            decoder.push_bytes(black_box(frame.clone()));
            black_box(decoder.next_envelope().expect("valid").expect("whole"));
        });
    });
    group.finish();
}

fn codec(c: &mut Criterion) {
    bench_envelope(c, "body_64k", &body_frame());
    for (name, envelope) in small_frames() {
        bench_envelope(c, &format!("small_{name}"), &envelope);
    }
}

criterion_group!(benches, codec);
criterion_main!(benches);
