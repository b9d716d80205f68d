//! Redis-specific behaviour and faults: outages, lost replies, pub/sub
//! wake-ups across sidecars, and token monotonicity across restarts.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use redis::Commands;

fn sidecar(redis_url: &str, extra: &[(&str, &str)]) -> Fencer {
    Fencer::sidecar(Backend::Redis, Some(redis_url), extra)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_gives_503_quickly_and_recovers_without_restart() {
    let mut redis = RedisServer::start(Persistence::Off);
    let s = sidecar(&redis.url(), &[("backend.redis.request_timeout_ms", "300")]);
    let a = s.acquire("out:1", 5_000, 0).await;
    assert_eq!(a.status, 200);

    redis.kill();
    let started = Instant::now();
    let r = s.acquire("out:2", 5_000, 0).await;
    assert_eq!(
        (r.status, r.code()),
        (503, "backend_unavailable"),
        "{}",
        r.body
    );
    // Bounded by the configured timeouts and retries, not a hang (generous
    // bound: this is about "no hang", not speed).
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    let ready = s
        .http
        .get(format!("{}/readyz?backend=1", s.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    // The pod's readiness does not follow the backend after start-up: a
    // Redis restart must not take every application pod out of service.
    let pod_ready = s
        .http
        .get(format!("{}/readyz", s.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(pod_ready.status(), 200);

    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = s.acquire("out:3", 5_000, 0).await;
        if r.status == 200 {
            break;
        }
        assert_eq!(r.code(), "backend_unavailable", "{}", r.body);
        assert!(Instant::now() < deadline, "sidecar did not recover");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ready = s
        .http
        .get(format!("{}/readyz", s.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    assert!(
        s.metric("fencer_backend_errors_total", &[("op", "acquire")])
            .await
            >= 1.0
    );
}

/// The reply to the acquire script is swallowed and the connection cut: the
/// sidecar retries with the same lease id and gets the same token; exactly
/// one token was minted and the lock belongs to the returned lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_is_idempotent_after_a_lost_reply() {
    let redis = RedisServer::start(Persistence::Off);
    let proxy = FaultProxy::start(redis.port);
    let s = sidecar(&proxy.url(), &[("backend.redis.token_mode", "counter")]);
    // Warm up: one normal cycle (token 1).
    let warm = s.acquire("idem:1", 10_000, 0).await;
    assert_eq!(warm.token(), 1);
    s.release("idem:1", &warm.lease()).await;

    proxy.drop_next_script_reply();
    let r = s.acquire("idem:1", 10_000, 0).await;
    assert_eq!(r.status, 200, "{}\n{}", r.body, s.logs());
    assert_eq!(r.token(), 2, "a second token was minted");
    let mut conn = redis.conn();
    let counter: u64 = conn.get("fencer:{idem:1}:token").unwrap();
    assert_eq!(counter, 2);
    let value: String = conn.get("fencer:{idem:1}:lock").unwrap();
    assert_eq!(value, format!("{} 2", r.lease()));
    assert!(s.metric("fencer_acquire_retries_total", &[]).await >= 1.0);
    assert_eq!(s.release("idem:1", &r.lease()).await.status, 200);
}

/// Holder on sidecar A, waiter on sidecar B: B learns of the release only
/// through Redis pub/sub.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_wakes_a_waiter_in_another_sidecar_by_pubsub() {
    let redis = RedisServer::start(Persistence::Off);
    let a = sidecar(&redis.url(), &[]);
    let b = Arc::new(sidecar(&redis.url(), &[]));
    let held = a.acquire("ps:1", 30_000, 0).await;
    assert_eq!(held.status, 200);
    let b2 = b.clone();
    let waiter = tokio::spawn(async move { b2.acquire("ps:1", 30_000, 20_000).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    assert_eq!(a.release("ps:1", &held.lease()).await.status, 200);
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

/// A holder that dies without releasing publishes nothing: the waiter gets
/// in through its fallback re-check at the holder's PTTL, and that path is
/// counted (which is what makes the zero above meaningful).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_without_release_is_found_by_the_fallback_recheck() {
    let redis = RedisServer::start(Persistence::Off);
    let mut a = sidecar(&redis.url(), &[]);
    let b = sidecar(&redis.url(), &[]);
    let held = a.acquire("fb:1", 600, 0).await;
    assert_eq!(held.status, 200);
    a.kill();
    let got = b.acquire("fb:1", 5_000, 10_000).await;
    assert_eq!(got.status, 200, "{}", got.body);
    assert!(got.token() > held.token());
    assert!(
        b.metric("fencer_waiter_wakeups_total", &[("cause", "fallback")])
            .await
            >= 1.0
    );
}

/// While a waiter waits, Redis restarts (losing the lock, no persistence):
/// the pub/sub reconnect triggers a re-check and the waiter gets the lock
/// long before the old holder's TTL would have run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pubsub_reconnect_resyncs_waiters() {
    let mut redis = RedisServer::start(Persistence::Off);
    let a = sidecar(&redis.url(), &[]);
    let b = Arc::new(sidecar(
        &redis.url(),
        &[("sidecar.max_fallback_ms", "60000")],
    ));
    let held = a.acquire("rs:1", 60_000, 0).await;
    assert_eq!(held.status, 200);
    let b2 = b.clone();
    let waiter = tokio::spawn(async move { b2.acquire("rs:1", 60_000, 30_000).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.restart();
    let got = waiter.await.unwrap();
    assert_eq!(got.status, 200, "{}", got.body);
    assert!(
        b.metric("fencer_waiter_wakeups_total", &[("cause", "resync")])
            .await
            >= 1.0
    );
}

async fn cycle(s: &Fencer, key: &str) -> u64 {
    let r = s.acquire(key, 10_000, 0).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(s.release(key, &r.lease()).await.status, 200);
    r.token()
}

async fn assert_increasing(s: &Fencer, key: &str, n: usize, last: &mut u64) {
    for _ in 0..n {
        let t = cycle(s, key).await;
        assert!(t > *last, "token {t} after {last}");
        *last = t;
    }
}

/// Counter mode with AOF persistence: tokens keep increasing across a
/// sidecar restart and a Redis SIGKILL + restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_across_sidecar_and_redis_restarts() {
    let mut redis = RedisServer::start(Persistence::Aof);
    let mut s = sidecar(&redis.url(), &[("backend.redis.token_mode", "counter")]);
    let mut last = 0;
    assert_increasing(&s, "mono:1", 300, &mut last).await;
    s.restart();
    assert_increasing(&s, "mono:1", 300, &mut last).await;
    redis.restart();
    assert_increasing(&s, "mono:1", 300, &mut last).await;
    assert_eq!(last, 900, "counter mode mints 1, 2, 3, …");
}

/// Hybrid-clock mode (the default) survives a Redis that loses everything:
/// the next token is above every earlier one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hybrid_tokens_move_forward_after_redis_loses_its_data() {
    let mut redis = RedisServer::start(Persistence::Off);
    let s = sidecar(&redis.url(), &[]);
    let mut last = 0;
    assert_increasing(&s, "hyb:1", 200, &mut last).await;
    redis.restart();
    let mut conn = redis.conn();
    let counter: Option<u64> = conn.get("fencer:{hyb:1}:token").unwrap();
    assert_eq!(
        counter, None,
        "the restart must really have lost the counter"
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    let t = loop {
        let r = s.acquire("hyb:1", 10_000, 0).await;
        if r.status == 200 {
            break r.token();
        }
        assert!(Instant::now() < deadline, "no recovery: {}", r.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(t > last, "token {t} after {last}: reused after data loss");
}

/// The documented limit: counter mode on a Redis without persistence starts
/// again at 1 after a restart. (README: use hybrid_clock or persistence.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counter_mode_without_persistence_restarts_at_one() {
    let mut redis = RedisServer::start(Persistence::Off);
    let s = sidecar(&redis.url(), &[("backend.redis.token_mode", "counter")]);
    let mut last = 0;
    assert_increasing(&s, "lim:1", 5, &mut last).await;
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(15);
    let t = loop {
        let r = s.acquire("lim:1", 10_000, 0).await;
        if r.status == 200 {
            break r.token();
        }
        assert!(Instant::now() < deadline, "no recovery: {}", r.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(t, 1);
}

/// `rediss://` with a private CA, a password and a database number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_password_and_database_in_the_url() {
    let certs = make_certs();
    let path = |f: &str| certs.path().join(f).to_str().unwrap().to_owned();
    let tls_port = free_port();
    let redis = RedisServer::start_with(
        Persistence::Off,
        &[
            "--tls-port".into(),
            tls_port.to_string(),
            "--tls-cert-file".into(),
            path("server.crt"),
            "--tls-key-file".into(),
            path("server.key"),
            "--tls-ca-cert-file".into(),
            path("ca.crt"),
            "--tls-auth-clients".into(),
            "no".into(),
        ],
        Some("s3cret-pass"),
    );
    let url = format!("rediss://:s3cret-pass@127.0.0.1:{tls_port}/3");
    let s = sidecar(&url, &[("backend.redis.ca_file", &path("ca.crt"))]);
    let r = s.acquire("tls:1", 10_000, 0).await;
    assert_eq!(r.status, 200, "{}\n{}", r.body, s.logs());
    // The lock landed in database 3.
    let mut conn = redis.conn();
    let _: () = redis::cmd("SELECT").arg(3).query(&mut conn).unwrap();
    let exists: bool = conn.exists("fencer:{tls:1}:lock").unwrap();
    assert!(exists);
    // A wrong password is refused (503, not a hang).
    let bad = sidecar(
        &format!("rediss://:wrong@127.0.0.1:{tls_port}/3"),
        &[
            ("backend.redis.ca_file", &path("ca.crt")),
            ("backend.redis.request_timeout_ms", "300"),
        ],
    );
    assert_eq!(
        bad.acquire("tls:2", 10_000, 0).await.code(),
        "backend_unavailable"
    );
}

/// A queued waiter whose re-check meets a Redis that does not answer keeps
/// its place and tries again, instead of ending its wait with 503 while
/// `wait_ms` is far from spent (seen in CI as a cluster waiter answered
/// during a slot move). Redis is frozen (SIGSTOP) across the moment the
/// holder's TTL runs out, so the waiter's re-check times out; once Redis
/// answers again the waiter gets the key within its wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_keeps_its_place_through_a_short_outage() {
    let redis = RedisServer::start(Persistence::Off);
    let s = Arc::new(sidecar(
        &redis.url(),
        &[("backend.redis.request_timeout_ms", "300")],
    ));
    let holder = s.acquire("outage:w", 1_500, 0).await;
    assert_eq!(holder.status, 200, "{}", holder.body);
    let waiter = {
        let s = s.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            (
                s.acquire("outage:w", 5_000, 10_000).await,
                started.elapsed(),
            )
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    redis.pause();
    // The holder's TTL (1.5 s) runs out while Redis is frozen: the
    // waiter's fallback re-check is sent to a server that does not answer.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    redis.resume();
    let (r, took) = waiter.await.unwrap();
    assert_eq!(r.status, 200, "after {took:?}: {}\n{}", r.body, s.logs());
    assert!(r.token() > holder.token());
    assert!(
        s.metric("fencer_waiter_wakeups_total", &[("cause", "backend_error")])
            .await
            >= 1.0,
        "the waiter never met the outage: the test did not test it"
    );
}

/// An acquire of `key` (TTL 30 s) waiting up to `wait_ms` on `s`, returned
/// once it sleeps in the queue: subscribed, and its first try as the head
/// answered "held" (the holder's acquire, the waiter's first try and its
/// try as the head make three backend acquires). A wake-up before that
/// would find it still subscribing or about to try anyway, and count as
/// nothing.
async fn queued_waiter(
    s: &Arc<Fencer>,
    key: &'static str,
    wait_ms: u64,
) -> tokio::task::JoinHandle<Resp> {
    let before = acquires_sent(s).await;
    let waiter = {
        let s = s.clone();
        tokio::spawn(async move { s.acquire(key, 30_000, wait_ms).await })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.metric("fencer_waiters", &[]).await < 1.0 || acquires_sent(s).await < before + 2.0 {
        assert!(Instant::now() < deadline, "the waiter never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    waiter
}

/// Backend acquires `s` has sent so far.
async fn acquires_sent(s: &Fencer) -> f64 {
    s.metric(
        "fencer_backend_request_duration_seconds_count",
        &[("op", "acquire")],
    )
    .await
}

/// A hand-over within one sidecar: the waiter is woken as soon as the
/// holder's release is on its way (`early_release`), and its try, sent
/// after the release on the same connection, gets the key — with a token
/// above the holder's, and mutual exclusion kept (the try is the same
/// atomic acquire as always).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_waiter_tries_while_the_release_is_on_its_way() {
    let redis = RedisServer::start(Persistence::Off);
    let s = Arc::new(sidecar(&redis.url(), &[]));
    let holder = s.acquire("early:1", 30_000, 0).await;
    assert_eq!(holder.status, 200, "{}", holder.body);
    let waiter = queued_waiter(&s, "early:1", 10_000).await;
    assert_eq!(s.release("early:1", &holder.lease()).await.status, 200);
    let got = waiter.await.unwrap();
    assert_eq!(got.status, 200, "{}", got.body);
    assert!(got.token() > holder.token());
    assert!(
        s.metric("fencer_waiter_wakeups_total", &[("cause", "early_release")])
            .await
            >= 1.0,
        "{}",
        s.metrics().await
    );
}

/// The early wake-up meets a release that fails: Redis is frozen while the
/// holder releases, so the release's outcome is unknown (503, retried in
/// the background) and the early try times out. The waiter keeps trying;
/// once Redis answers, it runs what waited in its socket in order — the
/// late release, then the waiter's try — and the waiter gets the key with a
/// higher token, never while the release had not happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_wake_up_whose_release_fails_still_ends_with_one_holder() {
    let redis = RedisServer::start(Persistence::Off);
    let s = Arc::new(sidecar(
        &redis.url(),
        &[("backend.redis.request_timeout_ms", "300")],
    ));
    let holder = s.acquire("early:2", 30_000, 0).await;
    assert_eq!(holder.status, 200, "{}", holder.body);
    let waiter = queued_waiter(&s, "early:2", 15_000).await;
    redis.pause();
    let rel = s.release("early:2", &holder.lease()).await;
    assert_eq!(rel.status, 503, "{}", rel.body);
    // The key is still held in Redis (the release never ran): nobody may
    // have it yet.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiter.is_finished(),
        "the waiter answered while Redis was frozen"
    );
    redis.resume();
    let got = waiter.await.unwrap();
    assert_eq!(got.status, 200, "{}\n{}", got.body, s.logs());
    assert!(got.token() > holder.token());
    // The waiter was woken while the release was unanswered (early, or by
    // the subscriber's resync when its connection stalled): its try was
    // queued behind the release in the frozen server, and ran after it.
    let woken = s
        .metric("fencer_waiter_wakeups_total", &[("cause", "early_release")])
        .await
        + s.metric("fencer_waiter_wakeups_total", &[("cause", "resync")])
            .await;
    assert!(
        woken >= 1.0,
        "the waiter was never woken during the failed release: {}",
        s.metrics().await
    );
}
