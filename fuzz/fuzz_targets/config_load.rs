#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencer_fuzz::config_load(data));
