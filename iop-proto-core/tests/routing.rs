//! Scenario tests of resilient routing in the Edge machine: retries before the first
//! byte, a slow run tried beside, trials and ejections. (The simulation checks the same
//! rules against random worlds; these pin each one down.)

mod common;

use std::time::Duration;

use common::edge::*;
use iop_proto_core::edge::*;
use iop_proto_core::wire::*;
use iop_proto_core::*;

/// Nodes n1 (mock adapter "a") and n2 (mock adapter "b"), capacity one each, both
/// serving model "m"; a first-byte deadline of one second; heartbeats far apart.
fn two_providers() -> EdgeConfig {
    let mut cfg = config();
    cfg.timing.heartbeat_interval = Duration::from_secs(100);
    cfg.timing.heartbeat_timeout = Duration::from_secs(300);
    cfg.nodes.insert(
        "n1".into(),
        node(vec![adapter("a", AdapterType::Mock, 1, 0)]),
    );
    cfg.nodes.insert(
        "n2".into(),
        node(vec![adapter("b", AdapterType::Mock, 1, 0)]),
    );
    cfg.models.insert(
        "m".into(),
        ModelSpec {
            candidates: vec![candidate("n1", "a"), candidate("n2", "b")],
            long_context_threshold: None,
            context_tokens: None,
            first_byte_timeout: None,
            resume_limit: None,
            stall_timeout: None,
            affinity: None,
        },
    );
    cfg.models.remove("solo");
    cfg.routing.first_byte_timeout = Duration::from_secs(1);
    cfg
}

struct World {
    h: Harness,
    conns: [ConnId; 2],
}

impl World {
    fn new() -> Self {
        let mut h = Harness::with(two_providers());
        let conns = [h.connect("n1"), h.connect("n2")];
        World { h, conns }
    }

    fn conn(&self, grant: &Grant) -> ConnId {
        if &*grant.node_id == "n1" {
            self.conns[0]
        } else {
            self.conns[1]
        }
    }

    fn send(&mut self, grant: &Grant, sequence: u64, kind: RunEventType, delta: &str) {
        self.send_error(grant, sequence, kind, delta, None);
    }

    fn send_error(
        &mut self,
        grant: &Grant,
        sequence: u64,
        kind: RunEventType,
        delta: &str,
        error: Option<ErrorDetail>,
    ) {
        let conn = self.conn(grant);
        self.h.send(
            conn,
            Body::RunEvent(RunEvent {
                run_id: grant.run.wire(),
                sequence,
                r#type: kind as i32,
                delta: delta.into(),
                error,
                ..Default::default()
            }),
        );
    }

    /// A run that answers: start, one delta, complete.
    fn answer(&mut self, grant: &Grant, text: &str) {
        self.send(grant, 1, RunEventType::Start, "");
        self.send(grant, 2, RunEventType::Delta, text);
        self.send(grant, 3, RunEventType::Complete, "");
    }

    /// A run that fails right after its start, as an unreachable provider does.
    fn fail(&mut self, grant: &Grant) {
        self.send(grant, 1, RunEventType::Start, "");
        self.send_error(
            grant,
            2,
            RunEventType::Error,
            "",
            Some(ErrorDetail {
                code: "upstream_unreachable".into(),
                message: "connection refused".into(),
                retryable: true,
            }),
        );
    }

    fn routing(&self, provider: &str) -> ProviderRouting {
        self.h
            .edge
            .provider_routing()
            .into_iter()
            .find(|p| &*p.provider_id == provider)
            .expect("listed")
    }
}

/// What the caller of `request` was told: deltas, in order, and how it ended.
fn told(events: &[EdgeEvent], request: RequestId) -> (Vec<String>, Option<Outcome>) {
    let mut deltas = Vec::new();
    let mut end = None;
    for e in events {
        if let EdgeEvent::Request { request: r, event } = e
            && *r == request
        {
            match event {
                RequestEvent::Run(run) if run.r#type == RunEventType::Delta as i32 => {
                    deltas.push(run.delta.clone());
                }
                RequestEvent::Ended(outcome) => end = Some(outcome.clone()),
                _ => {}
            }
        }
    }
    (deltas, end)
}

fn cancels(transmits: &[Transmit]) -> Vec<String> {
    transmits
        .iter()
        .filter_map(|t| match t {
            Transmit::Frame { envelope, .. } => match &envelope.body {
                Some(Body::CancelRequest(c)) => Some(c.run_id.clone()),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

#[test]
fn a_run_failing_after_its_start_is_retried_elsewhere_and_the_caller_sees_one_answer() {
    let mut w = World::new();
    let request = w.h.submit("m", 10).expect("accepted");
    let (_, events) = w.h.drain();
    let first = grants(&events).remove(0);
    w.fail(&first);
    let (_, events) = w.h.drain();
    assert!(
        events
            .iter()
            .any(|e| matches!(e, EdgeEvent::Retried { why: "error", .. })),
        "{events:?}"
    );
    let second = grants(&events).remove(0);
    assert_ne!(
        second.node_id, first.node_id,
        "not the provider that just failed"
    );
    assert_eq!(second.run.attempt, 1);
    w.answer(&second, "hello");
    let (_, more) = w.h.drain();
    let all: Vec<EdgeEvent> = events.into_iter().chain(more).collect();
    let (deltas, end) = told(&all, request);
    assert_eq!(deltas, ["hello"]);
    assert!(matches!(end, Some(Outcome::Completed)), "{end:?}");
    // The caller was told who answered once, and nothing of the failed run.
    let dispatched: Vec<&EdgeEvent> = all
        .iter()
        .filter(|e| {
            matches!(
                e,
                EdgeEvent::Request {
                    event: RequestEvent::Dispatched { .. },
                    ..
                }
            )
        })
        .collect();
    assert_eq!(dispatched.len(), 1, "{dispatched:?}");
    assert_eq!(w.routing(&first.provider_id).consecutive_failures, 1);
    assert_eq!(w.routing(&second.provider_id).consecutive_failures, 0);
}

#[test]
fn nothing_is_retried_after_the_first_byte() {
    let mut w = World::new();
    let request = w.h.submit_stream("m").expect("accepted");
    let (_, events) = w.h.drain();
    let run = grants(&events).remove(0);
    w.send(&run, 1, RunEventType::Start, "");
    w.send(&run, 2, RunEventType::Delta, "part");
    w.send_error(
        &run,
        3,
        RunEventType::Error,
        "",
        Some(ErrorDetail {
            code: "upstream_reset".into(),
            message: "reset".into(),
            retryable: true,
        }),
    );
    let (_, events) = w.h.drain();
    assert!(grants(&events).is_empty(), "{events:?}");
    let (deltas, end) = told(&events, request);
    assert_eq!(deltas, ["part"]);
    assert!(matches!(end, Some(Outcome::Failed(_))), "{end:?}");
}

#[test]
fn a_slow_run_is_tried_beside_and_a_later_attempt_that_wins_makes_it_a_failure() {
    let mut w = World::new();
    let request = w.h.submit("m", 10).expect("accepted");
    let (_, events) = w.h.drain();
    let slow = grants(&events).remove(0);
    w.send(&slow, 1, RunEventType::Start, "");
    w.h.at(1000);
    let (_, events) = w.h.drain();
    assert!(
        events.iter().any(|e| matches!(
            e,
            EdgeEvent::Retried {
                why: "first_byte_timeout",
                ..
            }
        )),
        "{events:?}"
    );
    let beside = grants(&events).remove(0);
    assert_ne!(beside.node_id, slow.node_id);
    // Not held against it yet: it may still answer first.
    assert_eq!(w.routing(&slow.provider_id).consecutive_failures, 0);
    w.answer(&beside, "fast");
    let (transmits, events) = w.h.drain();
    assert_eq!(
        cancels(&transmits),
        [slow.run.wire()],
        "the slow run is cancelled"
    );
    let (deltas, end) = told(&events, request);
    assert_eq!(deltas, ["fast"]);
    assert!(matches!(end, Some(Outcome::Completed)));
    assert_eq!(w.routing(&slow.provider_id).consecutive_failures, 1);
    // What the cancelled run still says goes nowhere.
    w.send(&slow, 2, RunEventType::Delta, "late");
    w.send(&slow, 3, RunEventType::Cancelled, "");
    let (_, events) = w.h.drain();
    assert_eq!(told(&events, request), (Vec::new(), None));
    assert_eq!(w.h.edge.ledger().leases_held(), 0);
}

#[test]
fn a_slow_run_that_answers_before_the_run_beside_it_is_a_success_and_the_other_says_nothing() {
    let mut w = World::new();
    let request = w.h.submit("m", 10).expect("accepted");
    let (_, events) = w.h.drain();
    let slow = grants(&events).remove(0);
    w.h.at(1000);
    let (_, events) = w.h.drain();
    let beside = grants(&events).remove(0);
    w.h.at(1500);
    // A long answer that is not streamed: its head comes at its end, after the
    // deadline; it wins all the same.
    w.answer(&slow, "long");
    let (transmits, events) = w.h.drain();
    assert_eq!(cancels(&transmits), [beside.run.wire()]);
    assert_eq!(told(&events, request).0, ["long"]);
    let slow_routing = w.routing(&slow.provider_id);
    assert_eq!(slow_routing.consecutive_failures, 0);
    assert_eq!(slow_routing.first_byte, Some(Duration::from_millis(1500)));
    assert_eq!(w.routing(&beside.provider_id).consecutive_failures, 0);
}

#[test]
fn with_the_other_provider_busy_a_slow_run_is_tried_beside_on_the_first_that_frees() {
    let mut w = World::new();
    let a = w.h.submit("m", 10).expect("accepted");
    let b = w.h.submit("m", 10).expect("accepted");
    let (_, events) = w.h.drain();
    let runs = grants(&events);
    assert_eq!(runs.len(), 2, "one on each provider");
    let (run_a, run_b) = (&runs[0], &runs[1]);
    assert_eq!(run_a.request, a);
    // Request a's run is slow; b's answers, but is still streaming at the deadline.
    w.send(run_b, 1, RunEventType::Start, "");
    w.send(run_b, 2, RunEventType::Delta, "b");
    w.h.at(1000);
    let (_, events) = w.h.drain();
    assert!(grants(&events).is_empty(), "the other provider is busy");
    assert_eq!(
        w.h.edge.queue().len(),
        1,
        "a waits for a provider beside its run"
    );
    // b ends: its provider frees, and a is tried there.
    w.send(run_b, 3, RunEventType::Complete, "");
    let (_, events) = w.h.drain();
    assert!(matches!(told(&events, b).1, Some(Outcome::Completed)));
    let beside = grants(&events).remove(0);
    assert_eq!((beside.request, &beside.node_id), (a, &run_b.node_id));
    w.answer(&beside, "a");
    let (transmits, events) = w.h.drain();
    assert_eq!(cancels(&transmits), [run_a.run.wire()]);
    assert_eq!(told(&events, a).0, ["a"]);
}

#[test]
fn a_slow_run_answering_while_its_request_waits_beside_it_leaves_the_queue() {
    let mut w = World::new();
    let a = w.h.submit_stream("m").expect("accepted");
    let _b = w.h.submit("m", 10).expect("accepted");
    let (_, events) = w.h.drain();
    let runs = grants(&events);
    let (run_a, run_b) = (runs[0].clone(), runs[1].clone());
    w.send(&run_b, 1, RunEventType::Start, "");
    w.send(&run_b, 2, RunEventType::Delta, "b");
    w.h.at(1000);
    w.h.drain();
    assert_eq!(w.h.edge.queue().len(), 1);
    // Its first byte, and it is still streaming: the wait beside it is over already.
    w.send(&run_a, 1, RunEventType::Start, "");
    w.send(&run_a, 2, RunEventType::Delta, "a");
    let (_, events) = w.h.drain();
    assert_eq!(told(&events, a).0, ["a"]);
    assert_eq!(w.h.edge.queue().len(), 0, "no wait outlives its need");
    w.send(&run_a, 3, RunEventType::Complete, "");
    // The provider that frees later serves no ghost.
    w.send(&run_b, 3, RunEventType::Complete, "");
    let (_, events) = w.h.drain();
    assert!(grants(&events).is_empty(), "{events:?}");
}

#[test]
fn a_provider_that_fails_is_on_trial_one_request_at_a_time_then_ejected_and_probed() {
    let mut cfg = two_providers();
    // Room for many, so only the trial rule holds the failing one to a single request.
    cfg.nodes.insert(
        "n1".into(),
        node(vec![adapter("a", AdapterType::Mock, 8, 0)]),
    );
    cfg.nodes.insert(
        "n2".into(),
        node(vec![adapter("b", AdapterType::Mock, 8, 0)]),
    );
    cfg.routing.eject_base = Duration::from_secs(5);
    let mut h = Harness::with(cfg);
    let conns = [h.connect("n1"), h.connect("n2")];
    let mut w = World { h, conns };
    let failing = |g: &Grant| &*g.provider_id == "b";
    // Requests one at a time: each to "b" fails at once, each to "a" keeps running.
    let mut to_b = 0;
    let mut ejected = None;
    for n in 0..12u64 {
        w.h.at(n * 10);
        w.h.submit("m", 10).expect("accepted");
        let (_, events) = w.h.drain();
        let mut pending: Vec<Grant> = grants(&events);
        let mut all = events;
        while let Some(g) = pending.pop() {
            if failing(&g) {
                to_b += 1;
                assert_eq!(
                    w.h.usage("n2", "b").in_flight,
                    1,
                    "on trial or not, one at a time here"
                );
                w.fail(&g);
                let (_, events) = w.h.drain();
                pending.extend(grants(&events));
                all.extend(events);
            }
        }
        if let Some(e) = all
            .iter()
            .find(|e| matches!(e, EdgeEvent::ProviderEjected { .. }))
        {
            ejected = Some(e.clone());
            break;
        }
    }
    let Some(EdgeEvent::ProviderEjected {
        provider_id,
        reason,
        time,
        ..
    }) = ejected
    else {
        panic!("never ejected after {to_b} failures");
    };
    assert_eq!(
        (&*provider_id, reason, time),
        ("b", Ejection::Consecutive(3), Duration::from_secs(5))
    );
    assert_eq!(to_b, 3, "ejected at its third failure");
    assert!(
        !w.h.edge
            .pickable(w.h.edge.resource("n2", "b").expect("configured"))
    );
    // Its time is up: the next request is its probe; it answers and b is restored.
    let now = w.h.now.as_millis();
    w.h.at(now + 5000);
    let mut probe = None;
    for _ in 0..8 {
        w.h.submit("m", 10).expect("accepted");
        let (_, events) = w.h.drain();
        if let Some(g) = grants(&events).into_iter().find(|g| failing(g)) {
            probe = Some(g);
            break;
        }
    }
    let probe = probe.expect("the probe goes to b");
    assert_eq!(w.routing("b").standing, Standing::Probing);
    w.answer(&probe, "back");
    let (_, events) = w.h.drain();
    assert!(
        events
            .iter()
            .any(|e| matches!(e, EdgeEvent::ProviderRestored { provider_id, .. } if &**provider_id == "b")),
        "{events:?}"
    );
    assert_eq!(w.routing("b").standing, Standing::Live);
}

/// A request that is not streamed gets its answer whole, so its first byte is its
/// terminal: a run lost before it ends (its node gone, its provider failing midway) is
/// tried again on another provider, and the caller sees only the answer that completed.
#[test]
fn a_whole_answer_lost_before_its_end_is_tried_again_and_nothing_of_it_reaches_the_caller() {
    let mut w = World::new();
    let request = w.h.submit("m", 10).expect("accepted");
    let (_, events) = w.h.drain();
    let first = grants(&events).remove(0);
    w.send(&first, 1, RunEventType::Start, "");
    w.send(&first, 2, RunEventType::Delta, "half an ");
    let (_, events) = w.h.drain();
    assert_eq!(told(&events, request), (Vec::new(), None), "held");
    // Past the first-byte deadline while it produces: not slow, nothing tried beside.
    w.h.at(1500);
    let (_, events) = w.h.drain();
    assert!(grants(&events).is_empty(), "{events:?}");
    // Its node is lost before the answer ends.
    let conn = w.conn(&first);
    w.h.edge
        .handle_connection_closed(w.h.now, conn)
        .expect("a known connection");
    let (_, events) = w.h.drain();
    let again = grants(&events)
        .into_iter()
        .find(|g| g.request == request)
        .expect("tried again");
    assert_ne!(again.node_id, first.node_id);
    w.answer(&again, "whole answer");
    let (_, events) = w.h.drain();
    let (deltas, end) = told(&events, request);
    assert_eq!(deltas, ["whole answer"]);
    assert_eq!(end, Some(Outcome::Completed));
}

/// A run that hangs past its first-byte deadline gets a run tried beside it; when that
/// one is refused by its node (or fails), the rescue goes on: the request waits for a
/// provider again, and waits again when that wait times out, never on the hung run alone
/// while another provider may still answer.
#[test]
fn a_refused_rescue_of_a_hung_run_is_tried_again() {
    let mut w = World::new();
    let request = w.h.submit("m", 10).expect("accepted");
    let (_, events) = w.h.drain();
    let hung = grants(&events).remove(0);
    w.h.at(1000);
    let (_, events) = w.h.drain();
    let rescue = grants(&events).remove(0);
    assert_ne!(rescue.node_id, hung.node_id);
    let other = w.conn(&rescue);
    w.h.refuse(other, &rescue.run.wire());
    let (_, events) = w.h.drain();
    assert!(told(&events, request).1.is_none(), "{events:?}");
    assert_eq!(w.h.edge.queue().len(), 1, "it waits for a provider again");
    // The node said it is full: the refusal hold passes before it is asked again.
    let hold = two_providers().timing.heartbeat_interval.as_millis() as u64;
    w.h.at(1000 + hold);
    let (_, events) = w.h.drain();
    let again = grants(&events)
        .into_iter()
        .find(|g| g.request == request)
        .expect("the rescue is dispatched again");
    assert_eq!(again.node_id, rescue.node_id);
    w.answer(&again, "rescued");
    let (transmits, events) = w.h.drain();
    assert_eq!(told(&events, request).0, ["rescued"]);
    assert_eq!(cancels(&transmits), [hung.run.wire()]);
}

/// Waiting beside a hung run for a provider that stays busy: when the wait times out,
/// the request waits again rather than being left to the hung run alone.
#[test]
fn a_wait_beside_a_hung_run_that_times_out_waits_again() {
    let mut w = World::new();
    let a = w.h.submit("m", 10).expect("accepted");
    let b = w.h.submit_stream("m").expect("accepted");
    let (_, events) = w.h.drain();
    let runs = grants(&events);
    let run_b = runs
        .iter()
        .find(|g| g.request == b)
        .expect("b runs")
        .clone();
    w.send(&run_b, 1, RunEventType::Start, "");
    w.send(&run_b, 2, RunEventType::Delta, "b");
    w.h.at(1000);
    w.h.drain();
    assert_eq!(w.h.edge.queue().len(), 1, "a waits beside its hung run");
    let wait = config().queue.wait_timeout.as_millis() as u64;
    w.h.at(1000 + wait);
    w.h.drain();
    assert_eq!(
        w.h.edge.queue().len(),
        1,
        "and again after its wait timed out"
    );
    w.send(&run_b, 3, RunEventType::Complete, "");
    let (_, events) = w.h.drain();
    let beside = grants(&events)
        .into_iter()
        .find(|g| g.request == a)
        .expect("tried beside once a provider freed");
    assert_eq!(beside.node_id, run_b.node_id);
}

/// Sends a whole tunnel answer for `grant`: `status` (with `retry-after` when given),
/// one body chunk, the end; in one merged frame when `merged`, as a node does for an Edge
/// that takes them.
fn tunnel_answer(
    h: &mut Harness,
    conn: ConnId,
    grant: &Grant,
    status: u32,
    retry_after: Option<&str>,
    merged: bool,
) {
    let frame = |sequence, kind: TunnelFrameKind| ProviderTunnelFrame {
        run_id: grant.run.wire(),
        sequence,
        kind: kind as i32,
        ..Default::default()
    };
    let mut head = frame(0, TunnelFrameKind::Status);
    head.status_code = status;
    if let Some(after) = retry_after {
        head.headers.push(Header {
            name: "retry-after".into(),
            value: bytes::Bytes::copy_from_slice(after.as_bytes()),
        });
    }
    let mut body = frame(1, TunnelFrameKind::Body);
    body.body = bytes::Bytes::from_static(b"{}");
    let mut end = frame(2, TunnelFrameKind::End);
    end.end = true;
    if merged {
        assert!(
            tunnel::merge_into(&mut head, body).is_none(),
            "the body joins"
        );
        assert!(
            tunnel::merge_into(&mut head, end).is_none(),
            "the end joins"
        );
        h.send(conn, Body::ProviderTunnelFrame(head));
        return;
    }
    for f in [head, body, end] {
        h.send(conn, Body::ProviderTunnelFrame(f));
    }
}

/// A small answer's parts that the core takes together (a merged frame, or frames read
/// in one go) reach the caller as one event holding them in order: each part is what
/// it would be as an event of its own. Parts between which the caller was handed
/// anything else stay apart, and so do the parts of two requests.
#[test]
fn parts_taken_together_reach_the_caller_as_one_event_in_order() {
    use tunnel::TunnelPart;
    let mut cfg = two_providers();
    for (node_id, name) in [("n1", "a"), ("n2", "b")] {
        cfg.nodes.insert(
            node_id.into(),
            node(vec![adapter(name, AdapterType::OpenaiCompat, 4, 0)]),
        );
    }
    let mut h = Harness::with(cfg);
    let conns = [h.connect("n1"), h.connect("n2")];
    let conn_of = |g: &Grant| {
        if &*g.node_id == "n1" {
            conns[0]
        } else {
            conns[1]
        }
    };
    // Merged: one event after the dispatch, then the end.
    let r1 = h.submit_tunnel("m").expect("accepted");
    let (_, events) = h.drain();
    let g1 = grants(&events).remove(0);
    tunnel_answer(&mut h, conn_of(&g1), &g1, 200, None, true);
    let (_, events) = h.drain();
    let caller = given(&events, r1);
    assert_eq!(caller.len(), 3, "{caller:?}");
    assert!(
        matches!(caller[0], RequestEvent::Dispatched { .. }),
        "{caller:?}"
    );
    let RequestEvent::Tunnels(parts) = &caller[1] else {
        panic!("one event for the parts: {caller:?}");
    };
    assert!(
        matches!(
            &parts[..],
            [TunnelPart::Status { code: 200, .. }, TunnelPart::Body(body), TunnelPart::End]
                if &body[..] == b"{}"
        ),
        "{parts:?}"
    );
    assert_eq!(caller[2], RequestEvent::Ended(Outcome::Completed));
    // Frame by frame, each handed over before the next arrives: an event each.
    let r2 = h.submit_tunnel("m").expect("accepted");
    let (_, events) = h.drain();
    let g2 = grants(&events).remove(0);
    let frame = |sequence, kind: TunnelFrameKind| ProviderTunnelFrame {
        run_id: g2.run.wire(),
        sequence,
        kind: kind as i32,
        ..Default::default()
    };
    let mut head = frame(0, TunnelFrameKind::Status);
    head.status_code = 200;
    let mut body = frame(1, TunnelFrameKind::Body);
    body.body = bytes::Bytes::from_static(b"{}");
    let mut end = frame(2, TunnelFrameKind::End);
    end.end = true;
    let mut caller = Vec::new();
    for f in [head, body, end] {
        h.send(conn_of(&g2), Body::ProviderTunnelFrame(f));
        let (_, events) = h.drain();
        caller.extend(given(&events, r2));
    }
    assert!(
        matches!(
            &caller[..],
            [
                RequestEvent::Dispatched { .. },
                RequestEvent::Tunnel(TunnelPart::Status { code: 200, .. }),
                RequestEvent::Tunnel(TunnelPart::Body(_)),
                RequestEvent::Tunnel(TunnelPart::End),
                RequestEvent::Ended(Outcome::Completed),
            ]
        ),
        "{caller:?}"
    );
    // Two requests answered in the same step: each gets its own parts.
    let (r3, r4) = (
        h.submit_tunnel("m").expect("accepted"),
        h.submit_tunnel("m").expect("accepted"),
    );
    let (_, events) = h.drain();
    let granted = grants(&events);
    let merged = |g: &Grant| {
        let mut head = ProviderTunnelFrame {
            run_id: g.run.wire(),
            kind: TunnelFrameKind::Status as i32,
            status_code: 200,
            ..Default::default()
        };
        let tail = ProviderTunnelFrame {
            run_id: g.run.wire(),
            sequence: 1,
            kind: TunnelFrameKind::End as i32,
            end: true,
            ..Default::default()
        };
        assert!(tunnel::merge_into(&mut head, tail).is_none());
        head
    };
    h.send(
        conn_of(&granted[0]),
        Body::ProviderTunnelFrame(merged(&granted[0])),
    );
    h.send(
        conn_of(&granted[1]),
        Body::ProviderTunnelFrame(merged(&granted[1])),
    );
    let (_, events) = h.drain();
    for request in [r3, r4] {
        let caller = given(&events, request);
        assert!(
            matches!(
                &caller[..],
                [
                    RequestEvent::Dispatched { .. },
                    RequestEvent::Tunnels(parts),
                    RequestEvent::Ended(Outcome::Completed),
                ] if matches!(&parts[..], [TunnelPart::Status { .. }, TunnelPart::End])
            ),
            "{request}: {caller:?}"
        );
    }
}

/// What the caller of `request` was given, in order (the frames without their run's
/// name, which the parts of a merged frame do not carry and no caller reads).
fn given(events: &[EdgeEvent], request: RequestId) -> Vec<RequestEvent> {
    events
        .iter()
        .filter_map(|e| match e {
            EdgeEvent::Request { request: r, event } if *r == request => {
                let mut event = event.clone();
                if let RequestEvent::Tunnel(tunnel::TunnelPart::Frame(frame)) = &mut event {
                    frame.run_id.clear();
                }
                Some(event)
            }
            _ => None,
        })
        .collect()
}

/// A provider that answers 503 with `Retry-After` is taken out of the rotation for that
/// long even where the ejection caps would keep it (here: the group's last provider in
/// the rotation); a request then waits for capacity instead of receiving its 503. The
/// same whether the answers come as separate frames or merged ones, and the callers are
/// given the same.
#[test]
fn a_retry_after_cools_a_provider_whatever_the_cap_and_requests_wait_for_capacity() {
    let separate = retry_after_world(false);
    let merged = retry_after_world(true);
    assert!(!separate.is_empty());
    assert_eq!(format!("{separate:?}"), format!("{merged:?}"));
}

/// The retry-after scenario with answers `merged` or not: what its callers were given.
fn retry_after_world(merged: bool) -> Vec<RequestEvent> {
    let mut cfg = two_providers();
    for (node_id, name) in [("n1", "a"), ("n2", "b")] {
        cfg.nodes.insert(
            node_id.into(),
            node(vec![adapter(name, AdapterType::OpenaiCompat, 4, 0)]),
        );
    }
    let mut h = Harness::with(cfg);
    let conns = [h.connect("n1"), h.connect("n2")];
    let conn_of = |g: &Grant| {
        if &*g.node_id == "n1" {
            conns[0]
        } else {
            conns[1]
        }
    };
    // The first provider asks for two seconds: out, and the request goes to the other.
    let r1 = h.submit_tunnel("m").expect("accepted");
    let (_, events) = h.drain();
    let x = grants(&events).remove(0);
    tunnel_answer(&mut h, conn_of(&x), &x, 503, Some("2"), merged);
    let (_, events) = h.drain();
    let y = grants(&events)
        .into_iter()
        .find(|g| g.request == r1)
        .expect("tried on the other provider");
    assert_ne!(y.node_id, x.node_id);
    tunnel_answer(&mut h, conn_of(&y), &y, 200, None, merged);
    let (_, events) = h.drain();
    let mut caller = given(&events, r1);
    // The other one asks for thirty: out too, though it was the last in the rotation;
    // the request waits for the first one's probe instead of receiving the 503.
    let r2 = h.submit_tunnel("m").expect("accepted");
    let (_, events) = h.drain();
    let y2 = grants(&events).remove(0);
    assert_eq!(y2.node_id, y.node_id);
    tunnel_answer(&mut h, conn_of(&y2), &y2, 503, Some("30"), merged);
    let (_, events) = h.drain();
    assert!(
        ended(&events).is_empty(),
        "no caller gets the 503: {events:?}"
    );
    assert!(
        events.iter().any(|e| matches!(
            e,
            EdgeEvent::ProviderEjected { reason: Ejection::RetryAfter, provider_id, .. }
                if *provider_id == y.provider_id
        )),
        "{events:?}"
    );
    assert_eq!(h.edge.queue().len(), 1, "it waits");
    h.at(2000);
    let (_, events) = h.drain();
    let probe = grants(&events)
        .into_iter()
        .find(|g| g.request == r2)
        .expect("dispatched to the first provider's probe");
    assert_eq!(probe.node_id, x.node_id);
    tunnel_answer(&mut h, conn_of(&probe), &probe, 200, None, merged);
    let (_, events) = h.drain();
    let (_, outcome) = ended(&events)
        .into_iter()
        .find(|(r, _)| *r == r2)
        .expect("ended");
    assert_eq!(outcome, Outcome::Completed);
    caller.extend(given(&events, r2));
    caller
}

/// A run past its first-byte deadline whose request may not be tried beside it yet (the
/// retry budget is spent) is looked at again after another deadline, and tried beside
/// once the budget has room: no request is left to a hung provider for good because
/// others were being retried at its deadline.
#[test]
fn a_slow_run_denied_a_try_beside_by_the_budget_gets_one_once_it_frees() {
    let mut cfg = two_providers();
    cfg.nodes.insert(
        "n1".into(),
        node(vec![adapter("a", AdapterType::Mock, 4, 0)]),
    );
    cfg.nodes.insert(
        "n2".into(),
        node(vec![adapter("b", AdapterType::Mock, 4, 0)]),
    );
    cfg.routing.retry_budget_min = 1;
    cfg.routing.retry_budget_percent = 0;
    let mut h = Harness::with(cfg);
    let conns = [h.connect("n1"), h.connect("n2")];
    let mut w = World { h, conns };
    let first = w.h.submit("m", 10).expect("accepted");
    let second = w.h.submit("m", 10).expect("accepted");
    let (_, events) = w.h.drain();
    let runs = grants(&events);
    assert_eq!(runs.len(), 2);
    w.h.at(1000);
    let (_, events) = w.h.drain();
    let beside = grants(&events);
    assert_eq!(beside.len(), 1, "the budget allows one: {events:?}");
    let (rescued, other) = if beside[0].request == first {
        (first, second)
    } else {
        (second, first)
    };
    w.answer(&beside[0], "one");
    let (_, events) = w.h.drain();
    assert_eq!(told(&events, rescued).0, ["one"]);
    // The budget has room again: the other is tried beside at its next look.
    w.h.at(2000);
    let (_, events) = w.h.drain();
    let later = grants(&events)
        .into_iter()
        .find(|g| g.request == other)
        .expect("tried beside once the budget freed");
    w.answer(&later, "two");
    let (_, events) = w.h.drain();
    assert_eq!(told(&events, other).0, ["two"]);
}

// ----- continuing a stream lost midway (issue 73) -----

/// [`two_providers`] whose adapters continue a final assistant message (`resume`), with
/// model "m"'s `resume_limit` and `stall_timeout`.
fn resuming(limit: Option<u32>, stall: Option<Duration>) -> (Harness, [ConnId; 2]) {
    let mut cfg = two_providers();
    for spec in cfg.nodes.values_mut() {
        for adapter in &mut spec.adapters {
            adapter.options.insert("resume".into(), "true".into());
        }
    }
    let m = cfg.models.get_mut("m").expect("m");
    m.resume_limit = limit;
    m.stall_timeout = stall;
    let mut h = Harness::with(cfg);
    let conns = [h.connect("n1"), h.connect("n2")];
    (h, conns)
}

/// The connection of the node `grant` went to.
fn node_conn(conns: &[ConnId; 2], grant: &Grant) -> ConnId {
    if &*grant.node_id == "n1" {
        conns[0]
    } else {
        conns[1]
    }
}

const ASKED: &[u8] =
    br#"{"model":"m","stream":true,"max_tokens":10,"messages":[{"role":"user","content":"hi"}]}"#;

fn submit_streamed(h: &mut Harness) -> RequestId {
    let mut submit = Submit::chat("m", bytes::Bytes::from_static(ASKED));
    submit.stream = true;
    h.edge.handle_submit(h.now, submit).expect("accepted")
}

fn event(run: &Grant, sequence: u64, kind: RunEventType, delta: &str) -> Body {
    Body::RunEvent(RunEvent {
        run_id: run.run.wire(),
        sequence,
        r#type: kind as i32,
        delta: delta.into(),
        ..Default::default()
    })
}

/// The run requests sent to `conn`.
fn run_inputs(transmits: &[Transmit], conn: ConnId) -> Vec<serde_json::Value> {
    frames_to(transmits, conn)
        .into_iter()
        .filter_map(|b| match b {
            Body::RunRequest(r) => serde_json::from_slice(&r.input).ok(),
            _ => None,
        })
        .collect()
}

/// A streamed answer whose node is lost after two deltas is continued on the other
/// provider: its run is sent the request with the delivered text as a final assistant
/// message to continue and `max_tokens` lowered by the two tokens produced; the caller
/// gets no second start and no second dispatch, the continuation's deltas in order, and
/// usage counting the lost run's tokens.
#[test]
fn a_stream_whose_node_is_lost_midway_is_continued_from_what_its_caller_has() {
    let (mut h, conns) = resuming(None, None);
    let request = submit_streamed(&mut h);
    let (_, events) = h.drain();
    let first = grants(&events).remove(0);
    let conn = node_conn(&conns, &first);
    let other = if conn == conns[0] { conns[1] } else { conns[0] };
    h.send(conn, event(&first, 1, RunEventType::Start, ""));
    h.send(conn, event(&first, 2, RunEventType::Delta, "Hello "));
    h.send(conn, event(&first, 3, RunEventType::Delta, "wor"));
    let (_, events) = h.drain();
    assert_eq!(told(&events, request).0, ["Hello ", "wor"]);
    h.edge
        .handle_connection_closed(h.now, conn)
        .expect("a known connection");
    let (transmits, events) = h.drain();
    assert!(
        events.iter().any(|e| matches!(
            e,
            EdgeEvent::Resumed {
                why: "node_lost",
                delivered: 9,
                ..
            }
        )),
        "{events:?}"
    );
    assert_eq!(told(&events, request), (Vec::new(), None), "not ended");
    let again = grants(&events).remove(0);
    assert_ne!(again.node_id, first.node_id);
    let input = run_inputs(&transmits, other).remove(0);
    assert_eq!(
        input["messages"],
        serde_json::json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello wor"}])
    );
    assert_eq!(input["continue_final_message"], true);
    assert_eq!(input["add_generation_prompt"], false);
    assert_eq!(input["max_tokens"], 8);
    h.send(other, event(&again, 1, RunEventType::Start, ""));
    h.send(other, event(&again, 2, RunEventType::Delta, "ld"));
    h.send(
        other,
        Body::RunEvent(RunEvent {
            run_id: again.run.wire(),
            sequence: 3,
            r#type: RunEventType::Complete as i32,
            usage: Some(Usage {
                prompt_tokens: 7,
                completion_tokens: 1,
                total_tokens: 8,
            }),
            ..Default::default()
        }),
    );
    let (_, events) = h.drain();
    let mine: Vec<&RequestEvent> = events
        .iter()
        .filter_map(|e| match e {
            EdgeEvent::Request { request: r, event } if *r == request => Some(event),
            _ => None,
        })
        .collect();
    assert!(
        !mine
            .iter()
            .any(|e| matches!(e, RequestEvent::Dispatched { .. })
                || matches!(e, RequestEvent::Run(r) if r.r#type == RunEventType::Start as i32)),
        "{mine:?}"
    );
    assert_eq!(
        told(&events, request),
        (vec!["ld".to_owned()], Some(Outcome::Completed))
    );
    let usage = mine
        .iter()
        .find_map(|e| match e {
            RequestEvent::Run(r) => r.usage,
            _ => None,
        })
        .expect("usage");
    assert_eq!((usage.completion_tokens, usage.total_tokens), (3, 10));
}

/// `resume_limit = 0`: the caller gets the loss, as before; a provider failing midway
/// with a retryable error is continued elsewhere at most `resume_limit` times.
#[test]
fn continuations_stop_at_the_models_limit() {
    let (mut h, conns) = resuming(Some(0), None);
    let request = submit_streamed(&mut h);
    let (_, events) = h.drain();
    let first = grants(&events).remove(0);
    let conn = node_conn(&conns, &first);
    h.send(conn, event(&first, 1, RunEventType::Start, ""));
    h.send(conn, event(&first, 2, RunEventType::Delta, "Hello "));
    h.edge.handle_connection_closed(h.now, conn).expect("known");
    let (_, events) = h.drain();
    assert!(grants(&events).is_empty());
    assert!(matches!(
        told(&events, request).1,
        Some(Outcome::Failed(RequestError::NodeLost { .. }))
    ));

    let (mut h, conns) = resuming(Some(1), None);
    let request = submit_streamed(&mut h);
    let (_, events) = h.drain();
    let first = grants(&events).remove(0);
    let conn_of = |g: &Grant| node_conn(&conns, g);
    let broken = |h: &mut Harness, g: &Grant, text: &str| {
        h.send(conn_of(g), event(g, 1, RunEventType::Start, ""));
        h.send(conn_of(g), event(g, 2, RunEventType::Delta, text));
        h.send(
            conn_of(g),
            Body::RunEvent(RunEvent {
                run_id: g.run.wire(),
                sequence: 3,
                r#type: RunEventType::Error as i32,
                error: Some(ErrorDetail {
                    code: "upstream_reset".into(),
                    message: "the provider's stream broke".into(),
                    retryable: true,
                }),
                ..Default::default()
            }),
        );
    };
    broken(&mut h, &first, "a ");
    let (_, events) = h.drain();
    assert!(
        events
            .iter()
            .any(|e| matches!(e, EdgeEvent::Resumed { why: "error", .. })),
        "{events:?}"
    );
    let second = grants(&events).remove(0);
    broken(&mut h, &second, "b ");
    let (_, events) = h.drain();
    assert!(grants(&events).is_empty(), "once only");
    let (deltas, end) = told(&events, request);
    assert_eq!(deltas, ["b "]);
    assert!(
        matches!(end, Some(Outcome::Failed(RequestError::Provider(ref d))) if d.code == "upstream_reset"),
        "{end:?}"
    );
}

/// A committed stream that goes silent past its model's stall timeout is cancelled on
/// its node and continued elsewhere; one that keeps sending is left alone however long
/// it runs.
#[test]
fn a_stream_silent_past_its_stall_timeout_is_continued_elsewhere() {
    let (mut h, conns) = resuming(None, Some(Duration::from_secs(2)));
    let request = submit_streamed(&mut h);
    let (_, events) = h.drain();
    let first = grants(&events).remove(0);
    let conn = node_conn(&conns, &first);
    h.send(conn, event(&first, 1, RunEventType::Start, ""));
    // It keeps sending every second for five seconds: never stalled.
    for i in 0..5u64 {
        h.send(conn, event(&first, 2 + i, RunEventType::Delta, "w "));
        let now = h.now.as_millis();
        h.at(now + 1_000);
    }
    let (transmits, events) = h.drain();
    assert!(grants(&events).is_empty() && cancels(&transmits).is_empty());
    // Then silence.
    let now = h.now.as_millis();
    h.at(now + 2_100);
    let (transmits, events) = h.drain();
    assert!(
        events
            .iter()
            .any(|e| matches!(e, EdgeEvent::Resumed { why: "stall", .. })),
        "{events:?}"
    );
    assert_eq!(cancels(&transmits), [first.run.wire()]);
    let again = grants(&events).remove(0);
    assert_ne!(again.node_id, first.node_id);
    assert_eq!(told(&events, request), (Vec::new(), None));
    // The stalled run's late words reach nobody.
    h.send(conn, event(&first, 7, RunEventType::Delta, "late "));
    let (_, events) = h.drain();
    assert_eq!(told(&events, request), (Vec::new(), None));
}
