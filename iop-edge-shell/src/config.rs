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

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use iop_api::tenant::{Budget, KeyPolicy, Period};
use iop_proto_core::edge_config::{
    Admission, ConflictLimits, EdgeTiming, QueueLimits, RetryOn, Routing, ThrottleLimits,
};
use iop_proto_core::wire::{AdapterConfig, AdapterType, NodeRuntimeConfig};
use iop_proto_core::{CandidateSpec, EdgeConfig, ModelSpec, NodeSpec, TokenVerifier};
use iop_shell_common::tls::ServerFiles;
use serde::Deserialize;

pub use iop_shell_common::config::ConfigError;
use iop_shell_common::config::invalid;

/// Shortest node token accepted.
pub const MIN_TOKEN_CHARS: usize = 16;

/// The token of the quickstart configuration; refused unless the node listener is on
/// loopback.
pub const EXAMPLE_TOKEN: &str = "dev-token-change-me";

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
    nodes: Vec<RawNode>,
    #[serde(default)]
    models: Vec<RawModel>,
    cluster: Option<RawCluster>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    endpoints: Vec<String>,
    #[serde(default = "default_prefix")]
    prefix: String,
    edge_id: String,
    advertise_nodes: Option<String>,
    advertise_http: Option<String>,
    username: Option<String>,
    password_file: Option<PathBuf>,
    ca_file: Option<PathBuf>,
    cert_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
    lease_ttl_sec: Option<u64>,
    keepalive_sec: Option<u64>,
    resync_sec: Option<u64>,
    request_timeout_ms: Option<u64>,
}

fn default_prefix() -> String {
    "/iop".to_owned()
}

/// The sections several Edges of a cluster share through etcd (`<prefix>/config`): what
/// the fleet is (nodes, models, client keys) and how it is run. Everything else belongs
/// to one process (its listeners, runtime, limits, tracing, and `[cluster]` itself).
pub const SHARED_SECTIONS: [&str; 8] = [
    "nodes",
    "models",
    "auth",
    "routing",
    "queue",
    "admission",
    "heartbeat",
    "timeouts",
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

fn cluster_settings(
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawListen {
    http: String,
    nodes: String,
    #[serde(default)]
    nodes_plaintext: bool,
    #[serde(default)]
    allow_public_plaintext: bool,
    nodes_tls: Option<RawTls>,
    http_tls: Option<RawHttpTls>,
    upgrade_socket: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    cert_file: PathBuf,
    key_file: PathBuf,
    client_ca_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHttpTls {
    cert_file: PathBuf,
    key_file: PathBuf,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdmission {
    free_failures: Option<u32>,
    failure_interval_ms: Option<u64>,
    failure_window_sec: Option<u64>,
    max_backoff_sec: Option<u64>,
    conflict_supersedes: Option<u32>,
    conflict_window_sec: Option<u64>,
    conflict_hold_down_sec: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeartbeat {
    interval_ms: Option<u64>,
    timeout_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTimeouts {
    register_ms: Option<u64>,
    refresh_ms: Option<u64>,
    cancel_grace_ms: Option<u64>,
    response_sec: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawQueue {
    max_waiting: Option<usize>,
    wait_timeout_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTracing {
    otlp_endpoint: Option<String>,
    protocol: Option<String>,
    service_name: Option<String>,
    sample_ratio: Option<f64>,
    #[serde(default)]
    headers: std::collections::BTreeMap<String, String>,
}

/// Where the Edge exports its spans (`[tracing]`, or the standard `OTEL_EXPORTER_OTLP_*`
/// environment variables when the file names no endpoint). Read at start only.
#[derive(Clone, PartialEq)]
pub struct TraceExport {
    /// The collector's traces URL (`http://` or `https://`, path included).
    pub endpoint: http::Uri,
    /// Protobuf (`http/protobuf`, the default) or JSON (`http/json`).
    pub json: bool,
    /// `service.name` of the spans.
    pub service_name: String,
    /// Headers sent with every export (a collector's API key: kept out of logs).
    pub headers: Vec<(String, String)>,
    /// The share of traces the Edge starts that it records (0 to 1); a caller's own
    /// sampling decision is always kept.
    pub sample_ratio: f64,
}

// The headers may hold a collector's API key: only their names are shown.
impl std::fmt::Debug for TraceExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceExport")
            .field("endpoint", &self.endpoint)
            .field("json", &self.json)
            .field("service_name", &self.service_name)
            .field(
                "headers",
                &self
                    .headers
                    .iter()
                    .map(|(name, _)| name)
                    .collect::<Vec<_>>(),
            )
            .field("sample_ratio", &self.sample_ratio)
            .finish()
    }
}

impl TraceExport {
    /// The export `[tracing]` describes, else the one the environment (`get`) describes:
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (the full URL), or
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` (a base, `/v1/traces` added), with
    /// `OTEL_EXPORTER_OTLP_PROTOCOL`, `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_SERVICE_NAME`
    /// and the ratio of `OTEL_TRACES_SAMPLER=traceidratio` (or
    /// `parentbased_traceidratio`) in `OTEL_TRACES_SAMPLER_ARG`; none when neither names an endpoint (or `OTEL_SDK_DISABLED`
    /// is `true`).
    fn resolve(
        raw: RawTracing,
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, ConfigError> {
        let env = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        let from_file = raw.otlp_endpoint.is_some();
        let endpoint = match raw.otlp_endpoint {
            Some(e) if e.is_empty() => return Ok(None),
            Some(e) => e,
            None if env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) => {
                return Ok(None);
            }
            None => match (
                env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
                env("OTEL_EXPORTER_OTLP_ENDPOINT"),
            ) {
                (Some(full), _) => full,
                (None, Some(base)) => format!("{}/v1/traces", base.trim_end_matches('/')),
                (None, None) => return Ok(None),
            },
        };
        let key = |name: &'static str, var: &'static str| {
            if from_file {
                name.to_owned()
            } else {
                var.to_owned()
            }
        };
        let uri: http::Uri = endpoint.trim().parse().map_err(|_| {
            invalid(
                key("tracing.otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT"),
                "must be a URL such as http://127.0.0.1:4318/v1/traces",
            )
        })?;
        // Logged at start: credentials belong in the headers, never in the URL.
        if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
            return Err(invalid(
                key("tracing.otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT"),
                "must not carry credentials (user:password@); put them in tracing.headers",
            ));
        }
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
            return Err(invalid(
                key("tracing.otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT"),
                "must be an http:// or https:// URL with a host",
            ));
        }
        let protocol = raw
            .protocol
            .or_else(|| {
                (!from_file)
                    .then(|| env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"))
                    .flatten()
            })
            .or_else(|| {
                (!from_file)
                    .then(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
                    .flatten()
            });
        let json = match protocol.as_deref().map(str::trim) {
            None | Some("http/protobuf") => false,
            Some("http/json") => true,
            Some(other) => {
                return Err(invalid(
                    key("tracing.protocol", "OTEL_EXPORTER_OTLP_PROTOCOL"),
                    format!(
                        "must be \"http/protobuf\" or \"http/json\" (gRPC is not spoken), got {other:?}"
                    ),
                ));
            }
        };
        let mut headers: Vec<(String, String)> = raw.headers.into_iter().collect();
        if !from_file && let Some(list) = env("OTEL_EXPORTER_OTLP_HEADERS") {
            for pair in list.split(',') {
                if let Some((k, v)) = pair.split_once('=') {
                    headers.push((k.trim().to_owned(), v.trim().to_owned()));
                }
            }
        }
        for (name, value) in &headers {
            if http::HeaderName::from_bytes(name.as_bytes()).is_err()
                || http::HeaderValue::from_str(value).is_err()
            {
                return Err(invalid(
                    key("tracing.headers", "OTEL_EXPORTER_OTLP_HEADERS"),
                    format!("{name:?} is not a valid header"),
                ));
            }
        }
        let ratio_from_env = || {
            env("OTEL_TRACES_SAMPLER")
                .filter(|s| s.ends_with("traceidratio"))
                .and_then(|_| env("OTEL_TRACES_SAMPLER_ARG"))
                .and_then(|arg| arg.trim().parse::<f64>().ok())
        };
        let sample_ratio = raw
            .sample_ratio
            .or_else(|| (!from_file).then(ratio_from_env).flatten())
            .unwrap_or(1.0);
        if !(0.0..=1.0).contains(&sample_ratio) {
            return Err(invalid(
                key("tracing.sample_ratio", "OTEL_TRACES_SAMPLER_ARG"),
                "must be between 0 and 1",
            ));
        }
        let service_name = raw
            .service_name
            .or_else(|| env("OTEL_SERVICE_NAME"))
            .unwrap_or_else(|| "iop-edge".to_owned());
        Ok(Some(TraceExport {
            endpoint: uri,
            json,
            service_name,
            headers,
            sample_ratio,
        }))
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRuntime {
    worker_threads: Option<usize>,
}

/// Most worker threads `runtime.worker_threads` may ask for.
pub const MAX_WORKER_THREADS: usize = 1024;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    max_body_bytes: Option<usize>,
    max_concurrent_requests: Option<usize>,
    header_read_timeout_sec: Option<u64>,
    max_header_bytes: Option<usize>,
    body_read_timeout_sec: Option<u64>,
    idle_timeout_sec: Option<u64>,
    max_connections: Option<usize>,
    max_streams_per_connection: Option<u32>,
    max_inflight_bytes: Option<usize>,
    sse_keepalive_ms: Option<u64>,
    shutdown_grace_sec: Option<u64>,
    handover_quiet_ms: Option<u64>,
    max_frame_bytes: Option<usize>,
    pending_frame_bytes: Option<usize>,
    max_pending_connections: Option<usize>,
    max_pending_per_address: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAuth {
    #[serde(default)]
    api_keys: Vec<String>,
    #[serde(default)]
    admin_keys: Vec<String>,
    #[serde(default)]
    admin_loopback: bool,
    #[serde(default)]
    keys: Vec<RawKey>,
    usage_file: Option<String>,
}

/// One named client key (`[[auth.keys]]`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKey {
    name: String,
    key: String,
    models: Option<Vec<String>>,
    requests_per_minute: Option<u32>,
    tokens_per_minute: Option<u64>,
    max_concurrent: Option<u32>,
    token_budget: Option<u64>,
    budget_period: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    id: String,
    token: Option<String>,
    token_sha256: Option<String>,
    request_timeout_sec: Option<u32>,
    #[serde(default)]
    adapters: Vec<RawAdapter>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdapter {
    #[serde(default)]
    name: String,
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    base_url: String,
    #[serde(default)]
    api_key: String,
    capacity: u32,
    #[serde(default)]
    long_capacity: u32,
    #[serde(default)]
    targets: Vec<String>,
    #[serde(default = "yes")]
    enabled: bool,
    #[serde(default)]
    options: BTreeMap<String, String>,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRouting {
    max_attempts: Option<u32>,
    retry_budget_percent: Option<u32>,
    retry_budget_min: Option<u32>,
    retry_on: Option<Vec<String>>,
    first_byte_timeout_sec: Option<f64>,
    eject_after_failures: Option<u32>,
    eject_failure_percent: Option<u32>,
    eject_min_requests: Option<u32>,
    eject_window_sec: Option<u64>,
    eject_base_sec: Option<f64>,
    eject_max_sec: Option<f64>,
    max_ejected_percent: Option<u32>,
    retry_after_max_sec: Option<u64>,
}

/// The failures `routing.retry_on` may list.
const RETRY_ON: [&str; 5] = ["connect", "5xx", "429", "408", "node_lost"];

fn retry_on(listed: Option<Vec<String>>) -> Result<RetryOn, ConfigError> {
    let Some(listed) = listed else {
        return Ok(RetryOn::default());
    };
    let mut on = RetryOn {
        connect: false,
        status_5xx: false,
        status_429: false,
        status_408: false,
        node_lost: false,
    };
    for item in &listed {
        match item.as_str() {
            "connect" => on.connect = true,
            "5xx" => on.status_5xx = true,
            "429" => on.status_429 = true,
            "408" => on.status_408 = true,
            "node_lost" => on.node_lost = true,
            other => {
                return Err(invalid(
                    "routing.retry_on",
                    format!("unknown failure {other:?}; one of {RETRY_ON:?}"),
                ));
            }
        }
    }
    Ok(on)
}

/// A positive number of seconds (fractions allowed), or `default`.
fn positive_secs_f64(
    key: &str,
    value: Option<f64>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    match value {
        None => Ok(default),
        Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Duration::from_secs_f64(s)),
        Some(_) => Err(invalid(key, "must be a positive number of seconds")),
    }
}

fn routing(raw: RawRouting) -> Result<Routing, ConfigError> {
    let d = Routing::default();
    Ok(Routing {
        max_attempts: raw.max_attempts.unwrap_or(d.max_attempts),
        retry_budget_percent: raw.retry_budget_percent.unwrap_or(d.retry_budget_percent),
        retry_budget_min: raw.retry_budget_min.unwrap_or(d.retry_budget_min),
        retry_on: retry_on(raw.retry_on)?,
        first_byte_timeout: positive_secs_f64(
            "routing.first_byte_timeout_sec",
            raw.first_byte_timeout_sec,
            d.first_byte_timeout,
        )?,
        eject_after_failures: raw.eject_after_failures.unwrap_or(d.eject_after_failures),
        eject_failure_percent: raw.eject_failure_percent.unwrap_or(d.eject_failure_percent),
        eject_min_requests: raw.eject_min_requests.unwrap_or(d.eject_min_requests),
        eject_window: positive_secs(
            "routing.eject_window_sec",
            raw.eject_window_sec,
            d.eject_window.as_secs(),
        )?,
        eject_base: positive_secs_f64("routing.eject_base_sec", raw.eject_base_sec, d.eject_base)?,
        eject_max: positive_secs_f64("routing.eject_max_sec", raw.eject_max_sec, d.eject_max)?,
        max_ejected_percent: raw.max_ejected_percent.unwrap_or(d.max_ejected_percent),
        retry_after_max: positive_secs(
            "routing.retry_after_max_sec",
            raw.retry_after_max_sec,
            d.retry_after_max.as_secs(),
        )?,
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    name: String,
    long_context_threshold: Option<u64>,
    first_byte_timeout_sec: Option<f64>,
    #[serde(default)]
    providers: Vec<RawCandidate>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCandidate {
    node: String,
    adapter: String,
    target: String,
}

/// The default and smallest `limits.max_header_bytes`: hyper's HTTP/1 read buffer cannot
/// be smaller (it panics below it), and at exactly this size a kept-alive connection's
/// buffer is reused in place; with a larger limit hyper grows each connection's buffer to
/// twice this once it has served a request (docs/benchmarks-history.md).
pub const MIN_HEADER_BYTES: usize = 8192;

/// HTTP-side settings (everything the core does not decide).
#[derive(Clone, Debug)]
pub struct HttpSettings {
    /// Public HTTP listen address.
    pub http_addr: SocketAddr,
    /// Node listener address.
    pub nodes_addr: SocketAddr,
    /// Client API keys: inference routes and `/v1/models` (with no named key either,
    /// those routes are open).
    pub api_keys: Vec<TokenVerifier>,
    /// Their names in logs and usage (`api_keys[i]`), made once.
    pub api_key_names: Vec<Arc<str>>,
    /// Named client keys, each with its models, limits and budget (`[[auth.keys]]`).
    pub keys: Vec<NamedKey>,
    /// Admin API keys: status, metrics, usage, events, node commands.
    pub admin_keys: Vec<TokenVerifier>,
    /// Their names in logs and usage (`admin_keys[i]`), made once.
    pub admin_key_names: Vec<Arc<str>>,
    /// With no admin key, the admin routes answer callers on loopback that no proxy
    /// forwarded (`auth.admin_loopback`, off by default: with no admin key and without
    /// it they answer nobody).
    pub admin_loopback: bool,
    /// Where key windows, budgets and usage are kept across restarts (`None`: nowhere).
    pub usage_file: Option<PathBuf>,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Requests served at once; more get 503.
    pub max_concurrent_requests: usize,
    /// Time to receive a request's headers; on a kept-alive connection it also bounds the
    /// wait for the next request, so it is the idle timeout too.
    pub header_read_timeout: Duration,
    /// Largest accepted request head (at least [`MIN_HEADER_BYTES`]).
    pub max_header_bytes: usize,
    /// Time to receive a whole request body; a slower one gets 408.
    pub body_read_timeout: Duration,
    /// A connection with no request in progress for this long is closed; also bounds an
    /// HTTP/2 connection that never completes its handshake.
    pub idle_timeout: Duration,
    /// Open connections on the public listener; more wait in the kernel's backlog.
    pub max_connections: usize,
    /// Concurrent HTTP/2 streams per connection.
    pub max_streams_per_connection: u32,
    /// Request bodies and buffered response bytes held at once; beyond it new requests
    /// get 503 `overloaded`.
    pub max_inflight_bytes: usize,
    /// An SSE stream with nothing to send for this long gets a comment line: it keeps
    /// intermediaries from timing it out, and a caller that left is noticed within about
    /// twice this, even while the provider is silent.
    pub sse_keepalive: Duration,
    /// Upper bound of one request, queueing included (then 504 and a cancel).
    pub response_timeout: Duration,
    /// After SIGTERM or SIGINT, how long the requests in flight have to finish before
    /// the Edge stops anyway (0: stop at once).
    pub shutdown_grace: Duration,
    /// A process handing over to a successor keeps its nodes at most this long for
    /// requests still arriving on its open connections, before it re-homes them (0: at
    /// once, as soon as the successor serves).
    pub handover_quiet: Duration,
}

/// A named client key: what logs, metrics and the dashboard call it, its secret, and
/// what it may do.
#[derive(Clone, Debug)]
pub struct NamedKey {
    /// Its name (never the secret).
    pub name: Arc<str>,
    /// Its secret, checked in constant time.
    pub verifier: TokenVerifier,
    /// Its models, limits and budget.
    pub policy: KeyPolicy,
}

impl HttpSettings {
    /// Whether callers must present a client key for inference and `/v1/models`.
    #[must_use]
    pub fn keys_required(&self) -> bool {
        !self.api_keys.is_empty() || !self.keys.is_empty()
    }

    /// Every key's name and policy, for the tenants' accounting: named keys with theirs,
    /// the unnamed keys unlimited (their usage is counted all the same). Callers with no
    /// key are not accounted.
    #[must_use]
    pub fn tenants(&self) -> Vec<(Arc<str>, KeyPolicy)> {
        let mut out: Vec<(Arc<str>, KeyPolicy)> = self
            .keys
            .iter()
            .map(|k| (k.name.clone(), k.policy.clone()))
            .collect();
        out.extend(
            self.api_key_names
                .iter()
                .chain(&self.admin_key_names)
                .map(|name| (name.clone(), KeyPolicy::default())),
        );
        out
    }
}

/// [`ANONYMOUS`] as the one shared name every keyless caller gets (no allocation per
/// request).
#[must_use]
pub fn anonymous() -> Arc<str> {
    static NAME: std::sync::OnceLock<Arc<str>> = std::sync::OnceLock::new();
    NAME.get_or_init(|| Arc::from(ANONYMOUS)).clone()
}

/// What logs and usage call callers when no key is required.
pub const ANONYMOUS: &str = "anonymous";

/// The name of an unnamed key: where it is in its list (`api_keys[2]`).
#[must_use]
pub fn legacy_name(list: &str, i: usize) -> Arc<str> {
    Arc::from(format!("{list}[{i}]"))
}

/// Longest key name (it goes into metric labels and log lines).
const MAX_KEY_NAME: usize = 64;

fn named_keys(
    raw: Vec<RawKey>,
    models: &BTreeMap<String, ModelSpec>,
) -> Result<Vec<NamedKey>, ConfigError> {
    let mut out: Vec<NamedKey> = Vec::with_capacity(raw.len());
    for (i, k) in raw.into_iter().enumerate() {
        let at = |field: &str| format!("auth.keys[{i}].{field}");
        let name = k.name.trim();
        if name.is_empty()
            || name.len() > MAX_KEY_NAME
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        {
            return Err(invalid(
                at("name"),
                format!("must be 1-{MAX_KEY_NAME} letters, digits, '-', '_' or '.'"),
            ));
        }
        if name == ANONYMOUS || name.contains('[') || out.iter().any(|o| &*o.name == name) {
            return Err(invalid(at("name"), format!("{name:?} is taken")));
        }
        let verifier =
            TokenVerifier::parse_key(&k.key).map_err(|err| invalid(at("key"), err.to_string()))?;
        if out.iter().any(|o| o.verifier == verifier) {
            return Err(invalid(at("key"), "is another named key's too"));
        }
        if let Some(listed) = &k.models
            && let Some(unknown) = listed.iter().find(|m| !models.contains_key(m.as_str()))
        {
            return Err(invalid(
                at("models"),
                format!("{unknown:?} is no [[models]] name"),
            ));
        }
        let positive = |field: &str, v: Option<u64>| match v {
            Some(0) => Err(invalid(
                at(field),
                "must be positive (omit it for no limit)",
            )),
            _ => Ok(()),
        };
        positive("requests_per_minute", k.requests_per_minute.map(u64::from))?;
        positive("tokens_per_minute", k.tokens_per_minute)?;
        positive("max_concurrent", k.max_concurrent.map(u64::from))?;
        positive("token_budget", k.token_budget)?;
        let period = match k.budget_period.as_deref() {
            None | Some("month") => Period::Month,
            Some("day") => Period::Day,
            Some(other) => {
                return Err(invalid(
                    at("budget_period"),
                    format!("{other:?} is not day or month"),
                ));
            }
        };
        if k.budget_period.is_some() && k.token_budget.is_none() {
            return Err(invalid(at("budget_period"), "needs token_budget"));
        }
        out.push(NamedKey {
            name: Arc::from(name),
            verifier,
            policy: KeyPolicy {
                models: k.models.map(|m| m.into_iter().map(Arc::from).collect()),
                requests_per_minute: k.requests_per_minute,
                tokens_per_minute: k.tokens_per_minute,
                max_concurrent: k.max_concurrent,
                budget: k.token_budget.map(|tokens| Budget { tokens, period }),
            },
        });
    }
    Ok(out)
}

/// TLS of both listeners, loaded and checked.
#[derive(Clone, Debug)]
pub struct TlsSettings {
    /// The node link: `None` only with `listen.nodes_plaintext = true`.
    pub nodes: Option<Arc<rustls::ServerConfig>>,
    /// Where the node link's material came from (reloaded on SIGHUP).
    pub nodes_files: Option<ServerFiles>,
    /// HTTPS on the public listener, if configured (ALPN h2, http/1.1).
    pub http: Option<Arc<rustls::ServerConfig>>,
}

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

/// Longest `limits.shutdown_grace_sec`: a day.
const MAX_SHUTDOWN_GRACE_SEC: u64 = 86_400;

fn positive_secs(key: &str, value: Option<u64>, default: u64) -> Result<Duration, ConfigError> {
    match value.unwrap_or(default) {
        0 => Err(invalid(key, "must be positive")),
        s => Ok(Duration::from_secs(s)),
    }
}

fn relative(base: &Path, file: &Path) -> PathBuf {
    base.parent().map_or(file.to_owned(), |dir| dir.join(file))
}

fn keys(key: &str, values: Vec<String>) -> Result<Vec<TokenVerifier>, ConfigError> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            TokenVerifier::parse_key(v)
                .map_err(|err| invalid(format!("{key}[{i}]"), err.to_string()))
        })
        .collect()
}

fn positive_ms(key: &str, value: Option<u64>, default: u64) -> Result<Duration, ConfigError> {
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
        let timing = EdgeTiming {
            heartbeat_interval: positive_ms(
                "heartbeat.interval_ms",
                raw.heartbeat.interval_ms,
                5_000,
            )?,
            heartbeat_timeout: positive_ms(
                "heartbeat.timeout_ms",
                raw.heartbeat.timeout_ms,
                15_000,
            )?,
            register_timeout: positive_ms(
                "timeouts.register_ms",
                raw.timeouts.register_ms,
                10_000,
            )?,
            refresh_timeout: positive_ms("timeouts.refresh_ms", raw.timeouts.refresh_ms, 10_000)?,
            cancel_grace: positive_ms(
                "timeouts.cancel_grace_ms",
                raw.timeouts.cancel_grace_ms,
                15_000,
            )?,
        };
        let http_addr = addr("listen.http", &raw.listen.http)?;
        let nodes_addr = addr("listen.nodes", &raw.listen.nodes)?;
        let tls = tls_settings(&raw.listen, nodes_addr, path)?;
        let a = &raw.admission;
        let admission = Admission {
            require_client_identity: raw
                .listen
                .nodes_tls
                .as_ref()
                .is_some_and(|t| t.client_ca_file.is_some()),
            throttle: ThrottleLimits {
                free_failures: a.free_failures.unwrap_or(5),
                interval: positive_ms(
                    "admission.failure_interval_ms",
                    a.failure_interval_ms,
                    1000,
                )?,
                max_hold: positive_secs("admission.max_backoff_sec", a.max_backoff_sec, 30)?,
                window: positive_secs("admission.failure_window_sec", a.failure_window_sec, 60)?,
                max_tracked: 4096,
            },
            pending: iop_proto_core::edge_config::PendingLimits {
                max_total: raw.limits.max_pending_connections.unwrap_or(1024),
                max_per_source: raw.limits.max_pending_per_address.unwrap_or(64),
            },
            pending_frame_len: raw.limits.pending_frame_bytes.unwrap_or(64 << 10),
            max_frame_len: raw
                .limits
                .max_frame_bytes
                .unwrap_or(iop_proto_core::wire::DEFAULT_MAX_FRAME_LEN),
            conflict: ConflictLimits {
                supersedes: a.conflict_supersedes.unwrap_or(3).max(2),
                window: positive_secs("admission.conflict_window_sec", a.conflict_window_sec, 30)?,
                hold_down: positive_secs(
                    "admission.conflict_hold_down_sec",
                    a.conflict_hold_down_sec,
                    60,
                )?,
                retry_after: Duration::from_secs(5),
            },
        };
        let queue = QueueLimits {
            max_waiting: raw.queue.max_waiting.unwrap_or(256),
            wait_timeout: positive_ms("queue.wait_timeout_ms", raw.queue.wait_timeout_ms, 30_000)?,
        };
        let mut nodes = BTreeMap::new();
        for (i, node) in raw.nodes.into_iter().enumerate() {
            let key = format!("nodes[{i}]");
            let token = match (node.token, node.token_sha256) {
                (Some(t), None) if !t.is_empty() => {
                    if t.chars().count() < MIN_TOKEN_CHARS {
                        return Err(invalid(
                            format!("{key}.token"),
                            format!("must have at least {MIN_TOKEN_CHARS} characters"),
                        ));
                    }
                    if t == EXAMPLE_TOKEN && !nodes_addr.ip().is_loopback() {
                        return Err(invalid(
                            format!("{key}.token"),
                            format!(
                                "{EXAMPLE_TOKEN:?} is the quickstart's token and anyone knows \
                                 it; choose a secret one for a node listener on {nodes_addr}"
                            ),
                        ));
                    }
                    TokenVerifier::from_secret(t.as_bytes())
                }
                (None, Some(hex)) => TokenVerifier::from_sha256_hex(&hex).ok_or_else(|| {
                    invalid(format!("{key}.token_sha256"), "must be 64 hex digits")
                })?,
                (Some(_), Some(_)) => {
                    return Err(invalid(&key, "set token or token_sha256, not both"));
                }
                _ => {
                    return Err(invalid(
                        format!("{key}.token"),
                        "missing or empty (or set token_sha256)",
                    ));
                }
            };
            let mut adapters = Vec::new();
            for (j, a) in node.adapters.into_iter().enumerate() {
                let kind = AdapterType::from_config_name(&a.kind).ok_or_else(|| {
                    invalid(
                        format!("{key}.adapters[{j}].type"),
                        format!(
                            "{:?} is not one of openai_compat, vllm, ollama, mock",
                            a.kind
                        ),
                    )
                })?;
                adapters.push(AdapterConfig {
                    name: a.name,
                    r#type: kind as i32,
                    base_url: a.base_url,
                    api_key: a.api_key,
                    capacity: a.capacity,
                    long_capacity: a.long_capacity,
                    targets: a.targets,
                    enabled: a.enabled,
                    options: a.options,
                });
            }
            let spec = NodeSpec {
                token,
                adapters,
                runtime: NodeRuntimeConfig {
                    concurrency: 0,
                    heartbeat_interval_ms: u32::try_from(timing.heartbeat_interval.as_millis())
                        .unwrap_or(u32::MAX),
                    request_timeout_sec: node.request_timeout_sec.unwrap_or(600),
                },
            };
            if nodes.insert(node.id.clone(), spec).is_some() {
                return Err(invalid(
                    format!("{key}.id"),
                    format!("node {:?} is defined twice", node.id),
                ));
            }
        }
        let mut models = BTreeMap::new();
        for (i, model) in raw.models.into_iter().enumerate() {
            let spec = ModelSpec {
                candidates: model
                    .providers
                    .into_iter()
                    .map(|c| CandidateSpec {
                        node_id: c.node,
                        provider_id: c.adapter,
                        target: c.target,
                    })
                    .collect(),
                long_context_threshold: model.long_context_threshold,
                first_byte_timeout: model
                    .first_byte_timeout_sec
                    .map(|s| {
                        positive_secs_f64(
                            &format!("models[{i}].first_byte_timeout_sec"),
                            Some(s),
                            Duration::ZERO,
                        )
                    })
                    .transpose()?,
            };
            if models.insert(model.name.clone(), spec).is_some() {
                return Err(invalid(
                    format!("models[{i}].name"),
                    format!("model {:?} is defined twice", model.name),
                ));
            }
        }
        let core = EdgeConfig {
            nodes,
            models,
            timing,
            queue,
            admission,
            routing: routing(raw.routing)?,
        };
        core.validate()
            .map_err(|err| invalid("config", err.to_string()))?;
        let limits = raw.limits;
        if let (Some(budget), body) = (
            limits.max_inflight_bytes,
            limits.max_body_bytes.unwrap_or(8 << 20),
        ) && budget < body
        {
            return Err(invalid(
                "limits.max_inflight_bytes",
                "must be at least limits.max_body_bytes, or no request fits",
            ));
        }
        let api_keys = keys("auth.api_keys", raw.auth.api_keys)?;
        let admin_keys = keys("auth.admin_keys", raw.auth.admin_keys)?;
        let named = named_keys(raw.auth.keys, &core.models)?;
        if let Some(i) = admin_keys
            .iter()
            .position(|k| api_keys.contains(k) || named.iter().any(|n| n.verifier == *k))
        {
            return Err(invalid(
                format!("auth.admin_keys[{i}]"),
                "is also a client key; give admins their own key",
            ));
        }
        if let Some(i) = named.iter().position(|n| api_keys.contains(&n.verifier)) {
            return Err(invalid(
                format!("auth.keys[{i}].key"),
                "is also in auth.api_keys; a key has one name",
            ));
        }
        // With no key there is nothing to keep: no file is written.
        let usage_file = match raw.auth.usage_file.as_deref() {
            _ if named.is_empty() && api_keys.is_empty() && admin_keys.is_empty() => None,
            Some("") => None,
            Some(file) => Some(relative(path, Path::new(file))),
            None => Some(relative(
                path,
                Path::new(&format!(
                    "{}.usage.json",
                    path.file_stem().and_then(|s| s.to_str()).unwrap_or("edge")
                )),
            )),
        };
        let http = HttpSettings {
            http_addr,
            nodes_addr,
            api_key_names: (0..api_keys.len())
                .map(|i| legacy_name("api_keys", i))
                .collect(),
            admin_key_names: (0..admin_keys.len())
                .map(|i| legacy_name("admin_keys", i))
                .collect(),
            api_keys,
            keys: named,
            admin_keys,
            admin_loopback: raw.auth.admin_loopback,
            usage_file,
            max_body_bytes: limits.max_body_bytes.unwrap_or(8 << 20),
            max_concurrent_requests: limits.max_concurrent_requests.unwrap_or(1024).max(1),
            header_read_timeout: Duration::from_secs(
                limits.header_read_timeout_sec.unwrap_or(30).max(1),
            ),
            max_header_bytes: limits
                .max_header_bytes
                .unwrap_or(MIN_HEADER_BYTES)
                .max(MIN_HEADER_BYTES),
            body_read_timeout: positive_secs(
                "limits.body_read_timeout_sec",
                limits.body_read_timeout_sec,
                30,
            )?,
            idle_timeout: positive_secs("limits.idle_timeout_sec", limits.idle_timeout_sec, 60)?,
            max_connections: limits.max_connections.unwrap_or(8192).max(1),
            max_streams_per_connection: limits.max_streams_per_connection.unwrap_or(128).max(1),
            max_inflight_bytes: limits.max_inflight_bytes.unwrap_or(256 << 20),
            sse_keepalive: positive_ms("limits.sse_keepalive_ms", limits.sse_keepalive_ms, 2000)?,
            response_timeout: Duration::from_secs(raw.timeouts.response_sec.unwrap_or(600).max(1)),
            handover_quiet: match limits.handover_quiet_ms.unwrap_or(2000) {
                ms @ 0..=60_000 => Duration::from_millis(ms),
                _ => {
                    return Err(invalid(
                        "limits.handover_quiet_ms",
                        "must be at most 60000".to_owned(),
                    ));
                }
            },
            shutdown_grace: match limits.shutdown_grace_sec.unwrap_or(30) {
                s @ 0..=MAX_SHUTDOWN_GRACE_SEC => Duration::from_secs(s),
                _ => {
                    return Err(invalid(
                        "limits.shutdown_grace_sec",
                        format!("must be at most {MAX_SHUTDOWN_GRACE_SEC}"),
                    ));
                }
            },
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
            Some(cluster) => Some(cluster_settings(cluster, nodes_addr, http_addr, path)?),
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

/// The listeners' TLS: the node link is TLS unless plaintext is asked for explicitly, and
/// plaintext on a non-loopback address needs a second, louder opt-in.
fn tls_settings(
    listen: &RawListen,
    nodes_addr: SocketAddr,
    path: &Path,
) -> Result<TlsSettings, ConfigError> {
    let nodes_files = match (&listen.nodes_tls, listen.nodes_plaintext) {
        (Some(_), true) => {
            return Err(invalid(
                "listen.nodes_plaintext",
                "set either listen.nodes_tls or nodes_plaintext = true, not both",
            ));
        }
        (None, false) => {
            return Err(invalid(
                "listen.nodes_tls",
                "missing: the node link is TLS; give cert_file and key_file (`iop-edge \
                 gen-cert` makes a self-signed pair), or set listen.nodes_plaintext = true",
            ));
        }
        (None, true) => {
            if !nodes_addr.ip().is_loopback() && !listen.allow_public_plaintext {
                return Err(invalid(
                    "listen.nodes_plaintext",
                    format!(
                        "refused on {nodes_addr}: node tokens, provider keys and every prompt \
                         would cross the network in clear; use listen.nodes_tls, or set \
                         listen.allow_public_plaintext = true if another layer encrypts the link"
                    ),
                ));
            }
            None
        }
        (Some(t), false) => Some(ServerFiles {
            cert_file: relative(path, &t.cert_file),
            key_file: relative(path, &t.key_file),
            client_ca_file: t.client_ca_file.as_ref().map(|f| relative(path, f)),
        }),
    };
    let nodes = nodes_files
        .as_ref()
        .map(|files| iop_shell_common::tls::server_config("listen.nodes_tls", files, &[]))
        .transpose()?;
    let http = listen
        .http_tls
        .as_ref()
        .map(|t| {
            let files = ServerFiles {
                cert_file: relative(path, &t.cert_file),
                key_file: relative(path, &t.key_file),
                client_ca_file: None,
            };
            iop_shell_common::tls::server_config("listen.http_tls", &files, &[b"h2", b"http/1.1"])
        })
        .transpose()?;
    Ok(TlsSettings {
        nodes,
        nodes_files,
        http,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[listen]
http = "127.0.0.1:8080"
nodes = "127.0.0.1:7100"
nodes_plaintext = true

[[nodes]]
id = "n1"
token = "t-0123456789abcdef"
[[nodes.adapters]]
name = "mock"
type = "mock"
capacity = 2
targets = ["m"]

[[models]]
name = "chat"
providers = [{ node = "n1", adapter = "mock", target = "m" }]
"#;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("edge.toml"))
    }

    const CLUSTER: &str =
        "\n[cluster]\nendpoints = [\"http://127.0.0.1:2379\"]\nedge_id = \"edge-a\"\n";

    #[test]
    fn a_cluster_section_names_etcd_and_defaults_the_rest() {
        let config = parse(&format!("{MINIMAL}{CLUSTER}")).expect("valid");
        let cluster = config.cluster.expect("cluster mode");
        assert_eq!(cluster.prefix, "/iop");
        assert_eq!(cluster.advertise_nodes, "127.0.0.1:7100");
        assert_eq!(cluster.lease_ttl, Duration::from_secs(10));
        assert_eq!(cluster.keepalive, Duration::from_secs(3));
        assert_eq!(cluster.resync, Duration::from_secs(30));
        assert!(parse(MINIMAL).expect("valid").cluster.is_none());
    }

    #[test]
    fn a_cluster_section_that_cannot_work_is_refused_naming_the_key() {
        let refused = |extra: &str, key: &str| {
            let text = format!("{MINIMAL}{CLUSTER}{extra}");
            let err = parse(&text).expect_err(extra).to_string();
            assert!(err.contains(key), "{extra}: {err}");
        };
        refused(
            "lease_ttl_sec = 6\nkeepalive_sec = 3\n",
            "cluster.keepalive_sec",
        );
        refused("resync_sec = 0\n", "cluster.resync_sec");
        refused("username = \"iop\"\n", "cluster.username");
        refused("cert_file = \"c.pem\"\n", "cluster.cert_file");
        let bad_id = format!("{MINIMAL}{}", CLUSTER.replace("edge-a", "edge/a"));
        assert!(
            parse(&bad_id)
                .expect_err("slash")
                .to_string()
                .contains("cluster.edge_id")
        );
        let with_user = format!(
            "{MINIMAL}{}",
            CLUSTER.replace("http://", "http://iop:secret@")
        );
        let err = parse(&with_user).expect_err("credentials").to_string();
        assert!(
            err.contains("cluster.endpoints") && !err.contains("secret"),
            "{err}"
        );
        let bad_url = format!("{MINIMAL}{}", CLUSTER.replace("http://", "etcd://"));
        assert!(
            parse(&bad_url)
                .expect_err("scheme")
                .to_string()
                .contains("cluster.endpoints")
        );
        // A wildcard listener cannot be what others dial.
        let wildcard = format!("{MINIMAL}{CLUSTER}")
            .replace("127.0.0.1:7100", "0.0.0.0:7100")
            .replace(
                "nodes_plaintext = true",
                "nodes_plaintext = true\nallow_public_plaintext = true",
            );
        assert!(
            parse(&wildcard)
                .expect_err("wildcard")
                .to_string()
                .contains("cluster.advertise_nodes")
        );
        let named = format!("{wildcard}advertise_nodes = \"10.0.0.1:7100\"\n");
        assert_eq!(
            parse(&named)
                .expect("named")
                .cluster
                .expect("cluster")
                .advertise_nodes,
            "10.0.0.1:7100"
        );
    }

    #[test]
    fn the_shared_configuration_replaces_the_sections_it_holds_and_nothing_else() {
        let local = format!("{MINIMAL}\n[auth]\nadmin_loopback = true\n{CLUSTER}");
        let shared = MINIMAL
            .split_once("[[nodes]]")
            .map(|(_, rest)| format!("[[nodes]]{rest}"))
            .expect("nodes")
            .replace("name = \"chat\"", "name = \"pushed\"");
        let config = Config::parse_shared(&local, &shared, Path::new("edge.toml")).expect("valid");
        assert!(
            config.core.models.contains_key("pushed") && !config.core.models.contains_key("chat")
        );
        // `[auth]` was not in the shared text: the local file's stays.
        assert!(config.http.admin_loopback);
        assert!(config.cluster.is_some());
        let listen = format!("[listen]\nhttp = \"127.0.0.1:1\"\nnodes = \"127.0.0.1:2\"\n{shared}");
        let err =
            Config::parse_shared(&local, &listen, Path::new("edge.toml")).expect_err("per process");
        assert!(
            err.to_string().contains("belongs to each edge's own file"),
            "{err}"
        );
        let broken = shared.replace("node = \"n1\"", "node = \"nobody\"");
        assert!(Config::parse_shared(&local, &broken, Path::new("edge.toml")).is_err());
    }

    #[test]
    fn a_minimal_config_parses() {
        let cfg = Config::parse(MINIMAL, Path::new("edge.toml")).expect("valid");
        assert_eq!(cfg.core.nodes.len(), 1);
        assert_eq!(cfg.core.models["chat"].candidates.len(), 1);
        assert!(cfg.http.api_keys.is_empty());
        assert!(cfg.tls.nodes.is_none(), "plaintext as asked");
    }

    #[test]
    fn the_shutdown_grace_defaults_to_30_s_may_be_0_and_is_bounded() {
        let grace = |extra: &str| {
            Config::parse(&format!("{MINIMAL}\n{extra}\n"), Path::new("edge.toml"))
                .map(|cfg| cfg.http.shutdown_grace)
        };
        assert_eq!(grace("").expect("valid"), Duration::from_secs(30));
        assert_eq!(
            grace("[limits]\nshutdown_grace_sec = 0").expect("valid"),
            Duration::ZERO
        );
        assert_eq!(
            grace("[limits]\nshutdown_grace_sec = 86400").expect("valid"),
            Duration::from_secs(86_400)
        );
        let err = grace("[limits]\nshutdown_grace_sec = 86401").expect_err("too long");
        assert!(
            err.to_string().contains("limits.shutdown_grace_sec"),
            "{err}"
        );
    }

    #[test]
    fn traces_go_where_the_file_or_the_standard_environment_says() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        let none = TraceExport::resolve(RawTracing::default(), env(&[])).expect("valid");
        assert_eq!(none, None);
        let base = TraceExport::resolve(
            RawTracing::default(),
            env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
                ("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=abc"),
            ]),
        )
        .expect("valid")
        .expect("configured");
        assert_eq!(base.endpoint.to_string(), "http://collector:4318/v1/traces");
        assert!(base.json);
        assert_eq!(
            base.headers,
            vec![("x-api-key".to_owned(), "abc".to_owned())]
        );
        assert!(
            !format!("{base:?}").contains("abc"),
            "a header's value in Debug"
        );
        let disabled = TraceExport::resolve(
            RawTracing::default(),
            env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
                ("OTEL_SDK_DISABLED", "true"),
            ]),
        );
        assert_eq!(disabled.expect("valid"), None);
        let grpc = TraceExport::resolve(
            RawTracing {
                otlp_endpoint: Some("http://collector:4317".into()),
                protocol: Some("grpc".into()),
                ..RawTracing::default()
            },
            env(&[]),
        );
        assert!(grpc.is_err_and(|e| e.to_string().contains("tracing.protocol")));
        let bad = TraceExport::resolve(
            RawTracing {
                otlp_endpoint: Some("collector:4318".into()),
                ..RawTracing::default()
            },
            env(&[]),
        );
        assert!(bad.is_err_and(|e| e.to_string().contains("tracing.otlp_endpoint")));
        let userinfo = TraceExport::resolve(
            RawTracing {
                otlp_endpoint: Some("https://me:secret@collector:4318/v1/traces".into()),
                ..RawTracing::default()
            },
            env(&[]),
        );
        assert!(userinfo.is_err_and(|e| !e.to_string().contains("secret")));
    }

    #[test]
    fn worker_threads_default_to_half_the_cpus_and_are_bounded() {
        let threads = |extra: &str| {
            Config::parse(&format!("{MINIMAL}\n{extra}\n"), Path::new("edge.toml"))
                .map(|cfg| cfg.worker_threads.get())
        };
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(threads("").expect("valid"), (cpus / 2).max(1));
        assert_eq!(threads("[runtime]\nworker_threads = 1").expect("valid"), 1);
        assert_eq!(threads("[runtime]\nworker_threads = 8").expect("valid"), 8);
        for bad in ["0", "1025", "-1"] {
            let err =
                threads(&format!("[runtime]\nworker_threads = {bad}")).expect_err("out of range");
            assert!(err.to_string().contains("worker_threads"), "{err}");
        }
    }

    #[test]
    fn the_head_limit_is_never_below_what_hyper_accepts() {
        let head = |limit: &str| {
            let text = format!("{MINIMAL}\n[limits]\n{limit}\n");
            Config::parse(&text, Path::new("edge.toml"))
                .expect("valid")
                .http
                .max_header_bytes
        };
        assert_eq!(head(""), MIN_HEADER_BYTES);
        // Below hyper's minimum it would panic on every connection: raised instead.
        assert_eq!(head("max_header_bytes = 5000"), MIN_HEADER_BYTES);
        assert_eq!(head("max_header_bytes = 65536"), 65_536);
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder.max_buf_size(head("max_header_bytes = 1"));
    }

    #[test]
    fn public_plaintext_needs_a_second_opt_in_and_keys_may_be_hashed() {
        let text = MINIMAL.replace("127.0.0.1:7100", "0.0.0.0:7100").replace(
            "nodes_plaintext = true",
            "nodes_plaintext = true\nallow_public_plaintext = true",
        );
        let digest = iop_proto_core::token::sha256_hex(b"sk-admin");
        let text = format!(
            "{text}\n[auth]\napi_keys = [\"sk-client\"]\nadmin_keys = [\"sha256:{digest}\"]\n"
        );
        let cfg = Config::parse(&text, Path::new("edge.toml")).expect("valid");
        assert!(cfg.http.admin_keys[0].verify(b"sk-admin"));
        assert!(cfg.http.api_keys[0].verify(b"sk-client"));
    }

    #[test]
    fn errors_name_the_key() {
        let cases = [
            (
                MINIMAL.replace("type = \"mock\"", "type = \"cli\""),
                "nodes[0].adapters[0].type",
            ),
            (
                MINIMAL.replace("token = \"t-0123456789abcdef\"", ""),
                "nodes[0].token",
            ),
            (
                MINIMAL.replace("t-0123456789abcdef", "short"),
                "nodes[0].token",
            ),
            (
                MINIMAL
                    .replace("127.0.0.1:7100", "0.0.0.0:7100")
                    .replace("nodes_plaintext = true", "nodes_plaintext = true\nallow_public_plaintext = true")
                    .replace("t-0123456789abcdef", EXAMPLE_TOKEN),
                "nodes[0].token",
            ),
            (
                MINIMAL.replace("127.0.0.1:7100", "0.0.0.0:7100"),
                "listen.nodes_plaintext",
            ),
            (
                MINIMAL.replace("nodes_plaintext = true", ""),
                "listen.nodes_tls",
            ),
            (
                MINIMAL.replace(
                    "nodes_plaintext = true",
                    "[listen.nodes_tls]\ncert_file = \"/nonexistent/c.pem\"\nkey_file = \"/nonexistent/k.pem\"",
                ),
                "listen.nodes_tls.cert_file",
            ),
            (format!("{MINIMAL}\n[auth]\napi_keys = [\"\", \"sk-real\"]\n"), "auth.api_keys[0]"),
            (format!("{MINIMAL}\n[auth]\nadmin_keys = [\"  \"]\n"), "auth.admin_keys[0]"),
            (
                format!("{MINIMAL}\n[auth]\napi_keys = [\"sk-a\"]\nadmin_keys = [\"sk-a\"]\n"),
                "auth.admin_keys[0]",
            ),
            (
                MINIMAL.replace("nodes = \"127.0.0.1:7100\"", "nodes = \"x\""),
                "listen.nodes",
            ),
            (
                MINIMAL.replace("adapter = \"mock\"", "adapter = \"nope\""),
                "no adapter",
            ),
            (
                MINIMAL.replace("capacity = 2", "capacity = 2\nsurprise = 1"),
                "surprise",
            ),
            (
                format!("{MINIMAL}\n[queue]\nwait_timeout_ms = 0\n"),
                "queue.wait_timeout_ms",
            ),
        ];
        for (text, key) in cases {
            let err = Config::parse(&text, Path::new("edge.toml"))
                .expect_err(key)
                .to_string();
            assert!(err.contains(key), "{err:?} does not name {key}");
        }
    }
}
