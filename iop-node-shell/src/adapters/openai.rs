//! `openai_compat` and `vllm`: raw tunnels pass method, path, headers and body through and
//! stream the response back as ordered frames; normalized runs go through
//! `/v1/chat/completions` streaming, with native `tool_calls` reported in
//! `openai_tool_calls` and a one-time text tool-call fallback when the backend rejects
//! `tools`.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use super::pool::ProviderBody;
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame};
use iop_json::nonempty_array;
use iop_proto_core::wire::{
    AdapterConfig, Header, ProviderHealth, RunRequest, TunnelRequest, Usage,
};
use iop_proto_core::{RunOutput, TunnelOutput};
use iop_shell_common::cancel::Cancel;
use iop_shell_common::deadline::{PooledSleep, SleepPool};
use serde_json::{Value, json};
use tokio::time::Instant;

use super::http::{self, HttpClient, Upstream, raw_wire_headers, wire_headers};
use super::json;
use super::sse::{Lines, UsageWatcher, sse_data, usage_of};
use super::{Sink, TunnelTail, error};

/// An OpenAI-compatible backend (`vllm` adds its `/health` endpoint).
#[derive(Debug)]
pub struct OpenAi {
    upstream: Upstream,
    client: HttpClient,
    default_timeout: Duration,
    vllm: bool,
}

/// How an upstream call failed before or while streaming.
enum CallError {
    Cancelled,
    TimedOut,
    Unreachable(String),
}

impl CallError {
    fn detail(&self) -> iop_proto_core::wire::ErrorDetail {
        match self {
            CallError::Cancelled => error("cancelled", "cancelled by the edge", false),
            CallError::TimedOut => error("timeout", "provider did not answer in time", true),
            CallError::Unreachable(why) => error("upstream_unreachable", why.clone(), true),
        }
    }
}

pin_project_lite::pin_project! {
    /// The deadline and cancellation of one provider call, armed once for every await of
    /// it (a timer per body frame cost a timer-wheel update per chunk).
    ///
    /// Work that is ready is taken without polling the two: they are polled, and so set to
    /// wake the task, only when the work is pending, once for each wait (polled before every
    /// read of a streamed body as well, they were a measurable share of a paced event's
    /// cost: docs/benchmarks-history.md). A cancel or a passed deadline still ends the
    /// call before any more work: both are looked at first, by a flag each (the cancel's,
    /// and the timer's, which the runtime sets when the deadline passes: a pool's timer is
    /// in the runtime's timer wheel from the start, polled or not).
    ///
    /// The timer is one the client kept ([`HttpClient::timers`]), back in the pool when
    /// the call is done, and taken as it is set when that is earlier than the deadline
    /// (it stays in the runtime's timer wheel): one that fires early is set again for the
    /// deadline, and only a timer set for the deadline ends the call.
    pub(crate) struct Watch {
        sleep: PooledSleep,
        deadline: Instant,
        cancel: Cancel,
    }
}

impl Watch {
    /// A watch for one call due at `deadline`, its timer taken from `timers` (each call
    /// pins it where its future lives, `std::pin::pin!`, as `run` takes it pinned).
    pub(crate) fn new(timers: &Arc<SleepPool>, deadline: Instant, cancel: &Cancel) -> Self {
        Watch {
            sleep: timers.sleep_by(deadline),
            deadline,
            cancel: cancel.clone(),
        }
    }

    /// `work`, unless the call is cancelled or its deadline passes first.
    async fn run<F: std::future::Future>(
        self: Pin<&mut Self>,
        work: F,
    ) -> Result<F::Output, CallError> {
        let this = self.project();
        if this.cancel.is_cancelled() {
            return Err(CallError::Cancelled);
        }
        if this.sleep.is_elapsed() {
            if this.sleep.deadline() >= *this.deadline {
                return Err(CallError::TimedOut);
            }
            // Fired early (kept set for another call's deadline): set for this one's.
            this.sleep.as_mut().reset(*this.deadline);
        }
        let (sleep, deadline) = (this.sleep, *this.deadline);
        tokio::select! {
            biased;
            out = work => Ok(out),
            () = this.cancel.cancelled() => Err(CallError::Cancelled),
            () = std::future::poll_fn(|cx| poll_due(sleep, deadline, cx)) => Err(CallError::TimedOut),
        }
    }
}

/// Ready once `deadline` is reached: `sleep` is set for it, or, set for an earlier
/// instant and fired, set for it then.
fn poll_due(sleep: &mut PooledSleep, deadline: Instant, cx: &mut Context<'_>) -> Poll<()> {
    loop {
        std::task::ready!(sleep.as_mut().poll(cx));
        if sleep.deadline() >= deadline {
            return Poll::Ready(());
        }
        sleep.as_mut().reset(deadline);
    }
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch")
            .field("deadline", &self.deadline)
            .finish()
    }
}

/// Sends `request` to `upstream` under `watch`.
async fn send(
    client: &HttpClient,
    upstream: &Upstream,
    request: hyper::Request<Bytes>,
    watch: Pin<&mut Watch>,
) -> Result<hyper::Response<ProviderBody>, CallError> {
    watch
        .run(upstream.send(client, request))
        .await?
        .map_err(|err| CallError::Unreachable(format!("request failed: {err}")))
}

/// The next body frame under `watch`.
async fn next_frame(
    body: &mut ProviderBody,
    watch: Pin<&mut Watch>,
) -> Result<Option<Frame<Bytes>>, CallError> {
    match watch.run(body.frame()).await? {
        None => Ok(None),
        Some(Err(err)) => Err(body_failed(&err)),
        Some(Ok(frame)) => Ok(Some(frame)),
    }
}

/// A tunnel's status output.
fn status_output((status, headers): (u32, Vec<Header>)) -> TunnelOutput {
    TunnelOutput::Status { status, headers }
}

fn body_failed(err: &dyn std::fmt::Display) -> CallError {
    CallError::Unreachable(format!("response body failed: {err}"))
}

/// Ready body frames are joined until the tunnel frame holds this many bytes.
const JOIN_MAX: usize = 64 << 10;
/// Frames [`Joined`] makes room for when it first finds data ready behind a frame.
const PARTS: usize = 16;

/// A tunnelled response body, read so that data frames the provider has already sent
/// come out as one. An SSE stream arrives as a body frame per event; passed on one by one,
/// each would cost a message to the core, a wire frame, a read and a write at the Edge and
/// a write to the caller. Joining never waits: only frames ready now are taken (what a
/// reverse proxy's read of everything buffered does), so a paced stream's events still
/// leave as they come, and the bytes are the same, in order.
struct Joined<B: Body> {
    body: B,
    /// What a look ahead found behind the last joined data (trailers, an error, or the
    /// body's end), returned next.
    ahead: Option<Option<Result<Frame<Bytes>, B::Error>>>,
    /// The data found ready behind a frame's, copied out in one allocation of the
    /// joined size (growing a buffer as they came cost a reallocation and a copy each).
    /// Kept between calls: a stream whose frames come one at a time never allocates it.
    parts: Vec<Bytes>,
}

impl<B> Joined<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    fn new(body: B) -> Self {
        Joined {
            body,
            ahead: None,
            parts: Vec::new(),
        }
    }

    /// Whether a frame (or the body's end) is ready now, polled without waiting; what the
    /// poll found is returned next.
    fn ready(&mut self) -> bool {
        if self.ahead.is_none() {
            let mut cx = Context::from_waker(Waker::noop());
            if let Poll::Ready(next) = Pin::new(&mut self.body).poll_frame(&mut cx) {
                self.ahead = Some(next);
            }
        }
        self.ahead.is_some()
    }

    /// Whether the body is known to have ended behind the frames returned so far (a look
    /// ahead found its end, or it says so itself).
    fn at_end(&self) -> bool {
        match &self.ahead {
            Some(None) => true,
            Some(Some(_)) => false,
            None => self.body.is_end_stream(),
        }
    }

    /// The next frame under `watch`, data joined with the data ready behind it.
    async fn frame(&mut self, watch: Pin<&mut Watch>) -> Result<Option<Frame<Bytes>>, CallError> {
        let next = match self.ahead.take() {
            Some(next) => next,
            None => watch.run(self.body.frame()).await?,
        };
        let first = match next {
            None => return Ok(None),
            Some(Err(err)) => return Err(body_failed(&err)),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => data,
                Err(frame) => return Ok(Some(frame)),
            },
        };
        let mut total = first.len();
        // Polled without a waker: a pending body is awaited (with one) on the next call.
        let mut cx = Context::from_waker(Waker::noop());
        while total < JOIN_MAX {
            match Pin::new(&mut self.body).poll_frame(&mut cx) {
                Poll::Pending => break,
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(more) => {
                        total += more.len();
                        if self.parts.capacity() == 0 {
                            // Room for a burst of events at once: growing 0 → 4 → 8 →
                            // 16 cost three reallocations per stream.
                            self.parts.reserve_exact(PARTS);
                        }
                        self.parts.push(more);
                    }
                    Err(frame) => {
                        self.ahead = Some(Some(Ok(frame)));
                        break;
                    }
                },
                Poll::Ready(other) => {
                    self.ahead = Some(other);
                    break;
                }
            }
        }
        if self.parts.is_empty() {
            return Ok(Some(Frame::data(first)));
        }
        let mut joined = BytesMut::with_capacity(total);
        joined.extend_from_slice(&first);
        for part in self.parts.drain(..) {
            joined.extend_from_slice(&part);
        }
        Ok(Some(Frame::data(joined.freeze())))
    }
}

/// Reads at most `limit` bytes of a body, for error messages.
async fn excerpt(body: &mut ProviderBody, limit: usize, mut watch: Pin<&mut Watch>) -> String {
    let mut out = Vec::new();
    while out.len() < limit {
        match next_frame(body, watch.as_mut()).await {
            Ok(Some(frame)) => {
                if let Ok(data) = frame.into_data() {
                    out.extend_from_slice(&data);
                }
            }
            _ => break,
        }
    }
    out.truncate(limit);
    String::from_utf8_lossy(&out).into_owned()
}

impl OpenAi {
    /// An adapter for `config`.
    pub fn new(
        config: &AdapterConfig,
        client: HttpClient,
        default_timeout: Duration,
        vllm: bool,
    ) -> Result<Self, String> {
        Ok(OpenAi {
            upstream: Upstream::new(&config.base_url, &config.api_key)?,
            client,
            default_timeout,
            vllm,
        })
    }

    /// The provider's health, probed: vLLM's `/health`, or for any other
    /// OpenAI-compatible server its model list (`/v1/models`).
    pub async fn health(&self) -> ProviderHealth {
        let path = if self.vllm { "/health" } else { "/v1/models" };
        http::probe(&self.client, &self.upstream, path).await
    }

    fn deadline(&self, timeout_sec: u32) -> Instant {
        let timeout = if timeout_sec > 0 {
            Duration::from_secs(u64::from(timeout_sec))
        } else {
            self.default_timeout
        };
        Instant::now() + timeout
    }

    /// Raw pass-through of one HTTP request; a tunnel that reaches the end of the answer
    /// hands its last outputs back.
    pub async fn tunnel(
        &self,
        request: TunnelRequest,
        sink: Sink,
        cancel: Cancel,
    ) -> Option<TunnelTail> {
        match self.tunnel_inner(request, &sink, &cancel).await {
            Ok(tail) => tail,
            Err(err) => {
                let _ = sink.tunnel(TunnelOutput::Error(err.detail())).await;
                None
            }
        }
    }

    async fn tunnel_inner(
        &self,
        request: TunnelRequest,
        sink: &Sink,
        cancel: &Cancel,
    ) -> Result<Option<TunnelTail>, CallError> {
        let mut watch = std::pin::pin!(Watch::new(
            self.client.timers(),
            self.deadline(request.timeout_sec()),
            cancel
        ));
        let method = request.method();
        // The head is written straight from the tunnel request and the answer's head kept
        // as read: a pass-through needs no `http` request or header map on either side.
        let head = self
            .upstream
            .tunnel_head(
                method,
                request.path(),
                request.headers(),
                request.body_len(),
            )
            .map_err(CallError::Unreachable)?;
        let answer = self
            .upstream
            .send_raw(&self.client, head, request.body(), method == "HEAD");
        let (head, body) = watch
            .as_mut()
            .run(answer)
            .await?
            .map_err(|err| CallError::Unreachable(format!("request failed: {err}")))?;
        let mut watcher = UsageWatcher::new(head.field("content-type").unwrap_or_default());
        let mut status = Some((u32::from(head.parsed.status), raw_wire_headers(&head)));
        drop(head);
        let mut body = Joined::new(body);
        // The status waits only for what is ready behind the head: a small answer is often
        // whole there, and then its status, body, usage and end go back together.
        if !body.ready()
            && let Some(status) = status.take()
            && !sink.tunnel(status_output(status)).await
        {
            return Ok(None);
        }
        let mut last = None;
        loop {
            let frame = body.frame(watch.as_mut()).await;
            // Everything but the answer's last bytes (or its end) goes out behind the status.
            let last_data = matches!(&frame, Ok(Some(frame)) if frame.is_data()) && body.at_end();
            if !last_data
                && !matches!(frame, Ok(None))
                && let Some(status) = status.take()
                && !sink.tunnel(status_output(status)).await
            {
                return Ok(None);
            }
            let Some(frame) = frame? else {
                break;
            };
            match frame.into_data() {
                Ok(data) => {
                    watcher.push(&data);
                    if last_data {
                        // The answer's last bytes: they go with its usage and end.
                        last = Some(data);
                        break;
                    }
                    if !sink.tunnel(TunnelOutput::Body(data)).await {
                        return Ok(None);
                    }
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        let headers = wire_headers(&trailers);
                        let _ = sink.tunnel(TunnelOutput::Trailers(headers)).await;
                    }
                }
            }
        }
        Ok(Some(TunnelTail {
            status,
            body: last,
            usage: watcher.finish(),
        }))
    }

    /// A normalized run through `/v1/chat/completions` with `stream: true`.
    pub async fn run(&self, request: RunRequest, sink: Sink, cancel: Cancel) {
        if !sink.run(RunOutput::Start).await {
            return;
        }
        let output = match self.run_inner(&request, &sink, &cancel).await {
            Ok(output) => output,
            Err(CallError::Cancelled) => RunOutput::Cancelled,
            Err(err) => RunOutput::Error(err.detail()),
        };
        let _ = sink.run(output).await;
    }

    async fn run_inner(
        &self,
        request: &RunRequest,
        sink: &Sink,
        cancel: &Cancel,
    ) -> Result<RunOutput, CallError> {
        let mut watch = std::pin::pin!(Watch::new(self.client.timers(), self.deadline(0), cancel));
        // The caller's body, copied member by member with the run's members replaced: no
        // tree of it is built, and a large one is read off the Node's thread.
        let model: Arc<str> = Value::from(request.target.as_str()).to_string().into();
        let prepared = {
            let model = Arc::clone(&model);
            // A cancelled run does not wait for a conversion slot.
            watch
                .as_mut()
                .run(super::convert_input(&request.input, move |raw| {
                    let input = json::Object::parse(raw)?;
                    let body = Bytes::from(input.write(&run_members(&model)));
                    Ok((body, input.get("tools").is_some_and(nonempty_array)))
                }))
                .await?
        };
        let (mut body, had_tools) = match prepared {
            Ok(prepared) => prepared,
            Err(err) => return Ok(RunOutput::Error(err)),
        };
        let mut headers = vec![Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"application/json"),
        }];
        headers.extend(http::trace_headers(&request.metadata));
        let mut fallback = false;
        let response = loop {
            let upstream = self
                .upstream
                .request("POST", "/v1/chat/completions", &headers, body.clone())
                .map_err(CallError::Unreachable)?;
            let mut response = send(&self.client, &self.upstream, upstream, watch.as_mut()).await?;
            let status = response.status();
            if status.is_success() {
                break response;
            }
            let text = excerpt(response.body_mut(), 4096, watch.as_mut()).await;
            if status.is_client_error()
                && had_tools
                && !fallback
                && text.to_ascii_lowercase().contains("tool")
            {
                fallback = true;
                let model = Arc::clone(&model);
                let rewritten = watch
                    .as_mut()
                    .run(super::convert_input(&request.input, move |raw| {
                        json::Object::parse(raw).map(|input| {
                            Bytes::from(text_tool_fallback(&input, &run_members(&model)))
                        })
                    }))
                    .await?;
                body = match rewritten {
                    Ok(body) => body,
                    Err(err) => return Ok(RunOutput::Error(err)),
                };
                continue;
            }
            return Ok(RunOutput::Error(error(
                "upstream_status",
                format!("provider answered {}: {}", status.as_u16(), text.trim()),
                super::provider_failed(status),
            )));
        };
        let mut lines = Lines::default();
        let mut calls = ToolCalls::default();
        let mut usage: Option<Usage> = None;
        let mut finish: Option<String> = None;
        let mut stop_sequence: Option<String> = None;
        let mut body = response.into_body();
        'stream: while let Some(frame) = next_frame(&mut body, watch.as_mut()).await? {
            let Ok(data) = frame.into_data() else {
                continue;
            };
            lines.push(data);
            while let Some(line) = lines.next_line() {
                let Some(payload) = sse_data(&line) else {
                    continue;
                };
                if payload == b"[DONE]" {
                    break 'stream;
                }
                let Ok(chunk) = serde_json::from_slice::<Value>(payload) else {
                    continue;
                };
                if let Some(u) = usage_of(&chunk) {
                    usage = Some(u);
                }
                if let Some(reason) = chunk
                    .pointer("/choices/0/finish_reason")
                    .and_then(Value::as_str)
                {
                    finish = Some(reason.to_owned());
                }
                // vLLM's: the stop string that ended the answer.
                if let Some(stop) = chunk
                    .pointer("/choices/0/stop_reason")
                    .and_then(Value::as_str)
                {
                    stop_sequence = Some(stop.to_owned());
                }
                let Some(delta) = chunk.pointer("/choices/0/delta") else {
                    continue;
                };
                if let Some(text) = delta.get("content").and_then(Value::as_str)
                    && !text.is_empty()
                    && !sink.run(RunOutput::Delta(text.to_owned())).await
                {
                    return Err(CallError::Cancelled);
                }
                if let Some(parts) = delta.get("tool_calls").and_then(Value::as_array) {
                    calls.merge(parts);
                }
            }
        }
        let mut metadata = BTreeMap::new();
        if !calls.is_empty() {
            metadata.insert("openai_tool_calls".to_owned(), calls.to_json().to_string());
        }
        if fallback {
            metadata.insert("openai_text_tool_fallback".to_owned(), "true".to_owned());
        }
        if let Some(finish) = finish {
            metadata.insert(iop_proto_core::wire::FINISH_REASON_KEY.to_owned(), finish);
        }
        if let Some(stop) = stop_sequence {
            metadata.insert(iop_proto_core::wire::STOP_SEQUENCE_KEY.to_owned(), stop);
        }
        Ok(RunOutput::Complete { usage, metadata })
    }
}

/// Streamed `tool_calls` fragments, merged by index.
#[derive(Debug, Default)]
struct ToolCalls {
    calls: BTreeMap<u64, (String, String, String)>,
}

impl ToolCalls {
    fn merge(&mut self, parts: &[Value]) {
        for (position, part) in parts.iter().enumerate() {
            let index = part
                .get("index")
                .and_then(Value::as_u64)
                .unwrap_or(position as u64);
            let entry = self.calls.entry(index).or_default();
            if let Some(id) = part.get("id").and_then(Value::as_str) {
                entry.0.push_str(id);
            }
            if let Some(name) = part.pointer("/function/name").and_then(Value::as_str) {
                entry.1.push_str(name);
            }
            if let Some(args) = part.pointer("/function/arguments").and_then(Value::as_str) {
                entry.2.push_str(args);
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    fn to_json(&self) -> Value {
        Value::Array(
            self.calls
                .iter()
                .map(|(index, (id, name, args))| {
                    let id = if id.is_empty() { format!("call_{index}") } else { id.clone() };
                    json!({ "id": id, "type": "function", "function": { "name": name, "arguments": args } })
                })
                .collect(),
        )
    }
}

/// The members a run's request to the provider sets, `model` being the target as a JSON
/// string: a streamed answer that ends with its usage.
fn run_members(model: &str) -> [(&'static str, &str); 3] {
    [
        ("model", model),
        ("stream", "true"),
        ("stream_options", r#"{"include_usage":true}"#),
    ]
}

/// The request without `tools`/`tool_choice`, with a text tool-call instruction merged into
/// the leading system message (some backends reject a system message elsewhere), and the
/// members of `set` replaced. Only the first message is rewritten; the rest are copied.
#[must_use]
pub fn text_tool_fallback(input: &json::Object<'_>, set: &[(&str, &str)]) -> Vec<u8> {
    use std::borrow::Cow;
    let tools = input.get("tools").map_or("null", |t| t.get());
    let instruction = format!(
        "You can call these tools: {tools}\nTo call tools, answer with only this JSON and no other text: \
         {{\"tool_calls\": [{{\"name\": \"<tool name>\", \"arguments\": {{...}}}}]}}"
    );
    let messages = input
        .get("messages")
        .and_then(json::elements)
        .unwrap_or_default();
    let first: Option<Value> = messages
        .first()
        .and_then(|m| serde_json::from_str(m.get()).ok())
        .filter(|m: &Value| m.get("role").and_then(Value::as_str) == Some("system"));
    let lead = match first {
        Some(mut system) => {
            let content = system
                .get("content")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned();
            system["content"] = json!(format!("{content}\n\n{instruction}"));
            (system, 1)
        }
        None => (json!({ "role": "system", "content": instruction }), 0),
    };
    let messages = json::array(
        std::iter::once(Cow::Owned(lead.0.to_string()))
            .chain(messages[lead.1..].iter().map(|m| Cow::Borrowed(m.get()))),
    );
    let mut all: Vec<(&str, &str)> = set.to_vec();
    all.push(("messages", &messages));
    let mut input_without_tools = input.write(&all);
    // Dropping members needs a second pass over the (small) top level.
    if let Ok(mut object) = json::Object::parse(&input_without_tools) {
        object.remove("tools");
        object.remove("tool_choice");
        input_without_tools = object.write(&[]);
    }
    input_without_tools
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body that answers polls from a script (a `Pending` wakes at once).
    struct Script(std::collections::VecDeque<Option<Result<Frame<Bytes>, String>>>);

    impl Body for Script {
        type Data = Bytes;
        type Error = String;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, String>>> {
            match self.0.pop_front() {
                Some(Some(Ok(frame))) if frame.data_ref().is_some_and(Bytes::is_empty) => {
                    // An empty data frame stands for "nothing ready yet".
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
                Some(next) => Poll::Ready(next),
                None => Poll::Ready(None),
            }
        }
    }

    fn data(text: &str) -> Option<Result<Frame<Bytes>, String>> {
        Some(Ok(Frame::data(Bytes::copy_from_slice(text.as_bytes()))))
    }

    #[tokio::test]
    async fn ready_body_frames_leave_as_one_in_order_and_nothing_waits() {
        let mut trailers = hyper::HeaderMap::new();
        trailers.insert("x-done", hyper::header::HeaderValue::from_static("1"));
        let script = [
            data("data: a\n\n"),
            data("data: b\n\n"),
            data(""),
            data("data: c\n\n"),
            Some(Ok(Frame::trailers(trailers))),
            data("data: late\n\n"),
            Some(Err("reset".to_owned())),
        ];
        let mut body = Joined::new(Script(script.into_iter().collect()));
        let cancel = Cancel::new();
        let mut watch = std::pin::pin!(watch_in(Duration::from_secs(60), &cancel));
        let mut next = async || body.frame(watch.as_mut()).await;
        let text = |frame: Option<Frame<Bytes>>| {
            let data = frame.expect("frame").into_data().expect("data");
            String::from_utf8(data.to_vec()).expect("utf-8")
        };
        // What was ready behind the first frame came with it; the pending poll ended it.
        assert_eq!(text(next().await.ok().flatten()), "data: a\n\ndata: b\n\n");
        assert_eq!(text(next().await.ok().flatten()), "data: c\n\n");
        let frame = next().await.ok().flatten().expect("trailers");
        assert!(
            frame
                .trailers_ref()
                .is_some_and(|t| t.contains_key("x-done"))
        );
        // The error found while looking ahead comes after the data before it.
        assert_eq!(text(next().await.ok().flatten()), "data: late\n\n");
        assert!(matches!(next().await, Err(CallError::Unreachable(why)) if why.contains("reset")));
    }

    /// A body is known to have ended once a look ahead found its end: the data before
    /// it is the answer's last, handed back with the usage and the end; a pending body
    /// or trailers behind the data leave it open.
    #[tokio::test]
    async fn the_last_data_is_known_once_the_end_is_found_behind_it() {
        let cancel = Cancel::new();
        let mut watch = std::pin::pin!(watch_in(Duration::from_secs(60), &cancel));
        let script = [data("a"), data(""), data("b"), None];
        let mut body = Joined::new(Script(script.into_iter().collect()));
        assert!(!body.at_end());
        assert!(body.frame(watch.as_mut()).await.ok().flatten().is_some());
        assert!(!body.at_end(), "nothing was ready behind the first data");
        assert!(body.frame(watch.as_mut()).await.ok().flatten().is_some());
        assert!(body.at_end(), "the end was ready behind the last data");
        assert!(body.frame(watch.as_mut()).await.ok().flatten().is_none());
        let mut trailers = hyper::HeaderMap::new();
        trailers.insert("x-done", hyper::header::HeaderValue::from_static("1"));
        let script = [data("a"), Some(Ok(Frame::trailers(trailers))), None];
        let mut body = Joined::new(Script(script.into_iter().collect()));
        assert!(body.frame(watch.as_mut()).await.ok().flatten().is_some());
        assert!(!body.at_end(), "trailers follow the data");
    }

    /// Work that is always ready (a provider streaming faster than it is read) is taken
    /// without polling the cancel or the timer, and still ends at a cancel or the deadline.
    #[tokio::test(flavor = "current_thread")]
    async fn ready_work_still_meets_a_cancel_and_the_deadline() {
        let cancel = Cancel::new();
        let mut watch = std::pin::pin!(watch_in(Duration::from_secs(60), &cancel));
        for _ in 0..3 {
            assert!(matches!(
                watch.as_mut().run(std::future::ready(1)).await,
                Ok(1)
            ));
        }
        cancel.cancel();
        let mut polled = false;
        let work = std::future::poll_fn(|_| {
            polled = true;
            Poll::Ready(())
        });
        assert!(matches!(
            watch.as_mut().run(work).await,
            Err(CallError::Cancelled)
        ));
        assert!(!polled, "work ran after the cancel");

        // The deadline passes while the task waits elsewhere (as a body read that used up
        // its budget does); the next ready work is not taken.
        let cancel = Cancel::new();
        let mut watch = std::pin::pin!(watch_in(Duration::from_millis(30), &cancel));
        assert!(matches!(ready(watch.as_mut()).await, Ok(())));
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(matches!(
            ready(watch.as_mut()).await,
            Err(CallError::TimedOut)
        ));

        // Pending work waits for either, as before.
        let mut watch = std::pin::pin!(watch_in(Duration::from_millis(30), &cancel));
        let pending = std::future::pending::<()>();
        assert!(matches!(
            watch.as_mut().run(pending).await,
            Err(CallError::TimedOut)
        ));
        let mut watch = std::pin::pin!(watch_in(Duration::from_secs(60), &cancel));
        let canceller = cancel.clone();
        tokio::spawn(async move { canceller.cancel() });
        let pending = std::future::pending::<()>();
        assert!(matches!(
            watch.as_mut().run(pending).await,
            Err(CallError::Cancelled)
        ));
        // A watch made after the cancel ends at once, before any work.
        let mut watch = std::pin::pin!(watch_in(Duration::from_secs(60), &cancel));
        assert!(matches!(
            ready(watch.as_mut()).await,
            Err(CallError::Cancelled)
        ));
    }

    /// A watch due `after` from now, its timer new.
    fn watch_in(after: Duration, cancel: &Cancel) -> Watch {
        Watch::new(&Arc::default(), Instant::now() + after, cancel)
    }

    /// What `watch` makes of work that is ready at once.
    async fn ready(watch: Pin<&mut Watch>) -> Result<(), CallError> {
        watch.run(std::future::ready(())).await
    }

    /// A kept timer set for an earlier call's deadline fires early for this one: the call
    /// goes on, pending or ready, and ends at its own deadline.
    #[tokio::test(flavor = "current_thread")]
    async fn a_kept_timer_that_fires_early_does_not_end_the_call() {
        let timers = Arc::new(SleepPool::default());
        let start = Instant::now();
        {
            // Kept, registered, for 20 ms from now.
            let mut kept = timers.sleep_until(start + Duration::from_millis(20));
            let waker = std::task::Waker::noop();
            let _ = kept.as_mut().poll(&mut Context::from_waker(waker));
        }
        let cancel = Cancel::new();
        let mut watch = std::pin::pin!(Watch::new(
            &timers,
            start + Duration::from_millis(300),
            &cancel
        ));
        assert!(matches!(ready(watch.as_mut()).await, Ok(())));
        // Past the kept timer's instant: ready work is still taken.
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(matches!(ready(watch.as_mut()).await, Ok(())));
        // Pending work ends at the call's own deadline, not before.
        let pending = std::future::pending::<()>();
        assert!(matches!(
            watch.as_mut().run(pending).await,
            Err(CallError::TimedOut)
        ));
        assert!(start.elapsed() >= Duration::from_millis(300));

        // The same while waiting from the start: pending work over the early instant.
        {
            let _kept = timers.sleep_until(Instant::now() + Duration::from_millis(20));
        }
        let start = Instant::now();
        let mut watch = std::pin::pin!(Watch::new(
            &timers,
            start + Duration::from_millis(200),
            &cancel
        ));
        assert!(matches!(
            watch.as_mut().run(std::future::pending::<()>()).await,
            Err(CallError::TimedOut)
        ));
        assert!(start.elapsed() >= Duration::from_millis(200));
    }

    #[tokio::test]
    async fn joining_stops_past_the_limit() {
        let big = "x".repeat(JOIN_MAX / 2 + 1);
        let script = [data(&big), data(&big), data(&big), None];
        let mut body = Joined::new(Script(script.into_iter().collect()));
        let cancel = Cancel::new();
        let mut watch = std::pin::pin!(watch_in(Duration::from_secs(60), &cancel));
        let mut sizes = Vec::new();
        while let Some(frame) = body.frame(watch.as_mut()).await.ok().flatten() {
            sizes.push(frame.into_data().map_or(0, |d| d.len()));
        }
        assert_eq!(sizes, [2 * big.len(), big.len()]);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_cancelled_run_does_not_wait_for_a_conversion_slot() {
        // Every slot is taken by other large conversions: a run cancelled while it waits
        // for one ends at once, cancelled, and never calls the provider.
        let config = iop_proto_core::wire::AdapterConfig {
            base_url: "http://127.0.0.1:9".into(),
            ..Default::default()
        };
        let adapter = OpenAi::new(
            &config,
            http::client(None).expect("client"),
            Duration::from_secs(60),
            false,
        )
        .expect("adapter");
        let last = super::super::testing::cancelled_waiting_for_a_slot(|request, sink, cancel| {
            adapter.run(request, sink, cancel)
        })
        .await;
        assert!(matches!(last, Some(RunOutput::Cancelled)), "{last:?}");
    }

    #[test]
    fn fallback_merges_into_the_leading_system_message() {
        let fallback = |body: Value| -> Value {
            let text = body.to_string();
            let input = json::Object::parse(text.as_bytes()).expect("object");
            serde_json::from_slice(&text_tool_fallback(&input, &[("stream", "true")]))
                .expect("JSON")
        };
        let body = json!({
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "lookup"}}],
            "tool_choice": "auto"
        });
        let out = fallback(body);
        assert_eq!(out["stream"], true);
        assert!(out.get("tools").is_none() && out.get("tool_choice").is_none());
        let messages = out["messages"].as_array().expect("messages");
        assert_eq!(messages.len(), 2);
        let system = messages[0]["content"].as_str().expect("text");
        assert!(system.starts_with("Be brief.") && system.contains("lookup"));

        let out = fallback(json!({"messages": [{"role": "user", "content": "hi"}], "tools": []}));
        assert_eq!(out["messages"][0]["role"], "system");
        assert_eq!(out["messages"][1]["content"], "hi");
    }

    #[test]
    fn tool_call_fragments_merge_by_index() {
        let mut calls = ToolCalls::default();
        calls.merge(&[
            json!({"index": 0, "id": "c1", "function": {"name": "get", "arguments": "{\"a\""}}),
        ]);
        calls.merge(&[json!({"index": 0, "function": {"arguments": ": 1}"}})]);
        assert_eq!(
            calls.to_json(),
            json!([{"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"a\": 1}"}}])
        );
    }
}
