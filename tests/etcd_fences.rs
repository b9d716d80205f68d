//! The gateway's fence store on etcd (`gateway.fence_store = "etcd"`,
//! issue 34 item 2) against real members: the decision rule, two replicas
//! on one cluster serialized by in-flight stamps, the stamp of a replica
//! that died mid-forward (never cleared before its hold, cleared after it),
//! marks that survive the leader's kill, and no stamp written on a session
//! lease whose keepalives fail once it may end within the stamp's hold. Every test starts its own
//! members (tests/common/etcd.rs).

mod common;

use std::time::Duration;

use common::etcd::EtcdCluster;
use fencer::etcd::wire::b64;
use fencer::etcd::{ClientConfig, EtcdClient};
use fencer::gateway::fence_store::etcd::{EtcdFenceOptions, EtcdFences};
use fencer::gateway::fence_store::{Decision, FenceError, FenceStore, Mode, Presented, Stamp};
use tokio::time::Instant;

async fn store(etcd: &EtcdCluster, hold: Duration) -> EtcdFences {
    store_at(etcd.endpoints(), hold, Duration::from_secs(2)).await
}

async fn store_at(endpoints: Vec<String>, hold: Duration, request_timeout: Duration) -> EtcdFences {
    let client = EtcdClient::new(&ClientConfig {
        endpoints,
        connect_timeout: Duration::from_millis(500),
        credentials: None,
        tls: Default::default(),
    })
    .unwrap();
    EtcdFences::connect(EtcdFenceOptions {
        client,
        prefix: "/fencer".into(),
        request_timeout,
        stamp_hold: hold,
        startup: Duration::from_secs(10),
    })
    .await
    .unwrap()
}

fn write(token: u64, lease: &str, seq: u64) -> Presented<'_> {
    Presented::new(token, lease, Some(seq), Mode::Write)
}

fn stamp(id: &str, hold: Duration) -> Stamp {
    Stamp {
        id: id.into(),
        hold,
    }
}

fn within(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms)
}

/// `fencer_gateway_etcd_events_total{event}` in `registry`.
fn events(registry: &prometheus::Registry, event: &str) -> f64 {
    let family = registry.gather();
    let f = family
        .iter()
        .find(|f| f.name() == "fencer_gateway_etcd_events_total")
        .expect("registered");
    f.get_metric()
        .iter()
        .find(|m| m.get_label().iter().any(|l| l.value() == event))
        .map(|m| m.get_counter().value())
        .expect("every event is exported from the start")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_decides_every_case_as_the_rule_does() {
    let etcd = EtcdCluster::with_size(1);
    let s = store(&etcd, Duration::from_secs(5)).await;
    common::fence_rules::check_rule_table(&s).await;
    assert_eq!(
        s.highest("case-1").await.unwrap(),
        Some((5, "a".to_owned()))
    );
    assert_eq!(s.highest("never").await.unwrap(), None);
}

/// Two replicas on one cluster: while one has a request in flight on a
/// key, the other waits — woken when the first clears its stamp, or
/// refused `Busy` at its deadline — and then decides on the mark the
/// first left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_take_turns_on_a_key() {
    let etcd = EtcdCluster::with_size(1);
    let hold = Duration::from_secs(20);
    let (a, b) = (store(&etcd, hold).await, store(&etcd, hold).await);
    let first = a
        .admit(
            "k",
            write(5, "x", 1),
            Some(&stamp("a1", hold)),
            within(2_000),
        )
        .await
        .unwrap();
    assert_eq!(first.decision, Decision::Advanced);
    // b waits for a's stamp; at its deadline, Busy.
    let t = Instant::now();
    let busy = b
        .admit("k", write(6, "y", 1), Some(&stamp("b1", hold)), within(500))
        .await;
    assert!(matches!(busy, Err(FenceError::Busy)), "{busy:?}");
    assert!(
        t.elapsed() >= Duration::from_millis(450),
        "{:?}",
        t.elapsed()
    );
    // b waits again; a's finish lets it in at once, on a's mark.
    let b = std::sync::Arc::new(b);
    let b2 = b.clone();
    let waiter = tokio::spawn(async move {
        let r = b2
            .admit(
                "k",
                write(5, "z", 1),
                Some(&stamp("b2", hold)),
                within(10_000),
            )
            .await;
        (r, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "b got in past a's stamp");
    let finished = Instant::now();
    a.finish("k", "a1").await.unwrap();
    let (r, at) = waiter.await.unwrap();
    assert_eq!(r.unwrap().decision, Decision::Stale { highest: 5 });
    assert!(
        at - finished < Duration::from_millis(1_000),
        "woken {:?} after the finish",
        at - finished
    );
    // A refused request leaves no stamp: a finds the key free.
    let next = a
        .admit(
            "k",
            write(6, "y", 1),
            Some(&stamp("a2", hold)),
            within(1_000),
        )
        .await
        .unwrap();
    assert_eq!(next.decision, Decision::Advanced);
    a.finish("k", "a2").await.unwrap();
    // Another replica's finish of a stamp that is not its own clears
    // nothing.
    a.admit(
        "k",
        write(6, "y", 2),
        Some(&stamp("a3", hold)),
        within(1_000),
    )
    .await
    .unwrap();
    b.finish("k", "b-other").await.unwrap();
    assert!(matches!(
        b.admit("k", write(7, "w", 1), None, within(300)).await,
        Err(FenceError::Busy)
    ));
}

/// A replica that dies mid-forward (here: dropped with its stamp in
/// place, its session lease no longer kept alive) keeps the key for the
/// stamp's hold — the write it forwarded may still land — and no longer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_replicas_stamp_holds_the_key_for_its_hold_and_no_longer() {
    let etcd = EtcdCluster::with_size(1);
    let hold = Duration::from_millis(2_000);
    let a = store(&etcd, hold).await;
    let b = store(&etcd, hold).await;
    let admitted_at = Instant::now();
    a.admit(
        "d",
        write(5, "x", 1),
        Some(&stamp("a1", hold)),
        within(2_000),
    )
    .await
    .unwrap();
    drop(a);
    let r = b
        .admit(
            "d",
            write(6, "y", 1),
            Some(&stamp("b1", hold)),
            within(10_000),
        )
        .await
        .unwrap();
    let waited = admitted_at.elapsed();
    assert_eq!(r.decision, Decision::Advanced);
    assert!(
        waited >= hold,
        "the key moved {waited:?} after the admit: before its {hold:?} hold"
    );
    assert!(
        waited < hold + Duration::from_millis(1_500),
        "the dead replica's stamp held the key {waited:?}"
    );
}

/// The leader killed while a replica admits: admissions resume once a new
/// leader is elected, and the mark never goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marks_survive_the_leaders_kill() {
    let mut etcd = EtcdCluster::start();
    let hold = Duration::from_secs(5);
    let s = store(&etcd, hold).await;
    let mut last = 0;
    let mut killed = None;
    for token in 1..=40u64 {
        if token == 15 {
            killed = Some(etcd.kill_leader());
        }
        // A call that meets the election may fail: the client's request
        // fails with it, and the next token tries again.
        match s
            .admit("m", write(token, "l", 1), None, within(3_000))
            .await
        {
            Ok(a) => {
                assert_eq!(a.decision, Decision::Advanced, "token {token}");
                assert_eq!(a.previous.unwrap_or(0), last, "token {token}");
                last = token;
            }
            Err(e) => eprintln!("token {token}: {e}"),
        }
    }
    let (_, at) = killed.unwrap();
    eprintln!(
        "leader killed {:?} ago; last token admitted {last}",
        at.elapsed()
    );
    assert_eq!(last, 40);
    assert_eq!(s.highest("m").await.unwrap(), Some((40, "l".to_owned())));
    let stale = s
        .admit("m", write(39, "old", 1), None, within(3_000))
        .await
        .unwrap();
    assert_eq!(stale.decision, Decision::Stale { highest: 40 });
}

/// Replicas racing on one key (no stamps: every admission a
/// compare-and-swap of the mark): each mark is superseded by exactly one
/// advance — two advances from the same mark mean one overwrote the other
/// (a lost update) — and the mark ends at the highest token advanced.
/// Mutant `etcd_mark_blind_write` (no compare) fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_replicas_never_lose_an_advance() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let etcd = EtcdCluster::with_size(1);
    let hold = Duration::from_secs(5);
    let registry = prometheus::Registry::new();
    let waits =
        prometheus::IntCounterVec::new(prometheus::Opts::new("w", "w"), &["result"]).unwrap();
    let replicas = [
        Arc::new(
            store(&etcd, hold)
                .await
                .with_metrics(waits.clone(), &registry),
        ),
        Arc::new(store(&etcd, hold).await),
    ];
    let next = Arc::new(AtomicU64::new(1));
    let tasks: Vec<_> = (0..12)
        .map(|i| {
            let (s, next) = (replicas[i % 2].clone(), next.clone());
            tokio::spawn(async move {
                let mut advances = Vec::new();
                for _ in 0..30 {
                    let token = next.fetch_add(1, Ordering::SeqCst);
                    let a = s
                        .admit("race", write(token, "l", 1), None, within(5_000))
                        .await
                        .unwrap();
                    if a.decision == Decision::Advanced {
                        advances.push((a.previous.unwrap_or(0), token));
                    }
                }
                advances
            })
        })
        .collect();
    let mut advances = Vec::new();
    for t in tasks {
        advances.extend(t.await.unwrap());
    }
    advances.sort_unstable();
    for pair in advances.windows(2) {
        assert_ne!(
            pair[0].0, pair[1].0,
            "two advances from mark {}: to {} and to {} (a lost update)",
            pair[0].0, pair[0].1, pair[1].1
        );
    }
    let highest = advances.iter().map(|a| a.1).max().unwrap();
    let (mark, _) = replicas[0].highest("race").await.unwrap().unwrap();
    assert_eq!(mark, highest, "the mark went down");
    // The races were real: replica 0 lost some compare-and-swaps.
    let conflicts = events(&registry, "cas_conflict");
    eprintln!("replica 0 lost {conflicts} compare-and-swaps");
    assert!(conflicts >= 1.0);
}

/// Two gateway replicas with `gateway.fence_store = "etcd"` on a
/// 3-member cluster: a write accepted by one fences an older token at the
/// other, through a kill of etcd's leader, and a new gateway finds the
/// marks where the others left them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_replicas_share_their_marks_on_etcd_through_a_leader_kill() {
    use common::upstream::Recorder;
    use common::*;
    use fencer::token::{Claim, Signer};
    let sign = |token: u64, lease: &str| {
        Signer::new("k1", SECRET.as_bytes()).sign(&Claim::new("acct:e", token, lease))
    };
    let mut etcd = EtcdCluster::start();
    let upstream = Recorder::start().await;
    let endpoints = etcd.endpoints().join(",");
    let extra = [
        ("gateway.fence_store", "etcd"),
        ("gateway.etcd_endpoints", endpoints.as_str()),
    ];
    let (a, b) = (
        Fencer::gateway(&upstream.url(), &extra),
        Fencer::gateway(&upstream.url(), &extra),
    );
    let client = reqwest::Client::new();
    let put = |g: &Fencer, token: u64, lease: &str| {
        let url = format!("{}/e", g.api);
        let header = sign(token, lease);
        let client = client.clone();
        async move {
            send(
                &client,
                "PUT",
                &url,
                &[("Fencing-Token", header.as_str())],
                Some("{}"),
            )
            .await
        }
    };
    assert_eq!(put(&a, 10, "x").await.status, 200);
    let stale = put(&b, 9, "w").await;
    assert_eq!(
        (stale.status, stale.code()),
        (409, "stale_fencing_token"),
        "{}",
        stale.body
    );
    etcd.kill_leader();
    // The election takes a moment: a request that meets it is refused
    // (503), never let through unchecked.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let w = put(&b, 11, "y").await;
        if w.status == 200 {
            break;
        }
        assert_eq!(w.status, 503, "{}", w.body);
        assert!(std::time::Instant::now() < deadline, "{}", w.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stale = put(&a, 10, "x").await;
    assert_eq!(stale.code(), "stale_fencing_token", "{}", stale.body);
    assert_eq!(stale.body["highest_seen"], 11, "{}", stale.body);
    let c = Fencer::gateway(&upstream.url(), &extra);
    let stale = put(&c, 10, "x").await;
    assert_eq!(stale.body["highest_seen"], 11, "{}", stale.body);
    assert_eq!(
        c.metric("fencer_gateway_fence_store_up", &[("store", "etcd")])
            .await,
        1.0
    );
}

/// The session lease ended under a live gateway (here revoked from
/// outside, as an expiry during a partition would end it): its stamps went
/// with it, the keepalive finds it gone and opens a new one
/// (`session_replaced`), and stamps are written on the new lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_lease_that_ran_out_is_replaced() {
    let etcd = EtcdCluster::with_size(1);
    let hold = Duration::from_secs(5);
    let registry = prometheus::Registry::new();
    let waits =
        prometheus::IntCounterVec::new(prometheus::Opts::new("w", "w"), &["result"]).unwrap();
    let s = store(&etcd, hold).await.with_metrics(waits, &registry);
    s.admit(
        "s",
        write(1, "l", 1),
        Some(&stamp("s1", hold)),
        within(2_000),
    )
    .await
    .unwrap();
    let port = etcd.ports()[0];
    let (code, leases) = common::etcd::post_json(port, "/v3/lease/leases", "{}").unwrap();
    assert_eq!(code, 200, "{leases}");
    let leases: serde_json::Value = serde_json::from_str(&leases).unwrap();
    for l in leases["leases"].as_array().unwrap() {
        let id = l["ID"].as_str().unwrap();
        let (code, text) =
            common::etcd::post_json(port, "/v3/lease/revoke", &format!(r#"{{"ID":"{id}"}}"#))
                .unwrap();
        assert_eq!(code, 200, "{text}");
    }
    // The stamp went with the lease: the key is free at once.
    let replaced = || events(&registry, "session_replaced");
    let deadline = Instant::now() + Duration::from_secs(5);
    while replaced() < 1.0 {
        assert!(Instant::now() < deadline, "the session was not replaced");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let next = s
        .admit(
            "s",
            write(2, "l", 1),
            Some(&stamp("s2", hold)),
            within(2_000),
        )
        .await
        .unwrap();
    assert_eq!(next.decision, Decision::Advanced);
    // The new stamp holds: another admission waits for it.
    assert!(matches!(
        s.admit("s", write(3, "m", 1), None, within(300)).await,
        Err(FenceError::Busy)
    ));
}

/// Whether `key`'s in-flight stamp is in etcd (read directly).
fn stamp_present(etcd: &EtcdCluster, key: &str) -> bool {
    let k = format!("/fencer/fence/stamps/{key}");
    let body = serde_json::json!({"key": b64(k.as_bytes()), "count_only": true});
    let (code, text) =
        common::etcd::post_json(etcd.ports()[0], "/v3/kv/range", &body.to_string()).unwrap();
    assert_eq!(code, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["count"].as_str() == Some("1")
}

/// A stamp must outlive its hold (the time by which its forwarded write
/// has landed or died), so it is written only on a session lease known to
/// last that long. Here every keepalive of the session is held back by a
/// proxy in front of the member while other calls pass: the lease runs out
/// on etcd's clock. The gateway admits stamped writes every 100 ms on new
/// keys and never finishes them; every stamp it wrote must still be in
/// etcd until its hold, counted from the admission's answer, is over.
/// Admissions are refused instead once the lease is not known to last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_stamp_is_written_on_a_session_lease_that_may_end_within_its_hold() {
    let etcd = EtcdCluster::with_size(1);
    let proxy = common::tcp_fault::TcpFault::start(etcd.ports()[0]);
    let hold = Duration::from_secs(2);
    let timeout = Duration::from_millis(500);
    let s = store_at(
        vec![format!("http://127.0.0.1:{}", proxy.port)],
        hold,
        timeout,
    )
    .await;
    for _ in 0..40 {
        proxy.delay_request_to(b"/v3/lease/keepalive", Duration::from_secs(60));
    }
    // The session's TTL is hold + timeout + 3 s, rounded up: 6 s.
    let end = Instant::now() + Duration::from_secs(6) + hold + Duration::from_secs(1);
    let mut admitted: Vec<(String, Instant)> = Vec::new();
    let (mut refused, mut early) = (0, Vec::new());
    let mut n = 0;
    while Instant::now() < end {
        if admitted.len() + refused < 60 {
            n += 1;
            let key = format!("g{n}");
            match s
                .admit(
                    &key,
                    write(1, "l", 1),
                    Some(&stamp(&key, hold)),
                    within(1_000),
                )
                .await
            {
                Ok(a) => {
                    assert_eq!(a.decision, Decision::Advanced);
                    admitted.push((key, Instant::now()));
                }
                Err(FenceError::Unavailable(_)) => refused += 1,
                Err(e) => panic!("{key}: {e:?}"),
            }
        }
        let now = Instant::now();
        for (key, at) in &admitted {
            if now < *at + hold && !stamp_present(&etcd, key) && !early.contains(key) {
                early.push(key.clone());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(proxy.requests_held() > 0, "no keepalive was held back");
    assert!(
        !admitted.is_empty(),
        "nothing admitted while the lease lasted"
    );
    assert!(refused > 0, "admissions went on to the lease's end");
    assert!(
        early.is_empty(),
        "{} of {} stamps went before their hold was over ({early:?}): written on a lease that ended first",
        early.len(),
        admitted.len()
    );
}
