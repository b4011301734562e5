//! [`Responder`]: one request's events in, the bytes of its answer in a translated
//! dialect out.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use super::chat::{InStreamError, Reader, SseLines};
use super::{Compose, MessageUsage, ResponseOptions, StopReason};
use crate::openai::{ApiError, ErrorType, Out, parse_text_tool_calls};
use iop_proto_core::edge::{DispatchShape, Outcome, RequestError, RequestEvent};
use iop_proto_core::tunnel::TunnelPart;
use iop_proto_core::wire::{
    FINISH_REASON_KEY, Header, ProviderTunnelFrame, RunEvent, RunEventType, STOP_SEQUENCE_KEY,
    TunnelFrameKind, Usage,
};

/// How long a stream may go without a byte before a `ping` event is written.
pub const PING_AFTER: Duration = Duration::from_secs(15);

/// The longest answer body a translated tunnel holds while it is read whole (a provider's
/// JSON completion, or its error).
const MAX_HELD: usize = 16 << 20;

/// Metadata keys a node sets on a run's `COMPLETE` (see the OpenAI responder).
const NATIVE_TOOL_CALLS: &str = "openai_tool_calls";
const TEXT_TOOL_FALLBACK: &str = "openai_text_tool_fallback";
#[derive(Debug)]
enum Phase<C> {
    /// Queued: nothing dispatched yet.
    Waiting,
    /// A normalized run: its text held while it may be a tool call written as text.
    Run { builder: C, held: Option<String> },
    /// A translated tunnel before the provider's status.
    TunnelHead,
    /// A translated tunnel whose provider answered 2xx with SSE chunks.
    Chunks {
        builder: C,
        reader: Reader,
        lines: SseLines,
    },
    /// A translated tunnel whose answer (a JSON completion, or an error) is read whole.
    Held {
        status: u16,
        body: BytesMut,
        retry_after: Option<Header>,
    },
    /// A native tunnel before the provider's status.
    NativeHead,
    /// A native tunnel passing the provider's body through.
    Native { sse: bool, at_boundary: bool },
    /// Everything is out.
    Done,
}

/// Turns the events of one request into its answer in the dialect `C` writes, with the
/// same interface as [`crate::openai::Responder`]: feed it the request's events and the
/// shell's timers, write every [`Out`] from [`poll_output`](Self::poll_output) in order
/// until [`is_done`](Self::is_done).
#[derive(Debug)]
pub struct Responder<C> {
    options: ResponseOptions,
    phase: Phase<C>,
    out: VecDeque<Out>,
    status: Option<u16>,
    settled: bool,
    usage: Option<Usage>,
    /// Time since the last byte, as the shell's idle ticks add it up.
    quiet: Duration,
    /// The dialect's writer once the answer ended.
    ended: Option<C>,
}

impl<C: Compose> Responder<C> {
    /// A responder for a request that is queued.
    #[must_use]
    pub fn new(options: ResponseOptions) -> Self {
        Responder {
            options,
            phase: Phase::Waiting,
            out: VecDeque::new(),
            status: None,
            settled: false,
            usage: None,
            quiet: Duration::ZERO,
            ended: None,
        }
    }

    /// The token usage the provider reported (for logs, metrics and a key's usage).
    #[must_use]
    pub fn usage(&self) -> Option<&Usage> {
        self.usage.as_ref()
    }

    /// The next piece of the response to write.
    pub fn poll_output(&mut self) -> Option<Out> {
        self.out.pop_front()
    }

    /// Whether the response is complete once what `poll_output` holds is written.
    #[must_use]
    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    /// Whether the Edge machine still has the request open when the response is done:
    /// the shell must cancel it.
    #[must_use]
    pub fn needs_cancel(&self) -> bool {
        !self.settled
    }

    /// The status to record: the one answered, 599 when a stream failed after its head.
    #[must_use]
    pub fn status(&self) -> Option<u16> {
        self.status
    }

    /// One of the request's events, as the Edge machine hands it out.
    pub fn handle_event(&mut self, event: RequestEvent) {
        match event {
            RequestEvent::Dispatched { shape, native, .. } => {
                self.handle_dispatched(shape, native);
            }
            RequestEvent::Run(event) => self.handle_run_event(*event),
            RequestEvent::Tunnel(part) => self.handle_tunnel_part(part),
            RequestEvent::Tunnels(parts) => {
                for part in parts {
                    self.handle_tunnel_part(part);
                }
            }
            RequestEvent::Ended(outcome) => self.handle_end(&outcome),
        }
    }

    /// The request was dispatched with `shape`; `native`: to a provider that serves the
    /// dialect itself, whose answer passes through.
    pub fn handle_dispatched(&mut self, shape: DispatchShape, native: bool) {
        if !matches!(self.phase, Phase::Waiting) {
            return;
        }
        self.phase = match (shape, native) {
            (DispatchShape::Tunnel, true) => Phase::NativeHead,
            (DispatchShape::Tunnel, false) => Phase::TunnelHead,
            (DispatchShape::Run, _) => {
                let mut builder = self.builder();
                if self.options.stream {
                    self.stream_head();
                    builder.start();
                }
                let held = self.options.wants_tools.then(String::new);
                let mut phase = Phase::Run { builder, held };
                self.drain(&mut phase);
                phase
            }
        };
    }

    fn builder(&self) -> C {
        C::new(&self.options)
    }

    /// A run event, in sequence order.
    pub fn handle_run_event(&mut self, event: RunEvent) {
        if event.usage.is_some() {
            self.usage.clone_from(&event.usage);
        }
        let Phase::Run { builder, held } = &mut self.phase else {
            return;
        };
        match RunEventType::try_from(event.r#type).ok() {
            Some(RunEventType::Delta) if !event.delta.is_empty() => match held {
                Some(text) => {
                    text.push_str(&event.delta);
                    // A tool call written as text is JSON from its first byte (or a code
                    // fence): anything else is text, and is held no longer.
                    let start = text.trim_start();
                    if !start.is_empty() && !start.starts_with(['{', '`']) {
                        builder.text(text);
                        *held = None;
                    }
                }
                None => builder.text(&event.delta),
            },
            Some(RunEventType::Complete) => {
                self.settled = true;
                let text = held.take().unwrap_or_default();
                let message = run_complete(
                    builder,
                    &text,
                    &event.metadata,
                    event.usage.as_ref(),
                    &self.options,
                );
                self.finish(message);
                return;
            }
            Some(RunEventType::Error) => {
                self.settled = true;
                let detail = event.error.unwrap_or_default();
                self.fail(&ApiError::provider(&detail));
                return;
            }
            Some(RunEventType::Cancelled) => self.settled = true,
            _ => {}
        }
        self.drain_phase();
    }

    /// A tunnel frame as the Edge machine kept it.
    pub fn handle_tunnel_part(&mut self, part: TunnelPart) {
        // The bare parts every answer is made of are read as they are, not rebuilt into
        // frames first.
        match part {
            TunnelPart::Body(body) => self.tunnel_body(&body),
            TunnelPart::Status { code, headers } => self.tunnel_status(code, &headers),
            TunnelPart::Usage(usage) => self.usage = Some(usage),
            TunnelPart::End => {
                self.settled = true;
                self.tunnel_end();
            }
            TunnelPart::Frame(frame) => self.handle_tunnel_frame(*frame),
        }
    }

    /// A tunnel frame, in sequence order.
    pub fn handle_tunnel_frame(&mut self, frame: ProviderTunnelFrame) {
        let kind = TunnelFrameKind::try_from(frame.kind).ok();
        if kind == Some(TunnelFrameKind::Usage) && frame.usage.is_some() {
            self.usage.clone_from(&frame.usage);
        }
        match kind {
            Some(TunnelFrameKind::Status) => self.tunnel_status(frame.status_code, &frame.headers),
            Some(TunnelFrameKind::Body) => self.tunnel_body(&frame.body),
            Some(TunnelFrameKind::Error) => {
                self.settled = true;
                let detail = frame.error.unwrap_or_default();
                self.fail(&ApiError::provider(&detail));
            }
            Some(TunnelFrameKind::End) => {
                self.settled = true;
                self.tunnel_end();
            }
            _ => {}
        }
    }

    fn tunnel_status(&mut self, code: u32, headers: &[Header]) {
        let status = u16::try_from(code)
            .ok()
            .filter(|s| (100..=999).contains(s))
            .unwrap_or(502);
        let sse = headers.iter().any(|h| {
            h.name.eq_ignore_ascii_case("content-type") && h.value.starts_with(b"text/event-stream")
        });
        match self.phase {
            Phase::NativeHead => {
                let headers = headers
                    .iter()
                    .filter(|h| iop_proto_core::tunnel::forwards_response_header(&h.name))
                    .cloned()
                    .collect();
                self.head(status, headers);
                self.phase = Phase::Native {
                    sse,
                    at_boundary: true,
                };
            }
            Phase::TunnelHead if (200..300).contains(&status) && sse => {
                let mut builder = self.builder();
                if self.options.stream {
                    self.stream_head();
                    builder.start();
                }
                let mut phase = Phase::Chunks {
                    builder,
                    reader: Reader::default(),
                    lines: SseLines::default(),
                };
                self.drain(&mut phase);
                self.phase = phase;
            }
            Phase::TunnelHead => {
                let retry_after = headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("retry-after"))
                    .cloned();
                self.phase = Phase::Held {
                    status,
                    body: BytesMut::new(),
                    retry_after,
                };
            }
            _ => {}
        }
    }

    fn tunnel_body(&mut self, body: &Bytes) {
        if body.is_empty() {
            return;
        }
        match &mut self.phase {
            Phase::Native { at_boundary, .. } => {
                *at_boundary = body.ends_with(b"\n\n") || body.ends_with(b"\r\n\r\n");
                self.quiet = Duration::ZERO;
                self.out.push_back(Out::Data(body.clone()));
            }
            Phase::Held { body: held, .. } => {
                if held.len() + body.len() > MAX_HELD {
                    self.fail(&ApiError::new(
                        502,
                        ErrorType::Server,
                        format!("the provider's answer exceeds {MAX_HELD} bytes"),
                        Some("provider_answer_too_large"),
                    ));
                    return;
                }
                held.extend_from_slice(body);
            }
            Phase::Chunks {
                builder,
                reader,
                lines,
            } => {
                let run_id = &self.options.run_id;
                let mut failed = None;
                let fits = lines.push(body, |payload| {
                    if failed.is_some() || payload == b"[DONE]" {
                        return;
                    }
                    if let Err(InStreamError(message)) = reader.read(payload, run_id, builder) {
                        failed = Some(message);
                    }
                });
                if let Some(message) = failed {
                    self.fail(&provider_said(&message));
                } else if !fits {
                    self.fail(&ApiError::new(
                        502,
                        ErrorType::Server,
                        "the provider sent an SSE line longer than the Edge reads",
                        Some("provider_protocol"),
                    ));
                } else {
                    self.drain_phase();
                }
            }
            _ => {}
        }
    }

    fn tunnel_end(&mut self) {
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Native { .. } | Phase::Done => {}
            Phase::Chunks {
                mut builder,
                mut reader,
                mut lines,
            } => {
                let run_id = self.options.run_id.clone();
                let mut failed = None;
                lines.end(|payload| {
                    if failed.is_none()
                        && payload != b"[DONE]"
                        && let Err(InStreamError(message)) =
                            reader.read(payload, &run_id, &mut builder)
                    {
                        failed = Some(message);
                    }
                });
                if let Some(message) = failed {
                    self.phase = Phase::Chunks {
                        builder,
                        reader,
                        lines,
                    };
                    self.fail(&provider_said(&message));
                    return;
                }
                let message = reader.finish(&run_id, &self.options.stop_sequences, &mut builder);
                self.phase = Phase::Chunks {
                    builder,
                    reader,
                    lines,
                };
                self.finish(message);
            }
            Phase::Held {
                status,
                body,
                retry_after,
            } => self.held_end(status, &body, retry_after),
            // The tunnel ended without a head.
            other => {
                self.phase = other;
                self.fail(&ApiError::new(
                    502,
                    ErrorType::Server,
                    "the provider's answer ended before its status",
                    Some("provider_protocol"),
                ));
            }
        }
    }

    /// A provider's whole answer: a chat completion re-encoded, or its error mapped.
    fn held_end(&mut self, status: u16, body: &[u8], retry_after: Option<Header>) {
        if !(200..300).contains(&status) {
            let error = C::provider_error(status, body);
            let (status, json) = C::error_response(&error, &self.options.request_id);
            let mut headers = vec![header("content-type", "application/json")];
            headers.extend(retry_after);
            self.head(status, headers);
            self.out.push_back(Out::Data(json));
            self.phase = Phase::Done;
            return;
        }
        let mut builder = self.builder();
        let mut reader = Reader::default();
        if let Err(InStreamError(message)) = reader.read(body, &self.options.run_id, &mut builder) {
            self.fail(&provider_said(&message));
            return;
        }
        if self.options.stream {
            self.stream_head();
            builder.start();
        }
        let message = reader.finish(
            &self.options.run_id,
            &self.options.stop_sequences,
            &mut builder,
        );
        let mut phase = Phase::Chunks {
            builder,
            reader,
            lines: SseLines::default(),
        };
        self.drain(&mut phase);
        self.phase = phase;
        self.finish(message);
    }

    /// The Edge machine ended the request.
    pub fn handle_end(&mut self, outcome: &Outcome) {
        self.settled = true;
        match (&self.phase, outcome) {
            (Phase::Done, _) => {}
            (Phase::Native { .. }, Outcome::Completed) => self.phase = Phase::Done,
            (Phase::Chunks { builder, .. } | Phase::Run { builder, .. }, Outcome::Completed)
                if builder.finished() =>
            {
                self.phase = Phase::Done;
            }
            (_, Outcome::Completed) => self.fail(&ApiError::new(
                502,
                ErrorType::Server,
                "request ended unexpectedly",
                None,
            )),
            // The provider's error already went out.
            (
                Phase::Run { builder, .. } | Phase::Chunks { builder, .. },
                Outcome::Failed(RequestError::Provider(_)),
            ) if builder.finished() => self.phase = Phase::Done,
            (_, outcome) => {
                let error = ApiError::from_outcome(outcome);
                self.fail(&error);
            }
        }
    }

    /// The response deadline passed.
    pub fn handle_timeout(&mut self) {
        if !matches!(self.phase, Phase::Done) {
            self.fail(&ApiError::timeout());
        }
    }

    /// Nothing happened for `interval`: after [`PING_AFTER`] without a byte, a streamed
    /// response gets a `ping` event (between a native provider's events only).
    pub fn handle_idle(&mut self, interval: Duration) {
        self.quiet += interval;
        if self.quiet < PING_AFTER {
            return;
        }
        let ping = match &mut self.phase {
            Phase::Run { builder, .. } | Phase::Chunks { builder, .. }
                if self.options.stream && builder.started() && !builder.finished() =>
            {
                builder.ping();
                builder.take()
            }
            Phase::Native {
                sse: true,
                at_boundary: true,
            } => Some(Bytes::from_static(C::NATIVE_PING)),
            _ => None,
        };
        if let Some(bytes) = ping {
            self.quiet = Duration::ZERO;
            self.out.push_back(Out::Data(bytes));
        }
    }

    fn stream_head(&mut self) {
        self.head(
            200,
            vec![
                header("content-type", "text/event-stream"),
                header("cache-control", "no-cache"),
            ],
        );
    }

    fn head(&mut self, status: u16, headers: Vec<Header>) {
        self.status = Some(status);
        self.out.push_back(Out::Head { status, headers });
    }

    /// The builder's stream bytes, written.
    fn drain_phase(&mut self) {
        let mut phase = std::mem::replace(&mut self.phase, Phase::Done);
        self.drain(&mut phase);
        self.phase = phase;
    }

    fn drain(&mut self, phase: &mut Phase<C>) {
        if let Phase::Run { builder, .. } | Phase::Chunks { builder, .. } = phase
            && let Some(bytes) = builder.take()
        {
            self.quiet = Duration::ZERO;
            self.out.push_back(Out::Data(bytes));
        }
    }

    /// The answer ended: the whole message (`Some`), or the stream's last events.
    fn finish(&mut self, message: Option<serde_json::Value>) {
        match message {
            Some(message) => {
                self.status = Some(200);
                self.out.push_back(Out::Whole {
                    status: 200,
                    body: Bytes::from(message.to_string()),
                });
            }
            None => self.drain_phase(),
        }
        if let Phase::Run { builder, .. } | Phase::Chunks { builder, .. } =
            std::mem::replace(&mut self.phase, Phase::Done)
        {
            self.ended = Some(builder);
        }
    }

    /// The dialect's writer of an answer that ended (well or not).
    #[must_use]
    pub fn composed(&self) -> Option<&C> {
        self.ended.as_ref()
    }

    /// A failure: the error answer before anything went out, an `error` event in a
    /// stream that started, an aborted body for a native answer that is not SSE.
    fn fail(&mut self, error: &ApiError) {
        let phase = std::mem::replace(&mut self.phase, Phase::Done);
        let request_id = &self.options.request_id;
        match phase {
            Phase::Done => {}
            Phase::Run { mut builder, .. } | Phase::Chunks { mut builder, .. }
                if builder.started() =>
            {
                self.status = Some(599);
                builder.fail(error, request_id);
                if let Some(bytes) = builder.take() {
                    self.out.push_back(Out::Data(bytes));
                }
            }
            Phase::Native { sse: true, .. } => {
                self.status = Some(599);
                let mut builder = self.builder();
                builder.fail(error, &self.options.request_id);
                if let Some(bytes) = builder.take() {
                    self.out.push_back(Out::Data(bytes));
                }
            }
            Phase::Native { sse: false, .. } => {
                self.status = Some(599);
                self.out.push_back(Out::Abort(error.message.clone()));
            }
            _ => {
                let (status, body) = C::error_response(error, &self.options.request_id);
                self.status = Some(status);
                self.out.push_back(Out::Whole { status, body });
            }
        }
    }
}

/// A run's `COMPLETE` into the builder: its tool calls (native, or written as text under
/// the node's fallback), the held text, the stop reason its metadata gives.
fn run_complete<C: Compose>(
    builder: &mut C,
    held: &str,
    metadata: &BTreeMap<String, String>,
    usage: Option<&Usage>,
    options: &ResponseOptions,
) -> Option<serde_json::Value> {
    let native = metadata
        .get(NATIVE_TOOL_CALLS)
        .and_then(|calls| serde_json::from_str::<serde_json::Value>(calls).ok())
        .filter(|calls| calls.as_array().is_some_and(|a| !a.is_empty()));
    let fallback = metadata.get(TEXT_TOOL_FALLBACK).map(String::as_str) == Some("true");
    let calls = native.or_else(|| {
        fallback
            .then(|| parse_text_tool_calls(held, &options.run_id))
            .flatten()
    });
    let text_was_call = calls.is_some() && fallback;
    if !text_was_call {
        builder.text(held);
    }
    let list = calls
        .as_ref()
        .and_then(serde_json::Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    for (i, call) in list.iter().enumerate() {
        let id = call
            .get("id")
            .and_then(serde_json::Value::as_str)
            .filter(|id| !id.is_empty())
            .map_or_else(
                || format!("{}_{}_{i}", C::CALL_ID_PREFIX, options.run_id),
                str::to_owned,
            );
        let name = call
            .pointer("/function/name")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("");
        let arguments = match call.pointer("/function/arguments") {
            Some(serde_json::Value::String(text)) => text.clone(),
            Some(other) => other.to_string(),
            None => String::new(),
        };
        builder.tool(&id, name, &arguments);
    }
    let sequence = metadata
        .get(STOP_SEQUENCE_KEY)
        .map(String::as_str)
        .filter(|s| options.stop_sequences.iter().any(|q| q == s));
    let mut reason = if list.is_empty() {
        StopReason::of_finish(metadata.get(FINISH_REASON_KEY).map(String::as_str))
    } else {
        StopReason::ToolUse
    };
    if reason == StopReason::EndTurn && sequence.is_some() {
        reason = StopReason::StopSequence;
    }
    let usage =
        usage.map(|u| MessageUsage::from_openai(u.prompt_tokens, u.completion_tokens, None));
    builder.finish(reason, sequence, usage)
}

/// A provider's in-stream or whole-body error message, as a 502 `api_error`.
fn provider_said(message: &str) -> ApiError {
    ApiError::new(
        502,
        ErrorType::Server,
        format!("provider error: {message}"),
        Some("upstream_error"),
    )
}

fn header(name: &str, value: &'static str) -> Header {
    Header {
        name: name.to_owned(),
        value: Bytes::from_static(value.as_bytes()),
    }
}
