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
//! What an embedder uses; the machines' internals (the lease ledger, the wait queue, the
//! registration guards, the Node's capacity gates) are private, and reached by tests,
//! benches and fuzz targets through `testkit::internals` (feature `testkit`).
//! - [`wire`]: the generated message types, the length-prefixed frame codec and the
//!   contract validation of each message.
//! - [`time`]: [`Timestamp`], the only notion of time the machines know, and [`timer`]:
//!   the keyed timer table every machine keeps its deadlines in.
//! - [`edge`]: the Edge machine ([`EdgeCore`]): node registry and generation fencing,
//!   provider leases and the wait queue, resilient routing, and the requests it owns from
//!   submit to end; configured by [`edge_config`] ([`EdgeConfig`]).
//! - [`session`]: the Node session machine ([`NodeSession`]), and [`reconnect`]: the
//!   reconnect policy and its [`Supervisor`]. The Node side does not use the Edge's.
//! - [`cluster`]: one Edge's part in a cluster of Edges coordinated through etcd
//!   ([`cluster::ClusterMember`]: membership by lease, the shared configuration, a node id
//!   owned once cluster-wide), which `iop-edge` drives in cluster mode, and a Node's links
//!   to the members ([`cluster::MemberLinks`]).
//! - [`run`] and [`tunnel`]: the contract sequencers of normalized runs and raw tunnels
//!   (what a stream may say in which order, which headers a tunnel forwards, the route a
//!   request came by).
//! - [`token`]: constant-time credential checks (node tokens, API keys).
//!
//! Beside it, and never below it: `iop-http1` (HTTP/1.1 framing), `iop-api` (the public
//! API dialects, response rendering, tenant accounting), `iop-trace` (W3C Trace Context
//! and OTLP spans), `iop-json` (JSON bodies read without a tree; the core uses it to put
//! a provider's model name in a tunnel's body), and `iop-testkit` (the simulations).
//!
//! ## The machine contract
//! Every machine ([`EdgeCore`], [`NodeSession`], [`Supervisor`],
//! [`cluster::ClusterMember`]) is driven the same way:
//! - **inputs** are `handle_*(now, …)` calls. Those that can be misused return
//!   `Result<_, the machine's error>`: an `Err` means the driver gave an input that does
//!   not fit the machine's state, a bug to log, never a peer's fault to ignore. Inputs
//!   that fit every state (`handle_timeout`, most of the cluster's) return nothing. What
//!   a peer does wrong is not an error of the call: it becomes a typed violation in an
//!   event or a close.
//! - **outputs** are drained after every input, transmits first: `poll_transmit` until
//!   `None` (bytes for the socket, in order, including the close), then `poll_event`
//!   until `None` (the Edge also has `poll_lifecycle`, what an operator sees). Acting on
//!   an event may feed the machine again, so drain until all are empty.
//! - **time** is a [`Timestamp`] passed in. `poll_timeout` returns the next [`Wake`] (its
//!   instant and why); call `handle_timeout(now)` once it has passed. A spurious call
//!   does nothing.
//! - events are enums a driver matches on; most are `#[non_exhaustive]` so that the wire
//!   can grow without breaking embedders, so a driver keeps a catch-all arm and logs what
//!   it does not know.
//!
//! ## Example: an Edge and a Node driven against each other
//! The whole handshake and one run, in memory. A real driver puts `wire::encode` and a
//! [`wire::FrameDecoder`] between the two (see `examples/blocking.rs`, which does this
//! over `std::net` sockets with no async runtime); here envelopes are handed across.
//! ```
//! use iop_proto_core::wire::{AdapterConfig, AdapterType, NodeRuntimeConfig};
//! use iop_proto_core::*;
//!
//! let token = "a-node-token-of-some-length";
//! let mut config = EdgeConfig::default();
//! config.nodes.insert("n1".into(), NodeSpec {
//!     token: TokenVerifier::from_secret(token.as_bytes()),
//!     adapters: vec![AdapterConfig {
//!         name: "mock".into(), r#type: AdapterType::Mock as i32, base_url: "mock://".into(),
//!         capacity: 1, targets: vec!["t".into()], enabled: true, ..Default::default()
//!     }],
//!     runtime: NodeRuntimeConfig::default(),
//! });
//! config.models.insert("demo".into(), ModelSpec {
//!     candidates: vec![CandidateSpec { node_id: "n1".into(), provider_id: "mock".into(), target: "t".into() }],
//!     long_context_threshold: None,
//!     context_tokens: None,
//!     first_byte_timeout: None,
//!     resume_limit: None,
//!     stall_timeout: None,
//!     affinity: None,
//! });
//! let mut edge = EdgeCore::new(config)?;
//! let mut node = NodeSession::new(SessionConfig::new("n1", token));
//! let (conn, now) = (ConnId(1), Timestamp::ZERO);
//! edge.handle_connection_opened(now, conn, Peer::default())?;
//! node.handle_connected(now)?;
//!
//! let mut answer = String::new();
//! let mut submitted = false;
//! loop {
//!     let mut moved = false;
//!     // The node's transmits go to the Edge...
//!     while let Some(transmit) = node.poll_transmit() {
//!         moved = true;
//!         if let NodeTransmit::Frame(envelope) = transmit {
//!             edge.handle_envelope(now, conn, envelope)?;
//!         }
//!     }
//!     // ...the Edge's to the node...
//!     while let Some(transmit) = edge.poll_transmit() {
//!         moved = true;
//!         // A frame, or a tunnel request with its message built (a shell writes that
//!         // with `TunnelDispatch::encode` instead).
//!         if let Some((_, envelope)) = transmit.frame() {
//!             node.handle_envelope(now, envelope)?;
//!         }
//!     }
//!     // ...then each side acts on its events, which may queue more transmits.
//!     while let Some(event) = node.poll_event() {
//!         moved = true;
//!         match event {
//!             SessionEvent::ApplyConfig { .. } => node.handle_config_applied(now, Ok(()))?,
//!             SessionEvent::StartRun { request } => {
//!                 // The provider's answer, as an adapter would report it.
//!                 node.handle_run_output(now, &request.run_id, RunOutput::Start)?;
//!                 node.handle_run_output(now, &request.run_id, RunOutput::Delta("Hi!".into()))?;
//!                 let done = RunOutput::Complete { usage: None, metadata: Default::default() };
//!                 node.handle_run_output(now, &request.run_id, done)?;
//!             }
//!             _ => {}
//!         }
//!     }
//!     while let Some(event) = edge.poll_event() {
//!         moved = true;
//!         match event {
//!             EdgeEvent::NodeConnected { .. } if !submitted => {
//!                 submitted = true;
//!                 // The whole request: the Edge builds and sends its dispatch itself.
//!                 let body = bytes::Bytes::from_static(br#"{"model":"demo","messages":[]}"#);
//!                 edge.handle_submit(now, Submit::chat("demo", body))?;
//!             }
//!             EdgeEvent::Request { event, .. } => match event {
//!                 RequestEvent::Run(event) => answer.push_str(&event.delta),
//!                 RequestEvent::Ended(outcome) => assert_eq!(outcome, Outcome::Completed),
//!                 _ => {}
//!             },
//!             _ => {}
//!         }
//!     }
//!     if !moved {
//!         break;
//!     }
//! }
//! assert_eq!(answer, "Hi!");
//! assert_eq!(node.state(), SessionState::Ready);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
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

#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub mod cluster;
pub mod edge;
pub mod edge_config;
// Internals: public items, reached from outside only through `testkit::internals` (tests,
// benches, fuzz targets), so in a build without the test kit some are unused.
#[cfg_attr(not(feature = "testkit"), allow(unreachable_pub, dead_code))]
mod gate;
#[cfg_attr(not(feature = "testkit"), allow(unreachable_pub, dead_code))]
mod guard;
mod idhash;
#[cfg_attr(not(feature = "testkit"), allow(unreachable_pub, dead_code))]
mod lease;
#[cfg_attr(not(feature = "testkit"), allow(unreachable_pub, dead_code))]
mod queue;
pub mod reconnect;
pub mod run;
pub mod session;
pub mod time;
pub mod timer;
pub mod token;
pub mod tunnel;
pub mod wire;

#[cfg(feature = "testkit")]
pub mod testkit;

// The embedding API: what a driver names to run an Edge or a Node. Everything else is
// reached through its module (`edge::`, `edge_config::`, `session::`, `reconnect::`, ...).
pub use edge::{
    Cancelled, CloseReason, ConnId, DispatchShape, EdgeCore, EdgeEvent, Lifecycle, Outcome, Peer,
    RequestError, RequestEvent, RequestId, RunId, Submit, SubmitError, Transmit,
};
pub use edge_config::{CandidateSpec, EdgeConfig, EdgeConfigError, ModelSpec, NodeSpec};
pub use reconnect::{ExitReason, Failure, ReconnectPolicy, Supervisor, SupervisorEvent};
pub use session::{
    NodeSession, NodeTransmit, RunOutput, SessionConfig, SessionEnd, SessionError, SessionEvent,
    SessionState, TunnelOutput,
};
pub use time::Timestamp;
pub use timer::Wake;
pub use token::TokenVerifier;
