//! Contract edge cases against the real Edge, with a node driven frame by frame (a
//! "rogue" written from the wire contract): silent streams whose caller left, cancels
//! settled by the node's terminal, bad messages that fail one run, superseded
//! connections told why, methods of the query routes, Ollama commands for other
//! adapters, and failed config refreshes.

use std::time::{Duration, Instant};

use iop_blackbox::client::{Cluster, next_sse};
use iop_blackbox::rogue::Rogue;
use iop_proto_core::wire::{
    Body, NodeConfigRefreshResponse, ProviderTunnelFrame, RefreshStatus, RunEvent, RunEventType,
    TunnelFrameKind,
};
use serde_json::{Value, json};

const TOKEN: &str = "rogue-token-0123456789";

fn body(capacity: u32) -> String {
    format!(
        r#"
[[nodes]]
id = "n1"
token = "{TOKEN}"
[[nodes.adapters]]
name = "run"
type = "mock"
capacity = {capacity}
targets = ["m"]
[[nodes.adapters]]
name = "oa"
type = "openai_compat"
base_url = "http://127.0.0.1:9"
capacity = {capacity}
targets = ["t"]

[[models]]
name = "chat"
providers = [{{ node = "n1", adapter = "run", target = "m" }}]
[[models]]
name = "tunnel"
providers = [{{ node = "n1", adapter = "oa", target = "t" }}]
"#
    )
}

fn ask(model: &str, stream: bool) -> Value {
    json!({"model": model, "stream": stream, "messages": [{"role": "user", "content": "x"}]})
}

fn event(run_id: &str, sequence: u64, kind: i32, delta: &str) -> Body {
    Body::RunEvent(RunEvent {
        run_id: run_id.into(),
        sequence,
        r#type: kind,
        delta: delta.into(),
        ..RunEvent::default()
    })
}

async fn run_request(rogue: &mut Rogue) -> String {
    match rogue
        .recv_until(|b| matches!(b, Body::RunRequest(_) | Body::ProviderTunnelRequest(_)))
        .await
    {
        Some(Body::RunRequest(r)) => r.run_id,
        Some(Body::ProviderTunnelRequest(t)) => t.run_id,
        other => panic!("no work: {other:?}"),
    }
}

async fn cancel_within(rogue: &mut Rogue, run_id: &str, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    loop {
        let left = limit.checked_sub(started.elapsed())?;
        match rogue.recv_within(left).await? {
            Body::CancelRequest(c) if c.run_id == run_id => return Some(started.elapsed()),
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_who_leaves_a_silent_stream_is_noticed_and_the_run_cancelled() {
    let cluster = Cluster::start("", &body(2));
    let (mut rogue, _) = Rogue::ready(&cluster, "n1", TOKEN).await;
    for model in ["chat", "tunnel"] {
        // The response head waits for the node's first event: ask in a task.
        let pending = tokio::spawn({
            let http = cluster.http();
            async move {
                http.post_stream("/v1/chat/completions", &ask(model, true))
                    .await
            }
        });
        let run = run_request(&mut rogue).await;
        if model == "chat" {
            rogue.send(event(&run, 0, RunEventType::Start as i32, ""));
            rogue.send(event(&run, 1, RunEventType::Delta as i32, "thinking"));
        } else {
            rogue.send(Body::ProviderTunnelFrame(ProviderTunnelFrame {
                run_id: run.clone(),
                sequence: 0,
                kind: TunnelFrameKind::Status as i32,
                status_code: 200,
                headers: vec![iop_proto_core::wire::Header {
                    name: "content-type".into(),
                    value: bytes::Bytes::from_static(b"text/event-stream"),
                }],
                ..ProviderTunnelFrame::default()
            }));
            let sent = rogue.send(Body::ProviderTunnelFrame(ProviderTunnelFrame {
                run_id: run.clone(),
                sequence: 1,
                kind: TunnelFrameKind::Body as i32,
                body: bytes::Bytes::from_static(b"data: {\"choices\":[]}\n\n"),
                ..ProviderTunnelFrame::default()
            }));
            assert!(
                sent,
                "the Edge closed the node link:\n{}",
                cluster.edge.log()
            );
        }
        let mut response = pending.await.expect("response");
        assert!(
            next_sse(response.body_mut(), Duration::from_secs(5))
                .await
                .is_some()
        );
        // While the provider is silent the stream carries SSE comments every 2 s: they
        // keep proxies from timing it out and expose a caller that vanished.
        let mut comment = false;
        let until = tokio::time::Instant::now() + Duration::from_secs(3);
        while !comment {
            use http_body_util::BodyExt;
            match tokio::time::timeout_at(until, response.body_mut().frame()).await {
                Ok(Some(Ok(frame))) => {
                    comment = frame
                        .into_data()
                        .is_ok_and(|d| d.starts_with(b": keep-alive"));
                }
                _ => break,
            }
        }
        assert!(comment, "{model}: no keep-alive comment on an idle stream");
        drop(response); // the caller leaves; the provider stays silent
        let took = cancel_within(&mut rogue, &run, Duration::from_secs(8))
            .await
            .unwrap_or_else(|| panic!("{model}: no CancelRequest while the provider was silent"));
        assert!(
            took < Duration::from_secs(6),
            "{model}: noticed after {took:?}"
        );
        // Settle the run so its lease returns.
        if model == "chat" {
            rogue.send(event(&run, 2, RunEventType::Cancelled as i32, ""));
        } else {
            rogue.send(Body::ProviderTunnelFrame(ProviderTunnelFrame {
                run_id: run.clone(),
                sequence: 2,
                kind: TunnelFrameKind::Error as i32,
                ..ProviderTunnelFrame::default()
            }));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_terminal_of_a_cancelled_run_frees_its_capacity_at_once() {
    let cluster = Cluster::start("", &body(1));
    let (mut rogue, _) = Rogue::ready(&cluster, "n1", TOKEN).await;
    let http = cluster.http();
    let first = tokio::spawn({
        let http = http.clone();
        async move { http.post("/v1/chat/completions", &ask("chat", false)).await }
    });
    let run = run_request(&mut rogue).await;
    rogue.send(event(&run, 0, RunEventType::Delta as i32, "early")); // no START
    let answer = first.await.expect("task");
    assert_eq!(
        answer.status,
        502,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    assert!(
        cancel_within(&mut rogue, &run, Duration::from_secs(2))
            .await
            .is_some()
    );
    // Capacity is 1: a second request waits until the first run's lease returns.
    let second = tokio::spawn({
        let http = http.clone();
        async move { http.post("/v1/chat/completions", &ask("chat", false)).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let cancelled_at = Instant::now();
    rogue.send(event(&run, 1, RunEventType::Cancelled as i32, ""));
    let next = run_request(&mut rogue).await;
    let waited = cancelled_at.elapsed();
    assert!(
        waited < Duration::from_millis(1000),
        "the lease came back {waited:?} after the terminal (cancel grace is 2 s)"
    );
    rogue.send(event(&next, 0, RunEventType::Start as i32, ""));
    rogue.send(event(&next, 1, RunEventType::Delta as i32, "ok"));
    rogue.send(event(&next, 2, RunEventType::Complete as i32, ""));
    assert_eq!(second.await.expect("task").status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_event_type_fails_that_call_and_the_node_keeps_serving() {
    let cluster = Cluster::start("", &body(2));
    let (mut rogue, _) = Rogue::ready(&cluster, "n1", TOKEN).await;
    let http = cluster.http();
    let spawn = |http: iop_blackbox::client::Http| {
        tokio::spawn(async move { http.post("/v1/chat/completions", &ask("chat", false)).await })
    };
    let (a, b) = (spawn(http.clone()), spawn(http.clone()));
    let (ra, rb) = (run_request(&mut rogue).await, run_request(&mut rogue).await);
    rogue.send(event(&ra, 0, RunEventType::Start as i32, ""));
    rogue.send(event(&rb, 0, RunEventType::Start as i32, ""));
    rogue.send(event(&ra, 1, 99, "from a newer node"));
    assert!(
        cancel_within(&mut rogue, &ra, Duration::from_secs(2))
            .await
            .is_some()
    );
    rogue.send(event(&rb, 1, RunEventType::Delta as i32, "fine"));
    rogue.send(event(&rb, 2, RunEventType::Complete as i32, ""));
    let (a, b) = (a.await.expect("a"), b.await.expect("b"));
    let statuses = [a.status, b.status];
    assert!(
        statuses.contains(&502) && statuses.contains(&200),
        "{statuses:?}"
    );
    let status = cluster.http().status().await;
    assert_eq!(
        status["nodes"][0]["connected"], true,
        "the connection stayed"
    );
    // A frame of an unknown kind for a tunnel: that call fails, the node stays.
    let c = tokio::spawn({
        let http = http.clone();
        async move {
            http.post("/v1/chat/completions", &ask("tunnel", false))
                .await
        }
    });
    let rc = run_request(&mut rogue).await;
    rogue.send(Body::ProviderTunnelFrame(ProviderTunnelFrame {
        run_id: rc,
        sequence: 0,
        kind: 17,
        ..ProviderTunnelFrame::default()
    }));
    assert_eq!(c.await.expect("c").status, 502);
    assert_eq!(cluster.http().status().await["nodes"][0]["connected"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_superseded_connection_is_told_why_before_it_is_closed() {
    let cluster = Cluster::start("", &body(2));
    let (mut old, _) = Rogue::ready(&cluster, "n1", TOKEN).await;
    let (_new, _) = Rogue::ready(&cluster, "n1", TOKEN).await;
    match old.recv().await {
        Some(Body::NodeReadyResponse(r)) => {
            assert!(!r.ready);
            assert!(r.reason.contains("superseded"), "{}", r.reason);
        }
        other => panic!("expected ready=false, got {other:?}"),
    }
    assert!(old.recv().await.is_none(), "then the connection closes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_routes_answer_405_for_other_methods_and_ollama_only_for_ollama() {
    let cluster = Cluster::start("", &body(2));
    let (mut rogue, _) = Rogue::ready(&cluster, "n1", TOKEN).await;
    let http = cluster.http();
    for (method, path, allow) in [
        ("POST", "/v1/nodes/n1/capabilities", "GET"),
        ("PUT", "/v1/nodes/n1/capabilities", "GET"),
        ("DELETE", "/v1/nodes/n1/transport", "GET"),
        ("POST", "/v1/nodes/n1/ollama/run/api/tags", "GET"),
        ("GET", "/v1/nodes/n1/ollama/run/api/show", "POST"),
        ("GET", "/v1/chat/completions", "POST"),
        ("POST", "/v1/models", "GET"),
    ] {
        let r = http.call(method, path).await;
        assert_eq!(r.status, 405, "{method} {path}");
        assert!(
            r.headers.iter().any(|(k, v)| k == "allow" && v == allow),
            "{method} {path}: {:?}",
            r.headers
        );
        assert_eq!(r.json()["error"]["code"], "method_not_allowed");
    }
    let r = http.get("/v1/nodes/n1/ollama/run/api/tags").await;
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"]["code"], "not_ollama_adapter");
    // None of these reached the node.
    assert!(
        rogue
            .recv_within(Duration::from_millis(500))
            .await
            .is_none_or(|b| !matches!(b, Body::NodeCommandRequest(_))),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_cannot_take_its_configuration_is_closed_and_registers_afresh() {
    let mut cluster = Cluster::start("", &body(2));
    let (mut rogue, _) = Rogue::ready(&cluster, "n1", TOKEN).await;
    cluster.rewrite(&body(3));
    cluster.edge.signal("HUP");
    let request_id = match rogue
        .recv_until(|b| matches!(b, Body::NodeConfigRefreshRequest(_)))
        .await
    {
        Some(Body::NodeConfigRefreshRequest(r)) => r.request_id,
        other => panic!("no refresh: {other:?}"),
    };
    rogue.send(Body::NodeConfigRefreshResponse(NodeConfigRefreshResponse {
        request_id,
        status: RefreshStatus::Failed as i32,
        message: "cannot start adapter".into(),
        revision: 1,
    }));
    // Nothing in flight: closed at once, so that it registers again.
    assert!(rogue.recv().await.is_none(), "the connection is closed");
    let log = cluster.edge.log();
    assert!(log.contains("cannot take its configuration"), "{log}");
    let (_again, answer) = Rogue::ready(&cluster, "n1", TOKEN).await;
    let capacities: Vec<u32> = answer
        .config
        .expect("config")
        .adapters
        .iter()
        .map(|a| a.capacity)
        .collect();
    assert_eq!(capacities, vec![3, 3], "the new configuration, at register");
}
