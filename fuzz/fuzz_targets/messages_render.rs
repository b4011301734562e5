//! Untrusted provider answers re-encoded as Anthropic Messages, streamed and whole.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    iop_testkit::fuzz::messages_render(data);
});
