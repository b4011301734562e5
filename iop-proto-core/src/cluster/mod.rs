//! One Edge's part in a cluster of Edges coordinated through etcd (docs/cluster.md).
//!
//! [`ClusterMember`] decides what an Edge asks etcd and what it makes of the answers: its
//! lease and member key, the shared configuration it applies, and whether a node id may be
//! served here. It never talks to etcd itself: it hands out typed requests
//! ([`poll_transmit`](ClusterMember::poll_transmit)), the shell performs them and feeds the
//! answers back ([`handle_reply`](ClusterMember::handle_reply)) with what the watch on the
//! cluster's prefix delivers ([`handle_watch`](ClusterMember::handle_watch)).
//!
//! The rules it keeps:
//! - **Membership** is a lease and a key under `<prefix>/members/` attached to it, renewed
//!   every `keepalive_every`. The lease counts as lost once `lease_ttl` has passed since the
//!   Edge *sent* the last keep-alive etcd confirmed: etcd cannot have expired it earlier, so
//!   the Edge always stops first.
//! - **A node id is owned once.** Its owner is the instance named by one key,
//!   `<prefix>/nodes/<node id>` = instance, created only if absent and attached to a lease
//!   of its own, the *node lease*, that every Edge serving the instance keeps alive. An Edge
//!   *vouches* for an instance while it has confirmed, within the last TTL, a keep-alive of
//!   that lease sent by itself: the key cannot have expired meanwhile, so no other instance
//!   can have created it again. A new instance is admitted only so (or on etcd's word that
//!   it created the key). When the last Edge serving the instance stops renewing, the lease
//!   and the key go, and another instance may take the id. (A first design gave each Edge
//!   a claim key of its own and made the oldest claim the owner; the simulation found a
//!   claim written and then refused by an Edge killed midway that became the oldest once
//!   the claims before it went, while a newer one was being served.)
//! - **etcd's silence stops nothing that runs** (static stability). A member whose own
//!   lease runs out, or who cannot renew a node lease in time, keeps serving the instances
//!   it holds, on the configuration and members it last saw
//!   ([`ClusterEvent::Detached`]); it only stops what needs etcd's word: admitting an
//!   instance it does not hold, applying a new configuration. Once etcd answers it claims
//!   each unvouched instance again ([`EtcdRequest::Claim`]); an instance is fenced
//!   ([`ClusterEvent::Fence`]) only when etcd says another instance holds its node id.
//!   What this costs: an instance that reaches only detached Edges lets its node lease
//!   run out, and a second process started with the same node id may be admitted by an
//!   Edge that reaches etcd. Both then serve until the detached side hears from etcd; each
//!   node process's own capacity gate still bounds what its providers see
//!   (docs/cluster.md, "When etcd is unreachable").
//! - **A member leaves the list slowly.** A member whose key went is listed to the nodes
//!   for one more TTL: an etcd that returns after an outage expires every lease at once,
//!   and the members put their keys back within a second or two; nodes told the short
//!   list would drop their sessions with every Edge in turn.
//! - **Configuration** comes from `<prefix>/config`; each revision is offered once, in order
//!   ([`ClusterEvent::Configure`]), the shell validates and applies it as a reload and says
//!   how it went ([`handle_configured`](ClusterMember::handle_configured)), and the outcome
//!   is written under `<prefix>/status/<edge id>` for `iop-edge config push` to read.
//! - **The watch is checked.** A watch that stalls without its connection breaking
//!   delivers nothing and says nothing, so every `resync_every` the member reads the prefix
//!   again ([`EtcdRequest::Sync`]; the shell watches on from the read's revision, on a new
//!   connection). What the watch missed arrives with the read; a read older than what the
//!   watch already delivered changes nothing.

use std::time::Duration;

/// An etcd lease, as etcd numbered it.
pub type LeaseId = i64;

/// Tells a request's answer from another's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(pub u64);

/// A pending [`ClusterMember::claim_node`], answered by [`ClusterEvent::Claim`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClaimTicket(pub u64);

/// What a member is and how often it speaks to etcd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterConfig {
    /// This Edge's id, unique in the cluster (a key name: no `/`).
    pub edge_id: String,
    /// The cluster's key prefix, without a trailing `/`.
    pub prefix: String,
    /// What this Edge publishes under its member key (its addresses, version), opaque here.
    pub member_info: Vec<u8>,
    /// The lease's time to live.
    pub lease_ttl: Duration,
    /// How often the lease is renewed: well under `lease_ttl`, so that a lost keep-alive
    /// or two does not lose it.
    pub keepalive_every: Duration,
    /// How long after a failed request it is asked again.
    pub retry_after: Duration,
    /// How often the prefix is read again (and the watch started anew from the read), so
    /// that a watch that stalled silently misses changes for at most this long.
    pub resync_every: Duration,
}

impl ClusterConfig {
    /// A member with etcd's usual timing for such leases: 10 s to live, renewed every 3 s,
    /// failed requests retried after 1 s; the prefix read again every 30 s.
    #[must_use]
    pub fn new(edge_id: &str, prefix: &str, member_info: Vec<u8>) -> Self {
        ClusterConfig {
            edge_id: edge_id.to_owned(),
            prefix: prefix.trim_end_matches('/').to_owned(),
            member_info,
            lease_ttl: Duration::from_secs(10),
            keepalive_every: Duration::from_secs(3),
            retry_after: Duration::from_secs(1),
            resync_every: Duration::from_secs(30),
        }
    }
}

/// Why a [`ClusterConfig`] cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterConfigError {
    /// The edge id is empty or holds a `/`.
    #[error("cluster.edge_id {0:?} must be a non-empty name without '/'")]
    EdgeId(String),
    /// The keep-alive interval does not fit three times into the lease's time to live.
    #[error("the lease must be renewed at least three times per TTL (every {every:?} for {ttl:?})")]
    KeepAlive {
        /// The lease's time to live.
        ttl: Duration,
        /// The renewal interval asked for.
        every: Duration,
    },
    /// The prefix would never be read again.
    #[error("the cluster's prefix must be read again at some interval (resync_every is zero)")]
    ResyncEvery,
}

/// A request for etcd; the shell performs it and answers with the matching [`Reply`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EtcdRequest {
    /// Grant a lease of `ttl` (answer: [`Reply::Granted`]).
    Grant {
        /// Its time to live.
        ttl: Duration,
    },
    /// Renew `lease` once (answer: [`Reply::KeptAlive`]).
    KeepAlive {
        /// The lease.
        lease: LeaseId,
    },
    /// Put `value` at `key`, attached to `lease` (answer: [`Reply::Put`]).
    Put {
        /// The key.
        key: String,
        /// The value.
        value: Vec<u8>,
        /// The lease the key lives with.
        lease: LeaseId,
    },
    /// Claim a node id in one step: grant a lease of `ttl`, then, in one transaction,
    /// create `key` = `value` attached to it if `key` is absent, and read `key` (answer:
    /// [`Reply::Claimed`]). If the key was there, the new lease is revoked.
    Claim {
        /// The node id's key.
        key: String,
        /// The instance, in decimal.
        value: Vec<u8>,
        /// The node lease's time to live.
        ttl: Duration,
    },
    /// Read every key under `prefix` and the store's revision, then watch the prefix from
    /// the next revision on (answer: [`Reply::Synced`], then [`ClusterMember::handle_watch`]
    /// calls until the watch breaks).
    Sync {
        /// The cluster's prefix, with its trailing `/`.
        prefix: String,
    },
}

/// One request to perform. Every one must be answered, in any order: with what etcd said,
/// or with [`Reply::Failed`] once the shell gives up on it (a timeout, a lost connection).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transmit {
    /// Given back with the answer.
    pub tag: Tag,
    /// What to ask.
    pub request: EtcdRequest,
}

/// A key as etcd holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    /// The key.
    pub key: String,
    /// Its value.
    pub value: Vec<u8>,
    /// The revision that created it.
    pub create_revision: u64,
    /// The revision that last changed it.
    pub mod_revision: u64,
    /// The lease it lives with (0: none).
    pub lease: LeaseId,
}

/// etcd's answer to a [`Transmit`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// The lease was granted.
    Granted {
        /// Its id.
        lease: LeaseId,
        /// The time to live etcd granted.
        ttl: Duration,
    },
    /// The lease was renewed; a `ttl` of zero means it had already expired.
    KeptAlive {
        /// What etcd says it has left.
        ttl: Duration,
    },
    /// The key was written at `revision`.
    Put {
        /// The store's revision after the write.
        revision: u64,
    },
    /// The node id's key after the claim: created by it (`created`), or as it was.
    Claimed {
        /// The key.
        holder: KeyValue,
        /// Whether this claim created it.
        created: bool,
    },
    /// Every key under the prefix at `revision`.
    Synced {
        /// The store's revision the read saw.
        revision: u64,
        /// The keys.
        kvs: Vec<KeyValue>,
    },
    /// The request failed or timed out: etcd could not be asked, or did not answer.
    Failed,
}

/// A change the watch delivered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    /// A key was written.
    Put(KeyValue),
    /// A key was deleted (or its lease expired) at `revision`.
    Delete {
        /// The key.
        key: String,
        /// The revision of the deletion.
        revision: u64,
    },
}

/// Another Edge of the cluster, or this one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Its id.
    pub edge_id: String,
    /// What it published.
    pub info: Vec<u8>,
}

/// The outcome of [`ClusterMember::claim_node`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimDecision {
    /// Serve it. `fence` is the create revision of the node id's key: the same for every
    /// Edge that serves this instance, and greater for any later owner.
    Admitted {
        /// The key's create revision.
        fence: u64,
    },
    /// Another instance owns the node id; refuse the register and let it retry later.
    HeldBy {
        /// The owning instance.
        instance: u64,
    },
    /// This Edge cannot decide now (not a member, etcd did not answer): refuse, retry later.
    Unavailable,
}

/// Why this Edge lost its lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeftReason {
    /// A lease TTL passed without a confirmed keep-alive.
    LeaseExpired,
    /// etcd said the lease no longer exists.
    LeaseRevoked,
}

/// What the shell acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterEvent {
    /// This Edge is a member: its lease and member key are written and it has read the
    /// cluster. It may admit nodes and answer `/healthz`.
    Joined,
    /// This Edge lost its lease: it is no longer a member in etcd, but keeps serving the
    /// instances it holds on the configuration and members it last saw, and answers
    /// `/healthz` as before. It admits no instance it does not hold until it has joined
    /// again ([`ClusterEvent::Joined`]), which it tries to at once.
    Detached(LeftReason),
    /// The members, as the watch shows them now (sorted by edge id), this Edge included
    /// once its own key is written, even before the watch shows it: a list sent to nodes
    /// always names its sender.
    Members(Vec<Member>),
    /// A configuration to validate and apply; answer with
    /// [`ClusterMember::handle_configured`].
    Configure {
        /// Its revision.
        revision: u64,
        /// The shared configuration's text.
        text: Vec<u8>,
    },
    /// A claim was decided.
    Claim {
        /// The claim's ticket.
        ticket: ClaimTicket,
        /// What to do with the register.
        decision: ClaimDecision,
    },
    /// Stop serving this instance of the node id: etcd says another instance holds it.
    /// Drain its sessions and close them.
    Fence {
        /// The node id.
        node_id: String,
        /// The instance.
        instance: u64,
    },
}

/// Misuse of [`ClusterMember`]'s API.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterUsageError {
    /// A reply for a tag that was not handed out or was answered already.
    #[error("no request {0:?} is waiting for an answer")]
    UnknownTag(Tag),
    /// A node id that cannot be a key name.
    #[error("node id {0:?} cannot be a key name")]
    NodeId(String),
}

mod links;
mod member;

pub use links::{HeardMembers, LinkEvent, MemberLinks, dialable};
pub use member::ClusterMember;
