"""Unit tests of the read-write lock checks (harness/checker.py) on tiny
synthetic histories: two read leases of one key told "held" at once are
not an M1 overlap (readers share) and count as readers sharing; a reader
and a writer, or two writers, are; a write applied with a read lease's
token is an R1 violation.

  python3 -m unittest discover -s tests/faults -p 'test_*.py'
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import checker  # noqa: E402

MS = 1_000_000


def grant(proc, lease, at_ms, read, token=1, ttl_ms=1000, key="acct:rw"):
    """An acquire answered 200 at `at_ms`; `read`: a read lease."""
    resp = {"lease_id": lease, "key": key, "token": token, "ttl_ms": ttl_ms}
    if read:
        resp["mode"] = "read"
    return {"t": at_ms * MS, "proc": proc, "kind": "ok", "f": "acquire", "key": key, "status": 200,
            "resp": resp}


def m1(events):
    return checker.m1_pairs(sorted(events, key=lambda e: e["t"]))


class RwLockTest(unittest.TestCase):
    def test_readers_share_and_count_as_sharing(self):
        events = [grant("w0", "R1", 0, True), grant("w1", "R2", 100, True)]
        self.assertEqual(m1(events), [])
        self.assertEqual(checker.readers_sharing(events), 1)

    def test_a_writer_beside_a_reader_or_a_writer_is_an_overlap(self):
        for first_read in (True, False):
            events = [grant("w0", "A", 0, first_read), grant("w1", "W", 100, False)]
            self.assertEqual(len(m1(events)), 1, first_read)
            self.assertEqual(checker.readers_sharing(events), 0)

    def test_a_write_applied_with_a_read_token_violates_r1(self):
        events = [grant("w0", "R1", 0, True, token=7), grant("w1", "W", 2000, False, token=8)]
        commit = {"key": "acct:rw", "token": 7, "seq": 1, "op_id": "w0-1", "commit_seq": 1,
                  "prev": 0, "new": 1}
        self.assertEqual(checker.read_lease_writes(events, [commit]), [commit])
        ok = dict(commit, token=8, op_id="w1-1")
        self.assertEqual(checker.read_lease_writes(events, [ok]), [])
        other_key = dict(commit, key="acct:other")
        self.assertEqual(checker.read_lease_writes(events, [other_key]), [])


if __name__ == "__main__":
    unittest.main()
