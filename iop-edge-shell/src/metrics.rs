//! Prometheus text metrics: requests by model and status, latency and time to first byte,
//! queue depth and wait, in-flight per provider, node connections, frames and bytes.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::core_task::Snapshot;

const BOUNDS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Clone, Debug, Default)]
struct Histogram {
    counts: [u64; BOUNDS.len()],
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, value: Duration) {
        let secs = value.as_secs_f64();
        for (i, bound) in BOUNDS.iter().enumerate() {
            if secs <= *bound {
                self.counts[i] += 1;
            }
        }
        self.sum += secs;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (i, bound) in BOUNDS.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {}",
                self.counts[i]
            );
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.count
        );
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.count);
    }
}

#[derive(Debug, Default)]
struct Inner {
    requests: BTreeMap<(String, u16), u64>,
    latency: BTreeMap<String, Histogram>,
    ttfb: BTreeMap<String, Histogram>,
    queue_wait: Histogram,
    rejected: BTreeMap<&'static str, u64>,
    violations: BTreeMap<&'static str, u64>,
    /// Tokens providers reported, by (public model, node, provider, kind).
    tokens: BTreeMap<(String, String, String, &'static str), u64>,
}

/// Process-wide metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
    /// Frames received from nodes.
    pub frames_in: AtomicU64,
    /// Frames sent to nodes.
    pub frames_out: AtomicU64,
    /// Bytes received from nodes.
    pub bytes_in: AtomicU64,
    /// Bytes sent to nodes.
    pub bytes_out: AtomicU64,
    /// Node ready transitions.
    pub node_connects: AtomicU64,
    /// Node generations fenced.
    pub node_disconnects: AtomicU64,
    /// Node ids that became a conflict.
    pub node_conflicts: AtomicU64,
    /// Node connections whose TLS handshake failed or timed out.
    pub tls_handshake_failures: AtomicU64,
}

fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    /// Adds to a counter.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// A finished HTTP request.
    pub fn request(&self, model: &str, status: u16, latency: Duration) {
        if let Ok(mut inner) = self.inner.lock() {
            *inner
                .requests
                .entry((model.to_owned(), status))
                .or_default() += 1;
            inner
                .latency
                .entry(model.to_owned())
                .or_default()
                .observe(latency);
        }
    }

    /// Token usage a provider reported for one request (known models only: the labels
    /// come from configuration, never from caller input).
    pub fn tokens(&self, model: &str, node: &str, provider: &str, prompt: u64, completion: u64) {
        if let Ok(mut inner) = self.inner.lock() {
            for (kind, n) in [("prompt", prompt), ("completion", completion)] {
                *inner
                    .tokens
                    .entry((model.to_owned(), node.to_owned(), provider.to_owned(), kind))
                    .or_default() += n;
            }
        }
    }

    /// Time to the first response byte of a request.
    pub fn first_byte(&self, model: &str, ttfb: Duration) {
        if let Ok(mut inner) = self.inner.lock() {
            inner
                .ttfb
                .entry(model.to_owned())
                .or_default()
                .observe(ttfb);
        }
    }

    /// A refused node registration, by reason.
    pub fn rejected(&self, reason: &'static str) {
        if let Ok(mut inner) = self.inner.lock() {
            *inner.rejected.entry(reason).or_default() += 1;
        }
    }

    /// A protocol violation by a node, by kind.
    pub fn violation(&self, kind: &'static str) {
        if let Ok(mut inner) = self.inner.lock() {
            *inner.violations.entry(kind).or_default() += 1;
        }
    }

    /// Time a request waited for a lease.
    pub fn queue_wait(&self, wait: Duration) {
        if let Ok(mut inner) = self.inner.lock() {
            inner.queue_wait.observe(wait);
        }
    }

    /// The Prometheus text exposition.
    #[must_use]
    pub fn render(&self, snapshot: &Snapshot) -> String {
        let mut out = String::new();
        let Ok(inner) = self.inner.lock() else {
            return out;
        };
        out.push_str("# HELP iop_http_requests_total Requests answered, by public model and HTTP status.\n# TYPE iop_http_requests_total counter\n");
        for ((model, status), n) in &inner.requests {
            let _ = writeln!(
                out,
                "iop_http_requests_total{{model=\"{}\",status=\"{status}\"}} {n}",
                escape(model)
            );
        }
        out.push_str("# HELP iop_http_request_duration_seconds Request latency, by public model.\n# TYPE iop_http_request_duration_seconds histogram\n");
        for (model, h) in &inner.latency {
            h.render(
                &mut out,
                "iop_http_request_duration_seconds",
                &format!("model=\"{}\"", escape(model)),
            );
        }
        out.push_str("# HELP iop_http_time_to_first_byte_seconds Time to the first response byte, by public model.\n# TYPE iop_http_time_to_first_byte_seconds histogram\n");
        for (model, h) in &inner.ttfb {
            h.render(
                &mut out,
                "iop_http_time_to_first_byte_seconds",
                &format!("model=\"{}\"", escape(model)),
            );
        }
        out.push_str("# HELP iop_tokens_total Tokens providers reported using, by public model, node, provider and kind (prompt, completion).\n# TYPE iop_tokens_total counter\n");
        for ((model, node, provider, kind), n) in &inner.tokens {
            let _ = writeln!(
                out,
                "iop_tokens_total{{model=\"{}\",node=\"{}\",provider=\"{}\",kind=\"{kind}\"}} {n}",
                escape(model),
                escape(node),
                escape(provider)
            );
        }
        out.push_str("# HELP iop_queue_wait_seconds Time requests waited for provider capacity.\n# TYPE iop_queue_wait_seconds histogram\n");
        inner
            .queue_wait
            .render(&mut out, "iop_queue_wait_seconds", "");
        out.push_str("# HELP iop_node_registrations_refused_total Node registrations refused, by reason.\n# TYPE iop_node_registrations_refused_total counter\n");
        for (reason, n) in &inner.rejected {
            let _ = writeln!(
                out,
                "iop_node_registrations_refused_total{{reason=\"{reason}\"}} {n}"
            );
        }
        out.push_str("# HELP iop_node_violations_total Protocol violations by nodes, by kind.\n# TYPE iop_node_violations_total counter\n");
        for (kind, n) in &inner.violations {
            let _ = writeln!(out, "iop_node_violations_total{{kind=\"{kind}\"}} {n}");
        }
        drop(inner);
        out.push_str("# HELP iop_queue_depth Requests waiting, by public model.\n# TYPE iop_queue_depth gauge\n");
        for (model, n) in &snapshot.queue_by_model {
            let _ = writeln!(out, "iop_queue_depth{{model=\"{}\"}} {n}", escape(model));
        }
        out.push_str("# HELP iop_provider_in_flight Leases held, by provider.\n# TYPE iop_provider_in_flight gauge\n");
        for p in &snapshot.providers {
            let _ = writeln!(
                out,
                "iop_provider_in_flight{{node=\"{}\",provider=\"{}\"}} {}",
                escape(&p.node_id),
                escape(&p.provider_id),
                p.in_flight
            );
        }
        out.push_str("# HELP iop_provider_capacity Capacity of the live generation, by provider.\n# TYPE iop_provider_capacity gauge\n");
        for p in &snapshot.providers {
            let _ = writeln!(
                out,
                "iop_provider_capacity{{node=\"{}\",provider=\"{}\"}} {}",
                escape(&p.node_id),
                escape(&p.provider_id),
                p.capacity
            );
        }
        let ready = snapshot
            .nodes
            .iter()
            .filter(|n| n.state == iop_proto_core::NodeState::Ready)
            .count();
        let _ = writeln!(
            out,
            "# HELP iop_nodes_ready Nodes that completed the ready handshake.\n# TYPE iop_nodes_ready gauge\niop_nodes_ready {ready}"
        );
        for (name, help, counter) in [
            (
                "iop_node_connects_total",
                "Node ready transitions.",
                &self.node_connects,
            ),
            (
                "iop_node_disconnects_total",
                "Node generations fenced.",
                &self.node_disconnects,
            ),
            (
                "iop_node_conflicts_total",
                "Node ids that two live connections kept taking from each other.",
                &self.node_conflicts,
            ),
            (
                "iop_node_tls_handshake_failures_total",
                "Node connections whose TLS handshake failed or timed out.",
                &self.tls_handshake_failures,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                counter.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP iop_node_frames_total Frames on node connections.\n# TYPE iop_node_frames_total counter"
        );
        let _ = writeln!(
            out,
            "iop_node_frames_total{{direction=\"in\"}} {}",
            self.frames_in.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "iop_node_frames_total{{direction=\"out\"}} {}",
            self.frames_out.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP iop_node_bytes_total Bytes on node connections.\n# TYPE iop_node_bytes_total counter"
        );
        let _ = writeln!(
            out,
            "iop_node_bytes_total{{direction=\"in\"}} {}",
            self.bytes_in.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "iop_node_bytes_total{{direction=\"out\"}} {}",
            self.bytes_out.load(Ordering::Relaxed)
        );
        out
    }
}
