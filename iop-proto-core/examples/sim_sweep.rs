//! Sweeps a range of simulation seeds and lists every one that breaks an invariant,
//! instead of stopping at the first as `cargo test` does. Run it in release through
//! `scripts/sim-sweep <start> <count> [threads]`; a failing seed replays with
//! `IOP_SIM_SEED=<n> cargo test -p iop-proto-core --test sim -- --nocapture`.
//!
//! Exits 0 when every seed passed, 1 when any failed, 2 on bad arguments.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use iop_proto_core::testkit::sim::{self, SimOptions};

/// Seeds a thread takes at a time: small enough to share the tail of a range evenly.
const BATCH: u64 = 256;

fn usage() -> ! {
    eprintln!("usage: sim_sweep <start> <count> [threads]");
    std::process::exit(2);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |i: usize| -> Option<u64> { args.get(i)?.replace('_', "").parse().ok() };
    let (Some(start), Some(count)) = (number(0), number(1)) else {
        usage();
    };
    let threads = match args.get(2) {
        Some(_) => number(2).filter(|&t| t > 0).unwrap_or_else(|| usage()),
        None => std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
    };
    let end = start.saturating_add(count);
    // A machine panic is reported as that seed's failure; the default hook would print
    // every one of them in the middle of the progress lines.
    std::panic::set_hook(Box::new(|_| {}));
    println!("sweeping seeds {start}..{end} on {threads} threads");
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
                        if let Err(failure) = sim::run_seed(seed, SimOptions::default()) {
                            println!("FAIL seed {seed} at {}: {}", failure.at, failure.message);
                            failures
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)
                                .push((seed, failure.at, failure.message));
                        }
                    }
                    let swept = done.fetch_add(BATCH.min(end - from), Ordering::Relaxed)
                        + BATCH.min(end - from);
                    if swept % 50_000 < BATCH {
                        println!(
                            "{swept} of {count} seeds in {:.0} s",
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
    failures.sort_by_key(|(seed, _, _)| *seed);
    println!(
        "swept seeds {start}..{end} ({count}) in {:.0} s: {} failed",
        started.elapsed().as_secs_f64(),
        failures.len()
    );
    for (seed, at, message) in &failures {
        println!("  seed {seed} at {at}: {message}");
    }
    std::process::exit(i32::from(!failures.is_empty()));
}
