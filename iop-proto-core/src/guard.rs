//! Registration abuse guards, plain accounting driven by timestamps:
//!
//! - [`AuthThrottle`]: failed registrations, counted where the guesses are: against the
//!   node id they claimed (known or not, alike, so throttling never tells ids apart) and
//!   against their source address. Each has a budget of [`ThrottleLimits::free_failures`]
//!   failures answered at once, refilled by one every [`ThrottleLimits::interval`];
//!   beyond it, the *answer* to a failure is held back (up to
//!   [`ThrottleLimits::max_hold`]), so failures from one address, and failures against one
//!   node id from anywhere, are answered at most one per interval. Nothing is ever refused
//!   without its credentials being checked, and a right token is accepted at once
//!   whatever failed before it: a misconfigured node costs its siblings behind the same
//!   address nothing. A node id's correct token ends its throttle; the address's budget
//!   refills only with time (so one valid node cannot reset it for a guesser beside it).
//!   It also decides which failures are worth a log line, so an attack writes a handful.
//! - [`FlapGuard`]: one node id that two live processes keep taking from each other.
//!   Each register names its process ([`Instance`]), so a take-back by a process that
//!   lost the id proves two of them; one process reconnecting, or a restart, never does
//!   (the rule is on [`FlapGuard`]). [`ConflictLimits::supersedes`] proven hand-overs
//!   within [`ConflictLimits::window`] make it a *conflict*: the current owner keeps the
//!   node and newcomers are held off for [`ConflictLimits::hold_down`], renewed by every
//!   refused newcomer, so the conflict stays visible for as long as both nodes run.
//!
//! - [`PendingConnections`]: connections that have not registered yet (still in their
//!   TLS handshake or before their `RegisterRequest`, or waiting for a held answer) are
//!   capped, in all and per source, so unauthenticated peers cannot hold an unbounded
//!   number of sockets and buffers. Together with the held answers this bounds the
//!   guesses of any number of concurrent connections.
//!
//! All are bounded: the throttle tracks at most [`ThrottleLimits::max_tracked`] node ids
//! and as many sources (forgetting settled ones first, then the oldest), a flap guard
//! keeps a few timestamps, and the pending table has one entry per source with a pending
//! connection.
//!
//! Over the ~800-line norm only with its unit tests (the guards themselves are about 610
//! lines); they sit beside the accounting they check.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::net::IpAddr;
use std::time::Duration;

use crate::time::Timestamp;

/// Where registrations come from, as the throttle counts them: an IPv4 address, or the
/// /64 prefix of an IPv6 address (one host usually owns a whole /64).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
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

/// `10.0.0.1`, `2001:db8:1:2::/64` or `unknown`.
impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::V4(octets) => std::net::Ipv4Addr::from(*octets).fmt(f),
            Source::V6Prefix(prefix) => {
                let mut octets = [0u8; 16];
                octets[..8].copy_from_slice(prefix);
                write!(f, "{}/64", std::net::Ipv6Addr::from(octets))
            }
            Source::Unknown => f.write_str("unknown"),
        }
    }
}

/// Limits of the failed-registration throttle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThrottleLimits {
    /// Failures a node id, and a source, may make in a burst before their answers are
    /// held back.
    pub free_failures: u32,
    /// Beyond the burst, failures are answered one per interval; the budget refills one
    /// failure per interval.
    pub interval: Duration,
    /// The longest a failed answer is held back (what bounds the guesses of many
    /// concurrent connections, with the caps on pending connections).
    pub max_hold: Duration,
    /// A node id's or a source's failure count (for logs and status) is forgotten after
    /// this long without one.
    pub window: Duration,
    /// Node ids tracked at once, and sources tracked at once.
    pub max_tracked: usize,
}

impl Default for ThrottleLimits {
    fn default() -> Self {
        ThrottleLimits {
            free_failures: 5,
            interval: Duration::from_secs(1),
            max_hold: Duration::from_secs(30),
            window: Duration::from_secs(60),
            max_tracked: 4096,
        }
    }
}

/// Which budget held a failed answer back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThrottledBy {
    /// The claimed node id's (failures against it from anywhere).
    Node,
    /// The source address's (failures from it, whatever id they claimed).
    Source,
}

impl ThrottledBy {
    /// A stable name for logs and events.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            ThrottledBy::Node => "node_id",
            ThrottledBy::Source => "source",
        }
    }
}

/// What a recorded failure means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FailureRecord {
    /// Failures against the claimed node id since it was last quiet for a window.
    pub node_failures: u32,
    /// Failures from the source since it was last quiet for a window.
    pub source_failures: u32,
    /// How long the answer is held back; zero within the budgets.
    pub hold: Duration,
    /// The budget that holds it (the longer hold, when both do).
    pub by: Option<ThrottledBy>,
    /// When the peer should try again: the hold a failure would meet right after this
    /// answer, at least one interval. Zero within the budgets.
    pub retry_after: Duration,
    /// Whether this failure is worth a log line.
    pub log: bool,
}

/// A node id or source with failures within the window, for status pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailingKey<K> {
    /// The node id claimed, or the source.
    pub key: K,
    /// Failures since it was last quiet for a window.
    pub failures: u32,
    /// How long a failure now would be held back (zero: within its budget).
    pub hold: Duration,
    /// Time since its last failure.
    pub since_last: Duration,
}

/// One budget: a count for logs, and a generic cell rate (GCRA) for holds.
#[derive(Clone, Copy, Debug)]
struct Budget {
    failures: u32,
    last_failure: Timestamp,
    /// Each failure moves this one interval further; up to `free_failures` intervals
    /// ahead of now are free, beyond that the answer waits.
    debt_until: Timestamp,
    /// When a failure of this key was last worth a log line.
    logged_at: Option<Timestamp>,
}

impl Budget {
    fn allowance(limits: &ThrottleLimits) -> Duration {
        limits.interval.saturating_mul(limits.free_failures)
    }

    /// The hold a failure at `now` would meet.
    fn hold(&self, now: Timestamp, limits: &ThrottleLimits) -> Duration {
        (self.debt_until.max(now) + limits.interval)
            .saturating_duration_since(now)
            .saturating_sub(Self::allowance(limits))
            .min(limits.max_hold)
    }

    /// Counts a failure at `now`; returns its hold.
    fn charge(&mut self, now: Timestamp, limits: &ThrottleLimits) -> Duration {
        if now >= self.last_failure + limits.window {
            self.failures = 0;
        }
        self.failures = self.failures.saturating_add(1);
        self.last_failure = now;
        let hold = self.hold(now, limits);
        // Capped, so a burst of concurrent failures cannot push recovery far out.
        self.debt_until = (self.debt_until.max(now) + limits.interval)
            .min(now + Self::allowance(limits) + limits.max_hold);
        hold
    }

    /// Nothing owed and nothing to report: may be forgotten.
    fn settled(&self, now: Timestamp, limits: &ThrottleLimits) -> bool {
        self.debt_until <= now && now >= self.last_failure + limits.window
    }
}

/// Budgets by key, bounded.
#[derive(Debug)]
struct Budgets<K> {
    entries: HashMap<K, Budget>,
}

impl<K: Eq + Hash + Clone> Budgets<K> {
    fn new() -> Self {
        Budgets {
            entries: HashMap::new(),
        }
    }

    fn get_or_insert(&mut self, now: Timestamp, key: &K, limits: &ThrottleLimits) -> &mut Budget {
        if !self.entries.contains_key(key) {
            self.make_room(now, limits);
        }
        self.entries.entry(key.clone()).or_insert(Budget {
            failures: 0,
            last_failure: now,
            debt_until: Timestamp::ZERO,
            logged_at: None,
        })
    }

    /// Keeps the table below its bound: forget settled keys, and if none is, the one
    /// that failed longest ago.
    fn make_room(&mut self, now: Timestamp, limits: &ThrottleLimits) {
        let max = limits.max_tracked.max(1);
        if self.entries.len() < max {
            return;
        }
        self.entries.retain(|_, b| !b.settled(now, limits));
        if self.entries.len() >= max
            && let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, b)| b.last_failure)
                .map(|(key, _)| key.clone())
        {
            self.entries.remove(&oldest);
        }
    }

    fn failing(&self, now: Timestamp, limits: &ThrottleLimits) -> Vec<FailingKey<K>> {
        self.entries
            .iter()
            .filter(|(_, b)| now < b.last_failure + limits.window)
            .map(|(key, b)| FailingKey {
                key: key.clone(),
                failures: b.failures,
                hold: b.hold(now, limits),
                since_last: now.saturating_duration_since(b.last_failure),
            })
            .collect()
    }
}

/// Failed-registration throttle by node id and by source. See the
/// [module documentation](self).
#[derive(Debug)]
pub struct AuthThrottle {
    limits: ThrottleLimits,
    nodes: Budgets<Box<str>>,
    sources: Budgets<Source>,
}

impl AuthThrottle {
    /// A throttle with `limits`.
    #[must_use]
    pub fn new(limits: ThrottleLimits) -> Self {
        AuthThrottle {
            limits,
            nodes: Budgets::new(),
            sources: Budgets::new(),
        }
    }

    /// Replaces the limits (on reload); what was counted stays.
    pub fn set_limits(&mut self, limits: ThrottleLimits) {
        self.limits = limits;
    }

    /// Node ids and sources currently tracked.
    #[must_use]
    pub fn tracked(&self) -> usize {
        self.nodes.entries.len() + self.sources.entries.len()
    }

    /// Counts a failed registration that claimed `node_id` from `source`: both budgets
    /// are charged, and the answer waits for the longer of their holds.
    pub fn record_failure(
        &mut self,
        now: Timestamp,
        source: Source,
        node_id: &str,
    ) -> FailureRecord {
        let limits = self.limits;
        let key: Box<str> = node_id.into();
        // A key not logged for a whole window is logged again, so a node that keeps
        // failing stays visible, about once a window.
        let quiet = |b: &Budget| b.logged_at.is_none_or(|at| now >= at + limits.window);
        let node = self.nodes.get_or_insert(now, &key, &limits);
        let node_hold = node.charge(now, &limits);
        let node_next = node.hold(now + node_hold, &limits);
        let (node_failures, node_quiet) = (node.failures, quiet(node));
        let src = self.sources.get_or_insert(now, &source, &limits);
        let source_hold = src.charge(now, &limits);
        let source_next = src.hold(now + source_hold, &limits);
        let (source_failures, source_quiet) = (src.failures, quiet(src));
        let (hold, by) = match (node_hold, source_hold) {
            (Duration::ZERO, Duration::ZERO) => (Duration::ZERO, None),
            (n, s) if n >= s => (n, Some(ThrottledBy::Node)),
            (_, s) => (s, Some(ThrottledBy::Source)),
        };
        let retry_after = if by.is_some() {
            node_next.max(source_next).max(limits.interval)
        } else {
            Duration::ZERO
        };
        // One line at the 1st, 2nd, 4th, 8th... failure where both counts say so (a
        // spray of ids from one address counts up its source; one id guessed from many
        // addresses counts up the id), one when a budget first holds an answer, and one
        // when neither was logged for a window.
        let starts = |failures: u32| failures == limits.free_failures.saturating_add(1);
        let log = (node_failures.is_power_of_two() && source_failures.is_power_of_two())
            || (by.is_some() && (starts(node_failures) || starts(source_failures)))
            || (node_quiet && source_quiet);
        if log {
            for b in [
                self.nodes.entries.get_mut(node_id),
                self.sources.entries.get_mut(&source),
            ]
            .into_iter()
            .flatten()
            {
                b.logged_at = Some(now);
            }
        }
        FailureRecord {
            node_failures,
            source_failures,
            hold,
            by,
            retry_after,
            log,
        }
    }

    /// A registration claiming `node_id` succeeded: that id's failures are forgotten and
    /// its throttle ends. The source's budget is left to refill with time, so a valid
    /// node cannot reset it for a guesser beside it.
    pub fn record_success(&mut self, node_id: &str) {
        self.nodes.entries.remove(node_id);
    }

    /// Node ids with failures within the window, most failures first, at most `max`.
    #[must_use]
    pub fn failing_nodes(&self, now: Timestamp, max: usize) -> Vec<FailingKey<Box<str>>> {
        top(self.nodes.failing(now, &self.limits), max)
    }

    /// Sources with failures within the window, most failures first, at most `max`.
    #[must_use]
    pub fn failing_sources(&self, now: Timestamp, max: usize) -> Vec<FailingKey<Source>> {
        top(self.sources.failing(now, &self.limits), max)
    }
}

fn top<K: Ord>(mut keys: Vec<FailingKey<K>>, max: usize) -> Vec<FailingKey<K>> {
    keys.sort_by(|a, b| b.failures.cmp(&a.failures).then_with(|| a.key.cmp(&b.key)));
    keys.truncate(max);
    keys
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
mod tests;
