//! `deploy/sql/fencer_fence.sql` against a real, test-owned PostgreSQL:
//! token semantics, atomicity with the caller's own writes, and the row
//! lock that serializes concurrent holders of one key.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::postgres::PgServer;
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, GenericClient, NoTls};

const SQL: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/sql/fencer_fence.sql"
));

/// SQLSTATE raised for a stale token.
const STALE: &str = "23F01";

async fn connect(pg: &PgServer) -> Client {
    let (client, conn) = tokio_postgres::connect(&pg.url(), NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect {}: {e}\n{}", pg.url(), pg.logs()));
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// A server with the fence SQL loaded (twice: it must be idempotent) and
/// an `accounts` table with account 1 at balance 0.
async fn setup() -> (PgServer, Client) {
    setup_with(PgServer::start()).await
}

async fn setup_with(pg: PgServer) -> (PgServer, Client) {
    let c = connect(&pg).await;
    c.batch_execute(SQL).await.expect("load fencer_fence.sql");
    c.batch_execute(SQL)
        .await
        .expect("load fencer_fence.sql again");
    c.batch_execute(
        "CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL);
         INSERT INTO accounts VALUES (1, 0);",
    )
    .await
    .unwrap();
    (pg, c)
}

async fn fence(
    c: &impl GenericClient,
    key: &str,
    token: i64,
    lease: &str,
) -> Result<i64, tokio_postgres::Error> {
    c.query_one("SELECT fencer_fence($1, $2, $3)", &[&key, &token, &lease])
        .await
        .map(|row| row.get(0))
}

fn sqlstate(e: &tokio_postgres::Error) -> &str {
    e.code()
        .unwrap_or_else(|| panic!("not a database error: {e}"))
        .code()
}

fn assert_stale(r: Result<i64, tokio_postgres::Error>) {
    let e = r.expect_err("stale token must be rejected");
    assert_eq!(sqlstate(&e), STALE, "{e:?}");
    let db = e.as_db_error().unwrap();
    assert_eq!(db.message(), "stale_fencing_token");
    assert!(db.detail().is_some() && db.hint().is_some(), "{db:?}");
}

async fn stored(c: &Client, key: &str) -> Option<(i64, String)> {
    c.query_opt(
        "SELECT token, lease_id FROM fencer_fences WHERE key = $1",
        &[&key],
    )
    .await
    .unwrap()
    .map(|r| (r.get(0), r.get(1)))
}

async fn balance(c: &Client) -> i32 {
    c.query_one("SELECT balance FROM accounts WHERE id = 1", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advancing_tokens_accepted_lower_rejected_and_rolled_back() {
    let (_pg, mut c) = setup().await;

    // Advancing tokens, each with its own write.
    for token in [5_i64, 6, 40] {
        let tx = c.transaction().await.unwrap();
        assert_eq!(fence(&tx, "acct", token, "").await.unwrap(), token);
        tx.execute(
            "UPDATE accounts SET balance = balance + 1 WHERE id = 1",
            &[],
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    assert_eq!(balance(&c).await, 3);
    assert_eq!(stored(&c, "acct").await, Some((40, String::new())));

    // Fence first: a lower token is refused before the write happens.
    let tx = c.transaction().await.unwrap();
    assert_stale(fence(&tx, "acct", 39, "").await);
    drop(tx); // rolls back
    assert_eq!(balance(&c).await, 3);

    // Write first, fence afterwards in the same transaction: the refusal
    // aborts the transaction, so even a blind COMMIT cannot keep the write.
    let tx = c.transaction().await.unwrap();
    tx.execute(
        "UPDATE accounts SET balance = balance + 100 WHERE id = 1",
        &[],
    )
    .await
    .unwrap();
    assert_stale(fence(&tx, "acct", 7, "").await);
    let _ = tx.commit().await; // COMMIT of an aborted transaction = ROLLBACK
    assert_eq!(balance(&c).await, 3);
    assert_eq!(stored(&c, "acct").await, Some((40, String::new())));

    // Fences are per key.
    assert_eq!(fence(&c, "other", 1, "").await.unwrap(), 1);
    // And the high-water mark keeps moving.
    assert_eq!(fence(&c, "acct", 41, "").await.unwrap(), 41);

    // Bad arguments.
    for (token, code) in [(0_i64, "22023"), (-3, "22023")] {
        let e = fence(&c, "acct", token, "").await.unwrap_err();
        assert_eq!(sqlstate(&e), code, "{e:?}");
    }
    let null_key: Option<&str> = None;
    let null_token: Option<i64> = None;
    let null_lease: Option<&str> = None;
    for (k, t, l) in [
        (null_key, Some(50), Some("")),
        (Some("acct"), null_token, Some("")),
        (Some("acct"), Some(50), null_lease),
    ] {
        let e = c
            .query_one("SELECT fencer_fence($1, $2, $3)", &[&k, &t, &l])
            .await
            .unwrap_err();
        assert_eq!(
            sqlstate(&e),
            SqlState::NULL_VALUE_NOT_ALLOWED.code(),
            "{e:?}"
        );
    }
    // The two-argument form uses lease ''.
    let t: i64 = c
        .query_one("SELECT fencer_fence('acct', 42)", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(t, 42);
    assert_eq!(stored(&c, "acct").await, Some((42, String::new())));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_token_same_lease_accepted_other_lease_rejected() {
    let (_pg, c) = setup().await;

    assert_eq!(fence(&c, "k", 10, "lease-a").await.unwrap(), 10);
    // Same holder again (a retried write): accepted, nothing changes.
    assert_eq!(fence(&c, "k", 10, "lease-a").await.unwrap(), 10);
    assert_eq!(stored(&c, "k").await, Some((10, "lease-a".to_owned())));
    // Same token from another lease, or from no lease: rejected.
    assert_stale(fence(&c, "k", 10, "lease-b").await);
    assert_stale(fence(&c, "k", 10, "").await);
    assert_stale(fence(&c, "k", 9, "lease-a").await);
    // A newer lease takes over; the old lease's token is now stale.
    assert_eq!(fence(&c, "k", 11, "lease-b").await.unwrap(), 11);
    assert_eq!(stored(&c, "k").await, Some((11, "lease-b".to_owned())));
    assert_stale(fence(&c, "k", 10, "lease-a").await);

    // Empty lease on both sides counts as the same lease.
    assert_eq!(fence(&c, "e", 3, "").await.unwrap(), 3);
    assert_eq!(fence(&c, "e", 3, "").await.unwrap(), 3);
    assert_stale(fence(&c, "e", 3, "lease-x").await);
}

/// T1 fences `key` with 34 and keeps its transaction open; T2 fences with
/// 33. T2 must wait for T1's row lock; the outcome depends on T1's end.
/// `previous`: a committed mark before both (None: fresh key, so T1's
/// uncommitted insert is what T2 waits on).
async fn concurrent_case(pg: &PgServer, key: &str, previous: Option<i64>, t1_commits: bool) {
    let mut c1 = connect(pg).await;
    let c2 = connect(pg).await;
    if let Some(p) = previous {
        fence(&c1, key, p, "").await.unwrap();
    }

    let t1 = c1.transaction().await.unwrap();
    assert_eq!(fence(&t1, key, 34, "lease-34").await.unwrap(), 34);

    let key2 = key.to_owned();
    let t2 = tokio::spawn(async move {
        c2.batch_execute("BEGIN").await.unwrap();
        let r = fence(&c2, &key2, 33, "lease-33").await;
        let finished = Instant::now();
        match &r {
            Ok(_) => c2.batch_execute("COMMIT").await.unwrap(),
            Err(_) => c2.batch_execute("ROLLBACK").await.unwrap(),
        }
        (r, finished)
    });

    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !t2.is_finished(),
        "T2 must wait for T1's lock on the fence row ({key})"
    );
    let released = Instant::now();
    if t1_commits {
        t1.commit().await.unwrap();
    } else {
        t1.rollback().await.unwrap();
    }
    let (r, finished) = tokio::time::timeout(Duration::from_secs(10), t2)
        .await
        .expect("T2 still blocked after T1 ended")
        .unwrap();
    assert!(finished >= released, "T2 completed before T1 ended");

    let check = connect(pg).await;
    if t1_commits {
        assert_stale(r);
        assert_eq!(stored(&check, key).await, Some((34, "lease-34".to_owned())));
    } else {
        assert_eq!(r.unwrap(), 33, "T1 rolled back, 33 is above the mark");
        assert_eq!(stored(&check, key).await, Some((33, "lease-33".to_owned())));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_holders_serialize_on_the_fence_row() {
    let (pg, _c) = setup().await;
    concurrent_case(&pg, "existing-commit", Some(30), true).await;
    concurrent_case(&pg, "existing-rollback", Some(30), false).await;
    concurrent_case(&pg, "fresh-commit", None, true).await;
    concurrent_case(&pg, "fresh-rollback", None, false).await;
}

/// An accepted equal token (the same holder writing again) changes no row
/// but must still lock it: a newer holder waits until the older holder's
/// transaction is over, so its writes land after the older holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_equal_token_still_holds_the_row_lock() {
    let (pg, mut c1) = setup().await;
    let c2 = connect(&pg).await;
    fence(&c1, "k", 10, "lease-a").await.unwrap();

    let t1 = c1.transaction().await.unwrap();
    assert_eq!(fence(&t1, "k", 10, "lease-a").await.unwrap(), 10);
    let t2 = tokio::spawn(async move {
        c2.batch_execute("BEGIN").await.unwrap();
        let r = fence(&c2, "k", 11, "lease-b").await;
        c2.batch_execute("COMMIT").await.unwrap();
        r
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!t2.is_finished(), "the newer holder must wait for T1");
    t1.commit().await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(10), t2)
        .await
        .expect("T2 still blocked after T1 ended")
        .unwrap();
    assert_eq!(r.unwrap(), 11);
    assert_eq!(stored(&c1, "k").await, Some((11, "lease-b".to_owned())));
}

/// Read-modify-write on one hot row, no `FOR UPDATE` on the data: the
/// fence row lock alone serializes the holders, so no increment is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_account_has_no_lost_updates() {
    const TASKS: usize = 8;
    const PER_TASK: usize = 50;
    let (pg, c) = setup().await;
    let next_token = Arc::new(AtomicU64::new(1));
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let mut client = connect(&pg).await;
        let next_token = next_token.clone();
        tasks.push(tokio::spawn(async move {
            let (mut committed, mut stale) = (0_usize, 0_usize);
            while committed < PER_TASK {
                let token = next_token.fetch_add(1, Ordering::SeqCst) as i64;
                let tx = client.transaction().await.unwrap();
                match fence(&tx, "hot-account", token, &format!("lease-{token}")).await {
                    Ok(t) => assert_eq!(t, token),
                    Err(e) => {
                        assert_eq!(sqlstate(&e), STALE, "{e:?}");
                        tx.rollback().await.unwrap();
                        stale += 1;
                        continue;
                    }
                }
                let b: i32 = tx
                    .query_one("SELECT balance FROM accounts WHERE id = 1", &[])
                    .await
                    .unwrap()
                    .get(0);
                tokio::task::yield_now().await;
                tx.execute("UPDATE accounts SET balance = $1 WHERE id = 1", &[&(b + 1)])
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
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
    assert_eq!(committed, TASKS * PER_TASK);
    assert_eq!(
        balance(&c).await as usize,
        committed,
        "lost updates ({stale} stale retries)"
    );
    let (mark, _) = stored(&c, "hot-account").await.unwrap();
    assert!(mark as u64 <= next_token.load(Ordering::SeqCst));
    eprintln!("hot account: {committed} commits, {stale} stale-token retries");
}

/// The harness itself: stop/restart keeps data, pause freezes existing
/// connections, kill + restart recovers every acknowledged commit (with
/// `synchronous_commit=on`; the default `off` may lose the last ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_restart_pause_kill() {
    let (mut pg, c) = setup_with(PgServer::start_with(&[("synchronous_commit", "on")])).await;
    let sync: String = c
        .query_one("SHOW synchronous_commit", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(sync, "on", "start_with settings override the defaults");
    let port = pg.port;
    fence(&c, "k", 7, "").await.unwrap();
    drop(c);

    pg.restart();
    assert_eq!(pg.port, port);
    let c = connect(&pg).await;
    assert_eq!(stored(&c, "k").await, Some((7, String::new())));

    pg.pause();
    let c = Arc::new(c);
    let c2 = c.clone();
    let during = tokio::spawn(async move { fence(&*c2, "k", 8, "").await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!during.is_finished(), "a paused server must not answer");
    pg.resume();
    // The call made while paused completes once resumed.
    let r = tokio::time::timeout(Duration::from_secs(10), during).await;
    assert_eq!(r.expect("no answer after resume").unwrap().unwrap(), 8);

    let old_pid = pg.pid();
    pg.kill();
    assert!(c.query_one("SELECT 1", &[]).await.is_err());
    pg.restart(); // crash recovery
    assert_ne!(pg.pid(), old_pid);
    let c = connect(&pg).await;
    assert_eq!(stored(&c, "k").await, Some((8, String::new())));
}
