//! A streamed answer continued after its run was lost (docs in README, "A stream that
//! survives its node"): what a request keeps of the answer it delivered, so that another
//! provider can continue it from there, and how the continuing run's events are joined
//! to what the caller already has.

use bytes::{Bytes, BytesMut};

use crate::edge::{DispatchShape, RequestEvent};
use crate::tunnel::TunnelPart;
use crate::wire::{RunEvent, RunEventType, TunnelFrameKind};

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
    /// How the answer reaches its caller, from the first run that answered: a
    /// continuation is only placed on a provider of the same shape.
    pub(in crate::edge) shape: Option<DispatchShape>,
    /// A tunnel's answer, read as a chat completion stream.
    sse: Sse,
}

/// A tunnel's chat completion stream as its caller has it (docs in README, "A stream
/// that survives its node"): events pass whole (an event cut by the break would corrupt
/// the stream the continuation joins), each read for its text; a continuation's events
/// are rewritten to join it.
#[derive(Debug, Default)]
struct Sse {
    /// Bytes of an event not whole yet, held back.
    pending: BytesMut,
    /// The caller's stream's `id`, `created` and `model` (JSON text).
    id: Option<String>,
    created: Option<String>,
    model: Option<String>,
    /// The caller had a chunk naming the role.
    role: bool,
}

/// Longest event held back whole: a longer one passes as it comes and the answer is no
/// longer continued.
const MAX_EVENT: usize = 64 << 10;

/// Where the first whole event of `bytes` ends (after its blank line), from `from` on.
fn event_end(bytes: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while let Some(at) = bytes.get(i..)?.iter().position(|&b| b == b'\n') {
        let nl = i + at;
        match bytes.get(nl + 1..) {
            Some([b'\n', ..]) => return Some(nl + 2),
            Some([b'\r', b'\n', ..]) => return Some(nl + 3),
            _ => i = nl + 1,
        }
    }
    None
}

/// The whole events of `bytes` (each with its blank line).
fn events(bytes: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut start = 0;
    std::iter::from_fn(move || {
        let end = event_end(bytes, start)?;
        let event = &bytes[start..end];
        start = end;
        Some(event)
    })
}

/// The `data:` payloads of one event.
fn payloads(event: &[u8]) -> impl Iterator<Item = &[u8]> {
    event.split(|&b| b == b'\n').filter_map(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let data = line.strip_prefix(b"data:")?;
        Some(data.strip_prefix(b" ").unwrap_or(data))
    })
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
            shape: None,
            sse: Sse::default(),
        }
    }

    /// A run of `shape` answers (`native`: in the caller's own dialect, not chat): the
    /// first sets how the answer reaches its caller; a tunnel's continuation starts a
    /// stream of its own.
    pub(in crate::edge) fn begin(&mut self, shape: DispatchShape, native: bool) {
        if shape == DispatchShape::Tunnel && (native || self.shape == Some(DispatchShape::Run)) {
            self.spoil();
        }
        self.shape.get_or_insert(shape);
        self.sse.pending.clear();
    }

    /// Whether a provider of `shape` that continues answers may continue this one.
    pub(in crate::edge) fn continues_on(&self, shape: DispatchShape) -> bool {
        self.shape.is_none_or(|s| s == shape)
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

    /// `event` goes to the caller: what it delivers is kept, and it is adjusted for a
    /// continuation ([`Self::deliver_run`], [`Self::deliver_tunnel`]); `out` gets what
    /// the caller is sent.
    pub(in crate::edge) fn deliver(
        &mut self,
        event: RequestEvent,
        out: &mut impl FnMut(RequestEvent),
    ) {
        match event {
            RequestEvent::Run(event) => {
                if let Some(event) = self.deliver_run(*event) {
                    out(RequestEvent::Run(Box::new(event)));
                }
            }
            RequestEvent::Tunnel(part) => self.deliver_tunnel(part, out),
            event => out(event),
        }
    }

    /// A run's `event` goes to the caller: kept, and adjusted for a continuation: the start of a
    /// continuing run is dropped (the caller had one), its usage counts the earlier
    /// runs' output too. `None` for an event the caller must not get.
    fn deliver_run(&mut self, mut event: RunEvent) -> Option<RunEvent> {
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

    /// A tunnel's `part` goes to the caller. Its body passes in whole events, each read
    /// for the text it delivers; a continuation's events are joined to the stream the
    /// caller has (its head dropped, the caller's id, creation time and model, no second
    /// role, usage counting the earlier runs' output).
    fn deliver_tunnel(&mut self, part: TunnelPart, out: &mut impl FnMut(RequestEvent)) {
        let mut part = match part {
            TunnelPart::Body(body) => {
                if let Some(whole) = self.whole_events(body) {
                    out(RequestEvent::Tunnel(TunnelPart::Body(whole)));
                }
                return;
            }
            other => other,
        };
        let kind = part.kind();
        if self.continued {
            match kind {
                // The caller has its head.
                Some(TunnelFrameKind::Status) => return,
                Some(TunnelFrameKind::Usage) if self.earlier > 0 => {
                    let usage = match &mut part {
                        TunnelPart::Usage(usage) => Some(usage),
                        TunnelPart::Frame(frame) => frame.usage.as_mut(),
                        _ => None,
                    };
                    if let Some(usage) = usage {
                        usage.completion_tokens += self.earlier;
                        usage.total_tokens += self.earlier;
                    }
                    out(RequestEvent::Tunnel(part));
                    return;
                }
                _ => {}
            }
        }
        if matches!(kind, Some(TunnelFrameKind::End | TunnelFrameKind::Error))
            && !self.sse.pending.is_empty()
        {
            // The rest of the body, whole or not, before its end.
            let rest = self.sse.pending.split().freeze();
            out(RequestEvent::Tunnel(TunnelPart::Body(rest)));
        }
        out(RequestEvent::Tunnel(part));
    }

    /// `body` added to what is held back: the whole events now complete, as the caller
    /// gets them (`None` when none is).
    fn whole_events(&mut self, body: Bytes) -> Option<Bytes> {
        if self.spoilt && !self.continued {
            // Nothing more is read: the bytes pass as they come.
            if self.sse.pending.is_empty() {
                return Some(body);
            }
            self.sse.pending.extend_from_slice(&body);
            return Some(self.sse.pending.split().freeze());
        }
        // What is held has no whole event: the first can only end in the new bytes (or
        // at the seam), so the scan starts there and the held bytes are read once.
        let mut scan = self.sse.pending.len().saturating_sub(2);
        self.sse.pending.extend_from_slice(&body);
        let mut end = 0;
        while let Some(next) = event_end(&self.sse.pending, scan) {
            end = next;
            scan = next;
        }
        if end == 0 {
            if self.sse.pending.len() > MAX_EVENT {
                self.spoil();
                return Some(self.sse.pending.split().freeze());
            }
            return None;
        }
        let whole = self.sse.pending.split_to(end).freeze();
        if !self.continued {
            for event in events(&whole) {
                self.read_event(event);
            }
            return Some(whole);
        }
        let mut joined = Vec::with_capacity(whole.len() + 64);
        for event in events(&whole) {
            self.join_event(event, &mut joined);
        }
        (!joined.is_empty()).then(|| Bytes::from(joined))
    }

    /// What one event of the caller's stream delivers, kept.
    fn read_event(&mut self, event: &[u8]) {
        for payload in payloads(event) {
            let Some(chunk) = iop_json::read_chunk(payload) else {
                continue;
            };
            let sse = &mut self.sse;
            for (kept, read) in [
                (&mut sse.id, chunk.id),
                (&mut sse.created, chunk.created),
                (&mut sse.model, chunk.model),
            ] {
                if kept.is_none() {
                    *kept = read;
                }
            }
            sse.role |= chunk.role;
            if chunk.other {
                self.spoil();
            }
            if let Some(content) = chunk.content {
                self.produced += 1;
                if self.text.len() + content.len() > MAX_RESUME_TEXT {
                    self.spoil();
                } else if !self.spoilt {
                    self.text.push_str(&content);
                }
            }
        }
    }

    /// One event of a continuation, joined to the caller's stream, onto `out` (nothing
    /// when all it said was the role again).
    fn join_event(&mut self, event: &[u8], out: &mut Vec<u8>) {
        let role_sent = self.sse.role;
        self.read_event(event);
        let join = iop_json::Joined {
            id: self.sse.id.as_deref(),
            created: self.sse.created.as_deref(),
            model: self.sse.model.as_deref(),
            role_sent,
            earlier: self.earlier,
        };
        let start = out.len();
        for line in event.split(|&b| b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.is_empty() {
                continue;
            }
            let payload = line
                .strip_prefix(b"data:")
                .map(|data| data.strip_prefix(b" ").unwrap_or(data));
            match payload {
                Some(payload) if payload != b"[DONE]" => {
                    let Some(joined) = iop_json::rejoin_chunk(payload, &join) else {
                        out.truncate(start);
                        return;
                    };
                    out.extend_from_slice(b"data: ");
                    out.extend_from_slice(&joined);
                }
                _ => out.extend_from_slice(line),
            }
            out.push(b'\n');
        }
        if out.len() > start {
            out.push(b'\n');
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{ProviderTunnelFrame, Usage};

    const ASK: &[u8] =
        br#"{"model":"chat","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

    fn body(bytes: &str) -> RequestEvent {
        RequestEvent::Tunnel(TunnelPart::Body(Bytes::copy_from_slice(bytes.as_bytes())))
    }

    fn frame(kind: TunnelFrameKind) -> RequestEvent {
        RequestEvent::Tunnel(TunnelPart::from(ProviderTunnelFrame {
            kind: kind as i32,
            status_code: if kind == TunnelFrameKind::Status {
                200
            } else {
                0
            },
            usage: (kind == TunnelFrameKind::Usage).then_some(Usage {
                prompt_tokens: 10,
                completion_tokens: 2,
                total_tokens: 12,
            }),
            ..ProviderTunnelFrame::default()
        }))
    }

    /// What the caller is sent for `events`, as text (`<kind>` for a frame).
    fn through(resume: &mut Resume, events: Vec<RequestEvent>) -> String {
        let mut sent = String::new();
        for event in events {
            resume.deliver(event, &mut |e| match e {
                RequestEvent::Tunnel(TunnelPart::Body(b)) => {
                    sent.push_str(std::str::from_utf8(&b).expect("utf-8"));
                }
                RequestEvent::Tunnel(part) => {
                    let f = part.into_frame();
                    let usage = f.usage.map(|u| format!(" {}", u.completion_tokens));
                    sent.push_str(&format!("<{}{}>", f.kind, usage.unwrap_or_default()));
                }
                _ => sent.push_str("<other>"),
            });
        }
        sent
    }

    #[test]
    fn a_tunnels_stream_passes_in_whole_events_and_a_continuation_joins_it() {
        let mut resume = Resume::new(1);
        resume.begin(DispatchShape::Tunnel, false);
        let first = r#"data: {"id":"c1","created":7,"model":"m1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
        let hel = r#"data: {"id":"c1","created":7,"model":"m1","choices":[{"index":0,"delta":{"content":"Hel"}}]}"#;
        // An event cut across frames passes once whole; one cut by the break never does.
        let sent = through(
            &mut resume,
            vec![
                frame(TunnelFrameKind::Status),
                body(&format!("{first}\n\n{}", &hel[..20])),
                body(&format!(
                    "{}\r\n\r\ndata: {{\"id\":\"c1\",\"choi",
                    &hel[20..]
                )),
            ],
        );
        assert_eq!(sent, format!("<1>{first}\n\n{hel}\r\n\r\n"));
        assert_eq!(resume.delivered(), 3);
        let body_then = resume.continue_from(ASK).expect("continued");
        let prefill: serde_json::Value = serde_json::from_slice(&body_then).expect("json");
        assert_eq!(
            prefill["messages"][1],
            serde_json::json!({"role": "assistant", "content": "Hel"})
        );
        // The continuation: its head and role go, its id, created and model become the
        // caller's, its usage counts the lost run's output.
        resume.begin(DispatchShape::Tunnel, false);
        let sent = through(
            &mut resume,
            vec![
                frame(TunnelFrameKind::Status),
                body(
                    r#"data: {"id":"c9","created":9,"model":"m2","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
                ),
                body(
                    "\n\ndata: {\"id\":\"c9\",\"created\":9,\"model\":\"m2\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"}}]}\n\n",
                ),
                body(
                    "data: {\"id\":\"c9\",\"choices\":[],\"usage\":{\"completion_tokens\":1,\"total_tokens\":5}}\n\ndata: [DONE]\n\n",
                ),
                frame(TunnelFrameKind::Usage),
                frame(TunnelFrameKind::End),
            ],
        );
        assert_eq!(
            sent,
            "data: {\"id\":\"c1\",\"created\":7,\"model\":\"m1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"}}]}\n\n\
             data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"completion_tokens\":2,\"total_tokens\":6}}\n\ndata: [DONE]\n\n<4 3><5>"
        );
        assert!(!resume.may_continue(), "the limit is reached");
    }

    #[test]
    fn a_tool_call_a_native_dialect_or_a_giant_event_is_never_continued() {
        let tool =
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0}]}}]}\n\n";
        let mut resume = Resume::new(1);
        resume.begin(DispatchShape::Tunnel, false);
        assert_eq!(through(&mut resume, vec![body(tool)]), tool);
        assert!(!resume.could_continue(ASK));

        let mut native = Resume::new(1);
        native.begin(DispatchShape::Tunnel, true);
        assert!(!native.could_continue(ASK));

        let mut giant = Resume::new(1);
        giant.begin(DispatchShape::Tunnel, false);
        let huge = format!("data: {}", "x".repeat(MAX_EVENT));
        assert_eq!(
            through(&mut giant, vec![body(&huge)]),
            huge,
            "passed on, not held"
        );
        assert!(!giant.could_continue(ASK));
        // Once spoilt, bytes pass as they come.
        assert_eq!(through(&mut giant, vec![body("data: {")]), "data: {");
    }
}
