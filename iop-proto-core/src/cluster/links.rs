//! A Node's side of a cluster: which Edges it keeps a session with ([`MemberLinks`]),
//! from the member lists its sessions hear ([`HeardMembers`]).

use std::collections::{BTreeMap, VecDeque};

/// A node's links to the Edges of a cluster (docs/cluster.md, "Which Edges a Node
/// dials"): which member to keep a session with, from the member lists its sessions
/// hear. The configured Edge (the *seed*) is dialled by the node's own supervisor; every
/// other member gets a link of its own while it is listed, and is told to leave once it
/// is not (or once its address changes).
#[derive(Debug, Default)]
pub struct MemberLinks {
    /// The Edge the seed session reached, once it said.
    seed_edge: Option<String>,
    /// Linked members: edge id → node-facing address.
    links: BTreeMap<String, String>,
    events: VecDeque<LinkEvent>,
}

/// What [`MemberLinks`] asks of the shell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkEvent {
    /// Keep a session with this member: dial it, and again after each loss, until told
    /// [`LinkEvent::Leave`].
    Dial {
        /// Its id.
        edge_id: String,
        /// Where to dial (`host:port`).
        addr: String,
    },
    /// Drain and end the session with this member.
    Leave {
        /// Its id.
        edge_id: String,
    },
}

/// Whether `addr` can be dialled: `host:port` with a non-zero port, no whitespace, at
/// most 255 bytes (a node's `edge_addr`, and the members an Edge names).
#[must_use]
pub fn dialable(addr: &str) -> bool {
    addr.len() <= 255
        && !addr.chars().any(char::is_whitespace)
        && addr.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0)
        })
}

/// The member lists a node's sessions heard that its [`MemberLinks`] has not taken yet:
/// the inbox between the sessions, which hear them, and the links, which follow them.
///
/// Each list replaces the one before in [`MemberLinks`], which keeps from the seed's
/// lists only which Edge the seed is. So the last list from the seed and the last from
/// any session say all that the lists in between would: however fast Edges send them,
/// at most two wait here.
#[derive(Debug, Default)]
pub struct HeardMembers {
    /// The seed's last list, when a list from another session came after it.
    seed: Option<crate::wire::ClusterMembers>,
    /// The last list, and whether the seed sent it.
    last: Option<(bool, crate::wire::ClusterMembers)>,
}

impl HeardMembers {
    /// A session heard `members` (`from_seed`: the session to the configured Edge).
    pub fn handle_members(&mut self, from_seed: bool, members: crate::wire::ClusterMembers) {
        let before = self.last.replace((from_seed, members));
        if from_seed {
            // The newer seed list, now last, says which Edge the seed is.
            self.seed = None;
        } else if let Some((true, seed)) = before {
            self.seed = Some(seed);
        }
    }

    /// Whether nothing waits.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.last.is_none()
    }

    /// What waits, oldest first, as [`MemberLinks::handle_members`] should take it in
    /// (at most two lists); empty afterwards.
    pub fn take(&mut self) -> Vec<(bool, crate::wire::ClusterMembers)> {
        let seed = self.seed.take().map(|seed| (true, seed));
        seed.into_iter().chain(self.last.take()).collect()
    }
}

impl MemberLinks {
    /// A session heard the members (`from_seed`: the session dialled to the configured
    /// Edge, whose id `members.edge_id` then is). A member with an address that cannot
    /// be dialled is left out.
    ///
    /// Each list replaces the one before ([`HeardMembers`] coalesces on that), so a list
    /// must name its sender: an Edge lists itself once its own key is written
    /// ([`ClusterEvent::Members`]), even before its view of etcd shows it.
    pub fn handle_members(&mut self, from_seed: bool, members: &crate::wire::ClusterMembers) {
        if from_seed {
            self.seed_edge = Some(members.edge_id.clone());
        }
        let wanted: BTreeMap<&str, &str> = members
            .members
            .iter()
            .filter(|m| self.seed_edge.as_deref() != Some(m.edge_id.as_str()))
            .filter(|m| dialable(&m.node_addr))
            .map(|m| (m.edge_id.as_str(), m.node_addr.as_str()))
            .collect();
        let gone: Vec<String> = self
            .links
            .iter()
            .filter(|(id, addr)| wanted.get(id.as_str()) != Some(&addr.as_str()))
            .map(|(id, _)| id.clone())
            .collect();
        for edge_id in gone {
            self.links.remove(&edge_id);
            self.events.push_back(LinkEvent::Leave { edge_id });
        }
        for (edge_id, addr) in wanted {
            if !self.links.contains_key(edge_id) {
                self.links.insert(edge_id.to_owned(), addr.to_owned());
                self.events.push_back(LinkEvent::Dial {
                    edge_id: edge_id.to_owned(),
                    addr: addr.to_owned(),
                });
            }
        }
    }

    /// The next link to open or close.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<LinkEvent> {
        self.events.pop_front()
    }
}
