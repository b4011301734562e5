//! The member lists a Node's sessions hear, kept for the task that follows the cluster.

use iop_proto_core::wire;

/// The member lists the node's sessions heard that the follower has not taken yet, in
/// the core's coalescing inbox ([`iop_proto_core::cluster::HeardMembers`]: at most two
/// wait), shared between the sessions' tasks and the follower's.
#[derive(Debug, Default)]
pub struct MembersHeard {
    lists: std::sync::Mutex<iop_proto_core::cluster::HeardMembers>,
    ready: tokio::sync::Notify,
}

impl MembersHeard {
    /// A session heard `members` (`from_seed`: the session to the configured Edge).
    pub fn put(&self, from_seed: bool, members: wire::ClusterMembers) {
        self.lists
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .handle_members(from_seed, members);
        self.ready.notify_one();
    }

    /// What was heard since the last call, oldest first, as `MemberLinks` should take it
    /// in; waits while there is nothing.
    pub async fn take(&self) -> Vec<(bool, wire::ClusterMembers)> {
        loop {
            let taken = self
                .lists
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            if !taken.is_empty() {
                return taken;
            }
            self.ready.notified().await;
        }
    }
}
