//! A deterministic simulation of nodes multi-homed to a cluster of Edges
//! (docs/cluster.md): every node keeps a session with each of three real [`EdgeCore`]s in
//! cluster mode, callers submit to any Edge, and the Edges race for the same providers.
//! Links carry frames through the real codec with seeded latency; now and then an Edge is
//! killed (its connections drop) and started again, and the nodes dial it anew.
//!
//! The node side does what the node shell does: its sessions share one capacity through
//! a [`LoadBoard`]: a session takes in what the others hold right before it handles what
//! its Edge sent, and publishes what it holds once it has; whenever one's load moves, the
//! others take it in (and report it to their Edges). Claims are admitted at once (the
//! cluster world, `testkit::cluster`, checks what etcd decides).
//!
//! Invariants, checked after every step:
//! - no provider above its capacity: a node's work across all its sessions stays within
//!   each adapter's capacity and long-context capacity, whatever the Edges believed;
//! - every accepted request ends exactly once;
//! - at the end, every live Edge holds no lease and waits for nothing, and every node is
//!   ready on every Edge with one session each.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;

use crate::harness::{Job, Wire, advance_jobs, within_capacity};
use crate::rng::Rng;
use iop_proto_core::RequestId;
use iop_proto_core::cluster::ClaimDecision;
use iop_proto_core::edge::{
    ConnId, EdgeCore, EdgeEvent, Outcome, Peer, RequestEvent, Submit, Transmit,
};
use iop_proto_core::edge_config::{CandidateSpec, EdgeConfig, ModelSpec, NodeSpec, QueueLimits};
use iop_proto_core::session::{LoadBoard, NodeSession, NodeTransmit, SessionConfig, SessionEvent};
use iop_proto_core::testkit::Inspect;
use iop_proto_core::time::Timestamp;
use iop_proto_core::token::TokenVerifier;
use iop_proto_core::wire::AdapterType;

const EDGES: usize = 3;
const NODES: usize = 3;
const TOKEN: &str = "multihome-sim-token";
/// Units of each node's one adapter, and of those long-context: few, so the Edges race.
const CAPACITY: u32 = 2;
const LONG_CAPACITY: u32 = 1;

/// Bugs planted in the simulated node, to prove the invariants catch them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MultihomeFaults {
    /// A session does not take in what the node's other sessions hold: its gates count
    /// only its own work.
    pub blind_sessions: bool,
}

/// What one run did.
#[derive(Clone, Debug, Default)]
pub struct MultihomeStats {
    /// Requests accepted by some Edge.
    pub requests: u64,
    /// Requests that completed.
    pub completed: u64,
    /// Runs a node refused because another Edge had taken the slot.
    pub refused: u64,
    /// Edges killed.
    pub killed: u64,
    /// Runs started while the same node ran work for another Edge.
    pub shared: u64,
}

struct Edge {
    core: EdgeCore,
    alive: bool,
    /// Accepted requests, and whether each has ended.
    requests: BTreeMap<RequestId, bool>,
    next_conn: u64,
}

struct Link {
    edge: usize,
    conn: ConnId,
    to_node: Wire,
    to_edge: Wire,
    /// The Edge closed it (or died): the node learns once what was sent has arrived.
    closed_by_edge: bool,
}

struct Session {
    link: usize,
    edge: usize,
    session: NodeSession,
    jobs: BTreeMap<String, Job>,
    /// Its key on the node's board, and the load changes it last published.
    key: u64,
    published: u64,
}

struct Node {
    id: String,
    sessions: Vec<Session>,
    board: LoadBoard,
    /// When to dial each Edge it has no session with.
    redial_at: [Timestamp; EDGES],
}

struct World {
    rng: Rng,
    now: Timestamp,
    faults: MultihomeFaults,
    edges: Vec<Edge>,
    links: Vec<Link>,
    nodes: Vec<Node>,
    stats: MultihomeStats,
    trace: Vec<String>,
}

fn config() -> EdgeConfig {
    let mut nodes = BTreeMap::new();
    for n in 0..NODES {
        nodes.insert(
            format!("n{n}"),
            NodeSpec {
                token: TokenVerifier::from_secret(TOKEN.as_bytes()),
                adapters: vec![iop_proto_core::testkit::adapter(
                    "a",
                    AdapterType::Mock,
                    CAPACITY,
                    LONG_CAPACITY,
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
            first_byte_timeout: None,
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
        queue: QueueLimits {
            max_waiting: 16,
            wait_timeout: Duration::from_millis(4000),
        },
        ..EdgeConfig::default()
    }
}

fn edge_core() -> EdgeCore {
    let mut core = EdgeCore::new(config()).expect("valid config");
    core.enable_cluster();
    core.handle_cluster_serving(Timestamp::ZERO);
    core
}

/// Runs the multi-homed world of `seed`; the first broken invariant is the error, with
/// the trace's last lines.
///
/// # Errors
/// An invariant broke.
pub fn run_multihome_seed(seed: u64, faults: MultihomeFaults) -> Result<MultihomeStats, String> {
    let mut world = World {
        rng: Rng::new(seed),
        now: Timestamp::ZERO,
        faults,
        edges: (0..EDGES)
            .map(|_| Edge {
                core: edge_core(),
                alive: true,
                requests: BTreeMap::new(),
                next_conn: 1,
            })
            .collect(),
        links: Vec::new(),
        nodes: (0..NODES)
            .map(|n| Node {
                id: format!("n{n}"),
                sessions: Vec::new(),
                board: LoadBoard::default(),
                redial_at: [Timestamp::ZERO; EDGES],
            })
            .collect(),
        stats: MultihomeStats::default(),
        trace: Vec::new(),
    };
    let result = world.play(seed);
    result.map(|()| world.stats.clone()).map_err(|err| {
        let tail: Vec<&String> = world.trace.iter().rev().take(40).collect();
        let mut s = format!("multihome seed {seed}: {err}\n--- last steps\n");
        for line in tail.into_iter().rev() {
            s.push_str(line);
            s.push('\n');
        }
        s
    })
}

impl World {
    fn log(&mut self, line: impl FnOnce() -> String) {
        if self.trace.len() >= 400 {
            self.trace.drain(..200);
        }
        let line = format!("t={}ms {}", self.now.as_millis(), line());
        self.trace.push(line);
    }

    fn latency(&mut self) -> Duration {
        Duration::from_millis(self.rng.range(1, 8))
    }

    /// Load on every Edge, an Edge killed and started again in some seeds, then quiet.
    fn play(&mut self, seed: u64) -> Result<(), String> {
        let kill_at = seed
            .is_multiple_of(3)
            .then(|| Timestamp::from_millis(self.rng.range(500, 1500)));
        let mut killed: Option<(usize, Timestamp)> = None;
        let load_until = Timestamp::from_millis(2000);
        while self.now < load_until {
            if let Some(at) = kill_at
                && killed.is_none()
                && self.now >= at
            {
                let e = self.rng.below(EDGES as u64) as usize;
                self.kill(e);
                killed = Some((
                    e,
                    self.now + Duration::from_millis(self.rng.range(200, 800)),
                ));
            }
            if let Some((e, back)) = killed
                && !self.edges[e].alive
                && self.now >= back
            {
                self.restart(e);
            }
            for _ in 0..self.rng.below(4) {
                let e = self.rng.below(EDGES as u64) as usize;
                let long = self.rng.chance(15);
                self.submit(e, long)?;
            }
            let step = self.rng.range(1, 20);
            self.run_until(self.now + Duration::from_millis(step))?;
        }
        if let Some((e, _)) = killed
            && !self.edges[e].alive
        {
            self.restart(e);
        }
        self.run_until(self.now + Duration::from_millis(6000))?;
        self.check_end()
    }

    fn kill(&mut self, e: usize) {
        self.log(|| format!("edge {e} killed"));
        self.stats.killed += 1;
        self.edges[e].alive = false;
        // Its requests die with it: their callers see their connection drop.
        for ended in self.edges[e].requests.values_mut() {
            *ended = true;
        }
        for link in self.links.iter_mut().filter(|l| l.edge == e) {
            link.to_edge.clear();
            link.closed_by_edge = true;
        }
    }

    fn restart(&mut self, e: usize) {
        self.log(|| format!("edge {e} started again"));
        self.edges[e] = Edge {
            core: edge_core(),
            alive: true,
            requests: BTreeMap::new(),
            next_conn: 1_000 * (self.stats.killed + 1),
        };
    }

    fn submit(&mut self, e: usize, long: bool) -> Result<(), String> {
        if !self.edges[e].alive {
            return Ok(());
        }
        let mut submit = Submit::chat("m", Bytes::from_static(br#"{"messages":[]}"#));
        submit.prompt_tokens = if long { 500 } else { 10 };
        let now = self.now;
        if let Ok(request) = self.edges[e].core.handle_submit(now, submit) {
            self.stats.requests += 1;
            self.edges[e].requests.insert(request, false);
        }
        self.drain_edge(e)
    }

    /// Routes an Edge's outputs; admits every claim at once.
    fn drain_edge(&mut self, e: usize) -> Result<(), String> {
        loop {
            let mut progressed = false;
            while let Some(t) = self.edges[e].core.poll_transmit() {
                progressed = true;
                match t {
                    Transmit::Frame { conn, envelope } => {
                        let at = self.now + self.latency();
                        if let Some(l) = self.link_of(e, conn) {
                            self.links[l].to_node.send(&envelope, at);
                        }
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
                            self.stats.completed += 1;
                        } else {
                            self.log(|| format!("edge {e}: {request} ended {outcome:?}"));
                        }
                    }
                    _ => {}
                }
            }
            let now = self.now;
            for conn in claims {
                self.edges[e]
                    .core
                    .handle_claim(now, conn, ClaimDecision::Admitted { fence: 1 });
            }
            while self.edges[e].core.poll_lifecycle().is_some() {}
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

    fn session_of(&self, link: usize) -> Option<(usize, usize)> {
        self.nodes.iter().enumerate().find_map(|(n, node)| {
            node.sessions
                .iter()
                .position(|s| s.link == link)
                .map(|s| (n, s))
        })
    }

    /// Session `s` of node `n` takes in what the node's other sessions hold.
    fn take_in(&mut self, n: usize, s: usize) {
        if self.faults.blind_sessions {
            return;
        }
        let now = self.now;
        let node = &mut self.nodes[n];
        let held = node.board.held_for(node.sessions[s].key);
        let _ = node.sessions[s].session.handle_held_elsewhere(now, held);
    }

    /// Routes node `n`'s sessions' outputs, publishes what each holds, and lets the
    /// others take it in when it moved.
    fn drain_node(&mut self, n: usize) -> Result<(), String> {
        let now = self.now;
        loop {
            let mut s = 0;
            while s < self.nodes[n].sessions.len() {
                let link = self.nodes[n].sessions[s].link;
                let mut closed = false;
                while let Some(t) = self.nodes[n].sessions[s].session.poll_transmit() {
                    match t {
                        NodeTransmit::Frame(envelope) => {
                            let at = now + self.latency();
                            self.links[link].to_edge.send(&envelope, at);
                        }
                        NodeTransmit::Close { .. } => closed = true,
                    }
                }
                let mut events = Vec::new();
                while let Some(event) = self.nodes[n].sessions[s].session.poll_event() {
                    events.push(event);
                }
                for event in events {
                    self.on_session_event(n, s, event)?;
                }
                if closed {
                    self.session_over(n, s);
                    continue;
                }
                s += 1;
            }
            // Publish; whoever's load moved, the others take it in.
            let mut moved = false;
            let node = &mut self.nodes[n];
            for session in &mut node.sessions {
                let changes = session.session.load_changes();
                if changes != session.published {
                    session.published = changes;
                    node.board.publish(session.key, session.session.load());
                    moved = true;
                }
            }
            if !moved {
                return Ok(());
            }
            for s in 0..self.nodes[n].sessions.len() {
                self.take_in(n, s);
            }
        }
    }

    fn on_session_event(&mut self, n: usize, s: usize, event: SessionEvent) -> Result<(), String> {
        let now = self.now;
        match event {
            SessionEvent::ApplyConfig { .. } => {
                let _ = self.nodes[n].sessions[s]
                    .session
                    .handle_config_applied(now, Ok(()));
            }
            SessionEvent::StartRun { request } => {
                if self.nodes[n]
                    .sessions
                    .iter()
                    .enumerate()
                    .any(|(i, other)| i != s && !other.jobs.is_empty())
                {
                    self.stats.shared += 1;
                }
                let delay = self.rng.range(5, 250);
                self.nodes[n].sessions[s].jobs.insert(
                    request.run_id,
                    Job::new(request.long_context, now + Duration::from_millis(delay)),
                );
                self.check_capacity(n)?;
            }
            SessionEvent::CancelRun { run_id } => {
                if let Some(job) = self.nodes[n].sessions[s].jobs.get_mut(&run_id) {
                    job.cancel(now);
                }
            }
            SessionEvent::WorkRefused { run_id, reason } => {
                self.stats.refused += 1;
                let id = self.nodes[n].id.clone();
                self.log(|| format!("{id} refused {run_id}: {reason}"));
            }
            SessionEvent::Ready
            | SessionEvent::Rehome { .. }
            | SessionEvent::Members(_)
            | SessionEvent::StartTunnel { .. }
            | SessionEvent::Command { .. }
            | SessionEvent::RefreshConfig { .. }
            | SessionEvent::CancelRejected { .. }
            | SessionEvent::PeerViolation { .. } => {}
        }
        Ok(())
    }

    /// A node's work across its sessions stays within its adapter's capacity.
    fn check_capacity(&self, n: usize) -> Result<(), String> {
        let node = &self.nodes[n];
        let jobs = node.sessions.iter().flat_map(|s| s.jobs.values());
        within_capacity(&node.id, jobs, CAPACITY, LONG_CAPACITY)
    }

    fn session_over(&mut self, n: usize, s: usize) {
        let now = self.now;
        let session = self.nodes[n].sessions.remove(s);
        self.nodes[n].board.leave(session.key);
        let link = session.link;
        let (e, conn) = (self.links[link].edge, self.links[link].conn);
        self.links[link].to_node.clear();
        self.links[link].closed_by_edge = true;
        if self.edges[e].alive {
            let _ = self.edges[e].core.handle_connection_closed(now, conn);
        }
        self.nodes[n].redial_at[e] = now + Duration::from_millis(50);
        let id = self.nodes[n].id.clone();
        self.log(|| format!("{id} session on edge {e} conn {} over", conn.0));
        for s in 0..self.nodes[n].sessions.len() {
            self.take_in(n, s);
        }
    }

    fn dial(&mut self, n: usize, e: usize) {
        let now = self.now;
        if !self.edges[e].alive {
            self.nodes[n].redial_at[e] = now + Duration::from_millis(50);
            return;
        }
        let conn = ConnId(self.edges[e].next_conn);
        self.edges[e].next_conn += 1;
        let _ = self.edges[e]
            .core
            .handle_connection_opened(now, conn, Peer::default());
        self.links.push(Link {
            edge: e,
            conn,
            to_node: Wire::new(16 << 20),
            to_edge: Wire::new(16 << 20),
            closed_by_edge: false,
        });
        let link = self.links.len() - 1;
        let node = &mut self.nodes[n];
        let mut config = SessionConfig::new(node.id.clone(), TOKEN);
        config.instance_id = 1 + n as u64;
        config.cluster = true;
        config.heartbeat_interval = Duration::from_millis(200);
        let mut session = NodeSession::new(config);
        let key = node.board.join();
        if !self.faults.blind_sessions {
            let _ = session.handle_held_elsewhere(now, node.board.held_for(key));
        }
        let _ = session.handle_connected(now);
        node.sessions.push(Session {
            link,
            edge: e,
            session,
            jobs: BTreeMap::new(),
            key,
            published: u64::MAX,
        });
        let id = node.id.clone();
        self.log(|| format!("{id} dials edge {e} (conn {})", conn.0));
    }

    /// Runs every machine until `until`, one due thing at a time.
    fn run_until(&mut self, until: Timestamp) -> Result<(), String> {
        loop {
            let next = self.next_due().min(until);
            self.now = self.now.max(next);
            self.step()?;
            if next >= until {
                return Ok(());
            }
        }
    }

    fn wants_dial(&self, n: usize, e: usize) -> bool {
        !self.nodes[n].sessions.iter().any(|s| s.edge == e)
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
            for e in 0..EDGES {
                if self.wants_dial(n, e) {
                    next = next.min(node.redial_at[e]);
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
            while let Some(frames) = self.links[l].to_node.receive_one(now) {
                let frames = frames.map_err(|err| format!("codec: {err}"))?;
                let Some((n, s)) = self.session_of(l) else {
                    continue;
                };
                // What the others hold, right before this session handles its Edge.
                self.take_in(n, s);
                for envelope in frames {
                    let _ = self.nodes[n].sessions[s]
                        .session
                        .handle_envelope(now, envelope);
                }
                self.drain_node(n)?;
            }
            if self.links[l].closed_by_edge
                && self.links[l].to_node.is_empty()
                && let Some((n, s)) = self.session_of(l)
            {
                let failure = iop_proto_core::reconnect::Failure::EdgeClosed("closed".into());
                let _ = self.nodes[n].sessions[s]
                    .session
                    .handle_connection_lost(now, failure);
                self.drain_node(n)?;
            }
        }
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
            for e in 0..EDGES {
                if self.wants_dial(n, e) && self.nodes[n].redial_at[e] <= now {
                    self.dial(n, e);
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

    fn check_end(&mut self) -> Result<(), String> {
        for (e, edge) in self.edges.iter().enumerate() {
            if let Some((request, _)) = edge.requests.iter().find(|(_, ended)| !**ended) {
                return Err(format!("edge {e}: {request} never ended"));
            }
            if edge.core.ledger().leases_held() > 0 {
                return Err(format!(
                    "edge {e} still holds {} leases at the end",
                    edge.core.ledger().leases_held()
                ));
            }
            let ready = edge
                .core
                .nodes()
                .iter()
                .filter(|n| n.state == iop_proto_core::edge::NodeState::Ready)
                .count();
            if ready != NODES {
                return Err(format!("only {ready} nodes ready on edge {e} at the end"));
            }
        }
        for node in &self.nodes {
            for e in 0..EDGES {
                let on = node.sessions.iter().filter(|s| s.edge == e).count();
                if on != 1 {
                    return Err(format!("{} ends with {on} sessions on edge {e}", node.id));
                }
            }
        }
        Ok(())
    }
}
