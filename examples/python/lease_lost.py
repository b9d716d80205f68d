"""Notice a lost lease and stop writing. The lease has a short TTL and nobody
renews it; a pause longer than the TTL (a GC pause, a stalled VM) lets it
expire. The proxy then refuses the next write under it with 409 lease_lost
instead of forwarding it, and the worker must stop: another worker may hold
the lock now."""
import os
import sys
import time

import requests

API = os.environ.get("FENCER_API", "http://127.0.0.1:7411")
PROXY = os.environ.get("FENCER_PROXY", "http://127.0.0.1:7412")
KEY = "example:lost"


class FencerError(Exception):
    def __init__(self, status, body):
        super().__init__(f"{status} {body.get('error')}: {body.get('message')}")
        self.status, self.code = status, body.get("error")


def call(method, url, body=None, headers=None):
    r = requests.request(method, url, json=body, headers=headers, timeout=30)
    if r.status_code != 200:
        raise FencerError(r.status_code, r.json())
    return r.json()


def main():
    lease = call("POST", f"{API}/v1/locks/{KEY}/acquire", {"ttl_ms": 1000, "wait_ms": 5000})
    print(f"acquired token={lease['token']} ttl_ms={lease['ttl_ms']}")
    fenced = {"Fencing-Lease": lease["lease_id"]}
    for balance in (1, 2, 3):
        try:
            call("PUT", f"{PROXY}/kv/example/lost", {"balance": balance}, fenced)
        except FencerError as e:
            if e.code == "lease_lost":
                print("lease lost: stopping")
                return
            raise
        print(f"write ok balance={balance}")
        print("pausing 1500 ms (longer than the ttl, no renew)")
        time.sleep(1.5)
    sys.exit("error: the lease should have been lost")


if __name__ == "__main__":
    try:
        main()
    except (FencerError, requests.RequestException) as e:
        sys.exit(f"error: {e}")
