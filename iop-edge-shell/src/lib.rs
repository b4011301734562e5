//! The IOP Edge shell: IO around [`iop_proto_core::EdgeCore`].
//!
//! - [`config`]: the TOML configuration.
//! - [`certgen`]: `iop-edge gen-cert`, certificates for the node link.
//! - [`driver`]: the core behind one lock, and what routes its outputs.
//! - [`nodes`]: the node listener (a reader task per connection).
//! - [`outbox`]: a node connection's outgoing frames, written together by its writer task.
//! - [`http`]: the OpenAI-compatible HTTP surface, status, metrics and health.
//! - [`memory`]: the budget of request bodies and buffered response bytes.
//! - [`drain`]: stopping without cutting the requests in flight off.

#![forbid(unsafe_code)]

pub mod certgen;
pub mod config;
pub mod drain;
pub mod driver;
pub mod events;
pub mod http;
pub mod inbox;
pub mod memory;
pub mod metrics;
pub mod nodes;
pub mod outbox;
pub mod tls_link;

use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use tokio::net::TcpListener;
use tokio::sync::{Semaphore, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::Config;
use crate::driver::CoreMsg;

/// How the Edge is told to stop.
#[derive(Clone, Debug, Default)]
pub struct Stop {
    /// Drain: take no more callers or nodes, let the requests in flight finish within
    /// `limits.shutdown_grace_sec`, then stop ([`drain`]).
    pub drain: CancellationToken,
    /// Stop now, cutting whatever is in flight (also during a drain).
    pub now: CancellationToken,
}

/// Runs the Edge until told to `stop`: binds both listeners, then serves. SIGHUP (when
/// `reload` is set) reloads `config_path`.
pub async fn run(
    config: Config,
    config_path: PathBuf,
    stop: Stop,
    reload: bool,
) -> std::io::Result<()> {
    let clock = iop_shell_common::clock::Clock::new();
    let metrics = Arc::new(metrics::Metrics::default());
    let core = iop_proto_core::EdgeCore::new(config.core.clone())
        .map_err(|err| std::io::Error::other(err.to_string()))?;
    let node_listener = bind("listen.nodes", config.http.nodes_addr)?;
    let http_listener = bind("listen.http", config.http.http_addr)?;
    info!(
        http = %http_listener.local_addr()?,
        https = config.tls.http.is_some(),
        nodes = %node_listener.local_addr()?,
        nodes_tls = config.tls.nodes.is_some(),
        mutual_tls = config.core.admission.require_client_identity,
        models = config.core.models.len(),
        nodes_configured = config.core.nodes.len(),
        worker_threads = config.worker_threads.get(),
        "edge listening"
    );
    warn_about_exposure(&config);
    let start_only = StartOnly::of(&config);
    let pending_frame_len = Arc::new(std::sync::atomic::AtomicUsize::new(
        config.core.admission.pending_frame_len,
    ));
    let events = Arc::new(events::EventHub::default());
    let node_tls: nodes::TlsSlot = Arc::new(RwLock::new(config.tls.nodes.clone()));
    let http_tls: nodes::TlsSlot = Arc::new(RwLock::new(config.tls.http.clone()));
    let core = driver::Core::new(core, clock, metrics.clone(), events.clone());
    // The listeners stop when the Edge starts to drain; the node links, the timer and
    // reloads only once it stops.
    let stop_accepting = CancellationToken::new();
    let shutdown = CancellationToken::new();
    let state = Arc::new(http::State {
        core: core.clone(),
        permits: Arc::new(Semaphore::new(config.http.max_concurrent_requests)),
        settings: RwLock::new(Arc::new(config.http.clone())),
        budget: Arc::new(memory::Budget::new(config.http.max_inflight_bytes)),
        metrics: metrics.clone(),
        events: events.clone(),
        drain: Arc::default(),
    });
    let timer = tokio::spawn(core.clone().run_timer());
    tokio::spawn(nodes::serve(
        node_listener,
        nodes::Listener {
            core,
            metrics: metrics.clone(),
            tls: node_tls.clone(),
            handshake_timeout: config.core.timing.register_timeout,
            pending_frame_len: pending_frame_len.clone(),
            decode_errors: Arc::new(iop_shell_common::logging::LogLimiter::new(
                std::time::Duration::from_secs(10),
                5,
            )),
            stop_accepting: stop_accepting.clone(),
            shutdown: shutdown.clone(),
        },
    ));
    tokio::spawn(http::serve(
        http_listener,
        state.clone(),
        http_tls.clone(),
        stop_accepting.clone(),
    ));
    if reload {
        tokio::spawn(reload_on_sighup(
            config_path,
            start_only,
            state.clone(),
            [node_tls, http_tls],
            pending_frame_len,
            shutdown.clone(),
        ));
    }
    tokio::select! {
        () = stop.drain.cancelled() => {}
        () = stop.now.cancelled() => {}
    }
    stop_accepting.cancel();
    state.drain.begin();
    let open = state.drain.open();
    if !stop.now.is_cancelled() && open > 0 {
        let grace = state.settings().shutdown_grace;
        info!(
            open,
            grace_sec = grace.as_secs(),
            "draining: no new callers or nodes; waiting for the requests in flight (signal again to stop at once)"
        );
        tokio::select! {
            () = state.drain.idle() => info!("drained: every request in flight has ended"),
            () = tokio::time::sleep(grace) => warn!(
                open = state.drain.open(),
                "shutdown grace over: cutting the requests still in flight"
            ),
            () = stop.now.cancelled() => warn!(
                open = state.drain.open(),
                "stopping at once: cutting the requests still in flight"
            ),
        }
    }
    shutdown.cancel();
    drop(state);
    timer.abort();
    Ok(())
}

/// Connections the kernel queues before accept. A restarted Edge meets its whole fleet
/// at once; with a short backlog the overflow waits out a 1 s SYN retransmit. (Linux caps
/// it at `net.core.somaxconn`, 4096 by default.)
const LISTEN_BACKLOG: u32 = 4096;

/// Binds `addr`, naming the listener in the error (two listeners can fail the same way).
fn bind(key: &str, addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let listen = || {
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        // As std's bind does: a restarted Edge must not wait out TIME_WAIT.
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        socket.listen(LISTEN_BACKLOG)
    };
    listen().map_err(|err| std::io::Error::new(err.kind(), format!("{key} = \"{addr}\": {err}")))
}

/// Says loudly what an operator exposes without protection.
fn warn_about_exposure(config: &Config) {
    if config.tls.nodes.is_none() {
        warn!(
            nodes = %config.http.nodes_addr,
            "the node link is PLAINTEXT (listen.nodes_plaintext = true): node tokens, provider \
             keys, prompts and completions cross it in clear"
        );
    }
    let public = !config.http.http_addr.ip().is_loopback();
    if public && config.http.api_keys.is_empty() {
        warn!(
            http = %config.http.http_addr,
            "no [auth] api_keys: anyone who reaches the public listener can call every model"
        );
    }
    if public && config.tls.http.is_none() && !config.http.api_keys.is_empty() {
        warn!(
            http = %config.http.http_addr,
            "API keys travel in clear to the public listener: configure listen.http_tls, or \
             terminate TLS in front of the Edge"
        );
    }
}

/// What a reload cannot change: read at start and in force until a restart (the
/// listeners' addresses and kinds, and what was sized when they started).
#[derive(Clone, Debug, PartialEq, Eq)]
struct StartOnly {
    http_addr: std::net::SocketAddr,
    nodes_addr: std::net::SocketAddr,
    https: bool,
    nodes_tls: bool,
    max_concurrent_requests: usize,
    max_connections: usize,
    worker_threads: std::num::NonZeroUsize,
}

impl StartOnly {
    fn of(config: &Config) -> Self {
        StartOnly {
            http_addr: config.http.http_addr,
            nodes_addr: config.http.nodes_addr,
            https: config.tls.http.is_some(),
            nodes_tls: config.tls.nodes.is_some(),
            max_concurrent_requests: config.http.max_concurrent_requests,
            max_connections: config.http.max_connections,
            worker_threads: config.worker_threads,
        }
    }

    /// The keys `next` sets otherwise than the running Edge, which keeps its values.
    fn changed_in(&self, next: &Config) -> Vec<&'static str> {
        let next = Self::of(next);
        [
            (self.http_addr != next.http_addr, "listen.http"),
            (self.nodes_addr != next.nodes_addr, "listen.nodes"),
            (self.https != next.https, "listen.http_tls"),
            (self.nodes_tls != next.nodes_tls, "listen.nodes_plaintext"),
            (
                self.max_concurrent_requests != next.max_concurrent_requests,
                "limits.max_concurrent_requests",
            ),
            (
                self.max_connections != next.max_connections,
                "limits.max_connections",
            ),
            (
                self.worker_threads != next.worker_threads,
                "runtime.worker_threads",
            ),
        ]
        .into_iter()
        .filter_map(|(changed, key)| changed.then_some(key))
        .collect()
    }
}

/// Longest a reload waits for its files to be read and checked. A file that blocks (a
/// FIFO nobody writes, a hung network mount) refuses the reload after this long, and the
/// Edge serves throughout.
const RELOAD_READ_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// A configuration read that has not finished yet.
type Reading = tokio::task::JoinHandle<Result<Config, config::ConfigError>>;

/// Reads and checks the configuration at `path` for a reload on a blocking thread, so
/// the runtime's threads (one, on two CPUs) keep serving while files are opened and read,
/// certificates parsed and TLS set up; `None` when the reload is refused (logged). A read
/// still going after `limit` is left in `reading`: until it ends, later reloads are
/// refused rather than each leaving another thread on the same stuck file.
async fn load_for_reload(
    path: &std::path::Path,
    limit: std::time::Duration,
    reading: &mut Option<Reading>,
) -> Option<Config> {
    if reading.as_ref().is_some_and(|read| !read.is_finished()) {
        error!(
            config = %path.display(),
            "reload refused: an earlier reload is still reading its files; the running configuration stays in force"
        );
        return None;
    }
    let owned = path.to_owned();
    let mut read = tokio::task::spawn_blocking(move || Config::load(&owned));
    match tokio::time::timeout(limit, &mut read).await {
        Ok(Ok(Ok(config))) => Some(config),
        Ok(Ok(Err(err))) => {
            error!(error = %err, "reload refused: the running configuration stays in force");
            None
        }
        Ok(Err(err)) => {
            error!(error = %err, "reload refused: reading the configuration failed; the running configuration stays in force");
            None
        }
        Err(_) => {
            error!(
                config = %path.display(),
                limit_ms = limit.as_millis() as u64,
                "reload refused: its files were not read in time (a FIFO or a hung mount?); the running configuration stays in force"
            );
            *reading = Some(read);
            None
        }
    }
}

async fn reload_on_sighup(
    path: PathBuf,
    start_only: StartOnly,
    state: Arc<http::State>,
    [node_tls, http_tls]: [nodes::TlsSlot; 2],
    pending_frame_len: Arc<std::sync::atomic::AtomicUsize>,
    shutdown: CancellationToken,
) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        return;
    };
    let mut reading = None;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            got = hup.recv() => if got.is_none() { return },
        }
        info!(config = %path.display(), "SIGHUP: reloading configuration");
        let Some(config) = load_for_reload(&path, RELOAD_READ_LIMIT, &mut reading).await else {
            state.metrics.reload(false);
            continue;
        };
        let pending_frame = config.core.admission.pending_frame_len;
        let kept = start_only.changed_in(&config);
        let (reply, answer) = oneshot::channel();
        if state
            .core
            .send(CoreMsg::Reload {
                config: config.core,
                reply,
            })
            .is_err()
        {
            return;
        }
        match answer.await {
            Ok(Ok(diff)) => {
                state.metrics.reload(true);
                pending_frame_len.store(pending_frame, std::sync::atomic::Ordering::Relaxed);
                // New connections use the reloaded certificates; a listener keeps its
                // kind (TLS or plaintext) until a restart.
                for (tls, next) in [
                    (&node_tls, &config.tls.nodes),
                    (&http_tls, &config.tls.http),
                ] {
                    if let (Ok(mut current), Some(next)) = (tls.write(), next)
                        && current.is_some()
                    {
                        *current = Some(next.clone());
                    }
                }
                state.budget.set_max(config.http.max_inflight_bytes);
                if let Ok(mut settings) = state.settings.write() {
                    let mut next = config.http.clone();
                    // Listeners stay where they are bound, and keep what they were sized
                    // with.
                    next.http_addr = settings.http_addr;
                    next.nodes_addr = settings.nodes_addr;
                    next.max_concurrent_requests = settings.max_concurrent_requests;
                    next.max_connections = settings.max_connections;
                    *settings = Arc::new(next);
                }
                if !kept.is_empty() {
                    warn!(
                        keys = ?kept,
                        "reload: these settings change only at a restart; their running values stay"
                    );
                }
                info!(
                    added = ?diff.added_nodes,
                    removed = ?diff.removed_nodes,
                    refreshed = ?diff.changed_payloads,
                    models = ?diff.changed_models,
                    "configuration reloaded"
                );
            }
            Ok(Err(err)) => {
                state.metrics.reload(false);
                warn!(error = %err, "reload refused: the running configuration stays in force");
            }
            Err(_) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::{Duration, Instant};

    const CONFIG: &str = "[listen]\nhttp = \"127.0.0.1:8080\"\nnodes = \"127.0.0.1:7100\"\nnodes_plaintext = true\n\n[[nodes]]\nid = \"n1\"\ntoken = \"t-0123456789abcdef\"\n[[nodes.adapters]]\nname = \"mock\"\ntype = \"mock\"\ncapacity = 2\ntargets = [\"m\"]\n\n[[models]]\nname = \"chat\"\nproviders = [{ node = \"n1\", adapter = \"mock\", target = \"m\" }]\n";

    #[test]
    fn a_reload_names_the_settings_that_wait_for_a_restart() {
        let parse = |text: &str| {
            Config::parse(text, std::path::Path::new("edge.toml")).expect("valid config")
        };
        let running = StartOnly::of(&parse(CONFIG));
        assert!(running.changed_in(&parse(CONFIG)).is_empty());
        // What a reload applies is not listed.
        let applied = format!("{CONFIG}\n[limits]\nmax_body_bytes = 1024\nidle_timeout_sec = 5\n");
        assert!(running.changed_in(&parse(&applied)).is_empty());
        let kept = CONFIG
            .replace("127.0.0.1:8080", "127.0.0.1:8081")
            .replace("127.0.0.1:7100", "127.0.0.1:7101")
            + "\n[limits]\nmax_concurrent_requests = 7\nmax_connections = 9\n[runtime]\nworker_threads = 3\n";
        assert_eq!(
            running.changed_in(&parse(&kept)),
            [
                "listen.http",
                "listen.nodes",
                "limits.max_concurrent_requests",
                "limits.max_connections",
                "runtime.worker_threads",
            ]
        );
    }

    /// On the one thread of a current-thread runtime, as the Edge runs on two CPUs: if the
    /// reload read its files there, nothing else would run until they were read.
    #[tokio::test(flavor = "current_thread")]
    async fn a_reload_whose_file_never_ends_is_refused_in_time_while_the_edge_runs_on() {
        let dir = std::env::temp_dir().join(format!("iop-reload-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("edge.toml");
        let made = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .expect("mkfifo runs");
        assert!(made.success());

        let ticks = Arc::new(AtomicU32::new(0));
        let ticker = tokio::spawn({
            let ticks = Arc::clone(&ticks);
            async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    ticks.fetch_add(1, Ordering::Relaxed);
                }
            }
        });

        // Nobody writes the FIFO: opening it blocks, on a thread of the blocking pool.
        let mut reading = None;
        let started = Instant::now();
        let limit = Duration::from_millis(300);
        assert!(load_for_reload(&path, limit, &mut reading).await.is_none());
        assert!(started.elapsed() >= limit);
        assert!(
            ticks.load(Ordering::Relaxed) >= 10,
            "the runtime's thread ran other tasks meanwhile: {} ticks",
            ticks.load(Ordering::Relaxed)
        );
        assert!(reading.as_ref().is_some_and(|read| !read.is_finished()));

        // A second reload while the first still waits on the file: refused at once, with
        // no second thread left on it.
        let again = Instant::now();
        assert!(load_for_reload(&path, limit, &mut reading).await.is_none());
        assert!(again.elapsed() < limit, "{:?}", again.elapsed());

        // The writer comes: the stuck read ends (its late result is not applied), and
        // the next reload reads a regular file as usual.
        let fifo = path.clone();
        tokio::task::spawn_blocking(move || std::fs::write(fifo, CONFIG))
            .await
            .expect("joined")
            .expect("written to the FIFO");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !reading
            .as_ref()
            .is_some_and(tokio::task::JoinHandle::is_finished)
        {
            assert!(Instant::now() < deadline, "the stuck read never ended");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        std::fs::remove_file(&path).expect("fifo removed");
        std::fs::write(&path, CONFIG).expect("config written");
        let config = load_for_reload(&path, limit, &mut reading)
            .await
            .expect("a regular file reloads");
        assert_eq!(config.core.nodes.len(), 1);

        // An invalid file is refused without waiting for the limit.
        std::fs::write(&path, "[listen]\nnot toml").expect("written");
        assert!(
            load_for_reload(&path, Duration::from_secs(30), &mut reading)
                .await
                .is_none()
        );
        ticker.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
