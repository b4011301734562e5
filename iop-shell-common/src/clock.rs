//! The one place where the shell maps its monotonic clock onto the core's `Timestamp`.

use std::time::Duration;

use iop_proto_core::Timestamp;
use tokio::time::Instant;

/// A monotonic clock whose origin is the process start.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    origin: Instant,
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock {
    /// A clock starting now.
    #[must_use]
    pub fn new() -> Self {
        Clock {
            origin: Instant::now(),
        }
    }

    /// The current time as a core timestamp.
    #[must_use]
    pub fn now(&self) -> Timestamp {
        let ms = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        Timestamp::from_millis(ms)
    }

    /// The tokio instant of a core timestamp (far future for `Timestamp::MAX`).
    #[must_use]
    pub fn instant(&self, at: Timestamp) -> Instant {
        let capped = at.as_millis().min(1 << 40);
        self.origin + Duration::from_millis(capped)
    }
}
