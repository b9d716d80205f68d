"""Client for the fencer sidecar: distributed locks with fencing tokens.

>>> from fencer_client import Client, LockHeld
>>> client = Client()                       # $FENCER_API, $FENCER_PROXY
>>> with client.lock("account:1", ttl_ms=10000, wait_ms=5000) as held:
...     held.session().put("/kv/account/1", json={"balance": 100})

See docs/clients.md in fencer's repository.
"""
from .client import DEFAULT_API, DEFAULT_PROXY, Client, HoldStream, Lease, error_from_response
from .errors import *  # noqa: F401,F403 - one class per error code
from .errors import ERROR_CLASSES, FENCED_CODES, FencerError, TransportError, error_from_body
from .held import HeldLock
from .http import REFUSAL_HEADER, fenced_urlopen, fencer_error, fencing_headers, raise_for_fencer

__version__ = "0.1.0"

__all__ = [
    "Client", "Lease", "HeldLock", "HoldStream", "DEFAULT_API", "DEFAULT_PROXY",
    "FencerError", "TransportError", "ERROR_CLASSES", "FENCED_CODES", "error_from_body", "error_from_response",
    "REFUSAL_HEADER", "fenced_urlopen", "fencer_error", "fencing_headers", "raise_for_fencer", "FencedSession",
] + [cls.__name__ for cls in ERROR_CLASSES.values()]


def __getattr__(name):
    # FencedSession needs `requests` (the extra): imported on first use only.
    if name == "FencedSession":
        from .session import FencedSession

        return FencedSession
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
