// Compiled by `tsc --noEmit --strict` in tests/clients.rs: the hand-written
// types must describe what a TypeScript user writes.
import {
  FencerClient, HeldLock, Lease, LeaseLostError, LockHeldError, StaleFencingTokenError,
  ERROR_CLASSES, FencerError, fencedFetch, errorFromBody,
} from 'fencer-client';

async function use(): Promise<number> {
  const client = new FencerClient({ api: 'http://127.0.0.1:7411' });
  const lease: Lease = await client.acquire('k', { ttlMs: 1000, waitMs: 10 });
  const renewed: Lease = await client.renew(lease, { ttlMs: 1000 });
  const permit: Lease = await client.acquirePermit('pool', 4, { ttlMs: 1000, autoRenew: true });
  await client.release(permit);
  const many = await client.acquireMany(['a', 'b'], { ttlMs: 1000 });
  const first: number = many.keys[0].token;
  await client.renewMany(many.lease_id, { ttlMs: 2000 });
  const freed: string[] = await client.releaseMany(many.lease_id);
  console.log(first, freed.length);
  await client.release(renewed);
  const token: number = await client.withLock('k', async (held: HeldLock) => {
    held.check();
    const signal: AbortSignal = held.signal;
    const res: Response = await held.fetch('/kv/x', { method: 'PUT', body: '{}', signal });
    return held.lease.token + res.status;
  }, { ttlMs: 3000, onLost: (err: LeaseLostError) => console.log(err.reason) });
  const held = await client.lock('k');
  await held[Symbol.asyncDispose]();
  const stream = await client.hold('k', { ttlMs: 1000 });
  for await (const event of stream) {
    if (event.type === 'heartbeat') break;
  }
  const send = fencedFetch(lease, { baseUrl: client.proxy, direct: true });
  try {
    await send('/kv/x');
  } catch (err) {
    if (err instanceof StaleFencingTokenError || err instanceof LockHeldError) return err.status;
    if (err instanceof FencerError) return err.body.highest_seen as number;
  }
  const cls: typeof FencerError | undefined = ERROR_CLASSES['lease_lost'];
  const e: FencerError = errorFromBody(409, { error: 'lease_lost', message: 'm' });
  return token + (cls ? 1 : 0) + e.status;
}
void use;
