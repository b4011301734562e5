//! What the fleet's life looks like to an operator: the [`Lifecycle`] events each
//! [`EdgeEvent`] means (node registered, ready, fenced with its reason, disconnected, in
//! conflict, draining; registrations refused for their credentials; config refresh
//! results; provider health changes), handed out by
//! [`EdgeCore::poll_lifecycle`](super::EdgeCore::poll_lifecycle). The shell only numbers,
//! timestamps and fans them out (`GET /v1/events`); nothing in the machine waits for a
//! subscriber.

use serde::Serialize;

use std::collections::VecDeque;

use super::{EdgeEvent, RejectReason};
use crate::wire::RefreshStatus;

/// A typed fleet lifecycle event. Serialised with a `type` tag (`node.ready`, …) and the
/// fields named here; ids are the configured names, never addresses or tokens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "type")]
pub enum Lifecycle {
    /// A connection registered as the node (it is not ready yet).
    #[serde(rename = "node.registered")]
    NodeRegistered {
        /// The node's configured id.
        node_id: String,
        /// The connection generation it holds.
        generation: u64,
    },
    /// The node completed its ready handshake: its providers take work.
    #[serde(rename = "node.ready")]
    NodeReady {
        /// The node's configured id.
        node_id: String,
        /// The node's generation: which of its connections owned it.
        generation: u64,
    },
    /// The node's generation was fenced: why, and how many requests it was serving.
    #[serde(rename = "node.fenced")]
    NodeFenced {
        /// The node's configured id.
        node_id: String,
        /// The fenced generation.
        generation: u64,
        /// Why, as a stable label (`heartbeat_timeout`, `peer_closed`, `superseded`, …).
        reason: &'static str,
        /// The reason in words.
        detail: String,
        /// Requests that were running on it (each failed with `node_lost`).
        lost: usize,
    },
    /// The node is no longer connected (follows `node.fenced`).
    #[serde(rename = "node.disconnected")]
    NodeDisconnected {
        /// The node's configured id.
        node_id: String,
    },
    /// Two connections keep taking the node id from each other: newcomers are held off.
    #[serde(rename = "node.conflict")]
    NodeConflict {
        /// The node id in conflict.
        node_id: String,
        /// Supersedes seen within the detection window.
        supersedes: u32,
        /// How long newcomers are held off, in milliseconds.
        hold_down_ms: u64,
    },
    /// The node could not take its configuration: no new work, closed once drained.
    #[serde(rename = "node.draining")]
    NodeDraining {
        /// The node's configured id.
        node_id: String,
        /// Why, in words.
        reason: String,
        /// Leases still held on it.
        in_flight: u32,
    },
    /// A node answered a config refresh, or did not in time.
    #[serde(rename = "config.refresh")]
    ConfigRefresh {
        /// The node's configured id.
        node_id: String,
        /// `applied`, `failed`, `restart_required` or `timed_out`.
        result: &'static str,
        /// Revision in force on the node (or pushed, for `timed_out`).
        revision: u64,
        /// The node's message (empty for `timed_out`).
        message: String,
    },
    /// A node registration was refused for its credentials (emitted at the 1st, 2nd,
    /// 4th, 8th… failure of its node id and address, and when answers start to be held
    /// back), so the operator can find the misconfigured machine.
    #[serde(rename = "register.refused")]
    RegisterRefused {
        /// The node id it claimed (at most 64 characters).
        node_id: String,
        /// Whether that id is configured: `true` means a wrong token (or certificate).
        known: bool,
        /// The connection's remote address.
        peer: String,
        /// `bad_token`, `unknown_node` or `identity_mismatch`.
        reason: &'static str,
        /// Failures of the id or of the address (the larger) since they were last quiet.
        failures: u32,
        /// Answers are held back: `node_id` or `source` ran out of failures; absent
        /// within the budgets.
        #[serde(skip_serializing_if = "Option::is_none")]
        throttled: Option<&'static str>,
        /// When it was told to come back, in milliseconds (0: not held back).
        retry_after_ms: u64,
    },
    /// A provider kept failing before its first byte (or asked callers to come back
    /// later): it is out of the rotation for `ejected_ms`, then one request probes it.
    #[serde(rename = "provider.ejected")]
    ProviderEjected {
        /// The node's configured id.
        node_id: String,
        /// The adapter instance.
        provider_id: String,
        /// `consecutive_failures`, `failure_rate` or `retry_after`.
        reason: &'static str,
        /// How long, in milliseconds.
        ejected_ms: u64,
    },
    /// An ejected provider answered its probe: back in the rotation.
    #[serde(rename = "provider.restored")]
    ProviderRestored {
        /// The node's configured id.
        node_id: String,
        /// The adapter instance.
        provider_id: String,
        /// Why it had been ejected.
        reason: &'static str,
    },
    /// A provider's health changed: `healthy` when its node became ready, `offline` when
    /// the node was fenced.
    #[serde(rename = "provider.health")]
    ProviderHealth {
        /// The node's configured id.
        node_id: String,
        /// The adapter instance.
        provider_id: String,
        /// The health `/v1/status` now reports for it.
        health: &'static str,
    },
}

impl Lifecycle {
    /// The `type` tag, for an SSE `event:` line.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Lifecycle::NodeRegistered { .. } => "node.registered",
            Lifecycle::NodeReady { .. } => "node.ready",
            Lifecycle::NodeFenced { .. } => "node.fenced",
            Lifecycle::NodeDisconnected { .. } => "node.disconnected",
            Lifecycle::NodeConflict { .. } => "node.conflict",
            Lifecycle::NodeDraining { .. } => "node.draining",
            Lifecycle::ConfigRefresh { .. } => "config.refresh",
            Lifecycle::RegisterRefused { .. } => "register.refused",
            Lifecycle::ProviderEjected { .. } => "provider.ejected",
            Lifecycle::ProviderRestored { .. } => "provider.restored",
            Lifecycle::ProviderHealth { .. } => "provider.health",
        }
    }
}

fn refresh_word(status: RefreshStatus) -> &'static str {
    match status {
        RefreshStatus::Applied => "applied",
        RefreshStatus::RestartRequired => "restart_required",
        _ => "failed",
    }
}

/// The lifecycle events `event` means by itself, in order (none for request traffic,
/// commands, registrations held off by a conflict or drain, and violations, which have
/// their own logs and metrics). A node that became ready or was fenced also changes its
/// providers' health: the transitions add those events, as they alone see the providers.
pub(super) fn of(event: &EdgeEvent, out: &mut VecDeque<Lifecycle>) {
    match event {
        EdgeEvent::NodeRegistered {
            node_id,
            generation,
        } => out.push_back(Lifecycle::NodeRegistered {
            node_id: node_id.to_string(),
            generation: generation.0,
        }),
        EdgeEvent::NodeConnected {
            node_id,
            generation,
        } => out.push_back(Lifecycle::NodeReady {
            node_id: node_id.to_string(),
            generation: generation.0,
        }),
        EdgeEvent::NodeDisconnected {
            node_id,
            generation,
            reason,
            lost,
        } => {
            out.push_back(Lifecycle::NodeFenced {
                node_id: node_id.to_string(),
                generation: generation.0,
                reason: reason.label(),
                detail: format!("{reason:?}"),
                lost: lost.len(),
            });
            out.push_back(Lifecycle::NodeDisconnected {
                node_id: node_id.to_string(),
            });
        }
        EdgeEvent::NodeConflict {
            node_id,
            supersedes,
            hold_down,
        } => out.push_back(Lifecycle::NodeConflict {
            node_id: node_id.to_string(),
            supersedes: *supersedes,
            hold_down_ms: u64::try_from(hold_down.as_millis()).unwrap_or(u64::MAX),
        }),
        EdgeEvent::NodeDraining {
            node_id,
            reason,
            in_flight,
        } => out.push_back(Lifecycle::NodeDraining {
            node_id: node_id.to_string(),
            reason: reason.to_string(),
            in_flight: *in_flight,
        }),
        EdgeEvent::RefreshAnswered {
            node_id,
            status,
            message,
            revision,
        } => out.push_back(Lifecycle::ConfigRefresh {
            node_id: node_id.to_string(),
            result: refresh_word(*status),
            revision: *revision,
            message: message.clone(),
        }),
        EdgeEvent::RefreshTimedOut {
            node_id, revision, ..
        } => out.push_back(Lifecycle::ConfigRefresh {
            node_id: node_id.to_string(),
            result: "timed_out",
            revision: *revision,
            message: String::new(),
        }),
        EdgeEvent::RegisterRejected {
            addr,
            node_id,
            known,
            reason,
            failures,
            throttled,
            log: true,
            ..
        } if !matches!(reason, RejectReason::Conflict | RejectReason::Draining) => {
            out.push_back(Lifecycle::RegisterRefused {
                node_id: node_id.clone(),
                known: *known,
                peer: addr.map_or_else(|| "unknown".to_owned(), |a| a.to_string()),
                reason: reason.as_str(),
                failures: *failures,
                throttled: throttled.map(|t| t.by.as_str()),
                retry_after_ms: throttled.map_or(0, |t| {
                    u64::try_from(t.retry_after.as_millis()).unwrap_or(u64::MAX)
                }),
            });
        }
        EdgeEvent::ProviderEjected {
            node_id,
            provider_id,
            reason,
            time,
        } => out.push_back(Lifecycle::ProviderEjected {
            node_id: node_id.to_string(),
            provider_id: provider_id.to_string(),
            reason: reason.label(),
            ejected_ms: u64::try_from(time.as_millis()).unwrap_or(u64::MAX),
        }),
        EdgeEvent::ProviderRestored {
            node_id,
            provider_id,
            after,
        } => out.push_back(Lifecycle::ProviderRestored {
            node_id: node_id.to_string(),
            provider_id: provider_id.to_string(),
            reason: after.label(),
        }),
        EdgeEvent::Request { .. }
        | EdgeEvent::ClaimNode { .. }
        | EdgeEvent::ReleaseNode { .. }
        | EdgeEvent::Attempt { .. }
        | EdgeEvent::Retried { .. }
        | EdgeEvent::Resumed { .. }
        | EdgeEvent::CommandAnswered { .. }
        | EdgeEvent::RegisterRejected { .. }
        | EdgeEvent::ConnectionRefused { .. }
        | EdgeEvent::PeerViolation { .. } => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_the_serialised_type_tag() {
        let text = || String::from("x");
        let all = [
            Lifecycle::NodeRegistered {
                node_id: text(),
                generation: 1,
            },
            Lifecycle::NodeReady {
                node_id: text(),
                generation: 1,
            },
            Lifecycle::NodeFenced {
                node_id: text(),
                generation: 1,
                reason: "peer_closed",
                detail: text(),
                lost: 0,
            },
            Lifecycle::NodeDisconnected { node_id: text() },
            Lifecycle::NodeConflict {
                node_id: text(),
                supersedes: 3,
                hold_down_ms: 1,
            },
            Lifecycle::NodeDraining {
                node_id: text(),
                reason: text(),
                in_flight: 0,
            },
            Lifecycle::ConfigRefresh {
                node_id: text(),
                result: "applied",
                revision: 1,
                message: text(),
            },
            Lifecycle::ProviderHealth {
                node_id: text(),
                provider_id: text(),
                health: "healthy",
            },
            Lifecycle::ProviderEjected {
                node_id: text(),
                provider_id: text(),
                reason: "consecutive_failures",
                ejected_ms: 5000,
            },
            Lifecycle::ProviderRestored {
                node_id: text(),
                provider_id: text(),
                reason: "consecutive_failures",
            },
            Lifecycle::RegisterRefused {
                node_id: text(),
                known: true,
                peer: text(),
                reason: "bad_token",
                failures: 1,
                throttled: None,
                retry_after_ms: 0,
            },
        ];
        for event in all {
            let json = serde_json::to_value(&event).expect("serialisable");
            assert_eq!(json["type"], event.kind(), "{event:?}");
        }
    }
}
