//! A deterministic simulation of nodes multi-homed to a cluster of Edges
//! (docs/cluster.md): every node keeps a session with each of three real [`EdgeCore`]s in
//! cluster mode, callers submit to any Edge, and the Edges race for the same providers.
//! Links carry frames through the real codec with seeded latency; now and then an Edge is
//! killed (its connections drop) and started again, and the nodes dial it anew.
//!
//! The node side does what the node shell does: its sessions share one capacity through
//! a [`LoadBoard`]: a session takes in what the others hold right before it handles what
//! its Edge sent, and publishes what it holds once it has; whenever one's load moves, the
//! others take it in (and report it to their Edges). Claims are admitted at once (the
//! cluster world, `testkit::cluster`, checks what etcd decides).
//!
//! Invariants, checked after every step:
//! - no provider above its capacity: a node's work across all its sessions stays within
//!   each adapter's capacity and long-context capacity, whatever the Edges believed;
//! - every accepted request ends exactly once;
//! - at the end, every live Edge holds no lease and waits for nothing, and every node is
//!   ready on every Edge with one session each.

use std::time::Duration;

use crate::fleet::{Fleet, NODES, Setup, Shape};
use iop_proto_core::edge_config::QueueLimits;
use iop_proto_core::reconnect::{ReconnectPolicy, Supervisor};
use iop_proto_core::time::Timestamp;

const EDGES: usize = 3;

/// Bugs planted in the simulated node, to prove the invariants catch them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MultihomeFaults {
    /// A session does not take in what the node's other sessions hold: its gates count
    /// only its own work.
    pub blind_sessions: bool,
}

/// What one run did.
#[derive(Clone, Debug, Default)]
pub struct MultihomeStats {
    /// Requests accepted by some Edge.
    pub requests: u64,
    /// Requests that completed.
    pub completed: u64,
    /// Runs a node refused because another Edge had taken the slot.
    pub refused: u64,
    /// Edges killed.
    pub killed: u64,
    /// Runs started while the same node ran work for another Edge.
    pub shared: u64,
}

/// Runs the multi-homed world of `seed`; the first broken invariant is the error, with
/// the trace's last lines.
///
/// # Errors
/// An invariant broke.
pub fn run_multihome_seed(seed: u64, faults: MultihomeFaults) -> Result<MultihomeStats, String> {
    let setup = Setup {
        shape: Shape::Multihome {
            edges: EDGES,
            blind_sessions: faults.blind_sessions,
        },
        token: "multihome-sim-token",
        // Few units, so the Edges race.
        capacity: 2,
        long_capacity: 1,
        latency_ms: 8,
        queue: QueueLimits {
            max_waiting: 16,
            wait_timeout: Duration::from_millis(4000),
        },
    };
    // Nodes dial each Edge themselves here: no supervisor.
    let unused = || Supervisor::new(ReconnectPolicy::default());
    let mut world = Fleet::new(seed, setup, unused);
    let result = play(&mut world, seed);
    let c = &world.counts;
    result
        .map(|()| MultihomeStats {
            requests: c.requests,
            completed: c.completed,
            refused: c.refused,
            killed: c.killed,
            shared: c.shared,
        })
        .map_err(|err| world.failure("multihome", seed, &err))
}

/// Load on every Edge, an Edge killed and started again in some seeds, then quiet.
fn play(world: &mut Fleet, seed: u64) -> Result<(), String> {
    let kill_at = seed
        .is_multiple_of(3)
        .then(|| Timestamp::from_millis(world.rng.range(500, 1500)));
    let mut killed: Option<(usize, Timestamp)> = None;
    let load_until = Timestamp::from_millis(2000);
    while world.now < load_until {
        if let Some(at) = kill_at
            && killed.is_none()
            && world.now >= at
        {
            let e = world.rng.below(EDGES as u64) as usize;
            world.kill(e);
            killed = Some((
                e,
                world.now + Duration::from_millis(world.rng.range(200, 800)),
            ));
        }
        if let Some((e, back)) = killed
            && !world.edges[e].alive
            && world.now >= back
        {
            restart(world, e);
        }
        for _ in 0..world.rng.below(4) {
            let e = world.rng.below(EDGES as u64) as usize;
            let long = world.rng.chance(15);
            world.submit(e, long)?;
        }
        let step = world.rng.range(1, 20);
        world.run_until(world.now + Duration::from_millis(step))?;
    }
    if let Some((e, _)) = killed
        && !world.edges[e].alive
    {
        restart(world, e);
    }
    world.run_until(world.now + Duration::from_millis(6000))?;
    check_end(world)
}

/// Edge `e` starts again (a new process: new connection ids).
fn restart(world: &mut Fleet, e: usize) {
    world.log(|| format!("edge {e} started again"));
    world.edges[e] = world.fresh_edge(1_000 * (world.counts.killed + 1));
}

/// At the end: every request ended, no Edge holds a lease, and every node is ready on
/// every Edge with one session each.
fn check_end(world: &Fleet) -> Result<(), String> {
    world.check_edges_settled()?;
    for e in 0..EDGES {
        let ready = world.ready_on(e);
        if ready != NODES {
            return Err(format!("only {ready} nodes ready on edge {e} at the end"));
        }
    }
    for node in &world.nodes {
        for e in 0..EDGES {
            let on = node.sessions.iter().filter(|s| s.edge == e).count();
            if on != 1 {
                return Err(format!("{} ends with {on} sessions on edge {e}", node.id));
            }
        }
    }
    Ok(())
}
