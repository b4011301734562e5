//! Replacing the Edge process under load (`iop-edge --takeover`): the listeners are
//! handed over, the nodes re-home, the old process finishes its streams and exits.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use iop_blackbox::client::{Cluster, Http, read_sse};
use iop_blackbox::{Proc, wait_until};
use serde_json::json;

/// Nodes n1 and n2, each with a fast adapter (model `chat`: three tokens) and a slow one
/// (model `long`: `tokens` tokens 100 ms apart), capacity 64 each.
fn body(reply: &str, tokens: u32) -> String {
    let mut text = String::new();
    for id in ["n1", "n2"] {
        text.push_str(&format!(
            r#"
[[nodes]]
id = "{id}"
token = "tok-{id}-long-enough-secret"
[[nodes.adapters]]
name = "fast"
type = "mock"
capacity = 64
targets = ["m"]
[nodes.adapters.options]
reply = "{reply}"
tokens = "3"
token_delay_ms = "1"
[[nodes.adapters]]
name = "slow"
type = "mock"
capacity = 64
targets = ["m"]
[nodes.adapters.options]
reply = "a long story"
tokens = "{tokens}"
token_delay_ms = "100"
"#
        ));
    }
    text.push_str(
        r#"
[[models]]
name = "chat"
providers = [{ node = "n1", adapter = "fast", target = "m" }, { node = "n2", adapter = "fast", target = "m" }]
[[models]]
name = "long"
providers = [{ node = "n1", adapter = "slow", target = "m" }, { node = "n2", adapter = "slow", target = "m" }]
"#,
    );
    text
}

/// What the callers saw.
#[derive(Default)]
struct Tally {
    ok: AtomicUsize,
    failed: AtomicUsize,
    streams_ok: AtomicUsize,
    streams_cut: AtomicUsize,
    failures: std::sync::Mutex<Vec<String>>,
}

impl Tally {
    fn fail(&self, counter: &AtomicUsize, what: String) {
        counter.fetch_add(1, Ordering::SeqCst);
        let mut failures = self.failures.lock().unwrap();
        if failures.len() < 20 {
            failures.push(what);
        }
    }
}

/// Steady load until `stop`: `small` callers sending small requests back to back over
/// kept connections, and `streams` callers each reading long streams one after another.
fn load(
    port: u16,
    small: usize,
    streams: usize,
    stop: &Arc<AtomicBool>,
    tally: &Arc<Tally>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    for _ in 0..small {
        let (stop, tally, http) = (stop.clone(), tally.clone(), Http::new(port));
        tasks.push(tokio::spawn(async move {
            let ask = json!({"model": "chat", "messages": [{"role": "user", "content": "x"}]});
            while !stop.load(Ordering::SeqCst) {
                let r = http.post("/v1/chat/completions", &ask).await;
                if r.status == 200 && r.json()["choices"][0]["message"]["content"].is_string() {
                    tally.ok.fetch_add(1, Ordering::SeqCst);
                } else {
                    let text = format!("{} {}", r.status, String::from_utf8_lossy(&r.body));
                    tally.fail(&tally.failed, text);
                }
            }
        }));
    }
    for _ in 0..streams {
        let (stop, tally, http) = (stop.clone(), tally.clone(), Http::new(port));
        tasks.push(tokio::spawn(async move {
            let ask = json!({"model": "long", "stream": true, "messages": [{"role": "user", "content": "x"}]});
            while !stop.load(Ordering::SeqCst) {
                let mut s = http.post_stream("/v1/chat/completions", &ask).await;
                if s.status() != 200 {
                    tally.fail(&tally.streams_cut, format!("stream status {}", s.status()));
                    continue;
                }
                let (events, ended) = read_sse(s.body_mut(), Duration::from_secs(30)).await;
                let whole = ended
                    && events.last().map(String::as_str) == Some("[DONE]")
                    && !events.iter().any(|e| e.contains("\"error\""));
                if whole {
                    tally.streams_ok.fetch_add(1, Ordering::SeqCst);
                } else {
                    let last: Vec<&String> = events.iter().rev().take(2).collect();
                    tally.fail(
                        &tally.streams_cut,
                        format!("stream cut: ended={ended}, {} events, last {last:?}", events.len()),
                    );
                }
            }
        }));
    }
    tasks
}

/// Starts a successor with `--takeover` and waits until it has taken the listeners over
/// from the cluster's Edge; the cluster's Edge is the successor afterwards, and the old
/// process is returned.
fn take_over(cluster: &mut Cluster, name: &str) -> Proc {
    let path = cluster.edge_config.to_string_lossy().into_owned();
    let successor = Proc::start(
        "iop-edge",
        &["--config", &path, "--takeover"],
        &cluster.dir,
        name,
        &[],
    );
    assert!(
        wait_until(Duration::from_secs(10), || successor
            .log()
            .contains("took over")),
        "no takeover:\n{}\n--- old edge\n{}",
        successor.log(),
        cluster.edge.log()
    );
    std::mem::replace(&mut cluster.edge, successor)
}

/// Both nodes are ready on the process that now answers the listener, each having
/// re-homed (or connected afresh) `times` times in all.
async fn nodes_rehomed(cluster: &Cluster, nodes: &[&Proc], times: usize) {
    let rehomed = || {
        nodes.iter().all(|n| {
            n.log()
                .matches("the edge is handing over: re-homing")
                .count()
                >= times
        })
    };
    assert!(
        wait_until(Duration::from_secs(5), rehomed) && all_connected(cluster).await,
        "nodes not on the new edge within 5 s\n--- edge\n{}\n--- node\n{}",
        cluster.edge.log(),
        nodes[0].log()
    );
}

/// `n` streams of the `long` model, each with its first event read.
async fn streams_under_way(
    cluster: &Cluster,
    n: usize,
) -> Vec<http::Response<hyper::body::Incoming>> {
    let ask =
        json!({"model": "long", "stream": true, "messages": [{"role": "user", "content": "x"}]});
    let mut streams = Vec::with_capacity(n);
    for _ in 0..n {
        let mut s = cluster
            .http()
            .post_stream("/v1/chat/completions", &ask)
            .await;
        assert_eq!(s.status(), 200);
        assert!(
            iop_blackbox::client::next_sse(s.body_mut(), Duration::from_secs(5))
                .await
                .is_some()
        );
        streams.push(s);
    }
    streams
}

/// Both nodes ready on the process that answers the listener, within 5 s.
async fn all_connected(cluster: &Cluster) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let status = cluster.admin().status().await;
        if status["nodes"].as_array().is_some_and(|nodes| {
            nodes.len() == 2 && nodes.iter().all(|n| n["connected"] == json!(true))
        }) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replacing_the_edge_twice_under_load_loses_no_request_and_no_stream() {
    let mut cluster = Cluster::start("", &body("one two", 30));
    let n1 = cluster.node("n1", "tok-n1-long-enough-secret");
    let n2 = cluster.node("n2", "tok-n2-long-enough-secret");
    cluster.wait_ready("n1").await;
    cluster.wait_ready("n2").await;

    let (stop, tally) = (Arc::new(AtomicBool::new(false)), Arc::new(Tally::default()));
    let tasks = load(cluster.http_port, 16, 50, &stop, &tally);
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // The same binary and configuration.
    let mut first = take_over(&mut cluster, "edge-2");
    nodes_rehomed(&cluster, &[&n1, &n2], 1).await;
    // The streams still running for the old process hold capacity the new one counts.
    let status = cluster.admin().status().await;
    let held: u64 = status["providers"]
        .as_array()
        .expect("providers")
        .iter()
        .map(|p| p["held_elsewhere"].as_u64().unwrap_or(0))
        .sum();
    assert!(held > 0, "no capacity held elsewhere: {status}");
    // Its last stream began less than 3 s before the hand-over.
    assert!(
        first.wait_exit(Duration::from_secs(15)).is_some(),
        "the old edge did not exit after its last stream:\n{}",
        first.log()
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;

    // A changed configuration: the fast model answers otherwise.
    cluster.rewrite(&body("three four", 30));
    let mut second = take_over(&mut cluster, "edge-3");
    nodes_rehomed(&cluster, &[&n1, &n2], 2).await;
    assert!(
        second.wait_exit(Duration::from_secs(15)).is_some(),
        "the old edge did not exit after its last stream:\n{}",
        second.log()
    );
    let ask = json!({"model": "chat", "messages": [{"role": "user", "content": "x"}]});
    let r = cluster.http().post("/v1/chat/completions", &ask).await;
    assert!(
        String::from_utf8_lossy(&r.body).contains("three four"),
        "the new configuration is in force: {}",
        String::from_utf8_lossy(&r.body)
    );
    tokio::time::sleep(Duration::from_millis(500)).await;

    stop.store(true, Ordering::SeqCst);
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(40), task)
            .await
            .expect("callers finish")
            .expect("caller task");
    }
    let (ok, failed) = (
        tally.ok.load(Ordering::SeqCst),
        tally.failed.load(Ordering::SeqCst),
    );
    let (streams, cut) = (
        tally.streams_ok.load(Ordering::SeqCst),
        tally.streams_cut.load(Ordering::SeqCst),
    );
    let failures = tally.failures.lock().unwrap().clone();
    assert_eq!(
        (failed, cut),
        (0, 0),
        "{ok} ok, {streams} streams whole; failures: {failures:#?}\n--- first\n{}\n--- second\n{}\n--- edge\n{}",
        first.log(),
        second.log(),
        cluster.edge.log()
    );
    // Every caller got through; the load was real (its pace depends on the machine).
    assert!(ok > 100 && streams >= 50, "{ok} small, {streams} streams");
    assert!(cluster.edge.running(), "{}", cluster.edge.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_old_edge_mid_handover_cuts_its_streams_and_the_new_one_serves() {
    // Streams of 80 tokens 100 ms apart: 8 s, still running when the old edge dies.
    let mut cluster = Cluster::start("", &body("one two", 80));
    let n1 = cluster.node("n1", "tok-n1-long-enough-secret");
    let n2 = cluster.node("n2", "tok-n2-long-enough-secret");
    cluster.wait_ready("n1").await;
    cluster.wait_ready("n2").await;
    let mut streams = streams_under_way(&cluster, 10).await;

    let mut old = take_over(&mut cluster, "edge-2");
    assert!(
        wait_until(Duration::from_secs(5), || old
            .log()
            .contains("nodes told to re-home")),
        "{}",
        old.log()
    );
    old.signal("KILL");
    let killed = Instant::now();
    let _ = old.wait_exit(Duration::from_secs(5));
    for s in &mut streams {
        let (events, ended) = read_sse(s.body_mut(), Duration::from_secs(10)).await;
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "a stream of the killed edge hung"
        );
        assert!(
            !(ended && events.last().map(String::as_str) == Some("[DONE]")),
            "a stream of the killed edge cannot have finished whole: {events:?}"
        );
    }

    // The new edge serves, with the nodes' full capacity once their old sessions closed.
    nodes_rehomed(&cluster, &[&n1, &n2], 1).await;
    let ask = json!({"model": "chat", "messages": [{"role": "user", "content": "x"}]});
    for _ in 0..20 {
        let r = cluster.http().post("/v1/chat/completions", &ask).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
    let long =
        json!({"model": "long", "stream": true, "messages": [{"role": "user", "content": "x"}]});
    let mut s = cluster
        .http()
        .post_stream("/v1/chat/completions", &long)
        .await;
    assert_eq!(s.status(), 200);
    assert!(
        iop_blackbox::client::next_sse(s.body_mut(), Duration::from_secs(5))
            .await
            .is_some(),
        "{}",
        cluster.edge.log()
    );
    assert!(
        wait_until(Duration::from_secs(5), || {
            n1.log().contains("re-homed session over") && n2.log().contains("re-homed session over")
        }),
        "the nodes' sessions to the killed edge ended"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_kept_connection_moves_to_the_successor_and_an_http2_stream_finishes() {
    let mut cluster = Cluster::start("", &body("one two", 30));
    let _n1 = cluster.node("n1", "tok-n1-long-enough-secret");
    let _n2 = cluster.node("n2", "tok-n2-long-enough-secret");
    cluster.wait_ready("n1").await;
    cluster.wait_ready("n2").await;
    // One kept HTTP/1.1 connection, idle at the handover.
    let kept = cluster.http();
    let ask = json!({"model": "chat", "messages": [{"role": "user", "content": "x"}]});
    assert_eq!(kept.post("/v1/chat/completions", &ask).await.status, 200);
    // One HTTP/2 stream under way.
    let long =
        json!({"model": "long", "stream": true, "messages": [{"role": "user", "content": "x"}]});
    let mut h2 =
        iop_blackbox::client::post_h2c(cluster.http_port, "/v1/chat/completions", &long).await;
    assert_eq!(h2.status(), 200);

    let mut old = take_over(&mut cluster, "edge-2");
    // The kept connection carries on, now to the successor: the old process moved it.
    for _ in 0..3 {
        let r = kept.post("/v1/chat/completions", &ask).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
    let (events, ended) = read_sse(h2.body_mut(), Duration::from_secs(15)).await;
    assert!(
        ended && events.last().map(String::as_str) == Some("[DONE]"),
        "the HTTP/2 stream finishes whole on the old process: {events:?}\n{}",
        old.log()
    );
    assert!(
        old.wait_exit(Duration::from_secs(10)).is_some(),
        "{}",
        old.log()
    );
    let log = old.log();
    assert!(
        log.contains("connections moved to the successor") && !log.contains("moved=0"),
        "the idle connection moved: {log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_old_edge_as_soon_as_the_successor_serves_loses_only_its_streams() {
    let mut cluster = Cluster::start("", &body("one two", 80));
    let _n1 = cluster.node("n1", "tok-n1-long-enough-secret");
    let _n2 = cluster.node("n2", "tok-n2-long-enough-secret");
    cluster.wait_ready("n1").await;
    cluster.wait_ready("n2").await;
    let mut streams = streams_under_way(&cluster, 6).await;
    // Killed before its nodes can have re-homed: they find their link gone and redial.
    let old = take_over(&mut cluster, "edge-2");
    old.signal("KILL");
    let killed = Instant::now();
    for s in &mut streams {
        let (events, ended) = read_sse(s.body_mut(), Duration::from_secs(10)).await;
        assert!(killed.elapsed() < Duration::from_secs(5), "a stream hung");
        assert!(!(ended && events.last().map(String::as_str) == Some("[DONE]")));
    }
    assert!(
        all_connected(&cluster).await,
        "nodes not back: {}",
        cluster.edge.log()
    );
    let small = json!({"model": "chat", "messages": [{"role": "user", "content": "x"}]});
    for _ in 0..10 {
        let r = cluster.http().post("/v1/chat/completions", &small).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
}
