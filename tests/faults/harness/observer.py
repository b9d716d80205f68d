"""The lock backend's own record of who holds each key, sampled.

M1 compares what sidecars *told* clients with each other; this gives it a
second witness. A thread samples the backend directly (not through a fault
proxy) every ~25 ms: per scenario key, the lease whose entry is live and the
time it has left *on the backend's clock* — Redis `PTTL` of the lock entry,
PostgreSQL and MySQL `expires_at` minus the server's own time. The checker
(`checker.late_answers`) then asks of every "held, N ms left" answer: did
the backend still hold that lease N ms after the client read the answer?
An answer sent after the lease ran out (issue 26's `answer_after_deadline`)
fails that even when no other client wanted the key, which M1's overlap
test cannot see.

A sample is the state at some instant between its `t0` and `t1` (monotonic
ns, the workers' clock). Only changes are written (`observer.jsonl`): a new
holder, no holder, or a live entry whose expiry moved (a renewal) by more
than `MOVE_NS`. Backends without an observer (ZooKeeper, the Redis
topologies, RedLock) are not checked this way.
"""
import json
import os
import select
import subprocess
import threading
import time

from .procs import lock_key, resp

EVERY_S = 0.025
# An expiry that moved by less than this is not written (sampling jitter).
MOVE_NS = 20_000_000

# Every key's live entry and its time left, read atomically on the server.
REDIS_SCRIPT = ("local out = {} for i, k in ipairs(KEYS) do "
                "out[#out + 1] = redis.call('GET', k) or '' "
                "out[#out + 1] = redis.call('PTTL', k) end return out")


class Observer(threading.Thread):
    def __init__(self, cluster, keys, path):
        super().__init__(daemon=True)
        self.cluster, self.keys, self.path = cluster, list(keys), path
        self.stop_flag = threading.Event()
        self.samples = 0
        self.errors = 0
        self._pipe = None

    @staticmethod
    def supports(cluster):
        return bool(cluster.redis or cluster.my or (cluster.sc["backend"] == "postgres"))

    def stop(self):
        self.stop_flag.set()
        self.join(timeout=5)
        if self._pipe:
            self._pipe.kill()

    def run(self):
        last = {}
        with open(self.path, "w", buffering=1) as out:
            while not self.stop_flag.is_set():
                t0 = time.monotonic_ns()
                try:
                    rows = self.sample()
                except Exception as e:  # down, paused, restarting: no sample
                    self.errors += 1
                    if self._pipe:
                        self._pipe.kill()
                        self._pipe = None
                    if last.get("_error") is None:
                        out.write(json.dumps({"t0": t0, "error": repr(e)[:200]}) + "\n")
                        last["_error"] = True
                    self.stop_flag.wait(0.1)
                    continue
                t1 = time.monotonic_ns()
                self.samples += 1
                last.pop("_error", None)
                for key in self.keys:
                    lease, left = rows.get(key, (None, None))
                    prev = last.get(key)
                    expiry = t0 + left * 1_000_000 if lease else None
                    if (prev is None or prev[0] != lease
                            or (lease and abs(expiry - prev[1]) > MOVE_NS)):
                        out.write(json.dumps({"t0": t0, "t1": t1, "key": key, "lease": lease,
                                              "left_ms": left if lease else None}) + "\n")
                        last[key] = (lease, expiry)
                self.stop_flag.wait(EVERY_S)

    def sample(self):
        """{key: (lease id, ms left)} for keys with a live entry."""
        c = self.cluster
        if c.redis:
            names = [lock_key(k) for k in self.keys]
            flat = resp(c.redis.port, "EVAL", REDIS_SCRIPT, len(names), *names, timeout=0.5)
            out = {}
            for key, value, pttl in zip(self.keys, flat[0::2], flat[1::2]):
                if value and int(pttl) > 0:
                    out[key] = (value.split(" ")[0], int(pttl))
            return out
        if c.my:
            q = ("SELECT lock_key, lease_id, TIMESTAMPDIFF(MICROSECOND, SYSDATE(6), expires_at) DIV 1000 "
                 "FROM fencer_locks WHERE lease_id IS NOT NULL AND expires_at > SYSDATE(6);")
            return self._query(["mariadb", "--no-defaults", f"--socket={c.my.sock}", "-uroot", "-B", "-N",
                                "-n", "fencer"], q)
        q = ("SELECT key, lease_id, (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint "
             "FROM fencer_locks WHERE lease_id IS NOT NULL AND expires_at > clock_timestamp();")
        return self._query([f"{c.pg.bin}/psql", "-h", "127.0.0.1", "-p", str(c.pg.port), "-U", "postgres",
                            "-d", "postgres", "-Atq", "-F", "\t"], q)

    def _query(self, argv, q):
        """One query on a client process kept open between samples (a
        process per sample would cost more CPU than the run can spare),
        read with a deadline: a paused server must not stall the sampler."""
        if self._pipe is None or self._pipe.poll() is not None:
            self._pipe = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL)
        p = self._pipe
        p.stdin.write((q + "\nSELECT 'END-OF-SAMPLE';\n").encode())
        p.stdin.flush()
        buf = b""
        deadline = time.monotonic() + 1.0
        while b"END-OF-SAMPLE\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([p.stdout], [], [], left)[0]:
                raise TimeoutError("no answer within 1 s")
            chunk = os.read(p.stdout.fileno(), 65536)
            if not chunk:
                raise ConnectionError("client exited")
            buf += chunk
        out = {}
        for line in buf.decode(errors="replace").splitlines():
            parts = line.split("\t")
            if len(parts) == 3 and parts[0] in self.keys:
                out[parts[0]] = (parts[1], int(parts[2]))
        return out


def load(path):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
