"""Auto-renew with keepalive: the sidecar renews the lease for us as long as
we show we are alive (a keepalive call, or a proxied request under the lease,
within keepalive_ms). If this process hangs or dies, renewal stops and the
lease runs out within keepalive_ms + ttl_ms."""
import os
import sys
import time

import requests

API = os.environ.get("FENCER_API", "http://127.0.0.1:7411")
KEY = "example:auto-renew"


class FencerError(Exception):
    def __init__(self, status, body):
        super().__init__(f"{status} {body.get('error')}: {body.get('message')}")
        self.status, self.code = status, body.get("error")


def call(method, url, body=None):
    r = requests.request(method, url, json=body, timeout=30)
    if r.status_code != 200:
        raise FencerError(r.status_code, r.json())
    return r.json()


def main():
    lease = call("POST", f"{API}/v1/locks/{KEY}/acquire",
                 {"ttl_ms": 1000, "auto_renew": True, "keepalive_ms": 2000, "wait_ms": 5000})
    print(f"acquired token={lease['token']} ttl_ms={lease['ttl_ms']}")
    try:
        for step in range(1, 7):
            time.sleep(0.5)  # one chunk of work
            # "I am alive"; 409 lease_lost here means: stop working, the lock is gone
            call("POST", f"{API}/v1/locks/{KEY}/keepalive", {"lease_id": lease["lease_id"]})
            print(f"step {step}: keepalive ok")
        state = call("GET", f"{API}/v1/locks/{KEY}")["state"]
        print(f"after 3000 ms with a 1000 ms ttl: {state}")
    finally:
        call("POST", f"{API}/v1/locks/{KEY}/release", {"lease_id": lease["lease_id"]})
        print("released")


if __name__ == "__main__":
    try:
        main()
    except (FencerError, requests.RequestException) as e:
        sys.exit(f"error: {e}")
