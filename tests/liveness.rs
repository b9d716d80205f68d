//! Renewal that cannot fail silently, against a real Redis the test pauses,
//! and batched renewal of many leases.

mod common;

use std::time::{Duration, Instant};

use common::upstream::Recorder;
use common::*;
use serde_json::json;

/// Redis frozen (SIGSTOP) longer than the leases' safe time: the sidecar
/// marks its auto-renewed leases lost before their TTL could have run out
/// by its own clock, its proxy refuses their writes, and the webhook hears
/// of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_makes_leases_lost_before_their_ttl() {
    let redis = RedisServer::start(Persistence::Off);
    let hook = Recorder::start().await;
    let upstream = Recorder::start().await;
    let s = Fencer::sidecar(
        Backend::Redis,
        Some(&redis.url()),
        &[
            ("backend.redis.request_timeout_ms", "100"),
            (
                "sidecar.lost_lease_webhook",
                &format!("{}/hook", hook.url()),
            ),
            ("proxy.upstream", &upstream.url()),
        ],
    );
    const TTL: u64 = 1_000;
    let mut leases = Vec::new();
    for i in 0..5 {
        let r = s
            .post(
                &Fencer::path(&format!("frozen:{i}"), "acquire"),
                json!({"ttl_ms": TTL, "auto_renew": true, "keepalive_ms": 60000}),
            )
            .await;
        assert_eq!(r.status, 200);
        leases.push(r.lease());
    }
    // Renewals are flowing.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        s.metric("fencer_renewals_total", &[("result", "renewed")])
            .await
            >= 5.0
    );
    redis.pause();
    let paused = Instant::now();
    // The sidecar's remaining safe time at the pause: its deadline, always
    // before the last successful renewal's send time + TTL, which is the
    // earliest Redis could expire the key.
    let safe = s.get(&Fencer::path("frozen:0", "")).await.body["remaining_ms"]
        .as_u64()
        .unwrap();
    assert!(safe < TTL);
    let lost_at = loop {
        let v = s.get(&Fencer::path("frozen:0", "")).await;
        if v.body["state"] == "lost" {
            break paused.elapsed();
        }
        assert!(
            paused.elapsed() < Duration::from_secs(5),
            "never marked lost"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // Marked lost at its deadline (plus polling slack), not at some later
    // point when a renewal finally failed for good.
    assert!(
        lost_at <= Duration::from_millis(safe + 150),
        "lost {lost_at:?} after the freeze, deadline was {safe} ms away"
    );
    eprintln!(
        "lease marked lost {lost_at:?} after Redis froze (safe time left {safe} ms, TTL {TTL} ms)"
    );
    let w = send(
        &s.http,
        "PUT",
        &format!("{}/data", s.proxy),
        &[("Fencing-Lock", "frozen:0"), ("Fencing-Lease", &leases[0])],
        Some("{}"),
    )
    .await;
    assert_eq!((w.status, w.code()), (409, "lease_lost"), "{}", w.body);
    assert!(
        upstream.seen().is_empty(),
        "a write of a lost lease was forwarded"
    );
    // Every lease was reported to the webhook.
    let deadline = Instant::now() + Duration::from_secs(5);
    while hook.seen().len() < 5 {
        assert!(
            Instant::now() < deadline,
            "webhook got {} calls",
            hook.seen().len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(hook.seen().iter().all(|h| h.path == "/hook" && h.bytes > 0));
    assert!(
        s.metric("fencer_lost_leases_total", &[("reason", "deadline")])
            .await
            >= 5.0
    );
    redis.resume();
}

/// 1 000 auto-renewed leases stay held over several TTLs with a handful of
/// batched backend calls, not one per lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_leases_are_renewed_in_batches() {
    let redis = RedisServer::start(Persistence::Off);
    let s = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    let client = s.http.clone();
    let api = s.api.clone();
    let mut tasks = Vec::new();
    for chunk in 0..10 {
        let (client, api) = (client.clone(), api.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..100 {
                let key = format!("many:{}", chunk * 100 + i);
                let r = send(
                    &client,
                    "POST",
                    &format!("{api}/v1/locks/{key}/acquire"),
                    &[],
                    Some(r#"{"ttl_ms":1500,"auto_renew":true,"keepalive_ms":600000}"#),
                )
                .await;
                assert_eq!(r.status, 200, "{}", r.body);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let before_calls = s
        .metric(
            "fencer_backend_request_duration_seconds_count",
            &[("op", "renew_many")],
        )
        .await;
    let before_renewed = s
        .metric("fencer_renewals_total", &[("result", "renewed")])
        .await;
    tokio::time::sleep(Duration::from_millis(4_500)).await; // 3 TTLs
    let list = s.get("/v1/locks?limit=10000").await;
    assert_eq!(list.body["total"], 1000);
    let held = list.body["leases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["state"] == "held")
        .count();
    assert_eq!(held, 1000, "leases lost while being renewed");
    let calls = s
        .metric(
            "fencer_backend_request_duration_seconds_count",
            &[("op", "renew_many")],
        )
        .await
        - before_calls;
    let renewed = s
        .metric("fencer_renewals_total", &[("result", "renewed")])
        .await
        - before_renewed;
    eprintln!("{renewed} renewals in {calls} backend calls over 4.5 s");
    assert!(renewed >= 2_000.0, "only {renewed} renewals");
    assert!(
        calls * 20.0 <= renewed,
        "renewals not batched: {calls} calls for {renewed}"
    );
}

/// Voluntary context switches of every thread of `pid` so far: each time a
/// thread went to sleep, so a timer that wakes the process counts here.
fn wakeups(pid: u32) -> u64 {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let status =
            std::fs::read_to_string(task.unwrap().path().join("status")).unwrap_or_default();
        total += status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
    }
    total
}

/// A sidecar with nothing to renew sleeps: the renewer waits for the first
/// due renewal instead of a 10 ms tick (which woke an idle sidecar 100
/// times a second, 200+ wake-ups in this window). What is left is the
/// once-a-second health ping and the like. With auto-renewed leases it
/// still renews them (checked by the renewal tests above and the lock
/// suite's `auto_renew_follows_the_application`); here a lease acquired
/// after the quiet window shows the renewer wakes for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_sidecar_sleeps_and_still_renews() {
    let redis = RedisServer::start(Persistence::Off);
    let s = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    s.wait_ready();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = wakeups(s.pid());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle = wakeups(s.pid()) - before;
    assert!(
        idle < 100,
        "{idle} wake-ups of an idle sidecar in 2 s (a 10 ms tick makes 200+)"
    );
    let r = s
        .post(
            &Fencer::path("idle:renewed", "acquire"),
            json!({"ttl_ms": 300, "auto_renew": true, "keepalive_ms": 60_000}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // Five TTLs later it is still held: renewed at a third of its TTL.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let g = s
        .http
        .get(format!("{}{}", s.api, Fencer::path("idle:renewed", "")))
        .send()
        .await
        .unwrap();
    let body: serde_json::Value = g.json().await.unwrap();
    assert_eq!(body["state"], "held", "{body}\n{}", s.logs());
    println!("idle wake-ups in 2 s: {idle}");
}
