//! The skim against serde: every top-level member `member_value` (the first of a name)
//! and `last_member_value` (the last, found from the end) find is the member serde reads,
//! whatever its strings hold (escapes, quotes, lengths on either side of the in-place
//! search) and however the object is laid out.

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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// Members of any names, some named twice, laid out with any whitespace: the member
    /// found from the end is the last of its name, the one serde keeps; so it is when the
    /// text's end or start is not the object's (read forward then), and an absent name
    /// is not found.
    #[test]
    fn the_last_member_found_from_the_end_is_the_one_serde_keeps(
        members in proptest::collection::vec(
            (prop_oneof![text(), Just("usage".to_owned())], value()),
            0..6,
        ),
        spaces in proptest::collection::vec(
            prop_oneof![Just(""), Just(" "), Just("\n\t ")],
            5,
        ),
        layout in 0..4u8,
    ) {
        let mut raw = format!("{}{{", spaces[0]);
        for (i, (key, value)) in members.iter().enumerate() {
            if i > 0 {
                raw.push(',');
            }
            raw.push_str(&format!(
                "{}{}{}:{}{}{}",
                spaces[1],
                serde_json::to_string(key).unwrap(),
                spaces[2],
                spaces[3],
                value,
                spaces[4],
            ));
        }
        raw.push('}');
        raw.push_str(spaces[0]);
        // As sent; with bytes after it (read forward); cut before its last brace; after
        // other text.
        let raw = match layout {
            0 => raw,
            1 => format!("{raw} x"),
            2 => raw.trim_end().strip_suffix('}').unwrap().to_owned(),
            _ => format!("[]{raw}"),
        };
        let raw = raw.as_bytes();
        let kept: Map<String, Value> = members.iter().cloned().collect();
        if layout == 0 {
            let read: Value = serde_json::from_slice(raw).expect("an object");
            prop_assert_eq!(&read, &Value::Object(kept.clone()));
        }
        for (key, expected) in &kept {
            let found = iop_json::last_member_value(raw, key);
            let range = match (layout, found) {
                // Cut, or after other text: no object, so no member is the right one.
                // The backward skim may take an inner object's end for the object's (a
                // member inside it then looks like one of the object's), or find a member
                // without reading what comes before it: only the bounds hold.
                (2 | 3, found) => {
                    prop_assert!(found.is_none_or(|r| r.start <= r.end && r.end <= raw.len()));
                    continue;
                }
                (_, Some(range)) => range,
                (_, None) => panic!("the member {key:?} is not found"),
            };
            let found: Value = serde_json::from_slice(&raw[range]).expect("a whole value");
            prop_assert_eq!(&found, expected, "key {:?} in {}", key, String::from_utf8_lossy(raw));
        }
        let absent = "no such member\u{1}";
        prop_assert!(iop_json::last_member_value(raw, absent).is_none());
    }

    /// Any bytes: no panic, and what is found lies inside them.
    #[test]
    fn any_text_read_from_the_end_stays_inside_it(
        raw in proptest::collection::vec(
            prop_oneof![
                Just(b'"'), Just(b'\\'), Just(b'{'), Just(b'}'), Just(b'['), Just(b']'),
                Just(b':'), Just(b','), Just(b' '), Just(b'u'), any::<u8>(),
            ],
            0..48,
        ),
        key in prop_oneof![Just("u"), Just("usage"), Just("\"")],
    ) {
        if let Some(range) = iop_json::last_member_value(&raw, key) {
            prop_assert!(range.start <= range.end && range.end <= raw.len());
        }
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

/// Read backward, a quote ends a string only after an even run of backslashes: strings
/// that end in escaped backslashes, hold escaped quotes, or look like members inside.
#[test]
fn strings_are_skimmed_backward_over_escaped_quotes_and_backslash_runs() {
    let raw = br#"{"a":"\\","b":"x\"}\\\",\"usage\":1","usage":{"k":"\\\\\""}, "z" : "\\\\" }"#;
    let read: Map<String, Value> = serde_json::from_slice(raw).expect("an object");
    for (key, expected) in &read {
        let range = iop_json::last_member_value(raw, key).expect("found");
        let found: Value = serde_json::from_slice(&raw[range]).expect("a whole value");
        assert_eq!(&found, expected, "{key}");
    }
    assert_eq!(read.len(), 4);
    assert_eq!(
        iop_json::last_member_value(raw, "k"),
        None,
        "nested, not a member"
    );
}
