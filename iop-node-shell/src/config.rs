//! The Node's local configuration file (TOML). It holds only what a node needs before it
//! reaches the Edge: the Edge address, its identity and token, the reconnect policy and
//! timeouts. Adapter configuration comes from the Edge, never from this file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use iop_proto_core::{Backoff, ReconnectPolicy};
use serde::Deserialize;

/// Environment variable read for the token when the file sets neither `token` nor
/// `token_file`.
pub const TOKEN_ENV: &str = "IOP_NODE_TOKEN";

/// A secret that never prints.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The secret value, for the one place that sends it.
    #[must_use]
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

pub use iop_shell_common::config::ConfigError;
use iop_shell_common::config::invalid;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    node_id: String,
    edge_addr: String,
    token: Option<String>,
    token_file: Option<PathBuf>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    reconnect: RawReconnect,
    #[serde(default)]
    timeouts: RawTimeouts,
    #[serde(default)]
    tls: RawTls,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    ca_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReconnect {
    max_attempts: Option<i64>,
    interval_sec: Option<f64>,
    backoff: Option<RawBackoff>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBackoff {
    base_ms: u64,
    max_ms: u64,
    #[serde(default)]
    jitter: f64,
    #[serde(default)]
    seed: u64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTimeouts {
    connect_sec: Option<f64>,
    handshake_sec: Option<f64>,
    request_sec: Option<f64>,
    shutdown_grace_sec: Option<f64>,
}

/// A validated node configuration.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Node identity, as configured on the Edge.
    pub node_id: String,
    /// `host:port` of the Edge's node listener.
    pub edge_addr: String,
    /// The node's token.
    pub token: Secret,
    /// Labels reported at register.
    pub labels: BTreeMap<String, String>,
    /// Reconnect policy (initial dial and every reconnect).
    pub policy: ReconnectPolicy,
    /// Optional exponential backoff instead of the fixed interval.
    pub backoff: Option<Backoff>,
    /// Dial timeout.
    pub connect_timeout: Duration,
    /// Register + configure + ready must complete within this.
    pub handshake_timeout: Duration,
    /// Default upper bound of one provider request when the Edge sends none.
    pub request_timeout: Duration,
    /// How long shutdown waits for cancelled work to end in order.
    pub shutdown_grace: Duration,
    /// Extra CA certificates (PEM) trusted for `https://` providers.
    pub ca_file: Option<PathBuf>,
}

fn seconds(key: &'static str, value: Option<f64>, default: f64) -> Result<Duration, ConfigError> {
    let secs = value.unwrap_or(default);
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => Err(invalid(
            key,
            format!("must be a positive number of seconds, got {secs}"),
        )),
    }
}

impl NodeConfig {
    /// Reads and validates `path`; the token may come from the environment.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = iop_shell_common::config::read(path)?;
        Self::parse(&text, path, std::env::var(TOKEN_ENV).ok())
    }

    /// Parses and validates configuration text. `env_token` is the value of
    /// [`TOKEN_ENV`], if set. Relative `token_file` paths resolve against `path`'s folder.
    pub fn parse(text: &str, path: &Path, env_token: Option<String>) -> Result<Self, ConfigError> {
        let raw: RawConfig = iop_shell_common::config::parse_toml(text, path)?;
        if raw.node_id.trim().is_empty() {
            return Err(invalid("node_id", "must not be empty"));
        }
        if !valid_addr(&raw.edge_addr) {
            return Err(invalid(
                "edge_addr",
                format!("must be host:port, got {:?}", raw.edge_addr),
            ));
        }
        let token = match (raw.token, raw.token_file) {
            (Some(_), Some(_)) => {
                return Err(invalid("token", "set either token or token_file, not both"));
            }
            (Some(token), None) => token,
            (None, Some(file)) => {
                let file = path.parent().map_or(file.clone(), |dir| dir.join(&file));
                std::fs::read_to_string(&file)
                    .map_err(|err| {
                        invalid(
                            "token_file",
                            format!("cannot read {}: {err}", file.display()),
                        )
                    })?
                    .trim()
                    .to_owned()
            }
            (None, None) => env_token.ok_or_else(|| {
                invalid(
                    "token",
                    format!(
                        "missing: set token, token_file or the {TOKEN_ENV} environment variable"
                    ),
                )
            })?,
        };
        if token.is_empty() {
            return Err(invalid("token", "must not be empty"));
        }
        let policy =
            ReconnectPolicy::from_config(raw.reconnect.max_attempts, raw.reconnect.interval_sec)
                .map_err(|err| invalid("reconnect", err.to_string()))?;
        let backoff = match raw.reconnect.backoff {
            None => None,
            Some(b) => {
                if b.base_ms == 0 || b.max_ms < b.base_ms || !(0.0..=1.0).contains(&b.jitter) {
                    return Err(invalid(
                        "reconnect.backoff",
                        "needs 0 < base_ms <= max_ms and 0 <= jitter <= 1",
                    ));
                }
                Some(Backoff {
                    base: Duration::from_millis(b.base_ms),
                    max: Duration::from_millis(b.max_ms),
                    jitter: b.jitter,
                    seed: b.seed,
                })
            }
        };
        Ok(NodeConfig {
            node_id: raw.node_id,
            edge_addr: raw.edge_addr,
            token: Secret(token),
            labels: raw.labels,
            policy,
            backoff,
            connect_timeout: seconds("timeouts.connect_sec", raw.timeouts.connect_sec, 5.0)?,
            handshake_timeout: seconds("timeouts.handshake_sec", raw.timeouts.handshake_sec, 10.0)?,
            request_timeout: seconds("timeouts.request_sec", raw.timeouts.request_sec, 600.0)?,
            shutdown_grace: seconds(
                "timeouts.shutdown_grace_sec",
                raw.timeouts.shutdown_grace_sec,
                5.0,
            )?,
            ca_file: raw
                .tls
                .ca_file
                .map(|file| path.parent().map_or(file.clone(), |dir| dir.join(&file))),
        })
    }
}

fn valid_addr(addr: &str) -> bool {
    match addr.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<NodeConfig, ConfigError> {
        NodeConfig::parse(text, Path::new("/nonexistent/node.toml"), None)
    }

    #[test]
    fn minimal_config_takes_the_contract_defaults() {
        let cfg = parse("node_id = \"n1\"\nedge_addr = \"127.0.0.1:7100\"\ntoken = \"t\"\n")
            .expect("valid");
        assert_eq!(cfg.policy, ReconnectPolicy::default());
        assert_eq!(cfg.connect_timeout, Duration::from_secs(5));
        assert!(!format!("{cfg:?}").contains("\"t\""), "token printed");
    }

    #[test]
    fn errors_name_the_key() {
        let cases = [
            (
                "node_id = \"\"\nedge_addr = \"a:1\"\ntoken = \"t\"",
                "node_id",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"nope\"\ntoken = \"t\"",
                "edge_addr",
            ),
            ("node_id = \"n\"\nedge_addr = \"a:1\"", "token"),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t\"\n[reconnect]\nmax_attempts = -1",
                "reconnect",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t\"\n[reconnect]\nmax_attempts = 0\ninterval_sec = 0",
                "reconnect",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t\"\n[timeouts]\nconnect_sec = -2",
                "timeouts.connect_sec",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t\"\nadapters = []",
                "adapters",
            ),
        ];
        for (text, key) in cases {
            let err = parse(text).expect_err(text).to_string();
            assert!(err.contains(key), "{err} does not name {key}");
        }
    }

    #[test]
    fn token_may_come_from_the_environment() {
        let cfg = NodeConfig::parse(
            "node_id = \"n\"\nedge_addr = \"a:1\"",
            Path::new("x.toml"),
            Some("from-env".into()),
        )
        .expect("valid");
        assert_eq!(cfg.token.expose(), "from-env");
    }
}
