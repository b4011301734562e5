//! Unit tests of `reconnect`.

use super::*;

fn limited(n: u32) -> MaxAttempts {
    MaxAttempts::Limited(NonZeroU32::new(n).expect("non-zero"))
}

#[test]
fn omitted_values_take_the_contract_defaults() {
    let policy = ReconnectPolicy::from_config(None, None).expect("valid");
    assert_eq!(policy.max_attempts, limited(10));
    assert_eq!(policy.interval, Duration::from_secs(10));
}

#[test]
fn zero_attempts_means_unlimited() {
    let policy = ReconnectPolicy::from_config(Some(0), None).expect("valid");
    assert_eq!(policy.max_attempts, MaxAttempts::Unlimited);
    assert_eq!(policy.interval, Duration::from_secs(10));
    let policy = ReconnectPolicy::from_config(Some(0), Some(0.25)).expect("valid");
    assert_eq!(policy.interval, Duration::from_millis(250));
}

#[test]
fn positive_attempts_are_exact() {
    let policy = ReconnectPolicy::from_config(Some(3), Some(1.0)).expect("valid");
    assert_eq!(policy.max_attempts, limited(3));
    // A zero interval is allowed when the attempts are finite.
    assert!(ReconnectPolicy::from_config(Some(3), Some(0.0)).is_ok());
}

#[test]
fn negative_attempts_are_rejected() {
    assert_eq!(
        ReconnectPolicy::from_config(Some(-1), None),
        Err(ReconnectConfigError::NegativeMaxAttempts(-1))
    );
    assert_eq!(
        ReconnectPolicy::from_config(Some(i64::from(u32::MAX) + 1), None),
        Err(ReconnectConfigError::MaxAttemptsTooLarge(
            i64::from(u32::MAX) + 1
        ))
    );
}

#[test]
fn unlimited_needs_a_positive_interval() {
    assert_eq!(
        ReconnectPolicy::from_config(Some(0), Some(0.0)),
        Err(ReconnectConfigError::UnlimitedNeedsPositiveInterval)
    );
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        assert!(matches!(
            ReconnectPolicy::from_config(Some(0), Some(bad)),
            Err(ReconnectConfigError::InvalidInterval(_))
        ));
    }
}

fn policy(max: i64, interval: f64) -> ReconnectPolicy {
    ReconnectPolicy::from_config(Some(max), Some(interval)).expect("valid")
}

fn drain(s: &mut Supervisor) -> Vec<SupervisorEvent> {
    std::iter::from_fn(|| s.poll_event()).collect()
}

#[test]
fn finite_policy_makes_exactly_max_attempts_then_exits_1() {
    let mut s = Supervisor::new(policy(3, 2.0));
    s.handle_start(Timestamp::ZERO).expect("idle");
    assert_eq!(drain(&mut s), vec![SupervisorEvent::Dial { attempt: 1 }]);
    s.handle_failure(Timestamp::ZERO, Failure::Refused)
        .expect("dialing");
    assert_eq!(
        s.poll_timeout().map(|w| w.at),
        Some(Timestamp::from_millis(2000))
    );
    s.handle_timeout(Timestamp::from_millis(1999));
    assert!(drain(&mut s).is_empty(), "not before the interval");
    s.handle_timeout(Timestamp::from_millis(2000));
    assert_eq!(drain(&mut s), vec![SupervisorEvent::Dial { attempt: 2 }]);
    s.handle_failure(Timestamp::from_millis(2000), Failure::Reset)
        .expect("dialing");
    s.handle_timeout(Timestamp::from_millis(4000));
    assert_eq!(drain(&mut s), vec![SupervisorEvent::Dial { attempt: 3 }]);
    s.handle_failure(Timestamp::from_millis(4000), Failure::TimedOut)
        .expect("dialing");
    let actions = drain(&mut s);
    let [SupervisorEvent::Exit(reason)] = actions.as_slice() else {
        panic!("{actions:?}");
    };
    assert_eq!(
        reason,
        &ExitReason::Exhausted {
            attempts: 3,
            last: Failure::TimedOut
        }
    );
    assert_eq!(reason.exit_code(), 1);
    assert_eq!(s.poll_timeout(), None);
}

#[test]
fn fatal_failures_exit_without_retrying() {
    for failure in [
        Failure::CredentialRejected("invalid token".into()),
        Failure::LocalConfig("bad address".into()),
    ] {
        let mut s = Supervisor::new(policy(0, 1.0));
        s.handle_start(Timestamp::ZERO).expect("idle");
        s.handle_connected(Timestamp::ZERO).expect("dialing");
        drain(&mut s);
        s.handle_failure(Timestamp::ZERO, failure.clone())
            .expect("connected");
        assert_eq!(
            drain(&mut s),
            vec![SupervisorEvent::Exit(ExitReason::Fatal(failure))]
        );
        assert_eq!(s.state(), SupervisorState::Exited);
    }
}

/// A cluster member refusing the node's credentials, or the configured Edge while
/// other sessions serve, is dialled again later each time, beyond any attempt limit;
/// the configured Edge alone, with nothing else live, ends the node.
#[test]
fn a_credential_refusal_ends_the_node_only_from_its_configured_edge_alone() {
    let rejected = Failure::CredentialRejected("authentication failed".into());
    let refuse = |s: &mut Supervisor, at: Timestamp| {
        s.handle_connected(at).expect("dialing");
        s.handle_failure(at, rejected.clone()).expect("connected");
    };
    // A member: waits of 5, 10, 20, 40, 60, 60 s, never an exit.
    let mut member = Supervisor::new(policy(2, 1.0)).for_member();
    member.handle_start(Timestamp::ZERO).expect("idle");
    let mut at = Timestamp::ZERO;
    for wait in [5, 10, 20, 40, 60, 60] {
        drain(&mut member);
        refuse(&mut member, at);
        assert_eq!(
            member.state(),
            SupervisorState::Waiting {
                until: at + Duration::from_secs(wait)
            }
        );
        assert!(drain(&mut member).is_empty());
        at = at + Duration::from_secs(wait);
        member.handle_timeout(at);
        assert!(matches!(
            drain(&mut member)[..],
            [SupervisorEvent::Dial { .. }]
        ));
    }
    // A ready session starts the waits over.
    member.handle_connected(at).expect("dialing");
    member.handle_ready(at).expect("connected");
    member.handle_failure(at, rejected.clone()).expect("ready");
    assert_eq!(
        member.state(),
        SupervisorState::Waiting {
            until: at + REJECTED_RETRY
        }
    );
    // The configured Edge, with another session live: retried; alone: the end.
    let mut seed = Supervisor::new(policy(2, 1.0));
    seed.handle_start(Timestamp::ZERO).expect("idle");
    drain(&mut seed);
    seed.handle_backing(Timestamp::ZERO, true);
    refuse(&mut seed, Timestamp::ZERO);
    assert!(matches!(seed.state(), SupervisorState::Waiting { .. }));
    seed.handle_timeout(Timestamp::ZERO + REJECTED_RETRY);
    drain(&mut seed);
    seed.handle_backing(Timestamp::ZERO + REJECTED_RETRY, false);
    refuse(&mut seed, Timestamp::ZERO + REJECTED_RETRY);
    assert_eq!(
        drain(&mut seed),
        vec![SupervisorEvent::Exit(ExitReason::Fatal(rejected))]
    );
}

#[test]
fn ready_resets_the_attempt_count_and_reconnects_use_the_same_policy() {
    let mut s = Supervisor::new(policy(2, 1.0));
    s.handle_start(Timestamp::ZERO).expect("idle");
    s.handle_failure(Timestamp::ZERO, Failure::Refused)
        .expect("dialing");
    s.handle_timeout(Timestamp::from_millis(1000));
    s.handle_connected(Timestamp::from_millis(1000))
        .expect("dialing");
    s.handle_ready(Timestamp::from_millis(1000))
        .expect("connected");
    assert_eq!(s.attempts(), 0);
    drain(&mut s);
    // The established session drops: two more attempts are allowed, not zero.
    s.handle_failure(
        Timestamp::from_millis(5000),
        Failure::EdgeClosed("restart".into()),
    )
    .expect("connected");
    s.handle_timeout(Timestamp::from_millis(6000));
    assert_eq!(drain(&mut s), vec![SupervisorEvent::Dial { attempt: 1 }]);
    s.handle_failure(Timestamp::from_millis(6000), Failure::Refused)
        .expect("dialing");
    s.handle_timeout(Timestamp::from_millis(7000));
    assert_eq!(drain(&mut s), vec![SupervisorEvent::Dial { attempt: 2 }]);
    s.handle_failure(Timestamp::from_millis(7000), Failure::Refused)
        .expect("dialing");
    assert!(matches!(
        drain(&mut s).as_slice(),
        [SupervisorEvent::Exit(ExitReason::Exhausted {
            attempts: 2,
            ..
        })]
    ));
}

#[test]
fn a_stop_during_a_session_exits_once_it_ends_whatever_ended_it() {
    let t = Timestamp::from_millis;
    // Asked for while connected: the session winds down first, then the process
    // exits 0, even though the session ended in a retryable failure.
    let mut s = Supervisor::new(policy(0, 1.0));
    s.handle_start(t(0)).expect("idle");
    s.handle_connected(t(0)).expect("dialing");
    s.handle_ready(t(0)).expect("connected");
    drain(&mut s);
    s.handle_stop(t(10));
    assert_eq!(s.state(), SupervisorState::Connected { ready: true });
    assert!(
        drain(&mut s).is_empty(),
        "nothing happens before the session ends"
    );
    s.handle_failure(t(20), Failure::Reset).expect("connected");
    assert_eq!(
        drain(&mut s),
        vec![SupervisorEvent::Exit(ExitReason::Shutdown)]
    );
    assert_eq!(s.poll_timeout(), None, "no redial");
    // With no session open (waiting to redial), it exits at once.
    let mut s = Supervisor::new(policy(0, 1.0));
    s.handle_start(t(0)).expect("idle");
    s.handle_failure(t(0), Failure::Refused).expect("dialing");
    drain(&mut s);
    s.handle_stop(t(5));
    assert_eq!(
        drain(&mut s),
        vec![SupervisorEvent::Exit(ExitReason::Shutdown)]
    );
    assert_eq!(s.state(), SupervisorState::Exited);
}

#[test]
fn unlimited_policy_retries_until_shutdown_which_exits_0() {
    let mut s = Supervisor::new(policy(0, 1.0));
    s.handle_start(Timestamp::ZERO).expect("idle");
    let mut now = 0;
    for _ in 0..1000 {
        s.handle_failure(Timestamp::from_millis(now), Failure::Refused)
            .expect("dialing");
        now += 1000;
        s.handle_timeout(Timestamp::from_millis(now));
    }
    assert_eq!(s.attempts(), 1001);
    s.handle_shutdown(Timestamp::from_millis(now));
    let actions = drain(&mut s);
    assert_eq!(
        actions.last(),
        Some(&SupervisorEvent::Exit(ExitReason::Shutdown))
    );
    assert_eq!(ExitReason::Shutdown.exit_code(), 0);
}

#[test]
fn a_deferred_rejection_waits_at_least_as_long_as_the_edge_asked() {
    let mut s = Supervisor::new(policy(0, 1.0));
    s.handle_start(Timestamp::ZERO).expect("idle");
    let deferred = |ms| Failure::Deferred {
        reason: "authentication failed".into(),
        retry_after: Duration::from_millis(ms),
    };
    s.handle_failure(Timestamp::ZERO, deferred(7000))
        .expect("dialing");
    assert_eq!(
        s.poll_timeout().map(|w| w.at),
        Some(Timestamp::from_millis(7000))
    );
    s.handle_timeout(Timestamp::from_millis(7000));
    s.handle_failure(Timestamp::from_millis(7000), deferred(10))
        .expect("dialing");
    assert_eq!(
        s.poll_timeout().map(|w| w.at),
        Some(Timestamp::from_millis(8000)),
        "never sooner than the policy's interval"
    );
    assert!(!deferred(1).is_fatal());
    assert!(!Failure::Tls("unknown issuer".into()).is_fatal());
}

#[test]
fn misuse_is_a_usage_error() {
    let mut s = Supervisor::new(ReconnectPolicy::default());
    assert!(s.handle_ready(Timestamp::ZERO).is_err());
    assert!(s.handle_failure(Timestamp::ZERO, Failure::Refused).is_err());
    s.handle_start(Timestamp::ZERO).expect("idle");
    assert!(s.handle_start(Timestamp::ZERO).is_err());
}

#[test]
fn jitter_spreads_a_fleet_below_the_interval_and_replays_from_its_seed() {
    // A fleet that lost the same Edge at the same instant: where does each redial?
    let first_redial = |jitter: f64, seed: u64| {
        let mut s = Supervisor::with_jitter(policy(0, 1.0), jitter, seed);
        s.handle_start(Timestamp::ZERO).expect("idle");
        s.handle_connected(Timestamp::ZERO).expect("dialing");
        s.handle_ready(Timestamp::ZERO).expect("connected");
        s.handle_failure(Timestamp::ZERO, Failure::Reset)
            .expect("ready");
        s.poll_timeout().expect("waiting").at.as_millis()
    };
    let fleet: Vec<u64> = (0..1000).map(|seed| first_redial(0.5, seed)).collect();
    assert!(
        fleet.iter().all(|ms| (500..=1000).contains(ms)),
        "{fleet:?}"
    );
    // Spread over the window: no 10 ms slot holds more than 5% of the fleet.
    let mut slots = [0u32; 51];
    for ms in &fleet {
        slots[((ms - 500) / 10) as usize] += 1;
    }
    assert!(slots.iter().all(|n| *n <= 50), "{slots:?}");
    assert_eq!(first_redial(0.5, 9), first_redial(0.5, 9), "a seed replays");
    assert_eq!(first_redial(0.0, 9), 1000, "no jitter: the exact interval");
    assert_eq!(first_redial(f64::NAN, 9), 1000, "nonsense jitter is none");
    assert!(first_redial(7.0, 9) <= 1000, "clamped to the interval");
}

#[test]
fn backoff_grows_is_capped_jittered_and_replays_from_its_seed() {
    let backoff = Backoff {
        base: Duration::from_millis(100),
        max: Duration::from_millis(1000),
        jitter: 0.5,
        seed: 42,
    };
    let delays = |seed: u64| {
        let mut s = Supervisor::with_backoff(policy(0, 1.0), Backoff { seed, ..backoff });
        s.handle_start(Timestamp::ZERO).expect("idle");
        let mut now = Timestamp::ZERO;
        let mut out = Vec::new();
        for _ in 0..8 {
            s.handle_failure(now, Failure::Refused).expect("dialing");
            let until = s.poll_timeout().expect("waiting").at;
            out.push(until.saturating_duration_since(now).as_millis() as u64);
            now = until;
            s.handle_timeout(now);
        }
        out
    };
    let a = delays(42);
    assert_eq!(a, delays(42), "same seed, same delays");
    assert_ne!(a, delays(7));
    for (i, d) in a.iter().enumerate() {
        let full = (100u64 << i).min(1000);
        assert!(
            *d <= full && *d >= full / 2,
            "attempt {i}: {d} not in [{}, {full}]",
            full / 2
        );
    }
}
