//! Time as an input: a monotonic [`Timestamp`] in milliseconds from an arbitrary origin.
//!
//! No machine in this crate reads a clock. The shell maps its own monotonic clock onto
//! `Timestamp` in one place and hands `now` to every `handle_*` call.

use std::fmt;
use std::time::Duration;

/// A point in monotonic time, in milliseconds from an origin chosen by the driver.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The origin.
    pub const ZERO: Timestamp = Timestamp(0);
    /// The latest representable instant; used as "never".
    pub const MAX: Timestamp = Timestamp(u64::MAX);

    /// A timestamp `ms` milliseconds after the origin.
    #[must_use]
    pub const fn from_millis(ms: u64) -> Self {
        Timestamp(ms)
    }

    /// Milliseconds since the origin.
    #[must_use]
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// `self + d`, saturating at [`Timestamp::MAX`].
    #[must_use]
    pub fn saturating_add(self, d: Duration) -> Self {
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        Timestamp(self.0.saturating_add(ms))
    }

    /// Time elapsed from `earlier` to `self`, zero if `earlier` is later.
    #[must_use]
    pub fn saturating_duration_since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }
}

impl std::ops::Add<Duration> for Timestamp {
    type Output = Timestamp;
    fn add(self, d: Duration) -> Timestamp {
        self.saturating_add(d)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t={}ms", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        let t = Timestamp::from_millis(u64::MAX - 5);
        assert_eq!(t + Duration::from_secs(1), Timestamp::MAX);
        assert_eq!(
            Timestamp::from_millis(5).saturating_duration_since(Timestamp::from_millis(9)),
            Duration::ZERO
        );
        assert_eq!(
            Timestamp::from_millis(1500).to_string(),
            "t=1500ms".to_string()
        );
    }
}
