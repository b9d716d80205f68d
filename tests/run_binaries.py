#!/usr/bin/env python3
"""Runs every test binary `cargo test --all-targets` would, N at a time.

`cargo test` runs its test binaries one after another; measured on the
landed main (`/usr/bin/time cargo test --all-targets -- --test-threads=2`,
2026-11-26), the phase keeps 0.51 cores of two busy on average (389 CPU
seconds in 767 s of wall time): most tests wait on servers they started,
on timeouts and on schedules. Two binaries at once (`--jobs 2`) took the
phase from 767 s to 501 s (`FENCER_TEST_JOBS=2 python3
tests/run_binaries.py`, loaded machine); the two lanes pack well (a later
loaded run: 2073 s of binary wall time in 1050 s, load average 10-14 from
other builds on the 2 cores).

What broke at two at a time, and was made robust (issue 29): the
`lock_suite` scenarios with 150-300 ms leases (ZooKeeper's fsynced writes
took longer than the lease; at load ~19 PostgreSQL and Redis renewals every
100 ms were >200 ms late) now scale every time by `slowness(backend)` (x2,
ZooKeeper x4), same ratios; the Redis Cluster batched-renewal test, the
MySQL crash test and bench_smoke got longer leases / checked releases.
Still seen with three other builds on the machine (load 7-19 on 2 cores,
far above two binaries on an idle CI machine): a Sentinel hold stream lost
at x2, the MySQL bell falling back to lease expiry (`mysql_backend`), a
ZooKeeper leader-change test, schemathesis counting a 503 for a tiny
generated TTL as a server error, `safety_regressions`' janitor and
lease-id tests. On an idle machine, with servers shared per binary
(`tests/common/shared.rs`), two at a time ran all 41 binaries and 483
tests without a failure in 543 s (`FENCER_TEST_JOBS=2 python3
tests/run_binaries.py`, 2026-11-26, load average < 1 before it; 722 s one
at a time in the last clean-clone CI), so two at a time is the default;
FENCER_TEST_JOBS=1 goes back to one at a time.

cargo-nextest (`cargo nextest run --all-targets --no-fail-fast`, default
scheduling: 2 tests at a time, each in a process of its own) lists the
same 483 tests; it took 1969 s (467 of them run: 16 found their binary
being rebuilt) while this runner with `--jobs 2` took 1707 s for all 483
beside it (both started within a minute, load 16-20): not faster here.

Each binary's output is printed whole when it ends, after a `Running` line
in cargo's format (so `tests/ci_times.py` reads it as it reads cargo's),
and its wall time is measured here. Every binary runs even if another
failed (as `--no-fail-fast`); the exit status is 1 if any failed.

Usage: run_binaries.py [--jobs N] [--test-threads N] [-- <cargo args>]
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Started first (longest first packs two lanes best); measured wall times
# of the last runs, from the CI time table. Binaries not named here follow,
# in cargo's order.
LONG_FIRST = ["lock_suite", "hot_account_proof", "openapi", "bench_smoke", "safety_regressions",
              "gateway_mysql", "zookeeper", "redis_topologies", "observability", "examples", "model"]


def executables(cargo_args):
    """(display name, path) of every test executable, from cargo's own
    build plan (`--no-run --message-format=json`): builds nothing new after
    the build phase."""
    out = subprocess.run(["cargo", "test", "--all-targets", "--locked", "--no-run", "--message-format=json",
                          *cargo_args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"].get("test"):
            continue
        t = m["target"]
        src = os.path.relpath(t["src_path"], ROOT)
        name = f"unittests {src}" if t["kind"] != ["test"] else src
        found.append((name, t["name"], m["executable"]))
    rank = {n: i for i, n in enumerate(LONG_FIRST)}
    return sorted(found, key=lambda f: rank.get(f[1], len(rank)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("FENCER_TEST_JOBS", "2")))
    ap.add_argument("--test-threads", type=int, default=int(os.environ.get("FENCER_TEST_THREADS", "2")))
    ap.add_argument("cargo_args", nargs="*")
    a = ap.parse_args()
    exes = executables(a.cargo_args)
    lock = threading.Lock()
    failed = []

    def run(item):
        name, _, path = item
        t0 = time.monotonic()
        r = subprocess.run([path, f"--test-threads={a.test_threads}"], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        took = time.monotonic() - t0
        with lock:
            print(f"     Running {name} ({os.path.relpath(path, ROOT)})", flush=True)
            sys.stdout.write(r.stdout)
            print(f"     (wall {took:.1f}s, exit {r.returncode})", flush=True)
            if r.returncode != 0:
                failed.append(name)

    print(f"running {len(exes)} test binaries, {a.jobs} at a time, {a.test_threads} test threads each",
          flush=True)
    with ThreadPoolExecutor(a.jobs) as pool:
        list(pool.map(run, exes))
    if failed:
        print(f"error: {len(failed)} target(s) failed:", flush=True)
        for f in failed:
            print(f"    {f}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
