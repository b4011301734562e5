//! Load from wrk, run one path at a time or all together, and what it reports.

#[allow(unused_imports)]
use crate::*;
use iop_blackbox::TempDir;
use iop_blackbox::procfs::{last_cpu, machine_steal_ticks};
use std::process::Command;
use std::time::Duration;

// ----- wrk -----

#[derive(Clone, Copy, Default)]
pub(crate) struct Run {
    pub(crate) rps: f64,
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    pub(crate) errors: u64,
    pub(crate) cpu_us: f64,
    /// The machine's ticks stolen by the hypervisor during the run, and all its ticks.
    pub(crate) stolen: (u64, u64),
    /// For a path with a `pair`: samples on which both processes' main threads were last
    /// on the same CPU, and all samples.
    pub(crate) together: (u64, u64),
}

/// Samples, every 10 ms until dropped, the CPU each of two processes' main threads last
/// ran on: on two vCPUs, where the kernel puts two single-threaded hops that wake each
/// other moved SSE throughput at c=16 by up to 16 % (docs/benchmarks-history.md,
/// 2 December 19:05-19:28), and it carries over from one run to the next. The sampler
/// reads two small `stat` files every 10 ms.
pub(crate) struct Together {
    pub(crate) stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub(crate) sampler: Option<std::thread::JoinHandle<(u64, u64)>>,
}

impl Together {
    pub(crate) fn start(pair: Option<(u32, u32)>) -> Self {
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

    pub(crate) fn finish(mut self) -> (u64, u64) {
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
pub(crate) fn together_share(run: &Run) -> String {
    let (same, all) = run.together;
    if all == 0 {
        return "–".to_owned();
    }
    format!("{:.0} %", same as f64 * 100.0 / all as f64)
}

pub(crate) fn duration_us(text: &str) -> Option<f64> {
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

pub(crate) fn wrk(
    dir: &TempDir,
    path: &Path3,
    body: &str,
    connections: usize,
    seconds: u64,
) -> Run {
    wrk_at(
        dir,
        path,
        "/v1/chat/completions",
        body,
        connections,
        seconds,
    )
}

/// [`wrk`] against another route of the path (`/v1/messages`).
pub(crate) fn wrk_at(
    dir: &TempDir,
    path: &Path3,
    route: &str,
    body: &str,
    connections: usize,
    seconds: u64,
) -> Run {
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
            format!("http://127.0.0.1:{}{route}", path.port),
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
