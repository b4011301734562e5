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

use crate::Faults;
use crate::harness::Wire;
use crate::rng::Rng;
use iop_proto_core::RequestId;
use iop_proto_core::edge::{ConnId, EdgeCore};
use iop_proto_core::edge_config::{
    CandidateSpec, EdgeConfig, EdgeTiming, ModelSpec, NodeSpec, QueueLimits,
};
use iop_proto_core::reconnect::{ReconnectPolicy, Supervisor};
use iop_proto_core::session::NodeSession;
use iop_proto_core::testkit::internals::RunTracker;
use iop_proto_core::time::Timestamp;
use iop_proto_core::token::TokenVerifier;
use iop_proto_core::tunnel::TunnelPart;
use iop_proto_core::wire::{
    AdapterConfig, AdapterType, Envelope, NodeRuntimeConfig, ProviderTunnelFrame, RunEvent,
    TunnelFrameKind,
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
    /// Of those, tunnel frames that carried several parts (merged by the node).
    pub merged: u64,
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
    /// Streams continued on another provider after their first byte (the streams world).
    pub resumed: u64,
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
    /// Every other request streamed, with a body the mock providers answer as numbered
    /// tokens (`1,2,…,N,`); the providers' `run` adapters continue a final assistant
    /// message (`resume`), and a quarter of their runs break with a retryable error
    /// after their second token. Checked besides: every completed stream's text is the
    /// uninterrupted answer byte for byte, and a dispatch after the first byte is a
    /// continuation the Edge announced; model m2 places its requests by their
    /// conversation (`affinity = "prefix"`). Off: the world as it was (its seeds
    /// unchanged).
    pub streams: bool,
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
    world_config_with(rev, false)
}

/// [`world_config`]; with `streams`, the `run` adapters continue streams lost midway.
#[must_use]
pub fn world_config_with(rev: u32, streams: bool) -> EdgeConfig {
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
                adapters: vec![
                    {
                        let mut run = adapter("run", AdapterType::Mock, 2, 1, rev);
                        if streams {
                            run.options.insert("resume".into(), "true".into());
                        }
                        run
                    },
                    tun,
                ],
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
            context_tokens: None,
            first_byte_timeout: None,
            resume_limit: None,
            stall_timeout: None,
            affinity: None,
        },
    );
    models.insert(
        "m1".to_owned(),
        ModelSpec {
            candidates: vec![candidate(1, "tun"), candidate(2, "tun")],
            long_context_threshold: Some(100),
            context_tokens: None,
            first_byte_timeout: None,
            resume_limit: None,
            stall_timeout: None,
            affinity: None,
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
            context_tokens: None,
            first_byte_timeout: None,
            resume_limit: None,
            stall_timeout: None,
            // The streams world places m2's requests by their conversation: waits for a
            // full provider and the load bound among every fault.
            affinity: streams.then_some(iop_proto_core::edge::AffinityMode::Prefix),
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
            affinity: iop_proto_core::edge::Affinity {
                wait: Duration::from_millis(300),
                ..iop_proto_core::edge::Affinity::default()
            },
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
    /// A streamed request's numbered answer: the first token's number (after a
    /// continuation's prefill), and whether this run breaks after its second token.
    numbered: Option<(u32, bool)>,
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
        let kind = part.kind().ok_or("unknown frame kind")?;
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
    /// A streamed request of the streams world: the answer it must read, and what it
    /// read.
    expect: Option<String>,
    text: String,
    /// Continuations the Edge announced for it.
    resumes: u32,
    /// A run dispatched after its first byte, until the Edge announces it as a
    /// continuation.
    unannounced: Option<String>,
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
    /// The streams world ([`SimOptions::streams`]).
    streams: bool,
    /// Faults have healed: no stream breaks any more.
    healed: bool,
}

macro_rules! check {
    ($world:expr, $cond:expr, $($msg:tt)*) => {
        if !$cond && $world.failure.is_none() {
            $world.failure = Some(format!($($msg)*));
        }
    };
}

mod checks;
mod driver;
mod edge_side;
mod node_side;

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
    iop_proto_core::tunnel::ends_tunnel(frame)
}

/// Runs `ops` in a world seeded with `seed`.
pub fn run(seed: u64, ops: &[Op], options: SimOptions) -> Result<Stats, SimFailure> {
    let edge = EdgeCore::new(world_config_with(0, options.streams))
        .expect("the simulated config is valid");
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
        streams: options.streams,
        healed: false,
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

mod ops;
pub use ops::generate;
use ops::{weave_bad_siblings, weave_broken_providers, weave_stubborn_providers};
