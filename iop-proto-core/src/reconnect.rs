//! The Node's reconnect policy: one policy for the initial dial and every reconnect.
//!
//! Contract rules (`reconnect.max_attempts`, `reconnect.interval_sec`):
//! - `max_attempts` omitted → 10; `0` → unlimited until local shutdown; a positive value →
//!   exactly that many attempts; negative → a validation error.
//! - `interval_sec` omitted → 10 seconds; in unlimited mode it must be positive.
//!
//! [`Supervisor`] is the machine that applies the policy: it tells the shell when to dial,
//! counts attempts (a successful ready resets the count), classifies failures (retryable
//! remote failures retry; a credential rejection or a local config error is fatal) and
//! decides the process exit: 1 for exhaustion or a fatal error, 0 for local shutdown.
//!
//! Over the ~800-line norm only with its unit tests (the policy itself is about 540
//! lines); they sit beside the rules they pin down.

use std::collections::VecDeque;
use std::num::NonZeroU32;
use std::time::Duration;

use crate::time::Timestamp;

/// Attempts made when `max_attempts` is omitted.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 10;
/// Interval between attempts when `interval_sec` is omitted.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
/// The share of the interval a Node takes off its waits at random unless configured
/// (`reconnect.jitter`; [`Supervisor::with_jitter`]): each wait is drawn from 80-100 % of
/// the interval, so a fleet that lost the same Edge does not redial it in one burst.
pub const DEFAULT_JITTER: f64 = 0.2;

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

/// Exponential backoff with jitter: an extension; the default is the contract's fixed
/// interval. Delay before attempt `n + 1` is `min(max, base * 2^(n-1))`, reduced by up to
/// `jitter` (a fraction in `0..=1`) drawn from a RNG seeded with `seed`, so a run replays.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Backoff {
    /// Delay after the first failure.
    pub base: Duration,
    /// Upper bound of the delay.
    pub max: Duration,
    /// Fraction of the delay removed at random (0 = none, 1 = up to all of it).
    pub jitter: f64,
    /// RNG seed.
    pub seed: u64,
}

/// Why a dial or an established session failed, as the supervisor classifies it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Failure {
    /// Connection refused.
    Refused,
    /// Connection reset.
    Reset,
    /// Dial, handshake or heartbeat timed out.
    TimedOut,
    /// The Edge could not be reached for another network reason (DNS, unreachable).
    Unreachable(String),
    /// The Edge closed the connection or refused readiness.
    EdgeClosed(String),
    /// What came back is not this protocol or breaks it (a malformed frame, a message out
    /// of place, an invalid config). Retried like a lost connection, in case the Edge is
    /// mid-upgrade or the address briefly points elsewhere, but reported as the Edge's
    /// fault rather than the network's.
    Protocol(String),
    /// The Edge's certificate did not check out (wrong fingerprint, unknown CA, wrong
    /// name, expired) or the TLS handshake failed: the node sent nothing and retries, in
    /// case the Edge is being re-keyed or a network path is being tampered with.
    Tls(String),
    /// The Edge refused the register for now (the node's address is backing off after
    /// failed attempts, or its node id is held by another connection): retried no sooner
    /// than `retry_after`.
    Deferred {
        /// The Edge's reason.
        reason: String,
        /// The earliest retry.
        retry_after: Duration,
    },
    /// The Edge rejected the node's credentials or identity: fatal, never retried.
    CredentialRejected(String),
    /// The local configuration cannot work: fatal.
    LocalConfig(String),
}

impl Failure {
    /// How a transport error counts, by its kind: the one classification every shell
    /// uses for dials, reads and writes. Refused, reset (also a broken pipe or an aborted
    /// connection) and timed out are told apart; anything else is `Unreachable` with the
    /// transport's description.
    #[must_use]
    pub fn from_io(kind: std::io::ErrorKind, detail: impl std::fmt::Display) -> Self {
        use std::io::ErrorKind;
        match kind {
            ErrorKind::ConnectionRefused => Failure::Refused,
            ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe => {
                Failure::Reset
            }
            ErrorKind::TimedOut => Failure::TimedOut,
            _ => Failure::Unreachable(detail.to_string()),
        }
    }

    /// Fatal failures end the process instead of retrying.
    #[must_use]
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            Failure::CredentialRejected(_) | Failure::LocalConfig(_)
        )
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Refused => f.write_str("connection refused"),
            Failure::Reset => f.write_str("connection reset"),
            Failure::TimedOut => f.write_str("timed out"),
            Failure::Unreachable(why) => write!(f, "edge unreachable: {why}"),
            Failure::EdgeClosed(why) => write!(f, "edge closed the session: {why}"),
            Failure::Protocol(why) => write!(f, "the edge broke the protocol: {why}"),
            Failure::Tls(why) => write!(f, "tls: {why}"),
            Failure::Deferred {
                reason,
                retry_after,
            } => write!(
                f,
                "edge refused the node for now: {reason} (retry after {} ms)",
                retry_after.as_millis()
            ),
            Failure::CredentialRejected(why) => write!(f, "edge rejected the node: {why}"),
            Failure::LocalConfig(why) => write!(f, "local configuration error: {why}"),
        }
    }
}

/// Why the supervisor ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExitReason {
    /// Local shutdown (SIGINT/SIGTERM).
    Shutdown,
    /// The finite attempt budget ran out; the last failure is attached.
    Exhausted {
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        last: Failure,
    },
    /// A fatal failure.
    Fatal(Failure),
}

impl ExitReason {
    /// The process exit code: 0 for local shutdown, 1 otherwise.
    #[must_use]
    pub fn exit_code(&self) -> i32 {
        match self {
            ExitReason::Shutdown => 0,
            ExitReason::Exhausted { .. } | ExitReason::Fatal(_) => 1,
        }
    }
}

/// What the supervisor asks the shell to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SupervisorEvent {
    /// Dial the Edge; `attempt` counts from 1 since the start or the last ready.
    Dial {
        /// Attempt number.
        attempt: u32,
    },
    /// Stop: cancel in-flight work and exit with `reason.exit_code()`.
    Exit(ExitReason),
}

/// Misuse of the supervisor by its driver.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SupervisorError {
    /// An input that makes no sense in the current state (e.g. `handle_ready` while idle).
    #[error("supervisor input {input} is invalid while {state:?}")]
    InvalidInput {
        /// The `handle_*` input refused.
        input: &'static str,
        /// The state it arrived in.
        state: SupervisorState,
    },
}

/// Where the supervisor is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SupervisorState {
    /// Not started.
    Idle,
    /// A dial is in progress.
    Dialing,
    /// Connected; `ready` once the ready handshake completed.
    Connected {
        /// Whether the session reached ready.
        ready: bool,
    },
    /// Waiting before the next attempt.
    Waiting {
        /// When to dial again.
        until: Timestamp,
    },
    /// Exited: no more inputs change anything.
    Exited,
}

/// The reconnect supervisor machine. One instance governs the whole life of a node
/// process: the initial dial and every reconnect.
#[derive(Debug)]
pub struct Supervisor {
    policy: ReconnectPolicy,
    backoff: Option<Backoff>,
    /// Fraction of the fixed interval removed at random (see [`Supervisor::with_jitter`]).
    jitter: f64,
    rng: u64,
    attempts: u32,
    state: SupervisorState,
    /// A stop was asked for while a session was open: the process exits once it has
    /// ended, whatever ended it.
    stop_requested: bool,
    /// It keeps the link to a cluster member other than the node's configured Edge
    /// ([`Supervisor::for_member`]): a credential refusal there is never the node's end.
    member: bool,
    /// Other sessions of the node are live ([`Supervisor::handle_backing`]): a credential
    /// refusal from the configured Edge is then not the node's end either.
    backed: bool,
    /// Credential refusals in a row (each doubles the wait before the next dial).
    rejections: u32,
    actions: VecDeque<SupervisorEvent>,
    now: Timestamp,
}

/// The first wait after a credential refusal that is not final (see
/// [`Supervisor::for_member`]); each further one in a row doubles it...
pub const REJECTED_RETRY: Duration = Duration::from_secs(5);
/// ...up to this.
pub const REJECTED_RETRY_MAX: Duration = Duration::from_secs(60);

impl Supervisor {
    /// A supervisor with the contract's fixed interval.
    #[must_use]
    pub fn new(policy: ReconnectPolicy) -> Self {
        Supervisor {
            policy,
            backoff: None,
            jitter: 0.0,
            rng: 0,
            attempts: 0,
            state: SupervisorState::Idle,
            stop_requested: false,
            member: false,
            backed: false,
            rejections: 0,
            actions: VecDeque::new(),
            now: Timestamp::ZERO,
        }
    }

    /// The supervisor of a link to a cluster member other than the node's configured
    /// Edge: that member refusing the node's credentials (its configuration not yet in,
    /// a hand-over, a mistake on that one Edge) is retried with a growing wait
    /// ([`REJECTED_RETRY`] doubling to [`REJECTED_RETRY_MAX`]), never fatal; the
    /// configured Edge alone decides whether the node's credentials are wrong.
    #[must_use]
    pub fn for_member(mut self) -> Self {
        self.member = true;
        self
    }

    /// Whether other sessions of the node are live now (with the cluster's other
    /// Edges). While they are, a credential refusal from the configured Edge is retried
    /// as a member's is, instead of ending the node and the work those sessions serve.
    pub fn handle_backing(&mut self, now: Timestamp, live_elsewhere: bool) {
        self.advance(now);
        self.backed = live_elsewhere;
    }

    /// A supervisor with the contract's fixed interval spread by jitter: each wait is drawn
    /// uniformly from `[(1 - jitter) * interval, interval]` (`jitter` is clamped to
    /// `0..=1`) by a generator seeded with `seed`, so a run replays.
    ///
    /// Without it every Node that lost the same Edge at the same instant redials in the
    /// same millisecond, every interval, until the Edge is back: a restarted Edge meets
    /// its whole fleet in one connect burst that overflows the listen backlog. Give each
    /// Node a different seed (the node shell draws one per process unless configured).
    /// The wait never exceeds the configured interval.
    #[must_use]
    pub fn with_jitter(policy: ReconnectPolicy, jitter: f64, seed: u64) -> Self {
        let mut supervisor = Supervisor::new(policy);
        supervisor.jitter = if jitter.is_finite() {
            jitter.clamp(0.0, 1.0)
        } else {
            0.0
        };
        supervisor.rng = seed;
        supervisor
    }

    /// A supervisor using exponential backoff with jitter instead of the fixed interval
    /// (the attempt limit still comes from `policy`).
    #[must_use]
    pub fn with_backoff(policy: ReconnectPolicy, backoff: Backoff) -> Self {
        let mut supervisor = Supervisor::new(policy);
        supervisor.rng = backoff.seed;
        supervisor.backoff = Some(backoff);
        supervisor
    }

    /// Where the supervisor is: dialing, connected, ready, waiting to redial or exited.
    #[must_use]
    pub fn state(&self) -> SupervisorState {
        self.state
    }

    /// Attempts made since the start or the last ready.
    #[must_use]
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The next thing for the shell to do.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<SupervisorEvent> {
        self.actions.pop_front()
    }

    /// When the next dial is due.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<crate::timer::Wake> {
        match self.state {
            SupervisorState::Waiting { until } => Some(crate::timer::Wake {
                at: until,
                reason: "redial",
            }),
            _ => None,
        }
    }

    fn advance(&mut self, now: Timestamp) {
        debug_assert!(now >= self.now, "time went backwards");
        self.now = self.now.max(now);
    }

    fn invalid(&self, input: &'static str) -> SupervisorError {
        SupervisorError::InvalidInput {
            input,
            state: self.state,
        }
    }

    fn dial(&mut self) {
        self.attempts = self.attempts.saturating_add(1);
        self.state = SupervisorState::Dialing;
        self.actions.push_back(SupervisorEvent::Dial {
            attempt: self.attempts,
        });
    }

    fn exit(&mut self, reason: ExitReason) {
        self.state = SupervisorState::Exited;
        self.actions.push_back(SupervisorEvent::Exit(reason));
    }

    /// Starts: the initial dial happens at once.
    pub fn handle_start(&mut self, now: Timestamp) -> Result<(), SupervisorError> {
        self.advance(now);
        if self.state != SupervisorState::Idle {
            return Err(self.invalid("start"));
        }
        self.dial();
        Ok(())
    }

    /// The dial connected; the session now registers.
    pub fn handle_connected(&mut self, now: Timestamp) -> Result<(), SupervisorError> {
        self.advance(now);
        if self.state != SupervisorState::Dialing {
            return Err(self.invalid("connected"));
        }
        self.state = SupervisorState::Connected { ready: false };
        Ok(())
    }

    /// The session completed its ready handshake: the attempt count resets.
    pub fn handle_ready(&mut self, now: Timestamp) -> Result<(), SupervisorError> {
        self.advance(now);
        if !matches!(self.state, SupervisorState::Connected { .. }) {
            return Err(self.invalid("ready"));
        }
        self.attempts = 0;
        self.rejections = 0;
        self.state = SupervisorState::Connected { ready: true };
        Ok(())
    }

    /// A dial failed or an established session ended. Fatal failures exit; retryable ones
    /// retry after the interval while attempts remain. After
    /// [`handle_stop`](Self::handle_stop) the session's end is the process's, whatever the
    /// failure.
    pub fn handle_failure(
        &mut self,
        now: Timestamp,
        failure: Failure,
    ) -> Result<(), SupervisorError> {
        self.advance(now);
        if !matches!(
            self.state,
            SupervisorState::Dialing | SupervisorState::Connected { .. }
        ) {
            return Err(self.invalid("failure"));
        }
        if self.stop_requested {
            self.exit(ExitReason::Shutdown);
            return Ok(());
        }
        let rejected = matches!(failure, Failure::CredentialRejected(_));
        if failure.is_fatal() && !(rejected && (self.member || self.backed)) {
            self.exit(ExitReason::Fatal(failure));
            return Ok(());
        }
        if rejected {
            // Not final here: dial again, later each time, whatever the attempt limit.
            let wait = REJECTED_RETRY
                .saturating_mul(1 << self.rejections.min(8))
                .min(REJECTED_RETRY_MAX);
            self.rejections = self.rejections.saturating_add(1);
            self.state = SupervisorState::Waiting {
                until: self.now + wait,
            };
            return Ok(());
        }
        if let MaxAttempts::Limited(max) = self.policy.max_attempts
            && self.attempts >= max.get()
        {
            self.exit(ExitReason::Exhausted {
                attempts: self.attempts,
                last: failure,
            });
            return Ok(());
        }
        let mut delay = self.delay();
        if let Failure::Deferred { retry_after, .. } = failure {
            delay = delay.max(retry_after);
        }
        self.state = SupervisorState::Waiting {
            until: self.now + delay,
        };
        Ok(())
    }

    /// A stop was asked for. With a session open it is the session's to wind down (its
    /// work drained or cancelled): the process exits once the session has ended, however
    /// it ends, and never redials. With none (idle, dialing, waiting) it exits at once.
    pub fn handle_stop(&mut self, now: Timestamp) {
        self.advance(now);
        if matches!(self.state, SupervisorState::Connected { .. }) {
            self.stop_requested = true;
        } else {
            self.handle_shutdown(now);
        }
    }

    /// The Edge process is handing over and told the ready session to re-home: the
    /// session goes on draining beside the supervisor, which dials again at once (the
    /// same address reaches the successor), with a fresh attempt count. After
    /// [`handle_stop`](Self::handle_stop) the process stops instead.
    pub fn handle_rehome(&mut self, now: Timestamp) -> Result<(), SupervisorError> {
        self.advance(now);
        if self.state != (SupervisorState::Connected { ready: true }) {
            return Err(self.invalid("rehome"));
        }
        if self.stop_requested {
            self.exit(ExitReason::Shutdown);
            return Ok(());
        }
        self.attempts = 0;
        self.dial();
        Ok(())
    }

    /// Local shutdown: exit 0 from any state (a no-op once exited).
    pub fn handle_shutdown(&mut self, now: Timestamp) {
        self.advance(now);
        if self.state != SupervisorState::Exited {
            self.exit(ExitReason::Shutdown);
        }
    }

    /// Dials when the wait is over. A spurious call does nothing.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        self.advance(now);
        if let SupervisorState::Waiting { until } = self.state
            && until <= self.now
        {
            self.dial();
        }
    }

    fn delay(&mut self) -> Duration {
        let (full, jitter) = match self.backoff {
            None => (self.policy.interval, self.jitter),
            Some(backoff) => {
                let exponent = self.attempts.saturating_sub(1).min(30);
                let full = backoff
                    .base
                    .saturating_mul(1u32 << exponent)
                    .min(backoff.max);
                (full, backoff.jitter.clamp(0.0, 1.0))
            }
        };
        if jitter == 0.0 {
            return full;
        }
        full.mul_f64(1.0 - jitter * self.next_unit())
    }

    /// A uniform draw from `[0, 1)`: SplitMix64, a tiny, well-distributed generator;
    /// enough for jitter.
    fn next_unit(&mut self) -> f64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests;
