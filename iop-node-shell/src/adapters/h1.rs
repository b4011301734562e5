//! HTTP/1.1 with providers on the wire: a request head written, a response head parsed
//! with `httparse`, and the response body's framing (RFC 9112 §6.3) decoded over one
//! read buffer, so that body bytes leave as slices of what was read.
//!
//! hyper's client connection reserves 8 KiB to read into and 8 KiB for message heads when
//! it is made, and talks to its caller through a request channel and a body channel; in
//! a Node streaming thousands of responses that was most of what each stream held
//! (docs/benchmarks-history.md). Here a
//! connection is its socket and what was read from it and not yet taken; a read goes
//! into one 64 KiB buffer per thread and what it got is copied out, so a read takes all
//! the socket has however little the connection holds (a response arriving in bulk is
//! read straight into the connection's buffer instead), and the task that reads the body
//! is the one that reads the socket.
//!
//! Providers are not trusted: heads, chunk lines and trailers have size limits, a
//! `Content-Length` must be one number, and a response framed by both `Transfer-Encoding`
//! and `Content-Length` (or by the close of the connection) is read as the RFC says and
//! its connection is not reused.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};

use bytes::{Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, Version};
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};

use super::connector::ProviderStream;
use iop_http1::{self as http1, HeadError, HeadReader, MAX_RESPONSE_HEADERS, ResponseHead};
pub use iop_http1::{BodyError, Chunk, Decoded, Framing};

/// The largest response head (status line and headers) accepted.
pub const MAX_HEAD: usize = 64 << 10;
/// The most one read takes.
const READ_MAX: usize = 64 << 10;
/// The most body data of chunks already read that one body step joins.
const JOIN_DATA: usize = 64 << 10;
/// A connection's buffer that held more than this is let go once it is empty, so a
/// stream waiting for its next event keeps at most about twice this.
const KEEP_MAX: usize = 8 << 10;

thread_local! {
    /// What every provider connection of a thread reads into before the bytes it got are
    /// copied to the connection's own buffer (reused while its stream goes on, let go
    /// once empty if a burst grew it past [`KEEP_MAX`]).
    ///
    /// A buffer per connection that started small and grew with the traffic took several
    /// reads for a response that had arrived whole (docs/benchmarks-history.md, 2 December
    /// 21:40); one that started large would be held by every open stream while it waits
    /// for its next event.
    /// Copying a read's few hundred bytes costs less than a system call; a read that fills
    /// this buffer puts its connection in bulk mode ([`Conn::poll_read`]), where 64 KiB
    /// copies would add to every read's cost.
    static SCRATCH: std::cell::RefCell<Box<[u8]>> =
        std::cell::RefCell::new(vec![0; READ_MAX].into_boxed_slice());
}

/// How talking HTTP/1.1 to a provider failed.
#[derive(Debug, thiserror::Error)]
pub enum H1Error {
    /// The socket failed.
    #[error("provider connection failed: {0}")]
    Io(#[from] io::Error),
    /// The provider closed the connection before its response ended.
    #[error("provider closed the connection before the response ended")]
    Incomplete,
    /// The provider's response breaks HTTP/1.1.
    #[error("malformed response from the provider: {0}")]
    Malformed(String),
    /// The request cannot be written as HTTP/1.1 (nothing was sent).
    #[error("cannot send the request: {0}")]
    Request(#[from] http1::EncodeError),
}

fn malformed(what: impl Into<String>) -> H1Error {
    H1Error::Malformed(what.into())
}

impl From<BodyError> for H1Error {
    fn from(err: BodyError) -> Self {
        match err {
            BodyError::Incomplete => H1Error::Incomplete,
            BodyError::Malformed(what) => malformed(what),
        }
    }
}

/// A chunked body's trailer section as fields (the core checked that it parses; a field
/// the `http` types refuse is left out).
#[must_use]
pub fn trailer_fields(section: &[u8]) -> HeaderMap {
    let mut fields = [httparse::EMPTY_HEADER; 32];
    let mut trailers = HeaderMap::new();
    if let Ok(httparse::Status::Complete((_, fields))) =
        httparse::parse_headers(section, &mut fields)
    {
        for field in fields.iter() {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(field.name.as_bytes()),
                HeaderValue::from_bytes(field.value),
            ) {
                trailers.append(name, value);
            }
        }
    }
    trailers
}

/// A parsed response head.
#[derive(Debug)]
pub struct Head {
    /// Status, version and headers.
    pub response: Response<()>,
    /// How its body ends.
    pub framing: Framing,
    /// Whether the connection may carry another request once the body is read.
    pub keep_alive: bool,
}

/// Writes the head of `parts` for a body of `body_len` bytes into `out`, by the core's
/// rules (as a raw tunnel's head). The connection headers are this client's: the caller's
/// `Content-Length`, `Transfer-Encoding` and hop-by-hop fields are left out. A method or
/// target the core would not send is an error, and nothing is written.
pub fn encode_request(
    parts: &http::request::Parts,
    body_len: usize,
    out: &mut Vec<u8>,
) -> Result<(), http1::EncodeError> {
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    http1::encode_request_line(parts.method.as_str(), &[target], out)?;
    for (name, value) in &parts.headers {
        if !is_connection_field(name) {
            http1::encode_field(name.as_str().as_bytes(), value.as_bytes(), out);
        }
    }
    http1::finish_request_head(parts.method.as_str(), body_len as u64, out);
    Ok(())
}

fn is_connection_field(name: &HeaderName) -> bool {
    name == CONTENT_LENGTH
        || name == TRANSFER_ENCODING
        || name == CONNECTION
        || name == http::header::UPGRADE
        || name == http::header::TE
        || name == http::header::PROXY_AUTHORIZATION
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

/// A response head as read: its bytes, and where the core found its parts in them.
#[derive(Debug)]
pub struct RawHead {
    /// The head's bytes (interim 1xx answers before it included).
    pub bytes: Bytes,
    /// Status, fields and framing.
    pub parsed: ResponseHead,
}

impl RawHead {
    /// Each field's name and value, as sent.
    pub fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.parsed
            .fields
            .iter()
            .map(|(name, value)| (&self.bytes[name.clone()], &self.bytes[value.clone()]))
    }

    /// The value of the first field named `name` (case-insensitive).
    #[must_use]
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        self.fields()
            .find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }

    /// The head as `http` types (field values are slices of the bytes read, not copies).
    pub fn into_head(self) -> Result<Head, H1Error> {
        let bytes = &self.bytes;
        let mut headers = HeaderMap::with_capacity(self.parsed.fields.len());
        for (name, value) in &self.parsed.fields {
            let name = HeaderName::from_bytes(&bytes[name.clone()])
                .map_err(|_| malformed(format!("header name {:?}", &bytes[name.clone()])))?;
            let value = HeaderValue::from_maybe_shared(bytes.slice(value.clone()))
                .map_err(|_| malformed(format!("value of header {name}")))?;
            headers.append(name, value);
        }
        let mut response = Response::new(());
        *response.status_mut() = StatusCode::from_u16(self.parsed.status)
            .map_err(|_| malformed(format!("status {}", self.parsed.status)))?;
        *response.version_mut() = if self.parsed.http10 {
            Version::HTTP_10
        } else {
            Version::HTTP_11
        };
        *response.headers_mut() = headers;
        Ok(Head {
            response,
            framing: self.parsed.body,
            keep_alive: self.parsed.keep_alive,
        })
    }
}

/// The response head at the start of `buf` once it is whole, taken out of `buf`; `None`
/// while it is incomplete. The core's reader finds it (searching each byte once however
/// the head arrives), skips interim 1xx answers and frames the body.
fn next_raw_head(
    buf: &mut BytesMut,
    reader: &mut HeadReader,
    head_request: bool,
) -> Result<Option<RawHead>, H1Error> {
    let parsed = match reader.poll_response(buf, head_request) {
        Ok(Some(parsed)) => parsed,
        Ok(None) => return Ok(None),
        Err(HeadError::TooLarge) => {
            return Err(malformed(format!(
                "response head over {MAX_HEAD} bytes or {MAX_RESPONSE_HEADERS} fields"
            )));
        }
        Err(err) => return Err(malformed(err.to_string())),
    };
    reader.reset();
    let bytes = buf.split_to(parsed.len).freeze();
    Ok(Some(RawHead { bytes, parsed }))
}

/// [`next_raw_head`] as `http` types.
#[cfg(test)]
fn next_head(
    buf: &mut BytesMut,
    reader: &mut HeadReader,
    method: &http::Method,
) -> Result<Option<Head>, H1Error> {
    next_raw_head(buf, reader, method == http::Method::HEAD)?
        .map(RawHead::into_head)
        .transpose()
}

/// A connection to a provider: its socket and what was read from it and not yet taken.
#[derive(Debug)]
pub struct Conn {
    io: ProviderStream,
    buf: BytesMut,
    /// The last read took all it could: the response is arriving in bulk, and reads go
    /// straight into `buf`, without a copy, until one comes back short.
    bulk: bool,
    /// The most `buf` has held since it was new (`usize::MAX` once a bulk read reserved
    /// [`READ_MAX`] in it): its room is at most about twice that, and past [`KEEP_MAX`]
    /// it is let go once empty.
    peak: usize,
}

impl Conn {
    /// A new connection over `stream`.
    pub fn new(stream: ProviderStream) -> Self {
        Conn {
            io: stream,
            buf: BytesMut::new(),
            bulk: false,
            peak: 0,
        }
    }

    /// Writes a request: its head (with as much of the body as the caller joined to it),
    /// then the rest of the body.
    pub async fn write_request(&mut self, head: &[u8], rest: &[u8]) -> io::Result<()> {
        self.io.write_all(head).await?;
        if !rest.is_empty() {
            self.io.write_all(rest).await?;
        }
        self.io.flush().await
    }

    /// Reads until a whole response head is in, and parses it.
    pub async fn read_head(&mut self, head_request: bool) -> Result<RawHead, H1Error> {
        let mut reader = HeadReader::new(MAX_HEAD);
        loop {
            if let Some(head) = next_raw_head(&mut self.buf, &mut reader, head_request)? {
                return Ok(head);
            }
            let read = std::future::poll_fn(|cx| self.poll_read(cx)).await?;
            if read == 0 {
                return Err(H1Error::Incomplete);
            }
        }
    }

    /// Reads what the socket has into the buffer, up to 64 KiB (at least that much in bulk
    /// mode); `Ok(0)` at its end.
    pub fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        let read = if self.bulk {
            self.buf.reserve(READ_MAX);
            // Room for a bulk read is not kept while the stream waits afterwards.
            self.peak = usize::MAX;
            ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut self.io),
                cx,
                &mut self.buf
            ))?
        } else {
            ready!(SCRATCH.with_borrow_mut(|scratch| {
                let mut room = ReadBuf::new(scratch);
                ready!(Pin::new(&mut self.io).poll_read(cx, &mut room))?;
                let read = room.filled();
                if self.buf.is_empty() && self.peak > KEEP_MAX {
                    // Room a burst left behind is not held while the stream waits.
                    self.buf = BytesMut::new();
                    self.peak = 0;
                }
                // Once the slices taken from the buffer have left for the Edge, it is
                // reused in place: a stream's events are read without an allocation.
                self.buf.extend_from_slice(read);
                self.peak = self.peak.max(self.buf.len());
                Poll::Ready(Ok::<_, io::Error>(read.len()))
            }))?
        };
        self.bulk = read >= READ_MAX;
        Poll::Ready(Ok(read))
    }

    /// The body of the response whose head was read next. The chunks of a chunked body
    /// that one read brought in come out as one step, up to 64 KiB
    /// ([`Framing::decode_joined`]): an SSE stream sent a chunk per event and read in a
    /// burst is one body frame downstream, not one per event.
    pub fn decode(&mut self, framing: &mut Framing) -> Result<Option<Decoded>, H1Error> {
        Ok(framing.decode_joined(&mut self.buf, JOIN_DATA)?)
    }

    /// Whether an idle connection can take another request: nothing unread, and the
    /// provider has neither closed it nor sent anything since (a poll without a waker).
    pub fn reusable(&mut self) -> bool {
        if !self.buf.is_empty() {
            return false;
        }
        let mut cx = Context::from_waker(Waker::noop());
        let idle = matches!(self.poll_read(&mut cx), Poll::Pending) && self.buf.is_empty();
        // Idle, it keeps no buffer (what was read last may still be in use downstream).
        self.buf = BytesMut::new();
        self.bulk = false;
        self.peak = 0;
        idle
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Method;

    fn head(text: &str, method: &Method) -> Result<Option<Head>, H1Error> {
        next_head(
            &mut BytesMut::from(text),
            &mut HeadReader::new(MAX_HEAD),
            method,
        )
    }

    /// Every step of `body` decoded with `framing`, fed `step` bytes at a time.
    fn decode_all(framing: Framing, body: &[u8], step: usize) -> Result<Vec<Decoded>, H1Error> {
        let mut framing = framing;
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        let mut fed = 0;
        loop {
            match framing.decode(&mut buf)? {
                Some(Decoded::End) => {
                    out.push(Decoded::End);
                    return Ok(out);
                }
                Some(step) => out.push(step),
                None if fed < body.len() => {
                    let next = (fed + step).min(body.len());
                    buf.extend_from_slice(&body[fed..next]);
                    fed = next;
                }
                None => {
                    out.push(framing.at_eof()?);
                    return Ok(out);
                }
            }
        }
    }

    fn data_of(steps: &[Decoded]) -> Vec<u8> {
        steps
            .iter()
            .filter_map(|s| match s {
                Decoded::Data(d) => Some(d.to_vec()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    /// A connection to a socket the test writes into.
    async fn socket_pair() -> (Conn, tokio::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let stream = ProviderStream::Plain(hyper_util::rt::TokioIo::new(client.unwrap()));
        (Conn::new(stream), accepted.unwrap().0)
    }

    async fn read(conn: &mut Conn) -> usize {
        std::future::poll_fn(|cx| conn.poll_read(cx)).await.unwrap()
    }

    /// Waits until the socket holds at least `n` unread bytes, so that what one read
    /// takes does not depend on how the kernel paced the writer.
    async fn wait_queued(conn: &Conn, n: usize) {
        let ProviderStream::Plain(plain) = &conn.io else {
            panic!("the test socket is plain TCP");
        };
        let mut probe = vec![0; n];
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while plain.inner().peek(&mut probe).await.unwrap() < n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{n} bytes never queued"
            );
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    #[tokio::test]
    async fn a_read_takes_what_arrived_into_a_buffer_of_its_size_and_bulk_skips_the_copy() {
        let (mut conn, mut provider) = socket_pair().await;
        // 3,000 bytes that arrived together: one read, held in exactly 3,000 bytes (a
        // buffer that grew from 1 KiB took three reads and kept 4 KiB).
        provider.write_all(&[7; 3000]).await.unwrap();
        wait_queued(&conn, 3000).await;
        assert_eq!(read(&mut conn).await, 3000);
        assert!(!conn.bulk);
        assert_eq!(conn.buf.capacity(), 3000);
        let small = conn.buf.split().freeze();

        // More than one read can take, 64 KiB of it waiting before the first read: that
        // read fills the thread's buffer, and the reads after it go straight into the
        // connection's until one comes back short. (Written from a task of its own: the
        // socket buffers need not hold all of it.)
        let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let sent = big.clone();
        tokio::spawn(async move { provider.write_all(&sent).await });
        wait_queued(&conn, READ_MAX).await;
        let mut bulk_reads = 0;
        while read(&mut conn).await > 0 {
            bulk_reads += usize::from(conn.bulk);
        }
        assert!(bulk_reads > 0, "no read was in bulk");
        assert!(!conn.bulk, "the read at the end is short");
        assert!(
            conn.buf[..] == big[..],
            "the bytes arrive whole and in order"
        );
        assert_eq!(
            &small[..],
            &[7; 3000][..],
            "what was taken before is untouched"
        );
    }

    #[tokio::test]
    async fn a_streams_events_reuse_one_buffer_and_room_a_burst_left_is_let_go() {
        let (mut conn, mut provider) = socket_pair().await;
        let event = b"data: {\"choices\":[{\"delta\":{\"content\":\"word\"}}]}\n\n";
        let mut next = async |conn: &mut Conn, bytes: &[u8]| {
            provider.write_all(bytes).await.unwrap();
            wait_queued(conn, bytes.len()).await;
            assert_eq!(read(conn).await, bytes.len());
            conn.buf.split().freeze()
        };
        let first = next(&mut conn, event).await;
        let at = first.as_ptr();
        // Once each event has left (dropped here), the next is read into the same room.
        drop(first);
        for _ in 0..10 {
            let taken = next(&mut conn, event).await;
            assert_eq!(taken.as_ptr(), at, "an event took a buffer of its own");
            assert_eq!(&taken[..], &event[..]);
        }
        // While an event is still on its way, the next one cannot overwrite it.
        let held = next(&mut conn, event).await;
        let after = next(&mut conn, event).await;
        assert_eq!((&held[..], &after[..]), (&event[..], &event[..]));
        drop((held, after));
        // A burst grows the buffer past what a waiting stream keeps: once empty, it goes.
        let burst = next(&mut conn, &[1; 20 << 10]).await;
        drop(burst);
        let small = next(&mut conn, event).await;
        assert_eq!(&small[..], &event[..]);
        assert!(
            conn.buf.capacity() < KEEP_MAX,
            "{} bytes of room kept after a burst",
            conn.buf.capacity()
        );
    }

    #[test]
    fn a_request_head_carries_its_length_and_none_of_the_callers_connection_fields() {
        let request = http::Request::post("/v1/chat/completions?x=1")
            .header("host", "provider:8000")
            .header("authorization", "Bearer k")
            .header("content-length", "999")
            .header("transfer-encoding", "chunked")
            .header("connection", "upgrade")
            .body(())
            .unwrap();
        let (parts, ()) = request.into_parts();
        let mut out = Vec::new();
        encode_request(&parts, 12, &mut out).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: provider:8000\r\n\
             authorization: Bearer k\r\ncontent-length: 12\r\n\r\n"
        );
        let (parts, ()) = http::Request::get("/health").body(()).unwrap().into_parts();
        let mut out = Vec::new();
        encode_request(&parts, 0, &mut out).unwrap();
        assert_eq!(out, b"GET /health HTTP/1.1\r\n\r\n");
    }

    #[test]
    fn response_heads_are_parsed_after_interim_responses_and_framed_by_the_rfc() {
        let mut buf = BytesMut::from(
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-a: b\r\n\r\nhello",
        );
        let parsed = next_head(&mut buf, &mut HeadReader::new(MAX_HEAD), &Method::POST)
            .unwrap()
            .unwrap();
        assert_eq!(parsed.response.status(), 200);
        assert_eq!(parsed.response.headers()["x-a"], "b");
        assert_eq!(parsed.framing, Framing::Length(5));
        assert!(parsed.keep_alive);
        assert_eq!(&buf[..], b"hello", "the body stays in the buffer");

        // (head, request method, framing, connection reusable)
        let cases = [
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
                Method::POST,
                Framing::Chunked(Chunk::Size),
                true,
            ),
            // Both framings: chunked wins, the connection is not reused.
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n",
                Method::POST,
                Framing::Chunked(Chunk::Size),
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
                Method::POST,
                Framing::UntilClose,
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\n\r\n",
                Method::POST,
                Framing::UntilClose,
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\n",
                Method::HEAD,
                Framing::Empty,
                true,
            ),
            (
                "HTTP/1.1 204 No Content\r\n\r\n",
                Method::POST,
                Framing::Empty,
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 4\r\nconnection: close\r\n\r\n",
                Method::GET,
                Framing::Length(4),
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\ncontent-length: 4\r\n\r\n",
                Method::GET,
                Framing::Length(4),
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 4, 4\r\n\r\n",
                Method::GET,
                Framing::Length(4),
                true,
            ),
        ];
        for (text, method, framing, keep_alive) in cases {
            let parsed = head(text, &method).unwrap().unwrap();
            assert_eq!(
                (parsed.framing, parsed.keep_alive),
                (framing, keep_alive),
                "{text:?}"
            );
        }
        assert!(head("HTTP/1.1 200 OK\r\n", &Method::GET).unwrap().is_none());
    }

    #[test]
    fn bad_heads_are_typed_errors() {
        for text in [
            "HTTP/1.1 200 OK\r\ncontent-length: 4\r\ncontent-length: 5\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: +4\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999999\r\n\r\n",
            "HTTP/1.1 101 Switching Protocols\r\n\r\n",
            "SSH-2.0-OpenSSH\r\n\r\n",
            "HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
        ] {
            assert!(
                matches!(head(text, &Method::GET), Err(H1Error::Malformed(_))),
                "{text:?}"
            );
        }
        let huge = format!("HTTP/1.1 200 OK\r\nx: {}", "a".repeat(MAX_HEAD + 1));
        assert!(matches!(
            head(&huge, &Method::GET),
            Err(H1Error::Malformed(_))
        ));
    }

    #[test]
    fn a_chunked_body_decodes_the_same_however_it_is_split() {
        let body = b"5;ext=1\r\nhello\r\n1\r\n \r\nB\r\nSSE world!\n\r\n0\r\nx-usage: 7\r\n\r\n";
        for step in [1, 2, 3, 7, body.len()] {
            let steps = decode_all(Framing::Chunked(Chunk::Size), body, step).unwrap();
            assert_eq!(data_of(&steps), b"hello SSE world!\n", "step {step}");
            let trailers = steps.iter().find_map(|s| match s {
                Decoded::Trailers(t) => Some(t),
                _ => None,
            });
            assert_eq!(trailer_fields(trailers.unwrap())["x-usage"], "7");
            assert_eq!(steps.last(), Some(&Decoded::End));
        }
        let plain = decode_all(Framing::Chunked(Chunk::Size), b"3\r\nabc\r\n0\r\n\r\n", 4).unwrap();
        assert_eq!(data_of(&plain), b"abc");
        assert!(!plain.iter().any(|s| matches!(s, Decoded::Trailers(_))));
    }

    #[test]
    fn bad_chunked_bodies_are_typed_errors() {
        for body in [
            &b"zz\r\n"[..],
            b"-1\r\n",
            b"1234567890abcdef0\r\n",
            b"3\r\nabcd\r\n",
            b"3x\r\nabc\r\n",
        ] {
            assert!(
                matches!(
                    decode_all(Framing::Chunked(Chunk::Size), body, 64),
                    Err(H1Error::Malformed(_))
                ),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
        let long = vec![b'1'; iop_http1::MAX_CHUNK_LINE + 2];
        assert!(matches!(
            decode_all(Framing::Chunked(Chunk::Size), &long, 512),
            Err(H1Error::Malformed(_))
        ));
        // A close before the last chunk is not an end.
        assert!(matches!(
            decode_all(Framing::Chunked(Chunk::Size), b"3\r\nabc\r\n", 64),
            Err(H1Error::Incomplete)
        ));
    }

    proptest::proptest! {
        #[test]
        fn any_chunked_body_decodes_to_its_data_however_it_arrives(
            chunks in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 1..64), 0..8),
            extension in proptest::bool::ANY,
            step in 1usize..40,
        ) {
            let mut wire = Vec::new();
            for chunk in &chunks {
                wire.extend_from_slice(format!("{:X}", chunk.len()).as_bytes());
                if extension {
                    wire.extend_from_slice(b";name=value");
                }
                wire.extend_from_slice(b"\r\n");
                wire.extend_from_slice(chunk);
                wire.extend_from_slice(b"\r\n");
            }
            wire.extend_from_slice(b"0\r\n\r\n");
            let steps = decode_all(Framing::Chunked(Chunk::Size), &wire, step).unwrap();
            proptest::prop_assert_eq!(data_of(&steps), chunks.concat());
            proptest::prop_assert_eq!(steps.last(), Some(&Decoded::End));
        }

        #[test]
        fn arbitrary_bytes_are_a_body_or_an_error_never_a_panic(
            wire in proptest::collection::vec(proptest::num::u8::ANY, 0..256),
            step in 1usize..40,
        ) {
            let _ = decode_all(Framing::Chunked(Chunk::Size), &wire, step);
            let _ = next_head(&mut BytesMut::from(&wire[..]), &mut HeadReader::new(MAX_HEAD), &Method::GET);
            let _ = head_in_steps(&wire, step);
        }
    }

    /// `wire` fed to [`next_head`] `step` bytes at a time: the head, and how many bytes
    /// were fed when it came out.
    fn head_in_steps(wire: &[u8], step: usize) -> Result<Option<(Head, usize)>, H1Error> {
        let (mut buf, mut reader, mut fed) = (BytesMut::new(), HeadReader::new(MAX_HEAD), 0);
        while fed < wire.len() {
            let next = (fed + step).min(wire.len());
            buf.extend_from_slice(&wire[fed..next]);
            fed = next;
            if let Some(head) = next_head(&mut buf, &mut reader, &Method::POST)? {
                return Ok(Some((head, fed)));
            }
        }
        Ok(None)
    }

    #[test]
    fn a_head_arriving_in_pieces_is_found_at_its_blank_line() {
        let wire = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        for step in 1..wire.len() {
            let (head, fed) = head_in_steps(wire, step).unwrap().expect("a head");
            assert_eq!(head.response.status(), StatusCode::OK, "step {step}");
            assert_eq!(head.framing, Framing::Length(2));
            // Found in the read that completed the blank line, not later.
            assert!(
                fed - step < wire.len() - 2,
                "step {step}: found after {fed} bytes"
            );
        }
        // Bare LF line ends, split anywhere.
        let lf = b"HTTP/1.1 204 No Content\nx: y\n\n";
        for step in 1..lf.len() {
            let (head, _) = head_in_steps(lf, step).unwrap().expect("a head");
            assert_eq!(head.response.status(), StatusCode::NO_CONTENT);
        }
        // No blank line yet: nothing, and no error.
        assert!(
            head_in_steps(b"HTTP/1.1 200 OK\r\nx: y\r\n", 1)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn a_head_without_an_end_is_refused_past_the_limit() {
        let mut wire = b"HTTP/1.1 200 OK\r\n".to_vec();
        while wire.len() <= MAX_HEAD {
            wire.extend_from_slice(b"x-filler: 0123456789abcdef0123456789abcdef\r\n");
        }
        assert!(matches!(
            head_in_steps(&wire, 4096),
            Err(H1Error::Malformed(_))
        ));
    }

    #[test]
    fn length_and_close_delimited_bodies() {
        let steps = decode_all(Framing::Length(5), b"hello", 2).unwrap();
        assert_eq!(data_of(&steps), b"hello");
        assert!(matches!(
            decode_all(Framing::Length(9), b"hello", 2),
            Err(H1Error::Incomplete)
        ));
        let steps = decode_all(Framing::UntilClose, b"all of it", 4).unwrap();
        assert_eq!(data_of(&steps), b"all of it");
        assert_eq!(decode_all(Framing::Empty, b"", 1).unwrap(), [Decoded::End]);
    }
}
