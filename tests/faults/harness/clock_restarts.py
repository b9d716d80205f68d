"""A sidecar restarted with its wall clock stepped (issue 28; issue 27
item 7): the nemesis `kill_sidecar_stepped` and the check A1.

`kill -9` of a sidecar, started again on the same ports and the same
`sidecar.state_dir` under libfaketime, its wall clock stepped 2–60 s back
or forward from where it was before (the offsets add up over a run: one
sidecar may run ahead, then be stepped back behind the real clock). The
nemesis prefers a sidecar that holds a lease for a proxy-mode worker (it
asks `GET /v1/locks`), so that the worker — run with
`adopt_after_restart` (worker.py) — finds its sidecar gone under its
lease, renews it until the restarted sidecar adopts it, and reads and
writes once more under it, through the restarted sidecar's proxy.

The write sequence numbers (`Fencing-Seq`) the restarted process stamps
on an adopted lease must be above every number the earlier process
stamped, whatever the clock did: the reservation in the state directory
carries the order across the restart (src/sidecar/sequence.rs). What is
checked:
- S1 (checker.py): per key, (token, seq) never goes back in the storage's
  commit log;
- A1: no read or write under an adopted lease is refused with
  `stale_sequence` / `duplicate_sequence` (the gateway saw a higher number
  of that lease before the restart: the adopted lease cannot write —
  availability lost to a clock step);
- M1 (checker.py) as in every run.
Bites: `clock_stepped_restarts`, `adopted` (renewals that adopted a
lease), `adopted_writes` (writes applied under an adopted lease).
"""
import json
import time
import urllib.request

from .procs import faketime_env

STEP_S = (2, 60)


def _holds(sidecar):
    """Whether the sidecar lists a held lease now."""
    try:
        with urllib.request.urlopen(sidecar.api + "/v1/locks", timeout=0.5) as r:
            body = json.load(r)
    except Exception:
        return False
    leases = body.get("leases", body) if isinstance(body, dict) else body
    return any((l or {}).get("state") == "held" for l in leases if isinstance(l, dict))


def kill_stepped(nem):
    """Nemesis `kill_sidecar_stepped` (see the module docstring)."""
    c = nem.c
    pick, size, back = nem.rng.random(), nem.rng.randint(*STEP_S), nem.rng.random() < 0.5
    proxied = [s for s, w in zip(c.sidecars, c.workers) if w.mode == "proxy"] or list(c.sidecars)
    holding = [s for s in proxied if _holds(s)]
    pool = holding or proxied
    s = pool[int(pick * len(pool))]
    step = -size if back else size
    old = getattr(s, "clock_offset_s", 0)
    new = old + step
    t = time.monotonic_ns()
    s.proc.kill()
    s.proc.env.update(faketime_env(f"{new:+d}"))
    c.event(kind="kill_sidecar_stepped", t=t, target=s.name, step_s=step, offset_s=new, held=bool(holding))
    s.start()
    s.clock_offset_s = new
    c.event(kind="restarted", target=s.name, restart_ms=round((time.monotonic_ns() - t) / 1e6), offset_s=new)


def check(report, events, nemesis):
    """A1 and the bites (see the module docstring)."""
    refused = [e for e in events if e.get("adopted") and e["f"] in ("read", "write") and e["kind"] == "fail"
               and e.get("error") in ("stale_sequence", "duplicate_sequence")]
    for e in refused[:3]:
        report.violate("A1", f"{e['key']}: a {e['f']} of {e['proc']} under its adopted lease {e.get('tag', '')[:8]} "
                             f"(token {e.get('token')}) was refused {e.get('error')} after its sidecar restarted "
                             f"with its clock stepped", [e])
    if len(refused) > 3:
        report.violate("A1", f"{len(refused) - 3} more requests under adopted leases refused")
    report.bites["clock_stepped_restarts"] = sum(1 for n in nemesis if n.get("kind") == "kill_sidecar_stepped")
    report.bites["adopted"] = sum(1 for e in events if e["f"] == "renew" and e["kind"] == "ok" and e.get("adopting"))
    report.bites["adopted_writes"] = sum(1 for e in events if e["f"] == "write" and e["kind"] == "ok"
                                         and e.get("adopted"))
