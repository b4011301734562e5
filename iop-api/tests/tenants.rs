//! Property tests of the tenants' accounting: whatever the order and timing of
//! admissions and ends, a key never gets more than its limits allow, every admission is
//! counted out once, usage adds up to what providers reported, and a restart changes no
//! decision.

use std::sync::Arc;
use std::time::Duration;

use iop_api::tenant::{Admitted, Budget, KeyPolicy, Period, Refusal, Tenants, TokenUsage, WINDOW};
use iop_proto_core::Timestamp;
use proptest::prelude::*;

/// 2026-11-30, some time in the day.
const T0: u64 = 1_796_000_000_000;

#[derive(Clone, Debug)]
enum Step {
    /// Time passes.
    Wait(u64),
    /// A request of key `key` for model `model`, estimated at `estimate` tokens.
    Admit {
        key: usize,
        model: usize,
        estimate: u64,
    },
    /// The `nth` request in progress ends, its provider reporting `usage`.
    Finish {
        nth: usize,
        usage: Option<(u64, u64)>,
    },
    /// The Edge drains and restarts: the accounting is exported and restored.
    Restart,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0u64..3_000).prop_map(Step::Wait),
        1 => (0u64..40_000).prop_map(|ms| Step::Wait(ms * 10)),
        6 => (0usize..3, 0usize..3, 0u64..400)
            .prop_map(|(key, model, estimate)| Step::Admit { key, model, estimate }),
        4 => (any::<usize>(), proptest::option::of((0u64..500, 0u64..500)))
            .prop_map(|(nth, usage)| Step::Finish { nth, usage }),
        1 => Just(Step::Restart),
    ]
}

fn policy() -> impl Strategy<Value = KeyPolicy> {
    (
        proptest::option::of(1u32..8),
        proptest::option::of(100u64..2_000),
        proptest::option::of(1u32..4),
        proptest::option::of((
            500u64..5_000,
            prop_oneof![Just(Period::Day), Just(Period::Month)],
        )),
        any::<bool>(),
    )
        .prop_map(|(rpm, tpm, concurrent, budget, one_model)| KeyPolicy {
            models: one_model.then(|| vec![Arc::from("m0")]),
            requests_per_minute: rpm,
            tokens_per_minute: tpm,
            max_concurrent: concurrent,
            budget: budget.map(|(tokens, period)| Budget { tokens, period }),
        })
}

const KEYS: [&str; 3] = ["alpha", "beta", "unnamed"];
const MODELS: [&str; 3] = ["m0", "m1", "unknown"];

fn build(policies: &[KeyPolicy]) -> Tenants {
    Tenants::new(
        KEYS[..2]
            .iter()
            .zip(policies)
            .map(|(name, p)| (Arc::from(*name), p.clone())),
        [Arc::from("m0"), Arc::from("m1")],
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn keys_stay_within_their_limits(
        policies in proptest::collection::vec(policy(), 2),
        steps in proptest::collection::vec(step(), 1..300),
    ) {
        let keys: Vec<Arc<str>> = KEYS.iter().map(|k| Arc::from(*k)).collect();
        let mut t = build(&policies);
        let mut now = T0;
        let mut open: Vec<(usize, usize, Admitted)> = Vec::new();
        // Per key: when each admission happened; tokens reported per day and period.
        let mut admitted_at: Vec<Vec<u64>> = vec![Vec::new(); 3];
        let mut reported = [(0u64, 0u64, 0u64); 3];
        for step in steps {
            match step {
                Step::Wait(ms) => now += ms,
                Step::Admit { key, model, estimate } => {
                    let before = t.report(Timestamp::from_millis(now));
                    match t.handle_admit(Timestamp::from_millis(now), &keys[key], MODELS[model], estimate) {
                        Ok(a) => {
                            admitted_at[key].push(now);
                            open.push((key, model, a));
                            if key < 2 {
                                let p = &policies[key];
                                // Only the models it may use.
                                if let Some(models) = &p.models {
                                    prop_assert!(models.iter().any(|m| &**m == MODELS[model]));
                                }
                                // Never more in a minute than its rate.
                                if let Some(rpm) = p.requests_per_minute {
                                    let window = WINDOW.as_millis() as u64;
                                    let recent = admitted_at[key]
                                        .iter()
                                        .filter(|&&at| at / 1000 + window / 1000 > now / 1000)
                                        .count();
                                    prop_assert!(recent as u64 <= u64::from(rpm),
                                        "{recent} requests within a minute against {rpm}");
                                }
                                // Never more at once than allowed.
                                if let Some(max) = p.max_concurrent {
                                    let at_once = open.iter().filter(|(k, _, _)| *k == key).count();
                                    prop_assert!(at_once as u32 <= max);
                                }
                                // Never admitted with its budget spent.
                                let before = before.iter().find(|r| &*r.key == KEYS[key]).expect("reported");
                                if let Some(b) = before.budget {
                                    prop_assert!(b.remaining > 0 || b.spent < b.budget.tokens);
                                }
                            }
                        }
                        Err(limited) => {
                            // Only configured keys are ever refused, and each refusal
                            // says when to come back, except for a model it may never use.
                            prop_assert!(key < 2);
                            match limited.refusal {
                                Refusal::Model => prop_assert!(limited.retry_after.is_none()),
                                _ => prop_assert!(limited.retry_after.is_some_and(|d| d > Duration::ZERO)),
                            }
                            if limited.refusal == Refusal::Requests {
                                prop_assert_eq!(limited.limits.requests.map(|q| q.remaining), Some(0));
                            }
                        }
                    }
                }
                Step::Finish { nth, usage } => {
                    if open.is_empty() {
                        continue;
                    }
                    let (key, model, a) = open.remove(nth % open.len());
                    let usage = usage.map(|(prompt, completion)| TokenUsage { prompt, completion });
                    if key < 2 && model < 2 {
                        let r = &mut reported[key];
                        r.0 += 1;
                        if let Some(u) = usage {
                            r.1 += u.prompt;
                            r.2 += u.completion;
                        }
                    }
                    t.handle_finish(Timestamp::from_millis(now), a, usage);
                }
                Step::Restart => {
                    // The Edge drains before it stops: what was in progress ends first.
                    for (key, model, a) in open.drain(..) {
                        if key < 2 && model < 2 {
                            reported[key].0 += 1;
                        }
                        t.handle_finish(Timestamp::from_millis(now), a, None);
                    }
                    let saved = serde_json::to_string(&t.export()).expect("serializes");
                    let mut again = build(&policies);
                    prop_assert!(again.restore(
                        Timestamp::from_millis(now),
                        serde_json::from_str(&saved).expect("parses"),
                    ));
                    // The same answers from here on, for every key and model.
                    prop_assert_eq!(again.report(Timestamp::from_millis(now)), t.report(Timestamp::from_millis(now)));
                    prop_assert_eq!(again.usage(), t.usage());
                    t = again;
                }
            }
        }
        // Every admission counted out: nothing in flight once all ended.
        for (key, model, a) in open.drain(..) {
            if key < 2 && model < 2 {
                reported[key].0 += 1;
            }
            t.handle_finish(Timestamp::from_millis(now), a, None);
        }
        for report in t.report(Timestamp::from_millis(now)) {
            prop_assert_eq!(report.in_flight, 0);
        }
        // The usage rows hold exactly the requests and tokens reported for served models.
        let rows = t.usage();
        for (i, key) in KEYS[..2].iter().enumerate() {
            let sum = rows
                .iter()
                .filter(|r| &*r.key == *key)
                .fold((0, 0, 0), |(n, p, c), r| {
                    (n + r.counts.requests, p + r.counts.prompt_tokens, c + r.counts.completion_tokens)
                });
            prop_assert_eq!(sum, reported[i], "usage of {} against what was reported", key);
        }
        prop_assert!(rows.iter().all(|r| &*r.key != "unnamed" && &*r.model != "unknown"));
    }
}
