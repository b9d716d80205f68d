-- fencer_fence_mysql.sql — fencing-token check inside your own MySQL /
-- MariaDB writes. The MySQL 8 / MariaDB 10.11 counterpart of
-- fencer_fence.sql (PostgreSQL); read that file's WHY first, it holds here.
--
-- WHY
--   A lock from fencer can be lost without its holder knowing (a GC pause,
--   a partition, a lease that expired while the process was stopped).
--   Every acquisition carries a fencing token that strictly increases per
--   lock key; storage that remembers the highest token it has accepted per
--   key can refuse writes from a holder that has been overtaken. Call
--   fencer_fence() inside the same transaction as your data change and the
--   check becomes part of the storage's own atomic write:
--
--     * fencer_fence() locks the key's row in fencer_sql_fences (FOR UPDATE)
--       and InnoDB holds that lock until YOUR transaction commits or rolls
--       back, so no other holder of the key gets past its own
--       fencer_fence() until you finish: there is no window between
--       "check" and "write";
--     * if fencer_fence() refuses the token it ROLLS BACK YOUR TRANSACTION
--       before it raises the error. This is the one place where MySQL
--       differs sharply from PostgreSQL: a failed statement in MySQL undoes
--       only itself and leaves the transaction open, so a write you made
--       before the call would otherwise survive a blind COMMIT. After the
--       rollback nothing you wrote before the call can commit.
--
-- WHAT IT TRUSTS
--   Only tokens signed by a fencer sidecar: pass the `fencing_token` string
--   of the acquire response (v2.<key id>.<token>.<lease tag>.<key>.<HMAC>),
--   not a bare number, or anyone who can call the procedure could push an
--   invented 2^63-1 into the mark and lock the key out for good. The
--   HMAC-SHA256 is verified here against fencer_sql_signing_keys (the
--   secrets the sidecars sign with). Neither MySQL nor MariaDB has an HMAC
--   function, so fencer_hmac_sha256() builds RFC 2104 from SHA2() and
--   UNHEX(). Its key XOR is done on 8-byte chunks through CONV(): `^` on
--   strings converts them to numbers in MariaDB (and means different things
--   in MySQL 8 depending on the operand types), so it never sees a string.
--
--   The routines run with their definer's rights (SQL SECURITY DEFINER):
--   grant your application account EXECUTE on fencer_fence (and on
--   fencer_fence_token if it fences from its own triggers) and nothing on
--   the fencer_sql_* tables. The signing secret is then readable by the
--   definer only.
--
--     INSERT INTO fencer_sql_signing_keys (key_id, secret)
--     VALUES ('k1', '<the signing secret>');
--     -- optional, as the gateway's [[gateway.keys]] key_prefixes: key id
--     -- k1 may then only sign lock keys starting with one of these
--     INSERT INTO fencer_sql_signing_key_prefixes VALUES ('k1', 'team-a/');
--
-- SEMANTICS of CALL fencer_fence(p_fencing_token, p_key)
--   p_key may be NULL (the token's own key is fenced) or the lock key your
--   write is for (then a token for another key is refused).
--
--   * token signature, key id or format not valid, or p_key given and not
--     the token's key                 -> SQLSTATE 23F02,
--                                        MESSAGE_TEXT 'invalid_fencing_token: …'
--   * no row for the key yet          -> store the token and its lease tag
--   * token >  stored token           -> store it
--   * token =  stored token, same lease (the same holder writing again)
--                                     -> accept
--   * otherwise (an older token, or the same token from another lease)
--                                     -> SQLSTATE 23F01,
--                                        MESSAGE_TEXT 'stale_fencing_token: …'
--   * the transaction read data before the key's mark moved (REPEATABLE
--     READ snapshot older than the fence row, see HOW TO USE IT)
--                                     -> SQLSTATE 40001, retry the transaction
--   * NULL token                      -> SQLSTATE 22004
--   * token 0                         -> SQLSTATE 22023
--   Every error (these, and any other such as a lock wait timeout) rolls
--   back the caller's whole transaction first.
--
--   23F01 and 23F02 are the SQLSTATEs the PostgreSQL file raises, so one
--   client can match one code on both databases. They are raised with
--   SIGNAL, so MYSQL_ERRNO is 1644 (ER_SIGNAL_EXCEPTION); match the
--   SQLSTATE, not the number. Class 23 (integrity constraint violation)
--   with subclass F01/F02, which neither server uses: generic code that
--   treats class 23 as "your write was refused, do not retry blindly" does
--   the right thing, and UPDATE IGNORE / INSERT IGNORE do not downgrade a
--   SIGNAL to a warning.
--
--   fencer_fence_token(p_fencing_token, p_key, OUT p_token) is the same
--   check with the accepted token as an OUT parameter and WITHOUT the
--   rollback, because triggers (and stored functions) may not end a
--   transaction. Use it from triggers; see the example at the end.
--
-- HOW TO USE IT
--   1. START TRANSACTION, then CALL fencer_fence() FIRST, before you read
--      anything your write depends on. Outside a transaction (autocommit)
--      the mark is committed and the row lock released at once: your
--      following statements are not fenced.
--   2. Do your reads and writes.
--   3. COMMIT. On 23F01 do not retry with the same token: your lease has
--      lost its lock; acquire the lock again (a new token) first. On 40001
--      (deadlock, or the snapshot check below) retry the whole transaction.
--      Do not keep writing after an error: the transaction is already gone,
--      and in autocommit mode the next statements would commit unfenced
--      (PostgreSQL refuses them; MySQL cannot be made to).
--
--     START TRANSACTION;
--     CALL fencer_fence('v2.k1.2051.Xq3…', 'accounts/42');
--     SELECT balance FROM accounts WHERE id = 42;
--     UPDATE accounts SET balance = 90 WHERE id = 42;
--     COMMIT;
--
--   Isolation. fencer_fence() makes only locking reads before it holds the
--   key's row lock, so under REPEATABLE READ (the server default) the
--   snapshot of your first plain SELECT is taken after the previous holder
--   committed. If your transaction read something BEFORE the call, its
--   snapshot may predate that commit and a read-modify-write would build on
--   stale data; fencer_fence() detects this (a per-row write counter,
--   `version`, differs between the snapshot and the locked row) and raises
--   40001. Under READ COMMITTED every statement sees the latest commit, and
--   calling first is what keeps a read from running ahead of the lock.
--
-- DIALECT ASSUMPTIONS
--   * InnoDB: row locks held to the end of the transaction and rollback are
--     the whole mechanism. The tables say ENGINE=InnoDB and this file sets
--     NO_ENGINE_SUBSTITUTION, so a server without InnoDB fails the CREATE
--     instead of silently making MyISAM tables, whose FOR UPDATE locks
--     nothing and whose writes cannot roll back.
--   * Strict sql_mode: stored routines and triggers run with the sql_mode
--     in force when they were CREATED, whatever the caller's session says;
--     this file sets a strict one first (STRICT_ALL_TABLES: an over-long
--     key or token is an error, never silently truncated into another
--     key's row). A token or key longer than the parameter is an error too.
--   * Lock keys are compared as bytes (VARBINARY): never case- or
--     accent-folded, never trailing-space-padded, so 'Acct' and 'acct' are
--     two keys, as everywhere else in fencer. p_key is declared utf8mb4 and
--     converted to its UTF-8 bytes; use a utf8mb4 connection for non-ASCII
--     keys.
--   * MySQL 8.0.16+ (CHECK constraints) or MariaDB 10.11. With binary
--     logging on, the helper functions are declared DETERMINISTIC NO SQL,
--     so no log_bin_trust_function_creators is needed.
--
-- NOTES
--   * This file stands alone: its tables are fencer_sql_fences,
--     fencer_sql_signing_keys and fencer_sql_signing_key_prefixes, none of
--     them a fencer gateway table. (The PostgreSQL file shares its mark
--     with the gateway's PostgreSQL fence store and honours the gateway's
--     in-flight stamps. The MySQL gateway fence store keeps its marks in
--     its own fencer_fences table and does not read these, so here the
--     mark is the database's own. Do not fence one key both here and
--     through a gateway: they would keep two marks.)
--   * Keep fenced transactions short: every other holder of the key waits
--     for your row lock (up to innodb_lock_wait_timeout, then 1205, which
--     fencer_fence() turns into a rollback).
--   * The signing key rows are read with LOCK IN SHARE MODE (so that the
--     read takes no REPEATABLE READ snapshot); replacing a secret therefore
--     waits for fenced transactions in progress.
--   * The HMAC comparison is not constant-time; SQL offers none, and the
--     attacker would have to time stored-procedure calls.
--   * Idempotent: load it again to upgrade (mariadb db < this file, or
--     mysql db < this file; it uses DELIMITER, a client command). Loading
--     drops and re-creates the routines, and dropping a routine drops the
--     EXECUTE grants on it: run your GRANTs again afterwards (and load it
--     at a quiet moment: calls in between fail, they do not pass).
--   * Tested on MariaDB 10.11 (tests/sql_fence_mysql.rs); MySQL 8 only by
--     its documentation so far.

SET SESSION sql_mode = 'STRICT_ALL_TABLES,NO_ENGINE_SUBSTITUTION,ERROR_FOR_DIVISION_BY_ZERO,NO_ZERO_DATE,NO_ZERO_IN_DATE';

-- One row per lock key: the highest token accepted and its lease's tag.
CREATE TABLE IF NOT EXISTS fencer_sql_fences (
  lock_key   VARBINARY(512) NOT NULL,   -- fencer's MAX_KEY_BYTES
  token      BIGINT NOT NULL,
  lease_tag  VARBINARY(64) NOT NULL,
  -- Bumped on every accepted call, even an equal token: the REPEATABLE
  -- READ snapshot check compares it (see HOW TO USE IT).
  version    BIGINT UNSIGNED NOT NULL,
  updated_at DATETIME(6) NOT NULL,      -- UTC
  PRIMARY KEY (lock_key)
) ENGINE=InnoDB;

CREATE TABLE IF NOT EXISTS fencer_sql_signing_keys (
  key_id VARBINARY(64) NOT NULL,
  secret VARBINARY(1024) NOT NULL,
  PRIMARY KEY (key_id),
  CONSTRAINT fencer_sql_signing_keys_secret_length CHECK (LENGTH(secret) >= 32)
) ENGINE=InnoDB;

-- Lock-key prefixes a key id may sign; none for a key id: any key.
CREATE TABLE IF NOT EXISTS fencer_sql_signing_key_prefixes (
  key_id VARBINARY(64) NOT NULL,
  prefix VARBINARY(512) NOT NULL,
  PRIMARY KEY (key_id, prefix)
) ENGINE=InnoDB;

DROP FUNCTION IF EXISTS fencer_hmac_sha256;
DROP FUNCTION IF EXISTS fencer_b64url_decode;
DROP FUNCTION IF EXISTS fencer_lease_tag;
DROP FUNCTION IF EXISTS fencer_msg_part;
DROP PROCEDURE IF EXISTS fencer_fence_token;
DROP PROCEDURE IF EXISTS fencer_fence;

DELIMITER //

-- HMAC-SHA256 (RFC 2104) from SHA2(): H((K ^ opad) || H((K ^ ipad) || m)).
-- The 64-byte padded key is XORed 8 bytes at a time as BIGINT UNSIGNED
-- (CONV to and from hex keeps all 64 bits; 0x36… = 3906369333256140342,
-- 0x5c… = 6655295901103053916 written in decimal so that neither server
-- treats them as binary strings).
CREATE FUNCTION fencer_hmac_sha256(p_key VARBINARY(1024), p_msg VARBINARY(4096))
RETURNS BINARY(32)
DETERMINISTIC NO SQL
BEGIN
  DECLARE k VARBINARY(64);
  DECLARE ipad VARBINARY(64) DEFAULT '';
  DECLARE opad VARBINARY(64) DEFAULT '';
  DECLARE c BIGINT UNSIGNED;
  DECLARE i INT DEFAULT 0;
  IF p_key IS NULL OR p_msg IS NULL THEN
    RETURN NULL;
  END IF;
  IF LENGTH(p_key) > 64 THEN
    SET k = UNHEX(SHA2(p_key, 256));
  ELSE
    SET k = p_key;
  END IF;
  SET k = CONCAT(k, UNHEX(REPEAT('00', 64 - LENGTH(k))));
  WHILE i < 8 DO
    SET c = CAST(CONV(HEX(SUBSTRING(k, i * 8 + 1, 8)), 16, 10) AS UNSIGNED);
    SET ipad = CONCAT(ipad, UNHEX(LPAD(CONV(c ^ 3906369333256140342, 10, 16), 16, '0')));
    SET opad = CONCAT(opad, UNHEX(LPAD(CONV(c ^ 6655295901103053916, 10, 16), 16, '0')));
    SET i = i + 1;
  END WHILE;
  RETURN UNHEX(SHA2(CONCAT(opad, UNHEX(SHA2(CONCAT(ipad, p_msg), 256))), 256));
END//

-- base64url without padding -> bytes; NULL if not valid base64.
CREATE FUNCTION fencer_b64url_decode(p VARCHAR(2048) CHARACTER SET ascii COLLATE ascii_bin)
RETURNS VARBINARY(2048)
DETERMINISTIC NO SQL
BEGIN
  IF LENGTH(p) % 4 = 1 THEN
    RETURN NULL;
  END IF;
  RETURN FROM_BASE64(CONCAT(REPLACE(REPLACE(p, '-', '+'), '_', '/'),
                            REPEAT('=', (4 - LENGTH(p) % 4) % 4)));
END//

-- The lease tag of a lease id (what v2 tokens carry instead of the id):
-- base64url of the first 12 bytes of SHA-256('fencer-lease-tag:' || id).
CREATE FUNCTION fencer_lease_tag(p_lease_id VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin)
RETURNS VARBINARY(16)
DETERMINISTIC NO SQL
RETURN CAST(REPLACE(REPLACE(REPLACE(
         TO_BASE64(SUBSTRING(UNHEX(SHA2(CONCAT('fencer-lease-tag:', p_lease_id), 256)), 1, 12)),
         '+', '-'), '/', '_'), '=', '') AS BINARY)//

-- One part of the signed message: 4-byte big-endian length, then the bytes.
CREATE FUNCTION fencer_msg_part(p VARBINARY(2048))
RETURNS VARBINARY(2052)
DETERMINISTIC NO SQL
RETURN CONCAT(UNHEX(LPAD(HEX(LENGTH(p)), 8, '0')), p)//

-- The check itself, without ending the transaction on refusal (usable from
-- triggers). Applications call fencer_fence() below instead.
CREATE PROCEDURE fencer_fence_token(
  IN  p_fencing_token VARCHAR(2048) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
  IN  p_key           VARCHAR(512)  CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
  OUT p_token         BIGINT)
MODIFIES SQL DATA
SQL SECURITY DEFINER
BEGIN
  DECLARE v_version VARCHAR(2048) CHARACTER SET ascii COLLATE ascii_bin;
  DECLARE v_kid     VARCHAR(2048) CHARACTER SET ascii COLLATE ascii_bin;
  DECLARE v_tok_s   VARCHAR(2048) CHARACTER SET ascii COLLATE ascii_bin;
  DECLARE v_lease_s VARCHAR(2048) CHARACTER SET ascii COLLATE ascii_bin;
  DECLARE v_key_s   VARCHAR(2048) CHARACTER SET ascii COLLATE ascii_bin;
  DECLARE v_sig_s   VARCHAR(2048) CHARACTER SET ascii COLLATE ascii_bin;
  DECLARE v_token   BIGINT;
  DECLARE v_key     VARBINARY(2048);
  DECLARE v_sig     VARBINARY(2048);
  DECLARE v_lease   VARBINARY(64);
  DECLARE v_secret  VARBINARY(1024) DEFAULT NULL;
  DECLARE v_nprefix INT DEFAULT 0;
  DECLARE v_match   INT DEFAULT 0;
  DECLARE f_token   BIGINT;
  DECLARE f_lease   VARBINARY(64);
  DECLARE f_version BIGINT UNSIGNED;
  DECLARE s_version BIGINT UNSIGNED DEFAULT NULL;
  DECLARE v_msg     VARCHAR(128);
  DECLARE v_found   INT DEFAULT 1;
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;

  SET p_token = NULL;
  IF p_fencing_token IS NULL THEN
    SIGNAL SQLSTATE '22004'
      SET MESSAGE_TEXT = 'fencer_fence: the fencing token must not be NULL';
  END IF;

  -- Shape: six dot-separated parts of URL-safe characters. The character
  -- check comes first and is unanchored, so the anchored part checks below
  -- cannot be fooled by a newline ('$' matches before a final newline).
  IF p_fencing_token REGEXP '[^A-Za-z0-9._-]'
     OR LENGTH(p_fencing_token) - LENGTH(REPLACE(p_fencing_token, '.', '')) <> 5 THEN
    SIGNAL SQLSTATE '23F02'
      SET MESSAGE_TEXT = 'invalid_fencing_token: not v2.<key id>.<token>.<lease tag>.<key>.<signature>';
  END IF;
  SET v_version = SUBSTRING_INDEX(p_fencing_token, '.', 1);
  SET v_kid     = SUBSTRING_INDEX(SUBSTRING_INDEX(p_fencing_token, '.', 2), '.', -1);
  SET v_tok_s   = SUBSTRING_INDEX(SUBSTRING_INDEX(p_fencing_token, '.', 3), '.', -1);
  SET v_lease_s = SUBSTRING_INDEX(SUBSTRING_INDEX(p_fencing_token, '.', 4), '.', -1);
  SET v_key_s   = SUBSTRING_INDEX(SUBSTRING_INDEX(p_fencing_token, '.', 5), '.', -1);
  SET v_sig_s   = SUBSTRING_INDEX(p_fencing_token, '.', -1);
  IF v_version NOT IN ('v1', 'v2')
     OR v_kid = ''
     OR NOT v_tok_s REGEXP '^[0-9]{1,19}$'
     -- at most 2^63-1 (equal-length digit strings compare like numbers)
     OR (LENGTH(v_tok_s) = 19 AND v_tok_s > '9223372036854775807')
     OR NOT v_lease_s REGEXP '^[A-Za-z0-9_-]{1,64}$'
     OR v_sig_s = '' THEN
    SIGNAL SQLSTATE '23F02'
      SET MESSAGE_TEXT = 'invalid_fencing_token: malformed token';
  END IF;
  SET v_token = CAST(v_tok_s AS SIGNED);
  SET v_key = fencer_b64url_decode(v_key_s);
  SET v_sig = fencer_b64url_decode(v_sig_s);
  IF v_key IS NULL OR v_sig IS NULL OR LENGTH(v_key) > 512 THEN
    SIGNAL SQLSTATE '23F02'
      SET MESSAGE_TEXT = 'invalid_fencing_token: malformed key or signature';
  END IF;

  -- The secret, by a LOCKING read: a plain SELECT would take this
  -- transaction's REPEATABLE READ snapshot now, before we wait for the
  -- key's row lock, i.e. possibly before the previous holder commits.
  SET v_found = 1;
  SELECT secret INTO v_secret
    FROM fencer_sql_signing_keys
   WHERE key_id = CAST(v_kid AS BINARY)
    LOCK IN SHARE MODE;
  IF v_found = 0 OR v_secret IS NULL OR LENGTH(v_secret) < 32 THEN
    SIGNAL SQLSTATE '23F02'
      SET MESSAGE_TEXT = 'invalid_fencing_token: unknown signing key id (insert it into fencer_sql_signing_keys)';
  END IF;
  -- The signed message: length-prefixed version, key id, key, token, lease.
  IF NOT (fencer_hmac_sha256(v_secret, CONCAT(
            fencer_msg_part(CAST(v_version AS BINARY)),
            fencer_msg_part(CAST(v_kid AS BINARY)),
            fencer_msg_part(v_key),
            fencer_msg_part(CAST(v_tok_s AS BINARY)),
            fencer_msg_part(CAST(v_lease_s AS BINARY)))) <=> v_sig) THEN
    SIGNAL SQLSTATE '23F02'
      SET MESSAGE_TEXT = 'invalid_fencing_token: bad signature';
  END IF;
  SELECT COUNT(*), COALESCE(SUM(LEFT(v_key, LENGTH(prefix)) = prefix), 0)
    INTO v_nprefix, v_match
    FROM fencer_sql_signing_key_prefixes
   WHERE key_id = CAST(v_kid AS BINARY)
    LOCK IN SHARE MODE;
  IF v_nprefix > 0 AND v_match = 0 THEN
    SIGNAL SQLSTATE '23F02'
      SET MESSAGE_TEXT = 'invalid_fencing_token: this key id may not sign tokens for this key';
  END IF;
  IF p_key IS NOT NULL AND CAST(p_key AS BINARY) <> v_key THEN
    SIGNAL SQLSTATE '23F02'
      SET MESSAGE_TEXT = 'invalid_fencing_token: the token is for another key than this write';
  END IF;
  IF v_token <= 0 THEN
    SIGNAL SQLSTATE '22023'
      SET MESSAGE_TEXT = 'fencer_fence: the token must be positive';
  END IF;
  SET v_lease = IF(v_version = 'v1', fencer_lease_tag(v_lease_s), CAST(v_lease_s AS BINARY));

  -- Lock the key's row, creating it if needed. INSERT … ON DUPLICATE KEY
  -- UPDATE takes an EXCLUSIVE lock on an existing row (a plain INSERT's
  -- duplicate-key error takes a SHARED one, and two waiters each holding
  -- S and asking for X deadlock on every hot key). A new row starts at
  -- token 0, which no valid token can equal, so from here on a fresh key
  -- and an existing one take the same path; if this transaction rolls
  -- back, the row goes with it. A concurrent uncommitted insert of the
  -- same key makes us wait for that transaction.
  INSERT INTO fencer_sql_fences (lock_key, token, lease_tag, version, updated_at)
  VALUES (v_key, 0, '', 0, UTC_TIMESTAMP(6))
  ON DUPLICATE KEY UPDATE token = token;
  SET v_found = 1;
  SELECT token, lease_tag, version INTO f_token, f_lease, f_version
    FROM fencer_sql_fences
   WHERE lock_key = v_key
     FOR UPDATE;
  IF v_found = 0 THEN
    SIGNAL SQLSTATE '40001'
      SET MESSAGE_TEXT = 'fencer_fence: the fence row vanished; retry the transaction';
  END IF;

  IF v_token < f_token OR (v_token = f_token AND v_lease <> f_lease) THEN
    SET v_msg = CONCAT('stale_fencing_token: token ', v_token,
                       IF(v_token = f_token, ' belongs to another lease; highest token seen is ',
                                             ' is older than the highest token seen, '),
                       f_token);
    SIGNAL SQLSTATE '23F01' SET MESSAGE_TEXT = v_msg;
  END IF;

  -- The snapshot check: a plain (consistent) read of the same row. Under
  -- REPEATABLE READ it shows the row as of this transaction's snapshot; if
  -- that predates the last accepted call, the caller has read data the
  -- previous holder was still changing. (With no snapshot yet, this read
  -- takes it now, after the lock: fine. Under READ COMMITTED it always
  -- matches.)
  SET v_found = 1;
  SELECT version INTO s_version FROM fencer_sql_fences WHERE lock_key = v_key;
  IF v_found = 0 OR s_version IS NULL OR s_version <> f_version THEN
    SIGNAL SQLSTATE '40001'
      SET MESSAGE_TEXT = 'fencer_fence: this transaction read data before the key''s last fenced write; call fencer_fence first and retry';
  END IF;

  -- Accept. The row is rewritten even for an equal token (the same holder
  -- writing again), so `version` tells every snapshot that predates this
  -- call that it is stale.
  UPDATE fencer_sql_fences
     SET token = v_token, lease_tag = v_lease, version = version + 1,
         updated_at = UTC_TIMESTAMP(6)
   WHERE lock_key = v_key;
  SET p_token = v_token;
END//

-- What applications call: the check, and on ANY error a rollback of the
-- caller's transaction before the error is passed on (MySQL would
-- otherwise keep the transaction, and the writes made before the call,
-- open for a COMMIT).
CREATE PROCEDURE fencer_fence(
  IN p_fencing_token VARCHAR(2048) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
  IN p_key           VARCHAR(512)  CHARACTER SET utf8mb4 COLLATE utf8mb4_bin)
MODIFIES SQL DATA
SQL SECURITY DEFINER
BEGIN
  DECLARE v_token BIGINT;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION
  BEGIN
    ROLLBACK;
    RESIGNAL;
  END;
  CALL fencer_fence_token(p_fencing_token, p_key, v_token);
END//

DELIMITER ;

-- EXAMPLE: a trigger that refuses a stale write on its own. Not executed
-- by this file (it would create a table in your schema); copy it, with the
-- leading "-- " removed, and adapt table, columns and lock key. The tests
-- run exactly the lines between BEGIN EXAMPLE and END EXAMPLE.
--
-- Every UPDATE of a row must carry the writer's signed token in the
-- column fencing_token. The trigger checks it against the row's lock key
-- ('accounts/<id>'), records the accepted number in fenced_token, and
-- clears fencing_token, so that an UPDATE which does not set it meets
-- NULL, not the previous writer's token, and is refused (22004).
--
-- A trigger cannot roll back the transaction: a refusal undoes the
-- refused statement only, so on any error from it roll back yourself.
-- It also fences at write time, i.e. after your reads: it stops a stale
-- holder's UPDATE, but a read-modify-write still has to CALL
-- fencer_fence() first, or write relative values (balance = balance - 10),
-- or run REPEATABLE READ (then the snapshot check raises 40001).
--
-- BEGIN EXAMPLE
-- CREATE TABLE accounts (
--   id            BIGINT NOT NULL PRIMARY KEY,
--   balance       BIGINT NOT NULL,
--   fencing_token VARCHAR(2048) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
--   fenced_token  BIGINT NULL
-- ) ENGINE=InnoDB;
-- DELIMITER //
-- CREATE TRIGGER accounts_fencer_fence BEFORE UPDATE ON accounts
-- FOR EACH ROW
-- BEGIN
--   DECLARE v_token BIGINT;
--   CALL fencer_fence_token(NEW.fencing_token, CONCAT('accounts/', OLD.id), v_token);
--   SET NEW.fenced_token = v_token;
--   SET NEW.fencing_token = NULL;
-- END//
-- DELIMITER ;
-- END EXAMPLE
--
--   UPDATE accounts SET balance = balance - 10, fencing_token = 'v2.k1.2051.…'
--    WHERE id = 42;
