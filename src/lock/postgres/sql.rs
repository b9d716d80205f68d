//! The SQL of the PostgreSQL lock backend.
//!
//! Every expiry is computed by the server (`clock_timestamp()`), never by the
//! sidecar. Each operation is one autocommit statement: no transaction (and
//! no row lock) is held while the application works with its lock.

/// Advisory lock id serializing schema migrations and idle-row clean-up
/// against token minting for new rows.
pub const FLOOR_LOCK: i64 = 0x6665_6e63_6572_0001; // "fencer" + 1
pub const MIGRATE_LOCK: i64 = 0x6665_6e63_6572_0002;
/// First key of the two-key advisory locks that order an acquire attempt
/// and its undo ([`VOID_ATTEMPT`]); the second is a hash of the attempt.
pub const ATTEMPT_LOCK_CLASS: i32 = 0x6665_6e63; // "fenc"

/// How long the tombstone of a voided attempt is kept: an acquire statement
/// that reaches the server later than this after its caller gave up is no
/// longer refused (the runner retries an undo for
/// [`crate::pg::runner::UNDO_RETRY_FOR`], well within it).
pub const VOID_RETENTION: std::time::Duration = std::time::Duration::from_secs(3600);

/// Tables and functions, created at start-up when missing
/// ([`crate::pg::schema`]: the catalog is read first, so a start-up against
/// an up-to-date database takes no table lock).
///
/// `fencer_locks` keeps one row per key; a released or expired row is
/// reused by the next acquire, and its `token` column is the key's counter.
/// Read leases (read-write locks) are rows of `fencer_readers`; the key's
/// row says until when the last of them lasts (`read_until`) and until
/// when a writer waiting for them keeps new ones out (`write_wait`), and
/// every reader's change takes the key's row lock first — so a writer's
/// acquire, which locks the row too, decides on columns of the row it
/// holds and never on another table read with a snapshot from before a
/// reader committed.
/// Rows idle for a long time are deleted by the clean-up; before deleting,
/// the clean-up raises `fencer_token_floor` to their highest token, and a
/// *new* row starts at `floor + 1`, so a key's tokens never go backwards
/// even after its row was removed.
pub fn pieces() -> Vec<crate::pg::schema::Piece> {
    use crate::pg::schema::{column_exists, function_exists, relation_exists, Piece};
    vec![
        Piece {
            name: "fencer_locks",
            exists: relation_exists("fencer_locks"),
            create: "CREATE TABLE fencer_locks (
  key        text PRIMARY KEY,
  lease_id   text,
  owner      text,
  token      bigint NOT NULL,
  expires_at timestamptz,
  updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
  -- Lock-delay of the current lease: after an expiry (not a release) the
  -- key stays unavailable until expires_at + delay_ms.
  delay_ms   bigint NOT NULL DEFAULT 0,
  -- The acquire attempt that last granted or confirmed the lease
  -- (VOID_ATTEMPT says why).
  attempt    text
)"
            .into(),
        },
        Piece {
            name: "fencer_locks.delay_ms",
            exists: column_exists("fencer_locks", "delay_ms"),
            create: "ALTER TABLE fencer_locks ADD COLUMN delay_ms bigint NOT NULL DEFAULT 0".into(),
        },
        Piece {
            name: "fencer_locks.attempt",
            exists: column_exists("fencer_locks", "attempt"),
            create: "ALTER TABLE fencer_locks ADD COLUMN attempt text".into(),
        },
        Piece {
            name: "fencer_locks.holds",
            exists: column_exists("fencer_locks", "holds_lease"),
            create: "ALTER TABLE fencer_locks ADD COLUMN holds integer, ADD COLUMN holds_lease text, \
                     ADD COLUMN holds_op text"
                .into(),
        },
        Piece {
            name: "fencer_locks.read_until",
            exists: column_exists("fencer_locks", "read_until"),
            create: "ALTER TABLE fencer_locks ADD COLUMN read_until timestamptz, \
                     ADD COLUMN write_wait timestamptz"
                .into(),
        },
        Piece {
            name: "fencer_readers",
            exists: relation_exists("fencer_readers"),
            create: "CREATE TABLE fencer_readers (
  key        text NOT NULL,
  lease_id   text NOT NULL,
  token      bigint NOT NULL,
  expires_at timestamptz NOT NULL,
  attempt    text,
  PRIMARY KEY (key, lease_id)
);
CREATE INDEX fencer_readers_expires_at ON fencer_readers (expires_at)"
                .into(),
        },
        Piece {
            name: "fencer_read_settle_v1",
            exists: function_exists("fencer_read_settle_v1"),
            create: READ_SETTLE.into(),
        },
        Piece {
            name: "fencer_read_acquire_v1",
            exists: function_exists("fencer_read_acquire_v1"),
            create: READ_ACQUIRE_FN.into(),
        },
        Piece {
            name: "fencer_read_renew_v1",
            exists: function_exists("fencer_read_renew_v1"),
            create: READ_RENEW_FN.into(),
        },
        Piece {
            name: "fencer_read_release_v1",
            exists: function_exists("fencer_read_release_v1"),
            create: READ_RELEASE_FN.into(),
        },
        Piece {
            name: "fencer_void_read_v1",
            exists: function_exists("fencer_void_read_v1"),
            create: VOID_READ_FN.into(),
        },
        Piece {
            name: "fencer_locks_updated_at",
            exists: relation_exists("fencer_locks_updated_at"),
            create: "CREATE INDEX fencer_locks_updated_at ON fencer_locks (updated_at)".into(),
        },
        Piece {
            name: "fencer_token_floor",
            exists: relation_exists("fencer_token_floor"),
            create: "CREATE TABLE fencer_token_floor (
  id    boolean PRIMARY KEY DEFAULT true CHECK (id),
  floor bigint NOT NULL
)"
            .into(),
        },
        Piece {
            name: "fencer_token_floor row",
            exists: "SELECT EXISTS (SELECT 1 FROM fencer_token_floor)".into(),
            create: "INSERT INTO fencer_token_floor (id, floor) VALUES (true, 0) ON CONFLICT (id) DO NOTHING"
                .into(),
        },
        Piece {
            name: "fencer_next_floor",
            exists: function_exists("fencer_next_floor"),
            create: NEXT_FLOOR.into(),
        },
        Piece {
            name: "fencer_void_attempts",
            exists: relation_exists("fencer_void_attempts"),
            create: "CREATE TABLE fencer_void_attempts (
  lease_id  text NOT NULL,
  attempt   text NOT NULL,
  voided_at timestamptz NOT NULL DEFAULT clock_timestamp(),
  PRIMARY KEY (lease_id, attempt)
);
CREATE INDEX fencer_void_attempts_voided_at ON fencer_void_attempts (voided_at)"
                .into(),
        },
        Piece {
            name: "fencer_attempt_live",
            exists: function_exists("fencer_attempt_live"),
            create: ATTEMPT_LIVE.into(),
        },
        Piece {
            name: "fencer_void_attempt",
            exists: function_exists("fencer_void_attempt"),
            create: VOID_ATTEMPT_FN.into(),
        },
        Piece {
            name: "fencer_acquire_many_v2",
            exists: function_exists("fencer_acquire_many_v2"),
            create: acquire_many_fn(),
        },
        Piece {
            name: "fencer_release_many_v1",
            exists: function_exists("fencer_release_many_v1"),
            create: release_many_fn(),
        },
        Piece {
            name: "fencer_semaphores",
            exists: relation_exists("fencer_semaphores"),
            create: "CREATE TABLE fencer_semaphores (
  name    text PRIMARY KEY,
  permits integer NOT NULL CHECK (permits > 0)
)"
            .into(),
        },
    ]
}

/// `statement` with its parameters `$1`…`$n` replaced by `names` (PL/pgSQL
/// variables): the shared functions below run the single statements' own
/// text, so a batch item does exactly what a lone call does.
fn with_variables(statement: &str, names: &[&str]) -> String {
    let mut s = statement.to_owned();
    // From the highest number down, so `$1` never eats the start of `$12`.
    for (i, name) in names.iter().enumerate().rev() {
        s = s.replace(&format!("${}", i + 1), name);
    }
    s
}

/// Many acquires in one transaction (the group commit of
/// [`crate::pg::group`]): each item runs [`ACQUIRE`] itself, as its own
/// statement (so with its own snapshot, and its expiry counted from the
/// moment its row is taken), in key order — two shared statements lock
/// rows in the same order and cannot deadlock. One row per item: (item,
/// status, token, remaining ms); status 0 when [`ACQUIRE`] answered no row
/// (the key's row was created by a transaction its snapshot could not see:
/// the caller asks again, as for a lone call).
fn acquire_many_fn() -> String {
    let body = with_variables(
        ACQUIRE,
        &[
            "v_key",
            "v_lease",
            "v_owner",
            "v_ttl",
            "v_delay",
            "v_attempt",
        ],
    );
    format!(
        r#"
CREATE FUNCTION fencer_acquire_many_v2(p_keys text[], p_leases text[], p_ttls bigint[],
                                       p_delay bigint, p_attempts text[])
RETURNS TABLE (item integer, st integer, tok bigint, rem bigint)
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
  v_key text; v_lease text; v_owner text := NULL; v_ttl bigint; v_delay bigint := p_delay;
  v_attempt text; rec record; i bigint; answered boolean;
BEGIN
  FOR i IN SELECT t.ord FROM unnest(p_keys) WITH ORDINALITY AS t(k, ord)
            ORDER BY t.k COLLATE "C", t.ord LOOP
    v_key := p_keys[i]; v_lease := p_leases[i]; v_ttl := p_ttls[i]; v_attempt := p_attempts[i];
    answered := false;
    FOR rec IN {body} LOOP
      item := i; st := rec.status; tok := rec.token; rem := rec.remaining_ms;
      answered := true;
      RETURN NEXT;
    END LOOP;
    IF NOT answered THEN
      item := i; st := 0; tok := 0; rem := 0;
      RETURN NEXT;
    END IF;
  END LOOP;
END $fn$
"#
    )
}

/// Many releases in one transaction, each item through [`RELEASE`] in key
/// order (see [`acquire_many_fn`]). One row per item: (item, status,
/// token); status 0 when the key has no row (free).
fn release_many_fn() -> String {
    let body = with_variables(RELEASE, &["v_key", "v_lease", "v_channel"]);
    format!(
        r#"
CREATE FUNCTION fencer_release_many_v1(p_keys text[], p_leases text[], p_channels text[])
RETURNS TABLE (item integer, st integer, tok bigint)
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
  v_key text; v_lease text; v_channel text; rec record; i bigint; answered boolean;
BEGIN
  FOR i IN SELECT t.ord FROM unnest(p_keys) WITH ORDINALITY AS t(k, ord)
            ORDER BY t.k COLLATE "C", t.ord LOOP
    v_key := p_keys[i]; v_lease := p_leases[i]; v_channel := p_channels[i];
    answered := false;
    FOR rec IN {body} LOOP
      item := i; st := rec.status; tok := rec.token;
      answered := true;
      RETURN NEXT;
    END LOOP;
    IF NOT answered THEN
      item := i; st := 0; tok := 0;
      RETURN NEXT;
    END IF;
  END LOOP;
END $fn$
"#
    )
}

/// $1 keys, $2 leases, $3 ttls (ms), $4 lock-delay ms, $5 attempt ids.
pub const ACQUIRE_MANY: &str = "SELECT * FROM fencer_acquire_many_v2($1, $2, $3, $4, $5)";

/// $1 keys, $2 leases, $3 notification channels.
pub const RELEASE_MANY: &str = "SELECT * FROM fencer_release_many_v1($1, $2, $3)";

/// VOLATILE: in READ COMMITTED (pinned on every connection) its query takes
/// a fresh snapshot after the shared lock is granted, so it sees a clean-up
/// that committed meanwhile. Called only when a key's row is created.
const NEXT_FLOOR: &str = r#"
CREATE FUNCTION fencer_next_floor() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  PERFORM pg_advisory_xact_lock_shared(7378424937699213313);
  RETURN (SELECT floor FROM fencer_token_floor WHERE id);
END $$
"#;

/// Whether acquire attempt ($1 lease, $2 attempt) may still take effect:
/// not voided by its undo. Under the attempt's advisory lock, shared: an
/// undo in progress (exclusive) is waited for, and VOLATILE means the query
/// below takes a fresh snapshot after the lock is granted (READ COMMITTED),
/// so it sees the tombstone an undo committed meanwhile. An undo that comes
/// later waits for this statement's transaction to end, and then sees its
/// grant.
const ATTEMPT_LIVE: &str = r#"
CREATE FUNCTION fencer_attempt_live(p_lease text, p_attempt text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  PERFORM pg_advisory_xact_lock_shared(1717923427, hashtext(p_lease || '/' || p_attempt));
  RETURN NOT EXISTS (SELECT 1 FROM fencer_void_attempts
                      WHERE lease_id = p_lease AND attempt = p_attempt);
END $$
"#;

/// The undo of an acquire attempt whose caller gave up (issue 27 item 3),
/// right whatever the order in which it and the attempt's statement reach
/// the server: under the attempt's advisory lock (exclusive) it leaves a
/// tombstone — an attempt that arrives later finds it and takes nothing —
/// then, with a fresh snapshot (each statement of a VOLATILE function
/// takes one), releases the key if the row still carries the attempt: an
/// attempt that ran first (or was running: the lock waited for it) is
/// undone. Returns how many rows it released (0 or 1). An undo names the
/// attempt, not the lease alone (PITFALLS 11, issue 26 item 1): a retry of
/// the same lease that was answered "held" has replaced the attempt on the
/// row, and then the lease is the application's and nothing changes.
const VOID_ATTEMPT_FN: &str = r#"
CREATE FUNCTION fencer_void_attempt(p_key text, p_lease text, p_attempt text, p_channel text)
RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  released integer;
BEGIN
  PERFORM pg_advisory_xact_lock(1717923427, hashtext(p_lease || '/' || p_attempt));
  INSERT INTO fencer_void_attempts (lease_id, attempt) VALUES (p_lease, p_attempt)
  ON CONFLICT (lease_id, attempt) DO NOTHING;
  WITH r AS (
    UPDATE fencer_locks
       SET lease_id = NULL, owner = NULL, expires_at = NULL, updated_at = clock_timestamp()
     WHERE key = p_key AND lease_id = p_lease AND attempt = p_attempt
       AND expires_at > clock_timestamp()
    RETURNING 1
  )
  SELECT count(*) INTO released FROM r;
  IF released > 0 THEN
    PERFORM pg_notify(p_channel, '');
  END IF;
  RETURN released;
END $$
"#;

/// $1 key, $2 lease, $3 notification channel, $4 attempt id: see
/// [`VOID_ATTEMPT_FN`]. One row: (released rows).
pub const VOID_ATTEMPT: &str = "SELECT fencer_void_attempt($1, $2, $4, $3)";

/// $1 key, $2 lease, $3 owner, $4 ttl ms, $5 lock-delay ms, $6 attempt id.
/// Returns (status, token, remaining_ms): 1 acquired (or already ours),
/// -1 held by another lease, -3 free but in lock-delay (the last lease
/// expired; `remaining_ms` is the delay's), -2 the attempt was voided by its undo (its
/// caller gave up; nothing taken). Every grant stores the attempt id; a
/// confirmation of a grant to the same lease (a retry) stores it only if it
/// is later than the one on the row ([`VOID_ATTEMPT_FN`] says why: the
/// request of an earlier try can arrive after its retry's).
pub const ACQUIRE: &str = r#"
WITH live AS (
  -- Evaluated once (a volatile CTE is never inlined), before any row is
  -- locked or written below: every write is gated on it.
  SELECT fencer_attempt_live($2, $6) AS ok
), up AS (
  -- The key's row exists and is free (or expired): take it. The expiry
  -- counts from the moment the row is taken, not from before a wait for
  -- its lock.
  UPDATE fencer_locks l
     SET lease_id = $2, owner = $3, token = l.token + 1,
         expires_at = clock_timestamp() + $4::bigint * interval '1 millisecond',
         updated_at = clock_timestamp(), delay_ms = $5::bigint, attempt = $6,
         write_wait = NULL
   WHERE l.key = $1 AND (SELECT ok FROM live)
     AND (l.lease_id IS NULL
          OR l.expires_at + l.delay_ms * interval '1 millisecond' <= clock_timestamp())
     AND (l.read_until IS NULL OR l.read_until <= clock_timestamp())
  RETURNING l.token
), ins AS (
  -- No row yet: create it above the token floor. Only this path reads the
  -- floor (and waits for a clean-up in progress): acquires of existing
  -- keys never touch the floor's lock.
  INSERT INTO fencer_locks (key, lease_id, owner, token, expires_at, updated_at, delay_ms, attempt)
  SELECT $1, $2, $3, fencer_next_floor() + 1,
         clock_timestamp() + $4::bigint * interval '1 millisecond', clock_timestamp(), $5::bigint, $6
   WHERE (SELECT ok FROM live) AND NOT EXISTS (SELECT 1 FROM fencer_locks WHERE key = $1)
  ON CONFLICT (key) DO NOTHING
  RETURNING token
), again AS (
  -- Already this lease's (a retry after an unknown outcome): confirm it,
  -- and from now on only this attempt may undo it — unless a later
  -- attempt already confirmed it (this one's request came late; attempt
  -- ids of a lease sort in sending order). Reads `up` and `ins`, so it
  -- runs after them and only when neither took the row.
  UPDATE fencer_locks l
     SET attempt = GREATEST(l.attempt COLLATE "C", $6 COLLATE "C")
   WHERE l.key = $1 AND l.lease_id = $2 AND l.expires_at > clock_timestamp()
     AND (SELECT ok FROM live)
     AND NOT EXISTS (SELECT 1 FROM up) AND NOT EXISTS (SELECT 1 FROM ins)
  RETURNING l.token
), wait AS (
  -- Read leases hold the key: this writer waits for them, re-checking
  -- within a second, and until a second after that no new reader gets in
  -- (writer preference; each re-check renews the mark, so a writer that
  -- gave up keeps readers out 2 s at most: memory.rs, WRITER_RECHECK).
  -- Runs after `again`, as `again` after `up`.
  UPDATE fencer_locks l
     SET write_wait = LEAST(l.read_until, clock_timestamp() + interval '1 second')
                      + interval '1 second'
   WHERE l.key = $1 AND (SELECT ok FROM live)
     AND l.read_until > clock_timestamp()
     AND (l.lease_id IS NULL OR l.expires_at <= clock_timestamp())
     AND NOT EXISTS (SELECT 1 FROM up) AND NOT EXISTS (SELECT 1 FROM ins)
     AND NOT EXISTS (SELECT 1 FROM again)
  RETURNING l.token,
            LEAST(1000, GREATEST(0, (EXTRACT(EPOCH FROM (l.read_until - clock_timestamp()))
                                     * 1000)::bigint)) AS readers_left_ms
)
SELECT 1 AS status, token, 0::bigint AS remaining_ms FROM up
UNION ALL
SELECT 1, token, 0::bigint FROM ins
UNION ALL
SELECT 1, token, 0::bigint FROM again
UNION ALL
SELECT -1, token, readers_left_ms FROM wait
UNION ALL
SELECT CASE WHEN l.expires_at > clock_timestamp() THEN -1 ELSE -3 END,
       l.token,
       GREATEST(0, (EXTRACT(EPOCH FROM (l.expires_at + l.delay_ms * interval '1 millisecond'
                                        - clock_timestamp())) * 1000)::bigint)
  FROM fencer_locks l
 WHERE l.key = $1 AND (SELECT ok FROM live)
   AND NOT EXISTS (SELECT 1 FROM up) AND NOT EXISTS (SELECT 1 FROM ins)
   AND NOT EXISTS (SELECT 1 FROM again) AND NOT EXISTS (SELECT 1 FROM wait)
UNION ALL
SELECT -2, 0::bigint, 0::bigint FROM live WHERE NOT ok
"#;

/// Reentrancy. $1 key, $2 lease, $3 expected count (NULL: read only), $4
/// new count, $5 owner, $6 the change's id. One row if the key has one:
/// (status, holds, owner, applied) — status 1 when the lease holds the key
/// (its count: 1 when none is recorded for this lease; set to $4, with
/// the owner, if it was $3 — unless change $6 was made already: then
/// `applied` without a second change), 0 free, -1 another lease's. The
/// count is valid only for `holds_lease`, so a new grant (which does not
/// touch it) starts from 1.
pub const HOLDS: &str = r#"
WITH cur AS (
  SELECT l.lease_id = $2 AND COALESCE(l.expires_at > clock_timestamp(), false) AS mine,
         l.lease_id IS NULL OR NOT COALESCE(l.expires_at > clock_timestamp(), false) AS free,
         CASE WHEN l.holds_lease = $2 THEN l.holds ELSE 1 END AS h,
         CASE WHEN l.holds_lease = $2 THEN l.owner END AS o,
         COALESCE(l.holds_lease = $2 AND l.holds_op = $6, false) AS done
    FROM fencer_locks l WHERE l.key = $1 FOR UPDATE
), up AS (
  UPDATE fencer_locks l
     SET holds = $4::integer, holds_lease = $2, owner = $5, holds_op = $6,
         updated_at = clock_timestamp()
    FROM cur
   WHERE l.key = $1 AND cur.mine AND NOT cur.done AND cur.h = $3::integer
  RETURNING l.holds, l.owner
)
SELECT CASE WHEN cur.mine THEN 1 WHEN cur.free THEN 0 ELSE -1 END,
       COALESCE((SELECT holds FROM up), cur.h),
       CASE WHEN EXISTS (SELECT 1 FROM up) THEN (SELECT owner FROM up) ELSE cur.o END,
       cur.done OR EXISTS (SELECT 1 FROM up)
  FROM cur
"#;

/// $1 key. Reads only (no row lock: a writer never waits for it). One row
/// if the key has one: (held, lease, token — the key's counter, ms left
/// on the lease, ms left on its lock-delay), times on the server's clock.
pub const INSPECT: &str = r#"
SELECT l.lease_id IS NOT NULL AND l.expires_at > clock_timestamp() AS held,
       l.lease_id,
       l.token,
       COALESCE(GREATEST(0, (EXTRACT(EPOCH FROM (l.expires_at - clock_timestamp())) * 1000)::bigint), 0),
       COALESCE(GREATEST(0, (EXTRACT(EPOCH FROM (l.expires_at + l.delay_ms * interval '1 millisecond'
                                                 - clock_timestamp())) * 1000)::bigint), 0),
       (SELECT count(*) FROM fencer_readers r WHERE r.key = l.key AND r.expires_at > clock_timestamp())
  FROM fencer_locks l
 WHERE l.key = $1
"#;

/// $1 key, $2 lease, $3 ttl ms. Returns (status, token): 1 renewed,
/// 0 not held (expired or released), -1 held by another lease.
pub const RENEW: &str = r#"
WITH r AS (
  UPDATE fencer_locks
     SET expires_at = clock_timestamp() + $3::bigint * interval '1 millisecond',
         updated_at = clock_timestamp()
   WHERE key = $1 AND lease_id = $2 AND expires_at > clock_timestamp()
  RETURNING token
)
SELECT 1 AS status, token FROM r
UNION ALL
SELECT CASE WHEN l.lease_id IS NULL OR l.lease_id = $2 OR l.expires_at <= clock_timestamp()
            THEN 0 ELSE -1 END,
       l.token
  FROM fencer_locks l
 WHERE l.key = $1 AND NOT EXISTS (SELECT 1 FROM r)
"#;

/// $1 keys, $2 leases, $3 ttls (ms), as arrays. One row per input, in
/// order: (renewed, token). Rows are locked in key order first (`lk`), as
/// the shared acquire and release functions lock theirs: statements that
/// each lock several rows in one order cannot deadlock.
pub const RENEW_MANY: &str = r#"
WITH t AS (
  SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[]) WITH ORDINALITY AS t(key, lease, ttl, n)
), lk AS (
  SELECT l.key FROM fencer_locks l
   WHERE l.key IN (SELECT key FROM t)
   ORDER BY l.key COLLATE "C"
   FOR UPDATE OF l
), r AS (
  UPDATE fencer_locks l
     SET expires_at = clock_timestamp() + t.ttl * interval '1 millisecond',
         updated_at = clock_timestamp()
    FROM t
   WHERE l.key = t.key AND l.lease_id = t.lease AND l.expires_at > clock_timestamp()
     AND l.key IN (SELECT key FROM lk)
  RETURNING l.key, l.token
)
SELECT r.key IS NOT NULL, COALESCE(r.token, 0) FROM t LEFT JOIN r ON r.key = t.key ORDER BY t.n
"#;

/// $1 key, $2 lease, $3 notification channel. Same statuses as RENEW.
/// The notification is sent (at commit) only when the release happened.
pub const RELEASE: &str = r#"
WITH r AS (
  UPDATE fencer_locks
     SET lease_id = NULL, owner = NULL, expires_at = NULL, updated_at = clock_timestamp()
   WHERE key = $1 AND lease_id = $2 AND expires_at > clock_timestamp()
  RETURNING token
)
SELECT 1 AS status, token, length(pg_notify($3, '')::text) FROM r
UNION ALL
SELECT CASE WHEN l.lease_id IS NULL OR l.lease_id = $2 OR l.expires_at <= clock_timestamp()
            THEN 0 ELSE -1 END,
       l.token, 0
  FROM fencer_locks l
 WHERE l.key = $1 AND NOT EXISTS (SELECT 1 FROM r)
"#;

/// $1 key, $2 floor: the key's next token will be above `floor`.
pub const RAISE_FLOOR: &str = r#"
INSERT INTO fencer_locks AS l (key, token) VALUES ($1, $2)
ON CONFLICT (key) DO UPDATE SET token = GREATEST(l.token, EXCLUDED.token)
"#;

/// $1 semaphore name, $2 permits: fixed unless fixed, answered as it
/// stands. No row when another transaction inserted the name after this
/// statement's snapshot (ON CONFLICT waited for it): asked again.
pub const PERMITS: &str = r#"
WITH ins AS (
  INSERT INTO fencer_semaphores (name, permits) VALUES ($1, $2)
  ON CONFLICT (name) DO NOTHING RETURNING permits
)
SELECT permits FROM ins
UNION ALL SELECT permits FROM fencer_semaphores WHERE name = $1
LIMIT 1
"#;

/// `fencer_read_settle_v1(key, channel)`, with the key's row locked by
/// the caller: `read_until` becomes the expiry of the last live reader
/// (NULL: none), and when none is left the key's waiters are notified.
const READ_SETTLE: &str = r#"
CREATE FUNCTION fencer_read_settle_v1(p_key text, p_channel text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  v_until timestamptz;
BEGIN
  SELECT max(r.expires_at) INTO v_until FROM fencer_readers r
   WHERE r.key = p_key AND r.expires_at > clock_timestamp();
  UPDATE fencer_locks SET read_until = v_until, updated_at = clock_timestamp() WHERE key = p_key;
  IF v_until IS NULL THEN
    PERFORM pg_notify(p_channel, '');
  END IF;
END $$
"#;

/// A read lease's acquire: `fencer_read_acquire_v1(key, lease, ttl ms,
/// attempt)` → `(status, token, remaining ms)` with [`ACQUIRE`]'s statuses.
/// Under the key's row lock (the row created, above the token floor, if
/// the key has none): already this lease's reader (a retry) → its token;
/// a write lease holds the key, or a writer waits for it → held; in a
/// write lease's lock-delay → delayed; else a reader row with the next
/// token of the key's counter, and `read_until` raised to its expiry.
/// The attempt is voidable as a writer's ([`VOID_READ_FN`]).
const READ_ACQUIRE_FN: &str = r#"
CREATE FUNCTION fencer_read_acquire_v1(p_key text, p_lease text, p_ttl bigint, p_attempt text)
RETURNS TABLE (status integer, token bigint, remaining_ms bigint)
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
  l record; r record; t bigint; ts timestamptz;
BEGIN
  IF NOT fencer_attempt_live(p_lease, p_attempt) THEN
    RETURN QUERY SELECT -2, 0::bigint, 0::bigint;
    RETURN;
  END IF;
  SELECT * INTO l FROM fencer_locks WHERE key = p_key FOR UPDATE;
  IF NOT FOUND THEN
    INSERT INTO fencer_locks (key, token) VALUES (p_key, fencer_next_floor())
    ON CONFLICT (key) DO NOTHING;
    SELECT * INTO l FROM fencer_locks WHERE key = p_key FOR UPDATE;
  END IF;
  ts := clock_timestamp();
  SELECT * INTO r FROM fencer_readers
   WHERE fencer_readers.key = p_key AND lease_id = p_lease AND expires_at > ts;
  IF FOUND THEN
    UPDATE fencer_readers SET attempt = GREATEST(attempt COLLATE "C", p_attempt COLLATE "C")
     WHERE fencer_readers.key = p_key AND lease_id = p_lease;
    RETURN QUERY SELECT 1, r.token, 0::bigint;
    RETURN;
  END IF;
  IF l.lease_id IS NOT NULL AND l.expires_at > ts THEN
    RETURN QUERY SELECT -1, l.token,
      GREATEST(0, (EXTRACT(EPOCH FROM (l.expires_at - ts)) * 1000)::bigint);
    RETURN;
  END IF;
  IF l.write_wait > ts THEN
    RETURN QUERY SELECT -1, l.token,
      GREATEST(0, (EXTRACT(EPOCH FROM (l.write_wait - ts)) * 1000)::bigint);
    RETURN;
  END IF;
  IF l.lease_id IS NOT NULL AND l.expires_at + l.delay_ms * interval '1 millisecond' > ts THEN
    RETURN QUERY SELECT -3, l.token,
      GREATEST(0, (EXTRACT(EPOCH FROM (l.expires_at + l.delay_ms * interval '1 millisecond' - ts))
                   * 1000)::bigint);
    RETURN;
  END IF;
  t := l.token + 1;
  UPDATE fencer_locks
     SET token = t, lease_id = NULL, owner = NULL, expires_at = NULL, write_wait = NULL,
         read_until = GREATEST(COALESCE(read_until, ts), ts + p_ttl * interval '1 millisecond'),
         updated_at = ts
   WHERE fencer_locks.key = p_key;
  INSERT INTO fencer_readers (key, lease_id, token, expires_at, attempt)
  VALUES (p_key, p_lease, t, ts + p_ttl * interval '1 millisecond', p_attempt)
  ON CONFLICT (key, lease_id) DO UPDATE
    SET token = EXCLUDED.token, expires_at = EXCLUDED.expires_at, attempt = EXCLUDED.attempt;
  RETURN QUERY SELECT 1, t, 0::bigint;
END $fn$
"#;

/// $1 key, $2 lease, $3 ttl ms, $4 attempt id: [`READ_ACQUIRE_FN`].
pub const READ_ACQUIRE: &str = "SELECT * FROM fencer_read_acquire_v1($1, $2, $3, $4)";

/// A read lease's renewal: `fencer_read_renew_v1(key, lease, ttl ms)` →
/// `(status, token)` as [`RENEW`]: under the key's row lock, the reader's
/// row extended and `read_until` raised to cover it.
const READ_RENEW_FN: &str = r#"
CREATE FUNCTION fencer_read_renew_v1(p_key text, p_lease text, p_ttl bigint)
RETURNS TABLE (status integer, token bigint)
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
  l record; t bigint; ts timestamptz;
BEGIN
  SELECT * INTO l FROM fencer_locks WHERE key = p_key FOR UPDATE;
  IF NOT FOUND THEN
    RETURN QUERY SELECT 0, 0::bigint;
    RETURN;
  END IF;
  ts := clock_timestamp();
  UPDATE fencer_readers r SET expires_at = ts + p_ttl * interval '1 millisecond'
   WHERE r.key = p_key AND r.lease_id = p_lease AND r.expires_at > ts
  RETURNING r.token INTO t;
  IF t IS NULL THEN
    RETURN QUERY SELECT CASE WHEN l.lease_id IS NOT NULL AND l.expires_at > ts THEN -1 ELSE 0 END,
                        l.token;
    RETURN;
  END IF;
  UPDATE fencer_locks
     SET read_until = GREATEST(COALESCE(read_until, ts), ts + p_ttl * interval '1 millisecond'),
         updated_at = ts
   WHERE fencer_locks.key = p_key;
  RETURN QUERY SELECT 1, t;
END $fn$
"#;

/// $1 key, $2 lease, $3 ttl ms: [`READ_RENEW_FN`].
pub const READ_RENEW: &str = "SELECT * FROM fencer_read_renew_v1($1, $2, $3)";

/// A read lease's release: `fencer_read_release_v1(key, lease, channel)`
/// → `(status, token)` as [`RELEASE`]; the last reader's release notifies
/// the key's waiters ([`READ_SETTLE`]).
const READ_RELEASE_FN: &str = r#"
CREATE FUNCTION fencer_read_release_v1(p_key text, p_lease text, p_channel text)
RETURNS TABLE (status integer, token bigint)
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
  l record; t bigint; live boolean;
BEGIN
  SELECT * INTO l FROM fencer_locks WHERE key = p_key FOR UPDATE;
  IF NOT FOUND THEN
    RETURN QUERY SELECT 0, 0::bigint;
    RETURN;
  END IF;
  DELETE FROM fencer_readers r WHERE r.key = p_key AND r.lease_id = p_lease
  RETURNING r.token, r.expires_at > clock_timestamp() INTO t, live;
  IF t IS NULL OR NOT live THEN
    RETURN QUERY SELECT CASE WHEN l.lease_id IS NOT NULL AND l.expires_at > clock_timestamp()
                             THEN -1 ELSE 0 END, l.token;
    RETURN;
  END IF;
  PERFORM fencer_read_settle_v1(p_key, p_channel);
  RETURN QUERY SELECT 1, t;
END $fn$
"#;

/// $1 key, $2 lease, $3 notification channel: [`READ_RELEASE_FN`].
pub const READ_RELEASE: &str = "SELECT * FROM fencer_read_release_v1($1, $2, $3)";

/// The undo of a read lease's acquire attempt whose caller gave up: as
/// [`VOID_ATTEMPT_FN`] — a tombstone under the attempt's lock, then the
/// reader row removed if it still carries the attempt.
const VOID_READ_FN: &str = r#"
CREATE FUNCTION fencer_void_read_v1(p_key text, p_lease text, p_attempt text, p_channel text)
RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  released integer;
BEGIN
  PERFORM pg_advisory_xact_lock(1717923427, hashtext(p_lease || '/' || p_attempt));
  INSERT INTO fencer_void_attempts (lease_id, attempt) VALUES (p_lease, p_attempt)
  ON CONFLICT (lease_id, attempt) DO NOTHING;
  PERFORM 1 FROM fencer_locks WHERE key = p_key FOR UPDATE;
  WITH r AS (
    DELETE FROM fencer_readers
     WHERE key = p_key AND lease_id = p_lease AND attempt = p_attempt
    RETURNING 1
  )
  SELECT count(*) INTO released FROM r;
  IF released > 0 THEN
    PERFORM fencer_read_settle_v1(p_key, p_channel);
  END IF;
  RETURN released;
END $$
"#;

/// $1 key, $2 lease, $3 notification channel, $4 attempt id:
/// [`VOID_READ_FN`].
pub const VOID_READ: &str = "SELECT fencer_void_read_v1($1, $2, $4, $3)";

/// $1 batch size: deletes up to $1 reader rows that expired more than a
/// minute ago (released ones are deleted by their release).
pub const CLEANUP_READERS: &str = r#"
DELETE FROM fencer_readers WHERE (key, lease_id) IN (
  SELECT key, lease_id FROM fencer_readers
   WHERE expires_at < clock_timestamp() - interval '1 minute'
   ORDER BY expires_at LIMIT $1)
"#;

/// $1 idle ms, $2 batch size. Deletes up to $2 rows of keys idle (free
/// and untouched) for $1 ms and raises the floor to their highest token in
/// the same statement. Run in a transaction holding the floor lock
/// exclusively (`pg_try_advisory_xact_lock(FLOOR_LOCK)`: when acquires are
/// creating rows the round is skipped rather than queued, so a clean-up
/// never makes new-key acquires wait behind it for long).
pub const CLEANUP: &str = r#"
WITH gone AS (
  DELETE FROM fencer_locks WHERE key IN (
    SELECT key FROM fencer_locks
     WHERE (lease_id IS NULL
            OR expires_at + delay_ms * interval '1 millisecond' <= clock_timestamp())
       AND (read_until IS NULL OR read_until <= clock_timestamp())
       AND updated_at < clock_timestamp() - $1::bigint * interval '1 millisecond'
     ORDER BY updated_at LIMIT $2
     FOR UPDATE SKIP LOCKED)
  RETURNING token
)
UPDATE fencer_token_floor
   SET floor = GREATEST(floor, (SELECT COALESCE(MAX(token), 0) FROM gone))
 WHERE id
RETURNING (SELECT count(*) FROM gone)
"#;

/// $1 retention ms, $2 batch size: deletes tombstones of voided attempts
/// older than the retention ([`VOID_RETENTION`]).
pub const CLEANUP_VOIDS: &str = r#"
DELETE FROM fencer_void_attempts WHERE (lease_id, attempt) IN (
  SELECT lease_id, attempt FROM fencer_void_attempts
   WHERE voided_at < clock_timestamp() - $1::bigint * interval '1 millisecond'
   ORDER BY voided_at LIMIT $2)
"#;

#[cfg(test)]
mod tests {
    #[test]
    fn schema_uses_the_floor_lock_id() {
        assert!(super::NEXT_FLOOR.contains(&super::FLOOR_LOCK.to_string()));
    }

    #[test]
    fn attempt_and_undo_share_one_lock() {
        let class = format!(
            "({}, hashtext(p_lease || '/' || p_attempt))",
            super::ATTEMPT_LOCK_CLASS
        );
        assert!(super::ATTEMPT_LIVE.contains(&format!("pg_advisory_xact_lock_shared{class}")));
        assert!(super::VOID_ATTEMPT_FN.contains(&format!("pg_advisory_xact_lock{class}")));
    }
}
