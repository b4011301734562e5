//! A cancel for one piece of work, waited on by the one task that runs it.
//!
//! tokio-util's `CancellationToken` is a tree of tokens under a mutex, and each wait on
//! one queues on a `Notify` under its lock when it is first polled, takes the lock again
//! on each poll and dequeues when dropped. The Node gave each tunnel a token of its own
//! (about 600 instructions per small request went to it), and its connection loop and
//! the Edge's node links polled waits on the process's tokens at every turn (about 450 on
//! the Node per request): BENCHMARKS.md. A piece of work needs none of that: one side
//! cancels, and the one task that runs the work waits. A [`Cancel`] is a flag and one
//! waker slot ([`AtomicWaker`]): a wait is an atomic load and a waker registration per
//! poll, and nothing to undo when it is dropped. A loop that must hear of a shared token
//! follows it with a cancel of its own ([`Cancel::follow`]).
//!
//! One waker slot means one waiting task: a second task that waits on the same cancel
//! takes the slot from the first, which is then not woken. Waits in the same task (in
//! turn or side by side in a `select!`) share its waker and are all woken.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use atomic_waker::AtomicWaker;
use tokio_util::sync::CancellationToken;

/// A cancel for one piece of work (see the module): cloned by whoever may cancel it and
/// by the work, waited on by the task that runs the work.
#[derive(Clone, Debug, Default)]
pub struct Cancel(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    cancelled: AtomicBool,
    waker: AtomicWaker,
}

impl Cancel {
    /// A cancel not yet given.
    #[must_use]
    pub fn new() -> Self {
        Cancel::default()
    }

    /// Cancels the work: its waits end, now and from now on.
    pub fn cancel(&self) {
        self.0.cancelled.store(true, Ordering::Release);
        self.0.waker.wake();
    }

    /// Whether the work was cancelled.
    #[must_use]
    pub fn is_cancelled(&self) -> bool {
        self.0.cancelled.load(Ordering::Acquire)
    }

    /// Ready once the work is cancelled; pending until then, with `cx` woken when it is
    /// (the last task to poll is the one woken).
    pub fn poll_cancelled(&self, cx: &mut Context<'_>) -> Poll<()> {
        // Registered before the flag is read: a cancel after the read wakes this waker,
        // one before it is seen. (Read first instead, a cancel between the read and the
        // registration would wake no one.)
        self.0.waker.register(cx.waker());
        if self.is_cancelled() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Completes once the work is cancelled.
    pub fn cancelled(&self) -> Cancelled<'_> {
        Cancelled(self)
    }

    /// Cancels this too once `token` is cancelled (at once if it is already), for as long
    /// as the returned guard lives: a loop that would wait on a token shared by many tasks
    /// on every turn (a process's shutdown) waits on this instead. The following is a
    /// task of its own, so it is for a long-lived loop (a connection's), not per request.
    pub fn follow(&self, token: &CancellationToken) -> Following {
        if token.is_cancelled() {
            self.cancel();
            return Following(None);
        }
        let (token, follows) = (token.clone(), self.clone());
        Following(Some(tokio::spawn(async move {
            token.cancelled().await;
            follows.cancel();
        })))
    }
}

/// A [`Cancel`] following a token ([`Cancel::follow`]); the following stops when this is
/// dropped.
#[derive(Debug)]
#[must_use = "the following stops when this is dropped"]
pub struct Following(Option<tokio::task::JoinHandle<()>>);

impl Drop for Following {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

/// The future of [`Cancel::cancelled`].
#[derive(Debug)]
#[must_use = "futures do nothing unless polled"]
pub struct Cancelled<'a>(&'a Cancel);

impl Future for Cancelled<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.poll_cancelled(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn polled(cancel: &Cancel) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        cancel.poll_cancelled(&mut cx).is_ready()
    }

    #[test]
    fn a_cancel_is_seen_by_every_clone_and_stays() {
        let cancel = Cancel::new();
        let work = cancel.clone();
        assert!(!work.is_cancelled() && !polled(&work));
        cancel.cancel();
        assert!(work.is_cancelled() && polled(&work) && polled(&cancel));
        assert!(polled(&work), "still cancelled on the next look");
    }

    #[tokio::test]
    async fn a_waiting_task_is_woken_by_a_cancel_from_another() {
        let cancel = Cancel::new();
        let work = cancel.clone();
        let waiter = tokio::spawn(async move { work.cancelled().await });
        // Let it wait first, so it is the cancel that wakes it.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());
        std::thread::spawn(move || cancel.cancel()).join().unwrap();
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken by the cancel")
            .unwrap();
    }

    #[tokio::test]
    async fn waits_side_by_side_in_one_task_all_end() {
        let cancel = Cancel::new();
        let work = cancel.clone();
        let waiter = tokio::spawn(async move {
            let (a, b) = (work.cancelled(), work.cancelled());
            tokio::join!(a, b);
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        cancel.cancel();
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("both waits end")
            .unwrap();
    }

    #[tokio::test]
    async fn a_cancel_follows_its_token_while_followed() {
        let token = CancellationToken::new();
        let cancel = Cancel::new();
        let following = cancel.follow(&token);
        tokio::task::yield_now().await;
        assert!(!cancel.is_cancelled());
        token.cancel();
        tokio::time::timeout(Duration::from_secs(5), cancel.cancelled())
            .await
            .expect("follows the token");

        // A token cancelled already: at once.
        let at_once = Cancel::new();
        let _following = at_once.follow(&token);
        assert!(at_once.is_cancelled());

        // No longer followed: the token's cancel does not reach it, and the task is gone.
        let token = CancellationToken::new();
        let dropped = Cancel::new();
        drop(dropped.follow(&token));
        tokio::task::yield_now().await;
        token.cancel();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!dropped.is_cancelled());
        drop(following);
    }

    /// Cancels racing the waiter's registration from another thread, many times: a
    /// waiter is never left asleep.
    #[test]
    fn a_cancel_racing_the_wait_is_never_lost() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        for _ in 0..2_000 {
            let cancel = Cancel::new();
            let work = cancel.clone();
            let canceller = std::thread::spawn(move || cancel.cancel());
            runtime.block_on(async {
                tokio::time::timeout(Duration::from_secs(5), work.cancelled())
                    .await
                    .expect("the cancel is seen");
            });
            canceller.join().unwrap();
        }
    }
}
