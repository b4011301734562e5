//! What placing a request by its conversation costs (README, "Placing a conversation"):
//! reading a 32,000-character chat prompt (its anchor and its block fingerprint) and
//! looking its prefix up for four providers, as the Edge does at each pick; and the
//! prefix index's memory once 100,000 conversations were sent.
//!
//! Run: `cargo bench -p iop-proto-core --bench affinity` (it prints the p99 of the whole
//! placement over 10,000 runs and the index's size besides criterion's figures).

use std::hint::black_box;
use std::time::Instant;

use criterion::{Criterion, criterion_group, criterion_main};
use iop_proto_core::edge::{AffinityMode, Placement, PrefixIndex, ResourceId};
use iop_proto_core::testkit::internals::Ledger;

/// A chat body of about `chars` characters: a system prompt, then turns.
fn body(chars: usize, conversation: usize) -> Vec<u8> {
    let mut messages = vec![format!(
        r#"{{"role":"system","content":"{}"}}"#,
        "You are a careful assistant. ".repeat(40)
    )];
    let mut turn = 0;
    while messages.iter().map(String::len).sum::<usize>() < chars {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        messages.push(format!(
            r#"{{"role":"{role}","content":"conversation {conversation} turn {turn}: {}"}}"#,
            "some words of the turn ".repeat(30)
        ));
        turn += 1;
    }
    format!(
        r#"{{"model":"m","stream":true,"messages":[{}]}}"#,
        messages.join(",")
    )
    .into_bytes()
}

fn providers() -> Vec<ResourceId> {
    let mut ledger = Ledger::new();
    (0..4).map(|_| ledger.add_resource()).collect()
}

/// Placement and lookup for four providers, as a pick does them.
fn place(index: &PrefixIndex, body: &[u8], providers: &[ResourceId]) -> usize {
    let placement = Placement::of(AffinityMode::Prefix, "m", None, body, 2048).expect("placed");
    let names = ["n0", "n1", "n2", "n3"];
    providers
        .iter()
        .zip(names)
        .map(|(&r, name)| index.matched(&placement, r) + (placement.rank((name, "a")) as usize & 1))
        .sum()
}

fn bench(c: &mut Criterion) {
    let providers = providers();
    let mut index = PrefixIndex::new(1 << 20);
    let long = body(32_000, 0);
    let placement = Placement::of(AffinityMode::Prefix, "m", None, &long, 2048).expect("placed");
    index.record(&placement, providers[1]);
    c.bench_function("place a 32k-character prompt over 4 providers", |b| {
        b.iter(|| place(&index, black_box(&long), &providers));
    });
    // The p99 of the same, one run at a time.
    let mut times: Vec<u128> = (0..10_000)
        .map(|_| {
            let start = Instant::now();
            black_box(place(&index, black_box(&long), &providers));
            start.elapsed().as_nanos()
        })
        .collect();
    times.sort_unstable();
    eprintln!(
        "placement of a 32k-character prompt: p50 {:.1} µs, p99 {:.1} µs",
        times[times.len() / 2] as f64 / 1000.0,
        times[times.len() * 99 / 100] as f64 / 1000.0
    );
    // 100,000 conversations of about 4,000 characters each, sent over four providers.
    let mut index = PrefixIndex::new(1 << 20);
    for conversation in 0..100_000 {
        let body = body(4_000, conversation);
        let placement =
            Placement::of(AffinityMode::Prefix, "m", None, &body, 2048).expect("placed");
        index.record(&placement, providers[conversation % 4]);
    }
    let (entries, bytes) = index.size();
    eprintln!(
        "prefix index after 100,000 conversations: {entries} entries, {:.1} MiB",
        bytes as f64 / (1 << 20) as f64
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
