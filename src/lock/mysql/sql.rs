//! The SQL of the MySQL/MariaDB lock backend.
//!
//! MySQL has no `UPDATE … RETURNING`, so each operation is a stored
//! procedure: one round trip, one short transaction (`START TRANSACTION`,
//! the key's row locked `FOR UPDATE`, `COMMIT`) that never outlives the
//! call — no transaction or row lock is held while the application works.
//! Every time is the server's: `SYSDATE(6)` (the moment of execution, so a
//! lease counts from when its row lock was granted, not from before a wait
//! for it — `NOW(6)` is the statement's start, the PostgreSQL `now()` bug
//! of issue 10), in UTC (the session's `time_zone` is pinned).
//!
//! Procedures carry a version in their name: a newer fencer adds new ones
//! instead of replacing what older sidecars still call.

/// What the schema needs, in order: (name, how to tell it exists, DDL).
/// A piece is created only when the check says it is missing
/// ([`super::schema`]).
pub fn pieces() -> Vec<crate::mysql::schema::Piece> {
    use crate::mysql::schema::{
        column_exists as column, routine_exists as routine, table_exists as table,
    };
    vec![
        ("fencer_locks", table("fencer_locks"), LOCKS),
        ("fencer_token_floor", table("fencer_token_floor"), FLOOR),
        (
            "fencer_token_floor row",
            "SELECT COUNT(*) FROM fencer_token_floor WHERE id = 1".into(),
            "INSERT IGNORE INTO fencer_token_floor (id, floor) VALUES (1, 0)",
        ),
        (
            "fencer_locks.attempt_id",
            column("fencer_locks", "attempt_id"),
            ADD_ATTEMPT,
        ),
        (
            "fencer_locks.holds_lease",
            column("fencer_locks", "holds_lease"),
            ADD_HOLDS,
        ),
        (
            "fencer_lock_holds_v1",
            routine("fencer_lock_holds_v1"),
            HOLDS_PROC,
        ),
        (
            "fencer_lock_acquire_v1",
            routine("fencer_lock_acquire_v1"),
            ACQUIRE_PROC,
        ),
        (
            "fencer_lock_acquire_v2",
            routine("fencer_lock_acquire_v2"),
            ACQUIRE_V2_PROC,
        ),
        (
            "fencer_lock_acquire_v3",
            routine("fencer_lock_acquire_v3"),
            ACQUIRE_V3_PROC.as_str(),
        ),
        (
            "fencer_lock_renew_v1",
            routine("fencer_lock_renew_v1"),
            RENEW_PROC,
        ),
        (
            "fencer_lock_renew_many_v1",
            routine("fencer_lock_renew_many_v1"),
            RENEW_MANY_PROC,
        ),
        (
            "fencer_lock_release_v1",
            routine("fencer_lock_release_v1"),
            RELEASE_PROC,
        ),
        (
            "fencer_lock_release_attempt_v1",
            routine("fencer_lock_release_attempt_v1"),
            RELEASE_ATTEMPT_PROC,
        ),
        (
            "fencer_locks.read_until",
            column("fencer_locks", "read_until"),
            ADD_READERS,
        ),
        ("fencer_readers", table("fencer_readers"), READERS),
        (
            "fencer_lock_acquire_v4",
            routine("fencer_lock_acquire_v4"),
            ACQUIRE_V4_PROC.as_str(),
        ),
        (
            "fencer_lock_read_acquire_v1",
            routine("fencer_lock_read_acquire_v1"),
            READ_ACQUIRE_PROC,
        ),
        (
            "fencer_lock_acquire_v5",
            routine("fencer_lock_acquire_v5"),
            ACQUIRE_V5_PROC.as_str(),
        ),
        (
            "fencer_lock_read_acquire_v2",
            routine("fencer_lock_read_acquire_v2"),
            READ_ACQUIRE_V2_PROC.as_str(),
        ),
        (
            "fencer_lock_read_renew_v1",
            routine("fencer_lock_read_renew_v1"),
            READ_RENEW_PROC,
        ),
        (
            "fencer_lock_read_release_v1",
            routine("fencer_lock_read_release_v1"),
            READ_RELEASE_PROC,
        ),
        ("fencer_semaphores", table("fencer_semaphores"), SEMAPHORES),
        (
            "fencer_semaphore_permits_v1",
            routine("fencer_semaphore_permits_v1"),
            PERMITS_PROC,
        ),
    ]
}

/// One row per key; a released or expired row is reused by the next
/// acquire and its `token` is the key's counter. Keys and lease ids are
/// binary strings: compared byte for byte ('A' ≠ 'a', trailing spaces
/// count), never through a collation.
const LOCKS: &str = "CREATE TABLE IF NOT EXISTS fencer_locks (
  lock_key   VARBINARY(512) NOT NULL PRIMARY KEY,
  lease_id   VARBINARY(128) NULL,
  token      BIGINT NOT NULL,
  expires_at DATETIME(6) NULL,
  updated_at DATETIME(6) NOT NULL,
  -- Lock-delay of the current lease: after an expiry (not a release) the
  -- key stays unavailable until expires_at + delay_ms.
  delay_ms   BIGINT NOT NULL DEFAULT 0,
  -- The acquire attempt that last granted or confirmed the current lease
  -- (ADD_ATTEMPT says why).
  attempt_id VARBINARY(64) NULL,
  KEY fencer_locks_updated_at (updated_at)
) ENGINE=InnoDB";

/// An undo must name the *attempt*, not the lease (PITFALLS 11, issue 26
/// item 1): an acquire is idempotent per lease id, so a retry after a
/// timeout is answered "held" with the same lease while the first try's
/// late reply is still on its way; that try's compensation, keyed by the
/// lease alone, then released the lease the retry had just handed out.
/// Every grant or confirmation writes its attempt id here, and the
/// compensation ([`RELEASE_ATTEMPT_PROC`]) releases only while the row
/// still carries its own attempt. A table created before this column
/// existed gets it on start-up (added once, then never touched again).
const ADD_ATTEMPT: &str = "ALTER TABLE fencer_locks ADD COLUMN attempt_id VARBINARY(64) NULL";

/// Reentrancy: a lease's hold count and owner, valid only while
/// `holds_lease` is the lease holding the row (a new grant, which does not
/// touch them, starts from one hold).
const ADD_HOLDS: &str = "ALTER TABLE fencer_locks ADD COLUMN holds INT NULL,
  ADD COLUMN holds_lease VARBINARY(128) NULL, ADD COLUMN holds_owner VARBINARY(512) NULL,
  ADD COLUMN holds_op VARBINARY(64) NULL";

/// (key, lease, expected count or NULL to read, new count, owner, change
/// id) → one row (status, holds, owner, applied): status 1 when the lease
/// holds the key (the count — 1 when none is recorded for this lease — set
/// to the new one, with the owner, if it was the expected one, unless this
/// change was made already: `applied` either way), 0 free, -1 another's.
const HOLDS_PROC: &str = "CREATE PROCEDURE fencer_lock_holds_v1(
  IN p_key VARBINARY(512), IN p_lease VARBINARY(128), IN p_expect INT,
  IN p_to INT, IN p_owner VARBINARY(512), IN p_op VARBINARY(64))
proc: BEGIN
  DECLARE v_found INT DEFAULT 1;
  DECLARE v_lease VARBINARY(128);
  DECLARE v_exp DATETIME(6);
  DECLARE v_holds INT;
  DECLARE v_holds_lease VARBINARY(128);
  DECLARE v_owner VARBINARY(512);
  DECLARE v_op VARBINARY(64);
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
  START TRANSACTION;
  SELECT lease_id, expires_at, holds, holds_lease, holds_owner, holds_op
    INTO v_lease, v_exp, v_holds, v_holds_lease, v_owner, v_op
    FROM fencer_locks WHERE lock_key = p_key FOR UPDATE;
  IF v_found = 0 OR v_lease IS NULL OR v_exp <= SYSDATE(6) THEN
    COMMIT;
    SELECT 0, 0, NULL, 0;
    LEAVE proc;
  END IF;
  IF v_lease <> p_lease THEN
    COMMIT;
    SELECT -1, 0, NULL, 0;
    LEAVE proc;
  END IF;
  IF v_holds_lease IS NULL OR v_holds_lease <> p_lease THEN
    SET v_holds = 1;
    SET v_owner = NULL;
    SET v_op = NULL;
  END IF;
  IF p_op IS NOT NULL AND v_op = p_op THEN
    COMMIT;
    SELECT 1, v_holds, v_owner, 1;
    LEAVE proc;
  END IF;
  IF p_expect IS NOT NULL AND v_holds = p_expect THEN
    UPDATE fencer_locks SET holds = p_to, holds_lease = p_lease, holds_owner = p_owner,
                            holds_op = p_op
     WHERE lock_key = p_key;
    COMMIT;
    SELECT 1, p_to, p_owner, 1;
    LEAVE proc;
  END IF;
  COMMIT;
  SELECT 1, v_holds, v_owner, 0;
END";

/// Read-write locks: until when the key's last read lease lasts, and until
/// when a writer waiting for them keeps new readers out (writer
/// preference). Every reader's change locks the key's row first, so a
/// writer — which locks it too — decides on the row it holds.
const ADD_READERS: &str = "ALTER TABLE fencer_locks ADD COLUMN read_until DATETIME(6) NULL,
  ADD COLUMN write_wait DATETIME(6) NULL";

/// Read leases, one row each (expired ones deleted by the clean-up).
const READERS: &str = "CREATE TABLE IF NOT EXISTS fencer_readers (
  lock_key   VARBINARY(512) NOT NULL,
  lease_id   VARBINARY(128) NOT NULL,
  token      BIGINT NOT NULL,
  expires_at DATETIME(6) NOT NULL,
  attempt_id VARBINARY(64) NULL,
  PRIMARY KEY (lock_key, lease_id),
  KEY fencer_readers_expires_at (expires_at)
) ENGINE=InnoDB";

/// [`ACQUIRE_V3_PROC`] that also finds read leases: a key whose last
/// reader lasts past now is held for a writer (status -1, no bell: the
/// writer re-checks within a second), and marks `write_wait` a second past
/// that re-check, keeping new readers out; a grant clears the mark
/// (memory.rs, `WRITER_RECHECK`).
pub static ACQUIRE_V4_PROC: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let mut p = ACQUIRE_V3_PROC.replacen("fencer_lock_acquire_v3", "fencer_lock_acquire_v4", 1);
    let swaps = [
        (
            "  DECLARE v_now DATETIME(6);\n",
            "  DECLARE v_now DATETIME(6);\n  DECLARE v_read DATETIME(6);\n",
        ),
        (
            "  SET v_now = SYSDATE(6);\n  IF v_lease IS NULL OR",
            "  SET v_now = SYSDATE(6);\n  SELECT read_until INTO v_read FROM fencer_locks WHERE lock_key = p_key;\n  \
             IF v_read > v_now AND (v_lease IS NULL OR v_exp <= v_now) THEN\n    \
             UPDATE fencer_locks SET write_wait = TIMESTAMPADD(SECOND, 1, \
             LEAST(v_read, TIMESTAMPADD(SECOND, 1, v_now))) WHERE lock_key = p_key;\n    \
             COMMIT;\n    \
             SELECT -1, v_token, LEAST(1000, TIMESTAMPDIFF(MICROSECOND, v_now, v_read) DIV 1000), 0;\n    \
             LEAVE proc;\n  END IF;\n  IF v_lease IS NULL OR",
        ),
        (
            "updated_at = v_now, delay_ms = p_delay, attempt_id = p_attempt\n",
            "updated_at = v_now, delay_ms = p_delay, attempt_id = p_attempt, write_wait = NULL\n",
        ),
    ];
    for (from, to) in swaps {
        assert_eq!(p.matches(from).count(), 1, "v3 text: {from}");
        p = p.replacen(from, to, 1);
    }
    p
});

/// A confirmation of a grant by a later try of its lease takes the grant's
/// undo from the earlier try — never the reverse. The confirm branches
/// wrote `attempt_id = p_attempt` whatever the row carried, so the
/// statement of a try whose caller gave up, reaching the server *after*
/// its retry had been answered, took the grant back for its own undo, and
/// that undo then released the lease the retry had handed to the
/// application (a second holder: the `seams` fault family found it, M1 at
/// seed 62877). Attempt ids of one process sort in the order they were
/// made ([`crate::lock::lease_id::attempt_id`]).
const LATER_ATTEMPT: &str = "(attempt_id IS NULL OR attempt_id < p_attempt)";

/// [`ACQUIRE_V4_PROC`] whose confirmation of an existing grant keeps the
/// later attempt ([`LATER_ATTEMPT`]).
pub static ACQUIRE_V5_PROC: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let confirm = "    UPDATE fencer_locks SET attempt_id = p_attempt WHERE lock_key = p_key;\n";
    assert_eq!(
        ACQUIRE_V4_PROC.matches(confirm).count(),
        1,
        "v4's confirm branch"
    );
    ACQUIRE_V4_PROC
        .replacen("fencer_lock_acquire_v4", "fencer_lock_acquire_v5", 1)
        .replacen(
        confirm,
        &format!(
            "    UPDATE fencer_locks SET attempt_id = p_attempt WHERE lock_key = p_key AND {LATER_ATTEMPT};\n"
        ),
        1,
    )
});

/// [`READ_ACQUIRE_PROC`] whose confirmation of an existing reader keeps the
/// later attempt ([`LATER_ATTEMPT`]).
pub static READ_ACQUIRE_V2_PROC: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let swaps = [
        ("fencer_lock_read_acquire_v1", "fencer_lock_read_acquire_v2".to_owned()),
        (
            "    UPDATE fencer_readers SET attempt_id = p_attempt WHERE lock_key = p_key AND lease_id = p_lease;\n",
            format!("    UPDATE fencer_readers SET attempt_id = p_attempt WHERE lock_key = p_key AND lease_id = p_lease AND {LATER_ATTEMPT};\n"),
        ),
        (
            "                            attempt_id = VALUES(attempt_id);\n",
            "                            attempt_id = IF(attempt_id IS NULL OR attempt_id < VALUES(attempt_id), VALUES(attempt_id), attempt_id);\n".to_owned(),
        ),
    ];
    let mut p = READ_ACQUIRE_PROC.to_owned();
    for (from, to) in swaps {
        assert_eq!(p.matches(from).count(), 1, "read v1 text: {from}");
        p = p.replacen(from, &to, 1);
    }
    p
});

/// A read lease's acquire: (key, lease, ttl ms, bell name, attempt) →
/// (status, token, remaining ms, bell holder) as [`ACQUIRE_V4_PROC`]'s. Under
/// the key's row lock (the row created above the floor when missing, with
/// no lease): already this lease's reader → its token; a write lease holds
/// the key (its bell holder answered, for the waiter to watch) or a writer
/// waits → held; a write lease's lock-delay → -3; else a reader row with
/// the key's next token and `read_until` raised to cover it.
const READ_ACQUIRE_PROC: &str = "CREATE PROCEDURE fencer_lock_read_acquire_v1(
  IN p_key VARBINARY(512), IN p_lease VARBINARY(128), IN p_ttl BIGINT,
  IN p_bell VARCHAR(64), IN p_attempt VARBINARY(64))
proc: BEGIN
  DECLARE v_found INT DEFAULT 1;
  DECLARE v_dup INT DEFAULT 0;
  DECLARE v_lease VARBINARY(128);
  DECLARE v_token BIGINT;
  DECLARE v_exp DATETIME(6);
  DECLARE v_delay BIGINT;
  DECLARE v_wait DATETIME(6);
  DECLARE v_floor BIGINT;
  DECLARE v_now DATETIME(6);
  DECLARE v_mine BIGINT;
  DECLARE v_until DATETIME(6);
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
  DECLARE CONTINUE HANDLER FOR 1062 SET v_dup = 1;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
  START TRANSACTION;
  SELECT lease_id, token, expires_at, delay_ms, write_wait INTO v_lease, v_token, v_exp, v_delay, v_wait
    FROM fencer_locks WHERE lock_key = p_key FOR UPDATE;
  IF v_found = 0 THEN
    SET v_found = 1;
    SELECT floor INTO v_floor FROM fencer_token_floor WHERE id = 1 LOCK IN SHARE MODE;
    INSERT INTO fencer_locks (lock_key, lease_id, token, updated_at)
      VALUES (p_key, NULL, v_floor, SYSDATE(6));
    SELECT lease_id, token, expires_at, delay_ms, write_wait INTO v_lease, v_token, v_exp, v_delay, v_wait
      FROM fencer_locks WHERE lock_key = p_key FOR UPDATE;
  END IF;
  SET v_now = SYSDATE(6);
  SET v_found = 1;
  SELECT token INTO v_mine FROM fencer_readers
   WHERE lock_key = p_key AND lease_id = p_lease AND expires_at > v_now;
  IF v_found = 1 THEN
    UPDATE fencer_readers SET attempt_id = p_attempt WHERE lock_key = p_key AND lease_id = p_lease;
    COMMIT;
    SELECT 1, v_mine, 0, 0;
    LEAVE proc;
  END IF;
  IF v_lease IS NOT NULL AND v_exp > v_now THEN
    COMMIT;
    SELECT -1, v_token, GREATEST(0, TIMESTAMPDIFF(MICROSECOND, v_now, v_exp) DIV 1000),
           COALESCE(IS_USED_LOCK(p_bell), 0);
    LEAVE proc;
  END IF;
  IF v_wait > v_now THEN
    COMMIT;
    SELECT -1, v_token, GREATEST(0, TIMESTAMPDIFF(MICROSECOND, v_now, v_wait) DIV 1000), 0;
    LEAVE proc;
  END IF;
  IF v_lease IS NOT NULL AND TIMESTAMPADD(MICROSECOND, v_delay * 1000, v_exp) > v_now THEN
    COMMIT;
    SELECT -3, v_token, GREATEST(0, TIMESTAMPDIFF(MICROSECOND, v_now,
                          TIMESTAMPADD(MICROSECOND, v_delay * 1000, v_exp)) DIV 1000), 0;
    LEAVE proc;
  END IF;
  SET v_until = TIMESTAMPADD(MICROSECOND, p_ttl * 1000, v_now);
  UPDATE fencer_locks
     SET token = v_token + 1, lease_id = NULL, expires_at = NULL, write_wait = NULL,
         read_until = GREATEST(COALESCE(read_until, v_now), v_until), updated_at = v_now
   WHERE lock_key = p_key;
  INSERT INTO fencer_readers (lock_key, lease_id, token, expires_at, attempt_id)
    VALUES (p_key, p_lease, v_token + 1, v_until, p_attempt)
    ON DUPLICATE KEY UPDATE token = VALUES(token), expires_at = VALUES(expires_at),
                            attempt_id = VALUES(attempt_id);
  COMMIT;
  SELECT 1, v_token + 1, 0, 0;
END";

/// A read lease's renewal: (key, lease, ttl ms) → (status, token) as
/// [`RENEW_PROC`]'s, `read_until` raised to cover it.
const READ_RENEW_PROC: &str = "CREATE PROCEDURE fencer_lock_read_renew_v1(
  IN p_key VARBINARY(512), IN p_lease VARBINARY(128), IN p_ttl BIGINT)
proc: BEGIN
  DECLARE v_found INT DEFAULT 1;
  DECLARE v_lease VARBINARY(128);
  DECLARE v_token BIGINT;
  DECLARE v_exp DATETIME(6);
  DECLARE v_mine BIGINT;
  DECLARE v_now DATETIME(6);
  DECLARE v_until DATETIME(6);
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
  START TRANSACTION;
  SELECT lease_id, token, expires_at INTO v_lease, v_token, v_exp
    FROM fencer_locks WHERE lock_key = p_key FOR UPDATE;
  IF v_found = 0 THEN
    COMMIT;
    SELECT 0, 0;
    LEAVE proc;
  END IF;
  SET v_now = SYSDATE(6);
  SELECT token INTO v_mine FROM fencer_readers
   WHERE lock_key = p_key AND lease_id = p_lease AND expires_at > v_now;
  IF v_found = 0 THEN
    COMMIT;
    SELECT IF(v_lease IS NOT NULL AND v_exp > v_now, -1, 0), v_token;
    LEAVE proc;
  END IF;
  SET v_until = TIMESTAMPADD(MICROSECOND, p_ttl * 1000, v_now);
  UPDATE fencer_readers SET expires_at = v_until WHERE lock_key = p_key AND lease_id = p_lease;
  UPDATE fencer_locks SET read_until = GREATEST(COALESCE(read_until, v_now), v_until), updated_at = v_now
   WHERE lock_key = p_key;
  COMMIT;
  SELECT 1, v_mine;
END";

/// A read lease's release, or (with an attempt id) the compensation of a
/// read acquire whose caller gave up — only while the reader row still
/// carries that attempt: (key, lease, attempt or NULL) → (status, token)
/// as [`RELEASE_PROC`]'s. `read_until` becomes the end of the last reader
/// left (NULL: none).
const READ_RELEASE_PROC: &str = "CREATE PROCEDURE fencer_lock_read_release_v1(
  IN p_key VARBINARY(512), IN p_lease VARBINARY(128), IN p_attempt VARBINARY(64))
proc: BEGIN
  DECLARE v_found INT DEFAULT 1;
  DECLARE v_lease VARBINARY(128);
  DECLARE v_token BIGINT;
  DECLARE v_exp DATETIME(6);
  DECLARE v_mine BIGINT;
  DECLARE v_mine_exp DATETIME(6);
  DECLARE v_attempt VARBINARY(64);
  DECLARE v_now DATETIME(6);
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
  START TRANSACTION;
  SELECT lease_id, token, expires_at INTO v_lease, v_token, v_exp
    FROM fencer_locks WHERE lock_key = p_key FOR UPDATE;
  IF v_found = 0 THEN
    COMMIT;
    SELECT 0, 0;
    LEAVE proc;
  END IF;
  SET v_now = SYSDATE(6);
  SELECT token, expires_at, attempt_id INTO v_mine, v_mine_exp, v_attempt FROM fencer_readers
   WHERE lock_key = p_key AND lease_id = p_lease;
  IF v_found = 0 OR (p_attempt IS NOT NULL AND NOT (v_attempt <=> p_attempt)) THEN
    COMMIT;
    SELECT IF(v_lease IS NOT NULL AND v_exp > v_now, -1, 0), v_token;
    LEAVE proc;
  END IF;
  DELETE FROM fencer_readers WHERE lock_key = p_key AND lease_id = p_lease;
  UPDATE fencer_locks
     SET read_until = (SELECT MAX(r.expires_at) FROM fencer_readers r
                        WHERE r.lock_key = p_key AND r.expires_at > v_now),
         updated_at = v_now
   WHERE lock_key = p_key;
  COMMIT;
  SELECT IF(v_mine_exp > v_now, 1, 0), v_mine;
END";

/// Semaphores' permit counts, fixed at first use (never deleted: see
/// `LockBackend::fix_permits`).
const SEMAPHORES: &str = "CREATE TABLE IF NOT EXISTS fencer_semaphores (
  name    VARBINARY(512) NOT NULL PRIMARY KEY,
  permits INT NOT NULL
) ENGINE=InnoDB";

/// (name, permits) → one row (the count that stands). Two statements
/// under autocommit: a racing first use's INSERT waits for the other's
/// commit and is ignored; the SELECT, a statement of its own, sees it.
const PERMITS_PROC: &str = "CREATE PROCEDURE fencer_semaphore_permits_v1(
  IN p_name VARBINARY(512), IN p_permits INT)
BEGIN
  INSERT IGNORE INTO fencer_semaphores (name, permits) VALUES (p_name, p_permits);
  SELECT permits FROM fencer_semaphores WHERE name = p_name;
END";

pub const PERMITS: &str = "CALL fencer_semaphore_permits_v1(?, ?)";

/// The token floor: a key whose row was deleted by the clean-up starts
/// above it, so its tokens never go backwards.
const FLOOR: &str = "CREATE TABLE IF NOT EXISTS fencer_token_floor (
  id    TINYINT NOT NULL PRIMARY KEY,
  floor BIGINT NOT NULL
) ENGINE=InnoDB";

/// (key, lease, ttl ms, lock-delay ms, bell name) → one row
/// (status, token, remaining ms, bell holder): status 1 acquired (or
/// already this lease's), -1 held by another lease; `bell holder` is the
/// connection id holding the key's bell (`IS_USED_LOCK`), 0 if none.
///
/// A new key's row is created above the floor, reading it under a shared
/// lock that the clean-up's exclusive lock orders against. Two first
/// acquires of a key race on the primary key: the loser's INSERT waits for
/// the winner's commit, fails with 1062 (handled), and reads the row the
/// winner committed.
pub const ACQUIRE_PROC: &str = "CREATE PROCEDURE fencer_lock_acquire_v1(
  IN p_key VARBINARY(512), IN p_lease VARBINARY(128), IN p_ttl BIGINT,
  IN p_delay BIGINT, IN p_bell VARCHAR(64))
proc: BEGIN
  DECLARE v_found INT DEFAULT 1;
  DECLARE v_dup INT DEFAULT 0;
  DECLARE v_lease VARBINARY(128);
  DECLARE v_token BIGINT;
  DECLARE v_exp DATETIME(6);
  DECLARE v_delay BIGINT;
  DECLARE v_floor BIGINT;
  DECLARE v_now DATETIME(6);
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
  DECLARE CONTINUE HANDLER FOR 1062 SET v_dup = 1;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
  START TRANSACTION;
  SELECT lease_id, token, expires_at, delay_ms INTO v_lease, v_token, v_exp, v_delay
    FROM fencer_locks WHERE lock_key = p_key FOR UPDATE;
  IF v_found = 0 THEN
    SET v_found = 1;
    SELECT floor INTO v_floor FROM fencer_token_floor WHERE id = 1 LOCK IN SHARE MODE;
    SET v_now = SYSDATE(6);
    INSERT INTO fencer_locks (lock_key, lease_id, token, expires_at, updated_at, delay_ms)
      VALUES (p_key, p_lease, v_floor + 1,
              TIMESTAMPADD(MICROSECOND, p_ttl * 1000, v_now), v_now, p_delay);
    IF v_dup = 0 THEN
      COMMIT;
      SELECT 1, v_floor + 1, 0, 0;
      LEAVE proc;
    END IF;
    SELECT lease_id, token, expires_at, delay_ms INTO v_lease, v_token, v_exp, v_delay
      FROM fencer_locks WHERE lock_key = p_key FOR UPDATE;
  END IF;
  SET v_now = SYSDATE(6);
  IF v_lease IS NULL OR TIMESTAMPADD(MICROSECOND, v_delay * 1000, v_exp) <= v_now THEN
    UPDATE fencer_locks
       SET lease_id = p_lease, token = v_token + 1,
           expires_at = TIMESTAMPADD(MICROSECOND, p_ttl * 1000, v_now),
           updated_at = v_now, delay_ms = p_delay
     WHERE lock_key = p_key;
    COMMIT;
    SELECT 1, v_token + 1, 0, 0;
  ELSEIF v_lease = p_lease AND v_exp > v_now THEN
    COMMIT;
    SELECT 1, v_token, 0, 0;
  ELSE
    COMMIT;
    SELECT -1, v_token,
           GREATEST(0, TIMESTAMPDIFF(MICROSECOND, v_now,
                         TIMESTAMPADD(MICROSECOND, v_delay * 1000, v_exp)) DIV 1000),
           COALESCE(IS_USED_LOCK(p_bell), 0);
  END IF;
END";

/// [`ACQUIRE_PROC`] with the attempt id (key, lease, ttl ms, lock-delay
/// ms, bell name, attempt) → the same row. Every grant, and every
/// confirmation of an existing grant to the same lease (a retry), stores
/// the attempt id ([`ADD_ATTEMPT`] says why). The v1 procedure stays for
/// sidecars of earlier versions during a rolling upgrade.
pub const ACQUIRE_V2_PROC: &str = "CREATE PROCEDURE fencer_lock_acquire_v2(
  IN p_key VARBINARY(512), IN p_lease VARBINARY(128), IN p_ttl BIGINT,
  IN p_delay BIGINT, IN p_bell VARCHAR(64), IN p_attempt VARBINARY(64))
proc: BEGIN
  DECLARE v_found INT DEFAULT 1;
  DECLARE v_dup INT DEFAULT 0;
  DECLARE v_lease VARBINARY(128);
  DECLARE v_token BIGINT;
  DECLARE v_exp DATETIME(6);
  DECLARE v_delay BIGINT;
  DECLARE v_floor BIGINT;
  DECLARE v_now DATETIME(6);
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
  DECLARE CONTINUE HANDLER FOR 1062 SET v_dup = 1;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
  START TRANSACTION;
  SELECT lease_id, token, expires_at, delay_ms INTO v_lease, v_token, v_exp, v_delay
    FROM fencer_locks WHERE lock_key = p_key FOR UPDATE;
  IF v_found = 0 THEN
    SET v_found = 1;
    SELECT floor INTO v_floor FROM fencer_token_floor WHERE id = 1 LOCK IN SHARE MODE;
    SET v_now = SYSDATE(6);
    INSERT INTO fencer_locks (lock_key, lease_id, token, expires_at, updated_at, delay_ms, attempt_id)
      VALUES (p_key, p_lease, v_floor + 1,
              TIMESTAMPADD(MICROSECOND, p_ttl * 1000, v_now), v_now, p_delay, p_attempt);
    IF v_dup = 0 THEN
      COMMIT;
      SELECT 1, v_floor + 1, 0, 0;
      LEAVE proc;
    END IF;
    SELECT lease_id, token, expires_at, delay_ms INTO v_lease, v_token, v_exp, v_delay
      FROM fencer_locks WHERE lock_key = p_key FOR UPDATE;
  END IF;
  SET v_now = SYSDATE(6);
  IF v_lease IS NULL OR TIMESTAMPADD(MICROSECOND, v_delay * 1000, v_exp) <= v_now THEN
    UPDATE fencer_locks
       SET lease_id = p_lease, token = v_token + 1,
           expires_at = TIMESTAMPADD(MICROSECOND, p_ttl * 1000, v_now),
           updated_at = v_now, delay_ms = p_delay, attempt_id = p_attempt
     WHERE lock_key = p_key;
    COMMIT;
    SELECT 1, v_token + 1, 0, 0;
  ELSEIF v_lease = p_lease AND v_exp > v_now THEN
    -- A retry confirms the grant: from now on only this attempt may undo it.
    UPDATE fencer_locks SET attempt_id = p_attempt WHERE lock_key = p_key;
    COMMIT;
    SELECT 1, v_token, 0, 0;
  ELSE
    COMMIT;
    SELECT -1, v_token,
           GREATEST(0, TIMESTAMPDIFF(MICROSECOND, v_now,
                         TIMESTAMPADD(MICROSECOND, v_delay * 1000, v_exp)) DIV 1000),
           COALESCE(IS_USED_LOCK(p_bell), 0);
  END IF;
END";

/// [`ACQUIRE_V2_PROC`] telling a key in lock-delay from a held one: status
/// -3 when nobody holds the key but the last lease expired less than its
/// lock-delay ago (`remaining` is the delay's), -1 only while a lease
/// holds it. Made from the v2 text, so the two cannot drift apart.
pub static ACQUIRE_V3_PROC: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let held = "    SELECT -1, v_token,\n";
    assert_eq!(ACQUIRE_V2_PROC.matches(held).count(), 1, "v2's held branch");
    ACQUIRE_V2_PROC
        .replacen("fencer_lock_acquire_v2", "fencer_lock_acquire_v3", 1)
        .replacen(held, "    SELECT IF(v_exp > v_now, -1, -3), v_token,\n", 1)
});

/// (key, lease, ttl ms) → (status, token): 1 renewed, 0 not held (expired
/// or released), -1 held by another lease.
pub const RENEW_PROC: &str = "CREATE PROCEDURE fencer_lock_renew_v1(
  IN p_key VARBINARY(512), IN p_lease VARBINARY(128), IN p_ttl BIGINT)
BEGIN
  DECLARE v_found INT DEFAULT 1;
  DECLARE v_lease VARBINARY(128);
  DECLARE v_token BIGINT;
  DECLARE v_exp DATETIME(6);
  DECLARE v_now DATETIME(6);
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
  START TRANSACTION;
  SELECT lease_id, token, expires_at INTO v_lease, v_token, v_exp
    FROM fencer_locks WHERE lock_key = p_key FOR UPDATE;
  SET v_now = SYSDATE(6);
  IF v_found = 0 THEN
    COMMIT;
    SELECT 0, 0;
  ELSEIF v_lease = p_lease AND v_exp > v_now THEN
    UPDATE fencer_locks
       SET expires_at = TIMESTAMPADD(MICROSECOND, p_ttl * 1000, v_now), updated_at = v_now
     WHERE lock_key = p_key;
    COMMIT;
    SELECT 1, v_token;
  ELSE
    COMMIT;
    SELECT IF(v_lease IS NULL OR v_lease = p_lease OR v_exp <= v_now, 0, -1), v_token;
  END IF;
END";

/// (JSON `[[hex key, lease, ttl ms], …]`) → one row per item, in order:
/// (renewed 0/1, token). One transaction, one moment (`v_now`) for all:
/// a lease renewed from an earlier instant only ends earlier.
pub const RENEW_MANY_PROC: &str = "CREATE PROCEDURE fencer_lock_renew_many_v1(IN p_items LONGTEXT)
BEGIN
  DECLARE v_now DATETIME(6);
  DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
  START TRANSACTION;
  SET v_now = SYSDATE(6);
  UPDATE fencer_locks l
    JOIN JSON_TABLE(p_items, '$[*]' COLUMNS (
           k VARCHAR(1024) PATH '$[0]', le VARCHAR(256) PATH '$[1]', ttl BIGINT PATH '$[2]')) t
      ON l.lock_key = UNHEX(t.k) AND l.lease_id = CAST(t.le AS BINARY)
     SET l.expires_at = TIMESTAMPADD(MICROSECOND, t.ttl * 1000, v_now), l.updated_at = v_now
   WHERE l.expires_at > v_now;
  SELECT IF(l.updated_at = v_now AND l.lease_id = CAST(t.le AS BINARY), 1, 0),
         COALESCE(l.token, 0)
    FROM JSON_TABLE(p_items, '$[*]' COLUMNS (
           n FOR ORDINALITY, k VARCHAR(1024) PATH '$[0]', le VARCHAR(256) PATH '$[1]')) t
    LEFT JOIN fencer_locks l ON l.lock_key = UNHEX(t.k)
   ORDER BY t.n;
  COMMIT;
END";

/// (key, lease) → (status, token), statuses as for renew. Releasing frees
/// the key at once (no lock-delay: the holder said it is done).
pub const RELEASE_PROC: &str = "CREATE PROCEDURE fencer_lock_release_v1(
  IN p_key VARBINARY(512), IN p_lease VARBINARY(128))
BEGIN
  DECLARE v_found INT DEFAULT 1;
  DECLARE v_lease VARBINARY(128);
  DECLARE v_token BIGINT;
  DECLARE v_exp DATETIME(6);
  DECLARE v_now DATETIME(6);
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
  START TRANSACTION;
  SELECT lease_id, token, expires_at INTO v_lease, v_token, v_exp
    FROM fencer_locks WHERE lock_key = p_key FOR UPDATE;
  SET v_now = SYSDATE(6);
  IF v_found = 0 THEN
    COMMIT;
    SELECT 0, 0;
  ELSEIF v_lease = p_lease AND v_exp > v_now THEN
    UPDATE fencer_locks SET lease_id = NULL, expires_at = NULL, updated_at = v_now
     WHERE lock_key = p_key;
    COMMIT;
    SELECT 1, v_token;
  ELSE
    COMMIT;
    SELECT IF(v_lease IS NULL OR v_lease = p_lease OR v_exp <= v_now, 0, -1), v_token;
  END IF;
END";

/// (key, lease, attempt) → (status, token): the compensation of an acquire
/// attempt whose caller gave up. Releases only while the row still carries
/// that very attempt; a later attempt of the same lease (a retry that was
/// answered) has overwritten it, and then the lease is the application's
/// and this is a no-op (-1).
pub const RELEASE_ATTEMPT_PROC: &str = "CREATE PROCEDURE fencer_lock_release_attempt_v1(
  IN p_key VARBINARY(512), IN p_lease VARBINARY(128), IN p_attempt VARBINARY(64))
BEGIN
  DECLARE v_found INT DEFAULT 1;
  DECLARE v_lease VARBINARY(128);
  DECLARE v_token BIGINT;
  DECLARE v_exp DATETIME(6);
  DECLARE v_attempt VARBINARY(64);
  DECLARE v_now DATETIME(6);
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
  START TRANSACTION;
  SELECT lease_id, token, expires_at, attempt_id INTO v_lease, v_token, v_exp, v_attempt
    FROM fencer_locks WHERE lock_key = p_key FOR UPDATE;
  SET v_now = SYSDATE(6);
  IF v_found = 0 THEN
    COMMIT;
    SELECT 0, 0;
  ELSEIF v_lease = p_lease AND v_attempt = p_attempt AND v_exp > v_now THEN
    UPDATE fencer_locks SET lease_id = NULL, expires_at = NULL, updated_at = v_now
     WHERE lock_key = p_key;
    COMMIT;
    SELECT 1, v_token;
  ELSE
    COMMIT;
    SELECT IF(v_lease IS NULL OR v_exp <= v_now, 0, -1), v_token;
  END IF;
END";

/// The idle-row clean-up, run by the sidecar in one transaction:
/// [`CLEANUP_LOCK`], then [`CLEANUP_COUNT`] (nothing to do: commit), then
/// [`CLEANUP_RAISE`] and [`CLEANUP_DELETE`].
///
/// The floor row is taken exclusively with `NOWAIT` (a round is skipped
/// rather than making new-key acquires queue behind it; MariaDB refuses
/// NOWAIT inside procedures, hence no procedure here), the floor is raised
/// to the highest token in the table, then up to a batch of rows of keys
/// idle for the given time are deleted. The floor is raised past every
/// token, not just the deleted ones: it only has to exceed them, and the
/// table's maximum needs no list of what was deleted (MySQL's DELETE
/// returns none). A row acquired meanwhile is not idle any more, and
/// DELETE re-checks its condition on each row it locks.
pub const CLEANUP_LOCK: &str =
    "SELECT floor FROM fencer_token_floor WHERE id = 1 FOR UPDATE NOWAIT";

const IDLE: &str =
    "(lease_id IS NULL OR TIMESTAMPADD(MICROSECOND, delay_ms * 1000, expires_at) <= SYSDATE(6))
   AND (read_until IS NULL OR read_until <= SYSDATE(6))
   AND updated_at < TIMESTAMPADD(MICROSECOND, -? * 1000, SYSDATE(6))";

/// (batch): deletes read leases' rows that expired more than a minute ago
/// (released ones are deleted by their release).
pub const CLEANUP_READERS: &str = "DELETE FROM fencer_readers
 WHERE expires_at < TIMESTAMPADD(MINUTE, -1, SYSDATE(6)) ORDER BY expires_at LIMIT ?";

/// (idle ms) → rows that the clean-up would delete (up to 1).
pub fn cleanup_count() -> String {
    format!("SELECT COUNT(*) FROM (SELECT 1 FROM fencer_locks WHERE {IDLE} LIMIT 1) t")
}

pub const CLEANUP_RAISE: &str = "UPDATE fencer_token_floor
   SET floor = GREATEST(floor, (SELECT COALESCE(MAX(token), 0) FROM fencer_locks)) WHERE id = 1";

/// (idle ms, batch).
pub fn cleanup_delete() -> String {
    format!("DELETE FROM fencer_locks WHERE {IDLE} ORDER BY updated_at LIMIT ?")
}

/// (key, floor): the key's next token will be above `floor`.
pub const RAISE_FLOOR: &str = "INSERT INTO fencer_locks (lock_key, token, updated_at)
VALUES (?, ?, SYSDATE(6))
ON DUPLICATE KEY UPDATE token = GREATEST(token, VALUES(token))";

#[cfg(test)]
mod tests {
    use super::*;

    /// The procedures made by text swaps are made (each swap found its
    /// text once), and only the later attempt of a lease confirms a grant.
    #[test]
    fn confirmations_keep_the_later_attempt() {
        assert!(ACQUIRE_V5_PROC.contains("fencer_lock_acquire_v5("));
        assert!(ACQUIRE_V5_PROC.contains(&format!("lock_key = p_key AND {LATER_ATTEMPT};")));
        assert!(READ_ACQUIRE_V2_PROC.contains("fencer_lock_read_acquire_v2("));
        assert!(READ_ACQUIRE_V2_PROC.contains(&format!("lease_id = p_lease AND {LATER_ATTEMPT};")));
        assert!(READ_ACQUIRE_V2_PROC.contains("attempt_id < VALUES(attempt_id)"));
    }
}
