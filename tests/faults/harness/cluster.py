"""One run's topology, started from a scenario:

    worker_i ──> sidecar_i ──[lockp]──> Redis or PostgreSQL (locks)
                   (backend "redis-sentinel": no lockp; the sidecars ask the
                   sentinels for the master, and each replica replicates
                   through a [link] of its own: RedisSentinelSet;
                   backend "redis-cluster": no lockp either, the sidecars
                   reach the 3 masters + 3 replicas of RedisClusterSet
                   directly, following MOVED;
                   backend "redlock": N independent masters, each behind a
                   [lockp] of its own, RedLockMasters;
                   backend "zookeeper": a 3-member ensemble,
                   ZooKeeperEnsemble, and every sidecar has a [zkp] of its
                   own to every member, "sidecar-i->zk-j": its connect
                   string lists its own proxies, so one sidecar can be cut
                   off from the whole ensemble while the others are not;
                   backend "mysql": a private MariaDB, and every sidecar
                   reaches it through a [myp] of its own, "sidecar-i->mysql",
                   so one sidecar's connections can be cut alone)
                   └─[gwp_i]──> gateway_a / gateway_b ──[stp_x]──> storage
    (direct workers carry their token to a gateway themselves)
    gateways ──> PostgreSQL (fence store, shared)

Every link in brackets is a FaultProxy. The sidecars alternate between the
two gateways; half of the workers (or as configured) write directly.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

from . import eviction
from .faultproxy import FaultProxy
from .etcd import EtcdCluster
from .zookeeper import ZooKeeperEnsemble
from .procs import (Fencer, MariaDB, Postgres, Proc, Redis, RedisClusterSet, RedisSentinelSet, RedLockMasters, free_port,
                    http_ok, metric_sum, proc_state, wait_for)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Cluster:
    def __init__(self, sc, run_dir, binary, seed):
        self.sc, self.run_dir, self.binary, self.seed = sc, run_dir, binary, seed
        self.nemesis_events = []
        self.lock = threading.Lock()
        self.proxies = []
        self.stop_flag = threading.Event()
        self.marks = []
        # What shutdown() looks at exists before anything is started, so a
        # build that fails part-way stops what it had started.
        self.workers, self.sidecars, self.gateways = [], [], []
        self.storage = self.pg = None
        self.redis = self.rset = self.rcluster = self.lockp = self.redlock = self.zk = self.my = None
        self.etcd = None
        self.eviction = None
        try:
            self._build()
        except BaseException:
            self.shutdown()
            raise

    def event(self, **kv):
        """A nemesis event, at `t` (monotonic ns) if given (a kill records
        when the signal went out), else now."""
        kv.setdefault("t", time.monotonic_ns())
        with self.lock:
            self.nemesis_events.append(kv)

    def proxy(self, name, port):
        p = FaultProxy(name, port, events=self.event)
        self.proxies.append(p)
        return p

    def mutants(self, role):
        return self.sc.get("mutants", {}).get(role, [])

    def _build(self):
        sc = self.sc
        self.pg = Postgres(self.run_dir, "pg", settings=sc.get("pg_settings", ()),
                           faketime=sc.get("pg_faketime"))
        self.redis = self.rset = self.rcluster = self.lockp = self.redlock = self.zk = self.my = None
        if sc.get("fence_store") == "etcd" or sc["backend"] == "etcd":
            # The gateways' etcd fence store, or the lock backend (issue
            # 34): each sidecar gets its own proxies to every member (below).
            self.etcd = EtcdCluster(self.run_dir, sc.get("etcd_members", 3))
        if sc["backend"] == "mysql":
            # No shared lock-backend proxy: each sidecar gets its own
            # (below). clock_mysql needs the server under libfaketime.
            self.my = MariaDB(self.run_dir, clock_file="clock_mysql" in sc["nemesis"])
        elif sc["backend"] == "zookeeper":
            # No shared lock-backend proxy: each sidecar gets its own to
            # every member (below).
            self.zk = ZooKeeperEnsemble(self.run_dir, sc.get("zk_members", 3))
        elif sc["backend"] == "redlock":
            self.redlock = RedLockMasters(self.run_dir, sc.get("redlock_masters", 5), aof=sc.get("redis_aof", False))
            self.redlock.proxies = [self.proxy(f"lock-master-{i}", port)
                                    for i, port in enumerate(self.redlock.ports)]
        elif sc["backend"] == "redis-cluster":
            # Like the sentinels, the cluster announces its nodes' own
            # addresses (CLUSTER SLOTS, MOVED): no lock-backend proxy.
            self.rcluster = RedisClusterSet(self.run_dir, node_args=sc.get("redis_node_args", ())).start()
        elif sc["backend"] == "redis-sentinel":
            # The sentinels announce the nodes' own addresses, so a proxy in
            # front of "the" lock backend has nothing to stand in front of.
            self.rset = RedisSentinelSet(self.run_dir, node_args=sc.get("redis_node_args", ()),
                                         down_after_ms=sc.get("sentinel_down_after_ms", 1000)).start()
        elif sc["backend"] == "redis":
            self.redis = Redis(self.run_dir, aof=sc.get("redis_aof", True), args=eviction.redis_args(sc, self.seed))
            if eviction.enabled(sc):
                self.eviction = eviction.Eviction(self)
            self.lockp = self.proxy("lock-backend", self.redis.port)
            lock_url = self.redis.url(self.lockp.port)
        else:
            self.lockp = self.proxy("lock-backend", self.pg.port)
            lock_url = self.pg.url(self.lockp.port)
        # Storage.
        self.storage_port = free_port()
        env = dict(os.environ, PYTHONPATH=HERE)
        self.storage = Proc("storage", [sys.executable, "-m", "harness.storage", "--port", str(self.storage_port),
                                        "--db", os.path.join(self.run_dir, "storage.db")], env,
                            os.path.join(self.run_dir, "storage.log"))
        self.storage.start()
        wait_for("storage", 10, lambda: http_ok(f"http://127.0.0.1:{self.storage_port}/healthz"))
        # Gateways on the shared PostgreSQL fence store.
        self.gateways = []
        for i, name in enumerate(["gateway-a", "gateway-b"][: sc.get("gateways", 2)]):
            stp = self.proxy(f"{name}->storage", self.storage_port)
            settings = {
                "gateway.upstream": f"http://127.0.0.1:{stp.port}",
                "gateway.fence_store": sc.get("fence_store", "postgres"),
                "gateway.postgres_url": self.pg.url(),
                "gateway.upstream_timeout_ms": sc.get("gw_upstream_timeout_ms", 3000),
                "gateway.uncertain_hold_ms": sc.get("uncertain_hold_ms", 1000),
                "gateway.serialize_timeout_ms": sc.get("serialize_timeout_ms", 3000),
                "gateway.postgres_request_timeout_ms": 1000,
            }
            if self.etcd and sc.get("fence_store") == "etcd":
                settings["gateway.etcd_endpoints"] = self.etcd.endpoints()
                settings["gateway.etcd_request_timeout_ms"] = 1000
            settings.update(sc.get("gateway_settings", {}))
            # gateway_routes: [(path pattern, key template)] binding storage
            # paths to the one key whose token may write them (the fuzzer's
            # families: without routes any token may write any path).
            routes = "".join(f'[[gateway.routes]]\npath = "{p}"\nkey = "{k}"\n'
                             for p, k in sc.get("gateway_routes", []))
            g = Fencer(self.run_dir, name, "gateway", self.binary, settings, self.mutants("gateway"),
                       config_text=routes or None)
            g.storage_proxy = stp
            self.gateways.append(g)
        # Sidecars and workers.
        self.sidecars, self.workers = [], []
        n = sc["workers"]
        direct = sc.get("direct_workers", n // 2)
        for i in range(n):
            g = self.gateways[i % len(self.gateways)]
            gwp = self.proxy(f"sidecar-{i}->{g.name}", g.api_port)
            settings = {
                "backend.kind": "redis" if (self.rset or self.rcluster) else sc["backend"],
                "sidecar.default_ttl_ms": sc["ttl_ms"],
                "sidecar.safety_margin_ms": 20,
                "proxy.upstream": f"http://127.0.0.1:{gwp.port}",
                "proxy.upstream_timeout_ms": sc.get("proxy_upstream_timeout_ms", 8000),
                "proxy.connect_timeout_ms": 500,
                "gateway.serialize_timeout_ms": sc.get("serialize_timeout_ms", 3000),
                "gateway.upstream_timeout_ms": sc.get("gw_upstream_timeout_ms", 3000),
                "gateway.connect_timeout_ms": 1000,
                "sidecar.preregister_timeout_ms": sc.get("preregister_timeout_ms", 5000),
                "sidecar.lost_lease_retention_ms": 60000,
            }
            if sc.get("preregister", True):
                settings["sidecar.preregister_url"] = f"http://127.0.0.1:{gwp.port}/_fencer/v1/fences/"
            if self.rset:
                settings.update(self._sentinel_settings())
            elif self.rcluster:
                settings.update(self._cluster_settings())
            elif self.zk:
                zkp = [self.proxy(f"sidecar-{i}->zk-{j}", port) for j, port in enumerate(self.zk.ports)]
                settings.update(self._zookeeper_settings(zkp))
            elif sc["backend"] == "etcd":
                etp = [self.proxy(f"sidecar-{i}->etcd-{j}", port) for j, port in enumerate(self.etcd.ports)]
                settings["backend.etcd.endpoints"] = ",".join(f"http://127.0.0.1:{p.port}" for p in etp)
                settings["backend.etcd.request_timeout_ms"] = sc.get("etcd_request_timeout_ms", 1000)
            elif self.my:
                myp = self.proxy(f"sidecar-{i}->mysql", self.my.port)
                settings.update(self._mysql_settings(myp))
            elif self.redlock:
                settings["backend.redlock.urls"] = ",".join(
                    f"redis://127.0.0.1:{p.port}/0" for p in self.redlock.proxies)
                settings["backend.redlock.restart_quarantine_ms"] = sc.get("redlock_quarantine_ms", 2000)
            elif sc["backend"] == "redis":
                settings["backend.redis.url"] = lock_url
                settings["backend.redis.token_mode"] = sc.get("token_mode", "hybrid_clock")
                settings["backend.redis.request_timeout_ms"] = 500
                settings.update(eviction.sidecar_settings(sc))
            else:
                settings["backend.postgres.url"] = lock_url
                settings["backend.postgres.request_timeout_ms"] = 1000
            if sc.get("sidecar_state_dir"):
                # Write-sequence reservations survive a restart here
                # (clock_restarts.py).
                state = os.path.join(self.run_dir, f"sidecar-{i}", "state")
                os.makedirs(state, exist_ok=True)
                settings["sidecar.state_dir"] = state
            # Extra settings a scenario asks for (e.g. an override a
            # configuration mutant needs to be allowed to start).
            settings.update(sc.get("sidecar_settings", {}))
            # sidecar_faketime: every sidecar's clock; first_sidecar_faketime:
            # one sidecar's only (the others keep the real clock).
            faketime = sc.get("sidecar_faketime") or (sc.get("first_sidecar_faketime") if i == 0 else None)
            s = Fencer(self.run_dir, f"sidecar-{i}", "sidecar", self.binary, settings,
                       self.mutants("sidecar"), faketime=faketime, ready=self.eviction is None)
            s.gateway_proxy = gwp
            s.zk_proxies = zkp if self.zk else []
            s.etcd_proxies = etp if sc["backend"] == "etcd" else []
            s.mysql_proxy = myp if self.my else None
            self.sidecars.append(s)
            mode = "direct" if i < direct else "proxy"
            self.workers.append(self._worker(i, s, g, mode))

    def _sentinel_settings(self):
        """A sidecar's `backend.redis` for the sentinel set (lists go to the
        environment comma-separated)."""
        sc = self.sc
        out = {
            "backend.redis.mode": "sentinel",
            "backend.redis.sentinels": ",".join(self.rset.sentinel_addrs),
            "backend.redis.master_name": self.rset.NAME,
            "backend.redis.token_mode": sc.get("token_mode", "hybrid_clock"),
            "backend.redis.request_timeout_ms": 500,
        }
        if out["backend.redis.token_mode"] == "counter":
            # Refused with a replicated Redis unless accepted explicitly:
            # the counter_tokens mutant runs it to show why.
            out["backend.redis.allow_counter_with_failover"] = "true"
        if sc.get("wait_replicas"):
            out["backend.redis.wait_replicas"] = sc["wait_replicas"]
            out["backend.redis.wait_timeout_ms"] = sc.get("wait_timeout_ms", 100)
        return out

    def _zookeeper_settings(self, proxies):
        """A sidecar's `backend.zookeeper`: its own proxies to the members,
        a 3 s session (a partition or a freeze of 3.5–5 s expires it within
        a family's run), requests bounded at 500 ms (≤ a third of the
        session). The 500 ms TTL is below the 45 % of the session minus the
        lock-delay (1 350 ms) the sidecar checks at start."""
        sc = self.sc
        return {
            "backend.zookeeper.connect": ",".join(f"127.0.0.1:{p.port}" for p in proxies),
            "backend.zookeeper.session_timeout_ms": sc.get("zk_session_timeout_ms", 3000),
            "backend.zookeeper.request_timeout_ms": sc.get("zk_request_timeout_ms", 500),
        }

    def _mysql_settings(self, proxy):
        """A sidecar's `backend.mysql`: its own proxy to the server, a small
        pool, statements bounded at 1 s (0.8 s on the server), and an
        idle-row clean-up every 500 ms of rows free for 1 s — so keys the
        faults leave idle are deleted and come back above the token floor
        (a forward jump of the server's clock makes every free row idle at
        once)."""
        sc = self.sc
        return {
            "backend.mysql.url": self.my.url(proxy.port),
            "backend.mysql.pool_size": sc.get("mysql_pool_size", 4),
            "backend.mysql.wake_connections": sc.get("mysql_wake_connections", 4),
            "backend.mysql.bell_connections": 2,
            "backend.mysql.request_timeout_ms": sc.get("mysql_request_timeout_ms", 1000),
            "backend.mysql.idle_cleanup_after_ms": sc.get("mysql_idle_cleanup_after_ms", 1000),
            "backend.mysql.cleanup_interval_ms": sc.get("mysql_cleanup_interval_ms", 500),
        }

    def mysql_metrics(self):
        """What the sidecars counted on the MySQL backend (scraped from their
        admin /metrics at the end of the run; a sidecar restarted during the
        run counts from its restart): every `fencer_mysql_*` series, summed
        over the sidecars (`bell_events.rung`, `cleanup_rows`, …), and the
        server's lock rows and token floor at the end."""
        out = {}
        for s in self.sidecars:
            for line in s.metrics().splitlines():
                if line.startswith("fencer_mysql_") and " " in line:
                    series = line.rsplit(" ", 1)[0]
                    name = series.split("{")[0][len("fencer_mysql_"):].removesuffix("_total")
                    if "{" in series:
                        name += "." + series.split('="', 1)[1].split('"', 1)[0]
                    try:
                        out[name] = out.get(name, 0) + float(line.rsplit(" ", 1)[1])
                    except ValueError:
                        pass
        try:
            out["rows_at_end"] = int(self.my.sql("SELECT COUNT(*) FROM fencer_locks").strip() or 0)
            out["token_floor_at_end"] = int(self.my.sql("SELECT floor FROM fencer_token_floor").strip() or 0)
        except Exception:
            pass
        return {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in out.items()}

    def lock_request_timeout_ms(self):
        """The sidecars' bound on one lock-backend request (the settings
        above): a reply held longer than this comes after its caller gave
        up (late_reply)."""
        b = self.sc["backend"]
        if b == "zookeeper":
            return self.sc.get("zk_request_timeout_ms", 500)
        if b == "etcd":
            return self.sc.get("etcd_request_timeout_ms", 1000)
        if b == "mysql":
            return self.sc.get("mysql_request_timeout_ms", 1000)
        if b == "postgres":
            return 1000
        if b == "redlock":
            return 50  # backend.redlock.request_timeout_ms's default
        return 500

    def gateway_call_timeout_ms(self, aim):
        """The sidecars' bound on one call to their gateway (the settings
        above): a pre-registration's (`sidecar.preregister_timeout_ms`) or
        a proxied request's (`proxy.upstream_timeout_ms`). A reply held
        longer comes after its caller gave up (late_reply_gateway)."""
        if aim == "preregister":
            return self.sc.get("preregister_timeout_ms", 5000)
        return self.sc.get("proxy_upstream_timeout_ms", 8000)

    def lock_links(self):
        """The proxied links from sidecars to the lock backend, in groups
        a fault hits together: one group per sidecar on ZooKeeper (its
        links to every member: its client talks to one of them) and MySQL;
        one per master on RedLock; the one shared link on Redis and
        PostgreSQL. None on the sentinel set and the cluster (no proxy)."""
        if self.zk:
            return [s.zk_proxies for s in self.sidecars]
        if self.sc["backend"] == "etcd":
            return [s.etcd_proxies for s in self.sidecars]
        if self.my:
            return [[s.mysql_proxy] for s in self.sidecars]
        if self.redlock:
            return [[p] for p in self.redlock.proxies]
        if self.lockp:
            return [[self.lockp]]
        return []

    def worker_of(self, sidecar):
        return next(w.cfg["id"] for w in self.workers if w.sidecar is sidecar)

    def zk_session_s(self):
        """How long a frozen or cut-off sidecar's hold on the backend lasts
        on the backend's clock: its ZooKeeper session, or on etcd its
        places' leases (TTL 500 ms + lock-delay, rounded up to etcd's whole
        seconds: 1 s)."""
        if self.sc["backend"] == "etcd":
            return self.sc.get("etcd_lapse_s", 1.0)
        return self.sc.get("zk_session_timeout_ms", 3000) / 1000

    def zookeeper_metrics(self):
        """What the sidecars counted about their ZooKeeper sessions, scraped
        from their admin /metrics at the end of the run (a sidecar restarted
        during the run counts from its restart), beside the faults that
        should have expired a session: per sidecar, the `partition_zk` and
        `pause_sidecar_long` that targeted it since its last restart
        (`kill_sidecar` starts its counters again). A sidecar that counted
        fewer expiries than that is listed in `not_expired`."""
        texts = [s.metrics() for s in self.sidecars]

        def per(event):
            return [int(metric_sum(t, "fencer_zookeeper_session_events_total", {"event": event})) for t in texts]
        expired = per("expired")
        with self.lock:
            events = list(self.nemesis_events)
        expected = []
        for s in self.sidecars:
            since = max([n["t"] for n in events if n.get("kind") == "kill" and n.get("target") == s.name] or [0])
            expected.append(sum(1 for n in events if n.get("kind") in ("partition_zk", "pause_sidecar_long")
                                and n.get("target") == s.name and n["t"] > since))
        return {
            "sessions_expired": expired, "expected_expiries": expected,
            "not_expired": [s.name for s, n, e in zip(self.sidecars, expired, expected) if n < e],
            "disconnected": sum(per("disconnected")), "reconnected": sum(per("reconnected")),
            "connected": sum(per("connected")), "connect_failed": sum(per("connect_failed")),
            "lease_expiries": int(sum(metric_sum(t, "fencer_zookeeper_lease_expiries_total") for t in texts)),
            "cleanup_retries": int(sum(metric_sum(t, "fencer_zookeeper_cleanup_retries_total") for t in texts)),
            "dead_nodes_deleted": int(sum(metric_sum(t, "fencer_zookeeper_dead_nodes_deleted_total") for t in texts)),
            "leases_lost_failover": int(sum(metric_sum(t, "fencer_lost_leases_total", {"reason": "failover"})
                                            for t in texts)),
        }

    def _cluster_settings(self):
        """A sidecar's `backend.redis` for the cluster (nodes comma-separated
        in the environment)."""
        sc = self.sc
        out = {
            "backend.redis.mode": "cluster",
            "backend.redis.nodes": ",".join(self.rcluster.node_urls()),
            "backend.redis.topology_check_interval_ms": sc.get("topology_check_interval_ms", 200),
            "backend.redis.token_mode": sc.get("token_mode", "hybrid_clock"),
            "backend.redis.request_timeout_ms": 500,
        }
        if out["backend.redis.token_mode"] == "counter":
            # Refused with a replicated Redis unless accepted explicitly:
            # the counter_tokens mutant runs it to show why.
            out["backend.redis.allow_counter_with_failover"] = "true"
        if sc.get("wait_replicas"):
            out["backend.redis.wait_replicas"] = sc["wait_replicas"]
            out["backend.redis.wait_timeout_ms"] = sc.get("wait_timeout_ms", 100)
        return out

    def failover_metrics(self):
        """What the sidecars counted about failovers, scraped from their
        admin /metrics at the end of the run (a sidecar restarted during the
        run counts from its restart), beside the failovers that happened: on
        a sentinel set the switches the sentinels made, on a cluster the
        promotions the nemesis caused and saw. A sidecar that counted fewer
        did not follow one. (On a cluster a sidecar may count more: it
        counts every change of its slot map, and a master flagged failing,
        then replaced, can be two.)"""
        texts = [s.metrics() for s in self.sidecars]
        seen = [int(metric_sum(t, "fencer_redis_failovers_total")) for t in texts]
        out = {
            "leases_lost_failover": int(sum(metric_sum(t, "fencer_lost_leases_total", {"reason": "failover"})
                                            for t in texts)),
            "redis_failovers_seen": seen,
        }
        if self.rset:
            expected = out["sentinel_switches"] = self.rset.switches()
        else:
            with self.lock:
                expected = sum(1 for n in self.nemesis_events if n.get("kind") == "promoted")
            out["nemesis_failovers"] = expected
        out["not_following"] = [s.name for s, n in zip(self.sidecars, seen) if n < expected]
        return out

    def redlock_rounds(self):
        """The sidecars' RedLock acquire rounds by outcome (majority, held,
        split, undecided, quarantined, …), summed and scraped at the end of
        the run (a sidecar restarted during the run counts from its
        restart)."""
        texts = [s.metrics() for s in self.sidecars]
        outcomes = ["majority", "held", "split", "undecided", "quarantined", "validity_exhausted",
                    "writeback_short"]
        return {o: int(sum(metric_sum(t, "fencer_redlock_rounds_total", {"op": "acquire", "outcome": o})
                           for t in texts)) for o in outcomes}

    def _worker(self, i, sidecar, gateway, mode):
        sc = self.sc
        wdir = os.path.join(self.run_dir, f"worker-{i}")
        os.makedirs(wdir, exist_ok=True)
        cfg = {
            "id": f"w{i}", "seed": self.seed * 1000 + i, "mode": mode,
            "api": sidecar.api, "proxy": sidecar.proxy,
            "gateway": gateway.api, "keys": sc["keys"], "ttl_ms": sc["ttl_ms"],
            "wait_ms": sc["wait_ms"], "think_ms": sc.get("think_ms", [20, 60]),
            "self_pause_p": sc.get("self_pause_p", 0), "self_pause_ttl": sc.get("self_pause_ttl", [1.0, 1.3]),
            "timeout_ms": sc.get("client_timeout_ms", 4000), "duration_s": sc["duration_s"],
            "history": os.path.join(wdir, "history.jsonl"), "pause_file": os.path.join(wdir, "pause.req"),
            "replay_p": sc.get("replay_p", 0), "forge_p": sc.get("forge_p", 0),
            "short_release_p": sc.get("short_release_p", 0), "short_release_ms": sc.get("short_release_ms", 200),
            "adopt_after_restart": sc.get("adopt_after_restart", False),
            # Semaphore workload (issue 33): each key is a semaphore of
            # this many permits; a cycle writes under the slot key it got.
            "semaphore_permits": sc.get("semaphore_permits"),
            "semaphore_other_count_p": sc.get("semaphore_other_count_p", 0),
            # Read-write locks (issue 33 item 2): read leases in this share
            # of the cycles.
            "read_p": sc.get("read_p", 0),
            # Renewals, holds and clients that walk away (worker.py, issue 28).
            "clients": sc.get("clients", {}),
        }
        with open(os.path.join(wdir, "config.json"), "w") as f:
            json.dump(cfg, f)
        env = dict(os.environ, PYTHONPATH=HERE)
        p = Proc(f"w{i}", [sys.executable, "-m", "harness.worker", os.path.join(wdir, "config.json")], env,
                 os.path.join(wdir, "stderr.log"))
        p.cfg, p.sidecar, p.mode = cfg, sidecar, mode
        return p

    # ------------------------------------------------------------ running

    def start_workers(self):
        for w in self.workers:
            # The other sidecars' lock APIs (renewals `elsewhere_p`), known
            # once every sidecar is up.
            w.cfg["other_apis"] = [s.api for s in self.sidecars if s is not w.sidecar]
            with open(os.path.join(os.path.dirname(w.cfg["history"]), "config.json"), "w") as f:
                json.dump(w.cfg, f)
            w.start()
        threading.Thread(target=self._self_pauses, daemon=True).start()
        if self.sc.get("fence_store", "postgres") in ("postgres", "etcd"):
            threading.Thread(target=self._sample_marks, daemon=True).start()

    def _self_pauses(self):
        """Continues a worker that stopped itself, after the time it asked."""
        pending = {}
        while not self.stop_flag.is_set():
            now = time.monotonic()
            for w in self.workers:
                req = w.cfg["pause_file"]
                if w.name not in pending and os.path.exists(req) and proc_state(w.pid) == "T":
                    try:
                        d = int(open(req).read())
                    except (OSError, ValueError):
                        continue
                    os.remove(req)
                    pending[w.name] = now + d / 1000
            for name, at in list(pending.items()):
                if now >= at:
                    next(w for w in self.workers if w.name == name).resume()
                    del pending[name]
            time.sleep(0.002)
        for w in self.workers:
            w.resume()

    def _sample_marks(self):
        while not self.stop_flag.is_set():
            if self.etcd and self.sc.get("fence_store") == "etcd":
                t = time.monotonic_ns()
                for k, tok in self.etcd.marks().items():
                    self.marks.append({"t": t, "key": k, "token": tok})
                time.sleep(0.25)
                continue
            try:
                out = self.pg.psql("SELECT key, token FROM fencer_fences")
                t = time.monotonic_ns()
                for line in out.splitlines():
                    if "|" in line:
                        k, tok = line.rsplit("|", 1)
                        self.marks.append({"t": t, "key": k, "token": int(tok)})
            except Exception:
                pass
            time.sleep(0.25)

    def wait_workers(self, timeout):
        end = time.time() + timeout
        for w in self.workers:
            while w.alive() and time.time() < end:
                if proc_state(w.pid) == "T" and not os.path.exists(w.cfg["pause_file"]):
                    w.resume()
                time.sleep(0.05)
        for w in self.workers:
            if w.alive():
                w.signal(signal.SIGCONT)
                w.kill()

    def heal_all(self):
        for p in self.proxies:
            p.set("pass")
        for s in self.sidecars:
            s.proc.resume()
        for g in self.gateways:
            g.proc.resume()
        if self.redis:
            self.redis.proc.resume()
        if self.eviction:
            self.eviction.heal()
        if self.my:
            # Running (a fault that failed half-way may have left it down),
            # unpaused, on the real clock.
            try:
                self.my.resume()
                if not self.my.alive():
                    self.my.restart()
                    self.event(kind="restarted", target="mysql", by="heal")
                if self.my.clock_file and self.my.offset_s:
                    t0, back = time.monotonic_ns(), self.my.offset_s
                    self.event(kind="clock_mysql", offset_s=0, by="heal",
                               landed_ms=self.my.set_offset(0))
                    if back < 0:  # back to the real clock: a forward jump
                        self.event(kind="admits_overlap", cause="clock_mysql_forward", t0=t0,
                                   t1=time.monotonic_ns() + int((self.sc["ttl_ms"] / 1000 + 0.3) * 1e9),
                                   keys=None, workers=None)
            except Exception as e:
                self.event(kind="nemesis_error", family="heal", error=str(e)[:2000])
        if self.redlock:
            self.redlock.resume_all()
        if self.zk:
            # Every member running and unpaused (a fault that failed half-way
            # may have left one down), then one leader and its followers
            # before the quiet phase.
            self.zk.resume_all()
            try:
                for i in range(self.zk.n):
                    if not self.zk.alive(i):
                        self.zk.restart(i)
                        self.event(kind="restarted", target=f"zk-{i}", by="heal")
                self.zk.wait_healthy(20)
            except Exception as e:
                self.event(kind="nemesis_error", family="heal", error=str(e)[:2000])
        if self.rset:
            self.rset.thaw_links()
        if self.rcluster:
            # A node a failover left down is started again, and the next
            # run phase (quiet) starts from a healthy cluster.
            try:
                self.rcluster.heal(20)
            except Exception as e:
                self.event(kind="nemesis_error", family="heal", error=str(e)[:2000])
        self.pg.resume()
        self.storage.resume()
        try:
            subprocess.run(["curl", "-s", "-XPOST", f"http://127.0.0.1:{self.storage_port}/_control",
                            "-d", '{"delay_ms": 0}'], capture_output=True, timeout=5)
        except Exception:
            pass

    def shutdown(self):
        self.stop_flag.set()
        for w in self.workers:
            w.kill()
        for s in self.sidecars:
            s.proc.kill()
        for g in self.gateways:
            g.proc.kill()
        if self.storage:
            self.storage.kill()
        for p in self.proxies:
            p.close()
        if self.redis:
            self.redis.stop()
        if self.redlock:
            self.redlock.stop()
        if self.zk:
            self.zk.stop()
        if self.etcd:
            self.etcd.stop()
        if self.my:
            self.my.stop()
        if self.rset:
            self.rset.stop()
        if self.rcluster:
            self.rcluster.stop()
        if self.pg:
            self.pg.stop()
