/**
 * Client for the fencer sidecar: distributed locks with fencing tokens.
 *
 * ```js
 * import { FencerClient } from 'fencer-client';
 * const client = new FencerClient();            // $FENCER_API, $FENCER_PROXY
 * await client.withLock('account:1', async (held) => {
 *   await held.fetch('/kv/account/1', { method: 'PUT', body: JSON.stringify({ balance: 100 }) });
 * }, { ttlMs: 10_000, waitMs: 5_000 });
 * ```
 * See docs/clients.md in fencer's repository.
 * @module
 */
export { DEFAULT_API, DEFAULT_PROXY, FencerClient, HoldStream, errorFromResponse } from './client.js';
export * from './errors.js';
export { REFUSAL_HEADER, fencedFetch, fencerError, fencingHeaders } from './fetch.js';
export { HeldLock } from './held.js';
export { Lease } from './lease.js';
