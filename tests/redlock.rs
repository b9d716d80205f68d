//! RedLock as an attacker meets it: masters that restart empty, masters that
//! freeze, two sidecars racing for the same majority.
//!
//! RedLock's known hole (Kleppmann, and antirez's own answer) is a master
//! that loses its data: restarted without `appendfsync always`, it forgets
//! a lock it granted, and with one more such master a second client gets a
//! "majority" while the first still holds. fencer's answer is the restart
//! quarantine (`backend.redlock.restart_quarantine_ms`): a master votes only
//! once it has kept its data that long, and no lease may outlive it. These
//! tests show the hole with the quarantine off and closed with it on.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use redis::Commands;

fn masters(n: usize) -> Vec<RedisServer> {
    (0..n)
        .map(|_| RedisServer::start(Persistence::Off))
        .collect()
}

fn redlock_sidecar(masters: &[RedisServer], extra: &[(&str, &str)]) -> Fencer {
    let urls: Vec<String> = masters.iter().map(RedisServer::url).collect();
    let urls = urls.join(",");
    let mut settings = vec![("backend.redlock.urls", urls.as_str())];
    settings.extend_from_slice(extra);
    Fencer::sidecar(Backend::RedLock, None, &settings)
}

/// Acquires `key` until the masters' first quarantine is over; returns how
/// long that took and the answer that finally granted.
async fn wait_out_quarantine(sidecar: &Fencer, key: &str, ttl_ms: u64) -> (Duration, Resp) {
    let started = Instant::now();
    loop {
        let r = sidecar.acquire(key, ttl_ms, 0).await;
        if r.status == 200 {
            return (started.elapsed(), r);
        }
        assert_eq!(r.status, 503, "{:?}", r.body);
        assert_eq!(r.code(), "backend_refused", "{:?}", r.body);
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "still quarantined after 20 s: {:?}",
            r.body
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_deployment_is_refused_until_the_quarantine_ends() {
    let m = masters(3);
    let sidecar = redlock_sidecar(
        &m,
        &[
            ("backend.redlock.restart_quarantine_ms", "1500"),
            ("sidecar.default_ttl_ms", "1000"),
        ],
    );
    let first = sidecar.acquire("fresh", 1000, 0).await;
    assert_eq!(first.status, 503, "{:?}", first.body);
    assert_eq!(first.code(), "backend_refused");
    let (waited, granted) = wait_out_quarantine(&sidecar, "fresh", 1000).await;
    assert!(
        waited >= Duration::from_millis(1200),
        "granted after {waited:?}, before the 1.5 s quarantine ended"
    );
    assert!(granted.token() > 0);
    let refused = sidecar
        .metric(
            "fencer_redlock_rounds_total",
            &[("op", "acquire"), ("outcome", "quarantined")],
        )
        .await;
    assert!(refused >= 1.0, "quarantined rounds not counted: {refused}");

    // A lease may not outlive the quarantine, at acquire or at renewal.
    let long = sidecar.acquire("long", 1501, 0).await;
    assert_eq!(long.status, 400, "{:?}", long.body);
    assert_eq!(long.code(), "ttl_too_long");
    let renew = sidecar.renew("fresh", &granted.lease(), 5000).await;
    assert_eq!(renew.status, 400, "{:?}", renew.body);
    assert_eq!(renew.code(), "ttl_too_long");
    // The lease itself is untouched by the refused renewal.
    let ok = sidecar.renew("fresh", &granted.lease(), 1000).await;
    assert_eq!(ok.status, 200, "{:?}", ok.body);
}

/// Two of three masters restart empty while a lease lives on the third.
/// A sidecar without the quarantine grants the key a second time; one with
/// it refuses until the restarted masters have kept their data long enough
/// for every lease they might have forgotten to have expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masters_restarted_empty_cannot_grant_a_live_lease_twice() {
    let mut m = masters(3);
    let q = [
        ("backend.redlock.restart_quarantine_ms", "3000"),
        ("sidecar.default_ttl_ms", "3000"),
    ];
    let a = redlock_sidecar(&m, &q);
    let b = redlock_sidecar(&m, &q);
    let (_, _) = wait_out_quarantine(&a, "warm-up", 100).await;

    let held = a.acquire("account:1", 3000, 0).await;
    assert_eq!(held.status, 200, "{:?}", held.body);
    let held_at = Instant::now();
    m[0].restart();
    m[1].restart();

    // With the quarantine: the forgetful masters abstain, no majority.
    let second = b.acquire("account:1", 3000, 0).await;
    assert_eq!(
        second.status, 503,
        "a second holder while the first lease lives: {:?}",
        second.body
    );
    assert_eq!(second.code(), "backend_refused");

    // The same masters, the mechanism off: a second "holder" at once.
    let off = redlock_sidecar(&m, &[("backend.redlock.restart_quarantine_ms", "0")]);
    let unsafe_grant = off.acquire("account:1", 1000, 0).await;
    assert!(held_at.elapsed() < Duration::from_millis(3000));
    assert_eq!(
        unsafe_grant.status, 200,
        "without the quarantine the restarted masters should grant (the hole this closes): {:?}",
        unsafe_grant.body
    );
    let _ = off.release("account:1", &unsafe_grant.lease()).await;

    // Once the first lease is over and the masters have served their
    // quarantine, the key is granted again, with a higher token.
    let (_, next) = wait_out_quarantine(&b, "account:1", 1000).await;
    assert!(
        held_at.elapsed() >= Duration::from_millis(3000),
        "granted {:?} after the first lease, inside its TTL",
        held_at.elapsed()
    );
    assert!(
        next.token() > held.token(),
        "token went back: {} after {}",
        next.token(),
        held.token()
    );
}

/// A frozen master (SIGSTOP) costs each round at most its request timeout;
/// the other two still make a majority, and the frozen one's stale view
/// does not matter when it wakes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_master_slows_no_round_past_its_request_timeout() {
    let m = masters(3);
    let sidecar = redlock_sidecar(&m, &[("backend.redlock.restart_quarantine_ms", "0")]);
    m[2].pause();
    let mut worst = Duration::ZERO;
    let mut last = 0;
    for i in 0..20 {
        let started = Instant::now();
        let r = sidecar.acquire("frozen", 2000, 0).await;
        worst = worst.max(started.elapsed());
        assert_eq!(r.status, 200, "round {i}: {:?}", r.body);
        assert!(r.token() > last);
        last = r.token();
        let rel = sidecar.release("frozen", &r.lease()).await;
        assert_eq!(rel.status, 200, "{:?}", rel.body);
    }
    m[2].resume();
    println!("20 acquire+release cycles with one of 3 masters frozen: worst acquire {worst:?}");
    // request_timeout_ms 50 (default) plus scheduling on a loaded machine.
    assert!(worst < Duration::from_secs(2), "an acquire took {worst:?}");
    let r = sidecar.acquire("frozen", 2000, 0).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert!(r.token() > last);
}

/// Two sidecars, eight workers, one key: the sidecars race each other for
/// every majority (a split vote, when it happens, is released and retried;
/// the split rule itself has unit tests in `vote.rs`); the critical section
/// is never shared: a non-atomic GET/SET counter on a
/// separate Redis ends at exactly the number of increments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sidecars_racing_for_one_key_never_share_it() {
    let m = masters(5);
    let counter = RedisServer::start(Persistence::Off);
    let off = [("backend.redlock.restart_quarantine_ms", "0")];
    let sidecars = Arc::new([redlock_sidecar(&m, &off), redlock_sidecar(&m, &off)]);
    let rounds = 25;
    let mut tasks = Vec::new();
    for w in 0..8 {
        let sidecars = sidecars.clone();
        let url = counter.url();
        tasks.push(tokio::spawn(async move {
            let sidecar = &sidecars[w % 2];
            let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
            let mut tokens = Vec::new();
            for _ in 0..rounds {
                let r = sidecar.acquire("shared", 5000, 20_000).await;
                assert_eq!(r.status, 200, "{:?}", r.body);
                let v: i64 = conn.get("n").unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(1)).await;
                let _: () = conn.set("n", v + 1).unwrap();
                tokens.push(r.token());
                let rel = sidecar.release("shared", &r.lease()).await;
                assert_eq!(rel.status, 200, "{:?}", rel.body);
            }
            tokens
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let n: i64 = counter.conn().get("n").unwrap();
    assert_eq!(n, 8 * rounds as i64, "increments lost under the lock");
    let before = all.len();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), before, "a token was handed out twice");
    let mut splits = 0.0;
    for s in sidecars.iter() {
        splits += s
            .metric(
                "fencer_redlock_rounds_total",
                &[("op", "acquire"), ("outcome", "split")],
            )
            .await;
    }
    println!(
        "{} cycles over two sidecars, {splits} split rounds",
        8 * rounds
    );
}
