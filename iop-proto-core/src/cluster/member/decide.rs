//! What a [`ClusterMember`] makes of etcd's answers and its own timers: the lease and
//! member key, the view of the prefix and what changes in it, the claims and renewals of
//! node leases. Private to the member; its inputs are in `member.rs`.

use super::super::{
    ClaimDecision, ClaimTicket, ClusterEvent, EtcdRequest, LeaseId, LeftReason, Member, Reply, Tag,
    Transmit,
};
use super::{ClusterMember, Pending, Served, Timer, parse_instance};
use crate::time::Timestamp;

impl ClusterMember {
    pub(super) fn advance(&mut self, now: Timestamp) {
        debug_assert!(now >= self.last_now, "time went backwards");
        self.last_now = self.last_now.max(now);
    }

    pub(super) fn send(&mut self, request: EtcdRequest, pending: Pending) {
        let tag = Tag(self.next_tag);
        self.next_tag += 1;
        self.pending.insert(tag, pending);
        self.transmits.push_back(Transmit { tag, request });
    }

    pub(super) fn grant(&mut self) {
        self.send(
            EtcdRequest::Grant {
                ttl: self.config.lease_ttl,
            },
            Pending::Grant {
                sent: self.last_now,
            },
        );
    }

    pub(super) fn sync(&mut self) {
        if self.syncing {
            return;
        }
        self.syncing = true;
        let prefix = format!("{}/", self.config.prefix);
        let seen = self.revision;
        self.send(EtcdRequest::Sync { prefix }, Pending::Sync { seen });
    }

    pub(super) fn retry(&mut self, what: impl FnOnce(&mut Self)) {
        what(self);
        let at = self.last_now.saturating_add(self.config.retry_after);
        let at = self.timers.get(Timer::Retry).map_or(at, |t| t.min(at));
        self.timers.set(Timer::Retry, at);
    }

    pub(super) fn write_member_key(&mut self) {
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

    pub(super) fn maybe_join(&mut self) {
        if !self.joined && self.lease.is_some() && self.member_key_written && self.synced {
            self.joined = true;
            self.events.push_back(ClusterEvent::Joined);
        }
    }

    pub(super) fn decide_claim(
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

    pub(super) fn serve(
        &mut self,
        node_id: &str,
        instance: u64,
        fence: u64,
        lease: LeaseId,
        sent: Timestamp,
    ) {
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
    pub(super) fn fence(&mut self, node_id: String) {
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
    pub(super) fn extend(&mut self, timer: Timer, until: Timestamp) {
        if self.timers.get(timer).is_some_and(|at| at < until) {
            self.timers.set(timer, until);
        }
    }

    pub(super) fn node_renewed(
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

    pub(super) fn lose_lease(&mut self, reason: LeftReason) {
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

    pub(super) fn view_changed(&mut self) {
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
