// Acquire a lock, waiting for it if another worker holds it; print the
// fencing token; release it. A second acquire while we hold the lock shows
// how a refusal arrives: as the typed error of its code (409 lock_held:
// LockHeldError).
//
// Uses the fencer-client library (`npm install ../../clients/node`).
import { FencerClient, LockHeldError } from "fencer-client";

const KEY = "example:acquire";

async function main() {
  const client = new FencerClient(); // $FENCER_API, else http://127.0.0.1:7411
  // Wait up to 5 s in the key's FIFO queue if someone else holds it.
  const lease = await client.acquire(KEY, { ttlMs: 10000, waitMs: 5000 });
  console.log(`acquired token=${lease.token}`);
  try {
    // ... do the work the lock protects ...
    try {
      // another worker would wait 200 ms, then get 409 lock_held
      await client.acquire(KEY, { waitMs: 200 });
    } catch (e) {
      if (!(e instanceof LockHeldError)) throw e;
      console.log(`second acquire refused: ${e.code}`);
    }
  } finally {
    await client.release(lease);
    console.log("released");
  }
}

main().catch((e) => {
  console.error(`error: ${e.message}`);
  process.exit(1);
});
