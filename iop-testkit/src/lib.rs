//! The simulations and test kit of IOP (not published): one harness, the simulated
//! worlds, and the fuzz entry points, over the protocol core's machines and the public
//! API crate.
//!
//! - [`harness`]: the drain loop, a Sans-IO [`harness::Wire`] carrying frames through the
//!   real codec with a delay, and a [`harness::Pair`] of one Edge and one Node session.
//! - [`sim`]: the main world: one Edge, nodes, clients and faults.
//! - [`upgrade`]: Edge processes replaced one after another (hand-over), and
//!   [`multihome`]: three Edges sharing nodes: two configurations of one skeleton
//!   (`fleet.rs`: Edges, links, node sessions, provider work and the checks they share).
//! - [`cluster`]: three cluster members against a simulated etcd.
//! - [`messages`]: the Anthropic Messages stream grammar, and [`responses`]: the
//!   Responses API stream rules, each checked from a stream's bytes.
//! - [`fuzz`]: what each fuzz target runs, so that corpora replay in `cargo test`.
//! - [`rng`]: the seeded generator every world draws from.

pub mod cluster;
mod fleet;
pub mod fuzz;
pub mod harness;
pub mod messages;
pub mod multihome;
pub mod responses;
pub mod rng;
pub mod sim;
pub mod upgrade;

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
