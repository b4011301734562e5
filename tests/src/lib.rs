//! Helpers for black-box tests: locating and running the workspace's binaries.

use std::path::PathBuf;

/// Path of a workspace binary (`iop-edge`, `iop-node`) built into the same target
/// directory as the running test. The test command builds the binaries first.
#[must_use]
pub fn binary(name: &str) -> PathBuf {
    let mut dir = std::env::current_exe().expect("test executable path");
    dir.pop(); // the test binary's file name
    if dir.ends_with("deps") {
        dir.pop();
    }
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} not found: build the binaries first (cargo build --bins)",
        path.display()
    );
    path
}
