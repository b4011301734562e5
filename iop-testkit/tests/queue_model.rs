//! The lease ledger and the wait queue against plain models, on random operation lists
//! (the same checker the `lease_queue` fuzz target runs; see `testkit::fuzz`).

use proptest::collection::vec;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn ledger_and_queue_agree_with_their_models(data in vec(any::<u8>(), 0..3000)) {
        iop_testkit::fuzz::lease_queue(&data);
    }
}
