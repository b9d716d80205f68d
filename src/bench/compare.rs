//! Comparing lock backends: the same lock scenarios through sidecars that
//! differ only in their backend, taking turns within each run so drift of
//! this noisy machine hits them alike; ratios to the first target (and
//! between any further pairs a comparison names) are per run, and their
//! median is reported: of cycles/s, of owner changes/s and of the wait p99
//! (how long an acquire waited, the contended scenario's latency). Used by
//! `redis-topologies` and `lock-backends`, which only differ in the
//! backends they start.

use std::time::{Duration, Instant};

use super::api_conn::ApiConn;
use super::local::{self, Proc};
use super::locks::{self, Side, SCENARIOS};
use super::stats::{lock_line, median, median_run, Report};

/// The lock scenarios measured on every target.
pub const LOCK_SCENARIOS: [&str; 2] = ["uncontended-16", "contended-16"];
/// How long a sidecar may take to grant its first lock.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// What one target measured in one lock scenario.
#[derive(Debug, Clone)]
pub struct TopologyReport {
    /// The target's label (`single`, `postgres`, `zookeeper`, …).
    pub topology: &'static str,
    /// The run with the median cycle rate.
    pub median: Report,
    /// CPU µs per cycle in that run: bench client, sidecar, the lock
    /// backend's masters, its other processes (replicas, sentinels), the
    /// counters' Redis.
    pub cpu_us: Option<[f64; 5]>,
    /// Wait p99 in ms of every run, in run order.
    pub wait_p99_ms: Vec<f64>,
    /// Over all runs.
    pub lost_updates: i64,
    pub errors: u64,
}

/// Per-run ratios `target / base` of two targets measured in the same runs.
#[derive(Debug, Clone)]
pub struct Ratio {
    pub target: &'static str,
    pub base: &'static str,
    pub cycles: Vec<f64>,
    pub owner_changes: Vec<f64>,
    /// Above 1: `target` waited longer than `base`.
    pub wait_p99: Vec<f64>,
}

/// One lock scenario on every topology.
#[derive(Debug, Clone)]
pub struct ScenarioResult {
    pub scenario: &'static str,
    /// In the stack's order (single, sentinel, …; redis, postgres, …).
    pub topologies: Vec<TopologyReport>,
    /// Every other target against the first, then the stack's extra pairs.
    pub ratios: Vec<Ratio>,
}

/// One sidecar and the processes whose CPU is counted against it.
pub struct Target {
    /// The label in the output (`single`, `sentinel`, `postgres`, …).
    pub topology: &'static str,
    pub api: String,
    pub sidecar: u32,
    /// The lock backend's primary processes, and the rest of it (replicas,
    /// sentinels, followers).
    pub masters: Vec<u32>,
    pub others: Vec<u32>,
    /// What the backend's CPU line calls them ("lock redis", "postgres").
    pub backend_label: String,
}

/// A backend to compare: the sidecar settings that select it and the
/// processes whose CPU counts as its own.
pub struct Spec {
    pub label: &'static str,
    /// `section.field` settings (`backend.kind` and its section).
    pub env: Vec<(&'static str, String)>,
    pub masters: Vec<u32>,
    pub others: Vec<u32>,
    pub backend_label: String,
}

/// Starts one sidecar per spec (no egress proxy) and waits until each has
/// granted a lock.
pub async fn start_sidecars(specs: Vec<Spec>) -> Result<(Vec<Target>, Vec<Proc>), String> {
    let (mut targets, mut sidecars) = (Vec::new(), Vec::new());
    for spec in specs {
        let api_addr = format!("127.0.0.1:{}", local::free_port()?);
        let mut env = vec![
            ("sidecar.listen", api_addr.clone()),
            ("proxy.enabled", "false".into()),
            ("admin.listen", format!("127.0.0.1:{}", local::free_port()?)),
        ];
        env.extend(spec.env);
        let sidecar = local::fencer("sidecar", &env, &api_addr).await?;
        let api = format!("http://{api_addr}");
        first_lock(spec.label, &api, &sidecar).await?;
        targets.push(Target {
            topology: spec.label,
            api,
            sidecar: sidecar.pid(),
            masters: spec.masters,
            others: spec.others,
            backend_label: spec.backend_label,
        });
        sidecars.push(sidecar);
    }
    Ok((targets, sidecars))
}

/// The targets of one comparison and the counters' Redis they share.
pub struct Stack<'a> {
    pub name: &'static str,
    pub targets: &'a [Target],
    pub counters: &'a redis::Client,
    pub counters_pid: u32,
    /// Further (target, base) labels compared like every target with the
    /// first (`mysql` against `postgres`).
    pub pairs: &'a [(&'static str, &'static str)],
}

impl Stack<'_> {
    /// One run of `sc` on `t`, with the CPU per cycle of every process.
    async fn measure(
        &self,
        t: &Target,
        sc: locks::Scenario,
        secs: u64,
    ) -> Result<(Report, Option<[f64; 5]>), String> {
        // With descendants: a PostgreSQL server is a postmaster and one
        // backend process per connection.
        let sum = |pids: &[u32]| -> Option<f64> {
            pids.iter()
                .map(|p| local::tree_cpu_secs(*p))
                .sum::<Option<f64>>()
        };
        let cpu = || -> Option<[f64; 5]> {
            Some([
                local::cpu_secs(std::process::id())?,
                local::cpu_secs(t.sidecar)?,
                sum(&t.masters)?,
                sum(&t.others)?,
                local::cpu_secs(self.counters_pid)?,
            ])
        };
        let before = cpu();
        let r = locks::run_side(Side::Fencer, sc, secs, &t.api, self.counters).await?;
        let per_cycle = match (before, cpu()) {
            (Some(b), Some(a)) => {
                let per = |i: usize| 1e6 * (a[i] - b[i]) / r.cycles.max(1) as f64;
                Some([per(0), per(1), per(2), per(3), per(4)])
            }
            _ => None,
        };
        Ok((r, per_cycle))
    }
}

/// Waits until the sidecar at `api` grants (and releases) a lock: it
/// listens before its backend is resolved (sentinel: the master asked of
/// the sentinels; cluster: the slot map).
async fn first_lock(topology: &str, api: &str, sidecar: &Proc) -> Result<(), String> {
    let started = Instant::now();
    let mut conn = ApiConn::new(api);
    let mut last = String::new();
    while started.elapsed() < READY_TIMEOUT {
        let acquire = conn
            .post_json(
                "/v1/locks/bench-ready/acquire",
                r#"{"ttl_ms":10000,"wait_ms":1000}"#.into(),
            )
            .await;
        match acquire {
            Ok((200, body)) => {
                let lease = serde_json::from_slice::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v.get("lease_id")?.as_str().map(str::to_owned))
                    .ok_or_else(|| format!("{topology} sidecar: bad acquire reply"))?;
                let body = serde_json::json!({ "lease_id": lease }).to_string();
                match conn.post_json("/v1/locks/bench-ready/release", body).await {
                    Ok((200, _)) => return Ok(()),
                    Ok((status, body)) => {
                        last = format!("release: {status} {}", String::from_utf8_lossy(&body))
                    }
                    Err(e) => last = format!("release: {e}"),
                }
            }
            Ok((status, body)) => {
                last = format!("acquire: {status} {}", String::from_utf8_lossy(&body))
            }
            Err(e) => last = format!("acquire: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "the {topology}-mode sidecar granted no lock within {READY_TIMEOUT:?} (last: {last}):\n{}",
        sidecar.log_tail()
    ))
}

/// The index of the run with the median cycle rate (as [`median_run`]).
fn median_index(runs: &[Report]) -> usize {
    median_run(runs)
        .and_then(|m| runs.iter().position(|r| std::ptr::eq(r, m)))
        .unwrap_or(0)
}

/// The per-run ratios of target `i` to target `base`.
fn ratio(targets: &[Target], reports: &[Vec<Report>], i: usize, base: usize) -> Ratio {
    let per_run = |f: &dyn Fn(&Report) -> f64| -> Vec<f64> {
        reports[i]
            .iter()
            .zip(&reports[base])
            .map(|(x, b)| f(x) / f(b).max(1e-9))
            .collect()
    };
    Ratio {
        target: targets[i].topology,
        base: targets[base].topology,
        cycles: per_run(&|r| r.cycles_per_sec()),
        owner_changes: per_run(&|r| r.rate(r.owner_changes)),
        wait_p99: per_run(&wait_p99),
    }
}

/// The wait p99 of a run, in ms.
fn wait_p99(r: &Report) -> f64 {
    Report::pct(&r.wait_us, 0.99)
}

fn list(v: &[f64]) -> String {
    v.iter()
        .map(|r| format!("{r:.2}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs both lock scenarios `runs` times on every target, prints as it
/// goes; fails if any update was lost.
pub async fn run(stack: &Stack<'_>, secs: u64, runs: usize) -> Result<Vec<ScenarioResult>, String> {
    let name = stack.name;
    let index = |label: &str| {
        stack
            .targets
            .iter()
            .position(|t| t.topology == label)
            .ok_or_else(|| format!("{name}: no target `{label}` to compare"))
    };
    let pairs: Vec<(usize, usize)> = stack
        .pairs
        .iter()
        .map(|(t, b)| Ok((index(t)?, index(b)?)))
        .collect::<Result<_, String>>()?;
    let mut out = Vec::new();
    for name in LOCK_SCENARIOS {
        let sc = *SCENARIOS
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| format!("no lock scenario `{name}`"))?;
        let n = stack.targets.len();
        let mut reports: Vec<Vec<Report>> = vec![Vec::new(); n];
        let mut cpus: Vec<Vec<Option<[f64; 5]>>> = vec![Vec::new(); n];
        for _ in 0..runs {
            for (i, t) in stack.targets.iter().enumerate() {
                let (r, cpu) = stack.measure(t, sc, secs).await?;
                reports[i].push(r);
                cpus[i].push(cpu);
            }
        }
        crate::outln!(
            "{}: {} ({} clients, {} keys, {secs} s per target, targets interleaved within each run, median of {runs} run(s))",
            stack.name, sc.name, sc.clients, sc.keys
        );
        let mut topologies = Vec::new();
        for (i, t) in stack.targets.iter().enumerate() {
            let m = median_index(&reports[i]);
            let median = reports[i][m].clone();
            crate::outln!("{}", lock_line(t.topology, &median));
            if let Some([client, sidecar, masters, others, counters]) = cpus[i][m] {
                let lock = if t.others.is_empty() {
                    format!("{} {masters:.1}", t.backend_label)
                } else {
                    format!(
                        "{} {:.1} = primary {masters:.1} + others {others:.1}",
                        t.backend_label,
                        masters + others
                    )
                };
                crate::outln!(
                    "            cpu µs per cycle: client {client:.1}  sidecar {sidecar:.1}  {lock}  counter redis {counters:.1}  total {:.1}",
                    client + sidecar + masters + others + counters
                );
            }
            topologies.push(TopologyReport {
                topology: t.topology,
                median,
                cpu_us: cpus[i][m],
                wait_p99_ms: reports[i].iter().map(wait_p99).collect(),
                lost_updates: reports[i].iter().map(|r| r.lost_updates).sum(),
                errors: reports[i].iter().map(|r| r.errors).sum(),
            });
        }
        let ratios: Vec<Ratio> = (1..n)
            .map(|i| (i, 0))
            .chain(pairs.iter().copied())
            .map(|(i, base)| ratio(stack.targets, &reports, i, base))
            .collect();
        for r in &ratios {
            let label = format!("{}/{}", r.target, r.base);
            crate::outln!(
                "  ratio     {label:<15} cycles/s {:.2}x (median of per-run ratios; runs: {})  owner changes/s {:.2}x (runs: {})  wait p99 {:.2}x (runs: {})",
                median(r.cycles.clone()),
                list(&r.cycles),
                median(r.owner_changes.clone()),
                list(&r.owner_changes),
                median(r.wait_p99.clone()),
                list(&r.wait_p99),
            );
        }
        crate::outln!(
            "  wait p99  ms, median of runs: {}",
            topologies
                .iter()
                .map(|t| format!(
                    "{} {:.2} (runs: {})",
                    t.topology,
                    median(t.wait_p99_ms.clone()),
                    list(&t.wait_p99_ms)
                ))
                .collect::<Vec<_>>()
                .join(", "),
        );
        crate::outln!(
            "  all runs  lost updates: {}  errors: {}",
            topologies
                .iter()
                .map(|t| format!("{} {}", t.topology, t.lost_updates))
                .collect::<Vec<_>>()
                .join(", "),
            topologies
                .iter()
                .map(|t| format!("{} {}", t.topology, t.errors))
                .collect::<Vec<_>>()
                .join(", "),
        );
        out.push(ScenarioResult {
            scenario: sc.name,
            topologies,
            ratios,
        });
    }
    let lost: Vec<String> = out
        .iter()
        .flat_map(|s| {
            s.topologies
                .iter()
                .filter(|t| t.lost_updates != 0)
                .map(move |t| format!("{} on {}: {}", s.scenario, t.topology, t.lost_updates))
        })
        .collect();
    if !lost.is_empty() {
        return Err(format!("{name}: lost updates ({})", lost.join("; ")));
    }
    Ok(out)
}
