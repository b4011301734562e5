//! A deadline that moves often and mostly later (a kept connection's idle and header
//! limits, pushed on by every request), over one runtime timer that is re-armed only
//! when it must be.
//!
//! Resetting a tokio `Sleep` takes its entry out of the timer wheel and puts it back, a few
//! hundred instructions each time; a connection moved its deadline twice per request. A
//! [`Deadline`] moved later only records the new instant: the timer, still set for the
//! old one, fires early, finds the deadline moved on, and is re-armed for it then. Moved
//! earlier, the timer is reset at once. Either way it reports the deadline when it is
//! reached, no sooner and no later than a `Sleep` reset each time.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::time::{Instant, Sleep};

/// A deadline over one runtime timer (see the module).
#[derive(Debug)]
pub struct Deadline {
    /// The timer, set to fire at the deadline or before it.
    sleep: Pin<Box<Sleep>>,
    /// The deadline.
    at: Instant,
}

impl Deadline {
    /// A deadline at `at`.
    #[must_use]
    pub fn new(at: Instant) -> Self {
        Deadline {
            sleep: Box::pin(tokio::time::sleep_until(at)),
            at,
        }
    }

    /// Moves the deadline to `at`, later or earlier.
    pub fn set(&mut self, at: Instant) {
        self.at = at;
        if at < self.sleep.deadline() {
            self.arm();
        }
    }

    /// The deadline.
    #[must_use]
    pub fn at(&self) -> Instant {
        self.at
    }

    /// Ready once the deadline is reached (and again on every poll until it moves);
    /// pending until then, with `cx` woken when it is.
    pub fn poll_reached(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            ready!(self.sleep.as_mut().poll(cx));
            if self.sleep.deadline() >= self.at {
                return Poll::Ready(());
            }
            // Fired for a deadline that has since moved on.
            self.arm();
        }
    }

    fn arm(&mut self) {
        self.sleep.as_mut().reset(self.at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Whether `deadline` is reached now (one poll).
    fn reached(deadline: &mut Deadline) -> bool {
        let waker = std::task::Waker::noop();
        deadline
            .poll_reached(&mut Context::from_waker(waker))
            .is_ready()
    }

    #[tokio::test]
    async fn a_deadline_moved_later_is_not_reached_at_the_old_one() {
        let start = Instant::now();
        let mut deadline = Deadline::new(start + Duration::from_millis(20));
        deadline.set(start + Duration::from_secs(30));
        // Well past the first deadline: the timer has fired for it, and is re-armed.
        tokio::time::sleep(Duration::from_millis(120)).await;
        assert!(!reached(&mut deadline), "moved later");
        assert_eq!(deadline.at(), start + Duration::from_secs(30));
        // Moved earlier again: reached then, woken by the timer.
        deadline.set(Instant::now() + Duration::from_millis(30));
        tokio::time::timeout(
            Duration::from_secs(10),
            std::future::poll_fn(|cx| deadline.poll_reached(cx)),
        )
        .await
        .expect("reached once moved earlier");
        assert!(Instant::now() >= deadline.at());
        assert!(reached(&mut deadline), "stays reached until it moves");
    }

    #[tokio::test]
    async fn a_deadline_moved_earlier_is_reached_at_the_new_one() {
        let start = Instant::now();
        let mut deadline = Deadline::new(start + Duration::from_secs(30));
        assert!(!reached(&mut deadline));
        deadline.set(start + Duration::from_millis(20));
        tokio::time::timeout(
            Duration::from_secs(10),
            std::future::poll_fn(|cx| deadline.poll_reached(cx)),
        )
        .await
        .expect("reached at the earlier deadline");
        assert!(Instant::now() >= start + Duration::from_millis(20));
        // Moved on after it was reached: pending again.
        deadline.set(Instant::now() + Duration::from_secs(30));
        assert!(!reached(&mut deadline));
    }
}
