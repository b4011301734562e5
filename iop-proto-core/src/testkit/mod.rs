//! The machines' internals for tests, benches and fuzz targets, and the drain loop every
//! test drives a machine with. Compiled only with the `testkit` feature; it adds no
//! dependencies. The simulations, the harness and the fuzz entry points are the
//! `iop-testkit` crate's.

use crate::edge::{EdgeEvent, Transmit};
use crate::session::{NodeTransmit, SessionEvent};
use crate::wire::{AdapterConfig, AdapterType};
use crate::{EdgeCore, NodeSession};

/// Everything the Edge machine has to hand out, in the order a shell drains it:
/// transmits, then events (lifecycle events are dropped).
pub fn drain_edge(edge: &mut EdgeCore) -> (Vec<Transmit>, Vec<EdgeEvent>) {
    let transmits = std::iter::from_fn(|| edge.poll_transmit()).collect();
    let events = std::iter::from_fn(|| edge.poll_event()).collect();
    while edge.poll_lifecycle().is_some() {}
    (transmits, events)
}

/// Everything a node session has to hand out: transmits, then events.
pub fn drain_node(node: &mut NodeSession) -> (Vec<NodeTransmit>, Vec<SessionEvent>) {
    let transmits = std::iter::from_fn(|| node.poll_transmit()).collect();
    let events = std::iter::from_fn(|| node.poll_event()).collect();
    (transmits, events)
}

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
