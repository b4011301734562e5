//! Edge side of the world: what the simulated Edge shell writes and reads, checked as it leaves and arrives.

use super::*;
use iop_proto_core::RequestId;
use iop_proto_core::edge::RunId;
use iop_proto_core::edge::{
    CloseReason, ConnId, DispatchShape, EdgeCore, EdgeEvent, Outcome, RejectReason, RequestError,
    RequestEvent, Transmit,
};
use iop_proto_core::testkit::Inspect;
use iop_proto_core::testkit::internals::RunTracker;
use iop_proto_core::wire::{Body, Envelope, RunRequest};
use std::sync::Arc;

impl World {
    pub(super) fn drain_edge(&mut self) {
        loop {
            let mut progressed = false;
            let mut closes = Vec::new();
            while let Some(transmit) = self.edge.poll_transmit() {
                progressed = true;
                match transmit {
                    Transmit::Frame { conn, envelope } => self.shell_writes(conn, envelope),
                    Transmit::Tunnel { conn, dispatch } => {
                        let envelope = crate::harness::sent_envelope(&dispatch);
                        self.shell_writes(conn, envelope);
                    }
                    Transmit::FrameLimit {
                        conn,
                        max_frame_len,
                    } => {
                        if let Some(link) = self.links.get_mut(&conn.0) {
                            link.to_edge.set_max_frame_len(max_frame_len);
                        }
                    }
                    Transmit::Close { conn, reason } => {
                        self.log(|| format!("edge closes conn {} ({reason:?})", conn.0));
                        if reason == CloseReason::Drained {
                            self.stats.drained += 1;
                        }
                        if let Some(link) = self.links.get_mut(&conn.0) {
                            link.edge_closed = true;
                        }
                        closes.push((conn, reason));
                    }
                }
            }
            while let Some(event) = self.edge.poll_event() {
                progressed = true;
                self.on_edge_event(event);
            }
            while let Some(lifecycle) = self.edge.poll_lifecycle() {
                progressed = true;
                self.log(|| format!("lifecycle {}", lifecycle.kind()));
            }
            // The shell stops reading a connection it closed and reports it closed.
            for (conn, reason) in closes {
                self.edge_closed(conn, &reason);
            }
            if !progressed {
                return;
            }
        }
    }

    /// The simulated Edge shell writes a frame of the machine's on `conn`: a dispatch is
    /// checked as it leaves (only to its node's ready owner, within capacity, a
    /// tunnel-only request only as a tunnel, nothing after a drain request). The planted
    /// shell bugs act here.
    pub(super) fn shell_writes(&mut self, conn: ConnId, mut envelope: Envelope) {
        if self.faults.tunnel_as_run
            && let Some(Body::ProviderTunnelRequest(tunnel)) = &envelope.body
        {
            envelope.body = Some(Body::RunRequest(RunRequest {
                run_id: tunnel.run_id.clone(),
                adapter: tunnel.adapter.clone(),
                target: tunnel.target.clone(),
                ..RunRequest::default()
            }));
        }
        let work = match &envelope.body {
            Some(Body::RunRequest(run)) => Some((run.run_id.clone(), run.adapter.clone(), true)),
            Some(Body::ProviderTunnelRequest(t)) => {
                Some((t.run_id.clone(), t.adapter.clone(), false))
            }
            _ => None,
        };
        if let Some((run_id, adapter, as_run)) = &work {
            self.check_dispatch(conn, run_id, adapter, *as_run);
            if self.faults.redispatch_after_first_byte
                && let Some(run) = RunId::parse(run_id)
            {
                self.last_dispatch
                    .insert(run.request, (conn, envelope.clone()));
            }
        }
        self.send_to_node(conn, &envelope);
        if work.is_some() && self.faults.dispatch_to_pending {
            // A copy to every connection that registered but is not ready yet.
            let pending: Vec<ConnId> = self
                .links
                .keys()
                .map(|&c| ConnId(c))
                .filter(|&c| c != conn && self.edge.owner_of(c).is_some_and(|o| !o.2))
                .collect();
            for other in pending {
                if let Some((run_id, adapter, as_run)) = &work {
                    self.check_dispatch(other, run_id, adapter, *as_run);
                }
                self.send_to_node(other, &envelope);
            }
        }
    }

    /// Bytes of `request`'s answer reached its caller.
    pub(super) fn first_bytes(&mut self, request: RequestId) {
        let Some(client) = self.clients.get_mut(&request) else {
            return;
        };
        if std::mem::replace(&mut client.got_bytes, true) {
            return;
        }
        // The planted bug: the same request dispatched again, as a new attempt.
        if let Some((conn, mut envelope)) = self.last_dispatch.remove(&request) {
            let again = RunId {
                request,
                attempt: 9,
            }
            .wire();
            match &mut envelope.body {
                Some(Body::RunRequest(run)) => run.run_id = again,
                Some(Body::ProviderTunnelRequest(tunnel)) => tunnel.run_id = again,
                _ => {}
            }
            self.shell_writes(conn, envelope);
        }
    }

    /// A dispatch leaving on `conn`.
    pub(super) fn check_dispatch(
        &mut self,
        conn: ConnId,
        run_id: &str,
        adapter: &str,
        as_run: bool,
    ) {
        check!(
            self,
            !self.drain_read.contains(&conn.0),
            "work dispatched to conn {} after the edge read its drain request",
            conn.0
        );
        let owner = self.edge.owner_of(conn);
        check!(
            self,
            owner.as_ref().is_some_and(|o| o.2),
            "{run_id} dispatched on conn {} which is not its node's ready owner ({owner:?})",
            conn.0
        );
        if let Some((node_id, ..)) = &owner
            && let Some(r) = self.edge.resource(node_id, adapter)
        {
            let usage = self.edge.ledger().usage(r);
            check!(
                self,
                usage.in_flight <= usage.capacity,
                "{run_id} dispatched beyond capacity on {node_id}/{adapter}"
            );
        }
        let tunnel_only = RunId::parse(run_id)
            .and_then(|run| self.clients.get(&run.request))
            .is_some_and(|c| c.tunnel_only);
        check!(
            self,
            !(as_run && tunnel_only),
            "tunnel-only {run_id} dispatched as a run on {adapter}"
        );
        // The rule that bounds a request's dispatches (`EdgeCore::verdict`, README's
        // "Retries"), word for word: "A dispatch is an attempt unless its node refused it
        // before asking its provider. A request has at most `max_attempts` attempts, and
        // at most 8 refusals its Edge's ledger did not explain. After a refusal the
        // ledger counts that provider full until its node reports its load or one
        // heartbeat interval passes, so the request is not dispatched there again before
        // that. A continuation of a stream lost after its first byte counts its attempts
        // afresh." A single Edge's ledger explains a refusal only by what the node
        // reported held elsewhere; the check takes any unit the node freed there (a
        // run's end, a load report, a ready) as leave to go back, and 8 refusals in all.
        let max_attempts = self.edge.config().routing.max_attempts;
        let hold = self.edge.config().timing.heartbeat_interval;
        let Some(run) = RunId::parse(run_id) else {
            return;
        };
        let node_id = owner.map_or_else(|| Arc::from(""), |o| o.0);
        self.dispatched_to
            .insert(run_id.to_owned(), (node_id.clone(), adapter.to_owned()));
        let Some(client) = self.clients.get_mut(&run.request) else {
            return;
        };
        client.dispatches += 1;
        let (dispatches, refusals, got_bytes, client_resumes) = (
            client.dispatches,
            client.refusals,
            client.got_bytes,
            client.resumes,
        );
        let back_too_soon = client.refused.as_ref().is_some_and(|(n, a, at, step)| {
            *n == node_id
                && a == adapter
                && self.now < *at + hold
                && self
                    .freed_at
                    .get(&(node_id.clone(), adapter.to_owned()))
                    .max(self.node_freed_at.get(&node_id))
                    .is_none_or(|freed| freed <= step)
        });
        // After the first byte only a continuation is dispatched: the Edge announces it
        // (`EdgeEvent::Resumed`) in the same step, checked once the step's events are in.
        if got_bytes && let Some(client) = self.clients.get_mut(&run.request) {
            client.unannounced = Some(run_id.to_owned());
        }
        check!(
            self,
            dispatches - refusals <= max_attempts * (1 + client_resumes + u32::from(got_bytes)),
            "{run_id}: {} attempts ({dispatches} dispatches, {refusals} refused), more than \
             {max_attempts}",
            dispatches - refusals
        );
        check!(
            self,
            refusals < 8,
            "{run_id}: dispatched after {refusals} refusals"
        );
        check!(
            self,
            !back_too_soon,
            "{run_id} dispatched to {node_id}/{adapter}, which refused its request, before \
             the node freed a unit there or the hold passed"
        );
    }

    /// The Edge is about to read `envelope` from `conn`: a refusal is counted against its
    /// request, and a unit the node frees is noted by adapter.
    pub(super) fn note_read(&mut self, conn: ConnId, envelope: &Envelope) {
        self.read_count += 1;
        let step = self.read_count;
        let Some((node_id, _, _)) = self.edge.owner_of(conn) else {
            return;
        };
        let (run_id, terminal, refused) = match &envelope.body {
            Some(Body::RunEvent(e)) => (
                &e.run_id,
                terminal_event(e),
                e.error.as_ref().is_some_and(|e| e.code == "refused"),
            ),
            Some(Body::ProviderTunnelFrame(f)) => (
                &f.run_id,
                terminal_frame(f),
                f.error.as_ref().is_some_and(|e| e.code == "refused"),
            ),
            Some(Body::NodeLoadReport(_) | Body::NodeReadyRequest(_)) => {
                self.node_freed_at.insert(node_id, step);
                return;
            }
            _ => return,
        };
        let Some(to) = self.dispatched_to.get(run_id).cloned() else {
            return;
        };
        if terminal && !refused {
            self.freed_at.insert(to.clone(), step);
        }
        if refused
            && let Some(client) =
                RunId::parse(run_id).and_then(|r| self.clients.get_mut(&r.request))
        {
            client.refusals += 1;
            client.refused = Some((to.0, to.1, self.now, step));
            self.stats.work_refused += 1;
        }
    }

    /// Tells the Edge a connection is closed, checking that a connection that no longer
    /// owns its node changes nothing and emits nothing.
    pub(super) fn edge_closed(&mut self, conn: ConnId, reason: &CloseReason) {
        // What is due before the close happens first, as a shell runs its timers and
        // drains every output before its next input (a conflict's hold ending at this
        // instant, or the dispatch of a grant a fence freed): what the check below sees
        // is then the close's own doing.
        if !self.faults.skip_timers {
            self.edge.handle_timeout(self.now);
        }
        self.drain_edge();
        let Some(link) = self.links.get_mut(&conn.0) else {
            return;
        };
        if link.edge_done {
            return;
        }
        link.edge_done = true;
        let owner = self.edge.owner_of(conn);
        // `last_seen` is an age: it moves with the clock, not with the state.
        let live = |edge: &EdgeCore| {
            let mut nodes = edge.nodes();
            nodes.iter_mut().for_each(|n| n.last_seen = None);
            nodes
        };
        let before = live(&self.edge);
        if self.edge.handle_connection_closed(self.now, conn).is_err() {
            return;
        }
        if owner.is_none() {
            let after = live(&self.edge);
            let quiet = self.edge.poll_event().is_none()
                && self.edge.poll_transmit().is_none()
                && self.edge.poll_lifecycle().is_none();
            check!(
                self,
                before == after && quiet,
                "closing stale conn {} ({reason:?}) changed live state",
                conn.0
            );
        }
        self.drain_edge();
    }

    pub(super) fn send_to_node(&mut self, conn: ConnId, envelope: &Envelope) {
        let latency = self.latency();
        let now = self.now;
        let Some(link) = self.links.get_mut(&conn.0) else {
            return;
        };
        if link.edge_closed {
            return;
        }
        if link.to_node.send(envelope, now + latency) {
            self.stats.frames += 1;
        }
    }

    pub(super) fn on_edge_event(&mut self, event: EdgeEvent) {
        match event {
            EdgeEvent::Request {
                request,
                event:
                    RequestEvent::Dispatched {
                        shape,
                        node_id,
                        provider_id,
                        ..
                    },
            } => {
                let answered = self.clients.get(&request).is_some_and(|c| c.answered);
                check!(self, !answered, "{request} answered by two providers");
                if let Some(client) = self.clients.get_mut(&request) {
                    client.answered = true;
                    if shape == DispatchShape::Tunnel {
                        // A tunnel's answer is the provider's bytes, not numbered tokens.
                        client.expect = None;
                    }
                    client.checker = Some(match shape {
                        DispatchShape::Run => Checker::Run(RunTracker::new()),
                        DispatchShape::Tunnel => Checker::Tunnel(TunnelOrder::Head),
                    });
                }
                self.log(|| format!("{request} dispatched to {node_id}/{provider_id} ({shape:?})"));
            }
            EdgeEvent::Request {
                request,
                event: RequestEvent::Run(event),
            } => {
                self.first_bytes(request);
                if let Some(client) = self.clients.get_mut(&request)
                    && client.expect.is_some()
                {
                    client.text.push_str(&event.delta);
                }
                let ok = match self
                    .clients
                    .get_mut(&request)
                    .and_then(|c| c.checker.as_mut())
                {
                    Some(Checker::Run(tracker)) => {
                        tracker.observe(&event).map_err(|e| e.to_string())
                    }
                    _ => Err("run event for a request that is not a dispatched run".into()),
                };
                check!(
                    self,
                    ok.is_ok(),
                    "{request}: invalid run sequence reached the caller: {ok:?}"
                );
            }
            EdgeEvent::Request {
                request,
                event: event @ (RequestEvent::Tunnel(_) | RequestEvent::Tunnels(_)),
            } => {
                self.first_bytes(request);
                // Parts that arrived together are checked one by one, in order.
                let parts = match event {
                    RequestEvent::Tunnels(parts) => parts,
                    RequestEvent::Tunnel(part) => vec![part],
                    _ => Vec::new(),
                };
                let ok = match self
                    .clients
                    .get_mut(&request)
                    .and_then(|c| c.checker.as_mut())
                {
                    Some(Checker::Tunnel(order)) => {
                        parts.iter().try_for_each(|part| order.observe(part))
                    }
                    _ => Err("tunnel frame for a request that is not a dispatched tunnel".into()),
                };
                check!(
                    self,
                    ok.is_ok(),
                    "{request}: invalid tunnel sequence reached the caller: {ok:?}"
                );
            }
            EdgeEvent::Request {
                request,
                event: RequestEvent::Ended(outcome),
            } => {
                self.log(|| format!("{request} ended: {outcome:?}"));
                if outcome == Outcome::Completed
                    && let Some(client) = self.clients.get(&request)
                    && let Some(expect) = &client.expect
                {
                    check!(
                        self,
                        client.text == *expect,
                        "{request} completed with {:?}, not the uninterrupted {expect:?} ({} continuations)",
                        client.text,
                        client.resumes
                    );
                }
                match outcome {
                    Outcome::Completed => self.stats.completed += 1,
                    Outcome::Failed(RequestError::Unsupported { .. }) => {
                        self.stats.unsupported += 1
                    }
                    _ => {}
                }
                match self.clients.get_mut(&request) {
                    Some(client) => {
                        check!(self, !client.ended, "{request} ended twice");
                        client.ended = true;
                    }
                    None => check!(self, false, "{request} ended but was never accepted"),
                }
            }
            EdgeEvent::Resumed {
                request,
                run,
                node_id,
                why,
                delivered,
                ..
            } => {
                self.stats.resumed += 1;
                if let Some(client) = self.clients.get_mut(&request) {
                    check!(
                        self,
                        client.expect.is_some(),
                        "{request} continued, but it is no stream that may be"
                    );
                    // A continuation may be dispatched after the first byte.
                    client.resumes += 1;
                    client.got_bytes = false;
                    client.unannounced = None;
                }
                self.log(|| {
                    format!("{request}: {run} lost on {node_id} ({why}) after {delivered} bytes; continued")
                });
            }
            EdgeEvent::NodeConnected {
                node_id,
                generation,
            } => {
                self.log(|| format!("node {node_id} ready (generation {})", generation.0));
            }
            EdgeEvent::NodeDisconnected {
                node_id,
                generation,
                reason,
                lost,
            } => {
                self.log(|| {
                    format!(
                        "node {node_id} generation {} fenced ({reason:?}), {} lost",
                        generation.0,
                        lost.len()
                    )
                });
            }
            EdgeEvent::Retried {
                request, run, why, ..
            } => {
                self.stats.retries += 1;
                self.log(|| format!("{request}: {run} given up ({why}), tried elsewhere"));
            }
            EdgeEvent::ProviderEjected {
                node_id,
                provider_id,
                reason,
                time,
            } => {
                self.stats.ejections += 1;
                self.log(|| {
                    format!(
                        "{node_id}/{provider_id} ejected for {}ms ({reason:?})",
                        time.as_millis()
                    )
                });
            }
            EdgeEvent::ProviderRestored {
                node_id,
                provider_id,
                ..
            } => {
                self.stats.restored += 1;
                self.log(|| format!("{node_id}/{provider_id} restored"));
            }
            EdgeEvent::NodeConflict { node_id, .. } => {
                self.stats.conflicts += 1;
                check!(
                    self,
                    self.procs
                        .iter()
                        .any(|p| p.impostor && *p.node_id == *node_id),
                    "node {node_id} in conflict without an impostor"
                );
                self.log(|| format!("node {node_id} in conflict"));
            }
            EdgeEvent::RegisterRejected {
                conn,
                reason,
                ref node_id,
                throttled,
                ..
            } if !matches!(reason, RejectReason::Draining | RejectReason::Conflict) => {
                let bad = self
                    .links
                    .get(&conn.0)
                    .is_some_and(|l| self.procs[l.node].bad);
                check!(
                    self,
                    bad,
                    "a registration with the right token as {node_id} was refused: {reason:?}"
                );
                self.stats.bad_refused += 1;
                self.stats.bad_throttled += u64::from(throttled.is_some());
                self.log(|| format!("{node_id}: bad sibling refused ({reason:?}, {throttled:?})"));
            }
            EdgeEvent::RegisterRejected {
                reason: RejectReason::Draining,
                ref node_id,
                ..
            } => {
                self.stats.held_off += 1;
                self.log(|| format!("{node_id}: registration held off while it drains"));
            }
            other => self.log(|| format!("edge event {other:?}")),
        }
    }

    // ----- the node side -----
}
