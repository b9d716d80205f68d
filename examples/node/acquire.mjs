// Acquire a lock, waiting for it if another worker holds it; print the
// fencing token; release it. A second acquire while we hold the lock shows
// how an error answer ({"error": code, "message": text}) looks.
const API = process.env.FENCER_API ?? "http://127.0.0.1:7411";
const KEY = "example:acquire";

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
  // Wait up to 5 s in the key's FIFO queue if someone else holds it.
  const lease = await call("POST", `${API}/v1/locks/${KEY}/acquire`, { ttl_ms: 10000, wait_ms: 5000 });
  console.log(`acquired token=${lease.token}`);
  try {
    // ... do the work the lock protects ...
    try {
      // another worker would wait 200 ms, then get 409 lock_held
      await call("POST", `${API}/v1/locks/${KEY}/acquire`, { wait_ms: 200 });
    } catch (e) {
      if (!(e instanceof FencerError)) throw e;
      console.log(`second acquire refused: ${e.code}`);
    }
  } finally {
    await call("POST", `${API}/v1/locks/${KEY}/release`, { lease_id: lease.lease_id });
    console.log("released");
  }
}

main().catch((e) => {
  console.error(`error: ${e.message}${e.cause ? ` (${e.cause.message})` : ""}`);
  process.exit(1);
});
