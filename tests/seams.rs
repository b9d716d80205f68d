//! Two holders at the seams between fencer's own mechanisms (issue 26
//! items 1, 2, 3 and 10; PITFALLS 11 and 12): a retry and the compensation
//! of the try before it, an answer and the lease's deadline, a release and
//! the client's disconnect, and the credentials a local client may read.
//! Every test runs real processes (the fencer binary, MariaDB, PostgreSQL,
//! Redis) with a relay that holds back a *reply* — or, in one, the request
//! of the try before the retry.

mod common;

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use common::mariadb::MariaDb;
use common::postgres::PgServer;
use common::tcp_fault::{Mode, TcpFault};
use common::*;

/// How long the relay holds the first try's reply: past the backend's
/// request timeout (1 s), so the caller gives up and retries while the
/// statement has already been applied on the server.
const LATE_REPLY: Duration = Duration::from_millis(1_500);

/// The shape of item 1: try 1 of an acquire is applied on the server but
/// its reply comes after the caller's timeout; try 2 (same lease id) is
/// answered "held" and the client is told 200; then try 1's reply arrives
/// and its compensation must not release the lease try 2 handed out.
///
/// This is the counterexample the model of the lease protocol prints for
/// the mutant `undo_by_lease` (`cargo test --test model undo_by_lease`,
/// docs/model.md); each step below names the model's action.
async fn late_first_reply_keeps_the_retried_lease(a: &Fencer, b: &Fencer, relay: &TcpFault) {
    let other = late_first_reply(a, b, relay).await;
    assert_eq!(
        (other.status, other.code()),
        (409, "lock_held"),
        "a second sidecar acquired a key the first still holds (token {}): {}",
        other.body["token"],
        other.body
    );
}

const ITEM1_KEY: &str = "seam-item1-key";

/// The steps of the model's `undo_by_lease` trace against real processes;
/// returns the other sidecar's answer to an acquire made once try 1's
/// undo has had its chance (409 when safe, 200 = two holders).
async fn late_first_reply(a: &Fencer, b: &Fencer, relay: &TcpFault) -> Resp {
    const KEY: &str = ITEM1_KEY;
    // (model: "deliver backend→sidecar0 L1 try 1" comes late) The relay
    // holds back the reply to try 1, past the backend's request timeout.
    relay.set(Mode::DelayReplyTo {
        marker: KEY.as_bytes(),
        delay: LATE_REPLY,
    });
    let started = Instant::now();
    // 1. client0: acquire — 2. deliver acquire(L1, try 1): the row is L1's;
    // its reply is held back. 3. sidecar0: timeout of try 1 (the runner's
    // undo is sent, or with the mutant, waits for the late answer) —
    // 4. deliver acquire(L1, try 2): confirmed, the row carries try 2 —
    // 5. deliver its reply (+ pre-registration): client0 told "held".
    let got = a.acquire(KEY, 30_000, 0).await;
    assert_eq!(got.status, 200, "{}", got.body);
    assert!(
        a.metric("fencer_acquire_retries_total", &[]).await >= 1.0,
        "the first try was not retried (the relay did not hold its reply?)"
    );
    // 6. deliver try 1's late reply, and the undo (void_attempt(L1, try 1),
    // or the mutant's release(L1)) reaches the backend.
    tokio::time::sleep((started + LATE_REPLY + Duration::from_millis(700)) - Instant::now()).await;
    // 7. client1: acquire on sidecar1 — held by another unless the undo
    // released the lease client0 holds.
    let other = b.acquire(KEY, 10_000, 0).await;
    if other.status == 409 {
        // The lease the client was given still renews: it is live.
        let renewed = a.renew(KEY, &got.lease(), 30_000).await;
        assert_eq!(renewed.status, 200, "{}", renewed.body);
    }
    other
}

/// A MariaDB, sidecar `a` on it through a relay (request timeout 1 s), and
/// sidecar `b` on it directly.
fn mysql_sidecars_one_behind_a_relay() -> (MariaDb, TcpFault, Fencer, Fencer) {
    let db = MariaDb::start();
    let relay = TcpFault::start(db.port);
    let via_relay = format!("mysql://root@127.0.0.1:{}/fencer", relay.port);
    let a = Fencer::sidecar(
        Backend::MySql,
        Some(&via_relay),
        &[("backend.mysql.request_timeout_ms", "1000")],
    );
    a.wait_ready();
    let b = Fencer::sidecar(Backend::MySql, Some(&db.url()), &[]);
    b.wait_ready();
    (db, relay, a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_late_first_reply_does_not_release_the_lease_its_retry_handed_out() {
    let (_db, relay, a, b) = mysql_sidecars_one_behind_a_relay();
    late_first_reply_keeps_the_retried_lease(&a, &b, &relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_late_first_reply_does_not_release_the_lease_its_retry_handed_out() {
    let pg = PgServer::start();
    let relay = TcpFault::start(pg.port);
    let via_relay = format!("postgres://postgres@127.0.0.1:{}/postgres", relay.port);
    let a = Fencer::sidecar(
        Backend::Postgres,
        Some(&via_relay),
        &[("backend.postgres.request_timeout_ms", "1000")],
    );
    a.wait_ready();
    let b = Fencer::sidecar(Backend::Postgres, Some(&pg.url()), &[]);
    b.wait_ready();
    late_first_reply_keeps_the_retried_lease(&a, &b, &relay).await;
}

/// The same trace with the real mutant `undo_by_lease` switched on: the
/// test above must see two holders then (it checks the mechanism, not a
/// schedule that never happens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_undo_by_lease_mutant_makes_two_holders_on_the_model_trace() {
    let pg = PgServer::start();
    let relay = TcpFault::start(pg.port);
    let via_relay = format!("postgres://postgres@127.0.0.1:{}/postgres", relay.port);
    let a = Fencer::sidecar_env(
        Backend::Postgres,
        Some(&via_relay),
        &[("backend.postgres.request_timeout_ms", "1000")],
        &[("FENCER_MUTANT", "undo_by_lease")],
    );
    a.wait_ready();
    let b = Fencer::sidecar(Backend::Postgres, Some(&pg.url()), &[]);
    b.wait_ready();
    let other = late_first_reply(&a, &b, &relay).await;
    assert_eq!(
        other.status, 200,
        "with undo_by_lease the late undo should have released the lease client0 holds: {}",
        other.body
    );
}

/// Found by the model (docs/model.md, `orphan_held`): an acquire whose
/// client goes away during pre-registration has already recorded its lease
/// as held; its clean-up releases the lease in the backend, and until that
/// release's reply came back the sidecar still answered `GET` with "held"
/// — while another sidecar could take the key. Each step names the
/// model's action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_abandoned_during_preregistration_is_never_shown_held() {
    const KEY: &str = "seam:orphan";
    let redis = RedisServer::start(Persistence::Off);
    let backend_relay = TcpFault::start(redis.port);
    let storage = Fencer::storage(&[]);
    let gateway = Fencer::gateway(&storage.api, &[]);
    let gateway_relay = TcpFault::start(gateway.api_port);
    let pre = format!("http://127.0.0.1:{}/_fencer/v1/fences/", gateway_relay.port);
    let a = Fencer::sidecar(
        Backend::Redis,
        Some(&backend_relay.redis_url()),
        &[
            ("sidecar.preregister_url", pre.as_str()),
            ("sidecar.preregister_timeout_ms", "6000"),
        ],
    );
    a.wait_ready();
    let b = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    b.wait_ready();

    // (model: the pre-registration's reply comes late)
    gateway_relay.set(Mode::DelayReplies(Duration::from_millis(3_000)));
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(1_000))
        .build()
        .unwrap();
    let url = format!("{}{}", a.api, Fencer::path(KEY, "acquire"));
    // 1. client0: acquire — 2. deliver acquire(L1, try 1) — 3. deliver
    // its reply: the lease is recorded held; pre-registration on its way.
    let abandoned = tokio::spawn(async move {
        impatient
            .post(url)
            .header("content-type", "application/json")
            .body(json!({"ttl_ms": 30_000, "wait_ms": 0}).to_string())
            .send()
            .await
    });
    let recorded = Instant::now();
    loop {
        let view = a.get(&Fencer::path(KEY, "")).await;
        if view.body["state"] == "held" {
            break;
        }
        assert!(
            recorded.elapsed() < Duration::from_millis(900),
            "the grant was never recorded: {}",
            view.body
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The clean-up's release will be applied by Redis, its reply held back.
    backend_relay.set(Mode::DelayReplyTo {
        marker: KEY.as_bytes(),
        delay: Duration::from_millis(3_000),
    });
    // 4. client0: disconnects mid-call (its 1 s timeout).
    assert!(abandoned.await.unwrap().is_err(), "the acquire answered");
    // 5. deliver release(L1): the key is free in Redis. 7–9. client1:
    // acquire on the other sidecar gets it.
    let started = Instant::now();
    let other = loop {
        let r = b.acquire(KEY, 30_000, 0).await;
        if r.status == 200 || started.elapsed() > Duration::from_secs(2) {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(other.status, 200, "{}", other.body);
    // 6. client0: GET — must not answer "held" now.
    let view = a.get(&Fencer::path(KEY, "")).await;
    assert_ne!(
        view.body["state"], "held",
        "two holders: sidecar b handed out token {} while sidecar a still shows its abandoned lease held: {}",
        other.body["token"], view.body
    );
}

/// A sidecar on Redis whose token pre-registration goes through a relay in
/// front of a real gateway, so the test can make it slow.
struct SlowPreregistration {
    _storage: Fencer,
    _gateway: Fencer,
    relay: TcpFault,
    sidecar: Fencer,
    other: Fencer,
    _redis: RedisServer,
}

fn slow_preregistration() -> SlowPreregistration {
    slow_preregistration_env(&[])
}

fn slow_preregistration_env(env: &[(&str, &str)]) -> SlowPreregistration {
    let redis = RedisServer::start(Persistence::Off);
    let storage = Fencer::storage(&[]);
    let gateway = Fencer::gateway(&storage.api, &[]);
    let relay = TcpFault::start(gateway.api_port);
    let pre = format!("http://127.0.0.1:{}/_fencer/v1/fences/", relay.port);
    let sidecar = Fencer::sidecar_env(
        Backend::Redis,
        Some(&redis.url()),
        &[
            ("sidecar.preregister_url", pre.as_str()),
            ("sidecar.preregister_timeout_ms", "6000"),
        ],
        env,
    );
    sidecar.wait_ready();
    let other = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    other.wait_ready();
    SlowPreregistration {
        _storage: storage,
        _gateway: gateway,
        relay,
        sidecar,
        other,
        _redis: redis,
    }
}

/// Item 2: a pre-registration slower than the TTL. The grant is worth
/// nothing by the time of the answer: no "held" answer (a client using the
/// lock for mutual exclusion alone would be a second holder).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_whose_lease_ran_out_before_the_answer_is_not_answered_held() {
    let s = slow_preregistration();
    s.relay
        .set(Mode::DelayReplies(Duration::from_millis(1_600)));
    let r = s.sidecar.acquire("seam:item2", 1_000, 0).await;
    s.relay.set(Mode::Pass);
    assert_eq!(
        (r.status, r.code()),
        (503, "lease_expired_before_answer"),
        "answered after the lease had run out: {}",
        r.body
    );
    assert_eq!(
        s.sidecar
            .metric("fencer_acquire_expired_before_answer_total", &[])
            .await,
        1.0
    );
    // It was not handed over: another sidecar gets the key at once (the
    // clean-up released it), and this sidecar lists no held lease.
    let other = s.other.acquire("seam:item2", 10_000, 2_000).await;
    assert_eq!(other.status, 200, "{}", other.body);
    let mine = s.sidecar.get(&Fencer::path("seam:item2", "")).await;
    assert_ne!(mine.body["state"], "held", "{}", mine.body);
}

/// The model's `answer_after_deadline` trace has the same shape (a reply
/// that comes after the lease's local deadline — the backend's there, the
/// gateway's here); with `FENCER_MUTANT=answer_after_deadline` the client
/// is told "held" although its lease ran out, and another sidecar gets the
/// key too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answer_after_deadline_mutant_makes_two_holders() {
    let s = slow_preregistration_env(&[("FENCER_MUTANT", "answer_after_deadline")]);
    s.relay
        .set(Mode::DelayReplies(Duration::from_millis(1_600)));
    let r = s.sidecar.acquire("seam:item2m", 1_000, 0).await;
    s.relay.set(Mode::Pass);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body["ttl_ms"].as_u64().unwrap() > 0, "{}", r.body);
    let other = s.other.acquire("seam:item2m", 10_000, 2_000).await;
    assert_eq!(other.status, 200, "{}", other.body);
}

/// Item 2, the other half: a grant that spent part of its TTL before the
/// answer reports the time left, not the TTL asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_reports_the_time_left_at_the_answer_not_the_ttl_asked_for() {
    let s = slow_preregistration();
    s.relay.set(Mode::DelayReplies(Duration::from_millis(600)));
    let r = s.sidecar.acquire("seam:item2b", 2_000, 0).await;
    s.relay.set(Mode::Pass);
    assert_eq!(r.status, 200, "{}", r.body);
    let left = r.body["ttl_ms"].as_u64().unwrap();
    assert!(
        left <= 1_400,
        "told {left} ms after 600 ms of a 2000 ms lease were spent: {}",
        r.body
    );
    assert_eq!(r.body["remaining_ms"], r.body["ttl_ms"], "{}", r.body);
}

/// Item 3: a release whose client goes away while the backend's reply is
/// on its way. The backend frees the key; this sidecar must not go on
/// saying "held" (nor let its proxy write under the lease). The model's
/// `release_in_request` trace (docs/model.md); each step names its action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_client_disconnects_never_leaves_the_lease_held_here() {
    let (other, view, list) = release_cut_short(&[]).await;
    assert_eq!(other.status, 200, "{}", other.body);
    // ...and this sidecar does not say it still holds it.
    assert_ne!(
        view.body["state"], "held",
        "two holders: the first sidecar still lists its released lease: {}",
        view.body
    );
    assert!(
        list.body["leases"]
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l["state"] != "held"),
        "{}",
        list.body
    );
}

/// The same trace with `FENCER_MUTANT=release_in_request`: two holders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_in_request_mutant_makes_two_holders_on_the_model_trace() {
    let (other, view, _) = release_cut_short(&[("FENCER_MUTANT", "release_in_request")]).await;
    assert_eq!(other.status, 200, "{}", other.body);
    assert_eq!(view.body["state"], "held", "{}", view.body);
}

/// Runs the `release_in_request` trace; returns the other sidecar's
/// acquire, then this sidecar's view of the key and its list.
async fn release_cut_short(env: &[(&str, &str)]) -> (Resp, Resp, Resp) {
    let redis = RedisServer::start(Persistence::Off);
    let relay = TcpFault::start(redis.port);
    let a = Fencer::sidecar_env(Backend::Redis, Some(&relay.redis_url()), &[], env);
    a.wait_ready();
    let b = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    b.wait_ready();
    // 1–3. client0: acquire — deliver acquire(L1) — deliver its reply.
    let held = a.acquire("seam:item3", 30_000, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);

    // 4. client0: release — 5. deliver release(L1): applied, its reply
    // held back — 6. client0: disconnects mid-call.
    relay.set(Mode::DelayReplies(Duration::from_millis(1_500)));
    let impatient = impatient();
    let gave_up = impatient
        .post(format!(
            "{}{}",
            a.api,
            Fencer::path("seam:item3", "release")
        ))
        .header("content-type", "application/json")
        .body(json!({"lease_id": held.lease()}).to_string())
        .send()
        .await;
    assert!(gave_up.is_err(), "the release answered within 300 ms");
    relay.set(Mode::Pass);

    // 8–10. client1: acquire on the other sidecar: the backend applied the
    // release, so it gets the key.
    let started = Instant::now();
    let other = loop {
        let r = b.acquire("seam:item3", 30_000, 0).await;
        if r.status == 200 || started.elapsed() > Duration::from_secs(5) {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // 7. client0: GET — "held" would be a second holder.
    let view = a.get(&Fencer::path("seam:item3", "")).await;
    let list = a.get("/v1/locks").await;
    (other, view, list)
}

/// Item 10: only the acquirer learns the lease id (a credential: it
/// releases the lock and binds proxied writes) and the signed token; any
/// other local client sees the lease by its tag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_leases_shows_neither_lease_ids_nor_signed_tokens() {
    let s = Fencer::sidecar(Backend::Memory, None, &[]);
    s.wait_ready();
    let held = s
        .post(
            &Fencer::path("seam:item10", "acquire"),
            json!({"ttl_ms": 30_000, "owner": "worker-1"}),
        )
        .await;
    assert_eq!(held.status, 200, "{}", held.body);
    let lease = held.lease();
    let token = held.body["fencing_token"].as_str().unwrap().to_owned();
    for path in [Fencer::path("seam:item10", ""), "/v1/locks".to_owned()] {
        let r = s.get(&path).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let text = r.body.to_string();
        assert!(
            !text.contains(&lease) && !text.contains(&token),
            "{path} shows a credential: {text}"
        );
        assert!(text.contains("lease_tag"), "{text}");
    }
}

fn dapr_config(prefix: Option<&str>) -> String {
    let mut toml = "[[sidecar.dapr_lock_stores]]\nname = \"orders\"\n".to_owned();
    if let Some(p) = prefix {
        toml.push_str(&format!("key_prefix = \"{p}\"\n"));
    }
    toml
}

async fn dapr_unlock(s: &Fencer, resource: &str, owner: &str) -> Value {
    let r = s
        .post(
            "/v1.0-alpha1/unlock/orders",
            json!({"resourceId": resource, "lockOwner": owner}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.body
}

/// Item 10, Dapr: a store has a key namespace of its own by default, and
/// even a store that shares the `/v1/locks` namespace on purpose releases
/// only leases taken through it, never a `/v1/locks` lease of the same
/// owner name (owner names are visible to every local client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dapr_unlock_never_releases_a_lease_taken_through_the_lock_api() {
    for prefix in [None, Some("")] {
        let s = Fencer::sidecar_with_config(Backend::Memory, &dapr_config(prefix), &[]);
        s.wait_ready();
        let held = s
            .post(
                &Fencer::path("order:7", "acquire"),
                json!({"ttl_ms": 30_000, "owner": "worker-1"}),
            )
            .await;
        assert_eq!(held.status, 200, "{}", held.body);
        let answer = dapr_unlock(&s, "order:7", "worker-1").await;
        assert_ne!(answer["status"], 0, "prefix {prefix:?}: {answer}");
        let view = s.get(&Fencer::path("order:7", "")).await;
        assert_eq!(
            view.body["state"], "held",
            "prefix {prefix:?}: {}",
            view.body
        );
        // The store's own locks still work as Dapr specifies.
        let locked = s
            .post(
                "/v1.0-alpha1/lock/orders",
                json!({"resourceId": "order:8", "lockOwner": "w", "expiryInSeconds": 30}),
            )
            .await;
        assert_eq!(locked.body["success"], true, "{}", locked.body);
        assert_eq!(dapr_unlock(&s, "order:8", "w").await["status"], 0);
    }
}

/// Sends `op` on `re:hup` with `body` from a client that gives up after
/// 300 ms while Redis is frozen, then lets Redis answer.
async fn hang_up_while_frozen(redis: &RedisServer, s: &Fencer, op: &str, body: &Value) {
    let impatient = impatient();
    redis.pause();
    let gone = impatient
        .post(format!("{}{}", s.api, Fencer::path("re:hup", op)))
        .body(body.to_string())
        .send()
        .await;
    assert!(gone.is_err(), "answered while Redis was frozen: {gone:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    redis.resume();
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// A release of one hold straight after a sidecar restart (the lease not
/// adopted yet: the backend's count decides) whose client hangs up while
/// Redis is frozen is undone once Redis answers, like a tracked lease's:
/// the client's retry gives back one hold, not the last. Mutant:
/// `holds_change_kept`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untracked_release_whose_client_hung_up_is_undone() {
    let redis = RedisServer::start(Persistence::Off);
    let relay = TcpFault::start(redis.port);
    let mut s = Fencer::sidecar(Backend::Redis, Some(&relay.redis_url()), &[]);
    // The owner marks the count changes (a read of the count names none).
    let body = json!({"ttl_ms": 30_000, "owner": "owner-x7", "reentrant": true});
    let first = s
        .post(&Fencer::path("re:untracked", "acquire"), body.clone())
        .await;
    assert_eq!(first.status, 200, "{}", first.body);
    let again = s
        .post(&Fencer::path("re:untracked", "acquire"), body.clone())
        .await;
    assert_eq!(again.body["holds"], 2, "{}", again.body);
    let lease = first.lease();
    s.crash_and_restart();
    s.wait_ready();
    // The change's reply is held back past the client's patience: the
    // change is in Redis, its client gone before the answer.
    relay.set(Mode::DelayReplyTo {
        marker: b"owner-x7",
        delay: Duration::from_millis(1_000),
    });
    let gone = impatient()
        .post(format!(
            "{}{}",
            s.api,
            Fencer::path("re:untracked", "release")
        ))
        .body(json!({ "lease_id": lease }).to_string())
        .send()
        .await;
    assert!(gone.is_err(), "answered before the held reply: {gone:?}");
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let retried = s.release("re:untracked", &lease).await;
    assert_eq!(
        (
            retried.body["released"].clone(),
            retried.body["holds"].clone()
        ),
        (json!(false), json!(1)),
        "{}\n{}",
        retried.body,
        s.logs()
    );
    assert_eq!(
        s.release("re:untracked", &lease).await.body["released"],
        true
    );
}

/// A semaphore acquire whose client hangs up while Redis is frozen: its
/// slot try goes through once Redis answers, and the permit it took —
/// handed to nobody — is given back at once, not kept for its 30 s TTL
/// (each slot try is an acquire, released by the acquire's clean-up; the
/// mutant `keep_orphans` switches that off). A waiter for the last permit
/// gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_whose_client_hung_up_is_given_back() {
    let redis = RedisServer::start(Persistence::Off);
    let s = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    let path = "/v1/semaphores/hup/acquire";
    let body = json!({"permits": 1, "ttl_ms": 30_000, "wait_ms": 0});
    // The count is fixed (and learnt) before Redis freezes.
    let first = s.post(path, body.clone()).await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(
        s.post(
            "/v1/semaphores/hup/release",
            json!({"lease_id": first.lease()})
        )
        .await
        .body["released"],
        true
    );
    let impatient = impatient();
    redis.pause();
    let gone = impatient
        .post(format!("{}{path}", s.api))
        .body(body.to_string())
        .send()
        .await;
    assert!(gone.is_err(), "answered while Redis was frozen: {gone:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    redis.resume();
    let after = s
        .post(
            path,
            json!({"permits": 1, "ttl_ms": 30_000, "wait_ms": 5_000}),
        )
        .await;
    assert_eq!(after.status, 200, "{}\n{}", after.body, s.logs());
    assert!(after.token() > first.token(), "{}", after.body);
}

/// A client that gives up on an answer after 300 ms.
fn impatient() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap()
}

/// Waits (up to 10 s) for the lease on `key` to count `want` holds here.
async fn settle_holds(s: &Fencer, key: &str, want: u64) {
    let path = Fencer::path(key, "");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let holds = s.get(&path).await.body["holds"].clone();
        if holds == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "holds stayed {holds} (want {want})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A reentrant lease's hold count and a client that goes away before the
/// answer (issue 33 item 1): a re-entry, and a release of one hold, whose
/// callers hung up while Redis was frozen are undone once Redis answers —
/// else the key would stay held after the owner's last release, or the
/// client's retried release would give back two holds and free the key
/// while the owner still holds it. Mutant: `holds_change_kept`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_count_change_whose_client_hung_up_is_undone() {
    let redis = RedisServer::start(Persistence::Off);
    let s = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    let body = json!({"ttl_ms": 30_000, "owner": "o", "reentrant": true});
    let first = s
        .post(&Fencer::path("re:hup", "acquire"), body.clone())
        .await;
    assert_eq!(first.status, 200, "{}", first.body);
    let lease = first.lease();
    // A re-entry, its client gone while Redis is frozen.
    hang_up_while_frozen(&redis, &s, "acquire", &body).await;
    settle_holds(&s, "re:hup", 1).await;
    // Now two holds, then a release of one whose client is gone.
    let again = s
        .post(&Fencer::path("re:hup", "acquire"), body.clone())
        .await;
    assert_eq!(again.body["holds"], 2, "{}", again.body);
    hang_up_while_frozen(&redis, &s, "release", &json!({"lease_id": lease})).await;
    settle_holds(&s, "re:hup", 2).await;
    // The client retries its release: one hold given back, not two.
    let retried = s.release("re:hup", &lease).await;
    assert_eq!(
        (
            retried.body["released"].clone(),
            retried.body["holds"].clone()
        ),
        (json!(false), json!(1)),
        "{}",
        retried.body
    );
    let last = s.release("re:hup", &lease).await;
    assert_eq!(last.body["released"], true, "{}", last.body);
}

/// The client's retry of a re-entry it hung up on, sent while the first
/// try is still on its way (Redis frozen): it waits for the first try's
/// undo (the lease's turn goes with it) and is answered two holds — not a
/// conflict with a count the hung-up try moved, and never three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_reentry_waits_for_the_undo_of_the_try_it_replaces() {
    let redis = RedisServer::start(Persistence::Off);
    let s = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    let body = json!({"ttl_ms": 30_000, "owner": "o", "reentrant": true});
    let url = format!("{}{}", s.api, Fencer::path("re:retry", "acquire"));
    let first = s
        .post(&Fencer::path("re:retry", "acquire"), body.clone())
        .await;
    assert_eq!(first.status, 200, "{}", first.body);
    let impatient = impatient();
    redis.pause();
    let gone = impatient.post(&url).body(body.to_string()).send().await;
    assert!(gone.is_err(), "answered while Redis was frozen: {gone:?}");
    let retry = tokio::spawn(
        reqwest::Client::new()
            .post(url)
            .body(body.to_string())
            .send(),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.resume();
    let answer = retry.await.unwrap().unwrap();
    let status = answer.status().as_u16();
    let answer: Value = answer.json().await.unwrap();
    assert_eq!(
        (status, answer["holds"].clone()),
        (200, json!(2)),
        "{answer}\n{}",
        s.logs()
    );
    assert_eq!(answer["lease_id"], first.body["lease_id"], "{answer}");
    settle_holds(&s, "re:retry", 2).await;
    for left in [json!(1), Value::Null] {
        let r = s.release("re:retry", &first.lease()).await;
        assert_eq!(r.body["holds"], left, "{}", r.body);
    }
}

/// Read-write locks (issue 33 item 2): a read acquire whose reply is held
/// back past the sidecar's request timeout — and whose client gave up —
/// leaves no reader behind: PostgreSQL voids the attempt and removes its
/// reader row (`fencer_void_read_v1`), MySQL removes it on the late
/// answer's connection (`fencer_lock_read_release_v1` with the attempt),
/// Redis takes it out of the readers hash (the sidecar's release of the
/// abandoned lease id, `READ_RELEASE`); a writer elsewhere gets the key at
/// once rather than at the reader's TTL.
async fn a_read_acquire_answered_too_late_leaves_no_reader_behind(
    a: &Fencer,
    b: &Fencer,
    relay: &TcpFault,
) {
    const KEY: &str = "seam:rw";
    // The reply to the statement naming the key (its parameters) is held.
    relay.set(Mode::DelayReplyTo {
        marker: KEY.as_bytes(),
        delay: Duration::from_millis(2_500),
    });
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(600))
        .build()
        .unwrap();
    let gone = impatient
        .post(format!("{}{}", a.api, Fencer::path(KEY, "acquire")))
        .header("content-type", "application/json")
        .body(json!({"mode": "read", "ttl_ms": 30_000, "wait_ms": 0}).to_string())
        .send()
        .await;
    assert!(gone.is_err(), "answered within 600 ms: {gone:?}");
    let started = Instant::now();
    let w = b.acquire(KEY, 10_000, 10_000).await;
    assert_eq!(w.status, 200, "{}", w.body);
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "the writer waited {:?}: a reader nobody holds was kept",
        started.elapsed()
    );
    // Whatever the reply said, the sidecar holds no reader either.
    let listed = a.get("/v1/locks").await;
    assert_eq!(listed.body["count"], 0, "{}", listed.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_read_acquire_answered_too_late_leaves_no_reader_behind() {
    let pg = PgServer::start();
    let relay = TcpFault::start(pg.port);
    let via_relay = format!("postgres://postgres@127.0.0.1:{}/postgres", relay.port);
    let a = Fencer::sidecar(
        Backend::Postgres,
        Some(&via_relay),
        &[("backend.postgres.request_timeout_ms", "1000")],
    );
    a.wait_ready();
    let b = Fencer::sidecar(Backend::Postgres, Some(&pg.url()), &[]);
    b.wait_ready();
    a_read_acquire_answered_too_late_leaves_no_reader_behind(&a, &b, &relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_read_acquire_answered_too_late_leaves_no_reader_behind() {
    let (_db, relay, a, b) = mysql_sidecars_one_behind_a_relay();
    a_read_acquire_answered_too_late_leaves_no_reader_behind(&a, &b, &relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_read_acquire_answered_too_late_leaves_no_reader_behind() {
    let redis = RedisServer::start(Persistence::Off);
    let relay = TcpFault::start(redis.port);
    let a = Fencer::sidecar(
        Backend::Redis,
        Some(&relay.redis_url()),
        &[("backend.redis.request_timeout_ms", "1000")],
    );
    a.wait_ready();
    let b = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    b.wait_ready();
    a_read_acquire_answered_too_late_leaves_no_reader_behind(&a, &b, &relay).await;
}

/// The same seam with the *request* late, not the reply (found by the
/// `seams` fault family on MySQL, M1): try 1's statement is held on its
/// way past the request timeout, try 2 (same lease id) is answered "held",
/// then try 1's statement reaches MariaDB — after the retry — and its
/// compensation runs once it is done. The late statement's confirmation
/// must not take the grant back from try 2 (attempt ids are ordered), so
/// its undo finds nothing of its own and the lease stays the client's.
/// Before `fencer_lock_acquire_v5` it released it: another sidecar got the
/// key (two holders).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_late_first_request_does_not_take_back_the_lease_its_retry_handed_out() {
    const KEY: &str = "seam-late-request";
    let (_db, relay, a, b) = mysql_sidecars_one_behind_a_relay();
    let started = Instant::now();
    relay.delay_request_to(KEY.as_bytes(), LATE_REPLY);
    let got = a.acquire(KEY, 30_000, 0).await;
    assert_eq!(got.status, 200, "{}", got.body);
    assert_eq!(relay.requests_held(), 1, "try 1's statement was not held");
    assert!(
        a.metric("fencer_acquire_retries_total", &[]).await >= 1.0,
        "the first try was not retried"
    );
    // Try 1's statement lands, then its compensation runs.
    tokio::time::sleep((started + LATE_REPLY + Duration::from_millis(1_000)) - Instant::now())
        .await;
    let other = b.acquire(KEY, 10_000, 0).await;
    assert_eq!(
        (other.status, other.code()),
        (409, "lock_held"),
        "a second sidecar acquired a key the first still holds: {}\n{}",
        other.body,
        a.logs()
    );
    let renewed = a.renew(KEY, &got.lease(), 30_000).await;
    assert_eq!(renewed.status, 200, "{}", renewed.body);
}
