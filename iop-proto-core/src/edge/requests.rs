//! The requests the Edge owns, from submit to end: each one's call (body included), its
//! place in the queue or the runs serving it, and every run's stream, checked against
//! the run or tunnel contract before anything reaches the caller.
//!
//! A *request* is what a caller asked; a *run* is one dispatch of it to a provider, and
//! holds that provider's lease. A request may have several runs: a retry after a
//! provider failed, or a second try beside one that is slow to its first byte. Until
//! one of them *commits* (its first byte: a tunnel's response head, a run's first
//! content or its end), what they send is held back, so a failed run can be given up and
//! the request dispatched again without the caller seeing anything. Once a run commits,
//! its siblings are cancelled and nothing is retried any more.
//!
//! A run outlives its request, or its part in it, when it is given up: it is cancelled
//! on its node and keeps its lease until the node ends it or the cancel grace passes.
//!
//! Longer than the crate's ~800-line norm on purpose: a request and its runs share one
//! state (what is held, who committed, which runs are given up), and the stream checks
//! that decide a run's next step read and change that state at once; split, each half
//! would need the other's internals.

use super::ConnId;
use super::Cx;
use super::DispatchShape;
use super::EdgeCore;
use super::EdgeEvent;
use super::Outcome;
use super::RequestError;
use super::RequestEvent;
use super::StreamViolation;
use super::Submit;
use super::TimerKey;
use crate::idhash::IdMap;
use crate::lease::Lease;
use crate::lease::RequestId;
use crate::lease::ResourceId;
use crate::lease::RunId;
use crate::queue::Candidate;
use crate::queue::Ticket;
use crate::queue::Waiter;
use crate::time::Timestamp;
use crate::tunnel::Endpoint;
use crate::tunnel::TunnelPart;
use crate::wire::Body;
use crate::wire::CancelKind;
use crate::wire::CancelRequest;
use crate::wire::TunnelFrameKind;
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;

use super::pool::ResourceMeta;
use crate::edge_config::RetryOn;

/// Events a run may hold before its first byte (a run that only ever says nothing is
/// committed once it has held this many).
const MAX_HELD: usize = 32;

/// Bytes of answer a normalized run whose caller did not ask for a stream may hold before
/// its first byte: such an answer reaches the caller whole, at its terminal, so until
/// then the run may be retried like any failure before the first byte. A longer answer
/// is committed at this size (and passed on as it comes, as a streamed one is).
const MAX_HELD_WHOLE: usize = 4 << 20;

/// Requests by id, and the runs holding leases.
#[derive(Debug)]
pub(super) struct Requests {
    map: IdMap<RequestId, Request>,
    runs: IdMap<RunId, Run>,
    next: u64,
    /// Requests being retried (dispatched more than once, or queued again), for the
    /// retry budget.
    retrying: usize,
}

impl Default for Requests {
    fn default() -> Self {
        Requests {
            map: IdMap::default(),
            runs: IdMap::default(),
            next: 1,
            retrying: 0,
        }
    }
}

/// A caller's request.
#[derive(Debug)]
pub(super) struct Request {
    /// What the caller sent: every dispatch is built from it (its body is dropped once a
    /// run commits: no dispatch follows).
    call: Submit,
    /// Its model group's name.
    pub(super) model: Arc<str>,
    /// It needs long-context capacity.
    pub(super) long: bool,
    /// The providers that may serve it (the model group's, or its tunnel-served ones).
    pub(super) candidates: Arc<[Candidate]>,
    /// Where it waits, if it does.
    ticket: Option<Ticket>,
    /// Its runs that may still answer it.
    live: Few<RunId>,
    /// The run that answers it, once one reached its first byte.
    committed: Option<RunId>,
    /// Dispatches so far.
    attempts: u32,
    /// Dispatches a node refused before its provider was asked ([`Cause::Refused`]): not
    /// counted as attempts.
    refused: u32,
    /// Of those, refusals its ledger could not explain: bounded by [`MAX_REFUSALS`].
    unexplained_refusals: u32,
    /// Providers a run of it failed on: not tried again for it.
    failed: Vec<ResourceId>,
    /// What its caller is told if no other run can answer.
    last_failure: Option<Outcome>,
    /// Counted in [`Requests::retrying`].
    retrying: bool,
    /// Attempts made before its last continuation (a continuation counts afresh).
    attempts_before: u32,
    /// What a streamed answer keeps to be continued if its run is lost after its first
    /// byte; `None` for a request that is never continued.
    resume: Option<Resume>,
    /// What it says of its conversation, when its group places by it.
    pub(super) placement: Option<Arc<crate::edge::Placement>>,
}

/// One dispatch: its lease, its connection and its stream.
#[derive(Debug)]
pub(super) struct Run {
    pub(super) lease: Lease,
    pub(super) conn: ConnId,
    stream: Stream,
    /// Its request still waits on it; false once given up (the caller left, a sibling
    /// answered, it failed or broke its stream): it is cancelled on the node, and waits
    /// for the node to end it or the grace.
    serving: bool,
    /// It answers its request: what it sends goes to the caller.
    committed: bool,
    /// What it sent before its first byte.
    held: Few<RequestEvent>,
    /// Its terminal, held with the rest.
    held_end: Option<Outcome>,
    /// How its request is told who answers.
    dispatched: RequestEvent,
    /// When it was dispatched (its first-byte latency is measured from here).
    pub(super) started: Timestamp,
    /// Its caller gets the answer whole (a normalized run, not streamed): its first byte
    /// is its terminal.
    whole: bool,
    /// A whole answer's content began: it is no longer slow to its first byte (no
    /// provider is tried beside it), though it is not committed yet.
    producing: bool,
    /// The size of what it holds, for [`MAX_HELD_WHOLE`].
    held_bytes: usize,
    /// It went past its first-byte deadline (another provider may be tried beside it).
    slow: bool,
    /// When it last sent anything (for a stall of a committed run).
    pub(super) last_event: Timestamp,
}

impl Request {
    /// The route it came by.
    pub(super) fn endpoint(&self) -> Endpoint {
        self.call.endpoint
    }

    /// Whether it counts as being retried.
    pub(super) fn retrying(&self) -> bool {
        self.retrying
    }

    /// Whether it is answered by a continuation: only providers that continue exactly
    /// may serve it ([`Self::continues_on`]).
    pub(super) fn continued(&self) -> bool {
        self.resume.as_ref().is_some_and(|r| r.continued)
    }

    /// Whether the provider `meta` describes may continue its answer: one that declares
    /// it continues answers exactly, of the shape that answered first (a run's events
    /// and a tunnel's bytes reach the caller differently).
    pub(super) fn continues_on(&self, meta: &ResourceMeta) -> bool {
        meta.resumes
            && self
                .resume
                .as_ref()
                .is_some_and(|r| r.continues_on(meta.shape))
    }
}

impl Requests {
    /// Requests open, counting runs given up whose node has not ended them.
    pub(super) fn open(&self) -> usize {
        self.map.len() + self.runs.values().filter(|r| !r.serving).count()
    }

    /// Requests accepted and not ended.
    pub(super) fn accepted(&self) -> usize {
        self.map.len()
    }

    /// Requests being retried now.
    pub(super) fn retrying(&self) -> usize {
        self.retrying
    }

    /// Accepts `call` as a new request, not dispatched nor queued yet.
    pub(super) fn accept(
        &mut self,
        call: Submit,
        model: Arc<str>,
        long: bool,
        candidates: Arc<[Candidate]>,
        resume_limit: u32,
        placement: Option<Arc<crate::edge::Placement>>,
    ) -> RequestId {
        let resume = (call.stream && call.endpoint == Endpoint::Chat && resume_limit > 0)
            .then(|| Resume::new(resume_limit));
        let id = RequestId(self.next);
        self.next += 1;
        self.map.insert(
            id,
            Request {
                call,
                model,
                long,
                candidates,
                ticket: None,
                live: Few::default(),
                committed: None,
                attempts: 0,
                refused: 0,
                unexplained_refusals: 0,
                failed: Vec::new(),
                last_failure: None,
                retrying: false,
                attempts_before: 0,
                resume,
                placement,
            },
        );
        id
    }

    pub(super) fn get(&self, id: RequestId) -> Option<&Request> {
        self.map.get(&id)
    }

    pub(super) fn run(&self, run: RunId) -> Option<&Run> {
        self.runs.get(&run)
    }

    /// Whether `run` still serves its request and has not reached its first byte.
    pub(super) fn awaits_first_byte(&self, run: RunId) -> bool {
        self.runs
            .get(&run)
            .is_some_and(|r| r.serving && !r.committed && !r.producing)
    }

    /// The route `id` came by, which decides the providers that can answer it.
    pub(super) fn endpoint(&self, id: RequestId) -> Option<Endpoint> {
        self.map.get(&id).map(|r| r.call.endpoint)
    }

    /// Whether `id` waits in the queue (for its first dispatch, or a retry, or beside a
    /// slow run).
    pub(super) fn waiting(&self, id: RequestId) -> bool {
        self.map.get(&id).is_some_and(|r| r.ticket.is_some())
    }

    /// `id`'s wait, taken out of `waits` (it is to wait otherwise); `None` when it does not
    /// wait.
    pub(super) fn unwait(
        &mut self,
        waits: &mut crate::queue::WaitQueue,
        id: RequestId,
    ) -> Option<Waiter> {
        let r = self.map.get_mut(&id)?;
        let ticket = r.ticket.take()?;
        waits.remove(ticket)
    }

    /// The wait of `id` ended without a dispatch (it timed out while a run still tries).
    pub(super) fn unqueued(&mut self, id: RequestId) {
        if let Some(r) = self.map.get_mut(&id) {
            r.ticket = None;
        }
    }

    /// `id` waits in the queue with `ticket`, serving only `candidates` from now on.
    pub(super) fn queued(&mut self, id: RequestId, ticket: Ticket, candidates: Arc<[Candidate]>) {
        if let Some(r) = self.map.get_mut(&id) {
            r.ticket = Some(ticket);
            r.candidates = candidates;
        }
    }

    /// The wait of `id` as the queue keeps it, among `candidates`.
    pub(super) fn waiter(
        &self,
        id: RequestId,
        candidates: Arc<[Candidate]>,
        deadline: Timestamp,
    ) -> Option<Waiter> {
        let r = self.map.get(&id)?;
        Some(Waiter {
            request: id,
            model: r.model.clone(),
            long: r.long,
            candidates,
            deadline,
        })
    }

    /// How `id` is placed by its conversation, if it is.
    pub(super) fn placement(&self, id: RequestId) -> Option<Arc<crate::edge::Placement>> {
        self.map.get(&id)?.placement.clone()
    }

    /// The next run of `id`.
    pub(super) fn next_run(&self, id: RequestId) -> Option<RunId> {
        let r = self.map.get(&id)?;
        Some(RunId {
            request: id,
            attempt: r.attempts,
        })
    }

    /// Dispatches `lease.run` on `conn`: builds the message its provider is served
    /// with and sends it. The caller learns who answers when the run commits.
    pub(super) fn dispatch(
        &mut self,
        cx: &mut Cx<'_>,
        lease: Lease,
        conn: ConnId,
        meta: &ResourceMeta,
        node_id: &Arc<str>,
        target: &Arc<str>,
    ) {
        let run = lease.run;
        let Some(r) = self.map.get_mut(&run.request) else {
            return;
        };
        r.attempts += 1;
        r.ticket = None;
        r.live.push(run);
        if r.attempts > 1 && !r.retrying {
            r.retrying = true;
            self.retrying += 1;
        }
        let continuation = r.resume.as_ref().and_then(|c| c.body.clone());
        let native = meta.shape == DispatchShape::Tunnel
            && continuation.is_none()
            && r.call
                .native
                .as_ref()
                .is_some_and(|call| match call.dialect {
                    crate::tunnel::Dialect::Messages => meta.native_messages,
                });
        let (body, stream) = message(
            &r.call,
            continuation,
            &r.model,
            run,
            meta,
            target,
            lease.long,
            native,
        );
        match body {
            stream::Dispatched::Run(body) => cx.out.send(conn, body),
            stream::Dispatched::Tunnel(dispatch) => cx.out.send_tunnel(conn, dispatch),
        }
        cx.out.event(EdgeEvent::Attempt {
            run,
            node_id: node_id.clone(),
            provider_id: meta.provider_id.clone(),
            shape: meta.shape,
        });
        self.runs.insert(
            run,
            Run {
                lease,
                conn,
                stream,
                serving: true,
                committed: false,
                held: Few::default(),
                held_end: None,
                dispatched: RequestEvent::Dispatched {
                    run,
                    shape: meta.shape,
                    node_id: node_id.clone(),
                    provider_id: meta.provider_id.clone(),
                    native,
                },
                started: cx.now,
                whole: !r.call.stream && meta.shape == DispatchShape::Run,
                producing: false,
                held_bytes: 0,
                slow: false,
                last_event: cx.now,
            },
        );
    }

    /// `id` is queued for another provider: it counts as being retried.
    pub(super) fn retry_queued(&mut self, id: RequestId) {
        if let Some(r) = self.map.get_mut(&id)
            && !r.retrying
        {
            r.retrying = true;
            self.retrying += 1;
        }
    }

    /// `id` ends for its caller with `outcome` (its runs are done or given up); a wait it
    /// had (for a provider beside a slow one) ends with it.
    pub(super) fn end(&mut self, cx: &mut Cx<'_>, id: RequestId, outcome: Outcome) {
        if let Some(r) = self.map.remove(&id) {
            if r.retrying {
                self.retrying -= 1;
            }
            if let Some(ticket) = r.ticket {
                cx.waits.remove(ticket);
            }
            cx.out.request(id, RequestEvent::Ended(outcome));
        }
    }

    /// `id` ends with what its last failed run said (or `fallback`).
    pub(super) fn end_failed(&mut self, cx: &mut Cx<'_>, id: RequestId, fallback: Outcome) {
        let outcome = self
            .map
            .get_mut(&id)
            .and_then(|r| r.last_failure.take())
            .unwrap_or(fallback);
        self.end(cx, id, outcome);
    }

    /// The caller left: `id` ends now ([`Outcome::Cancelled`]); what it held is returned
    /// for the transitions to let go.
    pub(super) fn cancel(&mut self, cx: &mut Cx<'_>, id: RequestId) -> Option<Cancel> {
        let request = self.map.get(&id)?;
        let runs: Vec<RunId> = request
            .live
            .iter()
            .chain(request.committed.iter())
            .copied()
            .collect();
        self.end(cx, id, Outcome::Cancelled);
        if runs.is_empty() {
            return Some(Cancel::Queued);
        }
        Some(Cancel::Running(self.give_up_all(&runs)))
    }

    /// Marks `runs` given up; returns those still running, with their connections.
    fn give_up_all(&mut self, runs: &[RunId]) -> Vec<(RunId, ConnId)> {
        runs.iter()
            .filter_map(|run| {
                let r = self.runs.get_mut(run)?;
                r.serving = false;
                r.held.clear();
                Some((*run, r.conn))
            })
            .collect()
    }

    /// Sends `CancelRequest(CANCEL_RUN)` for `run` on `conn` and arms its cancel grace:
    /// its lease returns when the node ends the run or the grace passes.
    pub(super) fn cancel_on_node(
        cx: &mut Cx<'_>,
        run: RunId,
        conn: ConnId,
        reason: String,
        grace: Duration,
    ) {
        cx.out.send(
            conn,
            Body::CancelRequest(CancelRequest {
                run_id: run.wire(),
                kind: CancelKind::CancelRun as i32,
                reason,
            }),
        );
        cx.timers.set(TimerKey::CancelGrace(run), cx.now + grace);
    }

    /// `run` reached its first byte: it answers its request. What it held goes to the
    /// caller, after who answers; its siblings are given up.
    pub(super) fn commit(&mut self, cx: &mut Cx<'_>, run: RunId) -> Option<Committed> {
        let r = self.runs.get_mut(&run)?;
        r.committed = true;
        let held = std::mem::take(&mut r.held);
        let end = r.held_end.take();
        let dispatched = r.dispatched.clone();
        let request = self.map.get_mut(&run.request)?;
        request.committed = Some(run);
        request.live.retain(|&l| l != run);
        if let Some(ticket) = request.ticket.take() {
            // It waited for a provider beside a slow run, which answered after all.
            cx.waits.remove(ticket);
        }
        let siblings: Vec<RunId> = request.live.drain().collect();
        match request.resume.as_mut() {
            // No dispatch follows: the body is not needed any more.
            None => {
                request.call.body = Bytes::new();
                request.call.headers = crate::wire::ForwardedHeaders::default();
            }
            Some(resume) => resume.body = None,
        }
        if let (Some(resume), RequestEvent::Dispatched { shape, native, .. }) =
            (request.resume.as_mut(), &dispatched)
        {
            resume.begin(*shape, *native);
        }
        // A continuation's caller knows who answers already (the log keeps the first).
        if !request.continued() {
            cx.out.request(run.request, dispatched);
        }
        for event in held.into_iter() {
            deliver(request.resume.as_mut(), event, &mut |e| {
                cx.out.request(run.request, e);
            });
        }
        let siblings = self.give_up_all(&siblings);
        let ended = end.is_some();
        if let Some(outcome) = end {
            self.runs.remove(&run);
            cx.timers.stop(TimerKey::CancelGrace(run));
            self.end(cx, run.request, outcome);
        }
        Some(Committed { ended, siblings })
    }

    /// `run` failed before its first byte and another provider may answer: it is given
    /// up (its request remembers the provider, and `cause` in case nothing else answers).
    /// Returns its lease and, when it still runs on its node, its connection to cancel.
    pub(super) fn give_up(&mut self, run: RunId, cause: &Cause) -> Option<(Lease, Option<ConnId>)> {
        let r = self.runs.get_mut(&run)?;
        r.serving = false;
        r.held.clear();
        let (lease, conn) = (r.lease, r.conn);
        let ended = r.held_end.take().is_some();
        if let Some(request) = self.map.get_mut(&run.request) {
            request.live.retain(|&l| l != run);
            if matches!(cause, Cause::Refused(_)) {
                request.refused += 1;
            } else if !request.failed.contains(&lease.resource) {
                request.failed.push(lease.resource);
            }
            request.last_failure = Some(cause.outcome());
        }
        if ended {
            self.runs.remove(&run);
            return Some((lease, None));
        }
        Some((lease, Some(conn)))
    }

    /// `run` has not reached its first byte in time: it goes on, but another provider
    /// may be tried beside it (returns whether it still serves its request, uncommitted).
    pub(super) fn slow(&mut self, run: RunId) -> bool {
        let Some(r) = self.runs.get_mut(&run) else {
            return false;
        };
        if !r.serving || r.committed || r.producing {
            return false;
        }
        r.slow = true;
        let resource = r.lease.resource;
        if let Some(request) = self.map.get_mut(&run.request)
            && !request.failed.contains(&resource)
        {
            request.failed.push(resource);
        }
        true
    }

    /// Whether every run that may still answer `id` went past its first-byte deadline
    /// (and there is at least one): another provider may be tried beside them.
    pub(super) fn only_slow_live(&self, id: RequestId) -> bool {
        self.map.get(&id).is_some_and(|r| {
            !r.live.is_empty()
                && r.live
                    .iter()
                    .all(|l| self.runs.get(l).is_some_and(|run| run.slow))
        })
    }

    /// Whether `id` has runs that may still answer it.
    pub(super) fn has_live(&self, id: RequestId) -> bool {
        self.map.get(&id).is_some_and(|r| !r.live.is_empty())
    }

    /// Whether `id` has runs besides `run` that may still answer it.
    pub(super) fn has_live_besides(&self, id: RequestId, run: RunId) -> bool {
        self.map
            .get(&id)
            .is_some_and(|r| r.live.iter().any(|&l| l != run))
    }

    /// Attempts of `id` so far (dispatches its nodes did not refuse, counted afresh from
    /// its last continuation), and the providers it failed on.
    pub(super) fn attempts(&self, id: RequestId) -> Option<(u32, &[ResourceId])> {
        self.map.get(&id).map(|r| {
            let attempts = r.attempts.saturating_sub(r.refused);
            (
                attempts.saturating_sub(r.attempts_before),
                r.failed.as_slice(),
            )
        })
    }

    /// The refusals `id` met that its ledger could not explain so far.
    pub(super) fn unexplained_refusals(&self, id: RequestId) -> u32 {
        self.map.get(&id).map_or(0, |r| r.unexplained_refusals)
    }

    /// `id` met a refusal its ledger could not explain (see [`MAX_REFUSALS`]).
    pub(super) fn count_unexplained_refusal(&mut self, id: RequestId) {
        if let Some(r) = self.map.get_mut(&id) {
            r.unexplained_refusals += 1;
        }
    }

    /// A fenced lease: its run is gone with its node.
    pub(super) fn fenced(&mut self, cx: &mut Cx<'_>, lease: Lease) -> Fenced {
        let Some(run) = self.runs.remove(&lease.run) else {
            return Fenced::Nothing;
        };
        cx.timers.stop(TimerKey::CancelGrace(lease.run));
        let id = lease.run.request;
        if !run.serving || !self.map.contains_key(&id) {
            return Fenced::Nothing;
        }
        if run.committed {
            return Fenced::Committed(id, lease.resource);
        }
        if let Some(request) = self.map.get_mut(&id) {
            request.live.retain(|&l| l != lease.run);
            if !request.failed.contains(&lease.resource) {
                request.failed.push(lease.resource);
            }
        }
        Fenced::Uncommitted(id)
    }

    /// The cancel grace of `run` passed: the run is dropped; its lease to return.
    pub(super) fn grace_over(&mut self, run: RunId) -> Option<Lease> {
        let r = self.runs.get(&run)?;
        if r.serving {
            return None;
        }
        self.runs.remove(&run).map(|r| r.lease)
    }

    /// The run `run_id` names, if it runs on `conn`.
    pub(super) fn run_on(&self, conn: ConnId, run_id: &str) -> Option<RunId> {
        let run = RunId::parse(run_id)?;
        (self.runs.get(&run)?.conn == conn).then_some(run)
    }

    /// A run event or tunnel frame from `conn` for `run` (what [`Self::run_on`] found for
    /// its name): checked against its run's contract; before the run's first byte held
    /// back (and judged: a first byte, or a failure worth another provider), after it
    /// passed to the caller.
    pub(super) fn observe(
        &mut self,
        cx: &mut Cx<'_>,
        conn: ConnId,
        run: Option<RunId>,
        item: StreamItem,
        retry_on: &RetryOn,
    ) -> Step {
        let Some(run) = run else {
            return Step::Ignored;
        };
        let Some(r) = self.runs.get_mut(&run).filter(|r| r.conn == conn) else {
            return Step::Ignored;
        };
        let (lease, serving, committed) = (r.lease, r.serving, r.committed);
        r.last_event = cx.now;
        let Some(observed) = observe(&mut r.stream, &item) else {
            // A broken stream: nothing it sends is trusted any more, except that it
            // ended: the node has stopped the run, so its lease returns now, not at the
            // grace.
            if item.is_terminal() {
                self.runs.remove(&run);
                cx.timers.stop(TimerKey::CancelGrace(run));
                return Step::Ended { lease };
            }
            return Step::Ignored;
        };
        match observed {
            Err(detail) if serving && !committed => {
                // Before its first byte a broken stream is a failed provider like any
                // other: the request may be tried elsewhere.
                let terminal = item.is_terminal();
                r.stream = Stream::Broken;
                if terminal {
                    r.held_end = Some(Outcome::Failed(RequestError::Violation(detail.clone())));
                }
                Step::Failed {
                    run,
                    cause: Cause::Violation(detail),
                    retry_after: None,
                }
            }
            Err(detail) => {
                let terminal = item.is_terminal();
                if serving {
                    self.end(
                        cx,
                        run.request,
                        Outcome::Failed(RequestError::Violation(detail.clone())),
                    );
                }
                if terminal {
                    // Out of order, but the node has ended the run: nothing to cancel.
                    self.runs.remove(&run);
                    cx.timers.stop(TimerKey::CancelGrace(run));
                } else if let Some(r) = self.runs.get_mut(&run) {
                    // Nothing more this stream sends is trusted; the lease waits for the
                    // node to end the run, the grace timer, or a fence.
                    r.stream = Stream::Broken;
                    r.serving = false;
                }
                Step::Violated {
                    run,
                    lease,
                    conn,
                    terminal,
                    cancel: serving && !terminal,
                    detail,
                }
            }
            Ok(end) if !serving => {
                // Given up: what it says goes nowhere; its end frees its lease.
                if end.is_some() {
                    self.runs.remove(&run);
                    cx.timers.stop(TimerKey::CancelGrace(run));
                    return Step::Ended { lease };
                }
                Step::Progress
            }
            Ok(end) if committed => {
                let Some(request) = self.map.get_mut(&run.request) else {
                    return Step::Ignored;
                };
                if let Some(Outcome::Failed(RequestError::Provider(detail))) = &end
                    && detail.retryable
                    && request.resume.as_ref().is_some_and(Resume::may_continue)
                {
                    // The provider's stream failed midway: another may continue it.
                    self.runs.remove(&run);
                    cx.timers.stop(TimerKey::CancelGrace(run));
                    return Step::Broken {
                        run,
                        lease,
                        event: item.into_event(),
                        outcome: end.unwrap_or(Outcome::Cancelled),
                    };
                }
                deliver(request.resume.as_mut(), item.into_event(), &mut |e| {
                    cx.out.request(run.request, e);
                });
                match end {
                    Some(outcome) => {
                        self.runs.remove(&run);
                        self.end(cx, run.request, outcome);
                        Step::Ended { lease }
                    }
                    None => Step::Progress,
                }
            }
            Ok(None) => {
                let status = match &item {
                    StreamItem::Part(_, TunnelPart::Status { code, headers }) => {
                        Some((*code, retry_after(headers)))
                    }
                    StreamItem::Part(_, TunnelPart::Frame(frame))
                        if frame.kind == TunnelFrameKind::Status as i32 =>
                    {
                        Some((frame.status_code, retry_after(&frame.headers)))
                    }
                    _ => None,
                };
                let content = item.has_content();
                r.held_bytes = r.held_bytes.saturating_add(item.size());
                r.held.push(item.into_event());
                match status {
                    // A continuation has no head of its own to give: a provider that
                    // does not answer it with success failed it.
                    Some((code, retry_after))
                        if retry_on.status(code)
                            || (!(200..300).contains(&code)
                                && self.map.get(&run.request).is_some_and(Request::continued)) =>
                    {
                        Step::Failed {
                            run,
                            cause: Cause::Status(code),
                            retry_after,
                        }
                    }
                    Some(_) => Step::FirstByte { run },
                    // A whole answer's first byte is its terminal: until then it is held.
                    None if r.whole && (content || r.producing) => {
                        r.producing = true;
                        if r.held_bytes > MAX_HELD_WHOLE {
                            Step::FirstByte { run }
                        } else {
                            Step::Progress
                        }
                    }
                    None if content || r.held.len() >= MAX_HELD => Step::FirstByte { run },
                    None => Step::Progress,
                }
            }
            Ok(Some(outcome)) => {
                let retryable = match &outcome {
                    Outcome::Failed(RequestError::Provider(detail)) => {
                        detail.retryable && retry_on.connect
                    }
                    _ => false,
                };
                r.held.push(item.into_event());
                r.held_end = Some(outcome.clone());
                match outcome {
                    Outcome::Failed(RequestError::Provider(detail))
                        if detail.retryable && detail.code == REFUSED =>
                    {
                        Step::Failed {
                            run,
                            cause: Cause::Refused(detail),
                            retry_after: None,
                        }
                    }
                    Outcome::Failed(RequestError::Provider(detail)) if retryable => Step::Failed {
                        run,
                        cause: Cause::Error(detail),
                        retry_after: None,
                    },
                    _ => Step::FirstByte { run },
                }
            }
        }
    }

    /// The run's stream is known to be broken by a message that failed validation
    /// (an unknown event type, say): the same as any violation of its stream.
    pub(super) fn invalid(
        &mut self,
        cx: &mut Cx<'_>,
        run: RunId,
        detail: StreamViolation,
    ) -> Option<Step> {
        let r = self.runs.get_mut(&run)?;
        let (lease, conn, serving, committed) = (r.lease, r.conn, r.serving, r.committed);
        if matches!(r.stream, Stream::Broken) {
            return Some(Step::Ignored);
        }
        r.stream = Stream::Broken;
        if serving && !committed {
            return Some(Step::Failed {
                run,
                cause: Cause::Violation(detail),
                retry_after: None,
            });
        }
        r.serving = false;
        if serving {
            self.end(
                cx,
                run.request,
                Outcome::Failed(RequestError::Violation(detail.clone())),
            );
        }
        Some(Step::Violated {
            run,
            lease,
            conn,
            terminal: false,
            cancel: serving,
            detail,
        })
    }
}

impl Requests {
    /// `id`'s answering run was lost on `resource` after its first byte: it is to be
    /// continued elsewhere, from what its caller has. False when it cannot be continued
    /// exactly (then it ends as before).
    pub(super) fn resume(&mut self, id: RequestId, resource: ResourceId) -> bool {
        let Some(r) = self.map.get_mut(&id) else {
            return false;
        };
        let Some(resume) = r.resume.as_mut() else {
            return false;
        };
        if resume.continue_from(&r.call.body).is_none() {
            return false;
        }
        r.committed = None;
        r.attempts_before = r.attempts.saturating_sub(r.refused);
        if !r.failed.contains(&resource) {
            r.failed.push(resource);
        }
        true
    }

    /// `run` answers its request and has sent nothing since `since`: given up (its
    /// request is to be continued elsewhere). Its lease and connection, to cancel it on
    /// its node.
    pub(super) fn stalled(&mut self, run: RunId) -> Option<(Lease, ConnId)> {
        let r = self.runs.get_mut(&run)?;
        if !r.serving || !r.committed {
            return None;
        }
        r.serving = false;
        r.held.clear();
        Some((r.lease, r.conn))
    }

    /// Whether `id` could be continued now, its body included.
    pub(super) fn continuable(&self, id: RequestId) -> bool {
        self.map.get(&id).is_some_and(|r| {
            r.resume
                .as_ref()
                .is_some_and(|resume| resume.could_continue(&r.call.body))
        })
    }

    /// Whether `id` may be continued once more (before its body is looked at).
    pub(super) fn may_resume(&self, id: RequestId) -> bool {
        self.map
            .get(&id)
            .and_then(|r| r.resume.as_ref())
            .is_some_and(Resume::may_continue)
    }

    /// Bytes of answer `id`'s caller has.
    pub(super) fn delivered(&self, id: RequestId) -> usize {
        self.map
            .get(&id)
            .and_then(|r| r.resume.as_ref())
            .map_or(0, Resume::delivered)
    }
}

/// `event` on its way to the caller, through what a resumable request keeps: `out` gets
/// what the caller is sent.
fn deliver(resume: Option<&mut Resume>, event: RequestEvent, out: &mut impl FnMut(RequestEvent)) {
    match resume {
        Some(resume) => resume.deliver(event, out),
        None => out(event),
    }
}

/// The requests' figures, for tests and status pages.
impl EdgeCore {
    /// Requests accepted and not yet finished with the node (includes cancelled runs
    /// whose lease is still held).
    #[must_use]
    pub fn open_requests(&self) -> usize {
        self.requests.open()
    }
}

mod few;
mod resume;
mod stream;

use resume::Resume;

pub(super) use few::Few;
pub(super) use stream::{
    Cancel, Cause, Committed, Fenced, MAX_REFUSALS, REFUSED, Step, StreamItem,
};
use stream::{Stream, message, observe, retry_after};
