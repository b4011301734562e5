//! Node registry: connections and their phases, node ownership by generation,
//! registration (credentials, back-off, conflicts), the ready handshake and fencing.

use super::*;

/// How soon a node held off because its node id is draining may register again (its
/// own redial interval, when longer, wins).
const DRAINING_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Why a register is refused for now: another live connection holds the node id.
enum HeldOff {
    /// Two live connections claim it; the flap guard says when to try again and whether
    /// the refusal is worth a log line.
    Conflict { retry_after: Duration, log: bool },
    /// The holder is stopping gracefully and still finishing its requests.
    Draining,
}

/// Connections, node ownership by generation, and admission (back-off, pending caps).
#[derive(Debug)]
pub(super) struct Registry {
    pub(super) nodes: Vec<NodeEntry>,
    pub(super) node_index: IdMap<Arc<str>, usize>,
    pub(super) conns: IdMap<ConnId, Conn>,
    pub(super) throttle: AuthThrottle,
    pub(super) pending: PendingConnections,
    /// Connections refused for the pending caps (logged at powers of two).
    pub(super) refused_pending: u64,
    pub(super) next_generation: u64,
    pub(super) next_nonce: u64,
}

impl Registry {
    /// The open connection `conn`, or the driver's misuse.
    pub(super) fn conn_mut(&mut self, conn: ConnId) -> Result<&mut Conn, UsageError> {
        self.conns
            .get_mut(&conn)
            .ok_or(UsageError::UnknownConnection(conn))
    }

    pub(super) fn new(throttle: crate::guard::ThrottleLimits) -> Self {
        Registry {
            nodes: Vec::new(),
            node_index: IdMap::default(),
            conns: IdMap::default(),
            throttle: AuthThrottle::new(throttle),
            pending: PendingConnections::default(),
            refused_pending: 0,
            next_generation: 1,
            next_nonce: 1,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// Opened, no register yet.
    Unregistered,
    /// Accepted register for `node` in `generation` (pending or ready: see the node).
    Owner { node: usize, generation: Generation },
    /// Rejected or superseded; a close was requested. Nothing it sends matters.
    Stale,
    /// Its register failed while the claimed node id or its source is throttled: the
    /// refusal is held back until its [`TimerKey::Answer`]. Nothing it sends matters.
    Held,
}

#[derive(Debug)]
pub(super) struct Conn {
    pub(super) phase: Phase,
    pub(super) peer: Peer,
    /// Counted in [`PendingConnections`] (until it registers, is refused or closes).
    pub(super) pending: bool,
    pub(super) last_rx: Timestamp,
    /// The Edge's heartbeat still unanswered: (nonce, sent at).
    pub(super) ping: Option<(u64, Timestamp)>,
    /// Round-trip time of the last heartbeat the peer answered.
    pub(super) rtt: Option<Duration>,
    /// The refusal a [`Phase::Held`] connection gets when its hold ends.
    pub(super) held: Option<Box<HeldAnswer>>,
}

/// A refusal held back by the throttle.
#[derive(Debug)]
pub(super) struct HeldAnswer {
    /// The node id it claimed (as it is echoed in the answer).
    pub(super) claimed: String,
    /// When it may try again.
    pub(super) retry_after: Duration,
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
    pub(super) instance: Instance,
}

#[derive(Debug)]
pub(super) struct NodeEntry {
    pub(super) id: Arc<str>,
    /// `None` once removed from the configuration.
    pub(super) spec: Option<crate::edge_config::NodeSpec>,
    pub(super) revision: u64,
    pub(super) applied_revision: u64,
    pub(super) owner: Option<Owner>,
    /// Outstanding refresh: (request sequence, revision).
    pub(super) refresh: Option<(u64, u64)>,
    pub(super) last_refresh: Option<RefreshStatus>,
    /// Adapter instance → resource, for every adapter ever configured on this node.
    pub(super) resources: Vec<(Arc<str>, ResourceId)>,
    /// Supersedes of this node id, to notice two nodes fighting over it.
    pub(super) flap: FlapGuard,
    /// Unanswered pushes of the current revision.
    pub(super) refresh_tries: u32,
    /// The node gets no new work and its connection is closed once its last lease
    /// returns: it could not take its configuration (it then registers afresh), or it is
    /// stopping gracefully.
    pub(super) draining: Option<DrainReason>,
    /// What the node said about itself in its last accepted register (version,
    /// labels); kept while it is offline so an operator sees what was last there.
    pub(super) agent: Option<Box<Agent>>,
}

/// A node's own description of itself, from its `RegisterRequest` (bounded by
/// validation: see [`crate::wire::Validate`]).
#[derive(Debug, Clone, Default)]
pub(super) struct Agent {
    pub(super) version: Box<str>,
    pub(super) labels: Box<[(Box<str>, Box<str>)]>,
}

impl EdgeCore {
    /// Configured nodes and their readiness, in id order.
    #[must_use]
    pub fn nodes(&self) -> Vec<NodeStatus> {
        let mut out: Vec<NodeStatus> = self
            .registry
            .nodes
            .iter()
            .filter(|n| n.spec.is_some())
            .map(|n| {
                let peer = n
                    .owner
                    .and_then(|o| self.registry.conns.get(&o.conn))
                    .map(|c| &c.peer);
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
                    last_refresh: n.last_refresh,
                    conflict: n.flap.in_conflict(self.now),
                    tls: peer.and_then(|p| p.tls),
                    client_certificate: peer.is_some_and(|p| !p.identities.is_empty()),
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
                    rtt: n
                        .owner
                        .and_then(|o| self.registry.conns.get(&o.conn))
                        .and_then(|c| c.rtt),
                    last_seen: n
                        .owner
                        .and_then(|o| self.registry.conns.get(&o.conn))
                        .map(|c| self.now.saturating_duration_since(c.last_rx)),
                }
            })
            .collect();
        out.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        out
    }

    /// Node ids and sources whose registrations failed within the throttle's window,
    /// most failures first, at most `max` of each.
    #[must_use]
    pub fn registration_failures(&self, max: usize) -> RegistrationFailures {
        let throttle = &self.registry.throttle;
        RegistrationFailures {
            nodes: throttle
                .failing_nodes(self.now, max)
                .into_iter()
                .map(|f| FailingNode {
                    known: self
                        .registry
                        .node_index
                        .get(&*f.key)
                        .is_some_and(|&i| self.registry.nodes[i].spec.is_some()),
                    node_id: f.key.chars().take(64).collect(),
                    failures: f.failures,
                    hold: f.hold,
                    since_last: f.since_last,
                })
                .collect(),
            sources: throttle.failing_sources(self.now, max),
        }
    }

    /// Adopts a validated configuration: nodes, resources and model groups.
    pub(super) fn install(&mut self, config: EdgeConfig) {
        for node in &mut self.registry.nodes {
            node.spec = None;
        }
        for (node_id, spec) in &config.nodes {
            let i = match self.registry.node_index.get(node_id.as_str()) {
                Some(&i) => i,
                None => {
                    let id: Arc<str> = node_id.as_str().into();
                    self.registry.nodes.push(NodeEntry {
                        id: id.clone(),
                        spec: None,
                        revision: 1,
                        applied_revision: 0,
                        owner: None,
                        refresh: None,
                        last_refresh: None,
                        resources: Vec::new(),
                        flap: FlapGuard::default(),
                        refresh_tries: 0,
                        draining: None,
                        agent: None,
                    });
                    self.registry
                        .node_index
                        .insert(id, self.registry.nodes.len() - 1);
                    self.registry.nodes.len() - 1
                }
            };
            for adapter in &spec.adapters {
                let name = adapter.instance_name();
                if !self.registry.nodes[i]
                    .resources
                    .iter()
                    .any(|(n, _)| &**n == name)
                {
                    let r = self.pool.ledger.add_resource();
                    let provider_id: Arc<str> = name.into();
                    self.pool.resources.push(ResourceMeta {
                        node: i,
                        provider_id: provider_id.clone(),
                    });
                    self.registry.nodes[i].resources.push((provider_id, r));
                }
            }
            self.registry.nodes[i].spec = Some(spec.clone());
        }
        let mut models = IdMap::default();
        for (name, spec) in &config.models {
            let mut long_possible = false;
            let candidates: Vec<Candidate> = spec
                .candidates
                .iter()
                .filter_map(|c| {
                    let adapter = config.nodes.get(&c.node_id)?.adapter(&c.provider_id)?;
                    if !adapter.enabled {
                        return None;
                    }
                    long_possible |= adapter.long_capacity > 0;
                    Some(Candidate {
                        resource: self.resource(&c.node_id, &c.provider_id)?,
                        target: c.target.as_str().into(),
                    })
                })
                .collect();
            let cursor = self.pool.models.get(name.as_str()).map_or(0, |m| m.cursor);
            models.insert(
                Arc::from(name.as_str()),
                Model {
                    candidates: candidates.into(),
                    long_threshold: spec.long_context_threshold,
                    long_possible,
                    cursor,
                },
            );
        }
        self.pool.models = models;
        self.registry.throttle.set_limits(config.admission.throttle);
        self.config = config;
    }

    pub(super) fn send(&mut self, conn: ConnId, body: Body) {
        self.out.transmits.push_back(Transmit::Frame {
            conn,
            envelope: Envelope::new(body),
        });
    }

    pub(super) fn close(&mut self, conn: ConnId, reason: CloseReason) {
        if let Some(c) = self.registry.conns.get_mut(&conn)
            && c.phase != Phase::Stale
        {
            c.phase = Phase::Stale;
            self.out
                .transmits
                .push_back(Transmit::Close { conn, reason });
        }
        self.settle_pending(conn);
    }

    /// The connection no longer counts as pending (it registered, or is being closed).
    pub(super) fn settle_pending(&mut self, conn: ConnId) {
        if let Some(c) = self.registry.conns.get_mut(&conn)
            && std::mem::take(&mut c.pending)
        {
            self.registry.pending.release(Source::of(c.peer.addr));
        }
    }

    pub(super) fn node_of(&self, conn: ConnId) -> Option<Arc<str>> {
        match self.registry.conns.get(&conn)?.phase {
            Phase::Owner { node, .. } => Some(self.registry.nodes[node].id.clone()),
            _ => None,
        }
    }

    /// The peer broke the protocol at connection level: close it (fencing it if it owns).
    pub(super) fn violation(&mut self, conn: ConnId, violation: ConnViolation) {
        self.out.events.push_back(EdgeEvent::PeerViolation {
            conn,
            node_id: self.node_of(conn),
            violation: Violation::Connection(violation.clone()),
        });
        let phase = self.registry.conns.get(&conn).map(|c| c.phase);
        self.close(conn, CloseReason::ProtocolViolation(violation.clone()));
        if let Some(Phase::Owner { node, generation }) = phase {
            self.fence_owner(node, generation, CloseReason::ProtocolViolation(violation));
        }
    }

    pub(super) fn on_register(&mut self, conn: ConnId, phase: Phase, req: RegisterRequest) {
        if phase != Phase::Unregistered {
            self.violation(conn, ConnViolation::SecondRegister);
            return;
        }
        let Some(addr) = self.registry.conns.get(&conn).map(|c| c.peer.addr) else {
            return;
        };
        let i = match self.authenticate(conn, &req) {
            Ok(i) => i,
            Err(reason) => {
                self.refuse_register(conn, addr, &req.node_id, reason);
                return;
            }
        };
        // The id's correct token ends its throttle (its source's budget refills with time).
        self.registry.throttle.record_success(&req.node_id);
        let instance = std::num::NonZeroU64::new(req.instance_id);
        // A newer register supersedes the current owner in this same transition, unless
        // the two keep taking the node id from each other.
        if let Some(old) = self.registry.nodes[i].owner {
            let limits = self.config.admission.conflict;
            // Live: heard from within two heartbeat intervals (a node answers every ping
            // and sends its own at that interval). A node that lost its link gives up
            // after three silent intervals by default, so its reconnect finds the old
            // connection silent.
            let live_within = self.config.timing.heartbeat_interval * 2;
            let rival = match self.registry.conns.get(&old.conn) {
                Some(c) if self.now.saturating_duration_since(c.last_rx) < live_within => {
                    Rival::Live
                }
                _ => Rival::Silent,
            };
            // A live owner that is stopping gracefully keeps the node id until its
            // requests have ended: the newcomer is most likely the node's own restart,
            // and superseding would cut those requests. A silent one is superseded as
            // any other.
            let claim = Claim {
                newcomer: instance,
                holder: old.instance,
                rival,
            };
            let stopping = matches!(
                self.registry.nodes[i].draining,
                Some(DrainReason::Stopping(_))
            );
            // The stopping process itself reconnecting has given its old connection up.
            if stopping && rival == Rival::Live && !claim.same_process() {
                self.hold_off(conn, addr, i, &req.node_id, HeldOff::Draining);
                return;
            }
            match self.registry.nodes[i].flap.contest(self.now, limits, claim) {
                Contest::HoldOff { retry_after, log } => {
                    let held = HeldOff::Conflict { retry_after, log };
                    self.hold_off(conn, addr, i, &req.node_id, held);
                    return;
                }
                Contest::SupersedeAndHold => self.out.events.push_back(EdgeEvent::NodeConflict {
                    node_id: self.registry.nodes[i].id.clone(),
                    supersedes: limits.supersedes,
                    hold_down: limits.hold_down,
                }),
                Contest::Supersede => {}
            }
            self.send(
                old.conn,
                Body::NodeReadyResponse(NodeReadyResponse {
                    ready: false,
                    reason: "superseded: a newer connection registered this node id".into(),
                }),
            );
            self.close(old.conn, CloseReason::Superseded);
            self.fence_owner(i, old.generation, CloseReason::Superseded);
        }
        let generation = Generation(self.registry.next_generation);
        self.registry.next_generation += 1;
        let revision = self.registry.nodes[i].revision;
        self.registry.nodes[i].owner = Some(Owner {
            conn,
            generation,
            ready: false,
            registered_revision: revision,
            instance,
        });
        self.registry.nodes[i].agent = Some(Box::new(Agent {
            version: req.version.as_str().into(),
            labels: req
                .labels
                .iter()
                .map(|(k, v)| (k.as_str().into(), v.as_str().into()))
                .collect(),
        }));
        let timing = self.config.timing;
        if let Some(c) = self.registry.conns.get_mut(&conn) {
            c.phase = Phase::Owner {
                node: i,
                generation,
            };
        }
        self.settle_pending(conn);
        self.out.events.push_back(EdgeEvent::NodeRegistered {
            node_id: self.registry.nodes[i].id.clone(),
            generation,
        });
        // The full frame limit, in force before the node learns it may send large frames.
        self.out.transmits.push_back(Transmit::FrameLimit {
            conn,
            max_frame_len: self.config.admission.max_frame_len,
        });
        let payload = self.registry.nodes[i]
            .spec
            .as_ref()
            .map(|spec| spec.payload(revision));
        self.send(
            conn,
            Body::RegisterResponse(RegisterResponse {
                accepted: true,
                reason: String::new(),
                node_id: self.registry.nodes[i].id.to_string(),
                config: payload,
                heartbeat_interval_ms: millis(timing.heartbeat_interval),
                retry_after_ms: 0,
            }),
        );
        self.timers.set(
            TimerKey::Handshake(conn),
            self.now + timing.register_timeout,
        );
        self.timers
            .set(TimerKey::Ping(conn), self.now + timing.heartbeat_interval);
        #[cfg(feature = "testkit")]
        if self.faults.dispatch_before_ready {
            self.sync_resources(i, generation);
        }
    }

    /// The node a register may claim: a configured id, its token, and (with mutual TLS
    /// required) a client certificate naming it. An unknown id still costs a token check,
    /// so timing does not tell ids from tokens either.
    pub(super) fn authenticate(
        &self,
        conn: ConnId,
        req: &RegisterRequest,
    ) -> Result<usize, RejectReason> {
        let node = self
            .registry
            .node_index
            .get(req.node_id.as_str())
            .copied()
            .and_then(|i| Some((i, self.registry.nodes[i].spec.as_ref()?)));
        let Some((i, spec)) = node else {
            let _ = TokenVerifier::from_secret(b"").verify(req.token.as_bytes());
            return Err(RejectReason::UnknownNode);
        };
        if !spec.token.verify(req.token.as_bytes()) {
            return Err(RejectReason::BadToken);
        }
        if self.config.admission.require_client_identity {
            let named = self
                .registry
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
    fn refuse_register(
        &mut self,
        conn: ConnId,
        addr: Option<IpAddr>,
        claimed: &str,
        reason: RejectReason,
    ) {
        let source = Source::of(addr);
        let record = self
            .registry
            .throttle
            .record_failure(self.now, source, claimed);
        let known = self
            .registry
            .node_index
            .get(claimed)
            .is_some_and(|&i| self.registry.nodes[i].spec.is_some());
        self.out.events.push_back(EdgeEvent::RegisterRejected {
            conn,
            addr,
            node_id: claimed.chars().take(64).collect(),
            known,
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
            self.reject_register(conn, claimed, reason, AUTH_FAILED, None);
            return;
        }
        self.timers.stop(TimerKey::Handshake(conn));
        self.timers.stop(TimerKey::Liveness(conn));
        self.timers
            .set(TimerKey::Answer(conn), self.now + record.hold);
        if let Some(c) = self.registry.conns.get_mut(&conn) {
            c.phase = Phase::Held;
            c.held = Some(Box::new(HeldAnswer {
                claimed: claimed.to_owned(),
                retry_after: record.retry_after,
            }));
        }
    }

    /// A held refusal is due: answer and close.
    pub(super) fn answer_held(&mut self, conn: ConnId) {
        let Some(held) = self
            .registry
            .conns
            .get_mut(&conn)
            .filter(|c| c.phase == Phase::Held)
            .and_then(|c| c.held.take())
        else {
            return;
        };
        self.reject_register(
            conn,
            &held.claimed,
            RejectReason::Throttled,
            &throttled_reason(held.retry_after),
            Some(held.retry_after),
        );
    }

    pub(super) fn reject_register(
        &mut self,
        conn: ConnId,
        node_id: &str,
        why: RejectReason,
        reason: &str,
        retry_after: Option<Duration>,
    ) {
        self.send(
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
        self.close(conn, CloseReason::RegisterRejected(why));
    }

    /// Refuses an authenticated register for node `i` for now: its id is held by another
    /// live connection (in conflict, or draining), and the node may try again later.
    fn hold_off(
        &mut self,
        conn: ConnId,
        addr: Option<IpAddr>,
        i: usize,
        claimed: &str,
        held: HeldOff,
    ) {
        let id = &*self.registry.nodes[i].id;
        let (why, reason, retry_after, log) = match held {
            HeldOff::Draining => (
                RejectReason::Draining,
                format!(
                    "node id {id:?} is draining: its current connection is finishing its requests"
                ),
                DRAINING_RETRY_AFTER,
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
        self.reject_register(conn, claimed, why, &reason, Some(retry_after));
        self.out.events.push_back(EdgeEvent::RegisterRejected {
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

    pub(super) fn refuse_ready(&mut self, conn: ConnId, reason: &str, close: bool) {
        self.send(
            conn,
            Body::NodeReadyResponse(NodeReadyResponse {
                ready: false,
                reason: reason.to_owned(),
            }),
        );
        if close {
            self.close(conn, CloseReason::ReadyRefused);
        }
    }

    pub(super) fn on_ready(&mut self, conn: ConnId, phase: Phase, req: &NodeReadyRequest) {
        let Phase::Owner {
            node: i,
            generation,
        } = phase
        else {
            self.refuse_ready(conn, "ready before an accepted register", true);
            return;
        };
        let Some(owner) = self.registry.nodes[i].owner.filter(|o| o.conn == conn) else {
            self.refuse_ready(conn, "connection is not the node's current owner", true);
            return;
        };
        if *self.registry.nodes[i].id != *req.node_id {
            self.refuse_ready(conn, "node_id does not match the registered node", false);
            self.violation(conn, ConnViolation::ReadyForAnotherNode);
            return;
        }
        self.send(
            conn,
            Body::NodeReadyResponse(NodeReadyResponse {
                ready: true,
                reason: String::new(),
            }),
        );
        if owner.ready {
            return; // duplicate ready from the ready owner: no side effect
        }
        self.timers.stop(TimerKey::Handshake(conn));
        if let Some(o) = self.registry.nodes[i].owner.as_mut() {
            o.ready = true;
        }
        self.registry.nodes[i].applied_revision = owner.registered_revision;
        self.out.events.push_back(EdgeEvent::NodeConnected {
            node_id: self.registry.nodes[i].id.clone(),
            generation,
        });
        self.sync_resources(i, generation);
        if self.registry.nodes[i].revision != owner.registered_revision {
            self.push_refresh(i);
        }
    }

    /// Brings node `i`'s resources in line with its configuration for `generation`, at
    /// ready and after an applied refresh: enabled adapters come online (or take their new
    /// capacities when already live) and waiters are pumped; removed or disabled adapters
    /// take no new work while their leases drain (offline ones simply stay offline). A
    /// draining node takes no new work whatever its configuration says (a refresh it
    /// applies while draining does not bring its capacity back).
    pub(super) fn sync_resources(&mut self, i: usize, generation: Generation) {
        let Some(spec) = self.registry.nodes[i].spec.clone() else {
            return;
        };
        let draining = self.registry.nodes[i].draining.is_some();
        for (name, r) in self.registry.nodes[i].resources.clone() {
            match spec.adapter(&name).filter(|a| a.enabled && !draining) {
                Some(adapter) => {
                    if self.pool.ledger.usage(r).generation == Some(generation) {
                        self.pool
                            .ledger
                            .set_capacity(r, adapter.capacity, adapter.long_capacity);
                    } else {
                        let returned = self.pool.ledger.activate(
                            r,
                            generation,
                            adapter.capacity,
                            adapter.long_capacity,
                        );
                        debug_assert!(returned.is_empty(), "older generation was not fenced");
                    }
                    self.pump(r);
                }
                None => self.pool.ledger.set_capacity(r, 0, 0),
            }
        }
    }

    /// Fences node `i`'s `generation` if it is still the owner: leases return once, its
    /// running requests fail with `NodeLost`, its resources go offline.
    pub(super) fn fence_owner(&mut self, i: usize, generation: Generation, reason: CloseReason) {
        let Some(owner) = self.registry.nodes[i]
            .owner
            .filter(|o| o.generation == generation)
        else {
            return; // stale: changes nothing, emits nothing
        };
        self.registry.nodes[i].owner = None;
        self.registry.nodes[i].refresh = None;
        self.timers.stop(TimerKey::Refresh(i));
        self.registry.nodes[i].refresh_tries = 0;
        self.registry.nodes[i].draining = None;
        let node_id = self.registry.nodes[i].id.clone();
        let pending: Vec<u64> = self
            .control
            .commands
            .iter()
            .filter(|(_, (node, g, _))| *node == i && *g == generation)
            .map(|(seq, _)| *seq)
            .collect();
        for seq in pending {
            self.fail_command(seq, "the node disconnected");
        }
        let mut lost = Vec::new();
        for (_, r) in self.registry.nodes[i].resources.clone() {
            for lease in self.pool.ledger.fence(r) {
                match self.requests.remove(&lease.request) {
                    Some(ReqState::Granted { .. } | ReqState::Running { .. }) => {
                        lost.push(lease.request);
                    }
                    Some(ReqState::Cancelling { .. }) => {
                        self.timers.stop(TimerKey::CancelGrace(lease.request));
                    }
                    None => {}
                    Some(state @ ReqState::Waiting { .. }) => {
                        self.requests.insert(lease.request, state);
                    }
                }
            }
        }
        lost.sort_unstable();
        for &request in &lost {
            self.out.events.push_back(EdgeEvent::RequestEnded {
                request,
                outcome: Outcome::Failed(RequestError::NodeLost {
                    node_id: node_id.clone(),
                }),
            });
        }
        if owner.ready {
            self.out.events.push_back(EdgeEvent::NodeDisconnected {
                node_id,
                generation,
                reason,
                lost,
            });
        }
    }
}
