//! Transport figures for `TRANSPORT_STATUS`: frames and bytes each way, reconnects.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters shared by the supervisor and every connection driver.
#[derive(Debug, Default)]
pub struct TransportStats {
    /// Frames received.
    pub frames_in: AtomicU64,
    /// Frames sent.
    pub frames_out: AtomicU64,
    /// Bytes received.
    pub bytes_in: AtomicU64,
    /// Bytes sent.
    pub bytes_out: AtomicU64,
    /// Connections established after the first.
    pub reconnects: AtomicU64,
    /// Successful connections.
    pub connections: AtomicU64,
    /// Last heartbeat round-trip, in milliseconds (0 = none yet).
    pub last_rtt_ms: AtomicU64,
}

impl TransportStats {
    /// Adds to a counter.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Reads a counter.
    #[must_use]
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}
