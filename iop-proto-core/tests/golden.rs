//! A golden transcript of the register → configure → ready → run → cancel → reconnect
//! exchange between the real Edge machine and the real Node session, so a change to the
//! handshake shows up in review as a diff of `tests/golden/handshake.txt`.
//! Regenerate with `IOP_BLESS=1 cargo test -p iop-proto-core --test golden`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use bytes::BytesMut;
use iop_proto_core::testkit::sim::world_config;
use iop_proto_core::wire::{self, Body, Envelope, FrameDecoder, RunRequest};
use iop_proto_core::*;

struct Pair {
    edge: EdgeCore,
    node: NodeSession,
    conn: ConnId,
    now: Timestamp,
    out: String,
}

fn line(body: &Body) -> String {
    // Debug output of prost messages is deterministic (maps are BTreeMaps).
    format!("{body:?}")
}

impl Pair {
    fn connect(&mut self, conn: ConnId) {
        self.conn = conn;
        let mut config = SessionConfig::new("n0", "sim-token");
        config.version = "golden".into();
        config.adapter_types = vec!["mock".into(), "openai_compat".into()];
        self.node = NodeSession::new(config);
        self.edge
            .handle_connection_opened(self.now, conn, iop_proto_core::Peer::default())
            .expect("new conn");
        self.node.handle_connected(self.now).expect("connecting");
        let _ = writeln!(self.out, "{} -- connection {} opened", self.now, conn.0);
    }

    /// Delivers frames both ways (through the real codec) until nothing moves, answering
    /// the node's shell events the way the node binary does.
    fn settle(&mut self) {
        loop {
            let mut moved = false;
            while let Some(envelope) = self.node.poll_transmit() {
                moved = true;
                let envelope = roundtrip(&envelope);
                let body = envelope.body.clone().expect("body");
                let _ = writeln!(self.out, "{} node -> edge {}", self.now, line(&body));
                self.edge
                    .handle_envelope(self.now, self.conn, envelope)
                    .expect("open");
            }
            while let Some(transmit) = self.edge.poll_transmit() {
                moved = true;
                match transmit {
                    Transmit::Frame { envelope, .. } => {
                        let envelope = roundtrip(&envelope);
                        let body = envelope.body.clone().expect("body");
                        let _ = writeln!(self.out, "{} edge -> node {}", self.now, line(&body));
                        self.node.handle_envelope(self.now, envelope);
                    }
                    Transmit::Close { conn, reason } => {
                        let _ = writeln!(
                            self.out,
                            "{} -- edge closes connection {} ({reason:?})",
                            self.now, conn.0
                        );
                    }
                    Transmit::FrameLimit {
                        conn,
                        max_frame_len,
                    } => {
                        let _ = writeln!(
                            self.out,
                            "{} -- edge accepts frames up to {max_frame_len} bytes on connection {}",
                            self.now, conn.0
                        );
                    }
                }
            }
            while let Some(event) = self.node.poll_event() {
                moved = true;
                let _ = writeln!(self.out, "{} node event {}", self.now, short(&event));
                match event {
                    SessionEvent::ApplyConfig { .. } => {
                        self.node
                            .handle_config_applied(self.now, Ok(()))
                            .expect("configuring");
                    }
                    SessionEvent::CancelRun { run_id } => {
                        self.node
                            .handle_run_output(self.now, &run_id, RunOutput::Cancelled)
                            .expect("running");
                    }
                    _ => {}
                }
            }
            while let Some(event) = self.edge.poll_event() {
                moved = true;
                let _ = writeln!(self.out, "{} edge event {}", self.now, short_edge(&event));
                if let EdgeEvent::Granted(grant) = event {
                    let input = bytes::Bytes::from_static(
                        br#"{"messages":[{"role":"user","content":"hi"}]}"#,
                    );
                    self.edge
                        .handle_dispatch(
                            self.now,
                            grant.request,
                            Dispatch::Run(RunRequest {
                                input,
                                ..RunRequest::default()
                            }),
                        )
                        .expect("granted");
                }
            }
            if !moved {
                return;
            }
        }
    }

    fn at(&mut self, ms: u64) {
        self.now = Timestamp::from_millis(ms);
    }
}

fn roundtrip(envelope: &Envelope) -> Envelope {
    let mut out = BytesMut::new();
    wire::encode(envelope, &mut out).expect("encodes");
    let mut decoder = FrameDecoder::new();
    decoder.push_bytes(out.freeze());
    decoder.next_envelope().expect("decodes").expect("whole")
}

fn short(event: &SessionEvent) -> String {
    match event {
        SessionEvent::ApplyConfig { payload } => format!(
            "ApplyConfig(revision {}, {} adapters)",
            payload.revision,
            payload.adapters.len()
        ),
        SessionEvent::StartRun { request } => {
            format!("StartRun({} on {})", request.run_id, request.adapter)
        }
        other => format!("{other:?}"),
    }
}

fn short_edge(event: &EdgeEvent) -> String {
    match event {
        EdgeEvent::Granted(g) => format!(
            "Granted({} on {}/{} generation {}, {:?})",
            g.request, g.node_id, g.provider_id, g.lease.generation.0, g.shape
        ),
        other => format!("{other:?}"),
    }
}

#[test]
fn handshake_transcript_matches_the_golden_file() {
    let mut config = world_config(0);
    config.timing.heartbeat_interval = Duration::from_secs(60);
    config.timing.heartbeat_timeout = Duration::from_secs(180);
    let mut pair = Pair {
        edge: EdgeCore::new(config).expect("valid"),
        node: NodeSession::new(SessionConfig::new("n0", "sim-token")),
        conn: ConnId(0),
        now: Timestamp::ZERO,
        out: String::new(),
    };
    // register -> configure -> ready
    pair.connect(ConnId(1));
    pair.settle();
    // a run to completion
    pair.at(10);
    pair.edge
        .handle_submit(
            pair.now,
            Submit {
                model: "m0",
                prompt_tokens: 5,
                tunnel_only: false,
            },
        )
        .expect("accepted");
    pair.settle();
    let t = pair.now;
    pair.node
        .handle_run_output(t, "run-1", RunOutput::Start)
        .expect("run");
    pair.node
        .handle_run_output(t, "run-1", RunOutput::Delta("Hello".into()))
        .expect("run");
    let metadata: BTreeMap<String, String> = BTreeMap::new();
    pair.node
        .handle_run_output(
            t,
            "run-1",
            RunOutput::Complete {
                usage: Some(wire::Usage {
                    prompt_tokens: 5,
                    completion_tokens: 1,
                    total_tokens: 6,
                }),
                metadata,
            },
        )
        .expect("run");
    pair.settle();
    // a run cancelled by its caller
    pair.at(20);
    let r2 = pair
        .edge
        .handle_submit(
            pair.now,
            Submit {
                model: "m0",
                prompt_tokens: 5,
                tunnel_only: false,
            },
        )
        .expect("accepted");
    pair.settle();
    pair.node
        .handle_run_output(pair.now, "run-2", RunOutput::Start)
        .expect("run");
    pair.settle();
    pair.at(30);
    assert!(
        pair.edge
            .handle_cancel(pair.now, r2, "caller disconnected")
            .is_ok()
    );
    pair.settle();
    // the connection drops; the node reconnects on a new connection
    pair.at(40);
    let _ = writeln!(pair.out, "{} -- connection 1 lost", pair.now);
    pair.edge
        .handle_connection_closed(pair.now, ConnId(1))
        .expect("open");
    pair.node.handle_connection_lost(pair.now, Failure::Reset);
    pair.settle();
    pair.at(50);
    pair.connect(ConnId(2));
    pair.settle();

    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/handshake.txt");
    if std::env::var_os("IOP_BLESS").is_some() {
        std::fs::write(&path, &pair.out).expect("write golden");
        return;
    }
    let golden = std::fs::read_to_string(&path).unwrap_or_default();
    if golden != pair.out {
        panic!(
            "the handshake transcript changed; review and rerun with IOP_BLESS=1 to accept.\n--- golden\n{golden}\n--- now\n{}",
            pair.out
        );
    }
}
