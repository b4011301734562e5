//! The client keys' accounting (`iop_api::tenant`) in the Edge: behind a mutex
//! the request handlers take twice per request (admission, end), driven by the wall
//! clock, and kept in a file across restarts.
//!
//! The file (`[auth] usage_file`, by default `<config>.usage.json` beside the config
//! file) holds each key's rate windows, the budget it spent this period and its usage
//! per model and day. It is written, whole, to a temporary file renamed over it (a crash
//! leaves the old one or the new one, never half of either), at most every
//! [`SAVE_EVERY`] while keys are used and once more, flushed to the disk, when the Edge
//! stops; it is read at start, up to [`MAX_FILE`] bytes. The periodic writes are not
//! flushed (a killed process loses nothing the kernel holds; a lost machine loses what
//! it had not written back). A file that cannot be read or parsed is set aside
//! with a warning (renamed `.bad`), so a restart never fails on it and never overwrites
//! what an operator may want to look at.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use iop_api::tenant::{
    Admitted, ClusterKey, EdgeShare, KeyPolicy, KeyReport, Limited, RateLimits, Saved, Tenants,
    TokenUsage, UsageRow,
};
use iop_proto_core::Timestamp;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How often the file is written while keys are used.
pub const SAVE_EVERY: Duration = Duration::from_secs(1);
/// Largest usage file read at start.
pub const MAX_FILE: u64 = 64 << 20;

/// The tenants' accounting and where it is kept.
#[derive(Debug)]
pub struct TenantBook {
    tenants: Mutex<Tenants>,
    file: Mutex<Option<PathBuf>>,
    dirty: AtomicBool,
    /// When a failed write was last logged (once a minute while writes fail).
    warned: Mutex<Option<std::time::Instant>>,
}

/// The wall clock as the accounting reads it.
fn wall() -> Timestamp {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    Timestamp::from_millis(ms)
}

impl TenantBook {
    /// The accounting for `keys` serving `models`, with what `file` kept (if any).
    #[must_use]
    pub fn new(
        keys: Vec<(Arc<str>, KeyPolicy)>,
        models: Vec<Arc<str>>,
        file: Option<PathBuf>,
    ) -> Self {
        let mut tenants = Tenants::new(keys, models);
        if let Some(path) = &file
            && let Some(saved) = load(path)
        {
            if tenants.restore(wall(), saved) {
                info!(file = %path.display(), "key windows, budgets and usage restored");
            } else {
                warn!(file = %path.display(), "usage file of another version: starting afresh");
            }
        }
        TenantBook {
            tenants: Mutex::new(tenants),
            file: Mutex::new(file),
            dirty: AtomicBool::new(false),
            warned: Mutex::new(None),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Tenants> {
        self.tenants.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A request of `key` for `model`, estimated at `estimate` tokens: admitted (finish
    /// the ticket when it ends), or refused.
    pub fn admit(
        self: &Arc<Self>,
        key: &Arc<str>,
        model: &str,
        estimate: u64,
    ) -> Result<Ticket, Limited> {
        let admitted = self.lock().handle_admit(wall(), key, model, estimate)?;
        self.dirty.store(true, Ordering::Relaxed);
        Ok(Ticket {
            book: self.clone(),
            admitted: Some(admitted),
        })
    }

    /// Whether `key` may use `model`.
    #[must_use]
    pub fn may_use(&self, key: &str, model: &str) -> bool {
        self.lock().may_use(key, model)
    }

    /// Every key's state.
    #[must_use]
    pub fn report(&self) -> Vec<KeyReport> {
        self.lock().report(wall())
    }

    /// Usage per key, model and day.
    #[must_use]
    pub fn usage(&self) -> Vec<UsageRow> {
        self.lock().usage()
    }

    /// This Edge's figures, to publish to the cluster.
    #[must_use]
    pub fn share(&self) -> EdgeShare {
        self.lock().share(wall())
    }

    /// The other Edges' figures as read from etcd (`edges`: by Edge id, whether each
    /// still shares the limits; `members`: the Edges sharing them, this one included).
    pub fn handle_cluster(
        &self,
        members: u32,
        edges: std::collections::BTreeMap<String, (bool, EdgeShare)>,
    ) {
        self.lock().handle_cluster(wall(), members, edges);
    }

    /// etcd is unreachable: each Edge keeps to its share of every limit.
    pub fn handle_detached(&self) {
        self.lock().handle_detached();
    }

    /// Whether the limits are shared and etcd is unreachable.
    #[must_use]
    pub fn detached(&self) -> bool {
        self.lock().detached()
    }

    /// What this Edge published before a restart: the spend it had is spent.
    pub fn restore_share(&self, own: &EdgeShare) {
        self.lock().restore_share(wall(), own);
        self.dirty.store(true, Ordering::Relaxed);
    }

    /// Every key's figures across the cluster (empty on a single Edge).
    #[must_use]
    pub fn cluster_report(&self, edge_id: &str) -> std::collections::BTreeMap<String, ClusterKey> {
        self.lock().cluster_report(wall(), edge_id)
    }

    /// A reloaded configuration.
    pub fn reconfigure(
        &self,
        keys: Vec<(Arc<str>, KeyPolicy)>,
        models: Vec<Arc<str>>,
        file: Option<PathBuf>,
    ) {
        let mut tenants = self.lock();
        tenants.reconfigure(keys, models);
        let mut current = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        // A file named anew (the first named key, or another path) is read first: what
        // it kept applies to the keys it names.
        if let Some(path) = &file
            && current.as_ref() != Some(path)
            && let Some(saved) = load(path)
            && tenants.restore(wall(), saved)
        {
            info!(file = %path.display(), "key windows, budgets and usage restored");
        }
        *current = file;
        self.dirty.store(true, Ordering::Relaxed);
    }

    /// Writes the file if anything changed since it was last written (and flushes it to
    /// the disk when `durable`).
    pub async fn save_if_changed(self: &Arc<Self>, durable: bool) {
        if !self.dirty.swap(false, Ordering::Relaxed) {
            return;
        }
        let Some(path) = self
            .file
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        else {
            return;
        };
        let saved = self.lock().export();
        let written = tokio::task::spawn_blocking(move || {
            save(&path, &saved, durable).map_err(|e| (path, e))
        })
        .await;
        if let Ok(Err((path, err))) = written {
            let mut warned = self.warned.lock().unwrap_or_else(PoisonError::into_inner);
            if warned.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
                warn!(file = %path.display(), %err, "usage file not written; tried again every second, said once a minute");
                *warned = Some(std::time::Instant::now());
            }
            self.dirty.store(true, Ordering::Relaxed);
        }
    }

    /// A successor took over: the file is written one last time, durably, and never
    /// again by this process (the successor reads it and goes on from there). What
    /// requests still in flight here use afterwards is not carried over.
    pub async fn hand_over(self: &Arc<Self>) {
        self.dirty.store(true, Ordering::Relaxed);
        self.save_if_changed(true).await;
        *self.file.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// Reads the file again (the process taken over from wrote it last), replacing what
    /// this process counted meanwhile for the keys it names.
    pub fn reload(&self) {
        let file = self
            .file
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(path) = file
            && let Some(saved) = load(&path)
            && self.lock().restore(wall(), saved)
        {
            info!(file = %path.display(), "key windows, budgets and usage taken over");
        }
    }

    /// Writes the file every [`SAVE_EVERY`] while keys are used, and once more when
    /// `stop` is cancelled.
    pub async fn keep(self: Arc<Self>, stop: CancellationToken) {
        loop {
            tokio::select! {
                () = tokio::time::sleep(SAVE_EVERY) => self.save_if_changed(false).await,
                () = stop.cancelled() => {
                    self.save_if_changed(true).await;
                    return;
                }
            }
        }
    }
}

/// An admitted request; finish it when the request ends (dropped unfinished, it
/// finishes with no usage reported).
#[derive(Debug)]
pub struct Ticket {
    book: Arc<TenantBook>,
    admitted: Option<Admitted>,
}

impl Ticket {
    /// The key's rate limits right after this admission.
    #[must_use]
    pub fn limits(&self) -> RateLimits {
        self.admitted.as_ref().map(|a| a.limits).unwrap_or_default()
    }

    /// The request ended; its provider reported `usage` (if it did).
    pub fn finish(mut self, usage: Option<TokenUsage>) {
        self.end(usage);
    }

    fn end(&mut self, usage: Option<TokenUsage>) {
        if let Some(admitted) = self.admitted.take() {
            self.book.lock().handle_finish(wall(), admitted, usage);
            self.book.dirty.store(true, Ordering::Relaxed);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.end(None);
    }
}

/// What `path` kept, if it is there and readable; an unreadable file is set aside.
fn load(path: &Path) -> Option<Saved> {
    let bytes = match read_limited(path) {
        Ok(Some(bytes)) => bytes,
        Ok(None) => return None,
        Err(err) => {
            set_aside(path, &err.to_string());
            return None;
        }
    };
    match serde_json::from_slice(&bytes) {
        Ok(saved) => Some(saved),
        Err(err) => {
            set_aside(path, &err.to_string());
            None
        }
    }
}

/// The file's bytes, up to [`MAX_FILE`]; `None` when there is no file.
fn read_limited(path: &Path) -> std::io::Result<Option<Vec<u8>>> {
    use std::io::Read;
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(err),
    };
    let mut bytes = Vec::new();
    file.take(MAX_FILE + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_FILE {
        return Err(std::io::Error::other(format!(
            "larger than {MAX_FILE} bytes"
        )));
    }
    Ok(Some(bytes))
}

fn set_aside(path: &Path, err: &str) {
    let bad = path.with_extension("json.bad");
    let moved = std::fs::rename(path, &bad).is_ok();
    warn!(file = %path.display(), error = err, set_aside = moved, "usage file unreadable: starting afresh");
}

/// Writes `saved` to `path` through a temporary file renamed over it, flushed to the
/// disk first when `durable`.
fn save(path: &Path, saved: &Saved, durable: bool) -> std::io::Result<()> {
    let text = serde_json::to_vec(saved).map_err(std::io::Error::other)?;
    let tmp = path.with_extension("json.tmp");
    {
        use std::io::Write;
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(&text)?;
        if durable {
            file.sync_all()?;
        }
    }
    std::fs::rename(&tmp, path)
}
