//! Unit tests of `h1`.

use super::*;

#[test]
fn an_emptied_write_buffer_keeps_room_for_the_next_response_but_no_more() {
    // Grown past the limit by one large batch: comes back empty with the limit's room.
    let mut out = Vec::new();
    out.extend_from_slice(&[7; 3 * WRITE_KEEP]);
    out.clear();
    keep_room(&mut out);
    assert_eq!(out.capacity(), WRITE_KEEP);
    // Within the limit: left as it is.
    let mut small = Vec::with_capacity(WRITE_KEEP / 2);
    let room = small.capacity();
    keep_room(&mut small);
    assert_eq!(small.capacity(), room);
}
