//! `scaling` (`--local` only): where the sidecar stops scaling. The lock
//! cycle ([`scaling_client`]) at each number of concurrent clients
//! (`--clients`) over each number of distinct keys (`--keys`), through a
//! sidecar on each lock backend (`--backend`: Redis, or a private
//! PostgreSQL like `lock-backends` starts, fsync off). Per point: cycles/s,
//! cycle p50/p99, wait p99, CPU µs per cycle and CPU cores busy of the
//! bench client, the sidecar, the lock backend and the counters' Redis (a
//! separate server, so the lock backend's CPU is its own), how busy the
//! whole machine was, lost updates and errors; `--json FILE` writes it all
//! (bench/scaling.py runs the matrix, bench/plot_scaling.py draws it).
//!
//! Each run lets its clients connect and warm up for [`WARMUP`] before the
//! window opens; a cycle counts when it completes inside the window, CPU
//! is read at the window's edges. Every point uses fresh keys, so with
//! more keys than cycles every acquire is a key's first (a new token
//! counter in Redis, a new row in PostgreSQL): `keys_touched` says how
//! many. One set of servers and one sidecar per backend serve all its
//! points.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::compare::{self, Spec, Target};
use super::local::{self, Proc};
use super::scaling_client::{self as client, Flags, Walk};
use super::servers;
use super::stats::{median_run, Report};

pub const NAME: &str = "scaling";

/// Connecting and warming up before each run's window opens.
pub const WARMUP: Duration = Duration::from_secs(1);

/// A lock backend the scenario measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Redis,
    Postgres,
}

impl Backend {
    fn label(self) -> &'static str {
        match self {
            Backend::Redis => "redis",
            Backend::Postgres => "postgres",
        }
    }
}

/// What to measure: every (clients, keys) point on every backend.
#[derive(Debug, Clone)]
pub struct Matrix {
    pub backends: Vec<Backend>,
    pub clients: Vec<usize>,
    pub keys: Vec<u64>,
    pub secs: u64,
    pub runs: usize,
}

/// CPU per process group: µs per cycle, or cores busy (CPU seconds per
/// second of the window).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Cpu {
    pub client: f64,
    pub sidecar: f64,
    pub backend: f64,
    pub counters: f64,
    pub total: f64,
}

/// One point of the matrix: the run with the median cycle rate, and the
/// totals of all runs.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    pub backend: Backend,
    pub clients: usize,
    pub keys: u64,
    pub cycles_per_sec: f64,
    /// Every run's, in run order.
    pub cycles_per_sec_runs: Vec<f64>,
    pub cycles: u64,
    pub window_secs: f64,
    pub cycle_p50_ms: f64,
    pub cycle_p99_ms: f64,
    pub wait_p99_ms: f64,
    pub cpu_us_per_cycle: Option<Cpu>,
    pub cpu_cores: Option<Cpu>,
    /// Cores busy on the whole machine (anything running, not only these
    /// processes) during the window.
    pub machine_busy_cores: Option<f64>,
    /// Distinct keys the median run locked (warm-up included).
    pub keys_touched: u64,
    /// Over all runs: must be 0.
    pub lost_updates: i64,
    pub errors: u64,
}

/// The machine-readable output (`--json`).
#[derive(Debug, Serialize)]
pub struct JsonOut<'a> {
    pub scenario: &'static str,
    pub seconds: u64,
    pub warmup_seconds: f64,
    pub runs: usize,
    pub cores: usize,
    /// The sidecar's settings that bound its scaling (the defaults).
    pub sidecar_worker_threads: usize,
    pub postgres_pool_size: usize,
    pub points: &'a [Point],
}

impl JsonOut<'_> {
    pub fn new<'a>(m: &Matrix, points: &'a [Point]) -> JsonOut<'a> {
        JsonOut {
            scenario: NAME,
            seconds: m.secs,
            warmup_seconds: WARMUP.as_secs_f64(),
            runs: m.runs,
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            // `runtime.worker_threads = 0` means one thread for a sidecar.
            sidecar_worker_threads: 1,
            postgres_pool_size: crate::lock::settings::PostgresSettings::default().pool_size,
            points,
        }
    }
}

/// A sidecar on one backend, the servers behind it and the counters'
/// Redis; the sidecar drops (stops) before the servers.
struct Stack {
    target: Target,
    counters: redis::Client,
    counters_pid: u32,
    _sidecar: Vec<Proc>,
    _servers: Vec<Proc>,
}

impl Stack {
    async fn start(backend: Backend) -> Result<Stack, String> {
        let (counters_proc, counters_url) = local::redis().await?;
        let (server, spec) = match backend {
            Backend::Redis => {
                let (p, url) = local::redis().await?;
                let pid = p.pid();
                (
                    p,
                    Spec {
                        label: "redis",
                        env: vec![("backend.kind", "redis".into()), ("backend.redis.url", url)],
                        masters: vec![pid],
                        others: vec![],
                        backend_label: "lock redis".into(),
                    },
                )
            }
            Backend::Postgres => {
                let (p, url) = servers::postgres().await?;
                let pid = p.pid();
                (
                    p,
                    Spec {
                        label: "postgres",
                        env: vec![
                            ("backend.kind", "postgres".into()),
                            ("backend.postgres.url", url),
                        ],
                        // The postmaster; its backends are its children.
                        masters: vec![pid],
                        others: vec![],
                        backend_label: "postgres".into(),
                    },
                )
            }
        };
        let (mut targets, sidecar) = compare::start_sidecars(vec![spec]).await?;
        let target = targets.pop().ok_or("no sidecar started")?;
        let counters = redis::Client::open(counters_url.as_str()).map_err(|e| e.to_string())?;
        Ok(Stack {
            target,
            counters,
            counters_pid: counters_proc.pid(),
            _sidecar: sidecar,
            _servers: vec![counters_proc, server],
        })
    }

    /// CPU seconds so far of (client, sidecar, backend, counters).
    fn cpu(&self) -> Option<[f64; 4]> {
        let backend: Option<f64> = self
            .target
            .masters
            .iter()
            .map(|p| local::tree_cpu_secs(*p))
            .sum();
        Some([
            local::cpu_secs(std::process::id())?,
            local::cpu_secs(self.target.sidecar)?,
            backend?,
            local::cpu_secs(self.counters_pid)?,
        ])
    }
}

/// One run of one point.
struct Run {
    report: Report,
    cpu: Option<[f64; 4]>,
    machine_busy_secs: Option<f64>,
    keys_touched: u64,
}

/// Busy CPU seconds of the whole machine so far (`/proc/stat`: all but
/// idle and iowait; 100 ticks per second on Linux).
fn machine_busy_secs() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<f64> = stat
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    let total: f64 = ticks.iter().take(8).sum();
    Some((total - ticks.get(3)? - ticks.get(4)?) / 100.0)
}

async fn run_once(stack: &Stack, clients: usize, keys: u64, secs: u64) -> Result<Run, String> {
    let tag: Arc<str> = format!("{clients}x{keys}-{}", rand::random::<u32>()).into();
    let flags = Arc::new(Flags::default());
    let tasks: Vec<_> = (0..clients)
        .map(|i| {
            tokio::spawn(client::run_client(
                Walk::new(i, clients, keys),
                tag.clone(),
                stack.target.api.clone(),
                stack.counters.clone(),
                flags.clone(),
            ))
        })
        .collect();
    tokio::time::sleep(WARMUP).await;
    let (cpu_before, busy_before) = (stack.cpu(), machine_busy_secs());
    let started = Instant::now();
    flags.measuring.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(secs)).await;
    flags.measuring.store(false, Ordering::Relaxed);
    let window = started.elapsed().as_secs_f64();
    let (cpu_after, busy_after) = (stack.cpu(), machine_busy_secs());
    flags.stop.store(true, Ordering::Relaxed);
    let mut results = Vec::with_capacity(clients);
    for t in tasks {
        results.push(t.await.map_err(|e| e.to_string())??);
    }
    let (lost, keys_touched) = client::check(&stack.counters, &tag, &results).await?;
    let mut report = Report::default();
    for r in results {
        report.absorb(r.window);
    }
    report.secs = window;
    report.lost_updates = lost;
    report.sort();
    let cpu = match (cpu_before, cpu_after) {
        (Some(b), Some(a)) => Some([a[0] - b[0], a[1] - b[1], a[2] - b[2], a[3] - b[3]]),
        _ => None,
    };
    Ok(Run {
        report,
        cpu,
        machine_busy_secs: busy_before.zip(busy_after).map(|(b, a)| a - b),
        keys_touched,
    })
}

fn cpu_of(secs: [f64; 4], per: f64) -> Cpu {
    let [client, sidecar, backend, counters] = secs.map(|s| s / per);
    Cpu {
        client,
        sidecar,
        backend,
        counters,
        total: client + sidecar + backend + counters,
    }
}

fn point(backend: Backend, clients: usize, keys: u64, runs: &[Run]) -> Point {
    let reports: Vec<Report> = runs.iter().map(|r| r.report.clone()).collect();
    let m = median_run(&reports)
        .and_then(|m| reports.iter().position(|r| std::ptr::eq(r, m)))
        .unwrap_or(0);
    let (run, r) = (&runs[m], &reports[m]);
    Point {
        backend,
        clients,
        keys,
        cycles_per_sec: r.cycles_per_sec(),
        cycles_per_sec_runs: reports.iter().map(Report::cycles_per_sec).collect(),
        cycles: r.cycles,
        window_secs: r.secs,
        cycle_p50_ms: Report::pct(&r.cycle_us, 0.5),
        cycle_p99_ms: Report::pct(&r.cycle_us, 0.99),
        wait_p99_ms: Report::pct(&r.wait_us, 0.99),
        cpu_us_per_cycle: run.cpu.map(|c| cpu_of(c, r.cycles.max(1) as f64 / 1e6)),
        cpu_cores: run.cpu.map(|c| cpu_of(c, r.secs.max(1e-9))),
        machine_busy_cores: run.machine_busy_secs.map(|b| b / r.secs.max(1e-9)),
        keys_touched: run.keys_touched,
        lost_updates: runs.iter().map(|r| r.report.lost_updates).sum(),
        errors: runs.iter().map(|r| r.report.errors).sum(),
    }
}

/// The printed header of the table.
pub fn header() -> String {
    format!(
        "  {:<8} {:>7} {:>8} {:>9} {:>7} {:>7} | {:>27} | {:>23} | {:>4} {:>5}",
        "backend",
        "clients",
        "keys",
        "cycles/s",
        "p50 ms",
        "p99 ms",
        "cpu µs/cycle cli/side/back",
        "cores cli/side/back/all",
        "lost",
        "errs"
    )
}

/// One printed row.
pub fn row(p: &Point) -> String {
    let per = p.cpu_us_per_cycle.unwrap_or_default();
    let cores = p.cpu_cores.unwrap_or_default();
    format!(
        "  {:<8} {:>7} {:>8} {:>9.0} {:>7.2} {:>7.2} | {:>7.1} {:>6.1} {:>6.1} {:>5.0} | {:>4.2} {:>4.2} {:>4.2} {:>6.2} | {:>4} {:>5}",
        p.backend.label(),
        p.clients,
        p.keys,
        p.cycles_per_sec,
        p.cycle_p50_ms,
        p.cycle_p99_ms,
        per.client,
        per.sidecar,
        per.backend,
        per.total,
        cores.client,
        cores.sidecar,
        cores.backend,
        p.machine_busy_cores.unwrap_or(0.0),
        p.lost_updates,
        p.errors,
    )
}

/// Runs the matrix, printing a row per point (lost updates are reported
/// in the points; [`lost_updates`] turns them into an error once the JSON
/// is written). Ctrl-C ends it as an error, so the servers are still
/// stopped.
pub async fn run(m: &Matrix) -> Result<Vec<Point>, String> {
    tokio::select! {
        r = run_matrix(m) => r,
        _ = tokio::signal::ctrl_c() => Err(format!("{NAME}: interrupted")),
    }
}

async fn run_matrix(m: &Matrix) -> Result<Vec<Point>, String> {
    crate::outln!(
        "{NAME} ({} s per point after {} s warm-up, median of {} run(s); cpu total includes the counters' Redis; cores all = the whole machine)",
        m.secs,
        WARMUP.as_secs_f64(),
        m.runs
    );
    crate::outln!("{}", header());
    let mut points = Vec::new();
    for backend in &m.backends {
        let stack = Stack::start(*backend).await?;
        for keys in &m.keys {
            for clients in &m.clients {
                let mut runs = Vec::with_capacity(m.runs);
                for _ in 0..m.runs {
                    runs.push(run_once(&stack, *clients, *keys, m.secs).await?);
                }
                let p = point(*backend, *clients, *keys, &runs);
                crate::outln!("{}", row(&p));
                points.push(p);
            }
        }
    }
    Ok(points)
}

/// The points that lost updates, as an error naming them.
pub fn lost_updates(points: &[Point]) -> Result<(), String> {
    let lost: Vec<String> = points
        .iter()
        .filter(|p| p.lost_updates != 0)
        .map(|p| {
            format!(
                "{} {} clients {} keys: {}",
                p.backend.label(),
                p.clients,
                p.keys,
                p.lost_updates
            )
        })
        .collect();
    if lost.is_empty() {
        Ok(())
    } else {
        Err(format!("{NAME}: lost updates ({})", lost.join("; ")))
    }
}
