//! A request as the handlers read it ([`Req`]): its method, target, header fields and
//! body. The Edge's own HTTP/1.1 reader hands over the head's bytes and where each field
//! lies in them, with no map built: a request looks up a few fields among the few it
//! carries, and building `http::HeaderMap` (two allocations, a name parse and a hash per
//! field) cost more than all those lookups together. An h2 request (hyper's) keeps its map.

use std::ops::Range;

use bytes::Bytes;
use http::{HeaderMap, Method, Uri};

/// A request: what `http::Request` carried for the handlers, with [`Fields`] for its
/// headers.
pub(crate) struct Req<B> {
    method: Method,
    uri: Uri,
    fields: Fields,
    body: B,
}

impl<B> Req<B> {
    pub(crate) fn new(method: Method, uri: Uri, fields: Fields, body: B) -> Self {
        Req {
            method,
            uri,
            fields,
            body,
        }
    }

    pub(crate) fn method(&self) -> &Method {
        &self.method
    }

    pub(crate) fn uri(&self) -> &Uri {
        &self.uri
    }

    pub(crate) fn headers(&self) -> &Fields {
        &self.fields
    }

    pub(crate) fn into_body(self) -> B {
        self.body
    }
}

impl<B> From<http::Request<B>> for Req<B> {
    fn from(request: http::Request<B>) -> Self {
        let (parts, body) = request.into_parts();
        Req::new(parts.method, parts.uri, Fields::Map(parts.headers), body)
    }
}

/// A request's header fields, in the order sent (an HTTP/1.1 head's) or as a map holds
/// them (each name's values together, in order).
pub(crate) enum Fields {
    /// An HTTP/1.1 head: its bytes, and each field's name and value within them (names
    /// as sent, in any case; token names and field values, as the reader admits them).
    Head {
        bytes: Bytes,
        fields: Vec<(Range<usize>, Range<usize>)>,
    },
    /// An h2 request's map.
    Map(HeaderMap),
}

impl Fields {
    /// Each field's name (as sent: compare without case) and value.
    pub(crate) fn iter(&self) -> FieldIter<'_> {
        match self {
            Fields::Head { bytes, fields } => FieldIter::Head(bytes, fields.iter()),
            Fields::Map(map) => FieldIter::Map(map.iter()),
        }
    }

    /// The first value of the field named `name` (lower-case), as `HeaderMap::get` finds
    /// it.
    pub(crate) fn get(&self, name: &str) -> Option<&[u8]> {
        self.iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, value)| value)
    }

    /// [`Fields::get`] as text, when the value is visible ASCII (as
    /// `HeaderValue::to_str` reads it).
    pub(crate) fn get_str(&self, name: &str) -> Option<&str> {
        self.get(name).and_then(text)
    }

    /// Whether a field named `name` (lower-case) is present.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }
}

/// A field value as text when it is visible ASCII or tabs, exactly what
/// `HeaderValue::to_str` accepts.
pub(crate) fn text(value: &[u8]) -> Option<&str> {
    value
        .iter()
        .all(|&b| b == b'\t' || (0x20..0x7f).contains(&b))
        .then(|| std::str::from_utf8(value).ok())
        .flatten()
}

/// [`Fields::iter`].
pub(crate) enum FieldIter<'a> {
    Head(&'a [u8], std::slice::Iter<'a, (Range<usize>, Range<usize>)>),
    Map(http::header::Iter<'a, http::HeaderValue>),
}

impl<'a> Iterator for FieldIter<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        match self {
            FieldIter::Head(bytes, fields) => fields
                .next()
                .map(|(name, value)| (&bytes[name.clone()], &bytes[value.clone()])),
            FieldIter::Map(map) => map
                .next()
                .map(|(name, value)| (name.as_str().as_bytes(), value.as_bytes())),
        }
    }
}

#[cfg(test)]
impl Fields {
    /// The fields of an HTTP/1.1 head sending `pairs` in order, names as given, as the
    /// Edge's reader finds them.
    pub(crate) fn head(pairs: &[(&str, &str)]) -> Fields {
        let mut text = String::from("GET / HTTP/1.1\r\n");
        for (name, value) in pairs {
            text.push_str(&format!("{name}: {value}\r\n"));
        }
        text.push_str("\r\n");
        let head = iop_http1::HeadReader::new(1 << 16)
            .poll(text.as_bytes())
            .expect("a valid head")
            .expect("a whole head");
        Fields::Head {
            bytes: Bytes::from(text),
            fields: head.fields,
        }
    }

    /// An h2 request's map of `pairs`.
    pub(crate) fn map(pairs: &[(&str, &str)]) -> Fields {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                http::HeaderValue::from_bytes(value.as_bytes()).unwrap(),
            );
        }
        Fields::Map(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_head_reads_as_its_map_would() {
        let sent = [
            ("Content-Type", "application/json"),
            ("X-Request-Id", "first"),
            ("x-request-id", "second"),
            ("X-Bin", "caf\u{e9}"),
        ];
        for fields in [Fields::head(&sent), Fields::map(&sent)] {
            assert_eq!(fields.get("x-request-id"), Some(&b"first"[..]));
            assert_eq!(fields.get_str("content-type"), Some("application/json"));
            assert!(fields.contains("x-bin"));
            // Not visible ASCII: no text, as `HeaderValue::to_str` says.
            assert_eq!(fields.get_str("x-bin"), None);
            assert_eq!(fields.get("accept"), None);
            assert_eq!(fields.iter().count(), 4);
        }
        assert_eq!(text(b"a\tb ~"), Some("a\tb ~"));
        assert_eq!(text(b"a\x7f"), None);
        assert_eq!(text(b"a\x01"), None);
    }
}
