"""Dapr's official Python SDK (`dapr`, gRPC) against fencer's Dapr APIs:
the SDK's sidecar check (HTTP /v1.0/healthz/outbound), GetMetadata,
TryLock, a second owner refused, Unlock's three statuses, and writes
through fencer's egress proxy with the lease — read from the TryLock
response's metadata (`fencing-lease`) and from fencer's look-up, which
must agree (docs/dapr.md). Run by tests/dapr_sdk.rs against `fencer dev`;
prints "ok" last.

Environment: FENCER_API, FENCER_PROXY, FENCER_GATEWAY (http://host:port),
and the SDK's own DAPR_RUNTIME_HOST, DAPR_HTTP_PORT, DAPR_GRPC_PORT.
"""

import json
import os
import random
import urllib.error
import urllib.request
import warnings

from dapr.clients import DaprClient
from dapr.clients.grpc._response import UnlockResponseStatus

warnings.simplefilter("ignore")  # "The Distributed Lock API is an Alpha version"

API = os.environ["FENCER_API"]
PROXY = os.environ["FENCER_PROXY"]
GATEWAY = os.environ["FENCER_GATEWAY"]
STORE = "lockstore"


def http(method, url, body, headers=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method=method)
    req.add_header("content-type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def lease_of(resource, owner):
    status, text = http(
        "POST",
        f"{API}/v1/dapr/{STORE}/lease",
        {"resourceId": resource, "lockOwner": owner},
    )
    return status, json.loads(text)


def main():
    calls = []
    n = random.randrange(10**9)
    resource, path = f"account:{n}", f"/kv/accounts/{n}"
    a, b = f"py-a-{n}", f"py-b-{n}"
    # DaprClient() waits for the sidecar: GET /v1.0/healthz/outbound.
    with DaprClient() as d:
        calls.append("DaprClient()")
        meta = d.get_metadata()
        kinds = {c.name: c.type for c in meta.registered_components}
        assert kinds.get(STORE) == "lock.memory", kinds
        calls.append("get_metadata")

        first = d.try_lock(STORE, resource, a, 30)
        assert first.success, "a acquires"
        assert not d.try_lock(STORE, resource, b, 30).success, "b is refused"
        calls.append("try_lock")
        # The lease comes back as response metadata...
        lease1 = first.headers["fencing-lease"][0]
        token1 = first.headers["fencing-token"][0]
        # ...and from the look-up, to the owner only.
        status, view = lease_of(resource, a)
        assert status == 200 and view["lease_id"] == lease1, (status, view)
        assert lease_of(resource, b)[0] == 404

        none = d.unlock(STORE, f"{resource}-none", a).status
        assert none == UnlockResponseStatus.lock_does_not_exist, none
        other = d.unlock(STORE, resource, b).status
        assert other == UnlockResponseStatus.lock_belongs_to_others, other

        status, text = http("PUT", f"{PROXY}{path}", {"by": a}, {"Fencing-Lease": lease1})
        assert status == 200, (status, text)

        assert d.unlock(STORE, resource, a).status == UnlockResponseStatus.success
        calls.append("unlock")

        second = d.try_lock(STORE, resource, b, 30)
        assert second.success
        lease2 = second.headers["fencing-lease"][0]
        status, text = http("PUT", f"{PROXY}{path}", {"by": b}, {"Fencing-Lease": lease2})
        assert status == 200, (status, text)
        # a's lease and token are stale: refused at the proxy and the gateway.
        status, text = http("PUT", f"{PROXY}{path}", {"by": a}, {"Fencing-Lease": lease1})
        assert status == 409, (status, text)
        status, text = http(
            "PUT",
            f"{GATEWAY}{path}",
            {"by": a},
            {"Fencing-Token": token1, "Fencing-Key": resource},
        )
        assert status == 409, (status, text)
        assert d.unlock(STORE, resource, b).status == UnlockResponseStatus.success
    print("calls: " + ", ".join(calls))
    print("ok")


if __name__ == "__main__":
    main()
