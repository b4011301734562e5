//! `[limits]` and `[auth]`: the public listener's limits, the client and admin keys, and
//! the named keys with their models, limits and budgets ([`HttpSettings`]). Defaults are
//! named.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use iop_api::tenant::{Budget, KeyPolicy, Period};
use iop_proto_core::{ModelSpec, TokenVerifier};
use iop_shell_common::config::{ConfigError, invalid};
use serde::Deserialize;

use super::{keys, positive_ms, positive_secs, relative};

/// `limits.max_body_bytes`: larger request bodies get 413.
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 << 20;
/// `limits.max_concurrent_requests`: requests at once, counted once a body is in.
pub const DEFAULT_MAX_CONCURRENT_REQUESTS: usize = 1024;
/// `limits.header_read_timeout_sec`.
pub const DEFAULT_HEADER_READ_TIMEOUT_SEC: u64 = 30;
/// `limits.body_read_timeout_sec`.
pub const DEFAULT_BODY_READ_TIMEOUT_SEC: u64 = 30;
/// `limits.idle_timeout_sec`: a connection with no request in progress is closed.
pub const DEFAULT_IDLE_TIMEOUT_SEC: u64 = 60;
/// `limits.max_connections`: open connections on the public listener.
pub const DEFAULT_MAX_CONNECTIONS: usize = 8192;
/// `limits.max_streams_per_connection`: HTTP/2 streams.
pub const DEFAULT_MAX_STREAMS_PER_CONNECTION: u32 = 128;
/// `limits.max_inflight_bytes`: request bodies and response bytes buffered for callers.
pub const DEFAULT_MAX_INFLIGHT_BYTES: usize = 256 << 20;
/// `limits.sse_keepalive_ms`: an SSE comment on a stream idle this long.
pub const DEFAULT_SSE_KEEPALIVE_MS: u64 = 2_000;
/// `timeouts.response_sec`: the longest a request may take, queueing included.
pub const DEFAULT_RESPONSE_SEC: u64 = 600;
/// `limits.handover_quiet_ms`: how long a process handing over keeps its nodes for late
/// requests...
pub const DEFAULT_HANDOVER_QUIET_MS: u64 = 2_000;
/// ...at most.
pub const MAX_HANDOVER_QUIET_MS: u64 = 60_000;
/// `limits.shutdown_grace_sec`: how long requests in flight may take after SIGTERM...
pub const DEFAULT_SHUTDOWN_GRACE_SEC: u64 = 30;
/// ...at most a day.
pub const MAX_SHUTDOWN_GRACE_SEC: u64 = 86_400;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimits {
    pub(super) max_body_bytes: Option<usize>,
    pub(super) max_concurrent_requests: Option<usize>,
    pub(super) header_read_timeout_sec: Option<u64>,
    pub(super) max_header_bytes: Option<usize>,
    pub(super) body_read_timeout_sec: Option<u64>,
    pub(super) idle_timeout_sec: Option<u64>,
    pub(super) max_connections: Option<usize>,
    pub(super) max_streams_per_connection: Option<u32>,
    pub(super) max_inflight_bytes: Option<usize>,
    pub(super) sse_keepalive_ms: Option<u64>,
    pub(super) shutdown_grace_sec: Option<u64>,
    pub(super) handover_quiet_ms: Option<u64>,
    pub(super) max_frame_bytes: Option<usize>,
    pub(super) pending_frame_bytes: Option<usize>,
    pub(super) max_pending_connections: Option<usize>,
    pub(super) max_pending_per_address: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAuth {
    #[serde(default)]
    pub(super) api_keys: Vec<String>,
    #[serde(default)]
    pub(super) admin_keys: Vec<String>,
    #[serde(default)]
    pub(super) admin_loopback: bool,
    #[serde(default)]
    pub(super) keys: Vec<RawKey>,
    pub(super) usage_file: Option<String>,
}

/// One named client key (`[[auth.keys]]`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawKey {
    pub(super) name: String,
    pub(super) key: String,
    pub(super) models: Option<Vec<String>>,
    pub(super) requests_per_minute: Option<u32>,
    pub(super) tokens_per_minute: Option<u64>,
    pub(super) max_concurrent: Option<u32>,
    pub(super) token_budget: Option<u64>,
    pub(super) budget_period: Option<String>,
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
    /// Every model's `display_name` (its name when it sets none), by name.
    pub display_names: std::collections::BTreeMap<String, Arc<str>>,
    /// `messages.keep_billing_header`: Claude Code's attribution line stays in the
    /// system prompt a provider sees.
    pub keep_billing_header: bool,
    /// `responses.store_max_entries` and `store_max_bytes`: the caps of the stored
    /// responses (0 entries: none is kept).
    pub responses_store: (usize, usize),
    /// `routing.session_header`: a request header naming the caller's session, read
    /// before the well-known ones.
    pub session_header: Option<http::HeaderName>,
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

/// The HTTP side from `[limits]`, `[auth]` and `timeouts.response_sec`: the keys (client,
/// admin and named, never one key in two roles), where their usage is kept, and every
/// limit of the public listener.
pub(super) fn http_settings(
    limits: RawLimits,
    auth: RawAuth,
    response_sec: Option<u64>,
    (http_addr, nodes_addr): (SocketAddr, SocketAddr),
    models: &BTreeMap<String, ModelSpec>,
    path: &Path,
) -> Result<HttpSettings, ConfigError> {
    let max_body_bytes = limits.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
    if let Some(budget) = limits.max_inflight_bytes
        && budget < max_body_bytes
    {
        return Err(invalid(
            "limits.max_inflight_bytes",
            "must be at least limits.max_body_bytes, or no request fits",
        ));
    }
    let api_keys = keys("auth.api_keys", auth.api_keys)?;
    let admin_keys = keys("auth.admin_keys", auth.admin_keys)?;
    let named = named_keys(auth.keys, models)?;
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
    let usage_file = match auth.usage_file.as_deref() {
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
    Ok(HttpSettings {
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
        admin_loopback: auth.admin_loopback,
        usage_file,
        max_body_bytes,
        max_concurrent_requests: limits
            .max_concurrent_requests
            .unwrap_or(DEFAULT_MAX_CONCURRENT_REQUESTS)
            .max(1),
        header_read_timeout: Duration::from_secs(
            limits
                .header_read_timeout_sec
                .unwrap_or(DEFAULT_HEADER_READ_TIMEOUT_SEC)
                .max(1),
        ),
        max_header_bytes: limits
            .max_header_bytes
            .unwrap_or(MIN_HEADER_BYTES)
            .max(MIN_HEADER_BYTES),
        body_read_timeout: positive_secs(
            "limits.body_read_timeout_sec",
            limits.body_read_timeout_sec,
            DEFAULT_BODY_READ_TIMEOUT_SEC,
        )?,
        idle_timeout: positive_secs(
            "limits.idle_timeout_sec",
            limits.idle_timeout_sec,
            DEFAULT_IDLE_TIMEOUT_SEC,
        )?,
        max_connections: limits
            .max_connections
            .unwrap_or(DEFAULT_MAX_CONNECTIONS)
            .max(1),
        max_streams_per_connection: limits
            .max_streams_per_connection
            .unwrap_or(DEFAULT_MAX_STREAMS_PER_CONNECTION)
            .max(1),
        max_inflight_bytes: limits
            .max_inflight_bytes
            .unwrap_or(DEFAULT_MAX_INFLIGHT_BYTES),
        sse_keepalive: positive_ms(
            "limits.sse_keepalive_ms",
            limits.sse_keepalive_ms,
            DEFAULT_SSE_KEEPALIVE_MS,
        )?,
        response_timeout: Duration::from_secs(response_sec.unwrap_or(DEFAULT_RESPONSE_SEC).max(1)),
        handover_quiet: match limits
            .handover_quiet_ms
            .unwrap_or(DEFAULT_HANDOVER_QUIET_MS)
        {
            ms @ 0..=MAX_HANDOVER_QUIET_MS => Duration::from_millis(ms),
            _ => {
                return Err(invalid(
                    "limits.handover_quiet_ms",
                    format!("must be at most {MAX_HANDOVER_QUIET_MS}"),
                ));
            }
        },
        display_names: std::collections::BTreeMap::new(),
        keep_billing_header: false,
        responses_store: (0, 0),
        session_header: None,
        shutdown_grace: match limits
            .shutdown_grace_sec
            .unwrap_or(DEFAULT_SHUTDOWN_GRACE_SEC)
        {
            s @ 0..=MAX_SHUTDOWN_GRACE_SEC => Duration::from_secs(s),
            _ => {
                return Err(invalid(
                    "limits.shutdown_grace_sec",
                    format!("must be at most {MAX_SHUTDOWN_GRACE_SEC}"),
                ));
            }
        },
    })
}
