//! Node registry: connections and their phases, node ownership by generation,
//! registration (credentials, the throttle, conflicts) and the ready handshake.
//!
//! The `Registry` decides who a connection is; what that means for leases and requests
//! (a superseded owner fenced, a ready node's capacity activated) is in `transitions`.
//!
//! Longer than the crate's ~800-line norm on purpose: registration is one decision read
//! top to bottom (pending caps, credentials, the throttle, conflicts, ownership and
//! generation, the ready handshake), each step gating the next; split, the order of the
//! gates would hide across files. The guards' own accounting is in `guard.rs`.

use super::CloseReason;
use super::ConnId;
use super::ConnViolation;
use super::Cx;
use super::DrainReason;
use super::EdgeEvent;
use super::Peer;
use super::TOO_MANY_FAILURES;
use super::TimerKey;
use super::Transmit;
use super::UsageError;
use crate::edge_config::EdgeConfig;
use crate::guard::AuthThrottle;
use crate::guard::FlapGuard;
use crate::guard::Instance;
use crate::guard::PendingConnections;
use crate::guard::Source;
use crate::idhash::IdMap;
use crate::lease::Generation;
use crate::lease::ResourceId;
use crate::time::Timestamp;
use crate::wire::Body;
use crate::wire::Heartbeat;
use crate::wire::NodeReadyRequest;
use crate::wire::NodeReadyResponse;
use std::sync::Arc;
use std::time::Duration;

mod admit;
mod status;
/// How soon a node held off because its node id is draining may register again (its
/// own redial interval, when longer, wins).
const DRAINING_RETRY_AFTER: Duration = Duration::from_secs(1);

/// How soon a node refused by an Edge process that is handing over dials again: at
/// once, in effect; the listener already leads to the successor.
const HANDING_OVER_RETRY_AFTER: Duration = Duration::from_millis(50);
/// When a node whose id another instance holds in the cluster may try again: the
/// holder's node lease runs out within its TTL (10 s) once no Edge renews it.
const CLUSTER_HELD_RETRY_AFTER: Duration = Duration::from_secs(5);
/// When a node this Edge could not claim (etcd unreachable) may try again.
const CLUSTER_UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(2);

/// The index of a node ever configured (a node removed from the configuration keeps its
/// entry, with no spec, so its resources and their leases stay addressable).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) struct NodeIdx(u32);

impl NodeIdx {
    /// Its place in the registry's table, and in tables kept beside it.
    pub(super) fn position(self) -> usize {
        self.0 as usize
    }
}

/// Connections, node ownership by generation, and admission (throttle, pending caps).
#[derive(Debug)]
pub(super) struct Registry {
    nodes: Vec<NodeEntry>,
    index: IdMap<Arc<str>, NodeIdx>,
    conns: IdMap<ConnId, Conn>,
    throttle: AuthThrottle,
    pending: PendingConnections,
    /// Connections refused for the pending caps (logged at powers of two).
    refused_pending: u64,
    next_generation: u64,
    next_nonce: u64,
    /// This Edge process is handing over ([`EdgeCore::handle_rehome`]): registers are
    /// held off so that nodes reach the successor.
    pub(super) handing_over: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// Opened, no register yet.
    Unregistered,
    /// Accepted register for `node` in `generation` (pending or ready: see the node).
    Owner {
        node: NodeIdx,
        generation: Generation,
    },
    /// Rejected or superseded; a close was requested. Nothing it sends matters.
    Stale,
    /// Its register failed while the claimed node id or its source is throttled: the
    /// refusal is held back until its [`TimerKey::Answer`]. Nothing it sends matters.
    Held,
}

#[derive(Debug)]
pub(super) struct Conn {
    phase: Phase,
    peer: Peer,
    /// Counted in [`PendingConnections`] (until it registers, is refused or closes).
    pending: bool,
    last_rx: Timestamp,
    /// The Edge's heartbeat still unanswered: (nonce, sent at).
    ping: Option<(u64, Timestamp)>,
    /// Round-trip time of the last heartbeat the peer answered.
    rtt: Option<Duration>,
    /// The refusal a [`Phase::Held`] connection gets when its hold ends.
    held: Option<Box<HeldAnswer>>,
}

/// A refusal held back by the throttle.
#[derive(Debug)]
struct HeldAnswer {
    /// The node id it claimed (as it is echoed in the answer).
    claimed: String,
    /// When it may try again.
    retry_after: Duration,
}

/// The reason a throttled node reads: distinct from [`AUTH_FAILED`] and stable, so a
/// node can tell it is being slowed down, and when to come back.
#[must_use]
pub fn throttled_reason(retry_after: Duration) -> String {
    let ms = retry_after.as_millis().max(1);
    if ms < 1000 {
        format!("{TOO_MANY_FAILURES}, retry in {ms} ms")
    } else {
        format!("{TOO_MANY_FAILURES}, retry in {} s", ms.div_ceil(1000))
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Owner {
    pub(super) conn: ConnId,
    pub(super) generation: Generation,
    pub(super) ready: bool,
    /// Revision sent in the `RegisterResponse`.
    pub(super) registered_revision: u64,
    /// The node process that registered (its `RegisterRequest.instance_id`).
    instance: Instance,
    /// The node can re-home (`RegisterRequest.rehome`).
    pub(super) rehome: bool,
    /// The node follows the cluster's members (`RegisterRequest.cluster`).
    pub(super) cluster: bool,
}

impl Owner {
    /// The node process that registered, `0` for a node too old to say.
    pub(super) fn instance(&self) -> u64 {
        self.instance.map_or(0, std::num::NonZeroU64::get)
    }
}

#[derive(Debug)]
pub(super) struct NodeEntry {
    pub(super) id: Arc<str>,
    /// `None` once removed from the configuration.
    pub(super) spec: Option<crate::edge_config::NodeSpec>,
    pub(super) revision: u64,
    pub(super) applied_revision: u64,
    pub(super) owner: Option<Owner>,
    /// Adapter instance → resource, for every adapter ever configured on this node.
    pub(super) resources: Vec<(Arc<str>, ResourceId)>,
    /// Supersedes of this node id, to notice two nodes fighting over it.
    flap: FlapGuard,
    /// The node gets no new work and its connection is closed once its last lease
    /// returns: it could not take its configuration (it then registers afresh), or it is
    /// stopping gracefully.
    pub(super) draining: Option<DrainReason>,
    /// What the node said about itself in its last accepted register (version,
    /// labels); kept while it is offline so an operator sees what was last there.
    agent: Option<Box<Agent>>,
}

/// A node's own description of itself, from its `RegisterRequest` (bounded by
/// validation: see [`crate::wire::Validate`]).
#[derive(Debug, Clone, Default)]
struct Agent {
    version: Box<str>,
    labels: Box<[(Box<str>, Box<str>)]>,
}

/// What became of a register.
pub(super) enum Admitted {
    /// Refused or held off; its answer is sent (or held back). Nothing else to do.
    Refused,
    /// A second register on one connection: the connection broke the grammar.
    Violation(ConnViolation),
    /// It may take `node`. `superseding` is the owner it takes the node from: already
    /// told and closed here, for the caller to fence.
    /// In a cluster, authenticated: the node id must be claimed before it is taken.
    Claim { node: NodeIdx },
    Take {
        node: NodeIdx,
        superseding: Option<Owner>,
    },
}

/// What became of a ready.
pub(super) enum Readied {
    /// Refused (and closed when it must be); nothing else to do.
    Refused,
    /// The ready owner said it again: answered, no side effect.
    Duplicate,
    /// A ready naming another node id: the connection broke the grammar.
    Violation(ConnViolation),
    /// The pending owner is ready now.
    Activated {
        node: NodeIdx,
        generation: Generation,
        /// The revision it registered with (a newer one must be pushed).
        registered_revision: u64,
    },
}

/// Where a register stands with the cluster, for [`Registry::admit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ClusterStep {
    /// A single Edge: no cluster.
    Single,
    /// In a cluster, not claimed yet: authenticated, it waits for the claim.
    Unclaimed,
    /// In a cluster, the claim admitted it.
    Claimed,
}

/// Why a register is refused for now: another live connection holds the node id.
enum HeldOff {
    /// Two live connections claim it; the flap guard says when to try again and whether
    /// the refusal is worth a log line.
    Conflict { retry_after: Duration, log: bool },
    /// The holder is stopping gracefully and still finishing its requests.
    Draining,
    /// This Edge process is handing over: try again at once, reaching its successor.
    HandingOver,
    /// In a cluster, the same node process already has a live session here.
    Duplicate,
    /// The cluster did not let this Edge serve the node id: another instance holds it
    /// (`Some`), or the claim could not be decided (`None`: etcd unreachable, not a
    /// member).
    Cluster { held_by: Option<u64> },
}

impl Registry {
    pub(super) fn new(throttle: crate::guard::ThrottleLimits) -> Self {
        Registry {
            nodes: Vec::new(),
            index: IdMap::default(),
            conns: IdMap::default(),
            throttle: AuthThrottle::new(throttle),
            pending: PendingConnections::default(),
            refused_pending: 0,
            next_generation: 1,
            next_nonce: 1,
            handing_over: false,
        }
    }

    // ----- lookups -----

    /// The node `id` names, configured now or before.
    pub(super) fn idx(&self, id: &str) -> Option<NodeIdx> {
        self.index.get(id).copied()
    }

    /// The node `id` names, if it is configured now.
    pub(super) fn configured(&self, id: &str) -> Option<NodeIdx> {
        self.idx(id).filter(|&i| self.node(i).spec.is_some())
    }

    pub(super) fn node(&self, i: NodeIdx) -> &NodeEntry {
        &self.nodes[i.position()]
    }

    /// Whether node `i`'s connection was heard from within `timeout` before `now`. One
    /// silent for longer is as good as fenced: its liveness timer may fire later in the
    /// same instant (after another timer's work looked for a provider), and no work
    /// may go to it meanwhile.
    pub(super) fn heard_within(&self, i: NodeIdx, now: Timestamp, timeout: Duration) -> bool {
        self.node(i)
            .owner
            .as_ref()
            .and_then(|o| self.conns.get(&o.conn))
            .is_some_and(|c| now.saturating_duration_since(c.last_rx) < timeout)
    }

    /// Every node ever configured.
    pub(super) fn indices(&self) -> impl Iterator<Item = NodeIdx> + use<> {
        (0..u32::try_from(self.nodes.len()).unwrap_or(u32::MAX)).map(NodeIdx)
    }

    pub(super) fn phase(&self, conn: ConnId) -> Result<Phase, UsageError> {
        self.conns
            .get(&conn)
            .map(|c| c.phase)
            .ok_or(UsageError::UnknownConnection(conn))
    }

    pub(super) fn conn_count(&self) -> usize {
        self.conns.len()
    }

    /// The node and generation `conn` owns, if it is that node's current, ready owner.
    pub(super) fn ready_owner(&self, conn: ConnId, phase: Phase) -> Option<(NodeIdx, Generation)> {
        let Phase::Owner { node, generation } = phase else {
            return None;
        };
        self.node(node)
            .owner
            .is_some_and(|o| o.conn == conn && o.ready)
            .then_some((node, generation))
    }

    /// The node id a connection owns, for reports.
    pub(super) fn node_of(&self, conn: ConnId) -> Option<Arc<str>> {
        match self.conns.get(&conn)?.phase {
            Phase::Owner { node, .. } => Some(self.node(node).id.clone()),
            _ => None,
        }
    }

    // ----- connections -----

    /// A connection the transport accepted: counted against the pending caps, refused
    /// (and closed) over them.
    pub(super) fn open(
        &mut self,
        cx: &mut Cx<'_>,
        conn: ConnId,
        peer: Peer,
        config: &EdgeConfig,
    ) -> Result<(), UsageError> {
        if self.conns.contains_key(&conn) {
            return Err(UsageError::DuplicateConnection(conn));
        }
        let addr = peer.addr;
        let admitted = self
            .pending
            .admit(Source::of(addr), config.admission.pending);
        self.conns.insert(
            conn,
            Conn {
                phase: Phase::Unregistered,
                pending: admitted,
                peer,
                last_rx: cx.now,
                ping: None,
                rtt: None,
                held: None,
            },
        );
        let timing = config.timing;
        cx.timers
            .set(TimerKey::Handshake(conn), cx.now + timing.register_timeout);
        cx.timers
            .set(TimerKey::Liveness(conn), cx.now + timing.heartbeat_timeout);
        if !admitted {
            self.refused_pending += 1;
            cx.out.event(EdgeEvent::ConnectionRefused {
                conn,
                addr,
                pending: self.pending.total(),
                refused: self.refused_pending,
                log: self.refused_pending.is_power_of_two(),
            });
            self.close(cx, conn, CloseReason::TooManyPending);
        }
        Ok(())
    }

    pub(super) fn secured(
        &mut self,
        conn: ConnId,
        tls: &'static str,
        identities: Vec<String>,
    ) -> Result<(), UsageError> {
        let c = self.conn_mut(conn)?;
        c.peer.tls = Some(tls);
        c.peer.identities = identities;
        Ok(())
    }

    /// Bytes of a frame not yet whole: liveness counts them.
    pub(super) fn bytes_received(
        &mut self,
        now: Timestamp,
        conn: ConnId,
    ) -> Result<(), UsageError> {
        let c = self.conn_mut(conn)?;
        if !matches!(c.phase, Phase::Stale | Phase::Held) {
            c.last_rx = now;
        }
        Ok(())
    }

    /// A whole envelope arrived: the connection is alive.
    pub(super) fn heard(&mut self, now: Timestamp, conn: ConnId) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.last_rx = now;
        }
    }

    /// The transport closed `conn`: forgets it and its timers; returns the phase it had
    /// (an owner's generation must be fenced).
    pub(super) fn remove(&mut self, cx: &mut Cx<'_>, conn: ConnId) -> Result<Phase, UsageError> {
        let c = self
            .conns
            .remove(&conn)
            .ok_or(UsageError::UnknownConnection(conn))?;
        if c.pending {
            self.pending.release(Source::of(c.peer.addr));
        }
        for key in [
            TimerKey::Handshake(conn),
            TimerKey::Liveness(conn),
            TimerKey::Ping(conn),
            TimerKey::Answer(conn),
        ] {
            cx.timers.stop(key);
        }
        Ok(c.phase)
    }

    /// Asks the transport to close `conn` (once): nothing it sends matters from now on.
    pub(super) fn close(&mut self, cx: &mut Cx<'_>, conn: ConnId, reason: CloseReason) {
        if let Some(c) = self.conns.get_mut(&conn)
            && c.phase != Phase::Stale
        {
            c.phase = Phase::Stale;
            cx.out.transmits.push_back(Transmit::Close { conn, reason });
        }
        self.settle_pending(conn);
    }

    /// The connection no longer counts as pending (it registered, or is being closed).
    fn settle_pending(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.get_mut(&conn)
            && std::mem::take(&mut c.pending)
        {
            self.pending.release(Source::of(c.peer.addr));
        }
    }

    fn conn_mut(&mut self, conn: ConnId) -> Result<&mut Conn, UsageError> {
        self.conns
            .get_mut(&conn)
            .ok_or(UsageError::UnknownConnection(conn))
    }

    /// The answer to the Edge's own heartbeat: only the ping in flight counts, and the
    /// round trip is timed by the Edge's clock, never the peer's echo.
    pub(super) fn heartbeat_answered(&mut self, now: Timestamp, conn: ConnId, nonce: u64) {
        if let Some(c) = self.conns.get_mut(&conn)
            && let Some((sent_nonce, sent)) = c.ping
            && sent_nonce == nonce
        {
            c.rtt = Some(now.saturating_duration_since(sent));
            c.ping = None;
        }
    }

    /// The ping timer of `conn` fired: pings it if it still owns its node.
    pub(super) fn ping(&mut self, cx: &mut Cx<'_>, conn: ConnId, interval: Duration) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let Phase::Owner { node, .. } = c.phase else {
            return;
        };
        if self.nodes[node.position()]
            .owner
            .is_none_or(|o| o.conn != conn)
        {
            return;
        }
        let nonce = self.next_nonce;
        self.next_nonce += 1;
        c.ping = Some((nonce, cx.now));
        cx.out.send(
            conn,
            Body::Heartbeat(Heartbeat {
                nonce,
                sent_at_ms: cx.now.as_millis(),
            }),
        );
        cx.timers.set(TimerKey::Ping(conn), cx.now + interval);
    }

    /// When a connection's handshake (register, then ready) must have completed: still
    /// unregistered, or the node's pending owner.
    pub(super) fn handshake_pending(&self, conn: ConnId) -> Option<Phase> {
        let c = self.conns.get(&conn)?;
        let pending = match c.phase {
            Phase::Unregistered => true,
            Phase::Owner { node, .. } => self
                .node(node)
                .owner
                .is_some_and(|o| o.conn == conn && !o.ready),
            Phase::Stale | Phase::Held => false,
        };
        pending.then_some(c.phase)
    }

    /// The liveness timer of `conn` fired: `Some(phase)` when it was silent for the whole
    /// timeout, else the timer is set again from its last receive.
    pub(super) fn silent(
        &mut self,
        cx: &mut Cx<'_>,
        conn: ConnId,
        timeout: Duration,
    ) -> Option<Phase> {
        let c = self.conns.get(&conn)?;
        let deadline = c.last_rx + timeout;
        if deadline > cx.now {
            cx.timers.set(TimerKey::Liveness(conn), deadline);
            return None;
        }
        Some(c.phase)
    }

    // ----- the ready handshake -----

    /// Refuses a ready: answered `ready=false`, and closed when `close`.
    pub(super) fn refuse_ready(
        &mut self,
        cx: &mut Cx<'_>,
        conn: ConnId,
        reason: &str,
        close: bool,
    ) {
        cx.out.send(
            conn,
            Body::NodeReadyResponse(NodeReadyResponse {
                ready: false,
                reason: reason.to_owned(),
            }),
        );
        if close {
            self.close(cx, conn, CloseReason::ReadyRefused);
        }
    }

    /// A ready: only the current pending owner becomes ready; the ready owner saying it
    /// again changes nothing; anyone else is refused.
    pub(super) fn ready(
        &mut self,
        cx: &mut Cx<'_>,
        conn: ConnId,
        phase: Phase,
        req: &NodeReadyRequest,
    ) -> Readied {
        let Phase::Owner {
            node: i,
            generation,
        } = phase
        else {
            self.refuse_ready(cx, conn, "ready before an accepted register", true);
            return Readied::Refused;
        };
        let Some(owner) = self.node(i).owner.filter(|o| o.conn == conn) else {
            self.refuse_ready(cx, conn, "connection is not the node's current owner", true);
            return Readied::Refused;
        };
        if *self.node(i).id != *req.node_id {
            self.refuse_ready(
                cx,
                conn,
                "node_id does not match the registered node",
                false,
            );
            return Readied::Violation(ConnViolation::ReadyForAnotherNode);
        }
        cx.out.send(
            conn,
            Body::NodeReadyResponse(NodeReadyResponse {
                ready: true,
                reason: String::new(),
            }),
        );
        if owner.ready {
            return Readied::Duplicate;
        }
        cx.timers.stop(TimerKey::Handshake(conn));
        let node = &mut self.nodes[i.position()];
        if let Some(o) = node.owner.as_mut() {
            o.ready = true;
        }
        node.applied_revision = owner.registered_revision;
        cx.out.event(EdgeEvent::NodeConnected {
            node_id: node.id.clone(),
            generation,
        });
        Readied::Activated {
            node: i,
            generation,
            registered_revision: owner.registered_revision,
        }
    }

    // ----- ownership ends -----

    /// Node `i`'s `generation` ends, if it is still the owner: returns that owner (the
    /// caller fences what it held). Stale: `None`, nothing changes.
    pub(super) fn end_ownership(&mut self, i: NodeIdx, generation: Generation) -> Option<Owner> {
        let node = &mut self.nodes[i.position()];
        let owner = node.owner.filter(|o| o.generation == generation)?;
        node.owner = None;
        node.draining = None;
        Some(owner)
    }

    /// Node `i` starts draining for `reason`: its owner, unless it has none or already
    /// drains (then it keeps its first reason).
    pub(super) fn start_draining(&mut self, i: NodeIdx, reason: &DrainReason) -> Option<Owner> {
        let node = &mut self.nodes[i.position()];
        let owner = node.owner?;
        if node.draining.is_some() {
            return None;
        }
        node.draining = Some(reason.clone());
        Some(owner)
    }

    // ----- configuration -----

    /// Adopts the nodes of a validated configuration; returns the adapter instances that
    /// are new, which need a resource ([`attach`](Self::attach)).
    pub(super) fn install(&mut self, config: &EdgeConfig) -> Vec<(NodeIdx, Arc<str>)> {
        for node in &mut self.nodes {
            node.spec = None;
        }
        let mut new = Vec::new();
        for (node_id, spec) in &config.nodes {
            let i = match self.idx(node_id) {
                Some(i) => i,
                None => {
                    let id: Arc<str> = node_id.as_str().into();
                    let i =
                        NodeIdx(u32::try_from(self.nodes.len()).expect("fewer than 2^32 nodes"));
                    self.nodes.push(NodeEntry {
                        id: id.clone(),
                        spec: None,
                        revision: 1,
                        applied_revision: 0,
                        owner: None,
                        resources: Vec::new(),
                        flap: FlapGuard::default(),
                        draining: None,
                        agent: None,
                    });
                    self.index.insert(id, i);
                    i
                }
            };
            for adapter in &spec.adapters {
                let name = adapter.instance_name();
                if !self.node(i).resources.iter().any(|(n, _)| &**n == name) {
                    new.push((i, Arc::from(name)));
                }
            }
            self.nodes[i.position()].spec = Some(spec.clone());
        }
        self.throttle.set_limits(config.admission.throttle);
        new
    }

    /// Adapter instance `name` of node `i` is `resource`.
    pub(super) fn attach(&mut self, i: NodeIdx, name: Arc<str>, resource: ResourceId) {
        self.nodes[i.position()].resources.push((name, resource));
    }

    /// Node `i`'s payload changed: a new revision to push.
    pub(super) fn bump_revision(&mut self, i: NodeIdx) {
        self.nodes[i.position()].revision += 1;
    }

    /// Node `i` confirmed `revision` (a refresh applied).
    pub(super) fn applied(&mut self, i: NodeIdx, revision: u64) {
        self.nodes[i.position()].applied_revision = revision;
    }
}
