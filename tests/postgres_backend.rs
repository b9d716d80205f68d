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
