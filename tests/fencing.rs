//! Fencing end to end with real processes: the egress proxy, the gateway
//! and its fence stores, token signatures, pre-registration.

mod common;

use std::time::{Duration, Instant};

use common::postgres::PgServer;
use common::upstream::Recorder;
use common::*;
use fencer::token::{Claim, Mode, Signer};
use serde_json::json;

/// storage <- gateway (memory fences) <- sidecar (memory locks, proxy to the
/// gateway, pre-registration on).
struct Stack {
    storage: Fencer,
    gateway: Fencer,
    sidecar: Fencer,
}

fn prefix(gateway: &Fencer) -> String {
    format!("{}/_fencer/v1/fences/", gateway.api)
}

fn stack(gateway_extra: &[(&str, &str)], sidecar_extra: &[(&str, &str)]) -> Stack {
    let storage = Fencer::storage(&[]);
    let gateway = Fencer::gateway(&storage.api, gateway_extra);
    let pre = prefix(&gateway);
    let mut extra = vec![
        ("proxy.upstream", gateway.api.as_str()),
        ("sidecar.preregister_url", pre.as_str()),
    ];
    extra.extend_from_slice(sidecar_extra);
    let sidecar = Fencer::sidecar(Backend::Memory, None, &extra);
    Stack {
        storage,
        gateway,
        sidecar,
    }
}

fn signer() -> Signer {
    Signer::new("k1", SECRET.as_bytes())
}

fn sign(key: &str, token: u64, lease: &str) -> String {
    signer().sign(&Claim::new(key, token, lease))
}

async fn put(s: &Fencer, url: &str, headers: &[(&str, &str)], balance: i64) -> Resp {
    send(
        &s.http,
        "PUT",
        url,
        headers,
        Some(&json!({ "balance": balance }).to_string()),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_through_the_proxy_carries_the_lease_token_to_storage() {
    let st = stack(&[], &[]);
    let s = &st.sidecar;
    let lease = s.acquire("account:1", 10_000, 0).await;
    assert_eq!(lease.status, 200);
    let url = format!("{}/kv/accounts/1", s.proxy);
    let w = put(s, &url, &[("Fencing-Lease", &lease.lease())], 100).await;
    assert_eq!(w.status, 200, "{}", w.body);
    // A fenced read through the proxy too.
    let r = send(
        &s.http,
        "GET",
        &url,
        &[("Fencing-Lease", &lease.lease())],
        None,
    )
    .await;
    assert_eq!(r.body["value"]["balance"], 100);
    let log = send(
        &s.http,
        "GET",
        &format!("{}/_log/accounts/1", st.storage.api),
        &[],
        None,
    )
    .await;
    assert_eq!(log.body["writes"][0]["token"], lease.token());
    assert!(
        s.metric("fencer_preregistrations_total", &[("result", "ok")])
            .await
            >= 1.0
    );
    assert_eq!(
        st.gateway
            .metric(
                "fencer_gateway_requests_total",
                &[("kind", "write"), ("result", "accepted")]
            )
            .await,
        1.0
    );
}

/// The seeds' story: holder 1 pauses past its lease, holder 2 gets a higher
/// token; holder 1's write is refused by the gateway (409 with both tokens)
/// and, through the proxy, already by its sidecar (409 lease_lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_token_is_rejected_after_a_newer_one_was_registered() {
    let st = stack(&[], &[]);
    let s = &st.sidecar;
    let first = s.acquire("account:9", 200, 0).await;
    let second = s.acquire("account:9", 10_000, 5_000).await;
    assert_eq!(second.status, 200, "{}", second.body);
    assert!(second.token() > first.token());
    let url = format!("{}/kv/accounts/9", st.gateway.api);
    let old = first.body["fencing_token"].as_str().unwrap().to_owned();
    let w = put(s, &url, &[("Fencing-Token", &old)], 1).await;
    assert_eq!(
        (w.status, w.code()),
        (409, "stale_fencing_token"),
        "{}",
        w.body
    );
    assert_eq!(w.body["token"], first.token());
    assert_eq!(w.body["highest_seen"], second.token());
    assert_eq!(w.body["key"], "account:9");
    let via_proxy = put(
        s,
        &format!("{}/kv/accounts/9", s.proxy),
        &[
            ("Fencing-Lock", "account:9"),
            ("Fencing-Lease", &first.lease()),
        ],
        1,
    )
    .await;
    assert_eq!((via_proxy.status, via_proxy.code()), (409, "lease_lost"));
    // The storage never saw a write.
    let log = send(
        &s.http,
        "GET",
        &format!("{}/_log/accounts/9", st.storage.api),
        &[],
        None,
    )
    .await;
    assert_eq!(log.body["writes"].as_array().unwrap().len(), 0);
    // The new holder writes fine.
    let fresh = second.body["fencing_token"].as_str().unwrap().to_owned();
    assert_eq!(
        put(s, &url, &[("Fencing-Token", &fresh)], 2).await.status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_inflated_and_misused_tokens_are_refused_and_move_nothing() {
    let st = stack(&[], &[]);
    let s = &st.sidecar;
    let g = &st.gateway;
    let url = format!("{}/kv/accounts/5", g.api);
    // No token on a write.
    let w = put(s, &url, &[], 1).await;
    assert_eq!((w.status, w.code()), (428, "fencing_token_required"));
    // Reads without a token pass unchecked.
    let r = send(&s.http, "GET", &url, &[], None).await;
    assert_eq!(r.status, 404);

    let lease = s.acquire("account:5", 10_000, 0).await;
    let good = lease.body["fencing_token"].as_str().unwrap().to_owned();
    // Forged: valid format, wrong secret, a huge token.
    let forged = Signer::new("k1", b"not-the-secret-not-the-secret-not-the-secret")
        .sign(&Claim::new("account:5", 9_000_000_000_000_000, "evil"));
    // Inflated: a real token with its number changed.
    let inflated = good.replacen(&format!(".{}.", lease.token()), ".9223372036854775807.", 1);
    // A real token under an unknown key id.
    let unknown_kid = good.replacen("v2.k1.", "v2.k9.", 1);
    assert_ne!(unknown_kid, good);
    for bad in [&forged, &inflated, &unknown_kid, &"garbage".to_owned()] {
        let w = put(s, &url, &[("Fencing-Token", bad)], 666).await;
        assert_eq!(
            (w.status, w.code()),
            (403, "invalid_fencing_token"),
            "{bad}: {}",
            w.body
        );
    }
    // A token for another key.
    let other = s.acquire("account:6", 10_000, 0).await;
    let other_tok = other.body["fencing_token"].as_str().unwrap().to_owned();
    let w = put(
        s,
        &url,
        &[("Fencing-Token", &other_tok), ("Fencing-Key", "account:5")],
        1,
    )
    .await;
    assert_eq!((w.status, w.code()), (403, "invalid_fencing_token"));
    // None of that moved the mark: the honest holder still writes.
    let w = put(s, &url, &[("Fencing-Token", &good)], 1).await;
    assert_eq!(w.status, 200, "{}", w.body);
    let forged_pre = send(
        &s.http,
        "POST",
        &format!("{}account:5", prefix(g)),
        &[("Fencing-Token", &forged)],
        None,
    )
    .await;
    assert_eq!(forged_pre.status, 403);
    assert_eq!(
        put(s, &url, &[("Fencing-Token", &good)], 2).await.status,
        200
    );
}

/// A token value belongs to one lease: the same number from another lease
/// (e.g. a counter reissued after a Redis failover) is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_equal_token_from_another_lease_is_refused() {
    let st = stack(&[], &[]);
    let s = &st.sidecar;
    let url = format!("{}/kv/accounts/3", st.gateway.api);
    let holder = sign("account:3", 34, "lease-a");
    assert_eq!(
        put(s, &url, &[("Fencing-Token", &holder)], 1).await.status,
        200
    );
    assert_eq!(
        put(s, &url, &[("Fencing-Token", &holder)], 2).await.status,
        200,
        "same lease writes again"
    );
    let twin = sign("account:3", 34, "lease-b");
    let w = put(s, &url, &[("Fencing-Token", &twin)], 3).await;
    assert_eq!(
        (w.status, w.code()),
        (409, "stale_fencing_token"),
        "{}",
        w.body
    );
    assert_eq!(w.body["highest_seen"], 34);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_strips_application_fencing_headers() {
    let st = stack(&[], &[]);
    let s = &st.sidecar;
    let url = format!("{}/kv/accounts/4", s.proxy);
    // No lock named: the application's own token is stripped, so the
    // gateway sees a write without a token.
    let forged = sign("account:4", u64::from(u32::MAX), "mine");
    let w = put(
        s,
        &url,
        &[("Fencing-Token", &forged), ("Fencing-Key", "account:4")],
        1,
    )
    .await;
    assert_eq!(
        (w.status, w.code()),
        (428, "fencing_token_required"),
        "{}",
        w.body
    );
    // With the lock: the sidecar's token replaces the application's.
    let lease = s.acquire("account:4", 10_000, 0).await;
    let w = put(
        s,
        &url,
        &[
            ("Fencing-Lease", &lease.lease()),
            ("Fencing-Token", &forged),
        ],
        1,
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
    let log = send(
        &s.http,
        "GET",
        &format!("{}/_log/accounts/4", st.storage.api),
        &[],
        None,
    )
    .await;
    assert_eq!(log.body["writes"][0]["token"], lease.token());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_refuses_unheld_lost_and_rebound_leases() {
    let st = stack(&[], &[]);
    let s = &st.sidecar;
    let url = format!("{}/kv/accounts/8", s.proxy);
    let w = put(s, &url, &[("Fencing-Lock", "account:8")], 1).await;
    assert_eq!((w.status, w.code()), (428, "lease_required"), "{}", w.body);
    let w = put(s, &url, &[("Fencing-Lease", "never-issued")], 1).await;
    assert_eq!((w.status, w.code()), (428, "lock_not_held"), "{}", w.body);
    let long = "k".repeat(513);
    let w = put(s, &url, &[("Fencing-Lock", &long)], 1).await;
    assert_eq!((w.status, w.code()), (400, "invalid_request"));
    let old = s.acquire("account:8", 150, 0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let w = put(s, &url, &[("Fencing-Lease", &old.lease())], 1).await;
    assert_eq!((w.status, w.code()), (409, "lease_lost"), "{}", w.body);
    // Re-acquired: a write bound to the old lease is still refused.
    let new = s.acquire("account:8", 10_000, 0).await;
    assert_eq!(new.status, 200);
    let w = put(
        s,
        &url,
        &[
            ("Fencing-Lock", "account:8"),
            ("Fencing-Lease", &old.lease()),
        ],
        1,
    )
    .await;
    assert_eq!((w.status, w.code()), (409, "lease_lost"));
    let w = put(
        s,
        &url,
        &[
            ("Fencing-Lock", "account:8"),
            ("Fencing-Lease", &new.lease()),
        ],
        1,
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
    assert!(
        s.metric("fencer_proxy_requests_total", &[("result", "lease_lost")])
            .await
            >= 2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_name_locks_and_bind_paths_to_keys() {
    let storage = Fencer::storage(&[]);
    let routes = "[[gateway.routes]]\npath = \"/kv/accounts/{id}\"\nkey = \"account:{id}\"\n";
    let gateway = Fencer::gateway_with_config(&storage.api, routes, &[]);
    let sidecar_cfg = format!(
        "[proxy]\nupstream = \"{}\"\nrequire_lock_for_writes = true\n[[proxy.routes]]\npath = \"/kv/accounts/{{id}}\"\nkey = \"account:{{id}}\"\n",
        gateway.api
    );
    let s = Fencer::sidecar_with_config(Backend::Memory, &sidecar_cfg, &[]);
    let url = format!("{}/kv/accounts/7", s.proxy);
    // The route names account:7; a write must also name its lease.
    let w = put(&s, &url, &[], 1).await;
    assert_eq!((w.status, w.code()), (428, "lease_required"), "{}", w.body);
    // A write that maps to no route is refused under require_lock_for_writes.
    let w = put(&s, &format!("{}/kv/other", s.proxy), &[], 1).await;
    assert_eq!((w.status, w.code()), (428, "lock_not_held"));
    let seven = s.acquire("account:7", 10_000, 0).await;
    let eight = s.acquire("account:8", 10_000, 0).await;
    assert_eq!(
        put(&s, &url, &[("Fencing-Lease", &seven.lease())], 1)
            .await
            .status,
        200
    );
    // The path's key and the lease's must agree.
    let w = put(&s, &url, &[("Fencing-Lease", &eight.lease())], 1).await;
    assert_eq!((w.status, w.code()), (409, "lease_lost"), "{}", w.body);
    // At the gateway, account:7's token cannot write /kv/accounts/8.
    let tok = seven.body["fencing_token"].as_str().unwrap().to_owned();
    let w = put(
        &s,
        &format!("{}/kv/accounts/8", gateway.api),
        &[("Fencing-Token", &tok)],
        1,
    )
    .await;
    assert_eq!(
        (w.status, w.code()),
        (403, "invalid_fencing_token"),
        "{}",
        w.body
    );
}

/// 256 MiB through the proxy: the sidecar's peak memory stays far below it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_streams_large_bodies() {
    let upstream = Recorder::start().await;
    let url = upstream.url();
    let s = Fencer::sidecar(Backend::Memory, None, &[("proxy.upstream", url.as_str())]);
    let lease = s.acquire("big:1", 60_000, 0).await.lease();
    let before = peak_rss_kib(s.pid());
    const SIZE: u64 = 256 << 20;
    let port = s.proxy_port;
    let reply = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            conn,
            "PUT /blob HTTP/1.1\r\nHost: x\r\nFencing-Lease: {lease}\r\nContent-Length: {SIZE}\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let chunk = vec![b'x'; 1 << 16];
        for _ in 0..SIZE / chunk.len() as u64 {
            conn.write_all(&chunk).unwrap();
        }
        let mut out = String::new();
        conn.read_to_string(&mut out).unwrap();
        out
    })
    .await
    .unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.contains(&format!("\"bytes\":{SIZE}")), "{reply}");
    let grown = peak_rss_kib(s.pid()).saturating_sub(before);
    assert!(
        grown < 64 * 1024,
        "the proxy buffered: peak RSS grew by {grown} KiB"
    );
    assert_eq!(upstream.seen()[0].bytes, SIZE);
}

/// A request with token 34 is not forwarded until 33's request has finished
/// at the upstream, even though 33's upstream is slow.
async fn check_serialization(first_gw: &Fencer, second_gw: &Fencer, upstream: &Recorder) {
    let client = reqwest::Client::new();
    let t33 = sign("acct:s", 33, "a");
    let t34 = sign("acct:s", 34, "b");
    let (u1, u2) = (
        format!("{}/x", first_gw.api),
        format!("{}/x", second_gw.api),
    );
    let c1 = client.clone();
    let slow = tokio::spawn(async move {
        send(
            &c1,
            "PUT",
            &u1,
            &[("Fencing-Token", &t33), ("x-delay-ms", "600")],
            Some("{}"),
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let fast = send(&client, "PUT", &u2, &[("Fencing-Token", &t34)], Some("{}")).await;
    assert_eq!(slow.await.unwrap().status, 200);
    assert_eq!(fast.status, 200);
    let seen = upstream.seen();
    let a = seen.iter().find(|s| s.token == Some(33)).unwrap();
    let b = seen.iter().find(|s| s.token == Some(34)).unwrap();
    assert!(
        b.arrived >= a.finished,
        "34 was forwarded while 33 was still in flight"
    );
    // 33 again, after 34: refused.
    let late = send(
        &client,
        "PUT",
        &format!("{}/x", first_gw.api),
        &[("Fencing-Token", &sign("acct:s", 33, "a"))],
        Some("{}"),
    )
    .await;
    assert_eq!(late.code(), "stale_fencing_token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_serializes_fenced_requests_per_key() {
    let upstream = Recorder::start().await;
    let g = Fencer::gateway(&upstream.url(), &[]);
    check_serialization(&g, &g, &upstream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateway_replicas_on_one_postgres_serialize_and_share_marks() {
    let pg = PgServer::start();
    let upstream = Recorder::start().await;
    let extra = [
        ("gateway.fence_store", "postgres"),
        ("gateway.postgres_url", &pg.url() as &str),
    ];
    let g1 = Fencer::gateway(&upstream.url(), &extra);
    let g2 = Fencer::gateway(&upstream.url(), &extra);
    check_serialization(&g1, &g2, &upstream).await;
    // A mark written through one replica holds at the other.
    let client = reqwest::Client::new();
    let w = send(
        &client,
        "PUT",
        &format!("{}/y", g1.api),
        &[("Fencing-Token", &sign("acct:y", 50, "a"))],
        Some("{}"),
    )
    .await;
    assert_eq!(w.status, 200);
    let w = send(
        &client,
        "PUT",
        &format!("{}/y", g2.api),
        &[("Fencing-Token", &sign("acct:y", 49, "z"))],
        Some("{}"),
    )
    .await;
    assert_eq!((w.status, w.code()), (409, "stale_fencing_token"));
}

/// Group commit (issue 32): concurrent admissions of different keys share
/// one PostgreSQL statement, and each item still gets its own verdict. Every
/// key has tokens of its own (round × 100 + key number), so an answer
/// mapped to the wrong item shows as a wrong `highest_seen`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_gateway_commits_concurrent_admissions_together() {
    let pg = PgServer::start();
    let upstream = Recorder::start().await;
    let extra = [
        ("gateway.fence_store", "postgres"),
        ("gateway.postgres_url", &pg.url() as &str),
    ];
    let g = Fencer::gateway(&upstream.url(), &extra);
    let client = reqwest::Client::new();
    let url = format!("{}/b", g.api);
    let name = "fencer_gateway_fence_items_per_statement";
    let at_once = |token: fn(u64, u64) -> u64, lease: &'static str, round: u64| {
        let tasks: Vec<_> = (0..32u64)
            .map(|i| {
                let (client, url) = (client.clone(), url.clone());
                tokio::spawn(async move {
                    let t = sign(&format!("acct:b{i}"), token(round, i), lease);
                    (
                        i,
                        send(&client, "PUT", &url, &[("Fencing-Token", &t)], Some("{}")).await,
                    )
                })
            })
            .collect();
        async move {
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        }
    };
    let mut round = 0u64;
    loop {
        round += 1;
        // Fresh tokens: all accepted.
        for (i, r) in at_once(|round, i| round * 100 + i, "a", round).await {
            assert_eq!(r.status, 200, "acct:b{i}: {}", r.body);
        }
        // The same tokens from another lease: each refused against its own
        // key's mark.
        for (i, r) in at_once(|round, i| round * 100 + i, "z", round).await {
            assert_eq!(
                (r.status, r.code()),
                (409, "stale_fencing_token"),
                "acct:b{i}: {}",
                r.body
            );
            assert_eq!(r.body["highest_seen"], round * 100 + i, "acct:b{i}");
        }
        let m = g.metrics().await;
        let labels = [("store", "postgres"), ("op", "admit")];
        let statements = metric_sum(&m, &format!("{name}_count"), &labels);
        let items = metric_sum(&m, &format!("{name}_sum"), &labels);
        assert!(
            statements >= 1.0 && items >= 64.0 * round as f64,
            "{statements} {items}"
        );
        if items > statements {
            break;
        }
        assert!(
            round < 10,
            "no statement carried two admissions in {round} rounds of 64 concurrent writes"
        );
    }
    assert_eq!(upstream.seen().len() as u64, 32 * round);
}

/// Two replicas' shared admission statements lock shared rows in the same
/// (key) order, so they cannot deadlock. Made to happen for certain: a
/// third transaction holds `k1`; statement B (`k1, k2`) queues on it, then
/// statement A (`k2, k1`, in the order its requests arrived) starts. Taken
/// as given, A would lock `k2` and queue on `k1` behind B, and B, once it
/// has `k1`, would wait for `k2`: a deadlock, one of them aborted. In key
/// order A waits on `k1` holding nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_admission_statements_lock_rows_in_key_order() {
    let pg = PgServer::start();
    let upstream = Recorder::start().await;
    // The gateway creates the schema.
    let _g = Fencer::gateway(
        &upstream.url(),
        &[
            ("gateway.fence_store", "postgres"),
            ("gateway.postgres_url", &pg.url() as &str),
        ],
    );
    let connect = || async {
        let (c, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        c
    };
    let x = connect().await;
    x.batch_execute("INSERT INTO fencer_fences (key, token) VALUES ('k1', 1), ('k2', 1)")
        .await
        .unwrap();
    x.batch_execute("BEGIN; SELECT 1 FROM fencer_fences WHERE key = 'k1' FOR UPDATE")
        .await
        .unwrap();
    let waiting = |n: i64| {
        let url = pg.url();
        async move { pg_until_lock_waiters(&url, n).await }
    };
    let many = |keys: [&'static str; 2], token: i64| {
        let pg_url = pg.url();
        tokio::spawn(async move {
            let (c, conn) = tokio_postgres::connect(&pg_url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(conn);
            let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
            c.query(
                "SELECT * FROM fencer_gw_admit_many_v2($1, $2, $3, $4, $5, $6, $7)",
                &[
                    &keys,
                    &vec![token; 2],
                    &vec!["l".to_string(); 2],
                    &vec![-1i64; 2],
                    &vec![String::new(); 2],
                    &vec![0i64; 2],
                    &vec![false; 2],
                ],
            )
            .await
            .map(|rows| rows.len())
        })
    };
    let b = many(["k1", "k2"], 2);
    waiting(1).await;
    let a = many(["k2", "k1"], 3);
    // A queues too: on k1 in key order (on k2's lock only if it took k2).
    tokio::time::sleep(Duration::from_millis(300)).await;
    x.batch_execute("COMMIT").await.unwrap();
    assert_eq!(b.await.unwrap().expect("statement B"), 2);
    assert_eq!(a.await.unwrap().expect("statement A"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_gateway_keeps_its_marks() {
    let pg = PgServer::start_with(&[("synchronous_commit", "on")]);
    let upstream = Recorder::start().await;
    let extra = [
        ("gateway.fence_store", "postgres"),
        ("gateway.postgres_url", &pg.url() as &str),
    ];
    let mut g = Fencer::gateway(&upstream.url(), &extra);
    let client = reqwest::Client::new();
    let w = send(
        &client,
        "PUT",
        &format!("{}/r", g.api),
        &[("Fencing-Token", &sign("acct:r", 34, "b"))],
        Some("{}"),
    )
    .await;
    assert_eq!(w.status, 200);
    // The in-flight stamp is cleared just after the answer; a crash before
    // that leaves it to run out (tests/safety_regressions.rs covers that).
    tokio::time::sleep(Duration::from_millis(300)).await;
    g.kill();
    let g = Fencer::gateway(&upstream.url(), &extra);
    let w = send(
        &client,
        "PUT",
        &format!("{}/r", g.api),
        &[("Fencing-Token", &sign("acct:r", 33, "a"))],
        Some("{}"),
    )
    .await;
    assert_eq!(
        (w.status, w.code()),
        (409, "stale_fencing_token"),
        "{}",
        w.body
    );
    assert_eq!(w.body["highest_seen"], 34);
}

/// When the upstream does not answer in time, the write may still land:
/// the key stays blocked for `uncertain_hold_ms`, then frees up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_upstream_outcome_blocks_the_key_for_a_while() {
    let upstream = Recorder::start().await;
    let g = Fencer::gateway(
        &upstream.url(),
        &[
            ("gateway.upstream_timeout_ms", "200"),
            ("gateway.uncertain_hold_ms", "1500"),
            ("gateway.serialize_timeout_ms", "100"),
        ],
    );
    let client = reqwest::Client::new();
    let url = format!("{}/u", g.api);
    let w = send(
        &client,
        "PUT",
        &url,
        &[
            ("Fencing-Token", &sign("acct:u", 1, "a")),
            ("x-delay-ms", "1000"),
        ],
        Some("{}"),
    )
    .await;
    assert_eq!((w.status, w.code()), (504, "upstream_timeout"));
    let w = send(
        &client,
        "PUT",
        &url,
        &[("Fencing-Token", &sign("acct:u", 2, "b"))],
        Some("{}"),
    )
    .await;
    assert_eq!((w.status, w.code()), (503, "fence_busy"), "{}", w.body);
    tokio::time::sleep(Duration::from_millis(1700)).await;
    let w = send(
        &client,
        "PUT",
        &url,
        &[("Fencing-Token", &sign("acct:u", 2, "b"))],
        Some("{}"),
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
}

/// Redis lost its counter (counter mode, no persistence): the next token is
/// below the gateway's mark. Pre-registration detects it, the sidecar raises
/// the counter past the mark and hands out a token above it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preregistration_repairs_a_counter_that_went_backwards() {
    let mut redis = RedisServer::start(Persistence::Off);
    let storage = Fencer::storage(&[]);
    let gateway = Fencer::gateway(&storage.api, &[]);
    let pre = prefix(&gateway);
    let s = Fencer::sidecar(
        Backend::Redis,
        Some(&redis.url()),
        &[
            ("backend.redis.token_mode", "counter"),
            ("sidecar.preregister_url", &pre),
        ],
    );
    let mut last = 0;
    for _ in 0..5 {
        let r = s.acquire("acct:rep", 10_000, 0).await;
        last = r.token();
        s.release("acct:rep", &r.lease()).await;
    }
    assert_eq!(last, 5);
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(15);
    let r = loop {
        let r = s.acquire("acct:rep", 10_000, 0).await;
        if r.status == 200 || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.token() > 5,
        "token {} reused below the gateway's mark",
        r.token()
    );
    assert!(
        s.metric("fencer_preregistrations_total", &[("result", "stale")])
            .await
            >= 1.0
    );
}

/// PITFALLS 5 (the KIP-890 hole): equal tokens must pass for one holder's
/// many writes, so without sequences a delayed duplicate of the lease's
/// first write would land after its second and undo it. With `Fencing-Seq`
/// the gateway refuses it, and refuses a second request with the number of
/// the last accepted one too: it cannot tell an exact retry from a different
/// request reusing the number, and the first delivery is the one applied.
async fn check_sequences(extra: &[(&str, &str)]) {
    let storage = Fencer::storage(&[]);
    let gateway = Fencer::gateway(&storage.api, extra);
    let client = reqwest::Client::new();
    let path = format!("seq-{}", rand_suffix());
    let url = format!("{}/kv/{path}", gateway.api);
    let token = sign(&format!("acct:{path}"), 34, "lease-a");
    let write = |seq: &'static str, balance: i64| {
        let (client, url, token) = (client.clone(), url.clone(), token.clone());
        let key = format!("acct:{path}");
        async move {
            let mut headers = vec![
                ("Fencing-Token", token.as_str()),
                ("Fencing-Key", key.as_str()),
            ];
            if !seq.is_empty() {
                headers.push(("Fencing-Seq", seq));
            }
            send(
                &client,
                "PUT",
                &url,
                &headers,
                Some(&json!({ "balance": balance }).to_string()),
            )
            .await
        }
    };
    let first = write("1", 100).await;
    assert_eq!(first.status, 200, "{}\n{}", first.body, gateway.logs());
    assert_eq!(write("2", 90).await.status, 200);
    // Write 1 again, delayed: it must not undo write 2.
    let late = write("1", 100).await;
    assert_eq!(
        (late.status, late.code()),
        (409, "stale_sequence"),
        "{}",
        late.body
    );
    assert_eq!(late.body["last_seq"], 2);
    let read = |client: reqwest::Client| {
        let url = format!("{}/kv/{path}", storage.api);
        async move { send(&client, "GET", &url, &[], None).await }
    };
    assert_eq!(read(client.clone()).await.body["value"]["balance"], 90);
    // The same number again — a retry or another request, the gateway
    // cannot tell — is refused; the accepted write stands.
    let again = write("2", 1).await;
    assert_eq!(
        (again.status, again.code()),
        (409, "duplicate_sequence"),
        "{}",
        again.body
    );
    assert_eq!(read(client.clone()).await.body["value"]["balance"], 90);
    // The lease goes on; a client that does not number its writes still
    // passes with its equal token.
    assert_eq!(write("3", 80).await.status, 200);
    assert_eq!(write("", 70).await.status, 200);
    assert_eq!(read(client.clone()).await.body["value"]["balance"], 70);
    // A bad sequence header is a 400, and moves nothing.
    let bad = write("zero", 1).await;
    assert_eq!(
        (bad.status, bad.code()),
        (400, "invalid_request"),
        "{}",
        bad.body
    );
    // A new token starts its lease's sequence afresh.
    let next = sign(&format!("acct:{path}"), 35, "lease-b");
    let key = format!("acct:{path}");
    let w = send(
        &client,
        "PUT",
        &url,
        &[
            ("Fencing-Token", &next),
            ("Fencing-Key", &key),
            ("Fencing-Seq", "1"),
        ],
        Some(&json!({ "balance": 60 }).to_string()),
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
    assert_eq!(read(client.clone()).await.body["value"]["balance"], 60);
}

fn rand_suffix() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_write_of_a_lease_cannot_undo_its_later_write() {
    check_sequences(&[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_write_of_a_lease_cannot_undo_its_later_write_on_postgres() {
    let pg = PgServer::start();
    check_sequences(&[
        ("gateway.fence_store", "postgres"),
        ("gateway.postgres_url", &pg.url() as &str),
    ])
    .await;
}

/// The proxy numbers a lease's requests in increasing order, one at a
/// time, whatever the application sent, and a new lease's numbers start
/// above the old one's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_numbers_a_leases_requests_in_order() {
    let upstream = Recorder::start().await;
    let s = Fencer::sidecar(
        Backend::Memory,
        None,
        &[("proxy.upstream", upstream.url().as_str())],
    );
    let lease = s.acquire("acct:n", 10_000, 0).await;
    let url = format!("{}/n", s.proxy);
    // Eight concurrent requests of one lease: serialized and numbered.
    let mut tasks = Vec::new();
    for i in 0..8 {
        let (http, url, id) = (s.http.clone(), url.clone(), lease.lease());
        tasks.push(tokio::spawn(async move {
            send(
                &http,
                "PUT",
                &url,
                &[
                    ("Fencing-Lock", "acct:n"),
                    ("Fencing-Lease", &id),
                    ("Fencing-Seq", "999"),
                    ("x-delay-ms", "20"),
                ],
                Some(&i.to_string()),
            )
            .await
            .status
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let seen = upstream.seen();
    let seqs: Vec<u64> = seen.iter().map(|r| r.seq.unwrap()).collect();
    assert_eq!(seqs.len(), 8);
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    assert!(seqs.iter().all(|&q| q != 999 && q <= i64::MAX as u64));
    assert!(seen.iter().all(|r| r.token == Some(lease.token())));
    // One at a time: each arrived after the previous one finished.
    for pair in seen.windows(2) {
        assert!(pair[1].arrived >= pair[0].finished, "{seen:?}");
    }
    s.release("acct:n", &lease.lease()).await;
    let second = s.acquire("acct:n", 10_000, 0).await;
    let w = send(
        &s.http,
        "PUT",
        &url,
        &[("Fencing-Lease", &second.lease())],
        Some("x"),
    )
    .await;
    assert_eq!(w.status, 200);
    // A new lease's numbers start above everything numbered before.
    assert!(upstream.seen().last().unwrap().seq.unwrap() > *seqs.last().unwrap());
}

/// By default a read without a token goes through unchecked (documented);
/// with `gateway.require_token_for_reads` every method needs one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_without_a_token_are_refused_when_the_gateway_requires_one() {
    for (require, expected) in [("false", 404), ("true", 428)] {
        let st = stack(&[("gateway.require_token_for_reads", require)], &[]);
        let url = format!("{}/kv/accounts/5", st.gateway.api);
        let r = send(&st.sidecar.http, "GET", &url, &[], None).await;
        assert_eq!(r.status, expected, "require={require}: {}", r.body);
        if expected == 428 {
            assert_eq!(r.code(), "fencing_token_required", "{}", r.body);
            let token = sign("account:5", 1, "lease-r");
            let ok = send(
                &st.sidecar.http,
                "GET",
                &url,
                &[("Fencing-Token", &token)],
                None,
            )
            .await;
            assert_eq!(ok.status, 404, "a fenced read goes through: {}", ok.body);
        }
    }
}

/// A signing key bound to key prefixes (one per team or namespace) is
/// accepted only for those keys: a team's leaked secret cannot write
/// another team's keys through the gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_bound_to_prefixes_cannot_sign_for_other_keys() {
    let storage = Fencer::storage(&[]);
    let gateway = Fencer::gateway_with_config(
        &storage.api,
        "[[gateway.keys]]\nkey_id = \"k1\"\nsecret_env = \"FENCER_TEST_SECRET\"\nkey_prefixes = [\"team-a/\"]\n",
        &[],
    );
    let http = reqwest::Client::new();
    let own = send(
        &http,
        "PUT",
        &format!("{}/kv/team-a/1", gateway.api),
        &[("Fencing-Token", &sign("team-a/1", 1, "lease-a"))],
        Some("{}"),
    )
    .await;
    assert_eq!(own.status, 200, "{}", own.body);
    let other = send(
        &http,
        "PUT",
        &format!("{}/kv/team-b/1", gateway.api),
        &[("Fencing-Token", &sign("team-b/1", 1, "lease-b"))],
        Some("{}"),
    )
    .await;
    assert_eq!(other.status, 403, "{}", other.body);
    assert_eq!(other.code(), "invalid_fencing_token", "{}", other.body);
}

/// A multi-key lease (issue 33 item 4) binds proxied writes with its one
/// lease id: the proxy injects the token of the key each request names
/// (`Fencing-Lock`), refuses a request that names none (the lease covers
/// several), and refuses the group's id once it is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_key_lease_fences_each_key_with_its_own_token() {
    let st = stack(&[], &[]);
    let s = &st.sidecar;
    let m = s
        .post(
            "/v1/locks/acquire",
            json!({"keys": ["account:21", "account:22"], "ttl_ms": 10_000}),
        )
        .await;
    assert_eq!(m.status, 200, "{}", m.body);
    let group = m.lease();
    for (i, key) in ["account:21", "account:22"].iter().enumerate() {
        let url = format!("{}/kv/accounts/2{}", s.proxy, i + 1);
        let w = put(
            s,
            &url,
            &[("Fencing-Lease", &group), ("Fencing-Lock", key)],
            7,
        )
        .await;
        assert_eq!(w.status, 200, "{key}: {}", w.body);
        let log = send(
            &s.http,
            "GET",
            &format!("{}/_log/accounts/2{}", st.storage.api, i + 1),
            &[],
            None,
        )
        .await;
        assert_eq!(log.body["writes"][0]["token"], m.body["keys"][i]["token"]);
    }
    let url = format!("{}/kv/accounts/21", s.proxy);
    let w = put(s, &url, &[("Fencing-Lease", &group)], 8).await;
    assert_eq!((w.status, w.code()), (428, "lock_not_held"), "{}", w.body);
    let released = s
        .post("/v1/locks/release", json!({"lease_id": group}))
        .await;
    assert_eq!(released.status, 200, "{}", released.body);
    let w = put(
        s,
        &url,
        &[("Fencing-Lease", &group), ("Fencing-Lock", "account:21")],
        9,
    )
    .await;
    assert_eq!(w.status, 428, "{}", w.body);
}

/// A semaphore permit (issue 33 item 3) is fenced per slot: its write
/// carries the slot key's token, and once the slot passed to a newer
/// permit the gateway refuses the earlier permit's token for that slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_permit_is_fenced_per_slot() {
    let st = stack(&[], &[]);
    let s = &st.sidecar;
    let ask = json!({"permits": 1, "ttl_ms": 10_000});
    let old = s.post("/v1/semaphores/printers/acquire", ask.clone()).await;
    assert_eq!(old.status, 200, "{}", old.body);
    let slot_key = old.body["key"].as_str().unwrap().to_owned();
    assert_eq!(slot_key, "printers#0");
    let url = format!("{}/kv/printers/0", st.gateway.api);
    let w = put(
        s,
        &url,
        &[
            ("Fencing-Token", old.body["fencing_token"].as_str().unwrap()),
            ("Fencing-Key", &slot_key),
        ],
        1,
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
    s.post(
        "/v1/semaphores/printers/release",
        json!({"lease_id": old.lease()}),
    )
    .await;
    let new = s.post("/v1/semaphores/printers/acquire", ask).await;
    assert_eq!(new.body["key"], slot_key.as_str(), "{}", new.body);
    let w = put(
        s,
        &url,
        &[
            ("Fencing-Token", new.body["fencing_token"].as_str().unwrap()),
            ("Fencing-Key", &slot_key),
        ],
        2,
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
    let stale = put(
        s,
        &url,
        &[
            ("Fencing-Token", old.body["fencing_token"].as_str().unwrap()),
            ("Fencing-Key", &slot_key),
        ],
        3,
    )
    .await;
    assert_eq!(stale.status, 409, "{}", stale.body);
}

fn sign_read(key: &str, token: u64, lease: &str) -> String {
    signer().sign(&Claim::with_mode(key, token, lease, Mode::Read))
}

async fn get(s: &Fencer, url: &str, headers: &[(&str, &str)]) -> Resp {
    send(&s.http, "GET", url, headers, None).await
}

/// Read-write locks at the gateway (issue 33 item 2), on `gateway` in front
/// of `storage`'s `/kv/accounts/{n}` (key `account:{n}`): a read lease's
/// token reads but never writes; readers do not fence each other, in any
/// order; a writer that paused past its lease is fenced by a later
/// reader's read; a reader a writer followed is fenced by the writer's
/// first request.
async fn check_read_write_fencing(s: &Fencer, gateway: &Fencer, storage: &Fencer, n: u32) {
    let key = format!("account:{n}");
    let url = format!("{}/kv/accounts/{n}", gateway.api);
    let direct = format!("{}/kv/accounts/{n}", storage.api);
    let writer = sign(&key, 5, "writer-1");
    assert_eq!(
        put(s, &url, &[("Fencing-Token", &writer)], 10).await.status,
        200
    );
    // A reader's token never writes, and the refusal moves no mark: the
    // writer goes on.
    let r7 = sign_read(&key, 7, "reader-7");
    let w = put(s, &url, &[("Fencing-Token", &r7)], 666).await;
    assert_eq!((w.status, w.code()), (409, "read_lease"), "{}", w.body);
    assert_eq!(w.body["token"], 7);
    for method in ["POST", "DELETE", "PATCH"] {
        let w = send(&s.http, method, &url, &[("Fencing-Token", &r7)], Some("{}")).await;
        assert_eq!(
            (w.status, w.code()),
            (409, "read_lease"),
            "{method}: {}",
            w.body
        );
    }
    assert_eq!(get(s, &direct, &[]).await.body["value"]["balance"], 10);
    assert_eq!(
        put(s, &url, &[("Fencing-Token", &writer)], 11).await.status,
        200
    );
    // Readers 7 and 6 (granted once the writer let go) read, the higher
    // first: readers do not fence each other.
    let r6 = sign_read(&key, 6, "reader-6");
    for (who, t) in [("7", &r7), ("6", &r6), ("7 again", &r7), ("6 again", &r6)] {
        let r = get(s, &url, &[("Fencing-Token", t)]).await;
        assert_eq!(r.status, 200, "reader {who}: {}", r.body);
        assert_eq!(r.body["value"]["balance"], 11, "reader {who}");
    }
    // The writer of token 5, paused past its lease, comes back: a reader
    // of a later lease has read since.
    let late = put(s, &url, &[("Fencing-Token", &writer)], 12).await;
    assert_eq!(
        (late.status, late.code()),
        (409, "stale_fencing_token"),
        "{}",
        late.body
    );
    assert_eq!(late.body["highest_seen"], 7);
    // The next writer (token 8) writes; a reader it followed may no
    // longer read, the writer reads and writes on.
    let w8 = sign(&key, 8, "writer-8");
    assert_eq!(
        put(s, &url, &[("Fencing-Token", &w8)], 13).await.status,
        200
    );
    for (who, t) in [("7", &r7), ("6", &r6)] {
        let r = get(s, &url, &[("Fencing-Token", t)]).await;
        assert_eq!(
            (r.status, r.code()),
            (409, "stale_fencing_token"),
            "reader {who}: {}",
            r.body
        );
        assert_eq!(r.body["highest_seen"], 8);
    }
    assert_eq!(get(s, &url, &[("Fencing-Token", &w8)]).await.status, 200);
    assert_eq!(
        put(s, &url, &[("Fencing-Token", &w8)], 14).await.status,
        200
    );
    // A reader after it reads what it wrote.
    let r9 = sign_read(&key, 9, "reader-9");
    let r = get(s, &url, &[("Fencing-Token", &r9)]).await;
    assert_eq!(
        (r.status, r.body["value"]["balance"].clone()),
        (200, json!(14))
    );
    assert_eq!(get(s, &direct, &[]).await.body["value"]["balance"], 14);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_lease_tokens_read_but_never_write_and_fence_late_writers() {
    let st = stack(&[], &[]);
    check_read_write_fencing(&st.sidecar, &st.gateway, &st.storage, 71).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_lease_tokens_are_fenced_alike_on_a_postgres_gateway() {
    let pg = PgServer::start();
    let storage = Fencer::storage(&[]);
    let extra = [
        ("gateway.fence_store", "postgres"),
        ("gateway.postgres_url", &pg.url() as &str),
    ];
    let g1 = Fencer::gateway(&storage.api, &extra);
    check_read_write_fencing(&g1, &g1, &storage, 72).await;
    // A table of the previous version (no read mark) is brought up to
    // date by the next start, its write marks kept.
    let (c, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    c.batch_execute("ALTER TABLE fencer_fences DROP COLUMN read_token")
        .await
        .unwrap();
    use fencer::gateway::fence_store::postgres::{PgFenceOptions, PgFences};
    use fencer::gateway::fence_store::{Decision, FenceStore, Presented};
    let store = PgFences::connect(&PgFenceOptions {
        url: &pg.url(),
        ca_file: None,
        pool_size: 2,
        request_timeout: Duration::from_secs(2),
        startup: Duration::from_secs(10),
    })
    .await
    .unwrap();
    let soon = || tokio::time::Instant::now() + Duration::from_secs(2);
    let old = store
        .admit(
            "account:72",
            Presented::new(7, "x", None, Mode::Write),
            None,
            soon(),
        )
        .await
        .unwrap();
    assert_eq!(old.decision, Decision::Stale { highest: 8 });
    let reader = store
        .admit(
            "account:72",
            Presented::new(10, "r", None, Mode::Read),
            None,
            soon(),
        )
        .await
        .unwrap();
    assert_eq!(reader.decision, Decision::Advanced);
    // The decision rule inside the database, case by case.
    common::fence_rules::check_rule_table(&store).await;
}

/// The memory store keeps both marks as the rule says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_store_applies_the_decision_rule_of_both_modes() {
    let store = fencer::gateway::fence_store::memory::MemoryFences::default();
    common::fence_rules::check_rule_table(&store).await;
}

/// A read lease through the proxy (issue 33 item 2): its reads carry its
/// read-mode token (pre-registered as a reader's) and pass the gateway;
/// its writes are refused by the sidecar itself and never leave; the
/// writer after it writes, and the reader, whose lease it followed, is
/// refused a read with the old token even straight at the gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_lease_reads_through_the_proxy_and_never_writes() {
    let st = stack(&[], &[]);
    let s = &st.sidecar;
    let url = format!("{}/kv/accounts/81", s.proxy);
    let first = s.acquire("account:81", 10_000, 0).await;
    assert_eq!(
        put(s, &url, &[("Fencing-Lease", &first.lease())], 5)
            .await
            .status,
        200
    );
    s.post(
        &Fencer::path("account:81", "release"),
        json!({"lease_id": first.lease()}),
    )
    .await;
    let reader = s
        .post(
            &Fencer::path("account:81", "acquire"),
            json!({"mode": "read", "ttl_ms": 10_000}),
        )
        .await;
    assert_eq!(reader.status, 200, "{}", reader.body);
    let bound = [("Fencing-Lease", reader.lease())];
    let bound: Vec<(&str, &str)> = bound.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let r = get(s, &url, &bound).await;
    assert_eq!(
        (r.status, r.body["value"]["balance"].clone()),
        (200, json!(5)),
        "{}",
        r.body
    );
    let w = put(s, &url, &bound, 666).await;
    assert_eq!((w.status, w.code()), (409, "read_lease"), "{}", w.body);
    assert_eq!(
        s.metric("fencer_proxy_requests_total", &[("result", "read_lease")])
            .await,
        1.0
    );
    // Refused before the gateway: it saw no write since the first one.
    assert_eq!(
        st.gateway
            .metric(
                "fencer_gateway_requests_total",
                &[("kind", "write"), ("result", "accepted")]
            )
            .await,
        1.0
    );
    // Another reader beside it reads too, under the lock's key.
    let second = s
        .post(
            &Fencer::path("account:81", "acquire"),
            json!({"mode": "read", "ttl_ms": 10_000}),
        )
        .await;
    assert_eq!(second.status, 200, "{}", second.body);
    let r = get(
        s,
        &url,
        &[
            ("Fencing-Lease", &second.lease()),
            ("Fencing-Lock", "account:81"),
        ],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    for l in [reader.lease(), second.lease()] {
        let gone = s
            .post(
                &Fencer::path("account:81", "release"),
                json!({"lease_id": l}),
            )
            .await;
        assert_eq!(gone.status, 200, "{}", gone.body);
    }
    let writer = s.acquire("account:81", 10_000, 0).await;
    assert_eq!(writer.status, 200, "{}", writer.body);
    assert_eq!(
        put(s, &url, &[("Fencing-Lease", &writer.lease())], 6)
            .await
            .status,
        200
    );
    let stale = get(
        s,
        &format!("{}/kv/accounts/81", st.gateway.api),
        &[(
            "Fencing-Token",
            reader.body["fencing_token"].as_str().unwrap(),
        )],
    )
    .await;
    assert_eq!(
        (stale.status, stale.code()),
        (409, "stale_fencing_token"),
        "{}",
        stale.body
    );
}
