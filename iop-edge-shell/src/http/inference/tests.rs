//! Unit tests of `inference`.

use super::*;

#[test]
fn fresh_request_ids_are_a_process_prefix_and_a_counter_in_hex() {
    let (a, b) = (fresh_request_id(), fresh_request_id());
    for id in [&a, &b] {
        assert_eq!(id.len(), 28, "{id}");
        assert!(id.starts_with("req_"), "{id}");
        assert!(
            id[4..]
                .bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)),
            "{id}"
        );
        assert!(iop_proto_core::wire::is_request_id(id.as_bytes()), "{id}");
    }
    assert_eq!(a[..20], b[..20], "one prefix per process");
    let count = |id: &str| u32::from_str_radix(&id[20..], 16).unwrap();
    // Other tests may take ids in between.
    assert!(count(&b) > count(&a), "{a} then {b}");
}

#[test]
fn a_session_key_is_the_configured_header_first_then_the_known_ones_in_order() {
    let headers = |pairs: &[(&str, &str)]| {
        let mut map = http::HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                http::HeaderValue::from_str(value).unwrap(),
            );
        }
        map
    };
    let configured = http::HeaderName::from_static("x-conversation");
    let both = headers(&[
        ("session-id", "codex"),
        ("x-claude-code-session-id", " claude "),
        ("x-conversation", "mine"),
    ]);
    assert_eq!(
        session_header(&both, Some(&configured)).as_deref(),
        Some("mine")
    );
    assert_eq!(session_header(&both, None).as_deref(), Some("claude"));
    let later = headers(&[("session-id", "b"), ("session_id", "a")]);
    assert_eq!(session_header(&later, None).as_deref(), Some("a"));
    // Empty and overlong values are no key; the next known header is.
    let long = "k".repeat(iop_proto_core::edge::MAX_SESSION_KEY + 1);
    let unusable = headers(&[
        ("x-claude-code-session-id", "  "),
        ("session_id", &long),
        ("session-id", "c"),
    ]);
    assert_eq!(session_header(&unusable, None).as_deref(), Some("c"));
    assert_eq!(session_header(&headers(&[("accept", "x")]), None), None);
}
