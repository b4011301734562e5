//! The node session's public types: its configuration, states, events, errors and the
//! adapter output it accepts.

use super::AdapterDiff;
use crate::gate::GateError;
use crate::reconnect::Failure;
use crate::run::RunViolation;
use crate::tunnel::DEFAULT_CHUNK_SIZE;
use crate::wire::Envelope;
use crate::wire::ErrorDetail;
use crate::wire::Header;
use crate::wire::NodeCommandRequest;
use crate::wire::NodeConfigPayload;
use crate::wire::RunRequest;
use crate::wire::TunnelRequest;
use crate::wire::Usage;
use bytes::Bytes;
use std::collections::BTreeMap;
use std::time::Duration;

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
    /// This process's `RegisterRequest.instance_id`: random, drawn once when the process
    /// starts and the same for every connection it makes, so the Edge can tell the node's
    /// own reconnects and restarts from a second process using its id. 0 sends none.
    pub instance_id: u64,
    /// Register, configure and ready must complete within this time.
    pub handshake_timeout: Duration,
    /// Heartbeat interval until the Edge says otherwise.
    pub heartbeat_interval: Duration,
    /// Edge silence longer than this many heartbeat intervals loses the connection.
    pub heartbeat_timeout_intervals: u32,
    /// Largest `BODY` frame payload.
    pub chunk_size: usize,
    /// How long a local shutdown waits for cancelled work to end in order before the
    /// session closes anyway.
    pub shutdown_grace: Duration,
    /// How long a graceful stop lets the work in flight run to its end before it is
    /// cancelled ([`NodeSession::handle_drain`](super::NodeSession::handle_drain)).
    pub drain_grace: Duration,
    /// Whether this node can re-home (`RegisterRequest.rehome`): when an Edge process
    /// hands over it sends `NodeRehomeRequest`, and the shell keeps this session running
    /// its work to the end while a new one dials ([`SessionEvent::Rehome`]).
    pub rehome: bool,
    /// Whether this node follows a cluster of Edges (`RegisterRequest.cluster`): an Edge
    /// in a cluster then names its members ([`SessionEvent::Members`]), for the shell to
    /// keep a session with each.
    pub cluster: bool,
}

impl std::fmt::Debug for SessionConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionConfig")
            .field("node_id", &self.node_id)
            .field("token", &"<redacted>")
            .field("version", &self.version)
            .field("adapter_types", &self.adapter_types)
            .field("instance_id", &self.instance_id)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .finish_non_exhaustive()
    }
}

impl SessionConfig {
    /// Defaults: 10 s handshake, 5 s heartbeats, 3 missed intervals, 64 KiB chunks, 5 s
    /// for cancelled work to end, 30 s for a graceful stop.
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
            instance_id: 0,
            handshake_timeout: Duration::from_secs(10),
            heartbeat_interval: Duration::from_secs(5),
            heartbeat_timeout_intervals: 3,
            chunk_size: DEFAULT_CHUNK_SIZE,
            shutdown_grace: Duration::from_secs(5),
            drain_grace: Duration::from_secs(30),
            rehome: false,
            cluster: false,
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
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SessionEnd {
    /// The Edge rejected the register (bad token or unknown node): fatal.
    #[error("the edge rejected the node: {0}")]
    Rejected(String),
    /// The Edge refused the register for now (`retry_after_ms` set): retried later.
    #[error("the edge deferred the node: {reason} (retry after {} ms)", retry_after.as_millis())]
    Deferred {
        /// The Edge's reason.
        reason: String,
        /// The earliest retry.
        retry_after: Duration,
    },
    /// The Edge answered `ready=false`.
    #[error("the edge refused readiness: {0}")]
    ReadyRefused(String),
    /// The Edge sent a config that breaks the contract.
    #[error("the config from the edge is invalid: {0}")]
    InvalidConfig(crate::wire::ValidationError),
    /// The config is valid but the node could not start its adapters (the shell's
    /// reason).
    #[error("the config from the edge cannot be applied here: {0}")]
    ConfigNotApplied(String),
    /// Nothing from the Edge within the heartbeat timeout.
    #[error("nothing from the edge within the heartbeat timeout")]
    HeartbeatTimeout,
    /// The handshake did not complete in time.
    #[error("the handshake did not complete in time")]
    HandshakeTimeout,
    /// The transport failed or the Edge closed the connection.
    #[error("{0}")]
    ConnectionLost(Failure),
    /// The Edge broke the protocol.
    #[error("the edge broke the protocol: {0}")]
    ProtocolViolation(EdgeViolation),
    /// Local shutdown.
    #[error("local shutdown")]
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
            SessionEnd::ReadyRefused(why) | SessionEnd::ConfigNotApplied(why) => {
                Some(Failure::EdgeClosed(why.clone()))
            }
            SessionEnd::InvalidConfig(err) => Some(Failure::Protocol(err.to_string())),
            SessionEnd::ProtocolViolation(violation) => {
                Some(Failure::Protocol(violation.to_string()))
            }
            SessionEnd::HeartbeatTimeout | SessionEnd::HandshakeTimeout => Some(Failure::TimedOut),
            SessionEnd::ConnectionLost(failure) => Some(failure.clone()),
            SessionEnd::LocalShutdown => None,
        }
    }
}

/// How the Edge broke the protocol, as the node saw it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EdgeViolation {
    /// A message that has no place in the session's state.
    #[error("unexpected {message} while {state:?}")]
    Unexpected {
        /// The message name.
        message: &'static str,
        /// The state it arrived in.
        state: SessionState,
    },
    /// Bytes that are not a frame of this protocol.
    #[error("undecodable input: {0}")]
    Undecodable(crate::wire::DecodeError),
    /// Work the node cannot answer without corrupting a live run (its run id is in
    /// flight, or empty).
    #[error("{0}")]
    Work(WorkRefusal),
}

/// Why new work was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WorkRefusal {
    /// The request breaks the message contract.
    #[error("invalid request: {0}")]
    Invalid(crate::wire::ValidationError),
    /// A run with this id is already in flight.
    #[error("run id {0:?} is already in flight")]
    Duplicate(String),
    /// No adapter of that name runs on this node.
    #[error("no adapter named {0:?} on this node")]
    UnknownAdapter(String),
    /// The adapter's capacity gate refused it.
    #[error(transparent)]
    Gate(#[from] GateError),
    /// The node is shutting down.
    #[error("the node is shutting down")]
    ShuttingDown,
    /// The Edge told this session to re-home and promised to dispatch nothing more on it.
    #[error("this session was told to re-home: it takes no new work")]
    Rehomed,
}

/// An output to hand to the transport, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum NodeTransmit {
    /// Write this envelope.
    Frame(Envelope),
    /// Flush what was written, then close the connection: the session ended. The shell
    /// cancels the upstream requests of the abandoned runs.
    Close {
        /// Why the session ended; [`SessionEnd::failure`] says how the supervisor counts it.
        end: SessionEnd,
        /// Runs in flight when it ended.
        abandoned: Vec<String>,
    },
}

/// Where a piece of work stands after an output of its adapter was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkStep {
    /// It goes on: more output is expected.
    Going,
    /// That was its terminal: it has left the session (its capacity is free), and the
    /// shell may forget its task.
    Ended,
}

/// What the session made of an adapter task that returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Returned {
    /// Its work had already ended properly.
    Done,
    /// It returned without a terminal: the session ended its work with an
    /// `adapter_error` terminal.
    Unfinished,
}

/// Something the shell must act on. Deliberately exhaustive: a new event is a compile
/// error in every shell until it decides what to do with it.
#[derive(Clone, Debug, PartialEq)]
pub enum SessionEvent {
    /// Apply this config and start its adapters, then call
    /// [`NodeSession::handle_config_applied`](super::NodeSession::handle_config_applied).
    ApplyConfig {
        /// The config from `RegisterResponse`.
        payload: NodeConfigPayload,
    },
    /// The Edge confirmed readiness; work may arrive.
    Ready,
    /// Execute a normalized run (its capacity unit is taken).
    StartRun {
        /// The run to execute on `request.adapter`; report its output with [`NodeSession::handle_run_output`](super::NodeSession::handle_run_output).
        request: RunRequest,
    },
    /// Open a provider tunnel (its capacity unit is taken).
    StartTunnel {
        /// The tunnel to open on `request.adapter()`, read in place from its frame; report
        /// its output with [`NodeSession::handle_tunnel_output`](super::NodeSession::handle_tunnel_output).
        request: TunnelRequest,
        /// Its run id (`request.run_id()`), shared with the session's own record of it.
        run_id: std::sync::Arc<str>,
    },
    /// Abort this run's upstream request; it still ends with a terminal output.
    CancelRun {
        /// The run to abort; it still ends with a terminal output.
        run_id: String,
    },
    /// A cancel named no run this session knows.
    CancelRejected {
        /// The run id named.
        run_id: String,
        /// Why the cancel was ignored.
        error: CancelError,
    },
    /// Answer this command with [`NodeSession::handle_command_response`](super::NodeSession::handle_command_response).
    Command {
        /// The validated request.
        request: NodeCommandRequest,
    },
    /// Apply this refresh, then call [`NodeSession::handle_refresh_applied`](super::NodeSession::handle_refresh_applied).
    RefreshConfig {
        /// Edge request id.
        request_id: String,
        /// The new config.
        payload: NodeConfigPayload,
        /// What changes.
        diff: AdapterDiff,
    },
    /// The Edge process is handing over to a successor (`NodeRehomeRequest`): dial again
    /// at once (the same address reaches the successor) and keep this session running
    /// until the Edge closes it after its last piece of work; report what it holds
    /// ([`NodeSession::load`](super::NodeSession::load)) to the new session with
    /// [`NodeSession::handle_held_elsewhere`](super::NodeSession::handle_held_elsewhere). Nothing new arrives on this session.
    Rehome {
        /// The Edge's reason, for the log.
        reason: String,
    },
    /// The Edges of the cluster this session's Edge belongs to (only when
    /// [`SessionConfig::cluster`] asked): from its `RegisterResponse`, then on every
    /// change. The shell keeps a session with each member other than `edge_id` (this
    /// session's own Edge) and ends the sessions of Edges no longer listed.
    Members(crate::wire::ClusterMembers),
    /// Work was refused at once (unknown adapter or capacity); the Edge was told.
    WorkRefused {
        /// The run refused; the Edge already has its terminal error.
        run_id: String,
        /// Why it was refused.
        reason: WorkRefusal,
    },
    /// The Edge sent something that breaks the protocol (for logs).
    PeerViolation {
        /// What the Edge did wrong.
        violation: EdgeViolation,
    },
}

/// Why a cancel was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CancelError {
    /// The cancel request itself is invalid (empty run id, unknown kind).
    #[error("invalid cancel request: {0}")]
    Invalid(crate::wire::ValidationError),
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
        /// The `handle_*` input refused.
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
        /// The run whose output was refused.
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
    /// Failed: the terminal `ERROR` event with this detail.
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
