//! The IOP Node shell: IO around [`iop_proto_core`]'s node machines.
//!
//! - [`config`]: the local TOML config (what a node needs before it reaches the Edge).
//! - [`supervisor`]: the one task that dials and redials through the core `Supervisor`.
//! - [`link`]: the TLS (or, by choice, plaintext) connection to the Edge.
//! - [`driver`]: one connection: frames in → `NodeSession` → frames out.
//! - [`adapters`]: the provider adapters (`mock`, `openai_compat`, `vllm`, `ollama`).

#![forbid(unsafe_code)]

pub mod adapters;
pub mod config;
pub mod driver;
pub mod link;
pub mod stats;
pub mod supervisor;
