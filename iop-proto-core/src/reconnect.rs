//! The Node's reconnect policy: one policy for the initial dial and every reconnect.
//!
//! Contract rules (`reconnect.max_attempts`, `reconnect.interval_sec`):
//! - `max_attempts` omitted → 10; `0` → unlimited until local shutdown; a positive value →
//!   exactly that many attempts; negative → a validation error.
//! - `interval_sec` omitted → 10 seconds; in unlimited mode it must be positive.

use std::num::NonZeroU32;
use std::time::Duration;

/// Attempts made when `max_attempts` is omitted.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 10;
/// Interval between attempts when `interval_sec` is omitted.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);

/// How many connection attempts the policy allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaxAttempts {
    /// Exactly this many attempts, then the process exits 1.
    Limited(NonZeroU32),
    /// Retry until local shutdown.
    Unlimited,
}

/// A reconnect configuration that breaks the contract.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ReconnectConfigError {
    /// `max_attempts` below zero.
    #[error("reconnect.max_attempts must be 0 (unlimited) or positive, got {0}")]
    NegativeMaxAttempts(i64),
    /// `max_attempts` beyond what a `u32` holds.
    #[error("reconnect.max_attempts {0} is too large (at most {max})", max = u32::MAX)]
    MaxAttemptsTooLarge(i64),
    /// `interval_sec` negative, NaN or infinite.
    #[error("reconnect.interval_sec must be a finite number of seconds >= 0, got {0}")]
    InvalidInterval(f64),
    /// Unlimited mode with a zero interval would spin.
    #[error("reconnect.interval_sec must be positive when max_attempts = 0 (unlimited)")]
    UnlimitedNeedsPositiveInterval,
}

/// A validated reconnect policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReconnectPolicy {
    /// Attempt limit.
    pub max_attempts: MaxAttempts,
    /// Fixed wait between attempts (the contract's default behaviour).
    pub interval: Duration,
}

impl Default for ReconnectPolicy {
    fn default() -> Self {
        ReconnectPolicy {
            max_attempts: MaxAttempts::Limited(
                NonZeroU32::new(DEFAULT_MAX_ATTEMPTS).unwrap_or(NonZeroU32::MIN),
            ),
            interval: DEFAULT_INTERVAL,
        }
    }
}

impl ReconnectPolicy {
    /// Builds the policy from the raw configuration values, applying the contract's
    /// defaults and rules.
    pub fn from_config(
        max_attempts: Option<i64>,
        interval_sec: Option<f64>,
    ) -> Result<Self, ReconnectConfigError> {
        let max_attempts = match max_attempts {
            None => ReconnectPolicy::default().max_attempts,
            Some(0) => MaxAttempts::Unlimited,
            Some(n) if n < 0 => return Err(ReconnectConfigError::NegativeMaxAttempts(n)),
            Some(n) => u32::try_from(n)
                .ok()
                .and_then(NonZeroU32::new)
                .map(MaxAttempts::Limited)
                .ok_or(ReconnectConfigError::MaxAttemptsTooLarge(n))?,
        };
        let interval = match interval_sec {
            None => DEFAULT_INTERVAL,
            Some(secs) => Duration::try_from_secs_f64(secs)
                .map_err(|_| ReconnectConfigError::InvalidInterval(secs))?,
        };
        if max_attempts == MaxAttempts::Unlimited && interval.is_zero() {
            return Err(ReconnectConfigError::UnlimitedNeedsPositiveInterval);
        }
        Ok(ReconnectPolicy {
            max_attempts,
            interval,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limited(n: u32) -> MaxAttempts {
        MaxAttempts::Limited(NonZeroU32::new(n).expect("non-zero"))
    }

    #[test]
    fn omitted_values_take_the_contract_defaults() {
        let policy = ReconnectPolicy::from_config(None, None).expect("valid");
        assert_eq!(policy.max_attempts, limited(10));
        assert_eq!(policy.interval, Duration::from_secs(10));
    }

    #[test]
    fn zero_attempts_means_unlimited() {
        let policy = ReconnectPolicy::from_config(Some(0), None).expect("valid");
        assert_eq!(policy.max_attempts, MaxAttempts::Unlimited);
        assert_eq!(policy.interval, Duration::from_secs(10));
        let policy = ReconnectPolicy::from_config(Some(0), Some(0.25)).expect("valid");
        assert_eq!(policy.interval, Duration::from_millis(250));
    }

    #[test]
    fn positive_attempts_are_exact() {
        let policy = ReconnectPolicy::from_config(Some(3), Some(1.0)).expect("valid");
        assert_eq!(policy.max_attempts, limited(3));
        // A zero interval is allowed when the attempts are finite.
        assert!(ReconnectPolicy::from_config(Some(3), Some(0.0)).is_ok());
    }

    #[test]
    fn negative_attempts_are_rejected() {
        assert_eq!(
            ReconnectPolicy::from_config(Some(-1), None),
            Err(ReconnectConfigError::NegativeMaxAttempts(-1))
        );
        assert_eq!(
            ReconnectPolicy::from_config(Some(i64::from(u32::MAX) + 1), None),
            Err(ReconnectConfigError::MaxAttemptsTooLarge(
                i64::from(u32::MAX) + 1
            ))
        );
    }

    #[test]
    fn unlimited_needs_a_positive_interval() {
        assert_eq!(
            ReconnectPolicy::from_config(Some(0), Some(0.0)),
            Err(ReconnectConfigError::UnlimitedNeedsPositiveInterval)
        );
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                ReconnectPolicy::from_config(Some(0), Some(bad)),
                Err(ReconnectConfigError::InvalidInterval(_))
            ));
        }
    }
}
