//! Unit tests of `driver`.

#[test]
fn a_request_event_is_small() {
    // Its channel allocates 32 slots at once, for every open request.
    assert!(std::mem::size_of::<super::RequestEvent>() <= 64);
}
