//! Arbitrary envelopes, shell outputs and timeouts into the Node session machine.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    iop_testkit::fuzz::node_session(data);
});
