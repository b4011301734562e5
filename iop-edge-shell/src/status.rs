//! What a status answer shows of the Edge: the core's view of its nodes, providers and
//! queues, and the cluster's, taken together for `/v1/status`, `/metrics` and the
//! dashboard.

use iop_proto_core::edge::{NodeStatus, ProviderRouting, RegistrationFailures};
use iop_proto_core::wire::ProviderSnapshot;

/// Status for `/v1/status` and `/metrics`.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Configured nodes.
    pub nodes: Vec<NodeStatus>,
    /// Configured providers.
    pub providers: Vec<ProviderSnapshot>,
    /// Waiting requests per model.
    pub queue_by_model: Vec<(String, usize)>,
    /// Requests accepted and not finished.
    pub open_requests: usize,
    /// Node ids and addresses whose registrations failed recently.
    pub registration_failures: RegistrationFailures,
    /// Providers as routing sees them (ejections, recent failures, latency).
    pub routing: Vec<ProviderRouting>,
    /// In cluster mode: membership and members (filled in by the HTTP layer).
    pub cluster: Option<crate::membership::ViewSnapshot>,
    /// The stored responses (filled in by the HTTP layer).
    pub responses_store: iop_api::responses::StoreFigures,
    /// How requests were placed by their conversation, and the prefix index's size.
    pub affinity: iop_proto_core::edge::AffinityFigures,
    /// The placement settings in force.
    pub affinity_config: iop_proto_core::edge::Affinity,
}
