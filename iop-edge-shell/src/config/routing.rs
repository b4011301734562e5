//! `[routing]`: retries before the first byte, ejection of failing providers and the
//! first-byte deadline. Its defaults are the core's (`Routing::default`).

use std::time::Duration;

use iop_proto_core::edge::{Affinity, AffinityMode};
use iop_proto_core::edge_config::{RetryOn, Routing};
use iop_shell_common::config::{ConfigError, invalid};
use serde::Deserialize;

use super::positive_secs;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRouting {
    pub(super) max_attempts: Option<u32>,
    pub(super) retry_budget_percent: Option<u32>,
    pub(super) retry_budget_min: Option<u32>,
    pub(super) retry_on: Option<Vec<String>>,
    pub(super) first_byte_timeout_sec: Option<f64>,
    pub(super) eject_after_failures: Option<u32>,
    pub(super) eject_failure_percent: Option<u32>,
    pub(super) eject_min_requests: Option<u32>,
    pub(super) eject_window_sec: Option<u64>,
    pub(super) eject_base_sec: Option<f64>,
    pub(super) eject_max_sec: Option<f64>,
    pub(super) max_ejected_percent: Option<u32>,
    pub(super) retry_after_max_sec: Option<u64>,
    /// How requests are placed: `off`, `session` or `prefix`.
    pub(super) affinity: Option<String>,
    /// No provider above this many times the group's mean load (at least 1).
    pub(super) load_factor: Option<f64>,
    /// Prompt fingerprints remembered.
    pub(super) prefix_entries: Option<usize>,
    /// The most of a prompt its anchor spans.
    pub(super) anchor_bytes: Option<usize>,
    /// A request header naming the caller's session, read before the well-known ones.
    pub(super) session_header: Option<String>,
    /// How long a request placed on a full provider waits for it (milliseconds).
    pub(super) affinity_wait_ms: Option<u64>,
}

/// The most prompt fingerprints `routing.prefix_entries` may ask to remember (about
/// 20 bytes each: 640 MiB).
const MAX_PREFIX_ENTRIES: usize = 32 << 20;

/// `routing.affinity` (or a model's `affinity`).
pub(super) fn affinity_mode(key: &str, word: &str) -> Result<AffinityMode, ConfigError> {
    AffinityMode::parse(word).ok_or_else(|| {
        invalid(
            key,
            format!("unknown affinity {word:?}; one of \"off\", \"session\", \"prefix\""),
        )
    })
}

fn affinity(raw: &RawRouting) -> Result<Affinity, ConfigError> {
    let d = Affinity::default();
    let load_factor_percent = match raw.load_factor {
        None => d.load_factor_percent,
        Some(f) if f.is_finite() && (1.0..=100.0).contains(&f) => (f * 100.0).round() as u32,
        Some(_) => {
            return Err(invalid(
                "routing.load_factor",
                "must be a number from 1 to 100 (the most a provider may take of the group's mean load)",
            ));
        }
    };
    let prefix_entries = raw.prefix_entries.unwrap_or(d.prefix_entries);
    if !(1..=MAX_PREFIX_ENTRIES).contains(&prefix_entries) {
        return Err(invalid(
            "routing.prefix_entries",
            format!("must be from 1 to {MAX_PREFIX_ENTRIES}"),
        ));
    }
    let anchor_bytes = raw.anchor_bytes.unwrap_or(d.anchor_bytes);
    if !(64..=1 << 20).contains(&anchor_bytes) {
        return Err(invalid(
            "routing.anchor_bytes",
            "must be from 64 to 1048576",
        ));
    }
    let wait = match raw.affinity_wait_ms {
        None => d.wait,
        Some(ms @ 0..=600_000) => std::time::Duration::from_millis(ms),
        Some(_) => {
            return Err(invalid(
                "routing.affinity_wait_ms",
                "must be at most 600000 (ten minutes)",
            ));
        }
    };
    Ok(Affinity {
        wait,
        mode: match &raw.affinity {
            None => d.mode,
            Some(word) => affinity_mode("routing.affinity", word)?,
        },
        load_factor_percent,
        prefix_entries,
        anchor_bytes,
    })
}

/// `routing.session_header`, checked as a header name.
pub(super) fn session_header(raw: &RawRouting) -> Result<Option<http::HeaderName>, ConfigError> {
    raw.session_header
        .as_deref()
        .map(|name| {
            http::HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes())
                .map_err(|_| invalid("routing.session_header", "is not a header name"))
        })
        .transpose()
}

/// The failures `routing.retry_on` may list.
const RETRY_ON: [&str; 5] = ["connect", "5xx", "429", "408", "node_lost"];

fn retry_on(listed: Option<Vec<String>>) -> Result<RetryOn, ConfigError> {
    let Some(listed) = listed else {
        return Ok(RetryOn::default());
    };
    let mut on = RetryOn {
        connect: false,
        status_5xx: false,
        status_429: false,
        status_408: false,
        node_lost: false,
    };
    for item in &listed {
        match item.as_str() {
            "connect" => on.connect = true,
            "5xx" => on.status_5xx = true,
            "429" => on.status_429 = true,
            "408" => on.status_408 = true,
            "node_lost" => on.node_lost = true,
            other => {
                return Err(invalid(
                    "routing.retry_on",
                    format!("unknown failure {other:?}; one of {RETRY_ON:?}"),
                ));
            }
        }
    }
    Ok(on)
}

/// A positive number of seconds (fractions allowed), or `default`.
pub(super) fn positive_secs_f64(
    key: &str,
    value: Option<f64>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    match value {
        None => Ok(default),
        Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Duration::from_secs_f64(s)),
        Some(_) => Err(invalid(key, "must be a positive number of seconds")),
    }
}

/// Resilient routing from `[routing]`; what it leaves out is the core's default
/// ([`Routing::default`]).
pub(super) fn routing(raw: RawRouting) -> Result<Routing, ConfigError> {
    let d = Routing::default();
    Ok(Routing {
        affinity: affinity(&raw)?,
        max_attempts: raw.max_attempts.unwrap_or(d.max_attempts),
        retry_budget_percent: raw.retry_budget_percent.unwrap_or(d.retry_budget_percent),
        retry_budget_min: raw.retry_budget_min.unwrap_or(d.retry_budget_min),
        retry_on: retry_on(raw.retry_on)?,
        first_byte_timeout: positive_secs_f64(
            "routing.first_byte_timeout_sec",
            raw.first_byte_timeout_sec,
            d.first_byte_timeout,
        )?,
        eject_after_failures: raw.eject_after_failures.unwrap_or(d.eject_after_failures),
        eject_failure_percent: raw.eject_failure_percent.unwrap_or(d.eject_failure_percent),
        eject_min_requests: raw.eject_min_requests.unwrap_or(d.eject_min_requests),
        eject_window: positive_secs(
            "routing.eject_window_sec",
            raw.eject_window_sec,
            d.eject_window.as_secs(),
        )?,
        eject_base: positive_secs_f64("routing.eject_base_sec", raw.eject_base_sec, d.eject_base)?,
        eject_max: positive_secs_f64("routing.eject_max_sec", raw.eject_max_sec, d.eject_max)?,
        max_ejected_percent: raw.max_ejected_percent.unwrap_or(d.max_ejected_percent),
        retry_after_max: positive_secs(
            "routing.retry_after_max_sec",
            raw.retry_after_max_sec,
            d.retry_after_max.as_secs(),
        )?,
    })
}
