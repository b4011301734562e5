//! Routing by conversation beside load-only picking, round robin, an oracle and SGLang's
//! cache-aware router, on four providers with a model of a KV cache (`kvfake`: 4 slots
//! each, each cache a third of the workload's prompt blocks, time to first token growing
//! with the blocks not cached). Two workloads: multi-turn chat (64 conversations of 5
//! turns over 8 shared system prompts, all conversations at once) and shared prefixes (32
//! groups of 4 KiB prefixes, 16 questions each, 32 callers). Every policy gets the same
//! requests against emptied caches; the figures are the providers' own.
//!
//! Run: `cargo run --release -p iop-blackbox --bin affinity -- [--write BENCHMARKS.md]`
//! (it builds the Edge and Node first, and installs `sglang-router` from PyPI into
//! `target/sglang-venv` when missing; without it that row says so).

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use iop_blackbox::client::{Cluster, Http, Link};
use iop_blackbox::free_port;
use iop_blackbox::kvfake::{self, KvFake, Model};
use serde_json::{Value, json};

const PROVIDERS: usize = 4;
const SLOTS: usize = 4;
const TOKEN: &str = "affinity-bench-token-0123456789";

/// A deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// About `len` bytes of words.
    fn text(&mut self, len: usize) -> String {
        const WORDS: [&str; 16] = [
            "alpha", "river", "stone", "cloud", "signal", "harbor", "ember", "quartz", "meadow",
            "vector", "lantern", "orbit", "cedar", "falcon", "summit", "delta",
        ];
        let mut out = String::new();
        while out.len() < len {
            out.push_str(WORDS[self.below(WORDS.len())]);
            out.push_str(&format!("{} ", self.below(1000)));
        }
        out
    }
}

/// One conversation: its system prompt and its user turns.
#[derive(Clone)]
struct Conversation {
    system: Arc<str>,
    turns: Vec<String>,
}

/// A one-turn request of the shared-prefix workload.
#[derive(Clone)]
struct Ask {
    group: usize,
    body: Value,
}

fn conversations() -> Vec<Conversation> {
    let mut rng = Rng(0x5eed_1234_abcd);
    let systems: Vec<Arc<str>> = (0..8).map(|_| Arc::from(rng.text(1536).as_str())).collect();
    (0..64)
        .map(|c| Conversation {
            system: systems[c % systems.len()].clone(),
            turns: (0..5)
                .map(|_| {
                    let len = 200 + rng.below(200);
                    rng.text(len)
                })
                .collect(),
        })
        .collect()
}

fn asks() -> Vec<Ask> {
    let mut rng = Rng(0xfeed_5678_1234);
    let prefixes: Vec<String> = (0..32).map(|_| rng.text(4096)).collect();
    let mut asks: Vec<Ask> = (0..32 * 16)
        .map(|i| {
            let group = i % 32;
            let content = format!("{}\n\nQuestion: {}", prefixes[group], rng.text(200));
            Ask {
                group,
                body: json!({"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 16}),
            }
        })
        .collect();
    // Shuffled, the same way for every policy.
    for i in (1..asks.len()).rev() {
        asks.swap(i, rng.below(i + 1));
    }
    asks
}

/// The answer every provider gives (`kvfake` answers the same words), as a caller keeps it.
fn reply() -> String {
    (0..16)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Blocks of every distinct prompt of both workloads: what the caches are sized from.
fn working_set() -> (usize, usize) {
    let mut multi = std::collections::HashSet::new();
    for c in conversations() {
        let mut messages = vec![json!({"role": "system", "content": &*c.system})];
        for turn in &c.turns {
            messages.push(json!({"role": "user", "content": turn}));
            multi.extend(kvfake::prompt_blocks(&json!({ "messages": messages })));
            messages.push(json!({"role": "assistant", "content": reply()}));
        }
    }
    let mut shared = std::collections::HashSet::new();
    for a in asks() {
        shared.extend(kvfake::prompt_blocks(&a.body));
    }
    (multi.len(), shared.len())
}

/// Where a policy sends requests.
#[derive(Clone)]
enum Target {
    /// Through one endpoint (an Edge, a router).
    One(Box<Http>),
    /// Straight to the providers, round robin.
    RoundRobin(Arc<Vec<Http>>, Arc<AtomicUsize>),
    /// Straight to the provider a conversation or group is pinned to.
    Oracle(Arc<Vec<Http>>),
}

impl Target {
    fn client(&self, pin: usize) -> &Http {
        match self {
            Target::One(http) => http.as_ref(),
            Target::RoundRobin(all, next) => &all[next.fetch_add(1, Ordering::Relaxed) % all.len()],
            Target::Oracle(all) => &all[pin % all.len()],
        }
    }
}

/// Callers' time per request (microseconds summed, requests): what the caller waits,
/// queueing wherever it happens included.
static LATENCY: (AtomicU64, AtomicU64) = (AtomicU64::new(0), AtomicU64::new(0));

/// Sends `body`; the answer's text, or why not.
async fn send(http: &Http, body: &Value) -> Result<String, String> {
    let sent = Instant::now();
    let r = http.post("/v1/chat/completions", body).await;
    LATENCY.0.fetch_add(
        u64::try_from(sent.elapsed().as_micros()).unwrap_or(0),
        Ordering::Relaxed,
    );
    LATENCY.1.fetch_add(1, Ordering::Relaxed);
    if r.status != 200 {
        return Err(format!(
            "{} {}",
            r.status,
            String::from_utf8_lossy(&r.body)
                .chars()
                .take(200)
                .collect::<String>()
        ));
    }
    Ok(r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned())
}

/// Every conversation at once, each turn after the last one's answer.
async fn run_multi(target: &Target) -> (usize, Duration) {
    LATENCY.0.store(0, Ordering::Relaxed);
    LATENCY.1.store(0, Ordering::Relaxed);
    let failed = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = conversations()
        .into_iter()
        .enumerate()
        .map(|(c, conversation)| {
            let target = target.clone();
            let failed = failed.clone();
            tokio::spawn(async move {
                let mut messages =
                    vec![json!({"role": "system", "content": &*conversation.system})];
                for turn in &conversation.turns {
                    messages.push(json!({"role": "user", "content": turn}));
                    let body = json!({"model": "m", "messages": messages, "max_tokens": 16});
                    match send(target.client(c), &body).await {
                        Ok(text) => messages.push(json!({"role": "assistant", "content": text})),
                        Err(err) => {
                            eprintln!("conversation {c}: {err}");
                            failed.fetch_add(1, Ordering::Relaxed);
                            messages.push(json!({"role": "assistant", "content": reply()}));
                        }
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        let _ = task.await;
    }
    (failed.load(Ordering::Relaxed), started.elapsed())
}

/// The one-turn requests by 32 callers.
async fn run_shared(target: &Target) -> (usize, Duration) {
    LATENCY.0.store(0, Ordering::Relaxed);
    LATENCY.1.store(0, Ordering::Relaxed);
    let asks = Arc::new(asks());
    let next = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (asks, next, failed, target) =
                (asks.clone(), next.clone(), failed.clone(), target.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(ask) = asks.get(i) else { return };
                    if let Err(err) = send(target.client(ask.group), &ask.body).await {
                        eprintln!("ask {i}: {err}");
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        let _ = task.await;
    }
    (failed.load(Ordering::Relaxed), started.elapsed())
}

/// One policy's figures on one workload.
struct Row {
    policy: String,
    ratio: f64,
    per_provider: Vec<u64>,
    ttft_ms: f64,
    wait_ms: f64,
    caller_ms: f64,
    failed: usize,
    wall: Duration,
}

fn figures(policy: &str, providers: &[KvFake], failed: usize, wall: Duration) -> Row {
    let stats: Vec<_> = providers.iter().map(KvFake::stats).collect();
    let blocks: u64 = stats.iter().map(|s| s.prompt_blocks).sum();
    let cached: u64 = stats.iter().map(|s| s.cached_blocks).sum();
    let requests: u64 = stats.iter().map(|s| s.requests).sum();
    let (waited, asked) = (
        LATENCY.0.swap(0, Ordering::Relaxed),
        LATENCY.1.swap(0, Ordering::Relaxed),
    );
    Row {
        caller_ms: waited as f64 / asked.max(1) as f64 / 1000.0,
        policy: policy.to_owned(),
        ratio: cached as f64 / blocks.max(1) as f64,
        per_provider: stats.iter().map(|s| s.requests).collect(),
        ttft_ms: stats.iter().map(|s| s.ttft_us).sum::<u64>() as f64
            / requests.max(1) as f64
            / 1000.0,
        wait_ms: stats.iter().map(|s| s.wait_us).sum::<u64>() as f64
            / requests.max(1) as f64
            / 1000.0,
        failed,
        wall,
    }
}

/// An Edge placing by `affinity` over four Nodes, one per provider.
fn edge(providers: &[KvFake], affinity: &str) -> (Cluster, Vec<iop_blackbox::Proc>) {
    let body = kvfake::fleet_toml(providers, TOKEN, SLOTS, "");
    let head = format!("[routing]\naffinity = \"{affinity}\"\n[queue]\nmax_waiting = 1024\n");
    let cluster = Cluster::start_with(Link::Plaintext, &head, &body);
    let nodes = (0..providers.len())
        .map(|i| cluster.node(&format!("n{i}"), &format!("{TOKEN}-{i}")))
        .collect();
    (cluster, nodes)
}

/// `sglang-router` (cache-aware) in front of the providers, installed when missing.
fn sglang(providers: &[KvFake]) -> Option<(Child, u16)> {
    let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/sglang-venv");
    let python = venv.join("bin/python");
    if !python.exists() {
        let made = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .is_ok_and(|s| s.success());
        let installed = made
            && Command::new(venv.join("bin/pip"))
                .args(["install", "-q", "sglang-router"])
                .status()
                .is_ok_and(|s| s.success());
        if !installed {
            eprintln!("sglang-router could not be installed: its row is left out");
            return None;
        }
    }
    let (port, metrics) = (free_port(), free_port());
    let mut command = Command::new(&python);
    command
        .args([
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
        ])
        .arg(port.to_string())
        .arg("--prometheus-port")
        .arg(metrics.to_string())
        // Its own process group: the router and whatever it starts stop together.
        .process_group(0)
        .args(["--policy", "cache_aware", "--worker-urls"])
        .args(providers.iter().map(KvFake::url))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let child = command.spawn().ok()?;
    Some((child, port))
}

async fn ready(http: &Http, port: u16) -> bool {
    for _ in 0..300 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1});
        if send(http, &body).await.is_ok() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

fn row_text(workload: &str, row: &Row, oracle: f64) -> String {
    let max = *row.per_provider.iter().max().unwrap_or(&0);
    let min = *row.per_provider.iter().min().unwrap_or(&0);
    format!(
        "| {workload} | {} | {:.3} | {:.2} | {} | {:.2} | {:.1} ms | {:.1} ms | {:.1} ms | {} | {:.1} s |",
        row.policy,
        row.ratio,
        row.ratio / oracle.max(1e-9),
        row.per_provider
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(" / "),
        max as f64 / min.max(1) as f64,
        row.ttft_ms,
        row.wait_ms,
        row.caller_ms,
        row.failed,
        row.wall.as_secs_f64(),
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    iop_blackbox::build_binaries();
    let write = std::env::args().skip_while(|a| a != "--write").nth(1);
    let (multi_blocks, shared_blocks) = working_set();
    let model = |blocks: usize| Model {
        slots: SLOTS,
        cache_blocks: blocks / 3,
        base: Duration::from_millis(1),
        per_block: Duration::from_micros(100),
        tokens: 16,
    };
    let mut lines = vec![
        "| workload | policy | cached-block ratio | ÷ oracle | requests per provider | max/min | provider time to first token (mean) | of which waiting for a slot | caller's time per request (mean) | failed | wall |".to_owned(),
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|".to_owned(),
    ];
    for (workload, blocks) in [
        ("multi-turn chat", multi_blocks),
        ("shared prefixes", shared_blocks),
    ] {
        let mut providers = Vec::new();
        for _ in 0..PROVIDERS {
            providers.push(kvfake::start(model(blocks)).await);
        }
        let run = |target: Target| {
            let workload = workload.to_owned();
            async move {
                if workload == "multi-turn chat" {
                    run_multi(&target).await
                } else {
                    run_shared(&target).await
                }
            }
        };
        let direct: Arc<Vec<Http>> =
            Arc::new(providers.iter().map(|p| Http::new(p.port())).collect());
        let mut rows = Vec::new();
        for p in &providers {
            p.reset();
        }
        let (failed, wall) = run(Target::Oracle(direct.clone())).await;
        rows.push(figures(
            "oracle (each conversation or group pinned to one provider)",
            &providers,
            failed,
            wall,
        ));
        for p in &providers {
            p.reset();
        }
        let (failed, wall) = run(Target::RoundRobin(
            direct.clone(),
            Arc::new(AtomicUsize::new(0)),
        ))
        .await;
        rows.push(figures("round robin", &providers, failed, wall));
        for (affinity, name) in [
            ("off", "IOP, least loaded (`affinity = \"off\"`)"),
            ("prefix", "IOP, by conversation (`affinity = \"prefix\"`)"),
        ] {
            let (cluster, _nodes) = edge(&providers, affinity);
            let http = cluster.http();
            assert!(
                ready(&http, cluster.http_port).await,
                "the Edge did not answer: {}",
                cluster.edge.log()
            );
            for p in &providers {
                p.reset();
            }
            let (failed, wall) = run(Target::One(Box::new(http))).await;
            rows.push(figures(name, &providers, failed, wall));
        }
        match sglang(&providers) {
            Some((mut child, port)) => {
                let http = Http::new(port);
                if ready(&http, port).await {
                    for p in &providers {
                        p.reset();
                    }
                    let (failed, wall) = run(Target::One(Box::new(http))).await;
                    rows.push(figures(
                        "SGLang router `--policy cache_aware`",
                        &providers,
                        failed,
                        wall,
                    ));
                } else {
                    eprintln!("sglang-router did not answer");
                }
                // `--` before the group: `kill -KILL -<n>` alone reads `-<n>` as an
                // option, and some builds then signal every process (-1).
                let _ = Command::new("kill")
                    .args(["-s", "KILL", "--"])
                    .arg(format!("-{}", child.id()))
                    .status();
                let _ = child.wait();
            }
            None => eprintln!("no sglang-router"),
        }
        let oracle = rows[0].ratio;
        for row in &rows {
            lines.push(row_text(workload, row, oracle));
        }
    }
    let table = lines.join("\n");
    println!("{table}");
    println!(
        "\nworking sets: multi-turn {multi_blocks} blocks, shared prefixes {shared_blocks} blocks of {} bytes; each cache a third",
        kvfake::BLOCK
    );
    if let Some(path) = write {
        let text = std::fs::read_to_string(&path).expect("read the benchmarks file");
        let (begin, end) = ("<!-- affinity:begin -->", "<!-- affinity:end -->");
        let (Some(i), Some(j)) = (text.find(begin), text.find(end)) else {
            panic!("{path} has no {begin} ... {end} section");
        };
        let updated = format!("{}{begin}\n{table}\n{}", &text[..i], &text[j..]);
        std::fs::write(&path, updated).expect("write the benchmarks file");
    }
}
