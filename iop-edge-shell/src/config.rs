//! The Edge's TOML configuration: listen addresses, nodes with their tokens and adapters,
//! model groups, queue limits, timers, HTTP limits and client API keys. Errors name the
//! key and the problem; the core validates the protocol rules.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use iop_proto_core::wire::{AdapterConfig, AdapterType, NodeRuntimeConfig};
use iop_proto_core::{
    CandidateSpec, EdgeConfig, EdgeTiming, ModelSpec, NodeSpec, QueueLimits, TokenVerifier,
};
use serde::Deserialize;

pub use iop_shell_common::config::ConfigError;
use iop_shell_common::config::invalid;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    listen: RawListen,
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
    nodes: Vec<RawNode>,
    #[serde(default)]
    models: Vec<RawModel>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawListen {
    http: String,
    nodes: String,
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
struct RawLimits {
    max_body_bytes: Option<usize>,
    max_concurrent_requests: Option<usize>,
    header_read_timeout_sec: Option<u64>,
    max_header_bytes: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAuth {
    #[serde(default)]
    api_keys: Vec<String>,
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    name: String,
    long_context_threshold: Option<u64>,
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

/// HTTP-side settings (everything the core does not decide).
#[derive(Clone, Debug)]
pub struct HttpSettings {
    /// Public HTTP listen address.
    pub http_addr: SocketAddr,
    /// Node listener address.
    pub nodes_addr: SocketAddr,
    /// Client API keys (empty: no authentication).
    pub api_keys: Vec<TokenVerifier>,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Requests served at once; more get 503.
    pub max_concurrent_requests: usize,
    /// Time to receive a request's headers; on a kept-alive connection it also bounds the
    /// wait for the next request, so it is the idle timeout too.
    pub header_read_timeout: Duration,
    /// Largest accepted request head.
    pub max_header_bytes: usize,
    /// Upper bound of one request, queueing included (then 504 and a cancel).
    pub response_timeout: Duration,
}

/// The whole Edge configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// What the core governs.
    pub core: EdgeConfig,
    /// What the HTTP shell governs.
    pub http: HttpSettings,
}

fn addr(key: &str, value: &str) -> Result<SocketAddr, ConfigError> {
    value
        .parse()
        .map_err(|_| invalid(key, format!("must be ip:port, got {value:?}")))
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
        let queue = QueueLimits {
            max_waiting: raw.queue.max_waiting.unwrap_or(256),
            wait_timeout: positive_ms("queue.wait_timeout_ms", raw.queue.wait_timeout_ms, 30_000)?,
        };
        let mut nodes = BTreeMap::new();
        for (i, node) in raw.nodes.into_iter().enumerate() {
            let key = format!("nodes[{i}]");
            let token = match (node.token, node.token_sha256) {
                (Some(t), None) if !t.is_empty() => TokenVerifier::Plain(t.into_bytes()),
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
        };
        core.validate()
            .map_err(|err| invalid("config", err.to_string()))?;
        let limits = raw.limits;
        let http = HttpSettings {
            http_addr: addr("listen.http", &raw.listen.http)?,
            nodes_addr: addr("listen.nodes", &raw.listen.nodes)?,
            api_keys: raw
                .auth
                .api_keys
                .into_iter()
                .map(|k| TokenVerifier::Plain(k.into_bytes()))
                .collect(),
            max_body_bytes: limits.max_body_bytes.unwrap_or(8 << 20),
            max_concurrent_requests: limits.max_concurrent_requests.unwrap_or(1024).max(1),
            header_read_timeout: Duration::from_secs(
                limits.header_read_timeout_sec.unwrap_or(30).max(1),
            ),
            max_header_bytes: limits.max_header_bytes.unwrap_or(64 << 10).max(4096),
            response_timeout: Duration::from_secs(raw.timeouts.response_sec.unwrap_or(600).max(1)),
        };
        Ok(Config { core, http })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[listen]
http = "127.0.0.1:8080"
nodes = "127.0.0.1:7100"

[[nodes]]
id = "n1"
token = "t"
[[nodes.adapters]]
name = "mock"
type = "mock"
capacity = 2
targets = ["m"]

[[models]]
name = "chat"
providers = [{ node = "n1", adapter = "mock", target = "m" }]
"#;

    #[test]
    fn a_minimal_config_parses() {
        let cfg = Config::parse(MINIMAL, Path::new("edge.toml")).expect("valid");
        assert_eq!(cfg.core.nodes.len(), 1);
        assert_eq!(cfg.core.models["chat"].candidates.len(), 1);
        assert!(cfg.http.api_keys.is_empty());
    }

    #[test]
    fn errors_name_the_key() {
        let cases = [
            (
                MINIMAL.replace("type = \"mock\"", "type = \"cli\""),
                "nodes[0].adapters[0].type",
            ),
            (MINIMAL.replace("token = \"t\"", ""), "nodes[0].token"),
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
