#!/usr/bin/env python3
"""Keeps the copies of fencer's configuration, dashboards and alert rules
that live under deploy/ equal to their sources.

Why copies: `kubectl kustomize` (and every GitOps tool that renders
kustomize with default settings) refuses files outside the kustomization's
own directory tree, and Helm's `.Files` sees only files inside the chart.
The sources stay where users and tests find them (config/, grafana/,
deploy/prometheus/); this script writes the copies, and
`sync_copies.py --check` (run by tests/deploy.rs) fails when one drifted,
went missing, or is left over from a deleted source.

usage: deploy/sync_copies.py           # rewrite the copies
       deploy/sync_copies.py --check   # exit 1 on any drift
"""
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Directory of copies -> list of (source, name inside that directory).
DASHBOARDS = sorted((ROOT / "grafana/dashboards").glob("*.json"))
COPIES = {
    "deploy/kustomize/base/files": [
        ("config/sidecar.toml", "sidecar.toml"),
        ("config/gateway.toml", "gateway.toml"),
    ]
    + [(f"grafana/dashboards/{d.name}", f"dashboards/{d.name}") for d in DASHBOARDS],
    "deploy/helm/fencer/files": [
        ("config/sidecar.toml", "sidecar.toml"),
        ("config/gateway.toml", "gateway.toml"),
        ("deploy/prometheus/fencer-rules.yaml", "fencer-rules.yaml"),
    ]
    + [(f"grafana/dashboards/{d.name}", f"dashboards/{d.name}") for d in DASHBOARDS],
}


def main(check):
    drift = []
    for copy_dir, entries in COPIES.items():
        base = ROOT / copy_dir
        wanted = set()
        for source, name in entries:
            src = (ROOT / source).read_bytes()
            dst = base / name
            wanted.add(dst)
            if dst.exists() and dst.read_bytes() == src:
                continue
            if check:
                drift.append(f"{dst.relative_to(ROOT)} differs from {source}")
            else:
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(src)
                print(f"wrote {dst.relative_to(ROOT)}")
        for leftover in sorted(p for p in base.rglob("*") if p.is_file() and p not in wanted):
            if check:
                drift.append(f"{leftover.relative_to(ROOT)} has no source any more")
            else:
                leftover.unlink()
                print(f"removed {leftover.relative_to(ROOT)}")
    for d in drift:
        print("DRIFT", d)
    if drift:
        print("run: python3 deploy/sync_copies.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv[1:]))
