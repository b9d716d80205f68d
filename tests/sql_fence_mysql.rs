//! `deploy/sql/fencer_fence_mysql.sql` against a real, test-owned MariaDB:
//! signed-token verification (HMAC-SHA256 built from SHA2 in SQL), token
//! semantics, the rollback of the caller's transaction on refusal, the row
//! lock that serializes concurrent holders of one key, the REPEATABLE READ
//! snapshot check, the hot-account workload, the example trigger, and the
//! mark surviving a crash.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::mariadb::MariaDb;
use common::SECRET;
use fencer::token::{lease_tag, Claim, Signer};
use mysql_async::prelude::*;
use mysql_async::{Conn, Opts, OptsBuilder};

const SQL: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/sql/fencer_fence_mysql.sql"
));

/// SQLSTATE raised for a stale token.
const STALE: &str = "23F01";
/// SQLSTATE raised for a token that is not validly signed.
const INVALID: &str = "23F02";
/// SQLSTATE raised when the caller's snapshot predates the key's mark.
const SNAPSHOT: &str = "40001";

type R<T = ()> = Result<T, mysql_async::Error>;

async fn connect(db: &MariaDb) -> Conn {
    connect_with(db, &[]).await
}

/// A connection running `init` first (e.g. an isolation level).
async fn connect_with(db: &MariaDb, init: &[&str]) -> Conn {
    let opts = OptsBuilder::from_opts(Opts::from_url(&db.url()).unwrap())
        .prefer_socket(false)
        .init(init.to_vec());
    Conn::new(opts)
        .await
        .unwrap_or_else(|e| panic!("connect {}: {e}\n{}", db.url(), db.logs()))
}

/// A server with the fence SQL loaded (twice: it must be idempotent) and
/// the test's signing key.
fn start() -> MariaDb {
    let db = start_server();
    db.sql(SQL);
    db.sql(SQL);
    db.sql(&format!(
        "INSERT INTO fencer_sql_signing_keys (key_id, secret) VALUES ('k1', '{SECRET}')"
    ));
    db
}

/// `MariaDb::start`, retried: `mariadb-install-db` uses the shared /tmp
/// for its temporary tables, and two bootstraps at once (this binary's
/// tests, or another test run on the machine) occasionally trip over each
/// other's files ("Unknown table 'mysql.tmp_proxies_priv'").
fn start_server() -> MariaDb {
    for attempt in 1.. {
        match std::panic::catch_unwind(MariaDb::start) {
            Ok(db) => return db,
            Err(e) if attempt < 3 => eprintln!("MariaDB start failed, retrying: {e:?}"),
            Err(e) => std::panic::resume_unwind(e),
        }
    }
    unreachable!()
}

/// [`start`], plus a plain `accounts` table with account 1 at balance 0.
async fn setup() -> (MariaDb, Conn) {
    let db = start();
    db.sql(
        "CREATE TABLE accounts (id INT PRIMARY KEY, balance INT NOT NULL) ENGINE=InnoDB;
         INSERT INTO accounts VALUES (1, 0);",
    );
    let c = connect(&db).await;
    (db, c)
}

/// The token a sidecar would hand out for `lease` on `key`.
fn signed(key: &str, token: u64, lease: &str) -> String {
    Signer::new("k1", SECRET.as_bytes()).sign(&Claim::new(key, token, lease))
}

async fn fence_wire(c: &mut Conn, wire: Option<&str>, key: Option<&str>) -> R {
    c.exec_drop("CALL fencer_fence(?, ?)", (wire, key)).await
}

async fn fence(c: &mut Conn, key: &str, token: u64, lease: &str) -> R {
    fence_wire(c, Some(&signed(key, token, lease)), Some(key)).await
}

fn server_error(e: &mysql_async::Error) -> &mysql_async::ServerError {
    match e {
        mysql_async::Error::Server(s) => s,
        other => panic!("not a server error: {other:?}"),
    }
}

fn sqlstate(e: &mysql_async::Error) -> &str {
    &server_error(e).state
}

fn assert_state(r: R, state: &str) {
    let e = r.expect_err("must be refused");
    assert_eq!(sqlstate(&e), state, "{e:?}");
}

fn assert_stale(r: R) {
    let e = r.expect_err("stale token must be rejected");
    let s = server_error(&e);
    assert_eq!(s.state, STALE, "{e:?}");
    assert!(s.message.starts_with("stale_fencing_token"), "{e:?}");
}

async fn stored(c: &mut Conn, key: &str) -> Option<(i64, String)> {
    c.exec_first::<(i64, Vec<u8>), _, _>(
        "SELECT token, lease_tag FROM fencer_sql_fences WHERE lock_key = ?",
        (key,),
    )
    .await
    .unwrap()
    .map(|(t, l)| (t, String::from_utf8(l).unwrap()))
}

async fn balance(c: &mut Conn) -> i64 {
    c.query_first("SELECT balance FROM accounts WHERE id = 1")
        .await
        .unwrap()
        .unwrap()
}

async fn in_transaction(c: &mut Conn) -> bool {
    c.query_first::<i64, _>("SELECT @@in_transaction")
        .await
        .unwrap()
        .unwrap()
        == 1
}

fn tag(lease: &str) -> String {
    lease_tag(lease)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advancing_tokens_accepted_lower_rejected_and_rolled_back() {
    let (_db, mut c) = setup().await;

    // Advancing tokens, each with its own write.
    for token in [5, 6, 40] {
        c.query_drop("START TRANSACTION").await.unwrap();
        fence(&mut c, "acct", token, "").await.unwrap();
        c.query_drop("UPDATE accounts SET balance = balance + 1 WHERE id = 1")
            .await
            .unwrap();
        c.query_drop("COMMIT").await.unwrap();
    }
    assert_eq!(balance(&mut c).await, 3);
    assert_eq!(stored(&mut c, "acct").await, Some((40, tag(""))));

    // Fence first: a lower token is refused before the write happens, and
    // the transaction is over.
    c.query_drop("START TRANSACTION").await.unwrap();
    assert_stale(fence(&mut c, "acct", 39, "").await);
    assert!(
        !in_transaction(&mut c).await,
        "the refusal ends the transaction"
    );
    assert_eq!(balance(&mut c).await, 3);

    // Write first, fence afterwards in the same transaction: the refusal
    // rolls the transaction back, so a blind COMMIT cannot keep the write
    // (in MySQL a failed statement alone would leave it committable).
    c.query_drop("START TRANSACTION").await.unwrap();
    c.query_drop("UPDATE accounts SET balance = balance + 100 WHERE id = 1")
        .await
        .unwrap();
    assert_stale(fence(&mut c, "acct", 7, "").await);
    c.query_drop("COMMIT").await.unwrap();
    assert_eq!(balance(&mut c).await, 3);
    assert_eq!(stored(&mut c, "acct").await, Some((40, tag(""))));

    // Any refusal rolls back, not only a stale one.
    c.query_drop("START TRANSACTION").await.unwrap();
    c.query_drop("UPDATE accounts SET balance = balance + 100 WHERE id = 1")
        .await
        .unwrap();
    assert_state(fence_wire(&mut c, Some("garbage"), None).await, INVALID);
    c.query_drop("COMMIT").await.unwrap();
    assert_eq!(balance(&mut c).await, 3);

    // Fences are per key, compared as bytes.
    fence(&mut c, "other", 1, "").await.unwrap();
    fence(&mut c, "ACCT", 1, "").await.unwrap();
    fence(&mut c, "acct ", 1, "").await.unwrap();
    assert_eq!(stored(&mut c, "acct").await, Some((40, tag(""))));
    // And the high-water mark keeps moving.
    fence(&mut c, "acct", 41, "").await.unwrap();

    // Bad arguments.
    assert_state(fence(&mut c, "acct", 0, "").await, "22023");
    assert_state(fence_wire(&mut c, None, None).await, "22004");
    // Without a key to check, the token's own key is fenced.
    fence_wire(&mut c, Some(&signed("acct", 42, "")), None)
        .await
        .unwrap();
    assert_eq!(stored(&mut c, "acct").await, Some((42, tag(""))));
    // The procedure form with the accepted token as an OUT parameter.
    c.exec_drop(
        "CALL fencer_fence_token(?, 'acct', @t)",
        (signed("acct", 43, ""),),
    )
    .await
    .unwrap();
    let t: i64 = c.query_first("SELECT @t").await.unwrap().unwrap();
    assert_eq!(t, 43);
}

/// Only a token a sidecar signed can move the mark: a bare or forged huge
/// number would lock the key out for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_signed_tokens_move_the_mark() {
    let db = start();
    let mut c = connect(&db).await;
    fence(&mut c, "acct", 5, "a").await.unwrap();
    let good = signed("acct", 6, "a");
    let forged = Signer::new("k1", b"not-the-secret-not-the-secret-not-the-secret")
        .sign(&Claim::new("acct", i64::MAX as u64, "evil"));
    let inflated = good.replacen(".6.", &format!(".{}.", i64::MAX), 1);
    let padded = good.replacen(".6.", ".06.", 1);
    let other_kid = good.replacen("v2.k1.", "v2.k9.", 1);
    let relabelled = good.replacen("v2.", "v1.", 1);
    let newline = format!("{good}\n");
    let sig = good.rsplit('.').next().unwrap();
    let short_sig = good.replacen(sig, &sig[..sig.len() - 2], 1);
    // Signed, but above 2^63-1: no BIGINT holds it.
    let too_big = signed("acct", i64::MAX as u64 + 1, "a");
    for bad in [
        forged.as_str(),
        inflated.as_str(),
        padded.as_str(),
        other_kid.as_str(),
        relabelled.as_str(),
        newline.as_str(),
        short_sig.as_str(),
        too_big.as_str(),
        "garbage",
        "",
        "v2.k1.7.x.YWNjdA.",
        "v2.k1.7.x.YWNjdA.A",
        "v2.k1.99999999999999999999.x.YWNjdA.AAAA",
        "v2..7.x.YWNjdA.AAAA",
        "v3.k1.7.x.YWNjdA.AAAA",
    ] {
        let e = fence_wire(&mut c, Some(bad), None).await.unwrap_err();
        assert_eq!(sqlstate(&e), INVALID, "{bad:?}: {e:?}");
    }
    // A valid token for another key than the one written.
    let e = fence_wire(&mut c, Some(&signed("other", 9, "a")), Some("acct"))
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), INVALID, "{e:?}");
    assert_eq!(stored(&mut c, "acct").await, Some((5, tag("a"))));
    assert_eq!(stored(&mut c, "other").await, None);

    // A v1 token (lease id in clear) of an older sidecar verifies, by tag.
    let v1 = common::sign_v1("acct", 7, "a");
    fence_wire(&mut c, Some(&v1), Some("acct")).await.unwrap();
    assert_eq!(stored(&mut c, "acct").await, Some((7, tag("a"))));
    assert_stale(fence_wire(&mut c, Some(&good), Some("acct")).await);

    // The largest token there is, and a non-ASCII key.
    fence(&mut c, "max", i64::MAX as u64, "a").await.unwrap();
    assert_eq!(stored(&mut c, "max").await, Some((i64::MAX, tag("a"))));
    fence(&mut c, "konto/ø€😀", 3, "a").await.unwrap();
    assert_eq!(stored(&mut c, "konto/ø€😀").await, Some((3, tag("a"))));

    // A secret longer than SHA-256's block is hashed first (RFC 2104).
    let long_secret = "s".repeat(100);
    db.sql(&format!(
        "INSERT INTO fencer_sql_signing_keys VALUES ('k2', '{long_secret}')"
    ));
    let k2 = Signer::new("k2", long_secret.as_bytes()).sign(&Claim::new("acct", 8, "b"));
    fence_wire(&mut c, Some(&k2), Some("acct")).await.unwrap();
    assert_eq!(stored(&mut c, "acct").await, Some((8, tag("b"))));

    // A key id limited to other keys' prefixes signs nothing here.
    db.sql("INSERT INTO fencer_sql_signing_key_prefixes VALUES ('k1', 'team-b/')");
    assert_state(fence(&mut c, "acct", 9, "a").await, INVALID);
    fence(&mut c, "team-b/x", 1, "a").await.unwrap();
    assert_eq!(stored(&mut c, "acct").await, Some((8, tag("b"))));

    // Secrets too short to be secrets are refused by the table.
    assert!(std::process::Command::new("mariadb")
        .arg("--no-defaults")
        .arg(format!("--socket={}", db.socket().display()))
        .args(["-uroot", "fencer", "-e"])
        .arg("INSERT INTO fencer_sql_signing_keys VALUES ('k3', 'short')")
        .output()
        .map(|o| !o.status.success())
        .unwrap());
}

/// The application account needs EXECUTE and nothing else: the routines
/// run as their definer, the secret and the mark stay out of its reach.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_account_with_execute_only_fences_but_cannot_touch_the_tables() {
    let db = start();
    db.sql(
        "CREATE USER app@'127.0.0.1';
         GRANT EXECUTE ON PROCEDURE fencer.fencer_fence TO app@'127.0.0.1';",
    );
    let url = db.url().replacen("root@", "app@", 1);
    let opts = OptsBuilder::from_opts(Opts::from_url(&url).unwrap()).prefer_socket(false);
    let mut app = Conn::new(opts).await.unwrap();
    fence(&mut app, "k", 3, "a").await.unwrap();
    assert_stale(fence(&mut app, "k", 2, "a").await);
    for sql in [
        "SELECT secret FROM fencer_sql_signing_keys",
        "SELECT token FROM fencer_sql_fences",
        "UPDATE fencer_sql_fences SET token = 1",
        "CALL fencer_fence_token('x', NULL, @t)",
    ] {
        // 42000: access denied (ER_TABLEACCESS_DENIED_ERROR, ER_PROCACCESS_DENIED_ERROR)
        assert_state(app.query_drop(sql).await, "42000");
    }
    let mut root = connect(&db).await;
    assert_eq!(stored(&mut root, "k").await, Some((3, tag("a"))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_token_same_lease_accepted_other_lease_rejected() {
    let db = start();
    let mut c = connect(&db).await;

    fence(&mut c, "k", 10, "lease-a").await.unwrap();
    // Same holder again (a retried write): accepted.
    fence(&mut c, "k", 10, "lease-a").await.unwrap();
    assert_eq!(stored(&mut c, "k").await, Some((10, tag("lease-a"))));
    // Same token from another lease, or from no lease: rejected.
    assert_stale(fence(&mut c, "k", 10, "lease-b").await);
    assert_stale(fence(&mut c, "k", 10, "").await);
    assert_stale(fence(&mut c, "k", 9, "lease-a").await);
    // A newer lease takes over; the old lease's token is now stale.
    fence(&mut c, "k", 11, "lease-b").await.unwrap();
    assert_eq!(stored(&mut c, "k").await, Some((11, tag("lease-b"))));
    assert_stale(fence(&mut c, "k", 10, "lease-a").await);
    assert_stale(fence(&mut c, "k", 11, "lease-a").await);

    // Empty lease on both sides counts as the same lease.
    fence(&mut c, "e", 3, "").await.unwrap();
    fence(&mut c, "e", 3, "").await.unwrap();
    assert_stale(fence(&mut c, "e", 3, "lease-x").await);
}

/// T1 fences `key` with 34 and keeps its transaction open; T2 fences with
/// 33. T2 must wait for T1's row lock; the outcome depends on T1's end.
/// `previous`: a committed mark before both (None: fresh key, so T1's
/// uncommitted insert is what T2 waits on).
async fn concurrent_case(db: &MariaDb, key: &str, previous: Option<u64>, t1_commits: bool) {
    let mut c1 = connect(db).await;
    let mut c2 = connect(db).await;
    if let Some(p) = previous {
        fence(&mut c1, key, p, "").await.unwrap();
    }

    c1.query_drop("START TRANSACTION").await.unwrap();
    fence(&mut c1, key, 34, "lease-34").await.unwrap();

    let key2 = key.to_owned();
    let t2 = tokio::spawn(async move {
        c2.query_drop("START TRANSACTION").await.unwrap();
        let r = fence(&mut c2, &key2, 33, "lease-33").await;
        let finished = Instant::now();
        match &r {
            Ok(_) => c2.query_drop("COMMIT").await.unwrap(),
            Err(_) => c2.query_drop("ROLLBACK").await.unwrap(),
        }
        (r, finished)
    });

    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !t2.is_finished(),
        "T2 must wait for T1's lock on the fence row ({key})"
    );
    let released = Instant::now();
    if t1_commits {
        c1.query_drop("COMMIT").await.unwrap();
    } else {
        c1.query_drop("ROLLBACK").await.unwrap();
    }
    let (r, finished) = tokio::time::timeout(Duration::from_secs(10), t2)
        .await
        .expect("T2 still blocked after T1 ended")
        .unwrap();
    assert!(finished >= released, "T2 completed before T1 ended");

    let mut check = connect(db).await;
    if t1_commits {
        assert_stale(r);
        assert_eq!(stored(&mut check, key).await, Some((34, tag("lease-34"))));
    } else {
        r.expect("T1 rolled back, 33 is above the mark");
        assert_eq!(stored(&mut check, key).await, Some((33, tag("lease-33"))));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_holders_serialize_on_the_fence_row() {
    let db = start();
    concurrent_case(&db, "existing-commit", Some(30), true).await;
    concurrent_case(&db, "existing-rollback", Some(30), false).await;
    concurrent_case(&db, "fresh-commit", None, true).await;
    concurrent_case(&db, "fresh-rollback", None, false).await;
}

/// An accepted equal token (the same holder writing again) must still lock
/// the row: a newer holder waits until the older holder's transaction is
/// over, so its writes land after the older holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_equal_token_still_holds_the_row_lock() {
    let db = start();
    let mut c1 = connect(&db).await;
    let mut c2 = connect(&db).await;
    fence(&mut c1, "k", 10, "lease-a").await.unwrap();

    c1.query_drop("START TRANSACTION").await.unwrap();
    fence(&mut c1, "k", 10, "lease-a").await.unwrap();
    let t2 = tokio::spawn(async move {
        c2.query_drop("START TRANSACTION").await.unwrap();
        let r = fence(&mut c2, "k", 11, "lease-b").await;
        c2.query_drop("COMMIT").await.unwrap();
        r
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!t2.is_finished(), "the newer holder must wait for T1");
    c1.query_drop("COMMIT").await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(10), t2)
        .await
        .expect("T2 still blocked after T1 ended")
        .unwrap();
    r.unwrap();
    assert_eq!(stored(&mut c1, "k").await, Some((11, tag("lease-b"))));
}

/// REPEATABLE READ (the server default): a transaction that read before
/// fencing has a snapshot that may predate the previous holder's commit. It
/// gets 40001 (and a rolled-back transaction), not a stale read to build
/// on — also when the previous holder reused its own token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeatable_read_snapshot_older_than_the_mark_is_refused() {
    let (db, mut c1) = setup().await;
    let mut c2 = connect_with(
        &db,
        &["SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ"],
    )
    .await;
    fence(&mut c1, "acct", 10, "a").await.unwrap();

    // The current holder reuses its own token (10, a), then a newer one
    // advances (12, x); each time the other holder's snapshot predates it.
    for ((cur, cur_lease), (token, lease)) in [((10, "a"), (11, "b")), ((12, "x"), (13, "c"))] {
        // The newer holder reads first (its snapshot)…
        c2.query_drop("START TRANSACTION").await.unwrap();
        let seen = balance(&mut c2).await;
        // …then the current holder writes and commits…
        c1.query_drop("START TRANSACTION").await.unwrap();
        fence(&mut c1, "acct", cur, cur_lease).await.unwrap();
        c1.query_drop("UPDATE accounts SET balance = balance + 1 WHERE id = 1")
            .await
            .unwrap();
        c1.query_drop("COMMIT").await.unwrap();
        // …and the newer holder's fence refuses its stale snapshot.
        let e = fence(&mut c2, "acct", token, lease).await.unwrap_err();
        assert_eq!(sqlstate(&e), SNAPSHOT, "{e:?}");
        assert!(!in_transaction(&mut c2).await);
        assert_eq!(balance(&mut c2).await, seen + 1);
        // Retried, fencing first, it goes through and sees the write.
        c2.query_drop("START TRANSACTION").await.unwrap();
        fence(&mut c2, "acct", token, lease).await.unwrap();
        assert_eq!(balance(&mut c2).await, seen + 1);
        c2.query_drop("COMMIT").await.unwrap();
    }
    // A snapshot taken after the last fenced commit is fine.
    c2.query_drop("START TRANSACTION").await.unwrap();
    balance(&mut c2).await;
    fence(&mut c2, "acct", 14, "d").await.unwrap();
    c2.query_drop("COMMIT").await.unwrap();
}

/// Read-modify-write on one hot row, no `FOR UPDATE` on the data: the
/// fence row lock alone serializes the holders, so no increment is lost.
///
/// `FENCER_SQL_FENCE_MYSQL_SKIP_CHECK=1` leaves the fence call out, to
/// watch the same workload lose updates (the test then fails).
async fn hot_account(isolation: &str) {
    const TASKS: usize = 8;
    const PER_TASK: usize = 50;
    let skip_check = std::env::var_os("FENCER_SQL_FENCE_MYSQL_SKIP_CHECK").is_some();
    let (db, mut c) = setup().await;
    let init = format!("SET SESSION TRANSACTION ISOLATION LEVEL {isolation}");
    let next_token = Arc::new(AtomicU64::new(1));
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let mut client = connect_with(&db, &[init.as_str()]).await;
        let next_token = next_token.clone();
        tasks.push(tokio::spawn(async move {
            let (mut committed, mut stale) = (0_usize, 0_usize);
            while committed < PER_TASK {
                let token = next_token.fetch_add(1, Ordering::SeqCst);
                client.query_drop("START TRANSACTION").await.unwrap();
                if !skip_check {
                    if let Err(e) =
                        fence(&mut client, "hot-account", token, &format!("lease-{token}")).await
                    {
                        assert_eq!(sqlstate(&e), STALE, "{e:?}");
                        stale += 1;
                        continue;
                    }
                }
                let b: i64 = client
                    .query_first("SELECT balance FROM accounts WHERE id = 1")
                    .await
                    .unwrap()
                    .unwrap();
                tokio::task::yield_now().await;
                client
                    .exec_drop("UPDATE accounts SET balance = ? WHERE id = 1", (b + 1,))
                    .await
                    .unwrap();
                client.query_drop("COMMIT").await.unwrap();
                committed += 1;
            }
            (committed, stale)
        }));
    }
    let (mut committed, mut stale) = (0, 0);
    for t in tasks {
        let (c, s) = t.await.unwrap();
        committed += c;
        stale += s;
    }
    let final_balance = balance(&mut c).await as usize;
    eprintln!(
        "hot account ({isolation}, check {}): {committed} commits, balance {final_balance}, \
         {} lost updates, {stale} stale-token retries",
        if skip_check { "SKIPPED" } else { "on" },
        committed - final_balance.min(committed),
    );
    assert_eq!(committed, TASKS * PER_TASK);
    assert_eq!(
        final_balance, committed,
        "lost updates ({stale} stale retries)"
    );
    let (mark, _) = stored(&mut c, "hot-account").await.unwrap();
    assert!(mark as u64 <= next_token.load(Ordering::SeqCst));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hot_account_has_no_lost_updates_repeatable_read() {
    hot_account("REPEATABLE READ").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hot_account_has_no_lost_updates_read_committed() {
    hot_account("READ COMMITTED").await;
}

/// The lines of the file's example trigger, as run by a user.
fn trigger_example() -> String {
    let begin = "-- BEGIN EXAMPLE\n";
    let start = SQL.find(begin).expect("BEGIN EXAMPLE marker") + begin.len();
    let end = SQL.find("-- END EXAMPLE").expect("END EXAMPLE marker");
    SQL[start..end]
        .lines()
        .map(|l| {
            l.strip_prefix("-- ")
                .or_else(|| l.strip_prefix("--"))
                .unwrap_or_else(|| panic!("example line not commented: {l:?}"))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

async fn update_with(c: &mut Conn, sql: &str, token: Option<String>) -> R {
    c.exec_drop(sql, (token,)).await
}

async fn account(c: &mut Conn, id: i64) -> (i64, Option<String>, Option<i64>) {
    c.exec_first(
        "SELECT balance, fencing_token, fenced_token FROM accounts WHERE id = ?",
        (id,),
    )
    .await
    .unwrap()
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_trigger_refuses_a_stale_update() {
    let db = start();
    db.sql(&trigger_example());
    db.sql("INSERT INTO accounts (id, balance) VALUES (1, 100), (2, 100)");
    let mut c = connect(&db).await;
    const DEBIT: &str =
        "UPDATE accounts SET balance = balance - 10, fencing_token = ? WHERE id = 1";

    update_with(&mut c, DEBIT, Some(signed("accounts/1", 5, "a")))
        .await
        .unwrap();
    assert_eq!(account(&mut c, 1).await, (90, None, Some(5)));
    assert_eq!(stored(&mut c, "accounts/1").await, Some((5, tag("a"))));

    // No token: the column was cleared, so the previous writer's token is
    // not inherited.
    assert_state(
        c.query_drop("UPDATE accounts SET balance = 0 WHERE id = 1")
            .await,
        "22004",
    );
    // Stale, other lease, and a token for another row's key.
    assert_stale(update_with(&mut c, DEBIT, Some(signed("accounts/1", 4, "z"))).await);
    assert_stale(update_with(&mut c, DEBIT, Some(signed("accounts/1", 5, "b"))).await);
    assert_state(
        update_with(&mut c, DEBIT, Some(signed("accounts/2", 6, "a"))).await,
        INVALID,
    );
    // IGNORE does not turn the refusal into a warning.
    assert_stale(
        update_with(
            &mut c,
            "UPDATE IGNORE accounts SET balance = 0, fencing_token = ? WHERE id = 1",
            Some(signed("accounts/1", 4, "z")),
        )
        .await,
    );
    assert_eq!(account(&mut c, 1).await, (90, None, Some(5)));

    // A statement refused on one row changes no row.
    update_with(
        &mut c,
        "UPDATE accounts SET balance = 0, fencing_token = ? WHERE id = 2",
        Some(signed("accounts/2", 50, "a")),
    )
    .await
    .unwrap();
    // Row 1 is fenced first and accepted, row 2's token is stale.
    let r = c
        .exec_drop(
            "UPDATE accounts SET balance = balance + 1, \
             fencing_token = CASE id WHEN 1 THEN ? ELSE ? END ORDER BY id",
            (signed("accounts/1", 6, "a"), signed("accounts/2", 49, "a")),
        )
        .await;
    assert_stale(r);
    assert_eq!(account(&mut c, 1).await, (90, None, Some(5)));
    assert_eq!(stored(&mut c, "accounts/1").await, Some((5, tag("a"))));

    // The paused old holder: the new holder (34) writes while the old one
    // (33) is blocked on the row; once 34 commits, 33 is refused.
    let mut new = connect(&db).await;
    let mut old = connect(&db).await;
    new.query_drop("START TRANSACTION").await.unwrap();
    update_with(&mut new, DEBIT, Some(signed("accounts/1", 34, "new")))
        .await
        .unwrap();
    let old_write = tokio::spawn(async move {
        let r = update_with(&mut old, DEBIT, Some(signed("accounts/1", 33, "old"))).await;
        (r, old)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!old_write.is_finished(), "the old holder must wait");
    new.query_drop("COMMIT").await.unwrap();
    let (r, _old) = tokio::time::timeout(Duration::from_secs(10), old_write)
        .await
        .unwrap()
        .unwrap();
    assert_stale(r);
    assert_eq!(account(&mut c, 1).await, (80, None, Some(34)));

    // A trigger cannot end the transaction: the refused statement is
    // undone, earlier writes stay pending until the caller rolls back.
    c.query_drop("START TRANSACTION").await.unwrap();
    update_with(&mut c, DEBIT, Some(signed("accounts/1", 35, "a")))
        .await
        .unwrap();
    assert_stale(update_with(&mut c, DEBIT, Some(signed("accounts/1", 34, "x"))).await);
    assert!(in_transaction(&mut c).await);
    c.query_drop("ROLLBACK").await.unwrap();
    assert_eq!(account(&mut c, 1).await, (80, None, Some(34)));
    assert_eq!(stored(&mut c, "accounts/1").await, Some((34, tag("new"))));
}

/// The mark is InnoDB data: a crash (SIGKILL) loses only what was not
/// committed, and a clean restart nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mark_survives_kill_and_restart() {
    let (mut db, mut c) = setup().await;
    fence(&mut c, "k", 7, "a").await.unwrap();
    // In flight at the crash: fenced with 9, never committed.
    c.query_drop("START TRANSACTION").await.unwrap();
    fence(&mut c, "k", 9, "b").await.unwrap();
    c.query_drop("UPDATE accounts SET balance = 99 WHERE id = 1")
        .await
        .unwrap();

    db.kill();
    assert!(c.query_drop("SELECT 1").await.is_err());
    drop(c);
    db.restart(); // crash recovery
    let mut c = connect(&db).await;
    assert_eq!(stored(&mut c, "k").await, Some((7, tag("a"))));
    assert_eq!(balance(&mut c).await, 0);
    assert_stale(fence(&mut c, "k", 6, "z").await);
    assert_stale(fence(&mut c, "k", 7, "z").await);
    fence(&mut c, "k", 8, "b").await.unwrap();

    drop(c);
    db.restart();
    let mut c = connect(&db).await;
    assert_eq!(stored(&mut c, "k").await, Some((8, tag("b"))));
    assert_stale(fence(&mut c, "k", 7, "a").await);
}
