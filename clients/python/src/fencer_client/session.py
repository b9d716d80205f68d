"""A ``requests.Session`` bound to a lease (the ``requests`` extra:
``pip install 'clients/python[requests]'``)."""
from typing import Optional

import requests

from .http import LeaseSource, fencing_headers, raise_for_fencer, resolve


class FencedSession(requests.Session):
    """A ``requests.Session`` whose every request carries the lease
    (``Fencing-Lease``; ``Fencing-Token`` with ``direct=True``, for a request
    sent straight to the gateway). Relative URLs are joined to ``base_url``
    (the proxy). A held lock that is lost raises :class:`LeaseLost` before
    anything is sent; a refusal by fencer's proxy or gateway raises its typed
    error (``raise_errors=False`` returns it as a response instead)."""

    def __init__(self, source: LeaseSource, base_url: Optional[str] = None,
                 direct: bool = False, raise_errors: bool = True):
        super().__init__()
        self.source = source
        self.base_url = base_url
        self.direct = direct
        self.raise_errors = raise_errors
        # The proxy is local: never route it through $http_proxy.
        self.trust_env = False

    def request(self, method, url, *args, **kwargs):
        """As ``requests.Session.request``, fenced (see the class)."""
        headers = dict(kwargs.pop("headers", None) or {})
        headers.update(fencing_headers(self.source, self.direct))
        response = super().request(method, resolve(self.base_url, url), *args, headers=headers, **kwargs)
        if self.raise_errors:
            raise_for_fencer(response)
        return response
