#!/usr/bin/env python3
"""Draws docs/perf/scaling.png from docs/perf/scaling.json (bench/scaling.py).

One column per lock backend; top row cycles/s, bottom row CPU µs per cycle
(bench client + sidecar + lock backend + counters' Redis, solid; the
sidecar's share, dashed), both against concurrent clients on a log axis,
one line per key count. Cycles/s shares one y axis across backends so they
can be compared by eye.

Needs matplotlib, which this script does not install:
    pip install matplotlib

Usage:
    python3 bench/plot_scaling.py [--json docs/perf/scaling.json]
        [--out docs/perf/scaling.png] [--table]

--table also prints the points as a Markdown table.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def key_label(k):
    exp = len(str(k)) - 1
    return f"10^{exp} keys" if k == 10**exp else f"{k} keys"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=os.path.join(ROOT, "docs/perf/scaling.json"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/perf/scaling.png"))
    ap.add_argument("--table", action="store_true", help="also print a Markdown table")
    a = ap.parse_args()
    with open(a.json) as f:
        doc = json.load(f)
    if a.table:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from scaling import table

        print(table(doc))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("needs matplotlib: pip install matplotlib")

    points = doc["points"]
    backends = list(dict.fromkeys(p["backend"] for p in points))
    keys = sorted({p["keys"] for p in points})
    fig, axes = plt.subplots(
        2, len(backends), figsize=(5.5 * len(backends), 7.5), squeeze=False, sharex=True
    )
    top = max(p["cycles_per_sec"] for p in points) * 1.1
    for col, backend in enumerate(backends):
        rate_ax, cpu_ax = axes[0][col], axes[1][col]
        for i, k in enumerate(keys):
            pts = sorted(
                (p for p in points if p["backend"] == backend and p["keys"] == k),
                key=lambda p: p["clients"],
            )
            if not pts:
                continue
            x = [p["clients"] for p in pts]
            color = f"C{i}"
            rate_ax.plot(x, [p["cycles_per_sec"] for p in pts], "o-", color=color, label=key_label(k))
            per = [p.get("cpu_us_per_cycle") or {} for p in pts]
            cpu_ax.plot(x, [c.get("total", 0) for c in per], "o-", color=color, label=f"{key_label(k)}: all")
            cpu_ax.plot(
                x, [c.get("sidecar", 0) for c in per], "s--", color=color, alpha=0.7,
                label=f"{key_label(k)}: sidecar",
            )
        rate_ax.set_title(f"{backend}: lock cycles/s")
        rate_ax.set_ylim(0, top)
        rate_ax.grid(True, alpha=0.3)
        rate_ax.legend(fontsize=8)
        cpu_ax.set_title(f"{backend}: CPU µs per cycle")
        cpu_ax.set_ylim(bottom=0)
        cpu_ax.grid(True, alpha=0.3)
        cpu_ax.legend(fontsize=7)
        cpu_ax.set_xscale("log", base=2)
        cpu_ax.set_xlabel("concurrent clients")
        clients = sorted({p["clients"] for p in points})
        cpu_ax.set_xticks(clients)
        cpu_ax.set_xticklabels([str(c) for c in clients])
    m = doc.get("machine", {})
    # A debug binary's numbers are several times the product's cost: say so
    # on the figure itself, so it is never mistaken for a result.
    warn = "NOT A RESULT (debug build): " if "debug" in m.get("binary", "") else ""
    load = m.get("loadavg_before")
    load = f", load before {load[0]}" if load else ""
    fig.suptitle(
        f"{warn}fencer sidecar scaling: acquire → counter GET/SET → release\n"
        f"({doc.get('seconds')} s per point, {doc.get('runs')} run(s), {m.get('cores', doc.get('cores'))} cores, "
        f"sidecar {doc.get('sidecar_worker_threads')} thread{load}, {m.get('binary', '')} {m.get('commit', '')})",
        fontsize=9,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"wrote {os.path.relpath(a.out)}")


if __name__ == "__main__":
    main()
