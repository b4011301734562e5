//! Generated normalized runs, for the property tests of every translated dialect: the
//! steps of a run (text, idle time) and how it ends (completed with or without tool calls,
//! failed, cancelled, its node lost, timed out), fed to a `translated::Responder`, and what
//! a caller reads of the answer.

#![allow(dead_code)]

use iop_api::openai::Out;
use iop_api::translated::{Compose, Responder};
use iop_proto_core::wire::{ErrorDetail, RunEvent, RunEventType, Usage};
use iop_proto_core::{DispatchShape, Outcome, RequestError};
use proptest::prelude::*;
use serde_json::{Value, json};

/// What a caller reads: the status, and the body (whole, or the stream's bytes).
pub(crate) fn drain<C: Compose>(responder: &mut Responder<C>) -> (Option<u16>, Vec<u8>) {
    let mut status = None;
    let mut body = Vec::new();
    while let Some(out) = responder.poll_output() {
        match out {
            Out::Whole { status: s, body: b } => {
                assert!(status.is_none(), "a whole answer after a head");
                status = Some(s);
                body.extend_from_slice(&b);
            }
            Out::Head { status: s, headers } => {
                assert!(status.is_none(), "two heads");
                status = Some(s);
                if s == 200 {
                    assert!(headers.iter().any(|h| h.name == "content-type"));
                }
            }
            Out::Data(b) => {
                assert!(status.is_some(), "body bytes before the head");
                body.extend_from_slice(&b);
            }
            Out::Abort(_) => body.extend_from_slice(b"<abort>"),
        }
    }
    (status, body)
}

pub(crate) fn run_event(sequence: u64, kind: RunEventType) -> RunEvent {
    RunEvent {
        run_id: "run-7".into(),
        sequence,
        r#type: kind as i32,
        ..RunEvent::default()
    }
}

/// One step of a generated run.
#[derive(Clone, Debug)]
pub(crate) enum Step {
    Delta(String),
    Idle,
}

/// How a generated run ends.
#[derive(Clone, Debug)]
pub(crate) enum End {
    Complete {
        calls: Vec<(String, String)>,
        fallback: bool,
        finish: Option<&'static str>,
        stop: Option<String>,
        usage: Option<(u64, u64)>,
    },
    Error,
    Cancelled,
    NodeLost,
    Timeout,
}

pub(crate) fn feed_run<C: Compose>(responder: &mut Responder<C>, steps: &[Step], end: &End) {
    responder.handle_dispatched(DispatchShape::Run, false);
    responder.handle_run_event(run_event(0, RunEventType::Start));
    let mut sequence = 1;
    for step in steps {
        match step {
            Step::Delta(text) => {
                let mut e = run_event(sequence, RunEventType::Delta);
                e.delta = text.clone();
                responder.handle_run_event(e);
                sequence += 1;
            }
            Step::Idle => responder.handle_idle(std::time::Duration::from_secs(16)),
        }
    }
    match end {
        End::Complete {
            calls,
            fallback,
            finish,
            stop,
            usage,
        } => {
            let mut e = run_event(sequence, RunEventType::Complete);
            if !calls.is_empty() {
                let list: Vec<Value> = calls
                    .iter()
                    .enumerate()
                    .map(|(i, (name, args))| json!({"id": format!("call_{i}"), "type": "function", "function": {"name": name, "arguments": args}}))
                    .collect();
                e.metadata
                    .insert("openai_tool_calls".into(), Value::Array(list).to_string());
            }
            if *fallback {
                e.metadata
                    .insert("openai_text_tool_fallback".into(), "true".into());
            }
            if let Some(finish) = finish {
                e.metadata
                    .insert("finish_reason".into(), (*finish).to_owned());
            }
            if let Some(stop) = stop {
                e.metadata.insert("stop_sequence".into(), stop.clone());
            }
            e.usage = usage.map(|(p, c)| Usage {
                prompt_tokens: p,
                completion_tokens: c,
                total_tokens: p + c,
            });
            responder.handle_run_event(e);
            responder.handle_end(&Outcome::Completed);
        }
        End::Error => {
            let mut e = run_event(sequence, RunEventType::Error);
            e.error = Some(ErrorDetail {
                code: "boom".into(),
                message: "it broke".into(),
                retryable: false,
            });
            responder.handle_run_event(e);
            responder.handle_end(&Outcome::Failed(RequestError::Provider(
                ErrorDetail::default(),
            )));
        }
        End::Cancelled => {
            responder.handle_run_event(run_event(sequence, RunEventType::Cancelled));
            responder.handle_end(&Outcome::Cancelled);
        }
        End::NodeLost => responder.handle_end(&Outcome::Failed(RequestError::NodeLost {
            node_id: "n".into(),
        })),
        End::Timeout => responder.handle_timeout(),
    }
}

pub(crate) fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z ]{1,12}",
        "[{}\\[\\]\":,a-z0-9 ]{1,10}",
        "[ \\n]{1,3}",
        Just("```json\n".to_owned()),
        Just("{\"tool_calls\":[{\"name\":\"f\",\"arguments\":{\"a\":1}}]}".to_owned()),
        "\\PC{1,6}",
    ]
}

pub(crate) fn arguments() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("{}".to_owned()),
        Just("{\"city\":\"Paris\",\"days\":[1,2]}".to_owned()),
        Just(String::new()),
        Just("{\"broken\":".to_owned()),
        Just("[1,2]".to_owned()),
        "\\PC{0,12}",
    ]
}

pub(crate) fn end() -> impl Strategy<Value = End> {
    prop_oneof![
        6 => (
            prop::collection::vec(("[a-z_]{1,8}", arguments()), 0..3),
            any::<bool>(),
            prop::option::of(prop_oneof![Just("stop"), Just("length"), Just("tool_calls"), Just("weird")]),
            prop::option::of(prop_oneof![Just("END".to_owned()), Just("other".to_owned())]),
            prop::option::of((0u64..5000, 0u64..5000)),
        )
            .prop_map(|(calls, fallback, finish, stop, usage)| End::Complete {
                calls,
                fallback,
                finish,
                stop,
                usage,
            }),
        1 => Just(End::Error),
        1 => Just(End::Cancelled),
        1 => Just(End::NodeLost),
        1 => Just(End::Timeout),
    ]
}

pub(crate) fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        prop_oneof![8 => text().prop_map(Step::Delta), 1 => Just(Step::Idle)],
        0..12,
    )
}

/// Tunnel frames as the Edge machine hands them on, in order: each of one kind, bare or
/// carrying more than its kind needs (metadata; an error detail), so that
/// `TunnelPart::from` makes every kind of part of them, bare and boxed. Bodies are chat
/// completion chunks (whole, cut, or `[DONE]`), a whole answer, or not JSON.
pub(crate) fn tunnel_frames()
-> impl Strategy<Value = Vec<iop_proto_core::wire::ProviderTunnelFrame>> {
    use bytes::Bytes;
    use iop_proto_core::wire::{Header, ProviderTunnelFrame};
    let header = prop_oneof![
        Just(("content-type", "text/event-stream")),
        Just(("content-type", "application/json")),
        Just(("retry-after", "3")),
        Just(("x-request-id", "up-1")),
        Just(("x-other", "v")),
    ]
    .prop_map(|(name, value): (&str, &'static str)| Header {
        name: name.into(),
        value: Bytes::from_static(value.as_bytes()),
    });
    let body = prop_oneof![
        Just(
            "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}]}\n\n"
        ),
        Just(
            "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n"
        ),
        Just("data: [DONE]\n\n"),
        Just("data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"h"),
        Just(
            "{\"id\":\"c\",\"object\":\"chat.completion\",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"hi\"},\"finish_reason\":\"stop\"}]}"
        ),
        Just("not json"),
        Just(""),
    ];
    let frame = (
        0..8_i32,
        prop_oneof![Just(200_u32), Just(404), Just(503), Just(0), Just(1000)],
        prop::collection::vec(header, 0..3),
        body,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(kind, code, headers, body, metadata, error)| {
            let mut frame = ProviderTunnelFrame {
                run_id: "run-7".into(),
                kind,
                ..ProviderTunnelFrame::default()
            };
            match kind {
                1 => {
                    frame.status_code = code;
                    frame.headers = headers;
                }
                2 => frame.headers = headers,
                3 => frame.body = Bytes::from_static(body.as_bytes()),
                4 => {
                    frame.usage = Some(Usage {
                        prompt_tokens: 5,
                        completion_tokens: u64::from(code),
                        total_tokens: 5 + u64::from(code),
                    });
                }
                _ => {}
            }
            if metadata {
                frame.metadata.insert("k".into(), "v".into());
            }
            if error || kind == 6 {
                frame.error = Some(ErrorDetail {
                    code: "upstream".into(),
                    message: "upstream said no".into(),
                    retryable: false,
                });
            }
            frame
        });
    prop::collection::vec(frame, 0..8)
}

/// How a request may end after its frames: `None` leaves it open.
pub(crate) fn tunnel_outcome() -> impl Strategy<Value = Option<Outcome>> {
    prop_oneof![
        Just(None),
        Just(Some(Outcome::Completed)),
        Just(Some(Outcome::Cancelled)),
        Just(Some(Outcome::Failed(RequestError::Provider(ErrorDetail {
            code: "upstream".into(),
            message: "upstream said no".into(),
            retryable: false,
        })))),
    ]
}
