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
