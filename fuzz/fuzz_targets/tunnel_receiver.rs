//! Arbitrary tunnel frames into the tunnel receiver.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    iop_testkit::fuzz::tunnel_receiver(data);
});
