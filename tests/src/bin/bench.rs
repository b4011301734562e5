//! The data path beside a reverse proxy, in one run: the same requests straight to a fast
//! fake provider, through two chained nginx hops (client → nginx → nginx → provider, the
//! fair peer of client → Edge → Node → provider), and through IOP twice, over the node
//! link as deployed by default (TLS 1.3) and over plaintext, interleaved round by round so
//! that machine noise hits every path alike. Small requests run at 1, 16, 64 and 256
//! concurrent callers, unpaced streams at 16. rathole, a one-hop TCP tunnel whose client
//! dials out to its server as IOP's Node dials the Edge, runs beside them as the next mark
//! (`rathole_binary`: installed with cargo when missing and allowed). Loopback only,
//! bounded in time.
//!
//! ```text
//! cargo run --release -p iop-blackbox --bin bench -- [seconds per run] [rounds] [--write BENCHMARKS.md]
//! ```
//!
//! Under `cargo run` it first builds the `iop-edge` and `iop-node` it measures
//! (`iop_blackbox::build_binaries`). The table goes to stdout; with `--write`, also into
//! the file's latest-run block (between `<!-- bench:latest … -->` and
//! `<!-- /bench:latest -->`, appended when the file has none).
//!
//! The Edge and the Node log at INFO, one line per request each, as the tests run them
//! (`IOP_TEST_RUST_LOG=warn` measures them without those lines); each nginx hop writes
//! its access log, buffered as IOP's log lines are, so both proxies do the same work.
//!
//! It needs `nginx` and `wrk` on the PATH and installs them with apt-get when it can
//! (`IOP_BENCH_NO_INSTALL=1` forbids that). The provider runs in its own process (this
//! binary, `bench provider <port>`); load comes from `wrk` (small requests, unpaced
//! streams) and from this binary (2,000 paced streams, whose chunks carry the provider's
//! send time). Proxy CPU is user + system time of every process of the proxy (both nginx
//! instances with their workers; the Edge and the Node) over the run, from `/proc`. The
//! share of the machine's CPU the hypervisor stole during each path's runs is reported
//! too: on a shared virtual machine a run under heavy steal measures the host.
//!
//! Each round then measures every proxy again at c=16 (small requests, unpaced streams)
//! with their event loops pinned by `taskset` (`place`): the Edge on the first CPU this
//! process may use and the Node on the second (rathole's server and client alike), each
//! nginx hop's workers spread over them as `worker_cpu_affinity auto` places them. Left to the scheduler, two single-threaded
//! hops that wake each other share a vCPU much of the time (two thirds of a c=16 run in
//! one `perf sched` recording) while the other runs wrk and the provider and idles in
//! between; the pinned rows show what each proxy does when its hops do not share a CPU,
//! as in a deployment with the Edge and the Node on machines of their own. They are
//! skipped on one CPU or without `taskset`.
//!
//! During every wrk run through IOP, when the Edge polls on one thread (its default on two
//! CPUs), a thread samples, every 10 ms, the CPU the Edge's and the Node's main threads last
//! ran on; the table reports the share of samples on which
//! they shared one (c=16 small requests / unpaced streams). Left to the kernel, that share
//! carries over from one run to the next and moves IOP's c=16 throughput on two vCPUs.
//!
//! Last, with the data path's processes gone, 1,000 in-process nodes connect to an Edge of
//! their own over TLS and then over plaintext, with the Node's default redial jitter, and
//! the Edge is killed and restarted (`iop_blackbox::fleet`, which the `reconnect` harness
//! runs in more combinations): the table's last two rows, the Edge's memory per idle
//! connected node and the time until every node is ready again, beside bare TCP connects
//! and bare clients redialling by the same policy over the same link.
//!
//! `IOP_BENCH_EDGE_THREADS=<n>` starts the Edge with `runtime.worker_threads = n` instead
//! of its default, to compare thread counts; `IOP_BENCH_SSE_BURST=1` has the fake provider
//! write an unpaced stream's 20 events together instead of one by one, to see what the
//! per-event writes cost each path; `IOP_BENCH_SERVE=1` keeps every path up
//! for profiling until stdin closes (then measures) or SIGINT or SIGTERM comes (then
//! stops everything it started, logs included), and `bench paced <port>
//! [pid...]` runs one set of paced streams against one of them.
//! `IOP_BENCH_PACED_DUMP=<file>` writes every paced chunk's send time and latency, in
//! microseconds, one chunk a line, to see when a set's slow chunks were sent.
//!
//! `bench scheduler [rounds]` measures something else: paced-stream latency through two
//! IOP paths (TLS link) whose Nodes differ only in `runtime.scheduler` (`batch`, the
//! default, and `inherit`), and straight to the provider, on an otherwise idle machine and
//! then beside a process that keeps every CPU busy at the default priority, as an
//! inference engine's busy loop does (`bench burn`).

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use iop_blackbox::client::{Cluster, Link};
use iop_blackbox::fleet::{self, count};
use iop_blackbox::procfs::{
    children, last_cpu, machine_steal_ticks, machine_ticks, tree_cpu as cpu,
    tree_rss_kib as rss_kib,
};
use iop_blackbox::{Proc, TempDir, free_port};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Callers of the small-request runs: one for the added latency, then more and more for
/// throughput.
const SMALL_CONCURRENCY: [usize; 4] = [1, 16, 64, 256];
/// Words in every completion.
const WORDS: usize = 16;
/// SSE events in a streamed completion: role, words, finish, usage, `[DONE]`.
const SSE_EVENTS: usize = WORDS + 4;
/// Paced streams open at once.
const PACED_STREAMS: usize = 2_000;
/// Chunks per paced stream, and the pause between them.
const PACED_CHUNKS: usize = 100;
const PACE_MS: u64 = 20;
/// Nodes connected to one Edge for the idle-memory and restart rows, and their redial
/// jitter (the Node's default).
const FLEET_NODES: usize = 1_000;
const FLEET_JITTER: f64 = iop_proto_core::reconnect::DEFAULT_JITTER;

const SMALL: &str = r#"{"model":"fake","messages":[{"role":"user","content":"Say something."}]}"#;
const STREAM: &str =
    r#"{"model":"fake","stream":true,"messages":[{"role":"user","content":"Say something."}]}"#;

// ----- the fake provider -----

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The number after `key` in `body`, if any.
fn number_after(body: &[u8], key: &[u8]) -> Option<u64> {
    let at = find(body, key)? + key.len();
    let digits: Vec<u8> = body[at..]
        .iter()
        .copied()
        .take_while(u8::is_ascii_digit)
        .collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}

/// A provider response body: whole, or SSE events yielded one frame at a time (paced
/// ones stamped with their send time in `"t_us"`).
enum ProviderBody {
    Whole(Option<Bytes>),
    Sse {
        next: usize,
        total: usize,
        pace: Option<Duration>,
        sleep: Option<Pin<Box<tokio::time::Sleep>>>,
        /// Unpaced: whether this event already yielded once, so hyper flushes each
        /// event on its own as a provider generating tokens does.
        yielded: bool,
        /// Unpaced, under `IOP_BENCH_SSE_BURST`: never yield, so hyper writes the
        /// stream's events together, as a provider that had them all at once would.
        burst: bool,
    },
}

fn sse_event(i: usize, total: usize) -> Bytes {
    let stamp = now_us();
    let text = if i + 1 == total {
        "data: [DONE]\n\n".to_owned()
    } else if i == 0 {
        format!(
            "data: {{\"id\":\"chatcmpl-b\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"fake\",\"t_us\":{stamp},\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"finish_reason\":null}}]}}\n\n"
        )
    } else if i + 3 == total {
        format!(
            "data: {{\"id\":\"chatcmpl-b\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"fake\",\"t_us\":{stamp},\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"stop\"}}]}}\n\n"
        )
    } else if i + 2 == total {
        format!(
            "data: {{\"id\":\"chatcmpl-b\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"fake\",\"t_us\":{stamp},\"choices\":[],\"usage\":{{\"prompt_tokens\":5,\"completion_tokens\":{WORDS},\"total_tokens\":{}}}}}\n\n",
            WORDS + 5
        )
    } else {
        format!(
            "data: {{\"id\":\"chatcmpl-b\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"fake\",\"t_us\":{stamp},\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"word{i} \"}},\"finish_reason\":null}}]}}\n\n"
        )
    };
    Bytes::from(text)
}

impl Body for ProviderBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match &mut *self {
            ProviderBody::Whole(data) => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            ProviderBody::Sse {
                next,
                total,
                pace,
                sleep,
                yielded,
                burst,
            } => {
                if *next >= *total {
                    return Poll::Ready(None);
                }
                if let Some(pace) = pace {
                    let timer = sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(*pace)));
                    if timer.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    *sleep = None;
                } else if *next > 0 && !*yielded && !*burst {
                    *yielded = true;
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                *yielded = false;
                let event = sse_event(*next, *total);
                *next += 1;
                Poll::Ready(Some(Ok(Frame::data(event))))
            }
        }
    }
}

async fn provide(req: Request<Incoming>) -> Result<Response<ProviderBody>, Infallible> {
    let body = req
        .into_body()
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
        .unwrap_or_default();
    if find(&body, b"\"stream\":true").is_none() {
        let words: Vec<String> = (0..WORDS).map(|i| format!("word{i}")).collect();
        let json = format!(
            "{{\"id\":\"chatcmpl-b\",\"object\":\"chat.completion\",\"created\":1,\"model\":\"fake\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{}\"}},\"finish_reason\":\"stop\"}}],\"usage\":{{\"prompt_tokens\":5,\"completion_tokens\":{WORDS},\"total_tokens\":{}}}}}",
            words.join(" "),
            WORDS + 5
        );
        let mut response = Response::new(ProviderBody::Whole(Some(Bytes::from(json))));
        response.headers_mut().insert(
            "content-type",
            http::HeaderValue::from_static("application/json"),
        );
        return Ok(response);
    }
    let pace = number_after(&body, b"\"pace_ms\":").map(Duration::from_millis);
    let total = match pace {
        Some(_) => PACED_CHUNKS,
        None => SSE_EVENTS,
    };
    let mut response = Response::new(ProviderBody::Sse {
        next: 0,
        total,
        pace,
        sleep: None,
        yielded: false,
        burst: *SSE_BURST,
    });
    response.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("text/event-stream"),
    );
    Ok(response)
}

/// `IOP_BENCH_SSE_BURST`, read once: the provider writes an unpaced stream's events
/// together instead of one by one (a diagnostic; the harness's figures use the default).
static SSE_BURST: std::sync::LazyLock<bool> =
    std::sync::LazyLock::new(|| std::env::var_os("IOP_BENCH_SSE_BURST").is_some());

fn run_provider(port: u16) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("provider bind");
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service_fn(provide))
                    .await;
            });
        }
    });
}

// ----- processes and measurement -----

/// A path under test: where its clients connect, and the processes that make it up.
struct Path3 {
    name: &'static str,
    port: u16,
    pids: Vec<u32>,
    /// Two single-threaded processes whose CPUs are sampled during every wrk run
    /// (`Together`): IOP's Edge and Node, when the Edge polls on its main thread alone.
    pair: Option<(u32, u32)>,
}

impl Path3 {
    fn cpu(&self) -> Duration {
        self.cpus().into_iter().sum()
    }

    fn cpus(&self) -> Vec<Duration> {
        self.pids.iter().map(|p| cpu(*p)).collect()
    }

    fn rss(&self) -> Vec<u64> {
        self.pids.iter().map(|p| rss_kib(*p)).collect()
    }
}

/// The cells of a proxy CPU row from a figure per path (direct, nginx, then IOP's): "–"
/// for direct, nginx's figure, and each of IOP's with it as a multiple of nginx's, each
/// figure with `decimals` decimals.
fn cpu_cells(per_path_us: &[f64], decimals: usize) -> Vec<String> {
    let nginx = per_path_us.get(1).copied().unwrap_or(0.0);
    per_path_us
        .iter()
        .enumerate()
        .map(|(i, us)| match i {
            0 => "–".to_owned(),
            1 => format!("{us:.decimals$} µs"),
            _ => format!("{us:.decimals$} µs ({:.2}× nginx)", us / nginx),
        })
        .collect()
}

/// Binds every thread of `pid` to `cpus` (a `taskset` list: "1", "0-1").
fn taskset(pid: u32, cpus: &str) -> bool {
    Command::new("taskset")
        .args(["-a", "-p", "-c", cpus, &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The CPUs this process may run on (`Cpus_allowed_list` of `/proc/self/status`, such as
/// "0-3,6"), in order; empty when it cannot be read.
fn allowed_cpus() -> Vec<usize> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map_or_else(Vec::new, cpu_list)
}

/// The CPUs of a kernel CPU list ("0-3,6"), in order; empty for a malformed one.
fn cpu_list(list: &str) -> Vec<usize> {
    let mut cpus = Vec::new();
    for part in list.trim().split(',') {
        let (first, last) = part.split_once('-').unwrap_or((part, part));
        match (first.trim().parse::<usize>(), last.trim().parse::<usize>()) {
            (Ok(first), Ok(last)) if first <= last && last < 4096 => cpus.extend(first..=last),
            _ => return Vec::new(),
        }
    }
    cpus
}

/// Pins a path's event loops to CPUs of `cpus` (at least two), or lets them run on all of
/// `cpus` again. Pinned, each single-threaded process of the path gets a CPU of its own
/// (the Edge the first, the Node the second), and each nginx hop's workers are spread
/// over the CPUs as `worker_cpu_affinity auto` places them. The load generator and the
/// provider are never pinned. False when `taskset` failed.
fn place(path: &Path3, pinned: bool, cpus: &[usize]) -> bool {
    let anywhere = cpus
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let at = |i: usize| {
        if pinned {
            cpus[i % cpus.len()].to_string()
        } else {
            anywhere.clone()
        }
    };
    let mut placed = true;
    for (i, &pid) in path.pids.iter().enumerate() {
        let mut workers = children(pid);
        if workers.is_empty() {
            placed &= taskset(pid, &at(i));
        } else {
            workers.sort_unstable();
            for (j, worker) in workers.into_iter().enumerate() {
                placed &= taskset(worker, &at(j));
            }
        }
    }
    placed
}

fn ensure_tools() {
    let missing: Vec<&str> = ["nginx", "wrk"]
        .into_iter()
        .filter(|tool| which(tool).is_none())
        .collect();
    if missing.is_empty() {
        return;
    }
    if std::env::var_os("IOP_BENCH_NO_INSTALL").is_some() {
        panic!("missing {missing:?}: install nginx and wrk");
    }
    eprintln!("bench: installing {missing:?} with apt-get");
    let _ = Command::new("apt-get").arg("update").status();
    let status = Command::new("apt-get")
        .args([
            "install",
            "-y",
            "--no-install-recommends",
            "nginx-light",
            "wrk",
        ])
        .status()
        .expect("apt-get runs");
    assert!(status.success(), "apt-get install nginx-light wrk failed");
    // The package starts a system nginx on port 80; this harness runs its own.
    let _ = Command::new("nginx").args(["-s", "stop"]).status();
}

fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join(tool))
        .find(|p| p.exists())
}

/// One nginx instance listening on `port` and proxying everything to `upstream`.
fn start_nginx(dir: &TempDir, name: &str, port: u16, upstream: u16) -> Child {
    let root = dir.path().join(name);
    std::fs::create_dir_all(&root).expect("nginx dir");
    let r = root.display();
    let conf = format!(
        r#"worker_processes auto;
daemon off;
pid {r}/nginx.pid;
error_log {r}/error.log warn;
worker_rlimit_nofile 20000;
events {{ worker_connections 10000; }}
http {{
  access_log {r}/access.log combined buffer=64k flush=1s;
  client_body_temp_path {r}/body;
  proxy_temp_path {r}/proxy;
  fastcgi_temp_path {r}/fastcgi;
  uwsgi_temp_path {r}/uwsgi;
  scgi_temp_path {r}/scgi;
  keepalive_requests 1000000;
  upstream next {{ server 127.0.0.1:{upstream}; keepalive 512; keepalive_requests 1000000; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    client_max_body_size 16m;
    location / {{
      proxy_pass http://next;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
"#
    );
    let file = root.join("nginx.conf");
    std::fs::write(&file, conf).expect("nginx.conf");
    Command::new(which("nginx").expect("nginx"))
        .arg("-p")
        .arg(&root)
        .arg("-c")
        .arg(&file)
        .arg("-e")
        .arg(root.join("error.log"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nginx starts")
}

/// rathole's binary: on the PATH, built earlier into `target/bench-tools`, or installed
/// there now with cargo (plain TCP transport only; a few minutes, once) unless
/// `IOP_BENCH_NO_INSTALL` forbids it. `None` leaves rathole out of the run.
fn rathole_binary() -> Option<PathBuf> {
    if let Some(path) = which("rathole") {
        return Some(path);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench-tools");
    let bin = root.join("bin/rathole");
    if bin.exists() {
        return Some(bin);
    }
    if std::env::var_os("IOP_BENCH_NO_INSTALL").is_some() {
        eprintln!("bench: rathole not found and IOP_BENCH_NO_INSTALL is set: no rathole column");
        return None;
    }
    eprintln!(
        "bench: installing rathole with cargo into {}",
        root.display()
    );
    let installed = Command::new("cargo")
        .args(["install", "rathole", "--version", "0.5.0"])
        .args([
            "--no-default-features",
            "--features",
            "server,client",
            "--root",
        ])
        .arg(&root)
        .env("CARGO_TARGET_DIR", root.join("build"))
        .status()
        .is_ok_and(|s| s.success());
    if installed && bin.exists() {
        Some(bin)
    } else {
        eprintln!("bench: rathole did not install: no rathole column");
        None
    }
}

/// rathole between `port` and the provider: its server (the public side, where callers
/// connect) and its client (beside the provider, dialling out to the server, as IOP's Node
/// does), plain TCP. One hop that forwards bytes without reading them: the next mark
/// issue 56 set.
fn start_rathole(bin: &Path, dir: &TempDir, port: u16, provider: u16) -> (Child, Child) {
    let control = free_port();
    let root = dir.path().join("rathole");
    std::fs::create_dir_all(&root).expect("rathole dir");
    let token = "iop-bench-rathole-token";
    let server = root.join("server.toml");
    std::fs::write(
        &server,
        format!(
            "[server]\nbind_addr = \"127.0.0.1:{control}\"\n[server.transport]\ntype = \"tcp\"\n[server.transport.tcp]\nnodelay = true\n[server.services.p]\ntoken = \"{token}\"\nbind_addr = \"127.0.0.1:{port}\"\nnodelay = true\n"
        ),
    )
    .expect("rathole server.toml");
    let client = root.join("client.toml");
    std::fs::write(
        &client,
        format!(
            "[client]\nremote_addr = \"127.0.0.1:{control}\"\n[client.transport]\ntype = \"tcp\"\n[client.transport.tcp]\nnodelay = true\n[client.services.p]\ntoken = \"{token}\"\nlocal_addr = \"127.0.0.1:{provider}\"\nnodelay = true\n"
        ),
    )
    .expect("rathole client.toml");
    let start = |flag: &str, config: &Path| {
        Command::new(bin)
            .arg(flag)
            .arg(config)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("rathole starts")
    };
    let server = start("-s", &server);
    wait_port(control);
    let client = start("-c", &client);
    wait_port(port);
    // The client registers its service over the control channel after connecting.
    std::thread::sleep(Duration::from_millis(500));
    (server, client)
}

fn wait_port(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("nothing listens on {port}");
}

// ----- wrk -----

#[derive(Clone, Copy, Default)]
struct Run {
    rps: f64,
    p50_us: f64,
    p99_us: f64,
    errors: u64,
    cpu_us: f64,
    /// The machine's ticks stolen by the hypervisor during the run, and all its ticks.
    stolen: (u64, u64),
    /// For a path with a `pair`: samples on which both processes' main threads were last
    /// on the same CPU, and all samples.
    together: (u64, u64),
}

/// Samples, every 10 ms until dropped, the CPU each of two processes' main threads last
/// ran on: on two vCPUs, where the kernel puts two single-threaded hops that wake each
/// other moved SSE throughput at c=16 by up to 16 % (docs/benchmarks-history.md,
/// 2 December 19:05-19:28), and it carries over from one run to the next. The sampler
/// reads two small `stat` files every 10 ms.
struct Together {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    sampler: Option<std::thread::JoinHandle<(u64, u64)>>,
}

impl Together {
    fn start(pair: Option<(u32, u32)>) -> Self {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sampler = pair.map(|(a, b)| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let (mut same, mut all) = (0, 0);
                while !stop.load(Ordering::Relaxed) {
                    if let (Some(x), Some(y)) = (last_cpu(a), last_cpu(b)) {
                        all += 1;
                        same += u64::from(x == y);
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                (same, all)
            })
        });
        Together { stop, sampler }
    }

    fn finish(mut self) -> (u64, u64) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.sampler
            .take()
            .and_then(|s| s.join().ok())
            .unwrap_or((0, 0))
    }
}

impl Drop for Together {
    /// A run that panics before `finish` stops the sampler too.
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The share of a run's samples (all rounds', after `med`) on which its pair shared a
/// CPU, as "NN %"; "–" without samples.
fn together_share(run: &Run) -> String {
    let (same, all) = run.together;
    if all == 0 {
        return "–".to_owned();
    }
    format!("{:.0} %", same as f64 * 100.0 / all as f64)
}

fn duration_us(text: &str) -> Option<f64> {
    let text = text.trim();
    let (number, unit) = text.split_at(text.find(|c: char| c.is_ascii_alphabetic())?);
    let value: f64 = number.parse().ok()?;
    Some(match unit {
        "us" => value,
        "ms" => value * 1e3,
        "s" => value * 1e6,
        _ => return None,
    })
}

fn wrk(dir: &TempDir, path: &Path3, body: &str, connections: usize, seconds: u64) -> Run {
    let script = dir.path().join("post.lua");
    std::fs::write(
        &script,
        format!(
            "wrk.method = \"POST\"\nwrk.body = '{body}'\nwrk.headers[\"Content-Type\"] = \"application/json\"\n"
        ),
    )
    .expect("lua");
    let before = path.cpu();
    let steal_before = machine_steal_ticks();
    let together = Together::start(path.pair);
    let output = Command::new(which("wrk").expect("wrk"))
        .args([
            "-t1".to_owned(),
            format!("-c{connections}"),
            format!("-d{seconds}s"),
            "--latency".to_owned(),
            "-s".to_owned(),
            script.display().to_string(),
            format!("http://127.0.0.1:{}/v1/chat/completions", path.port),
        ])
        .output()
        .expect("wrk runs");
    let together = together.finish();
    let used = path.cpu().saturating_sub(before);
    let steal_after = machine_steal_ticks();
    let text = String::from_utf8_lossy(&output.stdout);
    let mut run = Run {
        stolen: (
            steal_after.0.saturating_sub(steal_before.0),
            steal_after.1.saturating_sub(steal_before.1),
        ),
        together,
        ..Run::default()
    };
    let mut requests = 0.0;
    for line in text.lines() {
        let line = line.trim();
        if let Some(v) = line.strip_prefix("Requests/sec:") {
            run.rps = v.trim().parse().unwrap_or(0.0);
        } else if let Some(v) = line.strip_prefix("50%") {
            run.p50_us = duration_us(v).unwrap_or(0.0);
        } else if let Some(v) = line.strip_prefix("99%") {
            run.p99_us = duration_us(v).unwrap_or(0.0);
        } else if let Some(v) = line.strip_prefix("Non-2xx or 3xx responses:") {
            run.errors += v.trim().parse::<u64>().unwrap_or(0);
        } else if let Some(v) = line.strip_prefix("Socket errors:") {
            run.errors += v
                .split(',')
                .filter_map(|p| p.split_whitespace().last()?.parse::<u64>().ok())
                .sum::<u64>();
        } else if line.contains("requests in") {
            requests = line
                .split_whitespace()
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0.0);
        }
    }
    run.cpu_us = used.as_secs_f64() * 1e6 / f64::max(requests, 1.0);
    run
}

// ----- paced streams -----

#[derive(Clone, Default)]
struct Paced {
    p50_us: f64,
    p99_us: f64,
    errors: usize,
    /// CPU per chunk delivered, µs, per process of the path.
    cpu_per_chunk_us: Vec<f64>,
    /// The busiest process's CPU over the streams' wall time, in cores.
    busiest_cores: f64,
    /// The share of the whole machine's CPU time that was busy meanwhile (every process,
    /// the load generator and the provider too).
    machine_busy: f64,
    /// The share of it the hypervisor took for other guests meanwhile.
    machine_stolen: f64,
    /// KiB per stream above idle, per process of the path.
    per_stream_kib: Vec<f64>,
    /// Whether every process was back within 2x of its idle RSS within 10 s.
    settled: bool,
    settle_s: f64,
}

/// One paced stream over a raw connection: every chunk's provider stamp and latency, from
/// that stamp to its arrival here (µs).
async fn paced_stream(port: u16, body: Bytes) -> Result<Vec<(u64, u64)>, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream
        .write_all(head.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    stream.write_all(&body).await.map_err(|e| e.to_string())?;
    let mut buf: Vec<u8> = Vec::with_capacity(16 << 10);
    let mut scanned = 0;
    let mut latencies = Vec::with_capacity(PACED_CHUNKS);
    let mut chunk = [0u8; 16 << 10];
    let mut status_checked = false;
    loop {
        let n = stream.read(&mut chunk).await.map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        let arrived = now_us();
        buf.extend_from_slice(&chunk[..n]);
        if !status_checked && buf.len() >= 12 {
            if !buf.starts_with(b"HTTP/1.1 200") {
                return Err(String::from_utf8_lossy(&buf[..buf.len().min(200)]).into_owned());
            }
            status_checked = true;
        }
        while let Some(at) = find(&buf[scanned..], b"\"t_us\":") {
            let start = scanned + at + 7;
            let end = start
                + buf[start..]
                    .iter()
                    .take_while(|b| b.is_ascii_digit())
                    .count();
            if end == buf.len() {
                break; // the number may continue in the next read
            }
            let sent: u64 = std::str::from_utf8(&buf[start..end])
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(arrived);
            latencies.push((sent, arrived.saturating_sub(sent)));
            scanned = end;
        }
        if find(&buf[scanned..], b"[DONE]").is_some() {
            break;
        }
        // Keep the buffer small: what was scanned is not needed again.
        if scanned > 8 << 10 {
            buf.drain(..scanned);
            scanned = 0;
        }
    }
    if latencies.len() + 1 < PACED_CHUNKS {
        return Err(format!(
            "{} of {} chunks",
            latencies.len(),
            PACED_CHUNKS - 1
        ));
    }
    Ok(latencies)
}

async fn paced(path: &Path3) -> Paced {
    let body = Bytes::from(format!(
        r#"{{"model":"fake","stream":true,"pace_ms":{PACE_MS},"messages":[{{"role":"user","content":"Say something slowly."}}]}}"#
    ));
    let idle = path.rss();
    let peaks = std::sync::Arc::new(std::sync::Mutex::new(idle.clone()));
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (peaks, sampling, pids) = (peaks.clone(), sampling.clone(), path.pids.clone());
        std::thread::spawn(move || {
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                let now: Vec<u64> = pids.iter().map(|p| rss_kib(*p)).collect();
                if let Ok(mut peaks) = peaks.lock() {
                    for (peak, now) in peaks.iter_mut().zip(now) {
                        *peak = (*peak).max(now);
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let cpu_before = path.cpus();
    let machine_before = machine_ticks();
    let steal_before = machine_steal_ticks();
    let wall = Instant::now();
    let mut tasks = Vec::with_capacity(PACED_STREAMS);
    for i in 0..PACED_STREAMS {
        let body = body.clone();
        let port = path.port;
        tasks.push(tokio::spawn(async move {
            // Spread the opens over one second, as arrivals would be.
            tokio::time::sleep(Duration::from_micros(
                (i as u64 * 1_000_000) / PACED_STREAMS as u64,
            ))
            .await;
            paced_stream(port, body).await
        }));
    }
    let mut stamped: Vec<(u64, u64)> = Vec::new();
    let mut errors = 0;
    let mut first_error = None;
    for task in tasks {
        match task.await {
            Ok(Ok(latencies)) => stamped.extend(latencies),
            Ok(Err(e)) => {
                errors += 1;
                first_error.get_or_insert(e);
            }
            Err(_) => errors += 1,
        }
    }
    let wall = wall.elapsed().as_secs_f64();
    let machine_busy = {
        let (busy, all) = machine_ticks();
        busy.saturating_sub(machine_before.0) as f64
            / f64::max(all.saturating_sub(machine_before.1) as f64, 1.0)
    };
    let machine_stolen = {
        let (stolen, all) = machine_steal_ticks();
        stolen.saturating_sub(steal_before.0) as f64
            / f64::max(all.saturating_sub(steal_before.1) as f64, 1.0)
    };
    let used: Vec<f64> = path
        .cpus()
        .iter()
        .zip(&cpu_before)
        .map(|(now, before)| now.saturating_sub(*before).as_secs_f64())
        .collect();
    if let Some(e) = first_error {
        eprintln!("bench: {}: paced stream error: {e}", path.name);
    }
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let _ = sampler.join();
    let peaks = peaks.lock().map(|p| p.clone()).unwrap_or_default();
    if let Some(file) = std::env::var_os("IOP_BENCH_PACED_DUMP") {
        let text: String = stamped.iter().map(|(t, l)| format!("{t} {l}\n")).collect();
        if let Err(err) = std::fs::write(&file, text) {
            eprintln!(
                "bench: IOP_BENCH_PACED_DUMP={}: {err}",
                file.to_string_lossy()
            );
        }
    }
    let mut all: Vec<u64> = stamped.into_iter().map(|(_, latency)| latency).collect();
    all.sort_unstable();
    let pick = |q: f64| {
        all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0) as f64
    };
    let started = Instant::now();
    let within = || {
        path.rss()
            .iter()
            .zip(&idle)
            .all(|(now, idle)| *now <= 2 * *idle)
    };
    while !within() && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Paced {
        p50_us: pick(0.5),
        p99_us: pick(0.99),
        errors,
        cpu_per_chunk_us: used
            .iter()
            .map(|u| u * 1e6 / f64::max(all.len() as f64, 1.0))
            .collect(),
        busiest_cores: used.iter().copied().fold(0.0, f64::max) / f64::max(wall, 1e-9),
        machine_busy,
        machine_stolen,
        per_stream_kib: peaks
            .iter()
            .zip(&idle)
            .map(|(peak, idle)| peak.saturating_sub(*idle) as f64 / PACED_STREAMS as f64)
            .collect(),
        settled: within(),
        settle_s: started.elapsed().as_secs_f64(),
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// The median of each figure over the rounds.
fn med(runs: &[Run]) -> Run {
    Run {
        rps: median(runs.iter().map(|r| r.rps).collect()),
        p50_us: median(runs.iter().map(|r| r.p50_us).collect()),
        p99_us: median(runs.iter().map(|r| r.p99_us).collect()),
        errors: runs.iter().map(|r| r.errors).sum(),
        cpu_us: median(runs.iter().map(|r| r.cpu_us).collect()),
        stolen: runs
            .iter()
            .fold((0, 0), |(s, a), r| (s + r.stolen.0, a + r.stolen.1)),
        together: runs
            .iter()
            .fold((0, 0), |(s, a), r| (s + r.together.0, a + r.together.1)),
    }
}

/// The share of the machine's CPU time the hypervisor stole over `runs`.
fn stolen_share(runs: &[&Run]) -> f64 {
    let (stolen, all) = runs
        .iter()
        .fold((0u64, 0u64), |(s, a), r| (s + r.stolen.0, a + r.stolen.1));
    stolen as f64 / f64::max(all as f64, 1.0)
}

fn iop_body(provider: u16) -> String {
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

[[models]]
name = "fake"
providers = [{{ node = "n1", adapter = "oa", target = "fake" }}]
"#
    )
}

/// The fleet's two rows of the table, each link's figure in its own IOP column (TLS, then
/// plaintext): the Edge's memory per idle connected node, and the time until every node
/// is ready again after the Edge restarts, with the bare references (TCP connects, then
/// bare clients redialling over TLS / plaintext) in the direct column and the restart
/// over the bare reconnects of the same link in IOP's (`iop_blackbox::fleet`).
fn fleet_rows(rows: &[fleet::Row], trailing: usize) -> String {
    let cells = |cell: &dyn Fn(&fleet::Row) -> String| {
        rows.iter().map(cell).collect::<Vec<_>>().join(" | ")
    };
    let links = rows
        .iter()
        .map(|r| r.link_name())
        .collect::<Vec<_>>()
        .join(" / ");
    let nodes = count(rows.first().map_or(0, |r| r.nodes));
    format!(
        "| Edge memory per idle connected node, {nodes} nodes | – | – | {} |\n\
         | {nodes} nodes ready again after an Edge restart, median of {} (direct: bare TCP connects; then bare clients redialling by the same policy, {links}) | {:.3} s; {} | – | {} |",
        cells(&|r| format!("{:.1} KiB", r.per_node_kib)),
        fleet::RESTARTS,
        rows.first().map_or(0.0, |r| r.raw.as_secs_f64()),
        rows.iter()
            .map(|r| format!("{:.3} s", r.bare_again().as_secs_f64()))
            .collect::<Vec<_>>()
            .join(" / "),
        cells(&|r| {
            format!(
                "{} ({})",
                fleet::seconds(r.again),
                r.restart_ratio()
                    .map_or_else(|| "–".to_owned(), |x| format!("{x:.2}×"))
            )
        }),
    )
    .lines()
    .map(|line| format!("{line}{}", " – |".repeat(trailing)))
    .collect::<Vec<_>>()
    .join("\n")
}

/// Where `--write` puts the table: between these lines of the file, replacing what was
/// there (the file's other sections are the record of earlier runs and are left alone).
const LATEST_BEGIN: &str =
    "<!-- bench:latest (written by `bench --write`; replaced on every run) -->";
const LATEST_END: &str = "<!-- /bench:latest -->";

/// Puts `report` between the latest-run markers of `path`, or appends a block with them.
fn write_report(path: &std::path::Path, report: &str) -> std::io::Result<()> {
    // A file that is not there gets the block; one that cannot be read is left alone.
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(err) => return Err(err),
    };
    let block = format!("{LATEST_BEGIN}\n**Latest run of the harness.** {report}{LATEST_END}");
    let updated = match (text.find(LATEST_BEGIN), text.find(LATEST_END)) {
        (Some(begin), Some(end)) if begin < end => format!(
            "{}{block}{}",
            &text[..begin],
            &text[end + LATEST_END.len()..]
        ),
        _ => format!("{text}\n{block}\n"),
    };
    std::fs::write(path, updated)
}

/// Keeps every CPU this process may use busy until killed, at the default priority, as
/// an inference engine's busy-polling loop does (vLLM's and llama.cpp's keep their cores
/// at 100 % while they generate).
fn burn() {
    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let spinners: Vec<_> = (0..threads)
        .map(|_| {
            std::thread::spawn(|| {
                let mut x = 0u64;
                loop {
                    x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005) + 1);
                }
            })
        })
        .collect();
    for spinner in spinners {
        let _ = spinner.join();
    }
}

/// `bench scheduler [rounds]`: paced-stream latency through two IOP paths that differ
/// only in the Node's `runtime.scheduler` (`batch`, the default, and `inherit`), and
/// straight to the provider, first on an otherwise idle machine and then beside a
/// process that keeps every CPU busy (`burn`), interleaved round by round. Writes a table
/// of medians to stdout.
fn scheduler(rounds: usize) {
    iop_blackbox::build_binaries();
    let provider_port = free_port();
    let mut provider = Command::new(std::env::current_exe().expect("self"))
        .args(["provider", &provider_port.to_string()])
        .stdout(Stdio::null())
        .spawn()
        .expect("provider starts");
    wait_port(provider_port);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let head = "[limits]\nmax_connections = 8192\nmax_concurrent_requests = 8192\n\n[queue]\nmax_waiting = 8192\n";
    let policies = ["batch", "inherit"];
    let clusters: Vec<(Cluster, Proc)> = policies
        .iter()
        .map(|policy| {
            let cluster = Cluster::start_with(Link::Tls, head, &iop_body(provider_port));
            let node = cluster.node_extra(
                "n1",
                "bench-node-token-0123456789",
                "max_attempts = 0\ninterval_sec = 0.2",
                &format!("[runtime]\nscheduler = \"{policy}\"\n"),
            );
            runtime.block_on(cluster.wait_ready("n1"));
            (cluster, node)
        })
        .collect();
    let mut paths = vec![Path3 {
        name: "direct",
        port: provider_port,
        pids: vec![],
        pair: None,
    }];
    for (policy, (cluster, node)) in policies.iter().zip(&clusters) {
        paths.push(Path3 {
            name: policy,
            port: cluster.http_port,
            pids: vec![cluster.edge.pid(), node.pid()],
            pair: None,
        });
    }
    // latencies[busy][path]: (p50, p99) of each round.
    let mut latencies = vec![vec![Vec::new(); paths.len()]; 2];
    for round in 0..rounds {
        for busy in [false, true] {
            eprintln!(
                "bench scheduler: round {} of {rounds}, {}",
                round + 1,
                if busy {
                    "beside a busy provider"
                } else {
                    "idle machine"
                }
            );
            let mut burner = busy.then(|| {
                Command::new(std::env::current_exe().expect("self"))
                    .arg("burn")
                    .spawn()
                    .expect("burner starts")
            });
            std::thread::sleep(Duration::from_millis(500));
            for (i, path) in paths.iter().enumerate() {
                let run = runtime.block_on(paced(path));
                if run.errors > 0 {
                    eprintln!(
                        "bench scheduler: {}: {} streams failed",
                        path.name, run.errors
                    );
                }
                latencies[usize::from(busy)][i].push((run.p50_us, run.p99_us));
            }
            if let Some(burner) = &mut burner {
                let _ = burner.kill();
                let _ = burner.wait();
            }
        }
    }
    drop(clusters);
    let _ = provider.kill();
    let _ = provider.wait();
    println!(
        "{} paced streams of {PACED_CHUNKS} chunks every {PACE_MS} ms over the TLS link; medians of {rounds} rounds.\n",
        count(PACED_STREAMS)
    );
    println!(
        "| chunk latency p50 / p99 | direct | IOP, Node `batch` (added) | IOP, Node `inherit` (added) |"
    );
    println!("|---|---:|---:|---:|");
    for (busy, label) in [
        (0, "idle machine"),
        (1, "beside a process keeping every CPU busy"),
    ] {
        let p50 = |i: usize| median(latencies[busy][i].iter().map(|l| l.0).collect());
        let p99 = |i: usize| median(latencies[busy][i].iter().map(|l| l.1).collect());
        println!(
            "| {label} | {:.1} / {:.1} ms | {:+.1} / {:+.1} ms | {:+.1} / {:+.1} ms |",
            p50(0) / 1e3,
            p99(0) / 1e3,
            (p50(1) - p50(0)) / 1e3,
            (p99(1) - p99(0)) / 1e3,
            (p50(2) - p50(0)) / 1e3,
            (p99(2) - p99(0)) / 1e3,
        );
    }
}

/// How holding the paths up for profiling (`IOP_BENCH_SERVE`) ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Served {
    /// Stdin closed: measure as usual.
    StdinClosed,
    /// SIGINT or SIGTERM: stop everything and exit, so that no process, and none of the
    /// Edge's and Node's logs (gigabytes after minutes of load), is left behind.
    Stopped,
}

/// Waits, with the paths up, until stdin closes or SIGINT or SIGTERM comes.
async fn serve_until_told() -> Served {
    use tokio::signal::unix::{SignalKind, signal};
    let stdin = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
    });
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        let _ = stdin.await;
        return Served::StdinClosed;
    };
    tokio::select! {
        _ = stdin => Served::StdinClosed,
        _ = term.recv() => Served::Stopped,
        _ = int.recv() => Served::Stopped,
    }
}

/// Stops rathole's server and client, if it ran.
fn stop_rathole(rathole: Option<&mut (Child, Child)>) {
    if let Some((server, client)) = rathole {
        for child in [server, client] {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Stops the nginx hops and the fake provider.
fn stop_data_path(nginx: &mut [&mut Child], provider: &mut Child) {
    for nginx in nginx {
        // TERM lets the master stop its workers; KILL would orphan them.
        let _ = Command::new("kill")
            .args(["-TERM", &nginx.id().to_string()])
            .status();
        let _ = nginx.wait();
    }
    let _ = provider.kill();
    let _ = provider.wait();
}

#[allow(clippy::too_many_lines)]
fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("provider") {
        let port = args
            .get(2)
            .and_then(|p| p.parse().ok())
            .expect("bench provider <port>");
        run_provider(port);
        return;
    }
    if args.get(1).map(String::as_str) == Some("burn") {
        burn();
        return;
    }
    if args.get(1).map(String::as_str) == Some("scheduler") {
        let rounds = args.get(2).and_then(|r| r.parse().ok()).unwrap_or(3);
        scheduler(rounds);
        return;
    }
    if args.get(1).map(String::as_str) == Some("paced") {
        // For profiling beside `IOP_BENCH_SERVE`: one set of paced streams against a port.
        let port = args
            .get(2)
            .and_then(|p| p.parse().ok())
            .expect("bench paced <port> [pid...]");
        let pids = args[3..].iter().filter_map(|p| p.parse().ok()).collect();
        let path = Path3 {
            name: "paced",
            port,
            pids,
            pair: None,
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let run = runtime.block_on(paced(&path));
        println!(
            "p50 {:.0} µs p99 {:.0} µs errors {} cpu/chunk {:?} busy {:.0} %",
            run.p50_us,
            run.p99_us,
            run.errors,
            run.cpu_per_chunk_us,
            run.machine_busy * 100.0
        );
        return;
    }
    iop_blackbox::build_binaries();
    // `--write PATH` puts the table into PATH's latest-run block as well.
    let write_to = args.iter().position(|a| a == "--write").map(|i| {
        let Some(path) = args.get(i + 1) else {
            eprintln!("usage: bench [seconds] [rounds] [--write FILE]");
            std::process::exit(2);
        };
        PathBuf::from(path)
    });
    let command = format!(
        "cargo run --release -p iop-blackbox --bin bench -- {}",
        args.get(1..).unwrap_or_default().join(" ")
    );
    let positional: Vec<&String> = args
        .iter()
        .skip(1)
        .take_while(|a| a.as_str() != "--write")
        .collect();
    let seconds: u64 = positional.first().and_then(|s| s.parse().ok()).unwrap_or(5);
    let rounds: usize = positional.get(1).and_then(|s| s.parse().ok()).unwrap_or(3);
    ensure_tools();
    let dir = TempDir::new("bench");

    let provider_port = free_port();
    let mut provider = Command::new(std::env::current_exe().expect("self"))
        .args(["provider", &provider_port.to_string()])
        .stdout(Stdio::null())
        .spawn()
        .expect("provider starts");
    wait_port(provider_port);

    let (hop1, hop2) = (free_port(), free_port());
    let mut nginx2 = start_nginx(&dir, "hop2", hop2, provider_port);
    let mut nginx1 = start_nginx(&dir, "hop1", hop1, hop2);
    wait_port(hop2);
    wait_port(hop1);
    let rathole_port = free_port();
    let mut rathole =
        rathole_binary().map(|bin| start_rathole(&bin, &dir, rathole_port, provider_port));

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut head = "[limits]\nmax_connections = 8192\nmax_concurrent_requests = 8192\n\n[queue]\nmax_waiting = 8192\n".to_owned();
    // For comparing thread counts; the figures the harness writes use the default.
    // The Edge's threads as it will count them: one polls on its main thread, which is
    // then the thread whose CPU tells where the Edge runs.
    let mut edge_threads = iop_shell_common::process::default_workers().get();
    if let Some(threads) = std::env::var_os("IOP_BENCH_EDGE_THREADS") {
        let threads = threads.to_string_lossy();
        edge_threads = threads.parse().unwrap_or(0);
        head.push_str(&format!("\n[runtime]\nworker_threads = {threads}\n"));
    }
    // IOP twice: over the node link as deployed by default (TLS), and over plaintext.
    let tls = Cluster::start_with(Link::Tls, &head, &iop_body(provider_port));
    let tls_node: Proc = tls.node("n1", "bench-node-token-0123456789");
    runtime.block_on(tls.wait_ready("n1"));
    let plain = Cluster::start_with(Link::Plaintext, &head, &iop_body(provider_port));
    let plain_node: Proc = plain.node("n1", "bench-node-token-0123456789");
    runtime.block_on(plain.wait_ready("n1"));

    if std::env::var_os("IOP_BENCH_SERVE").is_some() {
        // For profiling: keep everything up and say where it is.
        println!(
            "provider {provider_port} nginx {hop1} rathole {rathole_port} iop-tls {} (edge pid {} node pid {}) iop-plaintext {} (edge pid {} node pid {})",
            tls.http_port,
            tls.edge.pid(),
            tls_node.pid(),
            plain.http_port,
            plain.edge.pid(),
            plain_node.pid()
        );
        if runtime.block_on(serve_until_told()) == Served::Stopped {
            // Stopped by a signal: everything started goes, logs included.
            eprintln!("bench: stopped; stopping the paths");
            stop_data_path(&mut [&mut nginx1, &mut nginx2], &mut provider);
            stop_rathole(rathole.as_mut());
            drop((tls_node, plain_node, tls, plain));
            // The stdin reader is still blocked: leave it rather than wait for it.
            runtime.shutdown_background();
            return;
        }
    }
    let iop_path = |name, cluster: &Cluster, node: &Proc| Path3 {
        name,
        port: cluster.http_port,
        pids: vec![cluster.edge.pid(), node.pid()],
        pair: (edge_threads == 1).then(|| (cluster.edge.pid(), node.pid())),
    };
    let paths = [
        Path3 {
            name: "direct",
            port: provider_port,
            pids: vec![],
            pair: None,
        },
        Path3 {
            name: "nginx, 2 hops",
            port: hop1,
            pids: vec![nginx1.id(), nginx2.id()],
            pair: None,
        },
        iop_path("IOP, TLS link (default)", &tls, &tls_node),
        iop_path("IOP, plaintext link", &plain, &plain_node),
    ]
    .into_iter()
    .chain(rathole.as_ref().map(|(server, client)| Path3 {
        name: "rathole, 1 TCP hop",
        port: rathole_port,
        pids: vec![server.id(), client.id()],
        pair: None,
    }))
    .collect::<Vec<_>>();
    // Warm every path up.
    for path in &paths {
        wrk(&dir, path, SMALL, 4, 1);
    }

    // small[k][path]: the runs at SMALL_CONCURRENCY[k], one per round.
    let mut small = vec![vec![Vec::new(); paths.len()]; SMALL_CONCURRENCY.len()];
    let mut sse = vec![Vec::new(); paths.len()];
    // The proxies again with their event loops pinned (`place`): where the scheduler puts
    // two single-threaded hops that talk to each other decides c=16 throughput here.
    let cpus = allowed_cpus();
    let mut pin = cpus.len() >= 2 && which("taskset").is_some();
    let mut many_pinned = vec![Vec::new(); paths.len()];
    let mut sse_pinned = vec![Vec::new(); paths.len()];
    for round in 0..rounds {
        eprintln!("bench: round {} of {rounds}", round + 1);
        for (i, path) in paths.iter().enumerate() {
            for (k, &connections) in SMALL_CONCURRENCY.iter().enumerate() {
                small[k][i].push(wrk(&dir, path, SMALL, connections, seconds));
            }
            sse[i].push(wrk(&dir, path, STREAM, 16, seconds));
        }
        for (i, path) in paths.iter().enumerate().skip(1).filter(|_| pin) {
            if !place(path, true, &cpus) {
                eprintln!("bench: taskset failed; no pinned runs");
                place(path, false, &cpus);
                pin = false;
                break;
            }
            many_pinned[i].push(wrk(&dir, path, SMALL, 16, seconds));
            sse_pinned[i].push(wrk(&dir, path, STREAM, 16, seconds));
            place(path, false, &cpus);
        }
    }
    eprintln!("bench: {PACED_STREAMS} paced streams per path");
    let paced_runs: Vec<Paced> = paths.iter().map(|p| runtime.block_on(paced(p))).collect();

    // The data path is measured: its processes go before the fleet's Edges start.
    stop_data_path(&mut [&mut nginx1, &mut nginx2], &mut provider);
    stop_rathole(rathole.as_mut());
    drop((tls_node, plain_node, tls, plain));
    eprintln!("bench: {FLEET_NODES} nodes against a restarting Edge, TLS and plaintext");
    // If it fails, the data path's figures are still reported.
    let fleet = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runtime.block_on(async {
            let raw = fleet::raw_connects(FLEET_NODES).await;
            let mut rows = Vec::new();
            for link in [Link::Tls, Link::Plaintext] {
                rows.push(fleet::measure(FLEET_NODES, link, FLEET_JITTER, raw).await);
            }
            rows
        })
    }));

    let small: Vec<Vec<Run>> = small
        .iter()
        .map(|runs| runs.iter().map(|r| med(r)).collect())
        .collect();
    let sse: Vec<Run> = sse.iter().map(|r| med(r)).collect();
    let at = |connections: usize| {
        let k = SMALL_CONCURRENCY
            .iter()
            .position(|c| *c == connections)
            .expect("a measured concurrency");
        &small[k]
    };

    let date = String::from_utf8_lossy(
        &Command::new("date")
            .arg("-u")
            .arg("+%Y-%m-%d %H:%M UTC")
            .output()
            .map(|o| o.stdout)
            .unwrap_or_default(),
    )
    .trim()
    .to_owned();
    let mut report = String::new();
    macro_rules! out {
        ($($arg:tt)*) => {{
            use std::fmt::Write as _;
            // Writing into a String cannot fail.
            let _ = writeln!(report, $($arg)*);
        }};
    }
    // One table row: its label and a cell per path.
    let row = |label: &str, cells: Vec<String>| format!("| {label} | {} |", cells.join(" | "));
    // A cell per path from `cell`, "–" for those `cell` skips.
    let cells = |cell: &dyn Fn(usize) -> Option<String>| -> Vec<String> {
        (0..paths.len())
            .map(|i| cell(i).unwrap_or_else(|| "–".to_owned()))
            .collect()
    };
    out!(
        "Measured {date}; medians of {rounds} interleaved rounds of {seconds} s per figure; load from wrk 4.x (1 thread); {} paced streams of {PACED_CHUNKS} chunks every {PACE_MS} ms. Command: `{command}`.\n",
        count(PACED_STREAMS)
    );
    out!(
        "| | {} |",
        paths.iter().map(|p| p.name).collect::<Vec<_>>().join(" | ")
    );
    out!("|---{}|", "|---:".repeat(paths.len()));
    let single = at(1);
    out!(
        "{}",
        row(
            "small request, c=1, p50 / p99 (added)",
            cells(&|i| Some(if i == 0 {
                format!("{:.0} / {:.0} µs", single[0].p50_us, single[0].p99_us)
            } else {
                format!(
                    "{:+.0} / {:+.0} µs",
                    single[i].p50_us - single[0].p50_us,
                    single[i].p99_us - single[0].p99_us
                )
            }))
        )
    );
    for &connections in &SMALL_CONCURRENCY[1..] {
        let runs = at(connections);
        out!(
            "{}",
            row(
                &format!("small requests, c={connections}, req/s (ratio to direct; p99)"),
                cells(&|i| Some(format!(
                    "{:.0} ({:.2}; {:.1} ms)",
                    runs[i].rps,
                    runs[i].rps / runs[0].rps,
                    runs[i].p99_us / 1e3
                )))
            )
        );
    }
    for connections in [16, 64] {
        let runs = at(connections);
        out!(
            "{}",
            row(
                &format!("proxy CPU per small request (c={connections})"),
                cpu_cells(&runs.iter().map(|r| r.cpu_us).collect::<Vec<_>>(), 1)
            )
        );
    }
    let chunks = |run: &Run| run.rps * SSE_EVENTS as f64;
    // CPU per SSE chunk of each path's streams.
    let per_chunk_us =
        |runs: &[Run]| -> Vec<f64> { runs.iter().map(|r| r.cpu_us / SSE_EVENTS as f64).collect() };
    out!(
        "{}",
        row(
            "unpaced SSE, c=16, chunks/s (ratio to direct)",
            cells(&|i| Some(format!(
                "{:.0} ({:.2})",
                chunks(&sse[i]),
                chunks(&sse[i]) / chunks(&sse[0])
            )))
        )
    );
    out!(
        "{}",
        row("proxy CPU per SSE chunk", cpu_cells(&per_chunk_us(&sse), 2))
    );
    out!(
        "{}",
        row(
            "IOP's Edge and Node on the same CPU, share of the c=16 runs (small / SSE)",
            cells(&|i| paths[i].pair.map(|_| format!(
                "{} / {}",
                together_share(&at(16)[i]),
                together_share(&sse[i])
            )))
        )
    );
    let base = &paced_runs[0];
    out!(
        "{}",
        row(
            &format!(
                "{} streams, {PACE_MS} ms pacing, chunk latency p50 / p99 (added)",
                count(PACED_STREAMS)
            ),
            cells(&|i| Some(if i == 0 {
                format!("{:.0} / {:.0} µs", base.p50_us, base.p99_us)
            } else {
                format!(
                    "{:+.1} / {:+.1} ms",
                    (paced_runs[i].p50_us - base.p50_us) / 1e3,
                    (paced_runs[i].p99_us - base.p99_us) / 1e3
                )
            }))
        )
    );
    // Figures of each process of a path, as "a + b".
    let joined = |values: &[f64]| {
        values
            .iter()
            .map(|v| format!("{v:.1}"))
            .collect::<Vec<_>>()
            .join(" + ")
    };
    out!(
        "{}",
        row(
            "paced streams: CPU per chunk, µs (per process)",
            cells(&|i| (i > 0).then(|| format!(
                "{} (busiest {:.2} cores)",
                joined(&paced_runs[i].cpu_per_chunk_us),
                paced_runs[i].busiest_cores
            )))
        )
    );
    out!(
        "{}",
        row(
            "paced streams: whole machine's CPU busy meanwhile",
            cells(&|i| Some(format!("{:.0} %", paced_runs[i].machine_busy * 100.0)))
        )
    );
    out!(
        "{}",
        row(
            "machine's CPU stolen by the hypervisor (wrk runs / paced streams)",
            cells(&|i| {
                let mut runs: Vec<&Run> = small.iter().map(|runs| &runs[i]).collect();
                runs.push(&sse[i]);
                Some(format!(
                    "{:.0} % / {:.0} %",
                    stolen_share(&runs) * 100.0,
                    paced_runs[i].machine_stolen * 100.0
                ))
            })
        )
    );
    out!(
        "{}",
        row(
            "memory per paced stream, KiB (per process)",
            cells(&|i| (i > 0).then(|| joined(&paced_runs[i].per_stream_kib)))
        )
    );
    out!(
        "{}",
        row(
            "RSS back within 2× of idle after the streams",
            cells(&|i| (i > 0).then(|| format!(
                "{} ({:.1} s)",
                if paced_runs[i].settled { "yes" } else { "no" },
                paced_runs[i].settle_s
            )))
        )
    );
    out!(
        "{}",
        row(
            "errors (all runs)",
            cells(&|i| Some(
                (small.iter().map(|runs| runs[i].errors).sum::<u64>()
                    + sse[i].errors
                    + paced_runs[i].errors as u64)
                    .to_string()
            ))
        )
    );
    match &fleet {
        Ok(rows) => out!("{}", fleet_rows(rows, paths.len() - 4)),
        Err(_) => {
            // The panic's message and place are already on stderr.
            out!(
                "| Edge memory per idle connected node; {FLEET_NODES} nodes ready again after an Edge restart | – | – | the fleet run failed (see stderr) | – |{}",
                " – |".repeat(paths.len() - 4)
            );
        }
    }

    if pin {
        let many = at(16);
        let many_pinned: Vec<Run> = many_pinned.iter().map(|r| med(r)).collect();
        let sse_pinned: Vec<Run> = sse_pinned.iter().map(|r| med(r)).collect();
        out!(
            "\nThe proxies pinned, in the same rounds: each single-threaded process on a CPU of its own (the Edge on CPU {}, the Node on CPU {}), each nginx hop's workers spread over the {} CPUs as `worker_cpu_affinity auto` places them; wrk and the provider unpinned.\n",
            cpus[0],
            cpus[1],
            cpus.len()
        );
        let proxies = 1..paths.len();
        let pinned_row = |label: &str, cell: &dyn Fn(usize) -> String| {
            format!(
                "| {label} | {} |",
                proxies.clone().map(cell).collect::<Vec<_>>().join(" | ")
            )
        };
        out!(
            "| | {} |",
            proxies
                .clone()
                .map(|i| format!("{}, pinned", paths[i].name))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        out!("|---{}|", "|---:".repeat(proxies.len()));
        out!(
            "{}",
            pinned_row(
                "small requests, c=16, req/s (ratio to nginx pinned; to the same path unpinned)",
                &|i| format!(
                    "{:.0} ({:.2}; {:.2})",
                    many_pinned[i].rps,
                    many_pinned[i].rps / many_pinned[1].rps,
                    many_pinned[i].rps / many[i].rps
                )
            )
        );
        out!(
            "{}",
            row(
                "proxy CPU per small request (c=16)",
                cpu_cells(&many_pinned.iter().map(|r| r.cpu_us).collect::<Vec<_>>(), 1)
                    .split_off(1)
            )
        );
        out!(
            "{}",
            pinned_row(
                "unpaced SSE, c=16, chunks/s (ratio to direct)",
                &|i| format!(
                    "{:.0} ({:.2})",
                    chunks(&sse_pinned[i]),
                    chunks(&sse_pinned[i]) / chunks(&sse[0])
                )
            )
        );
        out!(
            "{}",
            row(
                "proxy CPU per SSE chunk",
                cpu_cells(&per_chunk_us(&sse_pinned), 2).split_off(1)
            )
        );
        out!(
            "{}",
            pinned_row("errors (pinned runs)", &|i| (many_pinned[i].errors
                + sse_pinned[i].errors)
                .to_string())
        );
    }
    print!("{report}");
    if let Some(path) = &write_to {
        match write_report(path, &report) {
            Ok(()) => eprintln!("bench: the table is in {}", path.display()),
            Err(err) => eprintln!("bench: cannot write {}: {err}", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_placement_cell_is_a_share_or_a_dash() {
        let run = |together| Run {
            together,
            ..Run::default()
        };
        assert_eq!(together_share(&run((0, 0))), "–");
        assert_eq!(together_share(&run((2, 3))), "67 %");
    }

    #[test]
    fn the_fleet_rows_give_tls_then_plaintext_in_their_columns() {
        let ms = Duration::from_millis;
        let row = |link, per_node_kib, again, bare, tls_again| fleet::Row {
            link,
            jitter: 0.2,
            nodes: 1000,
            cold: Some(ms(100)),
            again,
            cold_cpu: ms(0),
            restart_cpu: ms(0),
            per_node_kib,
            raw: ms(42),
            raw_again: bare,
            tls_again,
        };
        let rows = [
            row(Link::Tls, 5.74, Some(ms(230)), ms(70), Some(ms(200))),
            row(Link::Plaintext, 1.5, None, ms(64), None),
        ];
        assert_eq!(
            fleet_rows(&rows, 0),
            "| Edge memory per idle connected node, 1,000 nodes | – | – | 5.7 KiB | 1.5 KiB |\n\
             | 1,000 nodes ready again after an Edge restart, median of 5 (direct: bare TCP connects; then bare clients redialling by the same policy, TLS 1.3 / plaintext) | 0.042 s; 0.200 s / 0.064 s | – | 0.230 s (1.15×) | did not finish in 60 s (–) |"
        );
        // A column after the two IOP ones (rathole's) gets a dash in each row.
        assert!(fleet_rows(&rows, 1).lines().all(|l| l.ends_with("| – |")));
    }

    #[test]
    fn cpu_rows_give_every_iop_path_against_nginx() {
        assert_eq!(
            cpu_cells(&[0.0, 31.4, 29.9, 27.0], 1).join(" | "),
            "– | 31.4 µs | 29.9 µs (0.95× nginx) | 27.0 µs (0.86× nginx)"
        );
        assert_eq!(
            cpu_cells(&[0.0, 3.41, 3.3], 2).join(" | "),
            "– | 3.41 µs | 3.30 µs (0.97× nginx)"
        );
    }

    #[test]
    fn cpu_lists_read_as_the_kernel_writes_them() {
        assert_eq!(cpu_list("0-1"), [0, 1]);
        assert_eq!(cpu_list(" 0-2,5,7-8\n"), [0, 1, 2, 5, 7, 8]);
        assert_eq!(cpu_list("3"), [3]);
        assert!(cpu_list("2-1").is_empty());
        assert!(cpu_list("x").is_empty());
        assert!(cpu_list("0-99999").is_empty());
    }

    #[test]
    fn the_latest_run_block_is_replaced_and_the_rest_kept() {
        let dir = TempDir::new("bench-write");
        let path = dir.path().join("BENCHMARKS.md");
        std::fs::write(&path, "# Benchmarks\n\nbefore\n").unwrap();
        write_report(&path, "Measured first.\n").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("# Benchmarks\n\nbefore\n"));
        assert!(text.contains("**Latest run of the harness.** Measured first.\n"));
        std::fs::write(&path, format!("{text}after\n")).unwrap();
        write_report(&path, "Measured second.\n").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains("first"), "{text}");
        assert!(text.contains("Measured second."));
        assert!(text.starts_with("# Benchmarks\n\nbefore\n") && text.ends_with("after\n"));
        assert_eq!(text.matches(LATEST_BEGIN).count(), 1);
        // A file that is not text is not overwritten.
        std::fs::write(&path, [0xff, 0xfe, 0x00]).unwrap();
        assert!(write_report(&path, "Measured third.\n").is_err());
        assert_eq!(std::fs::read(&path).unwrap(), [0xff, 0xfe, 0x00]);
    }
}
