// Types of fencer-client (hand-written; checked by `tsc --noEmit --strict` in tests/clients.rs).

/** The lock API when neither an address nor `$FENCER_API` is given. */
export const DEFAULT_API: string;
/** The egress proxy when neither an address nor `$FENCER_PROXY` is given. */
export const DEFAULT_PROXY: string;

/** Options of `FencerClient.acquire`. */
export interface AcquireOptions {
  /** Lease TTL in ms (100-3 600 000; default: the sidecar's). */
  ttlMs?: number;
  /** How long to wait in the key's FIFO queue, in ms (0-300 000). */
  waitMs?: number;
  /** Free text shown in the sidecar's listings. */
  owner?: string;
  /** The sidecar renews while this process shows activity within `keepaliveMs`. */
  autoRenew?: boolean;
  /** Only with `autoRenew`. */
  keepaliveMs?: number;
  /** With `owner`: the owner holding the key here takes it again (the same lease, one more hold). */
  reentrant?: boolean;
  /** `read`: a read lease of a read-write lock, shared with other readers; its token reads and never writes (`ReadLeaseError`). Default `write`. */
  mode?: 'read' | 'write';
  /** Aborts the acquire (e.g. a long wait). */
  signal?: AbortSignal;
}

/** Options of `FencerClient.lock` and `withLock`. */
export interface LockOptions {
  /** Lease TTL in ms (default 10 000); renewed at a third of it. */
  ttlMs?: number;
  /** How long to wait in the key's FIFO queue, in ms. */
  waitMs?: number;
  /** Free text shown in the sidecar's listings. */
  owner?: string;
  /** Called once when the lease is lost. */
  onLost?: (err: LeaseLostError) => void;
  /** Aborts the acquire. */
  signal?: AbortSignal;
}

/** Options of `fencedFetch`. */
export interface FencedFetchOptions {
  /** Relative URLs are joined to it (the proxy). */
  baseUrl?: string;
  /** Send `Fencing-Token` (straight to the gateway) instead of `Fencing-Lease`. */
  direct?: boolean;
  /** Throw the typed error for a refusal by fencer (default true). */
  raiseErrors?: boolean;
  /** The `fetch` to wrap (default: the global one). */
  fetch?: typeof fetch;
}

/** A hold-stream event. */
export interface HoldEvent {
  type: 'acquired' | 'heartbeat' | 'lost' | 'released';
  [field: string]: unknown;
}

/** A lock held by this application: what an acquire or renew answered. */
export class Lease {
  constructor(answer: Record<string, any>, sentAt: number, key: string, leaseId?: string);
  /** The lock's key. */
  readonly key: string;
  /** The fencing token: strictly increases per key. */
  readonly token: number;
  /** The signed token the gateway checks. */
  readonly fencingToken: string;
  /** The lease id: a credential, send it only to your own sidecar. */
  readonly leaseId: string;
  /** Time the lease had left when the answer went out. */
  readonly ttlMs: number;
  /** `performance.now()` past which the lease must be taken as lost. */
  readonly deadline: number;
  /** The whole answer. */
  readonly raw: Record<string, any>;
  /** Milliseconds left until `deadline`. */
  readonly remainingMs: number;
  /** The header that binds a proxied request to this lease. */
  readonly headers: { 'Fencing-Lease': string };
}

/** A client of one sidecar's lock API and egress proxy. */
export class FencerClient {
  constructor(options?: { api?: string; proxy?: string; timeoutMs?: number });
  /** The lock API's base URL. */
  readonly api: string;
  /** The egress proxy's base URL. */
  readonly proxy: string;
  /** How long a call waits for its answer (plus its own `waitMs`). */
  readonly timeoutMs: number;
  /** Takes the lock, waiting up to `waitMs`; rejects with `LockHeldError` if still held. */
  acquire(key: string, options?: AcquireOptions): Promise<Lease>;
  /** Takes one of `permits` permits of semaphore `name` (a lease on the lock key `name#slot`: renew, release and keepalive take it as any lease); rejects with `LockHeldError` if all stay held, `PermitsMismatchError` if the name's count is another. */
  acquirePermit(name: string, permits: number, options?: Omit<AcquireOptions, 'reentrant' | 'mode'>): Promise<Lease>;
  /** Takes every key or none under one lease id (keys in byte order); rejects with `LockHeldError` if one stays held (every key taken is given back). */
  acquireMany(keys: string[], options?: Omit<AcquireOptions, 'reentrant' | 'mode'>): Promise<{ lease_id: string; keys: { key: string; token: number; fencing_token: string; remaining_ms: number }[]; ttl_ms: number; remaining_ms: number }>;
  /** Renews every key of a multi-key lease. */
  renewMany(leaseId: string, options?: { ttlMs?: number; signal?: AbortSignal }): Promise<Record<string, any>>;
  /** Releases every key of a multi-key lease; resolves to the keys. */
  releaseMany(leaseId: string): Promise<string[]>;
  /** Extends the lease; rejects with `LeaseLostError` if it no longer holds. */
  renew(lease: Lease, options?: { ttlMs?: number; signal?: AbortSignal }): Promise<Lease>;
  /** Gives the lock up (a reentrant lease: one hold; resolves to the holds left, `undefined` once free); rejects with `LeaseLostError` if it was already gone. */
  release(lease: Lease): Promise<number | undefined>;
  /** What the backend records for `key`, whichever sidecar's lease holds it (rate-limited). */
  backendStatus(key: string): Promise<Record<string, any>>;
  /** "I am alive" for an `autoRenew` lease. */
  keepalive(lease: Lease): Promise<void>;
  /** This sidecar's lease on `key`; rejects with `NotFoundError` if none. */
  status(key: string): Promise<Record<string, any>>;
  /** This sidecar's leases. */
  leases(options?: { limit?: number }): Promise<{ leases: Record<string, any>[]; count: number; total: number; truncated: boolean }>;
  /** Holds the lock as long as the stream is open. */
  hold(key: string, options?: { ttlMs?: number; waitMs?: number; owner?: string }): Promise<HoldStream>;
  /** A lock renewed in the background; see `HeldLock`. */
  lock(key: string, options?: LockOptions): Promise<HeldLock>;
  /** Runs `fn` under the lock, releasing it afterwards; rejects with `LeaseLostError` on loss. */
  withLock<T>(key: string, fn: (held: HeldLock) => Promise<T> | T, options?: LockOptions): Promise<T>;
}

/** The events of a hold stream; closing it releases the lock. */
export class HoldStream implements AsyncIterable<HoldEvent> {
  [Symbol.asyncIterator](): AsyncIterator<HoldEvent>;
  /** Closes the stream: the sidecar releases the lock at once. */
  close(): void;
  [Symbol.asyncDispose](): Promise<void>;
}

/** A lock held through `FencerClient.lock` / `withLock`, renewed in the background. */
export class HeldLock {
  /** Acquires the lock and starts keeping it alive. */
  static start(client: FencerClient, key: string, options?: LockOptions): Promise<HeldLock>;
  private constructor();
  /** The client that holds it. */
  readonly client: FencerClient;
  /** The current lease. */
  readonly lease: Lease;
  /** The `LeaseLostError` once the lease is lost, else `null`. */
  readonly lost: LeaseLostError | null;
  /** The lock's key. */
  readonly key: string;
  /** Aborts (reason: the `LeaseLostError`) when the lease is lost. */
  readonly signal: AbortSignal;
  /** `{'Fencing-Lease': leaseId}`, after `check()`. */
  readonly headers: Record<string, string>;
  /** Throws the `LeaseLostError` if the lease is lost. */
  check(): void;
  /** `fetch` through the proxy under this lease. */
  fetch(input: string | URL | Request, init?: RequestInit): Promise<Response>;
  /** Stops renewing and releases; throws `LeaseLostError` if it was lost. */
  release(): Promise<void>;
  [Symbol.asyncDispose](): Promise<void>;
}

/** The headers that bind a request to a lease (or a held lock, checked first). */
export function fencingHeaders(source: Lease | HeldLock, options?: { direct?: boolean }): Record<string, string>;
/** The typed error if `response` is a refusal by fencer, else `null`. */
/** The header fencer's proxy and gateway put on their own refusals (`fencing-error`). */
export const REFUSAL_HEADER: string;
export function fencerError(response: Response): Promise<FencerError | null>;
/** A `fetch` bound to a lease. */
export function fencedFetch(source: Lease | HeldLock, options?: FencedFetchOptions): (input: string | URL | Request, init?: RequestInit) => Promise<Response>;
/** The typed error for an error `Response` (its body is read). */
export function errorFromResponse(response: Response): Promise<FencerError>;

/** An error answer of fencer: HTTP `status`, `code` (the `error` field), `message` and the whole JSON `body`. */
export class FencerError extends Error {
  constructor(status: number, code: string, message: string, body?: Record<string, unknown>);
  /** HTTP status (0: no answer arrived). */
  status: number;
  /** The `error` field of the answer. */
  code: string;
  /** The whole JSON answer (extra fields such as `key`, `field`, `highest_seen`). */
  body: Record<string, unknown>;
  /** The `Response` it came from, for errors thrown by `fencedFetch`. */
  response?: Response;
  /** The error code a subclass stands for. */
  static readonly code?: string;
}
/** The sidecar could not be reached, or answered something that is not fencer JSON (status 0: no answer at all). */
export class TransportError extends FencerError {}
/** 400: a field is out of range or malformed; `body.field` names it. */
export class InvalidRequestError extends FencerError {}
/** 400: the TTL asked for exceeds the sidecar's maximum (`body.max_ttl_ms`). */
export class TtlTooLongError extends FencerError {}
/** 413: the request body is larger than the sidecar accepts (16 KiB). */
export class PayloadTooLargeError extends FencerError {}
/** 404: this sidecar holds no lease on the key. */
export class NotFoundError extends FencerError {}
/** 405: the route does not take this HTTP method. */
export class MethodNotAllowedError extends FencerError {}
/** 409: another lease still held the lock when `waitMs` ran out. */
export class LockHeldError extends FencerError {}
/** 409: nobody holds the lock, but its last lease expired without a release and the key stays closed for the sidecar's lock-delay. */
export class LockDelayedError extends LockHeldError {
  /** How long the lock-delay lasts still (`retry_after_ms`). */
  readonly retryAfterMs: number | undefined;
}
/** 409: the lease no longer holds its lock (expired, released or lost): stop the work it protects. Also raised by this library (status 0) when a kept-alive lease was not renewed before its deadline; `reason` says why. */
export class LeaseLostError extends FencerError {
  constructor(status: number, code: string, message: string, body?: Record<string, unknown>, reason?: string);
  /** Why the lease ended: `lease_lost`, `not_owner`, `max_hold_reached`, `deadline`, ... */
  reason: string;
}
/** 409: another lease holds the key and this one never held it here. */
export class NotOwnerError extends FencerError {}
/** 409: the lease reached `sidecar.max_hold_ms` and cannot be renewed. */
export class MaxHoldReachedError extends FencerError {}
/** 429: the key's wait queue is full; retry later. */
export class TooManyWaitersError extends FencerError {}
/** 429: the sidecar holds as many leases as it may. */
export class TooManyLeasesError extends FencerError {}
/** 400: the lock type asked for is not kept by the sidecar's backend. */
export class UnsupportedByBackendError extends FencerError {}
/** 409: a reentrant lease already counts the most holds one lease may. */
/** 409: the semaphore's permit count was fixed at another count (`body.permits`). */
export class PermitsMismatchError extends FencerError {}
export class TooManyHoldsError extends FencerError {}
/** 429: too many backend views from this sidecar; `body.retry_after_ms` says when to ask again. */
export class RateLimitedError extends FencerError {}
/** 400: `scope=backend` is off on this sidecar. */
export class ViewOffError extends FencerError {}
/** 503: the lock backend did not answer; nothing was taken. */
export class BackendUnavailableError extends FencerError {}
/** 503: the lock backend refused the operation (e.g. a read-only replica). */
export class BackendRefusedError extends FencerError {}
/** 503: the backend could not confirm the write on enough replicas. */
export class NotReplicatedError extends FencerError {}
/** 503: pre-registration could not reach the gateway; the lease was released. */
export class GatewayUnavailableError extends FencerError {}
/** 503: the gateway has seen a higher token than the one minted (`body.highest_seen`); the sidecar repairs forward: retry. */
export class TokenBehindGatewayError extends FencerError {}
/** 503: the minted token is implausibly far above the gateway's mark. */
export class TokenJumpError extends FencerError {}
/** 503: the lease ran out before its answer could be sent; it was released. */
export class LeaseExpiredBeforeAnswerError extends FencerError {}
/** 503: the sidecar is shutting down. */
export class ShuttingDownError extends FencerError {}
/** 500: a sidecar task that should have answered did not. */
export class InternalError extends FencerError {}
/** 400: the Dapr-compatible API was called with an unknown lock store. */
export class LockStoreNotFoundError extends FencerError {}
/** 404: no lease is held now through that Dapr lock store by that owner. */
export class LeaseNotFoundError extends FencerError {}
/** 503 (500 on Dapr's health routes): the sidecar cannot serve yet. */
export class NotReadyError extends FencerError {}
/** 428: the proxy requires `Fencing-Lease` on requests that name a lock. */
export class LeaseRequiredError extends FencerError {}
/** 428: the request names a lock (or lease) this sidecar does not hold. */
export class LockNotHeldError extends FencerError {}
/** 503: the previous request under this lease has not been answered yet. */
export class LeaseBusyError extends FencerError {}
/** 400: a `Fencing-*` header was sent twice. */
export class DuplicateFencingHeaderError extends FencerError {}
/** 502: the upstream could not be reached or failed mid-response; a write may or may not have landed. */
export class UpstreamError extends FencerError {}
/** 504: the upstream did not answer in time; a write may have landed. */
export class UpstreamTimeoutError extends FencerError {}
/** 428: a write reached the gateway without a fencing token. */
export class FencingTokenRequiredError extends FencerError {}
/** 403: the token's signature, key or range does not verify. */
export class InvalidFencingTokenError extends FencerError {}
/** 403: the path maps to no lock key in the gateway's routes. */
export class PathNotRoutedError extends FencerError {}
/** 409: a higher token was already accepted for the key (`body.highest_seen`): a newer holder has written; this write was not applied. */
export class StaleFencingTokenError extends FencerError {}
/** 409: the lease's write sequence went back (a delayed write). */
/** 409: a write under a read lease: its token reads, never writes. */
export class ReadLeaseError extends FencerError {}
export class StaleSequenceError extends FencerError {}
/** 409: the lease's write sequence repeats with a different request. */
export class DuplicateSequenceError extends FencerError {}
/** 503: the key stayed busy with another fenced request too long. */
export class FenceBusyError extends FencerError {}
/** 503: the gateway's fence store is unreachable; not forwarded. */
export class FenceStoreUnavailableError extends FencerError {}
/** Every error code this library knows, mapped to its class. */
export const ERROR_CLASSES: Readonly<Record<string, typeof FencerError>>;
/** The codes the egress proxy and the gateway answer with themselves (a fenced answer is fencer's refusal only with one of these). */
export const FENCED_CODES: ReadonlySet<string>;
/** The typed error for an error answer: the class of its code, or `FencerError` for an unknown code. */
export function errorFromBody(status: number, body: unknown): FencerError;
