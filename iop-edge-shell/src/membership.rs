//! What the cluster task shares with the rest of the Edge: the inputs it takes (the
//! core's claims and releases, etcd's answers), and the view of the cluster it keeps for
//! `/healthz`, `/v1/status` and the dashboard. The task itself is the `cluster` module.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use iop_proto_core::ConnId;
use iop_proto_core::cluster::{Reply, Tag, WatchEvent};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::config::ClusterSettings;

/// An input for the cluster task.
#[derive(Debug)]
pub enum Input {
    /// etcd answered a request.
    Reply(Tag, Reply),
    /// The watch delivered changes (of watch `epoch`).
    Watch(u64, Vec<WatchEvent>),
    /// The watch `epoch` broke.
    WatchLost(u64),
    /// The core asks whether `instance` of `node_id` may be served (a register on `conn`).
    Claim {
        /// The connection waiting.
        conn: ConnId,
        /// The node id.
        node_id: Arc<str>,
        /// The node process.
        instance: u64,
    },
    /// Nothing here serves `instance` of `node_id` any more.
    Release {
        /// The node id.
        node_id: Arc<str>,
        /// The node process.
        instance: u64,
    },
}

/// What an Edge publishes under its member key.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberInfo {
    /// Its id (from the key).
    #[serde(default, skip_deserializing)]
    pub edge_id: String,
    /// Where nodes dial it.
    pub node_addr: String,
    /// Where callers reach it.
    pub http_addr: String,
    /// Its version.
    pub version: String,
}

/// The cluster as this Edge sees it: for `/healthz`, `/v1/status` and the dashboard.
#[derive(Debug)]
pub struct ClusterView {
    /// This Edge's id.
    pub edge_id: String,
    pub(crate) member: AtomicBool,
    /// It serves callers: a member, or one that lost its lease and serves on.
    pub(crate) serves: AtomicBool,
    /// Unix ms since which it serves without its lease (0: it holds it).
    pub(crate) detached_since: AtomicU64,
    /// Unix ms since which etcd has not answered it (0: etcd answers).
    pub(crate) unanswered_since: AtomicU64,
    /// It may serve: a member with the cluster's shared configuration in (set once).
    pub(crate) serving: AtomicBool,
    pub(crate) current: AtomicBool,
    inner: RwLock<ViewInner>,
    /// The key response ids are signed with, once read from etcd.
    responses_key: std::sync::OnceLock<ring::hmac::Key>,
}

#[derive(Debug, Default, Clone)]
pub(crate) struct ViewInner {
    pub(crate) members: Vec<MemberInfo>,
    pub(crate) config_revision: u64,
    pub(crate) config_refused: Option<(u64, String)>,
}

/// A copy of the view, for a status answer.
#[derive(Debug, Clone, Serialize)]
pub struct ViewSnapshot {
    /// This Edge's id.
    pub edge_id: String,
    /// Whether it is a member now (holds its lease; may admit new node instances).
    pub member: bool,
    /// Whether it serves callers: a member, or one that lost its lease and serves on
    /// with the nodes, configuration and members it last knew.
    pub serving: bool,
    /// Since when (Unix ms) it has served without its lease; absent while it holds it.
    pub detached_since_unix_ms: Option<u64>,
    /// Since when (Unix ms) etcd has not answered it; absent while etcd answers.
    pub etcd_unreachable_since_unix_ms: Option<u64>,
    /// The members, sorted by id.
    pub members: Vec<MemberInfo>,
    /// Whether `members` is the cluster as it is now (the watch runs); `false` while this
    /// Edge cannot read etcd, when they are the last it saw.
    pub members_current: bool,
    /// The etcd revision of the shared configuration in force (0: the local file's).
    pub config_revision: u64,
    /// The last shared configuration refused here: its revision and why.
    pub config_refused: Option<(u64, String)>,
}

impl ClusterView {
    fn new(edge_id: &str) -> Self {
        ClusterView {
            edge_id: edge_id.to_owned(),
            member: AtomicBool::new(false),
            serves: AtomicBool::new(false),
            detached_since: AtomicU64::new(0),
            unanswered_since: AtomicU64::new(0),
            serving: AtomicBool::new(false),
            current: AtomicBool::new(false),
            inner: RwLock::default(),
            responses_key: std::sync::OnceLock::new(),
        }
    }

    /// The key response ids are signed with, once known.
    pub(crate) fn responses_key(&self) -> Option<&ring::hmac::Key> {
        self.responses_key.get()
    }

    /// The key response ids are signed with, read from etcd (set once).
    pub(crate) fn set_responses_key(&self, key: ring::hmac::Key) {
        let _ = self.responses_key.set(key);
    }

    /// Whether this Edge is a member now: it holds its etcd lease.
    #[must_use]
    pub fn is_member(&self) -> bool {
        self.member.load(Ordering::Relaxed)
    }

    /// Whether this Edge serves callers: a member, or one that lost its lease and serves
    /// on ([`ClusterMember::serves`](iop_proto_core::cluster::ClusterMember::serves));
    /// false before it first joined. Its `/healthz` answers 200 only then.
    #[must_use]
    pub fn serves(&self) -> bool {
        self.serves.load(Ordering::Relaxed)
    }

    /// Whether this Edge has served as a member with the cluster's shared configuration
    /// in ([`ClusterMember::is_serving`](iop_proto_core::cluster::ClusterMember::is_serving)); it stays true once it was.
    #[must_use]
    pub fn has_served(&self) -> bool {
        self.serving.load(Ordering::Relaxed)
    }

    /// Waits until [`Self::has_served`], at most `limit`; whether it did.
    pub async fn serving_within(&self, limit: std::time::Duration) -> bool {
        let by = tokio::time::Instant::now() + limit;
        while !self.has_served() {
            if tokio::time::Instant::now() >= by {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        true
    }

    /// A copy for a status answer.
    #[must_use]
    pub fn snapshot(&self) -> ViewSnapshot {
        let inner = self.inner.read().map(|i| i.clone()).unwrap_or_default();
        ViewSnapshot {
            edge_id: self.edge_id.clone(),
            member: self.is_member(),
            serving: self.serves(),
            detached_since_unix_ms: Some(self.detached_since.load(Ordering::Relaxed))
                .filter(|&ms| ms > 0),
            etcd_unreachable_since_unix_ms: Some(self.unanswered_since.load(Ordering::Relaxed))
                .filter(|&ms| ms > 0),
            members: inner.members,
            members_current: self.current.load(Ordering::Relaxed),
            config_revision: inner.config_revision,
            config_refused: inner.config_refused,
        }
    }

    pub(crate) fn update(&self, f: impl FnOnce(&mut ViewInner)) {
        if let Ok(mut inner) = self.inner.write() {
            f(&mut inner);
        }
    }
}

/// The cluster task's handles: its input and what it shows.
#[derive(Debug, Clone)]
pub struct Handle {
    /// Where the core's claims and releases go.
    pub tx: mpsc::UnboundedSender<Input>,
    /// What it shows.
    pub view: Arc<ClusterView>,
}

/// Makes the cluster task's handles before the task runs (the core needs the sender).
pub fn handle(settings: &ClusterSettings) -> (Handle, mpsc::UnboundedReceiver<Input>) {
    let (tx, rx) = mpsc::unbounded_channel();
    (
        Handle {
            tx,
            view: Arc::new(ClusterView::new(&settings.edge_id)),
        },
        rx,
    )
}

/// The wall clock, in Unix milliseconds.
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
