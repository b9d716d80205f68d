#!/usr/bin/env python3
"""Prints where a CI run's time went (issue 29): wall time per phase (fmt,
clippy, build, each test binary, the fault suite's runs), largest first
within each part, and a loud line when the whole run is over its budget.

Usage: ci_times.py <phases file> <start unix time> [<cargo test log>]
[<fault suite log>]. The phases file has one "<name> <seconds>" line per
phase (.ci/run and tests/run.sh append to it). Warns, never fails: noise on
a shared machine must not reject good work.
"""
import re
import sys
import time

BUDGET_MIN = 35
# The fault suite's PR tier has a budget of its own (issue 29): a family
# added must fit in it (shorter schedules, or the runs two at a time).
FAULT_BUDGET_MIN = 13
FAULT_PHASE = "fault suite (PR tier)"


def phases(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                name, _, secs = line.rstrip("\n").rpartition(" ")
                if name and secs.isdigit():
                    out.append((name, int(secs)))
    except OSError:
        pass
    return out


def test_binaries(path):
    """(binary, seconds, tests) from `cargo test` output: each `Running`
    line is followed by its `test result: … finished in Xs`."""
    out, current = [], None
    try:
        with open(path, errors="replace") as f:
            for line in f:
                m = re.match(r"\s*(Running|Doc-tests)\s+(unittests\s+\S+|\S+)", line)
                if m:
                    current = m.group(2) if m.group(1) == "Running" else f"doc-tests {m.group(2)}"
                    continue
                m = re.search(r"test result: (\w+)\. (\d+) passed; (\d+) failed.*finished in ([\d.]+)s", line)
                if m and current:
                    out.append((current, float(m.group(4)), int(m.group(2)) + int(m.group(3)), m.group(1)))
                    current = None
    except OSError:
        pass
    return out


def fault_runs(path):
    """(run name, seconds, ok, seconds bringing its processes up and down)
    from the fault suite's `[ok] name … NNs … setup=Ss down=Ds` lines."""
    out = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                m = re.match(r"\[(ok|BAD)\]\s+(\S+)\s+\S+\s+expect\s+\S+\s+([\d.]+)s", line)
                if m:
                    ud = re.search(r" setup=([\d.]+)s down=([\d.]+)s", line)
                    updown = float(ud.group(1)) + float(ud.group(2)) if ud else 0.0
                    out.append((m.group(2), float(m.group(3)), m.group(1) == "ok", updown))
    except OSError:
        pass
    return out


def fmt(secs):
    return f"{int(secs) // 60:>3}m{int(secs) % 60:02d}s"


def main():
    start = int(sys.argv[2])
    total = int(time.time()) - start
    print("\n==================== CI time by phase ====================")
    for name, secs in phases(sys.argv[1]):
        print(f"  {name:<44} {fmt(secs)}")
    if len(sys.argv) > 3:
        bins = test_binaries(sys.argv[3])
        if bins:
            print(f"  -- test binaries ({len(bins)}, {sum(b[2] for b in bins)} tests; "
                  f"{fmt(sum(b[1] for b in bins))} in all), largest first:")
            for name, secs, n, result in sorted(bins, key=lambda b: -b[1]):
                flag = "" if result == "ok" else "  FAILED"
                print(f"     {name:<41} {fmt(secs)}  {n:>4} tests{flag}")
    if len(sys.argv) > 4:
        runs = fault_runs(sys.argv[4])
        if runs:
            print(f"  -- fault suite runs ({len(runs)}; {fmt(sum(r[1] for r in runs))} in all, of which "
                  f"{fmt(sum(r[3] for r in runs)).strip()} bringing servers and fencer up and down), largest first:")
            for name, secs, ok, _ in sorted(runs, key=lambda r: -r[1]):
                print(f"     {name:<41} {fmt(secs)}{'' if ok else '  BAD'}")
    print(f"  {'total':<44} {fmt(total)}")
    fault = dict(phases(sys.argv[1])).get(FAULT_PHASE)
    if fault is not None and fault > FAULT_BUDGET_MIN * 60:
        print(f"\n!!!!! FAULT SUITE BUDGET EXCEEDED: {fmt(fault).strip()} > {FAULT_BUDGET_MIN} minutes !!!!!")
    if total > BUDGET_MIN * 60:
        print(f"\n!!!!! CI BUDGET EXCEEDED: {fmt(total).strip()} > {BUDGET_MIN} minutes !!!!!")
    print("==========================================================")


if __name__ == "__main__":
    main()
