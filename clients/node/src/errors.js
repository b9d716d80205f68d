/**
 * Typed errors: one class per error code fencer's lock API, egress proxy and
 * gateway answer with (`{"error": code, "message": text, ...}`). Code branches
 * on the class (`err instanceof LockHeldError`) instead of comparing strings;
 * a code this library does not know still arrives as a `FencerError` with its
 * `code`, so a newer sidecar never breaks an older client.
 * @module
 */

/** An error answer of fencer: HTTP `status`, `code` (the `error` field), `message` and the whole JSON `body`. */
export class FencerError extends Error {
  /** @param {number} status @param {string} code @param {string} message @param {Record<string, unknown>} [body] */
  constructor(status, code, message, body = {}) {
    super(`${status} ${code}: ${message}`);
    this.name = new.target.name;
    /** HTTP status (0: no answer arrived). */
    this.status = status;
    /** The `error` field of the answer. */
    this.code = code;
    /** The whole JSON answer (extra fields such as `key`, `field`, `highest_seen`). */
    this.body = body;
  }
}

/** The sidecar could not be reached, or answered something that is not fencer JSON (status 0: no answer at all). Whether the request was applied is unknown. */
export class TransportError extends FencerError {}

/** 400: a field is out of range or malformed; `body.field` names it. */
export class InvalidRequestError extends FencerError {}
InvalidRequestError.code = 'invalid_request';

/** 400: the TTL asked for exceeds the sidecar's maximum (`body.max_ttl_ms`). */
export class TtlTooLongError extends FencerError {}
TtlTooLongError.code = 'ttl_too_long';

/** 413: the request body is larger than the sidecar accepts (16 KiB). */
export class PayloadTooLargeError extends FencerError {}
PayloadTooLargeError.code = 'payload_too_large';

/** 404: this sidecar holds no lease on the key. */
export class NotFoundError extends FencerError {}
NotFoundError.code = 'not_found';

/** 405: the route does not take this HTTP method. */
export class MethodNotAllowedError extends FencerError {}
MethodNotAllowedError.code = 'method_not_allowed';

/** 409: another lease still held the lock when `waitMs` ran out. */
export class LockHeldError extends FencerError {}
LockHeldError.code = 'lock_held';

/** 409: nobody holds the lock, but its last lease expired without a release and the key stays closed for the sidecar's lock-delay; `retryAfterMs` says for how much longer. A `LockHeldError`, so code that checks for that keeps working. */
export class LockDelayedError extends LockHeldError {
  /** @returns {number | undefined} */
  get retryAfterMs() {
    return typeof this.body.retry_after_ms === 'number' ? this.body.retry_after_ms : undefined;
  }
}
LockDelayedError.code = 'lock_delayed';

/** 409: the lease no longer holds its lock (expired, released or lost): stop the work it protects. Also raised by this library (status 0) when a kept-alive lease was not renewed before its deadline; `reason` says why. */
export class LeaseLostError extends FencerError {
  /** @param {number} status @param {string} code @param {string} message @param {Record<string, unknown>} [body] @param {string} [reason] */
  constructor(status, code, message, body = {}, reason = undefined) {
    super(status, code, message, body);
    /** Why the lease ended: `lease_lost`, `not_owner`, `max_hold_reached`, `deadline`, ... */
    this.reason = reason ?? (typeof body.reason === 'string' ? body.reason : code);
  }
}
LeaseLostError.code = 'lease_lost';

/** 409: another lease holds the key and this one never held it here. */
export class NotOwnerError extends FencerError {}
NotOwnerError.code = 'not_owner';

/** 409: the lease reached `sidecar.max_hold_ms` and cannot be renewed. */
export class MaxHoldReachedError extends FencerError {}
MaxHoldReachedError.code = 'max_hold_reached';

/** 429: the key's wait queue is full; retry later. */
export class TooManyWaitersError extends FencerError {}
TooManyWaitersError.code = 'too_many_waiters';

/** 429: the sidecar holds as many leases as it may. */
export class TooManyLeasesError extends FencerError {}
TooManyLeasesError.code = 'too_many_leases';

/** 400: the lock type asked for (`body.feature`) is not kept by the sidecar's backend (`body.backend`). */
export class UnsupportedByBackendError extends FencerError {}
UnsupportedByBackendError.code = 'unsupported_by_backend';

/** 409: a reentrant lease already counts the most holds one lease may (`body.max_holds`). */
/** 409: the semaphore's permit count was fixed at its first use, at another count (`body.permits`). */
export class PermitsMismatchError extends FencerError {}
PermitsMismatchError.code = 'permits_mismatch';

export class TooManyHoldsError extends FencerError {}
TooManyHoldsError.code = 'too_many_holds';

/** 429: too many backend views (`GET /v1/locks/{key}?scope=backend`) from this sidecar; `body.retry_after_ms` says when to ask again. */
export class RateLimitedError extends FencerError {}
RateLimitedError.code = 'rate_limited';

/** 400: `scope=backend` is off on this sidecar (`sidecar.backend_view_per_second = 0`). */
export class ViewOffError extends FencerError {}
ViewOffError.code = 'view_off';

/** 503: the lock backend did not answer; nothing was taken. */
export class BackendUnavailableError extends FencerError {}
BackendUnavailableError.code = 'backend_unavailable';

/** 503: the lock backend refused the operation (e.g. a read-only replica). */
export class BackendRefusedError extends FencerError {}
BackendRefusedError.code = 'backend_refused';

/** 503: the backend could not confirm the write on enough replicas. */
export class NotReplicatedError extends FencerError {}
NotReplicatedError.code = 'not_replicated';

/** 503: pre-registration could not reach the gateway; the lease was released. */
export class GatewayUnavailableError extends FencerError {}
GatewayUnavailableError.code = 'gateway_unavailable';

/** 503: the gateway has seen a higher token than the one minted (`body.highest_seen`); the sidecar repairs forward: retry. */
export class TokenBehindGatewayError extends FencerError {}
TokenBehindGatewayError.code = 'token_behind_gateway';

/** 503: the minted token is implausibly far above the gateway's mark. */
export class TokenJumpError extends FencerError {}
TokenJumpError.code = 'token_jump';

/** 503: the lease ran out before its answer could be sent; it was released. */
export class LeaseExpiredBeforeAnswerError extends FencerError {}
LeaseExpiredBeforeAnswerError.code = 'lease_expired_before_answer';

/** 503: the sidecar is shutting down. */
export class ShuttingDownError extends FencerError {}
ShuttingDownError.code = 'shutting_down';

/** 500: a sidecar task that should have answered did not. */
export class InternalError extends FencerError {}
InternalError.code = 'internal_error';

/** 400: the Dapr-compatible API was called with an unknown lock store. */
export class LockStoreNotFoundError extends FencerError {}
LockStoreNotFoundError.code = 'lock_store_not_found';

/** 404: no lease is held now through that Dapr lock store by that owner (`POST /v1/dapr/{store}/lease`). */
export class LeaseNotFoundError extends FencerError {}
LeaseNotFoundError.code = 'lease_not_found';

/** 503 (500 on Dapr's health routes): the sidecar cannot serve yet — backend unreachable, starting or stopping. */
export class NotReadyError extends FencerError {}
NotReadyError.code = 'not_ready';

/** 428: the proxy requires `Fencing-Lease` on requests that name a lock. */
export class LeaseRequiredError extends FencerError {}
LeaseRequiredError.code = 'lease_required';

/** 428: the request names a lock (or lease) this sidecar does not hold. */
export class LockNotHeldError extends FencerError {}
LockNotHeldError.code = 'lock_not_held';

/** 503: the previous request under this lease has not been answered yet. */
export class LeaseBusyError extends FencerError {}
LeaseBusyError.code = 'lease_busy';

/** 400: a `Fencing-*` header was sent twice. */
export class DuplicateFencingHeaderError extends FencerError {}
DuplicateFencingHeaderError.code = 'duplicate_fencing_header';

/** 502: the upstream could not be reached or failed mid-response; a write may or may not have landed. */
export class UpstreamError extends FencerError {}
UpstreamError.code = 'upstream_error';

/** 504: the upstream did not answer in time; a write may have landed. */
export class UpstreamTimeoutError extends FencerError {}
UpstreamTimeoutError.code = 'upstream_timeout';

/** 428: a write reached the gateway without a fencing token. */
export class FencingTokenRequiredError extends FencerError {}
FencingTokenRequiredError.code = 'fencing_token_required';

/** 403: the token's signature, key or range does not verify. */
export class InvalidFencingTokenError extends FencerError {}
InvalidFencingTokenError.code = 'invalid_fencing_token';

/** 403: the path maps to no lock key in the gateway's routes. */
export class PathNotRoutedError extends FencerError {}
PathNotRoutedError.code = 'path_not_routed';

/** 409: a higher token was already accepted for the key (`body.highest_seen`): a newer holder has written; this write was not applied. */
export class StaleFencingTokenError extends FencerError {}
StaleFencingTokenError.code = 'stale_fencing_token';

/** 409: the lease's write sequence went back (a delayed write). */
/** 409: a write under a read lease (a read-write lock's reader). */
export class ReadLeaseError extends FencerError {}
ReadLeaseError.code = 'read_lease';

export class StaleSequenceError extends FencerError {}
StaleSequenceError.code = 'stale_sequence';

/** 409: the lease's write sequence repeats with a different request. */
export class DuplicateSequenceError extends FencerError {}
DuplicateSequenceError.code = 'duplicate_sequence';

/** 503: the key stayed busy with another fenced request too long. */
export class FenceBusyError extends FencerError {}
FenceBusyError.code = 'fence_busy';

/** 503: the gateway's fence store is unreachable; not forwarded. */
export class FenceStoreUnavailableError extends FencerError {}
FenceStoreUnavailableError.code = 'fence_store_unavailable';

/**
 * Every error code this library knows, mapped to its class.
 * @type {Readonly<Record<string, typeof FencerError>>}
 */
export const ERROR_CLASSES = Object.freeze(Object.fromEntries(
  [InvalidRequestError, TtlTooLongError, PayloadTooLargeError, NotFoundError, MethodNotAllowedError, LockHeldError, LockDelayedError, LeaseLostError, NotOwnerError, MaxHoldReachedError, TooManyWaitersError, TooManyLeasesError, UnsupportedByBackendError, PermitsMismatchError, TooManyHoldsError, RateLimitedError, ViewOffError, BackendUnavailableError, BackendRefusedError, NotReplicatedError, GatewayUnavailableError, TokenBehindGatewayError, TokenJumpError, LeaseExpiredBeforeAnswerError, ShuttingDownError, InternalError, LockStoreNotFoundError, LeaseNotFoundError, NotReadyError, LeaseRequiredError, LockNotHeldError, LeaseBusyError, DuplicateFencingHeaderError, UpstreamError, UpstreamTimeoutError, FencingTokenRequiredError, InvalidFencingTokenError, PathNotRoutedError, StaleFencingTokenError, ReadLeaseError, StaleSequenceError, DuplicateSequenceError, FenceBusyError, FenceStoreUnavailableError].map((cls) => [cls.code, cls]),
));

/**
 * The codes the egress proxy and the gateway answer with themselves (each
 * has its class). A fenced request's answer is recognised as fencer's
 * refusal by its `Fencing-Error` header, not by its code: the storage's own
 * answers pass through unchanged, and may say `{"error": "invalid_request"}`.
 * @type {ReadonlySet<string>}
 */
export const FENCED_CODES = Object.freeze(new Set([
  'lease_required', 'lock_not_held', 'lease_lost', 'lease_busy', 'duplicate_fencing_header',
  'invalid_request', 'internal_error', 'method_not_allowed', 'upstream_error', 'upstream_timeout',
  'fencing_token_required', 'invalid_fencing_token', 'path_not_routed', 'stale_fencing_token',
  'stale_sequence', 'duplicate_sequence', 'fence_busy', 'fence_store_unavailable', 'read_lease',
]));

/**
 * The typed error for an error answer (`status`, decoded JSON `body`): the class of its code, or `FencerError` for a code this library does not know.
 * @param {number} status
 * @param {unknown} body
 * @returns {FencerError}
 */
export function errorFromBody(status, body) {
  if (body === null || typeof body !== 'object' || typeof body.error !== 'string') {
    return new TransportError(status, 'unexpected_answer', `not a fencer error answer: ${JSON.stringify(body)}`.slice(0, 300));
  }
  const Cls = Object.hasOwn(ERROR_CLASSES, body.error) ? ERROR_CLASSES[body.error] : FencerError;
  return new Cls(status, body.error, String(body.message ?? ''), body);
}
