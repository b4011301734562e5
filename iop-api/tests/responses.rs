//! The OpenAI Responses dialect: the translation of a Responses request into the chat body
//! providers are sent, its refusals, the response store, and the `Responder`'s answers,
//! with a property test over generated runs: the stream rules Codex relies on hold with
//! no exception, and a streamed answer ends with the response the same run gives whole.

use iop_api::responses::{self, Responder, Store, Stored, translate};
use iop_api::translated::ResponseOptions;
use iop_proto_core::DispatchShape;
use iop_proto_core::wire::{ProviderTunnelFrame, TunnelFrameKind};
use iop_testkit::responses::{Ended, check_stream};
use proptest::prelude::*;
use serde_json::{Value, json};

mod common;
use common::*;

fn chat(body: Value) -> Value {
    let translated =
        translate(body.to_string().as_bytes(), None).unwrap_or_else(|e| panic!("refused: {e}"));
    serde_json::from_slice(&translated.chat).expect("the chat body is JSON")
}

fn refused(body: Value) -> (u16, Option<String>, String) {
    match translate(body.to_string().as_bytes(), None) {
        Ok(t) => panic!("accepted: {}", String::from_utf8_lossy(&t.chat)),
        Err(e) => (e.status, e.code, e.message),
    }
}

#[test]
fn input_items_become_the_same_conversation_in_chat() {
    let body = json!({
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use metric units."},
            {"role": "user", "content": [
                {"type": "input_text", "text": "Weather?"},
                {"type": "input_image", "image_url": "https://example.com/a.png"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Calling."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": true},
                  {"type": "function", "name": "get_time"}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": false,
        "max_output_tokens": 77,
        "temperature": 0.5,
        "top_p": 0.9,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": true}},
        "user": "u-1",
        "stream": true,
        "metadata": {"k": "v"},
    });
    let chat = chat(body);
    assert_eq!(
        chat["messages"],
        json!([
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Use metric units."},
            {"role": "user", "content": [
                {"type": "text", "text": "Weather?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]},
            {"role": "assistant", "content": "Calling.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
            {"role": "tool", "content": "noon", "tool_call_id": "c2"},
        ])
    );
    assert_eq!(chat["tools"][0]["function"]["strict"], true);
    assert_eq!(
        chat["tools"][1]["function"]["parameters"],
        json!({"type": "object", "properties": {}})
    );
    assert_eq!(
        chat["tool_choice"],
        json!({"type": "function", "function": {"name": "get_weather"}})
    );
    assert_eq!(chat["parallel_tool_calls"], false);
    assert_eq!(chat["max_tokens"], 77);
    assert_eq!(chat["response_format"]["json_schema"]["name"], "w");
    assert_eq!(chat["stream_options"]["include_usage"], true);
    assert_eq!(chat["user"], "u-1");
    assert!(chat.get("metadata").is_none(), "metadata stays at the Edge");
}

#[test]
fn what_no_chat_provider_can_do_is_refused_with_a_400_that_says_where() {
    for (body, code, says) in [
        (json!({"input": "x"}), "missing_model", "model"),
        (json!({"model": "m"}), "invalid_request", "input"),
        (
            json!({"model": "m", "input": [{"type": "computer_call"}]}),
            "invalid_request",
            "input[0].type",
        ),
        (
            json!({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}),
            "unsupported_parameter",
            "input[0]",
        ),
        (
            json!({"model": "m", "input": [{"role": "robot", "content": "x"}]}),
            "invalid_request",
            "input[0].role",
        ),
        (
            json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_audio"}]}]}),
            "invalid_request",
            "input[0].content[0].type",
        ),
        (
            json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}),
            "unsupported_parameter",
            "file_id",
        ),
        (
            json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}),
            "unsupported_parameter",
            "tools[0]",
        ),
        (
            json!({"model": "m", "input": "x", "tools": [{"type": "custom", "name": "sh"}]}),
            "unsupported_parameter",
            "custom",
        ),
        (
            json!({"model": "m", "input": "x", "tool_choice": {"type": "function", "name": "nope"}}),
            "invalid_request",
            "tool_choice.name",
        ),
        (
            json!({"model": "m", "input": "x", "max_output_tokens": 0}),
            "invalid_request",
            "max_output_tokens",
        ),
        (
            json!({"model": "m", "input": "x", "temperature": "hot"}),
            "invalid_request",
            "temperature",
        ),
        (
            json!({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}),
            "invalid_request",
            "text.format.type",
        ),
        (
            json!({"model": "m", "input": "x", "metadata": [1]}),
            "invalid_request",
            "metadata",
        ),
        (
            json!({"model": "m", "input": "x", "store": "yes"}),
            "invalid_request",
            "store",
        ),
    ] {
        let (status, got, message) = refused(body.clone());
        assert_eq!(
            (status, got.as_deref()),
            (400, Some(code)),
            "{body}: {message}"
        );
        assert!(message.contains(says), "{body}: {message}");
    }
    for raw in [
        &b"not json"[..],
        b"[1,2]",
        b"{\"model\":\"m\",\"input\":\"\xff\"}",
    ] {
        assert!(translate(raw, None).is_err());
    }
}

#[test]
fn a_stored_conversation_leads_the_next_turn_and_grows_with_its_answer() {
    let body = json!({"model": "m", "instructions": "Be brief.", "input": "Again?", "previous_response_id": "resp_1"});
    let context = r#"[{"role":"user","content":"Hello"},{"role":"assistant","content":"Hi."}]"#;
    let asked = translate(body.to_string().as_bytes(), Some(context)).expect("translated");
    let chat: Value = serde_json::from_slice(&asked.chat).expect("JSON");
    assert_eq!(
        chat["messages"],
        json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Again?"},
        ])
    );
    // The instructions are no part of what is stored.
    let stored: Value = serde_json::from_str(&asked.conversation).expect("JSON");
    assert_eq!(stored.as_array().map(Vec::len), Some(3));
    assert_eq!(
        responses::previous_response_id(body.to_string().as_bytes()).expect("read"),
        Some("resp_1".to_owned())
    );
    // The answer joins the conversation the store keeps.
    let mut responder = Responder::new(asked.response_options("run-3", "req", 7));
    feed_run(
        &mut responder,
        &[Step::Delta("Sure.".into())],
        &End::Complete {
            calls: vec![],
            fallback: false,
            finish: None,
            stop: None,
            usage: None,
        },
    );
    let (id, conversation, response) = responses::to_store(&asked, &responder).expect("stored");
    let response: Value = serde_json::from_slice(&response).expect("JSON");
    assert_eq!(response["id"], id.as_str());
    assert_eq!(response["previous_response_id"], "resp_1");
    let conversation: Value = serde_json::from_str(&conversation).expect("JSON");
    assert_eq!(
        conversation[3],
        json!({"role": "assistant", "content": "Sure."})
    );
    let mut store = Store::new(10, 1 << 20);
    assert!(store.insert(
        &id,
        Stored {
            owner: "k".into(),
            conversation: conversation.to_string().into(),
            response: bytes::Bytes::new(),
        }
    ));
    assert!(store.get(&id, "k").is_some() && store.get(&id, "other").is_none());
}

#[test]
fn a_providers_stream_is_reencoded_with_the_same_rules() {
    let options = |stream| ResponseOptions {
        stream,
        ..ResponseOptions::of(
            &iop_api::openai::RequestFacts::default(),
            &[],
            "run-9",
            "req",
        )
    };
    let chunks = [
        json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        json!({"choices": [{"index": 0, "delta": {"reasoning_content": "Think."}}]}),
        json!({"choices": [{"index": 0, "delta": {"content": "Hel"}}]}),
        json!({"choices": [{"index": 0, "delta": {"content": "lo"}}]}),
        json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_a", "function": {"name": "f", "arguments": "{\"a\":"}}]}}]}),
        json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}, "finish_reason": "tool_calls"}]}),
        json!({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 6}}}),
    ];
    let mut sse = String::new();
    for c in &chunks {
        sse.push_str(&format!("data: {c}\n\n"));
    }
    sse.push_str("data: [DONE]\n\n");
    let mut stream = Responder::new(options(true));
    stream.handle_dispatched(DispatchShape::Tunnel, false);
    let mut head = ProviderTunnelFrame {
        kind: TunnelFrameKind::Status as i32,
        status_code: 200,
        ..ProviderTunnelFrame::default()
    };
    head.headers.push(iop_proto_core::wire::Header {
        name: "content-type".into(),
        value: bytes::Bytes::from_static(b"text/event-stream"),
    });
    stream.handle_tunnel_frame(head);
    // Cut anywhere: the bytes arrive in pieces of 7.
    for piece in sse.as_bytes().chunks(7) {
        stream.handle_tunnel_frame(ProviderTunnelFrame {
            kind: TunnelFrameKind::Body as i32,
            body: bytes::Bytes::copy_from_slice(piece),
            ..ProviderTunnelFrame::default()
        });
    }
    stream.handle_tunnel_frame(ProviderTunnelFrame {
        kind: TunnelFrameKind::End as i32,
        ..ProviderTunnelFrame::default()
    });
    let (status, body) = drain(&mut stream);
    assert_eq!(status, Some(200));
    let Ok(Ended::Response(response)) = check_stream(&body) else {
        panic!("{}", String::from_utf8_lossy(&body));
    };
    let kinds: Vec<&str> = response["output"]
        .as_array()
        .expect("output")
        .iter()
        .map(|i| i["type"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(kinds, ["reasoning", "message", "function_call"]);
    assert_eq!(response["output"][1]["content"][0]["text"], "Hello");
    assert_eq!(response["output"][2]["arguments"], "{\"a\":1}");
    assert_eq!(response["output"][2]["call_id"], "call_a");
    assert_eq!(
        response["usage"],
        json!({"input_tokens": 10, "input_tokens_details": {"cached_tokens": 6},
               "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 0},
               "total_tokens": 14})
    );
}

fn options(stream: bool, wants_tools: bool) -> ResponseOptions {
    let facts = iop_api::openai::RequestFacts {
        model: "m".into(),
        stream,
        wants_tools,
        prompt_tokens: 11,
        ..iop_api::openai::RequestFacts::default()
    };
    ResponseOptions::of(&facts, &[], "run-7", "req_7").at(1_700_000_000)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10_000))]

    /// Generated normalized runs (text, tool calls native and written as text, errors,
    /// cancels, lost nodes and timeouts at any point): every stream keeps the rules Codex
    /// relies on (sequence numbers, one `response.created`, one terminal event, items
    /// equal to the final output), completes exactly when the run completed, and ends
    /// with the response the same run gives whole.
    #[test]
    fn runs_keep_the_stream_rules_and_end_with_the_whole_response(
        steps in steps(),
        end in end(),
        wants_tools in any::<bool>(),
    ) {
        let mut stream = Responder::new(options(true, wants_tools));
        feed_run(&mut stream, &steps, &end);
        prop_assert!(stream.is_done());
        let (status, body) = drain(&mut stream);
        let mut whole = Responder::new(options(false, wants_tools));
        feed_run(&mut whole, &steps, &end);
        prop_assert!(whole.is_done());
        let (whole_status, whole_body) = drain(&mut whole);
        let whole_body: Value = serde_json::from_slice(&whole_body).expect("JSON");
        let ended = match status {
            Some(200) => check_stream(&body)
                .unwrap_or_else(|why| panic!("rules: {why}\n{}", String::from_utf8_lossy(&body))),
            Some(_) => {
                // Refused before the first event: an OpenAI error object.
                prop_assert!(whole_body["error"]["message"].is_string());
                let completed = matches!(end, End::Complete { .. });
                prop_assert!(!completed, "a completed run was refused");
                return Ok(());
            }
            None => panic!("no answer"),
        };
        match (&end, ended) {
            (End::Complete { .. }, Ended::Response(response)) => {
                prop_assert_eq!(whole_status, Some(200));
                prop_assert_eq!(&response, &whole_body);
                let text: String = steps.iter().filter_map(|s| match s {
                    Step::Delta(t) => Some(t.as_str()),
                    Step::Idle => None,
                }).collect();
                let shown: String = response["output"].as_array().expect("output").iter()
                    .filter(|i| i["type"] == "message")
                    .filter_map(|i| i["content"][0]["text"].as_str()).collect();
                // Text is never lost unless it was a tool call written as text.
                prop_assert!(shown == text || shown.is_empty(), "{:?} vs {:?}", shown, text);
            }
            (End::Complete { .. }, other) => prop_assert!(false, "a completed run ended {:?}", other),
            (_, Ended::Failed(response)) => {
                prop_assert!(response["error"]["code"].is_string());
                prop_assert_ne!(whole_status, Some(200));
            }
            (_, other) => prop_assert!(false, "a failed run ended {:?}", other),
        }
    }
}
