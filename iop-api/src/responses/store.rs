//! [`Store`]: the responses an Edge keeps for `previous_response_id`, `GET` and `DELETE`,
//! bounded in entries and bytes, the oldest evicted first. Each entry belongs to the key
//! that made it: another caller is told it does not exist.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;

/// What one entry costs beyond its strings: the map's slot, the order queue's, the
/// `Arc`s' counts.
const ENTRY_OVERHEAD: usize = 160;

/// A stored response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The caller (key name) that made it.
    pub owner: Arc<str>,
    /// The conversation up to and including its answer, as a JSON array of chat
    /// messages: what a turn that continues it is prefixed with.
    pub conversation: Arc<str>,
    /// The response object, as `GET /v1/responses/{id}` answers it.
    pub response: Bytes,
}

impl Stored {
    fn size(&self, id: &str) -> usize {
        id.len() + self.owner.len() + self.conversation.len() + self.response.len() + ENTRY_OVERHEAD
    }
}

/// What the store holds, for status pages and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreFigures {
    /// Responses held.
    pub entries: usize,
    /// Bytes they take, counted as [`Store`] counts them.
    pub bytes: usize,
    /// Responses evicted to stay within the caps, since the start.
    pub evicted: u64,
    /// The caps.
    pub max_entries: usize,
    /// The byte cap.
    pub max_bytes: usize,
}

/// The store; see the module docs.
#[derive(Debug)]
pub struct Store {
    /// Each entry with its insertion number.
    map: HashMap<Arc<str>, (u64, Stored)>,
    /// Ids with their insertion numbers, oldest first; an id removed (or stored again
    /// since) is skipped when it comes up.
    order: VecDeque<(Arc<str>, u64)>,
    inserted: u64,
    bytes: usize,
    max_entries: usize,
    max_bytes: usize,
    evicted: u64,
}

impl Store {
    /// An empty store of at most `max_entries` responses and `max_bytes` bytes (0 and 0:
    /// nothing is kept).
    #[must_use]
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        Store {
            map: HashMap::new(),
            order: VecDeque::new(),
            inserted: 0,
            bytes: 0,
            max_entries,
            max_bytes,
            evicted: 0,
        }
    }

    /// New caps (a reload); entries past them are evicted at once.
    pub fn resize(&mut self, max_entries: usize, max_bytes: usize) {
        self.max_entries = max_entries;
        self.max_bytes = max_bytes;
        self.evict(0, 0);
    }

    /// Keeps `stored` as `id`, evicting the oldest entries to make room; `false` (and
    /// nothing kept) when it alone is larger than the byte cap.
    pub fn insert(&mut self, id: &str, stored: Stored) -> bool {
        let size = stored.size(id);
        if size > self.max_bytes || self.max_entries == 0 {
            return false;
        }
        self.remove(id);
        self.evict(1, size);
        let id: Arc<str> = Arc::from(id);
        self.bytes += size;
        self.inserted += 1;
        self.order.push_back((id.clone(), self.inserted));
        self.map.insert(id, (self.inserted, stored));
        true
    }

    /// The response `id`, when `owner` made it.
    #[must_use]
    pub fn get(&self, id: &str, owner: &str) -> Option<&Stored> {
        self.map
            .get(id)
            .map(|(_, s)| s)
            .filter(|s| &*s.owner == owner)
    }

    /// Deletes the response `id` when `owner` made it; whether it did.
    pub fn delete(&mut self, id: &str, owner: &str) -> bool {
        if self.get(id, owner).is_none() {
            return false;
        }
        self.remove(id)
    }

    fn remove(&mut self, id: &str) -> bool {
        let Some((_, stored)) = self.map.remove(id) else {
            return false;
        };
        self.bytes -= stored.size(id);
        // The order queue keeps the id until it comes up; a queue mostly of removed ids
        // is compacted.
        if self.order.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.order
                .retain(|(id, n)| map.get(id).is_some_and(|(m, _)| m == n));
        }
        true
    }

    /// Evicts the oldest entries until `entries` more and `bytes` more fit.
    fn evict(&mut self, entries: usize, bytes: usize) {
        while self.map.len() + entries > self.max_entries || self.bytes + bytes > self.max_bytes {
            let Some((oldest, n)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&oldest).is_some_and(|(m, _)| *m == n) && self.remove(&oldest) {
                self.evicted += 1;
            }
        }
    }

    /// What it holds.
    #[must_use]
    pub fn figures(&self) -> StoreFigures {
        StoreFigures {
            entries: self.map.len(),
            bytes: self.bytes,
            evicted: self.evicted,
            max_entries: self.max_entries,
            max_bytes: self.max_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(owner: &str, n: usize) -> Stored {
        Stored {
            owner: Arc::from(owner),
            conversation: Arc::from("x".repeat(n).as_str()),
            response: Bytes::from_static(b"{}"),
        }
    }

    #[test]
    fn entries_belong_to_their_owner_and_the_oldest_go_first() {
        let mut store = Store::new(2, 1 << 20);
        assert!(store.insert("a", stored("k1", 10)));
        assert!(store.insert("b", stored("k1", 10)));
        assert!(store.get("a", "k2").is_none(), "another key sees nothing");
        assert!(!store.delete("a", "k2"));
        assert!(store.get("a", "k1").is_some());
        assert!(store.insert("c", stored("k1", 10)));
        assert!(store.get("a", "k1").is_none(), "the oldest was evicted");
        assert_eq!(store.figures().entries, 2);
        assert_eq!(store.figures().evicted, 1);
        assert!(store.delete("b", "k1"));
        assert_eq!(store.figures().entries, 1);
    }

    #[test]
    fn the_byte_cap_holds_and_an_entry_too_large_is_not_kept() {
        let one = stored("k", 1000).size("id-00");
        let mut store = Store::new(1000, one * 3);
        for i in 0..100 {
            assert!(store.insert(&format!("id-{i:02}"), stored("k", 1000)));
            assert!(store.figures().bytes <= one * 3);
        }
        assert_eq!(store.figures().entries, 3);
        assert!(!store.insert("huge", stored("k", one * 4)));
        assert!(store.get("huge", "k").is_none());
        store.resize(1, one * 3);
        assert_eq!(store.figures().entries, 1);
        assert!(store.get("id-99", "k").is_some(), "the newest stays");
    }

    #[test]
    fn an_id_stored_again_is_as_new_as_its_last_store() {
        let mut store = Store::new(2, 1 << 20);
        store.insert("a", stored("k", 1));
        store.insert("b", stored("k", 1));
        store.insert("a", stored("k", 2));
        store.insert("c", stored("k", 1));
        assert!(store.get("b", "k").is_none(), "b was the oldest");
        assert_eq!(store.get("a", "k").map(|s| s.conversation.len()), Some(2));
    }

    #[test]
    fn removed_ids_do_not_pile_up_in_the_order_queue() {
        let mut store = Store::new(10, 1 << 20);
        for i in 0..10_000 {
            let id = format!("r{i}");
            store.insert(&id, stored("k", 1));
            store.delete(&id, "k");
        }
        assert!(store.order.len() <= 2 * store.map.len() + 65);
        assert_eq!(store.figures().bytes, 0);
    }
}
