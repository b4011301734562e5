//! A node link's TLS session on rustls's unbuffered API, so that an idle node costs the
//! Edge no TLS buffers.
//!
//! `tokio-rustls` drives rustls's buffered connection, which keeps a receive buffer for
//! the whole life of every session, the larger part of what an idle TLS node costs the
//! Edge (docs/benchmarks-history.md). Here the buffers are ours: received records wait in `incoming` only while a
//! record is incomplete, encrypted output in `outgoing` only until the socket takes it,
//! and both are released once empty. Nothing cryptographic is done here; rustls decrypts,
//! encrypts, and runs the handshake and its alerts.
//!
//! [`TlsLink`] is one `AsyncRead + AsyncWrite` stream, used split: the reader task reads,
//! the connection's outbox writes. Reads process every complete record they find, so the
//! writer, which must pass the same `incoming` to rustls to reach its write state, never
//! meets unread application data there (and hands any to the reader if it did).

use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker, ready};
#[cfg(test)]
use std::time::Duration;

use rustls::server::{ServerConfig, ServerConnectionData, UnbufferedServerConnection};
use rustls::unbuffered::{
    ConnectionState, EncodeError, EncryptError, InsufficientSizeError, WriteTraffic,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf, ReadHalf};
use tokio::net::TcpStream;

/// Bytes read from the socket at a time.
const READ_CHUNK: usize = 8 << 10;
/// The most received bytes held while no record completes: a whole handshake flight
/// (rustls takes handshake messages up to 64 KiB) plus one record. More is an attack.
const MAX_INCOMING: usize = (64 << 10) + (17 << 10);
/// Plaintext taken into one `poll_write` call; more waits for the socket.
const MAX_OUTGOING: usize = 256 << 10;

/// A server-side TLS session over a node connection.
pub struct TlsLink {
    io: TcpStream,
    conn: UnbufferedServerConnection,
    /// Received TLS bytes not yet processed (an incomplete record at most, between reads).
    incoming: Vec<u8>,
    /// Decrypted bytes the reader has not taken yet, from `plain_at`.
    plain: Vec<u8>,
    plain_at: usize,
    /// TLS bytes for the socket, from `out_at`.
    outgoing: Vec<u8>,
    out_at: usize,
    /// The peer sent close_notify, or the socket ended.
    read_closed: bool,
    /// The reader, parked, for plaintext the writer came across.
    read_waker: Option<Waker>,
    /// close_notify is queued.
    closing: bool,
}

impl std::fmt::Debug for TlsLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsLink")
            .field("incoming", &self.incoming.len())
            .field("plain", &(self.plain.len() - self.plain_at))
            .field("outgoing", &(self.outgoing.len() - self.out_at))
            .field("read_closed", &self.read_closed)
            .finish_non_exhaustive()
    }
}

fn tls_error(err: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, err)
}

/// What one pass over the received bytes asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// The handshake is done and every complete record is processed.
    Traffic,
    /// Handshake messages are incomplete: read more.
    Read,
    /// The peer closed its side.
    PeerClosed,
}

/// Runs rustls's encoder into the end of `out`, growing it to the size rustls asks for.
fn append(
    out: &mut Vec<u8>,
    mut room: usize,
    mut write: impl FnMut(&mut [u8]) -> Result<usize, InsufficientSizeError>,
) {
    loop {
        let len = out.len();
        out.resize(len + room, 0);
        match write(&mut out[len..]) {
            Ok(n) => {
                out.truncate(len + n);
                return;
            }
            Err(InsufficientSizeError { required_size }) => {
                out.truncate(len);
                room = required_size;
            }
        }
    }
}

impl TlsLink {
    /// Runs the server side of a TLS handshake on `io` (the caller bounds it in time).
    pub async fn accept(io: TcpStream, config: Arc<ServerConfig>) -> io::Result<Self> {
        let conn = UnbufferedServerConnection::new(config).map_err(tls_error)?;
        let mut link = Self {
            io,
            conn,
            incoming: Vec::new(),
            plain: Vec::new(),
            plain_at: 0,
            outgoing: Vec::new(),
            out_at: 0,
            read_closed: false,
            read_waker: None,
            closing: false,
        };
        poll_fn(|cx| link.poll_handshake(cx)).await?;
        Ok(link)
    }

    /// Waits until `reader` has plaintext to give or its stream has ended, holding no
    /// buffer for it meanwhile (an empty read; see the `AsyncRead` impl).
    pub async fn input_ready(reader: &mut ReadHalf<Self>) -> io::Result<()> {
        poll_fn(|cx| Pin::new(&mut *reader).poll_read(cx, &mut ReadBuf::new(&mut []))).await
    }

    /// The session's rustls state: peer certificates, protocol version.
    pub fn session(&self) -> &rustls::CommonState {
        &self.conn
    }

    fn poll_handshake(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            let next = self.process()?;
            // Our flight goes out before we wait for the peer's answer to it. (Pending
            // here, the next poll processes again and finds the same state.)
            ready!(self.poll_send(cx))?;
            match next {
                Next::Traffic => return Poll::Ready(Ok(())),
                Next::PeerClosed => return Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into())),
                Next::Read => {
                    if ready!(self.poll_fill(cx))? == 0 {
                        return Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into()));
                    }
                }
            }
        }
    }

    /// Processes what was received until rustls needs more input or may send application
    /// data: handshake output goes to `outgoing`, decrypted records to `plain`.
    fn process(&mut self) -> io::Result<Next> {
        loop {
            let status = self.conn.process_tls_records(&mut self.incoming);
            let discard = status.discard;
            let next = match status.state {
                Ok(state) => step(
                    state,
                    &mut self.plain,
                    &mut self.plain_at,
                    &mut self.outgoing,
                ),
                Err(err) => Err(tls_error(err)),
            };
            self.incoming.drain(..discard);
            match next {
                Ok(Some(next)) => return Ok(next),
                Ok(None) => {}
                Err(err) => {
                    self.send_alert();
                    return Err(err);
                }
            }
        }
    }

    /// Best effort: the alert rustls queued for a failed session goes out.
    fn send_alert(&mut self) {
        let status = self.conn.process_tls_records(&mut []);
        if let Ok(ConnectionState::EncodeTlsData(mut encode)) = status.state {
            append(&mut self.outgoing, 1 << 10, |buf| {
                match encode.encode(buf) {
                    Err(EncodeError::InsufficientSize(size)) => Err(size),
                    other => Ok(other.unwrap_or(0)),
                }
            });
            let _ = self.io.try_write(&self.outgoing[self.out_at..]);
        }
    }

    /// Reads once from the socket into `incoming`; `Ready(Ok(0))` at its end.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        loop {
            if self.incoming.len() >= MAX_INCOMING {
                return Poll::Ready(Err(tls_error("TLS input larger than any record")));
            }
            // No buffer is held while the socket has nothing to give.
            ready!(self.io.poll_read_ready(cx))?;
            self.incoming.reserve(READ_CHUNK);
            match self.io.try_read_buf(&mut self.incoming) {
                Ok(n) => return Poll::Ready(Ok(n)),
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                    if self.incoming.is_empty() {
                        self.incoming = Vec::new();
                    }
                }
                Err(err) => return Poll::Ready(Err(err)),
            }
        }
    }

    /// Writes `outgoing` to the socket; `Ready(Ok)` once all of it is out.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.out_at < self.outgoing.len() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.outgoing[self.out_at..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.out_at += n;
        }
        self.outgoing = Vec::new();
        self.out_at = 0;
        Poll::Ready(Ok(()))
    }

    /// Like [`Self::poll_send`] without registering for the socket's readiness: the reader
    /// must not take the writer's wake-up. What the socket does not take now goes with
    /// the writer's next write.
    fn try_send(&mut self) -> io::Result<()> {
        while self.out_at < self.outgoing.len() {
            match self.io.try_write(&self.outgoing[self.out_at..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.out_at += n,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(err) => return Err(err),
            }
        }
        self.outgoing = Vec::new();
        self.out_at = 0;
        Ok(())
    }

    /// Encrypts `data` into `outgoing` as application data.
    fn encrypt(&mut self, data: &[u8]) -> io::Result<()> {
        // Room for the records' headers and tags, so one pass does.
        let room = data.len() + 64 * (data.len() / (16 << 10) + 1);
        self.write_traffic(room, |write, buf| write.encrypt(data, buf))
    }

    /// Brings rustls to its write state and lets `write` put records into `outgoing`
    /// (about `room` bytes of them): application data or close_notify.
    fn write_traffic(
        &mut self,
        room: usize,
        mut write: impl FnMut(
            &mut WriteTraffic<'_, ServerConnectionData>,
            &mut [u8],
        ) -> Result<usize, EncryptError>,
    ) -> io::Result<()> {
        // rustls reaches its write state within a pass or two; more is a bug, not a loop.
        for _ in 0..8 {
            let status = self.conn.process_tls_records(&mut self.incoming);
            let discard = status.discard;
            let had = self.plain.len() - self.plain_at;
            let next = match status.state.map_err(tls_error)? {
                ConnectionState::WriteTraffic(mut traffic) => {
                    let mut failed = None;
                    append(&mut self.outgoing, room, |buf| {
                        match write(&mut traffic, buf) {
                            Ok(n) => Ok(n),
                            Err(EncryptError::InsufficientSize(size)) => Err(size),
                            Err(err) => {
                                failed = Some(err);
                                Ok(0)
                            }
                        }
                    });
                    self.incoming.drain(..discard);
                    return failed.map_or(Ok(()), |err| Err(tls_error(err)));
                }
                ConnectionState::Closed => {
                    self.incoming.drain(..discard);
                    return Err(io::ErrorKind::BrokenPipe.into());
                }
                // A key update to answer, plaintext the reader left: handled as the
                // reader would, then on to the write state.
                state => step(
                    state,
                    &mut self.plain,
                    &mut self.plain_at,
                    &mut self.outgoing,
                )?,
            };
            self.incoming.drain(..discard);
            if matches!(next, Some(Next::PeerClosed)) {
                self.read_closed = true;
            }
            if (self.plain.len() - self.plain_at > had || self.read_closed)
                && let Some(reader) = self.read_waker.take()
            {
                reader.wake();
            }
        }
        Err(tls_error("TLS session cannot send application data"))
    }
}

/// Handles one state of rustls's unbuffered connection, except that the caller wants
/// `WriteTraffic` for itself: `Some` when the pass is over.
fn step(
    state: ConnectionState<'_, '_, ServerConnectionData>,
    plain: &mut Vec<u8>,
    plain_at: &mut usize,
    outgoing: &mut Vec<u8>,
) -> io::Result<Option<Next>> {
    Ok(match state {
        ConnectionState::ReadTraffic(mut records) => {
            while let Some(record) = records.next_record() {
                let record = record.map_err(tls_error)?;
                if *plain_at == plain.len() {
                    plain.clear();
                    *plain_at = 0;
                }
                plain.extend_from_slice(record.payload);
            }
            None
        }
        // Handshake records (and a key update): dropping this state would lose them.
        ConnectionState::EncodeTlsData(mut encode) => {
            let mut failed = None;
            append(outgoing, 1 << 10, |buf| match encode.encode(buf) {
                Ok(n) => Ok(n),
                Err(EncodeError::InsufficientSize(size)) => Err(size),
                Err(err) => {
                    failed = Some(err);
                    Ok(0)
                }
            });
            if let Some(err) = failed {
                return Err(tls_error(err));
            }
            None
        }
        // What `EncodeTlsData` put in `outgoing` is written before anything encrypted
        // later, so it counts as sent here.
        ConnectionState::TransmitTlsData(transmit) => {
            transmit.done();
            None
        }
        ConnectionState::BlockedHandshake => Some(Next::Read),
        ConnectionState::WriteTraffic(_) => Some(Next::Traffic),
        ConnectionState::PeerClosed | ConnectionState::Closed => Some(Next::PeerClosed),
        // The Edge accepts no early data (its config leaves it off).
        ConnectionState::ReadEarlyData(_) => return Err(tls_error("unexpected early data")),
        _ => return Err(tls_error("unknown TLS connection state")),
    })
}

/// With an empty `buf`, `poll_read` waits without taking anything: it is ready once
/// plaintext is waiting or the stream has ended, so a reader can wait for input before it
/// takes a buffer for it (see `TlsLink::input_ready`).
impl AsyncRead for TlsLink {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.plain_at < this.plain.len() {
                let n = buf.remaining().min(this.plain.len() - this.plain_at);
                buf.put_slice(&this.plain[this.plain_at..this.plain_at + n]);
                this.plain_at += n;
                if this.plain_at == this.plain.len() {
                    this.plain = Vec::new();
                    this.plain_at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.read_closed {
                return Poll::Ready(Ok(()));
            }
            if this.process()? == Next::PeerClosed {
                this.read_closed = true;
            }
            // A key update's answer, say.
            this.try_send()?;
            if this.plain_at < this.plain.len() || this.read_closed {
                continue;
            }
            this.read_waker = Some(cx.waker().clone());
            if ready!(this.poll_fill(cx))? == 0 {
                this.read_closed = true;
                if !this.incoming.is_empty() {
                    return Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into()));
                }
            }
        }
    }
}

impl AsyncWrite for TlsLink {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.outgoing.len() - this.out_at >= MAX_OUTGOING {
            ready!(this.poll_send(cx))?;
        }
        let take = data.len().min(MAX_OUTGOING);
        this.encrypt(&data[..take])?;
        // The socket takes what it can now; `poll_flush` sees to the rest.
        match this.poll_send(cx) {
            Poll::Ready(Err(err)) => Poll::Ready(Err(err)),
            _ => Poll::Ready(Ok(take)),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        slices: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if slices.len() == 1 {
            return self.poll_write(cx, &slices[0]);
        }
        // Small frames share records: gathered first, encrypted once.
        let mut joined = Vec::new();
        for slice in slices {
            if !joined.is_empty() && joined.len() + slice.len() > MAX_OUTGOING {
                break;
            }
            joined.extend_from_slice(slice);
        }
        self.poll_write(cx, &joined)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_send(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send(cx))?;
        if !this.closing {
            this.closing = true;
            // A session that cannot say close_notify any more (the peer closed both
            // ways, or it failed) still closes its socket.
            let _ = this.write_traffic(64, |write, buf| write.queue_close_notify(buf));
        }
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    fn configs() -> (Arc<ServerConfig>, tokio_rustls::TlsConnector) {
        configs_for(&[&rustls::version::TLS13, &rustls::version::TLS12])
    }

    fn configs_for(
        client_versions: &[&'static rustls::SupportedProtocolVersion],
    ) -> (Arc<ServerConfig>, tokio_rustls::TlsConnector) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let der = CertificateDer::from(cert.der().to_vec());
        let private = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let provider = iop_shell_common::tls::provider();
        let server = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![der.clone()], private)
            .unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(client_versions)
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        (
            Arc::new(server),
            tokio_rustls::TlsConnector::from(Arc::new(client)),
        )
    }

    async fn pair() -> (TlsLink, tokio_rustls::client::TlsStream<TcpStream>) {
        pair_with(configs()).await
    }

    async fn pair_with(
        (server, connector): (Arc<ServerConfig>, tokio_rustls::TlsConnector),
    ) -> (TlsLink, tokio_rustls::client::TlsStream<TcpStream>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let tcp = TcpStream::connect(addr).await.unwrap();
            let name = ServerName::try_from("localhost").unwrap();
            connector.connect(name, tcp).await.unwrap()
        });
        let (tcp, _) = listener.accept().await.unwrap();
        let link = TlsLink::accept(tcp, server).await.unwrap();
        (link, client.await.unwrap())
    }

    #[tokio::test]
    async fn bytes_cross_both_ways_split_and_large() {
        let (link, mut client) = pair().await;
        assert_eq!(
            link.session().protocol_version(),
            Some(rustls::ProtocolVersion::TLSv1_3)
        );
        let (mut reader, mut writer) = tokio::io::split(link);
        // Larger than a record and than the socket's buffers: both ends must keep going.
        let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let sent = big.clone();
        let echo = tokio::spawn(async move {
            let mut got = vec![0; sent.len()];
            reader.read_exact(&mut got).await.unwrap();
            assert_eq!(got, sent);
            writer.write_all(&got).await.unwrap();
            let both = [io::IoSlice::new(b"ab"), io::IoSlice::new(b"cd")];
            assert_eq!(writer.write_vectored(&both).await.unwrap(), 4);
            writer.flush().await.unwrap();
            writer.shutdown().await.unwrap();
            let mut rest = Vec::new();
            reader.read_to_end(&mut rest).await.unwrap();
            rest
        });
        client.write_all(&big).await.unwrap();
        let mut back = vec![0; big.len()];
        client.read_exact(&mut back).await.unwrap();
        assert_eq!(back, big);
        let mut tail = Vec::new();
        // The Edge's close_notify ends the client's stream cleanly.
        client.read_to_end(&mut tail).await.unwrap();
        assert_eq!(tail, b"abcd");
        client.write_all(b"last words").await.unwrap();
        client.shutdown().await.unwrap();
        assert_eq!(echo.await.unwrap(), b"last words");
    }

    #[tokio::test]
    async fn traffic_goes_on_across_key_updates_the_node_asks_for() {
        let (link, mut client) = pair().await;
        let (mut reader, mut writer) = tokio::io::split(link);
        for round in 0..3u8 {
            // The client asks for new keys both ways (update_requested).
            client.get_mut().1.refresh_traffic_keys().unwrap();
            client.write_all(&[round; 100]).await.unwrap();
            client.flush().await.unwrap();
            let mut got = [0; 100];
            reader.read_exact(&mut got).await.unwrap();
            assert_eq!(got, [round; 100]);
            writer.write_all(&[round + 10; 50]).await.unwrap();
            writer.flush().await.unwrap();
            let mut back = [0; 50];
            client.read_exact(&mut back).await.unwrap();
            assert_eq!(back, [round + 10; 50]);
        }
    }

    #[tokio::test]
    async fn a_tls_1_2_node_is_served_too() {
        let (mut link, mut client) = pair_with(configs_for(&[&rustls::version::TLS12])).await;
        assert_eq!(
            link.session().protocol_version(),
            Some(rustls::ProtocolVersion::TLSv1_2)
        );
        client.write_all(&[7; 40_000]).await.unwrap();
        let mut got = vec![0; 40_000];
        link.read_exact(&mut got).await.unwrap();
        assert!(got.iter().all(|&b| b == 7));
        link.write_all(b"ok").await.unwrap();
        link.flush().await.unwrap();
        let mut back = [0; 2];
        client.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"ok");
    }

    #[tokio::test]
    async fn an_idle_session_holds_no_buffers() {
        let (mut link, mut client) = pair().await;
        client.write_all(b"hello").await.unwrap();
        let mut got = [0; 5];
        link.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello");
        link.write_all(b"back").await.unwrap();
        link.flush().await.unwrap();
        let mut back = [0; 4];
        client.read_exact(&mut back).await.unwrap();
        // Nothing more to read: the next read parks without a receive buffer.
        let pending = tokio::time::timeout(Duration::from_millis(50), link.read(&mut got)).await;
        assert!(pending.is_err());
        assert_eq!(link.incoming.capacity(), 0);
        assert_eq!(link.plain.capacity(), 0);
        assert_eq!(link.outgoing.capacity(), 0);
    }

    #[tokio::test]
    async fn waiting_for_input_takes_nothing_and_holds_no_buffer() {
        let (link, mut client) = pair().await;
        let (mut reader, _writer) = tokio::io::split(link);
        let waiting =
            tokio::time::timeout(Duration::from_millis(50), TlsLink::input_ready(&mut reader))
                .await;
        assert!(waiting.is_err(), "nothing was sent yet");
        client.write_all(b"hello").await.unwrap();
        client.flush().await.unwrap();
        TlsLink::input_ready(&mut reader).await.unwrap();
        // Ready again at once: the plaintext is still there, untouched.
        TlsLink::input_ready(&mut reader).await.unwrap();
        let mut got = [0; 5];
        reader.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello");
        client.shutdown().await.unwrap();
        // The end of the stream is input too: the read that follows returns 0.
        TlsLink::input_ready(&mut reader).await.unwrap();
        assert_eq!(reader.read(&mut got).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn a_peer_that_does_not_speak_tls_is_refused() {
        let (server, _) = configs();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            tcp.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .unwrap();
            let mut answer = Vec::new();
            let _ = tcp.read_to_end(&mut answer).await;
            answer
        });
        let (tcp, _) = listener.accept().await.unwrap();
        let err = TlsLink::accept(tcp, server).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        drop(err);
        let answer = client.await.unwrap();
        // A TLS alert record (content type 21), not silence.
        assert_eq!(answer.first(), Some(&21), "{answer:?}");
    }

    #[tokio::test]
    async fn a_record_cut_short_by_the_peer_is_an_error() {
        let (mut link, client) = pair().await;
        let mut tcp = client.into_inner().0;
        // A record header announcing 100 bytes, then the end of the connection.
        tcp.write_all(&[23, 3, 3, 0, 100, 1, 2, 3]).await.unwrap();
        tcp.shutdown().await.unwrap();
        let mut buf = [0; 16];
        let err = link.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{err}");
    }
}
