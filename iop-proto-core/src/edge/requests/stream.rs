//! A run's stream as its request sees it: the items a node sends, checked against the
//! run's contract ([`observe`]); what a run's failure was ([`Cause`]) and what an item did
//! ([`Step`]); and the message a run is dispatched with ([`message`]).

use crate::edge::ConnId;
use crate::edge::DispatchShape;
use crate::edge::Outcome;
use crate::edge::RequestError;
use crate::edge::RequestEvent;
use crate::edge::StreamViolation;
use crate::edge::Submit;
use crate::edge::TunnelDispatch;
use crate::edge::pool::ResourceMeta;
use crate::lease::Lease;
use crate::lease::RequestId;
use crate::lease::ResourceId;
use crate::lease::RunId;
use crate::run::RunStep;
use crate::run::RunTracker;
use crate::tunnel::TunnelPart;
use crate::tunnel::TunnelReceiver;
use crate::tunnel::TunnelStep;
use crate::wire::Body;
use crate::wire::ErrorDetail;
use crate::wire::Header;
use crate::wire::RunEvent;
use crate::wire::RunEventType;
use crate::wire::RunRequest;
use crate::wire::TunnelFrameKind;
use bytes::Bytes;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug)]
pub(in crate::edge) enum Stream {
    Run(RunTracker),
    Tunnel(TunnelReceiver),
    /// The stream broke the contract; nothing more it sends is trusted.
    Broken,
}

/// One item of a run's stream: a run event, or a tunnel's part with its sequence number
/// (a merged frame is its parts one by one: `tunnel::split_parts`).
#[derive(Debug)]
pub(in crate::edge) enum StreamItem {
    Run(RunEvent),
    Part(u64, TunnelPart),
}

impl StreamItem {
    /// Whether it ends its stream, whatever else is wrong with it.
    pub(in crate::edge) fn is_terminal(&self) -> bool {
        match self {
            StreamItem::Run(event) => matches!(
                RunEventType::try_from(event.r#type),
                Ok(RunEventType::Complete | RunEventType::Error | RunEventType::Cancelled)
            ),
            StreamItem::Part(_, part) => matches!(
                part.kind(),
                Some(TunnelFrameKind::End | TunnelFrameKind::Error)
            ),
        }
    }

    /// Whether it is a first byte for the caller: a run's content (text or tool calls).
    pub(in crate::edge) fn has_content(&self) -> bool {
        match self {
            StreamItem::Run(event) => {
                !event.delta.is_empty() || event.metadata.contains_key("openai_tool_calls")
            }
            StreamItem::Part(..) => false,
        }
    }

    /// About how much memory it takes once held.
    pub(in crate::edge) fn size(&self) -> usize {
        match self {
            StreamItem::Run(event) => {
                64 + event.delta.len()
                    + event
                        .metadata
                        .iter()
                        .map(|(k, v)| k.len() + v.len())
                        .sum::<usize>()
            }
            StreamItem::Part(_, part) => 64 + part.body_len(),
        }
    }

    pub(in crate::edge) fn into_event(self) -> RequestEvent {
        match self {
            StreamItem::Run(event) => RequestEvent::Run(Box::new(event)),
            StreamItem::Part(_, part) => RequestEvent::Tunnel(part),
        }
    }
}

/// How a run failed before its first byte.
#[derive(Clone, Debug, PartialEq)]
pub(in crate::edge) enum Cause {
    /// The node reported a retryable error (the provider unreachable, a timeout).
    Error(ErrorDetail),
    /// The provider answered this status.
    Status(u32),
    /// The run broke its stream's contract.
    Violation(StreamViolation),
    /// The node refused to start it (its capacity gate was full: another Edge of a
    /// cluster took the slot first; or it is stopping): the provider was never asked, so
    /// its health does not suffer, and the request may be tried on it again.
    Refused(ErrorDetail),
}

/// The code of a node's refusal to start work (`RunEvent` error before any content).
pub(in crate::edge) const REFUSED: &str = "refused";

/// Refusals a request may meet, that its ledger cannot explain, before it fails with the
/// last one. A node reports what its other sessions hold before it refuses, so a refusal
/// for a slot another Edge took leaves the ledger full: it is not counted (under
/// saturation a request may lose many such races while it waits, within its queue wait).
/// A refusal with room left in the ledger is counted: the bound stops a node that
/// refuses everything (a configuration it does not share) from being asked again and
/// again.
pub(in crate::edge) const MAX_REFUSALS: u32 = 8;

impl Cause {
    /// What the caller is told if nothing else can answer.
    pub(in crate::edge) fn outcome(&self) -> Outcome {
        match self {
            Cause::Error(detail) | Cause::Refused(detail) => {
                Outcome::Failed(RequestError::Provider(detail.clone()))
            }
            Cause::Status(status) => Outcome::Failed(RequestError::Provider(ErrorDetail {
                code: format!("upstream_status_{status}"),
                message: format!("the provider answered {status}"),
                retryable: true,
            })),
            Cause::Violation(detail) => Outcome::Failed(RequestError::Violation(detail.clone())),
        }
    }

    /// A stable label for events and metrics.
    pub(in crate::edge) fn label(&self) -> &'static str {
        match self {
            Cause::Error(_) => "error",
            Cause::Refused(_) => "refused",
            Cause::Status(408) => "status_408",
            Cause::Status(429) => "status_429",
            Cause::Status(_) => "status_5xx",
            Cause::Violation(_) => "violation",
        }
    }
}

/// What a stream item did, for the transitions to act on.
pub(in crate::edge) enum Step {
    /// Not for a run of this connection, or of a stream already broken: ignored.
    Ignored,
    /// Passed to the caller, held back, or dropped (a run whose caller left).
    Progress,
    /// The run reached its first byte: [`Requests::commit`] it.
    FirstByte { run: RunId },
    /// The run failed before its first byte: either give it up and retry
    /// ([`Requests::give_up`]), or commit it and let the caller have its answer.
    Failed {
        run: RunId,
        cause: Cause,
        retry_after: Option<Duration>,
    },
    /// The run ended: its lease is free (its request, if it still served one, ended
    /// with it).
    Ended { lease: Lease },
    /// The committed run's provider failed midway (a retryable error in its stream) and
    /// its request may be continued elsewhere: the run is over, its lease free. When no
    /// continuation is made, `event` goes to the caller and the request ends with
    /// `outcome`, as for any other end.
    Broken {
        run: RunId,
        lease: Lease,
        event: RequestEvent,
        outcome: Outcome,
    },
    /// The committed run broke its stream's contract: its request failed. When the item
    /// was its terminal the run is done and its lease free; otherwise, when `cancel`, it
    /// must be cancelled on the node (a run already cancelled waits on).
    Violated {
        run: RunId,
        lease: Lease,
        conn: ConnId,
        terminal: bool,
        cancel: bool,
        detail: StreamViolation,
    },
}

/// A run committed as its request's answer.
pub(in crate::edge) struct Committed {
    /// The run held its terminal: it is over, and so is its request.
    pub(in crate::edge) ended: bool,
    /// Its siblings, given up: cancel them on their nodes.
    pub(in crate::edge) siblings: Vec<(RunId, ConnId)>,
}

/// What a cancel found.
pub(in crate::edge) enum Cancel {
    /// It waited, or had not been dispatched yet: it has left the queue.
    Queued,
    /// Runs served it: cancel them on their nodes.
    Running(Vec<(RunId, ConnId)>),
}

/// A fenced run's part in its request.
pub(in crate::edge) enum Fenced {
    /// It served nothing any more.
    Nothing,
    /// It answered its request, which is lost with it unless continued elsewhere
    /// (the provider it ran on, to try no more).
    Committed(RequestId, ResourceId),
    /// It had not reached its first byte: its request may be tried elsewhere.
    Uncommitted(RequestId),
}

/// Checks `item` against `stream`'s contract: `None` for a stream already broken, else
/// whether the stream goes on, ended (and how) or broke.
pub(super) fn observe(
    stream: &mut Stream,
    item: &StreamItem,
) -> Option<Result<Option<Outcome>, StreamViolation>> {
    let provider_error = |error: &Option<ErrorDetail>| {
        Outcome::Failed(RequestError::Provider(error.clone().unwrap_or_default()))
    };
    Some(match (stream, item) {
        (Stream::Broken, _) => return None,
        (Stream::Run(tracker), StreamItem::Run(event)) => match tracker.observe(event) {
            Ok(RunStep::Terminal(RunEventType::Complete)) => Ok(Some(Outcome::Completed)),
            Ok(RunStep::Terminal(RunEventType::Cancelled)) => Ok(Some(Outcome::Cancelled)),
            Ok(RunStep::Terminal(_)) => Ok(Some(provider_error(&event.error))),
            Ok(_) => Ok(None),
            Err(violation) => Err(StreamViolation::Run(violation)),
        },
        (Stream::Tunnel(receiver), StreamItem::Part(sequence, part)) => {
            match receiver.observe_part(*sequence, part) {
                Ok(TunnelStep::End) => Ok(Some(Outcome::Completed)),
                Ok(TunnelStep::Error) => Ok(Some(match part {
                    TunnelPart::Frame(frame) => provider_error(&frame.error),
                    _ => provider_error(&None),
                })),
                Ok(_) => Ok(None),
                Err(violation) => Err(StreamViolation::Tunnel(violation)),
            }
        }
        (Stream::Run(_), StreamItem::Part(..)) => Err(StreamViolation::FrameForRun),
        (Stream::Tunnel(_), StreamItem::Run(_)) => Err(StreamViolation::EventForTunnel),
    })
}

/// A `Retry-After` of whole seconds among `headers` (an HTTP date is not read: the
/// machine has no calendar).
pub(super) fn retry_after(headers: &[Header]) -> Option<Duration> {
    let header = headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("retry-after"))?;
    let seconds: u64 = std::str::from_utf8(&header.value)
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(seconds))
}

/// What a run is dispatched with: a run request's frame, or a tunnel request.
pub(super) enum Dispatched {
    /// A `RunRequest`, built.
    Run(Body),
    /// A tunnel request, from the request's own handles.
    Tunnel(TunnelDispatch),
}

/// The message run `run` of `call` is dispatched with on the provider `meta` describes,
/// serving `target`, and the stream its answer is checked with; `native`: a tunnel of
/// the caller's own call ([`Submit::native`]) rather than its translation.
#[allow(clippy::too_many_arguments)]
pub(super) fn message(
    call: &Submit,
    continuation: Option<Bytes>,
    model: &Arc<str>,
    run: RunId,
    meta: &ResourceMeta,
    target: &Arc<str>,
    long: bool,
    native: bool,
) -> (Dispatched, Stream) {
    match meta.shape {
        DispatchShape::Run => {
            let mut metadata = BTreeMap::new();
            if !call.request_id.is_empty() {
                metadata.insert(
                    crate::wire::REQUEST_ID_KEY.to_owned(),
                    String::from(&*call.request_id),
                );
            }
            metadata.insert("model".to_owned(), String::from(&**model));
            // A run's provider call is the Node's to make: the trace context it passes on
            // travels in the metadata (a tunnel carries it among its headers).
            for header in call.headers.iter() {
                if crate::wire::TRACE_KEYS.contains(&header.name)
                    && let Ok(value) = std::str::from_utf8(header.value)
                {
                    metadata.insert(header.name.to_owned(), value.to_owned());
                }
            }
            (
                Dispatched::Run(Body::RunRequest(RunRequest {
                    run_id: run.wire(),
                    adapter: String::from(&*meta.provider_id),
                    target: String::from(&**target),
                    input: continuation.unwrap_or_else(|| call.body.clone()),
                    metadata,
                    long_context: long,
                    ..RunRequest::default()
                })),
                Stream::Run(RunTracker::new()),
            )
        }
        DispatchShape::Tunnel => (
            Dispatched::Tunnel(TunnelDispatch {
                run,
                adapter: meta.provider_id.clone(),
                target: target.clone(),
                path: match &call.native {
                    Some(own) if native => own.dialect.path(),
                    _ => call.endpoint.path(),
                },
                headers: call.headers.clone(),
                body: match (&call.native, continuation) {
                    // A continuation is always of the chat call (`native` is false).
                    (_, Some(body)) => iop_json::for_target(body, target),
                    (Some(own), None) if native => iop_json::for_target(own.body.clone(), target),
                    _ => iop_json::for_target(call.body.clone(), target),
                },
                stream: call.stream,
                timeout_sec: u32::try_from(call.timeout.as_secs()).unwrap_or(u32::MAX),
                request_id: call.request_id.clone(),
                long_context: long,
            }),
            Stream::Tunnel(TunnelReceiver::new()),
        ),
    }
}
