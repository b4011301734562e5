//! Placing requests by their conversation (README, "Placing a conversation"): a session
//! goes to one provider, on every Edge alike; turns of a conversation without a key
//! follow their anchor; a shared prefix goes where it was sent; and no provider takes
//! more than the load bound.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use common::edge::*;
use iop_proto_core::edge::*;
use iop_proto_core::wire::*;
use iop_proto_core::*;

/// Four nodes n0..n3, each one mock adapter "a" of `capacity`, serving model "m" placed
/// by `mode`.
fn four(capacity: u32, mode: AffinityMode) -> EdgeConfig {
    let mut cfg = config();
    cfg.timing.heartbeat_interval = Duration::from_secs(100);
    cfg.timing.heartbeat_timeout = Duration::from_secs(300);
    cfg.queue.max_waiting = 256;
    let mut candidates = Vec::new();
    for n in 0..4 {
        cfg.nodes.insert(
            format!("n{n}"),
            node(vec![adapter("a", AdapterType::Mock, capacity, 0)]),
        );
        candidates.push(candidate(&format!("n{n}"), "a"));
    }
    cfg.models.remove("solo");
    cfg.models.insert(
        "m".into(),
        ModelSpec {
            candidates,
            affinity: Some(mode),
            ..ModelSpec::default()
        },
    );
    cfg
}

fn edge(capacity: u32, mode: AffinityMode) -> Harness {
    let mut h = Harness::with(four(capacity, mode));
    for n in 0..4 {
        h.connect(&format!("n{n}"));
    }
    h
}

fn chat(messages: &str) -> Bytes {
    Bytes::from(format!(
        r#"{{"model":"m","stream":true,"messages":[{messages}]}}"#
    ))
}

/// Submits `body` (with `session`) and returns the node it was dispatched to, if it was.
fn place(h: &mut Harness, body: Bytes, session: Option<&str>) -> Option<String> {
    let mut submit = Submit::chat("m", body);
    submit.stream = true;
    submit.session = session.map(Into::into);
    h.edge.handle_submit(h.now, submit).expect("accepted");
    grants(&h.events()).first().map(|g| g.node_id.to_string())
}

#[test]
fn a_session_goes_to_one_provider_on_every_edge() {
    let (mut a, mut b) = (
        edge(64, AffinityMode::Session),
        edge(64, AffinityMode::Session),
    );
    let mut agree = 0;
    let mut used = BTreeMap::<String, u32>::new();
    for s in 0..40 {
        let key = format!("session-{s}");
        let body = chat(&format!(r#"{{"role":"user","content":"turn {s}"}}"#));
        let on_a = place(&mut a, body.clone(), Some(&key)).expect("dispatched");
        // A later turn, another prompt, the other Edge.
        let later = chat(&format!(r#"{{"role":"user","content":"other {s}"}}"#));
        let on_b = place(&mut b, later, Some(&key)).expect("dispatched");
        agree += u32::from(on_a == on_b);
        *used.entry(on_a).or_default() += 1;
    }
    // Loads differ between the Edges (each holds its own runs), within the bound.
    assert!(agree >= 36, "{agree} of 40 sessions agreed");
    assert_eq!(
        used.len(),
        4,
        "sessions spread over every provider: {used:?}"
    );
    // Without a key, session mode places by load alone.
    let figures = a.edge.affinity_figures();
    assert_eq!(figures.placed[0] + figures.placed[3], 40);
}

#[test]
fn turns_of_a_conversation_follow_its_anchor_and_a_shared_prefix_its_provider() {
    let (mut a, mut b) = (
        edge(64, AffinityMode::Prefix),
        edge(64, AffinityMode::Prefix),
    );
    let mut agree = 0;
    for c in 0..32 {
        let first = format!(
            r#"{{"role":"system","content":"You help with trips."}},{{"role":"user","content":"Conversation {c}: plan a trip"}}"#
        );
        let second = format!(
            r#"{first},{{"role":"assistant","content":"Day one."}},{{"role":"user","content":"Day two?"}}"#
        );
        let on_a = place(&mut a, chat(&first), None).expect("dispatched");
        let on_b = place(&mut b, chat(&second), None).expect("dispatched");
        agree += u32::from(on_a == on_b);
    }
    assert!(
        agree >= 30,
        "{agree} of 32 conversations agreed without a key"
    );
    // A shared 4 KiB prefix in one user message: every question with it goes where the
    // first went (the anchor sits inside the prefix), within the bound.
    let shared = "p".repeat(4096);
    let mut providers = BTreeMap::<String, u32>::new();
    for q in 0..8 {
        let body = chat(&format!(
            r#"{{"role":"user","content":"{shared} question {q}"}}"#
        ));
        *providers
            .entry(place(&mut a, body, None).expect("dispatched"))
            .or_default() += 1;
    }
    assert!(providers.len() <= 2, "{providers:?}");
    let figures = a.edge.affinity_figures();
    assert!(
        figures.prefix_entries > 0 && figures.matched_blocks > 0,
        "{figures:?}"
    );
}

#[test]
fn one_prefix_at_once_is_spread_within_the_load_bound() {
    // 64 requests with one prompt on 4 providers of 8 slots: a provider takes them while
    // it has room, then the next; once the load passes a provider's capacity, the bound
    // (1.25 x the mean) decides which provider each waits for.
    let mut h = edge(8, AffinityMode::Prefix);
    let body = chat(r#"{"role":"user","content":"the same question"}"#);
    let mut per = BTreeMap::<String, u32>::new();
    let mut waiting = 0;
    for _ in 0..64 {
        match place(&mut h, body.clone(), None) {
            Some(node) => *per.entry(node).or_default() += 1,
            None => waiting += 1,
        }
    }
    assert_eq!(per.len(), 4, "every provider took some: {per:?}");
    assert!(per.values().all(|&n| n <= 8), "{per:?}");
    assert_eq!(per.values().sum::<u32>() + waiting, 64);
    let figures = h.edge.affinity_figures();
    assert_eq!(figures.placed.iter().sum::<u64>(), 64, "{figures:?}");
}

#[test]
fn a_freed_provider_serves_a_waiter_placed_on_it_first() {
    let mut h = edge(1, AffinityMode::Session);
    // Fill every provider.
    let mut holders = Vec::new();
    for s in 0..64 {
        if holders.len() == 4 {
            break;
        }
        let key = format!("fill-{s}");
        let before = h.edge.open_requests();
        let mut submit = Submit::chat("m", chat(r#"{"role":"user","content":"x"}"#));
        submit.session = Some(key.as_str().into());
        h.edge.handle_submit(h.now, submit).expect("accepted");
        if let Some(g) = grants(&h.events()).into_iter().next() {
            holders.push(g);
        }
        assert!(h.edge.open_requests() > before);
    }
    assert_eq!(holders.len(), 4);
    // Two waiters: the older placed on another provider, the newer on the one that
    // frees. The freed one serves the newer first.
    let freed = holders[0].clone();
    let mut keys = (0..200).map(|s| format!("wait-{s}"));
    let rank_of = |key: &str, node: &str| {
        let p = Placement::of(AffinityMode::Session, "m", Some(key), b"{}", 2048).unwrap();
        p.rank((node, "a"))
    };
    let first_choice = |key: &str| {
        (0..4)
            .map(|n| format!("n{n}"))
            .max_by_key(|node| rank_of(key, node))
            .unwrap()
    };
    let elsewhere = keys
        .by_ref()
        .find(|k| first_choice(k) != *freed.node_id)
        .unwrap();
    let here = keys.find(|k| first_choice(k) == *freed.node_id).unwrap();
    for key in [&elsewhere, &here] {
        let mut submit = Submit::chat("m", chat(r#"{"role":"user","content":"y"}"#));
        submit.session = Some(key.as_str().into());
        h.edge.handle_submit(h.now, submit).expect("queued");
    }
    assert!(grants(&h.events()).is_empty(), "every provider is full");
    let run_id = h.dispatch(&freed);
    // The harness numbers connections from 1, n0's first.
    let conn = ConnId(
        (0..4)
            .position(|n| format!("n{n}") == *freed.node_id)
            .expect("node") as u64
            + 1,
    );
    h.run_event(conn, &run_id, RunEventType::Start, 1);
    h.run_event(conn, &run_id, RunEventType::Complete, 2);
    let next = grants(&h.events());
    assert_eq!(next.len(), 1, "{next:?}");
    assert_eq!(next[0].node_id, freed.node_id);
    // The waiter placed here went first: it is the newer request.
    assert!(next[0].run.request.0 > holders[3].run.request.0 + 1);
}

/// A session key whose first choice among n0..n3 is `n{node}`, and not `taken`.
fn key_on(node: usize, taken: &[String]) -> String {
    (0..1000)
        .map(|s| format!("k-{s}"))
        .find(|k| {
            let p = Placement::of(AffinityMode::Session, "m", Some(k), b"{}", 2048).unwrap();
            !taken.contains(k)
                && (0..4)
                    .max_by_key(|n| p.rank((&format!("n{n}"), "a")))
                    .is_some_and(|n| n == node)
        })
        .expect("a key placed there")
}

#[test]
fn a_request_waits_for_its_full_provider_at_most_the_affinity_wait() {
    let mut h = edge(1, AffinityMode::Session);
    let mut holders = Vec::new();
    let mut keys = Vec::new();
    for n in 0..4 {
        let key = key_on(n, &keys);
        keys.push(key.clone());
        let mut submit = Submit::chat("m", chat(r#"{"role":"user","content":"x"}"#));
        submit.session = Some(key.as_str().into());
        h.edge.handle_submit(h.now, submit).expect("accepted");
        holders.extend(grants(&h.events()));
    }
    assert_eq!(holders.len(), 4, "{holders:?}");
    // A session placed on n0 while n0 is full: it waits for n0, not for the first free.
    let key = key_on(0, &keys);
    let mut submit = Submit::chat("m", chat(r#"{"role":"user","content":"y"}"#));
    submit.session = Some(key.as_str().into());
    let waiting = h.edge.handle_submit(h.now, submit).expect("queued");
    assert!(grants(&h.events()).is_empty());
    // n1 frees: the request keeps waiting for n0.
    let on_n1 = holders
        .iter()
        .find(|g| &*g.node_id == "n1")
        .expect("n1 busy")
        .clone();
    let run_id = h.dispatch(&on_n1);
    h.run_event(ConnId(2), &run_id, RunEventType::Start, 1);
    h.run_event(ConnId(2), &run_id, RunEventType::Complete, 2);
    assert!(
        grants(&h.events()).is_empty(),
        "n1 does not take a request placed on n0"
    );
    // Past the affinity wait (3 s), any provider may: n1 takes it.
    h.at(3_001);
    let next = grants(&h.events());
    assert_eq!(next.len(), 1, "{next:?}");
    assert_eq!((next[0].request, &*next[0].node_id), (waiting, "n1"));
}
