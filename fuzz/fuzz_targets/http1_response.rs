//! Untrusted bytes from a provider, read as the responses of one keep-alive HTTP/1.1
//! connection by the Node's client.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    iop_testkit::fuzz::http1_response(data);
});
