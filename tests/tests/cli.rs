//! The binaries start, answer `--version` and `--help`, and refuse unknown flags; a
//! Node asks Linux for the scheduling policy its config names.

use std::process::Command;

use iop_blackbox::binary;
use iop_blackbox::client::{Cluster, Link};
use iop_blackbox::procfs;

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

#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_node_runs_under_sched_batch_unless_told_to_inherit() {
    let mock = |id: &str| {
        format!(
            "[[nodes]]\nid = \"{id}\"\ntoken = \"tok-{id}-long-enough-secret\"\n\
             [[nodes.adapters]]\nname = \"mock\"\ntype = \"mock\"\ncapacity = 1\ntargets = [\"m\"]\n"
        )
    };
    let body = format!(
        "{}{}[[models]]\nname = \"m\"\nproviders = [{{ node = \"n1\", adapter = \"mock\", target = \"m\" }}]\n",
        mock("n1"),
        mock("n2")
    );
    let cluster = Cluster::start_with(Link::Plaintext, "", &body);
    let reconnect = "max_attempts = 0\ninterval_sec = 0.2";
    let batch = cluster.node("n1", "tok-n1-long-enough-secret");
    let inherit = cluster.node_extra(
        "n2",
        "tok-n2-long-enough-secret",
        reconnect,
        "[runtime]\nscheduler = \"inherit\"",
    );
    cluster.wait_ready("n1").await;
    cluster.wait_ready("n2").await;
    // The test runs under the policy it was started with; a node that inherits keeps it.
    let started = procfs::policy(std::process::id()).expect("own stat");
    assert_eq!(procfs::policy(inherit.pid()), Some(started));
    if started == 0 {
        assert_eq!(procfs::policy(batch.pid()), Some(3), "{}", batch.log());
        // Log lines reach the file a few milliseconds after they are written.
        assert!(
            iop_blackbox::wait_until(std::time::Duration::from_secs(5), || {
                batch.log().contains("scheduling policy set")
            }),
            "{}",
            batch.log()
        );
    } else {
        // Started under `chrt`: the operator's choice stays.
        assert_eq!(procfs::policy(batch.pid()), Some(started));
    }
}
