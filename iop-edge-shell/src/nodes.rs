//! The node listener: a TLS handshake (unless the operator chose plaintext), then one
//! reader task per connection feeding the shared core, and an [`Outbox`] its frames are
//! written through by the connection's writer task. A connection that fails its
//! handshake, sends garbage, an oversized length or only a header is closed on its own;
//! everyone else keeps being served.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::BytesMut;
use iop_proto_core::wire::FrameDecoder;
use iop_proto_core::{ConnId, Peer};
use iop_shell_common::cancel::Cancel;
use iop_shell_common::logging::LogLimiter;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadHalf};
use tokio::net::TcpListener;
use tokio::net::tcp::OwnedReadHalf;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::conn::ConnHandle;
pub use crate::conn::TlsSlot;
use crate::driver::{Core, CoreMsg};
use crate::metrics::Metrics;
use crate::outbox::Outbox;
use crate::tls_link::TlsLink;

/// What every node connection task shares.
#[derive(Clone, Debug)]
pub struct Listener {
    /// The core.
    pub core: Core,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// TLS, if any.
    pub tls: TlsSlot,
    /// How long a peer has for its TLS handshake.
    pub handshake_timeout: Duration,
    /// The frame limit a connection starts with, until the core raises it (replaced on
    /// reload).
    pub pending_frame_len: Arc<AtomicUsize>,
    /// Bounds the log lines about undecodable input.
    pub decode_errors: Arc<LogLimiter>,
    /// Stops accepting node connections (the Edge drains: the links it has stay up for
    /// the requests in flight).
    pub stop_accepting: CancellationToken,
    /// Stops everything.
    pub shutdown: CancellationToken,
}

/// Accepts node connections until `stop_accepting`.
pub async fn serve(listener: TcpListener, shared: Listener) {
    let accept_errors = LogLimiter::new(Duration::from_secs(10), 3);
    let handshake_errors = Arc::new(LogLimiter::new(Duration::from_secs(10), 5));
    let mut next = 1u64;
    loop {
        let accepted = tokio::select! {
            () = shared.stop_accepting.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let conn = ConnId(next);
                next += 1;
                debug!(conn = conn.0, %peer, "node connection accepted");
                let _ = stream.set_nodelay(true);
                let tls = shared.tls.read().map_or(None, |tls| tls.clone());
                let shared = shared.clone();
                let handshake_errors = handshake_errors.clone();
                tokio::spawn(connection(
                    stream,
                    peer,
                    conn,
                    tls,
                    shared,
                    handshake_errors,
                ));
            }
            Err(err) => {
                if let Some(suppressed) = accept_errors.allow() {
                    warn!(%err, suppressed, "node listener: accept failed");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

fn handshake_failed(
    shared: &Listener,
    limiter: &LogLimiter,
    peer: SocketAddr,
    err: &dyn std::fmt::Display,
) {
    shared.metrics.tls_handshake_failures.inc();
    if let Some(suppressed) = limiter.allow() {
        info!(%peer, error = %err, suppressed, "node TLS handshake failed");
    } else {
        debug!(%peer, error = %err, "node TLS handshake failed");
    }
}

/// Smallest and largest read buffer of a node connection.
const READ_MIN: usize = 1 << 10;
const READ_MAX: usize = 64 << 10;

/// The next read's buffer: doubled when a read filled the last one, halved when it used
/// under a quarter, within `READ_MIN..=READ_MAX`.
fn next_read_size(want: usize, read: usize) -> usize {
    if read >= want {
        (want * 2).min(READ_MAX)
    } else if read < want / 4 {
        (want / 2).max(READ_MIN)
    } else {
        want
    }
}

/// How often a connection receiving a large frame tells the core it is alive.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

async fn connection(
    stream: tokio::net::TcpStream,
    addr: SocketAddr,
    conn: ConnId,
    tls: Option<Arc<rustls::ServerConfig>>,
    shared: Listener,
    handshake_errors: Arc<LogLimiter>,
) {
    // The core hears of the connection at once, so the caps on unregistered connections
    // and the register deadline cover the TLS handshake too.
    let outbox = Arc::new(Outbox::new());
    let closer = Cancel::new();
    let frame_limit = Arc::new(AtomicUsize::new(
        shared.pending_frame_len.load(Ordering::Relaxed),
    ));
    let handle = ConnHandle {
        outbox: outbox.clone(),
        frame_limit: frame_limit.clone(),
        closer: closer.clone(),
    };
    let peer = Peer {
        addr: Some(addr.ip()),
        ..Peer::default()
    };
    if shared
        .core
        .send(CoreMsg::ConnOpened { conn, peer, handle })
        .is_err()
    {
        return;
    }
    match tls {
        None => {
            let (reader, writer) = stream.into_split();
            let link = Link {
                conn,
                plaintext: true,
                outbox,
                frame_limit,
                closer,
            };
            run_link(reader, writer, link, &shared).await;
        }
        Some(config) => {
            // Boxed and freed once done: a handshake in flight is several KiB that an
            // idle node's task should not carry for its whole life.
            let handshake = Box::pin(async {
                tokio::select! {
                    () = closer.cancelled() => None,
                    () = shared.shutdown.cancelled() => None,
                    done = tokio::time::timeout(shared.handshake_timeout, TlsLink::accept(stream, config)) => Some(done),
                }
            });
            // The handshake's result is a temporary consumed here, before the link's first
            // await, so that the task keeps no room for a second session.
            let halves = match handshake.await {
                None => None,
                Some(Ok(Ok(stream))) => {
                    let session = stream.session();
                    let identities = session
                        .peer_certificates()
                        .and_then(|chain| chain.first())
                        .map(|leaf| iop_shell_common::tls::names(leaf))
                        .unwrap_or_default();
                    let version = session
                        .protocol_version()
                        .and_then(iop_shell_common::tls::version_name)
                        .unwrap_or("TLS");
                    let secured = CoreMsg::Secured {
                        conn,
                        tls: version,
                        identities,
                    };
                    // Split at once: the session lives behind the halves' one Arc.
                    shared
                        .core
                        .send(secured)
                        .is_ok()
                        .then(|| tokio::io::split(stream))
                }
                Some(Ok(Err(err))) => {
                    handshake_failed(&shared, &handshake_errors, addr, &err);
                    None
                }
                Some(Err(_)) => {
                    handshake_failed(&shared, &handshake_errors, addr, &"timed out");
                    None
                }
            };
            if let Some((reader, writer)) = halves {
                let link = Link {
                    conn,
                    plaintext: false,
                    outbox,
                    frame_limit,
                    closer,
                };
                run_link(reader, writer, link, &shared).await;
            }
        }
    }
    let _ = shared.core.send(CoreMsg::ConnClosed { conn });
}

/// One node connection as its reader sees it.
struct Link {
    conn: ConnId,
    /// No TLS: a ClientHello on it is a misconfigured node, said so.
    plaintext: bool,
    outbox: Arc<Outbox>,
    frame_limit: Arc<AtomicUsize>,
    closer: Cancel,
}

/// A node connection's read side, which can wait for input without holding a buffer.
trait LinkRead: AsyncRead + Unpin + Send {
    /// Resolves once a read would find input or the end of the stream.
    fn input_ready(&mut self) -> impl Future<Output = std::io::Result<()>> + Send;
}

impl LinkRead for OwnedReadHalf {
    fn input_ready(&mut self) -> impl Future<Output = std::io::Result<()>> + Send {
        self.readable()
    }
}

impl LinkRead for ReadHalf<TlsLink> {
    fn input_ready(&mut self) -> impl Future<Output = std::io::Result<()>> + Send {
        TlsLink::input_ready(self)
    }
}

/// Reads frames into the core and writes what the core sends, until either side ends.
async fn run_link<R, W>(mut reader: R, writer: W, link: Link, shared: &Listener)
where
    R: LinkRead,
    W: AsyncWrite + Send + 'static,
{
    let Listener {
        core,
        metrics,
        shutdown,
        ..
    } = shared;
    let Link {
        conn,
        plaintext,
        outbox,
        frame_limit,
        closer,
    } = link;
    tokio::spawn(outbox.run(Box::pin(writer)));
    let mut decoder = FrameDecoder::with_max_frame_len(frame_limit.load(Ordering::Relaxed));
    // The read buffer follows the traffic (a streaming node's grows to 64 KiB reads), and
    // a new one is taken only once input is waiting: an idle node (heartbeats only)
    // holds no read buffer between them.
    let mut want = READ_MIN;
    let mut buf = BytesMut::new();
    let mut first = true;
    let mut progress_said = tokio::time::Instant::now();
    // The shutdown closes this connection as its closer does: one wait, on a cancel of its
    // own (a wait on the process's token takes its lock on every poll, and this loop
    // polls at every read).
    let _follow = closer.follow(shutdown);
    'read: loop {
        let read = tokio::select! {
            () = closer.cancelled() => break,
            read = async {
                if buf.capacity() < want {
                    buf = BytesMut::new();
                    reader.input_ready().await?;
                    buf.reserve(want);
                }
                reader.read_buf(&mut buf).await
            } => read,
        };
        match read {
            Ok(0) => {
                if let Err(err) = decoder.finish() {
                    info!(conn = conn.0, %err, "node connection ended mid-frame");
                }
                break;
            }
            Ok(n) => {
                // A TLS ClientHello starts 0x16 0x03: a node that speaks TLS to a
                // plaintext listener. Say so instead of "frame too large".
                if first && plaintext && buf.starts_with(&[0x16, 0x03]) {
                    warn!(
                        conn = conn.0,
                        "a node started a TLS handshake, but this node listener is plaintext \
                         (listen.nodes_plaintext = true); give it listen.nodes_tls instead"
                    );
                    break;
                }
                first = false;
                want = next_read_size(want, n);
                metrics.bytes_in.inc_by(n as u64);
                decoder.push_bytes(buf.split().freeze());
                let mut broken = false;
                // The core raises the frame limit once the node has registered, so it is
                // read before each frame.
                let mut next = || {
                    decoder.set_max_frame_len(frame_limit.load(Ordering::Relaxed));
                    match decoder.next_envelope() {
                        Ok(envelope) => envelope,
                        Err(err) => {
                            // Unauthenticated peers can repeat this at will: rate-limited.
                            if let Some(suppressed) = shared.decode_errors.allow() {
                                warn!(conn = conn.0, %err, suppressed, "closing node connection: undecodable input");
                            }
                            broken = true;
                            None
                        }
                    }
                };
                // The first outside the core's lock: a read that completes no frame (part
                // of a large one) does not take it.
                let decoded = match next() {
                    Some(first) => {
                        let Ok(count) = core.frames(conn, first, next) else {
                            break 'read;
                        };
                        metrics.frames_in.inc_by(count);
                        true
                    }
                    None => false,
                };
                if broken {
                    break 'read;
                }
                // Part of a large frame: the node is alive. Said at most once a second,
                // so a 16 MiB frame in 16 KiB reads is not a thousand messages.
                if !decoded && progress_said.elapsed() >= PROGRESS_EVERY {
                    progress_said = tokio::time::Instant::now();
                    if core.send(CoreMsg::BytesReceived { conn }).is_err() {
                        break;
                    }
                }
            }
            Err(err) => {
                debug!(conn = conn.0, %err, "node connection read failed");
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_read_buffer_follows_the_traffic() {
        // Heartbeats keep it small; a stream grows it to the cap; quiet shrinks it back.
        assert_eq!(next_read_size(READ_MIN, 40), READ_MIN);
        let mut want = READ_MIN;
        for _ in 0..10 {
            want = next_read_size(want, want);
        }
        assert_eq!(want, READ_MAX);
        assert_eq!(next_read_size(READ_MAX, READ_MAX / 2), READ_MAX, "steady");
        for _ in 0..10 {
            want = next_read_size(want, 40);
        }
        assert_eq!(want, READ_MIN);
    }
}
