//! Asking another Edge of the cluster: the conversation of a stored response it holds,
//! for a turn that names it in `previous_response_id` and reached this Edge. Plain
//! HTTP/1.1 to the member's advertised HTTP address, with the caller's own credential
//! (the owner answers only the key that made the response), a deadline and a size bound.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// The longest a fetch from another Edge may take, its answer included.
const FETCH_WAIT: Duration = Duration::from_secs(2);

/// The caller's credential as it came: `authorization` or `x-api-key`.
pub(crate) type Credential = Option<(HeaderName, HeaderValue)>;

/// The credential headers of a request, for a fetch made on its caller's behalf.
pub(crate) fn credential(headers: &super::fields::Fields) -> Credential {
    [
        http::header::AUTHORIZATION,
        HeaderName::from_static("x-api-key"),
    ]
    .into_iter()
    .find_map(|name| {
        let mut value = HeaderValue::from_bytes(headers.get(name.as_str())?).ok()?;
        // A secret: kept out of HPACK tables and `Debug` output.
        value.set_sensitive(true);
        Some((name, value))
    })
}

/// The conversation of response `id` from the Edge at `addr`, at most `limit` bytes;
/// `None` when it does not answer one in time (gone, not holding it, another key's).
pub(crate) async fn conversation(
    addr: &str,
    id: &str,
    credential: Credential,
    limit: usize,
) -> Option<Arc<str>> {
    static CLIENT: OnceLock<Client<HttpConnector, Empty<Bytes>>> = OnceLock::new();
    // Ids are made here: anything else in one is a forgery, never put in a URL.
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return None;
    }
    let client = CLIENT.get_or_init(|| Client::builder(TokioExecutor::new()).build_http());
    let mut request = Request::get(format!("http://{addr}/v1/responses/{id}/conversation"))
        .body(Empty::new())
        .ok()?;
    if let Some((name, value)) = credential {
        request.headers_mut().insert(name, value);
    }
    let fetch = async {
        let response = client.request(request).await.ok()?;
        if response.status() != http::StatusCode::OK {
            return None;
        }
        let body = Limited::new(response.into_body(), limit)
            .collect()
            .await
            .ok()?
            .to_bytes();
        std::str::from_utf8(&body).ok().map(Arc::from)
    };
    let fetched = tokio::time::timeout(FETCH_WAIT, fetch).await.ok().flatten();
    if fetched.is_none() {
        tracing::info!(
            response_id = id,
            owner = addr,
            "stored response not fetched from its Edge"
        );
    }
    fetched
}
