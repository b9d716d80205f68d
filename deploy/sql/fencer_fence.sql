-- fencer_fence.sql — fencing-token check inside your own PostgreSQL writes.
--
-- WHY
--   A lock from fencer can be lost without its holder knowing (a GC pause,
--   a network partition, a lease that expired while the process was
--   stopped). Every acquisition therefore carries a fencing token that
--   strictly increases per lock key. Storage that remembers the highest
--   token it has seen per key can refuse writes from a holder that has
--   been overtaken.
--
--   The fencer gateway does this for writes that go through it. If your
--   application writes to PostgreSQL directly, load this file and call
--   fencer_fence() inside the same transaction as your data change. The
--   token check and your write then commit or roll back together: the check
--   is part of the storage's own atomic write. There is no window between
--   "check" and "write" in which a newer holder could slip in, because
--
--     * fencer_fence() locks the key's row in fencer_fences (FOR UPDATE)
--       and that row lock is held until YOUR transaction commits or rolls
--       back — it even rewrites the row when it accepts the same token
--       again, so a REPEATABLE READ / SERIALIZABLE transaction that started
--       before an earlier holder's commit fails with 40001 instead of
--       building on a stale snapshot;
--     * if fencer_fence() rejects the token it raises an error, which aborts
--       your transaction: nothing you wrote in it, before or after the
--       call, can commit (even a blind COMMIT then only rolls back).
--
-- WHAT IT TRUSTS
--   Only tokens signed by a fencer sidecar: pass the `fencing_token` string
--   of the acquire response (v2.<key id>.<token>.<lease tag>.<key>.<HMAC>),
--   not a bare number. The HMAC-SHA256 is verified here, against the
--   secrets in fencer_signing_keys (the same secrets the gateway has), so a
--   caller cannot push an invented or inflated number into the mark the
--   gateway shares — one call with 2^63-1 used to lock the key out for good.
--   fencer_signing_keys is readable by no one but the function's owner:
--   fencer_fence() runs as SECURITY DEFINER. Grant your application role
--   EXECUTE on fencer_fence(text, text) and nothing on the two tables.
--
--     INSERT INTO fencer_signing_keys (key_id, secret)
--     VALUES ('k1', convert_to('<the signing secret>', 'UTF8'));
--
-- SEMANTICS of fencer_fence(p_fencing_token text, p_key text DEFAULT NULL)
--   * token signature, key id or format not valid, or p_key given and not
--     the token's key                -> ERROR, SQLSTATE 23F02,
--                                       MESSAGE 'invalid_fencing_token'
--   * a request forwarded by the fencer gateway is in flight on the key
--                                    -> ERROR, SQLSTATE 55P03 (lock_not_available):
--                                       retry; the gateway's write may still land
--   * no row for the key yet         -> store the token and its lease, return the token
--   * token >  stored token          -> store it (the lease's write sequence
--                                       restarts), return the token
--   * token =  stored token, same lease
--                                    -> accept (the same holder writing again),
--                                       return the token
--   * otherwise (an older token, or the same token from another lease)
--                                    -> ERROR, SQLSTATE 23F01,
--                                       MESSAGE 'stale_fencing_token'
--   * NULL token                     -> ERROR, SQLSTATE 22004 (null_value_not_allowed)
--   * token 0                        -> ERROR, SQLSTATE 22023 (invalid_parameter_value)
--
--   23F01 and 23F02 are in class 23 (integrity constraint violation) with
--   subcodes PostgreSQL itself does not use, so clients can match them
--   exactly, and generic code that treats class 23 as "your write was
--   refused, do not retry blindly" does the right thing.
--
-- HOW TO USE IT
--   1. Call fencer_fence() FIRST in the transaction, before you read
--      anything your write depends on. From then on your transaction holds
--      the key's row lock, so (in READ COMMITTED) every later statement
--      sees all data committed by earlier holders, and no other holder of
--      the same key gets past fencer_fence() until you finish.
--   2. Do your reads and writes.
--   3. COMMIT. On SQLSTATE 23F01, do not retry with the same token: your
--      lease has lost its lock; acquire the lock again (a new token) first.
--      On 40001 (REPEATABLE READ / SERIALIZABLE) or 55P03, retry the whole
--      transaction.
--
--   Example (psql; the token string comes from fencer's acquire reply):
--
--     BEGIN;
--     SELECT fencer_fence('v2.k1.2051.Xq3…', 'accounts/42');
--     UPDATE accounts SET balance = balance - 10 WHERE id = 42;
--     COMMIT;
--
-- NOTES
--   * One row per lock key, in the table the fencer gateway also uses, so
--     writes fenced here and through the gateway share one high-water mark;
--     the row's lease_id holds the lease's *tag* (a one-way digest of the
--     lease id), as the gateway's does.
--   * Keep fenced transactions short: the row lock makes the gateway's
--     requests for the same key wait for them (up to its
--     postgres_request_timeout_ms, then 503).
--   * This file is idempotent: load it again to upgrade. The tables and
--     functions are created in the first schema on your search_path; the
--     function pins that search_path.
--   * The earlier, unsigned fencer_fence(text, bigint, text) is dropped.

CREATE TABLE IF NOT EXISTS fencer_fences (
  key        text PRIMARY KEY,
  token      bigint NOT NULL,
  lease_id   text NOT NULL DEFAULT '',
  -- The gateway's per-lease write sequence (Fencing-Seq); a new token
  -- starts its lease's sequence afresh, so an advance here resets it.
  seq        bigint NOT NULL DEFAULT 0,
  updated_at timestamptz NOT NULL DEFAULT now(),
  -- The gateway's in-flight stamp: a forwarded request on the key whose
  -- outcome is not known yet.
  inflight_id    text,
  inflight_until timestamptz,
  wake       boolean NOT NULL DEFAULT false
);
ALTER TABLE fencer_fences ADD COLUMN IF NOT EXISTS seq bigint NOT NULL DEFAULT 0;
ALTER TABLE fencer_fences ADD COLUMN IF NOT EXISTS inflight_id text;
ALTER TABLE fencer_fences ADD COLUMN IF NOT EXISTS inflight_until timestamptz;
ALTER TABLE fencer_fences ADD COLUMN IF NOT EXISTS wake boolean NOT NULL DEFAULT false;
-- The highest read lease's token the gateway admitted (read-write locks):
-- a writer's token must be above it too.
ALTER TABLE fencer_fences ADD COLUMN IF NOT EXISTS read_token bigint NOT NULL DEFAULT 0;

CREATE TABLE IF NOT EXISTS fencer_signing_keys (
  key_id text PRIMARY KEY,
  secret bytea NOT NULL CHECK (length(secret) >= 32),
  -- Lock keys this key may sign, by prefix (as the gateway's
  -- [[gateway.keys]] key_prefixes); NULL or empty: any key.
  key_prefixes text[]
);
ALTER TABLE fencer_signing_keys ADD COLUMN IF NOT EXISTS key_prefixes text[];
REVOKE ALL ON fencer_signing_keys FROM PUBLIC;

DROP FUNCTION IF EXISTS fencer_fence(text, bigint, text);

-- HMAC-SHA256 (RFC 2104) on PostgreSQL's built-in sha256(): no extension.
CREATE OR REPLACE FUNCTION fencer_hmac_sha256(p_key bytea, p_msg bytea)
RETURNS bytea LANGUAGE plpgsql IMMUTABLE STRICT AS $fn$
DECLARE
  k bytea := p_key;
  ipad bytea;
  opad bytea;
BEGIN
  IF length(k) > 64 THEN
    k := sha256(k);
  END IF;
  k := k || decode(repeat('00', 64 - length(k)), 'hex');
  ipad := k;
  opad := k;
  FOR i IN 0..63 LOOP
    ipad := set_byte(ipad, i, get_byte(k, i) # 54);  -- 0x36
    opad := set_byte(opad, i, get_byte(k, i) # 92);  -- 0x5c
  END LOOP;
  RETURN sha256(opad || sha256(ipad || p_msg));
END
$fn$;

CREATE OR REPLACE FUNCTION fencer_b64url_decode(p text)
RETURNS bytea LANGUAGE sql IMMUTABLE STRICT AS $fn$
  SELECT decode(translate(p, '-_', '+/') || repeat('=', (4 - length(p) % 4) % 4), 'base64')
$fn$;

-- The lease tag of a lease id (what v2 tokens carry instead of the id).
CREATE OR REPLACE FUNCTION fencer_lease_tag(p_lease_id text)
RETURNS text LANGUAGE sql IMMUTABLE STRICT AS $fn$
  SELECT translate(rtrim(encode(substring(sha256(convert_to('fencer-lease-tag:' || p_lease_id, 'UTF8'))
                                          FROM 1 FOR 12), 'base64'), '='), '+/', '-_')
$fn$;

CREATE OR REPLACE FUNCTION fencer_fence(p_fencing_token text, p_key text DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path FROM CURRENT
AS $fencer_fence$
DECLARE
  parts   text[];
  v_token bigint;
  v_key   text;
  v_lease text;
  v_sig   bytea;
  v_secret bytea;
  v_prefixes text[];
  v_msg   bytea := ''::bytea;
  part    text;
  f       record;
BEGIN
  IF p_fencing_token IS NULL THEN
    RAISE EXCEPTION USING ERRCODE = '22004',
      MESSAGE = 'fencer_fence: the fencing token must not be NULL';
  END IF;
  parts := string_to_array(p_fencing_token, '.');
  IF parts[1] = 'v3' THEN
    RAISE EXCEPTION USING ERRCODE = '23F02', MESSAGE = 'invalid_fencing_token',
      DETAIL = 'a read lease''s token (v3): a read-write lock''s reader may read, never write';
  END IF;
  IF coalesce(array_length(parts, 1), 0) <> 6
     OR parts[1] NOT IN ('v1', 'v2')
     OR parts[3] !~ '^[0-9]{1,19}$'
     OR parts[4] !~ '^[A-Za-z0-9_-]{1,64}$'
     OR parts[5] !~ '^[A-Za-z0-9_-]*$'
     OR parts[6] !~ '^[A-Za-z0-9_-]+$' THEN
    RAISE EXCEPTION USING ERRCODE = '23F02', MESSAGE = 'invalid_fencing_token',
      DETAIL = 'not a fencer fencing token (v2.<key id>.<token>.<lease tag>.<key>.<signature>)';
  END IF;
  BEGIN
    v_token := parts[3]::bigint;
    v_key := convert_from(fencer_b64url_decode(parts[5]), 'UTF8');
    v_sig := fencer_b64url_decode(parts[6]);
  EXCEPTION WHEN OTHERS THEN
    RAISE EXCEPTION USING ERRCODE = '23F02', MESSAGE = 'invalid_fencing_token',
      DETAIL = 'malformed token, key or signature';
  END;
  SELECT k.secret, k.key_prefixes INTO v_secret, v_prefixes
    FROM fencer_signing_keys k WHERE k.key_id = parts[2];
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = '23F02', MESSAGE = 'invalid_fencing_token',
      DETAIL = format('unknown signing key id %L', parts[2]),
      HINT = 'Insert the signing secret into fencer_signing_keys.';
  END IF;
  -- The signed message: length-prefixed version, key id, key, token, lease.
  FOREACH part IN ARRAY ARRAY[parts[1], parts[2], v_key, parts[3], parts[4]] LOOP
    v_msg := v_msg || int4send(octet_length(convert_to(part, 'UTF8'))) || convert_to(part, 'UTF8');
  END LOOP;
  IF fencer_hmac_sha256(v_secret, v_msg) IS DISTINCT FROM v_sig THEN
    RAISE EXCEPTION USING ERRCODE = '23F02', MESSAGE = 'invalid_fencing_token',
      DETAIL = 'bad signature';
  END IF;
  IF coalesce(array_length(v_prefixes, 1), 0) > 0
     AND NOT EXISTS (SELECT 1 FROM unnest(v_prefixes) AS pre(p) WHERE starts_with(v_key, pre.p)) THEN
    RAISE EXCEPTION USING ERRCODE = '23F02', MESSAGE = 'invalid_fencing_token',
      DETAIL = format('key id %L may not sign tokens for key %L', parts[2], v_key);
  END IF;
  IF p_key IS NOT NULL AND p_key <> v_key THEN
    RAISE EXCEPTION USING ERRCODE = '23F02', MESSAGE = 'invalid_fencing_token',
      DETAIL = format('the token is for key %L, this write is for %L', v_key, p_key);
  END IF;
  IF v_token <= 0 THEN
    RAISE EXCEPTION USING ERRCODE = '22023',
      MESSAGE = format('fencer_fence: token must be positive, got %s', v_token);
  END IF;
  v_lease := CASE WHEN parts[1] = 'v1' THEN fencer_lease_tag(parts[4]) ELSE parts[4] END;

  LOOP
    -- First writer of this key: the insert itself is the check. A concurrent
    -- uncommitted insert (or update) of the same key makes us wait for that
    -- transaction (unique index), then we fall through to the locked read.
    INSERT INTO fencer_fences AS t (key, token, lease_id)
    VALUES (v_key, v_token, v_lease)
    ON CONFLICT (key) DO NOTHING;
    IF FOUND THEN
      RETURN v_token;
    END IF;
    -- The key exists: lock its row until the caller's transaction ends.
    SELECT t.token, t.lease_id, t.inflight_id, t.inflight_until, t.read_token INTO f
      FROM fencer_fences AS t
     WHERE t.key = v_key
       FOR UPDATE;
    EXIT WHEN FOUND;
    -- The row was deleted between the two statements: try again.
  END LOOP;

  IF f.inflight_id IS NOT NULL AND f.inflight_until > clock_timestamp() THEN
    RAISE EXCEPTION USING ERRCODE = '55P03',
      MESSAGE = 'fencer_fence: a request forwarded by the fencer gateway is in flight on this key',
      DETAIL = format('key %L, in flight until %s', v_key, f.inflight_until),
      HINT = 'Roll back and retry: the gateway''s write may still land.';
  END IF;

  -- A writer comes after every reader the gateway admitted, too.
  IF v_token <= f.read_token THEN
    RAISE EXCEPTION USING ERRCODE = '23F01', MESSAGE = 'stale_fencing_token',
      DETAIL = format('key %L: token %s is not above %s, a read lease''s the gateway admitted',
                      v_key, v_token, f.read_token),
      HINT = 'The lease holding this token has lost its lock and a newer holder has read. '
             'Roll back; acquire the lock again before writing.';
  END IF;

  IF v_token > f.token THEN
    UPDATE fencer_fences AS t
       SET token = v_token, lease_id = v_lease, seq = 0, updated_at = now()
     WHERE t.key = v_key;
    RETURN v_token;
  END IF;

  IF v_token = f.token AND v_lease = f.lease_id THEN
    -- The same holder writing again: accept. The row is rewritten all the
    -- same, so a REPEATABLE READ transaction that started before another
    -- transaction of this holder committed fails (40001) instead of
    -- working from a snapshot that misses that holder's writes.
    UPDATE fencer_fences AS t SET updated_at = now() WHERE t.key = v_key;
    RETURN v_token;
  END IF;

  RAISE EXCEPTION USING
    ERRCODE = '23F01',
    MESSAGE = 'stale_fencing_token',
    DETAIL  = CASE WHEN v_token = f.token THEN
                format('key %L: token %s belongs to another lease; highest token seen is %s',
                       v_key, v_token, f.token)
              ELSE
                format('key %L: token %s is older than the highest token seen, %s',
                       v_key, v_token, f.token)
              END,
    HINT    = 'The lease holding this token has lost its lock and a newer holder has written. '
              'Roll back; acquire the lock again before writing.';
END;
$fencer_fence$;

REVOKE ALL ON FUNCTION fencer_fence(text, text) FROM PUBLIC;

COMMENT ON TABLE fencer_fences IS
  'fencer: highest fencing token seen per lock key (shared with the fencer gateway)';
COMMENT ON TABLE fencer_signing_keys IS
  'fencer: token-signing secrets by key id, readable only by fencer_fence()''s owner';
COMMENT ON FUNCTION fencer_fence(text, text) IS
  'fencer: call first in a write transaction with the signed fencing token; locks the key''s fence row until commit; raises 23F02 for an invalid token, 23F01 for a stale one, 55P03 while a gateway request is in flight';
