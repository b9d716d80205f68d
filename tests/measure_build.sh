#!/usr/bin/env bash
# What CI's compile phases cost (issue 29): the workspace's test build with
# plain rustc and with clippy-driver as the workspace's compiler wrapper
# (lints inside the build, as .ci/run does it), with and without
# incremental compilation, and `cargo clippy --all-targets` on its own (what
# the shared compile saves). Dependencies are built once, before the first
# figure, so each figure is the workspace's own crates (the lib, the bins
# and every test binary). CPU seconds (user + sys) are the figure to
# compare on a shared machine; wall time is printed too.
#
# Usage: tests/measure_build.sh [out file]   (run in a checkout; takes
# ~20 CPU minutes; it rewrites target/debug's workspace artefacts)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-/tmp/measure_build.out}"
: > "$out"
driver="$(command -v clippy-driver)"
args="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
cargo test --all-targets --locked --no-run -q   # dependencies, once
m() {
  local name=$1
  shift
  touch src/lib.rs
  /usr/bin/time -f "$name wall=%e user=%U sys=%S" "$@" cargo test --all-targets --locked --no-run -q \
    2>&1 | tail -1 | tee -a "$out"
}
m plain_noinc env CARGO_INCREMENTAL=0
m clippy_noinc env CARGO_INCREMENTAL=0 RUSTC_WORKSPACE_WRAPPER="$driver" CLIPPY_ARGS="$args"
rm -rf target/debug/incremental
m clippy_inc env CARGO_INCREMENTAL=1 RUSTC_WORKSPACE_WRAPPER="$driver" CLIPPY_ARGS="$args"
# Clippy as CI ran it before: from nothing (dependencies in check mode too),
# in a target directory of its own.
scratch="$(mktemp -d)"
CARGO_TARGET_DIR="$scratch" /usr/bin/time -f "clippy_alone wall=%e user=%U sys=%S" \
  cargo clippy --all-targets --locked -q -- -D warnings 2>&1 | tail -1 | tee -a "$out"
rm -rf "$scratch"
