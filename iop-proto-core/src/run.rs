//! The run tracker: checks that one normalized run's events follow the contract
//! (`START`, `DELTA*`, exactly one terminal of `COMPLETE`/`ERROR`/`CANCELLED`, sequence
//! strictly increasing). Used on both sides: the Node checks what it emits, the Edge what
//! it receives. A violation concerns that run only; other runs on the connection go on.

use crate::wire::{RunEvent, RunEventType};

/// What a valid event did to the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunStep {
    /// The run started.
    Started,
    /// A delta arrived.
    Delta,
    /// The run ended with this terminal type (`Complete`, `Error` or `Cancelled`).
    Terminal(RunEventType),
}

/// How an event broke the contract.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RunViolation {
    /// The type is not a defined `RunEventType` (or is unspecified).
    #[error("run event type {0} is not a known event type")]
    UnknownType(i32),
    /// The first event was not `START`.
    #[error("first run event must be START, got {0:?}")]
    NotStarted(RunEventType),
    /// A second `START`.
    #[error("duplicate START")]
    DuplicateStart,
    /// Anything after the terminal event.
    #[error("{0:?} after the terminal event")]
    AfterTerminal(RunEventType),
    /// A sequence number not above the previous one.
    #[error("sequence {got} does not increase past {last}")]
    SequenceNotIncreasing {
        /// Previous sequence.
        last: u64,
        /// Offending sequence.
        got: u64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
enum Phase {
    #[default]
    AwaitStart,
    Running,
    Ended,
}

/// Contract checker for one run's event stream.
#[derive(Clone, Debug, Default)]
pub struct RunTracker {
    phase: Phase,
    last_sequence: Option<u64>,
}

impl RunTracker {
    /// A tracker expecting `START`.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// True once a terminal event was accepted or a violation ended the run.
    #[must_use]
    pub fn is_ended(&self) -> bool {
        self.phase == Phase::Ended
    }

    /// Checks `event`, the next event of this run. After a violation, or after the
    /// terminal event, every further event is refused.
    pub fn observe(&mut self, event: &RunEvent) -> Result<RunStep, RunViolation> {
        let result = self.check(event);
        match result {
            Ok(RunStep::Terminal(_)) | Err(_) => self.phase = Phase::Ended,
            Ok(_) => self.phase = Phase::Running,
        }
        if result.is_ok() {
            self.last_sequence = Some(event.sequence);
        }
        result
    }

    fn check(&self, event: &RunEvent) -> Result<RunStep, RunViolation> {
        let kind = match RunEventType::try_from(event.r#type) {
            Ok(RunEventType::Unspecified) | Err(_) => {
                return Err(RunViolation::UnknownType(event.r#type));
            }
            Ok(kind) => kind,
        };
        if self.phase == Phase::Ended {
            return Err(RunViolation::AfterTerminal(kind));
        }
        if let Some(last) = self.last_sequence
            && event.sequence <= last
        {
            return Err(RunViolation::SequenceNotIncreasing {
                last,
                got: event.sequence,
            });
        }
        match (self.phase, kind) {
            (Phase::AwaitStart, RunEventType::Start) => Ok(RunStep::Started),
            (Phase::AwaitStart, other) => Err(RunViolation::NotStarted(other)),
            (_, RunEventType::Start) => Err(RunViolation::DuplicateStart),
            (_, RunEventType::Delta) => Ok(RunStep::Delta),
            (_, terminal) => Ok(RunStep::Terminal(terminal)),
        }
    }
}

/// Numbers the events a Node emits for one run, so its output is always a valid sequence.
#[derive(Clone, Debug)]
pub struct RunEmitter {
    run_id: String,
    next_sequence: u64,
    ended: bool,
}

impl RunEmitter {
    /// An emitter for `run_id`, starting at sequence 0.
    #[must_use]
    pub fn new(run_id: impl Into<String>) -> Self {
        RunEmitter {
            run_id: run_id.into(),
            next_sequence: 0,
            ended: false,
        }
    }

    /// True once a terminal event was emitted.
    #[must_use]
    pub fn is_ended(&self) -> bool {
        self.ended
    }

    /// The next event of type `kind`, or `None` once the run has ended (nothing may
    /// follow a terminal event). The caller fills in delta, usage, metadata or error.
    pub fn next(&mut self, kind: RunEventType) -> Option<RunEvent> {
        if self.ended {
            return None;
        }
        self.ended = matches!(
            kind,
            RunEventType::Complete | RunEventType::Error | RunEventType::Cancelled
        );
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        Some(RunEvent {
            run_id: self.run_id.clone(),
            sequence,
            r#type: kind as i32,
            ..RunEvent::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: RunEventType, sequence: u64) -> RunEvent {
        RunEvent {
            run_id: "r".into(),
            sequence,
            r#type: kind as i32,
            ..Default::default()
        }
    }

    #[test]
    fn start_deltas_and_one_terminal_pass() {
        let mut t = RunTracker::new();
        assert_eq!(
            t.observe(&event(RunEventType::Start, 0)),
            Ok(RunStep::Started)
        );
        assert_eq!(
            t.observe(&event(RunEventType::Delta, 1)),
            Ok(RunStep::Delta)
        );
        assert_eq!(
            t.observe(&event(RunEventType::Delta, 5)),
            Ok(RunStep::Delta)
        );
        assert_eq!(
            t.observe(&event(RunEventType::Complete, 6)),
            Ok(RunStep::Terminal(RunEventType::Complete))
        );
        assert!(t.is_ended());
        assert_eq!(
            t.observe(&event(RunEventType::Delta, 7)),
            Err(RunViolation::AfterTerminal(RunEventType::Delta))
        );
    }

    #[test]
    fn violations_are_named() {
        let mut t = RunTracker::new();
        assert_eq!(
            t.observe(&event(RunEventType::Delta, 0)),
            Err(RunViolation::NotStarted(RunEventType::Delta))
        );
        let mut t = RunTracker::new();
        t.observe(&event(RunEventType::Start, 3)).expect("start");
        assert_eq!(
            t.observe(&event(RunEventType::Delta, 3)),
            Err(RunViolation::SequenceNotIncreasing { last: 3, got: 3 })
        );
        let mut t = RunTracker::new();
        t.observe(&event(RunEventType::Start, 0)).expect("start");
        assert_eq!(
            t.observe(&event(RunEventType::Start, 1)),
            Err(RunViolation::DuplicateStart)
        );
        let mut t = RunTracker::new();
        let bogus = RunEvent {
            r#type: 42,
            ..event(RunEventType::Start, 0)
        };
        assert_eq!(t.observe(&bogus), Err(RunViolation::UnknownType(42)));
        assert!(t.is_ended());
    }

    #[test]
    fn a_run_may_end_without_deltas_in_any_terminal() {
        for terminal in [
            RunEventType::Complete,
            RunEventType::Error,
            RunEventType::Cancelled,
        ] {
            let mut t = RunTracker::new();
            t.observe(&event(RunEventType::Start, 0)).expect("start");
            assert_eq!(
                t.observe(&event(terminal, 1)),
                Ok(RunStep::Terminal(terminal))
            );
        }
    }

    #[test]
    fn emitter_stops_after_the_terminal() {
        let mut e = RunEmitter::new("r");
        let mut t = RunTracker::new();
        for kind in [
            RunEventType::Start,
            RunEventType::Delta,
            RunEventType::Error,
        ] {
            let ev = e.next(kind).expect("open");
            t.observe(&ev).expect("valid");
        }
        assert!(e.next(RunEventType::Delta).is_none());
        assert!(e.next(RunEventType::Complete).is_none());
    }
}
