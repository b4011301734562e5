//! What an operator reads about each request: the `x-request-id` that names it from the
//! caller through the Edge and the Node to the provider, the one log line per request,
//! and the token usage metrics.

use std::time::Duration;

use iop_blackbox::Proc;
use iop_blackbox::client::Cluster;
use iop_blackbox::fake::{self, Behaviour, Flavor};
use iop_blackbox::wait_until;
use serde_json::json;

fn body(oa: &str) -> String {
    format!(
        r#"
[[nodes]]
id = "n1"
token = "tok-1-long-enough-secret"
[[nodes.adapters]]
name = "mock"
type = "mock"
capacity = 2
targets = ["m"]
[[nodes.adapters]]
name = "oa"
type = "openai_compat"
base_url = "{oa}"
capacity = 2
targets = ["gpt-x"]

[[models]]
name = "mock-chat"
providers = [{{ node = "n1", adapter = "mock", target = "m" }}]
[[models]]
name = "tunnel-chat"
providers = [{{ node = "n1", adapter = "oa", target = "gpt-x" }}]
"#
    )
}

async fn ready(oa: &str) -> (Cluster, Proc) {
    let cluster = Cluster::start("", &body(oa));
    let node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    (cluster, node)
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

fn chat(model: &str) -> serde_json::Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hello"}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_names_the_request_from_the_caller_to_the_provider() {
    let fake = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let (cluster, node) = ready(&fake.url()).await;

    // The caller's id comes back, reaches the provider, and is in both processes' logs.
    let given = "trace-4f1c:abc_123";
    let http = cluster.http().with_header("x-request-id", given);
    for model in ["tunnel-chat", "mock-chat"] {
        let r = http.post("/v1/chat/completions", &chat(model)).await;
        assert_eq!(r.status, 200, "{model}");
        assert_eq!(header(&r.headers, "x-request-id"), Some(given), "{model}");
    }
    let upstream = fake.state.requests();
    assert!(
        upstream
            .iter()
            .any(|r| header(&r.headers, "x-request-id") == Some(given)),
        "the provider saw the id: {upstream:?}"
    );
    assert!(
        wait_until(Duration::from_secs(5), || {
            let log = cluster.edge.log();
            log.lines()
                .filter(|l| l.contains(given) && l.contains("request"))
                .count()
                >= 2
        }),
        "one edge line per request:\n{}",
        cluster.edge.log()
    );
    let edge_log = cluster.edge.log();
    let line = edge_log
        .lines()
        .find(|l| l.contains(given) && l.contains("mock-chat"))
        .expect("the mock request's line");
    for field in [
        "status=200",
        "node=\"n1\"",
        "provider=\"mock\"",
        "ttfb_ms=",
        "duration_ms=",
        "queue_ms=",
        "caller=anonymous",
    ] {
        assert!(
            line.contains(field) || line.contains(&field.replace('"', "")),
            "{field} missing from {line}"
        );
    }
    assert!(
        wait_until(Duration::from_secs(5), || node.log().contains(given)),
        "the node logs the id:\n{}",
        node.log()
    );

    // Without one (or with one unfit for logs) the Edge makes one, different every time.
    let mut made = Vec::new();
    for http in [
        cluster.http(),
        cluster.http(),
        cluster
            .http()
            .with_header("x-request-id", "has spaces and \"quotes\""),
    ] {
        let r = http.post("/v1/chat/completions", &chat("mock-chat")).await;
        let id = header(&r.headers, "x-request-id")
            .expect("an id")
            .to_owned();
        assert!(id.starts_with("req_") && id.len() == 28, "{id}");
        made.push(id);
    }
    made.sort();
    made.dedup();
    assert_eq!(made.len(), 3, "fresh ids are unique");

    // Refusals are named too.
    let r = cluster
        .http()
        .with_header("x-request-id", "refused-1")
        .post("/v1/chat/completions", &chat("no-such-model"))
        .await;
    assert_eq!(r.status, 404);
    assert_eq!(header(&r.headers, "x-request-id"), Some("refused-1"));
    assert!(wait_until(Duration::from_secs(5), || {
        cluster
            .edge
            .log()
            .lines()
            .any(|l| l.contains("refused-1") && l.contains("status=404"))
    }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_usage_the_providers_report_is_counted_by_model_and_provider() {
    let fake = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let (cluster, _node) = ready(&fake.url()).await;
    let http = cluster.http();
    // A run reports usage on its terminal event; a tunnel's usage is observed from the
    // provider's body (non-streamed) or its usage chunk (streamed).
    for _ in 0..2 {
        let r = http
            .post("/v1/chat/completions", &chat("tunnel-chat"))
            .await;
        assert_eq!(r.status, 200);
    }
    let r = http.post("/v1/chat/completions", &chat("mock-chat")).await;
    assert_eq!(r.status, 200);
    let reported = r.json()["usage"].clone();
    assert!(reported["prompt_tokens"].as_u64().is_some(), "{reported}");

    let metrics = cluster.admin().get("/metrics").await;
    assert_eq!(metrics.status, 200);
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    let value = |labels: &str| -> Option<u64> {
        text.lines()
            .find(|l| l.starts_with(&format!("iop_tokens_total{{{labels}}} ")))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    };
    // The fake provider reports 7 prompt tokens and 16 completion tokens per call.
    assert_eq!(
        value(r#"model="tunnel-chat",node="n1",provider="oa",key="anonymous",kind="prompt""#),
        Some(14),
        "{text}"
    );
    assert_eq!(
        value(r#"model="tunnel-chat",node="n1",provider="oa",key="anonymous",kind="completion""#),
        Some(2 * Behaviour::default().words as u64),
        "{text}"
    );
    assert_eq!(
        value(r#"model="mock-chat",node="n1",provider="mock",key="anonymous",kind="prompt""#),
        reported["prompt_tokens"].as_u64(),
        "{text}"
    );
    // OpenMetrics, as prometheus-client renders it; queue wait is kept per model.
    assert!(
        metrics.headers.iter().any(|(k, v)| k == "content-type"
            && v.starts_with("application/openmetrics-text; version=1.0.0")),
        "{:?}",
        metrics.headers
    );
    assert!(text.ends_with("# EOF\n"), "{text}");
    assert!(
        text.lines()
            .any(|l| l == r#"iop_queue_wait_seconds_count{model="tunnel-chat"} 2"#),
        "{text}"
    );
}

/// A request's line says how long it waited for a provider (`queue_ms`) apart from how
/// long the provider took to answer (`ttfb_ms`): an idle provider that takes 400 ms to
/// answer is a request that did not queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_time_ends_when_the_request_is_dispatched_not_at_its_first_byte() {
    let slow = Behaviour {
        whole_delay: Duration::from_millis(400),
        ..Behaviour::default()
    };
    let fake = fake::start(Flavor::OpenAi, slow).await;
    let (cluster, _node) = ready(&fake.url()).await;
    let given = "queue-then-answer";
    let http = cluster.http().with_header("x-request-id", given);
    let r = http
        .post("/v1/chat/completions", &chat("tunnel-chat"))
        .await;
    assert_eq!(r.status, 200);
    assert!(
        wait_until(Duration::from_secs(5), || cluster
            .edge
            .log()
            .contains(given)),
        "the request's line:\n{}",
        cluster.edge.log()
    );
    let log = cluster.edge.log();
    let line = log
        .lines()
        .find(|l| l.contains(given) && l.contains("tunnel-chat"))
        .expect("the request's line");
    let field = |name: &str| -> f64 {
        let at = line.find(&format!(" {name}=")).expect(name) + name.len() + 2;
        line[at..]
            .split(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {line}"))
    };
    let (queue, ttfb) = (field("queue_ms"), field("ttfb_ms"));
    assert!(ttfb >= 390.0, "the provider took 400 ms: {line}");
    assert!(queue < 200.0, "nothing queued ahead of it: {line}");
}

/// An SSE reader that keeps what it has buffered between events.
struct Events {
    body: hyper::body::Incoming,
    buffer: String,
}

impl Events {
    /// The next event's JSON payload (`None` at the end of the stream or after `timeout`).
    async fn next(&mut self, timeout: Duration) -> Option<serde_json::Value> {
        use http_body_util::BodyExt;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            while let Some(end) = self.buffer.find("\n\n") {
                let event: String = self.buffer.drain(..end + 2).collect();
                if let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) {
                    return serde_json::from_str(data).ok();
                }
            }
            let frame = tokio::time::timeout_at(deadline, self.body.frame())
                .await
                .ok()??
                .ok()?;
            if let Ok(data) = frame.into_data() {
                self.buffer.push_str(&String::from_utf8_lossy(&data));
            }
        }
    }

    /// Events until one of `kind` for `node`, returning all read (it last).
    async fn until(&mut self, kind: &str, node: &str) -> Vec<serde_json::Value> {
        let mut seen = Vec::new();
        while let Some(event) = self.next(Duration::from_secs(15)).await {
            let hit = event["type"] == kind && event["node_id"] == node;
            seen.push(event);
            if hit {
                return seen;
            }
        }
        panic!("no {kind} for {node}; saw {seen:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_events_stream_in_order_with_typed_payloads() {
    let cluster = Cluster::start(
        "[auth]\napi_keys = [\"sk-client-events-0001\"]\nadmin_keys = [\"sk-admin-events-0001\"]\n",
        &body("http://127.0.0.1:9"),
    );
    // Operators only: a client key is refused.
    let denied = cluster
        .http()
        .with_key("sk-client-events-0001")
        .get("/v1/events")
        .await;
    assert_eq!(denied.status, 403);
    let response = cluster
        .http()
        .with_key("sk-admin-events-0001")
        .get_stream("/v1/events")
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()["content-type"].to_str().unwrap_or(""),
        "text/event-stream"
    );
    let mut events = Events {
        body: response.into_body(),
        buffer: String::new(),
    };

    let mut node = cluster.node("n1", "tok-1-long-enough-secret");
    let seen = events.until("node.ready", "n1").await;
    let kinds: Vec<&str> = seen.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(kinds, ["node.registered", "node.ready"], "{seen:?}");
    let generation = seen[1]["generation"].as_u64().expect("a generation");
    assert_eq!(seen[0]["generation"].as_u64(), Some(generation));
    let seqs: Vec<u64> = seen.iter().filter_map(|e| e["seq"].as_u64()).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    assert!(seen.iter().all(|e| e["at_ms"].as_u64().is_some()));
    // Its providers come up with it.
    let mut healthy = Vec::new();
    while healthy.len() < 2 {
        let e = events.next(Duration::from_secs(5)).await.expect("health");
        assert_eq!(e["type"], "provider.health", "{e}");
        assert_eq!(e["health"], "healthy", "{e}");
        healthy.push(e["provider_id"].as_str().unwrap_or("").to_owned());
    }
    healthy.sort();
    assert_eq!(healthy, ["mock", "oa"]);

    // Killed: fenced (with the reason), disconnected, providers offline.
    node.signal("KILL");
    let _ = node.wait_exit(Duration::from_secs(5));
    let seen = events.until("node.disconnected", "n1").await;
    let fenced = seen
        .iter()
        .find(|e| e["type"] == "node.fenced")
        .expect("fenced first");
    assert_eq!(fenced["generation"].as_u64(), Some(generation));
    assert!(
        ["peer_closed", "heartbeat_timeout"].contains(&fenced["reason"].as_str().unwrap_or("")),
        "{fenced}"
    );
    let offline = events.next(Duration::from_secs(5)).await.expect("health");
    assert_eq!(offline["type"], "provider.health");
    assert_eq!(offline["health"], "offline");

    // Back again: a new generation.
    let _node = cluster.node("n1", "tok-1-long-enough-secret");
    let seen = events.until("node.ready", "n1").await;
    let again = seen.last().and_then(|e| e["generation"].as_u64());
    assert!(again > Some(generation), "{seen:?}");
}
