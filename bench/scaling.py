#!/usr/bin/env python3
"""Scaling curves of the sidecar on Redis and PostgreSQL (issue 32 item 5).

Runs `fencer bench --local --scenario scaling` over the matrix
clients x keys x backend (default 1, 4, 16, 64, 256 clients; 10^3, 10^5,
10^6 keys; redis and postgres), writes every point to
docs/perf/scaling.json and prints the table in Markdown. The bench starts
its own Redis servers, a private PostgreSQL (fsync off) and one sidecar per
backend on free loopback ports; nothing else needs to run, and the
machine's own servers are never touched. bench/plot_scaling.py draws
docs/perf/scaling.png from the JSON.

Per point: cycles/s (acquire -> GET/SET of the key's counter in Redis ->
release), cycle p50/p99, CPU us per cycle of the bench client, the sidecar,
the lock backend and the counters' Redis, CPU cores busy per process and on
the whole machine, lost updates (checked per key; any fails the run) and
errors.

Time: 30 points x (1 s warm-up + --seconds) x --runs, plus about 10 s of
start-up and the per-key checks: about 6 minutes at the defaults. Run it
on an otherwise idle machine; the numbers of a busy one say little.

Usage:
    cargo build --profile profiling
    python3 bench/scaling.py [--fencer target/profiling/fencer]
        [--seconds 10] [--runs 1] [--clients 1,4,16,64,256]
        [--keys 1000,100000,1000000] [--backend redis,postgres]
        [--out docs/perf/scaling.json]
    python3 bench/plot_scaling.py

(target/debug/fencer works for trying the script out; its numbers are not
the product's.)
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def table(doc):
    """The points as a Markdown table."""
    head = (
        "| backend | clients | keys | cycles/s | p50 ms | p99 ms "
        "| CPU µs/cycle client | sidecar | backend | total "
        "| cores sidecar | cores backend | cores machine | lost | errors |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in doc["points"]:
        per = p.get("cpu_us_per_cycle") or {}
        cores = p.get("cpu_cores") or {}
        lines.append(
            "| {} | {} | {} | {:.0f} | {:.2f} | {:.2f} | {:.0f} | {:.0f} | {:.0f} | {:.0f} "
            "| {:.2f} | {:.2f} | {:.2f} | {} | {} |".format(
                p["backend"],
                p["clients"],
                p["keys"],
                p["cycles_per_sec"],
                p["cycle_p50_ms"],
                p["cycle_p99_ms"],
                per.get("client", 0),
                per.get("sidecar", 0),
                per.get("backend", 0),
                per.get("total", 0),
                cores.get("sidecar", 0),
                cores.get("backend", 0),
                p.get("machine_busy_cores") or 0,
                p["lost_updates"],
                p["errors"],
            )
        )
    return "\n".join(lines)


def machine():
    """What the numbers were measured on."""
    info = {"cores": os.cpu_count()}
    try:
        with open("/proc/loadavg") as f:
            info["loadavg_before"] = f.read().split()[:3]
    except OSError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        rev = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        info["commit"] = rev.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fencer", default=os.path.join(ROOT, "target/profiling/fencer"))
    ap.add_argument("--seconds", type=int, default=10, help="measured seconds per point and run")
    ap.add_argument("--runs", type=int, default=1, help="runs per point (median reported)")
    ap.add_argument("--clients", default="1,4,16,64,256")
    ap.add_argument("--keys", default="1000,100000,1000000")
    ap.add_argument("--backend", default="redis,postgres")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/perf/scaling.json"))
    a = ap.parse_args()
    if not os.path.exists(a.fencer):
        sys.exit(f"{a.fencer} not found: cargo build --profile profiling (or give --fencer)")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    tmp = a.out + ".partial"
    cmd = [
        a.fencer,
        "bench",
        "--local",
        "--scenario",
        "scaling",
        "--seconds",
        str(a.seconds),
        "--runs",
        str(a.runs),
        "--clients",
        a.clients,
        "--keys",
        a.keys,
        "--backend",
        a.backend,
        "--json",
        tmp,
    ]
    info = machine()
    load = float(info.get("loadavg_before", ["0"])[0])
    if load > 0.5 * (info["cores"] or 1):
        print(
            f"warning: load average {load} on {info['cores']} cores: the machine is not idle, "
            "so these numbers measure the neighbours too",
            file=sys.stderr,
        )
    started = time.time()
    print("$ " + " ".join(cmd), flush=True)
    # The bench prints a row per point as it goes.
    rc = subprocess.run(cmd).returncode
    if not os.path.exists(tmp):
        sys.exit(f"fencer bench failed (exit {rc}) before writing any point")
    with open(tmp) as f:
        doc = json.load(f)
    os.remove(tmp)
    info["binary"] = os.path.relpath(os.path.abspath(a.fencer), ROOT)
    info["wall_seconds"] = round(time.time() - started)
    try:
        with open("/proc/loadavg") as f:
            info["loadavg_after"] = f.read().split()[:3]
    except OSError:
        pass
    doc["machine"] = info
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print()
    print(table(doc))
    print(f"\nwrote {os.path.relpath(a.out)} in {info['wall_seconds']} s")
    if rc != 0:
        sys.exit(f"fencer bench exited {rc} (lost updates?); the points are in {a.out}")


if __name__ == "__main__":
    main()
