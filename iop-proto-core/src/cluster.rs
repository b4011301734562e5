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
//!   serves an instance only while it has confirmed, within the last TTL, a keep-alive of
//!   that lease sent by itself: the key cannot have expired meanwhile, so no other instance
//!   can have created it again. When the last Edge serving the instance stops renewing,
//!   the lease and the key go, and another instance may take the id. (A first design gave
//!   each Edge a claim key of its own and made the oldest claim the owner; the simulation
//!   found a claim written and then refused by an Edge killed midway that became the
//!   oldest once the claims before it went, while a newer one was being served.)
//! - **A lease runs out:** the Edge's own lease lost fences every instance served here
//!   ([`ClusterEvent::Fence`]) and it stops being a member; a node lease it could not renew
//!   in time fences that instance.
//! - **Configuration** comes from `<prefix>/config`; each revision is offered once, in order
//!   ([`ClusterEvent::Configure`]), the shell validates and applies it as a reload and says
//!   how it went ([`handle_configured`](ClusterMember::handle_configured)), and the outcome
//!   is written under `<prefix>/status/<edge id>` for `iop-edge config push` to read.
//! - **The watch is checked.** A watch that stalls without its connection breaking
//!   delivers nothing and says nothing, so every `resync_every` the member reads the prefix
//!   again ([`EtcdRequest::Sync`]; the shell watches on from the read's revision, on a new
//!   connection). What the watch missed arrives with the read; a read older than what the
//!   watch already delivered changes nothing.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use crate::time::Timestamp;
use crate::timer::TimerTable;

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

/// Why this Edge stopped being a member.
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
    /// This Edge is no longer a member: stop admitting nodes, answer `/healthz` with 503.
    /// Every instance served here gets a [`ClusterEvent::Fence`] first.
    Left(LeftReason),
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
    /// Stop serving this instance of the node id: drain its sessions and close them.
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

/// The member's deadlines, in its [`TimerTable`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Timer {
    /// The member's lease runs out unless a renewal sent before it is confirmed. First at
    /// equal times, so a renewal due then is not sent for a lease already lost.
    Expiry,
    /// Renew the member's lease and the node leases of what is served here.
    KeepAlive,
    /// Ask again for what failed: a lease, the member key, a read of the cluster.
    Retry,
    /// The node lease of the instance in this slot runs out.
    Node(u64),
    /// Read the prefix again, in case the watch stalled.
    Resync,
}

impl crate::timer::TimerKey for Timer {
    fn reason(&self) -> &'static str {
        match self {
            Timer::Expiry => "member lease",
            Timer::KeepAlive => "keep-alive",
            Timer::Retry => "retry",
            Timer::Node(_) => "node lease",
            Timer::Resync => "resync",
        }
    }
}

#[derive(Clone, Debug)]
enum Pending {
    Grant {
        sent: Timestamp,
    },
    KeepAlive {
        sent: Timestamp,
        lease: LeaseId,
    },
    MemberKey {
        lease: LeaseId,
    },
    Status,
    Claim {
        ticket: ClaimTicket,
        node_id: String,
        instance: u64,
        sent: Timestamp,
    },
    /// A keep-alive of a node lease; with a ticket, the admission waiting for it.
    NodeKeepAlive {
        node_id: String,
        instance: u64,
        lease: LeaseId,
        sent: Timestamp,
        admit: Option<(ClaimTicket, u64)>,
    },
    /// A read of the prefix; `seen` is the revision the member had reached when it asked.
    Sync {
        seen: u64,
    },
}

/// One Edge's membership, configuration and node-id claims (module docs).
#[derive(Debug)]
pub struct ClusterMember {
    config: ClusterConfig,
    last_now: Timestamp,
    next_tag: u64,
    next_ticket: u64,
    pending: HashMap<Tag, Pending>,
    transmits: VecDeque<Transmit>,
    events: VecDeque<ClusterEvent>,
    /// The lease, once granted, and until it is lost.
    lease: Option<LeaseId>,
    /// Deadlines: the lease counts as live until `Timer::Expiry` (the send time of the
    /// last confirmed keep-alive, or of the grant, plus its TTL), and each served instance
    /// until its `Timer::Node`.
    timers: TimerTable<Timer>,
    member_key_written: bool,
    joined: bool,
    /// Whether a keep-alive is in flight (one at a time).
    keeping_alive: bool,
    /// What to ask again when `Timer::Retry` fires.
    retry_grant: bool,
    retry_member_key: bool,
    retry_sync: bool,
    /// The store as the watch shows it, under the prefix.
    synced: bool,
    syncing: bool,
    revision: u64,
    view: BTreeMap<String, KeyValue>,
    members_seen: Vec<Member>,
    /// The configuration revision last offered to the shell.
    offered_config: u64,
    /// The configuration revision the shell last answered for (applied or refused).
    answered_config: u64,
    /// Instances served here, by node id, and the node id of each timer slot.
    serving: HashMap<String, Served>,
    slots: HashMap<u64, String>,
    next_slot: u64,
    /// Node ids being claimed from here: no second claim meanwhile.
    claiming: HashSet<String>,
}

/// An instance served here, and its node lease.
#[derive(Clone, Copy, Debug)]
struct Served {
    instance: u64,
    fence: u64,
    lease: LeaseId,
    /// Its `Timer::Node`: served until then unless a renewal sent before is confirmed.
    slot: u64,
    renewing: bool,
}

impl ClusterMember {
    /// A member that is not joined yet; its first transmit asks for a lease.
    ///
    /// # Errors
    /// [`ClusterConfigError`] for an edge id that cannot be a key name, or a keep-alive
    /// interval that does not fit three times into the lease's TTL.
    pub fn new(config: ClusterConfig, now: Timestamp) -> Result<Self, ClusterConfigError> {
        if config.edge_id.is_empty() || config.edge_id.contains('/') {
            return Err(ClusterConfigError::EdgeId(config.edge_id));
        }
        if config.keepalive_every.is_zero() || config.keepalive_every * 3 > config.lease_ttl {
            return Err(ClusterConfigError::KeepAlive {
                ttl: config.lease_ttl,
                every: config.keepalive_every,
            });
        }
        if config.resync_every.is_zero() {
            return Err(ClusterConfigError::ResyncEvery);
        }
        let mut member = ClusterMember {
            config,
            last_now: now,
            next_tag: 0,
            next_ticket: 0,
            pending: HashMap::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            lease: None,
            timers: TimerTable::new(),
            member_key_written: false,
            joined: false,
            keeping_alive: false,
            retry_grant: false,
            retry_member_key: false,
            retry_sync: false,
            synced: false,
            syncing: false,
            revision: 0,
            view: BTreeMap::new(),
            members_seen: Vec::new(),
            offered_config: 0,
            answered_config: 0,
            serving: HashMap::new(),
            slots: HashMap::new(),
            next_slot: 0,
            claiming: HashSet::new(),
        };
        member.grant();
        member.sync();
        Ok(member)
    }

    // ----- getters -----

    /// Whether this Edge is a member now: it may admit nodes, and `/healthz` says so.
    #[must_use]
    pub fn is_member(&self) -> bool {
        self.joined
    }

    /// Whether this Edge may serve as a member: joined, and every shared configuration
    /// offered so far is answered (applied or refused), so that what it serves is the
    /// cluster's configuration, not only its own file. An Edge taking over from another
    /// process of its own waits for this before it takes the listeners' callers and
    /// nodes; nodes that register before it are told to try again shortly.
    #[must_use]
    pub fn is_serving(&self) -> bool {
        self.joined && self.answered_config >= self.offered_config
    }

    /// Whether the member's view of the cluster is current: it has read the prefix and its
    /// watch has not broken since. When not, the members and configuration it last
    /// reported are the last it saw, kept until the next read.
    #[must_use]
    pub fn is_synced(&self) -> bool {
        self.synced
    }

    /// The lease held, if any.
    #[must_use]
    pub fn lease(&self) -> Option<LeaseId> {
        self.lease
    }

    /// Until when the lease counts as live here; meaningful while one is held.
    #[must_use]
    pub fn valid_until(&self) -> Timestamp {
        self.timers.get(Timer::Expiry).unwrap_or(Timestamp::ZERO)
    }

    /// The instance served here for `node_id`, with its fence.
    #[must_use]
    pub fn serving(&self, node_id: &str) -> Option<(u64, u64)> {
        self.serving.get(node_id).map(|s| (s.instance, s.fence))
    }

    // ----- inputs -----

    /// etcd's answer to the request tagged `tag`.
    ///
    /// # Errors
    /// [`ClusterUsageError::UnknownTag`] for a tag not waiting for an answer.
    pub fn handle_reply(
        &mut self,
        now: Timestamp,
        tag: Tag,
        reply: Reply,
    ) -> Result<(), ClusterUsageError> {
        self.advance(now);
        let pending = self
            .pending
            .remove(&tag)
            .ok_or(ClusterUsageError::UnknownTag(tag))?;
        match (pending, reply) {
            // A second grant cannot be asked for while a lease is held; if one came, its
            // lease is left to expire.
            (Pending::Grant { .. }, Reply::Granted { .. }) if self.lease.is_some() => {}
            (Pending::Grant { sent }, Reply::Granted { lease, ttl }) => {
                self.lease = Some(lease);
                // Counted from when the grant was asked for: etcd granted it later.
                let until = sent.saturating_add(self.config.lease_ttl.min(ttl));
                self.timers.set(Timer::Expiry, until);
                self.timers.set(
                    Timer::KeepAlive,
                    now.saturating_add(self.config.keepalive_every),
                );
                self.write_member_key();
            }
            (Pending::Grant { .. }, _) => self.retry(|m| m.retry_grant = true),
            (Pending::KeepAlive { sent, lease }, Reply::KeptAlive { ttl }) => {
                self.keeping_alive = false;
                if self.lease != Some(lease) {
                    return Ok(());
                }
                if ttl.is_zero() {
                    self.lose_lease(LeftReason::LeaseRevoked);
                } else {
                    let until = sent.saturating_add(self.config.lease_ttl.min(ttl));
                    self.extend(Timer::Expiry, until);
                }
            }
            (Pending::KeepAlive { .. }, _) => {
                // The next renewal tries again; the expiry timer decides if it is too late.
                self.keeping_alive = false;
            }
            (Pending::MemberKey { lease }, Reply::Put { .. }) => {
                if self.lease == Some(lease) {
                    self.member_key_written = true;
                    // Its own key is in etcd now, whether or not the watch showed it yet.
                    self.view_changed();
                    self.maybe_join();
                }
            }
            (Pending::MemberKey { lease }, _) => {
                if self.lease == Some(lease) {
                    self.retry(|m| m.retry_member_key = true);
                }
            }
            (Pending::Status, _) => {}
            (
                Pending::Claim {
                    ticket,
                    node_id,
                    instance,
                    sent,
                },
                reply,
            ) => self.decide_claim(ticket, node_id, instance, sent, reply),
            (
                Pending::NodeKeepAlive {
                    node_id,
                    instance,
                    lease,
                    sent,
                    admit,
                },
                reply,
            ) => self.node_renewed(node_id, instance, lease, sent, admit, reply),
            (Pending::Sync { seen }, Reply::Synced { revision, kvs }) => {
                self.syncing = false;
                self.timers
                    .set(Timer::Resync, now.saturating_add(self.config.resync_every));
                if revision < seen {
                    // The store went back: an etcd started afresh, its data lost. Its
                    // revisions count again from 1, so what it holds is offered anew.
                    self.offered_config = 0;
                    self.answered_config = 0;
                } else if self.synced && revision < self.revision {
                    // The watch already delivered past this read: it is alive, and the
                    // read has nothing newer (the shell's new watch starts after the read,
                    // and what it repeats is skipped).
                    return Ok(());
                }
                self.synced = true;
                self.revision = revision;
                self.view = kvs.into_iter().map(|kv| (kv.key.clone(), kv)).collect();
                self.view_changed();
                self.maybe_join();
            }
            (Pending::Sync { .. }, _) => {
                // Whether or not the watch still runs, what it shows can no longer be
                // vouched for: the view is the last seen until a read answers.
                self.syncing = false;
                self.synced = false;
                self.retry(|m| m.retry_sync = true);
            }
        }
        Ok(())
    }

    /// Changes the watch delivered, all from one revision or in revision order. Changes at
    /// or below the revision already seen (a watch restarted by the shell) are skipped.
    pub fn handle_watch(&mut self, now: Timestamp, events: Vec<WatchEvent>) {
        self.advance(now);
        if !self.synced {
            return;
        }
        let mut changed = false;
        for event in events {
            match event {
                WatchEvent::Put(kv) if kv.mod_revision > self.revision => {
                    self.revision = kv.mod_revision;
                    self.view.insert(kv.key.clone(), kv);
                    changed = true;
                }
                WatchEvent::Delete { key, revision } if revision > self.revision => {
                    self.revision = revision;
                    self.view.remove(&key);
                    changed = true;
                }
                _ => {}
            }
        }
        if changed {
            self.view_changed();
        }
    }

    /// The watch broke (or its connection did): read the prefix again and watch on.
    pub fn handle_watch_lost(&mut self, now: Timestamp) {
        self.advance(now);
        self.synced = false;
        self.sync();
    }

    /// How the configuration of `revision` went: `Ok` applied, `Err` refused with a reason
    /// (the running configuration stays). Written to the status key for the pusher.
    pub fn handle_configured(
        &mut self,
        now: Timestamp,
        revision: u64,
        outcome: Result<(), String>,
    ) {
        self.advance(now);
        self.answered_config = self.answered_config.max(revision);
        let Some(lease) = self.lease else { return };
        let value = match outcome {
            Ok(()) => format!("{revision} ok"),
            Err(reason) => format!("{revision} refused: {reason}"),
        };
        let key = format!("{}/status/{}", self.config.prefix, self.config.edge_id);
        self.send(
            EtcdRequest::Put {
                key,
                value: value.into_bytes(),
                lease,
            },
            Pending::Status,
        );
    }

    /// Runs what is due at `now`; a spurious call is a no-op.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        self.advance(now);
        while let Some(timer) = self.timers.pop_expired(now) {
            match timer {
                Timer::Expiry => {
                    if self.lease.is_some() {
                        self.lose_lease(LeftReason::LeaseExpired);
                    }
                }
                Timer::Node(slot) => {
                    if let Some(node_id) = self.slots.get(&slot).cloned() {
                        self.fence(node_id);
                    }
                }
                Timer::KeepAlive => self.renew(now),
                Timer::Retry => self.ask_again(),
                Timer::Resync => self.sync(),
            }
        }
    }

    /// Renews the member's lease and the node leases of what is served here, one request
    /// each in flight at most.
    fn renew(&mut self, now: Timestamp) {
        let Some(lease) = self.lease else { return };
        self.timers.set(
            Timer::KeepAlive,
            now.saturating_add(self.config.keepalive_every),
        );
        if !self.keeping_alive {
            self.keeping_alive = true;
            self.send(
                EtcdRequest::KeepAlive { lease },
                Pending::KeepAlive { sent: now, lease },
            );
        }
        let mut due: Vec<(String, Served)> = self
            .serving
            .iter_mut()
            .filter(|(_, s)| !s.renewing)
            .map(|(node, s)| {
                s.renewing = true;
                (node.clone(), *s)
            })
            .collect();
        due.sort_by(|a, b| a.0.cmp(&b.0));
        for (node_id, served) in due {
            self.send(
                EtcdRequest::KeepAlive {
                    lease: served.lease,
                },
                Pending::NodeKeepAlive {
                    node_id,
                    instance: served.instance,
                    lease: served.lease,
                    sent: now,
                    admit: None,
                },
            );
        }
    }

    /// Asks again for what failed.
    fn ask_again(&mut self) {
        if std::mem::take(&mut self.retry_grant) && self.lease.is_none() {
            self.grant();
        }
        if std::mem::take(&mut self.retry_member_key) {
            self.write_member_key();
        }
        if std::mem::take(&mut self.retry_sync) && !self.synced {
            self.sync();
        }
    }

    // ----- mutators -----

    /// Asks whether `instance` of `node_id` may be served here; answered by a
    /// [`ClusterEvent::Claim`] with the returned ticket (at once when it can be decided
    /// without etcd).
    ///
    /// # Errors
    /// [`ClusterUsageError::NodeId`] for a node id that cannot be a key name.
    pub fn claim_node(
        &mut self,
        now: Timestamp,
        node_id: &str,
        instance: u64,
    ) -> Result<ClaimTicket, ClusterUsageError> {
        self.advance(now);
        if node_id.is_empty() || node_id.contains('/') {
            return Err(ClusterUsageError::NodeId(node_id.to_owned()));
        }
        let ticket = ClaimTicket(self.next_ticket);
        self.next_ticket += 1;
        let decided = |decision| ClusterEvent::Claim { ticket, decision };
        if self.lease.is_none() || !self.joined {
            self.events.push_back(decided(ClaimDecision::Unavailable));
            return Ok(ticket);
        }
        match self.serving.get(node_id) {
            Some(served) if served.instance == instance => {
                let fence = served.fence;
                self.events
                    .push_back(decided(ClaimDecision::Admitted { fence }));
                return Ok(ticket);
            }
            Some(served) => {
                let held = served.instance;
                self.events
                    .push_back(decided(ClaimDecision::HeldBy { instance: held }));
                return Ok(ticket);
            }
            None => {}
        }
        if self.claiming.contains(node_id) {
            self.events.push_back(decided(ClaimDecision::Unavailable));
            return Ok(ticket);
        }
        self.claiming.insert(node_id.to_owned());
        self.send(
            EtcdRequest::Claim {
                key: format!("{}/nodes/{node_id}", self.config.prefix),
                value: instance.to_string().into_bytes(),
                ttl: self.config.lease_ttl,
            },
            Pending::Claim {
                ticket,
                node_id: node_id.to_owned(),
                instance,
                sent: now,
            },
        );
        Ok(ticket)
    }

    /// The last session of `instance` of `node_id` here ended: this Edge stops renewing
    /// its node lease, which runs out once no Edge renews it.
    pub fn release_node(&mut self, now: Timestamp, node_id: &str, instance: u64) {
        self.advance(now);
        if self
            .serving
            .get(node_id)
            .is_some_and(|s| s.instance == instance)
            && let Some(served) = self.serving.remove(node_id)
        {
            self.timers.stop(Timer::Node(served.slot));
            self.slots.remove(&served.slot);
        }
    }

    // ----- outputs -----

    /// The next request for etcd.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next thing for the shell to act on.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<ClusterEvent> {
        self.events.pop_front()
    }

    /// When [`ClusterMember::handle_timeout`] is next due.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        self.timers.next().map(|wake| wake.at)
    }

    // ----- internals -----

    fn advance(&mut self, now: Timestamp) {
        debug_assert!(now >= self.last_now, "time went backwards");
        self.last_now = self.last_now.max(now);
    }

    fn send(&mut self, request: EtcdRequest, pending: Pending) {
        let tag = Tag(self.next_tag);
        self.next_tag += 1;
        self.pending.insert(tag, pending);
        self.transmits.push_back(Transmit { tag, request });
    }

    fn grant(&mut self) {
        self.send(
            EtcdRequest::Grant {
                ttl: self.config.lease_ttl,
            },
            Pending::Grant {
                sent: self.last_now,
            },
        );
    }

    fn sync(&mut self) {
        if self.syncing {
            return;
        }
        self.syncing = true;
        let prefix = format!("{}/", self.config.prefix);
        let seen = self.revision;
        self.send(EtcdRequest::Sync { prefix }, Pending::Sync { seen });
    }

    fn retry(&mut self, what: impl FnOnce(&mut Self)) {
        what(self);
        let at = self.last_now.saturating_add(self.config.retry_after);
        let at = self.timers.get(Timer::Retry).map_or(at, |t| t.min(at));
        self.timers.set(Timer::Retry, at);
    }

    fn write_member_key(&mut self) {
        let Some(lease) = self.lease else { return };
        let key = format!("{}/members/{}", self.config.prefix, self.config.edge_id);
        self.send(
            EtcdRequest::Put {
                key,
                value: self.config.member_info.clone(),
                lease,
            },
            Pending::MemberKey { lease },
        );
    }

    fn maybe_join(&mut self) {
        if !self.joined && self.lease.is_some() && self.member_key_written && self.synced {
            self.joined = true;
            self.events.push_back(ClusterEvent::Joined);
        }
    }

    fn decide_claim(
        &mut self,
        ticket: ClaimTicket,
        node_id: String,
        instance: u64,
        sent: Timestamp,
        reply: Reply,
    ) {
        self.claiming.remove(&node_id);
        let decision = match reply {
            // Not a member any more: decide nothing (a lease it created runs out alone).
            Reply::Claimed { .. } if !self.joined => ClaimDecision::Unavailable,
            Reply::Claimed { holder, created } => match parse_instance(&holder.value) {
                Some(owner) if owner != instance => ClaimDecision::HeldBy { instance: owner },
                None => ClaimDecision::Unavailable,
                // Created now: its lease was granted after `sent`.
                Some(_) if created => {
                    self.serve(
                        &node_id,
                        instance,
                        holder.create_revision,
                        holder.lease,
                        sent,
                    );
                    ClaimDecision::Admitted {
                        fence: holder.create_revision,
                    }
                }
                // Another Edge's: serve once a renewal of its lease is confirmed.
                Some(_) => {
                    self.claiming.insert(node_id.clone());
                    self.send(
                        EtcdRequest::KeepAlive {
                            lease: holder.lease,
                        },
                        Pending::NodeKeepAlive {
                            node_id,
                            instance,
                            lease: holder.lease,
                            sent: self.last_now,
                            admit: Some((ticket, holder.create_revision)),
                        },
                    );
                    return;
                }
            },
            _ => ClaimDecision::Unavailable,
        };
        self.events
            .push_back(ClusterEvent::Claim { ticket, decision });
    }

    fn serve(&mut self, node_id: &str, instance: u64, fence: u64, lease: LeaseId, sent: Timestamp) {
        let slot = self.next_slot;
        self.next_slot += 1;
        self.slots.insert(slot, node_id.to_owned());
        self.timers.set(
            Timer::Node(slot),
            sent.saturating_add(self.config.lease_ttl),
        );
        self.serving.insert(
            node_id.to_owned(),
            Served {
                instance,
                fence,
                lease,
                slot,
                renewing: false,
            },
        );
    }

    /// Stops serving `node_id`'s instance: its timer goes, and the shell is told.
    fn fence(&mut self, node_id: String) {
        if let Some(served) = self.serving.remove(&node_id) {
            self.timers.stop(Timer::Node(served.slot));
            self.slots.remove(&served.slot);
            self.events.push_back(ClusterEvent::Fence {
                node_id,
                instance: served.instance,
            });
        }
    }

    /// Moves `timer` to `until` if that is later.
    fn extend(&mut self, timer: Timer, until: Timestamp) {
        if self.timers.get(timer).is_some_and(|at| at < until) {
            self.timers.set(timer, until);
        }
    }

    fn node_renewed(
        &mut self,
        node_id: String,
        instance: u64,
        lease: LeaseId,
        sent: Timestamp,
        admit: Option<(ClaimTicket, u64)>,
        reply: Reply,
    ) {
        let alive = matches!(reply, Reply::KeptAlive { ttl } if !ttl.is_zero());
        if let Some((ticket, fence)) = admit {
            self.claiming.remove(&node_id);
            let decision = if alive && self.joined && !self.serving.contains_key(&node_id) {
                self.serve(&node_id, instance, fence, lease, sent);
                ClaimDecision::Admitted { fence }
            } else {
                ClaimDecision::Unavailable
            };
            self.events
                .push_back(ClusterEvent::Claim { ticket, decision });
            return;
        }
        let Some(served) = self
            .serving
            .get_mut(&node_id)
            .filter(|s| s.lease == lease && s.instance == instance)
        else {
            return;
        };
        served.renewing = false;
        let slot = served.slot;
        if alive {
            self.extend(
                Timer::Node(slot),
                sent.saturating_add(self.config.lease_ttl),
            );
        } else if matches!(reply, Reply::KeptAlive { .. }) {
            // etcd says the lease is gone: the key went with it.
            self.fence(node_id);
        }
    }

    fn lose_lease(&mut self, reason: LeftReason) {
        self.lease = None;
        self.timers.stop(Timer::Expiry);
        self.timers.stop(Timer::KeepAlive);
        self.member_key_written = false;
        let mut fenced: Vec<String> = self.serving.keys().cloned().collect();
        fenced.sort();
        for node_id in fenced {
            self.fence(node_id);
        }
        if std::mem::take(&mut self.joined) {
            self.events.push_back(ClusterEvent::Left(reason));
        }
        // Join again: a new lease, a new member key, and the cluster read afresh (what
        // the watch showed cannot be vouched for once etcd went unanswered a TTL).
        self.grant();
        self.synced = false;
        self.sync();
    }

    fn view_changed(&mut self) {
        let members_prefix = format!("{}/members/", self.config.prefix);
        let mut members: Vec<Member> = self
            .view
            .range(members_prefix.clone()..)
            .take_while(|(key, _)| key.starts_with(&members_prefix))
            .map(|(key, kv)| Member {
                edge_id: key[members_prefix.len()..].to_owned(),
                info: kv.value.clone(),
            })
            .collect();
        // Once its own key is written, this Edge is a member whatever its view shows: a
        // read or a watch can lag its own write, and a list without the sender would
        // tell its nodes to leave the very Edge that sends it.
        if self.member_key_written {
            let own = Member {
                edge_id: self.config.edge_id.clone(),
                info: self.config.member_info.clone(),
            };
            match members.binary_search_by(|m| m.edge_id.cmp(&own.edge_id)) {
                Ok(at) => members[at] = own,
                Err(at) => members.insert(at, own),
            }
        }
        if members != self.members_seen {
            self.members_seen.clone_from(&members);
            self.events.push_back(ClusterEvent::Members(members));
        }
        let config_key = format!("{}/config", self.config.prefix);
        if let Some(kv) = self.view.get(&config_key)
            && kv.mod_revision > self.offered_config
        {
            self.offered_config = kv.mod_revision;
            self.events.push_back(ClusterEvent::Configure {
                revision: kv.mod_revision,
                text: kv.value.clone(),
            });
        }
    }
}

/// The instance a node id's key names; `None` for a value that is not one.
fn parse_instance(value: &[u8]) -> Option<u64> {
    std::str::from_utf8(value).ok()?.parse().ok()
}

/// A node's links to the Edges of a cluster (docs/cluster.md, "Which Edges a Node
/// dials"): which member to keep a session with, from the member lists its sessions
/// hear. The configured Edge (the *seed*) is dialled by the node's own supervisor; every
/// other member gets a link of its own while it is listed, and is told to leave once it
/// is not (or once its address changes).
#[derive(Debug, Default)]
pub struct MemberLinks {
    /// The Edge the seed session reached, once it said.
    seed_edge: Option<String>,
    /// Linked members: edge id → node-facing address.
    links: BTreeMap<String, String>,
    events: VecDeque<LinkEvent>,
}

/// What [`MemberLinks`] asks of the shell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkEvent {
    /// Keep a session with this member: dial it, and again after each loss, until told
    /// [`LinkEvent::Leave`].
    Dial {
        /// Its id.
        edge_id: String,
        /// Where to dial (`host:port`).
        addr: String,
    },
    /// Drain and end the session with this member.
    Leave {
        /// Its id.
        edge_id: String,
    },
}

/// Whether `addr` can be dialled: `host:port` with a non-zero port, no whitespace, at
/// most 255 bytes (a node's `edge_addr`, and the members an Edge names).
#[must_use]
pub fn dialable(addr: &str) -> bool {
    addr.len() <= 255
        && !addr.chars().any(char::is_whitespace)
        && addr.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0)
        })
}

/// The member lists a node's sessions heard that its [`MemberLinks`] has not taken yet:
/// the inbox between the sessions, which hear them, and the links, which follow them.
///
/// Each list replaces the one before in [`MemberLinks`], which keeps from the seed's
/// lists only which Edge the seed is. So the last list from the seed and the last from
/// any session say all that the lists in between would: however fast Edges send them,
/// at most two wait here.
#[derive(Debug, Default)]
pub struct HeardMembers {
    /// The seed's last list, when a list from another session came after it.
    seed: Option<crate::wire::ClusterMembers>,
    /// The last list, and whether the seed sent it.
    last: Option<(bool, crate::wire::ClusterMembers)>,
}

impl HeardMembers {
    /// A session heard `members` (`from_seed`: the session to the configured Edge).
    pub fn handle_members(&mut self, from_seed: bool, members: crate::wire::ClusterMembers) {
        let before = self.last.replace((from_seed, members));
        if from_seed {
            // The newer seed list, now last, says which Edge the seed is.
            self.seed = None;
        } else if let Some((true, seed)) = before {
            self.seed = Some(seed);
        }
    }

    /// Whether nothing waits.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.last.is_none()
    }

    /// What waits, oldest first, as [`MemberLinks::handle_members`] should take it in
    /// (at most two lists); empty afterwards.
    pub fn take(&mut self) -> Vec<(bool, crate::wire::ClusterMembers)> {
        let seed = self.seed.take().map(|seed| (true, seed));
        seed.into_iter().chain(self.last.take()).collect()
    }
}

impl MemberLinks {
    /// A session heard the members (`from_seed`: the session dialled to the configured
    /// Edge, whose id `members.edge_id` then is). A member with an address that cannot
    /// be dialled is left out.
    ///
    /// Each list replaces the one before ([`HeardMembers`] coalesces on that), so a list
    /// must name its sender: an Edge lists itself once its own key is written
    /// ([`ClusterEvent::Members`]), even before its view of etcd shows it.
    pub fn handle_members(&mut self, from_seed: bool, members: &crate::wire::ClusterMembers) {
        if from_seed {
            self.seed_edge = Some(members.edge_id.clone());
        }
        let wanted: BTreeMap<&str, &str> = members
            .members
            .iter()
            .filter(|m| self.seed_edge.as_deref() != Some(m.edge_id.as_str()))
            .filter(|m| dialable(&m.node_addr))
            .map(|m| (m.edge_id.as_str(), m.node_addr.as_str()))
            .collect();
        let gone: Vec<String> = self
            .links
            .iter()
            .filter(|(id, addr)| wanted.get(id.as_str()) != Some(&addr.as_str()))
            .map(|(id, _)| id.clone())
            .collect();
        for edge_id in gone {
            self.links.remove(&edge_id);
            self.events.push_back(LinkEvent::Leave { edge_id });
        }
        for (edge_id, addr) in wanted {
            if !self.links.contains_key(edge_id) {
                self.links.insert(edge_id.to_owned(), addr.to_owned());
                self.events.push_back(LinkEvent::Dial {
                    edge_id: edge_id.to_owned(),
                    addr: addr.to_owned(),
                });
            }
        }
    }

    /// The next link to open or close.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<LinkEvent> {
        self.events.pop_front()
    }
}
