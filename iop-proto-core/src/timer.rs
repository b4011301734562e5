//! Keyed timers: every machine keeps its deadlines in one [`TimerTable`], so a timer is
//! set, replaced or stopped by its key (quinn's `TimerTable`, keyed like the per-peer
//! timers of str0m and snownet), [`poll_timeout`](crate::EdgeCore::poll_timeout) is the
//! table's earliest entry, and a [`Wake`] says which timer it is, so traces read
//! `wakes at t=1500ms for liveness`.

use std::collections::BTreeSet;
use std::hash::Hash;

use crate::idhash::IdMap;
use crate::time::Timestamp;

/// A timer key that can name itself in traces.
pub trait TimerKey: Copy + Ord + Hash {
    /// What the timer is for (`"handshake"`, `"liveness"`, ...).
    fn reason(&self) -> &'static str;
}

/// When a machine wants [`handle_timeout`](crate::EdgeCore::handle_timeout), and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Wake {
    /// The deadline.
    pub at: Timestamp,
    /// The timer that sets it, for traces and logs.
    pub reason: &'static str,
}

/// Deadlines by key, at most one per key.
#[derive(Debug, Clone)]
pub struct TimerTable<K> {
    by_key: IdMap<K, Timestamp>,
    by_time: BTreeSet<(Timestamp, K)>,
}

impl<K> Default for TimerTable<K> {
    fn default() -> Self {
        TimerTable {
            by_key: IdMap::default(),
            by_time: BTreeSet::new(),
        }
    }
}

impl<K: TimerKey> TimerTable<K> {
    /// An empty table.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` to fire at `at`, replacing any deadline it had.
    pub fn set(&mut self, key: K, at: Timestamp) {
        if let Some(old) = self.by_key.insert(key, at) {
            self.by_time.remove(&(old, key));
        }
        self.by_time.insert((at, key));
    }

    /// Stops `key`; a key that is not set is left alone.
    pub fn stop(&mut self, key: K) {
        if let Some(at) = self.by_key.remove(&key) {
            self.by_time.remove(&(at, key));
        }
    }

    /// The deadline of `key`, if set.
    #[must_use]
    pub fn get(&self, key: K) -> Option<Timestamp> {
        self.by_key.get(&key).copied()
    }

    /// The earliest deadline and its reason.
    #[must_use]
    pub fn next(&self) -> Option<Wake> {
        self.by_time.first().map(|&(at, key)| Wake {
            at,
            reason: key.reason(),
        })
    }

    /// Removes and returns a timer due at or before `now`, earliest first.
    pub fn pop_expired(&mut self, now: Timestamp) -> Option<K> {
        let &(at, key) = self.by_time.first()?;
        if at > now {
            return None;
        }
        self.by_time.pop_first();
        self.by_key.remove(&key);
        Some(key)
    }

    /// Timers set.
    #[must_use]
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Whether no timer is set.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
}

/// The earlier of two wakes.
#[must_use]
pub fn earliest(a: Option<Wake>, b: Option<Wake>) -> Option<Wake> {
    match (a, b) {
        (Some(a), Some(b)) => Some(if b.at < a.at { b } else { a }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
    enum T {
        A(u8),
        B,
    }

    impl TimerKey for T {
        fn reason(&self) -> &'static str {
            match self {
                T::A(_) => "a",
                T::B => "b",
            }
        }
    }

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    #[test]
    fn set_replaces_stop_removes_and_expiry_is_in_order() {
        let mut t = TimerTable::new();
        t.set(T::A(1), at(50));
        t.set(T::B, at(20));
        t.set(T::A(1), at(10)); // replaced, not added
        assert_eq!(t.len(), 2);
        assert_eq!(
            t.next(),
            Some(Wake {
                at: at(10),
                reason: "a"
            })
        );
        t.stop(T::A(1));
        t.stop(T::A(9)); // not set: nothing happens
        assert_eq!(
            t.next(),
            Some(Wake {
                at: at(20),
                reason: "b"
            })
        );
        t.set(T::A(2), at(30));
        assert_eq!(t.pop_expired(at(19)), None);
        assert_eq!(t.pop_expired(at(40)), Some(T::B));
        assert_eq!(t.pop_expired(at(40)), Some(T::A(2)));
        assert_eq!(t.pop_expired(at(40)), None);
        assert!(t.is_empty());
    }
}
