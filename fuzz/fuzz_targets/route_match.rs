#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencer_fuzz::route_match(data));
