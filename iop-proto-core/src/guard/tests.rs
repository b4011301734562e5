//! Unit tests of `guard`.

use super::*;

fn at(ms: u64) -> Timestamp {
    Timestamp::from_millis(ms)
}

const A: Source = Source::V4([10, 0, 0, 1]);

const B: Source = Source::V4([10, 0, 0, 2]);

#[test]
fn five_failures_are_answered_at_once_then_one_per_interval() {
    let mut t = AuthThrottle::new(ThrottleLimits::default());
    for i in 1..=5 {
        let r = t.record_failure(at(0), A, "n1");
        assert_eq!(
            (r.hold, r.by, r.retry_after),
            (Duration::ZERO, None, Duration::ZERO),
            "failure {i}"
        );
    }
    // A guesser that waits for each answer gets one per second.
    let mut now = 0;
    for _ in 0..20 {
        let r = t.record_failure(at(now), A, "n1");
        assert_eq!(r.hold, Duration::from_secs(1));
        assert_eq!(r.retry_after, Duration::from_secs(1));
        assert!(r.by.is_some());
        now += 1000;
    }
    // Concurrent guesses queue up behind each other, up to the longest hold.
    let holds: Vec<u64> = (0..40)
        .map(|_| t.record_failure(at(now), A, "n1").hold.as_secs())
        .collect();
    assert_eq!(&holds[..3], &[1, 2, 3]);
    assert_eq!(holds.iter().max(), Some(&30));
}

#[test]
fn the_id_and_the_source_are_budgeted_apart() {
    let mut t = AuthThrottle::new(ThrottleLimits::default());
    for _ in 0..5 {
        t.record_failure(at(0), A, "n1");
    }
    // The same id from elsewhere: the id's budget holds it.
    let r = t.record_failure(at(0), B, "n1");
    assert_eq!(r.by, Some(ThrottledBy::Node));
    // Other ids from the first address: the address's budget holds them.
    let r = t.record_failure(at(0), A, "unknown-1");
    assert_eq!(r.by, Some(ThrottledBy::Source));
    // Another id from another address is untouched.
    assert_eq!(t.record_failure(at(0), B, "n2").hold, Duration::ZERO);
}

#[test]
fn a_right_token_ends_its_ids_throttle_but_not_its_sources() {
    let mut t = AuthThrottle::new(ThrottleLimits::default());
    for _ in 0..10 {
        t.record_failure(at(0), A, "n1");
    }
    t.record_success("n1");
    assert!(t.failing_nodes(at(0), 10).is_empty());
    let r = t.record_failure(at(0), A, "n1");
    assert_eq!(r.node_failures, 1, "the id starts afresh");
    assert_eq!(r.by, Some(ThrottledBy::Source), "the address still owes");
}

#[test]
fn the_budget_refills_with_time() {
    let mut t = AuthThrottle::new(ThrottleLimits::default());
    for _ in 0..8 {
        t.record_failure(at(0), A, "n1");
    }
    assert!(t.record_failure(at(0), A, "n1").hold > Duration::ZERO);
    // Ten quiet seconds pay back what was owed and refill the burst.
    for _ in 0..5 {
        assert_eq!(t.record_failure(at(10_000), A, "n1").hold, Duration::ZERO);
    }
    // A quiet window forgets the count.
    assert_eq!(t.record_failure(at(80_000), A, "n1").node_failures, 1);
}

#[test]
fn log_lines_grow_logarithmically_with_the_failures() {
    for ids in [1, 200] {
        let mut t = AuthThrottle::new(ThrottleLimits::default());
        let logged = (0..200u64)
            .filter(|&i| {
                let id = format!("n{}", i % ids);
                t.record_failure(at(i * 100), A, &id).log
            })
            .count();
        // 1, 2, 4, 6 (answers start to wait), 8, 16, 32, 64, 128.
        assert_eq!(logged, 9, "{ids} ids");
    }
}

#[test]
fn the_tables_stay_bounded() {
    let limits = ThrottleLimits {
        max_tracked: 16,
        ..ThrottleLimits::default()
    };
    let mut t = AuthThrottle::new(limits);
    for i in 0..1000u32 {
        t.record_failure(
            at(u64::from(i)),
            Source::V4(i.to_be_bytes()),
            &i.to_string(),
        );
        assert!(t.tracked() <= 32);
    }
}

#[test]
fn sources_print_as_an_operator_reads_them() {
    assert_eq!(A.to_string(), "10.0.0.1");
    let v6: IpAddr = "2001:db8:1:2::9".parse().expect("v6");
    assert_eq!(Source::of(Some(v6)).to_string(), "2001:db8:1:2::/64");
    assert_eq!(Source::Unknown.to_string(), "unknown");
}

#[test]
fn pending_connections_are_capped_in_all_and_per_source() {
    let limits = PendingLimits {
        max_total: 3,
        max_per_source: 2,
    };
    let b = Source::V4([10, 0, 0, 2]);
    let mut p = PendingConnections::default();
    assert!(p.admit(A, limits) && p.admit(A, limits));
    assert!(!p.admit(A, limits), "per source");
    assert!(p.admit(b, limits));
    assert!(!p.admit(Source::Unknown, limits), "in all");
    p.release(A);
    assert!(p.admit(A, limits));
    for _ in 0..5 {
        p.release(b);
    }
    assert_eq!(p.total(), 2, "releasing more than admitted changes nothing");
}

#[test]
fn ipv6_hosts_count_by_prefix() {
    let a: IpAddr = "2001:db8:1:2::1".parse().expect("v6");
    let b: IpAddr = "2001:db8:1:2:ffff::9".parse().expect("v6");
    let c: IpAddr = "2001:db8:1:3::1".parse().expect("v6");
    let mapped: IpAddr = "::ffff:10.0.0.1".parse().expect("mapped");
    assert_eq!(Source::of(Some(a)), Source::of(Some(b)));
    assert_ne!(Source::of(Some(a)), Source::of(Some(c)));
    assert_eq!(Source::of(Some(mapped)), A);
}

fn process(n: u64) -> Instance {
    std::num::NonZeroU64::new(n)
}

/// `newcomer` takes the id from `holder`, which is live.
fn live(newcomer: u64, holder: u64) -> Claim {
    Claim {
        newcomer: process(newcomer),
        holder: process(holder),
        rival: Rival::Live,
    }
}

#[test]
fn two_processes_taking_the_id_back_make_a_conflict_that_refused_newcomers_renew() {
    let limits = ConflictLimits::default();
    let mut g = FlapGuard::default();
    // A (1) takes it from B (2) at 0 s; B's take-back at 40 s is outside the window,
    // so it proves nothing yet.
    assert_eq!(g.contest(at(0), limits, live(1, 2)), Contest::Supersede);
    assert_eq!(
        g.contest(at(40_000), limits, live(2, 1)),
        Contest::Supersede
    );
    // A takes it back within the window: that proves its own hand-over and the one
    // at 40 s. B's next take-back is the third proven one.
    assert_eq!(
        g.contest(at(41_000), limits, live(1, 2)),
        Contest::Supersede
    );
    assert_eq!(
        g.contest(at(42_000), limits, live(2, 1)),
        Contest::SupersedeAndHold
    );
    assert!(g.in_conflict(at(42_001)));
    let Contest::HoldOff { retry_after, log } = g.contest(at(90_000), limits, live(2, 1)) else {
        panic!("held off");
    };
    assert!(retry_after < limits.hold_down);
    assert!(log, "the first refusal is logged");
    // The refused newcomer renewed the hold: still a conflict past the first hold-down.
    assert!(g.in_conflict(at(120_000)));
    // The holder's own process reconnecting is never held off.
    assert_eq!(
        g.contest(at(120_000), limits, live(1, 1)),
        Contest::Supersede
    );
    assert!(!g.in_conflict(at(150_000)));
    assert_eq!(
        g.contest(at(150_000), limits, live(2, 1)),
        Contest::Supersede
    );
}

#[test]
fn restarts_never_make_a_conflict_however_fast_they_overlap() {
    let limits = ConflictLimits::default();
    let mut g = FlapGuard::default();
    // Each restart is a new process taking the id from the live (draining) old one.
    for n in 1..50u64 {
        assert_eq!(
            g.contest(at(n * 10), limits, live(n + 1, n)),
            Contest::Supersede,
            "restart {n}"
        );
    }
    assert!(!g.in_conflict(at(500)));
}

#[test]
fn one_process_reconnecting_never_makes_a_conflict() {
    let limits = ConflictLimits::default();
    let mut g = FlapGuard::default();
    for t in 0..20 {
        assert_eq!(
            g.contest(at(t * 10), limits, live(7, 7)),
            Contest::Supersede
        );
        let silent = Claim {
            rival: Rival::Silent,
            ..live(7, 7)
        };
        assert_eq!(
            g.contest(at(t * 10 + 5), limits, silent),
            Contest::Supersede
        );
    }
    assert!(!g.in_conflict(at(200)));
}

#[test]
fn nodes_without_an_instance_id_are_judged_by_liveness_alone() {
    let limits = ConflictLimits::default();
    let mut g = FlapGuard::default();
    let old = |rival| Claim {
        newcomer: None,
        holder: None,
        rival,
    };
    for t in 0..10 {
        assert_eq!(
            g.contest(at(t * 100), limits, old(Rival::Silent)),
            Contest::Supersede
        );
    }
    assert!(!g.in_conflict(at(1_000)));
    // Three live supersedes: a conflict, as before instance ids.
    assert_eq!(
        g.contest(at(1_100), limits, old(Rival::Live)),
        Contest::Supersede
    );
    assert_eq!(
        g.contest(at(1_200), limits, old(Rival::Silent)),
        Contest::Supersede
    );
    assert_eq!(
        g.contest(at(1_300), limits, old(Rival::Live)),
        Contest::Supersede
    );
    assert_eq!(
        g.contest(at(1_400), limits, old(Rival::Live)),
        Contest::SupersedeAndHold
    );
    // Once in conflict, a newcomer is held off whatever the owner's state.
    assert!(matches!(
        g.contest(at(1_500), limits, old(Rival::Silent)),
        Contest::HoldOff { .. }
    ));
}

#[test]
fn a_take_back_over_a_silent_holder_counts_nothing() {
    let limits = ConflictLimits::default();
    let mut g = FlapGuard::default();
    let silent = |newcomer, holder| Claim {
        rival: Rival::Silent,
        ..live(newcomer, holder)
    };
    for t in 0..10 {
        let (a, b) = if t % 2 == 0 { (1, 2) } else { (2, 1) };
        assert_eq!(
            g.contest(at(t * 100), limits, silent(a, b)),
            Contest::Supersede
        );
    }
    assert!(!g.in_conflict(at(1_000)));
}
