// Notice a lost lease and stop writing. The lease has a short TTL and nobody
// renews it; a pause longer than the TTL (a GC pause, a stalled VM) lets it
// expire. The proxy then refuses the next write under it with 409 lease_lost
// (LeaseLostError) instead of forwarding it, and the worker must stop:
// another worker may hold the lock now.
//
// Uses the fencer-client library (`npm install ../../clients/node`) and its
// fetch wrapper, fencedFetch.
import { setTimeout as sleep } from "node:timers/promises";
import { FencerClient, LeaseLostError, fencedFetch } from "fencer-client";

const KEY = "example:lost";

async function main() {
  const client = new FencerClient(); // $FENCER_API and $FENCER_PROXY
  const lease = await client.acquire(KEY, { ttlMs: 1000, waitMs: 5000 });
  console.log(`acquired token=${lease.token} ttl_ms=${lease.ttlMs}`);
  const fenced = fencedFetch(lease, { baseUrl: client.proxy });
  for (const balance of [1, 2, 3]) {
    try {
      await fenced("/kv/example/lost", {
        method: "PUT",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ balance }),
      });
    } catch (e) {
      if (!(e instanceof LeaseLostError)) throw e;
      console.log("lease lost: stopping");
      return;
    }
    console.log(`write ok balance=${balance}`);
    console.log("pausing 1500 ms (longer than the ttl, no renew)");
    await sleep(1500);
  }
  throw new Error("the lease should have been lost");
}

main().catch((e) => {
  console.error(`error: ${e.message}`);
  process.exit(1);
});
