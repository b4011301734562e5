//! The Edge's driver: the [`EdgeCore`] and what routes its outputs, shared by the tasks
//! that feed it. A node connection's reader, an HTTP handler or the timer takes the lock,
//! hands the machine its input, drains every output (frames to the connection's writer,
//! events to the request's channel) and lets go: no task in between, so a request crosses
//! one task boundary less in each direction than with a dedicated core task, and nothing
//! else ever touches protocol state. The lock is never held across an `.await`, and nothing run
//! under it takes it again.

use foldhash::{HashMap, HashMapExt};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use iop_proto_core::edge_config::ConfigDiff;
use iop_proto_core::wire::{self, Envelope};
use iop_proto_core::{
    Cancelled, CloseReason, ConnId, EdgeConfig, EdgeCore, RequestEvent, RequestId, SubmitError,
    Transmit,
};
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::conn::{ConnHandle, MAX_QUEUED_PER_CONNECTION, STALLED_AFTER};
use crate::events::EventHub;
use crate::memory::RequestMemory;
use crate::metrics::Metrics;
use crate::outbox::Outbox;
pub use crate::status::Snapshot;
pub use iop_api::openai::Endpoint;
use iop_shell_common::clock::Clock;
use iop_shell_common::misuse;

/// Bytes a request may have waiting for a slow client before it is cancelled.
pub const MAX_BUFFERED_PER_REQUEST: usize = 16 << 20;

/// A request's event channel, holding the request's memory (its body and the response
/// bytes buffered for it; the handler reports what it takes) and the core's answer to its
/// submission; dropping it returns that memory to the budget.
#[derive(Debug)]
pub struct Events {
    /// Events in order.
    pub rx: crate::inbox::Inbox<RequestEvent, Held>,
}

/// What a request's handler and the core's task share beside its events, in the event
/// queue's own allocation.
#[derive(Debug)]
pub struct Held {
    memory: RequestMemory,
    /// The core's answer to the submission, until the handler takes it.
    submitted: Mutex<Option<Result<RequestId, SubmitError>>>,
    /// When the request was first dispatched (its first attempt went to a provider), as
    /// the core's task heard it. Its `Dispatched` event comes later, once the provider
    /// that answers is known (the first byte, or a retry's), so it cannot say when the
    /// request left the queue. (A lock, set once: a `OnceLock`'s first set cost each
    /// request about 170 instructions, this one about 30.)
    first_dispatch: Mutex<Option<Instant>>,
}

impl Held {
    /// The request's first dispatch, as the core's task heard it: the first one told is
    /// kept.
    pub(crate) fn dispatched_at(&self, at: Instant) {
        self.first_dispatch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get_or_insert(at);
    }
}

impl Events {
    /// The request's memory.
    #[must_use]
    pub fn memory(&self) -> &RequestMemory {
        &self.rx.attached().memory
    }

    /// When the request was first dispatched, once it was (its first attempt, as the
    /// core's task heard it).
    #[must_use]
    pub fn first_dispatch(&self) -> Option<Instant> {
        *self
            .rx
            .attached()
            .first_dispatch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The core's answer to the request's submission ([`CoreMsg::Submit`]): its id, or
    /// why it was refused; `None` if the core's task ended without answering.
    pub async fn submitted(&mut self) -> Option<Result<RequestId, SubmitError>> {
        std::future::poll_fn(|cx| {
            self.rx.poll_attached(cx, |held| {
                held.submitted
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take()
            })
        })
        .await
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        self.memory().close();
    }
}

/// A request's event channel as the core's task holds it.
pub type EventOutlet = crate::inbox::Outlet<RequestEvent, Held>;

/// A request's event channel's two ends, holding accounting for it against `budget`.
#[must_use]
pub fn events(budget: Arc<crate::memory::Budget>) -> (EventOutlet, Events) {
    let (tx, rx) = crate::inbox::inbox_with(Held {
        memory: RequestMemory::new(budget),
        submitted: Mutex::new(None),
        first_dispatch: Mutex::new(None),
    });
    (tx, Events { rx })
}

/// The size a buffered event counts for.
#[must_use]
pub fn event_size(event: &RequestEvent) -> usize {
    match event {
        RequestEvent::Run(e) => e.delta.len() + 64,
        RequestEvent::Tunnel(part) => part.body_len() + 64,
        RequestEvent::Tunnels(parts) => parts.iter().map(|p| p.body_len() + 64).sum(),
        _ => 0,
    }
}

/// An input for the core.
#[derive(Debug)]
pub enum CoreMsg {
    /// A node connection was accepted.
    ConnOpened {
        /// Its id.
        conn: ConnId,
        /// What the transport knows of the peer so far (its address).
        peer: iop_proto_core::Peer,
        /// Its writer, frame limit and closer.
        handle: ConnHandle,
    },
    /// A node connection completed its TLS handshake.
    Secured {
        /// Connection.
        conn: ConnId,
        /// The negotiated version.
        tls: &'static str,
        /// Names of its verified client certificate, if any.
        identities: Vec<String>,
    },
    /// Bytes of a frame not yet whole arrived on a node connection.
    BytesReceived {
        /// Connection.
        conn: ConnId,
    },
    /// A node connection closed.
    ConnClosed {
        /// Connection.
        conn: ConnId,
    },
    /// A new request, whole: the core dispatches it.
    Submit {
        /// The request.
        submit: iop_proto_core::Submit,
        /// Where its events go, with the memory it holds; the core's answer (its id, or
        /// why it was refused) goes there too ([`Events::submitted`]).
        events: EventOutlet,
    },
    /// The caller gave up.
    Cancel {
        /// Request.
        request: RequestId,
        /// Why.
        reason: &'static str,
    },
    /// A new configuration (SIGHUP).
    Reload {
        /// The validated core part (boxed: the other messages are small).
        config: Box<EdgeConfig>,
        /// What changed, or why it was refused.
        reply: oneshot::Sender<Result<ConfigDiff, String>>,
    },
    /// A query command for a node.
    Command {
        /// Node id.
        node_id: String,
        /// The command (its request id is assigned by the core).
        request: iop_proto_core::wire::NodeCommandRequest,
        /// The node's answer, or why it was not sent.
        reply: CommandReply,
    },
    /// A status snapshot.
    Snapshot {
        /// Answer.
        reply: oneshot::Sender<Snapshot>,
    },
    /// A successor process holds the listeners now: re-home the nodes
    /// ([`EdgeCore::handle_rehome`]).
    Rehome,
    /// How many requests wait for capacity, in all.
    Waiting {
        /// Answer.
        reply: oneshot::Sender<usize>,
    },
    /// The cluster decided a claim ([`EdgeCore::handle_claim`]).
    Claimed {
        /// The connection whose register waits.
        conn: ConnId,
        /// The decision.
        decision: iop_proto_core::cluster::ClaimDecision,
    },
    /// The cluster can no longer vouch for a node instance
    /// ([`EdgeCore::handle_cluster_fence`]).
    ClusterFence {
        /// The node id.
        node_id: String,
        /// The node process.
        instance: u64,
    },
    /// The cluster's members changed ([`EdgeCore::handle_cluster_members`]).
    ClusterMembers(iop_proto_core::wire::ClusterMembers),
    /// The cluster's shared configuration is in: registers are judged from now on
    /// ([`EdgeCore::handle_cluster_serving`]).
    ClusterServing,
}

struct Entry {
    events: EventOutlet,
    model: Arc<str>,
    submitted: Instant,
}

/// Where a command's answer goes.
pub type CommandReply = oneshot::Sender<
    Result<iop_proto_core::wire::NodeCommandResponse, iop_proto_core::edge::CommandError>,
>;

/// A drain's frames per connection: the bytes to queue and how many frames they end.
#[derive(Default)]
struct Batches(Vec<(ConnId, (BytesMut, u64))>);

impl Batches {
    /// The batch of `conn`, begun if there is none.
    fn of(&mut self, conn: ConnId) -> &mut (BytesMut, u64) {
        let at = match self.0.iter().position(|(c, _)| *c == conn) {
            Some(at) => at,
            None => {
                self.0.push((conn, (BytesMut::new(), 0)));
                self.0.len() - 1
            }
        };
        &mut self.0[at].1
    }

    /// How many bytes the batch of `conn` holds (none when it has no batch).
    fn len(&self, conn: ConnId) -> usize {
        self.0
            .iter()
            .find(|(c, _)| *c == conn)
            .map_or(0, |(_, (buf, _))| buf.len())
    }

    /// The batch of `conn`, taken out.
    fn take(&mut self, conn: ConnId) -> Option<(BytesMut, u64)> {
        let at = self.0.iter().position(|(c, _)| *c == conn)?;
        Some(self.0.swap_remove(at).1)
    }
}

struct Task {
    commands: HashMap<String, CommandReply>,
    core: EdgeCore,
    clock: Clock,
    metrics: Arc<Metrics>,
    conns: HashMap<ConnId, ConnHandle>,
    requests: HashMap<RequestId, Entry>,
    events: Arc<EventHub>,
    /// The deadline the timer task sleeps until, in core milliseconds.
    armed: u64,
    /// Outboxes given frames by this drain, to write once the lock is released.
    kicks: Vec<Arc<Outbox>>,
    /// Request tasks given events by this drain, to wake once the lock is released.
    wakes: Vec<std::task::Waker>,
    /// A drain's frames per connection; kept, empty, between drains for its capacity.
    batches: Batches,
    /// In a cluster: where claims and releases go.
    cluster: Option<tokio::sync::mpsc::UnboundedSender<crate::membership::Input>>,
}

/// The core, shared: cheap to clone, every clone feeds the same machine.
#[derive(Clone)]
pub struct Core {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core").finish_non_exhaustive()
    }
}

struct Shared {
    task: Mutex<Task>,
    /// Wakes the timer when the machine's next deadline moved earlier than the one it
    /// sleeps until.
    rearm: Notify,
    clock: Clock,
}

/// The core is gone: a bug made it panic under the lock. Callers answer 503.
#[derive(Debug, Clone, Copy)]
pub struct Stopped;

thread_local! {
    /// Empty lists with room, swapped in for the core's kicks and wakes each time
    /// [`Core::with`] takes them out of the lock, so that is not an allocation per input.
    static SPARE: std::cell::Cell<(Vec<Arc<Outbox>>, Vec<std::task::Waker>)> =
        const { std::cell::Cell::new((Vec::new(), Vec::new())) };
}

impl Core {
    /// Wraps the machine and what its outputs need.
    #[must_use]
    pub fn new(core: EdgeCore, clock: Clock, metrics: Arc<Metrics>, events: Arc<EventHub>) -> Self {
        let task = Task {
            commands: HashMap::new(),
            core,
            clock,
            metrics,
            conns: HashMap::new(),
            requests: HashMap::new(),
            events,
            armed: u64::MAX,
            kicks: Vec::new(),
            wakes: Vec::new(),
            batches: Batches::default(),
            cluster: None,
        };
        Core {
            shared: Arc::new(Shared {
                task: Mutex::new(task),
                rearm: Notify::new(),
                clock,
            }),
        }
    }

    /// The clock the core runs on.
    #[must_use]
    pub fn clock(&self) -> Clock {
        self.shared.clock
    }

    /// Puts the core in cluster mode ([`EdgeCore::enable_cluster`]): claims and releases
    /// go to `tx`. Call before the node listener accepts.
    pub fn enable_cluster(
        &self,
        tx: tokio::sync::mpsc::UnboundedSender<crate::membership::Input>,
    ) -> Result<(), Stopped> {
        self.with(|task| {
            task.core.enable_cluster();
            task.cluster = Some(tx);
        })
    }

    /// Hands the machine one input and routes everything it produces, on the caller's
    /// task. Replies (`oneshot`s in `message`) are sent before this returns.
    pub fn send(&self, message: CoreMsg) -> Result<(), Stopped> {
        self.with(|task| task.handle(message))
    }

    /// Hands the core, in order and under one lock, `first` and every envelope `next`
    /// yields after it (the frames one read of a node connection completed, decoded as
    /// they are handed over: no list of them is built). Returns how many there were.
    pub fn frames(
        &self,
        conn: ConnId,
        first: Envelope,
        mut next: impl FnMut() -> Option<Envelope>,
    ) -> Result<u64, Stopped> {
        let mut count = 0;
        self.with(|task| {
            let now = task.clock.now();
            let mut pending = Some(first);
            while let Some(envelope) = pending.take().or_else(&mut next) {
                count += 1;
                misuse("envelope", task.core.handle_envelope(now, conn, envelope));
            }
        })?;
        Ok(count)
    }

    /// Whether this Edge should take callers now ([`EdgeCore::takes_callers`]): false
    /// for a cluster member with no live provider for any model, past its start.
    #[must_use]
    pub fn takes_callers(&self) -> bool {
        self.shared
            .task
            .lock()
            .map(|task| task.core.takes_callers(task.clock.now()))
            .unwrap_or(false)
    }

    fn with(&self, input: impl FnOnce(&mut Task)) -> Result<(), Stopped> {
        let mut task = self.shared.task.lock().map_err(|_| Stopped)?;
        input(&mut task);
        task.drain();
        let rearm = task.deadline() < task.armed;
        // The frames are queued in order under the lock; their connections' writer
        // tasks are kicked outside it (they write once the tasks ready now have run).
        // Swapped with this thread's spare lists, whose room the next call reuses.
        let (mut kicks, mut wakes) = SPARE.take();
        std::mem::swap(&mut kicks, &mut task.kicks);
        std::mem::swap(&mut wakes, &mut task.wakes);
        drop(task);
        for outbox in kicks.drain(..) {
            outbox.kick();
        }
        // Waking a task can rouse a parked worker thread (a futex call): done here, the
        // other worker is not held at the core's lock meanwhile.
        for waker in wakes.drain(..) {
            waker.wake();
        }
        SPARE.set((kicks, wakes));
        if rearm {
            self.shared.rearm.notify_one();
        }
        Ok(())
    }

    /// Runs the machine's timer until the core stops: sleeps until its next deadline (or
    /// until an input moved that deadline earlier), then hands it the time.
    pub async fn run_timer(self) {
        let clock = self.shared.clock;
        let timer = tokio::time::sleep_until(clock.instant(iop_proto_core::Timestamp::MAX));
        tokio::pin!(timer);
        loop {
            let Ok(next) = self.shared.task.lock().map(|mut task| {
                // An input that moves the deadline earlier from here on sees it, notifies,
                // and the stored permit wakes the select below.
                task.armed = task.deadline();
                task.armed
            }) else {
                return;
            };
            let deadline = clock.instant(iop_proto_core::Timestamp::from_millis(next));
            if timer.deadline() != deadline {
                timer.as_mut().reset(deadline);
            }
            tokio::select! {
                () = self.shared.rearm.notified() => {}
                () = &mut timer => {
                    if self.with(|task| task.core.handle_timeout(clock.now())).is_err() {
                        return;
                    }
                }
            }
        }
    }
}

impl Task {
    /// The machine's next deadline in core milliseconds (`u64::MAX` for none).
    fn deadline(&self) -> u64 {
        self.core
            .poll_timeout()
            .map_or(u64::MAX, |wake| wake.at.as_millis())
    }

    fn handle(&mut self, message: CoreMsg) {
        let now = self.clock.now();
        match message {
            CoreMsg::ConnOpened { conn, peer, handle } => {
                self.conns.insert(conn, handle);
                let opened = self.core.handle_connection_opened(now, conn, peer);
                if misuse("connection opened", opened).is_none() {
                    self.conns.remove(&conn);
                }
            }
            CoreMsg::Secured {
                conn,
                tls,
                identities,
            } => {
                let secured = self
                    .core
                    .handle_connection_secured(now, conn, tls, identities);
                misuse("connection secured", secured);
            }
            CoreMsg::BytesReceived { conn } => {
                misuse("bytes received", self.core.handle_bytes_received(now, conn));
            }
            CoreMsg::ConnClosed { conn } => {
                misuse(
                    "connection closed",
                    self.core.handle_connection_closed(now, conn),
                );
                self.conns.remove(&conn);
            }
            CoreMsg::Submit { submit, events } => {
                let model = submit.model.clone();
                let result = self.core.handle_submit(now, submit);
                let admitted = result.as_ref().ok().copied();
                *events
                    .attached()
                    .submitted
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(result);
                events.wake(&mut self.wakes);
                if let Some(request) = admitted {
                    self.requests.insert(
                        request,
                        Entry {
                            events,
                            model,
                            submitted: Instant::now(),
                        },
                    );
                }
            }
            CoreMsg::Cancel { request, reason } => {
                if self.core.handle_cancel(now, request, reason) == Cancelled::Now {
                    debug!(request = %request, reason, "request cancelled");
                }
                // Otherwise the caller left just as its request ended: nothing to cancel.
            }
            CoreMsg::Reload { config, reply } => {
                let result = self
                    .core
                    .handle_config(now, *config)
                    .map_err(|err| err.to_string());
                let _ = reply.send(result);
            }
            CoreMsg::Command {
                node_id,
                request,
                reply,
            } => match self.core.handle_command(now, &node_id, request) {
                Ok(id) => {
                    self.commands.insert(id.to_string(), reply);
                }
                Err(refusal) => {
                    let _ = reply.send(Err(refusal));
                }
            },
            CoreMsg::Rehome => self.core.handle_rehome(now),
            CoreMsg::Claimed { conn, decision } => self.core.handle_claim(now, conn, decision),
            CoreMsg::ClusterFence { node_id, instance } => {
                self.core.handle_cluster_fence(now, &node_id, instance);
            }
            CoreMsg::ClusterMembers(members) => self.core.handle_cluster_members(now, members),
            CoreMsg::ClusterServing => self.core.handle_cluster_serving(now),
            CoreMsg::Waiting { reply } => {
                let waiting = self
                    .core
                    .config()
                    .models
                    .keys()
                    .map(|m| self.core.waiting(m))
                    .sum();
                let _ = reply.send(waiting);
            }
            CoreMsg::Snapshot { reply } => {
                let mut queue_by_model: Vec<(String, usize)> = self
                    .core
                    .config()
                    .models
                    .keys()
                    .map(|m| (m.clone(), self.core.waiting(m)))
                    .collect();
                queue_by_model.sort();
                let _ = reply.send(Snapshot {
                    nodes: self.core.nodes(),
                    providers: self.core.snapshots(),
                    queue_by_model,
                    open_requests: self.core.open_requests(),
                    registration_failures: self.core.registration_failures(20),
                    routing: self.core.provider_routing(),
                    cluster: None,
                    responses_store: iop_api::responses::StoreFigures::default(),
                    affinity: self.core.affinity_figures(),
                    affinity_config: self.core.config().routing.affinity,
                });
            }
        }
    }

    /// Drains every output of the machine: frames to their connections (one buffer per
    /// connection per drain), closes, and events to their requests.
    fn drain(&mut self) {
        loop {
            // One buffer per connection written to (seldom more than one: a Vec).
            let mut batches = std::mem::take(&mut self.batches);
            let mut progressed = false;
            while let Some(transmit) = self.core.poll_transmit() {
                progressed = true;
                // A large tunnel body or run input is not copied into the batch: it is
                // queued after the batch, as the caller's bytes.
                let (conn, encoded, kind) = match transmit {
                    Transmit::Frame { conn, mut envelope } => {
                        let buf = &mut batches.of(conn).0;
                        let encoded =
                            wire::encode_split(&mut envelope, buf, wire::DEFAULT_MAX_FRAME_LEN);
                        (conn, encoded, envelope.kind())
                    }
                    Transmit::Tunnel { conn, dispatch } => {
                        let buf = &mut batches.of(conn).0;
                        let encoded = dispatch.encode(buf, wire::DEFAULT_MAX_FRAME_LEN);
                        (conn, encoded, "provider_tunnel_request")
                    }
                    Transmit::FrameLimit {
                        conn,
                        max_frame_len,
                    } => {
                        // Before the frames that follow are flushed: the node cannot use
                        // the new limit before it reads them.
                        if let Some(c) = self.conns.get(&conn) {
                            c.frame_limit.store(max_frame_len, Ordering::Relaxed);
                        }
                        continue;
                    }
                    Transmit::Close { conn, reason } => {
                        self.flush(conn, batches.take(conn));
                        self.close(conn, &reason);
                        continue;
                    }
                };
                match encoded {
                    Ok(payload) => {
                        batches.of(conn).1 += 1;
                        if let Some(payload) = payload {
                            let batch = batches.take(conn);
                            self.flush(conn, batch);
                            self.queue(conn, payload, 0);
                        }
                    }
                    Err(err) => warn!(conn = conn.0, %err, kind, "frame cannot be encoded"),
                }
                // Hand large batches over at once: several big run inputs must not pile
                // up in one buffer.
                if batches.len(conn) >= 1 << 20 {
                    let batch = batches.take(conn);
                    self.flush(conn, batch);
                }
            }
            for (conn, batch) in batches.0.drain(..) {
                self.flush(conn, Some(batch));
            }
            self.batches = batches;
            // What it means to an operator, published before it is acted on (never waits).
            while let Some(lifecycle) = self.core.poll_lifecycle() {
                self.events.publish(&lifecycle);
            }
            while let Some(event) = self.core.poll_event() {
                progressed = true;
                self.on_event(event);
            }
            if !progressed {
                return;
            }
        }
    }

    /// Closes node connection `conn` for `reason`, once what was queued is written.
    fn close(&mut self, conn: ConnId, reason: &CloseReason) {
        if matches!(
            reason,
            CloseReason::RegisterRejected(_)
                | CloseReason::TooManyPending
                | CloseReason::HandshakeTimeout
        ) {
            // Unauthenticated peers can cause these at will: the core's RegisterRejected
            // and ConnectionRefused events are logged, rate-limited, instead.
            debug!(conn = conn.0, reason = ?reason, "closing node connection");
        } else {
            info!(conn = conn.0, reason = ?reason, "closing node connection");
        }
        // Dropping the handle closes its outbox: what is queued is still written, then
        // the socket is shut down.
        if let Some(c) = self.conns.remove(&conn) {
            c.closer.cancel();
        }
    }

    fn flush(&mut self, conn: ConnId, batch: Option<(BytesMut, u64)>) {
        let Some((buf, frames)) = batch else { return };
        if buf.is_empty() {
            return;
        }
        self.queue(conn, buf.freeze(), frames);
    }

    /// Queues `bytes` (the end of `frames` frames) on the connection's outbox, to be
    /// written once the core's lock is released.
    fn queue(&mut self, conn: ConnId, bytes: Bytes, frames: u64) {
        if let Some(c) = self.conns.get(&conn) {
            self.metrics.frames_out.inc_by(frames);
            self.metrics.bytes_out.inc_by(bytes.len() as u64);
            let queued = c.outbox.push(bytes);
            // Kicked once the core's lock is released: one kick has the writer write
            // all of it, so a batch followed by its split payload is kicked once.
            if !self
                .kicks
                .last()
                .is_some_and(|last| Arc::ptr_eq(last, &c.outbox))
            {
                self.kicks.push(c.outbox.clone());
            }
            if queued > MAX_QUEUED_PER_CONNECTION && c.outbox.stalled(STALLED_AFTER) {
                // A node that stopped reading what it is sent is dropped, not buffered for.
                warn!(
                    conn = conn.0,
                    queued, "closing node connection: it does not read"
                );
                c.closer.cancel();
            }
        }
    }

    fn forward(&mut self, request: RequestId, event: RequestEvent) {
        let Some(entry) = self.requests.get(&request) else {
            return;
        };
        let buffered = entry.events.attached().memory.buffer(event_size(&event));
        let sent = buffered.is_some() && entry.events.queue(event, &mut self.wakes).is_ok();
        if !sent || buffered.is_some_and(|b| b > MAX_BUFFERED_PER_REQUEST) {
            // The caller is gone or not reading: stop the work upstream.
            let now = self.clock.now();
            let _ = self
                .core
                .handle_cancel(now, request, "caller gone or not reading");
        }
    }
}

mod report;
#[cfg(test)]
mod tests;
