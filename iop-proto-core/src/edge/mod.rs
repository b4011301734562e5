//! The Edge machine: node registry with generation fencing, provider leases, the
//! provider-pool wait queue, dispatch and the run/tunnel streams of dispatched requests.
//!
//! Drive it with the convention of every machine in this crate:
//! 1. feed inputs: [`handle_connection_opened`](EdgeCore::handle_connection_opened),
//!    [`handle_envelope`](EdgeCore::handle_envelope),
//!    [`handle_connection_closed`](EdgeCore::handle_connection_closed),
//!    [`handle_submit`](EdgeCore::handle_submit), [`handle_dispatch`](EdgeCore::handle_dispatch),
//!    [`handle_cancel`](EdgeCore::handle_cancel), [`handle_config`](EdgeCore::handle_config)
//!    and [`handle_timeout`](EdgeCore::handle_timeout);
//! 2. after each, drain [`poll_transmit`](EdgeCore::poll_transmit) (frames to write,
//!    connections to close, in order) and [`poll_event`](EdgeCore::poll_event);
//! 3. sleep until [`poll_timeout`](EdgeCore::poll_timeout).
//!
//! Rules (contract `iop.edge-node-runtime-wire`):
//! - An accepted register claims ownership of the node id as *pending*: nothing is
//!   dispatched to it, it is offline in snapshots and gets no refresh until it is ready.
//! - A newer accepted register for the same node id fences the older generation in the
//!   same transition (its leases return, its requests fail with `NodeLost`).
//! - Only the current owner's close or heartbeat timeout fences it. Stale, superseded or
//!   rejected connections change nothing and emit no event.
//! - Ready from the current pending owner activates its resources, pumps waiters and
//!   emits exactly one [`EdgeEvent::NodeConnected`]; a duplicate ready from the same ready
//!   owner is answered `ready=true` with no side effect; any other ready gets `ready=false`
//!   and the connection is closed.
//! - Every accepted request ends exactly once with [`EdgeEvent::RequestEnded`].
//! - A ready owner's `NodeDrainRequest` (a graceful stop), like a failed config refresh,
//!   drains the node: nothing new is dispatched to it, what runs there ends normally, and
//!   its connection is closed ([`CloseReason::Drained`]) once its last lease returns.
//!   While a node stopping so is live, a newer register for its id is held off
//!   ([`RejectReason::Draining`]) instead of superseding it.

use std::collections::{BTreeMap, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::edge_config::{EdgeConfig, EdgeConfigError, category_of};
use crate::guard::{
    AuthThrottle, Claim, Contest, FlapGuard, Instance, PendingConnections, Rival, Source,
    ThrottledBy,
};
use crate::idhash::IdMap;
use crate::lease::{Generation, Lease, Ledger, Release, RequestId, ResourceId};
use crate::queue::{Candidate, Ticket, WaitQueue, Waiter};
use crate::run::{RunStep, RunTracker, RunViolation};
use crate::time::Timestamp;
use crate::timer::{TimerTable, Wake};
use crate::token::TokenVerifier;
use crate::tunnel::{TunnelReceiver, TunnelStep, TunnelViolation};
use crate::wire::{
    AdapterConfig, AdapterType, Body, CancelKind, CancelRequest, Envelope, ErrorDetail, Heartbeat,
    HeartbeatAck, NodeCommandResponse, NodeConfigRefreshRequest, NodeConfigRefreshResponse,
    NodeDrainRequest, NodeReadyRequest, NodeReadyResponse, ProviderHealth, ProviderSnapshot,
    ProviderStatus, ProviderTunnelFrame, ProviderTunnelRequest, RefreshStatus, RegisterRequest,
    RegisterResponse, RunEvent, RunEventType, RunRequest, TunnelFrameKind, Validate,
    ValidationError,
};

mod control;
mod dispatch;
mod lifecycle;
mod registry;
mod streams;
mod timers;
mod types;

pub use lifecycle::{Lifecycle, health_word};
pub use registry::throttled_reason;
pub use types::*;

use dispatch::{Model, ResourceMeta};
use registry::{Conn, Phase};
use streams::{ReqState, Stream, StreamItem};
use timers::TimerKey;

/// The Edge protocol machine. See the [module documentation](self).
///
/// Its state lives in sub-states that own their data (quinn-proto's `connection/`
/// shape): the node `Registry` (connections, ownership, admission; `edge/registry.rs`),
/// the provider `Pool` (leases, model groups, the wait queue; `edge/dispatch.rs`), the
/// requests and their streams (`edge/streams.rs`), the `Control` traffic (commands,
/// refreshes; `edge/control.rs`), one keyed timer table and one `Outbox` of transmits and
/// events. Transitions that cross them
/// (a register fencing an older owner, a lost node failing its requests) are methods of
/// `EdgeCore` in the module of the state they start from.
#[derive(Debug)]
pub struct EdgeCore {
    config: EdgeConfig,
    registry: registry::Registry,
    pool: dispatch::Pool,
    requests: IdMap<RequestId, ReqState>,
    next_request: u64,
    control: control::Control,
    timers: TimerTable<TimerKey>,
    out: Outbox,
    now: Timestamp,
    #[cfg(feature = "testkit")]
    faults: crate::testkit::Faults,
}

/// What the machine hands out, in order: transmits for the transport and events for the
/// shell. Every sub-state pushes into this one outbox.
#[derive(Debug, Default)]
struct Outbox {
    transmits: VecDeque<Transmit>,
    events: VecDeque<EdgeEvent>,
}

/// The run id on the wire for a request (see [`RunId`]).
#[must_use]
pub fn run_id_of(request: RequestId) -> String {
    RunId(request).wire()
}

/// Pushes of one revision a node may leave unanswered before it is drained.
pub const MAX_REFRESH_TRIES: u32 = 3;

fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

impl EdgeCore {
    /// A machine serving `config`.
    pub fn new(config: EdgeConfig) -> Result<Self, EdgeConfigError> {
        config.validate()?;
        let mut core = EdgeCore {
            config: EdgeConfig::default(),
            registry: registry::Registry::new(config.admission.throttle),
            pool: dispatch::Pool::default(),
            requests: IdMap::default(),
            next_request: 1,
            control: control::Control::default(),
            timers: TimerTable::new(),
            out: Outbox::default(),
            now: Timestamp::ZERO,
            #[cfg(feature = "testkit")]
            faults: crate::testkit::Faults::default(),
        };
        core.install(config);
        Ok(core)
    }

    /// Plants bugs for the simulator's self-test (test support only).
    #[cfg(feature = "testkit")]
    pub fn set_faults(&mut self, faults: crate::testkit::Faults) {
        self.faults = faults;
    }

    /// The configuration in force.
    #[must_use]
    pub fn config(&self) -> &EdgeConfig {
        &self.config
    }

    /// The lease ledger (read-only).
    #[must_use]
    pub fn ledger(&self) -> &Ledger {
        &self.pool.ledger
    }

    /// The wait queue (read-only).
    #[must_use]
    pub fn queue(&self) -> &WaitQueue {
        &self.pool.queue
    }

    /// Requests accepted and not yet finished with the node (includes cancelled runs
    /// whose lease is still held).
    #[must_use]
    pub fn open_requests(&self) -> usize {
        self.requests.len()
    }

    /// Number of open node connections (any phase).
    #[must_use]
    pub fn connections(&self) -> usize {
        self.registry.conns.len()
    }

    /// The node id and generation a connection owns, if it is a current owner.
    #[must_use]
    pub fn owner_of(&self, conn: ConnId) -> Option<(Arc<str>, Generation, bool)> {
        let c = self.registry.conns.get(&conn)?;
        let Phase::Owner { node, generation } = c.phase else {
            return None;
        };
        let owner = self.registry.nodes[node].owner?;
        (owner.conn == conn).then(|| {
            (
                self.registry.nodes[node].id.clone(),
                generation,
                owner.ready,
            )
        })
    }

    /// The connection that currently owns `node_id` (pending or ready).
    #[must_use]
    pub fn owner_of_node(&self, node_id: &str) -> Option<ConnId> {
        self.registry.nodes[*self.registry.node_index.get(node_id)?]
            .owner
            .map(|o| o.conn)
    }

    /// The resource of `(node_id, provider_id)`, if configured at any time.
    #[must_use]
    pub fn resource(&self, node_id: &str, provider_id: &str) -> Option<ResourceId> {
        let node = &self.registry.nodes[*self.registry.node_index.get(node_id)?];
        node.resources
            .iter()
            .find(|(name, _)| &**name == provider_id)
            .map(|(_, r)| *r)
    }

    /// The next frame to write or connection to close.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.out.transmits.pop_front()
    }

    /// The next event.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<EdgeEvent> {
        self.out.events.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) must next be called, and which timer
    /// it is for.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Wake> {
        let queue = self.pool.queue.next_deadline().map(|at| Wake {
            at,
            reason: "queue wait",
        });
        crate::timer::earliest(self.timers.next(), queue)
    }

    fn advance(&mut self, now: Timestamp) {
        debug_assert!(now >= self.now, "time went backwards: {now} < {}", self.now);
        self.now = self.now.max(now);
    }

    /// A node connection was accepted by the transport, before any TLS handshake; `peer`
    /// says what the transport knows about the other end so far (its address). The
    /// register timeout runs from here, and the connection counts against the caps on
    /// connections that have not registered yet: over them it is closed at once
    /// ([`CloseReason::TooManyPending`]). Its frames are limited to
    /// [`Admission::pending_frame_len`](crate::edge_config::Admission) until a register
    /// is accepted ([`Transmit::FrameLimit`]).
    pub fn handle_connection_opened(
        &mut self,
        now: Timestamp,
        conn: ConnId,
        peer: Peer,
    ) -> Result<(), EdgeError> {
        self.advance(now);
        if self.registry.conns.contains_key(&conn) {
            return Err(UsageError::DuplicateConnection(conn).into());
        }
        let source = Source::of(peer.addr);
        let admitted = self
            .registry
            .pending
            .admit(source, self.config.admission.pending);
        self.registry.conns.insert(
            conn,
            Conn {
                phase: Phase::Unregistered,
                pending: admitted,
                peer,
                last_rx: self.now,
                ping: None,
                rtt: None,
                held: None,
            },
        );
        let timing = self.config.timing;
        self.timers.set(
            TimerKey::Handshake(conn),
            self.now + timing.register_timeout,
        );
        self.timers.set(
            TimerKey::Liveness(conn),
            self.now + timing.heartbeat_timeout,
        );
        if !admitted {
            self.registry.refused_pending += 1;
            let addr = self.registry.conns.get(&conn).and_then(|c| c.peer.addr);
            self.out.events.push_back(EdgeEvent::ConnectionRefused {
                conn,
                addr,
                pending: self.registry.pending.total(),
                refused: self.registry.refused_pending,
                log: self.registry.refused_pending.is_power_of_two(),
            });
            self.close(conn, CloseReason::TooManyPending);
        }
        Ok(())
    }

    /// The connection's TLS handshake completed: `tls` is the negotiated version and
    /// `identities` the names of the client certificate, if one was presented and
    /// verified (see [`Peer`]).
    pub fn handle_connection_secured(
        &mut self,
        now: Timestamp,
        conn: ConnId,
        tls: &'static str,
        identities: Vec<String>,
    ) -> Result<(), EdgeError> {
        self.advance(now);
        let c = self.registry.conn_mut(conn)?;
        c.peer.tls = Some(tls);
        c.peer.identities = identities;
        Ok(())
    }

    /// The transport reports the connection closed (by the peer, an IO error, or after a
    /// requested [`Transmit::Close`]).
    pub fn handle_connection_closed(
        &mut self,
        now: Timestamp,
        conn: ConnId,
    ) -> Result<(), EdgeError> {
        self.advance(now);
        let c = self
            .registry
            .conns
            .remove(&conn)
            .ok_or(UsageError::UnknownConnection(conn))?;
        if c.pending {
            self.registry.pending.release(Source::of(c.peer.addr));
        }
        for key in [
            TimerKey::Handshake(conn),
            TimerKey::Liveness(conn),
            TimerKey::Ping(conn),
            TimerKey::Answer(conn),
        ] {
            self.timers.stop(key);
        }
        if let Phase::Owner { node, generation } = c.phase {
            self.fence_owner(node, generation, CloseReason::PeerClosed);
        }
        Ok(())
    }

    /// Bytes arrived on `conn` without completing a frame. Liveness counts them (a large
    /// frame on a slow link may take longer than the heartbeat timeout to arrive whole);
    /// the handshake deadline of a connection that has not registered does not move.
    /// A shell may call this at most every so often; a decoded envelope counts anyway.
    pub fn handle_bytes_received(&mut self, now: Timestamp, conn: ConnId) -> Result<(), EdgeError> {
        self.advance(now);
        let c = self.registry.conn_mut(conn)?;
        if !matches!(c.phase, Phase::Stale | Phase::Held) {
            c.last_rx = self.now;
        }
        Ok(())
    }

    /// An envelope decoded from a connection.
    pub fn handle_envelope(
        &mut self,
        now: Timestamp,
        conn: ConnId,
        envelope: Envelope,
    ) -> Result<(), EdgeError> {
        self.advance(now);
        let c = self.registry.conn_mut(conn)?;
        let phase = c.phase;
        if phase == Phase::Held {
            return Ok(()); // its answer is on its way; nothing it sends matters
        }
        if phase == Phase::Stale {
            // Rejected or superseded: answer a ready with a refusal, ignore the rest.
            if let Some(Body::NodeReadyRequest(_)) = envelope.body {
                self.refuse_ready(conn, "connection is not the node's current owner", false);
            }
            return Ok(());
        }
        c.last_rx = self.now;
        if let Err(err) = envelope.validate() {
            // A message about one run that is wrong (an unknown event type or frame kind,
            // as a newer node may send) fails that run, not the connection; a refresh
            // answer with an unknown status counts as failed. Anything else breaks the
            // connection's own grammar.
            #[cfg(feature = "testkit")]
            if self.faults.close_on_unknown_kind {
                self.violation(conn, ConnViolation::Invalid(err));
                return Ok(());
            }
            match envelope.body {
                Some(Body::RunEvent(event)) => {
                    self.bad_stream_item(conn, phase, &event.run_id, err);
                }
                Some(Body::ProviderTunnelFrame(frame)) => {
                    self.bad_stream_item(conn, phase, &frame.run_id, err);
                }
                Some(Body::NodeConfigRefreshResponse(resp)) if !resp.request_id.is_empty() => {
                    self.on_refresh_response(conn, phase, resp);
                }
                _ => self.violation(conn, ConnViolation::Invalid(err)),
            }
            return Ok(());
        }
        let Some(body) = envelope.body else {
            return Ok(());
        };
        match body {
            Body::RegisterRequest(req) => self.on_register(conn, phase, req),
            Body::NodeReadyRequest(req) => self.on_ready(conn, phase, &req),
            Body::Heartbeat(ping) => self.send(
                conn,
                Body::HeartbeatAck(HeartbeatAck {
                    nonce: ping.nonce,
                    echo_sent_at_ms: ping.sent_at_ms,
                }),
            ),
            Body::HeartbeatAck(ack) => {
                // Only the answer to the ping in flight counts: the peer's echoed clock is
                // not trusted, the Edge's own send time is.
                let now = self.now;
                if let Some(c) = self.registry.conns.get_mut(&conn) {
                    if let Some((nonce, sent)) = c.ping {
                        if nonce == ack.nonce {
                            c.rtt = Some(now.saturating_duration_since(sent));
                            c.ping = None;
                        }
                    }
                }
            }
            Body::RunEvent(event) => self.on_stream(conn, phase, StreamItem::Run(event)),
            Body::ProviderTunnelFrame(frame) => {
                self.on_stream(conn, phase, StreamItem::Frame(frame));
            }
            Body::NodeConfigRefreshResponse(resp) => self.on_refresh_response(conn, phase, resp),
            Body::NodeCommandResponse(resp) => self.on_command_response(conn, phase, resp),
            Body::NodeDrainRequest(req) => self.on_drain_request(conn, phase, req),
            other => self.violation(conn, ConnViolation::WrongDirection(other.kind())),
        }
        Ok(())
    }

    /// Expires timers due at or before `now`. A spurious call does nothing.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        self.advance(now);
        while let Some(key) = self.timers.pop_expired(self.now) {
            self.fire(key);
        }
        while let Some(waiter) = self.pool.queue.pop_expired(self.now) {
            self.requests.remove(&waiter.request);
            self.out.events.push_back(EdgeEvent::RequestEnded {
                request: waiter.request,
                outcome: Outcome::Expired,
            });
        }
    }

    /// A caller's request for `submit.model`. On success it is either granted at once
    /// ([`EdgeEvent::Granted`]) or queued until capacity frees or it expires.
    pub fn handle_submit(
        &mut self,
        now: Timestamp,
        submit: Submit<'_>,
    ) -> Result<RequestId, EdgeError> {
        self.advance(now);
        let model = self
            .pool
            .models
            .get(submit.model)
            .ok_or_else(|| SubmitError::UnknownModel(submit.model.to_owned()))?;
        let long = model
            .long_threshold
            .is_some_and(|t| submit.prompt_tokens >= t);
        if long && !model.long_possible {
            return Err(SubmitError::NoCandidates(submit.model.to_owned()).into());
        }
        let candidates: Arc<[Candidate]> = if submit.tunnel_only {
            model
                .candidates
                .iter()
                .filter(|c| self.shape_of(c.resource) == DispatchShape::Tunnel)
                .cloned()
                .collect()
        } else {
            model.candidates.clone()
        };
        if candidates.is_empty() {
            return Err(SubmitError::NoCandidates(submit.model.to_owned()).into());
        }
        let request = RequestId(self.next_request);
        let model_name: Arc<str> = self
            .pool
            .models
            .get_key_value(submit.model)
            .map(|(k, _)| k.clone())
            .unwrap_or_else(|| submit.model.into());
        if let Some(candidate) = self.pick_candidate(&model_name, &candidates, long) {
            self.next_request += 1;
            self.grant(request, &model_name, &candidate, long);
            return Ok(request);
        }
        let max_waiting = self.config.queue.max_waiting;
        if self.pool.queue.waiting_for(&model_name) >= max_waiting {
            return Err(EdgeError::Submit(SubmitError::QueueFull {
                model: submit.model.to_owned(),
                max_waiting,
            }));
        }
        self.next_request += 1;
        let ticket = self.pool.queue.push(Waiter {
            request,
            model: model_name,
            long,
            candidates,
            deadline: self.now + self.config.queue.wait_timeout,
        });
        self.requests.insert(
            request,
            ReqState::Waiting {
                ticket,
                tunnel_only: submit.tunnel_only,
            },
        );
        Ok(request)
    }

    /// Sends a granted request to its node. The machine sets the message's `run_id`,
    /// `adapter` and `target` from the grant; the shell supplies the rest.
    pub fn handle_dispatch(
        &mut self,
        now: Timestamp,
        request: RequestId,
        dispatch: Dispatch,
    ) -> Result<RunId, EdgeError> {
        self.advance(now);
        let Some(ReqState::Granted {
            lease,
            conn,
            shape,
            target,
        }) = self.requests.get(&request)
        else {
            return Err(UsageError::NotGranted(request).into());
        };
        // `String::from(&*arc)`, not `to_string()`: an `Arc<str>` has no specialised
        // `ToString` and would go through the formatter.
        let (lease, conn, shape, target) = (*lease, *conn, *shape, String::from(&**target));
        let run = RunId(request);
        let run_id = run.wire();
        let provider_id = String::from(&*self.pool.resources[lease.resource.index()].provider_id);
        let (body, stream) = match (dispatch, shape) {
            (Dispatch::Run(mut run), DispatchShape::Run) => {
                run.run_id.clone_from(&run_id);
                run.adapter = provider_id;
                run.target = target;
                run.long_context = lease.long;
                (Body::RunRequest(run), Stream::Run(RunTracker::new()))
            }
            (Dispatch::Tunnel(mut tunnel), DispatchShape::Tunnel) => {
                tunnel.run_id.clone_from(&run_id);
                tunnel.adapter = provider_id;
                tunnel.target = target;
                (
                    Body::ProviderTunnelRequest(tunnel),
                    Stream::Tunnel(TunnelReceiver::new()),
                )
            }
            (_, expected) => {
                return Err(UsageError::WrongShape { request, expected }.into());
            }
        };
        self.send(conn, body);
        self.requests.insert(
            request,
            ReqState::Running {
                lease,
                conn,
                stream,
            },
        );
        Ok(run)
    }

    /// The caller gave up on `request` (disconnect, response timeout, write failure).
    /// A waiting request leaves the queue; a granted one returns its lease; a running one
    /// is cancelled on its node with `CancelRequest(CANCEL_RUN)` and keeps its lease until
    /// the node confirms or the cancel grace passes. A request that already ended is
    /// [`UsageError::Ended`]: a race the driver may ignore.
    pub fn handle_cancel(
        &mut self,
        now: Timestamp,
        request: RequestId,
        reason: &str,
    ) -> Result<(), EdgeError> {
        self.advance(now);
        let Some(state) = self.requests.remove(&request) else {
            return Err(UsageError::Ended(request).into());
        };
        match state {
            ReqState::Waiting { ticket, .. } => {
                self.pool.queue.remove(ticket);
            }
            ReqState::Granted { lease, .. } => self.release(lease),
            ReqState::Running {
                lease,
                conn,
                stream,
            } => {
                self.cancel_on_node(request, conn, reason.to_owned());
                self.requests.insert(
                    request,
                    ReqState::Cancelling {
                        lease,
                        conn,
                        stream,
                    },
                );
            }
            ReqState::Cancelling { .. } => {
                self.requests.insert(request, state);
                return Err(UsageError::Ended(request).into());
            }
        }
        self.out.events.push_back(EdgeEvent::RequestEnded {
            request,
            outcome: Outcome::Cancelled,
        });
        Ok(())
    }

    /// Sends a query command (`CAPABILITIES`, `TRANSPORT_STATUS`, `OLLAMA_API`) to a ready
    /// node. The command is validated first, before the node is even looked up; its
    /// `request_id` is assigned here and returned. The answer arrives as
    /// [`EdgeEvent::CommandAnswered`] (also when the node is lost or does not answer
    /// within the refresh timeout).
    pub fn handle_command(
        &mut self,
        now: Timestamp,
        node_id: &str,
        mut request: crate::wire::NodeCommandRequest,
    ) -> Result<CommandId, EdgeError> {
        self.advance(now);
        let seq = self.control.next_refresh;
        let id = CommandId(seq);
        request.request_id = id.to_string();
        request.validate().map_err(CommandError::Invalid)?;
        let i = *self
            .registry
            .node_index
            .get(node_id)
            .filter(|&&i| self.registry.nodes[i].spec.is_some())
            .ok_or_else(|| CommandError::UnknownNode(node_id.to_owned()))?;
        if request.r#type == crate::wire::NodeCommandType::OllamaApi as i32 {
            let ollama = self.registry.nodes[i]
                .spec
                .as_ref()
                .and_then(|spec| spec.adapter(&request.adapter))
                .is_some_and(|a| a.r#type == AdapterType::Ollama as i32);
            if !ollama {
                return Err(EdgeError::Command(CommandError::NotOllama {
                    node: node_id.to_owned(),
                    adapter: request.adapter.clone(),
                }));
            }
        }
        let owner = self.registry.nodes[i]
            .owner
            .filter(|o| o.ready)
            .ok_or_else(|| CommandError::NotReady(node_id.to_owned()))?;
        self.control.next_refresh += 1;
        self.control
            .commands
            .insert(seq, (i, owner.generation, request.request_id.clone()));
        self.send(owner.conn, Body::NodeCommandRequest(request));
        self.timers.set(
            TimerKey::Command(seq),
            self.now + self.config.timing.refresh_timeout,
        );
        Ok(id)
    }

    /// Replaces the configuration. Removed nodes are fenced and closed; ready nodes whose
    /// payload changed get a `NodeConfigRefreshRequest` (pending ones after their ready);
    /// model groups take effect for new requests. An invalid configuration changes nothing.
    pub fn handle_config(
        &mut self,
        now: Timestamp,
        config: EdgeConfig,
    ) -> Result<crate::edge_config::ConfigDiff, EdgeError> {
        self.advance(now);
        config.validate()?;
        let diff = self.config.diff(&config);
        for node_id in &diff.removed_nodes {
            if let Some(&i) = self.registry.node_index.get(node_id.as_str())
                && let Some(owner) = self.registry.nodes[i].owner
            {
                self.close(owner.conn, CloseReason::NodeRemoved);
                self.fence_owner(i, owner.generation, CloseReason::NodeRemoved);
            }
        }
        // A changed token revokes the connection that registered with the old one.
        for node_id in &diff.changed_tokens {
            if let Some(&i) = self.registry.node_index.get(node_id.as_str())
                && let Some(owner) = self.registry.nodes[i].owner
            {
                self.close(owner.conn, CloseReason::CredentialsChanged);
                self.fence_owner(i, owner.generation, CloseReason::CredentialsChanged);
            }
        }
        for node_id in &diff.changed_payloads {
            if let Some(&i) = self.registry.node_index.get(node_id.as_str()) {
                self.registry.nodes[i].revision += 1;
                self.registry.nodes[i].refresh_tries = 0;
            }
        }
        self.install(config);
        for node_id in &diff.changed_payloads {
            if let Some(&i) = self.registry.node_index.get(node_id.as_str())
                && self.registry.nodes[i].owner.is_some_and(|o| o.ready)
            {
                self.push_refresh(i);
            }
        }
        Ok(diff)
    }
}
