//! Contract rules a decoded message must satisfy before anything acts on it.
//!
//! Decoding only proves a frame is well-formed protobuf. [`Validate`] checks what the
//! contract adds: required identifiers, enum values this schema knows, the admitted node
//! commands, and adapter configurations that can actually run. Every failure names the
//! message and field at fault.

use super::{
    AdapterConfig, AdapterLoad, AdapterType, Body, CancelKind, CancelRequest, ClusterMembers,
    Envelope, Heartbeat, HeartbeatAck, NodeCommandRequest, NodeCommandResponse, NodeCommandType,
    NodeConfigPayload, NodeConfigRefreshRequest, NodeConfigRefreshResponse, NodeDrainRequest,
    NodeReadyRequest, NodeReadyResponse, NodeRehomeRequest, ProviderTunnelFrame,
    ProviderTunnelRequest, RefreshStatus, RegisterRequest, RegisterResponse, RunEvent,
    RunEventType, RunRequest, TunnelFrameKind, TunnelRequest,
};

/// The read-only Ollama endpoints an `OLLAMA_API` command may reach.
pub const OLLAMA_API_ENDPOINTS: [(&str, &str); 4] = [
    ("GET", "/api/tags"),
    ("GET", "/api/ps"),
    ("GET", "/api/version"),
    ("POST", "/api/show"),
];

/// The `RunRequest`/`ProviderTunnelRequest` metadata key naming the caller's request (its
/// `x-request-id`). Observation only: both sides log it, nothing acts on it.
pub const REQUEST_ID_KEY: &str = "request_id";

/// The metadata key of a run's `COMPLETE` event that says why the answer ended, in
/// OpenAI's words: `stop` (the model finished, or a stop sequence fired), `length` (cut
/// at `max_tokens`). Optional: an Edge that reads no such key assumes `stop`.
pub const FINISH_REASON_KEY: &str = "finish_reason";

/// The metadata key of a run's `COMPLETE` event naming the stop sequence that ended the
/// answer, where the provider says which. Optional.
pub const STOP_SEQUENCE_KEY: &str = "stop_sequence";

/// The `RunRequest.metadata` keys a run carries the caller's W3C Trace Context in (the
/// `traceparent` and `tracestate` headers, as they came): the Node passes them on to the
/// provider. A tunnel carries them among its headers instead.
pub const TRACE_KEYS: [&str; 2] = ["traceparent", "tracestate"];

/// Whether `id` may name a request in logs and headers: 1 to 128 characters of
/// `A-Z a-z 0-9 - _ . : / + = @` (no spaces, quotes or control characters, so it cannot
/// forge a log line or a header). Anything else is replaced, not trusted.
#[must_use]
pub fn is_request_id(id: &[u8]) -> bool {
    (1..=128).contains(&id.len())
        && id
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/+=@".contains(b))
}

/// A contract rule a message breaks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ValidationError {
    /// A required string field is empty.
    #[error("{message}.{field} must not be empty")]
    EmptyField {
        /// The message, as the schema names it (`RunEvent`).
        message: &'static str,
        /// The field, as the schema spells it (`run_id`).
        field: &'static str,
    },
    /// A required sub-message is absent.
    #[error("{message}.{field} is missing")]
    MissingField {
        /// The message, as the schema names it (`RunEvent`).
        message: &'static str,
        /// The field, as the schema spells it (`run_id`).
        field: &'static str,
    },
    /// An enum field holds a number this schema does not define.
    #[error("{message}.{field} holds unknown enum value {value}")]
    UnknownEnumValue {
        /// The message, as the schema names it (`RunEvent`).
        message: &'static str,
        /// The field, as the schema spells it (`run_id`).
        field: &'static str,
        /// The value received.
        value: i32,
    },
    /// An enum field that must be set is `*_UNSPECIFIED`.
    #[error("{message}.{field} is unspecified")]
    UnspecifiedEnum {
        /// The message, as the schema names it (`RunEvent`).
        message: &'static str,
        /// The field, as the schema spells it (`run_id`).
        field: &'static str,
    },
    /// A node command outside `CAPABILITIES`, `TRANSPORT_STATUS`, `OLLAMA_API`.
    #[error(
        "node command type {value} is not admitted (only CAPABILITIES, TRANSPORT_STATUS, OLLAMA_API)"
    )]
    CommandNotAdmitted {
        /// The command type received.
        value: i32,
    },
    /// An `OLLAMA_API` command for an endpoint outside the read-only set.
    #[error(
        "OLLAMA_API admits only GET /api/tags, GET /api/ps, GET /api/version and POST /api/show, not {method} {path}"
    )]
    OllamaEndpointNotAdmitted {
        /// Requested method.
        method: String,
        /// Requested path.
        path: String,
    },
    /// An HTTP path that is not absolute.
    #[error("{message}.path must start with '/', got {path:?}")]
    RelativePath {
        /// The message, as the schema names it (`RunEvent`).
        message: &'static str,
        /// The path received.
        path: String,
    },
    /// An adapter instance that cannot run as configured.
    #[error("adapter {adapter:?}: {problem}")]
    InvalidAdapter {
        /// Instance name (or index when unnamed and untyped).
        adapter: String,
        /// What is wrong.
        problem: &'static str,
    },
    /// Two adapter instances share a name.
    #[error("adapter name {name:?} is used by more than one adapter")]
    DuplicateAdapter {
        /// The repeated instance name.
        name: String,
    },
    /// A field of an unauthenticated message is larger than any legitimate value.
    #[error("{message}.{field} is longer than {limit}")]
    TooLong {
        /// The message, as the schema names it (`RunEvent`).
        message: &'static str,
        /// The field, as the schema spells it (`run_id`).
        field: &'static str,
        /// The largest accepted size (bytes, or entries for a list or map).
        limit: usize,
    },
}

/// Longest `RegisterRequest.node_id`, in bytes.
pub const MAX_NODE_ID_BYTES: usize = 256;
/// Longest `RegisterRequest.token`, in bytes.
pub const MAX_TOKEN_BYTES: usize = 4096;
/// Most `RegisterRequest.labels` and `adapter_types` entries; each key and value is at
/// most [`MAX_NODE_ID_BYTES`].
pub const MAX_REGISTER_ENTRIES: usize = 64;

/// Contract validation of a decoded message.
pub trait Validate {
    /// `Ok` when the message satisfies every rule of the contract that applies to it.
    fn validate(&self) -> Result<(), ValidationError>;
}

fn non_empty(
    value: &str,
    message: &'static str,
    field: &'static str,
) -> Result<(), ValidationError> {
    if value.is_empty() {
        Err(ValidationError::EmptyField { message, field })
    } else {
        Ok(())
    }
}

/// Checks that `value` is a defined, specified value of enum `E`.
fn specified<E>(
    value: i32,
    message: &'static str,
    field: &'static str,
) -> Result<E, ValidationError>
where
    E: TryFrom<i32> + Default + PartialEq,
{
    let parsed = E::try_from(value).map_err(|_| ValidationError::UnknownEnumValue {
        message,
        field,
        value,
    })?;
    if parsed == E::default() {
        return Err(ValidationError::UnspecifiedEnum { message, field });
    }
    Ok(parsed)
}

impl Validate for Envelope {
    fn validate(&self) -> Result<(), ValidationError> {
        match &self.body {
            None => Err(ValidationError::MissingField {
                message: "Envelope",
                field: "body",
            }),
            Some(body) => body.validate(),
        }
    }
}

impl Validate for Body {
    fn validate(&self) -> Result<(), ValidationError> {
        match self {
            Body::RegisterRequest(m) => m.validate(),
            Body::RegisterResponse(m) => m.validate(),
            Body::NodeReadyRequest(m) => m.validate(),
            Body::NodeReadyResponse(m) => m.validate(),
            Body::Heartbeat(m) => m.validate(),
            Body::HeartbeatAck(m) => m.validate(),
            Body::RunRequest(m) => m.validate(),
            Body::RunEvent(m) => m.validate(),
            Body::ProviderTunnelRequest(m) => m.validate(),
            Body::ProviderTunnelFrame(m) => m.validate(),
            Body::CancelRequest(m) => m.validate(),
            Body::NodeCommandRequest(m) => m.validate(),
            Body::NodeCommandResponse(m) => m.validate(),
            Body::NodeConfigRefreshRequest(m) => m.validate(),
            Body::NodeConfigRefreshResponse(m) => m.validate(),
            Body::NodeDrainRequest(m) => m.validate(),
            Body::NodeRehomeRequest(m) => m.validate(),
            Body::NodeLoadReport(m) => validate_loads(&m.held_elsewhere, "NodeLoadReport"),
            Body::ClusterMembers(m) => m.validate(),
        }
    }
}

impl Validate for RegisterRequest {
    /// Besides a node id, bounds every field: the message arrives before the peer is
    /// authenticated.
    fn validate(&self) -> Result<(), ValidationError> {
        const M: &str = "RegisterRequest";
        let too_long = |field, limit| {
            Err(ValidationError::TooLong {
                message: M,
                field,
                limit,
            })
        };
        non_empty(&self.node_id, M, "node_id")?;
        if self.node_id.len() > MAX_NODE_ID_BYTES {
            return too_long("node_id", MAX_NODE_ID_BYTES);
        }
        if self.token.len() > MAX_TOKEN_BYTES {
            return too_long("token", MAX_TOKEN_BYTES);
        }
        if self.version.len() > MAX_NODE_ID_BYTES {
            return too_long("version", MAX_NODE_ID_BYTES);
        }
        if self.labels.len() > MAX_REGISTER_ENTRIES
            || self
                .labels
                .iter()
                .any(|(k, v)| k.len() > MAX_NODE_ID_BYTES || v.len() > MAX_NODE_ID_BYTES)
        {
            return too_long("labels", MAX_REGISTER_ENTRIES);
        }
        if self.adapter_types.len() > MAX_REGISTER_ENTRIES
            || self
                .adapter_types
                .iter()
                .any(|t| t.len() > MAX_NODE_ID_BYTES)
        {
            return too_long("adapter_types", MAX_REGISTER_ENTRIES);
        }
        Ok(())
    }
}

impl Validate for RegisterResponse {
    fn validate(&self) -> Result<(), ValidationError> {
        if !self.accepted {
            return Ok(());
        }
        non_empty(&self.node_id, "RegisterResponse", "node_id")?;
        if let Some(cluster) = &self.cluster {
            cluster.validate()?;
        }
        self.config
            .as_ref()
            .ok_or(ValidationError::MissingField {
                message: "RegisterResponse",
                field: "config",
            })?
            .validate()
    }
}

impl Validate for NodeReadyRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        non_empty(&self.node_id, "NodeReadyRequest", "node_id")?;
        validate_loads(&self.held_elsewhere, "NodeReadyRequest")
    }
}

/// Most entries of a `held_elsewhere` list (one per adapter instance a node runs).
pub const MAX_LOAD_ENTRIES: usize = 1024;

/// A `held_elsewhere` list: bounded, each adapter named (at most
/// [`MAX_NODE_ID_BYTES`]) once, and no more long-context requests than requests.
fn validate_loads(loads: &[AdapterLoad], message: &'static str) -> Result<(), ValidationError> {
    let field = "held_elsewhere";
    if loads.len() > MAX_LOAD_ENTRIES {
        return Err(ValidationError::TooLong {
            message,
            field,
            limit: MAX_LOAD_ENTRIES,
        });
    }
    let mut names: Vec<&str> = Vec::with_capacity(loads.len());
    for load in loads {
        if load.adapter.is_empty() || load.adapter.len() > MAX_NODE_ID_BYTES {
            return Err(ValidationError::InvalidAdapter {
                adapter: load.adapter.chars().take(64).collect(),
                problem: "held_elsewhere names no adapter, or one longer than 256 bytes",
            });
        }
        if load.long_in_flight > load.in_flight {
            return Err(ValidationError::InvalidAdapter {
                adapter: load.adapter.clone(),
                problem: "held_elsewhere counts more long-context requests than requests",
            });
        }
        names.push(&load.adapter);
    }
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(ValidationError::DuplicateAdapter {
            name: w[0].to_owned(),
        });
    }
    Ok(())
}

impl Validate for NodeReadyResponse {
    fn validate(&self) -> Result<(), ValidationError> {
        Ok(())
    }
}

impl Validate for Heartbeat {
    fn validate(&self) -> Result<(), ValidationError> {
        Ok(())
    }
}

impl Validate for HeartbeatAck {
    fn validate(&self) -> Result<(), ValidationError> {
        Ok(())
    }
}

impl Validate for RunRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        non_empty(&self.run_id, "RunRequest", "run_id")?;
        non_empty(&self.adapter, "RunRequest", "adapter")
    }
}

impl Validate for RunEvent {
    fn validate(&self) -> Result<(), ValidationError> {
        non_empty(&self.run_id, "RunEvent", "run_id")?;
        specified::<RunEventType>(self.r#type, "RunEvent", "type").map(drop)
    }
}

impl Validate for ProviderTunnelRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        let set = [&self.run_id, &self.adapter, &self.method].map(|field| !field.is_empty());
        tunnel_request(set, self.path.as_bytes())
    }
}

impl Validate for TunnelRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        let (set, path) = self.required();
        tunnel_request(set, path)
    }
}

/// A tunnel request's rules, read from either form of it: whether its run id, adapter and
/// method are set, and its path's bytes.
fn tunnel_request(set: [bool; 3], path: &[u8]) -> Result<(), ValidationError> {
    const M: &str = "ProviderTunnelRequest";
    for (set, field) in set.into_iter().zip(["run_id", "adapter", "method"]) {
        if !set {
            return Err(ValidationError::EmptyField { message: M, field });
        }
    }
    if path.first() != Some(&b'/') {
        return Err(ValidationError::RelativePath {
            message: M,
            path: String::from_utf8_lossy(path).into_owned(),
        });
    }
    Ok(())
}

impl Validate for ProviderTunnelFrame {
    fn validate(&self) -> Result<(), ValidationError> {
        non_empty(&self.run_id, "ProviderTunnelFrame", "run_id")?;
        specified::<TunnelFrameKind>(self.kind, "ProviderTunnelFrame", "kind").map(drop)
    }
}

impl Validate for CancelRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        non_empty(&self.run_id, "CancelRequest", "run_id")?;
        specified::<CancelKind>(self.kind, "CancelRequest", "kind").map(drop)
    }
}

impl Validate for NodeCommandRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        const M: &str = "NodeCommandRequest";
        // The admitted set is checked first, before anything that hints at a provider.
        let kind = NodeCommandType::try_from(self.r#type)
            .ok()
            .filter(|kind| *kind != NodeCommandType::Unspecified)
            .ok_or(ValidationError::CommandNotAdmitted { value: self.r#type })?;
        non_empty(&self.request_id, M, "request_id")?;
        if kind == NodeCommandType::OllamaApi {
            non_empty(&self.adapter, M, "adapter")?;
            let admitted = OLLAMA_API_ENDPOINTS
                .iter()
                .any(|(method, path)| *method == self.method && *path == self.path);
            if !admitted {
                return Err(ValidationError::OllamaEndpointNotAdmitted {
                    method: self.method.clone(),
                    path: self.path.clone(),
                });
            }
        }
        Ok(())
    }
}

impl Validate for NodeCommandResponse {
    fn validate(&self) -> Result<(), ValidationError> {
        non_empty(&self.request_id, "NodeCommandResponse", "request_id")
    }
}

impl Validate for AdapterConfig {
    fn validate(&self) -> Result<(), ValidationError> {
        let kind = match AdapterType::try_from(self.r#type) {
            Ok(AdapterType::Unspecified) | Err(_) => {
                return Err(ValidationError::InvalidAdapter {
                    adapter: self.name.clone(),
                    problem: "type must be one of openai_compat, vllm, ollama, mock",
                });
            }
            Ok(kind) => kind,
        };
        let invalid = |problem| ValidationError::InvalidAdapter {
            adapter: self.instance_name().to_owned(),
            problem,
        };
        if self.enabled && self.capacity == 0 {
            return Err(invalid(
                "capacity must be at least 1 for an enabled adapter",
            ));
        }
        if self.long_capacity > self.capacity {
            return Err(invalid("long_capacity must not exceed capacity"));
        }
        if kind != AdapterType::Mock
            && !(self.base_url.starts_with("http://") || self.base_url.starts_with("https://"))
        {
            return Err(invalid("base_url must start with http:// or https://"));
        }
        if kind != AdapterType::Mock && url_has_credentials(&self.base_url) {
            // They would travel in the `Host` header and stand in errors and logs.
            return Err(invalid(
                "base_url must not carry credentials (user:password@); put the key in api_key",
            ));
        }
        if self.targets.iter().any(String::is_empty) {
            return Err(invalid("targets must not contain an empty name"));
        }
        match self.options.get("dispatch").map(String::as_str) {
            None | Some("run") => {}
            Some("tunnel")
                if matches!(
                    kind,
                    AdapterType::OpenaiCompat | AdapterType::Vllm | AdapterType::Mock
                ) => {}
            Some("tunnel") => {
                return Err(invalid(
                    "option dispatch = \"tunnel\" needs an openai_compat, vllm or mock adapter",
                ));
            }
            Some(_) => return Err(invalid("option dispatch must be \"run\" or \"tunnel\"")),
        }
        Ok(())
    }
}

impl Validate for NodeConfigPayload {
    fn validate(&self) -> Result<(), ValidationError> {
        let mut names: Vec<&str> = Vec::with_capacity(self.adapters.len());
        for adapter in &self.adapters {
            adapter.validate()?;
            let name = adapter.instance_name();
            if names.contains(&name) {
                return Err(ValidationError::DuplicateAdapter {
                    name: name.to_owned(),
                });
            }
            names.push(name);
        }
        Ok(())
    }
}

impl Validate for NodeConfigRefreshRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        non_empty(&self.request_id, "NodeConfigRefreshRequest", "request_id")?;
        self.config
            .as_ref()
            .ok_or(ValidationError::MissingField {
                message: "NodeConfigRefreshRequest",
                field: "config",
            })?
            .validate()
    }
}

impl Validate for NodeConfigRefreshResponse {
    fn validate(&self) -> Result<(), ValidationError> {
        non_empty(&self.request_id, "NodeConfigRefreshResponse", "request_id")?;
        specified::<RefreshStatus>(self.status, "NodeConfigRefreshResponse", "status").map(drop)
    }
}

/// The longest reason a [`NodeDrainRequest`] may give (it is logged).
pub const MAX_DRAIN_REASON_BYTES: usize = 256;

impl Validate for NodeDrainRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        if self.reason.len() > MAX_DRAIN_REASON_BYTES {
            return Err(ValidationError::TooLong {
                message: "NodeDrainRequest",
                field: "reason",
                limit: MAX_DRAIN_REASON_BYTES,
            });
        }
        Ok(())
    }
}

impl Validate for NodeRehomeRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        if self.reason.len() > MAX_DRAIN_REASON_BYTES {
            return Err(ValidationError::TooLong {
                message: "NodeRehomeRequest",
                field: "reason",
                limit: MAX_DRAIN_REASON_BYTES,
            });
        }
        Ok(())
    }
}

/// The most Edges a `ClusterMembers` may list.
pub const MAX_CLUSTER_MEMBERS: usize = 64;

impl Validate for ClusterMembers {
    /// Bounded: at most [`MAX_CLUSTER_MEMBERS`] Edges, each with an id and an address of
    /// at most [`MAX_NODE_ID_BYTES`] bytes, neither empty.
    fn validate(&self) -> Result<(), ValidationError> {
        const M: &str = "ClusterMembers";
        if self.members.len() > MAX_CLUSTER_MEMBERS {
            return Err(ValidationError::TooLong {
                message: M,
                field: "members",
                limit: MAX_CLUSTER_MEMBERS,
            });
        }
        if self.edge_id.len() > MAX_NODE_ID_BYTES {
            return Err(ValidationError::TooLong {
                message: M,
                field: "edge_id",
                limit: MAX_NODE_ID_BYTES,
            });
        }
        for edge in &self.members {
            non_empty(&edge.edge_id, M, "members.edge_id")?;
            non_empty(&edge.node_addr, M, "members.node_addr")?;
            if edge.edge_id.len() > MAX_NODE_ID_BYTES || edge.node_addr.len() > MAX_NODE_ID_BYTES {
                return Err(ValidationError::TooLong {
                    message: M,
                    field: "members",
                    limit: MAX_NODE_ID_BYTES,
                });
            }
        }
        Ok(())
    }
}

/// Whether an `http(s)://` URL names a user (and maybe a password) before its host.
fn url_has_credentials(url: &str) -> bool {
    url.split_once("://")
        .map_or(url, |(_, rest)| rest)
        .split(['/', '?', '#'])
        .next()
        .is_some_and(|authority| authority.contains('@'))
}

#[cfg(test)]
mod tests;
