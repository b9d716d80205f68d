//! The Redis settings fencer's guarantees depend on, checked by fencer
//! itself (issue 26 items 4 and 6; PITFALLS §14 and §3).
//!
//! - Eviction: under `maxmemory-policy volatile-*` Redis evicts keys with a
//!   TTL first — fencer's lock entries are its only such keys — and grants
//!   an evicted lock again while its holder still reports it held. A
//!   sidecar must not become ready (and must refuse acquires, 503
//!   `backend_unavailable` naming server and policy) while any master it
//!   writes to says anything but `noeviction`: single, Sentinel (at start
//!   and after a failover), Cluster (every master) and RedLock (every
//!   master); a live `CONFIG SET` is noticed within
//!   `eviction_check_interval_ms`, a reconnect re-reads at once, and
//!   `allow_eviction` turns the refusal into a warning.
//! - `token_mode = "counter"` with a replicated topology reissues tokens
//!   after a lossy failover (`redis_topologies::lossy_failover_with_counter_tokens_reissues_a_token`);
//!   `check-config` refuses it unless `allow_counter_with_failover`.
//!
//! Every Redis here is a real `redis-server` the test starts.

mod common;

use std::time::{Duration, Instant};

use common::redis_topology::{ClusterSet, SentinelOpts, SentinelSet};
use common::*;

fn policy_args(policy: &str) -> Vec<String> {
    vec!["--maxmemory-policy".into(), policy.into()]
}

fn config_set(conn: &mut redis::Connection, field: &str, value: &str) {
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg(field)
        .arg(value)
        .query(conn)
        .unwrap();
}

/// `/readyz?backend=1`: the backend's state now (plain `/readyz` stays
/// ready once the backend answered, by design; see README, "The lock API").
fn backend_ready(s: &Fencer) -> bool {
    http_ok(&format!("{}/readyz?backend=1", s.admin))
}

/// Asserts an acquire is refused for the eviction policy `policy` of
/// `server`; retries briefly while the refusal is about something else
/// (a topology not found yet), never accepts a 200.
async fn assert_refused_for(s: &Fencer, key: &str, policy: &str, server: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = s.acquire(key, 10_000, 0).await;
        assert_ne!(
            r.status, 200,
            "acquired on a Redis with maxmemory-policy {policy}: {}",
            r.body
        );
        let message = r.body["message"].as_str().unwrap_or("").to_owned();
        if r.status == 503 && message.contains(policy) {
            assert_eq!(r.code(), "backend_unavailable", "{}", r.body);
            assert!(message.contains(server), "{message}");
            assert!(message.contains("noeviction"), "{message}");
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never refused for {policy}: {}\n{}",
            r.body,
            s.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits for `f` up to `limit`; returns the time it took.
async fn within(limit: Duration, what: &str, mut f: impl AsyncFnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < limit, "{what} not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    start.elapsed()
}

// ------------------------------------------------------------ single

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_redis_that_may_evict_is_not_ready_and_refuses_acquires() {
    let redis = RedisServer::start_with(Persistence::Off, &policy_args("volatile-lru"), None);
    let s = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    let server = format!("127.0.0.1:{}", redis.port);
    assert_refused_for(&s, "acct", "volatile-lru", &server).await;
    assert!(!http_ok(&format!("{}/readyz", s.admin)), "{}", s.logs());
    assert!(!backend_ready(&s));
    let left: Vec<String> = redis::cmd("KEYS")
        .arg("fencer:*")
        .query(&mut redis.conn())
        .unwrap();
    assert!(left.is_empty(), "the refused acquire wrote {left:?}");
    assert_eq!(
        s.metric("fencer_redis_eviction_safe", &[("mode", "single")])
            .await,
        0.0
    );
    assert_eq!(
        s.metric(
            "fencer_redis_maxmemory_policy",
            &[("policy", "volatile-lru")]
        )
        .await,
        1.0
    );
    assert!(
        s.logs().contains("redis may evict live lock entries"),
        "{}",
        s.logs()
    );
}

/// Ready with `noeviction`; an operator's live `CONFIG SET maxmemory-policy
/// allkeys-lru` is noticed within the check interval (acquires refused,
/// the lease already held keeps renewing), and `noeviction` again lifts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_policy_change_is_noticed_within_the_check_interval() {
    let redis = RedisServer::start(Persistence::Off);
    let s = Fencer::sidecar(
        Backend::Redis,
        Some(&redis.url()),
        &[("backend.redis.eviction_check_interval_ms", "200")],
    );
    s.wait_ready();
    let held = s.acquire("held", 30_000, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);
    assert_eq!(
        s.metric("fencer_redis_eviction_safe", &[("mode", "single")])
            .await,
        1.0
    );
    let mut conn = redis.conn();
    config_set(&mut conn, "maxmemory-policy", "allkeys-lru");
    let took = within(
        Duration::from_secs(3),
        "refusal after CONFIG SET",
        async || !backend_ready(&s),
    )
    .await;
    eprintln!("live policy change noticed after {took:?}");
    assert_refused_for(
        &s,
        "acct",
        "allkeys-lru",
        &format!("127.0.0.1:{}", redis.port),
    )
    .await;
    // A lease already held is not cut: its renewals go on (an evicted
    // entry would show as lease_lost at the next one).
    let renewed = s.renew("held", &held.lease(), 30_000).await;
    assert_eq!(renewed.status, 200, "{}", renewed.body);
    config_set(&mut conn, "maxmemory-policy", "noeviction");
    within(Duration::from_secs(3), "ready again", async || {
        backend_ready(&s)
    })
    .await;
    let r = s.acquire("acct", 10_000, 0).await;
    assert_eq!(r.status, 200, "{}", r.body);
}

/// A reconnect re-reads the policy at once: with a check interval far
/// beyond the test, a policy changed while fencer's connections are cut is
/// seen when they come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_reads_the_policy_again() {
    let redis = RedisServer::start(Persistence::Off);
    let s = Fencer::sidecar(
        Backend::Redis,
        Some(&redis.url()),
        &[("backend.redis.eviction_check_interval_ms", "600000")],
    );
    s.wait_ready();
    let r = s.acquire("a", 10_000, 0).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let mut conn = redis.conn();
    config_set(&mut conn, "maxmemory-policy", "volatile-ttl");
    let _: () = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .query(&mut conn)
        .unwrap();
    assert_refused_for(
        &s,
        "b",
        "volatile-ttl",
        &format!("127.0.0.1:{}", redis.port),
    )
    .await;
}

/// The opt-out: ready, acquires granted, a warning at start and at every
/// check, and the metrics say what is going on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_eviction_makes_it_a_warning() {
    let redis = RedisServer::start_with(Persistence::Off, &policy_args("volatile-lru"), None);
    let s = Fencer::sidecar(
        Backend::Redis,
        Some(&redis.url()),
        &[
            ("backend.redis.allow_eviction", "true"),
            ("backend.redis.eviction_check_interval_ms", "200"),
        ],
    );
    s.wait_ready();
    let r = s.acquire("acct", 10_000, 0).await;
    assert_eq!(r.status, 200, "{}", r.body);
    within(Duration::from_secs(3), "two warnings", async || {
        s.logs().matches("allowed by the setting").count() >= 2
    })
    .await;
    assert!(s.logs().contains("eviction check is advisory"));
    assert_eq!(s.metric("fencer_redis_eviction_allowed", &[]).await, 1.0);
    assert_eq!(
        s.metric("fencer_redis_eviction_safe", &[("mode", "single")])
            .await,
        0.0
    );
}

/// Why the check exists: with the opt-out, a short memory squeeze under
/// `volatile-lru` evicts a live lock entry (the only key with a TTL) and a
/// second sidecar is granted the key while the first still holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_grants_a_held_lock_to_a_second_holder() {
    let redis = RedisServer::start_with(Persistence::Off, &policy_args("volatile-lru"), None);
    let allow = [("backend.redis.allow_eviction", "true")];
    let a = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &allow);
    let b = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &allow);
    let first = a.acquire("acct", 60_000, 0).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let refused = b.acquire("acct", 60_000, 0).await;
    assert_eq!(refused.status, 409, "{}", refused.body);
    let mut conn = redis.conn();
    config_set(&mut conn, "maxmemory", "1");
    let _ = redis::cmd("SET")
        .arg("filler")
        .arg("x")
        .query::<redis::Value>(&mut conn);
    let lock: bool = redis::cmd("EXISTS")
        .arg("fencer:{acct}:lock")
        .query(&mut conn)
        .unwrap();
    config_set(&mut conn, "maxmemory", "0");
    assert!(!lock, "the lock entry was not evicted");
    let second = b.acquire("acct", 60_000, 0).await;
    assert_eq!(second.status, 200, "{}", second.body);
    let view = a.get(&Fencer::path("acct", "")).await;
    assert_eq!(view.body["state"], "held", "{}", view.body);
    eprintln!(
        "two holders: token {} (sidecar a, still held) and {} (sidecar b)",
        first.token(),
        second.token()
    );
}

// ------------------------------------------------------------ topologies

/// Sentinel: the master's policy is read at start, and the new master's
/// after a failover (the check interval is far beyond the test, so only
/// the failover can have triggered the second read).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_master_policy_is_checked_at_start_and_after_a_failover() {
    let set = SentinelSet::start(SentinelOpts {
        replicas: 1,
        sentinels: 1,
        ..SentinelOpts::default()
    });
    let sentinels = set.sentinel_addrs().join(",");
    let settings = [
        ("backend.redis.mode", "sentinel"),
        ("backend.redis.sentinels", sentinels.as_str()),
        ("backend.redis.master_name", set.master_name()),
        ("backend.redis.eviction_check_interval_ms", "600000"),
        ("proxy.enabled", "false"),
    ];
    let old = set.master_port();
    let replica = set.node_ports().into_iter().find(|p| *p != old).unwrap();
    config_set(&mut set.node_conn(old), "maxmemory-policy", "volatile-lru");
    let a = Fencer::sidecar(Backend::RedisSentinel, None, &settings);
    assert_refused_for(&a, "acct", "volatile-lru", &format!("127.0.0.1:{old}")).await;
    assert!(!backend_ready(&a));
    drop(a);

    config_set(&mut set.node_conn(old), "maxmemory-policy", "noeviction");
    config_set(
        &mut set.node_conn(replica),
        "maxmemory-policy",
        "volatile-ttl",
    );
    let b = Fencer::sidecar(Backend::RedisSentinel, None, &settings);
    within(
        Duration::from_secs(20),
        "sentinel sidecar ready",
        async || backend_ready(&b),
    )
    .await;
    let r = b.acquire("acct", 10_000, 0).await;
    assert_eq!(r.status, 200, "{}", r.body);
    set.failover();
    let new = set.wait_new_master(old, Duration::from_secs(20));
    assert_eq!(new, replica);
    // Until the sidecar follows, it writes to the old master (noeviction).
    within(
        Duration::from_secs(10),
        "the sidecar to follow",
        async || b.metric("fencer_redis_failovers_total", &[]).await >= 1.0,
    )
    .await;
    assert_refused_for(&b, "other", "volatile-ttl", &format!("127.0.0.1:{new}")).await;
    assert_eq!(
        b.metric("fencer_redis_eviction_safe", &[("mode", "sentinel")])
            .await,
        0.0
    );
}

/// Cluster: every master is checked; one with a bad policy stops the
/// backend, and it recovers when that master says `noeviction`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_one_evicting_master_is_not_ready() {
    let c = ClusterSet::start(3, 0);
    let bad = c.node_ports()[1];
    config_set(&mut c.conn(bad), "maxmemory-policy", "allkeys-lfu");
    let nodes = c.node_urls().join(",");
    let s = Fencer::sidecar(
        Backend::RedisCluster,
        None,
        &[
            ("backend.redis.mode", "cluster"),
            ("backend.redis.nodes", nodes.as_str()),
            ("backend.redis.eviction_check_interval_ms", "200"),
            ("proxy.enabled", "false"),
        ],
    );
    assert_refused_for(&s, "acct", "allkeys-lfu", &format!("127.0.0.1:{bad}")).await;
    assert!(!backend_ready(&s));
    assert_eq!(
        s.metric("fencer_redis_maxmemory_policy", &[("policy", "noeviction")])
            .await,
        2.0
    );
    config_set(&mut c.conn(bad), "maxmemory-policy", "noeviction");
    within(Duration::from_secs(5), "cluster ready", async || {
        backend_ready(&s)
    })
    .await;
    let r = s.acquire("acct", 10_000, 0).await;
    assert_eq!(r.status, 200, "{}", r.body);
}

/// RedLock: one master of three with `allkeys-lru` stops the backend (an
/// evicting master forgets grants, like one restarted empty).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redlock_master_that_may_evict_stops_the_backend() {
    let masters = [
        RedisServer::start(Persistence::Off),
        RedisServer::start(Persistence::Off),
        RedisServer::start_with(Persistence::Off, &policy_args("allkeys-lru"), None),
    ];
    let urls: Vec<String> = masters.iter().map(RedisServer::url).collect();
    let urls = urls.join(",");
    let s = Fencer::sidecar(
        Backend::RedLock,
        None,
        &[
            ("backend.redlock.urls", urls.as_str()),
            ("backend.redlock.restart_quarantine_ms", "0"),
            ("backend.redlock.eviction_check_interval_ms", "200"),
        ],
    );
    assert_refused_for(
        &s,
        "acct",
        "allkeys-lru",
        &format!("127.0.0.1:{}", masters[2].port),
    )
    .await;
    assert!(!backend_ready(&s));
    assert_eq!(
        s.metric("fencer_redlock_eviction_safe", &[("master", "2")])
            .await,
        0.0
    );
    assert_eq!(
        s.metric("fencer_redlock_eviction_safe", &[("master", "0")])
            .await,
        1.0
    );
    config_set(&mut masters[2].conn(), "maxmemory-policy", "noeviction");
    within(Duration::from_secs(5), "redlock ready", async || {
        backend_ready(&s)
    })
    .await;
    let r = s.acquire("acct", 10_000, 0).await;
    assert_eq!(r.status, 200, "{}", r.body);
}

// ------------------------------------------------------------ counter tokens

fn check_config(env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = std::process::Command::new(fencer_bin());
    cmd.arg("check-config").env_remove("FENCER_CONFIG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// `counter` tokens with Sentinel, Cluster or `wait_replicas` are refused by
/// `check-config` (exit 2, naming the field and the override), accepted
/// with `allow_counter_with_failover`, and on a single server.
#[test]
fn counter_tokens_with_a_replicated_redis_are_refused() {
    let sentinel = [
        ("FENCER__BACKEND__KIND", "redis"),
        ("FENCER__BACKEND__REDIS__MODE", "sentinel"),
        ("FENCER__BACKEND__REDIS__SENTINELS", "10.0.0.1:26379"),
        ("FENCER__BACKEND__REDIS__MASTER_NAME", "locks"),
        ("FENCER__BACKEND__REDIS__TOKEN_MODE", "counter"),
    ];
    let cluster = [
        ("FENCER__BACKEND__KIND", "redis"),
        ("FENCER__BACKEND__REDIS__MODE", "cluster"),
        ("FENCER__BACKEND__REDIS__NODES", "redis://10.0.0.1:6379"),
        ("FENCER__BACKEND__REDIS__TOKEN_MODE", "counter"),
    ];
    let waited = [
        ("FENCER__BACKEND__KIND", "redis"),
        ("FENCER__BACKEND__REDIS__WAIT_REPLICAS", "1"),
        ("FENCER__BACKEND__REDIS__TOKEN_MODE", "counter"),
    ];
    for (name, env) in [
        ("sentinel", &sentinel[..]),
        ("cluster", &cluster[..]),
        ("wait_replicas", &waited[..]),
    ] {
        let out = check_config(env);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {err}");
        assert!(err.contains("backend.redis.token_mode"), "{name}: {err}");
        assert!(err.contains("allow_counter_with_failover"), "{name}: {err}");
        assert!(err.contains("hybrid_clock"), "{name}: {err}");
        let mut allowed = env.to_vec();
        allowed.push((
            "FENCER__BACKEND__REDIS__ALLOW_COUNTER_WITH_FAILOVER",
            "true",
        ));
        let out = check_config(&allowed);
        assert!(
            out.status.success(),
            "{name} with the override: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let single = [
        ("FENCER__BACKEND__KIND", "redis"),
        ("FENCER__BACKEND__REDIS__TOKEN_MODE", "counter"),
    ];
    let out = check_config(&single);
    assert!(
        out.status.success(),
        "single: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The default token mode is fine with every topology.
    let out = check_config(&sentinel[..4]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
