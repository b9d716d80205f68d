"""Acquire a lock, waiting for it if another worker holds it; print the
fencing token; release it. A second acquire while we hold the lock shows how
an error answer ({"error": code, "message": text}) looks."""
import os
import sys

import requests

API = os.environ.get("FENCER_API", "http://127.0.0.1:7411")
KEY = "example:acquire"


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
    # Wait up to 5 s in the key's FIFO queue if someone else holds it.
    lease = call("POST", f"{API}/v1/locks/{KEY}/acquire", {"ttl_ms": 10000, "wait_ms": 5000})
    print(f"acquired token={lease['token']}")
    try:
        # ... do the work the lock protects ...
        try:  # another worker would wait 200 ms, then get 409 lock_held
            call("POST", f"{API}/v1/locks/{KEY}/acquire", {"wait_ms": 200})
        except FencerError as e:
            print(f"second acquire refused: {e.code}")
    finally:
        call("POST", f"{API}/v1/locks/{KEY}/release", {"lease_id": lease["lease_id"]})
        print("released")


if __name__ == "__main__":
    try:
        main()
    except (FencerError, requests.RequestException) as e:
        sys.exit(f"error: {e}")
