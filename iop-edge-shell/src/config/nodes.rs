//! `[[nodes]]` and `[[models]]`: the nodes the Edge accepts (their tokens and adapters)
//! and the model groups callers name, with the security rules on tokens.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use iop_proto_core::edge_config::EdgeTiming;
use iop_proto_core::wire::{AdapterConfig, AdapterType, NodeRuntimeConfig};
use iop_proto_core::{CandidateSpec, ModelSpec, NodeSpec, TokenVerifier};
use iop_shell_common::config::{ConfigError, invalid};
use serde::Deserialize;

use super::routing::positive_secs_f64;

/// Shortest node token accepted.
pub const MIN_TOKEN_CHARS: usize = 16;

/// The token of the quickstart configuration; refused unless the node listener is on
/// loopback.
pub const EXAMPLE_TOKEN: &str = "dev-token-change-me";

/// `nodes[].request_timeout_sec`: the longest provider call a node makes.
pub const DEFAULT_NODE_REQUEST_TIMEOUT_SEC: u32 = 600;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawNode {
    pub(super) id: String,
    pub(super) token: Option<String>,
    pub(super) token_sha256: Option<String>,
    pub(super) request_timeout_sec: Option<u32>,
    #[serde(default)]
    pub(super) adapters: Vec<RawAdapter>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdapter {
    #[serde(default)]
    pub(super) name: String,
    #[serde(rename = "type")]
    pub(super) kind: String,
    #[serde(default)]
    pub(super) base_url: String,
    #[serde(default)]
    pub(super) api_key: String,
    pub(super) capacity: u32,
    #[serde(default)]
    pub(super) long_capacity: u32,
    #[serde(default)]
    pub(super) targets: Vec<String>,
    #[serde(default = "yes")]
    pub(super) enabled: bool,
    #[serde(default)]
    pub(super) options: BTreeMap<String, String>,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawModel {
    pub(super) name: String,
    /// What model lists show people (`display_name`); the name when left out.
    pub(super) display_name: Option<String>,
    pub(super) long_context_threshold: Option<u64>,
    pub(super) context_tokens: Option<u64>,
    pub(super) first_byte_timeout_sec: Option<f64>,
    /// How many times a streamed answer lost midway is continued elsewhere (default 1;
    /// 0: never).
    pub(super) resume_limit: Option<u32>,
    /// Seconds without an event after which a stream that can be continued is (off
    /// unless set).
    pub(super) stall_timeout_sec: Option<f64>,
    /// How its requests are placed (`routing.affinity` when left out).
    pub(super) affinity: Option<String>,
    #[serde(default)]
    pub(super) providers: Vec<RawCandidate>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCandidate {
    pub(super) node: String,
    pub(super) adapter: String,
    pub(super) target: String,
}

/// The nodes of `[[nodes]]`, by id: each token checked (long enough, not the quickstart's
/// on a public node listener), each adapter's type known.
pub(super) fn nodes(
    raw: Vec<RawNode>,
    nodes_addr: SocketAddr,
    timing: &EdgeTiming,
) -> Result<BTreeMap<String, NodeSpec>, ConfigError> {
    let mut nodes = BTreeMap::new();
    for (i, node) in raw.into_iter().enumerate() {
        let key = format!("nodes[{i}]");
        let token = token(&key, node.token, node.token_sha256, nodes_addr)?;
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
                request_timeout_sec: node
                    .request_timeout_sec
                    .unwrap_or(DEFAULT_NODE_REQUEST_TIMEOUT_SEC),
            },
        };
        if nodes.insert(node.id.clone(), spec).is_some() {
            return Err(invalid(
                format!("{key}.id"),
                format!("node {:?} is defined twice", node.id),
            ));
        }
    }
    Ok(nodes)
}

/// A node's token check from `token` (a secret of at least [`MIN_TOKEN_CHARS`]
/// characters, not [`EXAMPLE_TOKEN`] on a node listener off loopback) or `token_sha256`.
fn token(
    key: &str,
    token: Option<String>,
    sha256: Option<String>,
    nodes_addr: SocketAddr,
) -> Result<TokenVerifier, ConfigError> {
    match (token, sha256) {
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
            Ok(TokenVerifier::from_secret(t.as_bytes()))
        }
        (None, Some(hex)) => TokenVerifier::from_sha256_hex(&hex)
            .ok_or_else(|| invalid(format!("{key}.token_sha256"), "must be 64 hex digits")),
        (Some(_), Some(_)) => Err(invalid(key, "set token or token_sha256, not both")),
        _ => Err(invalid(
            format!("{key}.token"),
            "missing or empty (or set token_sha256)",
        )),
    }
}

/// The model groups of `[[models]]`, by name.
pub(super) fn models(raw: Vec<RawModel>) -> Result<BTreeMap<String, ModelSpec>, ConfigError> {
    let mut models = BTreeMap::new();
    for (i, model) in raw.into_iter().enumerate() {
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
            context_tokens: model.context_tokens,
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
            resume_limit: model.resume_limit,
            stall_timeout: model
                .stall_timeout_sec
                .map(|s| {
                    positive_secs_f64(
                        &format!("models[{i}].stall_timeout_sec"),
                        Some(s),
                        Duration::ZERO,
                    )
                })
                .transpose()?,
            affinity: model
                .affinity
                .as_deref()
                .map(|word| super::routing::affinity_mode(&format!("models[{i}].affinity"), word))
                .transpose()?,
        };
        if models.insert(model.name.clone(), spec).is_some() {
            return Err(invalid(
                format!("models[{i}].name"),
                format!("model {:?} is defined twice", model.name),
            ));
        }
    }
    Ok(models)
}
