//! How a node can break the protocol, from the connection's grammar (the connection is
//! closed) down to one run's stream (that run fails): what the Edge reports in
//! [`EdgeEvent::PeerViolation`](super::EdgeEvent::PeerViolation), with a stable label
//! for metrics.

use crate::lease::RunId;
use crate::run::RunViolation;
use crate::tunnel::TunnelViolation;
use crate::wire::ValidationError;

/// How a node broke the protocol; [`Violation::label`] names it for metrics.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// The connection's own grammar: the connection is closed.
    #[error("{0}")]
    Connection(ConnViolation),
    /// One run's stream: that run fails and is cancelled on the node.
    #[error("{run}: {violation}")]
    Stream {
        /// The run whose stream broke the contract.
        run: RunId,
        /// What it broke.
        violation: StreamViolation,
    },
    /// A run event or tunnel frame that names no run of the connection: dropped.
    #[error("a message for no run of this connection: {0}")]
    Stray(ValidationError),
}

impl Violation {
    /// A stable name for metric labels and logs.
    #[must_use]
    pub fn label(&self) -> &'static str {
        match self {
            Violation::Connection(v) => v.label(),
            Violation::Stream { violation, .. } => violation.label(),
            Violation::Stray(_) => "stray_message",
        }
    }
}

/// How a node broke its connection's grammar (the connection is closed).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConnViolation {
    /// A message that breaks the message contract (not about one run).
    #[error("invalid message: {0}")]
    Invalid(ValidationError),
    /// A second `RegisterRequest` on one connection.
    #[error("second RegisterRequest on one connection")]
    SecondRegister,
    /// A run event or tunnel frame before the register was accepted.
    #[error("stream message before register")]
    StreamBeforeRegister,
    /// A run event or tunnel frame before the ready handshake completed.
    #[error("stream message before ready")]
    StreamBeforeReady,
    /// A `NodeReadyRequest` naming another node id than the registered one.
    #[error("ready for another node id")]
    ReadyForAnotherNode,
    /// A message only the Edge sends.
    #[error("{0} is not a node-to-edge message")]
    WrongDirection(&'static str),
    /// A `NodeDrainRequest` from a connection that is not its node's ready owner (a node
    /// that has not become ready has nothing to drain: it closes instead).
    #[error("NodeDrainRequest before ready")]
    DrainBeforeReady,
    /// A `NodeLoadReport` from a connection that is not its node's ready owner.
    #[error("NodeLoadReport before ready")]
    LoadBeforeReady,
}

impl ConnViolation {
    /// A stable name for metric labels and logs.
    #[must_use]
    pub fn label(&self) -> &'static str {
        match self {
            ConnViolation::Invalid(_) => "invalid_message",
            ConnViolation::SecondRegister => "second_register",
            ConnViolation::StreamBeforeRegister => "stream_before_register",
            ConnViolation::StreamBeforeReady => "stream_before_ready",
            ConnViolation::ReadyForAnotherNode => "ready_for_another_node",
            ConnViolation::WrongDirection(_) => "wrong_direction",
            ConnViolation::DrainBeforeReady => "drain_before_ready",
            ConnViolation::LoadBeforeReady => "load_before_ready",
        }
    }
}

/// How a node broke one run's stream (that run fails; the connection stays).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StreamViolation {
    /// Out of the run event order.
    #[error(transparent)]
    Run(RunViolation),
    /// Out of the tunnel frame order.
    #[error(transparent)]
    Tunnel(TunnelViolation),
    /// A tunnel frame for a normalized run.
    #[error("tunnel frame for a run")]
    FrameForRun,
    /// A run event for a tunnel.
    #[error("run event for a tunnel")]
    EventForTunnel,
    /// A message that breaks the message contract (e.g. an unknown type).
    #[error("invalid message: {0}")]
    Invalid(ValidationError),
}

impl StreamViolation {
    /// A stable name for metric labels and logs.
    #[must_use]
    pub fn label(&self) -> &'static str {
        match self {
            StreamViolation::Run(_) => "run_order",
            StreamViolation::Tunnel(_) => "tunnel_order",
            StreamViolation::FrameForRun => "frame_for_run",
            StreamViolation::EventForTunnel => "event_for_tunnel",
            StreamViolation::Invalid(_) => "invalid_stream_message",
        }
    }
}
