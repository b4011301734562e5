//! Handing over to a successor Edge process: the old machine re-homes its nodes and
//! dispatches nothing more; the new one counts what the nodes' old sessions still hold;
//! the node session reports it.

mod common;

use common::edge::*;
use iop_proto_core::edge::*;
use iop_proto_core::wire::*;

fn register_rehoming(h: &mut Harness, conn: ConnId, node_id: &str) {
    h.send(
        conn,
        Body::RegisterRequest(RegisterRequest {
            node_id: node_id.into(),
            token: TOKEN.into(),
            instance_id: 7,
            rehome: true,
            ..Default::default()
        }),
    );
}

/// A node `node_id` that can re-home, registered and ready on a new connection.
fn rehoming_node(h: &mut Harness, node_id: &str) -> ConnId {
    let conn = h.open();
    register_rehoming(h, conn, node_id);
    h.ready(conn, node_id);
    conn
}

fn ready_holding(h: &mut Harness, conn: ConnId, node_id: &str, held: Vec<AdapterLoad>) {
    h.send(
        conn,
        Body::NodeReadyRequest(NodeReadyRequest {
            node_id: node_id.into(),
            held_elsewhere: held,
        }),
    );
}

fn load(adapter: &str, in_flight: u32, long_in_flight: u32) -> AdapterLoad {
    AdapterLoad {
        adapter: adapter.into(),
        in_flight,
        long_in_flight,
    }
}

#[test]
fn rehome_tells_capable_nodes_drains_all_and_dispatches_nothing_more() {
    let mut h = Harness::new();
    let n1 = rehoming_node(&mut h, "n1");
    let (tx, _) = h.drain();
    let Body::RegisterResponse(resp) = &frames_to(&tx, n1)[0] else {
        panic!("{tx:?}");
    };
    assert!(resp.load_reports, "the edge says it takes load reports");
    let n2 = h.connect("n2"); // an older node: no re-home

    // One request runs on n1; one waits (n1's "a" has 2 units, "solo" only lists it).
    let running = h.submit("solo", 10).expect("accepted");
    let second = h.submit("solo", 10).expect("accepted");
    let third = h.submit("solo", 10).expect("queued");
    let dispatched = grants(&h.events());
    assert_eq!(dispatched.len(), 2);
    h.edge.handle_rehome(h.now);
    let (tx, events) = h.drain();
    // The two runs went out first; the re-home is the last frame on n1's connection.
    assert!(
        matches!(
            frames_to(&tx, n1).as_slice(),
            [
                Body::RunRequest(_),
                Body::RunRequest(_),
                Body::NodeRehomeRequest(_)
            ]
        ),
        "n1 is told to re-home after its runs: {tx:?}"
    );
    assert!(
        frames_to(&tx, n2).is_empty(),
        "n2 cannot re-home: it is not told"
    );
    // n2 had nothing in flight: closed at once; n1 keeps its connection for its runs.
    assert_eq!(closed(&tx), vec![(n2, CloseReason::Drained)]);
    // The waiter ends, retryable; the running ones go on.
    assert_eq!(
        ended(&events),
        vec![(third, Outcome::Failed(RequestError::HandingOver))]
    );
    let _ = (running, second);
    // Nothing is dispatched any more, and registers are held off.
    assert_eq!(h.submit("m", 10), Err(SubmitError::HandingOver));
    let late = h.open();
    register_rehoming(&mut h, late, "n2");
    let (tx, _) = h.drain();
    match frames_to(&tx, late).as_slice() {
        [Body::RegisterResponse(r)] => assert!(!r.accepted && r.retry_after_ms > 0, "{r:?}"),
        other => panic!("{other:?}"),
    }
    // When the last run ends, n1's connection closes.
    for (i, g) in dispatched.iter().enumerate() {
        let run = h.dispatch(g);
        h.run_event(n1, &run, RunEventType::Start, 0);
        h.run_event(n1, &run, RunEventType::Complete, 1);
        let (tx, _) = h.drain();
        let closes = closed(&tx);
        if i + 1 < dispatched.len() {
            assert!(closes.is_empty(), "{closes:?}");
        } else {
            assert_eq!(closes, vec![(n1, CloseReason::Drained)]);
        }
    }
}

/// A node refuses a run (it was full: another Edge took the slot) just as this Edge
/// hands over. No node here takes new work any more, and nothing reached a provider: the
/// request ends as a waiting one does at the hand-over (retryable, at the successor),
/// not with the node's refusal as a 502.
#[test]
fn a_run_refused_during_the_hand_over_ends_retryable_like_a_waiting_request() {
    let mut h = Harness::new();
    let n1 = rehoming_node(&mut h, "n1");
    let _ = h.drain();
    let request = h.submit("solo", 10).expect("accepted");
    let grant = grants(&h.events())
        .into_iter()
        .find(|g| g.request == request)
        .expect("dispatched");
    let run = h.dispatch(&grant);
    h.edge.handle_rehome(h.now);
    let _ = h.drain();
    h.refuse(n1, &run);
    let (tx, events) = h.drain();
    assert_eq!(
        ended(&events),
        vec![(request, Outcome::Failed(RequestError::HandingOver))],
        "{events:?}"
    );
    // Its lease came back: the drained node's connection closes.
    assert_eq!(closed(&tx), vec![(n1, CloseReason::Drained)]);
}

#[test]
fn capacity_held_by_a_nodes_old_session_is_not_dispatched_until_reported_free() {
    let mut h = Harness::new();
    let conn = h.open();
    register_rehoming(&mut h, conn, "n1");
    // The node's session to the previous edge still runs 2 requests on "a" (capacity 2).
    ready_holding(&mut h, conn, "n1", vec![load("a", 2, 1)]);
    h.drain();
    let usage = h.usage("n1", "a");
    assert_eq!((usage.held_elsewhere, usage.long_held_elsewhere), (2, 1));
    let waiting = h.submit("solo", 10).expect("queued");
    assert!(grants(&h.events()).is_empty(), "no unit is free");
    // One ends there: the waiter is served here.
    h.send(
        conn,
        Body::NodeLoadReport(NodeLoadReport {
            held_elsewhere: vec![load("a", 1, 1)],
        }),
    );
    let served = grants(&h.events());
    assert_eq!(served.len(), 1);
    assert_eq!(served[0].request, waiting);
    // Still one unit held elsewhere and one here: a long request waits (long capacity 1).
    assert_eq!(h.usage("n1", "a").in_flight, 1);
    let _long = h.submit("solo", 5000).expect("queued");
    assert!(grants(&h.events()).is_empty());
    // The old session is over: everything held elsewhere is free.
    h.send(
        conn,
        Body::NodeLoadReport(NodeLoadReport {
            held_elsewhere: vec![],
        }),
    );
    assert_eq!(grants(&h.events()).len(), 1);
    let usage = h.usage("n1", "a");
    assert_eq!((usage.in_flight, usage.held_elsewhere), (2, 0));
}

#[test]
fn a_load_report_before_ready_is_a_violation() {
    let mut h = Harness::new();
    let conn = h.open();
    register_rehoming(&mut h, conn, "n1");
    h.drain();
    h.send(
        conn,
        Body::NodeLoadReport(NodeLoadReport {
            held_elsewhere: vec![],
        }),
    );
    let (tx, _) = h.drain();
    assert!(
        matches!(
            closed(&tx).as_slice(),
            [(c, CloseReason::ProtocolViolation(ConnViolation::LoadBeforeReady))] if *c == conn
        ),
        "{tx:?}"
    );
}

#[test]
fn a_load_report_that_breaks_the_contract_is_refused() {
    for held in [
        vec![load("a", 1, 2)],
        vec![load("a", 1, 0), load("a", 1, 0)],
        vec![load("", 1, 0)],
    ] {
        let report = NodeLoadReport {
            held_elsewhere: held.clone(),
        };
        assert!(
            Body::NodeLoadReport(report).validate().is_err(),
            "{held:?} must be refused"
        );
    }
}

mod node_side {
    use iop_proto_core::session::*;
    use iop_proto_core::wire::*;
    use iop_proto_core::*;

    fn payload() -> NodeConfigPayload {
        NodeConfigPayload {
            revision: 1,
            adapters: vec![AdapterConfig {
                name: "a".into(),
                r#type: AdapterType::Mock as i32,
                capacity: 2,
                long_capacity: 1,
                targets: vec!["t".into()],
                enabled: true,
                ..Default::default()
            }],
            runtime: None,
        }
    }

    fn frames(s: &mut NodeSession) -> Vec<Body> {
        let mut out = Vec::new();
        while let Some(t) = s.poll_transmit() {
            if let NodeTransmit::Frame(e) = t {
                out.extend(e.body);
            }
        }
        out
    }

    /// The Edge answers the ready: the session takes work.
    fn readied(s: &mut NodeSession) {
        s.handle_envelope(
            Timestamp::ZERO,
            Envelope::new(Body::NodeReadyResponse(NodeReadyResponse {
                ready: true,
                reason: String::new(),
            })),
        )
        .unwrap();
        while s.poll_event().is_some() {}
    }

    fn session(load_reports: bool) -> NodeSession {
        let mut config = SessionConfig::new("n1", "tok");
        config.rehome = true;
        let mut s = NodeSession::new(config);
        let t = Timestamp::ZERO;
        s.handle_connected(t).unwrap();
        s.handle_held_elsewhere(
            t,
            vec![AdapterLoad {
                adapter: "a".into(),
                in_flight: 1,
                long_in_flight: 0,
            }],
        )
        .unwrap();
        let register = frames(&mut s);
        assert!(
            matches!(&register[..], [Body::RegisterRequest(r)] if r.rehome),
            "{register:?}"
        );
        s.handle_envelope(
            t,
            Envelope::new(Body::RegisterResponse(RegisterResponse {
                accepted: true,
                node_id: "n1".into(),
                config: Some(payload()),
                heartbeat_interval_ms: 1000,
                load_reports,
                ..Default::default()
            })),
        )
        .unwrap();
        while s.poll_event().is_some() {}
        s.handle_config_applied(t, Ok(())).unwrap();
        s
    }

    #[test]
    fn what_an_old_session_holds_goes_in_the_ready_and_in_reports_and_fills_the_gate() {
        let mut s = session(true);
        let t = Timestamp::ZERO;
        match frames(&mut s).as_slice() {
            [Body::NodeReadyRequest(r)] => {
                assert_eq!(r.held_elsewhere.len(), 1);
                assert_eq!(r.held_elsewhere[0].in_flight, 1);
            }
            other => panic!("{other:?}"),
        }
        readied(&mut s);
        // One unit is held elsewhere: the gate takes one run, then refuses.
        for (i, id) in ["r1", "r2"].into_iter().enumerate() {
            s.handle_envelope(
                t,
                Envelope::new(Body::RunRequest(RunRequest {
                    run_id: id.into(),
                    adapter: "a".into(),
                    target: "t".into(),
                    input: b"{}".to_vec().into(),
                    ..Default::default()
                })),
            )
            .unwrap();
            let refused = frames(&mut s)
                .iter()
                .any(|b| matches!(b, Body::RunEvent(e) if e.r#type == RunEventType::Error as i32));
            assert_eq!(refused, i == 1, "run {id}");
            while s.poll_event().is_some() {}
        }
        // The old session's work ends: reported once, and an unchanged picture sends
        // nothing.
        s.handle_held_elsewhere(t, vec![]).unwrap();
        assert!(matches!(
            frames(&mut s).as_slice(),
            [Body::NodeLoadReport(r)] if r.held_elsewhere.is_empty()
        ));
        s.handle_held_elsewhere(t, vec![]).unwrap();
        assert!(frames(&mut s).is_empty());
    }

    #[test]
    fn loads_of_several_old_sessions_sum_by_adapter() {
        let load = |adapter: &str, n, long| AdapterLoad {
            adapter: adapter.into(),
            in_flight: n,
            long_in_flight: long,
        };
        let a = [load("b", 2, 1), load("a", 1, 0)];
        let b = [load("a", 3, 1), load("c", 0, 0)];
        assert_eq!(
            sum_loads(a.iter().chain(&b)),
            vec![load("a", 4, 1), load("b", 2, 1)]
        );
    }

    #[test]
    fn an_edge_that_takes_no_reports_gets_none() {
        let mut s = session(false);
        let t = Timestamp::ZERO;
        let _ready = frames(&mut s);
        s.handle_held_elsewhere(t, vec![]).unwrap();
        assert!(frames(&mut s).is_empty());
    }

    #[test]
    fn a_rehome_request_is_announced_once_and_the_session_takes_no_new_work() {
        let mut s = session(true);
        let t = Timestamp::ZERO;
        let _ = frames(&mut s);
        readied(&mut s);
        for _ in 0..2 {
            s.handle_envelope(
                t,
                Envelope::new(Body::NodeRehomeRequest(NodeRehomeRequest {
                    reason: "upgrade".into(),
                })),
            )
            .unwrap();
        }
        let mut rehomes = 0;
        while let Some(e) = s.poll_event() {
            rehomes += usize::from(matches!(e, SessionEvent::Rehome { .. }));
        }
        assert_eq!(rehomes, 1);
        assert!(s.is_rehomed());
        assert_eq!(
            s.state(),
            SessionState::Ready,
            "it goes on serving its work"
        );
    }
}
