//! `SIGHUP`: the Edge reloads its configuration file. The file, and every file it names,
//! is read and checked off the event loop under a time limit; what the core keeps (nodes,
//! models, adapters, timings) goes to it as one `Reload`, whose answer lists the nodes to
//! refresh; certificates, keys and limits apply to new connections and requests (the
//! concurrency limits shrink as requests and connections above them end); what was set
//! up at start (the listeners' addresses and kinds, the runtime's threads) waits for a
//! restart, and the reload says so.

use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::{self, Config};
use crate::conn::TlsSlot;
use crate::driver::CoreMsg;
use crate::http;

/// What a reload cannot change: read at start and in force until a restart (the
/// listeners' addresses and kinds, and the runtime's threads).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StartOnly {
    http_addr: std::net::SocketAddr,
    nodes_addr: std::net::SocketAddr,
    https: bool,
    nodes_tls: bool,
    worker_threads: std::num::NonZeroUsize,
}

impl StartOnly {
    pub(crate) fn of(config: &Config) -> Self {
        StartOnly {
            http_addr: config.http.http_addr,
            nodes_addr: config.http.nodes_addr,
            https: config.tls.http.is_some(),
            nodes_tls: config.tls.nodes.is_some(),
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
                limit_ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX),
                "reload refused: its files were not read in time (a FIFO or a hung mount?); the running configuration stays in force"
            );
            *reading = Some(read);
            None
        }
    }
}

/// Applies a configuration read afresh: what the core keeps through the core, TLS for
/// new connections, limits and settings; names what waits for a restart. Shared by
/// SIGHUP and, in a cluster, the configuration etcd delivers.
#[derive(Clone)]
pub(crate) struct Reloader {
    pub(crate) start_only: StartOnly,
    pub(crate) state: Arc<http::State>,
    pub(crate) tls: [TlsSlot; 2],
    pub(crate) pending_frame_len: Arc<std::sync::atomic::AtomicUsize>,
    /// In a cluster, the shared configuration's text in force (from etcd), which a
    /// SIGHUP keeps over the local file's shared sections.
    pub(crate) shared: Arc<std::sync::Mutex<Option<String>>>,
}

impl Reloader {
    /// The shared text in force, if a cluster delivered one.
    pub(crate) fn shared(&self) -> Option<String> {
        self.shared.lock().ok().and_then(|s| s.clone())
    }

    /// Applies `config`; `Err` (the running configuration stays) when the core refuses it.
    pub(crate) async fn apply(&self, config: Config) -> Result<(), String> {
        let state = &self.state;
        let start_only = &self.start_only;
        let [node_tls, http_tls] = &self.tls;
        let pending_frame = config.core.admission.pending_frame_len;
        let models: Vec<Arc<str>> = config
            .core
            .models
            .keys()
            .map(|m| Arc::from(m.as_str()))
            .collect();
        let kept = start_only.changed_in(&config);
        let (reply, answer) = oneshot::channel();
        if state
            .core
            .send(CoreMsg::Reload {
                config: Box::new(config.core),
                reply,
            })
            .is_err()
        {
            return Err("the core stopped".to_owned());
        }
        match answer.await {
            Ok(Ok(diff)) => {
                state.metrics.reload(true);
                self.pending_frame_len
                    .store(pending_frame, std::sync::atomic::Ordering::Relaxed);
                // New connections use the reloaded certificates; a listener keeps its
                // kind (TLS or plaintext) until a restart.
                for (tls, next) in [(node_tls, &config.tls.nodes), (http_tls, &config.tls.http)] {
                    if let (Ok(mut current), Some(next)) = (tls.write(), next)
                        && current.is_some()
                    {
                        *current = Some(next.clone());
                    }
                }
                state.tenants.reconfigure(
                    config.http.tenants(),
                    models,
                    config.http.usage_file.clone(),
                );
                state.budget.set_max(config.http.max_inflight_bytes);
                if let Ok(mut store) = state.responses.lock() {
                    let (entries, bytes) = config.http.responses_store;
                    store.resize(entries, bytes);
                }
                state.permits.set(config.http.max_concurrent_requests);
                state.connections.set(config.http.max_connections);
                if let Ok(mut settings) = state.settings.write() {
                    let mut next = config.http.clone();
                    // Listeners stay where they are bound.
                    next.http_addr = start_only.http_addr;
                    next.nodes_addr = start_only.nodes_addr;
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
                Ok(())
            }
            Ok(Err(err)) => {
                state.metrics.reload(false);
                warn!(error = %err, "reload refused: the running configuration stays in force");
                Err(err)
            }
            Err(_) => Err("the core stopped".to_owned()),
        }
    }
}

/// Reloads the configuration at `path` on every SIGHUP until `shutdown` (in a cluster,
/// with the shared sections etcd delivered last).
pub(crate) async fn on_sighup(path: PathBuf, reloader: Reloader, shutdown: CancellationToken) {
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
        let Some(mut config) = load_for_reload(&path, RELOAD_READ_LIMIT, &mut reading).await else {
            reloader.state.metrics.reload(false);
            continue;
        };
        if let Some(shared) = reloader.shared() {
            let local = path.clone();
            let merged = tokio::task::spawn_blocking(move || {
                let text = iop_shell_common::config::read(&local)?;
                Config::parse_shared(&text, &shared, &local)
            })
            .await;
            match merged {
                Ok(Ok(merged)) => config = merged,
                Ok(Err(err)) => {
                    error!(error = %err, "reload refused: with the cluster's shared configuration; the running configuration stays in force");
                    reloader.state.metrics.reload(false);
                    continue;
                }
                Err(_) => continue,
            }
        }
        let _ = reloader.apply(config).await;
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
        // What a reload applies is not listed, the concurrency limits included.
        let applied = format!(
            "{CONFIG}\n[limits]\nmax_body_bytes = 1024\nidle_timeout_sec = 5\nmax_concurrent_requests = 7\nmax_connections = 9\n"
        );
        assert!(running.changed_in(&parse(&applied)).is_empty());
        let kept = CONFIG
            .replace("127.0.0.1:8080", "127.0.0.1:8081")
            .replace("127.0.0.1:7100", "127.0.0.1:7101")
            + "\n[runtime]\nworker_threads = 3\n";
        assert_eq!(
            running.changed_in(&parse(&kept)),
            ["listen.http", "listen.nodes", "runtime.worker_threads"]
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
