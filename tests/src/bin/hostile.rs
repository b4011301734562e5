//! Hostile-input harness: each attack of issue 13 against the real binaries, on loopback,
//! bounded in count and time, with the figures it measured and a verdict per check.
//!
//! - `hostile short` (run by `./scripts/test`): every attack at a reduced scale.
//! - `hostile long` (by hand, release build): the full scale written to BENCHMARKS.md:
//!   `cargo run --release -p iop-blackbox --bin hostile -- long` (it builds the Edge and the Node
//!   first)
//!
//! Exits 1 if a check fails.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use iop_blackbox::client::{Cluster, Http};
use iop_blackbox::procfs::rss_kib;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const KEY: &str = "sk-hostile-client";
const TOKEN: &str = "hostile-node-token-01";

#[derive(Clone, Copy)]
struct Scale {
    long: bool,
    frame_conns: usize,
    bodies: usize,
    slow_conns: usize,
    slow_deadline_s: u64,
    h2_conns: usize,
    h2_timeout_s: u64,
    streams: usize,
    settle: Duration,
}

const SHORT: Scale = Scale {
    long: false,
    frame_conns: 100,
    bodies: 6,
    slow_conns: 300,
    slow_deadline_s: 3,
    h2_conns: 300,
    h2_timeout_s: 3,
    streams: 300,
    settle: Duration::from_secs(10),
};

const LONG: Scale = Scale {
    long: true,
    frame_conns: 100,
    bodies: 20,
    slow_conns: 1100,
    slow_deadline_s: 30,
    h2_conns: 1000,
    h2_timeout_s: 30,
    streams: 2000,
    settle: Duration::from_secs(60),
};

/// Samples the peak RSS of `pids` every 10 ms until dropped.
struct Peak {
    peaks: Arc<Vec<AtomicU64>>,
    stop: Arc<AtomicBool>,
}

impl Peak {
    fn watch(pids: &[u32]) -> Peak {
        let peaks: Arc<Vec<AtomicU64>> = Arc::new(pids.iter().map(|_| AtomicU64::new(0)).collect());
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s, pids) = (peaks.clone(), stop.clone(), pids.to_vec());
        tokio::spawn(async move {
            while !s.load(Ordering::Relaxed) {
                for (i, pid) in pids.iter().enumerate() {
                    p[i].fetch_max(rss_kib(*pid), Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        Peak { peaks, stop }
    }

    fn peak(&self, i: usize) -> u64 {
        self.peaks[i].load(Ordering::Relaxed)
    }
}

impl Drop for Peak {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

struct Report {
    failed: usize,
    lines: Vec<String>,
}

impl Report {
    fn check(&mut self, ok: bool, what: String) {
        let line = format!("{} {what}", if ok { "ok  " } else { "FAIL" });
        println!("{line}");
        self.lines.push(line);
        if !ok {
            self.failed += 1;
        }
    }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn body(provider: &str) -> String {
    format!(
        r#"
[[nodes]]
id = "n1"
token = "{TOKEN}"
[[nodes.adapters]]
name = "mock"
type = "mock"
capacity = 4096
targets = ["m"]
[nodes.adapters.options]
token_delay_ms = "0"
tokens = "4"
[[nodes.adapters]]
name = "paced"
type = "mock"
capacity = 4096
targets = ["p"]
[nodes.adapters.options]
token_delay_ms = "20"
tokens = "50"
[[nodes.adapters]]
name = "oa"
type = "openai_compat"
base_url = "{provider}"
capacity = 64
targets = ["fake"]

[[models]]
name = "chat"
providers = [{{ node = "n1", adapter = "mock", target = "m" }}]
[[models]]
name = "paced"
providers = [{{ node = "n1", adapter = "paced", target = "p" }}]
"#
    )
}

fn connector(cluster: &Cluster) -> tokio_rustls::TlsConnector {
    iop_blackbox::client::connector_trusting(&cluster.dir.path().join("edge-cert.pem"))
}

async fn chat_ok(http: &Http) -> Option<Duration> {
    let started = Instant::now();
    let r = http
        .post(
            "/v1/chat/completions",
            &json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    (r.status == 200).then(|| started.elapsed())
}

/// 1. Unauthenticated connections that announce 16 MiB frames and send the bytes.
async fn pre_register_frames(cluster: &Cluster, node_pid: u32, scale: Scale, report: &mut Report) {
    let edge = cluster.edge.pid();
    let idle = rss_kib(edge);
    let peak = Peak::watch(&[edge]);
    let tls = connector(cluster);
    let port = cluster.node_port;
    let tasks: Vec<_> = (0..scale.frame_conns)
        .map(|_| {
            let tls = tls.clone();
            tokio::spawn(async move {
                let Ok(tcp) = TcpStream::connect(("127.0.0.1", port)).await else {
                    return 0usize;
                };
                let name = rustls_pki_types::ServerName::try_from("localhost").expect("name");
                let Ok(mut stream) = tls.connect(name, tcp).await else {
                    return 0;
                };
                let mut sent = 0usize;
                let chunk = vec![0x41u8; 64 << 10];
                if stream
                    .write_all(&(16u32 * 1024 * 1024 - 1).to_be_bytes())
                    .await
                    .is_err()
                {
                    return 0;
                }
                while sent < 16 << 20 {
                    if stream.write_all(&chunk).await.is_err() {
                        break;
                    }
                    sent += chunk.len();
                }
                sent
            })
        })
        .collect();
    let mut accepted = 0usize;
    for t in tasks {
        accepted += t.await.unwrap_or(0);
    }
    let served = chat_ok(&cluster.http().with_key(KEY)).await.is_some();
    let over = peak.peak(0).saturating_sub(idle);
    report.check(
        over < 64 * 1024,
        format!(
            "pre-register frames: {} connections x 16 MiB announced, {:.1} MiB written before the Edge closed them; Edge RSS peak {:.1} MiB over idle ({:.1} MiB) (< 64 MiB)",
            scale.frame_conns,
            accepted as f64 / (1 << 20) as f64,
            mib(over),
            mib(idle),
        ),
    );
    report.check(
        served && rss_kib(node_pid) > 0,
        "pre-register frames: the legitimate node keeps serving".into(),
    );
}

/// 2. Bodies just under the 8 MiB limit made of tiny messages, all at once.
async fn amplification(cluster: &Cluster, node_pid: u32, scale: Scale, report: &mut Report) {
    let edge = cluster.edge.pid();
    let (idle_edge, idle_node) = (rss_kib(edge), rss_kib(node_pid));
    let message = r#"{"role":"user","content":"x"},"#;
    let head = r#"{"model":"chat","messages":["#;
    let n = (8 * 1024 * 1024 - head.len() - 64) / message.len();
    let mut text = String::with_capacity(8 << 20);
    text.push_str(head);
    for _ in 0..n {
        text.push_str(message);
    }
    text.pop();
    text.push_str("]}");
    let raw = bytes::Bytes::from(text);
    let in_flight = raw.len() * scale.bodies;
    let peak = Peak::watch(&[edge, node_pid]);
    let http = cluster.http().with_key(KEY);
    let tasks: Vec<_> = (0..scale.bodies)
        .map(|_| {
            let (http, raw) = (http.clone(), raw.clone());
            tokio::spawn(async move { http.post_raw("/v1/chat/completions", raw).await.status })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap_or(0));
    }
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let (pe, pn) = (peak.peak(0), peak.peak(1));
    drop(peak);
    report.check(
        ok == scale.bodies,
        format!("amplification: {ok}/{} bodies of {n} messages ({:.1} MiB each) answered 200 ({statuses:?})", scale.bodies, mib(raw.len() as u64 / 1024)),
    );
    let bound = 8 * in_flight as u64 / 1024;
    report.check(
        pe < bound && pn < bound,
        format!(
            "amplification: {:.0} MiB in flight; peak RSS Edge {:.0} MiB, Node {:.0} MiB (each < 8x = {:.0} MiB)",
            mib(in_flight as u64 / 1024),
            mib(pe),
            mib(pn),
            mib(bound)
        ),
    );
    settle(
        cluster.edge.pid(),
        node_pid,
        idle_edge,
        idle_node,
        scale,
        "amplification",
        report,
    )
    .await;
}

/// Waits up to `scale.settle` for both processes to be back within 2x of idle.
async fn settle(
    edge: u32,
    node: u32,
    idle_edge: u64,
    idle_node: u64,
    scale: Scale,
    what: &str,
    report: &mut Report,
) {
    let started = Instant::now();
    let within = || rss_kib(edge) <= 2 * idle_edge && rss_kib(node) <= 2 * idle_node;
    while started.elapsed() < scale.settle && !within() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    report.check(
        within(),
        format!(
            "{what}: after {:.1} s RSS Edge {:.1} MiB (idle {:.1}), Node {:.1} MiB (idle {:.1}) (within 2x of idle)",
            started.elapsed().as_secs_f64(),
            mib(rss_kib(edge)),
            mib(idle_edge),
            mib(rss_kib(node)),
            mib(idle_node)
        ),
    );
}

/// 3. Authenticated requests whose bodies trickle in one byte at a time.
async fn slow_bodies(cluster: &Cluster, scale: Scale, report: &mut Report) {
    let port = cluster.http_port;
    let timeouts = Arc::new(AtomicUsize::new(0));
    let deadline = scale.slow_deadline_s;
    let tasks: Vec<_> = (0..scale.slow_conns)
        .map(|_| {
            let timeouts = timeouts.clone();
            tokio::spawn(async move {
                let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)).await else {
                    return None;
                };
                let head = format!(
                    "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json\r\ncontent-length: 4000\r\n\r\n"
                );
                s.write_all(head.as_bytes()).await.ok()?;
                let started = Instant::now();
                let mut buf = vec![0u8; 1024];
                loop {
                    tokio::select! {
                        read = s.read(&mut buf) => {
                            let n = read.ok()?;
                            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                            if text.starts_with("HTTP/1.1 408") {
                                timeouts.fetch_add(1, Ordering::Relaxed);
                            }
                            return Some((text.get(..12).unwrap_or("").to_owned(), started.elapsed()));
                        }
                        () = tokio::time::sleep(Duration::from_millis(deadline * 1000 / 6)) => {
                            if s.write_all(b" ").await.is_err() {
                                return None;
                            }
                        }
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let http = cluster.http().with_key(KEY);
    let mut worst = Duration::ZERO;
    let mut all_ok = true;
    for _ in 0..5 {
        match tokio::time::timeout(Duration::from_secs(5), chat_ok(&http)).await {
            Ok(Some(t)) => worst = worst.max(t),
            _ => all_ok = false,
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    report.check(
        all_ok && worst < Duration::from_secs(1),
        format!(
            "slow bodies: with {} connections trickling bodies, normal requests answered 200 in at most {:.0} ms (< 1 s)",
            scale.slow_conns,
            worst.as_secs_f64() * 1e3
        ),
    );
    let mut latest = Duration::ZERO;
    for t in tasks {
        if let Ok(Some((_, took))) = t.await {
            latest = latest.max(took);
        }
    }
    let n = timeouts.load(Ordering::Relaxed);
    report.check(
        n == scale.slow_conns && latest < Duration::from_secs(deadline + 3),
        format!(
            "slow bodies: {n}/{} got 408, the last {:.1} s after its headers (deadline {deadline} s)",
            scale.slow_conns,
            latest.as_secs_f64()
        ),
    );
}

/// 4. Connections that send the HTTP/2 preface and nothing else.
async fn stalled_h2(cluster: &Cluster, scale: Scale, report: &mut Report) {
    let port = cluster.http_port;
    let log_before = cluster.edge.log().lines().count();
    let closed = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let limit = Duration::from_secs(scale.h2_timeout_s + 5);
    let tasks: Vec<_> = (0..scale.h2_conns)
        .map(|_| {
            let closed = closed.clone();
            tokio::spawn(async move {
                let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)).await else {
                    return;
                };
                if s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                    .await
                    .is_err()
                {
                    return;
                }
                let mut buf = vec![0u8; 4096];
                loop {
                    match tokio::time::timeout(limit, s.read(&mut buf)).await {
                        Ok(Ok(0) | Err(_)) => {
                            closed.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                        Ok(Ok(_)) => {}
                        Err(_) => return,
                    }
                }
            })
        })
        .collect();
    let (mut health_ok, mut health_checks) = (0, 0);
    let http = cluster.http();
    while started.elapsed() < Duration::from_secs(scale.h2_timeout_s + 2) {
        health_checks += 1;
        if let Ok(r) = tokio::time::timeout(Duration::from_secs(2), http.get("/healthz")).await
            && r.status == 200
        {
            health_ok += 1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for t in tasks {
        let _ = t.await;
    }
    let took = started.elapsed();
    let n = closed.load(Ordering::Relaxed);
    report.check(
        n == scale.h2_conns,
        format!(
            "stalled HTTP/2: {n}/{} preface-only connections closed by the Edge within {:.1} s (handshake timeout {} s)",
            scale.h2_conns,
            took.as_secs_f64(),
            scale.h2_timeout_s
        ),
    );
    report.check(
        health_ok == health_checks,
        format!(
            "stalled HTTP/2: /healthz answered {health_ok}/{health_checks} polls during the attack"
        ),
    );
    let lines = cluster.edge.log().lines().count() - log_before;
    report.check(
        lines <= 5,
        format!("stalled HTTP/2: {lines} Edge log lines during the attack (<= 5)"),
    );
}

/// 5. Many paced streams, then memory back near idle.
async fn streams(cluster: &Cluster, node_pid: u32, scale: Scale, report: &mut Report) {
    let (edge, idle_edge, idle_node) = (
        cluster.edge.pid(),
        rss_kib(cluster.edge.pid()),
        rss_kib(node_pid),
    );
    let peak = Peak::watch(&[edge, node_pid]);
    let http = cluster.http().with_key(KEY);
    let tasks: Vec<_> = (0..scale.streams)
        .map(|_| {
            let http = http.clone();
            tokio::spawn(async move {
                let mut r = http
                    .post_stream(
                        "/v1/chat/completions",
                        &json!({"model": "paced", "stream": true, "messages": [{"role": "user", "content": "go"}]}),
                    )
                    .await;
                let (events, ended) =
                    iop_blackbox::client::read_sse(r.body_mut(), Duration::from_secs(60)).await;
                ended && events.last().is_some_and(|e| e == "[DONE]")
            })
        })
        .collect();
    let mut done = 0;
    for t in tasks {
        if t.await.unwrap_or(false) {
            done += 1;
        }
    }
    let (pe, pn) = (peak.peak(0), peak.peak(1));
    drop(peak);
    report.check(
        done == scale.streams,
        format!(
            "streams: {done}/{} paced streams completed; peak RSS Edge {:.0} MiB, Node {:.0} MiB ({:.1} / {:.1} KiB per stream over idle)",
            scale.streams,
            mib(pe),
            mib(pn),
            pe.saturating_sub(idle_edge) as f64 / scale.streams as f64,
            pn.saturating_sub(idle_node) as f64 / scale.streams as f64
        ),
    );
    settle(
        edge, node_pid, idle_edge, idle_node, scale, "streams", report,
    )
    .await;
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    iop_blackbox::build_binaries();
    let scale = match std::env::args().nth(1).as_deref() {
        Some("long") => LONG,
        Some("short") | None => SHORT,
        Some(other) => {
            eprintln!("usage: hostile [short|long], not {other:?}");
            std::process::exit(2);
        }
    };
    let provider = iop_blackbox::fake::start(
        iop_blackbox::fake::Flavor::OpenAi,
        iop_blackbox::fake::Behaviour::default(),
    )
    .await;
    let head = format!(
        "[auth]\napi_keys = [\"{KEY}\"]\n\n[limits]\nbody_read_timeout_sec = {}\nheader_read_timeout_sec = {}\nmax_connections = 4096\nmax_concurrent_requests = 4096\n\n[queue]\nmax_waiting = 4096\n",
        scale.slow_deadline_s, scale.h2_timeout_s
    );
    let mut cluster = Cluster::start(&head, &body(&provider.url()));
    let node = cluster.node("n1", TOKEN);
    cluster.wait_ready("n1").await;
    // Warm both up so "idle" is a process that has served requests.
    let http = cluster.http().with_key(KEY);
    for _ in 0..20 {
        let _ = chat_ok(&http).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut report = Report {
        failed: 0,
        lines: Vec::new(),
    };
    println!(
        "hostile ({}): Edge idle {:.1} MiB, Node idle {:.1} MiB",
        if scale.long { "long" } else { "short" },
        mib(rss_kib(cluster.edge.pid())),
        mib(rss_kib(node.pid()))
    );
    pre_register_frames(&cluster, node.pid(), scale, &mut report).await;
    amplification(&cluster, node.pid(), scale, &mut report).await;
    slow_bodies(&cluster, scale, &mut report).await;
    stalled_h2(&cluster, scale, &mut report).await;
    streams(&cluster, node.pid(), scale, &mut report).await;
    cluster.admin_key = None;
    println!(
        "hostile: {} checks, {} failed",
        report.lines.len(),
        report.failed
    );
    if report.failed > 0 {
        eprintln!(
            "----- edge log (tail) -----\n{}",
            tail(&cluster.edge.log(), 40)
        );
        eprintln!("----- node log (tail) -----\n{}", tail(&node.log(), 40));
        // exit() runs no destructors: stop the binaries first, or they outlive us.
        drop(node);
        drop(cluster);
        std::process::exit(1);
    }
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
