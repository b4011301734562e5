//! Generates the wire types from `proto/iop/runtime.proto` with protox (pure Rust, no
//! system `protoc`) and prost-build. The output lands in `OUT_DIR` and is never committed.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?)
        .parent()
        .ok_or("iop-proto-core must live inside the workspace")?
        .join("proto");
    let schema = root.join("iop/runtime.proto");
    println!("cargo:rerun-if-changed={}", schema.display());

    let descriptors = protox::compile([&schema], [&root])?;
    prost_build::Config::new()
        // Every `bytes` field becomes `bytes::Bytes`, so decoding slices the input buffer.
        .bytes(["."])
        // BTreeMap keeps map fields in a deterministic order (golden transcripts, fuzzing).
        .btree_map(["."])
        .compile_fds(descriptors)?;
    Ok(())
}
