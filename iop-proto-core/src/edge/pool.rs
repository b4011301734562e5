//! Provider pool: resources and their leases, model groups, the wait queue, and picking
//! a candidate.
//!
//! The `Pool` knows capacity and who waits for it; which request a freed unit serves,
//! and what is dispatched there, is decided in `transitions`.

use super::DispatchShape;
use super::EdgeCore;
use crate::idhash::IdMap;
use crate::lease::Generation;
use crate::lease::Lease;
use crate::lease::Ledger;
use crate::lease::Release;
use crate::lease::ResourceId;
use crate::lease::RunId;
use crate::queue::Candidate;
use crate::queue::Ticket;
use crate::queue::WaitQueue;
use crate::queue::Waiter;
use crate::time::Timestamp;
use crate::timer::Wake;
use crate::tunnel::Endpoint;
use std::sync::Arc;
use std::time::Duration;

use super::health::{Ejection, Health, Passed, Standing};
use super::registry::NodeIdx;
use crate::edge_config::Routing;

/// Provider capacity: resources and their leases and health, model groups and the wait
/// queue.
#[derive(Debug, Default)]
pub(crate) struct Pool {
    /// (Crate-visible, as is `queue`: tests read them through `testkit::Inspect`.)
    pub(crate) ledger: Ledger,
    /// What each resource is (a field, so a borrow of it leaves the queue free).
    pub(super) resources: Vec<ResourceMeta>,
    health: Vec<Health>,
    models: IdMap<Arc<str>, Model>,
    pub(crate) queue: WaitQueue,
}

/// An ejection the pool made.
pub(super) struct Ejected {
    pub(super) until: Timestamp,
    pub(super) reason: Ejection,
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
    /// A tunnel-served adapter that serves the Messages API itself (its
    /// `native_messages` option): a Messages request is sent to it as the caller wrote it.
    pub(super) native_messages: bool,
    /// A tunnel-served adapter whose provider tokenizes ([`Endpoint::Tokenize`]).
    pub(super) tokenize: bool,
    /// An adapter that continues a final assistant message exactly (its `resume`
    /// option; vLLM's by default): a lost stream of its shape may be continued on it.
    pub(super) resumes: bool,
}

impl ResourceMeta {
    /// Whether it can answer a call to `endpoint` as it is served now: a run answers
    /// chat only; a tunnel every OpenAI route, and tokenizes when its provider does.
    pub(super) fn serves(&self, endpoint: Endpoint) -> bool {
        match endpoint {
            Endpoint::Chat => true,
            Endpoint::Completions | Endpoint::Embeddings => self.shape == DispatchShape::Tunnel,
            Endpoint::Tokenize => self.shape == DispatchShape::Tunnel && self.tokenize,
        }
    }
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
    /// The model's context window: a prompt estimated past it is refused.
    pub(super) context_tokens: Option<u64>,
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
            context_tokens: None,
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
            native_messages: false,
            tokenize: false,
            resumes: false,
        });
        self.health.push(Health::default());
        r
    }

    pub(super) fn meta(&self, r: ResourceId) -> &ResourceMeta {
        &self.resources[r.index()]
    }

    /// The adapter behind `r` is now configured as `adapter` (a configuration change):
    /// its shape, whether it serves the Messages API itself, whether it tokenizes.
    pub(super) fn set_serving(&mut self, r: ResourceId, adapter: &crate::wire::AdapterConfig) {
        let shape = DispatchShape::for_adapter(adapter);
        let option = |name: &str| adapter.options.get(name).map(String::as_str);
        let tunnel = shape == DispatchShape::Tunnel;
        let meta = &mut self.resources[r.index()];
        meta.shape = shape;
        meta.native_messages =
            tunnel && option(crate::tunnel::Dialect::Messages.option()) == Some("true");
        meta.tokenize = tunnel
            && match option(crate::tunnel::TOKENIZE_OPTION) {
                Some(v) => v == "true",
                None => adapter.r#type == crate::wire::AdapterType::Vllm as i32,
            };
        meta.resumes = match option(crate::tunnel::RESUME_OPTION) {
            Some(v) => v == "true",
            None => adapter.r#type == crate::wire::AdapterType::Vllm as i32,
        };
    }

    /// Units free at `r` (long-context ones for a `long` request).
    pub(super) fn free(&self, r: ResourceId, long: bool) -> u32 {
        self.ledger.free(r, long)
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

    /// The units of `r` that work outside this Edge process holds; whether any came free.
    pub(super) fn set_held(&mut self, r: ResourceId, held: u32, long_held: u32) -> bool {
        self.ledger.set_held(r, held, long_held)
    }

    /// `r`'s node refused work its ledger had room for: its free units are taken until
    /// [`Self::end_refused_hold`]. Whether a hold was made.
    pub(super) fn hold_refused(&mut self, r: ResourceId) -> bool {
        self.ledger.hold_refused(r)
    }

    /// A lease on `r` returned without its node's word: its unit stays taken until
    /// [`Self::end_refused_hold`]. Whether it was held.
    pub(super) fn hold_unconfirmed(&mut self, r: ResourceId) -> bool {
        self.ledger.hold_unconfirmed(r)
    }

    /// `r`'s node freed a unit, or its refusal hold passed: whether units came free.
    pub(super) fn end_refused_hold(&mut self, r: ResourceId) -> bool {
        self.ledger.end_refused_hold(r)
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

    /// Every model group.
    pub(super) fn models(&self) -> impl Iterator<Item = &Model> {
        self.models.values()
    }

    pub(super) fn model(&self, name: &str) -> Option<&Model> {
        self.models.get(name)
    }

    /// Picks among `candidates` (the model's, possibly filtered) one that has room, is in
    /// the rotation (or due its probe, or its trial is free) and whose node is `heard`
    /// (not silent past its heartbeat timeout, a fence its timer has yet to make): the
    /// cheapest by [`Health::cost`] (the most free capacity, weighted by first-byte
    /// latency); ties go round-robin from the model's cursor.
    pub(super) fn pick(
        &mut self,
        now: Timestamp,
        model: &str,
        candidates: &[Candidate],
        long: bool,
        heard: impl Fn(NodeIdx) -> bool,
    ) -> Option<Candidate> {
        let cursor = self.models.get(model)?.cursor;
        let n = candidates.len();
        let mut best: Option<(usize, f64)> = None;
        for step in 0..n {
            let index = (cursor + step) % n;
            let r = candidates[index].resource;
            let free = self.ledger.free(r, long);
            if free == 0
                || !self.health[r.index()].pickable(now)
                || !heard(self.resources[r.index()].node)
            {
                continue;
            }
            let cost = self.health[r.index()].cost(free);
            if best.is_none_or(|(_, c)| cost < c) {
                best = Some((index, cost));
            }
        }
        let (index, _) = best?;
        if let Some(entry) = self.models.get_mut(model) {
            entry.cursor = (index + 1) % n;
        }
        Some(candidates[index].clone())
    }

    // ----- health -----

    /// Whether `r` may be sent a request now (live, or due its probe).
    pub(super) fn pickable(&self, now: Timestamp, r: ResourceId) -> bool {
        self.health[r.index()].pickable(now)
    }

    pub(super) fn standing(&self, now: Timestamp, r: ResourceId) -> Standing {
        self.health[r.index()].standing(now)
    }

    /// Failures in a row, the failure average and the average first-byte latency of `r`.
    pub(super) fn health_figures(
        &self,
        now: Timestamp,
        r: ResourceId,
        routing: &Routing,
    ) -> (u32, f64, Option<f64>) {
        self.health[r.index()].figures(now, routing)
    }

    /// `run` is dispatched to `r` (it may be `r`'s probe).
    pub(super) fn dispatched(&mut self, now: Timestamp, r: ResourceId, run: RunId) {
        self.health[r.index()].dispatched(now, run);
    }

    /// `run` on `r` ended without a verdict on the provider: whether that freed `r`'s
    /// probe slot.
    pub(super) fn undecided(&mut self, r: ResourceId, run: RunId) -> bool {
        self.health[r.index()].undecided(run)
    }

    /// `run` on `r` reached its first byte after `latency`: the ejection it ends, if it
    /// was the probe.
    pub(super) fn succeeded(
        &mut self,
        now: Timestamp,
        routing: &Routing,
        r: ResourceId,
        run: RunId,
        latency: Duration,
    ) -> Passed {
        self.health[r.index()].success(now, run, latency, routing)
    }

    /// `run` on `r` failed before its first byte; `retry_after` is what the provider
    /// asked for. Returns the ejection made, if the failure proposed one and `r`'s model
    /// groups can do without it.
    pub(super) fn failed(
        &mut self,
        now: Timestamp,
        routing: &Routing,
        r: ResourceId,
        run: RunId,
        retry_after: Option<Duration>,
    ) -> Option<Ejected> {
        let was_out = matches!(
            self.health[r.index()].standing(now),
            Standing::Ejected { .. }
        );
        let proposed = self.health[r.index()].failure(now, run, routing);
        if was_out {
            // A request sent before the ejection failed late: it says what the ejection
            // already said (its own `Retry-After` included); the probe decides.
            return None;
        }
        let proposed = match retry_after {
            Some(asked) => {
                let asked = asked.min(routing.retry_after_max);
                match proposed {
                    Some((time, reason)) if time >= asked => Some((time, reason)),
                    _ => Some((asked, Ejection::RetryAfter)),
                }
            }
            None => proposed,
        }?;
        // The caps guard against ejecting on noisy failure rates; a provider that says
        // it is unavailable (`Retry-After`) is taken at its word: requests wait for it
        // (or go elsewhere) rather than receive its refusal.
        if proposed.1 != Ejection::RetryAfter && !self.may_eject(now, routing, r) {
            return None;
        }
        let (time, reason) = proposed;
        self.health[r.index()].eject(now, time, reason);
        Some(Ejected {
            until: now + time,
            reason,
        })
    }

    /// Whether every model group listing `r` keeps a live provider beside it, and stays
    /// within the share of its providers that may be out at once.
    fn may_eject(&self, now: Timestamp, routing: &Routing, r: ResourceId) -> bool {
        self.models.values().all(|model| {
            if !model.candidates.iter().any(|c| c.resource == r) {
                return true;
            }
            let live: Vec<ResourceId> = model
                .candidates
                .iter()
                .map(|c| c.resource)
                .filter(|&c| self.ledger.usage(c).generation.is_some())
                .collect();
            let out = live
                .iter()
                .filter(|&&c| c != r && self.health[c.index()].out(now))
                .count()
                + 1;
            let others_in = live
                .iter()
                .filter(|&&c| c != r && !self.health[c.index()].out(now))
                .count();
            let allowed = (model.candidates.len() * routing.max_ejected_percent as usize) / 100;
            others_in >= 1 && out <= allowed.max(1)
        })
    }

    // ----- the wait queue -----

    /// Requests waiting for `model`.
    pub(super) fn waiting_for(&self, model: &str) -> usize {
        self.queue.waiting_for(model)
    }

    pub(super) fn wait(&mut self, waiter: Waiter) -> Ticket {
        self.queue.push(waiter)
    }

    /// The oldest waiter that `r`'s free capacity can serve, taken out of the queue; none
    /// while `r` is out of the rotation.
    pub(super) fn next_for(&mut self, now: Timestamp, r: ResourceId) -> Option<Waiter> {
        if !self.health[r.index()].pickable(now) {
            return None;
        }
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
    /// Requests waiting in the queue for a provider of model group `model`.
    #[must_use]
    pub fn waiting(&self, model: &str) -> usize {
        self.pool.waiting_for(model)
    }

    /// When the oldest waiter's wait ends.
    pub(super) fn queue_deadline(&self) -> Option<Wake> {
        self.pool.queue.next_deadline().map(|at| Wake {
            at,
            reason: "queue wait",
        })
    }
}
