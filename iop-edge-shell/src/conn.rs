//! A node connection as the core's driver keeps it (its writer, frame limit and
//! closer), the limits on what is queued for it, and the slot its TLS settings are
//! reloaded into.

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use iop_shell_common::cancel::Cancel;

use crate::outbox::Outbox;

/// A listener's TLS, replaceable at run time (SIGHUP reloads the certificate). `None`
/// means plaintext, which the node listener only allows when asked explicitly.
pub type TlsSlot = Arc<RwLock<Option<Arc<rustls::ServerConfig>>>>;

/// What the core keeps of a node connection.
#[derive(Debug)]
pub struct ConnHandle {
    /// Where its frames are queued and written.
    pub outbox: Arc<Outbox>,
    /// The largest frame its reader accepts (raised by the core after register).
    pub frame_limit: Arc<AtomicUsize>,
    /// Stops its reader and handshake (waited on by the connection's task alone).
    pub closer: Cancel,
}

impl Drop for ConnHandle {
    /// The core is done with the connection: what is queued is still written, then the
    /// socket is shut down.
    fn drop(&mut self) {
        self.outbox.close();
    }
}

/// Bytes queued for one node above which a writer that makes no progress for
/// [`STALLED_AFTER`] is dropped: the node stopped reading. (A burst of large run inputs
/// to a node that reads is fine; request bodies are bounded by the memory budget.)
pub const MAX_QUEUED_PER_CONNECTION: usize = 64 << 20;

/// See [`MAX_QUEUED_PER_CONNECTION`].
pub const STALLED_AFTER: Duration = Duration::from_secs(10);
