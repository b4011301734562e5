//! A deterministic simulation of the whole protocol in one thread.
//!
//! One [`EdgeCore`], several simulated node processes (each a [`Supervisor`] plus a
//! [`NodeSession`] per connection, with a simulated provider behind it), one simulated
//! TCP link per connection carrying frames encoded and decoded by the real codec, with
//! seeded latency and jitter, and clients that submit, cancel and give up. Time is virtual
//! and jumps to the next thing due, so minutes of protocol run in milliseconds.
//!
//! Faults are weighted after FoundationDB's simulator and TigerBeetle's VOPR: node crash
//! (state lost, restart on a new connection), node freeze (no heartbeats, then it resumes
//! with stale state), network partition, abrupt disconnect, a second process registering
//! with the same node id, Edge config refresh, provider modes (slow, failing, hanging),
//! and bursts above capacity. Global invariants are checked after every step; the first
//! violation stops the run with the seed and the last steps of the trace.
//!
//! This file is longer than the crate's ~800-line norm on purpose: it is one world whose
//! every step interleaves all the machines, and its invariants (`check_invariants`) sit
//! next to the moves that could break them (`deliver`, `step_node`, `apply`). Split
//! apart, a reader would chase one scenario across files; it is test code and ships in
//! no build without the `testkit` feature.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::Faults;
use crate::harness::Wire;
use crate::rng::Rng;
use iop_proto_core::RequestId;
use iop_proto_core::edge::RunId;
use iop_proto_core::edge::{
    CloseReason, ConnId, DispatchShape, EdgeCore, EdgeEvent, NodeState, Outcome, RejectReason,
    RequestError, RequestEvent, Submit, Transmit,
};
use iop_proto_core::edge_config::{
    CandidateSpec, EdgeConfig, EdgeTiming, ModelSpec, NodeSpec, QueueLimits,
};
use iop_proto_core::reconnect::{
    ExitReason, Failure, ReconnectPolicy, Supervisor, SupervisorEvent,
};
use iop_proto_core::session::{
    NodeSession, NodeTransmit, RunOutput, SessionConfig, SessionEnd, SessionEvent, TunnelOutput,
};
use iop_proto_core::testkit::Inspect;
use iop_proto_core::testkit::internals::RunTracker;
use iop_proto_core::time::Timestamp;
use iop_proto_core::token::TokenVerifier;
use iop_proto_core::tunnel::TunnelPart;
use iop_proto_core::wire::{
    self, AdapterConfig, AdapterType, Body, Envelope, ErrorDetail, NodeCommandResponse,
    NodeRuntimeConfig, ProviderTunnelFrame, RunEvent, RunRequest, TunnelFrameKind, Usage,
};

/// How a simulated provider behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Answers after a few milliseconds per token.
    Normal,
    /// Answers slowly.
    Slow,
    /// Fails every request.
    Fail,
    /// Never answers until cancelled.
    Hang,
    /// Starts, sends one delta, then says nothing more until cancelled (a reasoning model
    /// thinking, a long prefill).
    Silent,
    /// Cannot be reached: every request fails at once with a retryable error (a run
    /// right after its start), before any byte.
    Refuse,
    /// Answers 503 with `Retry-After: 1` (a run: a retryable error after its start).
    Unavailable,
    /// Answers normally but takes a second to stop after a cancel, longer than the
    /// Edge's cancel grace: the Edge frees the unit while the node still holds it.
    Stubborn,
}

/// One step of a simulation. Generated from a seed by [`generate`], or by proptest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Let this many milliseconds pass.
    Advance(u16),
    /// A client request; it cancels after `cancel_after_ms` if set, and gives up at its
    /// timeout.
    Submit {
        /// Model group (index).
        model: u8,
        /// Long-context.
        long: bool,
        /// Client timeout in milliseconds.
        timeout_ms: u16,
        /// Cancel (caller disconnects) after this long.
        cancel_after_ms: Option<u16>,
        /// Only a tunnel-served provider may answer it (embeddings, completions).
        tunnel_only: bool,
    },
    /// Many requests at once (above capacity).
    Burst {
        /// Model group.
        model: u8,
        /// How many.
        count: u8,
    },
    /// The node process dies (state lost) and restarts later.
    Crash {
        /// Node.
        node: u8,
        /// Restart delay.
        restart_after_ms: u16,
    },
    /// The node process stops gracefully (a rolling restart: it asks the Edge to drain
    /// it and serves its work in flight to the end), then a new one starts.
    Stop {
        /// Node.
        node: u8,
        /// Restart delay after the process exited.
        restart_after_ms: u16,
        /// The new process starts at once, beside the one still draining (a restart that
        /// does not wait), and takes over once the old one has exited.
        overlap: bool,
    },
    /// The node process stops (no timers, no reads), then resumes.
    Freeze {
        /// Node.
        node: u8,
        /// How long.
        for_ms: u16,
    },
    /// The node's link stalls both ways, then delivers what it held.
    Partition {
        /// Node.
        node: u8,
        /// How long.
        for_ms: u16,
    },
    /// The node's connection resets.
    Disconnect {
        /// Node.
        node: u8,
    },
    /// A second process registers with the node's id, and dies after a while.
    Impostor {
        /// Node id (index).
        node: u8,
        /// Lifetime.
        for_ms: u16,
    },
    /// A misconfigured process behind the same address as every node (the simulated
    /// nodes share one source) registers with a wrong token, for a real node id or an
    /// unknown one, and is restarted in a loop until `for_ms` passes: its siblings with
    /// the right token must never be refused for its failures.
    BadSibling {
        /// The node id it claims (index), or `None` for an id the Edge does not know.
        node: Option<u8>,
        /// How long the restart loop lasts.
        for_ms: u16,
    },
    /// The Edge reloads a changed configuration (refresh pushed to ready nodes).
    Refresh,
    /// The node sends, for one of its runs, a message this Edge does not know (an event
    /// type or frame kind a newer node might use): that run fails, the connection stays.
    Garble {
        /// Node.
        node: u8,
    },
    /// The node's provider changes behaviour.
    Provider {
        /// Node.
        node: u8,
        /// Behaviour.
        mode: Mode,
    },
}

/// Nodes in the simulated world.
pub const NODES: usize = 3;
/// Model groups in the simulated world.
pub const MODELS: usize = 3;

/// Operations a seed generates: what `cargo test` and the wide sweep
/// (`scripts/sim-sweep`) both run, so a seed means the same world in each.
pub const OPS_PER_SEED: usize = 60;

/// Runs the world of `seed`: [`OPS_PER_SEED`] operations generated from it.
pub fn run_seed(seed: u64, options: SimOptions) -> Result<Stats, SimFailure> {
    let mut ops = generate(seed, OPS_PER_SEED);
    if !options.original_ops {
        weave_bad_siblings(seed, &mut ops);
        weave_broken_providers(seed, &mut ops);
        weave_stubborn_providers(seed, &mut ops);
    }
    run(seed, &ops, options)
}

/// Breaks providers in two fifths of the worlds (unreachable, or answering 503), from a
/// stream of its own.
fn weave_broken_providers(seed: u64, ops: &mut Vec<Op>) {
    let mut rng = Rng::new(seed ^ 0x3C6E_F372_FE94_F82B);
    if !rng.chance(40) {
        return;
    }
    for _ in 0..rng.range(1, 3) {
        let at = usize::try_from(rng.below(ops.len() as u64 + 1)).unwrap_or(0);
        let node = u8::try_from(rng.below(NODES as u64)).unwrap_or(0);
        let mode = if rng.chance(50) {
            Mode::Refuse
        } else {
            Mode::Unavailable
        };
        ops.insert(at.min(ops.len()), Op::Provider { node, mode });
    }
}

/// Makes a provider slow to stop after a cancel ([`Mode::Stubborn`]) in a fifth of the
/// worlds, from a stream of its own.
fn weave_stubborn_providers(seed: u64, ops: &mut Vec<Op>) {
    let mut rng = Rng::new(seed ^ 0xA54F_F53A_5F1D_36F1);
    if !rng.chance(20) {
        return;
    }
    let at = usize::try_from(rng.below(ops.len() as u64 + 1)).unwrap_or(0);
    let node = u8::try_from(rng.below(NODES as u64)).unwrap_or(0);
    ops.insert(
        at.min(ops.len()),
        Op::Provider {
            node,
            mode: Mode::Stubborn,
        },
    );
}

/// Adds misconfigured siblings to a third of the worlds, drawn from a stream of their
/// own so that the rest of a seed's operations stay what [`generate`] makes.
fn weave_bad_siblings(seed: u64, ops: &mut Vec<Op>) {
    let mut rng = Rng::new(seed ^ 0xBB67_AE85_84CA_A73B);
    if !rng.chance(33) {
        return;
    }
    for _ in 0..rng.range(1, 3) {
        let at = usize::try_from(rng.below(ops.len() as u64 + 1)).unwrap_or(0);
        let node = (!rng.chance(30)).then(|| u8::try_from(rng.below(NODES as u64)).unwrap_or(0));
        let for_ms = u16::try_from(rng.range(500, 6000)).unwrap_or(1000);
        ops.insert(at.min(ops.len()), Op::BadSibling { node, for_ms });
    }
}

/// Generates `len` weighted operations from `seed`.
#[must_use]
pub fn generate(seed: u64, len: usize) -> Vec<Op> {
    let mut rng = Rng::new(seed.wrapping_mul(0x2545_F491_4F6C_DD1D));
    let node = |rng: &mut Rng| u8::try_from(rng.below(NODES as u64)).unwrap_or(0);
    let ms = |rng: &mut Rng, lo: u64, hi: u64| u16::try_from(rng.range(lo, hi)).unwrap_or(u16::MAX);
    (0..len)
        .map(|_| match rng.below(100) {
            0..=27 => Op::Advance(ms(&mut rng, 1, 600)),
            28..=29 => Op::Garble {
                node: node(&mut rng),
            },
            30..=59 => Op::Submit {
                model: u8::try_from(rng.below(MODELS as u64)).unwrap_or(0),
                long: rng.chance(25),
                timeout_ms: ms(&mut rng, 300, 5000),
                cancel_after_ms: rng.chance(20).then(|| ms(&mut rng, 1, 800)),
                tunnel_only: rng.chance(25),
            },
            60..=64 => Op::Burst {
                model: u8::try_from(rng.below(MODELS as u64)).unwrap_or(0),
                count: u8::try_from(rng.range(3, 12)).unwrap_or(3),
            },
            65..=67 => Op::Crash {
                node: node(&mut rng),
                restart_after_ms: ms(&mut rng, 0, 1500),
            },
            68..=69 => Op::Stop {
                node: node(&mut rng),
                restart_after_ms: ms(&mut rng, 0, 1500),
                overlap: rng.chance(50),
            },
            70..=74 => Op::Freeze {
                node: node(&mut rng),
                for_ms: ms(&mut rng, 50, 1500),
            },
            75..=78 => Op::Partition {
                node: node(&mut rng),
                for_ms: ms(&mut rng, 50, 1500),
            },
            79..=82 => Op::Disconnect {
                node: node(&mut rng),
            },
            83..=85 => Op::Impostor {
                node: node(&mut rng),
                for_ms: ms(&mut rng, 50, 1500),
            },
            86..=89 => Op::Refresh,
            _ => Op::Provider {
                node: node(&mut rng),
                mode: match rng.below(10) {
                    0..=3 => Mode::Normal,
                    4..=5 => Mode::Slow,
                    6..=7 => Mode::Fail,
                    8 => Mode::Silent,
                    _ => Mode::Hang,
                },
            },
        })
        .collect()
}

/// Figures of a finished run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Virtual time simulated.
    pub simulated: Duration,
    /// Steps (event-processing rounds) taken.
    pub steps: u64,
    /// Requests submitted and accepted.
    pub requests: u64,
    /// Requests that completed.
    pub completed: u64,
    /// Requests refused at submit (queue full).
    pub refused: u64,
    /// Tunnel-only requests that ended because a reload left no tunnel-served provider.
    pub unsupported: u64,
    /// Frames carried by the links.
    pub frames: u64,
    /// Node ids that became a conflict (impostors fighting the real node).
    pub conflicts: u64,
    /// Messages of unknown kinds the nodes sent (each fails one run, never a connection).
    pub garbled: u64,
    /// Nodes that stopped gracefully and were closed by the Edge once drained.
    pub drained: u64,
    /// Registrations held off because their node id was draining (a restart that did
    /// not wait for the old process).
    pub held_off: u64,
    /// Registrations of misconfigured siblings refused.
    pub bad_refused: u64,
    /// Requests given another provider before their first byte.
    pub retries: u64,
    /// Providers ejected.
    pub ejections: u64,
    /// Providers restored by a probe.
    pub restored: u64,
    /// Of those, refusals held back by the throttle.
    pub bad_throttled: u64,
    /// Dispatches a node refused before asking its provider (its gate was full).
    pub work_refused: u64,
}

/// A violated invariant, with what is needed to replay it.
#[derive(Clone, Debug)]
pub struct SimFailure {
    /// The seed (latencies, jitter and provider timings).
    pub seed: u64,
    /// The virtual time of the violation.
    pub at: Timestamp,
    /// What broke.
    pub message: String,
    /// The last steps before it.
    pub trace: String,
}

impl std::fmt::Display for SimFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "simulation seed {} failed at {}: {}\nreplay with IOP_SIM_SEED={}\nlast steps:\n{}",
            self.seed, self.at, self.message, self.seed, self.trace
        )
    }
}

/// Options of a run.
#[derive(Clone, Copy, Debug, Default)]
pub struct SimOptions {
    /// Planted bugs.
    pub faults: Faults,
    /// Keep the whole trace instead of the last steps.
    pub full_trace: bool,
    /// Only the operations [`generate`] makes: no misconfigured siblings
    /// ([`Op::BadSibling`]) nor broken providers ([`Mode::Refuse`], [`Mode::Unavailable`]).
    pub original_ops: bool,
}

const TOKEN: &str = "sim-token";
/// What a misconfigured sibling sends instead.
const BAD_TOKEN: &str = "sim-token-with-a-typo";
/// The node id a sibling with a wrong id claims.
const UNKNOWN_ID: &str = "nx";

fn timing() -> EdgeTiming {
    EdgeTiming {
        heartbeat_interval: Duration::from_millis(200),
        heartbeat_timeout: Duration::from_millis(700),
        register_timeout: Duration::from_millis(800),
        refresh_timeout: Duration::from_millis(800),
        cancel_grace: Duration::from_millis(600),
    }
}

fn adapter(name: &str, kind: AdapterType, capacity: u32, long: u32, rev: u32) -> AdapterConfig {
    AdapterConfig {
        base_url: "http://provider.sim".into(),
        options: [("rev".to_owned(), rev.to_string())].into_iter().collect(),
        ..iop_proto_core::testkit::adapter(name, kind, capacity, long)
    }
}

/// The simulated Edge configuration; `rev` changes adapter options (a refresh). Every
/// fourth revision from 1 serves n1's `tun` adapter by runs, from 2 n1's and n2's, so
/// requests waiting for a tunnel see their providers change shape.
#[must_use]
pub fn world_config(rev: u32) -> EdgeConfig {
    let mut nodes = BTreeMap::new();
    for n in 0..NODES {
        let mut tun = adapter("tun", AdapterType::OpenaiCompat, 1 + (n as u32 % 2), 1, rev);
        let by_runs = match rev % 4 {
            1 => n == 1,
            2 => n == 1 || n == 2,
            _ => false,
        };
        if by_runs {
            tun.options.insert("dispatch".into(), "run".into());
        }
        nodes.insert(
            format!("n{n}"),
            NodeSpec {
                token: TokenVerifier::from_secret(TOKEN.as_bytes()),
                adapters: vec![adapter("run", AdapterType::Mock, 2, 1, rev), tun],
                runtime: NodeRuntimeConfig::default(),
            },
        );
    }
    let candidate = |n: usize, p: &str| CandidateSpec {
        node_id: format!("n{n}"),
        provider_id: p.into(),
        target: "t".into(),
    };
    let mut models = BTreeMap::new();
    models.insert(
        "m0".to_owned(),
        ModelSpec {
            candidates: vec![candidate(0, "run"), candidate(1, "run")],
            long_context_threshold: Some(100),
            first_byte_timeout: None,
        },
    );
    models.insert(
        "m1".to_owned(),
        ModelSpec {
            candidates: vec![candidate(1, "tun"), candidate(2, "tun")],
            long_context_threshold: Some(100),
            first_byte_timeout: None,
        },
    );
    models.insert(
        "m2".to_owned(),
        ModelSpec {
            candidates: vec![
                candidate(0, "tun"),
                candidate(2, "run"),
                candidate(1, "tun"),
            ],
            long_context_threshold: Some(100),
            first_byte_timeout: None,
        },
    );
    EdgeConfig {
        nodes,
        models,
        timing: timing(),
        queue: QueueLimits {
            max_waiting: 6,
            wait_timeout: Duration::from_millis(1500),
        },
        // Conflict timers scaled like the others: impostors fight over node ids for a
        // few seconds, and a held-off node must be back soon after its rival dies.
        admission: iop_proto_core::edge_config::Admission {
            conflict: iop_proto_core::edge_config::ConflictLimits {
                supersedes: 3,
                window: Duration::from_millis(2000),
                hold_down: Duration::from_millis(3000),
                retry_after: Duration::from_millis(500),
            },
            // Throttle timers scaled too: a bad sibling's answers are held back within
            // its restart loop.
            throttle: iop_proto_core::edge_config::ThrottleLimits {
                free_failures: 3,
                interval: Duration::from_millis(100),
                max_hold: Duration::from_millis(600),
                window: Duration::from_millis(2000),
                max_tracked: 64,
            },
            ..iop_proto_core::edge_config::Admission::default()
        },
        // Routing timers scaled like the others: a provider is ejected and probed again
        // within a world's life, and a hang is tried around well before a client gives up.
        routing: iop_proto_core::edge_config::Routing {
            first_byte_timeout: Duration::from_millis(600),
            eject_base: Duration::from_millis(200),
            eject_max: Duration::from_millis(1600),
            eject_window: Duration::from_millis(2000),
            eject_min_requests: 5,
            retry_after_max: Duration::from_millis(1000),
            ..iop_proto_core::edge_config::Routing::default()
        },
    }
}

#[derive(Debug)]
struct Work {
    tunnel: bool,
    next_at: Timestamp,
    step: u32,
    total: u32,
    cancelled: bool,
    fail: bool,
}

#[derive(Debug)]
struct NodeProc {
    node_id: String,
    alive: bool,
    impostor: bool,
    /// The process's `RegisterRequest.instance_id`: a restart is a new process.
    instance: u64,
    /// Misconfigured: registers with a wrong token, and is restarted in a loop when it
    /// exits, until its `kill_at`.
    bad: bool,
    supervisor: Supervisor,
    conn: Option<ConnId>,
    session: Option<NodeSession>,
    frozen_until: Timestamp,
    restart_at: Option<Timestamp>,
    kill_at: Option<Timestamp>,
    dial_at: Option<Timestamp>,
    mode: Mode,
    work: BTreeMap<String, Work>,
    /// Stopping gracefully: restart this long after the process exits.
    stopping: Option<Duration>,
    /// The process started beside this stopping one, which takes its slot once it exits.
    replacement: Option<usize>,
    /// Ended and replaced: never restarted.
    retired: bool,
}

impl NodeProc {
    /// A node process that starts now; `seed` drives its reconnect jitter (the node
    /// shell's default spread, so the simulated fleet redials as a real one does).
    fn new(node_id: String, now: Timestamp, impostor: bool, seed: u64) -> Self {
        let policy = ReconnectPolicy::from_config(Some(0), Some(0.1)).unwrap_or_default();
        let mut supervisor = Supervisor::with_jitter(policy, 0.5, seed);
        let _ = supervisor.handle_start(now);
        NodeProc {
            node_id,
            alive: true,
            impostor,
            instance: seed.max(1),
            bad: false,
            supervisor,
            conn: None,
            session: None,
            frozen_until: Timestamp::ZERO,
            restart_at: None,
            kill_at: None,
            dial_at: None,
            mode: Mode::Normal,
            work: BTreeMap::new(),
            stopping: None,
            replacement: None,
            retired: false,
        }
    }

    fn runnable(&self, now: Timestamp) -> bool {
        self.alive && self.frozen_until <= now
    }
}

#[derive(Debug)]
struct Link {
    node: usize,
    to_node: Wire,
    to_edge: Wire,
    held_until: Timestamp,
    /// The Edge closed its side: the node sees EOF once `to_node` drains.
    edge_closed: bool,
    /// The node side closed: the Edge sees EOF once `to_edge` drains.
    node_closed: bool,
    /// The Edge has been told the connection closed.
    edge_done: bool,
}

#[derive(Debug)]
enum Checker {
    Run(RunTracker),
    Tunnel(TunnelOrder),
}

/// Where a tunnel's frames are as its caller receives them: the status first, then
/// bodies, headers and usage, then exactly one end or error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TunnelOrder {
    Head,
    Body,
    Done,
}

impl TunnelOrder {
    fn observe(&mut self, part: &TunnelPart) -> Result<(), String> {
        let kind = match part {
            TunnelPart::Body(_) => TunnelFrameKind::Body,
            TunnelPart::Frame(frame) => {
                TunnelFrameKind::try_from(frame.kind).map_err(|_| "unknown frame kind")?
            }
        };
        *self = match (*self, kind) {
            (TunnelOrder::Head, TunnelFrameKind::Status) => TunnelOrder::Body,
            (TunnelOrder::Head, TunnelFrameKind::Error) => TunnelOrder::Done,
            (
                TunnelOrder::Body,
                TunnelFrameKind::Body | TunnelFrameKind::Headers | TunnelFrameKind::Usage,
            ) => TunnelOrder::Body,
            (TunnelOrder::Body, TunnelFrameKind::End | TunnelFrameKind::Error) => TunnelOrder::Done,
            (state, kind) => return Err(format!("{kind:?} in state {state:?}")),
        };
        Ok(())
    }
}

#[derive(Debug)]
struct Client {
    deadline: Timestamp,
    ended: bool,
    checker: Option<Checker>,
    tunnel_only: bool,
    /// Dispatches of the request seen on the wire.
    dispatches: u32,
    /// Of those, the ones a node refused before asking its provider (seen as the Edge
    /// reads them).
    refusals: u32,
    /// Its last refusal: by which node's adapter, when, and at which step of the world
    /// (to tell what its node said after it).
    refused: Option<(Arc<str>, String, Timestamp, u64)>,
    /// Its answer began: a provider was named, bytes may follow.
    answered: bool,
    /// Bytes of its answer reached it.
    got_bytes: bool,
}

struct World {
    now: Timestamp,
    rng: Rng,
    edge: EdgeCore,
    rev: u32,
    procs: Vec<NodeProc>,
    links: BTreeMap<u64, Link>,
    next_conn: u64,
    clients: BTreeMap<RequestId, Client>,
    client_timers: BTreeSet<(Timestamp, RequestId)>,
    trace: VecDeque<String>,
    full_trace: bool,
    stats: Stats,
    failure: Option<String>,
    /// Connections whose `NodeDrainRequest` the Edge has read: nothing more is dispatched
    /// to them.
    drain_read: BTreeSet<u64>,
    /// Bugs planted in the simulated shell.
    faults: Faults,
    /// Each request's last dispatch as written (for the planted redispatch).
    last_dispatch: BTreeMap<RequestId, (ConnId, Envelope)>,
    /// Where each run was dispatched: its node and adapter.
    dispatched_to: HashMap<String, (Arc<str>, String)>,
    /// Envelopes the Edge has read, counted: a step of the world.
    read_count: u64,
    /// By node and adapter: the step at which the Edge last read that the node freed a
    /// unit there (a run's terminal, a load report, a ready).
    freed_at: HashMap<(Arc<str>, String), u64>,
    /// By node: the step at which the Edge last read its load report or its ready.
    node_freed_at: HashMap<Arc<str>, u64>,
}

macro_rules! check {
    ($world:expr, $cond:expr, $($msg:tt)*) => {
        if !$cond && $world.failure.is_none() {
            $world.failure = Some(format!($($msg)*));
        }
    };
}

impl World {
    fn log(&mut self, line: impl FnOnce() -> String) {
        let text = format!("{} {}", self.now, line());
        self.trace.push_back(text);
        if !self.full_trace && self.trace.len() > 400 {
            self.trace.pop_front();
        }
    }

    fn latency(&mut self) -> Duration {
        // Mostly fast, sometimes slow: a long tail like a real network.
        let ms = if self.rng.chance(5) {
            self.rng.range(20, 120)
        } else {
            self.rng.range(1, 8)
        };
        Duration::from_millis(ms)
    }

    // ----- the Edge side -----

    fn drain_edge(&mut self) {
        loop {
            let mut progressed = false;
            let mut closes = Vec::new();
            while let Some(transmit) = self.edge.poll_transmit() {
                progressed = true;
                match transmit {
                    Transmit::Frame { conn, envelope } => self.shell_writes(conn, envelope),
                    Transmit::FrameLimit {
                        conn,
                        max_frame_len,
                    } => {
                        if let Some(link) = self.links.get_mut(&conn.0) {
                            link.to_edge.set_max_frame_len(max_frame_len);
                        }
                    }
                    Transmit::Close { conn, reason } => {
                        self.log(|| format!("edge closes conn {} ({reason:?})", conn.0));
                        if reason == CloseReason::Drained {
                            self.stats.drained += 1;
                        }
                        if let Some(link) = self.links.get_mut(&conn.0) {
                            link.edge_closed = true;
                        }
                        closes.push((conn, reason));
                    }
                }
            }
            while let Some(event) = self.edge.poll_event() {
                progressed = true;
                self.on_edge_event(event);
            }
            while let Some(lifecycle) = self.edge.poll_lifecycle() {
                progressed = true;
                self.log(|| format!("lifecycle {}", lifecycle.kind()));
            }
            // The shell stops reading a connection it closed and reports it closed.
            for (conn, reason) in closes {
                self.edge_closed(conn, &reason);
            }
            if !progressed {
                return;
            }
        }
    }

    /// The simulated Edge shell writes a frame of the machine's on `conn`: a dispatch is
    /// checked as it leaves (only to its node's ready owner, within capacity, a
    /// tunnel-only request only as a tunnel, nothing after a drain request). The planted
    /// shell bugs act here.
    fn shell_writes(&mut self, conn: ConnId, mut envelope: Envelope) {
        if self.faults.tunnel_as_run
            && let Some(Body::ProviderTunnelRequest(tunnel)) = &envelope.body
        {
            envelope.body = Some(Body::RunRequest(RunRequest {
                run_id: tunnel.run_id.clone(),
                adapter: tunnel.adapter.clone(),
                target: tunnel.target.clone(),
                ..RunRequest::default()
            }));
        }
        let work = match &envelope.body {
            Some(Body::RunRequest(run)) => Some((run.run_id.clone(), run.adapter.clone(), true)),
            Some(Body::ProviderTunnelRequest(t)) => {
                Some((t.run_id.clone(), t.adapter.clone(), false))
            }
            _ => None,
        };
        if let Some((run_id, adapter, as_run)) = &work {
            self.check_dispatch(conn, run_id, adapter, *as_run);
            if self.faults.redispatch_after_first_byte
                && let Some(run) = RunId::parse(run_id)
            {
                self.last_dispatch
                    .insert(run.request, (conn, envelope.clone()));
            }
        }
        self.send_to_node(conn, &envelope);
        if work.is_some() && self.faults.dispatch_to_pending {
            // A copy to every connection that registered but is not ready yet.
            let pending: Vec<ConnId> = self
                .links
                .keys()
                .map(|&c| ConnId(c))
                .filter(|&c| c != conn && self.edge.owner_of(c).is_some_and(|o| !o.2))
                .collect();
            for other in pending {
                if let Some((run_id, adapter, as_run)) = &work {
                    self.check_dispatch(other, run_id, adapter, *as_run);
                }
                self.send_to_node(other, &envelope);
            }
        }
    }

    /// Bytes of `request`'s answer reached its caller.
    fn first_bytes(&mut self, request: RequestId) {
        let Some(client) = self.clients.get_mut(&request) else {
            return;
        };
        if std::mem::replace(&mut client.got_bytes, true) {
            return;
        }
        // The planted bug: the same request dispatched again, as a new attempt.
        if let Some((conn, mut envelope)) = self.last_dispatch.remove(&request) {
            let again = RunId {
                request,
                attempt: 9,
            }
            .wire();
            match &mut envelope.body {
                Some(Body::RunRequest(run)) => run.run_id = again,
                Some(Body::ProviderTunnelRequest(tunnel)) => tunnel.run_id = again,
                _ => {}
            }
            self.shell_writes(conn, envelope);
        }
    }

    /// A dispatch leaving on `conn`.
    fn check_dispatch(&mut self, conn: ConnId, run_id: &str, adapter: &str, as_run: bool) {
        check!(
            self,
            !self.drain_read.contains(&conn.0),
            "work dispatched to conn {} after the edge read its drain request",
            conn.0
        );
        let owner = self.edge.owner_of(conn);
        check!(
            self,
            owner.as_ref().is_some_and(|o| o.2),
            "{run_id} dispatched on conn {} which is not its node's ready owner ({owner:?})",
            conn.0
        );
        if let Some((node_id, ..)) = &owner
            && let Some(r) = self.edge.resource(node_id, adapter)
        {
            let usage = self.edge.ledger().usage(r);
            check!(
                self,
                usage.in_flight <= usage.capacity,
                "{run_id} dispatched beyond capacity on {node_id}/{adapter}"
            );
        }
        let tunnel_only = RunId::parse(run_id)
            .and_then(|run| self.clients.get(&run.request))
            .is_some_and(|c| c.tunnel_only);
        check!(
            self,
            !(as_run && tunnel_only),
            "tunnel-only {run_id} dispatched as a run on {adapter}"
        );
        // The rule that bounds a request's dispatches (`EdgeCore::verdict`, README's
        // "Retries"), word for word: "A dispatch is an attempt unless its node refused it
        // before asking its provider. A request has at most `max_attempts` attempts, and
        // at most 8 refusals its Edge's ledger did not explain. After a refusal the
        // ledger counts that provider full until its node reports its load or one
        // heartbeat interval passes, so the request is not dispatched there again before
        // that." A single Edge's ledger explains a refusal only by what the node
        // reported held elsewhere; the check takes any unit the node freed there (a
        // run's end, a load report, a ready) as leave to go back, and 8 refusals in all.
        let max_attempts = self.edge.config().routing.max_attempts;
        let hold = self.edge.config().timing.heartbeat_interval;
        let Some(run) = RunId::parse(run_id) else {
            return;
        };
        let node_id = owner.map_or_else(|| Arc::from(""), |o| o.0);
        self.dispatched_to
            .insert(run_id.to_owned(), (node_id.clone(), adapter.to_owned()));
        let Some(client) = self.clients.get_mut(&run.request) else {
            return;
        };
        client.dispatches += 1;
        let (dispatches, refusals, got_bytes) =
            (client.dispatches, client.refusals, client.got_bytes);
        let back_too_soon = client.refused.as_ref().is_some_and(|(n, a, at, step)| {
            *n == node_id
                && a == adapter
                && self.now < *at + hold
                && self
                    .freed_at
                    .get(&(node_id.clone(), adapter.to_owned()))
                    .max(self.node_freed_at.get(&node_id))
                    .is_none_or(|freed| freed <= step)
        });
        check!(
            self,
            !got_bytes,
            "{run_id} dispatched after its request's first byte reached the caller"
        );
        check!(
            self,
            dispatches - refusals <= max_attempts,
            "{run_id}: {} attempts ({dispatches} dispatches, {refusals} refused), more than \
             {max_attempts}",
            dispatches - refusals
        );
        check!(
            self,
            refusals < 8,
            "{run_id}: dispatched after {refusals} refusals"
        );
        check!(
            self,
            !back_too_soon,
            "{run_id} dispatched to {node_id}/{adapter}, which refused its request, before \
             the node freed a unit there or the hold passed"
        );
    }

    /// The Edge is about to read `envelope` from `conn`: a refusal is counted against its
    /// request, and a unit the node frees is noted by adapter.
    fn note_read(&mut self, conn: ConnId, envelope: &Envelope) {
        self.read_count += 1;
        let step = self.read_count;
        let Some((node_id, _, _)) = self.edge.owner_of(conn) else {
            return;
        };
        let (run_id, terminal, refused) = match &envelope.body {
            Some(Body::RunEvent(e)) => (
                &e.run_id,
                terminal_event(e),
                e.error.as_ref().is_some_and(|e| e.code == "refused"),
            ),
            Some(Body::ProviderTunnelFrame(f)) => (
                &f.run_id,
                terminal_frame(f),
                f.error.as_ref().is_some_and(|e| e.code == "refused"),
            ),
            Some(Body::NodeLoadReport(_) | Body::NodeReadyRequest(_)) => {
                self.node_freed_at.insert(node_id, step);
                return;
            }
            _ => return,
        };
        let Some(to) = self.dispatched_to.get(run_id).cloned() else {
            return;
        };
        if terminal && !refused {
            self.freed_at.insert(to.clone(), step);
        }
        if refused
            && let Some(client) =
                RunId::parse(run_id).and_then(|r| self.clients.get_mut(&r.request))
        {
            client.refusals += 1;
            client.refused = Some((to.0, to.1, self.now, step));
            self.stats.work_refused += 1;
        }
    }

    /// Tells the Edge a connection is closed, checking that a connection that no longer
    /// owns its node changes nothing and emits nothing.
    fn edge_closed(&mut self, conn: ConnId, reason: &CloseReason) {
        // What is due before the close happens first, as a shell runs its timers and
        // drains every output before its next input (a conflict's hold ending at this
        // instant, or the dispatch of a grant a fence freed): what the check below sees
        // is then the close's own doing.
        if !self.faults.skip_timers {
            self.edge.handle_timeout(self.now);
        }
        self.drain_edge();
        let Some(link) = self.links.get_mut(&conn.0) else {
            return;
        };
        if link.edge_done {
            return;
        }
        link.edge_done = true;
        let owner = self.edge.owner_of(conn);
        // `last_seen` is an age: it moves with the clock, not with the state.
        let live = |edge: &EdgeCore| {
            let mut nodes = edge.nodes();
            nodes.iter_mut().for_each(|n| n.last_seen = None);
            nodes
        };
        let before = live(&self.edge);
        if self.edge.handle_connection_closed(self.now, conn).is_err() {
            return;
        }
        if owner.is_none() {
            let after = live(&self.edge);
            let quiet = self.edge.poll_event().is_none()
                && self.edge.poll_transmit().is_none()
                && self.edge.poll_lifecycle().is_none();
            check!(
                self,
                before == after && quiet,
                "closing stale conn {} ({reason:?}) changed live state",
                conn.0
            );
        }
        self.drain_edge();
    }

    fn send_to_node(&mut self, conn: ConnId, envelope: &Envelope) {
        let latency = self.latency();
        let now = self.now;
        let Some(link) = self.links.get_mut(&conn.0) else {
            return;
        };
        if link.edge_closed {
            return;
        }
        if link.to_node.send(envelope, now + latency) {
            self.stats.frames += 1;
        }
    }

    fn on_edge_event(&mut self, event: EdgeEvent) {
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
            } => {
                let answered = self.clients.get(&request).is_some_and(|c| c.answered);
                check!(self, !answered, "{request} answered by two providers");
                if let Some(client) = self.clients.get_mut(&request) {
                    client.answered = true;
                    client.checker = Some(match shape {
                        DispatchShape::Run => Checker::Run(RunTracker::new()),
                        DispatchShape::Tunnel => Checker::Tunnel(TunnelOrder::Head),
                    });
                }
                self.log(|| format!("{request} dispatched to {node_id}/{provider_id} ({shape:?})"));
            }
            EdgeEvent::Request {
                request,
                event: RequestEvent::Run(event),
            } => {
                self.first_bytes(request);
                let ok = match self
                    .clients
                    .get_mut(&request)
                    .and_then(|c| c.checker.as_mut())
                {
                    Some(Checker::Run(tracker)) => {
                        tracker.observe(&event).map_err(|e| e.to_string())
                    }
                    _ => Err("run event for a request that is not a dispatched run".into()),
                };
                check!(
                    self,
                    ok.is_ok(),
                    "{request}: invalid run sequence reached the caller: {ok:?}"
                );
            }
            EdgeEvent::Request {
                request,
                event: RequestEvent::Tunnel(part),
            } => {
                self.first_bytes(request);
                let ok = match self
                    .clients
                    .get_mut(&request)
                    .and_then(|c| c.checker.as_mut())
                {
                    Some(Checker::Tunnel(order)) => order.observe(&part),
                    _ => Err("tunnel frame for a request that is not a dispatched tunnel".into()),
                };
                check!(
                    self,
                    ok.is_ok(),
                    "{request}: invalid tunnel sequence reached the caller: {ok:?}"
                );
            }
            EdgeEvent::Request {
                request,
                event: RequestEvent::Ended(outcome),
            } => {
                self.log(|| format!("{request} ended: {outcome:?}"));
                match outcome {
                    Outcome::Completed => self.stats.completed += 1,
                    Outcome::Failed(RequestError::Unsupported { .. }) => {
                        self.stats.unsupported += 1
                    }
                    _ => {}
                }
                match self.clients.get_mut(&request) {
                    Some(client) => {
                        check!(self, !client.ended, "{request} ended twice");
                        client.ended = true;
                    }
                    None => check!(self, false, "{request} ended but was never accepted"),
                }
            }
            EdgeEvent::NodeConnected {
                node_id,
                generation,
            } => {
                self.log(|| format!("node {node_id} ready (generation {})", generation.0));
            }
            EdgeEvent::NodeDisconnected {
                node_id,
                generation,
                reason,
                lost,
            } => {
                self.log(|| {
                    format!(
                        "node {node_id} generation {} fenced ({reason:?}), {} lost",
                        generation.0,
                        lost.len()
                    )
                });
            }
            EdgeEvent::Retried {
                request, run, why, ..
            } => {
                self.stats.retries += 1;
                self.log(|| format!("{request}: {run} given up ({why}), tried elsewhere"));
            }
            EdgeEvent::ProviderEjected {
                node_id,
                provider_id,
                reason,
                time,
            } => {
                self.stats.ejections += 1;
                self.log(|| {
                    format!(
                        "{node_id}/{provider_id} ejected for {}ms ({reason:?})",
                        time.as_millis()
                    )
                });
            }
            EdgeEvent::ProviderRestored {
                node_id,
                provider_id,
                ..
            } => {
                self.stats.restored += 1;
                self.log(|| format!("{node_id}/{provider_id} restored"));
            }
            EdgeEvent::NodeConflict { node_id, .. } => {
                self.stats.conflicts += 1;
                check!(
                    self,
                    self.procs
                        .iter()
                        .any(|p| p.impostor && *p.node_id == *node_id),
                    "node {node_id} in conflict without an impostor"
                );
                self.log(|| format!("node {node_id} in conflict"));
            }
            EdgeEvent::RegisterRejected {
                conn,
                reason,
                ref node_id,
                throttled,
                ..
            } if !matches!(reason, RejectReason::Draining | RejectReason::Conflict) => {
                let bad = self
                    .links
                    .get(&conn.0)
                    .is_some_and(|l| self.procs[l.node].bad);
                check!(
                    self,
                    bad,
                    "a registration with the right token as {node_id} was refused: {reason:?}"
                );
                self.stats.bad_refused += 1;
                self.stats.bad_throttled += u64::from(throttled.is_some());
                self.log(|| format!("{node_id}: bad sibling refused ({reason:?}, {throttled:?})"));
            }
            EdgeEvent::RegisterRejected {
                reason: RejectReason::Draining,
                ref node_id,
                ..
            } => {
                self.stats.held_off += 1;
                self.log(|| format!("{node_id}: registration held off while it drains"));
            }
            other => self.log(|| format!("edge event {other:?}")),
        }
    }

    // ----- the node side -----

    fn drain_node(&mut self, i: usize) {
        loop {
            let mut progressed = false;
            let conn = self.procs[i].conn;
            let mut transmits = Vec::new();
            let mut events = Vec::new();
            if let Some(session) = self.procs[i].session.as_mut() {
                while let Some(transmit) = session.poll_transmit() {
                    transmits.push(transmit);
                }
                while let Some(event) = session.poll_event() {
                    events.push(event);
                }
            }
            for transmit in transmits {
                progressed = true;
                match transmit {
                    NodeTransmit::Frame(envelope) => {
                        if let Some(conn) = conn {
                            self.send_to_edge(conn, &envelope);
                        }
                    }
                    NodeTransmit::Close { end, abandoned } => {
                        self.session_closed(i, end, &abandoned)
                    }
                }
            }
            for event in events {
                progressed = true;
                self.on_session_event(i, event);
            }
            while let Some(event) = self.procs[i].supervisor.poll_event() {
                progressed = true;
                match event {
                    SupervisorEvent::Dial { attempt } => {
                        let at = self.now + self.latency();
                        let id = self.procs[i].node_id.clone();
                        self.log(|| format!("{id} (proc {i}) dials, attempt {attempt}"));
                        self.procs[i].dial_at = Some(at);
                    }
                    SupervisorEvent::Exit(reason) if self.procs[i].bad => {
                        // Its loop starts it again soon, as systemd's `Restart=always`.
                        self.procs[i].alive = false;
                        if self.procs[i].kill_at.is_some() {
                            let again = self.now + Duration::from_millis(self.rng.range(100, 400));
                            self.procs[i].restart_at = Some(again);
                        }
                        let id = self.procs[i].node_id.clone();
                        self.log(|| format!("{id} (bad proc {i}) exited: {reason:?}"));
                    }
                    SupervisorEvent::Exit(reason) => {
                        let stopped = self.procs[i]
                            .stopping
                            .filter(|_| reason == ExitReason::Shutdown);
                        check!(
                            self,
                            stopped.is_some(),
                            "node process {i} exited: {reason:?}"
                        );
                        self.procs[i].alive = false;
                        if let Some(delay) = stopped {
                            let id = self.procs[i].node_id.clone();
                            self.log(|| format!("{id} (proc {i}) exited after its stop"));
                            if self.procs[i].replacement.is_some() {
                                self.retire(i);
                            } else {
                                self.procs[i].restart_at = Some(self.now + delay);
                            }
                        }
                    }
                }
            }
            if !progressed {
                return;
            }
        }
    }

    fn send_to_edge(&mut self, conn: ConnId, envelope: &Envelope) {
        let latency = self.latency();
        let now = self.now;
        let Some(link) = self.links.get_mut(&conn.0) else {
            return;
        };
        if link.node_closed {
            return;
        }
        if link.to_edge.send(envelope, now + latency) {
            self.stats.frames += 1;
        }
    }

    fn provider_delay(&mut self, mode: Mode) -> Duration {
        Duration::from_millis(match mode {
            Mode::Slow => self.rng.range(100, 400),
            _ => self.rng.range(2, 30),
        })
    }

    fn on_session_event(&mut self, i: usize, event: SessionEvent) {
        let event_text = format!("{event:?}");
        let now = self.now;
        match event {
            SessionEvent::ApplyConfig { .. } => {
                if let Some(s) = self.procs[i].session.as_mut() {
                    let _ = s.handle_config_applied(now, Ok(()));
                }
            }
            SessionEvent::Ready => {
                let _ = self.procs[i].supervisor.handle_ready(now);
            }
            SessionEvent::StartRun { request } => self.start_work(i, request.run_id, false),
            SessionEvent::StartTunnel { request } => self.start_work(i, request.run_id, true),
            SessionEvent::CancelRun { run_id } => {
                let at = if self.procs[i].mode == Mode::Stubborn {
                    now + Duration::from_secs(1)
                } else {
                    now + self.provider_delay(Mode::Normal)
                };
                if let Some(work) = self.procs[i].work.get_mut(&run_id) {
                    work.cancelled = true;
                    work.next_at = work.next_at.min(at);
                }
            }
            SessionEvent::Command { request } => {
                if let Some(s) = self.procs[i].session.as_mut() {
                    let _ = s.handle_command_response(
                        now,
                        NodeCommandResponse {
                            request_id: request.request_id,
                            ok: true,
                            ..NodeCommandResponse::default()
                        },
                    );
                }
            }
            SessionEvent::RefreshConfig { request_id, .. } => {
                if let Some(s) = self.procs[i].session.as_mut() {
                    let _ = s.handle_refresh_applied(now, &request_id, Ok(()));
                }
            }
            SessionEvent::CancelRejected { .. }
            | SessionEvent::Rehome { .. }
            | SessionEvent::Members(_)
            | SessionEvent::WorkRefused { .. }
            | SessionEvent::PeerViolation { .. } => {
                self.log(|| format!("node {i} event {event_text}"));
            }
        }
    }

    /// The node's session ended: its connection closes and the supervisor decides.
    fn session_closed(&mut self, i: usize, end: SessionEnd, abandoned: &[String]) {
        let now = self.now;
        let id = self.procs[i].node_id.clone();
        self.log(|| {
            format!(
                "{id} (proc {i}) session closed: {end:?}, {} abandoned",
                abandoned.len()
            )
        });
        let refused = match &end {
            SessionEnd::Rejected(reason) | SessionEnd::Deferred { reason, .. } => {
                reason.starts_with(iop_proto_core::edge::AUTH_FAILED)
                    || reason.starts_with(iop_proto_core::edge::TOO_MANY_FAILURES)
            }
            _ => false,
        };
        if self.procs[i].bad {
            check!(
                self,
                refused || !matches!(end, SessionEnd::Rejected(_) | SessionEnd::Deferred { .. }),
                "a bad sibling was told {end:?}"
            );
        } else {
            check!(
                self,
                !refused,
                "{id} (proc {i}), whose token is right, was told {end:?}"
            );
        }
        self.procs[i].work.clear();
        self.procs[i].session = None;
        if let Some(conn) = self.procs[i].conn.take()
            && let Some(link) = self.links.get_mut(&conn.0)
        {
            link.node_closed = true;
            link.to_node.clear();
        }
        // A process that was asked to stop exits whatever ended its session: the
        // supervisor's decision since `handle_stop`.
        let _ = match end.failure() {
            Some(failure) => self.procs[i].supervisor.handle_failure(now, failure),
            None => {
                self.procs[i].supervisor.handle_shutdown(now);
                Ok(())
            }
        };
    }

    fn start_work(&mut self, i: usize, run_id: String, tunnel: bool) {
        let mode = self.procs[i].mode;
        let delay = self.provider_delay(mode);
        let total = u32::try_from(self.rng.range(1, 6)).unwrap_or(1);
        let next_at = if mode == Mode::Hang {
            Timestamp::MAX
        } else {
            self.now + delay
        };
        self.procs[i].work.insert(
            run_id,
            Work {
                tunnel,
                next_at,
                step: 0,
                total,
                cancelled: false,
                fail: mode == Mode::Fail,
            },
        );
    }

    /// Advances one piece of provider work by one output.
    fn progress_work(&mut self, i: usize, run_id: &str) {
        let now = self.now;
        let mode = self.procs[i].mode;
        let delay = self.provider_delay(mode);
        let Some(work) = self.procs[i].work.get_mut(run_id) else {
            return;
        };
        let (tunnel, step, total, cancelled, fail) = (
            work.tunnel,
            work.step,
            work.total,
            work.cancelled,
            work.fail,
        );
        work.step += 1;
        work.next_at = now + delay;
        // A silent provider goes quiet after its first delta, until cancelled.
        if mode == Mode::Silent && step >= 1 && !cancelled {
            work.next_at = Timestamp::MAX;
            if step > 1 {
                return;
            }
        }
        let refuse = mode == Mode::Refuse && !cancelled;
        let unavailable = mode == Mode::Unavailable && !cancelled;
        // A run starts before it ends, even a cancelled one (a node session keeps its
        // capacity slot until the run's terminal).
        let last = cancelled && (tunnel || step >= 1)
            || fail && step >= 1
            || step > total
            || refuse && (tunnel || step >= 1)
            || unavailable && step >= if tunnel { 2 } else { 1 };
        let Some(session) = self.procs[i].session.as_mut() else {
            return;
        };
        let unreachable = || ErrorDetail {
            code: "upstream_unreachable".into(),
            message: "connection refused".into(),
            retryable: true,
        };
        let _ = if tunnel {
            let output = if refuse {
                TunnelOutput::Error(unreachable())
            } else if unavailable {
                match step {
                    0 => TunnelOutput::Status {
                        status: 503,
                        headers: vec![wire::Header {
                            name: "retry-after".into(),
                            value: Bytes::from_static(b"1"),
                        }],
                    },
                    1 => TunnelOutput::Body(Bytes::from_static(b"{\"error\":\"busy\"}")),
                    _ => TunnelOutput::End,
                }
            } else if step == 0 && !cancelled {
                TunnelOutput::Status {
                    status: 200,
                    headers: Vec::new(),
                }
            } else if cancelled {
                TunnelOutput::Error(ErrorDetail {
                    code: "cancelled".into(),
                    ..ErrorDetail::default()
                })
            } else if fail {
                TunnelOutput::Error(ErrorDetail {
                    code: "upstream_error".into(),
                    ..ErrorDetail::default()
                })
            } else if step > total {
                TunnelOutput::End
            } else if step == total {
                TunnelOutput::Usage(Usage::default())
            } else {
                TunnelOutput::Body(Bytes::from_static(b"data: x\n\n"))
            };
            session.handle_tunnel_output(now, run_id, output)
        } else {
            let output = if step == 0 {
                RunOutput::Start
            } else if refuse {
                RunOutput::Error(unreachable())
            } else if unavailable {
                RunOutput::Error(ErrorDetail {
                    code: "upstream_status_503".into(),
                    message: "the provider answered 503".into(),
                    retryable: true,
                })
            } else if cancelled {
                RunOutput::Cancelled
            } else if fail {
                RunOutput::Error(ErrorDetail {
                    code: "upstream_error".into(),
                    ..ErrorDetail::default()
                })
            } else if step > total {
                RunOutput::Complete {
                    usage: None,
                    metadata: BTreeMap::new(),
                }
            } else {
                RunOutput::Delta("x".into())
            };
            session.handle_run_output(now, run_id, output)
        };
        if last {
            // The adapter's task returns, as the node shell's does: work it left without
            // a terminal (a provider that stopped mid-answer) ends here.
            self.procs[i].work.remove(run_id);
            if let Some(session) = self.procs[i].session.as_mut() {
                let _ = session.handle_work_returned(now, run_id);
            }
        }
    }

    /// A process that ended while its restart already runs beside it: the restart takes
    /// its slot (and its links follow), the ended one stays dead in the other.
    fn retire(&mut self, i: usize) {
        let Some(j) = self.procs[i].replacement.take() else {
            return;
        };
        self.procs[i].restart_at = None;
        self.procs[i].retired = true;
        self.procs.swap(i, j);
        for link in self.links.values_mut() {
            if link.node == i {
                link.node = j;
            } else if link.node == j {
                link.node = i;
            }
        }
        let id = self.procs[i].node_id.clone();
        self.log(|| format!("{id}: proc {j} takes over slot {i}"));
    }

    fn crash(&mut self, i: usize) {
        let id = self.procs[i].node_id.clone();
        self.log(|| format!("{id} (proc {i}) crashes"));
        let p = &mut self.procs[i];
        p.alive = false;
        p.session = None;
        p.work.clear();
        p.dial_at = None;
        if let Some(conn) = p.conn.take()
            && let Some(link) = self.links.get_mut(&conn.0)
        {
            link.node_closed = true;
            link.to_node.clear();
        }
    }

    // ----- the scheduler -----

    fn next_due(&self) -> Timestamp {
        let mut next = Timestamp::MAX;
        if let Some(t) = self.edge.poll_timeout().map(|w| w.at)
            && !self.faults.skip_timers
        {
            next = next.min(t);
        }
        for link in self.links.values() {
            let node_runnable =
                self.procs[link.node].runnable(self.now) || !self.procs[link.node].alive;
            if !link.edge_done {
                if let Some(at) = link.to_edge.next_arrival() {
                    next = next.min(at.max(link.held_until));
                } else if link.node_closed {
                    next = next.min(self.now.max(link.held_until));
                }
            }
            if node_runnable && !link.node_closed {
                if let Some(at) = link.to_node.next_arrival() {
                    next = next.min(at.max(link.held_until));
                } else if link.edge_closed {
                    next = next.min(self.now.max(link.held_until));
                }
            }
        }
        for p in &self.procs {
            if let Some(t) = p.restart_at {
                next = next.min(t);
            }
            if let Some(t) = p.kill_at {
                next = next.min(t);
            }
            if !p.alive {
                continue;
            }
            if p.frozen_until > self.now {
                next = next.min(p.frozen_until);
                continue;
            }
            if let Some(t) = p.dial_at {
                next = next.min(t);
            }
            if let Some(t) = p.supervisor.poll_timeout().map(|w| w.at) {
                next = next.min(t);
            }
            if let Some(t) = p
                .session
                .as_ref()
                .and_then(NodeSession::poll_timeout)
                .map(|w| w.at)
            {
                next = next.min(t);
            }
            for w in p.work.values() {
                next = next.min(w.next_at);
            }
        }
        if let Some(&(t, _)) = self.client_timers.first() {
            next = next.min(t);
        }
        next
    }

    /// Processes everything due at `self.now`.
    fn step(&mut self) {
        self.stats.steps += 1;
        let now = self.now;
        if self.edge.poll_timeout().is_some_and(|w| w.at <= now) {
            if !self.faults.skip_timers {
                self.edge.handle_timeout(now);
            }
            self.drain_edge();
        }
        // Links, in connection order: deliveries to the Edge, then to the node.
        let conns: Vec<u64> = self.links.keys().copied().collect();
        for c in conns {
            self.deliver(ConnId(c));
        }
        // Node processes.
        for i in 0..self.procs.len() {
            self.step_node(i);
        }
        // Clients giving up or leaving.
        while let Some(&(t, request)) = self.client_timers.first() {
            if t > now {
                break;
            }
            self.client_timers.pop_first();
            if self.clients.get(&request).is_some_and(|c| !c.ended) {
                self.log(|| format!("client gives up on {request}"));
                let cancelled = self.edge.handle_cancel(now, request, "client gave up");
                check!(
                    self,
                    cancelled == iop_proto_core::edge::Cancelled::Now,
                    "cancel of open {request} found it ended: {cancelled:?}"
                );
                self.drain_edge();
            }
        }
        self.check_invariants();
    }

    fn deliver(&mut self, conn: ConnId) {
        let now = self.now;
        // To the Edge.
        loop {
            let Some(link) = self.links.get_mut(&conn.0) else {
                return;
            };
            if link.held_until > now || link.edge_done {
                break;
            }
            match link.to_edge.receive_one(now) {
                Some(decoded) => {
                    check!(
                        self,
                        decoded.is_ok(),
                        "the codec failed on frames it encoded: {decoded:?}"
                    );
                    let envelopes = decoded.unwrap_or_default();
                    for envelope in envelopes {
                        let kind = envelope.kind();
                        self.log(|| format!("conn {} node->edge {kind}", conn.0));
                        let about_a_run = match &envelope.body {
                            Some(Body::RunEvent(e)) => Some((e.run_id.clone(), terminal_event(e))),
                            Some(Body::ProviderTunnelFrame(f)) => {
                                Some((f.run_id.clone(), terminal_frame(f)))
                            }
                            _ => None,
                        };
                        let drain = matches!(envelope.body, Some(Body::NodeDrainRequest(_)));
                        if drain {
                            self.drain_read.insert(conn.0);
                        }
                        let ready_before = self.edge.owner_of(conn).is_some_and(|o| o.2);
                        // The planted shell bugs: a frame read and never handed over.
                        let run = about_a_run.as_ref().and_then(|(id, _)| RunId::parse(id));
                        let caller_left = run
                            .and_then(|r| self.clients.get(&r.request))
                            .is_some_and(|c| c.ended);
                        let terminal = about_a_run.as_ref().is_some_and(|(_, t)| *t);
                        let swallowed = (drain && self.faults.swallow_drain)
                            || (terminal && !caller_left && self.faults.swallow_terminal)
                            || (terminal && caller_left && self.faults.swallow_cancelled_terminal);
                        let unknown_kind =
                            wire::Validate::validate(&envelope).is_err() && about_a_run.is_some();
                        if unknown_kind && self.faults.close_on_unknown_kind {
                            self.log(|| {
                                format!("shell closes conn {} for an unknown kind", conn.0)
                            });
                            if let Some(link) = self.links.get_mut(&conn.0) {
                                link.edge_closed = true;
                            }
                            self.edge_closed(conn, &CloseReason::PeerClosed);
                        } else if !swallowed {
                            self.note_read(conn, &envelope);
                            let _ = self.edge.handle_envelope(now, conn, envelope);
                        }
                        self.drain_edge();
                        if let Some((run_id, terminal)) = about_a_run {
                            // (Unless its terminal ended a drain: the Edge then closes.)
                            check!(
                                self,
                                !ready_before
                                    || self.edge.owner_of(conn).is_some()
                                    || terminal && self.drain_read.contains(&conn.0),
                                "a message about {run_id} closed its node's connection"
                            );
                            check!(
                                self,
                                !terminal
                                    || RunId::parse(&run_id).is_none_or(|r| self
                                        .edge
                                        .ledger()
                                        .lease_of(r)
                                        .is_none()),
                                "{run_id} still holds its lease after its terminal"
                            );
                        }
                    }
                }
                None if link.node_closed && link.to_edge.is_empty() => {
                    self.log(|| format!("edge sees conn {} closed", conn.0));
                    self.edge_closed(conn, &CloseReason::PeerClosed);
                    break;
                }
                _ => break,
            }
        }
        // To the node.
        loop {
            let Some(link) = self.links.get_mut(&conn.0) else {
                return;
            };
            let i = link.node;
            if link.held_until > now || link.node_closed || !self.procs[i].runnable(now) {
                break;
            }
            match link.to_node.receive_one(now) {
                Some(decoded) => {
                    let envelopes = decoded.unwrap_or_default();
                    for envelope in envelopes {
                        let kind = envelope.kind();
                        self.log(|| format!("conn {} edge->node {kind}", conn.0));
                        if self.procs[i].conn == Some(conn)
                            && let Some(s) = self.procs[i].session.as_mut()
                        {
                            let taken = s.handle_envelope(now, envelope);
                            check!(
                                self,
                                taken.is_ok(),
                                "a live session refused an envelope: {taken:?}"
                            );
                        }
                        self.drain_node(i);
                    }
                }
                None if link.edge_closed && link.to_node.is_empty() => {
                    self.log(|| format!("node sees conn {} closed", conn.0));
                    if self.procs[i].conn == Some(conn)
                        && let Some(s) = self.procs[i].session.as_mut()
                    {
                        let lost = s.handle_connection_lost(
                            now,
                            Failure::EdgeClosed("closed by the edge".into()),
                        );
                        check!(self, lost.is_ok(), "connection lost refused: {lost:?}");
                    }
                    if let Some(link) = self.links.get_mut(&conn.0) {
                        link.node_closed = true;
                    }
                    self.drain_node(i);
                    break;
                }
                _ => break,
            }
        }
        if let Some(link) = self.links.get(&conn.0)
            && link.edge_done
            && link.node_closed
        {
            self.links.remove(&conn.0);
        }
    }

    fn step_node(&mut self, i: usize) {
        let now = self.now;
        if self.procs[i].kill_at.is_some_and(|t| t <= now) {
            self.procs[i].kill_at = None;
            self.procs[i].restart_at = None;
            if self.procs[i].alive {
                self.crash(i);
            }
        }
        if self.procs[i].restart_at.is_some_and(|t| t <= now) {
            self.procs[i].restart_at = None;
            let id = self.procs[i].node_id.clone();
            self.log(|| format!("{id} (proc {i}) restarts"));
            let seed = self.rng.next_u64();
            let (bad, kill_at) = (self.procs[i].bad, self.procs[i].kill_at);
            self.procs[i] = NodeProc::new(id, now, false, seed);
            self.procs[i].bad = bad;
            self.procs[i].kill_at = kill_at;
            self.drain_node(i);
        }
        if !self.procs[i].runnable(now) {
            return;
        }
        if self.procs[i].dial_at.is_some_and(|t| t <= now) {
            self.procs[i].dial_at = None;
            let conn = ConnId(self.next_conn);
            self.next_conn += 1;
            self.links.insert(
                conn.0,
                Link {
                    node: i,
                    to_node: Wire::new(wire::DEFAULT_MAX_FRAME_LEN),
                    // The Edge shell starts every connection at the pre-register limit.
                    to_edge: Wire::new(self.edge.config().admission.pending_frame_len),
                    held_until: Timestamp::ZERO,
                    edge_closed: false,
                    node_closed: false,
                    edge_done: false,
                },
            );
            let _ = self.edge.handle_connection_opened(
                now,
                conn,
                iop_proto_core::edge::Peer::default(),
            );
            self.drain_edge();
            let id = self.procs[i].node_id.clone();
            self.log(|| format!("{id} (proc {i}) connected on conn {}", conn.0));
            let p = &mut self.procs[i];
            let _ = p.supervisor.handle_connected(now);
            let mut config =
                SessionConfig::new(p.node_id.clone(), if p.bad { BAD_TOKEN } else { TOKEN });
            config.instance_id = p.instance;
            config.heartbeat_interval = timing().heartbeat_interval;
            config.handshake_timeout = Duration::from_millis(1000);
            config.chunk_size = 4;
            let mut session = NodeSession::new(config);
            let _ = session.handle_connected(now);
            p.session = Some(session);
            p.conn = Some(conn);
            self.drain_node(i);
        }
        if self.procs[i]
            .supervisor
            .poll_timeout()
            .is_some_and(|w| w.at <= now)
        {
            self.procs[i].supervisor.handle_timeout(now);
            self.drain_node(i);
        }
        if let Some(s) = self.procs[i].session.as_mut()
            && s.poll_timeout().is_some_and(|w| w.at <= now)
        {
            s.handle_timeout(now);
            self.drain_node(i);
        }
        let due: Vec<String> = self.procs[i]
            .work
            .iter()
            .filter(|(_, w)| w.next_at <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for run_id in due {
            self.progress_work(i, &run_id);
            self.drain_node(i);
        }
    }

    fn advance(&mut self, ms: u64) {
        let target = self.now + Duration::from_millis(ms);
        while self.failure.is_none() {
            let next = self.next_due();
            if next > target {
                self.now = target;
                return;
            }
            self.now = next.max(self.now);
            self.step();
        }
    }

    fn submit(
        &mut self,
        model: u8,
        long: bool,
        timeout_ms: u16,
        cancel_after_ms: Option<u16>,
        tunnel_only: bool,
    ) {
        let name = format!("m{}", usize::from(model) % MODELS);
        let mut submit = Submit::chat(&name, Bytes::from_static(br#"{"messages":[]}"#));
        submit.prompt_tokens = if long { 500 } else { 10 };
        if tunnel_only {
            submit.endpoint = iop_api::openai::Endpoint::Embeddings;
        }
        let result = self.edge.handle_submit(self.now, submit);
        match result {
            Ok(request) => {
                self.stats.requests += 1;
                let deadline = self.now + Duration::from_millis(u64::from(timeout_ms));
                let cancel_at =
                    cancel_after_ms.map(|ms| self.now + Duration::from_millis(u64::from(ms)));
                self.clients.insert(
                    request,
                    Client {
                        deadline,
                        ended: false,
                        checker: None,
                        tunnel_only,
                        dispatches: 0,
                        refusals: 0,
                        refused: None,
                        answered: false,
                        got_bytes: false,
                    },
                );
                self.client_timers
                    .insert((cancel_at.unwrap_or(deadline).min(deadline), request));
                self.log(|| {
                    format!(
                        "{request} submitted for {name} (long: {long}, tunnel only: {tunnel_only})"
                    )
                });
                self.drain_edge();
            }
            Err(err) => {
                self.stats.refused += 1;
                self.log(|| format!("submit for {name} refused: {err}"));
            }
        }
    }

    fn apply(&mut self, op: &Op) {
        let now = self.now;
        let node = |n: u8| usize::from(n) % NODES;
        match *op {
            Op::Advance(ms) => self.advance(u64::from(ms)),
            Op::Submit {
                model,
                long,
                timeout_ms,
                cancel_after_ms,
                tunnel_only,
            } => self.submit(model, long, timeout_ms, cancel_after_ms, tunnel_only),
            Op::Burst { model, count } => {
                for _ in 0..count {
                    self.submit(model, false, 3000, None, false);
                }
            }
            Op::Crash {
                node: n,
                restart_after_ms,
            } => {
                let i = node(n);
                if self.procs[i].alive {
                    self.crash(i);
                    if self.procs[i].replacement.is_some() {
                        self.retire(i);
                    } else {
                        self.procs[i].restart_at =
                            Some(now + Duration::from_millis(u64::from(restart_after_ms)));
                    }
                }
            }
            Op::Stop {
                node: n,
                restart_after_ms,
                overlap,
            } => {
                let i = node(n);
                if self.procs[i].runnable(now)
                    && self.procs[i].stopping.is_none()
                    && let Some(s) = self.procs[i].session.as_mut()
                {
                    let drained = s.handle_drain(now);
                    check!(self, drained.is_ok(), "drain refused: {drained:?}");
                    self.procs[i].supervisor.handle_stop(now);
                    self.procs[i].stopping =
                        Some(Duration::from_millis(u64::from(restart_after_ms)));
                    self.log(|| format!("proc {i} stops gracefully"));
                    self.drain_node(i);
                    if overlap && self.procs[i].alive {
                        let id = self.procs[i].node_id.clone();
                        let seed = self.rng.next_u64();
                        self.procs.push(NodeProc::new(id.clone(), now, false, seed));
                        let j = self.procs.len() - 1;
                        self.procs[i].replacement = Some(j);
                        self.log(|| format!("{id} restarts as proc {j} beside the draining one"));
                        self.drain_node(j);
                    }
                }
            }
            Op::Freeze { node: n, for_ms } => {
                let i = node(n);
                self.log(|| format!("proc {i} freezes for {for_ms}ms"));
                self.procs[i].frozen_until = now + Duration::from_millis(u64::from(for_ms));
            }
            Op::Partition { node: n, for_ms } => {
                let i = node(n);
                if let Some(conn) = self.procs[i].conn
                    && let Some(link) = self.links.get_mut(&conn.0)
                {
                    link.held_until = now + Duration::from_millis(u64::from(for_ms));
                    self.log(|| format!("conn {} partitioned for {for_ms}ms", conn.0));
                }
            }
            Op::Disconnect { node: n } => {
                let i = node(n);
                if let Some(conn) = self.procs[i].conn {
                    self.log(|| format!("conn {} resets", conn.0));
                    if let Some(link) = self.links.get_mut(&conn.0) {
                        link.to_node.clear();
                        link.to_edge.clear();
                        link.node_closed = true;
                        link.edge_closed = true;
                    }
                    self.edge_closed(conn, &CloseReason::PeerClosed);
                    if self.procs[i].runnable(now)
                        && let Some(s) = self.procs[i].session.as_mut()
                    {
                        let lost = s.handle_connection_lost(now, Failure::Reset);
                        check!(self, lost.is_ok(), "connection lost refused: {lost:?}");
                        self.drain_node(i);
                    }
                }
            }
            Op::Impostor { node: n, for_ms } => {
                let id = format!("n{}", node(n));
                let seed = self.rng.next_u64();
                let mut imp = NodeProc::new(id.clone(), now, true, seed);
                imp.kill_at = Some(now + Duration::from_millis(u64::from(for_ms)));
                self.procs.push(imp);
                let i = self.procs.len() - 1;
                self.log(|| format!("impostor proc {i} for {id}"));
                self.drain_node(i);
            }
            Op::BadSibling { node: n, for_ms } => {
                let id = n.map_or_else(|| UNKNOWN_ID.to_owned(), |n| format!("n{}", node(n)));
                let seed = self.rng.next_u64();
                let mut bad = NodeProc::new(id.clone(), now, false, seed);
                bad.bad = true;
                bad.kill_at = Some(now + Duration::from_millis(u64::from(for_ms)));
                self.procs.push(bad);
                let i = self.procs.len() - 1;
                self.log(|| format!("bad sibling proc {i} claims {id} with a wrong token"));
                self.drain_node(i);
            }
            Op::Refresh => {
                self.rev += 1;
                let rev = self.rev;
                self.log(|| format!("edge reloads config rev {rev}"));
                let result = self.edge.handle_config(now, world_config(rev));
                check!(
                    self,
                    result.is_ok(),
                    "a valid config was refused: {result:?}"
                );
                self.drain_edge();
            }
            Op::Garble { node: n } => {
                let i = node(n);
                let target = self.procs[i].conn.and_then(|conn| {
                    self.procs[i]
                        .work
                        .iter()
                        .find(|(_, w)| !w.cancelled)
                        .map(|(run_id, w)| (conn, run_id.clone(), w.tunnel))
                });
                if let Some((conn, run_id, tunnel)) = target {
                    self.log(|| format!("n{} sends an unknown message kind for {run_id}", node(n)));
                    let body = if tunnel {
                        Body::ProviderTunnelFrame(ProviderTunnelFrame {
                            run_id,
                            sequence: 1_000,
                            kind: 42,
                            ..ProviderTunnelFrame::default()
                        })
                    } else {
                        Body::RunEvent(RunEvent {
                            run_id,
                            sequence: 1_000,
                            r#type: 99,
                            ..RunEvent::default()
                        })
                    };
                    self.stats.garbled += 1;
                    self.send_to_edge(conn, &Envelope::new(body));
                }
            }
            Op::Provider { node: n, mode } => {
                let i = node(n);
                self.procs[i].mode = mode;
                // A hung provider wakes its pending work when it is no longer hanging.
                if mode != Mode::Hang {
                    for w in self.procs[i].work.values_mut() {
                        w.next_at = w.next_at.min(now + Duration::from_millis(5));
                    }
                }
            }
        }
    }

    fn check_invariants(&mut self) {
        if self.failure.is_some() {
            return;
        }
        let ledger = self.edge.ledger();
        let mut held = 0usize;
        let nodes = self.edge.nodes();
        let snapshots = self.edge.snapshots();
        let mut problems = Vec::new();
        for snap in &snapshots {
            let Some(r) = self.edge.resource(&snap.node_id, &snap.provider_id) else {
                continue;
            };
            let usage = ledger.usage(r);
            held += usage.in_flight as usize;
            // A draining node keeps its leases at capacity 0 (a grant there fails the
            // grant check).
            let draining = nodes
                .iter()
                .any(|n| n.draining && *n.node_id == *snap.node_id);
            if usage.in_flight > usage.capacity && usage.generation.is_some() && !draining {
                problems.push(format!(
                    "{}/{}: in_flight {} > capacity {}",
                    snap.node_id, snap.provider_id, usage.in_flight, usage.capacity
                ));
            }
            if usage.long_in_flight > usage.long_capacity && usage.generation.is_some() && !draining
            {
                problems.push(format!(
                    "{}/{}: long_in_flight over long capacity",
                    snap.node_id, snap.provider_id
                ));
            }
            let ready = nodes
                .iter()
                .any(|n| *n.node_id == snap.node_id && n.state == NodeState::Ready);
            if ready {
                let (queued, _) = self.edge.queue().queued_at(r);
                if snap.in_flight != usage.in_flight || snap.queued as usize != queued {
                    problems.push(format!(
                        "snapshot of {}/{} disagrees with the ledger",
                        snap.node_id, snap.provider_id
                    ));
                }
            } else if usage.in_flight != 0 || snap.in_flight != 0 || snap.capacity != 0 {
                problems.push(format!(
                    "{}/{} holds leases or capacity while its node is not ready",
                    snap.node_id, snap.provider_id
                ));
            }
        }
        if held != ledger.leases_held() {
            problems.push(format!(
                "ledger holds {} leases but resources count {held}",
                ledger.leases_held()
            ));
        }
        // No waiter waits while one of its candidates has room for it.
        for w in self.edge.queue().waiters() {
            if w.candidates
                .iter()
                .any(|c| ledger.free(c.resource, w.long) > 0 && self.edge.pickable(c.resource))
            {
                problems.push(format!(
                    "{} waits while a candidate has free capacity",
                    w.request
                ));
                break;
            }
        }
        // Every request ends, at the latest when its client gives up.
        let grace = timing().heartbeat_timeout;
        for (request, client) in &self.clients {
            if !client.ended && self.now > client.deadline + grace {
                problems.push(format!(
                    "{request} still open {} past its deadline",
                    self.now
                        .saturating_duration_since(client.deadline)
                        .as_millis()
                ));
                break;
            }
        }
        if let Some(p) = problems.into_iter().next() {
            self.failure = Some(p);
        }
    }

    /// Load stops and faults heal: everything must end and every lease come back.
    fn quiesce(&mut self) {
        self.log(|| "quiesce: no more load, faults heal".into());
        let now = self.now;
        for i in 0..self.procs.len() {
            if self.procs[i].impostor || self.procs[i].bad {
                self.procs[i].restart_at = None;
                if self.procs[i].alive {
                    self.crash(i);
                }
                self.procs[i].kill_at = None;
            } else {
                self.procs[i].frozen_until = self.procs[i].frozen_until.min(now);
                self.procs[i].mode = Mode::Normal;
                for w in self.procs[i].work.values_mut() {
                    w.next_at = w.next_at.min(now + Duration::from_millis(5));
                }
                if !self.procs[i].alive
                    && !self.procs[i].retired
                    && self.procs[i].restart_at.is_none()
                {
                    self.procs[i].restart_at = Some(now);
                }
            }
        }
        for link in self.links.values_mut() {
            link.held_until = link.held_until.min(now);
        }
        self.advance(8000);
        if self.failure.is_some() {
            return;
        }
        let open: Vec<_> = self
            .clients
            .iter()
            .filter(|(_, c)| !c.ended)
            .map(|(r, _)| *r)
            .collect();
        check!(self, open.is_empty(), "requests never ended: {open:?}");
        check!(
            self,
            self.edge.ledger().leases_held() == 0,
            "{} leases never returned",
            self.edge.ledger().leases_held()
        );
        check!(
            self,
            self.edge.queue().is_empty(),
            "waiters left in the queue"
        );
        check!(
            self,
            self.edge.open_requests() == 0,
            "{} requests still open in the edge",
            self.edge.open_requests()
        );
        let not_ready: Vec<_> = self
            .edge
            .nodes()
            .into_iter()
            .filter(|n| n.state != NodeState::Ready)
            .map(|n| n.node_id)
            .collect();
        check!(
            self,
            not_ready.is_empty(),
            "nodes not ready after healing: {not_ready:?}"
        );
        if self.failure.is_some() {
            return;
        }
        // Healed, with every provider answering again: a request to any model group
        // ends well (ejections from the faults are over and probed by then).
        let fresh: Vec<RequestId> = (0..MODELS as u8)
            .filter_map(|model| {
                let before = self.stats.requests;
                self.submit(model, false, 4000, None, false);
                (self.stats.requests > before).then(|| {
                    *self
                        .clients
                        .keys()
                        .next_back()
                        .expect("the request just submitted")
                })
            })
            .collect();
        check!(
            self,
            fresh.len() == MODELS,
            "a healed world refused a request"
        );
        let completed = self.stats.completed;
        self.advance(3000);
        let works: Vec<(usize, String, Vec<String>)> = self
            .procs
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.work.is_empty())
            .map(|(i, p)| (i, p.node_id.clone(), p.work.keys().cloned().collect()))
            .collect();
        check!(
            self,
            self.stats.completed == completed + fresh.len() as u64,
            "a healed world did not complete {fresh:?} (work left on the nodes: {works:?})"
        );
    }
}

fn terminal_event(event: &RunEvent) -> bool {
    matches!(
        iop_proto_core::wire::RunEventType::try_from(event.r#type),
        Ok(iop_proto_core::wire::RunEventType::Complete
            | iop_proto_core::wire::RunEventType::Error
            | iop_proto_core::wire::RunEventType::Cancelled)
    )
}

fn terminal_frame(frame: &ProviderTunnelFrame) -> bool {
    matches!(
        iop_proto_core::wire::TunnelFrameKind::try_from(frame.kind),
        Ok(iop_proto_core::wire::TunnelFrameKind::End
            | iop_proto_core::wire::TunnelFrameKind::Error)
    )
}

/// Runs `ops` in a world seeded with `seed`.
pub fn run(seed: u64, ops: &[Op], options: SimOptions) -> Result<Stats, SimFailure> {
    let edge = EdgeCore::new(world_config(0)).expect("the simulated config is valid");
    let mut seeds = Rng::new(seed ^ 0x6A09_E667_F3BC_C909);
    let mut world = World {
        now: Timestamp::ZERO,
        rng: Rng::new(seed),
        edge,
        rev: 0,
        procs: (0..NODES)
            .map(|n| NodeProc::new(format!("n{n}"), Timestamp::ZERO, false, seeds.next_u64()))
            .collect(),
        links: BTreeMap::new(),
        next_conn: 1,
        clients: BTreeMap::new(),
        client_timers: BTreeSet::new(),
        trace: VecDeque::new(),
        full_trace: options.full_trace,
        stats: Stats::default(),
        failure: None,
        drain_read: BTreeSet::new(),
        faults: options.faults,
        last_dispatch: BTreeMap::new(),
        dispatched_to: HashMap::new(),
        read_count: 0,
        freed_at: HashMap::new(),
        node_freed_at: HashMap::new(),
    };
    // A machine that panics on a broken internal invariant is a finding too: keep the
    // seed and the trace that led there.
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        for i in 0..NODES {
            world.drain_node(i);
        }
        // Let the nodes come up before load starts.
        world.advance(300);
        for op in ops {
            if world.failure.is_some() {
                break;
            }
            let text = format!("{op:?}");
            world.log(|| format!("op {text}"));
            world.apply(op);
            if world.failure.is_none() {
                world.check_invariants();
            }
        }
        if world.failure.is_none() {
            world.quiesce();
        }
    }));
    if let Err(panic) = outcome {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "a machine panicked".to_owned());
        world.failure = Some(format!("panic: {message}"));
    }
    world.stats.simulated = world.now.saturating_duration_since(Timestamp::ZERO);
    match world.failure.take() {
        None => Ok(world.stats),
        Some(message) => {
            let mut trace = String::new();
            for line in &world.trace {
                let _ = writeln!(trace, "  {line}");
            }
            Err(SimFailure {
                seed,
                at: world.now,
                message,
                trace,
            })
        }
    }
}
