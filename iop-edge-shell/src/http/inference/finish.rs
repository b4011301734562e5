//! What a request leaves behind when it ends: its cancel on the way out, its log line, metrics, usage and span.

use super::super::Caller;
use crate::driver::{Core, CoreMsg};
use crate::metrics::Metrics;
use crate::tenants::Ticket;
use crate::traces::Tracer;
use iop_api::tenant::TokenUsage;
use iop_proto_core::RequestId;
use iop_proto_core::wire::{ForwardedHeadersBuilder, Usage};
use iop_trace::{AttrValue, HopTrace, Span, TRACEPARENT, TRACESTATE, Timing};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::time::Instant;
use tracing::info;

/// Cancels the request when dropped before `disarm` (client gone, write failure, timeout).
pub(super) struct CancelGuard {
    pub(super) core: Core,
    pub(super) request: RequestId,
    pub(super) armed: bool,
    pub(super) reason: &'static str,
}

impl CancelGuard {
    pub(super) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Handled before the drop returns: the lease goes back at once.
        let _ = self.core.send(CoreMsg::Cancel {
            request: self.request,
            reason: self.reason,
        });
    }
}

/// What a request's log line and metrics record, gathered while it runs.
pub(super) struct Finish {
    pub(super) metrics: Arc<Metrics>,
    pub(super) model: Arc<str>,
    pub(super) started: Instant,
    pub(super) first_byte: Option<Duration>,
    pub(super) request_id: Arc<str>,
    pub(super) caller: Caller,
    pub(super) route: super::Route,
    /// Node and adapter that answer it, and how long after its arrival it was first
    /// dispatched (its queue wait, as the log line and the trace's spans give it).
    pub(super) dispatched: Option<(Arc<str>, Arc<str>, Duration)>,
    /// Its key's admission, finished with the usage its provider reported.
    pub(super) ticket: Option<Ticket>,
    /// Its trace, when the caller sent one or spans are exported.
    pub(super) trace: Option<RequestTrace>,
    pub(super) tracer: Arc<Tracer>,
    /// The series of `model` once looked up (its first byte and its end record into it).
    pub(super) series: Option<(Arc<str>, Arc<crate::metrics::ModelMetrics>)>,
}

/// A request's place in a trace (the core's decision), and when it arrived.
pub(super) struct RequestTrace {
    pub(super) hop: HopTrace,
    /// When the request arrived, in nanoseconds since the Unix epoch.
    pub(super) start_ns: u64,
}

impl RequestTrace {
    /// The trace of a request whose head carried `traceparent` and `tracestate` (their
    /// first values; [`HopTrace::begin`]); the ones to pass on go into `forward`.
    pub(super) fn begin(
        parent: Option<&[u8]>,
        state: Option<&[u8]>,
        tracer: &Tracer,
        forward: &mut ForwardedHeadersBuilder,
    ) -> Option<Self> {
        // `tracestate` only matters beside a `traceparent`.
        let state = parent.and(state);
        let hop = HopTrace::begin(parent, state, tracer)?;
        forward.push(TRACEPARENT, &hop.traceparent);
        if let Some(state) = &hop.tracestate {
            forward.push(TRACESTATE, state);
        }
        let start_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        Some(RequestTrace { hop, start_ns })
    }
}

impl Finish {
    /// The series `model`'s figures record into, looked up once per request.
    fn series(&mut self) -> Arc<crate::metrics::ModelMetrics> {
        match &self.series {
            Some((model, series)) if Arc::ptr_eq(model, &self.model) => series.clone(),
            _ => {
                let series = self.metrics.model(&self.model);
                self.series = Some((self.model.clone(), series.clone()));
                series
            }
        }
    }

    /// The request is answered by `node` and `provider`, and left the queue at `at` (its
    /// first dispatch).
    pub(super) fn dispatched(&mut self, node: Arc<str>, provider: Arc<str>, at: Instant) {
        self.dispatched = Some((node, provider, at.saturating_duration_since(self.started)));
    }

    /// The answer's first byte arrived at `at`.
    pub(super) fn first_byte(&mut self, at: Instant) {
        if self.first_byte.is_none() {
            let ttfb = at.saturating_duration_since(self.started);
            self.first_byte = Some(ttfb);
            self.series().first_byte(ttfb);
        }
    }

    /// Records the request's figures, finishes its key's admission and writes its one
    /// log line.
    pub(super) fn done(&mut self, status: u16, usage: Option<&Usage>) {
        let duration = self.started.elapsed();
        let metrics = self.series();
        metrics.request(status, duration, self.route.dialect());
        if let (Some(u), Some((node, provider, _))) = (usage, &self.dispatched) {
            metrics.tokens(
                node,
                provider,
                &self.caller.name,
                u.prompt_tokens,
                u.completion_tokens,
            );
        }
        if let Some(ticket) = self.ticket.take() {
            ticket.finish(usage.map(|u| TokenUsage {
                prompt: u.prompt_tokens,
                completion: u.completion_tokens,
            }));
        }
        let (node, provider, queued) = match &self.dispatched {
            Some((node, provider, at)) => (&**node, &**provider, Some(*at)),
            None => ("-", "-", None),
        };
        let trace_id = self.trace.as_ref().map(|t| t.hop.context.trace_id_hex());
        if let Some(trace) = &self.trace
            && trace.hop.spans.is_some()
        {
            self.tracer
                .export(self.spans(trace, status, usage, duration));
        }
        // Milliseconds to the microsecond, counted in thousandths; -1 for a step the
        // request never reached.
        let micros = |d: Option<Duration>| {
            d.map_or(-1000, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        };
        let (queue_us, ttfb_us, duration_us) = (
            micros(queued),
            micros(self.first_byte),
            micros(Some(duration)),
        );
        use iop_shell_common::logging::{Field, info_direct};
        // The same line as the `info!` below, written without tracing's per-field dispatch
        // where the text format allows it.
        // The request id is one `is_request_id` admits or one made here, and the endpoint
        // and dialect are constants: none needs its bytes checked for escapes.
        let line = iop_shell_common::direct_line!(
            "request",
            request_id: Some(Field::Quoted(&self.request_id)),
            trace_id: trace_id.as_deref().map(Field::Str),
            caller: Some(Field::Bare(&self.caller.name)),
            endpoint: Some(Field::Quoted(self.route.path())),
            dialect: Some(Field::Quoted(self.route.dialect().as_str())),
            model: Some(Field::Bare(&self.model)),
            node: Some(Field::Str(node)),
            provider: Some(Field::Str(provider)),
            status: Some(Field::U64(status.into())),
            queue_ms: Some(Field::Milli(queue_us)),
            ttfb_ms: Some(Field::Milli(ttfb_us)),
            duration_ms: Some(Field::Milli(duration_us)),
            prompt_tokens: usage.map(|u| Field::U64(u.prompt_tokens)),
            completion_tokens: usage.map(|u| Field::U64(u.completion_tokens)),
        );
        if !tracing::enabled!(target: "iop::request", tracing::Level::INFO) || info_direct(&line) {
            return;
        }
        info!(
            target: "iop::request",
            request_id = &*self.request_id,
            trace_id,
            caller = %self.caller,
            endpoint = self.route.path(),
            dialect = self.route.dialect().as_str(),
            model = %self.model,
            node,
            provider,
            status,
            queue_ms = queue_us as f64 / 1e3,
            ttfb_ms = ttfb_us as f64 / 1e3,
            duration_ms = duration_us as f64 / 1e3,
            prompt_tokens = usage.map(|u| u.prompt_tokens),
            completion_tokens = usage.map(|u| u.completion_tokens),
            "request"
        );
    }
}

impl Finish {
    /// The Edge's spans of a request that ended with `status` after `duration`
    /// ([`HopTrace::spans`]), with what the request's log line says as attributes.
    pub(super) fn spans(
        &self,
        trace: &RequestTrace,
        status: u16,
        usage: Option<&Usage>,
        duration: Duration,
    ) -> Vec<Span> {
        let text = |s: &str| AttrValue::Str(s.to_owned());
        let mut attributes = vec![
            ("http.request.method", text("POST")),
            ("url.path", text(self.route.path())),
            (
                "http.response.status_code",
                AttrValue::Int(i64::from(status)),
            ),
            ("gen_ai.request.model", text(&self.model)),
            ("iop.request_id", text(&self.request_id)),
            ("iop.key", text(&self.caller.name)),
        ];
        if let Some(u) = usage {
            let tokens = |n: u64| AttrValue::Int(i64::try_from(n).unwrap_or(i64::MAX));
            attributes.push(("gen_ai.usage.input_tokens", tokens(u.prompt_tokens)));
            attributes.push(("gen_ai.usage.output_tokens", tokens(u.completion_tokens)));
        }
        let mut dispatch_attributes = Vec::new();
        if let Some((node, provider, _)) = &self.dispatched {
            dispatch_attributes = vec![("iop.node", text(node)), ("iop.provider", text(provider))];
            attributes.extend(dispatch_attributes.iter().cloned());
        }
        let timing = Timing {
            start_ns: trace.start_ns,
            dispatched: self.dispatched.as_ref().map(|(_, _, at)| *at),
            first_byte: self.first_byte,
            ended: duration,
        };
        trace.hop.spans(
            &timing,
            &*self.tracer,
            attributes,
            dispatch_attributes,
            status >= 500,
        )
    }
}
