//! The OpenAI Responses dialect (`POST /v1/responses`, `GET` and `DELETE
//! /v1/responses/{id}`), what Codex and the OpenAI SDKs' `client.responses` speak, with
//! no IO.
//!
//! A Responses request is translated ([`translate`]) into the OpenAI chat body the core
//! dispatches to any provider: a normalized run reads it as its input, a tunnel sends it
//! to the provider's chat completions. The request's events are rendered back by
//! [`Responder`]: a run's events, or the provider's chat completion (JSON or SSE chunks)
//! re-encoded, as one `response` object or as the Responses event stream
//! ([`Builder`] keeps its rules). Errors take OpenAI's shape, as chat completions'
//! do; after the first event a failure is `response.failed`.
//!
//! A stored response (`store`, the API's default) is kept by the shell in a [`Store`]
//! with the conversation up to its answer, which a later turn naming it in
//! `previous_response_id` continues.
//!
//! ```
//! use iop_api::responses::{self, Responder};
//! use iop_proto_core::wire::{RunEvent, RunEventType};
//! use iop_proto_core::DispatchShape;
//!
//! let body = br#"{"model":"m","instructions":"Be brief.","input":"hi","store":false}"#;
//! let asked = responses::translate(body, None).map_err(|e| e.message)?;
//! assert!(std::str::from_utf8(&asked.chat)?.contains(r#"{"role":"system","content":"Be brief."}"#));
//! let mut responder = Responder::new(asked.response_options("run-1", "req_1", 1_700_000_000));
//! responder.handle_dispatched(DispatchShape::Run, false);
//! for (sequence, kind, delta) in [(0, RunEventType::Start, ""), (1, RunEventType::Delta, "Hello"), (2, RunEventType::Complete, "")] {
//!     responder.handle_run_event(RunEvent {
//!         run_id: "run-1".into(),
//!         sequence,
//!         r#type: kind as i32,
//!         delta: delta.into(),
//!         ..RunEvent::default()
//!     });
//! }
//! let Some(iop_api::openai::Out::Whole { status, body }) = responder.poll_output() else { unreachable!() };
//! assert_eq!(status, 200);
//! let response: serde_json::Value = serde_json::from_slice(&body)?;
//! assert_eq!(response["output"][0]["content"][0]["text"], "Hello");
//! assert_eq!(response["status"], "completed");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod output;
mod request;
mod store;

pub use output::Builder;
pub use request::{Translated, previous_response_id, translate};
pub use store::{Store, StoreFigures, Stored};

use crate::openai::ApiError;

/// The path of the Responses endpoint.
pub const RESPONSES_PATH: &str = "/v1/responses";

/// Turns a Responses request's events into its Responses answer.
pub type Responder = crate::translated::Responder<Builder>;

/// The 400 of a `previous_response_id` this Edge does not hold for the caller.
#[must_use]
pub fn previous_not_found(id: &str) -> ApiError {
    ApiError::bad_request(
        format!("Previous response with id '{id}' not found."),
        Some("previous_response_not_found"),
    )
}

/// The 404 of a response id this Edge does not hold for the caller.
#[must_use]
pub fn not_found(id: &str) -> ApiError {
    ApiError::new(
        404,
        crate::openai::ErrorType::InvalidRequest,
        format!("No response found with id '{id}'."),
        Some("not_found"),
    )
}

/// The stem of a response's id (`resp_{stem}`): the run id behind a per-process
/// `nonce`, so that an id never names two responses across restarts; in a cluster, led
/// by the hex of the id of the Edge that stores it (`{edge hex}_...`), which
/// [`owner_of`] reads back so that another Edge knows whom to ask.
#[must_use]
pub fn id_stem(edge: Option<&str>, nonce: u64, run_id: &str) -> String {
    let run = run_id.trim_start_matches("run-");
    match edge {
        Some(edge) => {
            let mut hex = String::with_capacity(edge.len() * 2);
            for b in edge.bytes() {
                hex.push_str(&format!("{b:02x}"));
            }
            format!("{hex}_{nonce:016x}{run}")
        }
        None => format!("{nonce:016x}{run}"),
    }
}

/// The id of the Edge that stores response `id`, when the id names one.
#[must_use]
pub fn owner_of(id: &str) -> Option<String> {
    let (hex, _) = id.strip_prefix("resp_")?.split_once('_')?;
    if hex.is_empty() || hex.len() % 2 != 0 || hex.len() > 256 {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

/// What `DELETE /v1/responses/{id}` answers.
#[must_use]
pub fn deleted(id: &str) -> bytes::Bytes {
    bytes::Bytes::from(
        serde_json::json!({"id": id, "object": "response", "deleted": true}).to_string(),
    )
}

/// What a finished response leaves for the store: its id, the conversation with its
/// answer appended, and the response object.
#[must_use]
pub fn to_store(
    asked: &Translated,
    responder: &Responder,
) -> Option<(String, String, bytes::Bytes)> {
    if !asked.store {
        return None;
    }
    let builder = responder.composed()?;
    let response = builder.final_response()?;
    let conversation = match builder.transcript() {
        Some(said) => request::join_arrays(&asked.conversation, &format!("[{said}]")),
        None => asked.conversation.clone(),
    };
    Some((
        builder.id().to_owned(),
        conversation,
        bytes::Bytes::from(response.to_string()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clustered_id_names_its_edge_and_a_single_edges_none() {
        let stem = id_stem(Some("edge-a"), 0xabc, "run-42");
        assert_eq!(stem, "656467652d61_0000000000000abc42");
        assert_eq!(owner_of(&format!("resp_{stem}")).as_deref(), Some("edge-a"));
        let single = id_stem(None, 0xabc, "run-42");
        assert_eq!(owner_of(&format!("resp_{single}")), None);
        for forged in [
            "resp_zz_1",
            "resp_6_1",
            "resp__1",
            "msg_6564_1",
            "resp_ff_1",
        ] {
            assert_eq!(owner_of(forged), None, "{forged}");
        }
    }
}
