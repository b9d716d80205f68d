//! The gateway's MySQL/MariaDB fence store (issue 18) against a real
//! MariaDB that each test starts, kills, pauses and restarts: the
//! PostgreSQL store's promises, kept the same way (tests/fencing.rs,
//! tests/safety_regressions.rs, tests/hot_account_proof.rs).

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::mariadb::MariaDb;
use common::upstream::{Recorder, Seen};
use common::*;
use fencer::gateway::fence_store::mysql::{MyFenceOptions, MyFences};
use fencer::gateway::fence_store::{Decision, FenceError, FenceStore, Mode, Presented, Stamp};
use fencer::token::{Claim, Signer};
use rand::Rng;

fn sign(key: &str, token: u64, lease: &str) -> String {
    Signer::new("k1", SECRET.as_bytes()).sign(&Claim::new(key, token, lease))
}

/// A gateway on the MySQL fence store of `db`, in front of `upstream`.
fn my_gateway(upstream: &str, db: &MariaDb, extra: &[(&str, &str)]) -> Fencer {
    let url = db.url();
    let mut settings = vec![
        ("gateway.fence_store", "mysql"),
        ("gateway.mysql_url", url.as_str()),
    ];
    settings.extend_from_slice(extra);
    Fencer::gateway(upstream, &settings)
}

async fn put(client: &reqwest::Client, url: &str, headers: &[(&str, &str)]) -> Resp {
    send(client, "PUT", url, headers, Some("{}")).await
}

fn impatient(ms: u64) -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_millis(ms))
        .build()
        .unwrap()
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

/// The seeds' GC pause: 34 was accepted, so 33 is refused (409 with both
/// tokens), and so is 34 from another lease; sequences inside one lease
/// hold as on PostgreSQL; keys are compared byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_token_is_refused_after_a_newer_one() {
    let db = MariaDb::start();
    let upstream = Recorder::start().await;
    let g = my_gateway(&upstream.url(), &db, &[]);
    let client = reqwest::Client::new();
    let url = format!("{}/kv/acct-9", g.api);
    let w = put(
        &client,
        &url,
        &[("Fencing-Token", &sign("acct:9", 34, "b"))],
    )
    .await;
    assert_eq!(w.status, 200, "{}\n{}", w.body, g.logs());
    let old = put(
        &client,
        &url,
        &[("Fencing-Token", &sign("acct:9", 33, "a"))],
    )
    .await;
    assert_eq!(
        (old.status, old.code()),
        (409, "stale_fencing_token"),
        "{}",
        old.body
    );
    assert_eq!(old.body["token"], 33);
    assert_eq!(old.body["highest_seen"], 34);
    let other = put(
        &client,
        &url,
        &[("Fencing-Token", &sign("acct:9", 34, "c"))],
    )
    .await;
    assert_eq!((other.status, other.code()), (409, "stale_fencing_token"));
    // The holder of 34 writes on; the storage saw 34's writes only.
    let again = put(
        &client,
        &url,
        &[("Fencing-Token", &sign("acct:9", 34, "b"))],
    )
    .await;
    assert_eq!(again.status, 200, "{}", again.body);
    let tokens: Vec<_> = upstream.seen().iter().map(|s| s.token).collect();
    assert_eq!(tokens, vec![Some(34), Some(34)]);
    assert_eq!(
        db.sql("SELECT token, lease_tag, inflight_id IS NULL FROM fencer_fences WHERE fence_key = 'acct:9'")
            .trim(),
        format!("34\t{}\t1", fencer::token::lease_tag("b")),
        "the mark is stored and the stamp cleared"
    );

    // Sequences inside one lease (PITFALLS 5).
    let key = "acct:seq";
    let token = sign(key, 7, "lease-a");
    let seq_put = |seq: &'static str| {
        let (client, url, token) = (client.clone(), format!("{}/kv/seq", g.api), token.clone());
        async move {
            let mut h = vec![("Fencing-Token", token.as_str())];
            if !seq.is_empty() {
                h.push(("Fencing-Seq", seq));
            }
            put(&client, &url, &h).await
        }
    };
    assert_eq!(seq_put("1").await.status, 200);
    assert_eq!(seq_put("2").await.status, 200);
    let late = seq_put("1").await;
    assert_eq!((late.status, late.code()), (409, "stale_sequence"));
    assert_eq!(late.body["last_seq"], 2);
    let dup = seq_put("2").await;
    assert_eq!((dup.status, dup.code()), (409, "duplicate_sequence"));
    assert_eq!(seq_put("3").await.status, 200);
    assert_eq!(seq_put("").await.status, 200);
    let next = put(
        &client,
        &format!("{}/kv/seq", g.api),
        &[
            ("Fencing-Token", &sign(key, 8, "lease-b")),
            ("Fencing-Seq", "1"),
        ],
    )
    .await;
    assert_eq!(next.status, 200, "a new token starts its sequence afresh");

    // Keys are bytes: case and trailing spaces make other keys.
    for k in ["Case", "case", "case "] {
        let w = put(
            &client,
            &format!("{}/kv/x", g.api),
            &[("Fencing-Token", &sign(k, 1, "l"))],
        )
        .await;
        assert_eq!(w.status, 200, "{k:?}: {}", w.body);
    }
    assert_eq!(
        db.sql("SELECT COUNT(*) FROM fencer_fences WHERE fence_key IN ('Case', 'case', 'case ')")
            .trim(),
        "3"
    );
    let high = put(
        &client,
        &format!("{}/kv/x", g.api),
        &[("Fencing-Token", &sign("case", 9, "l"))],
    )
    .await;
    assert_eq!(high.status, 200);
    for k in ["Case", "case "] {
        let w = put(
            &client,
            &format!("{}/kv/x", g.api),
            &[("Fencing-Token", &sign(k, 2, "l"))],
        )
        .await;
        assert_eq!(w.status, 200, "{k:?} shares a mark with another key");
    }
    // The schema is InnoDB, binary keys, server-side times.
    assert_eq!(
        db.sql(
            "SELECT engine FROM information_schema.tables \
             WHERE table_schema = 'fencer' AND table_name = 'fencer_fences'"
        )
        .trim(),
        "InnoDB"
    );
}

/// A request with token 34 through replica B is not forwarded until 33's
/// request through replica A has finished at the (slow) upstream: A's
/// stamp keeps B waiting, not overtaking. The mark is shared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_one_mariadb_serialize_and_share_marks() {
    let db = MariaDb::start();
    let upstream = Recorder::start().await;
    let g1 = my_gateway(&upstream.url(), &db, &[]);
    let g2 = my_gateway(&upstream.url(), &db, &[]);
    let client = reqwest::Client::new();
    for round in 0..3u64 {
        // Tokens of this round only: 33 and 34, 43 and 44, 53 and 54.
        let key = format!("acct:s{round}");
        let (old, new) = (33 + 10 * round, 34 + 10 * round);
        let (t_old, t_new) = (sign(&key, old, "a"), sign(&key, new, "b"));
        let (u1, u2) = (format!("{}/x", g1.api), format!("{}/x", g2.api));
        let c1 = client.clone();
        let slow = tokio::spawn(async move {
            put(
                &c1,
                &u1,
                &[("Fencing-Token", &t_old), ("x-delay-ms", "600")],
            )
            .await
        });
        tokio::time::sleep(Duration::from_millis(150)).await;
        let fast = put(&client, &u2, &[("Fencing-Token", &t_new)]).await;
        assert_eq!(slow.await.unwrap().status, 200);
        assert_eq!(fast.status, 200, "{}", fast.body);
        applied_in_token_order(&upstream.seen(), old, new);
        // The older token again, after the newer: refused by either replica.
        for g in [&g1, &g2] {
            let late = put(
                &client,
                &format!("{}/x", g.api),
                &[("Fencing-Token", &sign(&key, old, "a"))],
            )
            .await;
            assert_eq!(late.code(), "stale_fencing_token", "{}", late.body);
        }
    }
    // B waited for A's request three times, and was let in each time.
    assert_eq!(
        g2.metric(
            "fencer_gateway_remote_waits_total",
            &[("result", "admitted")]
        )
        .await,
        3.0
    );
    assert!(g2.metric("fencer_gateway_mysql_polls_total", &[]).await >= 3.0);
    // A mark written through one replica holds at the other.
    let w = put(
        &client,
        &format!("{}/y", g1.api),
        &[("Fencing-Token", &sign("acct:y", 50, "a"))],
    )
    .await;
    assert_eq!(w.status, 200);
    let w = put(
        &client,
        &format!("{}/y", g2.api),
        &[("Fencing-Token", &sign("acct:y", 49, "z"))],
    )
    .await;
    assert_eq!((w.status, w.code()), (409, "stale_fencing_token"));
}

/// A gateway that crashes mid-forward leaves its stamp in the table: the
/// other replica stays off the key (503 fence_busy) until the stamp's hold
/// has run out, so the crashed replica's write lands first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_forward_keeps_other_replicas_off_the_key() {
    let db = MariaDb::start();
    let storage = Recorder::start().await;
    let extra = [
        ("gateway.upstream_timeout_ms", "3000"),
        ("gateway.uncertain_hold_ms", "500"),
        ("gateway.mysql_request_timeout_ms", "1000"),
    ];
    // Hold: connect 1000 + upstream 3000 + uncertain 500 + 2 × 1000 + 1000.
    let hold = Duration::from_millis(7_500);
    let mut gw_a = my_gateway(&storage.url(), &db, &extra);
    let gw_b = my_gateway(&storage.url(), &db, &extra);
    let client = reqwest::Client::new();
    let first = tokio::spawn({
        let (client, url) = (client.clone(), format!("{}/kv/acct-3", gw_a.api));
        async move {
            client
                .put(url)
                .header("Fencing-Token", sign("acct:3", 1, "lease-one"))
                .header("x-delay-ms", "2000")
                .body("a")
                .send()
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    let admitted_by = Instant::now();
    gw_a.kill();
    let _ = first.await;
    // The stamp is still there, with its whole hold ahead of it.
    let left_ms: i64 = db
        .sql(
            "SELECT TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), inflight_until) DIV 1000 \
             FROM fencer_fences WHERE fence_key = 'acct:3' AND inflight_id IS NOT NULL",
        )
        .trim()
        .parse()
        .expect("the killed gateway's stamp is in the table");
    assert!(left_ms > 5_000, "stamp runs out in {left_ms} ms");
    let url_b = format!("{}/kv/acct-3", gw_b.api);
    let mut busy = 0;
    loop {
        let w = put(
            &client,
            &url_b,
            &[("Fencing-Token", &sign("acct:3", 2, "lease-two"))],
        )
        .await;
        if w.status == 200 {
            break;
        }
        assert_eq!((w.status, w.code()), (503, "fence_busy"), "{}", w.body);
        busy += 1;
        assert!(
            admitted_by.elapsed() < Duration::from_secs(30),
            "key blocked for good"
        );
    }
    assert!(busy >= 1);
    assert!(
        admitted_by.elapsed() >= hold - Duration::from_millis(500),
        "replica B got in after {:?}, before the stamp's hold ran out",
        admitted_by.elapsed()
    );
    assert!(eventually(Duration::from_secs(5), || storage.seen().len() >= 2).await);
    applied_in_token_order(&storage.seen(), 1, 2);
    assert!(
        gw_b.metric(
            "fencer_gateway_remote_waits_total",
            &[("result", "timeout")]
        )
        .await
            >= 1.0
    );
}

/// Acknowledged marks survive a MariaDB `kill -9` (with the server's
/// `innodb_flush_log_at_trx_commit = 1`) and a gateway restart; while the
/// server is down, writes get a 503 JSON error at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marks_survive_a_mariadb_crash_and_a_gateway_restart() {
    let mut db = MariaDb::start();
    assert_eq!(
        db.sql("SELECT @@innodb_flush_log_at_trx_commit").trim(),
        "1"
    );
    let upstream = Recorder::start().await;
    let extra = [("gateway.mysql_request_timeout_ms", "1000")];
    let mut g = my_gateway(&upstream.url(), &db, &extra);
    let client = reqwest::Client::new();
    let url = format!("{}/kv/r", g.api);
    for k in 0..20u64 {
        let w = put(
            &client,
            &url,
            &[("Fencing-Token", &sign(&format!("acct:r{k}"), 34, "b"))],
        )
        .await;
        assert_eq!(w.status, 200, "{}", w.body);
    }
    // Each stamp is cleared just after its answer; a crash before that
    // leaves it to run out (another test covers that), so let them clear.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        db.sql("SELECT COUNT(*) FROM fencer_fences WHERE inflight_id IS NOT NULL")
            .trim(),
        "0"
    );
    db.kill();
    let started = Instant::now();
    let down = put(
        &client,
        &url,
        &[("Fencing-Token", &sign("acct:r0", 35, "c"))],
    )
    .await;
    assert_eq!(
        (down.status, down.code()),
        (503, "fence_store_unavailable"),
        "{}",
        down.body
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    db.restart();
    // The pool's old connections are dead; the store recovers by itself.
    let deadline = Instant::now() + Duration::from_secs(30);
    let stale = loop {
        let w = put(
            &client,
            &url,
            &[("Fencing-Token", &sign("acct:r0", 33, "a"))],
        )
        .await;
        if w.status != 503 {
            break w;
        }
        assert_eq!(w.code(), "fence_store_unavailable", "{}", w.body);
        assert!(Instant::now() < deadline, "the store did not recover");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        (stale.status, stale.code()),
        (409, "stale_fencing_token"),
        "{}",
        stale.body
    );
    assert_eq!(stale.body["highest_seen"], 34);
    tokio::time::sleep(Duration::from_millis(300)).await;
    g.kill();
    let g = my_gateway(&upstream.url(), &db, &extra);
    for k in 0..20u64 {
        let w = put(
            &client,
            &format!("{}/kv/r", g.api),
            &[("Fencing-Token", &sign(&format!("acct:r{k}"), 33, "a"))],
        )
        .await;
        assert_eq!(
            (w.status, w.code()),
            (409, "stale_fencing_token"),
            "acct:r{k}: {}",
            w.body
        );
    }
    // Every write the storage saw carried 34.
    assert!(upstream.seen().iter().all(|s| s.token == Some(34)));
}

/// A paused (SIGSTOP) server: a write gets 503 `fence_store_unavailable`
/// within the request timeout, never a hang; readiness says not ready
/// within the kubelet's second; both recover when it resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unavailable_store_answers_503_not_a_hang() {
    let db = MariaDb::start();
    let upstream = Recorder::start().await;
    let g = my_gateway(
        &upstream.url(),
        &db,
        &[("gateway.mysql_request_timeout_ms", "1000")],
    );
    let client = reqwest::Client::new();
    let url = format!("{}/kv/p", g.api);
    let w = put(&client, &url, &[("Fencing-Token", &sign("acct:p", 1, "a"))]).await;
    assert_eq!(w.status, 200);
    let ready = impatient(1_000)
        .get(format!("{}/readyz", g.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    // The first write's stamp is cleared after its answer; were the server
    // paused before that, the key's turn would wait for the clearing too.
    wait_until("the stamp to clear", Duration::from_secs(5), || {
        db.sql("SELECT COUNT(*) FROM fencer_fences WHERE inflight_id IS NOT NULL")
            .trim()
            == "0"
    });
    db.pause();
    let started = Instant::now();
    let w = put(&client, &url, &[("Fencing-Token", &sign("acct:p", 2, "b"))]).await;
    let took = started.elapsed();
    assert_eq!(
        (w.status, w.code()),
        (503, "fence_store_unavailable"),
        "{}",
        w.body
    );
    assert!(w.body["message"].is_string());
    assert!(took < Duration::from_secs(4), "answered after {took:?}");
    let started = Instant::now();
    let ready = impatient(2_000)
        .get(format!("{}/readyz", g.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    assert!(started.elapsed() < Duration::from_millis(1_000));
    db.resume();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let w = put(&client, &url, &[("Fencing-Token", &sign("acct:p", 3, "c"))]).await;
        if w.status == 200 {
            break;
        }
        assert_eq!(w.code(), "fence_store_unavailable", "{}", w.body);
        assert!(Instant::now() < deadline, "the store did not recover");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Token 2 was never forwarded; no stamp was left behind by the
    // abandoned call (the next write went through above).
    assert!(upstream.seen().iter().all(|s| s.token != Some(2)));
}

/// A request that gives up while it waits for another replica's request
/// leaves nothing behind: both replicas take the next write at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_giving_up_on_a_busy_key_leaves_no_lock_behind() {
    let db = MariaDb::start();
    let storage = Recorder::start().await;
    let extra = [("gateway.serialize_timeout_ms", "2000")];
    let gw_a = my_gateway(&storage.url(), &db, &extra);
    let gw_b = my_gateway(&storage.url(), &db, &extra);
    let url = |g: &Fencer| format!("{}/kv/acct-5", g.api);
    let client = reqwest::Client::new();
    let first = tokio::spawn({
        let (client, u) = (client.clone(), url(&gw_a));
        async move {
            put(
                &client,
                &u,
                &[
                    ("Fencing-Token", &sign("acct:5", 1, "l1")),
                    ("x-delay-ms", "1500"),
                ],
            )
            .await
            .status
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let gave_up = impatient(300)
        .put(url(&gw_b))
        .header("Fencing-Token", sign("acct:5", 2, "l2"))
        .body("b")
        .send()
        .await;
    assert!(gave_up.is_err());
    assert_eq!(first.await.unwrap(), 200);
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (i, g) in [&gw_b, &gw_a].into_iter().enumerate() {
        let started = Instant::now();
        let w = put(
            &client,
            &url(g),
            &[("Fencing-Token", &sign("acct:5", 3 + i as u64, "l3"))],
        )
        .await;
        assert_eq!(w.status, 200, "replica {i}: {}", w.body);
        assert!(started.elapsed() < Duration::from_millis(1_000));
    }
    applied_in_token_order(&storage.seen(), 1, 3);
}

/// `/readyz` opens its own connection: it answers within the kubelet's
/// second while slow requests hold every pooled one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_answers_while_the_store_is_busy() {
    let db = MariaDb::start();
    let storage = Recorder::start().await;
    let gateway = my_gateway(&storage.url(), &db, &[("gateway.mysql_pool_size", "2")]);
    let client = reqwest::Client::new();
    let mut slow = Vec::new();
    for k in 0..4 {
        let (client, url) = (client.clone(), format!("{}/kv/slow{k}", gateway.api));
        slow.push(tokio::spawn(async move {
            put(
                &client,
                &url,
                &[
                    ("Fencing-Token", &sign(&format!("slow{k}"), 1, "l")),
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
        assert_eq!(s.await.unwrap().status, 200);
    }
}

// ------------------------------------------------------ the hot account

const WORKERS: usize = 8;
const TTL_MS: u64 = 300;
const CYCLES: u64 = 40;
const MIN_PAUSES: u64 = 20;
const MAX_PAUSES: u64 = 32;

fn signal(pid: u32, sig: i32) {
    unsafe {
        libc::kill(pid as i32, sig);
    }
}

#[derive(Debug, Default)]
struct Outcome {
    pauses: u64,
    stale: u64,
    lease_lost: u64,
    logged_writes: u64,
    balance: i64,
    tokens_in_order: bool,
    remote_waits: f64,
}

/// The seeds' hot account (tests/hot_account_proof.rs): eight worker
/// processes increment one balance (acquire → read → +1 → write →
/// release, TTL 300 ms) through two gateway replicas sharing the MariaDB
/// fence store, Redis locks; some workers are SIGSTOPped between read and
/// write past their TTL. Half write through their sidecar's proxy, half
/// carry their token to a gateway themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hot_account_through_two_replicas_loses_no_update() {
    let db = MariaDb::start();
    let redis = RedisServer::start(Persistence::Off);
    let storage = Fencer::storage(&[]);
    let key = "account:hot";
    let path = "accounts/hot";
    let gateways: Vec<Fencer> = (0..2)
        .map(|_| my_gateway(&storage.api, &db, &[("gateway.uncertain_hold_ms", "500")]))
        .collect();
    let mut sidecars = Vec::new();
    for i in 0..WORKERS {
        let gw = &gateways[i % 2];
        let pre = format!("{}/_fencer/v1/fences/", gw.api);
        sidecars.push(Fencer::sidecar(
            Backend::Redis,
            Some(&redis.url()),
            &[
                ("proxy.upstream", gw.api.as_str()),
                ("backend.redis.request_timeout_ms", "2000"),
                ("sidecar.preregister_url", pre.as_str()),
            ],
        ));
    }
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let mut workers: Vec<Child> = Vec::new();
    for (i, sc) in sidecars.iter().enumerate() {
        let via_proxy = i % 2 == 0;
        let target = if via_proxy {
            sc.proxy.clone()
        } else {
            gateways[(i / 2) % 2].api.clone()
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_fencer"))
            .args(["hot-account-worker", "--api", &sc.api, "--target", &target])
            .args(["--via", if via_proxy { "proxy" } else { "gateway" }])
            .args(["--key", key, "--path", path])
            .args(["--ttl-ms", &TTL_MS.to_string()])
            .args(["--cycles", &CYCLES.to_string(), "--think-ms", "15"])
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send((i, line));
            }
            let _ = tx.send((i, "EOF".into()));
        });
        workers.push(child);
    }
    drop(tx);

    let mut o = Outcome::default();
    let mut paused_until: Vec<Option<Instant>> = vec![None; WORKERS];
    let mut finished = 0;
    let started = Instant::now();
    let mut rng = rand::rng();
    while finished < WORKERS {
        assert!(
            started.elapsed() < Duration::from_secs(240),
            "the workload hung"
        );
        for (i, until) in paused_until.iter_mut().enumerate() {
            if until.is_some_and(|t| Instant::now() >= t) {
                signal(workers[i].id(), libc::SIGCONT);
                *until = None;
            }
        }
        let Ok((i, line)) = rx.recv_timeout(Duration::from_millis(5)) else {
            continue;
        };
        let mut words = line.split_whitespace();
        match (words.next(), words.next()) {
            (Some("READ"), _)
                if o.pauses < MAX_PAUSES && paused_until[i].is_none() && rng.random_bool(0.15) =>
            {
                signal(workers[i].id(), libc::SIGSTOP);
                let factor = if rng.random_bool(0.7) {
                    rng.random_range(1.0..1.25)
                } else {
                    rng.random_range(1.5..3.0)
                };
                paused_until[i] =
                    Some(Instant::now() + Duration::from_millis(TTL_MS).mul_f64(factor));
                o.pauses += 1;
            }
            (Some("WRITE"), Some("stale")) => o.stale += 1,
            (Some("WRITE"), Some("lease_lost")) => o.lease_lost += 1,
            (Some("EOF"), _) => finished += 1,
            _ => {}
        }
    }
    for mut w in workers {
        signal(w.id(), libc::SIGCONT);
        let _ = w.wait();
    }
    let client = reqwest::Client::new();
    let log = send(
        &client,
        "GET",
        &format!("{}/_log/{path}", storage.api),
        &[],
        None,
    )
    .await;
    let tokens: Vec<u64> = log.body["writes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["token"].as_u64().unwrap_or(0))
        .collect();
    o.logged_writes = tokens.len() as u64;
    o.tokens_in_order = tokens.windows(2).all(|w| w[0] <= w[1]);
    let value = send(
        &client,
        "GET",
        &format!("{}/kv/{path}", storage.api),
        &[],
        None,
    )
    .await;
    o.balance = value.body["value"]["balance"].as_i64().unwrap_or(0);
    for g in &gateways {
        o.remote_waits += g
            .metric(
                "fencer_gateway_remote_waits_total",
                &[("result", "admitted")],
            )
            .await;
    }
    eprintln!(
        "mysql hot account: {o:?}, lost updates {}",
        o.logged_writes as i64 - o.balance
    );
    assert!(o.pauses >= MIN_PAUSES, "only {} pauses injected", o.pauses);
    assert!(o.logged_writes > 0);
    assert!(
        o.tokens_in_order,
        "an accepted write carried a lower token than an earlier one: {tokens:?}"
    );
    assert_eq!(
        o.logged_writes as i64 - o.balance,
        0,
        "lost updates with fencing on: {o:?}"
    );
    assert!(o.stale > 0, "no stale write reached a gateway: {o:?}");
    // The mark is the highest token the storage saw.
    let mark: u64 = db
        .sql(&format!(
            "SELECT token FROM fencer_fences WHERE fence_key = '{key}'"
        ))
        .trim()
        .parse()
        .unwrap();
    assert!(mark >= *tokens.last().unwrap());
}

// ------------------------------------------------- the store by itself

async fn store_on(db: &MariaDb) -> MyFences {
    MyFences::connect(&MyFenceOptions {
        url: &db.url(),
        ca_file: None,
        pool_size: 4,
        request_timeout: Duration::from_secs(2),
        startup: Duration::from_secs(10),
    })
    .await
    .unwrap()
}

fn soon(ms: u64) -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_millis(ms)
}

fn stamp(id: &str, hold_ms: u64) -> Stamp {
    Stamp {
        id: id.into(),
        hold: Duration::from_millis(hold_ms),
    }
}

/// The stored procedure decides every case as [`decide`] does (the
/// memory store's rule), and moves the mark only when it should.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_procedure_applies_the_decision_rule() {
    let db = MariaDb::start();
    let store = store_on(&db).await;
    // A second start against the complete schema creates nothing.
    let again = store_on(&db).await;
    assert!(again.ping().await.is_ok());
    common::fence_rules::check_rule_table(&store).await;
    // A table of the previous version (no read mark) is brought up to date
    // by the next start, its write marks kept.
    db.sql(
        "ALTER TABLE fencer_fences DROP CONSTRAINT fencer_fences_read_token_not_negative, \
         DROP COLUMN read_token",
    );
    let upgraded = store_on(&db).await;
    let old = upgraded
        .admit(
            "case-1",
            Presented::new(4, "x", None, Mode::Write),
            None,
            soon(2_000),
        )
        .await
        .unwrap();
    assert_eq!(old.decision, Decision::Stale { highest: 5 });
    let reader = upgraded
        .admit(
            "case-1",
            Presented::new(10, "r", None, Mode::Read),
            None,
            soon(2_000),
        )
        .await
        .unwrap();
    assert_eq!(reader.decision, Decision::Advanced);
    assert_eq!(store.highest("never-seen").await.unwrap(), None);
    // Tokens above the database's range are refused, never wrapped.
    assert!(matches!(
        store
            .admit(
                "big",
                Presented::new(u64::MAX, "a", None, Mode::Write),
                None,
                soon(500)
            )
            .await,
        Err(FenceError::Unavailable(_))
    ));
    assert_eq!(store.highest("big").await.unwrap(), None);
}

/// A stamp keeps other requests off its key until it is cleared — by its
/// own id only — or runs out; the request that owns it may ask again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stamp_holds_the_key_until_cleared_by_its_owner_or_run_out() {
    let db = MariaDb::start();
    let store = store_on(&db).await;
    let a = stamp("stamp-a", 30_000);
    let first = store
        .admit(
            "k",
            Presented::new(1, "l1", None, Mode::Write),
            Some(&a),
            soon(1_000),
        )
        .await
        .unwrap();
    assert_eq!(first.decision, Decision::Advanced);
    // The same request asking again (same stamp id) is not its own obstacle.
    let retry = store
        .admit(
            "k",
            Presented::new(1, "l1", None, Mode::Write),
            Some(&a),
            soon(1_000),
        )
        .await
        .unwrap();
    assert_eq!(retry.decision, Decision::Same);
    let started = std::time::Instant::now();
    let busy = store
        .admit(
            "k",
            Presented::new(2, "l2", None, Mode::Write),
            Some(&stamp("stamp-b", 30_000)),
            soon(300),
        )
        .await;
    assert!(matches!(busy, Err(FenceError::Busy)), "{busy:?}");
    assert!(started.elapsed() >= Duration::from_millis(290));
    // Even a stale request waits: the in-flight write decides first.
    let stale = store
        .admit(
            "k",
            Presented::new(0, "l0", None, Mode::Write),
            None,
            soon(100),
        )
        .await;
    assert!(matches!(stale, Err(FenceError::Busy)), "{stale:?}");
    // Another request's id clears nothing.
    store.finish("k", "stamp-b").await.unwrap();
    store.finish("other-key", "stamp-a").await.unwrap();
    assert!(matches!(
        store
            .admit(
                "k",
                Presented::new(2, "l2", None, Mode::Write),
                Some(&stamp("stamp-b", 30_000)),
                soon(200)
            )
            .await,
        Err(FenceError::Busy)
    ));
    store.finish("k", "stamp-a").await.unwrap();
    let next = store
        .admit(
            "k",
            Presented::new(2, "l2", None, Mode::Write),
            Some(&stamp("stamp-b", 400)),
            soon(1_000),
        )
        .await
        .unwrap();
    assert_eq!(
        (next.decision, next.previous),
        (Decision::Advanced, Some(1))
    );
    // stamp-b is never cleared: it runs out after 400 ms, and a waiter is
    // let in then, well before its 5 s deadline.
    let started = std::time::Instant::now();
    let after = store
        .admit(
            "k",
            Presented::new(3, "l3", None, Mode::Write),
            None,
            soon(5_000),
        )
        .await
        .unwrap();
    assert_eq!(after.decision, Decision::Advanced);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_millis(1_500),
        "waited {waited:?}"
    );
    // Nothing is left in flight.
    assert_eq!(
        db.sql("SELECT COUNT(*) FROM fencer_fences WHERE inflight_until > UTC_TIMESTAMP(6)")
            .trim(),
        "0"
    );
}
