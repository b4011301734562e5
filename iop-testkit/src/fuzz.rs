//! Fuzz entry points. Each takes arbitrary bytes, drives one input surface and panics
//! only when an invariant breaks. The cargo-fuzz targets under `fuzz/` call these, and
//! the crate's tests replay the committed corpus through them on stable.
//!
//! Over the ~800-line norm on purpose: one flat list of entry points, each independent of
//! the others and named by its cargo-fuzz target, so a target's harness is found by name
//! in one file; it ships in no build without the `testkit` feature.

use bytes::{Bytes, BytesMut};

use iop_proto_core::testkit::Inspect;
use iop_proto_core::wire::{self, DecodeError, Envelope, FrameDecoder, Validate};

/// Feeds `data` to a [`FrameDecoder`] in uneven pieces and checks that:
/// the result does not depend on how the input was split, nor on whether tunnel requests
/// are read in place ([`FrameDecoder::next_inbound`]), and is what prost alone decodes
/// each frame to (tunnel frames are read by hand); the decoder never holds more
/// memory than the input warrants; an error is sticky; every decoded envelope validates
/// or fails validation without panicking, and re-encodes to a frame that decodes to the
/// same envelope.
pub fn frame_decoder(data: &[u8]) {
    // Small limit so the fuzzer can reach the oversized path cheaply.
    const MAX: usize = 4096;
    let whole = decode_all(MAX, |decoder| {
        decoder.push_bytes(Bytes::copy_from_slice(data))
    });
    let split = decode_all(MAX, |decoder| {
        // Piece sizes drawn from the data itself: deterministic per input.
        let mut rest = data;
        let mut i = 0usize;
        while !rest.is_empty() {
            let size = 1 + usize::from(data[i % data.len()]) % 7;
            let (piece, tail) = rest.split_at(size.min(rest.len()));
            if i.is_multiple_of(2) {
                decoder.push(piece);
            } else {
                decoder.push_bytes(Bytes::copy_from_slice(piece));
            }
            rest = tail;
            i += 1;
        }
    });
    assert_eq!(whole, split, "decoding depends on how the input was split");
    // The Node's reading (a tunnel request read in place) gives the same envelopes.
    let mut decoder = FrameDecoder::with_max_frame_len(MAX);
    decoder.push_bytes(Bytes::copy_from_slice(data));
    let mut read = Vec::new();
    let outcome = loop {
        match decoder.next_inbound() {
            Ok(Some(inbound)) => read.push(inbound.into_envelope()),
            Ok(None) => break decoder.finish().or_else(truncation_is_ok),
            Err(err) => break Err(err),
        }
    };
    assert_eq!(
        (read, outcome),
        whole,
        "reading in place differs from decoding"
    );

    assert_eq!(
        prost_reading(data, MAX),
        whole,
        "the decoder differs from prost"
    );

    let (envelopes, outcome) = whole;
    for envelope in &envelopes {
        let _ = envelope.validate();
        let mut out = BytesMut::new();
        wire::encode_with_limit(envelope, &mut out, usize::MAX)
            .expect("decoded envelope re-encodes");
        let mut again = FrameDecoder::new();
        again.push_bytes(out.freeze());
        assert_eq!(again.next_envelope().as_ref(), Ok(&Some(envelope.clone())));
    }
    if let Err(err) = outcome {
        let _ = err.to_string();
    }
}

type Decoded = (Vec<Envelope>, Result<(), DecodeError>);

/// The frames of `data` each decoded by prost alone, as the decoder reports them: up to
/// the first error, a frame cut short at the end being no error.
fn prost_reading(data: &[u8], max: usize) -> Decoded {
    use prost::Message;
    let mut envelopes = Vec::new();
    let mut rest = data;
    while let Some((header, tail)) = rest.split_first_chunk::<{ wire::HEADER_LEN }>() {
        let announced = u32::from_be_bytes(*header);
        let len = usize::try_from(announced).unwrap_or(usize::MAX);
        if len > max {
            let len = u64::from(announced);
            return (envelopes, Err(DecodeError::FrameTooLarge { len, max }));
        }
        let Some((body, tail)) = tail.split_at_checked(len) else {
            break;
        };
        match Envelope::decode(body) {
            Ok(envelope) if envelope.body.is_some() => envelopes.push(envelope),
            Ok(_) => return (envelopes, Err(DecodeError::MissingBody { len })),
            Err(source) => return (envelopes, Err(DecodeError::Malformed { len, source })),
        }
        rest = tail;
    }
    (envelopes, Ok(()))
}

fn decode_all(max: usize, feed: impl FnOnce(&mut FrameDecoder)) -> Decoded {
    let mut decoder = FrameDecoder::with_max_frame_len(max);
    feed(&mut decoder);
    // Memory held is bounded by what was received, never by what a header promised.
    assert!(decoder.buffer_capacity() <= 2 * decoder.buffered_len() + 64);
    let mut envelopes = Vec::new();
    loop {
        match decoder.next_envelope() {
            Ok(Some(envelope)) => envelopes.push(envelope),
            Ok(None) => return (envelopes, decoder.finish().or_else(truncation_is_ok)),
            Err(err) => {
                assert_eq!(
                    decoder.next_envelope(),
                    Err(err.clone()),
                    "errors are sticky"
                );
                assert_eq!(decoder.buffered_len(), 0);
                return (envelopes, Err(err));
            }
        }
    }
}

fn truncation_is_ok(err: DecodeError) -> Result<(), DecodeError> {
    match err {
        DecodeError::Truncated { .. } => Ok(()),
        other => Err(other),
    }
}

/// Reads bytes off the front of fuzz input, yielding zeros once exhausted.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    fn bytes(&mut self, max: usize) -> &[u8] {
        let n = usize::from(self.byte()).min(max).min(self.0.len());
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A `held_elsewhere` list: usually small and sane, sometimes over capacity, unknown,
/// duplicated or with more long-context requests than requests.
fn loads(input: &mut Input<'_>) -> Vec<iop_proto_core::wire::AdapterLoad> {
    (0..input.byte() % 3)
        .map(|_| iop_proto_core::wire::AdapterLoad {
            adapter: ["a", "b", "zz", ""][usize::from(input.byte() % 4)].into(),
            in_flight: u32::from(input.byte() % 6),
            long_in_flight: u32::from(input.byte() % 4),
        })
        .collect()
}

fn structured_envelope(input: &mut Input<'_>) -> Option<Envelope> {
    use prost::Message;

    use iop_proto_core::wire::{
        Body, CancelRequest, Heartbeat, HeartbeatAck, NodeConfigRefreshResponse, NodeDrainRequest,
        NodeReadyRequest, ProviderTunnelFrame, RegisterRequest, RunEvent,
    };
    let node_id = format!("n{}", input.byte() % 4);
    let run_id = format!("run-{}", input.byte() % 16);
    let body = match input.byte() % 10 {
        0 => {
            let raw = input.bytes(64);
            return Envelope::decode(raw).ok();
        }
        1 => Body::RegisterRequest(RegisterRequest {
            node_id,
            token: if input.byte().is_multiple_of(4) {
                "bad".into()
            } else {
                "sim-token".into()
            },
            ..RegisterRequest::default()
        }),
        2 => Body::NodeReadyRequest(NodeReadyRequest {
            node_id,
            held_elsewhere: loads(input),
        }),
        3 => Body::Heartbeat(Heartbeat {
            nonce: u64::from(input.byte()),
            sent_at_ms: u64::from(input.u16()),
        }),
        4 => Body::HeartbeatAck(HeartbeatAck {
            nonce: u64::from(input.byte()),
            echo_sent_at_ms: 0,
        }),
        5 | 6 => Body::RunEvent(RunEvent {
            run_id,
            sequence: u64::from(input.byte() % 8),
            r#type: i32::from(input.byte() % 7),
            delta: "x".into(),
            ..RunEvent::default()
        }),
        7 => Body::ProviderTunnelFrame(ProviderTunnelFrame {
            run_id,
            sequence: u64::from(input.byte() % 8),
            kind: i32::from(input.byte() % 8),
            status_code: u32::from(input.u16() % 700),
            body: bytes::Bytes::copy_from_slice(input.bytes(16)),
            ..ProviderTunnelFrame::default()
        }),
        8 => Body::NodeConfigRefreshResponse(NodeConfigRefreshResponse {
            request_id: format!("refresh-{}", input.byte() % 4),
            status: i32::from(input.byte() % 5),
            ..NodeConfigRefreshResponse::default()
        }),
        // A node stopping gracefully, now and then, ready or not.
        _ if input.byte().is_multiple_of(8) => Body::NodeDrainRequest(NodeDrainRequest {
            reason: "local shutdown".into(),
        }),
        // A re-homed node's load elsewhere, ready or not, right or wrong.
        _ if input.byte().is_multiple_of(8) => {
            Body::NodeLoadReport(iop_proto_core::wire::NodeLoadReport {
                held_elsewhere: loads(input),
            })
        }
        _ => Body::CancelRequest(CancelRequest {
            run_id,
            kind: i32::from(input.byte() % 4),
            reason: String::new(),
        }),
    };
    Some(Envelope::new(body))
}

/// The Edge machine fed arbitrary envelopes from several connections, interleaved with
/// time, submits, cancels and reloads that move adapters between the run and tunnel
/// shapes. Checks that nothing panics, that the lease accounting stays consistent after
/// every input, and that no tunnel-only request is dispatched to a run-served provider.
pub fn edge_core(data: &[u8]) {
    use crate::sim::world_config;
    use iop_proto_core::edge::{ConnId, EdgeCore, Submit, Transmit};
    use iop_proto_core::time::Timestamp;
    use iop_proto_core::wire::Body;

    let Ok(mut edge) = EdgeCore::new(world_config(0)) else {
        return;
    };
    let mut input = Input(data);
    let mut now = 0u64;
    let mut open = [false; 4];
    let mut requests = Vec::new();
    let mut tunnel_only_requests = std::collections::HashSet::new();
    let shapes = ["run", "tunnel"];
    while !input.is_empty() {
        let op = input.byte();
        let conn = usize::from(op >> 4) % open.len();
        let t = Timestamp::from_millis(now);
        match op % 8 {
            0 => {
                if !open[conn] {
                    open[conn] = edge
                        .handle_connection_opened(
                            t,
                            ConnId(conn as u64),
                            iop_proto_core::edge::Peer::default(),
                        )
                        .is_ok();
                }
            }
            1 => {
                if open[conn] {
                    open[conn] = false;
                    let _ = edge.handle_connection_closed(t, ConnId(conn as u64));
                }
            }
            2..=4 => {
                if let Some(envelope) = structured_envelope(&mut input)
                    && open[conn]
                {
                    let _ = edge.handle_envelope(t, ConnId(conn as u64), envelope);
                }
            }
            5 => {
                now += u64::from(input.u16());
                edge.handle_timeout(Timestamp::from_millis(now));
            }
            6 => {
                let model = format!("m{}", input.byte() % 4);
                let tunnel_only = input.byte() % 4 == 0;
                let mut submit = Submit::chat(&model, bytes::Bytes::from_static(b"{}"));
                submit.prompt_tokens = u64::from(input.byte());
                if tunnel_only {
                    submit.endpoint = iop_api::openai::Endpoint::Embeddings;
                }
                if let Ok(r) = edge.handle_submit(t, submit) {
                    requests.push(r);
                    if tunnel_only {
                        tunnel_only_requests.insert(r);
                    }
                }
            }
            _ if op & 0x08 != 0 => {
                // A reload: each adapter of each node may be switched to the other shape.
                let flips = input.u16();
                let mut cfg = world_config(u32::from(flips >> 12));
                for (bit, adapter) in cfg
                    .nodes
                    .values_mut()
                    .flat_map(|node| node.adapters.iter_mut())
                    .enumerate()
                {
                    if flips >> (bit % 12) & 1 == 1 {
                        adapter
                            .options
                            .insert("dispatch".into(), shapes[bit % 2].into());
                    }
                }
                let _ = edge.handle_config(t, cfg);
            }
            _ => {
                if let Some(&r) = requests.get(usize::from(input.byte())) {
                    let _ = edge.handle_cancel(t, r, "fuzz");
                }
            }
        }
        // Drain like a shell: check what is dispatched, forget the rest.
        while let Some(transmit) = edge.poll_transmit() {
            if let Transmit::Frame {
                envelope:
                    Envelope {
                        body: Some(Body::RunRequest(run)),
                    },
                ..
            } = transmit
                && let Some(run) = iop_proto_core::edge::RunId::parse(&run.run_id)
            {
                assert!(
                    !tunnel_only_requests.contains(&run.request),
                    "a tunnel-only request was dispatched to a run-served provider"
                );
            }
        }
        while edge.poll_event().is_some() {}
        while edge.poll_lifecycle().is_some() {}
        let ledger = edge.ledger();
        let held: u32 = edge
            .snapshots()
            .iter()
            .filter_map(|s| edge.resource(&s.node_id, &s.provider_id))
            .map(|r| ledger.usage(r).in_flight)
            .sum();
        assert_eq!(
            held as usize,
            ledger.leases_held(),
            "lease accounting diverged"
        );
    }
}

/// The Node session fed arbitrary envelopes, shell outputs and timeouts. Checks that
/// nothing panics and that every run event it transmits forms a valid sequence per run.
pub fn node_session(data: &[u8]) {
    use std::collections::HashMap;

    use iop_proto_core::session::{NodeSession, RunOutput, SessionConfig, TunnelOutput};
    use iop_proto_core::testkit::internals::RunTracker;
    use iop_proto_core::time::Timestamp;
    use iop_proto_core::wire::{
        AdapterConfig, AdapterType, Body, ErrorDetail, NodeConfigPayload, RegisterResponse,
    };

    let mut session = NodeSession::new(SessionConfig::new("n0", "sim-token"));
    let mut input = Input(data);
    let mut now = 0u64;
    let _ = session.handle_connected(Timestamp::ZERO);
    let mut trackers: HashMap<String, RunTracker> = HashMap::new();
    while !input.is_empty() {
        let t = Timestamp::from_millis(now);
        match input.byte() % 8 {
            0 => {
                // An accepted register with a plausible config.
                let payload = NodeConfigPayload {
                    revision: 1,
                    adapters: vec![AdapterConfig {
                        name: "run".into(),
                        r#type: AdapterType::Mock as i32,
                        capacity: u32::from(input.byte() % 4),
                        long_capacity: 0,
                        enabled: true,
                        ..AdapterConfig::default()
                    }],
                    runtime: None,
                };
                let _ = session.handle_envelope(
                    t,
                    Envelope::new(Body::RegisterResponse(RegisterResponse {
                        accepted: input.byte() % 8 != 0,
                        node_id: "n0".into(),
                        config: Some(payload),
                        heartbeat_interval_ms: u32::from(input.u16()),
                        ..RegisterResponse::default()
                    })),
                );
            }
            1 => {
                let _ = session.handle_config_applied(
                    t,
                    if input.byte() % 8 == 0 {
                        Err("no".into())
                    } else {
                        Ok(())
                    },
                );
            }
            2 | 3 => {
                if let Some(envelope) = structured_envelope(&mut input) {
                    let _ = session.handle_envelope(t, envelope);
                }
            }
            4 => {
                let run_id = format!("run-{}", input.byte() % 16);
                let output = match input.byte() % 5 {
                    0 => RunOutput::Start,
                    1 => RunOutput::Delta("x".into()),
                    2 => RunOutput::Complete {
                        usage: None,
                        metadata: Default::default(),
                    },
                    3 => RunOutput::Error(ErrorDetail::default()),
                    _ => RunOutput::Cancelled,
                };
                let _ = session.handle_run_output(t, &run_id, output);
            }
            5 => {
                let run_id = format!("run-{}", input.byte() % 16);
                let output = match input.byte() % 4 {
                    0 => TunnelOutput::Status {
                        status: u32::from(input.u16()),
                        headers: Vec::new(),
                    },
                    1 => TunnelOutput::Body(bytes::Bytes::copy_from_slice(input.bytes(200))),
                    2 => TunnelOutput::End,
                    _ => TunnelOutput::Error(ErrorDetail::default()),
                };
                let _ = session.handle_tunnel_output(t, &run_id, output);
            }
            6 => {
                now += u64::from(input.u16());
                session.handle_timeout(Timestamp::from_millis(now));
            }
            _ => match input.byte() % 8 {
                // A local stop now and then: graceful, quick, or the link lost.
                0 => {
                    let _ = session.handle_drain(t);
                }
                1 => {
                    let _ = session.handle_shutdown(t);
                }
                2 => {
                    let _ = session
                        .handle_connection_lost(t, iop_proto_core::reconnect::Failure::Reset);
                }
                // Answer a pending refresh or command with arbitrary ids.
                _ => {
                    let id = format!("refresh-{}", input.byte() % 4);
                    let _ = session.handle_refresh_applied(t, &id, Ok(()));
                }
            },
        }
        while session.poll_event().is_some() {}
        while let Some(transmit) = session.poll_transmit() {
            if let iop_proto_core::session::NodeTransmit::Frame(Envelope {
                body: Some(Body::RunEvent(event)),
            }) = transmit
            {
                let tracker = trackers.entry(event.run_id.clone()).or_default();
                assert!(
                    tracker.observe(&event).is_ok(),
                    "the session emitted an invalid run sequence: {event:?}"
                );
                if tracker.is_ended() {
                    // A run id may be reused by a later request after it ended.
                    trackers.remove(&event.run_id);
                }
            }
        }
    }
}

/// Arbitrary frames into the tunnel receiver: it never panics, and once it refuses a frame
/// or accepts a terminal it accepts nothing more.
pub fn tunnel_receiver(data: &[u8]) {
    use iop_proto_core::testkit::internals::TunnelReceiver;
    use iop_proto_core::wire::ProviderTunnelFrame;

    let mut input = Input(data);
    let mut receiver = TunnelReceiver::new();
    let mut closed = false;
    while !input.is_empty() {
        let frame = ProviderTunnelFrame {
            run_id: "t".into(),
            sequence: u64::from(input.byte() % 12),
            kind: i32::from(input.byte() % 9) - 1,
            status_code: u32::from(input.u16()),
            ..ProviderTunnelFrame::default()
        };
        let accepted = receiver.observe(&frame);
        if closed {
            assert!(accepted.is_err(), "accepted a frame after the tunnel ended");
        }
        match accepted {
            Ok(step) => closed = step.is_terminal(),
            Err(_) => closed = true,
        }
        assert_eq!(closed, receiver.is_ended());
    }
}

/// An untrusted request body (the first byte picks the OpenAI endpoint) through what the
/// Edge reads of it, in every dialect (the same bytes as a Messages request too). Checks
/// that: `inspect` answers exactly as serde alone does (its validating pass takes only
/// what serde reads the same), a 400 or facts whose token estimate is the public
/// estimate of the same bytes, and only for UTF-8; the estimate never
/// counts more tokens than the body has bytes (it decides long-context routing); the
/// model rewrite changes exactly the bytes of the top-level `model` value, and happens
/// exactly when that member is found; member ranges lie inside the body, and in a body
/// that is one JSON object the member found from the end is the one serde keeps.
pub fn openai_request(data: &[u8]) {
    use iop_api::openai::{Endpoint, estimate_tokens, inspect};
    use iop_json::{for_target, last_member_value, member_value, rewrite_model};

    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    let endpoint =
        [Endpoint::Chat, Endpoint::Completions, Endpoint::Embeddings][usize::from(pick % 3)];
    let estimate = estimate_tokens(body);
    assert!(
        estimate <= body.len() as u64,
        "{estimate} tokens for {} bytes",
        body.len()
    );
    let inspected = inspect(body, endpoint);
    assert_eq!(
        inspected,
        iop_api::openai::inspect_by_serde(body, endpoint),
        "the validating pass and serde read a body differently"
    );
    match inspected {
        Ok(facts) => {
            assert!(
                std::str::from_utf8(body).is_ok(),
                "accepted a body that is not UTF-8"
            );
            assert_eq!(facts.prompt_tokens, estimate, "inspect's estimate differs");
        }
        Err(error) => assert_eq!(error.status, 400, "{}", error.message),
    }
    messages_request(body);
    responses_request(body);
    for key in ["model", "messages", "usage"] {
        for range in [member_value(body, key), last_member_value(body, key)]
            .into_iter()
            .flatten()
        {
            assert!(
                range.start <= range.end && range.end <= body.len(),
                "{range:?}"
            );
        }
    }
    // One JSON object: the member found from its end is the one serde keeps.
    if let Ok(serde_json::Value::Object(object)) = serde_json::from_slice(body) {
        for key in ["model", "usage"] {
            let found = last_member_value(body, key).map(|range| {
                serde_json::from_slice::<serde_json::Value>(&body[range])
                    .expect("a member found from the end is a whole value")
            });
            assert_eq!(found.as_ref(), object.get(key), "member {key}");
        }
    }
    let target = "fuzz/model \"x\"";
    let encoded = br#""fuzz/model \"x\"""#;
    let sent = for_target(bytes::Bytes::copy_from_slice(body), target);
    match (member_value(body, "model"), rewrite_model(body, target)) {
        (None, None) => assert_eq!(&sent[..], body, "nothing to rewrite, yet changed"),
        (Some(range), Some(out)) => {
            let mut expected = body[..range.start].to_vec();
            expected.extend_from_slice(encoded);
            expected.extend_from_slice(&body[range.end..]);
            assert_eq!(&out[..], &expected[..], "the rewrite touched other bytes");
            assert_eq!(
                &sent[..],
                &expected[..],
                "the body sent differs from the rewrite"
            );
        }
        (found, rewritten) => panic!(
            "member {found:?} but rewrite {:?}",
            rewritten.map(|b| b.len())
        ),
    }
}

/// The same untrusted body as an Anthropic Messages request: translated or refused with
/// a 400 (never a panic); a translation is a JSON object with a non-empty `messages`
/// array, the model and stream the facts say, and the public estimate of its own bytes;
/// `count_tokens` agrees with it, and refuses exactly what the translation refuses for a
/// reason other than `max_tokens`.
fn messages_request(body: &[u8]) {
    use iop_api::anthropic::{TranslateOptions, count_tokens, translate};
    use iop_api::openai::estimate_tokens;

    let translated = translate(body, TranslateOptions::default());
    let counted = count_tokens(body, TranslateOptions::default());
    match &translated {
        Ok(t) => {
            let chat: serde_json::Value =
                serde_json::from_slice(&t.chat).expect("a translation is JSON");
            assert!(
                chat["messages"].as_array().is_some_and(|m| !m.is_empty()),
                "no messages in {chat}"
            );
            assert_eq!(chat["model"].as_str(), Some(t.facts.model.as_str()));
            assert_eq!(chat["stream"].as_bool() == Some(true), t.facts.stream);
            assert_eq!(t.facts.prompt_tokens, estimate_tokens(&t.chat));
            let counted = counted.expect("count_tokens refused what translate took");
            assert_eq!(counted.input_tokens, t.facts.prompt_tokens);
        }
        Err(error) => {
            assert_eq!(error.status, 400, "{}", error.message);
            if let Err(counted) = &counted {
                assert_eq!(counted.status, 400, "{}", counted.message);
            }
        }
    }
}

/// A Responses body translated, alone and as the turn after a stored conversation:
/// nothing panics, a refusal is a 400, a translation is a chat body whose estimate is
/// the facts', and the conversation it would store is a JSON array.
fn responses_request(body: &[u8]) {
    use iop_api::openai::estimate_tokens;
    use iop_api::responses::{previous_response_id, translate};

    let context = r#"[{"role":"user","content":"before"},{"role":"assistant","content":"then"}]"#;
    for stored in [None, Some(context)] {
        match translate(body, stored) {
            Ok(t) => {
                let chat: serde_json::Value =
                    serde_json::from_slice(&t.chat).expect("a translation is JSON");
                assert_eq!(chat["model"].as_str(), Some(t.facts.model.as_str()));
                assert_eq!(t.facts.prompt_tokens, estimate_tokens(&t.chat));
                let conversation: serde_json::Value =
                    serde_json::from_str(&t.conversation).expect("the conversation is JSON");
                assert!(conversation.is_array(), "{conversation}");
                if stored.is_some() {
                    assert_eq!(conversation[0]["content"], "before");
                }
            }
            Err(error) => assert_eq!(error.status, 400, "{}", error.message),
        }
    }
    if let Err(error) = previous_response_id(body) {
        assert_eq!(error.status, 400, "{}", error.message);
    }
}

/// An untrusted provider's answer (its bytes, as an OpenAI-compatible server's SSE
/// stream or JSON body, cut where the input says) re-encoded for a Messages caller,
/// streamed and whole. Checks that nothing panics, that every stream keeps the Messages
/// grammar ([`crate::messages::check_stream`]) and ends, with a message or an error
/// event, and that a whole answer is one JSON object (a message or an error).
pub fn messages_render(data: &[u8]) {
    use bytes::Bytes;
    use iop_api::anthropic::{Responder, ResponseOptions};
    use iop_api::openai::Out;
    use iop_proto_core::wire::{Header, ProviderTunnelFrame, TunnelFrameKind};
    use iop_proto_core::{DispatchShape, Outcome};

    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let Some((&cut, body)) = rest.split_first() else {
        return;
    };
    let frame = |kind: TunnelFrameKind| ProviderTunnelFrame {
        run_id: "r".into(),
        kind: kind as i32,
        ..ProviderTunnelFrame::default()
    };
    for stream in [true, false] {
        let mut responder = Responder::new(ResponseOptions {
            model: "m".into(),
            run_id: "r".into(),
            request_id: "req".into(),
            stream,
            wants_tools: pick & 4 != 0,
            stop_sequences: vec!["END".into()],
            input_estimate: 3,
            created: 0,
            echo: serde_json::Map::new(),
        });
        responder.handle_dispatched(DispatchShape::Tunnel, false);
        let mut head = frame(TunnelFrameKind::Status);
        head.status_code = if pick & 2 == 0 {
            200
        } else {
            400 + u32::from(pick % 200)
        };
        head.headers = vec![Header {
            name: "content-type".into(),
            value: Bytes::from_static(if pick & 1 == 0 {
                b"text/event-stream"
            } else {
                b"application/json"
            }),
        }];
        responder.handle_tunnel_frame(head);
        let step = usize::from(cut).max(1);
        for piece in body.chunks(step) {
            let mut b = frame(TunnelFrameKind::Body);
            b.body = Bytes::copy_from_slice(piece);
            responder.handle_tunnel_frame(b);
        }
        responder.handle_tunnel_frame(frame(TunnelFrameKind::End));
        responder.handle_end(&Outcome::Completed);
        assert!(responder.is_done(), "a provider's end left the answer open");
        let mut status = None;
        let mut out = Vec::new();
        while let Some(o) = responder.poll_output() {
            match o {
                Out::Head { status: s, .. } | Out::Whole { status: s, .. } if status.is_some() => {
                    panic!("a second head ({s})")
                }
                Out::Head { status: s, .. } => status = Some(s),
                Out::Whole { status: s, body } => {
                    status = Some(s);
                    out.extend_from_slice(&body);
                }
                Out::Data(b) => out.extend_from_slice(&b),
                Out::Abort(_) => panic!("a translated answer aborted"),
            }
        }
        let status = status.expect("an answer");
        let sse = stream && status == 200;
        if sse {
            match crate::messages::check_stream(&out) {
                Ok(crate::messages::Ended::Cut) => panic!("an ended stream was cut"),
                Ok(_) => {}
                Err(why) => panic!("grammar: {why}"),
            }
        } else {
            let value: serde_json::Value =
                serde_json::from_slice(&out).expect("a whole answer is JSON");
            assert!(
                value["type"] == "message" || value["type"] == "error",
                "{value}"
            );
        }
    }
}

/// Operation lists over the lease ledger and the wait queue, checked against plain
/// models: each lease is held once, released once, and fencing returns exactly the
/// leases of its resource; the queue agrees after every step with a list of waiters in
/// arrival order (oldest fitting waiter per resource, expiry by deadline then arrival,
/// counts per resource, earliest deadline, lookups by ticket, FIFO listing).
pub fn lease_queue(data: &[u8]) {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use iop_proto_core::RequestId;
    use iop_proto_core::edge::{Generation, ResourceId};
    use iop_proto_core::testkit::internals::{Candidate, Ticket, WaitQueue, Waiter};
    use iop_proto_core::testkit::internals::{Lease, Ledger, Release};
    use iop_proto_core::time::Timestamp;

    /// A waiting request as the model sees it.
    struct Waiting {
        ticket: Ticket,
        request: RequestId,
        resources: Vec<ResourceId>,
        long: bool,
        deadline: Timestamp,
    }

    let mut input = Input(data);
    let mut ledger = Ledger::new();
    let resources: Vec<_> = (0..4).map(|_| ledger.add_resource()).collect();
    // A tiny ring slack so that long-staying waiters move out of the ring early.
    let mut queue = WaitQueue::with_ring_slack(usize::from(input.byte() % 4));
    let mut model: BTreeMap<u64, Lease> = BTreeMap::new();
    let mut released: Vec<Lease> = Vec::new();
    let mut waiting: Vec<Waiting> = Vec::new();
    let mut tickets: Vec<Ticket> = Vec::new();
    let mut generation = 1u64;
    let mut next = 1u64;
    while !input.is_empty() {
        let r = resources[usize::from(input.byte()) % resources.len()];
        match input.byte() % 8 {
            0 => {
                generation += 1;
                let fenced = ledger.activate(
                    r,
                    Generation(generation),
                    u32::from(input.byte() % 4),
                    u32::from(input.byte() % 3),
                );
                for lease in fenced {
                    assert_eq!(model.remove(&lease.run.request.0), Some(lease));
                }
            }
            1 => {
                let fenced = ledger.fence(r);
                for lease in &fenced {
                    assert_eq!(lease.resource, r);
                    assert_eq!(model.remove(&lease.run.request.0), Some(*lease));
                }
                assert!(
                    model.values().all(|l| l.resource != r),
                    "fence left a lease behind"
                );
            }
            2 => {
                let long = input.byte() % 2 == 0;
                if let Some(lease) = ledger.try_acquire(r, RequestId(next), long) {
                    model.insert(next, lease);
                }
                next += 1;
            }
            3 => {
                let pick = usize::from(input.byte());
                if let Some(&lease) = model.values().nth(pick % model.len().max(1)) {
                    assert_eq!(ledger.release(lease), Release::Released);
                    model.remove(&lease.run.request.0);
                    released.push(lease);
                } else if let Some(&old) = released.get(pick % released.len().max(1)) {
                    assert_eq!(
                        ledger.release(old),
                        Release::Stale,
                        "a lease released twice"
                    );
                }
            }
            4 | 5 => {
                // One to three distinct candidates, starting at `r`.
                let extra = input.byte();
                let mut listed = vec![r];
                for k in 0..usize::from(extra % 3) {
                    let other = resources[(r.index() + 1 + k) % resources.len()];
                    if !listed.contains(&other) {
                        listed.push(other);
                    }
                }
                let candidates: Arc<[Candidate]> = listed
                    .iter()
                    .map(|&resource| Candidate {
                        resource,
                        target: "t".into(),
                    })
                    .collect();
                let long = extra & 0x80 != 0;
                let deadline = Timestamp::from_millis(u64::from(input.u16() % 512));
                let ticket = queue.push(Waiter {
                    request: RequestId(next),
                    model: "m".into(),
                    long,
                    candidates,
                    deadline,
                });
                assert!(
                    tickets.last().is_none_or(|&last| last < ticket),
                    "tickets follow arrival"
                );
                tickets.push(ticket);
                waiting.push(Waiting {
                    ticket,
                    request: RequestId(next),
                    resources: listed,
                    long,
                    deadline,
                });
                next += 1;
            }
            6 => {
                // Remove any ticket ever issued; a removed one stays removed.
                let pick = usize::from(input.byte());
                if let Some(&ticket) = tickets.get(pick % tickets.len().max(1)) {
                    let expected = waiting.iter().position(|w| w.ticket == ticket);
                    let got = queue.remove(ticket).map(|w| w.request);
                    assert_eq!(got, expected.map(|at| waiting.remove(at).request));
                }
            }
            _ => {
                let flags = input.byte();
                if flags & 4 == 0 {
                    // A grant: the oldest waiter listing `r` that fits what is free.
                    let (short_free, long_free) = (flags & 1 != 0, flags & 2 != 0);
                    let expected = waiting.iter().position(|w| {
                        w.resources.contains(&r) && if w.long { long_free } else { short_free }
                    });
                    let got = queue.oldest_fitting(r, short_free, long_free);
                    assert_eq!(got, expected.map(|at| waiting[at].ticket));
                    if let Some(ticket) = got {
                        let removed = queue.remove(ticket).map(|w| w.request);
                        assert_eq!(removed, expected.map(|at| waiting.remove(at).request));
                    }
                } else {
                    // Expiry: earliest deadline first, arrival order among equals.
                    let now = Timestamp::from_millis(u64::from(input.u16() % 512));
                    loop {
                        let due = waiting
                            .iter()
                            .enumerate()
                            .filter(|(_, w)| w.deadline <= now)
                            .min_by_key(|(_, w)| (w.deadline, w.ticket))
                            .map(|(at, _)| at);
                        let got = queue.pop_expired(now).map(|w| w.request);
                        assert_eq!(got, due.map(|at| waiting.remove(at).request));
                        if got.is_none() {
                            break;
                        }
                    }
                }
            }
        }
        assert_eq!(ledger.leases_held(), model.len());
        let counted: usize = resources
            .iter()
            .map(|&r| ledger.usage(r).in_flight as usize)
            .sum();
        assert_eq!(counted, model.len());
        for &res in &resources {
            let u = ledger.usage(res);
            assert!(u.long_in_flight <= u.in_flight);
            let listing = waiting.iter().filter(|w| w.resources.contains(&res));
            let long = listing.clone().filter(|w| w.long).count();
            assert_eq!(queue.queued_at(res), (listing.count(), long));
        }
        assert_eq!(queue.len(), waiting.len());
        assert_eq!(
            queue.next_deadline(),
            waiting.iter().map(|w| w.deadline).min()
        );
        let listed: Vec<RequestId> = waiting.iter().map(|w| w.request).collect();
        assert_eq!(queue.ids(), listed, "FIFO listing");
        for w in &waiting {
            assert_eq!(queue.get(w.ticket).map(|q| q.request), Some(w.request));
        }
    }
}

mod http;
pub use http::{http1_request, http1_response};
