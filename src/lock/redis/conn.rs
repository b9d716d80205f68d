//! Running one lock script on the Redis that owns its key, optionally
//! followed by `WAIT` on the same connection.
//!
//! The script and `WAIT` go out as one pipeline: `WAIT` counts the replicas
//! that acknowledged every write sent on *its* connection before it, so it
//! must follow the script on the same socket with nothing in between (a
//! `WAIT` on another connection returns a meaningless count). A multiplexed
//! connection keeps the order of one pipeline; in cluster mode the pipeline
//! is routed by the script's first key, and `WAIT` (no key) goes with it.
//!
//! Scripts go as `EVALSHA`; a node that does not know the script (a
//! restarted or freshly promoted one) answers `NOSCRIPT`, and the call is
//! repeated once as `EVAL` with the body, which also caches it there.

use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{
    Cmd, ErrorKind, FromRedisValue, Pipeline, RedisError, RedisResult, ServerErrorKind, Value,
};

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
    async fn pipeline(&mut self, pipe: &Pipeline) -> RedisResult<Vec<RedisResult<Value>>> {
        match self {
            Target::Node(c) => pipe.query_async(c).await,
            Target::Cluster(c) => pipe.query_async(c).await,
            Target::ClusterNode(c, host, port) => {
                let route = SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                };
                let n = pipe.len();
                let values = c.route_pipeline(pipe.clone(), 0, n, route).await?;
                Ok(values.into_iter().map(Ok).collect())
            }
        }
    }

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

fn build(first: &str, head: &str, call: &Call, wait: Option<Wait>) -> Pipeline {
    let mut pipe = redis::pipe();
    pipe.ignore_errors();
    let cmd = pipe.cmd(first).arg(head).arg(call.keys.len());
    for k in &call.keys {
        cmd.arg(k);
    }
    for a in &call.args {
        cmd.arg(a);
    }
    if let Some(w) = wait {
        pipe.cmd("WAIT").arg(w.replicas).arg(w.timeout_ms);
    }
    pipe
}

fn no_script(r: &RedisResult<Value>) -> bool {
    matches!(r, Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript))
}

/// Runs `script` with `call` on `target`, then `WAIT` when asked.
pub async fn run(
    target: &mut Target,
    lua: &Lua,
    call: &Call,
    wait: Option<Wait>,
) -> Result<Reply, RedisError> {
    let mut replies = target
        .pipeline(&build("EVALSHA", lua.script.get_hash(), call, wait))
        .await?;
    if replies.first().is_some_and(no_script) {
        replies = target
            .pipeline(&build("EVAL", lua.body, call, wait))
            .await?;
    }
    let mut replies = replies.into_iter();
    let value = replies
        .next()
        .ok_or_else(|| RedisError::from((ErrorKind::Parse, "empty pipeline reply")))??;
    let replicas = match wait {
        None => None,
        Some(_) => {
            let v = replies
                .next()
                .ok_or_else(|| RedisError::from((ErrorKind::Parse, "no WAIT reply")))??;
            Some(i64::from_redis_value(v)?)
        }
    };
    Ok(Reply { value, replicas })
}
