"""Unit tests of N1 (harness/checker.py `semaphore_overcounts`) on tiny
synthetic histories: more leases of one semaphore told "held" at once than
its permits is a violation, whichever slot keys they name (a slot beyond
the count included); as many as the permits, an overlap within the
answer's transit, or one inside a window that admits overlaps, is not.

  python3 -m unittest discover -s tests/faults -p 'test_*.py'
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import checker  # noqa: E402

MS = 1_000_000
SLACK = 200 * MS


def grant(proc, lease, slot, at_ms, ttl_ms=1000, name="pool"):
    """A permit acquire answered 200 at `at_ms`, held on `name#slot`."""
    return {"t": at_ms * MS, "proc": proc, "kind": "ok", "f": "acquire", "key": name, "status": 200,
            "resp": {"lease_id": lease, "key": f"{name}#{slot}", "token": 1, "ttl_ms": ttl_ms}}


def n1(events, permits, windows=()):
    return checker.semaphore_overcounts(sorted(events, key=lambda e: e["t"]), permits, SLACK, list(windows))[0]


class N1Test(unittest.TestCase):
    def test_as_many_holders_as_permits_is_fine_and_counts_as_full(self):
        events = [grant("w0", "L1", 0, 0), grant("w1", "L2", 1, 100)]
        self.assertEqual(n1(events, 2), [])
        self.assertEqual(checker.semaphore_overcounts(events, 2, SLACK, [])[1], 1)

    def test_one_more_holder_than_permits_is_a_violation_on_any_slot(self):
        # The third on slot 2 of a 2-permit semaphore (the extra-slot
        # mutant), and the same count on 1 permit with two slots.
        events = [grant("w0", "L1", 0, 0), grant("w1", "L2", 1, 100), grant("w2", "L3", 2, 200)]
        over = n1(events, 2)
        self.assertEqual(len(over), 1)
        self.assertEqual({x["tag"] for x in over[0][2]}, {checker.lease_tag(x) for x in ("L1", "L2", "L3")})
        self.assertEqual(len(n1(events[:2], 1)), 1)

    def test_one_lease_answered_twice_counts_once(self):
        renewal = {"t": 300 * MS, "proc": "w0", "kind": "ok", "f": "renew", "key": "pool#0",
                   "tag": checker.lease_tag("L1"), "resp": {"remaining_ms": 1000}}
        events = [grant("w0", "L1", 0, 0), renewal, grant("w1", "L2", 1, 100)]
        self.assertEqual(n1(events, 2), [])

    def test_a_short_hold_counts_until_its_release(self):
        release = {"t": 50 * MS, "proc": "w0", "kind": "invoke", "f": "release", "key": "pool#0",
                   "tag": checker.lease_tag("L1")}
        events = [grant("w0", "L1", 0, 0), grant("w1", "L2", 1, 20), release]
        self.assertEqual(len(n1(events, 1)), 1)

    def test_an_overlap_within_the_transit_is_not(self):
        # L2 granted 100 ms before L1's reported time left ends.
        events = [grant("w0", "L1", 0, 0), grant("w1", "L2", 0, 900)]
        self.assertEqual(n1(events, 1), [])

    def test_a_released_permit_is_not_counted_after_its_release(self):
        release = {"t": 400 * MS, "proc": "w0", "kind": "invoke", "f": "release", "key": "pool#0",
                   "tag": checker.lease_tag("L1")}
        events = [grant("w0", "L1", 0, 0), release, grant("w1", "L2", 1, 500)]
        self.assertEqual(n1(events, 1), [])

    def test_a_window_that_admits_an_overlap_excuses_it(self):
        events = [grant("w0", "L1", 0, 0), grant("w1", "L2", 1, 100)]
        window = {"kind": "admits_overlap", "t0": 50 * MS, "t1": 150 * MS, "cause": "pause"}
        self.assertEqual(n1(events, 1, [window]), [])


if __name__ == "__main__":
    unittest.main()
