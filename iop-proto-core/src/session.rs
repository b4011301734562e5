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
//! - Work (`RunRequest`, `ProviderTunnelRequest`) passes the adapter's [`CapacityGate`];
//!   the shell reports progress with [`NodeSession::handle_run_output`] and
//!   [`NodeSession::handle_tunnel_output`], which number, chunk and check every event
//!   and frame, so the Edge always receives a valid contract sequence.
//! - A cancel affects only the named run; unknown run ids get a typed error; a cancel
//!   after the terminal is a no-op.
//! - A config refresh is validated and diffed per adapter: `FAILED` keeps the old config,
//!   `RESTART_REQUIRED` names what cannot change live, `APPLIED` starts, stops or resizes
//!   adapters. Runs on a removed adapter finish or are cancelled explicitly.
//!
//! [`Supervisor`]: crate::reconnect::Supervisor

use crate::timer::{TimerTable, Wake};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use bytes::Bytes;

use crate::gate::{CapacityGate, GateError};
use crate::reconnect::Failure;
use crate::run::{RunEmitter, RunTracker, RunViolation};
use crate::time::Timestamp;
use crate::tunnel::{DEFAULT_CHUNK_SIZE, TunnelEmitter};
use crate::wire::{
    AdapterConfig, AdapterType, Body, CancelRequest, Envelope, ErrorDetail, Header, Heartbeat,
    HeartbeatAck, NodeCommandRequest, NodeCommandResponse, NodeConfigPayload,
    NodeConfigRefreshRequest, NodeConfigRefreshResponse, NodeReadyRequest, ProviderTunnelFrame,
    ProviderTunnelRequest, RefreshStatus, RegisterRequest, RunEventType, RunRequest, Usage,
    Validate,
};

/// What a node presents to the Edge and how patient it is.
#[derive(Clone)]
pub struct SessionConfig {
    /// Node identity.
    pub node_id: String,
    /// Credential; never printed.
    pub token: String,
    /// Software version reported at register.
    pub version: String,
    /// Adapter types this binary can run.
    pub adapter_types: Vec<String>,
    /// Informational labels.
    pub labels: BTreeMap<String, String>,
    /// Register, configure and ready must complete within this time.
    pub handshake_timeout: Duration,
    /// Heartbeat interval until the Edge says otherwise.
    pub heartbeat_interval: Duration,
    /// Edge silence longer than this many heartbeat intervals loses the connection.
    pub heartbeat_timeout_intervals: u32,
    /// Largest `BODY` frame payload.
    pub chunk_size: usize,
}

impl std::fmt::Debug for SessionConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionConfig")
            .field("node_id", &self.node_id)
            .field("token", &"<redacted>")
            .field("version", &self.version)
            .field("adapter_types", &self.adapter_types)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .finish_non_exhaustive()
    }
}

impl SessionConfig {
    /// Defaults: 10 s handshake, 5 s heartbeats, 3 missed intervals, 64 KiB chunks.
    #[must_use]
    pub fn new(node_id: impl Into<String>, token: impl Into<String>) -> Self {
        SessionConfig {
            node_id: node_id.into(),
            token: token.into(),
            version: String::new(),
            adapter_types: ["openai_compat", "vllm", "ollama", "mock"]
                .map(String::from)
                .to_vec(),
            labels: BTreeMap::new(),
            handshake_timeout: Duration::from_secs(10),
            heartbeat_interval: Duration::from_secs(5),
            heartbeat_timeout_intervals: 3,
            chunk_size: DEFAULT_CHUNK_SIZE,
        }
    }
}

/// Where the session is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionState {
    /// Waiting for the transport to connect.
    Connecting,
    /// `RegisterRequest` sent.
    Registering,
    /// Accepted; applying config, then awaiting the ready answer.
    Configuring,
    /// Dispatch-ready.
    Ready,
    /// Over; see [`SessionEnd`].
    Closed,
}

/// Why a session ended.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SessionEnd {
    /// The Edge rejected the register (bad token or unknown node): fatal.
    Rejected(String),
    /// The Edge refused the register for now (`retry_after_ms` set): retried later.
    Deferred {
        /// The Edge's reason.
        reason: String,
        /// The earliest retry.
        retry_after: Duration,
    },
    /// The Edge answered `ready=false`.
    ReadyRefused(String),
    /// The Edge sent a config this node cannot apply.
    InvalidConfig(String),
    /// Nothing from the Edge within the heartbeat timeout.
    HeartbeatTimeout,
    /// The handshake did not complete in time.
    HandshakeTimeout,
    /// The transport failed or the Edge closed the connection.
    ConnectionLost(Failure),
    /// The Edge broke the protocol.
    ProtocolViolation(String),
    /// Local shutdown.
    LocalShutdown,
}

impl SessionEnd {
    /// How the supervisor should treat this end (`None` for local shutdown).
    #[must_use]
    pub fn failure(&self) -> Option<Failure> {
        match self {
            SessionEnd::Rejected(why) => Some(Failure::CredentialRejected(why.clone())),
            SessionEnd::Deferred {
                reason,
                retry_after,
            } => Some(Failure::Deferred {
                reason: reason.clone(),
                retry_after: *retry_after,
            }),
            SessionEnd::ReadyRefused(why)
            | SessionEnd::InvalidConfig(why)
            | SessionEnd::ProtocolViolation(why) => Some(Failure::EdgeClosed(why.clone())),
            SessionEnd::HeartbeatTimeout | SessionEnd::HandshakeTimeout => Some(Failure::TimedOut),
            SessionEnd::ConnectionLost(failure) => Some(failure.clone()),
            SessionEnd::LocalShutdown => None,
        }
    }
}

/// Per-adapter change between two payloads. Only enabled adapters count as active.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdapterDiff {
    /// Newly active adapters.
    pub added: Vec<String>,
    /// Adapters no longer active (removed or disabled).
    pub removed: Vec<String>,
    /// Active in both, configuration changed (applies live).
    pub changed: Vec<String>,
    /// Changes that cannot apply live, each explained.
    pub restart_required: Vec<String>,
}

impl AdapterDiff {
    /// True when nothing changes.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.added.is_empty()
            && self.removed.is_empty()
            && self.changed.is_empty()
            && self.restart_required.is_empty()
    }
}

/// Compares two payloads adapter by adapter. Changing the type of a named instance cannot
/// apply live (work of the old kind may be in flight on it): it requires a restart.
#[must_use]
pub fn diff_adapters(old: &NodeConfigPayload, new: &NodeConfigPayload) -> AdapterDiff {
    let active = |p: &NodeConfigPayload| -> BTreeMap<String, AdapterConfig> {
        p.adapters
            .iter()
            .filter(|a| a.enabled)
            .map(|a| (a.instance_name().to_owned(), a.clone()))
            .collect()
    };
    let (old_set, new_set) = (active(old), active(new));
    let mut diff = AdapterDiff::default();
    for (name, adapter) in &new_set {
        match old_set.get(name) {
            None => diff.added.push(name.clone()),
            Some(before) if before.r#type != adapter.r#type => {
                let kind =
                    |t: i32| AdapterType::try_from(t).map_or("unknown", AdapterType::config_name);
                diff.restart_required.push(format!(
                    "adapter {name:?} changes type from {} to {}",
                    kind(before.r#type),
                    kind(adapter.r#type)
                ));
            }
            Some(before) if before != adapter => diff.changed.push(name.clone()),
            Some(_) => {}
        }
    }
    diff.removed = old_set
        .keys()
        .filter(|name| !new_set.contains_key(*name))
        .cloned()
        .collect();
    diff
}

/// Something the shell must act on.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum SessionEvent {
    /// Apply this config and start its adapters, then call
    /// [`NodeSession::handle_config_applied`].
    ApplyConfig {
        /// The config from `RegisterResponse`.
        payload: NodeConfigPayload,
    },
    /// The Edge confirmed readiness; work may arrive.
    Ready,
    /// Execute a normalized run (its capacity unit is taken).
    StartRun {
        /// The request.
        request: RunRequest,
    },
    /// Open a provider tunnel (its capacity unit is taken).
    StartTunnel {
        /// The request.
        request: ProviderTunnelRequest,
    },
    /// Abort this run's upstream request; it still ends with a terminal output.
    CancelRun {
        /// The run.
        run_id: String,
    },
    /// A cancel named no run this session knows.
    CancelRejected {
        /// The run id named.
        run_id: String,
        /// Why.
        error: CancelError,
    },
    /// Answer this command with [`NodeSession::handle_command_response`].
    Command {
        /// The validated request.
        request: NodeCommandRequest,
    },
    /// Apply this refresh, then call [`NodeSession::handle_refresh_applied`].
    RefreshConfig {
        /// Edge request id.
        request_id: String,
        /// The new config.
        payload: NodeConfigPayload,
        /// What changes.
        diff: AdapterDiff,
    },
    /// Work was refused at once (unknown adapter or capacity); the Edge was told.
    WorkRefused {
        /// The run.
        run_id: String,
        /// Why.
        reason: String,
    },
    /// The Edge sent something that breaks the protocol (for logs).
    PeerViolation {
        /// What.
        detail: String,
    },
    /// The session ended; cancel the abandoned runs' upstream requests.
    Closed {
        /// Why.
        end: SessionEnd,
        /// Runs in flight when it ended.
        abandoned: Vec<String>,
    },
}

/// Why a cancel was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CancelError {
    /// The cancel request itself is invalid (empty run id, unknown kind).
    #[error("invalid cancel request: {0}")]
    Invalid(String),
    /// No run with that id is known to this session.
    #[error("no run with this id is known")]
    UnknownRun,
}

/// Misuse of the session by its driver.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SessionError {
    /// The input does not fit the session's state.
    #[error("{input} is invalid while {state:?}")]
    WrongState {
        /// The input.
        input: &'static str,
        /// The session state.
        state: SessionState,
    },
    /// Output for a run that is not in flight (never started, or already ended).
    #[error("run {0:?} is not in flight")]
    UnknownRun(String),
    /// Output that would break the run's contract sequence; nothing was sent.
    #[error("run {run_id:?}: {violation}")]
    InvalidRunOutput {
        /// The run.
        run_id: String,
        /// What it would break.
        violation: RunViolation,
    },
    /// Tunnel output out of order (e.g. body before status, anything after the end).
    #[error("tunnel {0:?}: output out of contract order")]
    InvalidTunnelOutput(String),
    /// Output of the wrong kind (run output for a tunnel or the reverse).
    #[error("{0:?} is a different kind of work")]
    WrongKind(String),
    /// An answer to a refresh or command that is not pending.
    #[error("no pending request {0:?}")]
    NotPending(String),
}

/// Progress of a normalized run, reported by the shell.
#[derive(Clone, Debug, PartialEq)]
pub enum RunOutput {
    /// The run started.
    Start,
    /// Generated text.
    Delta(String),
    /// Finished; usage and metadata (`openai_tool_calls`, `openai_text_tool_fallback`).
    Complete {
        /// Token usage.
        usage: Option<Usage>,
        /// Metadata for the Edge.
        metadata: BTreeMap<String, String>,
    },
    /// Failed.
    Error(ErrorDetail),
    /// Cancelled.
    Cancelled,
}

/// Progress of a provider tunnel, reported by the shell.
#[derive(Clone, Debug, PartialEq)]
pub enum TunnelOutput {
    /// Status line and headers.
    Status {
        /// HTTP status.
        status: u32,
        /// Response headers.
        headers: Vec<Header>,
    },
    /// Body bytes as they arrived (split into chunks by the session).
    Body(Bytes),
    /// Trailers.
    Trailers(Vec<Header>),
    /// Usage observed in the response.
    Usage(Usage),
    /// The body is complete.
    End,
    /// The request failed or was cancelled.
    Error(ErrorDetail),
}

#[derive(Debug)]
enum WorkKind {
    Run(RunEmitter, RunTracker),
    Tunnel(TunnelEmitter),
}

#[derive(Debug)]
struct Work {
    adapter: String,
    long: bool,
    kind: WorkKind,
    cancel_requested: bool,
}

/// Remembered ids of finished runs (so a late cancel is a no-op, not an error).
const FINISHED_MEMORY: usize = 4096;

/// The session's timers (liveness is derived from the last receive instead).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum SessionTimer {
    /// Register, configure and ready must be done by this.
    Handshake,
    /// Send a heartbeat.
    Ping,
}

impl crate::timer::TimerKey for SessionTimer {
    fn reason(&self) -> &'static str {
        match self {
            SessionTimer::Handshake => "handshake",
            SessionTimer::Ping => "ping",
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
    pending_commands: HashSet<String>,
    gates: HashMap<String, CapacityGate>,
    work: HashMap<String, Work>,
    finished: VecDeque<String>,
    finished_set: HashSet<String>,
    transmits: VecDeque<Envelope>,
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
            pending_commands: HashSet::new(),
            gates: HashMap::new(),
            work: HashMap::new(),
            finished: VecDeque::new(),
            finished_set: HashSet::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            end: None,
        }
    }

    // ----- getters -----

    /// Current state.
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

    /// The capacity gate of an adapter instance.
    #[must_use]
    pub fn gate(&self, adapter: &str) -> Option<&CapacityGate> {
        self.gates.get(adapter)
    }

    /// Runs and tunnels in flight.
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.work.len()
    }

    // ----- outputs -----

    /// The next envelope to write.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Envelope> {
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

    // ----- inputs -----

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
        self.transmits.push_back(Envelope::new(body));
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
                self.send(Body::NodeReadyRequest(NodeReadyRequest {
                    node_id: self.config.node_id.clone(),
                }));
            }
            Err(why) => self.close(SessionEnd::InvalidConfig(why)),
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
    pub fn handle_connection_lost(&mut self, now: Timestamp, failure: Failure) {
        self.advance(now);
        self.close(SessionEnd::ConnectionLost(failure));
    }

    /// Local shutdown.
    pub fn handle_shutdown(&mut self, now: Timestamp) {
        self.advance(now);
        self.close(SessionEnd::LocalShutdown);
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

    /// An envelope decoded from the Edge.
    pub fn handle_envelope(&mut self, now: Timestamp, envelope: Envelope) {
        self.advance(now);
        if matches!(self.state, SessionState::Connecting | SessionState::Closed) {
            return;
        }
        self.last_rx = self.now;
        let Some(body) = envelope.body else {
            return;
        };
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
                        self.close(SessionEnd::InvalidConfig(err.to_string()));
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
            Body::ProviderTunnelRequest(req) if self.state == SessionState::Ready => {
                self.on_tunnel_request(req);
            }
            Body::CancelRequest(req) if self.state == SessionState::Ready => self.on_cancel(&req),
            Body::NodeCommandRequest(req) if self.state == SessionState::Ready => {
                self.on_command(req)
            }
            Body::NodeConfigRefreshRequest(req) if self.state == SessionState::Ready => {
                self.on_refresh(req);
            }
            other => {
                let detail = format!("unexpected {} while {:?}", other.kind(), self.state);
                self.events.push_back(SessionEvent::PeerViolation {
                    detail: detail.clone(),
                });
                self.close(SessionEnd::ProtocolViolation(detail));
            }
        }
    }

    /// Progress of a run, from the adapter. Numbered, checked and sent.
    pub fn handle_run_output(
        &mut self,
        now: Timestamp,
        run_id: &str,
        output: RunOutput,
    ) -> Result<(), SessionError> {
        self.advance(now);
        let work = self.work_in_flight(run_id, "run output")?;
        let WorkKind::Run(emitter, tracker) = &mut work.kind else {
            return Err(SessionError::WrongKind(run_id.to_owned()));
        };
        let kind = match &output {
            RunOutput::Start => RunEventType::Start,
            RunOutput::Delta(_) => RunEventType::Delta,
            RunOutput::Complete { .. } => RunEventType::Complete,
            RunOutput::Error(_) => RunEventType::Error,
            RunOutput::Cancelled => RunEventType::Cancelled,
        };
        // Check against a copy first so a refused output consumes nothing.
        let mut probe_emitter = emitter.clone();
        let mut probe_tracker = tracker.clone();
        let Some(mut event) = probe_emitter.next(kind) else {
            return Err(SessionError::UnknownRun(run_id.to_owned()));
        };
        probe_tracker
            .observe(&event)
            .map_err(|violation| SessionError::InvalidRunOutput {
                run_id: run_id.to_owned(),
                violation,
            })?;
        *emitter = probe_emitter;
        *tracker = probe_tracker;
        match output {
            RunOutput::Delta(text) => event.delta = text,
            RunOutput::Complete { usage, metadata } => {
                event.usage = usage;
                event.metadata = metadata;
            }
            RunOutput::Error(error) => event.error = Some(error),
            RunOutput::Start | RunOutput::Cancelled => {}
        }
        let ended = tracker.is_ended();
        self.send(Body::RunEvent(event));
        if ended {
            self.finish(run_id);
        }
        Ok(())
    }

    /// Progress of a tunnel, from the adapter. Numbered, chunked, checked and sent.
    pub fn handle_tunnel_output(
        &mut self,
        now: Timestamp,
        run_id: &str,
        output: TunnelOutput,
    ) -> Result<(), SessionError> {
        self.advance(now);
        let work = self.work_in_flight(run_id, "tunnel output")?;
        let WorkKind::Tunnel(emitter) = &mut work.kind else {
            return Err(SessionError::WrongKind(run_id.to_owned()));
        };
        let frames: Vec<ProviderTunnelFrame> = match output {
            TunnelOutput::Status { status, headers } => {
                emitter.status(status, headers).into_iter().collect()
            }
            TunnelOutput::Body(data) if data.is_empty() => return Ok(()),
            TunnelOutput::Body(data) => emitter.body(data),
            TunnelOutput::Trailers(headers) => emitter.headers(headers).into_iter().collect(),
            TunnelOutput::Usage(usage) => emitter.usage(usage).into_iter().collect(),
            TunnelOutput::End => emitter.end().into_iter().collect(),
            TunnelOutput::Error(error) => emitter.error(error).into_iter().collect(),
        };
        if frames.is_empty() {
            return Err(SessionError::InvalidTunnelOutput(run_id.to_owned()));
        }
        let ended = emitter.is_ended();
        for frame in frames {
            self.send(Body::ProviderTunnelFrame(frame));
        }
        if ended {
            self.finish(run_id);
        }
        Ok(())
    }

    /// The adapter task for `run_id` returned. Work it left without a terminal ends here
    /// with an `adapter_error` terminal, so its capacity is never stranded and the Edge
    /// still receives a complete sequence. Returns whether that was needed.
    pub fn handle_work_returned(&mut self, now: Timestamp, run_id: &str) -> bool {
        let tunnel = match self.work.get(run_id).map(|w| &w.kind) {
            None => return false,
            Some(WorkKind::Tunnel(_)) => true,
            Some(WorkKind::Run(..)) => false,
        };
        let detail = ErrorDetail {
            code: "adapter_error".into(),
            message: "adapter ended without a terminal event".into(),
            retryable: true,
        };
        if tunnel {
            self.handle_tunnel_output(now, run_id, TunnelOutput::Error(detail))
                .is_ok()
        } else {
            // A run that never started must start before it can end.
            let _ = self.handle_run_output(now, run_id, RunOutput::Start);
            self.handle_run_output(now, run_id, RunOutput::Error(detail))
                .is_ok()
        }
    }

    // ----- internals -----

    /// The work `run_id` while the session is open and the work has not ended.
    fn work_in_flight(
        &mut self,
        run_id: &str,
        input: &'static str,
    ) -> Result<&mut Work, SessionError> {
        if self.state == SessionState::Closed {
            return Err(self.wrong_state(input));
        }
        self.work
            .get_mut(run_id)
            .ok_or_else(|| SessionError::UnknownRun(run_id.to_owned()))
    }

    fn applied_revision(&self) -> u64 {
        self.applied.as_ref().map_or(0, |p| p.revision)
    }

    fn close(&mut self, end: SessionEnd) {
        if self.state == SessionState::Closed {
            return;
        }
        self.state = SessionState::Closed;
        let mut abandoned: Vec<String> = self.work.drain().map(|(id, _)| id).collect();
        abandoned.sort();
        self.pending_refresh = None;
        self.pending_commands.clear();
        self.end = Some(end.clone());
        self.events
            .push_back(SessionEvent::Closed { end, abandoned });
    }

    /// Creates, resizes or closes gates after a config takes effect.
    fn install_gates(&mut self, payload: &NodeConfigPayload, diff: &AdapterDiff) {
        for adapter in payload.adapters.iter().filter(|a| a.enabled) {
            let name = adapter.instance_name();
            if diff.added.iter().any(|n| n == name) || diff.changed.iter().any(|n| n == name) {
                match self.gates.get_mut(name) {
                    Some(gate) => gate.resize(adapter.capacity, adapter.long_capacity),
                    None => {
                        self.gates.insert(
                            name.to_owned(),
                            CapacityGate::new(adapter.capacity, adapter.long_capacity),
                        );
                    }
                }
            }
        }
        for name in &diff.removed {
            if let Some(gate) = self.gates.get_mut(name) {
                gate.close();
            }
        }
    }

    fn finish(&mut self, run_id: &str) {
        let Some(work) = self.work.remove(run_id) else {
            return;
        };
        if let Some(gate) = self.gates.get_mut(&work.adapter) {
            gate.release(work.long);
        }
        if self.finished.len() >= FINISHED_MEMORY
            && let Some(old) = self.finished.pop_front()
        {
            self.finished_set.remove(&old);
        }
        self.finished.push_back(run_id.to_owned());
        self.finished_set.insert(run_id.to_owned());
    }

    /// Takes a capacity unit for new work, or explains the refusal.
    fn admit(&mut self, run_id: &str, adapter: &str, long: bool) -> Result<(), String> {
        if self.work.contains_key(run_id) {
            return Err(format!("run id {run_id:?} is already in flight"));
        }
        let gate = self
            .gates
            .get_mut(adapter)
            .ok_or_else(|| format!("no adapter named {adapter:?} on this node"))?;
        gate.try_acquire(long)
            .map_err(|err: GateError| err.to_string())
    }

    fn on_run_request(&mut self, request: RunRequest) {
        let run_id = request.run_id.clone();
        let admitted = request
            .validate()
            .map_err(|e| e.to_string())
            .and_then(|()| self.admit(&run_id, &request.adapter, request.long_context));
        match admitted {
            Ok(()) => {
                self.work.insert(
                    run_id,
                    Work {
                        adapter: request.adapter.clone(),
                        long: request.long_context,
                        kind: WorkKind::Run(
                            RunEmitter::new(request.run_id.clone()),
                            RunTracker::new(),
                        ),
                        cancel_requested: false,
                    },
                );
                self.events.push_back(SessionEvent::StartRun { request });
            }
            Err(reason) if self.work.contains_key(&run_id) || run_id.is_empty() => {
                // Answering would corrupt the live run's stream (or has no run to name).
                self.events
                    .push_back(SessionEvent::PeerViolation { detail: reason });
            }
            Err(reason) => {
                let mut emitter = RunEmitter::new(run_id.clone());
                if let Some(start) = emitter.next(RunEventType::Start) {
                    self.send(Body::RunEvent(start));
                }
                if let Some(mut error) = emitter.next(RunEventType::Error) {
                    error.error = Some(ErrorDetail {
                        code: "refused".into(),
                        message: reason.clone(),
                        retryable: true,
                    });
                    self.send(Body::RunEvent(error));
                }
                self.events
                    .push_back(SessionEvent::WorkRefused { run_id, reason });
            }
        }
    }

    fn on_tunnel_request(&mut self, request: ProviderTunnelRequest) {
        let run_id = request.run_id.clone();
        let admitted = request
            .validate()
            .map_err(|e| e.to_string())
            .and_then(|()| self.admit(&run_id, &request.adapter, request.long_context));
        match admitted {
            Ok(()) => {
                self.work.insert(
                    run_id.clone(),
                    Work {
                        adapter: request.adapter.clone(),
                        long: request.long_context,
                        kind: WorkKind::Tunnel(TunnelEmitter::new(run_id, self.config.chunk_size)),
                        cancel_requested: false,
                    },
                );
                self.events.push_back(SessionEvent::StartTunnel { request });
            }
            Err(reason) if self.work.contains_key(&run_id) || run_id.is_empty() => {
                self.events
                    .push_back(SessionEvent::PeerViolation { detail: reason });
            }
            Err(reason) => {
                let mut emitter = TunnelEmitter::new(run_id.clone(), self.config.chunk_size);
                if let Some(frame) = emitter.error(ErrorDetail {
                    code: "refused".into(),
                    message: reason.clone(),
                    retryable: true,
                }) {
                    self.send(Body::ProviderTunnelFrame(frame));
                }
                self.events
                    .push_back(SessionEvent::WorkRefused { run_id, reason });
            }
        }
    }

    fn on_cancel(&mut self, request: &CancelRequest) {
        if let Err(err) = request.validate() {
            self.events.push_back(SessionEvent::CancelRejected {
                run_id: request.run_id.clone(),
                error: CancelError::Invalid(err.to_string()),
            });
            return;
        }
        // Both kinds cancel exactly the named run: the node keeps no session state.
        match self.work.get_mut(&request.run_id) {
            Some(work) if !work.cancel_requested => {
                work.cancel_requested = true;
                self.events.push_back(SessionEvent::CancelRun {
                    run_id: request.run_id.clone(),
                });
            }
            Some(_) => {}
            None if self.finished_set.contains(&request.run_id) => {}
            None => self.events.push_back(SessionEvent::CancelRejected {
                run_id: request.run_id.clone(),
                error: CancelError::UnknownRun,
            }),
        }
    }

    fn on_command(&mut self, request: NodeCommandRequest) {
        match request.validate() {
            Ok(()) => {
                self.pending_commands.insert(request.request_id.clone());
                self.events.push_back(SessionEvent::Command { request });
            }
            Err(err) => self.send(Body::NodeCommandResponse(NodeCommandResponse {
                request_id: request.request_id,
                ok: false,
                error: err.to_string(),
                payload: Bytes::new(),
            })),
        }
    }

    fn on_refresh(&mut self, request: NodeConfigRefreshRequest) {
        let revision = self.applied_revision();
        let respond = |status: RefreshStatus, message: String| {
            Body::NodeConfigRefreshResponse(NodeConfigRefreshResponse {
                request_id: request.request_id.clone(),
                status: status as i32,
                message,
                revision,
            })
        };
        if let Err(err) = request.validate() {
            let body = respond(
                RefreshStatus::Failed,
                format!("invalid config: {err}; the previous config stays in force"),
            );
            self.send(body);
            return;
        }
        if self.pending_refresh.is_some() {
            let body = respond(
                RefreshStatus::Failed,
                "another refresh is being applied".into(),
            );
            self.send(body);
            return;
        }
        let payload = request.config.clone().unwrap_or_default();
        let diff = diff_adapters(
            self.applied
                .as_ref()
                .unwrap_or(&NodeConfigPayload::default()),
            &payload,
        );
        if !diff.restart_required.is_empty() {
            let body = respond(
                RefreshStatus::RestartRequired,
                format!(
                    "{}; the previous config stays in force until the node restarts",
                    diff.restart_required.join("; ")
                ),
            );
            self.send(body);
            return;
        }
        self.pending_refresh = Some((request.request_id.clone(), payload.clone()));
        self.events.push_back(SessionEvent::RefreshConfig {
            request_id: request.request_id,
            payload,
            diff,
        });
    }
}
