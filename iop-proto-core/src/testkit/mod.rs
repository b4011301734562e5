//! Test support shared by the crate's tests, the simulator and the fuzz targets.
//! Compiled only with the `testkit` feature; it adds no dependencies.

pub mod fuzz;
pub mod harness;
pub mod rng;
pub mod sim;

use crate::wire::{AdapterConfig, AdapterType};

/// The adapter every test uses: `kind` named `name`, serving target `"t"` with
/// `capacity` units of which `long` may be long-context, at a base URL nothing listens on.
#[must_use]
pub fn adapter(name: &str, kind: AdapterType, capacity: u32, long: u32) -> AdapterConfig {
    AdapterConfig {
        name: name.into(),
        r#type: kind as i32,
        base_url: "http://127.0.0.1:9".into(),
        capacity,
        long_capacity: long,
        targets: vec!["t".into()],
        enabled: true,
        ..AdapterConfig::default()
    }
}

/// Bugs that can be planted in the machines, to prove the simulator catches them.
/// All off by default; only the `testkit` feature compiles the switches in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Release a lease twice when a request ends.
    pub double_release: bool,
    /// Activate a node's resources at register instead of at ready.
    pub dispatch_before_ready: bool,
    /// Forget to release the lease of a completed run.
    pub leak_lease: bool,
    /// Grant a tunnel-only waiter to a provider that stopped tunnelling.
    pub ignore_tunnel_only: bool,
    /// Keep a cancelled run's lease until the grace even when the node ended the run.
    pub hold_cancelled_lease: bool,
    /// Close the whole connection for a message about one run of an unknown kind.
    pub close_on_unknown_kind: bool,
    /// Take a node's drain request as read but keep its capacity (it gets new work).
    pub ignore_drain: bool,
}
