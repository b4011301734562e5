//! The Edge's timers: one table, keyed by what each timer is about, and the first-byte
//! deadlines of runs, kept apart because every dispatch has one. What a timer does when
//! it fires is in `transitions` (`EdgeCore::fire`).

use super::ConnId;
use crate::lease::RequestId;
use crate::lease::ResourceId;
use crate::lease::RunId;
use crate::time::Timestamp;
use crate::timer::Wake;
use std::time::Duration;

use std::collections::VecDeque;

use super::registry::NodeIdx;

/// One timer of the Edge, keyed by what it is about; at most one per key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum TimerKey {
    /// A connection must register, then report ready, before this.
    Handshake(ConnId),
    /// A connection that sends nothing until this is lost (re-armed lazily from its
    /// last receive, so a busy connection costs no timer work per frame).
    Liveness(ConnId),
    /// Ping a registered connection.
    Ping(ConnId),
    /// A held refusal of a failed register is sent then (see `Phase::Held`).
    Answer(ConnId),
    /// A node's config refresh must be answered by this.
    Refresh(NodeIdx),
    /// A cancelled run keeps its lease at most until this.
    CancelGrace(RunId),
    /// A node command must be answered by this.
    Command(u64),
    /// An ejected provider may be probed from this instant: waiters are served again.
    Probe(ResourceId),
    /// A provider whose node refused work is taken at most until this (see
    /// [`Usage::refused_hold`](crate::lease::Usage::refused_hold)).
    RefusalHold(ResourceId),
    /// A committed run whose answer can be continued counts as stalled if it sends
    /// nothing until this (re-armed lazily from its last event).
    Stall(RunId),
    /// A request waiting for the provider its conversation is placed on waits for any
    /// from this instant.
    Placed(RequestId),
}

impl crate::timer::TimerKey for TimerKey {
    fn reason(&self) -> &'static str {
        match self {
            TimerKey::Handshake(_) => "handshake",
            TimerKey::Liveness(_) => "liveness",
            TimerKey::Ping(_) => "ping",
            TimerKey::Answer(_) => "held register answer",
            TimerKey::Refresh(_) => "refresh answer",
            TimerKey::CancelGrace(_) => "cancel grace",
            TimerKey::Command(_) => "command answer",
            TimerKey::Probe(_) => "probe",
            TimerKey::RefusalHold(_) => "refusal hold",
            TimerKey::Stall(_) => "stalled stream",
            TimerKey::Placed(_) => "placed wait",
        }
    }
}

/// The first-byte deadlines of runs: a run that has not reached its first byte by its
/// deadline is slow, and another provider may be tried beside it.
///
/// Every dispatch has one and nearly every run beats it, so a deadline costs a push
/// instead of a timer-table entry: one queue per deadline length (the routing default,
/// and the models' own), in dispatch order, so each queue's front is its earliest. A run
/// that reached its first byte is not looked for; it leaves when it comes to the front
/// ([`settle`](Self::settle)), or is skipped when its deadline passes.
#[derive(Debug, Default)]
pub(super) struct Deadlines {
    lanes: Vec<(Duration, VecDeque<(Timestamp, RunId)>)>,
}

impl Deadlines {
    /// `run`, dispatched at `now`, must reach its first byte within `after`.
    pub(super) fn push(&mut self, now: Timestamp, after: Duration, run: RunId) {
        let at = now + after;
        match self.lanes.iter_mut().find(|(d, _)| *d == after) {
            Some((_, lane)) => lane.push_back((at, run)),
            None => self.lanes.push((after, VecDeque::from([(at, run)]))),
        }
    }

    /// The earliest deadline.
    pub(super) fn next(&self) -> Option<Wake> {
        self.lanes
            .iter()
            .filter_map(|(_, lane)| lane.front())
            .map(|&(at, _)| at)
            .min()
            .map(|at| Wake {
                at,
                reason: "first byte",
            })
    }

    /// A run whose deadline has passed at `now`, taken out.
    pub(super) fn pop_due(&mut self, now: Timestamp) -> Option<RunId> {
        let lane = self
            .lanes
            .iter_mut()
            .filter(|(_, lane)| lane.front().is_some_and(|&(at, _)| at <= now))
            .min_by_key(|(_, lane)| lane.front().map(|&(at, _)| at))?;
        let run = lane.1.pop_front().map(|(_, run)| run);
        self.lanes.retain(|(_, lane)| !lane.is_empty());
        run
    }

    /// Takes out the runs at the front of each queue that need no deadline any more
    /// (`done`), so that no wake-up is spent on them.
    pub(super) fn settle(&mut self, mut done: impl FnMut(RunId) -> bool) {
        for (_, lane) in &mut self.lanes {
            while lane.front().is_some_and(|&(_, run)| done(run)) {
                lane.pop_front();
            }
        }
        self.lanes.retain(|(_, lane)| !lane.is_empty());
    }

    /// Runs waiting for their first byte or their turn to leave.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lanes.iter().map(|(_, lane)| lane.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::RequestId;

    fn run(n: u64) -> RunId {
        RunId::first(RequestId(n))
    }

    #[test]
    fn deadlines_come_due_in_order_across_lengths_and_answered_runs_leave_at_the_front() {
        let mut d = Deadlines::default();
        let (short, long) = (Duration::from_secs(1), Duration::from_secs(10));
        d.push(Timestamp::from_millis(0), long, run(1));
        d.push(Timestamp::from_millis(100), short, run(2));
        d.push(Timestamp::from_millis(200), short, run(3));
        assert_eq!(d.next().map(|w| w.at), Some(Timestamp::from_millis(1100)));
        assert_eq!(d.pop_due(Timestamp::from_millis(1099)), None);
        // Run 2 answered: it leaves from the front, so the next wake is run 3's.
        d.settle(|r| r == run(2));
        assert_eq!(d.next().map(|w| w.at), Some(Timestamp::from_millis(1200)));
        // Run 3 did not: it is due, then run 1.
        assert_eq!(d.pop_due(Timestamp::from_millis(20_000)), Some(run(3)));
        assert_eq!(d.pop_due(Timestamp::from_millis(20_000)), Some(run(1)));
        assert_eq!(d.pop_due(Timestamp::from_millis(20_000)), None);
        assert_eq!((d.len(), d.next()), (0, None));
    }
}
