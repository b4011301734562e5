//! The simulated etcd: a linearizable key-value store with leases and a change history.

use iop_proto_core::Timestamp;
use iop_proto_core::cluster::{EtcdRequest, KeyValue, LeaseId, Reply, WatchEvent};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

#[derive(Clone, Debug)]
pub(super) struct Stored {
    pub(super) value: Vec<u8>,
    pub(super) create: u64,
    pub(super) modified: u64,
    pub(super) lease: Option<LeaseId>,
}

/// A linearizable key-value store with leases and a change history, as etcd keeps.
#[derive(Debug, Default)]
pub(super) struct Store {
    pub(super) revision: u64,
    pub(super) kvs: BTreeMap<String, Stored>,
    /// Live leases and when they expire.
    pub(super) leases: HashMap<LeaseId, (Timestamp, Duration)>,
    pub(super) next_lease: LeaseId,
    /// Every change, in revision order, with when it happened.
    pub(super) history: Vec<(Timestamp, WatchEvent)>,
}

impl Store {
    pub(super) fn kv(key: &str, stored: &Stored) -> KeyValue {
        KeyValue {
            key: key.to_owned(),
            value: stored.value.clone(),
            create_revision: stored.create,
            mod_revision: stored.modified,
            lease: stored.lease.unwrap_or(0),
        }
    }

    pub(super) fn put(
        &mut self,
        now: Timestamp,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) {
        self.revision += 1;
        let create = self.kvs.get(key).map_or(self.revision, |s| s.create);
        let stored = Stored {
            value,
            create,
            modified: self.revision,
            lease,
        };
        self.history
            .push((now, WatchEvent::Put(Self::kv(key, &stored))));
        self.kvs.insert(key.to_owned(), stored);
    }

    pub(super) fn delete(&mut self, now: Timestamp, key: &str) {
        if self.kvs.remove(key).is_some() {
            self.revision += 1;
            self.history.push((
                now,
                WatchEvent::Delete {
                    key: key.to_owned(),
                    revision: self.revision,
                },
            ));
        }
    }

    pub(super) fn range(&self, prefix: &str) -> Vec<KeyValue> {
        self.kvs
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, s)| Self::kv(k, s))
            .collect()
    }

    pub(super) fn lease_alive(&self, lease: LeaseId) -> bool {
        self.leases.contains_key(&lease)
    }

    pub(super) fn expire(&mut self, now: Timestamp) {
        let mut expired: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, (at, _))| *at <= now)
            .map(|(l, _)| *l)
            .collect();
        expired.sort_unstable();
        for lease in expired {
            self.leases.remove(&lease);
            let keys: Vec<String> = self
                .kvs
                .iter()
                .filter(|(_, s)| s.lease == Some(lease))
                .map(|(k, _)| k.clone())
                .collect();
            for key in keys {
                self.delete(now, &key);
            }
        }
    }

    pub(super) fn next_expiry(&self) -> Option<Timestamp> {
        self.leases.values().map(|(at, _)| *at).min()
    }

    pub(super) fn apply(&mut self, now: Timestamp, request: &EtcdRequest) -> Reply {
        self.expire(now);
        match request {
            EtcdRequest::Grant { ttl } => {
                self.next_lease += 1;
                self.leases
                    .insert(self.next_lease, (now.saturating_add(*ttl), *ttl));
                Reply::Granted {
                    lease: self.next_lease,
                    ttl: *ttl,
                }
            }
            EtcdRequest::KeepAlive { lease } => match self.leases.get_mut(lease) {
                Some((at, ttl)) => {
                    *at = now.saturating_add(*ttl);
                    Reply::KeptAlive { ttl: *ttl }
                }
                None => Reply::KeptAlive {
                    ttl: Duration::ZERO,
                },
            },
            EtcdRequest::Put { key, value, lease } => {
                if !self.lease_alive(*lease) {
                    return Reply::Failed;
                }
                self.put(now, key, value.clone(), Some(*lease));
                Reply::Put {
                    revision: self.revision,
                }
            }
            EtcdRequest::Claim { key, value, ttl } => {
                self.next_lease += 1;
                let lease = self.next_lease;
                let created = !self.kvs.contains_key(key);
                if created {
                    self.leases.insert(lease, (now.saturating_add(*ttl), *ttl));
                    self.put(now, key, value.clone(), Some(lease));
                }
                let holder = self.kvs.get(key).map(|s| Self::kv(key, s));
                match holder {
                    Some(holder) => Reply::Claimed { holder, created },
                    None => Reply::Failed,
                }
            }
            EtcdRequest::Sync { prefix } => Reply::Synced {
                revision: self.revision,
                kvs: self.range(prefix),
            },
        }
    }
}
