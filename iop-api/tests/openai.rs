//! Table tests of the OpenAI surface: what a body asks for, the token estimate, the one
//! error mapping, and every response shape the `Responder` renders.
//!
//! One file on purpose, past the 800-line norm: each file under `tests/` is a test binary
//! of its own, linked against the whole dependency graph, and on a 2-core CI machine every
//! extra binary costs a link; this suite covers one subject and shares its helpers.

use std::sync::Arc;

use bytes::Bytes;
use iop_api::openai::*;
use iop_json::{for_target, member_value, rewrite_model};
use iop_proto_core::edge::{CommandError, StreamViolation};
use iop_proto_core::wire::{
    ErrorDetail, Header, ProviderTunnelFrame, RunEvent, RunEventType, TunnelFrameKind, Usage,
};
use iop_proto_core::{DispatchShape, Outcome, RequestError, SubmitError};
use serde_json::{Value, json};

mod common;

// ----- inputs -----

fn options(stream: bool, include_usage: bool, wants_tools: bool) -> ResponseOptions {
    ResponseOptions {
        model: "m".into(),
        run_id: "run-7".into(),
        created: 1_700_000_000,
        stream,
        include_usage,
        wants_tools,
    }
}

enum In {
    Dispatched(DispatchShape),
    Start,
    Delta(&'static str),
    Complete {
        usage: bool,
        metadata: &'static [(&'static str, &'static str)],
    },
    Error(&'static str),
    Status(u32, &'static [(&'static str, &'static str)]),
    Body(&'static str),
    TunnelError(&'static str),
    TunnelEnd,
    End(Outcome),
    Timeout,
    Idle,
}

fn detail(code: &str) -> ErrorDetail {
    ErrorDetail {
        code: code.into(),
        message: "upstream said no".into(),
        retryable: false,
    }
}

fn run(responder: &mut Responder, inputs: Vec<In>) -> Vec<Out> {
    let mut sequence = 0;
    let mut event = |kind: RunEventType| {
        sequence += 1;
        RunEvent {
            run_id: "run-7".into(),
            sequence: sequence - 1,
            r#type: kind as i32,
            ..RunEvent::default()
        }
    };
    let frame = |kind: TunnelFrameKind| ProviderTunnelFrame {
        run_id: "run-7".into(),
        kind: kind as i32,
        ..ProviderTunnelFrame::default()
    };
    let mut out = Vec::new();
    for input in inputs {
        match input {
            In::Dispatched(shape) => responder.handle_dispatched(shape),
            In::Start => responder.handle_run_event(event(RunEventType::Start)),
            In::Delta(text) => responder.handle_run_event(RunEvent {
                delta: text.into(),
                ..event(RunEventType::Delta)
            }),
            In::Complete { usage, metadata } => responder.handle_run_event(RunEvent {
                usage: usage.then_some(Usage {
                    prompt_tokens: 5,
                    completion_tokens: 2,
                    total_tokens: 7,
                }),
                metadata: metadata
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
                ..event(RunEventType::Complete)
            }),
            In::Error(code) => responder.handle_run_event(RunEvent {
                error: Some(detail(code)),
                ..event(RunEventType::Error)
            }),
            In::Status(code, headers) => responder.handle_tunnel_frame(ProviderTunnelFrame {
                status_code: code,
                headers: headers
                    .iter()
                    .map(|(n, v)| Header {
                        name: (*n).into(),
                        value: Bytes::from_static(v.as_bytes()),
                    })
                    .collect(),
                ..frame(TunnelFrameKind::Status)
            }),
            In::Body(text) => responder.handle_tunnel_frame(ProviderTunnelFrame {
                body: Bytes::from_static(text.as_bytes()),
                ..frame(TunnelFrameKind::Body)
            }),
            In::TunnelError(code) => responder.handle_tunnel_frame(ProviderTunnelFrame {
                error: Some(detail(code)),
                ..frame(TunnelFrameKind::Error)
            }),
            In::TunnelEnd => responder.handle_tunnel_frame(frame(TunnelFrameKind::End)),
            In::End(outcome) => responder.handle_end(&outcome),
            In::Timeout => responder.handle_timeout(),
            In::Idle => responder.handle_idle(),
        }
        out.extend(std::iter::from_fn(|| responder.poll_output()));
    }
    out
}

// ----- reading outputs -----

fn whole(out: &[Out]) -> (u16, Value) {
    match out {
        [Out::Whole { status, body }] => {
            (*status, serde_json::from_slice(body).expect("a JSON body"))
        }
        other => panic!("expected one whole response, got {other:?}"),
    }
}

/// The SSE events of a stream after its head: JSON payloads, `[DONE]` as a string, and
/// keep-alive comments as `":"`.
fn events(out: &[Out]) -> (u16, Vec<(String, String)>, Vec<Value>) {
    let Some(Out::Head { status, headers }) = out.first() else {
        panic!("expected a head first, got {out:?}");
    };
    let headers = headers
        .iter()
        .map(|h| {
            (
                h.name.clone(),
                String::from_utf8_lossy(&h.value).into_owned(),
            )
        })
        .collect();
    let mut values = Vec::new();
    for piece in &out[1..] {
        let Out::Data(bytes) = piece else {
            values.push(Value::String(format!("{piece:?}")));
            continue;
        };
        let text = std::str::from_utf8(bytes).expect("utf8");
        assert!(
            text.ends_with("\n\n"),
            "one whole SSE event per chunk: {text:?}"
        );
        if text.starts_with(':') {
            values.push(json!(":"));
        } else if let Some(data) = text.strip_prefix("data: ") {
            let data = data.trim_end();
            values.push(serde_json::from_str(data).unwrap_or_else(|_| json!(data)));
        } else {
            values.push(json!(text));
        }
    }
    (*status, headers, values)
}

fn deltas(values: &[Value]) -> Vec<Value> {
    values
        .iter()
        .filter_map(|v| v.pointer("/choices/0/delta").cloned())
        .collect()
}

fn finish_reasons(values: &[Value]) -> Vec<Value> {
    values
        .iter()
        .filter_map(|v| v.pointer("/choices/0/finish_reason").cloned())
        .filter(|f| !f.is_null())
        .collect()
}

/// Run metadata as key/value pairs.
type Metadata = &'static [(&'static str, &'static str)];
/// Text chunks expected.
type Texts = &'static [&'static str];

const NATIVE: Metadata = &[(
    "openai_tool_calls",
    r#"[{"id":"call_x","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Seoul\"}"}}]"#,
)];
const FALLBACK: Metadata = &[("openai_text_tool_fallback", "true")];
const FALLBACK_TEXT: &str = "```json\n{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Seoul\"}}]}\n```";

// ----- whole responses -----

#[test]
fn a_whole_run_is_one_chat_completion() {
    let mut r = Responder::new(options(false, false, false));
    let out = run(
        &mut r,
        vec![
            In::Dispatched(DispatchShape::Run),
            In::Start,
            In::Delta("Hel"),
            In::Delta("lo"),
            In::Complete {
                usage: true,
                metadata: &[],
            },
        ],
    );
    let (status, body) = whole(&out);
    assert_eq!(status, 200);
    assert_eq!(body["id"], "chatcmpl-run-7");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "m");
    assert_eq!(body["created"], 1_700_000_000);
    assert_eq!(
        body["choices"][0]["message"],
        json!({"role": "assistant", "content": "Hello"})
    );
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7})
    );
    assert!(r.is_done() && !r.needs_cancel());
    assert_eq!(r.status(), Some(200));
    // The end that follows changes nothing.
    assert!(run(&mut r, vec![In::End(Outcome::Completed)]).is_empty());
}

#[test]
fn whole_tool_calls_come_back_natively_or_from_the_text_fallback() {
    // (metadata, text, content expected, tool name expected, finish)
    let table: &[(Metadata, &str, Value, Option<&str>, &str)] = &[
        (NATIVE, "", Value::Null, Some("get_weather"), "tool_calls"),
        (
            NATIVE,
            "Checking.",
            json!("Checking."),
            Some("get_weather"),
            "tool_calls",
        ),
        (
            FALLBACK,
            FALLBACK_TEXT,
            Value::Null,
            Some("get_weather"),
            "tool_calls",
        ),
        (
            FALLBACK,
            "No tool needed.",
            json!("No tool needed."),
            None,
            "stop",
        ),
        (&[], FALLBACK_TEXT, json!(FALLBACK_TEXT), None, "stop"),
    ];
    for (metadata, text, content, tool, finish) in table {
        let mut r = Responder::new(options(false, false, true));
        let mut inputs = vec![In::Dispatched(DispatchShape::Run), In::Start];
        if !text.is_empty() {
            inputs.push(In::Delta(text));
        }
        inputs.push(In::Complete {
            usage: false,
            metadata,
        });
        let (status, body) = whole(&run(&mut r, inputs));
        let message = &body["choices"][0]["message"];
        assert_eq!(status, 200);
        assert_eq!(message["content"], *content, "{text:?}");
        assert_eq!(
            message
                .pointer("/tool_calls/0/function/name")
                .and_then(Value::as_str),
            *tool,
            "{text:?}"
        );
        assert_eq!(body["choices"][0]["finish_reason"], *finish);
        if *metadata == FALLBACK && tool.is_some() {
            assert_eq!(message["tool_calls"][0]["id"], "call_run-7_0");
            assert_eq!(
                message["tool_calls"][0]["function"]["arguments"],
                "{\"city\":\"Seoul\"}"
            );
        }
    }
}

#[test]
fn a_request_that_ends_before_its_response_gets_the_mapped_error() {
    let cases = [
        (
            vec![In::End(Outcome::Expired)],
            503,
            "capacity_timeout",
            false,
        ),
        (vec![In::Timeout], 504, "timeout", true),
        (
            vec![
                In::Dispatched(DispatchShape::Run),
                In::Start,
                In::Error("timeout"),
            ],
            504,
            "timeout",
            false,
        ),
        (
            vec![
                In::Dispatched(DispatchShape::Run),
                In::Error("rate_limited"),
            ],
            502,
            "rate_limited",
            false,
        ),
        (
            vec![
                In::Dispatched(DispatchShape::Run),
                In::End(Outcome::Failed(RequestError::NodeLost {
                    node_id: Arc::from("n1"),
                })),
            ],
            503,
            "node_lost",
            false,
        ),
        (
            vec![
                In::Dispatched(DispatchShape::Tunnel),
                In::TunnelError("bad_gateway"),
            ],
            502,
            "bad_gateway",
            false,
        ),
        (
            vec![In::Dispatched(DispatchShape::Tunnel), In::Timeout],
            504,
            "timeout",
            true,
        ),
    ];
    for (inputs, status, code, cancel) in cases {
        let mut r = Responder::new(options(false, false, false));
        let (got, body) = whole(&run(&mut r, inputs));
        assert_eq!((got, body["error"]["code"].as_str()), (status, Some(code)));
        assert_eq!(
            body["error"]["type"],
            if status == 400 {
                "invalid_request_error"
            } else {
                "server_error"
            }
        );
        assert_eq!(r.needs_cancel(), cancel, "{code}");
        assert!(r.is_done());
    }
}

// ----- streamed runs -----

#[test]
fn a_streamed_run_is_a_role_chunk_deltas_a_finish_and_done() {
    let mut r = Responder::new(options(true, false, false));
    let out = run(
        &mut r,
        vec![
            In::Dispatched(DispatchShape::Run),
            In::Idle,
            In::Start,
            In::Delta("Hel"),
            In::Delta(""),
            In::Delta("lo"),
            In::Complete {
                usage: true,
                metadata: &[],
            },
        ],
    );
    let (status, headers, values) = events(&out);
    assert_eq!(status, 200);
    assert!(headers.contains(&("content-type".into(), "text/event-stream".into())));
    assert_eq!(
        values[0],
        json!(":"),
        "a keep-alive comment while the run is queued"
    );
    assert_eq!(
        deltas(&values),
        vec![
            json!({"role": "assistant", "content": ""}),
            json!({"content": "Hel"}),
            json!({"content": "lo"}),
            json!({}),
        ]
    );
    assert_eq!(finish_reasons(&values), vec![json!("stop")]);
    assert!(
        values.iter().all(|v| v.get("usage").is_none()),
        "usage only when asked"
    );
    assert_eq!(values.last(), Some(&json!("[DONE]")));
    assert!(
        values[1..values.len() - 1]
            .iter()
            .all(|v| v["id"] == "chatcmpl-run-7" && v["object"] == "chat.completion.chunk")
    );
    assert!(r.is_done() && !r.needs_cancel());
}

#[test]
fn include_usage_adds_a_usage_chunk_before_done() {
    let mut r = Responder::new(options(true, true, false));
    let out = run(
        &mut r,
        vec![
            In::Dispatched(DispatchShape::Run),
            In::Start,
            In::Complete {
                usage: true,
                metadata: &[],
            },
        ],
    );
    let (_, _, values) = events(&out);
    let usage = &values[values.len() - 2];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["total_tokens"], 7);
}

#[test]
fn streamed_tool_calls_never_show_the_call_as_text() {
    // (metadata, text, text chunks expected, tool name expected, finish)
    let table: &[(Metadata, &str, Texts, Option<&str>, &str)] = &[
        (NATIVE, "", &[], Some("get_weather"), "tool_calls"),
        (
            FALLBACK,
            FALLBACK_TEXT,
            &[],
            Some("get_weather"),
            "tool_calls",
        ),
        (FALLBACK, "Sunny.", &["Sunny."], None, "stop"),
        (&[], "Plain answer.", &["Plain answer."], None, "stop"),
    ];
    for (metadata, text, texts, tool, finish) in table {
        let mut r = Responder::new(options(true, false, true));
        let mut inputs = vec![In::Dispatched(DispatchShape::Run), In::Start];
        if !text.is_empty() {
            inputs.push(In::Delta(text));
        }
        let before_complete = run(&mut r, inputs);
        // Text that may be a call written out (JSON, a fenced block) is held back while
        // tools are offered; prose streams at once.
        let maybe_call = text.trim_start().starts_with(['{', '`']);
        let streamed: Vec<String> = deltas(&events(&before_complete).2)
            .iter()
            .filter_map(|d| {
                d["content"]
                    .as_str()
                    .filter(|c| !c.is_empty())
                    .map(str::to_owned)
            })
            .collect();
        if maybe_call {
            assert!(
                streamed.is_empty(),
                "a possible call is held back: {text:?}"
            );
        } else {
            assert_eq!(streamed.concat(), *text, "prose streams before the end");
        }
        let out = run(
            &mut r,
            vec![In::Complete {
                usage: false,
                metadata,
            }],
        );
        let values: Vec<Value> = out
            .iter()
            .map(|o| match o {
                Out::Data(b) => {
                    let s = std::str::from_utf8(b).expect("utf8");
                    serde_json::from_str(s.trim_start_matches("data: ").trim_end())
                        .unwrap_or_else(|_| json!(s.trim_start_matches("data: ").trim_end()))
                }
                other => panic!("{other:?}"),
            })
            .collect();
        let text_chunks: Vec<String> = deltas(&values)
            .iter()
            .filter_map(|d| d["content"].as_str().map(str::to_owned))
            .collect();
        let text_chunks = if maybe_call {
            text_chunks
        } else {
            // What streamed before the end is part of the answer's text.
            let mut all = streamed;
            all.extend(text_chunks);
            all
        };
        assert_eq!(text_chunks, *texts, "{text:?}");
        let calls: Vec<Value> = deltas(&values)
            .iter()
            .filter_map(|d| d.get("tool_calls").cloned())
            .collect();
        assert_eq!(
            calls
                .first()
                .and_then(|c| c.pointer("/0/function/name"))
                .and_then(Value::as_str),
            *tool
        );
        if tool.is_some() {
            assert_eq!(calls[0][0]["index"], 0);
        }
        assert_eq!(finish_reasons(&values), vec![json!(finish)]);
        assert_eq!(values.last(), Some(&json!("[DONE]")));
    }
}

#[test]
fn a_stream_that_fails_after_its_head_says_so_in_an_error_event() {
    let lost = || {
        Outcome::Failed(RequestError::NodeLost {
            node_id: Arc::from("n1"),
        })
    };
    let violation = || Outcome::Failed(RequestError::Violation(StreamViolation::FrameForRun));
    // (what happens after some text, code of the error event, must cancel)
    let cases: Vec<(Vec<In>, &str, bool)> = vec![
        (vec![In::Error("overloaded")], "overloaded", false),
        (vec![In::End(lost())], "stream_failed", false),
        (vec![In::End(violation())], "stream_failed", false),
        (vec![In::Timeout], "timeout", true),
    ];
    for (after, code, cancel) in cases {
        let mut r = Responder::new(options(true, false, false));
        let mut inputs = vec![
            In::Dispatched(DispatchShape::Run),
            In::Start,
            In::Delta("Hi"),
        ];
        inputs.extend(after);
        let (status, _, values) = events(&run(&mut r, inputs));
        assert_eq!(status, 200, "the head went out before the failure");
        let last = values.last().expect("an error event");
        assert_eq!(last["error"]["code"], code);
        assert!(!values.contains(&json!("[DONE]")));
        assert_eq!(r.status(), Some(599));
        assert_eq!(r.needs_cancel(), cancel, "{code}");
        assert!(r.is_done());
    }
}

// ----- tunnels -----

#[test]
fn a_tunnel_passes_status_allowed_headers_and_body_through() {
    let mut r = Responder::new(options(true, false, false));
    let out = run(
        &mut r,
        vec![
            In::Dispatched(DispatchShape::Tunnel),
            In::Idle,
            In::Status(
                201,
                &[
                    ("Content-Type", "text/event-stream"),
                    ("Set-Cookie", "session=secret"),
                    ("x-request-id", "abc"),
                ],
            ),
            In::Body("data: {\"a\":1}\n\n"),
            In::Idle,
            In::Body("data: {\"b\""),
            In::Idle,
            In::Body(":2}\n\n"),
            In::TunnelEnd,
        ],
    );
    let Some(Out::Head { status, headers }) = out.first() else {
        panic!("a head first: {out:?}");
    };
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|h| {
            (
                h.name.clone(),
                String::from_utf8_lossy(&h.value).into_owned(),
            )
        })
        .collect();
    let body: Vec<String> = out[1..]
        .iter()
        .map(|o| match o {
            Out::Data(b) => String::from_utf8_lossy(b).into_owned(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(*status, 201);
    assert!(headers.iter().any(|(n, _)| n == "Content-Type"));
    assert!(
        !headers
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case("set-cookie")),
        "only allow-listed provider headers reach the caller: {headers:?}"
    );
    // No comment before the head; one between events; none inside a half-sent event.
    assert_eq!(
        body,
        [
            "data: {\"a\":1}\n\n",
            ": keep-alive\n\n",
            "data: {\"b\"",
            ":2}\n\n"
        ]
    );
    assert!(r.is_done() && !r.needs_cancel());
}

#[test]
fn a_tunnel_failure_after_its_head_is_an_event_for_sse_and_an_abort_otherwise() {
    for (content_type, sse) in [("text/event-stream", true), ("application/json", false)] {
        let headers: &'static [(&'static str, &'static str)] = if sse {
            &[("content-type", "text/event-stream")]
        } else {
            &[("content-type", "application/json")]
        };
        let mut r = Responder::new(options(false, false, false));
        let out = run(
            &mut r,
            vec![
                In::Dispatched(DispatchShape::Tunnel),
                In::Status(200, headers),
                In::Body("{\"partial\":"),
                In::Idle,
                In::TunnelError("reset"),
            ],
        );
        let last = out.last().expect("something");
        if sse {
            let Out::Data(bytes) = last else {
                panic!("{content_type}: {last:?}")
            };
            assert!(
                std::str::from_utf8(bytes)
                    .expect("utf8")
                    .contains("\"code\":\"reset\"")
            );
        } else {
            assert!(matches!(last, Out::Abort(m) if m.contains("upstream said no")));
            assert_eq!(out.len(), 3, "no keep-alive in a JSON body: {out:?}");
        }
        assert!(r.is_done() && !r.needs_cancel());
    }
    let mut r = Responder::new(options(false, false, false));
    let out = run(
        &mut r,
        vec![
            In::Dispatched(DispatchShape::Tunnel),
            In::Status(70_000, &[]),
        ],
    );
    assert!(
        matches!(out.as_slice(), [Out::Head { status: 502, .. }]),
        "{out:?}"
    );
}

// ----- the error mapping -----

#[test]
fn every_ending_and_refusal_maps_to_one_status_and_code() {
    let outcomes = [
        (Outcome::Expired, 503, Some("capacity_timeout")),
        (Outcome::Cancelled, 503, Some("cancelled")),
        (Outcome::Completed, 502, None),
        (
            Outcome::Failed(RequestError::Provider(detail("timeout"))),
            504,
            Some("timeout"),
        ),
        (
            Outcome::Failed(RequestError::Provider(detail("boom"))),
            502,
            Some("boom"),
        ),
        (
            Outcome::Failed(RequestError::Unsupported {
                model: Arc::from("m"),
            }),
            400,
            Some("unsupported_endpoint"),
        ),
        (
            Outcome::Failed(RequestError::Violation(StreamViolation::FrameForRun)),
            502,
            Some("protocol_violation"),
        ),
    ];
    for (outcome, status, code) in outcomes {
        let e = ApiError::from_outcome(&outcome);
        assert_eq!((e.status, e.code.as_deref()), (status, code), "{outcome:?}");
    }
    let submits = [
        (
            SubmitError::UnknownModel("x".into()),
            Endpoint::Chat,
            404,
            "model_not_found",
        ),
        (
            SubmitError::QueueFull {
                model: "m".into(),
                max_waiting: 3,
            },
            Endpoint::Chat,
            429,
            "queue_full",
        ),
        (
            SubmitError::NoCandidates("m".into()),
            Endpoint::Chat,
            503,
            "no_provider",
        ),
        (
            SubmitError::NoCandidates("m".into()),
            Endpoint::Embeddings,
            400,
            "unsupported_endpoint",
        ),
    ];
    for (refused, endpoint, status, code) in submits {
        let e = ApiError::from_submit(&refused, endpoint);
        assert_eq!(
            (e.status, e.code.as_deref()),
            (status, Some(code)),
            "{refused:?}"
        );
    }
    let e = ApiError::from_submit(
        &SubmitError::QueueFull {
            model: "m".into(),
            max_waiting: 3,
        },
        Endpoint::Chat,
    );
    assert_eq!(e.kind, ErrorType::RateLimit);
    let commands = [
        (CommandError::UnknownNode("n".into()), 404, "unknown_node"),
        (CommandError::NotReady("n".into()), 503, "node_not_ready"),
        (
            CommandError::NotOllama {
                node: "n".into(),
                adapter: "a".into(),
            },
            400,
            "not_ollama_adapter",
        ),
    ];
    for (refused, status, code) in commands {
        let e = ApiError::from_command(&refused);
        assert_eq!(
            (e.status, e.code.as_deref()),
            (status, Some(code)),
            "{refused:?}"
        );
    }
    let body: Value = serde_json::from_slice(&ApiError::timeout().body()).expect("json");
    assert_eq!(
        body,
        json!({"error": {"message": "the request timed out", "type": "server_error", "param": null, "code": "timeout"}})
    );
    let event = ApiError::timeout().sse_event();
    assert!(event.starts_with(b"data: {") && event.ends_with(b"}\n\n"));
}

// ----- request bodies -----

#[test]
fn inspect_reads_what_the_edge_decides_on_or_says_what_is_wrong() {
    let ok = |raw: &str, endpoint| inspect(raw.as_bytes(), endpoint).expect(raw);
    let asked = ok(
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"tools":[{"type":"function"}]}"#,
        Endpoint::Chat,
    );
    assert_eq!(
        (
            asked.model.as_str(),
            asked.stream,
            asked.include_usage,
            asked.wants_tools
        ),
        ("m", true, true, true)
    );
    let plain = ok(
        r#"{"model":"m","messages":[{}],"stream":null,"tools":[]}"#,
        Endpoint::Chat,
    );
    assert!(!plain.stream && !plain.include_usage && !plain.wants_tools);
    let spaced = ok(
        r#"{"model":"m","messages": [ {} ],"tools": [ 
 ] }"#,
        Endpoint::Chat,
    );
    assert!(
        !spaced.wants_tools,
        "an empty tools array with spaces in it"
    );
    let tools = ok(
        r#"{"model":"m","messages":[{}],"tools": [ {"type":"function"} ]}"#,
        Endpoint::Chat,
    );
    assert!(tools.wants_tools);
    ok(
        r#"{"model":"m","prompt":"once upon"}"#,
        Endpoint::Completions,
    );
    ok(r#"{"model":"m","input":[1,2,3]}"#, Endpoint::Embeddings);

    let refused = [
        ("{not json", Endpoint::Chat, None),
        ("[1,2]", Endpoint::Chat, None),
        (
            r#"{"messages":[{}]}"#,
            Endpoint::Chat,
            Some("missing_model"),
        ),
        (
            r#"{"model":7,"messages":[{}]}"#,
            Endpoint::Chat,
            Some("missing_model"),
        ),
        (
            r#"{"model":"m","messages":[]}"#,
            Endpoint::Chat,
            Some("invalid_value"),
        ),
        (
            r#"{"model":"m","messages": [ 
 ] }"#,
            Endpoint::Chat,
            Some("invalid_value"),
        ),
        (
            r#"{"model":"m","messages":{"0":{}}}"#,
            Endpoint::Chat,
            Some("invalid_value"),
        ),
        (
            r#"{"model":"m","messages":"hi"}"#,
            Endpoint::Chat,
            Some("invalid_value"),
        ),
        (
            r#"{"model":"m","messages":[{}],"stream":"yes"}"#,
            Endpoint::Chat,
            Some("invalid_value"),
        ),
        (
            r#"{"model":"m","messages":[{}]}"#,
            Endpoint::Completions,
            Some("invalid_value"),
        ),
        (
            r#"{"model":"m","prompt":null}"#,
            Endpoint::Completions,
            Some("invalid_value"),
        ),
        (
            r#"{"model":"m"}"#,
            Endpoint::Embeddings,
            Some("invalid_value"),
        ),
    ];
    for (raw, endpoint, code) in refused {
        let e = inspect(raw.as_bytes(), endpoint).expect_err(raw);
        assert_eq!((e.status, e.code.as_deref()), (400, code), "{raw}");
    }
    // JSON is UTF-8: a stray byte anywhere, even in a field the Edge does not read.
    let e = inspect(
        b"{\"model\":\"m\",\"messages\":[{}],\"user\":\"\xff\"}",
        Endpoint::Chat,
    )
    .expect_err("not UTF-8");
    assert_eq!((e.status, e.code.as_deref()), (400, None));
    assert!(e.message.contains("UTF-8"), "{}", e.message);
    let e = inspect(br#"{"model":"m","messages":[]}"#, Endpoint::Chat).expect_err("empty");
    assert!(
        e.message.contains("messages"),
        "the message names the field: {}",
        e.message
    );
}

#[test]
fn the_token_estimate_counts_text_not_json() {
    let chat = |content: &str| {
        format!(
            r#"{{"model":"gpt","messages":[{{"role":"user","content":{}}}]}}"#,
            serde_json::to_string(content).expect("string")
        )
    };
    // (text, about how many tokens a cl100k-style tokenizer gives the whole chat body)
    let english = "The quick brown fox jumps over the lazy dog.";
    let cases: &[(String, u64)] = &[
        (chat(english), 17),
        (chat(&english.repeat(20)), 17 + 19 * 10),
        (chat(&"안녕하세요 반갑습니다 ".repeat(20)), 7 + 20 * 10),
        (chat(&"我们今天去公园散步".repeat(20)), 7 + 20 * 9),
    ];
    for (body, reference) in cases {
        let estimate = estimate_tokens(body.as_bytes());
        let quarter = (body.len() as u64).div_ceil(4);
        let off = |n: u64| (n as f64 / *reference as f64 - 1.0).abs();
        assert!(
            off(estimate) <= 0.35,
            "estimate {estimate} vs about {reference} for {body:.60}"
        );
        assert!(
            off(estimate) < off(quarter),
            "no worse than bytes/4 ({quarter}) for {body:.60}"
        );
    }
    // Token-id inputs count one per number; escapes count once.
    assert_eq!(estimate_tokens(br#"{"input":[101,2023,102]}"#), 4);
    assert_eq!(estimate_tokens(br#""a\nb\u00e9""#), 4);
    assert_eq!(estimate_tokens(b"\xff\xfe"), 1, "not UTF-8: bytes/4");
    assert_eq!(estimate_tokens(b""), 0);
}

/// The estimate as first written, character by character: the byte-wise one must count
/// exactly as it does.
fn estimate_by_chars(text: &str) -> u64 {
    fn cjk(c: char) -> bool {
        matches!(u32::from(c), 0x3040..=0x30FF | 0x3400..=0x4DBF | 0x4E00..=0x9FFF
            | 0xAC00..=0xD7AF | 0xF900..=0xFAFF | 0x20000..=0x2FFFF)
    }
    let (mut tokens, mut word, mut digits) = (0u64, 0u64, 0u64);
    let (mut in_string, mut number) = (false, false);
    let flush = |word: &mut u64, digits: &mut u64, tokens: &mut u64| {
        if *word > 0 {
            *tokens += if *word <= 6 { 1 } else { word.div_ceil(5) };
            *word = 0;
        }
        if *digits > 0 {
            *tokens += digits.div_ceil(3);
            *digits = 0;
        }
    };
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if !in_string {
            let digit = c.is_ascii_digit();
            tokens += u64::from(number && !digit);
            number = digit;
            in_string = c == '"';
            continue;
        }
        match c {
            '"' => {
                flush(&mut word, &mut digits, &mut tokens);
                in_string = false;
            }
            '\\' => {
                flush(&mut word, &mut digits, &mut tokens);
                tokens += 1;
                if chars.next() == Some('u') {
                    for _ in 0..4 {
                        chars.next();
                    }
                }
            }
            '0'..='9' => {
                if word > 0 {
                    word += 1;
                } else {
                    digits += 1;
                }
            }
            c if c.is_alphabetic() && !cjk(c) => {
                if digits > 0 {
                    flush(&mut word, &mut digits, &mut tokens);
                }
                word += 1;
            }
            c if c.is_whitespace() => flush(&mut word, &mut digits, &mut tokens),
            c => {
                flush(&mut word, &mut digits, &mut tokens);
                tokens += if cjk(c) || c.is_ascii() || u32::from(c) < 0x2000 {
                    1
                } else {
                    2
                };
            }
        }
    }
    flush(&mut word, &mut digits, &mut tokens);
    tokens + u64::from(number)
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2048))]
    #[test]
    fn the_bytewise_estimate_counts_as_the_character_one(
        text in r#"[a-zA-Z0-9 \t\n\x0b\x0c\r"\\u{}:,\[\]\x00-\x1f\x7f\u{80}-\u{a0}é€한我😀\u{2000}\u{3000}\u{1c}]{0,64}"#,
    ) {
        proptest::prop_assert_eq!(estimate_tokens(text.as_bytes()), estimate_by_chars(&text));
    }

    /// The fuzz target's checks (`testkit::fuzz::openai_request`) on request bodies, whole,
    /// cut short or with a byte changed, and on any bytes, under plain `cargo test`
    /// (libFuzzer needs a nightly toolchain).
    #[test]
    fn request_bodies_keep_the_fuzz_targets_invariants(
        pick in 0u8..3,
        model in r#"[a-z0-9/:. "\\é]{0,16}"#,
        contents in proptest::collection::vec(r#"[a-zA-Z0-9 ,.!?"\\\n\t é€한我ー。、「」😀]{0,40}"#, 0..4),
        stream in proptest::option::of(proptest::prelude::any::<bool>()),
        model_last in proptest::prelude::any::<bool>(),
        cut in proptest::prelude::any::<proptest::sample::Index>(),
        flip in proptest::option::of((proptest::prelude::any::<proptest::sample::Index>(), proptest::prelude::any::<u8>())),
        noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..48),
    ) {
        let messages: Vec<Value> = contents
            .iter()
            .map(|c| json!({"role": "user", "content": c}))
            .collect();
        let mut body = serde_json::Map::new();
        if !model_last {
            body.insert("model".into(), json!(model));
        }
        body.insert("messages".into(), json!(messages));
        body.insert("prompt".into(), json!(contents.first()));
        body.insert("input".into(), json!(contents));
        if let Some(stream) = stream {
            body.insert("stream".into(), json!(stream));
        }
        if model_last {
            body.insert("model".into(), json!(model));
        }
        let whole = serde_json::to_vec(&Value::Object(body)).expect("json");
        let mut data = vec![pick];
        data.extend_from_slice(&whole);
        iop_testkit::fuzz::openai_request(&data);
        // Cut short, or one byte changed.
        let mut changed = data[..1 + cut.index(whole.len() + 1)].to_vec();
        if let Some((at, byte)) = flip {
            let at = 1 + at.index(whole.len());
            changed = data.clone();
            changed[at] = byte;
        }
        iop_testkit::fuzz::openai_request(&changed);
        data.truncate(1);
        data.extend_from_slice(&noise);
        iop_testkit::fuzz::openai_request(&data);
    }

    /// Long letter and digit runs (read eight bytes at a time) and runs of three-byte
    /// characters, ending on every kind of neighbour.
    #[test]
    fn the_estimate_reads_runs_as_the_character_one(
        text in r#"([a-zA-Z]{1,24}|[0-9]{1,20}|[a-z0-9]{1,20}|[ \t\n"\\u{}:,\x00-\x1f\x7f@\[`é€한我ー。😀\u{3000}]|[한我ー。、「」々〇〡〱〼\u{303f}\u{3000}]{1,9}){0,40}"#,
    ) {
        proptest::prop_assert_eq!(estimate_tokens(text.as_bytes()), estimate_by_chars(&text));
    }
}

#[test]
fn the_model_rewrite_touches_only_the_model_value() {
    let raw = br#"{ "messages" : [{"role":"user","content":"say \"model\": x"}],  "model":"public-name" ,"stream":true}"#;
    let out = rewrite_model(raw, "llama3:8b").expect("rewritten");
    assert_eq!(
        std::str::from_utf8(&out).expect("utf8"),
        r#"{ "messages" : [{"role":"user","content":"say \"model\": x"}],  "model":"llama3:8b" ,"stream":true}"#
    );
    let nested = br#"{"meta":{"model":"inner"},"model":null}"#;
    assert_eq!(
        &rewrite_model(nested, "t").expect("rewritten")[..],
        br#"{"meta":{"model":"inner"},"model":"t"}"#
    );
    let escaped = br#"{"mod\u0065l":"x"}"#;
    assert_eq!(
        &rewrite_model(escaped, "y").expect("rewritten")[..],
        br#"{"mod\u0065l":"y"}"#
    );
    assert!(rewrite_model(br#"{"messages":[]}"#, "t").is_none());
    assert!(rewrite_model(b"[1,2]", "t").is_none());
    assert!(rewrite_model(br#"{"model":"#, "t").is_none());
    assert!(rewrite_model(br#"{"x":]],"model":"a"}"#, "t").is_none());
    assert_eq!(
        &rewrite_model(br#"{"model":"a"}"#, "quo\"te").expect("rewritten")[..],
        br#"{"model":"quo\"te"}"#
    );
}

#[test]
fn a_body_that_already_names_the_target_is_sent_without_a_copy() {
    let raw = Bytes::from_static(br#"{"model":"llama3:8b","messages":[]}"#);
    let out = for_target(raw.clone(), "llama3:8b");
    assert_eq!(out, raw);
    assert_eq!(out.as_ptr(), raw.as_ptr(), "the same bytes, not a copy");

    // Another name, or the same name written another way, is rewritten.
    assert_eq!(
        &for_target(raw.clone(), "qwen")[..],
        br#"{"model":"qwen","messages":[]}"#
    );
    let spelled = Bytes::from_static(br#"{"model":"llama3:8b"}"#);
    assert_eq!(
        &for_target(spelled, "llama3:8b")[..],
        br#"{"model":"llama3:8b"}"#
    );
    // A target JSON must escape is compared in its escaped form.
    let quoted = Bytes::from_static(br#"{"model":"quo\"te"}"#);
    let out = for_target(quoted.clone(), "quo\"te");
    assert_eq!(out.as_ptr(), quoted.as_ptr());
    assert_eq!(
        &for_target(Bytes::from_static(br#"{"model":"quo"}"#), "quo\"te")[..],
        br#"{"model":"quo\"te"}"#
    );
    // Nothing to rewrite: the body as it came.
    let bare = Bytes::from_static(br#"{"messages":[]}"#);
    assert_eq!(for_target(bare.clone(), "t").as_ptr(), bare.as_ptr());
    let broken = Bytes::from_static(br#"{"model":"#);
    assert_eq!(for_target(broken.clone(), "t"), broken);
}

#[test]
fn a_top_level_member_is_found_past_decoys_and_never_past_the_end() {
    let raw = br#" { "choices": [{"usage": 1}], "note": "\"usage\": 2", "k\\": 3,
        "meta": {"usage": 4}, "us\u0061ge" : {"total_tokens": 9}, "usage": 5 }"#;
    let at = member_value(raw, "usage").expect("found");
    assert_eq!(
        &raw[at], br#"{"total_tokens": 9}"#,
        "the first, however escaped"
    );
    assert_eq!(member_value(br#"{"a":{"usage":1}}"#, "usage"), None);
    assert_eq!(member_value(br#"[{"usage":1}]"#, "usage"), None);
    let whole = br#"{"id":"a\"b","usage":{"prompt_tokens":2}}"#;
    // Cut short anywhere, it finds the member only once its value is whole.
    let value = member_value(whole, "usage").expect("found");
    for cut in 0..whole.len() {
        let found = member_value(&whole[..cut], "usage");
        assert_eq!(found.is_some(), cut >= value.end, "cut at {cut}");
        assert!(found.is_none_or(|r| r.end <= cut));
    }
}

#[test]
fn text_tool_calls_are_restored_only_from_a_call_shape() {
    let calls = parse_text_tool_calls(FALLBACK_TEXT, "r1").expect("parsed");
    assert_eq!(calls[0]["id"], "call_r1_0");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(calls[0]["function"]["arguments"], "{\"city\":\"Seoul\"}");
    assert!(parse_text_tool_calls("just words", "r1").is_none());
    assert!(parse_text_tool_calls("{\"tool_calls\": []}", "r1").is_none());
    assert!(parse_text_tool_calls("{\"tool_calls\": [{\"arguments\": {}}]}", "r1").is_none());
}

#[test]
fn the_usage_a_provider_reports_is_observed_for_logs_and_metrics() {
    // A run: usage on the terminal event, whole or streamed, asked for or not.
    for stream in [false, true] {
        let mut r = Responder::new(options(stream, false, false));
        assert!(r.usage().is_none());
        run(
            &mut r,
            vec![
                In::Dispatched(DispatchShape::Run),
                In::Start,
                In::Complete {
                    usage: true,
                    metadata: &[],
                },
            ],
        );
        let usage = r.usage().expect("observed");
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (5, 2));
    }
    // A tunnel: a USAGE frame is observed and never reaches the body.
    let mut r = Responder::new(options(true, false, false));
    let mut out = run(
        &mut r,
        vec![
            In::Dispatched(DispatchShape::Tunnel),
            In::Status(200, &[("content-type", "text/event-stream")]),
            In::Body("data: {}\n\n"),
        ],
    );
    r.handle_tunnel_frame(ProviderTunnelFrame {
        run_id: "run-7".into(),
        kind: TunnelFrameKind::Usage as i32,
        usage: Some(Usage {
            prompt_tokens: 11,
            completion_tokens: 3,
            total_tokens: 14,
        }),
        ..ProviderTunnelFrame::default()
    });
    out.extend(std::iter::from_fn(|| r.poll_output()));
    assert_eq!(r.usage().map(|u| u.total_tokens), Some(14));
    let body: Vec<u8> = out
        .iter()
        .filter_map(|o| match o {
            Out::Data(b) => Some(b.to_vec()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(body, b"data: {}\n\n", "usage stays out of the body");
    // No report, no usage.
    let mut r = Responder::new(options(false, false, false));
    run(
        &mut r,
        vec![
            In::Dispatched(DispatchShape::Run),
            In::Start,
            In::Complete {
                usage: false,
                metadata: &[],
            },
        ],
    );
    assert!(r.usage().is_none());
}

#[test]
fn rate_limit_headers_read_as_openai_writes_them() {
    use iop_api::openai::{RATE_LIMIT_HEADERS, rate_limit_headers};
    use iop_api::tenant::{Quota, RateLimits};
    use std::time::Duration;
    let limits = RateLimits {
        requests: Some(Quota {
            limit: 60,
            remaining: 0,
            reset: Duration::from_millis(59_001),
        }),
        tokens: Some(Quota {
            limit: 150_000,
            remaining: 149_990,
            reset: Duration::from_millis(20),
        }),
    };
    let values = rate_limit_headers(&limits, Some(Duration::from_millis(3_723_400)));
    let got: Vec<(&str, String)> = RATE_LIMIT_HEADERS
        .iter()
        .zip(values)
        .filter_map(|(name, value)| value.map(|v| (*name, v.to_string())))
        .collect();
    assert_eq!(
        got,
        [
            ("x-ratelimit-limit-requests", "60".to_owned()),
            ("x-ratelimit-remaining-requests", "0".to_owned()),
            ("x-ratelimit-reset-requests", "1m0s".to_owned()),
            ("x-ratelimit-limit-tokens", "150000".to_owned()),
            ("x-ratelimit-remaining-tokens", "149990".to_owned()),
            ("x-ratelimit-reset-tokens", "20ms".to_owned()),
            ("retry-after", "3724".to_owned()),
            ("retry-after-ms", "3723400".to_owned()),
        ]
    );
    // Only what is limited is said.
    let none = rate_limit_headers(&RateLimits::default(), None);
    assert!(none.iter().all(Option::is_none));
    // The longest reset still fits.
    let far = rate_limit_headers(
        &RateLimits {
            requests: Some(Quota {
                limit: u64::MAX,
                remaining: u64::MAX,
                reset: Duration::MAX,
            }),
            tokens: None,
        },
        Some(Duration::MAX),
    );
    assert_eq!(far[0].map(|v| v.to_string()), Some(u64::MAX.to_string()));
    assert!(
        far[2].is_some_and(|v| v.to_string().ends_with("h59m59s") || v.to_string().ends_with('s'))
    );
}

// ----- the validating pass of `inspect` against serde -----

/// JSON text of any value, with the members `inspect` decides on among others, escapes
/// (surrogates too), numbers of every shape and whitespace.
fn json_value() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    let leaf = prop_oneof![
        Just("null".to_owned()),
        Just("true".to_owned()),
        Just("false".to_owned()),
        r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,3})?([eE][+-]?[0-9]{1,3})?",
        r#""([a-zA-Z ]{1,9}|[0-9]{1,4}|[.,!?'\x7f]|\\[nt"\\/bfr]|\\u00e9|\\u0041|\\ud83d\\ude00|\\ud800|é|😀|한|我|。|ー|\u{2000}|\u{3000}){0,6}""#,
    ];
    leaf.prop_recursive(4, 24, 5, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4)
                .prop_map(|v| format!("[{}]", v.join(","))),
            proptest::collection::vec((json_key(), inner), 0..4).prop_map(|members| {
                let members: Vec<String> = members
                    .into_iter()
                    .map(|(k, v)| format!("{k}:{v}"))
                    .collect();
                format!("{{{}}}", members.join(","))
            }),
        ]
    })
}

fn json_key() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::strategy::Strategy as _;
    proptest::sample::select(vec![
        r#""model""#,
        r#""messages""#,
        r#""prompt""#,
        r#""input""#,
        r#""stream""#,
        r#""stream_options""#,
        r#""include_usage""#,
        r#""tools""#,
        r#""max_tokens""#,
        r#""max_completion_tokens""#,
        r#""prompt_cache_key""#,
        r#""user""#,
        r#""temperature""#,
        r#""""#,
        r#""mo\u0064el""#,
        r#""Model""#,
    ])
    .prop_map(str::to_owned)
}

/// A request body: an object of such members with whitespace around its tokens, often
/// with a plain model and messages, then maybe one byte inserted, removed or replaced.
fn request_body() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
    use proptest::prelude::*;
    let ws = proptest::sample::select(vec!["", "", " ", "\n", "\t", " \r\n "]);
    let member = (ws.clone(), json_key(), ws.clone(), json_value(), ws.clone())
        .prop_map(|(a, k, b, v, c)| format!("{a}{k}{b}:{v}{c}"));
    let plain = proptest::sample::select(vec![
        vec![],
        vec![
            r#""model":"m""#.to_owned(),
            r#""messages":[{"role":"user","content":"hi"}]"#.to_owned(),
        ],
        vec![
            r#""model":"m""#.to_owned(),
            r#""prompt":"once""#.to_owned(),
            r#""input":[1,2]"#.to_owned(),
        ],
    ]);
    let edit = proptest::option::of((
        any::<proptest::sample::Index>(),
        0u8..3,
        proptest::sample::select(b"{}[]\",:\\ 0123456789-+.eEtrufalsn\x00\x1f\x7f\xc3".to_vec()),
    ));
    (plain, proptest::collection::vec(member, 0..5), ws, edit).prop_map(
        |(plain, more, ws, edit)| {
            let members: Vec<String> = plain.into_iter().chain(more).collect();
            let mut body = format!("{ws}{{{}}}{ws}", members.join(",")).into_bytes();
            if let Some((at, kind, byte)) = edit {
                let at = at.index(body.len() + 1);
                match kind {
                    0 => body.insert(at, byte),
                    1 if at < body.len() => {
                        body.remove(at);
                    }
                    _ if at < body.len() => body[at] = byte,
                    _ => {}
                }
            }
            body
        },
    )
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4096))]
    /// The validating pass takes a body only where serde would read it the same: on any
    /// body, `inspect` answers as serde alone does (facts, or the same 400).
    #[test]
    fn inspect_answers_as_serde_alone_on_any_body(body in request_body()) {
        for endpoint in [Endpoint::Chat, Endpoint::Completions, Endpoint::Embeddings] {
            proptest::prop_assert_eq!(
                inspect(&body, endpoint),
                inspect_by_serde(&body, endpoint),
                "{}", String::from_utf8_lossy(&body)
            );
        }
    }
}

#[test]
fn the_validating_pass_leaves_to_serde_what_only_serde_can_judge() {
    let same = |raw: &str| {
        assert_eq!(
            inspect(raw.as_bytes(), Endpoint::Chat),
            inspect_by_serde(raw.as_bytes(), Endpoint::Chat),
            "{raw}"
        );
    };
    let chat = r#""model":"m","messages":[{}]"#;
    // A repeated member, an escaped key, a surrogate, deep nesting, odd numbers.
    same(&format!(r#"{{{chat},"model":"n"}}"#));
    same(&format!(r#"{{{chat},"stream":true,"stream":false}}"#));
    same(r#"{"mo\u0064el":"m","messages":[{}]}"#);
    same(&format!(r#"{{{chat},"user":"\ud800"}}"#));
    same(&format!(r#"{{{chat},"user":"\ud83d\ude00"}}"#));
    same(&format!(
        r#"{{{chat},"x":{}{}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    ));
    same(&format!(
        r#"{{{chat},"x":{}{}}}"#,
        "[".repeat(99),
        "]".repeat(99)
    ));
    for number in [
        "01", "1.", "-", "1e", "1e+", ".5", "+1", "1.5e-3", "-0", "0.0E0", "1x",
    ] {
        same(&format!(r#"{{{chat},"n":{number}}}"#));
    }
    // Brackets closed by the other kind, at the top and inside.
    for wrong in [
        r#"{"model":"m","messages":[{}}}"#,
        r#"{"model":"m","messages":[{}],"x":{"a":1]}"#,
        r#"{"model":"m","messages":[{}]]"#,
        r#"{"model":"m","messages":[{]]}"#,
    ] {
        same(wrong);
        assert!(
            inspect(wrong.as_bytes(), Endpoint::Chat).is_err(),
            "{wrong}"
        );
    }
    same(&format!("{{{chat}}}x"));
    same(&format!("{{{chat},}}"));
    same(&format!("{{{chat}\u{0}}}"));
    same(&format!("{{{chat},\"t\":\"tab\there\"}}"));
    same(r#"{"model":"a\"b","messages":[{}]}"#);
    // And it takes the plain body itself, with its facts as serde reads them.
    let facts = inspect(
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"user":"u1","max_tokens":9}"#,
        Endpoint::Chat,
    )
    .expect("a plain body");
    assert_eq!(
        (
            facts.model.as_str(),
            facts.stream,
            facts.session.as_deref(),
            facts.max_tokens
        ),
        ("m", true, Some("u1"), Some(9))
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]

    /// The Edge hands the responder tunnel parts (`TunnelPart`), not frames: each part
    /// reads as the frame it stands for would, whatever came before it and whatever ends
    /// the request: the same outputs, usage, status and state at every step.
    #[test]
    fn a_tunnel_part_reads_as_the_frame_it_stands_for(
        frames in common::tunnel_frames(),
        end in common::tunnel_outcome(),
        stream in proptest::prelude::any::<bool>(),
    ) {
        use iop_proto_core::tunnel::TunnelPart;
        let mut by_frame = Responder::new(options(stream, true, false));
        let mut by_part = Responder::new(options(stream, true, false));
        by_frame.handle_dispatched(DispatchShape::Tunnel);
        by_part.handle_dispatched(DispatchShape::Tunnel);
        for frame in frames {
            by_frame.handle_tunnel_frame(frame.clone());
            by_part.handle_tunnel_part(TunnelPart::from(frame));
            let a: Vec<Out> = std::iter::from_fn(|| by_frame.poll_output()).collect();
            let b: Vec<Out> = std::iter::from_fn(|| by_part.poll_output()).collect();
            proptest::prop_assert_eq!(a, b);
            proptest::prop_assert_eq!(by_frame.usage(), by_part.usage());
            proptest::prop_assert_eq!(by_frame.status(), by_part.status());
            proptest::prop_assert_eq!(by_frame.is_done(), by_part.is_done());
            proptest::prop_assert_eq!(by_frame.needs_cancel(), by_part.needs_cancel());
        }
        if let Some(outcome) = end {
            by_frame.handle_end(&outcome);
            by_part.handle_end(&outcome);
            let a: Vec<Out> = std::iter::from_fn(|| by_frame.poll_output()).collect();
            let b: Vec<Out> = std::iter::from_fn(|| by_part.poll_output()).collect();
            proptest::prop_assert_eq!(a, b);
            proptest::prop_assert_eq!(by_frame.is_done(), by_part.is_done());
            proptest::prop_assert_eq!(by_frame.needs_cancel(), by_part.needs_cancel());
        }
    }
}
