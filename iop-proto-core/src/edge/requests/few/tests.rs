//! Unit tests of `Few`.

use super::Few;

fn items(few: &Few<u32>) -> Vec<u32> {
    few.iter().copied().collect()
}

#[test]
fn a_few_keeps_its_order_through_pushes_removals_and_spills() {
    let mut few = Few::default();
    assert!(few.is_empty());
    for n in 1..=2 {
        few.push(n);
    }
    assert!(few.rest.capacity() == 0, "two items stay in place");
    few.retain(|&n| n != 1);
    few.push(3);
    assert_eq!(items(&few), [2, 3]);
    for n in 4..=6 {
        few.push(n);
    }
    assert_eq!(items(&few), [2, 3, 4, 5, 6]);
    few.retain(|&n| n % 2 == 0);
    assert_eq!(items(&few), [2, 4, 6]);
    assert_eq!(few.len(), 3);
    assert_eq!(few.drain().collect::<Vec<_>>(), [2, 4, 6]);
    assert!(few.is_empty());
    few.push(7);
    few.clear();
    assert!(few.is_empty());
}
