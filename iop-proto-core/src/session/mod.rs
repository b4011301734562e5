//! The Node session machine: one connection to the Edge, from register to close.
//!
//! `Connecting → Registering → Configuring → Ready → Closed`.
//! - On an accepted `RegisterResponse` it asks the shell to apply the config and start
//!   adapters ([`SessionEvent::ApplyConfig`]) and sends `NodeReadyRequest` only once the
//!   shell reports they started ([`NodeSession::handle_config_applied`]).
//! - A rejected register ends the session with a fatal credential failure; `ready=false`
//!   ends it with a retryable one. Either way control returns to the [`Supervisor`].
//! - It answers heartbeats, sends its own, and treats Edge silence beyond the heartbeat
//!   timeout as a lost connection.
//! - Work (`RunRequest`, `ProviderTunnelRequest`) passes the adapter's capacity gate;
//!   the shell reports progress with [`NodeSession::handle_run_output`] and
//!   [`NodeSession::handle_tunnel_output`], which number, chunk and check every event
//!   and frame, so the Edge always receives a valid contract sequence.
//! - A cancel affects only the named run; unknown run ids get a typed error; a cancel
//!   after the terminal is a no-op.
//! - A config refresh is validated and diffed per adapter: `FAILED` keeps the old config,
//!   `RESTART_REQUIRED` names what cannot change live, `APPLIED` starts, stops or resizes
//!   adapters. Runs on a removed adapter finish or are cancelled explicitly.
//! - A local stop is graceful ([`NodeSession::handle_drain`]: the Edge is asked to send
//!   nothing more, and the work in flight runs to its end) or quick
//!   ([`NodeSession::handle_shutdown`]: the work in flight is cancelled); either ends in
//!   [`SessionEnd::LocalShutdown`].
//!
//! [`Supervisor`]: crate::reconnect::Supervisor

use crate::timer::{TimerTable, Wake};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use crate::gate::CapacityGate;
use crate::idhash::{IdMap, IdSet};
use crate::reconnect::Failure;
use crate::time::Timestamp;
use crate::wire::{
    AdapterLoad, Body, Envelope, Heartbeat, HeartbeatAck, Inbound, NodeCommandResponse,
    NodeConfigPayload, NodeConfigRefreshResponse, NodeDrainRequest, NodeLoadReport,
    NodeReadyRequest, RefreshStatus, RegisterRequest, TunnelRequest, Validate,
};

mod board;
mod config;
mod types;
mod work;

pub use board::LoadBoard;
pub use config::{AdapterDiff, diff_adapters};

/// What several sessions' work holds, summed by adapter: the `held_elsewhere` a node's
/// current session reports when more than one session drains beside it (each from
/// [`NodeSession::load`]). Sorted by adapter; adapters holding nothing left out.
#[must_use]
pub fn sum_loads<'a>(loads: impl IntoIterator<Item = &'a AdapterLoad>) -> Vec<AdapterLoad> {
    let mut sum: BTreeMap<&str, (u32, u32)> = BTreeMap::new();
    for load in loads {
        let entry = sum.entry(load.adapter.as_str()).or_default();
        entry.0 = entry.0.saturating_add(load.in_flight);
        entry.1 = entry.1.saturating_add(load.long_in_flight);
    }
    sum.into_iter()
        .filter(|(_, (n, _))| *n > 0)
        .map(|(adapter, (in_flight, long_in_flight))| AdapterLoad {
            adapter: adapter.to_owned(),
            in_flight,
            long_in_flight,
        })
        .collect()
}
pub use types::*;

use work::Work;

/// The session's timers (liveness is derived from the last receive instead).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum SessionTimer {
    /// Register, configure and ready must be done by this.
    Handshake,
    /// Send a heartbeat.
    Ping,
    /// A graceful stop stops waiting for the work in flight to end on its own.
    Drain,
    /// A shutdown stops waiting for cancelled work at this time.
    Cancel,
}

impl crate::timer::TimerKey for SessionTimer {
    fn reason(&self) -> &'static str {
        match self {
            SessionTimer::Handshake => "handshake",
            SessionTimer::Ping => "ping",
            SessionTimer::Drain => "drain grace",
            SessionTimer::Cancel => "shutdown grace",
        }
    }
}

/// The Node session machine. See the [module documentation](self).
#[derive(Debug)]
pub struct NodeSession {
    config: SessionConfig,
    state: SessionState,
    now: Timestamp,
    timers: TimerTable<SessionTimer>,
    heartbeat_interval: Duration,
    last_rx: Timestamp,
    next_nonce: u64,
    last_rtt: Option<Duration>,
    applied: Option<NodeConfigPayload>,
    pending_apply: Option<NodeConfigPayload>,
    ready_sent: bool,
    pending_refresh: Option<(String, NodeConfigPayload)>,
    pending_commands: IdSet<String>,
    /// (Crate-visible: tests read a gate through `testkit::InspectSession`.)
    pub(crate) gates: IdMap<Arc<str>, CapacityGate>,
    work: IdMap<Arc<str>, Work>,
    /// Finished run ids, oldest first, and the same ids for lookup (one allocation each).
    finished: VecDeque<Arc<str>>,
    finished_set: IdSet<Arc<str>>,
    transmits: VecDeque<NodeTransmit>,
    /// A graceful stop asked the Edge to send nothing more and waits for it to close.
    draining: bool,
    /// The Edge said it is handing over (`NodeRehomeRequest`): nothing new comes here.
    rehomed: bool,
    /// The Edge takes `NodeLoadReport` (`RegisterResponse.load_reports`).
    load_reports: bool,
    /// The Edge takes merged tunnel frames (`RegisterResponse.merged_tunnel_frames`).
    merged_tunnel_frames: bool,
    /// What the node's work for other, draining sessions holds, by adapter (sorted, no
    /// empty entries): in the `NodeReadyRequest`, in the gates, and reported on change.
    held_elsewhere: Vec<AdapterLoad>,
    /// Counts every change of what this session's work holds ([`Self::load_changes`]).
    load_changes: u64,
    /// A local shutdown cancelled the work in flight and waits for it to end (until
    /// the `Cancel` timer).
    cancelling: bool,
    events: VecDeque<SessionEvent>,
    end: Option<SessionEnd>,
}

impl NodeSession {
    /// A session in `Connecting`.
    #[must_use]
    pub fn new(config: SessionConfig) -> Self {
        let interval = config.heartbeat_interval;
        NodeSession {
            config,
            state: SessionState::Connecting,
            now: Timestamp::ZERO,
            timers: TimerTable::new(),
            heartbeat_interval: interval,
            last_rx: Timestamp::ZERO,
            next_nonce: 1,
            last_rtt: None,
            applied: None,
            pending_apply: None,
            ready_sent: false,
            pending_refresh: None,
            pending_commands: IdSet::default(),
            gates: IdMap::default(),
            work: IdMap::default(),
            finished: VecDeque::new(),
            finished_set: IdSet::default(),
            transmits: VecDeque::new(),
            draining: false,
            rehomed: false,
            load_reports: false,
            merged_tunnel_frames: false,
            held_elsewhere: Vec::new(),
            load_changes: 0,
            cancelling: false,
            events: VecDeque::new(),
            end: None,
        }
    }

    /// Where the session is in register → configure → ready, or closed.
    #[must_use]
    pub fn state(&self) -> SessionState {
        self.state
    }

    /// Why the session ended, once closed.
    #[must_use]
    pub fn end(&self) -> Option<&SessionEnd> {
        self.end.as_ref()
    }

    /// The config in force (after the shell applied it).
    #[must_use]
    pub fn applied_config(&self) -> Option<&NodeConfigPayload> {
        self.applied.as_ref()
    }

    /// The heartbeat interval in force.
    #[must_use]
    pub fn heartbeat_interval(&self) -> Duration {
        self.heartbeat_interval
    }

    /// Round-trip time of the last answered heartbeat.
    #[must_use]
    pub fn last_rtt(&self) -> Option<Duration> {
        self.last_rtt
    }

    /// A count that moves whenever what this session's work holds ([`Self::load`])
    /// changes: a shell that publishes the load to the node's other sessions compares it
    /// instead of building the load on every wake.
    #[must_use]
    pub fn load_changes(&self) -> u64 {
        self.load_changes
    }

    /// Runs and tunnels in flight.
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.work.len()
    }

    /// The next envelope to write.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<NodeTransmit> {
        self.transmits.pop_front()
    }

    /// The next event for the shell.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<SessionEvent> {
        self.events.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) must next be called, and why.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Wake> {
        if matches!(self.state, SessionState::Connecting | SessionState::Closed) {
            return None;
        }
        let liveness = Wake {
            at: self.liveness_deadline(),
            reason: "liveness",
        };
        crate::timer::earliest(self.timers.next(), Some(liveness))
    }

    fn liveness_deadline(&self) -> Timestamp {
        self.last_rx + self.heartbeat_interval * self.config.heartbeat_timeout_intervals.max(1)
    }

    fn advance(&mut self, now: Timestamp) {
        debug_assert!(now >= self.now, "time went backwards");
        self.now = self.now.max(now);
    }

    fn wrong_state(&self, input: &'static str) -> SessionError {
        SessionError::WrongState {
            input,
            state: self.state,
        }
    }

    fn send(&mut self, body: Body) {
        self.transmits
            .push_back(NodeTransmit::Frame(Envelope::new(body)));
    }

    /// The transport connected: register.
    pub fn handle_connected(&mut self, now: Timestamp) -> Result<(), SessionError> {
        self.advance(now);
        if self.state != SessionState::Connecting {
            return Err(self.wrong_state("connected"));
        }
        self.state = SessionState::Registering;
        self.last_rx = self.now;
        self.timers.set(
            SessionTimer::Handshake,
            self.now + self.config.handshake_timeout,
        );
        self.timers
            .set(SessionTimer::Ping, self.now + self.heartbeat_interval);
        self.send(Body::RegisterRequest(RegisterRequest {
            node_id: self.config.node_id.clone(),
            token: self.config.token.clone(),
            version: self.config.version.clone(),
            adapter_types: self.config.adapter_types.clone(),
            labels: self.config.labels.clone(),
            instance_id: self.config.instance_id,
            rehome: self.config.rehome,
            cluster: self.config.cluster,
        }));
        Ok(())
    }

    /// The shell applied the register config and started its adapters (`Ok`), or could
    /// not (`Err` ends the session).
    pub fn handle_config_applied(
        &mut self,
        now: Timestamp,
        result: Result<(), String>,
    ) -> Result<(), SessionError> {
        self.advance(now);
        if self.state != SessionState::Configuring || self.pending_apply.is_none() {
            return Err(self.wrong_state("config applied"));
        }
        let Some(payload) = self.pending_apply.take() else {
            return Err(self.wrong_state("config applied"));
        };
        match result {
            Ok(()) => {
                self.install_gates(
                    &payload,
                    &diff_adapters(&NodeConfigPayload::default(), &payload),
                );
                self.applied = Some(payload);
                self.ready_sent = true;
                self.apply_held();
                self.send(Body::NodeReadyRequest(NodeReadyRequest {
                    node_id: self.config.node_id.clone(),
                    held_elsewhere: self.held_elsewhere.clone(),
                }));
            }
            Err(why) => self.close(SessionEnd::ConfigNotApplied(why)),
        }
        Ok(())
    }

    /// The shell applied a refresh (`Ok`: answer `APPLIED`) or could not (`Err`: answer
    /// `FAILED`; the shell keeps the old adapters running).
    pub fn handle_refresh_applied(
        &mut self,
        now: Timestamp,
        request_id: &str,
        result: Result<(), String>,
    ) -> Result<(), SessionError> {
        self.advance(now);
        let pending = self
            .pending_refresh
            .take_if(|(id, _)| id == request_id)
            .ok_or_else(|| SessionError::NotPending(request_id.to_owned()))?;
        let (request_id, payload) = pending;
        if self.state != SessionState::Ready {
            return Ok(());
        }
        let response = match result {
            Ok(()) => {
                let old = self.applied.clone().unwrap_or_default();
                self.install_gates(&payload, &diff_adapters(&old, &payload));
                self.apply_held();
                let revision = payload.revision;
                self.applied = Some(payload);
                NodeConfigRefreshResponse {
                    request_id,
                    status: RefreshStatus::Applied as i32,
                    message: String::new(),
                    revision,
                }
            }
            Err(why) => NodeConfigRefreshResponse {
                request_id,
                status: RefreshStatus::Failed as i32,
                message: format!("could not apply: {why}"),
                revision: self.applied_revision(),
            },
        };
        self.send(Body::NodeConfigRefreshResponse(response));
        Ok(())
    }

    /// The shell's answer to a [`SessionEvent::Command`].
    pub fn handle_command_response(
        &mut self,
        now: Timestamp,
        response: NodeCommandResponse,
    ) -> Result<(), SessionError> {
        self.advance(now);
        if !self.pending_commands.remove(&response.request_id) {
            return Err(SessionError::NotPending(response.request_id));
        }
        if self.state == SessionState::Ready {
            self.send(Body::NodeCommandResponse(response));
        }
        Ok(())
    }

    /// The transport failed or the Edge closed the connection.
    pub fn handle_connection_lost(
        &mut self,
        now: Timestamp,
        failure: Failure,
    ) -> Result<(), SessionError> {
        self.advance(now);
        if matches!(self.state, SessionState::Connecting | SessionState::Closed) {
            return Err(self.wrong_state("connection lost"));
        }
        // A session that is stopping ends as such: the Edge closes a drained connection,
        // and whatever else ended it, the node is not to redial.
        if self.draining || self.cancelling {
            self.close(SessionEnd::LocalShutdown);
            return Ok(());
        }
        self.close(SessionEnd::ConnectionLost(failure));
        Ok(())
    }

    /// The bytes from the Edge are not frames of this protocol: the session ends with a
    /// protocol violation (retried like any lost connection, and logged as the Edge's
    /// fault rather than the network's).
    pub fn handle_undecodable(
        &mut self,
        now: Timestamp,
        error: crate::wire::DecodeError,
    ) -> Result<(), SessionError> {
        self.advance(now);
        if matches!(self.state, SessionState::Connecting | SessionState::Closed) {
            return Err(self.wrong_state("undecodable input"));
        }
        let violation = EdgeViolation::Undecodable(error);
        self.events.push_back(SessionEvent::PeerViolation {
            violation: violation.clone(),
        });
        self.close(SessionEnd::ProtocolViolation(violation));
        Ok(())
    }

    /// Local shutdown. Work in flight is cancelled ([`SessionEvent::CancelRun`] for each
    /// run) and new work is refused; the session closes once the last run has ended in
    /// order, or when [`SessionConfig::shutdown_grace`] passes, whichever is first.
    /// Without work in flight it closes at once. A second call changes nothing; during a
    /// graceful stop ([`Self::handle_drain`]) it cuts the wait short.
    pub fn handle_shutdown(&mut self, now: Timestamp) -> Result<(), SessionError> {
        self.advance(now);
        self.cancel_all();
        Ok(())
    }

    /// Graceful local stop, for a rolling restart. A ready session asks the Edge to
    /// dispatch nothing more (`NodeDrainRequest`) and serves the work in flight, and the
    /// work the Edge dispatched before it read the request, to its end. The Edge closes
    /// the connection once its last lease on the node has returned, and the session then
    /// ends with [`SessionEnd::LocalShutdown`] (so does any other loss of the connection
    /// meanwhile). If [`SessionConfig::drain_grace`] passes first, the session goes on as
    /// [`Self::handle_shutdown`] does and cancels what is still in flight. Before the
    /// session is ready nothing has been dispatched to it, and it closes at once. A second
    /// call changes nothing.
    pub fn handle_drain(&mut self, now: Timestamp) -> Result<(), SessionError> {
        self.advance(now);
        if self.state == SessionState::Closed || self.draining || self.cancelling {
            return Ok(());
        }
        if self.state != SessionState::Ready {
            self.close(SessionEnd::LocalShutdown);
            return Ok(());
        }
        self.draining = true;
        self.send(Body::NodeDrainRequest(NodeDrainRequest {
            reason: "local shutdown".to_owned(),
        }));
        self.timers
            .set(SessionTimer::Drain, self.now + self.config.drain_grace);
        Ok(())
    }

    /// What the node's work for other sessions holds now, by adapter: the whole picture
    /// (an adapter left out holds nothing), from the shell, whenever a draining session's
    /// work changes. The gates count it as taken; the Edge learns it in the
    /// `NodeReadyRequest`, or, once that is sent, in a `NodeLoadReport` (only to an Edge
    /// that takes them). Entries with nothing held are dropped; an unchanged picture
    /// sends nothing.
    pub fn handle_held_elsewhere(
        &mut self,
        now: Timestamp,
        mut held: Vec<AdapterLoad>,
    ) -> Result<(), SessionError> {
        self.advance(now);
        held.retain(|l| l.in_flight > 0);
        held.sort_by(|a, b| a.adapter.cmp(&b.adapter));
        held.dedup_by(|a, b| a.adapter == b.adapter);
        if held == self.held_elsewhere || self.state == SessionState::Closed {
            return Ok(());
        }
        self.held_elsewhere = held;
        self.apply_held();
        if self.ready_sent && self.load_reports {
            self.send(Body::NodeLoadReport(NodeLoadReport {
                held_elsewhere: self.held_elsewhere.clone(),
            }));
        }
        Ok(())
    }

    /// The gates count what other sessions hold.
    fn apply_held(&mut self) {
        for (name, gate) in &mut self.gates {
            let (n, long) = self
                .held_elsewhere
                .iter()
                .find(|l| *l.adapter == **name)
                .map_or((0, 0), |l| (l.in_flight, l.long_in_flight));
            gate.set_held(n, long);
        }
    }

    /// What this session's work in flight holds, by adapter (sorted; adapters with none
    /// left out): what a re-homed session reports to its successor session.
    #[must_use]
    pub fn load(&self) -> Vec<AdapterLoad> {
        let mut load: Vec<AdapterLoad> = self
            .gates
            .iter()
            .filter(|(_, g)| g.in_flight() > 0)
            .map(|(name, g)| AdapterLoad {
                adapter: String::from(&**name),
                in_flight: g.in_flight(),
                long_in_flight: g.long_in_flight(),
            })
            .collect();
        load.sort_by(|a, b| a.adapter.cmp(&b.adapter));
        load
    }

    /// Whether the Edge told this session to re-home ([`SessionEvent::Rehome`]).
    #[must_use]
    pub fn is_rehomed(&self) -> bool {
        self.rehomed
    }

    /// Whether a graceful stop is under way ([`Self::handle_drain`]) and has not yet turned
    /// into cancelling the work in flight.
    #[must_use]
    pub fn is_draining(&self) -> bool {
        self.draining && !self.cancelling
    }

    /// Cancels the work in flight and closes once it has ended, or at once without any.
    fn cancel_all(&mut self) {
        if self.state == SessionState::Closed || self.cancelling {
            return;
        }
        self.timers.stop(SessionTimer::Drain);
        if self.work.is_empty() {
            self.close(SessionEnd::LocalShutdown);
            return;
        }
        self.cancelling = true;
        self.timers
            .set(SessionTimer::Cancel, self.now + self.config.shutdown_grace);
        let mut runs: Vec<String> = self.work.keys().map(|id| String::from(&**id)).collect();
        runs.sort();
        for run_id in runs {
            if let Some(work) = self.work.get_mut(run_id.as_str()) {
                work.cancel_requested = true;
            }
            self.events.push_back(SessionEvent::CancelRun { run_id });
        }
    }

    /// Sends due heartbeats and detects silence and handshake timeouts. A spurious call
    /// does nothing.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        self.advance(now);
        if matches!(self.state, SessionState::Connecting | SessionState::Closed) {
            return;
        }
        if self.liveness_deadline() <= self.now {
            self.close(SessionEnd::HeartbeatTimeout);
            return;
        }
        while let Some(timer) = self.timers.pop_expired(self.now) {
            match timer {
                SessionTimer::Handshake => {
                    if matches!(
                        self.state,
                        SessionState::Registering | SessionState::Configuring
                    ) {
                        self.close(SessionEnd::HandshakeTimeout);
                        return;
                    }
                }
                SessionTimer::Drain => {
                    self.cancel_all();
                    if self.state == SessionState::Closed {
                        return;
                    }
                }
                SessionTimer::Cancel => {
                    self.close(SessionEnd::LocalShutdown);
                    return;
                }
                SessionTimer::Ping => {
                    let nonce = self.next_nonce;
                    self.next_nonce += 1;
                    self.send(Body::Heartbeat(Heartbeat {
                        nonce,
                        sent_at_ms: self.now.as_millis(),
                    }));
                    self.timers
                        .set(SessionTimer::Ping, self.now + self.heartbeat_interval);
                }
            }
        }
    }

    /// Bytes arrived from the Edge, whether or not they completed a frame. Liveness
    /// counts them: a large frame (a 16 MiB request on a slow link) can take longer than
    /// the heartbeat timeout to arrive whole, and the heartbeats queued behind it cannot
    /// overtake it, yet the Edge is plainly alive.
    pub fn handle_bytes_received(&mut self, now: Timestamp) -> Result<(), SessionError> {
        self.advance(now);
        if matches!(self.state, SessionState::Connecting | SessionState::Closed) {
            return Err(self.wrong_state("bytes received"));
        }
        self.last_rx = self.now;
        Ok(())
    }

    /// An envelope decoded from the Edge.
    pub fn handle_envelope(
        &mut self,
        now: Timestamp,
        envelope: Envelope,
    ) -> Result<(), SessionError> {
        self.received(now)?;
        if let Some(body) = envelope.body {
            self.on_message(body);
        }
        Ok(())
    }

    /// A frame from the Edge as [`FrameDecoder::next_inbound`](crate::wire::FrameDecoder::next_inbound)
    /// reads it: the same as [`handle_envelope`](Self::handle_envelope) with the
    /// envelope it carries, but a tunnel request costs no copy of its fields.
    pub fn handle_inbound(&mut self, now: Timestamp, inbound: Inbound) -> Result<(), SessionError> {
        match inbound {
            Inbound::Envelope(envelope) => self.handle_envelope(now, envelope),
            Inbound::TunnelRequest(request) => {
                self.received(now)?;
                self.on_tunnel(request);
                Ok(())
            }
        }
    }

    /// A frame arrived: refused before the session connected or after it closed, and
    /// otherwise a sign of life.
    fn received(&mut self, now: Timestamp) -> Result<(), SessionError> {
        self.advance(now);
        if matches!(self.state, SessionState::Connecting | SessionState::Closed) {
            return Err(self.wrong_state("envelope"));
        }
        self.last_rx = self.now;
        Ok(())
    }

    /// A tunnel request, admitted only once the session is ready.
    fn on_tunnel(&mut self, request: TunnelRequest) {
        if self.state == SessionState::Ready {
            self.on_tunnel_request(request);
        } else {
            self.unexpected("provider_tunnel_request");
        }
    }

    fn on_message(&mut self, body: Body) {
        match body {
            Body::RegisterResponse(resp) if self.state == SessionState::Registering => {
                if !resp.accepted {
                    let end = match resp.retry_after_ms {
                        0 => SessionEnd::Rejected(resp.reason),
                        ms => SessionEnd::Deferred {
                            reason: resp.reason,
                            retry_after: Duration::from_millis(u64::from(ms)),
                        },
                    };
                    self.close(end);
                    return;
                }
                let payload = match resp.validate() {
                    Ok(()) => resp.config.unwrap_or_default(),
                    Err(err) => {
                        self.close(SessionEnd::InvalidConfig(err));
                        return;
                    }
                };
                if resp.heartbeat_interval_ms > 0 {
                    self.heartbeat_interval =
                        Duration::from_millis(u64::from(resp.heartbeat_interval_ms));
                    self.timers
                        .set(SessionTimer::Ping, self.now + self.heartbeat_interval);
                }
                self.state = SessionState::Configuring;
                self.load_reports = resp.load_reports;
                self.merged_tunnel_frames = resp.merged_tunnel_frames;
                if let Some(members) = resp.cluster.filter(|_| self.config.cluster) {
                    self.events.push_back(SessionEvent::Members(members));
                }
                self.pending_apply = Some(payload.clone());
                self.events.push_back(SessionEvent::ApplyConfig { payload });
            }
            // Unasked, ready=false tells a connection the Edge is dropping why (e.g. a
            // newer connection took the node id over).
            Body::NodeReadyResponse(resp)
                if !resp.ready
                    && matches!(self.state, SessionState::Configuring | SessionState::Ready) =>
            {
                self.close(SessionEnd::ReadyRefused(resp.reason));
            }
            Body::NodeReadyResponse(resp)
                if self.state == SessionState::Configuring && self.ready_sent =>
            {
                if resp.ready {
                    self.state = SessionState::Ready;
                    self.timers.stop(SessionTimer::Handshake);
                    self.events.push_back(SessionEvent::Ready);
                } else {
                    self.close(SessionEnd::ReadyRefused(resp.reason));
                }
            }
            Body::Heartbeat(ping) => self.send(Body::HeartbeatAck(HeartbeatAck {
                nonce: ping.nonce,
                echo_sent_at_ms: ping.sent_at_ms,
            })),
            Body::HeartbeatAck(ack) => {
                if ack.echo_sent_at_ms <= self.now.as_millis() {
                    self.last_rtt = Some(
                        self.now
                            .saturating_duration_since(Timestamp::from_millis(ack.echo_sent_at_ms)),
                    );
                }
            }
            Body::RunRequest(req) if self.state == SessionState::Ready => self.on_run_request(req),
            Body::ProviderTunnelRequest(req) => self.on_tunnel(req.into()),
            Body::CancelRequest(req) if self.state == SessionState::Ready => self.on_cancel(&req),
            Body::NodeCommandRequest(req) if self.state == SessionState::Ready => {
                self.on_command(req)
            }
            Body::NodeConfigRefreshRequest(req) if self.state == SessionState::Ready => {
                self.on_refresh(req);
            }
            Body::ClusterMembers(members)
                if self.config.cluster
                    && matches!(self.state, SessionState::Configuring | SessionState::Ready) =>
            {
                self.events.push_back(SessionEvent::Members(members));
            }
            Body::NodeRehomeRequest(req)
                if self.state == SessionState::Ready && self.config.rehome =>
            {
                if !self.rehomed {
                    self.rehomed = true;
                    self.events
                        .push_back(SessionEvent::Rehome { reason: req.reason });
                }
            }
            other => self.unexpected(other.kind()),
        }
    }

    /// A message the session's state does not admit: a violation that closes it.
    fn unexpected(&mut self, message: &'static str) {
        let violation = EdgeViolation::Unexpected {
            message,
            state: self.state,
        };
        self.events.push_back(SessionEvent::PeerViolation {
            violation: violation.clone(),
        });
        self.close(SessionEnd::ProtocolViolation(violation));
    }

    fn close(&mut self, end: SessionEnd) {
        if self.state == SessionState::Closed {
            return;
        }
        self.state = SessionState::Closed;
        let mut abandoned: Vec<String> = self
            .work
            .drain()
            .map(|(id, _)| String::from(&*id))
            .collect();
        abandoned.sort();
        self.pending_refresh = None;
        self.pending_commands.clear();
        self.draining = false;
        self.cancelling = false;
        self.timers = TimerTable::new();
        self.end = Some(end.clone());
        self.transmits
            .push_back(NodeTransmit::Close { end, abandoned });
    }
}
