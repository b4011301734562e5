//! An Edge in a cluster of Edges (docs/cluster.md): what [`EdgeCore`] decides there.
//!
//! - **A register waits for its claim.** Once a node is authenticated, the node id must
//!   be claimed cluster-wide before the connection may take it: the core emits
//!   [`EdgeEvent::ClaimNode`], the shell asks its
//!   [`ClusterMember`](crate::cluster::ClusterMember), and answers with
//!   [`EdgeCore::handle_claim`]. Admitted, the register goes on as on a single Edge
//!   (conflicts and draining holders included); otherwise it is refused with a retry
//!   ([`RejectReason::ClusterHeld`], [`RejectReason::ClusterUnavailable`]).
//! - **A node instance no longer served here is released** ([`EdgeEvent::ReleaseNode`]),
//!   so that this Edge stops renewing its node lease.
//! - **A fenced instance drains** ([`EdgeCore::handle_cluster_fence`]): no new work, closed
//!   once its work has ended.
//! - **Nodes that follow the cluster learn its members**: in their `RegisterResponse`, and
//!   in a `ClusterMembers` message on every change ([`EdgeCore::handle_cluster_members`]).

use super::CloseReason;
use super::ConnId;
use super::DrainReason;
use super::EdgeCore;
use super::EdgeEvent;
use super::cx;
use crate::time::Timestamp;
use crate::wire::Body;
use crate::wire::RegisterRequest;

use std::collections::HashMap;

use super::registry::{Admitted, ClusterStep, NodeIdx, Phase};
use crate::cluster::ClaimDecision;
use crate::wire::ClusterMembers;

/// The core's cluster state: off on a single Edge.
#[derive(Debug, Default)]
pub(super) struct ClusterState {
    pub(super) enabled: bool,
    /// Registers waiting for their claim, by connection.
    awaiting: HashMap<ConnId, (NodeIdx, Box<RegisterRequest>)>,
    /// Instances that may no longer be served here, settled when events are polled.
    ended: Vec<(NodeIdx, u64)>,
    /// The members, as last told.
    pub(super) members: Option<ClusterMembers>,
    /// The cluster's shared configuration is in ([`EdgeCore::handle_cluster_serving`]):
    /// until then every register is told to try again shortly, not judged against a
    /// configuration that may not be the cluster's yet.
    pub(super) serving: bool,
    /// Since when.
    serving_since: Timestamp,
}

impl ClusterState {
    /// Whether `conn` waits for its claim.
    pub(super) fn awaits(&self, conn: ConnId) -> bool {
        self.awaiting.contains_key(&conn)
    }

    /// A register authenticated on `conn` waits for its claim.
    pub(super) fn wait(&mut self, conn: ConnId, node: NodeIdx, req: &RegisterRequest) {
        self.awaiting.insert(conn, (node, Box::new(req.clone())));
    }

    /// `instance` of `node` may have lost its last connection here.
    pub(super) fn ended(&mut self, node: NodeIdx, instance: u64) {
        if self.enabled {
            self.ended.push((node, instance));
        }
    }

    /// `conn` closed: a claim it waited for settles on its own.
    pub(super) fn closed(&mut self, conn: ConnId) {
        if let Some((node, req)) = self.awaiting.remove(&conn) {
            self.ended.push((node, req.instance_id));
        }
    }
}

impl EdgeCore {
    /// Makes this Edge a cluster member's: from now on every authenticated register waits
    /// for [`handle_claim`](Self::handle_claim). Call before the first connection.
    pub fn enable_cluster(&mut self) {
        self.cluster.enabled = true;
    }

    /// The cluster member may serve ([`ClusterMember::is_serving`](crate::cluster::ClusterMember::is_serving)):
    /// the shared configuration is applied here, and registers are judged from now on.
    /// Before it, a register in cluster mode is refused with a retry (`cluster_unavailable`),
    /// never as unknown: a node whose id only the shared configuration names would hear
    /// "authentication failed" from an Edge that is merely starting.
    pub fn handle_cluster_serving(&mut self, now: Timestamp) {
        self.advance(now);
        if !self.cluster.serving {
            self.cluster.serving = true;
            self.cluster.serving_since = now;
        }
    }

    /// Whether a member of a cluster should take callers (its `/healthz`): some model
    /// group has a live provider here, or none is configured, or it began to serve less than
    /// two heartbeat intervals or one register timeout ago, whichever is longer (the
    /// nodes that follow the cluster dial a new member as soon as they hear of it, and a
    /// hand-over re-homes its nodes within moments). A member whose nodes all went elsewhere, or that
    /// lost them in a hand-over, would otherwise hold its callers until their queue wait
    /// ran out while the other members could answer them: answering 503 sends the
    /// balancer's callers to those (when no member has a node, every member answers 503:
    /// the fabric cannot serve). Outside cluster mode, always true.
    #[must_use]
    pub fn takes_callers(&self, now: Timestamp) -> bool {
        if !self.cluster.enabled {
            return true;
        }
        let timing = &self.config.timing;
        let grace = (timing.heartbeat_interval * 2).max(timing.register_timeout);
        if !self.cluster.serving
            || now.saturating_duration_since(self.cluster.serving_since) < grace
        {
            return true;
        }
        let mut models = self.pool.models().peekable();
        models.peek().is_none()
            || models.any(|model| {
                model.candidates.iter().any(|c| {
                    let usage = self.pool.usage(c.resource);
                    usage.generation.is_some() && usage.capacity > 0
                })
            })
    }

    /// Whether [`enable_cluster`](Self::enable_cluster) was called.
    #[must_use]
    pub fn is_cluster(&self) -> bool {
        self.cluster.enabled
    }

    /// The cluster's answer to the [`EdgeEvent::ClaimNode`] of `conn`. A connection that
    /// closed meanwhile, or an answer nobody waits for, changes nothing (the instance is
    /// released if nothing here serves it).
    pub fn handle_claim(&mut self, now: Timestamp, conn: ConnId, decision: ClaimDecision) {
        self.advance(now);
        let Some((node, req)) = self.cluster.awaiting.remove(&conn) else {
            return;
        };
        self.cluster.ended.push((node, req.instance_id));
        let Ok(phase) = self.registry.phase(conn) else {
            return;
        };
        match decision {
            ClaimDecision::Admitted { .. } => {
                self.take_node(conn, phase, &req, ClusterStep::Claimed);
            }
            ClaimDecision::HeldBy { instance } => {
                let mut cx = cx!(self);
                self.registry
                    .refuse_claim(&mut cx, conn, node, Some(instance));
            }
            ClaimDecision::Unavailable => {
                let mut cx = cx!(self);
                self.registry.refuse_claim(&mut cx, conn, node, None);
            }
        }
    }

    /// The cluster member can no longer vouch for `instance` of `node_id` (its node lease
    /// or the Edge's membership ran out): the node drains, taking no new work, and closes
    /// once its work has ended. Another instance does not lose its connection.
    pub fn handle_cluster_fence(&mut self, now: Timestamp, node_id: &str, instance: u64) {
        self.advance(now);
        let Some(node) = self.registry.idx(node_id) else {
            return;
        };
        if self
            .registry
            .node(node)
            .owner
            .is_some_and(|o| o.instance() == instance)
        {
            self.drain_node(
                node,
                DrainReason::Cluster("this edge can no longer vouch for the node id in etcd"),
            );
        }
    }

    /// The cluster's members changed: every node that follows the cluster is told. A
    /// member that could not go on the wire (an empty or oversized id or address) is left
    /// out, and at most [`MAX_CLUSTER_MEMBERS`](crate::wire::MAX_CLUSTER_MEMBERS) are told.
    pub fn handle_cluster_members(&mut self, now: Timestamp, mut members: ClusterMembers) {
        self.advance(now);
        let fits = |text: &str| !text.is_empty() && text.len() <= crate::wire::MAX_NODE_ID_BYTES;
        members
            .members
            .retain(|m| fits(&m.edge_id) && fits(&m.node_addr));
        members.members.truncate(crate::wire::MAX_CLUSTER_MEMBERS);
        if self.cluster.members.as_ref() == Some(&members) {
            return;
        }
        for i in self.registry.indices() {
            if let Some(owner) = self.registry.node(i).owner.filter(|o| o.cluster) {
                self.out
                    .send(owner.conn, Body::ClusterMembers(members.clone()));
            }
        }
        self.cluster.members = Some(members);
    }

    /// Emits [`EdgeEvent::ReleaseNode`] for every instance that lost its last connection
    /// here and waits for no claim.
    pub(super) fn settle_cluster(&mut self) {
        if self.cluster.ended.is_empty() {
            return;
        }
        let mut ended = std::mem::take(&mut self.cluster.ended);
        ended.sort_unstable();
        ended.dedup();
        for (node, instance) in ended {
            let entry = self.registry.node(node);
            let served = entry.owner.is_some_and(|o| o.instance() == instance);
            let waiting = self
                .cluster
                .awaiting
                .values()
                .any(|(n, r)| *n == node && r.instance_id == instance);
            if !served && !waiting {
                self.out.event(EdgeEvent::ReleaseNode {
                    node_id: entry.id.clone(),
                    instance,
                });
            }
        }
    }

    /// A register that may take its node (its claim admitted, or no cluster): through the
    /// registry's rules, then taken.
    pub(super) fn take_node(
        &mut self,
        conn: ConnId,
        phase: Phase,
        req: &RegisterRequest,
        step: ClusterStep,
    ) {
        let mut cx = cx!(self);
        match self
            .registry
            .admit(&mut cx, conn, phase, req, &self.config, step)
        {
            Admitted::Refused => {}
            Admitted::Violation(violation) => self.violation(conn, violation),
            Admitted::Claim { node } => {
                self.cluster.wait(conn, node, req);
                self.out.event(EdgeEvent::ClaimNode {
                    conn,
                    node_id: self.registry.node(node).id.clone(),
                    instance: req.instance_id,
                });
            }
            Admitted::Take { node, superseding } => {
                if let Some(old) = superseding {
                    self.fence(node, old.generation, CloseReason::Superseded);
                }
                let mut cx = cx!(self);
                let members = self.cluster.members.as_ref();
                self.registry
                    .take(&mut cx, conn, node, req, &self.config, members);
            }
        }
    }
}
