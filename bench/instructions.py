#!/usr/bin/env python3
"""Instructions per lock cycle in the sidecar, counted by callgrind.

Wall-clock figures on this 2-core machine move by tens of percent with
other tenants' load; callgrind counts the instructions the sidecar executes,
which depend only on the binary, its inputs and its environment. So this is
the one performance figure a later change can be compared against exactly.

What it does (docs/performance.md, "Instructions per lock cycle"):

1. starts its own redis-server (or uses `--postgres URL`) on a free loopback
   port in a temporary directory;
2. starts `fencer sidecar` under `valgrind --tool=callgrind
   --instr-atstart=no` (Redis backend, proxy off, no gateway, so no
   pre-registration; one keep-alive client);
3. drives `--warmup` acquire/release cycles with instrumentation off
   (connection set-up, script loading, first allocations), zeroes the
   counters, switches instrumentation on, drives exactly `--cycles` cycles
   over one keep-alive HTTP/1.1 connection (TCP_NODELAY), switches it off
   and dumps;
4. prints the sidecar's user-space instructions divided by the cycles and,
   with `--top N`, the N most expensive functions (inclusive) from
   `callgrind_annotate`.

The sidecar's background work in the window (timers, health checks) is
counted too; at the default window it is well under 1% of the total
(compare `--cycles 2000` with `--cycles 4000`).

Usage:
    cargo build --profile profiling
    python3 bench/instructions.py [--binary target/profiling/fencer]
        [--cycles 2000] [--warmup 300] [--top 40] [--keep DIR]
"""

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port, proc, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"process exited with {proc.returncode} before listening on {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"nothing listened on {port} within {timeout}s")


class Api:
    """One keep-alive HTTP/1.1 connection with TCP_NODELAY, as an
    application thread with a persistent connection to its sidecar has."""

    def __init__(self, port):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.conn.connect()
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def post(self, path, body):
        self.conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise SystemExit(f"POST {path}: {resp.status} {data[:200]!r}")
        return data

    def cycle(self, key):
        reply = json.loads(self.post(f"/v1/locks/{key}/acquire", b'{"ttl_ms":10000,"wait_ms":10000}'))
        self.post(f"/v1/locks/{key}/release", json.dumps({"lease_id": reply["lease_id"]}).encode())


def callgrind_control(*args):
    out = subprocess.run(["callgrind_control", *args], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"callgrind_control {' '.join(args)}: {out.stdout}{out.stderr}")


def total_instructions(path):
    """The dump's instructions: the sum over its parts (one per thread)."""
    total, seen = 0, False
    with open(path) as f:
        for line in f:
            if line.startswith("totals:") or line.startswith("summary:"):
                total += int(line.split()[1])
                seen = True
    if not seen:
        raise SystemExit(f"no totals in {path}")
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default="target/profiling/fencer")
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--top", type=int, default=0, help="print the N most expensive functions (inclusive)")
    ap.add_argument("--keep", help="copy the callgrind output here")
    ap.add_argument("--postgres", help="PostgreSQL URL: measure the postgres backend instead of a private Redis")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    args = ap.parse_args()

    binary = os.path.abspath(args.binary)
    if not os.path.exists(binary):
        raise SystemExit(f"{binary} not found; build it with `cargo build --profile profiling`")
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found (apt-get install valgrind)")

    tmp = tempfile.mkdtemp(prefix="fencer-instructions-")
    procs = []
    try:
        env = dict(os.environ)
        env.pop("RUST_LOG", None)
        api_port, admin_port = free_port(), free_port()
        env.update({
            "FENCER_BENCH_SECRET": "instructions-per-cycle-secret-0123456789",
            "FENCER__SIGNING__SECRET_ENV": "FENCER_BENCH_SECRET",
            "FENCER__LOG__LEVEL": "warn",
            "FENCER__SIDECAR__LISTEN": f"127.0.0.1:{api_port}",
            "FENCER__ADMIN__LISTEN": f"127.0.0.1:{admin_port}",
            "FENCER__PROXY__ENABLED": "false",
        })
        if args.postgres:
            backend = "postgres"
            env["FENCER__BACKEND__KIND"] = "postgres"
            env["FENCER__BACKEND__POSTGRES__URL"] = args.postgres
        else:
            backend = "redis"
            redis_port = free_port()
            redis = subprocess.Popen(
                ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", tmp],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(redis)
            wait_port(redis_port, redis, 10)
            env["FENCER__BACKEND__KIND"] = "redis"
            env["FENCER__BACKEND__REDIS__URL"] = f"redis://127.0.0.1:{redis_port}"
        out = os.path.join(tmp, "callgrind.out")
        log = open(os.path.join(tmp, "sidecar.log"), "w")
        sidecar = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
             binary, "sidecar"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append(sidecar)
        wait_port(api_port, sidecar, 120)

        api = Api(api_port)
        key = f"instructions-{os.getpid()}"
        for _ in range(args.warmup):
            api.cycle(key)
        callgrind_control("-z", str(sidecar.pid))
        callgrind_control("-i", "on", str(sidecar.pid))
        started = time.time()
        for _ in range(args.cycles):
            api.cycle(key)
        secs = time.time() - started
        callgrind_control("-i", "off", str(sidecar.pid))
        callgrind_control("-d", str(sidecar.pid))
        dumps = sorted(f for f in os.listdir(tmp) if f.startswith("callgrind.out"))
        dump = os.path.join(tmp, dumps[-1])
        total = total_instructions(dump)
        per_cycle = total / args.cycles
        if args.json:
            print(json.dumps({"backend": backend, "cycles": args.cycles, "instructions": total,
                              "instructions_per_cycle": round(per_cycle)}))
        else:
            print(f"backend {backend}, {args.cycles} cycles (acquire + release) after {args.warmup} warm-up, "
                  f"one keep-alive client, {secs:.1f}s under callgrind")
            print(f"sidecar instructions: {total} total, {per_cycle:,.0f} per cycle")
        if args.top:
            ann = subprocess.run(["callgrind_annotate", "--inclusive=yes", dump],
                                 capture_output=True, text=True).stdout
            rows = [l for l in ann.splitlines() if re.match(r"^\s*[\d,]+ \(", l)]
            for line in rows[:args.top]:
                print(line[:220])
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            shutil.copy(dump, os.path.join(args.keep, "callgrind.out"))
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
