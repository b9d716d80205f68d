//! The Dapr-compatible lock API (`/v1.0-alpha1/lock|unlock/{store}`):
//! the checks of Dapr's lock-store conformance suite (components-contrib
//! `tests/conformance/lock`: acquire, acquire another resource, a second
//! owner refused, unlock of a missing lock, unlock by the wrong owner,
//! unlock, expiry), on `fencer dev` and on a Redis-backed sidecar with a
//! configured store; Dapr's error codes; and what fencer adds: a fencing
//! token per Dapr lock that the proxy and the gateway enforce.

mod common;

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use common::dev::Dev;
use common::*;

struct Answer {
    status: u16,
    body: Value,
    headers: reqwest::header::HeaderMap,
}

async fn call(api: &str, op: &str, store: &str, body: &str) -> Answer {
    let r = reqwest::Client::new()
        .post(format!("{api}/v1.0-alpha1/{op}/{store}"))
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let body = r.json().await.unwrap_or(Value::Null);
    Answer {
        status,
        body,
        headers,
    }
}

async fn try_lock(api: &str, store: &str, resource: &str, owner: &str, expiry: i64) -> Answer {
    let body = json!({"resourceId": resource, "lockOwner": owner, "expiryInSeconds": expiry});
    call(api, "lock", store, &body.to_string()).await
}

async fn unlock(api: &str, store: &str, resource: &str, owner: &str) -> Answer {
    let body = json!({"resourceId": resource, "lockOwner": owner});
    call(api, "unlock", store, &body.to_string()).await
}

/// The conformance suite's checks, in its order, with its names.
async fn conformance(api: &str, store: &str) {
    let base = format!("conf{}", rand_suffix());
    let (r1, r2) = (format!("{base}resource-1"), format!("{base}resource-2"));
    let (o1, o2) = ("lock-owner-1", "lock-owner-2");

    let a = try_lock(api, store, &r1, o1, 15).await;
    assert_eq!(
        (a.status, &a.body),
        (200, &json!({"success": true})),
        "acquire lock1"
    );
    let a = try_lock(api, store, &r2, o1, 15).await;
    assert_eq!(
        (a.status, &a.body),
        (200, &json!({"success": true})),
        "acquire lock2"
    );
    let a = try_lock(api, store, &r1, o2, 15).await;
    assert_eq!(
        (a.status, &a.body),
        (200, &json!({"success": false})),
        "fails to acquire existing lock"
    );

    let u = unlock(api, store, &format!("{base}nonexistent"), o1).await;
    assert_eq!(
        (u.status, &u.body),
        (200, &json!({"status": 1})),
        "unlock nonexistent"
    );
    let u = unlock(api, store, &r1, o2).await;
    assert_eq!(
        (u.status, &u.body),
        (200, &json!({"status": 2})),
        "unlock wrong owner"
    );
    let u = unlock(api, store, &r1, o1).await;
    assert_eq!(
        (u.status, &u.body),
        (200, &json!({"status": 0})),
        "unlocks successfully"
    );

    let a = try_lock(api, store, &r1, o1, 1).await;
    assert_eq!(a.body, json!({"success": true}), "short lock");
    let started = Instant::now();
    loop {
        let a = try_lock(api, store, &r1, o2, 1).await;
        if a.body == json!({"success": true}) {
            break;
        }
        assert_eq!(a.body, json!({"success": false}));
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "lock expires: still held after 5 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Expired means gone, not early: not before its second was up.
    assert!(
        started.elapsed() >= Duration::from_millis(700),
        "{:?}",
        started.elapsed()
    );
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dapr_lock_conformance_checks_pass_on_fencer_dev() {
    let dev = Dev::start();
    conformance(&dev.api, "lockstore").await;
    let metrics = reqwest::get(format!("{}/metrics", dev.admin))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains(
            r#"fencer_dapr_requests_total{op="unlock",protocol="http",result="other_owner"} 1"#
        ),
        "{metrics}"
    );
}

const STORES: &str = r#"
[backend]
kind = "redis"
[[sidecar.dapr_lock_stores]]
name = "orders"
key_prefix = "orders/"
[[sidecar.dapr_lock_stores]]
name = "billing"
key_prefix = "billing/"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_stores_map_to_the_backend_with_their_prefix() {
    let redis = RedisServer::start(Persistence::Off);
    let s = Fencer::sidecar_with_config(
        Backend::Redis,
        STORES,
        &[("backend.redis.url", &redis.url())],
    );
    conformance(&s.api, "orders").await;
    // Two stores never share a key: the same resource in both is two locks.
    assert_eq!(
        try_lock(&s.api, "orders", "r", "a", 30).await.body["success"],
        true
    );
    assert_eq!(
        try_lock(&s.api, "billing", "r", "b", 30).await.body["success"],
        true
    );
    // And the store's key is the prefixed one, visible to the lock API —
    // but not its owner: a Dapr lease's owner string is its credential.
    let view = s
        .http
        .get(format!("{}/v1/locks/orders%2Fr", s.api))
        .send()
        .await
        .unwrap();
    assert_eq!(view.status(), 200);
    let view: Value = view.json().await.unwrap();
    assert_eq!(view["key"], "orders/r");
    assert!(view.get("owner").is_none(), "{view}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dapr_locks_carry_fencing_tokens_the_proxy_and_the_gateway_enforce() {
    let dev = Dev::start();
    let http = reqwest::Client::new();
    let first = try_lock(&dev.api, "lockstore", "account:9", "worker-1", 1).await;
    assert_eq!(first.body["success"], true);
    let lease1 = first.headers["fencing-lease"].to_str().unwrap().to_owned();
    let token1 = first.headers["fencing-token"].to_str().unwrap().to_owned();
    assert_eq!(first.headers["fencing-key"], "account:9");
    let w = http
        .put(format!("{}/kv/accounts/9", dev.proxy))
        .header("Fencing-Lease", &lease1)
        .body(r#"{"balance":1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(w.status(), 200, "{}", w.text().await.unwrap());

    // worker-1's lock expires; worker-2 takes it and writes.
    let started = Instant::now();
    let second = loop {
        let a = try_lock(&dev.api, "lockstore", "account:9", "worker-2", 30).await;
        if a.body["success"] == true {
            break a;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let lease2 = second.headers["fencing-lease"].to_str().unwrap().to_owned();
    let w = http
        .put(format!("{}/kv/accounts/9", dev.proxy))
        .header("Fencing-Lease", &lease2)
        .body(r#"{"balance":2}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(w.status(), 200);

    // worker-1, resuming after its pause, writes under its old lease: the
    // proxy refuses it, and its token sent straight to the gateway is
    // refused as stale.
    let late = http
        .put(format!("{}/kv/accounts/9", dev.proxy))
        .header("Fencing-Lease", &lease1)
        .body(r#"{"balance":-1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(late.status(), 409);
    let late: Value = late.json().await.unwrap();
    assert_eq!(late["error"], "lease_lost");
    let direct = http
        .put(format!("{}/kv/accounts/9", dev.gateway))
        .header("Fencing-Token", &token1)
        .header("Fencing-Key", "account:9")
        .body(r#"{"balance":-1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(direct.status(), 409, "{}", direct.text().await.unwrap());
    let stored: Value = http
        .get(format!("{}/kv/accounts/9", dev.proxy))
        .header("Fencing-Lease", &lease2)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stored["value"]["balance"], 2, "{stored}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_dapr_requests_get_daprs_status_codes_and_fencers_error_shape() {
    let dev = Dev::start();
    let long = "o".repeat(300);
    let key = "k".repeat(600);
    let cases: Vec<(&str, &str, String, u16, &str)> = vec![
        (
            "lock",
            "nostore",
            json!({"resourceId": "r", "lockOwner": "o", "expiryInSeconds": 5}).to_string(),
            400,
            "ERR_LOCK_STORE_NOT_FOUND",
        ),
        (
            "unlock",
            "nostore",
            json!({"resourceId": "r", "lockOwner": "o"}).to_string(),
            400,
            "ERR_LOCK_STORE_NOT_FOUND",
        ),
        (
            "lock",
            "lockstore",
            "{".into(),
            400,
            "ERR_MALFORMED_REQUEST",
        ),
        (
            "lock",
            "lockstore",
            "[]".into(),
            400,
            "ERR_MALFORMED_REQUEST",
        ),
        (
            "lock",
            "lockstore",
            json!({"lockOwner": "o", "expiryInSeconds": 5}).to_string(),
            400,
            "ERR_MALFORMED_REQUEST",
        ),
        (
            "lock",
            "lockstore",
            json!({"resourceId": "r", "expiryInSeconds": 5}).to_string(),
            400,
            "ERR_MALFORMED_REQUEST",
        ),
        (
            "lock",
            "lockstore",
            json!({"resourceId": "r", "lockOwner": "o"}).to_string(),
            400,
            "ERR_MALFORMED_REQUEST",
        ),
        (
            "lock",
            "lockstore",
            json!({"resourceId": "r", "lockOwner": "o", "expiryInSeconds": 0}).to_string(),
            400,
            "ERR_MALFORMED_REQUEST",
        ),
        (
            "lock",
            "lockstore",
            json!({"resourceId": "r", "lockOwner": "o", "expiryInSeconds": -5}).to_string(),
            400,
            "ERR_MALFORMED_REQUEST",
        ),
        (
            "lock",
            "lockstore",
            json!({"resourceId": "r", "lockOwner": "o", "expiryInSeconds": 3601}).to_string(),
            400,
            "ERR_MALFORMED_REQUEST",
        ),
        (
            "lock",
            "lockstore",
            json!({"resourceId": "r", "lockOwner": "o", "expiryInSeconds": "5"}).to_string(),
            400,
            "ERR_MALFORMED_REQUEST",
        ),
        (
            "lock",
            "lockstore",
            json!({"resourceId": "r", "lockOwner": "o", "expiryInSeconds": 1.5}).to_string(),
            400,
            "ERR_MALFORMED_REQUEST",
        ),
        (
            "lock",
            "lockstore",
            json!({"resourceId": "r", "lockOwner": "o", "expiryInSecond": 5}).to_string(),
            400,
            "ERR_MALFORMED_REQUEST",
        ),
        (
            "lock",
            "lockstore",
            json!({"resourceId": "r", "lockOwner": long, "expiryInSeconds": 5}).to_string(),
            400,
            "ERR_MALFORMED_REQUEST",
        ),
        (
            "lock",
            "lockstore",
            json!({"resourceId": key, "lockOwner": "o", "expiryInSeconds": 5}).to_string(),
            400,
            "ERR_MALFORMED_REQUEST",
        ),
        (
            "lock",
            "lockstore",
            json!({"resourceId": "", "lockOwner": "o", "expiryInSeconds": 5}).to_string(),
            400,
            "ERR_MALFORMED_REQUEST",
        ),
        (
            "unlock",
            "lockstore",
            json!({"resourceId": "r"}).to_string(),
            400,
            "ERR_MALFORMED_REQUEST",
        ),
        (
            "unlock",
            "lockstore",
            json!({"resourceId": "r", "lockOwner": 7}).to_string(),
            400,
            "ERR_MALFORMED_REQUEST",
        ),
    ];
    for (op, store, body, status, code) in &cases {
        let a = call(&dev.api, op, store, body).await;
        assert_eq!(a.status, *status, "{op} {body}: {}", a.body);
        assert_eq!(a.body["errorCode"], *code, "{op} {body}");
        assert!(
            a.body["error"].is_string() && a.body["message"].is_string(),
            "{}",
            a.body
        );
    }
    // Nothing above took a lock.
    let list: Value = reqwest::get(format!("{}/v1/locks", dev.api))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["total"], 0, "{list}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_outage_is_daprs_500_not_a_false_answer() {
    // AOF: a restart keeps the lock, so the unlock after it finds it.
    let mut redis = RedisServer::start(Persistence::Aof);
    let s = Fencer::sidecar_with_config(
        Backend::Redis,
        STORES,
        &[
            ("backend.redis.url", &redis.url()),
            ("backend.redis.request_timeout_ms", "300"),
        ],
    );
    assert_eq!(
        try_lock(&s.api, "orders", "x", "o", 30).await.body["success"],
        true
    );
    redis.kill();
    let a = try_lock(&s.api, "orders", "y", "o", 30).await;
    assert_eq!(a.status, 500, "{}", a.body);
    assert_eq!(a.body["errorCode"], "ERR_TRY_LOCK");
    let u = unlock(&s.api, "orders", "x", "o").await;
    assert_eq!(u.status, 500, "{}", u.body);
    assert_eq!(u.body["errorCode"], "ERR_UNLOCK");
    assert_eq!(u.body["status"], 3);
    // Not held here any more, whatever the backend did with it.
    let view = s.get("/v1/locks/orders%2Fx").await;
    assert_eq!(view.body["state"], "lost", "{}", view.body);
    // Back up: the lease is released — by the client's retried unlock (0),
    // or already by the sidecar's own background retry of the release (1:
    // the lock does not exist any more) — and another owner gets the key.
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let u = unlock(&s.api, "orders", "x", "o").await;
        if u.status == 200 {
            assert!(u.body["status"] == 0 || u.body["status"] == 1, "{}", u.body);
            let other = try_lock(&s.api, "orders", "x", "p", 30).await;
            assert_eq!(other.body["success"], true, "{}", other.body);
            break;
        }
        assert!(Instant::now() < deadline, "no recovery: {}", u.body);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
