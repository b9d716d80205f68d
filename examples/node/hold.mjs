// Hold a lock for exactly as long as an HTTP connection: POST .../hold answers
// a stream of JSON lines (acquired, then a heartbeat every second, and a last
// line if the lease is lost). Closing the stream releases the lock at once,
// and so does this process dying.
//
// Uses the fencer-client library (`npm install ../../clients/node`).
import { FencerClient } from "fencer-client";

const KEY = "example:hold";

async function main() {
  const client = new FencerClient(); // $FENCER_API, else http://127.0.0.1:7411
  const stream = await client.hold(KEY, { ttlMs: 5000, waitMs: 5000 });
  let beats = 0;
  // Leaving the loop (break, return or throw) closes the stream.
  for await (const event of stream) {
    if (event.type === "acquired") {
      console.log(`acquired token=${event.token}`); // start acting as the leader
    } else if (event.type === "heartbeat") {
      console.log(`heartbeat remaining_ms=${event.remaining_ms}`);
      if (++beats === 2) break; // done leading
    } else {
      // "lost" or "released": stop acting as the leader now
      throw new Error(`lease ended: ${JSON.stringify(event)}`);
    }
  }
  console.log("stream closed");

  // The sidecar released the lock when the stream closed: it is free again.
  const lease = await client.acquire(KEY, { waitMs: 2000 });
  console.log(`lock free again token=${lease.token}`);
  await client.release(lease);
}

main().catch((e) => {
  console.error(`error: ${e.message}`);
  process.exit(1);
});
