//! The IOP Edge shell: IO around [`iop_proto_core::EdgeCore`].
//!
//! - [`config`]: the TOML configuration.
//! - [`certgen`]: `iop-edge gen-cert`, certificates for the node link.
//! - [`driver`]: the core behind one lock, and what routes its outputs.
//! - [`nodes`]: the node listener (a reader task per connection).
//! - [`outbox`]: a node connection's outgoing frames, written together by its writer task.
//! - [`http`]: the OpenAI-compatible HTTP surface, status, metrics and health.
//! - [`memory`]: the budget of request bodies and buffered response bytes.
//! - [`limit`]: the concurrency limits a reload may resize.
//! - [`drain`]: stopping without cutting the requests in flight off.
//! - `reload`: SIGHUP, the configuration read again.
//! - [`cluster`], [`etcd`]: several Edges as one fabric through etcd (docs/cluster.md).
//! - [`upgrade`]: handing the listeners to a successor process (`--takeover`).

#![forbid(unsafe_code)]

pub mod certgen;
pub mod cluster;
pub mod config;
pub mod conn;
pub mod drain;
pub mod driver;
pub mod etcd;
pub mod events;
pub mod http;
pub mod inbox;
mod key_sync;
pub mod limit;
pub mod membership;
pub mod memory;
pub mod metrics;
pub mod nodes;
pub mod outbox;
mod reload;
pub(crate) mod response_ids;
pub mod status;
pub mod tenants;
pub mod tls_link;
pub mod traces;
pub mod upgrade;

use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::Config;

/// How the Edge is told to stop.
#[derive(Clone, Debug, Default)]
pub struct Stop {
    /// Drain: take no more callers or nodes, let the requests in flight finish within
    /// `limits.shutdown_grace_sec`, then stop ([`drain`]).
    pub drain: CancellationToken,
    /// Stop now, cutting whatever is in flight (also during a drain).
    pub now: CancellationToken,
}

/// Runs the Edge until told to `stop`: binds both listeners (or, with `takeover`, takes
/// them from the Edge running on `listen.upgrade_socket`, see [`upgrade`]), then serves,
/// until told to stop or until a successor takes over. SIGHUP (when `reload` is set)
/// reloads `config_path`.
pub async fn run(
    config: Config,
    config_path: PathBuf,
    stop: Stop,
    reload: bool,
    takeover: bool,
) -> std::io::Result<()> {
    let clock = iop_shell_common::clock::Clock::new();
    let metrics = Arc::new(metrics::Metrics::default());
    let core = iop_proto_core::EdgeCore::new(config.core.clone())
        .map_err(|err| std::io::Error::other(err.to_string()))?;
    let taken = if takeover {
        let path = config.upgrade_socket.clone();
        let taken = tokio::task::spawn_blocking(move || upgrade::take(&path))
            .await
            .map_err(std::io::Error::other)?
            .map_err(|err| {
                std::io::Error::new(
                    err.kind(),
                    format!(
                        "taking over from the edge on {}: {err}",
                        config.upgrade_socket.display()
                    ),
                )
            })?;
        if taken.is_none() {
            info!(socket = %config.upgrade_socket.display(), "no running edge to take over from: starting afresh");
        }
        taken
    } else {
        None
    };
    let (node_listener, http_listener, taken) = match taken {
        Some(taken) => {
            let nodes = adopt("listen.nodes", config.http.nodes_addr, &taken.nodes)?;
            let http = adopt("listen.http", config.http.http_addr, &taken.http)?;
            (nodes, http, Some(taken))
        }
        None => (
            bind("listen.nodes", config.http.nodes_addr)?,
            bind("listen.http", config.http.http_addr)?,
            None,
        ),
    };
    let offered = [
        http_listener.as_fd().try_clone_to_owned()?,
        node_listener.as_fd().try_clone_to_owned()?,
    ];
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
    let start_only = reload::StartOnly::of(&config);
    let pending_frame_len = Arc::new(std::sync::atomic::AtomicUsize::new(
        config.core.admission.pending_frame_len,
    ));
    let events = Arc::new(events::EventHub::default());
    let node_tls: nodes::TlsSlot = Arc::new(RwLock::new(config.tls.nodes.clone()));
    let http_tls: nodes::TlsSlot = Arc::new(RwLock::new(config.tls.http.clone()));
    let core = driver::Core::new(core, clock, metrics.clone(), events.clone());
    let cluster = config.cluster.as_ref().map(membership::handle);
    if let Some((handle, _)) = &cluster {
        core.enable_cluster(handle.tx.clone())
            .map_err(|_| std::io::Error::other("the core stopped"))?;
    }
    // The listeners stop when the Edge starts to drain; the node links, the timer and
    // reloads only once it stops.
    let stop_accepting = CancellationToken::new();
    let shutdown = CancellationToken::new();
    let tenants = Arc::new(tenants::TenantBook::new(
        config.http.tenants(),
        config
            .core
            .models
            .keys()
            .map(|m| Arc::from(m.as_str()))
            .collect(),
        config.http.usage_file.clone(),
    ));
    let tracer = match config.traces.clone() {
        Some(export) => traces::Tracer::start(export, shutdown.clone()),
        None => traces::Tracer::disabled(),
    };
    let state = Arc::new(http::State {
        tracer,
        tenants: tenants.clone(),
        core: core.clone(),
        permits: limit::Limit::new(config.http.max_concurrent_requests),
        connections: limit::Limit::new(config.http.max_connections),
        settings: RwLock::new(Arc::new(config.http.clone())),
        budget: Arc::new(memory::Budget::new(config.http.max_inflight_bytes)),
        metrics: metrics.clone(),
        events: events.clone(),
        drain: Arc::default(),
        cluster: cluster.as_ref().map(|(handle, _)| handle.view.clone()),
        responses: Arc::new(std::sync::Mutex::new(iop_api::responses::Store::new(
            config.http.responses_store.0,
            config.http.responses_store.1,
        ))),
        timers: Arc::default(),
    });
    let timer = tokio::spawn(core.clone().run_timer());
    let kept = tokio::spawn(tenants.clone().keep(shutdown.clone()));
    let reloader = reload::Reloader {
        start_only,
        state: state.clone(),
        tls: [node_tls.clone(), http_tls.clone()],
        pending_frame_len: pending_frame_len.clone(),
        shared: Arc::default(),
    };
    let cluster_task = match (cluster, config.cluster.clone()) {
        (Some((handle, rx)), Some(settings)) => Some(tokio::spawn(cluster::run(
            settings,
            cluster::Parts {
                core: core.clone(),
                reloader: reloader.clone(),
                config_path: config_path.clone(),
                handle,
                rx,
                shutdown: shutdown.clone(),
                tenants: tenants.clone(),
            },
        ))),
        _ => None,
    };
    if taken.is_some()
        && let Some(view) = &state.cluster
        && !view.serving_within(TAKEOVER_CLUSTER_WAIT).await
    {
        // Taking the listeners without the cluster's configuration would turn the nodes
        // the running process re-homes here away: it serves on instead.
        shutdown.cancel();
        if let Some(task) = cluster_task {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(3), task).await;
        }
        return Err(std::io::Error::other(format!(
            "not taking over: the cluster's shared configuration did not arrive within {} s \
             (is etcd reachable?); the running edge serves on",
            TAKEOVER_CLUSTER_WAIT.as_secs()
        )));
    }
    let node_accepting = tokio::spawn(nodes::serve(
        node_listener,
        nodes::Listener {
            core: core.clone(),
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
    let http_accepting = tokio::spawn(http::serve(
        http_listener,
        state.clone(),
        http_tls.clone(),
        stop_accepting.clone(),
    ));
    if let Some(taken) = taken {
        // Serving: the process taken over from stops accepting, then the keys' state it
        // wrote last is read (it writes no more).
        match tokio::task::spawn_blocking(move || taken.ready()).await {
            Ok(Ok(arrivals)) => {
                info!("took over: the previous edge no longer accepts");
                receive_moved(arrivals, state.clone());
            }
            Ok(Err(err)) => {
                warn!(%err, "the previous edge did not confirm the hand-over (gone?); serving on")
            }
            Err(err) => warn!(%err, "hand-over task failed; serving on"),
        }
        tenants.reload();
    }
    let mut offer = Box::pin(upgrade::offer(config.upgrade_socket.clone(), offered));
    let mut upgradable = true;
    if reload {
        tokio::spawn(reload::on_sighup(config_path, reloader, shutdown.clone()));
    }
    let successor = loop {
        tokio::select! {
            () = stop.drain.cancelled() => break None,
            () = stop.now.cancelled() => break None,
            successor = &mut offer, if upgradable => match successor {
                Some(successor) => break Some(successor),
                None => upgradable = false,
            },
        }
    };
    // Its copies of the listeners close with it: a stopping Edge refuses connections.
    drop(offer);
    stop_accepting.cancel();
    let handed_over = successor.is_some();
    let mut moving = None;
    if let Some(successor) = successor {
        // The successor serves on the listeners: stop accepting on them, then let it go
        // on. Connections still open here finish their request and close.
        let _ = node_accepting.await;
        let _ = http_accepting.await;
        tenants.hand_over().await;
        let (mover, moves) = successor.done();
        state.drain.hand_over(mover);
        moving = Some(moves);
        info!("handing over: the successor accepts now; requests in flight here run to their end");
        // Requests still arriving on connections open here are served while the nodes
        // stay: until every connection has moved or is busy, every request has reached
        // the core and nothing waits for capacity, for a moment at most. Then the nodes
        // re-home and this process drains.
        let quiet_by = tokio::time::Instant::now() + state.settings().handover_quiet;
        while tokio::time::Instant::now() < quiet_by && !stop.now.is_cancelled() {
            let (reply, waiting) = tokio::sync::oneshot::channel();
            let _ = core.send(driver::CoreMsg::Waiting { reply });
            let waiting = waiting.await.unwrap_or(0);
            if waiting == 0
                && state.drain.arriving() == 0
                && state.connections.held() <= state.drain.open()
            {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let _ = core.send(driver::CoreMsg::Rehome);
        info!(
            open = state.drain.open(),
            "nodes told to re-home to the successor"
        );
    }
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
    if let Some(moving) = moving {
        // A connection whose last request just ended moves on its way out: wait for the
        // connections still held here (bounded), then for the moves queued, so that none
        // closes with this process.
        let by = tokio::time::Instant::now() + MOVE_GRACE;
        while state.connections.held() > 0
            && tokio::time::Instant::now() < by
            && !stop.now.is_cancelled()
        {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        if moving.finish(MOVE_GRACE).await.is_none() {
            warn!("upgrade: the last connections did not move in time; they close");
        }
    }
    if !handed_over && upgradable {
        // No successor will listen there.
        let _ = std::fs::remove_file(&config.upgrade_socket);
    }
    shutdown.cancel();
    if let Some(task) = cluster_task {
        // It revokes its lease on the way out (bounded by its request deadline).
        let _ = tokio::time::timeout(std::time::Duration::from_secs(3), task).await;
    }
    drop(state);
    timer.abort();
    // The keys' windows, budgets and usage, written one last time.
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), kept).await;
    Ok(())
}

/// Serves the connections the process taken over from moves here, as they arrive (a
/// thread receives them: the exchange blocks).
fn receive_moved(arrivals: upgrade::Arrivals, state: Arc<http::State>) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<upgrade::Moved>();
    let spawned = std::thread::Builder::new()
        .name("iop-edge-arrivals".into())
        .spawn(move || arrivals.receive(|moved| drop(tx.send(moved))));
    if let Err(err) = spawned {
        warn!(%err, "cannot receive the previous edge's connections");
        return;
    }
    tokio::spawn(async move {
        let mut count = 0u64;
        while let Some(moved) = rx.recv().await {
            count += 1;
            http::serve_moved(moved, state.clone()).await;
        }
        info!(
            connections = count,
            "the previous edge has moved its last connection"
        );
    });
}

/// How long a process that handed over waits, once its requests have ended, for its last
/// connections to move to the successor.
const MOVE_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a cluster Edge taking over waits for the cluster's shared configuration
/// before it takes the listeners' callers and nodes (within the 30 s the running process
/// waits for its successor): without it, it gives up and the running process serves on.
const TAKEOVER_CLUSTER_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// An inherited listener, checked against the address the configuration names: a new
/// address in the configuration is bound afresh (the inherited one closes with the
/// process it came from).
fn adopt(
    key: &str,
    addr: std::net::SocketAddr,
    inherited: &std::net::TcpListener,
) -> std::io::Result<TcpListener> {
    let local = inherited.local_addr()?;
    if local != addr && addr.port() != 0 {
        warn!(key, inherited = %local, configured = %addr, "the configuration names another address: binding it afresh");
        return bind(key, addr);
    }
    TcpListener::from_std(inherited.try_clone()?)
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
    if config.http.admin_keys.is_empty() {
        if config.http.admin_loopback {
            warn!(
                "no [auth] admin_keys and admin_loopback = true: status, metrics, usage, events \
                 and node commands answer any caller on this host without a key (never \
                 with a proxy on the same host)"
            );
        } else {
            info!(
                "no [auth] admin_keys: status, metrics, usage, events and node commands answer \
                 nobody (set admin_keys, or admin_loopback = true for local use)"
            );
        }
    }
    let public = !config.http.http_addr.ip().is_loopback();
    if public && !config.http.keys_required() {
        warn!(
            http = %config.http.http_addr,
            "no [auth] api_keys: anyone who reaches the public listener can call every model"
        );
    }
    if public && config.tls.http.is_none() && config.http.keys_required() {
        warn!(
            http = %config.http.http_addr,
            "API keys travel in clear to the public listener: configure listen.http_tls, or \
             terminate TLS in front of the Edge"
        );
    }
}
