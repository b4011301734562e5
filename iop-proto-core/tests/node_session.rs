//! Scenario tests of the Node session machine: one test per contract rule.
//!
//! One file on purpose, past the 800-line norm: each file under `tests/` is a test binary
//! of its own, linked against the whole dependency graph, and on a 2-core CI machine every
//! extra binary costs a link; this suite covers one subject and shares its helpers.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use iop_proto_core::session::*;
use iop_proto_core::testkit::InspectSession;
use iop_proto_core::testkit::adapter;
use iop_proto_core::testkit::internals::*;
use iop_proto_core::wire::*;
use iop_proto_core::*;

fn payload(revision: u64, adapters: Vec<AdapterConfig>) -> NodeConfigPayload {
    NodeConfigPayload {
        revision,
        adapters,
        runtime: None,
    }
}

struct H {
    s: NodeSession,
    now: u64,
    /// Events drained along with transmits, not yet looked at.
    pending_events: Vec<SessionEvent>,
    /// The Edge's `RegisterResponse.merged_tunnel_frames`.
    merged: bool,
}

impl H {
    fn t(&self) -> Timestamp {
        Timestamp::from_millis(self.now)
    }

    fn new() -> Self {
        Self::with(|_| {})
    }

    fn with(tweak: impl FnOnce(&mut SessionConfig)) -> Self {
        let mut cfg = SessionConfig::new("n1", "secret");
        cfg.handshake_timeout = Duration::from_millis(5000);
        cfg.chunk_size = 4;
        tweak(&mut cfg);
        H {
            s: NodeSession::new(cfg),
            now: 0,
            pending_events: Vec::new(),
            merged: false,
        }
    }

    fn rx(&mut self, body: Body) {
        let t = self.t();
        // A closed session refuses input; tests check `end()` for that.
        let _ = self.s.handle_envelope(t, Envelope::new(body));
    }

    /// The frames sent so far (a close is checked with [`H::closed`]).
    fn tx(&mut self) -> Vec<Body> {
        self.drain()
            .into_iter()
            .filter_map(|t| match t {
                NodeTransmit::Frame(e) => e.body,
                NodeTransmit::Close { .. } => None,
            })
            .collect()
    }

    fn drain(&mut self) -> Vec<NodeTransmit> {
        let (transmits, events) = iop_proto_core::testkit::drain_node(&mut self.s);
        self.pending_events.extend(events);
        transmits
    }

    fn events(&mut self) -> Vec<SessionEvent> {
        let mut events: Vec<SessionEvent> = self.pending_events.drain(..).collect();
        events.extend(std::iter::from_fn(|| self.s.poll_event()));
        events
    }

    fn at(&mut self, ms: u64) {
        self.now = ms;
        let t = self.t();
        self.s.handle_timeout(t);
    }

    fn accept(&mut self, adapters: Vec<AdapterConfig>) {
        self.rx(Body::RegisterResponse(RegisterResponse {
            accepted: true,
            reason: String::new(),
            node_id: "n1".into(),
            config: Some(payload(1, adapters)),
            heartbeat_interval_ms: 1000,
            retry_after_ms: 0,
            load_reports: true,
            cluster: None,
            merged_tunnel_frames: self.merged,
        }));
    }

    /// Connected, registered with a mock adapter "a" (capacity 2, long 1), ready.
    fn ready() -> Self {
        Self::ready_with(|_| {})
    }

    fn ready_with(tweak: impl FnOnce(&mut SessionConfig)) -> Self {
        Self::ready_merging(false, tweak)
    }

    /// Ready, with an Edge that takes merged tunnel frames or not.
    fn ready_merging(merged: bool, tweak: impl FnOnce(&mut SessionConfig)) -> Self {
        let mut h = H::with(tweak);
        h.merged = merged;
        h.s.handle_connected(h.t()).expect("connecting");
        h.accept(vec![adapter("a", AdapterType::Mock, 2, 1)]);
        h.s.handle_config_applied(h.t(), Ok(()))
            .expect("configuring");
        h.rx(Body::NodeReadyResponse(NodeReadyResponse {
            ready: true,
            reason: String::new(),
        }));
        h.tx();
        h.events();
        assert_eq!(h.s.state(), SessionState::Ready);
        h
    }

    /// A chat-completions tunnel request from the Edge.
    fn tunnel(&mut self, run_id: &str, adapter: &str) {
        self.rx(Body::ProviderTunnelRequest(ProviderTunnelRequest {
            run_id: run_id.into(),
            adapter: adapter.into(),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            ..Default::default()
        }));
    }

    fn run(&mut self, run_id: &str, adapter: &str, long: bool) {
        self.rx(Body::RunRequest(RunRequest {
            run_id: run_id.into(),
            adapter: adapter.into(),
            target: "t".into(),
            long_context: long,
            ..Default::default()
        }));
    }
}

#[test]
fn register_then_apply_then_ready_in_that_order() {
    let mut h = H::new();
    assert_eq!(h.s.state(), SessionState::Connecting);
    h.s.handle_connected(h.t()).expect("connecting");
    let tx = h.tx();
    let [Body::RegisterRequest(reg)] = tx.as_slice() else {
        panic!("{tx:?}");
    };
    assert_eq!((reg.node_id.as_str(), reg.token.as_str()), ("n1", "secret"));
    h.accept(vec![adapter("a", AdapterType::Mock, 2, 1)]);
    assert_eq!(h.s.state(), SessionState::Configuring);
    assert!(matches!(
        h.events().as_slice(),
        [SessionEvent::ApplyConfig { .. }]
    ));
    assert!(h.tx().is_empty(), "no ready before the adapters started");
    h.s.handle_config_applied(h.t(), Ok(()))
        .expect("configuring");
    assert!(matches!(h.tx().as_slice(), [Body::NodeReadyRequest(r)] if r.node_id == "n1"));
    h.rx(Body::NodeReadyResponse(NodeReadyResponse {
        ready: true,
        reason: String::new(),
    }));
    assert_eq!(h.events(), vec![SessionEvent::Ready]);
    assert_eq!(h.s.heartbeat_interval(), Duration::from_millis(1000));
    assert_eq!(h.s.gate("a").map(CapacityGate::capacity), Some(2));
}

#[test]
fn rejected_register_is_fatal_and_ready_false_is_retryable() {
    let mut h = H::new();
    h.s.handle_connected(h.t()).expect("connecting");
    h.rx(Body::RegisterResponse(RegisterResponse {
        accepted: false,
        reason: "invalid token".into(),
        ..Default::default()
    }));
    assert_eq!(h.s.state(), SessionState::Closed);
    let failure = h.s.end().and_then(SessionEnd::failure).expect("failure");
    assert!(failure.is_fatal(), "{failure}");

    let mut h = H::new();
    h.s.handle_connected(h.t()).expect("connecting");
    h.accept(vec![]);
    h.s.handle_config_applied(h.t(), Ok(()))
        .expect("configuring");
    h.rx(Body::NodeReadyResponse(NodeReadyResponse {
        ready: false,
        reason: "superseded".into(),
    }));
    assert_eq!(
        h.s.end(),
        Some(&SessionEnd::ReadyRefused("superseded".into()))
    );
    assert!(
        !h.s.end()
            .and_then(SessionEnd::failure)
            .expect("failure")
            .is_fatal()
    );
}

#[test]
fn a_temporary_rejection_is_retried_and_an_unasked_ready_false_says_why() {
    let mut h = H::new();
    h.s.handle_connected(h.t()).expect("connecting");
    h.rx(Body::RegisterResponse(RegisterResponse {
        accepted: false,
        reason: "authentication failed".into(),
        retry_after_ms: 4000,
        ..Default::default()
    }));
    let failure = h.s.end().and_then(SessionEnd::failure).expect("failure");
    assert!(!failure.is_fatal(), "{failure}");
    assert!(matches!(failure, Failure::Deferred { retry_after, .. }
        if retry_after == std::time::Duration::from_secs(4)));

    // A ready node the Edge drops for a newer connection is told why.
    let mut h = H::new();
    h.s.handle_connected(h.t()).expect("connecting");
    h.accept(vec![]);
    h.s.handle_config_applied(h.t(), Ok(()))
        .expect("configuring");
    h.rx(Body::NodeReadyResponse(NodeReadyResponse {
        ready: true,
        reason: String::new(),
    }));
    assert_eq!(h.s.state(), SessionState::Ready);
    h.rx(Body::NodeReadyResponse(NodeReadyResponse {
        ready: false,
        reason: "superseded: a newer connection registered this node id".into(),
    }));
    assert!(matches!(h.s.end(), Some(SessionEnd::ReadyRefused(why)) if why.contains("superseded")));
}

#[test]
fn adapters_that_fail_to_start_end_the_session() {
    let mut h = H::new();
    h.s.handle_connected(h.t()).expect("connecting");
    h.accept(vec![adapter("a", AdapterType::Mock, 1, 0)]);
    h.s.handle_config_applied(h.t(), Err("port in use".into()))
        .expect("configuring");
    assert!(
        h.tx()
            .iter()
            .all(|b| !matches!(b, Body::NodeReadyRequest(_)))
    );
    assert_eq!(
        h.s.end(),
        Some(&SessionEnd::ConfigNotApplied("port in use".into()))
    );
}

#[test]
fn a_config_that_breaks_the_contract_ends_the_session_as_invalid() {
    let mut h = H::new();
    h.s.handle_connected(h.t()).expect("connecting");
    h.accept(vec![
        adapter("a", AdapterType::Mock, 1, 0),
        adapter("a", AdapterType::Mock, 1, 0),
    ]);
    assert!(h.events().is_empty(), "nothing to apply");
    assert!(matches!(
        h.s.end(),
        Some(SessionEnd::InvalidConfig(ValidationError::DuplicateAdapter { name })) if name == "a"
    ));
}

#[test]
fn heartbeats_are_answered_sent_and_silence_loses_the_connection() {
    let mut h = H::ready();
    h.rx(Body::Heartbeat(Heartbeat {
        nonce: 9,
        sent_at_ms: 3,
    }));
    assert_eq!(
        h.tx(),
        vec![Body::HeartbeatAck(HeartbeatAck {
            nonce: 9,
            echo_sent_at_ms: 3
        })]
    );
    h.at(1000);
    assert!(matches!(h.tx().as_slice(), [Body::Heartbeat(_)]));
    h.now = 1200;
    h.rx(Body::HeartbeatAck(HeartbeatAck {
        nonce: 1,
        echo_sent_at_ms: 1000,
    }));
    assert_eq!(h.s.last_rtt(), Some(Duration::from_millis(200)));
    h.at(4199);
    assert_eq!(h.s.state(), SessionState::Ready);
    h.at(4200);
    assert_eq!(h.s.end(), Some(&SessionEnd::HeartbeatTimeout));
}

#[test]
fn handshake_must_complete_in_time() {
    let mut h = H::new();
    h.s.handle_connected(h.t()).expect("connecting");
    h.accept(vec![]);
    h.rx(Body::Heartbeat(Heartbeat::default())); // the Edge is alive
    h.now = 4999;
    h.rx(Body::Heartbeat(Heartbeat::default()));
    h.at(4999);
    assert_eq!(h.s.state(), SessionState::Configuring);
    h.at(5000);
    assert_eq!(h.s.end(), Some(&SessionEnd::HandshakeTimeout));
}

#[test]
fn work_passes_the_capacity_gate_or_is_refused_at_once() {
    let mut h = H::ready();
    h.run("r1", "a", true);
    h.run("r2", "a", true); // long capacity is 1
    h.run("r3", "a", false);
    h.run("r4", "a", false); // capacity is 2
    h.run("r5", "zz", false); // unknown adapter
    let events = h.events();
    let started: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            SessionEvent::StartRun { request } => Some(request.run_id.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(started, vec!["r1", "r3"]);
    let refused: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            SessionEvent::WorkRefused { run_id, .. } => Some(run_id.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(refused, vec!["r2", "r4", "r5"]);
    // Each refusal is a valid run: START then ERROR.
    let tx = h.tx();
    for run in ["r2", "r4", "r5"] {
        let mut tracker = RunTracker::new();
        let events: Vec<_> = tx
            .iter()
            .filter_map(|b| match b {
                Body::RunEvent(e) if e.run_id == run => Some(e.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(events.len(), 2);
        for e in &events {
            tracker.observe(e).expect("valid refusal");
        }
        assert!(tracker.is_ended());
    }
    // Runs and tunnels share the gate.
    h.tunnel("t1", "a");
    assert!(matches!(
        h.events().as_slice(),
        [SessionEvent::WorkRefused { .. }]
    ));
    let tx = h.tx();
    assert!(
        matches!(tx.as_slice(), [Body::ProviderTunnelFrame(f)] if f.kind == TunnelFrameKind::Error as i32 && f.sequence == 0)
    );
}

#[test]
fn run_output_is_sequenced_and_checked() {
    let mut h = H::ready();
    h.run("r1", "a", false);
    h.events();
    let t = h.t();
    assert!(matches!(
        h.s.handle_run_output(t, "r1", RunOutput::Delta("x".into())),
        Err(SessionError::InvalidRunOutput { .. })
    ));
    assert!(h.tx().is_empty(), "a refused output sends nothing");
    h.s.handle_run_output(t, "r1", RunOutput::Start)
        .expect("start");
    h.s.handle_run_output(t, "r1", RunOutput::Delta("hel".into()))
        .expect("delta");
    let mut metadata = BTreeMap::new();
    metadata.insert("openai_tool_calls".to_string(), "[]".to_string());
    h.s.handle_run_output(
        t,
        "r1",
        RunOutput::Complete {
            usage: None,
            metadata,
        },
    )
    .expect("complete");
    assert_eq!(
        h.s.handle_run_output(t, "r1", RunOutput::Delta("late".into())),
        Err(SessionError::UnknownRun("r1".into()))
    );
    let seqs: Vec<_> = h
        .tx()
        .into_iter()
        .filter_map(|b| match b {
            Body::RunEvent(e) => Some((e.sequence, e.r#type)),
            _ => None,
        })
        .collect();
    assert_eq!(
        seqs,
        vec![
            (0, RunEventType::Start as i32),
            (1, RunEventType::Delta as i32),
            (2, RunEventType::Complete as i32)
        ]
    );
    assert_eq!(
        h.s.gate("a").map(CapacityGate::in_flight),
        Some(0),
        "unit returned"
    );
}

#[test]
fn tunnel_output_is_chunked_ordered_and_ends_once() {
    let mut h = H::ready();
    h.tunnel("t1", "a");
    assert!(matches!(
        h.events().as_slice(),
        [SessionEvent::StartTunnel { .. }]
    ));
    let t = h.t();
    assert_eq!(
        h.s.handle_tunnel_output(t, "t1", TunnelOutput::Body(Bytes::from_static(b"early"))),
        Err(SessionError::InvalidTunnelOutput("t1".into()))
    );
    h.s.handle_tunnel_output(
        t,
        "t1",
        TunnelOutput::Status {
            status: 200,
            headers: vec![],
        },
    )
    .expect("status");
    h.s.handle_tunnel_output(
        t,
        "t1",
        TunnelOutput::Body(Bytes::from_static(b"0123456789")),
    )
    .expect("body");
    h.s.handle_tunnel_output(t, "t1", TunnelOutput::Usage(Usage::default()))
        .expect("usage");
    h.s.handle_tunnel_output(t, "t1", TunnelOutput::End)
        .expect("end");
    assert!(
        h.s.handle_tunnel_output(t, "t1", TunnelOutput::End)
            .is_err()
    );
    let frames: Vec<_> = h
        .tx()
        .into_iter()
        .filter_map(|b| match b {
            Body::ProviderTunnelFrame(f) => Some(f),
            _ => None,
        })
        .collect();
    let mut rx = TunnelReceiver::new();
    for f in &frames {
        rx.observe(f).expect("valid frame");
    }
    let body: Vec<u8> = frames.iter().flat_map(|f| f.body.to_vec()).collect();
    assert_eq!(body, b"0123456789");
    assert_eq!(
        frames
            .iter()
            .filter(|f| f.kind == TunnelFrameKind::Body as i32)
            .count(),
        3
    );
}

#[test]
fn cancel_affects_only_the_named_run() {
    let mut h = H::ready();
    h.run("r1", "a", false);
    h.run("r2", "a", false);
    h.events();
    h.rx(Body::CancelRequest(CancelRequest {
        run_id: "r1".into(),
        kind: CancelKind::TerminateSession as i32,
        reason: "caller left".into(),
    }));
    assert_eq!(
        h.events(),
        vec![SessionEvent::CancelRun {
            run_id: "r1".into()
        }]
    );
    h.rx(Body::CancelRequest(CancelRequest {
        run_id: "r1".into(),
        kind: CancelKind::CancelRun as i32,
        reason: String::new(),
    }));
    assert!(
        h.events().is_empty(),
        "a repeated cancel is not re-signalled"
    );
    assert_eq!(h.s.in_flight(), 2, "r2 untouched");
    h.rx(Body::CancelRequest(CancelRequest {
        run_id: "nope".into(),
        kind: CancelKind::CancelRun as i32,
        reason: String::new(),
    }));
    assert_eq!(
        h.events(),
        vec![SessionEvent::CancelRejected {
            run_id: "nope".into(),
            error: CancelError::UnknownRun
        }]
    );
    // After the terminal: a no-op.
    let t = h.t();
    h.s.handle_run_output(t, "r2", RunOutput::Start)
        .expect("start");
    h.s.handle_run_output(t, "r2", RunOutput::Error(ErrorDetail::default()))
        .expect("end");
    h.rx(Body::CancelRequest(CancelRequest {
        run_id: "r2".into(),
        kind: CancelKind::CancelRun as i32,
        reason: String::new(),
    }));
    assert!(h.events().is_empty());
    h.rx(Body::CancelRequest(CancelRequest::default()));
    assert!(matches!(
        h.events().as_slice(),
        [SessionEvent::CancelRejected {
            error: CancelError::Invalid(_),
            ..
        }]
    ));
}

fn refresh(h: &mut H, id: &str, adapters: Vec<AdapterConfig>) {
    h.rx(Body::NodeConfigRefreshRequest(NodeConfigRefreshRequest {
        request_id: id.into(),
        config: Some(payload(2, adapters)),
    }));
}

fn refresh_status(tx: &[Body]) -> (RefreshStatus, String) {
    tx.iter()
        .find_map(|b| match b {
            Body::NodeConfigRefreshResponse(r) => Some((
                RefreshStatus::try_from(r.status).expect("known"),
                r.message.clone(),
            )),
            _ => None,
        })
        .expect("a refresh response")
}

#[test]
fn invalid_refresh_fails_and_keeps_the_old_config() {
    let mut h = H::ready();
    let mut bad = adapter("a", AdapterType::Mock, 5, 9); // long above capacity
    bad.enabled = true;
    refresh(&mut h, "q1", vec![bad]);
    let (status, message) = refresh_status(&h.tx());
    assert_eq!(status, RefreshStatus::Failed);
    assert!(message.contains("long_capacity"), "{message}");
    assert_eq!(h.s.applied_config().map(|p| p.revision), Some(1));
    assert_eq!(h.s.gate("a").map(CapacityGate::capacity), Some(2));
}

#[test]
fn a_type_change_requires_a_restart_and_says_which() {
    let mut h = H::ready();
    refresh(&mut h, "q1", vec![adapter("a", AdapterType::Ollama, 2, 1)]);
    let (status, message) = refresh_status(&h.tx());
    assert_eq!(status, RefreshStatus::RestartRequired);
    assert!(
        message.contains("\"a\"") && message.contains("mock") && message.contains("ollama"),
        "{message}"
    );
    assert_eq!(h.s.applied_config().map(|p| p.revision), Some(1));
}

#[test]
fn applied_refresh_resizes_adds_and_removes_adapters_without_dropping_runs() {
    let mut h = H::ready();
    h.run("r1", "a", false);
    h.events();
    refresh(&mut h, "q1", vec![adapter("b", AdapterType::Mock, 1, 0)]);
    let events = h.events();
    let [SessionEvent::RefreshConfig { diff, .. }] = events.as_slice() else {
        panic!("{events:?}");
    };
    assert_eq!(
        (diff.added.clone(), diff.removed.clone()),
        (vec!["b".to_string()], vec!["a".to_string()])
    );
    assert!(h.tx().is_empty(), "answer only once applied");
    let t = h.t();
    h.s.handle_refresh_applied(t, "q1", Ok(()))
        .expect("pending");
    assert_eq!(refresh_status(&h.tx()).0, RefreshStatus::Applied);
    // Nothing new goes to the removed adapter; the run on it still finishes normally.
    h.run("r2", "a", false);
    assert!(matches!(
        h.events().as_slice(),
        [SessionEvent::WorkRefused { .. }]
    ));
    h.s.handle_run_output(t, "r1", RunOutput::Start)
        .expect("still in flight");
    h.s.handle_run_output(
        t,
        "r1",
        RunOutput::Complete {
            usage: None,
            metadata: BTreeMap::new(),
        },
    )
    .expect("finishes");
    h.run("r3", "b", false);
    assert!(matches!(
        h.events().as_slice(),
        [SessionEvent::StartRun { .. }]
    ));
    assert_eq!(h.s.applied_config().map(|p| p.revision), Some(2));
}

#[test]
fn failed_apply_answers_failed() {
    let mut h = H::ready();
    refresh(&mut h, "q1", vec![adapter("a", AdapterType::Mock, 3, 1)]);
    h.events();
    let t = h.t();
    h.s.handle_refresh_applied(t, "q1", Err("bind failed".into()))
        .expect("pending");
    let (status, message) = refresh_status(&h.tx());
    assert_eq!(status, RefreshStatus::Failed);
    assert!(message.contains("bind failed"));
    assert_eq!(h.s.gate("a").map(CapacityGate::capacity), Some(2));
    assert!(
        h.s.handle_refresh_applied(t, "q1", Ok(())).is_err(),
        "answered once"
    );
}

#[test]
fn a_late_cancel_of_a_recently_finished_run_is_a_no_op_even_if_its_id_came_twice() {
    let mut h = H::ready();
    let finish = |h: &mut H, id: &str| {
        h.run(id, "a", false);
        let t = h.t();
        h.s.handle_run_output(t, id, RunOutput::Start)
            .expect("start");
        h.s.handle_run_output(t, id, RunOutput::Error(ErrorDetail::default()))
            .expect("end");
    };
    // The events a cancel of "r1" raises, once what came before is drained.
    let cancel_r1 = |h: &mut H| {
        h.events();
        h.rx(Body::CancelRequest(CancelRequest {
            run_id: "r1".into(),
            kind: CancelKind::CancelRun as i32,
            reason: String::new(),
        }));
        h.events()
    };
    // "r1" finishes twice, then 4,095 other runs: its second finish is among the last
    // 4,096 the session remembers (a memory that counted the id twice would have
    // forgotten it with its first finish).
    finish(&mut h, "r1");
    finish(&mut h, "r1");
    for i in 0..4_095 {
        finish(&mut h, &format!("x{i}"));
    }
    assert!(
        cancel_r1(&mut h).is_empty(),
        "r1 finished among the last 4,096 runs"
    );
    for i in 0..4_096 {
        finish(&mut h, &format!("y{i}"));
    }
    assert_eq!(
        cancel_r1(&mut h),
        vec![SessionEvent::CancelRejected {
            run_id: "r1".into(),
            error: CancelError::UnknownRun
        }],
        "forgotten once 4,096 newer runs finished"
    );
}

#[test]
fn commands_outside_the_admitted_set_fail_before_any_lookup() {
    let mut h = H::ready();
    h.rx(Body::NodeCommandRequest(NodeCommandRequest {
        request_id: "c1".into(),
        r#type: 5,
        adapter: "does-not-matter".into(),
        ..Default::default()
    }));
    assert!(h.events().is_empty(), "never reaches the shell");
    assert!(
        matches!(h.tx().as_slice(), [Body::NodeCommandResponse(r)] if !r.ok && r.request_id == "c1")
    );
    h.rx(Body::NodeCommandRequest(NodeCommandRequest {
        request_id: "c2".into(),
        r#type: NodeCommandType::Capabilities as i32,
        ..Default::default()
    }));
    assert!(matches!(
        h.events().as_slice(),
        [SessionEvent::Command { .. }]
    ));
    let t = h.t();
    h.s.handle_command_response(
        t,
        NodeCommandResponse {
            request_id: "c2".into(),
            ok: true,
            ..Default::default()
        },
    )
    .expect("pending");
    assert!(matches!(h.tx().as_slice(), [Body::NodeCommandResponse(r)] if r.ok));
}

#[test]
fn losing_the_connection_abandons_in_flight_work_explicitly() {
    let mut h = H::ready();
    h.run("r1", "a", false);
    h.events();
    let t = h.t();
    h.s.handle_connection_lost(t, Failure::Reset)
        .expect("a live session");
    assert_eq!(
        h.drain(),
        vec![NodeTransmit::Close {
            end: SessionEnd::ConnectionLost(Failure::Reset),
            abandoned: vec!["r1".into()]
        }]
    );
    assert!(h.events().is_empty());
    assert!(h.s.handle_run_output(t, "r1", RunOutput::Start).is_err());
}

#[test]
fn work_before_ready_is_a_protocol_violation() {
    let mut h = H::new();
    h.s.handle_connected(h.t()).expect("connecting");
    h.run("r1", "a", false);
    assert!(matches!(h.s.end(), Some(SessionEnd::ProtocolViolation(_))));
}

/// The frames of tunnel `t1` a whole response makes when its outputs reach the session
/// before the shell drains it: the head, a body of `body_len` bytes, usage, the end.
fn whole_response(merged: bool, body_len: usize) -> Vec<ProviderTunnelFrame> {
    let mut h = H::ready_merging(merged, |c| c.chunk_size = 8);
    h.tunnel("t1", "a");
    h.events();
    let t = h.t();
    let body = Bytes::from(vec![b'x'; body_len]);
    for output in [
        TunnelOutput::Status {
            status: 200,
            headers: vec![Header {
                name: "content-type".into(),
                value: Bytes::from_static(b"application/json"),
            }],
        },
        TunnelOutput::Body(body),
        TunnelOutput::Usage(Usage {
            prompt_tokens: 3,
            completion_tokens: 4,
            total_tokens: 7,
        }),
        TunnelOutput::End,
    ] {
        h.s.handle_tunnel_output(t, "t1", output).expect("in order");
    }
    h.tx()
        .into_iter()
        .filter_map(|b| match b {
            Body::ProviderTunnelFrame(f) => Some(f),
            _ => None,
        })
        .collect()
}

#[test]
fn a_whole_response_leaves_as_one_frame_only_for_an_edge_that_takes_merged_frames() {
    let separate = whole_response(false, 5);
    assert_eq!(separate.len(), 4, "an older Edge gets one frame per part");
    let merged = whole_response(true, 5);
    assert_eq!(merged.len(), 1, "{merged:?}");
    assert_eq!(merged[0].kind, TunnelFrameKind::Status as i32);
    assert!(merged[0].end && merged[0].usage.is_some() && merged[0].body.len() == 5);
    // What the Edge reads from it is exactly the separate frames.
    let parts: Vec<_> = merged.into_iter().flat_map(tunnel::split).collect();
    assert_eq!(parts, separate);
    // A body of several chunks: the head takes the first, the last takes usage and end.
    let separate = whole_response(false, 20);
    let merged = whole_response(true, 20);
    assert_eq!((separate.len(), merged.len()), (6, 3), "{merged:?}");
    let parts: Vec<_> = merged.into_iter().flat_map(tunnel::split).collect();
    assert_eq!(parts, separate);
    let mut rx = TunnelReceiver::new();
    for part in &parts {
        rx.observe(part).expect("valid part");
    }
    assert!(rx.is_ended());
}

/// Outputs handed to the session together (what an adapter ends with) are taken exactly
/// as one by one: the same frames, the same step, the same first refusal.
#[test]
fn outputs_given_together_are_taken_as_given_one_by_one() {
    let status = || TunnelOutput::Status {
        status: 200,
        headers: Vec::new(),
    };
    let body = |n: usize| TunnelOutput::Body(Bytes::from(vec![b'x'; n]));
    let usage = || TunnelOutput::Usage(Usage::default());
    let error = || TunnelOutput::Error(ErrorDetail::default());
    let cases: Vec<Vec<TunnelOutput>> = vec![
        vec![status(), body(20), usage(), TunnelOutput::End],
        vec![body(3), usage(), TunnelOutput::End],
        vec![status(), body(0), TunnelOutput::End],
        vec![body(4)],
        vec![status(), TunnelOutput::End, usage()],
        vec![status(), status(), body(1)],
        vec![error(), TunnelOutput::End],
        vec![TunnelOutput::Trailers(Vec::new()), TunnelOutput::End],
        vec![],
    ];
    for merged in [false, true] {
        for case in &cases {
            let replay = || case.iter().map(|o| format!("{o:?}")).collect::<Vec<_>>();
            let start = |h: &mut H| {
                h.tunnel("t1", "a");
                h.events();
            };
            let mut one = H::ready_merging(merged, |c| c.chunk_size = 8);
            start(&mut one);
            let t = one.t();
            let mut by_one = Ok(WorkStep::Going);
            for output in case.iter().cloned() {
                by_one = one.s.handle_tunnel_output(t, "t1", output);
                if by_one.is_err() {
                    break;
                }
            }
            let mut all = H::ready_merging(merged, |c| c.chunk_size = 8);
            start(&mut all);
            let t = all.t();
            let together = all.s.handle_tunnel_outputs(t, "t1", case.iter().cloned());
            assert_eq!(together, by_one, "{:?}", replay());
            assert_eq!(all.tx(), one.tx(), "{:?}", replay());
            assert_eq!(all.s.in_flight(), one.s.in_flight(), "{:?}", replay());
        }
    }
}

#[test]
fn work_whose_adapter_returned_without_a_terminal_ends_with_an_error() {
    let mut h = H::ready();
    h.run("r1", "a", false);
    h.tunnel("t1", "a");
    h.events();
    let t = h.t();
    assert_eq!(h.s.handle_work_returned(t, "r1"), Ok(Returned::Unfinished));
    assert_eq!(h.s.handle_work_returned(t, "t1"), Ok(Returned::Unfinished));
    assert_eq!(
        h.s.handle_work_returned(t, "r1"),
        Ok(Returned::Done),
        "already ended: nothing to do"
    );
    let mut run = RunTracker::new();
    let mut tunnel = TunnelReceiver::new();
    let mut terminals = 0;
    for body in h.tx() {
        match body {
            Body::RunEvent(e) => {
                terminals += usize::from(e.r#type() == RunEventType::Error);
                run.observe(&e).expect("valid run");
            }
            Body::ProviderTunnelFrame(f) => {
                tunnel.observe(&f).expect("valid tunnel");
            }
            _ => {}
        }
    }
    assert!(run.is_ended() && tunnel.is_ended());
    assert_eq!(terminals, 1, "the second return sent nothing");
    assert_eq!(
        h.s.gate("a").map(CapacityGate::in_flight),
        Some(0),
        "capacity returned"
    );
}

#[test]
fn shutdown_cancels_work_refuses_new_work_and_closes_once_the_last_run_ended() {
    let mut h = H::ready();
    h.run("r1", "a", false);
    h.events();
    h.tx();
    let t = h.t();
    h.s.handle_shutdown(t).expect("a live session");
    assert_eq!(
        h.events(),
        vec![SessionEvent::CancelRun {
            run_id: "r1".into()
        }]
    );
    assert_eq!(h.s.state(), SessionState::Ready, "still draining");
    h.run("r2", "a", false);
    assert!(matches!(
        h.events().as_slice(),
        [SessionEvent::WorkRefused { run_id, reason: WorkRefusal::ShuttingDown }] if run_id == "r2"
    ));
    h.s.handle_run_output(t, "r1", RunOutput::Start)
        .expect("in flight");
    h.s.handle_run_output(t, "r1", RunOutput::Cancelled)
        .expect("in flight");
    let out = h.drain();
    // r2's refusal, r1's terminal, and only then the close: nothing is cut short.
    let last = out.last().expect("something sent");
    assert_eq!(
        *last,
        NodeTransmit::Close {
            end: SessionEnd::LocalShutdown,
            abandoned: vec![]
        }
    );
    let cancelled = out.iter().any(|t| {
        matches!(t, NodeTransmit::Frame(e) if matches!(&e.body,
            Some(Body::RunEvent(r)) if r.run_id == "r1" && r.r#type() == RunEventType::Cancelled))
    });
    assert!(cancelled, "the terminal went out before the close: {out:?}");
}

#[test]
fn shutdown_gives_up_on_work_that_outlives_the_grace() {
    let grace = Duration::from_millis(700);
    let mut h = H::ready_with(|cfg| cfg.shutdown_grace = grace);
    h.run("r1", "a", false);
    h.events();
    h.tx();
    let t = h.t();
    h.s.handle_shutdown(t).expect("a live session");
    h.s.handle_shutdown(t)
        .expect("a second call changes nothing");
    h.at((t + grace).as_millis() - 1);
    assert_eq!(h.s.state(), SessionState::Ready, "still draining");
    h.at((t + grace).as_millis());
    assert_eq!(
        h.drain().last(),
        Some(&NodeTransmit::Close {
            end: SessionEnd::LocalShutdown,
            abandoned: vec!["r1".into()]
        })
    );
}

#[test]
fn shutdown_without_work_closes_at_once() {
    let mut h = H::ready();
    let t = h.t();
    h.s.handle_shutdown(t).expect("a live session");
    assert_eq!(
        h.drain(),
        vec![NodeTransmit::Close {
            end: SessionEnd::LocalShutdown,
            abandoned: vec![]
        }]
    );
}

/// The `NodeDrainRequest`s among what the session sent.
fn drain_requests(tx: &[Body]) -> usize {
    tx.iter()
        .filter(|b| matches!(b, Body::NodeDrainRequest(_)))
        .count()
}

#[test]
fn a_graceful_stop_asks_the_edge_to_drain_and_serves_work_in_flight_to_its_end() {
    let mut h = H::ready();
    h.run("r1", "a", false);
    h.events();
    h.tx();
    let t = h.t();
    h.s.handle_drain(t).expect("a live session");
    h.s.handle_drain(t).expect("a second call changes nothing");
    assert!(h.s.is_draining());
    let tx = h.tx();
    assert_eq!(drain_requests(&tx), 1, "asked once: {tx:?}");
    assert!(h.events().is_empty(), "nothing is cancelled");
    // Work the Edge dispatched before it read the request is still served.
    h.tunnel("t1", "a");
    assert!(matches!(
        h.events().as_slice(),
        [SessionEvent::StartTunnel { .. }]
    ));
    for (id, output, step) in [
        ("r1", RunOutput::Start, WorkStep::Going),
        (
            "r1",
            RunOutput::Complete {
                usage: None,
                metadata: BTreeMap::new(),
            },
            WorkStep::Ended,
        ),
    ] {
        assert_eq!(h.s.handle_run_output(t, id, output), Ok(step));
    }
    h.s.handle_work_returned(t, "t1").expect("in flight");
    assert_eq!(
        h.s.state(),
        SessionState::Ready,
        "the Edge closes, not the node"
    );
    // Heartbeats go on meanwhile.
    h.at((t + Duration::from_secs(2)).as_millis());
    assert!(h.tx().iter().any(|b| matches!(b, Body::Heartbeat(_))));
    // The Edge closes the drained connection: a local shutdown, nothing abandoned.
    let t = h.t();
    h.s.handle_connection_lost(t, Failure::EdgeClosed("drained".into()))
        .expect("a live session");
    assert_eq!(
        h.drain().last(),
        Some(&NodeTransmit::Close {
            end: SessionEnd::LocalShutdown,
            abandoned: vec![]
        })
    );
    assert_eq!(
        h.s.end().and_then(SessionEnd::failure),
        None,
        "not redialled"
    );
}

#[test]
fn a_graceful_stop_cancels_what_outlives_its_grace_and_a_shutdown_cuts_it_short() {
    let grace = Duration::from_millis(900);
    for cut_short in [false, true] {
        let mut h = H::ready_with(|cfg| cfg.drain_grace = grace);
        h.run("r1", "a", false);
        h.events();
        h.tx();
        let t = h.t();
        h.s.handle_drain(t).expect("a live session");
        if cut_short {
            h.s.handle_shutdown(t).expect("a live session");
        } else {
            h.at((t + grace).as_millis() - 1);
            assert!(h.events().is_empty(), "still draining");
            h.at((t + grace).as_millis());
        }
        assert!(!h.s.is_draining());
        assert_eq!(
            h.events(),
            vec![SessionEvent::CancelRun {
                run_id: "r1".into()
            }],
            "cut short: {cut_short}"
        );
        let t = h.t();
        h.s.handle_run_output(t, "r1", RunOutput::Start)
            .expect("in flight");
        h.s.handle_run_output(t, "r1", RunOutput::Cancelled)
            .expect("in flight");
        assert_eq!(
            h.drain().last(),
            Some(&NodeTransmit::Close {
                end: SessionEnd::LocalShutdown,
                abandoned: vec![]
            })
        );
    }
}

#[test]
fn a_graceful_stop_before_ready_closes_at_once_and_a_lost_edge_ends_it_as_a_shutdown() {
    let mut h = H::new();
    h.s.handle_connected(h.t()).expect("connecting");
    let t = h.t();
    h.s.handle_drain(t).expect("a live session");
    let out = h.drain();
    assert_eq!(
        out.last(),
        Some(&NodeTransmit::Close {
            end: SessionEnd::LocalShutdown,
            abandoned: vec![]
        })
    );
    assert!(
        !out.iter().any(|t| matches!(t, NodeTransmit::Frame(e) if matches!(e.body, Some(Body::NodeDrainRequest(_))))),
        "nothing to drain before ready"
    );

    // An Edge that goes away mid-drain (it crashed): the work is abandoned, and the
    // node still stops rather than redials.
    let mut h = H::ready();
    h.run("r1", "a", false);
    h.events();
    let t = h.t();
    h.s.handle_drain(t).expect("a live session");
    h.s.handle_connection_lost(t, Failure::Reset)
        .expect("a live session");
    assert_eq!(
        h.drain().last(),
        Some(&NodeTransmit::Close {
            end: SessionEnd::LocalShutdown,
            abandoned: vec!["r1".into()]
        })
    );
}

#[test]
fn undecodable_bytes_from_the_edge_end_the_session_as_a_violation() {
    let mut h = H::ready();
    let t = h.t();
    let error = DecodeError::FrameTooLarge {
        len: 1 << 40,
        max: 1 << 20,
    };
    h.s.handle_undecodable(t, error.clone())
        .expect("a live session");
    assert!(matches!(
        h.events().as_slice(),
        [SessionEvent::PeerViolation { violation: EdgeViolation::Undecodable(e) }] if *e == error
    ));
    assert!(matches!(
        h.drain().as_slice(),
        [NodeTransmit::Close {
            end: SessionEnd::ProtocolViolation(EdgeViolation::Undecodable(_)),
            ..
        }]
    ));
    assert!(
        h.s.handle_undecodable(t, error).is_err(),
        "a closed session takes no input"
    );
}

#[test]
fn a_large_frame_in_transit_keeps_the_edge_alive() {
    let mut h = H::ready();
    // Heartbeats every second, lost after three: bytes of one big frame arrive every
    // second for ten, and no frame completes.
    for ms in (1000..=10_000).step_by(1000) {
        h.now = ms;
        let t = h.t();
        h.s.handle_bytes_received(t).expect("a live session");
        h.at(ms + 500);
        assert_eq!(h.s.state(), SessionState::Ready, "alive at {ms} ms");
    }
    h.at(13_000);
    assert_eq!(h.s.end(), Some(&SessionEnd::HeartbeatTimeout));
    assert!(
        h.s.handle_bytes_received(h.t()).is_err(),
        "a closed session takes no input"
    );
}

fn cluster_members(edges: &[&str]) -> ClusterMembers {
    ClusterMembers {
        edge_id: edges[0].into(),
        members: edges
            .iter()
            .map(|e| ClusterEdge {
                edge_id: (*e).into(),
                node_addr: format!("{e}:7100"),
            })
            .collect(),
    }
}

/// A node that follows a cluster asks for the members, hears them in the register answer
/// and on every change; one that does not ask never gets them.
#[test]
fn a_node_following_a_cluster_hears_its_members() {
    let mut h = H::with(|c| c.cluster = true);
    h.s.handle_connected(h.t()).expect("connecting");
    let tx = h.tx();
    assert!(matches!(tx.as_slice(), [Body::RegisterRequest(r)] if r.cluster));
    h.rx(Body::RegisterResponse(RegisterResponse {
        accepted: true,
        node_id: "n1".into(),
        config: Some(payload(1, vec![adapter("a", AdapterType::Mock, 2, 1)])),
        heartbeat_interval_ms: 1000,
        cluster: Some(cluster_members(&["a", "b"])),
        ..Default::default()
    }));
    let events = h.events();
    assert!(
        events.contains(&SessionEvent::Members(cluster_members(&["a", "b"]))),
        "{events:?}"
    );
    h.rx(Body::ClusterMembers(cluster_members(&["a", "b", "c"])));
    assert_eq!(
        h.events(),
        [SessionEvent::Members(cluster_members(&["a", "b", "c"]))]
    );

    // Not asked: members in an answer are ignored, and a members message breaks the
    // contract.
    let mut h = H::new();
    h.s.handle_connected(h.t()).expect("connecting");
    let tx = h.tx();
    assert!(matches!(tx.as_slice(), [Body::RegisterRequest(r)] if !r.cluster));
    h.rx(Body::RegisterResponse(RegisterResponse {
        accepted: true,
        node_id: "n1".into(),
        config: Some(payload(1, vec![adapter("a", AdapterType::Mock, 2, 1)])),
        heartbeat_interval_ms: 1000,
        cluster: Some(cluster_members(&["a"])),
        ..Default::default()
    }));
    assert!(
        !h.events()
            .iter()
            .any(|e| matches!(e, SessionEvent::Members(_)))
    );
    h.rx(Body::ClusterMembers(cluster_members(&["a"])));
    assert!(
        h.events()
            .iter()
            .any(|e| matches!(e, SessionEvent::PeerViolation { .. })),
        "an unasked members message is a violation"
    );
}
