//! The node side of the fleet skeleton: routing a node's sessions' outputs, sharing
//! what they hold, their events, their end, and dialling.

use super::{Fleet, Link, Session, Shape};
use crate::harness::{Job, Wire, within_capacity};
use iop_proto_core::edge::{ConnId, Peer};
use iop_proto_core::reconnect::{Failure, SupervisorEvent};
use iop_proto_core::session::{
    NodeSession, NodeTransmit, SessionConfig, SessionEnd, SessionEvent, sum_loads,
};
use iop_proto_core::wire::AdapterLoad;
use std::collections::BTreeMap;
use std::time::Duration;

impl Fleet {
    /// Session `s` of node `n` takes in what the node's other sessions hold
    /// (multi-homed).
    pub(super) fn take_in(&mut self, n: usize, s: usize) {
        if let Shape::Multihome {
            blind_sessions: false,
            ..
        } = self.setup.shape
        {
            let now = self.now;
            let node = &mut self.nodes[n];
            let held = node.board.held_for(node.sessions[s].key);
            let _ = node.sessions[s].session.handle_held_elsewhere(now, held);
        }
    }

    /// Routes node `n`'s sessions' outputs, then shares what they hold: an upgrade's
    /// current session learns what the re-homed ones hold; a multi-homed node publishes
    /// what each session holds, and the others take it in when it moved. An upgrade's
    /// supervisor dials when it says so.
    pub(super) fn drain_node(&mut self, n: usize) -> Result<(), String> {
        loop {
            let mut s = 0;
            while s < self.nodes[n].sessions.len() {
                let link = self.nodes[n].sessions[s].link;
                let mut closed = false;
                while let Some(t) = self.nodes[n].sessions[s].session.poll_transmit() {
                    match t {
                        NodeTransmit::Frame(envelope) => {
                            let at = self.now + self.latency();
                            self.links[link].to_edge.send(&envelope, at);
                        }
                        NodeTransmit::Close { .. } => closed = true,
                    }
                }
                let mut events = Vec::new();
                while let Some(event) = self.nodes[n].sessions[s].session.poll_event() {
                    events.push(event);
                }
                for event in events {
                    self.on_session_event(n, s, event)?;
                }
                if closed {
                    self.session_over(n, s);
                    continue;
                }
                s += 1;
            }
            if let Shape::Upgrade { .. } = self.setup.shape {
                self.report_held(n);
                let mut dials = 0;
                if let Some(supervisor) = self.nodes[n].supervisor.as_mut() {
                    while let Some(event) = supervisor.poll_event() {
                        if let SupervisorEvent::Dial { .. } = event {
                            dials += 1;
                        }
                    }
                }
                for _ in 0..dials {
                    self.dial_listening(n);
                }
                return Ok(());
            }
            let mut moved = false;
            let node = &mut self.nodes[n];
            for session in &mut node.sessions {
                let changes = session.session.load_changes();
                if changes != session.published {
                    session.published = changes;
                    node.board.publish(session.key, session.session.load());
                    moved = true;
                }
            }
            if !moved {
                return Ok(());
            }
            for s in 0..self.nodes[n].sessions.len() {
                self.take_in(n, s);
            }
        }
    }

    pub(super) fn on_session_event(
        &mut self,
        n: usize,
        s: usize,
        event: SessionEvent,
    ) -> Result<(), String> {
        let now = self.now;
        let upgrade = matches!(self.setup.shape, Shape::Upgrade { .. });
        match event {
            SessionEvent::ApplyConfig { .. } => {
                let _ = self.nodes[n].sessions[s]
                    .session
                    .handle_config_applied(now, Ok(()));
            }
            SessionEvent::Ready => {
                if let Some(supervisor) = self.nodes[n].supervisor.as_mut() {
                    let _ = supervisor.handle_ready(now);
                }
            }
            SessionEvent::StartRun { request } => {
                if self.nodes[n]
                    .sessions
                    .iter()
                    .enumerate()
                    .any(|(i, other)| i != s && !other.jobs.is_empty())
                {
                    self.counts.shared += 1;
                }
                let delay = self.rng.range(5, 250);
                self.nodes[n].sessions[s].jobs.insert(
                    request.run_id,
                    Job::new(request.long_context, now + Duration::from_millis(delay)),
                );
                self.check_capacity(n)?;
            }
            SessionEvent::CancelRun { run_id } => {
                if let Some(job) = self.nodes[n].sessions[s].jobs.get_mut(&run_id) {
                    job.cancel(now);
                }
            }
            SessionEvent::Rehome { .. } => {
                let node = &mut self.nodes[n];
                node.sessions[s].rehomed = true;
                self.counts.rehomed += 1;
                let id = node.id.clone();
                if let Some(supervisor) = node.supervisor.as_mut() {
                    let _ = supervisor.handle_rehome(now);
                }
                self.log(|| format!("{id} re-homes"));
            }
            // One Edge at a time: the Edge never oversubscribed what the node reported.
            SessionEvent::WorkRefused { run_id, reason } if upgrade => {
                return Err(format!(
                    "{} refused {run_id}: {reason} (the edge oversubscribed it)",
                    self.nodes[n].id
                ));
            }
            // Several Edges race for a slot: one of them is refused.
            SessionEvent::WorkRefused { run_id, reason } => {
                self.counts.refused += 1;
                let id = self.nodes[n].id.clone();
                self.log(|| format!("{id} refused {run_id}: {reason}"));
            }
            SessionEvent::StartTunnel { .. }
            | SessionEvent::Members(_)
            | SessionEvent::Command { .. }
            | SessionEvent::RefreshConfig { .. }
            | SessionEvent::CancelRejected { .. }
            | SessionEvent::PeerViolation { .. } => {}
        }
        Ok(())
    }

    /// A node's work across its sessions stays within its adapter's capacity.
    pub(super) fn check_capacity(&self, n: usize) -> Result<(), String> {
        let node = &self.nodes[n];
        let jobs = node.sessions.iter().flat_map(|s| s.jobs.values());
        within_capacity(
            &node.id,
            jobs,
            self.setup.capacity,
            self.setup.long_capacity,
        )
    }

    /// The current session learns what the re-homed ones hold, as the node shell does
    /// (upgrade).
    pub(super) fn report_held(&mut self, n: usize) {
        if let Shape::Upgrade {
            hide_held_elsewhere: true,
            ..
        } = self.setup.shape
        {
            return;
        }
        let node = &mut self.nodes[n];
        let Some(current) = node.sessions.iter().rposition(|s| !s.rehomed) else {
            return;
        };
        let loads: Vec<Vec<AdapterLoad>> = node
            .sessions
            .iter()
            .filter(|s| s.rehomed)
            .map(|s| s.session.load())
            .collect();
        let held = sum_loads(loads.iter().flatten());
        if held != node.reported {
            node.reported.clone_from(&held);
            let _ = node.sessions[current]
                .session
                .handle_held_elsewhere(self.now, held);
        }
    }

    pub(super) fn session_over(&mut self, n: usize, s: usize) {
        let now = self.now;
        let session = self.nodes[n].sessions.remove(s);
        self.nodes[n].board.leave(session.key);
        let link = session.link;
        let (e, conn) = (self.links[link].edge, self.links[link].conn);
        self.links[link].to_node.clear();
        self.links[link].closed_by_edge = true;
        if self.edges[e].alive {
            let _ = self.edges[e].core.handle_connection_closed(now, conn);
        }
        let id = self.nodes[n].id.clone();
        self.log(|| format!("{id} session on edge {e} conn {} over", conn.0));
        match self.setup.shape {
            Shape::Upgrade { .. } => {
                if !session.rehomed {
                    let failure = session
                        .session
                        .end()
                        .and_then(SessionEnd::failure)
                        .unwrap_or(Failure::EdgeClosed("closed".into()));
                    if let Some(supervisor) = self.nodes[n].supervisor.as_mut() {
                        let _ = supervisor.handle_failure(now, failure);
                    }
                }
            }
            Shape::Multihome { .. } => {
                self.nodes[n].redial_at[e] = now + Duration::from_millis(50);
                for s in 0..self.nodes[n].sessions.len() {
                    self.take_in(n, s);
                }
            }
        }
    }

    /// Node `n`'s supervisor dials: the connection reaches the Edge that listens
    /// (upgrade).
    pub(super) fn dial_listening(&mut self, n: usize) {
        let Shape::Upgrade { listening, .. } = self.setup.shape else {
            return;
        };
        if !self.edges[listening].alive {
            let now = self.now;
            if let Some(supervisor) = self.nodes[n].supervisor.as_mut() {
                let _ = supervisor.handle_failure(now, Failure::EdgeClosed("refused".into()));
            }
            return;
        }
        self.dial(n, listening);
    }

    /// Node `n` dials Edge `e`, which is alive.
    pub(super) fn dial(&mut self, n: usize, e: usize) {
        let now = self.now;
        let conn = ConnId(self.edges[e].next_conn);
        self.edges[e].next_conn += 1;
        let _ = self.edges[e]
            .core
            .handle_connection_opened(now, conn, Peer::default());
        self.links.push(Link {
            edge: e,
            conn,
            node: n,
            to_node: Wire::new(16 << 20),
            to_edge: Wire::new(16 << 20),
            closed_by_edge: false,
        });
        let link = self.links.len() - 1;
        let (token, shape) = (self.setup.token, self.setup.shape);
        let node = &mut self.nodes[n];
        let mut config = SessionConfig::new(node.id.clone(), token);
        config.instance_id = 1 + n as u64;
        config.heartbeat_interval = Duration::from_millis(200);
        config.rehome = matches!(shape, Shape::Upgrade { .. });
        config.cluster = matches!(shape, Shape::Multihome { .. });
        let mut session = NodeSession::new(config);
        let key = node.board.join();
        match shape {
            Shape::Upgrade { .. } => {
                if let Some(supervisor) = node.supervisor.as_mut() {
                    let _ = supervisor.handle_connected(now);
                }
                let _ = session.handle_held_elsewhere(now, node.reported.clone());
            }
            Shape::Multihome { blind_sessions, .. } => {
                if !blind_sessions {
                    let _ = session.handle_held_elsewhere(now, node.board.held_for(key));
                }
            }
        }
        let _ = session.handle_connected(now);
        node.sessions.push(Session {
            link,
            edge: e,
            session,
            jobs: BTreeMap::new(),
            rehomed: false,
            key,
            published: u64::MAX,
        });
        let id = node.id.clone();
        self.log(|| format!("{id} dials edge {e} (conn {})", conn.0));
    }
}
