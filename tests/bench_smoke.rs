//! A few seconds of `fencer bench`: every scenario runs on both sides (the
//! sidecar and the direct-Redis baseline) and no update is lost. Asserts
//! nothing about speed.

mod common;

use std::process::Command;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_benchmark_scenario_runs_without_lost_updates() {
    let redis = RedisServer::start(Persistence::Off);
    let s = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    let (api, url) = (s.api.clone(), redis.url());
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_fencer"))
            .args([
                "bench",
                "--scenario",
                "all",
                "--seconds",
                "1",
                "--api",
                &api,
                "--redis",
                &url,
            ])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for scenario in [
        "uncontended-1",
        "uncontended-16",
        "contended-16",
        "spread-64x8",
    ] {
        assert!(text.contains(scenario), "{scenario} missing:\n{text}");
    }
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("cycles/s") && l.contains("lost"))
        .collect();
    assert_eq!(lines.len(), 8, "{text}");
    for l in lines {
        assert!(l.contains("lost 0 "), "lost updates: {l}");
        let cycles: f64 = l
            .split("cycles/s")
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(cycles > 0.0, "scenario did not run: {l}");
    }
}
