//! `fencer bench`: measures fencer against baselines taken in the same run
//! (never against numbers from another day or machine), and prints both
//! with their ratio. docs/performance.md holds the results and the
//! profiles behind them.
//!
//! - lock scenarios ([`locks`]): the sidecar's HTTP lock API vs. a direct
//!   in-process Redis client doing the same lock protocol;
//! - `write-path` ([`write_path`]): egress proxy + gateway vs. nginx vs. a
//!   direct request to the same storage;
//! - `fence-store-pg` ([`fence_store`]): fenced writes/s with marks in
//!   PostgreSQL vs. the same writes sent straight to the storage;
//! - `leases` ([`leases`]): memory, CPU and Redis commands of one sidecar
//!   keeping many auto-renewed leases alive;
//! - `redis-topologies` ([`topologies`], `--local` only): two lock scenarios
//!   through sidecars in Redis `single`, `sentinel` and `cluster` mode and
//!   on 5 RedLock masters, each topology started here ([`redis_topology`]),
//!   with the ratio to `single`.
//! - `lock-backends` ([`backends`], `--local` only): the same two lock
//!   scenarios through sidecars on Redis, PostgreSQL, MySQL (MariaDB) and
//!   a 3-member ZooKeeper ensemble ([`servers`]), with the ratio to Redis
//!   and of MySQL to PostgreSQL.
//! - `scaling` ([`scaling`], `--local` only, not part of `all`): the lock
//!   cycle at `--clients` × `--keys` on `--backend` redis and postgres,
//!   with CPU per cycle of every process; `--json FILE` for
//!   bench/scaling.py.
//!
//! With `--local` the tool starts everything it needs itself (Redis,
//! fencer processes from this binary, nginx) on free loopback ports.

mod api_conn;
pub mod backends;
pub mod compare;
mod fence_store;
mod leases;
pub mod local;
mod locks;
pub mod redis_topology;
pub mod scaling;
mod scaling_client;
pub mod servers;
pub mod stats;
pub mod topologies;
mod write_path;

use self::locks::{Side, SCENARIOS};
use self::stats::{cpu_line, lock_line, median, median_run, Report};

const WRITE_PATH: &str = "write-path";
const FENCE_STORE: &str = "fence-store-pg";
const LEASES: &str = "leases";
const TOPOLOGIES: &str = topologies::NAME;
const BACKENDS: &str = backends::NAME;
const SCALING: &str = scaling::NAME;

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Start Redis and a sidecar (and, for the other scenarios, every
    /// other process) on free loopback ports instead of using --api/--redis.
    #[arg(long)]
    pub local: bool,
    /// With --local: the lock scenarios talk to the sidecar over its Unix
    /// socket (`sidecar.listen_unix`) instead of loopback TCP.
    #[arg(long)]
    pub unix: bool,
    /// Base URL of the sidecar's lock API (lock scenarios, without --local):
    /// `http://host:port` or `unix:/path/to/socket`.
    #[arg(long, default_value = "http://127.0.0.1:7411")]
    pub api: String,
    /// The Redis the sidecar uses (baseline client and lost-update counters;
    /// without --local).
    #[arg(long, default_value = "redis://127.0.0.1:6379/0")]
    pub redis: String,
    /// PostgreSQL for the fence-store-pg scenario (skipped without it).
    #[arg(long)]
    pub postgres: Option<String>,
    /// Comma-separated: uncontended-1, uncontended-16, contended-16,
    /// spread-64x8, write-path, fence-store-pg, leases, redis-topologies, lock-backends
    /// (--local only), scaling (--local only, never in `all`); or `all`, or
    /// `locks` (the four lock scenarios).
    #[arg(long, default_value = "all")]
    pub scenario: String,
    /// Seconds per scenario, side and run.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub seconds: u64,
    /// Runs per scenario; sides alternate within a run and the median run
    /// is reported (this machine's noise is larger than many effects).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=101))]
    pub runs: u64,
    /// Leases held in the `leases` scenario.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub leases: u64,
    /// TTL of those leases (they are renewed at a third of it).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1_000..=3_600_000))]
    pub lease_ttl_ms: u64,
    /// Skip the direct-Redis baseline of the lock scenarios.
    #[arg(long)]
    pub no_baseline: bool,
    /// `scaling`: concurrent clients, comma-separated (a point each).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256",
          value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub clients: Vec<u64>,
    /// `scaling`: distinct keys, comma-separated (a point each, times
    /// every --clients).
    #[arg(long, value_delimiter = ',', default_value = "1000,100000,1000000",
          value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub keys: Vec<u64>,
    /// `scaling`: lock backends, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        value_enum,
        default_value = "redis,postgres"
    )]
    pub backend: Vec<scaling::Backend>,
    /// `scaling`: also write every point as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// Every result, for the smoke test.
#[derive(Debug, Default)]
pub struct Results {
    /// (scenario, fencer, baseline) per lock scenario.
    pub locks: Vec<(String, Report, Option<Report>)>,
    /// (path label, clients, report) per write path.
    pub write_path: Vec<(&'static str, usize, Report)>,
    /// (direct, fenced) writes.
    pub fence_store: Option<(Report, Report)>,
    pub leases: Option<leases::LeaseReport>,
    /// `redis-topologies`: per lock scenario, single vs sentinel vs cluster vs redlock.
    pub redis_topologies: Vec<compare::ScenarioResult>,
    /// `lock-backends`: per lock scenario, Redis vs PostgreSQL vs MySQL vs
    /// ZooKeeper.
    pub lock_backends: Vec<compare::ScenarioResult>,
    /// `scaling`: one point per backend × keys × clients.
    pub scaling: Vec<scaling::Point>,
}

fn selected(args: &BenchArgs) -> Result<Vec<&'static str>, String> {
    let all: Vec<&'static str> = SCENARIOS
        .iter()
        .map(|s| s.name)
        .chain([
            WRITE_PATH,
            FENCE_STORE,
            LEASES,
            TOPOLOGIES,
            BACKENDS,
            SCALING,
        ])
        .collect();
    let mut out = Vec::new();
    for name in args.scenario.split(',').map(str::trim) {
        match name {
            // `leases` writes one never-expiring token counter per lease
            // into the Redis it runs on: part of `all` only in a Redis this
            // tool started and throws away. `redis-topologies` starts its
            // own Sentinel set and Cluster: part of `all` only with --local.
            // `scaling` is a matrix of minutes: only when named.
            "all" => out.extend(all.iter().copied().filter(|n| {
                *n != SCALING && (args.local || ![LEASES, TOPOLOGIES, BACKENDS].contains(n))
            })),
            "locks" => out.extend(SCENARIOS.iter().map(|s| s.name)),
            n => match all.iter().find(|a| **a == n) {
                Some(a) => out.push(*a),
                None => {
                    return Err(format!(
                        "unknown scenario `{n}`; choose from all, locks, {}",
                        all.join(", ")
                    ))
                }
            },
        }
    }
    out.dedup();
    if !args.local && out.contains(&LEASES) {
        return Err(format!(
            "`{LEASES}` leaves {} token counters (they never expire) in the Redis it uses; run it with --local",
            args.leases
        ));
    }
    if !args.local && out.contains(&TOPOLOGIES) {
        return Err(format!(
            "`{TOPOLOGIES}` starts its own Redis servers (a single one, a Sentinel set, a Cluster) and a sidecar on each; run it with --local"
        ));
    }
    if !args.local && out.contains(&BACKENDS) {
        return Err(format!(
            "`{BACKENDS}` starts its own Redis, PostgreSQL and ZooKeeper servers and a sidecar on each; run it with --local"
        ));
    }
    if !args.local && out.contains(&SCALING) {
        return Err(format!(
            "`{SCALING}` starts its own Redis, PostgreSQL and sidecars; run it with --local"
        ));
    }
    Ok(out)
}

/// Runs the selected scenarios, printing as it goes.
pub async fn measure(args: &BenchArgs) -> Result<Results, String> {
    let names = selected(args)?;
    let mut results = Results::default();
    // Redis and a sidecar for the lock scenarios (and Redis for `leases`).
    let mut _local_procs = Vec::new();
    // The sidecar's Unix socket file, removed when this returns.
    let mut _socket_file = None;
    // (sidecar, redis) when started here: their CPU is measured per cycle.
    let mut pids: Option<(u32, u32)> = None;
    let (mut api, mut redis_url) = (args.api.clone(), args.redis.clone());
    let needs_redis = names
        .iter()
        .any(|n| *n == LEASES || SCENARIOS.iter().any(|s| s.name == *n));
    if args.local && needs_redis {
        let (redis, url) = local::redis().await?;
        let api_addr = format!("127.0.0.1:{}", local::free_port()?);
        let socket = std::env::temp_dir().join(format!(
            "fencer-bench-{}-{}.sock",
            std::process::id(),
            rand::random::<u32>()
        ));
        _socket_file = Some(local::RemoveOnDrop(socket.clone()));
        let socket = socket.display().to_string();
        let sidecar = local::fencer(
            "sidecar",
            &[
                ("sidecar.listen", api_addr.clone()),
                ("sidecar.listen_unix", socket.clone()),
                ("proxy.enabled", "false".into()),
                ("backend.kind", "redis".into()),
                ("backend.redis.url", url.clone()),
                ("admin.listen", format!("127.0.0.1:{}", local::free_port()?)),
            ],
            &api_addr,
        )
        .await?;
        api = if args.unix {
            format!("unix:{socket}")
        } else {
            format!("http://{api_addr}")
        };
        redis_url = url;
        pids = Some((sidecar.pid(), redis.pid()));
        _local_procs.push(redis);
        _local_procs.push(sidecar);
    }
    let redis = redis::Client::open(redis_url.as_str()).map_err(|e| e.to_string())?;
    let runs = args.runs as usize;
    for name in names {
        if let Some(sc) = SCENARIOS.iter().find(|s| s.name == name) {
            let (mut f_runs, mut b_runs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..runs {
                let f = run_lock_side(Side::Fencer, *sc, args.seconds, &api, &redis, pids).await?;
                if !args.no_baseline {
                    let b = run_lock_side(Side::Baseline, *sc, args.seconds, &api, &redis, pids)
                        .await?;
                    ratios.push(f.cycles_per_sec() / b.cycles_per_sec().max(1e-9));
                    b_runs.push(b);
                }
                f_runs.push(f);
            }
            crate::outln!(
                "{} ({} clients, {} keys, {} s per side, median of {runs} run(s))",
                sc.name,
                sc.clients,
                sc.keys,
                args.seconds
            );
            let f = median_run(&f_runs).cloned().unwrap_or_default();
            crate::outln!("{}", lock_line("fencer", &f));
            if let Some(l) = cpu_line(&f) {
                crate::outln!("{l}");
            }
            let b = median_run(&b_runs).cloned();
            if let Some(b) = &b {
                crate::outln!("{}", lock_line("baseline", b));
                if let Some(l) = cpu_line(b) {
                    crate::outln!("{l}");
                }
                crate::outln!(
                    "  ratio     cycles/s {:.2}x (median of per-run ratios; runs: {})  owner changes/s {:.2}x  cycle p50 {:.2}x",
                    median(ratios.clone()),
                    ratios
                        .iter()
                        .map(|r| format!("{r:.2}"))
                        .collect::<Vec<_>>()
                        .join(" "),
                    f.rate(f.owner_changes) / b.rate(b.owner_changes).max(1e-9),
                    Report::pct(&f.cycle_us, 0.5) / Report::pct(&b.cycle_us, 0.5).max(1e-9),
                );
            }
            results.locks.push((sc.name.to_owned(), f, b));
        } else if name == WRITE_PATH {
            let stack = write_path::Stack::start().await?;
            for clients in [1usize, 16] {
                let mut per_path: Vec<(write_path::Path, Vec<Report>)> = Vec::new();
                let paths: Vec<write_path::Path> = [
                    write_path::Path::Direct,
                    write_path::Path::Nginx,
                    write_path::Path::Fenced,
                ]
                .into_iter()
                .filter(|p| *p != write_path::Path::Nginx || stack.nginx.is_some())
                .collect();
                for p in &paths {
                    per_path.push((*p, Vec::new()));
                }
                let cpu_before = stack.cpu();
                let mut writes: Vec<(write_path::Path, u64)> = Vec::new();
                for _ in 0..runs {
                    if clients == 1 {
                        let total = args.seconds * paths.len() as u64;
                        let reports = write_path::run_interleaved(&stack, &paths, total).await?;
                        for ((p, runs), r) in per_path.iter_mut().zip(reports) {
                            writes.push((*p, r.cycles));
                            runs.push(r);
                        }
                    } else {
                        for (p, reports) in per_path.iter_mut() {
                            let r = write_path::run_path(&stack, *p, clients, args.seconds).await?;
                            writes.push((*p, r.cycles));
                            reports.push(r);
                        }
                    }
                }
                let cpu_line = stack.cpu_line(&cpu_before, &stack.cpu(), &writes);
                let how = if clients == 1 {
                    "paths interleaved in batches of 20 writes"
                } else {
                    "one path after the other"
                };
                crate::outln!(
                    "{WRITE_PATH} ({clients} client(s), PUT of a small value, {} s per path, {how}, median of {runs} run(s))",
                    args.seconds
                );
                let medians: Vec<(write_path::Path, Report)> = per_path
                    .iter()
                    .map(|(p, r)| (*p, median_run(r).cloned().unwrap_or_default()))
                    .collect();
                let direct_p50 = Report::pct(&medians[0].1.cycle_us, 0.5);
                for (p, r) in &medians {
                    crate::outln!("{}", write_path::line(p.label(), r, direct_p50));
                }
                crate::outln!("{cpu_line}");
                let added = |p: write_path::Path| {
                    medians
                        .iter()
                        .find(|(q, _)| *q == p)
                        .map(|(_, r)| Report::pct(&r.cycle_us, 0.5) - direct_p50)
                };
                if let (Some(f), Some(n)) = (
                    added(write_path::Path::Fenced),
                    added(write_path::Path::Nginx),
                ) {
                    crate::outln!(
                        "  ratio     added p50 fencer/nginx {:.2}x (proxy + gateway: two hops; nginx: one)",
                        f / n.max(1e-9)
                    );
                }
                for (p, r) in medians {
                    results.write_path.push((p.label(), clients, r));
                }
            }
        } else if name == FENCE_STORE {
            let Some(pg) = &args.postgres else {
                crate::outln!("{FENCE_STORE}: skipped (give --postgres URL)");
                continue;
            };
            let stack = fence_store::Stack::start(pg).await?;
            let clients = 64;
            let (mut direct, mut fenced) = (Vec::new(), Vec::new());
            for _ in 0..runs {
                direct.push(fence_store::run(&stack, false, clients, args.seconds).await?);
                fenced.push(fence_store::run(&stack, true, clients, args.seconds).await?);
            }
            let d = median_run(&direct).cloned().unwrap_or_default();
            let f = median_run(&fenced).cloned().unwrap_or_default();
            crate::outln!(
                "{FENCE_STORE} ({clients} writers, each its own key, a new token per write, {} s per side, median of {runs} run(s))",
                args.seconds
            );
            let direct_p50 = Report::pct(&d.cycle_us, 0.5);
            crate::outln!("{}", write_path::line("direct", &d, direct_p50));
            crate::outln!("{}", write_path::line("fenced", &f, direct_p50));
            crate::outln!(
                "  ratio     writes/s fenced/direct {:.2}x",
                f.cycles_per_sec() / d.cycles_per_sec().max(1e-9)
            );
            match stack.items_per_statement().await {
                Ok(ops) => {
                    for (op, statements, calls) in ops {
                        crate::outln!(
                            "  group commit {op}: {calls:.0} calls in {statements:.0} statements ({:.1} per statement)",
                            calls / statements.max(1.0)
                        );
                    }
                }
                Err(e) => {
                    crate::outln!("  group commit: gateway metrics unreadable: {e}");
                }
            }
            results.fence_store = Some((d, f));
        } else if name == LEASES {
            let window = args
                .seconds
                .max(2 * args.lease_ttl_ms.div_ceil(1000) / 3 + 1);
            let r =
                leases::run(&redis_url, args.leases as usize, args.lease_ttl_ms, window).await?;
            crate::outln!(
                "{LEASES} ({} auto-renewed leases, ttl {} ms, one sidecar on Redis)",
                args.leases,
                args.lease_ttl_ms
            );
            crate::outln!("{}", r.lines());
            results.leases = Some(r);
        } else if name == TOPOLOGIES {
            if !redis_topology::redis_cli_available() {
                let named = args.scenario.split(',').any(|n| n.trim() == TOPOLOGIES);
                let why = "needs `redis-cli` (to create the Redis Cluster), which cannot be run";
                if named {
                    return Err(format!("{TOPOLOGIES} {why}"));
                }
                crate::outln!("{TOPOLOGIES}: skipped ({why})");
                continue;
            }
            results.redis_topologies = topologies::run(args.seconds, runs).await?;
        } else if name == BACKENDS {
            results.lock_backends = backends::run(args.seconds, runs).await?;
        } else if name == SCALING {
            let matrix = scaling::Matrix {
                backends: args.backend.clone(),
                clients: args.clients.iter().map(|c| *c as usize).collect(),
                keys: args.keys.clone(),
                secs: args.seconds,
                runs,
            };
            let points = scaling::run(&matrix).await?;
            if let Some(path) = &args.json {
                let json = serde_json::to_string_pretty(&scaling::JsonOut::new(&matrix, &points))
                    .map_err(|e| e.to_string())?;
                std::fs::write(path, json + "\n")
                    .map_err(|e| format!("{}: {e}", path.display()))?;
            }
            scaling::lost_updates(&points)?;
            results.scaling = points;
        }
    }
    Ok(results)
}

/// One side of a lock scenario, with the CPU each process spent per cycle
/// when `pids` (sidecar, Redis) are known.
async fn run_lock_side(
    side: Side,
    sc: locks::Scenario,
    secs: u64,
    api: &str,
    redis: &redis::Client,
    pids: Option<(u32, u32)>,
) -> Result<Report, String> {
    let cpu = |pids: Option<(u32, u32)>| {
        let (sidecar, redis) = pids?;
        Some([
            local::cpu_secs(std::process::id())?,
            local::cpu_secs(sidecar)?,
            local::cpu_secs(redis)?,
        ])
    };
    let before = cpu(pids);
    let mut r = locks::run_side(side, sc, secs, api, redis).await?;
    if let (Some(b), Some(a)) = (before, cpu(pids)) {
        let per = |i: usize| 1e6 * (a[i] - b[i]) / r.cycles.max(1) as f64;
        r.cpu_us = Some([per(0), per(1), per(2)]);
    }
    Ok(r)
}

pub async fn run(args: BenchArgs) -> Result<(), String> {
    measure(&args).await.map(|_| ())
}
