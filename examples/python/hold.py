"""Hold a lock for exactly as long as an HTTP connection: POST .../hold answers
a stream of JSON lines (acquired, then a heartbeat every second, and a last
line if the lease is lost). Closing the stream releases the lock at once,
and so does this process dying."""
import json
import os
import sys

import requests

API = os.environ.get("FENCER_API", "http://127.0.0.1:7411")
KEY = "example:hold"


def main():
    with requests.post(f"{API}/v1/locks/{KEY}/hold", json={"ttl_ms": 5000, "wait_ms": 5000},
                       stream=True, timeout=30) as r:
        if r.status_code != 200:
            err = r.json()
            sys.exit(f"error: {r.status_code} {err['error']}: {err['message']}")
        beats = 0
        for line in r.iter_lines():
            event = json.loads(line)
            if event["type"] == "acquired":
                print(f"acquired token={event['token']}")  # start acting as the leader
            elif event["type"] == "heartbeat":
                print(f"heartbeat remaining_ms={event['remaining_ms']}")
                beats += 1
                if beats == 2:
                    break  # done leading: leaving the `with` closes the stream
            else:  # "lost" or "released": stop acting as the leader now
                sys.exit(f"lease ended: {event}")
    print("stream closed")

    # The sidecar released the lock when the stream closed: it is free again.
    r = requests.post(f"{API}/v1/locks/{KEY}/acquire", json={"wait_ms": 2000}, timeout=30)
    lease = r.json()
    if r.status_code != 200:
        sys.exit(f"error: {r.status_code} {lease['error']}: {lease['message']}")
    print(f"lock free again token={lease['token']}")
    requests.post(f"{API}/v1/locks/{KEY}/release", json={"lease_id": lease["lease_id"]}, timeout=30)


if __name__ == "__main__":
    try:
        main()
    except requests.RequestException as e:
        sys.exit(f"error: {e}")
