//! Untrusted OpenAI request bodies through what the Edge reads of them.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    iop_testkit::fuzz::openai_request(data);
});
