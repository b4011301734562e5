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

fn headers(pairs: &[(&str, &str)]) -> Fields {
    Fields::head(pairs)
}

fn session_header(headers: &Fields, configured: Option<&HeaderName>) -> Option<String> {
    HeadFacts::read(headers, configured, &crate::traces::Tracer::disabled()).session
}

#[test]
fn a_session_key_is_the_configured_header_first_then_the_known_ones_in_order() {
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
    // A configured name that is also forwarded is both.
    let agent = http::HeaderName::from_static("user-agent");
    let facts = HeadFacts::read(
        &headers(&[("user-agent", "sdk/1")]),
        Some(&agent),
        &crate::traces::Tracer::disabled(),
    );
    assert_eq!(facts.session.as_deref(), Some("sdk/1"));
    let pairs = [("user-agent", "sdk/1"), ("x-request-id", "-")];
    assert_eq!(
        forwarded(facts),
        pairs.map(|(n, v)| (n.to_owned(), v.to_owned()))
    );
}

/// The headers a request's facts forward, in order.
fn forwarded(facts: HeadFacts) -> Vec<(String, String)> {
    let id = facts.request_id.clone();
    facts
        .forward
        .finish()
        .iter()
        .map(|h| {
            let value = String::from_utf8(h.value.to_vec()).unwrap();
            // A fresh id reads as `-`.
            let fresh = *value == *id && id.starts_with("req_");
            (
                h.name.to_owned(),
                if fresh { "-".to_owned() } else { value },
            )
        })
        .collect()
}

#[test]
fn one_pass_over_the_head_reads_what_lookups_read_and_forwards_in_order() {
    let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let sent = [
        ("Content-Type", "application/json"),
        ("X-Request-Id", "abc-123"),
        ("Accept", "text/event-stream"),
        ("Content-Length", "12"),
        ("x-request-id", "second"),
        ("content-type", "second/type"),
        ("Host", "edge"),
        ("TraceParent", parent),
        ("Session_Id", "s-1"),
    ];
    // An HTTP/1.1 head forwards in the order sent; an h2 map holds a name's values
    // together. Names go on lower-cased either way.
    let head = [
        "content-type",
        "accept",
        "content-type",
        "x-request-id",
        "traceparent",
    ];
    let map = [
        "content-type",
        "content-type",
        "accept",
        "x-request-id",
        "traceparent",
    ];
    for (fields, order) in [(Fields::head(&sent), head), (Fields::map(&sent), map)] {
        let facts = HeadFacts::read(&fields, None, &crate::traces::Tracer::disabled());
        // The first value of each, as a lookup reads it.
        assert_eq!(&*facts.request_id, &*request_id(&fields));
        assert_eq!(&*facts.request_id, "abc-123");
        assert_eq!(facts.content_length, declared_length(&fields));
        assert_eq!(facts.content_length, Some(12));
        assert_eq!(facts.session.as_deref(), Some("s-1"));
        let sent_on = forwarded(facts);
        let names: Vec<&str> = sent_on.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, order, "{sent_on:?}");
        let value = |name: &str| {
            sent_on
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
                .collect::<Vec<_>>()
        };
        assert_eq!(value("content-type"), ["application/json", "second/type"]);
        assert_eq!(value("x-request-id"), ["abc-123"], "the caller's id, once");
        assert!(value("traceparent")[0].starts_with("00-0af7651916cd43dd8448eb211c80319c-"));
    }
    // An id the contract does not admit is replaced; none given, one is made.
    let forged = headers(&[("x-request-id", "a b"), ("x-request-id", "ok")]);
    let facts = HeadFacts::read(&forged, None, &crate::traces::Tracer::disabled());
    assert!(facts.request_id.starts_with("req_"), "{}", facts.request_id);
    assert_eq!(
        forwarded(facts),
        [("x-request-id".to_owned(), "-".to_owned())]
    );
    // A name longer than any this reads is neither forwarded nor a session, unless it is
    // the configured one.
    let long = "x-a-session-header-named-at-some-length";
    let configured = HeaderName::from_static("x-a-session-header-named-at-some-length");
    let fields = headers(&[("X-A-Session-Header-Named-At-Some-Length", "mine")]);
    let facts = HeadFacts::read(
        &fields,
        Some(&configured),
        &crate::traces::Tracer::disabled(),
    );
    assert_eq!(facts.session.as_deref(), Some("mine"), "{long}");
    assert_eq!(session_header(&fields, None), None);
}

#[test]
fn a_content_length_reads_as_str_parse_reads_it() {
    let cases: [&[u8]; 12] = [
        b"0",
        b"74",
        b"+12",
        b"",
        b"+",
        b"-1",
        b" 1",
        b"1 ",
        b"1a",
        b"18446744073709551615",
        b"18446744073709551616",
        b"\xff1",
    ];
    for case in cases {
        let parsed = std::str::from_utf8(case)
            .ok()
            .and_then(|v| v.parse::<u64>().ok());
        assert_eq!(content_length(case), parsed, "{case:?}");
    }
}
