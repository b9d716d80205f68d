//! PostgreSQL lock backend: faults and server-side time.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::postgres::PgServer;
use common::*;

fn sidecar(pg: &PgServer, extra: &[(&str, &str)]) -> Fencer {
    let s = Fencer::sidecar(Backend::Postgres, Some(&pg.url()), extra);
    s.wait_ready();
    s
}

/// PostgreSQL down: 503 quickly; back: the sidecar recovers by itself and
/// tokens continue above everything issued before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_restart_gives_503_then_recovers_with_tokens_intact() {
    let mut pg = PgServer::start_with(&[("synchronous_commit", "on")]);
    let s = sidecar(&pg, &[("backend.postgres.request_timeout_ms", "500")]);
    let mut last = 0;
    for _ in 0..20 {
        let r = s.acquire("pg:1", 10_000, 0).await;
        last = r.token();
        s.release("pg:1", &r.lease()).await;
    }
    pg.kill();
    let started = Instant::now();
    let r = s.acquire("pg:1", 10_000, 0).await;
    assert_eq!(
        (r.status, r.code()),
        (503, "backend_unavailable"),
        "{}",
        r.body
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    // The backend's state now; the pod's readiness does not follow it
    // once the sidecar has started (issue 10 item 9).
    assert!(!http_ok(&format!("{}/readyz?backend=1", s.admin)));
    assert!(http_ok(&format!("{}/readyz", s.admin)));
    pg.restart();
    let r = s.acquire_eventually("pg:1").await;
    assert!(r.token() > last, "token {} after {last}", r.token());
    s.wait_ready();
}

/// The LISTEN connection is terminated by the server: the sidecar
/// reconnects, re-checks its waiters, and the next release wakes them by
/// NOTIFY again (no polling).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_listen_connection_is_replaced() {
    let pg = PgServer::start();
    let a = sidecar(&pg, &[]);
    let b = Arc::new(sidecar(&pg, &[]));
    let held = a.acquire("pg:listen", 60_000, 0).await;
    assert_eq!(held.status, 200);
    let b2 = b.clone();
    let waiter = tokio::spawn(async move { b2.acquire("pg:listen", 60_000, 30_000).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let acquire_calls = [("op", "acquire")];
    let tries = b
        .metric(
            "fencer_backend_request_duration_seconds_count",
            &acquire_calls,
        )
        .await;
    let killed = pg_query_i64(
        &pg.url(),
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = 'fencer-listener'",
    )
    .await;
    assert_eq!(killed, 2, "one LISTEN connection per sidecar");
    // Wait for b to have re-established LISTEN (it re-checks its queue).
    let deadline = Instant::now() + Duration::from_secs(10);
    while b
        .metric("fencer_waiter_wakeups_total", &[("cause", "resync")])
        .await
        < 1.0
    {
        assert!(Instant::now() < deadline, "no resync after reconnect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The resync's re-check has answered "held" before the release: else a
    // slow re-check could land after it and take the key with no wake-up
    // at all (seen once under load).
    while b
        .metric(
            "fencer_backend_request_duration_seconds_count",
            &acquire_calls,
        )
        .await
        <= tries
    {
        assert!(Instant::now() < deadline, "no re-check after the resync");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!waiter.is_finished());
    assert_eq!(a.release("pg:listen", &held.lease()).await.status, 200);
    let got = waiter.await.unwrap();
    assert_eq!(got.status, 200, "{}", got.body);
    assert_eq!(
        b.metric("fencer_waiter_wakeups_total", &[("cause", "fallback")])
            .await,
        0.0
    );
    assert!(
        b.metric("fencer_waiter_wakeups_total", &[("cause", "release")])
            .await
            >= 1.0
    );
}

/// Leases expire by the server's clock: a sidecar whose wall clock is a day
/// off (libfaketime) sees exactly the same lease lifetimes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_expiry_follows_the_server_clock_not_the_sidecars() {
    let lib = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
    assert!(
        std::path::Path::new(lib).exists(),
        "install Debian's faketime package (tests/run.sh does)"
    );
    let pg = PgServer::start();
    for offset in ["-1d", "+1d"] {
        let s = Fencer::sidecar_env(
            Backend::Postgres,
            Some(&pg.url()),
            &[],
            &[
                ("LD_PRELOAD", lib),
                ("FAKETIME", offset),
                ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
            ],
        );
        s.wait_ready();
        let key = format!("pg:clock{offset}");
        let a = s.acquire(&key, 1_000, 0).await;
        assert_eq!(a.status, 200, "{}", a.body);
        let b = s.acquire(&key, 1_000, 0).await;
        assert_eq!(
            b.code(),
            "lock_held",
            "skewed sidecar clock {offset} changed the lease"
        );
        let remaining = pg_query_i64(
            &pg.url(),
            &format!(
                "SELECT (EXTRACT(EPOCH FROM expires_at - clock_timestamp()) * 1000)::bigint FROM fencer_locks WHERE key = '{key}'"
            ),
        )
        .await;
        assert!(
            (0..=1_000).contains(&remaining),
            "expiry {remaining} ms away on the server"
        );
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        let c = s.acquire(&key, 1_000, 0).await;
        assert_eq!(c.status, 200, "{}", c.body);
        // The fake clock really was in effect in that process.
        let shifted = if offset == "-1d" { -1 } else { 1 };
        let day = pg_query_i64(
            &pg.url(),
            &format!("SELECT EXTRACT(DAY FROM now() + interval '{shifted} day')::bigint"),
        )
        .await;
        let logs = s.logs();
        let stamp = logs
            .lines()
            .find(|l| l.contains("sidecar listening"))
            .unwrap_or_default()
            .to_owned();
        assert!(
            stamp.contains(&format!("-{day:02}T")),
            "faketime not applied: {stamp}"
        );
    }
}

/// Idle rows are deleted by the clean-up, and a deleted key's next token is
/// still above every token it had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleaning_up_idle_rows_never_lets_tokens_go_back() {
    let pg = PgServer::start();
    let s = sidecar(
        &pg,
        &[
            ("backend.postgres.idle_cleanup_after_ms", "1000"),
            ("backend.postgres.cleanup_interval_ms", "200"),
        ],
    );
    let mut last = 0;
    for _ in 0..10 {
        let r = s.acquire("pg:idle", 10_000, 0).await;
        last = r.token();
        s.release("pg:idle", &r.lease()).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while pg_query_i64(&pg.url(), "SELECT count(*) FROM fencer_locks").await > 0 {
        assert!(Instant::now() < deadline, "idle row not cleaned up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = s.acquire("pg:idle", 10_000, 0).await;
    assert!(
        r.token() > last,
        "token {} after {last}: went back after clean-up",
        r.token()
    );
}

/// `sslmode=require` in the URL: the sidecar talks TLS and verifies the
/// server against the configured CA; without that CA it refuses to connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_postgres_is_verified() {
    let certs = make_certs();
    let crt = certs.path().join("server.crt");
    let key = certs.path().join("server.key");
    let ca = certs.path().join("ca.crt");
    let pg = PgServer::start_with(&[
        ("ssl", "on"),
        ("ssl_cert_file", crt.to_str().unwrap()),
        ("ssl_key_file", key.to_str().unwrap()),
    ]);
    let url = format!("{}?sslmode=require", pg.url());
    let s = Fencer::sidecar(
        Backend::Postgres,
        Some(&url),
        &[("backend.postgres.ca_file", ca.to_str().unwrap())],
    );
    s.wait_ready();
    let r = s.acquire("tls:1", 10_000, 0).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let encrypted = pg_query_i64(
        &pg.url(),
        "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid) WHERE ssl AND application_name LIKE 'fencer-%'",
    )
    .await;
    assert!(encrypted >= 1, "no TLS connection from the sidecar");
    // Without the CA the server cannot be verified: never ready.
    let untrusted = Fencer::sidecar(
        Backend::Postgres,
        Some(&url),
        &[("backend.postgres.request_timeout_ms", "500")],
    );
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert!(!http_ok(&format!("{}/readyz", untrusted.admin)));
    let r = untrusted.acquire("tls:2", 10_000, 0).await;
    assert_eq!(r.code(), "backend_unavailable");
}

/// Issue 32 item 3: concurrent acquires and releases of one sidecar share
/// statements (one transaction, one WAL flush for several keys), and a
/// shared statement never gives one key to two holders: 24 clients on 8
/// keys (three per key, each waiting its turn) check that at most one of
/// them is inside each key at any time, and every key's tokens rise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_acquires_share_statements_and_keep_keys_exclusive() {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicI64, Ordering};
    use std::sync::Mutex;

    let pg = PgServer::start();
    let s = Arc::new(sidecar(&pg, &[]));
    let name = "fencer_sql_lock_items_per_statement";
    let inside: Arc<Vec<AtomicI64>> = Arc::new((0..8).map(|_| AtomicI64::new(0)).collect());
    let tokens: Arc<Mutex<HashMap<usize, Vec<u64>>>> = Arc::default();
    let mut round = 0;
    loop {
        round += 1;
        let clients: Vec<_> = (0..24usize)
            .map(|c| {
                let (s, inside, tokens) = (s.clone(), inside.clone(), tokens.clone());
                tokio::spawn(async move {
                    let k = c % 8;
                    let key = format!("pg:shared-{k}");
                    for _ in 0..5 {
                        let r = s.acquire(&key, 10_000, 10_000).await;
                        assert_eq!(r.status, 200, "{key}: {}", r.body);
                        let was = inside[k].fetch_add(1, Ordering::SeqCst);
                        assert_eq!(was, 0, "{key}: two holders at once");
                        tokens.lock().unwrap().entry(k).or_default().push(r.token());
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        inside[k].fetch_sub(1, Ordering::SeqCst);
                        let released = s.release(&key, &r.lease()).await;
                        assert_eq!(released.status, 200, "{key}: {}", released.body);
                    }
                })
            })
            .collect();
        for c in clients {
            c.await.unwrap();
        }
        for (k, seen) in tokens.lock().unwrap().iter() {
            let mut sorted = seen.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(
                sorted.len(),
                seen.len(),
                "pg:shared-{k}: a token issued twice"
            );
        }
        let m = s.metrics().await;
        let shared = |op| {
            let labels = [("db", "postgres"), ("op", op)];
            (
                metric_sum(&m, &format!("{name}_count"), &labels),
                metric_sum(&m, &format!("{name}_sum"), &labels),
            )
        };
        let (acquires, releases) = (shared("acquire"), shared("release"));
        assert!(acquires.1 >= 120.0 * round as f64, "{acquires:?}");
        if acquires.1 > acquires.0 && releases.1 > releases.0 {
            break;
        }
        assert!(
            round < 5,
            "no statement carried two acquires and two releases in {round} rounds of 24 clients: acquires {acquires:?}, releases {releases:?} (statements, items)"
        );
    }
}

/// Statements that lock several lock rows — the shared acquire and release
/// of the group commit, and the renewer's `RENEW_MANY` — lock them in key
/// order, so they cannot deadlock. Made to happen for certain: a third
/// transaction holds `k1`; a shared release (`k1, k2`) queues on it, then a
/// renewal of both in the other order (`k2, k1`) starts. Taken as given,
/// the renewal would lock `k2` and queue on `k1` behind the release, which,
/// once it has `k1`, would wait for `k2`: a deadlock, one aborted (the
/// renewal of a held lease answered with an error). In key order the
/// renewal waits on `k1` holding nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_row_lock_statements_lock_rows_in_key_order() {
    use fencer::lock::postgres::sql::{RELEASE_MANY, RENEW_MANY};
    let pg = PgServer::start();
    // A sidecar creates the schema.
    let _s = sidecar(&pg, &[]);
    let x = pg_connect(&pg.url()).await;
    x.batch_execute(
        "INSERT INTO fencer_locks (key, lease_id, token, expires_at) VALUES \
         ('k1', 'l1', 1, clock_timestamp() + interval '1 hour'), \
         ('k2', 'l2', 1, clock_timestamp() + interval '1 hour')",
    )
    .await
    .unwrap();
    x.batch_execute("BEGIN; SELECT 1 FROM fencer_locks WHERE key = 'k1' FOR UPDATE")
        .await
        .unwrap();
    let waiting = |n: i64| {
        let url = pg.url();
        async move { pg_until_lock_waiters(&url, n).await }
    };
    let run = |statement: &'static str, keys: [&'static str; 2], third: Vec<String>| {
        let pg_url = pg.url();
        tokio::spawn(async move {
            let c = pg_connect(&pg_url).await;
            let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
            let leases: Vec<String> = keys.iter().map(|k| k.replace('k', "l")).collect();
            if statement == RENEW_MANY {
                let ttls = vec![60_000i64; 2];
                c.query(statement, &[&keys, &leases, &ttls]).await
            } else {
                c.query(statement, &[&keys, &leases, &third]).await
            }
            .map(|rows| rows.len())
        })
    };
    let release = run(RELEASE_MANY, ["k1", "k2"], vec!["ch".into(); 2]);
    waiting(1).await;
    let renew = run(RENEW_MANY, ["k2", "k1"], vec![]);
    waiting(2).await;
    x.batch_execute("COMMIT").await.unwrap();
    let (release, renew) = (release.await.unwrap(), renew.await.unwrap());
    assert_eq!(
        release.map_err(|e| e.to_string()),
        Ok(2),
        "the shared release"
    );
    assert_eq!(renew.map_err(|e| e.to_string()), Ok(2), "the renewal");
}

/// The group commit through an outage: PostgreSQL is stopped (SIGSTOP)
/// for 1.5 s while 16 clients on 8 keys acquire and release, so lone and
/// shared statements are cut off mid-way, their callers give up and the
/// lock manager retries and releases — every mechanism that acts on an
/// abandoned acquire meets a shared statement. Afterwards: no key was ever
/// held by two clients at once, every client acquires again, each key's
/// tokens rose, and no key is left taken by a lease nobody was told of
/// (the TTL is 30 s: what is still held 3 s after the end is an orphan).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_postgres_under_shared_statements_leaves_no_orphan_and_no_second_holder() {
    use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

    let pg = PgServer::start();
    let s = Arc::new(sidecar(
        &pg,
        &[("backend.postgres.request_timeout_ms", "500")],
    ));
    let inside: Arc<Vec<AtomicI64>> = Arc::new((0..8).map(|_| AtomicI64::new(0)).collect());
    let last_token: Arc<Vec<AtomicU64>> = Arc::new((0..8).map(|_| AtomicU64::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let resumed_at = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let clients: Vec<_> = (0..16usize)
        .map(|c| {
            let (s, inside, last_token, stop, resumed_at) = (
                s.clone(),
                inside.clone(),
                last_token.clone(),
                stop.clone(),
                resumed_at.clone(),
            );
            tokio::spawn(async move {
                let k = c % 8;
                let key = format!("pg:outage-{k}");
                let mut after_resume = 0;
                while !stop.load(Ordering::SeqCst) {
                    let r = s.acquire(&key, 30_000, 300).await;
                    if r.status != 200 {
                        assert!(
                            matches!(
                                r.code(),
                                "lock_held" | "backend_unavailable" | "lock_timeout"
                            ),
                            "{key}: {} {}",
                            r.status,
                            r.body
                        );
                        continue;
                    }
                    let was = inside[k].fetch_add(1, Ordering::SeqCst);
                    assert_eq!(was, 0, "{key}: two holders at once");
                    let before = last_token[k].fetch_max(r.token(), Ordering::SeqCst);
                    assert!(
                        r.token() > before,
                        "{key}: token {} after {before}",
                        r.token()
                    );
                    tokio::time::sleep(Duration::from_millis(3)).await;
                    inside[k].fetch_sub(1, Ordering::SeqCst);
                    let _ = s.release(&key, &r.lease()).await;
                    if resumed_at.lock().unwrap().is_some() {
                        after_resume += 1;
                    }
                }
                after_resume
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    pg.pause();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    pg.resume();
    *resumed_at.lock().unwrap() = Some(Instant::now());
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    stop.store(true, Ordering::SeqCst);
    for (c, client) in clients.into_iter().enumerate() {
        let after = client.await.unwrap();
        assert!(
            after > 0,
            "client {c} never acquired again after the outage"
        );
    }
    let name = "fencer_sql_lock_items_per_statement";
    let shared = s.metric(&format!("{name}_sum"), &[("op", "acquire")]).await
        - s.metric(&format!("{name}_count"), &[("op", "acquire")])
            .await;
    assert!(
        shared > 0.0,
        "no acquire statement was shared: nothing under test"
    );
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    let taken = pg_query_i64(
        &pg.url(),
        "SELECT count(*) FROM fencer_locks WHERE key LIKE 'pg:outage-%' \
         AND lease_id IS NOT NULL AND expires_at > clock_timestamp()",
    )
    .await;
    assert_eq!(
        taken, 0,
        "keys still taken 3 s after every client released (TTL 30 s)"
    );
}

/// One slow key does not hold the others up behind the group commit: a
/// third transaction holds `pg:blocked`'s row, so an acquire of it waits
/// for the row lock (up to `lock_timeout`, 2.5 s here). Acquires of other
/// keys that arrive once that statement is older than the group's bound
/// (250 ms) go out alone instead of queueing behind it for the whole wait.
/// (Calls that queued before it became slow still wait for it; see
/// `src/pg/group.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_waiting_on_a_row_lock_does_not_hold_up_other_keys() {
    let pg = PgServer::start();
    let s = Arc::new(sidecar(
        &pg,
        &[("backend.postgres.request_timeout_ms", "5000")],
    ));
    let r = s.acquire("pg:blocked", 10_000, 0).await;
    assert_eq!(r.status, 200, "{}", r.body);
    s.release("pg:blocked", &r.lease()).await;
    let x = pg_connect(&pg.url()).await;
    x.batch_execute("BEGIN; SELECT 1 FROM fencer_locks WHERE key = 'pg:blocked' FOR UPDATE")
        .await
        .unwrap();
    let blocked = {
        let s = s.clone();
        tokio::spawn(async move { s.acquire("pg:blocked", 10_000, 0).await })
    };
    pg_until_lock_waiters(&pg.url(), 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let others: Vec<_> = (0..8)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move { s.acquire(&format!("pg:free-{i}"), 10_000, 0).await })
        })
        .collect();
    for o in others {
        let r = o.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(1_500),
        "acquires of free keys waited {took:?} behind a statement waiting on another key's row lock"
    );
    assert!(
        !blocked.is_finished(),
        "the blocked acquire ended before the others: nothing under test"
    );
    x.batch_execute("COMMIT").await.unwrap();
    let r = blocked.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
}

/// Read-write locks (issue 33 item 2) under the group commit: readers and
/// writers of 6 keys at once, writers' acquires sharing statements
/// (`fencer_acquire_many_v2`, whose writers find readers and wait for
/// them), readers through their own statements
/// ([`common::rw_check::readers_and_writers_never_overlap`]). Mutant
/// `writers_skip_readers` fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_and_writers_under_shared_statements_never_overlap() {
    let pg = PgServer::start();
    let s = Arc::new(sidecar(&pg, &[]));
    common::rw_check::readers_and_writers_never_overlap(&[s], "pg").await;
}
