//! fencer's etcd client (`src/etcd/`, issue 34) against real members: the
//! calls the lock recipe and the fence store are built on — reads,
//! create-if-absent, leases that take their keys with them, watches that
//! see a deletion or say the history was compacted — and the cluster's
//! faults: a killed leader, a dead or frozen endpoint, an expired auth
//! token. Every test starts its own members (tests/common/etcd.rs).

mod common;

use std::time::Duration;

use common::etcd::{post_json, EtcdCluster};
use fencer::etcd::wire::{Compare, EventType, Op, OpResponse};
use fencer::etcd::{ClientConfig, Credentials, EtcdClient, EtcdError, Retry};
use tokio::time::Instant;

fn client(endpoints: Vec<String>, credentials: Option<Credentials>) -> EtcdClient {
    EtcdClient::new(&ClientConfig {
        endpoints,
        connect_timeout: Duration::from_millis(500),
        credentials,
        tls: Default::default(),
    })
    .unwrap()
}

/// A put tried up to three times, 3 s each: the last answer.
async fn put_retried(c: &EtcdClient, key: &[u8], value: &[u8]) -> Result<(), EtcdError> {
    let mut last = Ok(());
    for _ in 0..3 {
        last = c.put(key, value, 0, soon()).await.map(|_| ());
        if last.is_ok() {
            break;
        }
    }
    last
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(3)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_writes_transactions_leases_and_watches() {
    let etcd = EtcdCluster::with_size(1);
    let c = client(etcd.endpoints(), None);

    // Create-if-absent: the first wins, the second reads the winner.
    let create = || async {
        c.txn(
            &[Compare::absent(b"l/a")],
            &[Op::Put {
                key: b"l/a".to_vec(),
                value: b"first".to_vec(),
                lease: 0,
            }],
            &[Op::Get {
                key: b"l/a".to_vec(),
            }],
            soon(),
            Retry::Idempotent,
        )
        .await
    };
    let first = create().await.unwrap();
    assert!(first.succeeded);
    let second = create().await.unwrap();
    assert!(!second.succeeded);
    let OpResponse::Range(found) = &second.responses[0] else {
        panic!("{second:?}")
    };
    assert_eq!(found.kvs[0].value, b"first");
    // The creation revision is the write's: the store's revision then.
    assert_eq!(found.kvs[0].create_revision, first.header.revision);

    // Keys under a prefix, newest creation first, bounded from above.
    c.put(b"l/b", b"", 0, soon()).await.unwrap();
    let c_rev = c.put(b"l/c", b"", 0, soon()).await.unwrap().header.revision;
    let all = c.newest_before(b"l/", 0, 0, soon()).await.unwrap();
    let names: Vec<_> = all.kvs.iter().map(|kv| kv.key.clone()).collect();
    assert_eq!(names, [b"l/c".to_vec(), b"l/b".to_vec(), b"l/a".to_vec()]);
    let ahead = c.newest_before(b"l/", c_rev - 1, 1, soon()).await.unwrap();
    assert_eq!(ahead.kvs.len(), 1);
    assert_eq!(ahead.kvs[0].key, b"l/b");
    assert!(
        c.newest_before(b"l0", 0, 0, soon())
            .await
            .unwrap()
            .kvs
            .is_empty(),
        "the prefix's end is exclusive"
    );

    // A lease takes its keys with it; a keepalive of a gone lease says 0.
    let lease = c.grant(Duration::from_secs(5), soon()).await.unwrap();
    assert_eq!(lease.ttl, 5);
    c.put(b"l/leased", b"x", lease.id, soon()).await.unwrap();
    let kept = c.keep_alive(lease.id, soon()).await.unwrap();
    assert_eq!((kept.id, kept.ttl), (lease.id, 5));

    // A watch sees the deletion the revoke makes.
    let now = c.get(b"l/leased", soon()).await.unwrap().header.revision;
    let mut watch = c.watch(b"l/leased", now + 1, soon()).await.unwrap();
    c.revoke(lease.id, soon()).await.unwrap();
    let seen = tokio::time::timeout(Duration::from_secs(3), watch.next())
        .await
        .expect("the watch saw the revoke")
        .unwrap();
    assert_eq!(seen.events[0].kind, EventType::Delete, "{seen:?}");
    assert!(c.get(b"l/leased", soon()).await.unwrap().kvs.is_empty());
    assert_eq!(c.keep_alive(lease.id, soon()).await.unwrap().ttl, 0);
    c.revoke(lease.id, soon()).await.unwrap(); // again: already gone, fine

    // A put with a lease that does not exist is refused, not retried.
    assert!(matches!(
        c.put(b"l/x", b"", lease.id, soon()).await,
        Err(EtcdError::Rejected { code: 5, .. })
    ));

    // A watch from a compacted revision is told so.
    let head = c.delete(b"l/b", soon()).await.unwrap().header.revision;
    let (code, body) = post_json(
        etcd.ports()[0],
        "/v3/kv/compaction",
        &format!(r#"{{"revision":"{head}"}}"#),
    )
    .unwrap();
    assert_eq!(code, 200, "{body}");
    let mut old = c.watch(b"l/a", 2, soon()).await.unwrap();
    let said = tokio::time::timeout(Duration::from_secs(3), old.next())
        .await
        .expect("the compacted watch answered")
        .unwrap();
    assert!(said.canceled && said.compact_revision == head, "{said:?}");
}

/// A killed leader, a dead endpoint and a frozen one: reads go on through
/// the others within their deadline; a write whose member may have got it
/// is reported unknown, not retried elsewhere; one that never left is
/// sent to the next member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_fail_over_within_the_deadline() {
    let mut etcd = EtcdCluster::start();
    // A follower first in line (a write to a cluster whose leader just
    // died waits for the election: etcd's own timeout, seconds).
    let follower = (0..3).find(|&i| i != etcd.leader()).unwrap();
    let mut endpoints = etcd.endpoints();
    endpoints.rotate_left(follower);
    let c = client(endpoints, None);
    c.put(b"f/k", b"v", 0, soon()).await.unwrap();

    // The first endpoint dead: nothing was sent to it, so even a write
    // goes on to the next (a write that may have arrived would fail as
    // unknown: see `stuck` below).
    etcd.kill(follower);
    put_retried(&c, b"f/k", b"after-kill").await.unwrap();

    // The leader killed (it may be any member left): reads go on.
    etcd.restart(follower);
    etcd.wait_healthy(Duration::from_secs(15));
    let (old, at) = etcd.kill_leader();
    let got = c
        .get(b"f/k", Instant::now() + Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(got.kvs[0].value, b"after-kill");
    eprintln!("read after the leader's kill in {:?}", at.elapsed());
    etcd.restart(old);
    etcd.wait_healthy(Duration::from_secs(15));

    // A frozen member (a follower: the others keep their leader) first
    // in line: a read gives it a share of the deadline (a third) and goes
    // on — were the whole 3 s its, the read would fail; a write to it is
    // reported unknown.
    let frozen = (0..3).find(|&i| i != etcd.leader()).unwrap();
    let mut endpoints = etcd.endpoints();
    endpoints.rotate_left(frozen);
    let frozen_first = client(endpoints, None);
    frozen_first.get(b"f/k", soon()).await.unwrap(); // prefers it
    etcd.pause(frozen);
    let read = frozen_first
        .get(b"f/k", Instant::now() + Duration::from_secs(3))
        .await
        .unwrap();
    assert_eq!(read.kvs[0].value, b"after-kill");
    // A write that meets an election (under load one can start while a
    // member is frozen) fails as unknown: tried three times. Sent to the
    // frozen member, every try would fail.
    let write = put_retried(&frozen_first, b"f/k", b"x").await;
    // The read moved the preference on to a live member: the write goes
    // there.
    assert!(write.is_ok(), "{write:?}");
    let stuck = client(vec![etcd.endpoints()[frozen].clone()], None);
    let unknown = stuck
        .put(b"f/k", b"y", 0, Instant::now() + Duration::from_millis(500))
        .await;
    assert!(
        matches!(&unknown, Err(EtcdError::Unavailable(m)) if m.contains("outcome is unknown") || m.contains("no answer")),
        "{unknown:?}"
    );
    etcd.resume(frozen);
}

/// Authentication: without credentials every call is refused; with them
/// the client authenticates, and when the token expires (1 s here) it
/// gets a new one and the call goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_authenticates_and_renews_an_expired_token() {
    let etcd = EtcdCluster::with_args(1, &["--auth-token-ttl", "1"]);
    let port = etcd.ports()[0];
    for (path, body) in [
        (
            "/v3/auth/user/add",
            r#"{"name":"root","password":"rootpw"}"#,
        ),
        ("/v3/auth/role/add", r#"{"name":"root"}"#),
        ("/v3/auth/user/grant", r#"{"user":"root","role":"root"}"#),
        ("/v3/auth/enable", "{}"),
    ] {
        let (code, text) = post_json(port, path, body).unwrap();
        assert_eq!(code, 200, "{path}: {text}");
    }
    let anonymous = client(etcd.endpoints(), None);
    assert!(matches!(
        anonymous.get(b"a/k", soon()).await,
        Err(EtcdError::Rejected { .. })
    ));
    let wrong = client(
        etcd.endpoints(),
        Some(Credentials {
            user: "root".into(),
            password: "nope".into(),
        }),
    );
    assert!(matches!(
        wrong.get(b"a/k", soon()).await,
        Err(EtcdError::Rejected { .. })
    ));
    let root = client(
        etcd.endpoints(),
        Some(Credentials {
            user: "root".into(),
            password: "rootpw".into(),
        }),
    );
    root.put(b"a/k", b"v", 0, soon()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let got = root.get(b"a/k", soon()).await.unwrap();
    assert_eq!(got.kvs[0].value, b"v");
}

/// TLS with a private CA, and client certificates when the member asks
/// for them (`--client-cert-auth`): the client verifies the member
/// against `ca_file`, presents its own certificate, and is refused
/// without it or against the public roots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_private_ca_and_client_certificates() {
    let certs = common::make_certs();
    let d = certs.path();
    common::make_client_cert(d, "/CN=fencer");
    let etcd = EtcdCluster::with_tls(d, true);
    let file = |f: &str| Some(d.join(f).display().to_string());
    let tls_client = |tls: fencer::http::tls_client::UpstreamTls| {
        EtcdClient::new(&ClientConfig {
            endpoints: etcd.tls_endpoints(),
            connect_timeout: Duration::from_millis(1_000),
            credentials: None,
            tls,
        })
        .unwrap()
    };
    let full = tls_client(fencer::http::tls_client::UpstreamTls {
        ca_file: file("ca.crt"),
        client_cert_file: file("client.crt"),
        client_key_file: file("client.key"),
        server_name: None,
    });
    full.put(b"t/k", b"v", 0, soon()).await.unwrap();
    assert_eq!(full.get(b"t/k", soon()).await.unwrap().kvs[0].value, b"v");
    let no_cert = tls_client(fencer::http::tls_client::UpstreamTls {
        ca_file: file("ca.crt"),
        ..Default::default()
    });
    let refused = no_cert.get(b"t/k", soon()).await;
    assert!(
        matches!(refused, Err(EtcdError::Unavailable(_))),
        "{refused:?}"
    );
    let public_roots = tls_client(Default::default());
    let refused = public_roots.get(b"t/k", soon()).await;
    assert!(
        matches!(&refused, Err(EtcdError::Unavailable(m)) if m.contains("certificate") || m.contains("UnknownIssuer")),
        "{refused:?}"
    );
}
