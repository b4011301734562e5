//! Scenario tests of the Edge machine: one test per contract rule.
//!
//! One file on purpose, past the 800-line norm: each file under `tests/` is a test binary
//! of its own, linked against the whole dependency graph, and on a 2-core CI machine every
//! extra binary costs a link; this suite covers one subject and shares its helpers.

mod common;

use common::edge::*;
use iop_proto_core::edge::run_id_of;
use iop_proto_core::edge::*;
use iop_proto_core::wire::*;
use iop_proto_core::*;

/// Heartbeats far apart, so a silent test node is not fenced during the test.
fn quiet_config() -> EdgeConfig {
    let mut cfg = config();
    cfg.timing.heartbeat_interval = std::time::Duration::from_secs(100);
    cfg.timing.heartbeat_timeout = std::time::Duration::from_secs(300);
    cfg
}

fn snapshot(h: &Harness, provider: &str) -> ProviderSnapshot {
    h.edge
        .snapshots()
        .into_iter()
        .find(|s| s.provider_id == provider)
        .expect("listed")
}

fn assert_offline_zeros(s: &ProviderSnapshot) {
    assert_eq!(s.status, ProviderStatus::Unavailable as i32);
    assert_eq!(s.health, ProviderHealth::Offline as i32);
    assert_eq!(
        (
            s.capacity,
            s.long_capacity,
            s.in_flight,
            s.long_in_flight,
            s.queued,
            s.long_queued
        ),
        (0, 0, 0, 0, 0, 0)
    );
}

#[test]
fn accepted_register_is_pending_only() {
    let mut h = Harness::new();
    let conn = h.open();
    h.register(conn, "n1");
    let (tx, events) = h.drain();
    let Body::RegisterResponse(resp) = &frames_to(&tx, conn)[0] else {
        panic!("expected RegisterResponse, got {tx:?}");
    };
    assert!(resp.accepted);
    let config = resp.config.as_ref().expect("config");
    assert_eq!(config.adapters[0].name, "a");
    assert_eq!(resp.heartbeat_interval_ms, 1000);
    // Registered, and nothing more before ready.
    assert!(
        matches!(&events[..], [EdgeEvent::NodeRegistered { node_id, .. }] if &**node_id == "n1"),
        "only node-registered before ready: {events:?}"
    );
    assert_offline_zeros(&snapshot(&h, "a"));
    // Nothing is dispatched to a pending node: the request waits.
    let req = h.submit("solo", 10).expect("accepted");
    assert!(grants(&h.events()).is_empty());
    assert_eq!(h.edge.queue().ids(), vec![req]);
    assert_eq!(h.edge.nodes()[0].state, NodeState::Pending);
}

#[test]
fn ready_from_pending_owner_activates_pumps_and_connects_once() {
    let mut h = Harness::new();
    let conn = h.open();
    h.register(conn, "n1");
    h.drain();
    let waiting = h.submit("solo", 10).expect("queued");
    h.ready(conn, "n1");
    let (tx, events) = h.drain();
    // The ready answer first, then the pumped waiter's dispatch in the same transition.
    assert!(
        matches!(
            frames_to(&tx, conn).as_slice(),
            [Body::NodeReadyResponse(r), Body::RunRequest(run)] if r.ready && run.run_id == run_id_of(waiting)
        ),
        "{tx:?}"
    );
    let connected = events
        .iter()
        .filter(|e| matches!(e, EdgeEvent::NodeConnected { .. }))
        .count();
    assert_eq!(connected, 1);
    assert_eq!(
        grants(&events)[0].request,
        waiting,
        "waiter pumped on ready"
    );
    let snap = snapshot(&h, "a");
    assert_eq!(snap.status, ProviderStatus::Available as i32);
    assert_eq!((snap.capacity, snap.in_flight), (2, 1));

    // A duplicate ready from the same ready owner: ready=true, no side effect.
    h.ready(conn, "n1");
    let (tx, events) = h.drain();
    assert_eq!(only_ready_answer(&tx, conn), Some(true));
    assert!(events.is_empty(), "{events:?}");
    assert_eq!(snapshot(&h, "a").in_flight, 1);
}

#[test]
fn ready_from_anyone_else_is_refused_and_closed() {
    let mut h = Harness::new();
    // Before any register.
    let early = h.open();
    h.ready(early, "n1");
    let (tx, events) = h.drain();
    assert_eq!(only_ready_answer(&tx, early), Some(false));
    assert_eq!(closed(&tx), vec![(early, CloseReason::ReadyRefused)]);
    assert!(events.is_empty());

    // From a superseded connection.
    let old = h.open();
    h.register(old, "n1");
    let new = h.open();
    h.register(new, "n1");
    h.drain();
    h.ready(old, "n1");
    let (tx, events) = h.drain();
    assert_eq!(only_ready_answer(&tx, old), Some(false));
    assert!(events.is_empty(), "stale ready emits nothing: {events:?}");
    assert_eq!(h.edge.nodes()[0].state, NodeState::Pending);
    h.ready(new, "n1");
    assert_eq!(h.edge.nodes()[0].state, NodeState::Ready);
}

#[test]
fn newer_register_fences_the_older_generation_in_the_same_transition() {
    let mut h = Harness::new();
    let old = h.connect("n1");
    let r1 = h.submit("solo", 10).expect("granted");
    let grant = grants(&h.events()).remove(0);
    h.dispatch(&grant);
    assert_eq!(h.usage("n1", "a").in_flight, 1);

    let new = h.open();
    h.register(new, "n1");
    let (tx, events) = h.drain();
    assert_eq!(closed(&tx), vec![(old, CloseReason::Superseded)]);
    assert_eq!(h.usage("n1", "a").in_flight, 0, "leases returned at once");
    assert_eq!(h.usage("n1", "a").generation, None);
    assert_eq!(
        ended(&events),
        vec![(
            r1,
            Outcome::Failed(RequestError::NodeLost {
                node_id: "n1".into()
            })
        )]
    );
    assert!(events.iter().any(|e| matches!(
        e,
        EdgeEvent::NodeDisconnected { reason: CloseReason::Superseded, lost, .. } if lost == &vec![r1]
    )));
    // The old connection's close and late events change nothing.
    h.run_event(old, &grant_run_id(r1), RunEventType::Start, 0);
    h.edge.handle_connection_closed(h.now, old).expect("open");
    let (tx, events) = h.drain();
    assert!(tx.is_empty() && events.is_empty(), "{tx:?} {events:?}");
    assert_eq!(h.edge.owner_of(new).map(|o| o.2), Some(false));
}

fn grant_run_id(r: RequestId) -> String {
    iop_proto_core::edge::run_id_of(r)
}

#[test]
fn only_the_current_owner_close_fences() {
    let mut h = Harness::new();
    let rejected = h.open();
    h.register_with(rejected, "n1", "wrong");
    let conn = h.connect("n1");
    h.edge
        .handle_connection_closed(h.now, rejected)
        .expect("open");
    assert!(h.events().is_empty());
    assert_eq!(h.edge.nodes()[0].state, NodeState::Ready);
    h.edge.handle_connection_closed(h.now, conn).expect("open");
    let events = h.events();
    assert!(matches!(
        events.as_slice(),
        [EdgeEvent::NodeDisconnected {
            reason: CloseReason::PeerClosed,
            ..
        }]
    ));
    assert_offline_zeros(&snapshot(&h, "a"));
}

#[test]
fn bad_token_and_unknown_node_are_rejected_and_closed() {
    let mut h = Harness::new();
    for (node, token, why) in [
        ("n1", "wrong", RejectReason::BadToken),
        ("nx", TOKEN, RejectReason::UnknownNode),
    ] {
        let conn = h.open();
        h.register_with(conn, node, token);
        let (tx, events) = h.drain();
        let Body::RegisterResponse(resp) = &frames_to(&tx, conn)[0] else {
            panic!("expected a response");
        };
        assert!(!resp.accepted);
        // One reason on the wire whatever failed: node ids cannot be enumerated.
        assert_eq!(resp.reason, AUTH_FAILED);
        assert_eq!(resp.retry_after_ms, 0, "wrong credentials are final");
        assert!(resp.config.is_none(), "no config for a rejected node");
        assert!(matches!(closed(&tx)[0].1, CloseReason::RegisterRejected(_)));
        assert!(
            matches!(events.as_slice(), [EdgeEvent::RegisterRejected { reason, log: true, .. }] if *reason == why),
            "{events:?}"
        );
    }
    assert_eq!(h.edge.nodes()[0].state, NodeState::Offline);
}

#[test]
fn heartbeat_timeout_fences_the_owner_and_pings_are_sent() {
    let mut h = Harness::new();
    let conn = h.connect("n1");
    h.at(1000);
    let tx = h.transmits();
    assert!(matches!(
        frames_to(&tx, conn).as_slice(),
        [Body::Heartbeat(_)]
    ));
    // The node answers at 1500, then goes silent.
    h.now = iop_proto_core::Timestamp::from_millis(1500);
    h.send(
        conn,
        Body::HeartbeatAck(HeartbeatAck {
            nonce: 1,
            echo_sent_at_ms: 1000,
        }),
    );
    h.at(4400);
    assert_eq!(
        h.edge.nodes()[0].state,
        NodeState::Ready,
        "within the timeout"
    );
    h.at(4500);
    let (tx, events) = h.drain();
    assert!(closed(&tx).contains(&(conn, CloseReason::HeartbeatTimeout)));
    assert!(matches!(
        events.as_slice(),
        [EdgeEvent::NodeDisconnected { .. }]
    ));
    assert_eq!(h.edge.nodes()[0].state, NodeState::Offline);
}

#[test]
fn edge_answers_node_heartbeats() {
    let mut h = Harness::new();
    let conn = h.connect("n1");
    h.send(
        conn,
        Body::Heartbeat(Heartbeat {
            nonce: 77,
            sent_at_ms: 5,
        }),
    );
    let tx = h.transmits();
    assert_eq!(
        frames_to(&tx, conn),
        vec![Body::HeartbeatAck(HeartbeatAck {
            nonce: 77,
            echo_sent_at_ms: 5
        })]
    );
}

#[test]
fn handshake_must_complete_within_the_register_timeout() {
    let mut h = Harness::new();
    let silent = h.open();
    h.at(1000);
    let pending = h.open();
    h.register(pending, "n1");
    h.drain();
    h.at(2000);
    assert_eq!(
        closed(&h.transmits()),
        vec![(silent, CloseReason::HandshakeTimeout)]
    );
    h.at(2999);
    assert!(
        closed(&h.transmits()).is_empty(),
        "register re-armed the deadline"
    );
    h.at(3000);
    let (tx, events) = h.drain();
    assert_eq!(closed(&tx), vec![(pending, CloseReason::HandshakeTimeout)]);
    assert!(events.is_empty(), "a pending node was never connected");
    assert_eq!(h.edge.nodes()[0].state, NodeState::Offline);
}

#[test]
fn acquire_picks_most_free_capacity_with_round_robin_ties() {
    let mut cfg = config();
    cfg.nodes.insert(
        "n2".into(),
        node(vec![adapter("b", AdapterType::Mock, 2, 0)]),
    );
    let mut h = Harness::with(cfg);
    h.connect("n1");
    h.connect("n2");
    let mut chosen = Vec::new();
    for _ in 0..4 {
        h.submit("m", 1).expect("granted");
        chosen.push(grants(&h.events())[0].node_id.to_string());
    }
    // Equal free capacity alternates; then most free wins.
    assert_eq!(chosen, vec!["n1", "n2", "n1", "n2"]);
    let r = h.submit("m", 1).expect("queued");
    assert!(grants(&h.events()).is_empty());
    assert_eq!(h.edge.queue().ids(), vec![r]);
}

#[test]
fn most_free_capacity_beats_rotation() {
    let mut cfg = config();
    cfg.nodes.insert(
        "n2".into(),
        node(vec![adapter("b", AdapterType::Mock, 5, 0)]),
    );
    let mut h = Harness::with(cfg);
    h.connect("n1");
    h.connect("n2");
    for _ in 0..3 {
        h.submit("m", 1).expect("granted");
        assert_eq!(&*grants(&h.events())[0].node_id, "n2");
    }
}

#[test]
fn waiters_are_served_fifo_as_capacity_frees() {
    let mut h = Harness::new();
    let conn = h.connect("n1");
    let a = h.submit("solo", 1).expect("ok");
    let b = h.submit("solo", 1).expect("ok");
    let granted = grants(&h.events());
    let w1 = h.submit("solo", 1).expect("queued");
    let w2 = h.submit("solo", 1).expect("queued");
    assert_eq!(h.edge.queue().ids(), vec![w1, w2]);
    let run_a = h.dispatch(&granted[0]);
    h.dispatch(&granted[1]);
    h.run_event(conn, &run_a, RunEventType::Start, 0);
    h.run_event(conn, &run_a, RunEventType::Complete, 1);
    let events = h.events();
    assert!(ended(&events).contains(&(a, Outcome::Completed)));
    assert_eq!(grants(&events)[0].request, w1, "oldest waiter first");
    assert_eq!(h.edge.queue().ids(), vec![w2]);
    let _ = b;
}

#[test]
fn waiters_expire_with_a_typed_outcome() {
    let mut h = Harness::with(quiet_config());
    h.connect("n1");
    h.submit("solo", 1).expect("ok");
    h.submit("solo", 1).expect("ok");
    h.events();
    let w = h.submit("solo", 1).expect("queued");
    assert_eq!(
        h.edge.queue().next_deadline(),
        Some(Timestamp::from_millis(10_000))
    );
    h.at(9999);
    assert!(ended(&h.events()).is_empty());
    h.at(10_000);
    assert_eq!(ended(&h.events()), vec![(w, Outcome::Expired)]);
    assert!(h.edge.queue().is_empty());
}

#[test]
fn unknown_model_no_candidates_and_full_queue_fail_at_once() {
    let mut cfg = config();
    cfg.models.insert("empty".into(), ModelSpec::default());
    let mut h = Harness::with(cfg);
    assert_eq!(
        h.submit("nope", 1),
        Err(SubmitError::UnknownModel("nope".into()))
    );
    assert_eq!(
        h.submit("empty", 1),
        Err(SubmitError::NoCandidates("empty".into()))
    );
    // Node n2/b has no long capacity; "solo" is n1 only with long 1: long fits in config.
    for _ in 0..3 {
        h.submit("solo", 1).expect("queued while offline");
    }
    assert_eq!(
        h.submit("solo", 1),
        Err(SubmitError::QueueFull {
            model: "solo".into(),
            max_waiting: 3
        })
    );
}

#[test]
fn long_requests_count_in_both_capacities() {
    let mut h = Harness::new();
    h.connect("n1");
    h.submit("solo", 5000).expect("long granted");
    let g = grants(&h.events()).remove(0);
    assert!(h.lease(&g).long);
    let u = h.usage("n1", "a");
    assert_eq!((u.in_flight, u.long_in_flight), (1, 1));
    let long2 = h.submit("solo", 5000).expect("queued: long capacity is 1");
    assert!(grants(&h.events()).is_empty());
    let short = h.submit("solo", 1).expect("short still fits");
    assert_eq!(grants(&h.events())[0].request, short);
    assert_eq!(h.edge.queue().ids(), vec![long2]);
    let s = h
        .edge
        .snapshots()
        .into_iter()
        .find(|s| s.provider_id == "a")
        .expect("a");
    assert_eq!((s.queued, s.long_queued), (1, 1));
}

#[test]
fn dispatch_shape_follows_the_adapter_type() {
    let mut h = Harness::new();
    h.connect("n2");
    h.submit("m", 1).expect("granted");
    let g = grants(&h.events()).remove(0);
    assert_eq!((&*g.node_id, g.shape), ("n2", DispatchShape::Tunnel));
    let run_id = h.dispatch(&g);
    let tx = h.transmits();
    let Some((_, envelope)) = tx.first().and_then(Transmit::frame) else {
        panic!("dispatch transmits");
    };
    let Some(Body::ProviderTunnelRequest(req)) = &envelope.body else {
        panic!("tunnel expected");
    };
    assert_eq!(
        (
            req.run_id.as_str(),
            req.adapter.as_str(),
            req.target.as_str()
        ),
        (run_id.as_str(), "b", "t")
    );

    h.connect("n1");
    h.submit("solo", 1).expect("granted");
    assert_eq!(grants(&h.events())[0].shape, DispatchShape::Run);
}

#[test]
fn run_violation_fails_that_run_only() {
    let mut h = Harness::new();
    let conn = h.connect("n1");
    h.submit("solo", 1).expect("ok");
    h.submit("solo", 1).expect("ok");
    let gs = grants(&h.events());
    let (ra, rb) = (h.dispatch(&gs[0]), h.dispatch(&gs[1]));
    h.transmits();
    h.run_event(conn, &ra, RunEventType::Delta, 0); // no START
    h.run_event(conn, &rb, RunEventType::Start, 0);
    h.run_event(conn, &rb, RunEventType::Complete, 1);
    let (tx, events) = h.drain();
    let outcomes = ended(&events);
    assert!(
        matches!(outcomes[0], (r, Outcome::Failed(RequestError::Violation(_))) if r == gs[0].request)
    );
    assert_eq!(outcomes[1], (gs[1].request, Outcome::Completed));
    assert!(
        frames_to(&tx, conn)
            .iter()
            .any(|b| matches!(b, Body::CancelRequest(c) if c.run_id == ra))
    );
    assert!(closed(&tx).is_empty(), "the connection stays up");
}

#[test]
fn cancel_sends_cancel_run_and_releases_the_lease_exactly_once() {
    let mut h = Harness::new();
    let conn = h.connect("n1");
    let r = h.submit("solo", 1).expect("ok");
    let g = grants(&h.events()).remove(0);
    let run = h.dispatch(&g);
    h.transmits();
    assert_eq!(
        h.edge.handle_cancel(h.now, r, "caller left"),
        Cancelled::Now
    );
    let (tx, events) = h.drain();
    assert_eq!(ended(&events), vec![(r, Outcome::Cancelled)]);
    assert!(matches!(
        frames_to(&tx, conn).as_slice(),
        [Body::CancelRequest(CancelRequest { kind, .. })] if *kind == CancelKind::CancelRun as i32
    ));
    assert_eq!(
        h.usage("n1", "a").in_flight,
        1,
        "held until the node confirms"
    );
    assert_eq!(
        h.edge.handle_cancel(h.now, r, "again"),
        Cancelled::AlreadyEnded
    );
    h.run_event(conn, &run, RunEventType::Start, 0);
    h.run_event(conn, &run, RunEventType::Cancelled, 1);
    assert!(h.events().is_empty(), "the caller already got its end");
    assert_eq!(h.usage("n1", "a").in_flight, 0);
    h.at(10_000); // the grace timer finds nothing left to release
    assert_eq!(h.usage("n1", "a").in_flight, 0);
}

#[test]
fn cancel_grace_releases_when_the_node_never_confirms() {
    let mut h = Harness::with(quiet_config());
    h.connect("n1");
    let r = h.submit("solo", 1).expect("ok");
    let g = grants(&h.events()).remove(0);
    h.dispatch(&g);
    h.edge.handle_cancel(h.now, r, "caller left");
    h.at(4999);
    assert_eq!(h.usage("n1", "a").in_flight, 1);
    h.at(5000);
    assert_eq!(h.usage("n1", "a").in_flight, 0);
}

#[test]
fn cancelling_a_waiter_leaves_the_queue() {
    let mut h = Harness::new();
    let r = h.submit("solo", 1).expect("queued");
    assert_eq!(h.edge.handle_cancel(h.now, r, "gone"), Cancelled::Now);
    assert!(h.edge.queue().is_empty());
    assert_eq!(ended(&h.events()), vec![(r, Outcome::Cancelled)]);
}

#[test]
fn stream_frames_from_a_pending_owner_are_a_violation() {
    let mut h = Harness::new();
    let conn = h.open();
    h.register(conn, "n1");
    h.drain();
    h.run_event(conn, "run-1", RunEventType::Start, 0);
    let (tx, events) = h.drain();
    assert!(matches!(
        closed(&tx)[0].1,
        CloseReason::ProtocolViolation(_)
    ));
    assert!(matches!(events[0], EdgeEvent::PeerViolation { .. }));
    assert_eq!(h.edge.nodes()[0].state, NodeState::Offline);
}

#[test]
fn config_refresh_goes_to_ready_nodes_and_applies_on_answer() {
    let mut h = Harness::new();
    let conn = h.connect("n1");
    let pending = h.open();
    h.register(pending, "n2");
    h.drain();
    let mut cfg = config();
    cfg.nodes.get_mut("n1").expect("n1").adapters[0].capacity = 4;
    cfg.nodes.get_mut("n2").expect("n2").adapters[0].capacity = 3;
    let diff = h.edge.handle_config(h.now, cfg).expect("valid");
    assert_eq!(
        diff.changed_payloads,
        vec!["n1".to_string(), "n2".to_string()]
    );
    let tx = h.transmits();
    let refreshes: Vec<_> = frames_to(&tx, conn);
    let [Body::NodeConfigRefreshRequest(req)] = refreshes.as_slice() else {
        panic!("one refresh to the ready node: {tx:?}");
    };
    assert!(
        frames_to(&tx, pending).is_empty(),
        "no refresh before ready"
    );
    assert_eq!(
        h.usage("n1", "a").capacity,
        2,
        "not before the node applied it"
    );
    h.send(
        conn,
        Body::NodeConfigRefreshResponse(NodeConfigRefreshResponse {
            request_id: req.request_id.clone(),
            status: RefreshStatus::Applied as i32,
            message: String::new(),
            revision: 2,
        }),
    );
    assert_eq!(h.usage("n1", "a").capacity, 4);
    assert!(matches!(
        h.events().as_slice(),
        [EdgeEvent::RefreshAnswered {
            status: RefreshStatus::Applied,
            ..
        }]
    ));
    // The pending node registered with revision 1: it gets the refresh right after ready.
    h.ready(pending, "n2");
    assert!(
        frames_to(&h.transmits(), pending)
            .iter()
            .any(|b| matches!(b, Body::NodeConfigRefreshRequest(_)))
    );
}

#[test]
fn invalid_config_changes_nothing() {
    let mut h = Harness::new();
    h.connect("n1");
    let mut cfg = config();
    cfg.models.get_mut("m").expect("m").candidates[0].node_id = "ghost".into();
    assert!(h.edge.handle_config(h.now, cfg).is_err());
    assert_eq!(h.edge.config(), &config());
    assert!(h.transmits().is_empty());
}

#[test]
fn removed_node_is_fenced_and_closed() {
    let mut h = Harness::new();
    let conn = h.connect("n2");
    let mut cfg = config();
    cfg.nodes.remove("n2");
    cfg.models.get_mut("m").expect("m").candidates.pop();
    h.edge.handle_config(h.now, cfg).expect("valid");
    let (tx, events) = h.drain();
    assert_eq!(closed(&tx), vec![(conn, CloseReason::NodeRemoved)]);
    assert!(matches!(
        events.as_slice(),
        [EdgeEvent::NodeDisconnected { .. }]
    ));
    assert!(h.edge.snapshots().iter().all(|s| s.node_id != "n2"));
}

#[test]
fn node_to_edge_direction_is_enforced() {
    let mut h = Harness::new();
    let conn = h.connect("n1");
    h.send(
        conn,
        Body::RunRequest(RunRequest {
            run_id: "x".into(),
            adapter: "a".into(),
            ..Default::default()
        }),
    );
    let (tx, _) = h.drain();
    assert!(matches!(
        closed(&tx)[0].1,
        CloseReason::ProtocolViolation(_)
    ));
    assert_eq!(h.edge.nodes()[0].state, NodeState::Offline);
}

#[test]
fn commands_are_validated_first_then_sent_to_ready_nodes_and_answered() {
    let mut h = Harness::new();
    let conn = h.connect("n1");
    let cmd = |kind: i32| NodeCommandRequest {
        r#type: kind,
        ..Default::default()
    };
    // An inadmissible type is refused before the node is even looked up.
    assert!(matches!(
        h.edge.handle_command(h.now, "no-such-node", cmd(5)),
        Err(CommandError::Invalid(_))
    ));
    assert_eq!(
        h.edge.handle_command(
            h.now,
            "no-such-node",
            cmd(NodeCommandType::Capabilities as i32)
        ),
        Err(CommandError::UnknownNode("no-such-node".into()))
    );
    assert_eq!(
        h.edge
            .handle_command(h.now, "n2", cmd(NodeCommandType::Capabilities as i32)),
        Err(CommandError::NotReady("n2".into()))
    );
    let id = h
        .edge
        .handle_command(h.now, "n1", cmd(NodeCommandType::TransportStatus as i32))
        .expect("sent")
        .to_string();
    let tx = h.transmits();
    assert!(
        matches!(frames_to(&tx, conn).as_slice(), [Body::NodeCommandRequest(r)] if r.request_id == id)
    );
    h.send(
        conn,
        Body::NodeCommandResponse(NodeCommandResponse {
            request_id: id.clone(),
            ok: true,
            error: String::new(),
            payload: bytes::Bytes::from_static(b"{}"),
        }),
    );
    assert!(matches!(
        h.events().as_slice(),
        [EdgeEvent::CommandAnswered { response, .. }] if response.ok && response.request_id == id
    ));
    // A pending command fails when its node goes away.
    let id = h
        .edge
        .handle_command(h.now, "n1", cmd(NodeCommandType::Capabilities as i32))
        .expect("sent")
        .to_string();
    h.edge.handle_connection_closed(h.now, conn).expect("open");
    let events = h.events();
    assert!(events.iter().any(|e| matches!(e, EdgeEvent::CommandAnswered { response, .. } if !response.ok && response.request_id == id)));
}

#[test]
fn tunnel_only_requests_use_only_tunnel_served_candidates() {
    // Model "m" mixes n1/a (mock: runs) and n2/b (openai_compat: tunnels).
    let mut h = Harness::new();
    h.connect("n1");
    h.connect("n2");
    let first = h.submit_tunnel("m").expect("granted");
    let g = grants(&h.events()).remove(0);
    assert_eq!(
        (g.request, &*g.node_id, g.shape),
        (first, "n2", DispatchShape::Tunnel)
    );
    // n2/b is full (capacity 1): the next one waits even though the mock has room.
    let second = h.submit_tunnel("m").expect("queued");
    assert!(grants(&h.events()).is_empty());
    assert_eq!(h.edge.queue().ids(), vec![second]);
    // A model with no tunnel-served candidate refuses at once.
    assert_eq!(
        h.submit_tunnel("solo"),
        Err(SubmitError::NoCandidates("solo".into()))
    );
    // Chat requests still use every candidate.
    h.submit("m", 1).expect("granted on the mock");
    assert_eq!(&*grants(&h.events())[0].node_id, "n1");
}

#[test]
fn a_tokenize_call_goes_only_to_a_tunnel_whose_provider_tokenizes() {
    // Model "k": n2/b (openai_compat), n3/c (vllm), n4/d (mock tunnelled, `tokenize`).
    let mut cfg = config();
    cfg.nodes.insert(
        "n3".into(),
        node(vec![adapter("c", AdapterType::Vllm, 1, 0)]),
    );
    let mut mock = adapter("d", AdapterType::Mock, 1, 0);
    mock.options.insert("dispatch".into(), "tunnel".into());
    mock.options
        .insert(tunnel::TOKENIZE_OPTION.into(), "true".into());
    cfg.nodes.insert("n4".into(), node(vec![mock]));
    cfg.models.insert(
        "k".into(),
        ModelSpec {
            candidates: vec![
                candidate("n2", "b"),
                candidate("n3", "c"),
                candidate("n4", "d"),
            ],
            long_context_threshold: None,
            context_tokens: None,
            first_byte_timeout: None,
            resume_limit: None,
            stall_timeout: None,
            affinity: None,
        },
    );
    let mut h = Harness::with(cfg.clone());
    for n in ["n2", "n3", "n4"] {
        h.connect(n);
    }
    let tokenize = |h: &mut Harness, model: &str| {
        let mut submit = Submit::chat(model, bytes::Bytes::from_static(b"{\"model\":\"k\"}"));
        submit.endpoint = tunnel::Endpoint::Tokenize;
        h.edge.handle_submit(h.now, submit)
    };
    let mut nodes = Vec::new();
    for _ in 0..2 {
        tokenize(&mut h, "k").expect("granted");
        nodes.push(grants(&h.events()).remove(0).node_id.to_string());
    }
    nodes.sort();
    assert_eq!(nodes, ["n3", "n4"], "never the openai_compat adapter");
    // Both are busy: the next one waits for them, never for n2/b.
    let waiting = tokenize(&mut h, "k").expect("queued");
    assert!(grants(&h.events()).is_empty());
    assert_eq!(h.edge.queue().ids(), vec![waiting]);
    // No provider of "m" tokenizes: refused at once, and the shell answers its estimate.
    assert_eq!(
        tokenize(&mut h, "m"),
        Err(SubmitError::NoCandidates("m".into()))
    );
    // A vLLM adapter that says `tokenize = "false"` does not.
    cfg.nodes.get_mut("n3").expect("n3").adapters[0]
        .options
        .insert(tunnel::TOKENIZE_OPTION.into(), "false".into());
    cfg.nodes.get_mut("n4").expect("n4").adapters[0]
        .options
        .remove(tunnel::TOKENIZE_OPTION);
    h.edge.handle_config(h.now, cfg).expect("valid");
    h.drain();
    assert_eq!(
        tokenize(&mut h, "k"),
        Err(SubmitError::NoCandidates("k".into()))
    );
}

#[test]
fn a_waiting_tunnel_request_skips_a_provider_that_stopped_tunnelling() {
    // Model "t": n2/b and n3/c, both openai_compat with capacity 1.
    let mut cfg = config();
    cfg.nodes.insert(
        "n3".into(),
        node(vec![adapter("c", AdapterType::OpenaiCompat, 1, 0)]),
    );
    cfg.models.insert(
        "t".into(),
        ModelSpec {
            candidates: vec![candidate("n2", "b"), candidate("n3", "c")],
            long_context_threshold: None,
            context_tokens: None,
            first_byte_timeout: None,
            resume_limit: None,
            stall_timeout: None,
            affinity: None,
        },
    );
    let mut h = Harness::with(cfg.clone());
    h.connect("n2");
    h.connect("n3");
    let on_b = h.submit_tunnel("t").expect("granted");
    let on_c = h.submit_tunnel("t").expect("granted");
    let first = h.submit_tunnel("t").expect("queued");
    let second = h.submit_tunnel("t").expect("queued");
    h.drain();
    // A refresh turns n2/b into an Ollama adapter (served by runs) while both wait.
    cfg.nodes.get_mut("n2").expect("n2").adapters[0].r#type = AdapterType::Ollama as i32;
    h.edge.handle_config(h.now, cfg).expect("valid");
    h.drain();
    // n2/b frees: neither waiter may take it. Both keep waiting for n3/c, in order.
    assert_eq!(
        h.edge.handle_cancel(h.now, on_b, "caller left"),
        Cancelled::Now
    );
    end_tunnel(&mut h, "n2", on_b);
    let events = h.events();
    assert!(grants(&events).is_empty(), "{events:?}");
    assert!(
        ended(&events).iter().all(|(request, _)| *request == on_b),
        "{events:?}"
    );
    assert_eq!(h.edge.queue().ids(), vec![first, second]);
    assert_eq!(h.usage("n2", "b").in_flight, 0, "the freed unit stays free");
    // A chat request may use n2/b now.
    h.submit("t", 1).expect("granted on n2/b");
    assert_eq!(&*grants(&h.events())[0].node_id, "n2");
    // n3/c frees: the older waiter gets it.
    assert_eq!(
        h.edge.handle_cancel(h.now, on_c, "caller left"),
        Cancelled::Now
    );
    end_tunnel(&mut h, "n3", on_c);
    let granted = grants(&h.events());
    assert_eq!(granted.len(), 1);
    assert_eq!((granted[0].request, &*granted[0].node_id), (first, "n3"));
    // With n3/c turned into a run-served mock as well, the last waiter has no provider
    // left for its endpoint: it fails with a typed error when n3/c frees.
    let mut cfg = h.edge.config().clone();
    cfg.nodes.get_mut("n3").expect("n3").adapters[0].r#type = AdapterType::Mock as i32;
    h.edge.handle_config(h.now, cfg).expect("valid");
    h.drain();
    assert_eq!(
        h.edge.handle_cancel(h.now, first, "caller left"),
        Cancelled::Now
    );
    end_tunnel(&mut h, "n3", first);
    let events = h.events();
    assert!(
        ended(&events)
            .iter()
            .any(|(request, outcome)| *request == second
                && matches!(outcome, Outcome::Failed(RequestError::Unsupported { .. }))),
        "{events:?}"
    );
    assert!(grants(&events).is_empty());
    assert!(h.edge.queue().is_empty());
}

/// `node` ends the tunnel of `request` (as it does for a cancel): its lease returns.
fn end_tunnel(h: &mut Harness, node: &str, request: RequestId) {
    let conn = h.edge.owner_of_node(node).expect("owned");
    h.send(
        conn,
        Body::ProviderTunnelFrame(ProviderTunnelFrame {
            run_id: run_id_of(request),
            sequence: 0,
            kind: TunnelFrameKind::Error as i32,
            end: true,
            ..Default::default()
        }),
    );
}

#[test]
fn a_large_frame_in_transit_keeps_the_node_alive_but_not_a_handshake() {
    let mut h = Harness::new();
    let conn = h.connect("n1");
    // Bytes every second for ten seconds and no whole frame: past the 3 s timeout.
    for ms in (1000..=10_000).step_by(1000) {
        h.now = iop_proto_core::Timestamp::from_millis(ms);
        h.edge
            .handle_bytes_received(h.now, conn)
            .expect("an open connection");
        h.at(ms + 500);
        assert_eq!(
            h.edge.nodes()[0].state,
            NodeState::Ready,
            "alive at {ms} ms"
        );
    }
    h.at(13_600);
    let (tx, _) = h.drain();
    assert!(closed(&tx).contains(&(conn, CloseReason::HeartbeatTimeout)));

    // A connection that never registers is closed at its handshake deadline however
    // many bytes it sends.
    let pending = h.open();
    let opened = h.now;
    let mut closed_at = None;
    for step in 1..=200 {
        let at = opened.as_millis() + step * 100;
        h.now = iop_proto_core::Timestamp::from_millis(at);
        let _ = h.edge.handle_bytes_received(h.now, pending);
        h.at(at);
        if closed(&h.transmits()).contains(&(pending, CloseReason::HandshakeTimeout)) {
            closed_at = Some(at - opened.as_millis());
            break;
        }
    }
    let closed_after = closed_at.expect("closed by the handshake deadline");
    assert!(closed_after <= 10_000, "closed after {closed_after} ms");
}

/// The lifecycle events `h` emitted since the last drain, in order.
fn lifecycle(h: &mut Harness) -> Vec<Lifecycle> {
    h.events();
    std::iter::from_fn(|| h.edge.poll_lifecycle()).collect()
}

#[test]
fn a_node_life_reads_as_typed_lifecycle_events_in_order() {
    let mut h = Harness::new();
    let conn = h.open();
    h.register(conn, "n1");
    assert_eq!(
        lifecycle(&mut h),
        vec![Lifecycle::NodeRegistered {
            node_id: "n1".into(),
            generation: 1
        }]
    );
    h.ready(conn, "n1");
    assert_eq!(
        lifecycle(&mut h),
        vec![
            Lifecycle::NodeReady {
                node_id: "n1".into(),
                generation: 1
            },
            Lifecycle::ProviderHealth {
                node_id: "n1".into(),
                provider_id: "a".into(),
                health: "healthy"
            },
        ]
    );
    // Request traffic is not lifecycle.
    let _ = h.submit("solo", 10).expect("queued");
    assert!(lifecycle(&mut h).is_empty());
    // Silence past the heartbeat timeout fences the generation, with the reason.
    h.at(10_000);
    let events = lifecycle(&mut h);
    assert_eq!(
        events.iter().map(Lifecycle::kind).collect::<Vec<_>>(),
        ["node.fenced", "node.disconnected", "provider.health"]
    );
    match &events[0] {
        Lifecycle::NodeFenced {
            node_id,
            generation,
            reason,
            lost,
            ..
        } => {
            assert_eq!(
                (&**node_id, *generation, *reason),
                ("n1", 1, "heartbeat_timeout")
            );
            assert_eq!(*lost, 1, "the granted request was lost with it");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        &events[2],
        Lifecycle::ProviderHealth {
            health: "offline",
            ..
        }
    ));
    // The JSON an operator reads: a `type` tag and the fields.
    let json = serde_json::to_value(&events[0]).expect("serialisable");
    assert_eq!(json["type"], "node.fenced");
    assert_eq!(json["reason"], "heartbeat_timeout");
    assert_eq!(json["node_id"], "n1");
}

/// What an operator sees of a node: the version and labels it registered with, the
/// round-trip time of the Edge's own heartbeat (an answer to another nonce does not
/// count, and the peer's echoed clock is not trusted), and how long it has been quiet.
#[test]
fn status_reports_version_labels_and_heartbeat_rtt() {
    let mut h = Harness::new();
    let conn = h.open();
    h.send(
        conn,
        Body::RegisterRequest(RegisterRequest {
            node_id: "n1".into(),
            token: TOKEN.into(),
            version: "9.9.9".into(),
            labels: [("zone".to_owned(), "eu-1".to_owned())].into(),
            ..Default::default()
        }),
    );
    h.ready(conn, "n1");
    h.drain();
    let n1 = &h.edge.nodes()[0];
    assert_eq!(n1.version.as_deref(), Some("9.9.9"));
    assert_eq!(n1.labels.get("zone").map(String::as_str), Some("eu-1"));
    assert_eq!(n1.rtt, None, "no heartbeat answered yet");

    // The Edge pings at the heartbeat interval; the node answers 7 ms later.
    h.at(1000);
    let (tx, _) = h.drain();
    let ping = frames_to(&tx, conn)
        .into_iter()
        .find_map(|b| match b {
            Body::Heartbeat(p) => Some(p),
            _ => None,
        })
        .expect("a heartbeat at the interval");
    h.now = Timestamp::from_millis(1007);
    h.send(
        conn,
        Body::HeartbeatAck(HeartbeatAck {
            nonce: ping.nonce + 1,
            echo_sent_at_ms: 0,
        }),
    );
    assert_eq!(
        h.edge.nodes()[0].rtt,
        None,
        "another nonce is not an answer"
    );
    h.send(
        conn,
        Body::HeartbeatAck(HeartbeatAck {
            nonce: ping.nonce,
            echo_sent_at_ms: 0,
        }),
    );
    assert_eq!(
        h.edge.nodes()[0].rtt,
        Some(std::time::Duration::from_millis(7))
    );
    h.at(1500);
    assert_eq!(
        h.edge.nodes()[0].last_seen,
        Some(std::time::Duration::from_millis(493))
    );

    // Offline: the last version stays, the link figures go.
    h.edge.handle_connection_closed(h.now, conn).expect("open");
    let n1 = &h.edge.nodes()[0];
    assert_eq!(n1.state, NodeState::Offline);
    assert_eq!(n1.version.as_deref(), Some("9.9.9"));
    assert_eq!((n1.rtt, n1.last_seen), (None, None));
}
