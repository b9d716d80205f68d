//! The sidecar's lock logic: where backend results become lease state.
//!
//! It knows nothing of HTTP; handlers call it and map [`LockError`] to
//! responses in one place (`crate::error`). One concern per file:
//! - [`acquire`] — acquiring, waiting in the queue, pre-registration, and
//!   the guard that releases what a cancelled acquire may have taken;
//! - [`renew`] — renewals (the application's and the sidecar's own) and
//!   adoption of leases after a sidecar restart;
//! - [`release`] — release, shutdown, and releasing leases nobody owns;
//! - [`reentrant`] — hold counts of reentrant leases;
//! - [`semaphore`] — permits: a lease on one of a semaphore's slot keys;
//! - [`multi`] — multi-key leases: all of a set of keys or none;
//! - [`readers`] — read leases of read-write locks;
//! - [`view`] — what the backend records for a key, rate-limited.

mod acquire;
mod failover;
mod multi;
mod readers;
mod reentrant;
mod release;
mod renew;
mod semaphore;
pub mod view;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use self::acquire::Acquire;
pub use self::multi::{AcquireMany, GroupView, MAX_KEYS};
pub use self::reentrant::{Released, MAX_HOLDS};
pub use self::semaphore::{slot_of, Permit, PermitRequest, MAX_PERMITS};
use super::leases::{LeaseRecord, LeaseTable, LeaseView, Lost};
use super::preregister::Preregistrar;
use super::waiters::WaitQueues;
use super::webhook::Webhook;
use crate::lock::{BackendError, DynBackend, LeaseId, LockKey, Ownership};
use crate::metrics::Metrics;
use crate::token::Signer;

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("lock `{0}` is held by another lease")]
    Held(LockKey),
    #[error("lock `{key}` is free but in its lock-delay (its last lease expired without a release) for {} ms more", .retry_after.as_millis())]
    Delayed { key: LockKey, retry_after: Duration },
    #[error("too many backend views; sidecar.backend_view_per_second and four at a time bound them (retry in {} ms)", .retry_after.as_millis())]
    RateLimited { retry_after: Duration },
    #[error("{feature} locks are not supported by the {backend} backend (README: lock types)")]
    Unsupported {
        feature: &'static str,
        backend: &'static str,
    },
    #[error("all {permits} permits of semaphore `{name}` are held")]
    NoPermit { name: LockKey, permits: u32 },
    #[error("semaphore `{name}` has {fixed} permits, fixed at its first use; asked for {asked} (a name keeps its count: use another name for another count)")]
    PermitsMismatch {
        name: LockKey,
        fixed: u32,
        asked: u32,
    },
    #[error("this sidecar holds no multi-key lease {0} (released, or every key ran out)")]
    UnknownGroup(String),
    #[error("the lease already counts {0} holds, the most one lease may")]
    TooManyHolds(u32),
    #[error("scope=backend is off on this sidecar (sidecar.backend_view_per_second = 0)")]
    ViewOff,
    #[error("the lease no longer holds lock `{0}`")]
    LeaseLost(LockKey),
    #[error("lock `{0}` is held by a different lease")]
    NotOwner(LockKey),
    #[error("this sidecar holds no lease on `{0}`")]
    NotFound(LockKey),
    #[error("this sidecar holds no lease on `{0}`; acquire it first")]
    NotHeld(LockKey),
    #[error("the lease on `{0}` reached sidecar.max_hold_ms and cannot be renewed")]
    MaxHold(LockKey),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("ttl_ms {} is above {} ms, the longest lease the {} backend keeps safe ({})", .ttl.as_millis(), .max.as_millis(), .backend, .why)]
    TtlTooLong {
        ttl: Duration,
        max: Duration,
        backend: &'static str,
        why: &'static str,
    },
    #[error("too many queued waiters (limit {0})")]
    TooManyWaiters(usize),
    #[error("too many leases held by this sidecar (limit {0})")]
    TooManyLeases(usize),
    #[error("the lease on `{key}` ran out before the answer ({} ms after the request): pre-registration, the backend or this process was too slow for its ttl_ms; retry, or ask for a longer ttl_ms", .took.as_millis())]
    ExpiredBeforeAnswer { key: LockKey, took: Duration },
    #[error("the sidecar is shutting down")]
    ShuttingDown,
    #[error("could not register the new token at the gateway: {0}")]
    GatewayUnavailable(String),
    #[error("the gateway has already accepted token {highest} for `{key}`, above what the backend minted; retry")]
    TokenBehind { key: LockKey, highest: u64 },
    #[error("the gateway's mark for `{key}` is {highest}, far above the backend's token {token}: not repaired (a forged or corrupted mark?)")]
    TokenJump {
        key: LockKey,
        highest: u64,
        token: u64,
    },
}

pub struct LockManagerConfig {
    /// Cap on any lease's life, however it is renewed.
    pub max_hold: Option<Duration>,
    /// Told about every lease lost without a release.
    pub webhook: Option<Webhook>,
    /// Registers each new token at the gateway before the acquire returns.
    pub preregister: Option<Preregistrar>,
    pub max_leases: usize,
    pub max_fallback: Duration,
    /// TTL for renewals of leases this sidecar has no record of (adoption).
    pub default_ttl: Duration,
    /// `sidecar.backend_view_per_second` ([`view`]).
    pub backend_view_per_second: u32,
}

pub struct LockManager {
    backend: DynBackend,
    pub(crate) leases: Arc<LeaseTable>,
    waiters: Arc<WaitQueues>,
    signer: Signer,
    metrics: Arc<Metrics>,
    config: LockManagerConfig,
    shutdown: CancellationToken,
    preregister: Option<Preregistrar>,
    webhook: Option<Webhook>,
    /// Every lost lease, for hold streams.
    lost_tx: broadcast::Sender<Lost>,
    views: view::ViewLimits,
    /// Semaphores' permit counts as the backend fixed them ([`semaphore`]).
    permits: semaphore::FixedPermits,
    /// Multi-key leases held here ([`multi`]).
    groups: multi::Groups,
    /// Turns of hold-count changes of leases not tracked here ([`reentrant`]).
    untracked_turns: reentrant::UntrackedTurns,
    /// Numbers of read leases ([`readers`]).
    readers: readers::ReaderNumbers,
}

impl LockManager {
    pub fn new(
        backend: DynBackend,
        leases: LeaseTable,
        waiters: Arc<WaitQueues>,
        signer: Signer,
        metrics: Arc<Metrics>,
        mut config: LockManagerConfig,
        shutdown: CancellationToken,
    ) -> LockManager {
        let preregister = config.preregister.take();
        let webhook = config.webhook.take();
        LockManager {
            backend,
            leases: Arc::new(leases),
            waiters,
            signer,
            metrics,
            shutdown,
            preregister,
            webhook,
            lost_tx: broadcast::channel(1024).0,
            views: view::ViewLimits::new(config.backend_view_per_second),
            permits: Default::default(),
            groups: Default::default(),
            untracked_turns: Default::default(),
            readers: Default::default(),
            config,
        }
    }

    pub fn backend(&self) -> &DynBackend {
        &self.backend
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Returns when a renewal is due (see [`LeaseTable::until_due`]).
    pub async fn until_renewal_due(&self, idle: Duration) {
        self.leases.until_due(idle).await
    }

    /// Refuses a TTL above what the backend keeps safe.
    fn check_ttl(&self, ttl: Duration) -> Result<(), LockError> {
        match self.backend.max_ttl() {
            Some(max) if ttl > max => Err(LockError::TtlTooLong {
                ttl,
                max,
                backend: self.backend.name(),
                why: self.backend.max_ttl_why(),
            }),
            _ => Ok(()),
        }
    }

    /// Times one backend call and counts its failure.
    async fn call<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Result<T, BackendError>>,
    ) -> Result<T, BackendError> {
        timed_call(&self.backend, &self.metrics, op, fut).await
    }

    fn record_lost(&self, lost: impl IntoIterator<Item = Lost>) {
        for l in lost {
            let group = self.metrics.group(l.key.as_str());
            self.metrics
                .lost_leases
                .with_label_values(&[group.as_str(), l.reason.as_str()])
                .inc();
            self.metrics
                .hold_time
                .with_label_values(&[group.as_str()])
                .observe(l.held_for.as_secs_f64());
            tracing::warn!(
                key = %l.key, token = l.token, lease_tag = %l.lease_id.tag(),
                reason = l.reason.as_str(), held_ms = l.held_for.as_millis() as u64, "lease lost"
            );
            if let Some(w) = &self.webhook {
                w.send(&l);
            }
            let _ = self.lost_tx.send(l);
        }
    }

    /// Subscribes to lost-lease events.
    pub fn lost_events(&self) -> broadcast::Receiver<Lost> {
        self.lost_tx.subscribe()
    }

    /// Notes application activity on `key` (keepalive of auto-renewed leases).
    pub fn touch(&self, key: &LockKey, lease: Option<&LeaseId>) -> bool {
        self.leases.touch(key, lease, Instant::now())
    }

    /// Classifies a failed compare-and-set for `lease` on `key`.
    fn not_held(&self, key: &LockKey, known: bool, found: Ownership) -> LockError {
        match found {
            Ownership::OtherHolder if !known => LockError::NotOwner(key.clone()),
            _ => LockError::LeaseLost(key.clone()),
        }
    }

    pub fn get(&self, key: &LockKey) -> Result<LeaseView, LockError> {
        let now = Instant::now();
        let (record, lost) = self.leases.get(key, now);
        self.record_lost(lost);
        record
            .map(|r| r.view(now))
            .ok_or_else(|| LockError::NotFound(key.clone()))
    }

    /// `key`'s record, with its state brought up to date.
    pub fn record(&self, key: &LockKey) -> Result<LeaseRecord, LockError> {
        let (record, lost) = self.leases.get(key, Instant::now());
        self.record_lost(lost);
        record.ok_or_else(|| LockError::NotFound(key.clone()))
    }

    /// The key `lease` holds (or held, if lost) in this sidecar.
    pub fn key_of_lease(&self, lease: &LeaseId) -> Option<LockKey> {
        self.leases.key_of(lease)
    }

    /// Whether `lease` held a key here and ended (released, lost, replaced).
    pub fn lease_ended_here(&self, lease: &LeaseId) -> bool {
        self.leases.retired(lease)
    }

    /// The lease a proxied request for `key` may use: held here, inside its
    /// local deadline, and (when the application bound the request to a
    /// lease) the very lease it named.
    pub fn lease_for_write(
        &self,
        key: &LockKey,
        bound: Option<&LeaseId>,
    ) -> Result<LeaseRecord, LockError> {
        let (record, lost) = self.leases.get(key, Instant::now());
        self.record_lost(lost);
        let Some(record) = record else {
            return Err(match bound {
                Some(l) if self.leases.knows(key, l) => LockError::LeaseLost(key.clone()),
                _ => LockError::NotHeld(key.clone()),
            });
        };
        if let Some(l) = bound {
            if !record.answers_to(l) && !crate::mutants::active("no_lease_binding") {
                // Computed under another lease: refuse even though the app
                // holds the key again now.
                return Err(LockError::LeaseLost(key.clone()));
            }
        }
        let past_deadline_only = matches!(
            record.state,
            super::leases::LeaseState::Lost {
                reason: super::leases::LostReason::Deadline,
                ..
            }
        );
        let mutant_lets_it_out =
            past_deadline_only && crate::mutants::active("inject_after_deadline");
        if !(record.is_held() || mutant_lets_it_out) {
            return Err(LockError::LeaseLost(key.clone()));
        }
        Ok(record)
    }

    pub fn list(&self, limit: usize) -> (Vec<LeaseView>, usize) {
        let now = Instant::now();
        let (records, total, lost) = self.leases.list(now, limit);
        self.record_lost(lost);
        (records.iter().map(|r| r.view(now)).collect(), total)
    }

    /// Periodic bookkeeping: expire overdue leases, forget old lost ones,
    /// keep the held gauge exact.
    pub fn sweep(&self) {
        let (lost, held) = self.leases.sweep(Instant::now());
        self.record_lost(lost);
        self.groups.sweep(&self.leases);
        let mut per_group: std::collections::HashMap<String, i64> =
            std::collections::HashMap::new();
        for key in &held {
            *per_group
                .entry(self.metrics.group(key.as_str()))
                .or_default() += 1;
        }
        // Groups that dropped to zero must read 0, not their last value.
        for family in prometheus::core::Collector::collect(&self.metrics.leases_held) {
            for m in family.get_metric() {
                if let Some(g) = m.get_label().iter().find(|l| l.name() == "group") {
                    per_group.entry(g.value().to_owned()).or_default();
                }
            }
        }
        for (group, n) in per_group {
            self.metrics
                .leases_held
                .with_label_values(&[group.as_str()])
                .set(n);
        }
    }
}

/// Times one backend call and counts its failure (also for tasks that
/// outlive the request that started them).
async fn timed_call<T>(
    backend: &DynBackend,
    metrics: &Metrics,
    op: &'static str,
    fut: impl std::future::Future<Output = Result<T, BackendError>>,
) -> Result<T, BackendError> {
    let started = Instant::now();
    let result = fut.await;
    let name = backend.name();
    metrics
        .backend_duration
        .with_label_values(&[name, op])
        .observe(started.elapsed().as_secs_f64());
    if let Err(e) = &result {
        metrics.backend_errors.with_label_values(&[name, op]).inc();
        tracing::warn!(backend = name, op, error = %e, "backend request failed");
    }
    result
}
