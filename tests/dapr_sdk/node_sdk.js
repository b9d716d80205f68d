// Dapr's official Node SDK (@dapr/dapr) against fencer's Dapr APIs, over
// HTTP or gRPC (argv[2]): start (the SDK's sidecar check), metadata, lock,
// a second owner refused, unlock's three statuses, and writes through
// fencer's egress proxy with the lease the look-up names (docs/dapr.md).
// Run by tests/dapr_sdk.rs against `fencer dev`; prints "ok" last.
// Environment: FENCER_API, FENCER_PROXY, FENCER_GATEWAY (http://host:port),
// DAPR_GRPC_PORT (the gRPC listener's port).
"use strict";

const assert = require("node:assert/strict");
const {
  DaprClient,
  CommunicationProtocolEnum,
  LogLevel,
} = require("@dapr/dapr");

const protocol = process.argv[2];
const api = process.env.FENCER_API;
const proxy = process.env.FENCER_PROXY;
const gateway = process.env.FENCER_GATEWAY;
const STORE = "lockstore";

function client() {
  const url = new URL(api);
  const grpc = protocol === "grpc";
  return new DaprClient({
    daprHost: "127.0.0.1",
    daprPort: grpc ? process.env.DAPR_GRPC_PORT : url.port,
    communicationProtocol: grpc
      ? CommunicationProtocolEnum.GRPC
      : CommunicationProtocolEnum.HTTP,
    logger: { level: LogLevel.Error },
  });
}

// fencer's look-up: the lease this owner holds (SDKs hide the headers).
async function leaseOf(resourceId, lockOwner) {
  const r = await fetch(`${api}/v1/dapr/${STORE}/lease`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ resourceId, lockOwner }),
  });
  return { status: r.status, body: await r.json() };
}

async function put(base, path, headers, value) {
  const r = await fetch(`${base}${path}`, {
    method: "PUT",
    headers,
    body: JSON.stringify(value),
  });
  return { status: r.status, body: await r.text() };
}

async function main() {
  const dapr = client();
  await dapr.start();
  const calls = ["start"];

  const meta = await dapr.metadata.get();
  const store = meta.components.find((c) => c.name === STORE);
  assert.ok(store, `metadata lists ${STORE}: ${JSON.stringify(meta)}`);
  assert.equal(store.type, "lock.memory");
  calls.push("metadata.get");

  const n = Math.floor(Math.random() * 1e9);
  const resource = `account:${n}`;
  const path = `/kv/accounts/${n}`;
  const [a, b] = [`node-${protocol}-a-${n}`, `node-${protocol}-b-${n}`];

  assert.deepEqual(await dapr.lock.lock(STORE, resource, a, 30), { success: true });
  assert.deepEqual(await dapr.lock.lock(STORE, resource, b, 30), { success: false });
  calls.push("lock.lock");

  assert.equal((await dapr.lock.unlock(STORE, `${resource}-none`, a)).status, 1);
  assert.equal((await dapr.lock.unlock(STORE, resource, b)).status, 2);

  // The lease, looked up by its owner, and only by its owner.
  assert.equal((await leaseOf(resource, b)).status, 404);
  const l1 = await leaseOf(resource, a);
  assert.equal(l1.status, 200, JSON.stringify(l1.body));
  assert.equal(l1.body.key, resource);
  const w1 = await put(proxy, path, { "Fencing-Lease": l1.body.lease_id }, { by: a });
  assert.equal(w1.status, 200, w1.body);

  assert.equal((await dapr.lock.unlock(STORE, resource, a)).status, 0);
  assert.equal((await leaseOf(resource, a)).status, 404);
  calls.push("lock.unlock");

  // b takes the lock and writes; a's lease and token are stale now.
  assert.deepEqual(await dapr.lock.lock(STORE, resource, b, 30), { success: true });
  const l2 = await leaseOf(resource, b);
  assert.ok(l2.body.token > l1.body.token, JSON.stringify([l1.body, l2.body]));
  const w2 = await put(proxy, path, { "Fencing-Lease": l2.body.lease_id }, { by: b });
  assert.equal(w2.status, 200, w2.body);
  const stale = await put(proxy, path, { "Fencing-Lease": l1.body.lease_id }, { by: a });
  assert.equal(stale.status, 409, stale.body);
  const direct = await put(
    gateway,
    path,
    { "Fencing-Token": l1.body.fencing_token, "Fencing-Key": resource },
    { by: a },
  );
  assert.equal(direct.status, 409, direct.body);
  assert.equal((await dapr.lock.unlock(STORE, resource, b)).status, 0);

  await dapr.stop();
  console.log(`calls: ${calls.join(", ")}`);
  console.log("ok");
}

main().then(
  () => process.exit(0),
  (e) => {
    console.error(e);
    process.exit(1);
  },
);
