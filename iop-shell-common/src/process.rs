//! Process plumbing shared by the binaries: the tokio runtime and shutdown signals.

use std::process::ExitCode;

use tokio_util::sync::CancellationToken;

/// The multi-threaded runtime a binary runs on; on failure the message is printed
/// under `program`'s name and the exit code to return is given back.
pub fn runtime(program: &str) -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|err| {
            eprintln!("{program}: cannot start the runtime: {err}");
            ExitCode::from(1)
        })
}

/// 64 bits that differ between processes (and between calls): the std hasher's random
/// keys, the pid and the clock. Not a secret, only a spread: seeds reconnect jitter so a
/// fleet does not redial in step, and prefixes request ids so they stay unique across
/// restarts.
#[must_use]
pub fn nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    if let Ok(since) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        hasher.write_u128(since.as_nanos());
    }
    hasher.finish()
}

/// Reports an invalid configuration (log and stderr) and gives the exit code (1).
pub fn invalid_config(
    program: &str,
    path: &std::path::Path,
    err: &dyn std::fmt::Display,
) -> ExitCode {
    tracing::error!(config = %path.display(), error = %err, "invalid configuration");
    // The log line first: both say the same, in the order they were written.
    crate::logging::flush();
    eprintln!("{program}: {err}");
    ExitCode::from(1)
}

/// Cancels `shutdown` on the first SIGTERM or SIGINT. Spawn it once at start.
pub async fn cancel_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!(signal = "SIGTERM", "shutdown requested"),
        _ = int.recv() => tracing::info!(signal = "SIGINT", "shutdown requested"),
    }
    shutdown.cancel();
}
