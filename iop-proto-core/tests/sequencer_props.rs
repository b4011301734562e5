//! Properties of the run and tunnel sequencers and of the reconnect policy.

use bytes::Bytes;
use iop_proto_core::testkit::internals::*;
use iop_proto_core::wire::*;
use iop_proto_core::*;
use proptest::collection::vec;
use proptest::prelude::*;

fn run_kind() -> impl Strategy<Value = i32> {
    prop_oneof![8 => 1..=5i32, 1 => prop_oneof![Just(0), Just(6), Just(-3)]]
}

/// Reference grammar of a run: START, DELTA*, one terminal, sequence strictly increasing.
fn valid_run_prefix(events: &[(i32, u64)]) -> bool {
    for (i, &(kind, seq)) in events.iter().enumerate() {
        if i > 0 && seq <= events[i - 1].1 {
            return false;
        }
        let ok = match (i, kind) {
            (0, 1) => true,
            (0, _) => false,
            (_, 2) => true,
            (_, 3..=5) => true,
            _ => false,
        };
        if !ok {
            return false;
        }
        if i > 0 && matches!(events[i - 1].0, 3..=5) {
            return false;
        }
    }
    true
}

fn tunnel_kind() -> impl Strategy<Value = i32> {
    prop_oneof![8 => 1..=6i32, 1 => prop_oneof![Just(0), Just(7)]]
}

/// Reference grammar of a tunnel: sequence 0,1,2..; STATUS (valid code) or ERROR first;
/// then HEADERS/BODY/USAGE; one END or ERROR last.
fn valid_tunnel_prefix(frames: &[(i32, u64, u32)]) -> bool {
    for (i, &(kind, seq, status)) in frames.iter().enumerate() {
        if seq != i as u64 {
            return false;
        }
        if i > 0 && matches!(frames[i - 1].0, 5 | 6) {
            return false;
        }
        let ok = match (i, kind) {
            (0, 1) => (100..=599).contains(&status),
            (0, 6) => true,
            (0, _) => false,
            (_, 2..=6) => true,
            _ => false,
        };
        if !ok {
            return false;
        }
    }
    true
}

#[derive(Clone, Debug)]
enum TunnelOp {
    Status(u32),
    Body(Vec<u8>),
    Headers,
    Usage,
    End,
    Error,
}

fn tunnel_op() -> impl Strategy<Value = TunnelOp> {
    prop_oneof![
        (0u32..700).prop_map(TunnelOp::Status),
        vec(any::<u8>(), 0..300).prop_map(TunnelOp::Body),
        Just(TunnelOp::Headers),
        Just(TunnelOp::Usage),
        Just(TunnelOp::End),
        Just(TunnelOp::Error),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    /// The run tracker accepts exactly the valid prefixes, and nothing after a refusal.
    #[test]
    fn run_tracker_accepts_exactly_valid_sequences(
        events in vec((run_kind(), 0u64..12), 0..10)
    ) {
        let mut tracker = RunTracker::new();
        let mut refused = false;
        for n in 0..events.len() {
            let (kind, sequence) = events[n];
            let event = RunEvent { run_id: "r".into(), sequence, r#type: kind, ..Default::default() };
            let accepted = tracker.observe(&event).is_ok();
            if refused {
                prop_assert!(!accepted, "accepted an event after a refusal");
                continue;
            }
            prop_assert_eq!(accepted, valid_run_prefix(&events[..=n]), "at {} of {:?}", n, events);
            refused = !accepted;
        }
    }

    /// The tunnel receiver accepts exactly the valid prefixes, and nothing after a refusal.
    #[test]
    fn tunnel_receiver_accepts_exactly_valid_sequences(
        frames in vec((tunnel_kind(), 0u64..8, prop_oneof![Just(200u32), Just(99), Just(600), 100u32..600]), 0..9)
    ) {
        let mut receiver = TunnelReceiver::new();
        let mut refused = false;
        for n in 0..frames.len() {
            let (kind, sequence, status_code) = frames[n];
            let frame = ProviderTunnelFrame { run_id: "t".into(), sequence, kind, status_code, ..Default::default() };
            let accepted = receiver.observe(&frame).is_ok();
            if refused {
                prop_assert!(!accepted);
                continue;
            }
            prop_assert_eq!(accepted, valid_tunnel_prefix(&frames[..=n]), "at {} of {:?}", n, frames);
            refused = !accepted;
        }
    }

    /// Whatever the adapter does, the emitter only produces sequences the receiver accepts.
    #[test]
    fn emitter_output_is_always_accepted(ops in vec(tunnel_op(), 0..20), chunk in 1usize..64) {
        let mut emitter = TunnelEmitter::new("t", chunk);
        let mut receiver = TunnelReceiver::new();
        for op in ops {
            let frames: Vec<ProviderTunnelFrame> = match op {
                TunnelOp::Status(code) => emitter.status(code, Vec::new()).into_iter().collect(),
                TunnelOp::Body(data) => emitter.body(Bytes::from(data)).collect(),
                TunnelOp::Headers => emitter.headers(Vec::new()).into_iter().collect(),
                TunnelOp::Usage => emitter.usage(Usage::default()).into_iter().collect(),
                TunnelOp::End => emitter.end().into_iter().collect(),
                TunnelOp::Error => emitter.error(ErrorDetail::default()).into_iter().collect(),
            };
            for frame in frames {
                prop_assert!(frame.body.len() <= chunk);
                prop_assert!(receiver.observe(&frame).is_ok(), "refused {:?}", frame);
            }
        }
        prop_assert_eq!(emitter.is_ended(), receiver.is_ended());
    }

    /// Whatever the adapter does, merging its frames as a node does (each into the frame
    /// before it, where the merge rule allows) and splitting them as an Edge does gives
    /// back exactly the frames it made, in order; no merged frame holds a chunk larger
    /// than the chunk size, and the merged frames are never more than the parts.
    #[test]
    fn merged_frames_split_back_into_the_frames_merged(
        ops in vec(tunnel_op(), 0..20),
        chunk in 1usize..64,
        flush in vec(any::<bool>(), 20),
    ) {
        let mut emitter = TunnelEmitter::new("t", chunk);
        let mut parts = Vec::new();
        let mut merged: Vec<ProviderTunnelFrame> = Vec::new();
        // Frames already sent (the shell drained) are not merged into any more.
        let mut sent = 0;
        for (op, flush) in ops.into_iter().zip(flush) {
            let frames: Vec<ProviderTunnelFrame> = match op {
                TunnelOp::Status(code) => emitter.status(code, Vec::new()).into_iter().collect(),
                TunnelOp::Body(data) => emitter.body(Bytes::from(data)).collect(),
                TunnelOp::Headers => emitter.headers(Vec::new()).into_iter().collect(),
                TunnelOp::Usage => emitter.usage(Usage { prompt_tokens: 1, ..Usage::default() }).into_iter().collect(),
                TunnelOp::End => emitter.end().into_iter().collect(),
                TunnelOp::Error => emitter.error(ErrorDetail::default()).into_iter().collect(),
            };
            for frame in frames {
                parts.push(frame.clone());
                let open = merged.len() > sent;
                let frame = match merged.last_mut() {
                    Some(last) if open => match tunnel::merge_into(last, frame) {
                        None => continue,
                        Some(frame) => frame,
                    },
                    _ => frame,
                };
                merged.push(frame);
            }
            if flush {
                sent = merged.len();
            }
        }
        prop_assert!(merged.len() <= parts.len());
        let mut receiver = TunnelReceiver::new();
        let mut split = Vec::new();
        for frame in merged {
            prop_assert!(frame.body.len() <= chunk);
            let count = tunnel::part_count(&frame);
            let before = split.len();
            split.extend(tunnel::split(frame));
            prop_assert_eq!(split.len() - before, count as usize);
        }
        for part in &split {
            prop_assert!(receiver.observe(part).is_ok(), "refused {:?}", part);
        }
        prop_assert_eq!(split, parts);
    }

    /// Any frame a peer may send splits into parts each of one kind alone (no part is
    /// merged again), numbered on from its sequence, as many as `part_count` says; the
    /// Edge's parts (`split_parts`) are those frames as it keeps them, each checked by
    /// the receiver as its frame is.
    #[test]
    fn any_frame_splits_into_plain_parts(
        kind in 0..8i32,
        sequence in prop_oneof![Just(0u64), any::<u64>()],
        status_code in prop_oneof![Just(0u32), Just(200), Just(429), Just(1000)],
        body in vec(any::<u8>(), 0..4),
        usage in any::<bool>(),
        end in any::<bool>(),
        headers in any::<bool>(),
        metadata in any::<bool>(),
        error in any::<bool>(),
    ) {
        let frame = ProviderTunnelFrame {
            run_id: "t".into(),
            sequence,
            kind,
            status_code,
            headers: if headers {
                vec![Header { name: "retry-after".into(), value: Bytes::from_static(b"1") }]
            } else {
                Vec::new()
            },
            metadata: if metadata {
                [("k".to_owned(), "v".to_owned())].into()
            } else {
                Default::default()
            },
            body: Bytes::from(body.clone()),
            usage: usage.then(Usage::default),
            error: error.then(ErrorDetail::default),
            end,
        };
        let count = tunnel::part_count(&frame);
        let parts: Vec<_> = tunnel::split(frame.clone()).collect();
        prop_assert_eq!(parts.len() as u64, count);
        if count == 1 {
            prop_assert_eq!(&parts[0], &frame);
        }
        let mut total = 0;
        for (i, part) in parts.iter().enumerate() {
            prop_assert_eq!(tunnel::part_count(part), 1);
            prop_assert_eq!(part.sequence, sequence.saturating_add(i as u64));
            prop_assert_eq!(&part.run_id, "t");
            total += part.body.len();
        }
        prop_assert_eq!(total, body.len());
        // As the Edge keeps them: each part a `TunnelPart` of its frame, a kept whole
        // frame without the name when it was merged; a plain frame keeps it.
        let kept: Vec<_> = tunnel::split_parts(frame).collect();
        let expected: Vec<_> = parts
            .iter()
            .cloned()
            .map(|mut part| {
                if count > 1 {
                    part.run_id.clear();
                }
                (part.sequence, tunnel::TunnelPart::from(part))
            })
            .collect();
        prop_assert_eq!(&kept, &expected);
        // The receiver judges a part as it judges its frame.
        let (mut by_frame, mut by_part) = (TunnelReceiver::new(), TunnelReceiver::new());
        for (part, (sequence, kept)) in parts.iter().zip(&kept) {
            prop_assert_eq!(by_frame.observe(part), by_part.observe_part(*sequence, kept));
            prop_assert_eq!(by_frame.is_ended(), by_part.is_ended());
        }
    }

    /// Chunking reassembles the exact body for any body and chunk size.
    #[test]
    fn chunking_reassembles_the_exact_body(body in vec(any::<u8>(), 0..5000), chunk in 1usize..700) {
        let mut emitter = TunnelEmitter::new("t", chunk);
        emitter.status(200, Vec::new()).expect("status first");
        let frames: Vec<_> = emitter.body(Bytes::from(body.clone())).collect();
        prop_assert_eq!(frames.len(), body.len().div_ceil(chunk));
        let mut joined = Vec::new();
        for (i, frame) in frames.iter().enumerate() {
            prop_assert_eq!(frame.sequence, i as u64 + 1);
            prop_assert!(!frame.body.is_empty() && frame.body.len() <= chunk);
            joined.extend_from_slice(&frame.body);
        }
        prop_assert_eq!(joined, body);
    }

    /// A finite policy makes exactly `max_attempts` dial attempts, never more, whatever
    /// mix of dial failures and sessions that end before ready it meets.
    #[test]
    fn finite_policy_makes_exactly_max_attempts(
        max in 1i64..40,
        outcomes in vec(any::<bool>(), 40),
        interval_ms in 0u64..5000,
    ) {
        let policy = ReconnectPolicy::from_config(Some(max), Some(interval_ms as f64 / 1000.0)).expect("valid");
        let mut s = Supervisor::new(policy);
        let mut now = Timestamp::ZERO;
        s.handle_start(now).expect("idle");
        let mut dials = 0i64;
        let mut exit = None;
        for connects in outcomes.iter().cycle().take(200) {
            while let Some(action) = s.poll_event() {
                match action {
                    SupervisorEvent::Dial { attempt } => {
                        dials += 1;
                        prop_assert_eq!(i64::from(attempt), dials);
                    }
                    SupervisorEvent::Exit(reason) => exit = Some(reason),
                }
            }
            if exit.is_some() {
                break;
            }
            if *connects {
                s.handle_connected(now).expect("dialing");
                s.handle_failure(now, Failure::EdgeClosed("ready refused".into())).expect("connected");
            } else {
                s.handle_failure(now, Failure::Refused).expect("dialing");
            }
            if let Some(at) = s.poll_timeout().map(|w| w.at) {
                prop_assert_eq!(at.saturating_duration_since(now).as_millis() as u64, interval_ms);
                now = at;
                s.handle_timeout(now);
            }
        }
        prop_assert_eq!(dials, max);
        let reason = exit.expect("exited");
        let exhausted = matches!(reason, ExitReason::Exhausted { .. });
        prop_assert!(exhausted, "{:?}", reason);
        prop_assert_eq!(reason.exit_code(), 1);
    }
}
