//! Handover harness: how long 1,000 connected nodes take to be ready on a successor Edge
//! started with `iop-edge --takeover`, against a cold start of the same system (the Edge
//! process started, the fleet already redialling), over TLS and plaintext. How it is
//! measured: `iop_blackbox::fleet::handover`. Each handover figure is the median of five.
//!
//! Run: `cargo run --release -p iop-blackbox --bin handover -- [nodes]` (it builds the
//! Edge first).

use iop_blackbox::client::Link;
use iop_blackbox::fleet::{self, count, seconds};
use iop_proto_core::reconnect::DEFAULT_JITTER;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    iop_blackbox::build_binaries();
    let nodes: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    println!(
        "| node link | {} nodes ready, cold start (Edge start to all ready) | ready on the successor (its start to all ready, median of {}) | each handover | handover ÷ cold start |",
        count(nodes),
        fleet::HANDOVERS
    );
    println!("|---|---:|---:|---|---:|");
    for link in [Link::Tls, Link::Plaintext] {
        let row = fleet::handover(nodes, link, DEFAULT_JITTER).await;
        let each: Vec<String> = row.each.iter().map(|d| seconds(*d)).collect();
        let ratio = match (row.handover, row.cold) {
            (Some(h), Some(c)) => format!("{:.2}×", h.as_secs_f64() / c.as_secs_f64()),
            _ => "–".to_owned(),
        };
        println!(
            "| {} | {} | {} | {} | {ratio} |",
            if link == Link::Tls {
                "TLS 1.3"
            } else {
                "plaintext"
            },
            seconds(row.cold),
            seconds(row.handover),
            each.join(", "),
        );
    }
}
