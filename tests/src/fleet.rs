//! A fleet of 1,000 nodes against one Edge: how long they take to register and become
//! ready, on a cold start and again after the Edge restarts, over TLS or plaintext, beside
//! bare clients that redial by the same policy, and the Edge's memory per idle connected
//! node. The `reconnect` harness prints every combination; `bench` puts the rows of the
//! nodes' default jitter in its table.
//!
//! The nodes are light in-process clients speaking the real wire protocol (register,
//! ready, heartbeat answers) so that one machine can hold a thousand of them. Each redials
//! through the core's reconnect `Supervisor`, as `iop-node` does, with `interval_sec =
//! 0.1` and the given jitter; the Edge's memory per idle connected node is its RSS growth
//! from no nodes to all of them ready. The restart's reference is bare clients redialling
//! through the same supervisor and policy to a listener that went away for as long as the
//! Edge did and came back: the part of a restart that is not protocol. Over plaintext they
//! are bare TCP clients; over TLS bare TLS clients (the nodes' connector, the Edge's
//! certificate and its own server configuration), since the handshakes' key exchanges and
//! signatures are a floor no protocol on that link goes under.
//! `IOP_BENCH_EDGE_THREADS=<n>` starts the Edge with `runtime.worker_threads = n` instead
//! of its default, to compare thread counts.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use iop_proto_core::wire::{
    self, Body, Envelope, FrameDecoder, HeartbeatAck, NodeReadyRequest, RegisterRequest,
};
use iop_proto_core::{Failure, ReconnectPolicy, Supervisor, SupervisorEvent, Timestamp};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::client::{Link, connector_trusting, gen_cert};
use crate::procfs::{cpu, rss_kib};
use crate::{Proc, TempDir, free_port, wait_until};

const TOKEN: &str = "reconnect-token-0123";

fn edge_toml(link: Link, nodes: usize, http: u16, port: u16) -> String {
    let mut text = format!(
        "[listen]\nhttp = \"127.0.0.1:{http}\"\nnodes = \"127.0.0.1:{port}\"\n{}\n\
         [heartbeat]\ninterval_ms = 5000\ntimeout_ms = 30000\n\n[timeouts]\nregister_ms = 30000\n\n",
        match link {
            Link::Plaintext => "nodes_plaintext = true\n".to_owned(),
            _ => "[listen.nodes_tls]\ncert_file = \"edge-cert.pem\"\nkey_file = \"edge-cert-key.pem\"\n"
                .to_owned(),
        }
    );
    // For comparing thread counts (as the data-path harness); the default otherwise.
    if let Some(threads) = std::env::var_os("IOP_BENCH_EDGE_THREADS") {
        let threads = threads.to_string_lossy();
        text.push_str(&format!("[runtime]\nworker_threads = {threads}\n\n"));
    }
    text.push_str("[auth]\nadmin_loopback = true\n\n");
    for i in 0..nodes {
        text.push_str(&format!("[[nodes]]\nid = \"n{i}\"\ntoken = \"{TOKEN}\"\n"));
    }
    text
}

/// Connects from a loopback address of node `i`'s own (127.1.x.y): the nodes of a fleet
/// dial from many hosts, and the Edge limits not-yet-registered connections per source
/// address, so a thousand nodes sharing 127.0.0.1 would measure that limit instead.
async fn connect_from(i: usize, port: u16) -> std::io::Result<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    let [hi, lo] = u16::try_from(i % 60_000).unwrap_or(0).to_be_bytes();
    socket.bind(std::net::SocketAddr::from(([127, 1, hi, lo], 0)))?;
    socket
        .connect(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
        .await
}

async fn send<S: AsyncWrite + Unpin>(stream: &mut S, body: Body) -> std::io::Result<()> {
    let mut out = BytesMut::new();
    wire::encode(&Envelope::new(body), &mut out).map_err(std::io::Error::other)?;
    stream.write_all(&out).await
}

/// Registers as `node`, reports ready, then answers heartbeats until the connection ends.
async fn session<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    node: &str,
    ready: &AtomicUsize,
) -> std::io::Result<()> {
    send(
        &mut stream,
        Body::RegisterRequest(RegisterRequest {
            node_id: node.into(),
            token: TOKEN.into(),
            rehome: true,
            ..RegisterRequest::default()
        }),
    )
    .await?;
    let mut decoder = FrameDecoder::new();
    let mut buf = vec![0u8; 8192];
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        decoder.push_bytes(bytes::Bytes::copy_from_slice(&buf[..n]));
        while let Some(envelope) = decoder.next_envelope().map_err(std::io::Error::other)? {
            match envelope.body {
                Some(Body::RegisterResponse(r)) if r.accepted => {
                    send(
                        &mut stream,
                        Body::NodeReadyRequest(NodeReadyRequest {
                            node_id: node.into(),
                            held_elsewhere: Vec::new(),
                        }),
                    )
                    .await?;
                }
                Some(Body::NodeReadyResponse(r)) if r.ready => {
                    ready.fetch_add(1, Ordering::SeqCst);
                }
                Some(Body::Heartbeat(ping)) => {
                    send(
                        &mut stream,
                        Body::HeartbeatAck(HeartbeatAck {
                            nonce: ping.nonce,
                            echo_sent_at_ms: ping.sent_at_ms,
                        }),
                    )
                    .await?;
                }
                // A re-home: this idle session has nothing to finish; dial again now.
                Some(Body::NodeRehomeRequest(_)) => {
                    REHOMED.with(|r| r.set(true));
                    return Ok(());
                }
                Some(Body::RegisterResponse(_) | Body::NodeReadyResponse(_)) => return Ok(()),
                _ => {}
            }
        }
    }
}

tokio::task_local! {
    /// Set by a node's session when the Edge told it to re-home.
    static REHOMED: std::cell::Cell<bool>;
}

/// Dials the listener on `port` from node `i`'s address and runs `connection` on each
/// connection made, redialling when it returns as the core's supervisor says (fixed
/// 100 ms interval, `jitter` of it removed at random), until `stop`. The nodes and the
/// bare reference clients share it, so both redial by exactly the same policy.
async fn redial<F, Fut>(i: usize, port: u16, jitter: f64, stop: Arc<AtomicBool>, mut connection: F)
where
    F: FnMut(TcpStream) -> Fut,
    Fut: Future<Output = ()>,
{
    let policy = ReconnectPolicy::from_config(Some(0), Some(0.1)).expect("a valid policy");
    let mut supervisor = Supervisor::with_jitter(policy, jitter, i as u64 ^ 0x5EED);
    let origin = Instant::now();
    let now = || Timestamp::from_millis(origin.elapsed().as_millis() as u64);
    supervisor.handle_start(now()).expect("idle");
    while !stop.load(Ordering::SeqCst) {
        let mut dial = false;
        while let Some(event) = supervisor.poll_event() {
            match event {
                SupervisorEvent::Dial { .. } => dial = true,
                _ => return,
            }
        }
        if !dial {
            let Some(wake) = supervisor.poll_timeout() else {
                return;
            };
            tokio::time::sleep_until((origin + Duration::from_millis(wake.at.as_millis())).into())
                .await;
            supervisor.handle_timeout(now());
            continue;
        }
        let Ok(tcp) = connect_from(i, port).await else {
            supervisor
                .handle_failure(now(), Failure::Refused)
                .expect("dialing");
            continue;
        };
        supervisor.handle_connected(now()).expect("dialing");
        let rehomed = REHOMED
            .scope(std::cell::Cell::new(false), async {
                connection(tcp).await;
                REHOMED.with(std::cell::Cell::get)
            })
            .await;
        if rehomed {
            // As `iop-node` does: dial again at once (the same address reaches the
            // successor).
            supervisor.handle_ready(now()).expect("connected");
            supervisor.handle_rehome(now()).expect("ready");
            continue;
        }
        supervisor
            .handle_failure(now(), Failure::Reset)
            .expect("connected");
    }
}

/// The name every TLS client here checks the Edge's certificate for.
fn server_name() -> rustls_pki_types::ServerName<'static> {
    rustls_pki_types::ServerName::try_from("localhost").expect("name")
}

/// One simulated node: a session on every connection [`redial`] makes, until `stop`.
async fn node(
    i: usize,
    port: u16,
    tls: Option<tokio_rustls::TlsConnector>,
    jitter: f64,
    ready: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
) {
    let name = format!("n{i}");
    redial(i, port, jitter, stop, |tcp| {
        let (tls, ready, name) = (tls.clone(), ready.clone(), name.clone());
        async move {
            let _ = tcp.set_nodelay(true);
            match tls {
                None => {
                    let _ = session(tcp, &name, &ready).await;
                }
                Some(connector) => {
                    if let Ok(stream) = connector.connect(server_name(), tcp).await {
                        let _ = session(stream, &name, &ready).await;
                    }
                }
            }
        }
    })
    .await;
}

async fn until(ready: &AtomicUsize, target: usize, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < limit {
        if ready.load(Ordering::SeqCst) >= target {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    None
}

/// Bare TCP connects of `n` clients to a listener that accepts and holds them (the same
/// listen backlog as the Edge's, so the reference pays no SYN retransmits the Edge avoids).
pub async fn raw_connects(n: usize) -> Duration {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind("127.0.0.1:0".parse().expect("addr"))
        .expect("bind");
    let listener = socket.listen(4096).expect("listen");
    let port = listener.local_addr().expect("addr").port();
    let server = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    let started = Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|i| tokio::spawn(async move { connect_from(i, port).await }))
        .collect();
    let mut held = Vec::new();
    for t in tasks {
        held.push(t.await.expect("task").expect("connect"));
    }
    let took = started.elapsed();
    // The clients' ends close here, but the listener's task is left running with the
    // connections it accepted (1,000 descriptors and one port, once per process): closing
    // those too made every plaintext registration measured after them slower (1,000 nodes
    // ready in 0.040-0.049 s instead of 0.025-0.030, restarts 1.33-1.53x the bare
    // reconnects instead of 1.09-1.27x, 2 December 22:50). Dropping the handle detaches it.
    drop(server);
    took
}

/// How a bare reference client reaches the listener: plain TCP, or a TLS handshake with
/// the Edge's own server configuration and the nodes' connector.
#[derive(Clone)]
enum Bare {
    Tcp,
    Tls(tokio_rustls::TlsAcceptor, tokio_rustls::TlsConnector),
}

/// The reference for a restart: `n` bare clients that redial through the same
/// `Supervisor` and policy as the nodes (100 ms, `jitter`) hold connections to a
/// listener; the listener and every connection it accepted are dropped, and after
/// `downtime` (the Edge's, from its kill until it answered again) the listener comes back
/// on the same port. Returns the time from the new listener's bind until all `n` are
/// connected again: the connects (and, for [`Bare::Tls`], the TLS handshakes with the
/// Edge's certificate and settings) plus the wait for the next redial, without the
/// protocol.
async fn raw_reconnects(n: usize, jitter: f64, downtime: Duration, bare: Bare) -> Duration {
    let port = free_port();
    let listen = |bare: Bare| {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_reuseaddr(true).expect("reuseaddr");
        socket
            .bind(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
            .expect("bind");
        let listener = socket.listen(4096).expect("listen");
        tokio::spawn(async move {
            // Dropped with this task when the listener "restarts": every connection goes.
            let mut held = Vec::new();
            let mut handshakes = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((s, _)) = accepted else { break };
                        match &bare {
                            Bare::Tcp => held.push(s),
                            Bare::Tls(acceptor, _) => {
                                let accept = acceptor.accept(s);
                                handshakes.spawn(async move {
                                    if let Ok(mut stream) = accept.await {
                                        let _ = stream.read(&mut [0u8; 16]).await;
                                    }
                                });
                            }
                        }
                    }
                    Some(_) = handshakes.join_next() => {}
                }
            }
        })
    };
    let connected = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let server = listen(bare.clone());
    for i in 0..n {
        let (connected, bare) = (connected.clone(), bare.clone());
        tokio::spawn(redial(i, port, jitter, stop.clone(), move |mut tcp| {
            let (connected, bare) = (connected.clone(), bare.clone());
            async move {
                match bare {
                    Bare::Tcp => {
                        connected.fetch_add(1, Ordering::SeqCst);
                        let _ = tcp.read(&mut [0u8; 16]).await;
                    }
                    Bare::Tls(_, connector) => {
                        let _ = tcp.set_nodelay(true);
                        if let Ok(mut stream) = connector.connect(server_name(), tcp).await {
                            connected.fetch_add(1, Ordering::SeqCst);
                            let _ = stream.read(&mut [0u8; 16]).await;
                        }
                    }
                }
            }
        }));
    }
    until(&connected, n, Duration::from_secs(60))
        .await
        .expect("bare clients connect");
    server.abort();
    connected.store(0, Ordering::SeqCst);
    tokio::time::sleep(downtime).await;
    let server = listen(bare);
    let again = until(&connected, n, Duration::from_secs(60))
        .await
        .expect("bare clients reconnect");
    // Everything goes before the next measurement: the listener with the connections it
    // holds, and with them the clients, which find `stop` set when their read ends.
    stop.store(true, Ordering::SeqCst);
    server.abort();
    let _ = server.await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    again
}

/// Edge restarts per fleet run, and bare restarts per reference; the medians are reported.
pub const RESTARTS: usize = 5;

/// The middle of `values` (the upper one of an even count).
fn median(mut values: Vec<Duration>) -> Duration {
    values.sort_unstable();
    values.get(values.len() / 2).copied().unwrap_or_default()
}

/// What one fleet run measured.
#[derive(Debug, Clone)]
pub struct Row {
    /// The node link.
    pub link: Link,
    /// The share of the redial interval the nodes take off at random.
    pub jitter: f64,
    /// Nodes in the fleet.
    pub nodes: usize,
    /// All nodes ready from a cold start; `None` if not within 60 s.
    pub cold: Option<Duration>,
    /// All nodes ready again after the Edge was killed and restarted: the median of
    /// [`RESTARTS`]; `None` if one of them took over 60 s.
    pub again: Option<Duration>,
    /// The Edge's CPU per registration from a cold start.
    pub cold_cpu: Duration,
    /// A restarted Edge's CPU per registration, its own start included (the mean of the
    /// restarts).
    pub restart_cpu: Duration,
    /// The Edge's RSS growth per idle connected node, KiB.
    pub per_node_kib: f64,
    /// Bare TCP connects of as many clients (`raw_connects`).
    pub raw: Duration,
    /// Bare TCP clients redialling by the same policy after a listener restart, down as
    /// long as the Edge was each time (the median of [`RESTARTS`]).
    pub raw_again: Duration,
    /// The same over TLS, for a TLS link.
    pub tls_again: Option<Duration>,
}

impl Row {
    /// The bare reconnects over the same link as the nodes': the floor of a restart.
    #[must_use]
    pub fn bare_again(&self) -> Duration {
        self.tls_again.unwrap_or(self.raw_again)
    }

    /// The restart over the bare reconnects of the same link.
    #[must_use]
    pub fn restart_ratio(&self) -> Option<f64> {
        self.again
            .map(|d| d.as_secs_f64() / self.bare_again().as_secs_f64())
    }

    /// `TLS 1.3` or `plaintext`.
    #[must_use]
    pub fn link_name(&self) -> &'static str {
        if self.link == Link::Tls {
            "TLS 1.3"
        } else {
            "plaintext"
        }
    }
}

/// `n` with a comma between thousands, as the table writes counts ("1,000").
#[must_use]
pub fn count(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

/// `0.123 s`, or that it did not finish.
#[must_use]
pub fn seconds(d: Option<Duration>) -> String {
    d.map_or_else(
        || "did not finish in 60 s".to_owned(),
        |d| format!("{:.3} s", d.as_secs_f64()),
    )
}

/// Starts an Edge for `nodes` nodes, connects them over `link` with `jitter`, kills and
/// restarts the Edge [`RESTARTS`] times, and measures the same restarts with bare
/// clients; `raw` is [`raw_connects`] of as many clients, taken once per run of the
/// caller.
pub async fn measure(nodes: usize, link: Link, jitter: f64, raw: Duration) -> Row {
    let dir = TempDir::new("reconnect");
    let (http, port) = (free_port(), free_port());
    let connector = (link == Link::Tls).then(|| {
        gen_cert(&dir, "edge-cert", &["localhost"], &[]);
        connector_trusting(&dir.path().join("edge-cert.pem"))
    });
    let config = dir.write("edge.toml", &edge_toml(link, nodes, http, port));
    let config = config.to_string_lossy().into_owned();
    // Starting, signalling and reaping a process block: with the worker set aside, so
    // that the nodes' tasks keep both of the runtime's workers (a blocked worker delayed
    // the nodes' noticing a killed Edge by 40 ms, and with it every restart).
    let start = |name: &str| {
        tokio::task::block_in_place(|| {
            let edge = Proc::start(
                "iop-edge",
                &["--config", &config],
                &dir,
                name,
                &[("RUST_LOG", "warn")],
            );
            assert!(
                wait_until(Duration::from_secs(10), || {
                    std::net::TcpStream::connect(("127.0.0.1", http)).is_ok()
                }),
                "the Edge ({name}) did not answer on 127.0.0.1:{http} within 10 s"
            );
            edge
        })
    };
    let mut edge = start("edge");
    // Let the fresh process settle before taking its idle footprint.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle_rss = rss_kib(edge.pid());
    let ready = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let cpu_before = cpu(edge.pid());
    for i in 0..nodes {
        tokio::spawn(node(
            i,
            port,
            connector.clone(),
            jitter,
            ready.clone(),
            stop.clone(),
        ));
    }
    let cold = until(&ready, nodes, Duration::from_secs(60)).await;
    let cold_cpu = cpu(edge.pid()) - cpu_before;
    // Idle connected nodes: the handshake's transient buffers are gone after a pause.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let per_node_kib = rss_kib(edge.pid()).saturating_sub(idle_rss) as f64 / nodes as f64;
    // Restarted several times: where the Edge comes back within the nodes' redial
    // interval decides whether the last of them waits out one more interval, and one
    // restart over one bare restart spread over 1.09-1.39x on the same build.
    let mut agains = Vec::with_capacity(RESTARTS);
    let mut downtimes = Vec::with_capacity(RESTARTS);
    let mut restart_cpu = Duration::ZERO;
    for restart in 0..RESTARTS {
        let killed = Instant::now();
        tokio::task::block_in_place(|| {
            edge.signal("KILL");
            let _ = edge.wait_exit(Duration::from_secs(5));
        });
        // Reset before the new Edge exists, so no early ready is missed.
        ready.store(0, Ordering::SeqCst);
        edge = start(&format!("edge-restart-{restart}"));
        downtimes.push(killed.elapsed());
        agains.push(until(&ready, nodes, Duration::from_secs(60)).await);
        restart_cpu += cpu(edge.pid());
        // Settled: every node registered and idle before the next kill.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::SeqCst);
    tokio::task::block_in_place(|| drop(edge));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let again = agains.into_iter().collect::<Option<Vec<_>>>().map(median);
    let mut raw_agains = Vec::with_capacity(RESTARTS);
    for downtime in &downtimes {
        raw_agains.push(raw_reconnects(nodes, jitter, *downtime, Bare::Tcp).await);
    }
    let raw_again = median(raw_agains);
    // Over TLS the floor a restart can reach is the handshakes themselves: the same
    // clients redialling by the same policy, with the nodes' connector, to a listener
    // serving the Edge's certificate through the Edge's own server configuration.
    let tls_again = match &connector {
        None => None,
        Some(connector) => {
            let files = iop_shell_common::tls::ServerFiles {
                cert_file: dir.path().join("edge-cert.pem"),
                key_file: dir.path().join("edge-cert-key.pem"),
                client_ca_file: None,
            };
            let config = iop_shell_common::tls::server_config("listen.nodes_tls", &files, &[])
                .expect("the Edge's TLS settings");
            let mut tls_agains = Vec::with_capacity(RESTARTS);
            for downtime in &downtimes {
                let bare = Bare::Tls(config.clone().into(), connector.clone());
                tls_agains.push(raw_reconnects(nodes, jitter, *downtime, bare).await);
            }
            Some(median(tls_agains))
        }
    };
    let restart_cpu = restart_cpu / u32::try_from(RESTARTS).unwrap_or(1);
    let per_registration = |d: Duration| d / u32::try_from(nodes.max(1)).unwrap_or(u32::MAX);
    Row {
        link,
        jitter,
        nodes,
        cold,
        again,
        cold_cpu: per_registration(cold_cpu),
        restart_cpu: per_registration(restart_cpu),
        per_node_kib,
        raw,
        raw_again,
        tls_again,
    }
}

/// Edge handovers per handover run; the median is reported.
pub const HANDOVERS: usize = 5;

/// What a handover run measured: all nodes ready from a cold start, and all nodes ready
/// on the successor after `iop-edge --takeover` started (the median of [`HANDOVERS`]),
/// each from the start of the Edge process.
#[derive(Debug, Clone)]
pub struct Handover {
    /// The node link.
    pub link: Link,
    /// Nodes in the fleet.
    pub nodes: usize,
    /// From the Edge process's start (nodes already redialling) until all are ready.
    pub cold: Option<Duration>,
    /// From the successor's start until all nodes are ready on it (median).
    pub handover: Option<Duration>,
    /// Every handover, in order.
    pub each: Vec<Option<Duration>>,
}

/// Runs a fleet of `nodes` over `link` (the node's default jitter), measures a cold
/// start, then hands the Edge over [`HANDOVERS`] times to a successor started with
/// `--takeover`, each time until every node is ready on it.
pub async fn handover(nodes: usize, link: Link, jitter: f64) -> Handover {
    let dir = TempDir::new("handover");
    let (http, port) = (free_port(), free_port());
    let connector = (link == Link::Tls).then(|| {
        gen_cert(&dir, "edge-cert", &["localhost"], &[]);
        connector_trusting(&dir.path().join("edge-cert.pem"))
    });
    let mut text = edge_toml(link, nodes, http, port);
    text = text.replacen(
        "[listen]\n",
        &format!(
            "[listen]\nupgrade_socket = \"{}\"\n",
            dir.path().join("upgrade.sock").display()
        ),
        1,
    );
    let config = dir.write("edge.toml", &text);
    let config = config.to_string_lossy().into_owned();
    let ready = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // The fleet redials from the start: a cold start is the Edge's start until all ready.
    for i in 0..nodes {
        tokio::spawn(node(
            i,
            port,
            connector.clone(),
            jitter,
            ready.clone(),
            stop.clone(),
        ));
    }
    let start = |name: &str, takeover: bool| {
        let mut args = vec!["--config", config.as_str()];
        if takeover {
            args.push("--takeover");
        }
        tokio::task::block_in_place(|| {
            Proc::start("iop-edge", &args, &dir, name, &[("RUST_LOG", "warn")])
        })
    };
    let started = Instant::now();
    let mut edge = start("edge", false);
    let cold = until(&ready, nodes, Duration::from_secs(60))
        .await
        .map(|_| started.elapsed());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut each = Vec::with_capacity(HANDOVERS);
    for round in 0..HANDOVERS {
        ready.store(0, Ordering::SeqCst);
        let started = Instant::now();
        let successor = start(&format!("edge-{round}"), true);
        each.push(
            until(&ready, nodes, Duration::from_secs(60))
                .await
                .map(|_| started.elapsed()),
        );
        let mut old = std::mem::replace(&mut edge, successor);
        tokio::task::block_in_place(|| {
            assert!(
                old.wait_exit(Duration::from_secs(10)).is_some(),
                "the old edge did not exit: {}",
                old.log()
            );
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    stop.store(true, Ordering::SeqCst);
    tokio::task::block_in_place(|| drop(edge));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let handover = each.iter().copied().collect::<Option<Vec<_>>>().map(median);
    Handover {
        link,
        nodes,
        cold,
        handover,
        each,
    }
}

#[cfg(test)]
mod tests {
    use super::count;

    #[test]
    fn counts_are_written_with_thousands_separated() {
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(1_000), "1,000");
        assert_eq!(count(2_000), "2,000");
        assert_eq!(count(1_234_567), "1,234,567");
    }
}
