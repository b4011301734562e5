//! The Edge machine's public types: connections and peers, what it transmits, the
//! events it reports, requests, outcomes and errors.

use super::ConnViolation;
use super::Ejection;
use super::Standing;
use super::StreamViolation;
use super::Violation;
use crate::guard::Source;
use crate::guard::ThrottledBy;
use crate::lease::Generation;
use crate::lease::RequestId;
use crate::lease::RunId;
use crate::tunnel::Endpoint;
use crate::tunnel::TunnelPart;
use crate::wire::AdapterConfig;
use crate::wire::AdapterType;
use crate::wire::Envelope;
use crate::wire::ErrorDetail;
use crate::wire::NodeCommandResponse;
use crate::wire::RefreshStatus;
use crate::wire::RunEvent;
use bytes::Bytes;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

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
/// (unknown node id, wrong token, certificate for another node), so a peer cannot tell
/// node ids from tokens. The Edge's own logs get the real [`RejectReason`].
pub const AUTH_FAILED: &str = "authentication failed";

/// How the reason of a failed registration starts when its answer was held back because
/// the claimed node id or the source failed too often (see [`throttled_reason`](super::throttled_reason)): the
/// same for unknown ids and wrong tokens, and never sent to a node whose token is right.
pub const TOO_MANY_FAILURES: &str = "too many failed attempts";

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
    /// The credentials were wrong while the claimed node id or the source had failed
    /// too often: the refusal was held back, then sent with [`throttled_reason`](super::throttled_reason).
    Throttled,
    /// Authenticated, but the node id is in conflict and held by another connection.
    Conflict,
    /// Authenticated, but the node id's live connection is stopping gracefully and still
    /// finishing its requests: the newcomer (the restarted node) is held off until it has
    /// gone, instead of superseding it and cutting those requests.
    Draining,
    /// Authenticated, but this Edge process is handing its listeners to a successor
    /// ([`crate::EdgeCore::handle_rehome`]): the node is told to try again at once, which
    /// reaches the successor.
    HandingOver,
    /// Authenticated, but in a cluster another node instance holds the node id
    /// (docs/cluster.md): exactly one of two machines sharing an id serves.
    ClusterHeld,
    /// Authenticated, but this Edge could not claim the node id in the cluster now (etcd
    /// unreachable, or the Edge is not a member): try again later or elsewhere.
    ClusterUnavailable,
    /// In a cluster, the same node process already holds a live session with this Edge.
    DuplicateSession,
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
            RejectReason::Draining => "draining",
            RejectReason::HandingOver => "handing_over",
            RejectReason::ClusterHeld => "cluster_held",
            RejectReason::ClusterUnavailable => "cluster_unavailable",
            RejectReason::DuplicateSession => "duplicate_session",
        }
    }
}

/// Why the Edge closes a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CloseReason {
    /// The register was refused (the peer was told [`AUTH_FAILED`] or why it is held
    /// off).
    RegisterRejected(RejectReason),
    /// No register, or no ready, within the register timeout.
    HandshakeTimeout,
    /// A ready from a connection that is not the node's current owner.
    ReadyRefused,
    /// A newer connection registered for the same node id.
    Superseded,
    /// Nothing received within the heartbeat timeout.
    HeartbeatTimeout,
    /// The peer broke the connection's own grammar.
    ProtocolViolation(ConnViolation),
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
    RefreshFailed(RefreshFailure),
    /// The node asked to be drained (`NodeDrainRequest`, a graceful stop), or this Edge
    /// handed over to a successor, and its last lease has returned: the close tells it
    /// that nothing more will come.
    Drained,
    /// The peer closed the connection (reported by the shell).
    PeerClosed,
}

impl CloseReason {
    /// A stable label for logs, metrics and lifecycle events.
    #[must_use]
    pub fn label(&self) -> &'static str {
        match self {
            CloseReason::RegisterRejected(_) => "register_rejected",
            CloseReason::HandshakeTimeout => "handshake_timeout",
            CloseReason::ReadyRefused => "ready_refused",
            CloseReason::Superseded => "superseded",
            CloseReason::HeartbeatTimeout => "heartbeat_timeout",
            CloseReason::ProtocolViolation(_) => "protocol_violation",
            CloseReason::NodeRemoved => "node_removed",
            CloseReason::CredentialsChanged => "credentials_changed",
            CloseReason::TooManyPending => "too_many_pending",
            CloseReason::RefreshFailed(_) => "refresh_failed",
            CloseReason::Drained => "drained",
            CloseReason::PeerClosed => "peer_closed",
        }
    }
}

/// An output to hand to the transport, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Transmit {
    /// Write this envelope on the connection.
    Frame {
        /// Target connection.
        conn: ConnId,
        /// The envelope; encode it after every earlier frame of the connection.
        envelope: Envelope,
    },
    /// Write this tunnel request on the connection ([`TunnelDispatch::encode`] writes
    /// its frame), after every earlier frame of the connection.
    Tunnel {
        /// Target connection.
        conn: ConnId,
        /// The request.
        dispatch: super::TunnelDispatch,
    },
    /// From now on accept frames of up to `max_frame_len` bytes on the connection.
    /// Connections start at [`Admission::pending_frame_len`](crate::edge_config::Admission)
    /// (the shell's decoder begins there); the limit rises to the full one just before the
    /// frame that accepts the register, so it is in force before the node can use it.
    FrameLimit {
        /// The node connection it concerns.
        conn: ConnId,
        /// The new limit.
        max_frame_len: usize,
    },
    /// Flush what was written, then close the connection.
    Close {
        /// Connection to close.
        conn: ConnId,
        /// Why, for the log (the peer is not told).
        reason: CloseReason,
    },
}

impl Transmit {
    /// The connection and envelope of a frame, or of a tunnel request with its message
    /// built ([`TunnelDispatch::to_envelope`](super::TunnelDispatch::to_envelope)), for
    /// tests and embedders that look at envelopes; `None` for the other transmits.
    #[must_use]
    pub fn frame(&self) -> Option<(ConnId, Envelope)> {
        match self {
            Transmit::Frame { conn, envelope } => Some((*conn, envelope.clone())),
            Transmit::Tunnel { conn, dispatch } => Some((*conn, dispatch.to_envelope())),
            Transmit::FrameLimit { .. } | Transmit::Close { .. } => None,
        }
    }
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

/// Why a request failed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RequestError {
    /// The node serving it disconnected or was fenced.
    NodeLost {
        /// The node's configured id.
        node_id: Arc<str>,
    },
    /// The node's stream for it broke the contract.
    Violation(StreamViolation),
    /// The provider or node reported an error (`ERROR` event or frame).
    Provider(ErrorDetail),
    /// The request needs a tunnel-served provider (embeddings, completions) and none of
    /// its model's candidates is one any more: a configuration refresh changed their
    /// adapters while it waited.
    Unsupported {
        /// The model group.
        model: Arc<str>,
    },
    /// It was still waiting for capacity when this Edge process handed its nodes to a
    /// successor ([`crate::EdgeCore::handle_rehome`]); nothing was sent to a provider, so
    /// the caller may retry at once.
    HandingOver,
}

/// How a request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// `COMPLETE` or `END`.
    Completed,
    /// Failed; the public API crate (`iop-api`) says what the caller is told.
    Failed(RequestError),
    /// Cancelled by the caller, or `CANCELLED` from the node.
    Cancelled,
    /// No capacity within the queue wait timeout.
    Expired,
}

/// Something the shell should know about. Deliberately exhaustive: a new event is a
/// compile error in every shell until it decides what to do with it.
#[derive(Clone, Debug, PartialEq)]
pub enum EdgeEvent {
    /// In a cluster: a register for `node_id` by `instance` authenticated on `conn`; ask
    /// the cluster member ([`crate::cluster::ClusterMember::claim_node`]) and answer with
    /// [`crate::EdgeCore::handle_claim`]. Until then the connection is not registered.
    ClaimNode {
        /// The connection waiting.
        conn: ConnId,
        /// The node id claimed.
        node_id: Arc<str>,
        /// The node process (`RegisterRequest.instance_id`, 0 if it gave none).
        instance: u64,
    },
    /// In a cluster: no connection here serves `instance` of `node_id` any more; the
    /// member stops renewing its node lease
    /// ([`crate::cluster::ClusterMember::release_node`]).
    ReleaseNode {
        /// The node id.
        node_id: Arc<str>,
        /// The node process.
        instance: u64,
    },
    /// A connection's register was accepted: it owns the node id under a new generation
    /// and must now report ready (no work is granted to it before).
    NodeRegistered {
        /// The node registered.
        node_id: Arc<str>,
        /// The generation the connection holds.
        generation: Generation,
    },
    /// A node completed its ready handshake (exactly once per generation).
    NodeConnected {
        /// The node now ready: requests may be granted to its providers.
        node_id: Arc<str>,
        /// Its connection generation.
        generation: Generation,
    },
    /// A ready node's generation was fenced.
    NodeDisconnected {
        /// The node; requests it was serving are in `lost` and have ended.
        node_id: Arc<str>,
        /// The fenced generation.
        generation: Generation,
        /// Why its generation ended.
        reason: CloseReason,
        /// Requests that were running on it; each also ends with
        /// [`RequestError::NodeLost`].
        lost: Vec<RequestId>,
    },
    /// Something happened to a request, for its caller: see [`RequestEvent`].
    Request {
        /// The caller's request it concerns.
        request: RequestId,
        /// What happened.
        event: RequestEvent,
    },
    /// A request was dispatched (its first try, a retry, or a try beside a slow one): for
    /// logs and metrics; its caller hears of it only if this run answers
    /// ([`RequestEvent::Dispatched`]).
    Attempt {
        /// The dispatch of the request it concerns.
        run: RunId,
        /// Node chosen.
        node_id: Arc<str>,
        /// Adapter instance chosen on it.
        provider_id: Arc<str>,
        /// Tunnel or run.
        shape: DispatchShape,
    },
    /// A provider failed a request before its first byte, and the request was given
    /// another provider (or one was tried beside a provider slow to answer).
    Retried {
        /// The caller's request it concerns.
        request: RequestId,
        /// The run that failed, or is slow.
        run: RunId,
        /// The node's configured id.
        node_id: Arc<str>,
        /// The provider on that node (its adapter instance name).
        provider_id: Arc<str>,
        /// Why, as a stable label (`error`, `status_5xx`, `status_429`, `status_408`,
        /// `violation`, `node_lost`, `first_byte_timeout`).
        why: &'static str,
    },
    /// A streamed answer lost after its first byte (its node lost, or its provider's
    /// stream failed) is continued on another provider from the text its caller has.
    Resumed {
        /// The caller's request it concerns.
        request: RequestId,
        /// The run that was lost.
        run: RunId,
        /// The node it ran on.
        node_id: Arc<str>,
        /// The provider on that node.
        provider_id: Arc<str>,
        /// Why, as a stable label (`node_lost`, `error`).
        why: &'static str,
        /// Bytes of answer the caller had.
        delivered: usize,
    },
    /// A provider was taken out of the rotation until its ejection ends and a probe
    /// succeeds (or, for a `Retry-After`, until the time it asked for).
    ProviderEjected {
        /// The node's configured id.
        node_id: Arc<str>,
        /// The provider on that node (its adapter instance name).
        provider_id: Arc<str>,
        /// Why.
        reason: Ejection,
        /// For how long.
        time: Duration,
    },
    /// An ejected provider answered its probe: it is back in the rotation.
    ProviderRestored {
        /// The node's configured id.
        node_id: Arc<str>,
        /// The provider on that node (its adapter instance name).
        provider_id: Arc<str>,
        /// Why it had been ejected.
        after: Ejection,
    },
    /// A node answered a config refresh.
    RefreshAnswered {
        /// The node that answered.
        node_id: Arc<str>,
        /// Applied, failed (the node keeps its previous adapters) or needs a restart.
        status: RefreshStatus,
        /// Details from the node.
        message: String,
        /// Revision in force on the node.
        revision: u64,
    },
    /// A node did not answer a config refresh in time.
    RefreshTimedOut {
        /// The node that did not answer.
        node_id: Arc<str>,
        /// Revision that was pushed.
        revision: u64,
        /// Whether the refresh is sent again (else the node is drained).
        retrying: bool,
    },
    /// A node gets no new work and is closed once its last lease returns: it could not
    /// take its configuration (it then registers again with the configuration), or it
    /// asked to stop gracefully.
    NodeDraining {
        /// The node being drained.
        node_id: Arc<str>,
        /// Why.
        reason: DrainReason,
        /// Leases still held on it.
        in_flight: u32,
    },
    /// A node answered a command, or the command failed (node lost, timed out: then
    /// `ok` is false and `error` says why).
    CommandAnswered {
        /// The node the command was sent to.
        node_id: Arc<str>,
        /// The node's answer, as it sent it.
        response: NodeCommandResponse,
    },
    /// A registration was refused (the peer got [`AUTH_FAILED`], [`TOO_MANY_FAILURES`]
    /// after a hold, or a conflict or draining reason). Emitted for every refusal, for
    /// metrics; `log` says whether it is worth a log line (the 1st, 2nd, 4th, 8th…
    /// failure of a node id and source, the first held answer, every conflict refusal),
    /// so an attack cannot flood the log.
    RegisterRejected {
        /// The connection (closed once the refusal is sent).
        conn: ConnId,
        /// The peer's address, when known.
        addr: Option<IpAddr>,
        /// The node id claimed (at most 64 characters of it).
        node_id: String,
        /// Whether the claimed node id is configured.
        known: bool,
        /// Why: bad credentials, or held off by a node-id conflict or drain.
        reason: RejectReason,
        /// Failures of the claimed node id or of the source (the larger), since it was
        /// last quiet.
        failures: u32,
        /// The answer is held back: which budget ran out, for how long, and when the
        /// peer is told to come back.
        throttled: Option<Throttled>,
        /// Whether to log it.
        log: bool,
    },
    /// Two live connections took a node id from each other too often: the node id is now
    /// in conflict (emitted once per conflict; log it loudly). The current owner keeps
    /// the node, newcomers are refused for `hold_down` after the last one tried.
    NodeConflict {
        /// The node id in conflict.
        node_id: Arc<str>,
        /// Supersedes seen within the detection window.
        supersedes: u32,
        /// How long newcomers are held off.
        hold_down: Duration,
    },
    /// A new connection was closed at once: too many connections have not registered
    /// yet, in all or from its source. `log` is set for the 1st, 2nd, 4th, 8th… refusal.
    ConnectionRefused {
        /// The connection, already closed.
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
        /// The connection the violation arrived on.
        conn: ConnId,
        /// Node, when known.
        node_id: Option<Arc<str>>,
        /// What happened.
        violation: Violation,
    },
}

/// Registrations that failed recently, for status pages: who keeps failing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegistrationFailures {
    /// Node ids claimed by failed registrations, most failures first.
    pub nodes: Vec<FailingNode>,
    /// Sources of failed registrations, most failures first.
    pub sources: Vec<crate::guard::FailingKey<Source>>,
}

/// A node id that failed registrations claimed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailingNode {
    /// The id (at most 64 characters of it).
    pub node_id: String,
    /// Whether it is configured (a wrong token) or not (a wrong id).
    pub known: bool,
    /// Failures since it was last quiet for the throttle's window.
    pub failures: u32,
    /// How long a failure now would be held back (zero: within its budget).
    pub hold: Duration,
    /// Time since its last failure.
    pub since_last: Duration,
}

/// A provider as routing sees it, for status pages.
#[derive(Clone, Debug, PartialEq)]
pub struct ProviderRouting {
    /// The node's configured id.
    pub node_id: Arc<str>,
    /// The provider on that node (its adapter instance name).
    pub provider_id: Arc<str>,
    /// In the rotation, ejected, or due (or in) its probe.
    pub standing: Standing,
    /// How much longer its ejection lasts, while it is ejected.
    pub ejected_for: Option<Duration>,
    /// Failures before the first byte in a row.
    pub consecutive_failures: u32,
    /// The share of its outcomes within the ejection window that failed, 0 to 1.
    pub failure_share: f64,
    /// The average first-byte latency, once it answered.
    pub first_byte: Option<Duration>,
    /// Units its node's work for an earlier Edge process still holds (a re-homed node's
    /// draining session), counted as taken here.
    pub held_elsewhere: u32,
    /// Units held back since its node refused work the ledger had room for
    /// (`Usage::refused_hold` of the ledger).
    pub refused_hold: u32,
}

/// A failed registration whose answer the throttle holds back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Throttled {
    /// The budget that ran out: the claimed node id's, or the source's.
    pub by: ThrottledBy,
    /// How long the answer waits.
    pub hold: Duration,
    /// When the peer is told to come back.
    pub retry_after: Duration,
}

/// Why a node could not take its configuration.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RefreshFailure {
    /// It answered a refresh with this status (an unknown status counts as `FAILED`).
    #[error("config refresh answered {status:?}: {message}")]
    Answered {
        /// The status the node answered.
        status: RefreshStatus,
        /// The node's message.
        message: String,
    },
    /// It left the refresh unanswered this many times.
    #[error("config refresh unanswered {0} times")]
    Unanswered(u32),
}

/// Why a node gets no new work and is closed once its last lease returns.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DrainReason {
    /// It could not take its configuration.
    #[error(transparent)]
    Refresh(#[from] RefreshFailure),
    /// It is stopping gracefully (`NodeDrainRequest`), with the reason it gave.
    #[error("node stopping: {0}")]
    Stopping(String),
    /// This Edge process is handing over to a successor ([`crate::EdgeCore::handle_rehome`]);
    /// `told` when the node was sent `NodeRehomeRequest` (it already dials the successor),
    /// otherwise it learns from the close once its work has ended.
    #[error("edge handing over (node told to re-home: {told})")]
    HandingOver {
        /// Whether the node was sent `NodeRehomeRequest`.
        told: bool,
    },
    /// In a cluster, this Edge can no longer vouch for the node instance: its membership
    /// or the node's lease in etcd could not be renewed in time (docs/cluster.md).
    #[error("cluster: {0}")]
    Cluster(&'static str),
}

/// The id of a node command on the wire (`cmd-<n>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CommandId(pub u64);

impl CommandId {
    /// The command a wire request id names, if it is one of this Edge's.
    #[must_use]
    pub fn parse(text: &str) -> Option<CommandId> {
        text.strip_prefix("cmd-")?.parse().ok().map(CommandId)
    }
}

impl std::fmt::Display for CommandId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cmd-{}", self.0)
    }
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
        /// The model group.
        model: String,
        /// The queue's limit (`max_waiting`) it hit.
        max_waiting: usize,
    },
    /// This Edge process has handed its nodes to a successor
    /// ([`crate::EdgeCore::handle_rehome`]) and dispatches nothing more; the caller may
    /// retry at once (the listener leads to the successor).
    #[error("the edge is handing over to a new process; retry")]
    HandingOver,
    /// The prompt, as estimated, is larger than the model's context window
    /// ([`ModelSpec::context_tokens`](crate::edge_config::ModelSpec::context_tokens)).
    #[error("prompt is too long: {tokens} tokens > {max} maximum")]
    PromptTooLong {
        /// The prompt's estimated tokens.
        tokens: u64,
        /// The model's context window.
        max: u64,
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
        /// The node named in the command.
        node: String,
        /// Adapter named.
        adapter: String,
    },
}

/// A caller's request, handed to the machine whole: from [`EdgeCore::handle_submit`](super::EdgeCore::handle_submit) to
/// its end the machine owns it, builds the message each dispatch sends (a normalized run
/// or a raw tunnel, as the chosen provider is served) and answers with
/// [`RequestEvent`]s.
#[derive(Clone, Debug, PartialEq)]
pub struct Submit {
    /// Public model name (the model group).
    pub model: Arc<str>,
    /// The OpenAI endpoint called. Chat can be served by runs or tunnels; every other
    /// endpoint is a raw OpenAI call only a tunnel-served provider can answer.
    pub endpoint: Endpoint,
    /// The request body as received (JSON). A tunnel carries it with `model` rewritten
    /// to the provider's target; a run carries it as its input.
    pub body: Bytes,
    /// Whether the caller asked for a stream.
    pub stream: bool,
    /// Estimated prompt tokens, compared with the model's long-context threshold.
    pub prompt_tokens: u64,
    /// Request headers a tunnel forwards to the provider (allow-listed by the shell, see
    /// [`crate::tunnel::forwards_request_header`]); shared with every dispatch of it.
    pub headers: crate::wire::ForwardedHeaders,
    /// The caller's request id (`x-request-id`), sent to the node in each dispatch's
    /// metadata so both sides' logs name the same request.
    pub request_id: Arc<str>,
    /// The longest the node may take over one provider call.
    pub timeout: Duration,
    /// The caller's own call, when it came in a dialect some providers serve themselves:
    /// a tunnel-served provider whose adapter says so is sent it (its `model` rewritten)
    /// instead of `body`, and [`RequestEvent::Dispatched`] says `native`.
    pub native: Option<NativeCall>,
    /// The session the caller named (a header or body field the shell read, see
    /// [`Placement`](crate::edge::Placement)): in a group placing requests by their
    /// conversation, every request of a session goes to the same provider.
    pub session: Option<Arc<str>>,
}

/// A call as the caller wrote it, for providers that serve its dialect themselves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NativeCall {
    /// Its dialect.
    pub dialect: crate::tunnel::Dialect,
    /// Its body as received.
    pub body: Bytes,
}

impl Submit {
    /// A chat completion request for `model` with `body`, no forwarded headers, a
    /// minute's provider timeout: what tests and simple embedders need.
    #[must_use]
    pub fn chat(model: &str, body: Bytes) -> Self {
        Submit {
            model: model.into(),
            endpoint: Endpoint::Chat,
            body,
            stream: false,
            prompt_tokens: 0,
            headers: crate::wire::ForwardedHeaders::default(),
            request_id: Arc::from(""),
            timeout: Duration::from_secs(60),
            native: None,
            session: None,
        }
    }

    /// Only a tunnel-served provider can answer it.
    #[must_use]
    pub fn tunnel_only(&self) -> bool {
        self.endpoint != Endpoint::Chat
    }
}

/// What happens to a request, for its caller, in order: `Dispatched` once the provider
/// that answers it is known, then that run's events or tunnel frames, then `Ended`
/// exactly once (also without a `Dispatched`, when it never got that far).
#[derive(Clone, Debug, PartialEq)]
pub enum RequestEvent {
    /// The request is answered by this provider, with this shape.
    Dispatched {
        /// The dispatch (its `run_id` on the wire).
        run: RunId,
        /// Tunnel or run.
        shape: DispatchShape,
        /// Node chosen.
        node_id: Arc<str>,
        /// Adapter instance chosen on it.
        provider_id: Arc<str>,
        /// The provider is sent the caller's own call ([`Submit::native`]) and answers in
        /// its dialect.
        native: bool,
    },
    /// A valid, in-order run event (boxed: a request's events queue in the shell, each
    /// taking the room of the largest kind).
    Run(Box<RunEvent>),
    /// A valid, in-order tunnel frame (a body chunk as its bytes alone).
    Tunnel(TunnelPart),
    /// Valid, in-order tunnel frames that arrived together (the parts of one merged
    /// frame, a small answer's status, body, usage and end): the same as each in turn as
    /// a [`RequestEvent::Tunnel`], handed over as one event.
    Tunnels(Vec<TunnelPart>),
    /// The end: nothing more arrives for the request, and its lease is back or on its
    /// way (a cancelled run keeps it until the node confirms).
    Ended(Outcome),
}

/// What a cancel found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cancelled {
    /// The request was open: it ended now, [`Outcome::Cancelled`].
    Now,
    /// It had already ended (or never existed): nothing to do. A caller that leaves just
    /// as its request ends races the machine; this is that race, not a misuse.
    AlreadyEnded,
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
    /// The node id, as configured.
    pub node_id: Arc<str>,
    /// Whether a connection holds it and whether it is ready for work.
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
    /// keeps it and newcomers are held off (see [`Admission::conflict`](crate::edge_config::Admission::conflict)).
    pub conflict: bool,
    /// TLS version of the owning connection; `None` when plaintext or offline.
    pub tls: Option<&'static str>,
    /// Whether the owning connection presented a verified client certificate.
    pub client_certificate: bool,
    /// The node gets no new work and is closed once its last lease returns: it failed to
    /// take its configuration (see [`CloseReason::RefreshFailed`]) or asked to stop
    /// gracefully (see [`CloseReason::Drained`]).
    pub draining: bool,
    /// Software version the node reported in its last accepted register; `None` until
    /// it has registered once.
    pub version: Option<String>,
    /// Labels the node reported in its last accepted register (sorted by key).
    pub labels: BTreeMap<String, String>,
    /// Round-trip time of the Edge's last heartbeat the owning connection answered, at
    /// the resolution of [`Timestamp`](crate::time::Timestamp) (milliseconds).
    pub rtt: Option<Duration>,
    /// Time since the owning connection last sent anything; `None` when offline.
    pub last_seen: Option<Duration>,
}
