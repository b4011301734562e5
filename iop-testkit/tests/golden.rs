//! A golden transcript of the register → configure → ready → run → cancel → reconnect
//! exchange between the real Edge machine and the real Node session, so a change to the
//! handshake shows up in review as a diff of `tests/golden/handshake.txt`.
//! Regenerate with `IOP_BLESS=1 cargo test -p iop-testkit --test golden`.

use std::collections::BTreeMap;
use std::time::Duration;

use iop_proto_core::wire;
use iop_proto_core::*;
use iop_testkit::harness::{Netem, Pair};
use iop_testkit::sim::world_config;

fn session() -> NodeSession {
    let mut config = SessionConfig::new("n0", "sim-token");
    config.version = "golden".into();
    config.adapter_types = vec!["mock".into(), "openai_compat".into()];
    config.instance_id = 7;
    NodeSession::new(config)
}

/// The caller's request: the Edge builds its dispatch from it.
fn call() -> Submit {
    let mut submit = Submit::chat(
        "m0",
        bytes::Bytes::from_static(br#"{"messages":[{"role":"user","content":"hi"}]}"#),
    );
    submit.prompt_tokens = 5;
    submit.request_id = "req-golden".into();
    submit
}

#[test]
fn handshake_transcript_matches_the_golden_file() {
    let mut config = world_config(0);
    config.timing.heartbeat_interval = Duration::from_secs(60);
    config.timing.heartbeat_timeout = Duration::from_secs(180);
    let mut pair = Pair::new(
        EdgeCore::new(config).expect("valid"),
        session(),
        Netem::instant(),
    );
    // register -> configure -> ready
    pair.connect(ConnId(1), session());
    pair.step();
    // a run to completion
    pair.at(10);
    pair.edge.handle_submit(pair.now, call()).expect("accepted");
    pair.step();
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
    pair.step();
    // a run cancelled by its caller
    pair.at(20);
    let r2 = pair.edge.handle_submit(pair.now, call()).expect("accepted");
    pair.step();
    pair.node
        .handle_run_output(pair.now, "run-2", RunOutput::Start)
        .expect("run");
    pair.step();
    pair.at(30);
    assert_eq!(
        pair.edge.handle_cancel(pair.now, r2, "caller disconnected"),
        Cancelled::Now
    );
    pair.step();
    // the connection drops; the node reconnects on a new connection
    pair.at(40);
    pair.disconnect();
    pair.step();
    pair.at(50);
    pair.connect(ConnId(2), session());
    pair.step();

    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/handshake.txt");
    if std::env::var_os("IOP_BLESS").is_some() {
        std::fs::write(&path, &pair.transcript).expect("write golden");
        return;
    }
    let golden = std::fs::read_to_string(&path).unwrap_or_default();
    if golden != pair.transcript {
        panic!(
            "the handshake transcript changed; review and rerun with IOP_BLESS=1 to accept.\n--- golden\n{golden}\n--- now\n{}",
            pair.transcript
        );
    }
}
