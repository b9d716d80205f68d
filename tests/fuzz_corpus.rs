//! Replays the committed fuzz corpora on stable Rust, without libFuzzer.
//!
//! `fuzz/targets.rs` holds the fuzz targets' bodies as plain functions; this
//! test runs every file of `fuzz/seeds/<target>/` (hand-written),
//! `fuzz/corpus/<target>/` (minimized from fuzzing) and
//! `fuzz/regressions/<target>/` (inputs that once failed) through its
//! target, so CI checks every property on every committed input. See
//! `fuzz/README.md` for running the fuzzer itself.

#[path = "../fuzz/targets.rs"]
mod targets;

use std::path::{Path, PathBuf};

fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("read a corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// Runs every seed, corpus and regression input of `target` through `run`,
/// naming the input that fails.
fn replay(target: &str, run: fn(&[u8])) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let seeds = inputs(&root.join("seeds").join(target));
    let corpus = inputs(&root.join("corpus").join(target));
    assert!(
        !seeds.is_empty() && !corpus.is_empty(),
        "fuzz/seeds/{target} and fuzz/corpus/{target} must both hold inputs"
    );
    let regressions = inputs(&root.join("regressions").join(target));
    for file in seeds.iter().chain(&corpus).chain(&regressions) {
        let data = std::fs::read(file).expect("read a corpus file");
        if let Err(panic) = std::panic::catch_unwind(|| run(&data)) {
            let why = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            panic!(
                "fuzz target `{target}` fails on {}: {why}\n(reproduce: cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run {target} --sanitizer none {})",
                file.display(),
                file.display()
            );
        }
    }
}

#[test]
fn token_verify() {
    replay("token_verify", targets::token_verify);
}

#[test]
fn token_roundtrip() {
    replay("token_roundtrip", targets::token_roundtrip);
}

#[test]
fn path_normalize() {
    replay("path_normalize", targets::path_normalize);
}

#[test]
fn route_match() {
    replay("route_match", targets::route_match);
}

#[test]
fn lock_key() {
    replay("lock_key", targets::lock_key);
}

#[test]
fn request_body() {
    replay("request_body", targets::request_body);
}

#[test]
fn config_load() {
    replay("config_load", targets::config_load);
}
