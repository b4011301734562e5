//! The lease ledger: per provider resource, its live generation, its capacities and the
//! leases held against them.
//!
//! A resource is one adapter instance on one node, `(node_id, provider_id)`. It is live
//! only while its node's current connection is ready; its capacity belongs to that
//! connection's generation. A lease is a token naming the run (one dispatch of a
//! request), the resource and the generation it was granted in. It is returned exactly once: by [`Ledger::release`], or
//! all at once when the generation is fenced. Anything after that reports
//! [`Release::Stale`] and changes nothing.

use crate::idhash::IdMap;

/// Index of a provider resource in the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ResourceId(pub(crate) u32);

impl ResourceId {
    /// The index as a `usize`, for tables kept beside the ledger.
    #[must_use]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A node connection's generation: every accepted register gets a new one, Edge-wide
/// increasing, so a lease or a callback from an older connection is recognisably stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Generation(pub u64);

/// Identifier of a client request; increasing in submission order (the queue's FIFO order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

/// One dispatch of a request to a provider, and the holder of its lease: a request's
/// first dispatch is attempt 0, and each retry on another provider is a new run. On the
/// wire it is the `run_id` of the dispatched message and of every event or frame of its
/// stream: `run-<request>`, or `run-<request>-<attempt>` for a retry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RunId {
    /// The request it serves.
    pub request: RequestId,
    /// Which dispatch of the request it is, from 0.
    pub attempt: u32,
}

impl RunId {
    /// What every wire run id starts with; the request's number follows in decimal.
    const PREFIX: &'static str = "run-";

    /// The first run of `request`.
    #[must_use]
    pub fn first(request: RequestId) -> Self {
        RunId {
            request,
            attempt: 0,
        }
    }

    /// The run a wire run id names, if it is one of this Edge's (one pass over its
    /// bytes: every frame of a run is looked up by it).
    #[must_use]
    pub fn parse(text: &str) -> Option<RunId> {
        let rest = text.strip_prefix(Self::PREFIX)?.as_bytes();
        let (request, rest) = leading_number(rest)?;
        let attempt = match rest {
            [] => 0,
            [b'-', tail @ ..] => match leading_number(tail)? {
                (attempt, []) if attempt > 0 => u32::try_from(attempt).ok()?,
                _ => return None,
            },
            _ => return None,
        };
        Some(RunId {
            request: RequestId(request),
            attempt,
        })
    }

    /// The longest wire form: the prefix, a `u64`, a dash and a `u32`.
    pub const MAX_WIRE_LEN: usize = Self::PREFIX.len() + 20 + 1 + 10;

    /// The wire form (as `Display` writes it), without the formatter: it is made once
    /// per dispatch.
    #[must_use]
    pub fn wire(self) -> String {
        let mut buf = [0u8; Self::MAX_WIRE_LEN];
        // ASCII only, so this cannot fail.
        std::str::from_utf8(self.write_wire(&mut buf))
            .map(String::from)
            .unwrap_or_default()
    }

    /// The wire form written into `buf`, without allocating: a dispatch's frame is
    /// encoded from it.
    pub fn write_wire(self, buf: &mut [u8; Self::MAX_WIRE_LEN]) -> &[u8] {
        let mut digits = [0u8; 20];
        let mut len = 0;
        let mut put = |bytes: &[u8]| {
            buf[len..len + bytes.len()].copy_from_slice(bytes);
            len += bytes.len();
        };
        put(Self::PREFIX.as_bytes());
        put(decimal(&mut digits, self.request.0));
        if self.attempt > 0 {
            put(b"-");
            put(decimal(&mut digits, u64::from(self.attempt)));
        }
        &buf[..len]
    }
}

/// The decimal number `bytes` start with (at least one digit; no sign) and what
/// follows it; `None` when there is none or it overflows.
fn leading_number(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let end = bytes
        .iter()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(bytes.len());
    if end == 0 {
        return None;
    }
    let mut n: u64 = 0;
    for &b in &bytes[..end] {
        n = n.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
    }
    Some((n, &bytes[end..]))
}

/// `n`'s decimal digits, written into the end of `buf` (20 digits hold any `u64`).
fn decimal(buf: &mut [u8; 20], mut n: u64) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[at..]
}

impl std::fmt::Display for RunId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut buf = [0u8; Self::MAX_WIRE_LEN];
        // ASCII only, so this cannot fail.
        f.write_str(std::str::from_utf8(self.write_wire(&mut buf)).unwrap_or_default())
    }
}

impl From<RequestId> for RunId {
    fn from(request: RequestId) -> Self {
        RunId::first(request)
    }
}

/// The token of one granted unit of provider capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Lease {
    /// The run holding the lease (at most one lease per run).
    pub run: RunId,
    /// The resource whose capacity it holds.
    pub resource: ResourceId,
    /// The generation it was granted in.
    pub generation: Generation,
    /// Whether it also holds long-context capacity.
    pub long: bool,
}

/// Outcome of returning a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Release {
    /// The lease was held and its capacity is free again.
    Released,
    /// The lease was already returned (released before, or its generation was fenced).
    Stale,
}

/// Capacity figures of one resource.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Live generation, `None` while offline.
    pub generation: Option<Generation>,
    /// Configured capacity of the live generation (0 offline).
    pub capacity: u32,
    /// Configured long-context capacity of the live generation (0 offline).
    pub long_capacity: u32,
    /// Leases held.
    pub in_flight: u32,
    /// Long-context leases held (also counted in `in_flight`).
    pub long_in_flight: u32,
    /// Units the node's work for an earlier Edge process still holds (a re-homed node's
    /// draining session: `NodeReadyRequest.held_elsewhere`, `NodeLoadReport`): taken,
    /// though no lease of this ledger holds them.
    pub held_elsewhere: u32,
    /// Of those, long-context units.
    pub long_held_elsewhere: u32,
    /// Units the node refused work for although this ledger counted them free: held by
    /// work it cannot see (a cancelled run its node has not ended yet, a slot another
    /// session took that no report announced). Taken until its node frees a unit there
    /// or the hold ends ([`Ledger::hold_refused`]).
    pub refused_hold: u32,
}

/// A held lease and its place in its resource's holder list.
#[derive(Clone, Copy, Debug)]
struct Held {
    lease: Lease,
    at: u32,
}

/// All resources and the leases held against them.
#[derive(Debug, Default)]
pub struct Ledger {
    resources: Vec<Resource>,
    leases: IdMap<RunId, Held>,
}

/// One resource's figures and the runs holding a lease on it (in no particular order),
/// side by side so an acquire or release touches one place.
#[derive(Debug, Default)]
struct Resource {
    usage: Usage,
    holders: Vec<RunId>,
}

impl Ledger {
    /// An empty ledger.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an offline resource.
    pub fn add_resource(&mut self) -> ResourceId {
        let id =
            ResourceId(u32::try_from(self.resources.len()).expect("fewer than 2^32 resources"));
        self.resources.push(Resource::default());
        id
    }

    /// Number of resources ever added.
    #[must_use]
    pub fn len(&self) -> usize {
        self.resources.len()
    }

    /// True when no resource was added.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.resources.is_empty()
    }

    /// Current figures of `resource`.
    #[must_use]
    pub fn usage(&self, resource: ResourceId) -> Usage {
        self.resources[resource.index()].usage
    }

    /// Number of leases held across all resources.
    #[must_use]
    pub fn leases_held(&self) -> usize {
        self.leases.len()
    }

    /// The lease `run` holds, if any.
    #[must_use]
    pub fn lease_of(&self, run: RunId) -> Option<Lease> {
        self.leases.get(&run).map(|held| held.lease)
    }

    /// Brings `resource` online for `generation` with the given capacities. A resource that
    /// is live in an older generation is fenced first (its leases are returned).
    pub fn activate(
        &mut self,
        resource: ResourceId,
        generation: Generation,
        capacity: u32,
        long_capacity: u32,
    ) -> Vec<Lease> {
        let returned = match self.resources[resource.index()].usage.generation {
            Some(live) if live != generation => self.fence(resource),
            _ => Vec::new(),
        };
        let usage = &mut self.resources[resource.index()].usage;
        usage.generation = Some(generation);
        usage.capacity = capacity;
        usage.long_capacity = long_capacity.min(capacity);
        returned
    }

    /// Changes the capacities of a live resource in place. Leases already held stay held;
    /// after a shrink no new lease is granted until `in_flight` is below the new figure.
    pub fn set_capacity(&mut self, resource: ResourceId, capacity: u32, long_capacity: u32) {
        let usage = &mut self.resources[resource.index()].usage;
        if usage.generation.is_some() {
            usage.capacity = capacity;
            usage.long_capacity = long_capacity.min(capacity);
        }
    }

    /// Records the units of live `resource` that work outside this ledger holds (see
    /// [`Usage::held_elsewhere`]); a later call replaces the figures. Whether any unit
    /// came free is the return value. Offline resources keep none.
    pub fn set_held(&mut self, resource: ResourceId, held: u32, long_held: u32) -> bool {
        let usage = &mut self.resources[resource.index()].usage;
        if usage.generation.is_none() {
            return false;
        }
        let freed = held < usage.held_elsewhere || long_held < usage.long_held_elsewhere;
        usage.held_elsewhere = held;
        usage.long_held_elsewhere = long_held.min(held);
        freed
    }

    /// The node of live `resource` refused work the ledger had room for: every unit it
    /// counted free is taken (`refused_hold`) until [`Self::end_refused_hold`]. Whether a
    /// hold was made (none offline, nor when nothing was free).
    pub fn hold_refused(&mut self, resource: ResourceId) -> bool {
        let free = self.free(resource, false);
        let usage = &mut self.resources[resource.index()].usage;
        if free == 0 {
            return false;
        }
        usage.refused_hold += free;
        true
    }

    /// A unit of live `resource` whose lease returned without its node's word (a cancelled
    /// run's grace passed) stays taken (`refused_hold`) until [`Self::end_refused_hold`]:
    /// the node may still be stopping that run. Whether one was held (none offline).
    pub fn hold_unconfirmed(&mut self, resource: ResourceId) -> bool {
        let usage = &mut self.resources[resource.index()].usage;
        if usage.generation.is_none() || usage.refused_hold >= usage.capacity {
            return false;
        }
        usage.refused_hold += 1;
        true
    }

    /// The node of `resource` freed a unit there (a run it ended, a load it reported), or
    /// its refusal hold passed: the units it held back count as free again. Whether any
    /// were held.
    pub fn end_refused_hold(&mut self, resource: ResourceId) -> bool {
        let usage = &mut self.resources[resource.index()].usage;
        std::mem::take(&mut usage.refused_hold) > 0
    }

    /// Takes `resource` offline and returns every lease held on it, each exactly once,
    /// in run order. Costs O(leases on `resource`), whatever else is held.
    pub fn fence(&mut self, resource: ResourceId) -> Vec<Lease> {
        let holders = std::mem::take(&mut self.resources[resource.index()]).holders;
        let mut returned: Vec<Lease> = holders
            .iter()
            .filter_map(|run| self.leases.remove(run))
            .map(|held| held.lease)
            .collect();
        returned.sort_unstable_by_key(|lease| lease.run);
        returned
    }

    /// Free units of `resource` for a request of the given kind (0 when offline).
    #[must_use]
    pub fn free(&self, resource: ResourceId, long: bool) -> u32 {
        let usage = &self.resources[resource.index()].usage;
        if usage.generation.is_none() {
            return 0;
        }
        let free = usage
            .capacity
            .saturating_sub(usage.in_flight)
            .saturating_sub(usage.held_elsewhere)
            .saturating_sub(usage.refused_hold);
        if long {
            free.min(
                usage
                    .long_capacity
                    .saturating_sub(usage.long_in_flight)
                    .saturating_sub(usage.long_held_elsewhere),
            )
        } else {
            free
        }
    }

    /// Grants `run` a lease on `resource` if it has a free unit of the right kind.
    /// Returns `None` when it has none, or when `run` already holds a lease.
    pub fn try_acquire(
        &mut self,
        resource: ResourceId,
        run: impl Into<RunId>,
        long: bool,
    ) -> Option<Lease> {
        let run = run.into();
        if self.free(resource, long) == 0 || self.leases.contains_key(&run) {
            return None;
        }
        let usage = &mut self.resources[resource.index()].usage;
        let generation = usage.generation?;
        usage.in_flight += 1;
        if long {
            usage.long_in_flight += 1;
        }
        let lease = Lease {
            run,
            resource,
            generation,
            long,
        };
        let holders = &mut self.resources[resource.index()].holders;
        let at = u32::try_from(holders.len()).expect("capacity is a u32");
        holders.push(run);
        self.leases.insert(run, Held { lease, at });
        Some(lease)
    }

    /// Returns a lease. Only the exact token currently held releases capacity.
    pub fn release(&mut self, lease: Lease) -> Release {
        let held = match self.leases.remove(&lease.run) {
            Some(held) if held.lease == lease => held,
            Some(other) => {
                // The run holds a different lease: put it back untouched.
                self.leases.insert(lease.run, other);
                return Release::Stale;
            }
            None => return Release::Stale,
        };
        let holders = &mut self.resources[lease.resource.index()].holders;
        holders.swap_remove(held.at as usize);
        if let Some(&moved) = holders.get(held.at as usize)
            && let Some(entry) = self.leases.get_mut(&moved)
        {
            entry.at = held.at;
        }
        let usage = &mut self.resources[lease.resource.index()].usage;
        usage.in_flight -= 1;
        if lease.long {
            usage.long_in_flight -= 1;
        }
        Release::Released
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(capacity: u32, long_capacity: u32) -> (Ledger, ResourceId) {
        let mut ledger = Ledger::new();
        let r = ledger.add_resource();
        assert!(
            ledger
                .activate(r, Generation(1), capacity, long_capacity)
                .is_empty()
        );
        (ledger, r)
    }

    #[test]
    fn a_run_id_reads_back_what_it_wrote_and_nothing_else() {
        for (request, attempt) in [(0, 0), (7, 0), (7, 1), (u64::MAX, u32::MAX)] {
            let run = RunId {
                request: RequestId(request),
                attempt,
            };
            assert_eq!(RunId::parse(&run.wire()), Some(run));
        }
        for bad in [
            "",
            "run-",
            "run-x",
            "run--1",
            "run-1-",
            "run-1-0",
            "run-+1",
            "run-1-+2",
            "run-1x",
            "run-1-2-3",
            "job-1",
            "run-18446744073709551616",
            "run-1-4294967296",
            "RUN-1",
        ] {
            assert_eq!(RunId::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn offline_resources_grant_nothing() {
        let mut ledger = Ledger::new();
        let r = ledger.add_resource();
        assert_eq!(ledger.free(r, false), 0);
        assert_eq!(ledger.try_acquire(r, RequestId(1), false), None);
    }

    #[test]
    fn capacity_bounds_grants_and_long_counts_in_both() {
        let (mut ledger, r) = live(2, 1);
        let long = ledger
            .try_acquire(r, RequestId(1), true)
            .expect("long fits");
        assert_eq!(
            ledger.try_acquire(r, RequestId(2), true),
            None,
            "long capacity is 1"
        );
        let short = ledger
            .try_acquire(r, RequestId(3), false)
            .expect("short fits");
        assert_eq!(
            ledger.try_acquire(r, RequestId(4), false),
            None,
            "capacity is 2"
        );
        let usage = ledger.usage(r);
        assert_eq!((usage.in_flight, usage.long_in_flight), (2, 1));
        assert_eq!(ledger.release(long), Release::Released);
        assert_eq!(ledger.release(short), Release::Released);
        assert_eq!(ledger.usage(r).in_flight, 0);
    }

    #[test]
    fn a_lease_is_released_exactly_once() {
        let (mut ledger, r) = live(1, 0);
        let lease = ledger.try_acquire(r, RequestId(1), false).expect("fits");
        assert_eq!(ledger.release(lease), Release::Released);
        assert_eq!(ledger.release(lease), Release::Stale);
        // A new lease for another request is unaffected by the stale release.
        let other = ledger.try_acquire(r, RequestId(2), false).expect("fits");
        assert_eq!(ledger.release(lease), Release::Stale);
        assert_eq!(ledger.usage(r).in_flight, 1);
        assert_eq!(ledger.release(other), Release::Released);
    }

    #[test]
    fn fencing_returns_all_leases_once_and_later_releases_are_stale() {
        let (mut ledger, r) = live(3, 3);
        let a = ledger.try_acquire(r, RequestId(1), false).expect("fits");
        let b = ledger.try_acquire(r, RequestId(2), true).expect("fits");
        let returned = ledger.fence(r);
        assert_eq!(returned, vec![a, b]);
        assert_eq!(ledger.usage(r), Usage::default());
        assert_eq!(ledger.release(a), Release::Stale);
        assert!(ledger.fence(r).is_empty());
        // The next generation starts from zero; the old token cannot touch it.
        assert!(ledger.activate(r, Generation(2), 3, 3).is_empty());
        let c = ledger.try_acquire(r, RequestId(1), false).expect("fits");
        assert_eq!(c.generation, Generation(2));
        assert_eq!(ledger.release(a), Release::Stale);
        assert_eq!(ledger.usage(r).in_flight, 1);
    }

    #[test]
    fn fencing_returns_only_the_leases_of_its_resource_after_any_release_order() {
        let mut ledger = Ledger::new();
        let r = ledger.add_resource();
        let other = ledger.add_resource();
        assert!(ledger.activate(r, Generation(1), 4, 0).is_empty());
        assert!(ledger.activate(other, Generation(2), 4, 0).is_empty());
        let held: Vec<Lease> = (1..=4)
            .map(|i| ledger.try_acquire(r, RequestId(i), false).expect("fits"))
            .collect();
        let kept = ledger
            .try_acquire(other, RequestId(9), false)
            .expect("fits");
        // Releasing from the front moves the last holder into the freed place.
        assert_eq!(ledger.release(held[0]), Release::Released);
        assert_eq!(ledger.release(held[3]), Release::Released);
        assert_eq!(ledger.release(held[3]), Release::Stale);
        assert_eq!(ledger.fence(r), vec![held[1], held[2]]);
        assert_eq!(ledger.lease_of(RequestId(9).into()), Some(kept));
        assert_eq!(ledger.leases_held(), 1);
        assert_eq!(ledger.fence(other), vec![kept]);
    }

    #[test]
    fn activating_a_newer_generation_fences_the_older() {
        let (mut ledger, r) = live(2, 0);
        let a = ledger.try_acquire(r, RequestId(1), false).expect("fits");
        assert_eq!(ledger.activate(r, Generation(5), 2, 0), vec![a]);
        assert_eq!(ledger.usage(r).in_flight, 0);
    }

    #[test]
    fn shrinking_capacity_stops_grants_until_drained() {
        let (mut ledger, r) = live(2, 0);
        let a = ledger.try_acquire(r, RequestId(1), false).expect("fits");
        let _b = ledger.try_acquire(r, RequestId(2), false).expect("fits");
        ledger.set_capacity(r, 1, 0);
        assert_eq!(ledger.try_acquire(r, RequestId(3), false), None);
        assert_eq!(ledger.release(a), Release::Released);
        assert_eq!(
            ledger.try_acquire(r, RequestId(3), false),
            None,
            "still at 1/1"
        );
    }

    #[test]
    fn a_refusal_takes_every_free_unit_until_its_hold_ends() {
        let (mut ledger, r) = live(3, 1);
        let a = ledger.try_acquire(r, RequestId(1), false).expect("fits");
        assert!(ledger.hold_refused(r), "two units were free");
        assert_eq!(ledger.usage(r).refused_hold, 2);
        assert_eq!((ledger.free(r, false), ledger.free(r, true)), (0, 0));
        assert!(!ledger.hold_refused(r), "nothing left to hold");
        assert_eq!(ledger.release(a), Release::Released);
        assert_eq!(
            ledger.free(r, false),
            1,
            "a release frees only its own unit"
        );
        assert!(ledger.end_refused_hold(r));
        assert_eq!(ledger.free(r, false), 3);
        assert!(!ledger.end_refused_hold(r), "ended once");
        assert!(ledger.hold_refused(r));
        ledger.fence(r);
        assert_eq!(ledger.usage(r).refused_hold, 0, "a fence ends the hold");
        assert!(!ledger.hold_refused(r), "offline: nothing to hold");
    }
}
