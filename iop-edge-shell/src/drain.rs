//! Stopping without cutting callers off. On the first SIGTERM, SIGINT or SIGQUIT the
//! Edge stops accepting connections (callers and nodes), closes the connections waiting
//! for their next request (HTTP/2 ones are sent GOAWAY), refuses a request that still
//! arrives with 503 `edge is shutting down` (closing its HTTP/1.1 connection after the
//! answer), and waits for the requests already in flight, streams included, for up to
//! `limits.shutdown_grace_sec`; its node links stay up meanwhile, since those requests
//! run over them. Then it stops, cutting whatever is left. A second signal stops it at
//! once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

/// How often a drain looks whether the requests in flight have ended.
const LOOK_EVERY: Duration = Duration::from_millis(10);

/// Which inference requests are open (from their arrival to the end of their response),
/// and whether new ones are still taken.
#[derive(Debug, Default)]
pub struct Drain {
    /// Whether the drain has begun. The flag, not the token below, is what a request
    /// reads against the count (see [`Drain::enter`]): both sides need sequentially
    /// consistent order, which the token does not promise.
    draining: AtomicBool,
    /// Where connections move to once a successor took over ([`Drain::hand_over`]).
    mover: std::sync::OnceLock<crate::upgrade::Mover>,
    /// Cancelled when the drain or the hand-over begins, to wake what waits on idle
    /// connections (they close, or move).
    began: CancellationToken,
    /// The same news for the HTTP/1.1 connections' waits ([`Drain::wait`]): set, then
    /// each waker in `waiting` woken.
    began_flag: AtomicBool,
    /// The connections waiting ([`DrainWait`]), each by its number, with its task's waker.
    waiting: std::sync::Mutex<Waiting>,
    open: AtomicUsize,
    /// Of those, the ones not yet handed to the core (their body still being read).
    arriving: AtomicUsize,
}

impl Drain {
    /// A request arrives: counted until the returned guard is dropped, or refused when
    /// the Edge is draining.
    pub fn enter(self: &Arc<Self>) -> Result<Open, Refused> {
        // Counted before the flag is read, and the flag set before the count is read (both
        // sequentially consistent): a request that arrives as the drain begins is either
        // refused or waited for, never cut.
        self.open.fetch_add(1, Ordering::SeqCst);
        self.arriving.fetch_add(1, Ordering::SeqCst);
        let open = Open {
            drain: Arc::clone(self),
            arriving: true,
        };
        if self.draining.load(Ordering::SeqCst) {
            return Err(if self.mover.get().is_some() {
                Refused::HandedOver
            } else {
                Refused::Draining
            });
        }
        Ok(open)
    }

    /// From now on requests are refused, and idle connections closed.
    pub fn begin(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.announce();
    }

    /// The drain or the hand-over began: every wait ends.
    fn announce(&self) {
        self.began.cancel();
        // Set before the waiters are taken: a wait registered after that sees the flag
        // (it looks under the same lock).
        self.began_flag.store(true, Ordering::SeqCst);
        let waiting = std::mem::take(&mut *lock(&self.waiting));
        for waker in waiting.wakers.into_values() {
            waker.wake();
        }
    }

    /// A wait for the drain (or the hand-over) to begin, for one connection to keep and
    /// poll between all its requests. Unlike a wait on [`Drain::began`]'s token, it takes the lock
    /// only when it first waits and when it is dropped (or polled from another task):
    /// polled again by the same task, it reads a flag.
    pub fn wait(self: &Arc<Self>) -> DrainWait {
        DrainWait {
            drain: Arc::clone(self),
            registered: None,
        }
    }

    /// A successor serves on the listeners now: requests on the connections still open
    /// here are still taken, and each plaintext HTTP/1.1 connection moves to `mover` as
    /// soon as it waits for its next request (see [`crate::upgrade`]); connections that
    /// cannot move (TLS, HTTP/2) close as in a drain.
    pub fn hand_over(&self, mover: crate::upgrade::Mover) {
        let _ = self.mover.set(mover);
        self.announce();
    }

    /// Where connections move to, once a successor took over.
    #[must_use]
    pub fn mover(&self) -> Option<&crate::upgrade::Mover> {
        self.mover.get()
    }

    /// Resolves once the drain has begun: a connection waiting for its next request
    /// closes, an HTTP/2 one sends GOAWAY.
    pub fn began(&self) -> WaitForCancellationFuture<'_> {
        self.began.cancelled()
    }

    /// Whether the Edge is draining.
    #[must_use]
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Requests open now.
    #[must_use]
    pub fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Requests open now and not yet handed to the core ([`Open::submitted`]): an Edge
    /// handing over keeps its nodes until there are none.
    #[must_use]
    pub fn arriving(&self) -> usize {
        self.arriving.load(Ordering::SeqCst)
    }

    /// Returns once no request is open (after [`Drain::begin`], no new one opens).
    pub async fn idle(&self) {
        while self.open() > 0 {
            tokio::time::sleep(LOOK_EVERY).await;
        }
    }
}

/// Why [`Drain::enter`] refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The Edge is stopping: the caller is told it is shutting down.
    Draining,
    /// A successor took over the listeners and this process is on its way out: nothing
    /// reached a provider, and the caller's retry (on a new connection) reaches the
    /// successor.
    HandedOver,
}

/// An open request; dropping it closes it.
#[derive(Debug)]
pub struct Open {
    drain: Arc<Drain>,
    arriving: bool,
}

impl Open {
    /// The request was handed to the core (accepted or refused): no longer arriving.
    pub fn submitted(&mut self) {
        if std::mem::take(&mut self.arriving) {
            self.drain.arriving.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.submitted();
        self.drain.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The connections waiting for the drain to begin ([`Drain::wait`]).
#[derive(Debug, Default)]
struct Waiting {
    next: u64,
    wakers: std::collections::HashMap<u64, std::task::Waker>,
}

fn lock(waiting: &std::sync::Mutex<Waiting>) -> std::sync::MutexGuard<'_, Waiting> {
    waiting
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One connection's wait for the drain (or the hand-over) to begin: see [`Drain::wait`].
#[derive(Debug)]
pub struct DrainWait {
    drain: Arc<Drain>,
    /// Its number among the waiting and the waker registered under it.
    registered: Option<(u64, std::task::Waker)>,
}

impl DrainWait {
    /// Ready once the drain or the hand-over has begun; pending until then, with `cx`
    /// woken when it begins.
    pub fn poll_began(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        use std::task::Poll;
        if self.drain.began_flag.load(Ordering::SeqCst) {
            return Poll::Ready(());
        }
        if let Some((_, waker)) = &self.registered
            && waker.will_wake(cx.waker())
        {
            return Poll::Pending;
        }
        let mut waiting = lock(&self.drain.waiting);
        // Looked at under the lock the drain takes its waiters under.
        if self.drain.began_flag.load(Ordering::SeqCst) {
            return Poll::Ready(());
        }
        let id = match &self.registered {
            Some((id, _)) => *id,
            None => {
                waiting.next += 1;
                waiting.next
            }
        };
        waiting.wakers.insert(id, cx.waker().clone());
        self.registered = Some((id, cx.waker().clone()));
        Poll::Pending
    }
}

impl Drop for DrainWait {
    fn drop(&mut self) {
        if let Some((id, _)) = self.registered.take() {
            lock(&self.drain.waiting).wakers.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_counted_until_dropped_and_refused_once_draining() {
        let drain = Arc::new(Drain::default());
        let first = drain.enter().expect("taken");
        let second = drain.enter().expect("taken");
        assert_eq!(drain.open(), 2);
        drop(first);
        assert_eq!(drain.open(), 1);
        drain.begin();
        assert!(drain.is_draining());
        assert_eq!(
            drain.enter().err(),
            Some(Refused::Draining),
            "refused while draining"
        );
        assert_eq!(drain.open(), 1, "a refused request is not counted");
        drop(second);
        assert_eq!(drain.open(), 0);
    }

    #[test]
    fn after_a_hand_over_a_late_request_is_told_to_retry_at_the_successor() {
        let drain = Arc::new(Drain::default());
        let open = drain.enter().expect("taken");
        drain.hand_over(crate::upgrade::Mover::gone());
        let during = drain.enter().expect("still taken while the nodes stay");
        drain.begin();
        assert_eq!(drain.enter().err(), Some(Refused::HandedOver));
        assert_eq!(drain.open(), 2, "the requests taken before are waited for");
        drop((open, during));
        assert_eq!(drain.open(), 0);
    }

    #[tokio::test]
    async fn idle_waits_for_the_last_open_request() {
        let drain = Arc::new(Drain::default());
        let open = drain.enter().expect("taken");
        drain.begin();
        tokio::time::timeout(Duration::from_secs(1), drain.began())
            .await
            .expect("the drain has begun");
        let waiting = tokio::spawn({
            let drain = Arc::clone(&drain);
            async move { drain.idle().await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiting.is_finished(), "a request is still open");
        drop(open);
        tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .expect("idle once the last request ended")
            .expect("joined");
    }

    /// Connections' waits, in tasks of their own, each polled many times before: every
    /// one ends when the drain begins; dropped ones leave nothing behind; one made after
    /// it is over at once. The hand-over ends them as well.
    #[tokio::test]
    async fn every_connection_wait_ends_when_the_drain_or_the_hand_over_begins() {
        for hand_over in [false, true] {
            let drain = Arc::new(Drain::default());
            let waits: Vec<_> = (0..8)
                .map(|_| {
                    let mut wait = drain.wait();
                    tokio::spawn(async move {
                        // Woken for nothing a few times first: each poll looks again.
                        for _ in 0..3 {
                            let mut polled = false;
                            std::future::poll_fn(|cx| {
                                if polled {
                                    return std::task::Poll::Ready(());
                                }
                                polled = true;
                                assert!(wait.poll_began(cx).is_pending());
                                cx.waker().wake_by_ref();
                                std::task::Poll::Pending
                            })
                            .await;
                        }
                        std::future::poll_fn(|cx| wait.poll_began(cx)).await;
                    })
                })
                .collect();
            let mut gone = drain.wait();
            let waker = std::task::Waker::noop();
            assert!(
                gone.poll_began(&mut std::task::Context::from_waker(waker))
                    .is_pending()
            );
            drop(gone);
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert_eq!(
                lock(&drain.waiting).wakers.len(),
                8,
                "the dropped wait is gone"
            );
            if hand_over {
                drain.hand_over(crate::upgrade::Mover::gone());
            } else {
                drain.begin();
            }
            for wait in waits {
                tokio::time::timeout(Duration::from_secs(5), wait)
                    .await
                    .expect("woken when it began")
                    .expect("joined");
            }
            let mut late = drain.wait();
            assert!(
                late.poll_began(&mut std::task::Context::from_waker(waker))
                    .is_ready()
            );
        }
    }
}
