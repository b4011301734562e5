//! Provider pool: resources and their leases, model groups, the wait queue, picking a
//! candidate, granting and pumping waiters.

use super::*;

/// Provider capacity: resources and their leases, model groups and the wait queue.
#[derive(Debug, Default)]
pub(super) struct Pool {
    pub(super) ledger: Ledger,
    pub(super) resources: Vec<ResourceMeta>,
    pub(super) models: IdMap<Arc<str>, Model>,
    pub(super) queue: WaitQueue,
}

#[derive(Debug)]
pub(super) struct ResourceMeta {
    pub(super) node: usize,
    pub(super) provider_id: Arc<str>,
}

#[derive(Debug)]
pub(super) struct Model {
    pub(super) candidates: Arc<[Candidate]>,
    pub(super) long_threshold: Option<u64>,
    pub(super) long_possible: bool,
    pub(super) cursor: usize,
}

impl EdgeCore {
    /// One snapshot per configured provider, in node id then configuration order.
    /// Providers of offline or pending nodes are listed `UNAVAILABLE`/`OFFLINE` with every
    /// figure 0; disabled ones `DISABLED`/`OFFLINE` with every figure 0.
    #[must_use]
    pub fn snapshots(&self) -> Vec<ProviderSnapshot> {
        let mut order: Vec<usize> = (0..self.registry.nodes.len())
            .filter(|&i| self.registry.nodes[i].spec.is_some())
            .collect();
        order.sort_by(|&a, &b| self.registry.nodes[a].id.cmp(&self.registry.nodes[b].id));
        let mut out = Vec::new();
        for i in order {
            self.push_snapshots(i, &mut out);
        }
        out
    }

    /// The snapshots of one node's providers (none for an unknown node).
    pub(super) fn node_snapshots(&self, node_id: &str) -> Vec<ProviderSnapshot> {
        let mut out = Vec::new();
        if let Some(&i) = self.registry.node_index.get(node_id) {
            self.push_snapshots(i, &mut out);
        }
        out
    }

    fn push_snapshots(&self, i: usize, out: &mut Vec<ProviderSnapshot>) {
        let node = &self.registry.nodes[i];
        let Some(spec) = &node.spec else { return };
        let ready = node.owner.is_some_and(|o| o.ready);
        for adapter in &spec.adapters {
            let name = adapter.instance_name();
            let kind = AdapterType::try_from(adapter.r#type).unwrap_or_default();
            let mut snap = ProviderSnapshot {
                node_id: node.id.to_string(),
                provider_id: name.to_owned(),
                category: category_of(kind) as i32,
                status: ProviderStatus::Unavailable as i32,
                health: ProviderHealth::Offline as i32,
                targets: adapter.targets.clone(),
                ..ProviderSnapshot::default()
            };
            let resource = self.resource(&node.id, name);
            let usage = resource
                .map(|r| self.pool.ledger.usage(r))
                .unwrap_or_default();
            if !adapter.enabled {
                snap.status = ProviderStatus::Disabled as i32;
            } else if ready && usage.generation.is_some() {
                let (queued, long_queued) =
                    resource.map_or((0, 0), |r| self.pool.queue.queued_at(r));
                snap.status = ProviderStatus::Available as i32;
                snap.health = ProviderHealth::Healthy as i32;
                snap.capacity = usage.capacity;
                snap.long_capacity = usage.long_capacity;
                snap.in_flight = usage.in_flight;
                snap.long_in_flight = usage.long_in_flight;
                snap.queued = u32::try_from(queued).unwrap_or(u32::MAX);
                snap.long_queued = u32::try_from(long_queued).unwrap_or(u32::MAX);
            }
            out.push(snap);
        }
    }

    /// Picks the live candidate with the most free capacity; ties go round-robin.
    /// Picks among `candidates` (the model's, possibly filtered) the live one with the
    /// most free capacity; ties go round-robin from the model's cursor.
    pub(super) fn pick_candidate(
        &mut self,
        model: &str,
        candidates: &[Candidate],
        long: bool,
    ) -> Option<Candidate> {
        let cursor = self.pool.models.get(model)?.cursor;
        let n = candidates.len();
        let mut best: Option<(usize, u32)> = None;
        for step in 0..n {
            let index = (cursor + step) % n;
            let free = self.pool.ledger.free(candidates[index].resource, long);
            if free > 0 && best.is_none_or(|(_, f)| free > f) {
                best = Some((index, free));
            }
        }
        let (index, _) = best?;
        if let Some(entry) = self.pool.models.get_mut(model) {
            entry.cursor = (index + 1) % n;
        }
        Some(candidates[index].clone())
    }

    /// The message shape a resource is dispatched with.
    pub(super) fn shape_of(&self, resource: ResourceId) -> DispatchShape {
        let meta = &self.pool.resources[resource.index()];
        self.registry.nodes[meta.node]
            .spec
            .as_ref()
            .and_then(|s| s.adapter(&meta.provider_id))
            .map_or(DispatchShape::Run, DispatchShape::for_adapter)
    }

    pub(super) fn grant(
        &mut self,
        request: RequestId,
        model: &Arc<str>,
        candidate: &Candidate,
        long: bool,
    ) {
        let Some(lease) = self
            .pool
            .ledger
            .try_acquire(candidate.resource, request, long)
        else {
            unreachable!("grant without free capacity");
        };
        let meta = &self.pool.resources[candidate.resource.index()];
        let node = &self.registry.nodes[meta.node];
        let Some(owner) = node.owner.filter(|o| o.ready) else {
            unreachable!("live resource on a node that is not ready");
        };
        let shape = self.shape_of(candidate.resource);
        self.requests.insert(
            request,
            ReqState::Granted {
                lease,
                conn: owner.conn,
                shape,
                target: candidate.target.clone(),
            },
        );
        self.out.events.push_back(EdgeEvent::Granted(Grant {
            request,
            lease,
            model: model.clone(),
            node_id: node.id.clone(),
            provider_id: meta.provider_id.clone(),
            target: candidate.target.clone(),
            shape,
        }));
    }

    /// Serves waiters listing `resource` while it has free capacity, oldest first.
    pub(super) fn pump(&mut self, resource: ResourceId) {
        loop {
            let short_free = self.pool.ledger.free(resource, false) > 0;
            let long_free = self.pool.ledger.free(resource, true) > 0;
            let Some(ticket) = self
                .pool
                .queue
                .oldest_fitting(resource, short_free, long_free)
            else {
                return;
            };
            let Some(waiter) = self.pool.queue.remove(ticket) else {
                return;
            };
            let request = waiter.request;
            let tunnel_only = matches!(
                self.requests.get(&request),
                Some(ReqState::Waiting {
                    tunnel_only: true,
                    ..
                })
            );
            #[cfg(feature = "testkit")]
            let tunnel_only = tunnel_only && !self.faults.ignore_tunnel_only;
            if tunnel_only && self.shape_of(resource) != DispatchShape::Tunnel {
                self.requeue_for_tunnel(waiter);
                continue;
            }
            let Some(candidate) = waiter
                .candidates
                .iter()
                .find(|c| c.resource == resource)
                .cloned()
            else {
                return;
            };
            self.grant(request, &waiter.model, &candidate, waiter.long);
        }
    }

    /// A tunnel-only waiter reached a provider that no longer tunnels (a configuration
    /// refresh changed its adapter while the request waited). It goes on with its
    /// candidates that still tunnel: granted at once where one has room, otherwise
    /// queued again, behind, with its deadline kept; with none left it fails.
    pub(super) fn requeue_for_tunnel(&mut self, waiter: Waiter) {
        let request = waiter.request;
        let candidates: Arc<[Candidate]> = waiter
            .candidates
            .iter()
            .filter(|c| self.shape_of(c.resource) == DispatchShape::Tunnel)
            .cloned()
            .collect();
        if candidates.is_empty() {
            self.requests.remove(&request);
            self.out.events.push_back(EdgeEvent::RequestEnded {
                request,
                outcome: Outcome::Failed(RequestError::Unsupported {
                    model: waiter.model.clone(),
                }),
            });
            return;
        }
        if let Some(candidate) = self.pick_candidate(&waiter.model, &candidates, waiter.long) {
            self.grant(request, &waiter.model, &candidate, waiter.long);
            return;
        }
        let ticket = self.pool.queue.push(Waiter {
            candidates,
            ..waiter
        });
        self.requests.insert(
            request,
            ReqState::Waiting {
                ticket,
                tunnel_only: true,
            },
        );
    }

    pub(super) fn release(&mut self, lease: Lease) {
        self.timers.stop(TimerKey::CancelGrace(lease.request));
        #[cfg(feature = "testkit")]
        if self.faults.double_release {
            let _ = self.pool.ledger.release(lease);
        }
        if self.pool.ledger.release(lease) == Release::Released {
            self.pump(lease.resource);
            let node = self.pool.resources[lease.resource.index()].node;
            self.close_if_drained(node);
        }
    }
}
