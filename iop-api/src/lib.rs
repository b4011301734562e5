//! IOP's public API surface, over the Sans-IO protocol core ([`iop_proto_core`]): what a
//! caller's request says and what it is answered, without sockets or clocks.
//!
//! - [`openai`]: the OpenAI dialect. Request reading ([`openai::inspect`]: the facts the
//!   Edge routes on, refused with a typed [`openai::ApiError`]), the token estimate, the
//!   error mapping, and the [`openai::Responder`] that renders a request's events (from
//!   [`iop_proto_core::EdgeCore`]) as an OpenAI response, streamed or whole.
//! - [`anthropic`]: the Anthropic Messages dialect: a Messages request translated into
//!   the chat body the core dispatches ([`anthropic::translate`]), and the
//!   [`anthropic::Responder`] that renders its events as a Messages response.
//! - [`responses`]: the OpenAI Responses dialect, translated the same way, with the
//!   bounded [`responses::Store`] that `previous_response_id` continues from.
//! - [`translated`]: what the translated dialects share: the chat body, the reader of a
//!   provider's chat completion, the [`translated::Responder`] generic over a dialect's
//!   writer.
//! - [`dialect`]: the one [`dialect::Responder`] a shell holds, whichever dialect the
//!   caller speaks.
//! - [`tokenize`]: exact prompt token counts from a provider's tokenizer, for the count
//!   routes.
//! - [`tenant`]: the accounting of named client keys (rate and token limits, requests at
//!   once, budgets, usage), driven by the wall-clock time the shell passes.
//!
//! The core knows nothing of this crate: a dialect is translated here into what the core
//! dispatches (a chat body for normalized runs or a raw call for tunnels), and the core's
//! events are rendered here for the caller.

#![forbid(unsafe_code)]

pub mod anthropic;
pub mod dialect;
pub mod openai;
pub mod responses;
pub mod tenant;
pub mod tokenize;
pub mod translated;
