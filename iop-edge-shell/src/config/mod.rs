//! The Edge's TOML configuration: listen addresses and their TLS, nodes with their tokens
//! and adapters, model groups, queue limits, timers, HTTP limits, API keys and admission
//! limits. Errors name the key and the problem; the core validates the protocol rules.
//!
//! Security rules enforced here (so `check-config` reports them):
//! - the node listener is TLS unless `listen.nodes_plaintext = true`, and plaintext on a
//!   non-loopback address also needs `listen.allow_public_plaintext = true`;
//! - node tokens have at least [`MIN_TOKEN_CHARS`] characters, and the quickstart's
//!   [`EXAMPLE_TOKEN`] is refused when the node listener is not on loopback;
//! - API keys are never empty or whitespace; a key is a client key or an admin key.

//!
//! One module per section, each with its raw form, its defaults named, and the function
//! that checks it: [`timing`] (heartbeat, timeouts, queue), [`admission`], [`nodes`]
//! (nodes and models), [`routing`], [`http`] (limits and keys), [`tls`], [`traces`],
//! [`cluster`]. [`Config::parse`] puts them together.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use iop_proto_core::{EdgeConfig, TokenVerifier};
use serde::Deserialize;

pub use iop_shell_common::config::ConfigError;
use iop_shell_common::config::invalid;

pub mod admission;
pub mod cluster;
pub mod http;
pub mod nodes;
pub mod routing;
#[cfg(test)]
mod tests;
pub mod timing;
pub mod tls;
pub mod traces;

pub use cluster::{ClusterSettings, SHARED_SECTIONS};
pub use http::{ANONYMOUS, HttpSettings, MIN_HEADER_BYTES, NamedKey, anonymous, legacy_name};
pub use nodes::{EXAMPLE_TOKEN, MIN_TOKEN_CHARS};
pub use tls::TlsSettings;
pub use traces::TraceExport;

use admission::RawAdmission;
use cluster::RawCluster;
use http::{RawAuth, RawLimits};
use nodes::{RawModel, RawNode};
use routing::RawRouting;
use timing::{RawHeartbeat, RawQueue, RawTimeouts};
use tls::{RawHttpTls, RawTls};
use traces::RawTracing;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    listen: RawListen,
    #[serde(default)]
    admission: RawAdmission,
    #[serde(default)]
    heartbeat: RawHeartbeat,
    #[serde(default)]
    timeouts: RawTimeouts,
    #[serde(default)]
    queue: RawQueue,
    #[serde(default)]
    limits: RawLimits,
    #[serde(default)]
    auth: RawAuth,
    #[serde(default)]
    runtime: RawRuntime,
    #[serde(default)]
    routing: RawRouting,
    #[serde(default)]
    tracing: RawTracing,
    #[serde(default)]
    messages: RawMessages,
    #[serde(default)]
    responses: RawResponses,
    #[serde(default)]
    nodes: Vec<RawNode>,
    #[serde(default)]
    models: Vec<RawModel>,
    cluster: Option<RawCluster>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawListen {
    http: String,
    nodes: String,
    #[serde(default)]
    pub(crate) nodes_plaintext: bool,
    #[serde(default)]
    pub(crate) allow_public_plaintext: bool,
    pub(crate) nodes_tls: Option<RawTls>,
    pub(crate) http_tls: Option<RawHttpTls>,
    upgrade_socket: Option<String>,
}

/// `[messages]`: how Anthropic Messages requests are translated.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMessages {
    /// Keep Claude Code's per-request attribution line in the system prompt (it defeats
    /// every provider's prefix cache; dropped by default).
    #[serde(default)]
    keep_billing_header: bool,
}

/// `[responses]`: the store of responses `previous_response_id` continues from.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawResponses {
    store_max_entries: Option<usize>,
    store_max_bytes: Option<u64>,
}

/// The store's defaults and ceilings.
const DEFAULT_STORE_ENTRIES: usize = 10_000;
const DEFAULT_STORE_BYTES: u64 = 64 << 20;
const MAX_STORE_ENTRIES: usize = 10_000_000;
const MAX_STORE_BYTES: u64 = 64 << 30;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRuntime {
    worker_threads: Option<usize>,
}

/// Most worker threads `runtime.worker_threads` may ask for.
pub const MAX_WORKER_THREADS: usize = 1024;

/// The whole Edge configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// What the core governs.
    pub core: EdgeConfig,
    /// What the HTTP shell governs.
    pub http: HttpSettings,
    /// TLS of the listeners.
    pub tls: TlsSettings,
    /// Threads the runtime polls tasks on (`runtime.worker_threads`; default half the
    /// CPUs, at least one).
    pub worker_threads: std::num::NonZeroUsize,
    /// Where spans are exported, if anywhere.
    pub traces: Option<TraceExport>,
    /// The Unix socket a successor process asks this one for its listeners on
    /// (`listen.upgrade_socket`; default [`default_upgrade_socket`]).
    pub upgrade_socket: PathBuf,
    /// Cluster mode, when `[cluster]` is set.
    pub cluster: Option<ClusterSettings>,
}

/// Where an Edge whose node listener is `nodes` waits for its successor when
/// `listen.upgrade_socket` is not set: `$XDG_RUNTIME_DIR/iop-edge-<port>.sock`, else
/// `/tmp/iop-edge-<uid>-<port>.sock`. Both ends check that the other runs as the same
/// user, so a socket another user placed there is refused, not obeyed.
#[must_use]
pub fn default_upgrade_socket(nodes: SocketAddr) -> PathBuf {
    let name = |uid: Option<u32>| match uid {
        Some(uid) => format!("iop-edge-{uid}-{}.sock", nodes.port()),
        None => format!("iop-edge-{}.sock", nodes.port()),
    };
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir).join(name(None)),
        None => {
            use std::os::unix::fs::MetadataExt;
            let uid = std::fs::metadata("/proc/self").map_or(0, |m| m.uid());
            std::env::temp_dir().join(name(Some(uid)))
        }
    }
}

fn addr(key: &str, value: &str) -> Result<SocketAddr, ConfigError> {
    value
        .parse()
        .map_err(|_| invalid(key, format!("must be ip:port, got {value:?}")))
}

pub(crate) fn positive_secs(
    key: &str,
    value: Option<u64>,
    default: u64,
) -> Result<Duration, ConfigError> {
    match value.unwrap_or(default) {
        0 => Err(invalid(key, "must be positive")),
        s => Ok(Duration::from_secs(s)),
    }
}

pub(crate) fn relative(base: &Path, file: &Path) -> PathBuf {
    base.parent().map_or(file.to_owned(), |dir| dir.join(file))
}

pub(crate) fn keys(key: &str, values: Vec<String>) -> Result<Vec<TokenVerifier>, ConfigError> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            TokenVerifier::parse_key(v)
                .map_err(|err| invalid(format!("{key}[{i}]"), err.to_string()))
        })
        .collect()
}

pub(crate) fn positive_ms(
    key: &str,
    value: Option<u64>,
    default: u64,
) -> Result<Duration, ConfigError> {
    match value.unwrap_or(default) {
        0 => Err(invalid(key, "must be positive")),
        ms => Ok(Duration::from_millis(ms)),
    }
}

impl Config {
    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::parse(&iop_shell_common::config::read(path)?, path)
    }

    /// Parses and validates configuration text.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let raw: Raw = iop_shell_common::config::parse_toml(text, path)?;
        Self::from_raw(raw, path)
    }

    /// The configuration of a cluster member: its own file's text (`local`) with each of
    /// the [`SHARED_SECTIONS`] that the cluster's shared text (`shared`, from etcd) holds
    /// taken from there instead (a section it leaves out stays as the local file sets
    /// it). The shared text may hold only those sections.
    pub fn parse_shared(local: &str, shared: &str, path: &Path) -> Result<Self, ConfigError> {
        let parse = |text: &str| -> Result<toml::Table, ConfigError> {
            iop_shell_common::config::parse_toml(text, path)
        };
        let mut table = parse(local)?;
        let shared = parse(shared)?;
        if let Some(key) = shared.keys().find(|k| !SHARED_SECTIONS.contains(&&***k)) {
            return Err(invalid(
                key,
                format!(
                    "belongs to each edge's own file, not the shared configuration (shared: {})",
                    SHARED_SECTIONS.join(", ")
                ),
            ));
        }
        // A section the shared text holds replaces the local file's; one it leaves out
        // stays as the local file sets it.
        table.extend(shared);
        let raw: Raw = toml::Value::Table(table)
            .try_into()
            .map_err(|err: toml::de::Error| ConfigError::Parse {
                path: path.to_owned(),
                message: err.to_string().trim().to_owned(),
            })?;
        Self::from_raw(raw, path)
    }

    fn from_raw(raw: Raw, path: &Path) -> Result<Self, ConfigError> {
        let timing = timing::timing(&raw.heartbeat, &raw.timeouts)?;
        let http_addr = addr("listen.http", &raw.listen.http)?;
        let nodes_addr = addr("listen.nodes", &raw.listen.nodes)?;
        let tls = tls::tls_settings(&raw.listen, nodes_addr, path)?;
        let admission = admission::admission(&raw.admission, &raw.limits, &raw.listen)?;
        let display_names = raw
            .models
            .iter()
            .map(|m| {
                let shown = m.display_name.as_deref().unwrap_or(&m.name);
                (m.name.clone(), Arc::from(shown))
            })
            .collect();
        let session_header = routing::session_header(&raw.routing)?;
        let core = EdgeConfig {
            nodes: nodes::nodes(raw.nodes, nodes_addr, &timing)?,
            models: nodes::models(raw.models)?,
            timing,
            queue: timing::queue(&raw.queue)?,
            admission,
            routing: routing::routing(raw.routing)?,
        };
        core.validate()
            .map_err(|err| invalid("config", err.to_string()))?;
        let http = http::http_settings(
            raw.limits,
            raw.auth,
            raw.timeouts.response_sec,
            (http_addr, nodes_addr),
            &core.models,
            path,
        )?;
        let store_entries = raw
            .responses
            .store_max_entries
            .unwrap_or(DEFAULT_STORE_ENTRIES);
        if store_entries > MAX_STORE_ENTRIES {
            return Err(invalid(
                "responses.store_max_entries",
                format!("must be at most {MAX_STORE_ENTRIES}"),
            ));
        }
        let store_bytes = raw.responses.store_max_bytes.unwrap_or(DEFAULT_STORE_BYTES);
        if store_bytes > MAX_STORE_BYTES {
            return Err(invalid(
                "responses.store_max_bytes",
                format!("must be at most {MAX_STORE_BYTES}"),
            ));
        }
        let http = HttpSettings {
            display_names,
            keep_billing_header: raw.messages.keep_billing_header,
            responses_store: (
                store_entries,
                usize::try_from(store_bytes).unwrap_or(usize::MAX),
            ),
            session_header,
            ..http
        };
        let worker_threads = match raw.runtime.worker_threads {
            None => iop_shell_common::process::default_workers(),
            Some(n @ 1..=MAX_WORKER_THREADS) => {
                std::num::NonZeroUsize::new(n).unwrap_or(std::num::NonZeroUsize::MIN)
            }
            Some(_) => {
                return Err(invalid(
                    "runtime.worker_threads",
                    format!("must be between 1 and {MAX_WORKER_THREADS}"),
                ));
            }
        };
        let traces = TraceExport::resolve(raw.tracing, |name| std::env::var(name).ok())?;
        let upgrade_socket = match raw.listen.upgrade_socket.as_deref() {
            None => default_upgrade_socket(nodes_addr),
            Some("") => return Err(invalid("listen.upgrade_socket", "must not be empty")),
            Some(p) => PathBuf::from(p),
        };
        let cluster = match raw.cluster {
            Some(cluster) => Some(cluster::cluster_settings(
                cluster, nodes_addr, http_addr, path,
            )?),
            None => None,
        };
        Ok(Config {
            core,
            http,
            tls,
            worker_threads,
            traces,
            upgrade_socket,
            cluster,
        })
    }
}
