//! Resilient routing through the real binaries: two Nodes serve one model, one healthy
//! and one broken in each of the ways a provider breaks (it refuses connections, answers
//! 500, answers 503 with `Retry-After`, accepts and never answers, or is a normalized
//! run that fails right after its start). Every caller must succeed, streamed or not;
//! the broken provider is ejected, and seen so in `/v1/status` and `/v1/events`, and
//! comes back once it recovers. A caller's own 400 is answered as it is and ejects
//! nothing; with every provider broken, callers get a clear error quickly, and the
//! attempts stay within their limit.

use std::time::{Duration, Instant};

use iop_blackbox::client::{Cluster, read_sse};
use iop_blackbox::fake::{self, Behaviour, Flavor};
use iop_blackbox::{free_port, mock_answer};
use serde_json::{Value, json};

const TOKEN: &str = "routing-token-0123456789";

/// Short routing timers, so a stalled provider and an ejection take a test second.
const ROUTING: &str =
    "[routing]\nfirst_byte_timeout_sec = 1\neject_base_sec = 1\neject_max_sec = 2\n";

/// An OpenAI-compatible adapter at `url`.
fn tunnel_adapter(url: &str) -> String {
    format!(
        "[[nodes.adapters]]\nname = \"api\"\ntype = \"openai_compat\"\nbase_url = \"{url}\"\ncapacity = 4\ntargets = [\"m\"]\n"
    )
}

/// A mock adapter (served as normalized runs) failing as `fail` says.
fn mock_adapter(fail: &str) -> String {
    format!(
        "[[nodes.adapters]]\nname = \"api\"\ntype = \"mock\"\ncapacity = 4\ntargets = [\"m\"]\n[nodes.adapters.options]\ntokens = \"5\"\ntoken_delay_ms = \"1\"\nfail = \"{fail}\"\n"
    )
}

/// Nodes `n1` and `n2` with the given adapters, both serving model `chat`.
fn two_nodes(n1: &str, n2: &str) -> String {
    format!(
        "[[nodes]]\nid = \"n1\"\ntoken = \"{TOKEN}-1\"\n{n1}\n[[nodes]]\nid = \"n2\"\ntoken = \"{TOKEN}-2\"\n{n2}\n\
         [[models]]\nname = \"chat\"\nproviders = [{{ node = \"n1\", adapter = \"api\", target = \"m\" }}, {{ node = \"n2\", adapter = \"api\", target = \"m\" }}]\n"
    )
}

async fn start(n1: &str, n2: &str) -> (Cluster, [iop_blackbox::Proc; 2]) {
    let cluster = Cluster::start(ROUTING, &two_nodes(n1, n2));
    let nodes = [
        cluster.node("n1", &format!("{TOKEN}-1")),
        cluster.node("n2", &format!("{TOKEN}-2")),
    ];
    cluster.wait_ready("n1").await;
    cluster.wait_ready("n2").await;
    (cluster, nodes)
}

fn ask(stream: bool) -> Value {
    json!({"model": "chat", "stream": stream, "messages": [{"role": "user", "content": "hello"}]})
}

/// What one caller got.
#[derive(Debug)]
enum Got {
    Ok,
    Failed(String),
}

/// One request, plain or streamed, read to its end.
async fn one(cluster: &Cluster, stream: bool) -> Got {
    let http = cluster.http();
    if !stream {
        let r = http.post("/v1/chat/completions", &ask(false)).await;
        if r.status == 200 && r.json()["choices"][0]["message"]["content"].is_string() {
            return Got::Ok;
        }
        return Got::Failed(format!("{} {}", r.status, String::from_utf8_lossy(&r.body)));
    }
    let mut response = http.post_stream("/v1/chat/completions", &ask(true)).await;
    let status = response.status().as_u16();
    let (events, ended) = read_sse(response.body_mut(), Duration::from_secs(30)).await;
    let errored = events.iter().any(|e| e.contains("\"error\""));
    if status == 200 && ended && !errored && events.last().is_some_and(|e| e == "[DONE]") {
        Got::Ok
    } else {
        Got::Failed(format!("{status} ended={ended} {events:?}"))
    }
}

/// `n` requests (a multiple of four), one in five streamed, four at a time: what
/// failed.
async fn load(cluster: &Cluster, n: usize) -> Vec<String> {
    let mut failed = Vec::new();
    for i in (0..n).step_by(4) {
        let stream = |k: usize| (i + k) % 5 == 4;
        let answers = tokio::join!(
            one(cluster, stream(0)),
            one(cluster, stream(1)),
            one(cluster, stream(2)),
            one(cluster, stream(3)),
        );
        for answer in [answers.0, answers.1, answers.2, answers.3] {
            if let Got::Failed(why) = answer {
                failed.push(why);
            }
        }
    }
    failed
}

/// `n2`'s provider as `/v1/status` shows it.
async fn n2_routing(cluster: &Cluster) -> Value {
    cluster.provider("n2", "api").await
}

/// Survives a broken n2: 100 callers succeed; n2 is seen ejected (with `reason` when
/// given) in the events, and never n1. Returns the cluster, its Nodes still running.
async fn survives(n1: &str, n2: &str, reason: Option<&str>) -> (Cluster, [iop_blackbox::Proc; 2]) {
    let (cluster, nodes) = start(n1, n2).await;
    let failed = load(&cluster, 100).await;
    assert!(
        failed.is_empty(),
        "{} of 100 failed: {failed:?}\n{}",
        failed.len(),
        cluster.edge.log()
    );
    let events = cluster.kept_events().await;
    let ejected: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "provider.ejected" && e["node_id"] == "n2")
        .collect();
    assert!(
        !ejected.is_empty(),
        "n2 never ejected: {events:?}\n{}",
        n2_routing(&cluster).await
    );
    if let Some(reason) = reason {
        assert_eq!(ejected[0]["reason"], reason, "{ejected:?}");
    }
    assert!(
        !events
            .iter()
            .any(|e| e["type"] == "provider.ejected" && e["node_id"] == "n1"),
        "the healthy provider was ejected: {events:?}"
    );
    // Each ejection announced once: a new one only after the last one's time (1 s here)
    // ran out and its probe failed.
    for pair in ejected.windows(2) {
        let apart = pair[1]["at_ms"].as_u64().unwrap_or(0) - pair[0]["at_ms"].as_u64().unwrap_or(0);
        assert!(apart >= 900, "ejected twice within {apart} ms: {ejected:?}");
    }
    (cluster, nodes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_refusing_connections_fails_no_caller() {
    let ok = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    // A port nothing listens on.
    let closed = format!("http://127.0.0.1:{}", free_port());
    survives(&tunnel_adapter(&ok.url()), &tunnel_adapter(&closed), None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_answering_500_fails_no_caller_and_comes_back_once_it_recovers() {
    let ok = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let broken = fake::start(
        Flavor::OpenAi,
        Behaviour {
            status: Some(500),
            ..Behaviour::default()
        },
    )
    .await;
    let (cluster, nodes) = start(&tunnel_adapter(&ok.url()), &tunnel_adapter(&broken.url())).await;
    let failed = load(&cluster, 100).await;
    assert!(failed.is_empty(), "{failed:?}");
    // Ejected after a few failures, not after every request tried it.
    let tried = broken.state.requests().len();
    assert!(
        tried < 30,
        "the broken provider got {tried} of 100 requests"
    );
    assert_eq!(n2_routing(&cluster).await["health"], "degraded");
    // It recovers: the next probe restores it, and it serves again.
    broken.state.set(|b| b.status = None);
    let restored = wait_for(&cluster, |e| {
        e["type"] == "provider.restored" && e["node_id"] == "n2"
    })
    .await;
    assert!(restored, "n2 never restored:\n{}", cluster.edge.log());
    let before = broken.state.requests().len();
    assert!(load(&cluster, 40).await.is_empty());
    assert!(
        broken.state.requests().len() > before + 5,
        "the recovered provider takes its share again"
    );
    assert_eq!(n2_routing(&cluster).await["routing"]["standing"], "live");
    drop(nodes);
}

/// Sends requests until the kept events include one `matches` (at most 20 s).
async fn wait_for(cluster: &Cluster, matches: impl Fn(&Value) -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let _ = one(cluster, false).await;
        if cluster.kept_events().await.iter().any(&matches) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_answering_503_with_retry_after_is_cooled_down() {
    let ok = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let busy = fake::start(
        Flavor::OpenAi,
        Behaviour {
            status: Some(503),
            retry_after: Some(30),
            ..Behaviour::default()
        },
    )
    .await;
    let (cluster, _nodes) = survives(
        &tunnel_adapter(&ok.url()),
        &tunnel_adapter(&busy.url()),
        Some("retry_after"),
    )
    .await;
    // Cooled down for the 30 s it asked for: it gets nothing more meanwhile.
    let tried = busy.state.requests().len();
    assert!(load(&cluster, 20).await.is_empty());
    assert_eq!(
        busy.state.requests().len(),
        tried,
        "asked to wait, it is left alone"
    );
    let routing = n2_routing(&cluster).await;
    assert_eq!(routing["routing"]["standing"], "ejected", "{routing}");
    assert!(
        routing["routing"]["ejected_for_ms"].as_u64().unwrap_or(0) > 20_000,
        "{routing}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_never_answers_fails_no_caller() {
    let ok = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let stalled = fake::start(
        Flavor::OpenAi,
        Behaviour {
            hang: true,
            ..Behaviour::default()
        },
    )
    .await;
    let started = Instant::now();
    survives(
        &tunnel_adapter(&ok.url()),
        &tunnel_adapter(&stalled.url()),
        None,
    )
    .await;
    // Tried beside after a second without a first byte, and soon not tried at all.
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_failing_right_after_its_start_fails_no_caller() {
    survives(&mock_adapter("never"), &mock_adapter("always"), None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_400_is_answered_as_it_is_and_ejects_nothing() {
    let refusing = |url: &str| tunnel_adapter(url);
    let a = fake::start(
        Flavor::OpenAi,
        Behaviour {
            reject_tools: true,
            ..Behaviour::default()
        },
    )
    .await;
    let b = fake::start(
        Flavor::OpenAi,
        Behaviour {
            reject_tools: true,
            ..Behaviour::default()
        },
    )
    .await;
    let (cluster, _nodes) = start(&refusing(&a.url()), &refusing(&b.url())).await;
    let with_tools = json!({
        "model": "chat",
        "messages": [{"role": "user", "content": "hello"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    });
    for _ in 0..10 {
        let r = cluster
            .http()
            .post("/v1/chat/completions", &with_tools)
            .await;
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    }
    assert_eq!(
        a.state.requests().len() + b.state.requests().len(),
        10,
        "each 400 tried once"
    );
    let events = cluster.kept_events().await;
    assert!(
        !events.iter().any(|e| e["type"] == "provider.ejected"),
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_provider_broken_callers_get_a_clear_error_quickly_within_the_attempts() {
    let broken = Behaviour {
        status: Some(500),
        ..Behaviour::default()
    };
    let a = fake::start(Flavor::OpenAi, broken.clone()).await;
    let b = fake::start(Flavor::OpenAi, broken).await;
    let (cluster, _nodes) = start(&tunnel_adapter(&a.url()), &tunnel_adapter(&b.url())).await;
    let mut slowest = Duration::ZERO;
    for _ in 0..30 {
        let started = Instant::now();
        let r = cluster
            .http()
            .post("/v1/chat/completions", &ask(false))
            .await;
        slowest = slowest.max(started.elapsed());
        assert!(
            r.status >= 500,
            "{} {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        );
        assert!(
            r.json()["error"]["message"].is_string(),
            "OpenAI-shaped: {:?}",
            r.json()
        );
    }
    // A request whose other provider is ejected waits for its probe (at most
    // `eject_max_sec`, 2 s here) rather than failing at once: it may have recovered.
    assert!(
        slowest < Duration::from_secs(3),
        "slowest failure took {slowest:?}"
    );
    let attempts = a.state.requests().len() + b.state.requests().len();
    // At most one try per provider of the group (two) for each request.
    assert!(
        attempts <= 60,
        "{attempts} upstream attempts for 30 requests"
    );
    let metrics = cluster.admin().get("/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    assert!(text.contains("iop_upstream_attempts_total"), "{text}");
}

/// A request that is not streamed gets its answer whole: a Node killed while it runs the
/// answer (after its first words, before its end) costs the caller nothing, since the
/// run is tried again on the other Node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_answer_whose_node_is_killed_midway_is_answered_by_the_other_node() {
    // 40 words, 50 ms apart: two seconds each, streamed to the Edge as they come.
    let slow = "[[nodes.adapters]]\nname = \"api\"\ntype = \"mock\"\ncapacity = 4\ntargets = [\"m\"]\n\
                [nodes.adapters.options]\ntokens = \"40\"\ntoken_delay_ms = \"50\"\n";
    let (cluster, mut nodes) = start(slow, slow).await;
    let asks = (0..8).map(|_| one(&cluster, false));
    let killer = async {
        tokio::time::sleep(Duration::from_millis(700)).await;
        nodes[0].signal("KILL");
    };
    let (answers, ()) = tokio::join!(futures_join_all(asks), killer);
    let failed: Vec<String> = answers
        .into_iter()
        .filter_map(|got| match got {
            Got::Ok => None,
            Got::Failed(why) => Some(why),
        })
        .collect();
    assert!(failed.is_empty(), "{failed:?}\n{}", cluster.edge.log());
    let _ = nodes[0].wait_exit(Duration::from_secs(5));
}

/// Runs every future in `asks` at once and collects their outputs in order.
async fn futures_join_all<F: std::future::Future>(asks: impl Iterator<Item = F>) -> Vec<F::Output> {
    let handles: Vec<_> = asks.map(Box::pin).collect();
    let mut out = Vec::with_capacity(handles.len());
    let mut pending: Vec<_> = handles.into_iter().map(Some).collect();
    let mut results: Vec<Option<F::Output>> = (0..pending.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut all = true;
        for (slot, result) in pending.iter_mut().zip(results.iter_mut()) {
            if let Some(fut) = slot {
                match fut.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        *result = Some(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => all = false,
                }
            }
        }
        if all {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    out.extend(results.into_iter().flatten());
    out
}

/// One provider hangs; the other has room for one request at a time. Requests on the
/// hung one are tried beside it on the other as it frees, one after another (a wait
/// beside a hung run that times out is renewed, never given up), so every caller is
/// answered, well within its response deadline (30 s here), none left to the hung run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_provider_beside_a_full_one_answers_every_caller_by_its_deadline() {
    let busy = fake::start(
        Flavor::OpenAi,
        Behaviour {
            whole_delay: Duration::from_millis(700),
            ..Behaviour::default()
        },
    )
    .await;
    let hung = fake::start(
        Flavor::OpenAi,
        Behaviour {
            hang: true,
            ..Behaviour::default()
        },
    )
    .await;
    let one_slot = format!(
        "[[nodes.adapters]]\nname = \"api\"\ntype = \"openai_compat\"\nbase_url = \"{}\"\ncapacity = 1\ntargets = [\"m\"]\n",
        busy.url()
    );
    let head = format!("{ROUTING}[queue]\nwait_timeout_ms = 1500\n");
    let cluster = Cluster::start(&head, &two_nodes(&one_slot, &tunnel_adapter(&hung.url())));
    let _nodes = [
        cluster.node("n1", &format!("{TOKEN}-1")),
        cluster.node("n2", &format!("{TOKEN}-2")),
    ];
    cluster.wait_ready("n1").await;
    cluster.wait_ready("n2").await;
    let started = Instant::now();
    let asks = (0..5).map(|_| async {
        let r = cluster
            .http()
            .post("/v1/chat/completions", &ask(false))
            .await;
        (r.status, started.elapsed())
    });
    let answers = futures_join_all(asks).await;
    for (status, after) in &answers {
        assert_eq!(
            *status,
            200,
            "after {after:?}: {answers:?}\n{}",
            cluster.edge.log()
        );
        assert!(
            *after < Duration::from_secs(20),
            "answered after {after:?}: {answers:?}"
        );
    }
    assert!(
        hung.state.requests().len() >= 2,
        "the hung provider was tried: {}",
        hung.state.requests().len()
    );
}

// ----- a stream that survives its provider (issue 73) -----

/// A mock adapter that a lost stream may be continued on, `words` words long, failing as
/// `fail` says.
fn resuming_mock(fail: &str, words: u32, delay_ms: u32) -> String {
    format!(
        "[[nodes.adapters]]\nname = \"api\"\ntype = \"mock\"\ncapacity = 64\ntargets = [\"m\"]\n[nodes.adapters.options]\n\
         tokens = \"{words}\"\ntoken_delay_ms = \"{delay_ms}\"\nfail = \"{fail}\"\nresume = \"true\"\n"
    )
}

/// One streamed answer as a caller reads it.
#[derive(Debug)]
struct Streamed {
    text: String,
    /// Chunks that name the role, ids seen, whether it ended well.
    roles: usize,
    ids: std::collections::BTreeSet<String>,
    whole: bool,
}

async fn stream_chat(cluster: &Cluster, model: &str) -> Streamed {
    let ask =
        json!({"model": model, "stream": true, "messages": [{"role": "user", "content": "hello"}]});
    let mut response = cluster
        .http()
        .post_stream("/v1/chat/completions", &ask)
        .await;
    let status = response.status().as_u16();
    let (events, ended) = read_sse(response.body_mut(), Duration::from_secs(60)).await;
    let mut got = Streamed {
        text: String::new(),
        roles: 0,
        ids: Default::default(),
        whole: status == 200 && ended && events.last().is_some_and(|e| e == "[DONE]"),
    };
    for event in events.iter().filter(|e| *e != "[DONE]") {
        let chunk: Value = serde_json::from_str(event).unwrap_or_default();
        if chunk.get("error").is_some() {
            got.whole = false;
        }
        if let Some(id) = chunk["id"].as_str() {
            got.ids.insert(id.to_owned());
        }
        let delta = &chunk["choices"][0]["delta"];
        if delta.get("role").is_some() {
            got.roles += 1;
        }
        if let Some(text) = delta["content"].as_str() {
            got.text.push_str(text);
        }
    }
    got
}

/// The text of one streamed Messages answer, and how many `message_start` events it had.
async fn stream_messages(cluster: &Cluster) -> (String, usize, bool) {
    let ask = json!({"model": "chat", "stream": true, "max_tokens": 1000, "messages": [{"role": "user", "content": "hello"}]});
    let mut response = cluster.http().post_stream("/v1/messages", &ask).await;
    let (events, ended) = read_sse(response.body_mut(), Duration::from_secs(60)).await;
    let mut text = String::new();
    let mut starts = 0;
    let mut stopped = false;
    for event in &events {
        let e: Value = serde_json::from_str(event).unwrap_or_default();
        match e["type"].as_str() {
            Some("message_start") => starts += 1,
            Some("content_block_delta") => text.push_str(e["delta"]["text"].as_str().unwrap_or("")),
            Some("message_stop") => stopped = true,
            _ => {}
        }
    }
    (text, starts, ended && stopped)
}

/// A provider whose stream fails after five words, beside one that does not: every
/// stream that lands on it is continued on the other, and its caller reads one
/// uninterrupted answer, byte for byte the one an unbroken provider gives (one role
/// chunk, one id; one `message_start` for the Messages API). With `resume_limit = 0`
/// the break reaches the caller, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_broken_midway_is_continued_byte_for_byte_elsewhere() {
    broken_midway("").await;
}

/// The same over raw tunnels: the Edge reads the provider's chat completion stream as it
/// passes, and joins the continuation's to it (the Messages and Responses APIs are
/// translated from it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnelled_stream_broken_midway_is_continued_byte_for_byte_elsewhere() {
    broken_midway("dispatch = \"tunnel\"\n").await;
}

async fn broken_midway(extra: &str) {
    let words = 30;
    let nodes = format!(
        "{}[[models]]\nname = \"off\"\nresume_limit = 0\nproviders = [{{ node = \"n1\", adapter = \"api\", target = \"m\" }}]\n",
        two_nodes(
            &(resuming_mock("after:5", words, 2) + extra),
            &(resuming_mock("never", words, 2) + extra)
        )
    );
    let cluster = std::sync::Arc::new(Cluster::start(ROUTING, &nodes));
    let _nodes = [
        cluster.node("n1", &format!("{TOKEN}-1")),
        cluster.node("n2", &format!("{TOKEN}-2")),
    ];
    cluster.wait_ready("n1").await;
    cluster.wait_ready("n2").await;
    let reference = mock_answer(words as usize);
    let answers = futures_join(&cluster, 24).await;
    for got in &answers {
        assert!(got.whole, "{got:?}\n{}", cluster.edge.log());
        assert_eq!(got.text, reference, "{got:?}");
        assert_eq!(got.roles, 1, "one role chunk: {got:?}");
        assert_eq!(got.ids.len(), 1, "one id: {got:?}");
    }
    let log = cluster.edge.log();
    let resumed = log.matches("continuing it on another provider").count();
    eprintln!("24 streams, {resumed} continued after n1 broke them midway; all byte-identical");
    assert!(
        resumed > 0,
        "no stream landed on the broken provider?\n{log}"
    );
    for _ in 0..4 {
        let (text, starts, whole) = stream_messages(&cluster).await;
        assert!(whole && starts == 1, "{text:?} {starts}");
        assert_eq!(text, reference);
    }
    for _ in 0..4 {
        let ask = json!({"model": "chat", "stream": true, "input": "hello"});
        let mut response = cluster.http().post_stream("/v1/responses", &ask).await;
        let (events, _) = read_sse(response.body_mut(), Duration::from_secs(60)).await;
        let mut text = String::new();
        let (mut created, mut completed) = (0, 0);
        for event in &events {
            let e: Value = serde_json::from_str(event).unwrap_or_default();
            match e["type"].as_str() {
                Some("response.created") => created += 1,
                Some("response.completed") => completed += 1,
                Some("response.output_text.delta") => {
                    text.push_str(e["delta"].as_str().unwrap_or(""))
                }
                _ => {}
            }
        }
        assert_eq!((created, completed), (1, 1), "{events:?}");
        assert_eq!(text, reference);
    }
    // Turned off: the caller sees the break.
    let off = stream_chat(&cluster, "off").await;
    assert!(!off.whole, "{off:?}");
    assert_eq!(off.text, mock_answer(5) + " ", "{off:?}");
}

async fn futures_join(cluster: &std::sync::Arc<Cluster>, n: usize) -> Vec<Streamed> {
    let mut tasks = Vec::new();
    for _ in 0..n {
        let cluster = cluster.clone();
        tasks.push(tokio::spawn(
            async move { stream_chat(&cluster, "chat").await },
        ));
    }
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.expect("caller"));
    }
    out
}

/// Three nodes, 60 streams of 150 words at once; the node serving a third of them is
/// killed with `kill -9` midway. Every stream ends normally, byte for byte the answer an
/// unbroken provider gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_survive_a_node_killed_midway() {
    let words = 150;
    let mock = resuming_mock("never", words, 10);
    let nodes = format!(
        "[[nodes]]\nid = \"n1\"\ntoken = \"{TOKEN}-1\"\n{mock}\n[[nodes]]\nid = \"n2\"\ntoken = \"{TOKEN}-2\"\n{mock}\n\
         [[nodes]]\nid = \"n3\"\ntoken = \"{TOKEN}-3\"\n{mock}\n[[models]]\nname = \"chat\"\nproviders = [{{ node = \"n1\", adapter = \"api\", target = \"m\" }}, \
         {{ node = \"n2\", adapter = \"api\", target = \"m\" }}, {{ node = \"n3\", adapter = \"api\", target = \"m\" }}]\n"
    );
    let cluster = std::sync::Arc::new(Cluster::start(ROUTING, &nodes));
    let procs = [
        cluster.node("n1", &format!("{TOKEN}-1")),
        cluster.node("n2", &format!("{TOKEN}-2")),
        cluster.node("n3", &format!("{TOKEN}-3")),
    ];
    for n in ["n1", "n2", "n3"] {
        cluster.wait_ready(n).await;
    }
    let reference = mock_answer(words as usize);
    let callers = {
        let cluster = cluster.clone();
        tokio::spawn(async move { futures_join(&cluster, 60).await })
    };
    tokio::time::sleep(Duration::from_millis(700)).await;
    procs[0].signal("KILL");
    let answers = callers.await.expect("callers");
    let broken: Vec<&Streamed> = answers
        .iter()
        .filter(|g| !g.whole || g.text != reference)
        .collect();
    let log = cluster.edge.log();
    let resumed = log.matches("continuing it on another provider").count();
    eprintln!(
        "kill -9 of n1 under 60 streams: {resumed} continued elsewhere, {} not whole and identical",
        broken.len()
    );
    assert!(broken.is_empty(), "{broken:?}\n{log}");
    assert!(resumed >= 10, "n1 served few streams? {resumed}\n{log}");
    for got in &answers {
        assert_eq!((got.roles, got.ids.len()), (1, 1), "{got:?}");
    }
}
