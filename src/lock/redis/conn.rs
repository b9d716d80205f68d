//! Running one lock script on the Redis that owns its key, optionally
//! followed by `WAIT` on the same connection.
//!
//! With `WAIT`, script and `WAIT` go out as one pipeline: `WAIT` counts the
//! replicas that acknowledged every write sent on *its* connection before
//! it, so it must follow the script on the same socket (a `WAIT` on another
//! connection returns a meaningless count). A multiplexed connection keeps
//! the order of one pipeline; in cluster mode the pipeline is routed by the
//! script's first key, and `WAIT` (no key) goes with it. Without `WAIT` the
//! script is a plain command, which the cluster client redirects (`MOVED`,
//! `ASK`) and retries (`TRYAGAIN`) by itself.
//!
//! Scripts go as `EVALSHA`; a node that does not know the script (a
//! restarted or freshly promoted one) answers `NOSCRIPT`, and the call is
//! repeated once as `EVAL` with the body, which also caches it there.

use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, ErrorKind, FromRedisValue, RedisError, RedisResult, ServerErrorKind, Value};

use super::scripts::Lua;

/// A connection to the Redis that lock commands go to.
#[derive(Clone)]
pub enum Target {
    /// One server: single mode, or the master Sentinel names.
    Node(ConnectionManager),
    /// Routed per key by the cluster client.
    Cluster(ClusterConnection),
    /// One node of a cluster, by address (for per-node commands such as
    /// `CONFIG GET`).
    ClusterNode(ClusterConnection, String, u16),
}

impl Target {
    /// One plain command (`PING`, `ROLE`, …) on this target.
    pub async fn command<T: FromRedisValue>(&mut self, cmd: &Cmd) -> RedisResult<T> {
        match self {
            Target::Node(c) => cmd.query_async(c).await,
            Target::Cluster(c) => cmd.query_async(c).await,
            Target::ClusterNode(c, host, port) => {
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                });
                let value = c.route_command(cmd.clone(), route).await?;
                T::from_redis_value(value).map_err(Into::into)
            }
        }
    }
}

/// Keys and arguments of one script call.
#[derive(Debug, Default)]
pub struct Call {
    pub keys: Vec<String>,
    pub args: Vec<String>,
}

impl Call {
    pub fn key(&mut self, key: String) -> &mut Self {
        self.keys.push(key);
        self
    }

    pub fn arg(&mut self, arg: impl ToString) -> &mut Self {
        self.args.push(arg.to_string());
        self
    }
}

/// `WAIT numreplicas timeout` after the script.
#[derive(Debug, Clone, Copy)]
pub struct Wait {
    pub replicas: u32,
    pub timeout_ms: u64,
}

/// A script's reply and, with [`Wait`], how many replicas acknowledged.
pub struct Reply {
    pub value: Value,
    pub replicas: Option<i64>,
}

fn command(first: &str, head: &str, call: &Call) -> Cmd {
    let mut cmd = redis::cmd(first);
    cmd.arg(head).arg(call.keys.len());
    for k in &call.keys {
        cmd.arg(k);
    }
    for a in &call.args {
        cmd.arg(a);
    }
    cmd
}

fn no_script(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}

/// The script alone, or the script then `WAIT`, as one request. Without
/// `WAIT` it is a plain command, which the cluster client redirects
/// (`MOVED`, `ASK`) and retries (`TRYAGAIN`) by itself; a pipeline's
/// per-command error replies would reach us instead.
async fn send(
    target: &mut Target,
    cmd: Cmd,
    wait: Option<Wait>,
) -> Result<(Value, Option<i64>), RedisError> {
    let Some(w) = wait else {
        return Ok((target.command::<Value>(&cmd).await?, None));
    };
    let mut pipe = redis::pipe();
    pipe.add_command(cmd);
    pipe.cmd("WAIT").arg(w.replicas).arg(w.timeout_ms);
    let (value, replicas): (Value, i64) = match target {
        Target::Node(c) => pipe.query_async(c).await?,
        Target::Cluster(c) => pipe.query_async(c).await?,
        Target::ClusterNode(..) => {
            return Err(RedisError::from((
                ErrorKind::Client,
                "lock scripts are routed by key, not to a chosen node",
            )))
        }
    };
    Ok((value, Some(replicas)))
}

/// Whether the connection an error came from may be replaced by a new one
/// before the next command: every error after which redis-rs' connection
/// manager reconnects by itself (`is_unrecoverable_error`: I/O, but also
/// an unparsable reply or a failed authentication), and every I/O error. A check narrower than redis-rs' own would let it
/// reconnect behind our back — to a server that may have restarted with
/// another eviction policy.
pub fn may_reconnect(e: &RedisError) -> bool {
    e.is_unrecoverable_error()
        || e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
}

/// An error reply after which the command did not run and may succeed
/// soon: a slot moving or failing over (`ASK`, `MOVED`, `TRYAGAIN` — a
/// multi-key script whose keys are split between two nodes mid-migration —
/// `CLUSTERDOWN`), a replica being promoted (`MASTERDOWN`, `LOADING`).
pub fn transient(e: &RedisError) -> bool {
    matches!(
        e.code(),
        Some("ASK" | "MOVED" | "TRYAGAIN" | "CLUSTERDOWN" | "MASTERDOWN" | "LOADING")
    )
}

/// Runs `lua` with `call` on `target`, then `WAIT` when asked.
pub async fn run(
    target: &mut Target,
    lua: &Lua,
    call: &Call,
    wait: Option<Wait>,
) -> Result<Reply, RedisError> {
    let sent = send(
        target,
        command("EVALSHA", lua.script.get_hash(), call),
        wait,
    )
    .await;
    let (value, replicas) = match sent {
        Err(e) if no_script(&e) => send(target, command("EVAL", lua.body, call), wait).await?,
        other => other?,
    };
    Ok(Reply { value, replicas })
}
