// Write to storage under a lock: send the request through the sidecar's
// egress proxy with `Fencing-Lease: <lease_id>`. The proxy adds the signed
// fencing token; the gateway in front of the storage refuses any write whose
// token is older than one it has already accepted for the key.
//
// withLock keeps the lease alive in the background while the function runs
// and releases it at the end (it rejects with LeaseLostError if the lease is
// lost meanwhile); held.fetch adds `Fencing-Lease`, sends relative URLs to
// the proxy ($FENCER_PROXY) and is aborted when the lease is lost.
// Uses the fencer-client library (`npm install ../../clients/node`).
import { FencerClient } from "fencer-client";

const KEY = "example:write";

async function main() {
  const client = new FencerClient(); // $FENCER_API and $FENCER_PROXY
  await client.withLock(KEY, async (held) => {
    console.log(`acquired token=${held.lease.token}`);
    const put = await held.fetch("/kv/example/write", {
      method: "PUT",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ balance: 100 }),
    });
    if (!put.ok) throw new Error(`write: ${put.status} ${await put.text()}`);
    console.log("write ok");
    const { value } = await (await held.fetch("/kv/example/write")).json();
    console.log(`read back balance=${value.balance}`);
  }, { ttlMs: 10000, waitMs: 5000 });
  console.log("released");
}

main().catch((e) => {
  console.error(`error: ${e.message}`);
  process.exit(1);
});
