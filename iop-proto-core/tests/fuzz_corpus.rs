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

#[test]
fn frame_decoder_corpus_replays() {
    for (path, data) in corpus("frame_decoder") {
        let result =
            std::panic::catch_unwind(|| iop_proto_core::testkit::fuzz::frame_decoder(&data));
        assert!(result.is_ok(), "corpus input {} fails", path.display());
    }
}

#[test]
fn edge_core_corpus_replays() {
    for (path, data) in corpus("edge_core") {
        let result = std::panic::catch_unwind(|| iop_proto_core::testkit::fuzz::edge_core(&data));
        assert!(result.is_ok(), "corpus input {} fails", path.display());
    }
}

#[test]
fn node_session_corpus_replays() {
    for (path, data) in corpus("node_session") {
        let result =
            std::panic::catch_unwind(|| iop_proto_core::testkit::fuzz::node_session(&data));
        assert!(result.is_ok(), "corpus input {} fails", path.display());
    }
}

#[test]
fn tunnel_receiver_corpus_replays() {
    for (path, data) in corpus("tunnel_receiver") {
        let result =
            std::panic::catch_unwind(|| iop_proto_core::testkit::fuzz::tunnel_receiver(&data));
        assert!(result.is_ok(), "corpus input {} fails", path.display());
    }
}

#[test]
fn lease_queue_corpus_replays() {
    for (path, data) in corpus("lease_queue") {
        let result = std::panic::catch_unwind(|| iop_proto_core::testkit::fuzz::lease_queue(&data));
        assert!(result.is_ok(), "corpus input {} fails", path.display());
    }
}

#[test]
fn openai_request_corpus_replays() {
    for (path, data) in corpus("openai_request") {
        let result =
            std::panic::catch_unwind(|| iop_proto_core::testkit::fuzz::openai_request(&data));
        assert!(result.is_ok(), "corpus input {} fails", path.display());
    }
}
