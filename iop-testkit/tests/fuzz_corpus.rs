//! Replays the committed cargo-fuzz corpora (`fuzz/corpus/<target>/`) through the same
//! entry points the fuzz targets call, so every kept input runs under plain `cargo test`.

use std::path::PathBuf;

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut inputs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|err| panic!("corpus {} unreadable: {err}", dir.display()))
        .map(|entry| {
            let path = entry.expect("corpus entry").path();
            let data = std::fs::read(&path).expect("corpus file");
            (path, data)
        })
        .collect();
    inputs.sort();
    assert!(!inputs.is_empty(), "corpus {} is empty", dir.display());
    inputs
}

/// Runs every input of `target`'s corpus through `run`, naming the one that fails.
fn replay(target: &str, run: fn(&[u8])) {
    for (path, data) in corpus(target) {
        let result = std::panic::catch_unwind(|| run(&data));
        assert!(result.is_ok(), "corpus input {} fails", path.display());
    }
}

#[test]
fn frame_decoder_corpus_replays() {
    replay("frame_decoder", iop_testkit::fuzz::frame_decoder);
}

#[test]
fn edge_core_corpus_replays() {
    replay("edge_core", iop_testkit::fuzz::edge_core);
}

#[test]
fn node_session_corpus_replays() {
    replay("node_session", iop_testkit::fuzz::node_session);
}

#[test]
fn tunnel_receiver_corpus_replays() {
    replay("tunnel_receiver", iop_testkit::fuzz::tunnel_receiver);
}

#[test]
fn lease_queue_corpus_replays() {
    replay("lease_queue", iop_testkit::fuzz::lease_queue);
}

#[test]
fn openai_request_corpus_replays() {
    replay("openai_request", iop_testkit::fuzz::openai_request);
}

#[test]
fn messages_render_corpus_replays() {
    replay("messages_render", iop_testkit::fuzz::messages_render);
}

#[test]
fn http1_request_corpus_replays() {
    replay("http1_request", iop_testkit::fuzz::http1_request);
}

#[test]
fn http1_response_corpus_replays() {
    replay("http1_response", iop_testkit::fuzz::http1_response);
}
