//! Scenario tests of the contract's edge cases (issue 17): a cancelled run settled by the
//! node's terminal, a bad message failing one run instead of the connection, failed or
//! unanswered config refreshes, and Ollama commands for adapters that are not Ollama.

mod common;

use common::edge::*;
use iop_proto_core::edge::*;
use iop_proto_core::wire::*;
use iop_proto_core::*;

/// A ready n1 with two runs dispatched on adapter "a" (capacity 2).
fn two_runs(h: &mut Harness) -> (ConnId, [(RequestId, String); 2]) {
    let conn = h.connect("n1");
    h.submit("solo", 1).expect("ok");
    h.submit("solo", 1).expect("ok");
    let gs = grants(&h.events());
    let runs = [
        (gs[0].request, h.dispatch(&gs[0])),
        (gs[1].request, h.dispatch(&gs[1])),
    ];
    h.transmits();
    (conn, runs)
}

/// A harness whose Edge pings every `interval` seconds and gives up after `timeout`.
fn with_heartbeats(interval: u64, timeout: u64) -> Harness {
    let mut cfg = config();
    cfg.timing.heartbeat_interval = std::time::Duration::from_secs(interval);
    cfg.timing.heartbeat_timeout = std::time::Duration::from_secs(timeout);
    Harness::with(cfg)
}

/// Node `conn` runs each of `runs` from start to completion.
fn complete(h: &mut Harness, conn: ConnId, runs: [&String; 2]) {
    for run in runs {
        h.run_event(conn, run, RunEventType::Start, 0);
        h.run_event(conn, run, RunEventType::Complete, 1);
    }
}

#[test]
fn the_terminal_of_a_run_cancelled_for_a_violation_returns_its_lease_at_once() {
    let mut h = Harness::new();
    let (conn, [(ra, a), _]) = two_runs(&mut h);
    h.run_event(conn, &a, RunEventType::Delta, 0); // DELTA before START
    let (tx, events) = h.drain();
    assert!(
        matches!(ended(&events).as_slice(), [(r, Outcome::Failed(RequestError::Violation(_)))] if *r == ra)
    );
    assert!(
        frames_to(&tx, conn)
            .iter()
            .any(|b| matches!(b, Body::CancelRequest(c) if c.run_id == a))
    );
    assert_eq!(
        h.usage("n1", "a").in_flight,
        2,
        "held until the node ends the run"
    );
    // The node answers the cancel: the lease comes back now, not at the grace.
    h.run_event(conn, &a, RunEventType::Cancelled, 1);
    assert_eq!(h.usage("n1", "a").in_flight, 1);
    assert!(h.events().is_empty(), "the caller already had its end");
    h.at(60_000);
    assert_eq!(
        h.usage("n1", "a").in_flight,
        0,
        "the other run's grace is unrelated"
    );
}

#[test]
fn an_unknown_event_type_fails_its_run_and_leaves_the_connection_up() {
    let mut h = Harness::new();
    let (conn, [(ra, a), (rb, b)]) = two_runs(&mut h);
    h.run_event(conn, &b, RunEventType::Start, 0);
    h.send(
        conn,
        Body::RunEvent(RunEvent {
            run_id: a.clone(),
            sequence: 0,
            r#type: 99,
            ..Default::default()
        }),
    );
    let (tx, events) = h.drain();
    assert!(closed(&tx).is_empty(), "the connection stays: {tx:?}");
    assert!(
        matches!(ended(&events).as_slice(), [(r, Outcome::Failed(RequestError::Violation(_)))] if *r == ra)
    );
    assert!(
        frames_to(&tx, conn)
            .iter()
            .any(|b| matches!(b, Body::CancelRequest(c) if c.run_id == a))
    );
    // The other run on the connection goes on to its end.
    h.run_event(conn, &b, RunEventType::Complete, 1);
    assert_eq!(ended(&h.events()), vec![(rb, Outcome::Completed)]);
    // A message naming no run of the connection is reported and dropped.
    h.send(
        conn,
        Body::RunEvent(RunEvent {
            run_id: String::new(),
            r#type: RunEventType::Delta as i32,
            ..Default::default()
        }),
    );
    let (tx, events) = h.drain();
    assert!(closed(&tx).is_empty());
    assert!(matches!(
        events.as_slice(),
        [EdgeEvent::PeerViolation { .. }]
    ));
    assert_eq!(h.edge.nodes()[0].state, NodeState::Ready);
}

#[test]
fn an_unknown_tunnel_frame_kind_fails_its_tunnel_only() {
    let mut h = Harness::new();
    let conn = h.connect("n2");
    let request = h.submit("m", 1).expect("ok");
    let g = grants(&h.events()).remove(0);
    assert_eq!(g.shape, DispatchShape::Tunnel);
    let run = h.dispatch(&g);
    h.transmits();
    h.send(
        conn,
        Body::ProviderTunnelFrame(ProviderTunnelFrame {
            run_id: run.clone(),
            sequence: 0,
            kind: 42,
            ..Default::default()
        }),
    );
    let (tx, events) = h.drain();
    assert!(closed(&tx).is_empty());
    assert!(
        matches!(ended(&events).as_slice(), [(r, Outcome::Failed(RequestError::Violation(_)))] if *r == request)
    );
    // Its END settles the lease at once.
    h.send(
        conn,
        Body::ProviderTunnelFrame(ProviderTunnelFrame {
            run_id: run,
            sequence: 1,
            kind: TunnelFrameKind::End as i32,
            end: true,
            ..Default::default()
        }),
    );
    assert_eq!(h.usage("n2", "b").in_flight, 0);
}

fn refresh_request(tx: &[Transmit], conn: ConnId) -> Option<String> {
    frames_to(tx, conn).into_iter().find_map(|b| match b {
        Body::NodeConfigRefreshRequest(r) => Some(r.request_id),
        _ => None,
    })
}

fn bigger(h: &Harness) -> EdgeConfig {
    let mut cfg = h.edge.config().clone();
    cfg.nodes.get_mut("n1").expect("n1").adapters[0].capacity = 4;
    cfg
}

#[test]
fn a_failed_refresh_drains_the_node_and_closes_it_when_its_work_is_done() {
    let mut h = with_heartbeats(100, 300);
    let (conn, [(_, a), (rb, _)]) = two_runs(&mut h);
    let cfg = bigger(&h);
    h.edge.handle_config(h.now, cfg).expect("valid");
    let tx = h.transmits();
    let id = refresh_request(&tx, conn).expect("refresh sent");
    // An unknown status (a newer node) counts as failed.
    h.send(
        conn,
        Body::NodeConfigRefreshResponse(NodeConfigRefreshResponse {
            request_id: id,
            status: 7,
            message: "?".into(),
            revision: 1,
        }),
    );
    let (tx, events) = h.drain();
    assert!(closed(&tx).is_empty(), "work in flight finishes first");
    assert!(
        events
            .iter()
            .any(|e| matches!(e, EdgeEvent::NodeDraining { in_flight: 2, .. })),
        "{events:?}"
    );
    assert!(h.edge.nodes()[0].draining);
    // No new work goes to it meanwhile.
    h.submit("solo", 1).expect("queued");
    assert!(grants(&h.events()).is_empty());
    h.run_event(conn, &a, RunEventType::Start, 0);
    h.run_event(conn, &a, RunEventType::Complete, 1);
    assert!(closed(&h.transmits()).is_empty(), "one run still in flight");
    h.edge.handle_cancel(h.now, rb, "caller left");
    h.send(
        conn,
        Body::RunEvent(RunEvent {
            run_id: grant_id(rb),
            sequence: 0,
            r#type: RunEventType::Cancelled as i32,
            ..Default::default()
        }),
    );
    let (tx, events) = h.drain();
    assert!(
        matches!(closed(&tx).as_slice(), [(c, CloseReason::RefreshFailed(_))] if *c == conn),
        "{tx:?}"
    );
    assert!(events.iter().any(|e| matches!(
        e,
        EdgeEvent::NodeDisconnected {
            reason: CloseReason::RefreshFailed(_),
            ..
        }
    )));
    // It registers again and gets the new configuration in its answer.
    let again = h.open();
    h.register(again, "n1");
    let tx = h.transmits();
    assert!(frames_to(&tx, again).iter().any(|b| matches!(b,
        Body::RegisterResponse(r) if r.config.as_ref().is_some_and(|c| c.adapters[0].capacity == 4))));
}

fn grant_id(r: RequestId) -> String {
    iop_proto_core::edge::run_id_of(r)
}

#[test]
fn an_unanswered_refresh_is_sent_three_times_then_the_node_drains() {
    let mut h = with_heartbeats(100, 300);
    let conn = h.connect("n1");
    let cfg = bigger(&h);
    h.edge.handle_config(h.now, cfg).expect("valid");
    let mut sent = vec![refresh_request(&h.transmits(), conn).expect("first")];
    for t in [2000, 4000] {
        h.at(t);
        let (tx, events) = h.drain();
        assert!(matches!(
            events.as_slice(),
            [EdgeEvent::RefreshTimedOut { retrying: true, .. }]
        ));
        sent.push(refresh_request(&tx, conn).expect("sent again"));
    }
    sent.dedup();
    assert_eq!(sent.len(), 3, "three distinct requests");
    h.at(6000);
    let (tx, events) = h.drain();
    assert!(events.iter().any(|e| matches!(
        e,
        EdgeEvent::RefreshTimedOut {
            retrying: false,
            ..
        }
    )));
    assert!(
        events
            .iter()
            .any(|e| matches!(e, EdgeEvent::NodeDraining { .. }))
    );
    // Nothing in flight: closed at once.
    assert!(matches!(
        closed(&tx).as_slice(),
        [(_, CloseReason::RefreshFailed(_))]
    ));
}

#[test]
fn a_node_stopping_gracefully_gets_no_new_work_and_is_closed_once_its_work_is_done() {
    let mut h = with_heartbeats(100, 300);
    let (conn, [(_, a), (_, b)]) = two_runs(&mut h);
    h.drain_request(conn, "local shutdown");
    let (tx, events) = h.drain();
    assert!(closed(&tx).is_empty(), "work in flight finishes first");
    assert!(
        events.iter().any(|e| matches!(e,
            EdgeEvent::NodeDraining { reason: DrainReason::Stopping(why), in_flight: 2, .. }
                if why == "local shutdown")),
        "{events:?}"
    );
    assert!(h.edge.nodes()[0].draining);
    // No new work goes to it, not even after it applies a refresh that raises its
    // capacity.
    let queued = h.submit("solo", 1).expect("queued");
    assert!(grants(&h.events()).is_empty());
    let cfg = bigger(&h);
    h.edge.handle_config(h.now, cfg).expect("valid");
    let id = refresh_request(&h.transmits(), conn).expect("refresh sent");
    h.send(
        conn,
        Body::NodeConfigRefreshResponse(NodeConfigRefreshResponse {
            request_id: id,
            status: RefreshStatus::Applied as i32,
            message: String::new(),
            revision: 2,
        }),
    );
    assert!(grants(&h.events()).is_empty(), "still draining");
    // Its runs end: the connection is closed as drained.
    complete(&mut h, conn, [&a, &b]);
    let (tx, events) = h.drain();
    assert!(
        matches!(closed(&tx).as_slice(), [(c, CloseReason::Drained)] if *c == conn),
        "{tx:?}"
    );
    assert!(events.iter().any(|e| matches!(
        e,
        EdgeEvent::NodeDisconnected {
            reason: CloseReason::Drained,
            ..
        }
    )));
    // The restarted node takes the request that waited.
    let again = h.open();
    h.register(again, "n1");
    h.ready(again, "n1");
    assert!(
        grants(&h.events()).iter().any(|g| g.request == queued),
        "the waiting request went to the new connection"
    );
}

/// The `RegisterResponse` sent to `conn`.
fn register_response(tx: &[Transmit], conn: ConnId) -> Option<RegisterResponse> {
    frames_to(tx, conn).into_iter().find_map(|b| match b {
        Body::RegisterResponse(r) => Some(r),
        _ => None,
    })
}

#[test]
fn a_restarted_node_waits_for_its_draining_connection_instead_of_cutting_it() {
    let mut h = with_heartbeats(1, 300);
    let (old, [(ra, a), (rb, b)]) = two_runs(&mut h);
    h.drain_request(old, "local shutdown");
    h.drain();
    // The node's restart registers while the old connection, live, still drains.
    let new = h.open();
    h.register(new, "n1");
    let (tx, events) = h.drain();
    let answer = register_response(&tx, new).expect("answered");
    assert!(!answer.accepted && answer.retry_after_ms > 0, "{answer:?}");
    assert!(
        matches!(closed(&tx).as_slice(), [(c, CloseReason::RegisterRejected(RejectReason::Draining))] if *c == new)
    );
    assert!(events.iter().any(|e| matches!(
        e,
        EdgeEvent::RegisterRejected {
            reason: RejectReason::Draining,
            ..
        }
    )));
    assert_eq!(
        h.edge.owner_of(old).map(|o| o.0),
        Some("n1".into()),
        "the old one still owns it"
    );
    // Its runs finish normally; then it is closed and the restart takes over.
    complete(&mut h, old, [&a, &b]);
    let (tx, events) = h.drain();
    assert!(matches!(closed(&tx).as_slice(), [(c, CloseReason::Drained)] if *c == old));
    let completed = ended(&events)
        .iter()
        .filter(|(r, o)| (*r == ra || *r == rb) && *o == Outcome::Completed)
        .count();
    assert_eq!(completed, 2, "{events:?}");
    let again = h.open();
    h.register(again, "n1");
    let tx = h.transmits();
    assert!(register_response(&tx, again).is_some_and(|r| r.accepted));

    // An owner that drains but has gone silent (a frozen process) does not hold its id.
    let old = again;
    h.ready(old, "n1");
    h.drain();
    h.drain_request(old, "");
    h.drain();
    let now = h.now.as_millis();
    h.at(now + 2_500);
    h.drain();
    let newer = h.open();
    h.register(newer, "n1");
    let tx = h.transmits();
    assert!(
        register_response(&tx, newer).is_some_and(|r| r.accepted),
        "a silent draining owner is superseded"
    );
}

#[test]
fn a_drain_request_before_ready_breaks_the_connection() {
    let mut h = Harness::new();
    let conn = h.open();
    h.register(conn, "n1");
    h.transmits();
    h.drain_request(conn, "");
    assert!(matches!(
        closed(&h.transmits()).as_slice(),
        [(c, CloseReason::ProtocolViolation(ConnViolation::DrainBeforeReady))] if *c == conn
    ));
    // An over-long reason is not a valid message.
    let conn = h.connect("n1");
    h.drain_request(conn, "x".repeat(MAX_DRAIN_REASON_BYTES + 1));
    assert!(matches!(
        closed(&h.transmits()).as_slice(),
        [(c, CloseReason::ProtocolViolation(ConnViolation::Invalid(_)))] if *c == conn
    ));
    assert!(!h.edge.nodes()[0].draining);
}

#[test]
fn ollama_commands_go_only_to_ollama_adapters() {
    let mut h = Harness::new();
    h.connect("n1");
    let command = |adapter: &str| NodeCommandRequest {
        r#type: NodeCommandType::OllamaApi as i32,
        adapter: adapter.into(),
        method: "GET".into(),
        path: "/api/tags".into(),
        ..Default::default()
    };
    assert_eq!(
        h.edge.handle_command(h.now, "n1", command("a")),
        Err(CommandError::NotOllama {
            node: "n1".into(),
            adapter: "a".into()
        }),
        "adapter a is a mock"
    );
    assert!(matches!(
        h.edge.handle_command(h.now, "n1", command("nope")),
        Err(CommandError::NotOllama { .. })
    ));
    assert!(h.transmits().is_empty(), "nothing reached the node");
}
