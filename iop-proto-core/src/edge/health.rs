//! The health of one provider (a `(node, provider)` resource), as routing sees it: plain
//! accounting of its recent outcomes, driven by `now`.
//!
//! - Every dispatch that reached its first byte is a success (with its first-byte
//!   latency); a provider failure before it (unreachable, 5xx, 429, 408, no first byte
//!   in time) is a failure. A caller's own 4xx is neither: it says nothing of the
//!   provider.
//! - `eject_after_failures` failures in a row, or a failure share of at least
//!   `eject_failure_percent` among `eject_min_requests` or more outcomes within
//!   `eject_window`, *propose* an ejection: `eject_base`, doubled for each ejection in a
//!   row, at most `eject_max`. The pool takes it only if the provider's model groups
//!   keep a live provider and stay within `max_ejected_percent`.
//! - A provider's `Retry-After` cools it down the same way, for as long as it asked.
//! - When the time is up, one request probes it: a success restores it (and forgets the
//!   ejections in a row), a failure ejects it again, for longer.
//! - Between ejections, [`Health::cost`] weighs its load by its first-byte latency; and
//!   a provider whose last outcome was a failure is on *trial*: it is sent one request
//!   at a time until one succeeds. A provider that fails fast, whose room is always
//!   free, so stops attracting traffic at its first failure, and reaches its verdict
//!   (restored by a success, ejected by failures in a row) within a few requests
//!   whatever the load: no penalty that starves it of the requests that would decide.

use std::collections::VecDeque;
use std::time::Duration;

use crate::edge_config::Routing;
use crate::lease::RunId;
use crate::time::Timestamp;

/// Outcomes kept for the failure share.
const MAX_OUTCOMES: usize = 64;
/// Weight of the newest first-byte latency in its average.
const LATENCY_ALPHA: f64 = 0.3;

/// Why a provider is out of the rotation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ejection {
    /// This many failures in a row.
    Consecutive(u32),
    /// This share (percent) of its recent outcomes failed.
    FailureRate(u32),
    /// It asked callers to come back later (`Retry-After`).
    RetryAfter,
}

impl Ejection {
    /// A stable label for events and metrics.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            Ejection::Consecutive(_) => "consecutive_failures",
            Ejection::FailureRate(_) => "failure_rate",
            Ejection::RetryAfter => "retry_after",
        }
    }
}

/// Where a provider stands in the rotation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// Picked by cost.
    Live,
    /// Ejected until then: not picked.
    Ejected {
        /// Until when.
        until: Timestamp,
        /// Why.
        reason: Ejection,
    },
    /// Its ejection is over: the next request to it is the probe that decides.
    ProbeDue,
    /// Its probe is in flight: not picked until it is decided.
    Probing,
}

/// What a success changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Passed {
    /// Nothing: it was in the rotation and stays.
    Nothing,
    /// It was on trial and is no more: it may take any number of requests again.
    Trial,
    /// It was ejected (why) and is back in the rotation.
    Restored(Ejection),
}

/// One provider's health. See the [module documentation](self).
#[derive(Debug, Clone, Default)]
pub(super) struct Health {
    consecutive: u32,
    outcomes: VecDeque<(Timestamp, bool)>,
    /// Average first-byte latency, in seconds.
    latency: Option<f64>,
    ejected: Option<(Timestamp, Ejection)>,
    /// Ejections in a row (each doubles the next).
    ejections: u32,
    /// The probe in flight.
    probe: Option<RunId>,
    /// The one request in flight while it is on trial (its last outcome failed).
    trial: Option<RunId>,
}

impl Health {
    /// Where it stands at `now`.
    pub(super) fn standing(&self, now: Timestamp) -> Standing {
        match self.ejected {
            Some((until, reason)) if until > now => Standing::Ejected { until, reason },
            Some(_) if self.probe.is_some() => Standing::Probing,
            Some(_) => Standing::ProbeDue,
            None => Standing::Live,
        }
    }

    /// Whether a request may be sent to it now: live and not on trial with a request in
    /// flight, or its probe is due.
    pub(super) fn pickable(&self, now: Timestamp) -> bool {
        match self.standing(now) {
            Standing::Live => self.consecutive == 0 || self.trial.is_none(),
            Standing::ProbeDue => true,
            Standing::Ejected { .. } | Standing::Probing => false,
        }
    }

    /// Whether it counts as out of the rotation (for the share a group may lose).
    pub(super) fn out(&self, now: Timestamp) -> bool {
        !matches!(self.standing(now), Standing::Live)
    }

    /// `run` is sent to it: if its probe was due, this is the probe; if it is on trial,
    /// this is the trial.
    pub(super) fn dispatched(&mut self, now: Timestamp, run: RunId) {
        match self.standing(now) {
            Standing::ProbeDue => self.probe = Some(run),
            Standing::Live if self.consecutive > 0 => self.trial = Some(run),
            _ => {}
        }
    }

    /// `run` ended without deciding anything (its caller left, its node was lost): a
    /// probe or trial slot it held is free again (returns whether it held one).
    pub(super) fn undecided(&mut self, run: RunId) -> bool {
        self.release(run)
    }

    /// Frees the probe or trial slot `run` held; whether it held one.
    fn release(&mut self, run: RunId) -> bool {
        if self.probe == Some(run) {
            self.probe = None;
            true
        } else if self.trial == Some(run) {
            self.trial = None;
            true
        } else {
            false
        }
    }

    /// The cost of picking it with `free` units of room: the fewer free units the
    /// dearer (so among equals the most free capacity wins), weighted by its average
    /// first-byte latency (so a slow provider is sent less).
    pub(super) fn cost(&self, free: u32) -> f64 {
        let load = 1.0 / f64::from(free.max(1));
        load * (1.0 + self.latency.unwrap_or(0.0))
    }

    /// The share of failures among its outcomes within the window before `now`.
    fn failure_share(&self, now: Timestamp, routing: &Routing) -> (usize, usize) {
        let recent = self
            .outcomes
            .iter()
            .filter(|&&(at, _)| now < at + routing.eject_window);
        let (failed, total) = recent.fold((0, 0), |(f, t), &(_, failed)| {
            (f + usize::from(failed), t + 1)
        });
        (failed, total)
    }

    fn record(&mut self, now: Timestamp, failed: bool, routing: &Routing) {
        while self
            .outcomes
            .front()
            .is_some_and(|&(at, _)| now >= at + routing.eject_window)
            || self.outcomes.len() >= MAX_OUTCOMES
        {
            self.outcomes.pop_front();
        }
        self.outcomes.push_back((now, failed));
    }

    /// A dispatch reached its first byte after `latency`: whether that changes what may
    /// be sent to it.
    pub(super) fn success(
        &mut self,
        now: Timestamp,
        run: RunId,
        latency: Duration,
        routing: &Routing,
    ) -> Passed {
        self.record(now, false, routing);
        let probe = self.probe == Some(run);
        let on_trial = self.consecutive > 0;
        self.release(run);
        self.consecutive = 0;
        let seconds = latency.as_secs_f64();
        self.latency = Some(match self.latency {
            Some(avg) => avg * (1.0 - LATENCY_ALPHA) + seconds * LATENCY_ALPHA,
            None => seconds,
        });
        // Only the probe, or a success once the ejection is over, restores: a request
        // sent before the ejection that succeeds late says less than the failures did.
        if probe || self.standing(now) == Standing::ProbeDue {
            self.probe = None;
            self.ejections = 0;
            if let Some((_, reason)) = self.ejected.take() {
                return Passed::Restored(reason);
            }
        }
        if on_trial {
            Passed::Trial
        } else {
            Passed::Nothing
        }
    }

    /// A dispatch failed before its first byte (`run` is it). Returns the ejection this
    /// proposes, if any: how long and why.
    pub(super) fn failure(
        &mut self,
        now: Timestamp,
        run: RunId,
        routing: &Routing,
    ) -> Option<(Duration, Ejection)> {
        self.record(now, true, routing);
        self.consecutive = self.consecutive.saturating_add(1);
        let probe_failed = self.probe == Some(run);
        self.release(run);
        if self.standing(now) != Standing::Live && !probe_failed {
            // Already out (a request sent before the ejection failed late): nothing new.
            return None;
        }
        let (failed, total) = self.failure_share(now, routing);
        let percent = u32::try_from(failed * 100 / total.max(1)).unwrap_or(100);
        let reason = if probe_failed || self.consecutive >= routing.eject_after_failures {
            Ejection::Consecutive(self.consecutive)
        } else if total >= routing.eject_min_requests as usize
            && percent >= routing.eject_failure_percent
        {
            Ejection::FailureRate(percent)
        } else {
            return None;
        };
        let doubled = routing
            .eject_base
            .saturating_mul(1u32 << self.ejections.min(20));
        Some((doubled.min(routing.eject_max), reason))
    }

    /// Takes it out of the rotation until `now + time`.
    pub(super) fn eject(&mut self, now: Timestamp, time: Duration, reason: Ejection) {
        if reason != Ejection::RetryAfter {
            self.ejections = self.ejections.saturating_add(1);
        }
        let until = now + time;
        let until = match self.ejected {
            Some((old, _)) if old > until => old,
            _ => until,
        };
        self.ejected = Some((until, reason));
    }

    /// Figures for status pages: failures in a row, the share of failures within the
    /// window (0 to 1), the average first-byte latency in seconds.
    pub(super) fn figures(&self, now: Timestamp, routing: &Routing) -> (u32, f64, Option<f64>) {
        let (failed, total) = self.failure_share(now, routing);
        #[allow(clippy::cast_precision_loss)] // counts of at most MAX_OUTCOMES
        let share = if total == 0 {
            0.0
        } else {
            failed as f64 / total as f64
        };
        (self.consecutive, share, self.latency)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::RequestId;

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn run(n: u64) -> RunId {
        RunId::first(RequestId(n))
    }

    #[test]
    fn three_failures_in_a_row_propose_an_ejection_that_grows_and_a_probe_ends() {
        let routing = Routing::default();
        let mut h = Health::default();
        assert_eq!(h.failure(at(0), run(1), &routing), None);
        assert_eq!(h.failure(at(1), run(2), &routing), None);
        let (time, reason) = h.failure(at(2), run(3), &routing).expect("proposed");
        assert_eq!(
            (time, reason),
            (routing.eject_base, Ejection::Consecutive(3))
        );
        h.eject(at(2), time, reason);
        assert!(!h.pickable(at(3)));
        // The time is up: one probe, which fails, and the next ejection is twice as long.
        let due = at(2) + time;
        assert_eq!(h.standing(due), Standing::ProbeDue);
        h.dispatched(due, run(4));
        assert_eq!(h.standing(due), Standing::Probing);
        let (again, _) = h.failure(due, run(4), &routing).expect("the probe failed");
        assert_eq!(again, routing.eject_base * 2);
        h.eject(due, again, Ejection::Consecutive(4));
        // The next probe succeeds: restored, and the doubling starts over.
        let due = due + again;
        h.dispatched(due, run(5));
        assert_eq!(
            h.success(due, run(5), Duration::from_millis(50), &routing),
            Passed::Restored(Ejection::Consecutive(4))
        );
        assert_eq!(h.standing(due), Standing::Live);
        for n in 6..9 {
            let _ = h.failure(due, run(n), &routing);
        }
        assert_eq!(
            h.failure(due, run(9), &routing).map(|p| p.0),
            Some(routing.eject_base)
        );
    }

    #[test]
    fn a_failure_share_proposes_an_ejection_and_successes_between_do_not_hide_it() {
        let routing = Routing::default();
        let mut h = Health::default();
        let mut proposed = None;
        for n in 0..20u64 {
            let failed = n % 2 == 0;
            proposed = if failed {
                h.failure(at(n * 100), run(n), &routing)
            } else {
                h.success(at(n * 100), run(n), Duration::ZERO, &routing);
                None
            }
            .or(proposed);
        }
        assert!(
            matches!(proposed, Some((_, Ejection::FailureRate(p))) if p >= 50),
            "{proposed:?}"
        );
    }

    #[test]
    fn a_failure_puts_it_on_trial_one_request_at_a_time_until_a_success() {
        let routing = Routing::default();
        let mut h = Health::default();
        h.dispatched(at(0), run(1));
        h.dispatched(at(0), run(2));
        assert!(h.pickable(at(0)), "healthy: any number in flight");
        assert_eq!(h.failure(at(1), run(1), &routing), None);
        // On trial: one request, and nothing more until it is decided.
        assert!(h.pickable(at(1)));
        h.dispatched(at(1), run(3));
        assert!(!h.pickable(at(1)));
        // An older request ending says nothing of the trial slot.
        assert!(!h.undecided(run(2)));
        assert!(!h.pickable(at(2)));
        // The trial's caller left: the slot is free for the next one.
        assert!(h.undecided(run(3)));
        h.dispatched(at(3), run(4));
        assert!(!h.pickable(at(3)));
        assert_eq!(
            h.success(at(4), run(4), Duration::from_millis(10), &routing),
            Passed::Trial
        );
        h.dispatched(at(4), run(5));
        h.dispatched(at(4), run(6));
        assert!(h.pickable(at(4)), "a success ends the trial");
    }

    #[test]
    fn cost_weighs_load_by_latency() {
        let routing = Routing::default();
        let mut fast = Health::default();
        let mut slow = Health::default();
        fast.success(at(0), run(1), Duration::from_millis(100), &routing);
        slow.success(at(0), run(2), Duration::from_secs(2), &routing);
        assert!(fast.cost(4) < slow.cost(4));
        assert!(fast.cost(1) > fast.cost(2));
        // A slow provider with all its room still beats a fast one that is nearly full.
        assert!(slow.cost(4) < fast.cost(1));
    }
}
