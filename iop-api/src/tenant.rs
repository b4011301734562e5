//! Client keys as tenants: which models each may use, its rate limits (requests and
//! tokens per minute, requests at once), its token budget per day or month, and what it
//! used. Plain accounting driven by the time passed in, like the registration guards.
//!
//! Time here is the wall clock: a [`Timestamp`] of milliseconds since the Unix epoch
//! (the shell passes its clock's), because windows and budgets outlive the process
//! ([`Tenants::export`], [`Tenants::restore`]) and a budget's day or month is a calendar
//! one, in UTC.
//!
//! - **Windows.** A minute's requests and tokens are counted in one-second buckets; a
//!   request is admitted while the last 60 seconds hold fewer than `requests_per_minute`
//!   requests and, when the minute's tokens are limited, room for its estimate (a window
//!   with nothing in it admits a request larger than the limit, so no request is refused
//!   for good). So a key sending twice its rate gets exactly its rate answered. Refused,
//!   the caller is told when the oldest second of the window leaves it.
//! - **Tokens** are estimated at admission (the prompt's estimate and the most the request
//!   may generate) and set right when the request ends with the usage its provider
//!   reported ([`Tenants::handle_finish`]).
//! - **Requests at once** are counted from admission to [`Tenants::handle_finish`], which
//!   the shell calls exactly once for every admission, whatever became of the request.
//! - **Budgets** count the tokens providers reported within the current UTC day or month;
//!   once spent, the key is refused until the next one begins.
//! - **Usage** is kept per key, model and UTC day, for the last [`USAGE_DAYS`] days.
//!
//! Everything is bounded: keys come from the configuration, a window holds at most 60
//! buckets, usage rows are kept for configured keys and served models only.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use iop_proto_core::Timestamp;

mod cluster;

pub use cluster::{ClusterKey, EdgeShare, KeyShare};

/// `HashMap` keyed by configured key names (never chosen by a caller).
type IdMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::FixedState>;

/// Days of usage kept per key and model.
pub const USAGE_DAYS: u32 = 62;
/// The rate windows' length.
pub const WINDOW: Duration = Duration::from_secs(60);
const WINDOW_SECS: u64 = 60;
const DAY_MS: u64 = 86_400_000;

/// A budget's period: a UTC calendar day or month.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Period {
    /// From midnight UTC to the next.
    Day,
    /// From the first of the month, midnight UTC, to the next month's.
    Month,
}

/// Tokens a key may use per period.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Tokens (prompt and completion, as providers report them).
    pub tokens: u64,
    /// Per day or per month.
    pub period: Period,
}

/// What one client key may do. The default allows everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyPolicy {
    /// The models it may use; `None`: every model the Edge serves.
    pub models: Option<Vec<Arc<str>>>,
    /// Requests admitted within any minute.
    pub requests_per_minute: Option<u32>,
    /// Tokens (estimated, then as reported) within any minute.
    pub tokens_per_minute: Option<u64>,
    /// Requests in progress at once.
    pub max_concurrent: Option<u32>,
    /// Tokens per day or month.
    pub budget: Option<Budget>,
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The key may not use this model.
    Model,
    /// The minute's requests are used up.
    Requests,
    /// The minute's tokens are used up.
    Tokens,
    /// As many requests as it may have at once are in progress.
    Concurrency,
    /// The period's token budget is spent.
    Budget,
}

impl Refusal {
    /// A stable label for metrics and error codes.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Model => "model_not_allowed",
            Refusal::Requests => "requests",
            Refusal::Tokens => "tokens",
            Refusal::Concurrency => "concurrency",
            Refusal::Budget => "budget",
        }
    }
}

/// One limit's state, for `x-ratelimit-*` headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quota {
    /// The limit.
    pub limit: u64,
    /// What is left of it now.
    pub remaining: u64,
    /// When all of it is available again (the window's newest bucket leaves it).
    pub reset: Duration,
}

/// A key's rate limits as they stand, for response headers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateLimits {
    /// Requests per minute, when limited.
    pub requests: Option<Quota>,
    /// Tokens per minute, when limited.
    pub tokens: Option<Quota>,
}

/// A refused request: why, when to try again, and the limits as they stand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limited {
    /// Why.
    pub refusal: Refusal,
    /// When a request may be admitted again (`None` for a model the key may not use).
    pub retry_after: Option<Duration>,
    /// For the response headers.
    pub limits: RateLimits,
}

/// An admitted request; hand it back to [`Tenants::handle_finish`] exactly once.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use = "every admission must be finished, or the key's requests at once leak"]
pub struct Admitted {
    key: Arc<str>,
    model: Arc<str>,
    /// The second its request and tokens were counted in.
    second: u64,
    estimate: u64,
    /// The limits after this admission, for the response headers.
    pub limits: RateLimits,
}

/// Tokens a provider reported for one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenUsage {
    /// Prompt tokens.
    pub prompt: u64,
    /// Completion tokens.
    pub completion: u64,
}

/// Requests and tokens of one key, model and day.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Requests that ended.
    pub requests: u64,
    /// Prompt tokens reported.
    pub prompt_tokens: u64,
    /// Completion tokens reported.
    pub completion_tokens: u64,
}

/// One row of usage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageRow {
    /// The key's name.
    pub key: Arc<str>,
    /// The model.
    pub model: Arc<str>,
    /// The UTC day, `YYYY-MM-DD`.
    pub day: String,
    /// What it used that day.
    pub counts: Counts,
}

/// A key's state, for status pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyReport {
    /// Its name.
    pub key: Arc<str>,
    /// Requests in progress.
    pub in_flight: u32,
    /// Its rate limits as they stand.
    pub limits: RateLimits,
    /// Its budget, when it has one.
    pub budget: Option<BudgetReport>,
}

/// A budget as it stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetReport {
    /// The budget.
    pub budget: Budget,
    /// Tokens used this period.
    pub spent: u64,
    /// Tokens left this period.
    pub remaining: u64,
    /// When the next period begins.
    pub resets_in: Duration,
}

/// Counts per second within the last minute.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Window {
    buckets: VecDeque<(u64, u64)>,
    total: u64,
}

impl Window {
    fn trim(&mut self, second: u64) {
        while let Some(&(at, amount)) = self.buckets.front() {
            if at + WINDOW_SECS > second && at <= second {
                break;
            }
            self.buckets.pop_front();
            self.total = self.total.saturating_sub(amount);
        }
    }

    fn add(&mut self, second: u64, amount: u64) {
        match self.buckets.back_mut() {
            Some((at, n)) if *at == second => *n = n.saturating_add(amount),
            _ => self.buckets.push_back((second, amount)),
        }
        self.total = self.total.saturating_add(amount);
    }

    /// Sets the amount counted in `second` right by `delta` (if it is still in the
    /// window).
    fn adjust(&mut self, second: u64, delta: i128) {
        if let Some((_, n)) = self.buckets.iter_mut().find(|(at, _)| *at == second) {
            let new = (i128::from(*n) + delta).clamp(0, i128::from(u64::MAX));
            let new = u64::try_from(new).unwrap_or(u64::MAX);
            self.total = self.total.saturating_sub(*n).saturating_add(new);
            *n = new;
        }
    }

    /// Time until the newest bucket leaves the window (all of the limit is back).
    fn newest_leaves(&self, now_ms: u64) -> Duration {
        self.until_leaves(self.buckets.back().map(|b| b.0), now_ms)
    }

    /// What the window holds at `now_ms`, without trimming it (for reports).
    fn total_at(&self, now_ms: u64) -> u64 {
        let second = now_ms / 1000;
        self.buckets
            .iter()
            .filter(|(at, _)| at + WINDOW_SECS > second && *at <= second)
            .fold(0, |sum, (_, n)| sum.saturating_add(*n))
    }

    fn until_leaves(&self, second: Option<u64>, now_ms: u64) -> Duration {
        second.map_or(Duration::ZERO, |at| {
            Duration::from_millis(((at + WINDOW_SECS) * 1000).saturating_sub(now_ms))
        })
    }

    /// How long from `now_ms` until `need` more fits under `limit`: until the oldest
    /// buckets whose leaving makes room have left (or the window is empty).
    fn fits_in(&self, limit: u64, need: u64, now_ms: u64) -> Duration {
        let mut total = self.total;
        for &(at, amount) in &self.buckets {
            if total.saturating_add(need) <= limit {
                break;
            }
            total = total.saturating_sub(amount);
            if total.saturating_add(need) <= limit || total == 0 {
                return self.until_leaves(Some(at), now_ms);
            }
        }
        Duration::ZERO
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Spent {
    /// The period it counts (a day or a month number).
    period: u64,
    tokens: u64,
}

#[derive(Clone, Debug, Default)]
struct Key {
    policy: KeyPolicy,
    requests: Window,
    tokens: Window,
    in_flight: u32,
    spent: Spent,
    /// In a cluster: its part of the minute's limits until the next sync.
    part: cluster::Part,
}

/// Every key's limits, windows, budgets and usage. See the [module documentation](self).
#[derive(Debug, Default)]
pub struct Tenants {
    keys: IdMap<Arc<str>, Key>,
    models: Vec<Arc<str>>,
    usage: BTreeMap<(Arc<str>, Arc<str>, u32), Counts>,
    /// The day usage was last pruned on.
    pruned: u32,
    /// In a cluster: the other Edges' figures (see [`Tenants::handle_cluster`]).
    sharing: Option<cluster::Sharing>,
}

impl Tenants {
    /// Tenants for `keys` (name and policy), serving `models`.
    #[must_use]
    pub fn new(
        keys: impl IntoIterator<Item = (Arc<str>, KeyPolicy)>,
        models: impl IntoIterator<Item = Arc<str>>,
    ) -> Self {
        let mut tenants = Tenants::default();
        tenants.reconfigure(keys, models);
        tenants
    }

    /// A new configuration: keys kept keep their windows, requests in progress, budget
    /// spent and usage; removed keys are forgotten (their requests in progress finish
    /// without effect); a new policy applies from the next request.
    pub fn reconfigure(
        &mut self,
        keys: impl IntoIterator<Item = (Arc<str>, KeyPolicy)>,
        models: impl IntoIterator<Item = Arc<str>>,
    ) {
        let mut next = IdMap::default();
        for (name, policy) in keys {
            let mut key = self.keys.remove(&name).unwrap_or_default();
            key.policy = policy;
            next.insert(name, key);
        }
        self.keys = next;
        self.models = models.into_iter().collect();
        self.models.sort();
        let keys = &self.keys;
        let models = &self.models;
        self.usage.retain(|(key, model, _), _| {
            keys.contains_key(key) && models.binary_search(model).is_ok()
        });
    }

    /// Whether `key` may use `model` (for listing models).
    #[must_use]
    pub fn may_use(&self, key: &str, model: &str) -> bool {
        self.keys.get(key).is_none_or(|k| allows(&k.policy, model))
    }

    /// A request of `key` for `model`, estimated at `estimate` tokens, arrives at `now`
    /// (wall clock): admitted (counted now), or refused with when to try again. A key
    /// the configuration does not name is not limited.
    pub fn handle_admit(
        &mut self,
        now: Timestamp,
        key: &Arc<str>,
        model: &str,
        estimate: u64,
    ) -> Result<Admitted, Limited> {
        let now_ms = now.as_millis();
        let second = now_ms / 1000;
        // The served model's own name where there is one: no copy on the way.
        let model_name = match self.models.binary_search_by(|m| (**m).cmp(model)) {
            Ok(i) => self.models[i].clone(),
            Err(_) => Arc::from(model),
        };
        let Some(k) = self.keys.get_mut(key) else {
            return Ok(Admitted {
                key: key.clone(),
                model: model_name,
                second,
                estimate,
                limits: RateLimits::default(),
            });
        };
        k.requests.trim(second);
        k.tokens.trim(second);
        let policy = &k.policy;
        let refuse = |k: &Key, refusal, retry_after| {
            Err(Limited {
                refusal,
                retry_after,
                limits: limits(k, now_ms),
            })
        };
        if !allows(policy, model) {
            return refuse(k, Refusal::Model, None);
        }
        if let Some(budget) = policy.budget {
            let period = period_of(budget.period, now_ms);
            if k.spent.period != period {
                k.spent = Spent { period, tokens: 0 };
            }
            if k.spent.tokens >= budget.tokens {
                let resets = period_end(budget.period, now_ms).saturating_sub(now_ms);
                return refuse(k, Refusal::Budget, Some(Duration::from_millis(resets)));
            }
        }
        if let Some(rpm) = policy.requests_per_minute
            && k.requests.total >= u64::from(rpm)
        {
            let after = k.requests.fits_in(u64::from(rpm), 1, now_ms);
            return refuse(
                k,
                Refusal::Requests,
                Some(after.max(Duration::from_millis(1))),
            );
        }
        if let Some(tpm) = policy.tokens_per_minute
            && k.tokens.total > 0
            && k.tokens.total.saturating_add(estimate) > tpm
        {
            let after = k.tokens.fits_in(tpm, estimate, now_ms);
            return refuse(
                k,
                Refusal::Tokens,
                Some(after.max(Duration::from_millis(1))),
            );
        }
        if let Some(max) = policy.max_concurrent
            && k.in_flight >= max
        {
            // Nothing says when one ends: a second is a fair guess to come back.
            return refuse(k, Refusal::Concurrency, Some(Duration::from_secs(1)));
        }
        // The other Edges of a cluster: within a sync interval, the view changes.
        if let Some(over) = self
            .sharing
            .as_ref()
            .and_then(|s| s.over(key, k, now_ms, estimate))
        {
            let refusal = match over {
                cluster::Over::Budget => Refusal::Budget,
                cluster::Over::Requests => Refusal::Requests,
                cluster::Over::Tokens => Refusal::Tokens,
                cluster::Over::Concurrency => Refusal::Concurrency,
            };
            return refuse(k, refusal, Some(Duration::from_secs(1)));
        }
        k.part.take(estimate);
        k.in_flight += 1;
        // Windows are kept for the limits there are (an unlimited key counts only its
        // usage); a limit set later starts from an empty window.
        if policy.requests_per_minute.is_some() {
            k.requests.add(second, 1);
        }
        if policy.tokens_per_minute.is_some() {
            k.tokens.add(second, estimate);
        }
        Ok(Admitted {
            key: key.clone(),
            model: model_name,
            second,
            estimate,
            limits: limits(k, now_ms),
        })
    }

    /// The request `admitted` ended at `now`, its provider having reported `usage` (if it
    /// did): its key's requests at once go down, its tokens are set right, and its usage
    /// is counted.
    pub fn handle_finish(&mut self, now: Timestamp, admitted: Admitted, usage: Option<TokenUsage>) {
        let now_ms = now.as_millis();
        let Some(k) = self.keys.get_mut(&admitted.key) else {
            return;
        };
        k.in_flight = k.in_flight.saturating_sub(1);
        let used = usage.map(|u| u.prompt.saturating_add(u.completion));
        if let Some(used) = used {
            k.tokens.adjust(
                admitted.second,
                i128::from(used) - i128::from(admitted.estimate),
            );
            if let Some(budget) = k.policy.budget {
                let period = period_of(budget.period, now_ms);
                if k.spent.period != period {
                    k.spent = Spent { period, tokens: 0 };
                }
                k.spent.tokens = k.spent.tokens.saturating_add(used);
            }
        }
        if self.models.binary_search(&admitted.model).is_err() {
            return;
        }
        let day = u32::try_from(now_ms / DAY_MS).unwrap_or(u32::MAX);
        let counts = self
            .usage
            .entry((admitted.key, admitted.model, day))
            .or_default();
        counts.requests += 1;
        if let Some(u) = usage {
            counts.prompt_tokens = counts.prompt_tokens.saturating_add(u.prompt);
            counts.completion_tokens = counts.completion_tokens.saturating_add(u.completion);
        }
        // Once a day, the days that left the kept span go.
        if self.pruned != day {
            self.pruned = day;
            let oldest = day.saturating_sub(USAGE_DAYS - 1);
            self.usage.retain(|(_, _, d), _| *d >= oldest);
        }
    }

    /// Every configured key's state at `now`, by name.
    #[must_use]
    pub fn report(&self, now: Timestamp) -> Vec<KeyReport> {
        let now_ms = now.as_millis();
        let mut out: Vec<KeyReport> = self
            .keys
            .iter()
            .map(|(name, k)| KeyReport {
                key: name.clone(),
                in_flight: k.in_flight,
                limits: limits(k, now_ms),
                budget: k.policy.budget.map(|budget| {
                    let spent = if k.spent.period == period_of(budget.period, now_ms) {
                        k.spent.tokens
                    } else {
                        0
                    };
                    BudgetReport {
                        budget,
                        spent,
                        remaining: budget.tokens.saturating_sub(spent),
                        resets_in: Duration::from_millis(
                            period_end(budget.period, now_ms).saturating_sub(now_ms),
                        ),
                    }
                }),
            })
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out
    }

    /// Usage per key, model and day, oldest day first.
    #[must_use]
    pub fn usage(&self) -> Vec<UsageRow> {
        let mut rows: Vec<UsageRow> = self
            .usage
            .iter()
            .map(|((key, model, day), counts)| UsageRow {
                key: key.clone(),
                model: model.clone(),
                day: civil_day(*day),
                counts: *counts,
            })
            .collect();
        rows.sort_by(|a, b| (&a.day, &a.key, &a.model).cmp(&(&b.day, &b.key, &b.model)));
        rows
    }

    /// What must outlive the process: windows, budgets spent, usage (requests in
    /// progress are not: they end with it).
    #[must_use]
    pub fn export(&self) -> Saved {
        Saved {
            version: 1,
            keys: self
                .keys
                .iter()
                .map(|(name, k)| {
                    (
                        name.to_string(),
                        SavedKey {
                            requests: k.requests.clone(),
                            tokens: k.tokens.clone(),
                            spent: k.spent.clone(),
                        },
                    )
                })
                .collect(),
            usage: self
                .usage
                .iter()
                .map(|((key, model, day), counts)| SavedUsage {
                    key: key.to_string(),
                    model: model.to_string(),
                    day: *day,
                    counts: *counts,
                })
                .collect(),
        }
    }

    /// Takes back what [`export`](Self::export) saved, at `now`: for the keys and models
    /// configured now, windows that have not passed, the budgets spent and the usage. A
    /// file of another version is ignored (`false`).
    pub fn restore(&mut self, now: Timestamp, saved: Saved) -> bool {
        if saved.version != 1 {
            return false;
        }
        let second = now.as_millis() / 1000;
        for (name, s) in saved.keys {
            if let Some(k) = self.keys.get_mut(name.as_str()) {
                k.requests = bounded(s.requests, second);
                k.tokens = bounded(s.tokens, second);
                k.spent = s.spent;
            }
        }
        let oldest = u32::try_from(now.as_millis() / DAY_MS)
            .unwrap_or(u32::MAX)
            .saturating_sub(USAGE_DAYS - 1);
        for row in saved.usage {
            let (Some((key, _)), Ok(i)) = (
                self.keys.get_key_value(row.key.as_str()),
                self.models
                    .binary_search_by(|m| (**m).cmp(row.model.as_str())),
            ) else {
                continue;
            };
            if row.day < oldest {
                continue;
            }
            let entry = self
                .usage
                .entry((key.clone(), self.models[i].clone(), row.day))
                .or_default();
            *entry = row.counts;
        }
        true
    }
}

/// A saved window, checked: ordered, within the window at `second`, its total recounted.
fn bounded(mut w: Window, second: u64) -> Window {
    let mut buckets: Vec<(u64, u64)> = w
        .buckets
        .drain(..)
        .filter(|&(at, _)| at <= second && at + WINDOW_SECS > second)
        .collect();
    buckets.sort_unstable();
    buckets.dedup_by_key(|b| b.0);
    let total = buckets.iter().fold(0u64, |t, b| t.saturating_add(b.1));
    Window {
        buckets: buckets.into(),
        total,
    }
}

/// What [`Tenants::export`] saves (serde: the shell writes it as JSON).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Saved {
    version: u32,
    keys: BTreeMap<String, SavedKey>,
    usage: Vec<SavedUsage>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct SavedKey {
    requests: Window,
    tokens: Window,
    spent: Spent,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct SavedUsage {
    key: String,
    model: String,
    day: u32,
    counts: Counts,
}

fn allows(policy: &KeyPolicy, model: &str) -> bool {
    policy
        .models
        .as_ref()
        .is_none_or(|models| models.iter().any(|m| &**m == model))
}

fn limits(k: &Key, now_ms: u64) -> RateLimits {
    let quota = |limit: u64, w: &Window| Quota {
        limit,
        remaining: limit.saturating_sub(w.total_at(now_ms)),
        reset: w.newest_leaves(now_ms),
    };
    RateLimits {
        requests: k
            .policy
            .requests_per_minute
            .map(|rpm| quota(u64::from(rpm), &k.requests)),
        tokens: k.policy.tokens_per_minute.map(|tpm| quota(tpm, &k.tokens)),
    }
}

/// The number of the day or month `ms` falls in (UTC).
fn period_of(period: Period, ms: u64) -> u64 {
    let day = ms / DAY_MS;
    match period {
        Period::Day => day,
        Period::Month => {
            let (y, m, _) = civil_from_days(day);
            y * 12 + (m - 1)
        }
    }
}

/// When the period `ms` falls in ends, in milliseconds since the epoch.
fn period_end(period: Period, ms: u64) -> u64 {
    let day = ms / DAY_MS;
    match period {
        Period::Day => (day + 1) * DAY_MS,
        Period::Month => {
            let (y, m, _) = civil_from_days(day);
            let (y, m) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
            days_from_civil(y, m, 1) * DAY_MS
        }
    }
}

/// `YYYY-MM-DD` of a day number.
fn civil_day(day: u32) -> String {
    let (y, m, d) = civil_from_days(u64::from(day));
    format!("{y:04}-{m:02}-{d:02}")
}

/// Year, month (1-12) and day (1-31) of a day number since 1970-01-01 (Howard
/// Hinnant's `civil_from_days`, for days on or after the epoch).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// The day number of a date on or after 1970-01-01 (Hinnant's `days_from_civil`).
fn days_from_civil(y: u64, m: u64, d: u64) -> u64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests;
