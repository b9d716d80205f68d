"""Running one scenario: start the cluster, run the workload under the
nemesis, heal, let the workload finish in quiet, collect every history and
check it."""
import json
import os
import shutil
import time
import urllib.request

from . import checker, clock_restarts, eviction, late_requests
from . import observer as observer_mod
from .cluster import Cluster
from .nemesis import Nemesis


def load_history(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass  # a line cut by a kill
    except OSError:
        pass
    return out


def injections(sidecars):
    """The proxies' "token injected" lines (JSON logs, flat or nested)."""
    out = []
    for s in sidecars:
        for e in s.log_events():
            fields = e.get("fields", e)
            if fields.get("message") == "token injected":
                out.append(dict(fields, sidecar=s.name))
    return out


def seam_counts(logs):
    """What the sidecars' logs (one list of parsed JSON lines each) say
    about the seams the late_reply and slow_preregistration faults aim at:
    compensations of abandoned acquire tries by outcome (`superseded`: a
    retry of the same lease had been answered meanwhile — the undo that
    must not release it, PITFALLS 11), and acquires not handed over
    because their lease ran out first."""
    out = {"undo_released": 0, "undo_superseded": 0, "expired_before_answer_logged": 0}
    for log in logs:
        for e in log:
            fields = e.get("fields", e)
            msg = fields.get("message", "")
            if msg == "compensation of an acquire attempt whose caller gave up":
                k = "undo_" + str(fields.get("outcome"))
                out[k] = out.get(k, 0) + 1
            elif msg.startswith("lease ran out before the acquire could answer"):
                out["expired_before_answer_logged"] += 1
            elif msg == "released a lease nobody holds":
                # An acquire whose client left (or a renewal reply too
                # late) left a lease the sidecar gave back (issue 28).
                out["orphans_released"] = out.get("orphans_released", 0) + 1
            elif msg == "hold connection closed":
                out["holds_closed"] = out.get("holds_closed", 0) + 1
    return out


def observed_keys(sc):
    """The lock keys the workers take: a semaphore's are its slot keys."""
    n = sc.get("semaphore_permits")
    if not n:
        return sc["keys"]
    return [f"{k}#{i}" for k in sc["keys"] for i in range(n)]


def run(sc, seed, binary, out_dir, keep=False):
    """Runs scenario `sc`; returns a result dict (verdict PASS, FAIL or
    INCONCLUSIVE, violations, bite metrics)."""
    name = f"{sc['name']}-{sc['backend']}-seed{seed}"
    run_dir = os.path.join(out_dir, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    started = time.monotonic()
    cluster = observer = None
    try:
        cluster = Cluster(sc, run_dir, binary, seed)
        quiet = sc.get("quiet_s", 6)
        # The backend's own record of each key's holder (where it can be
        # read directly): the second witness for M1.
        if observer_mod.Observer.supports(cluster):
            observer = observer_mod.Observer(cluster, observed_keys(sc), os.path.join(run_dir, "observer.jsonl"))
            observer.start()
        # What a run spends before its workload starts and after it ends
        # (servers, sidecars, gateways up and down), reported per run:
        # what reusing servers across families could save (issue 29).
        setup_s = time.monotonic() - started
        cluster.start_workers()
        cluster.event(kind="start")
        nem = Nemesis(cluster, sc["nemesis"], seed, sc["ttl_ms"], tuple(sc.get("interval", (0.3, 1.5))))
        fuzz = None
        if sc.get("fuzz") is not None:
            # The gateway fuzzer (issue 28) runs while the faults do.
            from .fuzzer import Fuzzer
            fuzz = Fuzzer(cluster, seed, sc["fuzz"])
            fuzz.start(max(1, sc["duration_s"] - quiet))
        if sc["nemesis"]:
            nem.run_for(max(1, sc["duration_s"] - quiet))
        else:
            cluster.event(kind="heal")
        cluster.wait_workers(sc["duration_s"] + 60)
        nem.join()
        if observer:
            observer.stop()
        if fuzz:
            fuzz.stop()
        events = []
        for w in cluster.workers:
            events += load_history(w.cfg["history"])
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.storage_port}/_log", timeout=30) as r:
            commits = json.load(r)["log"]
        inj = injections(cluster.sidecars)
        # The fuzzer's writes are not the workers' ledger: F1 checks them
        # (and S1 across both), S3/S4/S6 the workers' own.
        ledger = [c for c in commits if not c.get("fuzz")]
        observed = observer_mod.load(observer.path) if observer else None
        report = checker.check(events, ledger, inj, cluster.marks, cluster.nemesis_events, sc, observed)
        if observer:
            report.bites["observer_samples"] = observer.samples
        fuzz_refused_by = None
        if fuzz:
            from .fuzzer import stats as fuzz_stats
            checker.check_fuzz(report, events, fuzz.events, commits)
            fz_bites, fuzz_refused_by = fuzz_stats(fuzz.events, commits)
            report.bites.update(fz_bites)
        report.bites.update(seam_counts(s.log_events() for s in cluster.sidecars))
        # Statements that reached the backend late (O1, issue 28).
        late_requests.check(report, events, cluster.nemesis_events, observed)
        # Sidecars restarted with their clock stepped (A1, issue 28).
        clock_restarts.check(report, events, cluster.nemesis_events)
        if cluster.eviction:
            # Held while Redis may evict (E1, issue 28).
            eviction.check(report, events, cluster.nemesis_events, sc, cluster)
        # late_reply_gateway: replies held on sidecar→gateway links (the
        # proxies' own record), by what they answered.
        gw_late = [n for n in cluster.nemesis_events
                   if n.get("kind") == "late_reply_fired" and "->gateway" in str(n.get("proxy"))]
        if any(n.get("kind") == "late_reply" and "->gateway" in str(n.get("proxy")) for n in cluster.nemesis_events):
            report.bites["late_replies_gateway"] = len(gw_late)
            report.bites["late_replies_preregister"] = sum(1 for n in gw_late
                                                           if "/_fencer/" in str(n.get("request")))
        failover_metrics = cluster.failover_metrics() if (cluster.rset or cluster.rcluster) else None
        redlock_rounds = cluster.redlock_rounds() if cluster.redlock else None
        zk_metrics = cluster.zookeeper_metrics() if cluster.zk else None
        mysql_metrics = cluster.mysql_metrics() if cluster.my else None
        if zk_metrics is not None:
            # Sessions the ensemble expired, as the sidecars counted them:
            # the bite of partition_zk and pause_sidecar_long.
            report.bites["zk_sessions_expired"] = sum(zk_metrics["sessions_expired"])
    except Exception as e:
        result = {"name": name, "verdict": "ERROR", "error": repr(e), "dir": run_dir,
                  "seconds": round(time.monotonic() - started, 1)}
        if observer:
            observer.stop()
        if cluster:
            cluster.shutdown()
        return result
    down = time.monotonic()
    cluster.shutdown()
    teardown_s = time.monotonic() - down
    verdict = "PASS"
    short = {}
    if not report.ok:
        verdict = "FAIL"
    else:
        for k, need in sc.get("bite", {}).items():
            if report.bites.get(k, 0) < need:
                short[k] = (report.bites.get(k, 0), need)
        if short:
            verdict = "INCONCLUSIVE"
    faults_by_kind = {}
    for n in cluster.nemesis_events:
        if n.get("kind") == "proxy" and n.get("mode") != "reset":
            continue  # the proxy's own record of a mode the nemesis logged as "net"
        if n.get("kind") not in ("start", "heal", "restarted", "nemesis_error", "promoted", "skipped",
                                 "cluster_healthy", "zk_healthy", "zk_leader_elected") + checker.NOT_FAULTS:
            k = "net_" + n["mode"] if n.get("kind") in ("net", "proxy") else n.get("kind")
            faults_by_kind[k] = faults_by_kind.get(k, 0) + 1
    result = {
        "name": name, "scenario": sc["name"], "backend": sc["backend"], "seed": seed,
        "faults_by_kind": faults_by_kind,
        "writes_per_s": round(len(commits) / max(1, sc["duration_s"]), 1),
        "mutants": sc.get("mutants", {}), "verdict": verdict,
        "violations": report.violations, "bites": report.bites, "below_threshold": short,
        "m1_excused": report.stats.get("m1_excused", {}),
        "fuzz_refused_by": fuzz_refused_by,
        "seconds": round(time.monotonic() - started, 1), "dir": run_dir,
        "setup_seconds": round(setup_s, 1), "teardown_seconds": round(teardown_s, 1),
    }
    if any(n.get("kind") in checker.UNAVAILABILITY_KINDS for n in cluster.nemesis_events):
        each = report.stats["unavailability_ms"]
        result["unavailability_ms"] = checker.spread(each)
        result["unavailability_each_ms"] = each
    if "lock_unavailability_ms" in report.stats:
        # The etcd lock backend's leader kills: kill → first acquire granted.
        result["lock_unavailability_ms"] = checker.spread(report.stats["lock_unavailability_ms"])
    if "fence_unavailability_ms" in report.stats:
        # The etcd fence store's leader kills: kill → first write applied.
        result["fence_unavailability_ms"] = checker.spread(report.stats["fence_unavailability_ms"])
    if failover_metrics is not None:
        result["failover_metrics"] = failover_metrics
    if redlock_rounds is not None:
        result["redlock_rounds"] = redlock_rounds
    if mysql_metrics is not None:
        result["mysql_metrics"] = mysql_metrics
        recovered = [n["recovery_ms"] for n in cluster.nemesis_events
                     if n.get("kind") == "restarted" and n.get("target") == "mysql" and "recovery_ms" in n]
        if recovered:
            result["mysql_recovery_ms"] = checker.spread(recovered)
        landed = [n["landed_ms"] for n in cluster.nemesis_events if n.get("kind") == "clock_mysql"]
        if landed:
            result["mysql_clock_landed_ms"] = checker.spread(landed)
    if zk_metrics is not None:
        result["zookeeper_metrics"] = zk_metrics
        elected = [n["elapsed_ms"] for n in cluster.nemesis_events if n.get("kind") == "zk_leader_elected"]
        if elected:
            result["zk_election_ms"] = checker.spread(elected)
    with open(os.path.join(run_dir, "report.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(run_dir, "nemesis.jsonl"), "w") as f:
        for n in cluster.nemesis_events:
            f.write(json.dumps(n) + "\n")
    if verdict == "PASS" and not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
        result["dir"] = None
    return result


def run_directed_rmw(sc, seed, binary, out_dir):
    """The scripted interleaving of FAULT-SUITE's "fence on write only"
    directed test (see run.py): two holders of one account, no
    pre-registration, A paused between its read and its write."""
    import http.client

    name = f"directed-rmw-seed{seed}"
    run_dir = os.path.join(out_dir, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    started = time.monotonic()
    cluster = Cluster(sc, run_dir, binary, seed)
    events = []

    def call(method, base, path, headers=None, body=None):
        host, port = base.replace("http://", "").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        data = json.dumps(body).encode() if body is not None else None
        h = dict(headers or {})
        if data is not None:
            h["content-type"] = "application/json"
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        raw = r.read()
        conn.close()
        return r.status, (json.loads(raw) if raw else {})

    try:
        key = sc["keys"][0]
        ttl = sc["ttl_ms"]
        (sa, sb), (ga, gb) = cluster.sidecars[:2], cluster.gateways[:2]

        def acquire(s, proc):
            st, lease = call("POST", s.api, f"/v1/locks/{key}/acquire", body={"ttl_ms": ttl, "wait_ms": 3000})
            assert st == 200, lease
            events.append({"t": time.monotonic_ns(), "proc": proc, "kind": "ok", "f": "acquire", "key": key,
                           "resp": lease})
            return lease

        def fenced(method, g, lease, seq, body=None, proc=None):
            h = {"Fencing-Token": lease["fencing_token"], "Fencing-Key": key, "Fencing-Seq": str(seq)}
            if body:
                events.append({"t": time.monotonic_ns(), "proc": proc, "kind": "invoke", "f": "write",
                               "key": key, "op_id": body["op_id"]})
            st, resp = call(method, g.api, f"/kv/{key}", h, body)
            if body:
                events.append({"t": time.monotonic_ns(), "proc": proc, "kind": "ok" if st == 200 else "fail",
                               "f": "write", "key": key, "op_id": body["op_id"], "error": resp.get("error")})
            return st, resp

        a = acquire(sa, "A")
        st, r = fenced("GET", ga, a, 1)
        bal_a = r.get("balance", 0) if st == 200 else 0
        time.sleep(ttl * 1.05 / 1000)  # A is paused past its lease
        b = acquire(sb, "B")
        st, r = fenced("GET", gb, b, 1)
        bal_b = r.get("balance", 0) if st == 200 else 0
        fenced("PUT", ga, a, 2, {"balance": bal_a + 1, "op_id": "A-1", "prev": bal_a}, "A")
        fenced("PUT", gb, b, 2, {"balance": bal_b + 1, "op_id": "B-1", "prev": bal_b}, "B")
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.storage_port}/_log", timeout=30) as resp:
            commits = json.load(resp)["log"]
        report = checker.check(events, commits, [], cluster.marks, [], dict(sc, wait_ms=3000))
        verdict = "PASS" if report.ok else "FAIL"
        result = {"name": name, "verdict": verdict, "violations": report.violations,
                  "bites": {"applied": len(commits)}, "seconds": round(time.monotonic() - started, 1),
                  "dir": run_dir}
    except Exception as e:
        result = {"name": name, "verdict": "ERROR", "error": repr(e), "dir": run_dir,
                  "seconds": round(time.monotonic() - started, 1)}
    finally:
        cluster.shutdown()
    if result["verdict"] == "PASS":
        shutil.rmtree(run_dir, ignore_errors=True)
        result["dir"] = None
    return result
