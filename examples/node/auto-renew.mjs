// Auto-renew with keepalive: the sidecar renews the lease for us as long as
// we show we are alive (a keepalive call, or a proxied request under the
// lease, within keepalive_ms). If this process hangs or dies, renewal stops
// and the lease runs out within keepalive_ms + ttl_ms.
import { setTimeout as sleep } from "node:timers/promises";

const API = process.env.FENCER_API ?? "http://127.0.0.1:7411";
const KEY = "example:auto-renew";

class FencerError extends Error {
  constructor(status, body) {
    super(`${status} ${body.error}: ${body.message}`);
    this.code = body.error;
  }
}

async function call(method, url, body) {
  const res = await fetch(url, {
    method,
    headers: { "Content-Type": "application/json" },
    body: body && JSON.stringify(body),
  });
  const json = await res.json();
  if (!res.ok) throw new FencerError(res.status, json);
  return json;
}

async function main() {
  const lease = await call("POST", `${API}/v1/locks/${KEY}/acquire`, {
    ttl_ms: 1000, auto_renew: true, keepalive_ms: 2000, wait_ms: 5000,
  });
  console.log(`acquired token=${lease.token} ttl_ms=${lease.ttl_ms}`);
  try {
    for (let step = 1; step <= 6; step++) {
      await sleep(500); // one chunk of work
      // "I am alive"; 409 lease_lost here means: stop working, the lock is gone
      await call("POST", `${API}/v1/locks/${KEY}/keepalive`, { lease_id: lease.lease_id });
      console.log(`step ${step}: keepalive ok`);
    }
    const { state } = await call("GET", `${API}/v1/locks/${KEY}`);
    console.log(`after 3000 ms with a 1000 ms ttl: ${state}`);
  } finally {
    await call("POST", `${API}/v1/locks/${KEY}/release`, { lease_id: lease.lease_id });
    console.log("released");
  }
}

main().catch((e) => {
  console.error(`error: ${e.message}${e.cause ? ` (${e.cause.message})` : ""}`);
  process.exit(1);
});
