//! `lock-backends` (`--local` only): the lock scenarios `uncontended-16`
//! and `contended-16` through sidecars that differ only in `backend.kind`
//! — `redis` (one server), `postgres` (a private server), `mysql` (a
//! private MariaDB server), `zookeeper` (a 3-member ensemble, the
//! smallest that survives a member's loss) and `etcd` (3 members, for the
//! same reason) — with the ratio of each to Redis in the same run, of
//! MySQL to PostgreSQL (the other SQL backend) and of etcd to PostgreSQL
//! and to ZooKeeper (the other consensus store): cycles/s, owner
//! changes/s and wait p99. `postgres-alone` is
//! the same PostgreSQL with `backend.postgres.group_commit = false`, one
//! statement per call: the group commit's gain, in the same run.
//!
//! The critical sections' read-modify-write counters live in one further
//! Redis shared by all, so only the lock backend differs; targets take
//! turns within each run ([`compare`]).

use super::compare::{self, ScenarioResult, Spec, Target};
use super::local::{self, Proc};
use super::servers;

pub const NAME: &str = "lock-backends";

/// ZooKeeper members measured: a production ensemble's smallest size.
const ZK_MEMBERS: usize = 3;

/// etcd members measured: the same.
const ETCD_MEMBERS: usize = 3;

/// Compared directly besides each with Redis: (target, base).
const PAIRS: [(&str, &str); 4] = [
    ("mysql", "postgres"),
    ("postgres", "postgres-alone"),
    ("etcd", "postgres"),
    ("etcd", "zookeeper"),
];

/// Every process of the comparison; the sidecars drop first.
struct Processes {
    targets: Vec<Target>,
    counters: redis::Client,
    counters_pid: u32,
    _sidecars: Vec<Proc>,
    _servers: Vec<Proc>,
}

impl Processes {
    async fn start() -> Result<Processes, String> {
        let (counters_proc, counters_url) = local::redis().await?;
        let (redis_proc, redis_url) = local::redis().await?;
        let (pg_proc, pg_url) = servers::postgres().await?;
        let (my_proc, my_url) = servers::mariadb().await?;
        let (zk_procs, zk_connect) = servers::zookeeper(ZK_MEMBERS).await?;
        let zk_pids: Vec<u32> = zk_procs.iter().map(Proc::pid).collect();
        let (etcd_procs, etcd_endpoints) = servers::etcd(ETCD_MEMBERS).await?;
        let etcd_pids: Vec<u32> = etcd_procs.iter().map(Proc::pid).collect();
        let pg_pid = pg_proc.pid();
        let my_pid = my_proc.pid();
        let specs = vec![
            Spec {
                label: "redis",
                env: vec![
                    ("backend.kind", "redis".into()),
                    ("backend.redis.url", redis_url),
                ],
                masters: vec![redis_proc.pid()],
                others: vec![],
                backend_label: "lock redis".into(),
            },
            Spec {
                label: "postgres",
                env: vec![
                    ("backend.kind", "postgres".into()),
                    ("backend.postgres.url", pg_url.clone()),
                ],
                // The postmaster; its backends are its children, counted
                // with it.
                masters: vec![pg_pid],
                others: vec![],
                backend_label: "postgres".into(),
            },
            Spec {
                label: "postgres-alone",
                env: vec![
                    ("backend.kind", "postgres".into()),
                    ("backend.postgres.url", pg_url),
                    ("backend.postgres.group_commit", "false".into()),
                ],
                masters: vec![pg_pid],
                others: vec![],
                backend_label: "postgres".into(),
            },
            Spec {
                label: "mysql",
                env: vec![
                    ("backend.kind", "mysql".into()),
                    ("backend.mysql.url", my_url),
                ],
                // One process, its connections are threads.
                masters: vec![my_pid],
                others: vec![],
                backend_label: "mariadb".into(),
            },
            Spec {
                label: "zookeeper",
                env: vec![
                    ("backend.kind", "zookeeper".into()),
                    ("backend.zookeeper.connect", zk_connect),
                ],
                masters: zk_pids,
                others: vec![],
                backend_label: format!("zookeeper ({ZK_MEMBERS} members)"),
            },
            Spec {
                label: "etcd",
                env: vec![
                    ("backend.kind", "etcd".into()),
                    ("backend.etcd.endpoints", etcd_endpoints.join(",")),
                ],
                masters: etcd_pids,
                others: vec![],
                backend_label: format!("etcd ({ETCD_MEMBERS} members)"),
            },
        ];
        let (targets, sidecars) = compare::start_sidecars(specs).await?;
        let counters = redis::Client::open(counters_url.as_str()).map_err(|e| e.to_string())?;
        let counters_pid = counters_proc.pid();
        let mut servers = vec![counters_proc, redis_proc, pg_proc, my_proc];
        servers.extend(zk_procs);
        servers.extend(etcd_procs);
        Ok(Processes {
            targets,
            counters,
            counters_pid,
            _sidecars: sidecars,
            _servers: servers,
        })
    }
}

/// Starts everything and compares (see the module comment). Ctrl-C ends
/// it as an error, so the servers are still stopped (`mariadbd` ignores
/// the terminal's SIGINT and would outlive the bench).
pub async fn run(secs: u64, runs: usize) -> Result<Vec<ScenarioResult>, String> {
    tokio::select! {
        r = start_and_compare(secs, runs) => r,
        _ = tokio::signal::ctrl_c() => Err(format!("{NAME}: interrupted")),
    }
}

async fn start_and_compare(secs: u64, runs: usize) -> Result<Vec<ScenarioResult>, String> {
    let p = Processes::start().await?;
    let stack = compare::Stack {
        name: NAME,
        targets: &p.targets,
        counters: &p.counters,
        counters_pid: p.counters_pid,
        pairs: &PAIRS,
    };
    compare::run(&stack, secs, runs).await
}
