//! A fast hasher for the machines' own integer ids (request ids, connection ids).
//!
//! These keys are chosen by the machine, the local shell or the configuration (model
//! names), never by a peer, so the flooding resistance of SipHash buys nothing; a
//! multiplicative hash is several times faster and keeps per-operation cost flat in
//! large queues.

use std::hash::{BuildHasherDefault, Hasher};

/// Hasher for integer keys: Fibonacci multiplicative hashing.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// `HashMap` keyed by machine-chosen integer ids.
pub(crate) type IdMap<K, V> = std::collections::HashMap<K, V, BuildHasherDefault<IdHasher>>;
