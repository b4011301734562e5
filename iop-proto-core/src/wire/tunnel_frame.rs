//! A `ProviderTunnelFrame`, the Node's commonest message, written and read by hand.
//!
//! Every provider answer crosses the link as tunnel frames: the Node encodes one for each
//! burst of the answer and the Edge decodes it. prost's generic code takes about three
//! times what the message needs for this (a length computed twice for each nested
//! message, a `Buf` walk for each `bytes` field, a call per field on the way in). The
//! functions here write exactly the bytes prost writes and read exactly the message prost
//! reads. What they do not take on (a frame with `metadata`, which is rare; a nested
//! message given twice, which prost merges; anything malformed) they leave to prost,
//! which then encodes, decodes or refuses it as it always has. Property tests and the
//! frame decoder's fuzz target hold the two equal.

use bytes::{Buf, Bytes, BytesMut};

use super::field::{
    bool_field_len, bytes_field_len, delimited_len, put_bool_field, put_bytes_field,
    put_delimited_head, put_varint_field, varint_field_len,
};
use super::tunnel_request::{Reader, Span, Value, only_field, read_pair};
use super::{ErrorDetail, Header, ProviderTunnelFrame, Usage};

/// Field numbers of `runtime.proto` (the property tests fail if these drift from it).
mod tag {
    pub(super) const ENVELOPE_TUNNEL_FRAME: u32 = 10;
    pub(super) const RUN_ID: u32 = 1;
    pub(super) const SEQUENCE: u32 = 2;
    pub(super) const KIND: u32 = 3;
    pub(super) const STATUS_CODE: u32 = 4;
    pub(super) const HEADERS: u32 = 5;
    pub(super) const BODY: u32 = 6;
    pub(super) const END: u32 = 7;
    pub(super) const ERROR: u32 = 8;
    pub(super) const USAGE: u32 = 9;
    pub(super) const METADATA: u32 = 10;
    pub(super) const HEADER_NAME: u32 = 1;
    pub(super) const HEADER_VALUE: u32 = 2;
    pub(super) const ERROR_CODE: u32 = 1;
    pub(super) const ERROR_MESSAGE: u32 = 2;
    pub(super) const ERROR_RETRYABLE: u32 = 3;
    pub(super) const USAGE_PROMPT: u32 = 1;
    pub(super) const USAGE_COMPLETION: u32 = 2;
    pub(super) const USAGE_TOTAL: u32 = 3;
}

/// The envelope's `provider_tunnel_frame` field.
pub(super) const ENVELOPE_FIELD: u32 = tag::ENVELOPE_TUNNEL_FRAME;

/// The varint prost writes for an `int32` (a negative one sign-extended to ten bytes).
#[allow(
    clippy::cast_sign_loss,
    reason = "protobuf writes an int32 as its 64-bit two's complement"
)]
fn int32(value: i32) -> u64 {
    i64::from(value) as u64
}

/// Length of `header` encoded as a message.
fn header_len(header: &Header) -> usize {
    bytes_field_len(tag::HEADER_NAME, header.name.len())
        + bytes_field_len(tag::HEADER_VALUE, header.value.len())
}

fn error_len(error: &ErrorDetail) -> usize {
    bytes_field_len(tag::ERROR_CODE, error.code.len())
        + bytes_field_len(tag::ERROR_MESSAGE, error.message.len())
        + bool_field_len(tag::ERROR_RETRYABLE, error.retryable)
}

/// A usage message's fields, in number order.
fn usage_fields(usage: &Usage) -> [(u32, u64); 3] {
    [
        (tag::USAGE_PROMPT, usage.prompt_tokens),
        (tag::USAGE_COMPLETION, usage.completion_tokens),
        (tag::USAGE_TOTAL, usage.total_tokens),
    ]
}

fn usage_len(usage: &Usage) -> usize {
    usage_fields(usage)
        .into_iter()
        .map(|(tag, n)| if n == 0 { 0 } else { varint_field_len(tag, n) })
        .sum()
}

/// Length of `frame` encoded as a message (what prost's `encoded_len` gives); `None` for
/// a frame with `metadata`, which is left to prost.
pub(super) fn message_len(frame: &ProviderTunnelFrame) -> Option<usize> {
    if !frame.metadata.is_empty() {
        return None;
    }
    let mut len = bytes_field_len(tag::RUN_ID, frame.run_id.len());
    if frame.sequence != 0 {
        len += varint_field_len(tag::SEQUENCE, frame.sequence);
    }
    if frame.kind != 0 {
        len += varint_field_len(tag::KIND, int32(frame.kind));
    }
    if frame.status_code != 0 {
        len += varint_field_len(tag::STATUS_CODE, u64::from(frame.status_code));
    }
    for header in &frame.headers {
        len += delimited_len(tag::HEADERS, header_len(header));
    }
    len += bytes_field_len(tag::BODY, frame.body.len());
    len += bool_field_len(tag::END, frame.end);
    if let Some(error) = &frame.error {
        len += delimited_len(tag::ERROR, error_len(error));
    }
    if let Some(usage) = &frame.usage {
        len += delimited_len(tag::USAGE, usage_len(usage));
    }
    Some(len)
}

/// Appends `frame` encoded as a message, the bytes prost writes for it: fields in number
/// order, each left out at its default. `frame` carries no `metadata` ([`message_len`]
/// said so).
pub(super) fn encode_message(frame: &ProviderTunnelFrame, dst: &mut BytesMut) {
    debug_assert!(frame.metadata.is_empty());
    put_bytes_field(dst, tag::RUN_ID, frame.run_id.as_bytes());
    if frame.sequence != 0 {
        put_varint_field(dst, tag::SEQUENCE, frame.sequence);
    }
    if frame.kind != 0 {
        put_varint_field(dst, tag::KIND, int32(frame.kind));
    }
    if frame.status_code != 0 {
        put_varint_field(dst, tag::STATUS_CODE, u64::from(frame.status_code));
    }
    for header in &frame.headers {
        put_delimited_head(dst, tag::HEADERS, header_len(header));
        put_bytes_field(dst, tag::HEADER_NAME, header.name.as_bytes());
        put_bytes_field(dst, tag::HEADER_VALUE, &header.value);
    }
    put_bytes_field(dst, tag::BODY, &frame.body);
    put_bool_field(dst, tag::END, frame.end);
    if let Some(error) = &frame.error {
        put_delimited_head(dst, tag::ERROR, error_len(error));
        put_bytes_field(dst, tag::ERROR_CODE, error.code.as_bytes());
        put_bytes_field(dst, tag::ERROR_MESSAGE, error.message.as_bytes());
        put_bool_field(dst, tag::ERROR_RETRYABLE, error.retryable);
    }
    if let Some(usage) = &frame.usage {
        put_delimited_head(dst, tag::USAGE, usage_len(usage));
        for (number, n) in usage_fields(usage) {
            if n != 0 {
                put_varint_field(dst, number, n);
            }
        }
    }
}

/// The tunnel frame an envelope frame carries, read as prost decodes it: `Err` with the
/// frame, untouched, unless the frame is exactly one `provider_tunnel_frame` field (as
/// every encoder writes it) whose message [`read_message`] takes.
pub(super) fn read_frame(frame: Bytes) -> Result<ProviderTunnelFrame, Bytes> {
    let Some((mut out, body)) =
        only_field(&frame, tag::ENVELOPE_TUNNEL_FRAME).and_then(|at| read_message(&frame, at))
    else {
        return Err(frame);
    };
    if let Some(body) = body {
        // The frame's own handle becomes the body, cut down in place: a copy of the
        // handle would allocate for a buffer that was a `Vec` (prost's reading spares
        // that too when the body is the message's last field, as encoders write it).
        let range = body.range();
        let mut frame = frame;
        if range.end < frame.len() {
            frame.truncate(range.end);
        }
        frame.advance(range.start);
        out.body = frame;
    }
    Ok(out)
}

/// Reads the message that starts at `start` of `raw` and runs to its end as prost would
/// decode it into a [`ProviderTunnelFrame`], all but its body, whose place is returned
/// (header values are slices of `raw`); `None` where prost would refuse it, and where it
/// holds what this reader leaves to prost: `metadata`, a group, an `error` or `usage`
/// given twice (prost merges the two).
fn read_message(raw: &Bytes, start: usize) -> Option<(ProviderTunnelFrame, Option<Span>)> {
    u32::try_from(raw.len()).ok()?;
    let text = |span: Span| std::str::from_utf8(span.of(raw)).ok().map(String::from);
    let mut out = ProviderTunnelFrame::default();
    let mut body = None;
    let mut reader = Reader::new(raw, Span::new(start, raw.len()));
    while !reader.done() {
        match reader.field()? {
            (tag::RUN_ID, Value::Bytes(span)) => out.run_id = text(span)?,
            (tag::SEQUENCE, Value::Varint(v)) => out.sequence = v,
            // prost keeps the low 32 bits of a wider varint.
            #[allow(clippy::cast_possible_truncation, reason = "as prost decodes int32")]
            (tag::KIND, Value::Varint(v)) => out.kind = v as i32,
            #[allow(clippy::cast_possible_truncation, reason = "as prost decodes uint32")]
            (tag::STATUS_CODE, Value::Varint(v)) => out.status_code = v as u32,
            (tag::HEADERS, Value::Bytes(span)) => {
                let (name, value) = read_pair(
                    raw,
                    span,
                    tag::HEADER_NAME,
                    tag::HEADER_VALUE,
                    (true, false),
                )?;
                out.headers.push(Header {
                    name: text(name)?,
                    value: raw.slice(value.range()),
                });
            }
            // An empty body is no body, as prost reads it.
            (tag::BODY, Value::Bytes(span)) => body = (!span.is_empty()).then_some(span),
            (tag::END, Value::Varint(v)) => out.end = v != 0,
            (tag::ERROR, Value::Bytes(span)) if out.error.is_none() => {
                out.error = Some(read_error(raw, span, text)?);
            }
            (tag::USAGE, Value::Bytes(span)) if out.usage.is_none() => {
                out.usage = Some(read_usage(raw, span)?);
            }
            // `metadata`, a nested message given twice, or a known field in another wire
            // type: prost's to decode or refuse.
            (1..=tag::METADATA, _) => return None,
            // A field this schema does not know: skipped, as prost skips it.
            _ => {}
        }
    }
    Some((out, body))
}

fn read_error(
    raw: &[u8],
    span: Span,
    text: impl Fn(Span) -> Option<String>,
) -> Option<ErrorDetail> {
    let mut error = ErrorDetail::default();
    let mut reader = Reader::new(raw, span);
    while !reader.done() {
        match reader.field()? {
            (tag::ERROR_CODE, Value::Bytes(span)) => error.code = text(span)?,
            (tag::ERROR_MESSAGE, Value::Bytes(span)) => error.message = text(span)?,
            (tag::ERROR_RETRYABLE, Value::Varint(v)) => error.retryable = v != 0,
            (1..=3, _) => return None,
            _ => {}
        }
    }
    Some(error)
}

fn read_usage(raw: &[u8], span: Span) -> Option<Usage> {
    let mut usage = Usage::default();
    let mut reader = Reader::new(raw, span);
    while !reader.done() {
        match reader.field()? {
            (tag::USAGE_PROMPT, Value::Varint(v)) => usage.prompt_tokens = v,
            (tag::USAGE_COMPLETION, Value::Varint(v)) => usage.completion_tokens = v,
            (tag::USAGE_TOTAL, Value::Varint(v)) => usage.total_tokens = v,
            (1..=3, _) => return None,
            _ => {}
        }
    }
    Some(usage)
}
