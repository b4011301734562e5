//! Operation lists over the lease ledger and the wait queue.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    iop_proto_core::testkit::fuzz::lease_queue(data);
});
