//! A node written from the wire contract alone, driven step by step by a test: it can
//! register, report ready, and then send exactly what a test wants, right or wrong. A
//! background task answers the Edge's heartbeats, so a test may take its time between
//! steps without the Edge fencing the connection.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use iop_proto_core::wire::{
    self, Body, Envelope, FrameDecoder, NodeReadyRequest, RegisterRequest, RegisterResponse,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::client::Cluster;

/// A hand-driven node connection.
#[derive(Debug)]
pub struct Rogue {
    outgoing: mpsc::UnboundedSender<Body>,
    incoming: mpsc::UnboundedReceiver<Body>,
}

impl Rogue {
    /// Opens a TLS connection to `cluster`'s node listener, trusting its certificate.
    pub async fn connect(cluster: &Cluster) -> Rogue {
        let connector =
            crate::client::connector_trusting(&cluster.dir.path().join("edge-cert.pem"));
        // The Edge binds its node listener before its HTTP one, which `Cluster::start`
        // waited for; a refusal is retried briefly and then reported with the Edge's log.
        let mut tries = 0;
        let tcp = loop {
            match TcpStream::connect(("127.0.0.1", cluster.node_port)).await {
                Ok(tcp) => break tcp,
                Err(_) if tries < 40 => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                Err(err) => panic!(
                    "connect to the node port {}: {err}\n----- edge log -----\n{}",
                    cluster.node_port,
                    cluster.edge.log()
                ),
            }
        };
        let name = rustls_pki_types::ServerName::try_from("localhost").expect("name");
        let stream = connector.connect(name, tcp).await.expect("handshake");
        let (mut reader, mut writer) = tokio::io::split(stream);
        let (outgoing, mut to_write) = mpsc::unbounded_channel::<Body>();
        let (deliver, incoming) = mpsc::unbounded_channel::<Body>();
        let pong = outgoing.clone();
        tokio::spawn(async move {
            while let Some(body) = to_write.recv().await {
                let mut out = BytesMut::new();
                wire::encode(&Envelope::new(body), &mut out).expect("encode");
                if writer.write_all(&out).await.is_err() || writer.flush().await.is_err() {
                    return;
                }
            }
        });
        tokio::spawn(async move {
            let mut decoder = FrameDecoder::new();
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let n = match reader.read(&mut buf).await {
                    Ok(n) if n > 0 => n,
                    _ => return, // dropping `deliver` tells the test the link closed
                };
                decoder.push_bytes(Bytes::copy_from_slice(&buf[..n]));
                while let Ok(Some(envelope)) = decoder.next_envelope() {
                    let Some(body) = envelope.body else { continue };
                    let sent = match body {
                        Body::Heartbeat(ping) => pong
                            .send(Body::HeartbeatAck(wire::HeartbeatAck {
                                nonce: ping.nonce,
                                echo_sent_at_ms: ping.sent_at_ms,
                            }))
                            .is_ok(),
                        body => deliver.send(body).is_ok(),
                    };
                    if !sent {
                        return;
                    }
                }
            }
        });
        Rogue { outgoing, incoming }
    }

    /// Connects, registers as `node_id` and reports ready; returns the register answer.
    pub async fn ready(cluster: &Cluster, node_id: &str, token: &str) -> (Rogue, RegisterResponse) {
        let mut rogue = Rogue::connect(cluster).await;
        let answer = rogue.register(node_id, token).await;
        assert!(answer.accepted, "register refused: {answer:?}");
        rogue.send(Body::NodeReadyRequest(NodeReadyRequest {
            node_id: node_id.into(),
            held_elsewhere: Vec::new(),
        }));
        match rogue
            .recv_until(|b| matches!(b, Body::NodeReadyResponse(_)))
            .await
        {
            Some(Body::NodeReadyResponse(r)) if r.ready => {}
            other => panic!("not ready: {other:?}"),
        }
        (rogue, answer)
    }

    /// Sends a register and returns the answer.
    pub async fn register(&mut self, node_id: &str, token: &str) -> RegisterResponse {
        self.send(Body::RegisterRequest(RegisterRequest {
            node_id: node_id.into(),
            token: token.into(),
            version: "rogue".into(),
            ..RegisterRequest::default()
        }));
        match self
            .recv_until(|b| matches!(b, Body::RegisterResponse(_)))
            .await
        {
            Some(Body::RegisterResponse(r)) => r,
            other => panic!("no register answer: {other:?}"),
        }
    }

    /// Queues one frame; false once the link is closed.
    pub fn send(&self, body: Body) -> bool {
        self.outgoing.send(body).is_ok()
    }

    /// The next message other than a heartbeat; `None` when the Edge closed the
    /// connection or nothing came within 10 s.
    pub async fn recv(&mut self) -> Option<Body> {
        self.recv_within(Duration::from_secs(10)).await
    }

    /// [`Rogue::recv`] with a chosen timeout.
    pub async fn recv_within(&mut self, timeout: Duration) -> Option<Body> {
        tokio::time::timeout(timeout, self.incoming.recv())
            .await
            .ok()
            .flatten()
    }

    /// Messages until one matches `want` (which is returned), or `None`.
    pub async fn recv_until(&mut self, want: impl Fn(&Body) -> bool) -> Option<Body> {
        loop {
            let body = self.recv().await?;
            if want(&body) {
                return Some(body);
            }
        }
    }
}
