//! Renewals: the application's own (`POST …/renew`), the sidecar's batched
//! renewals of auto-renewed and held leases, and adoption of a lease after a
//! sidecar restart.
//!
//! The rules (PITFALLS 6 and 10; issue 9 item 2):
//! - a renewal *sets* the backend TTL, so the local deadline after it is its
//!   send time + the TTL it sent, never the larger of old and new;
//! - a renewal without `ttl_ms` keeps the lease's own TTL;
//! - one renewal of a lease at a time; one whose outcome stays unknown caps
//!   the lease's later deadlines at its TTL ([`super::super::leases`]);
//! - a reply that comes after the local deadline does not revive the lease:
//!   it is lost here, and released in the backend so the key is not taken
//!   by nobody for a whole TTL;
//! - a lease that ended here is never adopted back by a later renewal.

use std::time::Duration;

use tokio::time::Instant;

use super::super::leases::{LeaseTable, LeaseView, LostReason, NotRenewed, Renewal};
use super::acquire::renew_at;
use super::{LockError, LockManager};
use crate::lock::{BackendError, LeaseId, LockKey, Ownership};

/// Leases renewed per backend round trip at most.
const RENEW_BATCH: usize = 500;
/// Below this, a lease capped by `max_hold_ms` is not renewed any more.
const MIN_RENEW_TTL: Duration = Duration::from_millis(10);

/// A renewal on its way to the backend. If it is dropped before its reply
/// was applied (the client went away, the call failed), its outcome is
/// unknown and the lease's deadline is capped accordingly.
struct RenewalInFlight<'a> {
    leases: &'a LeaseTable,
    key: &'a LockKey,
    lease: &'a LeaseId,
    sent: Instant,
    ttl: Duration,
    settled: bool,
}

impl Drop for RenewalInFlight<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.leases
                .renewal_unknown(self.key, self.lease, self.sent, self.ttl);
        }
    }
}

impl LockManager {
    /// `POST /v1/locks/{key}/renew`. `ttl` `None`: the lease's own TTL.
    pub async fn renew(
        &self,
        key: LockKey,
        lease: LeaseId,
        ttl: Option<Duration>,
    ) -> Result<LeaseView, LockError> {
        if let Some(ttl) = ttl {
            self.check_ttl(ttl)?;
        }
        let now = Instant::now();
        let (record, lost) = self.leases.get(&key, now);
        self.record_lost(lost);
        let result = match record {
            Some(rec) if rec.lease_id == lease && !rec.is_held() => {
                // Lost here means lost: a renewal never revives it.
                Err(LockError::LeaseLost(key.clone()))
            }
            Some(rec) if rec.lease_id == lease => {
                self.renew_known(&key, &lease, ttl.unwrap_or(rec.ttl), rec.max_until)
                    .await
            }
            _ if self.leases.retired(&lease) => Err(LockError::LeaseLost(key.clone())),
            _ => {
                self.renew_unknown(&key, &lease, ttl.unwrap_or(self.config.default_ttl))
                    .await
            }
        };
        let label = match &result {
            Ok(_) => "renewed",
            Err(LockError::LeaseLost(_)) => "lease_lost",
            Err(LockError::NotOwner(_)) => "not_owner",
            Err(_) => "error",
        };
        self.metrics.renewals.with_label_values(&[label]).inc();
        result
    }

    /// Renews a lease this sidecar holds.
    async fn renew_known(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
        max_until: Option<Instant>,
    ) -> Result<LeaseView, LockError> {
        let mut ttl = ttl;
        if let Some(until) = max_until {
            let left = until.saturating_duration_since(Instant::now());
            if left < MIN_RENEW_TTL {
                return Err(LockError::MaxHold(key.clone()));
            }
            ttl = ttl.min(left);
        }
        let Some(rec) = self.leases.record_of(key, lease) else {
            return Err(LockError::LeaseLost(key.clone()));
        };
        // One renewal of a lease at a time (the sidecar's renewer skips a
        // lease whose renewal is on its way).
        let _turn = rec.renewing.clone().lock_owned().await;
        let sent = Instant::now();
        let mut flight = RenewalInFlight {
            leases: &self.leases,
            key,
            lease,
            sent,
            ttl,
            settled: false,
        };
        let result = self
            .call("renew", self.backend.renew(key, lease, ttl))
            .await;
        match result {
            Ok(Ownership::Owned { .. }) => {
                flight.settled = true;
                match self.leases.renewed(key, lease, sent, ttl) {
                    Ok(rec) => Ok(rec.view(Instant::now())),
                    Err(NotRenewed::Late) => {
                        self.lost_after_late_reply(key, lease);
                        Err(LockError::LeaseLost(key.clone()))
                    }
                    Err(NotRenewed::Gone) => Err(LockError::LeaseLost(key.clone())),
                }
            }
            Ok(other) => {
                flight.settled = true;
                self.record_lost(self.leases.refresh(key, Instant::now()));
                self.record_lost(self.leases.mark_lost(key, lease, LostReason::Backend));
                Err(self.not_held(key, true, other))
            }
            // Unknown outcome: `flight` caps the deadline when dropped.
            Err(e) => Err(e.into()),
        }
    }

    /// A renewal carrying a lease id this sidecar has no record of (it
    /// restarted while the application kept its lease): if the backend
    /// confirms the lease, track it again.
    async fn renew_unknown(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<LeaseView, LockError> {
        let ttl = self.config.max_hold.map_or(ttl, |cap| ttl.min(cap));
        let sent = Instant::now();
        match self
            .call("renew", self.backend.renew(key, lease, ttl))
            .await?
        {
            Ownership::Owned { token } => {
                if self.leases.record_of(key, lease).is_some() {
                    // Adopted meanwhile by a concurrent renewal.
                    return match self.leases.renewed(key, lease, sent, ttl) {
                        Ok(rec) => Ok(rec.view(Instant::now())),
                        Err(_) => Err(LockError::LeaseLost(key.clone())),
                    };
                }
                let group = self.metrics.group(key.as_str());
                let record = self.hold(
                    key,
                    &group,
                    lease,
                    token,
                    None,
                    ttl,
                    sent,
                    Renewal::Manual,
                    None,
                );
                if self.backend.supports_reentrancy() {
                    // Perhaps reentrant: its count and owner are in the
                    // backend, read when they matter.
                    self.leases.holds_unknown(key, lease);
                }
                tracing::info!(key = %key, token, lease_tag = %lease.tag(), "lease adopted on renewal");
                Ok(record.view(Instant::now()))
            }
            other => Err(self.not_held(key, false, other)),
        }
    }

    /// A renewal reply came after the local deadline: the lease is lost
    /// here (the application may already have been told), and released in
    /// the backend, which would otherwise keep the key for a whole TTL.
    fn lost_after_late_reply(&self, key: &LockKey, lease: &LeaseId) {
        self.record_lost(self.leases.refresh(key, Instant::now()));
        self.record_lost(self.leases.mark_lost(key, lease, LostReason::Deadline));
        self.release_in_background(key, lease);
    }

    /// Renews, in one batched backend call, every sidecar-renewed lease that
    /// is due; marks lost the ones the backend no longer gives us; retries
    /// failures within the lease's safe time. Called by the renewer task.
    pub async fn renew_due(&self) {
        let now = Instant::now();
        let due = self.leases.take_due(now, RENEW_BATCH);
        if due.is_empty() {
            return;
        }
        let mut batch: Vec<(LockKey, LeaseId, Duration)> = Vec::with_capacity(due.len());
        let mut turns = Vec::with_capacity(due.len());
        for rec in due {
            if now >= rec.deadline {
                let lost = self.leases.refresh(&rec.key, now);
                self.record_lost(lost);
                continue;
            }
            if let Renewal::Auto { keepalive } = rec.renewal {
                if now.saturating_duration_since(rec.last_activity) > keepalive {
                    // The application went silent: let the lease run out.
                    tracing::info!(key = %rec.key, "no keepalive; renewal stopped");
                    self.leases.schedule(&rec.key, rec.deadline);
                    continue;
                }
            }
            let ttl = match rec.max_until {
                Some(until) => rec.ttl.min(until.saturating_duration_since(now)),
                None => rec.ttl,
            };
            if ttl < MIN_RENEW_TTL {
                // max_hold_ms reached: no more renewals.
                self.leases.schedule(&rec.key, rec.deadline);
                continue;
            }
            let Ok(turn) = rec.renewing.clone().try_lock_owned() else {
                // The application's own renewal is on its way: look again
                // shortly.
                self.leases
                    .schedule(&rec.key, now + Duration::from_millis(10));
                continue;
            };
            turns.push(turn);
            batch.push((rec.key, rec.lease_id, ttl));
        }
        if batch.is_empty() {
            return;
        }
        let sent = Instant::now();
        let result = self
            .call("renew_many", self.backend.renew_many(&batch))
            .await;
        match result {
            Ok(results) => {
                for ((key, lease, ttl), result) in batch.into_iter().zip(results) {
                    let label = match result {
                        Ownership::Owned { .. } => {
                            match self.leases.renewed(&key, &lease, sent, ttl) {
                                Ok(_) => {
                                    self.leases.schedule(&key, renew_at(sent, ttl));
                                    "renewed"
                                }
                                Err(NotRenewed::Late) => {
                                    self.lost_after_late_reply(&key, &lease);
                                    "lease_lost"
                                }
                                Err(NotRenewed::Gone) => "lease_lost",
                            }
                        }
                        _ => {
                            self.record_lost(self.leases.refresh(&key, Instant::now()));
                            self.record_lost(self.leases.mark_lost(
                                &key,
                                &lease,
                                LostReason::Backend,
                            ));
                            "lease_lost"
                        }
                    };
                    self.metrics.renewals.with_label_values(&[label]).inc();
                }
            }
            Err(e) => {
                let unknown = matches!(e, BackendError::Unavailable(_));
                // Retry soon, and in any case look again at the deadline.
                for (key, lease, ttl) in &batch {
                    if unknown {
                        self.leases.renewal_unknown(key, lease, sent, *ttl);
                    }
                    self.metrics.renewals.with_label_values(&["error"]).inc();
                    let retry =
                        (*ttl / 10).clamp(Duration::from_millis(10), Duration::from_millis(200));
                    self.leases.schedule(key, Instant::now() + retry);
                }
            }
        }
        drop(turns);
    }
}
