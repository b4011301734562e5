//! What each of a node's sessions holds: one node, one capacity, however many Edges
//! it keeps a session with (docs/cluster.md).

use std::collections::BTreeMap;

use super::sum_loads;
use crate::wire::AdapterLoad;

/// The load of each session of one node process, by a key the board hands out.
///
/// The rule it serves: right before a session handles what its Edge sent, it takes in
/// what all the others hold ([`held_for`](Self::held_for), then
/// [`NodeSession::handle_held_elsewhere`](super::NodeSession::handle_held_elsewhere)),
/// and once it has handled it, it publishes its own
/// ([`publish`](Self::publish) of [`NodeSession::load`](super::NodeSession::load), when
/// [`NodeSession::load_changes`](super::NodeSession::load_changes) moved). With nothing
/// run between the two, every session's capacity gates count every run of the node, and
/// when two Edges race for the last slot, the second's session reports the first's run
/// to its Edge before it refuses. A shell that runs sessions on several threads holds
/// one lock across the pair.
#[derive(Clone, Debug, Default)]
pub struct LoadBoard {
    loads: BTreeMap<u64, Vec<AdapterLoad>>,
    next: u64,
}

impl LoadBoard {
    /// A key for a new session.
    pub fn join(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// Session `key` ended, and the work it abandoned has stopped upstream.
    pub fn leave(&mut self, key: u64) {
        self.loads.remove(&key);
    }

    /// Session `key` holds `load` now.
    pub fn publish(&mut self, key: u64, load: Vec<AdapterLoad>) {
        if load.is_empty() {
            self.loads.remove(&key);
        } else {
            self.loads.insert(key, load);
        }
    }

    /// What every session but `key` holds, summed by adapter.
    #[must_use]
    pub fn held_for(&self, key: u64) -> Vec<AdapterLoad> {
        sum_loads(
            self.loads
                .iter()
                .filter(|(k, _)| **k != key)
                .flat_map(|(_, load)| load),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(adapter: &str, n: u32, long: u32) -> AdapterLoad {
        AdapterLoad {
            adapter: adapter.into(),
            in_flight: n,
            long_in_flight: long,
        }
    }

    #[test]
    fn a_session_sees_what_the_others_hold_and_not_its_own() {
        let mut board = LoadBoard::default();
        let (a, b, c) = (board.join(), board.join(), board.join());
        board.publish(a, vec![load("x", 2, 1)]);
        board.publish(b, vec![load("x", 1, 0), load("y", 3, 0)]);
        assert_eq!(board.held_for(c), [load("x", 3, 1), load("y", 3, 0)]);
        assert_eq!(board.held_for(a), [load("x", 1, 0), load("y", 3, 0)]);
        board.publish(b, Vec::new());
        board.leave(a);
        assert_eq!(board.held_for(c), []);
    }
}
