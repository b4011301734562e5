//! Sweeps a range of simulation seeds of one world and lists every one that breaks an
//! invariant, instead of stopping at the first as `cargo test` does. Run it in release
//! through `scripts/sim-sweep [world] <start> <count> [threads]`; `replay <seed>` runs one
//! seed of the main world and prints its whole trace.
//!
//! Worlds: `main` (one Edge, nodes, clients and faults), `upgrade` (Edge processes replaced
//! one after another), `multihome` (three Edges sharing nodes), `cluster` (three cluster
//! members against a simulated etcd), and `all` (each of them over the same range).
//!
//! Exits 0 when every seed passed, 1 when any failed, 2 on bad arguments.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use iop_testkit::cluster::{ClusterFaults, run_cluster_seed};
use iop_testkit::multihome::{MultihomeFaults, run_multihome_seed};
use iop_testkit::sim::{self, SimOptions};
use iop_testkit::upgrade::{UpgradeFaults, run_upgrade_seed};

/// Seeds a thread takes at a time: small enough to share the tail of a range evenly.
const BATCH: u64 = 256;

/// The worlds a sweep can run, by name.
const WORLDS: [&str; 5] = ["main", "streams", "upgrade", "multihome", "cluster"];

fn usage() -> ! {
    eprintln!(
        "usage: sim_sweep [main|upgrade|multihome|cluster|all] <start> <count> [threads]\n       \
         sim_sweep replay <seed>"
    );
    std::process::exit(2);
}

/// Runs `seed` of `world`: `Err` with where and why it broke.
fn run_one(world: &str, seed: u64) -> Result<(), String> {
    match world {
        "main" => sim::run_seed(seed, SimOptions::default())
            .map(drop)
            .map_err(|f| format!("at {}: {}", f.at, f.message)),
        "streams" => sim::run_seed(
            seed,
            SimOptions {
                streams: true,
                ..SimOptions::default()
            },
        )
        .map(drop)
        .map_err(|f| format!("at {}: {}", f.at, f.message)),
        "upgrade" => run_upgrade_seed(seed, UpgradeFaults::default()).map(drop),
        "multihome" => run_multihome_seed(seed, MultihomeFaults::default()).map(drop),
        "cluster" => run_cluster_seed(seed, ClusterFaults::default()).map(drop),
        _ => usage(),
    }
}

/// Sweeps `start..start + count` of `world` on `threads`; returns the failures.
fn sweep(world: &str, start: u64, count: u64, threads: u64) -> Vec<(u64, String)> {
    let end = start.saturating_add(count);
    println!("sweeping {world} seeds {start}..{end} on {threads} threads");
    let next = AtomicU64::new(start);
    let done = AtomicU64::new(0);
    let failures = Mutex::new(Vec::new());
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let from = next.fetch_add(BATCH, Ordering::Relaxed);
                    if from >= end {
                        return;
                    }
                    for seed in from..(from + BATCH).min(end) {
                        // A machine panic is that seed's failure, as a broken check is.
                        let outcome = std::panic::catch_unwind(|| run_one(world, seed))
                            .unwrap_or_else(|_| Err("panicked".to_owned()));
                        if let Err(message) = outcome {
                            let first = message.lines().next().unwrap_or("").to_owned();
                            println!("FAIL {world} seed {seed}: {first}");
                            failures
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)
                                .push((seed, first));
                        }
                    }
                    let swept = done.fetch_add(BATCH.min(end - from), Ordering::Relaxed)
                        + BATCH.min(end - from);
                    if swept % 50_000 < BATCH {
                        println!(
                            "{swept} of {count} {world} seeds in {:.0} s",
                            started.elapsed().as_secs_f64()
                        );
                    }
                }
            });
        }
    });
    let mut failures = failures
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    failures.sort_by_key(|(seed, _)| *seed);
    println!(
        "swept {world} seeds {start}..{end} ({count}) in {:.0} s: {} failed",
        started.elapsed().as_secs_f64(),
        failures.len()
    );
    failures
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("replay") {
        let Some(seed) = args.get(1).and_then(|s| s.replace('_', "").parse().ok()) else {
            usage();
        };
        let options = SimOptions {
            full_trace: true,
            ..SimOptions::default()
        };
        match sim::run_seed(seed, options) {
            Ok(stats) => println!("seed {seed} passed: {stats:?}"),
            Err(failure) => {
                println!("{failure}");
                std::process::exit(1);
            }
        }
        return;
    }
    let world = match args.first() {
        Some(w) if w == "all" || WORLDS.contains(&w.as_str()) => args.remove(0),
        _ => "main".to_owned(),
    };
    let number = |i: usize| -> Option<u64> { args.get(i)?.replace('_', "").parse().ok() };
    let (Some(start), Some(count)) = (number(0), number(1)) else {
        usage();
    };
    let threads = match args.get(2) {
        Some(_) => number(2).filter(|&t| t > 0).unwrap_or_else(|| usage()),
        None => std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
    };
    // A panic is reported as that seed's failure; the default hook would print every one
    // of them in the middle of the progress lines.
    std::panic::set_hook(Box::new(|_| {}));
    let worlds: Vec<&str> = if world == "all" {
        WORLDS.to_vec()
    } else {
        vec![world.as_str()]
    };
    let mut failed = Vec::new();
    for w in worlds {
        for (seed, message) in sweep(w, start, count, threads) {
            failed.push(format!("{w} seed {seed}: {message}"));
        }
    }
    for line in &failed {
        println!("  {line}");
    }
    std::process::exit(i32::from(!failed.is_empty()));
}
