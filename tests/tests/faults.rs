//! Faults through the real binaries: node crash, freeze, Edge restart, bad credentials,
//! exhaustion, signals, config reload and hostile raw TCP clients.
//!
//! One file on purpose, past the 800-line norm: each file under `tests/` is a test binary
//! of its own, linked against the whole dependency graph, and on a 2-core CI machine every
//! extra binary costs a link; this suite covers one subject and shares its helpers.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use iop_blackbox::client::{Cluster, next_sse, post_h2c, read_sse};
use iop_blackbox::{Proc, free_port, wait_until};
use serde_json::{Value, json};

fn body(reply: &str, delay_ms: u32) -> String {
    nodes_body(&["n1"], reply, delay_ms)
}

/// Nodes `ids` serving `chat`, each with one mock adapter (capacity 2, long 1) that
/// answers `reply` in 40 tokens `delay_ms` apart.
fn nodes_body(ids: &[&str], reply: &str, delay_ms: u32) -> String {
    let mut text = String::new();
    for id in ids {
        text.push_str(&format!(
            r#"
[[nodes]]
id = "{id}"
token = "tok-1-long-enough-secret"
[[nodes.adapters]]
name = "mock"
type = "mock"
capacity = 2
long_capacity = 1
targets = ["m"]
[nodes.adapters.options]
reply = "{reply}"
tokens = "40"
token_delay_ms = "{delay_ms}"
"#
        ));
    }
    let providers: Vec<String> = ids
        .iter()
        .map(|id| format!(r#"{{ node = "{id}", adapter = "mock", target = "m" }}"#))
        .collect();
    text.push_str(&format!(
        "\n[[models]]\nname = \"chat\"\nproviders = [{}]\n",
        providers.join(", ")
    ));
    text
}

fn ask(stream: bool) -> Value {
    json!({"model": "chat", "stream": stream, "messages": [{"role": "user", "content": "x"}]})
}

async fn reply_text(cluster: &Cluster) -> String {
    let r = cluster
        .http()
        .post("/v1/chat/completions", &ask(false))
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_owned()
}

/// A streamed chat completion whose first event has arrived.
async fn stream_under_way(cluster: &Cluster) -> http::Response<hyper::body::Incoming> {
    let mut s = cluster
        .http()
        .post_stream("/v1/chat/completions", &ask(true))
        .await;
    assert!(
        next_sse(s.body_mut(), Duration::from_secs(5))
            .await
            .is_some(),
        "no first event"
    );
    s
}

/// Reads the stream `s` to its end and checks that it finished whole: it ended, no
/// error event, `[DONE]` last. `log` is shown when it did not.
async fn assert_finishes_whole(s: &mut http::Response<hyper::body::Incoming>, log: &str) {
    let (events, ended) = read_sse(s.body_mut(), Duration::from_secs(15)).await;
    assert!(ended && !stream_failed(&events), "{events:?}\n{log}");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{log}");
}

fn stream_failed(events: &[String]) -> bool {
    events.iter().any(|e| e.contains("\"error\"")) && !events.iter().any(|e| e == "[DONE]")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_killed_mid_stream_ends_the_stream_with_an_error_and_a_restart_serves_again() {
    let cluster = Cluster::start("", &body("one two", 50));
    let mut node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    let mut s = stream_under_way(&cluster).await;
    node.signal("KILL");
    let killed = Instant::now();
    let (events, ended) = read_sse(s.body_mut(), Duration::from_secs(10)).await;
    assert!(ended, "the stream must end, not hang");
    assert!(
        killed.elapsed() < Duration::from_millis(3000),
        "took {:?}",
        killed.elapsed()
    );
    assert!(stream_failed(&events), "{events:?}");
    let _ = node.wait_exit(Duration::from_secs(2));

    cluster.wait_node("n1", false).await;
    let p = cluster.provider("n1", "mock").await;
    assert_eq!(
        (p["status"].as_str(), p["health"].as_str()),
        (Some("unavailable"), Some("offline"))
    );
    for key in [
        "capacity",
        "long_capacity",
        "in_flight",
        "long_in_flight",
        "queued",
        "long_queued",
    ] {
        assert_eq!(p[key], 0, "{key}: {p}");
    }
    let _again = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    assert!(reply_text(&cluster).await.starts_with("one two"));
    assert_eq!(cluster.provider("n1", "mock").await["in_flight"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_node_is_fenced_and_its_old_connection_changes_nothing() {
    let cluster = Cluster::start("", &body("hi", 1));
    let node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    let generation = cluster.http().status().await["nodes"][0]["generation"]
        .as_u64()
        .expect("gen");
    node.signal("STOP");
    let stopped = Instant::now();
    cluster.wait_node("n1", false).await;
    // The Edge fences 1 s after the last frame it received, which may be up to one
    // heartbeat interval (200 ms) before the stop.
    assert!(
        stopped.elapsed() >= Duration::from_millis(700),
        "fenced before the heartbeat timeout"
    );
    assert!(
        stopped.elapsed() < Duration::from_secs(4),
        "fenced too late: {:?}",
        stopped.elapsed()
    );
    node.signal("CONT");
    cluster.wait_ready("n1").await;
    let status = cluster.http().status().await;
    assert!(
        status["nodes"][0]["generation"].as_u64().expect("gen") > generation,
        "{status}"
    );
    assert_eq!(
        reply_text(&cluster).await,
        "hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi hi"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_restart_ends_in_flight_requests_and_the_node_reconnects() {
    let mut cluster = Cluster::start("", &body("one", 50));
    let _node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    let mut s = stream_under_way(&cluster).await;
    let restarted = Instant::now();
    cluster.restart_edge();
    let (events, _) = read_sse(s.body_mut(), Duration::from_secs(5)).await;
    assert!(
        restarted.elapsed() < Duration::from_secs(5),
        "the in-flight request hung"
    );
    assert!(
        !events.iter().any(|e| e == "[DONE]"),
        "a cut request must not look complete"
    );
    cluster.wait_ready("n1").await;
    assert!(reply_text(&cluster).await.starts_with("one"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_exhaustion_and_signals_decide_the_exit_code() {
    let cluster = Cluster::start("", &body("hi", 1));
    // A wrong token: exit 1 at once, no retry.
    let mut bad = cluster.node_with(
        "n1",
        "wrong-token-of-enough-length",
        "max_attempts = 0\ninterval_sec = 0.2",
    );
    assert_eq!(bad.exit_code(Duration::from_secs(10)), Some(1));
    let log = bad.log();
    assert_eq!(log.matches("dialing the edge").count(), 1, "{log}");
    assert!(log.contains("authentication failed"), "{log}");

    // Exhaustion against a closed port: exactly max_attempts dials, then exit 1.
    let dir = iop_blackbox::TempDir::new("exhaust");
    let text = format!(
        "node_id = \"n1\"\nedge_addr = \"127.0.0.1:{}\"\ntoken = \"exhaust-token-0123456\"\n[reconnect]\nmax_attempts = 3\ninterval_sec = 0.1\n",
        free_port()
    );
    let path = dir.write("node.toml", &text).to_string_lossy().into_owned();
    let mut lost = iop_blackbox::Proc::start("iop-node", &["--config", &path], &dir, "lost", &[]);
    assert_eq!(lost.exit_code(Duration::from_secs(10)), Some(1));
    let log = lost.log();
    assert_eq!(log.matches("dialing the edge").count(), 3, "{log}");
    assert!(log.contains("exhausted"), "{log}");

    // SIGTERM: exit 0.
    let mut good = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    good.signal("TERM");
    assert_eq!(good.exit_code(Duration::from_secs(10)), Some(0));

    // SIGQUIT with nothing in flight: the Edge closes the drained link at once; exit 0.
    let mut good = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    good.signal("QUIT");
    assert_eq!(good.exit_code(Duration::from_secs(5)), Some(0));
    // SIGQUIT while the Edge cannot be reached: nothing to drain; exit 0.
    let text = format!(
        "node_id = \"n1\"\nedge_addr = \"127.0.0.1:{}\"\ntoken = \"exhaust-token-0123456\"\n[reconnect]\nmax_attempts = 0\ninterval_sec = 0.2\n",
        free_port()
    );
    let path = dir.write("away.toml", &text).to_string_lossy().into_owned();
    let mut away = iop_blackbox::Proc::start("iop-node", &["--config", &path], &dir, "away", &[]);
    assert!(wait_until(Duration::from_secs(5), || away
        .log()
        .contains("dial failed")));
    away.signal("QUIT");
    assert_eq!(away.exit_code(Duration::from_secs(5)), Some(0));

    // check-config: a bad file is refused with the key named.
    let bad_cfg = dir.write(
        "bad.toml",
        "node_id = \"n\"\nedge_addr = \"nowhere\"\ntoken = \"t\"\n",
    );
    let out = std::process::Command::new(iop_blackbox::binary("iop-node"))
        .args(["check-config", "--config", &bad_cfg.to_string_lossy()])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("edge_addr"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_refreshes_nodes_and_an_invalid_file_changes_nothing() {
    let mut cluster = Cluster::start("", &body("before", 1));
    let _node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    assert!(reply_text(&cluster).await.starts_with("before"));

    // A changed adapter and a new model: the node gets a refresh and serves both.
    let mut next = body("after", 1);
    next = next.replace(
        "[[models]]",
        "[[nodes.adapters]]\nname = \"second\"\ntype = \"mock\"\ncapacity = 1\ntargets = [\"m2\"]\n[nodes.adapters.options]\nreply = \"second adapter\"\n\n[[models]]",
    );
    next.push_str("\n[[models]]\nname = \"chat2\"\nproviders = [{ node = \"n1\", adapter = \"second\", target = \"m2\" }]\n");
    cluster.rewrite(&next);
    cluster.edge.signal("HUP");
    let http = cluster.http();
    let mut refreshed = false;
    for _ in 0..200 {
        let status = http.status().await;
        if status["nodes"][0]["last_refresh"] == "applied"
            && status["nodes"][0]["applied_revision"] == 2
        {
            refreshed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(refreshed, "{}", cluster.edge.log());
    assert!(reply_text(&cluster).await.starts_with("after"));
    let r = http
        .post(
            "/v1/chat/completions",
            &json!({"model": "chat2", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.json()["choices"][0]["message"]["content"],
        "second adapter"
    );

    // An invalid file: the running configuration stays in force.
    cluster.write_raw_config("[listen]\nthis is not toml");
    cluster.edge.signal("HUP");
    assert!(wait_until(Duration::from_secs(5), || cluster
        .edge
        .log()
        .contains("reload refused")));
    assert!(reply_text(&cluster).await.starts_with("after"));
    assert_eq!(http.status().await["nodes"][0]["applied_revision"], 2);

    // What a scraper sees: one reload applied, the last one refused.
    let metrics = String::from_utf8_lossy(&http.get("/metrics").await.body).into_owned();
    for line in [
        "iop_config_reloads_total{result=\"applied\"} 1",
        "iop_config_reloads_total{result=\"refused\"} 1",
        "iop_config_last_reload_successful 0",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "missing {line:?} in\n{metrics}"
        );
    }

    // A setting only a restart changes is kept, and the reload says so.
    cluster.rewrite_head("[runtime]\nworker_threads = 3\n", &next);
    cluster.edge.signal("HUP");
    assert!(
        wait_until(Duration::from_secs(5), || {
            let log = cluster.edge.log();
            log.contains("change only at a restart") && log.contains("runtime.worker_threads")
        }),
        "{}",
        cluster.edge.log()
    );
}

/// `limits.max_concurrent_requests` follows a reload: raised, the next caller is served;
/// lowered below what is running, nothing running is cut and the next caller is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_resizes_the_concurrency_limit_without_cutting_anything() {
    // 40 tokens 100 ms apart: streams of about four seconds.
    let slow = body("x", 100);
    let mut cluster = Cluster::start("[limits]\nmax_concurrent_requests = 1\n", &slow);
    let _node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    let reload = |cluster: &mut Cluster, limit: u32, times: usize| {
        cluster.rewrite_head(
            &format!("[limits]\nmax_concurrent_requests = {limit}\n"),
            &slow,
        );
        cluster.edge.signal("HUP");
        assert!(
            wait_until(Duration::from_secs(5), || cluster
                .edge
                .log()
                .matches("configuration reloaded")
                .count()
                == times),
            "{}",
            cluster.edge.log()
        );
    };
    async fn refused(cluster: &Cluster) -> bool {
        let r = cluster
            .http()
            .post("/v1/chat/completions", &ask(false))
            .await;
        r.status == 503 && String::from_utf8_lossy(&r.body).contains("too many concurrent")
    }

    let mut first = stream_under_way(&cluster).await;
    assert!(refused(&cluster).await, "one at a time");
    reload(&mut cluster, 2, 1);
    let mut second = stream_under_way(&cluster).await;
    reload(&mut cluster, 1, 2);
    assert!(refused(&cluster).await, "lowered below the two running");
    for s in [&mut first, &mut second] {
        assert_finishes_whole(s, "").await;
    }
    // Both ended: one slot is left, as the limit now says.
    let _third = stream_under_way(&cluster).await;
    assert!(refused(&cluster).await, "the limit is one again");
}

/// A reload whose file blocks (here a FIFO nobody writes yet) is read off the Edge's
/// event loop: callers are served and nodes kept meanwhile, and once the file arrives
/// within the reload's time limit it is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_waiting_on_its_file_does_not_stop_the_edge() {
    // One runtime thread, the Edge's default on two CPUs: a read on it would stop all.
    let head = "[runtime]\nworker_threads = 1\n";
    let cluster = Cluster::start(head, &body("before", 1));
    let _node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    assert!(reply_text(&cluster).await.starts_with("before"));

    std::fs::remove_file(&cluster.edge_config).expect("config removed");
    let made = std::process::Command::new("mkfifo")
        .arg(&cluster.edge_config)
        .status()
        .expect("mkfifo runs");
    assert!(made.success());
    cluster.edge.signal("HUP");
    assert!(wait_until(Duration::from_secs(5), || cluster
        .edge
        .log()
        .contains("SIGHUP: reloading")));

    // Longer than the node link's heartbeat timeout: a stalled Edge would lose its node.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let reply = tokio::time::timeout(Duration::from_secs(2), reply_text(&cluster))
            .await
            .unwrap_or_else(|_| {
                panic!("not served while the reload waits: {}", cluster.edge.log())
            });
        assert!(reply.starts_with("before"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        !cluster.edge.log().contains("node fenced"),
        "{}",
        cluster.edge.log()
    );

    let text = Cluster::edge_toml(
        cluster.http_port,
        cluster.node_port,
        head,
        &body("after", 1),
    );
    let fifo = cluster.edge_config.clone();
    tokio::task::spawn_blocking(move || std::fs::write(fifo, text))
        .await
        .expect("joined")
        .expect("written to the FIFO");
    assert!(
        wait_until(Duration::from_secs(5), || cluster
            .edge
            .log()
            .contains("configuration reloaded")),
        "{}",
        cluster.edge.log()
    );
    assert!(reply_text(&cluster).await.starts_with("after"));
}

/// A Node has nothing to reload: SIGHUP (a terminal hanging up, a script that sends it
/// to every service) is logged and changes nothing, where its default would end the
/// process and every stream on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_given_sighup_keeps_its_streams_and_serves_on() {
    let cluster = Cluster::start("", &body("one two", 20));
    let mut node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    let mut s = stream_under_way(&cluster).await;
    node.signal("HUP");
    assert_finishes_whole(&mut s, &node.log()).await;
    assert!(node.running(), "{}", node.log());
    assert!(
        wait_until(Duration::from_secs(5), || node.log().contains("SIGHUP")),
        "{}",
        node.log()
    );
    assert!(reply_text(&cluster).await.starts_with("one two"));
}

/// A raw HTTP/1.1 chat completion (not streamed) on `stream`; the response's head and
/// whatever of its body arrived with it.
fn raw_completion(stream: &mut TcpStream) -> String {
    let body = ask(false).to_string();
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("request written");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut buf = [0u8; 8192];
    let n = stream.read(&mut buf).expect("response");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// Starts node `node_id` with `timeouts.drain_grace_sec` set.
fn node_draining_within(cluster: &Cluster, node_id: &str, token: &str, grace: &str) -> Proc {
    let text = cluster
        .node_toml(node_id, token, "max_attempts = 0\ninterval_sec = 0.2")
        .replace(
            "[timeouts]\n",
            &format!("[timeouts]\ndrain_grace_sec = {grace}\n"),
        );
    let name = format!("node-{node_id}-{}", free_port());
    let path = cluster.dir.write(&format!("{name}.toml"), &text);
    Proc::start(
        "iop-node",
        &["--config", &path.to_string_lossy()],
        &cluster.dir,
        &name,
        &[],
    )
}

/// The state `/v1/status` gives `node_id`.
async fn node_state(cluster: &Cluster, node_id: &str) -> Value {
    let status = cluster.admin().status().await;
    status["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|n| n["node_id"] == node_id)
        .map_or(Value::Null, |n| n["state"].clone())
}

/// SIGQUIT stops a node gracefully (a rolling restart): the Edge sends it nothing more
/// and shows it draining, the other node takes the new callers, the stream in flight on
/// it finishes whole, and it exits 0 once that stream has ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigquit_drains_a_node_its_stream_finishes_and_the_other_node_serves() {
    // 40 tokens 200 ms apart: a stream of about eight seconds, long enough for n2 to
    // start and everything below to be looked at on a loaded machine.
    let cluster = Cluster::start("", &nodes_body(&["n1", "n2"], "one two", 200));
    let mut n1 = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    let mut s = stream_under_way(&cluster).await;
    let _n2 = cluster.node("n2", "tok-1-long-enough-secret");
    cluster.wait_ready("n2").await;

    n1.signal("QUIT");
    let mut saw_draining = false;
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline && !saw_draining {
        saw_draining = node_state(&cluster, "n1").await == "draining";
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(saw_draining, "{}", cluster.edge.log());
    // The node says so itself too, answering the Edge's query while it drains.
    let transport = cluster.admin().get("/v1/nodes/n1/transport").await.json();
    assert_eq!(
        (&transport["draining"], &transport["in_flight"]),
        (&json!(true), &json!(1)),
        "{transport}"
    );
    let metrics = cluster.admin().get("/metrics").await;
    let metrics = String::from_utf8_lossy(&metrics.body);
    assert!(
        metrics.lines().any(|l| l == "iop_nodes_draining 1"),
        "{metrics}"
    );
    let n1_mock = cluster.provider("n1", "mock").await;
    assert_eq!(
        (&n1_mock["in_flight"], &n1_mock["capacity"]),
        (&json!(1), &json!(0)),
        "{n1_mock}"
    );
    // New callers go to n2 meanwhile, though n1 had a free slot.
    let mut more = vec![
        stream_under_way(&cluster).await,
        stream_under_way(&cluster).await,
    ];
    assert_eq!(cluster.provider("n2", "mock").await["in_flight"], 2);
    assert_eq!(cluster.provider("n1", "mock").await["in_flight"], 1);
    assert!(
        n1.wait_exit(Duration::from_millis(100)).is_none(),
        "n1 waits for its stream"
    );

    assert_finishes_whole(&mut s, &n1.log()).await;
    assert_eq!(
        n1.exit_code(Duration::from_secs(5)),
        Some(0),
        "{}",
        n1.log()
    );
    let log = n1.log();
    assert!(log.contains("stopping gracefully"), "{log}");
    assert_eq!(
        log.matches("dialing the edge").count(),
        1,
        "no redial: {log}"
    );
    let edge = cluster.edge.log();
    assert!(
        edge.contains("node stopping gracefully") && edge.contains("node drained and gone"),
        "{edge}"
    );
    for s in &mut more {
        assert_finishes_whole(s, "").await;
    }
}

/// A rolling restart with one node id: the new process starts while the old one drains.
/// It is held off (not superseding the old one, which would cut its stream) and becomes
/// the node once the old one has gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_while_the_old_one_drains_takes_over_once_it_has_gone() {
    // 40 tokens 100 ms apart: a stream of about four seconds.
    let cluster = Cluster::start("", &body("one two", 100));
    let mut old = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    let mut s = stream_under_way(&cluster).await;
    old.signal("QUIT");
    let drain_seen = wait_until(Duration::from_secs(3), || {
        cluster.edge.log().contains("node stopping gracefully")
    });
    assert!(drain_seen, "{}", cluster.edge.log());
    let mut new = cluster.node("n1", "tok-1-long-enough-secret");
    assert!(
        wait_until(Duration::from_secs(3), || new
            .log()
            .contains("refused the node for now")),
        "{}",
        new.log()
    );
    assert_finishes_whole(&mut s, &cluster.edge.log()).await;
    assert_eq!(old.exit_code(Duration::from_secs(5)), Some(0));
    cluster.wait_ready("n1").await;
    assert!(
        new.wait_exit(Duration::from_millis(10)).is_none(),
        "the new one serves on"
    );
    let r = cluster
        .http()
        .post("/v1/chat/completions", &ask(false))
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let edge = cluster.edge.log();
    assert!(
        edge.contains("registration held off until the node id's draining connection has gone"),
        "{edge}"
    );
    assert!(
        !edge.contains("Superseded"),
        "nothing was superseded: {edge}"
    );
}

/// A stream longer than `timeouts.drain_grace_sec` is cancelled when the grace is over,
/// and SIGTERM during a graceful stop does not wait for it: either way the caller's
/// stream ends (with an error) and the node exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_is_bounded_by_its_grace_and_cut_short_by_sigterm() {
    for sigterm in [false, true] {
        // 40 tokens 250 ms apart: ten seconds.
        let cluster = Cluster::start("", &body("one", 250));
        let grace = if sigterm { "60" } else { "1" };
        let mut n1 = node_draining_within(&cluster, "n1", "tok-1-long-enough-secret", grace);
        cluster.wait_ready("n1").await;
        let mut s = stream_under_way(&cluster).await;
        let signalled = Instant::now();
        n1.signal("QUIT");
        if sigterm {
            assert!(wait_until(Duration::from_secs(5), || n1
                .log()
                .contains("stopping gracefully")));
            n1.signal("TERM");
        }
        let (events, ended) = read_sse(s.body_mut(), Duration::from_secs(8)).await;
        assert!(ended, "the stream ends (sigterm: {sigterm})");
        assert!(
            !events.iter().any(|e| e == "[DONE]"),
            "cut short, not finished: {events:?}"
        );
        assert_eq!(
            n1.exit_code(Duration::from_secs(5)),
            Some(0),
            "{}",
            n1.log()
        );
        assert!(
            signalled.elapsed() < Duration::from_secs(6),
            "took {:?} (sigterm: {sigterm})",
            signalled.elapsed()
        );
    }
}

/// SIGTERM: the Edge stops taking callers, closes a kept connection that has no request
/// in progress, lets the stream in flight finish, and exits 0 once it has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_the_streams_in_flight_finish_before_the_edge_exits() {
    // 40 tokens 100 ms apart: a stream of about four seconds.
    let mut cluster = Cluster::start("", &body("one two", 100));
    let _node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    let mut kept = TcpStream::connect(("127.0.0.1", cluster.http_port)).expect("connect");
    let first = raw_completion(&mut kept);
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    let mut s = stream_under_way(&cluster).await;

    cluster.edge.signal("TERM");
    assert!(
        wait_until(Duration::from_secs(5), || cluster
            .edge
            .log()
            .contains("draining")),
        "{}",
        cluster.edge.log()
    );
    // No new callers: the listener is closed...
    let port = cluster.http_port;
    assert!(
        wait_until(Duration::from_secs(2), || TcpStream::connect((
            "127.0.0.1",
            port
        ))
        .is_err()),
        "a draining Edge still takes new connections"
    );
    // ...and a kept connection with no request in progress is closed, by the drain
    // (the Edge is still up for the stream in flight), not by the Edge's exit.
    assert!(closed_by_peer(&mut kept));
    assert!(
        cluster.edge.running(),
        "the kept connection stayed open until the Edge exited: {}",
        cluster.edge.log()
    );

    // The stream in flight finishes whole.
    assert_finishes_whole(&mut s, "").await;
    assert_eq!(cluster.edge.exit_code(Duration::from_secs(5)), Some(0));
    assert!(
        cluster.edge.log().contains("drained"),
        "{}",
        cluster.edge.log()
    );
}

/// The same over HTTP/2 (h2c, served by hyper): the drain sends GOAWAY, and the stream
/// in flight on that connection still finishes whole. Started by SIGQUIT, which drains
/// the Edge as SIGTERM does (and a Node gracefully).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigquit_like_sigterm_lets_an_http2_stream_finish() {
    use http_body_util::BodyExt;
    let mut cluster = Cluster::start("", &body("one two", 50));
    let _node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    let response = post_h2c(cluster.http_port, "/v1/chat/completions", &ask(true)).await;
    let mut body = response.into_body();
    let first = body.frame().await.expect("a first frame").expect("frame");
    assert!(first.data_ref().is_some_and(|d| !d.is_empty()));

    cluster.edge.signal("QUIT");
    let rest = tokio::time::timeout(Duration::from_secs(10), body.collect())
        .await
        .expect("the stream ends")
        .expect("the stream ends cleanly")
        .to_bytes();
    let text = String::from_utf8_lossy(&rest);
    assert!(text.contains("data: [DONE]"), "{text}");
    assert_eq!(cluster.edge.exit_code(Duration::from_secs(5)), Some(0));
}

/// A stream longer than `limits.shutdown_grace_sec` is cut when the grace is over; a
/// second signal does not wait for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shutdown_grace_and_a_second_signal_bound_the_wait() {
    for second_signal in [false, true] {
        // 40 tokens 250 ms apart: ten seconds, longer than a grace of 1 s; a second signal
        // must not wait out a grace of 60.
        let grace = if second_signal { 60 } else { 1 };
        let mut cluster = Cluster::start(
            &format!("[limits]\nshutdown_grace_sec = {grace}\n"),
            &body("one", 250),
        );
        let _node = cluster.node("n1", "tok-1-long-enough-secret");
        cluster.wait_ready("n1").await;
        let mut s = stream_under_way(&cluster).await;
        let signalled = Instant::now();
        cluster.edge.signal("TERM");
        if second_signal {
            assert!(wait_until(Duration::from_secs(5), || cluster
                .edge
                .log()
                .contains("draining")));
            cluster.edge.signal("INT");
        }
        assert_eq!(cluster.edge.exit_code(Duration::from_secs(5)), Some(0));
        let waited = signalled.elapsed();
        let log = cluster.edge.log();
        if second_signal {
            assert!(log.contains("stopping at once"), "{log}");
            assert!(waited < Duration::from_secs(10), "{waited:?}\n{log}");
        } else {
            assert!(log.contains("shutdown grace over"), "{log}");
            assert!(waited >= Duration::from_secs(1), "{waited:?}\n{log}");
        }
        let (events, ended) = read_sse(s.body_mut(), Duration::from_secs(5)).await;
        assert!(
            !events.iter().any(|e| e == "[DONE]"),
            "the stream was cut, not finished: {events:?} {ended}"
        );
    }
}

fn closed_by_peer(stream: &mut TcpStream) -> bool {
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut buf = [0u8; 64];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(err) => return err.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_raw_tcp_clients_are_closed_and_everyone_else_is_served() {
    let cluster = Cluster::start("", &body("fine", 1));
    let _node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    let addr = ("127.0.0.1", cluster.node_port);

    let mut garbage = TcpStream::connect(addr).expect("connect");
    garbage
        .write_all(b"\x00\x00\x00\x05hello world, not protobuf")
        .expect("write");
    let mut oversized = TcpStream::connect(addr).expect("connect");
    oversized.write_all(&u32::MAX.to_be_bytes()).expect("write");
    let mut header_only = TcpStream::connect(addr).expect("connect");
    header_only
        .write_all(&1000u32.to_be_bytes())
        .expect("write");

    assert!(closed_by_peer(&mut garbage), "garbage stayed open");
    assert!(
        closed_by_peer(&mut oversized),
        "oversized length stayed open"
    );
    // A header alone is closed by the register deadline (2 s in tests).
    assert!(
        closed_by_peer(&mut header_only),
        "header-only client stayed open"
    );
    assert!(reply_text(&cluster).await.starts_with("fine"));
    assert_eq!(cluster.http().status().await["nodes"][0]["connected"], true);
}

/// A Node whose link stops draining (an Edge that does not read, a stalled path) keeps
/// its frames and sends every one, in order, once the link drains again: backpressure
/// delays a stream, it neither loses nor stalls it. The stream (25,000 words of 400
/// bytes, ~10 MiB of frames) is more than the kernel's socket buffers and the Node's
/// 4 MiB output buffer hold together, so while the relay holds, the Node's writes block
/// and it stops taking its adapter's output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_that_stops_draining_delays_a_stream_and_loses_nothing() {
    const TOKENS: usize = 25_000;
    let word = "x".repeat(400);
    let config = body(&word, 0).replace("tokens = \"40\"", &format!("tokens = \"{TOKENS}\""));
    let cluster = Cluster::start("", &config);
    let relay = iop_blackbox::Relay::start(cluster.node_port).await;
    let text = cluster
        .node_toml("n1", "tok-1-long-enough-secret", "interval_sec = 0.2")
        .replace(
            &format!("127.0.0.1:{}", cluster.node_port),
            &format!("127.0.0.1:{}", relay.port),
        );
    let path = cluster.dir.write("relayed.toml", &text);
    let path = path.to_string_lossy().into_owned();
    let _node = iop_blackbox::Proc::start(
        "iop-node",
        &["--config", &path],
        &cluster.dir,
        "relayed",
        &[],
    );
    cluster.wait_ready("n1").await;

    relay.hold(true);
    // The response head waits for the first content (routing may still retry before
    // it), so the hold ends while the caller waits for it: after half the test
    // clusters' heartbeat timeout (1 s), during which the Edge hears nothing.
    let http = cluster.http();
    let body = ask(true);
    let (mut s, ()) = tokio::join!(http.post_stream("/v1/chat/completions", &body), async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        relay.hold(false);
    });
    let (events, ended) = read_sse(s.body_mut(), Duration::from_secs(60)).await;
    assert!(ended, "the stream must end once the link drains");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let words: usize = events
        .iter()
        .map(|e| e.matches(word.as_str()).count())
        .sum();
    assert_eq!(words, TOKENS, "every word arrives, once");
}

/// A token count's body goes back to the in-flight byte budget once it is answered:
/// counts far past the budget in total leave it whole for the requests after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_counts_give_their_bodies_back_to_the_memory_budget() {
    let cluster = Cluster::start(
        "[limits]\nmax_body_bytes = 4096\nmax_inflight_bytes = 8192\n",
        &body("hi", 0),
    );
    let _node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    let count = json!({
        "model": "chat",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "x".repeat(3000)}],
    });
    // Each holds about 3 KB while it is read: three at once would not fit.
    for i in 0..10 {
        let r = cluster
            .http()
            .post("/v1/messages/count_tokens", &count)
            .await;
        assert_eq!(
            r.status,
            200,
            "count {i}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert!(r.json()["input_tokens"].as_u64() > Some(0), "count {i}");
    }
    assert!(reply_text(&cluster).await.starts_with("hi"));
}
