//! `ClusterMember`: membership, node-id ownership and configuration, one Edge's side
//! (docs/cluster.md). The three-Edge world with a simulated etcd is in `tests/sim.rs`.
//!
//! One file on purpose, past the 800-line norm: each file under `tests/` is a test binary
//! of its own, linked against the whole dependency graph, and on a 2-core CI machine every
//! extra binary costs a link; this suite covers one subject and shares its helpers.

use std::time::Duration;

use iop_proto_core::Timestamp;
use iop_proto_core::cluster::{
    ClaimDecision, ClusterConfig, ClusterConfigError, ClusterEvent, ClusterMember,
    ClusterUsageError, EtcdRequest, KeyValue, LeftReason, Reply, Tag, Transmit, WatchEvent,
};

fn at(ms: u64) -> Timestamp {
    Timestamp::from_millis(ms)
}

fn transmits(member: &mut ClusterMember) -> Vec<Transmit> {
    std::iter::from_fn(|| member.poll_transmit()).collect()
}

fn events(member: &mut ClusterMember) -> Vec<ClusterEvent> {
    std::iter::from_fn(|| member.poll_event()).collect()
}

fn kv(key: &str, value: &str, create: u64, lease: i64) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: value.as_bytes().to_vec(),
        create_revision: create,
        mod_revision: create,
        lease,
    }
}

/// etcd's answer to a claim of `node`: its key names `instance`, was created at `fence`
/// with node lease `lease`, by this claim or before it.
fn claimed(node: &str, instance: u64, fence: u64, lease: i64, created: bool) -> Reply {
    Reply::Claimed {
        holder: kv(
            &format!("/iop/nodes/{node}"),
            &instance.to_string(),
            fence,
            lease,
        ),
        created,
    }
}

/// A member of `/iop` that has joined at t=100ms with lease 7, the store at revision 5
/// holding `kvs`.
fn joined(kvs: Vec<KeyValue>) -> ClusterMember {
    let config = ClusterConfig::new("e1", "/iop/", b"127.0.0.1:7100".to_vec());
    let mut member = ClusterMember::new(config, at(0)).unwrap();
    let sent = transmits(&mut member);
    assert!(
        matches!(sent[0].request, EtcdRequest::Grant { ttl } if ttl == Duration::from_secs(10))
    );
    assert!(matches!(&sent[1].request, EtcdRequest::Sync { prefix } if prefix == "/iop/"));
    member
        .handle_reply(
            at(50),
            sent[0].tag,
            Reply::Granted {
                lease: 7,
                ttl: Duration::from_secs(10),
            },
        )
        .unwrap();
    let put = transmits(&mut member);
    assert!(matches!(
        &put[0].request,
        EtcdRequest::Put { key, lease: 7, .. } if key == "/iop/members/e1"
    ));
    member
        .handle_reply(at(60), put[0].tag, Reply::Put { revision: 4 })
        .unwrap();
    assert!(
        !member.is_member(),
        "a member once it has read the cluster too"
    );
    member
        .handle_reply(at(100), sent[1].tag, Reply::Synced { revision: 5, kvs })
        .unwrap();
    assert!(member.is_member());
    member
}

#[test]
fn a_member_joins_once_its_lease_key_and_view_are_in() {
    let mut member = joined(vec![
        kv("/iop/members/e1", "127.0.0.1:7100", 4, 7),
        kv("/iop/members/e2", "127.0.0.1:7200", 2, 3),
    ]);
    let seen = events(&mut member);
    assert!(seen.contains(&ClusterEvent::Joined));
    let members = seen.iter().rev().find_map(|e| match e {
        ClusterEvent::Members(m) => Some(m.iter().map(|m| m.edge_id.clone()).collect::<Vec<_>>()),
        _ => None,
    });
    assert_eq!(members.unwrap(), ["e1", "e2"]);
    // The lease is renewed every 3 s.
    assert_eq!(member.poll_timeout(), Some(at(3_050)));
}

#[test]
fn the_lease_counts_as_lost_a_ttl_after_the_last_confirmed_renewal_was_sent() {
    let mut member = joined(vec![]);
    let _ = events(&mut member);
    member.handle_timeout(at(3_050));
    let renew = transmits(&mut member);
    assert!(matches!(
        renew[0].request,
        EtcdRequest::KeepAlive { lease: 7 }
    ));
    // Confirmed late: counted from when it was sent, not when the answer came.
    member
        .handle_reply(
            at(5_000),
            renew[0].tag,
            Reply::KeptAlive {
                ttl: Duration::from_secs(10),
            },
        )
        .unwrap();
    assert_eq!(member.valid_until(), at(13_050));
    // Every later renewal fails: the member stops at 13.05 s, before etcd can expire it.
    let mut now = 6_050;
    while now < 13_050 {
        member.handle_timeout(at(now));
        for t in transmits(&mut member) {
            member
                .handle_reply(at(now + 10), t.tag, Reply::Failed)
                .unwrap();
        }
        assert!(member.is_member(), "still a member at {now} ms");
        now += 1_000;
    }
    member.handle_timeout(at(13_050));
    assert!(!member.is_member());
    assert!(events(&mut member).contains(&ClusterEvent::Detached(LeftReason::LeaseExpired)));
    // It serves on, on what it last knew, and says since when.
    assert!(member.serves());
    assert_eq!(member.detached_since(), Some(at(13_050)));
    assert_eq!(member.unanswered_since(), Some(at(6_060)));
    // It asks for a new lease at once, and reads the cluster afresh: what it saw before
    // is only the last seen.
    let asked = transmits(&mut member);
    assert!(
        asked
            .iter()
            .any(|t| matches!(t.request, EtcdRequest::Grant { .. }))
    );
    assert!(
        asked
            .iter()
            .any(|t| matches!(t.request, EtcdRequest::Sync { .. }))
    );
    assert!(!member.is_synced());
}

/// Claims `node` for `instance` at `now` and answers with `reply`; the decision, if made.
fn claim(
    member: &mut ClusterMember,
    now: u64,
    node: &str,
    instance: u64,
    reply: Reply,
) -> Vec<ClusterEvent> {
    let ticket = member.claim_node(at(now), node, instance).unwrap();
    let sent = transmits(member);
    assert!(matches!(
        &sent[0].request,
        EtcdRequest::Claim { key, value, .. } if key == &format!("/iop/nodes/{node}") && value == instance.to_string().as_bytes()
    ));
    member
        .handle_reply(at(now + 10), sent[0].tag, reply)
        .unwrap();
    let seen = events(member);
    assert!(
        seen.iter()
            .all(|e| !matches!(e, ClusterEvent::Claim { ticket: t, .. } if *t != ticket))
    );
    seen
}

#[test]
fn the_first_claim_serves_and_another_instance_is_refused() {
    let mut member = joined(vec![]);
    let _ = events(&mut member);
    let won = claim(&mut member, 200, "n1", 41, claimed("n1", 41, 9, 21, true));
    assert!(matches!(
        won[..],
        [ClusterEvent::Claim {
            decision: ClaimDecision::Admitted { fence: 9 },
            ..
        }]
    ));
    assert_eq!(member.serving("n1"), Some((41, 9)));
    // Another instance of n1, here: refused without asking etcd.
    let ticket = member.claim_node(at(300), "n1", 42).unwrap();
    assert!(transmits(&mut member).is_empty());
    assert_eq!(
        events(&mut member),
        [ClusterEvent::Claim {
            ticket,
            decision: ClaimDecision::HeldBy { instance: 41 }
        }]
    );
    // n2 is held by another instance through another Edge.
    let lost = claim(&mut member, 400, "n2", 51, claimed("n2", 52, 11, 30, false));
    assert!(matches!(
        lost[..],
        [ClusterEvent::Claim {
            decision: ClaimDecision::HeldBy { instance: 52 },
            ..
        }]
    ));
    assert_eq!(member.serving("n2"), None);
}

#[test]
fn an_instance_another_edge_claimed_is_served_once_its_lease_is_renewed_from_here() {
    let mut member = joined(vec![]);
    let _ = events(&mut member);
    let pending = claim(&mut member, 200, "n1", 41, claimed("n1", 41, 9, 21, false));
    assert!(pending.is_empty(), "not decided before the renewal");
    let renew = transmits(&mut member);
    assert!(matches!(
        renew[0].request,
        EtcdRequest::KeepAlive { lease: 21 }
    ));
    member
        .handle_reply(
            at(240),
            renew[0].tag,
            Reply::KeptAlive {
                ttl: Duration::from_secs(10),
            },
        )
        .unwrap();
    assert!(matches!(
        events(&mut member)[..],
        [ClusterEvent::Claim {
            decision: ClaimDecision::Admitted { fence: 9 },
            ..
        }]
    ));
    // A lease that had run out is not served.
    let _ = claim(&mut member, 300, "n2", 51, claimed("n2", 51, 12, 22, false));
    let renew = transmits(&mut member);
    member
        .handle_reply(
            at(340),
            renew[0].tag,
            Reply::KeptAlive {
                ttl: Duration::ZERO,
            },
        )
        .unwrap();
    assert!(matches!(
        events(&mut member)[..],
        [ClusterEvent::Claim {
            decision: ClaimDecision::Unavailable,
            ..
        }]
    ));
}

/// A node lease that cannot be renewed in time stops this Edge vouching for the
/// instance, not serving it: the instance is claimed again, and fenced only when etcd
/// says another instance holds the node id.
#[test]
fn an_instance_whose_node_lease_cannot_be_renewed_is_claimed_again_and_fenced_only_on_etcds_word() {
    let mut member = joined(vec![]);
    let _ = events(&mut member);
    let _ = claim(&mut member, 200, "n1", 41, claimed("n1", 41, 9, 21, true));
    let _ = claim(&mut member, 300, "n2", 51, claimed("n2", 51, 10, 22, true));
    assert_eq!(member.vouches("n1"), Some(41));
    // The node leases were granted after 200 and 300 ms: vouched for until 10.2 and
    // 10.3 s at most. The member's own lease is renewed meanwhile; the node leases'
    // renewals fail.
    let mut now = 3_050;
    while now < 10_200 {
        member.handle_timeout(at(now));
        for t in transmits(&mut member) {
            let reply = match t.request {
                EtcdRequest::KeepAlive { lease: 7 } => Reply::KeptAlive {
                    ttl: Duration::from_secs(10),
                },
                _ => Reply::Failed,
            };
            member.handle_reply(at(now + 5), t.tag, reply).unwrap();
        }
        now = member.poll_timeout().unwrap().as_millis();
    }
    assert_eq!(now, 10_200);
    member.handle_timeout(at(10_300));
    assert_eq!(events(&mut member), [], "nothing fenced for etcd's silence");
    assert_eq!(member.vouches("n1"), None);
    assert_eq!(member.serving("n1"), Some((41, 9)), "served on");
    let reclaims = transmits(&mut member);
    assert_eq!(reclaims.len(), 2, "{reclaims:?}");
    for t in &reclaims {
        assert!(matches!(&t.request, EtcdRequest::Claim { .. }), "{t:?}");
    }
    // n1's key had run out and another instance took it: this one is fenced. n2's
    // is made again for it: vouched for under the new lease and fence.
    member
        .handle_reply(
            at(10_400),
            reclaims[0].tag,
            claimed("n1", 42, 30, 40, false),
        )
        .unwrap();
    member
        .handle_reply(at(10_400), reclaims[1].tag, claimed("n2", 51, 31, 41, true))
        .unwrap();
    assert_eq!(
        events(&mut member),
        [ClusterEvent::Fence {
            node_id: "n1".into(),
            instance: 41
        }]
    );
    assert!(member.is_member(), "the member itself is fine");
    assert_eq!(member.serving("n1"), None);
    assert_eq!(member.serving("n2"), Some((51, 31)));
    assert_eq!(member.vouches("n2"), Some(51));
    // Renewed under the new lease from now on.
    member.handle_timeout(at(12_100));
    assert!(
        transmits(&mut member)
            .iter()
            .any(|t| matches!(t.request, EtcdRequest::KeepAlive { lease: 41 }))
    );
}

/// etcd away past the member's lease: the member serves on, detached, with what it
/// holds; another session of an instance it serves is admitted, a new instance is not.
/// When etcd answers it joins under a new lease, still listing itself to its nodes, and
/// claims every instance again, adopting a key another Edge made meanwhile once a renewal
/// of its lease from here is confirmed.
#[test]
fn a_member_that_lost_etcd_serves_on_and_claims_again_when_it_returns() {
    let mut member = joined(vec![
        kv("/iop/members/e1", "127.0.0.1:7100", 4, 7),
        kv("/iop/members/e2", "127.0.0.1:7200", 3, 3),
    ]);
    let _ = events(&mut member);
    let _ = claim(&mut member, 200, "n1", 41, claimed("n1", 41, 9, 21, true));
    // Every request fails from now on, for 30 s.
    let mut now = 1_000;
    while now < 31_000 {
        member.handle_timeout(at(now));
        for t in transmits(&mut member) {
            member
                .handle_reply(at(now + 500), t.tag, Reply::Failed)
                .unwrap();
        }
        now += 500;
    }
    let seen = events(&mut member);
    assert!(
        seen.contains(&ClusterEvent::Detached(LeftReason::LeaseExpired)),
        "{seen:?}"
    );
    assert!(
        !seen
            .iter()
            .any(|e| matches!(e, ClusterEvent::Fence { .. } | ClusterEvent::Members(_))),
        "nothing fenced, no list told: {seen:?}"
    );
    assert!(!member.is_member() && member.serves());
    assert_eq!(member.serving("n1"), Some((41, 9)));
    assert_eq!(member.vouches("n1"), None);
    // Another session of n1's instance: admitted at once. Another instance: not now.
    let again = member.claim_node(at(31_000), "n1", 41).unwrap();
    let other = member.claim_node(at(31_000), "n3", 71).unwrap();
    assert!(transmits(&mut member).is_empty(), "etcd is not asked");
    assert_eq!(
        events(&mut member),
        [
            ClusterEvent::Claim {
                ticket: again,
                decision: ClaimDecision::Admitted { fence: 9 }
            },
            ClusterEvent::Claim {
                ticket: other,
                decision: ClaimDecision::Unavailable
            }
        ]
    );
    // etcd answers again: a read that no longer shows e1's key (it expired), a new lease.
    member.handle_timeout(at(32_000));
    let asked = transmits(&mut member);
    let grant = asked
        .iter()
        .find(|t| matches!(t.request, EtcdRequest::Grant { .. }))
        .expect("a new lease is asked for");
    let sync = asked
        .iter()
        .find(|t| matches!(t.request, EtcdRequest::Sync { .. }))
        .expect("the cluster is read again");
    member
        .handle_reply(
            at(32_010),
            sync.tag,
            Reply::Synced {
                revision: 40,
                kvs: vec![
                    kv("/iop/members/e2", "127.0.0.1:7200", 38, 33),
                    kv("/iop/nodes/n1", "41", 39, 34),
                ],
            },
        )
        .unwrap();
    assert_eq!(
        events(&mut member),
        [],
        "the list still names this Edge: its nodes keep their sessions"
    );
    member
        .handle_reply(
            at(32_020),
            grant.tag,
            Reply::Granted {
                lease: 50,
                ttl: Duration::from_secs(10),
            },
        )
        .unwrap();
    let put = transmits(&mut member);
    member
        .handle_reply(at(32_030), put[0].tag, Reply::Put { revision: 41 })
        .unwrap();
    assert!(member.is_member());
    assert_eq!(member.detached_since(), None);
    assert_eq!(member.unanswered_since(), None);
    assert_eq!(events(&mut member), [ClusterEvent::Joined]);
    let reclaim = transmits(&mut member);
    let [t] = reclaim.as_slice() else {
        panic!("one claim again: {reclaim:?}");
    };
    assert!(matches!(&t.request, EtcdRequest::Claim { key, .. } if key == "/iop/nodes/n1"));
    // e2 made the key again for the same instance: renew its lease from here, then vouch.
    member
        .handle_reply(at(32_040), t.tag, claimed("n1", 41, 39, 34, false))
        .unwrap();
    let renew = transmits(&mut member);
    assert!(matches!(
        renew[0].request,
        EtcdRequest::KeepAlive { lease: 34 }
    ));
    assert_eq!(member.vouches("n1"), None, "not before the renewal");
    member
        .handle_reply(
            at(32_050),
            renew[0].tag,
            Reply::KeptAlive {
                ttl: Duration::from_secs(10),
            },
        )
        .unwrap();
    assert_eq!(member.vouches("n1"), Some(41));
    assert_eq!(member.serving("n1"), Some((41, 39)));
    assert_eq!(events(&mut member), []);
}

/// A member whose key went stays in the list told to the nodes for one TTL: an etcd that
/// returns after an outage expires every lease at once, and the members' keys are back
/// within a second or two. One that stays gone leaves the list after that.
#[test]
fn a_member_whose_key_went_leaves_the_list_a_ttl_later() {
    let mut member = joined(vec![
        kv("/iop/members/e1", "127.0.0.1:7100", 4, 7),
        kv("/iop/members/e2", "127.0.0.1:7200", 3, 3),
        kv("/iop/members/e3", "127.0.0.1:7300", 2, 2),
    ]);
    let _ = events(&mut member);
    let listed = |seen: &[ClusterEvent]| {
        seen.iter().rev().find_map(|e| match e {
            ClusterEvent::Members(m) => {
                Some(m.iter().map(|m| m.edge_id.clone()).collect::<Vec<_>>())
            }
            _ => None,
        })
    };
    member.handle_watch(
        at(1_000),
        vec![
            WatchEvent::Delete {
                key: "/iop/members/e2".into(),
                revision: 6,
            },
            WatchEvent::Delete {
                key: "/iop/members/e3".into(),
                revision: 7,
            },
        ],
    );
    assert_eq!(events(&mut member), [], "both still listed");
    // e2 is back a second later; e3 is not.
    member.handle_watch(
        at(2_000),
        vec![WatchEvent::Put(kv(
            "/iop/members/e2",
            "127.0.0.1:7200",
            8,
            9,
        ))],
    );
    assert_eq!(events(&mut member), []);
    let _ = keep_running(&mut member, 2_000, 10_999);
    assert_eq!(listed(&events(&mut member)), None);
    let _ = keep_running(&mut member, 10_999, 11_000);
    assert_eq!(
        listed(&events(&mut member)),
        Some(vec!["e1".to_owned(), "e2".to_owned()])
    );
}

/// A member serves once it has answered every configuration offered (applied or
/// refused): a successor in a hand-over waits for it before it takes the callers and
/// the nodes. A later revision, once offered, is answered in its turn while the member
/// keeps serving.
#[test]
fn a_member_serves_once_the_configuration_offered_is_answered() {
    let mut member = joined(vec![kv("/iop/config", "first", 3, 0)]);
    assert!(member.is_member());
    assert!(!member.is_serving(), "the configuration is not in yet");
    events(&mut member);
    member.handle_configured(at(150), 3, Ok(()));
    assert!(member.is_serving());
    let alone = joined(vec![]);
    assert!(
        alone.is_serving(),
        "no shared configuration: the local file serves"
    );
}

#[test]
fn configurations_are_offered_once_each_in_order_and_the_outcome_is_written() {
    let mut member = joined(vec![kv("/iop/config", "first", 3, 0)]);
    assert!(events(&mut member).contains(&ClusterEvent::Configure {
        revision: 3,
        text: b"first".to_vec()
    }));
    member.handle_configured(at(150), 3, Err("models: unknown node".into()));
    let status = transmits(&mut member);
    assert!(matches!(
        &status[0].request,
        EtcdRequest::Put { key, value, .. } if key == "/iop/status/e1" && value == b"3 refused: models: unknown node"
    ));
    // A later revision is offered; a replayed older one is not.
    member.handle_watch(
        at(200),
        vec![WatchEvent::Put(kv("/iop/config", "second", 3, 0)).clone()],
    );
    assert!(events(&mut member).is_empty());
    let mut second = kv("/iop/config", "second", 3, 0);
    second.mod_revision = 8;
    member.handle_watch(at(210), vec![WatchEvent::Put(second.clone())]);
    member.handle_watch(at(220), vec![WatchEvent::Put(second)]);
    assert_eq!(
        events(&mut member),
        [ClusterEvent::Configure {
            revision: 8,
            text: b"second".to_vec()
        }]
    );
}

/// The answer `config push` waits for is written under the member lease: one whose lease
/// an etcd started afresh no longer knows is written again under the next lease, and a
/// write that failed is tried again, so a push is told the truth.
#[test]
fn the_configuration_answer_is_written_again_under_each_new_lease() {
    let mut member = joined(vec![kv("/iop/config", "first", 3, 0)]);
    let _ = events(&mut member);
    member.handle_configured(at(150), 3, Ok(()));
    let status = transmits(&mut member);
    assert!(matches!(
        &status[0].request,
        EtcdRequest::Put { key, value, lease: 7 } if key == "/iop/status/e1" && value == b"3 ok"
    ));
    // The fresh etcd knows no lease 7: the write fails, and is tried again soon.
    member
        .handle_reply(at(160), status[0].tag, Reply::Failed)
        .unwrap();
    member.handle_timeout(member.poll_timeout().expect("a retry is due"));
    let again = transmits(&mut member);
    assert!(
        again.iter().any(|t| matches!(&t.request,
            EtcdRequest::Put { key, value, .. } if key == "/iop/status/e1" && value == b"3 ok")),
        "{again:?}"
    );
    // The lease is gone (a renewal says so): under the next one, the member key and then
    // the same answer are written again.
    member.handle_timeout(at(3_050));
    let renew = transmits(&mut member);
    let keepalive = renew
        .iter()
        .find(|t| matches!(t.request, EtcdRequest::KeepAlive { lease: 7 }))
        .expect("a renewal");
    member
        .handle_reply(
            at(3_060),
            keepalive.tag,
            Reply::KeptAlive {
                ttl: Duration::ZERO,
            },
        )
        .unwrap();
    assert!(!member.is_member());
    let asked = transmits(&mut member);
    let grant = asked
        .iter()
        .find(|t| matches!(t.request, EtcdRequest::Grant { .. }))
        .expect("a new lease is asked for");
    member
        .handle_reply(
            at(3_100),
            grant.tag,
            Reply::Granted {
                lease: 9,
                ttl: Duration::from_secs(10),
            },
        )
        .unwrap();
    let key = transmits(&mut member)
        .into_iter()
        .find(|t| matches!(&t.request, EtcdRequest::Put { key, lease: 9, .. } if key == "/iop/members/e1"))
        .expect("the member key under lease 9");
    member
        .handle_reply(at(3_120), key.tag, Reply::Put { revision: 2 })
        .unwrap();
    assert!(
        transmits(&mut member).iter().any(|t| matches!(&t.request,
            EtcdRequest::Put { key, value, lease: 9 } if key == "/iop/status/e1" && value == b"3 ok")),
        "the answer is written under the new lease"
    );
}

/// An etcd started afresh (its data lost) counts revisions from 1 again: what it holds
/// after a read is offered even at a revision below the one applied before.
#[test]
fn a_store_that_went_back_offers_its_configuration_anew() {
    let mut member = joined(vec![kv("/iop/config", "first", 5, 0)]);
    assert!(
        events(&mut member)
            .iter()
            .any(|e| matches!(e, ClusterEvent::Configure { revision: 5, .. }))
    );
    member.handle_watch_lost(at(300));
    let sync = transmits(&mut member)
        .into_iter()
        .find(|t| matches!(t.request, EtcdRequest::Sync { .. }))
        .expect("the cluster is read again");
    member
        .handle_reply(
            at(320),
            sync.tag,
            Reply::Synced {
                revision: 2,
                kvs: vec![kv("/iop/config", "pushed again", 2, 0)],
            },
        )
        .unwrap();
    assert!(events(&mut member).contains(&ClusterEvent::Configure {
        revision: 2,
        text: b"pushed again".to_vec()
    }));
}

/// A member's own key, once etcd confirmed it, is in the members it reports even before
/// a read or the watch shows it: the list it sends its nodes always names itself.
#[test]
fn a_member_lists_itself_once_its_key_is_written() {
    let config = ClusterConfig::new("e1", "/iop", b"me".to_vec());
    let mut member = ClusterMember::new(config, at(0)).unwrap();
    let sent = transmits(&mut member);
    member
        .handle_reply(
            at(10),
            sent[0].tag,
            Reply::Granted {
                lease: 7,
                ttl: Duration::from_secs(10),
            },
        )
        .unwrap();
    // The read answers first, from before the key was written.
    member
        .handle_reply(
            at(20),
            sent[1].tag,
            Reply::Synced {
                revision: 3,
                kvs: vec![kv("/iop/members/e2", "other", 2, 3)],
            },
        )
        .unwrap();
    let put = transmits(&mut member);
    member
        .handle_reply(at(30), put[0].tag, Reply::Put { revision: 4 })
        .unwrap();
    assert!(member.is_member());
    let last = events(&mut member)
        .into_iter()
        .rev()
        .find_map(|e| match e {
            ClusterEvent::Members(m) => Some(m),
            _ => None,
        })
        .expect("members");
    assert_eq!(
        last.iter().map(|m| m.edge_id.as_str()).collect::<Vec<_>>(),
        ["e1", "e2"]
    );
    assert_eq!(last[0].info, b"me");
    // The watch then shows the key: nothing changes.
    member.handle_watch(
        at(40),
        vec![WatchEvent::Put(KeyValue {
            lease: 7,
            ..kv("/iop/members/e1", "me", 4, 7)
        })],
    );
    assert_eq!(events(&mut member), []);
}

/// Runs `member` from `from` to `to` in steps of a second, renewing its lease whenever it
/// asks; returns every other request it made, with the time it was made.
fn keep_running(member: &mut ClusterMember, from: u64, to: u64) -> Vec<(u64, Transmit)> {
    let mut others = Vec::new();
    let mut now = from;
    while now < to {
        now = (now + 1_000).min(to);
        member.handle_timeout(at(now));
        for transmit in transmits(member) {
            if matches!(transmit.request, EtcdRequest::KeepAlive { .. }) {
                member
                    .handle_reply(
                        at(now),
                        transmit.tag,
                        Reply::KeptAlive {
                            ttl: Duration::from_secs(10),
                        },
                    )
                    .unwrap();
            } else {
                others.push((now, transmit));
            }
        }
    }
    others
}

/// A watch can stall without its connection breaking (a middlebox that drops the stream
/// without a reset): it then delivers nothing and says nothing. The member reads the
/// prefix again every `resync_every`, and what the watch missed arrives with the read.
#[test]
fn a_watch_that_stalled_silently_is_caught_up_by_the_next_read() {
    let mut member = joined(vec![
        kv("/iop/members/e1", "127.0.0.1:7100", 4, 7),
        kv("/iop/config", "first", 5, 0),
    ]);
    let _ = events(&mut member);
    // Meanwhile e2 joined and a configuration was pushed; the watch delivered neither.
    let early = keep_running(&mut member, 100, 30_000);
    assert!(
        early.is_empty(),
        "nothing read before the interval: {early:?}"
    );
    let later = keep_running(&mut member, 30_000, 31_000);
    let [(when, sync)] = later.as_slice() else {
        panic!("one read of the prefix: {later:?}");
    };
    assert_eq!(*when, 31_000, "30 s after the last read answered (t=100ms)");
    assert!(matches!(&sync.request, EtcdRequest::Sync { prefix } if prefix == "/iop/"));
    member
        .handle_reply(
            at(31_010),
            sync.tag,
            Reply::Synced {
                revision: 9,
                kvs: vec![
                    kv("/iop/members/e1", "127.0.0.1:7100", 4, 7),
                    kv("/iop/members/e2", "127.0.0.1:7200", 6, 8),
                    kv("/iop/config", "second", 8, 0),
                ],
            },
        )
        .unwrap();
    let seen = events(&mut member);
    assert!(
        seen.iter()
            .any(|e| matches!(e, ClusterEvent::Members(m) if m.len() == 2)),
        "{seen:?}"
    );
    assert!(
        seen.contains(&ClusterEvent::Configure {
            revision: 8,
            text: b"second".to_vec()
        }),
        "{seen:?}"
    );
    assert!(
        member.is_member(),
        "a read changes nothing about membership"
    );
    // And again 30 s after that one.
    let next = keep_running(&mut member, 31_010, 62_000);
    assert_eq!(
        next.iter()
            .filter(|(_, t)| matches!(t.request, EtcdRequest::Sync { .. }))
            .map(|(when, _)| *when)
            .collect::<Vec<_>>(),
        [61_010],
        "30 s after that read was answered"
    );
}

/// A live watch may deliver past the revision a read saw (the read was served, then more
/// was written and watched, then the read's answer came). That read is older than what
/// the member holds: it changes nothing, and offers no configuration again.
#[test]
fn a_read_older_than_what_the_watch_delivered_changes_nothing() {
    let mut member = joined(vec![kv("/iop/config", "first", 5, 0)]);
    let _ = events(&mut member);
    let later = keep_running(&mut member, 100, 31_000);
    let (_, sync) = later
        .into_iter()
        .find(|(_, t)| matches!(t.request, EtcdRequest::Sync { .. }))
        .expect("the prefix is read again");
    let pushed = kv("/iop/config", "second", 7, 0);
    member.handle_watch(at(31_005), vec![WatchEvent::Put(pushed)]);
    assert_eq!(
        events(&mut member),
        [ClusterEvent::Configure {
            revision: 7,
            text: b"second".to_vec()
        }]
    );
    member
        .handle_reply(
            at(31_010),
            sync.tag,
            Reply::Synced {
                revision: 6,
                kvs: vec![kv("/iop/config", "first", 5, 0)],
            },
        )
        .unwrap();
    assert_eq!(events(&mut member), [], "not the store going back");
    // The shell's new watch starts after the read: what it repeats is skipped, what is
    // new applies.
    member.handle_watch(
        at(31_020),
        vec![
            WatchEvent::Put(kv("/iop/config", "second", 7, 0)),
            WatchEvent::Put(kv("/iop/config", "third", 8, 0)),
        ],
    );
    assert_eq!(
        events(&mut member),
        [ClusterEvent::Configure {
            revision: 8,
            text: b"third".to_vec()
        }]
    );
}

/// A read that fails while the watch runs is tried again soon, without leaving the
/// cluster or dropping what the member holds; until one answers, the view counts as the
/// last seen, not the current one.
#[test]
fn a_failed_check_is_tried_again_soon() {
    let mut member = joined(vec![kv("/iop/config", "first", 5, 0)]);
    let _ = events(&mut member);
    let later = keep_running(&mut member, 100, 31_000);
    let (_, sync) = later
        .into_iter()
        .find(|(_, t)| matches!(t.request, EtcdRequest::Sync { .. }))
        .expect("the prefix is read again");
    assert!(member.is_synced());
    member
        .handle_reply(at(31_000), sync.tag, Reply::Failed)
        .unwrap();
    assert!(member.is_member());
    assert!(!member.is_synced(), "the view is only the last seen now");
    assert_eq!(events(&mut member), []);
    let again = keep_running(&mut member, 31_000, 33_000);
    assert_eq!(
        again
            .iter()
            .filter(|(_, t)| matches!(t.request, EtcdRequest::Sync { .. }))
            .map(|(when, _)| *when)
            .collect::<Vec<_>>(),
        [32_000],
        "retried after retry_after (1 s)"
    );
    let (_, sync) = again
        .into_iter()
        .find(|(_, t)| matches!(t.request, EtcdRequest::Sync { .. }))
        .expect("read again");
    member
        .handle_reply(
            at(33_010),
            sync.tag,
            Reply::Synced {
                revision: 5,
                kvs: vec![kv("/iop/config", "first", 5, 0)],
            },
        )
        .unwrap();
    assert!(member.is_synced());
    assert_eq!(
        events(&mut member),
        [],
        "nothing new: nothing offered again"
    );
}

#[test]
fn misuse_is_a_typed_error() {
    let config = ClusterConfig::new("a/b", "/iop", vec![]);
    assert!(matches!(
        ClusterMember::new(config, at(0)),
        Err(ClusterConfigError::EdgeId(_))
    ));
    let mut config = ClusterConfig::new("e1", "/iop", vec![]);
    config.keepalive_every = Duration::from_secs(5);
    assert!(matches!(
        ClusterMember::new(config, at(0)),
        Err(ClusterConfigError::KeepAlive { .. })
    ));
    let mut config = ClusterConfig::new("e1", "/iop", vec![]);
    config.resync_every = Duration::ZERO;
    assert!(matches!(
        ClusterMember::new(config, at(0)),
        Err(ClusterConfigError::ResyncEvery)
    ));
    let mut member = joined(vec![]);
    assert_eq!(
        member.handle_reply(at(200), Tag(999), Reply::Failed),
        Err(ClusterUsageError::UnknownTag(Tag(999)))
    );
    assert!(matches!(
        member.claim_node(at(200), "x/y", 1),
        Err(ClusterUsageError::NodeId(_))
    ));
    // Not a member: no claim goes to etcd.
    let config = ClusterConfig::new("e2", "/iop", vec![]);
    let mut fresh = ClusterMember::new(config, at(0)).unwrap();
    let _ = transmits(&mut fresh);
    let ticket = fresh.claim_node(at(10), "n1", 1).unwrap();
    assert!(transmits(&mut fresh).is_empty());
    assert_eq!(
        events(&mut fresh),
        [ClusterEvent::Claim {
            ticket,
            decision: ClaimDecision::Unavailable
        }]
    );
}

mod member_links {
    use std::collections::BTreeMap;

    use iop_proto_core::cluster::{HeardMembers, LinkEvent, MemberLinks};
    use iop_proto_core::wire::{ClusterEdge, ClusterMembers};
    use proptest::prelude::*;

    fn members(from: &str, list: &[(&str, &str)]) -> ClusterMembers {
        ClusterMembers {
            edge_id: from.into(),
            members: list
                .iter()
                .map(|(id, addr)| ClusterEdge {
                    edge_id: (*id).into(),
                    node_addr: (*addr).into(),
                })
                .collect(),
        }
    }

    fn events(links: &mut MemberLinks) -> Vec<LinkEvent> {
        std::iter::from_fn(|| links.poll_event()).collect()
    }

    fn dial(id: &str, addr: &str) -> LinkEvent {
        LinkEvent::Dial {
            edge_id: id.into(),
            addr: addr.into(),
        }
    }

    #[test]
    fn a_node_links_every_member_but_the_edge_it_was_configured_with() {
        let mut links = MemberLinks::default();
        let all = [("a", "a:7100"), ("b", "b:7100"), ("c", "c:7100")];
        links.handle_members(true, &members("a", &all));
        assert_eq!(
            events(&mut links),
            [dial("b", "b:7100"), dial("c", "c:7100")]
        );
        // The same list from another session changes nothing.
        links.handle_members(false, &members("b", &all));
        assert!(events(&mut links).is_empty());
        // c leaves, d joins, b moves.
        links.handle_members(
            false,
            &members("b", &[("a", "a:7100"), ("b", "b2:7100"), ("d", "d:7100")]),
        );
        assert_eq!(
            events(&mut links),
            [
                LinkEvent::Leave {
                    edge_id: "b".into()
                },
                LinkEvent::Leave {
                    edge_id: "c".into()
                },
                dial("b", "b2:7100"),
                dial("d", "d:7100"),
            ]
        );
    }

    #[test]
    fn an_address_that_cannot_be_dialled_is_left_out() {
        let mut links = MemberLinks::default();
        let long = format!("{}:1", "h".repeat(300));
        links.handle_members(
            true,
            &members(
                "a",
                &[
                    ("a", "a:7100"),
                    ("b", "no-port"),
                    ("c", "c:0"),
                    ("d", "d: 1"),
                    ("e", &long),
                    ("f", "f:9"),
                ],
            ),
        );
        assert_eq!(events(&mut links), [dial("f", "f:9")]);
    }

    /// The links `MemberLinks` keeps after taking `lists` in order.
    fn links_after(lists: &[(bool, ClusterMembers)]) -> BTreeMap<String, String> {
        let mut plan = MemberLinks::default();
        let mut links = BTreeMap::new();
        for (from_seed, members) in lists {
            plan.handle_members(*from_seed, members);
            for event in events(&mut plan) {
                match event {
                    LinkEvent::Dial { edge_id, addr } => {
                        links.insert(edge_id, addr);
                    }
                    LinkEvent::Leave { edge_id } => {
                        links.remove(&edge_id);
                    }
                }
            }
        }
        links
    }

    fn list(sender: u8, members: &[(u8, u8)]) -> ClusterMembers {
        ClusterMembers {
            edge_id: format!("e{sender}"),
            members: members
                .iter()
                .map(|(id, port)| ClusterEdge {
                    edge_id: format!("e{id}"),
                    node_addr: format!("127.0.0.1:{}", 7100 + u16::from(*port)),
                })
                .collect(),
        }
    }

    proptest! {
        /// However lists arrive and whenever the follower takes them, it ends with the
        /// links it would have had taking every list one by one, and never more than two
        /// wait.
        #[test]
        fn coalesced_lists_leave_the_same_links(
            steps in proptest::collection::vec(
                (any::<bool>(), 0u8..4, proptest::collection::vec((0u8..4, 0u8..2), 0..4), any::<bool>()),
                1..40,
            ),
        ) {
            let mut heard = HeardMembers::default();
            let mut every = Vec::new();
            let mut taken = Vec::new();
            for (from_seed, sender, members, take_now) in steps {
                let members = list(sender, &members);
                every.push((from_seed, members.clone()));
                heard.handle_members(from_seed, members);
                prop_assert!(!heard.is_empty());
                if take_now {
                    let lists = heard.take();
                    prop_assert!(!lists.is_empty() && lists.len() <= 2);
                    prop_assert!(heard.is_empty());
                    taken.extend(lists);
                }
            }
            let rest = heard.take();
            prop_assert!(rest.len() <= 2);
            taken.extend(rest);
            prop_assert_eq!(links_after(&taken), links_after(&every));
        }
    }
}
