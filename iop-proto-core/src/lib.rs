//! # iop-proto-core
//!
//! The Sans-IO protocol core of IOP, an LLM serving fabric in which **Nodes** running
//! beside LLM providers dial out to an **Edge** that serves an OpenAI-compatible API.
//!
//! Every protocol decision lives here as plain data structures and state machines driven
//! by explicit inputs and timestamps. Nothing in this crate opens a socket, reads a clock,
//! spawns a task or sleeps: the `iop-edge` and `iop-node` binaries are thin tokio shells
//! around it, and any other runtime (even blocking `std::net`) can drive it the same way.
//!
//! ## Modules
//! - [`wire`]: the generated message types, the length-prefixed frame codec and the
//!   contract validation of each message.
//! - [`time`]: [`Timestamp`], the only notion of time the machines know.
//! - [`edge`]: the Edge machine ([`EdgeCore`]): registry, generation fencing, dispatch
//!   and the streams of dispatched requests, over [`lease`] (the lease ledger) and
//!   [`queue`] (the provider-pool wait queue), configured by [`edge_config`].
//! - [`run`] and [`tunnel`]: the contract sequencers of normalized runs and raw tunnels.
//! - [`session`]: the Node session machine ([`NodeSession`]), with [`gate`] (per-adapter
//!   capacity) and [`reconnect`] (the reconnect policy and its [`Supervisor`]).
//! - [`token`]: constant-time credential checks (node tokens, API keys), and [`guard`]:
//!   the per-source back-off of failed registrations and node-id conflict detection.
//!
//! ## Example: framing a message and reading it back
//! ```
//! use bytes::BytesMut;
//! use iop_proto_core::wire::{self, Body, CancelKind, CancelRequest, Envelope, Validate};
//!
//! let cancel = Envelope::new(Body::CancelRequest(CancelRequest {
//!     run_id: "run-42".into(),
//!     kind: CancelKind::CancelRun as i32,
//!     reason: "caller disconnected".into(),
//! }));
//! let mut socket_bytes = BytesMut::new();
//! wire::encode(&cancel, &mut socket_bytes)?;
//!
//! let mut decoder = wire::FrameDecoder::new();
//! decoder.push_bytes(socket_bytes.freeze());
//! let received = decoder.next_envelope()?.expect("one whole frame");
//! received.validate()?;
//! assert_eq!(received, cancel);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![warn(missing_docs)]
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub mod edge;
pub mod edge_config;
pub mod gate;
pub mod guard;
mod idhash;
pub mod lease;
pub mod openai;
pub mod queue;
pub mod reconnect;
pub mod run;
pub mod session;
pub mod time;
pub mod timer;
pub use timer::Wake;
pub mod token;
pub mod tunnel;
pub mod wire;

#[cfg(feature = "testkit")]
pub mod testkit;

pub use edge::{
    AUTH_FAILED, CloseReason, CommandError, CommandId, ConnId, ConnViolation, Dispatch,
    DispatchShape, EdgeCore, EdgeError, EdgeEvent, Grant, NodeState, NodeStatus, Outcome, Peer,
    RefreshFailure, RejectReason, RequestError, RunId, StreamViolation, Submit, SubmitError,
    Transmit, UsageError, Violation,
};
pub use edge_config::{
    Admission, CandidateSpec, ConfigDiff, EdgeConfig, EdgeConfigError, EdgeTiming, ModelSpec,
    NodeSpec, QueueLimits,
};
pub use gate::{CapacityGate, GateError};
pub use guard::{
    AuthThrottle, ConflictLimits, Contest, FlapGuard, PendingConnections, PendingLimits, Source,
    ThrottleLimits,
};
pub use lease::{Generation, Lease, Ledger, Release, RequestId, ResourceId};
pub use queue::{Candidate, Ticket, WaitQueue, Waiter};
pub use reconnect::{
    Backoff, ExitReason, Failure, MaxAttempts, ReconnectConfigError, ReconnectPolicy, Supervisor,
    SupervisorError, SupervisorEvent, SupervisorState,
};
pub use run::{RunEmitter, RunStep, RunTracker, RunViolation};
pub use session::{
    AdapterDiff, CancelError, EdgeViolation, NodeSession, NodeTransmit, RunOutput, SessionConfig,
    SessionEnd, SessionError, SessionEvent, SessionState, TunnelOutput, WorkRefusal, diff_adapters,
};
pub use time::Timestamp;
pub use token::{SecretError, TokenVerifier};
pub use tunnel::{TunnelEmitter, TunnelReceiver, TunnelStep, TunnelViolation};
