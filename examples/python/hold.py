"""Hold a lock for exactly as long as an HTTP connection: POST .../hold answers
a stream of JSON lines (acquired, then a heartbeat every second, and a last
line if the lease is lost). Closing the stream releases the lock at once,
and so does this process dying.

Uses the fencer_client library (`pip install clients/python`)."""
import sys

from fencer_client import Client, FencerError

KEY = "example:hold"


def main():
    client = Client()  # $FENCER_API, else http://127.0.0.1:7411
    with client.hold(KEY, ttl_ms=5000, wait_ms=5000) as stream:
        beats = 0
        for event in stream:
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
    lease = client.acquire(KEY, wait_ms=2000)
    print(f"lock free again token={lease.token}")
    client.release(lease)


if __name__ == "__main__":
    try:
        main()
    except FencerError as e:
        sys.exit(f"error: {e}")
