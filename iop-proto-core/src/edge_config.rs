//! The Edge's configured world: nodes with their credentials and adapter instances, model
//! groups with their provider candidates, timing and queue limits. Validated as a whole,
//! with an error that names the key at fault, and compared with [`EdgeConfig::diff`] to
//! decide which nodes need a config refresh.

use std::collections::BTreeMap;
use std::time::Duration;

pub use crate::guard::{ConflictLimits, PendingLimits, ThrottleLimits};
use crate::token::TokenVerifier;
use crate::wire::{
    AdapterConfig, AdapterType, NodeConfigPayload, NodeRuntimeConfig, Validate, ValidationError,
};

/// One node the Edge accepts.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeSpec {
    /// How its token is checked.
    pub token: TokenVerifier,
    /// Adapter instances the node runs (sent in `RegisterResponse` and refreshes).
    pub adapters: Vec<AdapterConfig>,
    /// Runtime limits sent with the adapters.
    pub runtime: NodeRuntimeConfig,
}

impl NodeSpec {
    /// The payload sent to the node at `revision`.
    #[must_use]
    pub fn payload(&self, revision: u64) -> NodeConfigPayload {
        NodeConfigPayload {
            revision,
            adapters: self.adapters.clone(),
            runtime: Some(self.runtime),
        }
    }

    /// The adapter instance named `provider_id`.
    #[must_use]
    pub fn adapter(&self, provider_id: &str) -> Option<&AdapterConfig> {
        self.adapters
            .iter()
            .find(|adapter| adapter.instance_name() == provider_id)
    }
}

/// One provider candidate of a model group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CandidateSpec {
    /// Node hosting the provider.
    pub node_id: String,
    /// Adapter instance name on that node.
    pub provider_id: String,
    /// Model name the provider knows.
    pub target: String,
}

/// A public model name and the providers that can serve it.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ModelSpec {
    /// Candidates, in configuration order (the round-robin order on ties).
    pub candidates: Vec<CandidateSpec>,
    /// Requests whose estimated prompt tokens reach this count use long-context capacity.
    pub long_context_threshold: Option<u64>,
    /// The model's context window in tokens: a request whose estimated prompt is larger
    /// is refused before any provider sees it (`SubmitError::PromptTooLong`).
    pub context_tokens: Option<u64>,
    /// How long a dispatch may go without its first byte before another provider is
    /// tried beside it; `None`: [`Routing::first_byte_timeout`]. A model whose prefill
    /// is slow, or whose callers ask for long answers without streaming (a non-streamed
    /// tunnel's first byte is its whole answer), wants a longer one.
    pub first_byte_timeout: Option<Duration>,
    /// How many times a streamed answer lost after its first byte may be continued on
    /// another provider that can continue it; `None`: once. `Some(0)` never does.
    pub resume_limit: Option<u32>,
    /// How long a streamed answer that can be continued may go without an event before
    /// its provider counts as stalled: the run is cancelled and the answer continued
    /// elsewhere. `None`: never (a stream waits on, within the request's deadline).
    pub stall_timeout: Option<Duration>,
    /// How its requests are placed; `None`: [`Routing::affinity`]'s mode.
    pub affinity: Option<AffinityMode>,
}

/// Timers of the Edge's node protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EdgeTiming {
    /// How often the Edge pings each node connection, and tells nodes to ping.
    pub heartbeat_interval: Duration,
    /// Silence after which a node connection is considered lost.
    pub heartbeat_timeout: Duration,
    /// Time a new connection has to register and then to report ready.
    pub register_timeout: Duration,
    /// Time a node has to answer a config refresh.
    pub refresh_timeout: Duration,
    /// Time a cancelled run keeps its lease while the node confirms the cancel.
    pub cancel_grace: Duration,
}

impl Default for EdgeTiming {
    fn default() -> Self {
        EdgeTiming {
            heartbeat_interval: Duration::from_secs(5),
            heartbeat_timeout: Duration::from_secs(15),
            register_timeout: Duration::from_secs(10),
            refresh_timeout: Duration::from_secs(10),
            cancel_grace: Duration::from_secs(15),
        }
    }
}

/// Queue limits per model group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueLimits {
    /// Requests that may wait per model group; one more is refused (HTTP 429).
    pub max_waiting: usize,
    /// How long a request waits for capacity before it fails.
    pub wait_timeout: Duration,
}

impl Default for QueueLimits {
    fn default() -> Self {
        QueueLimits {
            max_waiting: 256,
            wait_timeout: Duration::from_secs(30),
        }
    }
}

/// How the Edge admits node connections, beyond each node's token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admission {
    /// Every node must come over mutual TLS with a client certificate that names its
    /// node id (see [`Peer::identities`](crate::edge::Peer::identities)); a valid
    /// certificate for node A cannot register as node B.
    pub require_client_identity: bool,
    /// Back-off of sources that keep failing to register.
    pub throttle: ThrottleLimits,
    /// When two live connections fighting over one node id become a conflict.
    pub conflict: ConflictLimits,
    /// Caps on connections that have not registered yet.
    pub pending: PendingLimits,
    /// Largest frame a connection may send before its register is accepted: a
    /// `RegisterRequest` needs a few hundred bytes, so unauthenticated peers cannot make
    /// the Edge buffer megabytes each.
    pub pending_frame_len: usize,
    /// Largest frame of a registered connection.
    pub max_frame_len: usize,
}

impl Default for Admission {
    fn default() -> Self {
        Admission {
            require_client_identity: false,
            throttle: ThrottleLimits::default(),
            conflict: ConflictLimits::default(),
            pending: PendingLimits::default(),
            pending_frame_len: 64 * 1024,
            max_frame_len: crate::wire::DEFAULT_MAX_FRAME_LEN,
        }
    }
}

/// Which provider failures a request is retried on, on another candidate, before its
/// first byte reached the caller. A caller's own 4xx (400, 401, 404, 413, 422...) is
/// never among them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryOn {
    /// The provider could not be reached, or failed before answering (a node reports it
    /// as a retryable error: connection refused or reset, a timeout upstream).
    pub connect: bool,
    /// The provider answered 500-599.
    pub status_5xx: bool,
    /// The provider answered 429 (too many requests).
    pub status_429: bool,
    /// The provider answered 408 (request timeout).
    pub status_408: bool,
    /// The node serving the attempt was lost.
    pub node_lost: bool,
}

impl Default for RetryOn {
    fn default() -> Self {
        RetryOn {
            connect: true,
            status_5xx: true,
            status_429: true,
            status_408: true,
            node_lost: true,
        }
    }
}

impl RetryOn {
    /// Whether a provider answering `status` failed in a way worth another candidate.
    #[must_use]
    pub fn status(&self, status: u32) -> bool {
        match status {
            408 => self.status_408,
            429 => self.status_429,
            500..=599 => self.status_5xx,
            _ => false,
        }
    }
}

/// How requests are routed around failing providers: retries before the first byte,
/// ejection of a provider that keeps failing, and the first-byte deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routing {
    /// Dispatches a request may take in all (the first, retries, and tries beside a slow
    /// one). 1 turns retries off.
    pub max_attempts: u32,
    /// Requests being retried may be at most this share (percent) of the requests in
    /// flight, so that retries cannot multiply an outage...
    pub retry_budget_percent: u32,
    /// ...or this many, whichever is more.
    pub retry_budget_min: u32,
    /// Which failures are retried.
    pub retry_on: RetryOn,
    /// How long a dispatch may go without its first byte (a tunnel's response head, a
    /// run's first content) before another candidate is tried beside it (see
    /// [`ModelSpec::first_byte_timeout`]).
    pub first_byte_timeout: Duration,
    /// Consecutive failures that eject a provider.
    pub eject_after_failures: u32,
    /// A failure share (percent) of the recent outcomes that ejects a provider...
    pub eject_failure_percent: u32,
    /// ...once it has this many outcomes within [`eject_window`](Self::eject_window).
    pub eject_min_requests: u32,
    /// How far back outcomes count towards the failure share.
    pub eject_window: Duration,
    /// The first ejection; each further one in a row doubles it...
    pub eject_base: Duration,
    /// ...up to this.
    pub eject_max: Duration,
    /// No more than this share (percent) of a model group's providers is ejected at once,
    /// and never its last live one.
    pub max_ejected_percent: u32,
    /// The longest a provider's `Retry-After` cools it down.
    pub retry_after_max: Duration,
    /// Placing requests by their conversation ([`AffinityMode`]).
    pub affinity: Affinity,
}

impl Default for Routing {
    fn default() -> Self {
        Routing {
            max_attempts: 3,
            retry_budget_percent: 20,
            retry_budget_min: 3,
            retry_on: RetryOn::default(),
            first_byte_timeout: Duration::from_secs(10),
            eject_after_failures: 3,
            eject_failure_percent: 50,
            eject_min_requests: 10,
            eject_window: Duration::from_secs(30),
            eject_base: Duration::from_secs(5),
            eject_max: Duration::from_secs(60),
            max_ejected_percent: 50,
            retry_after_max: Duration::from_secs(300),
            affinity: Affinity::default(),
        }
    }
}

/// The Edge's whole configured set.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct EdgeConfig {
    /// Nodes by id.
    pub nodes: BTreeMap<String, NodeSpec>,
    /// Model groups by public name.
    pub models: BTreeMap<String, ModelSpec>,
    /// Protocol timers.
    pub timing: EdgeTiming,
    /// Queue limits.
    pub queue: QueueLimits,
    /// Node admission rules.
    pub admission: Admission,
    /// Retries, ejection and the first-byte deadline.
    pub routing: Routing,
}

/// A configuration that cannot run, naming the key at fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EdgeConfigError {
    /// A node id that is empty.
    #[error("nodes: a node id must not be empty")]
    EmptyNodeId,
    /// An adapter of a node breaks the wire contract.
    #[error("nodes.{node}.adapters: {source}")]
    Adapter {
        /// The node whose adapter is invalid.
        node: String,
        /// The adapter rule broken.
        #[source]
        source: ValidationError,
    },
    /// A model name that is empty.
    #[error("models: a model name must not be empty")]
    EmptyModelName,
    /// A candidate naming a node that is not configured.
    #[error("models.{model}: candidate node {node:?} is not configured")]
    UnknownNode {
        /// The model group naming it.
        model: String,
        /// Node id named.
        node: String,
    },
    /// A candidate naming an adapter its node does not have.
    #[error("models.{model}: node {node:?} has no adapter {provider:?}")]
    UnknownProvider {
        /// The model group naming it.
        model: String,
        /// The node named.
        node: String,
        /// Adapter instance named.
        provider: String,
    },
    /// A candidate whose target the adapter does not list.
    #[error("models.{model}: adapter {node}/{provider} does not serve target {target:?}")]
    TargetNotServed {
        /// The model group naming it.
        model: String,
        /// The node named.
        node: String,
        /// The adapter named.
        provider: String,
        /// Target named.
        target: String,
    },
    /// The same provider listed twice in one model group.
    #[error("models.{model}: provider {node}/{provider} is listed twice")]
    DuplicateCandidate {
        /// The model group naming it.
        model: String,
        /// The node named.
        node: String,
        /// The adapter named.
        provider: String,
    },
    /// A timer that cannot work.
    #[error("{key}: {problem}")]
    Timing {
        /// The config key.
        key: &'static str,
        /// What is wrong.
        problem: &'static str,
    },
}

/// What changed between two configurations.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConfigDiff {
    /// Nodes only in the new configuration.
    pub added_nodes: Vec<String>,
    /// Nodes only in the old configuration.
    pub removed_nodes: Vec<String>,
    /// Nodes in both whose adapters or runtime limits differ (need a refresh).
    pub changed_payloads: Vec<String>,
    /// Nodes in both whose credentials differ.
    pub changed_tokens: Vec<String>,
    /// Model names added, removed or changed.
    pub changed_models: Vec<String>,
}

impl ConfigDiff {
    /// True when nothing changed.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        *self == ConfigDiff::default()
    }
}

impl EdgeConfig {
    /// Checks every rule; the first broken one is returned.
    pub fn validate(&self) -> Result<(), EdgeConfigError> {
        let timing = &self.timing;
        if timing.heartbeat_interval.is_zero() {
            return Err(EdgeConfigError::Timing {
                key: "heartbeat.interval",
                problem: "must be positive",
            });
        }
        if timing.heartbeat_timeout <= timing.heartbeat_interval {
            return Err(EdgeConfigError::Timing {
                key: "heartbeat.timeout",
                problem: "must be longer than heartbeat.interval",
            });
        }
        if timing.register_timeout.is_zero() {
            return Err(EdgeConfigError::Timing {
                key: "register_timeout",
                problem: "must be positive",
            });
        }
        let admission = &self.admission;
        if admission.pending_frame_len < 4096
            || admission.pending_frame_len > admission.max_frame_len
        {
            return Err(EdgeConfigError::Timing {
                key: "limits.pending_frame_bytes",
                problem: "must be at least 4096 and at most limits.max_frame_bytes",
            });
        }
        if admission.pending.max_total == 0 || admission.pending.max_per_source == 0 {
            return Err(EdgeConfigError::Timing {
                key: "limits.max_pending_connections",
                problem: "must be positive, in all and per address",
            });
        }
        let routing = &self.routing;
        if routing.max_attempts == 0 {
            return Err(EdgeConfigError::Timing {
                key: "routing.max_attempts",
                problem: "must be at least 1 (1 turns retries off)",
            });
        }
        if routing.first_byte_timeout.is_zero()
            || self
                .models
                .values()
                .any(|m| m.first_byte_timeout.is_some_and(|t| t.is_zero()))
        {
            return Err(EdgeConfigError::Timing {
                key: "routing.first_byte_timeout_sec",
                problem: "must be positive",
            });
        }
        if routing.eject_base.is_zero() || routing.eject_max < routing.eject_base {
            return Err(EdgeConfigError::Timing {
                key: "routing.eject_base_sec",
                problem: "must be positive and at most routing.eject_max_sec",
            });
        }
        if routing.eject_window.is_zero() || routing.eject_after_failures == 0 {
            return Err(EdgeConfigError::Timing {
                key: "routing.eject_window_sec",
                problem: "routing.eject_window_sec and eject_after_failures must be positive",
            });
        }
        if routing.max_ejected_percent > 100
            || routing.eject_failure_percent > 100
            || routing.retry_budget_percent > 100
        {
            return Err(EdgeConfigError::Timing {
                key: "routing",
                problem: "percentages must be at most 100",
            });
        }
        if self.queue.wait_timeout.is_zero() {
            return Err(EdgeConfigError::Timing {
                key: "queue.wait_timeout",
                problem: "must be positive",
            });
        }
        for (node_id, node) in &self.nodes {
            if node_id.is_empty() {
                return Err(EdgeConfigError::EmptyNodeId);
            }
            node.payload(0)
                .validate()
                .map_err(|source| EdgeConfigError::Adapter {
                    node: node_id.clone(),
                    source,
                })?;
        }
        for (model, spec) in &self.models {
            if model.is_empty() {
                return Err(EdgeConfigError::EmptyModelName);
            }
            let mut seen: Vec<(&str, &str)> = Vec::new();
            for c in &spec.candidates {
                let node =
                    self.nodes
                        .get(&c.node_id)
                        .ok_or_else(|| EdgeConfigError::UnknownNode {
                            model: model.clone(),
                            node: c.node_id.clone(),
                        })?;
                let adapter = node.adapter(&c.provider_id).ok_or_else(|| {
                    EdgeConfigError::UnknownProvider {
                        model: model.clone(),
                        node: c.node_id.clone(),
                        provider: c.provider_id.clone(),
                    }
                })?;
                if c.target.is_empty()
                    || (!adapter.targets.is_empty() && !adapter.targets.contains(&c.target))
                {
                    return Err(EdgeConfigError::TargetNotServed {
                        model: model.clone(),
                        node: c.node_id.clone(),
                        provider: c.provider_id.clone(),
                        target: c.target.clone(),
                    });
                }
                let key = (c.node_id.as_str(), c.provider_id.as_str());
                if seen.contains(&key) {
                    return Err(EdgeConfigError::DuplicateCandidate {
                        model: model.clone(),
                        node: c.node_id.clone(),
                        provider: c.provider_id.clone(),
                    });
                }
                seen.push(key);
            }
        }
        Ok(())
    }

    /// What changed from `self` to `new`.
    #[must_use]
    pub fn diff(&self, new: &EdgeConfig) -> ConfigDiff {
        let mut diff = ConfigDiff::default();
        for (id, old) in &self.nodes {
            match new.nodes.get(id) {
                None => diff.removed_nodes.push(id.clone()),
                Some(node) => {
                    if node.adapters != old.adapters || node.runtime != old.runtime {
                        diff.changed_payloads.push(id.clone());
                    }
                    if node.token != old.token {
                        diff.changed_tokens.push(id.clone());
                    }
                }
            }
        }
        diff.added_nodes = new
            .nodes
            .keys()
            .filter(|id| !self.nodes.contains_key(*id))
            .cloned()
            .collect();
        let mut models: Vec<&String> = self.models.keys().chain(new.models.keys()).collect();
        models.sort();
        models.dedup();
        diff.changed_models = models
            .into_iter()
            .filter(|m| self.models.get(*m) != new.models.get(*m))
            .cloned()
            .collect();
        diff
    }
}

/// The provider category of an adapter type, for snapshots.
#[must_use]
pub fn category_of(kind: AdapterType) -> crate::wire::ProviderCategory {
    match kind {
        AdapterType::OpenaiCompat => crate::wire::ProviderCategory::Api,
        AdapterType::Vllm | AdapterType::Ollama | AdapterType::Mock => {
            crate::wire::ProviderCategory::LocalInference
        }
        AdapterType::Unspecified => crate::wire::ProviderCategory::Unspecified,
    }
}

/// How a model group places requests (`[routing] affinity`, per model `affinity`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AffinityMode {
    /// By load alone (the least loaded, weighted by first-byte latency).
    #[default]
    Off,
    /// A request naming its session by rendezvous hashing with bounded load; others by
    /// load.
    Session,
    /// Sessions as above; every other request by its anchor and its prefix match.
    Prefix,
}

impl AffinityMode {
    /// Its configuration word.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            AffinityMode::Off => "off",
            AffinityMode::Session => "session",
            AffinityMode::Prefix => "prefix",
        }
    }

    /// The mode `word` names.
    #[must_use]
    pub fn parse(word: &str) -> Option<Self> {
        Some(match word {
            "off" => AffinityMode::Off,
            "session" => AffinityMode::Session,
            "prefix" => AffinityMode::Prefix,
            _ => return None,
        })
    }
}

/// The placement settings (`[routing]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Affinity {
    /// The mode of model groups that do not set their own.
    pub mode: AffinityMode,
    /// No provider takes a placed request above this share (percent) of the group's mean
    /// load, counting the request (`load_factor` 1.25: 125).
    pub load_factor_percent: u32,
    /// Fingerprints remembered per Edge (each one provider's block): the memory bound of
    /// the prefix index (about 20 bytes each).
    pub prefix_entries: usize,
    /// The most of a prompt's first user message its anchor spans.
    pub anchor_bytes: usize,
    /// How long a request placed on a provider that is full waits for it before any
    /// provider may take it.
    pub wait: std::time::Duration,
}

impl Default for Affinity {
    fn default() -> Self {
        Affinity {
            mode: AffinityMode::Off,
            load_factor_percent: 125,
            prefix_entries: 1 << 20,
            anchor_bytes: 2048,
            wait: std::time::Duration::from_secs(3),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) use crate::testkit::adapter;

    pub(crate) fn node(adapters: Vec<AdapterConfig>) -> NodeSpec {
        NodeSpec {
            token: TokenVerifier::from_secret(b"tok"),
            adapters,
            runtime: NodeRuntimeConfig::default(),
        }
    }

    fn candidate(node: &str, provider: &str, target: &str) -> CandidateSpec {
        CandidateSpec {
            node_id: node.into(),
            provider_id: provider.into(),
            target: target.into(),
        }
    }

    fn config() -> EdgeConfig {
        let mut cfg = EdgeConfig::default();
        cfg.nodes.insert(
            "n1".into(),
            node(vec![adapter("a", AdapterType::Mock, 2, 1)]),
        );
        cfg.models.insert(
            "m".into(),
            ModelSpec {
                candidates: vec![candidate("n1", "a", "t")],
                long_context_threshold: None,
                context_tokens: None,
                first_byte_timeout: None,
                resume_limit: None,
                stall_timeout: None,
                affinity: None,
            },
        );
        cfg
    }

    #[test]
    fn a_consistent_config_validates() {
        assert_eq!(config().validate(), Ok(()));
    }

    #[test]
    fn candidates_must_reference_configured_providers_and_targets() {
        let mut cfg = config();
        cfg.models.get_mut("m").expect("m").candidates[0].node_id = "nx".into();
        assert!(matches!(
            cfg.validate(),
            Err(EdgeConfigError::UnknownNode { .. })
        ));
        let mut cfg = config();
        cfg.models.get_mut("m").expect("m").candidates[0].provider_id = "zz".into();
        assert!(matches!(
            cfg.validate(),
            Err(EdgeConfigError::UnknownProvider { .. })
        ));
        let mut cfg = config();
        cfg.models.get_mut("m").expect("m").candidates[0].target = "other".into();
        assert!(matches!(
            cfg.validate(),
            Err(EdgeConfigError::TargetNotServed { .. })
        ));
        let mut cfg = config();
        cfg.models
            .get_mut("m")
            .expect("m")
            .candidates
            .push(candidate("n1", "a", "t"));
        assert!(matches!(
            cfg.validate(),
            Err(EdgeConfigError::DuplicateCandidate { .. })
        ));
    }

    #[test]
    fn invalid_adapters_and_timers_are_named() {
        let mut cfg = config();
        cfg.nodes.get_mut("n1").expect("n1").adapters[0].r#type = 0;
        let err = cfg.validate().expect_err("unknown type");
        assert!(err.to_string().starts_with("nodes.n1.adapters"), "{err}");
        let mut cfg = config();
        cfg.timing.heartbeat_timeout = cfg.timing.heartbeat_interval;
        assert!(matches!(
            cfg.validate(),
            Err(EdgeConfigError::Timing {
                key: "heartbeat.timeout",
                ..
            })
        ));
    }

    #[test]
    fn diff_names_what_changed() {
        let old = config();
        assert!(old.diff(&old).is_empty());
        let mut new = config();
        new.nodes.get_mut("n1").expect("n1").adapters[0].capacity = 5;
        new.nodes.insert("n2".into(), node(vec![]));
        new.models.insert("m2".into(), ModelSpec::default());
        let diff = old.diff(&new);
        assert_eq!(diff.changed_payloads, vec!["n1".to_string()]);
        assert_eq!(diff.added_nodes, vec!["n2".to_string()]);
        assert_eq!(diff.changed_models, vec!["m2".to_string()]);
        assert!(diff.removed_nodes.is_empty());
        let back = new.diff(&old);
        assert_eq!(back.removed_nodes, vec!["n2".to_string()]);
    }
}
