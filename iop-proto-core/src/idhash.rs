//! Maps keyed by the machines' own ids and names (request, connection and run ids, model
//! and node names).
//!
//! These keys are chosen by the machine, the local shell or the configuration, or (on a
//! Node) by its Edge, which the Node trusts with its whole configuration; never by an
//! unauthenticated peer. So the flooding resistance of a randomly keyed SipHash buys
//! nothing, while `foldhash` with a fixed seed is several times faster on the hot path
//! and keeps the machines deterministic:
//! the same inputs make the same maps, whatever the process.

/// `HashMap` keyed by machine-chosen ids or configured names.
pub(crate) type IdMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::FixedState>;

/// `HashSet` of machine-chosen ids.
pub(crate) type IdSet<K> = std::collections::HashSet<K, foldhash::fast::FixedState>;
