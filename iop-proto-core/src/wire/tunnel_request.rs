//! A `ProviderTunnelRequest` as the Node receives it: read in place from its frame.
//!
//! prost decodes a tunnel request into owned values: each of its strings, each forwarded
//! header's name, the header list and the metadata map are allocations made for every
//! request and freed when it starts. [`TunnelRequest`] keeps the frame's bytes instead
//! and where each field lies in them: its strings are checked as UTF-8 when it is read
//! (and again, cheaply, when one is asked for, as safe code must), and its headers and
//! metadata are read again from the bytes when asked for. It is small (about half the
//! prost message), which matters as much: it travels by value into the adapter's task, whose
//! future holds it.
//!
//! It reads exactly what prost would decode. A message it does not take (a group field,
//! a malformed field, a string that is not UTF-8) it leaves to prost, which then decodes
//! it or reports the same error it always has; a property test and the frame decoder's
//! fuzz target hold the two readings equal.

use std::collections::BTreeMap;
use std::fmt;

use bytes::Bytes;
use prost::Message;
use prost::encoding::{WireType, decode_key, decode_varint};

use super::field::{bytes_field_len, put_bytes_field, put_delimited_head};
use super::{Envelope, Header, ProviderTunnelRequest};

/// Field numbers of `runtime.proto` that the tunnel request's reader here and the Edge's
/// encoder (`edge::dispatch`) use (their property tests fail if these drift from the
/// schema).
pub(crate) mod tag {
    pub(crate) const ENVELOPE_TUNNEL_REQUEST: u32 = 9;
    pub(crate) const RUN_ID: u32 = 1;
    pub(crate) const ADAPTER: u32 = 2;
    pub(crate) const TARGET: u32 = 3;
    pub(crate) const METHOD: u32 = 4;
    pub(crate) const PATH: u32 = 5;
    pub(crate) const HEADERS: u32 = 6;
    pub(crate) const BODY: u32 = 7;
    pub(crate) const STREAM: u32 = 8;
    pub(crate) const TIMEOUT_SEC: u32 = 9;
    pub(crate) const METADATA: u32 = 10;
    pub(crate) const SESSION_ID: u32 = 11;
    pub(crate) const LONG_CONTEXT: u32 = 12;
    pub(crate) const HEADER_NAME: u32 = 1;
    pub(crate) const HEADER_VALUE: u32 = 2;
    pub(crate) const ENTRY_KEY: u32 = 1;
    pub(crate) const ENTRY_VALUE: u32 = 2;
}

/// Where a field's bytes lie in the message (a frame's length fits a `u32`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Span {
    start: u32,
    end: u32,
}

impl Span {
    /// The span of `start..end`, which [`TunnelRequest::read`] has bounded by `u32`.
    #[allow(
        clippy::cast_possible_truncation,
        reason = "the message is at most u32::MAX long"
    )]
    pub(super) fn new(start: usize, end: usize) -> Span {
        Span {
            start: start as u32,
            end: end as u32,
        }
    }

    pub(super) fn range(self) -> std::ops::Range<usize> {
        self.start as usize..self.end as usize
    }

    pub(super) fn of(self, raw: &[u8]) -> &[u8] {
        &raw[self.range()]
    }

    pub(super) fn is_empty(self) -> bool {
        self.start == self.end
    }
}

/// A provider tunnel request (the schema's `ProviderTunnelRequest`), read in place from
/// the frame that carried it: its strings and body are the frame's own bytes, so reading
/// one costs no allocation. [`FrameDecoder::next_inbound`](super::FrameDecoder::next_inbound)
/// yields it; [`TunnelRequest::from`] turns a decoded message into one and
/// [`TunnelRequest::to_message`] back.
#[derive(Clone, Default)]
pub struct TunnelRequest {
    /// The encoded message.
    raw: Bytes,
    run_id: Span,
    adapter: Span,
    target: Span,
    method: Span,
    path: Span,
    session_id: Span,
    body: Span,
    /// From the first header field to the end of the last (every encoder writes them
    /// together, so reading them again walks little else).
    headers: Span,
    /// The same for the metadata entries.
    metadata: Span,
    /// The last `request_id` metadata value.
    request_id: Option<Span>,
    stream: bool,
    timeout_sec: u32,
    long_context: bool,
}

/// One forwarded header of a [`TunnelRequest`], borrowed from its frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeaderRef<'a> {
    /// Header name as the caller sent it.
    pub name: &'a str,
    /// Header value, unchanged.
    pub value: &'a [u8],
}

impl TunnelRequest {
    /// Edge-assigned identifier; every frame of the answer carries it.
    #[must_use]
    pub fn run_id(&self) -> &str {
        self.text(self.run_id)
    }

    /// Adapter instance name on the node.
    #[must_use]
    pub fn adapter(&self) -> &str {
        self.text(self.adapter)
    }

    /// Provider-side target the Edge already wrote into the body.
    #[must_use]
    pub fn target(&self) -> &str {
        self.text(self.target)
    }

    /// HTTP method.
    #[must_use]
    pub fn method(&self) -> &str {
        self.text(self.method)
    }

    /// Path and query relative to the adapter's base URL.
    #[must_use]
    pub fn path(&self) -> &str {
        self.text(self.path)
    }

    /// Opaque correlation only.
    #[must_use]
    pub fn session_id(&self) -> &str {
        self.text(self.session_id)
    }

    /// Request body, byte for byte (a slice of the frame, not a copy).
    #[must_use]
    pub fn body(&self) -> Bytes {
        self.raw.slice(self.body.range())
    }

    /// Length of the body in bytes.
    #[must_use]
    pub fn body_len(&self) -> usize {
        self.body.range().len()
    }

    /// Whether the caller expects a streamed (SSE) answer.
    #[must_use]
    pub fn stream(&self) -> bool {
        self.stream
    }

    /// Upper bound for the whole provider request, in seconds; 0 means the node default.
    #[must_use]
    pub fn timeout_sec(&self) -> u32 {
        self.timeout_sec
    }

    /// Whether the request holds long-context capacity.
    #[must_use]
    pub fn long_context(&self) -> bool {
        self.long_context
    }

    /// Whether the string fields a tunnel request must not leave empty (run id, adapter,
    /// method) are set, and the path's bytes: what [`Validate`](super::Validate) checks,
    /// without a UTF-8 check of its own.
    pub(crate) fn required(&self) -> ([bool; 3], &[u8]) {
        (
            [self.run_id, self.adapter, self.method].map(|span| !span.is_empty()),
            self.path.of(&self.raw),
        )
    }

    /// The caller's request id ([`REQUEST_ID_KEY`](super::REQUEST_ID_KEY) in the
    /// metadata), as sent: observation only, check it before logging it.
    #[must_use]
    pub fn request_id(&self) -> Option<&str> {
        self.request_id.map(|span| self.text(span))
    }

    /// The headers to forward, in the order they were sent.
    pub fn headers(&self) -> impl Iterator<Item = HeaderRef<'_>> + '_ {
        self.pairs(
            self.headers,
            tag::HEADERS,
            tag::HEADER_NAME,
            tag::HEADER_VALUE,
        )
        .map(|(name, value)| HeaderRef {
            name: self.text(name),
            value: value.of(&self.raw),
        })
    }

    /// The metadata value under `key`: the last one sent, as a map keeps it.
    #[must_use]
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata_entries()
            .filter(|(k, _)| *k == key)
            .last()
            .map(|(_, value)| value)
    }

    /// Every metadata entry in the order sent (a key sent twice appears twice; the map
    /// of [`to_message`](Self::to_message) keeps the last).
    pub fn metadata_entries(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        self.pairs(
            self.metadata,
            tag::METADATA,
            tag::ENTRY_KEY,
            tag::ENTRY_VALUE,
        )
        .map(|(key, value)| (self.text(key), self.text(value)))
    }

    /// The same request as the schema's message, each field an owned copy.
    #[must_use]
    pub fn to_message(&self) -> ProviderTunnelRequest {
        ProviderTunnelRequest {
            run_id: self.run_id().to_owned(),
            adapter: self.adapter().to_owned(),
            target: self.target().to_owned(),
            method: self.method().to_owned(),
            path: self.path().to_owned(),
            headers: self
                .headers()
                .map(|header| Header {
                    name: header.name.to_owned(),
                    value: Bytes::copy_from_slice(header.value),
                })
                .collect(),
            body: self.body(),
            stream: self.stream,
            timeout_sec: self.timeout_sec,
            metadata: self
                .metadata_entries()
                .map(|(key, value)| (key.to_owned(), value.to_owned()))
                .collect::<BTreeMap<_, _>>(),
            session_id: self.session_id().to_owned(),
            long_context: self.long_context,
        }
    }

    /// A string field's text. Each was checked as UTF-8 when the message was read, so the
    /// empty fallback is never taken.
    fn text(&self, span: Span) -> &str {
        std::str::from_utf8(span.of(&self.raw)).unwrap_or_default()
    }

    /// The two fields `first` and `second` of each sub-message in field `field` within
    /// `within`, in the order sent (an absent field reads empty, a repeated one as its
    /// last).
    fn pairs(
        &self,
        within: Span,
        field: u32,
        first: u32,
        second: u32,
    ) -> impl Iterator<Item = (Span, Span)> {
        let mut reader = Reader::new(&self.raw, within);
        std::iter::from_fn(move || {
            while let Some((number, value)) = reader.field() {
                if let (true, Value::Bytes(span)) = (number == field, value) {
                    return read_pair(&self.raw, span, first, second, (false, false));
                }
            }
            None
        })
    }

    /// Reads the message `raw` in place, as prost would decode it; `None` where prost
    /// would refuse it or where it holds what this reader leaves to prost (a group).
    pub(crate) fn read(raw: Bytes) -> Option<TunnelRequest> {
        u32::try_from(raw.len()).ok()?;
        let string = |span: Span| utf8(span.of(&raw)).map(|()| span);
        let mut out = TunnelRequest::default();
        let mut reader = Reader::new(&raw, Span::new(0, raw.len()));
        while !reader.done() {
            let key_at = reader.pos();
            let (number, value) = reader.field()?;
            let whole = Span::new(key_at, reader.pos());
            match (number, value) {
                (tag::RUN_ID, Value::Bytes(span)) => out.run_id = string(span)?,
                (tag::ADAPTER, Value::Bytes(span)) => out.adapter = string(span)?,
                (tag::TARGET, Value::Bytes(span)) => out.target = string(span)?,
                (tag::METHOD, Value::Bytes(span)) => out.method = string(span)?,
                (tag::PATH, Value::Bytes(span)) => out.path = string(span)?,
                (tag::SESSION_ID, Value::Bytes(span)) => out.session_id = string(span)?,
                (tag::BODY, Value::Bytes(span)) => out.body = span,
                (tag::HEADERS, Value::Bytes(span)) => {
                    // The name is a string, checked as each of its occurrences is read.
                    read_pair(
                        &raw,
                        span,
                        tag::HEADER_NAME,
                        tag::HEADER_VALUE,
                        (true, false),
                    )?;
                    out.headers = widen(out.headers, whole);
                }
                (tag::METADATA, Value::Bytes(span)) => {
                    let (key, value) =
                        read_pair(&raw, span, tag::ENTRY_KEY, tag::ENTRY_VALUE, (true, true))?;
                    out.metadata = widen(out.metadata, whole);
                    if key.of(&raw) == super::REQUEST_ID_KEY.as_bytes() {
                        out.request_id = Some(value);
                    }
                }
                (tag::STREAM, Value::Varint(v)) => out.stream = v != 0,
                // prost keeps the low 32 bits of a wider varint.
                #[allow(clippy::cast_possible_truncation, reason = "as prost decodes uint32")]
                (tag::TIMEOUT_SEC, Value::Varint(v)) => out.timeout_sec = v as u32,
                (tag::LONG_CONTEXT, Value::Varint(v)) => out.long_context = v != 0,
                // A known field in another wire type: prost refuses it.
                (1..=12, _) => return None,
                // A field this schema does not know: skipped, as prost skips it.
                _ => {}
            }
        }
        out.raw = raw;
        Some(out)
    }

    /// Reads the tunnel request an envelope frame carries in place: `None` unless the
    /// frame is exactly one `provider_tunnel_request` field (as every encoder writes it)
    /// whose message [`read`](Self::read) takes.
    pub(crate) fn read_frame(frame: &Bytes) -> Option<TunnelRequest> {
        let start = only_field(frame, tag::ENVELOPE_TUNNEL_REQUEST)?;
        TunnelRequest::read(frame.slice(start..))
    }
}

impl From<ProviderTunnelRequest> for TunnelRequest {
    /// The message re-encoded and read in place (for tests and for an envelope that
    /// arrived whole).
    fn from(message: ProviderTunnelRequest) -> Self {
        let read = TunnelRequest::read(Bytes::from(message.encode_to_vec()));
        debug_assert!(read.is_some(), "prost's own encoding reads back");
        read.unwrap_or_default()
    }
}

impl From<TunnelRequest> for Envelope {
    fn from(request: TunnelRequest) -> Self {
        Envelope::new(super::Body::ProviderTunnelRequest(request.to_message()))
    }
}

impl PartialEq for TunnelRequest {
    fn eq(&self, other: &Self) -> bool {
        self.run_id() == other.run_id()
            && self.adapter() == other.adapter()
            && self.target() == other.target()
            && self.method() == other.method()
            && self.path() == other.path()
            && self.session_id() == other.session_id()
            && self.body.of(&self.raw) == other.body.of(&other.raw)
            && self.stream == other.stream
            && self.timeout_sec == other.timeout_sec
            && self.long_context == other.long_context
            && self.headers().eq(other.headers())
            && self.to_message().metadata == other.to_message().metadata
    }
}

impl fmt::Debug for TunnelRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TunnelRequest")
            .field("run_id", &self.run_id())
            .field("adapter", &self.adapter())
            .field("target", &self.target())
            .field("method", &self.method())
            .field("path", &self.path())
            .field(
                "headers",
                &self.headers().map(|h| h.name).collect::<Vec<_>>(),
            )
            .field("body_len", &self.body_len())
            .field("stream", &self.stream)
            .field("timeout_sec", &self.timeout_sec)
            .field("long_context", &self.long_context)
            .finish_non_exhaustive()
    }
}

/// The request headers a tunnel forwards to its provider, held as the bytes of the
/// `ProviderTunnelRequest`'s `headers` fields (each a `Header` message under its key, as
/// prost writes it): built with one allocation, shared by every dispatch of a request, and
/// written into each dispatch's frame with one copy. A `Vec<Header>` costs an allocation
/// per name and per value besides the list's own.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ForwardedHeaders {
    encoded: Bytes,
}

/// Builds [`ForwardedHeaders`], one header at a time, in the order they are forwarded.
#[derive(Debug, Default)]
pub struct ForwardedHeadersBuilder {
    buf: bytes::BytesMut,
}

impl ForwardedHeaders {
    /// A builder with room for `capacity` encoded bytes (about each header's name and
    /// value and four bytes more); it grows past that when it must.
    #[must_use]
    pub fn builder(capacity: usize) -> ForwardedHeadersBuilder {
        ForwardedHeadersBuilder {
            buf: bytes::BytesMut::with_capacity(capacity),
        }
    }

    /// The headers in the order they were pushed.
    pub fn iter(&self) -> impl Iterator<Item = HeaderRef<'_>> + '_ {
        let raw: &[u8] = &self.encoded;
        // Built by the builder alone, so it always reads; a length past the spans' reach
        // (no header list is that long) reads as none.
        let whole = u32::try_from(raw.len()).map_or(Span::default(), |_| Span::new(0, raw.len()));
        let mut reader = Reader::new(raw, whole);
        std::iter::from_fn(move || {
            let (_, Value::Bytes(span)) = reader.field()? else {
                return None;
            };
            let (name, value) = read_pair(
                raw,
                span,
                tag::HEADER_NAME,
                tag::HEADER_VALUE,
                (false, false),
            )?;
            Some(HeaderRef {
                name: std::str::from_utf8(name.of(raw)).unwrap_or_default(),
                value: value.of(raw),
            })
        })
    }

    /// Whether there is none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.encoded.is_empty()
    }

    /// The headers as prost messages (for a built `ProviderTunnelRequest`).
    #[must_use]
    pub fn to_vec(&self) -> Vec<Header> {
        self.iter()
            .map(|h| Header {
                name: h.name.to_owned(),
                value: Bytes::copy_from_slice(h.value),
            })
            .collect()
    }

    /// The encoded `headers` fields, as a tunnel request's frame carries them.
    pub(crate) fn encoded(&self) -> &[u8] {
        &self.encoded
    }
}

impl ForwardedHeadersBuilder {
    /// Appends a header.
    pub fn push(&mut self, name: &str, value: &[u8]) {
        let len = bytes_field_len(tag::HEADER_NAME, name.len())
            + bytes_field_len(tag::HEADER_VALUE, value.len());
        let buf = &mut self.buf;
        buf.reserve(prost::encoding::key_len(tag::HEADERS) + 10 + len);
        put_delimited_head(buf, tag::HEADERS, len);
        put_bytes_field(buf, tag::HEADER_NAME, name.as_bytes());
        put_bytes_field(buf, tag::HEADER_VALUE, value);
    }

    /// The headers pushed.
    #[must_use]
    pub fn finish(self) -> ForwardedHeaders {
        ForwardedHeaders {
            encoded: self.buf.freeze(),
        }
    }
}

impl From<&[Header]> for ForwardedHeaders {
    fn from(headers: &[Header]) -> Self {
        let mut builder = ForwardedHeaders::builder(0);
        for h in headers {
            builder.push(&h.name, &h.value);
        }
        builder.finish()
    }
}

impl From<Vec<Header>> for ForwardedHeaders {
    fn from(headers: Vec<Header>) -> Self {
        ForwardedHeaders::from(headers.as_slice())
    }
}

impl fmt::Debug for ForwardedHeaders {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Where the value of a frame that is exactly one length-delimited field `number` (below
/// 16) starts: its key, then a length that runs to the frame's end, as every encoder
/// writes an envelope; `None` for any other frame.
pub(super) fn only_field(frame: &[u8], number: u32) -> Option<usize> {
    // A one-byte key: a larger number's first byte would be a continuation byte.
    let key = u8::try_from(number << 3 | WireType::LengthDelimited as u32)
        .ok()
        .filter(|&key| key < 0x80)?;
    let (&first, mut rest) = frame.split_first()?;
    if first != key {
        return None;
    }
    let len = decode_varint(&mut rest).ok()?;
    (len == rest.len() as u64).then_some(frame.len() - rest.len())
}

/// The smallest span holding `span` (empty for none yet) and `field`, which follows it.
fn widen(span: Span, field: Span) -> Span {
    if span == Span::default() {
        field
    } else {
        Span {
            start: span.start,
            end: field.end,
        }
    }
}

/// `Some` if `bytes` are UTF-8 (as a string field's must be).
fn utf8(bytes: &[u8]) -> Option<()> {
    (bytes.is_ascii() || std::str::from_utf8(bytes).is_ok()).then_some(())
}

/// Fields `first` and `second` of the sub-message at `span` of `raw`, both
/// length-delimited: the last of each, empty when absent; `None` where prost would refuse
/// the sub-message. `text` says which of the two are strings: prost checks every
/// occurrence of a string field as UTF-8 (a field given twice keeps the last, but an
/// earlier one that is not UTF-8 still refuses the message), so each is checked here as
/// it is read. A reader of a message already read this way passes `(false, false)`.
pub(super) fn read_pair(
    raw: &[u8],
    span: Span,
    first: u32,
    second: u32,
    text: (bool, bool),
) -> Option<(Span, Span)> {
    let (mut a, mut b) = (Span::default(), Span::default());
    let mut reader = Reader::new(raw, span);
    while !reader.done() {
        match reader.field()? {
            (number, Value::Bytes(span)) if number == first => {
                if text.0 {
                    utf8(span.of(raw))?;
                }
                a = span;
            }
            (number, Value::Bytes(span)) if number == second => {
                if text.1 {
                    utf8(span.of(raw))?;
                }
                b = span;
            }
            (number, _) if number == first || number == second => return None,
            _ => {}
        }
    }
    Some((a, b))
}

/// A field's value as the reader needs it.
#[derive(Clone, Copy, Debug)]
pub(super) enum Value {
    Varint(u64),
    /// A length-delimited field's bytes.
    Bytes(Span),
    /// A fixed-width field (no field of these messages is one; skipped).
    Fixed,
}

/// A cursor over the fields of an encoded message (or a part of it), by prost's rules for
/// keys, varints and lengths. Its spans index the whole message.
pub(super) struct Reader<'a> {
    /// What is left to read.
    rest: &'a [u8],
    /// Where `rest` ends in the message.
    end: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(raw: &'a [u8], within: Span) -> Self {
        Reader {
            rest: &raw[within.range()],
            end: within.end as usize,
        }
    }

    /// Where the next field starts in the message.
    pub(super) fn pos(&self) -> usize {
        self.end - self.rest.len()
    }

    pub(super) fn done(&self) -> bool {
        self.rest.is_empty()
    }

    /// A varint as prost reads it, a one-byte one without a call.
    #[inline(always)]
    fn varint(&mut self) -> Option<u64> {
        match self.rest {
            [byte, rest @ ..] if *byte < 0x80 => {
                self.rest = rest;
                Some(u64::from(*byte))
            }
            _ => decode_varint(&mut self.rest).ok(),
        }
    }

    /// The next field; `None` at the end, or where prost would refuse the bytes or a
    /// group starts (left to prost). Kept inline: its callers match on what it returns,
    /// and as a call it cost about 60 instructions a field.
    #[inline(always)]
    pub(super) fn field(&mut self) -> Option<(u32, Value)> {
        let (number, wire) = match self.rest {
            // A one-byte key (fields 1 to 15); any other key is prost's to read or refuse
            // (field 0 and unknown wire types among them).
            [byte, rest @ ..] if *byte < 0x80 && *byte >= 8 => {
                self.rest = rest;
                (u32::from(byte >> 3), byte & 7)
            }
            [] => return None,
            _ => {
                let (number, wire) = decode_key(&mut self.rest).ok()?;
                (number, wire as u8)
            }
        };
        let value = match wire {
            0 => Value::Varint(self.varint()?),
            2 => {
                let len = usize::try_from(self.varint()?).ok()?;
                let start = self.pos();
                let (_, rest) = self.rest.split_at_checked(len)?;
                self.rest = rest;
                Value::Bytes(Span::new(start, start + len))
            }
            // Fixed widths: no field of these messages is one; skipped.
            1 | 5 => {
                let width = if wire == 1 { 8 } else { 4 };
                self.rest = self.rest.get(width..)?;
                Value::Fixed
            }
            // Groups, and the wire types prost refuses.
            _ => return None,
        };
        Some((number, value))
    }
}
