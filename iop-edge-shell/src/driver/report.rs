//! What the driver makes of each event the core hands out that is not a request's: logs
//! with their fields, metrics, the operator's event stream, command answers and the
//! cluster's claims.

use super::Task;
use iop_proto_core::edge::DrainReason;
use iop_proto_core::{CloseReason, EdgeEvent, Outcome, RequestEvent};
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

impl Task {
    pub(super) fn on_event(&mut self, event: EdgeEvent) {
        match event {
            EdgeEvent::ClaimNode {
                conn,
                node_id,
                instance,
            } => {
                let input = crate::membership::Input::Claim {
                    conn,
                    node_id,
                    instance,
                };
                let sent = self
                    .cluster
                    .as_ref()
                    .is_some_and(|tx| tx.send(input).is_ok());
                if !sent {
                    // The cluster task is gone: nothing can vouch for the node id.
                    let now = self.clock.now();
                    self.core.handle_claim(
                        now,
                        conn,
                        iop_proto_core::cluster::ClaimDecision::Unavailable,
                    );
                }
            }
            EdgeEvent::ReleaseNode { node_id, instance } => {
                if let Some(tx) = &self.cluster {
                    let _ = tx.send(crate::membership::Input::Release { node_id, instance });
                }
            }
            EdgeEvent::NodeRegistered {
                node_id,
                generation,
            } => {
                debug!(node_id = %node_id, generation = generation.0, "node registered");
            }
            EdgeEvent::Request {
                request,
                event: RequestEvent::Ended(outcome),
            } => {
                if let Some(entry) = self.requests.remove(&request) {
                    if !matches!(outcome, Outcome::Completed) {
                        debug!(request = %request, model = &*entry.model, outcome = ?outcome, "request ended");
                    }
                    let _ = entry
                        .events
                        .queue(RequestEvent::Ended(outcome), &mut self.wakes);
                }
            }
            EdgeEvent::Request { request, event } => self.forward(request, event),
            EdgeEvent::Attempt {
                run,
                node_id,
                provider_id,
                shape,
            } => {
                self.metrics.attempts.inc();
                if run.attempt == 0
                    && let Some(entry) = self.requests.get(&run.request)
                {
                    let now = Instant::now();
                    entry.events.attached().dispatched_at(now);
                    self.metrics
                        .model(&entry.model)
                        .queue_wait(now.saturating_duration_since(entry.submitted));
                }
                debug!(run = %run, node_id = %node_id, provider_id = %provider_id, shape = ?shape, "dispatched");
            }
            EdgeEvent::Retried {
                request,
                run,
                node_id,
                provider_id,
                why,
            } => {
                if let Some(entry) = self.requests.get(&request) {
                    self.metrics.retry(&entry.model, why);
                }
                info!(request = %request, run = %run, node_id = %node_id, provider_id = %provider_id, why, "provider failed before the first byte: trying another");
            }
            EdgeEvent::Resumed {
                request,
                run,
                node_id,
                provider_id,
                why,
                delivered,
            } => {
                if let Some(entry) = self.requests.get(&request) {
                    let label = match why {
                        "node_lost" => "resume_node_lost",
                        "stall" => "resume_stall",
                        _ => "resume_error",
                    };
                    self.metrics.retry(&entry.model, label);
                }
                warn!(request = %request, run = %run, node_id = %node_id, provider_id = %provider_id, why, delivered_bytes = delivered, "answer lost midway: continuing it on another provider from what the caller has");
            }
            EdgeEvent::ProviderEjected {
                node_id,
                provider_id,
                reason,
                time,
            } => {
                self.metrics
                    .ejection(&node_id, &provider_id, reason.label());
                warn!(node_id = %node_id, provider_id = %provider_id, reason = reason.label(), ejected_ms = time.as_millis() as u64, "provider ejected: no requests until its probe");
            }
            EdgeEvent::ProviderRestored {
                node_id,
                provider_id,
                after,
            } => {
                info!(node_id = %node_id, provider_id = %provider_id, after = after.label(), "provider restored: its probe answered");
            }
            EdgeEvent::NodeConnected {
                node_id,
                generation,
            } => {
                self.metrics.node_connects.inc();
                info!(node_id = %node_id, generation = generation.0, "node ready");
            }
            EdgeEvent::NodeDisconnected {
                node_id,
                generation,
                reason,
                lost,
            } => {
                self.metrics.node_disconnects.inc();
                if reason == CloseReason::Drained {
                    info!(node_id = %node_id, generation = generation.0, reason = ?reason, "node drained and gone");
                } else {
                    warn!(node_id = %node_id, generation = generation.0, reason = ?reason, lost = lost.len(), "node fenced");
                }
            }
            EdgeEvent::RefreshAnswered {
                node_id,
                status,
                message,
                revision,
            } => {
                info!(node_id = %node_id, status = ?status, message, revision, "config refresh answered")
            }
            EdgeEvent::RefreshTimedOut {
                node_id,
                revision,
                retrying,
            } => {
                warn!(node_id = %node_id, revision, retrying, "config refresh not answered in time");
            }
            EdgeEvent::NodeDraining {
                node_id,
                reason,
                in_flight,
            } => match reason {
                DrainReason::Stopping(why) => info!(
                    node_id = %node_id,
                    reason = why,
                    in_flight,
                    "node stopping gracefully: no new work; its connection closes once its \
                     work is done"
                ),
                DrainReason::HandingOver { told } => info!(
                    node_id = %node_id,
                    told_to_rehome = told,
                    in_flight,
                    "handing over: no new work for this node here; its connection closes once \
                     its work is done"
                ),
                DrainReason::Cluster(why) => warn!(
                    node_id = %node_id,
                    reason = why,
                    in_flight,
                    "cluster: this edge can no longer vouch for the node (its lease in etcd \
                     was lost): no new work here; its connection closes once its work is \
                     done, and it serves through the other edges"
                ),
                reason => error!(
                    node_id = %node_id,
                    %reason,
                    in_flight,
                    "node cannot take its configuration: no new work; it is closed to register \
                     again once its work is done"
                ),
            },
            EdgeEvent::CommandAnswered { response, .. } => {
                if let Some(reply) = self.commands.remove(&response.request_id) {
                    let _ = reply.send(Ok(response));
                }
            }
            EdgeEvent::RegisterRejected {
                conn,
                addr,
                node_id,
                known,
                reason,
                failures,
                throttled,
                log,
            } => {
                self.metrics.rejected(if throttled.is_some() {
                    "throttled"
                } else {
                    reason.as_str()
                });
                if log {
                    let peer = addr.map_or_else(|| "-".to_owned(), |a| a.to_string());
                    if reason == iop_proto_core::edge::RejectReason::Conflict {
                        warn!(
                            conn = conn.0,
                            peer, node_id, "registration held off: the node id is in conflict"
                        );
                    } else if reason == iop_proto_core::edge::RejectReason::Draining {
                        info!(
                            conn = conn.0,
                            peer,
                            node_id,
                            "registration held off until the node id's draining connection has gone"
                        );
                    } else {
                        warn!(
                            conn = conn.0,
                            %peer,
                            node_id,
                            known,
                            reason = reason.as_str(),
                            failures,
                            throttled_by = throttled.map(|t| t.by.as_str()),
                            hold_ms = throttled.map(|t| t.hold.as_millis() as u64),
                            "node registration refused (logged at 1, 2, 4, 8... failures of \
                             a node id and address)"
                        );
                    }
                }
            }
            EdgeEvent::ConnectionRefused {
                conn,
                addr,
                pending,
                refused,
                log,
            } => {
                self.metrics.rejected("too_many_pending");
                if log {
                    let peer = addr.map_or_else(|| "-".to_owned(), |a| a.to_string());
                    warn!(
                        conn = conn.0,
                        %peer,
                        pending,
                        refused,
                        "node connection refused: too many connections have not registered yet \
                         (logged at 1, 2, 4, 8... refusals)"
                    );
                }
            }
            EdgeEvent::NodeConflict {
                node_id,
                supersedes,
                hold_down,
            } => {
                self.metrics.node_conflicts.inc();
                error!(
                    node_id = %node_id,
                    supersedes,
                    hold_down_sec = hold_down.as_secs(),
                    "node id conflict: two live connections keep taking this node id from each \
                     other (two nodes configured with the same id?); the current one keeps it, \
                     newcomers are refused until they stop"
                );
            }
            EdgeEvent::PeerViolation {
                conn,
                node_id,
                violation,
            } => {
                self.metrics.violation(violation.label());
                warn!(
                    conn = conn.0,
                    node_id = node_id.as_deref().unwrap_or("-"),
                    kind = violation.label(),
                    %violation,
                    "node broke the protocol"
                );
            }
        }
    }
}
