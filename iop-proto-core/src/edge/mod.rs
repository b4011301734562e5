//! The Edge machine: node registry with generation fencing, provider leases, the
//! provider-pool wait queue, and the requests it owns from submit to end.
//!
//! Drive it with the convention of every machine in this crate:
//! 1. feed inputs: [`handle_connection_opened`](EdgeCore::handle_connection_opened),
//!    [`handle_envelope`](EdgeCore::handle_envelope),
//!    [`handle_connection_closed`](EdgeCore::handle_connection_closed),
//!    [`handle_submit`](EdgeCore::handle_submit), [`handle_cancel`](EdgeCore::handle_cancel),
//!    [`handle_command`](EdgeCore::handle_command), [`handle_config`](EdgeCore::handle_config)
//!    and [`handle_timeout`](EdgeCore::handle_timeout);
//! 2. after each, drain [`poll_transmit`](EdgeCore::poll_transmit) (frames to write,
//!    connections to close, in order), [`poll_event`](EdgeCore::poll_event) (what the
//!    shell acts on: each request's [`RequestEvent`]s, node changes for its logs and
//!    metrics) and [`poll_lifecycle`](EdgeCore::poll_lifecycle) (what an operator sees);
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
//! - The machine owns each request, body included, from [`EdgeCore::handle_submit`] to
//!   its end: it picks the provider, builds and sends the dispatch, checks the stream and
//!   hands the caller's events out. Every accepted request ends exactly once
//!   ([`RequestEvent::Ended`]).
//! - A ready owner's `NodeDrainRequest` (a graceful stop), like a failed config refresh,
//!   drains the node: nothing new is dispatched to it, what runs there ends normally, and
//!   its connection is closed ([`CloseReason::Drained`]) once its last lease returns.
//!   While a node stopping so is live, a newer register for its id is held off
//!   ([`RejectReason::Draining`]) instead of superseding it.
//!
//! Inside (for contributors; none of it is public): its state is four sub-states that
//! own their data and their rules (quinn-proto's `connection/` shape): the node registry
//! (`registry.rs`: connections, ownership, admission), the provider pool (`pool.rs` and
//! `health.rs`: leases, model groups, picking, provider health, the wait queue), the
//! requests (`requests.rs`: each request, its runs and their streams) and the control
//! traffic (`control.rs`: commands, config refreshes). Each works through a narrow
//! context: the time, the outbox, the timer table, the wait queue. The rules that cross
//! them (a register superseding an owner, a fence failing requests, a freed lease serving
//! a waiter, a failed run retried elsewhere) are in one file, `transitions.rs`, as a
//! readable list.

use std::collections::VecDeque;
use std::time::Duration;

use crate::edge_config::{EdgeConfig, EdgeConfigError};
use crate::queue::WaitQueue;
use crate::time::Timestamp;
use crate::timer::{TimerTable, Wake};
use crate::wire::{Body, Envelope};

mod affinity;
mod cluster;
mod control;
mod dispatch;
mod health;
mod lifecycle;
mod pool;
mod registry;
mod requests;
mod timers;
mod transitions;
mod types;
mod violation;

pub use crate::lease::{Generation, RequestId, ResourceId, RunId};
pub use affinity::{
    Affinity, AffinityFigures, AffinityMode, MAX_SESSION_KEY, Placed, Placement, PrefixIndex,
    SESSION_HEADERS,
};
pub use dispatch::TunnelDispatch;
pub use health::{Ejection, Standing};
pub use lifecycle::Lifecycle;
pub use registry::throttled_reason;
pub use types::*;
pub use violation::*;

use timers::TimerKey;

/// The Edge protocol machine. See the [module documentation](self).
#[derive(Debug)]
pub struct EdgeCore {
    config: EdgeConfig,
    registry: registry::Registry,
    pub(crate) pool: pool::Pool,
    requests: requests::Requests,
    control: control::Control,
    timers: TimerTable<TimerKey>,
    first_bytes: timers::Deadlines,
    out: Outbox,
    now: Timestamp,
    cluster: cluster::ClusterState,
    /// Which provider this Edge sent which prompts to, and how requests were placed.
    prefixes: affinity::PrefixIndex,
    placed: [u64; 4],
    matched_blocks: u64,
}

/// What the machine hands out, in order: transmits for the transport, events for the
/// shell, lifecycle events for operators. Every sub-state pushes into this one outbox.
#[derive(Debug, Default)]
struct Outbox {
    transmits: VecDeque<Transmit>,
    events: VecDeque<EdgeEvent>,
    lifecycle: VecDeque<Lifecycle>,
}

impl Outbox {
    /// A frame for `conn`.
    fn send(&mut self, conn: ConnId, body: Body) {
        self.transmits.push_back(Transmit::Frame {
            conn,
            envelope: Envelope::new(body),
        });
    }

    /// A tunnel request for `conn`.
    fn send_tunnel(&mut self, conn: ConnId, dispatch: TunnelDispatch) {
        self.transmits
            .push_back(Transmit::Tunnel { conn, dispatch });
    }

    /// An event, with the lifecycle events it means to an operator.
    fn event(&mut self, event: EdgeEvent) {
        lifecycle::of(&event, &mut self.lifecycle);
        self.events.push_back(event);
    }

    /// An event of `request`, for its caller. A tunnel part that follows another of the
    /// same request with nothing between them joins it ([`RequestEvent::Tunnels`]).
    fn request(&mut self, request: RequestId, event: RequestEvent) {
        if let RequestEvent::Tunnel(part) = event {
            if let Some(EdgeEvent::Request {
                request: last,
                event: previous @ (RequestEvent::Tunnel(_) | RequestEvent::Tunnels(_)),
            }) = self.events.back_mut()
                && *last == request
            {
                match previous {
                    RequestEvent::Tunnels(parts) => parts.push(part),
                    RequestEvent::Tunnel(first) => {
                        let first = std::mem::replace(first, crate::tunnel::TunnelPart::End);
                        let mut parts = Vec::with_capacity(4);
                        parts.push(first);
                        parts.push(part);
                        *previous = RequestEvent::Tunnels(parts);
                    }
                    _ => {}
                }
                return;
            }
            self.events.push_back(EdgeEvent::Request {
                request,
                event: RequestEvent::Tunnel(part),
            });
            return;
        }
        self.events.push_back(EdgeEvent::Request { request, event });
    }
}

/// What a sub-state may touch besides itself: the time, the outbox and the timers.
struct Cx<'a> {
    now: Timestamp,
    out: &'a mut Outbox,
    timers: &'a mut TimerTable<TimerKey>,
    /// The wait queue: a request that ends leaves it.
    waits: &'a mut WaitQueue,
}

/// The context of `$core`'s sub-states, borrowing its outbox, timers and wait queue (a
/// macro, so the borrow stays on those fields and the sub-states stay free to borrow).
macro_rules! cx {
    ($core:ident) => {
        crate::edge::Cx {
            now: $core.now,
            out: &mut $core.out,
            timers: &mut $core.timers,
            waits: &mut $core.pool.queue,
        }
    };
}
use cx;

/// The run id on the wire for a request's first dispatch (see [`RunId`]).
#[must_use]
pub fn run_id_of(request: RequestId) -> String {
    RunId::first(request).wire()
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
            pool: pool::Pool::default(),
            requests: requests::Requests::default(),
            control: control::Control::default(),
            timers: TimerTable::new(),
            first_bytes: timers::Deadlines::default(),
            out: Outbox::default(),
            now: Timestamp::ZERO,
            cluster: cluster::ClusterState::default(),
            prefixes: affinity::PrefixIndex::new(config.routing.affinity.prefix_entries),
            placed: [0; 4],
            matched_blocks: 0,
        };
        core.install(config);
        Ok(core)
    }

    /// The configuration in force.
    #[must_use]
    pub fn config(&self) -> &EdgeConfig {
        &self.config
    }

    /// The next frame to write or connection to close.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.out.transmits.pop_front()
    }

    /// The next event.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<EdgeEvent> {
        self.settle_cluster();
        self.out.events.pop_front()
    }

    /// The next lifecycle event: what the fleet's life looks like to an operator (node
    /// registered, ready, fenced, in conflict, draining; refused registrations; config
    /// refreshes; provider health), in the order it happened. Nothing in the machine
    /// waits for it to be taken.
    #[must_use]
    pub fn poll_lifecycle(&mut self) -> Option<Lifecycle> {
        self.out.lifecycle.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) must next be called, and which timer
    /// it is for.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Wake> {
        let earliest = crate::timer::earliest;
        earliest(
            earliest(self.timers.next(), self.queue_deadline()),
            self.first_bytes.next(),
        )
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
    ) -> Result<(), UsageError> {
        self.advance(now);
        self.open_connection(conn, peer)
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
        self.secure_connection(conn, tls, identities)
    }

    /// The transport reports the connection closed (by the peer, an IO error, or after a
    /// requested [`Transmit::Close`]).
    pub fn handle_connection_closed(
        &mut self,
        now: Timestamp,
        conn: ConnId,
    ) -> Result<(), UsageError> {
        self.advance(now);
        self.cluster.closed(conn);
        self.connection_closed(conn)
    }

    /// Bytes arrived on `conn` without completing a frame. Liveness counts them (a large
    /// frame on a slow link may take longer than the heartbeat timeout to arrive whole);
    /// the handshake deadline of a connection that has not registered does not move.
    /// A shell may call this at most every so often; a decoded envelope counts anyway.
    pub fn handle_bytes_received(
        &mut self,
        now: Timestamp,
        conn: ConnId,
    ) -> Result<(), UsageError> {
        self.advance(now);
        self.bytes_received(conn)
    }

    /// An envelope decoded from a connection.
    pub fn handle_envelope(
        &mut self,
        now: Timestamp,
        conn: ConnId,
        envelope: Envelope,
    ) -> Result<(), UsageError> {
        self.advance(now);
        self.on_envelope(conn, envelope)
    }

    /// Expires timers due at or before `now`. A spurious call does nothing.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        self.advance(now);
        while let Some(key) = self.timers.pop_expired(self.now) {
            self.fire(key);
        }
        while let Some(run) = self.first_bytes.pop_due(self.now) {
            self.slow_first_byte(run);
        }
        self.expire_waiters();
    }

    /// A caller's request. It is dispatched at once when a candidate has room, else it
    /// waits in its model group's queue until capacity frees or the wait times out; either
    /// way its [`RequestEvent`]s come from [`poll_event`](Self::poll_event).
    pub fn handle_submit(
        &mut self,
        now: Timestamp,
        submit: Submit,
    ) -> Result<RequestId, SubmitError> {
        self.advance(now);
        self.submit(submit)
    }

    /// This Edge process hands over to a successor that already holds its listeners (an
    /// upgrade or a restart): from now on nothing is dispatched here. Each ready node
    /// that can re-home (`RegisterRequest.rehome`) is sent `NodeRehomeRequest` and dials
    /// the successor at once, reporting to it the capacity its work here still holds;
    /// every ready node drains: what runs here goes on to its end and its connection is
    /// closed after its last lease returns ([`CloseReason::Drained`]). Pending and later
    /// registrations are refused with a retry at once ([`RejectReason::HandingOver`]),
    /// requests still waiting for capacity (or whose run a node refuses afterwards, full
    /// from another Edge's work) end with [`RequestError::HandingOver`] and
    /// later submits fail with [`SubmitError::HandingOver`]; both are safe to retry,
    /// since nothing reached a provider. A second call changes nothing.
    pub fn handle_rehome(&mut self, now: Timestamp) {
        self.advance(now);
        if !self.registry.handing_over {
            self.rehome();
        }
    }

    /// Whether [`handle_rehome`](Self::handle_rehome) was called.
    #[must_use]
    pub fn is_handing_over(&self) -> bool {
        self.registry.handing_over
    }

    /// The caller gave up on `request` (disconnect, response timeout, write failure).
    /// A waiting request leaves the queue; a running one is cancelled on its node with
    /// `CancelRequest(CANCEL_RUN)` and keeps its lease until the node confirms or the
    /// cancel grace passes. It ends now with [`Outcome::Cancelled`].
    pub fn handle_cancel(&mut self, now: Timestamp, request: RequestId, reason: &str) -> Cancelled {
        self.advance(now);
        self.cancel(request, reason)
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
        request: crate::wire::NodeCommandRequest,
    ) -> Result<CommandId, CommandError> {
        self.advance(now);
        self.command(node_id, request)
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
        self.reconfigure(config)
    }
}
