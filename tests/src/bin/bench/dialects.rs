//! What the Messages dialect costs: the same requests through one Edge and Node as chat
//! completions (`/v1/chat/completions`) and as Anthropic Messages (`/v1/messages`,
//! translated to chat at the Edge and rendered back), over a tunnel and over a normalized
//! run, interleaved round by round so that machine noise hits both alike.

#[allow(unused_imports)]
use crate::*;
use iop_blackbox::client::{Cluster, Link};
use iop_blackbox::{TempDir, free_port};
use std::process::{Command, Stdio};

const CHAT: &str =
    r#"{"model":"MODEL","max_tokens":64,"messages":[{"role":"user","content":"Say something."}]}"#;
const CHAT_STREAM: &str = r#"{"model":"MODEL","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"Say something."}]}"#;
const MESSAGES: &str = r#"{"model":"MODEL","max_tokens":64,"system":"Be brief.","messages":[{"role":"user","content":[{"type":"text","text":"Say something."}]}]}"#;
const MESSAGES_STREAM: &str = r#"{"model":"MODEL","max_tokens":64,"stream":true,"system":"Be brief.","messages":[{"role":"user","content":[{"type":"text","text":"Say something."}]}]}"#;

/// The bench's model served twice by the fake provider: as a tunnel (`fake`) and as
/// normalized runs (`fake-run`: the OpenAI-compatible adapter with `dispatch = "run"`).
fn config(provider: u16) -> String {
    format!(
        r#"
[[nodes]]
id = "n1"
token = "bench-node-token-0123456789"
[[nodes.adapters]]
name = "oa"
type = "openai_compat"
base_url = "http://127.0.0.1:{provider}"
capacity = 4096
targets = ["fake"]
[[nodes.adapters]]
name = "oa-run"
type = "openai_compat"
base_url = "http://127.0.0.1:{provider}"
capacity = 4096
targets = ["fake"]
[nodes.adapters.options]
dispatch = "run"

[[models]]
name = "fake"
providers = [{{ node = "n1", adapter = "oa", target = "fake" }}]

[[models]]
name = "fake-run"
providers = [{{ node = "n1", adapter = "oa-run", target = "fake" }}]
"#
    )
}

/// `bench dialects [seconds] [rounds]`: p50 and p99 latency of small requests at 1 and
/// 16 callers and of unpaced streams at 16, as chat completions and as Messages, over a
/// tunnel and over a run; medians of the rounds, and what Messages adds. Writes a table
/// to stdout.
pub(crate) fn dialects(seconds: u64, rounds: usize) {
    iop_blackbox::build_binaries();
    ensure_tools();
    let provider_port = free_port();
    let mut provider = Command::new(std::env::current_exe().expect("self"))
        .args(["provider", &provider_port.to_string()])
        .stdout(Stdio::null())
        .spawn()
        .expect("provider starts");
    wait_port(provider_port);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let head = "[limits]\nmax_connections = 8192\nmax_concurrent_requests = 8192\n\n[queue]\nmax_waiting = 8192\n";
    let cluster = Cluster::start_with(Link::Tls, head, &config(provider_port));
    let node = cluster.node_with(
        "n1",
        "bench-node-token-0123456789",
        "max_attempts = 0\ninterval_sec = 0.2",
    );
    runtime.block_on(cluster.wait_ready("n1"));
    let path = Path3 {
        name: "iop",
        port: cluster.http_port,
        pids: vec![cluster.edge.pid(), node.pid()],
        pair: None,
    };
    let dir = TempDir::new("bench-dialects");
    // (row label, model, connections, chat body, messages body)
    let loads: [(&str, &str, usize, &str, &str); 6] = [
        ("tunnel, small, 1 caller", "fake", 1, CHAT, MESSAGES),
        ("tunnel, small, 16 callers", "fake", 16, CHAT, MESSAGES),
        (
            "tunnel, SSE, 16 callers",
            "fake",
            16,
            CHAT_STREAM,
            MESSAGES_STREAM,
        ),
        ("run, small, 1 caller", "fake-run", 1, CHAT, MESSAGES),
        ("run, small, 16 callers", "fake-run", 16, CHAT, MESSAGES),
        (
            "run, SSE, 16 callers",
            "fake-run",
            16,
            CHAT_STREAM,
            MESSAGES_STREAM,
        ),
    ];
    // Warm both routes up.
    for (_, model, _, chat, messages) in &loads {
        wrk_at(
            &dir,
            &path,
            "/v1/chat/completions",
            &chat.replace("MODEL", model),
            4,
            1,
        );
        wrk_at(
            &dir,
            &path,
            "/v1/messages",
            &messages.replace("MODEL", model),
            4,
            1,
        );
    }
    // runs[load][dialect]: one Run per round.
    let mut runs = vec![[Vec::new(), Vec::new()]; loads.len()];
    for round in 0..rounds {
        eprintln!("bench dialects: round {} of {rounds}", round + 1);
        for (i, (_, model, connections, chat, messages)) in loads.iter().enumerate() {
            // Alternate which dialect goes first, so neither always runs warmer.
            let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for d in order {
                let (route, body) = if d == 0 {
                    ("/v1/chat/completions", chat)
                } else {
                    ("/v1/messages", messages)
                };
                let run = wrk_at(
                    &dir,
                    &path,
                    route,
                    &body.replace("MODEL", model),
                    *connections,
                    seconds,
                );
                if run.errors > 0 {
                    eprintln!("bench dialects: {route} {model}: {} errors", run.errors);
                }
                runs[i][d].push(run);
            }
        }
    }
    drop(node);
    drop(cluster);
    let _ = provider.kill();
    let _ = provider.wait();
    println!(
        "The same request as chat completions and as Messages through one Edge and Node (TLS link), wrk for {seconds} s per run; medians of {rounds} rounds.\n"
    );
    println!(
        "| load | chat p50 / p99 | Messages p50 / p99 | Messages adds, p50 / p99 | requests/s chat / Messages | errors |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for (i, (label, ..)) in loads.iter().enumerate() {
        let stat = |d: usize, f: fn(&Run) -> f64| median(runs[i][d].iter().map(f).collect());
        let (c50, c99) = (stat(0, |r| r.p50_us), stat(0, |r| r.p99_us));
        let (m50, m99) = (stat(1, |r| r.p50_us), stat(1, |r| r.p99_us));
        let errors: u64 = runs[i].iter().flatten().map(|r| r.errors).sum();
        println!(
            "| {label} | {:.3} / {:.3} ms | {:.3} / {:.3} ms | {:+.3} / {:+.3} ms | {:.0} / {:.0} | {errors} |",
            c50 / 1e3,
            c99 / 1e3,
            m50 / 1e3,
            m99 / 1e3,
            (m50 - c50) / 1e3,
            (m99 - c99) / 1e3,
            stat(0, |r| r.rps),
            stat(1, |r| r.rps),
        );
    }
}
