//! Reentrant locks (issue 33 item 1): `"reentrant": true` lets the owner
//! that holds a key through this sidecar take it again — the same lease,
//! the same token, one more hold — and a release gives back one hold
//! until the last one frees the key.
//!
//! The count lives with the lease in the backend ([`LockBackend::holds`]),
//! beside the owner allowed to re-enter: a sidecar that restarts adopts
//! the lease on its next renewal ([`Holding::Unknown`]) and reads both from
//! there, so neither a re-entry nor a release after the restart frees the
//! key early. Every change is a compare-and-set from the count last
//! confirmed, one at a time per lease (`holds_turn`): a retry after an
//! unknown outcome sees either the count it set or the one it started
//! from, never a count moved twice.
//!
//! [`LockBackend::holds`]: crate::lock::LockBackend::holds

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::OwnedMutexGuard;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::super::leases::{Holding, LeaseRecord, LeaseTable, LeaseView, LostReason};
use super::acquire::Acquire;
use super::{LockError, LockManager};
use crate::lock::{BackendError, DynBackend, Holds, HoldsChange, LeaseId, LockKey};

/// Calls of one count change after an unknown outcome (same change:
/// safe to repeat).
const HOLDS_TRIES: u32 = 3;

/// The most holds one lease may count: a bound, not a policy (a caller
/// re-entering without end has a bug; it is told, not ignored).
pub const MAX_HOLDS: u32 = 10_000;

/// What a release did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// The key is free (the lease's last hold, or a lease without holds).
    Freed,
    /// One hold given back; the lease keeps the key with this many.
    StillHeld(u32),
}

impl LockManager {
    /// A reentrant acquire: refused where the backend keeps no counts.
    pub(super) fn check_reentrancy(&self) -> Result<(), LockError> {
        if self.backend.supports_reentrancy() {
            return Ok(());
        }
        Err(LockError::Unsupported {
            feature: "reentrant",
            backend: self.backend.name(),
        })
    }

    /// `req`'s owner already holds `req.key` here through a reentrant
    /// lease: one hold more, the same lease. `None`: no such lease (the
    /// acquire goes on as any other, waiting if another lease holds it).
    pub(super) async fn reenter(&self, req: &Acquire) -> Option<Result<LeaseView, LockError>> {
        let owner = req.owner.as_deref()?;
        let found = self.record(&req.key).ok().filter(LeaseRecord::is_held)?;
        if found.holds == Holding::No {
            return None;
        }
        let turn = found.holds_turn.clone().lock_owned().await;
        let (rec, current) = match self.count_of(&req.key, &found.lease_id).await {
            Ok(Some((rec, n, o))) if o == owner => (rec, n),
            Ok(_) => return None,
            Err(e) => return Some(Err(e)),
        };
        if current >= MAX_HOLDS {
            return Some(Err(LockError::TooManyHolds(MAX_HOLDS)));
        }
        match self
            .change_holds(&rec, current, current + 1, owner, turn)
            .await
        {
            Ok(Some(view)) => {
                self.count_hold_change("entered");
                tracing::debug!(key = %req.key, holds = current + 1, "reentrant lock taken again");
                Some(Ok(view))
            }
            // The lease is gone: a fresh acquire, as for any other key.
            Ok(None) => None,
            Err(e) => Some(Err(e)),
        }
    }

    /// The count and owner of a reentrant lease held here: as last
    /// confirmed, or (adopted after a restart) read from the backend.
    /// `None`: not held, or not reentrant.
    async fn count_of(
        &self,
        key: &LockKey,
        lease: &LeaseId,
    ) -> Result<Option<(LeaseRecord, u32, String)>, LockError> {
        let Some(rec) = self
            .leases
            .record_of(key, lease)
            .filter(LeaseRecord::is_held)
        else {
            return Ok(None);
        };
        match (rec.holds, rec.owner.clone()) {
            (Holding::Count(n), Some(owner)) => Ok(Some((rec, n, owner))),
            (Holding::Unknown, _) => match self.holds_call(&rec, HoldsChange::Read).await? {
                Holds::Owned {
                    holds,
                    owner: Some(owner),
                    ..
                } => Ok(Some((rec, holds, owner))),
                Holds::Owned { .. } => Ok(None),
                Holds::Free | Holds::OtherHolder => {
                    self.lease_gone(&rec);
                    Ok(None)
                }
            },
            _ => Ok(None),
        }
    }

    /// A reentrant lease just granted: its first hold and its owner are
    /// recorded with it in the backend (for a restart), and here.
    pub(super) async fn first_hold(&self, key: &LockKey, lease_id: &str, owner: &str) {
        let Some(rec) =
            LeaseId::parse(lease_id).and_then(|lease| self.leases.record_of(key, &lease))
        else {
            return;
        };
        let turn = rec.holds_turn.clone().lock_owned().await;
        if let Err(e) = self.change_holds(&rec, 1, 1, owner, turn).await {
            // Held, and re-entrant here; only a restart would not know the
            // owner (its re-entry would then wait for this lease).
            tracing::warn!(key = %key, error = %e, "could not record the reentrant lease's owner in the backend");
            self.leases.set_holds(key, &rec.lease_id, 1, owner);
        }
    }

    /// Releases one hold of `lease`: the key stays held while holds are
    /// left, and is released with the last one (or at once for a lease
    /// that is not reentrant).
    pub async fn release_hold(&self, key: LockKey, lease: LeaseId) -> Result<Released, LockError> {
        let found = match self.leases.holding(&key, &lease) {
            Some(Holding::Count(_) | Holding::Unknown) => self.leases.record_of(&key, &lease),
            Some(Holding::No) => None,
            // Not tracked here: perhaps a reentrant lease of a process
            // before a restart, not renewed since (the backend knows).
            None if self.backend.supports_reentrancy() && !self.leases.knows(&key, &lease) => {
                return self.release_untracked(key, lease).await
            }
            None => None,
        };
        let Some(found) = found else {
            self.release(key, lease).await?;
            return Ok(Released::Freed);
        };
        let turn = found.holds_turn.clone().lock_owned().await;
        if let Some((rec, current, owner)) = self.count_of(&key, &lease).await? {
            if current > 1 {
                self.change_holds(&rec, current, current - 1, &owner, turn)
                    .await?
                    .ok_or_else(|| LockError::LeaseLost(key.clone()))?;
                self.count_hold_change("left");
                tracing::debug!(key = %key, holds = current - 1, "reentrant lock: one hold given back");
                return Ok(Released::StillHeld(current - 1));
            }
            // The last hold: its record goes too (Redis keeps it apart
            // from the lock entry). Best effort — a record left is ignored
            // by the next lease, which it does not name.
            let op = change_id();
            let last = HoldsChange::Set {
                expect: current,
                to: 0,
                owner: &owner,
                op: &op,
            };
            let _ = self.holds_call(&rec, last).await;
        }
        self.release(key, lease).await?;
        Ok(Released::Freed)
    }

    /// A release of a lease this sidecar does not track: one hold given
    /// back in the backend if it counts more than one, else released. The
    /// change goes through [`Self::send_holds_change`] as a tracked one
    /// does — undone if the client hangs up before the answer — under a
    /// turn of the lease's own here, so a retry waits for that undo.
    async fn release_untracked(&self, key: LockKey, lease: LeaseId) -> Result<Released, LockError> {
        let turn = self.untracked_turns.turn(&lease).lock_owned().await;
        let read = self
            .call("holds", self.backend.holds(&key, &lease, HoldsChange::Read))
            .await;
        let holds = match read {
            Ok(holds) => holds,
            Err(e) => {
                drop(turn);
                self.untracked_turns.forget_idle();
                return Err(e.into());
            }
        };
        let (current, owner) = match holds {
            Holds::Owned {
                holds,
                owner: Some(owner),
                ..
            } if holds > 1 => (holds, owner),
            _ => {
                drop(turn);
                self.untracked_turns.forget_idle();
                self.release(key, lease).await?;
                return Ok(Released::Freed);
            }
        };
        let sent = self
            .send_holds_change(&key, &lease, current, current - 1, &owner, turn)
            .await;
        self.untracked_turns.forget_idle();
        match sent?.0 {
            Holds::Owned { applied: true, .. } => {
                self.count_hold_change("left");
                Ok(Released::StillHeld(current - 1))
            }
            Holds::Owned { holds, .. } => {
                self.count_hold_change("conflict");
                Err(LockError::Backend(BackendError::Unavailable(format!(
                    "the backend counts {holds} holds of this lease, not {current}: retry"
                ))))
            }
            _ => Err(LockError::LeaseLost(key)),
        }
    }

    /// One count change, `expect` → `to`, under one change id, repeated
    /// after an unknown outcome, in a task of its own: a caller that goes
    /// away meanwhile (its client disconnected) never leaves a change it
    /// was not told of — the task's end is awaited and the change undone
    /// ([`Pending`]), or a re-entry nobody learned of would keep the key
    /// held after the owner's last release, and a release the client
    /// retries would give back two holds. The lease's `turn` goes with the
    /// change and, if its caller went away, with the undo: a retry of the
    /// client's waits for the undo instead of racing it. A count the backend says was
    /// moved by some other change is an error, never taken for this one.
    /// `Ok(None)`: the lease no longer holds the key (marked lost here).
    async fn change_holds(
        &self,
        rec: &LeaseRecord,
        expect: u32,
        to: u32,
        owner: &str,
        turn: OwnedMutexGuard<()>,
    ) -> Result<Option<LeaseView>, LockError> {
        let (found, _turn) = self
            .send_holds_change(&rec.key, &rec.lease_id, expect, to, owner, turn)
            .await?;
        match found {
            Holds::Owned { applied: true, .. } => Ok(self
                .leases
                .set_holds(&rec.key, &rec.lease_id, to, owner)
                .map(|r| r.view(Instant::now()))),
            Holds::Owned { holds, .. } => Err(self.holds_conflict(rec, expect, holds, owner)),
            Holds::Free | Holds::OtherHolder => {
                self.lease_gone(rec);
                Ok(None)
            }
        }
    }

    /// The backend counts `holds`, not the `expect`ed: an error, with the
    /// backend's count taken here.
    fn holds_conflict(&self, rec: &LeaseRecord, expect: u32, holds: u32, owner: &str) -> LockError {
        self.count_hold_change("conflict");
        tracing::warn!(key = %rec.key, expected = expect, found = holds,
            "hold count moved by another change; taking the backend's");
        self.leases.set_holds(&rec.key, &rec.lease_id, holds, owner);
        LockError::Backend(BackendError::Unavailable(format!(
            "the backend counts {holds} holds of this lease, not {expect}: retry"
        )))
    }

    /// The core of [`Self::change_holds`], for a lease whether tracked here
    /// or not: the backend's answer, and the turn (held until the caller
    /// has applied the answer here).
    async fn send_holds_change(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        expect: u32,
        to: u32,
        owner: &str,
        turn: OwnedMutexGuard<()>,
    ) -> Result<(Holds, Undo), LockError> {
        let (backend, who, op) = (self.backend.clone(), owner.to_owned(), change_id());
        let (task_key, task_lease) = (key.clone(), lease.clone());
        let metrics = self.metrics.clone();
        let op2 = op.clone();
        let task = tokio::spawn(async move {
            let change = HoldsChange::Set {
                expect,
                to,
                owner: &who,
                op: &op2,
            };
            let mut tries = 0;
            loop {
                tries += 1;
                let call = backend.holds(&task_key, &task_lease, change);
                match super::timed_call(&backend, &metrics, "holds", call).await {
                    Err(BackendError::Unavailable(_)) if tries < HOLDS_TRIES => continue,
                    other => return other,
                }
            }
        });
        let mut pending = Pending {
            task: None,
            undo: Some(Undo {
                undone: self.metrics.hold_changes.with_label_values(&["undone"]),
                backend: self.backend.clone(),
                leases: self.leases.clone(),
                key: key.clone(),
                lease: lease.clone(),
                expect,
                to,
                owner: owner.to_owned(),
                op: op.clone(),
                _turn: turn,
            }),
        };
        let found = pending
            .wait(task)
            .await
            .unwrap_or_else(|e| Err(BackendError::Unavailable(e.to_string())));
        let Some(undo) = pending.undo.take() else {
            return Err(LockError::Backend(BackendError::Unavailable(
                "hold count change lost".into(),
            )));
        };
        let found = match found {
            Ok(found) => found,
            Err(e) => {
                // Unknown outcome, and the client is told it failed: the
                // change must not land unseen (its request may still be
                // on its way). Settled and undone in the background.
                if !crate::mutants::active("holds_change_kept") {
                    tokio::spawn(undo.settle(None));
                }
                return Err(e.into());
            }
        };
        // Answered: nothing to undo; the turn (in `undo`) is held until
        // the caller has set the count here too.
        Ok((found, undo))
    }

    async fn holds_call(
        &self,
        rec: &LeaseRecord,
        change: HoldsChange<'_>,
    ) -> Result<Holds, BackendError> {
        self.call("holds", self.backend.holds(&rec.key, &rec.lease_id, change))
            .await
    }

    fn count_hold_change(&self, result: &str) {
        self.metrics.hold_changes.with_label_values(&[result]).inc();
    }

    /// The backend no longer gives `rec` the key: lost here too.
    fn lease_gone(&self, rec: &LeaseRecord) {
        self.record_lost(
            self.leases
                .mark_lost(&rec.key, &rec.lease_id, LostReason::Backend),
        );
    }
}

/// Turns of leases this sidecar does not track (a release straight after
/// a restart): one change at a time per lease, as a record's `holds_turn`
/// gives a tracked one. An entry lives while someone holds or waits for
/// its turn.
#[derive(Default)]
pub(super) struct UntrackedTurns(std::sync::Mutex<HashMap<LeaseId, Arc<tokio::sync::Mutex<()>>>>);

impl UntrackedTurns {
    fn turn(&self, lease: &LeaseId) -> Arc<tokio::sync::Mutex<()>> {
        self.0
            .lock()
            .expect("turns")
            .entry(lease.clone())
            .or_default()
            .clone()
    }

    /// Drops the turns nobody holds or waits for.
    fn forget_idle(&self) {
        self.0
            .lock()
            .expect("turns")
            .retain(|_, t| Arc::strong_count(t) > 1);
    }
}

/// A fresh id for one hold-count change.
fn change_id() -> String {
    LeaseId::generate().as_str()[..12].to_owned()
}

/// A count change on its way. Dropped before its answer was taken (the
/// caller went away), it waits for the change in the background and, if
/// it was applied, sets the count back.
struct Pending {
    task: Option<JoinHandle<Result<Holds, BackendError>>>,
    undo: Option<Undo>,
}

struct Undo {
    /// The change's id.
    op: String,
    /// The lease's turn, held until the undo is done (dropped with it).
    _turn: OwnedMutexGuard<()>,
    undone: prometheus::IntCounter,
    backend: DynBackend,
    leases: Arc<LeaseTable>,
    key: LockKey,
    lease: LeaseId,
    expect: u32,
    to: u32,
    owner: String,
}

impl Pending {
    async fn wait(
        &mut self,
        task: JoinHandle<Result<Holds, BackendError>>,
    ) -> Result<Result<Holds, BackendError>, tokio::task::JoinError> {
        let task = self.task.insert(task);
        let found = task.await;
        self.task = None;
        found
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let (Some(task), Some(u)) = (self.task.take(), self.undo.take()) else {
            return;
        };
        if crate::mutants::active("holds_change_kept") {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            let answer = task.await.ok();
            u.settle(answer).await;
        });
    }
}

/// Tries of one step of an undo (each bounded by the backend's timeout).
const UNDO_TRIES: u32 = 5;

impl Undo {
    /// Learns whether the change went in — its own answer, or else the same
    /// change sent again (its id: never applied twice; if it had not gone
    /// in, it does now) — and if it did, sets the count back. Holds the
    /// lease's turn throughout.
    async fn settle(self, answer: Option<Result<Holds, BackendError>>) {
        let u = self;
        let change = HoldsChange::Set {
            expect: u.expect,
            to: u.to,
            owner: &u.owner,
            op: &u.op,
        };
        let mut outcome = answer;
        for attempt in 0..UNDO_TRIES {
            if matches!(outcome, Some(Ok(_))) {
                break;
            }
            if attempt > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(100 << attempt)).await;
            }
            outcome = Some(u.backend.holds(&u.key, &u.lease, change).await);
        }
        let Some(Ok(Holds::Owned { applied: true, .. })) = outcome else {
            if !matches!(outcome, Some(Ok(_))) {
                tracing::warn!(key = %u.key, outcome = ?outcome,
                    "could not learn whether a hold count change its caller never learned of went in");
            }
            return;
        };
        let op = change_id();
        let back = HoldsChange::Set {
            expect: u.to,
            to: u.expect,
            owner: &u.owner,
            op: &op,
        };
        let mut result = Err(BackendError::Unavailable("not tried".into()));
        for attempt in 0..UNDO_TRIES {
            if attempt > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(100 << attempt)).await;
            }
            result = u.backend.holds(&u.key, &u.lease, back).await;
            if !matches!(result, Err(BackendError::Unavailable(_))) {
                break;
            }
        }
        match result {
            Ok(Holds::Owned { applied: true, .. }) => {
                u.undone.inc();
                u.leases.set_holds(&u.key, &u.lease, u.expect, &u.owner);
                tracing::info!(key = %u.key, holds = u.expect,
                    "hold count change undone: its caller never learned of it");
            }
            other => tracing::warn!(key = %u.key, outcome = ?other,
                "could not undo a hold count change its caller never learned of"),
        }
    }
}
