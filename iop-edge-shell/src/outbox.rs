//! A node connection's outgoing bytes.
//!
//! The core's frames are queued here, in order, while the core's lock is held; once the
//! lock is released the task that produced them kicks the connection's writer task
//! ([`Outbox::kick`]), which writes everything queued when it next runs. On the
//! single-threaded runtime (the Edge's on up to three CPUs) the writer is woken onto the
//! back of the runtime's queue, so it runs after the tasks that were ready with it: the
//! requests that one read of the callers' sockets made ready each queue their frame, and
//! all of them leave in one vectored write. (tokio's multi-threaded runtime runs a task
//! woken by the running one next, so there most passes are one request.) Under
//! concurrent callers that is a fraction of a write per request instead of one `sendto`
//! each, and less CPU for the Edge and the Node together (the node reads fewer, fuller
//! segments), for a request alone about a microsecond more wait. Where the Edge and the
//! Node run on CPUs of their own, a frame waiting for the rest of its pass is latency the
//! node could have used. Writing the first frame of a pass at once and leaving only the
//! later ones to the writer cost more CPU than it saved (the writer woke twice per pass).
//! The figures of each variant: docs/benchmarks-history.md.
//!
//! Only the writer touches the socket. When the socket does not take everything (the
//! node reads slowly, a TLS record is half written) the writer waits for it, and kicks
//! leave it alone until it has drained the queue (its waker is the one registered with
//! the socket); a node that stops reading still gets its bytes in order.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Buf, Bytes};
use tokio::io::AsyncWrite;
use tokio::time::Instant;

/// The write half of a node connection, plaintext or TLS.
pub type Sink = Pin<Box<dyn AsyncWrite + Send>>;

/// How many queued buffers one vectored write hands the socket.
const MAX_SLICES: usize = 64;

/// Room for queued buffers an outbox keeps once it has drained a larger backlog.
const KEEP_SLOTS: usize = 16;

/// How long a closed outbox's writer keeps trying (see `Outbox::linger`).
const LINGER: Duration = Duration::from_secs(10);

/// A node connection's outgoing bytes; shared by the core (which queues), the tasks that
/// kick it, and the connection's writer task.
#[derive(Debug)]
pub struct Outbox {
    state: Mutex<State>,
    /// How long the writer keeps trying to write what is queued after [`Outbox::close`]
    /// before it drops the socket: a node that stopped reading must not hold it forever.
    linger: Duration,
}

impl Default for Outbox {
    fn default() -> Self {
        Self::new()
    }
}

struct State {
    queue: VecDeque<Bytes>,
    /// Bytes in `queue`.
    queued: usize,
    /// The socket's write half, once the connection's handshake is done.
    sink: Option<Sink>,
    /// The writer task is waiting for the socket (its waker is registered there), so
    /// kicks need not wake it.
    parked: bool,
    /// No more frames: the writer drains the queue, shuts the socket down and ends.
    closed: bool,
    /// A write failed: the connection is dead, frames are dropped.
    failed: bool,
    /// The writer task's waker, for kicks and for [`Outbox::close`].
    writer: Option<Waker>,
    /// When a write last made progress (or the connection opened).
    progress: Instant,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("queued", &self.queued)
            .field("parked", &self.parked)
            .field("closed", &self.closed)
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl Outbox {
    /// An outbox with no socket yet (frames queue until [`Outbox::run`] is given one).
    #[must_use]
    pub fn new() -> Self {
        Self::with_linger(LINGER)
    }

    /// An outbox whose writer gives up `linger` after [`Outbox::close`] if the socket has
    /// not taken everything by then.
    fn with_linger(linger: Duration) -> Self {
        Self {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                queued: 0,
                sink: None,
                parked: false,
                closed: false,
                failed: false,
                writer: None,
                progress: Instant::now(),
            }),
            linger,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind; keep going with it.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queues `bytes` behind everything queued before; returns the bytes now queued. Call
    /// [`Outbox::kick`] once the core's lock is released.
    pub fn push(&self, bytes: Bytes) -> usize {
        let mut s = self.lock();
        if s.failed || s.closed || bytes.is_empty() {
            return s.queued;
        }
        s.queued += bytes.len();
        s.queue.push_back(bytes);
        s.queued
    }

    /// Wakes the writer task to write what is queued, unless it already waits for the
    /// socket to take more (the socket wakes it then).
    pub fn kick(&self) {
        let s = self.lock();
        if s.parked || s.failed || s.queue.is_empty() {
            return;
        }
        if let Some(writer) = &s.writer {
            writer.wake_by_ref();
        }
    }

    /// No more frames: the writer task writes what is queued, shuts the socket down and
    /// ends.
    pub fn close(&self) {
        let mut s = self.lock();
        s.closed = true;
        if let Some(writer) = s.writer.take() {
            writer.wake();
        }
    }

    /// Whether writes have made no progress for `after` (the node stopped reading).
    #[must_use]
    pub fn stalled(&self, after: Duration) -> bool {
        self.lock().progress.elapsed() >= after
    }

    /// The connection's writer task: owns `sink`, writes what is queued whenever it is
    /// kicked or the socket takes more, and shuts it down after [`Outbox::close`].
    pub async fn run(self: Arc<Self>, sink: Sink) {
        self.lock().sink = Some(sink);
        let mut linger: Option<Pin<Box<tokio::time::Sleep>>> = None;
        poll_fn(|cx| {
            let mut s = self.lock();
            if !s.writer.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                s.writer = Some(cx.waker().clone());
            }
            if s.failed {
                return Poll::Ready(());
            }
            if s.closed {
                let deadline =
                    linger.get_or_insert_with(|| Box::pin(tokio::time::sleep(self.linger)));
                if deadline.as_mut().poll(cx).is_ready() {
                    // Closed, and the node still has not taken what was queued.
                    s.fail();
                    return Poll::Ready(());
                }
            }
            match s.write(cx) {
                Poll::Pending => {
                    s.parked = true;
                    return Poll::Pending;
                }
                Poll::Ready(Err(_)) => {
                    s.fail();
                    return Poll::Ready(());
                }
                Poll::Ready(Ok(())) => s.parked = false,
            }
            if !s.closed {
                return Poll::Pending;
            }
            // Everything is written and nothing more comes: close the write side.
            s.parked = true;
            let Some(sink) = s.sink.as_mut() else {
                return Poll::Ready(());
            };
            match sink.as_mut().poll_shutdown(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(_) => {
                    s.sink = None;
                    Poll::Ready(())
                }
            }
        })
        .await;
    }
}

impl State {
    /// Writes the queue, front first, then flushes; `Ready(Ok)` once all of it is out.
    fn write(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Some(sink) = self.sink.as_mut() else {
            return Poll::Ready(Ok(()));
        };
        while !self.queue.is_empty() {
            let written = if self.queue.len() == 1 || !sink.is_write_vectored() {
                ready(sink.as_mut().poll_write(cx, &self.queue[0]))?
            } else {
                let mut slices = [IoSlice::new(&[]); MAX_SLICES];
                let n = self.queue.len().min(MAX_SLICES);
                for (slice, bytes) in slices.iter_mut().zip(&self.queue) {
                    *slice = IoSlice::new(bytes);
                }
                ready(sink.as_mut().poll_write_vectored(cx, &slices[..n]))?
            };
            let Some(written) = written else {
                return Poll::Pending;
            };
            if written == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.queued -= written;
            self.progress = Instant::now();
            let mut left = written;
            while left > 0 {
                let front = &mut self.queue[0];
                if front.len() <= left {
                    left -= front.len();
                    self.queue.pop_front();
                } else {
                    front.advance(left);
                    left = 0;
                }
            }
        }
        // A backlog (a node that read slowly for a while) does not keep its room.
        if self.queue.capacity() > KEEP_SLOTS {
            self.queue.shrink_to(KEEP_SLOTS);
        }
        // A TLS session may hold records the socket did not take yet.
        sink.as_mut().poll_flush(cx)
    }

    fn fail(&mut self) {
        self.failed = true;
        self.queue.clear();
        self.queued = 0;
        self.sink = None;
        if let Some(writer) = self.writer.take() {
            writer.wake();
        }
    }
}

/// `Pending` as `Ok(None)`, so the caller can return it after `?`.
fn ready(poll: Poll<io::Result<usize>>) -> io::Result<Option<usize>> {
    match poll {
        Poll::Ready(result) => result.map(Some),
        Poll::Pending => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    fn bytes(n: usize, tag: u8) -> Bytes {
        Bytes::from(vec![tag; n])
    }

    /// An outbox whose writer task runs on `sink` (and has been polled once).
    async fn writing(
        sink: impl AsyncWrite + Send + 'static,
        linger: Duration,
    ) -> (Arc<Outbox>, tokio::task::JoinHandle<()>) {
        let outbox = Arc::new(Outbox::with_linger(linger));
        let writer = tokio::spawn(outbox.clone().run(Box::pin(sink)));
        tokio::task::yield_now().await;
        (outbox, writer)
    }

    #[tokio::test]
    async fn a_kick_has_the_writer_write_and_it_shuts_down_after_close() {
        let (near, mut far) = tokio::io::duplex(1 << 16);
        let (outbox, writer) = writing(near, LINGER).await;
        outbox.push(bytes(3, 1));
        outbox.push(bytes(2, 2));
        outbox.kick();
        let mut got = [0u8; 5];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(got, [1, 1, 1, 2, 2]);
        outbox.close();
        writer.await.unwrap();
        assert_eq!(
            far.read(&mut got).await.unwrap(),
            0,
            "the write side is shut"
        );
    }

    #[tokio::test]
    async fn a_full_socket_keeps_the_rest_for_the_writer_in_order() {
        // A pipe of 1 KiB: most of 80 KiB of frames wait for the reader.
        let (near, mut far) = tokio::io::duplex(1 << 10);
        let (outbox, writer) = writing(near, LINGER).await;
        let mut sent = Vec::new();
        for i in 0..200u8 {
            let frame = bytes(300 + usize::from(i), i);
            sent.extend_from_slice(&frame);
            outbox.push(frame);
            outbox.kick();
        }
        tokio::task::yield_now().await;
        assert!(outbox.lock().queued > 0, "the pipe could not take it all");
        outbox.close();
        let mut got = Vec::new();
        far.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, sent);
        writer.await.unwrap();
        let s = outbox.lock();
        assert_eq!(s.queued, 0);
        assert!(
            s.queue.capacity() <= KEEP_SLOTS,
            "the backlog's room is given back"
        );
    }

    #[tokio::test]
    async fn vectored_writes_to_a_tcp_socket_keep_every_byte_in_order() {
        // A TCP socket takes many queued frames in one `writev`; a peer that reads late
        // leaves part of 8 MiB for the writer task.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let near = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut far, _) = listener.accept().await.unwrap();
        let (_read, write) = near.into_split();
        assert!(write.is_write_vectored());
        let (outbox, writer) = writing(write, LINGER).await;
        let mut sent = Vec::new();
        for i in 0..4096u32 {
            let frame = Bytes::from(vec![(i % 251) as u8; 1 + (i as usize * 7) % 4000]);
            sent.extend_from_slice(&frame);
            outbox.push(frame);
            if i % 3 == 0 {
                outbox.kick();
            }
        }
        outbox.kick();
        outbox.close();
        let mut got = Vec::new();
        far.read_to_end(&mut got).await.unwrap();
        assert_eq!(got.len(), sent.len());
        assert!(got == sent, "the bytes arrive as queued");
        writer.await.unwrap();
    }

    #[tokio::test]
    async fn frames_queued_before_the_socket_are_written_when_it_comes() {
        let (near, mut far) = tokio::io::duplex(1 << 10);
        let outbox = Arc::new(Outbox::new());
        outbox.push(bytes(4, 7));
        outbox.kick();
        let writer = tokio::spawn(outbox.clone().run(Box::pin(near)));
        let mut got = [0u8; 4];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(got, [7; 4]);
        outbox.close();
        writer.await.unwrap();
    }

    #[tokio::test]
    async fn a_dead_peer_fails_the_outbox_and_drops_what_is_queued() {
        let (near, far) = tokio::io::duplex(16);
        drop(far);
        let (outbox, writer) = writing(near, LINGER).await;
        outbox.push(bytes(64, 1));
        outbox.kick();
        writer.await.unwrap();
        assert!(outbox.lock().failed);
        assert_eq!(
            outbox.push(bytes(8, 2)),
            0,
            "nothing queues on a dead connection"
        );
    }

    #[tokio::test]
    async fn a_closed_outbox_to_a_node_that_does_not_read_lets_go_of_the_socket() {
        let (near, mut far) = tokio::io::duplex(16);
        let (outbox, writer) = writing(near, Duration::from_millis(50)).await;
        outbox.push(bytes(64, 1));
        outbox.kick();
        outbox.close();
        tokio::time::timeout(Duration::from_secs(5), writer)
            .await
            .expect("the writer gives up")
            .unwrap();
        // The socket is dropped: the peer reads what fitted, then the end.
        let mut got = Vec::new();
        far.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, vec![1; 16]);
    }

    /// A sink that records every write it is handed.
    #[derive(Clone, Default)]
    struct Recording(Arc<Mutex<(Vec<u8>, usize)>>);

    impl AsyncWrite for Recording {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let mut rec = self.0.lock().unwrap();
            rec.0.extend_from_slice(buf);
            rec.1 += 1;
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_write_vectored(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            let mut rec = self.0.lock().unwrap();
            let mut n = 0;
            for buf in bufs {
                rec.0.extend_from_slice(buf);
                n += buf.len();
            }
            rec.1 += 1;
            Poll::Ready(Ok(n))
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn frames_that_tasks_ready_together_kick_leave_in_one_write() {
        let sink = Recording::default();
        let (outbox, writer) = writing(sink.clone(), LINGER).await;
        // Three requests made ready by one read of the callers' sockets, each queuing
        // its frame and kicking on its own task.
        let tasks: Vec<_> = (1..=3u8)
            .map(|tag| {
                let outbox = outbox.clone();
                tokio::spawn(async move {
                    outbox.push(bytes(usize::from(tag), tag));
                    outbox.kick();
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        tokio::task::yield_now().await;
        {
            let rec = sink.0.lock().unwrap();
            assert_eq!(rec.0, [1, 2, 2, 3, 3, 3], "in the order queued");
            assert_eq!(rec.1, 1, "one write for the three");
        }
        // A frame kicked alone later is written by itself.
        outbox.push(bytes(1, 4));
        outbox.kick();
        tokio::task::yield_now().await;
        assert_eq!(sink.0.lock().unwrap().1, 2);
        outbox.close();
        writer.await.unwrap();
    }

    #[tokio::test]
    async fn a_node_that_does_not_read_is_stalled() {
        let (near, _far) = tokio::io::duplex(16);
        let (outbox, _writer) = writing(near, LINGER).await;
        outbox.push(bytes(64, 1));
        outbox.kick();
        tokio::task::yield_now().await;
        assert!(!outbox.stalled(Duration::from_secs(60)));
        assert!(outbox.stalled(Duration::ZERO));
        assert_eq!(outbox.lock().queued, 48, "16 bytes fit the pipe");
    }
}
