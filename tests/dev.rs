//! `fencer dev`: the README's first command. One process, every role, one
//! metrics endpoint, and the fencing walkthrough works.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_runs_every_role_behind_one_metrics_endpoint() {
    let [api, proxy, gw, st, admin] = [
        free_port(),
        free_port(),
        free_port(),
        free_port(),
        free_port(),
    ];
    let mut child = Command::new(env!("CARGO_BIN_EXE_fencer"))
        .arg("dev")
        .env("FENCER__SIDECAR__LISTEN", format!("127.0.0.1:{api}"))
        .env("FENCER__PROXY__LISTEN", format!("127.0.0.1:{proxy}"))
        .env("FENCER__GATEWAY__LISTEN", format!("127.0.0.1:{gw}"))
        .env("FENCER__STORAGE__LISTEN", format!("127.0.0.1:{st}"))
        .env("FENCER__ADMIN__LISTEN", format!("127.0.0.1:{admin}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !http_ok(&format!("http://127.0.0.1:{admin}/readyz")) {
        assert!(Instant::now() < deadline, "fencer dev did not become ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    let http = reqwest::Client::new();
    let lease = send(
        &http,
        "POST",
        &format!("http://127.0.0.1:{api}/v1/locks/account:1/acquire"),
        &[],
        Some("{}"),
    )
    .await;
    assert_eq!(lease.status, 200);
    let w = send(
        &http,
        "PUT",
        &format!("http://127.0.0.1:{proxy}/kv/accounts/1"),
        &[("Fencing-Lease", lease.body["lease_id"].as_str().unwrap())],
        Some(r#"{"balance":100}"#),
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
    let direct = send(
        &http,
        "PUT",
        &format!("http://127.0.0.1:{gw}/kv/accounts/1"),
        &[],
        Some("{}"),
    )
    .await;
    assert_eq!(direct.code(), "fencing_token_required");
    let metrics = http
        .get(format!("http://127.0.0.1:{admin}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for needle in [
        "role=\"dev\"",
        "fencer_acquisitions_total",
        "fencer_proxy_requests_total{result=\"forwarded\"} 1",
        "fencer_gateway_requests_total",
        "fencer_preregistrations_total{result=\"ok\"} 1",
    ] {
        assert!(
            metrics.contains(needle),
            "missing {needle} in one scrape:\n{metrics}"
        );
    }
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
}
