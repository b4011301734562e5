//! The node listener: one reader and one writer task per connection, around the core
//! task. A connection that sends garbage, an oversized length or only a header is closed
//! on its own; everyone else keeps being served.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use iop_proto_core::ConnId;
use iop_proto_core::wire::FrameDecoder;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::core_task::CoreMsg;
use crate::metrics::Metrics;

/// Accepts node connections until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    core: mpsc::Sender<CoreMsg>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let mut next = 1u64;
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let conn = ConnId(next);
                next += 1;
                debug!(conn = conn.0, %peer, "node connection accepted");
                let _ = stream.set_nodelay(true);
                tokio::spawn(connection(
                    stream,
                    conn,
                    core.clone(),
                    metrics.clone(),
                    shutdown.clone(),
                ));
            }
            Err(err) => {
                warn!(%err, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

async fn write_loop(
    mut writer: tokio::net::tcp::OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Bytes>,
) {
    let mut batch = BytesMut::new();
    while let Some(first) = rx.recv().await {
        batch.extend_from_slice(&first);
        while batch.len() < (1 << 20) {
            match rx.try_recv() {
                Ok(more) => batch.extend_from_slice(&more),
                Err(_) => break,
            }
        }
        if writer.write_all(&batch).await.is_err() {
            return;
        }
        batch.clear();
    }
    let _ = writer.shutdown().await;
}

async fn connection(
    stream: TcpStream,
    conn: ConnId,
    core: mpsc::Sender<CoreMsg>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let (mut reader, writer) = stream.into_split();
    let (wtx, wrx) = mpsc::unbounded_channel();
    let closer = CancellationToken::new();
    tokio::spawn(write_loop(writer, wrx));
    if core
        .send(CoreMsg::ConnOpened {
            conn,
            writer: wtx,
            closer: closer.clone(),
        })
        .await
        .is_err()
    {
        return;
    }
    let mut decoder = FrameDecoder::new();
    let mut buf = BytesMut::with_capacity(64 << 10);
    'read: loop {
        buf.reserve(64 << 10);
        let read = tokio::select! {
            () = closer.cancelled() => break,
            () = shutdown.cancelled() => break,
            read = reader.read_buf(&mut buf) => read,
        };
        match read {
            Ok(0) => {
                if let Err(err) = decoder.finish() {
                    info!(conn = conn.0, %err, "node connection ended mid-frame");
                }
                break;
            }
            Ok(n) => {
                Metrics::add(&metrics.bytes_in, n as u64);
                decoder.push_bytes(buf.split().freeze());
                loop {
                    match decoder.next_envelope() {
                        Ok(Some(envelope)) => {
                            Metrics::add(&metrics.frames_in, 1);
                            if core.send(CoreMsg::Frame { conn, envelope }).await.is_err() {
                                break 'read;
                            }
                        }
                        Ok(None) => break,
                        Err(err) => {
                            warn!(conn = conn.0, %err, "closing node connection: undecodable input");
                            break 'read;
                        }
                    }
                }
            }
            Err(err) => {
                debug!(conn = conn.0, %err, "node connection read failed");
                break;
            }
        }
    }
    let _ = core.send(CoreMsg::ConnClosed { conn }).await;
}
