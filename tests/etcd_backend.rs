//! The etcd lock backend's own behaviour and faults (issue 34): tokens
//! and held leases across leader kills (with the time acquires stop), a
//! killed sidecar's keys freed on etcd's clock, a paused holder's lease
//! lapsing, a create whose reply was lost, the token offset and a cluster
//! rebuilt from empty, compaction while a waiter waits, a full cluster
//! restart, a waiter that gives up, TLS with client certificates and a
//! password, and a lease past its TTL that the sweeper could not end
//! first (never renewed, released as held or acquired again). The behavioural suite runs on it in tests/lock_suite.rs.
//!
//! Every test starts its own etcd (tests/common/etcd.rs).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::etcd::{post_json, EtcdCluster};
use common::*;
use fencer::etcd::wire::{b64, prefix_end};
use fencer::lock::etcd::settings::EtcdSettings;
use fencer::lock::etcd::{place, EtcdBackend};
use fencer::lock::{Attempt, Holds, HoldsChange, LeaseId, LockBackend, LockKey, WakeSink};
use serde_json::json;

fn sidecar(etcd: &EtcdCluster, extra: &[(&str, &str)]) -> Fencer {
    let endpoints = etcd.endpoints().join(",");
    let mut all = vec![("backend.etcd.endpoints", endpoints.as_str())];
    all.extend_from_slice(extra);
    let s = Fencer::sidecar(Backend::Etcd, None, &all);
    s.wait_ready();
    s
}

/// How late past its bound a key may move on this noisy 2-core machine:
/// etcd checks for expired leases every 500 ms, and the machine adds its
/// own delays.
const SLACK: Duration = Duration::from_millis(1_500);

/// The places queued under `key` (what any sidecar would see).
fn places(etcd: &EtcdCluster, key: &str) -> u64 {
    let q = place::queue("/fencer", key);
    let body = json!({"key": b64(&q), "range_end": b64(&prefix_end(&q)), "count_only": true});
    let (code, text) = post_json(etcd.ports()[0], "/v3/kv/range", &body.to_string()).unwrap();
    assert_eq!(code, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["count"]
        .as_str()
        .map_or(0, |c| c.parse().unwrap_or_default())
}

async fn places_become(etcd: &EtcdCluster, key: &str, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while places(etcd, key) != n {
        assert!(
            Instant::now() < deadline,
            "{key}: {} places, not {n}",
            places(etcd, key)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn acquire_in_background(
    s: &Fencer,
    key: &str,
    ttl_ms: u64,
    wait_ms: u64,
) -> tokio::task::JoinHandle<Option<(Resp, Instant)>> {
    s.acquire_in_background(key, json!({"ttl_ms": ttl_ms, "wait_ms": wait_ms}))
}

/// Tokens rise through three leader kills, a lease held across them
/// renews, and acquires resume within a bound after each kill (the
/// failover unavailability, printed: `cargo test --test etcd_backend
/// leader -- --nocapture`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_rise_and_held_leases_survive_leader_kills() {
    let mut etcd = EtcdCluster::start();
    let s = sidecar(&etcd, &[("sidecar.default_ttl_ms", "5000")]);
    let held = s.acquire("leader:held", 5_000, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);
    let mut last = 0;
    let mut gaps = Vec::new();
    for round in 0..3 {
        for _ in 0..5 {
            let r = s.acquire("leader:1", 5_000, 3_000).await;
            assert_eq!(r.status, 200, "round {round}: {}", r.body);
            assert!(
                r.token() > last,
                "token went back: {} after {last}",
                r.token()
            );
            last = r.token();
            assert_eq!(s.release("leader:1", &r.lease()).await.status, 200);
        }
        if round == 2 {
            break;
        }
        let (old, killed) = etcd.kill_leader();
        // Acquires resume: the first one granted after the kill.
        let resumed = loop {
            let r = s.acquire("leader:1", 5_000, 0).await;
            if r.status == 200 {
                assert!(r.token() > last);
                last = r.token();
                assert_eq!(s.release("leader:1", &r.lease()).await.status, 200);
                break killed.elapsed();
            }
            assert_eq!(r.code(), "backend_unavailable", "{}", r.body);
            assert!(
                killed.elapsed() < Duration::from_secs(15),
                "no acquire 15 s after the leader's kill: {}\n{}",
                r.body,
                s.logs()
            );
        };
        gaps.push(resumed);
        let renewed = s.renew("leader:held", &held.lease(), 5_000).await;
        assert_eq!(renewed.status, 200, "round {round}: {}", renewed.body);
        etcd.restart(old);
        etcd.wait_healthy(Duration::from_secs(30));
    }
    eprintln!("acquires resumed {gaps:?} after each leader kill");
}

/// A sidecar killed with `kill -9` deletes nothing; its keys are free
/// once their places' etcd leases lapse on etcd's clock — the lease's TTL
/// (rounded up to etcd's whole seconds), not before and not much after. A
/// key it only waited for is not blocked by its place either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_sidecars_keys_are_free_after_their_ttl_on_etcds_clock() {
    let etcd = EtcdCluster::with_size(1);
    let ttl = Duration::from_millis(2_000);
    let (mut a, b, w) = (
        sidecar(&etcd, &[]),
        sidecar(&etcd, &[]),
        sidecar(&etcd, &[]),
    );
    let sent = Instant::now();
    let held = a.acquire("kill:held", 2_000, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);
    let b_held = b.acquire("kill:queued", 8_000, 0).await;
    assert_eq!(b_held.status, 200);
    // a waits behind b; w behind a.
    let _a_waits = acquire_in_background(&a, "kill:queued", 2_000, 15_000);
    places_become(&etcd, "kill:queued", 2).await;
    let w_queued = acquire_in_background(&w, "kill:queued", 2_000, 12_000);
    places_become(&etcd, "kill:queued", 3).await;
    let w_held = acquire_in_background(&w, "kill:held", 2_000, 12_000);
    places_become(&etcd, "kill:held", 2).await;
    a.kill();
    let killed = Instant::now();
    assert_eq!(b.release("kill:queued", &b_held.lease()).await.status, 200);

    let (got, at) = w_held.await.unwrap().expect("w answered");
    assert_eq!(got.status, 200, "{}\n{}", got.body, w.logs());
    assert!(got.token() > held.token());
    let moved = at - sent;
    assert!(
        moved >= ttl,
        "the key moved {moved:?} after the killed holder's acquire: before its {ttl:?} lease ended"
    );
    assert!(
        moved <= ttl + SLACK,
        "the killed holder's key moved only {moved:?} after its acquire (TTL {ttl:?})"
    );
    eprintln!("held key moved {moved:?} after the killed holder's acquire");
    let (got, at) = w_queued.await.unwrap().expect("w answered");
    assert_eq!(got.status, 200, "{}\n{}", got.body, w.logs());
    assert!(got.token() > b_held.token());
    assert!(
        at - killed <= ttl + SLACK,
        "the killed waiter's place blocked the queue for {:?}",
        at - killed
    );
}

/// A holder frozen (SIGSTOP) past its TTL: its place lapses with its etcd
/// lease and another sidecar gets the key — after the TTL, with a higher
/// token. When it thaws, its lease is lost and its own clean-up leaves the
/// new holder's place alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_holder_loses_its_lease_and_thaws_without_harm() {
    let etcd = EtcdCluster::with_size(1);
    let (a, b) = (sidecar(&etcd, &[]), sidecar(&etcd, &[]));
    let sent = Instant::now();
    let held = a.acquire("frozen:1", 1_000, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);
    unsafe { libc::kill(a.pid() as i32, libc::SIGSTOP) };
    let got = b.acquire("frozen:1", 10_000, 8_000).await;
    let moved = sent.elapsed();
    assert_eq!(got.status, 200, "{}\n{}", got.body, b.logs());
    assert!(got.token() > held.token());
    assert!(moved >= Duration::from_millis(1_000), "{moved:?}");
    unsafe { libc::kill(a.pid() as i32, libc::SIGCONT) };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        a.renew("frozen:1", &held.lease(), 1_000).await.code(),
        "lease_lost"
    );
    let still = b.renew("frozen:1", &got.lease(), 10_000).await;
    assert_eq!(still.status, 200, "{}", still.body);
    assert_eq!(places(&etcd, "frozen:1"), 1);
}

/// A holder that renews keeps the key; the next sidecar gets it only
/// after the holder's deadline passes unrenewed (mutant
/// `etcd_early_expiry` ends it at half its TTL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_moves_only_after_the_holders_deadline() {
    let etcd = EtcdCluster::with_size(1);
    let (a, b) = (sidecar(&etcd, &[]), sidecar(&etcd, &[]));
    for round in 0..3 {
        let key = format!("deadline:{round}");
        let sent = Instant::now();
        let held = a.acquire(&key, 1_000, 0).await;
        assert_eq!(held.status, 200, "{}", held.body);
        let got = b.acquire(&key, 1_000, 5_000).await;
        let moved = sent.elapsed();
        assert_eq!(got.status, 200, "{}", got.body);
        assert!(
            moved >= Duration::from_millis(1_000),
            "round {round}: the key moved {moved:?} after the acquire was sent, before the holder's 1 s lease ended"
        );
        assert_eq!(
            a.renew(&key, &held.lease(), 1_000).await.code(),
            "lease_lost"
        );
    }
}

/// A waiter that gives up takes its place out of the queue at once
/// (mutant `etcd_waiter_place_left` leaves it, to lapse by itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_gives_up_leaves_no_place_behind() {
    let etcd = EtcdCluster::with_size(1);
    let (a, b) = (sidecar(&etcd, &[]), sidecar(&etcd, &[]));
    let held = a.acquire("giveup:1", 20_000, 0).await;
    assert_eq!(held.status, 200);
    let r = b.acquire("giveup:1", 20_000, 500).await;
    assert_eq!(r.code(), "lock_held", "{}", r.body);
    places_become(&etcd, "giveup:1", 1).await;
    assert_eq!(a.release("giveup:1", &held.lease()).await.status, 200);
    places_become(&etcd, "giveup:1", 0).await;
}

struct NoWake;
impl WakeSink for NoWake {
    fn released(&self, _: &str) {}
    fn resync(&self) {}
}

async fn backend(etcd: &EtcdCluster, request_timeout_ms: u64) -> EtcdBackend {
    let settings = EtcdSettings {
        endpoints: etcd.endpoints(),
        request_timeout_ms,
        ..Default::default()
    };
    let b = EtcdBackend::new(
        &settings,
        Duration::ZERO,
        Arc::new(NoWake),
        &prometheus::Registry::new(),
    )
    .unwrap();
    b.ping().await.unwrap();
    b
}

/// One acquire + release; the token.
async fn cycle(be: &EtcdBackend, key: &LockKey) -> u64 {
    let lease = LeaseId::generate();
    let attempt = be
        .try_acquire(key, &lease, Duration::from_secs(2))
        .await
        .unwrap();
    let Attempt::Acquired { token } = attempt else {
        panic!("{attempt:?}")
    };
    be.release(key, &lease).await.unwrap();
    token
}

/// The member stalls while a try is on its way: the try fails with its
/// outcome unknown, its writes landing once the member resumes. The retry
/// with the same lease id finds the place by its name and holds with it —
/// never a second place; asked again, it answers the same token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_whose_reply_was_lost_is_found_not_repeated() {
    let etcd = EtcdCluster::with_size(1);
    let be = backend(&etcd, 300).await;
    let key = LockKey::parse("lost:1").unwrap();
    let lease = LeaseId::generate();
    etcd.pause(0);
    let first = be.try_acquire(&key, &lease, Duration::from_secs(2)).await;
    etcd.resume(0);
    assert!(first.is_err(), "{first:?}");
    let mut retry = be.try_acquire(&key, &lease, Duration::from_secs(2)).await;
    for _ in 0..20 {
        if retry.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        retry = be.try_acquire(&key, &lease, Duration::from_secs(2)).await;
    }
    let Ok(Attempt::Acquired { token }) = retry else {
        panic!("{retry:?}")
    };
    assert_eq!(places(&etcd, "lost:1"), 1);
    assert_eq!(
        be.try_acquire(&key, &lease, Duration::from_secs(2))
            .await
            .unwrap(),
        Attempt::Acquired { token }
    );
    assert_eq!(places(&etcd, "lost:1"), 1);
}

/// `raise_token_floor` on one sidecar moves every sidecar's next token
/// past the floor (mutant `etcd_token_ignores_offset` does not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raised_token_floor_reaches_every_sidecar() {
    let etcd = EtcdCluster::with_size(1);
    let (one, two) = (backend(&etcd, 2_000).await, backend(&etcd, 2_000).await);
    let key = LockKey::parse("floor:1").unwrap();
    let before = cycle(&two, &key).await;
    let floor = before + 1_000_000_000;
    one.raise_token_floor(&key, floor).await.unwrap();
    let after = cycle(&two, &key).await;
    assert!(
        after > floor,
        "{after} <= {floor}: the stale offset was used"
    );
    let mine = cycle(&one, &key).await;
    assert!(mine > after);
}

/// A cluster rebuilt from empty (restored from nothing, or from a
/// snapshot older than the tokens issued) starts its revisions over:
/// without pre-registration the tokens go back below the gateway's mark;
/// with it the sidecar repairs them forward past the mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_rebuilt_from_empty_needs_preregistration_to_keep_tokens_rising() {
    let mut etcd = EtcdCluster::with_size(1);
    let storage = Fencer::storage(&[]);
    let gateway = Fencer::gateway(&storage.api, &[]);
    let pre = format!("{}/_fencer/v1/fences/", gateway.api);
    let fenced = sidecar(&etcd, &[("sidecar.preregister_url", pre.as_str())]);
    let plain = sidecar(&etcd, &[]);
    // Enough revisions that a rebuilt cluster's stay below them.
    let mut mark = 0;
    for _ in 0..20 {
        let r = fenced.acquire("rebuilt:1", 1_000, 0).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.token() > mark);
        mark = r.token();
        assert_eq!(fenced.release("rebuilt:1", &r.lease()).await.status, 200);
    }
    etcd.restart_empty(0);
    let back = acquire_until_up(&plain, "rebuilt:1").await;
    assert!(
        back.token() < mark,
        "{} after {mark}: the rebuilt cluster did not start over",
        back.token()
    );
    assert_eq!(plain.release("rebuilt:1", &back.lease()).await.status, 200);
    let repaired = acquire_until_up(&fenced, "rebuilt:1").await;
    assert!(
        repaired.token() > mark,
        "{} after the gateway's mark {mark}\n{}",
        repaired.token(),
        fenced.logs()
    );
    assert_eq!(
        fenced.release("rebuilt:1", &repaired.lease()).await.status,
        200
    );
    let next = plain.acquire("rebuilt:1", 1_000, 0).await;
    assert_eq!(next.status, 200, "{}", next.body);
    assert!(next.token() > repaired.token());
}

async fn acquire_until_up(s: &Fencer, key: &str) -> Resp {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = s.acquire(key, 1_000, 0).await;
        if r.status == 200 {
            return r;
        }
        assert!(Instant::now() < deadline, "{}\n{}", r.body, s.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A waiter's watch breaks (the member restarts) and the history it would
/// resume from has been compacted meanwhile: it is woken, watches again
/// from now, and gets the key as soon as the holder releases — not at its
/// fallback re-check after the holder's TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_watch_history_was_compacted_still_gets_the_release() {
    let mut etcd = EtcdCluster::with_size(1);
    let (a, b) = (sidecar(&etcd, &[]), sidecar(&etcd, &[]));
    let held = a.acquire("compact:1", 30_000, 0).await;
    assert_eq!(held.status, 200);
    let waiter = acquire_in_background(&b, "compact:1", 5_000, 25_000);
    places_become(&etcd, "compact:1", 2).await;
    // Writes elsewhere, then a compaction past them all.
    let port = etcd.ports()[0];
    let mut revision = 0;
    for i in 0..5 {
        let body = json!({"key": b64(format!("other/{i}").as_bytes()), "value": b64(b"x")});
        let (code, text) = post_json(port, "/v3/kv/put", &body.to_string()).unwrap();
        assert_eq!(code, 200, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        revision = v["header"]["revision"]
            .as_str()
            .unwrap()
            .parse::<i64>()
            .unwrap();
    }
    let (code, text) = post_json(
        port,
        "/v3/kv/compaction",
        &json!({"revision": revision.to_string(), "physical": true}).to_string(),
    )
    .unwrap();
    assert_eq!(code, 200, "{text}");
    etcd.restart(0);
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let released = Instant::now();
    let r = a.release("compact:1", &held.lease()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let (got, at) = waiter.await.unwrap().expect("b answered");
    assert_eq!(got.status, 200, "{}\n{}", got.body, b.logs());
    assert!(
        at - released < Duration::from_secs(3),
        "the waiter got the key {:?} after the release",
        at - released
    );
}

/// Every member killed and started again on its data: a lease held
/// across it renews, and tokens keep rising.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_cluster_restart_keeps_held_leases_and_rising_tokens() {
    let mut etcd = EtcdCluster::start();
    let s = sidecar(&etcd, &[]);
    let held = s.acquire("restart:held", 10_000, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);
    let before = s.acquire("restart:1", 5_000, 0).await;
    assert_eq!(s.release("restart:1", &before.lease()).await.status, 200);
    for i in 0..etcd.len() {
        etcd.kill(i);
    }
    for i in 0..etcd.len() {
        etcd.restart(i);
    }
    etcd.wait_healthy(Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(8);
    let renewed = loop {
        let r = s.renew("restart:held", &held.lease(), 10_000).await;
        if r.status == 200 || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(renewed.status, 200, "{}\n{}", renewed.body, s.logs());
    let after = acquire_until_up(&s, "restart:1").await;
    assert!(after.token() > before.token());
    assert!(after.token() > held.token());
}

/// TLS with a private CA and a client certificate, and etcd's
/// authentication with a password from a file: locks work; a sidecar with
/// the wrong password is refused (503), never served anonymously. (With
/// both on, etcd's JSON gateway refuses a client certificate that has a
/// CommonName — it would not be used as the user — so this one has none:
/// docs/backends.md says so.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_client_certificates_and_a_password() {
    let certs = common::make_certs();
    let d = certs.path();
    common::make_client_cert(d, "/O=fencer");
    let etcd = EtcdCluster::with_tls(d, true);
    let port = etcd.ports()[0];
    for (path, body) in [
        (
            "/v3/auth/user/add",
            r#"{"name":"root","password":"rootpw"}"#,
        ),
        ("/v3/auth/role/add", r#"{"name":"root"}"#),
        ("/v3/auth/user/grant", r#"{"user":"root","role":"root"}"#),
        ("/v3/auth/enable", "{}"),
    ] {
        let (code, text) = post_json(port, path, body).unwrap();
        assert_eq!(code, 200, "{path}: {text}");
    }
    std::fs::write(d.join("pw"), "rootpw\n").unwrap();
    std::fs::write(d.join("bad"), "nope\n").unwrap();
    let file = |f: &str| d.join(f).display().to_string();
    let endpoints = etcd.tls_endpoints().join(",");
    let with = |pw: &str| {
        Fencer::sidecar(
            Backend::Etcd,
            None,
            &[
                ("backend.etcd.endpoints", endpoints.as_str()),
                ("backend.etcd.tls.ca_file", &file("ca.crt")),
                ("backend.etcd.tls.client_cert_file", &file("client.crt")),
                ("backend.etcd.tls.client_key_file", &file("client.key")),
                ("backend.etcd.user", "root"),
                ("backend.etcd.password_file", &file(pw)),
            ],
        )
    };
    let good = with("pw");
    good.wait_ready();
    let r = good.acquire("tls:1", 5_000, 0).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(good.release("tls:1", &r.lease()).await.status, 200);
    let bad = with("bad");
    let r = bad.acquire("tls:1", 5_000, 0).await;
    assert_eq!(
        (r.status, r.code()),
        (503, "backend_unavailable"),
        "{}",
        r.body
    );
}

/// A lock cycle reuses the etcd lease its last place left (a keepalive,
/// not a grant: no replicated write, and no lease left to lapse per
/// cycle): ten cycles leave one lease, not ten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_cycles_reuse_their_etcd_lease() {
    let etcd = EtcdCluster::with_size(1);
    let be = backend(&etcd, 2_000).await;
    let key = LockKey::parse("reuse:1").unwrap();
    let mut last = 0;
    for _ in 0..10 {
        let token = cycle(&be, &key).await;
        assert!(token > last);
        last = token;
    }
    let (code, text) = post_json(etcd.ports()[0], "/v3/lease/leases", "{}").unwrap();
    assert_eq!(code, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let leases = v["leases"].as_array().map_or(0, Vec::len);
    assert_eq!(leases, 1, "{text}");
}

/// Waiters on one key in one sidecar share one watch of the key's queue:
/// 8 clients × 10 cycles on one key open a handful of watch streams, not
/// one per handover, and each cycle costs the backend two transactions
/// (the place written, the place deleted) and one keepalive — no grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_one_key_share_one_watch_and_a_cycle_is_three_calls() {
    let etcd = EtcdCluster::with_size(1);
    let s = Arc::new(sidecar(&etcd, &[]));
    let counts = |text: &str, method: &str, metric: &str| -> u64 {
        text.lines()
            .filter(|l| l.starts_with(metric) && l.contains(&format!("grpc_method=\"{method}\"")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    let metrics = || async {
        reqwest::get(format!("{}/metrics", etcd.endpoints()[0]))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    // One cycle first: its grant is the only one.
    let r = s.acquire("shared:1", 10_000, 0).await;
    assert_eq!(s.release("shared:1", &r.lease()).await.status, 200);
    let before = metrics().await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                let r = s.acquire("shared:1", 10_000, 10_000).await;
                assert_eq!(r.status, 200, "{}", r.body);
                assert_eq!(s.release("shared:1", &r.lease()).await.status, 200);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let after = metrics().await;
    let delta = |method: &str, metric: &str| {
        counts(&after, method, metric) - counts(&before, method, metric)
    };
    let watches = delta("Watch", "grpc_server_started_total");
    assert!(watches <= 4, "{watches} watch streams for 80 cycles");
    assert_eq!(delta("Txn", "grpc_server_handled_total"), 160);
    assert_eq!(delta("LeaseGrant", "grpc_server_handled_total"), 0);
    assert_eq!(delta("LeaseKeepAlive", "grpc_server_handled_total"), 80);
}

/// What a call of `lease` does once its TTL has passed, when the sweeper
/// could not end it first: the slot was busy with a renewal stalled on a
/// stopped member (the sweeper passes over a busy slot), and the call
/// queued behind it.
#[derive(Debug, Clone, Copy)]
enum LateCall {
    Renew,
    Release,
    Acquire,
}

/// Holds `key` with a 400 ms TTL, stops the member under a renewal, and
/// sends `call` 700 ms in — past the TTL, the renewal still holding the
/// key's slot. The member resumes at 900 ms; the stalled renewal, sent in
/// time, may then succeed, but its TTL counts from when it was sent and
/// ends before `call` gets the slot.
async fn call_past_the_ttl(call: LateCall) -> String {
    let etcd = EtcdCluster::with_size(1);
    let be = Arc::new(backend(&etcd, 2_000).await);
    let key = LockKey::parse(&format!("late:{call:?}")).unwrap();
    let lease = LeaseId::generate();
    let ttl = Duration::from_millis(400);
    let t0 = Instant::now();
    let attempt = be.try_acquire(&key, &lease, ttl).await.unwrap();
    assert!(matches!(attempt, Attempt::Acquired { .. }), "{attempt:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    etcd.pause(0);
    let stalled = {
        let (be, key, lease) = (be.clone(), key.clone(), lease.clone());
        tokio::spawn(async move { be.renew(&key, &lease, ttl).await })
    };
    tokio::time::sleep_until((t0 + Duration::from_millis(700)).into()).await;
    let late = {
        let (be, key, lease) = (be.clone(), key.clone(), lease.clone());
        tokio::spawn(async move {
            match call {
                LateCall::Renew => format!("{:?}", be.renew(&key, &lease, ttl).await),
                LateCall::Release => format!("{:?}", be.release(&key, &lease).await),
                LateCall::Acquire => format!("{:?}", be.try_acquire(&key, &lease, ttl).await),
            }
        })
    };
    tokio::time::sleep_until((t0 + Duration::from_millis(900)).into()).await;
    etcd.resume(0);
    let stalled = stalled.await.unwrap();
    let late = late.await.unwrap();
    assert!(
        !late.contains("Unavailable"),
        "the late call failed ({late}) rather than answering (stalled renewal: {stalled:?})"
    );
    late
}

/// A lease whose TTL has passed on this sidecar's clock is over, whatever
/// etcd still holds: a renewal does not bring it back, a release does not
/// call it held (and skip the lock-delay the sweeper would keep), and a
/// retried acquire of the same lease is not told it holds. These guards
/// are reached only when the sweeper did not end the lease first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_past_its_ttl_is_never_renewed_released_as_held_or_acquired_again() {
    let (renew, release, acquire) = tokio::join!(
        call_past_the_ttl(LateCall::Renew),
        call_past_the_ttl(LateCall::Release),
        call_past_the_ttl(LateCall::Acquire),
    );
    let ok = renew == "Ok(Free)" && release == "Ok(Free)" && acquire.starts_with("Ok(Held");
    assert!(
        ok,
        "past the TTL: renewal answered {renew} (not Free), release {release} (not Free), \
         acquire of the same lease {acquire} (not Held)"
    );
}

/// A client that renews its lease through another sidecar process while
/// the first one lives (two processes of one sidecar, or a client that
/// moved): the second adopts the lease id and moves the place to an etcd
/// lease of its own. The first process must then leave the place alone —
/// its sweeper at its old deadline, its release of the lease — and a
/// release through it, finding the place moved, adopts it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_renewed_through_another_live_process_is_ended_by_neither() {
    let etcd = EtcdCluster::with_size(1);
    let (a, b, c) = (
        sidecar(&etcd, &[]),
        sidecar(&etcd, &[]),
        sidecar(&etcd, &[]),
    );
    // a's deadline passes while b's renewal still holds.
    let held = a.acquire("moved:k", 2_000, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);
    let renewed = b.renew("moved:k", &held.lease(), 10_000).await;
    assert_eq!(renewed.status, 200, "{}", renewed.body);
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    let other = c.acquire("moved:k", 5_000, 0).await;
    assert_eq!(
        other.status, 409,
        "the key was taken while the lease b renewed for 10 s still held: {}",
        other.body
    );
    let again = b.renew("moved:k", &held.lease(), 10_000).await;
    assert_eq!(again.status, 200, "b's renewal: {}", again.body);

    // A release through a, the place on b's etcd lease: released.
    let held = a.acquire("moved:r", 10_000, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);
    let renewed = b.renew("moved:r", &held.lease(), 10_000).await;
    assert_eq!(renewed.status, 200, "{}", renewed.body);
    let released = a.release("moved:r", &held.lease()).await;
    assert_eq!(released.status, 200, "release through a: {}", released.body);
    let next = c.acquire("moved:r", 5_000, 0).await;
    assert_eq!(next.status, 200, "after the release: {}", next.body);
    assert!(next.token() > held.token());
    let late = b.renew("moved:r", &held.lease(), 10_000).await;
    assert_eq!(
        late.status, 409,
        "b renewed a released lease: {}",
        late.body
    );
}

/// A lease adopted from an earlier process of the sidecar (it died, its
/// sweeper with it) is held here no longer than its TTL from that
/// process's last renewal — which is written nowhere: the place's etcd
/// lease, kept for the TTL plus the lock-delay, tells it. Adopted by a
/// hold-count read, the lease is not held on past its TTL (answered
/// "acquired" with its old token, while its place lapses soon after and
/// another sidecar takes the key); adopted early by a renewal, it renews.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_lease_is_held_no_longer_than_its_earlier_processs_deadline() {
    let etcd = EtcdCluster::with_size(1);
    let (read, renewed) = (
        LockKey::parse("adopt:read").unwrap(),
        LockKey::parse("adopt:renewed").unwrap(),
    );
    let (lease, lease2) = (LeaseId::generate(), LeaseId::generate());
    let ttl = Duration::from_millis(1_500);
    let acquired = Instant::now();
    let mut tokens = Vec::new();
    {
        let earlier = backend(&etcd, 2_000).await;
        for (key, lease) in [(&read, &lease), (&renewed, &lease2)] {
            let a = earlier.try_acquire(key, lease, ttl).await.unwrap();
            let Attempt::Acquired { token } = a else {
                panic!("{a:?}")
            };
            tokens.push(token);
        }
    }
    let later = backend(&etcd, 2_000).await;
    let r = later.renew(&renewed, &lease2, ttl).await.unwrap();
    assert!(
        matches!(r, fencer::lock::Ownership::Owned { .. }),
        "adopted {:?} into the TTL: {r:?}",
        acquired.elapsed()
    );
    // Adopted late in its TTL: held here as long as its TTL again, it
    // would outlive its deadline.
    tokio::time::sleep_until((acquired + Duration::from_millis(600)).into()).await;
    let h = later.holds(&read, &lease, HoldsChange::Read).await.unwrap();
    assert!(matches!(h, Holds::Owned { .. }), "{h:?}");
    tokio::time::sleep_until((acquired + ttl + Duration::from_millis(200)).into()).await;
    // Past the TTL the adopted lease is over: the key is held (its place
    // not yet ended) or free — taken then with a new place and token —
    // but the old lease is not held on.
    let again = later.try_acquire(&read, &lease, ttl).await.unwrap();
    assert_ne!(
        again,
        Attempt::Acquired { token: tokens[0] },
        "{:?} after its acquire, past its {ttl:?} TTL, the adopted lease was held on",
        acquired.elapsed()
    );
}
