//! Scenario and property tests of node admission in the Edge machine: one uniform
//! rejection, per-source back-off, client-certificate identity, node-id conflicts,
//! superseded connections told why, and revoked tokens.

mod common;

use std::net::IpAddr;

use common::edge::*;
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

/// Attempts one register of `node` with `token` from `peer`; returns the answer.
fn attempt(h: &mut Harness, peer: Peer, node: &str, token: &str) -> RegisterResponse {
    let conn = h.open_from(peer);
    h.register_with(conn, node, token);
    let tx = h.transmits();
    register_answer(&tx, conn)
}

#[test]
fn a_source_that_keeps_failing_backs_off_without_its_credentials_being_checked() {
    let mut h = Harness::new();
    let attacker = "203.0.113.7";
    for i in 0..6 {
        let answer = attempt(&mut h, from(attacker), "n1", "guess");
        assert!(!answer.accepted);
        assert_eq!(answer.reason, AUTH_FAILED, "attempt {i}");
    }
    // Blocked now: even the right token is refused, with the same reason and a retry hint.
    let answer = attempt(&mut h, from(attacker), "n1", TOKEN);
    assert!(
        !answer.accepted,
        "credentials are not checked while backing off"
    );
    assert_eq!(answer.reason, AUTH_FAILED);
    assert!(
        answer.retry_after_ms > 0,
        "a throttled peer may come back later"
    );
    let events = h.events();
    assert_eq!(
        rejections(&events).last(),
        Some(&(RejectReason::Throttled, false))
    );
    // Another address is not affected.
    assert!(attempt(&mut h, from("198.51.100.1"), "n1", TOKEN).accepted);
    // After the back-off the right token gets in, and the slate is clean.
    h.at(u64::from(answer.retry_after_ms) + 1);
    assert!(attempt(&mut h, from(attacker), "n2", TOKEN).accepted);
    let again = attempt(&mut h, from(attacker), "n1", "guess");
    assert_eq!(
        again.retry_after_ms, 0,
        "failures were forgotten after a success"
    );
}

#[test]
fn two_hundred_guesses_write_a_handful_of_log_lines() {
    let mut h = Harness::new();
    for _ in 0..200 {
        let answer = attempt(&mut h, from("203.0.113.9"), "n1", "guess");
        assert_eq!(answer.reason, AUTH_FAILED);
    }
    let events = h.events();
    let rejected = rejections(&events);
    assert_eq!(rejected.len(), 200, "every refusal is counted");
    let logged = rejected.iter().filter(|(_, log)| *log).count();
    assert!(logged <= 10, "{logged} log lines for 200 guesses");
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
        assert!(!conflict, "a reconnect of process {instance} made a conflict");
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
    assert_eq!(h.edge.owner_of_node("n1"), Some(conn), "the holder's own process");
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
        (0u8..4, 0u8..3, any::<bool>(), 0u32..20_000).prop_map(
            |(source, node, right_token, advance_ms)| Try {
                source,
                node,
                right_token,
                advance_ms,
            },
        ),
        1..120,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever the mix of sources, ids, tokens and timing: every failed registration
    /// gets the one reason on the wire; a blocked source never gets in; a source that is
    /// not blocked always gets in with the right credentials (or is held off by a node-id
    /// conflict); the machine's back-off and log decisions are those of the throttle.
    #[test]
    fn admission_is_uniform_and_never_lets_a_blocked_source_in(tries in tries()) {
        let mut h = Harness::new();
        let mut throttle = AuthThrottle::new(ThrottleLimits::default());
        for t in tries {
            h.at(h.now.as_millis() + u64::from(t.advance_ms));
            let addr: IpAddr = format!("10.0.0.{}", t.source).parse().expect("ip");
            let source = Source::of(Some(addr));
            let node = ["n1", "n2", "nx"][usize::from(t.node)];
            let token = if t.right_token { TOKEN } else { "guess" };
            let blocked = throttle.blocked(h.now, source).is_some();
            let answer = attempt(&mut h, Peer { addr: Some(addr), ..Peer::default() }, node, token);
            let events = h.events();
            let conflict = answer.reason.contains("conflict");
            if blocked {
                prop_assert!(!answer.accepted, "a blocked source got in");
                prop_assert!(answer.retry_after_ms > 0);
            } else if t.right_token && node != "nx" {
                prop_assert!(answer.accepted || conflict, "{:?}", answer);
            } else {
                prop_assert!(!answer.accepted);
            }
            if answer.accepted {
                throttle.record_success(source);
            } else if !conflict {
                prop_assert_eq!(&answer.reason, AUTH_FAILED);
                let expected = throttle.record_failure(h.now, source);
                let seen = events.iter().find_map(|e| match e {
                    EdgeEvent::RegisterRejected { failures, blocked_for, log, .. } =>
                        Some((*failures, *blocked_for, *log)),
                    _ => None,
                });
                prop_assert_eq!(seen, Some((expected.failures, expected.blocked_for, expected.log)));
            }
        }
    }
}
