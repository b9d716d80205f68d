#!/usr/bin/env python3
"""fencer vs. the lock libraries it replaces, in one run on one private Redis.

Peers (each client has its own connection, as separate app threads would):
  direct  fencer's compiled direct Redis client: `fencer bench`'s baseline
          side (SET NX PX, 10 ms polling, Lua compare-and-delete)
  fencer  the sidecar over HTTP: `fencer bench`'s fencer side
  node    redis-semaphore Mutex over ioredis, one process, N async clients
          (pinned in bench/peers/node/package-lock.json, installed by `npm ci`)
  python  python-redis-lock (SET NX EX, BLPOP wake-up), pinned in
          bench/peers/python/requirements.txt, installed into a venv under
          ~/.cache/fencer-peers; N threads in one process
  python-procs  the same with one process per client: the GIL caps the
          threads at one core, processes are not capped but pay an
          interpreter each; both are measured so the run shows which wins

Scenarios: uncontended-1 (1 client, 1 key), uncontended-16 (16 clients, a key
each), contended-16 (16 clients, one key). Every cycle: acquire -> non-atomic
GET/SET increment of a per-key counter in the same Redis -> release, as in
src/bench/locks.rs, so lost updates are counted for every peer.

Usage (from the repository root; the release-like binary first):
  cargo build --profile profiling
  python3 bench/peers.py --runs 5 --seconds 5 --json peers.json
  python3 bench/peers.py --runs 1 --seconds 2            # a quick look
Options: --fencer PATH (default target/profiling/fencer, else target/debug/fencer
for development), --scenarios a,b, --peers direct,fencer,node,python,python-procs,
--no-setup (skip npm ci / pip install).

The script starts one redis-server (no persistence) and one sidecar on free
loopback ports, runs every scenario's peers interleaved within each run
(their order rotates from run to run), and reports the median run (by
cycles/s) per scenario and peer, with ratios to the direct client of the same
run: cycles/s, cycle p50/p99, owner changes/s (handoffs to a different
client), wait p99, lost updates, errors, and CPU µs per cycle of the client
process(es), the sidecar and Redis (from /proc/<pid>/stat, as
src/bench/local.rs cpu_secs). `fencer bench` runs both its sides in one
process (fencer first); the split of its CPU between them is taken when the
sidecar's HTTP connections close (the fencer side's end), so the direct
side's client CPU includes the process's exit and the fencer side's its start.
Every wait has a timeout; only processes started here are stopped.
"""

import argparse
import hashlib
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS_DIR = ROOT / "bench" / "peers"
NODE_DIR = PEERS_DIR / "node"
PY_REQ = PEERS_DIR / "python" / "requirements.txt"
VENV = Path.home() / ".cache" / "fencer-peers" / "venv"

SCENARIOS = {
    "uncontended-1": (1, 1),
    "uncontended-16": (16, 16),
    "contended-16": (16, 1),
}
PEERS = ["direct", "fencer", "node", "python", "python-procs"]
SECRET = "fencer-bench-secret-0123456789abcdef0123456789"
TICK = os.sysconf("SC_CLK_TCK")

# Processes started here, killed (their process group) on exit.
STARTED = []


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run_cmd(cmd, timeout, cwd=None, env=None):
    """A setup command with a timeout; raises with its output on failure."""
    r = subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.stdout


def setup(want):
    """`npm ci` and the venv, when missing or out of date (a stamp file
    holds the hash of the lock file they were made from)."""
    if "node" in want:
        lock = (NODE_DIR / "package-lock.json").read_bytes()
        stamp = NODE_DIR / "node_modules" / ".fencer-peers-stamp"
        h = hashlib.sha256(lock).hexdigest()
        if not stamp.exists() or stamp.read_text() != h:
            log("peers: npm ci in bench/peers/node")
            run_cmd(["npm", "ci", "--no-audit", "--no-fund"], 600, cwd=NODE_DIR)
            stamp.write_text(h)
    if "python" in want or "python-procs" in want:
        req = PY_REQ.read_bytes()
        stamp = VENV / ".fencer-peers-stamp"
        h = hashlib.sha256(req).hexdigest()
        if not stamp.exists() or stamp.read_text() != h:
            log(f"peers: pip install into {VENV}")
            if not (VENV / "bin" / "python").exists():
                run_cmd([sys.executable, "-m", "venv", str(VENV)], 300)
            run_cmd([str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", "-r", str(PY_REQ)], 600)
            stamp.write_text(h)


def free_port():
    """A free port below Linux's ephemeral range, as local.rs free_port."""
    for _ in range(1000):
        port = random.randint(20000, 31999)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise SystemExit("no free port")


def spawn(cmd, stdout, env=None, stdin=subprocess.DEVNULL, cwd=None):
    p = subprocess.Popen(
        cmd, stdin=stdin, stdout=stdout, stderr=subprocess.PIPE if stdout == subprocess.PIPE else stdout,
        env=env, cwd=cwd, start_new_session=True,
    )
    STARTED.append(p)
    return p


def stop(p, grace=3.0):
    """SIGTERM, then SIGKILL, to the process group of `p` (its own session,
    made at spawn: only what this script started)."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass


def stop_all():
    while STARTED:
        stop(STARTED.pop())


def wait_tcp(p, port, what, log_path, timeout=15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if p.poll() is not None:
            break
        time.sleep(0.05)
    raise SystemExit(f"{what} did not listen on {port}:\n{Path(log_path).read_text()[-2000:]}")


def start_redis(tmp):
    port = free_port()
    d = tmp / "redis"
    d.mkdir()
    logf = open(d / "out.log", "w")
    p = spawn(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(d)],
        logf,
    )
    wait_tcp(p, port, "redis-server", d / "out.log")
    return p, f"redis://127.0.0.1:{port}/0"


def clean_env():
    """This environment without fencer's settings, RUST_LOG and OpenTelemetry
    variables: the sidecar and `fencer bench` run as configured here only."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("FENCER", "OTEL_")) and k != "RUST_LOG"}


def start_sidecar(fencer, tmp, redis_url):
    """The sidecar as `fencer bench --local` starts it (src/bench/mod.rs)."""
    port = free_port()
    d = tmp / "sidecar"
    d.mkdir()
    env = clean_env()
    env.update(
        FENCER_BENCH_SECRET=SECRET,
        FENCER__SIGNING__SECRET_ENV="FENCER_BENCH_SECRET",
        FENCER__LOG__LEVEL="warn",
        FENCER__SIDECAR__LISTEN=f"127.0.0.1:{port}",
        FENCER__PROXY__ENABLED="false",
        FENCER__BACKEND__KIND="redis",
        FENCER__BACKEND__REDIS__URL=redis_url,
        FENCER__ADMIN__LISTEN=f"127.0.0.1:{free_port()}",
    )
    logf = open(d / "out.log", "w")
    p = spawn([str(fencer), "sidecar"], logf, env=env, cwd=d)
    wait_tcp(p, port, "fencer sidecar", d / "out.log")
    return p, f"http://127.0.0.1:{port}"


def stat_fields(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_secs(pid):
    """utime + stime of `pid` (as local.rs cpu_secs) plus cutime + cstime
    (children it has reaped: the Python peer's client processes)."""
    try:
        f = stat_fields(pid)
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return sum(int(x) for x in f[11:15]) / TICK


def tree_cpu(pids):
    """CPU seconds of `pids` (a peer's processes) that are still alive."""
    return sum(c for c in (cpu_secs(p) for p in pids) if c is not None)


def fd_count(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


class LineReader:
    """Lines from a child's stdout, each with a deadline."""

    def __init__(self, p):
        self.p, self.buf = p, b""

    def line(self, timeout, what):
        end = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}: no answer within {timeout:.0f} s")
            r, _, _ = select.select([self.p.stdout], [], [], min(left, 0.5))
            if r:
                chunk = os.read(self.p.stdout.fileno(), 65536)
                if not chunk:
                    err = self.p.stderr.read().decode(errors="replace") if self.p.stderr else ""
                    raise RuntimeError(f"{what}: exited ({self.p.wait(5)}): {err[-2000:]}")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


LINE = re.compile(
    r"^\s+(fencer|baseline)\s+cycles/s\s+(?P<cps>[\d.]+)\s+owner changes/s\s+(?P<ocps>[\d.]+)\s+"
    r"wait p50/p99/max ms\s+(?P<w50>[\d.]+)/\s*(?P<w99>[\d.]+)/\s*(?P<wmax>[\d.]+)\s+"
    r"cycle p50/p99 ms\s+(?P<c50>[\d.]+)/\s*(?P<c99>[\d.]+)\s+fairness\s+(?P<fair>[\d.]+)\s+"
    r"lost\s+(?P<lost>-?\d+)\s+errors\s+(?P<errors>\d+)"
)


def bench_pair(o, sc, env):
    """`fencer bench` for one scenario: its fencer side, then its direct
    (baseline) side, with the CPU of each."""
    n0 = fd_count(o.sidecar.pid)
    cmd = [str(o.fencer), "bench", "--scenario", sc, "--api", o.api, "--redis", o.redis_url,
           "--seconds", str(o.seconds), "--runs", "1"]
    r0, s0 = cpu_secs(o.redis.pid), cpu_secs(o.sidecar.pid)
    t0 = time.monotonic()
    p = spawn(cmd, subprocess.PIPE, env=env)
    limit = 2 * o.seconds + 60
    # The fencer side's end: the sidecar's HTTP connections close. Poll
    # coarsely until near it (the poller's CPU competes for 2 cores), then
    # every millisecond.
    rusage = None

    def reap():
        # The whole process's CPU (all threads) from wait4 when it exits
        # (Popen.poll would reap it without the rusage).
        nonlocal rusage
        if rusage is None:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid == p.pid:
                rusage = ru
                p.returncode = os.waitstatus_to_exitcode(status)
        return rusage is not None

    rose, mid = False, None
    while time.monotonic() - t0 < o.seconds + 30 and not reap():
        n = fd_count(o.sidecar.pid)
        if n > n0:
            rose = True
        elif rose and n <= n0:
            mid = (cpu_secs(p.pid), cpu_secs(o.redis.pid), cpu_secs(o.sidecar.pid))
            break
        near = rose and time.monotonic() - t0 > o.seconds - 0.3
        time.sleep(0.001 if near else 0.02)
    end = t0 + limit
    while time.monotonic() < end and not reap():
        time.sleep(0.02)
    if rusage is None:
        stop(p)
        raise TimeoutError(f"fencer bench {sc}: still running after {limit} s")
    out = p.stdout.read().decode(errors="replace")
    err = p.stderr.read().decode(errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"fencer bench {sc} failed ({p.returncode}):\n{out}\n{err}")
    STARTED.remove(p)
    r1, s1 = cpu_secs(o.redis.pid), cpu_secs(o.sidecar.pid)
    client_total = rusage.ru_utime + rusage.ru_stime
    sides = {}
    for line in out.splitlines():
        m = LINE.match(line)
        if m:
            sides["fencer" if m.group(1) == "fencer" else "direct"] = m
    if set(sides) != {"fencer", "direct"}:
        raise RuntimeError(f"fencer bench {sc}: unexpected output:\n{out}\n{err}")
    res = {}
    for name, m in sides.items():
        res[name] = {
            "cycles_per_s": float(m["cps"]),
            "owner_changes_per_s": float(m["ocps"]),
            "wait_p50_ms": float(m["w50"]), "wait_p99_ms": float(m["w99"]),
            "cycle_p50_ms": float(m["c50"]), "cycle_p99_ms": float(m["c99"]),
            "lost_updates": int(m["lost"]), "errors": int(m["errors"]),
            "fairness": float(m["fair"]),
            "secs": float(o.seconds),
        }
    if mid is not None and None not in mid:
        split = {
            "fencer": (mid[0], mid[2] - s0, mid[1] - r0),
            "direct": (client_total - mid[0], s1 - mid[2], r1 - mid[1]),
        }
        for name, (c, s, r) in split.items():
            cycles = max(1.0, res[name]["cycles_per_s"] * o.seconds)
            res[name]["cpu_us_per_cycle"] = cpu_dict(c, s, r, cycles, name == "fencer")
    else:
        log(f"peers: {sc}: the fencer side's end was not seen; no CPU split")
    return res


def cpu_dict(client, sidecar, redis, cycles, uses_sidecar):
    """CPU µs per cycle. The sidecar counts in the total only for the peer
    that uses it; for the others its (idle) CPU is kept as `sidecar_idle`."""
    per = lambda s: 1e6 * s / cycles  # noqa: E731
    d = {"client": per(client), "redis": per(redis)}
    d["sidecar" if uses_sidecar else "sidecar_idle"] = per(sidecar)
    d["total"] = d["client"] + d["redis"] + (d["sidecar"] if uses_sidecar else 0.0)
    return d


def peer_run(o, peer, sc):
    """One run of the node or Python peer for scenario `sc`."""
    clients, keys = SCENARIOS[sc]
    tag = f"{sc}-{peer}-{random.getrandbits(32)}"
    common = ["--redis", o.redis_url, "--clients", str(clients), "--keys", str(keys),
              "--seconds", str(o.seconds), "--tag", tag]
    if peer == "node":
        cmd = ["node", str(NODE_DIR / "peer.js")] + common
    else:
        cmd = [str(VENV / "bin" / "python"), str(PEERS_DIR / "python" / "peer.py")] + common + [
            "--mode", "processes" if peer == "python-procs" else "threads"]
    p = spawn(cmd, subprocess.PIPE, stdin=subprocess.PIPE)
    try:
        rd = LineReader(p)
        ready = json.loads(rd.line(60, f"{peer} {sc} ready"))
        pids = ready["pids"]
        c0, r0, s0 = tree_cpu(pids), cpu_secs(o.redis.pid), cpu_secs(o.sidecar.pid)
        p.stdin.write(b"go\n")
        p.stdin.flush()
        res = json.loads(rd.line(o.seconds + 60, f"{peer} {sc} result"))
        # The Python parent has reaped its client processes by now: their
        # CPU is in its cutime/cstime.
        c1, r1, s1 = cpu_secs(pids[0]), cpu_secs(o.redis.pid), cpu_secs(o.sidecar.pid)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    finally:
        stop(p)
        STARTED.remove(p)
    secs = res["secs"]
    out = {
        "cycles_per_s": res["cycles"] / secs,
        "owner_changes_per_s": res["owner_changes"] / secs,
        "wait_p50_ms": res["wait_ms"]["p50"], "wait_p99_ms": res["wait_ms"]["p99"],
        "cycle_p50_ms": res["cycle_ms"]["p50"], "cycle_p99_ms": res["cycle_ms"]["p99"],
        "lost_updates": res["lost_updates"], "errors": res["errors"],
        "fairness": min(res["per_client"]) / max(1, max(res["per_client"])),
        "secs": secs,
        "cpu_us_per_cycle": cpu_dict(c1 - c0, s1 - s0, r1 - r0, max(1, res["cycles"]), False),
    }
    return out


def median_run(runs):
    """The run whose cycles/s is the median (upper for even counts), as
    src/bench/stats.rs median_run."""
    s = sorted(runs, key=lambda r: r["cycles_per_s"])
    return s[len(s) // 2]


def fmt(v, d=2):
    return "–" if v is None else f"{v:.{d}f}"


def table(summary, peers):
    cols = ["scenario", "peer", "cycles/s", "× direct", "cycle p50 ms", "cycle p99 ms", "owner changes/s",
            "wait p99 ms", "lost", "errors", "CPU µs/cycle client", "sidecar", "redis", "total", "CPU × direct"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for sc, per in summary.items():
        for peer in peers:
            m = per.get(peer)
            if m is None:
                continue
            cpu = m.get("cpu_us_per_cycle") or {}
            sidecar = cpu.get("sidecar")
            lines.append("| " + " | ".join([
                sc, peer, f"{m['cycles_per_s']:.0f}", fmt(m.get("ratio_cycles_per_s")),
                fmt(m["cycle_p50_ms"]), fmt(m["cycle_p99_ms"]), f"{m['owner_changes_per_s']:.0f}",
                fmt(m["wait_p99_ms"]), str(m["lost_updates"]), str(m["errors"]),
                fmt(cpu.get("client"), 1), fmt(sidecar, 1), fmt(cpu.get("redis"), 1), fmt(cpu.get("total"), 1),
                fmt(m.get("ratio_cpu_total")),
            ]) + " |")
    return "\n".join(lines)


def versions(o):
    v = {"fencer_binary": str(o.fencer)}
    for name, cmd in [("redis_server", ["redis-server", "--version"]), ("node", ["node", "--version"])]:
        try:
            v[name] = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            v[name] = None
    pkg = json.loads((NODE_DIR / "package.json").read_text())
    v["node_packages"] = pkg["dependencies"]
    v["python_packages"] = [l for l in PY_REQ.read_text().splitlines() if l and not l.startswith("#")]
    try:
        v["python"] = subprocess.run([str(VENV / "bin" / "python"), "--version"], capture_output=True,
                                     text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        v["python"] = None
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fencer", type=Path, default=None, help="fencer binary (default target/profiling/fencer)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-setup", action="store_true")
    o = ap.parse_args()
    if not (1 <= o.runs <= 101 and 1 <= o.seconds <= 3600):
        raise SystemExit("--runs 1..101, --seconds 1..3600")
    scenarios = [s.strip() for s in o.scenarios.split(",") if s.strip()]
    peers = [p.strip() for p in o.peers.split(",") if p.strip()]
    for s in scenarios:
        if s not in SCENARIOS:
            raise SystemExit(f"unknown scenario {s}; choose from {', '.join(SCENARIOS)}")
    for p in peers:
        if p not in PEERS:
            raise SystemExit(f"unknown peer {p}; choose from {', '.join(PEERS)}")
    if "direct" not in peers:
        peers.insert(0, "direct")  # the ratios' reference
    if o.fencer is None:
        o.fencer = ROOT / "target" / "profiling" / "fencer"
        if not o.fencer.exists():
            o.fencer = ROOT / "target" / "debug" / "fencer"
            log(f"peers: no target/profiling/fencer; using {o.fencer} (development only: not for numbers)")
    if not o.fencer.exists():
        raise SystemExit(f"{o.fencer}: no such binary (cargo build --profile profiling)")
    for tool in ["redis-server"] + (["node"] if "node" in peers else []):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found")
    if not o.no_setup:
        setup(peers)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="fencer-peers-"))
    try:
        o.redis, o.redis_url = start_redis(tmp)
        o.sidecar, o.api = start_sidecar(o.fencer, tmp, o.redis_url)
        bench_env = clean_env()
        units = []
        if "direct" in peers or "fencer" in peers:
            units.append("bench")
        units += [p for p in ("node", "python", "python-procs") if p in peers]
        raw = {sc: {p: [] for p in peers} for sc in scenarios}
        load0 = os.getloadavg()
        for run in range(o.runs):
            order = units[run % len(units):] + units[: run % len(units)]
            for sc in scenarios:
                for unit in order:
                    log(f"peers: run {run + 1}/{o.runs} {sc} {unit}")
                    if unit == "bench":
                        for name, r in bench_pair(o, sc, bench_env).items():
                            if name in raw[sc]:
                                raw[sc][name].append(r)
                    else:
                        raw[sc][unit].append(peer_run(o, unit, sc))
        load1 = os.getloadavg()
    finally:
        stop_all()
        shutil.rmtree(tmp, ignore_errors=True)

    summary = {}
    for sc in scenarios:
        per = {}
        direct = raw[sc]["direct"]
        for peer in peers:
            runs = raw[sc][peer]
            if not runs:
                continue
            m = dict(median_run(runs))
            d = median_run(direct)
            m["ratio_cycles_per_s"] = statistics.median(
                [r["cycles_per_s"] / max(1e-9, b["cycles_per_s"]) for r, b in zip(runs, direct)]
            )
            m["ratio_cycle_p50"] = m["cycle_p50_ms"] / max(1e-9, d["cycle_p50_ms"])
            if m.get("cpu_us_per_cycle") and d.get("cpu_us_per_cycle"):
                m["ratio_cpu_total"] = m["cpu_us_per_cycle"]["total"] / max(1e-9, d["cpu_us_per_cycle"]["total"])
            m["runs_cycles_per_s"] = [round(r["cycles_per_s"], 1) for r in runs]
            per[peer] = m
        summary[sc] = per

    print(f"fencer vs. lock libraries: {o.runs} run(s) × {o.seconds} s per scenario and peer, one private Redis, "
          f"median run by cycles/s; ratios to the direct client of the same run (cycles/s: median of per-run ratios). "
          f"Load average {load0[0]:.2f} before, {load1[0]:.2f} after.\n")
    print(table(summary, peers))
    lost = [f"{sc} {p}: {r['lost_updates']}" for sc in scenarios for p in peers
            for r in raw[sc][p] if r["lost_updates"]]
    if lost:
        print("\nLOST UPDATES (a peer let two clients into the critical section): " + ", ".join(lost))
    if o.json:
        o.json.write_text(json.dumps({
            "args": {"runs": o.runs, "seconds": o.seconds, "scenarios": scenarios, "peers": peers},
            "machine": {"nproc": os.cpu_count(), "loadavg_before": load0, "loadavg_after": load1},
            "versions": versions(o),
            "summary": summary,
            "runs": raw,
        }, indent=2))
        log(f"peers: wrote {o.json}")


if __name__ == "__main__":
    main()
