"""Acquire a lock, waiting for it if another worker holds it; print the
fencing token; release it. A second acquire while we hold the lock shows how
a refusal arrives: as the typed error of its code (409 lock_held: LockHeld).

Uses the fencer_client library (`pip install clients/python`)."""
import sys

from fencer_client import Client, FencerError, LockHeld

KEY = "example:acquire"


def main():
    client = Client()  # $FENCER_API, else http://127.0.0.1:7411
    # Wait up to 5 s in the key's FIFO queue if someone else holds it.
    lease = client.acquire(KEY, ttl_ms=10000, wait_ms=5000)
    print(f"acquired token={lease.token}")
    try:
        # ... do the work the lock protects ...
        try:  # another worker would wait 200 ms, then get 409 lock_held
            client.acquire(KEY, wait_ms=200)
        except LockHeld as e:
            print(f"second acquire refused: {e.code}")
    finally:
        client.release(lease)
        print("released")


if __name__ == "__main__":
    try:
        main()
    except FencerError as e:
        sys.exit(f"error: {e}")
