//! Acquiring a lock: the fast path, the per-key FIFO queue, pre-registration
//! at the gateway, and what a cancelled acquire leaves behind.
//!
//! An acquire's future belongs to its HTTP request, and hyper drops it the
//! moment the client goes away — between two backend calls, during one, or
//! while the new token is being pre-registered. Whatever the acquire may
//! have taken by then (a lock granted to a lease id nobody will ever see, a
//! lease recorded and renewed for a hold stream that never started) must be
//! given back (issue 9 item 6, issue 10 item 4). [`Attempts`] keeps that
//! account: every lease id that may hold the key and the backend call still
//! running. Backend calls run in tasks of their own, so dropping the acquire
//! never cuts one in half; when the acquire ends without handing a lease to
//! its caller, a clean-up task waits for the running call and releases
//! every lease id that may hold the key.
//!
//! Each attempt under the queue uses a fresh lease id. Only a retry after an
//! *unknown* outcome reuses the id (so the backend answers with the token it
//! may already have granted), and then the lease's deadline counts from the
//! first send of that id — the earliest moment the backend can have started
//! the lease (issue 10 item 1).

use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::super::leases::{
    LeaseRecord, LeaseState, LeaseTable, LeaseView, Lost, LostReason, Renewal,
};
use super::super::preregister::{PreregisterError, Preregistrar};
use super::super::waiters::Wake;
use super::{LockError, LockManager};
use crate::lock::{Attempt, BackendError, DynBackend, LeaseId, LockKey, WatchGuard};
use crate::metrics::Metrics;
use crate::token::Claim;

/// Retries of an acquire whose outcome is unknown (same lease id, so the
/// backend returns the same token if the first attempt went through).
const ACQUIRE_RETRIES: u32 = 2;

/// A queued waiter whose try failed (backend unavailable) tries again
/// after this, doubling up to [`OUTAGE_MAX_PAUSE`].
const OUTAGE_FIRST_PAUSE: Duration = Duration::from_millis(20);
const OUTAGE_MAX_PAUSE: Duration = Duration::from_millis(500);

/// One acquisition request.
#[derive(Clone)]
pub struct Acquire {
    pub key: LockKey,
    pub ttl: Duration,
    pub wait: Duration,
    pub owner: Option<String>,
    pub renewal: Renewal,
    /// The Dapr lock store the lease is taken through, if any: only that
    /// store's `unlock` may release it by owner.
    pub dapr_store: Option<String>,
    /// The owner may take the key again while it holds it ([`super::reentrant`]).
    pub reentrant: bool,
}

enum Repair {
    Retry,
    Failed(LockError),
}

enum Try {
    Got(Box<LeaseRecord>),
    /// Not taken: how long the backend said it stays so, and whether that
    /// is a lock-delay (nobody holds the key) rather than a holder.
    Held(Option<Duration>, Delay),
}

/// Whether a "not taken" was a lock-delay, and when it ends.
#[derive(Clone, Copy, Default)]
struct Delay(Option<Instant>);

impl Delay {
    /// The answer to an acquire that gives up on this: `lock_delayed` with
    /// the time left while the delay lasts, else `lock_held`.
    fn gave_up(self, key: &LockKey) -> LockError {
        let now = Instant::now();
        match self.0 {
            Some(until) if until > now => LockError::Delayed {
                key: key.clone(),
                retry_after: until - now,
            },
            _ => LockError::Held(key.clone()),
        }
    }
}

/// The lease ids one acquire tried that may hold its key, and its backend
/// call in flight. Owned by the acquire's future; when dropped, every such
/// lease except the one handed to the caller is released by a task of its
/// own, after the call in flight has ended (see the module comment).
struct Attempts {
    backend: DynBackend,
    leases: Arc<LeaseTable>,
    metrics: Arc<Metrics>,
    key: LockKey,
    maybe_held: Vec<LeaseId>,
    pending: Option<JoinHandle<Result<Attempt, BackendError>>>,
    granted: Option<LeaseId>,
    /// The lease id of the last try (for the `fresh_send_time` mutant).
    last: Option<LeaseId>,
    /// How long the holder the last try found keeps the key, if known.
    held_for: Option<Duration>,
}

impl Attempts {
    /// Runs one backend acquire in its own task and waits for it. If this
    /// future is dropped meanwhile, the task runs on and the clean-up waits
    /// for it.
    async fn try_acquire(
        &mut self,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Attempt, BackendError> {
        let (backend, key, l) = (self.backend.clone(), self.key.clone(), lease.clone());
        let metrics = self.metrics.clone();
        self.pending = Some(tokio::spawn(async move {
            super::timed_call(
                &backend,
                &metrics,
                "acquire",
                backend.try_acquire(&key, &l, ttl),
            )
            .await
        }));
        let handle = self.pending.as_mut().expect("just set");
        let result = handle.await;
        self.pending = None;
        result.unwrap_or_else(|e| Err(BackendError::Unavailable(format!("acquire task: {e}"))))
    }

    /// `lease` was answered "held by another": it never held the key.
    fn not_taken(&mut self, lease: &LeaseId) {
        self.maybe_held.retain(|l| l != lease);
    }
}

impl Drop for Attempts {
    fn drop(&mut self) {
        let granted = self.granted.take();
        let orphans: Vec<LeaseId> = self
            .maybe_held
            .drain(..)
            .filter(|l| Some(l) != granted.as_ref())
            .collect();
        if (orphans.is_empty() && self.pending.is_none()) || crate::mutants::active("keep_orphans")
        {
            return;
        }
        // An acquire dropped after the grant (its client went away during
        // pre-registration) has already recorded its lease as held: it
        // stops being held here now, before the backend is told, or a
        // `GET` would answer "held" after the backend let another sidecar
        // take the key (found by the model, docs/model.md).
        for lease in &orphans {
            super::release::stop_holding(&self.leases, &self.metrics, &self.key, lease);
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(super::release::release_orphans(
            self.backend.clone(),
            self.leases.clone(),
            self.metrics.clone(),
            self.key.clone(),
            orphans,
            self.pending.take(),
            true,
        ));
    }
}

impl LockManager {
    /// Acquires `req.key`, waiting up to `req.wait` in this sidecar's FIFO queue.
    pub async fn acquire(&self, req: Acquire) -> Result<LeaseView, LockError> {
        self.acquire_counted(req, true).await.0
    }

    /// [`Self::acquire`], counted in `fencer_acquisitions_total` or not (a
    /// semaphore's slot tries are counted as the semaphore's), and with
    /// how long the holder its last try found keeps the key, if known.
    pub(super) async fn acquire_counted(
        &self,
        mut req: Acquire,
        count: bool,
    ) -> (Result<LeaseView, LockError>, Option<Duration>) {
        let started = Instant::now();
        if let Err(e) = self.check_ttl(req.ttl) {
            return (Err(e), None);
        }
        if let Some(cap) = self.config.max_hold {
            // max_hold_ms caps the first TTL as well as every renewal.
            req.ttl = req.ttl.min(cap);
        }
        let key = req.key.clone();
        let group = self.metrics.group(key.as_str());
        if req.reentrant {
            if let Err(e) = self.check_reentrancy() {
                return (Err(e), None);
            }
            if let Some(result) = self.reenter(&req).await {
                self.count_acquire(&key, &group, started, &result);
                return (result, None);
            }
        }
        let mut attempts = Attempts {
            backend: self.backend.clone(),
            leases: self.leases.clone(),
            metrics: self.metrics.clone(),
            key: key.clone(),
            maybe_held: Vec::new(),
            pending: None,
            granted: None,
            last: None,
            held_for: None,
        };
        let mut result = self
            .acquire_registered(&req, &mut attempts, started, &group)
            .await;
        if let (Ok(view), Some(owner)) = (&result, req.owner.as_deref()) {
            if req.reentrant {
                // Before the lease is handed over: a client gone meanwhile
                // leaves it to `attempts`, which releases it.
                self.first_hold(&key, &view.lease_id, owner).await;
            }
        }
        result = result.and_then(|view| self.held_at_answer(&key, &view.lease_id, started));
        if let Ok(view) = &result {
            attempts.granted = LeaseId::parse(&view.lease_id);
        }
        let held_for = attempts.held_for;
        drop(attempts);
        if count {
            self.count_acquire(&key, &group, started, &result);
        }
        (result, held_for)
    }

    /// Counts and logs one acquire's outcome.
    fn count_acquire(
        &self,
        key: &LockKey,
        group: &str,
        started: Instant,
        result: &Result<LeaseView, LockError>,
    ) {
        let outcome = match result {
            Ok(_) => "acquired",
            Err(LockError::Held(_)) => "timeout",
            Err(LockError::Delayed { .. }) => "delayed",
            Err(_) => "error",
        };
        self.metrics
            .acquisitions
            .with_label_values(&[group, outcome])
            .inc();
        if key.is_reader() {
            self.metrics
                .read_acquisitions
                .with_label_values(&[outcome])
                .inc();
        }
        self.metrics
            .acquire_wait
            .with_label_values(&[group, outcome])
            .observe(started.elapsed().as_secs_f64());
        match result {
            // Per-operation lines are debug: at tens of thousands of
            // acquisitions per second an info line each would cost more CPU
            // than the lock itself. Failures and lost leases stay at info+.
            Ok(view) => tracing::debug!(
                key = %key, token = view.token,
                wait_ms = started.elapsed().as_millis() as u64, "lock acquired"
            ),
            Err(e) => tracing::debug!(key = %key, error = %e, "lock not acquired"),
        }
    }

    /// The lease as it stands at the moment of the answer, or an error if
    /// it ran out before it (PITFALLS 12, issue 26 item 2): a slow
    /// pre-registration, a slow backend or a frozen process can spend the
    /// whole TTL between the grant and the answer, and a "held" answer with
    /// the requested TTL would then make two holders of a client that uses
    /// the lock for mutual exclusion alone. The view's times are taken now,
    /// so the client is told the time left, not the time it asked for. A
    /// lease that ran out is reported lost here (counted, logged) and
    /// released by the acquire's clean-up (it is not handed over).
    fn held_at_answer(
        &self,
        key: &LockKey,
        lease_id: &str,
        started: Instant,
    ) -> Result<LeaseView, LockError> {
        let now = Instant::now();
        let (record, lost) = self.leases.get(key, now);
        self.record_lost(lost);
        match record {
            Some(r) if r.lease_id.as_str() == lease_id && r.is_held() => Ok(r.view(now)),
            Some(r)
                if r.lease_id.as_str() == lease_id
                    && crate::mutants::active("answer_after_deadline") =>
            {
                // Mutant: answer "held" with the full TTL, as before issue 26.
                let mut view = r.view(now);
                view.remaining_ms = view.ttl_ms;
                Ok(view)
            }
            _ => {
                let took = now.saturating_duration_since(started);
                tracing::warn!(key = %key, took_ms = took.as_millis() as u64,
                    "lease ran out before the acquire could answer; not handed over");
                self.metrics.acquire_expired_before_answer.inc();
                Err(LockError::ExpiredBeforeAnswer {
                    key: key.clone(),
                    took,
                })
            }
        }
    }

    /// Acquires, then (if configured) registers the token at the gateway
    /// before anyone sees it, repairing forward once if the backend's
    /// counter turned out to be behind the gateway.
    async fn acquire_registered(
        &self,
        req: &Acquire,
        attempts: &mut Attempts,
        started: Instant,
        group: &str,
    ) -> Result<LeaseView, LockError> {
        let key = &req.key;
        let view = self.acquire_inner(req, attempts, started, group).await?;
        let Some(pre) = &self.preregister else {
            return Ok(view);
        };
        match self.preregister_or_repair(pre, key, &view, attempts).await {
            Ok(()) => Ok(view),
            Err(Repair::Failed(e)) => Err(e),
            Err(Repair::Retry) => {
                let view = self.acquire_inner(req, attempts, started, group).await?;
                match self.preregister_or_repair(pre, key, &view, attempts).await {
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
        attempts: &mut Attempts,
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
            Err(PreregisterError::Stale { .. }) if crate::mutants::active("no_repair") => {
                return Ok(());
            }
            Err(e) => e,
        };
        if self.release(key.clone(), lease.clone()).await.is_ok() {
            attempts.not_taken(&lease);
        }
        match err {
            PreregisterError::Stale { highest }
                if highest.saturating_sub(view.token) > crate::token::TOKEN_JUMP =>
            {
                // Raising the counter that far would leave every later
                // token near 2^63 (and overflow soon): an operator decides.
                tracing::error!(key = %key, token = view.token, highest_seen = highest,
                    "the gateway's mark is far above the backend's token; not repairing");
                Err(Repair::Failed(LockError::TokenJump {
                    key: key.clone(),
                    highest,
                    token: view.token,
                }))
            }
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
        attempts: &mut Attempts,
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
        let deadline = started + wait;

        // Fast path: nobody here is waiting, so trying first is fair.
        if !self.waiters.has_waiters(key.as_str()) {
            match self.try_once(req, attempts, group).await? {
                Try::Got(rec) => return Ok(rec.view(Instant::now())),
                Try::Held(_, delay) if wait.is_zero() => return Err(delay.gave_up(key)),
                Try::Held(..) => {}
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
        let _gauge_guard = crate::http::server::OnDrop::new(move || gauge.dec());
        // Subscribe before the first try under the queue, so a release
        // between that try and our sleep cannot be missed. Bounded by the
        // wait: a half-open notification connection must not hold a waiter
        // past its wait_ms (issue 9 item 5).
        let watch_until = if crate::mutants::active("subscribe_without_timeout") {
            deadline + Duration::from_secs(86_400)
        } else {
            deadline
        };
        let watch = |until: Instant| async move {
            tokio::time::timeout_at(
                until,
                self.backend
                    .watch(key, deadline.saturating_duration_since(Instant::now())),
            )
            .await
            .unwrap_or_else(|_| WatchGuard::none())
        };
        let mut watching = watch(watch_until).await;

        let mut must_try = ticket.is_head();
        let mut recheck_at: Option<Instant> = None;
        // A queued waiter keeps its place through a backend outage shorter
        // than its wait (a failover, a slot moving): the try that failed is
        // repeated with backoff, and only a wait that ends on a failed try
        // answers with that failure (it does not know the key is held).
        let mut outage: Option<(LockError, Duration)> = None;
        // What the last try found, for the answer if the wait ends on it.
        let mut delay = Delay::default();
        let gave_up = |outage: Option<(LockError, Duration)>, delay: Delay| match outage {
            Some((e, _)) => e,
            None => delay.gave_up(key),
        };
        loop {
            if must_try {
                if Instant::now() >= deadline {
                    return Err(gave_up(outage, delay));
                }
                match self.try_once(req, attempts, group).await {
                    Ok(Try::Got(rec)) => {
                        if key.is_reader() {
                            // Readers share: the next waiter tries now (a
                            // reader gets in beside this one, a writer
                            // finds it and waits for its release).
                            drop(ticket);
                        } else {
                            ticket.acquired(ttl);
                        }
                        return Ok(rec.view(Instant::now()));
                    }
                    Ok(Try::Held(remaining, found)) => {
                        outage = None;
                        delay = found;
                        recheck_at = Some(Instant::now() + self.fallback_delay(remaining));
                        // Nothing watched yet (on MySQL: the key was held
                        // here, or without a bell, when this waiter queued):
                        // the holder found now may be one to watch — else a
                        // release elsewhere is seen only at the holder's
                        // expiry, past a shorter wait.
                        if watching.is_none() {
                            // Never past the re-check it would delay.
                            let until = recheck_at.map_or(watch_until, |r| r.min(watch_until));
                            watching = watch(until).await;
                        }
                    }
                    Err(e @ LockError::Backend(BackendError::Unavailable(_))) => {
                        let pause = outage
                            .as_ref()
                            .map_or(OUTAGE_FIRST_PAUSE, |(_, p)| (*p * 2).min(OUTAGE_MAX_PAUSE));
                        tracing::warn!(key = %key, error = %e, retry_in_ms = pause.as_millis() as u64,
                            "backend unavailable while waiting; the waiter keeps its place and tries again");
                        recheck_at = Some(Instant::now() + pause);
                        outage = Some((e, pause));
                    }
                    Err(e) => return Err(e),
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
                        return Err(gave_up(outage, delay));
                    }
                    // The holder's TTL ran out without a release message
                    // (expiry publishes nothing): the one polling path. Or
                    // the pause after a failed try is over.
                    let cause = if outage.is_some() { "backend_error" } else { "fallback" };
                    self.metrics.waiter_wakeups.with_label_values(&[cause]).inc();
                    recheck_at = None;
                    must_try = ticket.is_head() || outage.is_some();
                }
                _ = self.shutdown.cancelled() => return Err(LockError::ShuttingDown),
            }
        }
    }

    /// When to re-check a lock held for `remaining`: just after it would
    /// expire, with jitter so sidecars do not re-check in lockstep.
    pub(super) fn fallback_delay(&self, remaining: Option<Duration>) -> Duration {
        let base = remaining.unwrap_or(self.config.max_fallback);
        let jitter_cap = (base / 10).clamp(Duration::from_millis(1), Duration::from_millis(50));
        let jitter = rand::rng().random_range(Duration::ZERO..=jitter_cap);
        (base + Duration::from_millis(1) + jitter)
            .clamp(Duration::from_millis(5), self.config.max_fallback)
    }

    /// One acquisition attempt with a fresh lease id, retried with that id
    /// when the outcome is unknown.
    async fn try_once(
        &self,
        req: &Acquire,
        attempts: &mut Attempts,
        group: &str,
    ) -> Result<Try, LockError> {
        let (key, ttl) = (&req.key, req.ttl);
        // Mutant: one lease id for every try of the acquire (and, below, a
        // send time per retry), as before issue 10.
        let reused = crate::mutants::active("fresh_send_time")
            .then(|| {
                attempts
                    .maybe_held
                    .last()
                    .cloned()
                    .or_else(|| attempts.last.clone())
            })
            .flatten();
        let lease = reused.unwrap_or_else(LeaseId::generate);
        attempts.last = Some(lease.clone());
        attempts.maybe_held.push(lease.clone());
        // The deadline counts from the FIRST send of this lease id: a retry
        // may return the lock set by the first attempt, whose TTL started
        // then.
        let mut first_sent = Instant::now();
        let mut attempt = 0;
        loop {
            if crate::mutants::active("fresh_send_time") {
                first_sent = Instant::now();
            }
            match attempts.try_acquire(&lease, ttl).await {
                Ok(Attempt::Acquired { token }) => {
                    let record = self.hold(
                        key,
                        group,
                        &lease,
                        token,
                        req.owner.clone(),
                        ttl,
                        first_sent,
                        req.renewal,
                        req.dapr_store.clone(),
                    );
                    return Ok(Try::Got(Box::new(record)));
                }
                Ok(not_taken @ (Attempt::Held { .. } | Attempt::Delayed { .. })) => {
                    attempts.held_for = not_taken.remaining();
                    if attempt == 0 && !self.backend.held_keeps_a_place() {
                        attempts.not_taken(&lease);
                    }
                    let delay = match not_taken {
                        Attempt::Delayed { remaining } => {
                            tracing::debug!(key = %key, retry_after_ms = remaining.as_millis() as u64,
                                "key in lock-delay: its last lease expired without a release");
                            Delay(Some(Instant::now() + remaining))
                        }
                        _ => Delay(None),
                    };
                    return Ok(Try::Held(not_taken.remaining(), delay));
                }
                Err(BackendError::Unavailable(_)) if attempt < ACQUIRE_RETRIES => {
                    attempt += 1;
                    self.metrics
                        .acquire_retries
                        .with_label_values(&[self.backend.name()])
                        .inc();
                    tokio::time::sleep(Duration::from_millis(5 * u64::from(attempt))).await;
                }
                // The lease stays in `attempts`: it is released when the
                // acquire gives up, after any call still running.
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Records a lease the backend just confirmed (request sent at `sent`),
    /// with its signed token, and counts it as held.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn hold(
        &self,
        key: &LockKey,
        group: &str,
        lease: &LeaseId,
        token: u64,
        owner: Option<String>,
        ttl: Duration,
        sent: Instant,
        renewal: Renewal,
        dapr_store: Option<String>,
    ) -> LeaseRecord {
        let now = Instant::now();
        let record = LeaseRecord {
            key: key.clone(),
            lease_id: lease.clone(),
            token,
            fencing_token: self.signer.sign(&Claim::with_mode(
                key.as_str(),
                token,
                lease.as_str(),
                key.mode(),
            )),
            owner,
            ttl,
            acquired_at: now,
            deadline: self.leases.deadline(sent, ttl),
            state: LeaseState::Held,
            renewal,
            dapr_store,
            last_activity: now,
            max_until: self.config.max_hold.map(|m| sent + m),
            writes: Default::default(),
            renewing: Default::default(),
            ttl_floor: None,
            holds: Default::default(),
            holds_turn: Default::default(),
            group: None,
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
}

/// When a sidecar-renewed lease whose request was sent at `sent` is next
/// renewed: after a third of its TTL (jittered), leaving two more tries
/// before the lease could run out.
pub(super) fn renew_at(sent: Instant, ttl: Duration) -> Instant {
    let third = ttl / 3;
    let jitter = rand::rng().random_range(Duration::ZERO..=third / 10);
    sent + third - jitter
}
