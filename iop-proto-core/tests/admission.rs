//! Scenario and property tests of node admission in the Edge machine: one uniform
//! rejection, per-source back-off, client-certificate identity, node-id conflicts,
//! superseded connections told why, and revoked tokens.

mod common;

use std::net::IpAddr;

use common::edge::*;
use iop_proto_core::edge::*;
use iop_proto_core::edge::{TOO_MANY_FAILURES, throttled_reason};
use iop_proto_core::edge_config::*;
use iop_proto_core::wire::*;
use iop_proto_core::*;
use proptest::prelude::*;

fn from(addr: &str) -> Peer {
    Peer {
        addr: Some(addr.parse().expect("ip")),
        ..Peer::default()
    }
}

/// The register answer sent to `conn`.
fn register_answer(tx: &[Transmit], conn: ConnId) -> RegisterResponse {
    frames_to(tx, conn)
        .into_iter()
        .find_map(|b| match b {
            Body::RegisterResponse(r) => Some(r),
            _ => None,
        })
        .expect("a RegisterResponse")
}

fn rejections(events: &[EdgeEvent]) -> Vec<(RejectReason, bool)> {
    events
        .iter()
        .filter_map(|e| match e {
            EdgeEvent::RegisterRejected { reason, log, .. } => Some((*reason, *log)),
            _ => None,
        })
        .collect()
}

/// Attempts one register of `node` with `token` from `peer`; returns the answer, which
/// must come at once (no hold).
fn attempt(h: &mut Harness, peer: Peer, node: &str, token: &str) -> RegisterResponse {
    let (answer, waited) = attempt_waiting(h, peer, node, token);
    assert_eq!(waited, 0, "answered at once: {answer:?}");
    answer
}

/// Attempts one register and lets time pass until it is answered; returns the answer
/// and how long it took, in milliseconds.
fn attempt_waiting(
    h: &mut Harness,
    peer: Peer,
    node: &str,
    token: &str,
) -> (RegisterResponse, u64) {
    let conn = h.open_from(peer);
    h.register_with(conn, node, token);
    let start = h.now.as_millis();
    loop {
        let tx = h.transmits();
        if frames_to(&tx, conn)
            .iter()
            .any(|b| matches!(b, Body::RegisterResponse(_)))
        {
            return (register_answer(&tx, conn), h.now.as_millis() - start);
        }
        let wake = h.edge.poll_timeout().expect("a held answer has a timer");
        h.at(wake.at.as_millis());
    }
}

const ONE_ADDRESS: &str = "203.0.113.7";

#[test]
fn a_node_guessed_wrong_from_its_address_never_locks_out_its_siblings() {
    let mut h = Harness::new();
    // A misconfigured n1 retries once a second from the one address a NAT gives a whole
    // fleet; its healthy sibling n2, from the same address, registers in between.
    // n2 restarts every second.
    let mut reasons = Vec::new();
    let mut sibling = None;
    for second in 0..60u64 {
        h.at(second * 1000);
        let (bad, _) = attempt_waiting(&mut h, from(ONE_ADDRESS), "n1", "typo");
        assert!(!bad.accepted);
        reasons.push(bad.reason);
        if let Some(conn) = sibling.take() {
            h.edge.handle_connection_closed(h.now, conn).expect("open");
        }
        let conn = h.open_from(from(ONE_ADDRESS));
        h.register(conn, "n2");
        let good = register_answer(&h.transmits(), conn);
        assert!(good.accepted, "second {second}: {good:?}");
        sibling = Some(conn);
        h.drain();
    }
    assert!(
        reasons
            .iter()
            .all(|r| r == AUTH_FAILED || r.starts_with(TOO_MANY_FAILURES))
    );
    // n2 is ready now and sees its own failures only: none.
    assert!(
        h.edge
            .registration_failures(10)
            .nodes
            .iter()
            .all(|n| n.node_id == "n1" && n.known)
    );
}

#[test]
fn guesses_are_answered_at_a_bounded_rate_and_never_succeed() {
    for known in [true, false] {
        let mut h = Harness::new();
        let mut waited = 0;
        let mut throttled = 0;
        for i in 0..200 {
            let node = if known {
                "n1".to_owned()
            } else {
                format!("guess-id-{i}")
            };
            let (answer, ms) = attempt_waiting(&mut h, from(ONE_ADDRESS), &node, "guess-token");
            assert!(!answer.accepted);
            waited += ms;
            if answer.reason.starts_with(TOO_MANY_FAILURES) {
                throttled += 1;
                assert!(answer.retry_after_ms >= 1000, "{answer:?}");
                assert_eq!(
                    answer.reason,
                    throttled_reason(std::time::Duration::from_millis(u64::from(
                        answer.retry_after_ms
                    )))
                );
            } else {
                assert_eq!(answer.reason, AUTH_FAILED);
                assert_eq!(answer.retry_after_ms, 0, "wrong credentials are final");
            }
        }
        // Five answered at once, then one a second.
        assert_eq!(throttled, 195, "known id: {known}");
        assert_eq!(waited, 195_000, "known id: {known}");
        let events = h.events();
        let logged = events
            .iter()
            .filter(|e| matches!(e, EdgeEvent::RegisterRejected { log: true, .. }))
            .count();
        // Powers of two, the first held answer, and one a minute for the 195 s they take.
        assert!(logged <= 12, "{logged} log lines for 200 guesses");
        let failing = h.edge.registration_failures(5);
        assert_eq!(failing.sources.len(), 1);
        assert_eq!(failing.sources[0].failures, 200);
        assert_eq!(failing.sources[0].key.to_string(), ONE_ADDRESS);
        if known {
            assert_eq!(
                (failing.nodes[0].node_id.as_str(), failing.nodes[0].known),
                ("n1", true)
            );
        }
    }
}

#[test]
fn concurrent_guesses_wait_for_each_other() {
    let mut h = Harness::new();
    let conns: Vec<ConnId> = (0..64)
        .map(|_| {
            let conn = h.open_from(from(ONE_ADDRESS));
            h.register_with(conn, "n1", "guess");
            conn
        })
        .collect();
    let tx = h.transmits();
    let answered_at_once = conns
        .iter()
        .filter(|&&c| !frames_to(&tx, c).is_empty())
        .count();
    assert_eq!(answered_at_once, 5);
    // A held answer keeps its connection pending: with 59 held, the pending cap (64 per
    // address) leaves room for 5 more connections.
    for _ in 0..5 {
        h.open_from(from(ONE_ADDRESS));
    }
    let over = h.open_from(from(ONE_ADDRESS));
    assert_eq!(
        closed(&h.transmits()),
        vec![(over, CloseReason::TooManyPending)]
    );
    // The rest are answered one a second, up to the longest hold.
    let mut answered = answered_at_once;
    for second in 1..=30 {
        h.at(second * 1000);
        let now = closed(&h.transmits())
            .iter()
            .filter(|(c, _)| conns.contains(c))
            .count();
        answered += now;
        if second < 30 {
            assert!(now <= 1, "{now} answers in second {second}");
        }
    }
    assert_eq!(answered, 64, "every held answer comes by the longest hold");
    // Meanwhile the right token, even for the guessed id, gets in at once.
    assert!(attempt(&mut h, from(ONE_ADDRESS), "n1", TOKEN).accepted);
}

#[test]
fn a_right_token_ends_its_ids_throttle() {
    let mut h = Harness::new();
    for _ in 0..20 {
        attempt_waiting(&mut h, from("198.51.100.1"), "n1", "guess");
    }
    // From anywhere, the guessed id's own token is never held or refused...
    assert!(attempt(&mut h, from("198.51.100.1"), "n1", TOKEN).accepted);
    // ...and it ends the id's throttle: a later typo of n1 elsewhere is answered at once.
    let (answer, waited) = attempt_waiting(&mut h, from("192.0.2.9"), "n1", "typo");
    assert_eq!((answer.reason.as_str(), waited), (AUTH_FAILED, 0));
}

#[test]
fn with_mutual_tls_a_certificate_only_registers_the_node_it_names() {
    let mut cfg = config();
    cfg.admission.require_client_identity = true;
    let mut h = Harness::with(cfg);
    let cert_for = |names: &[&str]| Peer {
        addr: Some("10.1.1.1".parse().expect("ip")),
        tls: Some("TLSv1.3"),
        identities: names.iter().map(|n| (*n).to_owned()).collect(),
    };
    let answer = attempt(&mut h, cert_for(&["n1"]), "n2", TOKEN);
    assert!(
        !answer.accepted,
        "node A's certificate cannot register node B"
    );
    assert_eq!(answer.reason, AUTH_FAILED);
    assert_eq!(
        rejections(&h.events()),
        vec![(RejectReason::IdentityMismatch, true)]
    );
    assert!(!attempt(&mut h, Peer::default(), "n1", TOKEN).accepted);
    let conn = h.open_from(cert_for(&["n1"]));
    h.register(conn, "n1");
    h.ready(conn, "n1");
    let status = &h.edge.nodes()[0];
    assert_eq!(status.state, NodeState::Ready);
    assert_eq!(status.tls, Some("TLSv1.3"));
    assert!(status.client_certificate);
}

#[test]
fn two_nodes_sharing_an_id_become_a_conflict_instead_of_flapping() {
    let mut cfg = config();
    // Heartbeats far apart: the test node never answers one.
    cfg.timing.heartbeat_interval = std::time::Duration::from_secs(100);
    cfg.timing.heartbeat_timeout = std::time::Duration::from_secs(300);
    let mut h = Harness::with(cfg);
    let mut owner = h.connect("n1");
    // Two processes with one id: each reconnect takes the node from the other.
    let mut supersedes = 0;
    let conflict = loop {
        h.at(h.now.as_millis() + 1000);
        let conn = h.open();
        h.register(conn, "n1");
        h.ready(conn, "n1");
        let (tx, events) = h.drain();
        // The connection taken over is told why before it is closed.
        assert!(
            frames_to(&tx, owner).iter().any(|b| matches!(b,
                Body::NodeReadyResponse(r) if !r.ready && r.reason.contains("superseded"))),
            "{tx:?}"
        );
        assert!(closed(&tx).contains(&(owner, CloseReason::Superseded)));
        supersedes += 1;
        owner = conn;
        if let Some(e) = events
            .iter()
            .find(|e| matches!(e, EdgeEvent::NodeConflict { .. }))
        {
            break e.clone();
        }
        assert!(supersedes < 10, "no conflict after {supersedes} supersedes");
    };
    assert_eq!(supersedes, 3);
    assert!(matches!(conflict, EdgeEvent::NodeConflict { ref node_id, .. } if &**node_id == "n1"));
    assert!(h.edge.nodes()[0].conflict);
    // The next newcomer is held off, told why and when to come back; the owner stays.
    for _ in 0..5 {
        h.at(h.now.as_millis() + 20_000);
        let answer = attempt(&mut h, Peer::default(), "n1", TOKEN);
        assert!(!answer.accepted);
        assert!(answer.reason.contains("conflict"), "{}", answer.reason);
        assert!(answer.retry_after_ms > 0);
        let events = h.events();
        assert!(matches!(
            rejections(&events).as_slice(),
            [(RejectReason::Conflict, _)]
        ));
        assert!(
            !events
                .iter()
                .any(|e| matches!(e, EdgeEvent::NodeConflict { .. }))
        );
        assert_eq!(h.edge.owner_of_node("n1"), Some(owner));
        assert!(
            h.edge.nodes()[0].conflict,
            "still a conflict while both run"
        );
    }
    // The duplicate stopped: the conflict clears after the hold-down.
    h.at(h.now.as_millis() + 61_000);
    assert!(!h.edge.nodes()[0].conflict);
    assert_eq!(h.edge.nodes()[0].state, NodeState::Ready);
}

/// Takes `node` for a new connection of process `instance` and readies it; returns the
/// connection and whether the id became a conflict.
fn take(h: &mut Harness, node: &str, instance: u64) -> (ConnId, bool) {
    let conn = h.open();
    h.register_as(conn, node, instance);
    h.ready(conn, node);
    let (_, events) = h.drain();
    let conflict = events
        .iter()
        .any(|e| matches!(e, EdgeEvent::NodeConflict { .. }));
    (conn, conflict)
}

#[test]
fn restarts_and_reconnects_of_one_node_are_never_a_conflict() {
    let mut h = Harness::new();
    take(&mut h, "n1", 1);
    // Twenty restarts 100 ms apart, each a new process beside the live old one (a
    // restart that does not wait, or whose old process's drain request is still on its
    // way), and each process reconnecting once over its own live connection.
    for instance in 2..22 {
        h.at(h.now.as_millis() + 100);
        let (conn, conflict) = take(&mut h, "n1", instance);
        assert!(!conflict, "restart {instance} made a conflict");
        assert_eq!(h.edge.owner_of_node("n1"), Some(conn));
        h.at(h.now.as_millis() + 10);
        let (again, conflict) = take(&mut h, "n1", instance);
        assert!(
            !conflict,
            "a reconnect of process {instance} made a conflict"
        );
        assert_eq!(h.edge.owner_of_node("n1"), Some(again));
    }
    assert!(!h.edge.nodes()[0].conflict);
    assert_eq!(h.edge.nodes()[0].state, NodeState::Ready);
}

#[test]
fn two_processes_taking_one_id_back_and_forth_are_a_conflict() {
    let mut h = Harness::new();
    let (mut owner, _) = take(&mut h, "n1", 1);
    let mut caught = None;
    for round in 1..10u64 {
        h.at(h.now.as_millis() + 1000);
        let (conn, conflict) = take(&mut h, "n1", 1 + round % 2);
        if conflict {
            caught = Some(round);
            owner = conn;
            break;
        }
        owner = conn;
    }
    // Process 2 takes it (unproven), 1 takes it back (proves both), 2 again: the third.
    assert_eq!(caught, Some(3));
    // The holder's own process may still reconnect; the other is held off.
    let (conn, _) = take(&mut h, "n1", 2);
    assert_eq!(
        h.edge.owner_of_node("n1"),
        Some(conn),
        "the holder's own process"
    );
    assert_ne!(conn, owner);
    let refused = h.open();
    h.register_as(refused, "n1", 1);
    let answer = register_answer(&h.transmits(), refused);
    assert!(!answer.accepted && answer.reason.contains("conflict"));
}

#[test]
fn a_changed_token_revokes_the_connection_that_used_the_old_one() {
    let mut h = Harness::new();
    let conn = h.connect("n1");
    let mut cfg = h.edge.config().clone();
    cfg.nodes.get_mut("n1").expect("n1").token = TokenVerifier::from_secret(b"rotated-token");
    let diff = h.edge.handle_config(h.now, cfg).expect("valid");
    assert_eq!(diff.changed_tokens, vec!["n1".to_owned()]);
    let (tx, events) = h.drain();
    assert!(closed(&tx).contains(&(conn, CloseReason::CredentialsChanged)));
    assert!(matches!(
        events.as_slice(),
        [EdgeEvent::NodeDisconnected {
            reason: CloseReason::CredentialsChanged,
            ..
        }]
    ));
    assert!(!attempt(&mut h, Peer::default(), "n1", TOKEN).accepted);
    assert!(attempt(&mut h, Peer::default(), "n1", "rotated-token").accepted);
}

#[test]
fn oversized_register_fields_close_the_connection() {
    let mut h = Harness::new();
    let conn = h.open();
    h.register_with(conn, &"n".repeat(MAX_NODE_ID_BYTES + 1), TOKEN);
    let (tx, _) = h.drain();
    assert!(matches!(
        closed(&tx).as_slice(),
        [(_, CloseReason::ProtocolViolation(_))]
    ));
}

#[test]
fn unregistered_connections_are_capped_per_source_and_in_all() {
    let mut cfg = config();
    cfg.admission.pending = PendingLimits {
        max_total: 4,
        max_per_source: 2,
    };
    let mut h = Harness::with(cfg);
    let a = [h.open_from(from("10.0.0.1")), h.open_from(from("10.0.0.1"))];
    assert!(h.transmits().is_empty());
    let third = h.open_from(from("10.0.0.1"));
    let (tx, events) = h.drain();
    assert_eq!(closed(&tx), vec![(third, CloseReason::TooManyPending)]);
    assert!(matches!(
        events.as_slice(),
        [EdgeEvent::ConnectionRefused { log: true, .. }]
    ));
    // Other sources still get in, up to the total.
    let b = [h.open_from(from("10.0.0.2")), h.open_from(from("10.0.0.3"))];
    let over = h.open_from(from("10.0.0.4"));
    assert_eq!(
        closed(&h.transmits()),
        vec![(over, CloseReason::TooManyPending)]
    );
    // A registered connection no longer counts: room for one more.
    h.register(a[0], "n1");
    h.transmits();
    let next = h.open_from(from("10.0.0.1"));
    assert!(closed(&h.transmits()).is_empty(), "{next:?} admitted");
    // Closing frees room too, refused and closed ones never count twice.
    for conn in [b[0], b[1], third, over] {
        h.edge.handle_connection_closed(h.now, conn).expect("open");
    }
    let more: Vec<ConnId> = (0..2)
        .map(|i| h.open_from(from(&format!("10.0.1.{i}"))))
        .collect();
    assert!(closed(&h.transmits()).is_empty(), "{more:?} admitted");
}

#[test]
fn the_full_frame_limit_comes_just_before_an_accepted_register_answer() {
    let mut h = Harness::new();
    let refused = h.open();
    h.register_with(refused, "n1", "wrong");
    let tx = h.transmits();
    assert!(
        !tx.iter().any(|t| matches!(t, Transmit::FrameLimit { .. })),
        "a refused peer keeps the small limit"
    );
    let conn = h.open();
    h.register(conn, "n1");
    let tx = h.transmits();
    let limit = tx
        .iter()
        .position(|t| matches!(t, Transmit::FrameLimit { conn: c, max_frame_len } if *c == conn && *max_frame_len == DEFAULT_MAX_FRAME_LEN))
        .expect("limit raised");
    let answer = tx
        .iter()
        .position(|t| matches!(t, Transmit::Frame { envelope, .. } if matches!(envelope.body, Some(Body::RegisterResponse(_)))))
        .expect("answered");
    assert!(limit < answer, "{tx:?}");
    assert!(h.edge.config().admission.pending_frame_len < DEFAULT_MAX_FRAME_LEN);
}

#[derive(Clone, Debug)]
struct Try {
    source: u8,
    node: u8,
    right_token: bool,
    advance_ms: u32,
}

fn tries() -> impl Strategy<Value = Vec<Try>> {
    proptest::collection::vec(
        (
            0u8..4,
            0u8..3,
            any::<bool>(),
            prop_oneof![0u32..500, 0u32..20_000],
        )
            .prop_map(|(source, node, right_token, advance_ms)| Try {
                source,
                node,
                right_token,
                advance_ms,
            }),
        1..120,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever the mix of sources, ids, tokens and timing: the right token for a
    /// configured id is accepted at once (or held off by a node-id conflict), whatever
    /// failed before it; every failure is refused with one reason, at once within the
    /// budgets and otherwise after the throttle's hold with the throttled reason; the
    /// machine's hold and log decisions are the throttle's.
    #[test]
    fn a_right_token_always_gets_in_and_failures_wait_as_the_throttle_says(tries in tries()) {
        let mut h = Harness::new();
        let mut throttle = AuthThrottle::new(ThrottleLimits::default());
        for t in tries {
            h.at(h.now.as_millis() + u64::from(t.advance_ms));
            let addr: IpAddr = format!("10.0.0.{}", t.source).parse().expect("ip");
            let source = Source::of(Some(addr));
            let node = ["n1", "n2", "nx"][usize::from(t.node)];
            let token = if t.right_token { TOKEN } else { "guess" };
            let right = t.right_token && node != "nx";
            let at = h.now;
            let (answer, waited) = attempt_waiting(&mut h, Peer { addr: Some(addr), ..Peer::default() }, node, token);
            let events = h.events();
            if right {
                prop_assert_eq!(waited, 0);
                prop_assert!(answer.accepted || answer.reason.contains("conflict"), "{:?}", answer);
                throttle.record_success(node);
                continue;
            }
            prop_assert!(!answer.accepted);
            let expected = throttle.record_failure(at, source, node);
            prop_assert_eq!(u128::from(waited), expected.hold.as_millis());
            if expected.by.is_some() {
                prop_assert_eq!(&answer.reason, &throttled_reason(expected.retry_after));
            } else {
                prop_assert_eq!(&answer.reason, AUTH_FAILED);
            }
            let seen = events.iter().find_map(|e| match e {
                EdgeEvent::RegisterRejected { throttled, log, .. } => Some((throttled.map(|t| (t.by, t.hold)), *log)),
                _ => None,
            });
            prop_assert_eq!(seen, Some((expected.by.map(|by| (by, expected.hold)), expected.log)));
        }
    }
}
