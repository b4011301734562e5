//! A state-machine property test of the Edge machine against a reference model of the
//! registry, with random interleavings of open, register (good or bad token), ready,
//! close, heartbeat, time, submit, dispatch, complete, violate and cancel across several
//! nodes and connections. After every step it checks the invariants a user relies on.
//! A request whose run fails before its first byte (a violation, its node lost) is given
//! another provider: the model follows it to its new attempt, and to its new place at the
//! back of the queue's line when it has to wait.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use common::edge::{Grant, Harness, adapter, candidate, ended, grants, node};
use iop_proto_core::edge::*;
use iop_proto_core::testkit::Inspect;
use iop_proto_core::testkit::internals::Lease;
use iop_proto_core::wire::*;
use iop_proto_core::*;
use proptest::prelude::*;

const NODES: [&str; 3] = ["n1", "n2", "n3"];
const SLOTS: usize = 5;

#[derive(Clone, Debug)]
enum Op {
    Open(usize),
    Register {
        slot: usize,
        node: usize,
        good: bool,
    },
    Ready {
        slot: usize,
        node: usize,
    },
    Close(usize),
    Heartbeat(usize),
    Advance(u64),
    Submit {
        model: usize,
        long: bool,
    },
    Complete(usize),
    Violate(usize),
    Cancel(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let slot = 0..SLOTS;
    let node = 0..NODES.len();
    prop_oneof![
        2 => slot.clone().prop_map(Op::Open),
        3 => (slot.clone(), node.clone(), prop::bool::weighted(0.85))
            .prop_map(|(slot, node, good)| Op::Register { slot, node, good }),
        3 => (slot.clone(), node).prop_map(|(slot, node)| Op::Ready { slot, node }),
        1 => slot.clone().prop_map(Op::Close),
        1 => slot.prop_map(Op::Heartbeat),
        2 => (1u64..400).prop_map(Op::Advance),
        5 => (0..3usize, prop::bool::weighted(0.3)).prop_map(|(model, long)| Op::Submit { model, long }),
        3 => any::<usize>().prop_map(Op::Complete),
        1 => any::<usize>().prop_map(Op::Violate),
        1 => any::<usize>().prop_map(Op::Cancel),
    ]
}

fn world() -> EdgeConfig {
    let mut cfg = common::edge::config();
    // Liveness timers are covered by scenario tests and the simulator; here they never
    // fire, so the reference model need not model them. Queue expiry does fire.
    cfg.timing.heartbeat_interval = Duration::from_secs(3600);
    cfg.timing.heartbeat_timeout = Duration::from_secs(7200);
    cfg.timing.register_timeout = Duration::from_secs(7200);
    cfg.timing.cancel_grace = Duration::from_millis(700);
    cfg.queue.wait_timeout = Duration::from_millis(900);
    cfg.queue.max_waiting = 6;
    // Back-off and conflict hold-down are covered by tests/admission.rs; here every
    // good register wins, so the model need not count failures or supersedes.
    cfg.admission.throttle.free_failures = u32::MAX;
    cfg.admission.conflict.supersedes = u32::MAX;
    cfg.nodes.clear();
    cfg.nodes.insert(
        "n1".into(),
        node(vec![adapter("a", AdapterType::Mock, 2, 1)]),
    );
    cfg.nodes.insert(
        "n2".into(),
        node(vec![adapter("b", AdapterType::OpenaiCompat, 1, 0)]),
    );
    cfg.nodes.insert(
        "n3".into(),
        node(vec![
            adapter("c", AdapterType::Mock, 1, 1),
            adapter("d", AdapterType::Vllm, 2, 0),
        ]),
    );
    cfg.models.clear();
    let model = |cands: Vec<CandidateSpec>| ModelSpec {
        candidates: cands,
        long_context_threshold: Some(100),
        context_tokens: None,
        first_byte_timeout: None,
        resume_limit: None,
        stall_timeout: None,
        affinity: None,
    };
    cfg.models.insert(
        "m0".into(),
        model(vec![candidate("n1", "a"), candidate("n2", "b")]),
    );
    cfg.models.insert(
        "m1".into(),
        model(vec![candidate("n3", "c"), candidate("n1", "a")]),
    );
    cfg.models
        .insert("m2".into(), model(vec![candidate("n3", "d")]));
    cfg
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ConnModel {
    Unregistered,
    Owner(usize),
    Stale,
}

#[derive(Default)]
struct Model {
    conns: HashMap<usize, (ConnId, ConnModel)>,
    /// node → (slot, ready)
    owners: BTreeMap<usize, (usize, bool)>,
}

impl Model {
    fn state(&self, node: usize) -> NodeState {
        match self.owners.get(&node) {
            None => NodeState::Offline,
            Some((_, false)) => NodeState::Pending,
            Some((_, true)) => NodeState::Ready,
        }
    }

    fn fence_slot(&mut self, slot: usize) {
        self.owners.retain(|_, (s, _)| *s != slot);
    }
}

#[derive(Default)]
struct Tracking {
    granted: BTreeMap<RequestId, Grant>,
    dispatched: BTreeMap<RequestId, (ConnId, String, u64)>,
    ended: BTreeMap<RequestId, Outcome>,
    submitted: BTreeSet<RequestId>,
    /// Requests given another provider and not granted it yet, with the run that failed.
    retrying: BTreeMap<RequestId, RunId>,
    /// Where each request stands in the queue's line: its place on submission, and a new
    /// one at the back when it is given another provider (it waits again behind those
    /// already waiting, with a new wait).
    line: BTreeMap<RequestId, u64>,
    /// Places handed out so far.
    places: u64,
}

impl Tracking {
    fn join_line(&mut self, request: RequestId) {
        self.places += 1;
        self.line.insert(request, self.places);
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut h = Harness::with(world());
    let mut model = Model::default();
    let mut track = Tracking::default();
    let mut clock = 0u64;

    for (step, op) in ops.iter().enumerate() {
        // Whether this op acts for a connection that is not a live owner: it must then
        // change nothing and emit no event.
        let mut stale_actor = false;
        let before: Vec<NodeStatus> = h.edge.nodes();
        match *op {
            Op::Open(slot) => {
                if let std::collections::hash_map::Entry::Vacant(e) = model.conns.entry(slot) {
                    e.insert((h.open(), ConnModel::Unregistered));
                }
            }
            Op::Register { slot, node, good } => {
                let Some(&(conn, phase)) = model.conns.get(&slot) else {
                    continue;
                };
                h.register_with(
                    conn,
                    NODES[node],
                    if good { common::edge::TOKEN } else { "bad" },
                );
                match phase {
                    ConnModel::Unregistered if good => {
                        if let Some((old, _)) = model.owners.insert(node, (slot, false)) {
                            model.conns.get_mut(&old).expect("old").1 = ConnModel::Stale;
                        }
                        model.conns.get_mut(&slot).expect("slot").1 = ConnModel::Owner(node);
                    }
                    ConnModel::Unregistered => {
                        stale_actor = true;
                        model.conns.get_mut(&slot).expect("slot").1 = ConnModel::Stale;
                    }
                    ConnModel::Owner(_) => {
                        model.fence_slot(slot);
                        model.conns.get_mut(&slot).expect("slot").1 = ConnModel::Stale;
                    }
                    ConnModel::Stale => stale_actor = true,
                }
            }
            Op::Ready { slot, node } => {
                let Some(&(conn, phase)) = model.conns.get(&slot) else {
                    continue;
                };
                h.ready(conn, NODES[node]);
                match phase {
                    ConnModel::Owner(n) if n == node => {
                        model.owners.insert(n, (slot, true));
                    }
                    ConnModel::Owner(_) => {
                        model.fence_slot(slot);
                        model.conns.get_mut(&slot).expect("slot").1 = ConnModel::Stale;
                    }
                    ConnModel::Unregistered => {
                        stale_actor = true;
                        model.conns.get_mut(&slot).expect("slot").1 = ConnModel::Stale;
                    }
                    ConnModel::Stale => stale_actor = true,
                }
            }
            Op::Close(slot) => {
                let Some((conn, phase)) = model.conns.remove(&slot) else {
                    continue;
                };
                h.edge.handle_connection_closed(h.now, conn).expect("open");
                if phase == ConnModel::Stale || phase == ConnModel::Unregistered {
                    stale_actor = true;
                }
                model.fence_slot(slot);
            }
            Op::Heartbeat(slot) => {
                let Some(&(conn, phase)) = model.conns.get(&slot) else {
                    continue;
                };
                h.send(
                    conn,
                    Body::Heartbeat(Heartbeat {
                        nonce: step as u64,
                        sent_at_ms: clock,
                    }),
                );
                stale_actor = !matches!(phase, ConnModel::Owner(_));
            }
            Op::Advance(ms) => {
                clock += ms;
                h.at(clock);
            }
            Op::Submit { model: m, long } => {
                let name = format!("m{m}");
                match h.submit(&name, if long { 500 } else { 1 }) {
                    Ok(r) => {
                        prop_assert!(track.submitted.insert(r));
                        track.join_line(r);
                    }
                    Err(SubmitError::QueueFull { .. }) => {
                        prop_assert!(h.edge.queue().waiting_for(&name) >= 6);
                    }
                    Err(SubmitError::NoCandidates(_)) => prop_assert!(long && m == 2),
                    Err(e) => prop_assert!(false, "unexpected refusal {e}"),
                }
            }
            Op::Complete(i) | Op::Violate(i) => {
                let open: Vec<_> = track.dispatched.keys().copied().collect();
                if let Some(&r) = open.get(i % open.len().max(1)) {
                    let (conn, run_id, seq) = track.dispatched[&r].clone();
                    let Some(grant) = track.granted.get(&r) else {
                        continue;
                    };
                    let violate = matches!(op, Op::Violate(_));
                    match grant.shape {
                        DispatchShape::Run if violate => {
                            h.run_event(conn, &run_id, RunEventType::Delta, seq);
                        }
                        DispatchShape::Run => {
                            if seq == 0 {
                                h.run_event(conn, &run_id, RunEventType::Start, 0);
                            }
                            h.run_event(conn, &run_id, RunEventType::Complete, seq + 1);
                        }
                        DispatchShape::Tunnel => {
                            let kind = if violate {
                                TunnelFrameKind::Body
                            } else {
                                TunnelFrameKind::Status
                            };
                            h.send(
                                conn,
                                Body::ProviderTunnelFrame(ProviderTunnelFrame {
                                    run_id: run_id.clone(),
                                    sequence: 0,
                                    kind: kind as i32,
                                    status_code: 200,
                                    ..Default::default()
                                }),
                            );
                            h.send(
                                conn,
                                Body::ProviderTunnelFrame(ProviderTunnelFrame {
                                    run_id: run_id.clone(),
                                    sequence: 1,
                                    kind: TunnelFrameKind::End as i32,
                                    end: true,
                                    ..Default::default()
                                }),
                            );
                        }
                    }
                    track.dispatched.remove(&r);
                }
            }
            Op::Cancel(i) => {
                let open: Vec<_> = track
                    .submitted
                    .iter()
                    .filter(|r| !track.ended.contains_key(r))
                    .copied()
                    .collect();
                if let Some(&r) = open.get(i % open.len().max(1)) {
                    prop_assert_eq!(h.edge.handle_cancel(h.now, r, "test"), Cancelled::Now);
                }
            }
        }

        let (_tx, events) = h.drain();
        // A run that failed before its first byte (or was lost after it) is given another
        // provider: its request is granted again, once per such event, on a new attempt
        // (at once, or from the queue later). The failed run is gone: nothing answers on
        // it. (No model here has a first-byte timeout, whose retry runs beside the slow
        // run.)
        for e in &events {
            if let EdgeEvent::Retried { request, run, .. }
            | EdgeEvent::Resumed { request, run, .. } = e
            {
                prop_assert!(
                    track.retrying.insert(*request, *run).is_none(),
                    "step {step}: {request} given another provider twice before a grant"
                );
                track.dispatched.remove(request);
                track.join_line(*request);
            }
        }
        // The machine dispatches what it grants, in the same transition.
        for g in grants(&events) {
            let before = track.granted.insert(g.request, g.clone());
            if let Some(before) = before {
                let failed = track.retrying.remove(&g.request);
                prop_assert_eq!(
                    failed,
                    Some(before.run),
                    "step {} {:?}: {} granted twice",
                    step,
                    op,
                    g.request
                );
                prop_assert!(
                    g.run.attempt > before.run.attempt,
                    "a retry is a new attempt"
                );
            }
            let conn = h
                .edge
                .owner_of_node(&g.node_id)
                .expect("granted on a ready owner");
            track.dispatched.insert(g.request, (conn, g.run.wire(), 0));
        }
        if stale_actor {
            // A refused register is reported for logs and metrics, and that is all.
            prop_assert!(
                events
                    .iter()
                    .all(|e| matches!(e, EdgeEvent::RegisterRejected { .. })),
                "step {step} {op:?}: stale connection emitted {events:?}"
            );
            prop_assert_eq!(
                &before,
                &h.edge.nodes(),
                "step {} {:?}: stale connection changed state",
                step,
                op
            );
        }
        for (request, outcome) in ended(&events) {
            prop_assert!(
                track.ended.insert(request, outcome).is_none(),
                "step {step}: {request} ended twice"
            );
            track.dispatched.remove(&request);
            track.retrying.remove(&request);
        }
        check(&h, &model, &track, &events)?;
    }

    // Load stops: every connection closes and time passes every deadline.
    let slots: Vec<usize> = model.conns.keys().copied().collect();
    for slot in slots {
        let (conn, _) = model.conns.remove(&slot).expect("slot");
        h.edge.handle_connection_closed(h.now, conn).expect("open");
        model.fence_slot(slot);
    }
    h.at(clock + 10_000);
    let (_, events) = h.drain();
    for (request, outcome) in ended(&events) {
        prop_assert!(
            track.ended.insert(request, outcome).is_none(),
            "ended twice"
        );
    }
    prop_assert_eq!(h.edge.ledger().leases_held(), 0, "every lease returned");
    prop_assert!(h.edge.queue().is_empty());
    prop_assert_eq!(h.edge.open_requests(), 0);
    let ended: BTreeSet<_> = track.ended.keys().copied().collect();
    prop_assert_eq!(ended, track.submitted, "every request ends exactly once");
    Ok(())
}

fn check(
    h: &Harness,
    model: &Model,
    track: &Tracking,
    events: &[EdgeEvent],
) -> Result<(), TestCaseError> {
    let nodes = h.edge.nodes();
    for (i, name) in NODES.iter().enumerate() {
        let status = nodes
            .iter()
            .find(|n| &*n.node_id == *name)
            .expect("configured");
        prop_assert_eq!(status.state, model.state(i), "node {} state", name);
    }
    let ledger = h.edge.ledger();
    let mut held = 0u32;
    for snap in h.edge.snapshots() {
        let r = h
            .edge
            .resource(&snap.node_id, &snap.provider_id)
            .expect("resource");
        let usage = ledger.usage(r);
        prop_assert!(usage.in_flight <= usage.capacity || usage.generation.is_none());
        prop_assert!(usage.long_in_flight <= usage.long_capacity || usage.generation.is_none());
        held += usage.in_flight;
        let ready = nodes
            .iter()
            .any(|n| *n.node_id == snap.node_id && n.state == NodeState::Ready);
        if ready {
            let (queued, long_queued) = h.edge.queue().queued_at(r);
            prop_assert_eq!(snap.in_flight, usage.in_flight);
            prop_assert_eq!(snap.capacity, usage.capacity);
            prop_assert_eq!(snap.queued as usize, queued);
            prop_assert_eq!(snap.long_queued as usize, long_queued);
        } else {
            prop_assert_eq!(snap.status, ProviderStatus::Unavailable as i32);
            prop_assert_eq!((snap.capacity, snap.in_flight, snap.queued), (0, 0, 0));
            prop_assert_eq!(usage.in_flight, 0, "a fenced generation holds no lease");
        }
    }
    prop_assert_eq!(held as usize, ledger.leases_held());

    // Nothing granted to a pending or fenced generation.
    let granted: Vec<(Grant, Lease)> = grants(events)
        .into_iter()
        .filter(|g| !track.ended.contains_key(&g.request))
        .filter_map(|g| Some((g.clone(), ledger.lease_of(g.run)?)))
        .collect();
    for (g, lease) in &granted {
        let status = nodes.iter().find(|n| n.node_id == g.node_id).expect("node");
        prop_assert_eq!(status.state, NodeState::Ready);
        prop_assert_eq!(status.generation, Some(lease.generation));
    }

    // No waiter waits while one of its candidates could take it (has room and may be
    // sent a request: not ejected, not on trial with a request in flight), and grants
    // from the queue went to the oldest fitting waiter.
    let queue = h.edge.queue();
    for w in queue.waiters() {
        let id = w.request;
        for c in w.candidates.iter().filter(|c| h.edge.pickable(c.resource)) {
            prop_assert_eq!(
                ledger.free(c.resource, w.long),
                0,
                "{} waits while {:?} is free",
                id,
                c.resource
            );
        }
    }
    for (g, lease) in &granted {
        for w in queue.waiters() {
            let id = w.request;
            if w.long == lease.long && w.candidates.iter().any(|c| c.resource == lease.resource) {
                prop_assert!(
                    track.line[&id] > track.line[&g.request],
                    "FIFO: {} still waits behind granted {}",
                    id,
                    g.request
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

    #[test]
    fn edge_core_keeps_its_invariants(ops in prop::collection::vec(op(), 1..80)) {
        run(ops)?;
    }
}
