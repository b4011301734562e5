//! The fake provider every path of the benchmark calls: a small answer, an SSE stream, or paced chunks.

#[allow(unused_imports)]
use crate::*;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;

// ----- the fake provider -----

pub(crate) fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

pub(crate) fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The number after `key` in `body`, if any.
pub(crate) fn number_after(body: &[u8], key: &[u8]) -> Option<u64> {
    let at = find(body, key)? + key.len();
    let digits: Vec<u8> = body[at..]
        .iter()
        .copied()
        .take_while(u8::is_ascii_digit)
        .collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}

/// A provider response body: whole, or SSE events yielded one frame at a time (paced
/// ones stamped with their send time in `"t_us"`).
pub(crate) enum ProviderBody {
    Whole(Option<Bytes>),
    Sse {
        next: usize,
        total: usize,
        pace: Option<Duration>,
        sleep: Option<Pin<Box<tokio::time::Sleep>>>,
        /// Unpaced: whether this event already yielded once, so hyper flushes each
        /// event on its own as a provider generating tokens does.
        yielded: bool,
        /// Unpaced, under `IOP_BENCH_SSE_BURST`: never yield, so hyper writes the
        /// stream's events together, as a provider that had them all at once would.
        burst: bool,
    },
}

pub(crate) fn sse_event(i: usize, total: usize) -> Bytes {
    let stamp = now_us();
    let text = if i + 1 == total {
        "data: [DONE]\n\n".to_owned()
    } else if i == 0 {
        format!(
            "data: {{\"id\":\"chatcmpl-b\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"fake\",\"t_us\":{stamp},\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"finish_reason\":null}}]}}\n\n"
        )
    } else if i + 3 == total {
        format!(
            "data: {{\"id\":\"chatcmpl-b\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"fake\",\"t_us\":{stamp},\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"stop\"}}]}}\n\n"
        )
    } else if i + 2 == total {
        format!(
            "data: {{\"id\":\"chatcmpl-b\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"fake\",\"t_us\":{stamp},\"choices\":[],\"usage\":{{\"prompt_tokens\":5,\"completion_tokens\":{WORDS},\"total_tokens\":{}}}}}\n\n",
            WORDS + 5
        )
    } else {
        format!(
            "data: {{\"id\":\"chatcmpl-b\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"fake\",\"t_us\":{stamp},\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"word{i} \"}},\"finish_reason\":null}}]}}\n\n"
        )
    };
    Bytes::from(text)
}

impl Body for ProviderBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match &mut *self {
            ProviderBody::Whole(data) => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            ProviderBody::Sse {
                next,
                total,
                pace,
                sleep,
                yielded,
                burst,
            } => {
                if *next >= *total {
                    return Poll::Ready(None);
                }
                if let Some(pace) = pace {
                    let timer = sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(*pace)));
                    if timer.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    *sleep = None;
                } else if *next > 0 && !*yielded && !*burst {
                    *yielded = true;
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                *yielded = false;
                let event = sse_event(*next, *total);
                *next += 1;
                Poll::Ready(Some(Ok(Frame::data(event))))
            }
        }
    }
}

pub(crate) async fn provide(req: Request<Incoming>) -> Result<Response<ProviderBody>, Infallible> {
    let body = req
        .into_body()
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
        .unwrap_or_default();
    if find(&body, b"\"stream\":true").is_none() {
        let words: Vec<String> = (0..WORDS).map(|i| format!("word{i}")).collect();
        let json = format!(
            "{{\"id\":\"chatcmpl-b\",\"object\":\"chat.completion\",\"created\":1,\"model\":\"fake\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{}\"}},\"finish_reason\":\"stop\"}}],\"usage\":{{\"prompt_tokens\":5,\"completion_tokens\":{WORDS},\"total_tokens\":{}}}}}",
            words.join(" "),
            WORDS + 5
        );
        let mut response = Response::new(ProviderBody::Whole(Some(Bytes::from(json))));
        response.headers_mut().insert(
            "content-type",
            http::HeaderValue::from_static("application/json"),
        );
        return Ok(response);
    }
    let pace = number_after(&body, b"\"pace_ms\":").map(Duration::from_millis);
    let total = match pace {
        Some(_) => PACED_CHUNKS,
        None => SSE_EVENTS,
    };
    let mut response = Response::new(ProviderBody::Sse {
        next: 0,
        total,
        pace,
        sleep: None,
        yielded: false,
        burst: *SSE_BURST,
    });
    response.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("text/event-stream"),
    );
    Ok(response)
}

/// `IOP_BENCH_SSE_BURST`, read once: the provider writes an unpaced stream's events
/// together instead of one by one (a diagnostic; the harness's figures use the default).
static SSE_BURST: std::sync::LazyLock<bool> =
    std::sync::LazyLock::new(|| std::env::var_os("IOP_BENCH_SSE_BURST").is_some());

pub(crate) fn run_provider(port: u16) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("provider bind");
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service_fn(provide))
                    .await;
            });
        }
    });
}
