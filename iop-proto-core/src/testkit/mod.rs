//! Test support shared by the crate's tests, the simulator and the fuzz targets.
//! Compiled only with the `testkit` feature; it adds no dependencies.

pub mod cluster;
pub mod fuzz;
pub mod harness;
pub mod multihome;
pub mod rng;
pub mod sim;
pub mod upgrade;

use crate::wire::{AdapterConfig, AdapterType};
use crate::{EdgeCore, NodeSession};

/// The machines' internals, which embedders never touch: the lease ledger, the wait
/// queue, the registration guards, the Node's capacity gate and the run and tunnel
/// sequencers. Tests, benches and fuzz targets reach them here.
pub mod internals {
    pub use crate::gate::{CapacityGate, GateError};
    pub use crate::guard::{
        AuthThrottle, Contest, FlapGuard, Instance, PendingConnections, Rival, Source,
    };
    pub use crate::lease::{Lease, Ledger, Release, Usage as LeaseUsage};
    pub use crate::queue::{Candidate, Ticket, WaitQueue, Waiter};
    pub use crate::run::{RunEmitter, RunStep, RunTracker};
    pub use crate::tunnel::{BodyFrames, TunnelEmitter, TunnelReceiver, TunnelStep};
}

use internals::{CapacityGate, Ledger, WaitQueue};

/// Read access to a machine's internals, for tests that check them against what the
/// machine reported.
pub trait Inspect {
    /// The Edge's lease ledger.
    fn ledger(&self) -> &Ledger;
    /// The Edge's wait queue.
    fn queue(&self) -> &WaitQueue;
}

impl Inspect for EdgeCore {
    fn ledger(&self) -> &Ledger {
        &self.pool.ledger
    }

    fn queue(&self) -> &WaitQueue {
        &self.pool.queue
    }
}

/// Read access to a Node session's internals.
pub trait InspectSession {
    /// The capacity gate of `adapter`, while it is configured.
    fn gate(&self, adapter: &str) -> Option<&CapacityGate>;
}

impl InspectSession for NodeSession {
    fn gate(&self, adapter: &str) -> Option<&CapacityGate> {
        self.gates.get(adapter)
    }
}

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

/// Bugs planted in the simulated Edge shell, to prove the simulator's invariants catch
/// what a broken driver does to the system (the machines themselves take no test
/// switches: the faults are the harness's, as quinn's `Pair` drops and reorders on its
/// side). All off by default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Copy every dispatch to the connections that registered and are not ready yet.
    pub dispatch_to_pending: bool,
    /// Never hand the Edge a run's or tunnel's terminal while its caller waits.
    pub swallow_terminal: bool,
    /// Never hand the Edge the terminal of a run whose caller left.
    pub swallow_cancelled_terminal: bool,
    /// Write a tunnel dispatch as a normalized run.
    pub tunnel_as_run: bool,
    /// Close the whole connection for a message about one run of an unknown kind.
    pub close_on_unknown_kind: bool,
    /// Read a node's drain request and never hand it over.
    pub swallow_drain: bool,
    /// Never drive the Edge's timers.
    pub skip_timers: bool,
    /// Dispatch a request once more after its first bytes reached the caller.
    pub redispatch_after_first_byte: bool,
}
