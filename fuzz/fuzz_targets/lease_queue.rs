//! Operation lists over the lease ledger and the wait queue.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    iop_testkit::fuzz::lease_queue(data);
});
