//! `[admission]`: how the Edge admits node connections beyond each node's token (the
//! throttle of failing sources, node-id conflicts), with the related `[limits]` on
//! connections that have not registered yet. Defaults are named.

use std::time::Duration;

use iop_proto_core::edge_config::{Admission, ConflictLimits, PendingLimits, ThrottleLimits};
use iop_shell_common::config::ConfigError;
use serde::Deserialize;

use super::http::RawLimits;
use super::{RawListen, positive_ms, positive_secs};

/// `admission.free_failures`: failed registers a source may make before it is held back.
pub const DEFAULT_FREE_FAILURES: u32 = 5;
/// `admission.failure_interval_ms`: the first hold of a source past its free failures.
pub const DEFAULT_FAILURE_INTERVAL_MS: u64 = 1_000;
/// `admission.max_backoff_sec`: the longest hold.
pub const DEFAULT_MAX_BACKOFF_SEC: u64 = 30;
/// `admission.failure_window_sec`: how long a failure counts.
pub const DEFAULT_FAILURE_WINDOW_SEC: u64 = 60;
/// Sources and node ids the throttle keeps track of at most.
pub const THROTTLE_TRACKED: usize = 4096;
/// `limits.max_pending_connections`: node connections not registered yet, in all.
pub const DEFAULT_MAX_PENDING: usize = 1024;
/// `limits.max_pending_per_address`: ... and from one address.
pub const DEFAULT_MAX_PENDING_PER_ADDRESS: usize = 64;
/// `limits.pending_frame_bytes`: the largest frame before a register is accepted.
pub const DEFAULT_PENDING_FRAME_BYTES: usize = 64 << 10;
/// `admission.conflict_supersedes`: takeovers of a live connection that make a conflict
/// (at least 2).
pub const DEFAULT_CONFLICT_SUPERSEDES: u32 = 3;
/// `admission.conflict_window_sec`: within how long.
pub const DEFAULT_CONFLICT_WINDOW_SEC: u64 = 30;
/// `admission.conflict_hold_down_sec`: how long newcomers are held off a conflict.
pub const DEFAULT_CONFLICT_HOLD_DOWN_SEC: u64 = 60;
/// How soon a node held off a conflict is told to try again.
pub const CONFLICT_RETRY_AFTER: Duration = Duration::from_secs(5);

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmission {
    pub(super) free_failures: Option<u32>,
    pub(super) failure_interval_ms: Option<u64>,
    pub(super) failure_window_sec: Option<u64>,
    pub(super) max_backoff_sec: Option<u64>,
    pub(super) conflict_supersedes: Option<u32>,
    pub(super) conflict_window_sec: Option<u64>,
    pub(super) conflict_hold_down_sec: Option<u64>,
}

/// The admission rules from `[admission]`, the listener's mutual TLS and `[limits]`.
pub(super) fn admission(
    a: &RawAdmission,
    limits: &RawLimits,
    listen: &RawListen,
) -> Result<Admission, ConfigError> {
    Ok(Admission {
        require_client_identity: listen
            .nodes_tls
            .as_ref()
            .is_some_and(|t| t.client_ca_file.is_some()),
        throttle: ThrottleLimits {
            free_failures: a.free_failures.unwrap_or(DEFAULT_FREE_FAILURES),
            interval: positive_ms(
                "admission.failure_interval_ms",
                a.failure_interval_ms,
                DEFAULT_FAILURE_INTERVAL_MS,
            )?,
            max_hold: positive_secs(
                "admission.max_backoff_sec",
                a.max_backoff_sec,
                DEFAULT_MAX_BACKOFF_SEC,
            )?,
            window: positive_secs(
                "admission.failure_window_sec",
                a.failure_window_sec,
                DEFAULT_FAILURE_WINDOW_SEC,
            )?,
            max_tracked: THROTTLE_TRACKED,
        },
        pending: PendingLimits {
            max_total: limits
                .max_pending_connections
                .unwrap_or(DEFAULT_MAX_PENDING),
            max_per_source: limits
                .max_pending_per_address
                .unwrap_or(DEFAULT_MAX_PENDING_PER_ADDRESS),
        },
        pending_frame_len: limits
            .pending_frame_bytes
            .unwrap_or(DEFAULT_PENDING_FRAME_BYTES),
        max_frame_len: limits
            .max_frame_bytes
            .unwrap_or(iop_proto_core::wire::DEFAULT_MAX_FRAME_LEN),
        conflict: ConflictLimits {
            supersedes: a
                .conflict_supersedes
                .unwrap_or(DEFAULT_CONFLICT_SUPERSEDES)
                .max(2),
            window: positive_secs(
                "admission.conflict_window_sec",
                a.conflict_window_sec,
                DEFAULT_CONFLICT_WINDOW_SEC,
            )?,
            hold_down: positive_secs(
                "admission.conflict_hold_down_sec",
                a.conflict_hold_down_sec,
                DEFAULT_CONFLICT_HOLD_DOWN_SEC,
            )?,
            retry_after: CONFLICT_RETRY_AFTER,
        },
    })
}
