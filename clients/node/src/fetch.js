/**
 * Fenced `fetch`: requests sent through the egress proxy under a lease.
 *
 * Every request carries `Fencing-Lease: <leaseId>` so the proxy stamps the
 * lease's signed token on it, and refuses it (409 `lease_lost`) once the lease
 * is gone instead of forwarding it. A refusal by the proxy or the gateway
 * throws its typed error; the storage's own answers, errors included, are
 * returned unchanged.
 * @module
 */
import { errorFromBody } from './errors.js';

/**
 * The header fencer's proxy and gateway put on their own refusals, naming the
 * code; the gateway strips it from every storage answer.
 */
export const REFUSAL_HEADER = 'fencing-error';
import { Lease } from './lease.js';

/**
 * The headers that bind a request to `source` (a `Lease`, or a `HeldLock`,
 * which is checked first and throws `LeaseLostError` once lost). `direct`:
 * `Fencing-Token` with the signed token, for a request sent straight to the
 * gateway instead of through the proxy.
 * @param {Lease | import('./held.js').HeldLock} source
 * @param {{direct?: boolean}} [options]
 * @returns {Record<string, string>}
 */
export function fencingHeaders(source, { direct = false } = {}) {
  let lease = source;
  if (!(source instanceof Lease)) {
    source.check();
    lease = source.lease;
  }
  return direct ? { 'Fencing-Token': lease.fencingToken } : { 'Fencing-Lease': lease.leaseId };
}

/**
 * The typed error if `response` is a refusal by fencer's proxy or gateway
 * (marked by its `Fencing-Error` header, which must name the body's code),
 * else `null`: the storage's own answer, errors included — a storage may
 * answer `{"error": "invalid_request"}` itself.
 * Reads a clone: the response's body stays readable.
 * @param {Response} response
 * @returns {Promise<import('./errors.js').FencerError | null>}
 */
export async function fencerError(response) {
  const refusal = response.headers.get(REFUSAL_HEADER);
  if (response.status < 400 || !refusal || !(response.headers.get('content-type') ?? '').includes('json')) return null;
  let body;
  try {
    body = JSON.parse(await response.clone().text());
  } catch {
    return null;
  }
  if (body === null || typeof body !== 'object' || body.error !== refusal) return null;
  const err = errorFromBody(response.status, body);
  err.response = response;
  return err;
}

/**
 * A `fetch` bound to a lease (see `fencingHeaders`): relative URLs are joined
 * to `baseUrl` (the proxy); with a `HeldLock` the request is aborted when
 * the lease is lost; a refusal by fencer throws its typed error unless
 * `raiseErrors` is false.
 * @param {Lease | import('./held.js').HeldLock} source
 * @param {import('./index.js').FencedFetchOptions} [options]
 * @returns {(input: string | URL | Request, init?: RequestInit) => Promise<Response>}
 */
export function fencedFetch(source, { baseUrl, direct = false, raiseErrors = true, fetch: send = globalThis.fetch } = {}) {
  return async (input, init = {}) => {
    const headers = new Headers(init.headers);
    for (const [name, value] of Object.entries(fencingHeaders(source, { direct }))) headers.set(name, value);
    const url = typeof input === 'string' && baseUrl && !/^[a-z][a-z0-9+.-]*:/i.test(input)
      ? `${baseUrl.replace(/\/+$/, '')}/${input.replace(/^\/+/, '')}`
      : input;
    const signals = [init.signal, source instanceof Lease ? undefined : source.signal].filter(Boolean);
    const response = await send(url, {
      ...init,
      headers,
      signal: signals.length > 1 ? AbortSignal.any(signals) : signals[0],
    });
    if (raiseErrors) {
      const err = await fencerError(response);
      if (err) throw err;
    }
    return response;
  };
}
