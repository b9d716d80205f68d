//! Running one script call on the Redis that owns its keys, within the
//! request budget: the part of the backend that both the per-call path and
//! the group-commit batcher ([`super::batch`]) use, so a batch is bounded,
//! retried, classified and followed through failovers exactly like a
//! single call.

use std::sync::Arc;
use std::time::Duration;

use super::conn::{self, Call, Reply, Wait};
use super::eviction::EvictionGuard;
use super::scripts::Lua;
use super::topology::Topology;
use crate::lock::BackendError;

/// Which writes `WAIT` follows.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Replicated {
    Required(&'static str),
    No,
}

pub struct Runner {
    pub topology: Topology,
    /// What a connection error names ([`super::target`]): an operator
    /// reading "Connection refused" must see which address was tried.
    pub target: String,
    pub timeout: Duration,
    /// `WAIT` after acquires and renewals (`backend.redis.wait_replicas`).
    pub wait: Option<Wait>,
    /// Told when a connection dropped: the server's policy is read again.
    pub eviction: Arc<EvictionGuard>,
}

impl Runner {
    /// How long one call may take: the request timeout, plus `WAIT`'s own
    /// timeout when it follows the script.
    pub fn budget(&self, replicated: Replicated) -> Duration {
        self.timeout + Duration::from_millis(self.wait_for(replicated).map_or(0, |w| w.timeout_ms))
    }

    fn wait_for(&self, replicated: Replicated) -> Option<Wait> {
        match replicated {
            Replicated::Required(_) => self.wait,
            Replicated::No => None,
        }
    }

    /// Runs one script on the key's Redis, with `WAIT` when `replicated`
    /// requires it and `backend.redis.wait_replicas` is set.
    pub async fn exec(
        &self,
        lua: &Lua,
        call: &Call,
        replicated: Replicated,
    ) -> Result<Reply, BackendError> {
        // Subscribed before the target is read, so a switch between the two
        // is noticed.
        let mut moved = self.topology.master_changes();
        let mut target = self.topology.target()?;
        let wait = self.wait_for(replicated);
        let budget = self.budget(replicated);
        let call = tokio::time::timeout(budget, async {
            // A slot in migration or a shard mid-failover refuses for a
            // moment; the scripts are idempotent, so try again within the
            // budget rather than fail the lock call.
            let mut pause = Duration::from_millis(10);
            loop {
                match conn::run(&mut target, lua, call, wait).await {
                    Err(e) if conn::transient(&e) => {
                        tracing::debug!(error = %e, "redis refused for now; retrying");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_millis(100));
                        if let Ok(t) = self.topology.target() {
                            target = t;
                        }
                    }
                    other => return other,
                }
            }
        });
        let outcome = match &mut moved {
            // A request to a master that has just been replaced gives up at
            // once instead of waiting out its timeout on a dead server: the
            // caller retries (acquire) or reports 503 (release, renew) and
            // the next try goes to the new master.
            Some(moved) => tokio::select! {
                outcome = call => outcome,
                _ = moved.changed() => {
                    return Err(BackendError::Unavailable(
                        "redis master changed during the request".into(),
                    ))
                }
            },
            None => call.await,
        };
        match outcome {
            Err(_) => {
                self.saw_timeout();
                Err(BackendError::Unavailable(format!(
                    "{}: request timed out",
                    self.target
                )))
            }
            Ok(Err(e)) => {
                self.saw_error(&e);
                Err(classify(&self.target, e))
            }
            Ok(Ok(reply)) => Ok(reply),
        }
    }

    /// A command got no answer within our budget: its connection may be
    /// broken, and the error that would have said so went with the
    /// abandoned command, so a reconnect may follow without one reaching
    /// [`Runner::saw_error`]. The eviction policy is read again before the
    /// next acquire trusts the server behind it (not in cluster mode, as
    /// for errors).
    pub fn saw_timeout(&self) {
        if !self.topology.is_cluster() {
            self.eviction.invalidate(None);
        }
    }

    /// A command failed: the master may have moved (sentinel), and a
    /// connection that dropped reconnects to a server whose eviction
    /// policy must be read again (it may have restarted with another). Not
    /// in cluster mode, where the error does not say which master broke
    /// and one shard's outage must not stop the others: there a changed
    /// slot map and the periodic check re-read.
    /// ([`super::conn::may_reconnect`] says which errors).
    pub fn saw_error(&self, e: &redis::RedisError) {
        self.topology.saw_error(e);
        if super::conn::may_reconnect(e) && !self.topology.is_cluster() {
            self.eviction.invalidate(None);
        }
    }
}

/// An error after which the command may or may not have run (I/O, a
/// dropped connection, a timeout) is `Unavailable`; an error reply from
/// Redis (the script refused, `READONLY`, `OOM`) is a known failure.
pub fn classify(target: &str, e: redis::RedisError) -> BackendError {
    if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal() {
        BackendError::Unavailable(format!("{target}: {e}"))
    } else {
        BackendError::Protocol(e.to_string())
    }
}

/// The same error for each item of a failed batch: every item gets what
/// a single call would have had (`BackendError` holds a `String`, so it
/// is rebuilt rather than shared).
pub fn copy_error(e: &BackendError) -> BackendError {
    match e {
        BackendError::Unavailable(m) => BackendError::Unavailable(m.clone()),
        BackendError::Protocol(m) => BackendError::Protocol(m.clone()),
        BackendError::Refused(m) => BackendError::Refused(m.clone()),
        BackendError::NotReplicated(m) => BackendError::NotReplicated(m.clone()),
    }
}
