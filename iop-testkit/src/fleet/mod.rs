//! The one skeleton of the worlds where several Edge processes meet the same nodes: real
//! [`EdgeCore`]s, node processes running the real [`NodeSession`]s, links that carry
//! frames through the real codec with seeded latency, provider work as [`Job`]s, and
//! callers submitting throughout. Two configurations of it ([`Shape`]):
//!
//! - **upgrade** (`testkit::upgrade`): one Edge process after another, each handing its
//!   listeners to the next; a node's [`Supervisor`] dials whichever listens, and a
//!   re-homed session drains beside the new one, what it holds reported to it;
//! - **multi-homed** (`testkit::multihome`): three Edges in cluster mode; each node keeps a
//!   session with every Edge, its sessions sharing one capacity through a [`LoadBoard`].
//!
//! What both check after every step is here: a node's work across its sessions stays
//! within each adapter's capacity and long-context capacity; every accepted request ends
//! exactly once; an Edge dispatches nothing on a connection it told to re-home. What each
//! configuration plays, and what it checks at the end, is in its own file.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use bytes::Bytes;

use crate::harness::{Job, Wire, advance_jobs};
use crate::rng::Rng;
use iop_proto_core::RequestId;
use iop_proto_core::cluster::ClaimDecision;
use iop_proto_core::edge::{ConnId, EdgeCore, EdgeEvent, Outcome, RequestEvent, Submit, Transmit};
use iop_proto_core::edge_config::{CandidateSpec, EdgeConfig, ModelSpec, NodeSpec, QueueLimits};
use iop_proto_core::reconnect::{Failure, Supervisor};
use iop_proto_core::session::{LoadBoard, NodeSession};
use iop_proto_core::testkit::Inspect;
use iop_proto_core::time::Timestamp;
use iop_proto_core::token::TokenVerifier;
use iop_proto_core::wire::{AdapterLoad, AdapterType, Body, Envelope};

mod nodes;

/// Node processes in every configuration.
pub(crate) const NODES: usize = 3;

/// How the Edges and the nodes of a world meet.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Shape {
    /// One Edge process at a time takes the listeners; nodes dial whichever listens.
    Upgrade {
        /// The Edge the listener leads to.
        listening: usize,
        /// The old Edge's shell tells the nodes to re-home without telling its core.
        rehome_behind_the_core: bool,
        /// The node does not report what its draining session holds to the new one.
        hide_held_elsewhere: bool,
    },
    /// Every node keeps a session with each of `edges` Edges in cluster mode.
    Multihome {
        /// Edges.
        edges: usize,
        /// A session does not take in what the node's other sessions hold.
        blind_sessions: bool,
    },
}

/// What a world's configuration fixes: its shape, its token, its nodes' capacity, how
/// late a frame may arrive, and its Edges' configuration.
pub(crate) struct Setup {
    pub(crate) shape: Shape,
    pub(crate) token: &'static str,
    pub(crate) capacity: u32,
    pub(crate) long_capacity: u32,
    /// Frames take from 1 ms to this (exclusive) to cross a link.
    pub(crate) latency_ms: u64,
    pub(crate) queue: QueueLimits,
}

/// What one run did, in either shape (each reports its share).
#[derive(Clone, Debug, Default)]
pub(crate) struct Counts {
    pub(crate) requests: u64,
    pub(crate) completed: u64,
    pub(crate) killed: u64,
    pub(crate) handovers: u64,
    pub(crate) rehomed: u64,
    pub(crate) beside_old: u64,
    pub(crate) refused: u64,
    pub(crate) shared: u64,
}

pub(crate) struct Edge {
    pub(crate) core: EdgeCore,
    pub(crate) alive: bool,
    /// Connections told to re-home.
    told: BTreeSet<ConnId>,
    /// Accepted requests, and whether each has ended.
    pub(crate) requests: BTreeMap<RequestId, bool>,
    next_conn: u64,
}

pub(crate) struct Link {
    pub(crate) edge: usize,
    conn: ConnId,
    node: usize,
    to_node: Wire,
    to_edge: Wire,
    /// The Edge closed it (or died): the node learns once what was sent has arrived.
    closed_by_edge: bool,
}

pub(crate) struct Session {
    pub(crate) link: usize,
    pub(crate) edge: usize,
    session: NodeSession,
    jobs: BTreeMap<String, Job>,
    /// Told to re-home: it drains beside the current one.
    rehomed: bool,
    /// Its key on the node's board, and the load changes it last published.
    key: u64,
    published: u64,
}

pub(crate) struct Node {
    pub(crate) id: String,
    /// The supervisor that dials the listening Edge (upgrade).
    supervisor: Option<Supervisor>,
    pub(crate) sessions: Vec<Session>,
    /// What the sessions hold, shared (multi-homed).
    board: LoadBoard,
    /// The load last reported to the current session (upgrade).
    reported: Vec<AdapterLoad>,
    /// When to dial each Edge it has no session with (multi-homed).
    redial_at: Vec<Timestamp>,
}

pub(crate) struct Fleet {
    pub(crate) rng: Rng,
    pub(crate) now: Timestamp,
    pub(crate) setup: Setup,
    pub(crate) edges: Vec<Edge>,
    links: Vec<Link>,
    pub(crate) nodes: Vec<Node>,
    pub(crate) counts: Counts,
    trace: Vec<String>,
}

/// The Edges' configuration: `NODES` nodes with one mock adapter "a" each, one model "m"
/// over all of them, fast timers.
fn edge_config(setup: &Setup) -> EdgeConfig {
    let mut nodes = BTreeMap::new();
    for n in 0..NODES {
        nodes.insert(
            format!("n{n}"),
            NodeSpec {
                token: TokenVerifier::from_secret(setup.token.as_bytes()),
                adapters: vec![iop_proto_core::testkit::adapter(
                    "a",
                    AdapterType::Mock,
                    setup.capacity,
                    setup.long_capacity,
                )],
                runtime: Default::default(),
            },
        );
    }
    let mut models = BTreeMap::new();
    models.insert(
        "m".to_owned(),
        ModelSpec {
            candidates: (0..NODES)
                .map(|n| CandidateSpec {
                    node_id: format!("n{n}"),
                    provider_id: "a".into(),
                    target: "t".into(),
                })
                .collect(),
            long_context_threshold: Some(100),
            context_tokens: None,
            first_byte_timeout: None,
            resume_limit: None,
            stall_timeout: None,
            affinity: None,
        },
    );
    EdgeConfig {
        nodes,
        models,
        timing: iop_proto_core::edge_config::EdgeTiming {
            heartbeat_interval: Duration::from_millis(200),
            heartbeat_timeout: Duration::from_millis(700),
            register_timeout: Duration::from_millis(800),
            refresh_timeout: Duration::from_millis(800),
            cancel_grace: Duration::from_millis(600),
        },
        queue: setup.queue,
        ..EdgeConfig::default()
    }
}

impl Fleet {
    /// A world of `setup`'s shape at time zero: its Edges started (the first one alone,
    /// for an upgrade) and its node processes not yet connected.
    pub(crate) fn new(seed: u64, setup: Setup, supervisor: impl Fn() -> Supervisor) -> Self {
        let (edges, with_supervisor) = match setup.shape {
            Shape::Upgrade { .. } => (1, true),
            Shape::Multihome { edges, .. } => (edges, false),
        };
        let mut fleet = Fleet {
            rng: Rng::new(seed),
            now: Timestamp::ZERO,
            setup,
            edges: Vec::new(),
            links: Vec::new(),
            nodes: Vec::new(),
            counts: Counts::default(),
            trace: Vec::new(),
        };
        for _ in 0..edges {
            fleet.edges.push(fleet.fresh_edge(1));
        }
        for n in 0..NODES {
            let supervisor = with_supervisor.then(|| {
                let mut s = supervisor();
                let _ = s.handle_start(Timestamp::ZERO);
                s
            });
            fleet.nodes.push(Node {
                id: format!("n{n}"),
                supervisor,
                sessions: Vec::new(),
                board: LoadBoard::default(),
                reported: Vec::new(),
                redial_at: vec![Timestamp::ZERO; edges],
            });
        }
        fleet
    }

    /// An Edge process, its connection ids starting at `first_conn`: in cluster mode for
    /// a multi-homed world (its claims are admitted at once; the cluster world checks
    /// what etcd decides).
    pub(crate) fn fresh_edge(&self, first_conn: u64) -> Edge {
        let mut core = EdgeCore::new(edge_config(&self.setup)).expect("valid config");
        if matches!(self.setup.shape, Shape::Multihome { .. }) {
            core.enable_cluster();
            core.handle_cluster_serving(Timestamp::ZERO);
        }
        Edge {
            core,
            alive: true,
            told: BTreeSet::new(),
            requests: BTreeMap::new(),
            next_conn: first_conn,
        }
    }

    /// The run's error with the trace's last lines.
    pub(crate) fn failure(&self, world: &str, seed: u64, err: &str) -> String {
        let tail: Vec<&String> = self.trace.iter().rev().take(40).collect();
        let mut s = format!("{world} seed {seed}: {err}\n--- last steps\n");
        for line in tail.into_iter().rev() {
            s.push_str(line);
            s.push('\n');
        }
        s
    }

    pub(crate) fn log(&mut self, line: impl FnOnce() -> String) {
        if self.trace.len() >= 400 {
            self.trace.drain(..200);
        }
        let line = format!("t={}ms {}", self.now.as_millis(), line());
        self.trace.push(line);
    }

    fn latency(&mut self) -> Duration {
        Duration::from_millis(self.rng.range(1, self.setup.latency_ms))
    }

    /// Edge `e` dies: its requests with it (their callers see their connection drop), and
    /// its links.
    pub(crate) fn kill(&mut self, e: usize) {
        self.log(|| format!("edge {e} killed"));
        self.counts.killed += 1;
        self.edges[e].alive = false;
        for ended in self.edges[e].requests.values_mut() {
            *ended = true;
        }
        for link in self.links.iter_mut().filter(|l| l.edge == e) {
            link.to_edge.clear();
            link.closed_by_edge = true;
        }
    }

    /// A caller submits to Edge `e`.
    pub(crate) fn submit(&mut self, e: usize, long: bool) -> Result<(), String> {
        if !self.edges[e].alive {
            return Ok(());
        }
        let mut submit = Submit::chat("m", Bytes::from_static(br#"{"messages":[]}"#));
        submit.prompt_tokens = if long { 500 } else { 10 };
        let now = self.now;
        if let Ok(request) = self.edges[e].core.handle_submit(now, submit) {
            self.counts.requests += 1;
            self.edges[e].requests.insert(request, false);
        }
        self.drain_edge(e)
    }

    /// Routes an Edge's outputs; admits every claim at once.
    pub(crate) fn drain_edge(&mut self, e: usize) -> Result<(), String> {
        loop {
            let mut progressed = false;
            while let Some(t) = self.edges[e].core.poll_transmit() {
                progressed = true;
                match t {
                    Transmit::Frame { conn, envelope } => self.edge_writes(e, conn, envelope)?,
                    Transmit::Tunnel { conn, dispatch } => {
                        let envelope = crate::harness::sent_envelope(&dispatch);
                        self.edge_writes(e, conn, envelope)?;
                    }
                    Transmit::Close { conn, reason } => {
                        self.log(|| format!("edge {e} closes conn {} ({reason:?})", conn.0));
                        if let Some(l) = self.link_of(e, conn) {
                            self.links[l].closed_by_edge = true;
                        }
                        let now = self.now;
                        let _ = self.edges[e].core.handle_connection_closed(now, conn);
                    }
                    Transmit::FrameLimit { .. } => {}
                }
            }
            let mut claims = Vec::new();
            while let Some(event) = self.edges[e].core.poll_event() {
                progressed = true;
                match event {
                    EdgeEvent::ClaimNode { conn, .. } => claims.push(conn),
                    EdgeEvent::Request {
                        request,
                        event: RequestEvent::Ended(outcome),
                    } => {
                        match self.edges[e].requests.get_mut(&request) {
                            Some(ended) if *ended => {
                                return Err(format!("edge {e}: {request} ended twice"));
                            }
                            Some(ended) => *ended = true,
                            None => {
                                return Err(format!("edge {e}: {request} ended, never accepted"));
                            }
                        }
                        if outcome == Outcome::Completed {
                            self.counts.completed += 1;
                        } else {
                            self.log(|| format!("edge {e}: {request} ended {outcome:?}"));
                        }
                    }
                    _ => {}
                }
            }
            while self.edges[e].core.poll_lifecycle().is_some() {}
            let now = self.now;
            for conn in claims {
                self.edges[e]
                    .core
                    .handle_claim(now, conn, ClaimDecision::Admitted { fence: 1 });
            }
            if !progressed {
                return Ok(());
            }
        }
    }

    fn link_of(&self, e: usize, conn: ConnId) -> Option<usize> {
        self.links
            .iter()
            .position(|l| l.edge == e && l.conn == conn)
    }

    /// Edge `e` writes `envelope` on `conn`: nothing is dispatched on a connection it told
    /// to re-home.
    pub(crate) fn edge_writes(
        &mut self,
        e: usize,
        conn: ConnId,
        envelope: Envelope,
    ) -> Result<(), String> {
        let dispatch = matches!(
            envelope.body,
            Some(Body::RunRequest(_) | Body::ProviderTunnelRequest(_))
        );
        if dispatch && self.edges[e].told.contains(&conn) {
            return Err(format!(
                "edge {e} dispatched on conn {} after telling it to re-home",
                conn.0
            ));
        }
        if matches!(envelope.body, Some(Body::NodeRehomeRequest(_))) {
            self.edges[e].told.insert(conn);
        }
        if let (true, Shape::Upgrade { listening, .. }) = (dispatch, self.setup.shape)
            && e == listening
            && let Some(l) = self.link_of(e, conn)
        {
            // A dispatch while an old session of the node still works.
            let node = self.links[l].node;
            if self.nodes[node]
                .sessions
                .iter()
                .any(|s| s.rehomed && !s.jobs.is_empty())
            {
                self.counts.beside_old += 1;
            }
        }
        let at = self.now + self.latency();
        if let Some(l) = self.link_of(e, conn) {
            self.links[l].to_node.send(&envelope, at);
        }
        Ok(())
    }

    /// The links of Edge `e` not closed yet.
    pub(crate) fn open_conns(&self, e: usize) -> Vec<ConnId> {
        self.links
            .iter()
            .filter(|l| l.edge == e && !l.closed_by_edge)
            .map(|l| l.conn)
            .collect()
    }

    fn session_of(&self, link: usize) -> Option<(usize, usize)> {
        let node = self.links[link].node;
        let s = self.nodes[node]
            .sessions
            .iter()
            .position(|s| s.link == link)?;
        Some((node, s))
    }

    /// Whether node `n` keeps no session with Edge `e` and should dial it (multi-homed).
    fn wants_dial(&self, n: usize, e: usize) -> bool {
        matches!(self.setup.shape, Shape::Multihome { .. })
            && !self.nodes[n].sessions.iter().any(|s| s.edge == e)
    }

    /// Runs every machine until `until`, one due thing at a time.
    pub(crate) fn run_until(&mut self, until: Timestamp) -> Result<(), String> {
        loop {
            let next = self.next_due().min(until);
            self.now = self.now.max(next);
            self.step()?;
            if next >= until {
                return Ok(());
            }
        }
    }

    fn next_due(&self) -> Timestamp {
        let mut next = Timestamp::MAX;
        for edge in self.edges.iter().filter(|e| e.alive) {
            if let Some(w) = edge.core.poll_timeout() {
                next = next.min(w.at);
            }
        }
        for link in &self.links {
            for wire in [&link.to_node, &link.to_edge] {
                if let Some(at) = wire.next_arrival() {
                    next = next.min(at);
                }
            }
        }
        for (n, node) in self.nodes.iter().enumerate() {
            if let Some(w) = node.supervisor.as_ref().and_then(Supervisor::poll_timeout) {
                next = next.min(w.at);
            }
            for (e, at) in node.redial_at.iter().enumerate() {
                if self.wants_dial(n, e) {
                    next = next.min(*at);
                }
            }
            for s in &node.sessions {
                if let Some(w) = s.session.poll_timeout() {
                    next = next.min(w.at);
                }
                for job in s.jobs.values() {
                    next = next.min(job.next_at());
                }
            }
        }
        next.max(self.now)
    }

    fn step(&mut self) -> Result<(), String> {
        let now = self.now;
        // Frames that arrived.
        for l in 0..self.links.len() {
            let e = self.links[l].edge;
            while let Some(frames) = self.links[l].to_edge.receive_one(now) {
                let frames = frames.map_err(|err| format!("codec: {err}"))?;
                if !self.edges[e].alive {
                    continue;
                }
                let conn = self.links[l].conn;
                for envelope in frames {
                    let _ = self.edges[e].core.handle_envelope(now, conn, envelope);
                }
                self.drain_edge(e)?;
            }
            while let Some(frames) = self.links[l].to_node.receive_one_inbound(now) {
                let frames = frames.map_err(|err| format!("codec: {err}"))?;
                let Some((n, s)) = self.session_of(l) else {
                    continue;
                };
                // What the others hold, right before this session handles its Edge.
                self.take_in(n, s);
                for inbound in frames {
                    let _ = self.nodes[n].sessions[s]
                        .session
                        .handle_inbound(now, inbound);
                }
                self.drain_node(n)?;
            }
            // The Edge closed (or died): once what it sent has arrived, the node knows.
            if self.links[l].closed_by_edge
                && self.links[l].to_node.is_empty()
                && let Some((n, s)) = self.session_of(l)
            {
                let failure = Failure::EdgeClosed("closed".into());
                let _ = self.nodes[n].sessions[s]
                    .session
                    .handle_connection_lost(now, failure);
                self.drain_node(n)?;
            }
        }
        // Timers.
        for e in 0..self.edges.len() {
            if self.edges[e].alive
                && self.edges[e]
                    .core
                    .poll_timeout()
                    .is_some_and(|w| w.at <= now)
            {
                self.edges[e].core.handle_timeout(now);
                self.drain_edge(e)?;
            }
        }
        for n in 0..self.nodes.len() {
            if let Some(supervisor) = self.nodes[n].supervisor.as_mut()
                && supervisor.poll_timeout().is_some_and(|w| w.at <= now)
            {
                supervisor.handle_timeout(now);
            }
            for e in 0..self.nodes[n].redial_at.len() {
                if self.wants_dial(n, e) && self.nodes[n].redial_at[e] <= now {
                    if self.edges[e].alive {
                        self.dial(n, e);
                    } else {
                        self.nodes[n].redial_at[e] = now + Duration::from_millis(50);
                    }
                }
            }
            for s in 0..self.nodes[n].sessions.len() {
                if self.nodes[n].sessions[s]
                    .session
                    .poll_timeout()
                    .is_some_and(|w| w.at <= now)
                {
                    self.nodes[n].sessions[s].session.handle_timeout(now);
                }
                self.progress_jobs(n, s);
            }
            self.drain_node(n)?;
        }
        Ok(())
    }

    /// Provider work: start, one delta, complete (or cancelled).
    fn progress_jobs(&mut self, n: usize, s: usize) {
        let session = &mut self.nodes[n].sessions[s];
        advance_jobs(
            &mut self.rng,
            self.now,
            &mut session.session,
            &mut session.jobs,
        );
    }

    /// At the end: every request ended, and every live Edge holds no lease.
    pub(crate) fn check_edges_settled(&self) -> Result<(), String> {
        for (e, edge) in self.edges.iter().enumerate() {
            if let Some((request, _)) = edge.requests.iter().find(|(_, ended)| !**ended) {
                return Err(format!("edge {e}: {request} never ended"));
            }
            if edge.alive && edge.core.ledger().leases_held() > 0 {
                return Err(format!(
                    "edge {e} still holds {} leases at the end",
                    edge.core.ledger().leases_held()
                ));
            }
        }
        Ok(())
    }

    /// Nodes ready on Edge `e`.
    pub(crate) fn ready_on(&self, e: usize) -> usize {
        self.edges[e]
            .core
            .nodes()
            .iter()
            .filter(|n| n.state == iop_proto_core::edge::NodeState::Ready)
            .count()
    }
}
