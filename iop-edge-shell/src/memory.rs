//! The Edge's memory budget: request bodies and response bytes buffered for callers, in
//! all. A new request that does not fit is refused with 503 `overloaded` before its body
//! is read; requests already admitted keep going (their response bytes are counted, not
//! refused), so the budget bounds what callers can make the Edge hold without ever
//! breaking a request half way.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes held for requests, against a limit.
#[derive(Debug)]
pub struct Budget {
    used: AtomicUsize,
    max: AtomicUsize,
}

impl Budget {
    /// A budget of `max` bytes.
    #[must_use]
    pub fn new(max: usize) -> Self {
        Budget {
            used: AtomicUsize::new(0),
            max: AtomicUsize::new(max),
        }
    }

    /// Changes the limit (on reload); what is held stays.
    pub fn set_max(&self, max: usize) {
        self.max.store(max, Ordering::Relaxed);
    }

    /// Bytes held now.
    #[must_use]
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Takes `n` bytes if they fit.
    #[must_use]
    pub fn try_reserve(&self, n: usize) -> bool {
        let max = self.max.load(Ordering::Relaxed);
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&total| total <= max)
            })
            .is_ok()
    }

    fn add(&self, n: usize) {
        self.used.fetch_add(n, Ordering::AcqRel);
    }

    fn release(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }
}

/// Set in [`RequestMemory`]'s buffered count once the caller is gone: nothing more may be
/// added, and what was buffered has been returned.
const CLOSED: usize = 1 << (usize::BITS - 1);

/// What one request holds of the budget: its body, and the response bytes buffered for
/// its caller. Shared by the handler (which consumes) and the core (which buffers);
/// everything returns to the budget when the handler is done with it.
#[derive(Debug)]
pub struct RequestMemory {
    budget: Arc<Budget>,
    body: AtomicUsize,
    buffered: AtomicUsize,
}

impl RequestMemory {
    /// Accounting for a request against `budget`, holding nothing yet.
    #[must_use]
    pub fn new(budget: Arc<Budget>) -> Self {
        RequestMemory {
            budget,
            body: AtomicUsize::new(0),
            buffered: AtomicUsize::new(0),
        }
    }

    /// Takes `n` more bytes of body if they fit the budget.
    #[must_use]
    pub fn reserve_body(&self, n: usize) -> bool {
        if self.budget.try_reserve(n) {
            self.body.fetch_add(n, Ordering::AcqRel);
            true
        } else {
            false
        }
    }

    /// Counts `n` response bytes buffered for the caller; false once the caller is gone
    /// (then nothing was counted). Returns the request's buffered total otherwise.
    pub fn buffer(&self, n: usize) -> Option<usize> {
        let before = self
            .buffered
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                (b & CLOSED == 0).then_some(b + n)
            })
            .ok()?;
        self.budget.add(n);
        Some(before + n)
    }

    /// The caller took `n` buffered bytes.
    pub fn consumed(&self, n: usize) {
        let before = self.buffered.fetch_sub(n, Ordering::AcqRel);
        debug_assert!(before & !CLOSED >= n, "consumed more than was buffered");
        self.budget.release(n);
    }

    /// The caller is gone: return the body and whatever is still buffered.
    pub fn close(&self) {
        let buffered = self.buffered.fetch_or(CLOSED, Ordering::AcqRel);
        if buffered & CLOSED == 0 {
            self.budget.release(buffered);
            self.budget.release(self.body.swap(0, Ordering::AcqRel));
        }
    }
}

impl Drop for RequestMemory {
    /// Whatever it still holds goes back: a handler that reads a body without a response
    /// to buffer (a token count, a node command) returns it when it is done.
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_refuses_what_does_not_fit_and_everything_comes_back() {
        let budget = Arc::new(Budget::new(100));
        let a = RequestMemory::new(budget.clone());
        let b = RequestMemory::new(budget.clone());
        assert!(a.reserve_body(60));
        assert!(!b.reserve_body(50), "over the budget");
        assert!(b.reserve_body(40));
        // Response bytes are counted even past the limit; new bodies are then refused.
        assert_eq!(a.buffer(30), Some(30));
        assert_eq!(budget.used(), 130);
        assert!(!RequestMemory::new(budget.clone()).reserve_body(1));
        a.consumed(10);
        a.close();
        assert_eq!(a.buffer(5), None, "nothing is added for a caller that left");
        a.close();
        assert_eq!(budget.used(), 40);
        b.close();
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_request_dropped_without_closing_gives_its_body_back() {
        let budget = Arc::new(Budget::new(100));
        let a = RequestMemory::new(budget.clone());
        assert!(a.reserve_body(60));
        assert_eq!(a.buffer(10), Some(10));
        drop(a);
        assert_eq!(budget.used(), 0);
    }
}
