//! Lease and queue operations per second as the queue and the resource set grow, against
//! a plain `VecDeque` + `HashMap` doing the same operation sequence in the same group.
//!
//! One iteration = enqueue a waiter, expire the oldest waiter, release a lease on a random
//! resource and hand the freed unit to the oldest waiter listing it (acquire), then
//! enqueue a replacement so the queue keeps its size.
//!
//! Run: `cargo bench -p iop-proto-core --bench queue`

use std::collections::{HashMap, VecDeque};
use std::hint::black_box;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use iop_proto_core::lease::{Generation, Lease, Ledger, RequestId, ResourceId};
use iop_proto_core::queue::{Candidate, WaitQueue, Waiter};
use iop_proto_core::time::Timestamp;

/// Distinct candidate lists (model groups) waiters draw from.
const POOLS: usize = 4096;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The indexed queue and ledger of `iop-proto-core`.
struct Indexed {
    queue: WaitQueue,
    ledger: Ledger,
    resources: Vec<ResourceId>,
    leases: Vec<Lease>,
    model: Arc<str>,
    /// Candidate lists shared by waiters, as model groups share theirs.
    pools: Vec<Arc<[Candidate]>>,
    next_id: u64,
    now: u64,
    wait: u64,
}

impl Indexed {
    fn new(waiters: usize, resources: usize, rng: &mut Rng) -> Self {
        let mut ledger = Ledger::new();
        let ids: Vec<ResourceId> = (0..resources).map(|_| ledger.add_resource()).collect();
        let mut leases = Vec::with_capacity(resources);
        for (i, &r) in ids.iter().enumerate() {
            let _ = ledger.activate(r, Generation(1), 1, 0);
            leases.push(
                ledger
                    .try_acquire(r, RequestId(u64::MAX - i as u64), false)
                    .expect("empty resource"),
            );
        }
        let pools = (0..POOLS)
            .map(|_| {
                let a = ids[rng.below(ids.len())];
                let b = ids[rng.below(ids.len())];
                let list = if a == b { vec![a] } else { vec![a, b] };
                list.into_iter()
                    .map(|resource| Candidate {
                        resource,
                        target: "t".into(),
                    })
                    .collect()
            })
            .collect();
        let mut this = Indexed {
            pools,
            queue: WaitQueue::new(),
            ledger,
            resources: ids,
            leases,
            model: "m".into(),
            next_id: 1,
            now: 0,
            wait: waiters as u64,
        };
        for _ in 0..waiters {
            this.enqueue(rng);
            this.now += 1;
        }
        this
    }

    fn enqueue(&mut self, rng: &mut Rng) {
        let candidates = self.pools[rng.below(POOLS)].clone();
        self.queue.push(Waiter {
            request: RequestId(self.next_id),
            model: self.model.clone(),
            long: false,
            candidates,
            deadline: Timestamp::from_millis(self.now + self.wait + 1),
        });
        self.next_id += 1;
    }

    fn iteration(&mut self, rng: &mut Rng) {
        self.enqueue(rng);
        self.now += 1;
        while let Some(w) = self.queue.pop_expired(Timestamp::from_millis(self.now)) {
            black_box(w);
        }
        let i = rng.below(self.resources.len());
        let r = self.resources[i];
        let _ = self.ledger.release(self.leases[i]);
        let holder = match self.queue.oldest_fitting(r, true, false) {
            Some(ticket) => {
                let waiter = self.queue.remove(ticket).expect("live front");
                self.enqueue(rng);
                waiter.request
            }
            None => RequestId(u64::MAX - i as u64),
        };
        self.leases[i] = self
            .ledger
            .try_acquire(r, holder, false)
            .expect("freed unit");
    }
}

/// The baseline: one FIFO `VecDeque` scanned front to back, a `HashMap` of holders.
struct Naive {
    pools: Vec<[usize; 2]>,
    queue: VecDeque<(u64, [usize; 2], u64)>,
    holders: HashMap<usize, u64>,
    resources: usize,
    next_id: u64,
    now: u64,
    wait: u64,
}

impl Naive {
    fn new(waiters: usize, resources: usize, rng: &mut Rng) -> Self {
        let pools = (0..POOLS)
            .map(|_| [rng.below(resources), rng.below(resources)])
            .collect();
        let mut this = Naive {
            pools,
            queue: VecDeque::new(),
            holders: (0..resources).map(|r| (r, u64::MAX - r as u64)).collect(),
            resources,
            next_id: 1,
            now: 0,
            wait: waiters as u64,
        };
        for _ in 0..waiters {
            this.enqueue(rng);
            this.now += 1;
        }
        this
    }

    fn enqueue(&mut self, rng: &mut Rng) {
        let cands = self.pools[rng.below(POOLS)];
        self.queue
            .push_back((self.next_id, cands, self.now + self.wait + 1));
        self.next_id += 1;
    }

    fn iteration(&mut self, rng: &mut Rng) {
        self.enqueue(rng);
        self.now += 1;
        while self.queue.front().is_some_and(|w| w.2 <= self.now) {
            black_box(self.queue.pop_front());
        }
        let r = rng.below(self.resources);
        self.holders.remove(&r);
        let holder = match self.queue.iter().position(|w| w.1.contains(&r)) {
            Some(pos) => {
                let (id, _, _) = self.queue.remove(pos).expect("found");
                self.enqueue(rng);
                id
            }
            None => u64::MAX - r as u64,
        };
        self.holders.insert(r, holder);
    }
}

fn queue(c: &mut Criterion) {
    for resources in [10usize, 10_000] {
        let mut group = c.benchmark_group(format!("queue_ops_{resources}_resources"));
        group.throughput(Throughput::Elements(1));
        for waiters in [10usize, 1_000, 100_000] {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
            let mut indexed = Indexed::new(waiters, resources, &mut rng);
            group.bench_with_input(BenchmarkId::new("indexed", waiters), &waiters, |b, _| {
                b.iter(|| indexed.iteration(&mut rng));
            });
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
            let mut naive = Naive::new(waiters, resources, &mut rng);
            group.bench_with_input(
                BenchmarkId::new("vecdeque_baseline", waiters),
                &waiters,
                |b, _| {
                    b.iter(|| naive.iteration(&mut rng));
                },
            );
        }
        group.finish();
    }
}

criterion_group!(benches, queue);
criterion_main!(benches);
