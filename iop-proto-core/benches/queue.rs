//! Lease and queue operations per second as the queue and the resource set grow, against
//! a plain `VecDeque` + `HashMap` doing the same operation sequence in the same group.
//!
//! One iteration does the same operations at every size: enqueue a waiter, expire the
//! waiter with the earliest deadline, release the lease on one of the new waiter's
//! candidate resources, grant the freed unit to the oldest waiter listing that resource
//! (acquire), and enqueue a replacement, so the queue keeps exactly its size. Only where
//! the expired and the served waiters sit in memory changes with the size.
//!
//! Run: `cargo bench -p iop-proto-core --bench queue`

use std::collections::{HashMap, VecDeque};
use std::hint::black_box;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use iop_proto_core::RequestId;
use iop_proto_core::edge::{Generation, ResourceId};
use iop_proto_core::testkit::internals::{Candidate, Lease, Ledger, WaitQueue, Waiter};
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
    /// The lease held on each resource, by resource index.
    leases: Vec<Lease>,
    model: Arc<str>,
    /// Candidate lists shared by waiters, as model groups share theirs.
    pools: Vec<Arc<[Candidate]>>,
    /// Candidates of the newest waiter.
    newest: Arc<[Candidate]>,
    next_id: u64,
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
            leases,
            model: "m".into(),
            newest: Arc::new([]),
            next_id: 1,
        };
        for _ in 0..waiters {
            this.enqueue(rng);
        }
        this
    }

    /// Deadlines follow arrival, one millisecond apart, as with a fixed wait timeout.
    fn enqueue(&mut self, rng: &mut Rng) {
        let candidates = self.pools[rng.below(POOLS)].clone();
        self.newest = candidates.clone();
        self.queue.push(Waiter {
            request: RequestId(self.next_id),
            model: self.model.clone(),
            long: false,
            candidates,
            deadline: Timestamp::from_millis(self.next_id),
        });
        self.next_id += 1;
    }

    fn iteration(&mut self, rng: &mut Rng) {
        self.enqueue(rng);
        let due = self.queue.next_deadline().expect("waiters");
        black_box(self.queue.pop_expired(due).expect("one is due"));
        let r = self.newest[rng.below(self.newest.len())].resource;
        let _ = self.ledger.release(self.leases[r.index()]);
        let ticket = self
            .queue
            .oldest_fitting(r, true, false)
            .expect("the newest waiter lists it");
        let waiter = self.queue.remove(ticket).expect("live front");
        self.enqueue(rng);
        self.leases[r.index()] = self
            .ledger
            .try_acquire(r, waiter.request, false)
            .expect("freed unit");
    }
}

/// The baseline: one FIFO `VecDeque` scanned front to back, a `HashMap` of holders.
struct Naive {
    pools: Vec<[usize; 2]>,
    queue: VecDeque<(u64, [usize; 2])>,
    holders: HashMap<usize, u64>,
    newest: [usize; 2],
    next_id: u64,
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
            newest: [0, 0],
            next_id: 1,
        };
        for _ in 0..waiters {
            this.enqueue(rng);
        }
        this
    }

    fn enqueue(&mut self, rng: &mut Rng) {
        self.newest = self.pools[rng.below(POOLS)];
        self.queue.push_back((self.next_id, self.newest));
        self.next_id += 1;
    }

    fn iteration(&mut self, rng: &mut Rng) {
        self.enqueue(rng);
        // Deadlines follow arrival: the front is the earliest.
        black_box(self.queue.pop_front());
        let r = self.newest[rng.below(2)];
        self.holders.remove(&r);
        let pos = self
            .queue
            .iter()
            .position(|w| w.1.contains(&r))
            .expect("the newest waiter lists it");
        let (id, _) = self.queue.remove(pos).expect("found");
        self.enqueue(rng);
        self.holders.insert(r, id);
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
