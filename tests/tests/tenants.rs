//! Keys for many tenants, through the real binaries: admin routes are closed unless
//! configured (and never open to a proxied caller), a named key uses only its models,
//! gets exactly its rate answered and 429s with the headers OpenAI's SDKs read beyond
//! it, is stopped by its token budget, and sees its usage per model and day in
//! `/v1/usage`, matching what the provider reported to the token. Windows and budgets
//! survive a restart of the Edge.

use std::time::Duration;

use iop_blackbox::client::{Cluster, Http, read_sse};
use iop_blackbox::fake::{self, Behaviour, Flavor};
use serde_json::{Value, json};

const TOKEN: &str = "tenants-token-0123456789";
const TEAM_A: &str = "sk-team-a-0123456789";
const TEAM_B: &str = "sk-team-b-0123456789";
const ADMIN: &str = "sk-admin-tenants-0123";

/// Node `n1` with an OpenAI-compatible adapter at `url` serving models `chat` and `other`.
fn body(url: &str) -> String {
    format!(
        "[[nodes]]\nid = \"n1\"\ntoken = \"{TOKEN}\"\n\
         [[nodes.adapters]]\nname = \"api\"\ntype = \"openai_compat\"\nbase_url = \"{url}\"\ncapacity = 8\ntargets = [\"m\"]\n\
         [[models]]\nname = \"chat\"\nproviders = [{{ node = \"n1\", adapter = \"api\", target = \"m\" }}]\n\
         [[models]]\nname = \"other\"\nproviders = [{{ node = \"n1\", adapter = \"api\", target = \"m\" }}]\n"
    )
}

/// `team-a`: 60 requests a minute, model `chat` only. `team-b`: a budget of 50 tokens a
/// day (the fake reports 7 prompt and 3 completion tokens a request).
fn keys() -> String {
    format!(
        "[auth]\nadmin_keys = [\"{ADMIN}\"]\n\
         [[auth.keys]]\nname = \"team-a\"\nkey = \"{TEAM_A}\"\nmodels = [\"chat\"]\nrequests_per_minute = 60\n\
         [[auth.keys]]\nname = \"team-b\"\nkey = \"{TEAM_B}\"\ntoken_budget = 50\nbudget_period = \"day\"\n"
    )
}

fn ask(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hello"}]})
}

async fn start() -> (Cluster, iop_blackbox::Proc, fake::Fake) {
    let provider = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let mut cluster = Cluster::start(&keys(), &body(&provider.url()));
    cluster.admin_key = Some(ADMIN.to_owned());
    let node = cluster.node("n1", TOKEN);
    cluster.wait_ready("n1").await;
    (cluster, node, provider)
}

fn header<'a>(r: &'a iop_blackbox::client::Whole, name: &str) -> Option<&'a str> {
    r.headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// The `/v1/usage` entry of `key` (limits and budget) and its usage rows.
async fn usage_of(admin: &Http, key: &str) -> (Value, Vec<Value>) {
    let usage = admin.get("/v1/usage").await;
    assert_eq!(
        usage.status,
        200,
        "{}",
        String::from_utf8_lossy(&usage.body)
    );
    let usage = usage.json();
    let entry = usage["keys"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|k| k["key"] == key)
        .cloned()
        .unwrap_or(Value::Null);
    let rows = usage["usage"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["key"] == key)
        .cloned()
        .collect();
    (entry, rows)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_are_closed_without_an_admin_key_unless_opted_in_and_never_when_proxied() {
    let provider = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let mut cluster = Cluster::start("[auth]\nadmin_loopback = false\n", &body(&provider.url()));
    let http = cluster.http();
    for path in ["/metrics", "/v1/status", "/v1/usage", "/v1/events"] {
        let r = http.get(path).await;
        assert_eq!(
            r.status, 403,
            "{path} answered a loopback caller with no admin key"
        );
    }
    assert_eq!(http.get("/healthz").await.status, 200);
    assert!(
        cluster.edge.log().contains("answer nobody"),
        "{}",
        cluster.edge.log()
    );

    // The opt-in opens them to this host, and says so loudly.
    cluster.rewrite_head("[auth]\nadmin_loopback = true\n", &body(&provider.url()));
    cluster.edge.signal("HUP");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while http.get("/v1/status").await.status != 200 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{}",
            cluster.edge.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(http.get("/metrics").await.status, 200);
    // A caller that came through a proxy is never local.
    for (name, value) in [
        ("x-forwarded-for", "203.0.113.7"),
        ("forwarded", "for=203.0.113.7;proto=https"),
        ("x-real-ip", "203.0.113.7"),
    ] {
        for path in ["/metrics", "/v1/status", "/v1/usage"] {
            let r = cluster.http().with_header(name, value).get(path).await;
            assert_eq!(
                r.status, 403,
                "{path} answered a caller proxied with {name}"
            );
        }
    }
    // Started with the opt-in, the Edge warns.
    cluster.restart_edge();
    assert!(
        wait_for_log(&cluster, "admin_loopback = true").await,
        "{}",
        cluster.edge.log()
    );
}

async fn wait_for_log(cluster: &Cluster, needle: &str) -> bool {
    for _ in 0..100 {
        if cluster.edge.log().contains(needle) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_key_gets_its_models_its_rate_and_its_budget_and_keeps_them_across_a_restart() {
    let (mut cluster, _node, provider) = start().await;
    let team_a = cluster.http().with_key(TEAM_A);
    let team_b = cluster.http().with_key(TEAM_B);
    let admin = cluster.admin();

    // Only its models: another is not there for it, as OpenAI answers.
    let r = team_a.post("/v1/chat/completions", &ask("other")).await;
    assert_eq!(r.status, 404, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    let listed = team_a.get("/v1/models").await.json();
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["chat"]);
    assert_eq!(team_a.get("/v1/models/other").await.status, 404);
    assert_eq!(team_b.get("/v1/models/other").await.status, 200);

    // 120 requests in a few seconds at 60 a minute: 60 answered, 60 refused.
    let mut answered = 0;
    let mut refused = Vec::new();
    let mut reported = (0u64, 0u64);
    let chat = ask("chat");
    for _ in 0..30 {
        let answers = tokio::join!(
            team_a.post("/v1/chat/completions", &chat),
            team_a.post("/v1/chat/completions", &chat),
            team_a.post("/v1/chat/completions", &chat),
            team_a.post("/v1/chat/completions", &chat),
        );
        for r in [answers.0, answers.1, answers.2, answers.3] {
            match r.status {
                200 => {
                    answered += 1;
                    let usage = &r.json()["usage"];
                    reported.0 += usage["prompt_tokens"].as_u64().expect("usage");
                    reported.1 += usage["completion_tokens"].as_u64().expect("usage");
                    assert_eq!(header(&r, "x-ratelimit-limit-requests"), Some("60"));
                    assert!(header(&r, "x-ratelimit-remaining-requests").is_some());
                    assert!(header(&r, "x-ratelimit-reset-requests").is_some());
                }
                429 => refused.push(r),
                other => panic!("{other}: {}", String::from_utf8_lossy(&r.body)),
            }
        }
    }
    assert_eq!((answered, refused.len()), (60, 60));
    for r in &refused {
        let after: u64 = header(r, "retry-after")
            .and_then(|v| v.parse().ok())
            .expect("Retry-After on a 429");
        assert!((1..=60).contains(&after), "Retry-After {after}");
        assert_eq!(header(r, "x-ratelimit-remaining-requests"), Some("0"));
        assert_eq!(header(r, "x-ratelimit-limit-requests"), Some("60"));
        let error = &r.json()["error"];
        assert_eq!(error["type"], "rate_limit_error");
        assert_eq!(error["code"], "rate_limit_exceeded");
    }

    // A budget of 50 tokens at 10 a request: five answered, then refused for the day.
    for i in 0..5 {
        let r = team_b.post("/v1/chat/completions", &ask("other")).await;
        assert_eq!(r.status, 200, "request {i}");
    }
    let spent = team_b.post("/v1/chat/completions", &ask("chat")).await;
    assert_eq!(spent.status, 429);
    assert_eq!(spent.json()["error"]["code"], "insufficient_quota");
    assert_eq!(header(&spent, "x-should-retry"), Some("false"));
    assert!(header(&spent, "retry-after").is_some());
    let (b, b_rows) = usage_of(&admin, "team-b").await;
    assert_eq!(b["budget"]["tokens"], 50);
    assert_eq!(b["budget"]["spent"], 50);
    assert_eq!(b["budget"]["remaining"], 0);
    assert_eq!(b["budget"]["period"], "day");
    let b_tokens: u64 = b_rows
        .iter()
        .map(|r| r["total_tokens"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(b_tokens, 50);

    // Usage per key, to the token of what the provider reported.
    let (a, rows) = usage_of(&admin, "team-a").await;
    assert_eq!(a["requests_per_minute"]["limit"], 60);
    assert_eq!(a["requests_per_minute"]["remaining"], 0);
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["model"], "chat");
    assert_eq!(rows[0]["requests"], 60);
    assert_eq!(rows[0]["prompt_tokens"], reported.0);
    assert_eq!(rows[0]["completion_tokens"], reported.1);
    // And in the metrics, under the key's name (never the key).
    let metrics = String::from_utf8_lossy(&admin.get("/metrics").await.body).into_owned();
    let line = format!(
        "iop_tokens_total{{model=\"chat\",node=\"n1\",provider=\"api\",key=\"team-a\",kind=\"prompt\"}} {}",
        reported.0
    );
    assert!(metrics.contains(&line), "no `{line}` in\n{metrics}");
    assert!(!metrics.contains(TEAM_A) && !cluster.edge.log().contains(TEAM_A));
    assert!(
        cluster.edge.log().contains("team-a"),
        "request log names the key"
    );

    // A restart keeps the window and the budget.
    cluster.restart_edge_gracefully();
    cluster.wait_ready("n1").await;
    let r = team_a.post("/v1/chat/completions", &ask("chat")).await;
    assert_eq!(r.status, 429, "the minute's window was lost in the restart");
    assert_eq!(header(&r, "x-ratelimit-remaining-requests"), Some("0"));
    let r = team_b.post("/v1/chat/completions", &ask("chat")).await;
    assert_eq!(r.status, 429, "the day's budget was lost in the restart");
    let (_, rows) = usage_of(&admin, "team-a").await;
    assert_eq!(rows[0]["prompt_tokens"], reported.0);

    // Keys change on SIGHUP: team-a's new rate applies at once to the window it kept,
    // team-b is gone.
    let raised = keys()
        .replace("requests_per_minute = 60", "requests_per_minute = 1000")
        .replace(
            &format!("[[auth.keys]]\nname = \"team-b\"\nkey = \"{TEAM_B}\""),
            "[[auth.keys]]\nname = \"team-c\"\nkey = \"sk-team-c-0123456789\"",
        );
    cluster.rewrite_head(&raised, &body(&provider.url()));
    cluster.edge.signal("HUP");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = team_a.post("/v1/chat/completions", &ask("chat")).await;
        if r.status == 200 {
            assert_eq!(header(&r, "x-ratelimit-limit-requests"), Some("1000"));
            assert_eq!(header(&r, "x-ratelimit-remaining-requests"), Some("939"));
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{}",
            cluster.edge.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        team_b
            .post("/v1/chat/completions", &ask("chat"))
            .await
            .status,
        401
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_usage_and_requests_at_once_are_counted_per_key() {
    let slow = Behaviour {
        words: 4,
        delay: Duration::from_millis(150),
        ..Behaviour::default()
    };
    let provider = fake::start(Flavor::OpenAi, slow).await;
    let head = format!(
        "[auth]\nadmin_keys = [\"{ADMIN}\"]\n\
         [[auth.keys]]\nname = \"streamer\"\nkey = \"{TEAM_A}\"\nmax_concurrent = 1\ntokens_per_minute = 100000\n"
    );
    let mut cluster = Cluster::start(&head, &body(&provider.url()));
    cluster.admin_key = Some(ADMIN.to_owned());
    let _node = cluster.node("n1", TOKEN);
    cluster.wait_ready("n1").await;
    let key = cluster.http().with_key(TEAM_A);
    let stream = json!({"model": "chat", "stream": true, "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "hello"}]});
    let mut first = key.post_stream("/v1/chat/completions", &stream).await;
    assert_eq!(first.status(), 200);
    assert_eq!(
        first.headers()["x-ratelimit-limit-tokens"].to_str().ok(),
        Some("100000")
    );
    // A second at once is over the key's one request at a time.
    let second = key.post("/v1/chat/completions", &ask("chat")).await;
    assert_eq!(second.status, 429);
    assert_eq!(header(&second, "retry-after"), Some("1"));
    let (events, ended) = read_sse(first.body_mut(), Duration::from_secs(10)).await;
    assert!(ended, "{events:?}");
    let usage: Value = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find(|e| e["usage"].is_object())
        .map(|e| e["usage"].clone())
        .expect("a usage chunk");
    // Once it ended, the next is admitted.
    let mut answered = false;
    for _ in 0..50 {
        let r = key.post("/v1/chat/completions", &ask("chat")).await;
        if r.status == 200 {
            answered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(answered);
    let (_, rows) = usage_of(&cluster.admin(), "streamer").await;
    assert_eq!(rows[0]["requests"], 2);
    assert_eq!(
        rows[0]["completion_tokens"].as_u64(),
        usage["completion_tokens"].as_u64().map(|c| c * 2)
    );
}
