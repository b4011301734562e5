//! The board a Node's sessions share: what each one's work holds, so that none admits past a capacity the others filled.

use iop_proto_core::wire::AdapterLoad;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::sync::watch;

/// What the node's work holds, session by session, on one board (the core's rule:
/// [`iop_proto_core::session::LoadBoard`]): the node has one capacity however many sessions it
/// keeps.
///
/// Every session, from its start until the work it abandoned has stopped upstream,
/// publishes what its work holds whenever that changes; a session takes in what all the
/// others hold right before it handles what its Edge sent, and whenever another's load
/// moves, reporting it to its Edge ([`NodeSession::handle_held_elsewhere`]). The others
/// are a re-homed session draining beside its successor, and, for a node following a
/// cluster of Edges, one session per Edge. The node runs on one thread, so nothing runs
/// between a session admitting work and publishing it: a provider never sees more than
/// its capacity, whatever the Edges believe.
#[derive(Clone, Debug)]
pub struct Elsewhere {
    pub(super) board: Arc<std::sync::Mutex<iop_proto_core::session::LoadBoard>>,
    /// Sessions on the board, read without the lock.
    pub(super) sessions: Arc<std::sync::atomic::AtomicUsize>,
    /// Re-homed sessions still running (the process waits for them before it exits).
    pub(super) running: Arc<std::sync::atomic::AtomicUsize>,
    /// Moves whenever a session's load does while others share the board, or a session
    /// leaves it.
    pub(super) changed: watch::Sender<u64>,
}

impl Default for Elsewhere {
    fn default() -> Self {
        Elsewhere {
            board: Arc::default(),
            sessions: Arc::default(),
            running: Arc::default(),
            changed: watch::Sender::new(0),
        }
    }
}

impl Elsewhere {
    /// Sessions on the board: connected, re-homed and draining, or waiting for the work
    /// they abandoned to stop.
    #[must_use]
    pub fn sessions(&self) -> usize {
        self.sessions.load(Ordering::SeqCst)
    }

    /// Re-homed sessions still running.
    #[must_use]
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    pub(super) fn board(&self) -> std::sync::MutexGuard<'_, iop_proto_core::session::LoadBoard> {
        self.board
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn join(&self) -> u64 {
        self.sessions.fetch_add(1, Ordering::SeqCst);
        self.board().join()
    }

    pub(super) fn leave(&self, key: u64) {
        self.board().leave(key);
        self.sessions.fetch_sub(1, Ordering::SeqCst);
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Puts session `key`'s load on the board, and tells the other sessions it moved. A
    /// session alone on the board tells nobody: only the others wait for the news (a
    /// session knows its own load), and one that joins later reads the board as it
    /// starts. Waking the waiters cost about 220 instructions per request on a node with
    /// one Edge (BENCHMARKS.md).
    pub(super) fn publish(&self, key: u64, load: Vec<AdapterLoad>) {
        self.board().publish(key, load);
        if self.sessions() > 1 {
            self.changed.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    pub(super) fn held_for(&self, key: u64) -> Vec<AdapterLoad> {
        self.board().held_for(key)
    }
}
