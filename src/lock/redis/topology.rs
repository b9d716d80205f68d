//! Which Redis a lock command goes to, by mode: one fixed server, the
//! master Sentinel names now, or the cluster.

use std::sync::Arc;

use redis::aio::ConnectionManager;
use tokio::sync::watch;

use super::cluster::ClusterTopology;
use super::conn::Target;
use super::sentinel::SentinelMaster;
use crate::lock::BackendError;

pub enum Topology {
    Single(ConnectionManager),
    Sentinel(Arc<SentinelMaster>),
    Cluster(Arc<ClusterTopology>),
}

impl Topology {
    /// Where the next command goes; unavailable until a sentinel has named
    /// a master or the cluster has answered once.
    pub fn target(&self) -> Result<Target, BackendError> {
        match self {
            Topology::Single(c) => Ok(Target::Node(c.clone())),
            Topology::Sentinel(s) => s
                .current()
                .map(|m| Target::Node(m.conn))
                .ok_or_else(|| BackendError::Unavailable("no redis master known yet".into())),
            Topology::Cluster(c) => c
                .conn()
                .map(Target::Cluster)
                .ok_or_else(|| BackendError::Unavailable("redis cluster not reached yet".into())),
        }
    }

    /// A command failed: in sentinel mode, maybe because the master moved.
    pub fn saw_error(&self, e: &redis::RedisError) {
        if let Topology::Sentinel(s) = self {
            s.suspect(e);
        }
    }

    pub fn failovers(&self) -> Option<watch::Receiver<u64>> {
        match self {
            Topology::Single(_) => None,
            Topology::Sentinel(s) => Some(s.failovers()),
            Topology::Cluster(c) => Some(c.failovers()),
        }
    }

    /// Sentinel mode: resolves when the master is replaced (requests in
    /// flight to the old one are abandoned). Not in cluster mode, where one
    /// shard's failover must not fail requests to the others.
    pub fn master_changes(&self) -> Option<watch::Receiver<u64>> {
        match self {
            Topology::Sentinel(s) => Some(s.failovers()),
            _ => None,
        }
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self, Topology::Cluster(_))
    }
}
