//! Work in flight: admitting runs and tunnels through the capacity gates, cancels,
//! commands, and remembering finished runs.

use crate::wire::Validate;

use super::CancelError;
use super::EdgeViolation;
use super::NodeSession;
use super::NodeTransmit;
use super::SessionEnd;
use super::SessionError;
use super::SessionEvent;
use super::SessionState;
use super::WorkRefusal;
use super::{Returned, RunOutput, TunnelOutput, WorkStep};
use crate::run::RunEmitter;
use crate::run::RunTracker;
use crate::time::Timestamp;
use crate::tunnel::TunnelEmitter;
use crate::wire::Body;
use crate::wire::CancelRequest;
use crate::wire::Envelope;
use crate::wire::ErrorDetail;
use crate::wire::NodeCommandRequest;
use crate::wire::NodeCommandResponse;
use crate::wire::RunEventType;
use crate::wire::RunRequest;
use crate::wire::TunnelRequest;
use bytes::Bytes;
use std::collections::VecDeque;
use std::sync::Arc;

#[derive(Debug)]
pub(super) enum WorkKind {
    Run(RunEmitter, RunTracker),
    Tunnel(TunnelEmitter),
}

#[derive(Debug)]
pub(super) struct Work {
    /// Its adapter, the name its gate is kept under.
    pub(super) adapter: Arc<str>,
    pub(super) long: bool,
    pub(super) kind: WorkKind,
    pub(super) cancel_requested: bool,
}

/// Remembered ids of finished runs (so a late cancel is a no-op, not an error).
pub(super) const FINISHED_MEMORY: usize = 4096;

impl NodeSession {
    /// The work `run_id` while the session is open and the work has not ended, with the
    /// transmit queue its output goes to (borrowed together, so frames need no list).
    pub(super) fn work_in_flight(
        &mut self,
        run_id: &str,
        input: &'static str,
    ) -> Result<(&mut Work, &mut VecDeque<NodeTransmit>), SessionError> {
        if self.state == SessionState::Closed {
            return Err(self.wrong_state(input));
        }
        let work = self
            .work
            .get_mut(run_id)
            .ok_or_else(|| SessionError::UnknownRun(run_id.to_owned()))?;
        Ok((work, &mut self.transmits))
    }

    pub(super) fn finish(&mut self, run_id: &str) {
        let Some((run_id, work)) = self.work.remove_entry(run_id) else {
            return;
        };
        if let Some(gate) = self.gates.get_mut(&work.adapter) {
            gate.release(work.long);
            self.load_changes += 1;
        }
        if self.finished.len() >= FINISHED_MEMORY
            && let Some(old) = self.finished.pop_front()
        {
            self.finished_set.remove(&old);
        }
        // An id the Edge used again after it finished is remembered once, so the queue
        // and the set stay the same ids and the oldest is forgotten first.
        if self.finished_set.insert(run_id.clone()) {
            self.finished.push_back(run_id);
        }
        // A shutdown waits for the last cancelled run to end in order.
        if self.cancelling && self.work.is_empty() {
            self.close(SessionEnd::LocalShutdown);
        }
    }

    /// Takes a capacity unit for new work (the name its adapter's gate is kept under), or
    /// explains the refusal.
    pub(super) fn admit(
        &mut self,
        run_id: &str,
        adapter: &str,
        long: bool,
    ) -> Result<Arc<str>, WorkRefusal> {
        if self.work.contains_key(run_id) {
            return Err(WorkRefusal::Duplicate(run_id.to_owned()));
        }
        if self.cancelling {
            return Err(WorkRefusal::ShuttingDown);
        }
        if self.rehomed {
            return Err(WorkRefusal::Rehomed);
        }
        let Some(name) = self
            .gates
            .get_key_value(adapter)
            .map(|(name, _)| name.clone())
        else {
            return Err(WorkRefusal::UnknownAdapter(adapter.to_owned()));
        };
        if let Some(gate) = self.gates.get_mut(adapter) {
            gate.try_acquire(long)?;
        }
        self.load_changes += 1;
        Ok(name)
    }

    pub(super) fn on_run_request(&mut self, request: RunRequest) {
        let run_id: Arc<str> = request.run_id.as_str().into();
        let admitted = request
            .validate()
            .map_err(WorkRefusal::Invalid)
            .and_then(|()| self.admit(&run_id, &request.adapter, request.long_context));
        let long = request.long_context;
        let kind = WorkKind::Run(RunEmitter::new(request.run_id.clone()), RunTracker::new());
        self.on_work(admitted, run_id, long, kind, |_| SessionEvent::StartRun {
            request,
        });
    }

    pub(super) fn on_tunnel_request(&mut self, request: TunnelRequest) {
        let run_id: Arc<str> = request.run_id().into();
        let admitted = request
            .validate()
            .map_err(WorkRefusal::Invalid)
            .and_then(|()| self.admit(&run_id, request.adapter(), request.long_context()));
        let long = request.long_context();
        // The session names the frames it sends (`handle_tunnel_output`).
        let kind = WorkKind::Tunnel(TunnelEmitter::unnamed(self.config.chunk_size));
        self.on_work(admitted, run_id, long, kind, |run_id| {
            SessionEvent::StartTunnel { request, run_id }
        });
    }

    /// Admits new work of either kind, or refuses it: at once on the wire, ending its
    /// sequence with a retryable `refused` error, unless answering would corrupt a live
    /// run's stream (a duplicate or empty run id), which is a violation instead.
    fn on_work(
        &mut self,
        admitted: Result<Arc<str>, WorkRefusal>,
        run_id: Arc<str>,
        long: bool,
        kind: WorkKind,
        start: impl FnOnce(Arc<str>) -> SessionEvent,
    ) {
        let reason = match admitted {
            Ok(adapter) => {
                self.work.insert(
                    run_id.clone(),
                    Work {
                        adapter,
                        long,
                        kind,
                        cancel_requested: false,
                    },
                );
                self.events.push_back(start(run_id));
                return;
            }
            Err(reason) => reason,
        };
        if self.work.contains_key(&run_id) || run_id.is_empty() {
            self.events.push_back(SessionEvent::PeerViolation {
                violation: EdgeViolation::Work(reason),
            });
            return;
        }
        let detail = ErrorDetail {
            code: "refused".into(),
            message: reason.to_string(),
            retryable: true,
        };
        match kind {
            WorkKind::Run(mut emitter, _) => {
                if let Some(start) = emitter.next(RunEventType::Start) {
                    self.send(Body::RunEvent(start));
                }
                if let Some(mut error) = emitter.next(RunEventType::Error) {
                    error.error = Some(detail);
                    self.send(Body::RunEvent(error));
                }
            }
            WorkKind::Tunnel(mut emitter) => {
                if let Some(mut frame) = emitter.error(detail) {
                    frame.run_id = String::from(&*run_id);
                    self.send(Body::ProviderTunnelFrame(frame));
                }
            }
        }
        self.events.push_back(SessionEvent::WorkRefused {
            run_id: String::from(&*run_id),
            reason,
        });
    }

    pub(super) fn on_cancel(&mut self, request: &CancelRequest) {
        if let Err(err) = request.validate() {
            self.events.push_back(SessionEvent::CancelRejected {
                run_id: request.run_id.clone(),
                error: CancelError::Invalid(err),
            });
            return;
        }
        // Both kinds cancel exactly the named run: the node keeps no session state.
        match self.work.get_mut(request.run_id.as_str()) {
            Some(work) if !work.cancel_requested => {
                work.cancel_requested = true;
                self.events.push_back(SessionEvent::CancelRun {
                    run_id: request.run_id.clone(),
                });
            }
            Some(_) => {}
            None if self.finished_set.contains(request.run_id.as_str()) => {}
            None => self.events.push_back(SessionEvent::CancelRejected {
                run_id: request.run_id.clone(),
                error: CancelError::UnknownRun,
            }),
        }
    }

    pub(super) fn on_command(&mut self, request: NodeCommandRequest) {
        match request.validate() {
            Ok(()) => {
                self.pending_commands.insert(request.request_id.clone());
                self.events.push_back(SessionEvent::Command { request });
            }
            Err(err) => self.send(Body::NodeCommandResponse(NodeCommandResponse {
                request_id: request.request_id,
                ok: false,
                error: err.to_string(),
                payload: Bytes::new(),
            })),
        }
    }
}

/// What the adapters report of the work they run.
impl NodeSession {
    /// Progress of a run, from the adapter. Numbered, checked and sent.
    pub fn handle_run_output(
        &mut self,
        now: Timestamp,
        run_id: &str,
        output: RunOutput,
    ) -> Result<WorkStep, SessionError> {
        self.advance(now);
        let (work, _) = self.work_in_flight(run_id, "run output")?;
        let WorkKind::Run(emitter, tracker) = &mut work.kind else {
            return Err(SessionError::WrongKind(run_id.to_owned()));
        };
        let kind = match &output {
            RunOutput::Start => RunEventType::Start,
            RunOutput::Delta(_) => RunEventType::Delta,
            RunOutput::Complete { .. } => RunEventType::Complete,
            RunOutput::Error(_) => RunEventType::Error,
            RunOutput::Cancelled => RunEventType::Cancelled,
        };
        // Check against a copy first so a refused output consumes nothing.
        let mut probe_emitter = emitter.clone();
        let mut probe_tracker = tracker.clone();
        let Some(mut event) = probe_emitter.next(kind) else {
            return Err(SessionError::UnknownRun(run_id.to_owned()));
        };
        probe_tracker
            .observe(&event)
            .map_err(|violation| SessionError::InvalidRunOutput {
                run_id: run_id.to_owned(),
                violation,
            })?;
        *emitter = probe_emitter;
        *tracker = probe_tracker;
        match output {
            RunOutput::Delta(text) => event.delta = text,
            RunOutput::Complete { usage, metadata } => {
                event.usage = usage;
                event.metadata = metadata;
            }
            RunOutput::Error(error) => event.error = Some(error),
            RunOutput::Start | RunOutput::Cancelled => {}
        }
        let ended = tracker.is_ended();
        self.send(Body::RunEvent(event));
        if ended {
            self.finish(run_id);
            return Ok(WorkStep::Ended);
        }
        Ok(WorkStep::Going)
    }

    /// Progress of a tunnel, from the adapter. Numbered, chunked, checked and sent.
    pub fn handle_tunnel_output(
        &mut self,
        now: Timestamp,
        run_id: &str,
        output: TunnelOutput,
    ) -> Result<WorkStep, SessionError> {
        self.handle_tunnel_outputs(now, run_id, std::iter::once(output))
    }

    /// Several outputs of one tunnel in order (what its adapter ended with), as many
    /// [`handle_tunnel_output`](Self::handle_tunnel_output) calls would take them, the
    /// tunnel looked up once: the first refused output is the error, and an output after
    /// the terminal one finds the tunnel gone.
    pub fn handle_tunnel_outputs(
        &mut self,
        now: Timestamp,
        run_id: &str,
        outputs: impl IntoIterator<Item = TunnelOutput>,
    ) -> Result<WorkStep, SessionError> {
        self.advance(now);
        let merge = self.merged_tunnel_frames;
        let (work, queue) = self.work_in_flight(run_id, "tunnel output")?;
        let WorkKind::Tunnel(emitter) = &mut work.kind else {
            return Err(SessionError::WrongKind(run_id.to_owned()));
        };
        // Frames go straight to the transmit queue (no list of them per body chunk), named
        // here (the emitter's are unnamed). To an Edge that takes them, a part joins the
        // tunnel's frame still waiting at the back of the queue: a response the provider
        // gave at once (its head, its whole body, its usage and its end read before the
        // shell drained) leaves as one frame, and the parts that joined need no name.
        let mut send = |frame| {
            let mut frame = match queue.back_mut() {
                Some(NodeTransmit::Frame(Envelope {
                    body: Some(Body::ProviderTunnelFrame(last)),
                })) if merge && last.run_id == run_id => {
                    match crate::tunnel::merge_part(last, frame) {
                        None => return,
                        Some(frame) => frame,
                    }
                }
                _ => frame,
            };
            frame.run_id = run_id.to_owned();
            queue.push_back(NodeTransmit::Frame(Envelope::new(
                Body::ProviderTunnelFrame(frame),
            )));
        };
        let mut outputs = outputs.into_iter();
        for output in outputs.by_ref() {
            let sent = match output {
                TunnelOutput::Status { status, headers } => {
                    emitter.status(status, headers).map(&mut send).is_some()
                }
                TunnelOutput::Body(data) if data.is_empty() => true,
                TunnelOutput::Body(data) => {
                    let mut any = false;
                    for frame in emitter.body(data) {
                        send(frame);
                        any = true;
                    }
                    any
                }
                TunnelOutput::Trailers(headers) => {
                    emitter.headers(headers).map(&mut send).is_some()
                }
                TunnelOutput::Usage(usage) => emitter.usage(usage).map(&mut send).is_some(),
                TunnelOutput::End => emitter.end().map(&mut send).is_some(),
                TunnelOutput::Error(error) => emitter.error(error).map(&mut send).is_some(),
            };
            if !sent {
                return Err(SessionError::InvalidTunnelOutput(run_id.to_owned()));
            }
            if emitter.is_ended() {
                break;
            }
        }
        if !emitter.is_ended() {
            return Ok(WorkStep::Going);
        }
        self.finish(run_id);
        match outputs.next() {
            Some(_) => Err(SessionError::UnknownRun(run_id.to_owned())),
            None => Ok(WorkStep::Ended),
        }
    }

    /// The adapter task for `run_id` returned. Work it left without a terminal ends here
    /// with an `adapter_error` terminal, so its capacity is never stranded and the Edge
    /// still receives a complete sequence. Work that already ended needs nothing.
    pub fn handle_work_returned(
        &mut self,
        now: Timestamp,
        run_id: &str,
    ) -> Result<Returned, SessionError> {
        let tunnel = match self.work.get(run_id).map(|w| &w.kind) {
            // Ended properly: nothing to do.
            None => return Ok(Returned::Done),
            Some(WorkKind::Tunnel(_)) => true,
            Some(WorkKind::Run(..)) => false,
        };
        let detail = ErrorDetail {
            code: "adapter_error".into(),
            message: "adapter ended without a terminal event".into(),
            retryable: true,
        };
        if tunnel {
            // An error is a terminal: the work ends here.
            self.handle_tunnel_output(now, run_id, TunnelOutput::Error(detail))?;
        } else {
            // A run that never started must start before it can end; one that started
            // refuses the second START, which is fine.
            if self
                .handle_run_output(now, run_id, RunOutput::Start)
                .is_err()
            {
                debug_assert!(self.work.contains_key(run_id));
            }
            self.handle_run_output(now, run_id, RunOutput::Error(detail))?;
        }
        Ok(Returned::Unfinished)
    }
}
