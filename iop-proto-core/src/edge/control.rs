//! Control traffic with ready nodes: query commands and config refreshes, and draining
//! a node that cannot take its configuration.

use super::*;

/// Outstanding commands and the sequence of control requests.
#[derive(Debug)]
pub(super) struct Control {
    /// Commands awaiting an answer: sequence → (node, generation, request id).
    pub(super) commands: std::collections::BTreeMap<u64, (usize, Generation, String)>,
    pub(super) next_refresh: u64,
}

impl Default for Control {
    fn default() -> Self {
        Control {
            commands: std::collections::BTreeMap::new(),
            next_refresh: 1,
        }
    }
}

impl EdgeCore {
    pub(super) fn fail_command(&mut self, seq: u64, why: &str) {
        self.timers.stop(TimerKey::Command(seq));
        if let Some((i, _, request_id)) = self.control.commands.remove(&seq) {
            self.out.events.push_back(EdgeEvent::CommandAnswered {
                node_id: self.registry.nodes[i].id.clone(),
                response: NodeCommandResponse {
                    request_id,
                    ok: false,
                    error: why.to_owned(),
                    payload: bytes::Bytes::new(),
                },
            });
        }
    }

    /// The node and generation `conn` owns, if it is that node's current, ready owner.
    pub(super) fn ready_owner(&self, conn: ConnId, phase: Phase) -> Option<(usize, Generation)> {
        let Phase::Owner { node, generation } = phase else {
            return None;
        };
        self.registry.nodes[node]
            .owner
            .is_some_and(|o| o.conn == conn && o.ready)
            .then_some((node, generation))
    }

    pub(super) fn on_command_response(
        &mut self,
        conn: ConnId,
        phase: Phase,
        response: NodeCommandResponse,
    ) {
        let Some((i, generation)) = self.ready_owner(conn, phase) else {
            return;
        };
        let Some(seq) = response
            .request_id
            .strip_prefix("cmd-")
            .and_then(|n| n.parse::<u64>().ok())
        else {
            return;
        };
        if self
            .control
            .commands
            .get(&seq)
            .is_some_and(|(node, g, _)| *node == i && *g == generation)
        {
            self.control.commands.remove(&seq);
            self.timers.stop(TimerKey::Command(seq));
            self.out.events.push_back(EdgeEvent::CommandAnswered {
                node_id: self.registry.nodes[i].id.clone(),
                response,
            });
        }
    }

    pub(super) fn push_refresh(&mut self, i: usize) {
        let Some(owner) = self.registry.nodes[i].owner else {
            return;
        };
        let Some(spec) = &self.registry.nodes[i].spec else {
            return;
        };
        let revision = self.registry.nodes[i].revision;
        let seq = self.control.next_refresh;
        self.control.next_refresh += 1;
        let payload = spec.payload(revision);
        self.registry.nodes[i].refresh = Some((seq, revision));
        self.send(
            owner.conn,
            Body::NodeConfigRefreshRequest(NodeConfigRefreshRequest {
                request_id: format!("refresh-{seq}"),
                config: Some(payload),
            }),
        );
        self.timers.set(
            TimerKey::Refresh(i),
            self.now + self.config.timing.refresh_timeout,
        );
    }

    pub(super) fn on_refresh_response(
        &mut self,
        conn: ConnId,
        phase: Phase,
        resp: NodeConfigRefreshResponse,
    ) {
        let Some((i, generation)) = self.ready_owner(conn, phase) else {
            return;
        };
        let Some((seq, revision)) = self.registry.nodes[i].refresh else {
            return;
        };
        if resp.request_id != format!("refresh-{seq}") {
            return;
        }
        self.registry.nodes[i].refresh = None;
        self.timers.stop(TimerKey::Refresh(i));
        // An unknown status (a newer node) is not an applied configuration.
        let (status, message) = match RefreshStatus::try_from(resp.status) {
            Ok(status) if status != RefreshStatus::Unspecified => (status, resp.message),
            _ => (
                RefreshStatus::Failed,
                format!("unknown refresh status {}: {}", resp.status, resp.message),
            ),
        };
        self.registry.nodes[i].last_refresh = Some(status);
        self.out.events.push_back(EdgeEvent::RefreshAnswered {
            node_id: self.registry.nodes[i].id.clone(),
            status,
            message: message.clone(),
            revision: resp.revision,
        });
        if status != RefreshStatus::Applied {
            self.drain_node(i, RefreshFailure::Answered { status, message }.into());
            return;
        }
        self.registry.nodes[i].refresh_tries = 0;
        self.registry.nodes[i].applied_revision = revision;
        self.sync_resources(i, generation);
        // The configuration may have moved on while this refresh was in flight.
        if self.registry.nodes[i].revision != revision {
            self.push_refresh(i);
        }
    }

    /// A node stops gracefully: only its ready owner may ask (the connection work is
    /// dispatched to); from any other registered connection it is a violation.
    pub(super) fn on_drain_request(&mut self, conn: ConnId, phase: Phase, req: NodeDrainRequest) {
        let Some((i, _)) = self.ready_owner(conn, phase) else {
            self.violation(conn, ConnViolation::DrainBeforeReady);
            return;
        };
        self.drain_node(i, DrainReason::Stopping(req.reason));
    }

    /// Node `i` gets no new work, and its connection closes once its last lease returns:
    /// it cannot take its configuration (it then registers again and receives the
    /// configuration in its `RegisterResponse`, or fails to become ready, visibly), or it
    /// is stopping gracefully (the close tells it that nothing more will come). A node
    /// already draining keeps its first reason.
    pub(super) fn drain_node(&mut self, i: usize, reason: DrainReason) {
        let Some(owner) = self.registry.nodes[i].owner else {
            return;
        };
        if self.registry.nodes[i].draining.is_some() {
            return;
        }
        self.registry.nodes[i].draining = Some(reason.clone());
        // (A planted bug for the simulation: the node drains but keeps its capacity.)
        #[cfg(feature = "testkit")]
        let planted = self.faults.ignore_drain && matches!(reason, DrainReason::Stopping(_));
        #[cfg(not(feature = "testkit"))]
        let planted = false;
        if !planted {
            for (_, r) in self.registry.nodes[i].resources.clone() {
                if self.pool.ledger.usage(r).generation == Some(owner.generation) {
                    self.pool.ledger.set_capacity(r, 0, 0);
                }
            }
        }
        self.out.events.push_back(EdgeEvent::NodeDraining {
            node_id: self.registry.nodes[i].id.clone(),
            reason,
            in_flight: self.in_flight_on(i),
        });
        self.close_if_drained(i);
    }

    /// Leases held on node `i`'s current generation.
    pub(super) fn in_flight_on(&self, i: usize) -> u32 {
        let Some(owner) = self.registry.nodes[i].owner else {
            return 0;
        };
        self.registry.nodes[i]
            .resources
            .iter()
            .map(|(_, r)| self.pool.ledger.usage(*r))
            .filter(|u| u.generation == Some(owner.generation))
            .map(|u| u.in_flight)
            .sum()
    }

    pub(super) fn close_if_drained(&mut self, i: usize) {
        let Some(drain) = self.registry.nodes[i].draining.clone() else {
            return;
        };
        if self.in_flight_on(i) > 0 {
            return;
        }
        if let Some(owner) = self.registry.nodes[i].owner {
            let reason = match drain {
                DrainReason::Refresh(failure) => CloseReason::RefreshFailed(failure),
                DrainReason::Stopping(_) => CloseReason::Drained,
            };
            self.close(owner.conn, reason.clone());
            self.fence_owner(i, owner.generation, reason);
        }
    }
}
