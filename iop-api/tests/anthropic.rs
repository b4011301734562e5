//! The Anthropic Messages dialect: the translation of a Messages request into the chat
//! body providers are sent (every field, every refusal), the error mapping, and the
//! `Responder`'s answers, with property tests over generated runs and provider streams:
//! the stream grammar the SDKs enforce holds with no exception, and a streamed answer
//! reassembles into the message the same answer gives whole.

use bytes::Bytes;
use iop_api::anthropic::{
    self, ErrorKind, Responder, ResponseOptions, TranslateOptions, context_overflow, translate,
};
use iop_api::openai::{ApiError, ErrorType, Out};
use iop_proto_core::wire::{ErrorDetail, Header, ProviderTunnelFrame, TunnelFrameKind};
use iop_proto_core::{DispatchShape, Outcome, RequestError};
use iop_testkit::messages::{Ended, check_stream};
use proptest::prelude::*;
use serde_json::{Value, json};

mod common;
use common::*;

// ----- translation -----

fn chat(body: Value) -> Value {
    let translated = translate(body.to_string().as_bytes(), TranslateOptions::default())
        .unwrap_or_else(|e| panic!("refused: {e}"));
    serde_json::from_slice(&translated.chat).expect("the chat body is JSON")
}

fn refused(body: &[u8]) -> String {
    match translate(body, TranslateOptions::default()) {
        Ok(t) => panic!("accepted: {}", String::from_utf8_lossy(&t.chat)),
        Err(e) => {
            assert_eq!(e.status, 400, "{e}");
            assert_eq!(ErrorKind::of(&e), (400, ErrorKind::InvalidRequest));
            e.message
        }
    }
}

#[test]
fn a_plain_request_becomes_the_same_chat() {
    let out = chat(json!({
        "model": "m", "max_tokens": 100, "temperature": 0.5, "top_p": 0.9, "top_k": 40,
        "stop_sequences": ["END"], "metadata": {"user_id": "u-1"},
        "messages": [{"role": "user", "content": "hi"}],
    }));
    assert_eq!(
        out,
        json!({
            "model": "m", "max_tokens": 100, "temperature": 0.5, "top_p": 0.9, "top_k": 40,
            "stop": ["END"], "user": "u-1",
            "messages": [{"role": "user", "content": "hi"}],
        })
    );
}

#[test]
fn a_stream_asks_for_usage() {
    let translated = translate(
        br#"{"model":"m","max_tokens":5,"stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
        TranslateOptions::default(),
    )
    .expect("valid");
    assert!(translated.facts.stream && translated.facts.include_usage);
    let out: Value = serde_json::from_slice(&translated.chat).expect("JSON");
    assert_eq!(out["stream"], true);
    assert_eq!(out["stream_options"], json!({"include_usage": true}));
    assert_eq!(translated.facts.max_tokens, Some(5));
    assert_eq!(
        translated.facts.prompt_tokens,
        iop_api::openai::estimate_tokens(&translated.chat)
    );
}

#[test]
fn system_prompts_are_one_system_message_without_claude_codes_attribution_line() {
    let billing = "x-anthropic-billing-header: cc_version=2.0.14.abc; cc_entrypoint=cli; cch=1f2e;";
    let messages = json!([{"role": "user", "content": "hi"}]);
    for (system, expected) in [
        (json!("Be brief."), Some("Be brief.")),
        (
            json!([{"type": "text", "text": "Be brief."}]),
            Some("Be brief."),
        ),
        (
            json!([{"type": "text", "text": "A."}, {"type": "text", "text": "B.", "cache_control": {"type": "ephemeral"}}]),
            Some("A.\nB."),
        ),
        (
            json!([{"type": "text", "text": billing}, {"type": "text", "text": "You are Claude Code."}]),
            Some("You are Claude Code."),
        ),
        (
            json!(format!("{billing}\nYou are Claude Code.")),
            Some("You are Claude Code."),
        ),
        (json!([{"type": "text", "text": billing}]), None),
        (json!([]), None),
    ] {
        let out =
            chat(json!({"model": "m", "max_tokens": 9, "system": system, "messages": messages}));
        let first = &out["messages"][0];
        match expected {
            Some(text) => assert_eq!(
                first,
                &json!({"role": "system", "content": text}),
                "{system}"
            ),
            None => assert_eq!(first["role"], "user", "{system}"),
        }
    }
    // Kept when asked.
    let kept = translate(
        json!({"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": billing}], "messages": messages})
            .to_string()
            .as_bytes(),
        TranslateOptions {
            keep_billing_header: true,
            ..TranslateOptions::default()
        },
    )
    .expect("valid");
    assert!(String::from_utf8_lossy(&kept.chat).contains("cch=1f2e"));
}

#[test]
fn tool_use_and_tool_results_become_tool_calls_and_tool_messages() {
    let out = chat(json!({
        "model": "m", "max_tokens": 9,
        "tools": [{"name": "get_weather", "description": "Weather.", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true},
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "two calls", "signature": "sig"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "rain"}], "is_error": true},
                {"type": "text", "text": "Thanks."},
            ]},
        ],
    }));
    assert_eq!(
        out["tools"],
        json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
    );
    assert_eq!(
        out["tool_choice"],
        json!({"type": "function", "function": {"name": "get_weather"}})
    );
    assert_eq!(out["parallel_tool_calls"], false);
    assert_eq!(
        out["messages"],
        json!([
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "Looking.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}},
            ]},
            {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
            {"role": "tool", "content": "Error: rain", "tool_call_id": "toolu_2"},
            {"role": "user", "content": "Thanks."},
        ])
    );
    for (choice, expected) in [
        (json!({"type": "auto"}), json!("auto")),
        (json!({"type": "any"}), json!("required")),
        (json!({"type": "none"}), json!("none")),
    ] {
        let out = chat(json!({"model": "m", "max_tokens": 9, "tool_choice": choice,
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "x"}]}));
        assert_eq!(out["tool_choice"], expected);
    }
}

#[test]
fn images_and_documents_become_content_parts() {
    let out = chat(
        json!({"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Plain text."}},
            {"type": "document", "title": "a.pdf", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}},
            {"type": "text", "text": "Describe."},
        ]}]}),
    );
    assert_eq!(
        out["messages"][0]["content"],
        json!([
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}},
            {"type": "text", "text": "Plain text."},
            {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBERi0=", "filename": "a.pdf"}},
            {"type": "text", "text": "Describe."},
        ])
    );
}

#[test]
fn bad_requests_get_a_typed_400_that_says_where() {
    for (body, says) in [
        (&br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#[..], "max_tokens"),
        (br#"{"model":"m","max_tokens":0,"messages":[{"role":"user","content":"x"}]}"#, "max_tokens"),
        (br#"{"model":"m","max_tokens":1.5,"messages":[{"role":"user","content":"x"}]}"#, "max_tokens"),
        (br#"{"max_tokens":5,"messages":[{"role":"user","content":"x"}]}"#, "model"),
        (br#"{"model":"m","max_tokens":5}"#, "messages"),
        (br#"{"model":"m","max_tokens":5,"messages":[]}"#, "messages"),
        (br#"{"model":"m","max_tokens":5,"messages":[{"role":"system","content":"x"}]}"#, "messages.0.role"),
        (br#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"video"}]}]}"#, "messages.0.content.0.type"),
        (br#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"text":"x"}]}]}"#, "messages.0.content.0"),
        (br#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"text","text":5}]}]}"#, "messages.0.content.0"),
        (br#"{"model":"m","max_tokens":5,"messages":[{"role":"assistant","content":[{"type":"tool_use","id":"a","name":"f","input":[1]}]}]}"#, "messages.0.content.0.input"),
        (br#"{"model":"m","max_tokens":5,"messages":[{"role":"assistant","content":[{"type":"tool_use","id":"a","name":"f"}]}]}"#, "messages.0.content.0"),
        (br#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"tool_use","id":"a","name":"f","input":{}}]}]}"#, "assistant"),
        (br#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/bmp","data":"x"}}]}]}"#, "media_type"),
        (br#"{"model":"m","max_tokens":5,"system":[{"type":"image"}],"messages":[{"role":"user","content":"x"}]}"#, "system.0.type"),
        (br#"{"model":"m","max_tokens":5,"tools":[{"name":"f"}],"messages":[{"role":"user","content":"x"}]}"#, "tools.0.input_schema"),
        (br#"{"model":"m","max_tokens":5,"tools":[{"type":"web_search_20250305","name":"web_search"}],"messages":[{"role":"user","content":"x"}]}"#, "tools.0.type"),
        (br#"{"model":"m","max_tokens":5,"tool_choice":{"type":"tool","name":"g"},"tools":[{"name":"f","input_schema":{}}],"messages":[{"role":"user","content":"x"}]}"#, "tool_choice.name"),
        (br#"{"model":"m","max_tokens":5,"stop_sequences":"END","messages":[{"role":"user","content":"x"}]}"#, "stop_sequences"),
        (br#"{"model":"m","max_tokens":5,"temperature":"hot","messages":[{"role":"user","content":"x"}]}"#, "temperature"),
        (br#"{"model":"m","max_tokens":5,"stream":"yes","messages":[{"role":"user","content":"x"}]}"#, "stream"),
        (b"[1,2]", "JSON object"),
        (b"{\"model\":", "invalid JSON"),
        (b"\xff\xfe", "UTF-8"),
    ] {
        let message = refused(body);
        assert!(message.contains(says), "{message:?} should name {says:?}");
    }
}

#[test]
fn count_tokens_needs_no_max_tokens_and_ignores_the_attribution_line() {
    let plain = anthropic::count_tokens(
        br#"{"model":"m","system":"Be brief.","messages":[{"role":"user","content":"hello there"}]}"#,
        TranslateOptions::default(),
    )
    .expect("counted");
    assert_eq!(plain.model, "m");
    assert!(plain.input_tokens > 0);
    assert_eq!(
        plain.body(),
        Bytes::from(format!("{{\"input_tokens\":{}}}", plain.input_tokens))
    );
    let billed = anthropic::count_tokens(
        br#"{"model":"m","system":[{"type":"text","text":"x-anthropic-billing-header: cch=9;"},{"type":"text","text":"Be brief."}],"messages":[{"role":"user","content":"hello there"}]}"#,
        TranslateOptions::default(),
    )
    .expect("counted");
    assert_eq!(plain.input_tokens, billed.input_tokens);
}

// ----- errors -----

#[test]
fn errors_take_the_messages_apis_types_and_statuses() {
    let cases = [
        (
            ApiError::bad_request("x", None),
            400,
            "invalid_request_error",
        ),
        (
            ApiError::new(401, ErrorType::InvalidRequest, "x", Some("invalid_api_key")),
            401,
            "authentication_error",
        ),
        (
            ApiError::new(403, ErrorType::InvalidRequest, "x", None),
            403,
            "permission_error",
        ),
        (ApiError::model_not_found("m"), 404, "not_found_error"),
        (
            ApiError::new(413, ErrorType::InvalidRequest, "x", Some("body_too_large")),
            413,
            "request_too_large",
        ),
        (
            ApiError::new(429, ErrorType::RateLimit, "x", Some("rate_limit_exceeded")),
            429,
            "rate_limit_error",
        ),
        (
            ApiError::new(429, ErrorType::RateLimit, "x", Some("queue_full")),
            529,
            "overloaded_error",
        ),
        (
            ApiError::from_outcome(&Outcome::Expired),
            529,
            "overloaded_error",
        ),
        (
            ApiError::new(503, ErrorType::Server, "x", Some("no_provider")),
            529,
            "overloaded_error",
        ),
        (
            ApiError::new(503, ErrorType::Server, "x", Some("overloaded")),
            529,
            "overloaded_error",
        ),
        (ApiError::timeout(), 504, "timeout_error"),
        (
            ApiError::provider(&ErrorDetail::default()),
            502,
            "api_error",
        ),
        (ApiError::shutting_down(), 503, "api_error"),
    ];
    for (error, status, kind) in cases {
        let (got, body) = anthropic::error_response(&error, "req_9");
        assert_eq!(got, status, "{error:?}");
        let body: Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(
            body,
            json!({"type": "error", "error": {"type": kind, "message": error.message}, "request_id": "req_9"})
        );
    }
}

#[test]
fn a_providers_context_overflow_reads_as_the_messages_apis_words() {
    for (body, expected) in [
        (
            &br#"{"object":"error","message":"This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4900 in the messages, 100 in the completion).","type":"BadRequestError","code":400}"#[..],
            Some((5000, 4096)),
        ),
        (
            br#"{"error":{"message":"This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.","type":"invalid_request_error","code":"context_length_exceeded"}}"#,
            Some((9000, 8192)),
        ),
        (
            br#"{"error":{"code":400,"message":"the request exceeds the available context size","type":"exceed_context_size_error","n_prompt_tokens":5120,"n_ctx":4096}}"#,
            Some((5120, 4096)),
        ),
        (
            br#"{"object":"error","message":"The input (6000 tokens) is longer than the model's context length (4096 tokens).","code":400}"#,
            Some((6000, 4096)),
        ),
        (br#"{"error":{"message":"bad temperature"}}"#, None),
        (b"not json", None),
    ] {
        assert_eq!(context_overflow(body), expected, "{}", String::from_utf8_lossy(body));
    }
}

// ----- responses -----

fn options(stream: bool, wants_tools: bool, stops: &[&str]) -> ResponseOptions {
    ResponseOptions {
        model: "m".into(),
        run_id: "run-7".into(),
        request_id: "req_7".into(),
        stream,
        wants_tools,
        stop_sequences: stops.iter().map(|s| (*s).to_owned()).collect(),
        input_estimate: 11,
        created: 0,
        echo: serde_json::Map::new(),
    }
}

/// A streamed answer's bytes, checked: how the stream ended.
fn streamed(status: Option<u16>, body: &[u8]) -> Ended {
    match status {
        Some(200) => check_stream(body)
            .unwrap_or_else(|why| panic!("grammar: {why}\n{}", String::from_utf8_lossy(body))),
        // Refused before its head: a whole error object.
        Some(s) => {
            let error: Value = serde_json::from_slice(body).expect("an error object");
            assert_eq!(error["type"], "error", "{s}: {error}");
            Ended::Error(error)
        }
        None => panic!("no answer"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10_000))]

    /// Generated normalized runs (text, tool calls native and written as text, errors,
    /// cancels, lost nodes and timeouts at any point): every stream keeps the grammar,
    /// ends with `message_stop` exactly when the run completed and with an `error` event
    /// otherwise, and reassembles into the message the same run gives whole.
    #[test]
    fn runs_keep_the_stream_grammar_and_reassemble_into_the_whole_answer(
        steps in steps(),
        end in end(),
        wants_tools in any::<bool>(),
        stops in prop::collection::vec(prop_oneof![Just("END"), Just("other")], 0..2),
    ) {
        let mut stream = Responder::new(options(true, wants_tools, &stops));
        feed_run(&mut stream, &steps, &end);
        prop_assert!(stream.is_done());
        let (status, body) = drain(&mut stream);
        let ended = streamed(status, &body);
        let mut whole = Responder::new(options(false, wants_tools, &stops));
        feed_run(&mut whole, &steps, &end);
        prop_assert!(whole.is_done());
        let (whole_status, whole_body) = drain(&mut whole);
        let whole_body: Value = serde_json::from_slice(&whole_body).expect("JSON");
        match (&end, ended) {
            (End::Complete { .. }, Ended::Message(message)) => {
                prop_assert_eq!(whole_status, Some(200));
                prop_assert_eq!(&message, &whole_body);
                prop_assert!(!stream.needs_cancel() && !whole.needs_cancel());
                let text: String = steps.iter().filter_map(|s| match s {
                    Step::Delta(t) => Some(t.as_str()),
                    Step::Idle => None,
                }).collect();
                // Text is never lost unless it was a tool call written as text.
                let shown: String = message["content"].as_array().expect("content").iter()
                    .filter_map(|b| b["text"].as_str()).collect();
                prop_assert!(shown == text || shown.is_empty(), "{:?} vs {:?}", shown, text);
            }
            (End::Complete { .. }, other) => prop_assert!(false, "a completed run ended {:?}", other),
            (_, Ended::Error(error)) => {
                prop_assert!(error["error"]["type"].is_string());
                prop_assert_ne!(whole_status, Some(200));
                prop_assert_eq!(&whole_body["type"], "error");
            }
            (_, other) => prop_assert!(false, "a failed run ended {:?}", other),
        }
    }
}

// ----- provider answers re-encoded -----

/// What a generated OpenAI-compatible provider answer says.
#[derive(Clone, Debug)]
struct Said {
    thinking: Vec<String>,
    text: Vec<String>,
    /// Each call's id, name and argument pieces.
    calls: Vec<(String, String, Vec<String>)>,
    finish: Option<&'static str>,
    stop_reason: Option<&'static str>,
    usage: Option<(u64, u64, Option<u64>)>,
}

impl Said {
    fn chunks(&self) -> Vec<Value> {
        let chunk = |delta: Value, finish: Option<&str>| json!({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        let mut out = vec![chunk(json!({"role": "assistant", "content": ""}), None)];
        out.extend(
            self.thinking
                .iter()
                .map(|t| chunk(json!({"reasoning_content": t}), None)),
        );
        out.extend(self.text.iter().map(|t| chunk(json!({"content": t}), None)));
        for (index, (id, name, pieces)) in self.calls.iter().enumerate() {
            for (j, piece) in pieces.iter().enumerate() {
                let part = if j == 0 {
                    json!({"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": piece}})
                } else {
                    json!({"index": index, "function": {"arguments": piece}})
                };
                out.push(chunk(json!({"tool_calls": [part]}), None));
            }
        }
        let mut last = chunk(json!({}), self.finish);
        last["choices"][0]["stop_reason"] = json!(self.stop_reason);
        out.push(last);
        if let Some(usage) = self.usage_json() {
            out.push(json!({"id": "c", "choices": [], "usage": usage}));
        }
        out
    }

    fn usage_json(&self) -> Option<Value> {
        self.usage.map(|(p, c, cached)| {
            let mut u = json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
            if let Some(cached) = cached {
                u["prompt_tokens_details"] = json!({"cached_tokens": cached});
            }
            u
        })
    }

    fn whole(&self) -> Value {
        let mut message = json!({"role": "assistant", "content": self.text.concat()});
        if !self.thinking.is_empty() {
            message["reasoning_content"] = json!(self.thinking.concat());
        }
        if !self.calls.is_empty() {
            message["tool_calls"] = self
                .calls
                .iter()
                .map(|(id, name, pieces)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": pieces.concat()}}))
                .collect();
        }
        let mut body = json!({"id": "c", "object": "chat.completion", "choices": [
            {"index": 0, "message": message, "finish_reason": self.finish, "stop_reason": self.stop_reason}]});
        if let Some(usage) = self.usage_json() {
            body["usage"] = usage;
        }
        body
    }
}

fn said() -> impl Strategy<Value = Said> {
    (
        prop::collection::vec("[a-z ]{1,6}", 0..3),
        prop::collection::vec(text(), 0..6),
        prop::collection::vec(
            (
                "call_[a-z0-9]{1,4}",
                "[a-z_]{1,8}",
                prop_oneof![
                    Just(vec!["{\"a\":".to_owned(), "1}".to_owned()]),
                    Just(vec!["{}".to_owned()]),
                    Just(vec![
                        "{\"x\":[".to_owned(),
                        "\"é\",".to_owned(),
                        "2]}".to_owned()
                    ]),
                    Just(vec!["{\"cut".to_owned()]),
                ],
            ),
            0..3,
        ),
        prop::option::of(prop_oneof![
            Just("stop"),
            Just("length"),
            Just("tool_calls"),
            Just("content_filter")
        ]),
        prop::option::of(prop_oneof![Just("END"), Just("nope")]),
        prop::option::of((0u64..9000, 0u64..9000, prop::option::of(0u64..9000))),
    )
        .prop_map(|(thinking, text, calls, finish, stop_reason, usage)| Said {
            thinking,
            text,
            calls,
            finish,
            stop_reason,
            usage,
        })
}

fn frame(kind: TunnelFrameKind) -> ProviderTunnelFrame {
    ProviderTunnelFrame {
        run_id: "run-7".into(),
        kind: kind as i32,
        ..ProviderTunnelFrame::default()
    }
}

/// A provider's answer through a translated tunnel: its status and `content-type`, its
/// body cut into pieces at `cuts` (byte offsets), then its end or an error.
fn feed_tunnel(
    responder: &mut Responder,
    status: u32,
    sse: bool,
    body: &[u8],
    cuts: &[usize],
    fail: bool,
) {
    responder.handle_dispatched(DispatchShape::Tunnel, false);
    let mut head = frame(TunnelFrameKind::Status);
    head.status_code = status;
    head.headers = vec![Header {
        name: "content-type".into(),
        value: Bytes::from_static(if sse {
            b"text/event-stream"
        } else {
            b"application/json"
        }),
    }];
    responder.handle_tunnel_frame(head);
    let mut at = 0;
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
    cuts.sort_unstable();
    for cut in cuts.into_iter().chain([body.len()]) {
        if cut > at {
            let mut piece = frame(TunnelFrameKind::Body);
            piece.body = Bytes::copy_from_slice(&body[at..cut]);
            responder.handle_tunnel_frame(piece);
            at = cut;
        }
    }
    if fail {
        let mut error = frame(TunnelFrameKind::Error);
        error.error = Some(ErrorDetail {
            code: "upstream_unreachable".into(),
            message: "gone".into(),
            retryable: true,
        });
        responder.handle_tunnel_frame(error);
        responder.handle_end(&Outcome::Failed(RequestError::Provider(
            ErrorDetail::default(),
        )));
    } else {
        responder.handle_tunnel_frame(frame(TunnelFrameKind::End));
        responder.handle_end(&Outcome::Completed);
    }
}

fn sse_body(said: &Said) -> Vec<u8> {
    let mut body = Vec::new();
    for chunk in said.chunks() {
        body.extend_from_slice(format!("data: {chunk}\n\n").as_bytes());
    }
    body.extend_from_slice(b"data: [DONE]\n\n");
    body
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4_000))]

    /// Generated provider answers (thinking, text, tool calls streamed in pieces, every
    /// finish, usage with cached tokens), their SSE bytes cut anywhere: the stream keeps
    /// the grammar and reassembles into the message the provider's whole JSON answer
    /// becomes, and into the one its stream becomes when read whole.
    #[test]
    fn provider_streams_keep_the_grammar_and_match_the_whole_answer(
        said in said(),
        cuts in prop::collection::vec(any::<usize>(), 0..8),
        fail in prop::bool::weighted(0.15),
    ) {
        let stops = ["END"];
        let sse = sse_body(&said);
        let mut stream = Responder::new(options(true, false, &stops));
        feed_tunnel(&mut stream, 200, true, &sse, &cuts, fail);
        prop_assert!(stream.is_done());
        let (status, body) = drain(&mut stream);
        let ended = streamed(status, &body);
        let mut from_chunks = Responder::new(options(false, false, &stops));
        feed_tunnel(&mut from_chunks, 200, true, &sse, &cuts, fail);
        let (_, from_chunks) = drain(&mut from_chunks);
        let from_chunks: Value = serde_json::from_slice(&from_chunks).expect("JSON");
        if fail {
            prop_assert!(matches!(ended, Ended::Error(_)), "{:?}", ended);
            prop_assert_eq!(&from_chunks["type"], "error");
            return Ok(());
        }
        let Ended::Message(message) = ended else {
            return Err(TestCaseError::fail(format!("ended {ended:?}")));
        };
        prop_assert_eq!(&message, &from_chunks);
        let whole_json = said.whole().to_string();
        let mut whole = Responder::new(options(false, false, &stops));
        feed_tunnel(&mut whole, 200, false, whole_json.as_bytes(), &cuts, false);
        let (whole_status, whole_body) = drain(&mut whole);
        prop_assert_eq!(whole_status, Some(200));
        let whole_body: Value = serde_json::from_slice(&whole_body).expect("JSON");
        prop_assert_eq!(&message, &whole_body);
        // What the provider said is all there: usage without the cached tokens in
        // input_tokens, the stop sequence only when one of ours fired.
        if let Some((p, c, cached)) = said.usage {
            let cached = cached.map(|x| x.min(p));
            prop_assert_eq!(message["usage"]["input_tokens"].as_u64(), Some(p - cached.unwrap_or(0)));
            prop_assert_eq!(message["usage"]["output_tokens"].as_u64(), Some(c));
            prop_assert_eq!(message["usage"]["cache_read_input_tokens"].as_u64(), cached);
        }
        let expected = match (said.finish, said.calls.is_empty(), said.stop_reason) {
            (Some("length"), _, _) => "max_tokens",
            (Some("content_filter"), _, _) => "refusal",
            (Some("tool_calls"), _, _) | (_, false, _) => "tool_use",
            (_, true, Some("END")) => "stop_sequence",
            _ => "end_turn",
        };
        prop_assert_eq!(message["stop_reason"].as_str(), Some(expected));
        prop_assert_eq!(
            message["stop_sequence"].as_str(),
            (expected == "stop_sequence").then_some("END")
        );
        let texts: String = message["content"].as_array().expect("content").iter()
            .filter_map(|b| b["text"].as_str()).collect();
        prop_assert_eq!(texts, said.text.concat());
    }
}

#[test]
fn a_providers_error_answer_is_mapped_with_its_retry_after() {
    let mut responder = Responder::new(options(true, false, &[]));
    responder.handle_dispatched(DispatchShape::Tunnel, false);
    let mut head = frame(TunnelFrameKind::Status);
    head.status_code = 400;
    head.headers = vec![
        Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"application/json"),
        },
        Header {
            name: "retry-after".into(),
            value: Bytes::from_static(b"7"),
        },
    ];
    responder.handle_tunnel_frame(head);
    let mut body = frame(TunnelFrameKind::Body);
    body.body = Bytes::from_static(
        br#"{"object":"error","message":"This model's maximum context length is 4096 tokens. However, you requested 5000 tokens.","code":400}"#,
    );
    responder.handle_tunnel_frame(body);
    responder.handle_tunnel_frame(frame(TunnelFrameKind::End));
    let Some(Out::Head { status, headers }) = responder.poll_output() else {
        panic!("a head")
    };
    assert_eq!(status, 400);
    assert!(
        headers
            .iter()
            .any(|h| h.name == "retry-after" && &h.value[..] == b"7")
    );
    let Some(Out::Data(body)) = responder.poll_output() else {
        panic!("a body")
    };
    let body: Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(
        body,
        json!({"type": "error", "error": {"type": "invalid_request_error",
            "message": "prompt is too long: 5000 tokens > 4096 maximum"}, "request_id": "req_7"})
    );
    assert!(responder.is_done());
}

#[test]
fn a_native_answer_passes_through_with_pings_between_events() {
    let mut responder = Responder::new(options(true, false, &[]));
    responder.handle_dispatched(DispatchShape::Tunnel, true);
    let mut head = frame(TunnelFrameKind::Status);
    head.status_code = 200;
    head.headers = vec![Header {
        name: "content-type".into(),
        value: Bytes::from_static(b"text/event-stream"),
    }];
    responder.handle_tunnel_frame(head);
    let native = b"event: message_start\ndata: {\"type\":\"message_start\"}\n\nevent: ping\ndata: {\"type\":";
    let mut body = frame(TunnelFrameKind::Body);
    body.body = Bytes::from_static(native);
    responder.handle_tunnel_frame(body);
    // Mid-event: no ping.
    responder.handle_idle(std::time::Duration::from_secs(20));
    let (status, bytes) = drain(&mut responder);
    assert_eq!(status, Some(200));
    assert_eq!(
        bytes, native,
        "passed through byte for byte, nothing inserted mid-event"
    );
    let mut rest = frame(TunnelFrameKind::Body);
    rest.body = Bytes::from_static(b"\"ping\"}\n\n");
    responder.handle_tunnel_frame(rest);
    responder.handle_idle(std::time::Duration::from_secs(20));
    let mut out = Vec::new();
    while let Some(Out::Data(b)) = responder.poll_output() {
        out.extend_from_slice(&b);
    }
    assert_eq!(
        out,
        b"\"ping\"}\n\nevent: ping\ndata: {\"type\":\"ping\"}\n\n"
    );
}

#[test]
fn a_quiet_stream_gets_a_ping_after_fifteen_seconds_and_not_before() {
    let mut responder = Responder::new(options(true, false, &[]));
    responder.handle_dispatched(DispatchShape::Run, false);
    let _ = drain(&mut responder);
    for _ in 0..7 {
        responder.handle_idle(std::time::Duration::from_secs(2));
    }
    assert!(responder.poll_output().is_none(), "14 s: no ping yet");
    responder.handle_idle(std::time::Duration::from_secs(2));
    let Some(Out::Data(ping)) = responder.poll_output() else {
        panic!("a ping")
    };
    assert_eq!(&ping[..], b"event: ping\ndata: {\"type\":\"ping\"}\n\n");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// The Edge hands the responder tunnel parts (`TunnelPart`), not frames: each part
    /// reads as the frame it stands for would, over a chat-completions provider and a
    /// native one, whatever ends the request: the same outputs, usage, status and state
    /// at every step.
    #[test]
    fn a_tunnel_part_reads_as_the_frame_it_stands_for(
        frames in tunnel_frames(),
        end in tunnel_outcome(),
        stream in any::<bool>(),
        native in any::<bool>(),
    ) {
        use iop_proto_core::tunnel::TunnelPart;
        let mut by_frame = Responder::new(options(stream, false, &[]));
        let mut by_part = Responder::new(options(stream, false, &[]));
        by_frame.handle_dispatched(DispatchShape::Tunnel, native);
        by_part.handle_dispatched(DispatchShape::Tunnel, native);
        for frame in frames {
            by_frame.handle_tunnel_frame(frame.clone());
            by_part.handle_tunnel_part(TunnelPart::from(frame));
            let a: Vec<Out> = std::iter::from_fn(|| by_frame.poll_output()).collect();
            let b: Vec<Out> = std::iter::from_fn(|| by_part.poll_output()).collect();
            prop_assert_eq!(a, b);
            prop_assert_eq!(by_frame.usage(), by_part.usage());
            prop_assert_eq!(by_frame.status(), by_part.status());
            prop_assert_eq!(by_frame.is_done(), by_part.is_done());
            prop_assert_eq!(by_frame.needs_cancel(), by_part.needs_cancel());
        }
        if let Some(outcome) = end {
            by_frame.handle_end(&outcome);
            by_part.handle_end(&outcome);
            let a: Vec<Out> = std::iter::from_fn(|| by_frame.poll_output()).collect();
            let b: Vec<Out> = std::iter::from_fn(|| by_part.poll_output()).collect();
            prop_assert_eq!(a, b);
            prop_assert_eq!(by_frame.is_done(), by_part.is_done());
            prop_assert_eq!(by_frame.needs_cancel(), by_part.needs_cancel());
        }
    }
}
