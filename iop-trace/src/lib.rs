//! Traces across the fabric: the W3C Trace Context a request carries
//! ([`TraceContext`], the `traceparent` header), and the spans the Edge records for it
//! ([`Span`]) in OTLP's shape, encoded for an OTLP/HTTP collector as protobuf
//! ([`encode_protobuf`]) or JSON ([`encode_json`]).
//!
//! The rules (W3C Trace Context, level 1):
//! - A `traceparent` is `version-trace_id-parent_id-flags` in lower-case hex. Version
//!   `00` is exactly 55 characters; a later version may append fields after a `-`, and
//!   its first four are read the same way. Version `ff`, an all-zero trace or parent id,
//!   upper-case hex or any other shape is invalid, and an invalid header is ignored (a
//!   new trace starts) rather than passed on.
//! - A hop that records spans passes the trace on with its own span as the parent
//!   ([`TraceContext::child`]); one that records none passes the caller's header as it
//!   came. `tracestate` travels unchanged either way.
//! - The `sampled` flag is the caller's decision: spans of a trace it did not sample are
//!   not exported.
//!
//! Identifiers come from the caller of this module (the shell), which has a source of
//! randomness; nothing here makes one up.

use std::fmt::Write as _;

/// The request header that carries the trace context.
pub const TRACEPARENT: &str = "traceparent";
/// The request header that carries vendors' trace state, passed on unchanged.
pub const TRACESTATE: &str = "tracestate";
/// The longest `tracestate` passed on (the specification's limit is 512 characters for
/// the members a vendor must keep; longer ones may be dropped whole).
pub const MAX_TRACESTATE: usize = 512;

/// A trace context: the trace, the span that is the parent of the next hop's work, and
/// the flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceContext {
    /// The trace's id (never all zeros).
    pub trace_id: [u8; 16],
    /// The parent span's id (never all zeros).
    pub parent_id: [u8; 8],
    /// Trace flags; bit 0 is `sampled`.
    pub flags: u8,
}

impl TraceContext {
    /// Reads a `traceparent` header value; `None` when it is not a valid one.
    #[must_use]
    pub fn parse(value: &[u8]) -> Option<Self> {
        if value.len() < 55 {
            return None;
        }
        let version = hex_byte(&value[0..2])?;
        if version == 0xff || value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
            return None;
        }
        // Version 00 is exactly this long; later versions may only add fields.
        if (version == 0 && value.len() != 55) || (value.len() > 55 && value[55] != b'-') {
            return None;
        }
        let mut trace_id = [0u8; 16];
        for (i, byte) in trace_id.iter_mut().enumerate() {
            *byte = hex_byte(&value[3 + 2 * i..5 + 2 * i])?;
        }
        let mut parent_id = [0u8; 8];
        for (i, byte) in parent_id.iter_mut().enumerate() {
            *byte = hex_byte(&value[36 + 2 * i..38 + 2 * i])?;
        }
        let flags = hex_byte(&value[53..55])?;
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return None;
        }
        Some(TraceContext {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// A new trace started by the hop itself, with `span` as the parent of the next hop,
    /// `sampled` or not. `None` for an all-zero id.
    #[must_use]
    pub fn root(trace_id: [u8; 16], span: [u8; 8], sampled: bool) -> Option<Self> {
        (trace_id != [0; 16] && span != [0; 8]).then_some(TraceContext {
            trace_id,
            parent_id: span,
            flags: u8::from(sampled),
        })
    }

    /// The same trace with `span` (a span of this hop) as the next hop's parent.
    #[must_use]
    pub fn child(&self, span: [u8; 8]) -> Self {
        TraceContext {
            parent_id: span,
            // Only `sampled` is defined at version 00; other bits are not passed on.
            flags: self.flags & 1,
            ..*self
        }
    }

    /// Whether the trace is sampled (its spans are to be recorded).
    #[must_use]
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The `traceparent` header value, version 00.
    #[must_use]
    pub fn header(&self) -> String {
        let mut out = String::with_capacity(55);
        out.push_str("00-");
        push_hex(&mut out, &self.trace_id);
        out.push('-');
        push_hex(&mut out, &self.parent_id);
        let _ = write!(out, "-{:02x}", self.flags & 1);
        out
    }

    /// The trace id in lower-case hex (32 digits), as logs and trace viewers show it.
    #[must_use]
    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }
}

/// Whether a `tracestate` value may be passed on: at most [`MAX_TRACESTATE`] visible
/// ASCII characters (a longer or stranger one is dropped whole).
#[must_use]
pub fn tracestate_ok(value: &[u8]) -> bool {
    value.len() <= MAX_TRACESTATE && value.iter().all(|b| (0x20..0x7f).contains(b))
}

/// Where a hop's trace ids come from (the shell's source of randomness), and whether it
/// records spans.
pub trait IdSource {
    /// Whether spans are recorded (exported) at all.
    fn recording(&self) -> bool;
    /// Whether a trace this hop starts is sampled.
    fn sample(&self) -> bool;
    /// A new, non-zero span id.
    fn span_id(&self) -> [u8; 8];
    /// A new, non-zero trace id.
    fn trace_id(&self) -> [u8; 16];
}

/// The spans a hop records for a request it serves: the whole request, and the dispatch
/// the next hop sees as its parent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HopSpans {
    /// The request span.
    pub request: [u8; 8],
    /// The dispatch span.
    pub dispatch: [u8; 8],
}

/// A request's trace at this hop, decided from what its caller sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HopTrace {
    /// The trace; for a trace the caller started, `parent_id` is the caller's span.
    pub context: TraceContext,
    /// Whether the caller started the trace (its span is the request span's parent).
    pub from_caller: bool,
    /// The spans this hop records, when it records the trace.
    pub spans: Option<HopSpans>,
    /// The `traceparent` to pass on: the dispatch span as parent when this hop records
    /// one, else the caller's header byte for byte, or the trace this hop started.
    pub traceparent: Vec<u8>,
    /// The caller's `tracestate` to pass on with it (when valid).
    pub tracestate: Option<Vec<u8>>,
}

/// When a request's steps happened, as offsets from its arrival.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    /// Its arrival, nanoseconds since the Unix epoch.
    pub start_ns: u64,
    /// When it was dispatched, if it was.
    pub dispatched: Option<std::time::Duration>,
    /// When its first byte came, if it did.
    pub first_byte: Option<std::time::Duration>,
    /// When it ended.
    pub ended: std::time::Duration,
}

impl HopTrace {
    /// The trace of a request whose caller sent `traceparent` and `tracestate` (if any):
    /// the caller's, continued (recorded when the caller sampled it); a new one when
    /// spans are recorded (sampled as `ids` says, and passed on unsampled otherwise, so
    /// the hops after agree); none when the caller sent no valid one and nothing is
    /// recorded.
    pub fn begin(
        traceparent: Option<&[u8]>,
        tracestate: Option<&[u8]>,
        ids: &impl IdSource,
    ) -> Option<Self> {
        let given = traceparent.and_then(TraceContext::parse);
        let (context, spans) = match given {
            None if !ids.recording() => return None,
            None => {
                let request = ids.span_id();
                let sampled = ids.sample();
                let context = TraceContext::root(ids.trace_id(), request, sampled)?;
                let spans = sampled.then(|| HopSpans {
                    request,
                    dispatch: ids.span_id(),
                });
                (context, spans)
            }
            Some(caller) if ids.recording() && caller.sampled() => {
                let spans = HopSpans {
                    request: ids.span_id(),
                    dispatch: ids.span_id(),
                };
                (caller, Some(spans))
            }
            Some(caller) => (caller, None),
        };
        let traceparent = match (spans, traceparent.filter(|_| given.is_some())) {
            (Some(s), _) => context.child(s.dispatch).header().into_bytes(),
            (None, Some(raw)) => raw.to_vec(),
            (None, None) => context.header().into_bytes(),
        };
        let tracestate = tracestate
            .filter(|v| given.is_some() && tracestate_ok(v))
            .map(<[u8]>::to_vec);
        Some(HopTrace {
            context,
            from_caller: given.is_some(),
            spans,
            traceparent,
            tracestate,
        })
    }

    /// The spans this hop records for the request, none when it records none: the whole
    /// request (`attributes`; `error` for a failure), its wait in the queue, its dispatch
    /// (`dispatch_attributes`; the parent of the next hop's work) and the wait for the
    /// first byte, the last three once it was dispatched.
    #[must_use]
    pub fn spans(
        &self,
        timing: &Timing,
        ids: &impl IdSource,
        attributes: Vec<(&'static str, AttrValue)>,
        dispatch_attributes: Vec<(&'static str, AttrValue)>,
        error: bool,
    ) -> Vec<Span> {
        let Some(hop) = self.spans else {
            return Vec::new();
        };
        let at = |d: std::time::Duration| {
            timing
                .start_ns
                .saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        };
        let trace_id = self.context.trace_id;
        let end = at(timing.ended);
        let span = |span_id, parent_id, name, kind, start_ns, end_ns| Span {
            trace_id,
            span_id,
            parent_id: Some(parent_id),
            name,
            kind,
            start_ns,
            end_ns,
            attributes: Vec::new(),
            error: false,
        };
        let mut out = Vec::with_capacity(4);
        if let Some(queued) = timing.dispatched {
            let sent = at(queued);
            out.push(span(
                ids.span_id(),
                hop.request,
                "queue wait",
                SpanKind::Internal,
                timing.start_ns,
                sent,
            ));
            out.push(Span {
                attributes: dispatch_attributes,
                error,
                ..span(
                    hop.dispatch,
                    hop.request,
                    "dispatch",
                    SpanKind::Client,
                    sent,
                    end,
                )
            });
            if let Some(first) = timing.first_byte {
                out.push(span(
                    ids.span_id(),
                    hop.dispatch,
                    "first byte",
                    SpanKind::Internal,
                    sent,
                    at(first.max(queued)),
                ));
            }
        }
        out.push(Span {
            parent_id: self.from_caller.then_some(self.context.parent_id),
            attributes,
            error,
            ..span(
                hop.request,
                hop.request,
                "request",
                SpanKind::Server,
                timing.start_ns,
                end,
            )
        });
        out
    }
}

/// Lower-case hex of `bytes`.
#[must_use]
pub fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push_hex(&mut out, bytes);
    out
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
}

/// One byte of two lower-case hex digits.
fn hex_byte(two: &[u8]) -> Option<u8> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    Some(digit(two[0])? << 4 | digit(two[1])?)
}

/// What kind of work a span covers (OTLP's `SpanKind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    /// Work inside this hop.
    Internal = 1,
    /// This hop answering a caller.
    Server = 2,
    /// This hop calling the next.
    Client = 3,
}

/// An attribute's value.
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    /// Text.
    Str(String),
    /// A whole number.
    Int(i64),
}

/// A finished span.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// Its trace.
    pub trace_id: [u8; 16],
    /// Its own id.
    pub span_id: [u8; 8],
    /// Its parent's id, if it has one.
    pub parent_id: Option<[u8; 8]>,
    /// What it covers.
    pub name: &'static str,
    /// Its kind.
    pub kind: SpanKind,
    /// When it started, nanoseconds since the Unix epoch.
    pub start_ns: u64,
    /// When it ended, nanoseconds since the Unix epoch.
    pub end_ns: u64,
    /// Its attributes.
    pub attributes: Vec<(&'static str, AttrValue)>,
    /// Whether the work failed (OTLP status `ERROR`).
    pub error: bool,
}

/// OTLP's trace messages (`opentelemetry/proto/collector/trace/v1` and the messages it
/// uses), with the fields IOP writes, numbered as in the published `.proto` files.
pub mod otlp {
    #![allow(missing_docs)]

    /// `ExportTraceServiceRequest`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ExportTraceServiceRequest {
        #[prost(message, repeated, tag = "1")]
        pub resource_spans: Vec<ResourceSpans>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ResourceSpans {
        #[prost(message, optional, tag = "1")]
        pub resource: Option<Resource>,
        #[prost(message, repeated, tag = "2")]
        pub scope_spans: Vec<ScopeSpans>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Resource {
        #[prost(message, repeated, tag = "1")]
        pub attributes: Vec<KeyValue>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ScopeSpans {
        #[prost(message, optional, tag = "1")]
        pub scope: Option<InstrumentationScope>,
        #[prost(message, repeated, tag = "2")]
        pub spans: Vec<Span>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct InstrumentationScope {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(string, tag = "2")]
        pub version: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Span {
        #[prost(bytes = "vec", tag = "1")]
        pub trace_id: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        pub span_id: Vec<u8>,
        #[prost(string, tag = "3")]
        pub trace_state: String,
        #[prost(bytes = "vec", tag = "4")]
        pub parent_span_id: Vec<u8>,
        #[prost(string, tag = "5")]
        pub name: String,
        #[prost(int32, tag = "6")]
        pub kind: i32,
        #[prost(fixed64, tag = "7")]
        pub start_time_unix_nano: u64,
        #[prost(fixed64, tag = "8")]
        pub end_time_unix_nano: u64,
        #[prost(message, repeated, tag = "9")]
        pub attributes: Vec<KeyValue>,
        #[prost(message, optional, tag = "15")]
        pub status: Option<Status>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Status {
        #[prost(string, tag = "2")]
        pub message: String,
        /// 0 unset, 1 ok, 2 error.
        #[prost(int32, tag = "3")]
        pub code: i32,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct KeyValue {
        #[prost(string, tag = "1")]
        pub key: String,
        #[prost(message, optional, tag = "2")]
        pub value: Option<AnyValue>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct AnyValue {
        #[prost(oneof = "any_value::Value", tags = "1, 3")]
        pub value: Option<any_value::Value>,
    }

    pub mod any_value {
        #[derive(Clone, PartialEq, prost::Oneof)]
        pub enum Value {
            #[prost(string, tag = "1")]
            StringValue(String),
            #[prost(int64, tag = "3")]
            IntValue(i64),
        }
    }
}

fn key_value(key: &str, value: &AttrValue) -> otlp::KeyValue {
    otlp::KeyValue {
        key: key.to_owned(),
        value: Some(otlp::AnyValue {
            value: Some(match value {
                AttrValue::Str(s) => otlp::any_value::Value::StringValue(s.clone()),
                AttrValue::Int(i) => otlp::any_value::Value::IntValue(*i),
            }),
        }),
    }
}

/// The export request for `spans` of the service named `service` (version `version`).
#[must_use]
pub fn export_request(
    service: &str,
    version: &str,
    spans: &[Span],
) -> otlp::ExportTraceServiceRequest {
    otlp::ExportTraceServiceRequest {
        resource_spans: vec![otlp::ResourceSpans {
            resource: Some(otlp::Resource {
                attributes: vec![
                    key_value("service.name", &AttrValue::Str(service.to_owned())),
                    key_value("service.version", &AttrValue::Str(version.to_owned())),
                ],
            }),
            scope_spans: vec![otlp::ScopeSpans {
                scope: Some(otlp::InstrumentationScope {
                    name: "iop".to_owned(),
                    version: version.to_owned(),
                }),
                spans: spans
                    .iter()
                    .map(|s| otlp::Span {
                        trace_id: s.trace_id.to_vec(),
                        span_id: s.span_id.to_vec(),
                        trace_state: String::new(),
                        parent_span_id: s.parent_id.map(|p| p.to_vec()).unwrap_or_default(),
                        name: s.name.to_owned(),
                        kind: s.kind as i32,
                        start_time_unix_nano: s.start_ns,
                        end_time_unix_nano: s.end_ns.max(s.start_ns),
                        attributes: s.attributes.iter().map(|(k, v)| key_value(k, v)).collect(),
                        status: s.error.then(|| otlp::Status {
                            message: String::new(),
                            code: 2,
                        }),
                    })
                    .collect(),
            }],
        }],
    }
}

/// `spans` as the body of an OTLP/HTTP protobuf export (`application/x-protobuf`).
#[must_use]
pub fn encode_protobuf(service: &str, version: &str, spans: &[Span]) -> Vec<u8> {
    prost::Message::encode_to_vec(&export_request(service, version, spans))
}

/// `spans` as the body of an OTLP/HTTP JSON export (`application/json`): OTLP's JSON
/// mapping, with ids in hex, field names in lowerCamelCase, 64-bit integers as strings
/// and enums as numbers.
#[must_use]
pub fn encode_json(service: &str, version: &str, spans: &[Span]) -> Vec<u8> {
    use serde_json::{Value, json};
    let attr = |k: &str, v: &AttrValue| match v {
        AttrValue::Str(s) => json!({"key": k, "value": {"stringValue": s}}),
        AttrValue::Int(i) => json!({"key": k, "value": {"intValue": i.to_string()}}),
    };
    let spans: Vec<Value> = spans
        .iter()
        .map(|s| {
            let mut span = json!({
                "traceId": hex(&s.trace_id),
                "spanId": hex(&s.span_id),
                "name": s.name,
                "kind": s.kind as i32,
                "startTimeUnixNano": s.start_ns.to_string(),
                "endTimeUnixNano": s.end_ns.max(s.start_ns).to_string(),
                "attributes": s.attributes.iter().map(|(k, v)| attr(k, v)).collect::<Vec<_>>(),
            });
            if let Some(parent) = s.parent_id {
                span["parentSpanId"] = Value::String(hex(&parent));
            }
            if s.error {
                span["status"] = json!({"code": 2});
            }
            span
        })
        .collect();
    let body = json!({"resourceSpans": [{
        "resource": {"attributes": [
            attr("service.name", &AttrValue::Str(service.to_owned())),
            attr("service.version", &AttrValue::Str(version.to_owned())),
        ]},
        "scopeSpans": [{"scope": {"name": "iop", "version": version}, "spans": spans}],
    }]});
    body.to_string().into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_reads_and_writes_back() {
        let ctx = TraceContext::parse(GOOD.as_bytes()).expect("valid");
        assert!(ctx.sampled());
        assert_eq!(ctx.header(), GOOD);
        assert_eq!(ctx.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        let child = ctx.child([1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            child.header(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0102030405060708-01"
        );
        // A later version may add fields; its first four read the same.
        let later = format!("cc{}-extra", &GOOD[2..]);
        assert_eq!(
            TraceContext::parse(later.as_bytes()).map(|c| c.trace_id),
            Some(ctx.trace_id)
        );
    }

    #[test]
    fn invalid_traceparents_are_refused() {
        let zero_trace = "00-00000000000000000000000000000000-00f067aa0ba902b7-01";
        let zero_parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01";
        let upper = GOOD.to_uppercase();
        let long_00 = format!("{GOOD}-x");
        let ff = format!("ff{}", &GOOD[2..]);
        for bad in [
            "",
            &GOOD[..54],
            zero_trace,
            zero_parent,
            &upper,
            &long_00,
            &ff,
            "00-4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::parse(bad.as_bytes()), None, "{bad:?}");
        }
    }

    struct Ids {
        recording: bool,
        sampled: bool,
        next: std::cell::Cell<u8>,
    }

    impl IdSource for Ids {
        fn recording(&self) -> bool {
            self.recording
        }
        fn sample(&self) -> bool {
            self.sampled
        }
        fn span_id(&self) -> [u8; 8] {
            self.next.set(self.next.get() + 1);
            [self.next.get(); 8]
        }
        fn trace_id(&self) -> [u8; 16] {
            [0xab; 16]
        }
    }

    fn ids(recording: bool, sampled: bool) -> Ids {
        Ids {
            recording,
            sampled,
            next: std::cell::Cell::new(0),
        }
    }

    #[test]
    fn a_hop_continues_starts_or_passes_on_a_trace_as_the_rules_say() {
        let later = format!("cc{}-more", &GOOD[2..]);
        // Not recording: the caller's header as it came, tracestate with it; nothing new.
        let hop = HopTrace::begin(Some(later.as_bytes()), Some(b"v=1"), &ids(false, true))
            .expect("the caller's");
        assert_eq!(
            (hop.traceparent, hop.spans),
            (later.clone().into_bytes(), None)
        );
        assert_eq!(hop.tracestate.as_deref(), Some(&b"v=1"[..]));
        assert!(HopTrace::begin(None, Some(b"v=1"), &ids(false, true)).is_none());
        // An invalid header is dropped, never passed on; a bad tracestate too.
        assert!(HopTrace::begin(Some(b"00-nope-01"), None, &ids(false, true)).is_none());
        let hop = HopTrace::begin(Some(GOOD.as_bytes()), Some(b"v=\n"), &ids(false, true))
            .expect("valid");
        assert_eq!(hop.tracestate, None);
        // Recording a sampled caller's trace: the dispatch span is the next parent.
        let hop = HopTrace::begin(Some(GOOD.as_bytes()), None, &ids(true, false)).expect("ok");
        let spans = hop.spans.expect("recorded");
        assert_eq!(
            hop.traceparent,
            format!("00-{}-{}-01", &GOOD[3..35], hex(&spans.dispatch)).into_bytes()
        );
        // ...but not one the caller did not sample.
        let unsampled = format!("{}00", &GOOD[..53]);
        let hop =
            HopTrace::begin(Some(unsampled.as_bytes()), None, &ids(true, true)).expect("passed on");
        assert_eq!((hop.spans, hop.traceparent), (None, unsampled.into_bytes()));
        // A new trace: sampled as the source says, passed on marked so either way.
        let hop = HopTrace::begin(None, Some(b"v=1"), &ids(true, false)).expect("new");
        assert!(hop.spans.is_none() && hop.traceparent.ends_with(b"-00"));
        assert_eq!(hop.tracestate, None, "no caller, no state of its");
        let hop = HopTrace::begin(None, None, &ids(true, true)).expect("new");
        assert!(!hop.from_caller && hop.traceparent.ends_with(b"-01"));
        let timing = Timing {
            start_ns: 1_000,
            dispatched: Some(std::time::Duration::from_nanos(10)),
            first_byte: Some(std::time::Duration::from_nanos(30)),
            ended: std::time::Duration::from_nanos(100),
        };
        let spans = hop.spans(&timing, &ids(true, true), Vec::new(), Vec::new(), false);
        let names: Vec<_> = spans.iter().map(|s| s.name).collect();
        assert_eq!(names, ["queue wait", "dispatch", "first byte", "request"]);
        let request = spans.last().expect("request");
        assert_eq!(
            (request.parent_id, request.start_ns, request.end_ns),
            (None, 1_000, 1_100)
        );
        assert_eq!(spans[2].parent_id, Some(spans[1].span_id));
    }

    #[test]
    fn spans_encode_to_what_a_collector_decodes() {
        let span = Span {
            trace_id: [7; 16],
            span_id: [9; 8],
            parent_id: Some([3; 8]),
            name: "request",
            kind: SpanKind::Server,
            start_ns: 10,
            end_ns: 25,
            attributes: vec![("http.response.status_code", AttrValue::Int(200))],
            error: false,
        };
        let bytes = encode_protobuf("iop-edge", "0.1.0", std::slice::from_ref(&span));
        let back: otlp::ExportTraceServiceRequest =
            prost::Message::decode(bytes.as_slice()).expect("decodes");
        let got = &back.resource_spans[0].scope_spans[0].spans[0];
        assert_eq!(got.trace_id, vec![7; 16]);
        assert_eq!(got.parent_span_id, vec![3; 8]);
        assert_eq!((got.start_time_unix_nano, got.end_time_unix_nano), (10, 25));
        let json: serde_json::Value =
            serde_json::from_slice(&encode_json("iop-edge", "0.1.0", &[span])).expect("json");
        let got = &json["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
        assert_eq!(got["traceId"], hex(&[7; 16]));
        assert_eq!(got["parentSpanId"], "0303030303030303");
        assert_eq!(got["startTimeUnixNano"], "10");
        assert_eq!(got["attributes"][0]["value"]["intValue"], "200");
    }
}
