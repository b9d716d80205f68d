//! `lock-backends` (`--local` only): the lock scenarios `uncontended-16`
//! and `contended-16` through sidecars that differ only in `backend.kind`
//! — `redis` (one server), `postgres` (a private server) and `zookeeper`
//! (a 3-member ensemble, the smallest that survives a member's loss) —
//! with the ratio of each to Redis in the same run.
//!
//! The critical sections' read-modify-write counters live in one further
//! Redis shared by all, so only the lock backend differs; targets take
//! turns within each run ([`compare`]).

use super::compare::{self, first_lock, ScenarioResult, Target};
use super::local::{self, Proc};
use super::servers;

pub const NAME: &str = "lock-backends";

/// ZooKeeper members measured: a production ensemble's smallest size.
const ZK_MEMBERS: usize = 3;

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
        let (zk_procs, zk_connect) = servers::zookeeper(ZK_MEMBERS).await?;
        let zk_pids: Vec<u32> = zk_procs.iter().map(Proc::pid).collect();
        let pg_pid = pg_proc.pid();
        let backends: [(
            &'static str,
            Vec<(&'static str, String)>,
            Vec<u32>,
            Vec<u32>,
            String,
        ); 3] = [
            (
                "redis",
                vec![
                    ("backend.kind", "redis".into()),
                    ("backend.redis.url", redis_url),
                ],
                vec![redis_proc.pid()],
                vec![],
                "lock redis".into(),
            ),
            (
                "postgres",
                vec![
                    ("backend.kind", "postgres".into()),
                    ("backend.postgres.url", pg_url),
                ],
                // The postmaster; its backends are its children and are
                // counted with it (see `local::cpu_secs`).
                vec![pg_pid],
                vec![],
                "postgres".into(),
            ),
            (
                "zookeeper",
                vec![
                    ("backend.kind", "zookeeper".into()),
                    ("backend.zookeeper.connect", zk_connect),
                ],
                zk_pids,
                vec![],
                format!("zookeeper ({ZK_MEMBERS} members)"),
            ),
        ];
        let (mut targets, mut sidecars) = (Vec::new(), Vec::new());
        for (topology, backend, masters, others, backend_label) in backends {
            let api_addr = format!("127.0.0.1:{}", local::free_port()?);
            let mut env = vec![
                ("sidecar.listen", api_addr.clone()),
                ("proxy.enabled", "false".into()),
                ("admin.listen", format!("127.0.0.1:{}", local::free_port()?)),
            ];
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
                backend_label,
            });
            sidecars.push(sidecar);
        }
        let counters = redis::Client::open(counters_url.as_str()).map_err(|e| e.to_string())?;
        let counters_pid = counters_proc.pid();
        let mut servers = vec![counters_proc, redis_proc, pg_proc];
        servers.extend(zk_procs);
        Ok(Processes {
            targets,
            counters,
            counters_pid,
            _sidecars: sidecars,
            _servers: servers,
        })
    }
}

/// Starts everything and compares (see the module comment).
pub async fn run(secs: u64, runs: usize) -> Result<Vec<ScenarioResult>, String> {
    let p = Processes::start().await?;
    let stack = compare::Stack {
        name: NAME,
        targets: &p.targets,
        counters: &p.counters,
        counters_pid: p.counters_pid,
    };
    compare::run(&stack, secs, runs).await
}
