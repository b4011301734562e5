//! The registry's registration rules: credentials (always checked first), the throttle of
//! failing sources, and whether a node id may change hands (conflicts, a draining or
//! handing-over holder, the cluster's claim).

use super::super::throttled_reason;
use super::{
    Admitted, Agent, CLUSTER_HELD_RETRY_AFTER, CLUSTER_UNAVAILABLE_RETRY_AFTER, ClusterStep,
    DRAINING_RETRY_AFTER, HANDING_OVER_RETRY_AFTER, HeldAnswer, HeldOff, NodeIdx, Owner, Phase,
    Registry,
};
use crate::edge::AUTH_FAILED;
use crate::edge::CloseReason;
use crate::edge::ConnId;
use crate::edge::ConnViolation;
use crate::edge::Cx;
use crate::edge::DrainReason;
use crate::edge::EdgeEvent;
use crate::edge::RejectReason;
use crate::edge::Throttled;
use crate::edge::TimerKey;
use crate::edge::Transmit;
use crate::edge::millis;
use crate::edge_config::EdgeConfig;
use crate::guard::Claim;
use crate::guard::Contest;
use crate::guard::Rival;
use crate::guard::Source;
use crate::lease::Generation;
use crate::token::TokenVerifier;
use crate::wire::Body;
use crate::wire::NodeReadyResponse;
use crate::wire::RegisterRequest;
use crate::wire::RegisterResponse;
use std::net::IpAddr;
use std::time::Duration;

impl Registry {
    /// Decides a register: credentials (always checked first), the throttle, then
    /// whether the node id may change hands (conflicts, a draining holder).
    pub(in crate::edge) fn admit(
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
    pub(in crate::edge) fn take(
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
                merged_tunnel_frames: true,
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
    pub(super) fn authenticate(
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
    pub(super) fn refuse(
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
    pub(in crate::edge) fn answer_held(&mut self, cx: &mut Cx<'_>, conn: ConnId) {
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

    pub(super) fn reject(
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
    pub(in crate::edge) fn refuse_unconfigured(
        &mut self,
        cx: &mut Cx<'_>,
        conn: ConnId,
        claimed: &str,
    ) {
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
    pub(in crate::edge) fn refuse_claim(
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
    pub(super) fn hold_off(
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
}
