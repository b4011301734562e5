//! Reading and rewriting a request body without building a document tree of it: the
//! top-level members are borrowed slices of the input, and a rewritten body is written
//! member by member, copying what is not changed byte for byte. A body of 300,000 tiny
//! messages then costs about its own size, not a map per message.

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

/// A JSON object's top-level members, in order, borrowed from the input.
#[derive(Debug, Default)]
pub struct Object<'a> {
    members: Vec<(Cow<'a, str>, &'a RawValue)>,
}

impl<'de: 'a, 'a> Deserialize<'de> for Object<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Members;
        impl<'de> Visitor<'de> for Members {
            type Value = Object<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Object<'de>, M::Error> {
                let mut members = Vec::new();
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    let value: &'de RawValue = map.next_value()?;
                    members.push((key, value));
                }
                Ok(Object { members })
            }
        }
        deserializer.deserialize_map(Members)
    }
}

impl<'a> Object<'a> {
    /// The object in `input`, or why it is not one.
    pub fn parse(input: &'a [u8]) -> Result<Self, String> {
        serde_json::from_slice(input)
            .map_err(|err| format!("run input is not a JSON object: {err}"))
    }

    /// The last value of `key` (JSON lets a later member win), unless it is `null`.
    #[must_use]
    pub fn get(&self, key: &str) -> Option<&'a RawValue> {
        self.members
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| *v)
            .filter(|v| v.get() != "null")
    }

    /// Its members, in order (a later one of the same name included).
    pub fn members(&self) -> impl Iterator<Item = (&str, &'a RawValue)> {
        self.members.iter().map(|(k, v)| (k.as_ref(), *v))
    }

    /// Drops every member named `key`.
    pub fn remove(&mut self, key: &str) {
        self.members.retain(|(k, _)| k != key);
    }

    /// The object as JSON, with `set` replacing members where they stand (or adding them
    /// at the end): each value is JSON text. Members not replaced are copied byte for
    /// byte; a member named twice is written once, where it first stood.
    #[must_use]
    pub fn write(&self, set: &[(&str, &str)]) -> Vec<u8> {
        let size = self
            .members
            .iter()
            .map(|(k, v)| k.len() + v.get().len() + 4)
            .chain(set.iter().map(|(k, v)| k.len() + v.len() + 4))
            .sum::<usize>()
            + 2;
        let mut out = Vec::with_capacity(size);
        out.push(b'{');
        let mut first = true;
        let mut member = |out: &mut Vec<u8>, key: &str, value: &str| {
            if !std::mem::take(&mut first) {
                out.push(b',');
            }
            // Keys are re-escaped: a borrowed key had its escapes resolved.
            out.extend_from_slice(serde_json::to_string(key).unwrap_or_default().as_bytes());
            out.push(b':');
            out.extend_from_slice(value.as_bytes());
        };
        let mut written: Vec<&str> = Vec::new();
        for (key, value) in &self.members {
            match set.iter().find(|(k, _)| *k == key.as_ref()) {
                None => member(&mut out, key, value.get()),
                Some((k, v)) if !written.contains(k) => {
                    written.push(k);
                    member(&mut out, k, v);
                }
                Some(_) => {}
            }
        }
        for (key, value) in set {
            if !written.contains(key) {
                member(&mut out, key, value);
            }
        }
        out.push(b'}');
        out
    }
}

/// The elements of a JSON array, borrowed; `None` if `raw` is not an array.
#[must_use]
pub fn elements(raw: &RawValue) -> Option<Vec<&RawValue>> {
    serde_json::from_str(raw.get()).ok()
}

/// `items` as a JSON array.
#[must_use]
pub fn array<'s>(items: impl IntoIterator<Item = Cow<'s, str>>) -> String {
    let mut out = String::from("[");
    for (i, item) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&item);
    }
    out.push(']');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nonempty_array;
    use serde_json::{Value, json};

    #[test]
    fn members_are_borrowed_replaced_and_written_back() {
        let input =
            br#"{"model":"x","messages":[{"role":"user","content":"hi"}],"n":null,"a\"b":1}"#;
        let mut object = Object::parse(input).expect("object");
        assert_eq!(object.get("model").map(RawValue::get), Some("\"x\""));
        assert!(object.get("n").is_none(), "null counts as absent");
        assert!(object.get("messages").is_some_and(nonempty_array));
        object.remove("n");
        let out = object.write(&[("model", "\"y\""), ("stream", "true")]);
        let value: Value = serde_json::from_slice(&out).expect("valid JSON");
        assert_eq!(
            value,
            json!({"model": "y", "messages": [{"role": "user", "content": "hi"}], "a\"b": 1, "stream": true})
        );
        assert!(Object::parse(b"[1]").is_err());
        assert!(!nonempty_array(
            &RawValue::from_string("[]".into()).expect("raw")
        ));
    }
}
