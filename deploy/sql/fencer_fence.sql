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
--   token check and your write then commit or roll back together: this
--   puts the check into the storage's own atomic write, which is the
--   strongest form of fencing there is. There is no window between "check"
--   and "write" in which a newer holder could slip in, because
--
--     * fencer_fence() locks the key's row in fencer_fences (FOR UPDATE)
--       and that row lock is held until YOUR transaction commits or rolls
--       back. A concurrent caller for the same key waits for it, then sees
--       the token you stored, and is rejected if its token is older;
--     * if fencer_fence() rejects the token it raises an error, which aborts
--       your transaction: nothing you wrote in it, before or after the
--       call, can commit (even a blind COMMIT then only rolls back).
--
-- SEMANTICS of fencer_fence(p_key, p_token, p_lease_id DEFAULT '')
--   * no row for p_key yet        -> store (p_token, p_lease_id), return p_token
--   * p_token >  stored token     -> store (p_token, p_lease_id), return p_token
--   * p_token =  stored token and
--     p_lease_id = stored lease   -> accept (the same holder writing again),
--                                    nothing changes, return p_token
--   * otherwise (an older token, or the same token from a different lease)
--                                 -> ERROR, SQLSTATE 23F01,
--                                    MESSAGE 'stale_fencing_token'
--   * NULL arguments              -> ERROR, SQLSTATE 22004 (null_value_not_allowed)
--   * p_token <= 0                -> ERROR, SQLSTATE 22023 (invalid_parameter_value)
--
--   23F01 is in class 23 (integrity constraint violation) with a subcode
--   PostgreSQL itself does not use, so clients can match it exactly, and
--   generic code that treats class 23 as "your write was refused, do not
--   retry blindly" does the right thing. Pass the lease id you got with the
--   token so that a retried write by the same holder is accepted while
--   another holder can never reuse a token; with p_lease_id = '' only
--   another '' caller matches an equal token.
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
--
--   Under REPEATABLE READ / SERIALIZABLE a concurrent holder's commit makes
--   fencer_fence() fail with 40001 (serialization_failure) instead; retry
--   that transaction as usual.
--
--   Example (psql; 2051 and 'lease-abc' come from fencer's acquire reply):
--
--     BEGIN;
--     SELECT fencer_fence('accounts/42', 2051, 'lease-abc');
--     UPDATE accounts SET balance = balance - 10 WHERE id = 42;
--     COMMIT;
--
--   Or from application code, with the fence in the same transaction:
--
--     tx = db.begin()
--     tx.execute("SELECT fencer_fence($1, $2, $3)", key, token, lease_id)
--     tx.execute("UPDATE accounts SET balance = $1 WHERE id = $2", ...)
--     tx.commit()      -- a stale token raised 23F01 above; nothing committed
--
-- NOTES
--   * One row per lock key, in the table the fencer gateway also uses, so
--     writes fenced here and through the gateway share one high-water mark.
--   * Tokens are bigint: fencer's tokens (including the hybrid_clock mode,
--     ~2e15) fit comfortably.
--   * The row lock serializes writers of one key. That is the point, but
--     keep fenced transactions short.
--   * This file is idempotent: load it again to upgrade the function. The
--     table and the function are created in the first schema on your
--     search_path; call the function with the same search_path.

CREATE TABLE IF NOT EXISTS fencer_fences (
  key        text PRIMARY KEY,
  token      bigint NOT NULL,
  lease_id   text NOT NULL DEFAULT '',
  -- The gateway's per-lease write sequence (Fencing-Seq); a new token
  -- starts its lease's sequence afresh, so an advance here resets it.
  seq        bigint NOT NULL DEFAULT 0,
  updated_at timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE fencer_fences ADD COLUMN IF NOT EXISTS seq bigint NOT NULL DEFAULT 0;

CREATE OR REPLACE FUNCTION fencer_fence(p_key text, p_token bigint, p_lease_id text DEFAULT '')
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
AS $fencer_fence$
DECLARE
  v_token bigint;
  v_lease text;
BEGIN
  IF p_key IS NULL OR p_token IS NULL OR p_lease_id IS NULL THEN
    RAISE EXCEPTION USING
      ERRCODE = '22004',
      MESSAGE = 'fencer_fence: key, token and lease_id must not be NULL',
      HINT    = 'Pass '''' as lease_id if you have none.';
  END IF;
  IF p_token <= 0 THEN
    RAISE EXCEPTION USING
      ERRCODE = '22023',
      MESSAGE = format('fencer_fence: token must be positive, got %s', p_token);
  END IF;

  LOOP
    -- First writer of this key: the insert itself is the check. A concurrent
    -- uncommitted insert (or update) of the same key makes us wait for that
    -- transaction (unique index), then we fall through to the locked read.
    INSERT INTO fencer_fences AS f (key, token, lease_id)
    VALUES (p_key, p_token, p_lease_id)
    ON CONFLICT (key) DO NOTHING;
    IF FOUND THEN
      RETURN p_token;
    END IF;

    -- The key exists: lock its row until the caller's transaction ends.
    -- If another transaction holds it, we wait here and then read the
    -- token it committed (READ COMMITTED re-reads the latest version).
    -- Do not drop FOR UPDATE: when an equal token is accepted below, no row
    -- changes, and this lock alone keeps newer holders out until we finish.
    SELECT f.token, f.lease_id INTO v_token, v_lease
    FROM fencer_fences AS f
    WHERE f.key = p_key
    FOR UPDATE;
    EXIT WHEN FOUND;
    -- The row was deleted between the two statements: try again.
  END LOOP;

  IF p_token > v_token THEN
    UPDATE fencer_fences
    SET token = p_token, lease_id = p_lease_id, seq = 0, updated_at = now()
    WHERE key = p_key;
    RETURN p_token;
  END IF;

  IF p_token = v_token AND p_lease_id = v_lease THEN
    -- The same holder writing again (e.g. a retry): accept, change nothing.
    RETURN p_token;
  END IF;

  RAISE EXCEPTION USING
    ERRCODE = '23F01',
    MESSAGE = 'stale_fencing_token',
    DETAIL  = CASE WHEN p_token = v_token THEN
                format('key %L: token %s was already used by another lease (%L, not %L); highest token seen is %s',
                       p_key, p_token, v_lease, p_lease_id, v_token)
              ELSE
                format('key %L: token %s is older than the highest token seen, %s',
                       p_key, p_token, v_token)
              END,
    HINT    = 'The lease holding this token has lost its lock and a newer holder has written. '
              'Roll back; acquire the lock again before writing.';
END;
$fencer_fence$;

COMMENT ON TABLE fencer_fences IS
  'fencer: highest fencing token seen per lock key (shared with the fencer gateway)';
COMMENT ON FUNCTION fencer_fence(text, bigint, text) IS
  'fencer: call first in a write transaction; locks the key''s fence row until commit and raises SQLSTATE 23F01 (stale_fencing_token) for an older token or an equal token from another lease';
