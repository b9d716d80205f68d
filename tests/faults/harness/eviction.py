"""Redis that may evict lock entries (issue 28; PITFALLS 14): the run's
Redis policy, the nemeses that change it and fill memory, and the check
E1 ("no held answer while the policy is unsafe").

A run of a family with `redis_eviction` starts its single Redis with a
small `maxmemory` (`redis_maxmemory`, 8 MB) and an evicting policy chosen
per run from the seed (`allkeys-lru` or `volatile-lru`: fencer's lock
entries, lock-delay markers and idle counters are keys with a TTL, the
first a `volatile-*` policy evicts). The sidecars start on that Redis and
must not become ready: every acquire is refused (503
`backend_unavailable`) until the nemesis sets `noeviction`. Nemeses:

  evict_policy  from the unsafe start: `CONFIG SET maxmemory-policy
                noeviction` (the sidecars become ready within their check
                interval). Later: the run's evicting policy is set live,
                memory is filled at once (so Redis evicts between the
                operator's change and the sidecars' next check), held 2.5–4 s,
                then `noeviction` again. Between the live set and the next
                check (`eviction_check_interval_ms`, 500 ms here) a
                sidecar cannot know: that is the operator's change, so the
                nemesis names it — `admits_overlap` cause `eviction_policy`
                for [set, set + grace] plus the TTL (nemesis.admits).
  evict_fill    writes 256 KiB values with a 1–3 s TTL until Redis refuses
                one (`OOM`, under `noeviction`: acquires fail with an error
                the caller sees, availability only) or 1.5× `maxmemory` is
                written (under an evicting policy: Redis evicts).

E1: an acquire answered 200 while the policy was unsafe is a violation if
it was invoked after the unsafe period began plus a grace — none for the
start-up period (the sidecars started on the unsafe Redis: not one "held"
answer is allowed), and the check interval + 2 request timeouts + 0.5 s of
scheduling after a live change (the check reads on a timer; one read may
have started just before the change). An answer that came after the
policy was safe again is not counted (the grant may have followed the
sidecar's next check).
"""
import random
import threading
import time

from .procs import info, resp, RespError

POLICIES = ("allkeys-lru", "volatile-lru")
SAFE = "noeviction"
FILL_VALUE = 256 * 1024
# Bounds of one live unsafe period.
UNSAFE_HOLD_S = (2.5, 4.0)
# The start-up period (sidecars on the evicting Redis) lasts at least this.
START_S = 2.0


def enabled(sc):
    return bool(sc.get("redis_eviction")) and sc["backend"] == "redis"


def policy_for(sc, seed):
    """The evicting policy of this run: the scenario's, or one of POLICIES
    chosen by the seed."""
    return sc.get("redis_policy") or random.Random(seed * 7919 + 28).choice(POLICIES)


def redis_args(sc, seed):
    if not enabled(sc):
        return []
    return ["--maxmemory", sc.get("redis_maxmemory", "8mb"), "--maxmemory-policy", policy_for(sc, seed)]


def check_interval_ms(sc):
    return sc.get("eviction_check_interval_ms", 500)


def sidecar_settings(sc):
    if not enabled(sc):
        return {}
    return {"backend.redis.eviction_check_interval_ms": check_interval_ms(sc)}


def grace_s(sc):
    """How long after a live CONFIG SET a sidecar may still grant: its next
    full read (one interval), a read that started just before the change
    and one after it (2 × the 500 ms request timeout), and 0.5 s of
    scheduling on a loaded machine."""
    return check_interval_ms(sc) / 1000 + 2 * 0.5 + 0.5


class Eviction:
    """The run's Redis policy, as the nemesis sets it."""

    def __init__(self, cluster):
        self.c = cluster
        self.policy = policy_for(cluster.sc, cluster.seed)
        self.safe = False
        self.lock = threading.Lock()
        self.fills = 0
        self.t_start = time.monotonic()
        cluster.event(kind="eviction_policy", policy=self.policy, safe=False, live=False,
                      maxmemory=cluster.sc.get("redis_maxmemory", "8mb"))

    def _set(self, safe, live):
        name = SAFE if safe else self.policy
        t = time.monotonic_ns()
        self.c.redis.cmd("CONFIG", "SET", "maxmemory-policy", name)
        self.safe = safe
        self.c.event(kind="eviction_policy", t=t, policy=name, safe=safe, live=live)
        return t

    def heal(self):
        """The quiet phase runs on `noeviction`."""
        with self.lock:
            if not self.safe:
                self._set(True, live=True)

    def evicted_keys(self):
        try:
            return int(info(self.c.redis.port, "stats").get("evicted_keys", 0))
        except Exception:
            return None

    def fill(self, rng):
        """Writes big keys with a TTL until Redis refuses one or 1.5×
        maxmemory went in; returns (written, refused, evicted meanwhile)."""
        port = self.c.redis.port
        limit = _bytes(self.c.sc.get("redis_maxmemory", "8mb")) * 3 // 2
        before = self.evicted_keys() or 0
        written, refused = 0, None
        value = "x" * FILL_VALUE
        self.fills += 1
        while written * FILL_VALUE < limit:
            try:
                resp(port, "SET", f"filler:{self.fills}:{written}", value, "PX", int(rng.uniform(1000, 3000)),
                     timeout=2.0)
            except RespError as e:
                refused = str(e)[:80]
                break
            written += 1
        return written, refused, (self.evicted_keys() or 0) - before


def _bytes(text):
    text = str(text).lower()
    for suffix, mul in (("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10), ("b", 1)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mul)
    return int(text)


def flip(nem):
    """Nemesis `evict_policy` (see the module docstring)."""
    ev = nem.c.eviction
    if not ev.safe:
        time.sleep(max(0.0, ev.t_start + START_S - time.monotonic()))
        with ev.lock:
            ev._set(True, live=True)
        return
    hold = nem.rng.uniform(*UNSAFE_HOLD_S)
    if not nem._time_for("evict_policy", hold + 1.0):
        return
    with ev.lock:
        t = ev._set(False, live=True)
    nem.admits("eviction_policy", t, t + int(grace_s(nem.c.sc) * 1e9))
    written, refused, evicted = ev.fill(nem.rng)
    nem.c.event(kind="evict_fill", written=written, refused=refused, evicted=evicted, during="live_change")
    time.sleep(max(0.0, t / 1e9 + hold - time.monotonic()))
    with ev.lock:
        ev._set(True, live=True)


def fill(nem):
    """Nemesis `evict_fill` (see the module docstring)."""
    written, refused, evicted = nem.c.eviction.fill(nem.rng)
    nem.c.event(kind="evict_fill", written=written, refused=refused, evicted=evicted,
                safe=nem.c.eviction.safe)


def unsafe_periods(nemesis):
    """[(start, end, at_start)] of the periods the policy was unsafe
    (`at_start`: the period the sidecars started in)."""
    out, start, first = [], None, False
    for n in sorted((n for n in nemesis if n.get("kind") == "eviction_policy"), key=lambda n: n["t"]):
        if not n["safe"] and start is None:
            start, first = n["t"], not n.get("live")
        elif n["safe"] and start is not None:
            out.append((start, n["t"], first))
            start = None
    if start is not None:
        out.append((start, float("inf"), first))
    return out


def check(report, events, nemesis, sc, cluster):
    """E1 and the bites: `eviction_flips` (live changes to the evicting
    policy), `refused_unsafe` (acquires refused 503 while unsafe),
    `held_unsafe` (acquires answered 200 while unsafe, inside the grace
    too), `evicted_keys` (Redis's own count at the end)."""
    periods = unsafe_periods(nemesis)
    grace = int(grace_s(sc) * 1e9)
    invoked = {}
    refused = held = 0
    bad = []
    for e in sorted(events, key=lambda e: e["t"]):
        if e["f"] != "acquire":
            continue
        if e["kind"] == "invoke":
            invoked[e["proc"]] = e["t"]
            continue
        t_inv = invoked.pop(e["proc"], None)
        for u0, u1, at_start in periods:
            if not (u0 <= e["t"] < u1):
                continue
            if e["kind"] == "fail" and e.get("status") == 503:
                refused += 1
            elif e["kind"] == "ok":
                held += 1
                if t_inv is not None and t_inv >= u0 + (0 if at_start else grace):
                    bad.append((e, t_inv, u0, at_start))
    for e, t_inv, u0, at_start in bad[:3]:
        when = "since the sidecars started" if at_start else f"for {(t_inv - u0) / 1e6:.0f} ms when invoked"
        report.violate("E1", f"{e['key']}: acquire of {e['proc']} answered held (token "
                             f"{(e.get('resp') or {}).get('token')}) while Redis's maxmemory-policy was "
                             f"evicting ({when})", [e])
    if len(bad) > 3:
        report.violate("E1", f"{len(bad) - 3} more acquires answered held while the policy was unsafe")
    report.bites["eviction_flips"] = sum(1 for n in nemesis if n.get("kind") == "eviction_policy"
                                         and n.get("live") and not n["safe"])
    report.bites["refused_unsafe"] = refused
    report.bites["held_unsafe"] = held
    report.bites["evict_fills"] = sum(1 for n in nemesis if n.get("kind") == "evict_fill")
    # Redis's own count at the end (recheck.py, without a cluster: the
    # fills' own record of what they evicted).
    fills = sum(n.get("evicted") or 0 for n in nemesis if n.get("kind") == "evict_fill")
    report.bites["evicted_keys"] = (cluster.eviction.evicted_keys() or 0) if cluster else fills
