"""Fenced HTTP: requests sent through the egress proxy under a lease.

Every request carries ``Fencing-Lease: <lease_id>`` so the proxy stamps the
lease's signed token on it, and refuses it (409 ``lease_lost``) once the lease
is gone instead of forwarding it. A refusal by the proxy or the gateway
raises its typed error; the storage's own answers, errors included, are
returned unchanged.

This module needs the standard library only; the ``requests`` session is in
:mod:`fencer_client.session` (the ``requests`` extra).
"""
import io
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Dict, Optional, Union

from .client import Lease, _NO_PROXY_OPENER
from .errors import FencerError, error_from_body

#: The header fencer's proxy and gateway put on their own refusals (never on
#: an answer of the storage: the gateway strips it).
REFUSAL_HEADER = "Fencing-Error"

# A lease, or anything with a ``check()`` and a ``lease`` (a HeldLock).
LeaseSource = Any


def fencing_headers(source: LeaseSource, direct: bool = False) -> Dict[str, str]:
    """The headers that bind a request to ``source`` (a :class:`Lease` or a
    held lock, which is checked first and raises :class:`LeaseLost` once
    lost). ``direct``: ``Fencing-Token`` with the signed token, for a request
    sent straight to the gateway instead of through the proxy."""
    if isinstance(source, Lease):
        lease = source
    else:
        source.check()
        lease = source.lease
    if direct:
        return {"Fencing-Token": lease.fencing_token}
    return {"Fencing-Lease": lease.lease_id}


def fencer_error(status: int, content_type: str, raw: bytes,
                 fencing_error: Optional[str] = None) -> Optional[FencerError]:
    """The typed error if an answer is a refusal by fencer's proxy or gateway,
    else ``None`` (the storage's own answer, errors included).

    fencer marks its own refusals with a ``Fencing-Error: <code>`` header
    (``fencing_error``) that the gateway strips from every storage answer:
    a storage answering ``{"error": "invalid_request"}`` itself is therefore
    not mistaken for fencer. The body's code must match the header."""
    if status < 400 or not fencing_error or "json" not in (content_type or ""):
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("error") != fencing_error:
        return None
    return error_from_body(status, body)


def raise_for_fencer(response) -> None:
    """Raises the typed error if a ``requests`` response is a refusal by
    fencer's proxy or gateway; the error's ``response`` is the response."""
    err = fencer_error(response.status_code, response.headers.get("Content-Type", ""), response.content,
                       response.headers.get(REFUSAL_HEADER))
    if err is not None:
        err.response = response
        raise err


def resolve(base_url: Optional[str], url: str) -> str:
    """``url`` joined to ``base_url`` unless it is absolute."""
    if base_url and not urllib.parse.urlsplit(url).scheme:
        return base_url.rstrip("/") + "/" + url.lstrip("/")
    return url


def fenced_urlopen(source: LeaseSource, url: Union[str, urllib.request.Request], data: Any = None,
                   method: Optional[str] = None, headers: Optional[Dict[str, str]] = None,
                   timeout: float = 30.0, base_url: Optional[str] = None, direct: bool = False):
    """``urllib.request.urlopen`` under a lease (standard library only).
    ``data`` that is not bytes is sent as JSON. Returns the response (a
    context manager); a refusal by fencer raises its typed error, any other
    error status raises ``urllib.error.HTTPError`` as ``urlopen`` does."""
    if isinstance(url, urllib.request.Request):
        request = url
    else:
        request = urllib.request.Request(resolve(base_url, url), method=method)
    if data is not None and not isinstance(data, (bytes, bytearray)):
        data = json.dumps(data).encode()
        request.add_header("Content-Type", "application/json")
    if data is not None:
        request.data = data
    for name, value in {**(headers or {}), **fencing_headers(source, direct)}.items():
        request.add_header(name, value)
    try:
        return _NO_PROXY_OPENER.open(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        raw = e.read()
        err = fencer_error(e.code, e.headers.get("Content-Type", ""), raw, e.headers.get(REFUSAL_HEADER))
        if err is not None:
            raise err from None
        raise urllib.error.HTTPError(e.url, e.code, e.msg, e.headers, io.BytesIO(raw)) from None
