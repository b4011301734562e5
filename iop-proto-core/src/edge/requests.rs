//! The requests the Edge owns, from submit to end: each one's call (body included), its
//! place in the queue or the run serving it, and every run's stream, checked against
//! the run or tunnel contract before anything reaches the caller.
//!
//! A *request* is what a caller asked; a *run* is one dispatch of it to a provider, and
//! holds that provider's lease. A run outlives its request when the caller leaves: it is
//! cancelled on its node and keeps its lease until the node ends it or the cancel grace
//! passes.

use super::pool::ResourceMeta;
use super::*;

/// Requests by id, and the runs holding leases.
#[derive(Debug)]
pub(super) struct Requests {
    map: IdMap<RequestId, Request>,
    runs: IdMap<RunId, Run>,
    next: u64,
}

impl Default for Requests {
    fn default() -> Self {
        Requests {
            map: IdMap::default(),
            runs: IdMap::default(),
            next: 1,
        }
    }
}

/// A caller's request.
#[derive(Debug)]
pub(super) struct Request {
    /// What the caller sent: every dispatch is built from it.
    call: Submit,
    /// Its model group's name.
    pub(super) model: Arc<str>,
    /// It needs long-context capacity.
    pub(super) long: bool,
    /// The providers that may serve it (the model group's, or its tunnel-served ones).
    pub(super) candidates: Arc<[Candidate]>,
    pub(super) state: ReqState,
    /// Dispatches so far.
    attempts: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReqState {
    /// Accepted, not dispatched: in the queue once it has a ticket.
    Queued(Option<Ticket>),
    /// Served by this run.
    Running(RunId),
}

/// One dispatch: its lease, its connection and its stream.
#[derive(Debug)]
pub(super) struct Run {
    pub(super) lease: Lease,
    pub(super) conn: ConnId,
    stream: Stream,
    /// Its request still waits on it; false once the caller left or the stream broke
    /// (it is cancelled on the node and waits for the node to end it, or the grace).
    serving: bool,
}

#[derive(Debug)]
enum Stream {
    Run(RunTracker),
    Tunnel(TunnelReceiver),
    /// The stream broke the contract; nothing more it sends is trusted.
    Broken,
}

/// One item of a run's stream.
#[derive(Debug)]
pub(super) enum StreamItem {
    Run(RunEvent),
    Frame(ProviderTunnelFrame),
}

impl StreamItem {
    pub(super) fn run_id(&self) -> &str {
        match self {
            StreamItem::Run(event) => &event.run_id,
            StreamItem::Frame(frame) => &frame.run_id,
        }
    }

    /// Whether it ends its stream, whatever else is wrong with it.
    fn is_terminal(&self) -> bool {
        match self {
            StreamItem::Run(event) => matches!(
                RunEventType::try_from(event.r#type),
                Ok(RunEventType::Complete | RunEventType::Error | RunEventType::Cancelled)
            ),
            StreamItem::Frame(frame) => matches!(
                TunnelFrameKind::try_from(frame.kind),
                Ok(TunnelFrameKind::End | TunnelFrameKind::Error)
            ),
        }
    }

    fn into_event(self) -> RequestEvent {
        match self {
            StreamItem::Run(event) => RequestEvent::Run(Box::new(event)),
            StreamItem::Frame(frame) => RequestEvent::Tunnel(frame.into()),
        }
    }
}

/// What a stream item did, for the transitions to act on.
pub(super) enum Step {
    /// Not for a run of this connection, or of a stream already broken: ignored.
    Ignored,
    /// Passed to the caller (or dropped, for a run whose caller left).
    Progress,
    /// The run ended: its lease is free (its request, if it still served one, ended
    /// with it).
    Ended { lease: Lease },
    /// The run broke its stream's contract: its request (if it served one) failed. When
    /// the item was its terminal the run is done and its lease free; otherwise, when
    /// `cancel`, it must be cancelled on the node (a run already cancelled waits on).
    Violated {
        run: RunId,
        lease: Lease,
        conn: ConnId,
        terminal: bool,
        cancel: bool,
        detail: StreamViolation,
    },
}

/// What a cancel found.
pub(super) enum Cancel {
    /// It waited (in the queue, when it has a ticket).
    Queued(Option<Ticket>),
    /// A run served it: cancel it on its node.
    Running { run: RunId, conn: ConnId },
}

/// Checks `item` against `stream`'s contract: `None` for a stream already broken, else
/// whether the stream goes on, ended (and how) or broke.
fn observe(
    stream: &mut Stream,
    item: &StreamItem,
) -> Option<Result<Option<Outcome>, StreamViolation>> {
    let provider_error = |error: &Option<ErrorDetail>| {
        Outcome::Failed(RequestError::Provider(error.clone().unwrap_or_default()))
    };
    Some(match (stream, item) {
        (Stream::Broken, _) => return None,
        (Stream::Run(tracker), StreamItem::Run(event)) => match tracker.observe(event) {
            Ok(RunStep::Terminal(RunEventType::Complete)) => Ok(Some(Outcome::Completed)),
            Ok(RunStep::Terminal(RunEventType::Cancelled)) => Ok(Some(Outcome::Cancelled)),
            Ok(RunStep::Terminal(_)) => Ok(Some(provider_error(&event.error))),
            Ok(_) => Ok(None),
            Err(violation) => Err(StreamViolation::Run(violation)),
        },
        (Stream::Tunnel(receiver), StreamItem::Frame(frame)) => match receiver.observe(frame) {
            Ok(TunnelStep::End) => Ok(Some(Outcome::Completed)),
            Ok(TunnelStep::Error) => Ok(Some(provider_error(&frame.error))),
            Ok(_) => Ok(None),
            Err(violation) => Err(StreamViolation::Tunnel(violation)),
        },
        (Stream::Run(_), StreamItem::Frame(_)) => Err(StreamViolation::FrameForRun),
        (Stream::Tunnel(_), StreamItem::Run(_)) => Err(StreamViolation::EventForTunnel),
    })
}

impl Requests {
    /// Requests open, counting runs whose caller left but whose node has not ended them.
    pub(super) fn open(&self) -> usize {
        self.map.len() + self.runs.values().filter(|r| !r.serving).count()
    }

    /// Accepts `call` as a new, queued request (not in the queue yet).
    pub(super) fn accept(
        &mut self,
        call: Submit,
        model: Arc<str>,
        long: bool,
        candidates: Arc<[Candidate]>,
    ) -> RequestId {
        let id = RequestId(self.next);
        self.next += 1;
        self.map.insert(
            id,
            Request {
                call,
                model,
                long,
                candidates,
                state: ReqState::Queued(None),
                attempts: 0,
            },
        );
        id
    }

    pub(super) fn get(&self, id: RequestId) -> Option<&Request> {
        self.map.get(&id)
    }

    /// Whether only a tunnel-served provider can answer `id`.
    pub(super) fn tunnel_only(&self, id: RequestId) -> bool {
        self.map.get(&id).is_some_and(|r| r.call.tunnel_only())
    }

    /// `id` waits in the queue with `ticket`, serving only `candidates` from now on.
    pub(super) fn queued(&mut self, id: RequestId, ticket: Ticket, candidates: Arc<[Candidate]>) {
        if let Some(r) = self.map.get_mut(&id) {
            r.state = ReqState::Queued(Some(ticket));
            r.candidates = candidates;
        }
    }

    /// The wait of `id` as the queue keeps it.
    pub(super) fn waiter(&self, id: RequestId, deadline: Timestamp) -> Option<Waiter> {
        let r = self.map.get(&id)?;
        Some(Waiter {
            request: id,
            model: r.model.clone(),
            long: r.long,
            candidates: r.candidates.clone(),
            deadline,
        })
    }

    /// The next run of `id`.
    pub(super) fn next_run(&self, id: RequestId) -> Option<RunId> {
        let r = self.map.get(&id)?;
        Some(RunId {
            request: id,
            attempt: r.attempts,
        })
    }

    /// Dispatches `id` as run `lease.run` on `conn`: builds the message its provider is
    /// served with, sends it, and tells the caller who answers.
    pub(super) fn dispatch(
        &mut self,
        cx: &mut Cx<'_>,
        lease: Lease,
        conn: ConnId,
        meta: &ResourceMeta,
        node_id: &Arc<str>,
        target: &str,
    ) {
        let run = lease.run;
        let Some(r) = self.map.get_mut(&run.request) else {
            return;
        };
        r.attempts += 1;
        r.state = ReqState::Running(run);
        let (body, stream) = message(&r.call, &r.model, run, meta, target, lease.long);
        cx.out.send(conn, body);
        self.runs.insert(
            run,
            Run {
                lease,
                conn,
                stream,
                serving: true,
            },
        );
        cx.out.request(
            run.request,
            RequestEvent::Dispatched {
                run,
                shape: meta.shape,
                node_id: node_id.clone(),
                provider_id: meta.provider_id.clone(),
            },
        );
    }

    /// `id` ends for its caller with `outcome` (it holds no lease, or its run is done).
    pub(super) fn end(&mut self, cx: &mut Cx<'_>, id: RequestId, outcome: Outcome) {
        if self.map.remove(&id).is_some() {
            cx.out.request(id, RequestEvent::Ended(outcome));
        }
    }

    /// The caller left: `id` ends now ([`Outcome::Cancelled`]); what it held is returned
    /// for the transitions to let go.
    pub(super) fn cancel(&mut self, cx: &mut Cx<'_>, id: RequestId) -> Option<Cancel> {
        let request = self.map.remove(&id)?;
        cx.out.request(id, RequestEvent::Ended(Outcome::Cancelled));
        Some(match request.state {
            ReqState::Queued(ticket) => Cancel::Queued(ticket),
            ReqState::Running(run) => {
                let conn = match self.runs.get_mut(&run) {
                    Some(r) => {
                        r.serving = false;
                        r.conn
                    }
                    None => return Some(Cancel::Queued(None)),
                };
                Cancel::Running { run, conn }
            }
        })
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

    /// A fenced lease: its run is gone with its node. Returns its request when the run
    /// still served one (that request is lost and must end), having dropped the run.
    pub(super) fn fenced(&mut self, cx: &mut Cx<'_>, lease: Lease) -> Option<RequestId> {
        let run = self.runs.remove(&lease.run)?;
        cx.timers.stop(TimerKey::CancelGrace(lease.run));
        (run.serving && self.map.contains_key(&lease.run.request)).then_some(lease.run.request)
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

    /// A run event or tunnel frame from `conn`: checked against its run's contract and,
    /// while the run serves its request, passed to the caller.
    pub(super) fn observe(&mut self, cx: &mut Cx<'_>, conn: ConnId, item: StreamItem) -> Step {
        let Some(run) = self.run_on(conn, item.run_id()) else {
            return Step::Ignored;
        };
        let Some(r) = self.runs.get_mut(&run) else {
            return Step::Ignored;
        };
        let (lease, serving) = (r.lease, r.serving);
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
            Ok(None) => {
                if serving {
                    cx.out.request(run.request, item.into_event());
                }
                Step::Progress
            }
            Ok(Some(outcome)) => {
                self.runs.remove(&run);
                cx.timers.stop(TimerKey::CancelGrace(run));
                if serving {
                    cx.out.request(run.request, item.into_event());
                    self.end(cx, run.request, outcome);
                }
                Step::Ended { lease }
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
        let (lease, conn, serving) = (r.lease, r.conn, r.serving);
        if matches!(r.stream, Stream::Broken) {
            return Some(Step::Ignored);
        }
        r.stream = Stream::Broken;
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

/// The message run `run` of `call` is dispatched with on the provider `meta` describes,
/// serving `target`, and the stream its answer is checked with.
fn message(
    call: &Submit,
    model: &Arc<str>,
    run: RunId,
    meta: &ResourceMeta,
    target: &str,
    long: bool,
) -> (Body, Stream) {
    let mut metadata = BTreeMap::new();
    if !call.request_id.is_empty() {
        metadata.insert(
            crate::wire::REQUEST_ID_KEY.to_owned(),
            String::from(&*call.request_id),
        );
    }
    match meta.shape {
        DispatchShape::Run => {
            metadata.insert("model".to_owned(), String::from(&**model));
            (
                Body::RunRequest(RunRequest {
                    run_id: run.wire(),
                    adapter: String::from(&*meta.provider_id),
                    target: target.to_owned(),
                    input: call.body.clone(),
                    metadata,
                    long_context: long,
                    ..RunRequest::default()
                }),
                Stream::Run(RunTracker::new()),
            )
        }
        DispatchShape::Tunnel => (
            Body::ProviderTunnelRequest(ProviderTunnelRequest {
                run_id: run.wire(),
                adapter: String::from(&*meta.provider_id),
                target: target.to_owned(),
                method: "POST".into(),
                path: call.endpoint.path().into(),
                headers: call.headers.clone(),
                body: crate::openai::for_target(call.body.clone(), target),
                stream: call.stream,
                timeout_sec: u32::try_from(call.timeout.as_secs()).unwrap_or(u32::MAX),
                metadata,
                long_context: long,
                ..ProviderTunnelRequest::default()
            }),
            Stream::Tunnel(TunnelReceiver::new()),
        ),
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
