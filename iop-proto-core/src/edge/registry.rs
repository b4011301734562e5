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

use super::AUTH_FAILED;
use super::CloseReason;
use super::ConnId;
use super::ConnViolation;
use super::Cx;
use super::DrainReason;
use super::EdgeCore;
use super::EdgeEvent;
use super::FailingNode;
use super::NodeState;
use super::NodeStatus;
use super::Peer;
use super::RegistrationFailures;
use super::RejectReason;
use super::TOO_MANY_FAILURES;
use super::Throttled;
use super::TimerKey;
use super::Transmit;
use super::UsageError;
use super::cx;
use super::millis;
use crate::edge_config::EdgeConfig;
use crate::guard::AuthThrottle;
use crate::guard::Claim;
use crate::guard::Contest;
use crate::guard::FlapGuard;
use crate::guard::Instance;
use crate::guard::PendingConnections;
use crate::guard::Rival;
use crate::guard::Source;
use crate::idhash::IdMap;
use crate::lease::Generation;
use crate::lease::ResourceId;
use crate::time::Timestamp;
use crate::token::TokenVerifier;
use crate::wire::Body;
use crate::wire::Heartbeat;
use crate::wire::NodeReadyRequest;
use crate::wire::NodeReadyResponse;
use crate::wire::RefreshStatus;
use crate::wire::RegisterRequest;
use crate::wire::RegisterResponse;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

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

    // ----- registration -----

    /// Decides a register: credentials (always checked first), the throttle, then
    /// whether the node id may change hands (conflicts, a draining holder).
    pub(super) fn admit(
        &mut self,
        cx: &mut Cx<'_>,
        conn: ConnId,
        phase: Phase,
        req: &RegisterRequest,
        config: &EdgeConfig,
        step: ClusterStep,
    ) -> Admitted {
        if phase != Phase::Unregistered {
            return Admitted::Violation(ConnViolation::SecondRegister);
        }
        let Some(addr) = self.conns.get(&conn).map(|c| c.peer.addr) else {
            return Admitted::Refused;
        };
        let i = match self.authenticate(conn, req, config) {
            Ok(i) => i,
            Err(reason) => {
                self.refuse(cx, conn, addr, &req.node_id, reason);
                return Admitted::Refused;
            }
        };
        // The id's correct token ends its throttle (its source's budget refills with time).
        self.throttle.record_success(&req.node_id);
        if self.handing_over {
            self.hold_off(cx, conn, addr, i, &req.node_id, HeldOff::HandingOver);
            return Admitted::Refused;
        }
        if step == ClusterStep::Unclaimed {
            return Admitted::Claim { node: i };
        }
        let Some(old) = self.node(i).owner else {
            return Admitted::Take {
                node: i,
                superseding: None,
            };
        };
        // Live: heard from within two heartbeat intervals (a node answers every ping and
        // sends its own at that interval). A node that lost its link gives up after three
        // silent intervals by default, so its reconnect finds the old connection silent.
        let live_within = config.timing.heartbeat_interval * 2;
        let rival = match self.conns.get(&old.conn) {
            Some(c) if cx.now.saturating_duration_since(c.last_rx) < live_within => Rival::Live,
            _ => Rival::Silent,
        };
        let claim = Claim {
            newcomer: std::num::NonZeroU64::new(req.instance_id),
            holder: old.instance,
            rival,
        };
        // A live owner that is stopping gracefully keeps the node id until its requests
        // have ended: the newcomer is most likely the node's own restart, and superseding
        // would cut those requests. The stopping process itself reconnecting has given
        // its old connection up.
        // In a cluster a node keeps one session with each Edge: the same process
        // registering again here while its session is live (it dialled this Edge twice,
        // say through a balancer) would cut that session's work. The newcomer is turned
        // away; a session that is really gone goes silent and is superseded as usual.
        if step == ClusterStep::Claimed
            && rival == Rival::Live
            && claim.same_process()
            && old.cluster
            && req.cluster
        {
            self.hold_off(cx, conn, addr, i, &req.node_id, HeldOff::Duplicate);
            return Admitted::Refused;
        }
        let stopping = matches!(self.node(i).draining, Some(DrainReason::Stopping(_)));
        if stopping && rival == Rival::Live && !claim.same_process() {
            self.hold_off(cx, conn, addr, i, &req.node_id, HeldOff::Draining);
            return Admitted::Refused;
        }
        let limits = config.admission.conflict;
        match self.nodes[i.position()].flap.contest(cx.now, limits, claim) {
            Contest::HoldOff { retry_after, log } => {
                let held = HeldOff::Conflict { retry_after, log };
                self.hold_off(cx, conn, addr, i, &req.node_id, held);
                return Admitted::Refused;
            }
            Contest::SupersedeAndHold => cx.out.event(EdgeEvent::NodeConflict {
                node_id: self.node(i).id.clone(),
                supersedes: limits.supersedes,
                hold_down: limits.hold_down,
            }),
            Contest::Supersede => {}
        }
        cx.out.send(
            old.conn,
            Body::NodeReadyResponse(NodeReadyResponse {
                ready: false,
                reason: "superseded: a newer connection registered this node id".into(),
            }),
        );
        self.close(cx, old.conn, CloseReason::Superseded);
        Admitted::Take {
            node: i,
            superseding: Some(old),
        }
    }

    /// `conn` takes node `i` as its pending owner: a new generation, the full frame
    /// limit, the `RegisterResponse` with the node's configuration.
    pub(super) fn take(
        &mut self,
        cx: &mut Cx<'_>,
        conn: ConnId,
        i: NodeIdx,
        req: &RegisterRequest,
        config: &EdgeConfig,
        cluster: Option<&crate::wire::ClusterMembers>,
    ) -> Generation {
        let generation = Generation(self.next_generation);
        self.next_generation += 1;
        let node = &mut self.nodes[i.position()];
        debug_assert!(node.owner.is_none(), "the old owner was fenced first");
        let revision = node.revision;
        node.owner = Some(Owner {
            conn,
            generation,
            ready: false,
            registered_revision: revision,
            instance: std::num::NonZeroU64::new(req.instance_id),
            rehome: req.rehome,
            cluster: req.cluster,
        });
        node.agent = Some(Box::new(Agent {
            version: req.version.as_str().into(),
            labels: req
                .labels
                .iter()
                .map(|(k, v)| (k.as_str().into(), v.as_str().into()))
                .collect(),
        }));
        let node_id = node.id.clone();
        let payload = node.spec.as_ref().map(|spec| spec.payload(revision));
        if let Some(c) = self.conns.get_mut(&conn) {
            c.phase = Phase::Owner {
                node: i,
                generation,
            };
        }
        self.settle_pending(conn);
        cx.out.event(EdgeEvent::NodeRegistered {
            node_id: node_id.clone(),
            generation,
        });
        // The full frame limit, in force before the node learns it may send large frames.
        cx.out.transmits.push_back(Transmit::FrameLimit {
            conn,
            max_frame_len: config.admission.max_frame_len,
        });
        let timing = config.timing;
        cx.out.send(
            conn,
            Body::RegisterResponse(RegisterResponse {
                accepted: true,
                reason: String::new(),
                node_id: node_id.to_string(),
                config: payload,
                heartbeat_interval_ms: millis(timing.heartbeat_interval),
                retry_after_ms: 0,
                load_reports: true,
                cluster: cluster.filter(|_| req.cluster).cloned(),
            }),
        );
        cx.timers
            .set(TimerKey::Handshake(conn), cx.now + timing.register_timeout);
        cx.timers
            .set(TimerKey::Ping(conn), cx.now + timing.heartbeat_interval);
        generation
    }

    /// The node a register may claim: a configured id, its token, and (with mutual TLS
    /// required) a client certificate naming it. An unknown id still costs a token check,
    /// so timing does not tell ids from tokens either.
    fn authenticate(
        &self,
        conn: ConnId,
        req: &RegisterRequest,
        config: &EdgeConfig,
    ) -> Result<NodeIdx, RejectReason> {
        let node = self
            .configured(&req.node_id)
            .and_then(|i| Some((i, self.node(i).spec.as_ref()?)));
        let Some((i, spec)) = node else {
            let _ = TokenVerifier::from_secret(b"").verify(req.token.as_bytes());
            return Err(RejectReason::UnknownNode);
        };
        if !spec.token.verify(req.token.as_bytes()) {
            return Err(RejectReason::BadToken);
        }
        if config.admission.require_client_identity {
            let named = self
                .conns
                .get(&conn)
                .is_some_and(|c| c.peer.identities.contains(&req.node_id));
            if !named {
                return Err(RejectReason::IdentityMismatch);
            }
        }
        Ok(i)
    }

    /// A register with wrong credentials: counted against the claimed node id and the
    /// source, refused with [`AUTH_FAILED`] at once within their budgets, otherwise held
    /// back and then refused with [`throttled_reason`]. Credentials are always checked
    /// first: nothing here can refuse a node whose token is right.
    fn refuse(
        &mut self,
        cx: &mut Cx<'_>,
        conn: ConnId,
        addr: Option<IpAddr>,
        claimed: &str,
        reason: RejectReason,
    ) {
        let source = Source::of(addr);
        let record = self.throttle.record_failure(cx.now, source, claimed);
        cx.out.event(EdgeEvent::RegisterRejected {
            conn,
            addr,
            node_id: claimed.chars().take(64).collect(),
            known: self.configured(claimed).is_some(),
            reason,
            failures: record.node_failures.max(record.source_failures),
            throttled: record.by.map(|by| Throttled {
                by,
                hold: record.hold,
                retry_after: record.retry_after,
            }),
            log: record.log,
        });
        if record.by.is_none() {
            // Wrong credentials are final (retry_after 0).
            self.reject(cx, conn, claimed, reason, AUTH_FAILED, None);
            return;
        }
        cx.timers.stop(TimerKey::Handshake(conn));
        cx.timers.stop(TimerKey::Liveness(conn));
        cx.timers.set(TimerKey::Answer(conn), cx.now + record.hold);
        if let Some(c) = self.conns.get_mut(&conn) {
            c.phase = Phase::Held;
            c.held = Some(Box::new(HeldAnswer {
                claimed: claimed.to_owned(),
                retry_after: record.retry_after,
            }));
        }
    }

    /// A held refusal is due: answer and close.
    pub(super) fn answer_held(&mut self, cx: &mut Cx<'_>, conn: ConnId) {
        let Some(held) = self
            .conns
            .get_mut(&conn)
            .filter(|c| c.phase == Phase::Held)
            .and_then(|c| c.held.take())
        else {
            return;
        };
        self.reject(
            cx,
            conn,
            &held.claimed,
            RejectReason::Throttled,
            &throttled_reason(held.retry_after),
            Some(held.retry_after),
        );
    }

    fn reject(
        &mut self,
        cx: &mut Cx<'_>,
        conn: ConnId,
        node_id: &str,
        why: RejectReason,
        reason: &str,
        retry_after: Option<Duration>,
    ) {
        cx.out.send(
            conn,
            Body::RegisterResponse(RegisterResponse {
                accepted: false,
                reason: reason.to_owned(),
                node_id: node_id
                    .chars()
                    .take(crate::wire::MAX_NODE_ID_BYTES)
                    .collect(),
                retry_after_ms: retry_after.map_or(0, |d| millis(d).max(1)),
                ..RegisterResponse::default()
            }),
        );
        self.close(cx, conn, CloseReason::RegisterRejected(why));
    }

    /// Refuses a register on `conn` before this cluster Edge holds the cluster's shared
    /// configuration: try again shortly (here or at another Edge). Nothing is judged, so
    /// nothing is counted against the claimed id or the source.
    pub(super) fn refuse_unconfigured(&mut self, cx: &mut Cx<'_>, conn: ConnId, claimed: &str) {
        let Some(addr) = self.conns.get(&conn).map(|c| c.peer.addr) else {
            return;
        };
        let claimed: String = claimed.chars().take(64).collect();
        self.reject(
            cx,
            conn,
            &claimed,
            RejectReason::ClusterUnavailable,
            "this edge has not taken in the cluster's configuration yet: try again shortly, \
             or another edge",
            Some(CLUSTER_UNAVAILABLE_RETRY_AFTER),
        );
        cx.out.event(EdgeEvent::RegisterRejected {
            conn,
            addr,
            known: self.configured(&claimed).is_some(),
            node_id: claimed,
            reason: RejectReason::ClusterUnavailable,
            failures: 0,
            throttled: None,
            log: true,
        });
    }

    /// Refuses the register waiting on `conn` for node `i` as the cluster decided:
    /// `held_by` another instance, or undecided (`None`).
    pub(super) fn refuse_claim(
        &mut self,
        cx: &mut Cx<'_>,
        conn: ConnId,
        i: NodeIdx,
        held_by: Option<u64>,
    ) {
        let Some(addr) = self.conns.get(&conn).map(|c| c.peer.addr) else {
            return;
        };
        let claimed = self.node(i).id.to_string();
        self.hold_off(cx, conn, addr, i, &claimed, HeldOff::Cluster { held_by });
    }

    /// Refuses an authenticated register for node `i` for now: its id is held by another
    /// live connection (in conflict, or draining), and the node may try again later.
    fn hold_off(
        &mut self,
        cx: &mut Cx<'_>,
        conn: ConnId,
        addr: Option<IpAddr>,
        i: NodeIdx,
        claimed: &str,
        held: HeldOff,
    ) {
        let id = &*self.node(i).id;
        let (why, reason, retry_after, log) = match held {
            HeldOff::Draining => (
                RejectReason::Draining,
                format!(
                    "node id {id:?} is draining: its current connection is finishing its requests"
                ),
                DRAINING_RETRY_AFTER,
                true,
            ),
            HeldOff::HandingOver => (
                RejectReason::HandingOver,
                "this edge process is handing over to its successor: dial again".to_owned(),
                HANDING_OVER_RETRY_AFTER,
                false,
            ),
            HeldOff::Duplicate => (
                RejectReason::DuplicateSession,
                format!(
                    "this node process already has a live session for node id {id:?} with \
                     this edge (in a cluster a node keeps one per edge: dial the edges \
                     directly, not through the callers' balancer)"
                ),
                CLUSTER_HELD_RETRY_AFTER,
                true,
            ),
            HeldOff::Cluster {
                held_by: Some(instance),
            } => (
                RejectReason::ClusterHeld,
                format!(
                    "node id {id:?} is held by another instance ({instance:016x}) in the \
                     cluster (two nodes share this id?): try again once it has gone"
                ),
                CLUSTER_HELD_RETRY_AFTER,
                true,
            ),
            HeldOff::Cluster { held_by: None } => (
                RejectReason::ClusterUnavailable,
                "this edge cannot confirm the node id with the cluster (etcd unreachable, \
                 or not a member now): try again, or another edge"
                    .to_owned(),
                CLUSTER_UNAVAILABLE_RETRY_AFTER,
                true,
            ),
            HeldOff::Conflict { retry_after, log } => (
                RejectReason::Conflict,
                format!(
                    "node id {id:?} is in conflict: another live connection holds it (two \
                     nodes share this id?)"
                ),
                retry_after,
                log,
            ),
        };
        let node_id = id.to_string();
        self.reject(cx, conn, claimed, why, &reason, Some(retry_after));
        cx.out.event(EdgeEvent::RegisterRejected {
            conn,
            addr,
            node_id,
            known: true,
            reason: why,
            failures: 0,
            throttled: None,
            log,
        });
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

    // ----- status -----

    /// Configured nodes and their readiness, in id order; `last_refresh` comes from the
    /// control traffic.
    pub(super) fn statuses(
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
    pub(super) fn failures(&self, now: Timestamp, max: usize) -> RegistrationFailures {
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

    pub(super) fn open_connection(&mut self, conn: ConnId, peer: Peer) -> Result<(), UsageError> {
        let mut cx = cx!(self);
        self.registry.open(&mut cx, conn, peer, &self.config)
    }

    pub(super) fn secure_connection(
        &mut self,
        conn: ConnId,
        tls: &'static str,
        identities: Vec<String>,
    ) -> Result<(), UsageError> {
        self.registry.secured(conn, tls, identities)
    }

    pub(super) fn bytes_received(&mut self, conn: ConnId) -> Result<(), UsageError> {
        self.registry.bytes_received(self.now, conn)
    }
}
