"""A lock kept alive in the background, that tells its holder when it is lost.

Two daemon threads per held lock, because a renewal can hang (a stalled
network, a paused sidecar) and the holder must still learn of the loss at
the lease's deadline, not whenever the hung call returns:

- the *renewer* renews at a third of the TTL; a final refusal (``lease_lost``,
  ``not_owner``, ``max_hold_reached``) loses the lease at once; any other
  failure is retried every tenth of the TTL (10-200 ms) until the deadline;
- the *watchdog* sleeps until the current deadline and, if no renewal moved
  it meanwhile, declares the lease lost.

The deadline is counted from when a renew was *sent*, on the monotonic
clock, so a late answer never stretches it past what the sidecar granted.
"""
import asyncio
import logging
import threading
import time
from typing import Callable, Optional

from .client import Client, Lease
from .errors import FencerError, LeaseLost, MaxHoldReached, NotOwner

log = logging.getLogger("fencer_client")

# Refusals after which renewing again cannot help.
_FINAL = (LeaseLost, NotOwner, MaxHoldReached)


class HeldLock:
    """A lock held through :meth:`Client.lock`: a context manager that
    acquires on entry, renews in the background and releases on exit.

    ``lease`` is the current lease (its ``token`` and ``fencing_token`` stay
    the same across renewals). ``lost`` is the :class:`LeaseLost` once the
    lease is lost, else ``None``. :meth:`check` raises it; so does every
    request sent through :meth:`session` or :meth:`urlopen`, and leaving the
    ``with`` block.
    """

    def __init__(self, client: Client, key: str, ttl_ms: int = 10000, wait_ms: Optional[int] = None,
                 owner: Optional[str] = None,
                 on_lost: Optional[Callable[[FencerError], None]] = None):
        if ttl_ms < 100:
            raise ValueError("ttl_ms must be at least 100")
        self.client = client
        self.key = key
        self.ttl_ms = ttl_ms
        self.wait_ms = wait_ms
        self.owner = owner
        self.on_lost = on_lost
        self.lease: Optional[Lease] = None
        self.lost: Optional[LeaseLost] = None
        self._changed = threading.Condition()
        self._stopped = False
        self._closing = False  # the holder stopped it: later failures are not losses
        self._released = False

    # --- life cycle ---

    def start(self) -> Lease:
        """Acquires the lock and starts keeping it alive (what entering the
        ``with`` does). Raises :class:`LockHeld` if it stayed held past ``wait_ms``."""
        if self.lease is not None:
            raise RuntimeError("this HeldLock was already started")
        self.lease = self.client.acquire(self.key, ttl_ms=self.ttl_ms, wait_ms=self.wait_ms, owner=self.owner)
        for name, target in (("renew", self._renewer), ("watchdog", self._watchdog)):
            thread = threading.Thread(target=target, name=f"fencer-{name}:{self.key}", daemon=True)
            thread.start()
        return self.lease

    def release(self) -> None:
        """Stops renewing and releases the lock (once: later calls do
        nothing). Raises :class:`LeaseLost` if the lease was lost before (the
        work done under it may have raced a newer holder)."""
        self._stop()
        self.check()
        if self.lease is None or self._released:
            return
        try:
            self.client.release(self.lease)
        except LeaseLost as e:
            self.lost = e
            raise
        self._released = True

    def _stop(self) -> None:
        # No join: a renewal still in flight may hang, and whatever it
        # answers is ignored once stopped (after a release, lease_lost).
        with self._changed:
            self._stopped = True
            self._closing = True
            self._changed.notify_all()

    def __enter__(self) -> "HeldLock":
        self.start()
        return self

    async def __aenter__(self) -> "HeldLock":
        """``async with client.lock(key) as held:`` acquires in a worker
        thread (a waiting acquire does not block the event loop); renewal
        runs in its threads as with ``with``."""
        await asyncio.get_running_loop().run_in_executor(None, self.start)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        """Releases in a worker thread; raises :class:`LeaseLost` as ``with`` does."""
        await asyncio.get_running_loop().run_in_executor(None, self.__exit__, exc_type, exc, tb)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            # The block failed on its own: release what we can, keep its error.
            self._stop()
            if self.lost is None and self.lease is not None:
                try:
                    self.client.release(self.lease)
                except FencerError as e:
                    log.warning("release of %s after an error failed: %s", self.key, e)
            return
        self.release()

    # --- what the holder calls ---

    def check(self) -> None:
        """Raises :class:`LeaseLost` if the lease is lost (or its deadline
        passed, even if the watchdog has not woken yet)."""
        if self.lost is None and self.lease is not None and time.monotonic() >= self.lease.deadline:
            self._lose(self._deadline_error())
        if self.lost is not None:
            raise self.lost

    @property
    def headers(self):
        """``{"Fencing-Lease": lease_id}`` after :meth:`check`."""
        self.check()
        return self.lease.headers

    def session(self, base_url: Optional[str] = None):
        """A ``requests`` session whose every request carries this lease
        (needs the ``requests`` extra); relative URLs go to the proxy."""
        from .session import FencedSession

        return FencedSession(self, base_url=base_url or self.client.proxy)

    def urlopen(self, url, data=None, method=None, headers=None, timeout=30.0):
        """``urllib`` request through the proxy under this lease; see
        :func:`fencer_client.http.fenced_urlopen`."""
        from .http import fenced_urlopen

        return fenced_urlopen(self, url, data=data, method=method, headers=headers,
                              timeout=timeout, base_url=self.client.proxy)

    # --- background ---

    def _deadline_error(self) -> LeaseLost:
        return LeaseLost(0, "lease_lost", f"lease on {self.key} not renewed before its deadline",
                         {"key": self.key}, reason="deadline")

    def _lose(self, error: LeaseLost) -> None:
        with self._changed:
            if self.lost is not None or self._closing:
                return
            self.lost = error
            self._stopped = True
            self._changed.notify_all()
        log.warning("lease on %s lost: %s", self.key, error)
        if self.on_lost is not None:
            try:
                self.on_lost(error)
            except Exception:  # the callback's own failure must not kill the thread silently
                log.exception("on_lost callback for %s raised", self.key)

    def _wait(self, seconds: float) -> bool:
        """Sleeps up to ``seconds``; False once stopped."""
        with self._changed:
            if not self._stopped:
                self._changed.wait(max(0.0, seconds))
            return not self._stopped

    def _renewer(self) -> None:
        every = self.ttl_ms / 3000.0
        retry = min(0.2, max(0.01, self.ttl_ms / 10000.0))
        pause = every
        while self._wait(pause):
            lease = self.lease
            try:
                renewed = self.client.renew(lease, ttl_ms=self.ttl_ms)
            except _FINAL as e:
                self._lose(e if isinstance(e, LeaseLost)
                           else LeaseLost(e.status, "lease_lost", str(e), e.body, reason=e.code))
                return
            except FencerError as e:
                log.warning("renewing %s failed, retrying: %s", self.key, e)
                pause = min(retry, max(0.0, lease.deadline - time.monotonic()))
                continue
            with self._changed:
                if self.lost is None:
                    self.lease = renewed
                    self._changed.notify_all()
            pause = every

    def _watchdog(self) -> None:
        while True:
            with self._changed:
                if self._stopped:
                    return
                left = self.lease.deadline - time.monotonic()
                if left > 0:
                    self._changed.wait(left)
                    continue
            self._lose(self._deadline_error())
            return
