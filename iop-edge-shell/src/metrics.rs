//! Metrics, kept and rendered with the Prometheus org's `prometheus-client` (OpenMetrics
//! text): requests by model and status, latency and time to first byte, queue depth and
//! wait, token usage, in-flight per provider, node connections, frames and bytes.
//!
//! Every label value comes from configuration or from a closed set (status codes,
//! reasons), never from caller input: an unknown model is counted as `_unknown`.

use foldhash::HashMap;
use std::sync::{Arc, LazyLock, Mutex, OnceLock, RwLock};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::status::Snapshot;
use iop_api::dialect::Dialect;

/// The `Content-Type` of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The model label of a request whose model is not one the Edge serves (or not known yet).
#[must_use]
pub fn unknown_model() -> Arc<str> {
    static UNKNOWN: LazyLock<Arc<str>> = LazyLock::new(|| Arc::from("_unknown"));
    UNKNOWN.clone()
}

/// Histogram buckets, in seconds.
const BOUNDS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabel {
    model: Arc<str>,
}

/// A request's model and status, and its API dialect where it is not OpenAI's (an
/// OpenAI request's series keep the labels they always had).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct RequestLabels {
    model: Arc<str>,
    status: u16,
    dialect: Option<&'static str>,
}

impl EncodeLabelSet for RequestLabels {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel;
        ("model", &*self.model).encode(encoder.encode_label())?;
        ("status", self.status).encode(encoder.encode_label())?;
        if let Some(dialect) = self.dialect {
            ("dialect", dialect).encode(encoder.encode_label())?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TokenLabels {
    model: Arc<str>,
    node: Arc<str>,
    provider: Arc<str>,
    /// The client key's name (never the key).
    key: Arc<str>,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProviderLabels {
    node: String,
    provider: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RetryLabels {
    model: Arc<str>,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EjectionLabels {
    node: Arc<str>,
    provider: Arc<str>,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabel {
    direction: &'static str,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

fn histogram() -> Histogram {
    Histogram::new(BOUNDS)
}

/// Gauges read from the core's snapshot when scraped.
#[derive(Debug, Default)]
struct Fleet {
    queue_depth: Family<ModelLabel, Gauge>,
    in_flight: Family<ProviderLabels, Gauge>,
    capacity: Family<ProviderLabels, Gauge>,
    nodes_ready: Gauge,
    nodes_draining: Gauge,
    responses_stored: Gauge,
    responses_store_bytes: Gauge,
    affinity_placed: Family<ReasonLabel, Gauge>,
    affinity_matched_blocks: Gauge,
    affinity_prefix_entries: Gauge,
    affinity_prefix_bytes: Gauge,
    ejected: Family<ProviderLabels, Gauge>,
    /// In cluster mode only (a series per this Edge's id; none on a single Edge).
    cluster_member: Family<EdgeLabel, Gauge>,
    cluster_members: Family<EdgeLabel, Gauge>,
    cluster_detached: Family<EdgeLabel, Gauge>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EdgeLabel {
    edge: String,
}

/// The series one public model's requests record into, each looked up in its family the
/// first time it is used and then held: a request's figures cost one lookup of its model
/// instead of one per series (six, hashing up to three names each), and its token
/// counters one more. A series appears in the exposition only once something was
/// recorded into it, as with the families alone.
#[derive(Debug)]
pub struct ModelMetrics {
    model: Arc<str>,
    requests: Family<RequestLabels, Counter>,
    tokens: Family<TokenLabels, Counter>,
    /// Requests answered 200, the status nearly all of them have.
    ok: OnceLock<Counter>,
    latency: ModelHistogram,
    ttfb: ModelHistogram,
    queue_wait: ModelHistogram,
    /// Prompt and completion token counters by node, adapter and key name (all from
    /// configuration), one lookup for the pair.
    token_counters: Mutex<HashMap<TokenKey, TokenCounters>>,
}

/// One model's histogram in its family, looked up on first use.
#[derive(Debug)]
struct ModelHistogram {
    family: Histograms<ModelLabel>,
    handle: OnceLock<Histogram>,
}

impl ModelHistogram {
    fn new(family: &Histograms<ModelLabel>) -> Self {
        ModelHistogram {
            family: family.clone(),
            handle: OnceLock::new(),
        }
    }

    fn observe(&self, model: &Arc<str>, value: Duration) {
        self.handle
            .get_or_init(|| {
                self.family
                    .get_or_create(&ModelLabel {
                        model: model.clone(),
                    })
                    .clone()
            })
            .observe(value.as_secs_f64());
    }
}

/// A node id and one of its adapters' names.
type TokenKey = (Arc<str>, Arc<str>, Arc<str>);

#[derive(Debug)]
struct TokenCounters {
    prompt: Counter,
    completion: Counter,
}

impl ModelMetrics {
    /// A finished HTTP request, in `dialect`.
    pub fn request(&self, status: u16, latency: Duration, dialect: Dialect) {
        let labels = || RequestLabels {
            model: self.model.clone(),
            status,
            dialect: (dialect != Dialect::OpenAi).then(|| dialect.as_str()),
        };
        if status == 200 && dialect == Dialect::OpenAi {
            self.ok
                .get_or_init(|| self.requests.get_or_create(&labels()).clone())
                .inc();
        } else {
            self.requests.get_or_create(&labels()).inc();
        }
        self.latency.observe(&self.model, latency);
    }

    /// Time to the first response byte of a request.
    pub fn first_byte(&self, ttfb: Duration) {
        self.ttfb.observe(&self.model, ttfb);
    }

    /// Time a request waited for a lease.
    pub fn queue_wait(&self, wait: Duration) {
        self.queue_wait.observe(&self.model, wait);
    }

    /// Token usage a provider reported for one request.
    pub fn tokens(
        &self,
        node: &Arc<str>,
        provider: &Arc<str>,
        key: &Arc<str>,
        prompt: u64,
        completion: u64,
    ) {
        let mut counters = self
            .token_counters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let pair = counters
            .entry((node.clone(), provider.clone(), key.clone()))
            .or_insert_with(|| {
                let counter = |kind| {
                    self.tokens
                        .get_or_create(&TokenLabels {
                            model: self.model.clone(),
                            node: node.clone(),
                            provider: provider.clone(),
                            key: key.clone(),
                            kind,
                        })
                        .clone()
                };
                TokenCounters {
                    prompt: counter("prompt"),
                    completion: counter("completion"),
                }
            });
        pair.prompt.inc_by(prompt);
        pair.completion.inc_by(completion);
    }
}

/// Process-wide metrics. Counters are cheap to clone and share one value.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    latency: Histograms<ModelLabel>,
    ttfb: Histograms<ModelLabel>,
    queue_wait: Histograms<ModelLabel>,
    tokens: Family<TokenLabels, Counter>,
    rejected: Family<ReasonLabel, Counter>,
    violations: Family<KindLabel, Counter>,
    reloads: Family<ResultLabel, Counter>,
    /// 1 when the last configuration reload was applied (or none was asked for), 0
    /// when it was refused.
    reload_ok: Gauge,
    /// When the running configuration was loaded, in Unix seconds.
    loaded_at: Gauge,
    fleet: Fleet,
    /// Each public model's series (labels come from configuration or `_unknown`, so
    /// the map is as small as the configured models).
    models: RwLock<HashMap<Arc<str>, Arc<ModelMetrics>>>,
    /// Held while the fleet gauges are refreshed and the registry encoded, so two
    /// scrapes at once do not interleave.
    render: Mutex<()>,
    /// Frames received from nodes.
    pub frames_in: Counter,
    /// Frames sent to nodes.
    pub frames_out: Counter,
    /// Bytes received from nodes.
    pub bytes_in: Counter,
    /// Bytes sent to nodes.
    pub bytes_out: Counter,
    /// Node ready transitions.
    pub node_connects: Counter,
    /// Node generations fenced.
    pub node_disconnects: Counter,
    /// Node ids that became a conflict.
    pub node_conflicts: Counter,
    /// Node connections whose TLS handshake failed or timed out.
    pub tls_handshake_failures: Counter,
    retries: Family<RetryLabels, Counter>,
    ejections: Family<EjectionLabels, Counter>,
    /// Dispatches of requests to providers (first tries, retries, tries beside a slow one).
    pub attempts: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every metric, registered.
    #[must_use]
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "iop_http_requests",
            "Requests answered, by public model and HTTP status",
            requests.clone(),
        );
        let latency: Histograms<ModelLabel> = Family::new_with_constructor(histogram);
        registry.register(
            "iop_http_request_duration_seconds",
            "Request latency, by public model",
            latency.clone(),
        );
        let ttfb: Histograms<ModelLabel> = Family::new_with_constructor(histogram);
        registry.register(
            "iop_http_time_to_first_byte_seconds",
            "Time to the first response byte, by public model",
            ttfb.clone(),
        );
        let tokens = Family::<TokenLabels, Counter>::default();
        registry.register(
            "iop_tokens",
            "Tokens providers reported using, by public model, node, provider and kind (prompt, completion)",
            tokens.clone(),
        );
        let queue_wait: Histograms<ModelLabel> = Family::new_with_constructor(histogram);
        registry.register(
            "iop_queue_wait_seconds",
            "Time requests waited for provider capacity, by public model",
            queue_wait.clone(),
        );
        let rejected = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "iop_node_registrations_refused",
            "Node registrations refused, by reason",
            rejected.clone(),
        );
        let violations = Family::<KindLabel, Counter>::default();
        registry.register(
            "iop_node_violations",
            "Protocol violations by nodes, by kind",
            violations.clone(),
        );
        let reloads = Family::<ResultLabel, Counter>::default();
        registry.register(
            "iop_config_reloads",
            "Configuration reloads (SIGHUP), by result (applied, refused)",
            reloads.clone(),
        );
        let reload_ok = Gauge::default();
        reload_ok.set(1);
        registry.register(
            "iop_config_last_reload_successful",
            "1 when the last configuration reload was applied or none was asked for, 0 when it was refused",
            reload_ok.clone(),
        );
        let loaded_at = Gauge::default();
        loaded_at.set(unix_seconds());
        registry.register(
            "iop_config_last_reload_success_timestamp_seconds",
            "When the running configuration was loaded (start or last applied reload), in Unix seconds",
            loaded_at.clone(),
        );
        let fleet = Fleet::default();
        registry.register(
            "iop_queue_depth",
            "Requests waiting, by public model",
            fleet.queue_depth.clone(),
        );
        registry.register(
            "iop_provider_in_flight",
            "Leases held, by provider",
            fleet.in_flight.clone(),
        );
        registry.register(
            "iop_provider_capacity",
            "Capacity of the live generation, by provider",
            fleet.capacity.clone(),
        );
        registry.register(
            "iop_nodes_ready",
            "Nodes that completed the ready handshake",
            fleet.nodes_ready.clone(),
        );
        registry.register(
            "iop_provider_ejected",
            "1 while a provider is out of the rotation (ejected, or waiting for its probe)",
            fleet.ejected.clone(),
        );
        registry.register(
            "iop_cluster_member",
            "In cluster mode: 1 while this Edge holds its etcd lease and may admit new node instances, else 0",
            fleet.cluster_member.clone(),
        );
        registry.register(
            "iop_cluster_members",
            "In cluster mode: the Edges this one sees in etcd, itself included",
            fleet.cluster_members.clone(),
        );
        registry.register(
            "iop_cluster_detached",
            "In cluster mode: 1 while this Edge serves on its last known state without its etcd lease (etcd unreachable), else 0",
            fleet.cluster_detached.clone(),
        );
        registry.register(
            "iop_affinity_placed",
            "Requests placed by their conversation since the Edge started, by reason: session (its session key), prefix (a remembered prefix past its anchor), anchor (its anchor), balance (every provider of its order over the load bound or full: the least loaded)",
            fleet.affinity_placed.clone(),
        );
        registry.register(
            "iop_affinity_matched_blocks",
            "64-byte prompt blocks the providers of placed requests were remembered to hold, since the Edge started",
            fleet.affinity_matched_blocks.clone(),
        );
        registry.register(
            "iop_affinity_prefix_entries",
            "Prompt fingerprints this Edge remembers (bounded by routing.prefix_entries)",
            fleet.affinity_prefix_entries.clone(),
        );
        registry.register(
            "iop_affinity_prefix_bytes",
            "About the bytes the remembered prompt fingerprints take",
            fleet.affinity_prefix_bytes.clone(),
        );
        registry.register(
            "iop_responses_stored",
            "Responses this Edge keeps for previous_response_id ([responses] store caps)",
            fleet.responses_stored.clone(),
        );
        registry.register(
            "iop_responses_store_bytes",
            "Bytes the stored responses take",
            fleet.responses_store_bytes.clone(),
        );
        registry.register(
            "iop_nodes_draining",
            "Ready nodes taking no new work until their requests end (a graceful stop or a failed config refresh)",
            fleet.nodes_draining.clone(),
        );
        let counter = |registry: &mut Registry, name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        let node_connects = counter(&mut registry, "iop_node_connects", "Node ready transitions");
        let node_disconnects = counter(
            &mut registry,
            "iop_node_disconnects",
            "Node generations fenced",
        );
        let node_conflicts = counter(
            &mut registry,
            "iop_node_conflicts",
            "Node ids that two live connections kept taking from each other",
        );
        let tls_handshake_failures = counter(
            &mut registry,
            "iop_node_tls_handshake_failures",
            "Node connections whose TLS handshake failed or timed out",
        );
        let retries = Family::<RetryLabels, Counter>::default();
        registry.register(
            "iop_request_retries",
            "Requests given another provider before their first byte, by public model and why (error, status_5xx, status_429, status_408, violation, node_lost, first_byte_timeout)",
            retries.clone(),
        );
        let ejections = Family::<EjectionLabels, Counter>::default();
        registry.register(
            "iop_provider_ejections",
            "Providers taken out of the rotation, by node, provider and reason",
            ejections.clone(),
        );
        let attempts = counter(
            &mut registry,
            "iop_upstream_attempts",
            "Dispatches of requests to providers (first tries, retries, tries beside a slow one)",
        );
        let frames = Family::<DirectionLabel, Counter>::default();
        registry.register(
            "iop_node_frames",
            "Frames on node connections",
            frames.clone(),
        );
        let bytes = Family::<DirectionLabel, Counter>::default();
        registry.register("iop_node_bytes", "Bytes on node connections", bytes.clone());
        let direction = |family: &Family<DirectionLabel, Counter>, direction| {
            family.get_or_create(&DirectionLabel { direction }).clone()
        };
        Metrics {
            frames_in: direction(&frames, "in"),
            frames_out: direction(&frames, "out"),
            bytes_in: direction(&bytes, "in"),
            bytes_out: direction(&bytes, "out"),
            registry,
            requests,
            latency,
            ttfb,
            queue_wait,
            tokens,
            rejected,
            violations,
            reloads,
            reload_ok,
            loaded_at,
            fleet,
            models: RwLock::default(),
            render: Mutex::new(()),
            node_connects,
            node_disconnects,
            node_conflicts,
            tls_handshake_failures,
            retries,
            ejections,
            attempts,
        }
    }

    /// A request of `model` given another provider, and why.
    pub fn retry(&self, model: &Arc<str>, reason: &'static str) {
        self.retries
            .get_or_create(&RetryLabels {
                model: model.clone(),
                reason,
            })
            .inc();
    }

    /// A provider taken out of the rotation, and why.
    pub fn ejection(&self, node: &Arc<str>, provider: &Arc<str>, reason: &'static str) {
        self.ejections
            .get_or_create(&EjectionLabels {
                node: node.clone(),
                provider: provider.clone(),
                reason,
            })
            .inc();
    }

    /// The series `model`'s requests record into.
    #[must_use]
    pub fn model(&self, model: &Arc<str>) -> Arc<ModelMetrics> {
        if let Some(found) = self
            .models
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(model)
        {
            return found.clone();
        }
        self.models
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(model.clone())
            .or_insert_with(|| {
                Arc::new(ModelMetrics {
                    model: model.clone(),
                    requests: self.requests.clone(),
                    tokens: self.tokens.clone(),
                    ok: OnceLock::new(),
                    latency: ModelHistogram::new(&self.latency),
                    ttfb: ModelHistogram::new(&self.ttfb),
                    queue_wait: ModelHistogram::new(&self.queue_wait),
                    token_counters: Mutex::default(),
                })
            })
            .clone()
    }

    /// A refused node registration, by reason.
    pub fn rejected(&self, reason: &'static str) {
        self.rejected.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// A protocol violation by a node, by kind.
    pub fn violation(&self, kind: &'static str) {
        self.violations.get_or_create(&KindLabel { kind }).inc();
    }

    /// A configuration reload: applied (the running configuration is now the file's) or
    /// refused (the running one stays).
    pub fn reload(&self, applied: bool) {
        let result = if applied { "applied" } else { "refused" };
        self.reloads.get_or_create(&ResultLabel { result }).inc();
        self.reload_ok.set(i64::from(applied));
        if applied {
            self.loaded_at.set(unix_seconds());
        }
    }

    /// The OpenMetrics text exposition, with the fleet gauges taken from `snapshot`.
    #[must_use]
    pub fn render(&self, snapshot: &Snapshot) -> String {
        let _rendering = self
            .render
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let fleet = &self.fleet;
        // Rebuilt from the snapshot, so a provider or model that is gone disappears.
        fleet.queue_depth.clear();
        for (model, n) in &snapshot.queue_by_model {
            fleet
                .queue_depth
                .get_or_create(&ModelLabel {
                    model: Arc::from(model.as_str()),
                })
                .set(gauge_value(*n as u64));
        }
        fleet.in_flight.clear();
        fleet.capacity.clear();
        fleet.ejected.clear();
        for p in &snapshot.routing {
            let out = p.standing != iop_proto_core::edge::Standing::Live;
            fleet
                .ejected
                .get_or_create(&ProviderLabels {
                    node: p.node_id.to_string(),
                    provider: p.provider_id.to_string(),
                })
                .set(i64::from(out));
        }
        for p in &snapshot.providers {
            let labels = ProviderLabels {
                node: p.node_id.clone(),
                provider: p.provider_id.clone(),
            };
            fleet
                .in_flight
                .get_or_create(&labels)
                .set(gauge_value(u64::from(p.in_flight)));
            fleet
                .capacity
                .get_or_create(&labels)
                .set(gauge_value(u64::from(p.capacity)));
        }
        let ready = snapshot
            .nodes
            .iter()
            .filter(|n| n.state == iop_proto_core::edge::NodeState::Ready)
            .count();
        fleet.nodes_ready.set(gauge_value(ready as u64));
        let draining = snapshot.nodes.iter().filter(|n| n.draining).count();
        fleet.nodes_draining.set(gauge_value(draining as u64));
        for (why, n) in iop_proto_core::edge::Placed::ALL
            .iter()
            .zip(snapshot.affinity.placed)
        {
            fleet
                .affinity_placed
                .get_or_create(&ReasonLabel {
                    reason: why.as_str(),
                })
                .set(gauge_value(n));
        }
        fleet
            .affinity_matched_blocks
            .set(gauge_value(snapshot.affinity.matched_blocks));
        fleet
            .affinity_prefix_entries
            .set(gauge_value(snapshot.affinity.prefix_entries as u64));
        fleet
            .affinity_prefix_bytes
            .set(gauge_value(snapshot.affinity.prefix_bytes as u64));
        let store = &snapshot.responses_store;
        fleet
            .responses_stored
            .set(gauge_value(store.entries as u64));
        fleet
            .responses_store_bytes
            .set(gauge_value(store.bytes as u64));
        if let Some(cluster) = &snapshot.cluster {
            let edge = EdgeLabel {
                edge: cluster.edge_id.clone(),
            };
            fleet
                .cluster_member
                .get_or_create(&edge)
                .set(i64::from(cluster.member));
            fleet
                .cluster_members
                .get_or_create(&edge)
                .set(gauge_value(cluster.members.len() as u64));
            fleet
                .cluster_detached
                .get_or_create(&edge)
                .set(i64::from(cluster.detached_since_unix_ms.is_some()));
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

fn unix_seconds() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| gauge_value(since.as_secs()))
}

fn gauge_value(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_openmetrics_with_our_names() {
        let m = Metrics::new();
        let (model, node, provider) = (Arc::from("mock-chat"), Arc::from("n1"), Arc::from("mock"));
        let (openai, anthropic) = (Dialect::OpenAi, Dialect::Anthropic);
        m.model(&model)
            .request(200, Duration::from_millis(12), openai);
        // Another string with the same name records into the same series.
        let again = m.model(&Arc::from("mock-chat"));
        again.request(200, Duration::from_millis(30), openai);
        again.request(503, Duration::from_millis(1), openai);
        // Another dialect is a label of its own; the latency series is shared.
        again.request(200, Duration::from_millis(2), anthropic);
        let key: Arc<str> = Arc::from("team-a");
        m.model(&model).tokens(&node, &provider, &key, 5, 7);
        again.tokens(&node, &provider, &key, 1, 1);
        again.tokens(&node, &Arc::from("other"), &key, 2, 3);
        m.model(&model).queue_wait(Duration::from_millis(3));
        m.rejected("throttled");
        m.frames_in.inc_by(4);
        let text = m.render(&Snapshot::default());
        for line in [
            "iop_http_requests_total{model=\"mock-chat\",status=\"200\"} 2",
            "iop_http_requests_total{model=\"mock-chat\",status=\"503\"} 1",
            "iop_http_requests_total{model=\"mock-chat\",status=\"200\",dialect=\"anthropic\"} 1",
            "iop_http_request_duration_seconds_bucket{le=\"0.025\",model=\"mock-chat\"} 3",
            "iop_http_request_duration_seconds_count{model=\"mock-chat\"} 4",
            "iop_tokens_total{model=\"mock-chat\",node=\"n1\",provider=\"mock\",key=\"team-a\",kind=\"completion\"} 8",
            "iop_tokens_total{model=\"mock-chat\",node=\"n1\",provider=\"mock\",key=\"team-a\",kind=\"prompt\"} 6",
            "iop_tokens_total{model=\"mock-chat\",node=\"n1\",provider=\"other\",key=\"team-a\",kind=\"prompt\"} 2",
            "iop_queue_wait_seconds_count{model=\"mock-chat\"} 1",
            "iop_node_registrations_refused_total{reason=\"throttled\"} 1",
            "iop_node_frames_total{direction=\"in\"} 4",
            "iop_node_frames_total{direction=\"out\"} 0",
            "iop_nodes_ready 0",
            "iop_nodes_draining 0",
            "# TYPE iop_http_requests counter",
            "# EOF",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        // A series is shown once something was recorded into it, not before.
        assert!(
            !text.contains("iop_http_time_to_first_byte_seconds_count"),
            "{text}"
        );
        let _unused = m.model(&Arc::from("quiet"));
        assert!(!m.render(&Snapshot::default()).contains("quiet"));
    }

    #[test]
    fn reloads_are_counted_and_the_last_result_shown() {
        let m = Metrics::new();
        let value = |text: &str, name: &str| -> i64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        };
        let text = m.render(&Snapshot::default());
        assert_eq!(value(&text, "iop_config_last_reload_successful"), 1);
        let loaded = value(&text, "iop_config_last_reload_success_timestamp_seconds");
        assert!(loaded > 1_700_000_000, "{loaded}");
        assert!(!text.contains("iop_config_reloads_total"), "{text}");

        m.reload(false);
        let text = m.render(&Snapshot::default());
        assert_eq!(value(&text, "iop_config_last_reload_successful"), 0);
        assert_eq!(
            value(&text, "iop_config_reloads_total{result=\"refused\"}"),
            1
        );
        assert_eq!(
            value(&text, "iop_config_last_reload_success_timestamp_seconds"),
            loaded,
            "a refused reload leaves when the running configuration was loaded"
        );

        m.reload(true);
        let text = m.render(&Snapshot::default());
        assert_eq!(value(&text, "iop_config_last_reload_successful"), 1);
        assert_eq!(
            value(&text, "iop_config_reloads_total{result=\"applied\"}"),
            1
        );
        assert!(value(&text, "iop_config_last_reload_success_timestamp_seconds") >= loaded);
    }
}
