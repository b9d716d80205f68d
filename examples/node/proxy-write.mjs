// Write to storage under a lock: send the request through the sidecar's
// egress proxy with `Fencing-Lease: <lease_id>`. The proxy adds the signed
// fencing token; the gateway in front of the storage refuses any write whose
// token is older than one it has already accepted for the key.
const API = process.env.FENCER_API ?? "http://127.0.0.1:7411";
const PROXY = process.env.FENCER_PROXY ?? "http://127.0.0.1:7412";
const KEY = "example:write";

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
  const lease = await call("POST", `${API}/v1/locks/${KEY}/acquire`, { ttl_ms: 10000, wait_ms: 5000 });
  console.log(`acquired token=${lease.token}`);
  const fenced = { "Fencing-Lease": lease.lease_id };
  try {
    await call("PUT", `${PROXY}/kv/example/write`, { balance: 100 }, fenced);
    console.log("write ok");
    const { value } = await call("GET", `${PROXY}/kv/example/write`, undefined, fenced);
    console.log(`read back balance=${value.balance}`);
  } finally {
    await call("POST", `${API}/v1/locks/${KEY}/release`, { lease_id: lease.lease_id });
    console.log("released");
  }
}

main().catch((e) => {
  console.error(`error: ${e.message}${e.cause ? ` (${e.cause.message})` : ""}`);
  process.exit(1);
});
