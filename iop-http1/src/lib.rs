//! HTTP/1.1 message framing, Sans-IO (RFC 9112): what the Edge's public listener reads of
//! a request head and body, what it writes as a response head and body chunks, and the
//! body framing that the Node's provider client decodes too. Bytes in, decisions and bytes
//! out; the shells own the sockets and the timers.
//!
//! Every peer is untrusted:
//! - a request head is refused past its size limit or its header count (431), not
//!   buffered without bound, and a head that arrives a few bytes at a time is searched
//!   once and parsed once ([`HeadReader`]);
//! - a body is framed by one `Content-Length` (equal values repeated are one value) or by
//!   `Transfer-Encoding: chunked` alone: both at once, another coding, or `Transfer-Encoding`
//!   on HTTP/1.0 is refused (400 or 501) and the connection closed, so that no two readers
//!   of one stream can disagree on where a message ends (request smuggling);
//! - chunk-size lines, chunk sizes and trailer sections have limits.
//!
//! [`body`] holds the body framing both sides decode, [`request`] the request heads a
//! server reads and a client writes, [`response`] the response heads a client reads and
//! a server writes.

pub mod body;
pub mod head;
pub mod request;
pub mod response;

pub use body::{BodyError, Chunk, Decoded, Framing, MAX_CHUNK_LINE, MAX_TRAILERS};
pub use head::{HeadError, HeadReader, encode_content_length, lists_token};
pub use request::{
    CONTINUE, EncodeError, MAX_REQUEST_HEADERS, Opening, RequestHead, encode_field,
    encode_request_line, finish_request_head, is_field_value, is_token, opening,
};
pub use response::{
    BodyFraming, CHUNK_END, LAST_CHUNK, MAX_RESPONSE_HEADERS, ResponseFraming, ResponseHead,
    encode_chunk_start, encode_response_head, is_framing_field, response_framing,
};
