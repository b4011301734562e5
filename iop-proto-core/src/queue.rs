//! The provider-pool wait queue: requests that found no free capacity among their model
//! group's live candidates wait here, FIFO, until capacity frees or their deadline passes.
//!
//! The cost of every operation stays flat as the queue grows (amortised O(1), O(log n)
//! only in the rare case of a deadline earlier than one already queued):
//! - waiters live in a slab (memory proportional to the live waiters) addressed by their
//!   [`Ticket`], which also carries the arrival sequence that orders the queue;
//! - each resource keeps FIFO lanes of the tickets listing it (short and long-context);
//!   a waiter removed through one lane is dropped lazily from the others, and a lane's
//!   front is always live;
//! - deadlines are a sorted deque, normally appended at the back.
//!
//! Nothing scans all waiters or all resources.

use std::collections::VecDeque;
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
    /// The request.
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
    slot: u32,
}

#[derive(Debug)]
struct Slot {
    seq: u64,
    waiter: Option<Waiter>,
}

#[derive(Debug, Default)]
struct Lane {
    tickets: VecDeque<Ticket>,
    live: usize,
}

#[derive(Debug, Default)]
struct Lanes {
    short: Lane,
    long: Lane,
}

/// Waiting requests, indexed by candidate resource and by deadline.
#[derive(Debug, Default)]
pub struct WaitQueue {
    slots: Vec<Slot>,
    free: Vec<u32>,
    next_seq: u64,
    len: usize,
    lanes: Vec<Lanes>,
    /// Sorted by deadline, then ticket; entries of removed waiters are dropped lazily.
    deadlines: VecDeque<(Timestamp, Ticket)>,
    per_model: IdMap<Arc<str>, usize>,
}

impl WaitQueue {
    /// An empty queue.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
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
        let slot = self.slots.get(ticket.slot as usize)?;
        if slot.seq == ticket.seq {
            slot.waiter.as_ref()
        } else {
            None
        }
    }

    fn is_live(&self, ticket: Ticket) -> bool {
        self.get(ticket).is_some()
    }

    /// Waiting requests in FIFO order (for inspection and tests; O(n log n)).
    #[must_use]
    pub fn waiters(&self) -> Vec<&Waiter> {
        let mut live: Vec<(u64, &Waiter)> = self
            .slots
            .iter()
            .filter_map(|s| s.waiter.as_ref().map(|w| (s.seq, w)))
            .collect();
        live.sort_unstable_by_key(|(seq, _)| *seq);
        live.into_iter().map(|(_, w)| w).collect()
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
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(Slot { seq, waiter: None });
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 waiters")
            }
        };
        let ticket = Ticket { seq, slot };
        for candidate in waiter.candidates.iter() {
            let index = candidate.resource.index();
            if self.lanes.len() <= index {
                self.lanes.resize_with(index + 1, Lanes::default);
            }
            let lane = self.lane_mut(candidate.resource, waiter.long);
            lane.tickets.push_back(ticket);
            lane.live += 1;
        }
        let entry = (waiter.deadline, ticket);
        match self.deadlines.back() {
            Some(last) if *last > entry => {
                // Only after the wait timeout was shortened: keep the deque sorted.
                let at = self.deadlines.partition_point(|e| *e < entry);
                self.deadlines.insert(at, entry);
            }
            _ => self.deadlines.push_back(entry),
        }
        *self.per_model.entry(waiter.model.clone()).or_default() += 1;
        self.slots[slot as usize] = Slot {
            seq,
            waiter: Some(waiter),
        };
        self.len += 1;
        ticket
    }

    fn lane_mut(&mut self, resource: ResourceId, long: bool) -> &mut Lane {
        let lanes = &mut self.lanes[resource.index()];
        if long {
            &mut lanes.long
        } else {
            &mut lanes.short
        }
    }

    /// Removes the waiter holding `ticket`, returning it if it was waiting.
    pub fn remove(&mut self, ticket: Ticket) -> Option<Waiter> {
        let slot = self.slots.get_mut(ticket.slot as usize)?;
        if slot.seq != ticket.seq {
            return None;
        }
        let waiter = slot.waiter.take()?;
        self.free.push(ticket.slot);
        self.len -= 1;
        for candidate in waiter.candidates.iter() {
            self.lane_mut(candidate.resource, waiter.long).live -= 1;
            self.clean_lane(candidate.resource, waiter.long);
        }
        self.clean_deadlines();
        if let Some(count) = self.per_model.get_mut(&waiter.model) {
            *count -= 1;
            if *count == 0 {
                self.per_model.remove(&waiter.model);
            }
        }
        Some(waiter)
    }

    /// Drops removed tickets from the front of a lane, and compacts it when removed
    /// tickets outnumber live ones (so memory stays proportional to the live waiters).
    fn clean_lane(&mut self, resource: ResourceId, long: bool) {
        let lanes = &self.lanes[resource.index()];
        let lane = if long { &lanes.long } else { &lanes.short };
        let mut pop = 0;
        while lane.tickets.get(pop).is_some_and(|&t| !self.is_live(t)) {
            pop += 1;
        }
        let compact = lane.tickets.len() - pop > 2 * lane.live + 16;
        let keep: Option<VecDeque<Ticket>> = compact.then(|| {
            lane.tickets
                .iter()
                .copied()
                .filter(|&t| self.is_live(t))
                .collect()
        });
        let lane = self.lane_mut(resource, long);
        match keep {
            Some(tickets) => lane.tickets = tickets,
            None => {
                lane.tickets.drain(..pop);
            }
        }
    }

    fn clean_deadlines(&mut self) {
        while self
            .deadlines
            .front()
            .is_some_and(|&(_, t)| !self.is_live(t))
        {
            self.deadlines.pop_front();
        }
        if self.deadlines.len() > 2 * self.len + 16 {
            let live: VecDeque<_> = self
                .deadlines
                .iter()
                .copied()
                .filter(|&(_, t)| self.is_live(t))
                .collect();
            self.deadlines = live;
        }
    }

    /// The oldest waiter listing `resource` that fits what is free there: any short
    /// request when `short_free`, any long request when `long_free`.
    #[must_use]
    pub fn oldest_fitting(
        &self,
        resource: ResourceId,
        short_free: bool,
        long_free: bool,
    ) -> Option<Ticket> {
        let lanes = self.lanes.get(resource.index())?;
        // Lane fronts are always live (cleaned on every removal).
        let short = short_free
            .then(|| lanes.short.tickets.front().copied())
            .flatten();
        let long = long_free
            .then(|| lanes.long.tickets.front().copied())
            .flatten();
        match (short, long) {
            (Some(s), Some(l)) => Some(s.min(l)),
            (s, l) => s.or(l),
        }
    }

    /// `(queued, long_queued)` for `resource`: unique waiters listing it as a candidate.
    #[must_use]
    pub fn queued_at(&self, resource: ResourceId) -> (usize, usize) {
        self.lanes.get(resource.index()).map_or((0, 0), |lanes| {
            (lanes.short.live + lanes.long.live, lanes.long.live)
        })
    }

    /// The earliest deadline among waiters.
    #[must_use]
    pub fn next_deadline(&self) -> Option<Timestamp> {
        self.deadlines.front().map(|(deadline, _)| *deadline)
    }

    /// Removes and returns one waiter whose deadline is at or before `now`, earliest first.
    pub fn pop_expired(&mut self, now: Timestamp) -> Option<Waiter> {
        let &(deadline, ticket) = self.deadlines.front()?;
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

    fn request(q: &WaitQueue, t: Option<Ticket>) -> Option<RequestId> {
        t.and_then(|t| q.get(t)).map(|w| w.request)
    }

    #[test]
    fn oldest_fitting_respects_fifo_and_kind() {
        let mut q = WaitQueue::new();
        let t1 = q.push(waiter(1, true, &[0, 1], 100));
        q.push(waiter(2, false, &[0], 100));
        q.push(waiter(3, false, &[1], 100));
        let r0 = ResourceId(0);
        assert_eq!(
            request(&q, q.oldest_fitting(r0, true, true)),
            Some(RequestId(1))
        );
        assert_eq!(
            request(&q, q.oldest_fitting(r0, true, false)),
            Some(RequestId(2))
        );
        assert_eq!(q.oldest_fitting(r0, false, false), None);
        assert_eq!(q.queued_at(r0), (2, 1));
        assert_eq!(q.queued_at(ResourceId(1)), (2, 1));
        assert_eq!(q.queued_at(ResourceId(7)), (0, 0));
        assert_eq!(q.waiting_for("m"), 3);
        q.remove(t1);
        assert_eq!(
            request(&q, q.oldest_fitting(ResourceId(1), true, true)),
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
        assert!(
            q.lanes[0].short.tickets.len() < 64,
            "{}",
            q.lanes[0].short.tickets.len()
        );
        assert!(q.deadlines.len() < 64);
        assert_eq!(q.get(keeper).map(|w| w.request), Some(RequestId(0)));
    }
}
