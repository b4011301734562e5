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
//! `bench dialects [seconds] [rounds]` measures what Anthropic's Messages dialect adds:
//! the same requests through one Edge and Node as chat completions and as `/v1/messages`,
//! over a tunnel and over a normalized run (`dialects.rs`).
//!
//! `bench scheduler [rounds]` measures something else: paced-stream latency through two
//! IOP paths (TLS link) whose Nodes differ only in `runtime.scheduler` (`batch`, the
//! default, and `inherit`), and straight to the provider, on an otherwise idle machine and
//! then beside a process that keeps every CPU busy at the default priority, as an
//! inference engine's busy loop does (`bench burn`).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use iop_blackbox::client::{Cluster, Link};
use iop_blackbox::fleet::{self, count};
use iop_blackbox::{Proc, TempDir, free_port};

mod provider;
mod report;
#[allow(unused_imports)]
use report::*;
mod scheduler;
#[allow(unused_imports)]
use provider::*;
#[allow(unused_imports)]
use scheduler::*;
mod procs;
#[allow(unused_imports)]
use procs::*;
mod load;
#[allow(unused_imports)]
use load::*;
mod paced;
#[allow(unused_imports)]
use paced::*;
mod dialects;

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
    if args.get(1).map(String::as_str) == Some("dialects") {
        let seconds = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(5);
        let rounds = args.get(3).and_then(|r| r.parse().ok()).unwrap_or(3);
        dialects::dialects(seconds, rounds);
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
    use std::time::Duration;

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
