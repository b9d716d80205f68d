//! ZooKeeper-specific behaviour and faults: the queue (a waiter that gives
//! up leaves no node, only the next waiter is woken), tokens across leader
//! changes, session expiry by partition and by a paused sidecar, a create
//! whose reply was lost, and the token offset; a dead, frozen or cut-off
//! sidecar's nodes deleted at their lease-expiry record (issue 27 item 5),
//! one budget per acquire try, and an ensemble rebuilt from empty (item 8).
//!
//! Every test starts its own ZooKeeper (tests/common/zookeeper.rs).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::tcp_fault::{Mode, TcpFault};
use common::zookeeper::ZooKeeperEnsemble;
use common::*;
use fencer::lock::zookeeper::settings::ZooKeeperSettings;
use fencer::lock::zookeeper::ZooKeeperBackend;
use fencer::lock::{Attempt, LeaseId, LockBackend, LockKey, WakeSink};
use serde_json::json;
use zookeeper_client as zk;

fn sidecar(connect: &str, extra: &[(&str, &str)]) -> Fencer {
    let mut all = vec![("backend.zookeeper.connect", connect)];
    all.extend_from_slice(extra);
    let s = Fencer::sidecar(Backend::ZooKeeper, None, &all);
    wait_until(
        "the sidecar's ZooKeeper session",
        Duration::from_secs(20),
        || http_ok(&format!("{}/readyz", s.admin)),
    );
    s
}

/// The lock nodes queued under `key` (what any sidecar would see).
async fn queue_of(connect: &str, key: &str) -> Vec<String> {
    let client = zk::Client::connect(connect).await.unwrap();
    let dir = fencer::lock::zookeeper::queue::key_dir("/fencer/locks", key);
    match client.list_children(&dir).await {
        Ok(children) => children,
        Err(zk::Error::NoNode) => Vec::new(),
        Err(e) => panic!("list {dir}: {e}"),
    }
}

/// Queue nodes in queue order: by the sequence number ZooKeeper appended.
fn in_queue_order(mut nodes: Vec<String>) -> Vec<String> {
    nodes.sort_by_key(|n| n.rsplit('-').next().and_then(|s| s.parse::<u64>().ok()));
    nodes
}

async fn acquire_with(s: &Fencer, key: &str, body: serde_json::Value) -> Resp {
    s.post(&Fencer::path(key, "acquire"), body).await
}

/// A waiter's node keeps its place in the key's queue while it waits, and
/// goes when it gives up: nothing queues behind a ghost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_gives_up_leaves_no_node_behind() {
    let zk = ZooKeeperEnsemble::with_size(1);
    let (a, b) = (
        sidecar(&zk.connect_string(), &[]),
        sidecar(&zk.connect_string(), &[]),
    );
    let held = a.acquire("ghost:1", 10_000, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);
    let b = Arc::new(b);
    let b2 = b.clone();
    let waiter = tokio::spawn(async move { b2.acquire("ghost:1", 10_000, 1_500).await });
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(queue_of(&zk.connect_string(), "ghost:1").await.len(), 2);
    assert_eq!(b.metric("fencer_zookeeper_queue_nodes", &[]).await, 1.0);
    let r = waiter.await.unwrap();
    assert_eq!(r.code(), "lock_held", "{}", r.body);
    // A try-lock on a held key leaves nothing either.
    assert_eq!(b.acquire("ghost:1", 10_000, 0).await.code(), "lock_held");
    assert!(
        eventually(Duration::from_secs(3), || {
            futures_block(queue_of(&zk.connect_string(), "ghost:1")).len() == 1
        })
        .await,
        "the waiter's node outlived its wait: {:?}",
        queue_of(&zk.connect_string(), "ghost:1").await
    );
    assert_eq!(b.metric("fencer_zookeeper_queue_nodes", &[]).await, 0.0);
    // And the holder's release lets the next one straight in.
    assert_eq!(a.release("ghost:1", &held.lease()).await.status, 200);
    let next = b.acquire("ghost:1", 10_000, 0).await;
    assert_eq!(next.status, 200, "{}", next.body);
    assert!(next.token() > held.token());
}

fn futures_block<F: std::future::Future>(f: F) -> F::Output {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
}

/// A lease that is not renewed ends on the holder's clock first: the
/// backend deletes its node only once the TTL has passed since the acquire
/// was sent, so the next sidecar gets the key after the holder's deadline,
/// never before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_moves_only_after_the_holders_deadline() {
    let zk = ZooKeeperEnsemble::with_size(1);
    let c = zk.connect_string();
    let (a, b) = (sidecar(&c, &[]), sidecar(&c, &[]));
    for round in 0..3 {
        let key = format!("deadline:{round}");
        let sent = Instant::now();
        let held = a.acquire(&key, 1_000, 0).await;
        assert_eq!(held.status, 200, "{}", held.body);
        let got = b.acquire(&key, 1_000, 5_000).await;
        let moved = sent.elapsed();
        assert_eq!(got.status, 200, "{}", got.body);
        assert!(
            moved >= Duration::from_millis(1_000),
            "round {round}: the key moved {moved:?} after the acquire was sent, before the holder's 1 s lease ended"
        );
        assert_eq!(
            a.renew(&key, &held.lease(), 1_000).await.code(),
            "lease_lost"
        );
    }
}

/// Waiters in different sidecars are served in queue order, and a release
/// wakes only the next one: the later waiter watches the earlier one's
/// node, not the holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecars_are_served_in_queue_order_and_only_the_next_is_woken() {
    let zk = ZooKeeperEnsemble::with_size(1);
    let c = zk.connect_string();
    let (a, b, d) = (
        sidecar(&c, &[]),
        Arc::new(sidecar(&c, &[])),
        Arc::new(sidecar(&c, &[])),
    );
    let held = a.acquire("herd:1", 10_000, 0).await;
    let b2 = b.clone();
    let first = tokio::spawn(async move { b2.acquire("herd:1", 10_000, 10_000).await });
    tokio::time::sleep(Duration::from_millis(400)).await;
    let d2 = d.clone();
    let second = tokio::spawn(async move { d2.acquire("herd:1", 10_000, 10_000).await });
    tokio::time::sleep(Duration::from_millis(400)).await;
    let woken_before = d.metric("fencer_waiter_wakeups_total", &[]).await;
    assert_eq!(a.release("herd:1", &held.lease()).await.status, 200);
    let got = first.await.unwrap();
    assert_eq!(got.status, 200, "{}", got.body);
    assert!(got.token() > held.token());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!second.is_finished(), "the second waiter jumped the queue");
    assert_eq!(
        d.metric("fencer_waiter_wakeups_total", &[]).await,
        woken_before,
        "the holder's release woke a waiter that was not next"
    );
    assert_eq!(b.release("herd:1", &got.lease()).await.status, 200);
    let last = second.await.unwrap();
    assert_eq!(last.status, 200, "{}", last.body);
    assert!(last.token() > got.token());
    for s in [&b, &d] {
        let polled = s
            .metric("fencer_waiter_wakeups_total", &[("cause", "fallback")])
            .await;
        assert_eq!(polled, 0.0, "a waiter polled instead of being woken");
    }
}

/// A 3-server ensemble loses its leader twice: the sidecar's session moves
/// to a surviving member (its lease lives on and renews), and tokens keep
/// increasing — by epoch, the zxid's high 32 bits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_across_leader_changes_and_leases_survive_them() {
    let mut zk = ZooKeeperEnsemble::start();
    let s = sidecar(
        &zk.connect_string(),
        &[
            ("backend.zookeeper.session_timeout_ms", "10000"),
            ("sidecar.default_ttl_ms", "4000"),
        ],
    );
    let held = s.acquire("leader:held", 4_000, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);
    let mut last = 0;
    let mut epochs = Vec::new();
    for round in 0..3 {
        for _ in 0..5 {
            let r = s.acquire("leader:1", 4_000, 3_000).await;
            assert_eq!(r.status, 200, "round {round}: {}", r.body);
            assert!(
                r.token() > last,
                "token went back: {} after {last}",
                r.token()
            );
            last = r.token();
            assert_eq!(s.release("leader:1", &r.lease()).await.status, 200);
        }
        epochs.push(last >> 32);
        if round == 2 {
            break;
        }
        let (old, _) = zk.kill_leader();
        zk.wait_new_leader(old, Duration::from_secs(20));
        // The session survived the move: the held lease renews.
        let renewed = {
            let deadline = Instant::now() + Duration::from_secs(3);
            loop {
                let r = s.renew("leader:held", &held.lease(), 4_000).await;
                if r.status == 200 || Instant::now() > deadline {
                    break r;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        assert_eq!(
            renewed.status,
            200,
            "round {round}: {}\n{}",
            renewed.body,
            s.logs()
        );
        zk.restart(old);
        zk.wait_healthy(Duration::from_secs(30));
    }
    assert!(
        epochs.windows(2).all(|w| w[1] > w[0]),
        "epochs did not advance with the leaders: {epochs:?}"
    );
    assert_eq!(
        s.metric(
            "fencer_zookeeper_session_events_total",
            &[("event", "expired")]
        )
        .await,
        0.0
    );
}

/// The sidecar is cut off from ZooKeeper (half-open: nothing moves either
/// way). Its lease ends on its own clock at its TTL; the other sidecar gets
/// the key after that TTL on the ensemble's clock (the cut-off holder's
/// node is not refreshed, and its lease-expiry record passes) — not before,
/// and without waiting for the session to expire. The partition outlasts
/// the session: when the network heals, the old session is found expired
/// and a new one opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_past_the_session_ends_the_lease_before_anyone_else_gets_the_key() {
    let zk = ZooKeeperEnsemble::with_size(1);
    let cut = TcpFault::start(zk.ports()[0]);
    let session = [
        ("backend.zookeeper.session_timeout_ms", "4000"),
        ("backend.zookeeper.request_timeout_ms", "500"),
        ("sidecar.default_ttl_ms", "1800"),
    ];
    let a = sidecar(&format!("127.0.0.1:{}", cut.port), &session);
    let b = sidecar(&zk.connect_string(), &session);
    // 45% of 4 s: a longer lease could outlive the session.
    let long = a.acquire("cut:1", 1_801, 0).await;
    assert_eq!(
        (long.status, long.code()),
        (400, "ttl_too_long"),
        "{}",
        long.body
    );
    let t_a = Instant::now();
    let held = a.acquire("cut:1", 1_800, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);
    cut.set(Mode::FreezeAll);
    let got = b.acquire("cut:1", 1_800, 20_000).await;
    let t_b = Instant::now();
    assert_eq!(got.status, 200, "{}\n{}", got.body, b.logs());
    assert!(got.token() > held.token());
    assert!(
        t_b - t_a >= Duration::from_millis(1_800),
        "the key moved {:?} after the cut-off holder's acquire was sent: before its lease's TTL ended",
        t_b - t_a
    );
    assert!(
        t_b - t_a < Duration::from_millis(4_000),
        "the key moved only {:?} after the cut-off holder's acquire: at its session's expiry, not its TTL",
        t_b - t_a
    );
    // The holder's own view: lost, and its proxy will not sign for it.
    let r = a.renew("cut:1", &held.lease(), 1_000).await;
    assert_eq!(r.code(), "lease_lost", "{}", r.body);
    assert_eq!(b.release("cut:1", &got.lease()).await.status, 200);
    // Cut off past the session timeout: the ensemble expires the session.
    tokio::time::sleep_until((t_a + Duration::from_millis(5_000)).into()).await;
    cut.set(Mode::Pass);
    cut.reset_all();
    assert!(
        eventually(Duration::from_secs(20), || {
            futures_block(a.metric(
                "fencer_zookeeper_session_events_total",
                &[("event", "expired")],
            )) >= 1.0
                && futures_block(a.metric("fencer_zookeeper_session_up", &[])) == 1.0
        })
        .await,
        "no new session after the partition healed\n{}",
        a.logs()
    );
    let again = a.acquire("cut:1", 1_800, 3_000).await;
    assert_eq!(again.status, 200, "{}\n{}", again.body, a.logs());
    assert!(again.token() > got.token());
}

/// A sidecar frozen (SIGSTOP) past its session timeout: another sidecar
/// takes the key (after its TTL), and the ensemble expires the session.
/// When the sidecar wakes, every lease of the old session is reported lost
/// at once
/// (no lease may outlive 45% of the session, so their deadlines have all
/// passed, and the expired session is noticed besides), none renews, and
/// a new session serves new acquires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_paused_past_its_session_loses_every_lease_at_once() {
    let zk = ZooKeeperEnsemble::with_size(1);
    let c = zk.connect_string();
    let session = [
        ("backend.zookeeper.session_timeout_ms", "3000"),
        ("backend.zookeeper.request_timeout_ms", "500"),
        ("sidecar.default_ttl_ms", "1300"),
    ];
    let a = sidecar(&c, &session);
    let b = sidecar(&c, &session);
    let mut held = Vec::new();
    for key in ["pause:1", "pause:2", "pause:3"] {
        let r = acquire_with(
            &a,
            key,
            json!({"ttl_ms": 1_300, "wait_ms": 0, "auto_renew": true}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        held.push(r);
    }
    unsafe { libc::kill(a.pid() as i32, libc::SIGSTOP) };
    let paused = Instant::now();
    let got = b.acquire("pause:1", 1_300, 15_000).await;
    assert_eq!(got.status, 200, "{}", got.body);
    assert!(got.token() > held[0].token());
    assert_eq!(b.release("pause:1", &got.lease()).await.status, 200);
    // Frozen past the 3 s session: the ensemble expires it.
    tokio::time::sleep_until((paused + Duration::from_millis(4_000)).into()).await;
    unsafe { libc::kill(a.pid() as i32, libc::SIGCONT) };
    assert!(
        eventually(Duration::from_secs(5), || {
            futures_block(a.metric("fencer_lost_leases_total", &[])) == 3.0
                && futures_block(a.metric(
                    "fencer_zookeeper_session_events_total",
                    &[("event", "expired")],
                )) == 1.0
                && futures_block(a.metric("fencer_zookeeper_session_up", &[])) == 1.0
        })
        .await,
        "{}\n{}",
        a.metrics().await,
        a.logs()
    );
    for (key, r) in ["pause:1", "pause:2", "pause:3"].iter().zip(&held) {
        assert_eq!(a.renew(key, &r.lease(), 1_000).await.code(), "lease_lost");
    }
    let again = a.acquire("pause:1", 1_300, 3_000).await;
    assert_eq!(again.status, 200, "{}\n{}", again.body, a.logs());
    assert!(again.token() > got.token());
}

struct NoWake;
impl WakeSink for NoWake {
    fn released(&self, _key: &str) {}
    fn resync(&self) {}
}

async fn backend(connect: &str, request_timeout_ms: u64) -> ZooKeeperBackend {
    let settings = ZooKeeperSettings {
        connect: connect.into(),
        session_timeout_ms: 6_000,
        request_timeout_ms,
        ..Default::default()
    };
    let b = ZooKeeperBackend::new(
        &settings,
        Duration::ZERO,
        Arc::new(NoWake),
        &prometheus::Registry::new(),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while b.ping().await.is_err() {
        assert!(Instant::now() < deadline, "no session");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    b
}

/// The server stalls while a create is on its way: the acquire times out
/// with the outcome unknown. The retry with the same lease id finds the
/// node by its ticket and holds with it — never a second node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_whose_reply_was_lost_is_found_not_repeated() {
    let zk = ZooKeeperEnsemble::with_size(1);
    let c = zk.connect_string();
    let be = backend(&c, 300).await;
    let key = LockKey::parse("lost:1").unwrap();
    // The key's container exists (a create into a missing one would fail
    // outright rather than land late).
    cycle(&be, &key).await;
    let before = creates(&c, "lost:1").await;
    let lease = LeaseId::generate();
    lost_try(&zk, &be, &key, &lease).await;
    let retry = retried(&be, &key, &lease).await;
    let Ok(Attempt::Acquired { token }) = retry else {
        panic!("{retry:?}")
    };
    assert_eq!(queue_of(&c, "lost:1").await.len(), 1);
    // One child change in all: the retry looked before creating again.
    assert_eq!(
        creates(&c, "lost:1").await - before,
        1,
        "the lost create was repeated"
    );
    // Idempotent: the same lease id asks again, the same token comes back.
    assert_eq!(
        be.try_acquire(&key, &lease, Duration::from_secs(2))
            .await
            .unwrap(),
        Attempt::Acquired { token }
    );
    assert_eq!(queue_of(&c, "lost:1").await.len(), 1);
}

/// A try sent while the server stalls: it times out, its create landing
/// once the server resumes (outcome unknown to the caller).
async fn lost_try(zk: &ZooKeeperEnsemble, be: &ZooKeeperBackend, key: &LockKey, lease: &LeaseId) {
    zk.pause(0);
    let first = be.try_acquire(key, lease, Duration::from_secs(2)).await;
    zk.resume(0);
    assert!(first.is_err(), "{first:?}");
}

/// Tries `lease` until the backend answers (the session is back) or two
/// seconds pass; the last answer.
async fn retried(
    be: &ZooKeeperBackend,
    key: &LockKey,
    lease: &LeaseId,
) -> Result<Attempt, fencer::lock::BackendError> {
    let mut answer = be.try_acquire(key, lease, Duration::from_secs(2)).await;
    for _ in 0..20 {
        if answer.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        answer = be.try_acquire(key, lease, Duration::from_secs(2)).await;
    }
    answer
}

/// How many children were ever created under `key`'s queue node.
async fn creates(connect: &str, key: &str) -> i32 {
    let dir = fencer::lock::zookeeper::queue::key_dir("/fencer/locks", key);
    let client = zk::Client::connect(connect).await.unwrap();
    client.get_children(&dir).await.unwrap().1.cversion
}

/// The same seam for a read lease (issue 33 item 2): a reader's create
/// whose reply was lost is found by its ticket on the retry, never
/// repeated; and a reader's try whose caller gave up — the sidecar
/// releases the lease id, as it does for every acquire it could not
/// answer — leaves no reader node behind to keep writers out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_readers_create_whose_reply_was_lost_is_found_or_undone() {
    let zk = ZooKeeperEnsemble::with_size(1);
    let c = zk.connect_string();
    let be = backend(&c, 300).await;
    let key = LockKey::parse("lost:r").unwrap();
    cycle(&be, &key).await;
    let ttl = Duration::from_secs(2);
    // Retried: found, one create in all.
    let (r1, l1) = (key.reader(1), LeaseId::generate());
    let before = creates(&c, "lost:r").await;
    lost_try(&zk, &be, &r1, &l1).await;
    let retry = retried(&be, &r1, &l1).await;
    let Ok(Attempt::Acquired { token }) = retry else {
        panic!("{retry:?}")
    };
    let nodes = queue_of(&c, "lost:r").await;
    assert_eq!(nodes.len(), 1, "{nodes:?}");
    assert!(fencer::lock::zookeeper::queue::is_read_node(&nodes[0]));
    assert_eq!(
        creates(&c, "lost:r").await - before,
        1,
        "the lost create was repeated"
    );
    // A second reader shares the key.
    let (r2, l2) = (key.reader(2), LeaseId::generate());
    let Attempt::Acquired { token: t2 } = be.try_acquire(&r2, &l2, ttl).await.unwrap() else {
        panic!("readers share")
    };
    assert!(t2 > token);
    for (r, l) in [(&r1, &l1), (&r2, &l2)] {
        be.release(r, l).await.unwrap();
    }
    // Given up: released by lease id, the late node goes with it.
    let (r3, l3) = (key.reader(3), LeaseId::generate());
    lost_try(&zk, &be, &r3, &l3).await;
    be.release(&r3, &l3).await.unwrap();
    let got = retried(&be, &key, &LeaseId::generate()).await;
    assert!(
        matches!(got, Ok(Attempt::Acquired { .. })),
        "a writer kept out by an abandoned reader's node: {got:?} {:?}",
        queue_of(&c, "lost:r").await
    );
}

/// Repair after the ensemble lost its data (zxids restart below the
/// gateway's marks): the token offset rises past the mark, and another
/// sidecar still holding the old offset notices at its confirming write
/// rather than minting a token below the mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raised_token_floor_reaches_every_sidecar() {
    let zk = ZooKeeperEnsemble::with_size(1);
    let c = zk.connect_string();
    let (one, two) = (backend(&c, 2_000).await, backend(&c, 2_000).await);
    let key = LockKey::parse("floor:1").unwrap();
    let before = cycle(&two, &key).await;
    let floor = before + 1_000_000_000;
    one.raise_token_floor(&key, floor).await.unwrap();
    let after = cycle(&two, &key).await;
    assert!(
        after > floor,
        "{after} <= {floor}: the stale offset was used"
    );
    let mine = cycle(&one, &key).await;
    assert!(mine > after);
}

/// One acquire + release; the token.
async fn cycle(be: &ZooKeeperBackend, key: &LockKey) -> u64 {
    let lease = LeaseId::generate();
    let attempt = be
        .try_acquire(key, &lease, Duration::from_secs(2))
        .await
        .unwrap();
    let Attempt::Acquired { token } = attempt else {
        panic!("{attempt:?}")
    };
    be.release(key, &lease).await.unwrap();
    token
}

/// TLS to the ensemble (`backend.zookeeper.tls`, a private CA in
/// `ca_file`): locks work over it, and a sidecar that does not trust the
/// server's CA gets no session (its acquires answer 503) rather than
/// talking in the clear.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_private_ca() {
    let certs = make_certs();
    let d = certs.path();
    let pem = std::fs::read_to_string(d.join("server.key")).unwrap()
        + &std::fs::read_to_string(d.join("server.crt")).unwrap();
    std::fs::write(d.join("server.pem"), pem).unwrap();
    let (zk, port) = ZooKeeperEnsemble::with_tls(d);
    let _ = &zk;
    let connect = format!("127.0.0.1:{port}");
    let ca = d.join("ca.crt").display().to_string();
    let s = sidecar(
        &connect,
        &[
            ("backend.zookeeper.tls", "true"),
            ("backend.zookeeper.ca_file", ca.as_str()),
        ],
    );
    let mut last = 0;
    for _ in 0..3 {
        let r = s.acquire("tls:1", 2_000, 0).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.token() > last);
        last = r.token();
        assert_eq!(s.release("tls:1", &r.lease()).await.status, 200);
    }
    assert!(
        s.logs_with("tcp+tls://").contains("tcp+tls://"),
        "{}",
        s.logs()
    );
    // The system roots do not include the test CA: no session.
    let untrusting = Fencer::sidecar(
        Backend::ZooKeeper,
        None,
        &[
            ("backend.zookeeper.connect", connect.as_str()),
            ("backend.zookeeper.tls", "true"),
            ("backend.zookeeper.connect_timeout_ms", "1000"),
        ],
    );
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let r = untrusting.acquire("tls:1", 2_000, 0).await;
    assert_eq!(
        (r.status, r.code()),
        (503, "backend_unavailable"),
        "{}",
        r.body
    );
}

/// Digest auth: fencer's nodes get `creator_all` ACLs, so a client without
/// the identity can neither delete a holder's node (stealing the lock) nor
/// read it, while another sidecar with the same identity queues normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn digest_auth_keeps_strangers_off_the_lock_nodes() {
    let zk = ZooKeeperEnsemble::with_size(1);
    let c = zk.connect_string();
    let auth = [("backend.zookeeper.auth_digest", "fencer:s3cret")];
    let (a, b) = (sidecar(&c, &auth), sidecar(&c, &auth));
    let held = a.acquire("acl:1", 5_000, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);
    let dir = fencer::lock::zookeeper::queue::key_dir("/fencer/locks", "acl:1");
    let friend = zk::Client::connector()
        .with_auth("digest", b"fencer:s3cret")
        .connect(&c)
        .await
        .unwrap();
    let nodes = friend.list_children(&dir).await.unwrap();
    assert_eq!(nodes.len(), 1);
    let path = format!("{dir}/{}", nodes[0]);
    let stranger = zk::Client::connect(&c).await.unwrap();
    assert_eq!(
        stranger.list_children(&dir).await.err(),
        Some(zk::Error::NoAuth)
    );
    assert_eq!(stranger.delete(&path, None).await, Err(zk::Error::NoAuth));
    assert_eq!(
        stranger.get_data(&path).await.err(),
        Some(zk::Error::NoAuth)
    );
    assert_eq!(stranger.get_acl(&path).await.err(), Some(zk::Error::NoAuth));
    let (acl, _) = friend.get_acl(&path).await.unwrap();
    assert!(acl.iter().all(|a| a.scheme() == "digest"), "{acl:?}");
    // The same identity elsewhere: waits, then gets it.
    let b = Arc::new(b);
    let b2 = b.clone();
    let waiter = tokio::spawn(async move { b2.acquire("acl:1", 5_000, 5_000).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(a.release("acl:1", &held.lease()).await.status, 200);
    let got = waiter.await.unwrap();
    assert_eq!(got.status, 200, "{}", got.body);
    assert!(got.token() > held.token());
}

/// An acquire sent in the background on its own connection, so that the
/// sidecar can be killed or frozen meanwhile: its answer and when it came
/// (`None` if the sidecar died first).
fn acquire_in_background(
    s: &Fencer,
    key: &str,
    ttl_ms: u64,
    wait_ms: u64,
) -> tokio::task::JoinHandle<Option<(Resp, Instant)>> {
    s.acquire_in_background(key, json!({"ttl_ms": ttl_ms, "wait_ms": wait_ms}))
}

/// Waits until `key`'s queue has `n` nodes (a background acquire queued).
async fn queued(connect: &str, key: &str, n: usize) {
    assert!(
        eventually(Duration::from_secs(5), || {
            futures_block(queue_of(connect, key)).len() == n
        })
        .await,
        "{key}: {:?}, not {n} nodes",
        queue_of(connect, key).await
    );
}

/// How late past its bound a key may move on this noisy 2-core machine
/// (the bound is met within milliseconds when the machine is idle).
const SLACK: Duration = Duration::from_millis(1_500);

/// The kill tests' sidecars: a session far longer than a lease, so a key
/// freed at the TTL was not freed by the session's end.
const KILLED_CFG: [(&str, &str); 2] = [
    ("backend.zookeeper.session_timeout_ms", "20000"),
    ("sidecar.default_ttl_ms", "2000"),
];
const KILLED_TTL: Duration = Duration::from_millis(2_000);

/// A sidecar killed with `kill -9` deletes nothing, and its ZooKeeper
/// session — with every node of it — lives on for the session timeout
/// (20 s here). Its keys are free once the lease's TTL (2 s) has passed on
/// the ensemble's clock all the same, never before: each node's
/// lease-expiry record (its last write's mtime + its life) lets the node
/// behind it delete it. That holds for a key it held (with a waiter queued
/// behind it, and with nobody waiting: the next try-lock deletes it), and
/// for a key it was only *waiting* for — its queue node would otherwise
/// block everyone queued behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_sidecar_frees_its_keys_after_the_ttl_not_the_session() {
    let zk = ZooKeeperEnsemble::with_size(1);
    let c = zk.connect_string();
    let (cfg, ttl) = (KILLED_CFG, KILLED_TTL);
    // a holds two keys and b waits for a third; both are killed. d holds
    // the third and stays; w waits behind them.
    let (mut a, mut b) = (sidecar(&c, &cfg), sidecar(&c, &cfg));
    let (d, w) = (sidecar(&c, &cfg), sidecar(&c, &cfg));
    let sent = Instant::now();
    let held = a.acquire("kill:held", 2_000, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);
    let idle_sent = Instant::now();
    let idle = a.acquire("kill:idle", 2_000, 0).await;
    assert_eq!(idle.status, 200, "{}", idle.body);
    let d_held = d.acquire("kill:queued", 8_000, 0).await;
    assert_eq!(d_held.status, 200, "{}", d_held.body);
    let _b_waits = acquire_in_background(&b, "kill:queued", 2_000, 15_000);
    queued(&c, "kill:queued", 2).await;
    let w_queued = acquire_in_background(&w, "kill:queued", 2_000, 10_000);
    queued(&c, "kill:queued", 3).await;
    let w_held = acquire_in_background(&w, "kill:held", 2_000, 10_000);
    queued(&c, "kill:held", 2).await;

    a.kill();
    b.kill();
    let killed = Instant::now();
    assert_eq!(d.release("kill:queued", &d_held.lease()).await.status, 200);

    // The held key: after the holder's TTL, not before, and not at the
    // session timeout.
    let (got, at) = w_held.await.unwrap().expect("w answered");
    assert_eq!(got.status, 200, "{}\n{}", got.body, w.logs());
    assert!(got.token() > held.token());
    let moved = at - sent;
    assert!(
        moved >= ttl,
        "the key moved {moved:?} after the killed holder's acquire was sent: before its {ttl:?} lease ended"
    );
    assert!(
        moved <= ttl + SLACK,
        "the killed holder's key moved only {moved:?} after its acquire (TTL {ttl:?}, session 20 s)"
    );
    eprintln!("held key moved {moved:?} after the killed holder's acquire");
    // The key the killed sidecar only waited for: its node no longer
    // blocks the waiter behind it once its keepalives stopped for a TTL.
    let (got, at) = w_queued.await.unwrap().expect("w answered");
    assert_eq!(got.status, 200, "{}\n{}", got.body, w.logs());
    assert!(got.token() > d_held.token());
    eprintln!("queued key moved {:?} after the kill", at - killed);
    assert!(
        at - killed <= ttl + SLACK,
        "the killed waiter's node blocked the queue for {:?} (TTL {ttl:?}, session 20 s)",
        at - killed
    );
    // The key nobody waited for: a try-lock after its TTL finds the dead
    // record and takes the key at once.
    tokio::time::sleep_until((idle_sent + ttl + Duration::from_millis(100)).into()).await;
    let r = w.acquire("kill:idle", 2_000, 0).await;
    assert_eq!(r.status, 200, "{}\n{}", r.body, w.logs());
    assert!(r.token() > idle.token());
    assert_eq!(
        w.metric("fencer_zookeeper_dead_nodes_deleted_total", &[])
            .await,
        3.0
    );
}

/// Read-write locks (issue 33 item 2): readers and writers of 6 keys
/// through two sidecars, so the queue in ZooKeeper — not a sidecar's own
/// FIFO — keeps writers apart from everyone
/// ([`common::rw_check::readers_and_writers_never_overlap`]). Mutants
/// `writers_skip_readers` and `readers_ignore_writers` (the readers' rule
/// in `queue::place`) fail it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_and_writers_of_two_sidecars_never_overlap() {
    let zk = ZooKeeperEnsemble::with_size(1);
    let c = zk.connect_string();
    let sidecars = [Arc::new(sidecar(&c, &[])), Arc::new(sidecar(&c, &[]))];
    common::rw_check::readers_and_writers_never_overlap(&sidecars, "zk").await;
}

/// Read-write locks (issue 33 item 2) with a sidecar killed by `kill -9`:
/// its read lease frees the key for a writer elsewhere after the lease's
/// TTL, as a writer's would (the writer's node, just behind the reader's,
/// deletes it at its lease-expiry record); and its *waiting writer* keeps
/// new readers out — writer preference — only until its keepalives have
/// stopped for a TTL: the reader queued behind it deletes it (a reader
/// watches the nearest write node ahead) and then shares the key with the
/// reader that held it all along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_sidecars_readers_and_waiting_writers_free_the_key_after_the_ttl() {
    let zk = ZooKeeperEnsemble::with_size(1);
    let c = zk.connect_string();
    let (cfg, ttl) = (KILLED_CFG, KILLED_TTL);
    let (mut a, b, w) = (sidecar(&c, &cfg), sidecar(&c, &cfg), sidecar(&c, &cfg));
    let read =
        |ttl_ms: u64, wait_ms: u64| json!({"mode": "read", "ttl_ms": ttl_ms, "wait_ms": wait_ms});
    // rwk:held — a reads; w's writer waits behind it.
    let sent = Instant::now();
    let a_read = acquire_with(&a, "rwk:held", read(2_000, 0)).await;
    assert_eq!(a_read.status, 200, "{}", a_read.body);
    let w_writes = acquire_in_background(&w, "rwk:held", 2_000, 10_000);
    queued(&c, "rwk:held", 2).await;
    // rwk:queued — b reads (and stays); a's writer waits behind it; w's
    // reader queues behind a's writer.
    let b_read = acquire_with(&b, "rwk:queued", read(8_000, 0)).await;
    assert_eq!(b_read.status, 200, "{}", b_read.body);
    let _a_writes = acquire_in_background(&a, "rwk:queued", 2_000, 15_000);
    queued(&c, "rwk:queued", 2).await;
    let w_reads = w.acquire_in_background("rwk:queued", read(2_000, 10_000));
    queued(&c, "rwk:queued", 3).await;
    let nodes = in_queue_order(queue_of(&c, "rwk:queued").await);
    assert!(
        fencer::lock::zookeeper::queue::is_read_node(&nodes[0])
            && !fencer::lock::zookeeper::queue::is_read_node(&nodes[1])
            && fencer::lock::zookeeper::queue::is_read_node(&nodes[2]),
        "{nodes:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !w_reads.is_finished(),
        "a reader got in past a writer queued ahead of it"
    );

    a.kill();
    let killed = Instant::now();
    let (got, at) = w_writes.await.unwrap().expect("w answered");
    assert_eq!(got.status, 200, "{}\n{}", got.body, w.logs());
    assert!(got.token() > a_read.token());
    let moved = at - sent;
    assert!(
        moved >= ttl && moved <= ttl + SLACK,
        "the killed reader's key moved {moved:?} after its acquire (TTL {ttl:?}, session 20 s)"
    );
    let (got, at) = w_reads.await.unwrap().expect("w answered");
    assert_eq!(got.status, 200, "{}\n{}", got.body, w.logs());
    assert_eq!(got.body["mode"], "read", "{}", got.body);
    assert!(got.token() > b_read.token());
    assert!(
        at - killed <= ttl + SLACK,
        "the killed writer's waiting node kept readers out {:?} (TTL {ttl:?}, session 20 s)",
        at - killed
    );
    // b's reader held all along: the two readers share the key.
    let renewed = b
        .post(
            &Fencer::path("rwk:queued", "renew"),
            json!({"lease_id": b_read.lease(), "ttl_ms": 5_000}),
        )
        .await;
    assert_eq!(renewed.status, 200, "{}", renewed.body);
    assert_eq!(
        w.metric("fencer_zookeeper_dead_nodes_deleted_total", &[])
            .await,
        2.0
    );
}

/// The pairs on one node: a holder that renews just in time is never
/// deleted by the waiter behind it (each renewal rewrites its expiry
/// record, and the waiter's version-checked delete loses to it), however
/// long it holds; the same holder frozen (SIGSTOP: alive, silent) loses
/// the key at its TTL on the ensemble's clock — not before — and, woken,
/// finds its lease lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_renewing_in_time_keeps_its_node_and_a_frozen_one_loses_it_at_its_ttl() {
    let zk = ZooKeeperEnsemble::with_size(1);
    let c = zk.connect_string();
    let cfg = [
        ("backend.zookeeper.session_timeout_ms", "20000"),
        ("sidecar.default_ttl_ms", "1500"),
    ];
    let ttl = Duration::from_millis(1_500);
    let (a, w) = (sidecar(&c, &cfg), sidecar(&c, &cfg));
    let mut last = Instant::now();
    let held = a.acquire("slow:1", 1_500, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);
    let waiter = acquire_in_background(&w, "slow:1", 1_500, 9_000);
    queued(&c, "slow:1", 2).await;
    // Each renewal 1.1 s after the previous one's send: inside the local
    // deadline (1.5 s × 0.99 − 20 ms), past most of the node's life.
    for round in 0..4 {
        tokio::time::sleep_until((last + Duration::from_millis(1_100)).into()).await;
        let sent = Instant::now();
        let r = a.renew("slow:1", &held.lease(), 1_500).await;
        assert_eq!(r.status, 200, "round {round}: {}\n{}", r.body, a.logs());
        last = sent;
    }
    assert!(
        !waiter.is_finished(),
        "the waiter got the key while its holder renewed in time: {}",
        waiter
            .await
            .unwrap()
            .map_or("no answer".into(), |(r, _)| r.body.to_string())
    );
    assert_eq!(
        w.metric("fencer_zookeeper_dead_nodes_deleted_total", &[])
            .await,
        0.0
    );
    unsafe { libc::kill(a.pid() as i32, libc::SIGSTOP) };
    let answer = waiter.await;
    unsafe { libc::kill(a.pid() as i32, libc::SIGCONT) };
    let (got, at) = answer.unwrap().expect("w answered");
    assert_eq!(got.status, 200, "{}\n{}", got.body, w.logs());
    assert!(got.token() > held.token());
    let moved = at - last;
    eprintln!("frozen holder's key moved {moved:?} after its last renewal");
    assert!(
        moved >= ttl,
        "the key moved {moved:?} after the frozen holder's last renewal was sent: before its {ttl:?} lease ended"
    );
    assert!(
        moved <= ttl + SLACK,
        "the frozen holder's key moved only {moved:?} after its last renewal (TTL {ttl:?})"
    );
    let r = a.renew("slow:1", &held.lease(), 1_500).await;
    assert_eq!(r.code(), "lease_lost", "{}", r.body);
    assert_eq!(
        w.metric("fencer_zookeeper_dead_nodes_deleted_total", &[])
            .await,
        1.0
    );
}

/// One acquire try is bounded as a whole, not call by call: every reply
/// from ZooKeeper comes 350 ms late (each call alone within its 500 ms
/// request timeout) and a try on a new key needs three calls (the create
/// fails for the missing key node, the key node, the create again). The
/// try answers within the request timeout; the retry afterwards finds what
/// the cut-short try left and holds with one node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_try_is_bounded_as_a_whole_not_call_by_call() {
    let zk = ZooKeeperEnsemble::with_size(1);
    let relay = TcpFault::start(zk.ports()[0]);
    let connect = format!("127.0.0.1:{}", relay.port);
    let be = backend(&connect, 500).await;
    let key = LockKey::parse("budget:1").unwrap();
    let lease = LeaseId::generate();
    relay.set(Mode::DelayReplies(Duration::from_millis(350)));
    let t = Instant::now();
    let first = be.try_acquire(&key, &lease, Duration::from_secs(2)).await;
    let took = t.elapsed();
    relay.set(Mode::Pass);
    eprintln!("one try took {took:?}: {first:?}");
    assert!(
        took <= Duration::from_millis(500 + 300),
        "one try took {took:?} with a 500 ms request timeout: {first:?}"
    );
    assert!(first.is_err(), "{first:?}");
    let mut retry = be.try_acquire(&key, &lease, Duration::from_secs(2)).await;
    for _ in 0..20 {
        if retry.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        retry = be.try_acquire(&key, &lease, Duration::from_secs(2)).await;
    }
    assert!(matches!(retry, Ok(Attempt::Acquired { .. })), "{retry:?}");
    assert_eq!(queue_of(&zk.connect_string(), "budget:1").await.len(), 1);
}

/// The ensemble is rebuilt from empty (its data directory lost): zxids,
/// and with them tokens, start over. Without pre-registration a sidecar's
/// tokens go back below what the gateway accepted (the condition README's
/// Guarantees state, and `check-config` warns about); with it, the first
/// acquisition finds the gateway's mark above its token and raises the
/// token offset past it — for every sidecar, the unregistered one too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ensemble_rebuilt_from_empty_needs_preregistration_to_keep_tokens_rising() {
    let mut zk = ZooKeeperEnsemble::with_size(1);
    let c = zk.connect_string();
    let storage = Fencer::storage(&[]);
    let gateway = Fencer::gateway(&storage.api, &[]);
    let pre = format!("{}/_fencer/v1/fences/", gateway.api);
    // A short session: the rebuilt server refuses the old one, and the
    // client library expires it after 7/5 of its timeout (see below).
    let session = [
        ("backend.zookeeper.session_timeout_ms", "3000"),
        ("backend.zookeeper.request_timeout_ms", "500"),
        ("sidecar.default_ttl_ms", "1000"),
    ];
    let fenced = sidecar(
        &c,
        &[
            session[0],
            session[1],
            session[2],
            ("sidecar.preregister_url", pre.as_str()),
        ],
    );
    let plain = sidecar(&c, &session);
    let mut mark = 0;
    for _ in 0..3 {
        let r = fenced.acquire("rebuilt:1", 1_000, 0).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.token() > mark);
        mark = r.token();
        assert_eq!(fenced.release("rebuilt:1", &r.lease()).await.status, 200);
    }
    zk.restart_empty(0);
    // Without pre-registration: the new ensemble's zxids, below the mark.
    let back = acquire_after_rebuild(&plain, &zk).await;
    assert!(
        back.token() < mark,
        "{} after {mark}: the rebuilt ensemble did not start over",
        back.token()
    );
    assert_eq!(plain.release("rebuilt:1", &back.lease()).await.status, 200);
    // With it: repaired forward past the gateway's mark.
    let repaired = acquire_after_rebuild(&fenced, &zk).await;
    assert!(
        repaired.token() > mark,
        "{} after the gateway's mark {mark}\n{}",
        repaired.token(),
        fenced.logs()
    );
    assert_eq!(
        fenced.release("rebuilt:1", &repaired.lease()).await.status,
        200
    );
    let next = plain.acquire("rebuilt:1", 1_000, 0).await;
    assert_eq!(next.status, 200, "{}", next.body);
    assert!(next.token() > repaired.token());
}

/// Acquires `rebuilt:1` once the sidecar has a session on the rebuilt
/// ensemble. The rebuilt server refuses the old session's reconnects (the
/// client has seen zxids it never wrote) until the client library expires
/// it (7/5 of its timeout unheard) and the sidecar opens a new one.
async fn acquire_after_rebuild(s: &Fencer, zk: &ZooKeeperEnsemble) -> Resp {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = s.acquire("rebuilt:1", 1_000, 0).await;
        if r.status == 200 {
            return r;
        }
        assert_eq!(r.code(), "backend_unavailable", "{}", r.body);
        assert!(
            Instant::now() < deadline,
            "no session on the rebuilt ensemble: {}\n{}\n{}",
            r.body,
            s.logs(),
            zk.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A waiter that stops refreshing its queue node (frozen, SIGSTOP) loses
/// its place, not the queue's order: the waiter behind it deletes its node
/// once its lease-expiry record passes, and when it wakes, its keepalive
/// (or its next try, whichever runs first) finds the node gone and it
/// queues again — at the end, behind the one that took its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_waiter_loses_its_place_and_queues_again_at_the_end() {
    let zk = ZooKeeperEnsemble::with_size(1);
    let c = zk.connect_string();
    let cfg = [
        ("backend.zookeeper.session_timeout_ms", "20000"),
        ("sidecar.default_ttl_ms", "1000"),
    ];
    let (a, b, w) = (sidecar(&c, &cfg), sidecar(&c, &cfg), sidecar(&c, &cfg));
    let held = a.acquire("frozen:1", 8_000, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);
    let b_waits = acquire_in_background(&b, "frozen:1", 1_000, 15_000);
    queued(&c, "frozen:1", 2).await;
    let w_waits = acquire_in_background(&w, "frozen:1", 1_000, 15_000);
    queued(&c, "frozen:1", 3).await;
    let before = in_queue_order(queue_of(&c, "frozen:1").await);
    unsafe { libc::kill(b.pid() as i32, libc::SIGSTOP) };
    let dropped = eventually(Duration::from_secs(5), || {
        futures_block(w.metric("fencer_zookeeper_dead_nodes_deleted_total", &[])) == 1.0
    })
    .await;
    unsafe { libc::kill(b.pid() as i32, libc::SIGCONT) };
    assert!(
        dropped,
        "the frozen waiter's node was not deleted\n{}",
        w.logs()
    );
    // Queued again at the end: the old node gone, a new one behind w's.
    // Which of b's paths finds its node gone first — the keepalive or the
    // waiter's next try — is a race; either queues again, at the end.
    let requeued = |q: Vec<String>| {
        let q = in_queue_order(q);
        q.len() == 3 && q[..2] == [before[0].clone(), before[2].clone()] && !before.contains(&q[2])
    };
    assert!(
        eventually(Duration::from_secs(5), || requeued(futures_block(
            queue_of(&c, "frozen:1")
        )))
        .await,
        "the woken waiter did not queue again at the end: {before:?} then {:?}\n{}",
        queue_of(&c, "frozen:1").await,
        b.logs()
    );
    assert_eq!(a.release("frozen:1", &held.lease()).await.status, 200);
    let (first, _) = w_waits.await.unwrap().expect("w answered");
    assert_eq!(first.status, 200, "{}", first.body);
    assert!(!b_waits.is_finished(), "the frozen waiter kept its place");
    assert_eq!(w.release("frozen:1", &first.lease()).await.status, 200);
    let (second, _) = b_waits.await.unwrap().expect("b answered");
    assert_eq!(second.status, 200, "{}\n{}", second.body, b.logs());
    assert!(first.token() > held.token() && second.token() > first.token());
}
