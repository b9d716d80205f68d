//! `deploy/sql/fencer_fence.sql` against a real, test-owned PostgreSQL:
//! signed-token verification, token semantics, atomicity with the caller's
//! own writes, the row lock that serializes concurrent holders of one key,
//! and the gateway's in-flight stamps.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::postgres::PgServer;
use common::SECRET;
use fencer::token::{lease_tag, Claim, Signer};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, GenericClient, NoTls};

const SQL: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/sql/fencer_fence.sql"
));

/// SQLSTATE raised for a stale token.
const STALE: &str = "23F01";
/// SQLSTATE raised for a token that is not validly signed.
const INVALID: &str = "23F02";

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
    c.execute(
        "INSERT INTO fencer_signing_keys (key_id, secret) VALUES ('k1', convert_to($1, 'UTF8'))",
        &[&SECRET],
    )
    .await
    .unwrap();
    c.batch_execute(
        "CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL);
         INSERT INTO accounts VALUES (1, 0);",
    )
    .await
    .unwrap();
    (pg, c)
}

/// The token a sidecar would hand out for `lease` on `key`.
fn signed(key: &str, token: i64, lease: &str) -> String {
    Signer::new("k1", SECRET.as_bytes()).sign(&Claim::new(key, token as u64, lease))
}

async fn fence_wire(
    c: &impl GenericClient,
    wire: &str,
    key: Option<&str>,
) -> Result<i64, tokio_postgres::Error> {
    c.query_one("SELECT fencer_fence($1, $2)", &[&wire, &key])
        .await
        .map(|row| row.get(0))
}

async fn fence(
    c: &impl GenericClient,
    key: &str,
    token: i64,
    lease: &str,
) -> Result<i64, tokio_postgres::Error> {
    fence_wire(c, &signed(key, token, lease), Some(key)).await
}

fn tag(lease: &str) -> String {
    lease_tag(lease)
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
    assert_eq!(stored(&c, "acct").await, Some((40, tag(""))));

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
    assert_eq!(stored(&c, "acct").await, Some((40, tag(""))));

    // Fences are per key.
    assert_eq!(fence(&c, "other", 1, "").await.unwrap(), 1);
    // And the high-water mark keeps moving.
    assert_eq!(fence(&c, "acct", 41, "").await.unwrap(), 41);

    // Bad arguments.
    let e = fence(&c, "acct", 0, "").await.unwrap_err();
    assert_eq!(sqlstate(&e), "22023", "{e:?}");
    let null: Option<&str> = None;
    let e = c
        .query_one("SELECT fencer_fence($1)", &[&null])
        .await
        .unwrap_err();
    assert_eq!(
        sqlstate(&e),
        SqlState::NULL_VALUE_NOT_ALLOWED.code(),
        "{e:?}"
    );
    // Without a key to check, the token's own key is fenced.
    let t: i64 = c
        .query_one("SELECT fencer_fence($1)", &[&signed("acct", 42, "")])
        .await
        .unwrap()
        .get(0);
    assert_eq!(t, 42);
    assert_eq!(stored(&c, "acct").await, Some((42, tag(""))));
}

/// Issue 10 item 11: only a token a sidecar signed can move the mark the
/// gateway shares. A bare or forged huge number used to lock the key out
/// for good (the repair raised the lock row to 2^63-1, then overflowed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_signed_tokens_move_the_mark() {
    let (_pg, c) = setup().await;
    assert_eq!(fence(&c, "acct", 5, "a").await.unwrap(), 5);
    let good = signed("acct", 6, "a");
    let forged = Signer::new("k1", b"not-the-secret-not-the-secret-not-the-secret")
        .sign(&Claim::new("acct", i64::MAX as u64, "evil"));
    let inflated = good.replacen(".6.", &format!(".{}.", i64::MAX), 1);
    let other_kid = good.replacen("v2.k1.", "v2.k9.", 1);
    for bad in [
        forged.as_str(),
        inflated.as_str(),
        other_kid.as_str(),
        "garbage",
        "v2.k1.7.x.YWNjdA.",
        "v2.k1.99999999999999999999.x.YWNjdA.AAAA",
    ] {
        let e = fence_wire(&c, bad, None).await.unwrap_err();
        assert_eq!(sqlstate(&e), INVALID, "{bad}: {e:?}");
    }
    // A valid token for another key than the one written.
    let e = fence_wire(&c, &signed("other", 9, "a"), Some("acct"))
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), INVALID, "{e:?}");
    assert_eq!(stored(&c, "acct").await, Some((5, tag("a"))));
    // A v1 token (lease id in clear) of an older sidecar verifies, by tag.
    let v1 = common::sign_v1("acct", 7, "a");
    assert_eq!(fence_wire(&c, &v1, Some("acct")).await.unwrap(), 7);
    assert_eq!(stored(&c, "acct").await, Some((7, tag("a"))));
    assert_eq!(fence_wire(&c, &good, Some("acct")).await.ok(), None);
    // A key id limited to other keys' prefixes signs nothing here.
    c.execute(
        "UPDATE fencer_signing_keys SET key_prefixes = ARRAY['team-b/'] WHERE key_id = 'k1'",
        &[],
    )
    .await
    .unwrap();
    let e = fence(&c, "acct", 8, "a").await.unwrap_err();
    assert_eq!(sqlstate(&e), INVALID, "{e:?}");
    assert_eq!(fence(&c, "team-b/x", 1, "a").await.unwrap(), 1);
}

/// The gateway's in-flight stamp: a fenced write through the gateway may
/// still land, so a direct SQL write must not overtake it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_request_in_flight_keeps_sql_writers_out() {
    let (_pg, c) = setup().await;
    assert_eq!(fence(&c, "acct", 33, "a").await.unwrap(), 33);
    c.execute(
        "UPDATE fencer_fences SET inflight_id = 'req-1', inflight_until = clock_timestamp() + interval '1 hour' WHERE key = 'acct'",
        &[],
    )
    .await
    .unwrap();
    let e = fence(&c, "acct", 34, "b").await.unwrap_err();
    assert_eq!(sqlstate(&e), "55P03", "{e:?}");
    c.execute(
        "UPDATE fencer_fences SET inflight_until = clock_timestamp() - interval '1 second' WHERE key = 'acct'",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(fence(&c, "acct", 34, "b").await.unwrap(), 34);
}

/// Issue 10 item 10: under REPEATABLE READ, a holder writing again with its
/// own token used to change nothing in the fence row, so a newer holder
/// whose snapshot predates that write passed without 40001 and built on a
/// stale read. The equal-token path now rewrites the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeatable_read_sees_a_holder_reusing_its_token_as_a_conflict() {
    let (pg, mut c1) = setup().await;
    let c2 = connect(&pg).await;
    fence(&c1, "acct", 10, "a").await.unwrap();
    // The newer holder starts first: its snapshot is taken by its fence
    // call, which then waits for the older holder's transaction.
    let t1 = c1.transaction().await.unwrap();
    assert_eq!(fence(&t1, "acct", 10, "a").await.unwrap(), 10);
    t1.execute(
        "UPDATE accounts SET balance = balance + 1 WHERE id = 1",
        &[],
    )
    .await
    .unwrap();
    let newer = tokio::spawn(async move {
        c2.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            .await
            .unwrap();
        let r = fence(&c2, "acct", 11, "b").await;
        let _ = c2.batch_execute("ROLLBACK").await;
        r
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    t1.commit().await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(10), newer)
        .await
        .unwrap()
        .unwrap();
    let e = r.expect_err("the newer holder's snapshot misses the older holder's write");
    assert_eq!(sqlstate(&e), "40001", "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_token_same_lease_accepted_other_lease_rejected() {
    let (_pg, c) = setup().await;

    assert_eq!(fence(&c, "k", 10, "lease-a").await.unwrap(), 10);
    // Same holder again (a retried write): accepted, nothing changes.
    assert_eq!(fence(&c, "k", 10, "lease-a").await.unwrap(), 10);
    assert_eq!(stored(&c, "k").await, Some((10, tag("lease-a"))));
    // Same token from another lease, or from no lease: rejected.
    assert_stale(fence(&c, "k", 10, "lease-b").await);
    assert_stale(fence(&c, "k", 10, "").await);
    assert_stale(fence(&c, "k", 9, "lease-a").await);
    // A newer lease takes over; the old lease's token is now stale.
    assert_eq!(fence(&c, "k", 11, "lease-b").await.unwrap(), 11);
    assert_eq!(stored(&c, "k").await, Some((11, tag("lease-b"))));
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
        assert_eq!(stored(&check, key).await, Some((34, tag("lease-34"))));
    } else {
        assert_eq!(r.unwrap(), 33, "T1 rolled back, 33 is above the mark");
        assert_eq!(stored(&check, key).await, Some((33, tag("lease-33"))));
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
    assert_eq!(stored(&c1, "k").await, Some((11, tag("lease-b"))));
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
    assert_eq!(stored(&c, "k").await, Some((7, tag(""))));

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
    assert_eq!(stored(&c, "k").await, Some((8, tag(""))));
}

/// Read-write locks (issue 33 item 2): a reader's read admitted by the
/// gateway (the row's `read_token`) fences SQL writers below it as the
/// gateway's own writes are fenced; a read lease's token itself (v3) never
/// writes here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_readers_mark_fences_sql_writers_and_read_tokens_never_write() {
    let (_pg, c) = setup().await;
    fence(&c, "doc:1", 5, "writer-5").await.unwrap();
    // A reader of token 8 read through the gateway.
    c.execute(
        "UPDATE fencer_fences SET read_token = 8 WHERE key = 'doc:1'",
        &[],
    )
    .await
    .unwrap();
    assert_stale(fence(&c, "doc:1", 5, "writer-5").await);
    assert_stale(fence(&c, "doc:1", 7, "writer-7").await);
    assert_eq!(fence(&c, "doc:1", 9, "writer-9").await.unwrap(), 9);
    let read = Signer::new("k1", SECRET.as_bytes()).sign(&Claim::with_mode(
        "doc:1",
        10,
        "reader-10",
        fencer::token::Mode::Read,
    ));
    let e = fence_wire(&c, &read, Some("doc:1")).await.unwrap_err();
    assert_eq!(sqlstate(&e), INVALID, "{e:?}");
    assert!(e
        .as_db_error()
        .unwrap()
        .detail()
        .unwrap()
        .contains("read lease"));
    assert_eq!(stored(&c, "doc:1").await, Some((9, tag("writer-9"))));
}
