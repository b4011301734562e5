//! Handshake harness: how long 1,000 nodes take to register and become ready, on a cold
//! start and again after the Edge restarts, over TLS and over plaintext, each once without
//! jitter and once with the node's default, beside bare TCP connects and bare clients that
//! redial by the same policy, in one run. How each row is measured: `iop_blackbox::fleet`
//! (`bench` puts the rows of the default jitter in its own table). Each restart figure is
//! the median of five (`fleet::RESTARTS`); the last column is the restart over the bare
//! reconnects of the same link.
//!
//! Run: `cargo run --release -p iop-blackbox --bin reconnect -- [nodes]` (it builds the Edge and
//! the Node first).

use iop_blackbox::client::Link;
use iop_blackbox::fleet::{self, count, raw_connects, seconds};
use iop_proto_core::reconnect::DEFAULT_JITTER;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    iop_blackbox::build_binaries();
    let nodes: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let raw = raw_connects(nodes).await;
    println!(
        "| node link | node jitter | {} nodes ready, cold start | ready again after an Edge restart | Edge CPU per registration | Edge memory per idle node | bare TCP connects (reference) | bare TCP reconnects after a listener restart, same redial policy (reference) | bare TLS reconnects, same redial policy, certificate and server settings (reference) | restart ÷ bare reconnects over the same link |",
        count(nodes)
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let runs = [
        (Link::Tls, 0.0),
        (Link::Tls, DEFAULT_JITTER),
        (Link::Plaintext, 0.0),
        (Link::Plaintext, DEFAULT_JITTER),
    ];
    for (link, jitter) in runs {
        let row = fleet::measure(nodes, link, jitter, raw).await;
        println!(
            "| {} | {} | {} | {} | {:.0} µs (cold) / {:.0} µs (restart) | {:.1} KiB | {:.3} s | {:.3} s | {} | {} |",
            row.link_name(),
            row.jitter,
            seconds(row.cold),
            seconds(row.again),
            row.cold_cpu.as_secs_f64() * 1e6,
            row.restart_cpu.as_secs_f64() * 1e6,
            row.per_node_kib,
            row.raw.as_secs_f64(),
            row.raw_again.as_secs_f64(),
            row.tls_again
                .map_or_else(|| "–".to_owned(), |d| format!("{:.3} s", d.as_secs_f64())),
            row.restart_ratio()
                .map_or_else(|| "–".to_owned(), |r| format!("{r:.2}×")),
        );
    }
}
