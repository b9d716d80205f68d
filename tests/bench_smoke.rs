//! A few seconds of `fencer bench --local`: every scenario runs (lock
//! scenarios on both sides, the write path through nginx and through the
//! proxy + gateway, fenced writes on a PostgreSQL fence store, many
//! auto-renewed leases), no update is lost and no lease is dropped.
//! Asserts nothing about speed.

mod common;

use std::process::Command;

use common::postgres::PgServer;

fn number_after(line: &str, label: &str) -> f64 {
    line.split(label)
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no number after `{label}` in: {line}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_benchmark_scenario_runs_without_lost_updates() {
    let pg = PgServer::start();
    let url = pg.url();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_fencer"))
            .args([
                "bench",
                "--local",
                "--scenario",
                "all",
                "--seconds",
                "1",
                "--leases",
                "2000",
                "--lease-ttl-ms",
                "1500",
                "--postgres",
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
        "write-path (1 client",
        "write-path (16 client",
        "fence-store-pg",
        "leases (2000",
    ] {
        assert!(text.contains(scenario), "{scenario} missing:\n{text}");
    }
    let lock_lines: Vec<&str> = text
        .lines()
        .filter(|l| {
            (l.starts_with("  fencer ") || l.starts_with("  baseline ")) && l.contains("cycles/s")
        })
        .collect();
    assert_eq!(lock_lines.len(), 8, "{text}");
    for l in lock_lines {
        assert!(l.contains("lost 0 "), "lost updates: {l}");
        assert!(
            number_after(l, "cycles/s") > 0.0,
            "scenario did not run: {l}"
        );
    }
    // direct, nginx and fencer, for 1 and 16 clients; plus direct and
    // fenced for the PostgreSQL fence store.
    let write_lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("writes/s") && !l.contains("ratio"))
        .collect();
    assert_eq!(write_lines.len(), 8, "{text}");
    for l in &write_lines {
        assert!(number_after(l, "writes/s") > 0.0, "no writes: {l}");
        assert!(l.trim_end().ends_with("errors 0"), "errors: {l}");
    }
    let held = text
        .lines()
        .find(|l| l.contains("still held"))
        .expect("leases summary");
    assert_eq!(number_after(held, "still held"), 2000.0, "{text}");
    assert_eq!(number_after(held, "lost"), 0.0, "{text}");
}

/// `redis-topologies` for one second: sidecars in Redis single, sentinel
/// and cluster mode and on RedLock each run both lock scenarios, without
/// lost updates.
#[test]
fn redis_topologies_scenario_runs_without_lost_updates() {
    for tool in ["redis-server", "redis-cli"] {
        if Command::new(tool).arg("--version").output().is_err() {
            eprintln!("skipping redis_topologies_scenario_runs_without_lost_updates: `{tool}` is not installed");
            return;
        }
    }
    let out = Command::new(env!("CARGO_BIN_EXE_fencer"))
        .args([
            "bench",
            "--local",
            "--scenario",
            "redis-topologies",
            "--seconds",
            "1",
            "--runs",
            "1",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for scenario in ["uncontended-16", "contended-16"] {
        assert!(
            text.contains(&format!("redis-topologies: {scenario} (")),
            "{scenario} missing:\n{text}"
        );
    }
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| {
            ["  single ", "  sentinel ", "  cluster ", "  redlock "]
                .iter()
                .any(|p| l.starts_with(p))
                && l.contains("cycles/s")
        })
        .collect();
    assert_eq!(lines.len(), 8, "{text}");
    for l in lines {
        assert!(l.contains("lost 0 "), "lost updates: {l}");
        assert!(number_after(l, "cycles/s") > 0.0, "did not run: {l}");
    }
    assert_eq!(
        text.lines().filter(|l| l.contains("/single ")).count(),
        6,
        "sentinel/single, cluster/single and redlock/single per scenario:\n{text}"
    );
}

/// `lock-backends` for one second: sidecars on Redis, PostgreSQL and a
/// 3-member ZooKeeper ensemble each run both lock scenarios, without lost
/// updates, with their ratios to Redis.
#[test]
fn lock_backends_scenario_runs_without_lost_updates() {
    let out = Command::new(env!("CARGO_BIN_EXE_fencer"))
        .args([
            "bench",
            "--local",
            "--scenario",
            "lock-backends",
            "--seconds",
            "1",
            "--runs",
            "1",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| {
            ["  redis ", "  postgres ", "  zookeeper "]
                .iter()
                .any(|p| l.starts_with(p))
                && l.contains("cycles/s")
        })
        .collect();
    assert_eq!(lines.len(), 6, "{text}");
    for l in lines {
        assert!(l.contains("lost 0 "), "lost updates: {l}");
        assert!(number_after(l, "cycles/s") > 0.0, "did not run: {l}");
    }
    assert_eq!(
        text.lines().filter(|l| l.contains("/redis ")).count(),
        4,
        "postgres/redis and zookeeper/redis per scenario:\n{text}"
    );
}
