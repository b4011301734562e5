//! Load harness for the binaries: chat completions per second and latency through an Edge
//! and a Node, against the same requests sent straight to the provider, in one run.
//!
//! Run: `cargo run --release -p iop-blackbox --bin loadgen -- [seconds] [concurrency]`
//! (it starts the release `iop-edge` and `iop-node` built next to it).

use std::time::{Duration, Instant};

use iop_blackbox::client::{Cluster, Http};
use iop_blackbox::fake::{self, Behaviour, Flavor};
use serde_json::json;

struct Figures {
    rps: f64,
    p50: Duration,
    p99: Duration,
    errors: usize,
}

async fn load(
    http: Http,
    path: &'static str,
    body: serde_json::Value,
    seconds: u64,
    concurrency: usize,
) -> Figures {
    // Warm up connections and caches.
    for _ in 0..20 {
        let _ = http.post(path, &body).await;
    }
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (http, body) = (http.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0;
            while Instant::now() < deadline {
                let t = Instant::now();
                let r = http.post(path, &body).await;
                if r.status == 200 {
                    latencies.push(t.elapsed());
                } else {
                    errors += 1;
                }
            }
            (latencies, errors)
        }));
    }
    let mut all = Vec::new();
    let mut errors = 0;
    for task in tasks {
        let (l, e) = task.await.expect("load task");
        all.extend(l);
        errors += e;
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort();
    let pick = |q: f64| {
        all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    Figures {
        rps: all.len() as f64 / elapsed,
        p50: pick(0.5),
        p99: pick(0.99),
        errors,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seconds: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(10);
    let concurrency: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(16);
    let provider = fake::start(
        Flavor::OpenAi,
        Behaviour {
            words: 16,
            delay: Duration::ZERO,
            ..Behaviour::default()
        },
    )
    .await;
    let body = format!(
        r#"
[[nodes]]
id = "n1"
token = "load-test-token-0123"
[[nodes.adapters]]
name = "oa"
type = "openai_compat"
base_url = "{}"
capacity = 256
targets = ["fake"]
[[nodes.adapters]]
name = "mock"
type = "mock"
capacity = 256
targets = ["m"]
[nodes.adapters.options]
token_delay_ms = "0"
tokens = "16"

[[models]]
name = "tunnel"
providers = [{{ node = "n1", adapter = "oa", target = "fake" }}]
[[models]]
name = "mock"
providers = [{{ node = "n1", adapter = "mock", target = "m" }}]
"#,
        provider.url()
    );
    let cluster = Cluster::start("[queue]\nmax_waiting = 4096\n", &body);
    let _node = cluster.node("n1", "load-test-token-0123");
    cluster.wait_ready("n1").await;
    let ask = |model: &str| json!({"model": model, "messages": [{"role": "user", "content": "Say something."}]});

    let direct = load(
        Http::new(provider.addr.port()),
        "/v1/chat/completions",
        ask("fake"),
        seconds,
        concurrency,
    )
    .await;
    let tunnel = load(
        cluster.http(),
        "/v1/chat/completions",
        ask("tunnel"),
        seconds,
        concurrency,
    )
    .await;
    let run = load(
        cluster.http(),
        "/v1/chat/completions",
        ask("mock"),
        seconds,
        concurrency,
    )
    .await;

    println!("| path | requests/s | ratio to direct | p50 | p99 | errors |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, f) in [
        ("client → provider (direct, reference)", &direct),
        ("client → edge → node → provider (tunnel)", &tunnel),
        ("client → edge → node mock (normalized run)", &run),
    ] {
        println!(
            "| {name} | {:.0} | {:.2}× | {:.2} ms | {:.2} ms | {} |",
            f.rps,
            f.rps / direct.rps,
            f.p50.as_secs_f64() * 1e3,
            f.p99.as_secs_f64() * 1e3,
            f.errors
        );
    }
}
