//! The rules that cross sub-states, in one place. Longer than the crate's ~800-line norm
//! on purpose: it is the one file where a rule touches more than one sub-state, so that a
//! reviewer reads every such rule, and every `self.registry` outside the registry, in one
//! place. What a sub-state decides alone lives in its own file.
//!
//! Each sub-state decides about its own data (`registry`, `pool`, `requests`, `control`);
//! what one decision means for the others is written here:
//!
//! - **A register takes a node** ([`register`](EdgeCore::register)): a superseded owner's
//!   generation is fenced before the newcomer owns the node.
//! - **A ready node serves** ([`ready`](EdgeCore::ready)): its providers go live in its
//!   generation and the queue is pumped; a revision newer than the one it registered
//!   with is pushed.
//! - **A fence ends a generation** ([`fence`](EdgeCore::fence)): leases return at once,
//!   the requests its runs served fail with `NodeLost`, commands fail, the refresh is
//!   dropped, providers go offline. Only the current owner's generation can be fenced:
//!   a stale close or timeout changes nothing.
//! - **Capacity serves the oldest waiter** ([`release`](EdgeCore::release),
//!   [`pump`](EdgeCore::pump)): a lease returned exactly once frees a unit, which goes to
//!   the oldest waiter that fits; a draining node whose last lease returned is closed.
//! - **A request is dispatched where it was granted** ([`grant`](EdgeCore::grant)): the
//!   lease is taken and the message built and sent in the same transition; nothing is
//!   dispatched to a node that is not its ready owner.
//! - **A stream's end returns its lease** ([`on_stream_of`](EdgeCore::on_stream_of)); a broken
//!   stream fails its request and is cancelled on the node, which keeps the lease until
//!   it ends the run or the cancel grace passes.
//! - **Nothing reaches the caller before a run's first byte** ([`on_stream_of`](EdgeCore::on_stream_of)):
//!   a run that fails before it (the provider unreachable, 5xx, 429, 408, a broken
//!   stream, its node lost) is given up and its request dispatched again on another
//!   provider ([`retry`](EdgeCore::retry)), within `max_attempts` and the retry budget;
//!   when none can take it, the caller gets the failed run's answer. A run slow to its
//!   first byte gets another provider tried beside it, and another when that one fails
//!   ([`beside_slow`](EdgeCore::beside_slow)); the first to answer wins and the others are
//!   cancelled. A normalized run whose caller did not ask for a stream reaches its first
//!   byte at its terminal. A caller's own 4xx is an answer, never a failure.
//! - **A request's dispatches are bounded** by one rule ([`verdict`](EdgeCore::verdict)).
//! - **A provider that keeps failing is ejected** ([`provider_failed`](EdgeCore::provider_failed)):
//!   out of the rotation for a while that grows with repeats, never the last live
//!   provider of a model group; then one request probes it.
//! - **Draining** ([`drain_node`](EdgeCore::drain_node)): no new work for the node; it is
//!   closed once its last lease returns.
//! - **A configuration takes effect** ([`reconfigure`](EdgeCore::reconfigure)): removed
//!   nodes and changed tokens fence their owners; changed payloads are pushed.

use super::registry::Admitted;
use super::registry::ClusterStep;
use crate::cluster::ClaimDecision;
use crate::time::Timestamp;
use crate::wire::ClusterMembers;

use crate::wire::Validate;

use super::Cancelled;
use super::CloseReason;
use super::CommandError;
use super::CommandId;
use super::ConnId;
use super::ConnViolation;
use super::DispatchShape;
use super::DrainReason;
use super::EdgeCore;
use super::EdgeEvent;
use super::Lifecycle;
use super::MAX_REFRESH_TRIES;
use super::NodeStatus;
use super::Outcome;
use super::Placed;
use super::Placement;
use super::ProviderRouting;
use super::RefreshFailure;
use super::RejectReason;
use super::RequestError;
use super::Standing;
use super::StreamViolation;
use super::Submit;
use super::SubmitError;
use super::TimerKey;
use super::UsageError;
use super::Violation;
use super::control;
use super::cx;
use super::requests;
use crate::edge_config::EdgeConfig;
use crate::edge_config::EdgeConfigError;
use crate::edge_config::category_of;
use crate::lease::Generation;
use crate::lease::Lease;
use crate::lease::Release;
use crate::lease::RequestId;
use crate::lease::ResourceId;
use crate::lease::RunId;
use crate::queue::Candidate;
use crate::queue::Waiter;
use crate::wire::AdapterLoad;
use crate::wire::AdapterType;
use crate::wire::Body;
use crate::wire::Envelope;
use crate::wire::HeartbeatAck;
use crate::wire::NodeConfigRefreshResponse;
use crate::wire::NodeReadyRequest;
use crate::wire::NodeRehomeRequest;
use crate::wire::ProviderHealth;
use crate::wire::ProviderSnapshot;
use crate::wire::ProviderStatus;
use crate::wire::RegisterRequest;
use crate::wire::ValidationError;
use std::sync::Arc;
use std::time::Duration;

use super::health::Passed;
use super::pool::Model;
use super::registry::{NodeIdx, Phase, Readied};
use super::requests::{Cancel, Cause, Fenced, Requests, Step, StreamItem};

impl EdgeCore {
    // ----- connections -----

    pub(super) fn connection_closed(&mut self, conn: ConnId) -> Result<(), UsageError> {
        let mut cx = cx!(self);
        if let Phase::Owner { node, generation } = self.registry.remove(&mut cx, conn)? {
            self.fence(node, generation, CloseReason::PeerClosed);
        }
        Ok(())
    }

    /// The peer broke the protocol at connection level: close it (fencing it if it owns).
    pub(super) fn violation(&mut self, conn: ConnId, violation: ConnViolation) {
        self.out.event(EdgeEvent::PeerViolation {
            conn,
            node_id: self.registry.node_of(conn),
            violation: Violation::Connection(violation.clone()),
        });
        let phase = self.registry.phase(conn).ok();
        let mut cx = cx!(self);
        self.registry.close(
            &mut cx,
            conn,
            CloseReason::ProtocolViolation(violation.clone()),
        );
        if let Some(Phase::Owner { node, generation }) = phase {
            self.fence(node, generation, CloseReason::ProtocolViolation(violation));
        }
    }

    /// An envelope from `conn`, routed by its kind.
    pub(super) fn on_envelope(
        &mut self,
        conn: ConnId,
        envelope: Envelope,
    ) -> Result<(), UsageError> {
        let phase = self.registry.phase(conn)?;
        match phase {
            // Its answer is on its way; nothing it sends matters.
            Phase::Held => return Ok(()),
            // Rejected or superseded: answer a ready with a refusal, ignore the rest.
            Phase::Stale => {
                if let Some(Body::NodeReadyRequest(_)) = envelope.body {
                    let mut cx = cx!(self);
                    self.registry.refuse_ready(
                        &mut cx,
                        conn,
                        "connection is not the node's current owner",
                        false,
                    );
                }
                return Ok(());
            }
            Phase::Unregistered | Phase::Owner { .. } => {}
        }
        self.registry.heard(self.now, conn);
        if let Err(err) = envelope.validate() {
            // A message about one run that is wrong (an unknown event type or frame kind,
            // as a newer node may send) fails that run, not the connection; a refresh
            // answer with an unknown status counts as failed. Anything else breaks the
            // connection's own grammar.
            match envelope.body {
                Some(Body::RunEvent(event)) => {
                    self.bad_stream_item(conn, phase, &event.run_id, err);
                }
                Some(Body::ProviderTunnelFrame(frame)) => {
                    self.bad_stream_item(conn, phase, &frame.run_id, err);
                }
                Some(Body::NodeConfigRefreshResponse(resp)) if !resp.request_id.is_empty() => {
                    self.on_refresh_response(conn, phase, resp);
                }
                _ => self.violation(conn, ConnViolation::Invalid(err)),
            }
            return Ok(());
        }
        let Some(body) = envelope.body else {
            return Ok(());
        };
        match body {
            Body::RegisterRequest(req) => self.register(conn, phase, &req),
            Body::NodeReadyRequest(req) => self.ready(conn, phase, &req),
            Body::Heartbeat(ping) => self.out.send(
                conn,
                Body::HeartbeatAck(HeartbeatAck {
                    nonce: ping.nonce,
                    echo_sent_at_ms: ping.sent_at_ms,
                }),
            ),
            Body::HeartbeatAck(ack) => self.registry.heartbeat_answered(self.now, conn, ack.nonce),
            Body::RunEvent(event) => {
                let run = self.requests.run_on(conn, &event.run_id);
                self.on_stream_of(conn, phase, run, StreamItem::Run(event));
            }
            Body::ProviderTunnelFrame(frame) => {
                // A merged frame is its parts one by one (`merged_tunnel_frames`), of the
                // run its name gives, looked up once: the parts carry no name.
                let run = self.requests.run_on(conn, &frame.run_id);
                for (sequence, part) in crate::tunnel::split_parts(frame) {
                    self.on_stream_of(conn, phase, run, StreamItem::Part(sequence, part));
                }
            }
            Body::NodeConfigRefreshResponse(resp) => self.on_refresh_response(conn, phase, resp),
            Body::NodeCommandResponse(resp) => {
                if let Some((node, generation)) = self.registry.ready_owner(conn, phase) {
                    let mut cx = cx!(self);
                    self.control.answered(&mut cx, node, generation, resp);
                }
            }
            Body::NodeDrainRequest(req) => match self.registry.ready_owner(conn, phase) {
                Some((node, _)) => self.drain_node(node, DrainReason::Stopping(req.reason)),
                None => self.violation(conn, ConnViolation::DrainBeforeReady),
            },
            Body::NodeLoadReport(report) => match self.registry.ready_owner(conn, phase) {
                Some((node, _)) => self.held_elsewhere(node, &report.held_elsewhere, true),
                None => self.violation(conn, ConnViolation::LoadBeforeReady),
            },
            other => self.violation(conn, ConnViolation::WrongDirection(other.kind())),
        }
        Ok(())
    }

    // ----- registration and the ready handshake -----

    /// A register: a newer register supersedes the current owner in this same
    /// transition (its generation fenced first), unless the registry holds it off.
    pub(super) fn register(&mut self, conn: ConnId, phase: Phase, req: &RegisterRequest) {
        if self.cluster.awaits(conn) {
            self.violation(conn, ConnViolation::SecondRegister);
            return;
        }
        if self.cluster.enabled && !self.cluster.serving && phase == Phase::Unregistered {
            let mut cx = cx!(self);
            self.registry
                .refuse_unconfigured(&mut cx, conn, &req.node_id);
            return;
        }
        let step = if self.cluster.enabled {
            super::registry::ClusterStep::Unclaimed
        } else {
            super::registry::ClusterStep::Single
        };
        self.take_node(conn, phase, req, step);
    }

    /// A ready: the pending owner's providers go live and the queue is pumped.
    pub(super) fn ready(&mut self, conn: ConnId, phase: Phase, req: &NodeReadyRequest) {
        let mut cx = cx!(self);
        match self.registry.ready(&mut cx, conn, phase, req) {
            Readied::Refused | Readied::Duplicate => {}
            Readied::Violation(violation) => self.violation(conn, violation),
            Readied::Activated {
                node,
                generation,
                registered_revision,
            } => {
                self.sync_resources(node, generation, Some(&req.held_elsewhere));
                self.health_changed(node);
                if self.registry.node(node).revision != registered_revision {
                    self.push_refresh(node);
                }
            }
        }
    }

    /// Brings node `node`'s resources in line with its configuration for `generation`,
    /// at ready and after an applied refresh: enabled adapters come online (or take their
    /// new capacities when already live) and waiters are pumped; removed or disabled
    /// adapters take no new work while their leases drain (offline ones stay offline). A
    /// draining node takes no new work whatever its configuration says (a refresh it
    /// applies while draining does not bring its capacity back).
    ///
    /// At ready, `held` is what the node's work for an earlier Edge process still holds
    /// (`NodeReadyRequest.held_elsewhere`): counted as taken before any waiter is served.
    fn sync_resources(
        &mut self,
        node: NodeIdx,
        generation: Generation,
        held: Option<&[AdapterLoad]>,
    ) {
        let entry = self.registry.node(node);
        let Some(spec) = entry.spec.clone() else {
            return;
        };
        let draining = entry.draining.is_some();
        for (name, r) in entry.resources.clone() {
            match spec.adapter(&name).filter(|a| a.enabled && !draining) {
                Some(adapter) => {
                    let returned =
                        self.pool
                            .activate(r, generation, adapter.capacity, adapter.long_capacity);
                    debug_assert!(returned.is_empty(), "older generation was not fenced");
                    if let Some(held) = held {
                        let (n, long) = load_of(held, &name);
                        self.pool.set_held(r, n, long);
                    }
                    self.pump(r);
                }
                None => self.pool.stop_granting(r, None),
            }
        }
    }

    /// What node `node`'s work for an earlier Edge process holds now, by adapter (an
    /// adapter left out holds nothing): its resources count it as taken, and a unit that
    /// came free serves waiters (when `pump`).
    fn held_elsewhere(&mut self, node: NodeIdx, held: &[AdapterLoad], pump: bool) {
        for (name, r) in self.registry.node(node).resources.clone() {
            let (n, long) = load_of(held, &name);
            // The node says what it holds: a refusal's guess gives way to it.
            self.timers.stop(TimerKey::RefusalHold(r));
            let unheld = self.pool.end_refused_hold(r);
            if (self.pool.set_held(r, n, long) || unheld) && pump {
                self.pump(r);
            }
        }
    }

    /// This Edge process hands over to a successor that now holds its listeners: every
    /// ready node that can re-home is told to (`NodeRehomeRequest`) and every ready node
    /// drains, so nothing more is dispatched here while what runs goes on to its end and
    /// each connection closes after its last lease; pending registrations are closed
    /// (they dial again and reach the successor), as is every later one; requests still
    /// waiting for capacity end, retryable, and later submits are refused.
    pub(super) fn rehome(&mut self) {
        self.registry.handing_over = true;
        for node in self.registry.indices().collect::<Vec<_>>() {
            let Some(owner) = self.registry.node(node).owner else {
                continue;
            };
            if !owner.ready {
                let mut cx = cx!(self);
                self.registry.close(
                    &mut cx,
                    owner.conn,
                    CloseReason::RegisterRejected(RejectReason::HandingOver),
                );
                self.fence(
                    node,
                    owner.generation,
                    CloseReason::RegisterRejected(RejectReason::HandingOver),
                );
                continue;
            }
            if self.registry.node(node).draining.is_some() {
                continue;
            }
            if owner.rehome {
                self.out.send(
                    owner.conn,
                    Body::NodeRehomeRequest(NodeRehomeRequest {
                        reason: "edge handing over to a new process".to_owned(),
                    }),
                );
            }
            self.drain_node(node, DrainReason::HandingOver { told: owner.rehome });
        }
        for request in self.pool.queue.ids() {
            if self.requests.has_live(request) {
                // Waiting beside a slow run: that run goes on alone (when the wait expires).
                continue;
            }
            let mut cx = cx!(self);
            self.requests
                .end(&mut cx, request, Outcome::Failed(RequestError::HandingOver));
        }
    }

    /// Fences node `node`'s `generation` if it is still the owner: leases return once,
    /// the requests its runs served fail with `NodeLost`, its commands fail, its
    /// resources go offline. A stale generation changes nothing and emits nothing.
    pub(super) fn fence(&mut self, node: NodeIdx, generation: Generation, reason: CloseReason) {
        let Some(owner) = self.registry.end_ownership(node, generation) else {
            return;
        };
        self.cluster.ended(node, owner.instance());
        let mut cx = cx!(self);
        self.control.node_lost(&mut cx, node, generation);
        let node_id = self.registry.node(node).id.clone();
        let mut lost = Vec::new();
        let mut elsewhere = Vec::new();
        let mut broken = Vec::new();
        for (_, r) in self.registry.node(node).resources.clone() {
            for lease in self.pool.fence(r) {
                // (Offline now: nothing to pump for a probe slot freed.)
                self.pool.undecided(r, lease.run);
                let mut cx = cx!(self);
                match self.requests.fenced(&mut cx, lease) {
                    Fenced::Nothing => {}
                    Fenced::Committed(request, resource) => broken.push((request, lease, resource)),
                    Fenced::Uncommitted(request) => elsewhere.push((request, lease)),
                }
            }
        }
        // A run lost before its first byte: its request goes on elsewhere when it may.
        let why = Outcome::Failed(RequestError::NodeLost {
            node_id: node_id.clone(),
        });
        let mut retry = Vec::new();
        for (request, lease) in elsewhere {
            if self.config.routing.retry_on.node_lost && self.may_retry(request, None) {
                self.out.event(EdgeEvent::Retried {
                    request,
                    run: lease.run,
                    node_id: node_id.clone(),
                    provider_id: self.pool.meta(lease.resource).provider_id.clone(),
                    why: "node_lost",
                });
                retry.push(request);
            } else if !self.requests.has_live(request) {
                lost.push(request);
            }
        }
        // An answer lost midway is continued elsewhere where it can be, once every
        // provider of this node is offline (none of them is picked for it).
        for (request, lease, resource) in broken {
            if !self.try_resume(request, lease.run, resource, "node_lost") {
                lost.push(request);
            }
        }
        lost.sort_unstable();
        let mut cx = cx!(self);
        for &request in &lost {
            self.requests.end_failed(&mut cx, request, why.clone());
        }
        if owner.ready {
            self.out.event(EdgeEvent::NodeDisconnected {
                node_id,
                generation,
                reason,
                lost,
            });
            self.health_changed(node);
        }
        for request in retry {
            self.retry(request);
        }
    }

    // ----- requests -----

    /// A caller's request: dispatched at once where a candidate has room, else queued.
    pub(super) fn submit(&mut self, submit: Submit) -> Result<RequestId, SubmitError> {
        if self.registry.handing_over {
            return Err(SubmitError::HandingOver);
        }
        let model = self
            .pool
            .model(&submit.model)
            .ok_or_else(|| SubmitError::UnknownModel(submit.model.to_string()))?;
        if let Some(max) = model.context_tokens
            && submit.prompt_tokens > max
        {
            return Err(SubmitError::PromptTooLong {
                tokens: submit.prompt_tokens,
                max,
            });
        }
        let long = model
            .long_threshold
            .is_some_and(|t| submit.prompt_tokens >= t);
        if long && !model.long_possible {
            return Err(SubmitError::NoCandidates(submit.model.to_string()));
        }
        let candidates: Arc<[Candidate]> = if submit.tunnel_only() {
            model
                .candidates
                .iter()
                .filter(|c| self.pool.meta(c.resource).serves(submit.endpoint))
                .cloned()
                .collect()
        } else {
            model.candidates.clone()
        };
        if candidates.is_empty() {
            return Err(SubmitError::NoCandidates(submit.model.to_string()));
        }
        let name = model.name.clone();
        let placement = self.placement(&name, &submit, candidates.len());
        let picked = self.pick(&name, &candidates, long, placement.as_deref());
        let max_waiting = self.config.queue.max_waiting;
        if !matches!(picked, Pick::Now(_)) && self.pool.waiting_for(&name) >= max_waiting {
            return Err(SubmitError::QueueFull {
                model: name.to_string(),
                max_waiting,
            });
        }
        // A streamed answer keeps what continuing it needs (its body, its text) only in a
        // group where some provider continues answers.
        let resume_limit = if candidates
            .iter()
            .any(|c| self.pool.meta(c.resource).resumes)
        {
            self.config
                .models
                .get(&*name)
                .and_then(|m| m.resume_limit)
                .unwrap_or(1)
        } else {
            0
        };
        let request = self.requests.accept(
            submit,
            name,
            long,
            candidates.clone(),
            resume_limit,
            placement,
        );
        match picked {
            Pick::Now(candidate) => self.grant(request, &candidate),
            Pick::WaitFor(candidate) => self.wait(request, candidates, Some(candidate)),
            Pick::Busy => self.wait(request, candidates, None),
        }
        Ok(request)
    }

    /// `request` takes a lease on `candidate` and is dispatched there, in one transition.
    fn grant(&mut self, request: RequestId, candidate: &Candidate) {
        let (Some(run), Some(long)) = (
            self.requests.next_run(request),
            self.requests.get(request).map(|r| r.long),
        ) else {
            return;
        };
        let Some(lease) = self.pool.acquire(candidate.resource, run, long) else {
            unreachable!("grant without free capacity");
        };
        let meta = &self.pool.resources[candidate.resource.index()];
        let node = self.registry.node(meta.node);
        let Some(owner) = node.owner.filter(|o| o.ready) else {
            unreachable!("live resource on a node that is not ready");
        };
        let mut cx = cx!(self);
        self.requests.dispatch(
            &mut cx,
            lease,
            owner.conn,
            meta,
            &node.id,
            &candidate.target,
        );
        self.pool.dispatched(self.now, candidate.resource, run);
        if let Some(placement) = self
            .requests
            .get(request)
            .and_then(|r| r.placement.as_deref())
        {
            // A wait for the provider it was placed on, if it waited, is over.
            self.timers.stop(TimerKey::Placed(request));
            self.prefixes.record(placement, candidate.resource);
        }
        let deadline = self.first_byte_timeout(request);
        self.first_bytes.push(self.now, deadline, run);
    }

    /// How long a run of `request` may go without its first byte (its model's deadline,
    /// else the routing default).
    fn first_byte_timeout(&self, request: RequestId) -> Duration {
        self.requests
            .get(request)
            .and_then(|r| self.config.models.get(&*r.model))
            .and_then(|m| m.first_byte_timeout)
            .unwrap_or(self.config.routing.first_byte_timeout)
    }

    /// `request` waits in the queue for one of `candidates`, or, placed by its
    /// conversation on a provider that is full (`placed`), for that one alone until
    /// `affinity_wait_ms` has passed ([`TimerKey::Placed`]); its deadline is its queue
    /// wait either way.
    fn wait(
        &mut self,
        request: RequestId,
        candidates: Arc<[Candidate]>,
        placed: Option<Candidate>,
    ) {
        let deadline = self.now + self.config.queue.wait_timeout;
        let serving: Arc<[Candidate]> = match &placed {
            Some(candidate) => Arc::from(vec![candidate.clone()]),
            None => candidates.clone(),
        };
        if let Some(waiter) = self.requests.waiter(request, serving, deadline) {
            let ticket = self.pool.wait(waiter);
            self.requests.queued(request, ticket, candidates);
            if placed.is_some() {
                let until = self.now + self.config.routing.affinity.wait;
                self.timers.set(TimerKey::Placed(request), until);
            }
        }
    }

    /// `request` waited for the provider its conversation is placed on as long as it may:
    /// it waits on for any of its candidates (or is dispatched at once where one has
    /// room), its queue deadline kept.
    pub(super) fn placed_wait_over(&mut self, request: RequestId) {
        let Some(waiter) = self.requests.unwait(&mut self.pool.queue, request) else {
            return;
        };
        // Its candidates as they serve it now (a refresh may have changed a shape), but
        // those it failed on.
        let Some((model, long, candidates)) = self.untried(request) else {
            return;
        };
        if candidates.is_empty() {
            // Nothing serves it any more: the queue's answer, as for any waiter.
            self.requeue_for_endpoint(waiter);
            return;
        }
        match self.pick(&model, &candidates, long, None) {
            Pick::Now(candidate) => self.grant(request, &candidate),
            _ => {
                let ticket = self.pool.wait(Waiter {
                    candidates: candidates.clone(),
                    ..waiter
                });
                self.requests.queued(request, ticket, candidates);
            }
        }
    }

    /// Whether `request` may be dispatched once more, on a provider it has not failed on
    /// (nor `also`): attempts left, room in the retry budget, and such a provider online
    /// (in the rotation or not: a request may wait for an ejected one's probe).
    fn may_retry(&self, request: RequestId, also: Option<ResourceId>) -> bool {
        self.may_try_again(request, also, false)
    }

    /// `request`'s answer was lost midway (`run` on `resource`): it is continued on
    /// another provider that continues exactly, from what its caller has, when its model
    /// allows another continuation, such a provider is online and the request can be
    /// continued exactly. False when it is not (its caller then gets the failure, as
    /// without continuations). The retry budget, which bounds whole requests run again
    /// before their first byte, does not bound continuations: each is work its caller
    /// already holds bytes of, bounded per request by the model's `resume_limit`, and a
    /// node lost takes a third of a three-node fleet's streams at once.
    fn try_resume(
        &mut self,
        request: RequestId,
        run: RunId,
        resource: ResourceId,
        why: &'static str,
    ) -> bool {
        if !self.requests.may_resume(request) {
            return false;
        }
        let delivered = self.requests.delivered(request);
        if !self.continues_elsewhere(request, resource) || !self.requests.resume(request, resource)
        {
            return false;
        }
        let meta = self.pool.meta(resource);
        let node_id = self.registry.node(meta.node).id.clone();
        self.out.event(EdgeEvent::Resumed {
            request,
            run,
            node_id,
            provider_id: meta.provider_id.clone(),
            why,
            delivered,
        });
        self.retry(request);
        true
    }

    /// Whether a provider of `request`'s group other than `resource`, and none it failed
    /// on, continues answers exactly and is online (in the rotation or not: the
    /// continuation may wait for it within its deadline).
    fn continues_elsewhere(&self, request: RequestId, resource: ResourceId) -> bool {
        let (Some(r), Some((_, failed))) =
            (self.requests.get(request), self.requests.attempts(request))
        else {
            return false;
        };
        let endpoint = r.endpoint();
        r.candidates.iter().any(|c| {
            let meta = self.pool.meta(c.resource);
            c.resource != resource
                && !failed.contains(&c.resource)
                && r.continues_on(meta)
                && meta.serves(endpoint)
                && self.pool.usage(c.resource).capacity > 0
        })
    }

    /// Whether the ledger explains a node's refusal of `lease`'s run: without that run, the
    /// units this Edge holds and those the node reported held elsewhere fill its capacity
    /// (or its long-context capacity, for a long run). The node reports what its other
    /// sessions hold before it refuses, so a slot another Edge took is explained.
    fn refusal_explained(&self, lease: Lease) -> bool {
        let usage = self.pool.usage(lease.resource);
        let others = usage.in_flight.saturating_sub(1) + usage.held_elsewhere;
        let long_others =
            usage.long_in_flight.saturating_sub(u32::from(lease.long)) + usage.long_held_elsewhere;
        others >= usage.capacity || (lease.long && long_others >= usage.long_capacity)
    }

    /// [`Self::may_retry`]; after a node's refusal (`refused`), within
    /// [`requests::MAX_REFUSALS`] and outside the attempts and the retry budget, with the
    /// refusing provider still a candidate.
    fn may_try_again(&self, request: RequestId, also: Option<ResourceId>, refused: bool) -> bool {
        let routing = &self.config.routing;
        let (Some(r), Some((attempts, failed))) =
            (self.requests.get(request), self.requests.attempts(request))
        else {
            return false;
        };
        if refused {
            if self.requests.unexplained_refusals(request) >= requests::MAX_REFUSALS {
                return false;
            }
        } else {
            if attempts >= routing.max_attempts {
                return false;
            }
            let budget = (self.requests.accepted() * routing.retry_budget_percent as usize / 100)
                .max(routing.retry_budget_min as usize);
            if !r.retrying() && self.requests.retrying() >= budget {
                return false;
            }
        }
        let endpoint = r.endpoint();
        let continued = r.continued();
        r.candidates.iter().any(|c| {
            Some(c.resource) != also
                && !failed.contains(&c.resource)
                && self.pool.meta(c.resource).serves(endpoint)
                && (!continued || r.continues_on(self.pool.meta(c.resource)))
                // Out of the rotation for now (ejected, cooling down after its
                // `Retry-After`, probed) is no reason to fail: the request waits for it
                // within its queue deadline.
                && self.pool.usage(c.resource).capacity > 0
        })
    }

    /// The candidates of `request` it has not failed on (and, when only a tunnel can
    /// answer it, that are served by tunnels now).
    fn untried(&self, request: RequestId) -> Option<(Arc<str>, bool, Arc<[Candidate]>)> {
        let r = self.requests.get(request)?;
        let (_, failed) = self.requests.attempts(request)?;
        let endpoint = r.endpoint();
        let continued = r.continued();
        let candidates = r
            .candidates
            .iter()
            .filter(|c| !failed.contains(&c.resource))
            .filter(|c| self.pool.meta(c.resource).serves(endpoint))
            .filter(|c| !continued || r.continues_on(self.pool.meta(c.resource)))
            .cloned()
            .collect();
        Some((r.model.clone(), r.long, candidates))
    }

    /// Dispatches `request` again, on a provider it has not failed on: at once where one
    /// has room, else it waits in the queue for one; with none left it ends with what its
    /// last run said. A request with a run still trying is left to it.
    pub(super) fn retry(&mut self, request: RequestId) {
        if self.requests.waiting(request) {
            return;
        }
        if self.requests.has_live(request) {
            // A run within its first-byte deadline may still answer. Runs past it (a
            // provider that hangs) are not waited on alone: another is tried beside them.
            if self.requests.only_slow_live(request) {
                self.beside_slow(request);
            }
            return;
        }
        let Some((model, long, candidates)) = self.untried(request) else {
            return;
        };
        if candidates.is_empty() || self.registry.handing_over {
            let mut cx = cx!(self);
            let nothing = Outcome::Failed(if self.registry.handing_over {
                RequestError::HandingOver
            } else {
                RequestError::NodeLost {
                    node_id: Arc::from(""),
                }
            });
            self.requests.end_failed(&mut cx, request, nothing);
            return;
        }
        let placement = self.requests.placement(request);
        match self.pick(&model, &candidates, long, placement.as_deref()) {
            Pick::Now(candidate) => self.grant(request, &candidate),
            Pick::WaitFor(candidate) => {
                self.requests.retry_queued(request);
                self.wait(request, candidates, Some(candidate));
            }
            Pick::Busy => {
                self.requests.retry_queued(request);
                self.wait(request, candidates, None);
            }
        }
    }

    /// `run` on `resource` failed before its first byte: its provider's health takes
    /// the failure, and an ejection it causes is announced (and probed when it ends).
    pub(super) fn provider_failed(
        &mut self,
        resource: ResourceId,
        run: RunId,
        retry_after: Option<Duration>,
    ) {
        let routing = self.config.routing;
        let Some(ejected) = self
            .pool
            .failed(self.now, &routing, resource, run, retry_after)
        else {
            // Still in the rotation, and a trial slot `run` held is free again.
            self.pump(resource);
            return;
        };
        self.timers.set(TimerKey::Probe(resource), ejected.until);
        let meta = self.pool.meta(resource);
        self.out.event(EdgeEvent::ProviderEjected {
            node_id: self.registry.node(meta.node).id.clone(),
            provider_id: meta.provider_id.clone(),
            reason: ejected.reason,
            time: ejected.until.saturating_duration_since(self.now),
        });
    }

    /// Tells the shell (logs, metrics) that `run` is given up for `why` and its request
    /// tried elsewhere.
    fn retried(&mut self, run: RunId, resource: ResourceId, why: &'static str) {
        let meta = self.pool.meta(resource);
        self.out.event(EdgeEvent::Retried {
            request: run.request,
            run,
            node_id: self.registry.node(meta.node).id.clone(),
            provider_id: meta.provider_id.clone(),
            why,
        });
    }

    /// `run` reached its first byte: it answers its request; its siblings are cancelled;
    /// its provider's health takes the success.
    fn first_byte(&mut self, run: RunId) {
        let Some(r) = self.requests.run(run) else {
            return;
        };
        let (lease, started) = (r.lease, r.started);
        let mut cx = cx!(self);
        let Some(committed) = self.requests.commit(&mut cx, run) else {
            return;
        };
        let routing = self.config.routing;
        let latency = self.now.saturating_duration_since(started);
        match self
            .pool
            .succeeded(self.now, &routing, lease.resource, run, latency)
        {
            Passed::Nothing => {}
            Passed::Trial => self.pump(lease.resource),
            Passed::Restored(after) => {
                let meta = self.pool.meta(lease.resource);
                self.out.event(EdgeEvent::ProviderRestored {
                    node_id: self.registry.node(meta.node).id.clone(),
                    provider_id: meta.provider_id.clone(),
                    after,
                });
                // Back in the rotation: what waits for it may go.
                self.pump(lease.resource);
            }
        }
        // A sibling dispatched before this one is one that went past its first-byte
        // deadline: beaten by a later attempt, it failed. A later one (tried beside a slow
        // run that then answered) says nothing of its provider.
        for &(sibling, _) in &committed.siblings {
            if sibling.attempt < run.attempt
                && let Some(resource) = self.requests.run(sibling).map(|r| r.lease.resource)
            {
                self.provider_failed(resource, sibling, None);
            }
        }
        let grace = self.config.timing.cancel_grace;
        let mut cx = cx!(self);
        for (sibling, conn) in committed.siblings {
            let reason = "another provider answered first".to_owned();
            Requests::cancel_on_node(&mut cx, sibling, conn, reason, grace);
        }
        if committed.ended {
            self.release(lease);
        } else if let Some(stall) = self.stall_timeout(run.request) {
            self.timers.set(TimerKey::Stall(run), self.now + stall);
        }
        // Its first-byte deadline (and those of runs ahead of it that answered or
        // failed) need no wake-up.
        let requests = &self.requests;
        self.first_bytes
            .settle(|run| !requests.awaits_first_byte(run));
    }

    /// `run` failed before its first byte: given up and its request dispatched again
    /// when it may, otherwise its answer goes to the caller ([`Verdict`]).
    fn failed_before_first_byte(
        &mut self,
        run: RunId,
        cause: Cause,
        retry_after: Option<Duration>,
    ) {
        let Some(lease) = self.requests.run(run).map(|r| r.lease) else {
            return;
        };
        if let Cause::Violation(detail) = &cause {
            self.out.event(EdgeEvent::PeerViolation {
                conn: self.requests.run(run).map_or(ConnId(0), |r| r.conn),
                node_id: Some(
                    self.registry
                        .node(self.pool.meta(lease.resource).node)
                        .id
                        .clone(),
                ),
                violation: Violation::Stream {
                    run,
                    violation: detail.clone(),
                },
            });
        }
        let refusal = match cause {
            Cause::Refused(_) if self.refusal_explained(lease) => Some(Refusal::Explained),
            Cause::Refused(_) => Some(Refusal::Unexplained),
            _ => None,
        };
        if refusal.is_none() {
            self.provider_failed(lease.resource, run, retry_after);
        }
        if refusal == Some(Refusal::Unexplained) {
            self.requests.count_unexplained_refusal(run.request);
        }
        let verdict = self.verdict(run, lease, &cause, refusal);
        if verdict == Verdict::Answered {
            // Nothing else can answer: the caller gets this one.
            self.first_byte(run);
            return;
        }
        if verdict == Verdict::Again {
            self.retried(run, lease.resource, cause.label());
        }
        let Some((lease, conn)) = self.requests.give_up(run, &cause) else {
            return;
        };
        match conn {
            Some(conn) => {
                let grace = self.config.timing.cancel_grace;
                let mut cx = cx!(self);
                let reason = match &cause {
                    Cause::Violation(detail) => format!("protocol violation: {detail}"),
                    _ => "retried on another provider".to_owned(),
                };
                Requests::cancel_on_node(&mut cx, run, conn, reason, grace);
            }
            None => {
                self.pool.undecided(lease.resource, run);
                match refusal {
                    Some(refusal) => self.release_refused(lease, refusal),
                    None => self.release(lease),
                }
            }
        }
        let request = run.request;
        let mut cx = cx!(self);
        match verdict {
            Verdict::Again => self.retry(request),
            Verdict::LeftToSibling | Verdict::Answered => {}
            Verdict::HandedOver => {
                self.requests
                    .end(&mut cx, request, Outcome::Failed(RequestError::HandingOver));
            }
            // A broken stream has no answer to give: the request fails with it.
            Verdict::Failed => self.requests.end_failed(&mut cx, request, cause.outcome()),
        }
    }

    /// What becomes of `run`'s request now that `run` failed before its first byte
    /// (`refusal`: its node refused it, and whether the ledger explains that). The one
    /// rule that bounds a request's dispatches, as README's "Retries" states it and the
    /// simulation checks it:
    ///
    /// > A dispatch is an attempt unless its node refused it before asking its provider.
    /// > A request has at most `max_attempts` attempts, and at most 8 refusals its Edge's
    /// > ledger did not explain. After a refusal the ledger counts that provider full
    /// > until its node reports its load or one heartbeat interval passes, so the request
    /// > is not dispatched there again before that. A continuation of a stream lost after
    /// > its first byte counts its attempts afresh.
    fn verdict(
        &self,
        run: RunId,
        lease: Lease,
        cause: &Cause,
        refusal: Option<Refusal>,
    ) -> Verdict {
        let request = run.request;
        // A refusal leaves the provider a candidate: it was full for a moment.
        let also = refusal.is_none().then_some(lease.resource);
        if self.may_try_again(request, also, refusal.is_some()) {
            Verdict::Again
        } else if self.requests.has_live_besides(request, run) {
            Verdict::LeftToSibling
        } else if refusal.is_some() && self.registry.handing_over {
            // No node here takes new work, and nothing reached a provider: the request
            // ends as one still waiting does at the hand-over, retryable at the successor.
            Verdict::HandedOver
        } else if matches!(cause, Cause::Violation(_)) {
            Verdict::Failed
        } else {
            Verdict::Answered
        }
    }

    /// `run` has not reached its first byte in time: another provider is tried beside it
    /// when the request may, at once where one has room, else the first that has. The
    /// first of them to answer serves the caller.
    pub(super) fn slow_first_byte(&mut self, run: RunId) {
        let Some(lease) = self.requests.run(run).map(|r| r.lease) else {
            return;
        };
        if !self.requests.slow(run) {
            return;
        }
        // Not a failure yet: it may still answer first (a long answer that is not
        // streamed has its head only at the end). A later attempt that beats it makes it
        // one (see `first_byte`).
        let request = run.request;
        if self.requests.waiting(request) {
            return;
        }
        if !self.may_retry(request, Some(lease.resource)) {
            // No try beside it now (the retry budget is spent, or no provider is left):
            // it is looked at again after another deadline, while it may still be tried
            // beside (the budget frees as other retries end).
            let attempts = self.requests.attempts(request).map_or(u32::MAX, |(a, _)| a);
            if attempts < self.config.routing.max_attempts {
                let again = self.first_byte_timeout(request);
                self.first_bytes.push(self.now, again, run);
            }
            return;
        }
        self.retried(run, lease.resource, "first_byte_timeout");
        self.beside_slow(request);
    }

    /// `request`'s live runs are all past their first-byte deadline: another provider is
    /// tried beside them, at once where one has room, else the first that has (it waits
    /// in the queue, and waits again when that wait times out, so a request never waits
    /// on slow runs alone while it may still try elsewhere).
    fn beside_slow(&mut self, request: RequestId) {
        let Some((model, long, candidates)) = self.untried(request) else {
            return;
        };
        if candidates.is_empty() {
            return;
        }
        // Beside a slow run the first provider free will do: no waiting for a placement.
        match self.pick(&model, &candidates, long, None) {
            Pick::Now(candidate) => self.grant(request, &candidate),
            _ => {
                // Every other provider is busy: the first one free is tried beside it.
                self.requests.retry_queued(request);
                self.wait(request, candidates, None);
            }
        }
    }

    /// Where a request goes now among `candidates`, on a node heard from within its
    /// heartbeat timeout. Placed by its conversation (`placement`,
    /// [`affinity`](super::affinity)): the first provider of its order whose load (in
    /// flight and waiting for it) stays within the bound, at once if it has room, else it
    /// waits for that one; with none within the bound, and without a placement,
    /// `Pool::pick`'s least loaded with room.
    fn pick(
        &mut self,
        model: &str,
        candidates: &[Candidate],
        long: bool,
        placement: Option<&Placement>,
    ) -> Pick {
        if let Some(placement) = placement
            && candidates.len() > 1
        {
            let order = self.order(candidates, placement);
            let total: u64 = order.iter().map(|o| u64::from(o.load)).sum();
            let live = order.len() as u64;
            // Consistent hashing with bounded loads: no provider above `load_factor`
            // times the mean, this request counted, unless it is within its own
            // capacity (a provider with room is no hot spot, and an Edge that sees
            // little of a cluster's load would otherwise scatter conversations).
            let factor = u64::from(self.config.routing.affinity.load_factor_percent);
            let bound = ((total + 1) * factor).div_ceil(100 * live.max(1));
            let anchor = placement.anchor_blocks();
            if let Some(o) = order
                .iter()
                .find(|o| u64::from(o.load) < bound.max(u64::from(o.capacity)))
            {
                let why = if placement.keyed() {
                    Placed::Session
                } else if o.matched > anchor {
                    Placed::Prefix
                } else {
                    Placed::Anchor
                };
                self.placed[why.index()] += 1;
                self.matched_blocks += o.matched as u64;
                let Some(candidate) = candidates.iter().find(|c| c.resource == o.resource) else {
                    return Pick::Busy;
                };
                return if self.pool.free(o.resource, long) > 0 {
                    Pick::Now(candidate.clone())
                } else {
                    Pick::WaitFor(candidate.clone())
                };
            }
            self.placed[Placed::Balance.index()] += 1;
        }
        let (registry, now) = (&self.registry, self.now);
        let timeout = self.config.timing.heartbeat_timeout;
        match self.pool.pick(now, model, candidates, long, |node| {
            registry.heard_within(node, now, timeout)
        }) {
            Some(candidate) => Pick::Now(candidate),
            None => Pick::Busy,
        }
    }

    /// `candidates` in `placement`'s order, those in the rotation on a node heard from
    /// only: without a session key, a remembered prefix reaching past the anchor first
    /// (longest first); then by rendezvous rank (ties by configuration order).
    fn order(&self, candidates: &[Candidate], placement: &Placement) -> Vec<Ordered> {
        let timeout = self.config.timing.heartbeat_timeout;
        let anchor = placement.anchor_blocks();
        let mut order: Vec<Ordered> = candidates
            .iter()
            .filter(|c| self.pool.pickable(self.now, c.resource))
            .filter_map(|c| {
                let meta = self.pool.meta(c.resource);
                let node = self.registry.node(meta.node);
                if !self.registry.heard_within(meta.node, self.now, timeout) {
                    return None;
                }
                let usage = self.pool.usage(c.resource);
                let (queued, _) = self.pool.queued_at(c.resource);
                let matched = self.prefixes.matched(placement, c.resource);
                Some(Ordered {
                    resource: c.resource,
                    rank: placement.rank((&node.id, &meta.provider_id)),
                    // A session goes by its key alone: what this Edge remembers of other
                    // sessions' prompts must not move it where other Edges would not.
                    past_anchor: if matched > anchor && !placement.keyed() {
                        matched
                    } else {
                        0
                    },
                    matched,
                    load: usage.in_flight
                        + usage.held_elsewhere
                        + u32::try_from(queued).unwrap_or(u32::MAX),
                    capacity: usage.capacity,
                })
            })
            .collect();
        order.sort_by(|a, b| b.past_anchor.cmp(&a.past_anchor).then(b.rank.cmp(&a.rank)));
        order
    }

    /// How `submit` is placed, in a group of `candidates` providers: `None` by load.
    fn placement(&self, model: &str, submit: &Submit, candidates: usize) -> Option<Arc<Placement>> {
        if candidates < 2 {
            return None;
        }
        let affinity = &self.config.routing.affinity;
        let mode = self
            .config
            .models
            .get(model)
            .and_then(|m| m.affinity)
            .unwrap_or(affinity.mode);
        Placement::of(
            mode,
            model,
            submit.session.as_deref(),
            &submit.body,
            affinity.anchor_bytes,
        )
        .map(Arc::new)
    }

    /// Serves waiters listing `resource` while it has free capacity, oldest first (none
    /// while its node is silent past its heartbeat timeout).
    fn pump(&mut self, resource: ResourceId) {
        let timeout = self.config.timing.heartbeat_timeout;
        if !self
            .registry
            .heard_within(self.pool.meta(resource).node, self.now, timeout)
        {
            return;
        }
        while let Some(waiter) = self.pool.next_for(self.now, resource) {
            if self
                .requests
                .endpoint(waiter.request)
                .is_some_and(|e| !self.pool.meta(resource).serves(e))
            {
                self.requeue_for_endpoint(waiter);
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
            self.grant(waiter.request, &candidate);
        }
    }

    /// A tunnel-only waiter reached a provider that no longer serves its route (a
    /// configuration refresh changed its adapter while the request waited). It goes on
    /// with its candidates that still do: granted at once where one has room, otherwise
    /// queued again, behind, with its deadline kept; with none left it fails, unless it
    /// waited beside a slow run, which then goes on alone (as when such a wait expires).
    fn requeue_for_endpoint(&mut self, waiter: Waiter) {
        let request = waiter.request;
        let Some(endpoint) = self.requests.endpoint(request) else {
            return;
        };
        // The request's candidates: a waiter placed on one provider lists only that one.
        let listed = self
            .requests
            .get(request)
            .map_or_else(|| waiter.candidates.clone(), |r| r.candidates.clone());
        let candidates: Arc<[Candidate]> = listed
            .iter()
            .filter(|c| self.pool.meta(c.resource).serves(endpoint))
            .cloned()
            .collect();
        if candidates.is_empty() && self.requests.has_live(request) {
            self.requests.unqueued(request);
            return;
        }
        if candidates.is_empty() {
            let mut cx = cx!(self);
            let outcome = Outcome::Failed(RequestError::Unsupported {
                model: waiter.model.clone(),
            });
            self.requests.end(&mut cx, request, outcome);
            return;
        }
        if let Pick::Now(candidate) = self.pick(&waiter.model, &candidates, waiter.long, None) {
            self.grant(request, &candidate);
            return;
        }
        let ticket = self.pool.wait(Waiter {
            candidates: candidates.clone(),
            ..waiter
        });
        self.requests.queued(request, ticket, candidates);
    }

    /// Returns a lease: exactly once it frees a unit, which serves the oldest waiter that
    /// fits; a draining node whose last lease returned is closed.
    pub(super) fn release(&mut self, lease: Lease) {
        self.timers.stop(TimerKey::CancelGrace(lease.run));
        if self.pool.release(lease) == Release::Released {
            self.pump(lease.resource);
            self.close_if_drained(self.pool.meta(lease.resource).node);
        }
    }

    /// Returns the lease of a run its node refused: an unexplained refusal takes the
    /// provider's free units until its node reports its load or the hold passes (one
    /// heartbeat interval), so nothing goes straight back to a node that said it is full.
    fn release_refused(&mut self, lease: Lease, refusal: Refusal) {
        self.timers.stop(TimerKey::CancelGrace(lease.run));
        if self.pool.release(lease) != Release::Released {
            return;
        }
        let r = lease.resource;
        if refusal == Refusal::Unexplained && self.pool.hold_refused(r) {
            let until = self.now + self.config.timing.heartbeat_interval;
            self.timers.set(TimerKey::RefusalHold(r), until);
        }
        // A long run's refusal leaves short units free; a hold leaves nothing, and the
        // pump then serves no one.
        self.pump(r);
        self.close_if_drained(self.pool.meta(r).node);
    }

    /// Returns the lease of a cancelled run whose node did not confirm the cancel within
    /// the grace: the unit stays taken as a refusal's are (until the node reports its load
    /// or one heartbeat interval passes), since the node may still be stopping the run and
    /// would refuse a request sent there now.
    fn release_unconfirmed(&mut self, lease: Lease) {
        self.timers.stop(TimerKey::CancelGrace(lease.run));
        if self.pool.release(lease) != Release::Released {
            return;
        }
        let r = lease.resource;
        if self.pool.hold_unconfirmed(r) {
            let until = self.now + self.config.timing.heartbeat_interval;
            self.timers.set(TimerKey::RefusalHold(r), until);
        }
        // Another unit may be free: the held one is not the resource's only.
        self.pump(r);
        self.close_if_drained(self.pool.meta(r).node);
    }

    /// `r`'s refusal hold ends (its node reported its load, or the hold passed): units it
    /// held back serve waiters.
    fn end_refused_hold(&mut self, r: ResourceId) {
        self.timers.stop(TimerKey::RefusalHold(r));
        if self.pool.end_refused_hold(r) {
            self.pump(r);
        }
    }

    /// Waiters whose wait timed out end, [`Outcome::Expired`]; one that waited beside a
    /// slow run goes on with that run.
    pub(super) fn expire_waiters(&mut self) {
        while let Some(waiter) = self.pool.expired(self.now) {
            if self.requests.has_live(waiter.request) {
                // It waited beside slow runs: they go on, and it waits again for a
                // provider to try beside them (behind the others, with a new deadline),
                // until one answers or its caller's deadline ends it.
                self.requests.unqueued(waiter.request);
                if self.requests.only_slow_live(waiter.request) {
                    self.wait(waiter.request, waiter.candidates, None);
                }
                continue;
            }
            let mut cx = cx!(self);
            self.requests.end(&mut cx, waiter.request, Outcome::Expired);
        }
    }

    /// The caller left `request`.
    pub(super) fn cancel(&mut self, request: RequestId, reason: &str) -> Cancelled {
        let mut cx = cx!(self);
        match self.requests.cancel(&mut cx, request) {
            None => Cancelled::AlreadyEnded,
            Some(Cancel::Queued) => Cancelled::Now,
            Some(Cancel::Running(runs)) => {
                let grace = self.config.timing.cancel_grace;
                for (run, conn) in runs {
                    Requests::cancel_on_node(&mut cx, run, conn, reason.to_owned(), grace);
                }
                Cancelled::Now
            }
        }
    }

    /// A run event or tunnel part from `conn` for `run`, the run on `conn` its name gives
    /// (looked up by the caller; `None`: no run of this connection): only from the current
    /// ready owner; checked against its stream's contract; its end returns its lease.
    fn on_stream_of(&mut self, conn: ConnId, phase: Phase, run: Option<RunId>, item: StreamItem) {
        if !self.stream_allowed(conn, phase) {
            return;
        }
        let mut cx = cx!(self);
        let retry_on = self.config.routing.retry_on;
        let step = self.requests.observe(&mut cx, conn, run, item, &retry_on);
        self.after_step(conn, step);
    }

    /// Whether `conn` may send stream messages; a violation when it may not.
    fn stream_allowed(&mut self, conn: ConnId, phase: Phase) -> bool {
        if !matches!(phase, Phase::Owner { .. }) {
            self.violation(conn, ConnViolation::StreamBeforeRegister);
            return false;
        }
        if self.registry.ready_owner(conn, phase).is_none() {
            self.violation(conn, ConnViolation::StreamBeforeReady);
            return false;
        }
        true
    }

    fn after_step(&mut self, conn: ConnId, step: Step) {
        match step {
            Step::Ignored | Step::Progress => {}
            Step::FirstByte { run } => self.first_byte(run),
            Step::Failed {
                run,
                cause,
                retry_after,
                ..
            } => self.failed_before_first_byte(run, cause, retry_after),
            Step::Ended { lease } => {
                self.pool.undecided(lease.resource, lease.run);
                self.release(lease);
            }
            Step::Broken {
                run,
                lease,
                event,
                outcome,
            } => {
                self.pool.undecided(lease.resource, lease.run);
                self.release(lease);
                // A provider that breaks streams midway is as unhealthy as one that
                // fails before their first byte: its failures count to its ejection.
                self.provider_failed(lease.resource, run, None);
                if !self.try_resume(run.request, run, lease.resource, "error") {
                    let mut cx = cx!(self);
                    cx.out.request(run.request, event);
                    self.requests.end(&mut cx, run.request, outcome);
                }
            }
            Step::Violated {
                run,
                lease,
                conn: on,
                terminal,
                cancel,
                detail,
            } => {
                self.out.event(EdgeEvent::PeerViolation {
                    conn,
                    node_id: self.registry.node_of(conn),
                    violation: Violation::Stream {
                        run,
                        violation: detail.clone(),
                    },
                });
                if terminal {
                    self.release(lease);
                } else if cancel {
                    let mut cx = cx!(self);
                    let grace = self.config.timing.cancel_grace;
                    let reason = format!("protocol violation: {detail}");
                    Requests::cancel_on_node(&mut cx, run, on, reason, grace);
                }
            }
        }
    }

    /// A run event or tunnel frame that breaks the message contract (e.g. an unknown
    /// type): the run it names fails as for any stream violation; one that names no run
    /// of this connection is reported and dropped. The connection stays.
    fn bad_stream_item(
        &mut self,
        conn: ConnId,
        phase: Phase,
        run_id: &str,
        error: ValidationError,
    ) {
        if !self.stream_allowed(conn, phase) {
            return;
        }
        let Some(run) = self.requests.run_on(conn, run_id) else {
            self.out.event(EdgeEvent::PeerViolation {
                conn,
                node_id: self.registry.node_of(conn),
                violation: Violation::Stray(error),
            });
            return;
        };
        let mut cx = cx!(self);
        if let Some(step) = self
            .requests
            .invalid(&mut cx, run, StreamViolation::Invalid(error))
        {
            self.after_step(conn, step);
        }
    }

    // ----- control traffic -----

    /// A query command for a ready node (see [`EdgeCore::handle_command`]).
    pub(super) fn command(
        &mut self,
        node_id: &str,
        mut request: crate::wire::NodeCommandRequest,
    ) -> Result<CommandId, CommandError> {
        request.request_id = self.control.next_command().to_string();
        request.validate().map_err(CommandError::Invalid)?;
        let node = self
            .registry
            .configured(node_id)
            .ok_or_else(|| CommandError::UnknownNode(node_id.to_owned()))?;
        let entry = self.registry.node(node);
        if request.r#type == crate::wire::NodeCommandType::OllamaApi as i32 {
            let ollama = entry
                .spec
                .as_ref()
                .and_then(|spec| spec.adapter(&request.adapter))
                .is_some_and(|a| a.r#type == AdapterType::Ollama as i32);
            if !ollama {
                return Err(CommandError::NotOllama {
                    node: node_id.to_owned(),
                    adapter: request.adapter.clone(),
                });
            }
        }
        let owner = entry
            .owner
            .filter(|o| o.ready)
            .ok_or_else(|| CommandError::NotReady(node_id.to_owned()))?;
        let to = control::CommandTarget {
            node,
            node_id: entry.id.clone(),
            generation: owner.generation,
            conn: owner.conn,
        };
        let timeout = self.config.timing.refresh_timeout;
        let mut cx = cx!(self);
        Ok(self.control.command(&mut cx, to, request, timeout))
    }

    fn push_refresh(&mut self, node: NodeIdx) {
        let entry = self.registry.node(node);
        let (Some(owner), Some(spec)) = (entry.owner, &entry.spec) else {
            return;
        };
        let payload = spec.payload(entry.revision);
        let timeout = self.config.timing.refresh_timeout;
        let mut cx = cx!(self);
        self.control
            .push_refresh(&mut cx, node, owner.conn, payload, timeout);
    }

    fn on_refresh_response(&mut self, conn: ConnId, phase: Phase, resp: NodeConfigRefreshResponse) {
        let Some((node, generation)) = self.registry.ready_owner(conn, phase) else {
            return;
        };
        let node_id = self.registry.node(node).id.clone();
        let mut cx = cx!(self);
        match self.control.refresh_answered(&mut cx, node, &node_id, resp) {
            control::Refreshed::Stale => {}
            control::Refreshed::Failed(failure) => self.drain_node(node, failure.into()),
            control::Refreshed::Applied { revision } => {
                self.registry.applied(node, revision);
                self.sync_resources(node, generation, None);
                // The configuration may have moved on while this refresh was in flight.
                if self.registry.node(node).revision != revision {
                    self.push_refresh(node);
                }
            }
        }
    }

    /// Node `node` gets no new work, and its connection closes once its last lease
    /// returns: it cannot take its configuration (it then registers again and receives
    /// the configuration in its `RegisterResponse`, or fails to become ready, visibly),
    /// or it is stopping gracefully (the close tells it that nothing more will come). A
    /// node already draining keeps its first reason.
    pub(super) fn drain_node(&mut self, node: NodeIdx, reason: DrainReason) {
        let Some(owner) = self.registry.start_draining(node, &reason) else {
            return;
        };
        for (_, r) in self.registry.node(node).resources.clone() {
            self.pool.stop_granting(r, Some(owner.generation));
        }
        self.out.event(EdgeEvent::NodeDraining {
            node_id: self.registry.node(node).id.clone(),
            reason,
            in_flight: self.in_flight_on(node),
        });
        self.close_if_drained(node);
    }

    /// Leases held on node `node`'s current generation.
    fn in_flight_on(&self, node: NodeIdx) -> u32 {
        let entry = self.registry.node(node);
        let Some(owner) = entry.owner else {
            return 0;
        };
        self.pool
            .in_flight(entry.resources.iter().map(|(_, r)| *r), owner.generation)
    }

    fn close_if_drained(&mut self, node: NodeIdx) {
        let entry = self.registry.node(node);
        let (Some(drain), Some(owner)) = (entry.draining.clone(), entry.owner) else {
            return;
        };
        if self.in_flight_on(node) > 0 {
            return;
        }
        let reason = match drain {
            DrainReason::Refresh(failure) => CloseReason::RefreshFailed(failure),
            DrainReason::Stopping(_)
            | DrainReason::HandingOver { .. }
            | DrainReason::Cluster(_) => CloseReason::Drained,
        };
        let mut cx = cx!(self);
        self.registry.close(&mut cx, owner.conn, reason.clone());
        self.fence(node, owner.generation, reason);
    }

    // ----- configuration -----

    /// Adopts a validated configuration: nodes, resources and model groups.
    pub(super) fn install(&mut self, config: EdgeConfig) {
        self.prefixes.resize(config.routing.affinity.prefix_entries);
        for (node, name) in self.registry.install(&config) {
            let shape = self
                .registry
                .node(node)
                .spec
                .as_ref()
                .and_then(|s| s.adapter(&name))
                .map_or(DispatchShape::Run, DispatchShape::for_adapter);
            let r = self.pool.add_resource(node, name.clone(), shape);
            self.registry.attach(node, name, r);
        }
        // A configuration may serve an adapter another way than before.
        for node in self.registry.indices() {
            let entry = self.registry.node(node);
            let Some(spec) = &entry.spec else { continue };
            for (name, r) in &entry.resources {
                if let Some(adapter) = spec.adapter(name) {
                    self.pool.set_serving(*r, adapter);
                }
            }
        }
        let mut models = Vec::new();
        for (name, spec) in &config.models {
            let mut long_possible = false;
            let candidates: Vec<Candidate> = spec
                .candidates
                .iter()
                .filter_map(|c| {
                    let adapter = config.nodes.get(&c.node_id)?.adapter(&c.provider_id)?;
                    if !adapter.enabled {
                        return None;
                    }
                    long_possible |= adapter.long_capacity > 0;
                    Some(Candidate {
                        resource: self.resource(&c.node_id, &c.provider_id)?,
                        target: c.target.as_str().into(),
                    })
                })
                .collect();
            let mut model = Model::new(
                Arc::from(name.as_str()),
                candidates.into(),
                spec.long_context_threshold,
                long_possible,
            );
            model.context_tokens = spec.context_tokens;
            models.push(model);
        }
        self.pool.install_models(models);
        self.config = config;
    }

    /// Replaces the configuration (see [`EdgeCore::handle_config`]).
    pub(super) fn reconfigure(
        &mut self,
        config: EdgeConfig,
    ) -> Result<crate::edge_config::ConfigDiff, EdgeConfigError> {
        config.validate()?;
        let diff = self.config.diff(&config);
        // A removed node is closed; a changed token revokes the connection that
        // registered with the old one.
        let revoked = diff
            .removed_nodes
            .iter()
            .map(|id| (id, CloseReason::NodeRemoved))
            .chain(
                diff.changed_tokens
                    .iter()
                    .map(|id| (id, CloseReason::CredentialsChanged)),
            );
        for (node_id, reason) in revoked.collect::<Vec<_>>() {
            if let Some(node) = self.registry.idx(node_id)
                && let Some(owner) = self.registry.node(node).owner
            {
                let mut cx = cx!(self);
                self.registry.close(&mut cx, owner.conn, reason.clone());
                self.fence(node, owner.generation, reason);
            }
        }
        for node_id in &diff.changed_payloads {
            if let Some(node) = self.registry.idx(node_id) {
                self.registry.bump_revision(node);
                self.control.new_revision(node);
            }
        }
        self.install(config);
        for node_id in &diff.changed_payloads {
            if let Some(node) = self.registry.idx(node_id)
                && self.registry.node(node).owner.is_some_and(|o| o.ready)
            {
                self.push_refresh(node);
            }
        }
        Ok(diff)
    }

    // ----- timers -----

    /// What a timer does when it fires.
    pub(super) fn fire(&mut self, key: TimerKey) {
        let timing = self.config.timing;
        let mut cx = cx!(self);
        match key {
            TimerKey::Handshake(conn) => {
                if let Some(phase) = self.registry.handshake_pending(conn) {
                    self.registry
                        .close(&mut cx, conn, CloseReason::HandshakeTimeout);
                    if let Phase::Owner { node, generation } = phase {
                        self.fence(node, generation, CloseReason::HandshakeTimeout);
                    }
                }
            }
            TimerKey::Liveness(conn) => {
                if let Some(phase) = self
                    .registry
                    .silent(&mut cx, conn, timing.heartbeat_timeout)
                {
                    self.registry
                        .close(&mut cx, conn, CloseReason::HeartbeatTimeout);
                    if let Phase::Owner { node, generation } = phase {
                        self.fence(node, generation, CloseReason::HeartbeatTimeout);
                    }
                }
            }
            TimerKey::Ping(conn) => self.registry.ping(&mut cx, conn, timing.heartbeat_interval),
            TimerKey::Answer(conn) => self.registry.answer_held(&mut cx, conn),
            TimerKey::Refresh(node) => {
                let node_id = self.registry.node(node).id.clone();
                match self.control.refresh_timed_out(&mut cx, node, &node_id) {
                    None => {}
                    Some(true) => self.push_refresh(node),
                    Some(false) => {
                        self.drain_node(node, RefreshFailure::Unanswered(MAX_REFRESH_TRIES).into())
                    }
                }
            }
            TimerKey::Command(seq) => {
                self.control
                    .fail(&mut cx, seq, "the node did not answer in time");
            }
            TimerKey::CancelGrace(run) => {
                if let Some(lease) = self.requests.grace_over(run) {
                    self.pool.undecided(lease.resource, lease.run);
                    self.release_unconfirmed(lease);
                }
            }
            TimerKey::Probe(resource) => self.pump(resource),
            TimerKey::RefusalHold(resource) => self.end_refused_hold(resource),
            TimerKey::Stall(run) => self.stall_check(run),
            TimerKey::Placed(request) => self.placed_wait_over(request),
        }
    }

    /// How long a committed run of `request` may go silent before its answer is
    /// continued elsewhere: its model's stall timeout, for a request that may be
    /// continued.
    fn stall_timeout(&self, request: RequestId) -> Option<Duration> {
        if !self.requests.may_resume(request) {
            return None;
        }
        self.requests
            .get(request)
            .and_then(|r| self.config.models.get(&*r.model))
            .and_then(|m| m.stall_timeout)
    }

    /// The stall timer of `run` fired: re-armed from its last event while it sends;
    /// when it has been silent the whole time and its answer can be continued, it is
    /// cancelled on its node and the answer continued elsewhere. (When it cannot be, the
    /// stream waits on, as without a stall timeout.)
    fn stall_check(&mut self, run: RunId) {
        let Some(stall) = self.stall_timeout(run.request) else {
            return;
        };
        let Some(r) = self.requests.run(run) else {
            return;
        };
        let due = r.last_event + stall;
        if due > self.now {
            self.timers.set(TimerKey::Stall(run), due);
            return;
        }
        let resource = r.lease.resource;
        if !self.continues_elsewhere(run.request, resource)
            || !self.requests.continuable(run.request)
        {
            return;
        }
        let Some((_, conn)) = self.requests.stalled(run) else {
            return;
        };
        let grace = self.config.timing.cancel_grace;
        let mut cx = cx!(self);
        let reason = format!("no event for {} ms: continued elsewhere", stall.as_millis());
        Requests::cancel_on_node(&mut cx, run, conn, reason, grace);
        self.provider_failed(resource, run, None);
        if !self.try_resume(run.request, run, resource, "stall") {
            // Cannot be continued after all: the caller gets what a lost run gets.
            let node_id = self.registry.node(self.pool.meta(resource).node).id.clone();
            let why = Outcome::Failed(RequestError::NodeLost { node_id });
            let mut cx = cx!(self);
            self.requests.end(&mut cx, run.request, why);
        }
    }

    // ----- the cluster (docs/cluster.md; its state is `cluster.rs`'s) -----

    /// Makes this Edge a cluster member's: from now on every authenticated register waits
    /// for [`handle_claim`](Self::handle_claim). Call before the first connection.
    pub fn enable_cluster(&mut self) {
        self.cluster.enabled = true;
    }

    /// The cluster member may serve ([`ClusterMember::is_serving`](crate::cluster::ClusterMember::is_serving)):
    /// the shared configuration is applied here, and registers are judged from now on.
    /// Before it, a register in cluster mode is refused with a retry (`cluster_unavailable`),
    /// never as unknown: a node whose id only the shared configuration names would hear
    /// "authentication failed" from an Edge that is merely starting.
    pub fn handle_cluster_serving(&mut self, now: Timestamp) {
        self.advance(now);
        if !self.cluster.serving {
            self.cluster.serving = true;
            self.cluster.serving_since = now;
        }
    }

    /// Whether a member of a cluster should take callers (its `/healthz`): some model
    /// group has a live provider here, or none is configured, or it began to serve less than
    /// two heartbeat intervals or one register timeout ago, whichever is longer (the
    /// nodes that follow the cluster dial a new member as soon as they hear of it, and a
    /// hand-over re-homes its nodes within moments). A member whose nodes all went elsewhere, or that
    /// lost them in a hand-over, would otherwise hold its callers until their queue wait
    /// ran out while the other members could answer them: answering 503 sends the
    /// balancer's callers to those (when no member has a node, every member answers 503:
    /// the fabric cannot serve). Outside cluster mode, always true.
    #[must_use]
    pub fn takes_callers(&self, now: Timestamp) -> bool {
        if !self.cluster.enabled {
            return true;
        }
        let timing = &self.config.timing;
        let grace = (timing.heartbeat_interval * 2).max(timing.register_timeout);
        if !self.cluster.serving
            || now.saturating_duration_since(self.cluster.serving_since) < grace
        {
            return true;
        }
        let mut models = self.pool.models().peekable();
        models.peek().is_none()
            || models.any(|model| {
                model.candidates.iter().any(|c| {
                    let usage = self.pool.usage(c.resource);
                    usage.generation.is_some() && usage.capacity > 0
                })
            })
    }

    /// Whether [`enable_cluster`](Self::enable_cluster) was called.
    #[must_use]
    pub fn is_cluster(&self) -> bool {
        self.cluster.enabled
    }

    /// The cluster's answer to the [`EdgeEvent::ClaimNode`] of `conn`. A connection that
    /// closed meanwhile, or an answer nobody waits for, changes nothing (the instance is
    /// released if nothing here serves it).
    pub fn handle_claim(&mut self, now: Timestamp, conn: ConnId, decision: ClaimDecision) {
        self.advance(now);
        let Some((node, req)) = self.cluster.awaiting.remove(&conn) else {
            return;
        };
        self.cluster.ended.push((node, req.instance_id));
        let Ok(phase) = self.registry.phase(conn) else {
            return;
        };
        match decision {
            ClaimDecision::Admitted { .. } => {
                self.take_node(conn, phase, &req, ClusterStep::Claimed);
            }
            ClaimDecision::HeldBy { instance } => {
                let mut cx = cx!(self);
                self.registry
                    .refuse_claim(&mut cx, conn, node, Some(instance));
            }
            ClaimDecision::Unavailable => {
                let mut cx = cx!(self);
                self.registry.refuse_claim(&mut cx, conn, node, None);
            }
        }
    }

    /// The cluster member can no longer vouch for `instance` of `node_id` (its node lease
    /// or the Edge's membership ran out): the node drains, taking no new work, and closes
    /// once its work has ended. Another instance does not lose its connection.
    pub fn handle_cluster_fence(&mut self, now: Timestamp, node_id: &str, instance: u64) {
        self.advance(now);
        let Some(node) = self.registry.idx(node_id) else {
            return;
        };
        if self
            .registry
            .node(node)
            .owner
            .is_some_and(|o| o.instance() == instance)
        {
            self.drain_node(
                node,
                DrainReason::Cluster("this edge can no longer vouch for the node id in etcd"),
            );
        }
    }

    /// The cluster's members changed: every node that follows the cluster is told. A
    /// member that could not go on the wire (an empty or oversized id or address) is left
    /// out, and at most [`MAX_CLUSTER_MEMBERS`](crate::wire::MAX_CLUSTER_MEMBERS) are told.
    pub fn handle_cluster_members(&mut self, now: Timestamp, mut members: ClusterMembers) {
        self.advance(now);
        let fits = |text: &str| !text.is_empty() && text.len() <= crate::wire::MAX_NODE_ID_BYTES;
        members
            .members
            .retain(|m| fits(&m.edge_id) && fits(&m.node_addr));
        members.members.truncate(crate::wire::MAX_CLUSTER_MEMBERS);
        if self.cluster.members.as_ref() == Some(&members) {
            return;
        }
        for i in self.registry.indices() {
            if let Some(owner) = self.registry.node(i).owner.filter(|o| o.cluster) {
                self.out
                    .send(owner.conn, Body::ClusterMembers(members.clone()));
            }
        }
        self.cluster.members = Some(members);
    }

    /// Emits [`EdgeEvent::ReleaseNode`] for every instance that lost its last connection
    /// here and waits for no claim.
    pub(super) fn settle_cluster(&mut self) {
        if self.cluster.ended.is_empty() {
            return;
        }
        let mut ended = std::mem::take(&mut self.cluster.ended);
        ended.sort_unstable();
        ended.dedup();
        for (node, instance) in ended {
            let entry = self.registry.node(node);
            let served = entry.owner.is_some_and(|o| o.instance() == instance);
            let waiting = self
                .cluster
                .awaiting
                .values()
                .any(|(n, r)| *n == node && r.instance_id == instance);
            if !served && !waiting {
                self.out.event(EdgeEvent::ReleaseNode {
                    node_id: entry.id.clone(),
                    instance,
                });
            }
        }
    }

    /// A register that may take its node (its claim admitted, or no cluster): through the
    /// registry's rules, then taken.
    pub(super) fn take_node(
        &mut self,
        conn: ConnId,
        phase: Phase,
        req: &RegisterRequest,
        step: ClusterStep,
    ) {
        let mut cx = cx!(self);
        match self
            .registry
            .admit(&mut cx, conn, phase, req, &self.config, step)
        {
            Admitted::Refused => {}
            Admitted::Violation(violation) => self.violation(conn, violation),
            Admitted::Claim { node } => {
                self.cluster.wait(conn, node, req);
                self.out.event(EdgeEvent::ClaimNode {
                    conn,
                    node_id: self.registry.node(node).id.clone(),
                    instance: req.instance_id,
                });
            }
            Admitted::Take { node, superseding } => {
                if let Some(old) = superseding {
                    self.fence(node, old.generation, CloseReason::Superseded);
                }
                let mut cx = cx!(self);
                let members = self.cluster.members.as_ref();
                self.registry
                    .take(&mut cx, conn, node, req, &self.config, members);
            }
        }
    }

    // ----- what crosses sub-states to report -----

    /// The configured nodes, by node id: the order status pages list them in.
    fn configured_by_id(&self) -> Vec<NodeIdx> {
        let mut order: Vec<NodeIdx> = self
            .registry
            .indices()
            .filter(|&i| self.registry.node(i).spec.is_some())
            .collect();
        order.sort_by(|&a, &b| self.registry.node(a).id.cmp(&self.registry.node(b).id));
        order
    }

    /// One snapshot per configured provider, in node id then configuration order.
    /// Providers of offline or pending nodes are listed `UNAVAILABLE`/`OFFLINE` with every
    /// figure 0; disabled ones `DISABLED`/`OFFLINE` with every figure 0.
    #[must_use]
    pub fn snapshots(&self) -> Vec<ProviderSnapshot> {
        let order = self.configured_by_id();
        let mut out = Vec::new();
        for node in order {
            self.push_snapshots(node, &mut out);
        }
        out
    }

    fn push_snapshots(&self, node: NodeIdx, out: &mut Vec<ProviderSnapshot>) {
        let entry = self.registry.node(node);
        let Some(spec) = &entry.spec else { return };
        let ready = entry.owner.is_some_and(|o| o.ready);
        for adapter in &spec.adapters {
            let name = adapter.instance_name();
            let kind = AdapterType::try_from(adapter.r#type).unwrap_or_default();
            let mut snap = ProviderSnapshot {
                node_id: entry.id.to_string(),
                provider_id: name.to_owned(),
                category: category_of(kind) as i32,
                status: ProviderStatus::Unavailable as i32,
                health: ProviderHealth::Offline as i32,
                targets: adapter.targets.clone(),
                ..ProviderSnapshot::default()
            };
            let resource = entry
                .resources
                .iter()
                .find(|(n, _)| &**n == name)
                .map(|(_, r)| *r);
            let usage = resource.map(|r| self.pool.usage(r)).unwrap_or_default();
            if !adapter.enabled {
                snap.status = ProviderStatus::Disabled as i32;
            } else if ready && usage.generation.is_some() {
                let (queued, long_queued) = resource.map_or((0, 0), |r| self.pool.queued_at(r));
                // Out of the rotation (ejected, or waiting for its probe): degraded.
                let live = resource
                    .is_none_or(|r| self.pool.standing(self.now, r) == crate::edge::Standing::Live);
                snap.status = ProviderStatus::Available as i32;
                snap.health = if live {
                    ProviderHealth::Healthy as i32
                } else {
                    ProviderHealth::Degraded as i32
                };
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

    /// Node `node` became ready or was fenced: each enabled provider's health as
    /// `/v1/status` reports it now, for operators.
    fn health_changed(&mut self, node: NodeIdx) {
        let mut snapshots = Vec::new();
        self.push_snapshots(node, &mut snapshots);
        for s in snapshots {
            if s.status == ProviderStatus::Disabled as i32 {
                continue;
            }
            self.out.lifecycle.push_back(Lifecycle::ProviderHealth {
                node_id: s.node_id,
                provider_id: s.provider_id,
                health: ProviderHealth::try_from(s.health)
                    .unwrap_or(ProviderHealth::Offline)
                    .word(),
            });
        }
    }

    /// Every configured provider as routing sees it (in the rotation, ejected, probed;
    /// its recent failures and first-byte latency), in the order of
    /// [`snapshots`](Self::snapshots).
    #[must_use]
    pub fn provider_routing(&self) -> Vec<ProviderRouting> {
        let order = self.configured_by_id();
        let routing = &self.config.routing;
        let mut out = Vec::new();
        for node in order {
            let entry = self.registry.node(node);
            let Some(spec) = &entry.spec else { continue };
            for adapter in &spec.adapters {
                let name = adapter.instance_name();
                let Some(r) = entry
                    .resources
                    .iter()
                    .find(|(n, _)| &**n == name)
                    .map(|(_, r)| *r)
                else {
                    continue;
                };
                let (consecutive_failures, failure_share, latency) =
                    self.pool.health_figures(self.now, r, routing);
                let standing = self.pool.standing(self.now, r);
                out.push(ProviderRouting {
                    node_id: entry.id.clone(),
                    provider_id: self.pool.meta(r).provider_id.clone(),
                    standing,
                    ejected_for: match standing {
                        Standing::Ejected { until, .. } => {
                            Some(until.saturating_duration_since(self.now))
                        }
                        _ => None,
                    },
                    consecutive_failures,
                    failure_share,
                    first_byte: latency.map(Duration::from_secs_f64),
                    held_elsewhere: self.pool.usage(r).held_elsewhere,
                    refused_hold: self.pool.usage(r).refused_hold,
                });
            }
        }
        out
    }

    /// Whether a request may be sent to `resource` now: in the rotation and not on trial
    /// with a request in flight, or due its probe (for tests that check no waiter waits
    /// while a provider could take it).
    #[must_use]
    pub fn pickable(&self, resource: ResourceId) -> bool {
        self.pool.pickable(self.now, resource)
    }

    /// Configured nodes and their readiness, in id order.
    #[must_use]
    pub fn nodes(&self) -> Vec<NodeStatus> {
        self.registry
            .statuses(self.now, |node| self.control.last_refresh(node))
    }
}

/// The units `held` names for adapter `name`: (requests, long-context requests).
fn load_of(held: &[AdapterLoad], name: &str) -> (u32, u32) {
    held.iter()
        .find(|l| l.adapter == name)
        .map_or((0, 0), |l| (l.in_flight, l.long_in_flight))
}

/// A node's refusal of a run, as the Edge's ledger sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    /// Without that run, the units this Edge holds and those the node reported held
    /// elsewhere fill the provider: another session took the slot.
    Explained,
    /// The ledger had room: the node holds work this Edge cannot see.
    Unexplained,
}

/// What becomes of a request whose run failed before its first byte
/// ([`EdgeCore::verdict`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// Dispatched again: at once on a provider with room it has not failed on, else it
    /// waits in the queue for one (after an attempt: within `max_attempts` and the retry
    /// budget; after a refusal: not an attempt, within the unexplained refusals).
    Again,
    /// Another of its runs may still answer (one tried beside a slow one): this run is
    /// only given up.
    LeftToSibling,
    /// Refused while this Edge hands over: it ends retryable at the successor.
    HandedOver,
    /// Nothing else can answer and the run has no answer to give (a broken stream): it
    /// fails with the run's cause.
    Failed,
    /// Nothing else can answer: the caller gets what the run said (a provider's status
    /// and body, a node's refusal).
    Answered,
}

/// Where [`EdgeCore::pick`] sends a request.
#[derive(Debug)]
enum Pick {
    /// There, now.
    Now(Candidate),
    /// Placed there by its conversation, which is full: it waits for it.
    WaitFor(Candidate),
    /// Nowhere has room: it waits for any.
    Busy,
}

/// A candidate in a placement's order ([`EdgeCore::order`]).
#[derive(Clone, Copy, Debug)]
struct Ordered {
    resource: ResourceId,
    rank: u64,
    /// Blocks remembered past the anchor (0 when not past it).
    past_anchor: usize,
    matched: usize,
    /// Requests in flight there (from this Edge and, as its node reports, others) and
    /// waiting for it.
    load: u32,
    /// Requests it takes at once.
    capacity: u32,
}
