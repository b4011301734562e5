//! A whole IOP exchange over real TCP sockets with no async runtime: a blocking Edge and
//! a blocking Node, each a plain `std::net` loop around its Sans-IO machine, serve one
//! chat completion end to end (register → configure → ready → run → response).
//!
//! ```text
//! cargo run -p iop-api --example blocking
//! ```
//!
//! Both loops have the same shape, the one every driver of these machines has:
//! 1. hand the machine its input (`handle_*`) with the current time;
//! 2. drain `poll_transmit` to the socket, then `poll_event`, acting on each event
//!    (acting may feed the machine again, so drain until both are empty);
//! 3. wait for bytes until `poll_timeout`, then call `handle_timeout`.
//!
//! The Edge here takes its one request from `main` instead of an HTTP server, and the
//! Node's "provider" answers from a string; everything between them is the real wire.

use std::error::Error;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use iop_api::openai::{self, Endpoint, Out, Responder, ResponseOptions};
use iop_proto_core::wire::{
    self, AdapterConfig, AdapterType, FrameDecoder, NodeRuntimeConfig, Usage,
};
use iop_proto_core::{
    CandidateSpec, ConnId, EdgeConfig, EdgeCore, EdgeEvent, ModelSpec, NodeSession, NodeSpec,
    NodeTransmit, Peer, RunOutput, SessionConfig, SessionEvent, Submit, Timestamp, TokenVerifier,
    Transmit,
};

const TOKEN: &str = "example-node-token-0123456789";
const ANSWER: &str = "Hello from a node driven by std::net.";

/// Milliseconds since the process started: the only clock the machines see.
#[derive(Clone, Copy)]
struct Clock(Instant);

impl Clock {
    fn now(self) -> Timestamp {
        Timestamp::from_millis(u64::try_from(self.0.elapsed().as_millis()).unwrap_or(u64::MAX))
    }

    /// How long a read may block before the machine's next deadline.
    fn until(self, wake: Option<Timestamp>) -> Duration {
        let now = self.now();
        let wait = wake.map_or(Duration::from_millis(200), |at| {
            Duration::from_millis(at.as_millis().saturating_sub(now.as_millis()))
        });
        wait.clamp(Duration::from_millis(1), Duration::from_millis(200))
    }
}

/// Reads what arrived within `wait`: `Ok(None)` on a timeout, `Ok(Some(empty))` at EOF.
fn read_some(stream: &mut TcpStream, wait: Duration) -> std::io::Result<Option<Bytes>> {
    stream.set_read_timeout(Some(wait))?;
    let mut buf = vec![0u8; 64 << 10];
    match stream.read(&mut buf) {
        Ok(n) => {
            buf.truncate(n);
            Ok(Some(Bytes::from(buf)))
        }
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Unix seconds, for the `created` field of the response.
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn edge_config() -> EdgeConfig {
    let mut config = EdgeConfig::default();
    config.nodes.insert(
        "node-1".into(),
        NodeSpec {
            token: TokenVerifier::from_secret(TOKEN.as_bytes()),
            adapters: vec![AdapterConfig {
                name: "mock".into(),
                r#type: AdapterType::Mock as i32,
                base_url: "mock://".into(),
                capacity: 1,
                targets: vec!["echo".into()],
                enabled: true,
                ..AdapterConfig::default()
            }],
            runtime: NodeRuntimeConfig::default(),
        },
    );
    config.models.insert(
        "demo".into(),
        ModelSpec {
            candidates: vec![CandidateSpec {
                node_id: "node-1".into(),
                provider_id: "mock".into(),
                target: "echo".into(),
            }],
            long_context_threshold: None,
            context_tokens: None,
            first_byte_timeout: None,
            resume_limit: None,
            stall_timeout: None,
            affinity: None,
        },
    );
    config
}

/// The Edge: accepts one node connection, submits `body` once the node is ready, and
/// returns the HTTP status and body the caller would get.
fn run_edge(
    listener: &TcpListener,
    body: &[u8],
    clock: Clock,
) -> Result<(u16, Bytes), Box<dyn Error>> {
    let mut edge = EdgeCore::new(edge_config())?;
    let asked = openai::inspect(body, Endpoint::Chat)?;
    let (mut stream, _) = listener.accept()?;
    stream.set_nodelay(true)?;
    let conn = ConnId(1);
    edge.handle_connection_opened(clock.now(), conn, Peer::default())?;
    let mut decoder = FrameDecoder::with_max_frame_len(edge.config().admission.pending_frame_len);
    let mut responder = None;
    loop {
        // Drain: transmits, then one event, until both are empty (acting on an event
        // may queue more transmits).
        loop {
            let mut out = BytesMut::new();
            while let Some(transmit) = edge.poll_transmit() {
                match transmit {
                    Transmit::Frame { envelope, .. } => wire::encode(&envelope, &mut out)?,
                    Transmit::Tunnel { dispatch, .. } => {
                        if let Some(body) =
                            dispatch.encode(&mut out, wire::DEFAULT_MAX_FRAME_LEN)?
                        {
                            out.extend_from_slice(&body);
                        }
                    }
                    Transmit::FrameLimit { max_frame_len, .. } => {
                        decoder.set_max_frame_len(max_frame_len);
                    }
                    Transmit::Close { reason, .. } => {
                        return Err(format!("edge closed the connection: {reason:?}").into());
                    }
                }
            }
            stream.write_all(&out)?;
            let Some(event) = edge.poll_event() else {
                break;
            };
            on_edge_event(&mut edge, event, body, &asked, &mut responder, clock.now())?;
        }
        if let Some(Out::Whole { status, body }) =
            responder.as_mut().and_then(Responder::poll_output)
        {
            // The response is complete: hang up on the node, as a stopping Edge would.
            stream.shutdown(Shutdown::Both)?;
            return Ok((status, body));
        }
        // Wait for bytes or the next deadline.
        let wait = clock.until(edge.poll_timeout().map(|w| w.at));
        match read_some(&mut stream, wait)? {
            None => {}
            Some(bytes) if bytes.is_empty() => {
                edge.handle_connection_closed(clock.now(), conn)?;
                return Err("the node hung up".into());
            }
            Some(bytes) => {
                decoder.push_bytes(bytes);
                while let Some(envelope) = decoder.next_envelope()? {
                    edge.handle_envelope(clock.now(), conn, envelope)?;
                }
            }
        }
        // Deadlines fall due whether or not bytes came.
        let now = clock.now();
        if edge.poll_timeout().is_some_and(|wake| wake.at <= now) {
            edge.handle_timeout(now);
        }
    }
}

/// What the Edge's driver does with each event of its machine.
fn on_edge_event(
    edge: &mut EdgeCore,
    event: EdgeEvent,
    body: &[u8],
    asked: &openai::RequestFacts,
    responder: &mut Option<Responder>,
    now: Timestamp,
) -> Result<(), Box<dyn Error>> {
    match event {
        EdgeEvent::NodeConnected { node_id, .. } => {
            println!("edge: {node_id} is ready; submitting the request");
            // The whole request: the machine dispatches it itself.
            let mut submit = Submit::chat(&asked.model, Bytes::copy_from_slice(body));
            submit.prompt_tokens = asked.prompt_tokens;
            submit.stream = asked.stream;
            let request = edge.handle_submit(now, submit)?;
            let run_id = iop_proto_core::edge::run_id_of(request);
            *responder = Some(Responder::new(ResponseOptions::new(
                asked,
                &run_id,
                unix_now(),
            )));
        }
        EdgeEvent::Request { event, .. } => {
            if let Some(r) = responder.as_mut() {
                r.handle_event(event);
            }
        }
        other => println!("edge: {other:?}"),
    }
    Ok(())
}

/// The Node: dials the Edge, registers, applies its config, and answers every run from
/// a fixed string, until the Edge hangs up.
fn run_node(edge_addr: SocketAddr, clock: Clock) -> Result<(), Box<dyn Error>> {
    let mut stream = TcpStream::connect(edge_addr)?;
    stream.set_nodelay(true)?;
    let mut session = NodeSession::new(SessionConfig::new("node-1", TOKEN));
    session.handle_connected(clock.now())?;
    let mut decoder = FrameDecoder::new();
    loop {
        // Drain: transmits, then one event, until both are empty.
        loop {
            let mut out = BytesMut::new();
            let mut closed = false;
            while let Some(transmit) = session.poll_transmit() {
                match transmit {
                    NodeTransmit::Frame(envelope) => wire::encode(&envelope, &mut out)?,
                    NodeTransmit::Close { end, .. } => {
                        println!("node: session ended: {end}");
                        closed = true;
                    }
                }
            }
            // Best effort: the Edge may already have hung up.
            let _ = stream.write_all(&out);
            if closed {
                return Ok(());
            }
            let Some(event) = session.poll_event() else {
                break;
            };
            on_node_event(&mut session, event, clock.now())?;
        }
        let wait = clock.until(session.poll_timeout().map(|w| w.at));
        match read_some(&mut stream, wait) {
            Ok(None) => {}
            Ok(Some(bytes)) if bytes.is_empty() => {
                let failure = iop_proto_core::Failure::EdgeClosed("edge hung up".into());
                session.handle_connection_lost(clock.now(), failure)?;
            }
            Ok(Some(bytes)) => {
                decoder.push_bytes(bytes);
                loop {
                    match decoder.next_envelope() {
                        Ok(Some(envelope)) => session.handle_envelope(clock.now(), envelope)?,
                        Ok(None) => break,
                        Err(err) => {
                            session.handle_undecodable(clock.now(), err)?;
                            break;
                        }
                    }
                }
            }
            Err(err) => {
                let failure = iop_proto_core::Failure::from_io(err.kind(), &err);
                session.handle_connection_lost(clock.now(), failure)?;
            }
        }
        let now = clock.now();
        if session.poll_timeout().is_some_and(|wake| wake.at <= now) {
            session.handle_timeout(now);
        }
    }
}

/// What the Node's driver does with each event of its session.
fn on_node_event(
    session: &mut NodeSession,
    event: SessionEvent,
    now: Timestamp,
) -> Result<(), Box<dyn Error>> {
    match event {
        SessionEvent::ApplyConfig { payload } => {
            println!("node: applying {} adapter(s)", payload.adapters.len());
            session.handle_config_applied(now, Ok(()))?;
        }
        SessionEvent::StartRun { request } => {
            // A real adapter calls its provider here, on its own thread or task.
            let id = request.run_id;
            session.handle_run_output(now, &id, RunOutput::Start)?;
            for word in ANSWER.split_inclusive(' ') {
                session.handle_run_output(now, &id, RunOutput::Delta(word.into()))?;
            }
            let usage = Usage {
                prompt_tokens: 8,
                completion_tokens: 7,
                total_tokens: 15,
            };
            session.handle_run_output(
                now,
                &id,
                RunOutput::Complete {
                    usage: Some(usage),
                    metadata: Default::default(),
                },
            )?;
        }
        other => println!("node: {other:?}"),
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn Error>> {
    let clock = Clock(Instant::now());
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let node = std::thread::spawn(move || run_node(addr, clock).map_err(|e| e.to_string()));
    let body = br#"{"model":"demo","messages":[{"role":"user","content":"Say hello."}]}"#;
    let (status, response) = run_edge(&listener, body, clock)?;
    node.join().map_err(|_| "the node thread panicked")??;
    println!("HTTP {status}\n{}", String::from_utf8_lossy(&response));
    let parsed: serde_json::Value = serde_json::from_slice(&response)?;
    if status != 200 || parsed["choices"][0]["message"]["content"] != ANSWER {
        return Err("the response is not the node's answer".into());
    }
    Ok(())
}
