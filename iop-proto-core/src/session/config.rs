//! Adapter configuration: what changes between two payloads, the capacity gates that
//! follow it, and config refreshes from the Edge.

use crate::wire::Validate;

use super::NodeSession;
use super::SessionEvent;
use crate::gate::CapacityGate;
use crate::wire::AdapterConfig;
use crate::wire::AdapterType;
use crate::wire::Body;
use crate::wire::NodeConfigPayload;
use crate::wire::NodeConfigRefreshRequest;
use crate::wire::NodeConfigRefreshResponse;
use crate::wire::RefreshStatus;
use std::collections::BTreeMap;

/// Per-adapter change between two payloads. Only enabled adapters count as active.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdapterDiff {
    /// Newly active adapters.
    pub added: Vec<String>,
    /// Adapters no longer active (removed or disabled).
    pub removed: Vec<String>,
    /// Active in both, configuration changed (applies live).
    pub changed: Vec<String>,
    /// Changes that cannot apply live, each explained.
    pub restart_required: Vec<String>,
}

impl AdapterDiff {
    /// True when nothing changes.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.added.is_empty()
            && self.removed.is_empty()
            && self.changed.is_empty()
            && self.restart_required.is_empty()
    }
}

/// Compares two payloads adapter by adapter. Changing the type of a named instance cannot
/// apply live (work of the old kind may be in flight on it): it requires a restart.
#[must_use]
pub fn diff_adapters(old: &NodeConfigPayload, new: &NodeConfigPayload) -> AdapterDiff {
    let active = |p: &NodeConfigPayload| -> BTreeMap<String, AdapterConfig> {
        p.adapters
            .iter()
            .filter(|a| a.enabled)
            .map(|a| (a.instance_name().to_owned(), a.clone()))
            .collect()
    };
    let (old_set, new_set) = (active(old), active(new));
    let mut diff = AdapterDiff::default();
    for (name, adapter) in &new_set {
        match old_set.get(name) {
            None => diff.added.push(name.clone()),
            Some(before) if before.r#type != adapter.r#type => {
                let kind =
                    |t: i32| AdapterType::try_from(t).map_or("unknown", AdapterType::config_name);
                diff.restart_required.push(format!(
                    "adapter {name:?} changes type from {} to {}",
                    kind(before.r#type),
                    kind(adapter.r#type)
                ));
            }
            Some(before) if before != adapter => diff.changed.push(name.clone()),
            Some(_) => {}
        }
    }
    diff.removed = old_set
        .keys()
        .filter(|name| !new_set.contains_key(*name))
        .cloned()
        .collect();
    diff
}

impl NodeSession {
    pub(super) fn applied_revision(&self) -> u64 {
        self.applied.as_ref().map_or(0, |p| p.revision)
    }

    /// Creates, resizes or closes gates after a config takes effect.
    pub(super) fn install_gates(&mut self, payload: &NodeConfigPayload, diff: &AdapterDiff) {
        for adapter in payload.adapters.iter().filter(|a| a.enabled) {
            let name = adapter.instance_name();
            if diff.added.iter().any(|n| n == name) || diff.changed.iter().any(|n| n == name) {
                match self.gates.get_mut(name) {
                    Some(gate) => gate.resize(adapter.capacity, adapter.long_capacity),
                    None => {
                        self.gates.insert(
                            name.into(),
                            CapacityGate::new(adapter.capacity, adapter.long_capacity),
                        );
                    }
                }
            }
        }
        for name in &diff.removed {
            if let Some(gate) = self.gates.get_mut(name.as_str()) {
                gate.close();
            }
        }
    }

    pub(super) fn on_refresh(&mut self, request: NodeConfigRefreshRequest) {
        let revision = self.applied_revision();
        let respond = |status: RefreshStatus, message: String| {
            Body::NodeConfigRefreshResponse(NodeConfigRefreshResponse {
                request_id: request.request_id.clone(),
                status: status as i32,
                message,
                revision,
            })
        };
        if let Err(err) = request.validate() {
            let body = respond(
                RefreshStatus::Failed,
                format!("invalid config: {err}; the previous config stays in force"),
            );
            self.send(body);
            return;
        }
        if self.pending_refresh.is_some() {
            let body = respond(
                RefreshStatus::Failed,
                "another refresh is being applied".into(),
            );
            self.send(body);
            return;
        }
        let payload = request.config.clone().unwrap_or_default();
        let diff = diff_adapters(
            self.applied
                .as_ref()
                .unwrap_or(&NodeConfigPayload::default()),
            &payload,
        );
        if !diff.restart_required.is_empty() {
            let body = respond(
                RefreshStatus::RestartRequired,
                format!(
                    "{}; the previous config stays in force until the node restarts",
                    diff.restart_required.join("; ")
                ),
            );
            self.send(body);
            return;
        }
        self.pending_refresh = Some((request.request_id.clone(), payload.clone()));
        self.events.push_back(SessionEvent::RefreshConfig {
            request_id: request.request_id,
            payload,
            diff,
        });
    }
}
