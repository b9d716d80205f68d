//! The behavioural suite every lock backend must pass.
//!
//! Each scenario is a plain async function taking a [`Backend`]; the
//! `suite!` macro at the bottom instantiates all of them once per backend,
//! so a new backend plugs in with one line. Redis runs in all three
//! topologies: single, Sentinel and Cluster.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use common::etcd::EtcdCluster;
use common::mariadb::MariaDb;
use common::postgres::PgServer;
use common::redis_topology::{ClusterSet, SentinelOpts, SentinelSet};
use common::shared::{self, unique_name, MyDb, PgDb, Server};
use common::zookeeper::ZooKeeperEnsemble;
use common::*;
use redis::Commands;
use serde_json::json;

/// A sidecar on `backend`, plus a Redis the test owns (the lock backend when
/// `backend` is single Redis; otherwise just the shared data store of the
/// test), and the Sentinel set or Cluster behind a topology backend.
///
/// The heavier servers (PostgreSQL, MariaDB, ZooKeeper, the Sentinel set,
/// the Cluster) are shared by the tests of this binary, each test in its
/// own database, key prefix or ZooKeeper root (see `common::shared`); the
/// scenarios that call [`harness_own`] start their own. The single Redis and RedLock's
/// masters are per test: they start in tens of milliseconds.
struct Harness {
    redis: RedisServer,
    pg: Option<PgDb>,
    sentinel: Option<Server<SentinelSet>>,
    cluster: Option<Server<ClusterSet>>,
    /// RedLock's independent masters.
    masters: Vec<RedisServer>,
    /// A one-server ZooKeeper "ensemble" (leader changes have their own
    /// tests in tests/zookeeper.rs).
    _zk: Option<Server<ZooKeeperEnsemble>>,
    _mysql: Option<MyDb>,
    _etcd: Option<Server<EtcdCluster>>,
    sidecar: Fencer,
    /// What started `sidecar`, for [`Harness::another`].
    started_with: (Backend, Option<String>, Vec<(String, String)>),
}

impl Harness {
    /// A second sidecar on the same backend and settings (another pod).
    fn another(&self) -> Fencer {
        let (backend, url, settings) = &self.started_with;
        let all: Vec<(&str, &str)> = settings
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let sidecar = Fencer::sidecar(*backend, url.as_deref(), &all);
        if !matches!(backend, Backend::Memory | Backend::Redis) {
            sidecar.wait_ready();
        }
        sidecar
    }
}

/// A harness on the binary's shared servers (unless `FENCER_TEST_SHARED=0`).
fn harness(backend: Backend, extra: &[(&str, &str)]) -> Harness {
    harness_with(backend, extra, shared::enabled())
}

/// A harness on servers of its own: for the scenarios that look at
/// everything left in the lock backend after the sidecar stops (every key
/// of the server, which other tests' keys would fill): the `shutdown_*`
/// ones.
fn harness_own(backend: Backend, extra: &[(&str, &str)]) -> Harness {
    harness_with(backend, extra, false)
}

fn harness_with(backend: Backend, extra: &[(&str, &str)], share: bool) -> Harness {
    let redis = RedisServer::start(Persistence::Off);
    let pg = (backend == Backend::Postgres).then(|| match share {
        true => PgDb::shared(),
        false => PgDb::own(PgServer::start()),
    });
    // The topologies production runs: a master with two replicas and three
    // sentinels; three masters with a replica each.
    let sentinel = (backend == Backend::RedisSentinel).then(|| match share {
        true => Server::Shared(shared::sentinel()),
        false => Server::Own(SentinelSet::start(SentinelOpts::default())),
    });
    let cluster = (backend == Backend::RedisCluster).then(|| match share {
        true => Server::Shared(shared::cluster()),
        false => Server::Own(ClusterSet::start(3, 1)),
    });
    let masters: Vec<RedisServer> = if backend == Backend::RedLock {
        (0..5)
            .map(|_| RedisServer::start(Persistence::Off))
            .collect()
    } else {
        Vec::new()
    };
    let zk = (backend == Backend::ZooKeeper).then(|| match share {
        true => Server::Shared(shared::zookeeper()),
        false => Server::Own(ZooKeeperEnsemble::with_size(1)),
    });
    let mysql = (backend == Backend::MySql).then(|| match share {
        true => MyDb::shared(),
        false => MyDb::own(MariaDb::start()),
    });
    let etcd = (backend == Backend::Etcd).then(|| match share {
        true => Server::Shared(shared::etcd()),
        false => Server::Own(EtcdCluster::with_size(shared::etcd_members())),
    });
    let url = match (&pg, backend) {
        (Some(pg), _) => Some(pg.url()),
        (None, Backend::MySql) => mysql.as_ref().map(MyDb::url),
        (None, Backend::Redis) => Some(redis.url()),
        _ => None,
    };
    let mut settings: Vec<(String, String)> = Vec::new();
    // A test's own name space on a shared server: its lock keys, token
    // counters and release channels (pub/sub is server-wide, not per
    // database), or its ZooKeeper root.
    let space = unique_name();
    if let Some(set) = &sentinel {
        settings.push(("backend.redis.mode".into(), "sentinel".into()));
        settings.push((
            "backend.redis.sentinels".into(),
            set.sentinel_addrs().join(","),
        ));
        settings.push(("backend.redis.master_name".into(), set.master_name().into()));
    }
    if let Some(c) = &cluster {
        settings.push(("backend.redis.mode".into(), "cluster".into()));
        settings.push(("backend.redis.nodes".into(), c.node_urls().join(",")));
    }
    if sentinel.as_ref().is_some_and(Server::is_shared)
        || cluster.as_ref().is_some_and(Server::is_shared)
    {
        settings.push((
            "backend.redis.key_prefix".into(),
            format!("fencer:{space}:"),
        ));
    }
    if !masters.is_empty() {
        let urls: Vec<String> = masters.iter().map(RedisServer::url).collect();
        settings.push(("backend.redlock.urls".into(), urls.join(",")));
        // Fresh masters would abstain for the restart quarantine (60 s by
        // default); the quarantine has its own tests in tests/redlock.rs.
        settings.push(("backend.redlock.restart_quarantine_ms".into(), "0".into()));
    }
    if let Some(zk) = &zk {
        settings.push(("backend.zookeeper.connect".into(), zk.connect_string()));
        if zk.is_shared() {
            settings.push(("backend.zookeeper.root".into(), format!("/fencer/{space}")));
        }
        // The suite's 30 s leases need a session of at least 30 / 0.45 s.
        settings.push((
            "backend.zookeeper.session_timeout_ms".into(),
            "70000".into(),
        ));
    }
    if let Some(etcd) = &etcd {
        settings.push(("backend.etcd.endpoints".into(), etcd.endpoints().join(",")));
        settings.push(("backend.etcd.prefix".into(), format!("/fencer/{space}")));
    }
    settings.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let all: Vec<(&str, &str)> = settings
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let sidecar = Fencer::sidecar(backend, url.as_deref(), &all);
    if !matches!(backend, Backend::Memory | Backend::Redis) {
        // The schema is created, or the topology found, in the background.
        sidecar.wait_ready();
    }
    Harness {
        redis,
        pg,
        sentinel,
        cluster,
        masters,
        _zk: zk,
        _mysql: mysql,
        _etcd: etcd,
        sidecar,
        started_with: (backend, url, settings),
    }
}

/// Lock entries left in the lock backend (Redis in any mode).
fn redis_locks_left(h: &Harness) -> Vec<String> {
    let mut conns = Vec::new();
    if let Some(set) = &h.sentinel {
        conns.push(set.node_conn(set.master_port()));
    } else if let Some(c) = &h.cluster {
        // Masters only: a replica may lag a moment behind the DEL.
        for port in c.node_ports() {
            if c.is_replica(port) == Some(false) {
                conns.push(c.conn(port));
            }
        }
    } else if !h.masters.is_empty() {
        conns.extend(h.masters.iter().map(RedisServer::conn));
    } else {
        conns.push(h.redis.conn());
    }
    conns
        .iter_mut()
        .flat_map(|c| c.keys::<_, Vec<String>>("fencer:*:lock").unwrap())
        .collect()
}

/// 32 clients × 50 rounds of lock → GET → +1 → SET → release on one key:
/// with mutual exclusion no increment is lost, and the tokens, in the order
/// the critical sections ran, strictly increase.
async fn mutual_exclusion(backend: Backend) {
    let h = harness(backend, &[]);
    let sidecar = Arc::new(h.sidecar);
    let data = redis::Client::open(h.redis.url()).unwrap();
    const CLIENTS: usize = 32;
    const ROUNDS: usize = 50;
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let sidecar = sidecar.clone();
        let data = data.clone();
        tasks.push(tokio::spawn(async move {
            let mut conn = data.get_multiplexed_async_connection().await.unwrap();
            let mut seen = Vec::new();
            for _ in 0..ROUNDS {
                let r = sidecar.acquire("bank:hot", 10_000, 60_000).await;
                assert_eq!(r.status, 200, "{}", r.body);
                // A deliberately non-atomic read-modify-write.
                let v: Option<u64> = redis::cmd("GET")
                    .arg("data:counter")
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                let v = v.unwrap_or(0);
                tokio::task::yield_now().await;
                let _: () = redis::cmd("SET")
                    .arg("data:counter")
                    .arg(v + 1)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                seen.push((v, r.token()));
                let rel = sidecar.release("bank:hot", &r.lease()).await;
                assert_eq!(rel.status, 200, "{}", rel.body);
            }
            seen
        }));
    }
    let mut by_order = BTreeMap::new();
    for t in tasks {
        for (v, tok) in t.await.unwrap() {
            assert!(
                by_order.insert(v, tok).is_none(),
                "two critical sections read {v}"
            );
        }
    }
    let mut conn = h.redis.conn();
    let total: u64 = conn.get("data:counter").unwrap();
    assert_eq!(total, (CLIENTS * ROUNDS) as u64, "lost updates");
    let tokens: Vec<u64> = by_order.values().copied().collect();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens out of order: {tokens:?}"
    );
}

/// 1 000 acquisitions: strictly increasing tokens.
async fn tokens_strictly_increase(backend: Backend) {
    let h = harness(backend, &[]);
    let mut last = 0;
    for _ in 0..1000 {
        let r = h.sidecar.acquire("seq:1", 5_000, 0).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.token() > last, "{} after {last}", r.token());
        last = r.token();
        assert_eq!(h.sidecar.release("seq:1", &r.lease()).await.status, 200);
    }
    // Tokens are per key: another key has its own sequence, unaffected.
    let other = h.sidecar.acquire("seq:2", 5_000, 0).await;
    assert_eq!(other.status, 200);
}

async fn other_lease_cannot_release_or_renew(backend: Backend) {
    let h = harness(backend, &[]);
    let a = h.sidecar.acquire("acct:1", 10_000, 0).await;
    assert_eq!(a.status, 200);
    // A lease id that never held the key.
    let stranger = "AAAAAAAAAAAAAAAAAAAAAA";
    let r = h.sidecar.release("acct:1", stranger).await;
    assert_eq!((r.status, r.code()), (409, "not_owner"), "{}", r.body);
    let r = h.sidecar.renew("acct:1", stranger, 10_000).await;
    assert_eq!((r.status, r.code()), (409, "not_owner"), "{}", r.body);
    // Another holder's lease id from a different key.
    let b = h.sidecar.acquire("acct:2", 10_000, 0).await;
    let r = h.sidecar.release("acct:1", &b.lease()).await;
    assert_eq!(r.status, 409, "{}", r.body);
    // Still held by a.
    let again = h.sidecar.acquire("acct:1", 10_000, 0).await;
    assert_eq!((again.status, again.code()), (409, "lock_held"));
    let view = h.sidecar.get(&Fencer::path("acct:1", "")).await;
    assert_eq!(view.body["state"], "held");
    assert_eq!(
        view.body["lease_tag"],
        fencer::token::lease_tag(&a.lease()).as_str()
    );
    assert_eq!(h.sidecar.release("acct:1", &a.lease()).await.status, 200);
    // Released: a second release is lease_lost.
    let r = h.sidecar.release("acct:1", &a.lease()).await;
    assert_eq!((r.status, r.code()), (409, "lease_lost"), "{}", r.body);
}

/// How many times longer than their nominal figures `backend`'s timing
/// scenarios run: every TTL, interval and bound of a scenario is multiplied
/// by it, so each one checks the same ratios. CI runs two test binaries at
/// once (`tests/run_binaries.py`), and this suite shares the two cores with
/// `hot_account_proof`'s eight sidecars or the model checker; with other
/// work on the machine too (load 10-19 on 2 cores) a sidecar's renewal of a
/// 300 ms lease, due every 100 ms, was late by more than the 200 ms left
/// (PostgreSQL, Redis Cluster: a hold stream ended, max_hold ended early),
/// so every backend runs at ×2. ZooKeeper at ×4: each write (an acquire, a
/// renewal) goes through the leader's transaction log, which the test
/// servers fsync; under that load one acquire took longer than a 150 ms
/// lease (`lease_expired_before_answer`) and a renewal sent 150 ms into a
/// 300 ms lease found it lost (issue 29).
fn slowness(backend: Backend) -> u64 {
    if backend == Backend::ZooKeeper {
        4
    } else {
        2
    }
}

async fn expired_lease_release_is_lease_lost(backend: Backend) {
    let f = slowness(backend);
    let h = harness(backend, &[]);
    let a = h.sidecar.acquire("exp:1", 150 * f, 0).await;
    assert_eq!(a.status, 200, "{}", a.body);
    tokio::time::sleep(Duration::from_millis(400 * f)).await;
    let r = h.sidecar.release("exp:1", &a.lease()).await;
    assert_eq!((r.status, r.code()), (409, "lease_lost"), "{}", r.body);
    let r = h.sidecar.renew("exp:1", &a.lease(), 1000).await;
    assert_eq!((r.status, r.code()), (409, "lease_lost"), "{}", r.body);
}

async fn ttl_expiry_lets_next_in_and_renew_extends(backend: Backend) {
    let f = slowness(backend);
    let h = harness(backend, &[]);
    let a = h.sidecar.acquire("ttl:1", 300 * f, 0).await;
    assert_eq!(a.status, 200, "{}", a.body);
    // Renew twice past the original TTL: still held.
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(150 * f)).await;
        let r = h.sidecar.renew("ttl:1", &a.lease(), 300 * f).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.body["state"], "held");
        assert_eq!(r.token(), a.token());
    }
    let blocked = h.sidecar.acquire("ttl:1", 300 * f, 0).await;
    assert_eq!(blocked.code(), "lock_held");
    // Stop renewing: a waiter gets in once the TTL runs out, with a higher token.
    let b = h.sidecar.acquire("ttl:1", 300 * f, 5_000 * f).await;
    assert_eq!(b.status, 200, "{}", b.body);
    assert!(b.token() > a.token());
    // The local view of the old lease says lost.
    let r = h.sidecar.renew("ttl:1", &a.lease(), 300 * f).await;
    assert_eq!(r.code(), "lease_lost");
}

/// A blocked waiter is woken by the release, not by its fallback timer.
async fn waiter_woken_by_release(backend: Backend) {
    let h = harness(backend, &[]);
    let a = h.sidecar.acquire("wake:1", 30_000, 0).await;
    assert_eq!(a.status, 200);
    let sidecar = Arc::new(h.sidecar);
    let s2 = sidecar.clone();
    let waiter = tokio::spawn(async move { s2.acquire("wake:1", 30_000, 20_000).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    assert_eq!(sidecar.release("wake:1", &a.lease()).await.status, 200);
    let b = waiter.await.unwrap();
    assert_eq!(b.status, 200, "{}", b.body);
    assert!(b.token() > a.token());
    let fallback = sidecar
        .metric("fencer_waiter_wakeups_total", &[("cause", "fallback")])
        .await;
    assert_eq!(fallback, 0.0, "the waiter polled instead of being woken");
}

/// Waiters of one sidecar are served in arrival order.
async fn waiters_are_fifo(backend: Backend) {
    let h = harness(backend, &[]);
    let sidecar = Arc::new(h.sidecar);
    let first = sidecar.acquire("fifo:1", 30_000, 0).await;
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..5 {
        let (s, order) = (sidecar.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let r = s.acquire("fifo:1", 30_000, 20_000).await;
            assert_eq!(r.status, 200, "{}", r.body);
            order.lock().unwrap().push(i);
            s.release("fifo:1", &r.lease()).await;
        }));
        // Let each waiter join the queue before the next one.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sidecar.release("fifo:1", &first.lease()).await;
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
}

/// A waiter gives up after `wait_ms` with 409 lock_held.
async fn wait_times_out(backend: Backend) {
    let h = harness(backend, &[]);
    let a = h.sidecar.acquire("to:1", 30_000, 0).await;
    assert_eq!(a.status, 200);
    let b = h.sidecar.acquire("to:1", 30_000, 300).await;
    assert_eq!((b.status, b.code()), (409, "lock_held"));
    let timeouts = h
        .sidecar
        .metric(
            "fencer_acquisitions_total",
            &[("group", "to"), ("result", "timeout")],
        )
        .await;
    assert_eq!(timeouts, 1.0);
}

async fn get_and_list(backend: Backend) {
    let h = harness(backend, &[]);
    let r = h.sidecar.get(&Fencer::path("none:1", "")).await;
    assert_eq!((r.status, r.code()), (404, "not_found"));
    let a = h
        .sidecar
        .post(
            &Fencer::path("list/a b", "acquire"),
            json!({"owner": "worker-7"}),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.body["key"], "list/a b");
    h.sidecar.acquire("list:b", 10_000, 0).await;
    let one = h.sidecar.get(&Fencer::path("list/a b", "")).await;
    assert_eq!(one.body["owner"], "worker-7");
    assert_eq!(one.body["token"], a.body["token"]);
    let all = h.sidecar.get("/v1/locks").await;
    assert_eq!(all.body["count"], 2);
    let limited = h.sidecar.get("/v1/locks?limit=1").await;
    assert_eq!(limited.body["count"], 1);
    assert_eq!(limited.body["truncated"], true);
    let bad = h.sidecar.get("/v1/locks?limit=0").await;
    assert_eq!((bad.status, bad.code()), (400, "invalid_request"));
}

/// Every malformed request gets its 4xx JSON error, and the sidecar keeps
/// serving afterwards.
async fn bad_inputs(backend: Backend) {
    let h = harness(backend, &[]);
    let s = &h.sidecar;
    let long_key = "k".repeat(513);
    // (path, body, status, error code, field named in the error)
    type Case = (String, Vec<u8>, u16, &'static str, Option<&'static str>);
    let cases: Vec<Case> = vec![
        (
            "/v1/locks//acquire".into(),
            b"{}".to_vec(),
            400,
            "invalid_request",
            Some("key"),
        ),
        (
            Fencer::path(&long_key, "acquire"),
            b"{}".to_vec(),
            400,
            "invalid_request",
            Some("key"),
        ),
        (
            "/v1/locks/a%0Ab/acquire".into(),
            b"{}".to_vec(),
            400,
            "invalid_request",
            Some("key"),
        ),
        (
            "/v1/locks/a%00b/acquire".into(),
            b"{}".to_vec(),
            400,
            "invalid_request",
            Some("key"),
        ),
        (
            "/v1/locks/%FF%FE/acquire".into(),
            b"{}".to_vec(),
            400,
            "invalid_request",
            Some("key"),
        ),
        (
            Fencer::path("k", "acquire"),
            br#"{"ttl_ms":0}"#.to_vec(),
            400,
            "invalid_request",
            Some("ttl_ms"),
        ),
        (
            Fencer::path("k", "acquire"),
            br#"{"ttl_ms":-1}"#.to_vec(),
            400,
            "invalid_request",
            Some("ttl_ms"),
        ),
        (
            Fencer::path("k", "acquire"),
            br#"{"ttl_ms":99999999999999999999}"#.to_vec(),
            400,
            "invalid_request",
            Some("ttl_ms"),
        ),
        (
            Fencer::path("k", "acquire"),
            br#"{"wait_ms":300001}"#.to_vec(),
            400,
            "invalid_request",
            Some("wait_ms"),
        ),
        (
            Fencer::path("k", "acquire"),
            b"this is not json".to_vec(),
            400,
            "invalid_request",
            Some("body"),
        ),
        (
            Fencer::path("k", "acquire"),
            br#"{"ttl_ms":1000,"colour":"red"}"#.to_vec(),
            400,
            "invalid_request",
            Some("colour"),
        ),
        (
            Fencer::path("k", "acquire"),
            format!(r#"{{"owner":"{}"}}"#, "o".repeat(300)).into_bytes(),
            400,
            "invalid_request",
            Some("owner"),
        ),
        (
            Fencer::path("k", "release"),
            b"{}".to_vec(),
            400,
            "invalid_request",
            Some("lease_id"),
        ),
        (
            Fencer::path("k", "release"),
            br#"{"lease_id":"../../etc"}"#.to_vec(),
            400,
            "invalid_request",
            Some("lease_id"),
        ),
        (
            Fencer::path("k", "renew"),
            br#"{"lease_id":"abc","ttl_ms":5}"#.to_vec(),
            400,
            "invalid_request",
            Some("ttl_ms"),
        ),
        (
            "/v1/locks/k/explode".into(),
            b"{}".to_vec(),
            404,
            "not_found",
            None,
        ),
    ];
    for (path, body, status, code, field) in cases {
        let r = s.post_raw(&path, body).await;
        assert_eq!((r.status, r.code()), (status, code), "{path}: {}", r.body);
        assert!(
            r.body["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{path}: no message"
        );
        if let Some(field) = field {
            assert_eq!(r.body["field"], field, "{path}: {}", r.body);
        }
    }
    // A 1 MiB body: answered 413 once the 16 KiB limit is passed, without
    // reading (or buffering) the rest. Raw TCP, because the server closes
    // the connection before an HTTP client would have finished sending.
    let port = s.api_port;
    let reply = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(
            conn,
            "POST /v1/locks/k/acquire HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            1 << 20
        )
        .unwrap();
        let _ = conn.write_all(&[b' '; 20 * 1024]);
        let mut buf = vec![0u8; 4096];
        let n = conn.read(&mut buf).unwrap_or(0);
        String::from_utf8_lossy(&buf[..n]).into_owned()
    })
    .await
    .unwrap();
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
    assert!(reply.contains("payload_too_large"), "{reply}");
    // Wrong method.
    let r = s
        .http
        .delete(format!("{}/v1/locks/k/acquire", s.api))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    // Nothing was acquired by any of that, and the sidecar still works.
    assert_eq!(s.get("/v1/locks").await.body["count"], 0);
    let ok = s.acquire("k", 1000, 0).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
}

/// SIGTERM releases every lease and exits 0.
async fn shutdown_releases_leases(backend: Backend) {
    let mut h = harness_own(backend, &[]);
    let mut leases = HashSet::new();
    for i in 0..20 {
        let r = h.sidecar.acquire(&format!("shut:{i}"), 30_000, 0).await;
        assert_eq!(r.status, 200);
        leases.insert(r.lease());
    }
    assert_eq!(h.sidecar.terminate(), Some(0));
    if matches!(backend.name(), "redis" | "redlock") {
        let keys = redis_locks_left(&h);
        assert!(keys.is_empty(), "locks left after shutdown: {keys:?}");
    }
    if let Some(pg) = &h.pg {
        let held = pg_query_i64(
            &pg.url(),
            "SELECT count(*) FROM fencer_locks WHERE lease_id IS NOT NULL",
        )
        .await;
        assert_eq!(held, 0, "locks left after shutdown");
    }
    assert!(h
        .sidecar
        .logs_with("released leases on shutdown")
        .contains("released leases on shutdown"));
}

// ------------------------------------------------------------ lifetimes

/// Spawns `curl` holding `key` through a hold stream (a real client
/// process the test can SIGKILL); returns once the lock is held.
#[allow(clippy::zombie_processes)] // the caller kills and waits for it
async fn curl_hold(s: &Fencer, key: &str, ttl_ms: u64) -> std::process::Child {
    let mut child = std::process::Command::new("curl")
        .args([
            "-N",
            "-s",
            "-XPOST",
            &format!("{}{}", s.api, Fencer::path(key, "hold")),
        ])
        .args(["-d", &format!("{{\"ttl_ms\":{ttl_ms}}}")])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("curl must be installed (tests/run.sh installs it)");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let v = s.get(&Fencer::path(key, "")).await;
        if v.status == 200 && v.body["state"] == "held" && v.body["renewal"] == "hold" {
            return child;
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("hold not established: {}", v.body);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// kill -9 of a client holding a lock through a hold stream frees the lock
/// at once, far below its TTL.
async fn hold_is_released_when_the_client_dies(backend: Backend) {
    let h = harness(backend, &[]);
    let s = Arc::new(h.sidecar);
    let mut client = curl_hold(&s, "hold:kill", 30_000).await;
    let s2 = s.clone();
    let waiter = tokio::spawn(async move { s2.acquire("hold:kill", 30_000, 20_000).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiter.is_finished());
    let killed = std::time::Instant::now();
    client.kill().unwrap();
    let _ = client.wait();
    let got = waiter.await.unwrap();
    let after = killed.elapsed();
    assert_eq!(got.status, 200, "{}", got.body);
    eprintln!("{backend:?}: acquired {after:?} after the holder was killed (TTL 30 s)");
    // Generous bound against CI noise; the TTL is 30 s.
    assert!(
        after < Duration::from_secs(2),
        "released only after {after:?}"
    );
}

/// A hold keeps its lock across 10 TTLs, with heartbeats, then releases on
/// close.
async fn hold_keeps_the_lock_while_open(backend: Backend) {
    let f = slowness(backend);
    let heartbeat = (100 * f).to_string();
    let h = harness(backend, &[("sidecar.hold_heartbeat_ms", &heartbeat)]);
    let s = &h.sidecar;
    let resp = s
        .http
        .post(format!("{}{}", s.api, Fencer::path("hold:long", "hold")))
        .body(json!({ "ttl_ms": 300 * f }).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut resp = resp;
    let mut lines = String::new();
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_millis(3_000 * f) {
        match tokio::time::timeout(Duration::from_millis(500 * f), resp.chunk()).await {
            Ok(Ok(Some(bytes))) => lines.push_str(&String::from_utf8_lossy(&bytes)),
            other => panic!("hold stream ended early: {other:?}\n{lines}"),
        }
    }
    let first: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    assert_eq!(first["type"], "acquired");
    assert!(
        lines.lines().filter(|l| l.contains("heartbeat")).count() >= 10,
        "{lines}"
    );
    assert!(!lines.contains("\"lost\""), "{lines}");
    let other = s.acquire("hold:long", 300 * f, 0).await;
    assert_eq!(other.code(), "lock_held", "lost during the hold");
    let view = s.get(&Fencer::path("hold:long", "")).await;
    assert_eq!(view.body["token"], first["token"]);
    drop(resp);
    let next = s.acquire("hold:long", 300 * f, 2_000 * f).await;
    assert_eq!(next.status, 200, "{}", next.body);
}

/// auto_renew: alive while the application calls; after it goes silent the
/// lease ends within keepalive + TTL.
async fn auto_renew_follows_the_application(backend: Backend) {
    // A 300 ms TTL renewed every 100 ms is too close for a busy machine
    // (see `slowness`).
    let f = slowness(backend);
    let h = harness(backend, &[]);
    let s = &h.sidecar;
    let a = s
        .post(
            &Fencer::path("auto:1", "acquire"),
            json!({"ttl_ms": 300 * f, "auto_renew": true, "keepalive_ms": 500 * f}),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(200 * f)).await;
        let k = s
            .post(
                &Fencer::path("auto:1", "keepalive"),
                json!({"lease_id": a.lease()}),
            )
            .await;
        assert_eq!(k.status, 200, "{}", k.body);
    }
    // 2 s (× f) = 6.7 TTLs later, still the same lease.
    assert_eq!(s.acquire("auto:1", 300 * f, 0).await.code(), "lock_held");
    let silent = std::time::Instant::now();
    let b = s.acquire("auto:1", 300 * f, 5_000 * f).await;
    assert_eq!(b.status, 200, "{}", b.body);
    let gone = silent.elapsed();
    assert!(
        gone >= Duration::from_millis(400 * f),
        "ended before keepalive ran out: {gone:?}"
    );
    assert!(
        gone < Duration::from_millis(2_000 * f),
        "outlived keepalive + TTL: {gone:?}"
    );
    let k = s
        .post(
            &Fencer::path("auto:1", "keepalive"),
            json!({"lease_id": a.lease()}),
        )
        .await;
    assert_eq!(k.code(), "lease_lost");
}

/// max_hold_ms ends a lease however actively it is kept alive.
async fn max_hold_caps_renewal(backend: Backend) {
    let f = slowness(backend);
    let max_hold = (900 * f).to_string();
    let h = harness(backend, &[("sidecar.max_hold_ms", &max_hold)]);
    let s = Arc::new(h.sidecar);
    let a = s
        .post(
            &Fencer::path("cap:1", "acquire"),
            json!({"ttl_ms": 300 * f, "auto_renew": true, "keepalive_ms": 10000 * f}),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    let started = std::time::Instant::now();
    let s2 = s.clone();
    let lease = a.lease();
    let pinger = tokio::spawn(async move {
        for _ in 0..30 {
            s2.post(
                &Fencer::path("cap:1", "keepalive"),
                json!({"lease_id": lease}),
            )
            .await;
            tokio::time::sleep(Duration::from_millis(100 * f)).await;
        }
    });
    let b = s.acquire("cap:1", 300 * f, 5_000 * f).await;
    assert_eq!(b.status, 200, "{}", b.body);
    let held = started.elapsed();
    assert!(
        held >= Duration::from_millis(800 * f),
        "ended early: {held:?}"
    );
    assert!(
        held < Duration::from_millis(2_000 * f),
        "max_hold not enforced: {held:?}"
    );
    pinger.abort();
}

/// Lock-delay: after an expiry (not a release) the key stays unavailable
/// for the delay, then frees up; a release frees it at once. While the
/// delay lasts an acquire that gives up is told so — 409 `lock_delayed`
/// with `retry_after_ms` (issue 33 item 6) — not `lock_held`: nobody holds
/// the key. On ZooKeeper the delay is the expired holder's node living
/// on: its own sidecar knows the lease's TTL, and any other sidecar's
/// waiter reads it from the node (its data records the delay at the end
/// of its life), so both are told `lock_delayed` too.
async fn lock_delay_after_expiry(backend: Backend) {
    let f = slowness(backend);
    let delay = (800 * f).to_string();
    let h = harness(backend, &[("sidecar.lock_delay_ms", &delay)]);
    let s = &h.sidecar;
    // The memory backend lives in its process: no other sidecar sees it.
    let other = (backend != Backend::Memory).then(|| h.another());
    let a = s.acquire("delay:1", 200 * f, 0).await;
    assert_eq!(a.status, 200, "{}", a.body);
    // Held, not delayed: a lease holds it.
    assert_eq!(s.acquire("delay:1", 200 * f, 0).await.code(), "lock_held");
    if let Some(b) = &other {
        assert_eq!(b.acquire("delay:1", 200 * f, 0).await.code(), "lock_held");
    }
    tokio::time::sleep(Duration::from_millis(400 * f)).await;
    // Expired 200 ms (× f) ago, delay 800 ms (× f): refused, as delayed,
    // here and elsewhere.
    for asker in [Some(s), other.as_ref()].into_iter().flatten() {
        let refused = asker.acquire("delay:1", 200 * f, 0).await;
        assert_eq!(
            (refused.status, refused.code()),
            (409, "lock_delayed"),
            "{}",
            refused.body
        );
        let retry = refused.body["retry_after_ms"]
            .as_u64()
            .expect("retry_after_ms");
        // The delay ends 200 + 800 ms (× f) after the grant, ~400 ms (× f) ago.
        assert!(
            (1..=800 * f).contains(&retry),
            "retry_after_ms {retry}: {}",
            refused.body
        );
    }
    // A waiter whose wait outlasts the delay gets the key at its end.
    let waited = s.acquire("delay:1", 200 * f, 800 * f + 1_500 * f).await;
    assert_eq!(waited.status, 200, "{}", waited.body);
    // A release clears the delay.
    assert_eq!(s.release("delay:1", &waited.lease()).await.status, 200);
    assert_eq!(s.acquire("delay:1", 200 * f, 0).await.status, 200);
}

async fn acquire_reentrant(s: &Fencer, key: &str, owner: &str, wait_ms: u64) -> Resp {
    s.post(
        &Fencer::path(key, "acquire"),
        json!({"ttl_ms": 20_000, "wait_ms": wait_ms, "owner": owner, "reentrant": true}),
    )
    .await
}

/// Reentrant locks (issue 33 item 1): the owner takes the key again — the
/// same lease and token, one more hold — and each release gives one back
/// until the last frees the key; another owner waits meanwhile. The count
/// lives in the backend: a sidecar restarted meanwhile adopts the lease
/// on its next renewal and neither a re-entry nor a release frees the key
/// early (ZooKeeper: its leases end with their sidecar's session). RedLock
/// keeps no counts: 400 unsupported_by_backend.
async fn reentrant_locks(backend: Backend) {
    let mut h = harness(backend, &[]);
    if backend == Backend::RedLock {
        let r = acquire_reentrant(&h.sidecar, "re:1", "o", 0).await;
        assert_eq!(
            (r.status, r.code()),
            (400, "unsupported_by_backend"),
            "{}",
            r.body
        );
        assert_eq!(r.body["feature"], "reentrant", "{}", r.body);
        assert_eq!(r.body["backend"], backend.name(), "{}", r.body);
        return;
    }
    let s = &h.sidecar;
    let first = acquire_reentrant(s, "re:1", "o", 0).await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.body["holds"], 1, "{}", first.body);
    let again = acquire_reentrant(s, "re:1", "o", 0).await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(
        (again.lease(), again.token(), again.body["holds"].clone()),
        (first.lease(), first.token(), json!(2)),
        "{}",
        again.body
    );
    // Another owner, a non-reentrant acquire: held.
    assert_eq!(
        acquire_reentrant(s, "re:1", "p", 0).await.code(),
        "lock_held"
    );
    assert_eq!(s.acquire("re:1", 10_000, 0).await.code(), "lock_held");
    assert_eq!(s.get(&Fencer::path("re:1", "")).await.body["holds"], 2);
    let one = s.release("re:1", &first.lease()).await;
    assert_eq!(one.status, 200, "{}", one.body);
    assert_eq!(
        (one.body["released"].clone(), one.body["holds"].clone()),
        (json!(false), json!(1)),
        "{}",
        one.body
    );
    assert_eq!(
        s.acquire("re:1", 10_000, 0).await.code(),
        "lock_held",
        "one hold left"
    );
    let last = s.release("re:1", &first.lease()).await;
    assert_eq!(last.body["released"], true, "{}", last.body);
    assert!(last.body.get("holds").is_none(), "{}", last.body);
    let other = acquire_reentrant(s, "re:1", "p", 0).await;
    assert_eq!(other.status, 200, "{}", other.body);
    assert!(other.token() > first.token());
    assert_eq!(
        s.release("re:1", &other.lease()).await.body["released"],
        true
    );
    // A reentrant acquire needs an owner; a hold stream takes no `reentrant`.
    let no_owner = s
        .post(&Fencer::path("re:2", "acquire"), json!({"reentrant": true}))
        .await;
    assert_eq!(
        (no_owner.status, no_owner.body["field"].clone()),
        (400, json!("owner")),
        "{}",
        no_owner.body
    );

    // A lease that expires with holds left: the next lease of the key
    // starts from one hold (the count is the lease's, not the key's).
    let f = slowness(backend);
    let short = s
        .post(
            &Fencer::path("re:5", "acquire"),
            json!({"ttl_ms": 200 * f, "owner": "o", "reentrant": true}),
        )
        .await;
    assert_eq!(short.status, 200, "{}", short.body);
    assert_eq!(acquire_reentrant(s, "re:5", "o", 0).await.body["holds"], 2);
    tokio::time::sleep(Duration::from_millis(400 * f)).await;
    let next = acquire_reentrant(s, "re:5", "o", 5_000).await;
    assert_eq!(next.status, 200, "{}", next.body);
    assert_ne!(next.lease(), short.lease());
    assert_eq!(next.body["holds"], 1, "{}", next.body);
    assert_eq!(
        s.release("re:5", &next.lease()).await.body["released"],
        true
    );

    if matches!(backend, Backend::Memory | Backend::ZooKeeper) {
        // Nothing outlives the process; a ZooKeeper lease ends with its
        // sidecar's session.
        return;
    }
    // The count outlives the sidecar: three holds, a restart, then the
    // application renews (the new process adopts the lease), re-enters
    // and releases — the key frees with the fourth release only.
    let r = acquire_reentrant(s, "re:3", "o", 0).await;
    let lease = r.lease();
    for n in 2..=3 {
        assert_eq!(acquire_reentrant(s, "re:3", "o", 0).await.body["holds"], n);
    }
    h.sidecar.crash_and_restart();
    let s = &h.sidecar;
    s.wait_ready();
    let renewed = s.renew("re:3", &lease, 20_000).await;
    assert_eq!(renewed.status, 200, "{}", renewed.body);
    let back = acquire_reentrant(s, "re:3", "o", 0).await;
    assert_eq!(
        (back.status, back.lease(), back.body["holds"].clone()),
        (200, lease.clone(), json!(4)),
        "{}",
        back.body
    );
    for left in (1..=3).rev() {
        let r = s.release("re:3", &lease).await;
        assert_eq!(
            (r.body["released"].clone(), r.body["holds"].clone()),
            (json!(false), json!(left)),
            "{}",
            r.body
        );
    }
    assert_eq!(s.release("re:3", &lease).await.body["released"], true);
    assert_eq!(s.acquire("re:3", 10_000, 0).await.status, 200);
    // A release straight after a restart, before any renewal: the backend's
    // count still decides.
    let r = acquire_reentrant(s, "re:4", "o", 0).await;
    acquire_reentrant(s, "re:4", "o", 0).await;
    h.sidecar.crash_and_restart();
    let s = &h.sidecar;
    s.wait_ready();
    let one = s.release("re:4", &r.lease()).await;
    assert_eq!(
        (one.body["released"].clone(), one.body["holds"].clone()),
        (json!(false), json!(1)),
        "{}",
        one.body
    );
    assert_eq!(s.release("re:4", &r.lease()).await.body["released"], true);
}

async fn view(s: &Fencer, key: &str) -> Resp {
    s.get(&format!("{}?scope=backend", Fencer::path(key, "")))
        .await
}

/// `GET /v1/locks/{key}?scope=backend` (issue 33 item 5): what the backend
/// records, whichever sidecar's lease it is — the holder's token and tag
/// (never its id), its time left, the key's last token, the queue where
/// the backend keeps one (ZooKeeper); free and lock-delayed keys too.
async fn backend_view(backend: Backend) {
    let f = slowness(backend);
    let delay = (2_000 * f).to_string();
    let h = harness(backend, &[("sidecar.lock_delay_ms", &delay)]);
    let a = &h.sidecar;
    // The memory backend lives in its process: no other sidecar sees it.
    let other = (backend != Backend::Memory).then(|| h.another());
    let b = other.as_ref().unwrap_or(a);
    let never = view(b, "view:never").await;
    assert_eq!(never.status, 200, "{}", never.body);
    assert_eq!(never.body["state"], "free", "{}", never.body);
    assert_eq!(never.body["backend"], backend.name(), "{}", never.body);

    let held = a.acquire("view:1", 20_000, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);
    let tag = a.get(&Fencer::path("view:1", "")).await.body["lease_tag"].clone();
    for (s, here) in [(b, backend == Backend::Memory), (a, true)] {
        let v = view(s, "view:1").await;
        assert_eq!(v.status, 200, "{}", v.body);
        assert_eq!(v.body["state"], "held", "{}", v.body);
        assert_eq!(v.body["token"], held.body["token"], "{}", v.body);
        assert_eq!(v.body["lease_tag"], tag, "{}", v.body);
        assert_eq!(v.body["held_here"], here, "{}", v.body);
        assert!(
            !v.body.to_string().contains(&held.lease()),
            "the lease id (a credential) in {}",
            v.body
        );
        if queued(backend) {
            assert_eq!(v.body["waiting"], 0, "{}", v.body);
        } else {
            let left = v.body["remaining_ms"].as_u64().expect("remaining_ms");
            assert!((1..=20_000).contains(&left), "{}", v.body);
            assert_eq!(v.body["last_token"], held.body["token"], "{}", v.body);
            assert!(v.body.get("waiting").is_none(), "{}", v.body);
        }
    }
    if queued(backend) {
        // The queue: a waiter on the other sidecar is counted.
        let b = Arc::new(h.another());
        let b2 = b.clone();
        let waiter = tokio::spawn(async move { b2.acquire("view:1", 20_000, 20_000).await });
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while view(a, "view:1").await.body["waiting"] != 1 {
            assert!(
                std::time::Instant::now() < deadline,
                "the waiter is not counted"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(a.release("view:1", &held.lease()).await.status, 200);
        let got = waiter.await.unwrap();
        assert_eq!(got.status, 200, "{}", got.body);
        let v = view(a, "view:1").await;
        assert_eq!(
            (v.body["token"].clone(), v.body["held_here"].clone()),
            (got.body["token"].clone(), json!(false))
        );
        if backend == Backend::ZooKeeper {
            return;
        }
        assert_eq!(b.release("view:1", &got.lease()).await.status, 200);
    } else {
        assert_eq!(a.release("view:1", &held.lease()).await.status, 200);
    }
    let v = view(b, "view:1").await;
    assert_eq!(v.body["state"], "free", "{}", v.body);
    if !queued(backend) {
        assert_eq!(v.body["last_token"], held.body["token"], "{}", v.body);
    }
    // An expiry, not a release: the key is in its lock-delay.
    let short = a.acquire("view:1", 100 * f, 0).await;
    assert_eq!(short.status, 200, "{}", short.body);
    tokio::time::sleep(Duration::from_millis(300 * f)).await;
    let v = view(b, "view:1").await;
    assert_eq!(v.body["state"], "delayed", "{}", v.body);
    let left = v.body["retry_after_ms"].as_u64().expect("retry_after_ms");
    assert!((1..=2_000 * f).contains(&left), "{}", v.body);
}

/// Whether the backend keeps a queue of waiters (and no token counter).
fn queued(backend: Backend) -> bool {
    matches!(backend, Backend::ZooKeeper | Backend::Etcd)
}

/// `r` is the error `status` / `code`.
fn assert_refused(r: &Resp, status: u16, code: &str) {
    assert_eq!((r.status, r.code()), (status, code), "{}", r.body);
}

/// Each body sent to `path` is refused 400 `invalid_request` naming `field`.
async fn assert_invalid(s: &Fencer, path: &str, cases: Vec<(serde_json::Value, &str)>) {
    for (body, field) in cases {
        let r = s.post(path, body.clone()).await;
        assert_eq!(
            (r.status, r.code()),
            (400, "invalid_request"),
            "{body}: {}",
            r.body
        );
        assert_eq!(r.body["field"], field, "{body}: {}", r.body);
    }
}

/// `POST path` with `body` to `s`, answered in a task of its own.
fn in_background(s: &Fencer, path: &str, body: serde_json::Value) -> tokio::task::JoinHandle<Resp> {
    let (http, url) = (s.http.clone(), format!("{}{path}", s.api));
    tokio::spawn(async move {
        let r = http
            .post(url)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .expect("request failed");
        let status = r.status().as_u16();
        Resp {
            status,
            body: r.json().await.expect("JSON"),
        }
    })
}

/// `POST /v1/semaphores/{name}/acquire` (issue 33 item 3): at most
/// `permits` leases at once, one per slot key `name#slot`, whichever
/// sidecar holds them; a waiter gets the slot a release frees, or one
/// whose holder expired; each slot's tokens strictly increase; the count
/// is fixed in the backend at first use, so a sidecar that never saw the
/// name refuses another count.
async fn semaphores(backend: Backend) {
    let f = slowness(backend);
    let h = harness(backend, &[]);
    let a = &h.sidecar;
    let other = (backend != Backend::Memory).then(|| h.another());
    let b = other.as_ref().unwrap_or(a);
    let sem = |op: &str| format!("/v1/semaphores/pool%2F1/{op}");
    let ask = |ttl: u64, wait: u64| json!({"permits": 2, "ttl_ms": ttl, "wait_ms": wait});
    let one = a.post(&sem("acquire"), ask(20_000, 0)).await;
    assert_eq!(one.status, 200, "{}", one.body);
    let two = b.post(&sem("acquire"), ask(20_000, 0)).await;
    assert_eq!(two.status, 200, "{}", two.body);
    let slots: HashSet<u64> = [&one, &two]
        .iter()
        .map(|r| r.body["slot"].as_u64().expect("slot"))
        .collect();
    assert_eq!(slots, HashSet::from([0, 1]), "{} {}", one.body, two.body);
    for r in [&one, &two] {
        assert_eq!(r.body["semaphore"], "pool/1", "{}", r.body);
        assert_eq!(r.body["permits"], 2, "{}", r.body);
        assert_eq!(
            r.body["key"],
            format!("pool/1#{}", r.body["slot"]),
            "{}",
            r.body
        );
    }
    for s in [a, b] {
        let full = s.post(&sem("acquire"), ask(20_000, 0)).await;
        assert_eq!(
            (full.status, full.code()),
            (409, "lock_held"),
            "{}",
            full.body
        );
        assert_eq!(full.body["permits"], 2, "{}", full.body);
    }
    // The slot is an ordinary lock key: the lock API sees the lease.
    let as_lock = a
        .get(&Fencer::path(one.body["key"].as_str().unwrap(), ""))
        .await;
    assert_eq!(as_lock.body["token"], one.body["token"], "{}", as_lock.body);
    // A waiter on b gets the slot a's release frees, with a higher token.
    let waiter = in_background(b, &sem("acquire"), ask(20_000, 20_000 * f));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let renewed = a
        .post(
            &sem("renew"),
            json!({"lease_id": one.lease(), "ttl_ms": 30_000}),
        )
        .await;
    assert_eq!(renewed.status, 200, "{}", renewed.body);
    let kept = a
        .post(&sem("keepalive"), json!({"lease_id": one.lease()}))
        .await;
    assert_eq!(kept.body["alive"], true, "{}", kept.body);
    let released_at = std::time::Instant::now();
    let freed = a
        .post(&sem("release"), json!({"lease_id": one.lease()}))
        .await;
    assert_eq!(freed.status, 200, "{}", freed.body);
    assert_eq!(
        (freed.body["released"].clone(), freed.body["slot"].clone()),
        (json!(true), one.body["slot"].clone()),
        "{}",
        freed.body
    );
    let got = waiter.await.unwrap();
    assert_eq!(got.status, 200, "{}", got.body);
    assert_eq!(got.body["slot"], one.body["slot"], "{}", got.body);
    // Woken by the release, not by the holder's expiry 30 s on.
    assert!(
        released_at.elapsed() < Duration::from_secs(10),
        "the waiter got the permit {:?} after its release",
        released_at.elapsed()
    );
    assert!(got.token() > one.token(), "{} after {}", got.body, one.body);
    // A holder that expires without a release frees its slot: a waiter
    // gets it once its TTL is over (nothing is published for an expiry).
    let short_release = b
        .post(
            &sem("release"),
            json!({"lease_id": two.lease(), "slot": two.body["slot"]}),
        )
        .await;
    assert_eq!(
        short_release.body["released"], true,
        "{}",
        short_release.body
    );
    let short = a.post(&sem("acquire"), ask(500 * f, 0)).await;
    assert_eq!(short.status, 200, "{}", short.body);
    let after_expiry = b.post(&sem("acquire"), ask(20_000, 20_000 * f)).await;
    assert_eq!(after_expiry.status, 200, "{}", after_expiry.body);
    assert_eq!(
        after_expiry.body["slot"], short.body["slot"],
        "{}",
        after_expiry.body
    );
    // The count is the backend's, fixed at first use.
    let three = b
        .post(
            &sem("acquire"),
            json!({"permits": 3, "ttl_ms": 1000, "wait_ms": 0}),
        )
        .await;
    assert_refused(&three, 409, "permits_mismatch");
    assert_eq!(three.body["permits"], 2, "{}", three.body);
    let fresh = if backend == Backend::Memory {
        None
    } else {
        Some(h.another())
    };
    if let Some(fresh) = &fresh {
        let r = fresh
            .post(
                &sem("acquire"),
                json!({"permits": 1, "ttl_ms": 1000, "wait_ms": 0}),
            )
            .await;
        assert_eq!(r.code(), "permits_mismatch", "{}", r.body);
    }
    // Not a permit of this semaphore; a lease the sidecar does not know.
    let lock = a.acquire("pool/1#x", 10_000, 0).await;
    let wrong = a
        .post(&sem("release"), json!({"lease_id": lock.lease()}))
        .await;
    assert_refused(&wrong, 409, "not_owner");
    let unknown = a.post(&sem("release"), json!({"lease_id": "nope"})).await;
    assert_refused(&unknown, 404, "not_found");
    assert_invalid(
        a,
        &sem("acquire"),
        vec![
            (json!({"ttl_ms": 1000}), "permits"),
            (json!({"permits": 0}), "permits"),
            (json!({"permits": 257}), "permits"),
            (json!({"permits": "2"}), "permits"),
            (json!({"permits": 2, "reentrant": true}), "reentrant"),
            (json!({"permits": 2, "ttl_ms": 1}), "ttl_ms"),
        ],
    )
    .await;
    let bad_slot = a
        .post(
            &sem("release"),
            json!({"lease_id": one.lease(), "slot": 256}),
        )
        .await;
    assert_eq!(bad_slot.body["field"], "slot", "{}", bad_slot.body);
}

/// `POST /v1/locks/acquire {"keys": [...]}` (issue 33 item 4): every key or
/// none under one lease id, keys taken in one canonical order — so two
/// acquires naming the same keys in opposite orders never deadlock — and
/// the keys taken given back when one stays held past `wait_ms`; the group
/// renews, keeps alive and releases every key; each key keeps its own
/// strictly increasing token.
async fn multi_key_locks(backend: Backend) {
    let f = slowness(backend);
    let h = harness(backend, &[]);
    let a = &h.sidecar;
    let other = (backend != Backend::Memory).then(|| h.another());
    let b = other.as_ref().unwrap_or(a);
    let many =
        |keys: &[&str], ttl: u64, wait: u64| json!({"keys": keys, "ttl_ms": ttl, "wait_ms": wait});
    let m = a
        .post(
            "/v1/locks/acquire",
            many(&["mk:b", "mk:a", "mk:b"], 20_000, 0),
        )
        .await;
    assert_eq!(m.status, 200, "{}", m.body);
    let keys: Vec<&str> = m.body["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["mk:a", "mk:b"], "{}", m.body);
    for s in [a, b] {
        assert_eq!(s.acquire("mk:a", 10_000, 0).await.code(), "lock_held");
        assert_eq!(s.acquire("mk:b", 10_000, 0).await.code(), "lock_held");
    }
    let shown = a.get(&Fencer::path("mk:b", "")).await;
    assert_eq!(
        shown.body["token"], m.body["keys"][1]["token"],
        "{}",
        shown.body
    );
    // One key stays held: nothing is kept.
    let d = b.acquire("mk:d", 30_000, 0).await;
    assert_eq!(d.status, 200, "{}", d.body);
    let partial = a
        .post(
            "/v1/locks/acquire",
            many(&["mk:d", "mk:c"], 20_000, 300 * f),
        )
        .await;
    assert_refused(&partial, 409, "lock_held");
    assert_eq!(partial.body["key"], "mk:d", "{}", partial.body);
    let c = b.acquire("mk:c", 10_000, 0).await;
    assert_eq!(c.status, 200, "mk:c was kept: {}", c.body);
    b.release("mk:c", &c.lease()).await;
    b.release("mk:d", &d.lease()).await;
    // A waiter for keys the group holds gets them all at its release.
    let waiter = in_background(
        b,
        "/v1/locks/acquire",
        many(&["mk:e", "mk:a"], 20_000, 20_000 * f),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let renewed = a
        .post(
            "/v1/locks/renew",
            json!({"lease_id": m.lease(), "ttl_ms": 30_000}),
        )
        .await;
    assert_eq!(renewed.status, 200, "{}", renewed.body);
    assert!(
        renewed.body["remaining_ms"].as_u64().unwrap() > 20_000,
        "{}",
        renewed.body
    );
    let alive = a
        .post("/v1/locks/keepalive", json!({"lease_id": m.lease()}))
        .await;
    assert_eq!(alive.body["alive"], true, "{}", alive.body);
    let freed = a
        .post("/v1/locks/release", json!({"lease_id": m.lease()}))
        .await;
    assert_eq!(freed.status, 200, "{}", freed.body);
    assert_eq!(
        freed.body["keys"],
        json!(["mk:a", "mk:b"]),
        "{}",
        freed.body
    );
    let got = waiter.await.unwrap();
    assert_eq!(got.status, 200, "{}", got.body);
    assert!(
        got.body["keys"][0]["token"].as_u64() > m.body["keys"][0]["token"].as_u64(),
        "{}",
        got.body
    );
    let again = a
        .post("/v1/locks/release", json!({"lease_id": m.lease()}))
        .await;
    assert_refused(&again, 404, "not_found");
    assert_eq!(
        b.post("/v1/locks/release", json!({"lease_id": got.lease()}))
            .await
            .status,
        200
    );
    // Opposite orders at once, again and again: no deadlock (each lets go
    // as soon as it has both).
    let take_and_let_go = |s: &Fencer, keys: [&str; 2]| {
        let (http, api) = (s.http.clone(), s.api.clone());
        let body = many(&keys, 5_000, 10_000 * f).to_string();
        tokio::spawn(async move {
            let got: serde_json::Value = http
                .post(format!("{api}/v1/locks/acquire"))
                .body(body)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let lease = got["lease_id"].as_str().map(str::to_owned);
            if let Some(lease) = &lease {
                http.post(format!("{api}/v1/locks/release"))
                    .body(json!({ "lease_id": lease }).to_string())
                    .send()
                    .await
                    .unwrap();
            }
            (got, lease.is_some())
        })
    };
    for round in 0..4 {
        let one = take_and_let_go(a, ["mk:x", "mk:y"]);
        let two = take_and_let_go(b, ["mk:y", "mk:x"]);
        for r in [one.await.unwrap(), two.await.unwrap()] {
            assert!(r.1, "round {round}: {}", r.0);
        }
    }
    // A key spelled like a route is still a key for GET.
    let literal = a.get("/v1/locks/acquire").await;
    assert_refused(&literal, 404, "not_found");
    assert_invalid(
        a,
        "/v1/locks/acquire",
        vec![
            (json!({"ttl_ms": 1000}), "keys"),
            (json!({"keys": []}), "keys"),
            (json!({"keys": vec!["k"; 33]}), "keys"),
            (json!({"keys": [1]}), "keys"),
            (json!({"keys": ["a\nb"]}), "keys"),
            (json!({"keys": ["k"], "reentrant": true}), "reentrant"),
        ],
    )
    .await;
}

/// SIGTERM closes hold streams with a final line.
async fn shutdown_closes_hold_streams(backend: Backend) {
    let mut h = harness_own(backend, &[]);
    let resp = h
        .sidecar
        .http
        .post(format!(
            "{}{}",
            h.sidecar.api,
            Fencer::path("hold:term", "hold")
        ))
        .body(r#"{"ttl_ms":10000}"#)
        .send()
        .await
        .unwrap();
    let reader = tokio::spawn(async move { resp.text().await.unwrap_or_default() });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(h.sidecar.terminate(), Some(0));
    let text = reader.await.unwrap();
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(last["type"], "released", "{text}");
    assert_eq!(last["reason"], "shutdown");
}

/// Read-write locks (issue 33 item 2), `"mode": "read"`: readers share the
/// key, each with a token of its own from the key's one counter; a writer
/// excludes readers and writers; a waiting writer keeps new readers out
/// (no writer starvation); the last reader's release hands the key to the
/// writer, and the writer's to every reader waiting. Backends without
/// reader sets answer 400 `unsupported_by_backend`.
async fn read_write_locks(backend: Backend) {
    let f = slowness(backend);
    let h = harness(backend, &[]);
    let a = &h.sidecar;
    let path = |op: &str| Fencer::path("rw/1", op);
    let read = |ttl: u64, wait: u64| json!({"mode": "read", "ttl_ms": ttl, "wait_ms": wait});
    let r1 = a.post(&path("acquire"), read(20_000, 0)).await;
    if !matches!(
        backend,
        Backend::Memory
            | Backend::Postgres
            | Backend::Redis
            | Backend::RedisSentinel
            | Backend::RedisCluster
            | Backend::MySql
            | Backend::ZooKeeper
    ) {
        assert_eq!(
            (r1.status, r1.code()),
            (400, "unsupported_by_backend"),
            "{}",
            r1.body
        );
        assert_eq!(r1.body["feature"], "read-write", "{}", r1.body);
        return;
    }
    assert_eq!(r1.status, 200, "{}", r1.body);
    assert_eq!(
        (r1.body["mode"].as_str(), r1.body["key"].as_str()),
        (Some("read"), Some("rw/1"))
    );
    assert!(
        r1.body["fencing_token"]
            .as_str()
            .unwrap()
            .starts_with("v3."),
        "{}",
        r1.body
    );
    let other = (backend != Backend::Memory).then(|| h.another());
    let b = other.as_ref().unwrap_or(a);
    let r2 = b.post(&path("acquire"), read(20_000, 0)).await;
    assert_eq!(r2.status, 200, "readers share: {}", r2.body);
    assert!(r2.token() > r1.token(), "{} {}", r1.body, r2.body);
    // The backend's view counts the readers, whichever sidecar's they are.
    let v = view(a, "rw/1").await;
    assert_eq!(
        (v.body["state"].as_str(), v.body["readers"].as_u64()),
        (Some("read"), Some(2)),
        "{}",
        v.body
    );
    assert!(v.body.get("lease_tag").is_none(), "{}", v.body);
    // A writer finds the readers; a plain acquire is a writer's.
    let w = a.acquire("rw/1", 20_000, 0).await;
    assert_eq!((w.status, w.code()), (409, "lock_held"), "{}", w.body);
    let write = |wait: u64| json!({"mode": "write", "ttl_ms": 20_000, "wait_ms": wait});
    let writer = in_background(b, &path("acquire"), write(20_000 * f));
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Writer preference: a new reader does not get in past the writer.
    let late_reader = a.post(&path("acquire"), read(20_000, 200)).await;
    assert_eq!(
        (late_reader.status, late_reader.code()),
        (409, "lock_held"),
        "a reader got in while a writer waited: {}",
        late_reader.body
    );
    // A read lease renews, keeps alive and releases under the lock's key.
    let renewed = a
        .post(
            &path("renew"),
            json!({"lease_id": r1.lease(), "ttl_ms": 30_000}),
        )
        .await;
    assert_eq!(
        (renewed.status, renewed.body["mode"].as_str()),
        (200, Some("read")),
        "{}",
        renewed.body
    );
    let kept = a
        .post(&path("keepalive"), json!({"lease_id": r1.lease()}))
        .await;
    assert_eq!(kept.body["alive"], true, "{}", kept.body);
    let gone = a
        .post(&path("release"), json!({"lease_id": r1.lease()}))
        .await;
    assert_eq!(
        (gone.status, gone.body["released"].as_bool()),
        (200, Some(true)),
        "{}",
        gone.body
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !writer.is_finished(),
        "the writer got in while a reader held the key"
    );
    let released_at = std::time::Instant::now();
    let gone = b
        .post(&path("release"), json!({"lease_id": r2.lease()}))
        .await;
    assert_eq!(gone.status, 200, "{}", gone.body);
    let w = writer.await.unwrap();
    assert_eq!(w.status, 200, "{}", w.body);
    assert!(w.token() > r2.token(), "{} {}", r2.body, w.body);
    assert!(w.body.get("mode").is_none(), "{}", w.body);
    assert!(
        released_at.elapsed() < Duration::from_millis(1_500 * f),
        "the last reader's release did not hand the key over: {:?}",
        released_at.elapsed()
    );
    // Readers waiting for the writer all get in at its release.
    let readers: Vec<_> = (0..2)
        .map(|_| in_background(a, &path("acquire"), read(20_000, 20_000 * f)))
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released_at = std::time::Instant::now();
    let gone = b
        .post(&path("release"), json!({"lease_id": w.lease()}))
        .await;
    assert_eq!(gone.status, 200, "{}", gone.body);
    let mut tokens = vec![];
    let mut woken = vec![];
    for r in readers {
        let r = r.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.token() > w.token(), "{} {}", w.body, r.body);
        tokens.push(r.token());
        woken.push(r.lease());
    }
    assert_ne!(tokens[0], tokens[1]);
    assert!(
        released_at.elapsed() < Duration::from_millis(1_500 * f),
        "readers waited {:?} after the writer's release",
        released_at.elapsed()
    );
    // A writer that gives up (its wait ran out) keeps new readers out for
    // a couple of seconds at most — its last mark — not for the readers'
    // whole leases.
    let r5 = a.post(&path("acquire"), read(20_000, 0)).await;
    assert_eq!(r5.status, 200, "{}", r5.body);
    let w = b.post(&path("acquire"), write(300)).await;
    assert_eq!((w.status, w.code()), (409, "lock_held"), "{}", w.body);
    let asked = std::time::Instant::now();
    let r6 = a.post(&path("acquire"), read(20_000, 10_000)).await;
    assert_eq!(r6.status, 200, "{}", r6.body);
    assert!(
        asked.elapsed() < Duration::from_millis(3_500 * f),
        "a writer that gave up kept readers out {:?}",
        asked.elapsed()
    );
    // A read lease as a hold stream: its first line says so, and closing
    // the stream gives it back (a writer gets in once the other readers
    // went too).
    for l in woken.into_iter().chain([r5.lease(), r6.lease()]) {
        let gone = a.post(&path("release"), json!({"lease_id": l})).await;
        assert_eq!(gone.status, 200, "{}", gone.body);
    }
    let mut stream = a
        .http
        .post(format!("{}{}", a.api, path("hold")))
        .body(json!({"mode": "read", "ttl_ms": 20_000}).to_string())
        .send()
        .await
        .unwrap();
    let first = stream.chunk().await.unwrap().unwrap_or_default();
    let first: serde_json::Value =
        serde_json::from_slice(first.split(|b| *b == b'\n').next().unwrap()).unwrap();
    assert_eq!(
        (first["type"].as_str(), first["mode"].as_str()),
        (Some("acquired"), Some("read")),
        "{first}"
    );
    drop(stream);
    let closed = std::time::Instant::now();
    let w = b.post(&path("acquire"), write(10_000 * f)).await;
    assert_eq!(w.status, 200, "{}", w.body);
    assert!(
        closed.elapsed() < Duration::from_millis(2_500 * f),
        "the closed read hold was given back after {:?}",
        closed.elapsed()
    );
    b.post(&path("release"), json!({"lease_id": w.lease()}))
        .await;
    // Counted apart, as well as with every acquisition.
    let timeouts = a
        .metric("fencer_read_acquisitions_total", &[("result", "timeout")])
        .await;
    assert!(timeouts >= 1.0, "{timeouts}");
    assert!(
        a.metric("fencer_read_acquisitions_total", &[("result", "acquired")])
            .await
            >= 3.0
    );
    // Bad input.
    let bad = a.post(&path("acquire"), json!({"mode": "exclusive"})).await;
    assert_eq!(
        (bad.status, bad.body["field"].as_str()),
        (400, Some("mode")),
        "{}",
        bad.body
    );
    let bad = a
        .post(
            &path("acquire"),
            json!({"mode": "read", "reentrant": true, "owner": "o"}),
        )
        .await;
    assert_eq!(
        (bad.status, bad.body["field"].as_str()),
        (400, Some("mode")),
        "{}",
        bad.body
    );
}

macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name(super::Backend::Memory).await }
            )*
        }
        mod redis_single {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name(super::Backend::Redis).await }
            )*
        }
        mod redis_sentinel {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name(super::Backend::RedisSentinel).await }
            )*
        }
        mod redis_cluster {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name(super::Backend::RedisCluster).await }
            )*
        }
        mod redlock {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name(super::Backend::RedLock).await }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name(super::Backend::Postgres).await }
            )*
        }
        mod zookeeper {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name(super::Backend::ZooKeeper).await }
            )*
        }
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name(super::Backend::MySql).await }
            )*
        }
        mod etcd {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name(super::Backend::Etcd).await }
            )*
        }
    };
}

suite!(
    mutual_exclusion,
    tokens_strictly_increase,
    other_lease_cannot_release_or_renew,
    expired_lease_release_is_lease_lost,
    ttl_expiry_lets_next_in_and_renew_extends,
    waiter_woken_by_release,
    waiters_are_fifo,
    wait_times_out,
    get_and_list,
    bad_inputs,
    shutdown_releases_leases,
    hold_is_released_when_the_client_dies,
    hold_keeps_the_lock_while_open,
    auto_renew_follows_the_application,
    max_hold_caps_renewal,
    lock_delay_after_expiry,
    backend_view,
    reentrant_locks,
    semaphores,
    multi_key_locks,
    read_write_locks,
    shutdown_closes_hold_streams,
);

/// A multi-key acquire whose client goes away while it waits for its
/// second key gives back the first at once (not at its TTL); one that
/// times out answers only after giving it back. Mutant: `multi_keys_kept`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_key_acquire_whose_client_left_gives_back_what_it_took() {
    let s = Fencer::sidecar(Backend::Memory, None, &[]);
    let b = s.acquire("left:b", 30_000, 0).await;
    assert_eq!(b.status, 200, "{}", b.body);
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let gone = impatient
        .post(format!("{}/v1/locks/acquire", s.api))
        .body(json!({"keys": ["left:a", "left:b"], "ttl_ms": 30_000, "wait_ms": 5_000}).to_string())
        .send()
        .await;
    assert!(gone.is_err(), "answered while left:b was held: {gone:?}");
    let a = s.acquire("left:a", 30_000, 2_000).await;
    assert_eq!(
        a.status, 200,
        "left:a was kept for a client that left: {}",
        a.body
    );
}

/// The backend view is bounded: past `sidecar.backend_view_per_second` (a
/// burst of as many) it answers 429 `rate_limited` with `retry_after_ms`,
/// counted; 0 turns it off; a bad `scope` or an unknown parameter is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_view_is_rate_limited_off_at_zero_and_validated() {
    let s = Fencer::sidecar(
        Backend::Memory,
        None,
        &[("sidecar.backend_view_per_second", "3")],
    );
    let mut codes = Vec::new();
    for _ in 0..6 {
        let r = view(&s, "rl:1").await;
        codes.push((r.status, r.code().to_owned()));
        if r.status == 429 {
            assert!(
                r.body["retry_after_ms"].as_u64().unwrap() >= 1,
                "{}",
                r.body
            );
        }
    }
    let ok = codes.iter().filter(|(s, _)| *s == 200).count();
    let limited = codes
        .iter()
        .filter(|c| **c == (429, "rate_limited".to_owned()))
        .count();
    assert_eq!((ok, limited), (3, 3), "{codes:?}");
    assert_eq!(
        s.metric("fencer_backend_views_total", &[("result", "rate_limited")])
            .await,
        3.0
    );
    assert_eq!(
        s.metric("fencer_backend_views_total", &[("result", "free")])
            .await,
        3.0
    );
    // The bucket refills: a read later goes through.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(view(&s, "rl:1").await.status, 200);
    for (query, field) in [
        ("scope=everywhere", "scope"),
        ("scope=backend&x=1", "query"),
    ] {
        let r = s
            .get(&format!("{}?{query}", Fencer::path("rl:1", "")))
            .await;
        assert_eq!((r.status, r.code()), (400, "invalid_request"), "{}", r.body);
        assert_eq!(r.body["field"], field, "{}", r.body);
    }
    let off = Fencer::sidecar(
        Backend::Memory,
        None,
        &[("sidecar.backend_view_per_second", "0")],
    );
    let r = view(&off, "rl:1").await;
    assert_eq!((r.status, r.code()), (400, "view_off"), "{}", r.body);
}
