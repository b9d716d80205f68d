//! `fencer top --once` against a running sidecar and gateway.

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::*;

fn top(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_fencer"))
        .arg("top")
        .arg("--once")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_shows_leases_rates_and_waiters() {
    let s = Arc::new(Fencer::sidecar(Backend::Memory, None, &[]));
    let held = s.acquire("orders:1", 30_000, 0).await;
    s.acquire("orders:2", 30_000, 0).await;
    // A waiter queued while top samples, and acquisitions between samples.
    let s2 = s.clone();
    let waiter = tokio::spawn(async move { s2.acquire("orders:1", 30_000, 5_000).await });
    let s3 = s.clone();
    let churn = tokio::spawn(async move {
        for i in 0..50 {
            let r = s3.acquire(&format!("billing:{i}"), 10_000, 0).await;
            s3.release(&format!("billing:{i}"), &r.lease()).await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    let (admin, api) = (s.admin.clone(), s.api.clone());
    let text = tokio::task::spawn_blocking(move || {
        top(&["--admin", &admin, "--api", &api, "--interval-ms", "700"])
    })
    .await
    .unwrap();
    churn.await.unwrap();
    assert!(text.contains("(sidecar, memory)"), "{text}");
    assert!(
        text.contains("orders:1") && text.contains("orders:2"),
        "{text}"
    );
    assert!(
        text.contains("waiters by group: ") && text.contains("orders=1"),
        "{text}"
    );
    let rate: f64 = text
        .split("acquisitions/s ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|r| r.parse().ok())
        .unwrap();
    assert!(rate > 0.0, "no acquisition rate in:\n{text}");
    s.release("orders:1", &held.lease()).await;
    assert_eq!(waiter.await.unwrap().status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_works_for_a_gateway() {
    let storage = Fencer::storage(&[]);
    let g = Fencer::gateway(&storage.api, &[]);
    let admin = g.admin.clone();
    let text = tokio::task::spawn_blocking(move || {
        top(&["--admin", &admin, "--api", "", "--interval-ms", "200"])
    })
    .await
    .unwrap();
    assert!(text.contains("(gateway, memory)"), "{text}");
    assert!(text.contains("stale writes rejected 0"), "{text}");
}

/// `--key`: a key as the backend records it, held through another
/// sidecar (issue 33 item 5): state, token, the holder's tag, not here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_shows_a_key_another_sidecar_holds() {
    let redis = RedisServer::start(Persistence::Off);
    let a = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    let b = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    let held = a.acquire("orders/9", 30_000, 0).await;
    assert_eq!(held.status, 200, "{}", held.body);
    let tag = a.get(&Fencer::path("orders/9", "")).await.body["lease_tag"]
        .as_str()
        .unwrap()
        .to_owned();
    let (admin, api) = (b.admin.clone(), b.api.clone());
    let text = tokio::task::spawn_blocking(move || {
        top(&[
            "--admin",
            &admin,
            "--api",
            &api,
            "--interval-ms",
            "200",
            "--key",
            "orders/9",
            "--key",
            "orders:free",
        ])
    })
    .await
    .unwrap();
    let row = text
        .lines()
        .find(|l| l.starts_with("orders/9 "))
        .unwrap_or_else(|| panic!("no row for orders/9 in:\n{text}"));
    for part in ["held", &held.token().to_string(), &tag, " no"] {
        assert!(row.contains(part), "{part:?} not in {row:?}");
    }
    assert!(
        text.lines()
            .any(|l| l.starts_with("orders:free ") && l.contains("free")),
        "{text}"
    );
}
