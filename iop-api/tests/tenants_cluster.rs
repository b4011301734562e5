//! A simulation of a key's limits shared by several Edges through etcd
//! (`iop_api::tenant`, docs/cluster.md "Keys across the cluster"): Edges admit requests
//! in any order, write and read their figures once a second, lose etcd (partitions), and
//! are killed and restarted. Checked: within any minute the Edges together admit no
//! more than the key's requests per minute while every Edge syncs (on one cadence); no
//! more than the limit per Edge while some are cut off or restarting (each keeps to its
//! share of the Edges it last saw); and a budget, once every Edge has read it spent,
//! admits nothing more anywhere.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use iop_api::tenant::{Budget, EdgeShare, KeyPolicy, Period, Tenants, TokenUsage};
use iop_proto_core::Timestamp;
use proptest::prelude::*;

const T0: u64 = 1_796_000_000_000;
const EDGES: usize = 3;

#[derive(Clone, Debug)]
enum Step {
    /// 100 ms pass; every second each Edge that reaches etcd syncs.
    Tick,
    /// A request at Edge `edge`.
    Ask(usize),
    /// Edge `edge` is cut off from etcd, or reaches it again.
    Partition(usize),
    /// Edge `edge` is killed and started again.
    Restart(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => Just(Step::Tick),
        8 => (0..EDGES).prop_map(Step::Ask),
        1 => (0..EDGES).prop_map(Step::Partition),
        1 => (0..EDGES).prop_map(Step::Restart),
    ]
}

struct World {
    policy: KeyPolicy,
    edges: Vec<Tenants>,
    cut: Vec<bool>,
    failed: Vec<u32>,
    /// Synced since it last started: an Edge that has not joined serves no caller (it
    /// answers 503 `not_a_member`, docs/cluster.md).
    joined: Vec<bool>,
    etcd: BTreeMap<usize, EdgeShare>,
    now: u64,
    /// Admissions, by time (ms), for the minute's check.
    admitted: VecDeque<u64>,
    /// A partition or restart happened within the last minute.
    faults: VecDeque<u64>,
    /// Restarts within the last two minutes.
    restarts: VecDeque<u64>,
    spent: u64,
}

fn key() -> Arc<str> {
    Arc::from("k")
}

impl World {
    fn fresh(policy: &KeyPolicy) -> Tenants {
        Tenants::new([(key(), policy.clone())], [Arc::from("m")])
    }

    fn at(&self) -> Timestamp {
        Timestamp::from_millis(T0 + self.now)
    }

    /// One sync round: every Edge that reaches etcd writes its figures, then each reads
    /// the others' (Edges on one cadence; one whose round falls between others' differs
    /// by at most a sync interval's admissions, the stated tolerance).
    fn sync_all(&mut self) {
        let now = self.at();
        for i in 0..EDGES {
            if !self.cut[i] {
                self.etcd.insert(i, self.edges[i].share(now));
            }
        }
        for i in 0..EDGES {
            self.read(i);
        }
    }

    fn read(&mut self, i: usize) {
        if self.cut[i] {
            self.failed[i] += 1;
            if self.failed[i] >= 3 {
                self.edges[i].handle_detached();
            }
            return;
        }
        self.failed[i] = 0;
        self.joined[i] = true;
        let now = self.at();
        let others: BTreeMap<String, (bool, EdgeShare)> = self
            .etcd
            .iter()
            .filter(|(j, _)| **j != i)
            .map(|(j, s)| {
                let live = (T0 + self.now).saturating_sub(s.at_ms) <= 5_000;
                (format!("edge-{j}"), (live, s.clone()))
            })
            .collect();
        let members = 1 + others.values().filter(|(live, _)| *live).count() as u32;
        self.edges[i].handle_cluster(now, members, others);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn a_keys_limit_holds_across_edges(rpm in 3u32..40, steps in proptest::collection::vec(step(), 1..1500)) {
        let policy = KeyPolicy { requests_per_minute: Some(rpm), ..KeyPolicy::default() };
        let mut w = World {
            edges: (0..EDGES).map(|_| World::fresh(&policy)).collect(),
            policy,
            cut: vec![false; EDGES],
            failed: vec![0; EDGES],
            joined: vec![false; EDGES],
            etcd: BTreeMap::new(),
            now: 0,
            admitted: VecDeque::new(),
            faults: VecDeque::new(),
            restarts: VecDeque::new(),
            spent: 0,
        };
        w.sync_all();
        for step in steps {
            match step {
                Step::Tick => {
                    w.now += 100;
                    if w.now.is_multiple_of(1_000) {
                        w.sync_all();
                    }
                }
                Step::Ask(i) if !w.joined[i] => {}
                Step::Ask(i) => {
                    let now = w.at();
                    if let Ok(a) = w.edges[i].handle_admit(now, &key(), "m", 1) {
                        w.edges[i].handle_finish(now, a, None);
                        w.admitted.push_back(w.now);
                    }
                }
                Step::Partition(i) => {
                    w.cut[i] = !w.cut[i];
                    w.faults.push_back(w.now);
                }
                Step::Restart(i) => {
                    let mut fresh = World::fresh(&w.policy);
                    w.joined[i] = false;
                    if !w.cut[i]
                        && let Some(own) = w.etcd.get(&i)
                    {
                        fresh.restore_share(w.at(), own);
                    }
                    w.edges[i] = fresh;
                    // The shell syncs at once after taking its figures back.
                    if !w.cut[i] {
                        let now = w.at();
                        w.etcd.insert(i, w.edges[i].share(now));
                    }
                    w.read(i);
                    w.faults.push_back(w.now);
                    w.restarts.push_back(w.now);
                }
            }
            while w.admitted.front().is_some_and(|&t| t + 60_000 <= w.now) {
                w.admitted.pop_front();
            }
            // Faults count for two minutes: a window that saw one, and the minute after.
            while w.faults.front().is_some_and(|&t| t + 120_000 <= w.now) {
                w.faults.pop_front();
            }
            while w.restarts.front().is_some_and(|&t| t + 120_000 <= w.now) {
                w.restarts.pop_front();
            }
            let limit = u64::from(rpm);
            let in_minute = w.admitted.len() as u64;
            if w.faults.is_empty() {
                prop_assert!(in_minute <= limit, "{in_minute} admitted within a minute, limit {limit}, at {} ms", w.now);
            } else {
                // A cut-off Edge keeps to its share of the Edges it last saw syncing (the
                // whole limit if it saw none), and an Edge restarted forgets what it
                // admitted and had not written yet: bounded by the limit per Edge and per
                // restart.
                let bound = (EDGES + w.restarts.len()) as u64 * (limit + 1);
                prop_assert!(in_minute <= bound, "{in_minute} admitted within a minute, limit {limit}, with faults");
            }
        }
        let _ = w.spent;
    }

    #[test]
    fn a_spent_budget_admits_nothing_once_every_edge_has_read_it(asks in proptest::collection::vec(0..EDGES, 1..200)) {
        let policy = KeyPolicy {
            budget: Some(Budget { tokens: 100, period: Period::Day }),
            ..KeyPolicy::default()
        };
        let mut edges: Vec<Tenants> = (0..EDGES).map(|_| World::fresh(&policy)).collect();
        let mut now = 0u64;
        let mut spent = 0u64;
        let sync = |edges: &mut Vec<Tenants>, now: u64| {
            let t = Timestamp::from_millis(T0 + now);
            let shares: Vec<EdgeShare> = edges.iter().map(|e| e.share(t)).collect();
            for (i, e) in edges.iter_mut().enumerate() {
                let others = shares.iter().enumerate().filter(|(j, _)| *j != i)
                    .map(|(j, s)| (format!("edge-{j}"), (true, s.clone()))).collect();
                e.handle_cluster(t, EDGES as u32, others);
            }
        };
        sync(&mut edges, now);
        for (n, i) in asks.into_iter().enumerate() {
            now += 50;
            if n % 10 == 0 {
                sync(&mut edges, now);
            }
            let t = Timestamp::from_millis(T0 + now);
            let synced_spent: u64 = spent;
            if let Ok(a) = edges[i].handle_admit(t, &key(), "m", 1) {
                edges[i].handle_finish(t, a, Some(TokenUsage { prompt: 7, completion: 3 }));
                spent += 10;
                let _ = synced_spent;
            }
        }
        sync(&mut edges, now + 10);
        let t = Timestamp::from_millis(T0 + now + 20);
        if spent >= 100 {
            for e in &mut edges {
                prop_assert!(e.handle_admit(t, &key(), "m", 1).is_err(), "spent {spent}, yet admitted");
            }
        }
        // Over by at most what the Edges admitted between two syncs.
        prop_assert!(spent <= 100 + 10 * 10 * EDGES as u64, "{spent}");
    }
}
