//! Group commit of Redis acquires and releases (`src/lock/redis/batch.rs`).
//!
//! To put calls in one batch for certain, a test freezes its own
//! redis-server (SIGSTOP), sends one call (it goes out at once and stays in
//! flight), queues the calls under test behind it, and resumes Redis: they
//! then go together in the next batch. Part of the tests drive the backend
//! in-process (same key twice, the same lease twice, wrong-lease releases
//! need calls the sidecar API does not make); the rest go through sidecars.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use fencer::lock::redis::settings::RedisSettings;
use fencer::lock::redis::RedisBackend;
use fencer::lock::{Attempt, BackendError, LeaseId, LockBackend, LockKey, Ownership, WakeSink};
use redis::Commands;

struct NoWake;

impl WakeSink for NoWake {
    fn released(&self, _key: &str) {}
    fn resync(&self) {}
}

struct InProcess {
    backend: Arc<RedisBackend>,
    registry: prometheus::Registry,
}

impl InProcess {
    fn new(
        redis: &RedisServer,
        lock_delay: Duration,
        tune: impl FnOnce(&mut RedisSettings),
    ) -> Self {
        let mut settings = RedisSettings {
            url: redis.url(),
            request_timeout_ms: 3_000,
            ..RedisSettings::default()
        };
        tune(&mut settings);
        let registry = prometheus::Registry::new();
        let backend =
            RedisBackend::new(&settings, lock_delay, Arc::new(NoWake), &registry).unwrap();
        InProcess {
            backend: Arc::new(backend),
            registry,
        }
    }

    fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        use prometheus::Encoder;
        let mut out = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .unwrap();
        metric_sum(&String::from_utf8(out).unwrap(), name, labels)
    }

    /// Calls in batches of more than one so far.
    fn extra_batched(&self, op: &str) -> f64 {
        self.metric("fencer_redis_batched_calls_total", &[("op", op)])
            - self.metric("fencer_redis_batches_total", &[("op", op)])
    }

    fn acquire(
        &self,
        key: &str,
        lease: &LeaseId,
        ttl_ms: u64,
    ) -> tokio::task::JoinHandle<Result<Attempt, BackendError>> {
        let (b, k, l) = (self.backend.clone(), key_of(key), lease.clone());
        tokio::spawn(async move { b.try_acquire(&k, &l, Duration::from_millis(ttl_ms)).await })
    }

    fn release(
        &self,
        key: &str,
        lease: &LeaseId,
    ) -> tokio::task::JoinHandle<Result<Ownership, BackendError>> {
        let (b, k, l) = (self.backend.clone(), key_of(key), lease.clone());
        tokio::spawn(async move { b.release(&k, &l).await })
    }
}

fn key_of(key: &str) -> LockKey {
    LockKey::parse(key).unwrap()
}

fn token(a: &Result<Attempt, BackendError>) -> u64 {
    match a {
        Ok(Attempt::Acquired { token }) => *token,
        other => panic!("not acquired: {other:?}"),
    }
}

/// A call to start later.
type Later<'a, T> = Box<dyn FnOnce() -> T + 'a>;

fn later<'a, T>(f: impl FnOnce() -> T + 'a) -> Later<'a, T> {
    Box::new(f)
}

/// Freezes `redis`, starts `first` (in flight, alone), then each of
/// `queued` 20 ms apart (queued behind it, in this order), and resumes.
async fn in_one_batch<'a, T>(
    redis: &RedisServer,
    first: impl FnOnce() -> T,
    queued: Vec<Later<'a, T>>,
) -> (T, Vec<T>) {
    redis.pause();
    let f = first();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut out = Vec::new();
    for q in queued {
        out.push(q());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    redis.resume();
    (f, out)
}

/// Two acquires of one key in one batch: one is granted, the other sees
/// "held"; the same lease twice in the batch (a retry) gets one token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_twice_in_a_batch_grants_one_lease_and_a_retry_gets_its_token() {
    let redis = RedisServer::start(Persistence::Off);
    let p = InProcess::new(&redis, Duration::ZERO, |_| {});
    let warm = LeaseId::generate();
    let before = token(&p.acquire("same", &warm, 10_000).await.unwrap());
    p.release("same", &warm).await.unwrap().unwrap();

    let (l1, l2, other) = (
        LeaseId::generate(),
        LeaseId::generate(),
        LeaseId::generate(),
    );
    let (first, queued) = in_one_batch(
        &redis,
        || p.acquire("elsewhere", &other, 10_000),
        vec![
            later(|| p.acquire("same", &l1, 10_000)),
            later(|| p.acquire("same", &l1, 10_000)),
            later(|| p.acquire("same", &l2, 10_000)),
        ],
    )
    .await;
    token(&first.await.unwrap());
    let mut answers = Vec::new();
    for q in queued {
        answers.push(q.await.unwrap());
    }
    let (a, b) = (token(&answers[0]), token(&answers[1]));
    assert_eq!(a, b, "a retry of the same lease got another token");
    assert!(a > before, "token {a} not above {before}");
    assert!(
        matches!(answers[2], Ok(Attempt::Held { remaining: Some(_) })),
        "second lease: {:?}",
        answers[2]
    );
    assert!(
        p.extra_batched("acquire") >= 2.0,
        "the three did not share a batch"
    );
    let entry: String = redis.conn().get("fencer:{same}:lock").unwrap();
    assert_eq!(entry, format!("{} {a}", l1.as_str()));
}

/// Releases in one batch: the right lease releases (and says its token),
/// a wrong one is refused and leaves the lock, a free key says free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_releases_answer_each_lease_as_alone() {
    let redis = RedisServer::start(Persistence::Off);
    let p = InProcess::new(&redis, Duration::ZERO, |_| {});
    let leases: Vec<LeaseId> = (0..4).map(|_| LeaseId::generate()).collect();
    let mut tokens = Vec::new();
    for (i, l) in leases.iter().enumerate() {
        tokens.push(token(
            &p.acquire(&format!("rel:{i}"), l, 30_000).await.unwrap(),
        ));
    }
    let held = LeaseId::generate();
    token(&p.acquire("rel:first", &held, 30_000).await.unwrap());
    let wrong = LeaseId::generate();
    let (first, queued) = in_one_batch(
        &redis,
        || p.release("rel:first", &held),
        vec![
            later(|| p.release("rel:0", &leases[0])),
            later(|| p.release("rel:1", &wrong)),
            later(|| p.release("rel:2", &leases[2])),
            later(|| p.release("rel:3", &wrong)),
            later(|| p.release("rel:free", &wrong)),
        ],
    )
    .await;
    first.await.unwrap().unwrap();
    let mut got = Vec::new();
    for q in queued {
        got.push(q.await.unwrap().unwrap());
    }
    assert_eq!(
        got,
        vec![
            Ownership::Owned { token: tokens[0] },
            Ownership::OtherHolder,
            Ownership::Owned { token: tokens[2] },
            Ownership::OtherHolder,
            Ownership::Free,
        ]
    );
    assert!(
        p.extra_batched("release") >= 4.0,
        "the releases did not share a batch"
    );
    let mut conn = redis.conn();
    for (i, present) in [(0, false), (1, true), (2, false), (3, true)] {
        let exists: bool = conn.exists(format!("fencer:{{rel:{i}}}:lock")).unwrap();
        assert_eq!(exists, present, "rel:{i}");
    }
}

/// Lock-delay in a batch: a key whose holder expired stays blocked for
/// the delay, whatever else shares the batch; keys acquired in the batch
/// set their own markers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_delay_holds_in_a_batch() {
    let redis = RedisServer::start(Persistence::Off);
    let p = InProcess::new(&redis, Duration::from_millis(5_000), |_| {});
    token(
        &p.acquire("delay:expired", &LeaseId::generate(), 200)
            .await
            .unwrap(),
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (first, queued) = in_one_batch(
        &redis,
        || p.acquire("delay:first", &LeaseId::generate(), 10_000),
        vec![
            later(|| p.acquire("delay:expired", &LeaseId::generate(), 10_000)),
            later(|| p.acquire("delay:new", &LeaseId::generate(), 10_000)),
        ],
    )
    .await;
    token(&first.await.unwrap());
    let mut got = Vec::new();
    for q in queued {
        got.push(q.await.unwrap());
    }
    match &got[0] {
        Ok(Attempt::Delayed { remaining: r }) => {
            assert!(*r > Duration::from_millis(3_000), "{r:?}")
        }
        other => panic!("expired key not delayed: {other:?}"),
    }
    token(&got[1]);
    assert!(p.extra_batched("acquire") >= 1.0);
    let marker: i64 = redis.conn().pttl("fencer:{delay:new}:delay").unwrap();
    assert!(marker > 10_000, "marker of the new lease lives {marker} ms");
}

/// `wait_replicas` with no replica: every item of a batch is refused as
/// not replicated and undone (no lock entry left), one shortfall each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_shortfall_undoes_every_item_of_the_batch() {
    let redis = RedisServer::start(Persistence::Off);
    let p = InProcess::new(&redis, Duration::ZERO, |s| {
        s.wait_replicas = 1;
        s.wait_timeout_ms = 50;
    });
    let (first, queued) = in_one_batch(
        &redis,
        || p.acquire("short:first", &LeaseId::generate(), 10_000),
        (0..4)
            .map(|i| {
                let p = &p;
                later(move || p.acquire(&format!("short:{i}"), &LeaseId::generate(), 10_000))
            })
            .collect(),
    )
    .await;
    let mut all = vec![first.await.unwrap()];
    for q in queued {
        all.push(q.await.unwrap());
    }
    for a in &all {
        assert!(matches!(a, Err(BackendError::NotReplicated(_))), "{a:?}");
    }
    assert!(p.extra_batched("acquire") >= 3.0);
    assert_eq!(
        p.metric("fencer_redis_wait_shortfalls_total", &[("op", "acquire")]),
        5.0
    );
    let mut conn = redis.conn();
    let left: Vec<String> = conn.keys("fencer:*:lock").unwrap();
    assert!(left.is_empty(), "undo left {left:?}");
}

/// A master that may evict: acquires are refused before they are queued;
/// nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_refusal_comes_before_the_batch() {
    let redis = RedisServer::start_with(
        Persistence::Off,
        &["--maxmemory-policy".into(), "allkeys-lru".into()],
        None,
    );
    let p = InProcess::new(&redis, Duration::ZERO, |_| {});
    let calls: Vec<_> = (0..8)
        .map(|i| p.acquire(&format!("evict:{i}"), &LeaseId::generate(), 10_000))
        .collect();
    for c in calls {
        let a = c.await.unwrap();
        assert!(a.is_err(), "granted on an evicting Redis: {a:?}");
    }
    assert_eq!(
        p.metric("fencer_redis_batched_calls_total", &[("op", "acquire")]),
        0.0
    );
    let left: Vec<String> = redis.conn().keys("fencer:*").unwrap();
    assert!(left.is_empty(), "{left:?}");
}

// ------------------------------------------------------------ sidecars

fn sidecar(redis: &RedisServer, extra: &[(&str, &str)], env: &[(&str, &str)]) -> Fencer {
    Fencer::sidecar_env(Backend::Redis, Some(&redis.url()), extra, env)
}

/// 64 acquires on 64 keys at once through one sidecar, held up behind a
/// frozen Redis so they batch: every one is granted, each with a token
/// above the key's previous one, and each answer is the lock entry Redis
/// holds for that key (lease id and token): `Err` names a mismatch.
async fn batched_acquires_match_redis(env: &[(&str, &str)]) -> Result<(), String> {
    let redis = RedisServer::start(Persistence::Off);
    let s = Arc::new(sidecar(&redis, &[], env));
    let keys: Vec<String> = (0..64).map(|i| format!("many:{i}")).collect();
    let mut before = Vec::new();
    for k in &keys {
        let r = s.acquire(k, 10_000, 0).await;
        if r.status != 200 {
            return Err(format!("warm-up {k}: {} {}", r.status, r.body));
        }
        before.push(r.token());
        s.release(k, &r.lease()).await;
    }
    // Each key's counter a different distance ahead, so every item of the
    // batch gets its own token: a reply given to the wrong item shows.
    // (Fresh counters would all be below one batch's shared clock floor
    // and every item would get the same token.)
    let mut setup = redis.conn();
    for (i, (k, prev)) in keys.iter().zip(before.iter_mut()).enumerate() {
        *prev += (i as u64 + 1) * 1_000_000;
        let _: () = setup
            .set(format!("fencer:{{{k}}}:token"), prev.to_string())
            .unwrap();
    }
    let batches_before = s
        .metric("fencer_redis_batches_total", &[("op", "acquire")])
        .await;
    let calls_before = s
        .metric("fencer_redis_batched_calls_total", &[("op", "acquire")])
        .await;
    redis.pause();
    let calls: Vec<_> = keys
        .iter()
        .map(|k| {
            let (s, k) = (s.clone(), k.clone());
            tokio::spawn(async move { s.acquire(&k, 10_000, 0).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.resume();
    let mut conn = redis.conn();
    let mut wrong = Vec::new();
    for ((k, call), prev) in keys.iter().zip(calls).zip(before) {
        let r = call.await.unwrap();
        if r.status != 200 {
            wrong.push(format!("{k}: {} {}", r.status, r.body));
            continue;
        }
        if r.token() <= prev {
            wrong.push(format!("{k}: token {} not above {prev}", r.token()));
        }
        let entry: Option<String> = conn.get(format!("fencer:{{{k}}}:lock")).unwrap();
        let expected = format!("{} {}", r.lease(), r.token());
        if entry.as_deref() != Some(expected.as_str()) {
            wrong.push(format!("{k}: answered {expected}, Redis holds {entry:?}"));
        }
    }
    let batches = s
        .metric("fencer_redis_batches_total", &[("op", "acquire")])
        .await
        - batches_before;
    let calls = s
        .metric("fencer_redis_batched_calls_total", &[("op", "acquire")])
        .await
        - calls_before;
    if calls <= batches {
        wrong.push(format!(
            "no batch of more than one: {calls} calls in {batches} batches"
        ));
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(wrong.join("\n"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_acquires_on_distinct_keys_share_batches() {
    batched_acquires_match_redis(&[]).await.unwrap();
}

/// The mutant answers each item with its neighbour's reply: the test above
/// must see it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_replies_shifted_mutant_is_caught() {
    let found = batched_acquires_match_redis(&[("FENCER_MUTANT", "batch_replies_shifted")]).await;
    let found = found.expect_err("mis-mapped batch replies went unnoticed");
    assert!(found.contains("Redis holds"), "{found}");
    eprintln!(
        "mutant caught:\n{}",
        found.lines().take(3).collect::<Vec<_>>().join("\n")
    );
}

/// Redis frozen past the budget with a batch in flight and more queued:
/// every acquire answers 503 in bounded time; after Redis resumes, two
/// sidecars racing for each key never both hold it, and tokens move on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_fails_every_batched_item_and_never_makes_two_holders() {
    let redis = RedisServer::start(Persistence::Off);
    let fast = [("backend.redis.request_timeout_ms", "300")];
    let a = Arc::new(sidecar(&redis, &fast, &[]));
    let b = Arc::new(sidecar(&redis, &fast, &[]));
    let keys: Vec<String> = (0..16).map(|i| format!("frozen:{i}")).collect();
    let mut before = Vec::new();
    for k in &keys {
        let r = a.acquire(k, 10_000, 0).await;
        assert_eq!(r.status, 200, "{}", r.body);
        before.push(r.token());
        a.release(k, &r.lease()).await;
    }
    redis.pause();
    let started = Instant::now();
    let calls: Vec<_> = keys
        .iter()
        .map(|k| {
            let (a, k) = (a.clone(), k.clone());
            tokio::spawn(async move { a.acquire(&k, 1_000, 0).await })
        })
        .collect();
    for call in calls {
        let r = call.await.unwrap();
        assert_eq!(
            (r.status, r.code()),
            (503, "backend_unavailable"),
            "{}",
            r.body
        );
    }
    // No hang: bounded by the budget and the retries (5.4 s measured here
    // with and without batching; generous bound).
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    redis.resume();
    // Whatever the frozen batches wrote expires within 1 s (or is released
    // by the acquires' clean-up); then each key goes to exactly one sidecar.
    let races: Vec<_> = keys
        .iter()
        .map(|k| {
            let (a, b, k) = (a.clone(), b.clone(), k.clone());
            tokio::spawn(async move {
                let (ra, rb) =
                    tokio::join!(a.acquire(&k, 20_000, 4_000), b.acquire(&k, 20_000, 4_000));
                (k, ra, rb)
            })
        })
        .collect();
    for (race, prev) in races.into_iter().zip(before) {
        let (k, ra, rb) = race.await.unwrap();
        let granted: Vec<&Resp> = [&ra, &rb].into_iter().filter(|r| r.status == 200).collect();
        assert_eq!(
            granted.len(),
            1,
            "{k}: {} {} / {} {}",
            ra.status,
            ra.body,
            rb.status,
            rb.body
        );
        assert!(granted[0].token() > prev, "{k}: token went back");
    }
    assert!(
        a.metric("fencer_redis_batches_total", &[("op", "acquire")])
            .await
            >= 1.0
    );
}

/// Releases batched through one sidecar publish for each key: waiters on
/// another sidecar are woken long before the holders' TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_releases_wake_waiters_on_another_sidecar() {
    let redis = RedisServer::start(Persistence::Off);
    let a = Arc::new(sidecar(&redis, &[], &[]));
    let b = Arc::new(sidecar(&redis, &[], &[]));
    let keys: Vec<String> = (0..8).map(|i| format!("wake:{i}")).collect();
    let mut leases = Vec::new();
    for k in &keys {
        let r = a.acquire(k, 60_000, 0).await;
        assert_eq!(r.status, 200);
        leases.push(r.lease());
    }
    let waiters: Vec<_> = keys
        .iter()
        .map(|k| {
            let (b, k) = (b.clone(), k.clone());
            tokio::spawn(async move { b.acquire(&k, 10_000, 30_000).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    redis.pause();
    let releases: Vec<_> = keys
        .iter()
        .zip(&leases)
        .map(|(k, l)| {
            let (a, k, l) = (a.clone(), k.clone(), l.clone());
            tokio::spawn(async move { a.release(&k, &l).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    redis.resume();
    let started = Instant::now();
    for r in releases {
        let r = r.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }
    for w in waiters {
        let r = w.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "waiters woke by TTL, not by PUBLISH"
    );
    let extra = a
        .metric("fencer_redis_batched_calls_total", &[("op", "release")])
        .await
        - a.metric("fencer_redis_batches_total", &[("op", "release")])
            .await;
    assert!(extra >= 1.0, "the releases did not share a batch");
}
