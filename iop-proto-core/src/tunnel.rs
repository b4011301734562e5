//! The tunnel sequencer: the ordered frames of one raw provider response.
//!
//! Contract: sequence starts at 0 and increases by one; `STATUS` (with the response
//! headers) comes first, then any `HEADERS`/`BODY`/`USAGE`, then exactly one `END` or
//! `ERROR`, and nothing after it. `USAGE` and `metadata` are observations and never join
//! the body. The [`TunnelEmitter`] (Node side) can only produce valid sequences and splits
//! bodies into chunks of at most the configured size, so one large response cannot starve
//! other runs on the connection; the [`TunnelReceiver`] (Edge side) checks every frame.

use bytes::Bytes;

use crate::wire::{ErrorDetail, Header, ProviderTunnelFrame, TunnelFrameKind, Usage};

/// Default maximum size of one `BODY` frame's payload: 64 KiB.
pub const DEFAULT_CHUNK_SIZE: usize = 64 * 1024;

/// Caller request headers a tunnel carries to the provider: they describe the body or the
/// client (`anthropic-version` and `anthropic-beta` say which Messages API a caller
/// speaks, for a provider that serves it natively). Credentials (the caller's key is the
/// Edge's, the provider's key is the adapter's), cookies and hop-by-hop headers never
/// cross.
pub const FORWARDED_REQUEST_HEADERS: [&str; 6] = [
    "content-type",
    "accept",
    "user-agent",
    "openai-beta",
    "anthropic-version",
    "anthropic-beta",
];

/// Provider response headers a tunnel carries back to the caller; every other header is
/// dropped by the Node before it reaches the link, and again by the Edge.
///
/// - `content-type`, `content-encoding`: describe the body, which passes byte for byte.
/// - `cache-control`: keeps intermediaries from buffering or caching streams.
/// - `retry-after`: what a caller needs to honour a provider's 429 or 503.
/// - `x-request-id`: the provider's id, for a support request about one call.
///
/// Dropped on purpose: upstream routing and accounting (`openai-organization`,
/// `openai-project`, `x-litellm-*`, spend and version headers), rate-limit figures of
/// the upstream account (`x-ratelimit-*`), timing (`openai-processing-ms`, which tells
/// callers which upstream serves them), cookies, and anything hop-by-hop.
pub const FORWARDED_RESPONSE_HEADERS: [&str; 5] = [
    "content-type",
    "content-encoding",
    "cache-control",
    "retry-after",
    "x-request-id",
];

/// Whether a caller request header named `name` (any case) goes through a tunnel.
#[must_use]
pub fn forwards_request_header(name: &str) -> bool {
    FORWARDED_REQUEST_HEADERS
        .iter()
        .any(|h| h.eq_ignore_ascii_case(name))
}

/// Whether a provider response header (or trailer) named `name` (any case) goes back
/// through a tunnel.
#[must_use]
pub fn forwards_response_header(name: &str) -> bool {
    forwarded_response_header(name.as_bytes()).is_some()
}

/// The name a provider response header (or trailer) named `name` (any case, as read off
/// the wire: bytes that need not be UTF-8) goes back through a tunnel under: its entry
/// of [`FORWARDED_RESPONSE_HEADERS`], lower-case; `None` for a header that stays behind.
#[must_use]
pub fn forwarded_response_header(name: &[u8]) -> Option<&'static str> {
    FORWARDED_RESPONSE_HEADERS
        .into_iter()
        .find(|h| h.as_bytes().eq_ignore_ascii_case(name))
}

/// What a valid frame carried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TunnelStep {
    /// The status line and headers.
    Status,
    /// More headers (trailers).
    Headers,
    /// A body chunk.
    Body,
    /// A usage observation.
    Usage,
    /// Terminal: the body is complete.
    End,
    /// Terminal: the tunnel failed or was cancelled.
    Error,
}

impl TunnelStep {
    /// True for `End` and `Error`.
    #[must_use]
    pub fn is_terminal(self) -> bool {
        matches!(self, TunnelStep::End | TunnelStep::Error)
    }
}

/// How a frame broke the contract.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TunnelViolation {
    /// The kind is not a defined `TunnelFrameKind` (or is unspecified).
    #[error("tunnel frame kind {0} is not a known kind")]
    UnknownKind(i32),
    /// A sequence number other than the next one.
    #[error("tunnel frame sequence {got}, expected {expected}")]
    OutOfSequence {
        /// The next sequence number.
        expected: u64,
        /// The one received.
        got: u64,
    },
    /// The first frame was not `STATUS`.
    #[error("first tunnel frame must be STATUS, got {0:?}")]
    StatusNotFirst(TunnelFrameKind),
    /// A second `STATUS`.
    #[error("duplicate STATUS frame")]
    DuplicateStatus,
    /// A `STATUS` frame whose code is not an HTTP status (100..=599).
    #[error("STATUS frame carries invalid HTTP status {0}")]
    InvalidStatus(u32),
    /// Anything after `END` or `ERROR`.
    #[error("{0:?} after the terminal frame")]
    AfterTerminal(TunnelFrameKind),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
enum Phase {
    #[default]
    AwaitStatus,
    Streaming,
    Ended,
}

/// Checks the frames of one tunnel as they arrive.
#[derive(Clone, Debug, Default)]
pub struct TunnelReceiver {
    phase: Phase,
    next_sequence: u64,
}

impl TunnelReceiver {
    /// A receiver expecting `STATUS` with sequence 0.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// True once a terminal frame was accepted or a violation ended the tunnel.
    #[must_use]
    pub fn is_ended(&self) -> bool {
        self.phase == Phase::Ended
    }

    /// Checks `frame`, the next frame of this tunnel. After a violation or a terminal
    /// frame every further frame is refused.
    pub fn observe(&mut self, frame: &ProviderTunnelFrame) -> Result<TunnelStep, TunnelViolation> {
        self.step(frame.kind, frame.sequence, frame.status_code)
    }

    /// [`observe`](Self::observe) for `part`, the next part of this tunnel, numbered
    /// `sequence` ([`split_parts`]): the same checks, on what the part kept of its frame.
    pub fn observe_part(
        &mut self,
        sequence: u64,
        part: &TunnelPart,
    ) -> Result<TunnelStep, TunnelViolation> {
        let (kind, status_code) = match part {
            TunnelPart::Frame(frame) => (frame.kind, frame.status_code),
            TunnelPart::Status { code, .. } => (TunnelFrameKind::Status as i32, *code),
            TunnelPart::Body(_) => (TunnelFrameKind::Body as i32, 0),
            TunnelPart::Usage(_) => (TunnelFrameKind::Usage as i32, 0),
            TunnelPart::End => (TunnelFrameKind::End as i32, 0),
        };
        self.step(kind, sequence, status_code)
    }

    fn step(
        &mut self,
        kind: i32,
        sequence: u64,
        status_code: u32,
    ) -> Result<TunnelStep, TunnelViolation> {
        let result = self.check(kind, sequence, status_code);
        match result {
            Ok(step) if !step.is_terminal() => self.phase = Phase::Streaming,
            _ => self.phase = Phase::Ended,
        }
        if result.is_ok() {
            self.next_sequence += 1;
        }
        result
    }

    fn check(
        &self,
        kind: i32,
        sequence: u64,
        status_code: u32,
    ) -> Result<TunnelStep, TunnelViolation> {
        let raw = kind;
        let kind = match TunnelFrameKind::try_from(raw) {
            Ok(TunnelFrameKind::Unspecified) | Err(_) => {
                return Err(TunnelViolation::UnknownKind(raw));
            }
            Ok(kind) => kind,
        };
        if self.phase == Phase::Ended {
            return Err(TunnelViolation::AfterTerminal(kind));
        }
        if sequence != self.next_sequence {
            return Err(TunnelViolation::OutOfSequence {
                expected: self.next_sequence,
                got: sequence,
            });
        }
        match (self.phase, kind) {
            (Phase::AwaitStatus, TunnelFrameKind::Status) => {
                if (100..=599).contains(&status_code) {
                    Ok(TunnelStep::Status)
                } else {
                    Err(TunnelViolation::InvalidStatus(status_code))
                }
            }
            // A tunnel may fail before the provider answered at all.
            (Phase::AwaitStatus, TunnelFrameKind::Error) => Ok(TunnelStep::Error),
            (Phase::AwaitStatus, other) => Err(TunnelViolation::StatusNotFirst(other)),
            (_, TunnelFrameKind::Status) => Err(TunnelViolation::DuplicateStatus),
            (_, TunnelFrameKind::Headers) => Ok(TunnelStep::Headers),
            (_, TunnelFrameKind::Body) => Ok(TunnelStep::Body),
            (_, TunnelFrameKind::Usage) => Ok(TunnelStep::Usage),
            (_, TunnelFrameKind::End) => Ok(TunnelStep::End),
            (_, TunnelFrameKind::Error) => Ok(TunnelStep::Error),
            (_, TunnelFrameKind::Unspecified) => Err(TunnelViolation::UnknownKind(0)),
        }
    }
}

/// Produces the frames of one tunnel on the Node side, in contract order.
///
/// Each method returns the frames to send, empty once the tunnel has ended (after
/// [`end`](Self::end) or [`error`](Self::error), nothing more is produced) or when called
/// out of order (for example `body` before `status`, which yields nothing).
#[derive(Clone, Debug)]
pub struct TunnelEmitter {
    run_id: String,
    chunk_size: usize,
    next_sequence: u64,
    phase: Phase,
}

impl TunnelEmitter {
    /// An emitter for `run_id` splitting bodies into chunks of at most `chunk_size` bytes
    /// (at least 1).
    #[must_use]
    pub fn new(run_id: impl Into<String>, chunk_size: usize) -> Self {
        TunnelEmitter {
            run_id: run_id.into(),
            chunk_size: chunk_size.max(1),
            next_sequence: 0,
            phase: Phase::AwaitStatus,
        }
    }

    /// An emitter whose frames name no run (an empty `run_id`), for a caller that names
    /// the frames it sends itself: the Node session, where a part that joins the frame
    /// before it ([`merge_into`]) needs no name of its own.
    #[must_use]
    pub fn unnamed(chunk_size: usize) -> Self {
        Self::new(String::new(), chunk_size)
    }

    /// True once `END` or `ERROR` was produced.
    #[must_use]
    pub fn is_ended(&self) -> bool {
        self.phase == Phase::Ended
    }

    /// True once `STATUS` was produced.
    #[must_use]
    pub fn has_status(&self) -> bool {
        self.phase != Phase::AwaitStatus
    }

    fn frame(&mut self, kind: TunnelFrameKind) -> ProviderTunnelFrame {
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        ProviderTunnelFrame {
            run_id: self.run_id.clone(),
            sequence,
            kind: kind as i32,
            ..ProviderTunnelFrame::default()
        }
    }

    /// The `STATUS` frame. Only valid first; an invalid HTTP status is clamped to 502.
    pub fn status(
        &mut self,
        status_code: u32,
        headers: Vec<Header>,
    ) -> Option<ProviderTunnelFrame> {
        if self.phase != Phase::AwaitStatus {
            return None;
        }
        self.phase = Phase::Streaming;
        let mut frame = self.frame(TunnelFrameKind::Status);
        frame.status_code = if (100..=599).contains(&status_code) {
            status_code
        } else {
            502
        };
        frame.headers = headers;
        Some(frame)
    }

    /// `BODY` frames for `data`, split into chunks of at most the chunk size. The chunks
    /// are slices of `data`, not copies, made as the frames are taken: a body that fits one
    /// chunk, an SSE event's, becomes its frame's body as it is, and nothing is allocated
    /// to hold the frames. Nothing comes out before `STATUS`, after the end, or for no
    /// data.
    pub fn body(&mut self, data: Bytes) -> BodyFrames<'_> {
        let rest = if self.phase == Phase::Streaming {
            data
        } else {
            Bytes::new()
        };
        BodyFrames {
            emitter: self,
            rest,
        }
    }

    /// A `HEADERS` frame (trailers).
    pub fn headers(&mut self, headers: Vec<Header>) -> Option<ProviderTunnelFrame> {
        if self.phase != Phase::Streaming {
            return None;
        }
        let mut frame = self.frame(TunnelFrameKind::Headers);
        frame.headers = headers;
        Some(frame)
    }

    /// A `USAGE` observation.
    pub fn usage(&mut self, usage: Usage) -> Option<ProviderTunnelFrame> {
        if self.phase != Phase::Streaming {
            return None;
        }
        let mut frame = self.frame(TunnelFrameKind::Usage);
        frame.usage = Some(usage);
        Some(frame)
    }

    /// The terminal `END` frame (only after `STATUS`).
    pub fn end(&mut self) -> Option<ProviderTunnelFrame> {
        if self.phase != Phase::Streaming {
            return None;
        }
        self.phase = Phase::Ended;
        let mut frame = self.frame(TunnelFrameKind::End);
        frame.end = true;
        Some(frame)
    }

    /// The terminal `ERROR` frame; valid at any point before the end (a cancelled tunnel
    /// ends with it).
    pub fn error(&mut self, error: ErrorDetail) -> Option<ProviderTunnelFrame> {
        if self.phase == Phase::Ended {
            return None;
        }
        self.phase = Phase::Ended;
        let mut frame = self.frame(TunnelFrameKind::Error);
        frame.end = true;
        frame.error = Some(error);
        Some(frame)
    }
}

/// The `BODY` frames of one body, from [`TunnelEmitter::body`]; each is numbered as it is
/// taken, so take them all, in order (what is left untaken is never sent, and the frames
/// taken stay a valid sequence).
#[derive(Debug)]
#[must_use = "the frames are made as they are taken"]
pub struct BodyFrames<'a> {
    emitter: &'a mut TunnelEmitter,
    rest: Bytes,
}

impl Iterator for BodyFrames<'_> {
    type Item = ProviderTunnelFrame;

    fn next(&mut self) -> Option<ProviderTunnelFrame> {
        if self.rest.is_empty() {
            return None;
        }
        let body = if self.rest.len() <= self.emitter.chunk_size {
            std::mem::take(&mut self.rest)
        } else {
            self.rest.split_to(self.emitter.chunk_size)
        };
        let mut frame = self.emitter.frame(TunnelFrameKind::Body);
        frame.body = body;
        Some(frame)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.rest.len().div_ceil(self.emitter.chunk_size);
        (n, Some(n))
    }
}

impl ExactSizeIterator for BodyFrames<'_> {}

/// Where a part sits in a merged frame: `STATUS`, then `BODY`, then `USAGE`, then `END`.
/// `HEADERS` and `ERROR` are never merged.
fn stage(kind: TunnelFrameKind) -> Option<u8> {
    match kind {
        TunnelFrameKind::Status => Some(0),
        TunnelFrameKind::Body => Some(1),
        TunnelFrameKind::Usage => Some(2),
        TunnelFrameKind::End => Some(3),
        _ => None,
    }
}

/// The stage of the last part `frame` carries; `None` for a kind never merged.
fn last_stage(frame: &ProviderTunnelFrame) -> Option<u8> {
    let kind = TunnelFrameKind::try_from(frame.kind).ok()?;
    let first = stage(kind)?;
    Some(if frame.end {
        3
    } else if frame.usage.is_some() {
        first.max(2)
    } else if !frame.body.is_empty() {
        first.max(1)
    } else {
        first
    })
}

/// How many parts `frame` carries: 1 unless it is merged (`STATUS` with a body, usage or
/// the end; `BODY` with usage or the end; `USAGE` with the end).
#[must_use]
pub fn part_count(frame: &ProviderTunnelFrame) -> u64 {
    let Ok(kind) = TunnelFrameKind::try_from(frame.kind) else {
        return 1;
    };
    match kind {
        TunnelFrameKind::Status => {
            1 + u64::from(!frame.body.is_empty())
                + u64::from(frame.usage.is_some())
                + u64::from(frame.end)
        }
        TunnelFrameKind::Body => 1 + u64::from(frame.usage.is_some()) + u64::from(frame.end),
        TunnelFrameKind::Usage => 1 + u64::from(frame.end),
        _ => 1,
    }
}

/// Whether `frame` ends its tunnel: `END`, `ERROR`, or a merged frame whose last part is
/// `END`.
#[must_use]
pub fn ends_tunnel(frame: &ProviderTunnelFrame) -> bool {
    match TunnelFrameKind::try_from(frame.kind) {
        Ok(TunnelFrameKind::End | TunnelFrameKind::Error) => true,
        Ok(TunnelFrameKind::Status | TunnelFrameKind::Body | TunnelFrameKind::Usage) => frame.end,
        _ => false,
    }
}

/// Merges `part`, the frame that follows `into` in the same tunnel, into `into` when the
/// wire's merge rule allows it (`ProviderTunnelFrame` in the schema): a body into a
/// `STATUS` without one, usage into a `STATUS` or `BODY` without it, the end into a
/// `STATUS`, `BODY` or `USAGE`. The merged frame is exactly `into` then `part`, one frame
/// on the wire instead of two: `None`. Anything else (another tunnel, a sequence gap,
/// `HEADERS`, `ERROR`, a part out of the order) is handed back unchanged, to be sent on
/// its own.
#[must_use = "a part handed back must still be sent"]
pub fn merge_into(
    into: &mut ProviderTunnelFrame,
    part: ProviderTunnelFrame,
) -> Option<ProviderTunnelFrame> {
    if part.run_id != into.run_id {
        return Some(part);
    }
    merge_part(into, part)
}

/// [`merge_into`] for a part whose tunnel the caller knows is `into`'s (its name is not
/// looked at: an [`TunnelEmitter::unnamed`] part).
pub(crate) fn merge_part(
    into: &mut ProviderTunnelFrame,
    part: ProviderTunnelFrame,
) -> Option<ProviderTunnelFrame> {
    let (Some(held), Ok(kind)) = (last_stage(into), TunnelFrameKind::try_from(part.kind)) else {
        return Some(part);
    };
    let joins = held < 3
        && part_count(&part) == 1
        && part.sequence == into.sequence.saturating_add(part_count(into))
        && part.metadata.is_empty()
        && part.error.is_none()
        && match kind {
            TunnelFrameKind::Body => held == 0 && !part.body.is_empty() && part.headers.is_empty(),
            TunnelFrameKind::Usage => held < 2 && part.usage.is_some(),
            TunnelFrameKind::End => true,
            _ => false,
        };
    if !joins {
        return Some(part);
    }
    match kind {
        TunnelFrameKind::Body => into.body = part.body,
        TunnelFrameKind::Usage => into.usage = part.usage,
        _ => into.end = true,
    }
    None
}

/// The parts of `frame`, in order, each a frame of its own kind numbered from `frame`'s
/// sequence: what a merged frame stands for ([`merge_into`]); a frame that is not merged
/// is its only part.
pub fn split(frame: ProviderTunnelFrame) -> Parts {
    Parts { rest: Some(frame) }
}

/// The parts of `frame` as the Edge keeps them: each with its sequence number, as a
/// [`TunnelPart`], made straight from the frame's fields (a merged frame's parts are
/// never built as frames of their own, and name no run). Each part is what [`split`]
/// gives turned into a [`TunnelPart`], the run id of a kept whole frame that was merged
/// aside; a frame that is not merged is its only part.
pub fn split_parts(frame: ProviderTunnelFrame) -> TunnelParts {
    TunnelParts {
        merged: part_count(&frame) > 1,
        rest: Some(frame),
    }
}

/// The parts of one tunnel frame with their sequence numbers, from [`split_parts`].
#[derive(Debug)]
#[must_use = "the parts are made as they are taken"]
pub struct TunnelParts {
    rest: Option<ProviderTunnelFrame>,
    merged: bool,
}

impl Iterator for TunnelParts {
    type Item = (u64, TunnelPart);

    fn next(&mut self) -> Option<(u64, TunnelPart)> {
        let mut rest = self.rest.take()?;
        let sequence = rest.sequence;
        if part_count(&rest) == 1 {
            let mut part = TunnelPart::from(rest);
            if let TunnelPart::Frame(frame) = &mut part
                && self.merged
            {
                frame.run_id.clear();
            }
            return Some((sequence, part));
        }
        let first = take_first(&mut rest);
        self.rest = Some(rest);
        // As `TunnelPart::from` keeps the frame `Parts` would give.
        let part = match (first.kind, first.usage) {
            (TunnelFrameKind::Body, _) => TunnelPart::Body(first.body),
            (TunnelFrameKind::Status, None) if first.metadata.is_none() => TunnelPart::Status {
                code: first.status_code,
                headers: first.headers,
            },
            (TunnelFrameKind::Usage, Some(usage))
                if first.metadata.is_none()
                    && first.status_code == 0
                    && first.headers.is_empty() =>
            {
                TunnelPart::Usage(usage)
            }
            (kind, usage) => TunnelPart::Frame(Box::new(ProviderTunnelFrame {
                sequence,
                kind: kind as i32,
                status_code: first.status_code,
                headers: first.headers,
                metadata: first.metadata.unwrap_or_default(),
                body: first.body,
                usage,
                ..ProviderTunnelFrame::default()
            })),
        };
        Some((sequence, part))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        remaining(self.rest.as_ref())
    }
}

/// The parts of one tunnel frame, from [`split`].
#[derive(Debug)]
#[must_use = "the parts are made as they are taken"]
pub struct Parts {
    rest: Option<ProviderTunnelFrame>,
}

impl Iterator for Parts {
    type Item = ProviderTunnelFrame;

    fn next(&mut self) -> Option<ProviderTunnelFrame> {
        let mut rest = self.rest.take()?;
        if part_count(&rest) == 1 {
            return Some(rest);
        }
        let run_id = rest.run_id.clone();
        let first = take_first(&mut rest);
        self.rest = Some(rest);
        Some(ProviderTunnelFrame {
            run_id,
            sequence: first.sequence,
            kind: first.kind as i32,
            status_code: first.status_code,
            headers: first.headers,
            metadata: first.metadata.unwrap_or_default(),
            body: first.body,
            usage: first.usage,
            ..ProviderTunnelFrame::default()
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        remaining(self.rest.as_ref())
    }
}

/// What the first part of a merged frame keeps, cut off it by [`take_first`].
struct FirstPart {
    sequence: u64,
    kind: TunnelFrameKind,
    status_code: u32,
    headers: Vec<Header>,
    /// `None` when the frame has none: an empty map left behind costs its drop (a
    /// walk of its nodes, about 70 instructions), and most parts are dropped.
    metadata: Option<std::collections::BTreeMap<String, String>>,
    body: Bytes,
    usage: Option<Usage>,
}

/// Cuts the first part off `rest`, a merged frame ([`part_count`] more than one, so of a
/// known kind): the one rule of what a merged frame's first part keeps, for [`Parts`] and
/// [`TunnelParts`] alike. `rest` is left as the parts after it: the next kind, numbered
/// one on.
fn take_first(rest: &mut ProviderTunnelFrame) -> FirstPart {
    let kind = TunnelFrameKind::try_from(rest.kind).unwrap_or(TunnelFrameKind::Unspecified);
    // The first part keeps what is its own; the rest goes on as the next kind.
    let mut first = FirstPart {
        sequence: rest.sequence,
        kind,
        status_code: std::mem::take(&mut rest.status_code),
        headers: std::mem::take(&mut rest.headers),
        metadata: (!rest.metadata.is_empty()).then(|| std::mem::take(&mut rest.metadata)),
        body: Bytes::new(),
        usage: None,
    };
    rest.sequence = rest.sequence.saturating_add(1);
    let next = match kind {
        TunnelFrameKind::Status if !rest.body.is_empty() => TunnelFrameKind::Body,
        TunnelFrameKind::Status if rest.usage.is_some() => TunnelFrameKind::Usage,
        TunnelFrameKind::Body => {
            first.body = std::mem::take(&mut rest.body);
            if rest.usage.is_some() {
                TunnelFrameKind::Usage
            } else {
                TunnelFrameKind::End
            }
        }
        TunnelFrameKind::Usage => {
            first.usage = rest.usage.take();
            TunnelFrameKind::End
        }
        _ => TunnelFrameKind::End,
    };
    rest.kind = next as i32;
    first
}

/// How many parts are left of `rest` (an iterator's exact size hint).
fn remaining(rest: Option<&ProviderTunnelFrame>) -> (usize, Option<usize>) {
    let n = rest.map_or(0, |f| usize::try_from(part_count(f)).unwrap_or(usize::MAX));
    (n, Some(n))
}

/// The inference route a request came by: which requests a provider may serve (a
/// normalized run serves chat only; every other route is a raw call a tunnel forwards to
/// the same path).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`: served by runs or tunnels.
    Chat,
    /// `POST /v1/completions`: served by tunnels only.
    Completions,
    /// `POST /v1/embeddings`: served by tunnels only.
    Embeddings,
    /// `POST /tokenize` (vLLM's, with chat `messages`): a prompt's exact token count, for
    /// the Edge's own count routes rather than a caller; served only by tunnels whose
    /// provider tokenizes ([`TOKENIZE_OPTION`]).
    Tokenize,
}

/// The adapter option (read by the Edge) saying a run-served provider continues a final
/// assistant message exactly (vLLM's and SGLang's `continue_final_message`, llama.cpp's
/// and Ollama's trailing assistant message, the mock): a streamed answer lost after its
/// first byte may be continued on it. `"true"` or `"false"`; vLLM adapters default to
/// `"true"`, others to `"false"`.
pub const RESUME_OPTION: &str = "resume";

/// The adapter option that says whether a tunnel-served provider answers
/// [`Endpoint::Tokenize`]: `"true"` or `"false"`; vLLM adapters do unless it says `"false"`.
pub const TOKENIZE_OPTION: &str = "tokenize";

impl Endpoint {
    /// The route's path, which is also the path forwarded to OpenAI-compatible providers.
    #[must_use]
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Embeddings => "/v1/embeddings",
            Endpoint::Tokenize => "/tokenize",
        }
    }
}

/// An API dialect some providers serve themselves besides OpenAI's: a request in it is
/// translated for every other provider, and sent to these as the caller wrote it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Dialect {
    /// Anthropic's Messages API, `POST /v1/messages`.
    Messages,
}

impl Dialect {
    /// The path a provider serving the dialect is sent.
    #[must_use]
    pub fn path(self) -> &'static str {
        match self {
            Dialect::Messages => "/v1/messages",
        }
    }

    /// The adapter option (set to `"true"`) that says an adapter serves the dialect
    /// itself: `native_messages`.
    #[must_use]
    pub fn option(self) -> &'static str {
        match self {
            Dialect::Messages => "native_messages",
        }
    }
}

/// A tunnel frame as a response needs it: the parts every answer is made of (a `BODY`'s
/// bytes, a bare `STATUS`, `USAGE` or `END`) are kept without an allocation, as a request's
/// queue holds them; any other frame (an `ERROR`, `HEADERS`, or one carrying more than its
/// kind's own fields, such as metadata) is kept whole, boxed, as it is rare and large.
#[derive(Clone, Debug, PartialEq)]
pub enum TunnelPart {
    /// The bytes of a `BODY` frame.
    Body(Bytes),
    /// A `STATUS` frame with nothing else: the provider's status and response headers.
    Status {
        /// HTTP status code.
        code: u32,
        /// Response headers.
        headers: Vec<Header>,
    },
    /// A `USAGE` frame with nothing else.
    Usage(Usage),
    /// An `END` frame with nothing else.
    End,
    /// Any other frame.
    Frame(Box<ProviderTunnelFrame>),
}

impl From<ProviderTunnelFrame> for TunnelPart {
    fn from(frame: ProviderTunnelFrame) -> Self {
        let kind = TunnelFrameKind::try_from(frame.kind).ok();
        if kind == Some(TunnelFrameKind::Body) {
            return TunnelPart::Body(frame.body);
        }
        // What no bare part carries, beside the fields its kind may.
        let plain = frame.body.is_empty() && frame.error.is_none() && frame.metadata.is_empty();
        match kind {
            Some(TunnelFrameKind::Status) if plain && frame.usage.is_none() && !frame.end => {
                TunnelPart::Status {
                    code: frame.status_code,
                    headers: frame.headers,
                }
            }
            Some(TunnelFrameKind::Usage)
                if plain && !frame.end && frame.status_code == 0 && frame.headers.is_empty() =>
            {
                match frame.usage {
                    Some(usage) => TunnelPart::Usage(usage),
                    None => TunnelPart::Frame(Box::new(frame)),
                }
            }
            Some(TunnelFrameKind::End)
                if plain
                    && frame.usage.is_none()
                    && frame.status_code == 0
                    && frame.headers.is_empty() =>
            {
                TunnelPart::End
            }
            _ => TunnelPart::Frame(Box::new(frame)),
        }
    }
}

impl TunnelPart {
    /// The body bytes it carries.
    #[must_use]
    pub fn body_len(&self) -> usize {
        match self {
            TunnelPart::Body(body) => body.len(),
            TunnelPart::Frame(frame) => frame.body.len(),
            TunnelPart::Status { .. } | TunnelPart::Usage(_) | TunnelPart::End => 0,
        }
    }

    /// The kind of frame it is (`None` for a kept frame of a kind this build does not
    /// know, which validation does not let through).
    #[must_use]
    pub fn kind(&self) -> Option<TunnelFrameKind> {
        match self {
            TunnelPart::Body(_) => Some(TunnelFrameKind::Body),
            TunnelPart::Status { .. } => Some(TunnelFrameKind::Status),
            TunnelPart::Usage(_) => Some(TunnelFrameKind::Usage),
            TunnelPart::End => Some(TunnelFrameKind::End),
            TunnelPart::Frame(frame) => TunnelFrameKind::try_from(frame.kind).ok(),
        }
    }

    /// The frame it stands for (without a run id or sequence number, which the Edge
    /// checked before it kept the part): for a consumer that reads every kind alike.
    #[must_use]
    pub fn into_frame(self) -> ProviderTunnelFrame {
        let bare = |kind: TunnelFrameKind| ProviderTunnelFrame {
            kind: kind as i32,
            ..ProviderTunnelFrame::default()
        };
        match self {
            TunnelPart::Body(body) => ProviderTunnelFrame {
                body,
                ..bare(TunnelFrameKind::Body)
            },
            TunnelPart::Status { code, headers } => ProviderTunnelFrame {
                status_code: code,
                headers,
                ..bare(TunnelFrameKind::Status)
            },
            TunnelPart::Usage(usage) => ProviderTunnelFrame {
                usage: Some(usage),
                ..bare(TunnelFrameKind::Usage)
            },
            TunnelPart::End => ProviderTunnelFrame {
                end: true,
                ..bare(TunnelFrameKind::End)
            },
            TunnelPart::Frame(frame) => *frame,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_allow_listed_headers_cross_a_tunnel() {
        for name in [
            "Content-Type",
            "content-encoding",
            "Retry-After",
            "x-request-id",
        ] {
            assert!(forwards_response_header(name), "{name}");
            assert_eq!(
                forwarded_response_header(name.as_bytes()),
                Some(name.to_ascii_lowercase().as_str()),
                "{name}"
            );
        }
        // A name that is not UTF-8, or that only folds to a listed one outside ASCII,
        // stays behind.
        assert_eq!(forwarded_response_header(b"content-typ\xe9"), None);
        assert_eq!(
            forwarded_response_header("x-request-\u{131}d".as_bytes()),
            None
        );
        for name in [
            "openai-organization",
            "openai-project",
            "openai-processing-ms",
            "x-litellm-model-api-base",
            "x-ratelimit-remaining-tokens",
            "set-cookie",
            "server",
            "content-length",
            "transfer-encoding",
        ] {
            assert!(!forwards_response_header(name), "{name}");
        }
        assert!(forwards_request_header("OpenAI-Beta"));
        assert!(!forwards_request_header("authorization"));
        assert!(!forwards_request_header("cookie"));
    }

    fn frame(kind: TunnelFrameKind, sequence: u64) -> ProviderTunnelFrame {
        ProviderTunnelFrame {
            run_id: "t".into(),
            sequence,
            kind: kind as i32,
            status_code: if kind == TunnelFrameKind::Status {
                200
            } else {
                0
            },
            ..Default::default()
        }
    }

    #[test]
    fn status_first_then_body_then_one_terminal() {
        let mut rx = TunnelReceiver::new();
        use TunnelFrameKind as K;
        assert_eq!(rx.observe(&frame(K::Status, 0)), Ok(TunnelStep::Status));
        assert_eq!(rx.observe(&frame(K::Body, 1)), Ok(TunnelStep::Body));
        assert_eq!(rx.observe(&frame(K::Usage, 2)), Ok(TunnelStep::Usage));
        assert_eq!(rx.observe(&frame(K::Headers, 3)), Ok(TunnelStep::Headers));
        assert_eq!(rx.observe(&frame(K::End, 4)), Ok(TunnelStep::End));
        assert_eq!(
            rx.observe(&frame(K::Body, 5)),
            Err(TunnelViolation::AfterTerminal(K::Body))
        );
    }

    #[test]
    fn order_and_sequence_violations_are_named() {
        use TunnelFrameKind as K;
        let mut rx = TunnelReceiver::new();
        assert_eq!(
            rx.observe(&frame(K::Body, 0)),
            Err(TunnelViolation::StatusNotFirst(K::Body))
        );
        let mut rx = TunnelReceiver::new();
        assert_eq!(
            rx.observe(&frame(K::Status, 1)),
            Err(TunnelViolation::OutOfSequence {
                expected: 0,
                got: 1
            })
        );
        let mut rx = TunnelReceiver::new();
        rx.observe(&frame(K::Status, 0)).expect("status");
        assert_eq!(
            rx.observe(&frame(K::Status, 1)),
            Err(TunnelViolation::DuplicateStatus)
        );
        let mut rx = TunnelReceiver::new();
        let bad = ProviderTunnelFrame {
            status_code: 99,
            ..frame(K::Status, 0)
        };
        assert_eq!(rx.observe(&bad), Err(TunnelViolation::InvalidStatus(99)));
    }

    #[test]
    fn error_may_come_before_status() {
        let mut rx = TunnelReceiver::new();
        assert_eq!(
            rx.observe(&frame(TunnelFrameKind::Error, 0)),
            Ok(TunnelStep::Error)
        );
        assert!(rx.is_ended());
    }

    #[test]
    fn cancelled_tunnel_ends_with_error_and_nothing_after() {
        let mut tx = TunnelEmitter::new("t", 4);
        let mut frames = vec![tx.status(200, Vec::new()).expect("status")];
        frames.extend(tx.body(Bytes::from_static(b"0123456789")));
        frames.push(
            tx.error(ErrorDetail {
                code: "cancelled".into(),
                message: "caller left".into(),
                retryable: false,
            })
            .expect("error"),
        );
        assert_eq!(tx.body(Bytes::from_static(b"more")).count(), 0);
        assert!(tx.end().is_none());
        assert!(tx.error(ErrorDetail::default()).is_none());
        let mut rx = TunnelReceiver::new();
        for f in &frames {
            rx.observe(f).expect("emitter output is valid");
        }
        assert!(rx.is_ended());
        let bodies: Vec<_> = frames
            .iter()
            .filter(|f| f.kind == TunnelFrameKind::Body as i32)
            .map(|f| f.body.len())
            .collect();
        assert_eq!(bodies, vec![4, 4, 2]);
    }

    #[test]
    fn emitter_refuses_body_before_status() {
        let mut tx = TunnelEmitter::new("t", 8);
        assert_eq!(tx.body(Bytes::from_static(b"x")).count(), 0);
        assert!(tx.end().is_none());
        assert_eq!(
            tx.status(1000, Vec::new()).map(|f| f.status_code),
            Some(502)
        );
    }

    /// The parts every answer is made of are kept without a box, and every part stands
    /// for the frame it came from (its run id and sequence aside, checked before).
    #[test]
    fn a_tunnel_part_is_the_frame_it_keeps() {
        let usage = Some(Usage {
            prompt_tokens: 3,
            completion_tokens: 4,
            total_tokens: 7,
        });
        let header = vec![Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"application/json"),
        }];
        let of = |kind: TunnelFrameKind| ProviderTunnelFrame {
            kind: kind as i32,
            ..ProviderTunnelFrame::default()
        };
        let slim = [
            ProviderTunnelFrame {
                body: Bytes::from_static(b"{}"),
                ..of(TunnelFrameKind::Body)
            },
            ProviderTunnelFrame {
                status_code: 200,
                headers: header.clone(),
                ..of(TunnelFrameKind::Status)
            },
            ProviderTunnelFrame {
                usage,
                ..of(TunnelFrameKind::Usage)
            },
            ProviderTunnelFrame {
                end: true,
                ..of(TunnelFrameKind::End)
            },
        ];
        for frame in slim {
            let part = TunnelPart::from(frame.clone());
            assert!(!matches!(part, TunnelPart::Frame(_)), "{part:?}");
            assert_eq!(part.kind(), TunnelFrameKind::try_from(frame.kind).ok());
            assert_eq!(part.body_len(), frame.body.len());
            assert_eq!(part.into_frame(), frame);
        }
        let mut metadata = std::collections::BTreeMap::new();
        metadata.insert("k".to_owned(), "v".to_owned());
        let whole = [
            ProviderTunnelFrame {
                error: Some(ErrorDetail::default()),
                ..of(TunnelFrameKind::Error)
            },
            ProviderTunnelFrame {
                headers: header.clone(),
                ..of(TunnelFrameKind::Headers)
            },
            ProviderTunnelFrame {
                status_code: 200,
                metadata: metadata.clone(),
                ..of(TunnelFrameKind::Status)
            },
            ProviderTunnelFrame {
                usage,
                metadata,
                ..of(TunnelFrameKind::Usage)
            },
            ProviderTunnelFrame {
                status_code: 200,
                body: Bytes::from_static(b"{}"),
                usage,
                end: true,
                ..of(TunnelFrameKind::Status)
            },
            of(TunnelFrameKind::Usage),
            ProviderTunnelFrame {
                headers: header,
                end: true,
                ..of(TunnelFrameKind::End)
            },
        ];
        for frame in whole {
            let part = TunnelPart::from(frame.clone());
            assert!(matches!(part, TunnelPart::Frame(_)), "{part:?}");
            assert_eq!(part.kind(), TunnelFrameKind::try_from(frame.kind).ok());
            assert_eq!(part.body_len(), frame.body.len());
            assert_eq!(part.into_frame(), frame);
        }
    }
}
