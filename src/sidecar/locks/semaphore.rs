//! Expirable semaphores (issue 33 item 3): `permits` leases at most on one
//! name at a time.
//!
//! A permit is an ordinary lease on one of the name's *slot keys*,
//! `name#0` … `name#{permits-1}`. Everything a lease has, a permit has by
//! construction: its TTL, renewal, keepalive, hold stream, adoption after a
//! restart, its release on a client that went away, and above all its
//! fencing token — strictly increasing per slot key, so a storage
//! partitioned by slot fences each slot at the gateway as it fences a lock.
//! At most `permits` holders at once follows from each slot's mutual
//! exclusion, *provided every user of the name counts the same slots*: the
//! count is fixed in the backend at the name's first use
//! ([`crate::lock::LockBackend::fix_permits`]) and a different count is
//! refused (`permits_mismatch`), never trusted from the request.
//!
//! Acquiring tries the slots once each, without waiting, starting from a
//! random one (so sidecars do not all start at slot 0). When every slot is
//! held the acquire waits in this sidecar's FIFO queue for the name: only
//! its head tries again, when a slot of the name is released (each slot is
//! watched in the backend, as a lock waiter watches its key) or when the
//! holder that frees soonest would expire. Waiters of different sidecars
//! are not ordered among themselves (as Redisson's expirable semaphore).
//! On ZooKeeper a release wakes only the waiters queued on the key, and a
//! permit's try does not queue: its waiters poll every 150–250 ms.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use futures_util::future::join_all;
use rand::Rng;
use tokio::time::Instant;

use super::super::leases::LeaseView;
use super::super::waiters::semaphore_queue;
use super::acquire::Acquire;
use super::{LockError, LockManager};
use crate::lock::{BackendError, LockKey, WatchGuard};

/// The most permits one semaphore may have: an acquire that finds all of
/// them held has tried each once, one backend call per slot.
pub const MAX_PERMITS: u32 = 256;

/// Names whose count this sidecar has learnt; forgotten wholesale beyond
/// this many (asking the backend again is always correct).
const MAX_REMEMBERED: usize = 10_000;

/// How often a waiter polls on a backend whose waiters are woken through
/// their place in a key's queue (ZooKeeper), which a permit's try does not
/// keep: jittered, so sidecars do not poll in lockstep.
fn queue_less_poll() -> Duration {
    Duration::from_millis(150 + rand::rng().random_range(0..100))
}

/// A permit request: `lease` says everything but the key (a slot's).
pub struct PermitRequest {
    pub name: LockKey,
    pub permits: u32,
    pub lease: Acquire,
}

/// A granted permit: the lease on slot key `name#slot`.
pub struct Permit {
    pub view: LeaseView,
    pub slot: u32,
}

/// The slot key of permit `slot` of semaphore `name`.
fn slot_key(name: &LockKey, slot: u32) -> Result<LockKey, LockError> {
    LockKey::parse(&format!("{name}#{slot}")).map_err(|e| {
        LockError::Backend(BackendError::Protocol(format!(
            "semaphore `{name}`: slot key: {e}"
        )))
    })
}

/// The slot of a slot key of `name`, if `key` is one.
pub fn slot_of(name: &LockKey, key: &LockKey) -> Option<u32> {
    let rest = key
        .as_str()
        .strip_prefix(name.as_str())?
        .strip_prefix('#')?;
    if rest.is_empty()
        || !rest.bytes().all(|b| b.is_ascii_digit())
        || rest.starts_with("0") && rest.len() > 1
    {
        return None;
    }
    rest.parse().ok()
}

/// The counts the backend answered: a fixed count never changes, so the
/// backend is asked once per name.
#[derive(Default)]
pub(super) struct FixedPermits(Mutex<HashMap<LockKey, u32>>);

impl FixedPermits {
    fn get(&self, name: &LockKey) -> Option<u32> {
        self.0.lock().expect("permits").get(name).copied()
    }

    fn learn(&self, name: &LockKey, fixed: u32) {
        let mut known = self.0.lock().expect("permits");
        if known.len() >= MAX_REMEMBERED {
            known.clear();
        }
        known.insert(name.clone(), fixed);
    }
}

impl LockManager {
    /// Acquires one of `req.permits` permits of `req.name`, waiting up to
    /// `req.lease.wait` for one to be released.
    pub async fn acquire_permit(&self, req: PermitRequest) -> Result<Permit, LockError> {
        let started = Instant::now();
        let result = self.acquire_permit_inner(&req, started).await;
        let outcome = match &result {
            Ok(_) => "acquired",
            Err(LockError::NoPermit { .. }) => "timeout",
            Err(LockError::PermitsMismatch { .. }) => "permits_mismatch",
            Err(_) => "error",
        };
        self.metrics
            .semaphore_acquisitions
            .with_label_values(&[outcome])
            .inc();
        match &result {
            Ok(p) => tracing::debug!(semaphore = %req.name, slot = p.slot, token = p.view.token,
                wait_ms = started.elapsed().as_millis() as u64, "permit acquired"),
            Err(e) => tracing::debug!(semaphore = %req.name, error = %e, "permit not acquired"),
        }
        result
    }

    /// The name's count is `permits`, fixing it if this is its first use.
    async fn check_permits(&self, name: &LockKey, permits: u32) -> Result<(), LockError> {
        let fixed = match self.permits.get(name) {
            Some(n) => n,
            None => {
                let n = self
                    .call("fix_permits", self.backend.fix_permits(name, permits))
                    .await?;
                self.permits.learn(name, n);
                n
            }
        };
        if fixed != permits && !crate::mutants::active("permits_unchecked") {
            tracing::warn!(semaphore = %name, fixed, asked = permits,
                "semaphore asked with another permit count than the one fixed");
            return Err(LockError::PermitsMismatch {
                name: name.clone(),
                fixed,
                asked: permits,
            });
        }
        Ok(())
    }

    async fn acquire_permit_inner(
        &self,
        req: &PermitRequest,
        started: Instant,
    ) -> Result<Permit, LockError> {
        self.check_permits(&req.name, req.permits).await?;
        let slots = (0..req.permits)
            .map(|i| slot_key(&req.name, i))
            .collect::<Result<Vec<_>, _>>()?;
        let wait = req.lease.wait;
        let deadline = started + wait;
        let none_left = || LockError::NoPermit {
            name: req.name.clone(),
            permits: req.permits,
        };
        let queue = semaphore_queue(req.name.as_str());
        if !self.waiters.has_waiters(&queue) {
            match self.try_slots(req, &slots).await? {
                Ok(permit) => return Ok(permit),
                Err(_) if wait.is_zero() => return Err(none_left()),
                Err(_) => {}
            }
        } else if wait.is_zero() {
            // Waiters here are ahead: a try does not jump them.
            return Err(none_left());
        }
        let ticket = self
            .waiters
            .enqueue(&queue)
            .map_err(|e| LockError::TooManyWaiters(e.0))?;
        let gauge = self
            .metrics
            .waiters
            .with_label_values(&[self.metrics.group(req.name.as_str()).as_str()]);
        gauge.inc();
        let _gauge_guard = crate::http::server::OnDrop::new(move || gauge.dec());
        // Watched before the first try under the queue (a release between
        // the try and the sleep is not missed), every slot at once, all
        // bounded by the wait.
        let _watching: Vec<WatchGuard> = join_all(slots.iter().map(|key| async move {
            tokio::time::timeout_at(
                deadline,
                self.backend
                    .watch(key, deadline.saturating_duration_since(Instant::now())),
            )
            .await
            .unwrap_or_else(|_| WatchGuard::none())
        }))
        .await;
        let mut must_try = ticket.is_head();
        let mut recheck_at: Option<Instant> = None;
        let mut outage: Option<(LockError, Duration)> = None;
        loop {
            if must_try {
                if Instant::now() >= deadline {
                    return Err(outage.map_or_else(none_left, |(e, _)| e));
                }
                match self.try_slots(req, &slots).await {
                    // Dropping the ticket promotes the next waiter, which
                    // tries at once: another slot may be free too.
                    Ok(Ok(permit)) => return Ok(permit),
                    Ok(Err(soonest)) => {
                        outage = None;
                        let mut pause = self.fallback_delay(soonest);
                        if self.backend.held_keeps_a_place() {
                            // ZooKeeper: a try that finds a slot held keeps
                            // no place in its queue (it waits for nothing),
                            // so nothing wakes this waiter: it polls.
                            pause = pause.min(queue_less_poll());
                        }
                        recheck_at = Some(Instant::now() + pause);
                    }
                    Err(e @ LockError::Backend(BackendError::Unavailable(_))) => {
                        let pause = outage.as_ref().map_or(Duration::from_millis(20), |(_, p)| {
                            (*p * 2).min(Duration::from_millis(500))
                        });
                        tracing::warn!(semaphore = %req.name, error = %e, retry_in_ms = pause.as_millis() as u64,
                            "backend unavailable while waiting for a permit; trying again");
                        recheck_at = Some(Instant::now() + pause);
                        outage = Some((e, pause));
                    }
                    Err(e) => return Err(e),
                }
            }
            let sleep_until = recheck_at.map_or(deadline, |r| r.min(deadline));
            tokio::select! {
                wake = ticket.woken() => {
                    self.metrics.waiter_wakeups.with_label_values(&[wake.cause()]).inc();
                    // A released slot, a resync, or the head's place: try.
                    must_try = true;
                }
                _ = tokio::time::sleep_until(sleep_until) => {
                    if Instant::now() >= deadline {
                        return Err(outage.map_or_else(none_left, |(e, _)| e));
                    }
                    let cause = if outage.is_some() { "backend_error" } else { "fallback" };
                    self.metrics.waiter_wakeups.with_label_values(&[cause]).inc();
                    recheck_at = None;
                    must_try = ticket.is_head() || outage.is_some();
                }
                _ = self.shutdown.cancelled() => return Err(LockError::ShuttingDown),
            }
        }
    }

    /// Tries every slot once without waiting, from a random one on: the
    /// permit, or how soon the first holder found would expire.
    async fn try_slots(
        &self,
        req: &PermitRequest,
        slots: &[LockKey],
    ) -> Result<Result<Permit, Option<Duration>>, LockError> {
        let n = slots.len();
        // Mutant: one slot too many, so permits + 1 can hold at once.
        let tried = if crate::mutants::active("semaphore_extra_slot") {
            n + 1
        } else {
            n
        };
        let first = rand::rng().random_range(0..n);
        let mut soonest: Option<Duration> = None;
        for i in 0..tried {
            let slot = (first + i) % tried;
            let key = match slots.get(slot) {
                Some(k) => k.clone(),
                None => slot_key(&req.name, slot as u32)?,
            };
            let mut lease = req.lease.clone();
            lease.key = key;
            lease.wait = Duration::ZERO;
            self.metrics.semaphore_slot_tries.inc();
            match self.acquire_counted(lease, false).await {
                (Ok(view), _) => {
                    return Ok(Ok(Permit {
                        view,
                        slot: slot as u32,
                    }))
                }
                (Err(LockError::Held(_) | LockError::Delayed { .. }), held_for) => {
                    soonest = match (soonest, held_for) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                }
                (Err(e), _) => return Err(e),
            }
        }
        Ok(Err(soonest))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_of_reads_only_the_names_own_slot_keys() {
        let name = LockKey::parse("pool").unwrap();
        let k = |s: &str| LockKey::parse(s).unwrap();
        assert_eq!(slot_of(&name, &k("pool#0")), Some(0));
        assert_eq!(slot_of(&name, &k("pool#17")), Some(17));
        assert_eq!(slot_of(&name, &k("pool#")), None);
        assert_eq!(slot_of(&name, &k("pool#01")), None);
        assert_eq!(slot_of(&name, &k("pool#1a")), None);
        assert_eq!(slot_of(&name, &k("pools#1")), None);
        assert_eq!(slot_of(&name, &k("pool")), None);
    }
}
