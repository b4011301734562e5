//! A count of things held at once (requests being served, open connections) whose
//! limit a reload may change. Raising it takes effect at once; lowering it takes back
//! free slots at once and the rest as the holders above the new limit let go, so that
//! nothing already held is cut.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{AcquireError, OwnedSemaphorePermit, Semaphore, TryAcquireError};

/// At most `limit` slots held at once; see the module.
#[derive(Debug)]
pub struct Limit {
    slots: Arc<Semaphore>,
    /// The limit asked for last.
    limit: std::sync::Mutex<usize>,
    /// Slots to take back as their holders let go (after the limit was lowered below
    /// what was held).
    owed: AtomicUsize,
}

/// One slot, given back when dropped (or kept by the limit, if it was lowered).
#[derive(Debug)]
pub struct Slot {
    permit: Option<OwnedSemaphorePermit>,
    limit: Arc<Limit>,
}

impl Limit {
    /// A limit of `limit` slots (at least one).
    #[must_use]
    pub fn new(limit: usize) -> Arc<Self> {
        let limit = limit.clamp(1, Semaphore::MAX_PERMITS);
        Arc::new(Limit {
            slots: Arc::new(Semaphore::new(limit)),
            limit: std::sync::Mutex::new(limit),
            owed: AtomicUsize::new(0),
        })
    }

    /// A slot if one is free now.
    ///
    /// # Errors
    /// `NoPermits` when every slot is held.
    pub fn try_take(self: &Arc<Self>) -> Result<Slot, TryAcquireError> {
        let permit = self.slots.clone().try_acquire_owned()?;
        Ok(self.slot(permit))
    }

    /// A slot, once one is free.
    ///
    /// # Errors
    /// Never in practice: the semaphore is never closed.
    pub async fn take(self: &Arc<Self>) -> Result<Slot, AcquireError> {
        let permit = self.slots.clone().acquire_owned().await?;
        Ok(self.slot(permit))
    }

    fn slot(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> Slot {
        Slot {
            permit: Some(permit),
            limit: Arc::clone(self),
        }
    }

    /// The limit asked for last.
    #[must_use]
    pub fn limit(&self) -> usize {
        *self
            .limit
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Slots held now (about: a limit being lowered counts what it still takes back).
    #[must_use]
    pub fn held(&self) -> usize {
        let free = self.slots.available_permits() + self.owed.load(Ordering::Acquire);
        self.limit().saturating_sub(free)
    }

    /// Changes the limit to `next` (at least one).
    pub fn set(&self, next: usize) {
        let next = next.clamp(1, Semaphore::MAX_PERMITS);
        let mut limit = self
            .limit
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if next > *limit {
            // Cancel what is still owed first, then add the rest.
            let mut more = next - *limit;
            let forgiven = self
                .owed
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |owed| {
                    Some(owed - owed.min(more))
                })
                .map_or(0, |owed| owed.min(more));
            more -= forgiven;
            self.slots.add_permits(more);
        } else if next < *limit {
            let fewer = *limit - next;
            let taken = self.slots.forget_permits(fewer);
            self.owed.fetch_add(fewer - taken, Ordering::AcqRel);
        }
        *limit = next;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        // A slot owed to a lowered limit is not given back.
        let kept = self
            .limit
            .owed
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |owed| {
                owed.checked_sub(1)
            })
            .is_ok();
        if kept {
            permit.forget();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take_all(limit: &Arc<Limit>) -> Vec<Slot> {
        std::iter::from_fn(|| limit.try_take().ok()).collect()
    }

    #[test]
    fn at_most_the_limit_is_held() {
        let limit = Limit::new(3);
        let held = take_all(&limit);
        assert_eq!(held.len(), 3);
        drop(held);
        assert_eq!(take_all(&limit).len(), 3);
        assert_eq!(Limit::new(0).limit(), 1, "at least one");
        // A configured limit beyond what a semaphore holds is clamped, not a panic.
        let huge = Limit::new(usize::MAX);
        assert_eq!(huge.limit(), Semaphore::MAX_PERMITS);
        huge.set(1);
        huge.set(usize::MAX);
        assert_eq!(huge.limit(), Semaphore::MAX_PERMITS);
    }

    #[test]
    fn raising_the_limit_frees_slots_at_once() {
        let limit = Limit::new(2);
        let mut held = take_all(&limit);
        limit.set(5);
        held.extend(take_all(&limit));
        assert_eq!(held.len(), 5);
        assert_eq!(limit.limit(), 5);
    }

    #[test]
    fn lowering_the_limit_cuts_nothing_held_and_takes_slots_back_as_they_are_let_go() {
        let limit = Limit::new(4);
        let mut held = take_all(&limit);
        drop(held.pop()); // 3 held, 1 free
        limit.set(1);
        assert!(limit.try_take().is_err(), "the free slot was taken back");
        // Two of the three held are owed: letting them go frees nothing.
        drop(held.pop());
        drop(held.pop());
        assert!(limit.try_take().is_err());
        // The last one held is within the new limit: it comes back.
        drop(held.pop());
        let again = take_all(&limit);
        assert_eq!(again.len(), 1);
    }

    #[test]
    fn raising_again_before_the_holders_let_go_forgives_what_is_owed() {
        let limit = Limit::new(4);
        let held = take_all(&limit);
        limit.set(1); // 3 owed
        limit.set(3); // 1 owed
        drop(held);
        assert_eq!(take_all(&limit).len(), 3);
        limit.set(3);
        assert_eq!(limit.limit(), 3);
    }

    #[tokio::test]
    async fn a_waiter_gets_a_slot_the_raise_adds() {
        let limit = Limit::new(1);
        let _held = limit.try_take().expect("free");
        let waiting = tokio::spawn({
            let limit = Arc::clone(&limit);
            async move { limit.take().await.map(|_slot| ()) }
        });
        tokio::task::yield_now().await;
        limit.set(2);
        tokio::time::timeout(std::time::Duration::from_secs(1), waiting)
            .await
            .expect("woken by the raise")
            .expect("joined")
            .expect("a slot");
    }
}
