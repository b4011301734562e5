//! Protobuf fields written by hand, byte for byte as prost writes them.
//!
//! The hand-written encoders ([`TunnelDispatch`](crate::edge::TunnelDispatch) and the
//! tunnel frame's) share these. They differ from `prost::encoding` in one way: a varint
//! of one byte (every key here, most lengths) is written without a call.

use bytes::BufMut;
use prost::encoding::{WireType, encode_varint, encoded_len_varint, key_len};

/// Appends `value` as a varint.
#[inline(always)]
pub(crate) fn put_varint(dst: &mut impl BufMut, value: u64) {
    match u8::try_from(value) {
        Ok(byte) if byte < 0x80 => dst.put_u8(byte),
        _ => encode_varint(value, dst),
    }
}

/// Appends the key of field `tag` of type `wire`.
#[inline(always)]
fn put_key(dst: &mut impl BufMut, tag: u32, wire: WireType) {
    put_varint(dst, u64::from(tag << 3 | wire as u32));
}

/// Appends the key and length of a length-delimited field of `len` bytes, whose bytes
/// the caller writes next (a nested message is written this way even when empty).
#[inline(always)]
pub(crate) fn put_delimited_head(dst: &mut impl BufMut, tag: u32, len: usize) {
    put_key(dst, tag, WireType::LengthDelimited);
    put_varint(dst, len as u64);
}

/// Writes a varint field (the caller leaves out a default value).
#[inline]
pub(crate) fn put_varint_field(dst: &mut impl BufMut, tag: u32, value: u64) {
    put_key(dst, tag, WireType::Varint);
    put_varint(dst, value);
}

/// Writes a bool field unless it is false.
#[inline]
pub(crate) fn put_bool_field(dst: &mut impl BufMut, tag: u32, value: bool) {
    if value {
        put_varint_field(dst, tag, 1);
    }
}

/// Writes a string or bytes field unless it is empty.
#[inline]
pub(crate) fn put_bytes_field(dst: &mut impl BufMut, tag: u32, value: &[u8]) {
    if !value.is_empty() {
        put_delimited_head(dst, tag, value.len());
        dst.put_slice(value);
    }
}

/// The encoded length of a length-delimited field of `len` bytes, written even when empty
/// (a nested message that is present).
pub(crate) fn delimited_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

/// The encoded length of a string or bytes field of `len` bytes (nothing when empty, as
/// proto3 leaves a default value out).
pub(crate) fn bytes_field_len(tag: u32, len: usize) -> usize {
    if len == 0 { 0 } else { delimited_len(tag, len) }
}

/// The encoded length of a bool field (nothing when false).
pub(crate) fn bool_field_len(tag: u32, value: bool) -> usize {
    if value { key_len(tag) + 1 } else { 0 }
}

/// The encoded length of a varint field of `value`.
pub(crate) fn varint_field_len(tag: u32, value: u64) -> usize {
    key_len(tag) + encoded_len_varint(value)
}
