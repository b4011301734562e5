//! Arbitrary bytes from an untrusted peer into the frame decoder.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    iop_testkit::fuzz::frame_decoder(data);
});
