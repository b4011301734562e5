//! Unit tests of `driver`.

use super::*;
use iop_proto_core::wire::{AdapterType, NodeConfigPayload};

/// The next frame the node wrote to `edge`.
async fn next_frame(edge: &mut tokio::io::DuplexStream, decoder: &mut FrameDecoder) -> wire::Body {
    loop {
        if let Some(envelope) = decoder.next_envelope().expect("a frame") {
            return envelope.body.expect("a body");
        }
        let mut buf = BytesMut::with_capacity(4096);
        let n = edge.read_buf(&mut buf).await.expect("read");
        assert!(n > 0, "the node hung up");
        decoder.push_bytes(buf.freeze());
    }
}

/// Writes `bodies` to the node in one write.
async fn send(edge: &mut tokio::io::DuplexStream, bodies: Vec<wire::Body>) {
    let mut out = BytesMut::new();
    for body in bodies {
        wire::encode(&wire::Envelope::new(body), &mut out).expect("encodes");
    }
    edge.write_all(&out).await.expect("write");
}

/// A mock adapter named `name` serving target `t`.
fn mock(name: &str, capacity: u32) -> wire::AdapterConfig {
    wire::AdapterConfig {
        name: name.into(),
        r#type: AdapterType::Mock as i32,
        capacity,
        targets: vec!["t".into()],
        enabled: true,
        ..Default::default()
    }
}

/// A run that arrives in the same read as the Edge's re-home is admitted there: it
/// must be on the node's board when the session hands back to the supervisor, before
/// the re-homed session's own task or any other session runs, or another session
/// gives its slot away and the provider sees more than its capacity (seen once in
/// about 60 runs of the cluster test: five at once against four).
#[tokio::test(flavor = "current_thread")]
async fn work_admitted_with_the_rehome_is_on_the_board_before_the_supervisor_dials() {
    let ctx = Context {
        clock: Clock::new(),
        stats: Arc::default(),
        http: crate::adapters::http::client(None).expect("client"),
        request_timeout: Duration::from_secs(5),
        started: tokio::time::Instant::now(),
        drain_grace: Duration::from_secs(5),
        elsewhere: Elsewhere::default(),
        members: None,
        seed: true,
    };
    // Another session of the node: what it takes in from the board.
    let other = ctx.elsewhere.join();
    let mut config = SessionConfig::new("n1", "a-token-long-enough");
    config.rehome = true;
    let mut supervisor = Supervisor::new(iop_proto_core::ReconnectPolicy::default());
    supervisor.handle_start(ctx.clock.now()).expect("starts");
    while supervisor.poll_event().is_some() {}
    supervisor
        .handle_connected(ctx.clock.now())
        .expect("connects");
    let stop = Stop::default();
    let (node, mut edge) = tokio::io::duplex(1 << 16);
    let fake_edge = async move {
        let mut decoder = FrameDecoder::new();
        assert!(matches!(
            next_frame(&mut edge, &mut decoder).await,
            wire::Body::RegisterRequest(_)
        ));
        let config = NodeConfigPayload {
            revision: 1,
            adapters: vec![mock("a", 4)],
            runtime: None,
        };
        let accepted = wire::RegisterResponse {
            accepted: true,
            node_id: "n1".into(),
            config: Some(config),
            heartbeat_interval_ms: 60_000,
            load_reports: true,
            ..Default::default()
        };
        send(&mut edge, vec![wire::Body::RegisterResponse(accepted)]).await;
        while !matches!(
            next_frame(&mut edge, &mut decoder).await,
            wire::Body::NodeReadyRequest(_)
        ) {}
        let ready = wire::NodeReadyResponse {
            ready: true,
            reason: String::new(),
        };
        send(&mut edge, vec![wire::Body::NodeReadyResponse(ready)]).await;
        // One write: a run, then the re-home.
        let run = wire::RunRequest {
            run_id: "run-1".into(),
            adapter: "a".into(),
            target: "t".into(),
            ..Default::default()
        };
        let rehome = wire::NodeRehomeRequest {
            reason: "handing over".into(),
        };
        send(
            &mut edge,
            vec![
                wire::Body::RunRequest(run),
                wire::Body::NodeRehomeRequest(rehome),
            ],
        )
        .await;
        edge
    };
    let (ended, _edge) = tokio::join!(run(node, config, &ctx, &mut supervisor, &stop), fake_edge);
    // Nothing has yielded since the session returned.
    assert!(matches!(ended, Ended::Rehomed), "{ended:?}");
    let held = ctx.elsewhere.held_for(other);
    assert_eq!(
        held.iter()
            .map(|l| (l.adapter.as_str(), l.in_flight))
            .collect::<Vec<_>>(),
        [("a", 1)],
        "what the other session takes in"
    );
}

#[tokio::test]
async fn an_adapter_that_panics_still_reports_that_its_work_returned() {
    let client = crate::adapters::http::client(None).expect("client");
    let mut host = AdapterHost::new(client, Duration::from_secs(1));
    host.apply(&NodeConfigPayload {
        adapters: vec![mock("m", 1)],
        ..Default::default()
    })
    .expect("a mock adapter applies");
    let (tx, mut rx) = mpsc::channel(8);
    let mut tasks = HashMap::new();
    spawn_work(
        host.get("m"),
        &mut tasks,
        &tx,
        "run-1".into(),
        |_, _, _| async {
            panic!("an adapter bug");
        },
    );
    // A panic on a later poll, after the work waited once, is caught as well.
    spawn_work(
        host.get("m"),
        &mut tasks,
        &tx,
        "run-2".into(),
        |_, _, _| async {
            tokio::task::yield_now().await;
            panic!("an adapter bug after a wait");
        },
    );
    let mut finished = Vec::new();
    for _ in 0..2 {
        let output = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("an output in time");
        match output {
            Some(Output::Finished { run_id, tail: None }) => finished.push(run_id.to_string()),
            other => panic!("{other:?}"),
        }
    }
    finished.sort();
    assert_eq!(finished, ["run-1", "run-2"]);
    assert!(
        tasks.contains_key("run-1") && tasks.contains_key("run-2"),
        "still listed: the session closes them"
    );
}

/// The read buffer is renewed only when little room is left: while frames read earlier
/// still hold slices of it (a tunnel's body), it is read into where it left off rather
/// than replaced by a new block at every read; a block nobody else holds is reclaimed.
#[test]
fn the_read_buffer_is_used_up_before_a_new_block_is_taken() {
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    read_room(&mut buf);
    let block = buf.as_ptr();
    assert!(buf.capacity() >= READ_CHUNK);

    // A small frame read and handed on, still held.
    buf.extend_from_slice(&[7u8; 600]);
    let held = buf.split().freeze();
    read_room(&mut buf);
    assert_eq!(
        buf.as_ptr(),
        held.as_ptr().wrapping_add(600),
        "the next read goes on in the same block"
    );
    assert!(buf.capacity() >= READ_ROOM_MIN);

    // Read up to less than the least room: a new block, as the old one is held.
    let fill = buf.capacity() - READ_ROOM_MIN + 1;
    buf.extend_from_slice(&vec![1u8; fill]);
    let rest = buf.split().freeze();
    read_room(&mut buf);
    assert!(buf.capacity() >= READ_CHUNK);
    let renewed = buf.as_ptr();
    assert!(
        renewed < block || renewed >= block.wrapping_add(READ_CHUNK),
        "a held block is not written over"
    );
    assert_eq!(&held[..], &[7u8; 600][..]);
    assert!(rest.iter().all(|&b| b == 1));

    // Nothing holds the new block: once its room runs low it is reclaimed in place.
    buf.extend_from_slice(&vec![2u8; buf.capacity() - READ_ROOM_MIN + 1]);
    drop(buf.split());
    read_room(&mut buf);
    assert_eq!(
        buf.as_ptr(),
        renewed,
        "a block nobody holds is read into again"
    );
    assert!(buf.capacity() >= READ_CHUNK);
}
