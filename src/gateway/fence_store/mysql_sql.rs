//! The SQL of the MySQL/MariaDB fence store.
//!
//! `fencer_fences` keeps one row per key, as on PostgreSQL ([`super::sql`]):
//! the mark (`token`, `lease_tag` — the lease's *tag*, never its id — and
//! `seq`) and the in-flight stamp (`inflight_id`, `inflight_until`). Keys,
//! tags and stamp ids are binary strings (`VARBINARY`): compared byte for
//! byte, never through a collation, so 'A' ≠ 'a' and trailing spaces
//! count. Tokens and sequences are `BIGINT` with a `CHECK` that they are
//! not negative (the store refuses tokens above `i64::MAX` before it asks).
//!
//! MySQL has no `UPDATE … RETURNING`: the check-and-advance-and-stamp is a
//! stored procedure, one `CALL`, one round trip, one short transaction
//! (`START TRANSACTION`, the key's row locked `FOR UPDATE`, `COMMIT`) that
//! never outlives the call. An `EXIT HANDLER` rolls the transaction back
//! on any error, so the connection never goes back to the pool with the
//! row locked. Every time is the server's `SYSDATE(6)` — the moment of
//! execution, after the row lock was granted; `NOW(6)` is the statement's
//! start and would date a stamp from before a wait for the lock (the
//! PostgreSQL `now()` bug of issue 10) — in UTC (the session's `time_zone`
//! is pinned by [`crate::mysql`]).
//!
//! Procedures carry a version in their name: a later change gets a new
//! name, so replicas of two versions can run side by side in a roll-out.
//! `fencer_gw_admit_v2` knows read leases (the `read_token` column,
//! [`super`]'s two marks); `_v1` stays for replicas of the previous
//! version.

/// Serializes schema changes of concurrently starting gateways
/// (`GET_LOCK`).
pub const MIGRATE_LOCK: &str = "fencer:gateway_schema";

/// What the schema needs, in order: (name, how to tell it exists, DDL). A
/// piece is created only when its check says it is missing: a start-up
/// against an up-to-date database runs no DDL.
pub fn pieces() -> Vec<crate::mysql::schema::Piece> {
    use crate::mysql::schema::{column_exists, routine_exists as routine, table_exists as table};
    vec![
        ("fencer_fences", table("fencer_fences"), FENCES),
        (
            "read_token",
            column_exists("fencer_fences", "read_token"),
            ADD_READ_TOKEN,
        ),
        ("fencer_gw_admit_v1", routine("fencer_gw_admit_v1"), ADMIT),
        (
            "fencer_gw_admit_v2",
            routine("fencer_gw_admit_v2"),
            ADMIT_V2,
        ),
    ]
}

/// The read mark, added to tables of earlier versions (0: no reader seen).
pub const ADD_READ_TOKEN: &str =
    "ALTER TABLE fencer_fences ADD COLUMN read_token BIGINT NOT NULL DEFAULT 0, \
     ADD CONSTRAINT fencer_fences_read_token_not_negative CHECK (read_token >= 0)";

/// One row per key. `fence_key` is as long as a lock key may be
/// ([`crate::settings::limits::MAX_KEY_BYTES`]); a lease tag is at most 64
/// characters (the token format's bound).
pub const FENCES: &str = "CREATE TABLE IF NOT EXISTS fencer_fences (
  fence_key      VARBINARY(512) NOT NULL PRIMARY KEY,
  token          BIGINT NOT NULL,
  lease_tag      VARBINARY(64) NOT NULL DEFAULT '',
  seq            BIGINT NOT NULL DEFAULT 0,
  updated_at     DATETIME(6) NOT NULL,
  inflight_id    VARBINARY(64) NULL,
  inflight_until DATETIME(6) NULL,
  CONSTRAINT fencer_fences_token_not_negative CHECK (token >= 0),
  CONSTRAINT fencer_fences_seq_not_negative CHECK (seq >= 0)
) ENGINE=InnoDB";

/// `fencer_gw_admit_v1(key, token, lease tag, seq (-1: none), stamp id,
/// hold ms (0: no stamp))` → one row `(outcome, mark token, mark lease,
/// mark seq, busy ms)`.
///
/// Outcomes as on PostgreSQL: 0 advanced, 1 same, 2 stale, 3 stale
/// sequence, 4 busy (another request is in flight for `busy ms` more; the
/// caller waits and asks again), 5 duplicate sequence. The mark columns
/// are the row as it was (NULL when the key is new). The rule is
/// [`super::decide`]'s.
///
/// A new key's row is created by `INSERT … ON DUPLICATE KEY UPDATE`, which
/// takes an *exclusive* lock on a row another replica inserted first (a
/// plain INSERT's duplicate-key error takes a shared one, and two losers
/// each holding it and both asking for the exclusive lock would deadlock).
/// It starts as a placeholder (token 0, empty tag) that this same
/// transaction either turns into the mark or rolls back, so no committed
/// row is ever a placeholder; one found anyway is treated as a new key.
pub const ADMIT: &str = "CREATE PROCEDURE fencer_gw_admit_v1(
  IN p_key VARBINARY(512), IN p_token BIGINT, IN p_lease VARBINARY(64),
  IN p_seq BIGINT, IN p_stamp VARBINARY(64), IN p_hold_ms BIGINT)
MODIFIES SQL DATA
proc: BEGIN
  DECLARE v_found INT DEFAULT 1;
  DECLARE v_new INT DEFAULT 0;
  DECLARE v_token BIGINT;
  DECLARE v_lease VARBINARY(64);
  DECLARE v_seq BIGINT;
  DECLARE v_id VARBINARY(64);
  DECLARE v_until DATETIME(6);
  DECLARE v_now DATETIME(6);
  DECLARE v_res INT;
  DECLARE v_stamp VARBINARY(64) DEFAULT NULL;
  DECLARE v_stamp_until DATETIME(6) DEFAULT NULL;
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
  START TRANSACTION;
  SELECT token, lease_tag, seq, inflight_id, inflight_until
    INTO v_token, v_lease, v_seq, v_id, v_until
    FROM fencer_fences WHERE fence_key = p_key FOR UPDATE;
  IF v_found = 0 THEN
    INSERT INTO fencer_fences (fence_key, token, lease_tag, seq, updated_at)
      VALUES (p_key, 0, '', 0, SYSDATE(6))
      ON DUPLICATE KEY UPDATE token = token;
    SET v_found = 1;
    SELECT token, lease_tag, seq, inflight_id, inflight_until
      INTO v_token, v_lease, v_seq, v_id, v_until
      FROM fencer_fences WHERE fence_key = p_key FOR UPDATE;
  END IF;
  IF v_found = 0 THEN
    SIGNAL SQLSTATE '40001' SET MESSAGE_TEXT = 'fencer_gw_admit_v1: the fence row vanished';
  END IF;
  IF v_token = 0 AND v_lease = '' THEN
    SET v_new = 1;
  END IF;
  SET v_now = SYSDATE(6);
  IF v_until IS NOT NULL AND v_until > v_now AND NOT (v_id <=> p_stamp) THEN
    COMMIT;
    SELECT 4, v_token, v_lease, v_seq,
           GREATEST(1, CEILING(TIMESTAMPDIFF(MICROSECOND, v_now, v_until) / 1000));
    LEAVE proc;
  END IF;
  IF v_new = 1 OR p_token > v_token THEN SET v_res = 0;
  ELSEIF p_token < v_token OR v_lease <> p_lease THEN SET v_res = 2;
  ELSEIF p_seq < 0 OR p_seq > v_seq THEN SET v_res = 1;
  ELSEIF p_seq = v_seq THEN SET v_res = 5;
  ELSE SET v_res = 3;
  END IF;
  IF v_res IN (0, 1) THEN
    IF p_hold_ms > 0 THEN
      SET v_stamp = p_stamp;
      SET v_stamp_until = TIMESTAMPADD(MICROSECOND, p_hold_ms * 1000, v_now);
    END IF;
    UPDATE fencer_fences
       SET token = p_token, lease_tag = p_lease,
           seq = CASE WHEN v_res = 0 THEN GREATEST(p_seq, 0)
                      WHEN p_seq >= 0 THEN p_seq ELSE v_seq END,
           inflight_id = v_stamp, inflight_until = v_stamp_until, updated_at = v_now
     WHERE fence_key = p_key;
  END IF;
  COMMIT;
  IF v_new = 1 THEN
    SELECT v_res, NULL, NULL, NULL, 0;
  ELSE
    SELECT v_res, v_token, v_lease, v_seq, 0;
  END IF;
END";

/// `fencer_gw_admit_v2(key, token, lease tag, seq (-1: none), stamp id,
/// hold ms (0: no stamp), read (1: a read lease's token, on a read))` →
/// one row `(outcome, mark token, mark lease, mark seq, busy ms, read
/// token)`: `fencer_gw_admit_v1` for leases of either mode, outcome 6
/// "shared" as on PostgreSQL. A row is new only when it is a placeholder
/// with no read token either; a row that has only seen readers has write
/// mark 0 and an empty tag.
pub const ADMIT_V2: &str = "CREATE PROCEDURE fencer_gw_admit_v2(
  IN p_key VARBINARY(512), IN p_token BIGINT, IN p_lease VARBINARY(64),
  IN p_seq BIGINT, IN p_stamp VARBINARY(64), IN p_hold_ms BIGINT, IN p_read TINYINT)
MODIFIES SQL DATA
proc: BEGIN
  DECLARE v_found INT DEFAULT 1;
  DECLARE v_new INT DEFAULT 0;
  DECLARE v_token BIGINT;
  DECLARE v_lease VARBINARY(64);
  DECLARE v_seq BIGINT;
  DECLARE v_read BIGINT;
  DECLARE v_id VARBINARY(64);
  DECLARE v_until DATETIME(6);
  DECLARE v_now DATETIME(6);
  DECLARE v_res INT;
  DECLARE v_stamp VARBINARY(64) DEFAULT NULL;
  DECLARE v_stamp_until DATETIME(6) DEFAULT NULL;
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
  START TRANSACTION;
  SELECT token, lease_tag, seq, read_token, inflight_id, inflight_until
    INTO v_token, v_lease, v_seq, v_read, v_id, v_until
    FROM fencer_fences WHERE fence_key = p_key FOR UPDATE;
  IF v_found = 0 THEN
    INSERT INTO fencer_fences (fence_key, token, lease_tag, seq, updated_at)
      VALUES (p_key, 0, '', 0, SYSDATE(6))
      ON DUPLICATE KEY UPDATE token = token;
    SET v_found = 1;
    SELECT token, lease_tag, seq, read_token, inflight_id, inflight_until
      INTO v_token, v_lease, v_seq, v_read, v_id, v_until
      FROM fencer_fences WHERE fence_key = p_key FOR UPDATE;
  END IF;
  IF v_found = 0 THEN
    SIGNAL SQLSTATE '40001' SET MESSAGE_TEXT = 'fencer_gw_admit_v2: the fence row vanished';
  END IF;
  IF v_token = 0 AND v_lease = '' AND v_read = 0 THEN
    SET v_new = 1;
  END IF;
  SET v_now = SYSDATE(6);
  IF v_until IS NOT NULL AND v_until > v_now AND NOT (v_id <=> p_stamp) THEN
    COMMIT;
    SELECT 4, v_token, v_lease, v_seq,
           GREATEST(1, CEILING(TIMESTAMPDIFF(MICROSECOND, v_now, v_until) / 1000)), v_read;
    LEAVE proc;
  END IF;
  IF v_new = 1 THEN SET v_res = 0;
  ELSEIF p_read = 1 THEN
    IF p_token <= v_token THEN SET v_res = 2;
    ELSEIF p_token > v_read THEN SET v_res = 0;
    ELSE SET v_res = 6;
    END IF;
  ELSEIF p_token > v_token AND p_token > v_read THEN SET v_res = 0;
  ELSEIF p_token < v_token OR p_token <= v_read OR v_lease <> p_lease THEN SET v_res = 2;
  ELSEIF p_seq < 0 OR p_seq > v_seq THEN SET v_res = 1;
  ELSEIF p_seq = v_seq THEN SET v_res = 5;
  ELSE SET v_res = 3;
  END IF;
  IF v_res IN (0, 1, 6) THEN
    IF p_hold_ms > 0 THEN
      SET v_stamp = p_stamp;
      SET v_stamp_until = TIMESTAMPADD(MICROSECOND, p_hold_ms * 1000, v_now);
    END IF;
    IF p_read = 1 THEN
      UPDATE fencer_fences
         SET read_token = CASE WHEN v_res = 0 THEN p_token ELSE v_read END,
             inflight_id = v_stamp, inflight_until = v_stamp_until, updated_at = v_now
       WHERE fence_key = p_key;
    ELSE
      UPDATE fencer_fences
         SET token = p_token, lease_tag = p_lease,
             seq = CASE WHEN v_res = 0 THEN GREATEST(p_seq, 0)
                        WHEN p_seq >= 0 THEN p_seq ELSE v_seq END,
             inflight_id = v_stamp, inflight_until = v_stamp_until, updated_at = v_now
       WHERE fence_key = p_key;
    END IF;
  END IF;
  COMMIT;
  IF v_new = 1 THEN
    SELECT v_res, NULL, NULL, NULL, 0, NULL;
  ELSE
    SELECT v_res, v_token, v_lease, v_seq, 0, v_read;
  END IF;
END";

/// `CALL fencer_gw_admit_v2(key, token, lease tag, seq, stamp id, hold ms, read)`.
pub const CALL_ADMIT: &str = "CALL fencer_gw_admit_v2(?, ?, ?, ?, ?, ?, ?)";

/// Clears a stamp if it is still the key's: one statement, autocommit. A
/// clearing lost in a database crash only leaves the stamp to run out.
pub const FINISH: &str = "UPDATE fencer_fences SET inflight_id = NULL, inflight_until = NULL \
     WHERE fence_key = ? AND inflight_id = ?";

/// The key's write mark (a placeholder row, or one that only saw readers,
/// has none).
pub const HIGHEST: &str = "SELECT token, lease_tag FROM fencer_fences \
     WHERE fence_key = ? AND NOT (token = 0 AND lease_tag = '')";

/// The readiness probe's statement: the table is there and readable.
pub const PROBE: &str = "SELECT 1 FROM fencer_fences LIMIT 0";
