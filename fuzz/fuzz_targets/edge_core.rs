//! Arbitrary envelopes from several connections, time, submits and cancels into the Edge machine.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    iop_testkit::fuzz::edge_core(data);
});
