"""Auto-renew with keepalive: the sidecar renews the lease for us as long as
we show we are alive (a keepalive call, or a proxied request under the lease,
within keepalive_ms). If this process hangs or dies, renewal stops and the
lease runs out within keepalive_ms + ttl_ms.

(To have this process renew instead, use `with client.lock(key) as held:`:
see proxy_write.py.) Uses the fencer_client library (`pip install clients/python`)."""
import sys
import time

from fencer_client import Client, FencerError

KEY = "example:auto-renew"


def main():
    client = Client()  # $FENCER_API, else http://127.0.0.1:7411
    lease = client.acquire(KEY, ttl_ms=1000, auto_renew=True, keepalive_ms=2000, wait_ms=5000)
    print(f"acquired token={lease.token} ttl_ms={lease.ttl_ms}")
    try:
        for step in range(1, 7):
            time.sleep(0.5)  # one chunk of work
            # "I am alive"; LeaseLost here means: stop working, the lock is gone
            client.keepalive(lease)
            print(f"step {step}: keepalive ok")
        state = client.status(KEY)["state"]
        print(f"after 3000 ms with a 1000 ms ttl: {state}")
    finally:
        client.release(lease)
        print("released")


if __name__ == "__main__":
    try:
        main()
    except FencerError as e:
        sys.exit(f"error: {e}")
