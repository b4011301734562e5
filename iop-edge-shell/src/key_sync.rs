//! Cluster mode: the client keys' figures shared through etcd (docs/cluster.md, "Keys
//! across the cluster"; the rules are `iop_api::tenant`'s). Every [`SYNC_EVERY`] this
//! Edge writes its own figures to `<prefix>/usage/<edge id>` (one put, whatever the
//! request rate), reads every Edge's, and hands the others' to its accounting. A document
//! written within [`LIVE`] is an Edge sharing the limits now; an older one is an Edge
//! gone, whose budget spend still counts. At start the Edge takes back the spend its own
//! document holds. When etcd does not answer [`DETACHED_AFTER`] syncs in a row, each
//! Edge keeps to its share of each limit until it does again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use iop_api::tenant::EdgeShare;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::etcd::Etcd;
use crate::tenants::TenantBook;

/// How often the figures are written and read.
pub(crate) const SYNC_EVERY: Duration = Duration::from_secs(1);
/// A document older than this is an Edge that no longer shares the limits.
pub(crate) const LIVE: Duration = Duration::from_secs(5);
/// Syncs failed in a row after which each Edge keeps to its share.
pub(crate) const DETACHED_AFTER: u32 = 3;
/// Largest document read (a key's figures take about 200 bytes).
const MAX_DOCUMENT: usize = 4 << 20;

/// Writes to etcd made by the key sync since the Edge started (for `/metrics`).
pub(crate) static WRITES: AtomicU64 = AtomicU64::new(0);

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Shares `tenants`' figures through etcd under `prefix` as `edge_id` until `shutdown`.
pub(crate) async fn run(
    etcd: Arc<Etcd>,
    prefix: String,
    edge_id: String,
    tenants: Arc<TenantBook>,
    shutdown: CancellationToken,
) {
    let own = format!("{prefix}/usage/{edge_id}");
    let all = format!("{prefix}/usage/");
    // What this Edge spent before it restarted.
    for _ in 0..DETACHED_AFTER {
        match etcd.get(&own).await {
            Ok((_, Some(kv))) => {
                if let Ok(share) = serde_json::from_slice::<EdgeShare>(&kv.value) {
                    tenants.restore_share(&share);
                    info!(
                        edge_id,
                        "cluster: this Edge's key spend taken back from etcd"
                    );
                }
                break;
            }
            Ok((_, None)) => break,
            Err(err) => warn!(error = %err, "cluster: cannot read this Edge's key spend yet"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(SYNC_EVERY) => {}
        }
    }
    let mut failed = 0u32;
    loop {
        let share = tenants.share();
        let body = serde_json::to_vec(&share).unwrap_or_default();
        let wrote = etcd.put(&own, &body, 0).await;
        if wrote.is_ok() {
            WRITES.fetch_add(1, Ordering::Relaxed);
        }
        let read = etcd.range(&all).await;
        match (wrote, read) {
            (Ok(_), Ok((_, kvs))) => {
                if failed >= DETACHED_AFTER {
                    info!("cluster: etcd answers again; keys are limited across the cluster");
                }
                failed = 0;
                let now = wall_ms();
                let mut edges = BTreeMap::new();
                for kv in kvs {
                    let Some(id) = kv.key.strip_prefix(&all) else {
                        continue;
                    };
                    if id == edge_id || kv.value.len() > MAX_DOCUMENT {
                        continue;
                    }
                    let Ok(share) = serde_json::from_slice::<EdgeShare>(&kv.value) else {
                        continue;
                    };
                    let live = now.saturating_sub(share.at_ms) <= LIVE.as_millis() as u64;
                    edges.insert(id.to_owned(), (live, share));
                }
                let members = 1 + edges.values().filter(|(live, _)| *live).count();
                tenants.handle_cluster(u32::try_from(members).unwrap_or(u32::MAX), edges);
            }
            (wrote, read) => {
                failed += 1;
                if failed == DETACHED_AFTER {
                    let error = wrote.err().or(read.err()).map(|e| e.to_string());
                    warn!(
                        error,
                        "cluster: etcd unreachable; each Edge keeps to its share of every key's limits"
                    );
                }
                if failed >= DETACHED_AFTER {
                    tenants.handle_detached();
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(SYNC_EVERY) => {}
        }
    }
}
