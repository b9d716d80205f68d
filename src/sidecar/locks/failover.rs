//! What a backend failover does to the leases this sidecar holds.
//!
//! After a Sentinel promotion or a Cluster shard failover, the new master
//! has only the lock writes that replicated before the old one went away.
//! The rule (docs/backends.md, "Redis topologies"): every lease minted or renewed on
//! the old master is *suspect* until checked on the new one. The check runs
//! as soon as the backend reports the failover:
//!
//! - the new master has the lease (same lease id, same token): it stays
//!   held, with its deadline unchanged — the next renewal extends it there;
//! - the new master does not have it (free, or held by another lease that
//!   acquired it after the promotion): the lease is lost, reason
//!   `failover`, with the usual lost-lease webhook and hold-stream event;
//! - the check itself fails: the lease keeps its local deadline, and the
//!   next renewal decides (it runs on the new master too).
//!
//! Waiters re-check as well: releases published on the old master may
//! never have reached anyone.

use std::time::Duration;

use super::LockManager;
use crate::lock::{Ownership, WakeSink};
use crate::sidecar::leases::LostReason;

/// Leases checked per backend call.
const CHECK_BATCH: usize = 500;
/// Attempts per batch while the new master settles (a Cluster answers
/// `CLUSTERDOWN` until every node has the new slot map): 100 ms doubling,
/// about 3 s in all.
const CHECK_ATTEMPTS: u32 = 6;

impl LockManager {
    /// Re-verifies every held lease on the backend's new master.
    pub async fn reverify_after_failover(&self) {
        if crate::mutants::active("no_failover_reverify") {
            return;
        }
        WakeSink::resync(&*self.waiters);
        let held = self.leases.held();
        let (mut kept, mut lost, mut unchecked) = (0usize, 0usize, 0usize);
        for chunk in held.chunks(CHECK_BATCH) {
            let items: Vec<_> = chunk
                .iter()
                .map(|(key, lease, _)| (key.clone(), lease.clone()))
                .collect();
            let mut found = None;
            for attempt in 0..CHECK_ATTEMPTS {
                match self
                    .call("check_many", self.backend.check_many(&items))
                    .await
                {
                    Ok(f) => {
                        found = Some(f);
                        break;
                    }
                    Err(e) if attempt + 1 < CHECK_ATTEMPTS => {
                        tracing::debug!(error = %e, attempt, "re-verifying leases after a failover failed; retrying");
                        tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "re-verifying leases after a failover failed; their renewals decide");
                    }
                }
            }
            let Some(found) = found else {
                unchecked += chunk.len();
                continue;
            };
            for ((key, lease, token), found) in chunk.iter().zip(found) {
                match found {
                    Ownership::Owned { token: t } if t == *token => kept += 1,
                    _ => {
                        lost += 1;
                        self.record_lost(self.leases.mark_lost(key, lease, LostReason::Failover));
                    }
                }
            }
        }
        tracing::warn!(
            kept,
            lost,
            unchecked,
            "leases re-verified after a backend failover"
        );
    }
}
