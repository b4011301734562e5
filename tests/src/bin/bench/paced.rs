//! Paced SSE streams: many slow streams at once, and the latency of each chunk.

#[allow(unused_imports)]
use crate::*;
use bytes::Bytes;
use iop_blackbox::procfs::{machine_steal_ticks, machine_ticks, tree_rss_kib as rss_kib};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

// ----- paced streams -----

#[derive(Clone, Default)]
pub(crate) struct Paced {
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    pub(crate) errors: usize,
    /// CPU per chunk delivered, µs, per process of the path.
    pub(crate) cpu_per_chunk_us: Vec<f64>,
    /// The busiest process's CPU over the streams' wall time, in cores.
    pub(crate) busiest_cores: f64,
    /// The share of the whole machine's CPU time that was busy meanwhile (every process,
    /// the load generator and the provider too).
    pub(crate) machine_busy: f64,
    /// The share of it the hypervisor took for other guests meanwhile.
    pub(crate) machine_stolen: f64,
    /// KiB per stream above idle, per process of the path.
    pub(crate) per_stream_kib: Vec<f64>,
    /// Whether every process was back within 2x of its idle RSS within 10 s.
    pub(crate) settled: bool,
    pub(crate) settle_s: f64,
}

/// One paced stream over a raw connection: every chunk's provider stamp and latency, from
/// that stamp to its arrival here (µs).
pub(crate) async fn paced_stream(port: u16, body: Bytes) -> Result<Vec<(u64, u64)>, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream
        .write_all(head.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    stream.write_all(&body).await.map_err(|e| e.to_string())?;
    let mut buf: Vec<u8> = Vec::with_capacity(16 << 10);
    let mut scanned = 0;
    let mut latencies = Vec::with_capacity(PACED_CHUNKS);
    let mut chunk = [0u8; 16 << 10];
    let mut status_checked = false;
    loop {
        let n = stream.read(&mut chunk).await.map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        let arrived = now_us();
        buf.extend_from_slice(&chunk[..n]);
        if !status_checked && buf.len() >= 12 {
            if !buf.starts_with(b"HTTP/1.1 200") {
                return Err(String::from_utf8_lossy(&buf[..buf.len().min(200)]).into_owned());
            }
            status_checked = true;
        }
        while let Some(at) = find(&buf[scanned..], b"\"t_us\":") {
            let start = scanned + at + 7;
            let end = start
                + buf[start..]
                    .iter()
                    .take_while(|b| b.is_ascii_digit())
                    .count();
            if end == buf.len() {
                break; // the number may continue in the next read
            }
            let sent: u64 = std::str::from_utf8(&buf[start..end])
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(arrived);
            latencies.push((sent, arrived.saturating_sub(sent)));
            scanned = end;
        }
        if find(&buf[scanned..], b"[DONE]").is_some() {
            break;
        }
        // Keep the buffer small: what was scanned is not needed again.
        if scanned > 8 << 10 {
            buf.drain(..scanned);
            scanned = 0;
        }
    }
    if latencies.len() + 1 < PACED_CHUNKS {
        return Err(format!(
            "{} of {} chunks",
            latencies.len(),
            PACED_CHUNKS - 1
        ));
    }
    Ok(latencies)
}

pub(crate) async fn paced(path: &Path3) -> Paced {
    let body = Bytes::from(format!(
        r#"{{"model":"fake","stream":true,"pace_ms":{PACE_MS},"messages":[{{"role":"user","content":"Say something slowly."}}]}}"#
    ));
    let idle = path.rss();
    let peaks = std::sync::Arc::new(std::sync::Mutex::new(idle.clone()));
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (peaks, sampling, pids) = (peaks.clone(), sampling.clone(), path.pids.clone());
        std::thread::spawn(move || {
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                let now: Vec<u64> = pids.iter().map(|p| rss_kib(*p)).collect();
                if let Ok(mut peaks) = peaks.lock() {
                    for (peak, now) in peaks.iter_mut().zip(now) {
                        *peak = (*peak).max(now);
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let cpu_before = path.cpus();
    let machine_before = machine_ticks();
    let steal_before = machine_steal_ticks();
    let wall = Instant::now();
    let mut tasks = Vec::with_capacity(PACED_STREAMS);
    for i in 0..PACED_STREAMS {
        let body = body.clone();
        let port = path.port;
        tasks.push(tokio::spawn(async move {
            // Spread the opens over one second, as arrivals would be.
            tokio::time::sleep(Duration::from_micros(
                (i as u64 * 1_000_000) / PACED_STREAMS as u64,
            ))
            .await;
            paced_stream(port, body).await
        }));
    }
    let mut stamped: Vec<(u64, u64)> = Vec::new();
    let mut errors = 0;
    let mut first_error = None;
    for task in tasks {
        match task.await {
            Ok(Ok(latencies)) => stamped.extend(latencies),
            Ok(Err(e)) => {
                errors += 1;
                first_error.get_or_insert(e);
            }
            Err(_) => errors += 1,
        }
    }
    let wall = wall.elapsed().as_secs_f64();
    let machine_busy = {
        let (busy, all) = machine_ticks();
        busy.saturating_sub(machine_before.0) as f64
            / f64::max(all.saturating_sub(machine_before.1) as f64, 1.0)
    };
    let machine_stolen = {
        let (stolen, all) = machine_steal_ticks();
        stolen.saturating_sub(steal_before.0) as f64
            / f64::max(all.saturating_sub(steal_before.1) as f64, 1.0)
    };
    let used: Vec<f64> = path
        .cpus()
        .iter()
        .zip(&cpu_before)
        .map(|(now, before)| now.saturating_sub(*before).as_secs_f64())
        .collect();
    if let Some(e) = first_error {
        eprintln!("bench: {}: paced stream error: {e}", path.name);
    }
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let _ = sampler.join();
    let peaks = peaks.lock().map(|p| p.clone()).unwrap_or_default();
    if let Some(file) = std::env::var_os("IOP_BENCH_PACED_DUMP") {
        let text: String = stamped.iter().map(|(t, l)| format!("{t} {l}\n")).collect();
        if let Err(err) = std::fs::write(&file, text) {
            eprintln!(
                "bench: IOP_BENCH_PACED_DUMP={}: {err}",
                file.to_string_lossy()
            );
        }
    }
    let mut all: Vec<u64> = stamped.into_iter().map(|(_, latency)| latency).collect();
    all.sort_unstable();
    let pick = |q: f64| {
        all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0) as f64
    };
    let started = Instant::now();
    let within = || {
        path.rss()
            .iter()
            .zip(&idle)
            .all(|(now, idle)| *now <= 2 * *idle)
    };
    while !within() && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Paced {
        p50_us: pick(0.5),
        p99_us: pick(0.99),
        errors,
        cpu_per_chunk_us: used
            .iter()
            .map(|u| u * 1e6 / f64::max(all.len() as f64, 1.0))
            .collect(),
        busiest_cores: used.iter().copied().fold(0.0, f64::max) / f64::max(wall, 1e-9),
        machine_busy,
        machine_stolen,
        per_stream_kib: peaks
            .iter()
            .zip(&idle)
            .map(|(peak, idle)| peak.saturating_sub(*idle) as f64 / PACED_STREAMS as f64)
            .collect(),
        settled: within(),
        settle_s: started.elapsed().as_secs_f64(),
    }
}
