//! A small harness around `EdgeCore` for scenario tests.

use std::time::Duration;

use iop_proto_core::edge_config::*;
use iop_proto_core::wire::*;
use iop_proto_core::*;

pub use iop_proto_core::testkit::Inspect;
pub use iop_proto_core::testkit::adapter;
pub use iop_proto_core::testkit::internals::*;

pub const TOKEN: &str = "tok";

pub fn node(adapters: Vec<AdapterConfig>) -> NodeSpec {
    NodeSpec {
        token: TokenVerifier::from_secret(TOKEN.as_bytes()),
        adapters,
        runtime: NodeRuntimeConfig::default(),
    }
}

pub fn candidate(node: &str, provider: &str) -> CandidateSpec {
    CandidateSpec {
        node_id: node.into(),
        provider_id: provider.into(),
        target: "t".into(),
    }
}

/// Two nodes: n1 with mock adapter "a" (capacity 2, long 1), n2 with openai_compat "b"
/// (capacity 1, long 0). Model "m" lists both; model "solo" lists only n1/a.
pub fn config() -> EdgeConfig {
    let mut cfg = EdgeConfig {
        timing: EdgeTiming {
            heartbeat_interval: Duration::from_millis(1000),
            heartbeat_timeout: Duration::from_millis(3000),
            register_timeout: Duration::from_millis(2000),
            refresh_timeout: Duration::from_millis(2000),
            cancel_grace: Duration::from_millis(5000),
        },
        queue: QueueLimits {
            max_waiting: 3,
            wait_timeout: Duration::from_millis(10_000),
        },
        ..EdgeConfig::default()
    };
    cfg.nodes.insert(
        "n1".into(),
        node(vec![adapter("a", AdapterType::Mock, 2, 1)]),
    );
    cfg.nodes.insert(
        "n2".into(),
        node(vec![adapter("b", AdapterType::OpenaiCompat, 1, 0)]),
    );
    cfg.models.insert(
        "m".into(),
        ModelSpec {
            candidates: vec![candidate("n1", "a"), candidate("n2", "b")],
            long_context_threshold: Some(1000),
            context_tokens: None,
            first_byte_timeout: None,
            resume_limit: None,
            stall_timeout: None,
            affinity: None,
        },
    );
    cfg.models.insert(
        "solo".into(),
        ModelSpec {
            candidates: vec![candidate("n1", "a")],
            long_context_threshold: Some(1000),
            context_tokens: None,
            first_byte_timeout: None,
            resume_limit: None,
            stall_timeout: None,
            affinity: None,
        },
    );
    cfg
}

pub struct Harness {
    pub edge: EdgeCore,
    pub now: Timestamp,
    next_conn: u64,
}

impl Harness {
    pub fn new() -> Self {
        Self::with(config())
    }

    pub fn with(cfg: EdgeConfig) -> Self {
        Harness {
            edge: EdgeCore::new(cfg).expect("valid config"),
            now: Timestamp::ZERO,
            next_conn: 1,
        }
    }

    pub fn at(&mut self, ms: u64) {
        self.now = Timestamp::from_millis(ms);
        self.edge.handle_timeout(self.now);
    }

    pub fn open(&mut self) -> ConnId {
        self.open_from(Peer::default())
    }

    /// Opens a connection whose transport reported `peer`.
    pub fn open_from(&mut self, peer: Peer) -> ConnId {
        let conn = ConnId(self.next_conn);
        self.next_conn += 1;
        self.edge
            .handle_connection_opened(self.now, conn, peer)
            .expect("new conn");
        conn
    }

    pub fn send(&mut self, conn: ConnId, body: Body) {
        self.edge
            .handle_envelope(self.now, conn, Envelope::new(body))
            .expect("open conn");
    }

    pub fn register(&mut self, conn: ConnId, node_id: &str) {
        self.register_with(conn, node_id, TOKEN);
    }

    pub fn register_with(&mut self, conn: ConnId, node_id: &str, token: &str) {
        self.send(
            conn,
            Body::RegisterRequest(RegisterRequest {
                node_id: node_id.into(),
                token: token.into(),
                ..Default::default()
            }),
        );
    }

    /// Registers `conn` as `node_id` from the node process `instance`.
    pub fn register_as(&mut self, conn: ConnId, node_id: &str, instance: u64) {
        self.send(
            conn,
            Body::RegisterRequest(RegisterRequest {
                node_id: node_id.into(),
                token: TOKEN.into(),
                instance_id: instance,
                ..Default::default()
            }),
        );
    }

    pub fn ready(&mut self, conn: ConnId, node_id: &str) {
        self.send(
            conn,
            Body::NodeReadyRequest(NodeReadyRequest {
                node_id: node_id.into(),
                held_elsewhere: Vec::new(),
            }),
        );
    }

    /// `conn`'s node asks to stop gracefully, saying `reason`.
    pub fn drain_request(&mut self, conn: ConnId, reason: impl Into<String>) {
        self.send(
            conn,
            Body::NodeDrainRequest(NodeDrainRequest {
                reason: reason.into(),
            }),
        );
    }

    /// Opens, registers and readies `node_id`; drains outputs.
    pub fn connect(&mut self, node_id: &str) -> ConnId {
        let conn = self.open();
        self.register(conn, node_id);
        self.ready(conn, node_id);
        self.drain();
        conn
    }

    pub fn transmits(&mut self) -> Vec<Transmit> {
        std::iter::from_fn(|| self.edge.poll_transmit()).collect()
    }

    pub fn events(&mut self) -> Vec<EdgeEvent> {
        std::iter::from_fn(|| self.edge.poll_event()).collect()
    }

    pub fn drain(&mut self) -> (Vec<Transmit>, Vec<EdgeEvent>) {
        iop_proto_core::testkit::drain_edge(&mut self.edge)
    }

    pub fn submit(&mut self, model: &str, prompt_tokens: u64) -> Result<RequestId, SubmitError> {
        let mut submit = Submit::chat(model, bytes::Bytes::from_static(b"{}"));
        submit.prompt_tokens = prompt_tokens;
        self.edge.handle_submit(self.now, submit)
    }

    /// A chat request whose caller asked for a stream: its first content is its first
    /// byte (a request that is not streamed gets its answer whole, at the terminal).
    pub fn submit_stream(&mut self, model: &str) -> Result<RequestId, SubmitError> {
        let mut submit = Submit::chat(model, bytes::Bytes::from_static(b"{}"));
        submit.prompt_tokens = 10;
        submit.stream = true;
        self.edge.handle_submit(self.now, submit)
    }

    /// A request only a tunnel-served provider can answer (embeddings, completions).
    pub fn submit_tunnel(&mut self, model: &str) -> Result<RequestId, SubmitError> {
        let mut submit = Submit::chat(model, bytes::Bytes::from_static(b"{}"));
        submit.prompt_tokens = 1;
        submit.endpoint = iop_proto_core::tunnel::Endpoint::Embeddings;
        self.edge.handle_submit(self.now, submit)
    }

    pub fn usage(&self, node: &str, provider: &str) -> LeaseUsage {
        self.edge
            .ledger()
            .usage(self.edge.resource(node, provider).expect("configured"))
    }

    /// The wire run id of a dispatched request (the machine sent its dispatch itself).
    pub fn dispatch(&mut self, grant: &Grant) -> String {
        grant.run.wire()
    }

    /// The lease a dispatched request holds.
    pub fn lease(&self, grant: &Grant) -> Lease {
        self.edge
            .ledger()
            .lease_of(grant.run)
            .expect("a dispatched run holds a lease")
    }

    pub fn run_event(&mut self, conn: ConnId, run_id: &str, kind: RunEventType, sequence: u64) {
        self.send(
            conn,
            Body::RunEvent(RunEvent {
                run_id: run_id.into(),
                sequence,
                r#type: kind as i32,
                ..Default::default()
            }),
        );
    }

    /// The node refuses `run_id` before any content, as a full capacity gate does: its
    /// start, then a retryable `refused` error.
    pub fn refuse(&mut self, conn: ConnId, run_id: &str) {
        self.run_event(conn, run_id, RunEventType::Start, 1);
        self.send(
            conn,
            Body::RunEvent(RunEvent {
                run_id: run_id.into(),
                sequence: 2,
                r#type: RunEventType::Error as i32,
                error: Some(ErrorDetail {
                    code: "refused".into(),
                    message: "adapter at capacity (2 in flight)".into(),
                    retryable: true,
                }),
                ..Default::default()
            }),
        );
    }
}

/// A request the machine dispatched, as its `Dispatched` event says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    pub request: RequestId,
    pub run: RunId,
    pub node_id: std::sync::Arc<str>,
    pub provider_id: std::sync::Arc<str>,
    pub shape: DispatchShape,
}

/// The dispatches the machine made (each run it sent).
pub fn grants(events: &[EdgeEvent]) -> Vec<Grant> {
    events
        .iter()
        .filter_map(|e| match e {
            EdgeEvent::Attempt {
                run,
                shape,
                node_id,
                provider_id,
            } => Some(Grant {
                request: run.request,
                run: *run,
                node_id: node_id.clone(),
                provider_id: provider_id.clone(),
                shape: *shape,
            }),
            _ => None,
        })
        .collect()
}

pub fn ended(events: &[EdgeEvent]) -> Vec<(RequestId, Outcome)> {
    events
        .iter()
        .filter_map(|e| match e {
            EdgeEvent::Request {
                request,
                event: RequestEvent::Ended(outcome),
            } => Some((*request, outcome.clone())),
            _ => None,
        })
        .collect()
}

pub fn frames_to(transmits: &[Transmit], conn: ConnId) -> Vec<Body> {
    transmits
        .iter()
        .filter_map(|t| match t.frame() {
            Some((c, envelope)) if c == conn => envelope.body,
            _ => None,
        })
        .collect()
}

/// `Some(ready)` when the only frame sent to `conn` is a `NodeReadyResponse`.
pub fn only_ready_answer(transmits: &[Transmit], conn: ConnId) -> Option<bool> {
    match frames_to(transmits, conn).as_slice() {
        [Body::NodeReadyResponse(response)] => Some(response.ready),
        _ => None,
    }
}

pub fn closed(transmits: &[Transmit]) -> Vec<(ConnId, CloseReason)> {
    transmits
        .iter()
        .filter_map(|t| match t {
            Transmit::Close { conn, reason } => Some((*conn, reason.clone())),
            _ => None,
        })
        .collect()
}
