/**
 * A lock kept alive in the background, that tells its holder when it is lost.
 *
 * Two timers per held lock, because a renewal can hang (a stalled network, a
 * paused sidecar) and the holder must still learn of the loss at the lease's
 * deadline, not whenever the hung call returns:
 * - the renewer renews at a third of the TTL; a final refusal (`lease_lost`,
 *   `not_owner`, `max_hold_reached`) loses the lease at once; any other
 *   failure is retried every tenth of the TTL (10-200 ms) until the deadline;
 * - the watchdog fires at the current deadline and, if no renewal moved it,
 *   declares the lease lost.
 * The deadline is counted from when a renew was *sent*, so a late answer
 * never stretches it past what the sidecar granted. The timers keep the
 * process alive while the lock is held, as any ongoing work does: release it
 * (`withLock` and `await using` do).
 * @module
 */
import { LeaseLostError, MaxHoldReachedError, NotOwnerError } from './errors.js';
import { fencedFetch, fencingHeaders } from './fetch.js';

/** A lock held through `FencerClient.lock` / `withLock`, renewed in the background. */
export class HeldLock {
  /**
   * Acquires the lock and starts keeping it alive (what `client.lock` does).
   * @param {import('./client.js').FencerClient} client
   * @param {string} key
   * @param {import('./index.js').LockOptions} [options]
   * @returns {Promise<HeldLock>}
   */
  static async start(client, key, { ttlMs = 10_000, waitMs, owner, onLost, signal } = {}) {
    if (!(ttlMs >= 100)) throw new RangeError('ttlMs must be at least 100');
    const lease = await client.acquire(key, { ttlMs, waitMs, owner, signal });
    const held = new HeldLock(client, lease, ttlMs, onLost);
    held.#renewLater(ttlMs / 3);
    held.#armWatchdog();
    return held;
  }

  /** @private use `HeldLock.start` or `client.lock` */
  constructor(client, lease, ttlMs, onLost) {
    /** The client that holds it. */
    this.client = client;
    /** The current lease (token and fencing token stay the same across renewals). */
    this.lease = lease;
    /** The `LeaseLostError` once the lease is lost, else `null`. */
    this.lost = null;
    this.#ttlMs = ttlMs;
    this.#onLost = onLost;
  }

  #ttlMs;
  #onLost;
  #controller = new AbortController();
  #inflight = new AbortController();
  #renewTimer = undefined;
  #watchdog = undefined;
  #closing = false;
  #released = false;

  /** The lock's key. */
  get key() {
    return this.lease.key;
  }

  /** Aborts (with the `LeaseLostError` as its reason) when the lease is lost: pass it to the work the lock protects. */
  get signal() {
    return this.#controller.signal;
  }

  /** Throws the `LeaseLostError` if the lease is lost (or its deadline passed, even before the watchdog fired). */
  check() {
    if (!this.lost && performance.now() >= this.lease.deadline) this.#lose(this.#deadlineError());
    if (this.lost) throw this.lost;
  }

  /** `{'Fencing-Lease': leaseId}`, after `check()`. */
  get headers() {
    return fencingHeaders(this);
  }

  /**
   * `fetch` through the egress proxy under this lease: relative URLs go to
   * the proxy; throws `LeaseLostError` before sending once the lease is lost,
   * aborts a request in flight when it is lost, and throws the typed error
   * for a refusal by fencer's proxy or gateway.
   * @param {string | URL | Request} input
   * @param {RequestInit} [init]
   * @returns {Promise<Response>}
   */
  fetch(input, init) {
    return fencedFetch(this, { baseUrl: this.client.proxy })(input, init);
  }

  /**
   * Stops renewing and releases the lock (once: later calls do nothing). Throws the `LeaseLostError` if the
   * lease was lost (the work done under it may have raced a newer holder).
   * @returns {Promise<void>}
   */
  async release() {
    this.#stop();
    this.check();
    if (this.#released) return;
    try {
      await this.client.release(this.lease);
    } catch (err) {
      if (err instanceof LeaseLostError) this.lost = err;
      throw err;
    }
    this.#released = true;
  }

  /** `await using held = await client.lock(key)`: released at the end of the block (throws if lost). */
  [Symbol.asyncDispose]() {
    return this.release();
  }

  #stop() {
    this.#closing = true;
    clearTimeout(this.#renewTimer);
    clearTimeout(this.#watchdog);
    this.#inflight.abort();
  }

  #deadlineError() {
    return new LeaseLostError(0, 'lease_lost', `lease on ${this.key} not renewed before its deadline`, { key: this.key }, 'deadline');
  }

  #lose(err) {
    if (this.lost || this.#closing) return;
    this.lost = err;
    this.#stop();
    this.#closing = false; // stopped by the loss, not by the holder
    this.#controller.abort(err);
    if (this.#onLost) {
      try {
        this.#onLost(err);
      } catch (callbackErr) {
        console.error(`fencer-client: onLost for ${this.key} threw`, callbackErr);
      }
    }
  }

  #renewLater(ms) {
    this.#renewTimer = setTimeout(() => this.#renew(), Math.max(0, ms));
  }

  async #renew() {
    const lease = this.lease;
    // Never wait for an answer past the deadline: the watchdog decides then.
    const left = Math.max(1, Math.ceil(lease.deadline - performance.now()));
    try {
      const signal = AbortSignal.any([this.#inflight.signal, AbortSignal.timeout(left)]);
      const renewed = await this.client.renew(lease, { ttlMs: this.#ttlMs, signal });
      if (this.#closing || this.lost) return;
      this.lease = renewed;
      this.#armWatchdog();
      this.#renewLater(this.#ttlMs / 3);
    } catch (err) {
      if (this.#closing || this.lost) return;
      if (err instanceof LeaseLostError) return this.#lose(err);
      if (err instanceof NotOwnerError || err instanceof MaxHoldReachedError) {
        return this.#lose(new LeaseLostError(err.status, 'lease_lost', err.message, err.body, err.code));
      }
      const retry = Math.min(200, Math.max(10, this.#ttlMs / 10));
      this.#renewLater(Math.min(retry, lease.deadline - performance.now()));
    }
  }

  #armWatchdog() {
    clearTimeout(this.#watchdog);
    this.#watchdog = setTimeout(() => {
      if (performance.now() >= this.lease.deadline) this.#lose(this.#deadlineError());
      else this.#armWatchdog();
    }, Math.max(0, this.lease.deadline - performance.now()));
  }
}
