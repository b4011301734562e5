//! `[heartbeat]`, `[timeouts]` (but `response_sec`, an HTTP setting) and `[queue]`: the
//! core's protocol timers and queue limits, with their defaults named.

use iop_proto_core::edge_config::{EdgeTiming, QueueLimits};
use iop_shell_common::config::ConfigError;
use serde::Deserialize;

use super::positive_ms;

/// `heartbeat.interval_ms`: how often the Edge and a node ping each other.
pub const DEFAULT_HEARTBEAT_INTERVAL_MS: u64 = 5_000;
/// `heartbeat.timeout_ms`: silence after which a node connection is lost.
pub const DEFAULT_HEARTBEAT_TIMEOUT_MS: u64 = 15_000;
/// `timeouts.register_ms`: time a new connection has to register, then to report ready.
pub const DEFAULT_REGISTER_MS: u64 = 10_000;
/// `timeouts.refresh_ms`: time a node has to answer a configuration refresh.
pub const DEFAULT_REFRESH_MS: u64 = 10_000;
/// `timeouts.cancel_grace_ms`: how long a cancelled run keeps its lease unconfirmed.
pub const DEFAULT_CANCEL_GRACE_MS: u64 = 15_000;
/// `queue.max_waiting`: requests that may wait per model group.
pub const DEFAULT_MAX_WAITING: usize = 256;
/// `queue.wait_timeout_ms`: how long a request waits for capacity.
pub const DEFAULT_WAIT_TIMEOUT_MS: u64 = 30_000;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHeartbeat {
    pub(super) interval_ms: Option<u64>,
    pub(super) timeout_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTimeouts {
    pub(super) register_ms: Option<u64>,
    pub(super) refresh_ms: Option<u64>,
    pub(super) cancel_grace_ms: Option<u64>,
    pub(super) response_sec: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawQueue {
    pub(super) max_waiting: Option<usize>,
    pub(super) wait_timeout_ms: Option<u64>,
}

/// The core's timers from `[heartbeat]` and `[timeouts]`.
pub(super) fn timing(
    heartbeat: &RawHeartbeat,
    timeouts: &RawTimeouts,
) -> Result<EdgeTiming, ConfigError> {
    Ok(EdgeTiming {
        heartbeat_interval: positive_ms(
            "heartbeat.interval_ms",
            heartbeat.interval_ms,
            DEFAULT_HEARTBEAT_INTERVAL_MS,
        )?,
        heartbeat_timeout: positive_ms(
            "heartbeat.timeout_ms",
            heartbeat.timeout_ms,
            DEFAULT_HEARTBEAT_TIMEOUT_MS,
        )?,
        register_timeout: positive_ms(
            "timeouts.register_ms",
            timeouts.register_ms,
            DEFAULT_REGISTER_MS,
        )?,
        refresh_timeout: positive_ms(
            "timeouts.refresh_ms",
            timeouts.refresh_ms,
            DEFAULT_REFRESH_MS,
        )?,
        cancel_grace: positive_ms(
            "timeouts.cancel_grace_ms",
            timeouts.cancel_grace_ms,
            DEFAULT_CANCEL_GRACE_MS,
        )?,
    })
}

/// The queue limits from `[queue]`.
pub(super) fn queue(raw: &RawQueue) -> Result<QueueLimits, ConfigError> {
    Ok(QueueLimits {
        max_waiting: raw.max_waiting.unwrap_or(DEFAULT_MAX_WAITING),
        wait_timeout: positive_ms(
            "queue.wait_timeout_ms",
            raw.wait_timeout_ms,
            DEFAULT_WAIT_TIMEOUT_MS,
        )?,
    })
}
