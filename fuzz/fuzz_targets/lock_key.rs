#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencer_fuzz::lock_key(data));
