"""fencer_client against a real `fencer dev` (tests/clients.rs starts it and
sets FENCER_API, FENCER_PROXY, FENCER_GATEWAY and FENCER_ERROR_CODES).

Run alone: start `fencer dev`, then
  FENCER_GATEWAY=http://127.0.0.1:8080 PYTHONPATH=clients/python/src \\
    python3 -m unittest discover -s clients/python/tests
"""
import asyncio
import json
import os
import threading
import time
import unittest
import urllib.error
import uuid

import fencer_client
from fencer_client import (Client, FencerError, LeaseLost, LockHeld, LockNotHeld, InvalidRequest,
                           NotFound, StaleFencingToken, fenced_urlopen)

GATEWAY = os.environ.get("FENCER_GATEWAY", "http://127.0.0.1:8080")


def fresh(name):
    """A key no other test uses (tests share one fencer dev)."""
    return f"py:{name}:{uuid.uuid4().hex[:8]}"


class BlockedRenew(Client):
    """A client whose renewals hang (a stalled network) until released."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.unblock = threading.Event()

    def renew(self, lease, ttl_ms=None):
        self.unblock.wait(10)
        return super().renew(lease, ttl_ms)


class AcquireTest(unittest.TestCase):
    def setUp(self):
        self.client = Client()

    def test_acquire_refused_then_waits_for_release(self):
        key = fresh("acquire")
        first = self.client.acquire(key, ttl_ms=5000)
        self.assertGreater(first.token, 0)
        self.assertTrue(first.fencing_token and first.lease_id)
        started = time.monotonic()
        with self.assertRaises(LockHeld) as refused:
            self.client.acquire(key, wait_ms=200)
        self.assertGreaterEqual(time.monotonic() - started, 0.19)
        self.assertEqual((refused.exception.status, refused.exception.body["key"]), (409, key))

        # A waiter gets the lock as soon as the holder releases it.
        threading.Timer(0.3, self.client.release, [first]).start()
        second = self.client.acquire(key, ttl_ms=5000, wait_ms=5000)
        self.assertGreater(second.token, first.token)
        renewed = self.client.renew(second, ttl_ms=5000)
        self.assertEqual((renewed.token, renewed.lease_id), (second.token, second.lease_id))
        self.client.release(second)
        with self.assertRaises(LeaseLost):
            self.client.release(second)

    def test_hold_stream_releases_on_close(self):
        key = fresh("hold")
        with self.client.hold(key, ttl_ms=2000) as stream:
            events = iter(stream)
            acquired = next(events)
            self.assertEqual(acquired["type"], "acquired")
            self.assertEqual(next(events)["type"], "heartbeat")
        after = self.client.acquire(key, wait_ms=2000)
        self.assertGreater(after.token, acquired["token"])
        self.client.release(after)


class HeldLockTest(unittest.TestCase):
    def setUp(self):
        self.client = Client()

    def test_with_releases_on_exit_and_on_error(self):
        key = fresh("with")
        with self.client.lock(key, ttl_ms=5000) as held:
            self.assertEqual(self.client.status(key)["state"], "held")
            with self.assertRaises(LockHeld):
                self.client.acquire(key, wait_ms=0)
        lease = self.client.acquire(key, wait_ms=0)  # free at once: released on exit
        self.client.release(lease)
        self.assertGreater(lease.token, held.lease.token)

        with self.assertRaises(ZeroDivisionError):
            with self.client.lock(key, ttl_ms=5000):
                1 / 0
        self.client.release(self.client.acquire(key, wait_ms=0))

    def test_async_with_releases_on_exit(self):
        key = fresh("async")

        async def hold_it():
            async with self.client.lock(key, ttl_ms=300) as held:
                await asyncio.sleep(0.5)  # past the TTL: renewed meanwhile
                held.check()
                self.assertEqual(self.client.status(key)["state"], "held")
            held.release()  # a second release does nothing
            return held.lease.token

        token = asyncio.run(hold_it())
        lease = self.client.acquire(key, wait_ms=0)
        self.assertGreater(lease.token, token)
        self.client.release(lease)

    def test_keepalive_holds_past_the_ttl(self):
        key = fresh("keepalive")
        # Three TTLs. A TTL of 1 s leaves a renewal (sent every 333 ms)
        # 667 ms to come back: 300 ms lost leases on a loaded CI machine.
        with self.client.lock(key, ttl_ms=1000) as held:
            token = held.lease.token
            time.sleep(3.0)
            held.check()
            self.assertEqual(self.client.status(key)["state"], "held")
            with self.assertRaises(LockHeld):
                self.client.acquire(key, wait_ms=0)
            self.assertEqual(held.lease.token, token)
            self.assertGreater(held.lease.remaining_ms, 0)

    def test_loss_by_another_party_is_known_at_once(self):
        key = fresh("stolen")
        lost = []
        noticed = threading.Event()
        held = self.client.lock(key, ttl_ms=600, on_lost=lambda e: (lost.append(e), noticed.set()))
        with self.assertRaises(LeaseLost) as at_exit:
            with held:
                # Someone else with the lease id (an operator, a stale copy of
                # this worker) releases it: the next renewal is refused.
                Client().release(held.lease)
                self.assertTrue(noticed.wait(2.0), "on_lost was not called")
                self.assertIsInstance(lost[0], LeaseLost)
                with self.assertRaises(LeaseLost):
                    held.check()
                with self.assertRaises(LeaseLost):
                    held.urlopen("/kv/clients/never", data={"v": 1}, method="PUT")
        self.assertIs(at_exit.exception, lost[0])
        self.assertEqual(at_exit.exception.reason, "lease_lost")

    def test_loss_while_renewal_hangs_is_known_at_the_deadline(self):
        key = fresh("hung")
        client = BlockedRenew()
        noticed = threading.Event()
        try:
            with self.assertRaises(LeaseLost) as at_exit:
                with client.lock(key, ttl_ms=300, on_lost=lambda e: noticed.set()) as held:
                    started = time.monotonic()
                    # The renewal hangs until the test ends: noticed at all
                    # means the watchdog did not wait for it; within a few
                    # TTLs (not a tight bound: CI machines are loaded).
                    self.assertTrue(noticed.wait(3.0), "on_lost was not called")
                    self.assertLess(time.monotonic() - started, 1.5)
                    self.assertEqual(held.lost.reason, "deadline")
            self.assertEqual(at_exit.exception.reason, "deadline")
        finally:
            client.unblock.set()


class LockTypesTest(unittest.TestCase):
    def test_reentrant_holds_and_the_backend_view(self):
        client = Client()
        key = fresh("reentrant")
        first = client.acquire(key, ttl_ms=5000, owner="job", reentrant=True)
        again = client.acquire(key, ttl_ms=5000, owner="job", reentrant=True)
        self.assertEqual((again.lease_id, again.token), (first.lease_id, first.token))
        view = client.backend_status(key)
        self.assertEqual((view["state"], view["token"], view["held_here"]), ("held", first.token, True))
        self.assertEqual(client.release(first), 1)
        self.assertIsNone(client.release(first))
        self.assertEqual(client.backend_status(key)["state"], "free")

    def test_semaphore_permits_are_leases_on_slot_keys(self):
        client = Client()
        name = fresh("pool")
        one = client.acquire_permit(name, 2, ttl_ms=5000)
        two = client.acquire_permit(name, 2, ttl_ms=5000)
        self.assertEqual({one.raw["slot"], two.raw["slot"]}, {0, 1})
        self.assertEqual(one.key, f"{name}#{one.raw['slot']}")
        with self.assertRaises(LockHeld):
            client.acquire_permit(name, 2, ttl_ms=5000, wait_ms=0)
        with self.assertRaises(fencer_client.PermitsMismatch) as mismatch:
            client.acquire_permit(name, 3, ttl_ms=5000, wait_ms=0)
        self.assertEqual(mismatch.exception.body["permits"], 2)
        client.renew(one)
        self.assertIsNone(client.release(one))
        three = client.acquire_permit(name, 2, ttl_ms=5000, wait_ms=0)
        self.assertEqual(three.raw["slot"], one.raw["slot"])
        self.assertGreater(three.token, one.token)
        client.release(two)
        client.release(three)


    def test_read_leases_share_the_key_and_never_write(self):
        client = Client()
        key = fresh("rw")
        one = client.acquire(key, ttl_ms=5000, mode="read")
        two = client.acquire(key, ttl_ms=5000, mode="read")
        self.assertEqual((one.raw["mode"], two.key), ("read", key))
        self.assertGreater(two.token, one.token)
        with self.assertRaises(LockHeld):
            client.acquire(key, ttl_ms=5000, wait_ms=0)
        path = f"/kv/clients/{key.replace(':', '-')}"
        with self.assertRaises(fencer_client.ReadLease):
            fenced_urlopen(one, path, data={"by": "reader"}, method="PUT", base_url=client.proxy)
        client.renew(one)
        self.assertIsNone(client.release(one))
        self.assertIsNone(client.release(two))
        writer = client.acquire(key, ttl_ms=5000, wait_ms=0)
        self.assertGreater(writer.token, two.token)
        client.release(writer)

    def test_multi_key_lease_takes_every_key_or_none(self):
        client = Client()
        a, b = fresh("multi"), fresh("multi")
        held = client.acquire_many([b, a], ttl_ms=5000)
        self.assertEqual([k["key"] for k in held["keys"]], sorted([a, b]))
        with self.assertRaises(LockHeld):
            client.acquire(a, ttl_ms=5000, wait_ms=0)
        self.assertGreater(client.renew_many(held["lease_id"], ttl_ms=8000)["remaining_ms"], 5000)
        self.assertEqual(client.release_many(held["lease_id"]), sorted([a, b]))
        other = client.acquire(a, ttl_ms=5000, wait_ms=0)
        with self.assertRaises(LockHeld):
            client.acquire_many([a, b], ttl_ms=5000, wait_ms=0)
        client.release(client.acquire(b, ttl_ms=5000, wait_ms=0))
        client.release(other)


class FencedHttpTest(unittest.TestCase):
    def setUp(self):
        self.client = Client()

    def test_proxy_write_accepted_and_stale_write_refused(self):
        key = fresh("stale")
        path = f"/kv/clients/{key.replace(':', '-')}"
        with self.client.lock(key, ttl_ms=5000) as old:
            with old.urlopen(path, data={"by": "old"}, method="PUT") as r:
                self.assertEqual(r.status, 200)
            old_lease = old.lease
        with self.client.lock(key, ttl_ms=5000) as new:
            session = new.session()
            self.assertEqual(session.put(path, json={"by": "new"}).status_code, 200)
            self.assertEqual(session.get(path).json()["value"], {"by": "new"})
            # The old lease through the proxy: refused there, never forwarded.
            with self.assertRaises(LeaseLost):
                fenced_urlopen(old_lease, path, data={"by": "old"}, method="PUT", base_url=self.client.proxy)
            # The old signed token straight at the gateway: a newer one was seen.
            stale = fencer_client.FencedSession(old_lease, base_url=GATEWAY, direct=True)
            with self.assertRaises(StaleFencingToken) as refused:
                stale.put(path, json={"by": "old"})
            self.assertEqual(refused.exception.status, 409)
            self.assertGreaterEqual(refused.exception.body["highest_seen"], new.lease.token)
            with self.assertRaises(StaleFencingToken):
                fenced_urlopen(old_lease, GATEWAY + path, data={"by": "old"}, method="PUT", direct=True)
            self.assertEqual(session.get(path).json()["value"], {"by": "new"})

    def test_storage_errors_are_not_fencer_errors(self):
        key = fresh("missing")
        with self.client.lock(key, ttl_ms=5000) as held:
            response = held.session().get(f"/kv/clients/{key.replace(':', '-')}")
            self.assertEqual(response.status_code, 404)  # the storage's own answer
            # Nor is its own `invalid_request` (a body that is not JSON),
            # although the proxy and the gateway use that code too: only
            # fencer's refusals carry the Fencing-Error header.
            own = held.session().put(f"/kv/clients/{key.replace(':', '-')}", data=b"not json",
                                     headers={"Content-Type": "application/json"})
            self.assertEqual((own.status_code, own.json()["error"]), (400, "invalid_request"))
            self.assertNotIn("Fencing-Error", own.headers)
            with self.assertRaises(urllib.error.HTTPError) as raised:
                held.urlopen(f"/kv/clients/{key.replace(':', '-')}", data=b"not json", method="PUT")
            self.assertEqual(raised.exception.code, 400)


class ErrorCodeTest(unittest.TestCase):
    def test_every_code_has_its_class(self):
        codes = json.loads(os.environ.get("FENCER_ERROR_CODES") or "[]")
        if not codes:
            self.skipTest("FENCER_ERROR_CODES not set (tests/clients.rs sets it)")
        missing = [c for c in codes if c not in fencer_client.ERROR_CLASSES]
        self.assertEqual(missing, [], "error codes fencer answers that fencer_client lacks")
        for code in codes:
            err = fencer_client.error_from_body(409, {"error": code, "message": "m"})
            self.assertIs(type(err), fencer_client.ERROR_CLASSES[code])
            self.assertIsNot(type(err), FencerError)
            self.assertEqual((err.code, err.status, err.message), (code, 409, "m"))
            self.assertTrue(type(err).__doc__)
            self.assertIs(getattr(fencer_client, type(err).__name__), type(err))

    def test_every_code_of_the_proxy_and_gateway_is_a_fenced_code(self):
        codes = json.loads(os.environ.get("FENCER_FENCED_CODES") or "[]")
        if not codes:
            self.skipTest("FENCER_FENCED_CODES not set (tests/clients.rs sets it)")
        self.assertEqual(sorted(set(codes) - fencer_client.FENCED_CODES), [])
        self.assertEqual(sorted(fencer_client.FENCED_CODES - set(fencer_client.ERROR_CLASSES)), [])

    def test_unknown_code_is_a_plain_fencer_error(self):
        err = fencer_client.error_from_body(418, {"error": "from_the_future", "message": "m"})
        self.assertIs(type(err), FencerError)
        self.assertEqual(err.code, "from_the_future")

    def test_live_answers_map_to_their_classes(self):
        client = Client()
        with self.assertRaises(InvalidRequest) as bad:
            client.acquire(fresh("bad"), ttl_ms=1)
        self.assertEqual(bad.exception.body["field"], "ttl_ms")
        with self.assertRaises(NotFound):
            client.status(fresh("nobody"))
        never = fencer_client.Lease(key=fresh("never"), token=1, fencing_token="", lease_id=uuid.uuid4().hex,
                                    ttl_ms=1000, deadline=time.monotonic() + 1)
        with self.assertRaises(LockNotHeld):
            fenced_urlopen(never, "/kv/clients/never", data={"v": 1}, method="PUT", base_url=client.proxy)
        with self.assertRaises(fencer_client.TransportError):
            Client(api="http://127.0.0.1:9").acquire(fresh("nowhere"))


if __name__ == "__main__":
    unittest.main()
