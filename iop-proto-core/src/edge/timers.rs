//! The Edge's timers: one table, keyed by what each timer is about. What a timer does
//! when it fires is in `transitions` (`EdgeCore::fire`).

use super::registry::NodeIdx;
use super::*;

/// One timer of the Edge, keyed by what it is about; at most one per key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum TimerKey {
    /// A connection must register, then report ready, before this.
    Handshake(ConnId),
    /// A connection that sends nothing until this is lost (re-armed lazily from its
    /// last receive, so a busy connection costs no timer work per frame).
    Liveness(ConnId),
    /// Ping a registered connection.
    Ping(ConnId),
    /// A held refusal of a failed register is sent then (see `Phase::Held`).
    Answer(ConnId),
    /// A node's config refresh must be answered by this.
    Refresh(NodeIdx),
    /// A cancelled run keeps its lease at most until this.
    CancelGrace(RunId),
    /// A node command must be answered by this.
    Command(u64),
    /// A run that has not reached its first byte by this is slow: another provider may
    /// be tried beside it.
    FirstByte(RunId),
    /// An ejected provider may be probed from this instant: waiters are served again.
    Probe(ResourceId),
}

impl crate::timer::TimerKey for TimerKey {
    fn reason(&self) -> &'static str {
        match self {
            TimerKey::Handshake(_) => "handshake",
            TimerKey::Liveness(_) => "liveness",
            TimerKey::Ping(_) => "ping",
            TimerKey::Answer(_) => "held register answer",
            TimerKey::Refresh(_) => "refresh answer",
            TimerKey::CancelGrace(_) => "cancel grace",
            TimerKey::Command(_) => "command answer",
            TimerKey::FirstByte(_) => "first byte",
            TimerKey::Probe(_) => "probe",
        }
    }
}
