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

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::edge_config::{EdgeConfig, EdgeConfigError, category_of};
use crate::guard::{AuthThrottle, Contest, FlapGuard, PendingConnections, Source};
use crate::idhash::IdMap;
use crate::lease::{Generation, Lease, Ledger, Release, RequestId, ResourceId};
use crate::queue::{Candidate, Ticket, WaitQueue, Waiter};
use crate::run::{RunStep, RunTracker};
use crate::time::Timestamp;
use crate::token::TokenVerifier;
use crate::tunnel::{TunnelReceiver, TunnelStep};
use crate::wire::{
    AdapterConfig, AdapterType, Body, CancelKind, CancelRequest, Envelope, ErrorDetail, Heartbeat,
    HeartbeatAck, NodeCommandResponse, NodeConfigRefreshRequest, NodeConfigRefreshResponse,
    NodeReadyRequest, NodeReadyResponse, ProviderHealth, ProviderSnapshot, ProviderStatus,
    ProviderTunnelFrame, ProviderTunnelRequest, RefreshStatus, RegisterRequest, RegisterResponse,
    RunEvent, RunEventType, RunRequest, TunnelFrameKind, Validate,
};

/// Opaque identifier of a node connection, chosen by the shell.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnId(pub u64);

/// What the transport knows about a node connection's peer, given when it opens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Peer {
    /// The remote address. Failed registrations are throttled per source address;
    /// `None` when the transport has none (all such connections share one budget).
    pub addr: Option<IpAddr>,
    /// The negotiated TLS version (e.g. `"TLSv1.3"`); `None` on a plaintext connection.
    pub tls: Option<&'static str>,
    /// Names the peer's verified client certificate vouches for (its subject common name
    /// and DNS subject alternative names); empty without a client certificate. With
    /// [`Admission::require_client_identity`](crate::edge_config::Admission) a node may
    /// only register under one of these names.
    pub identities: Vec<String>,
}

/// The one rejection reason a failed registration gets on the wire, whatever failed
/// (unknown node id, wrong token, certificate for another node, back-off), so a peer
/// cannot tell node ids from tokens. The Edge's own logs get the real [`RejectReason`].
pub const AUTH_FAILED: &str = "authentication failed";

/// Why a registration was refused (for the Edge's logs and metrics only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RejectReason {
    /// No configured node has the claimed id.
    UnknownNode,
    /// The token is not the node's.
    BadToken,
    /// Mutual TLS is required and the client certificate does not name the node id.
    IdentityMismatch,
    /// The source failed too often and is backing off; credentials were not checked.
    Throttled,
    /// Authenticated, but the node id is in conflict and held by another connection.
    Conflict,
}

impl RejectReason {
    /// A stable name for logs and metric labels.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::UnknownNode => "unknown_node",
            RejectReason::BadToken => "bad_token",
            RejectReason::IdentityMismatch => "identity_mismatch",
            RejectReason::Throttled => "throttled",
            RejectReason::Conflict => "conflict",
        }
    }
}

/// Why the Edge closes a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CloseReason {
    /// Unknown node id or bad token.
    RegisterRejected(String),
    /// No register, or no ready, within the register timeout.
    HandshakeTimeout,
    /// A ready from a connection that is not the node's current owner.
    ReadyRefused,
    /// A newer connection registered for the same node id.
    Superseded,
    /// Nothing received within the heartbeat timeout.
    HeartbeatTimeout,
    /// The peer broke the protocol.
    ProtocolViolation(String),
    /// The node was removed from the configuration.
    NodeRemoved,
    /// The node's token changed in the configuration: the connection that registered
    /// with the old one is revoked.
    CredentialsChanged,
    /// Too many connections have not registered yet (in all, or from this source).
    TooManyPending,
    /// The node could not apply its configuration (a refresh answered `FAILED` or
    /// `RESTART_REQUIRED`, or went unanswered three times): once its work drained, it is
    /// closed so that it registers again and takes the configuration afresh.
    RefreshFailed(String),
    /// The peer closed the connection (reported by the shell).
    PeerClosed,
}

/// An output to hand to the transport, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Transmit {
    /// Write this envelope on the connection.
    Frame {
        /// Target connection.
        conn: ConnId,
        /// The message.
        envelope: Envelope,
    },
    /// From now on accept frames of up to `max_frame_len` bytes on the connection.
    /// Connections start at [`Admission::pending_frame_len`](crate::edge_config::Admission)
    /// (the shell's decoder begins there); the limit rises to the full one just before the
    /// frame that accepts the register, so it is in force before the node can use it.
    FrameLimit {
        /// The connection.
        conn: ConnId,
        /// The new limit.
        max_frame_len: usize,
    },
    /// Flush what was written, then close the connection.
    Close {
        /// Connection to close.
        conn: ConnId,
        /// Why.
        reason: CloseReason,
    },
}

/// Which message a granted request must be dispatched as. Decided by the provider's
/// adapter type, never by the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DispatchShape {
    /// Raw HTTP tunnel (`openai_compat`, `vllm`).
    Tunnel,
    /// Normalized run (`ollama`, `mock`).
    Run,
}

impl DispatchShape {
    /// The shape an adapter instance is served with: its `dispatch` option (`run` or
    /// `tunnel`) when set, else its type's default.
    #[must_use]
    pub fn for_adapter(adapter: &AdapterConfig) -> Self {
        match adapter.options.get("dispatch").map(String::as_str) {
            Some("run") => DispatchShape::Run,
            Some("tunnel") => DispatchShape::Tunnel,
            _ => Self::of(AdapterType::try_from(adapter.r#type).unwrap_or_default()),
        }
    }

    /// The shape an adapter type is served with by default.
    #[must_use]
    pub fn of(kind: AdapterType) -> Self {
        match kind {
            AdapterType::OpenaiCompat | AdapterType::Vllm => DispatchShape::Tunnel,
            AdapterType::Ollama | AdapterType::Mock | AdapterType::Unspecified => {
                DispatchShape::Run
            }
        }
    }
}

/// A lease granted to a request: where and how to dispatch it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The request.
    pub request: RequestId,
    /// The lease it holds.
    pub lease: Lease,
    /// Public model name requested.
    pub model: Arc<str>,
    /// Node chosen.
    pub node_id: Arc<str>,
    /// Adapter instance chosen.
    pub provider_id: Arc<str>,
    /// Provider-side target to put in the request.
    pub target: Arc<str>,
    /// Message to dispatch.
    pub shape: DispatchShape,
}

/// Why a request failed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RequestError {
    /// The node serving it disconnected or was fenced.
    NodeLost {
        /// The node.
        node_id: Arc<str>,
    },
    /// The node's stream for it broke the contract.
    Violation(String),
    /// The provider or node reported an error (`ERROR` event or frame).
    Provider(ErrorDetail),
    /// The request needs a tunnel-served provider (embeddings, completions) and none of
    /// its model's candidates is one any more: a configuration refresh changed their
    /// adapters while it waited.
    Unsupported(String),
}

/// How a request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// `COMPLETE` or `END`.
    Completed,
    /// Failed.
    Failed(RequestError),
    /// Cancelled by the caller, or `CANCELLED` from the node.
    Cancelled,
    /// No capacity within the queue wait timeout.
    Expired,
}

/// Something the shell should know about.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum EdgeEvent {
    /// A node completed its ready handshake (exactly once per generation).
    NodeConnected {
        /// Node id.
        node_id: Arc<str>,
        /// Its connection generation.
        generation: Generation,
    },
    /// A ready node's generation was fenced.
    NodeDisconnected {
        /// Node id.
        node_id: Arc<str>,
        /// The fenced generation.
        generation: Generation,
        /// Why.
        reason: CloseReason,
        /// Requests that were running on it; each also gets `RequestEnded(NodeLost)`.
        lost: Vec<RequestId>,
    },
    /// A request holds a lease and must now be dispatched with
    /// [`EdgeCore::handle_dispatch`].
    Granted(Grant),
    /// A valid, in-order event of a dispatched run.
    RunEvent {
        /// The request.
        request: RequestId,
        /// The event.
        event: RunEvent,
    },
    /// A valid, in-order frame of a dispatched tunnel.
    TunnelFrame {
        /// The request.
        request: RequestId,
        /// The frame.
        frame: ProviderTunnelFrame,
    },
    /// A request ended; emitted exactly once per accepted request.
    RequestEnded {
        /// The request.
        request: RequestId,
        /// How.
        outcome: Outcome,
    },
    /// A node answered a config refresh.
    RefreshAnswered {
        /// Node id.
        node_id: Arc<str>,
        /// Outcome.
        status: RefreshStatus,
        /// Details from the node.
        message: String,
        /// Revision in force on the node.
        revision: u64,
    },
    /// A node did not answer a config refresh in time.
    RefreshTimedOut {
        /// Node id.
        node_id: Arc<str>,
        /// Revision that was pushed.
        revision: u64,
        /// Whether the refresh is sent again (else the node is drained).
        retrying: bool,
    },
    /// A node could not take its configuration: it gets no new work and is closed once
    /// its last lease returns, so that it registers again with the configuration.
    NodeDraining {
        /// Node id.
        node_id: Arc<str>,
        /// Why.
        reason: String,
        /// Leases still held on it.
        in_flight: u32,
    },
    /// A node answered a command, or the command failed (node lost, timed out: then
    /// `ok` is false and `error` says why).
    CommandAnswered {
        /// Node id.
        node_id: Arc<str>,
        /// The answer.
        response: NodeCommandResponse,
    },
    /// A registration was refused (the peer got [`AUTH_FAILED`], or a conflict reason).
    /// Emitted for every refusal, for metrics; `log` says whether it is worth a log line
    /// (the 1st, 2nd, 4th, 8th… failure of a source, the start of its back-off, every
    /// conflict refusal), so an attack cannot flood the log.
    RegisterRejected {
        /// Connection.
        conn: ConnId,
        /// The peer's address, when known.
        addr: Option<IpAddr>,
        /// The node id claimed (at most 64 characters of it).
        node_id: String,
        /// Why.
        reason: RejectReason,
        /// Failures of this source since it was last quiet.
        failures: u32,
        /// The back-off this failure started or extended.
        blocked_for: Option<Duration>,
        /// Whether to log it.
        log: bool,
    },
    /// Two live connections took a node id from each other too often: the node id is now
    /// in conflict (emitted once per conflict; log it loudly). The current owner keeps
    /// the node, newcomers are refused for `hold_down` after the last one tried.
    NodeConflict {
        /// Node id.
        node_id: Arc<str>,
        /// Supersedes seen within the detection window.
        supersedes: u32,
        /// How long newcomers are held off.
        hold_down: Duration,
    },
    /// A new connection was closed at once: too many connections have not registered
    /// yet, in all or from its source. `log` is set for the 1st, 2nd, 4th, 8th… refusal.
    ConnectionRefused {
        /// Connection.
        conn: ConnId,
        /// The peer's address, when known.
        addr: Option<IpAddr>,
        /// Connections pending in all.
        pending: usize,
        /// Refusals so far.
        refused: u64,
        /// Whether to log it.
        log: bool,
    },
    /// A peer broke the protocol (for logs and metrics; the machine already acted).
    PeerViolation {
        /// Connection.
        conn: ConnId,
        /// Node, when known.
        node_id: Option<Arc<str>>,
        /// What happened.
        detail: String,
    },
}

/// Refusal of a new request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// No model group of that name.
    #[error("model {0:?} does not exist")]
    UnknownModel(String),
    /// The model group has no candidate that could ever serve this request.
    #[error("model {0:?} has no provider that can serve this request")]
    NoCandidates(String),
    /// Too many requests already wait for the model group.
    #[error("queue for model {model:?} is full ({max_waiting} waiting)")]
    QueueFull {
        /// Model name.
        model: String,
        /// The limit.
        max_waiting: usize,
    },
}

/// Misuse of the machine by its driver.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UsageError {
    /// `handle_connection_opened` for a connection already open.
    #[error("connection {0:?} is already open")]
    DuplicateConnection(ConnId),
    /// An input for a connection that is not open.
    #[error("connection {0:?} is not open")]
    UnknownConnection(ConnId),
}

/// Refusal of a node command.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CommandError {
    /// The command breaks the contract (checked before any node or provider lookup).
    #[error("{0}")]
    Invalid(crate::wire::ValidationError),
    /// No configured node of that id.
    #[error("node {0:?} does not exist")]
    UnknownNode(String),
    /// The node is not ready.
    #[error("node {0:?} is not ready")]
    NotReady(String),
    /// An `OLLAMA_API` command for an adapter the node does not have, or that is not an
    /// Ollama adapter (decided from the Edge's configuration, before anything is sent).
    #[error("node {node:?} has no Ollama adapter {adapter:?}")]
    NotOllama {
        /// Node id.
        node: String,
        /// Adapter named.
        adapter: String,
    },
}

/// Refusal of a dispatch.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DispatchError {
    /// The request is not granted (never was, already dispatched, or already ended).
    #[error("request {0} is not waiting for dispatch")]
    NotGranted(RequestId),
    /// The message does not match the grant's shape.
    #[error("request {request} must be dispatched as {expected:?}")]
    WrongShape {
        /// The request.
        request: RequestId,
        /// The shape the grant requires.
        expected: DispatchShape,
    },
}

/// The message a granted request is dispatched with. `run_id`, `adapter` and `target`
/// are filled in by the machine.
#[derive(Clone, Debug, PartialEq)]
pub enum Dispatch {
    /// A normalized run.
    Run(RunRequest),
    /// A raw provider tunnel.
    Tunnel(ProviderTunnelRequest),
}

/// A new request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Submit<'a> {
    /// Public model name.
    pub model: &'a str,
    /// Estimated prompt tokens, compared with the model's long-context threshold.
    pub prompt_tokens: u64,
    /// Only tunnel-served providers can answer (embeddings and completions are raw
    /// OpenAI endpoints a normalized run cannot render); chat sets it false, so no
    /// candidate is excluded for its type.
    pub tunnel_only: bool,
}

/// Readiness of a configured node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeState {
    /// No connection owns it.
    Offline,
    /// Registered, ready handshake not complete.
    Pending,
    /// Dispatch-ready.
    Ready,
}

/// A configured node as the Edge sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeStatus {
    /// Node id.
    pub node_id: Arc<str>,
    /// Readiness.
    pub state: NodeState,
    /// Generation of the owning connection.
    pub generation: Option<Generation>,
    /// Configuration revision on the Edge.
    pub revision: u64,
    /// Revision the node last confirmed (registered with, or refreshed to).
    pub applied_revision: u64,
    /// Status of the last config refresh answered.
    pub last_refresh: Option<RefreshStatus>,
    /// Two live connections keep taking this node id from each other: the current owner
    /// keeps it and newcomers are held off (see [`crate::guard::FlapGuard`]).
    pub conflict: bool,
    /// TLS version of the owning connection; `None` when plaintext or offline.
    pub tls: Option<&'static str>,
    /// Whether the owning connection presented a verified client certificate.
    pub client_certificate: bool,
    /// The node failed to take its configuration and gets no new work until it has
    /// registered again (see [`CloseReason::RefreshFailed`]).
    pub draining: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum TimerKey {
    Handshake(ConnId),
    Liveness(ConnId),
    Ping(ConnId),
    Refresh(usize, u64),
    CancelGrace(RequestId),
    Command(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Opened, no register yet.
    Unregistered,
    /// Accepted register for `node` in `generation` (pending or ready: see the node).
    Owner { node: usize, generation: Generation },
    /// Rejected or superseded; a close was requested. Nothing it sends matters.
    Stale,
}

#[derive(Debug)]
struct Conn {
    phase: Phase,
    peer: Peer,
    /// Counted in [`PendingConnections`] (until it registers, is refused or closes).
    pending: bool,
    /// Register, then ready, must arrive before this.
    handshake_deadline: Timestamp,
    last_rx: Timestamp,
}

#[derive(Debug, Clone, Copy)]
struct Owner {
    conn: ConnId,
    generation: Generation,
    ready: bool,
    /// Revision sent in the `RegisterResponse`.
    registered_revision: u64,
}

#[derive(Debug)]
struct NodeEntry {
    id: Arc<str>,
    /// `None` once removed from the configuration.
    spec: Option<crate::edge_config::NodeSpec>,
    revision: u64,
    applied_revision: u64,
    owner: Option<Owner>,
    /// Outstanding refresh: (request sequence, revision).
    refresh: Option<(u64, u64)>,
    last_refresh: Option<RefreshStatus>,
    /// Adapter instance → resource, for every adapter ever configured on this node.
    resources: Vec<(Arc<str>, ResourceId)>,
    /// Supersedes of this node id, to notice two nodes fighting over it.
    flap: FlapGuard,
    /// Unanswered pushes of the current revision.
    refresh_tries: u32,
    /// The node could not take its configuration: it gets no new work and its
    /// connection is closed once its last lease returns (it then registers afresh).
    draining: bool,
}

#[derive(Debug)]
struct ResourceMeta {
    node: usize,
    provider_id: Arc<str>,
}

#[derive(Debug)]
struct Model {
    candidates: Arc<[Candidate]>,
    long_threshold: Option<u64>,
    long_possible: bool,
    cursor: usize,
}

#[derive(Debug)]
enum Stream {
    Run(RunTracker),
    Tunnel(TunnelReceiver),
    /// The stream broke the contract; nothing more it sends is trusted.
    Broken,
}

#[derive(Debug)]
enum ReqState {
    Waiting {
        ticket: Ticket,
        /// Only a tunnel-served provider can answer it.
        tunnel_only: bool,
    },
    Granted {
        lease: Lease,
        conn: ConnId,
        shape: DispatchShape,
        target: Arc<str>,
    },
    Running {
        lease: Lease,
        conn: ConnId,
        stream: Stream,
    },
    /// Ended for the caller; the lease is held until the node confirms or the grace ends.
    Cancelling {
        lease: Lease,
        conn: ConnId,
        stream: Stream,
    },
}

/// One item of a dispatched request's stream.
#[derive(Debug)]
enum StreamItem {
    Run(RunEvent),
    Frame(ProviderTunnelFrame),
}

impl StreamItem {
    fn run_id(&self) -> &str {
        match self {
            StreamItem::Run(event) => &event.run_id,
            StreamItem::Frame(frame) => &frame.run_id,
        }
    }

    /// Whether it ends its stream, whatever else is wrong with it.
    fn is_terminal(&self) -> bool {
        match self {
            StreamItem::Run(event) => matches!(
                RunEventType::try_from(event.r#type),
                Ok(RunEventType::Complete | RunEventType::Error | RunEventType::Cancelled)
            ),
            StreamItem::Frame(frame) => matches!(
                TunnelFrameKind::try_from(frame.kind),
                Ok(TunnelFrameKind::End | TunnelFrameKind::Error)
            ),
        }
    }

    fn into_event(self, request: RequestId) -> EdgeEvent {
        match self {
            StreamItem::Run(event) => EdgeEvent::RunEvent { request, event },
            StreamItem::Frame(frame) => EdgeEvent::TunnelFrame { request, frame },
        }
    }
}

/// What a stream item did.
enum Observed {
    Progress,
    Terminal(Outcome),
    Violation(String),
}

/// Checks `item` against `stream`'s contract; `None` for a stream already broken.
fn observe(stream: &mut Stream, item: &StreamItem) -> Option<Observed> {
    let provider_error = |error: &Option<ErrorDetail>| {
        Outcome::Failed(RequestError::Provider(error.clone().unwrap_or_default()))
    };
    Some(match (stream, item) {
        (Stream::Broken, _) => return None,
        (Stream::Run(tracker), StreamItem::Run(event)) => match tracker.observe(event) {
            Ok(RunStep::Terminal(RunEventType::Complete)) => Observed::Terminal(Outcome::Completed),
            Ok(RunStep::Terminal(RunEventType::Cancelled)) => {
                Observed::Terminal(Outcome::Cancelled)
            }
            Ok(RunStep::Terminal(_)) => Observed::Terminal(provider_error(&event.error)),
            Ok(_) => Observed::Progress,
            Err(violation) => Observed::Violation(violation.to_string()),
        },
        (Stream::Tunnel(receiver), StreamItem::Frame(frame)) => match receiver.observe(frame) {
            Ok(TunnelStep::End) => Observed::Terminal(Outcome::Completed),
            Ok(TunnelStep::Error) => Observed::Terminal(provider_error(&frame.error)),
            Ok(_) => Observed::Progress,
            Err(violation) => Observed::Violation(violation.to_string()),
        },
        (Stream::Run(_), StreamItem::Frame(_)) => {
            Observed::Violation("tunnel frame for a run".into())
        }
        (Stream::Tunnel(_), StreamItem::Run(_)) => {
            Observed::Violation("RunEvent for a tunnel".into())
        }
    })
}

/// The Edge protocol machine. See the [module documentation](self).
#[derive(Debug)]
pub struct EdgeCore {
    config: EdgeConfig,
    nodes: Vec<NodeEntry>,
    node_index: HashMap<Arc<str>, usize>,
    conns: IdMap<ConnId, Conn>,
    ledger: Ledger,
    throttle: AuthThrottle,
    pending: PendingConnections,
    /// Connections refused for the pending caps (logged at powers of two).
    refused_pending: u64,
    resources: Vec<ResourceMeta>,
    models: HashMap<Arc<str>, Model>,
    queue: WaitQueue,
    requests: IdMap<RequestId, ReqState>,
    timers: BTreeSet<(Timestamp, TimerKey)>,
    transmits: VecDeque<Transmit>,
    events: VecDeque<EdgeEvent>,
    next_request: u64,
    next_generation: u64,
    next_nonce: u64,
    next_refresh: u64,
    /// Commands awaiting an answer: sequence → (node, generation, request id).
    commands: std::collections::BTreeMap<u64, (usize, Generation, String)>,
    now: Timestamp,
    #[cfg(feature = "testkit")]
    faults: crate::testkit::Faults,
}

/// The run id on the wire for a request.
#[must_use]
pub fn run_id_of(request: RequestId) -> String {
    format!("run-{}", request.0)
}

fn request_of(run_id: &str) -> Option<RequestId> {
    run_id.strip_prefix("run-")?.parse().ok().map(RequestId)
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
            nodes: Vec::new(),
            node_index: HashMap::new(),
            conns: IdMap::default(),
            ledger: Ledger::new(),
            throttle: AuthThrottle::new(config.admission.throttle),
            pending: PendingConnections::default(),
            refused_pending: 0,
            resources: Vec::new(),
            models: HashMap::new(),
            queue: WaitQueue::new(),
            requests: IdMap::default(),
            timers: BTreeSet::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            next_request: 1,
            next_generation: 1,
            next_nonce: 1,
            next_refresh: 1,
            commands: std::collections::BTreeMap::new(),
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

    // ----- getters -----

    /// The configuration in force.
    #[must_use]
    pub fn config(&self) -> &EdgeConfig {
        &self.config
    }

    /// The lease ledger (read-only).
    #[must_use]
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The wait queue (read-only).
    #[must_use]
    pub fn queue(&self) -> &WaitQueue {
        &self.queue
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
        self.conns.len()
    }

    /// The node id and generation a connection owns, if it is a current owner.
    #[must_use]
    pub fn owner_of(&self, conn: ConnId) -> Option<(Arc<str>, Generation, bool)> {
        let c = self.conns.get(&conn)?;
        let Phase::Owner { node, generation } = c.phase else {
            return None;
        };
        let owner = self.nodes[node].owner?;
        (owner.conn == conn).then(|| (self.nodes[node].id.clone(), generation, owner.ready))
    }

    /// The connection that currently owns `node_id` (pending or ready).
    #[must_use]
    pub fn owner_of_node(&self, node_id: &str) -> Option<ConnId> {
        self.nodes[*self.node_index.get(node_id)?]
            .owner
            .map(|o| o.conn)
    }

    /// The resource of `(node_id, provider_id)`, if configured at any time.
    #[must_use]
    pub fn resource(&self, node_id: &str, provider_id: &str) -> Option<ResourceId> {
        let node = &self.nodes[*self.node_index.get(node_id)?];
        node.resources
            .iter()
            .find(|(name, _)| &**name == provider_id)
            .map(|(_, r)| *r)
    }

    /// Configured nodes and their readiness, in id order.
    #[must_use]
    pub fn nodes(&self) -> Vec<NodeStatus> {
        let mut out: Vec<NodeStatus> = self
            .nodes
            .iter()
            .filter(|n| n.spec.is_some())
            .map(|n| {
                let peer = n
                    .owner
                    .and_then(|o| self.conns.get(&o.conn))
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
                    draining: n.draining,
                }
            })
            .collect();
        out.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        out
    }

    /// One snapshot per configured provider, in node id then configuration order.
    /// Providers of offline or pending nodes are listed `UNAVAILABLE`/`OFFLINE` with every
    /// figure 0; disabled ones `DISABLED`/`OFFLINE` with every figure 0.
    #[must_use]
    pub fn snapshots(&self) -> Vec<ProviderSnapshot> {
        let mut order: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| self.nodes[i].spec.is_some())
            .collect();
        order.sort_by(|&a, &b| self.nodes[a].id.cmp(&self.nodes[b].id));
        let mut out = Vec::new();
        for i in order {
            let node = &self.nodes[i];
            let Some(spec) = &node.spec else { continue };
            let ready = node.owner.is_some_and(|o| o.ready);
            for adapter in &spec.adapters {
                let name = adapter.instance_name();
                let kind = AdapterType::try_from(adapter.r#type).unwrap_or_default();
                let mut snap = ProviderSnapshot {
                    node_id: node.id.to_string(),
                    provider_id: name.to_owned(),
                    category: category_of(kind) as i32,
                    status: ProviderStatus::Unavailable as i32,
                    health: ProviderHealth::Offline as i32,
                    targets: adapter.targets.clone(),
                    ..ProviderSnapshot::default()
                };
                let resource = self.resource(&node.id, name);
                let usage = resource.map(|r| self.ledger.usage(r)).unwrap_or_default();
                if !adapter.enabled {
                    snap.status = ProviderStatus::Disabled as i32;
                } else if ready && usage.generation.is_some() {
                    let (queued, long_queued) =
                        resource.map_or((0, 0), |r| self.queue.queued_at(r));
                    snap.status = ProviderStatus::Available as i32;
                    snap.health = ProviderHealth::Healthy as i32;
                    snap.capacity = usage.capacity;
                    snap.long_capacity = usage.long_capacity;
                    snap.in_flight = usage.in_flight;
                    snap.long_in_flight = usage.long_in_flight;
                    snap.queued = u32::try_from(queued).unwrap_or(u32::MAX);
                    snap.long_queued = u32::try_from(long_queued).unwrap_or(u32::MAX);
                }
                out.push(snap);
            }
        }
        out
    }

    // ----- outputs -----

    /// The next frame to write or connection to close.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next event.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<EdgeEvent> {
        self.events.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) must next be called.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        let timer = self.timers.first().map(|(at, _)| *at);
        match (timer, self.queue.next_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    // ----- inputs -----

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
    ) -> Result<(), UsageError> {
        self.advance(now);
        if self.conns.contains_key(&conn) {
            return Err(UsageError::DuplicateConnection(conn));
        }
        let source = Source::of(peer.addr);
        let admitted = self.pending.admit(source, self.config.admission.pending);
        self.conns.insert(
            conn,
            Conn {
                phase: Phase::Unregistered,
                pending: admitted,
                peer,
                handshake_deadline: self.now + self.config.timing.register_timeout,
                last_rx: self.now,
            },
        );
        let timing = self.config.timing;
        self.timers.insert((
            self.now + timing.register_timeout,
            TimerKey::Handshake(conn),
        ));
        self.timers.insert((
            self.now + timing.heartbeat_timeout,
            TimerKey::Liveness(conn),
        ));
        if !admitted {
            self.refused_pending += 1;
            let addr = self.conns.get(&conn).and_then(|c| c.peer.addr);
            self.events.push_back(EdgeEvent::ConnectionRefused {
                conn,
                addr,
                pending: self.pending.total(),
                refused: self.refused_pending,
                log: self.refused_pending.is_power_of_two(),
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
    ) -> Result<(), UsageError> {
        self.advance(now);
        let c = self
            .conns
            .get_mut(&conn)
            .ok_or(UsageError::UnknownConnection(conn))?;
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
    ) -> Result<(), UsageError> {
        self.advance(now);
        let c = self
            .conns
            .remove(&conn)
            .ok_or(UsageError::UnknownConnection(conn))?;
        if c.pending {
            self.pending.release(Source::of(c.peer.addr));
        }
        if let Phase::Owner { node, generation } = c.phase {
            self.fence_owner(node, generation, CloseReason::PeerClosed);
        }
        Ok(())
    }

    /// An envelope decoded from a connection.
    pub fn handle_envelope(
        &mut self,
        now: Timestamp,
        conn: ConnId,
        envelope: Envelope,
    ) -> Result<(), UsageError> {
        self.advance(now);
        let c = self
            .conns
            .get_mut(&conn)
            .ok_or(UsageError::UnknownConnection(conn))?;
        let phase = c.phase;
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
                self.violation(conn, format!("invalid {}: {err}", envelope.kind()));
                return Ok(());
            }
            match envelope.body {
                Some(Body::RunEvent(event)) => {
                    self.bad_stream_item(conn, phase, &event.run_id, err.to_string());
                }
                Some(Body::ProviderTunnelFrame(frame)) => {
                    self.bad_stream_item(conn, phase, &frame.run_id, err.to_string());
                }
                Some(Body::NodeConfigRefreshResponse(resp)) if !resp.request_id.is_empty() => {
                    self.on_refresh_response(conn, phase, resp);
                }
                _ => self.violation(conn, format!("invalid {}: {err}", envelope.kind())),
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
            Body::HeartbeatAck(_) => {}
            Body::RunEvent(event) => self.on_stream(conn, phase, StreamItem::Run(event)),
            Body::ProviderTunnelFrame(frame) => {
                self.on_stream(conn, phase, StreamItem::Frame(frame));
            }
            Body::NodeConfigRefreshResponse(resp) => self.on_refresh_response(conn, phase, resp),
            Body::NodeCommandResponse(resp) => self.on_command_response(conn, phase, resp),
            other => self.violation(
                conn,
                format!("{} is not a node-to-edge message", other.kind()),
            ),
        }
        Ok(())
    }

    /// Expires timers due at or before `now`. A spurious call does nothing.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        self.advance(now);
        while let Some(&(at, key)) = self.timers.first() {
            if at > self.now {
                break;
            }
            self.timers.pop_first();
            self.fire(key);
        }
        while let Some(waiter) = self.queue.pop_expired(self.now) {
            self.requests.remove(&waiter.request);
            self.events.push_back(EdgeEvent::RequestEnded {
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
    ) -> Result<RequestId, SubmitError> {
        self.advance(now);
        let model = self
            .models
            .get(submit.model)
            .ok_or_else(|| SubmitError::UnknownModel(submit.model.to_owned()))?;
        let long = model
            .long_threshold
            .is_some_and(|t| submit.prompt_tokens >= t);
        if long && !model.long_possible {
            return Err(SubmitError::NoCandidates(submit.model.to_owned()));
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
            return Err(SubmitError::NoCandidates(submit.model.to_owned()));
        }
        let request = RequestId(self.next_request);
        let model_name: Arc<str> = self
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
        if self.queue.waiting_for(&model_name) >= max_waiting {
            return Err(SubmitError::QueueFull {
                model: submit.model.to_owned(),
                max_waiting,
            });
        }
        self.next_request += 1;
        let ticket = self.queue.push(Waiter {
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
    ) -> Result<String, DispatchError> {
        self.advance(now);
        let Some(ReqState::Granted {
            lease,
            conn,
            shape,
            target,
        }) = self.requests.get(&request)
        else {
            return Err(DispatchError::NotGranted(request));
        };
        let (lease, conn, shape, target) = (*lease, *conn, *shape, target.to_string());
        let run_id = run_id_of(request);
        let provider_id = self.resources[lease.resource.index()]
            .provider_id
            .to_string();
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
            (_, expected) => return Err(DispatchError::WrongShape { request, expected }),
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
        Ok(run_id)
    }

    /// The caller gave up on `request` (disconnect, response timeout, write failure).
    /// A waiting request leaves the queue; a granted one returns its lease; a running one
    /// is cancelled on its node with `CancelRequest(CANCEL_RUN)` and keeps its lease until
    /// the node confirms or the cancel grace passes. Returns false when the request had
    /// already ended.
    pub fn handle_cancel(&mut self, now: Timestamp, request: RequestId, reason: &str) -> bool {
        self.advance(now);
        let Some(state) = self.requests.remove(&request) else {
            return false;
        };
        match state {
            ReqState::Waiting { ticket, .. } => {
                self.queue.remove(ticket);
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
                return false;
            }
        }
        self.events.push_back(EdgeEvent::RequestEnded {
            request,
            outcome: Outcome::Cancelled,
        });
        true
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
    ) -> Result<String, CommandError> {
        self.advance(now);
        let seq = self.next_refresh;
        request.request_id = format!("cmd-{seq}");
        request.validate().map_err(CommandError::Invalid)?;
        let i = *self
            .node_index
            .get(node_id)
            .filter(|&&i| self.nodes[i].spec.is_some())
            .ok_or_else(|| CommandError::UnknownNode(node_id.to_owned()))?;
        if request.r#type == crate::wire::NodeCommandType::OllamaApi as i32 {
            let ollama = self.nodes[i]
                .spec
                .as_ref()
                .and_then(|spec| spec.adapter(&request.adapter))
                .is_some_and(|a| a.r#type == AdapterType::Ollama as i32);
            if !ollama {
                return Err(CommandError::NotOllama {
                    node: node_id.to_owned(),
                    adapter: request.adapter.clone(),
                });
            }
        }
        let owner = self.nodes[i]
            .owner
            .filter(|o| o.ready)
            .ok_or_else(|| CommandError::NotReady(node_id.to_owned()))?;
        self.next_refresh += 1;
        let request_id = request.request_id.clone();
        self.commands
            .insert(seq, (i, owner.generation, request_id.clone()));
        self.send(owner.conn, Body::NodeCommandRequest(request));
        self.timers.insert((
            self.now + self.config.timing.refresh_timeout,
            TimerKey::Command(seq),
        ));
        Ok(request_id)
    }

    /// Replaces the configuration. Removed nodes are fenced and closed; ready nodes whose
    /// payload changed get a `NodeConfigRefreshRequest` (pending ones after their ready);
    /// model groups take effect for new requests. An invalid configuration changes nothing.
    pub fn handle_config(
        &mut self,
        now: Timestamp,
        config: EdgeConfig,
    ) -> Result<crate::edge_config::ConfigDiff, EdgeConfigError> {
        self.advance(now);
        config.validate()?;
        let diff = self.config.diff(&config);
        for node_id in &diff.removed_nodes {
            if let Some(&i) = self.node_index.get(node_id.as_str())
                && let Some(owner) = self.nodes[i].owner
            {
                self.close(owner.conn, CloseReason::NodeRemoved);
                self.fence_owner(i, owner.generation, CloseReason::NodeRemoved);
            }
        }
        // A changed token revokes the connection that registered with the old one.
        for node_id in &diff.changed_tokens {
            if let Some(&i) = self.node_index.get(node_id.as_str())
                && let Some(owner) = self.nodes[i].owner
            {
                self.close(owner.conn, CloseReason::CredentialsChanged);
                self.fence_owner(i, owner.generation, CloseReason::CredentialsChanged);
            }
        }
        for node_id in &diff.changed_payloads {
            if let Some(&i) = self.node_index.get(node_id.as_str()) {
                self.nodes[i].revision += 1;
                self.nodes[i].refresh_tries = 0;
            }
        }
        self.install(config);
        for node_id in &diff.changed_payloads {
            if let Some(&i) = self.node_index.get(node_id.as_str())
                && self.nodes[i].owner.is_some_and(|o| o.ready)
            {
                self.push_refresh(i);
            }
        }
        Ok(diff)
    }

    // ----- internals -----

    /// Adopts a validated configuration: nodes, resources and model groups.
    fn install(&mut self, config: EdgeConfig) {
        for node in &mut self.nodes {
            node.spec = None;
        }
        for (node_id, spec) in &config.nodes {
            let i = match self.node_index.get(node_id.as_str()) {
                Some(&i) => i,
                None => {
                    let id: Arc<str> = node_id.as_str().into();
                    self.nodes.push(NodeEntry {
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
                        draining: false,
                    });
                    self.node_index.insert(id, self.nodes.len() - 1);
                    self.nodes.len() - 1
                }
            };
            for adapter in &spec.adapters {
                let name = adapter.instance_name();
                if !self.nodes[i].resources.iter().any(|(n, _)| &**n == name) {
                    let r = self.ledger.add_resource();
                    let provider_id: Arc<str> = name.into();
                    self.resources.push(ResourceMeta {
                        node: i,
                        provider_id: provider_id.clone(),
                    });
                    self.nodes[i].resources.push((provider_id, r));
                }
            }
            self.nodes[i].spec = Some(spec.clone());
        }
        let mut models = HashMap::new();
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
            let cursor = self.models.get(name.as_str()).map_or(0, |m| m.cursor);
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
        self.models = models;
        self.throttle.set_limits(config.admission.throttle);
        self.config = config;
    }

    fn send(&mut self, conn: ConnId, body: Body) {
        self.transmits.push_back(Transmit::Frame {
            conn,
            envelope: Envelope::new(body),
        });
    }

    fn close(&mut self, conn: ConnId, reason: CloseReason) {
        if let Some(c) = self.conns.get_mut(&conn)
            && c.phase != Phase::Stale
        {
            c.phase = Phase::Stale;
            self.transmits.push_back(Transmit::Close { conn, reason });
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

    fn node_of(&self, conn: ConnId) -> Option<Arc<str>> {
        match self.conns.get(&conn)?.phase {
            Phase::Owner { node, .. } => Some(self.nodes[node].id.clone()),
            _ => None,
        }
    }

    /// The peer broke the protocol at connection level: close it (fencing it if it owns).
    fn violation(&mut self, conn: ConnId, detail: String) {
        self.events.push_back(EdgeEvent::PeerViolation {
            conn,
            node_id: self.node_of(conn),
            detail: detail.clone(),
        });
        let phase = self.conns.get(&conn).map(|c| c.phase);
        self.close(conn, CloseReason::ProtocolViolation(detail.clone()));
        if let Some(Phase::Owner { node, generation }) = phase {
            self.fence_owner(node, generation, CloseReason::ProtocolViolation(detail));
        }
    }

    fn on_register(&mut self, conn: ConnId, phase: Phase, req: RegisterRequest) {
        if phase != Phase::Unregistered {
            self.violation(conn, "second RegisterRequest on one connection".into());
            return;
        }
        let Some(addr) = self.conns.get(&conn).map(|c| c.peer.addr) else {
            return;
        };
        let source = Source::of(addr);
        let verdict = match self.throttle.blocked(self.now, source) {
            Some(_) => Err(RejectReason::Throttled),
            None => self.authenticate(conn, &req),
        };
        let i = match verdict {
            Ok(i) => i,
            Err(reason) => {
                let record = self.throttle.record_failure(self.now, source);
                // Refused while backing off: the peer may come back when the back-off is
                // over. Wrong credentials are final (retry_after 0).
                let retry_after = match reason {
                    RejectReason::Throttled => self.throttle.blocked(self.now, source),
                    _ => None,
                };
                self.reject_register(conn, &req.node_id, AUTH_FAILED.to_owned(), retry_after);
                self.events.push_back(EdgeEvent::RegisterRejected {
                    conn,
                    addr,
                    node_id: req.node_id.chars().take(64).collect(),
                    reason,
                    failures: record.failures,
                    blocked_for: record.blocked_for,
                    log: record.log,
                });
                return;
            }
        };
        self.throttle.record_success(source);
        // A newer register supersedes the current owner in this same transition, unless
        // the two keep taking the node id from each other.
        if let Some(old) = self.nodes[i].owner {
            let limits = self.config.admission.conflict;
            match self.nodes[i].flap.contest(self.now, limits) {
                Contest::HoldOff { retry_after, log } => {
                    let reason = format!(
                        "node id {:?} is in conflict: another live connection holds it \
                         (two nodes share this id?)",
                        &*self.nodes[i].id
                    );
                    self.reject_register(conn, &req.node_id, reason, Some(retry_after));
                    self.events.push_back(EdgeEvent::RegisterRejected {
                        conn,
                        addr,
                        node_id: self.nodes[i].id.to_string(),
                        reason: RejectReason::Conflict,
                        failures: 0,
                        blocked_for: None,
                        log,
                    });
                    return;
                }
                Contest::SupersedeAndHold => self.events.push_back(EdgeEvent::NodeConflict {
                    node_id: self.nodes[i].id.clone(),
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
        let generation = Generation(self.next_generation);
        self.next_generation += 1;
        let revision = self.nodes[i].revision;
        self.nodes[i].owner = Some(Owner {
            conn,
            generation,
            ready: false,
            registered_revision: revision,
        });
        let timing = self.config.timing;
        if let Some(c) = self.conns.get_mut(&conn) {
            c.phase = Phase::Owner {
                node: i,
                generation,
            };
            c.handshake_deadline = self.now + timing.register_timeout;
        }
        self.settle_pending(conn);
        // The full frame limit, in force before the node learns it may send large frames.
        self.transmits.push_back(Transmit::FrameLimit {
            conn,
            max_frame_len: self.config.admission.max_frame_len,
        });
        let payload = self.nodes[i]
            .spec
            .as_ref()
            .map(|spec| spec.payload(revision));
        self.send(
            conn,
            Body::RegisterResponse(RegisterResponse {
                accepted: true,
                reason: String::new(),
                node_id: self.nodes[i].id.to_string(),
                config: payload,
                heartbeat_interval_ms: millis(timing.heartbeat_interval),
                retry_after_ms: 0,
            }),
        );
        self.timers.insert((
            self.now + timing.register_timeout,
            TimerKey::Handshake(conn),
        ));
        self.timers
            .insert((self.now + timing.heartbeat_interval, TimerKey::Ping(conn)));
        #[cfg(feature = "testkit")]
        if self.faults.dispatch_before_ready {
            self.sync_resources(i, generation);
        }
    }

    /// The node a register may claim: a configured id, its token, and (with mutual TLS
    /// required) a client certificate naming it. An unknown id still costs a token check,
    /// so timing does not tell ids from tokens either.
    fn authenticate(&self, conn: ConnId, req: &RegisterRequest) -> Result<usize, RejectReason> {
        let node = self
            .node_index
            .get(req.node_id.as_str())
            .copied()
            .and_then(|i| Some((i, self.nodes[i].spec.as_ref()?)));
        let Some((i, spec)) = node else {
            let _ = TokenVerifier::from_secret(b"").verify(req.token.as_bytes());
            return Err(RejectReason::UnknownNode);
        };
        if !spec.token.verify(req.token.as_bytes()) {
            return Err(RejectReason::BadToken);
        }
        if self.config.admission.require_client_identity {
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

    fn reject_register(
        &mut self,
        conn: ConnId,
        node_id: &str,
        reason: String,
        retry_after: Option<Duration>,
    ) {
        self.send(
            conn,
            Body::RegisterResponse(RegisterResponse {
                accepted: false,
                reason: reason.clone(),
                node_id: node_id
                    .chars()
                    .take(crate::wire::MAX_NODE_ID_BYTES)
                    .collect(),
                retry_after_ms: retry_after.map_or(0, |d| millis(d).max(1)),
                ..RegisterResponse::default()
            }),
        );
        self.close(conn, CloseReason::RegisterRejected(reason));
    }

    fn refuse_ready(&mut self, conn: ConnId, reason: &str, close: bool) {
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

    fn on_ready(&mut self, conn: ConnId, phase: Phase, req: &NodeReadyRequest) {
        let Phase::Owner {
            node: i,
            generation,
        } = phase
        else {
            self.refuse_ready(conn, "ready before an accepted register", true);
            return;
        };
        let Some(owner) = self.nodes[i].owner.filter(|o| o.conn == conn) else {
            self.refuse_ready(conn, "connection is not the node's current owner", true);
            return;
        };
        if *self.nodes[i].id != *req.node_id {
            self.refuse_ready(conn, "node_id does not match the registered node", false);
            self.violation(conn, "ready for another node id".into());
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
        if let Some(o) = self.nodes[i].owner.as_mut() {
            o.ready = true;
        }
        self.nodes[i].applied_revision = owner.registered_revision;
        self.events.push_back(EdgeEvent::NodeConnected {
            node_id: self.nodes[i].id.clone(),
            generation,
        });
        self.sync_resources(i, generation);
        if self.nodes[i].revision != owner.registered_revision {
            self.push_refresh(i);
        }
    }

    /// Brings node `i`'s resources in line with its configuration for `generation`, at
    /// ready and after an applied refresh: enabled adapters come online (or take their new
    /// capacities when already live) and waiters are pumped; removed or disabled adapters
    /// take no new work while their leases drain (offline ones simply stay offline).
    fn sync_resources(&mut self, i: usize, generation: Generation) {
        let Some(spec) = self.nodes[i].spec.clone() else {
            return;
        };
        for (name, r) in self.nodes[i].resources.clone() {
            match spec.adapter(&name).filter(|a| a.enabled) {
                Some(adapter) => {
                    if self.ledger.usage(r).generation == Some(generation) {
                        self.ledger
                            .set_capacity(r, adapter.capacity, adapter.long_capacity);
                    } else {
                        let returned = self.ledger.activate(
                            r,
                            generation,
                            adapter.capacity,
                            adapter.long_capacity,
                        );
                        debug_assert!(returned.is_empty(), "older generation was not fenced");
                    }
                    self.pump(r);
                }
                None => self.ledger.set_capacity(r, 0, 0),
            }
        }
    }

    /// Fences node `i`'s `generation` if it is still the owner: leases return once, its
    /// running requests fail with `NodeLost`, its resources go offline.
    fn fence_owner(&mut self, i: usize, generation: Generation, reason: CloseReason) {
        let Some(owner) = self.nodes[i].owner.filter(|o| o.generation == generation) else {
            return; // stale: changes nothing, emits nothing
        };
        self.nodes[i].owner = None;
        self.nodes[i].refresh = None;
        self.nodes[i].refresh_tries = 0;
        self.nodes[i].draining = false;
        let node_id = self.nodes[i].id.clone();
        let pending: Vec<u64> = self
            .commands
            .iter()
            .filter(|(_, (node, g, _))| *node == i && *g == generation)
            .map(|(seq, _)| *seq)
            .collect();
        for seq in pending {
            self.fail_command(seq, "the node disconnected");
        }
        let mut lost = Vec::new();
        for (_, r) in self.nodes[i].resources.clone() {
            for lease in self.ledger.fence(r) {
                match self.requests.remove(&lease.request) {
                    Some(ReqState::Granted { .. } | ReqState::Running { .. }) => {
                        lost.push(lease.request);
                    }
                    Some(ReqState::Cancelling { .. }) | None => {}
                    Some(state @ ReqState::Waiting { .. }) => {
                        self.requests.insert(lease.request, state);
                    }
                }
            }
        }
        lost.sort_unstable();
        for &request in &lost {
            self.events.push_back(EdgeEvent::RequestEnded {
                request,
                outcome: Outcome::Failed(RequestError::NodeLost {
                    node_id: node_id.clone(),
                }),
            });
        }
        if owner.ready {
            self.events.push_back(EdgeEvent::NodeDisconnected {
                node_id,
                generation,
                reason,
                lost,
            });
        }
    }

    /// Picks the live candidate with the most free capacity; ties go round-robin.
    /// Picks among `candidates` (the model's, possibly filtered) the live one with the
    /// most free capacity; ties go round-robin from the model's cursor.
    fn pick_candidate(
        &mut self,
        model: &str,
        candidates: &[Candidate],
        long: bool,
    ) -> Option<Candidate> {
        let cursor = self.models.get(model)?.cursor;
        let n = candidates.len();
        let mut best: Option<(usize, u32)> = None;
        for step in 0..n {
            let index = (cursor + step) % n;
            let free = self.ledger.free(candidates[index].resource, long);
            if free > 0 && best.is_none_or(|(_, f)| free > f) {
                best = Some((index, free));
            }
        }
        let (index, _) = best?;
        if let Some(entry) = self.models.get_mut(model) {
            entry.cursor = (index + 1) % n;
        }
        Some(candidates[index].clone())
    }

    /// The message shape a resource is dispatched with.
    fn shape_of(&self, resource: ResourceId) -> DispatchShape {
        let meta = &self.resources[resource.index()];
        self.nodes[meta.node]
            .spec
            .as_ref()
            .and_then(|s| s.adapter(&meta.provider_id))
            .map_or(DispatchShape::Run, DispatchShape::for_adapter)
    }

    fn grant(&mut self, request: RequestId, model: &Arc<str>, candidate: &Candidate, long: bool) {
        let Some(lease) = self.ledger.try_acquire(candidate.resource, request, long) else {
            unreachable!("grant without free capacity");
        };
        let meta = &self.resources[candidate.resource.index()];
        let node = &self.nodes[meta.node];
        let Some(owner) = node.owner.filter(|o| o.ready) else {
            unreachable!("live resource on a node that is not ready");
        };
        let shape = self.shape_of(candidate.resource);
        self.requests.insert(
            request,
            ReqState::Granted {
                lease,
                conn: owner.conn,
                shape,
                target: candidate.target.clone(),
            },
        );
        self.events.push_back(EdgeEvent::Granted(Grant {
            request,
            lease,
            model: model.clone(),
            node_id: node.id.clone(),
            provider_id: meta.provider_id.clone(),
            target: candidate.target.clone(),
            shape,
        }));
    }

    /// Serves waiters listing `resource` while it has free capacity, oldest first.
    fn pump(&mut self, resource: ResourceId) {
        loop {
            let short_free = self.ledger.free(resource, false) > 0;
            let long_free = self.ledger.free(resource, true) > 0;
            let Some(ticket) = self.queue.oldest_fitting(resource, short_free, long_free) else {
                return;
            };
            let Some(waiter) = self.queue.remove(ticket) else {
                return;
            };
            let request = waiter.request;
            let tunnel_only = matches!(
                self.requests.get(&request),
                Some(ReqState::Waiting {
                    tunnel_only: true,
                    ..
                })
            );
            #[cfg(feature = "testkit")]
            let tunnel_only = tunnel_only && !self.faults.ignore_tunnel_only;
            if tunnel_only && self.shape_of(resource) != DispatchShape::Tunnel {
                self.requeue_for_tunnel(waiter);
                continue;
            }
            let Some(candidate) = waiter
                .candidates
                .iter()
                .find(|c| c.resource == resource)
                .cloned()
            else {
                return;
            };
            self.grant(request, &waiter.model, &candidate, waiter.long);
        }
    }

    /// A tunnel-only waiter reached a provider that no longer tunnels (a configuration
    /// refresh changed its adapter while the request waited). It goes on with its
    /// candidates that still tunnel: granted at once where one has room, otherwise
    /// queued again, behind, with its deadline kept; with none left it fails.
    fn requeue_for_tunnel(&mut self, waiter: Waiter) {
        let request = waiter.request;
        let candidates: Arc<[Candidate]> = waiter
            .candidates
            .iter()
            .filter(|c| self.shape_of(c.resource) == DispatchShape::Tunnel)
            .cloned()
            .collect();
        if candidates.is_empty() {
            self.requests.remove(&request);
            self.events.push_back(EdgeEvent::RequestEnded {
                request,
                outcome: Outcome::Failed(RequestError::Unsupported(format!(
                    "no provider of model `{}` serves this endpoint any more",
                    waiter.model
                ))),
            });
            return;
        }
        if let Some(candidate) = self.pick_candidate(&waiter.model, &candidates, waiter.long) {
            self.grant(request, &waiter.model, &candidate, waiter.long);
            return;
        }
        let ticket = self.queue.push(Waiter {
            candidates,
            ..waiter
        });
        self.requests.insert(
            request,
            ReqState::Waiting {
                ticket,
                tunnel_only: true,
            },
        );
    }

    fn release(&mut self, lease: Lease) {
        #[cfg(feature = "testkit")]
        if self.faults.double_release {
            let _ = self.ledger.release(lease);
        }
        if self.ledger.release(lease) == Release::Released {
            self.pump(lease.resource);
            let node = self.resources[lease.resource.index()].node;
            self.close_if_drained(node);
        }
    }

    /// Common checks for a run event or tunnel frame: from the current ready owner, for a
    /// request running on this connection. Anything else is stale and ignored.
    fn stream_of(&mut self, conn: ConnId, phase: Phase, run_id: &str) -> Option<RequestId> {
        let Phase::Owner { node, .. } = phase else {
            self.violation(conn, "stream frame before register".into());
            return None;
        };
        if !self.nodes[node]
            .owner
            .is_some_and(|o| o.conn == conn && o.ready)
        {
            self.violation(conn, "stream frame before ready".into());
            return None;
        }
        let request = request_of(run_id)?;
        match self.requests.get(&request)? {
            ReqState::Running { conn: c, .. } | ReqState::Cancelling { conn: c, .. }
                if *c == conn =>
            {
                Some(request)
            }
            _ => None,
        }
    }

    /// A run event or tunnel frame from a node: checked against its stream's contract,
    /// passed to the caller while the request is open, and ending it on the terminal.
    fn on_stream(&mut self, conn: ConnId, phase: Phase, item: StreamItem) {
        let Some(request) = self.stream_of(conn, phase, item.run_id()) else {
            return;
        };
        let Some(state) = self.requests.remove(&request) else {
            return;
        };
        let (lease, conn, mut stream, cancelling) = match state {
            ReqState::Running {
                lease,
                conn,
                stream,
            } => (lease, conn, stream, false),
            ReqState::Cancelling {
                lease,
                conn,
                stream,
            } => (lease, conn, stream, true),
            other => {
                self.requests.insert(request, other);
                return;
            }
        };
        let Some(observed) = observe(&mut stream, &item) else {
            // A broken stream: nothing it sends is trusted any more, except that it ended:
            // the node has stopped the run, so its lease returns now, not at the grace.
            #[cfg(feature = "testkit")]
            let hold = self.faults.hold_cancelled_lease;
            #[cfg(not(feature = "testkit"))]
            let hold = false;
            if item.is_terminal() && !hold {
                self.release(lease);
                return;
            }
            self.requests.insert(
                request,
                ReqState::Cancelling {
                    lease,
                    conn,
                    stream,
                },
            );
            return;
        };
        match observed {
            Observed::Terminal(outcome) => {
                #[cfg(feature = "testkit")]
                let leak = self.faults.leak_lease && outcome == Outcome::Completed;
                #[cfg(not(feature = "testkit"))]
                let leak = false;
                if !leak {
                    self.release(lease);
                }
                if !cancelling {
                    self.events.push_back(item.into_event(request));
                    self.events
                        .push_back(EdgeEvent::RequestEnded { request, outcome });
                }
            }
            Observed::Progress => {
                if !cancelling {
                    self.events.push_back(item.into_event(request));
                }
                let state = if cancelling {
                    ReqState::Cancelling {
                        lease,
                        conn,
                        stream,
                    }
                } else {
                    ReqState::Running {
                        lease,
                        conn,
                        stream,
                    }
                };
                self.requests.insert(request, state);
            }
            Observed::Violation(detail) if item.is_terminal() => {
                // Out of order, but the node has ended the run: fail it if the caller still
                // waits, and settle the lease now; there is nothing left to cancel.
                self.events.push_back(EdgeEvent::PeerViolation {
                    conn,
                    node_id: self.node_of(conn),
                    detail: format!("{}: {detail}", run_id_of(request)),
                });
                self.release(lease);
                if !cancelling {
                    self.events.push_back(EdgeEvent::RequestEnded {
                        request,
                        outcome: Outcome::Failed(RequestError::Violation(detail)),
                    });
                }
            }
            Observed::Violation(detail) => {
                self.stream_violation(request, lease, conn, cancelling, detail);
            }
        }
    }

    /// Sends `CancelRequest(CANCEL_RUN)` for `request` on `conn` and arms its cancel
    /// grace: the lease is returned when the node ends the run or the grace passes.
    fn cancel_on_node(&mut self, request: RequestId, conn: ConnId, reason: String) {
        self.send(
            conn,
            Body::CancelRequest(CancelRequest {
                run_id: run_id_of(request),
                kind: CancelKind::CancelRun as i32,
                reason,
            }),
        );
        self.timers.insert((
            self.now + self.config.timing.cancel_grace,
            TimerKey::CancelGrace(request),
        ));
    }

    /// A run event or tunnel frame that breaks the message contract (e.g. an unknown
    /// type): the run it names fails as for any stream violation; one that names no run
    /// of this connection is reported and dropped. The connection stays.
    fn bad_stream_item(&mut self, conn: ConnId, phase: Phase, run_id: &str, detail: String) {
        let Some(request) = self.stream_of(conn, phase, run_id) else {
            if self.ready_owner(conn, phase).is_some() {
                self.events.push_back(EdgeEvent::PeerViolation {
                    conn,
                    node_id: self.node_of(conn),
                    detail: format!("dropped a message for no run of this connection: {detail}"),
                });
            }
            return;
        };
        match self.requests.remove(&request) {
            Some(ReqState::Running { lease, conn, .. }) => {
                self.stream_violation(request, lease, conn, false, detail);
            }
            Some(ReqState::Cancelling { lease, conn, .. }) => {
                self.stream_violation(request, lease, conn, true, detail);
            }
            Some(other) => {
                self.requests.insert(request, other);
            }
            None => {}
        }
    }

    /// A run's stream broke the contract: that run alone fails, is cancelled on the node,
    /// and keeps its lease until the node ends it or the cancel grace passes.
    fn stream_violation(
        &mut self,
        request: RequestId,
        lease: Lease,
        conn: ConnId,
        cancelling: bool,
        detail: String,
    ) {
        self.events.push_back(EdgeEvent::PeerViolation {
            conn,
            node_id: self.node_of(conn),
            detail: format!("{}: {detail}", run_id_of(request)),
        });
        if !cancelling {
            self.events.push_back(EdgeEvent::RequestEnded {
                request,
                outcome: Outcome::Failed(RequestError::Violation(detail.clone())),
            });
            self.cancel_on_node(request, conn, format!("protocol violation: {detail}"));
        }
        // Nothing more this stream sends is trusted; the lease waits for the grace timer
        // or a fence.
        self.requests.insert(
            request,
            ReqState::Cancelling {
                lease,
                conn,
                stream: Stream::Broken,
            },
        );
    }

    fn fail_command(&mut self, seq: u64, why: &str) {
        if let Some((i, _, request_id)) = self.commands.remove(&seq) {
            self.events.push_back(EdgeEvent::CommandAnswered {
                node_id: self.nodes[i].id.clone(),
                response: NodeCommandResponse {
                    request_id,
                    ok: false,
                    error: why.to_owned(),
                    payload: bytes::Bytes::new(),
                },
            });
        }
    }

    /// The node and generation `conn` owns, if it is that node's current, ready owner.
    fn ready_owner(&self, conn: ConnId, phase: Phase) -> Option<(usize, Generation)> {
        let Phase::Owner { node, generation } = phase else {
            return None;
        };
        self.nodes[node]
            .owner
            .is_some_and(|o| o.conn == conn && o.ready)
            .then_some((node, generation))
    }

    fn on_command_response(&mut self, conn: ConnId, phase: Phase, response: NodeCommandResponse) {
        let Some((i, generation)) = self.ready_owner(conn, phase) else {
            return;
        };
        let Some(seq) = response
            .request_id
            .strip_prefix("cmd-")
            .and_then(|n| n.parse::<u64>().ok())
        else {
            return;
        };
        if self
            .commands
            .get(&seq)
            .is_some_and(|(node, g, _)| *node == i && *g == generation)
        {
            self.commands.remove(&seq);
            self.events.push_back(EdgeEvent::CommandAnswered {
                node_id: self.nodes[i].id.clone(),
                response,
            });
        }
    }

    fn push_refresh(&mut self, i: usize) {
        let Some(owner) = self.nodes[i].owner else {
            return;
        };
        let Some(spec) = &self.nodes[i].spec else {
            return;
        };
        let revision = self.nodes[i].revision;
        let seq = self.next_refresh;
        self.next_refresh += 1;
        let payload = spec.payload(revision);
        self.nodes[i].refresh = Some((seq, revision));
        self.send(
            owner.conn,
            Body::NodeConfigRefreshRequest(NodeConfigRefreshRequest {
                request_id: format!("refresh-{seq}"),
                config: Some(payload),
            }),
        );
        self.timers.insert((
            self.now + self.config.timing.refresh_timeout,
            TimerKey::Refresh(i, seq),
        ));
    }

    fn on_refresh_response(&mut self, conn: ConnId, phase: Phase, resp: NodeConfigRefreshResponse) {
        let Some((i, generation)) = self.ready_owner(conn, phase) else {
            return;
        };
        let Some((seq, revision)) = self.nodes[i].refresh else {
            return;
        };
        if resp.request_id != format!("refresh-{seq}") {
            return;
        }
        self.nodes[i].refresh = None;
        // An unknown status (a newer node) is not an applied configuration.
        let (status, message) = match RefreshStatus::try_from(resp.status) {
            Ok(status) if status != RefreshStatus::Unspecified => (status, resp.message),
            _ => (
                RefreshStatus::Failed,
                format!("unknown refresh status {}: {}", resp.status, resp.message),
            ),
        };
        self.nodes[i].last_refresh = Some(status);
        self.events.push_back(EdgeEvent::RefreshAnswered {
            node_id: self.nodes[i].id.clone(),
            status,
            message: message.clone(),
            revision: resp.revision,
        });
        if status != RefreshStatus::Applied {
            self.drain_node(i, format!("config refresh answered {status:?}: {message}"));
            return;
        }
        self.nodes[i].refresh_tries = 0;
        self.nodes[i].applied_revision = revision;
        self.sync_resources(i, generation);
        // The configuration may have moved on while this refresh was in flight.
        if self.nodes[i].revision != revision {
            self.push_refresh(i);
        }
    }

    /// Node `i` cannot take its configuration: no new work goes to it, and its connection
    /// closes once its last lease returns, so that it registers again and receives the
    /// configuration in its `RegisterResponse` (or fails to become ready, visibly).
    fn drain_node(&mut self, i: usize, reason: String) {
        let Some(owner) = self.nodes[i].owner else {
            return;
        };
        if std::mem::replace(&mut self.nodes[i].draining, true) {
            return;
        }
        for (_, r) in self.nodes[i].resources.clone() {
            if self.ledger.usage(r).generation == Some(owner.generation) {
                self.ledger.set_capacity(r, 0, 0);
            }
        }
        self.events.push_back(EdgeEvent::NodeDraining {
            node_id: self.nodes[i].id.clone(),
            reason,
            in_flight: self.in_flight_on(i),
        });
        self.close_if_drained(i);
    }

    /// Leases held on node `i`'s current generation.
    fn in_flight_on(&self, i: usize) -> u32 {
        let Some(owner) = self.nodes[i].owner else {
            return 0;
        };
        self.nodes[i]
            .resources
            .iter()
            .map(|(_, r)| self.ledger.usage(*r))
            .filter(|u| u.generation == Some(owner.generation))
            .map(|u| u.in_flight)
            .sum()
    }

    fn close_if_drained(&mut self, i: usize) {
        if !self.nodes[i].draining || self.in_flight_on(i) > 0 {
            return;
        }
        if let Some(owner) = self.nodes[i].owner {
            let reason =
                CloseReason::RefreshFailed("the node could not take its configuration".into());
            self.close(owner.conn, reason.clone());
            self.fence_owner(i, owner.generation, reason);
        }
    }

    fn fire(&mut self, key: TimerKey) {
        let timing = self.config.timing;
        match key {
            TimerKey::Handshake(conn) => {
                let Some(c) = self.conns.get(&conn) else {
                    return;
                };
                let pending = match c.phase {
                    Phase::Unregistered => true,
                    Phase::Owner { node, .. } => self.nodes[node]
                        .owner
                        .is_some_and(|o| o.conn == conn && !o.ready),
                    Phase::Stale => false,
                };
                // An earlier timer of a re-armed deadline is not due yet.
                if pending && c.handshake_deadline <= self.now {
                    let phase = c.phase;
                    self.close(conn, CloseReason::HandshakeTimeout);
                    if let Phase::Owner { node, generation } = phase {
                        self.fence_owner(node, generation, CloseReason::HandshakeTimeout);
                    }
                }
            }
            TimerKey::Liveness(conn) => {
                let Some(c) = self.conns.get(&conn) else {
                    return;
                };
                let deadline = c.last_rx + timing.heartbeat_timeout;
                if deadline > self.now {
                    self.timers.insert((deadline, TimerKey::Liveness(conn)));
                    return;
                }
                let phase = c.phase;
                self.close(conn, CloseReason::HeartbeatTimeout);
                if let Phase::Owner { node, generation } = phase {
                    self.fence_owner(node, generation, CloseReason::HeartbeatTimeout);
                }
            }
            TimerKey::Ping(conn) => {
                if self.owner_of(conn).is_none() {
                    return;
                }
                let nonce = self.next_nonce;
                self.next_nonce += 1;
                self.send(
                    conn,
                    Body::Heartbeat(Heartbeat {
                        nonce,
                        sent_at_ms: self.now.as_millis(),
                    }),
                );
                self.timers
                    .insert((self.now + timing.heartbeat_interval, TimerKey::Ping(conn)));
            }
            TimerKey::Refresh(i, seq) => {
                if let Some((pending, revision)) = self.nodes[i].refresh
                    && pending == seq
                {
                    self.nodes[i].refresh = None;
                    self.nodes[i].refresh_tries += 1;
                    let retrying = self.nodes[i].refresh_tries < MAX_REFRESH_TRIES;
                    self.events.push_back(EdgeEvent::RefreshTimedOut {
                        node_id: self.nodes[i].id.clone(),
                        revision,
                        retrying,
                    });
                    if retrying {
                        self.push_refresh(i);
                    } else {
                        self.drain_node(
                            i,
                            format!("config refresh unanswered {MAX_REFRESH_TRIES} times"),
                        );
                    }
                }
            }
            TimerKey::Command(seq) => self.fail_command(seq, "the node did not answer in time"),
            TimerKey::CancelGrace(request) => {
                if let Some(ReqState::Cancelling { lease, .. }) = self.requests.get(&request) {
                    let lease = *lease;
                    self.requests.remove(&request);
                    self.release(lease);
                }
            }
        }
    }
}
