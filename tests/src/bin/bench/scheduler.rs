//! The scheduler comparison: paced-stream latency with the Node under SCHED_BATCH and under its inherited policy, idle and beside a busy CPU.

#[allow(unused_imports)]
use crate::*;
use iop_blackbox::client::{Cluster, Link};
use iop_blackbox::fleet::count;
use iop_blackbox::{Proc, free_port};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Keeps every CPU this process may use busy until killed, at the default priority, as
/// an inference engine's busy-polling loop does (vLLM's and llama.cpp's keep their cores
/// at 100 % while they generate).
pub(crate) fn burn() {
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
pub(crate) fn scheduler(rounds: usize) {
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
