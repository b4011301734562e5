//! A deterministic simulation of an Edge upgrade under load: one Edge process after
//! another, each a real [`EdgeCore`], re-homing node processes that each hold a draining
//! session to the old process beside a new one to its successor, with clients
//! submitting throughout. Links carry frames through the real codec with seeded latency.
//!
//! A handover is what the shell does: the successor starts listening (new dials reach
//! it), then the old core is told ([`EdgeCore::handle_rehome`]). Sometimes the old
//! process is killed in the middle (every one of its connections drops). Nodes run the
//! real [`NodeSession`] and [`Supervisor`]; a re-homed session drains beside the new one
//! and what it holds is reported to the new one, as the node shell does.
//!
//! Invariants, checked after every step:
//! - no dispatch (`RunRequest`, `ProviderTunnelRequest`) on a connection after the Edge
//!   told it to re-home;
//! - no provider above its capacity: a node's work across its sessions stays within each
//!   adapter's capacity and long-context capacity, and no session refuses work for
//!   capacity (the Edge never oversubscribed what the node reported);
//! - every accepted request ends exactly once, and at the end every live Edge holds no
//!   lease, waits for nothing, and every node is ready on the last Edge with one session.

use std::time::Duration;

use crate::fleet::{Fleet, NODES, Setup, Shape};
use iop_proto_core::edge_config::QueueLimits;
use iop_proto_core::reconnect::{MaxAttempts, ReconnectPolicy, Supervisor};
use iop_proto_core::time::Timestamp;
use iop_proto_core::wire::{Body, Envelope, NodeRehomeRequest};

/// Bugs planted in the simulated shells, to prove the invariants catch them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UpgradeFaults {
    /// The old Edge's shell tells the nodes to re-home itself, without telling its core:
    /// the core goes on dispatching to sessions told to re-home.
    pub rehome_behind_the_core: bool,
    /// The node does not report what its draining session holds to the new one.
    pub hide_held_elsewhere: bool,
}

/// What one run did.
#[derive(Clone, Debug, Default)]
pub struct UpgradeStats {
    /// Requests accepted by some Edge.
    pub requests: u64,
    /// Requests that completed.
    pub completed: u64,
    /// Handovers.
    pub handovers: u64,
    /// Old Edges killed mid-handover.
    pub killed: u64,
    /// Times a node re-homed.
    pub rehomed: u64,
    /// Dispatches a new Edge made while a node's old session still held capacity.
    pub beside_old: u64,
}

/// Runs the upgrade world of `seed`; the first broken invariant is the error, with the
/// trace's last lines.
///
/// # Errors
/// An invariant broke.
pub fn run_upgrade_seed(seed: u64, faults: UpgradeFaults) -> Result<UpgradeStats, String> {
    let setup = Setup {
        shape: Shape::Upgrade {
            listening: 0,
            rehome_behind_the_core: faults.rehome_behind_the_core,
            hide_held_elsewhere: faults.hide_held_elsewhere,
        },
        token: "upgrade-sim-token",
        capacity: 3,
        long_capacity: 1,
        latency_ms: 6,
        queue: QueueLimits {
            max_waiting: 8,
            wait_timeout: Duration::from_millis(3000),
        },
    };
    let supervisor = || {
        Supervisor::new(ReconnectPolicy {
            max_attempts: MaxAttempts::Unlimited,
            interval: Duration::from_millis(50),
        })
    };
    let mut world = Fleet::new(seed, setup, supervisor);
    let result = play(&mut world, seed);
    let c = &world.counts;
    result
        .map(|()| UpgradeStats {
            requests: c.requests,
            completed: c.completed,
            handovers: c.handovers,
            killed: c.killed,
            rehomed: c.rehomed,
            beside_old: c.beside_old,
        })
        .map_err(|err| world.failure("upgrade", seed, &err))
}

/// The Edge the listener leads to.
fn listening(world: &Fleet) -> usize {
    match world.setup.shape {
        Shape::Upgrade { listening, .. } => listening,
        Shape::Multihome { .. } => 0,
    }
}

/// The whole run: load, one or two handovers (some killed midway), then quiet.
fn play(world: &mut Fleet, seed: u64) -> Result<(), String> {
    let handovers = 1 + (seed % 2);
    let mut next_handover = Timestamp::from_millis(world.rng.range(300, 900));
    let load_until = Timestamp::from_millis(4000);
    while world.now < load_until {
        if world.now >= next_handover && world.counts.handovers < handovers {
            handover(world)?;
            next_handover = world.now + Duration::from_millis(world.rng.range(400, 1500));
        }
        for _ in 0..world.rng.below(3) {
            let long = world.rng.chance(15);
            world.submit(listening(world), long)?;
        }
        let step = world.rng.range(1, 25);
        world.run_until(world.now + Duration::from_millis(step))?;
    }
    // Quiet: everything in flight ends, nodes settle on the last Edge.
    world.run_until(world.now + Duration::from_millis(8000))?;
    check_end(world)
}

/// A successor starts listening (new dials reach it), then the old core is told to
/// re-home its nodes, as the shell does; sometimes the old process is killed midway.
fn handover(world: &mut Fleet) -> Result<(), String> {
    let old = listening(world);
    let successor = world.fresh_edge(1);
    world.edges.push(successor);
    let new = world.edges.len() - 1;
    if let Shape::Upgrade { listening, .. } = &mut world.setup.shape {
        *listening = new;
    }
    world.counts.handovers += 1;
    world.log(|| format!("handover: edge {old} -> edge {new}"));
    let behind = matches!(
        world.setup.shape,
        Shape::Upgrade {
            rehome_behind_the_core: true,
            ..
        }
    );
    if behind {
        for conn in world.open_conns(old) {
            let envelope = Envelope::new(Body::NodeRehomeRequest(NodeRehomeRequest {
                reason: "planted".into(),
            }));
            world.edge_writes(old, conn, envelope)?;
        }
    } else {
        let now = world.now;
        world.edges[old].core.handle_rehome(now);
        world.drain_edge(old)?;
    }
    if world.rng.chance(25) {
        // Killed in the middle of the handover.
        let at = world.rng.range(0, 300);
        world.run_until(world.now + Duration::from_millis(at))?;
        world.kill(old);
    }
    Ok(())
}

/// At the end: every request ended, no live Edge holds a lease, and every node has one
/// session, ready on the last Edge.
fn check_end(world: &Fleet) -> Result<(), String> {
    world.check_edges_settled()?;
    let last = world.edges.len() - 1;
    for node in &world.nodes {
        let on_last = node.sessions.iter().filter(|s| s.edge == last).count();
        if node.sessions.len() != 1 || on_last != 1 {
            return Err(format!(
                "{} ends with {} sessions ({on_last} on the last edge)",
                node.id,
                node.sessions.len()
            ));
        }
    }
    let ready = world.ready_on(last);
    if ready != NODES {
        return Err(format!("only {ready} nodes ready on the last edge"));
    }
    Ok(())
}
