//! Registration abuse guards, plain accounting driven by timestamps:
//!
//! - [`AuthThrottle`]: per-source failed-registration counts and an exponential back-off.
//!   A source that fails more than [`ThrottleLimits::free_failures`] times without a quiet
//!   [`ThrottleLimits::window`] is blocked, for twice as long with each further failure up
//!   to [`ThrottleLimits::max_block`]. While blocked, its registrations are refused without
//!   looking at the credentials, so guessing gains nothing. It also decides which failures
//!   are worth a log line (the 1st, 2nd, 4th, 8th… of a source), so an attack writes a
//!   handful of lines instead of one per attempt.
//! - [`FlapGuard`]: one node id that two live processes keep taking from each other.
//!   Each register names its process ([`Instance`]), so a take-back by a process that
//!   lost the id proves two of them; one process reconnecting, or a restart, never does
//!   (the rule is on [`FlapGuard`]). [`ConflictLimits::supersedes`] proven hand-overs
//!   within [`ConflictLimits::window`] make it a *conflict*: the current owner keeps the
//!   node and newcomers are held off for [`ConflictLimits::hold_down`], renewed by every
//!   refused newcomer, so the conflict stays visible for as long as both nodes run.
//!
//! - [`PendingConnections`]: connections that have not registered yet (still in their
//!   TLS handshake or before their `RegisterRequest`) are capped, in all and per source,
//!   so unauthenticated peers cannot hold an unbounded number of sockets and buffers.
//!
//! All are bounded: the throttle tracks at most [`ThrottleLimits::max_sources`] sources
//! (forgetting quiet ones first, then the oldest), a flap guard keeps at most
//! `supersedes` timestamps, and the pending table has one entry per source with a
//! pending connection.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::time::Duration;

use crate::time::Timestamp;

/// Where registrations come from, as the throttle counts them: an IPv4 address, or the
/// /64 prefix of an IPv6 address (one host usually owns a whole /64).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// An IPv4 address (or an IPv4-mapped IPv6 one).
    V4([u8; 4]),
    /// The first 64 bits of an IPv6 address.
    V6Prefix([u8; 8]),
    /// The transport gave no address; all such connections share one budget.
    Unknown,
}

impl Source {
    /// The source of a connection from `addr`.
    #[must_use]
    pub fn of(addr: Option<IpAddr>) -> Self {
        match addr {
            None => Source::Unknown,
            Some(IpAddr::V4(v4)) => Source::V4(v4.octets()),
            Some(IpAddr::V6(v6)) => match v6.to_ipv4_mapped() {
                Some(v4) => Source::V4(v4.octets()),
                None => {
                    let mut prefix = [0u8; 8];
                    prefix.copy_from_slice(&v6.octets()[..8]);
                    Source::V6Prefix(prefix)
                }
            },
        }
    }
}

/// Limits of the failed-registration back-off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThrottleLimits {
    /// Failures a source may make before it is blocked.
    pub free_failures: u32,
    /// Quiet time after which a source's failures are forgotten.
    pub window: Duration,
    /// The first block; each further failure doubles it.
    pub base_block: Duration,
    /// The longest block.
    pub max_block: Duration,
    /// Sources tracked at once.
    pub max_sources: usize,
}

impl Default for ThrottleLimits {
    fn default() -> Self {
        ThrottleLimits {
            free_failures: 5,
            window: Duration::from_secs(60),
            base_block: Duration::from_secs(1),
            max_block: Duration::from_secs(60),
            max_sources: 4096,
        }
    }
}

/// What a recorded failure means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FailureRecord {
    /// Failures of this source since it was last quiet for a whole window.
    pub failures: u32,
    /// The block this failure started or extended, if any.
    pub blocked_for: Option<Duration>,
    /// Whether this failure is worth a log line.
    pub log: bool,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    failures: u32,
    last_failure: Timestamp,
    blocked_until: Timestamp,
}

/// Per-source failed-registration back-off. See the [module documentation](self).
#[derive(Debug)]
pub struct AuthThrottle {
    limits: ThrottleLimits,
    entries: HashMap<Source, Entry>,
}

impl AuthThrottle {
    /// A throttle with `limits`.
    #[must_use]
    pub fn new(limits: ThrottleLimits) -> Self {
        AuthThrottle {
            limits,
            entries: HashMap::new(),
        }
    }

    /// Replaces the limits (on reload); what was counted stays.
    pub fn set_limits(&mut self, limits: ThrottleLimits) {
        self.limits = limits;
    }

    /// Sources currently tracked.
    #[must_use]
    pub fn tracked(&self) -> usize {
        self.entries.len()
    }

    /// How long `source` stays blocked from `now`, if it is.
    #[must_use]
    pub fn blocked(&self, now: Timestamp, source: Source) -> Option<Duration> {
        let entry = self.entries.get(&source)?;
        (entry.blocked_until > now).then(|| entry.blocked_until.saturating_duration_since(now))
    }

    /// Counts a failed registration (also one refused while blocked) of `source`.
    pub fn record_failure(&mut self, now: Timestamp, source: Source) -> FailureRecord {
        if !self.entries.contains_key(&source) {
            self.make_room(now);
        }
        let limits = self.limits;
        let entry = self.entries.entry(source).or_insert(Entry {
            failures: 0,
            last_failure: now,
            blocked_until: Timestamp::ZERO,
        });
        if entry.blocked_until <= now && now >= entry.last_failure + limits.window {
            entry.failures = 0;
        }
        entry.failures = entry.failures.saturating_add(1);
        entry.last_failure = now;
        let over = entry.failures.saturating_sub(limits.free_failures);
        let blocked_for = (over > 0).then(|| {
            let block = limits
                .base_block
                .saturating_mul(1u32 << (over - 1).min(30))
                .min(limits.max_block);
            entry.blocked_until = entry.blocked_until.max(now + block);
            block
        });
        FailureRecord {
            failures: entry.failures,
            blocked_for,
            log: entry.failures.is_power_of_two() || over == 1,
        }
    }

    /// A registration from `source` succeeded: its failures are forgotten.
    pub fn record_success(&mut self, source: Source) {
        self.entries.remove(&source);
    }

    /// Keeps the table below its bound: forget sources that are neither blocked nor
    /// recently failing, and if none is, the one that failed longest ago.
    fn make_room(&mut self, now: Timestamp) {
        if self.entries.len() < self.limits.max_sources.max(1) {
            return;
        }
        let window = self.limits.window;
        self.entries
            .retain(|_, e| e.blocked_until > now || now < e.last_failure + window);
        if self.entries.len() >= self.limits.max_sources.max(1)
            && let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.last_failure)
                .map(|(source, _)| *source)
        {
            self.entries.remove(&oldest);
        }
    }
}

/// Limits of node-id flap detection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConflictLimits {
    /// Supersedes within `window` that make a conflict.
    pub supersedes: u32,
    /// See `supersedes`.
    pub window: Duration,
    /// How long newcomers are held off after the conflict is detected or a newcomer was
    /// last refused.
    pub hold_down: Duration,
    /// When a refused newcomer is told to come back: shorter than `hold_down`, so one
    /// that keeps coming back keeps the conflict visible instead of winning when the
    /// hold-down ends, and one whose rival died gets in soon after.
    pub retry_after: Duration,
}

impl Default for ConflictLimits {
    fn default() -> Self {
        ConflictLimits {
            supersedes: 3,
            window: Duration::from_secs(30),
            hold_down: Duration::from_secs(60),
            retry_after: Duration::from_secs(5),
        }
    }
}

/// What to do with an authenticated register for a node that already has an owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Contest {
    /// The newcomer takes the node (the usual reconnect of a restarted node).
    Supersede,
    /// The newcomer takes the node, and that makes the node id a conflict from now on.
    SupersedeAndHold,
    /// The node id is in conflict: the newcomer is refused and should retry after
    /// `retry_after`.
    HoldOff {
        /// When the newcomer may try again.
        retry_after: Duration,
        /// Whether this refusal is worth a log line (the 1st, 2nd, 4th… of a conflict).
        log: bool,
    },
}

/// The connection a newcomer would take a node id from, as [`FlapGuard::contest`] sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rival {
    /// Heard from recently: two live connections claim the node id.
    Live,
    /// Silent for longer than a live connection is (the node lost its link or restarted
    /// and is reconnecting, before the heartbeat timeout closed its old connection).
    Silent,
}

/// The process behind a register: its `RegisterRequest.instance_id`, drawn at random
/// when the process starts; `None` for a node that predates the field (it sends 0).
pub type Instance = Option<std::num::NonZeroU64>;

/// An authenticated register that would take a node id from its current holder, as
/// [`FlapGuard::contest`] decides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim {
    /// The process that registers now.
    pub newcomer: Instance,
    /// The process that holds the node id.
    pub holder: Instance,
    /// Whether the holder's connection is still heard from.
    pub rival: Rival,
}

impl Claim {
    /// The newcomer is the holder's own process (its old connection is dead to it).
    #[must_use]
    pub fn same_process(&self) -> bool {
        self.newcomer.is_some() && self.newcomer == self.holder
    }
}

/// Processes a guard remembers as having lost the node id (a few are enough: two
/// processes fighting alternate between the same two).
const MAX_LOSERS: usize = 8;

/// Flap detection for one node id. See the [module documentation](self).
///
/// The rule: a node id is in *conflict* when, within [`ConflictLimits::window`], it
/// changed hands between live connections [`ConflictLimits::supersedes`] times and each
/// change is *proven* to be two processes fighting: the newcomer is a process that had
/// lost the id before and takes it back from another live one (a take-back also proves
/// the change it reverses). What never makes a conflict: one process reconnecting,
/// however often (same instance); a restart, overlapping the old process or not (a new
/// instance, and the old one does not come back); any takeover of a silent connection.
/// A node that sends no instance id (older than the field) is judged by liveness
/// alone: every supersede of a live connection counts.
#[derive(Clone, Debug, Default)]
pub struct FlapGuard {
    /// Proven live hand-overs within the window, oldest first.
    recent: VecDeque<Timestamp>,
    /// Processes that lost the node id, and when.
    losers: VecDeque<(std::num::NonZeroU64, Timestamp)>,
    hold_until: Option<Timestamp>,
    refused: u32,
}

impl FlapGuard {
    /// Whether the node id is in conflict at `now`.
    #[must_use]
    pub fn in_conflict(&self, now: Timestamp) -> bool {
        self.hold_until.is_some_and(|until| until > now)
    }

    /// Decides an authenticated register that would supersede the current holder (see
    /// the rule on [`FlapGuard`]). While the id is in conflict, newcomers are held off,
    /// except the holder's own process.
    pub fn contest(&mut self, now: Timestamp, limits: ConflictLimits, claim: Claim) -> Contest {
        if claim.same_process() {
            return Contest::Supersede;
        }
        if self.in_conflict(now) {
            self.hold_until = Some(now + limits.hold_down);
            self.refused = self.refused.saturating_add(1);
            return Contest::HoldOff {
                retry_after: limits.retry_after.min(limits.hold_down),
                log: self.refused.is_power_of_two(),
            };
        }
        self.hold_until = None;
        let expired = |at: Timestamp| now >= at + limits.window;
        while self.recent.front().is_some_and(|&at| expired(at)) {
            self.recent.pop_front();
        }
        self.losers.retain(|&(_, at)| !expired(at));
        let took_back = claim.newcomer.and_then(|newcomer| {
            let at = self.losers.iter().position(|&(p, _)| p == newcomer)?;
            self.losers.remove(at).map(|(_, lost_at)| lost_at)
        });
        if let Some(holder) = claim.holder {
            self.losers.retain(|&(p, _)| p != holder);
            if self.losers.len() == MAX_LOSERS {
                self.losers.pop_front();
            }
            self.losers.push_back((holder, now));
        }
        if claim.rival == Rival::Silent {
            return Contest::Supersede;
        }
        match (claim.newcomer, took_back) {
            // A process that predates instance ids: liveness is all there is to go by.
            (None, _) => {}
            (Some(_), Some(lost_at)) => {
                let at = self.recent.partition_point(|&t| t < lost_at);
                if self.recent.get(at) != Some(&lost_at) {
                    self.recent.insert(at, lost_at);
                }
            }
            // A new process beside a live one: a restart that overlaps the old process,
            // or the first move of a second one; only a take-back tells them apart.
            (Some(_), None) => return Contest::Supersede,
        }
        self.recent.push_back(now);
        let threshold = usize::try_from(limits.supersedes.max(1)).unwrap_or(usize::MAX);
        if self.recent.len() >= threshold {
            self.recent.clear();
            self.losers.clear();
            self.refused = 0;
            self.hold_until = Some(now + limits.hold_down);
            Contest::SupersedeAndHold
        } else {
            Contest::Supersede
        }
    }
}

/// Caps on connections that have not registered yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingLimits {
    /// Pending connections in all.
    pub max_total: usize,
    /// Pending connections from one source.
    pub max_per_source: usize,
}

impl Default for PendingLimits {
    fn default() -> Self {
        PendingLimits {
            max_total: 1024,
            max_per_source: 64,
        }
    }
}

/// Counts connections that have not registered yet, in all and per source.
#[derive(Debug, Default)]
pub struct PendingConnections {
    total: usize,
    by_source: HashMap<Source, usize>,
}

impl PendingConnections {
    /// Counts a new connection from `source` if the limits allow it.
    pub fn admit(&mut self, source: Source, limits: PendingLimits) -> bool {
        let from_source = self.by_source.get(&source).copied().unwrap_or(0);
        if self.total >= limits.max_total || from_source >= limits.max_per_source {
            return false;
        }
        self.total += 1;
        *self.by_source.entry(source).or_default() += 1;
        true
    }

    /// A counted connection from `source` registered, was refused or closed.
    pub fn release(&mut self, source: Source) {
        if let Some(n) = self.by_source.get_mut(&source) {
            *n -= 1;
            self.total -= 1;
            if *n == 0 {
                self.by_source.remove(&source);
            }
        }
    }

    /// Pending connections in all.
    #[must_use]
    pub fn total(&self) -> usize {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    const A: Source = Source::V4([10, 0, 0, 1]);

    #[test]
    fn five_failures_are_free_then_blocks_double_up_to_the_cap() {
        let mut t = AuthThrottle::new(ThrottleLimits::default());
        for i in 1..=5 {
            let r = t.record_failure(at(i), A);
            assert_eq!(r.blocked_for, None, "failure {i}");
            assert_eq!(t.blocked(at(i), A), None);
        }
        let blocks: Vec<u64> = (6..=14)
            .map(|i| {
                t.record_failure(at(i), A)
                    .blocked_for
                    .expect("blocked")
                    .as_secs()
            })
            .collect();
        assert_eq!(blocks, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert!(t.blocked(at(15), A).is_some());
        assert_eq!(t.blocked(at(15), Source::V4([10, 0, 0, 2])), None);
    }

    #[test]
    fn a_quiet_window_forgives_and_a_success_forgets() {
        let mut t = AuthThrottle::new(ThrottleLimits::default());
        for i in 0..5 {
            t.record_failure(at(i), A);
        }
        assert_eq!(t.record_failure(at(60_010), A).failures, 1);
        for i in 0..10 {
            t.record_failure(at(70_000 + i), A);
        }
        assert!(t.blocked(at(70_010), A).is_some());
        t.record_success(A);
        assert_eq!(t.blocked(at(70_010), A), None);
        assert_eq!(t.record_failure(at(70_011), A).failures, 1);
    }

    #[test]
    fn log_lines_grow_logarithmically_with_the_failures() {
        let mut t = AuthThrottle::new(ThrottleLimits::default());
        let logged = (0..200).filter(|&i| t.record_failure(at(i), A).log).count();
        // 1, 2, 4, 6 (the block starts), 8, 16, 32, 64, 128.
        assert_eq!(logged, 9);
    }

    #[test]
    fn the_table_stays_bounded() {
        let limits = ThrottleLimits {
            max_sources: 16,
            ..ThrottleLimits::default()
        };
        let mut t = AuthThrottle::new(limits);
        for i in 0..1000u32 {
            t.record_failure(at(u64::from(i)), Source::V4(i.to_be_bytes()));
            assert!(t.tracked() <= 16);
        }
    }

    #[test]
    fn pending_connections_are_capped_in_all_and_per_source() {
        let limits = PendingLimits {
            max_total: 3,
            max_per_source: 2,
        };
        let b = Source::V4([10, 0, 0, 2]);
        let mut p = PendingConnections::default();
        assert!(p.admit(A, limits) && p.admit(A, limits));
        assert!(!p.admit(A, limits), "per source");
        assert!(p.admit(b, limits));
        assert!(!p.admit(Source::Unknown, limits), "in all");
        p.release(A);
        assert!(p.admit(A, limits));
        for _ in 0..5 {
            p.release(b);
        }
        assert_eq!(p.total(), 2, "releasing more than admitted changes nothing");
    }

    #[test]
    fn ipv6_hosts_count_by_prefix() {
        let a: IpAddr = "2001:db8:1:2::1".parse().expect("v6");
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().expect("v6");
        let c: IpAddr = "2001:db8:1:3::1".parse().expect("v6");
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().expect("mapped");
        assert_eq!(Source::of(Some(a)), Source::of(Some(b)));
        assert_ne!(Source::of(Some(a)), Source::of(Some(c)));
        assert_eq!(Source::of(Some(mapped)), A);
    }

    fn process(n: u64) -> Instance {
        std::num::NonZeroU64::new(n)
    }

    /// `newcomer` takes the id from `holder`, which is live.
    fn live(newcomer: u64, holder: u64) -> Claim {
        Claim {
            newcomer: process(newcomer),
            holder: process(holder),
            rival: Rival::Live,
        }
    }

    #[test]
    fn two_processes_taking_the_id_back_make_a_conflict_that_refused_newcomers_renew() {
        let limits = ConflictLimits::default();
        let mut g = FlapGuard::default();
        // A (1) takes it from B (2) at 0 s; B's take-back at 40 s is outside the window,
        // so it proves nothing yet.
        assert_eq!(g.contest(at(0), limits, live(1, 2)), Contest::Supersede);
        assert_eq!(
            g.contest(at(40_000), limits, live(2, 1)),
            Contest::Supersede
        );
        // A takes it back within the window: that proves its own hand-over and the one
        // at 40 s. B's next take-back is the third proven one.
        assert_eq!(
            g.contest(at(41_000), limits, live(1, 2)),
            Contest::Supersede
        );
        assert_eq!(
            g.contest(at(42_000), limits, live(2, 1)),
            Contest::SupersedeAndHold
        );
        assert!(g.in_conflict(at(42_001)));
        let Contest::HoldOff { retry_after, log } = g.contest(at(90_000), limits, live(2, 1))
        else {
            panic!("held off");
        };
        assert!(retry_after < limits.hold_down);
        assert!(log, "the first refusal is logged");
        // The refused newcomer renewed the hold: still a conflict past the first hold-down.
        assert!(g.in_conflict(at(120_000)));
        // The holder's own process reconnecting is never held off.
        assert_eq!(
            g.contest(at(120_000), limits, live(1, 1)),
            Contest::Supersede
        );
        assert!(!g.in_conflict(at(150_000)));
        assert_eq!(
            g.contest(at(150_000), limits, live(2, 1)),
            Contest::Supersede
        );
    }

    #[test]
    fn restarts_never_make_a_conflict_however_fast_they_overlap() {
        let limits = ConflictLimits::default();
        let mut g = FlapGuard::default();
        // Each restart is a new process taking the id from the live (draining) old one.
        for n in 1..50u64 {
            assert_eq!(
                g.contest(at(n * 10), limits, live(n + 1, n)),
                Contest::Supersede,
                "restart {n}"
            );
        }
        assert!(!g.in_conflict(at(500)));
    }

    #[test]
    fn one_process_reconnecting_never_makes_a_conflict() {
        let limits = ConflictLimits::default();
        let mut g = FlapGuard::default();
        for t in 0..20 {
            assert_eq!(
                g.contest(at(t * 10), limits, live(7, 7)),
                Contest::Supersede
            );
            let silent = Claim {
                rival: Rival::Silent,
                ..live(7, 7)
            };
            assert_eq!(
                g.contest(at(t * 10 + 5), limits, silent),
                Contest::Supersede
            );
        }
        assert!(!g.in_conflict(at(200)));
    }

    #[test]
    fn nodes_without_an_instance_id_are_judged_by_liveness_alone() {
        let limits = ConflictLimits::default();
        let mut g = FlapGuard::default();
        let old = |rival| Claim {
            newcomer: None,
            holder: None,
            rival,
        };
        for t in 0..10 {
            assert_eq!(
                g.contest(at(t * 100), limits, old(Rival::Silent)),
                Contest::Supersede
            );
        }
        assert!(!g.in_conflict(at(1_000)));
        // Three live supersedes: a conflict, as before instance ids.
        assert_eq!(
            g.contest(at(1_100), limits, old(Rival::Live)),
            Contest::Supersede
        );
        assert_eq!(
            g.contest(at(1_200), limits, old(Rival::Silent)),
            Contest::Supersede
        );
        assert_eq!(
            g.contest(at(1_300), limits, old(Rival::Live)),
            Contest::Supersede
        );
        assert_eq!(
            g.contest(at(1_400), limits, old(Rival::Live)),
            Contest::SupersedeAndHold
        );
        // Once in conflict, a newcomer is held off whatever the owner's state.
        assert!(matches!(
            g.contest(at(1_500), limits, old(Rival::Silent)),
            Contest::HoldOff { .. }
        ));
    }

    #[test]
    fn a_take_back_over_a_silent_holder_counts_nothing() {
        let limits = ConflictLimits::default();
        let mut g = FlapGuard::default();
        let silent = |newcomer, holder| Claim {
            rival: Rival::Silent,
            ..live(newcomer, holder)
        };
        for t in 0..10 {
            let (a, b) = if t % 2 == 0 { (1, 2) } else { (2, 1) };
            assert_eq!(
                g.contest(at(t * 100), limits, silent(a, b)),
                Contest::Supersede
            );
        }
        assert!(!g.in_conflict(at(1_000)));
    }
}
