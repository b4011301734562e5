//! Unit tests of `tenant`.

use super::*;

const T0: u64 = 1_796_000_000_000; // 2026-11-30T...Z

fn at(ms: u64) -> Timestamp {
    Timestamp::from_millis(T0 + ms)
}

fn team() -> Arc<str> {
    Arc::from("team")
}

fn tenants(policy: KeyPolicy) -> Tenants {
    Tenants::new(
        [(Arc::from("team"), policy)],
        [Arc::from("chat"), Arc::from("embed")],
    )
}

#[test]
fn the_calendar_is_right_at_its_edges() {
    assert_eq!(civil_from_days(0), (1970, 1, 1));
    assert_eq!(civil_day(20_454), "2026-01-01");
    assert_eq!(days_from_civil(2024, 2, 29), 19_782);
    assert_eq!(civil_from_days(19_782), (2024, 2, 29));
    for day in (0..40_000).step_by(7) {
        let (y, m, d) = civil_from_days(day);
        assert_eq!(days_from_civil(y, m, d), day);
    }
    // December rolls into January.
    let dec31 = days_from_civil(2026, 12, 31) * DAY_MS + 5;
    assert_eq!(
        period_end(Period::Month, dec31),
        days_from_civil(2027, 1, 1) * DAY_MS
    );
    assert_eq!(
        period_end(Period::Day, dec31),
        days_from_civil(2027, 1, 1) * DAY_MS
    );
}

#[test]
fn twice_the_rate_in_a_minute_gets_the_rate_answered() {
    let mut t = tenants(KeyPolicy {
        requests_per_minute: Some(60),
        ..KeyPolicy::default()
    });
    let mut answered = 0;
    let mut refused = Vec::new();
    for i in 0..120u64 {
        match t.handle_admit(at(i * 495), &team(), "chat", 10) {
            Ok(a) => {
                answered += 1;
                t.handle_finish(at(i * 495 + 1), a, None);
            }
            Err(limited) => refused.push(limited),
        }
    }
    assert_eq!(answered, 60);
    assert!(refused.iter().all(|l| {
        l.refusal == Refusal::Requests
            && l.limits.requests.map(|q| q.remaining) == Some(0)
            && l.retry_after
                .is_some_and(|d| d > Duration::ZERO && d <= WINDOW)
    }));
    // The oldest second leaves: one more fits.
    assert!(t.handle_admit(at(60_000), &team(), "chat", 10).is_ok());
}

#[test]
fn tokens_are_estimated_then_set_right_and_the_budget_stops_the_key() {
    let mut t = tenants(KeyPolicy {
        tokens_per_minute: Some(1000),
        budget: Some(Budget {
            tokens: 1500,
            period: Period::Day,
        }),
        ..KeyPolicy::default()
    });
    let a = t.handle_admit(at(0), &team(), "chat", 900).expect("fits");
    assert_eq!(a.limits.tokens.map(|q| q.remaining), Some(100));
    // Estimated 900 in the minute: 200 more do not fit.
    let refused = t
        .handle_admit(at(10), &team(), "chat", 200)
        .expect_err("full");
    assert_eq!(refused.refusal, Refusal::Tokens);
    // It used 300: the minute has room again.
    t.handle_finish(
        at(20),
        a,
        Some(TokenUsage {
            prompt: 100,
            completion: 200,
        }),
    );
    let b = t
        .handle_admit(at(30), &team(), "chat", 200)
        .expect("fits now");
    t.handle_finish(
        at(40),
        b,
        Some(TokenUsage {
            prompt: 1000,
            completion: 300,
        }),
    );
    // 1,600 of 1,500 spent today: refused until midnight UTC.
    let spent = t
        .handle_admit(at(120_000), &team(), "chat", 1)
        .expect_err("spent");
    assert_eq!(spent.refusal, Refusal::Budget);
    let report = t.report(at(120_000));
    let budget = report[0].budget.expect("has one");
    assert_eq!((budget.spent, budget.remaining), (1600, 0));
    let midnight = (T0 / DAY_MS + 1) * DAY_MS - T0;
    assert_eq!(
        spent.retry_after,
        Some(Duration::from_millis(midnight - 120_000))
    );
    assert!(t.handle_admit(at(midnight), &team(), "chat", 1).is_ok());
    let usage = t.usage();
    assert_eq!(usage.len(), 1);
    assert_eq!(
        usage[0].counts,
        Counts {
            requests: 2,
            prompt_tokens: 1100,
            completion_tokens: 500
        }
    );
}

#[test]
fn models_and_requests_at_once_are_limited() {
    let mut t = tenants(KeyPolicy {
        models: Some(vec![Arc::from("chat")]),
        max_concurrent: Some(2),
        ..KeyPolicy::default()
    });
    assert_eq!(
        t.handle_admit(at(0), &team(), "embed", 1)
            .map(|_| ())
            .map_err(|l| l.refusal),
        Err(Refusal::Model)
    );
    assert!(!t.may_use("team", "embed") && t.may_use("team", "chat"));
    let a = t.handle_admit(at(0), &team(), "chat", 1).expect("one");
    let _b = t.handle_admit(at(0), &team(), "chat", 1).expect("two");
    assert_eq!(
        t.handle_admit(at(0), &team(), "chat", 1)
            .map_err(|l| l.refusal)
            .map(|_| ()),
        Err(Refusal::Concurrency)
    );
    t.handle_finish(at(1), a, None);
    assert!(t.handle_admit(at(2), &team(), "chat", 1).is_ok());
    // A key the configuration does not name is not limited.
    assert!(
        t.handle_admit(at(2), &Arc::from("api_keys[0]"), "embed", 1)
            .is_ok()
    );
}

#[test]
fn windows_budgets_and_usage_survive_a_restart() {
    let policy = KeyPolicy {
        requests_per_minute: Some(3),
        budget: Some(Budget {
            tokens: 100,
            period: Period::Month,
        }),
        ..KeyPolicy::default()
    };
    let mut t = tenants(policy.clone());
    for i in 0..3 {
        let a = t.handle_admit(at(i), &team(), "chat", 1).expect("fits");
        t.handle_finish(
            at(i),
            a,
            Some(TokenUsage {
                prompt: 10,
                completion: 10,
            }),
        );
    }
    let saved = serde_json::to_string(&t.export()).expect("json");
    let mut restarted = tenants(policy);
    assert!(restarted.restore(at(5_000), serde_json::from_str(&saved).expect("json")));
    let refused = restarted
        .handle_admit(at(5_000), &team(), "chat", 1)
        .expect_err("the window came back");
    assert_eq!(refused.refusal, Refusal::Requests);
    assert_eq!(
        restarted.report(at(5_000))[0].budget.map(|b| b.spent),
        Some(60)
    );
    assert_eq!(restarted.usage(), t.usage());
    // A minute later the window is gone, the month's budget is not.
    assert!(
        restarted
            .handle_admit(at(61_000), &team(), "chat", 1)
            .is_ok()
    );
}
