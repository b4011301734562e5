//! The one test harness (quinn's `Pair`, str0m's netem): the drain loop every test uses,
//! a Sans-IO [`Wire`] that carries frames through the real codec with a delay, and a
//! [`Pair`] of one Edge and one node session that steps both to quiescence.
//!
//! The scenario tests drain a single machine with [`drain_edge`] / [`drain_node`], the
//! golden transcript runs a [`Pair`], and the simulator builds its links from [`Wire`]s.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use crate::rng::Rng;
use iop_proto_core::edge::{
    ConnId, EdgeCore, EdgeEvent, Peer, RequestEvent, Transmit, TunnelDispatch,
};
use iop_proto_core::session::{NodeSession, NodeTransmit, RunOutput, SessionEvent};
use iop_proto_core::time::Timestamp;
use iop_proto_core::wire::{self, Body, DecodeError, Envelope, FrameDecoder, Inbound};

pub use iop_proto_core::testkit::{drain_edge, drain_node};

/// The envelope a Node reads from the frame `dispatch` is written as: encoded by
/// [`TunnelDispatch::encode`], as the Edge shell writes it, and decoded. Panics unless it
/// is the message [`TunnelDispatch::to_envelope`] builds, so every simulated dispatch
/// checks the encoder against prost's.
#[must_use]
pub fn sent_envelope(dispatch: &TunnelDispatch) -> Envelope {
    let mut out = BytesMut::new();
    let payload = dispatch
        .encode(&mut out, wire::DEFAULT_MAX_FRAME_LEN)
        .expect("a dispatch the Edge makes fits a frame");
    let mut decoder = FrameDecoder::new();
    decoder.push(&out);
    if let Some(payload) = payload {
        decoder.push(&payload);
    }
    let envelope = decoder
        .next_envelope()
        .expect("a dispatch decodes")
        .expect("a dispatch is one whole frame");
    assert_eq!(
        envelope,
        dispatch.to_envelope(),
        "a dispatch's frame is its message"
    );
    envelope
}

/// A simulated provider's piece of work on a node: start, one delta, complete (or
/// cancelled), each step after a seeded delay. The upgrade and multi-homed worlds run
/// their nodes' work with it.
#[derive(Debug)]
pub(crate) struct Job {
    pub(crate) long: bool,
    step: u32,
    next_at: Timestamp,
    cancelled: bool,
}

impl Job {
    /// Work of `long` context whose first step is due at `at`.
    pub(crate) fn new(long: bool, at: Timestamp) -> Self {
        Job {
            long,
            step: 0,
            next_at: at,
            cancelled: false,
        }
    }

    /// When its next step is due.
    pub(crate) fn next_at(&self) -> Timestamp {
        self.next_at
    }

    /// The Edge cancelled it: it ends, cancelled, at its next step, no later than `now`.
    pub(crate) fn cancel(&mut self, now: Timestamp) {
        self.cancelled = true;
        self.next_at = self.next_at.min(now);
    }
}

/// Runs every step of `jobs` due at `now` through `session`; finished work is removed and
/// returned to the session.
pub(crate) fn advance_jobs(
    rng: &mut Rng,
    now: Timestamp,
    session: &mut NodeSession,
    jobs: &mut std::collections::BTreeMap<String, Job>,
) {
    let due: Vec<String> = jobs
        .iter()
        .filter(|(_, j)| j.next_at <= now)
        .map(|(id, _)| id.clone())
        .collect();
    for run_id in due {
        let delay = Duration::from_millis(rng.range(5, 120));
        let Some(job) = jobs.get_mut(&run_id) else {
            continue;
        };
        let output = match (job.step, job.cancelled) {
            (0, _) => RunOutput::Start,
            (_, true) => RunOutput::Cancelled,
            (1, false) => RunOutput::Delta("x".into()),
            _ => RunOutput::Complete {
                usage: None,
                metadata: std::collections::BTreeMap::new(),
            },
        };
        let last = matches!(output, RunOutput::Cancelled | RunOutput::Complete { .. });
        job.step += 1;
        job.next_at = now + delay;
        let _ = session.handle_run_output(now, &run_id, output);
        if last {
            jobs.remove(&run_id);
            let _ = session.handle_work_returned(now, &run_id);
        }
    }
}

/// Work across a node's sessions within `capacity` units (`long_capacity` of them long
/// context), or what it runs above them.
pub(crate) fn within_capacity<'a>(
    node: &str,
    jobs: impl Iterator<Item = &'a Job>,
    capacity: u32,
    long_capacity: u32,
) -> Result<(), String> {
    let (all, long) = jobs.fold((0u32, 0u32), |(a, l), j| (a + 1, l + u32::from(j.long)));
    if all > capacity || long > long_capacity {
        return Err(format!(
            "{node} runs {all} ({long} long) across its sessions, above capacity {capacity} ({long_capacity})"
        ));
    }
    Ok(())
}

/// How long a frame takes on a [`Wire`]: a delay drawn from `min..=max` by a seeded
/// generator (str0m's netem, without loss: the link is TCP, it delays and stalls but
/// neither drops nor reorders).
#[derive(Debug, Clone)]
pub struct Netem {
    min: Duration,
    max: Duration,
    rng: Rng,
}

impl Netem {
    /// No delay at all.
    #[must_use]
    pub fn instant() -> Self {
        Self::jitter(Duration::ZERO, Duration::ZERO, 0)
    }

    /// A delay between `min` and `max`, drawn from `seed`.
    #[must_use]
    pub fn jitter(min: Duration, max: Duration, seed: u64) -> Self {
        Netem {
            min,
            max: max.max(min),
            rng: Rng::new(seed),
        }
    }

    /// The delay of the next frame.
    pub fn delay(&mut self) -> Duration {
        let (lo, hi) = (self.min.as_millis() as u64, self.max.as_millis() as u64);
        Duration::from_millis(self.rng.range(lo, hi))
    }
}

/// One direction of a connection: encoded frames in flight with their arrival times,
/// decoded on arrival by the real codec. Frames arrive in the order they were sent, as
/// on a TCP stream, whatever their delays.
#[derive(Debug)]
pub struct Wire {
    in_flight: VecDeque<(Timestamp, Bytes)>,
    decoder: FrameDecoder,
    last_arrival: Timestamp,
}

impl Wire {
    /// An empty wire whose receiver accepts frames up to `max_frame_len`.
    #[must_use]
    pub fn new(max_frame_len: usize) -> Self {
        Wire {
            in_flight: VecDeque::new(),
            decoder: FrameDecoder::with_max_frame_len(max_frame_len),
            last_arrival: Timestamp::ZERO,
        }
    }

    /// Encodes `envelope` and puts it on the wire to arrive at `at` (or after the frame
    /// sent before it). False if it cannot be encoded.
    pub fn send(&mut self, envelope: &Envelope, at: Timestamp) -> bool {
        let mut out = BytesMut::new();
        if wire::encode(envelope, &mut out).is_err() {
            return false;
        }
        self.last_arrival = self.last_arrival.max(at);
        self.in_flight.push_back((self.last_arrival, out.freeze()));
        true
    }

    /// When the next frame arrives.
    #[must_use]
    pub fn next_arrival(&self) -> Option<Timestamp> {
        self.in_flight.front().map(|(at, _)| *at)
    }

    /// Whether nothing is in flight.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.in_flight.is_empty()
    }

    /// Drops what is in flight (the sending side died).
    pub fn clear(&mut self) {
        self.in_flight.clear();
    }

    /// The receiver's frame limit changes (as the Edge's after a register).
    pub fn set_max_frame_len(&mut self, max_frame_len: usize) {
        self.decoder.set_max_frame_len(max_frame_len);
    }

    /// Frames that have arrived by `now`, decoded; an error if the codec failed.
    pub fn receive(&mut self, now: Timestamp) -> Result<Vec<Envelope>, DecodeError> {
        let mut out = Vec::new();
        while let Some(envelopes) = self.receive_one(now) {
            out.extend(envelopes?);
        }
        Ok(out)
    }

    /// [`receive`](Self::receive) as the Node's shell reads its frames.
    pub fn receive_inbound(&mut self, now: Timestamp) -> Result<Vec<Inbound>, DecodeError> {
        let mut out = Vec::new();
        while let Some(frames) = self.receive_one_inbound(now) {
            out.extend(frames?);
        }
        Ok(out)
    }

    /// The next frame if it has arrived by `now`, decoded (so a receiver can react to
    /// each frame before the next, as a shell reading a socket does).
    pub fn receive_one(&mut self, now: Timestamp) -> Option<Result<Vec<Envelope>, DecodeError>> {
        self.receive_one_inbound(now)
            .map(|frames| Ok(frames?.into_iter().map(Inbound::into_envelope).collect()))
    }

    /// [`receive_one`](Self::receive_one) as the Node's shell reads its frames
    /// ([`FrameDecoder::next_inbound`]: a tunnel request read in place).
    pub fn receive_one_inbound(
        &mut self,
        now: Timestamp,
    ) -> Option<Result<Vec<Inbound>, DecodeError>> {
        if self.next_arrival()? > now {
            return None;
        }
        let (_, bytes) = self.in_flight.pop_front()?;
        self.decoder.push_bytes(bytes);
        let mut out = Vec::new();
        loop {
            match self.decoder.next_inbound() {
                Ok(Some(inbound)) => out.push(inbound),
                Ok(None) => return Some(Ok(out)),
                Err(err) => return Some(Err(err)),
            }
        }
    }
}

/// Debug output of a message for transcripts (prost's is deterministic: maps are
/// `BTreeMap`s).
#[must_use]
pub fn describe(body: &Body) -> String {
    format!("{body:?}")
}

/// One Edge and one node session over one connection, each direction a [`Wire`] with
/// its [`Netem`]. [`Pair::step`] drains both machines, moves what arrived and answers
/// the node shell's routine events (apply a config, end a cancelled run) until nothing
/// moves; [`Pair::drive_until`] also lets time pass to each next deadline. Every frame,
/// close and event goes into [`Pair::transcript`].
#[derive(Debug)]
pub struct Pair {
    /// The Edge.
    pub edge: EdgeCore,
    /// The node.
    pub node: NodeSession,
    /// The connection between them.
    pub conn: ConnId,
    /// The shared clock.
    pub now: Timestamp,
    /// What happened, one line per frame, close and event.
    pub transcript: String,
    to_edge: Wire,
    to_node: Wire,
    netem: Netem,
}

impl Pair {
    /// A pair with nothing connected yet.
    #[must_use]
    pub fn new(edge: EdgeCore, node: NodeSession, netem: Netem) -> Self {
        let pending = edge.config().admission.pending_frame_len;
        Pair {
            edge,
            node,
            conn: ConnId(0),
            now: Timestamp::ZERO,
            transcript: String::new(),
            to_edge: Wire::new(pending),
            to_node: Wire::new(wire::DEFAULT_MAX_FRAME_LEN),
            netem,
        }
    }

    /// Opens connection `conn` with a fresh session (the node redials).
    pub fn connect(&mut self, conn: ConnId, node: NodeSession) {
        self.conn = conn;
        self.node = node;
        let pending = self.edge.config().admission.pending_frame_len;
        self.to_edge = Wire::new(pending);
        self.to_node = Wire::new(wire::DEFAULT_MAX_FRAME_LEN);
        self.edge
            .handle_connection_opened(self.now, conn, Peer::default())
            .expect("a new connection");
        self.node.handle_connected(self.now).expect("a new session");
        self.log(format_args!("-- connection {} opened", conn.0));
    }

    /// The connection drops under both.
    pub fn disconnect(&mut self) {
        let conn = self.conn.0;
        self.log(format_args!("-- connection {conn} lost"));
        self.to_edge.clear();
        self.to_node.clear();
        self.edge
            .handle_connection_closed(self.now, self.conn)
            .expect("open");
        self.node
            .handle_connection_lost(self.now, iop_proto_core::reconnect::Failure::Reset)
            .expect("a live session");
    }

    /// Sets the clock (never backwards).
    pub fn at(&mut self, ms: u64) {
        self.now = self.now.max(Timestamp::from_millis(ms));
    }

    fn log(&mut self, line: std::fmt::Arguments<'_>) {
        let _ = writeln!(self.transcript, "{} {line}", self.now);
    }

    /// Runs both machines at the current time until nothing moves. Returns whether
    /// anything did.
    pub fn step(&mut self) -> bool {
        let mut any = false;
        loop {
            let mut moved = false;
            while let Some(transmit) = self.node.poll_transmit() {
                moved = true;
                self.node_transmit(transmit);
            }
            for envelope in self.to_edge.receive(self.now).expect("the codec decodes") {
                moved = true;
                self.edge
                    .handle_envelope(self.now, self.conn, envelope)
                    .expect("open");
            }
            while let Some(transmit) = self.edge.poll_transmit() {
                moved = true;
                self.edge_transmit(transmit);
            }
            for inbound in self
                .to_node
                .receive_inbound(self.now)
                .expect("the codec decodes")
            {
                moved = true;
                // A closed session takes nothing more; the shell stops reading.
                let _ = self.node.handle_inbound(self.now, inbound);
            }
            while let Some(event) = self.node.poll_event() {
                moved = true;
                self.log(format_args!("node event {}", short_node(&event)));
                self.answer_node(event);
            }
            while let Some(event) = self.edge.poll_event() {
                moved = true;
                self.log(format_args!("edge event {}", short_edge(&event)));
            }
            if !moved {
                return any;
            }
            any = true;
        }
    }

    fn node_transmit(&mut self, transmit: NodeTransmit) {
        match transmit {
            NodeTransmit::Frame(envelope) => {
                let body = envelope.body.as_ref().map(describe).unwrap_or_default();
                self.log(format_args!("node -> edge {body}"));
                let at = self.now + self.netem.delay();
                self.to_edge.send(&envelope, at);
            }
            NodeTransmit::Close { end, .. } => {
                self.log(format_args!("-- node closes the session ({end:?})"));
            }
        }
    }

    fn edge_transmit(&mut self, transmit: Transmit) {
        match transmit {
            Transmit::Tunnel { conn, dispatch } => {
                self.edge_transmit(Transmit::Frame {
                    conn,
                    envelope: sent_envelope(&dispatch),
                });
            }
            Transmit::Frame { envelope, .. } => {
                let body = envelope.body.as_ref().map(describe).unwrap_or_default();
                self.log(format_args!("edge -> node {body}"));
                let at = self.now + self.netem.delay();
                self.to_node.send(&envelope, at);
            }
            Transmit::Close { conn, reason } => {
                self.log(format_args!(
                    "-- edge closes connection {} ({reason:?})",
                    conn.0
                ));
            }
            Transmit::FrameLimit {
                conn,
                max_frame_len,
            } => {
                self.log(format_args!(
                    "-- edge accepts frames up to {max_frame_len} bytes on connection {}",
                    conn.0
                ));
                self.to_edge.set_max_frame_len(max_frame_len);
            }
        }
    }

    /// The node shell's routine answers.
    fn answer_node(&mut self, event: SessionEvent) {
        match event {
            SessionEvent::ApplyConfig { .. } => {
                self.node
                    .handle_config_applied(self.now, Ok(()))
                    .expect("configuring");
            }
            SessionEvent::CancelRun { run_id } => {
                // The run may already have ended; then there is nothing to cancel.
                let _ = self
                    .node
                    .handle_run_output(self.now, &run_id, RunOutput::Cancelled);
            }
            _ => {}
        }
    }

    /// The next moment something is due: a machine's timer or a frame's arrival.
    #[must_use]
    pub fn next_due(&self) -> Option<Timestamp> {
        [
            self.edge.poll_timeout().map(|w| w.at),
            self.node.poll_timeout().map(|w| w.at),
            self.to_edge.next_arrival(),
            self.to_node.next_arrival(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Steps, then lets time pass to each next deadline and steps again, until `until`.
    pub fn drive_until(&mut self, until: Timestamp) {
        self.step();
        while let Some(next) = self.next_due().filter(|&t| t <= until) {
            self.now = self.now.max(next);
            self.edge.handle_timeout(self.now);
            self.node.handle_timeout(self.now);
            self.step();
        }
        self.now = self.now.max(until);
    }
}

fn short_node(event: &SessionEvent) -> String {
    match event {
        SessionEvent::ApplyConfig { payload } => format!(
            "ApplyConfig(revision {}, {} adapters)",
            payload.revision,
            payload.adapters.len()
        ),
        SessionEvent::StartRun { request } => {
            format!("StartRun({} on {})", request.run_id, request.adapter)
        }
        other => format!("{other:?}"),
    }
}

fn short_edge(event: &EdgeEvent) -> String {
    match event {
        EdgeEvent::Request {
            request,
            event:
                RequestEvent::Dispatched {
                    shape,
                    node_id,
                    provider_id,
                    ..
                },
        } => format!("Dispatched({request} on {node_id}/{provider_id}, {shape:?})"),
        EdgeEvent::Request { request, event } => format!("{request} {event:?}"),
        EdgeEvent::Attempt {
            run,
            node_id,
            provider_id,
            shape,
        } => format!("Attempt({run} on {node_id}/{provider_id}, {shape:?})"),
        other => format!("{other:?}"),
    }
}
