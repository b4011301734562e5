//! A key's limits across the Edges of a cluster (docs/cluster.md, "Keys across the
//! cluster"). Each Edge keeps its own windows and publishes them, with its requests in
//! progress and its budget spent, every sync interval ([`Tenants::share`]); it reads the
//! others' ([`Tenants::handle_cluster`]) and admits against the cluster's view:
//!
//! - **Budgets and requests at once:** this Edge's figures now plus the others' as last
//!   read must stay under the limit (over by at most what the others admitted since
//!   they last published: one sync interval's traffic).
//! - **Requests and tokens per minute:** besides that, what the minute leaves of the
//!   limit at a sync (the limit less every Edge's window) is split between the Edges
//!   that share the key in proportion to their use in the window (plus one each, so an
//!   idle Edge keeps a part): until the next sync, this Edge admits at most its part.
//!   So the Edges together do not admit more than the limit within a minute, however
//!   their callers are spread (parts round down; a key used on one Edge only gets most
//!   of its limit at the first syncs and the rest as the others' parts come back).
//! - **Detached** (etcd unreachable): each Edge admits up to its share of each limit,
//!   the limit divided by the Edges it last knew (at least one request), on its own
//!   figures alone ([`Tenants::handle_detached`]).
//! - **Budgets are durable:** a document stays in etcd after its Edge stops, so its spend
//!   counts for the rest of the period, and an Edge that restarts under the same id takes
//!   its own spend back ([`Tenants::restore_share`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{Counts, IdMap, Key, Spent, Tenants, period_of};
use iop_proto_core::Timestamp;

/// What one Edge publishes of one key.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyShare {
    /// Requests admitted within the last minute.
    #[serde(default)]
    pub requests: u64,
    /// Tokens counted within the last minute.
    #[serde(default)]
    pub tokens: u64,
    /// Requests in progress.
    #[serde(default)]
    pub in_flight: u32,
    /// The budget period its spend counts (a day or month number) and the tokens spent.
    #[serde(default)]
    pub period: u64,
    /// See `period`.
    #[serde(default)]
    pub spent: u64,
    /// What it used today (UTC), every model together.
    #[serde(default)]
    pub today: Counts,
    /// The day `today` is.
    #[serde(default)]
    pub day: u32,
}

/// What one Edge publishes: its keys' figures when it published them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EdgeShare {
    /// Wall clock, milliseconds since the epoch.
    pub at_ms: u64,
    /// By key name.
    pub keys: BTreeMap<String, KeyShare>,
}

/// How this Edge shares its keys' limits.
#[derive(Clone, Debug, Default)]
pub(super) struct Sharing {
    /// Edges sharing the limits, this one included.
    members: u32,
    /// etcd is unreachable: each Edge keeps to its share alone.
    detached: bool,
    /// The other Edges' figures as last read, summed per key.
    others: IdMap<Arc<str>, KeyShare>,
    /// Each other Edge's figures as last read (for reports).
    edges: BTreeMap<String, EdgeShare>,
}

/// A key's part of the minute's limits until the next sync, and what it used of it.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Part {
    requests: Option<u64>,
    tokens: Option<u64>,
    used_requests: u64,
    used_tokens: u64,
}

/// Why the cluster refuses a request the key's own figures would admit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Over {
    Budget,
    Requests,
    Tokens,
    Concurrency,
}

/// A key's figures across the cluster, for reports.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterKey {
    /// Requests within the last minute, in progress, today's usage and the budget spent
    /// this period, every Edge together (the others as last read).
    pub requests: u64,
    /// See `requests`.
    pub tokens: u64,
    /// See `requests`.
    pub in_flight: u32,
    /// See `requests`.
    pub today: Counts,
    /// See `requests`.
    pub spent: u64,
    /// Each Edge's own, this one's included, by Edge id.
    pub edges: BTreeMap<String, KeyShare>,
}

impl Sharing {
    fn other(&self, key: &str) -> Option<&KeyShare> {
        self.others.get(key)
    }
}

impl Tenants {
    /// This Edge's figures of every configured key at `now` (what it publishes).
    #[must_use]
    pub fn share(&self, now: Timestamp) -> EdgeShare {
        let now_ms = now.as_millis();
        let day = u32::try_from(now_ms / super::DAY_MS).unwrap_or(u32::MAX);
        let keys = self
            .keys
            .iter()
            .map(|(name, k)| {
                let mut today = Counts::default();
                for ((key, _, d), counts) in &self.usage {
                    if key == name && *d == day {
                        today.requests += counts.requests;
                        today.prompt_tokens += counts.prompt_tokens;
                        today.completion_tokens += counts.completion_tokens;
                    }
                }
                let (period, spent) = match k.policy.budget {
                    Some(b) if k.spent.period == period_of(b.period, now_ms) => {
                        (k.spent.period, k.spent.tokens)
                    }
                    _ => (0, 0),
                };
                (
                    name.to_string(),
                    KeyShare {
                        requests: k.requests.total_at(now_ms),
                        tokens: k.tokens.total_at(now_ms),
                        in_flight: k.in_flight,
                        period,
                        spent,
                        today,
                        day,
                    },
                )
            })
            .collect();
        EdgeShare {
            at_ms: now_ms,
            keys,
        }
    }

    /// The other Edges' figures as read at `now` (`edges`: each one's, by Edge id, those
    /// still sharing first; `members`: how many Edges share the limits now, this one
    /// included). Their budgets spent count whatever their age; their minute and
    /// requests in progress only from the `members - 1` Edges the caller counts live.
    pub fn handle_cluster(
        &mut self,
        now: Timestamp,
        members: u32,
        edges: BTreeMap<String, (bool, EdgeShare)>,
    ) {
        let now_ms = now.as_millis();
        let second = now_ms / 1000;
        let mut others: IdMap<Arc<str>, KeyShare> = IdMap::default();
        for (name, k) in &self.keys {
            let mut sum = KeyShare::default();
            let budget_period = k.policy.budget.map(|b| period_of(b.period, now_ms));
            let day = u32::try_from(now_ms / super::DAY_MS).unwrap_or(u32::MAX);
            for (live, share) in edges.values() {
                let Some(s) = share.keys.get(&**name) else {
                    continue;
                };
                if *live {
                    sum.requests = sum.requests.saturating_add(s.requests);
                    sum.tokens = sum.tokens.saturating_add(s.tokens);
                    sum.in_flight = sum.in_flight.saturating_add(s.in_flight);
                }
                if Some(s.period) == budget_period {
                    sum.spent = sum.spent.saturating_add(s.spent);
                }
                if s.day == day {
                    sum.today.requests += s.today.requests;
                    sum.today.prompt_tokens += s.today.prompt_tokens;
                    sum.today.completion_tokens += s.today.completion_tokens;
                }
            }
            others.insert(name.clone(), sum);
        }
        let members = members.max(1);
        for (name, k) in &mut self.keys {
            k.requests.trim(second);
            k.tokens.trim(second);
            let other = others.get(name).cloned().unwrap_or_default();
            // What the minute leaves, split by each Edge's recent use (one more each, so
            // an idle Edge keeps a part): the parts add up to what is left.
            let part = |limit: Option<u64>, own: u64, theirs: u64| {
                limit.map(|limit| {
                    let left = u128::from(limit.saturating_sub(own).saturating_sub(theirs));
                    let weight = u128::from(own) + 1;
                    let all = u128::from(own) + u128::from(theirs) + u128::from(members);
                    u64::try_from(left * weight / all).unwrap_or(u64::MAX)
                })
            };
            k.part = Part {
                requests: part(
                    k.policy.requests_per_minute.map(u64::from),
                    k.requests.total,
                    other.requests,
                ),
                tokens: part(k.policy.tokens_per_minute, k.tokens.total, other.tokens),
                used_requests: 0,
                used_tokens: 0,
            };
        }
        self.sharing = Some(Sharing {
            members,
            detached: false,
            others,
            edges: edges
                .into_iter()
                .map(|(id, (_, share))| (id, share))
                .collect(),
        });
    }

    /// etcd is unreachable: each Edge keeps to its share of each limit (the limit
    /// divided by the Edges it last knew) on its own figures, until the next
    /// [`handle_cluster`](Self::handle_cluster).
    pub fn handle_detached(&mut self) {
        if let Some(sharing) = self.sharing.as_mut() {
            sharing.detached = true;
        }
    }

    /// Whether the limits are shared and etcd is unreachable (each Edge on its share).
    #[must_use]
    pub fn detached(&self) -> bool {
        self.sharing.as_ref().is_some_and(|s| s.detached)
    }

    /// This Edge's own last published figures (read back from etcd at start, `own`):
    /// the budgets it had spent this period are spent still, and what it admitted within
    /// the minute before it stopped counts in its windows until the minute has passed.
    pub fn restore_share(&mut self, now: Timestamp, own: &EdgeShare) {
        let now_ms = now.as_millis();
        let second = own.at_ms / 1000;
        for (name, k) in &mut self.keys {
            let Some(s) = own.keys.get(&**name) else {
                continue;
            };
            if own.at_ms <= now_ms && now_ms - own.at_ms < super::WINDOW.as_millis() as u64 {
                if k.policy.requests_per_minute.is_some() && s.requests > 0 {
                    k.requests.add(second, s.requests);
                }
                if k.policy.tokens_per_minute.is_some() && s.tokens > 0 {
                    k.tokens.add(second, s.tokens);
                }
            }
            let Some(budget) = k.policy.budget else {
                continue;
            };
            let period = period_of(budget.period, now_ms);
            if s.period == period && (k.spent.period != period || k.spent.tokens < s.spent) {
                k.spent = Spent {
                    period,
                    tokens: s.spent,
                };
            }
        }
    }

    /// The key's figures across the cluster, when its limits are shared.
    #[must_use]
    pub fn cluster_report(&self, now: Timestamp, edge_id: &str) -> BTreeMap<String, ClusterKey> {
        let Some(sharing) = &self.sharing else {
            return BTreeMap::new();
        };
        let own = self.share(now);
        let mut out = BTreeMap::new();
        for (name, mine) in own.keys {
            let theirs = sharing.other(&name).cloned().unwrap_or_default();
            let mut edges: BTreeMap<String, KeyShare> = sharing
                .edges
                .iter()
                .filter_map(|(id, share)| Some((id.clone(), share.keys.get(&name)?.clone())))
                .collect();
            let report = ClusterKey {
                requests: mine.requests + theirs.requests,
                tokens: mine.tokens + theirs.tokens,
                in_flight: mine.in_flight + theirs.in_flight,
                today: Counts {
                    requests: mine.today.requests + theirs.today.requests,
                    prompt_tokens: mine.today.prompt_tokens + theirs.today.prompt_tokens,
                    completion_tokens: mine.today.completion_tokens
                        + theirs.today.completion_tokens,
                },
                spent: mine.spent + theirs.spent,
                edges: {
                    edges.insert(edge_id.to_owned(), mine);
                    edges
                },
            };
            out.insert(name, report);
        }
        out
    }
}

impl Sharing {
    /// Whether the cluster refuses a request of `estimate` tokens of key `name` that its
    /// own figures admit, and why.
    pub(super) fn over(&self, name: &str, k: &Key, now_ms: u64, estimate: u64) -> Option<Over> {
        let sharing = self;
        let policy = &k.policy;
        if sharing.detached {
            let share = |limit: u64| (limit / u64::from(sharing.members)).max(1);
            if let Some(rpm) = policy.requests_per_minute
                && k.requests.total >= share(u64::from(rpm))
            {
                return Some(Over::Requests);
            }
            if let Some(tpm) = policy.tokens_per_minute
                && k.tokens.total > 0
                && k.tokens.total.saturating_add(estimate) > share(tpm)
            {
                return Some(Over::Tokens);
            }
            if let Some(max) = policy.max_concurrent
                && u64::from(k.in_flight) >= share(u64::from(max))
            {
                return Some(Over::Concurrency);
            }
            // A budget: what was last known spent elsewhere still counts.
        }
        let other = sharing.other(name)?;
        if let Some(budget) = policy.budget {
            let period = period_of(budget.period, now_ms);
            let own = if k.spent.period == period {
                k.spent.tokens
            } else {
                0
            };
            if own.saturating_add(other.spent) >= budget.tokens {
                return Some(Over::Budget);
            }
        }
        if sharing.detached {
            return None;
        }
        if let Some(rpm) = policy.requests_per_minute
            && (k.requests.total.saturating_add(other.requests) >= u64::from(rpm)
                || k.part.requests.is_some_and(|p| k.part.used_requests >= p))
        {
            return Some(Over::Requests);
        }
        if let Some(tpm) = policy.tokens_per_minute
            && k.tokens.total.saturating_add(other.tokens) > 0
            && (k
                .tokens
                .total
                .saturating_add(other.tokens)
                .saturating_add(estimate)
                > tpm
                || k.part.tokens.is_some_and(|p| {
                    k.part.used_tokens.saturating_add(estimate) > p && k.part.used_tokens > 0
                }))
        {
            return Some(Over::Tokens);
        }
        if let Some(max) = policy.max_concurrent
            && k.in_flight.saturating_add(other.in_flight) >= max
        {
            return Some(Over::Concurrency);
        }
        None
    }
}

impl Part {
    /// An admission of `estimate` tokens counts against the part.
    pub(super) fn take(&mut self, estimate: u64) {
        self.used_requests += 1;
        self.used_tokens = self.used_tokens.saturating_add(estimate);
    }
}

#[cfg(test)]
mod tests {
    use super::super::*;
    use super::*;

    fn edge(policy: KeyPolicy) -> Tenants {
        Tenants::new([(Arc::from("k"), policy)], [Arc::from("m")])
    }

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_millis(1_800_000_000_000 + ms)
    }

    /// Every Edge reads every other's share.
    fn sync(edges: &mut [Tenants], now: Timestamp) {
        let shares: Vec<EdgeShare> = edges.iter().map(|e| e.share(now)).collect();
        let members = u32::try_from(edges.len()).unwrap();
        for (i, e) in edges.iter_mut().enumerate() {
            let others = shares
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(j, s)| (format!("edge-{j}"), (true, s.clone())))
                .collect();
            e.handle_cluster(now, members, others);
        }
    }

    fn key() -> Arc<str> {
        Arc::from("k")
    }

    #[test]
    fn three_edges_admit_a_minutes_limit_once_between_them() {
        let policy = KeyPolicy {
            requests_per_minute: Some(6),
            ..KeyPolicy::default()
        };
        let mut edges = vec![edge(policy.clone()), edge(policy.clone()), edge(policy)];
        sync(&mut edges, at(0));
        let mut admitted = 0;
        for i in 0..18u64 {
            let now = at(i * 100);
            if i % 6 == 5 {
                sync(&mut edges, now);
            }
            let e = &mut edges[(i % 3) as usize];
            if let Ok(a) = e.handle_admit(now, &key(), "m", 10) {
                admitted += 1;
                e.handle_finish(now, a, None);
            }
        }
        // A sync splits what is left evenly, rounding down: never over the limit.
        assert!(
            (5..=6).contains(&admitted),
            "{admitted}: the limit at most, over three Edges"
        );
        // A key used on one Edge only gets its limit back as the others' parts return.
        let policy = KeyPolicy {
            requests_per_minute: Some(9),
            ..KeyPolicy::default()
        };
        let mut edges = vec![edge(policy.clone()), edge(policy.clone()), edge(policy)];
        let mut admitted = 0;
        for round in 0..6u64 {
            sync(&mut edges, at(round * 1000));
            while edges[0]
                .handle_admit(at(round * 1000), &key(), "m", 1)
                .is_ok()
            {
                admitted += 1;
            }
        }
        assert_eq!(
            admitted, 8,
            "one Edge approaches the whole limit within a few syncs"
        );
    }

    #[test]
    fn a_budget_spent_on_one_edge_refuses_on_the_others_after_a_sync() {
        let policy = KeyPolicy {
            budget: Some(Budget {
                tokens: 100,
                period: Period::Day,
            }),
            ..KeyPolicy::default()
        };
        let mut edges = vec![edge(policy.clone()), edge(policy)];
        sync(&mut edges, at(0));
        let a = edges[0]
            .handle_admit(at(10), &key(), "m", 1)
            .expect("admitted");
        edges[0].handle_finish(
            at(20),
            a,
            Some(TokenUsage {
                prompt: 60,
                completion: 40,
            }),
        );
        assert!(
            edges[1].handle_admit(at(30), &key(), "m", 1).is_ok(),
            "not synced yet"
        );
        sync(&mut edges, at(1000));
        let refused = edges[1].handle_admit(at(1010), &key(), "m", 1).unwrap_err();
        assert_eq!(refused.refusal, Refusal::Budget);
        // A restarted Edge takes its spend back from what it published.
        let own = edges[0].share(at(1020));
        let mut restarted = edge(edges[0].keys[&key()].policy.clone());
        restarted.restore_share(at(1030), &own);
        assert_eq!(restarted.report(at(1030))[0].budget.unwrap().spent, 100);
        // Every Edge reports the cluster's figures.
        let report = edges[1].cluster_report(at(1040), "edge-1");
        assert_eq!(report["k"].spent, 100);
        assert_eq!(report["k"].today.requests, 1, "the one that ended");
    }

    #[test]
    fn detached_each_edge_keeps_to_its_share() {
        let policy = KeyPolicy {
            requests_per_minute: Some(7),
            max_concurrent: Some(4),
            ..KeyPolicy::default()
        };
        let mut edges = vec![edge(policy.clone()), edge(policy.clone()), edge(policy)];
        sync(&mut edges, at(0));
        edges[0].handle_detached();
        assert!(edges[0].detached());
        let mut held = Vec::new();
        while let Ok(a) = edges[0].handle_admit(at(10), &key(), "m", 1) {
            held.push(a);
        }
        // 4 / 3 = 1 at once.
        assert_eq!(held.len(), 1);
        for a in held {
            edges[0].handle_finish(at(20), a, None);
        }
        let mut admitted = 1;
        while let Ok(a) = edges[0].handle_admit(at(30), &key(), "m", 1) {
            admitted += 1;
            edges[0].handle_finish(at(30), a, None);
        }
        assert_eq!(admitted, 2, "7 / 3 requests a minute");
    }
}
