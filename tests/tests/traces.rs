//! Traces across the fabric, through the real binaries: a caller's W3C `traceparent`
//! reaches the provider (through a tunnel, and through a normalized run the Node makes)
//! with the caller's trace id and the Edge's dispatch span as parent, and an OTLP/HTTP
//! collector (a fake recording what it is sent) receives one trace per request: the
//! request span (child of the caller's span), queue wait, dispatch and first byte. A
//! request without a trace gets one, named in its log line beside its request id.
//! Without a collector the Edge records nothing and passes the caller's header on as it
//! came.

use std::time::Duration;

use iop_blackbox::client::Cluster;
use iop_blackbox::fake::{self, Behaviour, Fake, Flavor};
use iop_trace::otlp::{ExportTraceServiceRequest, Span};
use prost::Message;
use serde_json::{Value, json};

const TOKEN: &str = "traces-token-0123456789";
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// Node `n1` with an OpenAI-compatible provider (model `chat`, a tunnel) and an Ollama
/// one (model `local`, normalized runs).
fn body(openai: &str, ollama: &str) -> String {
    format!(
        "[[nodes]]\nid = \"n1\"\ntoken = \"{TOKEN}\"\n\
         [[nodes.adapters]]\nname = \"api\"\ntype = \"openai_compat\"\nbase_url = \"{openai}\"\ncapacity = 4\ntargets = [\"m\"]\n\
         [[nodes.adapters]]\nname = \"llama\"\ntype = \"ollama\"\nbase_url = \"{ollama}\"\ncapacity = 4\ntargets = [\"llama3\"]\n\
         [[models]]\nname = \"chat\"\nproviders = [{{ node = \"n1\", adapter = \"api\", target = \"m\" }}]\n\
         [[models]]\nname = \"local\"\nproviders = [{{ node = \"n1\", adapter = \"llama\", target = \"llama3\" }}]\n"
    )
}

fn ask(model: &str, stream: bool) -> Value {
    json!({"model": model, "stream": stream, "messages": [{"role": "user", "content": "hello"}]})
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Every span the collector received so far.
fn received(collector: &Fake) -> Vec<Span> {
    collector
        .state
        .requests()
        .iter()
        .filter(|r| r.path == "/v1/traces")
        .flat_map(|r| {
            ExportTraceServiceRequest::decode(r.body.as_ref())
                .expect("an OTLP protobuf export")
                .resource_spans
        })
        .flat_map(|rs| rs.scope_spans)
        .flat_map(|ss| ss.spans)
        .collect()
}

/// The `traceparent` the provider `fake` saw on its last request.
fn seen_traceparent(fake: &Fake) -> String {
    let requests = fake.state.requests();
    let last = requests.last().expect("the provider was called");
    last.headers
        .iter()
        .find(|(n, _)| n == "traceparent")
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

async fn spans_of(collector: &Fake, trace: &str, n: usize) -> Vec<Span> {
    for _ in 0..100 {
        let spans: Vec<Span> = received(collector)
            .into_iter()
            .filter(|s| hex(&s.trace_id) == trace)
            .collect();
        if spans.len() >= n {
            return spans;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the collector never got {n} spans of trace {trace}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_trace_reaches_the_provider_and_the_collector() {
    let collector = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let openai = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let ollama = fake::start(Flavor::Ollama, Behaviour::default()).await;
    let head = format!(
        "[tracing]\notlp_endpoint = \"{}/v1/traces\"\nservice_name = \"edge-under-test\"\n",
        collector.url()
    );
    let cluster = Cluster::start(&head, &body(&openai.url(), &ollama.url()));
    let _node = cluster.node("n1", TOKEN);
    cluster.wait_ready("n1").await;

    for (i, (model, provider)) in [("chat", &openai), ("local", &ollama)]
        .into_iter()
        .enumerate()
    {
        for stream in [false, true] {
            // One trace per request: the caller's trace id, its own span.
            let trace = format!("{}{i}{}", &TRACE[..30], u8::from(stream));
            let traceparent = format!("00-{trace}-{CALLER_SPAN}-01");
            let r = cluster
                .http()
                .with_header("traceparent", &traceparent)
                .with_header("tracestate", "vendor=abc")
                .post("/v1/chat/completions", &ask(model, stream))
                .await;
            assert_eq!(
                r.status,
                200,
                "{model}: {}",
                String::from_utf8_lossy(&r.body)
            );

            let spans = spans_of(&collector, &trace, 4).await;
            let named =
                |name: &str| -> Vec<&Span> { spans.iter().filter(|s| s.name == name).collect() };
            let requests = named("request");
            assert_eq!(requests.len(), 1, "one request span per request: {spans:?}");
            let request = requests[0];
            assert_eq!(
                hex(&request.parent_span_id),
                CALLER_SPAN,
                "child of the caller's span"
            );
            assert!(request.end_time_unix_nano > request.start_time_unix_nano);
            let dispatch = named("dispatch");
            assert_eq!(dispatch.len(), 1, "{spans:?}");
            assert_eq!(dispatch[0].parent_span_id, request.span_id);
            assert_eq!(named("queue wait").len(), 1);
            assert_eq!(named("first byte").len(), 1);
            assert_eq!(named("first byte")[0].parent_span_id, dispatch[0].span_id);
            let attribute = |key: &str| {
                request
                    .attributes
                    .iter()
                    .find(|a| a.key == key)
                    .and_then(|a| a.value.clone())
            };
            assert!(attribute("gen_ai.request.model").is_some());
            assert!(attribute("http.response.status_code").is_some());

            // The provider saw the same trace, its parent the Edge's dispatch span.
            assert_eq!(
                seen_traceparent(provider),
                format!("00-{trace}-{}-01", hex(&dispatch[0].span_id)),
                "{model}, stream={stream}"
            );
        }
    }
    // A tunnel passes the caller's tracestate on.
    let seen = openai.state.requests();
    assert!(
        seen.last().is_some_and(|r| r
            .headers
            .iter()
            .any(|(n, v)| n == "tracestate" && v == "vendor=abc")),
        "{:?}",
        seen.last().map(|r| &r.headers)
    );
    // The resource names the service.
    let export = collector.state.requests();
    let first = ExportTraceServiceRequest::decode(export[0].body.as_ref()).expect("decodes");
    let resource = first.resource_spans[0]
        .resource
        .clone()
        .expect("a resource");
    assert!(format!("{resource:?}").contains("edge-under-test"));
    assert!(export.iter().all(|r| {
        r.headers
            .iter()
            .any(|(n, v)| n == "content-type" && v == "application/x-protobuf")
    }));

    // Without a trace, the Edge starts one, and the log line names it beside the request.
    let r = cluster
        .http()
        .with_header("x-request-id", "traces-untraced-1")
        .post("/v1/chat/completions", &ask("chat", false))
        .await;
    assert_eq!(r.status, 200);
    let seen = seen_traceparent(&openai);
    let trace = seen.split('-').nth(1).expect("a traceparent").to_owned();
    assert_eq!(trace.len(), 32);
    let spans = spans_of(&collector, &trace, 4).await;
    let request = spans
        .iter()
        .find(|s| s.name == "request")
        .expect("a request span");
    assert!(request.parent_span_id.is_empty(), "a root span");
    let mut logged = false;
    for _ in 0..50 {
        logged = cluster.edge.log().lines().any(|l| {
            l.contains("request_id=\"traces-untraced-1\"")
                && l.contains(&format!("trace_id=\"{trace}\""))
        });
        if logged {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(logged, "{}", cluster.edge.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_collector_the_callers_traceparent_passes_as_it_came() {
    let openai = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let ollama = fake::start(Flavor::Ollama, Behaviour::default()).await;
    let cluster = Cluster::start("", &body(&openai.url(), &ollama.url()));
    let _node = cluster.node("n1", TOKEN);
    cluster.wait_ready("n1").await;
    let traceparent = format!("00-{TRACE}-{CALLER_SPAN}-01");
    for (model, provider) in [("chat", &openai), ("local", &ollama)] {
        let r = cluster
            .http()
            .with_header("traceparent", &traceparent)
            .post("/v1/chat/completions", &ask(model, false))
            .await;
        assert_eq!(r.status, 200);
        assert_eq!(seen_traceparent(provider), traceparent, "{model}");
    }
    // Byte for byte: flags this version does not define, a later version's fields.
    for given in [
        format!("00-{TRACE}-{CALLER_SPAN}-03"),
        format!("cc-{TRACE}-{CALLER_SPAN}-01-what-comes-later"),
    ] {
        let r = cluster
            .http()
            .with_header("traceparent", &given)
            .post("/v1/chat/completions", &ask("chat", false))
            .await;
        assert_eq!(r.status, 200);
        assert_eq!(seen_traceparent(&openai), given);
    }
    // An invalid one is not passed on.
    let r = cluster
        .http()
        .with_header("traceparent", "00-not-a-trace-01")
        .post("/v1/chat/completions", &ask("chat", false))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(seen_traceparent(&openai), "");
    assert!(
        cluster
            .edge
            .log()
            .contains(&format!("trace_id=\"{TRACE}\""))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sample_ratio_applies_to_new_traces_and_the_callers_decision_is_kept() {
    let collector = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let openai = fake::start(Flavor::OpenAi, Behaviour::default()).await;
    let ollama = fake::start(Flavor::Ollama, Behaviour::default()).await;
    let head = format!(
        "[tracing]\notlp_endpoint = \"{}/v1/traces\"\nprotocol = \"http/json\"\nsample_ratio = 0.0\n",
        collector.url()
    );
    let cluster = Cluster::start(&head, &body(&openai.url(), &ollama.url()));
    let _node = cluster.node("n1", TOKEN);
    cluster.wait_ready("n1").await;
    // A new trace is not sampled: passed on marked so, and not recorded.
    let r = cluster
        .http()
        .post("/v1/chat/completions", &ask("chat", false))
        .await;
    assert_eq!(r.status, 200);
    let unsampled = seen_traceparent(&openai);
    assert!(
        unsampled.starts_with("00-") && unsampled.ends_with("-00"),
        "{unsampled}"
    );
    // The caller's sampled trace is recorded all the same, as JSON.
    let traceparent = format!("00-{TRACE}-{CALLER_SPAN}-01");
    let r = cluster
        .http()
        .with_header("traceparent", &traceparent)
        .post("/v1/chat/completions", &ask("chat", false))
        .await;
    assert_eq!(r.status, 200);
    let mut got = Vec::new();
    for _ in 0..100 {
        got = collector
            .state
            .requests()
            .into_iter()
            .filter(|r| r.path == "/v1/traces")
            .map(|r| serde_json::from_slice::<Value>(&r.body).expect("OTLP JSON"))
            .collect();
        if !got.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let text = serde_json::to_string(&got).expect("json");
    assert!(text.contains(TRACE), "{text}");
    let unsampled_trace = unsampled.split('-').nth(1).expect("a trace id");
    assert!(
        !text.contains(unsampled_trace),
        "an unsampled trace was recorded"
    );
}
