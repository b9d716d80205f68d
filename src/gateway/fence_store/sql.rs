//! The SQL of the PostgreSQL fence store.
//!
//! `fencer_fences` keeps one row per key: the write mark (`token`,
//! `lease_id` — the lease's *tag*, never its id — and `seq`; token 0 with
//! an empty tag while only readers were seen), the read mark (`read_token`,
//! [`super`]'s two marks) and the in-flight stamp (`inflight_id`,
//! `inflight_until`, and `wake`: whether a replica waits for the stamp to
//! clear and wants a NOTIFY when it does).
//!
//! The `_v2` functions know read leases; the `_v1` ones stay for replicas
//! of the previous version during a roll-out (they know no read token, so
//! read-write locks need every replica on `_v2`: docs/fencing.md).
//!
//! Check-and-advance is one function call per request, holding the row's
//! lock only for the call: no connection or transaction stays open while
//! the request is forwarded. The functions carry a version suffix: a future
//! change of their body gets a new name, so replicas of two versions can
//! run side by side during a roll-out.

/// Serializes schema changes of concurrently starting gateways.
pub const MIGRATE_LOCK: i64 = 0x6665_6e63_6572_0003;

/// The columns the store needs, with their definitions, in table order.
pub const COLUMNS: &[(&str, &str)] = &[
    ("key", "text PRIMARY KEY"),
    ("token", "bigint NOT NULL"),
    ("lease_id", "text NOT NULL DEFAULT ''"),
    ("seq", "bigint NOT NULL DEFAULT 0"),
    ("updated_at", "timestamptz NOT NULL DEFAULT now()"),
    ("inflight_id", "text"),
    ("inflight_until", "timestamptz"),
    ("wake", "boolean NOT NULL DEFAULT false"),
    ("read_token", "bigint NOT NULL DEFAULT 0"),
];

/// The functions, by name, with their definitions.
pub const FUNCTIONS: &[(&str, &str)] = &[
    ("fencer_gw_admit_v1", ADMIT),
    ("fencer_gw_finish_v1", FINISH),
    ("fencer_gw_admit_many_v1", ADMIT_MANY),
    ("fencer_gw_finish_many_v1", FINISH_MANY),
    ("fencer_gw_admit_v2", ADMIT_V2),
    ("fencer_gw_admit_many_v2", ADMIT_MANY_V2),
];

/// The schema, piece by piece: the table, each column (tables of earlier
/// versions lack some), each function.
pub fn pieces() -> Vec<crate::pg::schema::Piece> {
    use crate::pg::schema::{column_exists, function_exists, relation_exists, Piece};
    let cols: Vec<String> = COLUMNS.iter().map(|(c, d)| format!("{c} {d}")).collect();
    let mut out = vec![Piece {
        name: "fencer_fences",
        exists: relation_exists("fencer_fences"),
        create: format!("CREATE TABLE fencer_fences ({})", cols.join(", ")),
    }];
    for (c, d) in COLUMNS {
        out.push(Piece {
            name: c,
            exists: column_exists("fencer_fences", c),
            create: format!("ALTER TABLE fencer_fences ADD COLUMN {c} {d}"),
        });
    }
    for (f, body) in FUNCTIONS {
        out.push(Piece {
            name: f,
            exists: function_exists(f),
            create: (*body).to_owned(),
        });
    }
    out
}

/// `fencer_gw_admit_v1(key, token, lease tag, seq (-1: none), stamp id,
/// hold ms (0: no stamp))` → `(outcome, mark token, mark lease, mark seq,
/// busy ms)`.
///
/// Outcomes: 0 advanced, 1 same, 2 stale, 3 stale sequence, 4 busy (another
/// request is in flight for `busy ms` more; the caller waits and asks
/// again), 5 duplicate sequence. The mark columns are the row as it was
/// (NULL when the key is new). The rule is [`super::decide`]'s.
const ADMIT: &str = r#"
CREATE FUNCTION fencer_gw_admit_v1(p_key text, p_token bigint, p_lease text, p_seq bigint,
                                   p_stamp text, p_hold_ms bigint)
RETURNS TABLE (o_outcome int, o_token bigint, o_lease text, o_seq bigint, o_busy_ms bigint)
LANGUAGE plpgsql AS $fn$
DECLARE
  f record;
  ts timestamptz := clock_timestamp();
  res int;
  stamp_id text := CASE WHEN p_hold_ms > 0 THEN p_stamp END;
  stamp_until timestamptz := CASE WHEN p_hold_ms > 0 THEN ts + p_hold_ms * interval '1 millisecond' END;
BEGIN
  SELECT t.token, t.lease_id, t.seq, t.inflight_id, t.inflight_until INTO f
    FROM fencer_fences t WHERE t.key = p_key FOR UPDATE;
  IF NOT FOUND THEN
    INSERT INTO fencer_fences AS t (key, token, lease_id, seq, inflight_id, inflight_until, updated_at)
    VALUES (p_key, p_token, p_lease, GREATEST(p_seq, 0), stamp_id, stamp_until, ts)
    ON CONFLICT (key) DO NOTHING;
    IF FOUND THEN
      RETURN QUERY SELECT 0, NULL::bigint, NULL::text, NULL::bigint, 0::bigint;
      RETURN;
    END IF;
    -- Inserted concurrently by another replica: decide against its row.
    SELECT t.token, t.lease_id, t.seq, t.inflight_id, t.inflight_until INTO f
      FROM fencer_fences t WHERE t.key = p_key FOR UPDATE;
  END IF;
  IF f.inflight_until IS NOT NULL AND f.inflight_until > ts
     AND f.inflight_id IS DISTINCT FROM p_stamp THEN
    UPDATE fencer_fences t SET wake = true WHERE t.key = p_key;
    RETURN QUERY SELECT 4, f.token, f.lease_id, f.seq,
      GREATEST(1, ceil(extract(epoch FROM f.inflight_until - ts) * 1000))::bigint;
    RETURN;
  END IF;
  IF p_token > f.token THEN res := 0;
  ELSIF p_token < f.token OR f.lease_id <> p_lease THEN res := 2;
  ELSIF p_seq < 0 OR p_seq > f.seq THEN res := 1;
  ELSIF p_seq = f.seq THEN res := 5;
  ELSE res := 3;
  END IF;
  IF res IN (0, 1) THEN
    UPDATE fencer_fences t
       SET token = p_token, lease_id = p_lease,
           seq = CASE WHEN res = 0 THEN GREATEST(p_seq, 0)
                      WHEN p_seq >= 0 THEN p_seq ELSE t.seq END,
           inflight_id = stamp_id, inflight_until = stamp_until, updated_at = ts
     WHERE t.key = p_key;
  END IF;
  RETURN QUERY SELECT res, f.token, f.lease_id, f.seq, 0::bigint;
END
$fn$"#;

/// `fencer_gw_admit_v2(key, token, lease tag, seq (-1: none), stamp id,
/// hold ms (0: no stamp), read)` → `(outcome, mark token, mark lease, mark
/// seq, busy ms, read token)`: `fencer_gw_admit_v1` for leases of either
/// mode (`read`: the token is a read lease's, on a read). Outcome 6 is
/// "shared" (a reader's token above the write mark, not above the read
/// mark: accepted, nothing recorded). The rule is [`super::decide`]'s.
const ADMIT_V2: &str = r#"
CREATE FUNCTION fencer_gw_admit_v2(p_key text, p_token bigint, p_lease text, p_seq bigint,
                                   p_stamp text, p_hold_ms bigint, p_read boolean)
RETURNS TABLE (o_outcome int, o_token bigint, o_lease text, o_seq bigint, o_busy_ms bigint,
               o_read_token bigint)
LANGUAGE plpgsql AS $fn$
DECLARE
  f record;
  ts timestamptz := clock_timestamp();
  res int;
  stamp_id text := CASE WHEN p_hold_ms > 0 THEN p_stamp END;
  stamp_until timestamptz := CASE WHEN p_hold_ms > 0 THEN ts + p_hold_ms * interval '1 millisecond' END;
BEGIN
  SELECT t.token, t.lease_id, t.seq, t.read_token, t.inflight_id, t.inflight_until INTO f
    FROM fencer_fences t WHERE t.key = p_key FOR UPDATE;
  IF NOT FOUND THEN
    INSERT INTO fencer_fences AS t (key, token, lease_id, seq, read_token, inflight_id,
                                    inflight_until, updated_at)
    VALUES (p_key, CASE WHEN p_read THEN 0 ELSE p_token END,
            CASE WHEN p_read THEN '' ELSE p_lease END,
            CASE WHEN p_read THEN 0 ELSE GREATEST(p_seq, 0) END,
            CASE WHEN p_read THEN p_token ELSE 0 END, stamp_id, stamp_until, ts)
    ON CONFLICT (key) DO NOTHING;
    IF FOUND THEN
      RETURN QUERY SELECT 0, NULL::bigint, NULL::text, NULL::bigint, 0::bigint, NULL::bigint;
      RETURN;
    END IF;
    -- Inserted concurrently by another replica: decide against its row.
    SELECT t.token, t.lease_id, t.seq, t.read_token, t.inflight_id, t.inflight_until INTO f
      FROM fencer_fences t WHERE t.key = p_key FOR UPDATE;
  END IF;
  IF f.inflight_until IS NOT NULL AND f.inflight_until > ts
     AND f.inflight_id IS DISTINCT FROM p_stamp THEN
    UPDATE fencer_fences t SET wake = true WHERE t.key = p_key;
    RETURN QUERY SELECT 4, f.token, f.lease_id, f.seq,
      GREATEST(1, ceil(extract(epoch FROM f.inflight_until - ts) * 1000))::bigint, f.read_token;
    RETURN;
  END IF;
  IF p_read THEN
    IF p_token <= f.token THEN res := 2;
    ELSIF p_token > f.read_token THEN res := 0;
    ELSE res := 6;
    END IF;
  ELSIF p_token > f.token AND p_token > f.read_token THEN res := 0;
  ELSIF p_token < f.token OR p_token <= f.read_token OR f.lease_id <> p_lease THEN res := 2;
  ELSIF p_seq < 0 OR p_seq > f.seq THEN res := 1;
  ELSIF p_seq = f.seq THEN res := 5;
  ELSE res := 3;
  END IF;
  IF res IN (0, 1, 6) THEN
    UPDATE fencer_fences t
       SET token = CASE WHEN p_read THEN t.token ELSE p_token END,
           lease_id = CASE WHEN p_read THEN t.lease_id ELSE p_lease END,
           seq = CASE WHEN p_read THEN t.seq
                      WHEN res = 0 THEN GREATEST(p_seq, 0)
                      WHEN p_seq >= 0 THEN p_seq ELSE t.seq END,
           read_token = CASE WHEN p_read AND res = 0 THEN p_token ELSE t.read_token END,
           inflight_id = stamp_id, inflight_until = stamp_until, updated_at = ts
     WHERE t.key = p_key;
  END IF;
  RETURN QUERY SELECT res, f.token, f.lease_id, f.seq, 0::bigint, f.read_token;
END
$fn$"#;

/// `fencer_gw_admit_many_v2(…, reads[])`: `fencer_gw_admit_many_v1` over
/// `fencer_gw_admit_v2`, answering the read token as its last column.
const ADMIT_MANY_V2: &str = r#"
CREATE FUNCTION fencer_gw_admit_many_v2(p_keys text[], p_tokens bigint[], p_leases text[],
                                        p_seqs bigint[], p_stamps text[], p_holds bigint[],
                                        p_reads boolean[])
RETURNS TABLE (o_idx int, o_outcome int, o_token bigint, o_lease text, o_seq bigint,
               o_busy_ms bigint, o_read_token bigint)
LANGUAGE plpgsql AS $fn$
DECLARE
  n int;
BEGIN
  FOR n IN SELECT s.n FROM generate_subscripts(p_keys, 1) AS s(n) ORDER BY p_keys[s.n] COLLATE "C" LOOP
    RETURN QUERY SELECT n, a.o_outcome, a.o_token, a.o_lease, a.o_seq, a.o_busy_ms, a.o_read_token
      FROM fencer_gw_admit_v2(p_keys[n], p_tokens[n], p_leases[n], p_seqs[n], p_stamps[n],
                              p_holds[n], p_reads[n]) a;
  END LOOP;
END
$fn$"#;

/// `fencer_gw_admit_many_v1(keys[], tokens[], lease tags[], seqs[], stamp
/// ids[], hold ms[])` → one row per item, `(index (1-based), outcome, mark
/// token, mark lease, mark seq, busy ms)`: each item admitted by
/// `fencer_gw_admit_v1` itself, in one transaction (one WAL flush for all:
/// [`super::pg_batch`]). Items are taken in key order, so two statements
/// lock shared rows in the same order and cannot deadlock; a key appears at
/// most once per statement (the caller sends each key's current turn only).
const ADMIT_MANY: &str = r#"
CREATE FUNCTION fencer_gw_admit_many_v1(p_keys text[], p_tokens bigint[], p_leases text[],
                                        p_seqs bigint[], p_stamps text[], p_holds bigint[])
RETURNS TABLE (o_idx int, o_outcome int, o_token bigint, o_lease text, o_seq bigint, o_busy_ms bigint)
LANGUAGE plpgsql AS $fn$
DECLARE
  n int;
BEGIN
  FOR n IN SELECT s.n FROM generate_subscripts(p_keys, 1) AS s(n) ORDER BY p_keys[s.n] COLLATE "C" LOOP
    RETURN QUERY SELECT n, a.o_outcome, a.o_token, a.o_lease, a.o_seq, a.o_busy_ms
      FROM fencer_gw_admit_v1(p_keys[n], p_tokens[n], p_leases[n], p_seqs[n], p_stamps[n], p_holds[n]) a;
  END LOOP;
END
$fn$"#;

/// `fencer_gw_finish_v1(key, stamp id, channel)` → whether the stamp was
/// still there. Notifies `channel` when a replica waits for the key.
///
/// Its commit does not wait for the WAL flush (`synchronous_commit` off for
/// this transaction only): a clearing lost in a database crash only leaves
/// the stamp to run out, which is safe, and it saves one flush per request.
/// The admission's commit, which makes the mark durable before the
/// forward, keeps waiting for its flush.
const FINISH: &str = r#"
CREATE FUNCTION fencer_gw_finish_v1(p_key text, p_stamp text, p_channel text)
RETURNS boolean
LANGUAGE plpgsql AS $fn$
DECLARE
  waiting boolean;
BEGIN
  SELECT t.wake INTO waiting FROM fencer_fences t
   WHERE t.key = p_key AND t.inflight_id = p_stamp FOR UPDATE;
  IF NOT FOUND THEN
    RETURN false;
  END IF;
  PERFORM set_config('synchronous_commit', 'off', true);
  UPDATE fencer_fences t SET inflight_id = NULL, inflight_until = NULL, wake = false
   WHERE t.key = p_key;
  IF waiting THEN
    PERFORM pg_notify(p_channel, '');
  END IF;
  RETURN true;
END
$fn$"#;

/// `fencer_gw_finish_many_v1(keys[], stamp ids[], channels[])` → one row
/// per item, `(index (1-based), cleared)`: each by `fencer_gw_finish_v1`,
/// in key order, in one transaction.
const FINISH_MANY: &str = r#"
CREATE FUNCTION fencer_gw_finish_many_v1(p_keys text[], p_stamps text[], p_channels text[])
RETURNS TABLE (o_idx int, o_cleared boolean)
LANGUAGE plpgsql AS $fn$
DECLARE
  n int;
BEGIN
  FOR n IN SELECT s.n FROM generate_subscripts(p_keys, 1) AS s(n) ORDER BY p_keys[s.n] COLLATE "C" LOOP
    RETURN QUERY SELECT n, fencer_gw_finish_v1(p_keys[n], p_stamps[n], p_channels[n]);
  END LOOP;
END
$fn$"#;

pub const CALL_ADMIT: &str = "SELECT * FROM fencer_gw_admit_v2($1, $2, $3, $4, $5, $6, $7)";
pub const CALL_ADMIT_MANY: &str =
    "SELECT * FROM fencer_gw_admit_many_v2($1, $2, $3, $4, $5, $6, $7)";
pub const CALL_FINISH: &str = "SELECT fencer_gw_finish_v1($1, $2, $3)";
pub const CALL_FINISH_MANY: &str = "SELECT * FROM fencer_gw_finish_many_v1($1, $2, $3)";
/// The write mark (a row with only readers' tokens has none).
pub const HIGHEST: &str =
    "SELECT token, lease_id FROM fencer_fences WHERE key = $1 AND lease_id <> ''";
