//! The invariants checked after every step, and the quiescence at the end.

use super::*;
use iop_proto_core::RequestId;
use iop_proto_core::edge::NodeState;
use iop_proto_core::testkit::Inspect;
use std::time::Duration;

impl World {
    pub(super) fn check_invariants(&mut self) {
        if self.failure.is_some() {
            return;
        }
        let ledger = self.edge.ledger();
        let mut held = 0usize;
        let nodes = self.edge.nodes();
        let snapshots = self.edge.snapshots();
        let mut problems = Vec::new();
        for snap in &snapshots {
            let Some(r) = self.edge.resource(&snap.node_id, &snap.provider_id) else {
                continue;
            };
            let usage = ledger.usage(r);
            held += usage.in_flight as usize;
            // A draining node keeps its leases at capacity 0 (a grant there fails the
            // grant check).
            let draining = nodes
                .iter()
                .any(|n| n.draining && *n.node_id == *snap.node_id);
            if usage.in_flight > usage.capacity && usage.generation.is_some() && !draining {
                problems.push(format!(
                    "{}/{}: in_flight {} > capacity {}",
                    snap.node_id, snap.provider_id, usage.in_flight, usage.capacity
                ));
            }
            if usage.long_in_flight > usage.long_capacity && usage.generation.is_some() && !draining
            {
                problems.push(format!(
                    "{}/{}: long_in_flight over long capacity",
                    snap.node_id, snap.provider_id
                ));
            }
            let ready = nodes
                .iter()
                .any(|n| *n.node_id == snap.node_id && n.state == NodeState::Ready);
            if ready {
                let (queued, _) = self.edge.queue().queued_at(r);
                if snap.in_flight != usage.in_flight || snap.queued as usize != queued {
                    problems.push(format!(
                        "snapshot of {}/{} disagrees with the ledger",
                        snap.node_id, snap.provider_id
                    ));
                }
            } else if usage.in_flight != 0 || snap.in_flight != 0 || snap.capacity != 0 {
                problems.push(format!(
                    "{}/{} holds leases or capacity while its node is not ready",
                    snap.node_id, snap.provider_id
                ));
            }
        }
        if held != ledger.leases_held() {
            problems.push(format!(
                "ledger holds {} leases but resources count {held}",
                ledger.leases_held()
            ));
        }
        // No waiter waits while one of its candidates has room for it.
        for w in self.edge.queue().waiters() {
            if w.candidates
                .iter()
                .any(|c| ledger.free(c.resource, w.long) > 0 && self.edge.pickable(c.resource))
            {
                problems.push(format!(
                    "{} waits while a candidate has free capacity",
                    w.request
                ));
                break;
            }
        }
        // A dispatch after the first byte is a continuation the Edge announced.
        if let Some(run) = self.clients.values().find_map(|c| c.unannounced.clone()) {
            problems.push(format!(
                "{run} dispatched after its request's first byte reached the caller"
            ));
        }
        // Every request ends, at the latest when its client gives up.
        let grace = timing().heartbeat_timeout;
        for (request, client) in &self.clients {
            if !client.ended && self.now > client.deadline + grace {
                problems.push(format!(
                    "{request} still open {} past its deadline",
                    self.now
                        .saturating_duration_since(client.deadline)
                        .as_millis()
                ));
                break;
            }
        }
        if let Some(p) = problems.into_iter().next() {
            self.failure = Some(p);
        }
    }

    /// Load stops and faults heal: everything must end and every lease come back.
    pub(super) fn quiesce(&mut self) {
        self.log(|| "quiesce: no more load, faults heal".into());
        self.healed = true;
        let now = self.now;
        for i in 0..self.procs.len() {
            if self.procs[i].impostor || self.procs[i].bad {
                self.procs[i].restart_at = None;
                if self.procs[i].alive {
                    self.crash(i);
                }
                self.procs[i].kill_at = None;
            } else {
                self.procs[i].frozen_until = self.procs[i].frozen_until.min(now);
                self.procs[i].mode = Mode::Normal;
                for w in self.procs[i].work.values_mut() {
                    w.next_at = w.next_at.min(now + Duration::from_millis(5));
                }
                if !self.procs[i].alive
                    && !self.procs[i].retired
                    && self.procs[i].restart_at.is_none()
                {
                    self.procs[i].restart_at = Some(now);
                }
            }
        }
        for link in self.links.values_mut() {
            link.held_until = link.held_until.min(now);
        }
        self.advance(8000);
        if self.failure.is_some() {
            return;
        }
        let open: Vec<_> = self
            .clients
            .iter()
            .filter(|(_, c)| !c.ended)
            .map(|(r, _)| *r)
            .collect();
        check!(self, open.is_empty(), "requests never ended: {open:?}");
        check!(
            self,
            self.edge.ledger().leases_held() == 0,
            "{} leases never returned",
            self.edge.ledger().leases_held()
        );
        check!(
            self,
            self.edge.queue().is_empty(),
            "waiters left in the queue"
        );
        check!(
            self,
            self.edge.open_requests() == 0,
            "{} requests still open in the edge",
            self.edge.open_requests()
        );
        let not_ready: Vec<_> = self
            .edge
            .nodes()
            .into_iter()
            .filter(|n| n.state != NodeState::Ready)
            .map(|n| n.node_id)
            .collect();
        check!(
            self,
            not_ready.is_empty(),
            "nodes not ready after healing: {not_ready:?}"
        );
        if self.failure.is_some() {
            return;
        }
        // Healed, with every provider answering again: a request to any model group
        // ends well (ejections from the faults are over and probed by then).
        let fresh: Vec<RequestId> = (0..MODELS as u8)
            .filter_map(|model| {
                let before = self.stats.requests;
                self.submit(model, false, 4000, None, false);
                (self.stats.requests > before).then(|| {
                    *self
                        .clients
                        .keys()
                        .next_back()
                        .expect("the request just submitted")
                })
            })
            .collect();
        check!(
            self,
            fresh.len() == MODELS,
            "a healed world refused a request"
        );
        let completed = self.stats.completed;
        self.advance(3000);
        let works: Vec<(usize, String, Vec<String>)> = self
            .procs
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.work.is_empty())
            .map(|(i, p)| (i, p.node_id.clone(), p.work.keys().cloned().collect()))
            .collect();
        check!(
            self,
            self.stats.completed == completed + fresh.len() as u64,
            "a healed world did not complete {fresh:?} (work left on the nodes: {works:?})"
        );
    }
}
