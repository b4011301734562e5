//! The binaries start, answer `--version` and `--help`, and refuse unknown flags.

use std::process::Command;

use iop_blackbox::binary;

#[test]
fn binaries_report_their_version() {
    for name in ["iop-edge", "iop-node"] {
        let out = Command::new(binary(name))
            .arg("--version")
            .output()
            .expect("runs");
        assert!(out.status.success(), "{name} --version failed");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.starts_with(&format!("{name} {}", env!("CARGO_PKG_VERSION"))),
            "{stdout}"
        );
    }
}

#[test]
fn binaries_reject_unknown_flags() {
    for name in ["iop-edge", "iop-node"] {
        let out = Command::new(binary(name))
            .arg("--no-such-flag")
            .output()
            .expect("runs");
        assert_eq!(
            out.status.code(),
            Some(2),
            "{name} accepted an unknown flag"
        );
    }
}
