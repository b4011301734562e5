//! `GET` and `DELETE /v1/responses/{id}`: the responses this Edge stored
//! (`iop_api::responses::Store`), each visible to the key that made it alone.

use http::{Response, StatusCode};
use iop_api::responses;

use super::{Caller, ResBody, State, api_error, json_response};

/// The stored response `id`, or 404 (also for another key's). `{id}/conversation` is
/// the conversation up to its answer (a JSON array of chat messages), which another Edge
/// of the cluster asks for when a turn naming it reaches that Edge.
pub(super) fn get(state: &State, caller: &Caller, id: &str) -> Response<ResBody> {
    let (id, conversation) = match id.strip_suffix("/conversation") {
        Some(id) => (id, true),
        None => (id, false),
    };
    let found = state.responses.lock().ok().and_then(|store| {
        store.get(id, &caller.name).map(|s| {
            if conversation {
                bytes::Bytes::copy_from_slice(s.conversation.as_bytes())
            } else {
                s.response.clone()
            }
        })
    });
    match found {
        Some(body) => json_response(StatusCode::OK, body),
        None => api_error(&responses::not_found(id)),
    }
}

/// Deletes the stored response `id`, or 404 (also for another key's).
pub(super) fn delete(state: &State, caller: &Caller, id: &str) -> Response<ResBody> {
    let deleted = state
        .responses
        .lock()
        .is_ok_and(|mut store| store.delete(id, &caller.name));
    if deleted {
        json_response(StatusCode::OK, responses::deleted(id))
    } else {
        api_error(&responses::not_found(id))
    }
}
