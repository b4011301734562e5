//! The response store under 100,000 stored responses: what it counts and what the
//! process holds (RSS from `/proc/self/statm`), at the default caps and at caps large
//! enough for every one. `cargo run --release -p iop-api --example store_memory`.

use std::sync::Arc;

use bytes::Bytes;
use iop_api::responses::{Store, Stored};

/// Resident set size in bytes (Linux), 0 elsewhere.
fn rss() -> usize {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<usize>().ok())
        .map_or(0, |pages| pages * 4096)
}

fn fill(store: &mut Store, n: usize) {
    let owner: Arc<str> = Arc::from("team-a");
    for i in 0..n {
        // A short conversation (three turns) and its response object, as a chat client
        // stores them: about 1.2 KiB and 1.1 KiB.
        let conversation = format!(
            r#"[{{"role":"user","content":"Question {i}: what is the weather in Paris today, and should I take an umbrella?"}},{{"role":"assistant","content":"It is sunny in Paris today with a light breeze; no umbrella is needed. {}"}},{{"role":"user","content":"And tomorrow?"}},{{"role":"assistant","content":"{}"}}]"#,
            "x".repeat(600),
            "y".repeat(300)
        );
        let response = format!(
            r#"{{"id":"resp_{i:016x}","object":"response","created_at":1764806400,"status":"completed","model":"chat","output":[{{"id":"msg_{i}_0","type":"message","status":"completed","role":"assistant","content":[{{"type":"output_text","text":"{}","annotations":[]}}]}}],"usage":{{"input_tokens":212,"output_tokens":75,"total_tokens":287}}}}"#,
            "y".repeat(800)
        );
        store.insert(
            &format!("resp_{i:016x}"),
            Stored {
                owner: owner.clone(),
                conversation: Arc::from(conversation),
                response: Bytes::from(response),
            },
        );
    }
}

fn main() {
    const N: usize = 100_000;
    for (label, entries, bytes) in [
        ("default caps (10,000 entries, 64 MiB)", 10_000, 64 << 20),
        ("caps for all (100,000 entries, 1 GiB)", 100_000, 1 << 30),
    ] {
        let before = rss();
        let mut store = Store::new(entries, bytes);
        fill(&mut store, N);
        let figures = store.figures();
        let after = rss();
        println!(
            "{label}: {N} stored, {} kept, {} evicted; counted {:.1} MiB, RSS +{:.1} MiB ({:.0} B per entry kept)",
            figures.entries,
            figures.evicted,
            figures.bytes as f64 / f64::from(1 << 20),
            after.saturating_sub(before) as f64 / f64::from(1 << 20),
            after.saturating_sub(before) as f64 / figures.entries.max(1) as f64,
        );
        assert!(figures.entries <= entries && figures.bytes <= bytes);
        drop(store);
    }
}
