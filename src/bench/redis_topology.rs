//! `fencer bench --local`: the Redis topologies of the sidecar's Redis
//! backend besides a single server, started as child processes on free
//! loopback ports, each in its own temporary directory, and killed when
//! dropped:
//!
//! - a Sentinel set: one master, two replicas and three sentinels
//!   monitoring the master as [`MASTER_NAME`] (quorum 2);
//! - a Redis Cluster: three masters and three replicas, joined with
//!   `redis-cli --cluster create`.
//!
//! Every wait is bounded ([`START_TIMEOUT`]) and fails with the tail of the
//! logs of the processes involved.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use super::local::{free_port, spawn, temp_dir, wait_tcp, Proc};

/// The name the sentinels monitor the master under.
pub const MASTER_NAME: &str = "fencer-bench";
/// How long a topology may take to come up.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Connect + reply timeout of one probe while waiting.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
const HOST: &str = "127.0.0.1";

/// A master, its replicas and the sentinels monitoring it.
pub struct SentinelSet {
    /// `nodes[0]` is the master, the rest its replicas.
    pub nodes: Vec<Proc>,
    pub sentinels: Vec<Proc>,
    /// `127.0.0.1:PORT` of each sentinel.
    pub sentinel_addrs: Vec<String>,
}

impl SentinelSet {
    /// The master's process.
    pub fn master_pids(&self) -> Vec<u32> {
        vec![self.nodes[0].pid()]
    }

    /// The replicas' and sentinels' processes.
    pub fn other_pids(&self) -> Vec<u32> {
        self.nodes[1..]
            .iter()
            .chain(&self.sentinels)
            .map(Proc::pid)
            .collect()
    }
}

/// The nodes of a Redis Cluster.
pub struct ClusterSet {
    pub nodes: Vec<Proc>,
    /// `redis://127.0.0.1:PORT` of each node.
    pub node_urls: Vec<String>,
    /// Per node: a master (`role:master`) once the cluster was up.
    pub is_master: Vec<bool>,
}

impl ClusterSet {
    /// The masters' processes.
    pub fn master_pids(&self) -> Vec<u32> {
        self.pids_where(true)
    }

    /// The replicas' processes.
    pub fn other_pids(&self) -> Vec<u32> {
        self.pids_where(false)
    }

    fn pids_where(&self, master: bool) -> Vec<u32> {
        self.nodes
            .iter()
            .zip(&self.is_master)
            .filter(|(_, m)| **m == master)
            .map(|(n, _)| n.pid())
            .collect()
    }
}

/// Whether `redis-cli` can be run (the Cluster is created with it).
pub fn redis_cli_available() -> bool {
    Command::new("redis-cli")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A data node in `dir`: no persistence, replication without the default 5 s
/// diskless-sync delay (a replica links up at once), log on stdout (the
/// process's `out.log`), plus `extra` arguments. Waits until it listens.
async fn data_node(what: &str, dir: PathBuf, extra: &[String]) -> Result<(Proc, u16), String> {
    let mut last = String::new();
    // A port found free can be taken by another process before the server
    // binds it (tests run two binaries at once): the server then exits,
    // and what answers on the port is the other process. Tried again on
    // another port until the answer comes from our own server.
    for _ in 0..5 {
        let port = free_port()?;
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &port.to_string(), "--bind", HOST])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--repl-diskless-sync", "yes"])
            .args(["--repl-diskless-sync-delay", "0"])
            .arg("--dir")
            .arg(&dir)
            .args(extra);
        let mut p = spawn(what, cmd, dir.clone())?;
        if let Err(e) = wait_tcp(&mut p, &format!("{HOST}:{port}")).await {
            last = e;
            continue;
        }
        let info = query::<String>(port, redis::cmd("INFO").arg("server")).await;
        let pid = info
            .as_deref()
            .ok()
            .and_then(|i| info_field(i, "process_id"));
        if pid == Some(p.pid().to_string().as_str()) {
            return Ok((p, port));
        }
        last = format!("{what}: port {port} answered for another process ({info:?})");
    }
    Err(last)
}

/// One command on a fresh connection to `127.0.0.1:port`, bounded by
/// [`PROBE_TIMEOUT`].
async fn query<T: redis::FromRedisValue>(port: u16, cmd: &redis::Cmd) -> Result<T, String> {
    let client =
        redis::Client::open(format!("redis://{HOST}:{port}")).map_err(|e| e.to_string())?;
    let ask = async {
        let mut conn = client.get_multiplexed_async_connection().await?;
        cmd.query_async::<T>(&mut conn).await
    };
    match tokio::time::timeout(PROBE_TIMEOUT, ask).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no reply within {PROBE_TIMEOUT:?}")),
    }
}

/// `field:value` of an `INFO` or `CLUSTER INFO` text.
fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .map(str::trim)
}

/// The value after `field` in a flat field/value reply
/// (`SENTINEL MASTER`).
fn pair<'a>(flat: &'a [String], field: &str) -> Option<&'a str> {
    flat.chunks(2)
        .find(|c| c.len() == 2 && c[0] == field)
        .map(|c| c[1].as_str())
}

/// The tail of each process's log, headed by its name.
fn logs<'a>(procs: impl IntoIterator<Item = &'a Proc>) -> String {
    procs
        .into_iter()
        .map(|p| format!("==== {} ====\n{}\n", p.name, p.log_tail()))
        .collect()
}

/// A process of `procs` that has exited, as an error.
fn any_exited(procs: &mut [&mut Proc]) -> Option<String> {
    procs
        .iter_mut()
        .find_map(|p| p.exited().map(|s| format!("{} exited ({s})", p.name)))
}

/// Starts the master, two replicas (waiting until both replicate), then
/// three sentinels; returns when every sentinel reports the master with
/// both replicas (`SENTINEL MASTER` → `flags master`, `num-slaves 2`).
pub async fn sentinel_set() -> Result<SentinelSet, String> {
    let started = Instant::now();
    let (master, master_port) = data_node("redis master", temp_dir("redis")?, &[]).await?;
    let mut nodes = vec![master];
    let mut replica_ports = Vec::new();
    for i in 0..2 {
        let replicaof = [
            "--replicaof".to_owned(),
            HOST.into(),
            master_port.to_string(),
        ];
        let (replica, port) = data_node(
            &format!("redis replica {i}"),
            temp_dir("redis")?,
            &replicaof,
        )
        .await?;
        nodes.push(replica);
        replica_ports.push(port);
    }
    // Sentinels learn the replicas from the master's INFO, which they read
    // every 10 s once running: start them after the replicas have linked
    // up, so the first read already lists both.
    loop {
        let mut up = 0;
        for port in &replica_ports {
            let info: String = query(*port, redis::cmd("INFO").arg("replication"))
                .await
                .unwrap_or_default();
            if info_field(&info, "master_link_status") == Some("up") {
                up += 1;
            }
        }
        if up == replica_ports.len() {
            break;
        }
        if let Some(e) = any_exited(&mut nodes.iter_mut().collect::<Vec<_>>()) {
            return Err(format!("sentinel set: {e}\n{}", logs(&nodes)));
        }
        if started.elapsed() > START_TIMEOUT {
            return Err(format!(
                "sentinel set: the replicas did not link up with the master within {START_TIMEOUT:?}\n{}",
                logs(&nodes)
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut sentinels = Vec::new();
    let mut sentinel_ports = Vec::new();
    for i in 0..3 {
        let port = free_port()?;
        let dir = temp_dir("sentinel")?;
        // `logfile ""`: the log goes to stdout, which is the process's
        // out.log. The sentinel rewrites this file as it learns the set.
        let conf = format!(
            "port {port}\n\
             bind {HOST}\n\
             daemonize no\n\
             dir {dir}\n\
             logfile \"\"\n\
             sentinel monitor {MASTER_NAME} {HOST} {master_port} 2\n\
             sentinel down-after-milliseconds {MASTER_NAME} 5000\n",
            dir = dir.display(),
        );
        let path = dir.join("sentinel.conf");
        std::fs::write(&path, conf).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut cmd = Command::new("redis-server");
        cmd.arg(&path).arg("--sentinel");
        let mut p = spawn(&format!("redis sentinel {i}"), cmd, dir)?;
        wait_tcp(&mut p, &format!("{HOST}:{port}")).await?;
        sentinels.push(p);
        sentinel_ports.push(port);
    }
    let mut last = String::new();
    loop {
        let mut ready = 0;
        for port in &sentinel_ports {
            match query::<Vec<String>>(*port, redis::cmd("SENTINEL").arg("MASTER").arg(MASTER_NAME))
                .await
            {
                Ok(m) => {
                    let (flags, slaves) = (pair(&m, "flags"), pair(&m, "num-slaves"));
                    if flags == Some("master") && slaves == Some("2") {
                        ready += 1;
                    } else {
                        last = format!(
                            "sentinel on {port}: flags {}, num-slaves {}",
                            flags.unwrap_or("?"),
                            slaves.unwrap_or("?")
                        );
                    }
                }
                Err(e) => last = format!("sentinel on {port}: {e}"),
            }
        }
        if ready == sentinel_ports.len() {
            break;
        }
        let mut all: Vec<&mut Proc> = nodes.iter_mut().chain(sentinels.iter_mut()).collect();
        if let Some(e) = any_exited(&mut all) {
            return Err(format!(
                "sentinel set: {e}\n{}",
                logs(nodes.iter().chain(&sentinels))
            ));
        }
        if started.elapsed() > START_TIMEOUT {
            return Err(format!(
                "sentinel set: not every sentinel reports master `{MASTER_NAME}` with 2 replicas \
                 within {START_TIMEOUT:?} (last: {last})\n{}",
                logs(nodes.iter().chain(&sentinels))
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(SentinelSet {
        nodes,
        sentinels,
        sentinel_addrs: sentinel_ports
            .iter()
            .map(|p| format!("{HOST}:{p}"))
            .collect(),
    })
}

/// Starts six cluster-enabled nodes, joins them as three masters with one
/// replica each (`redis-cli --cluster create … --cluster-replicas 1`) and
/// returns when every node says `cluster_state:ok`.
pub async fn cluster() -> Result<ClusterSet, String> {
    let started = Instant::now();
    let mut nodes = Vec::new();
    let mut ports = Vec::new();
    for i in 0..6 {
        // The cluster bus would be on port + 10 000 (possibly in the
        // ephemeral range, or taken): it gets a free port of its own.
        let dir = temp_dir("redis-cluster")?;
        let extra = [
            "--cluster-enabled".to_owned(),
            "yes".into(),
            "--cluster-config-file".into(),
            dir.join("nodes.conf").display().to_string(),
            "--cluster-node-timeout".into(),
            "5000".into(),
            "--cluster-port".into(),
            free_port()?.to_string(),
            "--cluster-announce-ip".into(),
            HOST.into(),
        ];
        let (node, port) = data_node(&format!("redis cluster node {i}"), dir, &extra).await?;
        nodes.push(node);
        ports.push(port);
    }
    let mut cmd = tokio::process::Command::new("redis-cli");
    cmd.arg("--cluster").arg("create");
    for p in &ports {
        cmd.arg(format!("{HOST}:{p}"));
    }
    cmd.args(["--cluster-replicas", "1", "--cluster-yes"])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let out = match tokio::time::timeout(START_TIMEOUT, cmd.output()).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => return Err(format!("cannot run redis-cli --cluster create: {e}")),
        Err(_) => {
            return Err(format!(
                "redis-cli --cluster create did not finish within {START_TIMEOUT:?}\n{}",
                logs(&nodes)
            ))
        }
    };
    if !out.status.success() {
        return Err(format!(
            "redis-cli --cluster create failed ({}):\n{}{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            logs(&nodes)
        ));
    }
    let mut last = String::new();
    loop {
        let mut ok = 0;
        for port in &ports {
            match query::<String>(*port, redis::cmd("CLUSTER").arg("INFO")).await {
                Ok(info) if info_field(&info, "cluster_state") == Some("ok") => ok += 1,
                Ok(info) => {
                    last = format!(
                        "node {port}: cluster_state:{}",
                        info_field(&info, "cluster_state").unwrap_or("?")
                    )
                }
                Err(e) => last = format!("node {port}: {e}"),
            }
        }
        if ok == ports.len() {
            break;
        }
        if let Some(e) = any_exited(&mut nodes.iter_mut().collect::<Vec<_>>()) {
            return Err(format!("cluster: {e}\n{}", logs(&nodes)));
        }
        if started.elapsed() > START_TIMEOUT {
            return Err(format!(
                "cluster: not every node says cluster_state:ok within {START_TIMEOUT:?} (last: {last})\n{}",
                logs(&nodes)
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut is_master = Vec::new();
    for port in &ports {
        let info: String = query(*port, redis::cmd("INFO").arg("replication")).await?;
        is_master.push(info_field(&info, "role") == Some("master"));
    }
    Ok(ClusterSet {
        nodes,
        is_master,
        node_urls: ports
            .iter()
            .map(|p| format!("redis://{HOST}:{p}"))
            .collect(),
    })
}
