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
pub mod tls;
