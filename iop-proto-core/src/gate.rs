//! The Node's capacity gate: one per adapter instance, shared by normalized runs and raw
//! tunnels. It protects a backend from work that bypassed the Edge's queue (defense in
//! depth, not admission): work beyond capacity is refused at once, never queued.

/// Why the gate refused work.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GateError {
    /// Every unit of capacity is in use.
    #[error("adapter at capacity ({capacity} in flight)")]
    Full {
        /// The configured capacity.
        capacity: u32,
    },
    /// Every unit of long-context capacity is in use.
    #[error("adapter at long-context capacity ({long_capacity} in flight)")]
    LongFull {
        /// The configured long-context capacity.
        long_capacity: u32,
    },
    /// The adapter was removed or disabled by a config refresh; it takes no new work.
    #[error("adapter is disabled or was removed")]
    Closed,
}

/// Concurrency limits of one adapter instance.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CapacityGate {
    capacity: u32,
    long_capacity: u32,
    in_flight: u32,
    long_in_flight: u32,
    /// Units the node's work for another (draining) session holds.
    held: u32,
    long_held: u32,
    open: bool,
}

impl CapacityGate {
    /// An open gate with the given limits (long-context work counts in both).
    #[must_use]
    pub fn new(capacity: u32, long_capacity: u32) -> Self {
        CapacityGate {
            capacity,
            long_capacity: long_capacity.min(capacity),
            in_flight: 0,
            long_in_flight: 0,
            held: 0,
            long_held: 0,
            open: true,
        }
    }

    /// Units the node's work for another session holds (a re-homed node's draining
    /// session to an earlier Edge process): taken, beside this session's own work.
    pub fn set_held(&mut self, held: u32, long_held: u32) {
        self.held = held;
        self.long_held = long_held.min(held);
    }

    /// Work in flight.
    #[must_use]
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Long-context work in flight (also counted in [`in_flight`](Self::in_flight)).
    #[must_use]
    pub fn long_in_flight(&self) -> u32 {
        self.long_in_flight
    }

    /// Configured capacity.
    #[must_use]
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Whether it admits new work.
    #[must_use]
    pub fn is_open(&self) -> bool {
        self.open
    }

    /// Takes one unit, or refuses at once.
    pub fn try_acquire(&mut self, long: bool) -> Result<(), GateError> {
        if !self.open {
            return Err(GateError::Closed);
        }
        if self.in_flight.saturating_add(self.held) >= self.capacity {
            return Err(GateError::Full {
                capacity: self.capacity,
            });
        }
        if long && self.long_in_flight.saturating_add(self.long_held) >= self.long_capacity {
            return Err(GateError::LongFull {
                long_capacity: self.long_capacity,
            });
        }
        self.in_flight += 1;
        if long {
            self.long_in_flight += 1;
        }
        Ok(())
    }

    /// Returns one unit taken by [`try_acquire`](Self::try_acquire).
    pub fn release(&mut self, long: bool) {
        debug_assert!(self.in_flight > 0, "release without acquire");
        self.in_flight = self.in_flight.saturating_sub(1);
        if long {
            self.long_in_flight = self.long_in_flight.saturating_sub(1);
        }
    }

    /// New limits from a config refresh; work in flight keeps its units.
    pub fn resize(&mut self, capacity: u32, long_capacity: u32) {
        self.capacity = capacity;
        self.long_capacity = long_capacity.min(capacity);
        self.open = true;
    }

    /// Stops admitting work (adapter removed or disabled); work in flight finishes.
    pub fn close(&mut self) {
        self.open = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_beyond_capacity_at_once() {
        let mut gate = CapacityGate::new(2, 1);
        gate.try_acquire(true).expect("long fits");
        assert_eq!(
            gate.try_acquire(true),
            Err(GateError::LongFull { long_capacity: 1 })
        );
        gate.try_acquire(false).expect("short fits");
        assert_eq!(
            gate.try_acquire(false),
            Err(GateError::Full { capacity: 2 })
        );
        gate.release(true);
        gate.try_acquire(false).expect("freed");
        assert_eq!((gate.in_flight(), gate.long_in_flight()), (2, 0));
    }

    #[test]
    fn closed_gate_refuses_new_work_but_lets_work_finish() {
        let mut gate = CapacityGate::new(1, 0);
        gate.try_acquire(false).expect("fits");
        gate.close();
        gate.release(false);
        assert_eq!(gate.try_acquire(false), Err(GateError::Closed));
        gate.resize(3, 0);
        assert!(gate.try_acquire(false).is_ok());
    }
}
