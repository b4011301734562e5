//! A task wrapper that answers a wake from inside the task's own poll with another poll,
//! instead of letting the runtime take it for a yield.
//!
//! hyper's HTTP/1 server reads a request body through a channel between its connection
//! dispatcher and the service, both polled by the connection's task: when the service
//! takes the body chunk, the channel wakes the dispatcher, that is the task that is
//! running. tokio's multi-thread scheduler treats a task woken during its own poll as a
//! yield: it goes to the back of the run queue and a parked worker is woken to help. On
//! an Edge answering one request at a time that was one futex wake and one hand-over
//! between worker threads per request (perf: `Harness::poll` → `schedule_task` →
//! `notify_parked_local`), and the hand-over added more latency than the rest of the
//! Edge's work.
//!
//! [`Repoll`] polls its future again at once when it was woken while being polled, at
//! most [`MAX_REPOLLS`] times in a row; past that (a future that really keeps itself
//! busy) it passes the wake on, and the runtime's fairness applies as before. A wake from
//! anywhere else goes straight to the task's waker. No wake is lost: the wake and the end
//! of a poll race on one atomic state.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker};

/// Polls in a row a [`Repoll`] gives a future that wakes itself, before it yields.
pub const MAX_REPOLLS: usize = 4;

const IDLE: u8 = 0;
const POLLING: u8 = 1;
const WOKEN: u8 = 2;

/// What the wrapped future's waker shares with the wrapper.
#[derive(Debug)]
struct Shared {
    state: AtomicU8,
    /// The task's own waker, as of its last poll.
    task: Mutex<Option<Waker>>,
}

impl Wake for Shared {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // While the wrapper polls, it is told (once is enough); otherwise the task is.
        if let Ok(_) | Err(WOKEN) =
            self.state
                .compare_exchange(POLLING, WOKEN, Ordering::AcqRel, Ordering::Acquire)
        {
            return;
        }
        let task = self
            .task
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(task) = task {
            task.wake();
        }
    }
}

/// A future whose wakes from inside its own poll become another poll; see the module
/// documentation.
#[derive(Debug)]
pub struct Repoll<F> {
    future: F,
    shared: Arc<Shared>,
    waker: Waker,
}

impl<F: Future> Repoll<F> {
    /// Wraps `future`.
    pub fn new(future: F) -> Self {
        let shared = Arc::new(Shared {
            state: AtomicU8::new(IDLE),
            task: Mutex::new(None),
        });
        Repoll {
            future,
            waker: Waker::from(shared.clone()),
            shared,
        }
    }
}

impl<F: Future + Unpin> Future for Repoll<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        {
            let mut task = this
                .shared
                .task
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if !task.as_ref().is_some_and(|t| t.will_wake(cx.waker())) {
                *task = Some(cx.waker().clone());
            }
        }
        let mut inner = Context::from_waker(&this.waker);
        for _ in 0..MAX_REPOLLS {
            this.shared.state.store(POLLING, Ordering::Release);
            if let Poll::Ready(out) = Pin::new(&mut this.future).poll(&mut inner) {
                this.shared.state.store(IDLE, Ordering::Release);
                return Poll::Ready(out);
            }
            // Pending: unless a wake came while it ran, wakes go to the task from now on.
            if this
                .shared
                .state
                .compare_exchange(POLLING, IDLE, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Poll::Pending;
            }
        }
        // Woken every time: let the runtime run others first.
        this.shared.state.store(IDLE, Ordering::Release);
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Counts the wakes it receives.
    struct Counter(AtomicUsize);

    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A future that wakes itself on each of its first `wakes` polls, then is ready.
    struct SelfWaking {
        wakes: usize,
        polls: usize,
    }

    impl Future for SelfWaking {
        type Output = usize;

        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<usize> {
            self.polls += 1;
            if self.wakes == 0 {
                return Poll::Ready(self.polls);
            }
            self.wakes -= 1;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    fn poll_once<F: Future + Unpin>(
        future: &mut Repoll<F>,
        counter: &Arc<Counter>,
    ) -> Poll<F::Output> {
        let waker = Waker::from(counter.clone());
        Pin::new(future).poll(&mut Context::from_waker(&waker))
    }

    #[test]
    fn a_wake_from_inside_the_poll_is_another_poll_not_a_yield() {
        let counter = Arc::new(Counter(AtomicUsize::new(0)));
        let mut future = Repoll::new(SelfWaking { wakes: 2, polls: 0 });
        assert_eq!(poll_once(&mut future, &counter), Poll::Ready(3));
        assert_eq!(
            counter.0.load(Ordering::SeqCst),
            0,
            "the task was not woken"
        );
    }

    #[test]
    fn a_future_that_keeps_waking_itself_yields_after_a_few_polls() {
        let counter = Arc::new(Counter(AtomicUsize::new(0)));
        let mut future = Repoll::new(SelfWaking {
            wakes: 100,
            polls: 0,
        });
        assert_eq!(poll_once(&mut future, &counter), Poll::Pending);
        assert_eq!(future.future.polls, MAX_REPOLLS);
        assert_eq!(
            counter.0.load(Ordering::SeqCst),
            1,
            "woken to run again later"
        );
    }

    #[test]
    fn a_wake_after_the_poll_reaches_the_task() {
        // A future that stores its waker and waits.
        struct Waiting(Arc<Mutex<Option<Waker>>>);
        impl Future for Waiting {
            type Output = ();
            fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
                *self.0.lock().unwrap() = Some(cx.waker().clone());
                Poll::Pending
            }
        }
        let slot = Arc::new(Mutex::new(None));
        let counter = Arc::new(Counter(AtomicUsize::new(0)));
        let mut future = Repoll::new(Waiting(slot.clone()));
        assert_eq!(poll_once(&mut future, &counter), Poll::Pending);
        let stored = slot.lock().unwrap().take().unwrap();
        std::thread::spawn(move || stored.wake()).join().unwrap();
        assert_eq!(counter.0.load(Ordering::SeqCst), 1);
    }
}
