// fencer-client against a real `fencer dev` (tests/clients.rs starts it and
// sets FENCER_API, FENCER_PROXY, FENCER_GATEWAY and FENCER_ERROR_CODES).
// Run alone: start `fencer dev`, then
//   FENCER_GATEWAY=http://127.0.0.1:8080 node --test clients/node/test/
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { setTimeout as sleep } from 'node:timers/promises';

import * as fencer from '../src/index.js';

const {
  FencerClient, FencerError, InvalidRequestError, LeaseLostError, LockHeldError, LockNotHeldError,
  NotFoundError, StaleFencingTokenError, TransportError, fencedFetch, ERROR_CLASSES, errorFromBody,
} = fencer;

const GATEWAY = process.env.FENCER_GATEWAY ?? 'http://127.0.0.1:8080';
const client = new FencerClient();

/** A key no other test uses (tests share one fencer dev). */
const fresh = (name) => `node:${name}:${randomUUID().slice(0, 8)}`;
const kvPath = (key) => `/kv/clients/${key.replaceAll(':', '-')}`;
const json = (value) => ({ headers: { 'content-type': 'application/json' }, body: JSON.stringify(value) });

/** A client whose renewals hang (a stalled network) until `unblock()`. */
class BlockedRenew extends FencerClient {
  #gate = Promise.withResolvers?.() ?? (() => { let resolve; const promise = new Promise((r) => { resolve = r; }); return { promise, resolve }; })();
  unblock() { this.#gate.resolve(); }
  async renew(lease, options) {
    await this.#gate.promise;
    return super.renew(lease, options);
  }
}

test('acquire is refused after waitMs, then waits for a release', async () => {
  const key = fresh('acquire');
  const first = await client.acquire(key, { ttlMs: 5000 });
  assert.ok(first.token > 0 && first.leaseId && first.fencingToken);
  const started = performance.now();
  const refused = await client.acquire(key, { waitMs: 200 }).catch((e) => e);
  assert.ok(refused instanceof LockHeldError, String(refused));
  assert.ok(performance.now() - started >= 190);
  assert.equal(refused.status, 409);
  assert.equal(refused.body.key, key);

  setTimeout(() => client.release(first), 300);
  const second = await client.acquire(key, { ttlMs: 5000, waitMs: 5000 });
  assert.ok(second.token > first.token);
  const renewed = await client.renew(second, { ttlMs: 5000 });
  assert.equal(renewed.token, second.token);
  await client.release(second);
  await assert.rejects(client.release(second), LeaseLostError);
});

test('a hold stream releases the lock when closed', async () => {
  const key = fresh('hold');
  const stream = await client.hold(key, { ttlMs: 2000 });
  const seen = [];
  for await (const event of stream) {
    seen.push(event);
    if (event.type === 'heartbeat') break;
  }
  assert.deepEqual(seen.map((e) => e.type), ['acquired', 'heartbeat']);
  const after = await client.acquire(key, { waitMs: 2000 });
  assert.ok(after.token > seen[0].token);
  await client.release(after);
});

test('withLock releases on exit, and on a throw', async () => {
  const key = fresh('with');
  const token = await client.withLock(key, async (held) => {
    assert.equal((await client.status(key)).state, 'held');
    await assert.rejects(client.acquire(key, { waitMs: 0 }), LockHeldError);
    return held.lease.token;
  }, { ttlMs: 5000 });
  const again = await client.acquire(key, { waitMs: 0 });
  assert.ok(again.token > token);
  await client.release(again);

  await assert.rejects(client.withLock(key, () => { throw new Error('boom'); }), /boom/);
  await client.release(await client.acquire(key, { waitMs: 0 }));
});

test('await using / asyncDispose releases', async () => {
  const key = fresh('dispose');
  const held = await client.lock(key, { ttlMs: 5000 });
  await held[Symbol.asyncDispose]();
  await held.release(); // a second release does nothing
  await client.release(await client.acquire(key, { waitMs: 0 }));
});

test('keep-alive holds the lease past its TTL', async () => {
  const key = fresh('keepalive');
  await client.withLock(key, async (held) => {
    const token = held.lease.token;
    // Three TTLs. A TTL of 1 s leaves a renewal (sent every 333 ms) 667 ms
    // to come back: 300 ms lost leases on a loaded CI machine.
    await sleep(3000);
    held.check();
    assert.equal((await client.status(key)).state, 'held');
    await assert.rejects(client.acquire(key, { waitMs: 0 }), LockHeldError);
    assert.equal(held.lease.token, token);
    assert.ok(!held.signal.aborted);
  }, { ttlMs: 1000 });
});

test('a lease released by another party is lost at once: signal aborts, withLock rejects', async () => {
  const key = fresh('stolen');
  let lost = null;
  let signal = null;
  const started = performance.now();
  const result = client.withLock(key, async (held) => {
    signal = held.signal;
    // Someone else with the lease id releases it: the next renewal is refused.
    await new FencerClient().release(held.lease);
    // withLock must not wait for this; the lease's signal stops it.
    await sleep(5000, undefined, { signal: held.signal });
    return 'finished';
  }, { ttlMs: 600, onLost: (err) => { lost = err; } });
  const err = await result.catch((e) => e);
  assert.ok(err instanceof LeaseLostError, String(err));
  assert.ok(performance.now() - started < 2000);
  assert.equal(lost, err);
  assert.ok(signal.aborted);
  assert.equal(signal.reason, err);
});

test('a hung renewal loses the lease at its deadline', async () => {
  const key = fresh('hung');
  const blocked = new BlockedRenew();
  let lostAt = 0;
  const held = await blocked.lock(key, { ttlMs: 300, onLost: () => { lostAt = performance.now(); } });
  const started = performance.now();
  try {
    await new Promise((resolve) => held.signal.addEventListener('abort', resolve, { once: true }));
    // The renewal hangs until the test ends: aborted at all means the
    // watchdog did not wait for it; within a few TTLs (loaded CI machines).
    assert.ok(lostAt - started < 1500, `lost after ${lostAt - started} ms`);
    assert.equal(held.lost.reason, 'deadline');
    assert.throws(() => held.check(), LeaseLostError);
    await assert.rejects(held.fetch('/kv/clients/never', { method: 'PUT', ...json({ v: 1 }) }), LeaseLostError);
    await assert.rejects(held.release(), LeaseLostError);
  } finally {
    blocked.unblock();
  }
});

test('a proxied write is accepted; a stale one is refused with the typed error', async () => {
  const key = fresh('stale');
  const path = kvPath(key);
  const old = await client.withLock(key, async (held) => {
    const res = await held.fetch(path, { method: 'PUT', ...json({ by: 'old' }) });
    assert.equal(res.status, 200);
    return held.lease;
  }, { ttlMs: 5000 });
  await client.withLock(key, async (held) => {
    assert.equal((await held.fetch(path, { method: 'PUT', ...json({ by: 'new' }) })).status, 200);
    // The old lease through the proxy: refused there, never forwarded.
    const viaProxy = fencedFetch(old, { baseUrl: client.proxy });
    await assert.rejects(viaProxy(path, { method: 'PUT', ...json({ by: 'old' }) }), LeaseLostError);
    // The old signed token straight at the gateway: a newer one was seen.
    const direct = fencedFetch(old, { baseUrl: GATEWAY, direct: true });
    const err = await direct(path, { method: 'PUT', ...json({ by: 'old' }) }).catch((e) => e);
    assert.ok(err instanceof StaleFencingTokenError, String(err));
    assert.equal(err.status, 409);
    assert.ok(err.body.highest_seen >= held.lease.token);
    const read = await held.fetch(path);
    assert.deepEqual((await read.json()).value, { by: 'new' });
    // The storage's own 404 is not a fencer error.
    assert.equal((await held.fetch(`${path}-missing`)).status, 404);
    // Nor is its own `invalid_request` (a body that is not JSON), although
    // the proxy and the gateway use that code too: only fencer's refusals
    // carry the Fencing-Error header.
    const own = await held.fetch(path, { method: 'PUT', headers: { 'content-type': 'application/json' }, body: 'not json' });
    assert.equal(own.status, 400);
    assert.equal((await own.json()).error, 'invalid_request');
    assert.equal(own.headers.get('fencing-error'), null);
  }, { ttlMs: 5000 });
});

test('every error code fencer answers has its class', (t) => {
  const codes = JSON.parse(process.env.FENCER_ERROR_CODES || '[]');
  if (codes.length === 0) return t.skip('FENCER_ERROR_CODES not set (tests/clients.rs sets it)');
  const missing = codes.filter((c) => !Object.hasOwn(ERROR_CLASSES, c));
  assert.deepEqual(missing, [], 'error codes fencer answers that fencer-client lacks');
  for (const code of codes) {
    const err = errorFromBody(409, { error: code, message: 'm' });
    assert.equal(err.constructor, ERROR_CLASSES[code]);
    assert.notEqual(err.constructor, FencerError);
    assert.equal(err.code, code);
    assert.equal(fencer[err.constructor.name], err.constructor, `${err.constructor.name} is exported`);
  }
  const unknown = errorFromBody(418, { error: 'from_the_future', message: 'm' });
  assert.equal(unknown.constructor, FencerError);
  assert.equal(unknown.code, 'from_the_future');
});

test('every code of the proxy and gateway is a fenced code', (t) => {
  const codes = JSON.parse(process.env.FENCER_FENCED_CODES || '[]');
  if (codes.length === 0) return t.skip('FENCER_FENCED_CODES not set (tests/clients.rs sets it)');
  assert.deepEqual(codes.filter((c) => !fencer.FENCED_CODES.has(c)), []);
  assert.deepEqual([...fencer.FENCED_CODES].filter((c) => !Object.hasOwn(ERROR_CLASSES, c)), []);
});

test('live answers map to their classes', async () => {
  const bad = await client.acquire(fresh('bad'), { ttlMs: 1 }).catch((e) => e);
  assert.ok(bad instanceof InvalidRequestError, String(bad));
  assert.equal(bad.body.field, 'ttl_ms');
  await assert.rejects(client.status(fresh('nobody')), NotFoundError);
  const never = new fencer.Lease({ token: 1, lease_id: randomUUID().replaceAll('-', ''), ttl_ms: 1000 }, performance.now(), fresh('never'));
  await assert.rejects(fencedFetch(never, { baseUrl: client.proxy })('/kv/clients/never', { method: 'PUT', ...json({ v: 1 }) }), LockNotHeldError);
  await assert.rejects(new FencerClient({ api: 'http://127.0.0.1:9' }).acquire(fresh('nowhere')), TransportError);
});

test('a reentrant lease counts holds; the backend view sees it', async () => {
  const key = fresh('reentrant');
  const first = await client.acquire(key, { ttlMs: 5000, owner: 'job', reentrant: true });
  const again = await client.acquire(key, { ttlMs: 5000, owner: 'job', reentrant: true });
  assert.equal(again.leaseId, first.leaseId);
  assert.equal(again.token, first.token);
  const view = await client.backendStatus(key);
  assert.deepEqual([view.state, view.token, view.held_here], ['held', first.token, true]);
  assert.equal(await client.release(first), 1);
  assert.equal(await client.release(first), undefined);
  assert.equal((await client.backendStatus(key)).state, 'free');
});

test('read leases share the key and never write', async () => {
  const key = fresh('rw');
  const one = await client.acquire(key, { ttlMs: 5000, mode: 'read' });
  const two = await client.acquire(key, { ttlMs: 5000, mode: 'read' });
  assert.equal(one.raw.mode, 'read');
  assert.ok(two.token > one.token);
  await assert.rejects(client.acquire(key, { ttlMs: 5000, waitMs: 0 }), LockHeldError);
  const put = fencedFetch(one, { baseUrl: client.proxy });
  await assert.rejects(put(`/kv/clients/${key.replaceAll(':', '-')}`, { method: 'PUT', ...json({ by: 'reader' }) }), fencer.ReadLeaseError);
  await client.release(one);
  await client.release(two);
  const writer = await client.acquire(key, { ttlMs: 5000, waitMs: 0 });
  assert.ok(writer.token > two.token);
  await client.release(writer);
});

test('a multi-key lease takes every key or none', async () => {
  const a = fresh('multi');
  const b = fresh('multi');
  const held = await client.acquireMany([b, a], { ttlMs: 5000 });
  assert.deepEqual(held.keys.map((k) => k.key), [a, b].sort());
  await assert.rejects(client.acquire(a, { ttlMs: 5000, waitMs: 0 }), fencer.LockHeldError);
  assert.ok((await client.renewMany(held.lease_id, { ttlMs: 8000 })).remaining_ms > 5000);
  assert.deepEqual(await client.releaseMany(held.lease_id), [a, b].sort());
  const other = await client.acquire(a, { ttlMs: 5000, waitMs: 0 });
  await assert.rejects(client.acquireMany([a, b], { ttlMs: 5000, waitMs: 0 }), fencer.LockHeldError);
  await client.release(await client.acquire(b, { ttlMs: 5000, waitMs: 0 }));
  await client.release(other);
});

test('semaphore permits are leases on slot keys', async () => {
  const name = fresh('pool');
  const one = await client.acquirePermit(name, 2, { ttlMs: 5000 });
  const two = await client.acquirePermit(name, 2, { ttlMs: 5000 });
  assert.deepEqual(new Set([one.raw.slot, two.raw.slot]), new Set([0, 1]));
  assert.equal(one.key, `${name}#${one.raw.slot}`);
  await assert.rejects(client.acquirePermit(name, 2, { ttlMs: 5000, waitMs: 0 }), fencer.LockHeldError);
  await assert.rejects(client.acquirePermit(name, 3, { ttlMs: 5000, waitMs: 0 }), (e) =>
    e instanceof fencer.PermitsMismatchError && e.body.permits === 2);
  await client.renew(one);
  assert.equal(await client.release(one), undefined);
  const three = await client.acquirePermit(name, 2, { ttlMs: 5000, waitMs: 0 });
  assert.equal(three.raw.slot, one.raw.slot);
  assert.ok(three.token > one.token);
  await client.release(two);
  await client.release(three);
});
