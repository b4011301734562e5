//! Security of the real binaries: what crosses the node link, who the Node trusts, who the
//! Edge lets register, who may call which route, how registration abuse is contained, and
//! which provider headers reach a caller.

use std::time::Duration;

use bytes::BytesMut;
use iop_blackbox::client::{Cluster, Link, gen_cert};
use iop_blackbox::fake::{self, Behaviour, Flavor, KEPT_HEADERS, LEAKY_HEADERS};
use iop_blackbox::{Proc, Relay, TempDir, binary, wait_until};
use iop_proto_core::wire::{self, Body, Envelope, FrameDecoder, RegisterRequest};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOKEN: &str = "node-token-0123456789";
const PROVIDER_KEY: &str = "sk-provider-secret-77f1";
const PROMPT: &str = "prompt-canary-the-relay-must-not-read";

fn tunnel_body(provider_url: &str) -> String {
    format!(
        r#"
[[nodes]]
id = "n1"
token = "{TOKEN}"
[[nodes.adapters]]
name = "oa"
type = "openai_compat"
base_url = "{provider_url}"
api_key = "{PROVIDER_KEY}"
capacity = 4
targets = ["fake"]

[[nodes]]
id = "n2"
token = "{TOKEN}-two"
[[nodes.adapters]]
name = "mock"
type = "mock"
capacity = 2
targets = ["m"]

[[models]]
name = "chat"
providers = [{{ node = "n1", adapter = "oa", target = "fake" }}]
"#
    )
}

fn ask(stream: bool) -> Value {
    json!({"model": "chat", "stream": stream, "messages": [{"role": "user", "content": PROMPT}]})
}

const FAST_RECONNECT: &str = "max_attempts = 0\ninterval_sec = 0.2";

/// Starts a node whose config text is `text`.
fn node_from(cluster: &Cluster, name: &str, text: &str) -> Proc {
    let path = cluster.dir.write(&format!("{name}.toml"), text);
    let path = path.to_string_lossy().into_owned();
    Proc::start("iop-node", &["--config", &path], &cluster.dir, name, &[])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_on_the_node_link_reads_no_token_key_prompt_or_completion() {
    let provider = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    for link in [Link::Tls, Link::Plaintext] {
        let cluster = Cluster::start_with(link, "", &tunnel_body(&provider.url()));
        let relay = Relay::start(cluster.node_port).await;
        let text = cluster.node_toml("n1", TOKEN, FAST_RECONNECT).replace(
            &format!("127.0.0.1:{}", cluster.node_port),
            &format!("127.0.0.1:{}", relay.port),
        );
        let _node = node_from(&cluster, "relayed", &text);
        cluster.wait_ready("n1").await;
        let whole = cluster
            .http()
            .post("/v1/chat/completions", &ask(false))
            .await;
        assert_eq!(
            whole.status,
            200,
            "{}",
            String::from_utf8_lossy(&whole.body)
        );
        let mut stream = cluster
            .http()
            .post_stream("/v1/chat/completions", &ask(true))
            .await;
        let (events, ended) =
            iop_blackbox::client::read_sse(stream.body_mut(), Duration::from_secs(10)).await;
        assert!(
            ended && events.iter().any(|e| e.contains("w1 ")),
            "{events:?}"
        );
        // The provider got its key: it did cross the link, inside the adapter config.
        assert!(provider.state.requests().iter().any(|r| {
            r.headers
                .iter()
                .any(|(k, v)| k == "authorization" && v.contains(PROVIDER_KEY))
        }));
        assert!(relay.seen().len() > 2000, "traffic went through the relay");
        let secrets = [TOKEN, PROVIDER_KEY, PROMPT, "w1 w2"];
        match link {
            Link::Tls => {
                for secret in secrets {
                    assert!(
                        !relay.saw(secret),
                        "{secret:?} crossed the TLS link in clear"
                    );
                }
            }
            // The same relay reads everything from a plaintext link: the check can fail.
            _ => {
                for secret in [TOKEN, PROVIDER_KEY, PROMPT] {
                    assert!(relay.saw(secret), "{secret:?} not seen on a plaintext link");
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_refuses_an_edge_it_cannot_verify_says_why_and_keeps_retrying() {
    let cluster = Cluster::start("", &tunnel_body("http://127.0.0.1:9"));
    // A pin of some other certificate.
    let bogus = "AB:".repeat(31) + "AB";
    let wrong_pin = cluster
        .node_toml("n1", TOKEN, FAST_RECONNECT)
        .replace(cluster.fingerprint.as_deref().expect("tls"), &bogus);
    let mut pinned = node_from(&cluster, "wrong-pin", &wrong_pin);
    // A CA that did not issue the Edge's certificate.
    let other = TempDir::new("other-ca");
    gen_cert(&other, "other-ca", &["some-ca"], &["--ca"]);
    let untrusting = cluster
        .node_toml("n1", TOKEN, FAST_RECONNECT)
        .lines()
        .filter(|l| !l.starts_with("edge_cert_sha256"))
        .collect::<Vec<_>>()
        .join("\n")
        + &format!(
            "\n[edge_tls]\nca_file = \"{}\"\n",
            other.path().join("other-ca.pem").display()
        );
    let mut unknown_ca = node_from(&cluster, "unknown-ca", &untrusting);
    assert!(
        wait_until(Duration::from_secs(10), || {
            pinned.log().matches("dialing the edge").count() >= 3
                && unknown_ca.log().matches("dialing the edge").count() >= 3
        }),
        "both keep retrying:\n{}\n{}",
        pinned.log(),
        unknown_ca.log()
    );
    assert!(pinned.running() && unknown_ca.running());
    let log = pinned.log();
    assert!(log.contains("not the pinned"), "{log}");
    let log = unknown_ca.log();
    assert!(
        log.contains("UnknownIssuer") || log.contains("unknown issuer"),
        "{log}"
    );
    // Neither sent a single frame: no token was offered to an unverified peer.
    let metrics = cluster.http().get("/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("iop_node_frames_total{direction=\"in\"} 0"),
        "{text}"
    );
    assert!(
        text.contains("iop_node_tls_handshake_failures_total"),
        "{text}"
    );
    let status = cluster.http().status().await;
    assert_eq!(status["nodes"][0]["connected"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_mutual_tls_a_node_certificate_registers_only_its_own_node_id() {
    let cluster = Cluster::start_with(Link::MutualTls, "", &tunnel_body("http://127.0.0.1:9"));
    // n1's certificate, n2's id and token: refused, for good (exit 1).
    let impostor = format!(
        "{}\n{}",
        cluster.node_toml("n2", &format!("{TOKEN}-two"), FAST_RECONNECT),
        cluster.node_cert("n1")
    );
    let mut impostor = node_from(&cluster, "impostor", &impostor);
    let status = impostor.wait_exit(Duration::from_secs(10)).expect("exits");
    assert_eq!(status.code(), Some(1));
    assert!(
        impostor.log().contains("authentication failed"),
        "{}",
        impostor.log()
    );
    // No client certificate at all: the handshake fails, and the node keeps trying.
    let mut anonymous = node_from(
        &cluster,
        "anonymous",
        &cluster.node_toml("n2", &format!("{TOKEN}-two"), FAST_RECONNECT),
    );
    // n2 with its own certificate gets in.
    let own = format!(
        "{}\n{}",
        cluster.node_toml("n2", &format!("{TOKEN}-two"), FAST_RECONNECT),
        cluster.node_cert("n2")
    );
    let _n2 = node_from(&cluster, "n2", &own);
    cluster.wait_ready("n2").await;
    let status = cluster.http().status().await;
    let n2 = status["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["node_id"] == "n2")
        .expect("n2")
        .clone();
    assert_eq!(n2["client_certificate"], true, "{n2}");
    assert_eq!(n2["tls_version"], "TLSv1.3", "{n2}");
    assert!(wait_until(Duration::from_secs(5), || anonymous
        .log()
        .matches("dialing the edge")
        .count()
        >= 2));
    assert!(anonymous.running());
    assert!(anonymous.log().contains("tls"), "{}", anonymous.log());
}

fn check_config(dir: &TempDir, text: &str) -> (bool, String) {
    let path = dir.write("edge.toml", text);
    let out = std::process::Command::new(binary("iop-edge"))
        .args(["check-config", "--config", &path.to_string_lossy()])
        .output()
        .expect("runs");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn check_config_refuses_plaintext_on_a_public_bind_blank_keys_and_weak_tokens() {
    let dir = TempDir::new("check");
    gen_cert(&dir, "cert", &["localhost"], &[]);
    let config = |listen: &str, token: &str, auth: &str| {
        format!(
            "[listen]\nhttp = \"127.0.0.1:18080\"\n{listen}\n{auth}\n[[nodes]]\nid = \"n1\"\ntoken = \"{token}\"\n"
        )
    };
    let tls = "nodes = \"0.0.0.0:17100\"\n[listen.nodes_tls]\ncert_file = \"cert.pem\"\nkey_file = \"cert-key.pem\"\n";
    let (ok, out) = check_config(&dir, &config(tls, TOKEN, ""));
    assert!(ok, "{out}");
    assert!(out.contains("node link TLS"), "{out}");
    for (listen, token, auth, key) in [
        (
            "nodes = \"0.0.0.0:17100\"\nnodes_plaintext = true",
            TOKEN,
            "",
            "listen.nodes_plaintext",
        ),
        ("nodes = \"0.0.0.0:17100\"", TOKEN, "", "listen.nodes_tls"),
        (tls, "dev-token-change-me", "", "nodes[0].token"),
        (tls, "short-token", "", "nodes[0].token"),
        (
            tls,
            TOKEN,
            "[auth]\napi_keys = [\"\", \"sk-real\"]",
            "auth.api_keys[0]",
        ),
        (
            tls,
            TOKEN,
            "[auth]\nadmin_keys = [\" \"]",
            "auth.admin_keys[0]",
        ),
    ] {
        let (ok, out) = check_config(&dir, &config(listen, token, auth));
        assert!(!ok, "{listen} / {token} / {auth} accepted: {out}");
        assert!(out.contains(key), "{key} not named: {out}");
    }
    // Plaintext on a public address with the explicit second opt-in passes.
    let (ok, out) = check_config(
        &dir,
        &config(
            "nodes = \"0.0.0.0:17100\"\nnodes_plaintext = true\nallow_public_plaintext = true",
            TOKEN,
            "",
        ),
    );
    assert!(ok && out.contains("PLAINTEXT"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_keys_call_models_and_only_admin_keys_operate_the_fabric() {
    let admin_digest = iop_proto_core::token::sha256_hex(b"sk-admin-key-1");
    let head = format!(
        "[auth]\napi_keys = [\"sk-client-key-1\"]\nadmin_keys = [\"sha256:{admin_digest}\"]\n"
    );
    let provider = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let mut cluster = Cluster::start(&head, &tunnel_body(&provider.url()));
    cluster.admin_key = Some("sk-admin-key-1".into());
    let _node = cluster.node("n1", TOKEN);
    cluster.wait_ready("n1").await;
    let client = cluster.http().with_key("sk-client-key-1");
    let admin = cluster.admin();
    let anonymous = cluster.http();
    for path in ["/metrics", "/v1/status", "/v1/nodes/n1/capabilities"] {
        let r = client.get(path).await;
        assert_eq!(r.status, 403, "client key on {path}");
        assert_eq!(r.json()["error"]["code"], "permission_denied", "{path}");
        let r = anonymous.get(path).await;
        assert_eq!(r.status, 401, "no key on {path}");
        assert_eq!(r.json()["error"]["code"], "invalid_api_key", "{path}");
        assert!(r.headers.iter().any(|(k, _)| k == "www-authenticate"));
        let r = admin.get(path).await;
        assert_eq!(
            r.status,
            200,
            "admin key on {path}: {}",
            String::from_utf8_lossy(&r.body)
        );
    }
    assert_eq!(client.get("/v1/models").await.status, 200);
    assert_eq!(
        admin.get("/v1/models").await.status,
        200,
        "admins may call models too"
    );
    assert_eq!(anonymous.get("/v1/models").await.status, 401);
    assert_eq!(
        anonymous.get("/healthz").await.status,
        200,
        "health stays open"
    );
    // The scheme is case-insensitive (RFC 9110).
    let lower = cluster
        .http()
        .with_authorization("bearer sk-client-key-1")
        .post("/v1/chat/completions", &ask(false))
        .await;
    assert_eq!(
        lower.status,
        200,
        "{}",
        String::from_utf8_lossy(&lower.body)
    );
    let wrong = cluster
        .http()
        .with_key("sk-client-key-2")
        .post("/v1/chat/completions", &ask(false))
        .await;
    assert_eq!(wrong.status, 401);
}

/// Opens a TLS connection to the Edge's node port trusting its self-signed certificate,
/// sends one RegisterRequest and returns the RegisterResponse.
async fn register_once(
    connector: &tokio_rustls::TlsConnector,
    port: u16,
    node_id: &str,
    token: &str,
) -> wire::RegisterResponse {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let name = rustls_pki_types::ServerName::try_from("localhost").expect("name");
    let mut tls = connector.connect(name, tcp).await.expect("handshake");
    let mut out = BytesMut::new();
    wire::encode(
        &Envelope::new(Body::RegisterRequest(RegisterRequest {
            node_id: node_id.into(),
            token: token.into(),
            ..RegisterRequest::default()
        })),
        &mut out,
    )
    .expect("encode");
    tls.write_all(&out).await.expect("write");
    let mut decoder = FrameDecoder::new();
    let mut buf = vec![0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), tls.read(&mut buf))
            .await
            .expect("answer in time")
            .expect("read");
        assert!(n > 0, "closed without an answer");
        decoder.push_bytes(bytes::Bytes::copy_from_slice(&buf[..n]));
        if let Some(envelope) = decoder.next_envelope().expect("decodes") {
            let Some(Body::RegisterResponse(response)) = envelope.body else {
                panic!("expected a RegisterResponse, got {envelope:?}");
            };
            return response;
        }
    }
}

/// Failed registrations are answered one per `failure_interval_ms` beyond a burst of 5,
/// whatever id they claim; the answer says so once they are held back; the right token
/// still gets in at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_guesses_are_answered_at_a_bounded_rate_and_never_get_in() {
    // A short interval keeps the test short; the default is 1 s.
    const INTERVAL_MS: u64 = 40;
    let head = format!("[admission]\nfailure_interval_ms = {INTERVAL_MS}\n");
    let cluster = Cluster::start(&head, &tunnel_body("http://127.0.0.1:9"));
    let connector =
        iop_blackbox::client::connector_trusting(&cluster.dir.path().join("edge-cert.pem"));
    let mut throttled: u64 = 0;
    let started = std::time::Instant::now();
    for i in 0..200 {
        // Half guess tokens of a real node, half guess node ids.
        let node = if i % 2 == 0 {
            "n1".to_owned()
        } else {
            format!("no-such-node-{i}")
        };
        let answer = register_once(
            &connector,
            cluster.node_port,
            &node,
            &format!("guess-{i:012}"),
        )
        .await;
        assert!(!answer.accepted);
        if answer
            .reason
            .starts_with("too many failed attempts, retry in ")
        {
            throttled += 1;
            assert!(answer.retry_after_ms > 0, "{answer:?}");
        } else {
            assert_eq!(
                answer.reason, "authentication failed",
                "node ids cannot be told from tokens"
            );
            assert_eq!(answer.retry_after_ms, 0, "wrong credentials are final");
        }
    }
    let elapsed = started.elapsed();
    // Five answered at once, the rest held back; a guess that arrives a whole interval
    // after the last answer (a slow client, a loaded machine) finds the slot refilled
    // and is answered without a hold, which the rate floor below still counts.
    assert!(
        (150..=195).contains(&throttled),
        "{throttled} of 200 held back: five answered at once, the rest held back"
    );
    let floor = Duration::from_millis(195 * INTERVAL_MS);
    assert!(
        elapsed >= floor,
        "200 guesses in {elapsed:?}: faster than one per interval"
    );
    // Meanwhile the right token is never held or refused.
    let right_at = std::time::Instant::now();
    let right = register_once(&connector, cluster.node_port, "n2", &format!("{TOKEN}-two")).await;
    assert!(right.accepted, "{right:?}");
    assert!(right_at.elapsed() < Duration::from_secs(1));
    let log = cluster.edge.log();
    let lines = log.matches("node registration refused").count();
    assert!(
        (4..=12).contains(&lines),
        "{lines} log lines for 200 failures:\n{log}"
    );
    assert!(
        log.contains("peer=127.0.0.1"),
        "the log names the peer: {log}"
    );
    // The metrics count each refusal by what the guesser was told: as many held back as
    // it saw (195 when every guess found the slot taken; fewer when a loaded machine
    // let a slot refill, as the range above allows), the rest refused outright.
    let metrics = cluster.http().get("/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    let refused = |reason: &str| {
        let line = format!("iop_node_registrations_refused_total{{reason=\"{reason}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert_eq!(refused("throttled"), throttled, "{text}");
    assert_eq!(
        refused("throttled") + refused("bad_token") + refused("unknown_node"),
        200,
        "{text}"
    );
    // The operator sees who: the id with its wrong token, and the address.
    let status = cluster.admin().status().await;
    let ids = &status["registrations"]["failing_node_ids"];
    assert!(
        ids.as_array()
            .into_iter()
            .flatten()
            .any(|f| f["node_id"] == "n1" && f["known"] == true && f["failures"] == 100),
        "{status}"
    );
    let sources = &status["registrations"]["failing_sources"];
    assert_eq!(sources[0]["source"], "127.0.0.1", "{status}");
    assert_eq!(sources[0]["failures"], 200, "{status}");
    let events = cluster.kept_events().await;
    assert!(
        events.iter().any(|e| e["type"] == "register.refused"
            && e["node_id"] == "n1"
            && e["known"] == true
            && e["peer"] == "127.0.0.1"),
        "{events:?}"
    );
}

/// One node with a wrong token, retrying as soon as it is answered (a fifth of a second
/// later), from the address 50 healthy nodes share (one NAT egress): every healthy node
/// that restarts comes back as fast as it would alone, and the bad one is refused, slowed
/// down and named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_a_wrong_token_never_locks_out_the_healthy_nodes_beside_it() {
    const HEALTHY: usize = 50;
    let mut body = String::new();
    for i in 0..=HEALTHY {
        body.push_str(&format!(
            "[[nodes]]\nid = \"h{i}\"\ntoken = \"{TOKEN}-{i}\"\n[[nodes.adapters]]\nname = \"mock\"\ntype = \"mock\"\ncapacity = 1\ntargets = [\"m\"]\n\n"
        ));
    }
    let cluster = Cluster::start("", &body);
    // h0 is the misconfigured one: a token with a typo, started again and again.
    let bad_token = format!("{TOKEN}-0-typo");
    let mut healthy: Vec<Proc> = (1..=HEALTHY)
        .map(|i| cluster.node(&format!("h{i}"), &format!("{TOKEN}-{i}")))
        .collect();
    let generations = |status: &Value| -> Vec<Option<u64>> {
        (0..=HEALTHY)
            .map(|i| {
                status["nodes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|n| n["node_id"] == format!("h{i}") && n["connected"] == true)
                    .and_then(|n| n["generation"].as_u64())
            })
            .collect()
    };
    let http = cluster.admin();
    assert!(
        wait_until(Duration::from_secs(30), || {
            let status = futures_block(http.status());
            generations(&status)[1..].iter().all(Option::is_some)
        }),
        "the healthy nodes never all became ready: {}",
        cluster.edge.log()
    );
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let bad = {
        let stop = stop.clone();
        let connector =
            iop_blackbox::client::connector_trusting(&cluster.dir.path().join("edge-cert.pem"));
        let port = cluster.node_port;
        tokio::spawn(async move {
            let mut answers = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                answers.push(register_once(&connector, port, "h0", &bad_token).await);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            answers
        })
    };
    // Let the bad node's failures pile up, then restart every healthy node, a few at a
    // time, while it goes on; each must be back within its normal reconnect time.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let mut worst = Duration::ZERO;
    for batch in (1..=HEALTHY).collect::<Vec<_>>().chunks(10) {
        let before = generations(&http.status().await);
        let restarted_at = std::time::Instant::now();
        for &i in batch {
            healthy[i - 1].signal("KILL");
            let _ = healthy[i - 1].wait_exit(Duration::from_secs(5));
            healthy[i - 1] = cluster.node(&format!("h{i}"), &format!("{TOKEN}-{i}"));
        }
        loop {
            let now = generations(&http.status().await);
            let back = batch
                .iter()
                .all(|&i| now[i].is_some() && now[i] != before[i]);
            if back {
                break;
            }
            assert!(
                restarted_at.elapsed() < Duration::from_secs(10),
                "restarted nodes {batch:?} not back: {now:?}\n{}",
                cluster.edge.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        worst = worst.max(restarted_at.elapsed());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let answers = bad.await.expect("the bad node's loop");
    assert!(answers.len() >= 10, "{} attempts", answers.len());
    assert!(
        answers.iter().all(|a| !a.accepted),
        "the bad node never gets in"
    );
    assert!(
        answers
            .iter()
            .any(|a| a.reason.starts_with("too many failed attempts")),
        "the bad node is told it is throttled: {answers:?}"
    );
    eprintln!("restarts of 10 healthy nodes at a time back within {worst:?}");
    let events = cluster.kept_events().await;
    assert!(
        events
            .iter()
            .any(|e| e["type"] == "register.refused" && e["node_id"] == "h0" && e["known"] == true),
        "the bad node is named in /v1/events: {events:?}"
    );
    for node in &healthy {
        let log = node.log();
        assert!(
            !log.contains("authentication failed"),
            "a healthy node was told its token is wrong: {log}"
        );
        assert!(
            !log.contains("too many failed attempts"),
            "a healthy node was throttled: {log}"
        );
    }
}

/// Blocks on a future from synchronous code inside the test's runtime.
fn futures_block<F: std::future::Future>(future: F) -> F::Output {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(future))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_sharing_an_id_are_a_conflict_not_an_endless_flap() {
    let cluster = Cluster::start("", &tunnel_body("http://127.0.0.1:9"));
    let mut first = cluster.node("n1", TOKEN);
    cluster.wait_ready("n1").await;
    let mut second = cluster.node("n1", TOKEN);
    let http = cluster.http();
    let mut conflict = false;
    for _ in 0..200 {
        let status = http.status().await;
        if status["nodes"][0]["state"] == "conflict" {
            assert_eq!(status["nodes"][0]["conflict"], true);
            conflict = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(conflict, "no conflict reported:\n{}", cluster.edge.log());
    let supersedes = |log: &str| log.matches("Superseded").count();
    let before = supersedes(&cluster.edge.log());
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = supersedes(&cluster.edge.log());
    assert!(
        after <= before + 1,
        "still flapping: {before} -> {after} supersedes"
    );
    let status = http.status().await;
    assert_eq!(status["nodes"][0]["state"], "conflict");
    assert_eq!(
        status["nodes"][0]["connected"], true,
        "the holder keeps serving"
    );
    let log = cluster.edge.log();
    assert_eq!(
        log.matches("node id conflict").count(),
        1,
        "one ERROR line per conflict:\n{log}"
    );
    assert!(
        first.running() && second.running(),
        "both keep running and retrying"
    );
    let held_off = first.log() + &second.log();
    assert!(
        held_off.contains("in conflict"),
        "the held-off node is told why"
    );
    assert!(
        held_off.contains("superseded"),
        "the superseded node is told why"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_response_carries_only_the_allow_listed_provider_headers() {
    let provider = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let cluster = Cluster::start("", &tunnel_body(&provider.url()));
    let _node = cluster.node("n1", TOKEN);
    cluster.wait_ready("n1").await;
    let whole = cluster
        .http()
        .post("/v1/chat/completions", &ask(false))
        .await;
    let stream = cluster
        .http()
        .post_stream("/v1/chat/completions", &ask(true))
        .await;
    let streamed: Vec<(String, String)> = stream
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
        .collect();
    for (headers, what) in [(&whole.headers, "whole"), (&streamed, "stream")] {
        for (leaky, _) in LEAKY_HEADERS {
            assert!(
                !headers.iter().any(|(k, _)| k == leaky),
                "{what} response leaked {leaky}: {headers:?}"
            );
        }
        for (kept, value) in KEPT_HEADERS {
            // The provider's own request id stays visible beside the Edge's.
            let kept = if kept == "x-request-id" {
                "x-upstream-request-id"
            } else {
                kept
            };
            assert!(
                headers.iter().any(|(k, v)| k == kept && v == value),
                "{what} response lost {kept}: {headers:?}"
            );
        }
        assert!(
            headers
                .iter()
                .any(|(k, v)| k == "x-request-id" && v.starts_with("req_")),
            "{what} response has the Edge's request id: {headers:?}"
        );
        assert!(headers.iter().any(|(k, _)| k == "content-type"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_loads_a_new_certificate_for_new_connections() {
    let cluster = Cluster::start("", &tunnel_body("http://127.0.0.1:9"));
    let old_pin = cluster.fingerprint.clone().expect("tls");
    let new_pin = gen_cert(
        &cluster.dir,
        "edge-cert",
        &["localhost", "127.0.0.1"],
        &["--force"],
    );
    assert_ne!(old_pin, new_pin);
    cluster.edge.signal("HUP");
    assert!(wait_until(Duration::from_secs(5), || cluster
        .edge
        .log()
        .contains("configuration reloaded")));
    let text = cluster
        .node_toml("n2", &format!("{TOKEN}-two"), FAST_RECONNECT)
        .replace(&old_pin, &new_pin);
    let _node = node_from(&cluster, "rekeyed", &text);
    cluster.wait_ready("n2").await;
}
