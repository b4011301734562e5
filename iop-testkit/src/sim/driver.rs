//! Time and operations: what is due next, the delivery of frames, and each operation of a seed.

use super::*;
use crate::harness::Wire;
use bytes::Bytes;
use iop_proto_core::edge::RunId;
use iop_proto_core::edge::{CloseReason, ConnId, Submit};
use iop_proto_core::reconnect::Failure;
use iop_proto_core::session::{NodeSession, SessionConfig};
use iop_proto_core::testkit::Inspect;
use iop_proto_core::time::Timestamp;
use iop_proto_core::wire::{self, Body, Envelope, ProviderTunnelFrame, RunEvent};
use std::time::Duration;

impl World {
    pub(super) fn next_due(&self) -> Timestamp {
        let mut next = Timestamp::MAX;
        if let Some(t) = self.edge.poll_timeout().map(|w| w.at)
            && !self.faults.skip_timers
        {
            next = next.min(t);
        }
        for link in self.links.values() {
            let node_runnable =
                self.procs[link.node].runnable(self.now) || !self.procs[link.node].alive;
            if !link.edge_done {
                if let Some(at) = link.to_edge.next_arrival() {
                    next = next.min(at.max(link.held_until));
                } else if link.node_closed {
                    next = next.min(self.now.max(link.held_until));
                }
            }
            if node_runnable && !link.node_closed {
                if let Some(at) = link.to_node.next_arrival() {
                    next = next.min(at.max(link.held_until));
                } else if link.edge_closed {
                    next = next.min(self.now.max(link.held_until));
                }
            }
        }
        for p in &self.procs {
            if let Some(t) = p.restart_at {
                next = next.min(t);
            }
            if let Some(t) = p.kill_at {
                next = next.min(t);
            }
            if !p.alive {
                continue;
            }
            if p.frozen_until > self.now {
                next = next.min(p.frozen_until);
                continue;
            }
            if let Some(t) = p.dial_at {
                next = next.min(t);
            }
            if let Some(t) = p.supervisor.poll_timeout().map(|w| w.at) {
                next = next.min(t);
            }
            if let Some(t) = p
                .session
                .as_ref()
                .and_then(NodeSession::poll_timeout)
                .map(|w| w.at)
            {
                next = next.min(t);
            }
            for w in p.work.values() {
                next = next.min(w.next_at);
            }
        }
        if let Some(&(t, _)) = self.client_timers.first() {
            next = next.min(t);
        }
        next
    }

    /// Processes everything due at `self.now`.
    pub(super) fn step(&mut self) {
        self.stats.steps += 1;
        let now = self.now;
        if self.edge.poll_timeout().is_some_and(|w| w.at <= now) {
            if !self.faults.skip_timers {
                self.edge.handle_timeout(now);
            }
            self.drain_edge();
        }
        // Links, in connection order: deliveries to the Edge, then to the node.
        let conns: Vec<u64> = self.links.keys().copied().collect();
        for c in conns {
            self.deliver(ConnId(c));
        }
        // Node processes.
        for i in 0..self.procs.len() {
            self.step_node(i);
        }
        // Clients giving up or leaving.
        while let Some(&(t, request)) = self.client_timers.first() {
            if t > now {
                break;
            }
            self.client_timers.pop_first();
            if self.clients.get(&request).is_some_and(|c| !c.ended) {
                self.log(|| format!("client gives up on {request}"));
                let cancelled = self.edge.handle_cancel(now, request, "client gave up");
                check!(
                    self,
                    cancelled == iop_proto_core::edge::Cancelled::Now,
                    "cancel of open {request} found it ended: {cancelled:?}"
                );
                self.drain_edge();
            }
        }
        self.check_invariants();
    }

    pub(super) fn deliver(&mut self, conn: ConnId) {
        let now = self.now;
        // To the Edge.
        loop {
            let Some(link) = self.links.get_mut(&conn.0) else {
                return;
            };
            if link.held_until > now || link.edge_done {
                break;
            }
            match link.to_edge.receive_one(now) {
                Some(decoded) => {
                    check!(
                        self,
                        decoded.is_ok(),
                        "the codec failed on frames it encoded: {decoded:?}"
                    );
                    let envelopes = decoded.unwrap_or_default();
                    for envelope in envelopes {
                        let kind = envelope.kind();
                        self.log(|| format!("conn {} node->edge {kind}", conn.0));
                        let about_a_run = match &envelope.body {
                            Some(Body::RunEvent(e)) => Some((e.run_id.clone(), terminal_event(e))),
                            Some(Body::ProviderTunnelFrame(f)) => {
                                Some((f.run_id.clone(), terminal_frame(f)))
                            }
                            _ => None,
                        };
                        let drain = matches!(envelope.body, Some(Body::NodeDrainRequest(_)));
                        if drain {
                            self.drain_read.insert(conn.0);
                        }
                        let ready_before = self.edge.owner_of(conn).is_some_and(|o| o.2);
                        // The planted shell bugs: a frame read and never handed over.
                        let run = about_a_run.as_ref().and_then(|(id, _)| RunId::parse(id));
                        let caller_left = run
                            .and_then(|r| self.clients.get(&r.request))
                            .is_some_and(|c| c.ended);
                        let terminal = about_a_run.as_ref().is_some_and(|(_, t)| *t);
                        let swallowed = (drain && self.faults.swallow_drain)
                            || (terminal && !caller_left && self.faults.swallow_terminal)
                            || (terminal && caller_left && self.faults.swallow_cancelled_terminal);
                        let unknown_kind =
                            wire::Validate::validate(&envelope).is_err() && about_a_run.is_some();
                        if unknown_kind && self.faults.close_on_unknown_kind {
                            self.log(|| {
                                format!("shell closes conn {} for an unknown kind", conn.0)
                            });
                            if let Some(link) = self.links.get_mut(&conn.0) {
                                link.edge_closed = true;
                            }
                            self.edge_closed(conn, &CloseReason::PeerClosed);
                        } else if !swallowed {
                            self.note_read(conn, &envelope);
                            let _ = self.edge.handle_envelope(now, conn, envelope);
                        }
                        self.drain_edge();
                        if let Some((run_id, terminal)) = about_a_run {
                            // (Unless its terminal ended a drain: the Edge then closes.)
                            check!(
                                self,
                                !ready_before
                                    || self.edge.owner_of(conn).is_some()
                                    || terminal && self.drain_read.contains(&conn.0),
                                "a message about {run_id} closed its node's connection"
                            );
                            check!(
                                self,
                                !terminal
                                    || RunId::parse(&run_id).is_none_or(|r| self
                                        .edge
                                        .ledger()
                                        .lease_of(r)
                                        .is_none()),
                                "{run_id} still holds its lease after its terminal"
                            );
                        }
                    }
                }
                None if link.node_closed && link.to_edge.is_empty() => {
                    self.log(|| format!("edge sees conn {} closed", conn.0));
                    self.edge_closed(conn, &CloseReason::PeerClosed);
                    break;
                }
                _ => break,
            }
        }
        // To the node.
        loop {
            let Some(link) = self.links.get_mut(&conn.0) else {
                return;
            };
            let i = link.node;
            if link.held_until > now || link.node_closed || !self.procs[i].runnable(now) {
                break;
            }
            match link.to_node.receive_one_inbound(now) {
                Some(decoded) => {
                    let frames = decoded.unwrap_or_default();
                    for inbound in frames {
                        let kind = inbound.kind();
                        self.log(|| format!("conn {} edge->node {kind}", conn.0));
                        if self.procs[i].conn == Some(conn)
                            && let Some(s) = self.procs[i].session.as_mut()
                        {
                            let taken = s.handle_inbound(now, inbound);
                            check!(
                                self,
                                taken.is_ok(),
                                "a live session refused an envelope: {taken:?}"
                            );
                        }
                        self.drain_node(i);
                    }
                }
                None if link.edge_closed && link.to_node.is_empty() => {
                    self.log(|| format!("node sees conn {} closed", conn.0));
                    if self.procs[i].conn == Some(conn)
                        && let Some(s) = self.procs[i].session.as_mut()
                    {
                        let lost = s.handle_connection_lost(
                            now,
                            Failure::EdgeClosed("closed by the edge".into()),
                        );
                        check!(self, lost.is_ok(), "connection lost refused: {lost:?}");
                    }
                    if let Some(link) = self.links.get_mut(&conn.0) {
                        link.node_closed = true;
                    }
                    self.drain_node(i);
                    break;
                }
                _ => break,
            }
        }
        if let Some(link) = self.links.get(&conn.0)
            && link.edge_done
            && link.node_closed
        {
            self.links.remove(&conn.0);
        }
    }

    pub(super) fn step_node(&mut self, i: usize) {
        let now = self.now;
        if self.procs[i].kill_at.is_some_and(|t| t <= now) {
            self.procs[i].kill_at = None;
            self.procs[i].restart_at = None;
            if self.procs[i].alive {
                self.crash(i);
            }
        }
        if self.procs[i].restart_at.is_some_and(|t| t <= now) {
            self.procs[i].restart_at = None;
            let id = self.procs[i].node_id.clone();
            self.log(|| format!("{id} (proc {i}) restarts"));
            let seed = self.rng.next_u64();
            let (bad, kill_at) = (self.procs[i].bad, self.procs[i].kill_at);
            self.procs[i] = NodeProc::new(id, now, false, seed);
            self.procs[i].bad = bad;
            self.procs[i].kill_at = kill_at;
            self.drain_node(i);
        }
        if !self.procs[i].runnable(now) {
            return;
        }
        if self.procs[i].dial_at.is_some_and(|t| t <= now) {
            self.procs[i].dial_at = None;
            let conn = ConnId(self.next_conn);
            self.next_conn += 1;
            self.links.insert(
                conn.0,
                Link {
                    node: i,
                    to_node: Wire::new(wire::DEFAULT_MAX_FRAME_LEN),
                    // The Edge shell starts every connection at the pre-register limit.
                    to_edge: Wire::new(self.edge.config().admission.pending_frame_len),
                    held_until: Timestamp::ZERO,
                    edge_closed: false,
                    node_closed: false,
                    edge_done: false,
                },
            );
            let _ = self.edge.handle_connection_opened(
                now,
                conn,
                iop_proto_core::edge::Peer::default(),
            );
            self.drain_edge();
            let id = self.procs[i].node_id.clone();
            self.log(|| format!("{id} (proc {i}) connected on conn {}", conn.0));
            let p = &mut self.procs[i];
            let _ = p.supervisor.handle_connected(now);
            let mut config =
                SessionConfig::new(p.node_id.clone(), if p.bad { BAD_TOKEN } else { TOKEN });
            config.instance_id = p.instance;
            config.heartbeat_interval = timing().heartbeat_interval;
            config.handshake_timeout = Duration::from_millis(1000);
            config.chunk_size = 4;
            let mut session = NodeSession::new(config);
            let _ = session.handle_connected(now);
            p.session = Some(session);
            p.conn = Some(conn);
            self.drain_node(i);
        }
        if self.procs[i]
            .supervisor
            .poll_timeout()
            .is_some_and(|w| w.at <= now)
        {
            self.procs[i].supervisor.handle_timeout(now);
            self.drain_node(i);
        }
        if let Some(s) = self.procs[i].session.as_mut()
            && s.poll_timeout().is_some_and(|w| w.at <= now)
        {
            s.handle_timeout(now);
            self.drain_node(i);
        }
        let due: Vec<String> = self.procs[i]
            .work
            .iter()
            .filter(|(_, w)| w.next_at <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for run_id in due {
            if !self.progress_work(i, &run_id) {
                self.drain_node(i);
            }
        }
    }

    pub(super) fn advance(&mut self, ms: u64) {
        let target = self.now + Duration::from_millis(ms);
        while self.failure.is_none() {
            let next = self.next_due();
            if next > target {
                self.now = target;
                return;
            }
            self.now = next.max(self.now);
            self.step();
        }
    }

    pub(super) fn submit(
        &mut self,
        model: u8,
        long: bool,
        timeout_ms: u16,
        cancel_after_ms: Option<u16>,
        tunnel_only: bool,
    ) {
        let name = format!("m{}", usize::from(model) % MODELS);
        let mut submit = Submit::chat(&name, Bytes::from_static(br#"{"messages":[]}"#));
        // The streams world: every other request streams a numbered answer.
        let numbered = (self.streams && !tunnel_only && self.stats.requests.is_multiple_of(2))
            .then(|| 1 + (self.stats.requests / 2 % 5) as u32);
        if let Some(tokens) = numbered {
            submit.body = Bytes::from(format!(
                r#"{{"stream":true,"max_tokens":{tokens},"messages":[{{"role":"user","content":"count"}}]}}"#
            ));
            submit.stream = true;
        }
        submit.prompt_tokens = if long { 500 } else { 10 };
        if tunnel_only {
            submit.endpoint = iop_api::openai::Endpoint::Embeddings;
        }
        let result = self.edge.handle_submit(self.now, submit);
        match result {
            Ok(request) => {
                self.stats.requests += 1;
                let deadline = self.now + Duration::from_millis(u64::from(timeout_ms));
                let cancel_at =
                    cancel_after_ms.map(|ms| self.now + Duration::from_millis(u64::from(ms)));
                self.clients.insert(
                    request,
                    Client {
                        deadline,
                        ended: false,
                        checker: None,
                        tunnel_only,
                        dispatches: 0,
                        refusals: 0,
                        refused: None,
                        answered: false,
                        got_bytes: false,
                        expect: numbered.map(|n| (1..=n).map(|i| format!("{i},")).collect()),
                        text: String::new(),
                        resumes: 0,
                        unannounced: None,
                    },
                );
                self.client_timers
                    .insert((cancel_at.unwrap_or(deadline).min(deadline), request));
                self.log(|| {
                    format!(
                        "{request} submitted for {name} (long: {long}, tunnel only: {tunnel_only})"
                    )
                });
                self.drain_edge();
            }
            Err(err) => {
                self.stats.refused += 1;
                self.log(|| format!("submit for {name} refused: {err}"));
            }
        }
    }

    pub(super) fn apply(&mut self, op: &Op) {
        let now = self.now;
        let node = |n: u8| usize::from(n) % NODES;
        match *op {
            Op::Advance(ms) => self.advance(u64::from(ms)),
            Op::Submit {
                model,
                long,
                timeout_ms,
                cancel_after_ms,
                tunnel_only,
            } => self.submit(model, long, timeout_ms, cancel_after_ms, tunnel_only),
            Op::Burst { model, count } => {
                for _ in 0..count {
                    self.submit(model, false, 3000, None, false);
                }
            }
            Op::Crash {
                node: n,
                restart_after_ms,
            } => {
                let i = node(n);
                if self.procs[i].alive {
                    self.crash(i);
                    if self.procs[i].replacement.is_some() {
                        self.retire(i);
                    } else {
                        self.procs[i].restart_at =
                            Some(now + Duration::from_millis(u64::from(restart_after_ms)));
                    }
                }
            }
            Op::Stop {
                node: n,
                restart_after_ms,
                overlap,
            } => {
                let i = node(n);
                if self.procs[i].runnable(now)
                    && self.procs[i].stopping.is_none()
                    && let Some(s) = self.procs[i].session.as_mut()
                {
                    let drained = s.handle_drain(now);
                    check!(self, drained.is_ok(), "drain refused: {drained:?}");
                    self.procs[i].supervisor.handle_stop(now);
                    self.procs[i].stopping =
                        Some(Duration::from_millis(u64::from(restart_after_ms)));
                    self.log(|| format!("proc {i} stops gracefully"));
                    self.drain_node(i);
                    if overlap && self.procs[i].alive {
                        let id = self.procs[i].node_id.clone();
                        let seed = self.rng.next_u64();
                        self.procs.push(NodeProc::new(id.clone(), now, false, seed));
                        let j = self.procs.len() - 1;
                        self.procs[i].replacement = Some(j);
                        self.log(|| format!("{id} restarts as proc {j} beside the draining one"));
                        self.drain_node(j);
                    }
                }
            }
            Op::Freeze { node: n, for_ms } => {
                let i = node(n);
                self.log(|| format!("proc {i} freezes for {for_ms}ms"));
                self.procs[i].frozen_until = now + Duration::from_millis(u64::from(for_ms));
            }
            Op::Partition { node: n, for_ms } => {
                let i = node(n);
                if let Some(conn) = self.procs[i].conn
                    && let Some(link) = self.links.get_mut(&conn.0)
                {
                    link.held_until = now + Duration::from_millis(u64::from(for_ms));
                    self.log(|| format!("conn {} partitioned for {for_ms}ms", conn.0));
                }
            }
            Op::Disconnect { node: n } => {
                let i = node(n);
                if let Some(conn) = self.procs[i].conn {
                    self.log(|| format!("conn {} resets", conn.0));
                    if let Some(link) = self.links.get_mut(&conn.0) {
                        link.to_node.clear();
                        link.to_edge.clear();
                        link.node_closed = true;
                        link.edge_closed = true;
                    }
                    self.edge_closed(conn, &CloseReason::PeerClosed);
                    if self.procs[i].runnable(now)
                        && let Some(s) = self.procs[i].session.as_mut()
                    {
                        let lost = s.handle_connection_lost(now, Failure::Reset);
                        check!(self, lost.is_ok(), "connection lost refused: {lost:?}");
                        self.drain_node(i);
                    }
                }
            }
            Op::Impostor { node: n, for_ms } => {
                let id = format!("n{}", node(n));
                let seed = self.rng.next_u64();
                let mut imp = NodeProc::new(id.clone(), now, true, seed);
                imp.kill_at = Some(now + Duration::from_millis(u64::from(for_ms)));
                self.procs.push(imp);
                let i = self.procs.len() - 1;
                self.log(|| format!("impostor proc {i} for {id}"));
                self.drain_node(i);
            }
            Op::BadSibling { node: n, for_ms } => {
                let id = n.map_or_else(|| UNKNOWN_ID.to_owned(), |n| format!("n{}", node(n)));
                let seed = self.rng.next_u64();
                let mut bad = NodeProc::new(id.clone(), now, false, seed);
                bad.bad = true;
                bad.kill_at = Some(now + Duration::from_millis(u64::from(for_ms)));
                self.procs.push(bad);
                let i = self.procs.len() - 1;
                self.log(|| format!("bad sibling proc {i} claims {id} with a wrong token"));
                self.drain_node(i);
            }
            Op::Refresh => {
                self.rev += 1;
                let rev = self.rev;
                self.log(|| format!("edge reloads config rev {rev}"));
                let result = self
                    .edge
                    .handle_config(now, world_config_with(rev, self.streams));
                check!(
                    self,
                    result.is_ok(),
                    "a valid config was refused: {result:?}"
                );
                self.drain_edge();
            }
            Op::Garble { node: n } => {
                let i = node(n);
                let target = self.procs[i].conn.and_then(|conn| {
                    self.procs[i]
                        .work
                        .iter()
                        .find(|(_, w)| !w.cancelled)
                        .map(|(run_id, w)| (conn, run_id.clone(), w.tunnel))
                });
                if let Some((conn, run_id, tunnel)) = target {
                    self.log(|| format!("n{} sends an unknown message kind for {run_id}", node(n)));
                    let body = if tunnel {
                        Body::ProviderTunnelFrame(ProviderTunnelFrame {
                            run_id,
                            sequence: 1_000,
                            kind: 42,
                            ..ProviderTunnelFrame::default()
                        })
                    } else {
                        Body::RunEvent(RunEvent {
                            run_id,
                            sequence: 1_000,
                            r#type: 99,
                            ..RunEvent::default()
                        })
                    };
                    self.stats.garbled += 1;
                    self.send_to_edge(conn, &Envelope::new(body));
                }
            }
            Op::Provider { node: n, mode } => {
                let i = node(n);
                self.procs[i].mode = mode;
                // A hung provider wakes its pending work when it is no longer hanging.
                if mode != Mode::Hang {
                    for w in self.procs[i].work.values_mut() {
                        w.next_at = w.next_at.min(now + Duration::from_millis(5));
                    }
                }
            }
        }
    }
}
