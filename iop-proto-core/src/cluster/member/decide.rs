//! What a [`ClusterMember`] makes of etcd's answers and its own timers: the lease and
//! member key, the view of the prefix and what changes in it, the claims and renewals of
//! node leases. Private to the member; its inputs are in `member.rs`.

use super::super::{
    ClaimDecision, ClaimTicket, ClusterEvent, EtcdRequest, LeaseId, LeftReason, Member, Reply, Tag,
    Transmit,
};
use super::{ClusterMember, Pending, Renewal, Served, Timer, parse_instance};
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
            self.detached_since = None;
            self.events.push_back(ClusterEvent::Joined);
            // What was served on the last known state is claimed again now.
            self.reclaim_all();
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
                            purpose: Renewal::Admit(ticket, holder.create_revision),
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
                vouched: true,
                reclaiming: false,
            },
        );
    }

    /// etcd's word on `node_id` is no longer fresh here (its node lease was not renewed
    /// in time, or is gone): serve it on, and claim it again when etcd can be asked.
    pub(super) fn unvouch(&mut self, node_id: &str) {
        let Some(served) = self.serving.get_mut(node_id) else {
            return;
        };
        served.vouched = false;
        self.timers.stop(Timer::Node(served.slot));
        self.reclaim(node_id.to_owned());
    }

    /// Claims `node_id`'s instance again, once this Edge is a member and no claim of it
    /// is in flight already.
    pub(super) fn reclaim(&mut self, node_id: String) {
        if !self.joined {
            return;
        }
        let Some(served) = self
            .serving
            .get_mut(&node_id)
            .filter(|s| !s.vouched && !s.reclaiming)
        else {
            return;
        };
        served.reclaiming = true;
        let instance = served.instance;
        self.send(
            self.claim_request(&node_id, instance),
            Pending::Reclaim {
                node_id,
                instance,
                sent: self.last_now,
            },
        );
    }

    /// The one-step claim of `node_id` for `instance` (a register's, or a claim again).
    pub(super) fn claim_request(&self, node_id: &str, instance: u64) -> EtcdRequest {
        EtcdRequest::Claim {
            key: format!("{}/nodes/{node_id}", self.config.prefix),
            value: instance.to_string().into_bytes(),
            ttl: self.config.lease_ttl,
        }
    }

    /// Claims again every instance served here without etcd's word.
    pub(super) fn reclaim_all(&mut self) {
        let mut unvouched: Vec<String> = self
            .serving
            .iter()
            .filter(|(_, s)| !s.vouched)
            .map(|(node_id, _)| node_id.clone())
            .collect();
        unvouched.sort();
        for node_id in unvouched {
            self.reclaim(node_id);
        }
    }

    /// etcd's answer to a claim again: the key names another instance (fence this one),
    /// was created for this one now (vouch), or names this one under another Edge's lease
    /// (vouch once a renewal from here is confirmed). Anything else is asked again.
    pub(super) fn reclaimed(
        &mut self,
        node_id: String,
        instance: u64,
        sent: Timestamp,
        reply: Reply,
    ) {
        let Some(served) = self
            .serving
            .get_mut(&node_id)
            .filter(|s| s.instance == instance && s.reclaiming)
        else {
            // Released meanwhile: a key it created runs out with its lease.
            return;
        };
        served.reclaiming = false;
        let Reply::Claimed { holder, created } = reply else {
            self.retry(|m| m.retry_reclaim = true);
            return;
        };
        match parse_instance(&holder.value) {
            Some(owner) if owner != instance => self.fence(node_id),
            None => self.retry(|m| m.retry_reclaim = true),
            Some(_) if created => self.vouch(&node_id, holder.create_revision, holder.lease, sent),
            Some(_) => {
                if let Some(served) = self.serving.get_mut(&node_id) {
                    served.reclaiming = true;
                }
                self.send(
                    EtcdRequest::KeepAlive {
                        lease: holder.lease,
                    },
                    Pending::NodeKeepAlive {
                        node_id,
                        instance,
                        lease: holder.lease,
                        sent: self.last_now,
                        purpose: Renewal::Adopt(holder.create_revision),
                    },
                );
            }
        }
    }

    /// `node_id`'s instance has etcd's word again, under `lease`, from a request sent at
    /// `sent`.
    pub(super) fn vouch(&mut self, node_id: &str, fence: u64, lease: LeaseId, sent: Timestamp) {
        let until = sent.saturating_add(self.config.lease_ttl);
        let Some(served) = self.serving.get_mut(node_id) else {
            return;
        };
        served.vouched = true;
        served.reclaiming = false;
        served.renewing = false;
        served.fence = fence;
        served.lease = lease;
        let slot = served.slot;
        self.timers.set(Timer::Node(slot), until);
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
        purpose: Renewal,
        reply: Reply,
    ) {
        let alive = matches!(reply, Reply::KeptAlive { ttl } if !ttl.is_zero());
        // etcd says the lease is gone: the key went with it.
        let gone = matches!(reply, Reply::KeptAlive { ttl } if ttl.is_zero());
        match purpose {
            Renewal::Admit(ticket, fence) => {
                self.claiming.remove(&node_id);
                let decision = if alive && self.joined && !self.serving.contains_key(&node_id) {
                    self.serve(&node_id, instance, fence, lease, sent);
                    ClaimDecision::Admitted { fence }
                } else {
                    ClaimDecision::Unavailable
                };
                self.events
                    .push_back(ClusterEvent::Claim { ticket, decision });
            }
            Renewal::Adopt(fence) => {
                let Some(served) = self
                    .serving
                    .get_mut(&node_id)
                    .filter(|s| s.instance == instance && s.reclaiming)
                else {
                    return;
                };
                served.reclaiming = false;
                if alive {
                    self.vouch(&node_id, fence, lease, sent);
                } else {
                    // Gone since the claim read it, or not answered: claim again.
                    self.retry(|m| m.retry_reclaim = true);
                }
            }
            Renewal::Renew => {
                let Some(served) = self
                    .serving
                    .get_mut(&node_id)
                    .filter(|s| s.lease == lease && s.instance == instance && s.vouched)
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
                } else if gone {
                    self.unvouch(&node_id);
                }
            }
        }
    }

    /// The member's lease is lost: it serves on, detached, what it holds, without
    /// vouching for any of it, and joins again as soon as etcd answers.
    pub(super) fn lose_lease(&mut self, reason: LeftReason) {
        self.lease = None;
        self.timers.stop(Timer::Expiry);
        self.timers.stop(Timer::KeepAlive);
        self.member_key_written = false;
        if std::mem::take(&mut self.joined) {
            self.detached_since.get_or_insert(self.last_now);
            self.events.push_back(ClusterEvent::Detached(reason));
        }
        // Nothing is claimed again before it joins (`maybe_join` does).
        let mut held: Vec<String> = self.serving.keys().cloned().collect();
        held.sort();
        for node_id in held {
            self.unvouch(&node_id);
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
        // tell its nodes to leave the very Edge that sends it. A detached Edge serves on,
        // and lists itself so.
        if self.member_key_written || self.detached_since.is_some() {
            let own = Member {
                edge_id: self.config.edge_id.clone(),
                info: self.config.member_info.clone(),
            };
            match members.binary_search_by(|m| m.edge_id.cmp(&own.edge_id)) {
                Ok(at) => members[at] = own,
                Err(at) => members.insert(at, own),
            }
        }
        self.keep_departed(&mut members);
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

    /// Adds to `members` those whose key went less than a TTL ago (module docs), and
    /// sets the timer for the next to leave.
    fn keep_departed(&mut self, members: &mut Vec<Member>) {
        let now = self.last_now;
        let until = now.saturating_add(self.config.lease_ttl);
        let listed = |members: &Vec<Member>, id: &str| members.iter().any(|m| m.edge_id == id);
        for gone in &self.members_seen {
            if !listed(members, &gone.edge_id) && !self.departed.contains_key(&gone.edge_id) {
                self.departed
                    .insert(gone.edge_id.clone(), (gone.info.clone(), until));
            }
        }
        self.departed
            .retain(|id, (_, until)| !listed(members, id) && *until > now);
        for (id, (info, _)) in &self.departed {
            members.push(Member {
                edge_id: id.clone(),
                info: info.clone(),
            });
        }
        members.sort_by(|a, b| a.edge_id.cmp(&b.edge_id));
        match self.departed.values().map(|(_, until)| *until).min() {
            Some(at) => self.timers.set(Timer::Departed, at),
            None => self.timers.stop(Timer::Departed),
        }
    }
}
