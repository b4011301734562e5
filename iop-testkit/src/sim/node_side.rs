//! Node side of the world: the simulated node shells and their providers.

use super::*;
use bytes::Bytes;
use iop_proto_core::edge::ConnId;
use iop_proto_core::reconnect::{ExitReason, SupervisorEvent};
use iop_proto_core::session::{NodeTransmit, RunOutput, SessionEnd, SessionEvent, TunnelOutput};
use iop_proto_core::time::Timestamp;
use iop_proto_core::wire::{self, Envelope, ErrorDetail, NodeCommandResponse, Usage};
use std::collections::BTreeMap;
use std::time::Duration;

impl World {
    pub(super) fn drain_node(&mut self, i: usize) {
        loop {
            let mut progressed = false;
            let conn = self.procs[i].conn;
            let mut transmits = Vec::new();
            let mut events = Vec::new();
            if let Some(session) = self.procs[i].session.as_mut() {
                while let Some(transmit) = session.poll_transmit() {
                    transmits.push(transmit);
                }
                while let Some(event) = session.poll_event() {
                    events.push(event);
                }
            }
            for transmit in transmits {
                progressed = true;
                match transmit {
                    NodeTransmit::Frame(envelope) => {
                        if let Some(conn) = conn {
                            self.send_to_edge(conn, &envelope);
                        }
                    }
                    NodeTransmit::Close { end, abandoned } => {
                        self.session_closed(i, end, &abandoned)
                    }
                }
            }
            for event in events {
                progressed = true;
                self.on_session_event(i, event);
            }
            while let Some(event) = self.procs[i].supervisor.poll_event() {
                progressed = true;
                match event {
                    SupervisorEvent::Dial { attempt } => {
                        let at = self.now + self.latency();
                        let id = self.procs[i].node_id.clone();
                        self.log(|| format!("{id} (proc {i}) dials, attempt {attempt}"));
                        self.procs[i].dial_at = Some(at);
                    }
                    SupervisorEvent::Exit(reason) if self.procs[i].bad => {
                        // Its loop starts it again soon, as systemd's `Restart=always`.
                        self.procs[i].alive = false;
                        if self.procs[i].kill_at.is_some() {
                            let again = self.now + Duration::from_millis(self.rng.range(100, 400));
                            self.procs[i].restart_at = Some(again);
                        }
                        let id = self.procs[i].node_id.clone();
                        self.log(|| format!("{id} (bad proc {i}) exited: {reason:?}"));
                    }
                    SupervisorEvent::Exit(reason) => {
                        let stopped = self.procs[i]
                            .stopping
                            .filter(|_| reason == ExitReason::Shutdown);
                        check!(
                            self,
                            stopped.is_some(),
                            "node process {i} exited: {reason:?}"
                        );
                        self.procs[i].alive = false;
                        if let Some(delay) = stopped {
                            let id = self.procs[i].node_id.clone();
                            self.log(|| format!("{id} (proc {i}) exited after its stop"));
                            if self.procs[i].replacement.is_some() {
                                self.retire(i);
                            } else {
                                self.procs[i].restart_at = Some(self.now + delay);
                            }
                        }
                    }
                }
            }
            if !progressed {
                return;
            }
        }
    }

    pub(super) fn send_to_edge(&mut self, conn: ConnId, envelope: &Envelope) {
        let latency = self.latency();
        let now = self.now;
        let Some(link) = self.links.get_mut(&conn.0) else {
            return;
        };
        if link.node_closed {
            return;
        }
        if link.to_edge.send(envelope, now + latency) {
            self.stats.frames += 1;
            if let Some(wire::Body::ProviderTunnelFrame(frame)) = &envelope.body
                && iop_proto_core::tunnel::part_count(frame) > 1
            {
                self.stats.merged += 1;
            }
        }
    }

    pub(super) fn provider_delay(&mut self, mode: Mode) -> Duration {
        Duration::from_millis(match mode {
            Mode::Slow => self.rng.range(100, 400),
            _ => self.rng.range(2, 30),
        })
    }

    pub(super) fn on_session_event(&mut self, i: usize, event: SessionEvent) {
        let event_text = format!("{event:?}");
        let now = self.now;
        match event {
            SessionEvent::ApplyConfig { .. } => {
                if let Some(s) = self.procs[i].session.as_mut() {
                    let _ = s.handle_config_applied(now, Ok(()));
                }
            }
            SessionEvent::Ready => {
                let _ = self.procs[i].supervisor.handle_ready(now);
            }
            SessionEvent::StartRun { request } => {
                let numbered = self.streams.then(|| numbered(&request.input)).flatten();
                let run_id = request.run_id.clone();
                self.start_work(i, request.run_id, false);
                if let Some((first, total)) = numbered
                    && let Some(work) = self.procs[i].work.get_mut(&run_id)
                {
                    // A quarter of the runs break after their second token.
                    let breaks = !self.healed
                        && run_id.bytes().map(u32::from).sum::<u32>().is_multiple_of(4);
                    work.total = total;
                    work.numbered = Some((first, breaks));
                }
            }
            SessionEvent::StartTunnel { request, .. } => {
                self.start_work(i, request.run_id().to_owned(), true);
            }
            SessionEvent::CancelRun { run_id } => {
                let at = if self.procs[i].mode == Mode::Stubborn {
                    now + Duration::from_secs(1)
                } else {
                    now + self.provider_delay(Mode::Normal)
                };
                if let Some(work) = self.procs[i].work.get_mut(&run_id) {
                    work.cancelled = true;
                    work.next_at = work.next_at.min(at);
                }
            }
            SessionEvent::Command { request } => {
                if let Some(s) = self.procs[i].session.as_mut() {
                    let _ = s.handle_command_response(
                        now,
                        NodeCommandResponse {
                            request_id: request.request_id,
                            ok: true,
                            ..NodeCommandResponse::default()
                        },
                    );
                }
            }
            SessionEvent::RefreshConfig { request_id, .. } => {
                if let Some(s) = self.procs[i].session.as_mut() {
                    let _ = s.handle_refresh_applied(now, &request_id, Ok(()));
                }
            }
            SessionEvent::CancelRejected { .. }
            | SessionEvent::Rehome { .. }
            | SessionEvent::Members(_)
            | SessionEvent::WorkRefused { .. }
            | SessionEvent::PeerViolation { .. } => {
                self.log(|| format!("node {i} event {event_text}"));
            }
        }
    }

    /// The node's session ended: its connection closes and the supervisor decides.
    pub(super) fn session_closed(&mut self, i: usize, end: SessionEnd, abandoned: &[String]) {
        let now = self.now;
        let id = self.procs[i].node_id.clone();
        self.log(|| {
            format!(
                "{id} (proc {i}) session closed: {end:?}, {} abandoned",
                abandoned.len()
            )
        });
        let refused = match &end {
            SessionEnd::Rejected(reason) | SessionEnd::Deferred { reason, .. } => {
                reason.starts_with(iop_proto_core::edge::AUTH_FAILED)
                    || reason.starts_with(iop_proto_core::edge::TOO_MANY_FAILURES)
            }
            _ => false,
        };
        if self.procs[i].bad {
            check!(
                self,
                refused || !matches!(end, SessionEnd::Rejected(_) | SessionEnd::Deferred { .. }),
                "a bad sibling was told {end:?}"
            );
        } else {
            check!(
                self,
                !refused,
                "{id} (proc {i}), whose token is right, was told {end:?}"
            );
        }
        self.procs[i].work.clear();
        self.procs[i].session = None;
        if let Some(conn) = self.procs[i].conn.take()
            && let Some(link) = self.links.get_mut(&conn.0)
        {
            link.node_closed = true;
            link.to_node.clear();
        }
        // A process that was asked to stop exits whatever ended its session: the
        // supervisor's decision since `handle_stop`.
        let _ = match end.failure() {
            Some(failure) => self.procs[i].supervisor.handle_failure(now, failure),
            None => {
                self.procs[i].supervisor.handle_shutdown(now);
                Ok(())
            }
        };
    }

    pub(super) fn start_work(&mut self, i: usize, run_id: String, tunnel: bool) {
        let mode = self.procs[i].mode;
        let delay = self.provider_delay(mode);
        let total = u32::try_from(self.rng.range(1, 6)).unwrap_or(1);
        let next_at = if mode == Mode::Hang {
            Timestamp::MAX
        } else {
            self.now + delay
        };
        self.procs[i].work.insert(
            run_id,
            Work {
                tunnel,
                next_at,
                step: 0,
                total,
                cancelled: false,
                fail: mode == Mode::Fail,
                numbered: None,
            },
        );
    }

    /// Advances one piece of provider work by one output; true when the output is held
    /// in the session, not drained yet: a third of the tunnels answer whole, as a
    /// provider does that sends its head, body and end at once, and what they say reaches
    /// the session's queue before the shell drains it (the node merges their frames).
    pub(super) fn progress_work(&mut self, i: usize, run_id: &str) -> bool {
        let now = self.now;
        let mode = self.procs[i].mode;
        let delay = self.provider_delay(mode);
        let Some(work) = self.procs[i].work.get_mut(run_id) else {
            return false;
        };
        let (tunnel, step, total, cancelled, fail, numbered) = (
            work.tunnel,
            work.step,
            work.total,
            work.cancelled,
            work.fail,
            work.numbered,
        );
        // A numbered run that breaks does so after its second token.
        let broke = numbered.is_some_and(|(_, breaks)| breaks)
            && step == 3
            && step <= total
            && !cancelled
            && !fail;
        work.step += 1;
        work.next_at = now + delay;
        // A silent provider goes quiet after its first delta, until cancelled. A run
        // further on when it went quiet pauses where it is: the output due now is not
        // skipped, it comes when the provider speaks again.
        if mode == Mode::Silent && step >= 1 && !cancelled {
            work.next_at = Timestamp::MAX;
            if step > 1 {
                work.step -= 1;
                return false;
            }
        }
        let refuse = mode == Mode::Refuse && !cancelled;
        let unavailable = mode == Mode::Unavailable && !cancelled;
        // A run starts before it ends, even a cancelled one (a node session keeps its
        // capacity slot until the run's terminal).
        let last = cancelled && (tunnel || step >= 1)
            || fail && step >= 1
            || step > total
            || broke
            || refuse && (tunnel || step >= 1)
            || unavailable && step >= if tunnel { 2 } else { 1 };
        let Some(session) = self.procs[i].session.as_mut() else {
            return false;
        };
        let whole = tunnel && run_id.bytes().map(u32::from).sum::<u32>().is_multiple_of(3);
        let unreachable = || ErrorDetail {
            code: "upstream_unreachable".into(),
            message: "connection refused".into(),
            retryable: true,
        };
        let _ = if tunnel {
            let output = if refuse {
                TunnelOutput::Error(unreachable())
            } else if unavailable {
                match step {
                    0 => TunnelOutput::Status {
                        status: 503,
                        headers: vec![wire::Header {
                            name: "retry-after".into(),
                            value: Bytes::from_static(b"1"),
                        }],
                    },
                    1 => TunnelOutput::Body(Bytes::from_static(b"{\"error\":\"busy\"}")),
                    _ => TunnelOutput::End,
                }
            } else if step == 0 && !cancelled {
                TunnelOutput::Status {
                    status: 200,
                    headers: Vec::new(),
                }
            } else if cancelled {
                TunnelOutput::Error(ErrorDetail {
                    code: "cancelled".into(),
                    ..ErrorDetail::default()
                })
            } else if fail {
                TunnelOutput::Error(ErrorDetail {
                    code: "upstream_error".into(),
                    ..ErrorDetail::default()
                })
            } else if step > total {
                TunnelOutput::End
            } else if step == total {
                TunnelOutput::Usage(Usage::default())
            } else {
                TunnelOutput::Body(Bytes::from_static(b"data: x\n\n"))
            };
            session.handle_tunnel_output(now, run_id, output)
        } else {
            let output = if step == 0 {
                RunOutput::Start
            } else if refuse {
                RunOutput::Error(unreachable())
            } else if unavailable {
                RunOutput::Error(ErrorDetail {
                    code: "upstream_status_503".into(),
                    message: "the provider answered 503".into(),
                    retryable: true,
                })
            } else if cancelled {
                RunOutput::Cancelled
            } else if fail {
                RunOutput::Error(ErrorDetail {
                    code: "upstream_error".into(),
                    ..ErrorDetail::default()
                })
            } else if broke {
                RunOutput::Error(ErrorDetail {
                    code: "upstream_reset".into(),
                    message: "the provider's stream broke".into(),
                    retryable: true,
                })
            } else if step > total {
                RunOutput::Complete {
                    usage: None,
                    metadata: BTreeMap::new(),
                }
            } else if let Some((first, _)) = numbered {
                RunOutput::Delta(format!("{},", first + step - 1))
            } else {
                RunOutput::Delta("x".into())
            };
            session.handle_run_output(now, run_id, output)
        };
        if last {
            // The adapter's task returns, as the node shell's does: work it left without
            // a terminal (a provider that stopped mid-answer) ends here.
            self.procs[i].work.remove(run_id);
            if let Some(session) = self.procs[i].session.as_mut() {
                let _ = session.handle_work_returned(now, run_id);
            }
        }
        whole && !last
    }

    /// A process that ended while its restart already runs beside it: the restart takes
    /// its slot (and its links follow), the ended one stays dead in the other.
    pub(super) fn retire(&mut self, i: usize) {
        let Some(j) = self.procs[i].replacement.take() else {
            return;
        };
        self.procs[i].restart_at = None;
        self.procs[i].retired = true;
        self.procs.swap(i, j);
        for link in self.links.values_mut() {
            if link.node == i {
                link.node = j;
            } else if link.node == j {
                link.node = i;
            }
        }
        let id = self.procs[i].node_id.clone();
        self.log(|| format!("{id}: proc {j} takes over slot {i}"));
    }

    pub(super) fn crash(&mut self, i: usize) {
        let id = self.procs[i].node_id.clone();
        self.log(|| format!("{id} (proc {i}) crashes"));
        let p = &mut self.procs[i];
        p.alive = false;
        p.session = None;
        p.work.clear();
        p.dial_at = None;
        if let Some(conn) = p.conn.take()
            && let Some(link) = self.links.get_mut(&conn.0)
        {
            link.node_closed = true;
            link.to_node.clear();
        }
    }

    // ----- the scheduler -----
}

/// A streamed request's numbered answer, from its run's input: the number its first
/// token carries (after the tokens of a final assistant message it continues) and how
/// many tokens it gives (its `max_tokens`). `None` for any other input.
fn numbered(input: &[u8]) -> Option<(u32, u32)> {
    let body: serde_json::Value = serde_json::from_slice(input).ok()?;
    let total = u32::try_from(body["max_tokens"].as_u64()?).ok()?;
    let mut first = 1;
    if body["continue_final_message"] == true {
        let last = body["messages"].as_array()?.last()?;
        if last["role"] == "assistant" {
            first += last["content"].as_str()?.matches(',').count() as u32;
        }
    }
    Some((first, total))
}
