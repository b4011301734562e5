//! The provider-pool wait queue: requests that found no free capacity among their model
//! group's live candidates wait here, FIFO, until capacity frees or their deadline passes.
//!
//! The cost of every operation stays flat as the queue grows (amortised O(1), O(log n)
//! for a deadline earlier than one already queued, which only a shortened wait timeout
//! causes), and so does the memory each operation touches:
//! - a [`Ticket`] is the waiter's arrival sequence number, which orders the queue;
//! - waiters live in a ring indexed by arrival, so the oldest waiters (the ones expiry
//!   and grants take) sit together at its front and new ones are appended at its back.
//!   A waiter that stays while many newer ones come and go is moved out of the ring
//!   into a side table, so the ring stays within a constant factor of the live waiters;
//! - whether a ticket still waits is one bit in a bitmap indexed by arrival sequence,
//!   from the oldest waiter to the newest; the bitmap stays in the fastest cache even at
//!   100,000 waiters, so skipping removed tickets never touches the waiters themselves;
//! - each resource keeps FIFO lanes of the tickets listing it (short and long-context).
//!   A removal does not touch the lanes: removed tickets are skipped when a lane's front
//!   is read, and a lane is compacted when it grows while removed tickets outnumber live
//!   ones, so lanes stay proportional to their live waiters. The per-resource counts of
//!   live waiters sit in their own small table;
//! - deadlines follow arrival while the wait timeout stays the same, so they are appended
//!   to a deque; one earlier than the deque's last goes to an ordered set instead, and
//!   expiry takes the earlier of the two fronts.
//!
//! Nothing scans all waiters or all resources.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;

use crate::idhash::IdMap;
use crate::lease::{RequestId, ResourceId};
use crate::time::Timestamp;

/// One provider candidate of a model group: a resource and the provider-side target name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// The resource (node and adapter instance).
    pub resource: ResourceId,
    /// The model name the provider knows.
    pub target: Arc<str>,
}

/// A waiting request.
#[derive(Clone, Debug)]
pub struct Waiter {
    /// The waiting request.
    pub request: RequestId,
    /// The public model name it asked for.
    pub model: Arc<str>,
    /// Whether it needs long-context capacity.
    pub long: bool,
    /// Its model group's candidates at submission time.
    pub candidates: Arc<[Candidate]>,
    /// When it gives up.
    pub deadline: Timestamp,
}

/// A waiter's place in the queue. Tickets order by arrival (the FIFO order); a ticket
/// of a removed waiter never matches a later one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket {
    seq: u64,
}

/// The set of arrival sequence numbers still waiting: one bit each, from the word holding
/// the oldest waiter to the word holding the newest. Memory is one bit per arrival since
/// the oldest waiter came, which the wait timeout bounds.
#[derive(Debug, Default)]
struct LiveBits {
    words: VecDeque<u64>,
    /// `words[0]` covers sequence numbers `64 * base ..= 64 * base + 63`.
    base: u64,
}

impl LiveBits {
    /// Marks `seq`, which is above every sequence number marked before.
    fn insert(&mut self, seq: u64) {
        let word = seq / 64;
        if self.words.is_empty() {
            self.base = word;
        }
        let index = usize::try_from(word - self.base).expect("span fits in memory");
        if index >= self.words.len() {
            self.words.resize(index + 1, 0);
        }
        self.words[index] |= 1 << (seq % 64);
    }

    fn contains(&self, seq: u64) -> bool {
        let Some(index) = (seq / 64).checked_sub(self.base) else {
            return false;
        };
        usize::try_from(index)
            .ok()
            .and_then(|index| self.words.get(index))
            .is_some_and(|word| word >> (seq % 64) & 1 == 1)
    }

    /// Clears `seq`; returns whether it was marked.
    fn remove(&mut self, seq: u64) -> bool {
        if !self.contains(seq) {
            return false;
        }
        let index = usize::try_from(seq / 64 - self.base).expect("checked by contains");
        self.words[index] &= !(1 << (seq % 64));
        while self.words.front() == Some(&0) {
            self.words.pop_front();
            self.base += 1;
        }
        true
    }
}

/// Tickets listing one resource, in arrival order, removed ones included until skipped.
#[derive(Debug, Default)]
struct Lanes {
    short: VecDeque<Ticket>,
    long: VecDeque<Ticket>,
}

/// The ring may span up to `RING_FACTOR` times the waiters it holds, plus a slack
/// (`RING_SLACK` unless set otherwise), before long-staying waiters move out. FIFO
/// traffic in which grants take waiters from the middle leaves about half the ring
/// removed; a factor of 4 keeps such waiters in it.
const RING_FACTOR: usize = 4;
const RING_SLACK: usize = 1024;

/// Live waiters listing one resource: `[short, long]`.
type Counts = [u32; 2];

/// Waiting requests, indexed by candidate resource and by deadline.
#[derive(Debug)]
pub struct WaitQueue {
    /// `ring[i]` holds the waiter with sequence number `ring_base + i`, `None` once it
    /// left. Its front entry is always live.
    ring: VecDeque<Option<Waiter>>,
    ring_base: u64,
    /// Waiters older than `ring_base`, moved out of the ring to keep it compact.
    stragglers: IdMap<u64, Waiter>,
    ring_slack: usize,
    next_seq: u64,
    len: usize,
    live: LiveBits,
    lanes: Vec<Lanes>,
    counts: Vec<Counts>,
    /// Sorted by deadline, then ticket; its front is always live, other entries of
    /// removed waiters are dropped lazily.
    deadlines: VecDeque<(Timestamp, Ticket)>,
    /// Deadlines that arrived earlier than the deque's last; same rules.
    early: BTreeSet<(Timestamp, Ticket)>,
    per_model: IdMap<Arc<str>, usize>,
}

impl Default for WaitQueue {
    fn default() -> Self {
        Self::new()
    }
}

impl WaitQueue {
    /// An empty queue.
    #[must_use]
    pub fn new() -> Self {
        Self::with_ring_slack(RING_SLACK)
    }

    /// An empty queue whose ring may hold `slack` removed entries beyond four times its
    /// waiters before long-staying waiters move out of it ([`WaitQueue::new`] uses 1,024).
    /// Behaviour is the same for every value; small ones exercise the move in tests.
    #[must_use]
    pub fn with_ring_slack(slack: usize) -> Self {
        Self {
            ring: VecDeque::new(),
            ring_base: 0,
            stragglers: IdMap::default(),
            ring_slack: slack,
            next_seq: 0,
            len: 0,
            live: LiveBits::default(),
            lanes: Vec::new(),
            counts: Vec::new(),
            deadlines: VecDeque::new(),
            early: BTreeSet::new(),
            per_model: IdMap::default(),
        }
    }

    /// Number of waiting requests.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nobody waits.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of requests waiting for `model`.
    #[must_use]
    pub fn waiting_for(&self, model: &str) -> usize {
        self.per_model.get(model).copied().unwrap_or(0)
    }

    /// The waiter holding `ticket`, if it still waits.
    #[must_use]
    pub fn get(&self, ticket: Ticket) -> Option<&Waiter> {
        if !self.live.contains(ticket.seq) {
            return None;
        }
        match ticket.seq.checked_sub(self.ring_base) {
            Some(index) => self.ring.get(usize::try_from(index).ok()?)?.as_ref(),
            None => self.stragglers.get(&ticket.seq),
        }
    }

    /// Waiting requests in FIFO order (for inspection and tests; O(n log n)).
    #[must_use]
    pub fn waiters(&self) -> Vec<&Waiter> {
        let mut old: Vec<(&u64, &Waiter)> = self.stragglers.iter().collect();
        old.sort_unstable_by_key(|(seq, _)| **seq);
        old.into_iter()
            .map(|(_, w)| w)
            .chain(self.ring.iter().flatten())
            .collect()
    }

    /// Waiting request ids in FIFO order.
    #[must_use]
    pub fn ids(&self) -> Vec<RequestId> {
        self.waiters().into_iter().map(|w| w.request).collect()
    }

    /// Adds a waiter at the back of the queue.
    pub fn push(&mut self, waiter: Waiter) -> Ticket {
        let seq = self.next_seq;
        self.next_seq += 1;
        let ticket = Ticket { seq };
        self.live.insert(seq);
        let kind = usize::from(waiter.long);
        for candidate in waiter.candidates.iter() {
            let index = candidate.resource.index();
            if self.lanes.len() <= index {
                self.lanes.resize_with(index + 1, Lanes::default);
                self.counts.resize(index + 1, [0, 0]);
            }
            let count = &mut self.counts[index][kind];
            let live = *count as usize;
            *count += 1;
            let lanes = &mut self.lanes[index];
            let lane = if waiter.long {
                &mut lanes.long
            } else {
                &mut lanes.short
            };
            // Removed tickets outnumber live ones: drop them (amortised against the
            // removals that left them), so the lane stays proportional to its waiters.
            if lane.len() > 2 * live + 16 {
                let bits = &self.live;
                lane.retain(|t| bits.contains(t.seq));
            }
            lane.push_back(ticket);
        }
        let entry = (waiter.deadline, ticket);
        match self.deadlines.back() {
            // Only after the wait timeout was shortened.
            Some(last) if *last > entry => {
                self.early.insert(entry);
                if self.early.len() > 2 * self.len + 16 {
                    let bits = &self.live;
                    self.early.retain(|(_, t)| bits.contains(t.seq));
                }
            }
            _ => self.deadlines.push_back(entry),
        }
        if self.deadlines.len() > 2 * self.len + 16 {
            let bits = &self.live;
            self.deadlines.retain(|(_, t)| bits.contains(t.seq));
        }
        *self.per_model.entry(waiter.model.clone()).or_default() += 1;
        if self.ring.is_empty() {
            self.ring_base = seq;
        }
        self.ring.push_back(Some(waiter));
        self.len += 1;
        self.shrink_ring();
        ticket
    }

    /// Removes the waiter holding `ticket`, returning it if it was waiting.
    pub fn remove(&mut self, ticket: Ticket) -> Option<Waiter> {
        if !self.live.remove(ticket.seq) {
            return None;
        }
        let waiter = match ticket.seq.checked_sub(self.ring_base) {
            Some(index) => {
                let waiter = self.ring.get_mut(usize::try_from(index).ok()?)?.take()?;
                while self.ring.front().is_some_and(Option::is_none) {
                    self.ring.pop_front();
                    self.ring_base += 1;
                }
                waiter
            }
            None => self.stragglers.remove(&ticket.seq)?,
        };
        self.len -= 1;
        let kind = usize::from(waiter.long);
        for candidate in waiter.candidates.iter() {
            let index = candidate.resource.index();
            let count = &mut self.counts[index][kind];
            *count -= 1;
            if *count == 0 {
                // Nobody of this kind waits here any more: free the lane's tickets now
                // rather than when it is next used.
                let lanes = &mut self.lanes[index];
                if waiter.long {
                    lanes.long.clear();
                } else {
                    lanes.short.clear();
                }
            }
        }
        while self
            .deadlines
            .front()
            .is_some_and(|(_, t)| !self.live.contains(t.seq))
        {
            self.deadlines.pop_front();
        }
        while self
            .early
            .first()
            .is_some_and(|(_, t)| !self.live.contains(t.seq))
        {
            self.early.pop_first();
        }
        if let Some(count) = self.per_model.get_mut(&waiter.model) {
            *count -= 1;
            if *count == 0 {
                self.per_model.remove(&waiter.model);
            }
        }
        Some(waiter)
    }

    /// Keeps the ring within a constant factor of the waiters it holds: while it spans
    /// more than `RING_FACTOR` times those waiters plus the slack, its front entries
    /// leave it, removed ones dropped and live ones (long-staying waiters that removed
    /// entries pile up behind) moved to the side table. Every entry leaves the ring once,
    /// so this is amortised O(1) per push.
    fn shrink_ring(&mut self) {
        let in_ring = self.len - self.stragglers.len();
        while self.ring.len() > RING_FACTOR * in_ring + self.ring_slack {
            let Some(front) = self.ring.pop_front() else {
                break;
            };
            if let Some(waiter) = front {
                self.stragglers.insert(self.ring_base, waiter);
            }
            self.ring_base += 1;
        }
        while self.ring.front().is_some_and(Option::is_none) {
            self.ring.pop_front();
            self.ring_base += 1;
        }
    }

    /// The oldest waiter listing `resource` that fits what is free there: any short
    /// request when `short_free`, any long request when `long_free`. Drops the removed
    /// tickets it finds at the front of the lanes it reads.
    pub fn oldest_fitting(
        &mut self,
        resource: ResourceId,
        short_free: bool,
        long_free: bool,
    ) -> Option<Ticket> {
        let lanes = self.lanes.get_mut(resource.index())?;
        let live = &self.live;
        let front = |lane: &mut VecDeque<Ticket>| {
            while let Some(&ticket) = lane.front() {
                if live.contains(ticket.seq) {
                    return Some(ticket);
                }
                lane.pop_front();
            }
            None
        };
        let short = if short_free {
            front(&mut lanes.short)
        } else {
            None
        };
        let long = if long_free {
            front(&mut lanes.long)
        } else {
            None
        };
        match (short, long) {
            (Some(s), Some(l)) => Some(s.min(l)),
            (s, l) => s.or(l),
        }
    }

    /// `(queued, long_queued)` for `resource`: unique waiters listing it as a candidate.
    #[must_use]
    pub fn queued_at(&self, resource: ResourceId) -> (usize, usize) {
        self.counts
            .get(resource.index())
            .map_or((0, 0), |&[short, long]| {
                ((short + long) as usize, long as usize)
            })
    }

    /// The earliest deadline among waiters.
    #[must_use]
    pub fn next_deadline(&self) -> Option<Timestamp> {
        self.earliest().map(|(deadline, _)| deadline)
    }

    /// The earliest `(deadline, ticket)`; both fronts are always live.
    fn earliest(&self) -> Option<(Timestamp, Ticket)> {
        match (self.deadlines.front(), self.early.first()) {
            (Some(&a), Some(&b)) => Some(a.min(b)),
            (a, b) => a.or(b).copied(),
        }
    }

    /// Removes and returns one waiter whose deadline is at or before `now`, earliest first.
    pub fn pop_expired(&mut self, now: Timestamp) -> Option<Waiter> {
        let (deadline, ticket) = self.earliest()?;
        if deadline > now {
            return None;
        }
        self.remove(ticket)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidates(resources: &[u32]) -> Arc<[Candidate]> {
        resources
            .iter()
            .map(|&r| Candidate {
                resource: ResourceId(r),
                target: "t".into(),
            })
            .collect()
    }

    fn waiter(id: u64, long: bool, resources: &[u32], deadline: u64) -> Waiter {
        Waiter {
            request: RequestId(id),
            model: "m".into(),
            long,
            candidates: candidates(resources),
            deadline: Timestamp::from_millis(deadline),
        }
    }

    fn oldest(q: &mut WaitQueue, r: ResourceId, short: bool, long: bool) -> Option<RequestId> {
        let ticket = q.oldest_fitting(r, short, long)?;
        q.get(ticket).map(|w| w.request)
    }

    #[test]
    fn oldest_fitting_respects_fifo_and_kind() {
        let mut q = WaitQueue::new();
        let t1 = q.push(waiter(1, true, &[0, 1], 100));
        q.push(waiter(2, false, &[0], 100));
        q.push(waiter(3, false, &[1], 100));
        let r0 = ResourceId(0);
        assert_eq!(oldest(&mut q, r0, true, true), Some(RequestId(1)));
        assert_eq!(oldest(&mut q, r0, true, false), Some(RequestId(2)));
        assert_eq!(q.oldest_fitting(r0, false, false), None);
        assert_eq!(q.queued_at(r0), (2, 1));
        assert_eq!(q.queued_at(ResourceId(1)), (2, 1));
        assert_eq!(q.queued_at(ResourceId(7)), (0, 0));
        assert_eq!(q.waiting_for("m"), 3);
        q.remove(t1);
        assert_eq!(
            oldest(&mut q, ResourceId(1), true, true),
            Some(RequestId(3))
        );
        assert_eq!(q.queued_at(r0), (1, 0));
        assert!(q.remove(t1).is_none(), "a ticket is removed once");
    }

    #[test]
    fn expiry_pops_in_deadline_order_and_only_when_due() {
        let mut q = WaitQueue::new();
        q.push(waiter(1, false, &[0], 300));
        q.push(waiter(2, false, &[0], 100));
        assert_eq!(q.next_deadline(), Some(Timestamp::from_millis(100)));
        assert!(q.pop_expired(Timestamp::from_millis(99)).is_none());
        let expired = q.pop_expired(Timestamp::from_millis(300)).expect("due");
        assert_eq!(expired.request, RequestId(2));
        assert_eq!(
            q.pop_expired(Timestamp::from_millis(300))
                .map(|w| w.request),
            Some(RequestId(1))
        );
        assert!(q.is_empty());
        assert_eq!(q.queued_at(ResourceId(0)), (0, 0));
        assert_eq!(q.waiting_for("m"), 0);
        assert_eq!(q.next_deadline(), None);
    }

    #[test]
    fn lanes_stay_small_when_waiters_leave_through_other_lanes() {
        let mut q = WaitQueue::new();
        // Every waiter lists resources 0 and 1; they all leave through resource 1's lane
        // while the oldest one keeps resource 0's lane from being cleaned at the front.
        let keeper = q.push(waiter(0, false, &[0], 1_000_000));
        for i in 1..10_000u64 {
            q.push(waiter(i, false, &[0, 1], 1_000_000));
            let oldest = q.oldest_fitting(ResourceId(1), true, false).expect("waits");
            q.remove(oldest);
        }
        assert_eq!(q.len(), 1);
        assert_eq!(q.queued_at(ResourceId(0)), (1, 0));
        assert!(q.lanes[0].short.len() < 64, "{}", q.lanes[0].short.len());
        assert!(q.deadlines.len() < 64);
        assert_eq!(q.get(keeper).map(|w| w.request), Some(RequestId(0)));
        // The keeper moved out of the ring rather than holding 10,000 removed entries in
        // it; only the liveness bitmap spans the arrivals since (one bit each).
        assert_eq!(q.stragglers.len(), 1);
        assert!(q.ring.len() <= RING_SLACK, "{}", q.ring.len());
        assert!(q.live.words.len() <= 10_000 / 64 + 2);
        assert_eq!(
            oldest(&mut q, ResourceId(0), true, false),
            Some(RequestId(0))
        );
        let newer = q.push(waiter(10_000, false, &[0], 1_000_000));
        assert_eq!(q.ids(), vec![RequestId(0), RequestId(10_000)]);
        assert_eq!(
            q.pop_expired(Timestamp::from_millis(1_000_000))
                .map(|w| w.request),
            Some(RequestId(0)),
            "the older waiter expires first"
        );
        assert!(q.stragglers.is_empty());
        assert_eq!(
            q.live.words.len(),
            1,
            "the bitmap shrinks behind the oldest"
        );
        assert_eq!(q.get(newer).map(|w| w.request), Some(RequestId(10_000)));
    }

    #[test]
    fn a_shortened_wait_timeout_keeps_expiry_in_deadline_order() {
        let mut q = WaitQueue::new();
        // 1,000 waiters with a long timeout, then 1,000 with a shorter one: the later
        // arrivals expire first, without reordering the long ones.
        for i in 0..1_000u64 {
            q.push(waiter(i, false, &[0], 60_000 + i));
        }
        for i in 0..1_000u64 {
            q.push(waiter(1_000 + i, false, &[0], 5_000 + i));
        }
        assert_eq!(q.early.len(), 1_000);
        assert_eq!(q.next_deadline(), Some(Timestamp::from_millis(5_000)));
        let mut expired = Vec::new();
        while let Some(w) = q.pop_expired(Timestamp::from_millis(u64::MAX)) {
            expired.push(w.request.0);
        }
        let expected: Vec<u64> = (1_000..2_000).chain(0..1_000).collect();
        assert_eq!(expired, expected);
        assert!(q.early.is_empty() && q.deadlines.is_empty());
    }

    #[test]
    fn liveness_bits_follow_the_oldest_waiter() {
        let mut bits = LiveBits::default();
        for seq in 100..400 {
            bits.insert(seq);
        }
        assert!(!bits.contains(99) && bits.contains(100) && bits.contains(399));
        assert!(!bits.contains(400) && !bits.contains(u64::MAX));
        for seq in 100..399 {
            assert!(bits.remove(seq));
        }
        assert!(!bits.remove(100), "removed once");
        assert_eq!(bits.words.len(), 1, "only the word of the last one is kept");
        assert!(bits.remove(399));
        assert!(bits.words.is_empty());
        bits.insert(10_000);
        assert!(bits.contains(10_000) && !bits.contains(399));
    }
}
