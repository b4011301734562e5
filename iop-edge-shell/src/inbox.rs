//! A request's event queue: one producer (the core's drain, which runs under the core's
//! lock) and one consumer (the request's response body).
//!
//! tokio's unbounded channel allocates its slots in blocks of 32 and keeps a spare block
//! for every open request however few events it carries (its cost per stream:
//! docs/benchmarks-history.md). This queue is a `VecDeque` behind a mutex that only these two sides
//! take: empty until the first event, a few slots for a stream whose events are read as
//! they come, and shrunk again after a burst. What both sides share besides the queue (a
//! request's memory accounting) lives in the same allocation ([`inbox_with`]).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

/// Slots an emptied queue may keep; a larger one (after a slow reader's burst) is freed.
const KEEP_SLOTS: usize = 8;

/// A new queue's two ends.
#[must_use]
pub fn inbox<T>() -> (Outlet<T>, Inbox<T>) {
    inbox_with(())
}

/// A new queue's two ends, both holding `attached` (in the queue's own allocation).
#[must_use]
pub fn inbox_with<T, A>(attached: A) -> (Outlet<T, A>, Inbox<T, A>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            items: VecDeque::new(),
            waker: None,
            outlet_gone: false,
            inbox_gone: false,
        }),
        attached,
    });
    (
        Outlet {
            shared: shared.clone(),
        },
        Inbox {
            shared,
            taken: VecDeque::new(),
        },
    )
}

struct Shared<T, A> {
    state: Mutex<State<T>>,
    attached: A,
}

impl<T, A> Shared<T, A> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // Nothing panics under this lock; a poisoned queue is still a queue.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Wakes the waiting reader, if any, after letting go of the lock.
fn wake_reader<T>(mut state: MutexGuard<'_, State<T>>) {
    let waker = state.waker.take();
    drop(state);
    if let Some(waker) = waker {
        waker.wake();
    }
}

/// Nothing to take: `Ready(None)` once the outlet is gone, otherwise `Pending` with the
/// reader's waker kept for the outlet's next queue or wake.
fn wait<T, R>(state: &mut State<T>, cx: &Context<'_>) -> Poll<Option<R>> {
    if state.outlet_gone {
        return Poll::Ready(None);
    }
    match &mut state.waker {
        Some(waker) => waker.clone_from(cx.waker()),
        None => state.waker = Some(cx.waker().clone()),
    }
    Poll::Pending
}

struct State<T> {
    items: VecDeque<T>,
    /// The reader waiting for the next item.
    waker: Option<Waker>,
    outlet_gone: bool,
    inbox_gone: bool,
}

/// The sending end.
pub struct Outlet<T, A = ()> {
    shared: Arc<Shared<T, A>>,
}

impl<T, A> std::fmt::Debug for Outlet<T, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outlet").finish_non_exhaustive()
    }
}

impl<T, A> Outlet<T, A> {
    /// What both ends hold.
    pub fn attached(&self) -> &A {
        &self.shared.attached
    }

    /// Hands the waiting reader's waker, if any, to `wakes` (as [`queue`](Self::queue)
    /// does): for a change to the attachment that [`Inbox::poll_attached`] waits for.
    pub fn wake(&self, wakes: &mut Vec<Waker>) {
        if let Some(waker) = self.shared.lock().waker.take() {
            wakes.push(waker);
        }
    }

    /// Queues `item`, or gives it back when the reader is gone. A waiting reader's waker
    /// goes to `wakes` instead of being woken here: the caller wakes it once it holds no
    /// lock (a wake can be a system call that rouses another thread, and the core's lock
    /// must not wait on it).
    pub fn queue(&self, item: T, wakes: &mut Vec<Waker>) -> Result<(), T> {
        let mut state = self.shared.lock();
        if state.inbox_gone {
            return Err(item);
        }
        if state.items.capacity() == 0 {
            // Room for a small response's events at once (dispatch, four frames, end):
            // growing 0 → 4 → 8 cost two reallocations per request.
            state.items.reserve_exact(KEEP_SLOTS);
        }
        state.items.push_back(item);
        if let Some(waker) = state.waker.take() {
            wakes.push(waker);
        }
        Ok(())
    }
}

impl<T, A> Drop for Outlet<T, A> {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.outlet_gone = true;
        wake_reader(state);
    }
}

/// The receiving end.
pub struct Inbox<T, A = ()> {
    shared: Arc<Shared<T, A>>,
    /// Items taken out of the queue in one lock and not yet returned: a request's
    /// events mostly come several at a time, and each lock is two atomic operations.
    taken: VecDeque<T>,
}

impl<T, A> std::fmt::Debug for Inbox<T, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox").finish_non_exhaustive()
    }
}

impl<T, A> Inbox<T, A> {
    /// What both ends hold.
    pub fn attached(&self) -> &A {
        &self.shared.attached
    }

    /// What `take` finds in the attachment; `Ready(None)` once the outlet is gone without
    /// it; otherwise waits for [`Outlet::wake`] (checked under the queue's lock, which the
    /// wake takes after the attachment changed, so no change is missed).
    pub fn poll_attached<R>(
        &mut self,
        cx: &mut Context<'_>,
        take: impl FnOnce(&A) -> Option<R>,
    ) -> Poll<Option<R>> {
        let mut state = self.shared.lock();
        if let Some(found) = take(&self.shared.attached) {
            return Poll::Ready(Some(found));
        }
        wait(&mut state, cx)
    }

    /// The next item; `Ready(None)` once the queue is empty and the outlet is gone.
    /// Everything queued is taken at once, under one lock, and handed out in order.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        if self.taken.is_empty() {
            let mut state = self.shared.lock();
            if state.items.is_empty() {
                return wait(&mut state, cx);
            }
            // The queue keeps this (empty) buffer; a large one is not kept.
            if self.taken.capacity() > KEEP_SLOTS {
                self.taken = VecDeque::new();
            }
            std::mem::swap(&mut state.items, &mut self.taken);
        }
        Poll::Ready(self.taken.pop_front())
    }
}

impl<T, A> Drop for Inbox<T, A> {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.inbox_gone = true;
        state.waker = None;
        let items = std::mem::take(&mut state.items);
        drop(state);
        // Whatever was queued is dropped outside the lock (and what was taken, with the
        // inbox).
        drop(items);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Queues `item` and wakes the reader at once, as the core's drain does once it has
    /// let go of its lock.
    fn send<T, A>(outlet: &Outlet<T, A>, item: T) -> Result<(), T> {
        let mut wakes = Vec::new();
        outlet.queue(item, &mut wakes)?;
        wakes.into_iter().for_each(Waker::wake);
        Ok(())
    }

    fn poll<T, A>(inbox: &mut Inbox<T, A>, wakes: &Arc<Count>) -> Poll<Option<T>> {
        let waker = Waker::from(wakes.clone());
        inbox.poll_recv(&mut Context::from_waker(&waker))
    }

    #[test]
    fn items_arrive_in_order_and_a_waiting_reader_is_woken_once_per_send() {
        let (outlet, mut inbox) = inbox();
        let wakes = Arc::new(Count::default());
        assert_eq!(poll(&mut inbox, &wakes), Poll::Pending);
        send(&outlet, 1).unwrap();
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
        // Nobody waits now: a send wakes no one.
        send(&outlet, 2).unwrap();
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
        assert_eq!(poll(&mut inbox, &wakes), Poll::Ready(Some(1)));
        assert_eq!(poll(&mut inbox, &wakes), Poll::Ready(Some(2)));
        assert_eq!(poll(&mut inbox, &wakes), Poll::Pending);
        // The outlet going away wakes the reader, which reads the end after the rest.
        send(&outlet, 3).unwrap();
        drop(outlet);
        assert_eq!(poll(&mut inbox, &wakes), Poll::Ready(Some(3)));
        assert_eq!(poll(&mut inbox, &wakes), Poll::Ready(None));
    }

    #[test]
    fn items_queued_while_a_batch_is_handed_out_follow_it() {
        let (outlet, mut inbox) = inbox();
        let wakes = Arc::new(Count::default());
        send(&outlet, 1).unwrap();
        send(&outlet, 2).unwrap();
        assert_eq!(poll(&mut inbox, &wakes), Poll::Ready(Some(1)));
        send(&outlet, 3).unwrap();
        assert_eq!(poll(&mut inbox, &wakes), Poll::Ready(Some(2)));
        drop(outlet);
        assert_eq!(poll(&mut inbox, &wakes), Poll::Ready(Some(3)));
        assert_eq!(poll(&mut inbox, &wakes), Poll::Ready(None));
        assert_eq!(wakes.0.load(Ordering::SeqCst), 0, "never waited");
    }

    #[test]
    fn a_queued_item_leaves_the_wake_to_the_caller() {
        let (outlet, mut inbox) = inbox();
        let wakes = Arc::new(Count::default());
        let mut deferred = Vec::new();
        outlet.queue(1, &mut deferred).unwrap();
        assert!(deferred.is_empty(), "nobody waits yet");
        assert_eq!(poll(&mut inbox, &wakes), Poll::Ready(Some(1)));
        assert_eq!(poll(&mut inbox, &wakes), Poll::Pending);
        outlet.queue(2, &mut deferred).unwrap();
        outlet.queue(3, &mut deferred).unwrap();
        assert_eq!(wakes.0.load(Ordering::SeqCst), 0, "not woken by queue");
        assert_eq!(deferred.len(), 1, "one waker for the reader, once");
        // Dropping the outlet after a queue wakes nobody twice: the waker was handed over.
        drop(outlet);
        assert_eq!(wakes.0.load(Ordering::SeqCst), 0);
        deferred.drain(..).for_each(Waker::wake);
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
        assert_eq!(poll(&mut inbox, &wakes), Poll::Ready(Some(2)));
        assert_eq!(poll(&mut inbox, &wakes), Poll::Ready(Some(3)));
        assert_eq!(poll(&mut inbox, &wakes), Poll::Ready(None));
    }

    #[test]
    fn an_ended_outlet_wakes_its_reader() {
        let (outlet, mut inbox) = inbox::<u8>();
        let wakes = Arc::new(Count::default());
        assert_eq!(poll(&mut inbox, &wakes), Poll::Pending);
        drop(outlet);
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
        assert_eq!(poll(&mut inbox, &wakes), Poll::Ready(None));
    }

    #[test]
    fn a_reader_that_left_refuses_items_and_frees_what_waited() {
        let (outlet, inbox) = inbox();
        let item = Arc::new(());
        send(&outlet, item.clone()).unwrap();
        assert_eq!(Arc::strong_count(&item), 2);
        drop(inbox);
        assert_eq!(
            Arc::strong_count(&item),
            1,
            "queued items freed with the reader"
        );
        assert!(send(&outlet, item.clone()).is_err());
        assert_eq!(Arc::strong_count(&item), 1);
    }

    #[test]
    fn an_emptied_queue_gives_back_a_burst() {
        let (outlet, mut inbox) = inbox();
        let wakes = Arc::new(Count::default());
        for i in 0..1000 {
            send(&outlet, i).unwrap();
        }
        for i in 0..1000 {
            assert_eq!(poll(&mut inbox, &wakes), Poll::Ready(Some(i)));
        }
        assert!(outlet.shared.lock().items.capacity() <= KEEP_SLOTS);
        // A reader keeping up holds a few slots at most.
        for i in 0..100 {
            send(&outlet, i).unwrap();
            assert_eq!(poll(&mut inbox, &wakes), Poll::Ready(Some(i)));
        }
        assert!(outlet.shared.lock().items.capacity() <= KEEP_SLOTS);
    }

    #[test]
    fn both_ends_hold_the_attachment_until_the_last_goes() {
        let held = Arc::new(());
        let (outlet, inbox) = inbox_with::<u8, _>(held.clone());
        assert!(Arc::ptr_eq(outlet.attached(), inbox.attached()));
        assert_eq!(Arc::strong_count(&held), 2);
        drop(outlet);
        assert_eq!(
            Arc::strong_count(inbox.attached()),
            2,
            "the reader still holds it"
        );
        drop(inbox);
        assert_eq!(Arc::strong_count(&held), 1);
    }

    #[test]
    fn a_reader_waiting_on_the_attachment_is_woken_when_it_changes_or_the_outlet_goes() {
        let (outlet, mut inbox) = inbox_with::<u8, _>(Mutex::new(None::<u32>));
        let wakes = Arc::new(Count::default());
        let waker = Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let take = |slot: &Mutex<Option<u32>>| slot.lock().unwrap().take();
        assert_eq!(inbox.poll_attached(&mut cx, take), Poll::Pending);
        *outlet.attached().lock().unwrap() = Some(7);
        let mut deferred = Vec::new();
        outlet.wake(&mut deferred);
        deferred.drain(..).for_each(Waker::wake);
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
        assert_eq!(inbox.poll_attached(&mut cx, take), Poll::Ready(Some(7)));
        assert_eq!(inbox.poll_attached(&mut cx, take), Poll::Pending);
        drop(outlet);
        assert_eq!(wakes.0.load(Ordering::SeqCst), 2);
        assert_eq!(inbox.poll_attached(&mut cx, take), Poll::Ready(None));
    }
}
