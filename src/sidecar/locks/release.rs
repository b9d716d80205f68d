//! Releasing locks: the application's release, shutdown, and the leases
//! nobody owns (a cancelled acquire's, a lease whose renewal reply came too
//! late).

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::super::leases::LeaseTable;
use super::super::waiters::WaitQueues;
use super::{LockError, LockManager};
use crate::lock::{Attempt, BackendError, DynBackend, LeaseId, LockKey, Ownership};
use crate::metrics::Metrics;

/// Attempts per orphan release (each bounded by the backend's timeout).
const ORPHAN_RELEASE_ATTEMPTS: u32 = 3;

impl LockManager {
    /// Releases `lease` of `key`.
    ///
    /// The local record goes first, before the backend is told (PITFALLS
    /// 12, issue 26 item 3): from then on the proxy refuses writes under the
    /// lease and no view says "held", whatever happens to this call. The
    /// backend call runs in a task of its own, so a client that disconnects
    /// mid-release cannot cut it short; if it fails, the task keeps trying
    /// in the background (the lease may still hold the key there) while the
    /// caller is told the outcome is unknown.
    pub async fn release(&self, key: LockKey, lease: LeaseId) -> Result<(), LockError> {
        let lost = self.leases.refresh(&key, Instant::now());
        self.record_lost(lost);
        let known = self.leases.knows(&key, &lease);
        let mut was_held = false;
        if !crate::mutants::active("release_in_request") {
            if let Some(rec) = self.leases.releasing(&key, &lease) {
                count_end_of_hold(&self.metrics, &rec);
                was_held = true;
            }
        }
        // A waiter here may try while the release is on its way.
        let early =
            (was_held && self.backend.orders_calls() && self.waiters.has_waiters(key.as_str()))
                .then(|| self.waiters.clone());
        let (first_tx, first_rx) = tokio::sync::oneshot::channel();
        let task = release_task(
            self.backend.clone(),
            self.leases.clone(),
            self.metrics.clone(),
            key.clone(),
            lease.clone(),
            first_tx,
            early,
        );
        if crate::mutants::active("release_in_request") {
            // Mutant: the release lives in the request's future and the
            // record stays "held" until the backend answered, as before
            // issue 26.
            task.await;
        } else {
            tokio::spawn(task);
        }
        let result = match first_rx.await {
            Ok(Ok(Ownership::Owned { .. })) => Ok(()),
            Ok(Ok(other)) => Err(self.not_held(&key, known, other)),
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Err(LockError::Backend(BackendError::Unavailable(
                "release task ended without an answer".into(),
            ))),
        };
        let label = match &result {
            Ok(_) => "released",
            Err(LockError::LeaseLost(_)) => "lease_lost",
            Err(LockError::NotOwner(_)) => "not_owner",
            Err(_) => "error",
        };
        self.metrics.releases.with_label_values(&[label]).inc();
        if result.is_ok() {
            tracing::debug!(key = %key, lease_tag = %lease.tag(), "lock released");
        }
        result
    }

    /// Releases `lease` in the backend from a task of its own, for a lease
    /// that is lost here but may still hold the key there (a renewal reply
    /// that came after the local deadline): otherwise the key would stay
    /// taken by nobody for a full TTL.
    pub(super) fn release_in_background(&self, key: &LockKey, lease: &LeaseId) {
        tokio::spawn(release_orphans(
            self.backend.clone(),
            self.leases.clone(),
            self.metrics.clone(),
            key.clone(),
            vec![lease.clone()],
            None,
            false,
        ));
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

/// Removes `lease`'s record of `key` from the table, keeping the gauges
/// right.
fn forget(leases: &LeaseTable, metrics: &Metrics, key: &LockKey, lease: &LeaseId) {
    if let Some(rec) = leases.remove(key, lease) {
        if rec.is_held() {
            count_end_of_hold(metrics, &rec);
        }
    }
}

/// Marks `lease`'s record of `key` released here (no "held" view, no
/// proxied write) before the backend is told, keeping the gauges right:
/// for a lease nobody was handed (an abandoned acquire's), like
/// [`LockManager::release`] does for the application's own.
pub(super) fn stop_holding(leases: &LeaseTable, metrics: &Metrics, key: &LockKey, lease: &LeaseId) {
    if let Some(rec) = leases.releasing(key, lease) {
        count_end_of_hold(metrics, &rec);
    }
}

/// A held lease stops being held here: the held gauge and the hold time.
fn count_end_of_hold(metrics: &Metrics, rec: &super::super::leases::LeaseRecord) {
    let group = metrics.group(rec.key.as_str());
    metrics
        .leases_held
        .with_label_values(&[group.as_str()])
        .dec();
    metrics
        .hold_time
        .with_label_values(&[group.as_str()])
        .observe(rec.acquired_at.elapsed().as_secs_f64());
}

/// One release in a task of its own: the first backend answer goes to
/// `first` (the caller, if it is still there); an unknown outcome is
/// retried here like an orphan's, since the lease may still hold the key.
///
/// With `early`, the key's local head is woken as soon as the release has
/// been handed to the backend's connection (the call's first poll wrote
/// it), not when its reply and notification are back: on a backend that
/// [orders its calls](crate::lock::LockBackend::orders_calls) the head's
/// try runs right after the release, and a hand-over within this sidecar
/// takes one round trip instead of two.
async fn release_task(
    backend: DynBackend,
    leases: Arc<LeaseTable>,
    metrics: Arc<Metrics>,
    key: LockKey,
    lease: LeaseId,
    first: tokio::sync::oneshot::Sender<Result<Ownership, BackendError>>,
    early: Option<Arc<WaitQueues>>,
) {
    let call = super::timed_call(&backend, &metrics, "release", backend.release(&key, &lease));
    tokio::pin!(call);
    let result = match futures_util::poll!(call.as_mut()) {
        std::task::Poll::Ready(result) => result,
        std::task::Poll::Pending => {
            if let Some(waiters) = &early {
                waiters.released_early(key.as_str());
            }
            call.await
        }
    };
    let retry = matches!(result, Err(BackendError::Unavailable(_)));
    let _ = first.send(result);
    if retry {
        // The record stays, marked released (never held again), so the
        // application may retry — a Dapr unlock finds it by owner — while
        // this task tries too.
        tracing::warn!(key = %key, lease_tag = %lease.tag(),
            "release outcome unknown; retrying in the background");
        for attempt in 0..ORPHAN_RELEASE_ATTEMPTS {
            tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
            let retried =
                super::timed_call(&backend, &metrics, "release", backend.release(&key, &lease))
                    .await;
            if let Ok(found) = retried {
                let result = if matches!(found, Ownership::Owned { .. }) {
                    "released"
                } else {
                    "not_held"
                };
                metrics.orphan_releases.with_label_values(&[result]).inc();
                forget(&leases, &metrics, &key, &lease);
                return;
            }
        }
        metrics.orphan_releases.with_label_values(&["error"]).inc();
        tracing::warn!(key = %key, lease_tag = %lease.tag(),
            "release still unanswered; the lease stays marked released here until the application retries or its TTL ends");
    } else {
        forget(&leases, &metrics, &key, &lease);
    }
}

/// Releases leases of `key` that nobody will use, after the backend call
/// `pending` (which may grant one of them) has ended, and (with
/// `forget_records`) forgets them here; a lost lease's record stays visible
/// as lost instead. Runs as a task of its own: it must not depend on the
/// request that left them behind.
pub(super) async fn release_orphans(
    backend: DynBackend,
    leases: Arc<LeaseTable>,
    metrics: Arc<Metrics>,
    key: LockKey,
    mut orphans: Vec<LeaseId>,
    pending: Option<JoinHandle<Result<Attempt, BackendError>>>,
    forget_records: bool,
) {
    if let Some(call) = pending {
        // The call has its own timeout in the backend; whatever it
        // answered, the lease it tried may hold the key.
        let _ = call.await;
    }
    orphans.dedup();
    for lease in orphans {
        let mut result = "error";
        for attempt in 0..ORPHAN_RELEASE_ATTEMPTS {
            match super::timed_call(&backend, &metrics, "release", backend.release(&key, &lease))
                .await
            {
                Ok(Ownership::Owned { .. }) => {
                    result = "released";
                    break;
                }
                Ok(_) => {
                    result = "not_held";
                    break;
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
                }
            }
        }
        if forget_records {
            forget(&leases, &metrics, &key, &lease);
        }
        metrics.orphan_releases.with_label_values(&[result]).inc();
        tracing::info!(key = %key, lease_tag = %lease.tag(), result, "released a lease nobody holds");
    }
}
