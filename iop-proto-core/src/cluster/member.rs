//! The [`ClusterMember`] machine: its state, its inputs and outputs. What it decides from
//! etcd's answers is in `member/decide.rs`.

mod decide;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use super::{
    ClaimDecision, ClaimTicket, ClusterConfig, ClusterConfigError, ClusterEvent, ClusterUsageError,
    EtcdRequest, KeyValue, LeaseId, LeftReason, Member, Reply, Tag, Transmit, WatchEvent,
};
use crate::time::Timestamp;
use crate::timer::TimerTable;

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
    /// A member whose key went leaves the list told to the nodes.
    Departed,
}

impl crate::timer::TimerKey for Timer {
    fn reason(&self) -> &'static str {
        match self {
            Timer::Expiry => "member lease",
            Timer::KeepAlive => "keep-alive",
            Timer::Retry => "retry",
            Timer::Node(_) => "node lease",
            Timer::Resync => "resync",
            Timer::Departed => "departed member",
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
    Status {
        lease: LeaseId,
    },
    Claim {
        ticket: ClaimTicket,
        node_id: String,
        instance: u64,
        sent: Timestamp,
    },
    /// A keep-alive of a node lease, for `purpose`.
    NodeKeepAlive {
        node_id: String,
        instance: u64,
        lease: LeaseId,
        sent: Timestamp,
        purpose: Renewal,
    },
    /// A claim of an instance served here without etcd's word (its node lease could not
    /// be renewed in time, or this Edge lost its own lease).
    Reclaim {
        node_id: String,
        instance: u64,
        sent: Timestamp,
    },
    /// A read of the prefix; `seen` is the revision the member had reached when it asked.
    Sync {
        seen: u64,
    },
}

/// Why a node lease is renewed.
#[derive(Clone, Copy, Debug)]
enum Renewal {
    /// It is served here: keep vouching for it.
    Renew,
    /// A register waits for it (the key is another Edge's): admit once confirmed.
    Admit(ClaimTicket, u64),
    /// An instance served here unvouched found the key naming it, under another Edge's
    /// lease: vouch for it again once confirmed. With the key's create revision.
    Adopt(u64),
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
    retry_status: bool,
    retry_reclaim: bool,
    /// Since when this Edge serves without its lease (it had joined, then lost it); until
    /// it joins again.
    detached_since: Option<Timestamp>,
    /// Since when etcd has not answered: the first failed request after the last answer.
    unanswered_since: Option<Timestamp>,
    /// Members whose key went, listed to the nodes until then (module docs).
    departed: BTreeMap<String, (Vec<u8>, Timestamp)>,
    /// This Edge's answer to the last configuration offered (`<revision> ok` or
    /// `<revision> refused: ...`), which `config push` waits for under
    /// `<prefix>/status/<edge id>`: written with the member lease, so written again under
    /// each new lease (an etcd started afresh knows none of the old ones).
    status: Option<Vec<u8>>,
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
    /// Its `Timer::Node`: vouched for until then unless a renewal sent before is
    /// confirmed.
    slot: u64,
    renewing: bool,
    /// Whether this Edge vouches for it: a renewal of its node lease that it sent within
    /// the last TTL is confirmed. When not, it is served on the last known state and
    /// claimed again once etcd answers.
    vouched: bool,
    /// A claim again is in flight.
    reclaiming: bool,
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
            retry_status: false,
            retry_reclaim: false,
            detached_since: None,
            unanswered_since: None,
            departed: BTreeMap::new(),
            status: None,
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

    /// Whether this Edge is a member now: it holds its lease and may admit new node
    /// instances.
    #[must_use]
    pub fn is_member(&self) -> bool {
        self.joined
    }

    /// Whether this Edge serves callers: a member, or one that was and lost its lease
    /// ([`detached_since`](Self::detached_since)), serving on the last known state. False
    /// only before it first joined.
    #[must_use]
    pub fn serves(&self) -> bool {
        self.joined || self.detached_since.is_some()
    }

    /// Since when this Edge has served without its lease (etcd did not renew it in time,
    /// or said it was gone); `None` while it is a member, and before it first joined.
    #[must_use]
    pub fn detached_since(&self) -> Option<Timestamp> {
        self.detached_since
    }

    /// Since when etcd has not answered this Edge: the first request that failed after
    /// the last one answered. `None` while etcd answers.
    #[must_use]
    pub fn unanswered_since(&self) -> Option<Timestamp> {
        self.unanswered_since
    }

    /// The instance this Edge vouches for under `node_id` (etcd's word that the node id is
    /// its, renewed within the last TTL); `None` when none is served here, or the one
    /// served is served on the last known state.
    #[must_use]
    pub fn vouches(&self, node_id: &str) -> Option<u64> {
        self.serving
            .get(node_id)
            .filter(|s| s.vouched)
            .map(|s| s.instance)
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
        if matches!(reply, Reply::Failed) {
            self.unanswered_since.get_or_insert(now);
        } else {
            self.unanswered_since = None;
        }
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
                    // The last answer, under this lease (the one it had may be gone).
                    self.write_status();
                }
            }
            (Pending::MemberKey { lease }, _) => {
                if self.lease == Some(lease) {
                    self.retry(|m| m.retry_member_key = true);
                }
            }
            (Pending::Status { .. }, Reply::Put { .. }) => {}
            (Pending::Status { lease }, _) => {
                if self.lease == Some(lease) {
                    self.retry(|m| m.retry_status = true);
                }
            }
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
                    purpose,
                },
                reply,
            ) => self.node_renewed(node_id, instance, lease, sent, purpose, reply),
            (
                Pending::Reclaim {
                    node_id,
                    instance,
                    sent,
                },
                reply,
            ) => self.reclaimed(node_id, instance, sent, reply),
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
        let value = match outcome {
            Ok(()) => format!("{revision} ok"),
            Err(reason) => format!("{revision} refused: {reason}"),
        };
        self.status = Some(value.into_bytes());
        self.write_status();
    }

    /// Writes the last configuration answer under the member lease, when both are there
    /// (a lease granted later writes it then, once its member key is in).
    fn write_status(&mut self) {
        let (Some(lease), Some(value)) = (self.lease, self.status.clone()) else {
            return;
        };
        if !self.member_key_written {
            return;
        }
        let key = format!("{}/status/{}", self.config.prefix, self.config.edge_id);
        self.send(
            EtcdRequest::Put { key, value, lease },
            Pending::Status { lease },
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
                        self.unvouch(&node_id);
                    }
                }
                Timer::KeepAlive => self.renew(now),
                Timer::Retry => self.ask_again(),
                Timer::Resync => self.sync(),
                Timer::Departed => self.view_changed(),
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
            .filter(|(_, s)| s.vouched && !s.renewing)
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
                    purpose: Renewal::Renew,
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
        if std::mem::take(&mut self.retry_status) {
            self.write_status();
        }
        if std::mem::take(&mut self.retry_reclaim) {
            self.reclaim_all();
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
        // What is served here is decided here, member or not: another session of an
        // instance held is no new instance.
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
        if self.lease.is_none() || !self.joined || self.claiming.contains(node_id) {
            self.events.push_back(decided(ClaimDecision::Unavailable));
            return Ok(ticket);
        }
        self.claiming.insert(node_id.to_owned());
        self.send(
            self.claim_request(node_id, instance),
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
}

/// The instance a node id's key names; `None` for a value that is not one.
fn parse_instance(value: &[u8]) -> Option<u64> {
    std::str::from_utf8(value).ok()?.parse().ok()
}
