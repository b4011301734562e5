//! What the two IOP shells (`iop-edge`, `iop-node`) share. No protocol decisions live
//! here; those are in [`iop_proto_core`].
//!
//! - [`clock`]: the monotonic clock mapped onto the core's `Timestamp`.
//! - [`config`]: reading a TOML file, errors naming the file or the key.
//! - [`logging`]: `tracing` to stderr as text or JSON lines.
//! - [`process`]: the runtime and the shutdown signals of a binary.
//! - [`tls`]: PEM files, certificate fingerprints and names, server configurations.

pub mod clock;
pub mod config;
pub mod logging;
pub mod process;
pub mod repoll;
pub mod tls;

/// A state machine refused an input the shell gave it: that is a bug in the shell, not
/// something a peer can cause. It is logged at ERROR with the input and the machine's
/// reason, and stops debug builds (tests) at once; release builds carry on without the
/// input. Expected refusals (a cancel racing the end of its request, a request the
/// caller got wrong) are matched by the caller instead.
#[track_caller]
pub fn misuse<T, E: std::fmt::Display>(input: &'static str, result: Result<T, E>) -> Option<T> {
    match result {
        Ok(value) => Some(value),
        Err(err) => {
            tracing::error!(
                input,
                error = %err,
                "a state machine refused an input: this is a bug in the shell"
            );
            debug_assert!(false, "{input} refused: {err}");
            None
        }
    }
}
