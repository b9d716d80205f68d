"""Write to storage under a lock: send the request through the sidecar's
egress proxy with `Fencing-Lease: <lease_id>`. The proxy adds the signed
fencing token; the gateway in front of the storage refuses any write whose
token is older than one it has already accepted for the key.

`client.lock()` keeps the lease alive in the background while the `with`
block runs and releases it at the end; `held.session()` is a
requests.Session that adds `Fencing-Lease` to every request and sends
relative URLs to the proxy ($FENCER_PROXY). Uses the fencer_client library
with its requests extra (`pip install 'clients/python[requests]'`)."""
import sys

import requests

from fencer_client import Client, FencerError

KEY = "example:write"


def main():
    client = Client()  # $FENCER_API and $FENCER_PROXY
    with client.lock(KEY, ttl_ms=10000, wait_ms=5000) as held:
        print(f"acquired token={held.lease.token}")
        session = held.session()
        session.put("/kv/example/write", json={"balance": 100}).raise_for_status()
        print("write ok")
        value = session.get("/kv/example/write").json()["value"]
        print(f"read back balance={value['balance']}")
    print("released")


if __name__ == "__main__":
    try:
        main()
    except (FencerError, requests.RequestException) as e:
        sys.exit(f"error: {e}")
