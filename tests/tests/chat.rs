//! Chat, completions and embeddings through the real binaries, in both dispatch shapes,
//! with tool calls, errors, status and metrics.

use std::time::Duration;

use iop_blackbox::Proc;
use iop_blackbox::client::{Cluster, next_sse, read_sse};
use iop_blackbox::fake::{self, Behaviour, Flavor};
use serde_json::{Value, json};

fn body(oa: &str, ollama: &str) -> String {
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
[nodes.adapters.options]
token_delay_ms = "2"
reply = "alpha beta gamma"
[[nodes.adapters]]
name = "oa"
type = "openai_compat"
base_url = "{oa}"
api_key = "provider-secret"
capacity = 2
targets = ["gpt-x"]
[[nodes.adapters]]
name = "oa-run"
type = "openai_compat"
base_url = "{oa}"
capacity = 2
targets = ["gpt-x"]
[nodes.adapters.options]
dispatch = "run"
[[nodes.adapters]]
name = "ol"
type = "ollama"
base_url = "{ollama}"
capacity = 2
targets = ["llama3:8b"]
[[nodes.adapters]]
name = "vl"
type = "vllm"
base_url = "{oa}"
capacity = 2
targets = ["gpt-x"]

[[models]]
name = "mock-chat"
providers = [{{ node = "n1", adapter = "mock", target = "m" }}]
[[models]]
name = "tunnel-chat"
providers = [{{ node = "n1", adapter = "oa", target = "gpt-x" }}]
[[models]]
name = "run-chat"
providers = [{{ node = "n1", adapter = "oa-run", target = "gpt-x" }}]
[[models]]
name = "vllm-chat"
providers = [{{ node = "n1", adapter = "vl", target = "gpt-x" }}]
[[models]]
name = "ollama-chat"
providers = [{{ node = "n1", adapter = "ol", target = "llama3:8b" }}]
"#
    )
}

/// An Edge serving `body(oa, ollama)` with node n1 running and ready.
async fn ready_cluster(oa: &str, ollama: &str) -> (Cluster, Proc) {
    let cluster = Cluster::start("", &body(oa, ollama));
    let node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    (cluster, node)
}

fn chat(model: &str, stream: bool) -> Value {
    json!({"model": model, "stream": stream, "messages": [{"role": "user", "content": "hello \"there\""}]})
}

fn content(response: &Value) -> String {
    response["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_owned()
}

fn streamed_text(events: &[String]) -> String {
    events
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completions_through_both_shapes_and_embeddings_through_the_tunnel() {
    let oa = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let ol = fake::start(Flavor::Ollama, Behaviour::default()).await;
    let (cluster, _node) = ready_cluster(&oa.url(), &ol.url()).await;
    let http = cluster.http();

    // Normalized run (mock): whole and streamed.
    let r = http
        .post("/v1/chat/completions", &chat("mock-chat", false))
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let v = r.json();
    assert_eq!(content(&v), "alpha beta gamma");
    assert_eq!(v["model"], "mock-chat");
    assert_eq!(v["object"], "chat.completion");
    assert!(
        v["usage"]["completion_tokens"]
            .as_u64()
            .is_some_and(|n| n == 3)
    );
    let mut s = http
        .post_stream("/v1/chat/completions", &chat("mock-chat", true))
        .await;
    assert_eq!(s.status(), 200);
    assert_eq!(s.headers()["content-type"], "text/event-stream");
    let (events, ended) = read_sse(s.body_mut(), Duration::from_secs(10)).await;
    assert!(ended);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(streamed_text(&events), "alpha beta gamma");

    // Raw tunnel: the body reaches the provider byte for byte except the model.
    let raw = r#"{"model":"tunnel-chat",  "messages":[{"role":"user","content":"keep \u00e9 these bytes"}],"temperature":0.5}"#;
    let r = http.post_raw("/v1/chat/completions", raw).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(content(&r.json()), "w0 w1 w2 ");
    let seen = oa
        .state
        .requests()
        .last()
        .cloned()
        .expect("provider saw it");
    assert_eq!(seen.path, "/v1/chat/completions");
    assert_eq!(
        std::str::from_utf8(&seen.body).expect("utf8"),
        raw.replace("\"tunnel-chat\"", "\"gpt-x\"")
    );
    let auth: Vec<_> = seen
        .headers
        .iter()
        .filter(|(k, _)| k == "authorization")
        .collect();
    assert_eq!(
        auth,
        vec![&(
            "authorization".to_owned(),
            "Bearer provider-secret".to_owned()
        )]
    );

    let mut s = http
        .post_stream("/v1/chat/completions", &chat("tunnel-chat", true))
        .await;
    assert_eq!(s.status(), 200);
    let (events, ended) = read_sse(s.body_mut(), Duration::from_secs(10)).await;
    assert!(ended);
    assert_eq!(streamed_text(&events), "w0 w1 w2 ");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));

    // Ollama as a normalized run.
    let r = http
        .post("/v1/chat/completions", &chat("ollama-chat", false))
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(content(&r.json()), "w0 w1 w2 ");
    assert_eq!(r.json()["usage"]["prompt_tokens"], 5);

    // Embeddings and completions go through the tunnel.
    let r = http
        .post(
            "/v1/embeddings",
            &json!({"model": "tunnel-chat", "input": "hi"}),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["data"][0]["embedding"], json!([0.25, -0.5, 1.0]));
    let r = http
        .post(
            "/v1/completions",
            &json!({"model": "tunnel-chat", "prompt": "hi"}),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["choices"][0]["text"], "fake completion");
    // ...but not to a provider that only runs chats.
    let r = http
        .post(
            "/v1/embeddings",
            &json!({"model": "mock-chat", "input": "hi"}),
        )
        .await;
    assert_eq!(r.status, 400);

    // Models, status (no addresses or tokens), metrics, health.
    let models = http.get("/v1/models").await.json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(
        ids,
        vec![
            "mock-chat",
            "ollama-chat",
            "run-chat",
            "tunnel-chat",
            "vllm-chat"
        ]
    );
    // One model, as the SDK's models.retrieve asks for it; an unknown one is OpenAI's 404.
    let one = http.get("/v1/models/mock-chat").await;
    assert_eq!(one.status, 200);
    assert_eq!(one.json()["id"], "mock-chat");
    assert_eq!(one.json()["object"], "model");
    let missing = http.get("/v1/models/no-such-model").await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json()["error"]["code"], "model_not_found");
    assert_eq!(
        http.call("DELETE", "/v1/models/mock-chat").await.status,
        405
    );
    // vLLM is an OpenAI-compatible tunnel too.
    let r = http
        .post("/v1/chat/completions", &chat("vllm-chat", false))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(content(&r.json()), "w0 w1 w2 ");
    let status = http.get("/v1/status").await;
    let text = String::from_utf8_lossy(&status.body).into_owned();
    for secret in [
        "tok-1-long-enough-secret",
        "provider-secret",
        "127.0.0.1",
        &oa.addr.port().to_string(),
    ] {
        assert!(!text.contains(secret), "status leaks {secret}: {text}");
    }
    let status = status.json();
    assert_eq!(status["nodes"][0]["connected"], true);
    // The version the node registered with (the node binary's own) and its labels.
    assert!(
        status["nodes"][0]["version"]
            .as_str()
            .is_some_and(|v| v.split('.').count() == 3),
        "{status}"
    );
    assert!(status["nodes"][0]["labels"].is_object(), "{status}");
    let mock = cluster.provider("n1", "mock").await;
    assert_eq!(
        (
            mock["status"].as_str(),
            mock["health"].as_str(),
            mock["capacity"].as_u64(),
            mock["in_flight"].as_u64()
        ),
        (Some("available"), Some("healthy"), Some(2), Some(0))
    );
    assert_eq!(cluster.provider("n1", "oa").await["category"], "api");
    assert_eq!(mock["category"], "local_inference");
    let metrics = String::from_utf8_lossy(&http.get("/metrics").await.body).into_owned();
    assert!(
        metrics.contains("iop_http_requests_total{model=\"mock-chat\",status=\"200\"} 2"),
        "{metrics}"
    );
    assert!(metrics.contains("iop_nodes_ready 1"));
    assert!(metrics.contains("iop_node_frames_total{direction=\"in\"}"));
    assert_eq!(http.get("/healthz").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_native_and_text_fallback() {
    let oa = fake::start(
        Flavor::OpenAi,
        Behaviour {
            tool_calls: true,
            ..Behaviour::default()
        },
    )
    .await;
    let ol = fake::start(
        Flavor::Ollama,
        Behaviour {
            tool_calls: true,
            ..Behaviour::default()
        },
    )
    .await;
    let (cluster, _node) = ready_cluster(&oa.url(), &ol.url()).await;
    let http = cluster.http();
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    let ask = |model: &str, stream: bool| {
        json!({"model": model, "stream": stream, "tools": tools, "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "weather in Seoul?"}]})
    };

    // Native tool calls through a normalized run: restored from openai_tool_calls.
    for model in ["run-chat", "ollama-chat"] {
        let v = http
            .post("/v1/chat/completions", &ask(model, false))
            .await
            .json();
        assert_eq!(
            v["choices"][0]["finish_reason"], "tool_calls",
            "{model}: {v}"
        );
        let call = &v["choices"][0]["message"]["tool_calls"][0];
        assert_eq!(call["function"]["name"], "get_weather", "{model}");
        let args: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().expect("string"))
                .expect("json");
        assert_eq!(args["city"], "Seoul", "{model}");
        let mut s = http
            .post_stream("/v1/chat/completions", &ask(model, true))
            .await;
        let (events, _) = read_sse(s.body_mut(), Duration::from_secs(10)).await;
        let call_events: Vec<Value> = events
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .filter(|v| v["choices"][0]["delta"]["tool_calls"].is_array())
            .collect();
        assert_eq!(call_events.len(), 1, "{model}: {events:?}");
        assert_eq!(
            call_events[0]["choices"][0]["delta"]["tool_calls"][0]["index"],
            0
        );
    }

    // Native tool calls through the tunnel: passed through as the provider sent them.
    let v = http
        .post("/v1/chat/completions", &ask("tunnel-chat", false))
        .await
        .json();
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"][0]["id"],
        "call_fake"
    );

    // A backend that rejects tools: one retry without them, instruction in the system message,
    // the text tool call restored because the node marked the fallback.
    oa.state.set(|b| {
        b.tool_calls = false;
        b.reject_tools = true;
    });
    let before = oa.state.requests().len();
    let v = http
        .post("/v1/chat/completions", &ask("run-chat", false))
        .await
        .json();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    assert!(v["choices"][0]["message"]["content"].is_null());
    let sent: Vec<Value> = oa.state.requests()[before..]
        .iter()
        .map(|r| serde_json::from_slice(&r.body).expect("json"))
        .collect();
    assert_eq!(sent.len(), 2, "exactly one retry");
    assert!(sent[0]["tools"].is_array());
    assert!(sent[1].get("tools").is_none() && sent[1].get("tool_choice").is_none());
    let system = sent[1]["messages"][0]["content"].as_str().expect("system");
    assert!(
        system.starts_with("You are terse.") && system.contains("get_weather"),
        "{system}"
    );
    assert_eq!(
        sent[1]["messages"].as_array().map(Vec::len),
        Some(2),
        "merged, not added"
    );

    // Without the marker, text that looks like a tool call stays text.
    let plain = json!({"model": "mock-chat", "messages": [{"role": "user", "content": "x"}]});
    let v = http.post("/v1/chat/completions", &plain).await.json();
    assert!(v["choices"][0]["message"].get("tool_calls").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_use_the_openai_shape_and_fitting_status_codes() {
    let oa = fake::start(
        Flavor::OpenAi,
        Behaviour {
            status: Some(503),
            ..Behaviour::default()
        },
    )
    .await;
    let head = "[auth]\napi_keys = [\"sk-good\"]\n\n[limits]\nmax_body_bytes = 4096\n";
    let cluster = Cluster::start(head, &body(&oa.url(), &oa.url()));
    let _node = cluster.node("n1", "tok-1-long-enough-secret");
    let http = cluster.http().with_key("sk-good");
    // wait_ready uses an unauthenticated client: poll with the key instead.
    let mut ready = false;
    for _ in 0..300 {
        let s = http.get("/v1/status").await;
        if s.status == 200 && s.json()["nodes"][0]["connected"] == true {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(ready);

    let check = |r: &iop_blackbox::client::Whole, status: u16, code: Option<&str>| {
        assert_eq!(r.status, status, "{}", String::from_utf8_lossy(&r.body));
        let v = r.json();
        assert!(v["error"]["message"].is_string(), "{v}");
        assert!(v["error"]["type"].is_string(), "{v}");
        if let Some(code) = code {
            assert_eq!(v["error"]["code"], code, "{v}");
        }
    };
    check(
        &cluster
            .http()
            .post("/v1/chat/completions", &chat("mock-chat", false))
            .await,
        401,
        Some("invalid_api_key"),
    );
    check(
        &cluster.http().with_key("sk-bad").get("/v1/models").await,
        401,
        Some("invalid_api_key"),
    );
    check(
        &http
            .post("/v1/chat/completions", &chat("nope", false))
            .await,
        404,
        Some("model_not_found"),
    );
    check(
        &http.post_raw("/v1/chat/completions", "{not json").await,
        400,
        None,
    );
    check(
        &http
            .post("/v1/chat/completions", &json!({"model": "mock-chat"}))
            .await,
        400,
        Some("invalid_value"),
    );
    check(
        &http
            .post("/v1/chat/completions", &json!({"messages": []}))
            .await,
        400,
        Some("missing_model"),
    );
    check(
        &http
            .post_raw("/v1/chat/completions", vec![b' '; 8192])
            .await,
        413,
        Some("body_too_large"),
    );
    // A provider's error status passes through the tunnel unchanged.
    let r = http
        .post("/v1/chat/completions", &chat("tunnel-chat", false))
        .await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["message"], "fake failure 503");
    // Health and metrics need no key.
    assert_eq!(cluster.http().get("/healthz").await.status, 200);
    assert_eq!(cluster.http().get("/metrics").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_stream_cancels_upstream() {
    let slow = Behaviour {
        words: 200,
        delay: Duration::from_millis(50),
        ..Behaviour::default()
    };
    let oa = fake::start(Flavor::OpenAi, slow).await;
    let mut text = body(&oa.url(), &oa.url());
    text = text.replace(
        "token_delay_ms = \"2\"",
        "token_delay_ms = \"50\"\ntokens = \"200\"",
    );
    let cluster = Cluster::start("", &text);
    let node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    let http = cluster.http();

    for (model, provider) in [("tunnel-chat", "oa"), ("mock-chat", "mock")] {
        let mut s = http
            .post_stream("/v1/chat/completions", &chat(model, true))
            .await;
        assert!(
            next_sse(s.body_mut(), Duration::from_secs(5))
                .await
                .is_some()
        );
        assert!(
            next_sse(s.body_mut(), Duration::from_secs(5))
                .await
                .is_some()
        );
        assert_eq!(cluster.provider("n1", provider).await["in_flight"], 1);
        drop(s);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            if cluster.provider("n1", provider).await["in_flight"] == 0 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{model}: lease never came back"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
    // The fake provider saw its upstream request closed.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while oa.state.aborted() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "upstream request never closed"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(node.log().contains("cancel requested by the edge"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_hangs_ends_in_a_timeout_error() {
    let oa = fake::start(
        Flavor::OpenAi,
        Behaviour {
            hang: true,
            ..Behaviour::default()
        },
    )
    .await;
    let (cluster, _node) = ready_cluster(&oa.url(), &oa.url()).await;
    // The node's request timeout (3 s in test clusters) ends the upstream call.
    let started = std::time::Instant::now();
    let r = cluster
        .http()
        .post("/v1/chat/completions", &chat("run-chat", false))
        .await;
    assert_eq!(r.status, 504, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"]["code"], "timeout");
    assert!(
        started.elapsed() >= Duration::from_secs(3) && started.elapsed() < Duration::from_secs(10)
    );
    // The provider notices the closed connection asynchronously.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while oa.state.aborted() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the hung upstream request was not closed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(cluster.provider("n1", "oa-run").await["in_flight"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_providers_are_reached_through_rustls_with_a_private_ca() {
    let pki = fake::test_pki();
    let tls = fake::start_tls(Flavor::OpenAi, Behaviour::default(), &pki).await;
    let url = format!("https://localhost:{}", tls.addr.port());
    let cluster = Cluster::start("", &body(&url, &url));
    cluster.dir.write("ca.pem", &pki.ca_pem);
    let _node = cluster.node_extra(
        "n1",
        "tok-1-long-enough-secret",
        "max_attempts = 0\ninterval_sec = 0.2",
        "[tls]\nca_file = \"ca.pem\"",
    );
    cluster.wait_ready("n1").await;
    let http = cluster.http();
    let r = http
        .post("/v1/chat/completions", &chat("tunnel-chat", false))
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(content(&r.json()), "w0 w1 w2 ");
    let r = http
        .post("/v1/chat/completions", &chat("run-chat", false))
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(tls.state.requests().len(), 2);

    // Without the CA the certificate is refused and the caller gets a provider error.
    let other = Cluster::start("", &body(&url, &url));
    let _untrusting = other.node("n1", "tok-1-long-enough-secret");
    other.wait_ready("n1").await;
    let r = other
        .http()
        .post("/v1/chat/completions", &chat("tunnel-chat", false))
        .await;
    assert_eq!(r.status, 502, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        tls.state.requests().len(),
        2,
        "no request got through an untrusted TLS session"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_commands_report_capabilities_transport_and_read_only_ollama() {
    let oa = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let ol = fake::start(Flavor::Ollama, Behaviour::default()).await;
    let (cluster, _node) = ready_cluster(&oa.url(), &ol.url()).await;
    let http = cluster.http();

    let caps = http.get("/v1/nodes/n1/capabilities").await;
    assert_eq!(caps.status, 200, "{}", String::from_utf8_lossy(&caps.body));
    let text = String::from_utf8_lossy(&caps.body).into_owned();
    assert!(
        !text.contains("provider-secret"),
        "capabilities leak an API key: {text}"
    );
    let caps = caps.json();
    let names: Vec<&str> = caps["adapters"]
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|a| a["name"].as_str())
        .collect();
    assert_eq!(names, vec!["mock", "oa", "oa-run", "ol", "vl"]);
    // Each provider is probed (vLLM's /health, an OpenAI-compatible /v1/models, Ollama's
    // /api/version) and reported in the words /v1/status uses for the same providers.
    for i in 0..5 {
        assert_eq!(caps["adapters"][i]["health"], "healthy", "{caps}");
    }
    let status = cluster.admin().status().await;
    let words = ["healthy", "degraded", "offline"];
    for p in status["providers"].as_array().expect("providers") {
        assert!(words.contains(&p["health"].as_str().unwrap_or("")), "{p}");
    }
    assert_eq!(caps["adapters"][1]["type"], "openai_compat");
    assert_eq!(caps["adapters"][0]["capacity"], 2);

    let transport = http.get("/v1/nodes/n1/transport").await.json();
    assert_eq!(transport["state"], "ready");
    assert_eq!(transport["draining"], false);
    assert!(
        transport["frames_in"].as_u64().is_some_and(|n| n >= 3),
        "{transport}"
    );
    assert!(
        transport["bytes_out"].as_u64().is_some_and(|n| n > 0),
        "{transport}"
    );

    let tags = http.get("/v1/nodes/n1/ollama/ol/api/tags").await;
    assert_eq!(tags.status, 200);
    assert_eq!(tags.json()["models"][0]["name"], "llama3:8b");
    // Only the read-only endpoints pass; the check happens before any provider lookup.
    let pull = http
        .post("/v1/nodes/n1/ollama/ol/api/pull", &json!({"name": "x"}))
        .await;
    assert_eq!(pull.status, 400);
    assert_eq!(pull.json()["error"]["code"], "command_not_admitted");
    assert!(!ol.state.requests().iter().any(|r| r.path == "/api/pull"));
    assert_eq!(http.get("/v1/nodes/nope/capabilities").await.status, 404);
    // Not an Ollama adapter: refused by the Edge from its own configuration.
    let not_ollama = http.get("/v1/nodes/n1/ollama/oa/api/tags").await;
    assert_eq!(not_ollama.status, 400);
    assert_eq!(not_ollama.json()["error"]["code"], "not_ollama_adapter");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_edge_speaks_h2c() {
    use http_body_util::BodyExt;
    let oa = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let (cluster, _node) = ready_cluster(&oa.url(), &oa.url()).await;
    let response = iop_blackbox::client::post_h2c(
        cluster.http_port,
        "/v1/chat/completions",
        &chat("mock-chat", false),
    )
    .await;
    assert_eq!(response.status(), 200);
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    let v: Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(content(&v), "alpha beta gamma");
}

/// The Edge defaults to half the CPUs' threads (one on a 2-CPU machine, which then runs
/// on a current-thread runtime); three workers must serve the same, concurrently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_on_several_worker_threads_serves_concurrent_runs_tunnels_and_streams() {
    let oa = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let ol = fake::start(Flavor::Ollama, Behaviour::default()).await;
    let cluster = Cluster::start(
        "[runtime]\nworker_threads = 3\n",
        &body(&oa.url(), &ol.url()),
    );
    let _node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    assert!(
        cluster.edge.log().contains("worker_threads=3"),
        "{}",
        cluster.edge.log()
    );
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..24 {
        let http = cluster.http();
        calls.spawn(async move {
            let (model, expected) = if i % 2 == 0 {
                ("mock-chat", "alpha beta gamma")
            } else {
                ("tunnel-chat", "w0 w1 w2 ")
            };
            if i % 4 < 2 {
                let r = http.post("/v1/chat/completions", &chat(model, false)).await;
                assert_eq!(r.status, 200, "{:?}", r.body);
                assert_eq!(content(&r.json()), expected);
            } else {
                let mut s = http
                    .post_stream("/v1/chat/completions", &chat(model, true))
                    .await;
                assert_eq!(s.status(), 200);
                let (events, ended) = read_sse(s.body_mut(), Duration::from_secs(10)).await;
                assert!(ended, "{model}: {events:?}");
                assert_eq!(streamed_text(&events), expected);
                assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
            }
        });
    }
    while let Some(done) = calls.join_next().await {
        done.expect("every call answered as expected");
    }
}
