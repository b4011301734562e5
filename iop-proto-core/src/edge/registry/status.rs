//! What the registry shows of its nodes (status pages, recent registration failures), the
//! Edge's read-only lookups of nodes and connections, and the connection inputs that touch
//! the registry alone (opened, secured, bytes received).

use super::{NodeIdx, Phase, Registry};
use crate::edge::ConnId;
use crate::edge::EdgeCore;
use crate::edge::FailingNode;
use crate::edge::NodeState;
use crate::edge::NodeStatus;
use crate::edge::Peer;
use crate::edge::RegistrationFailures;
use crate::edge::UsageError;
use crate::edge::cx;
use crate::lease::Generation;
use crate::lease::ResourceId;
use crate::time::Timestamp;
use crate::wire::RefreshStatus;
use std::sync::Arc;

impl Registry {
    /// Configured nodes and their readiness, in id order; `last_refresh` comes from the
    /// control traffic.
    pub(in crate::edge) fn statuses(
        &self,
        now: Timestamp,
        last_refresh: impl Fn(NodeIdx) -> Option<RefreshStatus>,
    ) -> Vec<NodeStatus> {
        let mut out: Vec<NodeStatus> = self
            .indices()
            .filter(|&i| self.node(i).spec.is_some())
            .map(|i| {
                let n = self.node(i);
                let conn = n.owner.and_then(|o| self.conns.get(&o.conn));
                NodeStatus {
                    node_id: n.id.clone(),
                    state: match n.owner {
                        None => NodeState::Offline,
                        Some(o) if o.ready => NodeState::Ready,
                        Some(_) => NodeState::Pending,
                    },
                    generation: n.owner.map(|o| o.generation),
                    revision: n.revision,
                    applied_revision: n.applied_revision,
                    last_refresh: last_refresh(i),
                    conflict: n.flap.in_conflict(now),
                    tls: conn.and_then(|c| c.peer.tls),
                    client_certificate: conn.is_some_and(|c| !c.peer.identities.is_empty()),
                    draining: n.draining.is_some(),
                    version: n.agent.as_ref().map(|a| a.version.to_string()),
                    labels: n
                        .agent
                        .as_ref()
                        .map(|a| {
                            a.labels
                                .iter()
                                .map(|(k, v)| (k.to_string(), v.to_string()))
                                .collect()
                        })
                        .unwrap_or_default(),
                    rtt: conn.and_then(|c| c.rtt),
                    last_seen: conn.map(|c| now.saturating_duration_since(c.last_rx)),
                }
            })
            .collect();
        out.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        out
    }

    /// Node ids and sources whose registrations failed within the throttle's window,
    /// most failures first, at most `max` of each.
    pub(in crate::edge) fn failures(&self, now: Timestamp, max: usize) -> RegistrationFailures {
        RegistrationFailures {
            nodes: self
                .throttle
                .failing_nodes(now, max)
                .into_iter()
                .map(|f| FailingNode {
                    known: self.configured(&f.key).is_some(),
                    node_id: f.key.chars().take(64).collect(),
                    failures: f.failures,
                    hold: f.hold,
                    since_last: f.since_last,
                })
                .collect(),
            sources: self.throttle.failing_sources(now, max),
        }
    }
}

/// The queries about nodes and connections, answered by the registry alone.
impl EdgeCore {
    /// Node ids and sources whose registrations failed within the throttle's window,
    /// most failures first, at most `max` of each: who keeps failing to register.
    #[must_use]
    pub fn registration_failures(&self, max: usize) -> RegistrationFailures {
        self.registry.failures(self.now, max)
    }

    /// Number of open node connections (any phase).
    #[must_use]
    pub fn connections(&self) -> usize {
        self.registry.conn_count()
    }

    /// The node id and generation a connection owns, and whether it is ready, if it is
    /// the node's current owner.
    #[must_use]
    pub fn owner_of(&self, conn: ConnId) -> Option<(Arc<str>, Generation, bool)> {
        let Ok(Phase::Owner { node, generation }) = self.registry.phase(conn) else {
            return None;
        };
        let entry = self.registry.node(node);
        let owner = entry.owner?;
        (owner.conn == conn).then(|| (entry.id.clone(), generation, owner.ready))
    }

    /// The connection that currently owns `node_id` (pending or ready).
    #[must_use]
    pub fn owner_of_node(&self, node_id: &str) -> Option<ConnId> {
        let i = self.registry.idx(node_id)?;
        self.registry.node(i).owner.map(|o| o.conn)
    }

    /// The resource of `(node_id, provider_id)`, if configured at any time.
    #[must_use]
    pub fn resource(&self, node_id: &str, provider_id: &str) -> Option<ResourceId> {
        let i = self.registry.idx(node_id)?;
        self.registry
            .node(i)
            .resources
            .iter()
            .find(|(name, _)| &**name == provider_id)
            .map(|(_, r)| *r)
    }

    pub(in crate::edge) fn open_connection(
        &mut self,
        conn: ConnId,
        peer: Peer,
    ) -> Result<(), UsageError> {
        let mut cx = cx!(self);
        self.registry.open(&mut cx, conn, peer, &self.config)
    }

    pub(in crate::edge) fn secure_connection(
        &mut self,
        conn: ConnId,
        tls: &'static str,
        identities: Vec<String>,
    ) -> Result<(), UsageError> {
        self.registry.secured(conn, tls, identities)
    }

    pub(in crate::edge) fn bytes_received(&mut self, conn: ConnId) -> Result<(), UsageError> {
        self.registry.bytes_received(self.now, conn)
    }
}
