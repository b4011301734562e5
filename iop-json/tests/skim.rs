//! The skim against serde: every top-level member `member_value` finds is the member
//! serde reads, whatever its strings hold (escapes, quotes, lengths on either side of the
//! in-place search) and however the object is laid out.

use proptest::prelude::*;
use serde_json::{Map, Value};

fn text() -> impl Strategy<Value = String> {
    // Short and long, with the bytes the scanner looks for anywhere in them.
    proptest::collection::vec(
        prop_oneof![
            Just('"'),
            Just('\\'),
            Just('a'),
            Just(' '),
            Just('é'),
            Just('\n'),
            Just('{'),
            Just(']'),
        ],
        0..40,
    )
    .prop_map(|chars| chars.into_iter().collect())
}

fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        text().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::vec((text(), inner), 0..4)
                .prop_map(|members| Value::Object(members.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn every_member_the_skim_finds_is_the_one_serde_reads(
        members in proptest::collection::vec((text(), value()), 1..6),
        pretty in any::<bool>(),
    ) {
        let object: Map<String, Value> = members.into_iter().collect();
        let raw = if pretty {
            serde_json::to_vec_pretty(&object).unwrap()
        } else {
            serde_json::to_vec(&object).unwrap()
        };
        for (key, expected) in &object {
            let range = iop_json::member_value(&raw, key).expect("the member is found");
            let found: Value = serde_json::from_slice(&raw[range]).expect("a whole value");
            prop_assert_eq!(&found, expected, "key {:?} in {}", key, String::from_utf8_lossy(&raw));
        }
        let absent = "no such member\u{1}";
        prop_assert!(iop_json::member_value(&raw, absent).is_none());
    }
}

/// A key written with escapes is the key they decode to, never the key its written bytes
/// spell: `"\""` is the key `"`, not the key `\"` (a case the property test found).
#[test]
fn an_escaped_key_is_not_the_key_its_bytes_spell() {
    let raw = br#"{"\"":false,"\\\"":null}"#;
    let value = |key: &str| iop_json::member_value(raw, key).map(|range| &raw[range]);
    assert_eq!(value("\""), Some(&b"false"[..]));
    assert_eq!(value("\\\""), Some(&b"null"[..]));
}
