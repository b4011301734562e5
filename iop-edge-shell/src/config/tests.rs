//! The configuration's tests: every key named in its error, every default and bound.

use super::*;

const MINIMAL: &str = r#"
[listen]
http = "127.0.0.1:8080"
nodes = "127.0.0.1:7100"
nodes_plaintext = true

[[nodes]]
id = "n1"
token = "t-0123456789abcdef"
[[nodes.adapters]]
name = "mock"
type = "mock"
capacity = 2
targets = ["m"]

[[models]]
name = "chat"
providers = [{ node = "n1", adapter = "mock", target = "m" }]
"#;

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(text, Path::new("edge.toml"))
}

const CLUSTER: &str =
    "\n[cluster]\nendpoints = [\"http://127.0.0.1:2379\"]\nedge_id = \"edge-a\"\n";

#[test]
fn a_cluster_section_names_etcd_and_defaults_the_rest() {
    let config = parse(&format!("{MINIMAL}{CLUSTER}")).expect("valid");
    let cluster = config.cluster.expect("cluster mode");
    assert_eq!(cluster.prefix, "/iop");
    assert_eq!(cluster.advertise_nodes, "127.0.0.1:7100");
    assert_eq!(cluster.lease_ttl, Duration::from_secs(10));
    assert_eq!(cluster.keepalive, Duration::from_secs(3));
    assert_eq!(cluster.resync, Duration::from_secs(30));
    assert!(parse(MINIMAL).expect("valid").cluster.is_none());
}

#[test]
fn a_cluster_section_that_cannot_work_is_refused_naming_the_key() {
    let refused = |extra: &str, key: &str| {
        let text = format!("{MINIMAL}{CLUSTER}{extra}");
        let err = parse(&text).expect_err(extra).to_string();
        assert!(err.contains(key), "{extra}: {err}");
    };
    refused(
        "lease_ttl_sec = 6\nkeepalive_sec = 3\n",
        "cluster.keepalive_sec",
    );
    refused("resync_sec = 0\n", "cluster.resync_sec");
    refused("username = \"iop\"\n", "cluster.username");
    refused("cert_file = \"c.pem\"\n", "cluster.cert_file");
    let bad_id = format!("{MINIMAL}{}", CLUSTER.replace("edge-a", "edge/a"));
    assert!(
        parse(&bad_id)
            .expect_err("slash")
            .to_string()
            .contains("cluster.edge_id")
    );
    let with_user = format!(
        "{MINIMAL}{}",
        CLUSTER.replace("http://", "http://iop:secret@")
    );
    let err = parse(&with_user).expect_err("credentials").to_string();
    assert!(
        err.contains("cluster.endpoints") && !err.contains("secret"),
        "{err}"
    );
    let bad_url = format!("{MINIMAL}{}", CLUSTER.replace("http://", "etcd://"));
    assert!(
        parse(&bad_url)
            .expect_err("scheme")
            .to_string()
            .contains("cluster.endpoints")
    );
    // A wildcard listener cannot be what others dial.
    let wildcard = format!("{MINIMAL}{CLUSTER}")
        .replace("127.0.0.1:7100", "0.0.0.0:7100")
        .replace(
            "nodes_plaintext = true",
            "nodes_plaintext = true\nallow_public_plaintext = true",
        );
    assert!(
        parse(&wildcard)
            .expect_err("wildcard")
            .to_string()
            .contains("cluster.advertise_nodes")
    );
    let named = format!("{wildcard}advertise_nodes = \"10.0.0.1:7100\"\n");
    assert_eq!(
        parse(&named)
            .expect("named")
            .cluster
            .expect("cluster")
            .advertise_nodes,
        "10.0.0.1:7100"
    );
}

#[test]
fn the_shared_configuration_replaces_the_sections_it_holds_and_nothing_else() {
    let local = format!("{MINIMAL}\n[auth]\nadmin_loopback = true\n{CLUSTER}");
    let shared = MINIMAL
        .split_once("[[nodes]]")
        .map(|(_, rest)| format!("[[nodes]]{rest}"))
        .expect("nodes")
        .replace("name = \"chat\"", "name = \"pushed\"");
    let config = Config::parse_shared(&local, &shared, Path::new("edge.toml")).expect("valid");
    assert!(config.core.models.contains_key("pushed") && !config.core.models.contains_key("chat"));
    // `[auth]` was not in the shared text: the local file's stays.
    assert!(config.http.admin_loopback);
    assert!(config.cluster.is_some());
    let listen = format!("[listen]\nhttp = \"127.0.0.1:1\"\nnodes = \"127.0.0.1:2\"\n{shared}");
    let err =
        Config::parse_shared(&local, &listen, Path::new("edge.toml")).expect_err("per process");
    assert!(
        err.to_string().contains("belongs to each edge's own file"),
        "{err}"
    );
    let broken = shared.replace("node = \"n1\"", "node = \"nobody\"");
    assert!(Config::parse_shared(&local, &broken, Path::new("edge.toml")).is_err());
}

#[test]
fn a_minimal_config_parses() {
    let cfg = Config::parse(MINIMAL, Path::new("edge.toml")).expect("valid");
    assert_eq!(cfg.core.nodes.len(), 1);
    assert_eq!(cfg.core.models["chat"].candidates.len(), 1);
    assert!(cfg.http.api_keys.is_empty());
    assert!(cfg.tls.nodes.is_none(), "plaintext as asked");
}

#[test]
fn the_shutdown_grace_defaults_to_30_s_may_be_0_and_is_bounded() {
    let grace = |extra: &str| {
        Config::parse(&format!("{MINIMAL}\n{extra}\n"), Path::new("edge.toml"))
            .map(|cfg| cfg.http.shutdown_grace)
    };
    assert_eq!(grace("").expect("valid"), Duration::from_secs(30));
    assert_eq!(
        grace("[limits]\nshutdown_grace_sec = 0").expect("valid"),
        Duration::ZERO
    );
    assert_eq!(
        grace("[limits]\nshutdown_grace_sec = 86400").expect("valid"),
        Duration::from_secs(86_400)
    );
    let err = grace("[limits]\nshutdown_grace_sec = 86401").expect_err("too long");
    assert!(
        err.to_string().contains("limits.shutdown_grace_sec"),
        "{err}"
    );
}

#[test]
fn traces_go_where_the_file_or_the_standard_environment_says() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |name: &str| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    };
    let none = TraceExport::resolve(RawTracing::default(), env(&[])).expect("valid");
    assert_eq!(none, None);
    let base = TraceExport::resolve(
        RawTracing::default(),
        env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=abc"),
        ]),
    )
    .expect("valid")
    .expect("configured");
    assert_eq!(base.endpoint.to_string(), "http://collector:4318/v1/traces");
    assert!(base.json);
    assert_eq!(
        base.headers,
        vec![("x-api-key".to_owned(), "abc".to_owned())]
    );
    assert!(
        !format!("{base:?}").contains("abc"),
        "a header's value in Debug"
    );
    let disabled = TraceExport::resolve(
        RawTracing::default(),
        env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
            ("OTEL_SDK_DISABLED", "true"),
        ]),
    );
    assert_eq!(disabled.expect("valid"), None);
    let grpc = TraceExport::resolve(
        RawTracing {
            otlp_endpoint: Some("http://collector:4317".into()),
            protocol: Some("grpc".into()),
            ..RawTracing::default()
        },
        env(&[]),
    );
    assert!(grpc.is_err_and(|e| e.to_string().contains("tracing.protocol")));
    let bad = TraceExport::resolve(
        RawTracing {
            otlp_endpoint: Some("collector:4318".into()),
            ..RawTracing::default()
        },
        env(&[]),
    );
    assert!(bad.is_err_and(|e| e.to_string().contains("tracing.otlp_endpoint")));
    let userinfo = TraceExport::resolve(
        RawTracing {
            otlp_endpoint: Some("https://me:secret@collector:4318/v1/traces".into()),
            ..RawTracing::default()
        },
        env(&[]),
    );
    assert!(userinfo.is_err_and(|e| !e.to_string().contains("secret")));
}

#[test]
fn worker_threads_default_to_half_the_cpus_and_are_bounded() {
    let threads = |extra: &str| {
        Config::parse(&format!("{MINIMAL}\n{extra}\n"), Path::new("edge.toml"))
            .map(|cfg| cfg.worker_threads.get())
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(threads("").expect("valid"), (cpus / 2).max(1));
    assert_eq!(threads("[runtime]\nworker_threads = 1").expect("valid"), 1);
    assert_eq!(threads("[runtime]\nworker_threads = 8").expect("valid"), 8);
    for bad in ["0", "1025", "-1"] {
        let err = threads(&format!("[runtime]\nworker_threads = {bad}")).expect_err("out of range");
        assert!(err.to_string().contains("worker_threads"), "{err}");
    }
}

#[test]
fn the_head_limit_is_never_below_what_hyper_accepts() {
    let head = |limit: &str| {
        let text = format!("{MINIMAL}\n[limits]\n{limit}\n");
        Config::parse(&text, Path::new("edge.toml"))
            .expect("valid")
            .http
            .max_header_bytes
    };
    assert_eq!(head(""), MIN_HEADER_BYTES);
    // Below hyper's minimum it would panic on every connection: raised instead.
    assert_eq!(head("max_header_bytes = 5000"), MIN_HEADER_BYTES);
    assert_eq!(head("max_header_bytes = 65536"), 65_536);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.max_buf_size(head("max_header_bytes = 1"));
}

#[test]
fn public_plaintext_needs_a_second_opt_in_and_keys_may_be_hashed() {
    let text = MINIMAL.replace("127.0.0.1:7100", "0.0.0.0:7100").replace(
        "nodes_plaintext = true",
        "nodes_plaintext = true\nallow_public_plaintext = true",
    );
    let digest = iop_proto_core::token::sha256_hex(b"sk-admin");
    let text =
        format!("{text}\n[auth]\napi_keys = [\"sk-client\"]\nadmin_keys = [\"sha256:{digest}\"]\n");
    let cfg = Config::parse(&text, Path::new("edge.toml")).expect("valid");
    assert!(cfg.http.admin_keys[0].verify(b"sk-admin"));
    assert!(cfg.http.api_keys[0].verify(b"sk-client"));
}

#[test]
fn errors_name_the_key() {
    let cases = [
        (
            MINIMAL.replace("type = \"mock\"", "type = \"cli\""),
            "nodes[0].adapters[0].type",
        ),
        (
            MINIMAL.replace("token = \"t-0123456789abcdef\"", ""),
            "nodes[0].token",
        ),
        (
            MINIMAL.replace("t-0123456789abcdef", "short"),
            "nodes[0].token",
        ),
        (
            MINIMAL
                .replace("127.0.0.1:7100", "0.0.0.0:7100")
                .replace("nodes_plaintext = true", "nodes_plaintext = true\nallow_public_plaintext = true")
                .replace("t-0123456789abcdef", EXAMPLE_TOKEN),
            "nodes[0].token",
        ),
        (
            MINIMAL.replace("127.0.0.1:7100", "0.0.0.0:7100"),
            "listen.nodes_plaintext",
        ),
        (
            MINIMAL.replace("nodes_plaintext = true", ""),
            "listen.nodes_tls",
        ),
        (
            MINIMAL.replace(
                "nodes_plaintext = true",
                "[listen.nodes_tls]\ncert_file = \"/nonexistent/c.pem\"\nkey_file = \"/nonexistent/k.pem\"",
            ),
            "listen.nodes_tls.cert_file",
        ),
        (format!("{MINIMAL}\n[auth]\napi_keys = [\"\", \"sk-real\"]\n"), "auth.api_keys[0]"),
        (format!("{MINIMAL}\n[auth]\nadmin_keys = [\"  \"]\n"), "auth.admin_keys[0]"),
        (
            format!("{MINIMAL}\n[auth]\napi_keys = [\"sk-a\"]\nadmin_keys = [\"sk-a\"]\n"),
            "auth.admin_keys[0]",
        ),
        (
            MINIMAL.replace("nodes = \"127.0.0.1:7100\"", "nodes = \"x\""),
            "listen.nodes",
        ),
        (
            MINIMAL.replace("adapter = \"mock\"", "adapter = \"nope\""),
            "no adapter",
        ),
        (
            MINIMAL.replace("capacity = 2", "capacity = 2\nsurprise = 1"),
            "surprise",
        ),
        (
            format!("{MINIMAL}\n[queue]\nwait_timeout_ms = 0\n"),
            "queue.wait_timeout_ms",
        ),
    ];
    for (text, key) in cases {
        let err = Config::parse(&text, Path::new("edge.toml"))
            .expect_err(key)
            .to_string();
        assert!(err.contains(key), "{err:?} does not name {key}");
    }
}
