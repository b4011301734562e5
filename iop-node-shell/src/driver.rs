//! One connection to the Edge: read frames → `NodeSession::handle_*` → drain `poll_*` →
//! write frames. One `select!` over the socket (both directions), the session's deadline,
//! adapter output and shutdown. Frames are encoded into one reused buffer and written from
//! here, so whatever the session produced in one wake costs one syscall and no hand-off to
//! another task; when too many bytes wait for the socket the driver stops taking adapter
//! output (backpressure reaches the provider) but keeps reading.

use foldhash::{HashMap, HashMapExt};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use iop_proto_core::session::{Returned, WorkStep};
use iop_proto_core::wire::{self, FrameDecoder, REQUEST_ID_KEY};
use iop_proto_core::{
    Failure, NodeSession, NodeTransmit, SessionConfig, SessionEnd, SessionEvent, Supervisor,
};
use iop_shell_common::cancel::Cancel;
use iop_shell_common::logging::{Field, info_direct};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::adapters::{AdapterHost, HttpClient, Output, Sink, TunnelTail};
use crate::stats::TransportStats;
use iop_shell_common::clock::Clock;
use iop_shell_common::misuse;

/// Output bytes waiting for the socket above which adapter output waits.
const HIGH_WATER: usize = 4 << 20;
/// An output buffer larger than this is given back once it has been written out.
const OUT_KEEP: usize = 256 << 10;
/// Largest single read: the room a new read buffer is taken with.
const READ_CHUNK: usize = 64 << 10;
/// Room below which the read buffer is renewed (see [`read_room`]).
const READ_ROOM_MIN: usize = 8 << 10;
/// Adapter outputs taken per wake beyond the first.
const OUTPUT_BATCH: usize = 256;

/// Everything a connection needs from the process.
#[derive(Clone, Debug)]
pub struct Context {
    /// The process clock.
    pub clock: Clock,
    /// Transport counters.
    pub stats: Arc<TransportStats>,
    /// Shared HTTP client for adapters.
    pub http: HttpClient,
    /// Default provider request timeout.
    pub request_timeout: Duration,
    /// When the process started (for `TRANSPORT_STATUS`).
    pub started: tokio::time::Instant,
    /// How long a graceful stop lets work run on (for its log line).
    pub drain_grace: Duration,
    /// What re-homed sessions still hold.
    pub elsewhere: Elsewhere,
    /// Where the cluster members a session learns go, when the node follows a cluster.
    pub members: Option<Arc<MembersHeard>>,
    /// Whether this link is the one to the configured `edge_addr`.
    pub seed: bool,
}

/// Writes what the socket takes of `out` now, then flushes once `out` is empty.
/// Cancel-safe: `out` and `unflushed` always say what is still owed to the socket.
async fn write_some<W: AsyncWrite + Unpin>(
    writer: &mut W,
    out: &mut BytesMut,
    unflushed: &mut bool,
    stats: &TransportStats,
) -> std::io::Result<()> {
    if !out.is_empty() {
        let n = writer.write(out).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        out.advance(n);
        *unflushed = true;
        TransportStats::add(&stats.bytes_out, n as u64);
    }
    if out.is_empty() && *unflushed {
        writer.flush().await?;
        *unflushed = false;
    }
    Ok(())
}

/// One connection's loop state: the session, the bytes it owes the socket, and the
/// adapter task of each piece of work in flight.
struct Conn {
    ctx: Context,
    node_id: String,
    session: NodeSession,
    decoder: FrameDecoder,
    read_buf: BytesMut,
    host: AdapterHost,
    /// The task of each piece of work the session has in flight, by run id: cancelled
    /// when the Edge cancels it or the session closes, forgotten when the session says
    /// the work ended (or its task returned). The session decides; this only follows.
    tasks: HashMap<Arc<str>, Cancel>,
    /// Where adapter tasks send their output.
    out_tx: mpsc::Sender<Output>,
    /// Encoded frames not yet taken by the socket, and whether a write awaits its flush.
    out: BytesMut,
    unflushed: bool,
    /// The socket failed: nothing more is written to it.
    broken: bool,
    /// Each stop was handed to the session (the loop stops waiting on it).
    stop_sent: bool,
    drain_sent: bool,
    /// The session became ready / was told to re-home, not yet told to the supervisor.
    became_ready: bool,
    rehome: bool,
    /// This session's key on the node's board ([`Elsewhere`]), and the
    /// [`NodeSession::load_changes`] it last published there.
    key: u64,
    published: u64,
    /// What it last took in from the node's other sessions was not nothing.
    holds_others: bool,
}

/// How the process was asked to stop: one token per way, each cancelled once.
#[derive(Clone, Debug, Default)]
pub struct Stop {
    /// Graceful (`SIGQUIT`): the Edge is asked to send nothing more and the work in flight
    /// runs to its end, up to `timeouts.drain_grace_sec`.
    pub drain: CancellationToken,
    /// Quick (`SIGTERM`, `SIGINT`): the work in flight is cancelled.
    pub now: CancellationToken,
}

impl Stop {
    /// Waits until either stop is asked for.
    pub async fn wait(&self) {
        tokio::select! {
            () = self.drain.cancelled() => {}
            () = self.now.cancelled() => {}
        }
    }
}

/// How [`run`] ended.
#[derive(Debug)]
pub enum Ended {
    /// The session closed, for this reason.
    Closed(SessionEnd),
    /// The Edge told it to re-home: it goes on draining in a task of its own and the
    /// supervisor dials again.
    Rehomed,
}

/// A connection's halves and channels, beside its loop state.
struct Link<S> {
    reader: tokio::io::ReadHalf<S>,
    writer: tokio::io::WriteHalf<S>,
    out_rx: mpsc::Receiver<Output>,
    /// Another session's load moved, or one left the board.
    changed: watch::Receiver<u64>,
}

/// Runs one session over `stream` until it closes and returns why. The session tells
/// `supervisor` when it is ready (which resets the reconnect attempts). A stop is handed
/// to the session: a graceful one asks the Edge to drain the node and lets the work in
/// flight run to its end; a quick one (or a graceful one past its grace) cancels that
/// work and closes once it has ended in order or its grace has passed. When the Edge
/// tells the session to re-home, it goes on in a task of its own until the Edge closes
/// it after its last piece of work, publishing what it holds to `ctx.elsewhere`, and
/// this returns [`Ended::Rehomed`].
pub async fn run<S>(
    stream: S,
    config: SessionConfig,
    ctx: &Context,
    supervisor: &mut Supervisor,
    stop: &Stop,
) -> Ended
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (reader, writer) = tokio::io::split(stream);
    let (out_tx, out_rx) = mpsc::channel::<Output>(1024);
    let mut c = Conn {
        ctx: ctx.clone(),
        node_id: config.node_id.clone(),
        session: NodeSession::new(config),
        decoder: FrameDecoder::new(),
        read_buf: BytesMut::with_capacity(READ_CHUNK),
        host: AdapterHost::new(ctx.http.clone(), ctx.request_timeout),
        tasks: HashMap::new(),
        out_tx,
        out: BytesMut::new(),
        unflushed: false,
        broken: false,
        stop_sent: false,
        drain_sent: false,
        became_ready: false,
        rehome: false,
        key: ctx.elsewhere.join(),
        published: u64::MAX,
        holds_others: false,
    };
    let mut link = Link {
        reader,
        writer,
        out_rx,
        changed: ctx.elsewhere.changed.subscribe(),
    };
    // What the node's other sessions hold goes into the ready.
    c.take_in_held();
    misuse("connected", c.session.handle_connected(ctx.clock.now()));
    match drive(&mut c, &mut link, Some(supervisor), stop).await {
        Some(end) => {
            linger(ctx, c.key, &c.tasks, link.out_rx);
            Ended::Closed(end)
        }
        None => {
            ctx.elsewhere.running.fetch_add(1, Ordering::SeqCst);
            info!(
                node_id = c.node_id,
                in_flight = c.session.in_flight(),
                "re-homing: this session finishes its work while the node dials again"
            );
            let stop = stop.clone();
            tokio::spawn(async move {
                let end = drive(&mut c, &mut link, None, &stop).await;
                info!(node_id = c.node_id, end = ?end, "re-homed session over");
                let ctx = c.ctx.clone();
                linger(&ctx, c.key, &c.tasks, link.out_rx);
                ctx.elsewhere.running.fetch_sub(1, Ordering::SeqCst);
            });
            Ended::Rehomed
        }
    }
}

/// Longest a closed session's load stays on the board for work it abandoned.
const LINGER_MAX: Duration = Duration::from_secs(10);

/// A closed session's load stays on the board until the work it abandoned has stopped
/// upstream (each task, cancelled, sends its `Finished`): the provider still runs those
/// requests until their connections close, so the node's other sessions must not give
/// their slots away before (bounded by [`LINGER_MAX`]).
fn linger(
    ctx: &Context,
    key: u64,
    tasks: &HashMap<Arc<str>, Cancel>,
    mut out_rx: mpsc::Receiver<Output>,
) {
    let mut running: std::collections::HashSet<Arc<str>> = tasks.keys().cloned().collect();
    if running.is_empty() {
        ctx.elsewhere.leave(key);
        return;
    }
    let elsewhere = ctx.elsewhere.clone();
    tokio::spawn(async move {
        let ended = async {
            while !running.is_empty() {
                match out_rx.recv().await {
                    Some(Output::Finished { run_id, .. }) => {
                        running.remove(&run_id);
                    }
                    Some(_) => {}
                    None => return,
                }
            }
        };
        let _ = tokio::time::timeout(LINGER_MAX, ended).await;
        elsewhere.leave(key);
    });
}

/// The connection's loop, until its session closes (`Some`) or, with a `supervisor`,
/// until the Edge tells it to re-home (`None`).
async fn drive<S>(
    c: &mut Conn,
    link: &mut Link<S>,
    mut supervisor: Option<&mut Supervisor>,
    stop: &Stop,
) -> Option<SessionEnd>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let ctx = c.ctx.clone();
    let drain_grace_ms = u64::try_from(ctx.drain_grace.as_millis()).unwrap_or(u64::MAX);
    let timer = tokio::time::sleep_until(ctx.clock.instant(iop_proto_core::Timestamp::MAX));
    tokio::pin!(timer);
    // The process's stop and drain, each followed by a cancel of this connection's own:
    // a wait on a token shared by many tasks takes its lock on every poll, and this loop
    // polls both on every turn.
    let (stopping, draining) = (Cancel::new(), Cancel::new());
    let _follow = (stopping.follow(&stop.now), draining.follow(&stop.drain));
    let Link {
        reader,
        writer,
        out_rx,
        changed,
    } = link;

    loop {
        let closed = c.drain_outputs();
        // Before anything else, a re-home's return included: work admitted with the
        // frames just read is on the board before another session can run.
        c.publish_load();
        if let Some(supervisor) = supervisor.as_deref_mut() {
            if std::mem::take(&mut c.became_ready) {
                misuse("ready", supervisor.handle_ready(ctx.clock.now()));
            }
            if closed.is_none() && std::mem::take(&mut c.rehome) {
                debug_assert_eq!(c.published, c.session.load_changes(), "load unpublished");
                misuse("rehome", supervisor.handle_rehome(ctx.clock.now()));
                return None;
            }
        }
        if let Some(end) = closed {
            // Abandoned work, and anything else still running, stops upstream now.
            for token in c.tasks.values() {
                token.cancel();
            }
            if !c.broken {
                // Let the last frames (terminal events, the last ack) reach the Edge.
                let _ = tokio::time::timeout(Duration::from_secs(2), async {
                    writer.write_all(&c.out).await?;
                    writer.flush().await?;
                    writer.shutdown().await
                })
                .await;
            }
            return Some(end);
        }

        let deadline = c.session.poll_timeout().map_or_else(
            || ctx.clock.instant(iop_proto_core::Timestamp::MAX),
            |wake| ctx.clock.instant(wake.at),
        );
        // One timer for the connection, moved only when the deadline does.
        if timer.deadline() != deadline {
            timer.as_mut().reset(deadline);
        }
        let accept_output = c.out.len() < HIGH_WATER;
        let owed = !c.broken && (!c.out.is_empty() || c.unflushed);
        if !owed && c.out.capacity() > OUT_KEEP {
            c.out = BytesMut::new();
        }
        read_room(&mut c.read_buf);
        // Only while the node has other sessions, or what they held is still counted
        // here: the branch costs a poll on every wake otherwise.
        let shares = ctx.elsewhere.sessions() > 1 || c.holds_others;
        tokio::select! {
            Ok(()) = changed.changed(), if shares => c.take_in_held(),
            () = stopping.cancelled(), if !c.stop_sent => {
                c.stop_sent = true;
                info!(node_id = c.node_id, in_flight = c.session.in_flight(), "shutting down: cancelling in-flight work");
                if let Some(supervisor) = supervisor.as_deref_mut() {
                    supervisor.handle_stop(ctx.clock.now());
                }
                misuse("shutdown", c.session.handle_shutdown(ctx.clock.now()));
            }
            () = draining.cancelled(), if !c.drain_sent => {
                c.drain_sent = true;
                if let Some(supervisor) = supervisor.as_deref_mut() {
                    supervisor.handle_stop(ctx.clock.now());
                }
                misuse("drain", c.session.handle_drain(ctx.clock.now()));
                if c.session.is_draining() {
                    info!(
                        node_id = c.node_id,
                        in_flight = c.session.in_flight(),
                        grace_ms = drain_grace_ms,
                        "stopping gracefully: the edge sends no more work, work in flight runs to its end"
                    );
                }
            }
            read = reader.read_buf(&mut c.read_buf) => c.on_read(read),
            Some(output) = out_rx.recv(), if accept_output => {
                c.apply_output(output);
                // Take what else the adapters have queued in the same wake: its frames
                // then go out in one write.
                for _ in 0..OUTPUT_BATCH {
                    if c.out.len() >= HIGH_WATER {
                        break;
                    }
                    let Ok(output) = out_rx.try_recv() else {
                        break;
                    };
                    c.apply_output(output);
                }
            }
            () = &mut timer => {
                // Bytes already in the socket arrived before the deadline: a node whose
                // thread was busy must not call a live Edge silent because the timer
                // won the race against input that was waiting.
                let early = {
                    let mut read = std::pin::pin!(reader.read_buf(&mut c.read_buf));
                    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                    read.as_mut().poll(&mut cx)
                };
                if let std::task::Poll::Ready(read) = early {
                    c.on_read(read);
                }
                c.session.handle_timeout(ctx.clock.now());
            }
            written = write_some(writer, &mut c.out, &mut c.unflushed, &ctx.stats), if owed => {
                if let Err(err) = written {
                    c.broken = true;
                    c.out.clear();
                    let failure = Failure::from_io(err.kind(), &err);
                    misuse("connection lost", c.session.handle_connection_lost(ctx.clock.now(), failure));
                }
            }
        }
    }
}

impl Conn {
    /// The session publishes what its work holds whenever that changes, for the
    /// node's other sessions (see [`Elsewhere`]).
    fn publish_load(&mut self) {
        let changes = self.session.load_changes();
        if changes != self.published {
            self.published = changes;
            self.ctx.elsewhere.publish(self.key, self.session.load());
        }
    }

    /// With other sessions on the board (or what they held still counted here), this
    /// one takes in what they hold (see [`Elsewhere`]).
    fn take_in_held(&mut self) {
        if self.ctx.elsewhere.sessions() > 1 || self.holds_others {
            let held = self.ctx.elsewhere.held_for(self.key);
            self.holds_others = !held.is_empty();
            misuse(
                "held elsewhere",
                self.session
                    .handle_held_elsewhere(self.ctx.clock.now(), held),
            );
        }
    }

    /// Drains every output of the session (acting on an event may feed it again): frames
    /// into `out`, events handled. `Some(end)` once the session has closed.
    fn drain_outputs(&mut self) -> Option<SessionEnd> {
        let mut closed = None;
        loop {
            let mut frames = 0u64;
            while let Some(transmit) = self.session.poll_transmit() {
                match transmit {
                    NodeTransmit::Frame(envelope) => {
                        if let Err(err) = wire::encode(&envelope, &mut self.out) {
                            warn!(node_id = self.node_id, %err, kind = envelope.kind(), "dropping a frame that cannot be encoded");
                            continue;
                        }
                        frames += 1;
                    }
                    NodeTransmit::Close { end, abandoned } => {
                        info!(node_id = self.node_id, end = %end, abandoned = abandoned.len(), "session closed");
                        closed = Some(end);
                    }
                }
            }
            TransportStats::add(&self.ctx.stats.frames_out, frames);
            let Some(event) = self.session.poll_event() else {
                break;
            };
            self.handle_event(event);
        }
        if let Some(rtt) = self.session.last_rtt() {
            self.ctx
                .stats
                .last_rtt_ms
                .store(rtt.as_millis() as u64, Ordering::Relaxed);
        }
        closed
    }

    /// One completed read: liveness, then every whole frame into the session.
    fn on_read(&mut self, read: std::io::Result<usize>) {
        let (ctx, session) = (&self.ctx, &mut self.session);
        let now = ctx.clock.now();
        match read {
            Ok(0) => {
                let failure = Failure::EdgeClosed("edge closed the connection".into());
                misuse(
                    "connection lost",
                    session.handle_connection_lost(now, failure),
                );
            }
            Ok(n) => {
                TransportStats::add(&ctx.stats.bytes_in, n as u64);
                self.take_in_held();
                let (ctx, session) = (&self.ctx, &mut self.session);
                let now = ctx.clock.now();
                misuse("bytes received", session.handle_bytes_received(now));
                self.decoder.push_bytes(self.read_buf.split().freeze());
                // Once the session has ended, the rest of the buffer is moot.
                while session.end().is_none() {
                    match self.decoder.next_inbound() {
                        Ok(Some(inbound)) => {
                            TransportStats::add(&ctx.stats.frames_in, 1);
                            misuse("envelope", session.handle_inbound(now, inbound));
                        }
                        Ok(None) => break,
                        Err(err) => {
                            misuse("undecodable", session.handle_undecodable(now, err));
                        }
                    }
                }
            }
            Err(err) => {
                let failure = Failure::from_io(err.kind(), &err);
                misuse(
                    "connection lost",
                    session.handle_connection_lost(now, failure),
                );
            }
        }
    }

    /// An adapter's output into the session; the work's task is forgotten once the
    /// session says the work ended.
    fn apply_output(&mut self, output: Output) {
        let now = self.ctx.clock.now();
        let (run_id, step) = match output {
            Output::Run { run_id, output } => {
                let step = self.session.handle_run_output(now, &run_id, output);
                (run_id, step)
            }
            Output::Tunnel { run_id, output } => {
                let step = self.session.handle_tunnel_output(now, &run_id, output);
                (run_id, step)
            }
            Output::Finished { run_id, tail } => {
                if let Some(tail) = tail
                    && let Err(err) =
                        self.session
                            .handle_tunnel_outputs(now, &run_id, tail.outputs())
                {
                    debug!(node_id = self.node_id, %err, "adapter output not sent");
                }
                // Its task is over, whatever its work said.
                self.tasks.remove(&*run_id);
                match self.session.handle_work_returned(now, &run_id) {
                    Ok(Returned::Done) => {}
                    Ok(Returned::Unfinished) => {
                        warn!(
                            node_id = self.node_id,
                            run_id = &*run_id,
                            "adapter returned without a terminal event"
                        );
                    }
                    Err(err) => debug!(node_id = self.node_id, %err, "adapter output not sent"),
                }
                return;
            }
            Output::Command(response) => {
                if let Err(err) = self.session.handle_command_response(now, response) {
                    debug!(node_id = self.node_id, %err, "command response not sent");
                }
                return;
            }
        };
        match step {
            Ok(WorkStep::Going) => {}
            Ok(WorkStep::Ended) => {
                self.tasks.remove(&*run_id);
            }
            Err(err) => debug!(node_id = self.node_id, %err, "adapter output not sent"),
        }
    }

    /// Acts on one event of the session.
    fn handle_event(&mut self, event: SessionEvent) {
        let now = self.ctx.clock.now();
        let node_id = self.node_id.as_str();
        match event {
            SessionEvent::ApplyConfig { payload } => {
                let result = self.host.apply(&payload);
                match &result {
                    Ok(()) => info!(
                        node_id,
                        revision = payload.revision,
                        adapters = payload.adapters.len(),
                        "config applied"
                    ),
                    Err(err) => warn!(node_id, %err, "config from the edge cannot be applied"),
                }
                misuse(
                    "config applied",
                    self.session.handle_config_applied(now, result),
                );
            }
            SessionEvent::Ready => {
                self.became_ready = true;
                info!(node_id, "ready: the edge may dispatch work");
            }
            SessionEvent::Rehome { reason } => {
                info!(node_id, reason, "the edge is handing over: re-homing");
                self.rehome = true;
            }
            SessionEvent::Members(members) => {
                if let Some(heard) = &self.ctx.members {
                    heard.put(self.ctx.seed, members);
                }
            }
            SessionEvent::StartRun { request } => {
                let request_id = request_id_of(&request.metadata);
                let line = iop_shell_common::direct_line!(
                    "run started",
                    node_id: Some(Field::Str(node_id)),
                    run_id: Some(Field::Str(&request.run_id)),
                    // `-` or one `is_request_id` admits: no escapes.
                    request_id: Some(Field::Quoted(request_id)),
                    adapter: Some(Field::Str(&request.adapter)),
                );
                if tracing::enabled!(tracing::Level::INFO) && !info_direct(&line) {
                    info!(
                        node_id,
                        run_id = request.run_id,
                        request_id,
                        adapter = request.adapter,
                        "run started"
                    );
                }
                // No span around the work: adapters log nothing of their own, and entering
                // one on every poll of a stream is paid on every event.
                let adapter = self.host.get(&request.adapter);
                let run_id = Arc::from(request.run_id.as_str());
                spawn_work(
                    adapter,
                    &mut self.tasks,
                    &self.out_tx,
                    run_id,
                    |adapter, sink, token| async move {
                        adapter.run(request, sink, token).await;
                        None
                    },
                );
            }
            SessionEvent::StartTunnel { request, run_id } => {
                let adapter = request.adapter();
                let request_id = request_id_or_dash(request.request_id());
                // The request id is `-` or one `is_request_id` admits: no escapes.
                let line = iop_shell_common::direct_line!(
                    "tunnel opened",
                    node_id: Some(Field::Str(node_id)),
                    run_id: Some(Field::Str(&run_id)),
                    request_id: Some(Field::Quoted(request_id)),
                    adapter: Some(Field::Str(adapter)),
                    path: Some(Field::Str(request.path())),
                );
                if tracing::enabled!(tracing::Level::INFO) && !info_direct(&line) {
                    info!(
                        node_id,
                        run_id = &*run_id,
                        request_id,
                        adapter,
                        path = request.path(),
                        "tunnel opened"
                    );
                }
                let adapter = self.host.get(adapter);
                spawn_work(
                    adapter,
                    &mut self.tasks,
                    &self.out_tx,
                    run_id,
                    |adapter, sink, token| async move { adapter.tunnel(request, sink, token).await },
                );
            }
            SessionEvent::CancelRun { run_id } => {
                info!(node_id, run_id, "cancel requested by the edge");
                if let Some(token) = self.tasks.get(run_id.as_str()) {
                    token.cancel();
                }
            }
            SessionEvent::CancelRejected { run_id, error } => {
                debug!(node_id, run_id, %error, "cancel ignored")
            }
            SessionEvent::Command { request } => {
                let transport = transport_status(&self.ctx, &self.session);
                // Commands may call a provider: answer from a task, never block the driver.
                let host = self.host.clone();
                let tx = self.out_tx.clone();
                tokio::spawn(async move {
                    let response = host.command(request, transport).await;
                    let _ = tx.send(Output::Command(response)).await;
                });
            }
            SessionEvent::RefreshConfig {
                request_id,
                payload,
                diff,
            } => {
                let result = self.host.apply(&payload);
                match &result {
                    Ok(()) => {
                        info!(node_id, request_id, revision = payload.revision, added = ?diff.added, removed = ?diff.removed, changed = ?diff.changed, "config refresh applied")
                    }
                    Err(err) => {
                        warn!(node_id, request_id, %err, "config refresh failed; previous adapters stay")
                    }
                }
                misuse(
                    "refresh applied",
                    self.session
                        .handle_refresh_applied(now, &request_id, result),
                );
            }
            SessionEvent::WorkRefused { run_id, reason } => {
                warn!(node_id, run_id, reason = %reason, "work refused")
            }
            SessionEvent::PeerViolation { violation } => {
                warn!(node_id, violation = %violation, "edge broke the protocol")
            }
        }
    }
}

/// The Edge's request id from a request's metadata; `-` when there is none or it is not
/// one the contract admits (it goes into log lines). Observation only.
fn request_id_of(metadata: &std::collections::BTreeMap<String, String>) -> &str {
    request_id_or_dash(metadata.get(REQUEST_ID_KEY).map(String::as_str))
}

/// A request id fit for a log line, or `-`.
fn request_id_or_dash(id: Option<&str>) -> &str {
    id.filter(|id| iop_proto_core::wire::is_request_id(id.as_bytes()))
        .unwrap_or("-")
}

/// Makes room in `buf` for the next read. What was read is split off to the decoder,
/// and the frames it makes keep slices of the buffer (a tunnel's body is one), so while
/// any of them lives the buffer cannot be reclaimed: a reserve of a whole chunk after
/// every read took a new 64 KiB block (jemalloc's large path, about 1,700 instructions)
/// about every fourth small request. A block is used up to its last [`READ_ROOM_MIN`]
/// instead; a unique one is reclaimed in place as before.
fn read_room(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < READ_ROOM_MIN {
        buf.reserve(READ_CHUNK);
    }
}

/// Runs one piece of work on its adapter in its own task (each with tokio's fair
/// scheduling and cooperative budget: polled together inside this connection's task,
/// thousands of paced streams would share one budget and wait on each other),
/// cancellable by `run_id`; when the task returns or its adapter panics the driver is
/// told, so work that ended without a terminal is closed.
fn spawn_work<F, Fut>(
    adapter: Option<Arc<crate::adapters::Adapter>>,
    tasks: &mut HashMap<Arc<str>, Cancel>,
    out_tx: &mpsc::Sender<Output>,
    run_id: Arc<str>,
    work: F,
) where
    F: FnOnce(Arc<crate::adapters::Adapter>, Sink, Cancel) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Option<TunnelTail>> + Send + 'static,
{
    // The session admitted the work, so the adapter exists in the config it applied.
    let Some(adapter) = adapter else {
        return;
    };
    let token = Cancel::new();
    tasks.insert(run_id.clone(), token.clone());
    let sink = Sink::new(run_id.clone(), out_tx.clone());
    let done = out_tx.clone();
    // The work's future is made inside the task's and polled where it lies: made outside
    // and awaited inside, it would be stored twice (the captured value and the awaited
    // one); wrapped in an unwind guard by value, it was copied into the guard and its await
    // slot in turn. And the task is boxed once, here: tokio moves a task's future into its
    // cell and its stages by value. Those copies of a large future were a visible share of
    // the Node's instructions per small request (docs/benchmarks-history.md); so was
    // making the task's future on the stack and copying it into its box (`in_box!`).
    tokio::spawn(iop_shell_common::in_box!(supervised(
        work, adapter, sink, token, run_id, done
    )));
}

/// `work` run on `adapter` in its task (see [`spawn_work`]); the driver is told when it
/// returns or panics. An `async fn` rather than a block, and never inlined: its future is
/// then made by a call that writes it into the task's box, where the block (or the call
/// inlined) was made on the stack and copied in whole.
#[inline(never)]
async fn supervised<F, Fut>(
    work: F,
    adapter: Arc<crate::adapters::Adapter>,
    sink: Sink,
    token: Cancel,
    run_id: Arc<str>,
    done: mpsc::Sender<Output>,
) where
    F: FnOnce(Arc<crate::adapters::Adapter>, Sink, Cancel) -> Fut,
    Fut: std::future::Future<Output = Option<TunnelTail>>,
{
    let mut work = std::pin::pin!(work(adapter, sink, token));
    // A panicking adapter ends its own work: the session still hears that it
    // returned and closes it, instead of keeping it in flight for good.
    let tail = std::future::poll_fn(|cx| {
        let poll = std::panic::AssertUnwindSafe(|| work.as_mut().poll(cx));
        match std::panic::catch_unwind(poll) {
            Ok(poll) => poll,
            Err(_) => {
                error!(run_id = &*run_id, "adapter panicked; its work ends here");
                std::task::Poll::Ready(None)
            }
        }
    })
    .await;
    let _ = done.send(Output::Finished { run_id, tail }).await;
}

fn transport_status(ctx: &Context, session: &NodeSession) -> serde_json::Value {
    let s = &ctx.stats;
    serde_json::json!({
        "state": format!("{:?}", session.state()).to_lowercase(),
        "uptime_ms": ctx.started.elapsed().as_millis() as u64,
        "frames_in": TransportStats::get(&s.frames_in),
        "frames_out": TransportStats::get(&s.frames_out),
        "bytes_in": TransportStats::get(&s.bytes_in),
        "bytes_out": TransportStats::get(&s.bytes_out),
        "connections": TransportStats::get(&s.connections),
        "reconnects": TransportStats::get(&s.reconnects),
        "last_heartbeat_rtt_ms": session.last_rtt().map(|d| d.as_millis() as u64),
        "in_flight": session.in_flight(),
        "draining": session.is_draining(),
    })
}

mod shared;
pub use shared::MembersHeard;

mod board;
pub use board::Elsewhere;

#[cfg(test)]
mod tests;
