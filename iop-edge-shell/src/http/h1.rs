//! Plaintext HTTP/1.1 connections, read and written by the Edge itself over the
//! [`iop_http1`] framing. What a connection speaks ([`http1::opening`]), every
//! framing decision (limits, smuggling refusals, keep-alive, chunking) and whether an
//! unread body still lets the connection carry the next request
//! ([`Framing::discard_buffered`]) are the core's; this module moves bytes and runs the
//! connection's one timer, armed from the configured limits: the header timeout for a new
//! connection's head, the idle timeout until a kept connection's next head starts, a fixed
//! stall limit for a response the client does not read. A connection that opens with the
//! HTTP/2 preface (h2c with prior knowledge) is handed to hyper with what was read of it;
//! TLS connections stay hyper's.
//!
//! hyper's HTTP/1 connection puts a channel and a task wake between its dispatcher and
//! the handler for the request body, a watchdog per connection beside it, and its own
//! head buffers: a large share of the Edge's instructions per small request
//! (docs/benchmarks-history.md).
//! Here a request is parsed where it was read, its body is a slice of the read buffer,
//! and the response (head and body, or each batch of ready chunks) leaves in one write
//! from the task that renders it.
//!
//! What a connection holds between requests is its socket: the read buffer is taken only
//! once input is waiting, and a response's write buffer is kept small.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{Method, Response, StatusCode, Uri};
use http_body::Body;
use iop_api::openai::ErrorType;
use iop_http1::{
    self as http1, BodyFraming, CHUNK_END, Framing, HeadError, HeadReader, LAST_CHUNK, Opening,
    RequestHead,
};
use iop_shell_common::deadline::Deadline;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tracing::debug;

use super::fields::{Fields, Req};
use super::{ResBody, State, error};
use crate::config::HttpSettings;

/// Smallest and largest read.
const READ_MIN: usize = 1 << 10;
const READ_MAX: usize = 64 << 10;
/// Bytes of response gathered into one write.
const WRITE_BATCH: usize = 64 << 10;
/// Longest request target a connection keeps for its next request ([`Conn::target`]).
const TARGET_KEPT: usize = 256;
/// Capacity a write buffer may keep between writes.
const WRITE_KEEP: usize = 4 << 10;
/// Unread request body a connection may discard to stay open after a response that did
/// not read it (only what has already arrived; a longer body closes the connection).
const DRAIN_MAX: u64 = 64 << 10;

/// Gives back what an emptied write buffer grew beyond [`WRITE_KEEP`], keeping that much:
/// the next response starts with room for a stream's events instead of growing into it
/// again from nothing (seven reallocations per 20-event SSE stream that arrived at once).
fn keep_room(out: &mut Vec<u8>) {
    if out.capacity() > WRITE_KEEP {
        *out = Vec::with_capacity(WRITE_KEEP);
    }
}

/// What the socket and the request body share while a handler runs: the read buffer and
/// the body's framing. The body and the connection are polled by the same task; the lock
/// is never contended, only needed because the handler's future must be `Send`.
#[derive(Debug)]
struct ReadSide {
    buf: BytesMut,
    /// The size of the next read: doubled after a read that filled the last one, back to
    /// the minimum after a small one.
    want: usize,
    body: Framing,
    /// Bytes of `100 Continue` written so far, while the client waits for it.
    continue_sent: Option<usize>,
    /// The client closed its side, or the socket failed.
    eof: bool,
}

impl ReadSide {
    fn new() -> Self {
        ReadSide {
            buf: BytesMut::new(),
            want: READ_MIN,
            body: Framing::Done,
            continue_sent: None,
            eof: false,
        }
    }

    /// Reads what the socket has; `Ready(Ok(0))` at its end.
    ///
    /// A read that did not fill the room it was given emptied the socket (epoll is
    /// edge-triggered), so the socket's readiness is cleared then, as tokio's own
    /// `poll_read` does: the next poll waits for the kernel's next event instead of
    /// finding out with a read that fails (one system call per request, the read that
    /// watches a kept-alive caller while its response is on the way). The clear goes
    /// through `try_io`, whose readiness snapshot is taken before the read, so an event
    /// that arrived after it is never lost.
    fn poll_read(&mut self, stream: &TcpStream, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        loop {
            ready!(stream.poll_read_ready(cx))?;
            if self.buf.capacity() - self.buf.len() < self.want {
                self.buf.reserve(self.want);
            }
            let room = self.buf.capacity() - self.buf.len();
            let mut outcome = None;
            let _ = stream.try_io(tokio::io::Interest::READABLE, || {
                match stream.try_read_buf(&mut self.buf) {
                    Ok(read) => {
                        outcome = Some(Ok(read));
                        if 0 < read && read < room {
                            // Drained: this clears the readiness seen before the read.
                            return Err(io::ErrorKind::WouldBlock.into());
                        }
                        Ok(())
                    }
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => Err(err),
                    Err(err) => {
                        outcome = Some(Err(err));
                        Ok(())
                    }
                }
            });
            match outcome {
                Some(Ok(read)) => {
                    self.want =
                        iop_shell_common::next_read_size(self.want, read, READ_MIN, READ_MAX);
                    if read == 0 {
                        self.eof = true;
                    }
                    return Poll::Ready(Ok(read));
                }
                Some(Err(err)) => {
                    self.eof = true;
                    return Poll::Ready(Err(err));
                }
                // Nothing to read after all: readiness is cleared, wait for the next.
                None => {}
            }
        }
    }

    /// Frees an emptied read buffer, so that a connection waiting on a response or for
    /// its next request holds none.
    fn release(&mut self) {
        if self.buf.is_empty() {
            self.buf = BytesMut::new();
            self.want = READ_MIN;
        }
    }
}

/// A plaintext connection: its socket and the read side it shares with request bodies.
struct Conn {
    stream: TcpStream,
    read: Mutex<ReadSide>,
    out: Vec<u8>,
    peer: SocketAddr,
    /// The connection's one deadline: a head's, the idle limit, a stalled write's.
    timer: Deadline,
    /// The last request target parsed, as written and as a `Uri` ([`Conn::target`]).
    last_target: Option<(Bytes, Uri)>,
}

fn lock(read: &Mutex<ReadSide>) -> MutexGuard<'_, ReadSide> {
    read.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How waiting for a request head ended without one.
enum NoHead {
    /// The client closed the connection or went quiet; nothing to answer.
    Gone,
    /// The head is refused: answer this and close.
    Refused(HeadError),
    /// The client speaks HTTP/2 with prior knowledge: hand the connection to hyper.
    H2,
    /// A successor took over: the connection moves there, with what was read of it.
    Move,
}

/// Serves a plaintext connection until the client closes it, a limit closes it, or a
/// response says so.
pub(super) async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    state: Arc<State>,
    settings: &HttpSettings,
) {
    serve_from(stream, peer, state, settings, None).await;
}

/// [`serve`] a connection that served requests in another Edge process, which read
/// `buffered` of it (see [`crate::upgrade`]).
pub(super) async fn serve_moved(
    stream: TcpStream,
    peer: SocketAddr,
    state: Arc<State>,
    settings: &HttpSettings,
    buffered: Bytes,
    fresh: bool,
) {
    serve_from(stream, peer, state, settings, Some((buffered, fresh))).await;
}

async fn serve_from(
    stream: TcpStream,
    peer: SocketAddr,
    state: Arc<State>,
    settings: &HttpSettings,
    moved: Option<(Bytes, bool)>,
) {
    let mut read = ReadSide::new();
    let first = moved.as_ref().is_none_or(|(_, fresh)| *fresh);
    if let Some((bytes, _)) = moved {
        read.buf.extend_from_slice(&bytes);
    }
    let mut conn = Conn {
        stream,
        read: Mutex::new(read),
        out: Vec::new(),
        peer,
        timer: Deadline::new(Instant::now() + settings.header_read_timeout),
        last_target: None,
    };
    let mut heads = HeadReader::new(settings.max_header_bytes);
    let mut first = first;
    // The connection's one wait for the drain to begin, looked at between its requests.
    let mut began = state.drain.wait();
    loop {
        let head = match conn
            .next_head(&mut heads, first, settings, &state.drain, &mut began)
            .await
        {
            Ok(head) => head,
            Err(NoHead::Gone) => return,
            Err(NoHead::Move) => {
                conn.move_on(&state, first);
                return;
            }
            Err(NoHead::Refused(refusal)) => {
                conn.refuse(refusal).await;
                return;
            }
            Err(NoHead::H2) => {
                let read = conn
                    .read
                    .into_inner()
                    .unwrap_or_else(PoisonError::into_inner);
                let prefix = read.buf.freeze();
                let io = Prefixed {
                    prefix,
                    stream: conn.stream,
                };
                super::serve_connection(io, peer, state, settings).await;
                return;
            }
        };
        // A successor took over while this head was read: the request is served there,
        // with its bytes (nothing of it was answered here).
        if state.drain.mover().is_some() && conn.movable() {
            conn.move_on(&state, first);
            return;
        }
        first = false;
        match conn.exchange(head, &state).await {
            // Also a response that began before the Edge started draining (or handing
            // over) ends its connection.
            Ok(true) if state.drain.mover().is_some() => {
                conn.move_on(&state, false);
                return;
            }
            Ok(true) if !state.drain.is_draining() => {}
            Ok(_) | Err(_) => return,
        }
    }
}

impl Conn {
    /// Waits for the next request head: on a new connection within the header timeout, on
    /// a kept one the idle timeout for its first byte and the header timeout from there.
    async fn next_head(
        &mut self,
        heads: &mut HeadReader,
        first: bool,
        settings: &HttpSettings,
        drain: &crate::drain::Drain,
        // A connection with no request begun closes when the Edge starts to drain.
        began: &mut crate::drain::DrainWait,
    ) -> Result<RequestHead, NoHead> {
        heads.reset();
        if !first && drain.mover().is_some() {
            return Err(NoHead::Move);
        }
        let mut started = first;
        if !first {
            let buffered = !lock(&self.read).buf.is_empty();
            let limit = if buffered {
                started = true;
                settings.header_read_timeout
            } else {
                settings.idle_timeout
            };
            self.timer.set(Instant::now() + limit);
        }
        loop {
            {
                let read = lock(&self.read);
                let opening = if first {
                    http1::opening(&read.buf)
                } else {
                    Opening::Http1
                };
                if opening == Opening::Http2 {
                    return Err(NoHead::H2);
                } else if opening == Opening::Undecided {
                    // Nothing yet, or a prefix of the HTTP/2 preface: read on.
                } else if !read.buf.is_empty() {
                    if let Some(head) = heads.poll(&read.buf).map_err(NoHead::Refused)? {
                        return Ok(head);
                    }
                } else if read.eof {
                    return Err(NoHead::Gone);
                }
                if read.eof {
                    // A head cut short by the client's close: nothing to answer it with.
                    debug!(peer = %self.peer, "http connection closed mid-head");
                    return Err(NoHead::Gone);
                }
            }
            let stream = &self.stream;
            let read = &self.read;
            let timer = &mut self.timer;
            let idle = lock(read).buf.is_empty();
            let outcome = std::future::poll_fn(|cx| {
                if let Poll::Ready(read) = lock(read).poll_read(stream, cx) {
                    return Poll::Ready(Some(read));
                }
                if (idle || drain.mover().is_some()) && began.poll_began(cx).is_ready() {
                    return Poll::Ready(None);
                }
                timer.poll_reached(cx).map(|()| None)
            })
            .await;
            match outcome {
                // A successor took over: the connection moves, with what was read.
                None if drain.mover().is_some() => return Err(NoHead::Move),
                None if idle && drain.is_draining() => {
                    debug!(peer = %self.peer, "closing an idle http connection: the edge is draining");
                    return Err(NoHead::Gone);
                }
                None => {
                    debug!(peer = %self.peer, "closing an http connection: no request in time");
                    return Err(NoHead::Gone);
                }
                Some(Err(err)) => {
                    debug!(peer = %self.peer, %err, "http connection read failed");
                    return Err(NoHead::Gone);
                }
                Some(Ok(_)) if !started => {
                    // The first byte of a head on a kept connection: the rest within the
                    // header timeout.
                    started = true;
                    self.timer
                        .set(Instant::now() + settings.header_read_timeout);
                }
                Some(Ok(_)) => {}
            }
        }
    }

    /// Whether [`Conn::move_on`] can move this connection: its client has not closed its
    /// side, and what was read of its next request fits a move.
    fn movable(&self) -> bool {
        let read = lock(&self.read);
        !read.eof && read.buf.len() <= crate::upgrade::MAX_MOVED_BYTES
    }

    /// Moves this connection, between requests, to the successor that took over (with
    /// the bytes of its next request read so far); closes it when it cannot move.
    fn move_on(self, state: &State, fresh: bool) {
        let Some(mover) = state.drain.mover() else {
            return;
        };
        if !self.movable() {
            return;
        }
        let read = self
            .read
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        let Ok(stream) = self.stream.into_std() else {
            return;
        };
        let moved = crate::upgrade::Moved {
            stream,
            peer: self.peer,
            buffered: read.buf.freeze(),
            fresh,
        };
        if mover.send(moved).is_err() {
            debug!(peer = %self.peer, "connection not moved: the successor went away");
        }
    }

    /// Answers a refused head and closes.
    async fn refuse(&mut self, refusal: HeadError) {
        debug!(peer = %self.peer, %refusal, "refusing an http request head");
        let status = StatusCode::from_u16(refusal.status()).unwrap_or(StatusCode::BAD_REQUEST);
        let code = match refusal {
            HeadError::TooLarge => "request_header_fields_too_large",
            HeadError::Malformed(_) => "bad_request",
            HeadError::UnsupportedCoding => "unsupported_transfer_coding",
        };
        let kind = if status.is_server_error() {
            ErrorType::Server
        } else {
            ErrorType::InvalidRequest
        };
        let response = error(status, &refusal.to_string(), kind, Some(code));
        let _ = self.respond(response, false, false, false).await;
    }

    /// One request and its response; whether the connection takes another.
    async fn exchange(&mut self, head: RequestHead, state: &Arc<State>) -> io::Result<bool> {
        let (bytes, keep_alive, http10) = {
            let mut read = lock(&self.read);
            let bytes = read.buf.split_to(head.len).freeze();
            read.body = head.body.clone();
            // Owed only while there is a body to ask for.
            read.continue_sent = (head.expect_continue && !head.body.is_done()).then_some(0);
            (bytes, head.keep_alive, head.http10)
        };
        let request = match self
            .target(&bytes, head.target.clone())
            .and_then(|uri| request(head, bytes, uri, H1Body { conn: self }))
        {
            Ok(request) => request,
            Err(refusal) => {
                self.refuse(refusal).await;
                return Ok(false);
            }
        };
        let head_request = request.method() == Method::HEAD;
        let response = self.handle(request, state).await;
        let Some(response) = response else {
            // The client left while its request was being handled.
            return Ok(false);
        };
        // A body the handler left unread keeps the connection only if it is all here.
        let body_read = {
            let mut read = lock(&self.read);
            read.continue_sent = None;
            let ReadSide { buf, body, .. } = &mut *read;
            let done = body.is_done() || body.discard_buffered(buf, DRAIN_MAX);
            read.release();
            done
        };
        // A draining Edge says so in the response: the caller takes its next request
        // elsewhere.
        let keep_alive = keep_alive && body_read && !state.drain.is_draining();
        self.respond(response, head_request, http10, keep_alive)
            .await
    }

    /// The request target (at `at` in `head`) as a `Uri`. A kept connection mostly asks
    /// for one endpoint again and again: the same bytes as the last target's give the
    /// last `Uri` again (a parse of the same bytes, made once), where a parse validated
    /// every byte of the path anew. The target kept is a copy of at most [`TARGET_KEPT`]
    /// bytes, so it holds no request head's buffer while the connection waits; a longer
    /// one is parsed where it lies, as every target was.
    fn target(&mut self, head: &Bytes, at: std::ops::Range<usize>) -> Result<Uri, HeadError> {
        let written = &head[at.clone()];
        if let Some((last, uri)) = &self.last_target
            && last[..] == *written
        {
            return Ok(uri.clone());
        }
        let invalid = || HeadError::Malformed("invalid request target");
        if written.len() > TARGET_KEPT {
            // Not kept: parsed where it lies in the head, as before.
            return Uri::from_maybe_shared(head.slice(at)).map_err(|_| invalid());
        }
        let copy = Bytes::copy_from_slice(written);
        let uri = Uri::from_maybe_shared(copy.clone()).map_err(|_| invalid())?;
        self.last_target = Some((copy, uri.clone()));
        Ok(uri)
    }

    /// Runs the handler; `None` when the client closes the connection first (once the
    /// request body is in, a read that finds the end of the stream means the caller left,
    /// and dropping the handler cancels its request).
    async fn handle(
        &self,
        request: Req<H1Body<'_>>,
        state: &Arc<State>,
    ) -> Option<Response<ResBody>> {
        let mut handler = std::pin::pin!(super::route(request, state.clone(), self.peer));
        let mut watching = true;
        std::future::poll_fn(|cx| {
            if let Poll::Ready(response) = handler.as_mut().poll(cx) {
                return Poll::Ready(Some(response));
            }
            if watching && !watch(&self.stream, &self.read, cx, &mut watching) {
                return Poll::Ready(None);
            }
            Poll::Pending
        })
        .await
    }

    /// Writes `response`; whether the connection takes another request.
    async fn respond(
        &mut self,
        response: Response<ResBody>,
        head_request: bool,
        http10: bool,
        keep_alive: bool,
    ) -> io::Result<bool> {
        let (parts, mut body) = response.into_parts();
        let status = parts.status;
        let len = match &body {
            ResBody::Full(data) | ResBody::Done { body: data, .. } => {
                Some(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            ResBody::Live(_) | ResBody::Events(_) => None,
        };
        let framing =
            http1::response_framing(status.as_u16(), head_request, len, http10, keep_alive);
        let mut out = std::mem::take(&mut self.out);
        out.clear();
        http1::encode_response_head(
            status.as_u16(),
            status.canonical_reason().unwrap_or(""),
            parts
                .headers
                .iter()
                .map(|(name, value)| (name.as_str().as_bytes(), value.as_bytes())),
            date().as_ref().map(|d| &d[..]),
            framing,
            &mut out,
        );
        let result = match (&mut body, framing.body) {
            (_, BodyFraming::None) => self.write_all(&out, &[]).await.map(|()| true),
            (ResBody::Full(data) | ResBody::Done { body: data, .. }, _) => {
                let data = data.take().unwrap_or_default();
                if data.len() <= WRITE_KEEP {
                    // Head and body in one write.
                    out.extend_from_slice(&data);
                    self.write_all(&out, &[]).await.map(|()| true)
                } else {
                    self.write_all(&out, &data).await.map(|()| true)
                }
            }
            (_, body_framing) => {
                self.stream_body(&mut body, body_framing == BodyFraming::Chunked, &mut out)
                    .await
            }
        };
        // The body (and with it the request's state) goes before the connection waits.
        drop(body);
        out.clear();
        keep_room(&mut out);
        self.out = out;
        Ok(result? && framing.keep_alive)
    }

    /// Writes a body as it is produced, each batch of frames that are ready in one write
    /// (`out` holds the response head first); whether it ended as it should (`false`: it
    /// failed or the client left: close the connection).
    async fn stream_body(
        &mut self,
        body: &mut ResBody,
        chunked: bool,
        out: &mut Vec<u8>,
    ) -> io::Result<bool> {
        let mut body = Pin::new(body);
        let mut watching = true;
        loop {
            let step = std::future::poll_fn(|cx| {
                loop {
                    if out.len() >= WRITE_BATCH {
                        return Poll::Ready(Step::Write);
                    }
                    match body.as_mut().poll_frame(cx) {
                        Poll::Ready(Some(Ok(frame))) => {
                            if let Ok(data) = frame.into_data()
                                && !data.is_empty()
                            {
                                if chunked {
                                    http1::encode_chunk_start(data.len(), out);
                                    out.extend_from_slice(&data);
                                    out.extend_from_slice(CHUNK_END);
                                } else {
                                    out.extend_from_slice(&data);
                                }
                            }
                        }
                        Poll::Ready(Some(Err(err))) => {
                            debug!(peer = %self.peer, %err, "response body failed: closing the connection");
                            return Poll::Ready(Step::Failed);
                        }
                        Poll::Ready(None) => {
                            if chunked {
                                out.extend_from_slice(LAST_CHUNK);
                            }
                            return Poll::Ready(Step::Ended);
                        }
                        Poll::Pending if !out.is_empty() => return Poll::Ready(Step::Write),
                        Poll::Pending => {
                            // Nothing to write: watch the client meanwhile.
                            if watching && !watch(&self.stream, &self.read, cx, &mut watching) {
                                return Poll::Ready(Step::Gone);
                            }
                            return Poll::Pending;
                        }
                    }
                }
            })
            .await;
            if step == Step::Gone {
                debug!(peer = %self.peer, "the client left during a response");
                return Ok(false);
            }
            // What was gathered goes out, also before a failure closes the connection.
            self.write_all(out, &[]).await?;
            out.clear();
            keep_room(out);
            match step {
                Step::Ended => return Ok(true),
                Step::Failed | Step::Gone => return Ok(false),
                Step::Write => tokio::task::consume_budget().await,
            }
        }
    }

    /// Writes `head` then `rest`; a write that makes no progress for [`STALL`] fails (a
    /// client that stopped reading).
    async fn write_all(&mut self, head: &[u8], rest: &[u8]) -> io::Result<()> {
        for part in [head, rest] {
            let mut at = 0;
            while at < part.len() {
                match self.stream.try_write(&part[at..]) {
                    Ok(n) => at += n,
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                        self.wait_writable().await?;
                    }
                    Err(err) => return Err(err),
                }
            }
        }
        Ok(())
    }

    /// Waits until the socket takes more; only a blocked write arms the timer, so a client
    /// that reads costs none.
    async fn wait_writable(&mut self) -> io::Result<()> {
        self.timer.set(Instant::now() + STALL);
        let stream = &self.stream;
        let timer = &mut self.timer;
        std::future::poll_fn(|cx| {
            if let Poll::Ready(ready) = stream.poll_write_ready(cx) {
                return Poll::Ready(ready);
            }
            timer.poll_reached(cx).map(|()| {
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client stopped reading",
                ))
            })
        })
        .await
    }
}

/// How long a response write may make no progress before the connection is closed.
const STALL: Duration = Duration::from_secs(60);

/// What one gathering of a streamed body ended with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// A batch is ready to write; more may follow.
    Write,
    /// The body ended (its last bytes are in the batch).
    Ended,
    /// The body failed: what came before it is written, then the connection closes.
    Failed,
    /// The client closed the connection.
    Gone,
}

/// Watches the socket while a request's body is in and its answer is pending or being
/// streamed: reads what comes (a pipelined request, kept up to [`READ_MAX`]) and tells
/// whether the client is still there. Past that much it stops watching (`watching` turns
/// false), so a client that sends too much is held back by TCP, not buffered for.
fn watch(
    stream: &TcpStream,
    read: &Mutex<ReadSide>,
    cx: &mut Context<'_>,
    watching: &mut bool,
) -> bool {
    let mut read = lock(read);
    if !read.body.is_done() || read.continue_sent.is_some() {
        // The handler is reading the body (or has yet to ask for it): its reads notice a
        // close.
        return true;
    }
    loop {
        if read.eof {
            return false;
        }
        if read.buf.len() >= READ_MAX {
            *watching = false;
            return true;
        }
        match read.poll_read(stream, cx) {
            Poll::Pending => return true,
            Poll::Ready(Ok(0) | Err(_)) => return false,
            Poll::Ready(Ok(_)) => {}
        }
    }
}

/// The request the handlers see: its method and target as `http` types, its fields where
/// they lie in the head as read ([`Fields::Head`]: no map is built, nothing is copied),
/// and its body.
fn request(
    head: RequestHead,
    bytes: Bytes,
    uri: Uri,
    body: H1Body<'_>,
) -> Result<Req<H1Body<'_>>, HeadError> {
    let method = Method::from_bytes(&bytes[head.method.clone()])
        .map_err(|_| HeadError::Malformed("invalid method"))?;
    // The fields stay where they lie in the head: the reader admits only token names and
    // field values, what `http::HeaderName` and `http::HeaderValue` accept.
    let fields = Fields::Head {
        bytes,
        fields: head.fields,
    };
    Ok(Req::new(method, uri, fields, body))
}

/// A request body read from the connection as the handler asks for it: slices of the
/// read buffer, framed by the core's decoder. `100 Continue` goes out before the first
/// read when the client asked for it.
pub(crate) struct H1Body<'c> {
    conn: &'c Conn,
}

mod body;
use body::{Prefixed, date};

#[cfg(test)]
mod tests;
