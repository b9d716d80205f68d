"""bench/peers.py's Python peer: N clients run the lock scenario of
src/bench/locks.rs with python-redis-lock: acquire -> non-atomic GET/SET
increment of a per-key counter -> release. Each client has its own
redis-py connection, in its own thread (--mode threads) or its own process
(--mode processes, fork).

Protocol with the driver (one JSON object per stdout line):
  argv: --redis URL --clients N --keys K --seconds S --tag TAG --mode M
  -> {"ready": true, "pids": [...]}  after every connection is up
  <- "go\\n" on stdin
  -> {"cycles": ..., "owner_changes": ..., ...}  when every client stopped
"""

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time

import redis
import redis_lock

# 10 s lock expiry and wait like the bench's ttl_ms/wait_ms (the library
# takes whole seconds and refuses a wait longer than the expiry).
EXPIRE_S = 10
WAIT_S = 10


def pct(v, p):
    """Report::pct of src/bench/stats.rs: sorted µs -> ms."""
    if not v:
        return 0.0
    return v[int((len(v) - 1) * p)] / 1000.0


def client_loop(url, tag, cid, keys, start_evt, deadline_box, last_owner):
    """One client; returns its counts and samples. `last_owner` is a list
    (threads) or a shared array (processes), written only by the holder."""
    conn = redis.Redis.from_url(url)
    conn.ping()
    k = cid % keys
    counter = f"bench-counter:{tag}:{k}"
    lock_name = f"bench-lock:{tag}:{k}"
    r = {"cycles": 0, "owner_changes": 0, "errors": 0, "wait": [], "cycle": []}
    yield  # connected
    start_evt.wait()
    deadline = deadline_box.value
    now = time.monotonic
    while now() < deadline:
        t0 = now()
        # The idiomatic use: a Lock per critical section.
        lock = redis_lock.Lock(conn, lock_name, expire=EXPIRE_S)
        if not lock.acquire(blocking=True, timeout=WAIT_S):
            r["errors"] += 1
            continue
        waited = now() - t0
        v = conn.get(counter)
        conn.set(counter, (int(v) if v is not None else 0) + 1)
        if last_owner[k] != cid:
            r["owner_changes"] += 1
        last_owner[k] = cid
        lock.release()
        r["cycles"] += 1
        r["wait"].append(int(waited * 1e6))
        r["cycle"].append(int((now() - t0) * 1e6))
    yield r


class Box:
    """A deadline shared by threads (processes use mp.Value)."""

    value = 0.0


def run_threads(o):
    start_evt = threading.Event()
    box = Box()
    last_owner = [-1] * o.keys
    gens = [client_loop(o.redis, o.tag, i, o.keys, start_evt, box, last_owner) for i in range(o.clients)]
    for g in gens:
        next(g)  # connect, in this thread (the socket is then used by one thread)
    results = [None] * o.clients

    def body(i):
        results[i] = next(gens[i])

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(o.clients)]
    for t in threads:
        t.start()
    ready([os.getpid()])
    started = time.monotonic()
    box.value = started + o.seconds
    start_evt.set()
    for t in threads:
        t.join()
    return results, time.monotonic() - started


def child(o, cid, start_evt, deadline, last_owner, ready_q, out_q):
    g = client_loop(o.redis, o.tag, cid, o.keys, start_evt, deadline, last_owner)
    next(g)
    ready_q.put(os.getpid())
    out_q.put((cid, next(g)))


def run_processes(o):
    ctx = mp.get_context("fork")
    start_evt = ctx.Event()
    deadline = ctx.Value("d", 0.0, lock=False)
    last_owner = ctx.Array("q", [-1] * o.keys, lock=False)
    ready_q, out_q = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=child, args=(o, i, start_evt, deadline, last_owner, ready_q, out_q), daemon=True)
        for i in range(o.clients)
    ]
    for p in procs:
        p.start()
    pids = [ready_q.get(timeout=30) for _ in procs]
    ready([os.getpid()] + pids)
    started = time.monotonic()
    deadline.value = started + o.seconds
    start_evt.set()
    results = [None] * o.clients
    for _ in procs:
        cid, r = out_q.get(timeout=o.seconds + WAIT_S + 30)
        results[cid] = r
    secs = time.monotonic() - started
    for p in procs:
        p.join(timeout=10)
    return results, secs


def ready(pids):
    sys.stdout.write(json.dumps({"ready": True, "pids": pids}) + "\n")
    sys.stdout.flush()
    go = sys.stdin.readline().strip()
    if go != "go":
        raise SystemExit(f"python peer: expected go, got {go!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", required=True)
    ap.add_argument("--clients", type=int, required=True)
    ap.add_argument("--keys", type=int, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--mode", choices=["threads", "processes"], default="processes")
    o = ap.parse_args()
    results, secs = (run_processes if o.mode == "processes" else run_threads)(o)
    per_key = [0] * o.keys
    out = {"cycles": 0, "owner_changes": 0, "errors": 0, "per_client": []}
    wait, cycle = [], []
    for cid, r in enumerate(results):
        for f in ("cycles", "owner_changes", "errors"):
            out[f] += r[f]
        out["per_client"].append(r["cycles"])
        per_key[cid % o.keys] += r["cycles"]
        wait += r["wait"]
        cycle += r["cycle"]
    conn = redis.Redis.from_url(o.redis)
    lost = 0
    for k in range(o.keys):
        v = conn.get(f"bench-counter:{o.tag}:{k}")
        lost += per_key[k] - (int(v) if v is not None else 0)
    wait.sort()
    cycle.sort()
    out.update(
        secs=secs,
        lost_updates=lost,
        wait_ms={"p50": pct(wait, 0.5), "p99": pct(wait, 0.99), "max": pct(wait, 1.0)},
        cycle_ms={"p50": pct(cycle, 0.5), "p99": pct(cycle, 0.99), "max": pct(cycle, 1.0)},
    )
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
