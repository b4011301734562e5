//! `[cluster]`: several Edges as one fabric through etcd (docs/cluster.md), and which
//! sections of the file they share.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use iop_shell_common::config::{ConfigError, invalid};
use serde::Deserialize;

use super::{positive_ms, relative};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCluster {
    pub(super) endpoints: Vec<String>,
    #[serde(default = "default_prefix")]
    pub(super) prefix: String,
    pub(super) edge_id: String,
    pub(super) advertise_nodes: Option<String>,
    pub(super) advertise_http: Option<String>,
    pub(super) username: Option<String>,
    pub(super) password_file: Option<PathBuf>,
    pub(super) ca_file: Option<PathBuf>,
    pub(super) cert_file: Option<PathBuf>,
    pub(super) key_file: Option<PathBuf>,
    pub(super) lease_ttl_sec: Option<u64>,
    pub(super) keepalive_sec: Option<u64>,
    pub(super) resync_sec: Option<u64>,
    pub(super) request_timeout_ms: Option<u64>,
}

fn default_prefix() -> String {
    "/iop".to_owned()
}

/// The sections several Edges of a cluster share through etcd (`<prefix>/config`): what
/// the fleet is (nodes, models, client keys) and how it is run. Everything else belongs
/// to one process (its listeners, runtime, limits, tracing, and `[cluster]` itself).
pub const SHARED_SECTIONS: [&str; 9] = [
    "nodes",
    "models",
    "auth",
    "routing",
    "queue",
    "admission",
    "heartbeat",
    "timeouts",
    "messages",
];

/// Cluster mode (`[cluster]`, docs/cluster.md).
#[derive(Clone)]
pub struct ClusterSettings {
    /// etcd's client URLs (`http://` or `https://`).
    pub endpoints: Vec<String>,
    /// The cluster's key prefix, without a trailing `/`.
    pub prefix: String,
    /// This Edge's id, unique in the cluster.
    pub edge_id: String,
    /// Where nodes dial this Edge, as published to the other members and the nodes.
    pub advertise_nodes: String,
    /// Where callers reach this Edge, as published (for operators).
    pub advertise_http: String,
    /// etcd user and password, if etcd has authentication on.
    pub username: Option<String>,
    /// The password (read from `password_file`); never logged.
    pub password: Option<String>,
    /// CA that signed etcd's certificate (default: the web PKI roots).
    pub ca_file: Option<PathBuf>,
    /// Client certificate for etcd, with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// Its key.
    pub key_file: Option<PathBuf>,
    /// The member lease's time to live (default 10 s).
    pub lease_ttl: Duration,
    /// How often it is renewed (default 3 s).
    pub keepalive: Duration,
    /// How often the cluster's prefix is read again and the watch started anew (default
    /// 30 s): the longest a silently stalled watch can hide a change.
    pub resync: Duration,
    /// Deadline of one etcd request (default 2 s).
    pub request_timeout: Duration,
}

impl std::fmt::Debug for ClusterSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterSettings")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("edge_id", &self.edge_id)
            .field("advertise_nodes", &self.advertise_nodes)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .finish_non_exhaustive()
    }
}

pub(super) fn cluster_settings(
    raw: RawCluster,
    nodes_addr: SocketAddr,
    http_addr: SocketAddr,
    path: &Path,
) -> Result<ClusterSettings, ConfigError> {
    if raw.endpoints.is_empty() {
        return Err(invalid(
            "cluster.endpoints",
            "name at least one etcd endpoint",
        ));
    }
    for endpoint in &raw.endpoints {
        let uri = endpoint.parse::<http::Uri>().ok();
        if !matches!(
            uri.as_ref().and_then(http::Uri::scheme_str),
            Some("http" | "https")
        ) {
            return Err(invalid(
                "cluster.endpoints",
                format!("{endpoint:?} must be an http:// or https:// URL"),
            ));
        }
        // Endpoints appear in logs and errors: credentials go in username/password_file.
        if uri
            .as_ref()
            .and_then(http::Uri::authority)
            .is_some_and(|a| a.as_str().contains('@'))
        {
            return Err(invalid(
                "cluster.endpoints",
                "must not carry credentials (user@host): set username and password_file",
            ));
        }
    }
    if raw.edge_id.is_empty()
        || raw.edge_id.len() > 64
        || !raw
            .edge_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err(invalid(
            "cluster.edge_id",
            "1-64 characters among letters, digits, '-', '_' and '.'",
        ));
    }
    let prefix = raw.prefix.trim_end_matches('/').to_owned();
    if prefix.is_empty() {
        return Err(invalid("cluster.prefix", "must not be empty or '/'"));
    }
    let password = match &raw.password_file {
        Some(file) => Some(
            iop_shell_common::config::read(&relative(path, file))?
                .trim_end_matches(['\r', '\n'])
                .to_owned(),
        ),
        None => None,
    };
    if raw.username.is_some() != password.is_some() {
        return Err(invalid(
            "cluster.username",
            "set username and password_file together",
        ));
    }
    if raw.cert_file.is_some() != raw.key_file.is_some() {
        return Err(invalid(
            "cluster.cert_file",
            "set cert_file and key_file together",
        ));
    }
    let secs = |key: &str, value: Option<u64>, default: u64| match value.unwrap_or(default) {
        0 => Err(invalid(key, "must be positive")),
        s => Ok(Duration::from_secs(s)),
    };
    let lease_ttl = secs("cluster.lease_ttl_sec", raw.lease_ttl_sec, 10)?;
    let keepalive = secs("cluster.keepalive_sec", raw.keepalive_sec, 3)?;
    if keepalive * 3 > lease_ttl {
        return Err(invalid(
            "cluster.keepalive_sec",
            "renew the lease at least three times per lease_ttl_sec",
        ));
    }
    let advertise = |key: &str, value: Option<String>, listen: SocketAddr| match value {
        Some(addr) if !addr.is_empty() && addr.len() <= 128 => Ok(addr),
        Some(_) => Err(invalid(key, "must be a host:port of at most 128 bytes")),
        None if listen.ip().is_unspecified() => Err(invalid(
            key,
            "the listener binds every address: name the one others should dial",
        )),
        None => Ok(listen.to_string()),
    };
    Ok(ClusterSettings {
        endpoints: raw.endpoints,
        prefix,
        advertise_nodes: advertise("cluster.advertise_nodes", raw.advertise_nodes, nodes_addr)?,
        advertise_http: advertise("cluster.advertise_http", raw.advertise_http, http_addr)?,
        edge_id: raw.edge_id,
        username: raw.username,
        password,
        ca_file: raw.ca_file.map(|f| relative(path, &f)),
        cert_file: raw.cert_file.map(|f| relative(path, &f)),
        key_file: raw.key_file.map(|f| relative(path, &f)),
        lease_ttl,
        keepalive,
        resync: secs("cluster.resync_sec", raw.resync_sec, 30)?,
        request_timeout: positive_ms("cluster.request_timeout_ms", raw.request_timeout_ms, 2_000)?,
    })
}
