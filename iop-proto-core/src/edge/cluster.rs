//! An Edge in a cluster of Edges (docs/cluster.md): the state [`EdgeCore`] keeps for it.
//! The rules that act on it cross sub-states and are in `transitions.rs` with the
//! others:
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

use super::ConnId;
use crate::time::Timestamp;
use crate::wire::RegisterRequest;

use std::collections::HashMap;

use super::registry::NodeIdx;
use crate::wire::ClusterMembers;

/// The core's cluster state: off on a single Edge.
#[derive(Debug, Default)]
pub(super) struct ClusterState {
    pub(super) enabled: bool,
    /// Registers waiting for their claim, by connection.
    pub(super) awaiting: HashMap<ConnId, (NodeIdx, Box<RegisterRequest>)>,
    /// Instances that may no longer be served here, settled when events are polled.
    pub(super) ended: Vec<(NodeIdx, u64)>,
    /// The members, as last told.
    pub(super) members: Option<ClusterMembers>,
    /// The cluster's shared configuration is in ([`EdgeCore::handle_cluster_serving`]):
    /// until then every register is told to try again shortly, not judged against a
    /// configuration that may not be the cluster's yet.
    pub(super) serving: bool,
    /// Since when.
    pub(super) serving_since: Timestamp,
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
