"""Faults, each a seeded schedule: the same seed gives the same sequence of
faults, targets and durations (not the same interleaving of the processes).

A fault is applied, held for its duration, then healed; every step is a
nemesis event with a monotonic timestamp, so the checker can relate faults
to the histories. Families:

  pause_worker    SIGSTOP/SIGCONT a worker (GC-style pause)
  pause_node      a worker and its sidecar together
  pause_sidecar   a sidecar only (requests queue in its sockets)
  pause_gateway   one gateway replica
  pause_backend   the lock backend (Redis or PostgreSQL)
  kill_sidecar    kill -9 a sidecar, start it again
  kill_sidecar_stepped  the same, restarted under libfaketime with its
                  wall clock stepped 2–60 s back or forward from before
                  (clock_restarts.py)
  kill_gateway    kill -9 a gateway replica, start it again
  kill_backend    kill -9 Redis (AOF) / crash PostgreSQL (immediate), restart
  net_lock        the sidecars' link to the lock backend: delay, blackhole,
                  reset, half-open pub/sub (Redis)
  net_gateway     a sidecar's link to its gateway: delay, blackhole, reset,
                  one-way loss of answers
  net_storage     a gateway's link to the storage: delay, blackhole, reset,
                  one-way loss of answers
  expire          premature expiry: the lock entry deleted / expired in the
                  backend (a backend wall-clock step)
  slow_storage    the storage holds writes longer than the clients wait
  late_reply      one lock-backend link holds back only the *reply* to the
                  next request that names a scenario key, 1.1–1.5× the
                  sidecars' backend request timeout, then delivers it: the
                  request is applied on the backend while its caller times
                  out and retries (PITFALLS 11: an undo that a retry can
                  share); every backend with a proxied link (Redis,
                  PostgreSQL, MySQL, ZooKeeper, RedLock masters)
  late_request    the mirror of late_reply: the next *request* naming a
                  scenario key (or aimed at an acquire or a release) is held
                  1.1–1.5× the request timeout, then delivered — a
                  statement that lands after its caller gave up
                  (late_requests.py; Redis, PostgreSQL, MySQL)
  evict_policy    Redis (a `redis_eviction` run: small maxmemory, started
                  with an evicting policy): CONFIG SET noeviction, or the
                  run's evicting policy live for 2.5–4 s with memory filled
                  at once, and back (eviction.py)
  evict_fill      Redis: big keys with a TTL until OOM or eviction
  slow_preregistration  one sidecar's link to its gateway delays every
                  answer 1.2–2× the TTL for a while: an acquire's token
                  pre-registration ends after its lease did (PITFALLS 12:
                  held at the moment of the answer)
  failover        kill -9 the Redis master of a sentinel set; a replica is
                  promoted; the old node rejoins as a replica 1–3 s later
  lossy_failover  the same, after freezing replication for 0.3–0.8 s while
                  the workload mints tokens (FAULT-SUITE's lossy failover):
                  the promoted replica lacks the last counter increments
  shard_failover  kill -9 the Redis Cluster master serving one of the
                  scenario's keys; its replica is promoted; the old node
                  rejoins (as a replica of its successor) 1–3 s later
  kill_master_empty   RedLock: kill -9 one master, restart it at once
                  without its data (no AOF): it forgot every lock it granted
  kill_masters_empty  RedLock: the same to a majority of the masters at
                  once — with the restart quarantine off, a second client
                  gets a majority while the first lease lives
  pause_master    RedLock: SIGSTOP/SIGCONT one master
  kill_zk_leader  ZooKeeper: kill -9 the ensemble's leader (from a healthy
                  ensemble); the other two elect a new one; the old member
                  is restarted 1–3 s after the kill, and the next fault
                  waits until the ensemble is healthy again
  kill_etcd_leader  the gateways' etcd fence store (fence_store = "etcd"):
                  kill -9 the cluster's leader (from a healthy cluster);
                  the other two elect a new one, the old member is
                  restarted 1–3 s after the kill, and the next fault waits
                  until the cluster is healthy again
  partition_zk    ZooKeeper: blackhole one sidecar's links to every member
                  for session timeout + 0.5–2 s: its session expires on the
                  ensemble (its nodes go, the others take its keys), then
                  heal (it learns of the expiry when it reconnects)
  pause_sidecar_long  ZooKeeper: SIGSTOP one sidecar for session timeout +
                  0.5–2 s (its session expires while it is frozen), SIGCONT
  kill_mysql      MySQL: kill -9 mariadbd, restart it 0.3–2 s later on the
                  same data dir and port (InnoDB crash recovery; commits
                  were flushed at each commit, so no acknowledged lease or
                  token is lost)
  cut_mysql       MySQL: one sidecar's connections to the server cut for
                  1.2–3 s (longer than the 500 ms lease and the 1 s
                  statement bound): either black-holed (bytes held, then
                  delivered at the heal: statements the sidecar gave up on
                  reach the server late) or reset (RST, then new
                  connections held, then RST again: what was sent is lost)
  clock_mysql     MySQL: the server's wall clock (the clock leases run on)
                  jumps by 1–4 s — forward in 70 % of the faults, which
                  ends every live lease early on the server, backward
                  otherwise, which makes them last longer — while mariadbd
                  keeps running, and back to the real clock 2–4 s later
                  (the opposite jump)

Backends "redis-sentinel" and "redis-cluster" have no single lock-backend
process or link, so net_lock, pause_backend and kill_backend are skipped
there (one "skipped" event); failover and lossy_failover exist only on
"redis-sentinel", shard_failover only on "redis-cluster". On "redlock",
net_lock hits one master's link and expire deletes the lock entry on a
majority of the masters; pause_backend and kill_backend are replaced by the
per-master families. On "zookeeper" the single-backend families get a
member's meaning: net_lock hits one sidecar's link to one member (delay,
blackhole, reset: the client moves to another member, its session lives),
pause_backend SIGSTOPs one member (if it leads, a pause past syncLimit,
1 s, makes the others elect), kill_backend kill -9s one member and starts
it again at once, and expire deletes the key's holder node (lowest
sequence) through a session of its own (zkclient.py) — the holder's
sidecar is not told, the next node in the queue takes the key. The
ZooKeeper families exist only on "zookeeper".

Every fault after which the backend itself admits two holders of a key
(docs/faults.md, "M1") also writes an `admits_overlap` event: its cause,
the window [t0, t1] in which a second holder may appear (the fault's time
plus a TTL and some slack), and the keys or workers it can concern. The
checker excuses an overlap of "held" answers only inside such a window;
it never infers one. On "mysql" (a private
MariaDB, each sidecar behind a proxy of its own) net_lock hits one
sidecar's link to the server, pause_backend SIGSTOPs mariadbd, kill_backend
is kill_mysql, and expire sets the key's lease row's `expires_at` to the
server's now behind the holder's back; kill_mysql, cut_mysql and
clock_mysql exist only there.
"""
import os
import random
import subprocess
import threading
import time

from . import clock_restarts, eviction, late_requests
from .procs import lock_key
from .etcd import post as etcd_post
from .zkclient import ZkClient, key_dir, sequence


# Families that need one lock-backend process / one link to it (lockp), a
# sentinel set, or a cluster, by backend.
NEEDS_SINGLE_BACKEND = {"net_lock", "pause_backend", "kill_backend"}
# A proxied link to the lock backend (none on the sentinel set or the cluster).
NEEDS_LOCK_LINK = {"late_reply", "late_request"}
NEEDS_SENTINELS = {"failover", "lossy_failover"}
NEEDS_CLUSTER = {"shard_failover"}
NEEDS_REDLOCK = {"kill_master_empty", "kill_masters_empty", "pause_master"}
NEEDS_ZOOKEEPER = {"kill_zk_leader", "partition_zk", "pause_sidecar_long"}
# The gateways' etcd fence store (a scenario's `fence_store = "etcd"`).
# (Each skips itself, as an event, when the run has no etcd.)
NEEDS_ETCD = {"kill_etcd_leader", "kill_etcd_member", "compact_etcd", "restart_etcd_all"}
# The etcd lock backend's links (a scenario's backend "etcd": the sidecars'
# proxies to each member; the gateways reach their fence store directly).
NEEDS_ETCD_BACKEND = {"partition_etcd_member"}
NEEDS_MYSQL = {"kill_mysql", "cut_mysql", "clock_mysql"}
# A single Redis started by a `redis_eviction` scenario (harness/eviction.py).
NEEDS_REDIS_EVICTION = {"evict_policy", "evict_fill"}
MULTI_NODE_BACKENDS = {"redis-sentinel", "redis-cluster"}
# Nemesis time one failover takes: promotion (~2.3–3.4 s after the kill),
# the old node back 1–3 s later, and margin. One that could not finish
# before the heal would eat the quiet phase (L2 would see no writes).
FAILOVER_BUDGET_S = 8
# The same for a ZooKeeper leader kill: election (~0.4–2 s), the restart 1–3 s
# after the kill, the JVM back and synced (1–4 s on 2 busy cores), margin.
ZK_FAILOVER_BUDGET_S = 10


# How to tell an acquire or a release from the other requests that carry
# a key, by backend: (bytes it carries as well, bytes it never carries).
# MySQL's acquire procedure takes the key's bell name (`fencer:<hex>`),
# its release does not (and the bell connections' GET_LOCK carries the
# bell name without the key); PostgreSQL's release names the key's
# notification channel (`fencer_<hex>`), its acquire does not. Elsewhere
# acquire and release carry the same bytes, and late_reply aims at
# whichever comes next.
AIM_MARKERS = {
    "acquire": {"mysql": (["fencer:"], []), "postgres": ([], ["fencer_"]),
                "etcd": (["request_range"], ["request_delete_range"])},
    "release": {"mysql": ([], ["fencer:"]), "postgres": (["fencer_"], []),
                "etcd": (["request_delete_range"], [])},
}


def arm_once(nem, mode, group, ms, timeout):
    """Arms `mode` (`late_reply` or `late_request`) on the proxies of one
    link group for the next request naming a scenario key — aimed, where
    the backend's bytes tell them apart, at acquires or releases
    (`<mode>_aims`) — for up to 3 s, records the fault, and disarms it if
    nothing matched. Returns whether a request or reply is being held."""
    c = nem.c
    # etcd's JSON carries keys in base64: a transaction's body is told by
    # its operations instead (an acquire's, a renewal's, a release's).
    marker = ["request_"] if c.sc["backend"] == "etcd" else [key_marker(c.sc["keys"])]
    unless = []
    aim = nem.rng.choice(c.sc.get(f"{mode}_aims", ["key"]))
    if c.sc["backend"] in AIM_MARKERS.get(aim, {}):
        also, unless = AIM_MARKERS[aim][c.sc["backend"]]
        marker += also
    c.event(kind=mode, proxy=",".join(p.name for p in group), ms=ms, marker=marker,
            unless=unless, aim=aim, timeout_ms=timeout)
    for p in group:
        p.set(mode, ms=ms, marker=marker, unless=unless)
    armed_until = time.monotonic() + 3.0
    while time.monotonic() < armed_until and any(p.mode["mode"] == mode for p in group):
        time.sleep(0.01)
    fired = False
    for p in group:
        if p.mode["mode"] == mode:
            p.set("pass")
        else:
            fired = True
    return fired


def key_marker(keys):
    """Bytes every lock-backend request about one of `keys` carries: their
    common leading letters and digits (the backends escape other
    characters differently: ZooKeeper's node names, Redis hash tags)."""
    prefix = os.path.commonprefix(list(keys))
    out = ""
    for ch in prefix:
        if not ch.isalnum():
            break
        out += ch
    if not out:
        raise ValueError(f"late_reply needs keys with a common alphanumeric prefix: {keys}")
    return out


def available(family, backend):
    if family in NEEDS_REDIS_EVICTION:
        return backend == "redis"
    if family in NEEDS_LOCK_LINK:
        return backend not in MULTI_NODE_BACKENDS
    if family in NEEDS_MYSQL:
        return backend == "mysql"
    if family in NEEDS_ETCD_BACKEND:
        return backend == "etcd"
    if family == "pause_sidecar_long":
        return backend in ("zookeeper", "etcd")
    if family in NEEDS_ZOOKEEPER:
        return backend == "zookeeper"
    if backend == "zookeeper" and family in NEEDS_SINGLE_BACKEND:
        return True  # per member (see the module docstring)
    if family in NEEDS_REDLOCK:
        return backend == "redlock"
    if family == "net_lock" and backend == "redlock":
        return True
    if family in NEEDS_SINGLE_BACKEND:
        return backend not in MULTI_NODE_BACKENDS and backend != "redlock"
    if family in NEEDS_SENTINELS:
        return backend == "redis-sentinel"
    if family in NEEDS_CLUSTER:
        return backend == "redis-cluster"
    return True


class Nemesis:
    def __init__(self, cluster, families, seed, ttl_ms, interval=(0.3, 1.5)):
        self.c = cluster
        backend = cluster.sc["backend"]
        self.families = [f for f in families if available(f, backend)]
        skipped = sorted(set(families) - set(self.families))
        if skipped:
            cluster.event(kind="skipped", families=skipped, backend=backend)
        self.rng = random.Random(seed)
        # Faults are dealt from a shuffled deck of the family's list, not
        # drawn with replacement: every kind the list names comes up as
        # often as the list says within each pass through it. Independent
        # draws left a run with 2 late replies where the bite needs 3
        # (seams, seeds 852496 and 1852499 in one clean-clone CI: both
        # tries INCONCLUSIVE), though 3 of its 7 entries are late_reply.
        self.deck = []
        self.ttl = ttl_ms / 1000
        self.interval = interval
        self.end = None
        self.thread = None
        self.stop = threading.Event()

    def run_for(self, seconds):
        self.thread = threading.Thread(target=self._loop, args=(seconds,), daemon=True)
        self.thread.start()

    def join(self):
        if self.thread:
            self.thread.join()

    def _loop(self, seconds):
        end = self.end = time.monotonic() + seconds
        while time.monotonic() < end and not self.stop.is_set():
            time.sleep(self.rng.uniform(*self.interval))
            if time.monotonic() >= end:
                break
            if not self.families:
                continue
            if not self.deck:
                self.deck = list(self.families)
                self.rng.shuffle(self.deck)
            fam = self.deck.pop()
            try:
                getattr(self, fam)()
            except Exception as e:  # a fault that could not be applied is logged, not fatal
                self.c.event(kind="nemesis_error", family=fam, error=str(e))
        self.c.heal_all()
        self.c.event(kind="heal")

    # ------------------------------------------------------------ helpers

    def pause_len(self):
        short = self.rng.random() < self.c.sc.get("short_pause_share", 0.7)
        lo, hi = (1.0, 1.3) if short else (1.5, 4.0)
        return self.rng.uniform(lo, hi) * self.ttl

    def hold(self, what, d, apply, heal, **kv):
        self.c.event(kind=what, d_ms=int(d * 1000), **kv)
        apply()
        time.sleep(d)
        heal()

    # Slack added to every window: scheduling on a loaded 2-core machine
    # between a process's clock reading and its answer's arrival.
    WINDOW_SLACK_S = 0.3

    def admits(self, cause, t0, t1=None, keys=None, workers=None):
        """Names a window in which two clients may legitimately be told
        "held" for one key at once: from `t0` (monotonic ns) to `t1` (ns,
        default t0) plus a TTL and slack — a lease that lived at the fault
        ends within a TTL of it. `keys` / `workers` (ids) limit it to the
        keys it touched / the clients whose answers it could have made
        stale; None means every one."""
        if cause in self.c.sc.get("hide_windows", ()):
            return  # a mutant: the defect injected from outside, unannounced
        t1 = t0 if t1 is None else t1
        end = t1 + int((self.ttl + self.WINDOW_SLACK_S) * 1e9)
        self.c.event(kind="admits_overlap", cause=cause, t0=t0, t1=end,
                     keys=list(keys) if keys else None, workers=list(workers) if workers else None)

    def hold_paused(self, what, d, apply, heal, workers, **kv):
        """A freeze (hold()) of a process that stands between a client and
        its answers: an answer checked just before the freeze arrives after
        it with the time left it had then — no process can rule that out,
        so the window is named (pause_worker, pause_node, pause_sidecar)."""
        t0 = time.monotonic_ns()
        self.hold(what, d, apply, heal, **kv)
        self.admits(what, t0, time.monotonic_ns(), workers=workers)

    # ------------------------------------------------------------ families

    def pause_worker(self):
        w = self.rng.choice(self.c.workers)
        self.hold_paused("pause", self.pause_len(), w.pause, w.resume, [w.cfg["id"]], worker=w.cfg["id"],
                         target=w.name)

    def pause_node(self):
        w = self.rng.choice(self.c.workers)

        def apply():
            w.pause()
            w.sidecar.proc.pause()

        def heal():
            w.sidecar.proc.resume()
            w.resume()
        self.hold_paused("pause", self.pause_len(), apply, heal, [w.cfg["id"]], worker=w.cfg["id"],
                         target="node:" + w.name)

    def pause_sidecar(self):
        s = self.rng.choice(self.c.sidecars)
        self.hold_paused("pause_sidecar", self.pause_len(), s.proc.pause, s.proc.resume, [self.c.worker_of(s)],
                         target=s.name)

    def pause_gateway(self):
        g = self.rng.choice(self.c.gateways)
        self.hold("pause_gateway", self.pause_len(), g.proc.pause, g.proc.resume, target=g.name)

    def pause_backend(self):
        if self.c.zk:
            zk = self.c.zk
            i = self.rng.randrange(zk.n)
            self.hold("pause_backend", self.pause_len(), lambda: zk.pause(i), lambda: zk.resume(i),
                      target=f"zk-{i}")
            return
        if self.c.my:
            self.hold("pause_backend", self.pause_len(), self.c.my.pause, self.c.my.resume, target="mysql")
            return
        if self.c.redis:
            self.hold("pause_backend", self.pause_len(), self.c.redis.proc.pause, self.c.redis.proc.resume,
                      target="redis")
        else:
            self.hold("pause_backend", self.pause_len(), self.c.pg.pause, self.c.pg.resume, target="postgres")

    def kill_sidecar(self):
        s = self.rng.choice(self.c.sidecars)
        self.c.event(kind="kill", target=s.name)
        s.crash_restart()
        self.c.event(kind="restarted", target=s.name)

    def kill_sidecar_stepped(self):
        """kill -9 a sidecar (one holding a proxied worker's lease if any)
        and start it again on its ports and state dir with its wall clock
        stepped 2–60 s back or forward (harness/clock_restarts.py)."""
        clock_restarts.kill_stepped(self)

    def kill_gateway(self):
        g = self.rng.choice(self.c.gateways)
        self.c.event(kind="kill", target=g.name)
        g.crash_restart()
        self.c.event(kind="restarted", target=g.name)

    def kill_backend(self):
        if self.c.zk:
            zk = self.c.zk
            i = self.rng.randrange(zk.n)
            t = zk.kill(i)
            self.c.event(kind="kill", target=f"zk-{i}", t=t)
            zk.restart(i)
            self.c.event(kind="restarted", target=f"zk-{i}")
            return
        if self.c.my:
            self.kill_mysql()
            return
        if self.c.redis:
            t0 = time.monotonic_ns()
            self.c.event(kind="kill", target="redis", t=t0)
            self.c.redis.restart()
            if not self.c.sc.get("redis_aof", True):
                # Restarted empty: every lock entry is gone while its
                # holders' leases live on (Redis without persistence).
                self.admits("kill_backend_empty", t0, time.monotonic_ns())
        else:
            self.c.event(kind="kill", target="postgres")
            self.c.pg.crash_restart()
        self.c.event(kind="restarted", target="backend")

    def _net(self, proxies, modes):
        p = self.rng.choice(proxies)
        mode = self.rng.choice(modes)
        d = self.rng.uniform(0.5, 2.0) * self.ttl
        if mode == "reset":
            p.reset_all()
            return
        params = {}
        if mode == "delay":
            params = {"ms": int(self.rng.uniform(0.2, 1.5) * self.ttl * 1000),
                      "direction": self.rng.choice(["both", "down"])}
        self.c.event(kind="net", proxy=p.name, mode=mode, d_ms=int(d * 1000), **params)
        p.set(mode, **params)
        time.sleep(d)
        p.set("pass")

    def net_lock(self):
        modes = ["delay", "blackhole", "reset"] + (["freeze_unscripted"] if self.c.redis else [])
        if self.c.zk:
            proxies = [p for s in self.c.sidecars for p in s.zk_proxies]
        elif self.c.my:
            proxies = [s.mysql_proxy for s in self.c.sidecars]
        else:
            proxies = self.c.redlock.proxies if self.c.redlock else [self.c.lockp]
        self._net(proxies, modes)

    def net_gateway(self):
        self._net([s.gateway_proxy for s in self.c.sidecars], ["delay", "blackhole", "reset", "drop_down"])

    def net_storage(self):
        self._net([g.storage_proxy for g in self.c.gateways], ["delay", "blackhole", "reset", "drop_down"])

    def expire(self):
        key = self.rng.choice(self.c.sc["keys"])
        t0 = time.monotonic_ns()
        if self.c.zk:
            self._zk_expire(key)
            self.admits("expire", t0, time.monotonic_ns(), keys=[key])
            return
        if self.c.my:
            # The holder's sidecar is not told; its local deadline is still
            # ahead. Only a row with a lease is touched (a free row's
            # expiry means nothing).
            out = self.c.my.sql("UPDATE fencer_locks SET expires_at = SYSDATE(6) WHERE lock_key = "
                                f"'{key}' AND lease_id IS NOT NULL AND expires_at > SYSDATE(6); "
                                "SELECT ROW_COUNT()")
            self.c.event(kind="expire", key=key, deleted=out.strip() == "1")
            self.admits("expire", t0, time.monotonic_ns(), keys=[key])
            return
        self.c.event(kind="expire", key=key)
        if self.c.redlock:
            n = len(self.c.redlock.masters)
            for i in self.rng.sample(range(n), n // 2 + 1):
                self.c.redlock.cmd(i, "DEL", lock_key(key))
        elif self.c.rcluster:
            self.c.rcluster.cmd_key(key, "DEL", lock_key(key))
        elif self.c.rset:
            self.c.rset.cmd("DEL", lock_key(key))
        elif self.c.redis:
            self.c.redis.cmd("DEL", "fencer:{" + key + "}:lock")
        else:
            self.c.pg.psql(f"UPDATE fencer_locks SET expires_at = clock_timestamp() WHERE key = '{key}'")
        self.admits("expire", t0, time.monotonic_ns(), keys=[key])

    def late_reply(self):
        """Holds back only the reply to the next request that names a
        scenario key (any key: the marker is the keys' common prefix) on
        one lock-backend link group, 1.1–1.5× the sidecars' request
        timeout (`late_reply_factor`), then delivers it (`late_reply_aims`: "key", or "acquire"
        where the backend's acquire carries bytes of its own, MySQL's bell
        name; one is picked per fault). The request is applied at once: an
        acquire is granted while its caller times out and retries with the
        same lease (the retry is answered "held"), then the late reply
        arrives and that try's compensation runs; a release frees the key
        while its caller waits. Armed for up to 3 s; the event
        `late_reply_fired` (from the proxy) says when a reply was held."""
        groups = self.c.lock_links()
        group = self.rng.choice(groups)
        timeout = self.c.lock_request_timeout_ms()
        ms = int(self.rng.uniform(*self.c.sc.get("late_reply_factor", (1.1, 1.5))) * timeout)
        fired = arm_once(self, "late_reply", group, ms, timeout)
        if fired:
            # The held reply is still on its way: let it land before the
            # next fault (one on the same connection would queue behind it).
            time.sleep(ms / 1000)

    def late_request(self):
        """Holds the next request that names a scenario key (or, aimed,
        an acquire or a release: `late_request_aims`) on one lock-backend
        link 1.1–1.5× the sidecars' request timeout, then delivers it: the
        statement lands after its caller gave up (harness/late_requests.py,
        which also reads the key's entry twice after it landed: O1)."""
        late_requests.fire(self)

    def evict_policy(self):
        """Redis's maxmemory-policy: from the unsafe start to noeviction;
        later the run's evicting policy set live (and memory filled at
        once), held 2.5–4 s, and back (harness/eviction.py; window
        `eviction_policy` for the sidecars' check interval)."""
        eviction.flip(self)

    def evict_fill(self):
        """Redis's memory filled with big keys with a TTL: evictions under
        an evicting policy, OOM refusals under noeviction
        (harness/eviction.py)."""
        eviction.fill(self)
    def late_reply_gateway(self):
        """late_reply on one sidecar's link to its gateway (issue 28 item
        2): only the reply to the next pre-registration (`aim`
        "preregister") or proxied write ("write") is held, 1.1–1.5× the
        sidecar's timeout for that call (`late_reply_factor`), then
        delivered; the request reaches the gateway at once, so the mark
        moves (or the storage applies the write) while the sidecar has
        given up on it. The acquire must not be answered "held" past its
        lease, nor the write reported applied; a second holder's token must
        not be refused by a mark the late one set wrongly. Skipped when
        less nemesis time is left than the reply is held. One reply per
        fault (armed ≤ 3 s; `late_reply_fired` names the request)."""
        aim = self.rng.choice(self.c.sc.get("late_reply_gateway_aims", ["preregister", "write"]))
        # Only the proxied workers' sidecars send writes to their gateway
        # (the direct workers carry their tokens themselves).
        proxied = [w.sidecar for w in self.c.workers if w.mode == "proxy"]
        s = self.rng.choice(proxied if aim == "write" and proxied else self.c.sidecars)
        p = s.gateway_proxy
        timeout = self.c.gateway_call_timeout_ms(aim)
        ms = int(self.rng.uniform(*self.c.sc.get("late_reply_factor", (1.1, 1.5))) * timeout)
        if time.monotonic() + ms / 1000 + 1 > (self.end or float("inf")):
            self.c.event(kind="skipped", family="late_reply_gateway", why="held reply would outlast the faults")
            return
        marker = ["/_fencer/v1/fences/"] if aim == "preregister" else ["/kv/"]
        marker.append(key_marker(self.c.sc["keys"]))
        unless = [] if aim == "preregister" else ["GET ", "HEAD "]
        self.c.event(kind="late_reply", proxy=p.name, ms=ms, marker=marker, unless=unless, aim=aim,
                     timeout_ms=timeout, target=s.name)
        p.set("late_reply", ms=ms, marker=marker, unless=unless)
        armed_until = time.monotonic() + 3.0
        while time.monotonic() < armed_until and p.mode["mode"] == "late_reply":
            time.sleep(0.01)
        if p.mode["mode"] == "late_reply":
            p.set("pass")
        else:
            # The held reply is still on its way: let it land before the
            # next fault on this link.
            time.sleep(ms / 1000)

    def slow_preregistration(self):
        """One sidecar's link to its gateway delays every answer 1.2–2× the
        TTL, for that delay plus 0.5–2 s: the token pre-registration of an
        acquire made meanwhile ends after its lease did (the request
        reaches the gateway at once: the mark moves). The sidecar must not
        answer such an acquire "held" (PITFALLS 12). The proxied workers'
        reads and writes on that link are slow too (below their client
        timeout)."""
        s = self.rng.choice(self.c.sidecars)
        p = s.gateway_proxy
        ms = int(self.rng.uniform(1.2, 2.0) * self.ttl * 1000)
        d = ms / 1000 + self.rng.uniform(0.5, 2.0)
        self.hold("slow_preregistration", d, lambda: p.set("delay", ms=ms, direction="down"),
                  lambda: p.set("pass"), proxy=p.name, ms=ms, target=s.name)

    def slow_storage(self):
        """The storage holds writes longer than the clients wait — but applies
        each within `upstream_timeout_ms + uncertain_hold_ms` of its arrival
        (less 300 ms of scheduling slack), whatever happens to the connection
        meanwhile (net_storage may reset it: the gateway then gives up early,
        and its hold still runs from the forward). That bound is the documented
        precondition of the gateway's guarantee (README, "When the storage's
        answer is unknown"): a write applied later than it may land after a
        newer one, and the checker says so (S1). The first long-tier run
        held writes up to 2× the client timeout regardless, and all four such
        writes that landed past the bound were caught."""
        d = self.rng.uniform(1.0, 3.0)
        sc = self.c.sc
        delay = int(sc.get("client_timeout_ms", 4000) * self.rng.uniform(1.2, 2.0))
        bound = sc.get("gw_upstream_timeout_ms", 3000) + sc.get("uncertain_hold_ms", 1000) - 300
        delay = min(delay, bound)
        url = f"http://127.0.0.1:{self.c.storage_port}/_control"

        def set_delay(ms):
            subprocess.run(["curl", "-s", "-XPOST", url, "-d", f'{{"delay_ms": {ms}}}'],
                           capture_output=True, timeout=5)
        self.hold("slow_storage", d, lambda: set_delay(delay), lambda: set_delay(0), delay_ms=delay)

    # ------------------------------------------------------------ sentinel failovers

    def failover(self):
        self._fail_over(lossy=False)

    def lossy_failover(self):
        self._fail_over(lossy=True)

    def _fail_over(self, lossy):
        """kill -9 the master of a healthy set, wait for the promotion, let
        the old node rejoin as a replica 1–3 s later.

        Lossy: every replica is first routed through a fresh link, then the
        links freeze for 0.3–0.8 s while the workload mints tokens on the
        master, and the links are reset (their held bytes dropped) right
        after the kill. Whether state was really lost is measured, not
        assumed: each key's counter on the master just before the kill
        against the promoted replica's (read before the promotion: once
        promoted, new acquires move it)."""
        rs = self.c.rset
        family = "lossy_failover" if lossy else "failover"
        left = self.end - time.monotonic() - FAILOVER_BUDGET_S
        try:
            if left <= 0:
                raise RuntimeError("no time left to finish it before the heal")
            # A failover the sentinels started on their own, or a node still
            # syncing, must settle first: a kill now would be a different fault.
            rs.wait_healthy(min(15, left))
        except RuntimeError as e:
            self.c.event(kind="skipped", families=[family], reason=str(e))
            return
        frozen_ms = None
        keys = self.c.sc["keys"]
        try:
            if lossy:
                rs.route_links()
                rs.freeze_links()
                frozen = self.rng.uniform(0.3, 0.8)
                frozen_ms = int(frozen * 1000)
                time.sleep(frozen)
            before = rs.counters(keys)
            old, t_kill = rs.kill_master()
        except Exception:
            rs.thaw_links()
            raise
        if lossy:
            rs.reset_links()
        self.c.event(kind=family, target=f"redis:{old}", t=t_kill,
                     frozen_ms=frozen_ms, counters_before=before)
        try:
            # Bytes already in a replica's socket are still applied after the
            # kill; the sentinels cannot promote before down-after (1 s).
            time.sleep(0.2)
            snap = {}
            for p in rs.replicas_of(old):
                try:
                    snap[p] = rs.counters(keys, port=p)
                except Exception:  # a replica not answering cannot be promoted either
                    pass
            new = rs.wait_new_master(old, 20)
            elapsed = (time.monotonic_ns() - t_kill) / 1e6
            after = snap.get(new) or {}
            lost = {k: before[k] - after[k] for k in keys if k in after and after[k] < before[k]}
            self.c.event(kind="promoted", old=old, new=new, elapsed_ms=round(elapsed), counters_after=after,
                         lost_state=bool(lost), lost=lost, lossy_attempt=lossy)
        finally:
            rs.thaw_links()
            time.sleep(self.rng.uniform(1.0, 3.0))
            rs.restart_node(old)
            self.c.event(kind="restarted", target=f"redis:{old}")
            # Asynchronous replication: the promoted replica may lack lock
            # entries the old master granted (and the sentinels may switch
            # again on their own while the old node rejoins).
            self.admits(family, t_kill, time.monotonic_ns() + int(2e9))

    # ------------------------------------------------------------ cluster shard failovers

    def shard_failover(self):
        """kill -9 the master serving one of the scenario's keys on a healthy
        cluster, wait for its replica's promotion, restart the old node 1–3 s
        later (it rejoins as a replica of its successor) and wait until the
        cluster is healthy again, so the next fault starts from a whole
        cluster.

        Events as for `failover` (the checker counts the `promoted` ones and
        times each kill's unavailability, over the keys of the killed shard
        only). Lost state is measured as on the sentinel set: the shard's
        keys' counters on the master just before the kill against those on
        its replica 0.2 s after it (before the promotion, which new acquires
        follow)."""
        rc = self.c.rcluster
        family = "shard_failover"
        left = self.end - time.monotonic() - FAILOVER_BUDGET_S
        try:
            if left <= 0:
                raise RuntimeError("no time left to finish it before the heal")
            rc.wait_healthy(min(15, left))
        except RuntimeError as e:
            self.c.event(kind="skipped", families=[family], reason=str(e)[:500])
            return
        keys = self.c.sc["keys"]
        key = self.rng.choice(keys)
        slot = rc.keyslot(key)
        old = rc.master_for_slot(slot)
        shard_keys = [k for k in keys if rc.master_for_key(k) == old]
        replicas = rc.replicas_of(old)
        before = rc.counters(shard_keys, port=old)
        t_kill = rc.kill(old)
        self.c.event(kind=family, target=f"redis:{old}", t=t_kill, key=key, slot=slot, keys=shard_keys,
                     frozen_ms=None, counters_before=before)
        try:
            # Bytes already in the replica's socket are still applied after
            # the kill; the cluster cannot promote before the node timeout.
            time.sleep(0.2)
            snap = {}
            for p in replicas:
                try:
                    snap[p] = rc.counters(shard_keys, port=p)
                except Exception:  # a replica not answering cannot be promoted either
                    pass
            new = rc.wait_slot_master_change(slot, old, 20)
            elapsed = (time.monotonic_ns() - t_kill) / 1e6
            after = snap.get(new) or {}
            lost = {k: before[k] - after[k] for k in shard_keys if k in after and after[k] < before[k]}
            self.c.event(kind="promoted", old=old, new=new, slot=slot, elapsed_ms=round(elapsed),
                         counters_after=after, lost_state=bool(lost), lost=lost, lossy_attempt=False)
        finally:
            time.sleep(self.rng.uniform(1.0, 3.0))
            rc.restart(old)
            self.c.event(kind="restarted", target=f"redis:{old}")
            self.admits(family, t_kill, time.monotonic_ns() + int(2e9), keys=shard_keys)
        t0 = time.monotonic()
        rc.wait_healthy(20)
        self.c.event(kind="cluster_healthy", after_restart_ms=round((time.monotonic() - t0) * 1000))

    # ------------------------------------------------------------ RedLock masters

    def kill_master_empty(self):
        self._restart_empty(1)

    def kill_masters_empty(self):
        self._restart_empty(len(self.c.redlock.masters) // 2 + 1)

    def _restart_empty(self, count):
        """kill -9 `count` masters and start each again at once, empty (the
        `kill` event is stamped when the first signal went out)."""
        rl = self.c.redlock
        picked = sorted(self.rng.sample(range(len(rl.masters)), count))
        ts = [rl.kill_restart(i) for i in picked]
        self.c.event(kind="kill_master_empty", t=ts[0], masters=picked,
                     target=",".join(f"redlock-{i}" for i in picked))
        self.c.event(kind="restarted", target="redlock", masters=picked)
        if self.c.sc.get("redlock_quarantine_ms", 2000) < self.c.sc["ttl_ms"]:
            # Published RedLock: a master restarted empty votes at once for
            # a key another client's majority still holds. The quarantine
            # (configured ≥ the TTL) closes that; without it, it is admitted.
            self.admits("kill_master_empty", ts[0], time.monotonic_ns())

    def pause_master(self):
        rl = self.c.redlock
        i = self.rng.randrange(len(rl.masters))
        self.hold("pause_master", self.pause_len(), lambda: rl.pause(i), lambda: rl.resume(i),
                  target=f"redlock-{i}")

    # ------------------------------------------------------------ ZooKeeper

    def _zk_expire(self, key):
        """Deletes `key`'s holder node (the lowest sequence in its queue)
        through a session of the nemesis's own on a serving member. The
        event says which node went (`node`: None if the queue was empty, so
        nothing was held)."""
        zk = self.c.zk
        order = list(range(zk.n))
        self.rng.shuffle(order)
        last = None
        for i in order:
            if not zk.answering(i):
                continue
            try:
                c = ZkClient(zk.ports[i], timeout=1.0)
            except (OSError, ConnectionError) as e:
                last = e
                continue
            try:
                d = key_dir(key)
                queue = sorted((sequence(n), n) for n in c.children(d) if sequence(n) is not None)
                node = queue[0][1] if queue else None
                deleted = c.delete(f"{d}/{node}") if node else False
            finally:
                c.close()
            self.c.event(kind="expire", key=key, node=node, deleted=deleted, member=f"zk-{i}")
            return
        raise RuntimeError(f"no ZooKeeper member would take a session: {last}")

    def kill_zk_leader(self):
        """kill -9 the leader of a healthy ensemble, wait for the new one,
        start the old member again 1–3 s after the kill, wait until the
        ensemble is healthy again (so the next fault starts from a whole
        ensemble). Events: `kill_zk_leader` (t = when SIGKILL went out,
        target zk-<i>), `zk_leader_elected` (new leader, ms after the kill),
        `restarted`, `zk_healthy`. The sidecars' sessions outlive the
        election (3 s session): no lease needs to be lost for it, only
        requests in flight fail."""
        self._kill_leader(self.c.zk, "zk")

    def kill_etcd_leader(self):
        """kill -9 the leader of the gateways' etcd cluster (from a healthy
        cluster), wait for the new one, start the old member again 1–3 s
        after the kill, wait until the cluster is healthy again. Events:
        `kill_etcd_leader` (t = when SIGKILL went out), `etcd_leader_elected`
        (ms after the kill), `restarted`, `etcd_healthy`. Admissions that
        meet the election fail (503 to the client): never let through."""
        if self.c.etcd is None:
            self.c.event(kind="skipped", families=["kill_etcd_leader"], reason="no etcd fence store")
            return
        self._kill_leader(self.c.etcd, "etcd")

    def _kill_leader(self, members, name):
        """`kill_<name>_leader` on `members` (a ZooKeeperEnsemble or an
        EtcdCluster: wait_healthy, kill_leader, wait_new_leader, restart):
        from a healthy cluster, kill -9 the leader, wait for the new one,
        restart the old member 1–3 s after the kill, wait until healthy."""
        family = f"kill_{name}_leader"
        back_after = self.rng.uniform(1.0, 3.0)
        left = self.end - time.monotonic() - ZK_FAILOVER_BUDGET_S
        try:
            if left <= 0:
                raise RuntimeError("no time left to finish it before the heal")
            members.wait_healthy(min(15, left))
        except RuntimeError as e:
            self.c.event(kind="skipped", families=[family], reason=str(e)[:500])
            return
        old, t_kill = members.kill_leader()
        self.c.event(kind=family, target=f"{name}-{old}", t=t_kill, member=old, back_after_ms=int(back_after * 1000))
        try:
            new = members.wait_new_leader(old, 20)
            self.c.event(kind=f"{name}_leader_elected", old=old, new=new,
                         elapsed_ms=round((time.monotonic_ns() - t_kill) / 1e6))
        finally:
            time.sleep(max(0.0, t_kill / 1e9 + back_after - time.monotonic()))
            members.restart(old)
            self.c.event(kind="restarted", target=f"{name}-{old}")
        t0 = time.monotonic()
        members.wait_healthy(20)
        self.c.event(kind=f"{name}_healthy", after_restart_ms=round((time.monotonic() - t0) * 1000))

    def _session_plus(self):
        return self.c.zk_session_s() + self.rng.uniform(0.5, 2.0)

    def partition_zk(self):
        """Blackholes every link of one sidecar to the ensemble for session
        timeout + 0.5–2 s (held bytes are delivered at the heal, as TCP
        would retransmit them), then heals. The ensemble expires its
        session meanwhile; the sidecar finds out when it reconnects."""
        s = self.rng.choice(self.c.sidecars)
        d = self._session_plus()
        if not self._time_for("partition_zk", d):
            return

        def apply():
            for p in s.zk_proxies:
                p.set("blackhole")

        def heal():
            for p in s.zk_proxies:
                p.set("pass")
        self.hold("partition_zk", d, apply, heal, target=s.name)

    def partition_etcd_member(self):
        """Blackholes every sidecar's link to one etcd member for 1–3 s
        (held bytes are delivered at the heal, as TCP would retransmit
        them): calls sent to it go unanswered and the sidecars' clients go
        on to the other members; watches on it break and are opened again,
        maybe from a revision compact_etcd has removed."""
        j = self.rng.randrange(self.c.etcd.n)
        d = self.rng.uniform(1.0, 3.0)
        if not self._time_for("partition_etcd_member", d):
            return
        links = [s.etcd_proxies[j] for s in self.c.sidecars]

        def apply():
            for p in links:
                p.set("blackhole")

        def heal():
            for p in links:
                p.set("pass")
        self.hold("partition_etcd_member", d, apply, heal, target=f"etcd-{j}")

    def kill_etcd_member(self):
        """kill -9 one etcd member that does not lead (from a healthy
        cluster), start it again on its data 1–3 s later, wait until
        healthy: calls in flight to it fail, the clients go on to the
        others, its watches break."""
        e = self.c.etcd
        if e is None:
            self.c.event(kind="skipped", families=["kill_etcd_member"], reason="no etcd")
            return
        back_after = self.rng.uniform(1.0, 3.0)
        if not self._time_for("kill_etcd_member", back_after + ZK_FAILOVER_BUDGET_S):
            return
        try:
            e.wait_healthy(10)
            leader = e.leader()
        except RuntimeError as err:
            self.c.event(kind="skipped", families=["kill_etcd_member"], reason=str(err)[:500])
            return
        i = self.rng.choice([j for j in range(e.n) if j != leader])
        t_kill = e.kill(i)
        self.c.event(kind="kill_etcd_member", target=f"etcd-{i}", t=t_kill, member=i,
                     back_after_ms=int(back_after * 1000))
        time.sleep(max(0.0, t_kill / 1e9 + back_after - time.monotonic()))
        e.restart(i)
        self.c.event(kind="restarted", target=f"etcd-{i}")
        try:
            e.wait_healthy(20)
        except RuntimeError as err:
            self.c.event(kind="skipped", families=["kill_etcd_member"], reason=str(err)[:500])

    def compact_etcd(self):
        """Compacts etcd's history at its current revision: a watch that
        must resume from an older revision (a waiter's, after its stream
        broke) is cancelled, and its waiter must still learn of releases."""
        e = self.c.etcd
        if e is None:
            self.c.event(kind="skipped", families=["compact_etcd"], reason="no etcd")
            return
        for i in range(e.n):
            r = etcd_post(e.ports[i], "/v3/kv/range", {"key": "AA=="})
            rev = int((r or {}).get("header", {}).get("revision", 0) or 0)
            if rev and etcd_post(e.ports[i], "/v3/kv/compaction", {"revision": str(rev)}) is not None:
                self.c.event(kind="compact_etcd", revision=rev, member=i)
                return
        self.c.event(kind="skipped", families=["compact_etcd"], reason="no member answered")

    def restart_etcd_all(self):
        """kill -9 every etcd member at once, start them all again on their
        data 0.5–1.5 s later, and wait until healthy: a full cluster
        restart. Leases held across it must stay held or be lost — never
        handed to a second holder."""
        e = self.c.etcd
        if e is None:
            self.c.event(kind="skipped", families=["restart_etcd_all"], reason="no etcd")
            return
        back_after = self.rng.uniform(0.5, 1.5)
        if not self._time_for("restart_etcd_all", back_after + ZK_FAILOVER_BUDGET_S):
            return
        t_kill = [e.kill(i) for i in range(e.n)][0]
        self.c.event(kind="restart_etcd_all", t=t_kill, back_after_ms=int(back_after * 1000))
        time.sleep(back_after)
        for p in e.procs:
            p.start()
        try:
            e.wait_healthy(20)
            self.c.event(kind="etcd_healthy", after_restart_ms=round((time.monotonic_ns() - t_kill) / 1e6))
        except RuntimeError as err:
            self.c.event(kind="skipped", families=["restart_etcd_all"], reason=str(err)[:500])

    def pause_sidecar_long(self):
        """SIGSTOP one sidecar for session timeout + 0.5–2 s: its session
        expires while it is frozen (its leases ended on its own clock long
        before: TTL ≤ 45 % of the session), SIGCONT."""
        s = self.rng.choice(self.c.sidecars)
        d = self._session_plus()
        if not self._time_for("pause_sidecar_long", d):
            return
        self.hold_paused("pause_sidecar_long", d, s.proc.pause, s.proc.resume, [self.c.worker_of(s)],
                         target=s.name)

    def _time_for(self, family, d):
        """Whether a fault of `d` s ends (nearly) before the heal: one that
        ran on would eat the quiet phase."""
        if time.monotonic() + d <= self.end + 1.0:
            return True
        self.c.event(kind="skipped", families=[family], reason="no time left to finish it before the heal")
        return False

    # ------------------------------------------------------------ MySQL / MariaDB

    def kill_mysql(self):
        """kill -9 mariadbd, restart it 0.3–2 s later on the same data dir
        and port. Events: `kill_mysql` (t = when SIGKILL went out),
        `restarted` (with the recovery time: start until it answers)."""
        my = self.c.my
        down = self.rng.uniform(0.3, 2.0)
        t = my.kill()
        self.c.event(kind="kill_mysql", target="mysql", t=t, down_ms=int(down * 1000))
        time.sleep(max(0.0, t / 1e9 + down - time.monotonic()))
        t0 = time.monotonic()
        my.restart()
        self.c.event(kind="restarted", target="mysql", recovery_ms=round((time.monotonic() - t0) * 1000))

    def cut_mysql(self):
        """One sidecar's link to the server cut for 1.2–3 s: longer than
        the lease (500 ms) and the statement bound (1 s), so its leases end
        on its own clock, its statements time out and are killed and
        compensated, and the other sidecars take its keys.
        `blackhole`: bytes held and delivered at the heal (a statement the
        sidecar gave up on reaches the server late); `reset`: RST, new
        connections held, RST again at the heal (nothing sent arrives)."""
        s = self.rng.choice(self.c.sidecars)
        p = s.mysql_proxy
        d = self.rng.uniform(1.2, 3.0)
        mode = self.rng.choice(["blackhole", "reset"])
        if not self._time_for("cut_mysql", d):
            return

        def apply():
            if mode == "reset":
                p.reset_all()
            p.set("blackhole")

        def heal():
            if mode == "reset":
                p.reset_all()
            p.set("pass")
        self.hold("cut_mysql", d, apply, heal, target=s.name, proxy=p.name, mode=mode)

    def clock_mysql(self):
        """The running server's wall clock jumps by 1–4 s (forward 70 %),
        is held there 2–4 s, then jumps back to the real clock. Events:
        `clock_mysql` for each jump, with the offset, the jump and the ms
        until the server's SYSDATE showed it (`landed_ms`, ≤ ~2 s:
        libfaketime re-reads its file every second)."""
        my = self.c.my
        size = self.rng.uniform(1.0, 4.0)
        offset = size if self.rng.random() < 0.7 else -size
        hold = self.rng.uniform(2.0, 4.0)
        if not self._time_for("clock_mysql", hold + 3.0):
            return
        old = my.offset_s
        t = time.monotonic_ns()
        landed = my.set_offset(offset)
        self.c.event(kind="clock_mysql", t=t, target="mysql", offset_s=round(offset, 3),
                     jump_s=round(offset - old, 3), landed_ms=landed, hold_ms=int(hold * 1000))
        if offset - old > 0:
            self._forward_jump(t)
        time.sleep(hold)
        t = time.monotonic_ns()
        landed = my.set_offset(0)
        self.c.event(kind="clock_mysql", t=t, target="mysql", offset_s=0, jump_s=round(-offset, 3),
                     landed_ms=landed)
        if -offset > 0:
            self._forward_jump(t)

    def _forward_jump(self, t):
        """A forward step of the clock leases run on ends every live lease
        early on the server: admitted from the write of the offset until a
        TTL after it landed (now, as set_offset polled until it did)."""
        self.admits("clock_mysql_forward", t, time.monotonic_ns())
