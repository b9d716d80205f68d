// Notice a lost lease and stop writing. The lease has a short TTL and nobody
// renews it; a pause longer than the TTL (a GC pause, a stalled VM) lets it
// expire. The proxy then refuses the next write under it with 409 lease_lost
// instead of forwarding it, and the worker must stop: another worker may hold
// the lock now.
import { setTimeout as sleep } from "node:timers/promises";

const API = process.env.FENCER_API ?? "http://127.0.0.1:7411";
const PROXY = process.env.FENCER_PROXY ?? "http://127.0.0.1:7412";
const KEY = "example:lost";

class FencerError extends Error {
  constructor(status, body) {
    super(`${status} ${body.error}: ${body.message}`);
    this.code = body.error;
  }
}

async function call(method, url, body, headers = {}) {
  const res = await fetch(url, {
    method,
    headers: { "Content-Type": "application/json", ...headers },
    body: body && JSON.stringify(body),
  });
  const json = await res.json();
  if (!res.ok) throw new FencerError(res.status, json);
  return json;
}

async function main() {
  const lease = await call("POST", `${API}/v1/locks/${KEY}/acquire`, { ttl_ms: 1000, wait_ms: 5000 });
  console.log(`acquired token=${lease.token} ttl_ms=${lease.ttl_ms}`);
  const fenced = { "Fencing-Lease": lease.lease_id };
  for (const balance of [1, 2, 3]) {
    try {
      await call("PUT", `${PROXY}/kv/example/lost`, { balance }, fenced);
    } catch (e) {
      if (e.code === "lease_lost") {
        console.log("lease lost: stopping");
        return;
      }
      throw e;
    }
    console.log(`write ok balance=${balance}`);
    console.log("pausing 1500 ms (longer than the ttl, no renew)");
    await sleep(1500);
  }
  throw new Error("the lease should have been lost");
}

main().catch((e) => {
  console.error(`error: ${e.message}${e.cause ? ` (${e.cause.message})` : ""}`);
  process.exit(1);
});
