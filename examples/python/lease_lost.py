"""Notice a lost lease and stop writing. The lease has a short TTL and nobody
renews it; a pause longer than the TTL (a GC pause, a stalled VM) lets it
expire. The proxy then refuses the next write under it with 409 lease_lost
(LeaseLost) instead of forwarding it, and the worker must stop: another
worker may hold the lock now.

Uses the fencer_client library (`pip install clients/python`) and, for the
writes, its standard-library helper fenced_urlopen."""
import sys
import time

from fencer_client import Client, FencerError, LeaseLost, fenced_urlopen

KEY = "example:lost"


def main():
    client = Client()  # $FENCER_API and $FENCER_PROXY
    lease = client.acquire(KEY, ttl_ms=1000, wait_ms=5000)
    print(f"acquired token={lease.token} ttl_ms={lease.ttl_ms}")
    for balance in (1, 2, 3):
        try:
            fenced_urlopen(lease, "/kv/example/lost", data={"balance": balance}, method="PUT",
                           base_url=client.proxy).close()
        except LeaseLost:
            print("lease lost: stopping")
            return
        print(f"write ok balance={balance}")
        print("pausing 1500 ms (longer than the ttl, no renew)")
        time.sleep(1.5)
    sys.exit("error: the lease should have been lost")


if __name__ == "__main__":
    try:
        main()
    except (FencerError, OSError) as e:
        sys.exit(f"error: {e}")
