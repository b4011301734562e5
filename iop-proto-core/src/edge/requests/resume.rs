//! A streamed answer continued after its run was lost (docs in README, "A stream that
//! survives its node"): what a request keeps of the answer it delivered, so that another
//! provider can continue it from there, and how the continuing run's events are joined
//! to what the caller already has.

use bytes::Bytes;

use crate::wire::{RunEvent, RunEventType};

/// Most text a request keeps to continue from: a longer answer is not continued (its
/// prefill would cost a provider as much as the answer itself, and the Edge the memory).
pub(in crate::edge) const MAX_RESUME_TEXT: usize = 256 << 10;

/// What a streamed normalized request keeps to be continued.
#[derive(Debug)]
pub(in crate::edge) struct Resume {
    /// The text its caller has, in order.
    text: String,
    /// Output events with text its caller has (the mock's tokens; a provider's stream
    /// sends about one token per event): what `max_tokens` is lowered by.
    produced: u64,
    /// Completion tokens of the runs before the one answering now (reported by none of
    /// them: counted as `produced` when each was lost).
    earlier: u64,
    /// Continuations so far, and the most allowed.
    pub(in crate::edge) resumes: u32,
    limit: u32,
    /// Something else than text was delivered (metadata on an output event): never
    /// continued.
    spoilt: bool,
    /// The body the next dispatch is sent with, while a continuation is being placed.
    pub(in crate::edge) body: Option<Bytes>,
    /// A continuation answers (or is being placed): its run's start is not the caller's.
    pub(in crate::edge) continued: bool,
    /// The last sequence number the caller saw: a continuing run's events are numbered
    /// on from it, so the caller reads one stream.
    sequence: u64,
}

impl Resume {
    pub(in crate::edge) fn new(limit: u32) -> Self {
        Resume {
            text: String::new(),
            produced: 0,
            earlier: 0,
            resumes: 0,
            limit,
            spoilt: false,
            body: None,
            continued: false,
            sequence: 0,
        }
    }

    /// Bytes of answer the caller has (kept for a continuation).
    pub(in crate::edge) fn delivered(&self) -> usize {
        self.text.len()
    }

    /// What the caller has cannot be continued (a tunnel's bytes).
    pub(in crate::edge) fn spoil(&mut self) {
        self.spoilt = true;
        self.text = String::new();
    }

    /// Whether another continuation may be tried.
    pub(in crate::edge) fn may_continue(&self) -> bool {
        !self.spoilt && self.resumes < self.limit
    }

    /// `event` goes to the caller: kept, and adjusted for a continuation: the start of a
    /// continuing run is dropped (the caller had one), its usage counts the earlier
    /// runs' output too. `None` for an event the caller must not get.
    pub(in crate::edge) fn deliver(&mut self, mut event: RunEvent) -> Option<RunEvent> {
        let kind = RunEventType::try_from(event.r#type).ok();
        if self.continued && kind == Some(RunEventType::Start) {
            return None;
        }
        if self.continued {
            self.sequence += 1;
            event.sequence = self.sequence;
        } else {
            self.sequence = event.sequence;
        }
        if kind == Some(RunEventType::Delta) {
            if !event.metadata.is_empty() {
                self.spoilt = true;
            }
            if !event.delta.is_empty() {
                self.produced += 1;
                if self.text.len() + event.delta.len() > MAX_RESUME_TEXT {
                    self.spoilt = true;
                    self.text = String::new();
                } else if !self.spoilt {
                    self.text.push_str(&event.delta);
                }
            }
        }
        if self.earlier > 0
            && let Some(usage) = event.usage.as_mut()
        {
            usage.completion_tokens += self.earlier;
            usage.total_tokens += self.earlier;
        }
        Some(event)
    }

    /// Whether [`continue_from`](Self::continue_from) would continue `original` now.
    pub(in crate::edge) fn could_continue(&self, original: &[u8]) -> bool {
        self.may_continue() && iop_json::continuation(original, &self.text, self.produced).is_some()
    }

    /// The body that continues `original` after what was delivered, counting one more
    /// continuation; `None` when it cannot be continued exactly.
    pub(in crate::edge) fn continue_from(&mut self, original: &[u8]) -> Option<Bytes> {
        if !self.may_continue() {
            return None;
        }
        let body = iop_json::continuation(original, &self.text, self.produced)?;
        self.resumes += 1;
        self.earlier = self.produced;
        self.body = Some(body.clone());
        self.continued = true;
        Some(body)
    }
}
