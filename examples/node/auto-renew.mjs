// Auto-renew with keepalive: the sidecar renews the lease for us as long as
// we show we are alive (a keepalive call, or a proxied request under the
// lease, within keepalive_ms). If this process hangs or dies, renewal stops
// and the lease runs out within keepalive_ms + ttl_ms.
//
// (To have this process renew instead, use client.withLock(key, fn): see
// proxy-write.mjs.) Uses the fencer-client library (`npm install ../../clients/node`).
import { setTimeout as sleep } from "node:timers/promises";
import { FencerClient } from "fencer-client";

const KEY = "example:auto-renew";

async function main() {
  const client = new FencerClient(); // $FENCER_API, else http://127.0.0.1:7411
  const lease = await client.acquire(KEY, { ttlMs: 1000, autoRenew: true, keepaliveMs: 2000, waitMs: 5000 });
  console.log(`acquired token=${lease.token} ttl_ms=${lease.ttlMs}`);
  try {
    for (let step = 1; step <= 6; step++) {
      await sleep(500); // one chunk of work
      // "I am alive"; LeaseLostError here means: stop working, the lock is gone
      await client.keepalive(lease);
      console.log(`step ${step}: keepalive ok`);
    }
    const { state } = await client.status(KEY);
    console.log(`after 3000 ms with a 1000 ms ttl: ${state}`);
  } finally {
    await client.release(lease);
    console.log("released");
  }
}

main().catch((e) => {
  console.error(`error: ${e.message}`);
  process.exit(1);
});
