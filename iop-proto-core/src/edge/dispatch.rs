//! A provider tunnel as the Edge dispatches it: the `ProviderTunnelRequest` a Node is
//! sent, held as the request's own shared handles and written straight into its frame.
//!
//! Building the prost message for every dispatch costs a dozen allocations (each string
//! field, the forwarded headers, the metadata map) that live only until the frame is
//! written. [`TunnelDispatch::encode`] writes the same bytes prost would from the
//! handles the request already holds; a property test holds the two encodings equal.

use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};

use crate::lease::RunId;
use crate::wire::codec::{HEADER_LEN, SPLIT_PAYLOAD_MIN, frame_header};
use crate::wire::field::{
    bool_field_len, bytes_field_len as bytes_len, delimited_len, put_bool_field,
    put_bytes_field as put_bytes, put_delimited_head, put_varint_field, varint_field_len,
};
use crate::wire::tunnel_request::tag;
use crate::wire::{
    Body, EncodeError, Envelope, ForwardedHeaders, ProviderTunnelRequest, REQUEST_ID_KEY,
};

/// The one method a tunnel dispatch uses.
const METHOD: &str = "POST";

/// One `ProviderTunnelRequest` the Edge sends ([`Transmit::Tunnel`](super::Transmit)):
/// its fields as handles shared with the request it serves, so a dispatch copies no
/// string. The method is always `POST` and the metadata holds the caller's request id
/// alone (nothing when it is empty), as every tunnel the Edge opens.
#[derive(Clone, Debug, PartialEq)]
pub struct TunnelDispatch {
    /// The run it opens; every frame of the answer names it.
    pub run: RunId,
    /// Adapter instance name on the node.
    pub adapter: Arc<str>,
    /// The model name the provider knows, already written into `body`.
    pub target: Arc<str>,
    /// Path relative to the adapter's base URL.
    pub path: &'static str,
    /// Request headers the provider is forwarded.
    pub headers: ForwardedHeaders,
    /// The body, passed through byte for byte.
    pub body: Bytes,
    /// Whether the caller asked for a stream.
    pub stream: bool,
    /// The longest the node may take over the provider call, in seconds.
    pub timeout_sec: u32,
    /// The caller's request id, sent in the metadata unless empty.
    pub request_id: Arc<str>,
    /// Whether it holds long-context capacity.
    pub long_context: bool,
}

impl TunnelDispatch {
    /// The message the frame carries, built: what [`encode`](Self::encode) writes, for
    /// tests and embedders that look at what the Edge sent.
    #[must_use]
    pub fn to_message(&self) -> ProviderTunnelRequest {
        let mut metadata = std::collections::BTreeMap::new();
        if !self.request_id.is_empty() {
            metadata.insert(REQUEST_ID_KEY.to_owned(), String::from(&*self.request_id));
        }
        ProviderTunnelRequest {
            run_id: self.run.wire(),
            adapter: String::from(&*self.adapter),
            target: String::from(&*self.target),
            method: METHOD.to_owned(),
            path: self.path.to_owned(),
            headers: self.headers.to_vec(),
            body: self.body.clone(),
            stream: self.stream,
            timeout_sec: self.timeout_sec,
            metadata,
            long_context: self.long_context,
            ..ProviderTunnelRequest::default()
        }
    }

    /// [`to_message`](Self::to_message) in its envelope.
    #[must_use]
    pub fn to_envelope(&self) -> Envelope {
        Envelope::new(Body::ProviderTunnelRequest(self.to_message()))
    }

    /// Appends the frame carrying this request to `dst`: the bytes
    /// [`wire::encode_split`](crate::wire::encode_split) writes for
    /// [`to_envelope`](Self::to_envelope), without building it. A body of at least
    /// [`SPLIT_PAYLOAD_MIN`] bytes is handed back instead of copied, to be written right
    /// after the rest. Refuses a frame over `max_frame_len`, leaving `dst` unchanged.
    pub fn encode(
        &self,
        dst: &mut BytesMut,
        max_frame_len: usize,
    ) -> Result<Option<Bytes>, EncodeError> {
        let mut run = [0u8; RunId::MAX_WIRE_LEN];
        let run = self.run.write_wire(&mut run);
        let split = self.body.len() >= SPLIT_PAYLOAD_MIN;
        let body_field = bytes_len(tag::BODY, self.body.len());
        let message_len = self.head_len(run) + body_field;
        let len = delimited_len(tag::ENVELOPE_TUNNEL_REQUEST, message_len);
        let header = frame_header(len, max_frame_len)?;
        let copied = if split { 0 } else { self.body.len() };
        dst.reserve(HEADER_LEN + len - self.body.len() + copied);
        dst.put_u32(header);
        put_delimited_head(dst, tag::ENVELOPE_TUNNEL_REQUEST, message_len);
        // Fields in their numbers' order, as prost writes them, but for a body handed
        // back: protobuf takes fields in any order, so it goes last, after its key.
        put_bytes(dst, tag::RUN_ID, run);
        put_bytes(dst, tag::ADAPTER, self.adapter.as_bytes());
        put_bytes(dst, tag::TARGET, self.target.as_bytes());
        put_bytes(dst, tag::METHOD, METHOD.as_bytes());
        put_bytes(dst, tag::PATH, self.path.as_bytes());
        dst.put_slice(self.headers.encoded());
        if !split {
            put_bytes(dst, tag::BODY, &self.body);
        }
        put_bool_field(dst, tag::STREAM, self.stream);
        if self.timeout_sec != 0 {
            put_varint_field(dst, tag::TIMEOUT_SEC, u64::from(self.timeout_sec));
        }
        if !self.request_id.is_empty() {
            put_delimited_head(dst, tag::METADATA, self.entry_len());
            put_bytes(dst, tag::ENTRY_KEY, REQUEST_ID_KEY.as_bytes());
            put_bytes(dst, tag::ENTRY_VALUE, self.request_id.as_bytes());
        }
        put_bool_field(dst, tag::LONG_CONTEXT, self.long_context);
        if split {
            put_delimited_head(dst, tag::BODY, self.body.len());
            return Ok(Some(self.body.clone()));
        }
        Ok(None)
    }

    /// The message's encoded length without its body field.
    fn head_len(&self, run: &[u8]) -> usize {
        let headers = self.headers.encoded().len();
        let timeout = if self.timeout_sec == 0 {
            0
        } else {
            varint_field_len(tag::TIMEOUT_SEC, u64::from(self.timeout_sec))
        };
        let metadata = if self.request_id.is_empty() {
            0
        } else {
            delimited_len(tag::METADATA, self.entry_len())
        };
        bytes_len(tag::RUN_ID, run.len())
            + bytes_len(tag::ADAPTER, self.adapter.len())
            + bytes_len(tag::TARGET, self.target.len())
            + bytes_len(tag::METHOD, METHOD.len())
            + bytes_len(tag::PATH, self.path.len())
            + headers
            + bool_field_len(tag::STREAM, self.stream)
            + timeout
            + metadata
            + bool_field_len(tag::LONG_CONTEXT, self.long_context)
    }

    /// The encoded length of the metadata's one entry (its key is never empty).
    fn entry_len(&self) -> usize {
        bytes_len(tag::ENTRY_KEY, REQUEST_ID_KEY.len())
            + bytes_len(tag::ENTRY_VALUE, self.request_id.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::RequestId;
    use crate::wire::{self, FrameDecoder, Header};
    use proptest::prelude::*;

    fn header() -> impl Strategy<Value = Header> {
        (
            "[a-z-]{0,12}",
            proptest::collection::vec(any::<u8>(), 0..40),
        )
            .prop_map(|(name, value)| Header {
                name,
                value: Bytes::from(value),
            })
    }

    fn dispatch() -> impl Strategy<Value = TunnelDispatch> {
        (
            (any::<u64>(), any::<u32>()),
            ("\\PC{0,20}", "\\PC{0,20}"),
            prop_oneof![Just("/v1/chat/completions"), Just("/v1/messages"), Just("")],
            proptest::collection::vec(header(), 0..5),
            prop_oneof![
                0usize..300,
                Just(SPLIT_PAYLOAD_MIN - 1),
                Just(SPLIT_PAYLOAD_MIN),
                SPLIT_PAYLOAD_MIN..SPLIT_PAYLOAD_MIN + 300
            ],
            (any::<bool>(), any::<u32>(), "\\PC{0,40}", any::<bool>()),
        )
            .prop_map(
                |((request, attempt), (adapter, target), path, headers, body_len, rest)| {
                    let (stream, timeout_sec, request_id, long_context) = rest;
                    TunnelDispatch {
                        run: RunId {
                            request: RequestId(request),
                            attempt,
                        },
                        adapter: adapter.into(),
                        target: target.into(),
                        path,
                        headers: headers.into(),
                        body: Bytes::from((0..body_len).map(|i| i as u8).collect::<Vec<_>>()),
                        stream,
                        timeout_sec,
                        request_id: request_id.into(),
                        long_context,
                    }
                },
            )
    }

    proptest! {
        /// The bytes written are prost's for the built message, split alike, and they
        /// decode back into it.
        #[test]
        fn encodes_as_prost_encodes_the_message(d in dispatch(), prefix in 0usize..8) {
            let mut ours = BytesMut::from(&vec![7u8; prefix][..]);
            let mut theirs = ours.clone();
            let payload = d.encode(&mut ours, wire::DEFAULT_MAX_FRAME_LEN).unwrap();
            let mut envelope = d.to_envelope();
            let expected =
                wire::encode_split(&mut envelope, &mut theirs, wire::DEFAULT_MAX_FRAME_LEN)
                    .unwrap();
            prop_assert_eq!(&ours, &theirs);
            prop_assert_eq!(&payload, &expected);
            prop_assert_eq!(payload.is_some(), d.body.len() >= SPLIT_PAYLOAD_MIN);
            let mut decoder = FrameDecoder::new();
            decoder.push(&ours[prefix..]);
            if let Some(payload) = &payload {
                decoder.push(payload);
            }
            prop_assert_eq!(decoder.next_envelope().unwrap(), Some(envelope));
        }

        /// A frame over the limit is refused as prost's encoding refuses it, with nothing
        /// written.
        #[test]
        fn refuses_what_prost_refuses(d in dispatch(), max in 0usize..400) {
            let mut ours = BytesMut::new();
            let mut theirs = BytesMut::new();
            let result = d.encode(&mut ours, max);
            let expected = wire::encode_split(&mut d.to_envelope(), &mut theirs, max);
            prop_assert_eq!(&result, &expected);
            if result.is_err() {
                prop_assert!(ours.is_empty());
            }
        }
    }
}
