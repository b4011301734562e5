//! Span export over OTLP/HTTP: the request handlers hand finished spans
//! ([`iop_trace::Span`]) to a bounded queue, and one task sends them to the
//! collector in batches (up to [`BATCH`] spans, or what arrived within [`LINGER`] of the
//! first), protobuf or JSON as configured. A collector that is slow or down never slows a
//! request: when the queue is full spans are dropped and counted, and a batch the collector
//! refuses is logged (the endpoint and status, never the headers) and dropped.
//!
//! Ids: trace and span ids come from a per-process random seed and a counter, mixed
//! (SplitMix64), so they are unique within the process, look random to a trace viewer,
//! and cost no system call.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use iop_trace::{IdSource, Span, encode_json, encode_protobuf};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::TraceExport;

/// Most spans sent in one export.
pub const BATCH: usize = 512;
/// How long a batch waits for more spans after its first.
pub const LINGER: Duration = Duration::from_millis(500);
/// Requests' span sets queued for export at most; more are dropped.
pub const QUEUE: usize = 4096;
/// How long one export may take.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where finished spans go.
#[derive(Debug)]
pub struct Tracer {
    tx: Option<mpsc::Sender<Vec<Span>>>,
    /// New traces sampled, out of `u64::MAX`.
    sample_below: u64,
    seed: u64,
    next: AtomicU64,
    dropped: AtomicU64,
}

impl Tracer {
    /// A tracer that exports nothing (no endpoint configured).
    #[must_use]
    pub fn disabled() -> Arc<Self> {
        Arc::new(Tracer {
            tx: None,
            sample_below: 0,
            seed: iop_shell_common::process::nonce(),
            next: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        })
    }

    /// A tracer exporting to `export`'s collector until `stop` (then what is queued is
    /// sent, within a few seconds).
    #[must_use]
    pub fn start(export: TraceExport, stop: CancellationToken) -> Arc<Self> {
        let (tx, rx) = mpsc::channel(QUEUE);
        // The ratio is checked at load to be within 0..=1.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let sample_below = if export.sample_ratio >= 1.0 {
            u64::MAX
        } else {
            (export.sample_ratio * u64::MAX as f64) as u64
        };
        let tracer = Arc::new(Tracer {
            tx: Some(tx),
            sample_below,
            seed: iop_shell_common::process::nonce(),
            next: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        });
        info!(
            endpoint = %export.endpoint,
            protocol = if export.json { "http/json" } else { "http/protobuf" },
            service = export.service_name,
            sample_ratio = export.sample_ratio,
            "exporting traces over OTLP"
        );
        tokio::spawn(send_loop(export, rx, stop, tracer.clone()));
        tracer
    }

    fn mixed(&self) -> u64 {
        // SplitMix64 of seed + counter: distinct for 2^64 calls, evenly spread.
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let mut z = self
            .seed
            .wrapping_add(n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Queues one request's spans for export; dropped (and counted) when the queue is
    /// full.
    pub fn export(&self, spans: Vec<Span>) {
        if let Some(tx) = &self.tx
            && tx.try_send(spans).is_err()
        {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl IdSource for Tracer {
    fn recording(&self) -> bool {
        self.tx.is_some()
    }

    /// `sample_ratio` of the traces this Edge starts.
    fn sample(&self) -> bool {
        self.tx.is_some() && (self.sample_below == u64::MAX || self.mixed() < self.sample_below)
    }

    fn span_id(&self) -> [u8; 8] {
        loop {
            let id = self.mixed();
            if id != 0 {
                return id.to_be_bytes();
            }
        }
    }

    fn trace_id(&self) -> [u8; 16] {
        let mut id = [0u8; 16];
        id[..8].copy_from_slice(&self.span_id());
        id[8..].copy_from_slice(&self.span_id());
        id
    }
}

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

fn client() -> HttpsClient {
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http()
        .enable_http1()
        .build();
    Client::builder(TokioExecutor::new()).build(https)
}

async fn send_loop(
    export: TraceExport,
    mut rx: mpsc::Receiver<Vec<Span>>,
    stop: CancellationToken,
    tracer: Arc<Tracer>,
) {
    let client = client();
    let mut failing_since: Option<Instant> = None;
    let mut reported_drops = 0;
    loop {
        let first = tokio::select! {
            got = rx.recv() => got,
            () = stop.cancelled() => None,
        };
        let Some(first) = first else { break };
        let mut batch = first;
        let linger = tokio::time::sleep(LINGER);
        tokio::pin!(linger);
        while batch.len() < BATCH {
            tokio::select! {
                more = rx.recv() => match more {
                    Some(more) => batch.extend(more),
                    None => break,
                },
                () = &mut linger => break,
                () = stop.cancelled() => break,
            }
        }
        send(&client, &export, &batch, &mut failing_since).await;
        let dropped = tracer.dropped.load(Ordering::Relaxed);
        if dropped != reported_drops {
            warn!(
                dropped = dropped - reported_drops,
                "trace export queue full: spans of some requests were dropped"
            );
            reported_drops = dropped;
        }
    }
    // Stopping: what is queued goes out, briefly.
    rx.close();
    let mut rest = Vec::new();
    while let Ok(more) = rx.try_recv() {
        rest.extend(more);
    }
    for chunk in rest.chunks(BATCH) {
        send(&client, &export, chunk, &mut failing_since).await;
    }
}

async fn send(
    client: &HttpsClient,
    export: &TraceExport,
    spans: &[Span],
    failing_since: &mut Option<Instant>,
) {
    let version = env!("CARGO_PKG_VERSION");
    let (body, content_type) = if export.json {
        (
            encode_json(&export.service_name, version, spans),
            "application/json",
        )
    } else {
        (
            encode_protobuf(&export.service_name, version, spans),
            "application/x-protobuf",
        )
    };
    let mut request = http::Request::post(export.endpoint.clone())
        .header(http::header::CONTENT_TYPE, content_type)
        .header(
            http::header::USER_AGENT,
            concat!("iop-edge/", env!("CARGO_PKG_VERSION")),
        );
    for (name, value) in &export.headers {
        request = request.header(name.as_str(), value.as_str());
    }
    let Ok(request) = request.body(Full::new(Bytes::from(body))) else {
        return;
    };
    let outcome = match tokio::time::timeout(EXPORT_TIMEOUT, client.request(request)).await {
        Ok(Ok(response)) if response.status().is_success() => Ok(()),
        Ok(Ok(response)) => Err(format!("answered {}", response.status())),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no answer within {} s", EXPORT_TIMEOUT.as_secs())),
    };
    match (outcome, *failing_since) {
        (Ok(()), Some(_)) => {
            info!(endpoint = %export.endpoint, "trace export works again");
            *failing_since = None;
        }
        (Ok(()), None) => {}
        // Said once when it starts failing, then once a minute while it does.
        (Err(why), since) => {
            if since.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                warn!(endpoint = %export.endpoint, spans = spans.len(), error = why, "trace export failed; those spans are dropped");
                *failing_since = Some(Instant::now());
            }
        }
    }
}
