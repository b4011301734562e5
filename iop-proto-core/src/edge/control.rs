//! Control traffic with ready nodes: query commands and config refreshes.
//!
//! `Control` keeps what was asked and answers it; what an answer means for the node (a
//! failed refresh drains it, an applied one changes its capacity) is in `transitions`.

use super::CommandId;
use super::ConnId;
use super::Cx;
use super::EdgeEvent;
use super::MAX_REFRESH_TRIES;
use super::RefreshFailure;
use super::TimerKey;
use crate::lease::Generation;
use crate::wire::Body;
use crate::wire::NodeCommandResponse;
use crate::wire::NodeConfigRefreshRequest;
use crate::wire::NodeConfigRefreshResponse;
use crate::wire::RefreshStatus;
use bytes::Bytes;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::registry::NodeIdx;

/// Outstanding commands, and each node's config refresh.
#[derive(Debug)]
pub(super) struct Control {
    /// Commands awaiting an answer, by sequence.
    commands: BTreeMap<u64, Command>,
    /// The sequence of control requests (commands and refreshes).
    next: u64,
    /// Refresh state by node index (grown as nodes are configured).
    refresh: Vec<Refresh>,
}

impl Default for Control {
    fn default() -> Self {
        Control {
            commands: BTreeMap::new(),
            next: 1,
            refresh: Vec::new(),
        }
    }
}

/// The ready owner a command goes to.
pub(super) struct CommandTarget {
    pub(super) node: NodeIdx,
    pub(super) node_id: Arc<str>,
    pub(super) generation: Generation,
    pub(super) conn: ConnId,
}

#[derive(Debug)]
struct Command {
    node: NodeIdx,
    node_id: Arc<str>,
    generation: Generation,
    request_id: String,
}

/// One node's config refresh.
#[derive(Debug, Default, Clone, Copy)]
struct Refresh {
    /// The refresh in flight: (sequence, revision pushed).
    outstanding: Option<(u64, u64)>,
    /// Pushes of the current revision left unanswered.
    tries: u32,
    /// The last answer.
    last: Option<RefreshStatus>,
}

/// What a refresh answer means.
pub(super) enum Refreshed {
    /// Not the answer to the refresh in flight: ignored.
    Stale,
    /// Applied: the node runs `revision`.
    Applied { revision: u64 },
    /// The node could not take it.
    Failed(RefreshFailure),
}

impl Control {
    fn refresh_mut(&mut self, node: NodeIdx) -> &mut Refresh {
        let at = node_at(node);
        if self.refresh.len() <= at {
            self.refresh.resize(at + 1, Refresh::default());
        }
        &mut self.refresh[at]
    }

    /// The last refresh answer of `node`.
    pub(super) fn last_refresh(&self, node: NodeIdx) -> Option<RefreshStatus> {
        self.refresh.get(node_at(node)).and_then(|r| r.last)
    }

    /// A new revision of `node` is to be pushed: unanswered pushes start again from 0.
    pub(super) fn new_revision(&mut self, node: NodeIdx) {
        self.refresh_mut(node).tries = 0;
    }

    /// Sends `request` to `to`, a node's ready owner, answered within `timeout`.
    pub(super) fn command(
        &mut self,
        cx: &mut Cx<'_>,
        to: CommandTarget,
        mut request: crate::wire::NodeCommandRequest,
        timeout: Duration,
    ) -> CommandId {
        let seq = self.next;
        self.next += 1;
        let id = CommandId(seq);
        request.request_id = id.to_string();
        self.commands.insert(
            seq,
            Command {
                node: to.node,
                node_id: to.node_id,
                generation: to.generation,
                request_id: request.request_id.clone(),
            },
        );
        cx.out.send(to.conn, Body::NodeCommandRequest(request));
        cx.timers.set(TimerKey::Command(seq), cx.now + timeout);
        id
    }

    /// The id the next command will get (commands are validated with their id set).
    pub(super) fn next_command(&self) -> CommandId {
        CommandId(self.next)
    }

    /// A command answer from `node`'s ready owner in `generation`.
    pub(super) fn answered(
        &mut self,
        cx: &mut Cx<'_>,
        node: NodeIdx,
        generation: Generation,
        response: NodeCommandResponse,
    ) {
        let Some(seq) = CommandId::parse(&response.request_id).map(|id| id.0) else {
            return;
        };
        if !self
            .commands
            .get(&seq)
            .is_some_and(|c| c.node == node && c.generation == generation)
        {
            return;
        }
        if let Some(command) = self.commands.remove(&seq) {
            cx.timers.stop(TimerKey::Command(seq));
            cx.out.event(EdgeEvent::CommandAnswered {
                node_id: command.node_id,
                response,
            });
        }
    }

    /// Command `seq` failed (`why`): its caller is answered `ok=false`.
    pub(super) fn fail(&mut self, cx: &mut Cx<'_>, seq: u64, why: &str) {
        cx.timers.stop(TimerKey::Command(seq));
        if let Some(command) = self.commands.remove(&seq) {
            cx.out.event(EdgeEvent::CommandAnswered {
                node_id: command.node_id,
                response: NodeCommandResponse {
                    request_id: command.request_id,
                    ok: false,
                    error: why.to_owned(),
                    payload: Bytes::new(),
                },
            });
        }
    }

    /// `node`'s `generation` is gone: its commands fail and its refresh is dropped.
    pub(super) fn node_lost(&mut self, cx: &mut Cx<'_>, node: NodeIdx, generation: Generation) {
        let lost: Vec<u64> = self
            .commands
            .iter()
            .filter(|(_, c)| c.node == node && c.generation == generation)
            .map(|(seq, _)| *seq)
            .collect();
        for seq in lost {
            self.fail(cx, seq, "the node disconnected");
        }
        let refresh = self.refresh_mut(node);
        refresh.outstanding = None;
        refresh.tries = 0;
        cx.timers.stop(TimerKey::Refresh(node));
    }

    /// Pushes `revision` of `node`'s `payload` to its owner on `conn`.
    pub(super) fn push_refresh(
        &mut self,
        cx: &mut Cx<'_>,
        node: NodeIdx,
        conn: ConnId,
        payload: crate::wire::NodeConfigPayload,
        timeout: Duration,
    ) {
        let seq = self.next;
        self.next += 1;
        let revision = payload.revision;
        self.refresh_mut(node).outstanding = Some((seq, revision));
        cx.out.send(
            conn,
            Body::NodeConfigRefreshRequest(NodeConfigRefreshRequest {
                request_id: format!("refresh-{seq}"),
                config: Some(payload),
            }),
        );
        cx.timers.set(TimerKey::Refresh(node), cx.now + timeout);
    }

    /// A refresh answer from `node`'s ready owner.
    pub(super) fn refresh_answered(
        &mut self,
        cx: &mut Cx<'_>,
        node: NodeIdx,
        node_id: &Arc<str>,
        resp: NodeConfigRefreshResponse,
    ) -> Refreshed {
        let refresh = self.refresh_mut(node);
        let Some((seq, revision)) = refresh.outstanding else {
            return Refreshed::Stale;
        };
        if resp.request_id != format!("refresh-{seq}") {
            return Refreshed::Stale;
        }
        refresh.outstanding = None;
        // An unknown status (a newer node) is not an applied configuration.
        let (status, message) = match RefreshStatus::try_from(resp.status) {
            Ok(status) if status != RefreshStatus::Unspecified => (status, resp.message),
            _ => (
                RefreshStatus::Failed,
                format!("unknown refresh status {}: {}", resp.status, resp.message),
            ),
        };
        refresh.last = Some(status);
        if status == RefreshStatus::Applied {
            refresh.tries = 0;
        }
        cx.timers.stop(TimerKey::Refresh(node));
        cx.out.event(EdgeEvent::RefreshAnswered {
            node_id: node_id.clone(),
            status,
            message: message.clone(),
            revision: resp.revision,
        });
        if status == RefreshStatus::Applied {
            Refreshed::Applied { revision }
        } else {
            Refreshed::Failed(RefreshFailure::Answered { status, message })
        }
    }

    /// `node`'s refresh went unanswered: `Some(retry)` when it was in flight (`retry`:
    /// push it again; otherwise the node has had its tries and must be drained).
    pub(super) fn refresh_timed_out(
        &mut self,
        cx: &mut Cx<'_>,
        node: NodeIdx,
        node_id: &Arc<str>,
    ) -> Option<bool> {
        let refresh = self.refresh_mut(node);
        let (_, revision) = refresh.outstanding.take()?;
        refresh.tries += 1;
        let retrying = refresh.tries < MAX_REFRESH_TRIES;
        cx.out.event(EdgeEvent::RefreshTimedOut {
            node_id: node_id.clone(),
            revision,
            retrying,
        });
        Some(retrying)
    }
}

/// `node`'s place in a table kept beside the registry's.
fn node_at(node: NodeIdx) -> usize {
    node.position()
}
