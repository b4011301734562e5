//! An Edge in a cluster (docs/cluster.md), as the core decides it: registers wait for
//! the cluster's claim, fenced instances drain, following nodes learn the members, and a
//! node's refusal of a slot is tried again without blaming its provider.

mod common;

use std::time::Duration;

use common::edge::*;
use iop_proto_core::cluster::ClaimDecision;
use iop_proto_core::edge::*;
use iop_proto_core::wire::*;

fn register_following(h: &mut Harness, conn: ConnId, node_id: &str, instance: u64) {
    h.send(
        conn,
        Body::RegisterRequest(RegisterRequest {
            node_id: node_id.into(),
            token: TOKEN.into(),
            instance_id: instance,
            cluster: true,
            ..Default::default()
        }),
    );
}

fn members() -> ClusterMembers {
    ClusterMembers {
        edge_id: "edge-a".into(),
        members: ["a", "b"]
            .iter()
            .map(|e| ClusterEdge {
                edge_id: format!("edge-{e}"),
                node_addr: format!("{e}.example:7100"),
            })
            .collect(),
    }
}

fn clustered() -> Harness {
    let mut h = Harness::new();
    h.edge.enable_cluster();
    h.edge.handle_cluster_serving(h.now);
    h
}

fn claims(events: &[EdgeEvent]) -> Vec<(ConnId, String, u64)> {
    events
        .iter()
        .filter_map(|e| match e {
            EdgeEvent::ClaimNode {
                conn,
                node_id,
                instance,
            } => Some((*conn, node_id.to_string(), *instance)),
            _ => None,
        })
        .collect()
}

fn releases(events: &[EdgeEvent]) -> Vec<(String, u64)> {
    events
        .iter()
        .filter_map(|e| match e {
            EdgeEvent::ReleaseNode { node_id, instance } => Some((node_id.to_string(), *instance)),
            _ => None,
        })
        .collect()
}

fn register_answer(transmits: &[Transmit], conn: ConnId) -> Option<RegisterResponse> {
    frames_to(transmits, conn)
        .into_iter()
        .find_map(|b| match b {
            Body::RegisterResponse(r) => Some(r),
            _ => None,
        })
}

#[test]
fn a_register_waits_for_its_claim_then_takes_the_node_and_learns_the_members() {
    let mut h = clustered();
    h.edge.handle_cluster_members(h.now, members());
    let conn = h.open();
    register_following(&mut h, conn, "n1", 7);
    let (transmits, events) = h.drain();
    assert!(register_answer(&transmits, conn).is_none(), "{transmits:?}");
    assert_eq!(claims(&events), [(conn, "n1".to_owned(), 7)]);
    // Not registered meanwhile: a ready is refused.
    h.edge
        .handle_claim(h.now, conn, ClaimDecision::Admitted { fence: 12 });
    let (transmits, events) = h.drain();
    let answer = register_answer(&transmits, conn).expect("answered");
    assert!(answer.accepted);
    assert_eq!(answer.cluster, Some(members()));
    assert!(
        events
            .iter()
            .any(|e| matches!(e, EdgeEvent::NodeRegistered { .. })),
        "{events:?}"
    );
    assert!(releases(&events).is_empty(), "{events:?}");
    h.ready(conn, "n1");
    let (transmits, _) = h.drain();
    assert_eq!(only_ready_answer(&transmits, conn), Some(true));
}

/// Before a cluster Edge holds the cluster's shared configuration (an Edge starting, or a
/// successor joining in a hand-over), a register is not judged against a configuration
/// that may not be the cluster's: it is told to try again shortly, whatever its id, and
/// never "authentication failed" (which a node takes as final). Once serving, an id the
/// configuration lacks is refused as usual.
#[test]
fn a_register_before_the_shared_configuration_is_in_is_told_to_retry_not_refused() {
    let mut h = Harness::new();
    h.edge.enable_cluster();
    for id in ["n1", "not-configured-yet"] {
        let conn = h.open();
        register_following(&mut h, conn, id, 7);
        let (transmits, events) = h.drain();
        let answer = register_answer(&transmits, conn).expect("answered at once");
        assert!(!answer.accepted);
        assert!(!answer.reason.starts_with(AUTH_FAILED), "{}", answer.reason);
        assert!(answer.reason.contains("configuration"), "{}", answer.reason);
        assert_eq!(answer.retry_after_ms, 2000);
        assert!(claims(&events).is_empty(), "{events:?}");
        assert!(
            events.iter().any(|e| matches!(
                e,
                EdgeEvent::RegisterRejected {
                    reason: RejectReason::ClusterUnavailable,
                    failures: 0,
                    ..
                }
            )),
            "{events:?}"
        );
    }
    h.edge.handle_cluster_serving(h.now);
    let conn = h.open();
    register_following(&mut h, conn, "not-configured-yet", 7);
    let (transmits, _) = h.drain();
    let answer = register_answer(&transmits, conn).expect("answered");
    assert!(answer.reason.starts_with(AUTH_FAILED), "{}", answer.reason);
    let conn = h.open();
    register_following(&mut h, conn, "n1", 7);
    let (_, events) = h.drain();
    assert_eq!(claims(&events), [(conn, "n1".to_owned(), 7)]);
}

/// A cluster member with no live provider for any model, past its start, stops taking
/// callers (its `/healthz` answers 503) so that the balancer sends them to members
/// that can serve; with a node ready it takes them again. A single Edge always does.
#[test]
fn a_member_without_any_node_stops_taking_callers_after_its_start() {
    let mut single = Harness::new();
    single.at(60_000);
    assert!(single.edge.takes_callers(single.now));
    let mut h = clustered();
    assert!(h.edge.takes_callers(h.now), "starting: nodes dial in");
    // Past max(two heartbeat intervals, the register timeout): 2 s here.
    h.at(2_000);
    assert!(!h.edge.takes_callers(h.now));
    let conn = h.open();
    register_following(&mut h, conn, "n1", 7);
    h.drain();
    h.edge
        .handle_claim(h.now, conn, ClaimDecision::Admitted { fence: 1 });
    h.ready(conn, "n1");
    h.drain();
    assert!(h.edge.takes_callers(h.now), "n1 serves model m and solo");
}

#[test]
fn a_node_id_another_instance_holds_is_refused_with_the_reason_and_a_retry() {
    let mut h = clustered();
    let conn = h.open();
    register_following(&mut h, conn, "n1", 8);
    h.drain();
    h.edge
        .handle_claim(h.now, conn, ClaimDecision::HeldBy { instance: 7 });
    let (transmits, events) = h.drain();
    let answer = register_answer(&transmits, conn).expect("answered");
    assert!(!answer.accepted);
    assert!(
        answer.reason.contains("held by another instance"),
        "{}",
        answer.reason
    );
    assert_eq!(answer.retry_after_ms, 5000);
    assert!(closed(&transmits).iter().any(|(c, _)| *c == conn));
    assert!(events.iter().any(|e| matches!(
        e,
        EdgeEvent::RegisterRejected {
            reason: RejectReason::ClusterHeld,
            ..
        }
    )));
}

#[test]
fn a_claim_the_cluster_cannot_decide_is_refused_for_a_retry_soon() {
    let mut h = clustered();
    let conn = h.open();
    register_following(&mut h, conn, "n1", 8);
    h.drain();
    h.edge.handle_claim(h.now, conn, ClaimDecision::Unavailable);
    let (transmits, _) = h.drain();
    let answer = register_answer(&transmits, conn).expect("answered");
    assert!(!answer.accepted);
    assert!(answer.reason.contains("etcd"), "{}", answer.reason);
    assert_eq!(answer.retry_after_ms, 2000);
}

#[test]
fn wrong_credentials_never_reach_the_cluster() {
    let mut h = clustered();
    let conn = h.open();
    h.register_with(conn, "n1", "not-the-token");
    let (transmits, events) = h.drain();
    assert!(claims(&events).is_empty(), "{events:?}");
    let answer = register_answer(&transmits, conn).expect("refused at once");
    assert!(!answer.accepted);
}

#[test]
fn a_second_register_while_the_first_is_claimed_breaks_the_connection() {
    let mut h = clustered();
    let conn = h.open();
    register_following(&mut h, conn, "n1", 7);
    h.drain();
    register_following(&mut h, conn, "n1", 7);
    let (transmits, _) = h.drain();
    assert!(
        closed(&transmits).iter().any(|(c, reason)| *c == conn
            && matches!(
                reason,
                CloseReason::ProtocolViolation(ConnViolation::SecondRegister)
            )),
        "{transmits:?}"
    );
}

#[test]
fn a_connection_gone_while_claiming_releases_the_instance_and_its_answer_is_moot() {
    let mut h = clustered();
    let conn = h.open();
    register_following(&mut h, conn, "n1", 7);
    h.drain();
    h.edge
        .handle_connection_closed(h.now, conn)
        .expect("open conn");
    let (_, events) = h.drain();
    assert_eq!(releases(&events), [("n1".to_owned(), 7)]);
    h.edge
        .handle_claim(h.now, conn, ClaimDecision::Admitted { fence: 3 });
    let (transmits, events) = h.drain();
    assert!(transmits.is_empty(), "{transmits:?}");
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, EdgeEvent::NodeRegistered { .. })),
        "{events:?}"
    );
}

#[test]
fn a_fence_drains_that_instance_and_releases_it_once_closed() {
    let mut h = clustered();
    let conn = h.open();
    register_following(&mut h, conn, "n1", 7);
    h.drain();
    h.edge
        .handle_claim(h.now, conn, ClaimDecision::Admitted { fence: 3 });
    h.ready(conn, "n1");
    h.drain();
    // Another instance's fence changes nothing here.
    h.edge.handle_cluster_fence(h.now, "n1", 8);
    let (transmits, events) = h.drain();
    assert!(transmits.is_empty() && events.is_empty(), "{events:?}");
    h.edge.handle_cluster_fence(h.now, "n1", 7);
    let (transmits, events) = h.drain();
    assert!(
        events.iter().any(|e| matches!(
            e,
            EdgeEvent::NodeDraining {
                reason: DrainReason::Cluster(_),
                ..
            }
        )),
        "{events:?}"
    );
    // Nothing in flight: closed at once, and no longer served here.
    assert!(closed(&transmits).iter().any(|(c, _)| *c == conn));
    assert_eq!(releases(&events), [("n1".to_owned(), 7)]);
    assert!(h.submit("solo", 1).is_ok());
    let (_, events) = h.drain();
    assert!(
        grants(&events).is_empty(),
        "a fenced node gets no work: {events:?}"
    );
}

#[test]
fn members_go_to_the_nodes_that_follow_the_cluster_and_only_when_they_change() {
    let mut h = clustered();
    let following = h.open();
    register_following(&mut h, following, "n1", 7);
    h.drain();
    h.edge
        .handle_claim(h.now, following, ClaimDecision::Admitted { fence: 3 });
    h.ready(following, "n1");
    let other = h.open();
    h.register_as(other, "n2", 9);
    h.drain();
    h.edge
        .handle_claim(h.now, other, ClaimDecision::Admitted { fence: 4 });
    h.ready(other, "n2");
    h.drain();
    h.edge.handle_cluster_members(h.now, members());
    let (transmits, _) = h.drain();
    assert_eq!(
        frames_to(&transmits, following),
        [Body::ClusterMembers(members())]
    );
    assert!(
        frames_to(&transmits, other).is_empty(),
        "an older node hears nothing"
    );
    h.edge.handle_cluster_members(h.now, members());
    let (transmits, _) = h.drain();
    assert!(transmits.is_empty(), "{transmits:?}");
}

#[test]
fn a_single_edge_takes_registers_at_once() {
    let mut h = Harness::new();
    let conn = h.open();
    register_following(&mut h, conn, "n1", 7);
    let (transmits, events) = h.drain();
    assert!(claims(&events).is_empty());
    let answer = register_answer(&transmits, conn).expect("answered");
    assert!(answer.accepted);
    assert_eq!(answer.cluster, None, "no cluster, no members");
}

/// The node refused the slot though the ledger had room (work this Edge cannot see holds
/// it): the request is not sent straight back, because the provider counts as full until
/// the node reports its load or one heartbeat interval passes; then it is tried again,
/// on the same provider if it is the only one, and the provider is not ejected however
/// often it happens. A node that refuses everything ends the request at its eighth such
/// refusal.
#[test]
fn a_nodes_refusal_holds_the_provider_and_is_tried_again_without_blaming_it() {
    let mut h = Harness::new();
    let conn = h.connect("n1");
    let request = h.submit("solo", 1).expect("accepted");
    let mut refused = 0;
    let mut clock = 0;
    let (_, events) = h.drain();
    let mut grant = grants(&events).pop().expect("dispatched");
    loop {
        h.refuse(conn, &grant.run.wire());
        refused += 1;
        let (_, events) = h.drain();
        assert!(
            !events
                .iter()
                .any(|e| matches!(e, EdgeEvent::ProviderEjected { .. })),
            "{events:?}"
        );
        if let Some((_, outcome)) = ended(&events).into_iter().find(|(r, _)| *r == request) {
            assert!(
                matches!(&outcome, Outcome::Failed(RequestError::Provider(d)) if d.code == "refused"),
                "{outcome:?}"
            );
            break;
        }
        assert!(grants(&events).is_empty(), "not straight back: {events:?}");
        assert_eq!(h.usage("n1", "a").refused_hold, 2, "both slots held");
        // Half the hold: still held.
        clock += 500;
        h.at(clock);
        let (_, events) = h.drain();
        assert!(grants(&events).is_empty(), "{events:?}");
        clock += 500;
        h.at(clock);
        let (_, events) = h.drain();
        grant = grants(&events)
            .into_iter()
            .find(|g| g.request == request)
            .expect("dispatched again once the hold passed");
        assert!(refused < 20, "a refusing node is not asked forever");
    }
    assert_eq!(refused, 8, "the eighth unexplained refusal ends it");
    let routing = h
        .edge
        .provider_routing()
        .into_iter()
        .find(|p| &*p.provider_id == "a")
        .expect("listed");
    assert_eq!(
        routing.standing,
        iop_proto_core::edge::Standing::Live,
        "{routing:?}"
    );
}

/// A refusal's hold gives way to what the node says: its load report ends it at once,
/// and a request waiting for the provider is dispatched.
#[test]
fn a_load_report_ends_a_refusal_hold_at_once() {
    let mut h = Harness::new();
    let conn = h.connect("n1");
    let first = h.submit("solo", 1).expect("accepted");
    let (_, events) = h.drain();
    let grant = grants(&events).pop().expect("dispatched");
    h.refuse(conn, &grant.run.wire());
    let second = h.submit("solo", 1).expect("accepted");
    let (_, events) = h.drain();
    assert!(grants(&events).is_empty(), "held: {events:?}");
    h.send(
        conn,
        Body::NodeLoadReport(NodeLoadReport {
            held_elsewhere: Vec::new(),
        }),
    );
    let (_, events) = h.drain();
    let mut served: Vec<_> = grants(&events).iter().map(|g| g.request).collect();
    served.sort();
    assert_eq!(served, vec![first, second], "{events:?}");
    assert_eq!(h.usage("n1", "a").refused_hold, 0);
}

/// A cancelled run whose node does not confirm the cancel within the grace: its lease
/// returns, but its unit stays taken until the node reports its load or one heartbeat
/// interval passes, for the node may still be stopping the run.
#[test]
fn a_unit_whose_cancel_grace_passed_is_held_until_the_node_says_or_the_hold_ends() {
    let mut cfg = config();
    cfg.timing.cancel_grace = Duration::from_millis(1_000);
    let mut h = Harness::with(cfg);
    let _conn = h.connect("n1");
    let first = h.submit("solo", 1).expect("accepted");
    let _second = h.submit("solo", 1).expect("accepted");
    h.drain();
    assert_eq!(h.usage("n1", "a").in_flight, 2);
    h.edge.handle_cancel(h.now, first, "caller left");
    h.drain();
    // The grace (1 s here) passes without the node's terminal.
    h.at(1_000);
    h.drain();
    let usage = h.usage("n1", "a");
    assert_eq!((usage.in_flight, usage.refused_hold), (1, 1), "{usage:?}");
    let third = h.submit("solo", 1).expect("accepted");
    let (_, events) = h.drain();
    assert!(grants(&events).is_empty(), "held: {events:?}");
    // One heartbeat interval (1 s) later the unit is offered again.
    h.at(2_000);
    let (_, events) = h.drain();
    assert_eq!(grants(&events).pop().map(|g| g.request), Some(third));
}

/// A refused request goes to another candidate with room at once, not back to the node
/// that refused it.
#[test]
fn a_refused_request_goes_to_another_candidate_with_room() {
    let mut h = Harness::new();
    let n1 = h.connect("n1");
    let n2 = h.connect("n2");
    h.drain();
    let request = h.submit("m", 1).expect("accepted");
    let (_, events) = h.drain();
    let grant = grants(&events).pop().expect("dispatched");
    let (first, other) = if &*grant.node_id == "n1" {
        (n1, "n2")
    } else {
        (n2, "n1")
    };
    h.refuse(first, &grant.run.wire());
    let (_, events) = h.drain();
    let again = grants(&events).pop().expect("dispatched again at once");
    assert_eq!(again.request, request);
    assert_eq!(&*again.node_id, other, "{events:?}");
}

/// A node that dialled one Edge twice (through a balancer, say) does not cut its own
/// live session there: the second register is turned away with the reason.
#[test]
fn the_same_node_process_registering_twice_keeps_its_live_session() {
    let mut h = clustered();
    let first = h.open();
    register_following(&mut h, first, "n1", 7);
    h.drain();
    h.edge
        .handle_claim(h.now, first, ClaimDecision::Admitted { fence: 3 });
    h.ready(first, "n1");
    h.drain();
    let second = h.open();
    register_following(&mut h, second, "n1", 7);
    h.drain();
    h.edge
        .handle_claim(h.now, second, ClaimDecision::Admitted { fence: 3 });
    let (transmits, events) = h.drain();
    let answer = register_answer(&transmits, second).expect("answered");
    assert!(!answer.accepted);
    assert!(
        answer.reason.contains("already has a live session"),
        "{}",
        answer.reason
    );
    assert!(answer.retry_after_ms > 0);
    assert!(
        closed(&transmits).iter().all(|(c, _)| *c != first),
        "{transmits:?}"
    );
    assert!(
        events.iter().any(|e| matches!(
            e,
            EdgeEvent::RegisterRejected {
                reason: RejectReason::DuplicateSession,
                ..
            }
        )),
        "{events:?}"
    );
    assert!(
        releases(&events).is_empty(),
        "the instance is still served: {events:?}"
    );
    assert!(h.submit("solo", 1).is_ok());
    let (_, events) = h.drain();
    assert_eq!(grants(&events).len(), 1, "{events:?}");
}

/// What the Edge tells its nodes always passes their validation: members that cannot go
/// on the wire are left out, and no more than the wire allows are sent.
#[test]
fn members_that_cannot_go_on_the_wire_are_left_out() {
    let mut h = clustered();
    let conn = h.open();
    register_following(&mut h, conn, "n1", 7);
    h.drain();
    h.edge
        .handle_claim(h.now, conn, ClaimDecision::Admitted { fence: 3 });
    h.ready(conn, "n1");
    h.drain();
    let mut many = members();
    many.members.push(ClusterEdge {
        edge_id: "edge-empty".into(),
        node_addr: String::new(),
    });
    many.members.push(ClusterEdge {
        edge_id: "x".repeat(10_000),
        node_addr: "x:1".into(),
    });
    for i in 0..100 {
        many.members.push(ClusterEdge {
            edge_id: format!("edge-{i:03}"),
            node_addr: format!("h{i}:7100"),
        });
    }
    h.edge.handle_cluster_members(h.now, many);
    let (transmits, _) = h.drain();
    let frames = frames_to(&transmits, conn);
    let [Body::ClusterMembers(sent)] = frames.as_slice() else {
        panic!("{transmits:?}");
    };
    assert_eq!(sent.members.len(), 64);
    assert_eq!(sent.members[..2], members().members[..]);
    assert!(
        Envelope::new(Body::ClusterMembers(sent.clone()))
            .validate()
            .is_ok()
    );
}

/// Under saturation a request may lose the race for a freed slot to another Edge many
/// times while it waits: each such refusal comes after the node's report that the slot
/// is taken, so the ledger explains it, the request waits for capacity again, and it is
/// not ended by the bound on refusals.
#[test]
fn refusals_the_nodes_reports_explain_never_end_a_waiting_request() {
    let mut h = Harness::new();
    let conn = h.connect("n1");
    let held = |n: u32| {
        Body::NodeLoadReport(NodeLoadReport {
            held_elsewhere: if n == 0 {
                Vec::new()
            } else {
                vec![AdapterLoad {
                    adapter: "a".into(),
                    in_flight: n,
                    long_in_flight: 0,
                }]
            },
        })
    };
    let request = h.submit("solo", 1).expect("accepted");
    let (_, events) = h.drain();
    let mut grant = grants(&events).pop().expect("dispatched");
    for _ in 0..20 {
        // Another Edge took both slots: reported, then this run refused.
        h.send(conn, held(2));
        h.refuse(conn, &grant.run.wire());
        let (_, events) = h.drain();
        assert!(ended(&events).is_empty(), "{events:?}");
        assert!(grants(&events).is_empty(), "it waits: {events:?}");
        // The other Edge's work ends: the slot is offered again.
        h.send(conn, held(0));
        let (_, events) = h.drain();
        grant = grants(&events).pop().expect("dispatched again once free");
        assert_eq!(grant.request, request);
    }
    h.run_event(conn, &grant.run.wire(), RunEventType::Start, 1);
    h.send(
        conn,
        Body::RunEvent(RunEvent {
            run_id: grant.run.wire(),
            sequence: 2,
            r#type: RunEventType::Delta as i32,
            delta: "hi".into(),
            ..Default::default()
        }),
    );
    h.run_event(conn, &grant.run.wire(), RunEventType::Complete, 3);
    let (_, events) = h.drain();
    assert!(
        ended(&events)
            .iter()
            .any(|(r, o)| *r == request && *o == Outcome::Completed),
        "{events:?}"
    );
}
