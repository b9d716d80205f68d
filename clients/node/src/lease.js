/**
 * A lease: what an acquire or renew answered.
 * @module
 */

/**
 * A lock held by this application: what an acquire or renew answered.
 * `deadline` is on `performance.now()`'s clock, counted from when the request
 * was *sent* (a late answer never stretches it): past it, assume the lock is
 * gone even if nobody said so.
 */
export class Lease {
  /**
   * @param {Record<string, any>} answer the sidecar's JSON answer
   * @param {number} sentAt `performance.now()` when the request went out
   * @param {string} key
   * @param {string} [leaseId] for a renew answer without one
   */
  constructor(answer, sentAt, key, leaseId = '') {
    /** The lock's key. */
    this.key = answer.key ?? key;
    /** The fencing token: strictly increases per key. */
    this.token = Number(answer.token);
    /** The signed token the gateway checks. */
    this.fencingToken = answer.fencing_token ?? '';
    /** The lease id: a credential, send it only to your own sidecar. */
    this.leaseId = answer.lease_id ?? leaseId;
    /** Time the lease had left when the answer went out. */
    this.ttlMs = Number(answer.ttl_ms ?? answer.remaining_ms ?? 0);
    /** `performance.now()` past which the lease must be taken as lost. */
    this.deadline = sentAt + this.ttlMs;
    /** The whole answer. */
    this.raw = answer;
  }

  /** Milliseconds left until `deadline` (0 once passed). */
  get remainingMs() {
    return Math.max(0, Math.floor(this.deadline - performance.now()));
  }

  /** The header that binds a proxied request to this lease. */
  get headers() {
    return { 'Fencing-Lease': this.leaseId };
  }
}
