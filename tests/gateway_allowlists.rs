//! The gateway refuses what it does not positively recognise (issue 26
//! items 7–9, PITFALLS 13), against real processes: a `fencer gateway` in
//! front of a recording storage, and a sidecar whose proxy talks to it.
//!
//! - every method outside `gateway.read_methods` is a write (item 7);
//! - a route's `{var}` matches only its characters, and fenced paths with
//!   `;` parameters are refused (item 8);
//! - a `Fencing-*` header twice is refused at the gateway and at the proxy,
//!   and the storage sees no `Fencing-*` header but the checked token and
//!   sequence (item 9).
//!
//! Every test but `route_variables_can_be_widened_per_route` uses only
//! settings older builds accept, so `FENCER_TEST_BIN=<old fencer>` shows
//! them failing there.

mod common;

use std::time::{Duration, Instant};

use common::upstream::Recorder;
use common::*;
use fencer::token::{Claim, Signer};

fn sign(key: &str, token: u64, lease: &str) -> String {
    Signer::new("k1", SECRET.as_bytes()).sign(&Claim::new(key, token, lease))
}

const ROUTES: &str = "[[gateway.routes]]\npath = \"/kv/accounts/{id}\"\nkey = \"account:{id}\"\n";

/// Item 7: MOVE, COPY, MKCOL, PROPPATCH, MERGE and a lower-case `put` used
/// to reach the storage with no token at all. Now only GET and HEAD pass
/// as reads; everything else needs a token, and with one it is fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn methods_outside_the_read_list_need_a_token() {
    let upstream = Recorder::start().await;
    let g = Fencer::gateway(&upstream.url(), &[]);
    let http = reqwest::Client::new();
    let url = format!("{}/kv/accounts/1", g.api);
    for method in [
        "MOVE",
        "COPY",
        "MKCOL",
        "PROPPATCH",
        "MERGE",
        "put",
        "LOCK",
        "FROB",
    ] {
        let r = send(&http, method, &url, &[], Some("{}")).await;
        assert_eq!(
            (r.status, r.code()),
            (428, "fencing_token_required"),
            "{method}: {}",
            r.body
        );
    }
    assert!(
        upstream.seen().is_empty(),
        "reached the storage unfenced: {:?}",
        upstream.seen()
    );
    // The known-safe reads still pass without a token.
    for method in ["GET", "HEAD"] {
        let r = send(&http, method, &url, &[], None).await;
        assert_eq!(r.status, 200, "{method}: {}", r.body);
    }
    // With a token, an extension method is a fenced write like any other.
    let token = sign("account:1", 5, "lease-a");
    let r = send(
        &http,
        "MOVE",
        &url,
        &[("Fencing-Token", &token)],
        Some("{}"),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let seen = upstream.seen();
    let methods: Vec<&str> = seen.iter().map(|s| s.method.as_str()).collect();
    assert_eq!(methods, ["GET", "HEAD", "MOVE"]);
    assert_eq!(seen[2].token, Some(5));
    assert!(
        g.metric(
            "fencer_gateway_requests_total",
            &[("kind", "write"), ("result", "missing_token")]
        )
        .await
            >= 8.0
    );
}

/// Item 7, second half: a fenced GET whose storage does not answer in time
/// changes nothing at the storage, so the next write on its key does not
/// wait out `uncertain_hold_ms` (it waited the whole hold behind a GET's
/// 504). A write's unknown outcome still holds the key
/// (`fencing::an_unknown_upstream_outcome_blocks_the_key_for_a_while`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_reads_upstream_timeout_does_not_hold_its_key() {
    let upstream = Recorder::start().await;
    let g = Fencer::gateway(
        &upstream.url(),
        &[
            ("gateway.upstream_timeout_ms", "200"),
            ("gateway.uncertain_hold_ms", "3000"),
            ("gateway.serialize_timeout_ms", "5000"),
        ],
    );
    let http = reqwest::Client::new();
    let url = format!("{}/r", g.api);
    let r = send(
        &http,
        "GET",
        &url,
        &[
            ("Fencing-Token", &sign("acct:r", 1, "reader")),
            ("x-delay-ms", "1000"),
        ],
        None,
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (504, "upstream_timeout"),
        "{}",
        r.body
    );
    let started = Instant::now();
    let w = send(
        &http,
        "PUT",
        &url,
        &[("Fencing-Token", &sign("acct:r", 2, "writer"))],
        Some("{}"),
    )
    .await;
    let waited = started.elapsed();
    assert_eq!(w.status, 200, "{}", w.body);
    assert!(
        waited < Duration::from_millis(1500),
        "the write waited {waited:?} behind a read's timeout"
    );
}

/// Item 8: with `/kv/accounts/{id}` → `account:{id}`, a token for
/// `account:2;x` wrote `/kv/accounts/2;x` — `/kv/accounts/2` to Tomcat,
/// Jetty and Spring — after a newer token for `account:2` had written
/// there. `.json` suffixes and full-width digits gave one object several
/// keys too. All are refused now, and only the real write reached the
/// storage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_parameters_and_lookalike_ids_cannot_write_through_a_route() {
    let upstream = Recorder::start().await;
    let g = Fencer::gateway_with_config(&upstream.url(), ROUTES, &[]);
    let http = reqwest::Client::new();
    let put = |path: &str, key: &str, token: u64| {
        let (http, url, t) = (
            http.clone(),
            format!("{}{path}", g.api),
            sign(key, token, "l"),
        );
        async move { send(&http, "PUT", &url, &[("Fencing-Token", &t)], Some("{}")).await }
    };
    let w = put("/kv/accounts/2", "account:2", 9).await;
    assert_eq!(w.status, 200, "{}", w.body);

    for (path, key) in [
        ("/kv/accounts/2;x", "account:2;x"),
        ("/kv/accounts/2%3Bx", "account:2;x"),
    ] {
        let w = put(path, key, 1).await;
        assert_eq!(
            (w.status, w.code(), w.body["field"].as_str()),
            (400, "invalid_request", Some("path")),
            "{path}: {}",
            w.body
        );
    }
    for (path, key) in [
        ("/kv/accounts/2.json", "account:2.json"),
        ("/kv/accounts/%EF%BC%92", "account:\u{ff12}"),
        ("/kv/accounts/\u{ff12}", "account:\u{ff12}"),
        ("/kv/accounts/2~", "account:2~"),
    ] {
        let w = put(path, key, 1).await;
        assert_eq!(
            (w.status, w.code()),
            (403, "path_not_routed"),
            "{path}: {}",
            w.body
        );
    }
    let paths: Vec<String> = upstream.seen().iter().map(|s| s.path.clone()).collect();
    assert_eq!(paths, ["/kv/accounts/2"]);
    assert!(
        g.metric(
            "fencer_gateway_requests_total",
            &[("result", "path_parameters")]
        )
        .await
            >= 2.0
    );
}

/// Item 8 without routes: the key comes from the token, so there is no
/// binding to bypass, but a `;` path still has no one meaning and a fenced
/// request with one is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_parameters_are_refused_without_routes_too() {
    let upstream = Recorder::start().await;
    let g = Fencer::gateway(&upstream.url(), &[]);
    let http = reqwest::Client::new();
    let t = sign("acct:p", 1, "l");
    let w = send(
        &http,
        "PUT",
        &format!("{}/kv/p;jsessionid=1", g.api),
        &[("Fencing-Token", &t)],
        Some("{}"),
    )
    .await;
    assert_eq!((w.status, w.code()), (400, "invalid_request"), "{}", w.body);
    let w = send(
        &http,
        "PUT",
        &format!("{}/kv/p", g.api),
        &[("Fencing-Token", &t)],
        Some("{}"),
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
    assert_eq!(upstream.seen().len(), 1);
}

/// `var_chars` widens (or narrows) what one route's `{var}` matches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_variables_can_be_widened_per_route() {
    let upstream = Recorder::start().await;
    let routes = "[[gateway.routes]]\npath = \"/files/{name}\"\nkey = \"file:{name}\"\nvar_chars = \"A-Za-z0-9._-\"\n\
                  [[gateway.routes]]\npath = \"/n/{id}\"\nkey = \"n:{id}\"\nvar_chars = \"0-9\"\n";
    let g = Fencer::gateway_with_config(&upstream.url(), routes, &[]);
    let http = reqwest::Client::new();
    let put = |path: &str, key: &str| {
        let (http, url, t) = (http.clone(), format!("{}{path}", g.api), sign(key, 1, "l"));
        async move { send(&http, "PUT", &url, &[("Fencing-Token", &t)], Some("{}")).await }
    };
    assert_eq!(put("/files/a.txt", "file:a.txt").await.status, 200);
    assert_eq!(put("/n/42", "n:42").await.status, 200);
    let w = put("/n/4a", "n:4a").await;
    assert_eq!((w.status, w.code()), (403, "path_not_routed"), "{}", w.body);
    assert_eq!(upstream.seen().len(), 2);
}

/// Item 9 at the gateway: duplicate `Fencing-Key`, `Fencing-Token`,
/// `Fencing-Seq` and `Fencing-Lease` headers were checked by their first
/// value and forwarded with every value. Now refused (400), and a fenced
/// request reaches the storage with its checked token and sequence only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_fencing_headers_are_refused_at_the_gateway() {
    let upstream = Recorder::start().await;
    let g = Fencer::gateway(&upstream.url(), &[]);
    let http = reqwest::Client::new();
    let url = format!("{}/kv/d", g.api);
    let good = sign("acct:d", 5, "l");
    let other = sign("acct:e", 6, "m");
    for headers in [
        vec![
            ("Fencing-Token", good.as_str()),
            ("Fencing-Token", other.as_str()),
        ],
        vec![
            ("Fencing-Token", good.as_str()),
            ("Fencing-Key", "acct:d"),
            ("Fencing-Key", "acct:e"),
        ],
        vec![
            ("Fencing-Token", good.as_str()),
            ("Fencing-Seq", "1"),
            ("fencing-seq", "2"),
        ],
        vec![
            ("Fencing-Token", good.as_str()),
            ("Fencing-Lease", "a"),
            ("Fencing-Lease", "b"),
        ],
    ] {
        let w = send(&http, "PUT", &url, &headers, Some("{}")).await;
        assert_eq!(
            (w.status, w.code()),
            (400, "duplicate_fencing_header"),
            "{headers:?}: {}",
            w.body
        );
    }
    // A read without a token too: it would go to the storage as it is.
    let r = send(
        &http,
        "GET",
        &url,
        &[("Fencing-Token", "x"), ("Fencing-Token", "y")],
        None,
    )
    .await;
    assert_eq!((r.status, r.code()), (400, "duplicate_fencing_header"));
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());

    let w = send(
        &http,
        "PUT",
        &url,
        &[
            ("Fencing-Token", &good),
            ("Fencing-Key", "acct:d"),
            ("Fencing-Seq", "7"),
            ("Fencing-Lease", "a"),
            ("Fencing-Whatever", "b"),
        ],
        Some("{}"),
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
    let r = send(
        &http,
        "GET",
        &url,
        &[("Fencing-Seq", "8"), ("Fencing-Key", "acct:d")],
        None,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let seen = upstream.seen();
    assert_eq!(
        seen[0].fencing,
        [
            ("fencing-token".to_owned(), good.clone()),
            ("fencing-seq".to_owned(), "7".to_owned())
        ]
    );
    assert!(seen[1].fencing.is_empty(), "{:?}", seen[1].fencing);
    assert!(
        g.metric(
            "fencer_gateway_requests_total",
            &[("result", "duplicate_header")]
        )
        .await
            >= 5.0
    );
}

/// Item 9 at the proxy: of two `Fencing-Lease` (or `Fencing-Lock`) values
/// the proxy used the first; now it refuses the request (400) before
/// anything is forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_fencing_headers_are_refused_at_the_proxy() {
    let upstream = Recorder::start().await;
    let s = Fencer::sidecar(
        Backend::Memory,
        None,
        &[("proxy.upstream", upstream.url().as_str())],
    );
    let lease = s.acquire("acct:q", 10_000, 0).await;
    assert_eq!(lease.status, 200, "{}", lease.body);
    let id = lease.lease();
    let url = format!("{}/kv/q", s.proxy);
    for headers in [
        vec![("Fencing-Lease", id.as_str()), ("Fencing-Lease", "other")],
        vec![
            ("Fencing-Lease", id.as_str()),
            ("Fencing-Lock", "acct:q"),
            ("Fencing-Lock", "acct:z"),
        ],
        vec![
            ("Fencing-Lease", id.as_str()),
            ("Fencing-Token", "a"),
            ("Fencing-Token", "b"),
        ],
    ] {
        let w = send(&s.http, "PUT", &url, &headers, Some("{}")).await;
        assert_eq!(
            (w.status, w.code()),
            (400, "duplicate_fencing_header"),
            "{headers:?}: {}",
            w.body
        );
    }
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());
    let w = send(&s.http, "PUT", &url, &[("Fencing-Lease", &id)], Some("{}")).await;
    assert_eq!(w.status, 200, "{}", w.body);
    assert!(
        s.metric("fencer_proxy_requests_total", &[("result", "bad_request")])
            .await
            >= 3.0
    );
}

/// The egress proxy classifies methods the same way (PITFALLS 13): with
/// `require_lock_for_writes`, a method outside `proxy.read_methods` that
/// names no lock — MOVE, a lower-case `put`, an extension method — is a
/// write and is refused (428) instead of passed on without a token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_treats_every_method_outside_its_read_list_as_a_write() {
    let upstream = Recorder::start().await;
    let s = Fencer::sidecar(
        Backend::Memory,
        None,
        &[
            ("proxy.upstream", upstream.url().as_str()),
            ("proxy.require_lock_for_writes", "true"),
        ],
    );
    let url = format!("{}/kv/q", s.proxy);
    for method in [
        "MOVE",
        "COPY",
        "MKCOL",
        "PROPPATCH",
        "MERGE",
        "put",
        "PURGE",
    ] {
        let w = send(&s.http, method, &url, &[], Some("{}")).await;
        assert_eq!(
            (w.status, w.code()),
            (428, "lock_not_held"),
            "{method}: {}",
            w.body
        );
    }
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());
    let r = send(&s.http, "GET", &url, &[], None).await;
    assert_ne!(r.status, 428, "{}", r.body);
}

/// Only fencer's own refusals carry `Fencing-Error`: the gateway's stale
/// refusal names its code there (and the proxy passes it on), while a
/// storage answer that carries the header — a storage posing as fencer,
/// which a client library would take for a refusal — reaches the client
/// without it, through the gateway and through the proxy in front of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_fencers_own_refusals_carry_the_refusal_header() {
    let upstream = Recorder::start().await;
    let g = Fencer::gateway(&upstream.url(), &[]);
    let http = reqwest::Client::new();
    let url = format!("{}/kv/refusal", g.api);
    let put = |token: String, forged: bool| {
        let mut req = http.put(&url).header("Fencing-Token", token).body("{}");
        if forged {
            req = req.header("x-answer-fencing-error", "stale_fencing_token");
        }
        req.send()
    };
    let posing = put(sign("/kv/refusal", 7, "lease-b"), true).await.unwrap();
    assert_eq!(posing.status(), 200);
    assert_eq!(
        posing.headers().get("fencing-error"),
        None,
        "the storage's header passed the gateway"
    );
    assert_eq!(upstream.seen().len(), 1);
    let stale = put(sign("/kv/refusal", 6, "lease-a"), false).await.unwrap();
    assert_eq!(stale.status(), 409);
    assert_eq!(
        stale
            .headers()
            .get("fencing-error")
            .map(|v| v.to_str().unwrap()),
        Some("stale_fencing_token")
    );
    // Through a sidecar's proxy: the gateway's refusal keeps its header,
    // the proxy's own refusals carry theirs.
    let s = Fencer::sidecar(Backend::Memory, None, &[("proxy.upstream", &g.api)]);
    let lease = s.acquire("proxy:refusal", 5000, 0).await;
    let via = |lease_id: String, forged: bool| {
        let mut req = http
            .put(format!("{}/kv/proxy-refusal", s.proxy))
            .header("Fencing-Lease", lease_id)
            .body("{}");
        if forged {
            req = req.header("x-answer-fencing-error", "lease_lost");
        }
        req.send()
    };
    let posing = via(lease.lease(), true).await.unwrap();
    assert_eq!(posing.headers().get("fencing-error"), None);
    let unknown = via("no-such-lease".into(), false).await.unwrap();
    assert!(unknown.status().is_client_error());
    let code = unknown
        .headers()
        .get("fencing-error")
        .map(|v| v.to_str().unwrap().to_owned());
    let body: serde_json::Value = unknown.json().await.unwrap();
    assert_eq!(code.as_deref(), body["error"].as_str(), "{body}");
}
