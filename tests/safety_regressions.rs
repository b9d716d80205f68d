//! Issue 9: eleven ways the landed fencer (7195c76) broke its promise when
//! attacked — slow storage, impatient clients, short renewals, half-open
//! sockets, crashes, odd paths. One test per defect, each against real
//! processes; each fails on 7195c76 and passes now. To watch one fail,
//! point the harness at an older binary:
//! `FENCER_TEST_BIN=/path/to/old/fencer cargo test --test safety_regressions`.
//!
//! The storage is [`Recorder`]: it logs when each write arrived and when it
//! was applied, and applies a write it received even if the sender hangs
//! up — the way a real storage does.

mod common;

use std::time::{Duration, Instant};

use common::postgres::PgServer;
use common::tcp_fault::{Mode, TcpFault};
use common::upstream::{Recorder, Seen};
use common::*;
use serde_json::json;

fn prefix(gateway: &Fencer) -> String {
    format!("{}/_fencer/v1/fences/", gateway.api)
}

/// A gateway (memory fences) in front of `storage`, and a sidecar (memory
/// locks) whose proxy and pre-registration use it, with `extra` settings.
fn fenced_stack(storage: &Recorder, extra: &[(&str, &str)]) -> (Fencer, Fencer) {
    let gateway = Fencer::gateway(&storage.url(), &[]);
    let pre = prefix(&gateway);
    let mut settings = vec![
        ("proxy.upstream", gateway.api.as_str()),
        ("sidecar.preregister_url", pre.as_str()),
    ];
    settings.extend_from_slice(extra);
    let sidecar = Fencer::sidecar(Backend::Memory, None, &settings);
    (gateway, sidecar)
}

fn impatient(ms: u64) -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_millis(ms))
        .build()
        .unwrap()
}

fn token_of(r: &Resp) -> String {
    r.body["fencing_token"].as_str().unwrap().to_owned()
}

/// Every write of token `older` was applied before any write of `newer`
/// arrived at the storage.
fn applied_in_token_order(seen: &[Seen], older: u64, newer: u64) {
    let old_done = seen
        .iter()
        .filter(|s| s.token == Some(older))
        .map(|s| s.finished)
        .max()
        .expect("the older write reached the storage");
    let new_first = seen
        .iter()
        .filter(|s| s.token == Some(newer))
        .map(|s| s.arrived)
        .min()
        .expect("the newer write reached the storage");
    assert!(
        new_first >= old_done,
        "token {newer} reached the storage {:?} before token {older}'s write was applied: {seen:#?}",
        old_done - new_first
    );
}

async fn put(client: &reqwest::Client, url: &str, headers: &[(&str, &str)]) -> Resp {
    send(client, "PUT", url, headers, Some("1")).await
}

// ------------------------------------------------------------ item 1

/// A client that hangs up while its write is at the storage must not
/// unlock the key: the next holder's write waits until that write is
/// applied (the guard lived in the request future, which hyper dropped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_hanging_up_mid_write_does_not_let_a_newer_write_overtake_it() {
    let storage = Recorder::start().await;
    let (gateway, sidecar) = fenced_stack(&storage, &[]);
    let url = format!("{}/kv/acct-1", gateway.api);
    let a = sidecar.acquire("acct:1", 30_000, 0).await;
    let slow = impatient(300)
        .put(&url)
        .header("Fencing-Token", token_of(&a))
        .header("x-delay-ms", "1500")
        .body("a")
        .send()
        .await;
    assert!(slow.is_err(), "the client must have given up");
    sidecar.release("acct:1", &a.lease()).await;
    let b = sidecar.acquire("acct:1", 30_000, 5_000).await;
    assert_eq!(b.status, 200, "{}", b.body);
    let w = put(&sidecar.http, &url, &[("Fencing-Token", &token_of(&b))]).await;
    assert_eq!(w.status, 200, "{}", w.body);
    assert!(eventually(Duration::from_secs(5), || storage.seen().len() >= 2).await);
    applied_in_token_order(&storage.seen(), a.token(), b.token());
}

/// The storage cut the connection as soon as it had read token 1's write
/// (a reset link, a restarted proxy) and applied it 1.5 s later anyway. The
/// gateway learnt nothing at once — yet the key must stay blocked as long as
/// if it had waited out its upstream timeout, and the uncertain hold after
/// that: a write may land that long after it was sent, however early the
/// connection broke. Else token 2, written once the short hold ran out,
/// is overtaken by token 1 (found by the fault suite's long tier).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_upstream_connection_keeps_the_key_blocked_for_the_whole_window() {
    let storage = Recorder::start().await;
    let gateway = Fencer::gateway(
        &storage.url(),
        &[
            ("gateway.upstream_timeout_ms", "2000"),
            ("gateway.uncertain_hold_ms", "500"),
        ],
    );
    let pre = prefix(&gateway);
    let sidecar = Fencer::sidecar(
        Backend::Memory,
        None,
        &[("sidecar.preregister_url", pre.as_str())],
    );
    let url = format!("{}/kv/acct-1", gateway.api);
    let a = sidecar.acquire("acct:1", 30_000, 0).await;
    let cut = put(
        &sidecar.http,
        &url,
        &[
            ("Fencing-Token", &token_of(&a)),
            ("x-delay-ms", "1500"),
            ("x-reset", "1"),
        ],
    )
    .await;
    assert_eq!(cut.status, 502, "{}", cut.body);
    sidecar.release("acct:1", &a.lease()).await;
    let b = sidecar.acquire("acct:1", 30_000, 5_000).await;
    assert_eq!(b.status, 200, "{}", b.body);
    let w = put(&sidecar.http, &url, &[("Fencing-Token", &token_of(&b))]).await;
    assert_eq!(w.status, 200, "{}", w.body);
    assert!(eventually(Duration::from_secs(5), || storage.seen().len() >= 2).await);
    applied_in_token_order(&storage.seen(), a.token(), b.token());
}

/// The sidecar's own proxy gave up first (its timeout below the gateway's)
/// and dropped its connection: same outcome, with no impatient client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_giving_up_first_does_not_let_the_next_holder_overtake() {
    let storage = Recorder::start().await;
    let gateway = Fencer::gateway(&storage.url(), &[]);
    let pre = prefix(&gateway);
    let sidecar = Fencer::sidecar(
        Backend::Memory,
        None,
        &[
            ("proxy.upstream", &gateway.api),
            ("sidecar.preregister_url", &pre),
            ("proxy.upstream_timeout_ms", "300"),
            // What this sidecar assumes of the gateway's budget (below 300).
            ("gateway.serialize_timeout_ms", "100"),
            ("gateway.connect_timeout_ms", "50"),
            ("gateway.upstream_timeout_ms", "100"),
        ],
    );
    let url = format!("{}/kv/acct-2", sidecar.proxy);
    let a = sidecar.acquire("acct:2", 30_000, 0).await;
    let w = put(
        &sidecar.http,
        &url,
        // Fencing-Lock too, so the test runs against 7195c76's proxy, which
        // knew no Fencing-Lease.
        &[
            ("Fencing-Lock", "acct:2"),
            ("Fencing-Lease", &a.lease()),
            ("x-delay-ms", "1500"),
        ],
    )
    .await;
    assert_eq!(w.status, 504, "{}", w.body);
    sidecar.release("acct:2", &a.lease()).await;
    let b = sidecar.acquire("acct:2", 30_000, 5_000).await;
    assert_eq!(b.status, 200, "{}", b.body);
    let w = put(
        &sidecar.http,
        &url,
        &[("Fencing-Lock", "acct:2"), ("Fencing-Lease", &b.lease())],
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
    assert!(eventually(Duration::from_secs(5), || storage.seen().len() >= 2).await);
    applied_in_token_order(&storage.seen(), a.token(), b.token());
}

/// A gateway that crashes mid-forward (or loses its database session) must
/// not free the key for the other replicas while its write may still land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_crash_mid_write_keeps_other_replicas_off_the_key() {
    let pg = PgServer::start();
    let storage = Recorder::start().await;
    let url_pg = pg.url();
    let extra = [
        ("gateway.fence_store", "postgres"),
        ("gateway.postgres_url", url_pg.as_str()),
        ("gateway.upstream_timeout_ms", "3000"),
        ("gateway.uncertain_hold_ms", "500"),
    ];
    let mut gw_a = Fencer::gateway(&storage.url(), &extra);
    let gw_b = Fencer::gateway(&storage.url(), &extra);
    let (t1, t2) = (
        sign_v1("acct:3", 1, "lease-one"),
        sign_v1("acct:3", 2, "lease-two"),
    );
    let url_a = format!("{}/kv/acct-3", gw_a.api);
    let client = reqwest::Client::new();
    let first = tokio::spawn({
        let (client, url_a, t1) = (client.clone(), url_a.clone(), t1.clone());
        async move {
            client
                .put(&url_a)
                .header("Fencing-Token", t1)
                .header("x-delay-ms", "2000")
                .body("a")
                .send()
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    gw_a.kill();
    let _ = first.await;
    let url_b = format!("{}/kv/acct-3", gw_b.api);
    let started = Instant::now();
    loop {
        let w = put(&client, &url_b, &[("Fencing-Token", &t2)]).await;
        if w.status == 200 {
            break;
        }
        assert_eq!((w.status, w.code()), (503, "fence_busy"), "{}", w.body);
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "key blocked for good"
        );
    }
    assert!(eventually(Duration::from_secs(5), || storage.seen().len() >= 2).await);
    applied_in_token_order(&storage.seen(), 1, 2);
}

// ------------------------------------------------------------ item 2

/// A renew with a shorter TTL shortens the backend lease: the local
/// deadline must follow, or two sidecars both say "held".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_with_a_shorter_ttl_shortens_the_local_deadline() {
    let redis = RedisServer::start(Persistence::Off);
    let a = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    let b = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    let lease = a.acquire("job:1", 60_000, 0).await;
    let r = a.renew("job:1", &lease.lease(), 500).await;
    assert_eq!(r.status, 200, "{}", r.body);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let other = b.acquire("job:1", 10_000, 0).await;
    assert_eq!(other.status, 200, "the backend lease ended: {}", other.body);
    let mine = a.get(&Fencer::path("job:1", "")).await;
    assert_eq!(
        mine.body["state"], "lost",
        "sidecar A still says held while B holds the lock: {}",
        mine.body
    );
}

/// A renew without `ttl_ms` keeps the lease's own TTL instead of cutting
/// it to `sidecar.default_ttl_ms` behind the sidecar's back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_without_ttl_keeps_the_leases_own_ttl() {
    let redis = RedisServer::start(Persistence::Off);
    let a = Fencer::sidecar(
        Backend::Redis,
        Some(&redis.url()),
        &[("sidecar.default_ttl_ms", "500")],
    );
    let b = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    let lease = a.acquire("job:2", 60_000, 0).await;
    let r = a
        .post(
            &Fencer::path("job:2", "renew"),
            json!({"lease_id": lease.lease()}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["ttl_ms"], 60_000);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let other = b.acquire("job:2", 10_000, 0).await;
    assert_eq!(
        (other.status, other.code()),
        (409, "lock_held"),
        "the 60 s lease was cut short: {}",
        other.body
    );
}

// ------------------------------------------------------------ item 3

/// A request queued behind a slow one of the same lease must not go out
/// with the token once the lease's deadline has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_behind_a_slow_one_does_not_leave_after_the_deadline() {
    let storage = Recorder::start().await;
    let sidecar = Fencer::sidecar(
        Backend::Memory,
        None,
        &[
            ("proxy.upstream", &storage.url()),
            ("proxy.upstream_timeout_ms", "5000"),
            ("gateway.serialize_timeout_ms", "1000"),
            ("gateway.connect_timeout_ms", "100"),
            ("gateway.upstream_timeout_ms", "1000"),
        ],
    );
    let lease = sidecar.acquire("acct:4", 1_000, 0).await;
    let url = format!("{}/kv/acct-4", sidecar.proxy);
    let slow = tokio::spawn({
        let (http, url, id) = (sidecar.http.clone(), url.clone(), lease.lease());
        async move {
            put(
                &http,
                &url,
                &[("Fencing-Lease", &id), ("x-delay-ms", "1500")],
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let queued = put(&sidecar.http, &url, &[("Fencing-Lease", &lease.lease())]).await;
    assert_eq!(
        (queued.status, queued.code()),
        (409, "lease_lost"),
        "{}",
        queued.body
    );
    assert_eq!(slow.await.unwrap().status, 200);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let seen = storage.seen();
    assert_eq!(
        seen.len(),
        1,
        "a request left after the deadline: {seen:#?}"
    );
    assert_eq!(seen[0].token, Some(lease.token()));
}

// ------------------------------------------------------------ item 4

/// A request that gives up while waiting for a busy key must not leave its
/// database session queued for the key's lock: it would get the lock later
/// and keep it, and the key would answer `fence_busy` in every replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_giving_up_on_a_busy_key_leaves_no_lock_behind() {
    let pg = PgServer::start();
    let storage = Recorder::start().await;
    let url_pg = pg.url();
    let extra = [
        ("gateway.fence_store", "postgres"),
        ("gateway.postgres_url", url_pg.as_str()),
        ("gateway.serialize_timeout_ms", "2000"),
    ];
    let gw_a = Fencer::gateway(&storage.url(), &extra);
    let gw_b = Fencer::gateway(&storage.url(), &extra);
    let url = |g: &Fencer| format!("{}/kv/acct-5", g.api);
    let client = reqwest::Client::new();
    let first = tokio::spawn({
        let (client, u) = (client.clone(), url(&gw_a));
        async move {
            client
                .put(u)
                .header("Fencing-Token", sign_v1("acct:5", 1, "l1"))
                .header("x-delay-ms", "1500")
                .body("a")
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let gave_up = impatient(300)
        .put(url(&gw_a))
        .header("Fencing-Token", sign_v1("acct:5", 2, "l2"))
        .body("b")
        .send()
        .await;
    assert!(gave_up.is_err());
    assert_eq!(first.await.unwrap(), 200);
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (i, g) in [&gw_b, &gw_a].into_iter().enumerate() {
        let w = put(
            &client,
            &url(g),
            &[("Fencing-Token", &sign_v1("acct:5", 3 + i as u64, "l3"))],
        )
        .await;
        assert_eq!(w.status, 200, "replica {i}: {}", w.body);
    }
}

// ------------------------------------------------------------ item 5

/// A half-open pub/sub connection (SUBSCRIBE never answered) must not hold
/// a blocking acquire past its `wait_ms`, nor block other keys' waiters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_subscriber_does_not_hold_waiters_past_wait_ms() {
    let redis = RedisServer::start(Persistence::Off);
    let fault = TcpFault::start(redis.port);
    let sidecar = Fencer::sidecar(Backend::Redis, Some(&fault.redis_url()), &[]);
    assert_eq!(sidecar.acquire("q:1", 30_000, 0).await.status, 200);
    assert_eq!(sidecar.acquire("q:2", 30_000, 0).await.status, 200);
    fault.set(Mode::FreezeUnscripted);
    let started = Instant::now();
    let (a, b) = tokio::join!(
        sidecar.acquire("q:1", 10_000, 2_000),
        sidecar.acquire("q:2", 10_000, 1_000)
    );
    let elapsed = started.elapsed();
    assert_eq!((a.status, a.code()), (409, "lock_held"), "{}", a.body);
    assert_eq!((b.status, b.code()), (409, "lock_held"), "{}", b.body);
    assert!(
        elapsed < Duration::from_millis(3_500),
        "waiters held {elapsed:?} for a 2 s wait"
    );
}

// ------------------------------------------------------------ item 6

/// The registrar answers after 800 ms: a stand-in gateway that is slow.
async fn slow_registrar() -> Recorder {
    Recorder::start_with_delay(800).await
}

/// A hold whose client leaves while the token is being pre-registered must
/// be released, not renewed forever with no stream to end it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_whose_client_leaves_during_preregistration_is_released() {
    let registrar = slow_registrar().await;
    let pre = format!("{}/_fencer/v1/fences/", registrar.url());
    let sidecar = Fencer::sidecar(Backend::Memory, None, &[("sidecar.preregister_url", &pre)]);
    let gone = impatient(300)
        .post(format!("{}{}", sidecar.api, Fencer::path("leader", "hold")))
        .body(json!({"ttl_ms": 1000}).to_string())
        .send()
        .await;
    assert!(gone.is_err());
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let next = sidecar.acquire("leader", 10_000, 0).await;
    assert_eq!(
        next.status, 200,
        "the orphaned hold still renews: {}",
        next.body
    );
}

/// A plain acquire whose client leaves during pre-registration must not
/// leave the key taken for its whole TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_whose_client_leaves_during_preregistration_is_released() {
    let registrar = slow_registrar().await;
    let pre = format!("{}/_fencer/v1/fences/", registrar.url());
    let sidecar = Fencer::sidecar(Backend::Memory, None, &[("sidecar.preregister_url", &pre)]);
    let gone = impatient(300)
        .post(format!(
            "{}{}",
            sidecar.api,
            Fencer::path("job:9", "acquire")
        ))
        .body(json!({"ttl_ms": 30_000}).to_string())
        .send()
        .await;
    assert!(gone.is_err());
    let next = sidecar.acquire("job:9", 10_000, 3_000).await;
    assert_eq!(next.status, 200, "orphaned until its TTL: {}", next.body);
}

// ------------------------------------------------------------ item 7

/// After a sidecar restart, the lease it adopts goes on writing: its
/// requests are numbered above what the gateway saw before the restart.
/// And a different request carrying an accepted sequence number is refused,
/// not let through as a "replay".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_lease_writes_on_and_a_reused_sequence_is_refused() {
    let redis = RedisServer::start(Persistence::Off);
    let storage = Recorder::start().await;
    let gateway = Fencer::gateway(&storage.url(), &[]);
    let pre = prefix(&gateway);
    let mut sidecar = Fencer::sidecar(
        Backend::Redis,
        Some(&redis.url()),
        &[
            ("proxy.upstream", &gateway.api),
            ("sidecar.preregister_url", &pre),
        ],
    );
    let lease = sidecar.acquire("acct:7", 60_000, 0).await;
    let url = format!("{}/kv/acct-7", sidecar.proxy);
    for _ in 0..2 {
        let w = put(
            &sidecar.http,
            &url,
            &[
                ("Fencing-Lock", "acct:7"),
                ("Fencing-Lease", &lease.lease()),
            ],
        )
        .await;
        assert_eq!(w.status, 200, "{}", w.body);
    }
    sidecar.crash_and_restart();
    let adopted = sidecar.renew("acct:7", &lease.lease(), 60_000).await;
    assert_eq!(adopted.status, 200, "{}", adopted.body);
    let w = put(
        &sidecar.http,
        &url,
        &[
            ("Fencing-Lock", "acct:7"),
            ("Fencing-Lease", &lease.lease()),
        ],
    )
    .await;
    assert_eq!(w.status, 200, "the adopted lease cannot write: {}", w.body);

    let last = storage.seen().last().cloned().unwrap();
    let seq = last.seq.unwrap().to_string();
    let token = last.raw_token.unwrap();
    let other = send(
        &sidecar.http,
        "DELETE",
        &format!("{}/kv/acct-7", gateway.api),
        &[("Fencing-Token", &token), ("Fencing-Seq", &seq)],
        None,
    )
    .await;
    assert_eq!(
        other.status, 409,
        "a different request passed as a replay: {}",
        other.body
    );
    assert_eq!(storage.seen().len(), 3);
}

/// Issue 27 item 7: a sidecar restarted with its wall clock stepped — 10
/// minutes back, or after a process whose clock ran an hour ahead — adopts
/// its lease and writes on at once. Sequence numbers continue above the
/// reservation kept in `sidecar.state_dir`, not from the clock; numbered
/// from the clock, every write of the adopted lease was refused 409
/// `stale_sequence` until the clock caught up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_lease_writes_on_after_the_clock_stepped_across_the_restart() {
    let lib = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
    assert!(
        std::path::Path::new(lib).exists(),
        "install Debian's faketime package (tests/run.sh does)"
    );
    let redis = RedisServer::start(Persistence::Off);
    let storage = Recorder::start().await;
    let gateway = Fencer::gateway(&storage.url(), &[]);
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().to_str().unwrap().to_owned();
    for (key, before, after) in [("acct:back", "+0", "-10m"), ("acct:ahead", "+1h", "+0")] {
        let mut sidecar = Fencer::sidecar_env(
            Backend::Redis,
            Some(&redis.url()),
            &[
                ("proxy.upstream", &gateway.api),
                ("sidecar.state_dir", &state_dir),
            ],
            &[
                ("LD_PRELOAD", lib),
                ("FAKETIME", before),
                ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
            ],
        );
        let lease = sidecar.acquire(key, 60_000, 0).await;
        assert_eq!(lease.status, 200, "{}", lease.body);
        let url = format!("{}/kv/{}", sidecar.proxy, key.replace(':', "-"));
        let headers = [("Fencing-Lock", key), ("Fencing-Lease", &lease.lease())];
        let w = put(&sidecar.http, &url, &headers).await;
        assert_eq!(w.status, 200, "{}", w.body);

        sidecar.set_process_env("FAKETIME", after);
        sidecar.crash_and_restart();
        let adopted = sidecar.renew(key, &lease.lease(), 60_000).await;
        assert_eq!(adopted.status, 200, "{}", adopted.body);
        for _ in 0..2 {
            let w = put(&sidecar.http, &url, &headers).await;
            assert_eq!(
                w.status, 200,
                "clock {before} then {after}: the adopted lease cannot write: {}",
                w.body
            );
        }
        let seqs: Vec<u64> = storage
            .seen()
            .iter()
            .filter(|s| s.path.ends_with(&key.replace(':', "-")))
            .map(|s| s.seq.unwrap())
            .collect();
        assert_eq!(seqs.len(), 3, "{seqs:?}");
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    }
}

// ------------------------------------------------------------ item 8

/// `counter` tokens of 10^14 and above are formatted exactly (Lua printed
/// them as `1e+14`, and every acquire of the key failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counter_tokens_past_ten_to_the_fourteen_stay_exact() {
    let redis = RedisServer::start(Persistence::Off);
    let sidecar = Fencer::sidecar(
        Backend::Redis,
        Some(&redis.url()),
        &[("backend.redis.token_mode", "counter")],
    );
    let mut conn = redis.conn();
    let _: () = redis::cmd("SET")
        .arg("fencer:{big}:token")
        .arg("99999999999998")
        .query(&mut conn)
        .unwrap();
    let mut tokens = Vec::new();
    for _ in 0..3 {
        let l = sidecar.acquire("big", 10_000, 0).await;
        assert_eq!(l.status, 200, "{}", l.body);
        tokens.push(l.token());
        sidecar.release("big", &l.lease()).await;
    }
    assert_eq!(
        tokens,
        vec![99_999_999_999_999, 100_000_000_000_000, 100_000_000_000_001]
    );
}

// ------------------------------------------------------------ item 9

/// One hot key must not take every fence-store connection: its queued and
/// in-flight requests wait without a pooled connection, and a write to
/// another key goes through at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hot_key_does_not_starve_other_keys_of_the_fence_store() {
    let pg = PgServer::start();
    let storage = Recorder::start().await;
    let url_pg = pg.url();
    let gateway = Fencer::gateway(
        &storage.url(),
        &[
            ("gateway.fence_store", "postgres"),
            ("gateway.postgres_url", url_pg.as_str()),
            ("gateway.postgres_pool_size", "4"),
            ("gateway.serialize_timeout_ms", "20000"),
        ],
    );
    let client = reqwest::Client::new();
    let hot = format!("{}/kv/hot", gateway.api);
    let mut writers = Vec::new();
    for t in 1..=8u64 {
        let (client, hot) = (client.clone(), hot.clone());
        writers.push(tokio::spawn(async move {
            put(
                &client,
                &hot,
                &[
                    ("Fencing-Token", &sign_v1("hot", t, "same-lease")),
                    ("x-delay-ms", "1000"),
                ],
            )
            .await
            .status
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let cold = put(
        &client,
        &format!("{}/kv/cold", gateway.api),
        &[("Fencing-Token", &sign_v1("cold", 1, "other"))],
    )
    .await;
    let took = started.elapsed();
    assert_eq!(cold.status, 200, "{}", cold.body);
    assert!(
        took < Duration::from_millis(800),
        "a cold key waited {took:?} behind a hot one"
    );
    for w in writers {
        let _ = w.await;
    }
}

// ------------------------------------------------------------ item 10

/// With `/kv/accounts/{id}` bound to `account:{id}`, a token for account 1
/// must not write account 2 through an encoding the route does not see.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encoded_and_unrouted_paths_cannot_escape_the_route_binding() {
    let storage = Recorder::start().await;
    let gateway = Fencer::gateway_with_config(
        &storage.url(),
        "[[gateway.routes]]\npath = \"/kv/accounts/{id}\"\nkey = \"account:{id}\"\n",
        &[],
    );
    let token = sign_v1("account:1", 1, "lease-1");
    let client = reqwest::Client::new();
    for path in [
        "/kv/accounts%2F2",
        "/kv/%61ccounts/2",
        "/kv/accounts/2/",
        "/kv//accounts/2",
        "/kv/accounts/1/../2",
        "/kv/accounts/1/%2e%2e/2",
        "/kv/other/2",
    ] {
        // Sent raw: a client library would normalise some of these.
        let w = raw_put(&gateway.api, path, &token).await;
        assert!(
            (400..500).contains(&w),
            "{path}: answered {w}, storage saw {:#?}",
            storage.seen()
        );
    }
    assert!(storage.seen().is_empty(), "{:#?}", storage.seen());
    let ok = put(
        &client,
        &format!("{}/kv/accounts/1", gateway.api),
        &[("Fencing-Token", &token)],
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.body);
}

/// A PUT with the path exactly as given (no client-side normalisation);
/// returns the status code.
async fn raw_put(base: &str, path: &str, token: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = base.strip_prefix("http://").unwrap();
    let mut s = tokio::net::TcpStream::connect(host).await.unwrap();
    let req = format!(
        "PUT {path} HTTP/1.1\r\nHost: {host}\r\nFencing-Token: {token}\r\nContent-Length: 1\r\nConnection: close\r\n\r\n1"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf);
    text.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {text:?}"))
}

// ------------------------------------------------------------ item 11

/// The lease id renews and releases the lock: it must not travel in the
/// token to the storage, nor appear in the gateway's logs or the lost-lease
/// webhook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_id_never_leaves_the_sidecar() {
    let storage = Recorder::start().await;
    let hook = Recorder::start().await;
    let (gateway, sidecar) = fenced_stack(&storage, &[("sidecar.lost_lease_webhook", &hook.url())]);
    let first = sidecar.acquire("acct:11", 300, 0).await;
    let id = first.lease();
    assert!(!token_of(&first).contains(&id), "{}", token_of(&first));
    let w = put(
        &sidecar.http,
        &format!("{}/kv/acct-11", sidecar.proxy),
        &[("Fencing-Lease", &id)],
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
    let at_storage = storage.seen()[0].raw_token.clone().unwrap();
    assert!(!at_storage.contains(&id), "{at_storage}");
    // Lost at its deadline: the webhook is told, without the id.
    assert!(eventually(Duration::from_secs(5), || !hook.seen().is_empty()).await);
    let body = String::from_utf8_lossy(&hook.seen()[0].body).into_owned();
    assert!(!body.contains(&id), "{body}");
    // A stale write is logged by the gateway, without the id.
    let second = sidecar.acquire("acct:11", 10_000, 2_000).await;
    assert_eq!(second.status, 200);
    let stale = put(
        &sidecar.http,
        &format!("{}/kv/acct-11", gateway.api),
        &[("Fencing-Token", &token_of(&first))],
    )
    .await;
    assert_eq!(stale.status, 409);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let logs = gateway.logs();
    assert!(logs.contains("stale fencing token rejected"), "{logs}");
    assert!(!logs.contains(&id), "the gateway logged the lease id");
}

// ------------------------------------------------------------ also

/// A secret from an environment variable is trimmed like one from a file:
/// a Kubernetes secret with a trailing newline made every write 403.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_variable_with_a_trailing_newline_still_verifies() {
    let storage = Recorder::start().await;
    let with_newline = format!("{SECRET}\n");
    let gateway = Fencer::gateway(
        &storage.url(),
        &[("!FENCER_TEST_SECRET", with_newline.as_str())],
    );
    let w = put(
        &reqwest::Client::new(),
        &format!("{}/kv/x", gateway.api),
        &[("Fencing-Token", &sign_v1("x", 1, "l"))],
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
}

/// An application's `Connection: fencing-seq` must not make the proxy
/// strip its own sequence header on the way out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_header_cannot_strip_the_proxys_own_headers() {
    let storage = Recorder::start().await;
    let sidecar = Fencer::sidecar(Backend::Memory, None, &[("proxy.upstream", &storage.url())]);
    let lease = sidecar.acquire("c:1", 10_000, 0).await.lease();
    let w = put(
        &sidecar.http,
        &format!("{}/kv/c-1", sidecar.proxy),
        &[
            ("Fencing-Lease", &lease),
            ("Connection", "fencing-seq, fencing-token"),
        ],
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
    let seen = storage.seen();
    assert!(
        seen[0].seq.is_some() && seen[0].token.is_some(),
        "{seen:#?}"
    );
}

/// A renewal answered after the lease's local deadline: the lease is lost
/// here, and must also be released in the backend (which did renew it) —
/// not left taken by nobody for a whole TTL — and a later renewal must not
/// bring it back once the sidecar has pruned its lost record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_renewal_reply_releases_the_lock_and_never_revives_it() {
    let redis = RedisServer::start(Persistence::Off);
    let fault = TcpFault::start(redis.port);
    let sidecar = Fencer::sidecar(
        Backend::Redis,
        Some(&fault.redis_url()),
        &[("sidecar.lost_lease_retention_ms", "100")],
    );
    let lease = sidecar.acquire("late", 1_000, 0).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    fault.set(Mode::DelayReplies(Duration::from_millis(700)));
    let r = sidecar.renew("late", &lease.lease(), 10_000).await;
    fault.set(Mode::Pass);
    assert_eq!((r.status, r.code()), (409, "lease_lost"), "{}", r.body);
    let mut conn = redis.conn();
    let mut gone = false;
    for _ in 0..50 {
        let exists: i64 = redis::cmd("EXISTS")
            .arg("fencer:{late}:lock")
            .query(&mut conn)
            .unwrap();
        if exists == 0 {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        gone,
        "the lock stays taken by a lease the sidecar calls lost: {}",
        sidecar.logs()
    );
    // Long after the lost record was pruned (retention 100 ms, sweeps every
    // second), the lease must still not come back.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let again = sidecar.renew("late", &lease.lease(), 10_000).await;
    assert_eq!(again.status, 409, "revived: {}", again.body);
}

// ============================================================ issue 10
//
// A second adversarial pass: the PostgreSQL lock backend, shared sidecars,
// start-up DDL, readiness. Each of these fails on 7195c76 as well.

/// A test's own PostgreSQL session, for holding row and advisory locks.
async fn pg_client(pg: &PgServer) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
}

/// The advisory lock id of the token floor (`src/lock/postgres/sql.rs`).
const FLOOR_LOCK: i64 = 0x6665_6e63_6572_0001;

/// A PostgreSQL sidecar, once its schema is there (`/readyz`).
fn pg_sidecar(pg: &PgServer, extra: &[(&str, &str)]) -> Fencer {
    let s = Fencer::sidecar(Backend::Postgres, Some(&pg.url()), extra);
    let started = Instant::now();
    while !http_ok(&format!("{}/readyz", s.admin)) {
        assert!(started.elapsed() < Duration::from_secs(20), "{}", s.logs());
        std::thread::sleep(Duration::from_millis(20));
    }
    s
}

/// Item 1: an acquire statement stuck behind a row lock timed out in the
/// sidecar but went on in the server and took the lock; the retry, from a
/// snapshot taken before that commit, answered "held"; the waiter's next
/// try found its own lease and counted the deadline from *its* send time —
/// later than the backend's expiry, which the first statement had fixed.
/// Two sidecars then both said "held".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_postgres_acquire_never_leaves_two_holders() {
    let pg = PgServer::start();
    let a = pg_sidecar(&pg, &[("backend.postgres.request_timeout_ms", "300")]);
    let b = pg_sidecar(&pg, &[]);
    // B holds the key briefly; A queues behind it.
    let first = b.acquire("pg:dup", 600, 0).await;
    assert_eq!(first.status, 200);
    let waiter = tokio::spawn({
        let (http, api) = (a.http.clone(), a.api.clone());
        async move {
            http.post(format!("{api}{}", Fencer::path("pg:dup", "acquire")))
                .body(json!({"ttl_ms": 1000, "wait_ms": 5000}).to_string())
                .send()
                .await
                .map(|r| r.status().as_u16())
        }
    });
    // The database turns slow on that row while A's re-check is due.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut locker = pg_client(&pg).await;
    let tx = locker.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM fencer_locks WHERE key = 'pg:dup' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(900)).await;
    tx.commit().await.unwrap();
    let _ = waiter.await;
    // Whenever B gets the lock again, A must not say it holds it.
    let started = Instant::now();
    loop {
        let r = b.acquire("pg:dup", 10_000, 0).await;
        if r.status == 200 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{}", r.body);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let mine = a.get(&Fencer::path("pg:dup", "")).await;
    assert_ne!(
        mine.body["state"], "held",
        "both sidecars hold pg:dup: {}",
        mine.body
    );
}

/// Item 2: two workers share a sidecar. The first pauses past its lease,
/// the second takes the lock and writes; the first wakes and writes naming
/// only the key, as README's quick start did. Its write must not go out
/// with the second worker's token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_worker_cannot_write_with_another_workers_lease() {
    let storage = Recorder::start().await;
    let (_gateway, sidecar) = fenced_stack(&storage, &[]);
    let url = format!("{}/kv/shared", sidecar.proxy);
    let _a = sidecar.acquire("acct:shared", 300, 0).await;
    tokio::time::sleep(Duration::from_millis(400)).await; // worker A paused
    let b = sidecar.acquire("acct:shared", 10_000, 1_000).await;
    assert_eq!(b.status, 200);
    let w = put(
        &sidecar.http,
        &url,
        &[
            ("Fencing-Lock", "acct:shared"),
            ("Fencing-Lease", &b.lease()),
        ],
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
    // Worker A wakes up and writes what it computed under its own lease.
    let stale = put(&sidecar.http, &url, &[("Fencing-Lock", "acct:shared")]).await;
    assert!(
        stale.status >= 400,
        "A's write went out: {} {}",
        stale.status,
        stale.body
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(storage.seen().len(), 1, "{:#?}", storage.seen());
}

/// Item 3: with `default_transaction_isolation = 'repeatable read'` on the
/// server, the floor read after waiting for a clean-up used the old
/// snapshot and a recreated key's token went back (5 → 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_never_go_back_under_a_repeatable_read_default() {
    let pg = PgServer::start_with(&[("default_transaction_isolation", "repeatable read")]);
    let s = pg_sidecar(&pg, &[]);
    let mut last = 0;
    for _ in 0..5 {
        let l = s.acquire("pg:floor", 10_000, 0).await;
        assert_eq!(l.status, 200, "{}", l.body);
        last = l.token();
        s.release("pg:floor", &l.lease()).await;
    }
    // A clean-up in progress: it holds the floor lock, has deleted the idle
    // row and raised the floor, and has not committed yet.
    let mut cleaner = pg_client(&pg).await;
    let tx = cleaner.transaction().await.unwrap();
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&FLOOR_LOCK])
        .await
        .unwrap();
    tx.execute("DELETE FROM fencer_locks WHERE key = 'pg:floor'", &[])
        .await
        .unwrap();
    tx.execute(
        "UPDATE fencer_token_floor SET floor = GREATEST(floor, $1)",
        &[&(last as i64)],
    )
    .await
    .unwrap();
    let next = tokio::spawn({
        let (http, api) = (s.http.clone(), s.api.clone());
        async move {
            let r = http
                .post(format!("{api}{}", Fencer::path("pg:floor", "acquire")))
                .body(json!({"ttl_ms": 10_000, "wait_ms": 5_000}).to_string())
                .send()
                .await
                .unwrap();
            r.json::<serde_json::Value>().await.unwrap()
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    tx.commit().await.unwrap();
    let body = next.await.unwrap();
    let token = body["token"].as_u64().unwrap_or_else(|| panic!("{body}"));
    assert!(token > last, "token went back: {token} after {last}");
}

/// Item 4: a statement that timed out in the sidecar went on in the
/// server: it granted the lock later to a lease nobody owned, and the
/// next request on its pooled connection queued behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_acquire_leaves_no_orphan_lock_and_no_stuck_connection() {
    let pg = PgServer::start();
    let a = pg_sidecar(
        &pg,
        &[
            ("backend.postgres.request_timeout_ms", "300"),
            ("backend.postgres.pool_size", "1"),
        ],
    );
    let b = pg_sidecar(&pg, &[]);
    let l = b.acquire("pg:orphan", 10_000, 0).await;
    b.release("pg:orphan", &l.lease()).await;
    let mut locker = pg_client(&pg).await;
    let tx = locker.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM fencer_locks WHERE key = 'pg:orphan' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();
    let r = a.acquire("pg:orphan", 30_000, 0).await;
    assert_eq!(r.status, 503, "{}", r.body);
    // Another key, on the one pooled connection.
    let other = a.acquire("pg:unrelated", 30_000, 0).await;
    assert_eq!(other.status, 200, "{}", other.body);
    tx.commit().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let free = b.acquire("pg:orphan", 10_000, 0).await;
    assert_eq!(
        free.status, 200,
        "an orphan lock holds pg:orphan: {}",
        free.body
    );
}

/// Item 5: every start-up ran DDL (`ALTER TABLE … ADD COLUMN IF NOT
/// EXISTS` wants ACCESS EXCLUSIVE); behind one long reader, one pod
/// restart froze every other sidecar's and gateway's traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_behind_a_long_reader_freezes_nobody() {
    let pg = PgServer::start();
    let url_pg = pg.url();
    let storage = Recorder::start().await;
    let gw_extra = [
        ("gateway.fence_store", "postgres"),
        ("gateway.postgres_url", url_pg.as_str()),
    ];
    let a = pg_sidecar(&pg, &[]);
    let gw_a = Fencer::gateway(&storage.url(), &gw_extra);
    assert_eq!(a.acquire("pg:warm", 10_000, 0).await.status, 200);
    // A long reader, as pg_dump holds.
    let reader = pg_client(&pg).await;
    reader
        .batch_execute(
            "BEGIN; SELECT count(*) FROM fencer_locks; SELECT count(*) FROM fencer_fences;",
        )
        .await
        .unwrap();
    // Restarts, in the background: their start-up is what must not freeze
    // the others (and it may wait for the reader itself).
    let restarts = {
        let (url, upstream) = (url_pg.clone(), storage.url());
        std::thread::spawn(move || {
            let b = Fencer::sidecar(Backend::Postgres, Some(&url), &[]);
            let gw = std::panic::catch_unwind(|| {
                Fencer::gateway(
                    &upstream,
                    &[
                        ("gateway.fence_store", "postgres"),
                        ("gateway.postgres_url", url.as_str()),
                    ],
                )
            });
            (b, gw.ok())
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let r = a.acquire("pg:during", 10_000, 0).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let w = put(
        &reqwest::Client::new(),
        &format!("{}/kv/during", gw_a.api),
        &[("Fencing-Token", &sign_v1("during", 1, "l"))],
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
    assert!(
        started.elapsed() < Duration::from_millis(1_500),
        "traffic stalled {:?} behind start-up DDL",
        started.elapsed()
    );
    reader.batch_execute("COMMIT").await.unwrap();
    let _ = restarts.join();
}

/// Item 6: every acquire took the token floor's shared lock, even for keys
/// whose row exists; a clean-up waiting for the exclusive lock behind one
/// slow new-key acquire then stalled every key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_clean_up_does_not_stall_existing_keys() {
    let pg = PgServer::start();
    let s = pg_sidecar(
        &pg,
        &[
            ("backend.postgres.cleanup_interval_ms", "100"),
            ("backend.postgres.idle_cleanup_after_ms", "1000"),
        ],
    );
    let l = s.acquire("pg:existing", 10_000, 0).await;
    s.release("pg:existing", &l.lease()).await;
    // A slow new-key acquire, holding the floor's shared lock.
    let mut slow = pg_client(&pg).await;
    let tx = slow.transaction().await.unwrap();
    tx.execute("SELECT pg_advisory_xact_lock_shared($1)", &[&FLOOR_LOCK])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await; // clean-up rounds
    let started = Instant::now();
    let r = s.acquire("pg:existing", 10_000, 0).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        started.elapsed() < Duration::from_millis(1_000),
        "an existing key waited {:?}",
        started.elapsed()
    );
    tx.commit().await.unwrap();
}

/// Item 7: the LISTEN janitor unlistened channels a new waiter had just
/// listened on, leaving hot keys deaf to releases; their waiters were
/// woken by the fallback timer only, or not before their wait ran out.
/// Runs across a janitor tick (every 10 s), with many keys going idle and
/// busy again around it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_stay_woken_by_releases_across_janitor_sweeps() {
    let pg = PgServer::start();
    let waiters = pg_sidecar(&pg, &[("sidecar.max_fallback_ms", "60000")]);
    let holders = pg_sidecar(&pg, &[]);
    let until = Instant::now() + Duration::from_secs(12);
    let mut tasks = Vec::new();
    for k in 0..100 {
        let key = format!("pg:hot{k}");
        let (w_http, w_api) = (waiters.http.clone(), waiters.api.clone());
        let (h_http, h_api) = (holders.http.clone(), holders.api.clone());
        tasks.push(tokio::spawn(async move {
            let mut late = 0;
            let mut rounds = 0;
            while Instant::now() < until {
                let hold = send(
                    &h_http,
                    "POST",
                    &format!("{h_api}{}", Fencer::path(&key, "acquire")),
                    &[],
                    Some(&json!({"ttl_ms": 60_000}).to_string()),
                )
                .await;
                let wait = tokio::spawn({
                    let (http, api, key) = (w_http.clone(), w_api.clone(), key.clone());
                    async move {
                        send(
                            &http,
                            "POST",
                            &format!("{api}{}", Fencer::path(&key, "acquire")),
                            &[],
                            Some(&json!({"ttl_ms": 60_000, "wait_ms": 3_000}).to_string()),
                        )
                        .await
                    }
                });
                tokio::time::sleep(Duration::from_millis(10)).await;
                send(
                    &h_http,
                    "POST",
                    &format!("{h_api}{}", Fencer::path(&key, "release")),
                    &[],
                    Some(&json!({"lease_id": hold.lease()}).to_string()),
                )
                .await;
                let got = wait.await.unwrap();
                if got.status != 200 {
                    late += 1;
                } else {
                    send(
                        &w_http,
                        "POST",
                        &format!("{w_api}{}", Fencer::path(&key, "release")),
                        &[],
                        Some(&json!({"lease_id": got.lease()}).to_string()),
                    )
                    .await;
                }
                rounds += 1;
                let idle = rand::random::<u64>() % 20;
                tokio::time::sleep(Duration::from_millis(idle)).await;
            }
            (late, rounds)
        }));
    }
    let (mut late, mut rounds) = (0, 0);
    for t in tasks {
        let (l, r) = t.await.unwrap();
        late += l;
        rounds += r;
    }
    let fallback = waiters
        .metric("fencer_waiter_wakeups_total", &[("cause", "fallback")])
        .await;
    assert!(rounds > 400, "too few rounds: {rounds}");
    assert_eq!(
        (late, fallback),
        (0, 0.0),
        "{late} waiters of {rounds} missed their release; {fallback} fallback wake-ups"
    );
}

/// Item 8: `/readyz` of a gateway waited for a fence-store pool slot; with
/// every connection held by slow requests it missed the kubelet's timeout
/// and the replica left its Service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_readiness_answers_while_the_store_is_busy() {
    let pg = PgServer::start();
    let url_pg = pg.url();
    let storage = Recorder::start().await;
    let gateway = Fencer::gateway(
        &storage.url(),
        &[
            ("gateway.fence_store", "postgres"),
            ("gateway.postgres_url", url_pg.as_str()),
            ("gateway.postgres_pool_size", "2"),
        ],
    );
    let client = reqwest::Client::new();
    let mut slow = Vec::new();
    for k in 0..4 {
        let (client, url) = (client.clone(), format!("{}/kv/slow{k}", gateway.api));
        slow.push(tokio::spawn(async move {
            put(
                &client,
                &url,
                &[
                    ("Fencing-Token", &sign_v1(&format!("slow{k}"), 1, "l")),
                    ("x-delay-ms", "3000"),
                ],
            )
            .await
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let ready = impatient(1_000)
        .get(format!("{}/readyz", gateway.admin))
        .send()
        .await;
    assert!(
        matches!(&ready, Ok(r) if r.status() == 200),
        "not ready within the kubelet's 1 s: {ready:?} after {:?}",
        started.elapsed()
    );
    for s in slow {
        let _ = s.await;
    }
}
