//! The streams of dispatched requests: request states, the run and tunnel sequencers,
//! stream violations and cancels on the node.

use super::*;

#[derive(Debug)]
pub(super) enum Stream {
    Run(RunTracker),
    Tunnel(TunnelReceiver),
    /// The stream broke the contract; nothing more it sends is trusted.
    Broken,
}

#[derive(Debug)]
pub(super) enum ReqState {
    Waiting {
        ticket: Ticket,
        /// Only a tunnel-served provider can answer it.
        tunnel_only: bool,
    },
    Granted {
        lease: Lease,
        conn: ConnId,
        shape: DispatchShape,
        target: Arc<str>,
    },
    Running {
        lease: Lease,
        conn: ConnId,
        stream: Stream,
    },
    /// Ended for the caller; the lease is held until the node confirms or the grace ends.
    Cancelling {
        lease: Lease,
        conn: ConnId,
        stream: Stream,
    },
}

/// One item of a dispatched request's stream.
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
    pub(super) fn is_terminal(&self) -> bool {
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

    pub(super) fn into_event(self, request: RequestId) -> EdgeEvent {
        match self {
            StreamItem::Run(event) => EdgeEvent::RunEvent { request, event },
            StreamItem::Frame(frame) => EdgeEvent::TunnelFrame { request, frame },
        }
    }
}

/// What a stream item did.
pub(super) enum Observed {
    Progress,
    Terminal(Outcome),
    Violation(StreamViolation),
}

/// Checks `item` against `stream`'s contract; `None` for a stream already broken.
pub(super) fn observe(stream: &mut Stream, item: &StreamItem) -> Option<Observed> {
    let provider_error = |error: &Option<ErrorDetail>| {
        Outcome::Failed(RequestError::Provider(error.clone().unwrap_or_default()))
    };
    Some(match (stream, item) {
        (Stream::Broken, _) => return None,
        (Stream::Run(tracker), StreamItem::Run(event)) => match tracker.observe(event) {
            Ok(RunStep::Terminal(RunEventType::Complete)) => Observed::Terminal(Outcome::Completed),
            Ok(RunStep::Terminal(RunEventType::Cancelled)) => {
                Observed::Terminal(Outcome::Cancelled)
            }
            Ok(RunStep::Terminal(_)) => Observed::Terminal(provider_error(&event.error)),
            Ok(_) => Observed::Progress,
            Err(violation) => Observed::Violation(StreamViolation::Run(violation)),
        },
        (Stream::Tunnel(receiver), StreamItem::Frame(frame)) => match receiver.observe(frame) {
            Ok(TunnelStep::End) => Observed::Terminal(Outcome::Completed),
            Ok(TunnelStep::Error) => Observed::Terminal(provider_error(&frame.error)),
            Ok(_) => Observed::Progress,
            Err(violation) => Observed::Violation(StreamViolation::Tunnel(violation)),
        },
        (Stream::Run(_), StreamItem::Frame(_)) => Observed::Violation(StreamViolation::FrameForRun),
        (Stream::Tunnel(_), StreamItem::Run(_)) => {
            Observed::Violation(StreamViolation::EventForTunnel)
        }
    })
}

impl EdgeCore {
    /// Common checks for a run event or tunnel frame: from the current ready owner, for a
    /// request running on this connection. Anything else is stale and ignored.
    pub(super) fn stream_of(
        &mut self,
        conn: ConnId,
        phase: Phase,
        run_id: &str,
    ) -> Option<RequestId> {
        let Phase::Owner { node, .. } = phase else {
            self.violation(conn, ConnViolation::StreamBeforeRegister);
            return None;
        };
        if !self.registry.nodes[node]
            .owner
            .is_some_and(|o| o.conn == conn && o.ready)
        {
            self.violation(conn, ConnViolation::StreamBeforeReady);
            return None;
        }
        let request = RunId::parse(run_id)?.0;
        match self.requests.get(&request)? {
            ReqState::Running { conn: c, .. } | ReqState::Cancelling { conn: c, .. }
                if *c == conn =>
            {
                Some(request)
            }
            _ => None,
        }
    }

    /// A run event or tunnel frame from a node: checked against its stream's contract,
    /// passed to the caller while the request is open, and ending it on the terminal.
    pub(super) fn on_stream(&mut self, conn: ConnId, phase: Phase, item: StreamItem) {
        let Some(request) = self.stream_of(conn, phase, item.run_id()) else {
            return;
        };
        let Some(state) = self.requests.remove(&request) else {
            return;
        };
        let (lease, conn, mut stream, cancelling) = match state {
            ReqState::Running {
                lease,
                conn,
                stream,
            } => (lease, conn, stream, false),
            ReqState::Cancelling {
                lease,
                conn,
                stream,
            } => (lease, conn, stream, true),
            other => {
                self.requests.insert(request, other);
                return;
            }
        };
        let Some(observed) = observe(&mut stream, &item) else {
            // A broken stream: nothing it sends is trusted any more, except that it ended:
            // the node has stopped the run, so its lease returns now, not at the grace.
            #[cfg(feature = "testkit")]
            let hold = self.faults.hold_cancelled_lease;
            #[cfg(not(feature = "testkit"))]
            let hold = false;
            if item.is_terminal() && !hold {
                self.release(lease);
                return;
            }
            self.requests.insert(
                request,
                ReqState::Cancelling {
                    lease,
                    conn,
                    stream,
                },
            );
            return;
        };
        match observed {
            Observed::Terminal(outcome) => {
                #[cfg(feature = "testkit")]
                let leak = self.faults.leak_lease && outcome == Outcome::Completed;
                #[cfg(not(feature = "testkit"))]
                let leak = false;
                if !leak {
                    self.release(lease);
                }
                if !cancelling {
                    self.out.events.push_back(item.into_event(request));
                    self.out
                        .events
                        .push_back(EdgeEvent::RequestEnded { request, outcome });
                }
            }
            Observed::Progress => {
                if !cancelling {
                    self.out.events.push_back(item.into_event(request));
                }
                let state = if cancelling {
                    ReqState::Cancelling {
                        lease,
                        conn,
                        stream,
                    }
                } else {
                    ReqState::Running {
                        lease,
                        conn,
                        stream,
                    }
                };
                self.requests.insert(request, state);
            }
            Observed::Violation(detail) if item.is_terminal() => {
                // Out of order, but the node has ended the run: fail it if the caller still
                // waits, and settle the lease now; there is nothing left to cancel.
                self.report_stream_violation(conn, request, &detail);
                self.release(lease);
                if !cancelling {
                    self.out.events.push_back(EdgeEvent::RequestEnded {
                        request,
                        outcome: Outcome::Failed(RequestError::Violation(detail)),
                    });
                }
            }
            Observed::Violation(detail) => {
                self.stream_violation(request, lease, conn, cancelling, detail);
            }
        }
    }

    /// Sends `CancelRequest(CANCEL_RUN)` for `request` on `conn` and arms its cancel
    /// grace: the lease is returned when the node ends the run or the grace passes.
    pub(super) fn cancel_on_node(&mut self, request: RequestId, conn: ConnId, reason: String) {
        self.send(
            conn,
            Body::CancelRequest(CancelRequest {
                run_id: run_id_of(request),
                kind: CancelKind::CancelRun as i32,
                reason,
            }),
        );
        self.timers.set(
            TimerKey::CancelGrace(request),
            self.now + self.config.timing.cancel_grace,
        );
    }

    /// A run event or tunnel frame that breaks the message contract (e.g. an unknown
    /// type): the run it names fails as for any stream violation; one that names no run
    /// of this connection is reported and dropped. The connection stays.
    pub(super) fn bad_stream_item(
        &mut self,
        conn: ConnId,
        phase: Phase,
        run_id: &str,
        error: ValidationError,
    ) {
        let Some(request) = self.stream_of(conn, phase, run_id) else {
            if self.ready_owner(conn, phase).is_some() {
                self.out.events.push_back(EdgeEvent::PeerViolation {
                    conn,
                    node_id: self.node_of(conn),
                    violation: Violation::Stray(error),
                });
            }
            return;
        };
        let detail = StreamViolation::Invalid(error);
        match self.requests.remove(&request) {
            Some(ReqState::Running { lease, conn, .. }) => {
                self.stream_violation(request, lease, conn, false, detail);
            }
            Some(ReqState::Cancelling { lease, conn, .. }) => {
                self.stream_violation(request, lease, conn, true, detail);
            }
            Some(other) => {
                self.requests.insert(request, other);
            }
            None => {}
        }
    }

    /// A run's stream broke the contract: that run alone fails, is cancelled on the node,
    /// and keeps its lease until the node ends it or the cancel grace passes.
    pub(super) fn stream_violation(
        &mut self,
        request: RequestId,
        lease: Lease,
        conn: ConnId,
        cancelling: bool,
        detail: StreamViolation,
    ) {
        self.report_stream_violation(conn, request, &detail);
        if !cancelling {
            self.out.events.push_back(EdgeEvent::RequestEnded {
                request,
                outcome: Outcome::Failed(RequestError::Violation(detail.clone())),
            });
            self.cancel_on_node(request, conn, format!("protocol violation: {detail}"));
        }
        // Nothing more this stream sends is trusted; the lease waits for the grace timer
        // or a fence.
        self.requests.insert(
            request,
            ReqState::Cancelling {
                lease,
                conn,
                stream: Stream::Broken,
            },
        );
    }
}

impl EdgeCore {
    /// Tells the shell (logs, metrics) that a node broke one run's stream contract.
    fn report_stream_violation(
        &mut self,
        conn: ConnId,
        request: RequestId,
        detail: &StreamViolation,
    ) {
        self.out.events.push_back(EdgeEvent::PeerViolation {
            conn,
            node_id: self.node_of(conn),
            violation: Violation::Stream {
                run: RunId(request),
                violation: detail.clone(),
            },
        });
    }
}
