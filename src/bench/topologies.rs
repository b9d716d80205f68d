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

use super::compare::{self, ScenarioResult, Spec, Target};
use super::local::{self, Proc};
use super::redis_topology::{self, ClusterSet, SentinelSet, MASTER_NAME};

pub const NAME: &str = "redis-topologies";

/// `section.field` settings of a fencer process.
type Env = Vec<(&'static str, String)>;

/// The number of RedLock masters measured (the seeds' typical N).
const REDLOCK_MASTERS: usize = 5;

/// Every process of the comparison. Fields drop in order: the sidecars go
/// before the Redis servers they use.
struct Processes {
    targets: Vec<Target>,
    counters: redis::Client,
    counters_pid: u32,
    _sidecars: Vec<Proc>,
    _redis: Vec<Proc>,
    _sentinel: SentinelSet,
    _cluster: ClusterSet,
}

impl Processes {
    async fn start() -> Result<Processes, String> {
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
        let redis = |mode: &str, mut env: Env| {
            env.insert(0, ("backend.kind", "redis".into()));
            env.insert(1, ("backend.redis.mode", mode.into()));
            env
        };
        let redlock_urls = redlock
            .iter()
            .map(|(_, u)| u.as_str())
            .collect::<Vec<_>>()
            .join(",");
        let specs = vec![
            Spec {
                label: "single",
                env: redis("single", vec![("backend.redis.url", single_url)]),
                masters: vec![single_proc.pid()],
                others: vec![],
                backend_label: "lock redis".into(),
            },
            Spec {
                label: "sentinel",
                env: redis(
                    "sentinel",
                    vec![
                        ("backend.redis.sentinels", sentinel.sentinel_addrs.join(",")),
                        ("backend.redis.master_name", MASTER_NAME.into()),
                        // Only its scheme and database are used in sentinel
                        // mode; the port is one nothing listens on, so a
                        // sidecar that ignored the sentinels could not run.
                        ("backend.redis.url", "redis://127.0.0.1:1/0".into()),
                    ],
                ),
                masters: sentinel.master_pids(),
                others: sentinel.other_pids(),
                backend_label: "lock redis (master; others: replicas and sentinels)".into(),
            },
            Spec {
                label: "cluster",
                env: redis(
                    "cluster",
                    vec![("backend.redis.nodes", cluster.node_urls.join(","))],
                ),
                masters: cluster.master_pids(),
                others: cluster.other_pids(),
                backend_label: "lock redis (masters; others: replicas)".into(),
            },
            Spec {
                label: "redlock",
                env: vec![
                    ("backend.kind", "redlock".into()),
                    ("backend.redlock.urls", redlock_urls),
                ],
                masters: redlock.iter().map(|(p, _)| p.pid()).collect(),
                others: vec![],
                backend_label: format!("lock redis ({REDLOCK_MASTERS} masters)"),
            },
        ];
        let (targets, sidecars) = compare::start_sidecars(specs).await?;
        let counters = redis::Client::open(counters_url.as_str()).map_err(|e| e.to_string())?;
        let counters_pid = counters_proc.pid();
        let mut servers = vec![counters_proc, single_proc];
        servers.extend(redlock.into_iter().map(|(p, _)| p));
        Ok(Processes {
            targets,
            counters,
            counters_pid,
            _sidecars: sidecars,
            _redis: servers,
            _sentinel: sentinel,
            _cluster: cluster,
        })
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

/// Starts everything and compares (see the module comment).
pub async fn run(secs: u64, runs: usize) -> Result<Vec<ScenarioResult>, String> {
    let p = Processes::start().await?;
    let stack = compare::Stack {
        name: NAME,
        targets: &p.targets,
        counters: &p.counters,
        counters_pid: p.counters_pid,
        pairs: &[],
    };
    compare::run(&stack, secs, runs).await
}
