//! The Edge's timers and what each does when it fires.

use super::*;

/// One timer of the Edge, keyed by what it is about; at most one per key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum TimerKey {
    /// A connection must register, then report ready, before this.
    Handshake(ConnId),
    /// A connection that sends nothing until this is lost (re-armed lazily from its
    /// last receive, so a busy connection costs no timer work per frame).
    Liveness(ConnId),
    /// Ping a registered connection.
    Ping(ConnId),
    /// A node's config refresh must be answered by this.
    Refresh(usize),
    /// A cancelled run keeps its lease at most until this.
    CancelGrace(RequestId),
    /// A node command must be answered by this.
    Command(u64),
    /// A held refusal of a failed register is sent then (see `Phase::Held`).
    Answer(ConnId),
}

impl crate::timer::TimerKey for TimerKey {
    fn reason(&self) -> &'static str {
        match self {
            TimerKey::Handshake(_) => "handshake",
            TimerKey::Liveness(_) => "liveness",
            TimerKey::Ping(_) => "ping",
            TimerKey::Refresh(_) => "refresh answer",
            TimerKey::CancelGrace(_) => "cancel grace",
            TimerKey::Command(_) => "command answer",
            TimerKey::Answer(_) => "held register answer",
        }
    }
}

impl EdgeCore {
    pub(super) fn fire(&mut self, key: TimerKey) {
        let timing = self.config.timing;
        match key {
            TimerKey::Handshake(conn) => {
                let Some(c) = self.registry.conns.get(&conn) else {
                    return;
                };
                let pending = match c.phase {
                    Phase::Unregistered => true,
                    Phase::Owner { node, .. } => self.registry.nodes[node]
                        .owner
                        .is_some_and(|o| o.conn == conn && !o.ready),
                    Phase::Stale | Phase::Held => false,
                };
                if pending {
                    let phase = c.phase;
                    self.close(conn, CloseReason::HandshakeTimeout);
                    if let Phase::Owner { node, generation } = phase {
                        self.fence_owner(node, generation, CloseReason::HandshakeTimeout);
                    }
                }
            }
            TimerKey::Liveness(conn) => {
                let Some(c) = self.registry.conns.get(&conn) else {
                    return;
                };
                let deadline = c.last_rx + timing.heartbeat_timeout;
                if deadline > self.now {
                    self.timers.set(TimerKey::Liveness(conn), deadline);
                    return;
                }
                let phase = c.phase;
                self.close(conn, CloseReason::HeartbeatTimeout);
                if let Phase::Owner { node, generation } = phase {
                    self.fence_owner(node, generation, CloseReason::HeartbeatTimeout);
                }
            }
            TimerKey::Ping(conn) => {
                if self.owner_of(conn).is_none() {
                    return;
                }
                let nonce = self.registry.next_nonce;
                self.registry.next_nonce += 1;
                if let Some(c) = self.registry.conns.get_mut(&conn) {
                    c.ping = Some((nonce, self.now));
                }
                self.send(
                    conn,
                    Body::Heartbeat(Heartbeat {
                        nonce,
                        sent_at_ms: self.now.as_millis(),
                    }),
                );
                self.timers
                    .set(TimerKey::Ping(conn), self.now + timing.heartbeat_interval);
            }
            TimerKey::Refresh(i) => {
                if let Some((_, revision)) = self.registry.nodes[i].refresh {
                    self.registry.nodes[i].refresh = None;
                    self.registry.nodes[i].refresh_tries += 1;
                    let retrying = self.registry.nodes[i].refresh_tries < MAX_REFRESH_TRIES;
                    self.out.events.push_back(EdgeEvent::RefreshTimedOut {
                        node_id: self.registry.nodes[i].id.clone(),
                        revision,
                        retrying,
                    });
                    if retrying {
                        self.push_refresh(i);
                    } else {
                        self.drain_node(i, RefreshFailure::Unanswered(MAX_REFRESH_TRIES).into());
                    }
                }
            }
            TimerKey::Command(seq) => self.fail_command(seq, "the node did not answer in time"),
            TimerKey::Answer(conn) => self.answer_held(conn),
            TimerKey::CancelGrace(request) => {
                if let Some(ReqState::Cancelling { lease, .. }) = self.requests.get(&request) {
                    let lease = *lease;
                    self.requests.remove(&request);
                    self.release(lease);
                }
            }
        }
    }
}
