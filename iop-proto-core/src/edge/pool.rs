//! Provider pool: resources and their leases, model groups, the wait queue, and picking
//! a candidate.
//!
//! The `Pool` knows capacity and who waits for it; which request a freed unit serves,
//! and what is dispatched there, is decided in `transitions`.

use super::registry::NodeIdx;
use super::*;

/// Provider capacity: resources and their leases, model groups and the wait queue.
#[derive(Debug, Default)]
pub(super) struct Pool {
    ledger: Ledger,
    resources: Vec<ResourceMeta>,
    models: IdMap<Arc<str>, Model>,
    queue: WaitQueue,
}

/// What the pool keeps of a resource beside its ledger figures.
#[derive(Debug)]
pub(super) struct ResourceMeta {
    /// The node it is on.
    pub(super) node: NodeIdx,
    /// Its adapter instance name.
    pub(super) provider_id: Arc<str>,
    /// The message it is dispatched with (from its adapter's configuration).
    pub(super) shape: DispatchShape,
}

/// A model group.
#[derive(Debug)]
pub(super) struct Model {
    /// Its name, shared by every request for it.
    pub(super) name: Arc<str>,
    /// Its providers, in configuration order (enabled ones only).
    pub(super) candidates: Arc<[Candidate]>,
    /// Estimated prompt tokens from which a request is long-context.
    pub(super) long_threshold: Option<u64>,
    /// Whether any candidate has long-context capacity at all.
    pub(super) long_possible: bool,
    /// Where the next round-robin tie-break starts.
    cursor: usize,
}

impl Model {
    /// A model group of `candidates`.
    pub(super) fn new(
        name: Arc<str>,
        candidates: Arc<[Candidate]>,
        long_threshold: Option<u64>,
        long_possible: bool,
    ) -> Self {
        Model {
            name,
            candidates,
            long_threshold,
            long_possible,
            cursor: 0,
        }
    }
}

impl Pool {
    // ----- resources -----

    /// Adds an offline resource for adapter instance `provider_id` of `node`.
    pub(super) fn add_resource(
        &mut self,
        node: NodeIdx,
        provider_id: Arc<str>,
        shape: DispatchShape,
    ) -> ResourceId {
        let r = self.ledger.add_resource();
        self.resources.push(ResourceMeta {
            node,
            provider_id,
            shape,
        });
        r
    }

    pub(super) fn meta(&self, r: ResourceId) -> &ResourceMeta {
        &self.resources[r.index()]
    }

    /// The adapter behind `r` is now served as `shape` (a configuration change).
    pub(super) fn set_shape(&mut self, r: ResourceId, shape: DispatchShape) {
        self.resources[r.index()].shape = shape;
    }

    pub(super) fn usage(&self, r: ResourceId) -> crate::lease::Usage {
        self.ledger.usage(r)
    }

    /// Brings `r` online for `generation`, or takes its new capacities when it already
    /// is; returns leases of an older generation it had to fence (none, when the
    /// registry fenced that generation first).
    pub(super) fn activate(
        &mut self,
        r: ResourceId,
        generation: Generation,
        capacity: u32,
        long_capacity: u32,
    ) -> Vec<Lease> {
        if self.ledger.usage(r).generation == Some(generation) {
            self.ledger.set_capacity(r, capacity, long_capacity);
            Vec::new()
        } else {
            self.ledger.activate(r, generation, capacity, long_capacity)
        }
    }

    /// `r` takes no new work; what it holds stays held.
    pub(super) fn stop_granting(&mut self, r: ResourceId, generation: Option<Generation>) {
        if generation.is_none() || self.ledger.usage(r).generation == generation {
            self.ledger.set_capacity(r, 0, 0);
        }
    }

    /// Takes `r` offline: every lease it held, each once.
    pub(super) fn fence(&mut self, r: ResourceId) -> Vec<Lease> {
        self.ledger.fence(r)
    }

    /// A lease for `run` on `r`, which must have room.
    pub(super) fn acquire(&mut self, r: ResourceId, run: RunId, long: bool) -> Option<Lease> {
        self.ledger.try_acquire(r, run, long)
    }

    pub(super) fn release(&mut self, lease: Lease) -> Release {
        self.ledger.release(lease)
    }

    /// Leases held on `resources` in `generation`.
    pub(super) fn in_flight(
        &self,
        resources: impl Iterator<Item = ResourceId>,
        generation: Generation,
    ) -> u32 {
        resources
            .map(|r| self.ledger.usage(r))
            .filter(|u| u.generation == Some(generation))
            .map(|u| u.in_flight)
            .sum()
    }

    // ----- model groups -----

    /// Replaces the model groups, keeping each surviving group's round-robin place.
    pub(super) fn install_models(&mut self, models: Vec<Model>) {
        let mut next = IdMap::default();
        for mut model in models {
            if let Some(old) = self.models.get(&model.name) {
                model.cursor = old.cursor;
            }
            next.insert(model.name.clone(), model);
        }
        self.models = next;
    }

    pub(super) fn model(&self, name: &str) -> Option<&Model> {
        self.models.get(name)
    }

    /// Picks among `candidates` (the model's, possibly filtered) the live one with the
    /// most free capacity; ties go round-robin from the model's cursor.
    pub(super) fn pick(
        &mut self,
        model: &str,
        candidates: &[Candidate],
        long: bool,
    ) -> Option<Candidate> {
        let cursor = self.models.get(model)?.cursor;
        let n = candidates.len();
        let mut best: Option<(usize, u32)> = None;
        for step in 0..n {
            let index = (cursor + step) % n;
            let free = self.ledger.free(candidates[index].resource, long);
            if free > 0 && best.is_none_or(|(_, f)| free > f) {
                best = Some((index, free));
            }
        }
        let (index, _) = best?;
        if let Some(entry) = self.models.get_mut(model) {
            entry.cursor = (index + 1) % n;
        }
        Some(candidates[index].clone())
    }

    // ----- the wait queue -----

    /// Requests waiting for `model`.
    pub(super) fn waiting_for(&self, model: &str) -> usize {
        self.queue.waiting_for(model)
    }

    pub(super) fn wait(&mut self, waiter: Waiter) -> Ticket {
        self.queue.push(waiter)
    }

    pub(super) fn unwait(&mut self, ticket: Ticket) -> Option<Waiter> {
        self.queue.remove(ticket)
    }

    /// The oldest waiter that `r`'s free capacity can serve, taken out of the queue.
    pub(super) fn next_for(&mut self, r: ResourceId) -> Option<Waiter> {
        let short_free = self.ledger.free(r, false) > 0;
        let long_free = self.ledger.free(r, true) > 0;
        let ticket = self.queue.oldest_fitting(r, short_free, long_free)?;
        self.queue.remove(ticket)
    }

    /// A waiter whose deadline passed, taken out of the queue.
    pub(super) fn expired(&mut self, now: Timestamp) -> Option<Waiter> {
        self.queue.pop_expired(now)
    }

    /// Unique waiters listing `r` as a live candidate: (all, long-context).
    pub(super) fn queued_at(&self, r: ResourceId) -> (usize, usize) {
        self.queue.queued_at(r)
    }
}

/// The pool's figures, for tests and status pages.
impl EdgeCore {
    /// The lease ledger (read-only).
    #[must_use]
    pub fn ledger(&self) -> &Ledger {
        &self.pool.ledger
    }

    /// The wait queue (read-only).
    #[must_use]
    pub fn queue(&self) -> &WaitQueue {
        &self.pool.queue
    }

    /// When the oldest waiter's wait ends.
    pub(super) fn queue_deadline(&self) -> Option<Wake> {
        self.pool.queue.next_deadline().map(|at| Wake {
            at,
            reason: "queue wait",
        })
    }
}
