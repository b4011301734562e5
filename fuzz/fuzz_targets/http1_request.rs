//! Untrusted bytes on the Edge's public listener, read as pipelined HTTP/1.1 requests.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    iop_testkit::fuzz::http1_request(data);
});
