"""Write to storage under a lock: send the request through the sidecar's
egress proxy with `Fencing-Lease: <lease_id>`. The proxy adds the signed
fencing token; the gateway in front of the storage refuses any write whose
token is older than one it has already accepted for the key."""
import os
import sys

import requests

API = os.environ.get("FENCER_API", "http://127.0.0.1:7411")
PROXY = os.environ.get("FENCER_PROXY", "http://127.0.0.1:7412")
KEY = "example:write"


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
    lease = call("POST", f"{API}/v1/locks/{KEY}/acquire", {"ttl_ms": 10000, "wait_ms": 5000})
    print(f"acquired token={lease['token']}")
    fenced = {"Fencing-Lease": lease["lease_id"]}
    try:
        call("PUT", f"{PROXY}/kv/example/write", {"balance": 100}, fenced)
        print("write ok")
        value = call("GET", f"{PROXY}/kv/example/write", headers=fenced)["value"]
        print(f"read back balance={value['balance']}")
    finally:
        call("POST", f"{API}/v1/locks/{KEY}/release", {"lease_id": lease["lease_id"]})
        print("released")


if __name__ == "__main__":
    try:
        main()
    except (FencerError, requests.RequestException) as e:
        sys.exit(f"error: {e}")
