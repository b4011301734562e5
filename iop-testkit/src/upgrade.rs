//! A deterministic simulation of an Edge upgrade under load: one Edge process after
//! another, each a real [`EdgeCore`], re-homing node processes that each hold a draining
//! session to the old process beside a new one to its successor, with clients
//! submitting throughout. Links carry frames through the real codec with seeded latency.
//!
//! A handover is what the shell does: the successor starts listening (new dials reach
//! it), then the old core is told ([`EdgeCore::handle_rehome`]). Sometimes the old
//! process is killed in the middle (every one of its connections drops). Nodes run the
//! real [`NodeSession`] and [`Supervisor`]; a re-homed session drains beside the new one
//! and what it holds is reported to the new one, as the node shell does.
//!
//! Invariants, checked after every step:
//! - no dispatch (`RunRequest`, `ProviderTunnelRequest`) on a connection after the Edge
//!   told it to re-home;
//! - no provider above its capacity: a node's work across its sessions stays within each
//!   adapter's capacity and long-context capacity, and no session refuses work for
//!   capacity (the Edge never oversubscribed what the node reported);
//! - every accepted request ends exactly once, and at the end every live Edge holds no
//!   lease, waits for nothing, and every node is ready on the last Edge with one session.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use bytes::Bytes;

use crate::harness::{Job, Wire, advance_jobs, within_capacity};
use crate::rng::Rng;
use iop_proto_core::RequestId;
use iop_proto_core::edge::{ConnId, EdgeCore, EdgeEvent, Peer, RequestEvent, Submit, Transmit};
use iop_proto_core::edge_config::{CandidateSpec, EdgeConfig, ModelSpec, NodeSpec, QueueLimits};
use iop_proto_core::reconnect::{MaxAttempts, ReconnectPolicy, Supervisor, SupervisorEvent};
use iop_proto_core::session::{NodeSession, NodeTransmit, SessionConfig, SessionEvent};
use iop_proto_core::testkit::Inspect;
use iop_proto_core::time::Timestamp;
use iop_proto_core::token::TokenVerifier;
use iop_proto_core::wire::{AdapterLoad, AdapterType, Body, Envelope, NodeRehomeRequest};

const NODES: usize = 3;
const TOKEN: &str = "upgrade-sim-token";
/// Units of each node's one adapter, and of those long-context.
const CAPACITY: u32 = 3;
const LONG_CAPACITY: u32 = 1;

/// Bugs planted in the simulated shells, to prove the invariants catch them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UpgradeFaults {
    /// The old Edge's shell tells the nodes to re-home itself, without telling its core:
    /// the core goes on dispatching to sessions told to re-home.
    pub rehome_behind_the_core: bool,
    /// The node does not report what its draining session holds to the new one.
    pub hide_held_elsewhere: bool,
}

/// What one run did.
#[derive(Clone, Debug, Default)]
pub struct UpgradeStats {
    /// Requests accepted by some Edge.
    pub requests: u64,
    /// Requests that completed.
    pub completed: u64,
    /// Handovers.
    pub handovers: u64,
    /// Old Edges killed mid-handover.
    pub killed: u64,
    /// Times a node re-homed.
    pub rehomed: u64,
    /// Dispatches a new Edge made while a node's old session still held capacity.
    pub beside_old: u64,
}

struct Edge {
    core: EdgeCore,
    alive: bool,
    /// Connections told to re-home.
    told: BTreeSet<ConnId>,
    /// Accepted requests, and whether each has ended.
    requests: BTreeMap<RequestId, bool>,
    next_conn: u64,
}

struct Link {
    edge: usize,
    conn: ConnId,
    node: usize,
    to_node: Wire,
    to_edge: Wire,
    /// The Edge closed it: the node learns once what was sent before has arrived.
    closed_by_edge: bool,
}

struct Session {
    link: usize,
    session: NodeSession,
    jobs: BTreeMap<String, Job>,
    /// Told to re-home: it drains beside the current one.
    rehomed: bool,
}

struct Node {
    id: String,
    supervisor: Supervisor,
    sessions: Vec<Session>,
    /// The load last reported to the current session.
    reported: Vec<AdapterLoad>,
}

struct World {
    rng: Rng,
    now: Timestamp,
    faults: UpgradeFaults,
    edges: Vec<Edge>,
    /// The Edge the listener leads to.
    listening: usize,
    links: Vec<Link>,
    nodes: Vec<Node>,
    stats: UpgradeStats,
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
            max_waiting: 8,
            wait_timeout: Duration::from_millis(3000),
        },
        ..EdgeConfig::default()
    }
}

/// Runs the upgrade world of `seed`; the first broken invariant is the error, with the
/// trace's last lines.
///
/// # Errors
/// An invariant broke.
pub fn run_upgrade_seed(seed: u64, faults: UpgradeFaults) -> Result<UpgradeStats, String> {
    let mut world = World {
        rng: Rng::new(seed),
        now: Timestamp::ZERO,
        faults,
        edges: Vec::new(),
        listening: 0,
        links: Vec::new(),
        nodes: Vec::new(),
        stats: UpgradeStats::default(),
        trace: Vec::new(),
    };
    world.start_edge();
    for n in 0..NODES {
        let policy = ReconnectPolicy {
            max_attempts: MaxAttempts::Unlimited,
            interval: Duration::from_millis(50),
        };
        let mut supervisor = Supervisor::new(policy);
        let _ = supervisor.handle_start(Timestamp::ZERO);
        world.nodes.push(Node {
            id: format!("n{n}"),
            supervisor,
            sessions: Vec::new(),
            reported: Vec::new(),
        });
    }
    let result = world.play(seed);
    result.map(|()| world.stats.clone()).map_err(|err| {
        let tail: Vec<&String> = world.trace.iter().rev().take(40).collect();
        let tail: Vec<&String> = tail.into_iter().rev().collect();
        format!("upgrade seed {seed}: {err}\n--- last steps\n{}", {
            let mut s = String::new();
            for line in tail {
                s.push_str(line);
                s.push('\n');
            }
            s
        })
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

    fn start_edge(&mut self) {
        let core = EdgeCore::new(config()).expect("valid config");
        self.edges.push(Edge {
            core,
            alive: true,
            told: BTreeSet::new(),
            requests: BTreeMap::new(),
            next_conn: 1,
        });
        self.listening = self.edges.len() - 1;
    }

    fn latency(&mut self) -> Duration {
        Duration::from_millis(self.rng.range(1, 6))
    }

    /// The whole run: load, one or two handovers (some killed midway), then quiet.
    fn play(&mut self, seed: u64) -> Result<(), String> {
        let handovers = 1 + (seed % 2);
        let mut next_handover = Timestamp::from_millis(self.rng.range(300, 900));
        let load_until = Timestamp::from_millis(4000);
        while self.now < load_until {
            if self.now >= next_handover && self.stats.handovers < handovers {
                self.handover()?;
                next_handover = self.now + Duration::from_millis(self.rng.range(400, 1500));
            }
            for _ in 0..self.rng.below(3) {
                let long = self.rng.chance(15);
                self.submit(long)?;
            }
            let step = self.rng.range(1, 25);
            self.run_until(self.now + Duration::from_millis(step))?;
        }
        // Quiet: everything in flight ends, nodes settle on the last Edge.
        self.run_until(self.now + Duration::from_millis(8000))?;
        self.check_end()
    }

    fn handover(&mut self) -> Result<(), String> {
        let old = self.listening;
        self.start_edge();
        self.stats.handovers += 1;
        self.log(|| format!("handover: edge {old} -> edge {}", old + 1));
        if self.faults.rehome_behind_the_core {
            let conns: Vec<ConnId> = self
                .links
                .iter()
                .filter(|l| l.edge == old && !l.closed_by_edge)
                .map(|l| l.conn)
                .collect();
            for conn in conns {
                let envelope = Envelope::new(Body::NodeRehomeRequest(NodeRehomeRequest {
                    reason: "planted".into(),
                }));
                self.edge_writes(old, conn, envelope)?;
            }
        } else {
            let now = self.now;
            self.edges[old].core.handle_rehome(now);
            self.drain_edge(old)?;
        }
        if self.rng.chance(25) {
            // Killed in the middle of the handover.
            let at = self.rng.range(0, 300);
            self.run_until(self.now + Duration::from_millis(at))?;
            self.kill(old);
        }
        Ok(())
    }

    fn kill(&mut self, edge: usize) {
        self.log(|| format!("edge {edge} killed"));
        self.stats.killed += 1;
        self.edges[edge].alive = false;
        // Its requests die with it: their callers see their connection drop.
        for ended in self.edges[edge].requests.values_mut() {
            *ended = true;
        }
        for l in 0..self.links.len() {
            if self.links[l].edge == edge {
                self.links[l].to_edge.clear();
                self.links[l].closed_by_edge = true;
            }
        }
    }

    fn submit(&mut self, long: bool) -> Result<(), String> {
        let e = self.listening;
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

    /// Routes an Edge's outputs.
    fn drain_edge(&mut self, e: usize) -> Result<(), String> {
        loop {
            let mut progressed = false;
            while let Some(t) = self.edges[e].core.poll_transmit() {
                progressed = true;
                match t {
                    Transmit::Frame { conn, envelope } => self.edge_writes(e, conn, envelope)?,
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
            while let Some(event) = self.edges[e].core.poll_event() {
                progressed = true;
                if let EdgeEvent::Request {
                    request,
                    event: RequestEvent::Ended(outcome),
                } = event
                {
                    match self.edges[e].requests.get_mut(&request) {
                        Some(ended) if *ended => {
                            return Err(format!("edge {e}: {request} ended twice"));
                        }
                        Some(ended) => *ended = true,
                        None => return Err(format!("edge {e}: {request} ended, never accepted")),
                    }
                    if outcome == iop_proto_core::edge::Outcome::Completed {
                        self.stats.completed += 1;
                    }
                }
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

    fn edge_writes(&mut self, e: usize, conn: ConnId, envelope: Envelope) -> Result<(), String> {
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
        if dispatch && e == self.listening {
            // A dispatch while an old session of the node still works.
            if let Some(l) = self.link_of(e, conn) {
                let node = self.links[l].node;
                if self.nodes[node]
                    .sessions
                    .iter()
                    .any(|s| s.rehomed && !s.jobs.is_empty())
                {
                    self.stats.beside_old += 1;
                }
            }
        }
        let at = self.now + self.latency();
        if let Some(l) = self.link_of(e, conn) {
            self.links[l].to_node.send(&envelope, at);
        }
        Ok(())
    }

    fn session_of(&self, link: usize) -> Option<(usize, usize)> {
        let node = self.links[link].node;
        let s = self.nodes[node]
            .sessions
            .iter()
            .position(|s| s.link == link)?;
        Some((node, s))
    }

    /// Routes a node session's outputs.
    fn drain_node(&mut self, n: usize) -> Result<(), String> {
        let now = self.now;
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
        self.report_held(n);
        // Supervisor: dial when it says so.
        while let Some(event) = self.nodes[n].supervisor.poll_event() {
            if let SupervisorEvent::Dial { .. } = event {
                self.dial(n);
            }
        }
        Ok(())
    }

    fn on_session_event(&mut self, n: usize, s: usize, event: SessionEvent) -> Result<(), String> {
        let now = self.now;
        let node = &mut self.nodes[n];
        match event {
            SessionEvent::ApplyConfig { .. } => {
                let _ = node.sessions[s].session.handle_config_applied(now, Ok(()));
            }
            SessionEvent::Ready => {
                let _ = node.supervisor.handle_ready(now);
            }
            SessionEvent::StartRun { request } => {
                let delay = self.rng.range(5, 250);
                self.nodes[n].sessions[s].jobs.insert(
                    request.run_id,
                    Job::new(request.long_context, now + Duration::from_millis(delay)),
                );
                self.check_capacity(n)?;
            }
            SessionEvent::CancelRun { run_id } => {
                if let Some(job) = node.sessions[s].jobs.get_mut(&run_id) {
                    job.cancel(now);
                }
            }
            SessionEvent::Rehome { .. } => {
                node.sessions[s].rehomed = true;
                self.stats.rehomed += 1;
                let id = node.id.clone();
                let _ = node.supervisor.handle_rehome(now);
                self.log(|| format!("{id} re-homes"));
            }
            SessionEvent::WorkRefused { run_id, reason } => {
                return Err(format!(
                    "{} refused {run_id}: {reason} (the edge oversubscribed it)",
                    self.nodes[n].id
                ));
            }
            SessionEvent::StartTunnel { .. }
            | SessionEvent::Members(_)
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

    /// The current session learns what the re-homed ones hold (as the node shell does).
    fn report_held(&mut self, n: usize) {
        if self.faults.hide_held_elsewhere {
            return;
        }
        let node = &mut self.nodes[n];
        let Some(current) = node.sessions.iter().rposition(|s| !s.rehomed) else {
            return;
        };
        let loads: Vec<Vec<AdapterLoad>> = node
            .sessions
            .iter()
            .filter(|s| s.rehomed)
            .map(|s| s.session.load())
            .collect();
        let held = iop_proto_core::session::sum_loads(loads.iter().flatten());
        if held != node.reported {
            node.reported.clone_from(&held);
            let _ = node.sessions[current]
                .session
                .handle_held_elsewhere(self.now, held);
        }
    }

    fn session_over(&mut self, n: usize, s: usize) {
        let now = self.now;
        let session = self.nodes[n].sessions.remove(s);
        let link = session.link;
        let (e, conn) = (self.links[link].edge, self.links[link].conn);
        self.links[link].to_node.clear();
        self.links[link].closed_by_edge = true;
        if self.edges[e].alive {
            let _ = self.edges[e].core.handle_connection_closed(now, conn);
        }
        let id = self.nodes[n].id.clone();
        self.log(|| format!("{id} session on edge {e} conn {} over", conn.0));
        if !session.rehomed {
            let failure = session
                .session
                .end()
                .and_then(iop_proto_core::session::SessionEnd::failure)
                .unwrap_or(iop_proto_core::reconnect::Failure::EdgeClosed(
                    "closed".into(),
                ));
            let _ = self.nodes[n].supervisor.handle_failure(now, failure);
        }
    }

    fn dial(&mut self, n: usize) {
        let now = self.now;
        let e = self.listening;
        if !self.edges[e].alive {
            let _ = self.nodes[n].supervisor.handle_failure(
                now,
                iop_proto_core::reconnect::Failure::EdgeClosed("refused".into()),
            );
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
            node: n,
            to_node: Wire::new(16 << 20),
            to_edge: Wire::new(16 << 20),
            closed_by_edge: false,
        });
        let link = self.links.len() - 1;
        let node = &mut self.nodes[n];
        let _ = node.supervisor.handle_connected(now);
        let mut config = SessionConfig::new(node.id.clone(), TOKEN);
        config.instance_id = 1 + n as u64;
        config.rehome = true;
        config.heartbeat_interval = Duration::from_millis(200);
        let mut session = NodeSession::new(config);
        let _ = session.handle_held_elsewhere(now, node.reported.clone());
        let _ = session.handle_connected(now);
        node.sessions.push(Session {
            link,
            session,
            jobs: BTreeMap::new(),
            rehomed: false,
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
        for node in &self.nodes {
            if let Some(w) = node.supervisor.poll_timeout() {
                next = next.min(w.at);
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
            while let Some(frames) = self.links[l].to_node.receive_one(now) {
                let frames = frames.map_err(|err| format!("codec: {err}"))?;
                let Some((n, s)) = self.session_of(l) else {
                    continue;
                };
                for envelope in frames {
                    let _ = self.nodes[n].sessions[s]
                        .session
                        .handle_envelope(now, envelope);
                }
                self.drain_node(n)?;
            }
            // The Edge closed (or died): once what it sent has arrived, the node knows.
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
            if self.nodes[n]
                .supervisor
                .poll_timeout()
                .is_some_and(|w| w.at <= now)
            {
                self.nodes[n].supervisor.handle_timeout(now);
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
        let last = self.edges.len() - 1;
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
        for node in &self.nodes {
            let on_last = node
                .sessions
                .iter()
                .filter(|s| self.links[s.link].edge == last)
                .count();
            if node.sessions.len() != 1 || on_last != 1 {
                return Err(format!(
                    "{} ends with {} sessions ({on_last} on the last edge)",
                    node.id,
                    node.sessions.len()
                ));
            }
        }
        let ready = self.edges[last]
            .core
            .nodes()
            .iter()
            .filter(|n| n.state == iop_proto_core::edge::NodeState::Ready)
            .count();
        if ready != NODES {
            return Err(format!("only {ready} nodes ready on the last edge"));
        }
        Ok(())
    }
}
