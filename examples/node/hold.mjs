// Hold a lock for exactly as long as an HTTP connection: POST .../hold answers
// a stream of JSON lines (acquired, then a heartbeat every second, and a last
// line if the lease is lost). Closing the stream releases the lock at once,
// and so does this process dying.
const API = process.env.FENCER_API ?? "http://127.0.0.1:7411";
const KEY = "example:hold";

// The stream's lines, one parsed JSON object at a time.
async function* jsonLines(body) {
  let buffered = "";
  for await (const chunk of body.pipeThrough(new TextDecoderStream())) {
    buffered += chunk;
    let nl;
    while ((nl = buffered.indexOf("\n")) >= 0) {
      const line = buffered.slice(0, nl).trim();
      buffered = buffered.slice(nl + 1);
      if (line) yield JSON.parse(line);
    }
  }
}

async function main() {
  const stream = new AbortController();
  const res = await fetch(`${API}/v1/locks/${KEY}/hold`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ ttl_ms: 5000, wait_ms: 5000 }),
    signal: stream.signal,
  });
  if (!res.ok) {
    const err = await res.json();
    throw new Error(`${res.status} ${err.error}: ${err.message}`);
  }
  let beats = 0;
  try {
    for await (const event of jsonLines(res.body)) {
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
  } finally {
    stream.abort(); // closes the connection: the sidecar releases the lock
  }
  console.log("stream closed");

  // The sidecar released the lock when the stream closed: it is free again.
  const again = await fetch(`${API}/v1/locks/${KEY}/acquire`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ wait_ms: 2000 }),
  });
  const lease = await again.json();
  if (!again.ok) throw new Error(`${again.status} ${lease.error}: ${lease.message}`);
  console.log(`lock free again token=${lease.token}`);
  await fetch(`${API}/v1/locks/${KEY}/release`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ lease_id: lease.lease_id }),
  });
}

main().catch((e) => {
  console.error(`error: ${e.message}${e.cause ? ` (${e.cause.message})` : ""}`);
  process.exit(1);
});
