//! Logging setup: `tracing` to stderr, as text or JSON lines; `RUST_LOG` filters.

use tracing_subscriber::EnvFilter;

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Installs the global subscriber (idempotent enough for one call per process).
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    let _ = match format {
        LogFormat::Text => builder.with_ansi(false).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// Bounds the log lines one noisy source writes: at most `burst` lines per `interval`,
/// and the first line after a quiet spell says how many were suppressed. For IO events
/// that a peer or the machine can repeat at will (accept errors, failed handshakes);
/// protocol events are rate-limited by the core's own decisions.
#[derive(Debug)]
pub struct LogLimiter {
    interval: std::time::Duration,
    burst: u32,
    state: std::sync::Mutex<LimiterState>,
}

#[derive(Debug)]
struct LimiterState {
    window_start: Option<std::time::Instant>,
    in_window: u32,
    suppressed: u64,
}

impl LogLimiter {
    /// A limiter letting `burst` lines through per `interval`.
    #[must_use]
    pub fn new(interval: std::time::Duration, burst: u32) -> Self {
        LogLimiter {
            interval,
            burst,
            state: std::sync::Mutex::new(LimiterState {
                window_start: None,
                in_window: 0,
                suppressed: 0,
            }),
        }
    }

    /// `Some(suppressed since the last line)` when a line may be written now.
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(std::time::Instant::now())
    }

    fn allow_at(&self, now: std::time::Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state
            .window_start
            .is_none_or(|start| now.duration_since(start) >= self.interval)
        {
            state.window_start = Some(now);
            state.in_window = 0;
        }
        if state.in_window < self.burst {
            state.in_window += 1;
            Some(std::mem::take(&mut state.suppressed))
        } else {
            state.suppressed += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_burst_per_interval_then_a_count_of_what_was_suppressed() {
        let limiter = LogLimiter::new(Duration::from_secs(10), 2);
        let t0 = Instant::now();
        assert_eq!(limiter.allow_at(t0), Some(0));
        assert_eq!(limiter.allow_at(t0), Some(0));
        for _ in 0..1000 {
            assert_eq!(limiter.allow_at(t0 + Duration::from_secs(1)), None);
        }
        assert_eq!(limiter.allow_at(t0 + Duration::from_secs(10)), Some(1000));
    }
}
