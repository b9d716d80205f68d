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
        .and_then(|v| v.trim_end_matches('x').parse().ok())
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
                // 3 s, not 1.5 s: beside another test binary (CI runs two
                // at a time) acquiring the 2000 leases took 20 s and one
                // acquire answered 1970 ms after it was sent, past a 1.5 s
                // lease. The leases taken first are still renewed for the
                // whole acquisition phase and a window of at least one TTL.
                "--lease-ttl-ms",
                "3000",
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

/// Runs a backend comparison (`redis-topologies`, `lock-backends`) for one
/// second: each target runs both lock scenarios without lost updates,
/// every other target gets its ratio to the first, each of `pairs`
/// (target, base) its ratio line too, and every target its wait p99.
/// The numbers must be positive; their size is not asserted.
fn comparison_runs_without_lost_updates(scenario: &str, targets: &[&str], pairs: &[(&str, &str)]) {
    let out = Command::new(env!("CARGO_BIN_EXE_fencer"))
        .args([
            "bench",
            "--local",
            "--scenario",
            scenario,
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
    for lock_scenario in ["uncontended-16", "contended-16"] {
        assert!(
            text.contains(&format!("{scenario}: {lock_scenario} (")),
            "{lock_scenario} missing:\n{text}"
        );
    }
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| {
            targets.iter().any(|t| l.starts_with(&format!("  {t} "))) && l.contains("cycles/s")
        })
        .collect();
    assert_eq!(lines.len(), 2 * targets.len(), "{text}");
    for l in lines {
        assert!(l.contains("lost 0 "), "lost updates: {l}");
        assert!(number_after(l, "cycles/s") > 0.0, "did not run: {l}");
    }
    // The contended scenario's block is everything after its header.
    let contended = text
        .split(&format!("{scenario}: contended-16 ("))
        .nth(1)
        .unwrap_or_else(|| panic!("no contended block:\n{text}"));
    for t in targets {
        let row = contended
            .lines()
            .find(|l| l.starts_with(&format!("  {t} ")) && l.contains("cycles/s"))
            .unwrap_or_else(|| panic!("no contended row for {t}:\n{text}"));
        assert!(
            number_after(row, "owner changes/s") > 0.0,
            "no owner changes: {row}"
        );
    }
    let waits: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("  wait p99  "))
        .collect();
    assert_eq!(waits.len(), 2, "a wait p99 line per lock scenario:\n{text}");
    for l in waits {
        for t in targets {
            assert!(
                number_after(l, &format!(" {t} ")) > 0.0,
                "no wait p99 for {t}: {l}"
            );
        }
    }
    for (target, base) in pairs {
        let label = format!("  ratio     {target}/{base} ");
        let rows: Vec<&str> = text.lines().filter(|l| l.starts_with(&label)).collect();
        assert_eq!(rows.len(), 2, "{target}/{base} per lock scenario:\n{text}");
        for l in rows {
            for what in ["cycles/s", "owner changes/s", "wait p99"] {
                let x = number_after(l, what);
                assert!(x > 0.0, "{target}/{base} {what} not positive: {l}");
            }
        }
    }
    let ratio = format!("/{} ", targets[0]);
    assert_eq!(
        text.lines().filter(|l| l.contains(&ratio)).count(),
        2 * (targets.len() - 1),
        "a ratio to {} per other target and scenario:\n{text}",
        targets[0]
    );
}

/// `redis-topologies`: sidecars in Redis single, sentinel and cluster mode
/// and on RedLock.
#[test]
fn redis_topologies_scenario_runs_without_lost_updates() {
    for tool in ["redis-server", "redis-cli"] {
        if Command::new(tool).arg("--version").output().is_err() {
            eprintln!("skipping redis_topologies_scenario_runs_without_lost_updates: `{tool}` is not installed");
            return;
        }
    }
    comparison_runs_without_lost_updates(
        "redis-topologies",
        &["single", "sentinel", "cluster", "redlock"],
        &[],
    );
}

/// `lock-backends`: sidecars on Redis, PostgreSQL (with and without group
/// commit), MySQL (a private MariaDB), a 3-member ZooKeeper ensemble and
/// a 3-member etcd cluster; MySQL is also compared with PostgreSQL,
/// PostgreSQL with itself without group commit, and etcd with PostgreSQL
/// and ZooKeeper.
#[test]
fn lock_backends_scenario_runs_without_lost_updates() {
    comparison_runs_without_lost_updates(
        "lock-backends",
        &[
            "redis",
            "postgres",
            "postgres-alone",
            "mysql",
            "zookeeper",
            "etcd",
        ],
        &[
            ("mysql", "postgres"),
            ("postgres", "postgres-alone"),
            ("etcd", "postgres"),
            ("etcd", "zookeeper"),
        ],
    );
}

/// `scaling` for one second: 2 clients over 10 keys through a sidecar on
/// Redis; the point's row is printed, the JSON names it with cycles, CPU
/// per process and no lost update.
#[test]
fn scaling_scenario_runs_without_lost_updates() {
    let dir = std::env::temp_dir().join(format!("fencer-scaling-smoke-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("scaling.json");
    let out = Command::new(env!("CARGO_BIN_EXE_fencer"))
        .args([
            "bench",
            "--local",
            "--scenario",
            "scaling",
            "--seconds",
            "1",
            "--clients",
            "2",
            "--keys",
            "10",
            "--backend",
            "redis",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = text
        .lines()
        .find(|l| l.trim_start().starts_with("redis "))
        .unwrap_or_else(|| panic!("no point row:\n{text}"));
    assert!(row.contains(" 2 ") && row.contains(" 10 "), "{row}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let points = doc["points"].as_array().unwrap();
    assert_eq!(points.len(), 1, "{doc}");
    let p = &points[0];
    assert_eq!(
        (
            p["backend"].as_str(),
            p["clients"].as_u64(),
            p["keys"].as_u64()
        ),
        (Some("redis"), Some(2), Some(10))
    );
    assert!(p["cycles_per_sec"].as_f64().unwrap() > 0.0, "{p}");
    assert_eq!(p["lost_updates"].as_i64(), Some(0), "{p}");
    assert_eq!(p["errors"].as_u64(), Some(0), "{p}");
    // Every key of the walk was touched (10 keys, hundreds of cycles).
    assert_eq!(p["keys_touched"].as_u64(), Some(10), "{p}");
    // CPU is read in 10 ms ticks: a second of the backend may show none.
    for process in ["client", "sidecar", "backend", "counters"] {
        assert!(
            p["cpu_us_per_cycle"][process].as_f64().unwrap() >= 0.0,
            "no CPU for {process}: {p}"
        );
    }
    assert!(
        p["cpu_us_per_cycle"]["sidecar"].as_f64().unwrap() > 0.0,
        "{p}"
    );
}
