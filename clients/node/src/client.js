/**
 * The lock API client: acquire, renew, release, keepalive, status, hold.
 * @module
 */
import { FencerError, TransportError, errorFromBody } from './errors.js';
import { HeldLock } from './held.js';
import { Lease } from './lease.js';

/** The lock API when neither an address nor `$FENCER_API` is given. */
export const DEFAULT_API = 'http://127.0.0.1:7411';
/** The egress proxy when neither an address nor `$FENCER_PROXY` is given. */
export const DEFAULT_PROXY = 'http://127.0.0.1:7412';

// Added to a call's own wait (waitMs) before the client gives up on the
// answer: the sidecar answers within waitMs plus a backend round trip.
const ANSWER_MARGIN_MS = 10_000;

/**
 * A client of one sidecar's lock API (`api`, default `$FENCER_API` or
 * `http://127.0.0.1:7411`) and egress proxy (`proxy`, default
 * `$FENCER_PROXY` or `http://127.0.0.1:7412`). Holds no state besides them.
 */
export class FencerClient {
  /** @param {{api?: string, proxy?: string, timeoutMs?: number}} [options] */
  constructor({ api, proxy, timeoutMs = 30_000 } = {}) {
    /** The lock API's base URL. */
    this.api = (api || process.env.FENCER_API || DEFAULT_API).replace(/\/+$/, '');
    /** The egress proxy's base URL. */
    this.proxy = (proxy || process.env.FENCER_PROXY || DEFAULT_PROXY).replace(/\/+$/, '');
    /** How long a call waits for its answer (plus its own `waitMs`). */
    this.timeoutMs = timeoutMs;
  }

  /**
   * Takes the lock on `key` for `ttlMs`, waiting up to `waitMs` in the key's
   * FIFO queue; rejects with `LockHeldError` if it is still held then. With
   * `autoRenew` the *sidecar* renews while this process calls `keepalive`
   * (or sends proxied requests) within `keepaliveMs`; see `lock` for renewal
   * done by this client.
   * @param {string} key
   * @param {import('./index.js').AcquireOptions} [options]
   * @returns {Promise<Lease>}
   */
  async acquire(key, { ttlMs, waitMs, owner, autoRenew, keepaliveMs, reentrant, mode, signal } = {}) {
    const body = {};
    if (ttlMs !== undefined) body.ttl_ms = ttlMs;
    if (waitMs !== undefined) body.wait_ms = waitMs;
    if (owner !== undefined) body.owner = owner;
    if (autoRenew) body.auto_renew = true;
    if (keepaliveMs !== undefined) body.keepalive_ms = keepaliveMs;
    if (reentrant) body.reentrant = true;
    if (mode !== undefined && mode !== 'write') body.mode = mode;
    const sentAt = performance.now();
    const answer = await this.#call('POST', path(key, 'acquire'), body, { waitMs, signal });
    return new Lease(answer, sentAt, key);
  }

  /**
   * Takes one of the `permits` permits of semaphore `name`, waiting up to
   * `waitMs` for one to be freed; rejects with `LockHeldError` if all stay
   * held, `PermitsMismatchError` if the name's count is another. The permit
   * is a lease on the lock key `name#slot` (`lease.key`, `lease.raw.slot`):
   * `renew`, `release` and `keepalive` take it as any lease.
   * @param {string} name
   * @param {number} permits
   * @param {import('./index.js').AcquireOptions} [options]
   * @returns {Promise<Lease>}
   */
  async acquirePermit(name, permits, { ttlMs, waitMs, owner, autoRenew, keepaliveMs, signal } = {}) {
    const body = { permits };
    if (ttlMs !== undefined) body.ttl_ms = ttlMs;
    if (waitMs !== undefined) body.wait_ms = waitMs;
    if (owner !== undefined) body.owner = owner;
    if (autoRenew) body.auto_renew = true;
    if (keepaliveMs !== undefined) body.keepalive_ms = keepaliveMs;
    const sentAt = performance.now();
    const answer = await this.#call('POST', `/v1/semaphores/${encodeURIComponent(name)}/acquire`, body, { waitMs, signal });
    return new Lease(answer, sentAt, answer.key);
  }

  /**
   * Takes every key of `keys` or none, under one lease id (keys taken in
   * byte order: two such calls never deadlock); rejects with
   * `LockHeldError` if one is still held after `waitMs` (every key taken is
   * given back). Resolves to the answer: `lease_id`, `keys` (each `key`,
   * `token`, `fencing_token`, `remaining_ms`), `remaining_ms`.
   * @param {string[]} keys
   * @param {import('./index.js').AcquireOptions} [options]
   * @returns {Promise<Record<string, any>>}
   */
  async acquireMany(keys, { ttlMs, waitMs, owner, autoRenew, keepaliveMs, signal } = {}) {
    const body = { keys: [...keys] };
    if (ttlMs !== undefined) body.ttl_ms = ttlMs;
    if (waitMs !== undefined) body.wait_ms = waitMs;
    if (owner !== undefined) body.owner = owner;
    if (autoRenew) body.auto_renew = true;
    if (keepaliveMs !== undefined) body.keepalive_ms = keepaliveMs;
    return this.#call('POST', '/v1/locks/acquire', body, { waitMs, signal });
  }

  /**
   * Renews every key of a multi-key lease; rejects with `LeaseLostError`
   * naming the first key found gone.
   * @param {string} leaseId
   * @param {{ttlMs?: number, signal?: AbortSignal}} [options]
   * @returns {Promise<Record<string, any>>}
   */
  async renewMany(leaseId, { ttlMs, signal } = {}) {
    const body = { lease_id: leaseId };
    if (ttlMs !== undefined) body.ttl_ms = ttlMs;
    return this.#call('POST', '/v1/locks/renew', body, { signal });
  }

  /**
   * Releases every key of a multi-key lease; resolves to the keys.
   * @param {string} leaseId
   * @returns {Promise<string[]>}
   */
  async releaseMany(leaseId) {
    const answer = await this.#call('POST', '/v1/locks/release', { lease_id: leaseId });
    return answer.keys;
  }

  /**
   * Extends `lease` by `ttlMs` (default: its own TTL); resolves to the
   * renewed lease. Rejects with `LeaseLostError` if it no longer holds.
   * @param {Lease} lease
   * @param {{ttlMs?: number, signal?: AbortSignal}} [options]
   * @returns {Promise<Lease>}
   */
  async renew(lease, { ttlMs, signal } = {}) {
    const body = { lease_id: lease.leaseId };
    if (ttlMs !== undefined) body.ttl_ms = ttlMs;
    const sentAt = performance.now();
    const answer = await this.#call('POST', path(lease.key, 'renew'), body, { signal });
    return new Lease(answer, sentAt, lease.key, lease.leaseId);
  }

  /**
   * Gives the lock up — or, for a reentrant lease, one hold: resolves to the
   * holds left (`undefined` once the key is free). Rejects with
   * `LeaseLostError` if it was already gone (the work done under it may have
   * raced a newer holder).
   * @param {Lease} lease
   * @returns {Promise<number | undefined>}
   */
  async release(lease) {
    const answer = await this.#call('POST', path(lease.key, 'release'), { lease_id: lease.leaseId });
    return answer && answer.released === false ? answer.holds : undefined;
  }

  /**
   * What the backend records for `key`, whichever sidecar's lease holds it
   * (`state`: held, read, free, delayed or split; `token`, `lease_tag`,
   * `remaining_ms`...). Rate-limited by the sidecar (`RateLimitedError`).
   * @param {string} key
   * @returns {Promise<Record<string, unknown>>}
   */
  async backendStatus(key) {
    return this.#call('GET', `${path(key)}?scope=backend`);
  }

  /**
   * Tells the sidecar this process is alive, for a lease acquired with
   * `autoRenew`. Rejects with `LeaseLostError` once it is gone.
   * @param {Lease} lease
   * @returns {Promise<void>}
   */
  async keepalive(lease) {
    await this.#call('POST', path(lease.key, 'keepalive'), { lease_id: lease.leaseId });
  }

  /**
   * This sidecar's lease on `key` (`state`: `held` or `lost`); rejects with
   * `NotFoundError` if it has none.
   * @param {string} key
   * @returns {Promise<Record<string, any>>}
   */
  status(key) {
    return this.#call('GET', path(key));
  }

  /**
   * This sidecar's leases: `{leases, count, total, truncated}`.
   * @param {{limit?: number}} [options]
   * @returns {Promise<Record<string, any>>}
   */
  leases({ limit = 1000 } = {}) {
    return this.#call('GET', `/v1/locks?limit=${Number(limit)}`);
  }

  /**
   * Holds the lock for as long as the returned stream is open: iterate its
   * events (`{type: 'acquired' | 'heartbeat' | 'lost' | 'released', ...}`)
   * with `for await`; leaving the loop (or `close()`, or this process dying)
   * closes the connection, and the sidecar releases the lock at once.
   * @param {string} key
   * @param {{ttlMs?: number, waitMs?: number, owner?: string}} [options]
   * @returns {Promise<HoldStream>}
   */
  async hold(key, { ttlMs, waitMs, owner } = {}) {
    const body = {};
    if (ttlMs !== undefined) body.ttl_ms = ttlMs;
    if (waitMs !== undefined) body.wait_ms = waitMs;
    if (owner !== undefined) body.owner = owner;
    const controller = new AbortController();
    const response = await this.#send('POST', path(key, 'hold'), body, { waitMs, signal: controller.signal, stream: true });
    return new HoldStream(response, controller, this.timeoutMs);
  }

  /**
   * A lock kept alive by this client while it is held (renewed at a third of
   * `ttlMs`). On loss `held.signal` aborts with a `LeaseLostError`,
   * `onLost(err)` is called, and `held.check()`, `held.fetch()` and
   * `held.release()` throw it. Use `await using held = await client.lock(k)`
   * or call `held.release()` in a `finally`; or see `withLock`.
   * @param {string} key
   * @param {import('./index.js').LockOptions} [options]
   * @returns {Promise<HeldLock>}
   */
  async lock(key, options = {}) {
    return HeldLock.start(this, key, options);
  }

  /**
   * Runs `fn(held)` under the lock and releases it afterwards; resolves to
   * what `fn` resolved to. Rejects with `LeaseLostError` as soon as the
   * lease is lost (`held.signal` aborts too, so `fn`'s fetches stop).
   * @template T
   * @param {string} key
   * @param {(held: HeldLock) => Promise<T> | T} fn
   * @param {import('./index.js').LockOptions} [options]
   * @returns {Promise<T>}
   */
  async withLock(key, fn, options = {}) {
    const held = await this.lock(key, options);
    const lost = new Promise((_, reject) => {
      held.signal.addEventListener('abort', () => reject(held.signal.reason), { once: true });
    });
    lost.catch(() => {});
    let result;
    try {
      result = await Promise.race([Promise.resolve().then(() => fn(held)), lost]);
    } catch (err) {
      if (held.lost) throw held.lost;
      await held.release().catch(() => {});
      throw err;
    }
    await held.release();
    return result;
  }

  async #send(method, urlPath, body, { waitMs, signal, stream = false } = {}) {
    const timeout = AbortSignal.timeout(this.timeoutMs + (waitMs ?? 0));
    const signals = signal ? [signal, timeout] : [timeout];
    let response;
    try {
      response = await fetch(this.api + urlPath, {
        method,
        headers: body === undefined ? {} : { 'content-type': 'application/json' },
        body: body === undefined ? undefined : JSON.stringify(body),
        // A hold stream lives as long as its caller wants: only its own signal ends it.
        signal: stream ? signal : AbortSignal.any(signals),
      });
    } catch (err) {
      if (signal?.aborted) throw signal.reason;
      throw new TransportError(0, 'transport_error', `${method} ${this.api}${urlPath}: ${err.cause?.message ?? err.message}`);
    }
    if (!response.ok) throw await errorFromResponse(response);
    return response;
  }

  async #call(method, urlPath, body, options) {
    const response = await this.#send(method, urlPath, body, options);
    const text = await response.text();
    try {
      return JSON.parse(text);
    } catch {
      throw new TransportError(response.status, 'unexpected_answer', text.slice(0, 300));
    }
  }
}

/**
 * The typed error for an error `Response` (its body is read).
 * @param {Response} response
 * @returns {Promise<FencerError>}
 */
export async function errorFromResponse(response) {
  const text = await response.text();
  let body;
  try {
    body = JSON.parse(text);
  } catch {
    return new TransportError(response.status, 'unexpected_answer', text.slice(0, 300));
  }
  return errorFromBody(response.status, body);
}

function path(key, action) {
  const base = `/v1/locks/${encodeURIComponent(key)}`;
  return action ? `${base}/${action}` : base;
}

/**
 * The events of a hold stream (see `FencerClient.hold`): an async iterable
 * of JSON objects; closing it releases the lock.
 */
export class HoldStream {
  /**
   * @param {Response} response
   * @param {AbortController} controller
   * @param {number} silenceMs heartbeats arrive every second: silence this long means the sidecar is gone
   */
  constructor(response, controller, silenceMs) {
    this.#response = response;
    this.#controller = controller;
    this.#silenceMs = silenceMs;
  }

  #response;
  #controller;
  #silenceMs;

  /** Yields each event; leaving the loop closes the stream. */
  async *[Symbol.asyncIterator]() {
    const decoder = new TextDecoder();
    let buffered = '';
    let silence;
    const watch = () => {
      clearTimeout(silence);
      silence = setTimeout(() => this.#controller.abort(
        new TransportError(0, 'transport_error', `hold stream silent for ${this.#silenceMs} ms`)), this.#silenceMs);
    };
    try {
      watch();
      for await (const chunk of this.#response.body) {
        watch();
        buffered += decoder.decode(chunk, { stream: true });
        let newline;
        while ((newline = buffered.indexOf('\n')) >= 0) {
          const line = buffered.slice(0, newline).trim();
          buffered = buffered.slice(newline + 1);
          if (line) yield JSON.parse(line);
        }
      }
    } catch (err) {
      throw this.#controller.signal.reason instanceof TransportError ? this.#controller.signal.reason : err;
    } finally {
      clearTimeout(silence);
      this.close();
    }
  }

  /** Closes the stream: the sidecar releases the lock at once. */
  close() {
    this.#controller.abort();
  }

  /** `await using stream = await client.hold(key)` closes it at the end of the block. */
  async [Symbol.asyncDispose]() {
    this.close();
  }
}

export { FencerError, Lease };
