//! `redis-topologies` (`--local` only): the lock scenarios `uncontended-16`
//! and `contended-16` through three sidecars that differ only in
//! `backend.redis.mode` — `single` on a Redis of its own, `sentinel` on a
//! Sentinel set (master, 2 replicas, 3 sentinels), `cluster` on a Redis
//! Cluster (3 masters, 3 replicas) — and `redlock` (`backend.kind =
//! "redlock"`) on 5 independent masters, with the ratio of each to `single`.
//!
//! The critical sections' read-modify-write counters live in one further
//! plain Redis shared by all three, so the data path is the same and only
//! the lock backend differs. The topologies take turns within each run
//! (single, sentinel, cluster, single, …) so drift of this noisy machine
//! hits them alike; ratios are per run, and their median is reported.

use std::time::{Duration, Instant};

use super::api_conn::ApiConn;
use super::local::{self, Proc};
use super::locks::{self, Side, SCENARIOS};
use super::redis_topology::{self, ClusterSet, SentinelSet, MASTER_NAME};
use super::stats::{lock_line, median, median_run, Report};

pub const NAME: &str = "redis-topologies";
/// The lock scenarios measured on every topology.
const LOCK_SCENARIOS: [&str; 2] = ["uncontended-16", "contended-16"];
/// How long a sidecar may take to grant its first lock.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// What one topology measured in one lock scenario.
#[derive(Debug, Clone)]
pub struct TopologyReport {
    /// `single`, `sentinel` or `cluster`.
    pub topology: &'static str,
    /// The run with the median cycle rate.
    pub median: Report,
    /// CPU µs per cycle in that run: bench client, sidecar, the lock
    /// backend's masters, its other processes (replicas, sentinels), the
    /// counters' Redis.
    pub cpu_us: Option<[f64; 5]>,
    /// Over all runs.
    pub lost_updates: i64,
    pub errors: u64,
}

/// One lock scenario on every topology.
#[derive(Debug, Clone)]
pub struct ScenarioResult {
    pub scenario: &'static str,
    /// single, sentinel, cluster, redlock.
    pub topologies: Vec<TopologyReport>,
    /// Per run, `topology / single` of cycles/s and of owner changes/s, for
    /// sentinel, cluster and redlock.
    pub ratios: Vec<(&'static str, Vec<f64>, Vec<f64>)>,
}

/// `section.field` settings of a fencer process.
type Env = Vec<(&'static str, String)>;

/// The number of RedLock masters measured (the seeds' typical N).
const REDLOCK_MASTERS: usize = 5;

/// One sidecar and the processes whose CPU is counted against it.
struct Target {
    topology: &'static str,
    api: String,
    sidecar: u32,
    /// The lock backend's masters, and its replicas and sentinels.
    masters: Vec<u32>,
    others: Vec<u32>,
}

/// Every process of the scenario. Fields drop in order: the sidecars go
/// before the Redis servers they use.
struct Stack {
    targets: Vec<Target>,
    counters: redis::Client,
    counters_pid: u32,
    _sidecars: Vec<Proc>,
    _redis: Vec<Proc>,
    _sentinel: SentinelSet,
    _cluster: ClusterSet,
}

impl Stack {
    async fn start() -> Result<Stack, String> {
        let (counters_proc, counters_url) = local::redis().await?;
        let (single_proc, single_url) = local::redis().await?;
        let sentinel = redis_topology::sentinel_set().await?;
        let cluster = redis_topology::cluster().await?;
        let mut redlock = Vec::new();
        for _ in 0..REDLOCK_MASTERS {
            let (proc, url) = local::redis().await?;
            vouch_redlock_master(&url).await?;
            redlock.push((proc, url));
        }
        let backends: [(&'static str, Env, Vec<u32>, Vec<u32>); 4] = [
            (
                "single",
                vec![
                    ("backend.redis.mode", "single".into()),
                    ("backend.redis.url", single_url),
                ],
                vec![single_proc.pid()],
                vec![],
            ),
            (
                "sentinel",
                vec![
                    ("backend.redis.mode", "sentinel".into()),
                    ("backend.redis.sentinels", sentinel.sentinel_addrs.join(",")),
                    ("backend.redis.master_name", MASTER_NAME.into()),
                    // Only its scheme and database are used in sentinel
                    // mode; the port is one nothing listens on, so a
                    // sidecar that ignored the sentinels could not run.
                    ("backend.redis.url", "redis://127.0.0.1:1/0".into()),
                ],
                sentinel.master_pids(),
                sentinel.other_pids(),
            ),
            (
                "cluster",
                vec![
                    ("backend.redis.mode", "cluster".into()),
                    ("backend.redis.nodes", cluster.node_urls.join(",")),
                ],
                cluster.master_pids(),
                cluster.other_pids(),
            ),
            (
                "redlock",
                vec![
                    ("backend.kind", "redlock".into()),
                    (
                        "backend.redlock.urls",
                        redlock
                            .iter()
                            .map(|(_, u)| u.as_str())
                            .collect::<Vec<_>>()
                            .join(","),
                    ),
                ],
                redlock.iter().map(|(p, _)| p.pid()).collect(),
                vec![],
            ),
        ];
        let (mut targets, mut sidecars) = (Vec::new(), Vec::new());
        for (topology, backend, masters, others) in backends {
            let api_addr = format!("127.0.0.1:{}", local::free_port()?);
            let mut env = vec![
                ("sidecar.listen", api_addr.clone()),
                ("proxy.enabled", "false".into()),
                ("admin.listen", format!("127.0.0.1:{}", local::free_port()?)),
            ];
            if !backend.iter().any(|(k, _)| *k == "backend.kind") {
                env.push(("backend.kind", "redis".into()));
            }
            env.extend(backend);
            let sidecar = local::fencer("sidecar", &env, &api_addr).await?;
            let api = format!("http://{api_addr}");
            first_lock(topology, &api, &sidecar).await?;
            targets.push(Target {
                topology,
                api,
                sidecar: sidecar.pid(),
                masters,
                others,
            });
            sidecars.push(sidecar);
        }
        let counters = redis::Client::open(counters_url.as_str()).map_err(|e| e.to_string())?;
        let counters_pid = counters_proc.pid();
        let mut servers = vec![counters_proc, single_proc];
        servers.extend(redlock.into_iter().map(|(p, _)| p));
        Ok(Stack {
            targets,
            counters,
            counters_pid,
            _sidecars: sidecars,
            _redis: servers,
            _sentinel: sentinel,
            _cluster: cluster,
        })
    }

    /// One run of `sc` on `t`, with the CPU per cycle of every process.
    async fn measure(
        &self,
        t: &Target,
        sc: locks::Scenario,
        secs: u64,
    ) -> Result<(Report, Option<[f64; 5]>), String> {
        let sum = |pids: &[u32]| -> Option<f64> {
            pids.iter()
                .map(|p| local::cpu_secs(*p))
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
        let r = locks::run_side(Side::Fencer, sc, secs, &t.api, &self.counters).await?;
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

/// The first-deployment step of docs/runbooks.md ("RedLock: first
/// deployment"): a brand-new master, which never granted a lock, is vouched
/// for (its data-age marker set to 0) so it votes without serving the
/// restart quarantine first.
async fn vouch_redlock_master(url: &str) -> Result<(), String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    redis::cmd("SET")
        .arg("fencer:redlock:data-age")
        .arg(0)
        .query_async::<()>(&mut conn)
        .await
        .map_err(|e| format!("vouching for RedLock master {url}: {e}"))
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

fn list(v: &[f64]) -> String {
    v.iter()
        .map(|r| format!("{r:.2}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Starts everything, runs both lock scenarios `runs` times on every
/// topology, prints as it goes; fails if any update was lost.
pub async fn run(secs: u64, runs: usize) -> Result<Vec<ScenarioResult>, String> {
    let stack = Stack::start().await?;
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
        println!(
            "{NAME}: {} ({} clients, {} keys, {secs} s per topology, topologies interleaved within each run, median of {runs} run(s))",
            sc.name, sc.clients, sc.keys
        );
        let mut topologies = Vec::new();
        for (i, t) in stack.targets.iter().enumerate() {
            let m = median_index(&reports[i]);
            let median = reports[i][m].clone();
            println!("{}", lock_line(t.topology, &median));
            if let Some([client, sidecar, masters, others, counters]) = cpus[i][m] {
                let lock = if t.others.is_empty() && t.masters.len() > 1 {
                    format!("lock redis ({} masters) {masters:.1}", t.masters.len())
                } else if t.others.is_empty() {
                    format!("lock redis {masters:.1}")
                } else {
                    format!(
                        "lock redis {:.1} = master{} {masters:.1} + replicas{} {others:.1}",
                        masters + others,
                        if t.masters.len() == 1 { "" } else { "s" },
                        if t.topology == "sentinel" {
                            " and sentinels"
                        } else {
                            ""
                        },
                    )
                };
                println!(
                    "            cpu µs per cycle: client {client:.1}  sidecar {sidecar:.1}  {lock}  counter redis {counters:.1}  total {:.1}",
                    client + sidecar + masters + others + counters
                );
            }
            topologies.push(TopologyReport {
                topology: t.topology,
                median,
                cpu_us: cpus[i][m],
                lost_updates: reports[i].iter().map(|r| r.lost_updates).sum(),
                errors: reports[i].iter().map(|r| r.errors).sum(),
            });
        }
        let mut ratios = Vec::new();
        for (i, t) in stack.targets.iter().enumerate().skip(1) {
            let per_run = |f: &dyn Fn(&Report) -> f64| -> Vec<f64> {
                reports[i]
                    .iter()
                    .zip(&reports[0])
                    .map(|(x, single)| f(x) / f(single).max(1e-9))
                    .collect()
            };
            let cycles = per_run(&|r| r.cycles_per_sec());
            let owners = per_run(&|r| r.rate(r.owner_changes));
            let label = format!("{}/single", t.topology);
            println!(
                "  ratio     {label:<15} cycles/s {:.2}x (median of per-run ratios; runs: {})  owner changes/s {:.2}x (runs: {})",
                median(cycles.clone()),
                list(&cycles),
                median(owners.clone()),
                list(&owners),
            );
            ratios.push((t.topology, cycles, owners));
        }
        println!(
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
        return Err(format!("{NAME}: lost updates ({})", lost.join("; ")));
    }
    Ok(out)
}
