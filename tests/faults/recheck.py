#!/usr/bin/env python3
"""Checks a kept run directory again with the current checker.

  python3 tests/faults/recheck.py /tmp/faults/mixed-0-redis-seed4444 [...]

Everything the checker reads is in the directory — worker histories, the
storage's commit log (storage.db), the sidecars' logs (token injections) and
the nemesis events — except the gateway marks sampled during the run, so S7
is not checked again. For a run whose verdict came from a checker since
corrected (a bound that was too tight), not for changing what a run saw.
"""
import glob
import json
import os
import sqlite3
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run as suite  # noqa: E402
from harness import checker, clock_restarts, eviction, late_requests  # noqa: E402
from harness import observer as observer_mod  # noqa: E402
from harness.scenario import load_history, seam_counts  # noqa: E402

COLS = ["commit_seq", "key", "token", "seq", "lease", "prev", "new", "op_id", "claimed_prev", "t_ns", "method"]
# Columns the storage has recorded since issue 28 (the gateway fuzzer).
FUZZ_COLS = ["raw_token", "raw_path", "fuzz"]


def scenario_of(report):
    """The scenario a run was made from, by the name in its report."""
    name, backend = report["scenario"], report["backend"]
    for mixed in (suite.MIXED, suite.MIXED_SENTINEL, suite.MIXED_CLUSTER, suite.MIXED_REDLOCK,
                  suite.MIXED_ZOOKEEPER, suite.MIXED_MYSQL):
        if name.startswith(mixed["name"] + "-") and name[len(mixed["name"]) + 1:].isdigit():
            return dict(mixed, backend=backend, name=name)
    for f in suite.FAMILIES + [suite.BASELINE]:
        if f["name"] == name:
            return dict(f, backend=backend)
    for base, mutants in (("zk-session", suite.ZOOKEEPER_MUTANTS), ("redlock-majority-restarts",
                                                                     suite.REDLOCK_MUTANTS),
                            ("mysql-cut", suite.MYSQL_MUTANTS), ("seams", suite.SEAM_MUTANTS),
                            ("redis-eviction", suite.EVICTION_MUTANTS),
                            ("gateway-fuzz", suite.FUZZ_MUTANTS)):
        for m in mutants.values():
            if m["name"] == name:
                return dict(next(f for f in suite.FAMILIES if f["name"] == base), **m)
    raise SystemExit(f"unknown scenario {name!r}")


def sidecar_logs(run_dir):
    """Each sidecar's name and its JSON log lines, parsed."""
    out = []
    for log in sorted(glob.glob(os.path.join(run_dir, "sidecar-*", "fencer.log"))):
        lines = []
        with open(log, errors="replace") as f:
            for line in f:
                if line.startswith("{"):
                    try:
                        lines.append(json.loads(line))
                    except ValueError:
                        pass
        out.append((os.path.basename(os.path.dirname(log)), lines))
    return out


def injections(run_dir):
    out = []
    for name, lines in sidecar_logs(run_dir):
        for e in lines:
            fields = e.get("fields", e)
            if fields.get("message") == "token injected":
                out.append(dict(fields, sidecar=name))
    return out


def recheck(run_dir):
    with open(os.path.join(run_dir, "report.json")) as f:
        report = json.load(f)
    sc = scenario_of(report)
    events = []
    for h in sorted(glob.glob(os.path.join(run_dir, "worker-*", "history.jsonl"))):
        events += load_history(h)
    db = sqlite3.connect(os.path.join(run_dir, "storage.db"))
    cols = COLS + [c for c in FUZZ_COLS if c in {r[1] for r in db.execute("PRAGMA table_info(log)")}]
    commits = [dict(zip(cols, r)) for r in db.execute(f"SELECT {', '.join(cols)} FROM log ORDER BY commit_seq")]
    nemesis = load_history(os.path.join(run_dir, "nemesis.jsonl"))
    observed = observer_mod.load(os.path.join(run_dir, "observer.jsonl")) or None
    # The gateway fuzzer's writes (issue 28) are F1's, not the ledger's.
    r = checker.check(events, [c for c in commits if not c.get("fuzz")], injections(run_dir), [], nemesis, sc, observed)
    fuzz_path = os.path.join(run_dir, "fuzz.jsonl")
    if os.path.exists(fuzz_path):
        from harness.fuzzer import stats as fuzz_stats
        fuzz_events = load_history(fuzz_path)
        checker.check_fuzz(r, events, fuzz_events, commits)
        r.bites.update(fuzz_stats(fuzz_events, commits)[0])
    r.bites.update(seam_counts(lines for _, lines in sidecar_logs(run_dir)))
    # Issue 28's checks (O1, A1, E1), as scenario.run makes them.
    late_requests.check(r, events, nemesis, observed)
    clock_restarts.check(r, events, nemesis)
    if eviction.enabled(sc):
        eviction.check(r, events, nemesis, sc, None)
    # Bites scraped from the processes during the run (not in the files).
    for k in ("zk_sessions_expired", "evicted_keys"):
        if k in report.get("bites", {}):
            r.bites[k] = report["bites"][k]
    short = {k: (r.bites.get(k, 0), need) for k, need in sc.get("bite", {}).items() if r.bites.get(k, 0) < need}
    verdict = "FAIL" if r.violations else ("INCONCLUSIVE" if short else "PASS")
    print(json.dumps({"dir": run_dir, "was": report["verdict"], "now": verdict, "bites": r.bites,
                      "violations": [v["property"] + ": " + v["message"] for v in r.violations],
                      "m1_excused": r.stats.get("m1_excused", {}),
                      "below_threshold": short}))
    return verdict == "PASS"


if __name__ == "__main__":
    ok = all([recheck(d) for d in sys.argv[1:]])
    sys.exit(0 if ok else 1)
