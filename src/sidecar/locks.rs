//! The sidecar's lock logic: acquire (with queueing), renew, release.
//!
//! This is where backend results become lease state. It knows nothing of
//! HTTP; handlers call it and map [`LockError`] to responses in one place.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use rand::Rng;
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::leases::{LeaseRecord, LeaseState, LeaseTable, LeaseView, Lost, LostReason, Renewal};
use super::preregister::{PreregisterError, Preregistrar};
use super::waiters::{WaitQueues, Wake};
use super::webhook::Webhook;
use crate::lock::{Attempt, BackendError, DynBackend, LeaseId, LockKey, Ownership};
use crate::metrics::Metrics;
use crate::token::{Claim, Signer};

/// Leases renewed per backend round trip at most.
const RENEW_BATCH: usize = 500;
/// Below this, a lease capped by `max_hold_ms` is not renewed any more.
const MIN_RENEW_TTL: Duration = Duration::from_millis(10);

/// Retries of an acquire whose outcome is unknown (same lease id, so the
/// backend returns the same token if the first attempt went through).
const ACQUIRE_RETRIES: u32 = 2;

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("lock `{0}` is held by another lease")]
    Held(LockKey),
    #[error("the lease no longer holds lock `{0}`")]
    LeaseLost(LockKey),
    #[error("lock `{0}` is held by a different lease")]
    NotOwner(LockKey),
    #[error("this sidecar holds no lease on `{0}`")]
    NotFound(LockKey),
    #[error("this sidecar holds no lease on `{0}`; acquire it first")]
    NotHeld(LockKey),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("too many queued waiters (limit {0})")]
    TooManyWaiters(usize),
    #[error("too many leases held by this sidecar (limit {0})")]
    TooManyLeases(usize),
    #[error("the sidecar is shutting down")]
    ShuttingDown,
    #[error("could not register the new token at the gateway: {0}")]
    GatewayUnavailable(String),
    #[error("the gateway has already accepted token {highest} for `{key}`, above what the backend minted; retry")]
    TokenBehind { key: LockKey, highest: u64 },
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
    pub lost_retention: Duration,
}

pub struct LockManager {
    backend: DynBackend,
    pub(crate) leases: LeaseTable,
    waiters: Arc<WaitQueues>,
    signer: Signer,
    metrics: Arc<Metrics>,
    config: LockManagerConfig,
    shutdown: CancellationToken,
    preregister: Option<Preregistrar>,
    webhook: Option<Webhook>,
    /// Every lost lease, for hold streams.
    lost_tx: broadcast::Sender<Lost>,
}

enum Repair {
    Retry,
    Failed(LockError),
}

enum Try {
    Got(Box<LeaseRecord>),
    Held(Option<Duration>),
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
            leases,
            waiters,
            signer,
            metrics,
            config,
            shutdown,
            preregister,
            webhook,
            lost_tx: broadcast::channel(1024).0,
        }
    }

    pub fn backend(&self) -> &DynBackend {
        &self.backend
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Times one backend call and counts its failure.
    async fn call<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Result<T, BackendError>>,
    ) -> Result<T, BackendError> {
        let started = Instant::now();
        let result = fut.await;
        let name = self.backend.name();
        self.metrics
            .backend_duration
            .with_label_values(&[name, op])
            .observe(started.elapsed().as_secs_f64());
        if let Err(e) = &result {
            self.metrics
                .backend_errors
                .with_label_values(&[name, op])
                .inc();
            tracing::warn!(backend = name, op, error = %e, "backend request failed");
        }
        result
    }

    fn record_lost(&self, lost: impl IntoIterator<Item = Lost>) {
        for l in lost {
            let group = self.metrics.groups.of(l.key.as_str());
            self.metrics
                .lost_leases
                .with_label_values(&[group.as_str(), l.reason.as_str()])
                .inc();
            self.metrics
                .hold_time
                .with_label_values(&[group.as_str()])
                .observe(l.held_for.as_secs_f64());
            tracing::warn!(
                key = %l.key, token = l.token, lease_id = %l.lease_id,
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
            batch.push((rec.key, rec.lease_id, ttl));
        }
        if batch.is_empty() {
            return;
        }
        let sent = Instant::now();
        match self
            .call("renew_many", self.backend.renew_many(&batch))
            .await
        {
            Ok(results) => {
                for ((key, lease, ttl), result) in batch.into_iter().zip(results) {
                    let label = match result {
                        Ownership::Owned { .. } => {
                            match self.leases.renewed(&key, &lease, sent, ttl) {
                                Some(_) => {
                                    self.leases.schedule(&key, renew_at(sent, ttl));
                                    "renewed"
                                }
                                None => {
                                    self.record_lost(self.leases.mark_lost(
                                        &key,
                                        &lease,
                                        LostReason::Deadline,
                                    ));
                                    "lease_lost"
                                }
                            }
                        }
                        _ => {
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
            Err(_) => {
                // Retry soon, and in any case look again at the deadline.
                for (key, _, ttl) in &batch {
                    self.metrics.renewals.with_label_values(&["error"]).inc();
                    let retry =
                        (*ttl / 10).clamp(Duration::from_millis(10), Duration::from_millis(200));
                    self.leases.schedule(key, Instant::now() + retry);
                }
            }
        }
    }

    /// Notes application activity on `key` (keepalive of auto-renewed leases).
    pub fn touch(&self, key: &LockKey, lease: Option<&LeaseId>) -> bool {
        self.leases.touch(key, lease, Instant::now())
    }

    /// Acquires `req.key`, waiting up to `req.wait` in this sidecar's FIFO queue.
    pub async fn acquire(&self, req: Acquire) -> Result<LeaseView, LockError> {
        let started = Instant::now();
        let key = req.key.clone();
        let group = self.metrics.groups.of(key.as_str());
        let result = self.acquire_registered(&req, started, &group).await;
        let outcome = match &result {
            Ok(_) => "acquired",
            Err(LockError::Held(_)) => "timeout",
            Err(_) => "error",
        };
        self.metrics
            .acquisitions
            .with_label_values(&[group.as_str(), outcome])
            .inc();
        self.metrics
            .acquire_wait
            .with_label_values(&[group.as_str(), outcome])
            .observe(started.elapsed().as_secs_f64());
        match &result {
            // Per-operation lines are debug: at tens of thousands of
            // acquisitions per second an info line each would cost more CPU
            // than the lock itself. Failures and lost leases stay at info+.
            Ok(view) => tracing::debug!(
                key = %key, token = view.token, lease_id = %view.lease_id,
                wait_ms = started.elapsed().as_millis() as u64, "lock acquired"
            ),
            Err(e) => tracing::debug!(key = %key, error = %e, "lock not acquired"),
        }
        result
    }

    /// Acquires, then (if configured) registers the token at the gateway
    /// before anyone sees it, repairing forward once if the backend's
    /// counter turned out to be behind the gateway.
    async fn acquire_registered(
        &self,
        req: &Acquire,
        started: Instant,
        group: &str,
    ) -> Result<LeaseView, LockError> {
        let key = &req.key;
        let view = self.acquire_inner(req, started, group).await?;
        let Some(pre) = &self.preregister else {
            return Ok(view);
        };
        match self.preregister_or_repair(pre, key, &view).await {
            Ok(()) => Ok(view),
            Err(Repair::Failed(e)) => Err(e),
            Err(Repair::Retry) => {
                let view = self.acquire_inner(req, started, group).await?;
                match self.preregister_or_repair(pre, key, &view).await {
                    Ok(()) => Ok(view),
                    Err(Repair::Failed(e)) => Err(e),
                    Err(Repair::Retry) => Err(LockError::TokenBehind {
                        key: key.clone(),
                        highest: view.token,
                    }),
                }
            }
        }
    }

    /// Registers a fresh token at the gateway. A stale answer means the
    /// backend's counter is behind the gateway's mark (Redis lost it): the
    /// lease is released and the counter raised past the mark — repair
    /// forward, never reuse.
    async fn preregister_or_repair(
        &self,
        pre: &Preregistrar,
        key: &LockKey,
        view: &LeaseView,
    ) -> Result<(), Repair> {
        let lease = LeaseId::parse(&view.lease_id).expect("our own lease id");
        let outcome = pre.register(key, &view.fencing_token).await;
        let label = match &outcome {
            Ok(()) => "ok",
            Err(PreregisterError::Stale { .. }) => "stale",
            Err(PreregisterError::Failed(_)) => "error",
        };
        self.metrics
            .preregistrations
            .with_label_values(&[label])
            .inc();
        let err = match outcome {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        let _ = self.release(key.clone(), lease).await;
        match err {
            PreregisterError::Stale { highest } => {
                tracing::warn!(key = %key, token = view.token, highest_seen = highest,
                    "backend token behind the gateway; raising the counter");
                match self
                    .call("raise_floor", self.backend.raise_token_floor(key, highest))
                    .await
                {
                    Ok(()) => Err(Repair::Retry),
                    Err(e) => Err(Repair::Failed(e.into())),
                }
            }
            PreregisterError::Failed(msg) => {
                tracing::warn!(key = %key, error = %msg, "token pre-registration failed; lease released");
                Err(Repair::Failed(LockError::GatewayUnavailable(msg)))
            }
        }
    }

    async fn acquire_inner(
        &self,
        req: &Acquire,
        started: Instant,
        group: &str,
    ) -> Result<LeaseView, LockError> {
        let (key, ttl, wait) = (&req.key, req.ttl, req.wait);
        if self.shutdown.is_cancelled() {
            return Err(LockError::ShuttingDown);
        }
        if self.leases.len() >= self.config.max_leases {
            return Err(LockError::TooManyLeases(self.config.max_leases));
        }
        let lease = LeaseId::generate();
        let deadline = started + wait;

        // Fast path: nobody here is waiting, so trying first is fair.
        if !self.waiters.has_waiters(key.as_str()) {
            match self.try_once(req, &lease, group).await? {
                Try::Got(rec) => return Ok(rec.view(Instant::now())),
                Try::Held(_) if wait.is_zero() => return Err(LockError::Held(key.clone())),
                Try::Held(_) => {}
            }
        } else if wait.is_zero() {
            // Others are queued ahead of us: a try-lock does not jump them.
            return Err(LockError::Held(key.clone()));
        }

        let ticket = self
            .waiters
            .enqueue(key.as_str())
            .map_err(|e| LockError::TooManyWaiters(e.0))?;
        let gauge = self.metrics.waiters.with_label_values(&[group]);
        gauge.inc();
        let _gauge_guard = crate::proxy::server::OnDrop::new(move || gauge.dec());
        // Subscribe before the first try under the queue, so a release
        // between that try and our sleep cannot be missed.
        let _watch = self.backend.watch(key).await;

        let mut must_try = ticket.is_head();
        let mut recheck_at: Option<Instant> = None;
        loop {
            if must_try {
                match self.try_once(req, &lease, group).await? {
                    Try::Got(rec) => {
                        ticket.acquired(ttl);
                        return Ok(rec.view(Instant::now()));
                    }
                    Try::Held(remaining) => {
                        recheck_at = Some(Instant::now() + self.fallback_delay(remaining));
                    }
                }
            }
            must_try = false;
            let sleep_until = recheck_at.map_or(deadline, |r| r.min(deadline));
            tokio::select! {
                wake = ticket.woken() => {
                    self.metrics.waiter_wakeups.with_label_values(&[wake.cause()]).inc();
                    match wake {
                        Wake::PromotedBehindHolder(holder_ttl) => {
                            recheck_at = Some(Instant::now() + self.fallback_delay(Some(holder_ttl)));
                        }
                        _ => must_try = true,
                    }
                }
                _ = tokio::time::sleep_until(sleep_until) => {
                    if Instant::now() >= deadline {
                        return Err(LockError::Held(key.clone()));
                    }
                    // The holder's TTL ran out without a release message
                    // (expiry publishes nothing): the one polling path.
                    self.metrics.waiter_wakeups.with_label_values(&["fallback"]).inc();
                    recheck_at = None;
                    must_try = ticket.is_head();
                }
                _ = self.shutdown.cancelled() => return Err(LockError::ShuttingDown),
            }
        }
    }

    /// When to re-check a lock held for `remaining`: just after it would
    /// expire, with jitter so sidecars do not re-check in lockstep.
    fn fallback_delay(&self, remaining: Option<Duration>) -> Duration {
        let base = remaining.unwrap_or(self.config.max_fallback);
        let jitter_cap = (base / 10).clamp(Duration::from_millis(1), Duration::from_millis(50));
        let jitter = rand::rng().random_range(Duration::ZERO..=jitter_cap);
        (base + Duration::from_millis(1) + jitter)
            .clamp(Duration::from_millis(5), self.config.max_fallback)
    }

    /// One acquisition attempt, retried with the same lease id when the
    /// outcome is unknown.
    async fn try_once(
        &self,
        req: &Acquire,
        lease: &LeaseId,
        group: &str,
    ) -> Result<Try, LockError> {
        let (key, ttl) = (&req.key, req.ttl);
        // The deadline counts from the FIRST send: a retry may return the
        // lock set by the first attempt, whose TTL started then.
        let first_sent = Instant::now();
        let mut attempt = 0;
        loop {
            match self
                .call("acquire", self.backend.try_acquire(key, lease, ttl))
                .await
            {
                Ok(Attempt::Acquired { token }) => {
                    let record = self.hold(
                        key,
                        group,
                        lease,
                        token,
                        req.owner.clone(),
                        ttl,
                        first_sent,
                        req.renewal,
                    );
                    return Ok(Try::Got(Box::new(record)));
                }
                Ok(Attempt::Held { remaining }) => return Ok(Try::Held(remaining)),
                Err(BackendError::Unavailable(_)) if attempt < ACQUIRE_RETRIES => {
                    attempt += 1;
                    self.metrics
                        .acquire_retries
                        .with_label_values(&[self.backend.name()])
                        .inc();
                    tokio::time::sleep(Duration::from_millis(5 * u64::from(attempt))).await;
                }
                Err(e) => {
                    // The script may have run: make sure a lock nobody will
                    // use is not left behind until its TTL.
                    let backend = self.backend.clone();
                    let (key, lease) = (key.clone(), lease.clone());
                    tokio::spawn(async move {
                        let _ = backend.release(&key, &lease).await;
                    });
                    return Err(e.into());
                }
            }
        }
    }

    /// Records a lease the backend just confirmed (request sent at `sent`),
    /// with its signed token, and counts it as held.
    #[allow(clippy::too_many_arguments)]
    fn hold(
        &self,
        key: &LockKey,
        group: &str,
        lease: &LeaseId,
        token: u64,
        owner: Option<String>,
        ttl: Duration,
        sent: Instant,
        renewal: Renewal,
    ) -> LeaseRecord {
        let now = Instant::now();
        let record = LeaseRecord {
            key: key.clone(),
            lease_id: lease.clone(),
            token,
            fencing_token: self.signer.sign(&Claim {
                key: key.as_str().to_owned(),
                token,
                lease_id: lease.as_str().to_owned(),
            }),
            owner,
            ttl,
            acquired_at: now,
            deadline: self.leases.deadline(sent, ttl),
            state: LeaseState::Held,
            renewal,
            last_activity: now,
            max_until: self.config.max_hold.map(|m| now + m),
            writes: Default::default(),
        };
        if renewal != Renewal::Manual {
            self.leases.schedule(key, renew_at(sent, ttl));
        }
        if let Some(old) = self.leases.insert(record.clone()) {
            // The backend gave the key to us again: the old lease is gone.
            self.record_lost([Lost::of(&old, LostReason::Backend, Instant::now())]);
        }
        self.metrics.leases_held.with_label_values(&[group]).inc();
        record
    }

    /// Classifies a failed compare-and-set for `lease` on `key`.
    fn not_held(&self, key: &LockKey, known: bool, found: Ownership) -> LockError {
        match found {
            Ownership::OtherHolder if !known => LockError::NotOwner(key.clone()),
            _ => LockError::LeaseLost(key.clone()),
        }
    }

    pub async fn renew(
        &self,
        key: LockKey,
        lease: LeaseId,
        ttl: Duration,
    ) -> Result<LeaseView, LockError> {
        let now = Instant::now();
        let (record, lost) = self.leases.get(&key, now);
        self.record_lost(lost);
        let known = self.leases.knows(&key, &lease);
        let result = match record {
            Some(rec) if rec.lease_id == lease && !rec.is_held() => {
                // Lost here means lost: a renewal never revives it.
                Err(LockError::LeaseLost(key.clone()))
            }
            _ => {
                let sent = Instant::now();
                match self
                    .call("renew", self.backend.renew(&key, &lease, ttl))
                    .await?
                {
                    Ownership::Owned { token } => {
                        match self.leases.renewed(&key, &lease, sent, ttl) {
                            Some(rec) => Ok(rec.view(Instant::now())),
                            None if known => {
                                // The reply came after our deadline.
                                self.record_lost(self.leases.mark_lost(
                                    &key,
                                    &lease,
                                    LostReason::Deadline,
                                ));
                                Err(LockError::LeaseLost(key.clone()))
                            }
                            None => Ok(self.adopt(&key, &lease, token, ttl, sent)),
                        }
                    }
                    other => {
                        self.record_lost(self.leases.mark_lost(&key, &lease, LostReason::Backend));
                        Err(self.not_held(&key, known, other))
                    }
                }
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

    /// A renewal of a lease this sidecar has no record of (e.g. it restarted
    /// while the application kept its lease): the backend confirmed the
    /// lease, so track it again.
    fn adopt(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        token: u64,
        ttl: Duration,
        sent: Instant,
    ) -> LeaseView {
        let group = self.metrics.groups.of(key.as_str());
        let record = self.hold(key, &group, lease, token, None, ttl, sent, Renewal::Manual);
        tracing::info!(key = %key, token, lease_id = %lease, "lease adopted on renewal");
        record.view(Instant::now())
    }

    pub async fn release(&self, key: LockKey, lease: LeaseId) -> Result<(), LockError> {
        let lost = self.leases.refresh(&key, Instant::now());
        self.record_lost(lost);
        let known = self.leases.knows(&key, &lease);
        let result = self
            .call("release", self.backend.release(&key, &lease))
            .await;
        let result = match result {
            Ok(Ownership::Owned { .. }) => Ok(()),
            Ok(other) => Err(self.not_held(&key, known, other)),
            Err(e) => Err(e.into()),
        };
        // On a backend error the lease may still hold: keep it so the
        // application can retry the release.
        if !matches!(result, Err(LockError::Backend(_))) {
            if let Some(rec) = self.leases.remove(&key, &lease) {
                if rec.is_held() {
                    let group = self.metrics.groups.of(key.as_str());
                    self.metrics
                        .leases_held
                        .with_label_values(&[group.as_str()])
                        .dec();
                    self.metrics
                        .hold_time
                        .with_label_values(&[group.as_str()])
                        .observe(rec.acquired_at.elapsed().as_secs_f64());
                }
            }
        }
        let label = match &result {
            Ok(_) => "released",
            Err(LockError::LeaseLost(_)) => "lease_lost",
            Err(LockError::NotOwner(_)) => "not_owner",
            Err(_) => "error",
        };
        self.metrics.releases.with_label_values(&[label]).inc();
        if result.is_ok() {
            tracing::debug!(key = %key, lease_id = %lease, "lock released");
        }
        result
    }

    pub fn get(&self, key: &LockKey) -> Result<LeaseView, LockError> {
        let now = Instant::now();
        let (record, lost) = self.leases.get(key, now);
        self.record_lost(lost);
        record
            .map(|r| r.view(now))
            .ok_or_else(|| LockError::NotFound(key.clone()))
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
            if &record.lease_id != l {
                // Computed under another lease: refuse even though the app
                // holds the key again now.
                return Err(LockError::LeaseLost(key.clone()));
            }
        }
        if !record.is_held() {
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
        let (lost, held) = self
            .leases
            .sweep(Instant::now(), self.config.lost_retention);
        self.record_lost(lost);
        let mut per_group: std::collections::HashMap<String, i64> =
            std::collections::HashMap::new();
        for key in &held {
            *per_group
                .entry(self.metrics.groups.of(key.as_str()))
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

    /// Releases every held lease (shutdown), each bounded by the backend
    /// timeout, all together bounded by `limit`.
    pub async fn release_all(&self, limit: Duration) -> (usize, usize) {
        let held = self.leases.drain_held();
        let total = held.len();
        let released = std::sync::atomic::AtomicUsize::new(0);
        let releases = futures_util::stream::iter(held)
            .map(|rec| {
                let backend = self.backend.clone();
                async move { backend.release(&rec.key, &rec.lease_id).await.is_ok() }
            })
            .buffer_unordered(256)
            .for_each(|ok| {
                if ok {
                    released.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                std::future::ready(())
            });
        let _ = tokio::time::timeout(limit, releases).await;
        let released = released.into_inner();
        self.metrics.leases_held.reset();
        (released, total)
    }
}

/// One acquisition request.
pub struct Acquire {
    pub key: LockKey,
    pub ttl: Duration,
    pub wait: Duration,
    pub owner: Option<String>,
    pub renewal: Renewal,
}

/// When a sidecar-renewed lease whose request was sent at `sent` is next
/// renewed: after a third of its TTL (jittered), leaving two more tries
/// before the lease could run out.
fn renew_at(sent: Instant, ttl: Duration) -> Instant {
    let third = ttl / 3;
    let jitter = rand::rng().random_range(Duration::ZERO..=third / 10);
    sent + third - jitter
}
