"""The lock API client: acquire, renew, release, keepalive, status, hold.

Plain ``urllib`` (no dependencies) and one connection per call: fencer closes
an idle keep-alive connection after 10 s, and a pooled connection closed at
the moment a request goes out would fail that request.
"""
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional

from .errors import FencerError, TransportError, error_from_body

if TYPE_CHECKING:  # held.py imports this module
    from .held import HeldLock

#: The lock API when neither an address nor ``$FENCER_API`` is given.
DEFAULT_API = "http://127.0.0.1:7411"
#: The egress proxy when neither an address nor ``$FENCER_PROXY`` is given.
DEFAULT_PROXY = "http://127.0.0.1:7412"

# Seconds added to a call's own wait (wait_ms) before the client gives up on
# the answer: the sidecar answers within wait_ms plus a backend round trip.
_ANSWER_MARGIN_S = 10.0


@dataclass(frozen=True)
class Lease:
    """A lock held by this application: what an acquire or renew answered.

    ``deadline`` is on :func:`time.monotonic`'s clock, counted from when the
    request was *sent* (a late answer never stretches it): past it, assume
    the lock is gone even if nobody said so."""

    key: str
    token: int
    fencing_token: str
    lease_id: str
    ttl_ms: int
    deadline: float = field(compare=False)
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def remaining_ms(self) -> int:
        """Milliseconds left until :attr:`deadline` (0 once passed)."""
        return max(0, int((self.deadline - time.monotonic()) * 1000))

    @property
    def headers(self) -> Dict[str, str]:
        """The header that binds a proxied request to this lease."""
        return {"Fencing-Lease": self.lease_id}


def _lease(answer: Dict[str, Any], sent_at: float, key: str, lease_id: str = "") -> Lease:
    ttl_ms = int(answer.get("ttl_ms", answer.get("remaining_ms", 0)))
    return Lease(
        key=answer.get("key", key),
        token=int(answer["token"]),
        fencing_token=answer.get("fencing_token", ""),
        lease_id=answer.get("lease_id", lease_id),
        ttl_ms=ttl_ms,
        deadline=sent_at + ttl_ms / 1000.0,
        raw=answer,
    )


def _acquire_body(ttl_ms: Optional[int], wait_ms: Optional[int], owner: Optional[str],
                  auto_renew: bool, keepalive_ms: Optional[int], **fixed: Any) -> Dict[str, Any]:
    """An acquire's body: `fixed`, then the options that were given."""
    body: Dict[str, Any] = dict(fixed)
    for name, value in (("ttl_ms", ttl_ms), ("wait_ms", wait_ms), ("owner", owner),
                        ("keepalive_ms", keepalive_ms)):
        if value is not None:
            body[name] = value
    if auto_renew:
        body["auto_renew"] = True
    return body


class Client:
    """A client of one sidecar's lock API (``api``, default ``$FENCER_API``
    or ``http://127.0.0.1:7411``) and egress proxy (``proxy``, default
    ``$FENCER_PROXY`` or ``http://127.0.0.1:7412``).

    Thread-safe: it holds no connection and no state besides its addresses.
    """

    def __init__(self, api: Optional[str] = None, proxy: Optional[str] = None, timeout: float = 30.0):
        self.api = (api or os.environ.get("FENCER_API") or DEFAULT_API).rstrip("/")
        self.proxy = (proxy or os.environ.get("FENCER_PROXY") or DEFAULT_PROXY).rstrip("/")
        self.timeout = timeout

    # --- the calls of the lock API ---

    def acquire(self, key: str, ttl_ms: Optional[int] = None, wait_ms: Optional[int] = None,
                owner: Optional[str] = None, auto_renew: bool = False,
                keepalive_ms: Optional[int] = None, reentrant: bool = False,
                mode: str = "write") -> Lease:
        """Takes the lock on ``key`` for ``ttl_ms``, waiting up to ``wait_ms``
        in the key's FIFO queue. Raises :class:`LockHeld` if it is still held
        then. With ``auto_renew`` the *sidecar* renews while this process
        calls :meth:`keepalive` (or sends proxied requests) within
        ``keepalive_ms``; see :meth:`lock` for renewal done by this client.
        With ``reentrant`` (and an ``owner``) the owner holding the key here
        takes it again: the same lease, one more hold (:meth:`release`
        gives one back). ``mode="read"`` takes a read lease of a read-write
        lock: shared with other readers, excluded by a writer (a waiting
        writer keeps new readers out); its token reads and never writes
        (:class:`ReadLease`)."""
        body = _acquire_body(ttl_ms, wait_ms, owner, auto_renew, keepalive_ms)
        if reentrant:
            body["reentrant"] = True
        if mode != "write":
            body["mode"] = mode
        sent_at = time.monotonic()
        answer = self._call("POST", self._path(key, "acquire"), body, wait_ms)
        return _lease(answer, sent_at, key)

    def acquire_permit(self, name: str, permits: int, ttl_ms: Optional[int] = None,
                       wait_ms: Optional[int] = None, owner: Optional[str] = None,
                       auto_renew: bool = False, keepalive_ms: Optional[int] = None) -> Lease:
        """Takes one of the ``permits`` permits of semaphore ``name``, waiting
        up to ``wait_ms`` for one to be freed; raises :class:`LockHeld` if all
        stay held, :class:`PermitsMismatch` if the name's count is another.
        The permit is a lease on the lock key ``name#slot`` (``lease.key``;
        ``lease.raw["slot"]``): :meth:`renew`, :meth:`release` and
        :meth:`keepalive` take it as any lease, and its token fences that
        slot."""
        body = _acquire_body(ttl_ms, wait_ms, owner, auto_renew, keepalive_ms, permits=permits)
        path = "/v1/semaphores/" + urllib.parse.quote(name, safe="") + "/acquire"
        sent_at = time.monotonic()
        answer = self._call("POST", path, body, wait_ms)
        return _lease(answer, sent_at, answer.get("key", name))

    def acquire_many(self, keys: List[str], ttl_ms: Optional[int] = None,
                     wait_ms: Optional[int] = None, owner: Optional[str] = None,
                     auto_renew: bool = False, keepalive_ms: Optional[int] = None) -> Dict[str, Any]:
        """Takes every key of ``keys`` or none, under one lease id (keys taken
        in byte order: two such calls never deadlock); raises
        :class:`LockHeld` if one is still held after ``wait_ms`` (every key
        taken is given back). Returns the answer: ``lease_id``, ``keys``
        (each ``key``, ``token``, ``fencing_token``, ``remaining_ms``) and
        ``remaining_ms``, the least of them. Send ``lease_id`` with
        ``Fencing-Lease`` and the key with ``Fencing-Lock``."""
        body = _acquire_body(ttl_ms, wait_ms, owner, auto_renew, keepalive_ms, keys=list(keys))
        return self._call("POST", "/v1/locks/acquire", body, wait_ms)

    def renew_many(self, lease_id: str, ttl_ms: Optional[int] = None) -> Dict[str, Any]:
        """Renews every key of a multi-key lease; raises :class:`LeaseLost`
        naming the first key found gone."""
        body: Dict[str, Any] = {"lease_id": lease_id}
        if ttl_ms is not None:
            body["ttl_ms"] = ttl_ms
        return self._call("POST", "/v1/locks/renew", body)

    def release_many(self, lease_id: str) -> List[str]:
        """Releases every key of a multi-key lease; returns the keys."""
        return self._call("POST", "/v1/locks/release", {"lease_id": lease_id})["keys"]

    def renew(self, lease: Lease, ttl_ms: Optional[int] = None) -> Lease:
        """Extends ``lease`` by ``ttl_ms`` (default: its own TTL) and returns
        the renewed lease. Raises :class:`LeaseLost` if it no longer holds."""
        body: Dict[str, Any] = {"lease_id": lease.lease_id}
        if ttl_ms is not None:
            body["ttl_ms"] = ttl_ms
        sent_at = time.monotonic()
        answer = self._call("POST", self._path(lease.key, "renew"), body)
        return _lease(answer, sent_at, lease.key, lease.lease_id)

    def release(self, lease: Lease) -> Optional[int]:
        """Gives the lock up — or, for a reentrant lease, one hold: returns
        the holds left (``None`` once the key is free). Raises
        :class:`LeaseLost` if it was already gone (then the work done under
        it may have raced a newer holder)."""
        answer = self._call("POST", self._path(lease.key, "release"), {"lease_id": lease.lease_id})
        return None if answer.get("released", True) else answer.get("holds")

    def backend_status(self, key: str) -> Dict[str, Any]:
        """What the backend records for ``key``, whichever sidecar's lease
        holds it (``state``: held, read, free, delayed or split; ``token``,
        ``lease_tag``, ``remaining_ms``...). Rate-limited by the sidecar:
        raises :class:`RateLimited` past it."""
        return self._call("GET", self._path(key, None) + "?scope=backend")

    def keepalive(self, lease: Lease) -> None:
        """Tells the sidecar this process is alive, for a lease acquired with
        ``auto_renew``. Raises :class:`LeaseLost` once it is gone."""
        self._call("POST", self._path(lease.key, "keepalive"), {"lease_id": lease.lease_id})

    def status(self, key: str) -> Dict[str, Any]:
        """This sidecar's lease on ``key`` (``state``: ``held`` or ``lost``);
        raises :class:`NotFound` if it has none."""
        return self._call("GET", self._path(key, None))

    def leases(self, limit: int = 1000) -> Dict[str, Any]:
        """This sidecar's leases: ``{"leases": [...], "count", "total", "truncated"}``."""
        return self._call("GET", f"/v1/locks?limit={int(limit)}")

    def hold(self, key: str, ttl_ms: Optional[int] = None, wait_ms: Optional[int] = None,
             owner: Optional[str] = None) -> "HoldStream":
        """Holds the lock for as long as the returned stream is open (use it
        in a ``with``): its events are dicts with ``type`` ``acquired``,
        ``heartbeat``, then ``lost`` or ``released``. Closing it, or this
        process dying, releases the lock at once."""
        body = {k: v for k, v in (("ttl_ms", ttl_ms), ("wait_ms", wait_ms), ("owner", owner))
                if v is not None}
        response = self._open("POST", self._path(key, "hold"), body, wait_ms)
        return HoldStream(response)

    def lock(self, key: str, ttl_ms: int = 10000, wait_ms: Optional[int] = None,
             owner: Optional[str] = None,
             on_lost: Optional[Callable[[FencerError], None]] = None) -> "HeldLock":
        """A lock kept alive by this client while it is held: use it as
        ``with client.lock("job:1") as held: ...`` (or ``async with``). It renews at a third of
        ``ttl_ms`` in a background thread; when the lease is lost it calls
        ``on_lost(error)``, and ``held.check()``, every request sent through
        ``held.session()`` and leaving the ``with`` raise :class:`LeaseLost`.
        Leaving the ``with`` normally releases the lock."""
        from .held import HeldLock

        return HeldLock(self, key, ttl_ms=ttl_ms, wait_ms=wait_ms, owner=owner, on_lost=on_lost)

    # --- plumbing ---

    @staticmethod
    def _path(key: str, action: Optional[str]) -> str:
        path = "/v1/locks/" + urllib.parse.quote(key, safe="")
        return path + "/" + action if action else path

    def _open(self, method: str, path: str, body: Optional[Dict[str, Any]] = None,
              wait_ms: Optional[int] = None):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.api + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        timeout = self.timeout + (wait_ms or 0) / 1000.0
        try:
            return _NO_PROXY_OPENER.open(request, timeout=timeout)
        except urllib.error.HTTPError as e:
            raise error_from_response(e.code, e.read()) from None
        except (OSError, ValueError) as e:
            raise TransportError(0, "transport_error", f"{method} {self.api}{path}: {e}") from None

    def _call(self, method: str, path: str, body: Optional[Dict[str, Any]] = None,
              wait_ms: Optional[int] = None) -> Dict[str, Any]:
        with self._open(method, path, body, wait_ms) as response:
            raw = response.read()
        try:
            return json.loads(raw)
        except ValueError:
            raise TransportError(response.status, "unexpected_answer", raw[:300].decode("utf-8", "replace")) from None


def error_from_response(status: int, raw: bytes) -> FencerError:
    """The typed error for an error answer's ``status`` and raw body."""
    try:
        body = json.loads(raw)
    except ValueError:
        return TransportError(status, "unexpected_answer", raw[:300].decode("utf-8", "replace"))
    return error_from_body(status, body)


# The sidecar is on localhost: never send lock calls through an HTTP proxy
# named by $http_proxy.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class HoldStream:
    """The events of a hold stream (see :meth:`Client.hold`); iterate it
    inside a ``with``: leaving the ``with`` closes the connection, which
    releases the lock."""

    def __init__(self, response):
        self._response = response

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        # Heartbeats arrive every second: a read that waits the client's whole
        # timeout means the sidecar is gone (the lock is then as good as lost).
        try:
            for line in self._response:
                line = line.strip()
                if line:
                    yield json.loads(line)
        except (OSError, ValueError) as e:
            raise TransportError(0, "transport_error", f"hold stream broke: {e}") from None

    def close(self) -> None:
        """Closes the stream: the sidecar releases the lock at once."""
        self._response.close()

    def __enter__(self) -> "HoldStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
