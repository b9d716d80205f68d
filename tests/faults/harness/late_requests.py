"""Statements that reach the lock backend late (issue 28): the nemesis
`late_request` and the check of what such a statement may leave behind.

A request that names a scenario key is held on its link 1.1–1.5× the
sidecars' backend request timeout and then delivered (faultproxy mode
`late_request`): its caller has timed out, retried, compensated, answered
its client or given up by then. What must hold:

- M1 (checked in every run): a late acquire that lands after its caller
  gave up is never a second holder, and a late release never frees a
  later lease (release is compare-and-delete by lease id);
- no holder nobody was told about outlives its TTL: after the statement
  landed, the key's backend entry is read twice — at once (0.1 s after
  delivery) and a TTL (+0.4 s) later. A lease id live in both reads that
  no client was ever answered for (no acquire or renew answered 200 with
  it) is an orphan that outlived its TTL (`O1`; the sidecars renew only
  leases they handed out). PostgreSQL tombstones a voided attempt, so
  there a late acquire should take nothing at all; Redis' and MySQL's may
  hold for at most their TTL.

Aims (`late_request_aims`, as for late_reply): "key" — the next request
naming any scenario key — or, where the backend's requests tell them
apart (nemesis.AIM_MARKERS: MySQL's acquire carries the bell name,
PostgreSQL's release the notification channel), "acquire" or "release".
"""
import re
import threading
import time

from .procs import resp

# Read the key's entry this long after the statement landed, and again a
# TTL plus this later.
FIRST_PROBE_S = 0.1
SECOND_PROBE_SLACK_S = 0.4


def fire(nem):
    """One late_request fault (called by Nemesis.late_request)."""
    from .nemesis import arm_once  # the one arming of a held request or reply

    c = nem.c
    group = nem.rng.choice(c.lock_links())
    timeout = c.lock_request_timeout_ms()
    ms = int(nem.rng.uniform(*c.sc.get("late_request_factor", (1.1, 1.5))) * timeout)
    with c.lock:
        before = sum(1 for n in c.nemesis_events if n.get("kind") == "late_request_delivered")
    fired = arm_once(nem, "late_request", group, ms, timeout)
    if not fired:
        return
    # The held request is still on its way: let it land (the proxy records
    # `late_request_delivered`), then read the key's entry twice in the
    # background (the nemesis goes on meanwhile).
    deadline = time.monotonic() + ms / 1000 + 2.0
    d = None
    while d is None and time.monotonic() < deadline:
        with c.lock:
            delivered = [n for n in c.nemesis_events if n.get("kind") == "late_request_delivered"]
        if len(delivered) > before:
            d = delivered[before]
        time.sleep(0.01)
    if d is None:
        return  # dropped with its connection (a reset): nothing arrived
    keys = keys_named(d.get("request", ""), c.sc["keys"])
    if keys:
        threading.Thread(target=_probe_twice, args=(c, keys, d["t"]), daemon=True).start()


def keys_named(text, keys):
    """The scenario keys a request's printable bytes name (longest first,
    so "acct:1" is not taken for "acct:10")."""
    out = []
    for k in sorted(keys, key=len, reverse=True):
        if re.search(re.escape(k) + r"(?![0-9A-Za-z])", text) and not any(k in o for o in out):
            out.append(k)
    return out


def holder(c, key):
    """The lease id holding `key` in the backend now (None: free), read
    the way each backend stores it. Redis: `fencer:{key}:lock` =
    "<lease id> <token>" with a PX expiry; PostgreSQL and MySQL: the
    `fencer_locks` row's lease while `expires_at` is ahead on the server's
    clock."""
    b = c.sc["backend"]
    if b == "redis":
        v = resp(c.redis.port, "GET", "fencer:{" + key + "}:lock")
        return v.split(" ")[0] if isinstance(v, str) and v else None
    if b == "postgres":
        out = c.pg.psql(f"SELECT lease_id FROM fencer_locks WHERE key = '{key}' AND lease_id IS NOT NULL "
                        "AND expires_at > clock_timestamp()").strip()
        return out or None
    if b == "mysql":
        out = c.my.sql(f"SELECT lease_id FROM fencer_locks WHERE lock_key = '{key}' AND lease_id IS NOT NULL "
                       "AND expires_at > SYSDATE(6)").strip()
        return out or None
    return None  # other backends: not read (the fault runs, the probe does not)


def _probe_twice(c, keys, t_delivered):
    ttl = c.sc["ttl_ms"] / 1000
    first = t_delivered / 1e9 + FIRST_PROBE_S
    for label, at in (("first", first), ("second", first + ttl + SECOND_PROBE_SLACK_S)):
        time.sleep(max(0.0, at - time.monotonic()))
        for key in keys:
            try:
                lease = holder(c, key)
            except Exception as e:  # a backend down (another fault): no reading
                c.event(kind="late_request_probe", probe=label, key=key, delivered=t_delivered, error=str(e)[:200])
                continue
            c.event(kind="late_request_probe", probe=label, key=key, delivered=t_delivered, lease=lease)


def told_leases(events):
    """Every lease id some client was told: a client only learns lease ids
    from the sidecar's answers — an acquire or renew, a hold stream's grant
    line (`hold`, which may be read seconds after the grant) or any later
    line — so any id in a history was told. (Counting only acquire and
    renew answers once called a hold's renewed lease an untold orphan.)"""
    told = set()
    for e in events:
        resp = e.get("resp")
        lease = resp.get("lease_id") if isinstance(resp, dict) else None
        for x in (lease, e.get("lease")):
            if x:
                told.add(x)
    return told


def held_before(observed):
    """(key, lease) -> the earliest instant the observer's samples prove
    that lease held that key (the end, t1, of the first sample showing it)."""
    first = {}
    for o in observed or ():
        lease = o.get("lease")
        if lease:
            k = (o.get("key"), lease)
            first[k] = min(first.get(k, o["t1"]), o["t1"])
    return first


def statements_delivered(nemesis):
    """delivered instant -> the late statement's whole printable text (only
    where the proxy recorded all of it). A late statement can only leave
    behind the lease it names: its acquire writes that lease id; a release
    or renew takes nothing."""
    return {n["t"]: n.get("request", "") for n in nemesis
            if n.get("kind") == "late_request_delivered" and n.get("whole")}


def check(report, events, nemesis, observed=None):
    """O1 and the bites: `late_requests` (statements delivered late),
    `late_request_probes` (keys read twice after one) and
    `late_request_orphans` (of those, keys an untold lease held at the
    first read).

    A lease the observer saw holding the key *before* the statement landed
    was not taken by it: in CI (seed 49351) a sidecar acquired for a
    waiting hold, renewed the lease for 3 s while the gateway answered its
    token pre-registration `fence_busy`, then released it and answered the
    client 503 — never told, alive at both probes, and none of the late
    statement's doing. The same happened with the lease taken just *after*
    a late release landed (CI, seed 653660): so a lease the late statement
    does not name (its whole text recorded) is not its doing either."""
    told = told_leases(events)
    seen = held_before(observed)
    named = statements_delivered(nemesis)
    probes = {}
    for n in nemesis:
        if n.get("kind") == "late_request_probe" and "lease" in n:
            probes.setdefault((n["delivered"], n["key"]), {})[n["probe"]] = n
    both = orphans = 0
    for (delivered, key), p in sorted(probes.items()):
        if "first" not in p or "second" not in p:
            continue
        both += 1
        lease = p["first"]["lease"]
        if lease and seen.get((key, lease), delivered + 1) < delivered:
            continue
        text = named.get(delivered)
        if lease and text is not None and lease not in text:
            continue  # not the statement's lease: an acquisition after it
        if lease and lease not in told:
            orphans += 1  # within its TTL: allowed, counted
        if lease and lease == p["second"]["lease"] and lease not in told:
            report.violate("O1", f"{key}: lease {lease[:8]}… held the key in the backend from just after a "
                                 f"late statement landed until a TTL later, and no client was told of it",
                           [p["first"], p["second"]])
    report.bites["late_requests"] = sum(1 for n in nemesis if n.get("kind") == "late_request_delivered")
    report.bites["late_request_probes"] = both
    # Keys held, just after a late statement landed, by a lease no client
    # was told of (a late acquire that took the key for its TTL: allowed;
    # PostgreSQL's tombstones should keep this near 0 there).
    report.bites["late_request_orphans"] = orphans
