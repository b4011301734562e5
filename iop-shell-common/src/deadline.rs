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
//!
//! Also here: [`SleepPool`], runtime timers kept for the next request once one is done
//! with them.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
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

/// Runtime timers kept for reuse, for work that sets one timer each, far out and almost
/// never reached (a response's deadline, a provider call's).
///
/// A new tokio `Sleep` enters the timer wheel when it is first polled and leaves it when
/// it is dropped, each under the timer driver's lock: about 600 instructions per request
/// for a timer that does not fire. A timer taken from the pool is still in the wheel, set
/// for the deadline of the work that used it last. Set for a later deadline, as the next
/// piece of work's is when each is its start plus the same limit, it stays where it is:
/// tokio records the new instant with one atomic exchange, and moves the entry itself
/// when the old instant comes round. Set for an earlier one, it is reset as a new timer
/// would be. Either way [`PooledSleep`] is an ordinary `Sleep` to its user, due at the
/// instant it was taken for.
///
/// Every timer a pool gives is in the wheel already, unlike a new `Sleep`, which enters
/// it when first polled: its `is_elapsed` turns true once its instant has passed, polled
/// or not.
///
/// A pooled timer may fire while it waits in the pool, for work long done: that wakes
/// the task which polled it last, once, and the task finds nothing to do. A pool belongs
/// to one runtime: make it, and take every timer from it, on that runtime.
#[derive(Debug, Default)]
pub struct SleepPool {
    free: Mutex<Vec<Pin<Box<Sleep>>>>,
}

/// Timers a pool keeps at most; more than this at once are dropped when done.
const POOL_KEEP: usize = 1024;

impl SleepPool {
    /// A timer due at `at`: a kept one moved to `at`, or a new one.
    #[must_use]
    pub fn sleep_until(self: &Arc<Self>, at: Instant) -> PooledSleep {
        self.take(at, false)
    }

    /// A timer due at `at` or before it, for a user that looks at the clock when it fires
    /// and sets it again if it came early (as [`Deadline`] does): a kept one still set
    /// for an instant before `at` is taken as it is, which spares moving it. It then
    /// fires once early for every time the kept timers' instants come round, not once per
    /// use.
    #[must_use]
    pub fn sleep_by(self: &Arc<Self>, at: Instant) -> PooledSleep {
        self.take(at, true)
    }

    /// A kept timer (as it is set if `early` allows and it is set for before `at` and
    /// has not fired, else moved to `at`), or a new one.
    fn take(self: &Arc<Self>, at: Instant, early: bool) -> PooledSleep {
        let kept = self
            .free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let sleep = match kept {
            Some(sleep) if early && sleep.deadline() <= at && !sleep.is_elapsed() => sleep,
            Some(mut sleep) => {
                sleep.as_mut().reset(at);
                sleep
            }
            None => {
                let mut sleep = Box::pin(tokio::time::sleep_until(at));
                // In the wheel from the start, as a kept one is.
                sleep.as_mut().reset(at);
                sleep
            }
        };
        PooledSleep {
            sleep: Some(sleep),
            pool: self.clone(),
        }
    }
}

/// A timer from a [`SleepPool`], back in the pool when dropped.
#[derive(Debug)]
pub struct PooledSleep {
    /// Always `Some` until the drop takes it.
    sleep: Option<Pin<Box<Sleep>>>,
    pool: Arc<SleepPool>,
}

impl PooledSleep {
    /// The timer, to poll, reset or read as any `Sleep`.
    pub fn as_mut(&mut self) -> Pin<&mut Sleep> {
        self.sleep
            .as_mut()
            .expect("a pooled sleep is taken only by its drop")
            .as_mut()
    }

    /// The instant the timer is due.
    #[must_use]
    pub fn deadline(&self) -> Instant {
        self.sleep
            .as_ref()
            .expect("a pooled sleep is taken only by its drop")
            .deadline()
    }

    /// Whether the timer has fired for its instant.
    #[must_use]
    pub fn is_elapsed(&self) -> bool {
        self.sleep.as_ref().is_some_and(|sleep| sleep.is_elapsed())
    }
}

impl Future for PooledSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.as_mut().get_mut().as_mut().poll(cx)
    }
}

impl Drop for PooledSleep {
    fn drop(&mut self) {
        let Some(sleep) = self.sleep.take() else {
            return;
        };
        let mut free = self
            .pool
            .free
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if free.len() < POOL_KEEP {
            free.push(sleep);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Timers `pool` keeps for reuse.
    fn kept(pool: &SleepPool) -> usize {
        pool.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

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

    #[tokio::test]
    async fn a_kept_timer_is_due_at_its_new_instant_later_or_earlier() {
        let pool = Arc::new(SleepPool::default());
        let start = Instant::now();
        {
            // Polled, so in the wheel, then back in the pool unfired.
            let mut first = pool.sleep_until(start + Duration::from_millis(30));
            let waker = std::task::Waker::noop();
            assert!(
                first
                    .as_mut()
                    .poll(&mut Context::from_waker(waker))
                    .is_pending()
            );
        }
        assert_eq!(kept(&pool), 1);
        // Taken again for a later instant: not due at the old one.
        let later = pool.sleep_until(start + Duration::from_millis(300));
        assert_eq!(kept(&pool), 0);
        assert_eq!(later.deadline(), start + Duration::from_millis(300));
        tokio::time::timeout(Duration::from_secs(10), later)
            .await
            .expect("due at the later instant");
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_millis(300),
            "woke after {waited:?}"
        );
        // Back in the pool having fired; taken for an earlier instant than a kept
        // unfired one would be set for, it is due then.
        {
            let _far = pool.sleep_until(Instant::now() + Duration::from_secs(60));
        }
        let soon = pool.sleep_until(Instant::now() + Duration::from_millis(20));
        let at = Instant::now();
        tokio::time::timeout(Duration::from_secs(10), soon)
            .await
            .expect("due at the earlier instant");
        assert!(at.elapsed() >= Duration::from_millis(15));
    }

    #[tokio::test]
    async fn a_timer_taken_by_an_instant_is_due_at_it_or_before() {
        let pool = Arc::new(SleepPool::default());
        let start = Instant::now();
        drop(pool.sleep_until(start + Duration::from_secs(30)));
        // Kept and set for earlier: taken as it is.
        let early = pool.sleep_by(start + Duration::from_secs(60));
        assert_eq!(early.deadline(), start + Duration::from_secs(30));
        drop(early);
        // Kept and set for later: moved to the instant.
        let moved = pool.sleep_by(start + Duration::from_millis(20));
        assert_eq!(moved.deadline(), start + Duration::from_millis(20));
        tokio::time::timeout(Duration::from_secs(10), moved)
            .await
            .expect("due at the instant");
        // Kept having fired: moved, not handed out fired.
        let after = pool.sleep_by(Instant::now() + Duration::from_secs(60));
        assert!(!after.is_elapsed());
        assert!(after.deadline() > start + Duration::from_secs(59));
    }

    #[tokio::test]
    async fn a_timer_from_a_pool_elapses_unpolled() {
        let pool = Arc::new(SleepPool::default());
        let fresh = pool.sleep_until(Instant::now() + Duration::from_millis(20));
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert!(fresh.is_elapsed(), "a new one");
        drop(fresh);
        let kept = pool.sleep_until(Instant::now() + Duration::from_millis(20));
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert!(kept.is_elapsed(), "a kept one that had fired");
    }

    #[tokio::test]
    async fn a_pool_keeps_at_most_its_bound() {
        let pool = Arc::new(SleepPool::default());
        let far = Instant::now() + Duration::from_secs(60);
        let many: Vec<_> = (0..POOL_KEEP + 5).map(|_| pool.sleep_until(far)).collect();
        drop(many);
        assert_eq!(kept(&pool), POOL_KEEP);
    }
}
