//! Load harness for the binaries: chat completions per second and latency through an Edge
//! and a Node, against the same requests sent straight to the provider, in one run.
//!
//! Run: `cargo run --release -p iop-blackbox --bin loadgen -- [seconds] [concurrency]`
//! (it builds the release `iop-edge` and `iop-node` first, then starts them).

use std::time::{Duration, Instant};

use iop_blackbox::client::{Cluster, Http, Link};
use iop_blackbox::fake::{self, Behaviour, Flavor};
use iop_blackbox::procfs::cpu;
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

/// Streams `seconds` of SSE completions at `concurrency`; returns chunks per second.
async fn stream_load(http: Http, model: &str, seconds: u64, concurrency: usize) -> (f64, usize) {
    use http_body_util::BodyExt;
    let body = json!({"model": model, "stream": true, "messages": [{"role": "user", "content": "Stream."}]});
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (http, body) = (http.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let (mut chunks, mut errors) = (0usize, 0usize);
            while Instant::now() < deadline {
                let mut response = http.post_stream("/v1/chat/completions", &body).await;
                if response.status() != 200 {
                    errors += 1;
                    continue;
                }
                while let Some(Ok(frame)) = response.body_mut().frame().await {
                    if let Ok(data) = frame.into_data() {
                        chunks += data.windows(6).filter(|w| w == b"data: ").count();
                    }
                }
            }
            (chunks, errors)
        }));
    }
    let (mut chunks, mut errors) = (0, 0);
    for task in tasks {
        let (c, e) = task.await.expect("stream task");
        chunks += c;
        errors += e;
    }
    (chunks as f64 / started.elapsed().as_secs_f64(), errors)
}

fn cluster_body(provider_url: &str) -> String {
    format!(
        r#"
[[nodes]]
id = "n1"
token = "load-test-token-0123"
[[nodes.adapters]]
name = "oa"
type = "openai_compat"
base_url = "{provider_url}"
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
"#
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    iop_blackbox::build_binaries();
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
    let ask = |model: &str| json!({"model": model, "messages": [{"role": "user", "content": "Say something."}]});
    let direct = load(
        Http::new(provider.addr.port()),
        "/v1/chat/completions",
        ask("fake"),
        seconds,
        concurrency,
    )
    .await;
    let (direct_chunks, _) = stream_load(
        Http::new(provider.addr.port()),
        "fake",
        seconds,
        concurrency,
    )
    .await;

    println!(
        "| path | node link | requests/s | ratio to direct | p50 | p99 | Edge + Node CPU per request | errors |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    println!(
        "| client → provider (direct, reference) | – | {:.0} | 1.00× | {:.2} ms | {:.2} ms | – | {} |",
        direct.rps,
        direct.p50.as_secs_f64() * 1e3,
        direct.p99.as_secs_f64() * 1e3,
        direct.errors
    );
    let mut streams = Vec::new();
    for link in [Link::Tls, Link::Plaintext] {
        let label = match link {
            Link::Plaintext => "plaintext",
            _ => "TLS",
        };
        let cluster = Cluster::start_with(
            link,
            "[queue]\nmax_waiting = 4096\n",
            &cluster_body(&provider.url()),
        );
        let node = cluster.node("n1", "load-test-token-0123");
        cluster.wait_ready("n1").await;
        for (name, model) in [
            ("client → edge → node → provider (tunnel)", "tunnel"),
            ("client → edge → node mock (normalized run)", "mock"),
        ] {
            let before = cpu(cluster.edge.pid()) + cpu(node.pid());
            let f = load(
                cluster.http(),
                "/v1/chat/completions",
                ask(model),
                seconds,
                concurrency,
            )
            .await;
            let used = cpu(cluster.edge.pid()) + cpu(node.pid()) - before;
            let requests = f.rps * seconds as f64;
            println!(
                "| {name} | {label} | {:.0} | {:.2}× | {:.2} ms | {:.2} ms | {:.0} µs | {} |",
                f.rps,
                f.rps / direct.rps,
                f.p50.as_secs_f64() * 1e3,
                f.p99.as_secs_f64() * 1e3,
                used.as_secs_f64() * 1e6 / requests.max(1.0),
                f.errors
            );
        }
        let before = cpu(cluster.edge.pid()) + cpu(node.pid());
        let (chunks, errors) = stream_load(cluster.http(), "tunnel", seconds, concurrency).await;
        let used = cpu(cluster.edge.pid()) + cpu(node.pid()) - before;
        streams.push((
            label,
            chunks,
            used.as_secs_f64() * 1e6 / (chunks * seconds as f64).max(1.0),
            errors,
        ));
    }
    println!();
    println!(
        "| SSE stream (tunnel, 16 words + role, finish, usage, [DONE]) | node link | chunks/s | ratio to direct | Edge + Node CPU per chunk | errors |"
    );
    println!("|---|---|---:|---:|---:|---:|");
    println!("| client → provider (direct, reference) | – | {direct_chunks:.0} | 1.00× | – | 0 |");
    for (label, chunks, per_chunk, errors) in streams {
        println!(
            "| client → edge → node → provider | {label} | {chunks:.0} | {:.2}× | {per_chunk:.1} µs | {errors} |",
            chunks / direct_chunks
        );
    }
}
