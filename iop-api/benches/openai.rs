//! What the Edge spends reading an OpenAI request body, per byte, as the body grows:
//! [`inspect`] (the admission facts: model, stream, input present, prompt tokens), its
//! token estimate alone, and the model rewrite a dispatch makes. Bodies are chat requests
//! of English prose, and of Japanese prose with escapes, the way SDKs send them.
//!
//! Baseline: `json_skim_baseline` runs serde_json over the same bytes without keeping
//! anything (`IgnoredAny`), the least any gateway that reads a JSON body pays.
//!
//! Run: `cargo bench -p iop-api --bench openai`

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use iop_api::openai::{Endpoint, estimate_tokens, inspect};
use iop_json::rewrite_model;

const ENGLISH: &str = "The quick brown fox jumps over the lazy dog, and then it \
    considers the implications of 42 sleepy hounds in 2026. Tokenizers split words, \
    punctuation; numbers like 3.14159 and identifiers such as parse_request_v2 too! ";

const JAPANESE: &str = "今日はいい天気ですね。東京の空は青く、風が気持ちいい。\\n\
    「トークン」を数えるのは難しい。";

/// A chat body of about `size` bytes: a system prompt and user turns of `text`.
fn body(text: &str, size: usize) -> Vec<u8> {
    let mut messages =
        vec![r#"{"role":"system","content":"You are a helpful assistant."}"#.to_owned()];
    let mut len = 0;
    while len < size {
        let mut content = String::new();
        while content.len() < 1024.min(size.saturating_sub(len).max(64)) {
            content.push_str(text);
        }
        len += content.len() + 32;
        messages.push(format!(r#"{{"role":"user","content":"{content}"}}"#));
    }
    format!(
        r#"{{"messages":[{}],"model":"llama3","stream":true,"temperature":0.2}}"#,
        messages.join(",")
    )
    .into_bytes()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("request body");
    for (script, text) in [("english", ENGLISH), ("japanese", JAPANESE)] {
        for size in [1 << 10, 16 << 10, 128 << 10] {
            let raw = body(text, size);
            group.throughput(Throughput::Bytes(raw.len() as u64));
            let id = format!("{script}/{}KiB", size >> 10);
            group.bench_with_input(
                BenchmarkId::new("json_skim_baseline", &id),
                &raw,
                |b, raw| {
                    b.iter(|| {
                        serde_json::from_slice::<serde::de::IgnoredAny>(black_box(raw)).is_ok()
                    });
                },
            );
            group.bench_with_input(BenchmarkId::new("inspect", &id), &raw, |b, raw| {
                b.iter(|| inspect(black_box(raw), Endpoint::Chat).map(|f| f.prompt_tokens));
            });
            group.bench_with_input(BenchmarkId::new("estimate_tokens", &id), &raw, |b, raw| {
                b.iter(|| estimate_tokens(black_box(raw)));
            });
            group.bench_with_input(BenchmarkId::new("rewrite_model", &id), &raw, |b, raw| {
                b.iter(|| rewrite_model(black_box(raw), "llama3:8b").map(|b| b.len()));
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
