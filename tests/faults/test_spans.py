"""Unit tests of M1's span builder and the clients' checks (checker.py),
on tiny synthetic histories: every kind of "held" answer makes a span,
every end a client can give a lease ends it, and each check fails when
what it looks for is there and passes when it is not.

  python3 -m unittest discover -s tests/faults -p 'test_*.py'
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import checker  # noqa: E402
from harness.worker import lease_tag  # noqa: E402

MS = 1_000_000
CFG = {"ttl_ms": 500, "wait_ms": 2000}


class History:
    """Builds a worker history: times in ms, one client per `proc`."""

    def __init__(self):
        self.events = []

    def add(self, t, proc, kind, f, **kv):
        kv.update(t=t * MS, proc=proc, kind=kind, f=f)
        self.events.append(kv)
        return self

    def acquire(self, t, proc, lease, ttl_ms=500, key="k", token=1):
        self.add(t - 1, proc, "invoke", "acquire", key=key)
        return self.add(t, proc, "ok", "acquire", key=key, status=200,
                        resp={"lease_id": lease, "token": token, "fencing_token": "x", "ttl_ms": ttl_ms,
                              "remaining_ms": ttl_ms})

    def release(self, t, proc, lease, key="k"):
        return self.add(t, proc, "invoke", "release", key=key, lease=lease, tag=lease_tag(lease))

    def renew(self, t, proc, lease, left_ms, key="k"):
        self.add(t - 1, proc, "invoke", "renew", key=key, lease=lease, tag=lease_tag(lease))
        return self.add(t, proc, "ok", "renew", key=key, lease=lease, tag=lease_tag(lease), status=200,
                        resp={"lease_id": lease, "ttl_ms": 500, "remaining_ms": left_ms, "state": "held"})

    def hold(self, t, proc, lease, left_ms, key="k", token=1):
        self.add(t - 1, proc, "invoke", "hold", key=key)
        return self.add(t, proc, "ok", "hold", key=key, status=200,
                        resp={"type": "acquired", "lease_id": lease, "token": token, "fencing_token": "x",
                              "ttl_ms": 500, "remaining_ms": left_ms, "state": "held"})

    def heartbeat(self, t, proc, lease, left_ms, key="k"):
        return self.add(t, proc, "ok", "hold_line", key=key, lease=lease, tag=lease_tag(lease),
                        resp={"type": "heartbeat", "remaining_ms": left_ms, "token": 1})

    def close(self, t, proc, lease, key="k"):
        self.add(t, proc, "invoke", "hold_close", key=key, lease=lease, tag=lease_tag(lease))
        return self.add(t, proc, "ok", "hold_close", key=key, lease=lease, tag=lease_tag(lease))

    def probe(self, t, proc, lease, left_ms, held_ms=0, key="k"):
        self.add(t - 1, proc, "invoke", "get", key=key, probe=True)
        return self.add(t, proc, "ok", "get", key=key, probe=True, status=200,
                        resp={"lease_tag": lease_tag(lease), "state": "held", "remaining_ms": left_ms,
                              "held_ms": held_ms, "ttl_ms": 500, "token": 1})

    def walk_away(self, t0, t1, proc, step, key="k", **ctx):
        self.add(t0, proc, "invoke", step, key=key, disconnect=step, how="at_once", **ctx)
        return self.add(t1, proc, "info", step, key=key, error="disconnect", disconnect=step, how="at_once",
                        answered=None, **ctx)

    def check(self, nemesis=(), **cfg):
        return checker.check(self.events, [], [], [], list(nemesis), dict(CFG, **cfg))


def m1(report):
    return [v for v in report.violations if v["property"] == "M1"]


class Spans(unittest.TestCase):
    def spans(self, h):
        return sorted(checker.held_spans(sorted(h.events, key=lambda e: e["t"]))["k"], key=lambda s: s["start"])

    def test_acquire_span_ends_at_release_or_time_left(self):
        h = History().acquire(0, "a", "L1").release(100, "a", "L1").acquire(1000, "b", "L2")
        a, b = self.spans(h)
        self.assertEqual((a["start"], a["end"], a["by_ttl"]), (0, 100 * MS, False))
        self.assertEqual((b["start"], b["end"], b["by_ttl"]), (1000 * MS, 1500 * MS, True))

    def test_renewal_hold_and_heartbeat_answers_make_spans(self):
        h = (History().acquire(0, "a", "L1").renew(200, "a", "L1", 480).release(600, "a", "L1")
             .hold(700, "b", "L2", 490).heartbeat(850, "b", "L2", 470).close(1000, "b", "L2"))
        whats = [(s["what"], s["start"] // MS, s["end"] // MS) for s in self.spans(h)]
        self.assertEqual(whats, [("acquire", 0, 500), ("renew", 200, 600), ("hold", 700, 1000),
                                 ("hold_line", 850, 1000)])

    def test_a_probe_after_the_clients_release_is_not_ended_by_it(self):
        h = History().acquire(0, "a", "L1").release(100, "a", "L1").probe(200, "a", "L1", 250)
        probe = [s for s in self.spans(h) if s["what"] == "get"][0]
        self.assertEqual((probe["start"] // MS, probe["end"] // MS), (200, 450))

    def test_a_probe_before_the_release_is_ended_by_it(self):
        h = History().acquire(0, "a", "L1").probe(50, "a", "L1", 400).release(100, "a", "L1")
        probe = [s for s in self.spans(h) if s["what"] == "get"][0]
        self.assertEqual(probe["end"] // MS, 100)

    def test_an_untold_lease_is_marked(self):
        h = History().walk_away(0, 10, "a", "acquire").probe(50, "a", "ORPHAN", 400, held_ms=40)
        (s,) = self.spans(h)
        self.assertFalse(s["told"])


class Overlaps(unittest.TestCase):
    def test_a_renewal_answered_into_anothers_hold_fails_m1(self):
        # a is granted 300 ms, renews at 250 (480 ms left) and releases at
        # 900; b is granted the key at 400. Without the renewal's span a's
        # acquire span ends at 300: no overlap.
        h = (History().acquire(0, "a", "L1", ttl_ms=300, token=1).renew(250, "a", "L1", 480)
             .release(900, "a", "L1").acquire(400, "b", "L2", token=2).release(800, "b", "L2"))
        self.assertEqual(len(m1(h.check())), 1)
        without = [e for e in h.events if e["f"] != "renew"]
        self.assertEqual(m1(checker.check(without, [], [], [], [], CFG)), [])

    def test_a_heartbeat_into_anothers_hold_fails_m1(self):
        h = (History().hold(0, "a", "L1", 450).heartbeat(400, "a", "L1", 450).close(1000, "a", "L1")
             .acquire(600, "b", "L2", token=2).release(700, "b", "L2"))
        self.assertEqual(len(m1(h.check())), 1)

    def test_spans_of_a_closed_hold_end_at_the_close(self):
        h = (History().hold(0, "a", "L1", 450).heartbeat(150, "a", "L1", 480).close(200, "a", "L1")
             .acquire(250, "b", "L2", token=2).release(400, "b", "L2"))
        self.assertEqual(m1(h.check()), [])

    def test_a_probe_saying_held_after_release_fails_m1_when_the_key_moved(self):
        h = (History().acquire(0, "a", "L1").release(100, "a", "L1").probe(200, "a", "L1", 450)
             .acquire(300, "b", "L2", token=2).release(400, "b", "L2"))
        self.assertEqual(len(m1(h.check())), 1)

    def test_windows_and_transit_still_excuse(self):
        h = (History().acquire(0, "a", "L1").renew(300, "a", "L1", 480).release(900, "a", "L1")
             .acquire(700, "b", "L2", token=2).release(800, "b", "L2"))
        window = {"kind": "admits_overlap", "cause": "expire", "t0": 600 * MS, "t1": 1000 * MS,
                  "keys": ["k"], "workers": None}
        r = h.check([window])
        self.assertEqual(m1(r), [])
        self.assertEqual(r.stats["m1_excused"], {"expire": 1})
        # The renewal's span ends at its time left, 150 ms into b's.
        h2 = (History().acquire(0, "a", "L1").renew(300, "a", "L1", 480).release(900, "a", "L1")
              .acquire(630, "b", "L2", token=2).release(800, "b", "L2"))
        h2.events = [e for e in h2.events if not (e["proc"] == "a" and e["f"] == "release")]
        r2 = h2.check()
        self.assertEqual(m1(r2), [])
        self.assertEqual(r2.stats["m1_excused"], {"transit": 1})

    def test_an_untold_lease_overlapping_is_counted_not_failed(self):
        h = (History().walk_away(0, 10, "a", "acquire").probe(50, "a", "ORPHAN", 400, held_ms=40)
             .acquire(100, "b", "L2", token=2).release(200, "b", "L2"))
        r = h.check()
        self.assertEqual(m1(r), [])
        self.assertEqual(r.bites["m1_untold_overlaps"], 1)
        self.assertEqual(r.bites["probes_untold"], 1)


class KeptLeases(unittest.TestCase):
    def test_a_lease_renewed_for_a_client_that_never_received_it_fails(self):
        # The hold a client walked away from at 0–10 ms, still held at
        # 2 s with 400 ms left: renewed for nobody (mutant keep_orphans).
        h = History().walk_away(0, 10, "a", "hold").probe(2000, "a", "ORPHAN", 400, held_ms=1990)
        (v,) = m1(h.check())
        self.assertIn("renewed for nobody", v["message"])

    def test_an_orphan_within_its_ttl_passes(self):
        h = History().walk_away(0, 10, "a", "acquire").probe(300, "a", "ORPHAN", 200, held_ms=280)
        self.assertEqual(m1(h.check()), [])

    def test_an_untold_lease_no_request_explains_fails(self):
        h = History().probe(300, "a", "GHOST", 200, held_ms=100)
        (v,) = m1(h.check())
        self.assertIn("no request", v["message"])

    def test_a_lease_kept_after_its_client_closed_the_hold_fails(self):
        h = History().hold(0, "a", "L1", 490).close(100, "a", "L1").probe(2000, "a", "L1", 450, held_ms=2000)
        (v,) = m1(h.check())
        self.assertIn("kept past its client", v["message"])

    def test_a_lease_held_to_its_deadline_after_a_walked_away_release_passes(self):
        h = (History().acquire(0, "a", "L1").walk_away(100, 110, "a", "release", lease="L1", tag=lease_tag("L1"))
             .probe(250, "a", "L1", 250, held_ms=250))
        self.assertEqual(m1(h.check()), [])


class ClientChecks(unittest.TestCase):
    def test_a_write_under_a_lease_never_told_fails(self):
        h = History().walk_away(0, 10, "a", "acquire").add(20, "a", "invoke", "write", key="k", tag="ORPHANTAG",
                                                            op_id="a-1")
        (v,) = m1(h.check())
        self.assertIn("never told", v["message"])

    def test_disconnects_are_counted_by_step(self):
        h = (History().walk_away(0, 10, "a", "acquire").walk_away(20, 30, "a", "hold")
             .acquire(100, "a", "L1").walk_away(200, 210, "a", "renew", lease="L1", tag=lease_tag("L1"))
             .walk_away(300, 310, "a", "release", lease="L1", tag=lease_tag("L1")))
        b = h.check().bites
        self.assertEqual([b.get("disconnects_" + s) for s in ("acquire", "renew", "release", "hold")], [1, 1, 1, 1])
        self.assertEqual(b["disconnects_unanswered"], 4)
        self.assertNotIn("holds", b)  # nothing of it happened: not printed

    def test_a_hold_grant_is_an_issued_token(self):
        # S6: a write applied with a hold's token was issued.
        h = History().hold(0, "a", "L1", 490, token=7).close(100, "a", "L1")
        commit = {"key": "k", "token": 7, "seq": 1, "lease": lease_tag("L1"), "prev": 0, "new": 1,
                  "op_id": "a-1", "commit_seq": 1}
        h.add(50, "a", "invoke", "write", key="k", op_id="a-1", tag=lease_tag("L1"))
        h.add(60, "a", "ok", "write", key="k", op_id="a-1", tag=lease_tag("L1"), status=200)
        r = checker.check(h.events, [commit], [], [], [], CFG)
        self.assertEqual([v["property"] for v in r.violations], [])


if __name__ == "__main__":
    unittest.main()
