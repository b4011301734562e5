//! What a tunnel body chunk allocates on its way through the machines, counted.
//!
//! An SSE stream is made of small body chunks; each crosses the Node's session (framed,
//! numbered, queued), the wire codec both ways, the Edge machine (checked against the
//! tunnel's contract, routed to its request) and the response renderer. None of that may
//! allocate per chunk beyond the one owned string protobuf's generated types give every
//! frame: its run id, cloned into the frame at the Node and decoded at the Edge.
//!
//! The count is this thread's allocations, so nothing else the test binary runs can
//! disturb it (this file holds its own binary for the counting allocator).

// A global allocator is an `unsafe` trait; this one only counts and passes every call on.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use bytes::{Bytes, BytesMut};
use iop_api::openai::{Out, Responder, ResponseOptions};
use iop_proto_core::wire::*;
use iop_proto_core::*;

// The Edge scenario harness of the core's own tests.
#[path = "../../iop-proto-core/tests/common/mod.rs"]
mod common;
use common::edge::{Harness, grants};

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is passed to `System` unchanged; counting touches a const-initialised
// thread-local `Cell`, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Allocations this thread made while `f` ran.
fn allocations(f: impl FnOnce()) -> u64 {
    let before = ALLOCATIONS.with(Cell::get);
    f();
    ALLOCATIONS.with(Cell::get) - before
}

/// Chunks measured, after as many to warm the queues up.
const CHUNKS: u64 = 1_000;

/// One SSE event, as a provider sends it.
const EVENT: &[u8] = b"data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"word \"}}]}\n\n";

#[test]
fn a_node_frames_and_encodes_a_body_chunk_allocating_only_its_run_id() {
    let mut session = NodeSession::new(SessionConfig::new("n1", "secret"));
    let now = Timestamp::ZERO;
    session.handle_connected(now).expect("connecting");
    let send = |session: &mut NodeSession, body: Body| {
        session
            .handle_envelope(now, Envelope::new(body))
            .expect("accepted");
    };
    send(
        &mut session,
        Body::RegisterResponse(RegisterResponse {
            accepted: true,
            node_id: "n1".into(),
            config: Some(NodeConfigPayload {
                revision: 1,
                adapters: vec![testkit::adapter("b", AdapterType::OpenaiCompat, 4, 0)],
                runtime: None,
            }),
            heartbeat_interval_ms: 1000,
            ..Default::default()
        }),
    );
    session
        .handle_config_applied(now, Ok(()))
        .expect("configuring");
    send(
        &mut session,
        Body::NodeReadyResponse(NodeReadyResponse {
            ready: true,
            reason: String::new(),
        }),
    );
    send(
        &mut session,
        Body::ProviderTunnelRequest(ProviderTunnelRequest {
            run_id: "r-1-1".into(),
            adapter: "b".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            ..Default::default()
        }),
    );
    session
        .handle_tunnel_output(
            now,
            "r-1-1",
            TunnelOutput::Status {
                status: 200,
                headers: Vec::new(),
            },
        )
        .expect("status");
    while session.poll_event().is_some() {}

    let event = Bytes::from_static(EVENT);
    let mut out = BytesMut::with_capacity(64 << 10);
    let mut frames = 0;
    let mut chunk = |session: &mut NodeSession, out: &mut BytesMut| {
        session
            .handle_tunnel_output(now, "r-1-1", TunnelOutput::Body(event.clone()))
            .expect("body");
        while let Some(transmit) = session.poll_transmit() {
            if let NodeTransmit::Frame(envelope) = transmit {
                encode(&envelope, out).expect("encodes");
                frames += 1;
            }
        }
        out.clear();
    };
    for _ in 0..CHUNKS {
        chunk(&mut session, &mut out);
    }
    let counted = allocations(|| {
        for _ in 0..CHUNKS {
            chunk(&mut session, &mut out);
        }
    });
    assert!(frames >= 2 * CHUNKS, "every chunk left as a frame");
    assert!(
        counted <= CHUNKS,
        "{counted} allocations for {CHUNKS} body chunks: more than the run id's one each"
    );
}

#[test]
fn an_edge_routes_and_renders_a_body_chunk_allocating_only_the_decoded_run_id() {
    let mut h = Harness::new();
    let conn = h.connect("n2");
    let request = h.submit_tunnel("m").expect("granted");
    let (_, events) = h.drain();
    let grant = grants(&events).pop().expect("a grant");
    assert_eq!(grant.request, request);
    let run_id = h.dispatch(&grant);
    h.drain();

    let mut responder = Responder::new(ResponseOptions {
        model: "m".into(),
        run_id: run_id.clone(),
        created: 1_700_000_000,
        stream: true,
        include_usage: false,
        wants_tools: false,
    });
    responder.handle_dispatched(DispatchShape::Tunnel);
    let frame = |sequence: u64, kind: TunnelFrameKind, body: &'static [u8]| {
        let mut wire = BytesMut::new();
        let envelope = Envelope::new(Body::ProviderTunnelFrame(ProviderTunnelFrame {
            run_id: run_id.clone(),
            sequence,
            kind: kind as i32,
            status_code: 200,
            body: Bytes::from_static(body),
            ..Default::default()
        }));
        encode(&envelope, &mut wire).expect("encodes");
        wire.freeze()
    };
    let mut decoder = FrameDecoder::new();
    let mut rendered = 0;
    let mut deliver = |h: &mut Harness, responder: &mut Responder, wire: Bytes| {
        decoder.push_bytes(wire);
        while let Some(envelope) = decoder.next_envelope().expect("decodes") {
            h.edge
                .handle_envelope(h.now, conn, envelope)
                .expect("open conn");
        }
        while let Some(event) = h.edge.poll_event() {
            if let EdgeEvent::Request { event, .. } = event {
                responder.handle_event(event);
            }
        }
        while let Some(out) = responder.poll_output() {
            if let Out::Data(data) = out {
                rendered += data.len();
            }
        }
    };
    deliver(
        &mut h,
        &mut responder,
        frame(0, TunnelFrameKind::Status, b""),
    );
    // Encoded beforehand, and each handed over as it is (a clone of a frozen buffer
    // allocates): the bytes a node link reads are not the Edge's allocations.
    let mut warm: Vec<Bytes> = (1..=2 * CHUNKS)
        .map(|sequence| frame(sequence, TunnelFrameKind::Body, EVENT))
        .collect();
    let measured = warm.split_off(CHUNKS as usize);
    for wire in warm {
        deliver(&mut h, &mut responder, wire);
    }
    let counted = allocations(|| {
        for wire in measured {
            deliver(&mut h, &mut responder, wire);
        }
    });
    assert_eq!(
        rendered,
        2 * CHUNKS as usize * EVENT.len(),
        "every chunk was passed through"
    );
    assert!(
        counted <= CHUNKS,
        "{counted} allocations for {CHUNKS} body chunks: more than the run id's one each"
    );
}
