//! The provider-pool wait queue: requests that found no free capacity among their model
//! group's live candidates wait here, FIFO, until capacity frees or their deadline passes.
//!
//! Every operation is logarithmic in the number of waiters: each resource keeps ordered
//! indexes of the waiters listing it (one lane for short, one for long-context requests),
//! and deadlines are kept in one ordered set. Nothing scans all waiters or all resources.

use std::collections::{BTreeSet, HashMap};

use crate::idhash::IdMap;
use std::sync::Arc;

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
    /// The request; ids increase in submission order, which is the FIFO order.
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

#[derive(Debug, Default)]
struct Lanes {
    short: BTreeSet<RequestId>,
    long: BTreeSet<RequestId>,
}

/// Waiting requests, indexed by candidate resource and by deadline.
#[derive(Debug, Default)]
pub struct WaitQueue {
    waiters: IdMap<RequestId, Waiter>,
    lanes: Vec<Lanes>,
    deadlines: BTreeSet<(Timestamp, RequestId)>,
    per_model: HashMap<Arc<str>, usize>,
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
        self.waiters.len()
    }

    /// True when nobody waits.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    /// Number of requests waiting for `model`.
    #[must_use]
    pub fn waiting_for(&self, model: &str) -> usize {
        self.per_model.get(model).copied().unwrap_or(0)
    }

    /// The waiter for `request`, if it waits.
    #[must_use]
    pub fn get(&self, request: RequestId) -> Option<&Waiter> {
        self.waiters.get(&request)
    }

    /// Adds a waiter. A request id already waiting is replaced.
    pub fn push(&mut self, waiter: Waiter) {
        self.remove(waiter.request);
        for candidate in waiter.candidates.iter() {
            let index = candidate.resource.index();
            if self.lanes.len() <= index {
                self.lanes.resize_with(index + 1, Lanes::default);
            }
            let lanes = &mut self.lanes[index];
            if waiter.long {
                lanes.long.insert(waiter.request);
            } else {
                lanes.short.insert(waiter.request);
            }
        }
        self.deadlines.insert((waiter.deadline, waiter.request));
        *self.per_model.entry(waiter.model.clone()).or_default() += 1;
        self.waiters.insert(waiter.request, waiter);
    }

    /// Removes `request` from the queue, returning its waiter if it was waiting.
    pub fn remove(&mut self, request: RequestId) -> Option<Waiter> {
        let waiter = self.waiters.remove(&request)?;
        for candidate in waiter.candidates.iter() {
            if let Some(lanes) = self.lanes.get_mut(candidate.resource.index()) {
                lanes.short.remove(&request);
                lanes.long.remove(&request);
            }
        }
        self.deadlines.remove(&(waiter.deadline, request));
        if let Some(count) = self.per_model.get_mut(&waiter.model) {
            *count -= 1;
            if *count == 0 {
                self.per_model.remove(&waiter.model);
            }
        }
        Some(waiter)
    }

    /// The oldest request listing `resource` that fits what is free there: any short
    /// request when `short_free`, any long request when `long_free`.
    #[must_use]
    pub fn oldest_fitting(
        &self,
        resource: ResourceId,
        short_free: bool,
        long_free: bool,
    ) -> Option<RequestId> {
        let lanes = self.lanes.get(resource.index())?;
        let short = if short_free {
            lanes.short.first().copied()
        } else {
            None
        };
        let long = if long_free {
            lanes.long.first().copied()
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
        self.lanes.get(resource.index()).map_or((0, 0), |lanes| {
            (lanes.short.len() + lanes.long.len(), lanes.long.len())
        })
    }

    /// The earliest deadline among waiters.
    #[must_use]
    pub fn next_deadline(&self) -> Option<Timestamp> {
        self.deadlines.first().map(|(deadline, _)| *deadline)
    }

    /// Removes and returns one waiter whose deadline is at or before `now`, earliest first.
    pub fn pop_expired(&mut self, now: Timestamp) -> Option<Waiter> {
        let &(deadline, request) = self.deadlines.first()?;
        if deadline > now {
            return None;
        }
        self.remove(request)
    }

    /// Waiting request ids in FIFO order (for inspection and tests; O(n log n)).
    #[must_use]
    pub fn ids(&self) -> Vec<RequestId> {
        let mut ids: Vec<_> = self.waiters.keys().copied().collect();
        ids.sort_unstable();
        ids
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

    #[test]
    fn oldest_fitting_respects_fifo_and_kind() {
        let mut q = WaitQueue::new();
        q.push(waiter(1, true, &[0, 1], 100));
        q.push(waiter(2, false, &[0], 100));
        q.push(waiter(3, false, &[1], 100));
        let r0 = ResourceId(0);
        assert_eq!(q.oldest_fitting(r0, true, true), Some(RequestId(1)));
        assert_eq!(q.oldest_fitting(r0, true, false), Some(RequestId(2)));
        assert_eq!(q.oldest_fitting(r0, false, false), None);
        assert_eq!(q.queued_at(r0), (2, 1));
        assert_eq!(q.queued_at(ResourceId(1)), (2, 1));
        assert_eq!(q.queued_at(ResourceId(7)), (0, 0));
        assert_eq!(q.waiting_for("m"), 3);
        q.remove(RequestId(1));
        assert_eq!(
            q.oldest_fitting(ResourceId(1), true, true),
            Some(RequestId(3))
        );
        assert_eq!(q.queued_at(r0), (1, 0));
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
    }
}
