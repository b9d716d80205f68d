//! Multi-key locks (issue 33 item 4): all of a set of keys or none, under
//! one lease id.
//!
//! Each key is an ordinary lease, acquired one after the other in one
//! canonical order (the keys' bytes, ascending): two multi-key acquires
//! that share keys take them in the same order, so neither can hold one
//! key the other waits for while it waits for one the other holds — no
//! deadlock, on any backend, without an atomic multi-key operation (which
//! RedLock, ZooKeeper and Redis Cluster across slots do not have). The
//! whole acquire shares one `wait_ms`. Should a key stay held past it, or
//! fail, or the client go away mid-way, every key already taken is
//! released before the answer (or by the guard, for a client gone): all
//! or nothing.
//!
//! The client gets one lease id, the *group* id: it renews, releases and
//! keeps alive every key, and binds proxied writes (`Fencing-Lease`) to
//! whichever key the request names; each key keeps its own lease id (never
//! shown) and its own fencing token, which the proxy injects for the key a
//! request names. Each key's lease lives and is lost on its own (a key's
//! TTL can run out while another is renewed): a renewal answers
//! `lease_lost` naming the first key found gone, and a release still frees
//! the others.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::super::leases::{LeaseTable, LeaseView};
use super::acquire::Acquire;
use super::{LockError, LockManager};
use crate::lock::{DynBackend, LeaseId, LockKey};
use crate::metrics::Metrics;

/// The most keys one multi-key lease may cover.
pub const MAX_KEYS: usize = 32;

/// The multi-key leases held here: group id → (key, the key's own lease).
#[derive(Default)]
pub(super) struct Groups(Mutex<HashMap<LeaseId, Vec<(LockKey, LeaseId)>>>);

impl Groups {
    fn insert(&self, group: LeaseId, members: Vec<(LockKey, LeaseId)>) {
        self.0.lock().expect("groups").insert(group, members);
    }

    fn get(&self, group: &LeaseId) -> Option<Vec<(LockKey, LeaseId)>> {
        self.0.lock().expect("groups").get(group).cloned()
    }

    fn remove(&self, group: &LeaseId) -> Option<Vec<(LockKey, LeaseId)>> {
        self.0.lock().expect("groups").remove(group)
    }

    /// Forgets groups none of whose keys is held here any more (every
    /// lease ran out or was lost without the group's release).
    pub(super) fn sweep(&self, leases: &LeaseTable) {
        self.0.lock().expect("groups").retain(|_, members| {
            members
                .iter()
                .any(|(key, lease)| leases.holding(key, lease).is_some())
        });
    }
}

/// A multi-key acquire: `lease` says everything but the key.
pub struct AcquireMany {
    pub keys: Vec<LockKey>,
    pub lease: Acquire,
}

/// A multi-key lease as the client sees it.
pub struct GroupView {
    pub lease_id: LeaseId,
    /// Each key's lease, in the canonical order.
    pub keys: Vec<LeaseView>,
}

impl GroupView {
    /// The least time any key's lease has left: the group's.
    pub fn remaining_ms(&self) -> u64 {
        self.keys.iter().map(|v| v.remaining_ms).min().unwrap_or(0)
    }
}

/// Releases the keys taken so far unless disarmed: a multi-key acquire
/// dropped mid-way (its client went away) gives back what it took.
struct Taken {
    backend: DynBackend,
    leases: Arc<LeaseTable>,
    metrics: Arc<Metrics>,
    members: Vec<(LockKey, LeaseId)>,
}

impl Drop for Taken {
    fn drop(&mut self) {
        if self.members.is_empty() || crate::mutants::active("multi_keys_kept") {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        for (key, lease) in self.members.drain(..) {
            super::release::stop_holding(&self.leases, &self.metrics, &key, &lease);
            rt.spawn(super::release::release_orphans(
                self.backend.clone(),
                self.leases.clone(),
                self.metrics.clone(),
                key,
                vec![lease],
                None,
                true,
            ));
        }
    }
}

impl LockManager {
    /// Acquires every key of `req` or none (see the module comment).
    pub async fn acquire_many(&self, req: AcquireMany) -> Result<GroupView, LockError> {
        let started = Instant::now();
        let result = self.acquire_many_inner(req, started).await;
        let outcome = match &result {
            Ok(_) => "acquired",
            Err(LockError::Held(_) | LockError::Delayed { .. }) => "timeout",
            Err(_) => "error",
        };
        self.metrics
            .multi_acquisitions
            .with_label_values(&[outcome])
            .inc();
        match &result {
            Ok(g) => tracing::debug!(keys = g.keys.len(), lease_tag = %g.lease_id.tag(),
                wait_ms = started.elapsed().as_millis() as u64, "multi-key lock acquired"),
            Err(e) => {
                tracing::debug!(error = %e, "multi-key lock not acquired; keys taken were given back")
            }
        }
        result
    }

    async fn acquire_many_inner(
        &self,
        mut req: AcquireMany,
        started: Instant,
    ) -> Result<GroupView, LockError> {
        req.keys.sort_unstable();
        req.keys.dedup();
        let deadline = started + req.lease.wait;
        let mut taken = Taken {
            backend: self.backend.clone(),
            leases: self.leases.clone(),
            metrics: self.metrics.clone(),
            members: Vec::with_capacity(req.keys.len()),
        };
        for key in &req.keys {
            let mut one = req.lease.clone();
            one.key = key.clone();
            one.wait = deadline.saturating_duration_since(Instant::now());
            let view = match self.acquire(one).await {
                Ok(view) => view,
                Err(e) => {
                    self.give_back(&mut taken).await;
                    return Err(e);
                }
            };
            let lease = LeaseId::parse(&view.lease_id).expect("our own lease id");
            taken.members.push((key.clone(), lease));
        }
        let group = LeaseId::generate();
        // Every key must still be held as the answer goes out (the first
        // ones' TTLs ran while the last were waited for): each is marked
        // one of the group's and shown as it stands now.
        let now = Instant::now();
        let mut views = Vec::with_capacity(taken.members.len());
        for (key, lease) in &taken.members {
            match self.leases.set_group(key, lease, &group) {
                Some(rec) => views.push(rec.view(now)),
                None => {
                    let key = key.clone();
                    tracing::warn!(key = %key, "multi-key acquire: a key's lease ran out before the last key was taken; all given back");
                    self.metrics.acquire_expired_before_answer.inc();
                    self.give_back(&mut taken).await;
                    return Err(LockError::ExpiredBeforeAnswer {
                        key,
                        took: now.saturating_duration_since(started),
                    });
                }
            }
        }
        self.groups
            .insert(group.clone(), std::mem::take(&mut taken.members));
        Ok(GroupView {
            lease_id: group,
            keys: views,
        })
    }

    /// Releases the keys taken so far, before the answer.
    async fn give_back(&self, taken: &mut Taken) {
        if crate::mutants::active("multi_keys_kept") {
            taken.members.clear();
            return;
        }
        for (key, lease) in std::mem::take(&mut taken.members) {
            if let Err(e) = self.release(key.clone(), lease.clone()).await {
                tracing::warn!(key = %key, error = %e, "multi-key acquire: a key taken could not be given back; it runs out with its TTL");
            }
        }
    }

    /// The keys and their leases of multi-key lease `group`, if it is one
    /// of this sidecar's.
    pub fn group(&self, group: &LeaseId) -> Option<Vec<(LockKey, LeaseId)>> {
        self.groups.get(group)
    }

    /// Renews every key of `group` (each with `ttl`, or its own).
    pub async fn renew_many_keys(
        &self,
        group: &LeaseId,
        ttl: Option<Duration>,
    ) -> Result<GroupView, LockError> {
        let members = self.group_members(group)?;
        let mut keys = Vec::with_capacity(members.len());
        for (key, lease) in members {
            keys.push(self.renew(key, lease, ttl).await?);
        }
        Ok(GroupView {
            lease_id: group.clone(),
            keys,
        })
    }

    /// Releases every key of `group`; the first key found lost is the
    /// error, after the others were released.
    pub async fn release_many_keys(&self, group: &LeaseId) -> Result<Vec<LockKey>, LockError> {
        let members = self
            .groups
            .remove(group)
            .ok_or_else(|| self.unknown_group(group))?;
        let mut first_error = None;
        let mut keys = Vec::with_capacity(members.len());
        for (key, lease) in members {
            if let Err(e) = self.release(key.clone(), lease).await {
                first_error.get_or_insert(e);
            }
            keys.push(key);
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(keys),
        }
    }

    /// Keeps every key of `group` alive (auto-renewed leases): the first
    /// key no longer held is the error.
    pub fn touch_group(&self, group: &LeaseId) -> Result<(), LockError> {
        for (key, lease) in self.group_members(group)? {
            if !self.touch(&key, Some(&lease)) {
                return Err(LockError::LeaseLost(key));
            }
        }
        Ok(())
    }

    fn group_members(&self, group: &LeaseId) -> Result<Vec<(LockKey, LeaseId)>, LockError> {
        self.groups
            .get(group)
            .ok_or_else(|| self.unknown_group(group))
    }

    fn unknown_group(&self, group: &LeaseId) -> LockError {
        LockError::UnknownGroup(group.tag().to_string())
    }
}
