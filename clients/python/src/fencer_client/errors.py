"""Typed errors: one class per error code fencer's lock API, egress proxy and
gateway answer with (``{"error": code, "message": text, ...}``).

Code branches on the class (``except LockHeld``) instead of comparing strings,
and a code this library does not know still arrives as a :class:`FencerError`
with its ``code``: a newer sidecar never breaks an older client.
"""
from typing import Any, Dict, Optional, Type


class FencerError(Exception):
    """An error answer of fencer: ``status`` (HTTP), ``code`` (the ``error``
    field), ``message`` and the whole JSON ``body`` (extra fields such as
    ``key``, ``field`` or ``highest_seen``)."""

    #: The error code this class stands for (``None``: the base, any code).
    code: Optional[str] = None

    def __init__(self, status: int, code: str, message: str, body: Optional[Dict[str, Any]] = None):
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body: Dict[str, Any] = dict(body or {})


class TransportError(FencerError):
    """The sidecar could not be reached or answered something that is not
    fencer JSON (status 0 when no answer arrived at all). Whether a request
    that failed this way was applied is unknown."""


# --- the lock API (docs/openapi.json) ---

class InvalidRequest(FencerError):
    """400: a field is out of range or malformed; ``body["field"]`` names it."""
    code = "invalid_request"


class TtlTooLong(FencerError):
    """400: the TTL asked for exceeds the sidecar's maximum (``body["max_ttl_ms"]``)."""
    code = "ttl_too_long"


class PayloadTooLarge(FencerError):
    """413: the request body is larger than the sidecar accepts (16 KiB)."""
    code = "payload_too_large"


class NotFound(FencerError):
    """404: this sidecar holds no lease on the key."""
    code = "not_found"


class MethodNotAllowed(FencerError):
    """405: the route does not take this HTTP method."""
    code = "method_not_allowed"


class LockHeld(FencerError):
    """409: another lease still held the lock when ``wait_ms`` ran out."""
    code = "lock_held"


class LockDelayed(LockHeld):
    """409: nobody holds the lock, but its last lease expired without a
    release and the key stays closed for the sidecar's lock-delay;
    ``retry_after_ms`` says for how much longer. A :class:`LockHeld`, so
    code that catches that keeps working."""
    code = "lock_delayed"

    @property
    def retry_after_ms(self) -> Optional[int]:
        return (self.body or {}).get("retry_after_ms")


class LeaseLost(FencerError):
    """409: the lease no longer holds its lock (expired, released or lost).
    Stop the work it protects: another holder may have the lock now.

    Also raised by this library itself (``status`` 0) when a kept-alive lease
    could not be renewed before its deadline; ``reason`` says why."""
    code = "lease_lost"

    def __init__(self, status: int, code: str, message: str,
                 body: Optional[Dict[str, Any]] = None, reason: Optional[str] = None):
        super().__init__(status, code, message, body)
        self.reason = reason or (body or {}).get("reason") or code


class NotOwner(FencerError):
    """409: another lease holds the key and this one never held it here."""
    code = "not_owner"


class MaxHoldReached(FencerError):
    """409: the lease reached ``sidecar.max_hold_ms`` and cannot be renewed."""
    code = "max_hold_reached"


class TooManyWaiters(FencerError):
    """429: the key's wait queue is full; retry later."""
    code = "too_many_waiters"


class TooManyLeases(FencerError):
    """429: the sidecar holds as many leases as it may."""
    code = "too_many_leases"


class UnsupportedByBackend(FencerError):
    """400: the lock type asked for (``body["feature"]``) is not kept by the
    sidecar's backend (``body["backend"]``)."""
    code = "unsupported_by_backend"


class PermitsMismatch(FencerError):
    """409: the semaphore's permit count was fixed at its first use, at
    another count (``body["permits"]``); every user of a name counts the
    same permits."""
    code = "permits_mismatch"


class TooManyHolds(FencerError):
    """409: a reentrant lease already counts the most holds one lease may
    (``body["max_holds"]``)."""
    code = "too_many_holds"


class RateLimited(FencerError):
    """429: too many backend views (``GET /v1/locks/{key}?scope=backend``)
    from this sidecar; ``retry_after_ms`` says when to ask again."""
    code = "rate_limited"


class ViewOff(FencerError):
    """400: ``scope=backend`` is off on this sidecar
    (``sidecar.backend_view_per_second = 0``)."""
    code = "view_off"


class BackendUnavailable(FencerError):
    """503: the lock backend did not answer; nothing was taken."""
    code = "backend_unavailable"


class BackendRefused(FencerError):
    """503: the lock backend refused the operation (e.g. read-only replica)."""
    code = "backend_refused"


class NotReplicated(FencerError):
    """503: the backend could not confirm the write on enough replicas."""
    code = "not_replicated"


class GatewayUnavailable(FencerError):
    """503: pre-registration could not reach the gateway; the lease was released."""
    code = "gateway_unavailable"


class TokenBehindGateway(FencerError):
    """503: the gateway has seen a higher token than the one minted
    (``body["highest_seen"]``); the sidecar repairs forward — retry."""
    code = "token_behind_gateway"


class TokenJump(FencerError):
    """503: the minted token is implausibly far above the gateway's mark."""
    code = "token_jump"


class LeaseExpiredBeforeAnswer(FencerError):
    """503: the lease ran out before its answer could be sent; it was released."""
    code = "lease_expired_before_answer"


class ShuttingDown(FencerError):
    """503: the sidecar is shutting down."""
    code = "shutting_down"


class InternalError(FencerError):
    """500: a sidecar task that should have answered did not."""
    code = "internal_error"


class LockStoreNotFound(FencerError):
    """400: the Dapr-compatible API was called with an unknown lock store."""
    code = "lock_store_not_found"


class LeaseNotFound(FencerError):
    """404: no lease is held now through that Dapr lock store by that owner
    (`POST /v1/dapr/{store}/lease`)."""
    code = "lease_not_found"


class NotReady(FencerError):
    """503 (500 on Dapr's health routes): the sidecar cannot serve yet — its
    backend is not reachable or it is starting or stopping."""
    code = "not_ready"


# --- the egress proxy ---

class LeaseRequired(FencerError):
    """428: the proxy requires ``Fencing-Lease`` on requests that name a lock."""
    code = "lease_required"


class LockNotHeld(FencerError):
    """428: the request names a lock (or lease) this sidecar does not hold."""
    code = "lock_not_held"


class LeaseBusy(FencerError):
    """503: the previous request under this lease has not been answered yet."""
    code = "lease_busy"


class DuplicateFencingHeader(FencerError):
    """400: a ``Fencing-*`` header was sent twice."""
    code = "duplicate_fencing_header"


class UpstreamError(FencerError):
    """502: the upstream could not be reached or failed mid-response; a write
    may or may not have landed."""
    code = "upstream_error"


class UpstreamTimeout(FencerError):
    """504: the upstream did not answer in time; a write may have landed."""
    code = "upstream_timeout"


# --- the gateway (docs/openapi-gateway.json), answered through the proxy ---

class FencingTokenRequired(FencerError):
    """428: a write reached the gateway without a fencing token."""
    code = "fencing_token_required"


class InvalidFencingToken(FencerError):
    """403: the token's signature, key or range does not verify."""
    code = "invalid_fencing_token"


class PathNotRouted(FencerError):
    """403: the path maps to no lock key in the gateway's routes."""
    code = "path_not_routed"


class StaleFencingToken(FencerError):
    """409: a higher token was already accepted for the key
    (``body["highest_seen"]``): a newer holder has written; this write was
    not applied."""
    code = "stale_fencing_token"


class ReadLease(FencerError):
    """409: a write under a read lease (a read-write lock's reader): its
    token reads, never writes; acquire with ``mode="write"`` to write. The
    write was not sent (proxy) or not applied (gateway)."""
    code = "read_lease"


class StaleSequence(FencerError):
    """409: the lease's write sequence went back (a delayed write)."""
    code = "stale_sequence"


class DuplicateSequence(FencerError):
    """409: the lease's write sequence repeats with a different request."""
    code = "duplicate_sequence"


class FenceBusy(FencerError):
    """503: the key stayed busy with another fenced request too long."""
    code = "fence_busy"


class FenceStoreUnavailable(FencerError):
    """503: the gateway's fence store is unreachable; not forwarded."""
    code = "fence_store_unavailable"


def _registry() -> Dict[str, Type[FencerError]]:
    found: Dict[str, Type[FencerError]] = {}
    stack = list(FencerError.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.code:
            found[cls.code] = cls
    return found


#: Every error code this library knows, mapped to its class.
ERROR_CLASSES: Dict[str, Type[FencerError]] = _registry()


#: The codes the egress proxy and the gateway answer with themselves (each has
#: its class). A fenced request's answer is recognised as fencer's refusal by
#: its ``Fencing-Error`` header, not by its code: the storage's own answers
#: pass through unchanged, and may well say ``{"error": "invalid_request"}``.
FENCED_CODES = frozenset({
    "lease_required", "lock_not_held", "lease_lost", "lease_busy", "duplicate_fencing_header",
    "invalid_request", "internal_error", "method_not_allowed", "upstream_error", "upstream_timeout",
    "fencing_token_required", "invalid_fencing_token", "path_not_routed", "stale_fencing_token",
    "stale_sequence", "duplicate_sequence", "fence_busy", "fence_store_unavailable", "read_lease",
})


def error_from_body(status: int, body: Any) -> FencerError:
    """The typed error for an error answer (``status``, decoded JSON
    ``body``): the class of its code, or :class:`FencerError` for a code this
    library does not know."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), str):
        return TransportError(status, "unexpected_answer", f"not a fencer error answer: {body!r}"[:300])
    code = body["error"]
    cls = ERROR_CLASSES.get(code, FencerError)
    return cls(status, code, str(body.get("message", "")), body)

__all__ = ["FencerError", "TransportError", "ERROR_CLASSES", "FENCED_CODES", "error_from_body"] + sorted(
    cls.__name__ for cls in ERROR_CLASSES.values())
