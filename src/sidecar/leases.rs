//! The sidecar's own record of the leases it holds, with local deadlines.
//!
//! The backend decides when a lock expires, by its clock. The sidecar must
//! never believe it holds a lock the backend may already have given away, so
//! each lease carries a *local* deadline on the monotonic clock, computed
//! from the moment the acquire or renew request was **sent** (a late reply
//! never extends it), shortened by the configured drift ratio and safety
//! margin. Past that deadline the lease is lost here, whatever the backend
//! says later.
//!
//! A renewal *sets* the backend's TTL, it does not add to it. So after a
//! renewal the deadline is the renewal's send time + the TTL it sent —
//! never the larger of old and new (issue 9 item 2; PITFALLS 10). Renewals
//! of one lease go one at a time ([`LeaseRecord::renewing`]), so the reply
//! being applied is the last renewal the backend saw. A renewal whose
//! outcome stays unknown may still be applied later, with its TTL: its TTL
//! then caps every later deadline of the lease ([`LeaseRecord::ttl_floor`]),
//! and the current deadline drops to its send time + its TTL at once if
//! that is earlier.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use crate::lock::{LeaseId, LockKey};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostReason {
    /// The local deadline passed without a successful renewal.
    Deadline,
    /// The backend said the lease no longer holds the key.
    Backend,
    /// After a failover, the new master did not have the lease.
    Failover,
    /// The application released it and the backend has not confirmed yet
    /// (or did not answer): not held here any more, whatever the backend
    /// says (PITFALLS 12). Not a loss: no lost event, no webhook.
    Released,
}

impl LostReason {
    pub fn as_str(self) -> &'static str {
        match self {
            LostReason::Deadline => "deadline",
            LostReason::Backend => "backend",
            LostReason::Failover => "failover",
            LostReason::Released => "released",
        }
    }
}

/// Who keeps a lease alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// The application calls renew itself.
    Manual,
    /// The sidecar renews while the application shows activity (an API
    /// call or proxied request on the key, or a keepalive) within `keepalive`.
    Auto { keepalive: Duration },
    /// The sidecar renews while the hold connection stays open.
    Hold,
}

impl Renewal {
    pub fn as_str(self) -> &'static str {
        match self {
            Renewal::Manual => "manual",
            Renewal::Auto { .. } => "auto",
            Renewal::Hold => "hold",
        }
    }
}

#[derive(Debug, Clone)]
pub enum LeaseState {
    Held,
    Lost { reason: LostReason, at: Instant },
}

/// Whether a lease is reentrant, and its hold count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Holding {
    /// Taken without `reentrant`.
    #[default]
    No,
    /// Adopted after a restart: the backend may keep a count for it.
    Unknown,
    /// Reentrant, with this many holds.
    Count(u32),
}

#[derive(Debug, Clone)]
pub struct LeaseRecord {
    pub key: LockKey,
    pub lease_id: LeaseId,
    pub token: u64,
    pub fencing_token: String,
    pub owner: Option<String>,
    pub ttl: Duration,
    pub acquired_at: Instant,
    pub deadline: Instant,
    pub state: LeaseState,
    pub renewal: Renewal,
    /// The Dapr lock store the lease was taken through (its `unlock` may
    /// release it by owner); `None` for `/v1/locks` leases, which only
    /// their lease id releases.
    pub dapr_store: Option<String>,
    /// Last sign of life from the application (auto-renew keepalive).
    pub last_activity: Instant,
    /// `max_hold_ms` cap: never renewed past this.
    pub max_until: Option<Instant>,
    /// The lease's write sequence (last number given to a proxied request),
    /// locked while one request is on its way: the proxy numbers and sends
    /// a lease's requests one at a time, in order (PITFALLS 5).
    pub writes: std::sync::Arc<tokio::sync::Mutex<u64>>,
    /// Held while a renewal of this lease is on its way to the backend:
    /// one renewal at a time, so replies cannot be applied out of order.
    pub renewing: std::sync::Arc<tokio::sync::Mutex<()>>,
    /// The smallest TTL of a renewal whose outcome stayed unknown: the
    /// backend may apply it late, so no later deadline may count on more.
    pub ttl_floor: Option<Duration>,
    /// Reentrancy: the hold count as last confirmed by the backend, where
    /// it lives.
    pub holds: Holding,
    /// Held while the hold count changes: one change at a time per lease.
    pub holds_turn: std::sync::Arc<tokio::sync::Mutex<()>>,
    /// The multi-key lease this lease is one key of: the id its client
    /// knows, which binds proxied writes to this key's lease too.
    pub group: Option<LeaseId>,
}

/// What the API shows of a lease.
#[derive(Debug, Serialize)]
pub struct LeaseView {
    pub key: String,
    pub token: u64,
    pub fencing_token: String,
    pub lease_id: String,
    pub ttl_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// `held` or `lost`.
    pub state: &'static str,
    /// Time left before the sidecar's conservative local deadline.
    pub remaining_ms: u64,
    pub held_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lost_reason: Option<&'static str>,
    /// `manual`, `auto` or `hold`.
    pub renewal: &'static str,
    /// A reentrant lease's hold count.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holds: Option<u32>,
    /// `read` for a read lease of a read-write lock; absent for the
    /// exclusive (write) lease.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<&'static str>,
    /// The Dapr lock store it was taken through, if any.
    #[serde(skip)]
    pub dapr_store: Option<String>,
}

/// What any local client may see of a lease (`GET /v1/locks`, `GET
/// /v1/locks/{key}`): the lease id and the signed token are credentials —
/// the id renews, releases and binds proxied writes, the token is accepted
/// by the gateway — so only the acquirer learns them, from its own answer
/// (issue 26 item 10). Leases are told apart by their one-way tag, the
/// same one tokens, logs and webhooks carry.
#[derive(Debug, Clone, Serialize)]
pub struct LeaseStatus {
    pub key: String,
    pub token: u64,
    pub lease_tag: String,
    pub ttl_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    pub state: &'static str,
    pub remaining_ms: u64,
    pub held_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lost_reason: Option<&'static str>,
    pub renewal: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holds: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<&'static str>,
}

impl LeaseView {
    /// This lease as any local client may see it.
    pub fn status(&self) -> LeaseStatus {
        LeaseStatus {
            key: self.key.clone(),
            token: self.token,
            lease_tag: crate::token::lease_tag(&self.lease_id),
            ttl_ms: self.ttl_ms,
            // A Dapr lease's owner string is its credential (it unlocks,
            // and it looks up the lease id: `super::dapr_lock::lease_of`),
            // so only its holder knows it.
            owner: if self.dapr_store.is_some() {
                None
            } else {
                self.owner.clone()
            },
            state: self.state,
            remaining_ms: self.remaining_ms,
            held_ms: self.held_ms,
            lost_reason: self.lost_reason,
            renewal: self.renewal,
            holds: self.holds,
            mode: self.mode,
        }
    }
}

impl LeaseRecord {
    pub fn view(&self, now: Instant) -> LeaseView {
        let (state, lost_reason) = match &self.state {
            LeaseState::Held => ("held", None),
            LeaseState::Lost { reason, .. } => ("lost", Some(reason.as_str())),
        };
        LeaseView {
            key: self.key.as_str().to_owned(),
            token: self.token,
            fencing_token: self.fencing_token.clone(),
            lease_id: self.lease_id.as_str().to_owned(),
            ttl_ms: self.ttl.as_millis() as u64,
            owner: self.owner.clone(),
            state,
            remaining_ms: match self.state {
                LeaseState::Held => self.deadline.saturating_duration_since(now).as_millis() as u64,
                LeaseState::Lost { .. } => 0,
            },
            // A lost lease was held until it was lost, not until now.
            held_ms: match self.state {
                LeaseState::Held => now,
                LeaseState::Lost { at, .. } => at.min(self.deadline).min(now),
            }
            .saturating_duration_since(self.acquired_at)
            .as_millis() as u64,
            lost_reason,
            renewal: self.renewal.as_str(),
            holds: match self.holds {
                Holding::Count(n) => Some(n),
                Holding::No | Holding::Unknown => None,
            },
            mode: self.key.is_reader().then_some("read"),
            dapr_store: self.dapr_store.clone(),
        }
    }

    /// Why the lease is no longer held here, if it is not.
    pub fn lost_reason(&self) -> Option<LostReason> {
        match self.state {
            LeaseState::Held => None,
            LeaseState::Lost { reason, .. } => Some(reason),
        }
    }

    pub fn is_held(&self) -> bool {
        matches!(self.state, LeaseState::Held)
    }

    /// Whether `lease` names this lease: its own id, or its multi-key
    /// lease's.
    pub fn answers_to(&self, lease: &LeaseId) -> bool {
        &self.lease_id == lease || self.group.as_ref() == Some(lease)
    }
}

/// Events the table reports so the caller can count them.
#[derive(Debug, Clone)]
pub struct Lost {
    pub key: LockKey,
    pub lease_id: LeaseId,
    pub token: u64,
    pub owner: Option<String>,
    pub reason: LostReason,
    pub held_for: Duration,
}

impl Lost {
    pub fn of(rec: &LeaseRecord, reason: LostReason, now: Instant) -> Lost {
        Lost {
            key: rec.key.clone(),
            lease_id: rec.lease_id.clone(),
            token: rec.token,
            owner: rec.owner.clone(),
            reason,
            held_for: now.saturating_duration_since(rec.acquired_at),
        }
    }
}

#[derive(Default)]
struct Tables {
    current: HashMap<LockKey, LeaseRecord>,
    /// The key of every lease in `current`, so a proxied request can name
    /// its lease alone.
    by_lease: HashMap<LeaseId, LockKey>,
    /// Leases that ended here (released, lost, replaced), with when they
    /// may be forgotten: a late call with one is answered `lease_lost`,
    /// not `not_owner`, and a renewal can never bring one back as an
    /// "adopted" lease — each is kept at least as long as the backend could
    /// still hold it (its TTL).
    retired: HashMap<LeaseId, (LockKey, Instant)>,
    /// `retired` by forget time, to evict the oldest when full.
    retired_order: BTreeSet<(Instant, LeaseId)>,
    /// When sidecar-renewed leases are next due (renewal or deadline check).
    schedule: BTreeSet<(Instant, LockKey)>,
}

impl Tables {
    fn retire(&mut self, rec: &LeaseRecord, now: Instant, retention: Duration, cap: usize) {
        let forget_at = now + retention.max(rec.ttl);
        while self.retired.len() >= cap {
            let Some((_, oldest)) = self.retired_order.pop_first() else {
                break;
            };
            self.retired.remove(&oldest);
        }
        if let Some((_, old_at)) = self
            .retired
            .insert(rec.lease_id.clone(), (rec.key.clone(), forget_at))
        {
            self.retired_order.remove(&(old_at, rec.lease_id.clone()));
        }
        self.retired_order.insert((forget_at, rec.lease_id.clone()));
    }

    fn forget_retired(&mut self, now: Instant) {
        while let Some((at, _)) = self.retired_order.first() {
            if *at > now {
                break;
            }
            let (_, lease) = self.retired_order.pop_first().expect("checked above");
            self.retired.remove(&lease);
        }
    }
}

pub struct LeaseTable {
    inner: Mutex<Tables>,
    /// Told when a renewal is scheduled ahead of every other one, so the
    /// renewer sleeps until the first one is due instead of polling.
    earlier: tokio::sync::Notify,
    retired_cap: usize,
    drift_ratio: f64,
    margin: Duration,
    /// How long a lost lease stays visible, and an ended one remembered
    /// (at least: see [`Tables::retired`]).
    retention: Duration,
}

/// Why a successful renewal reply could not be applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotRenewed {
    /// The lease has no record here any more (released).
    Gone,
    /// The reply came after the local deadline, or the lease was marked
    /// lost while the renewal was on its way: it is lost here although the
    /// backend renewed it.
    Late,
}

impl LeaseTable {
    pub fn new(
        drift_ratio: f64,
        margin: Duration,
        max_leases: usize,
        retention: Duration,
    ) -> LeaseTable {
        LeaseTable {
            inner: Mutex::new(Tables::default()),
            earlier: tokio::sync::Notify::new(),
            retired_cap: max_leases,
            drift_ratio,
            margin,
            retention,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.inner.lock().expect("lease table poisoned")
    }

    /// Whether `lease` held `key` here: now, or recently.
    pub fn knows(&self, key: &LockKey, lease: &LeaseId) -> bool {
        let t = self.lock();
        t.current.get(key).is_some_and(|r| &r.lease_id == lease)
            || t.retired.get(lease).is_some_and(|(k, _)| k == key)
    }

    /// The local deadline of a lease whose request was sent at `sent`.
    pub fn deadline(&self, sent: Instant, ttl: Duration) -> Instant {
        let safe = ttl
            .mul_f64(1.0 - self.drift_ratio)
            .saturating_sub(self.margin);
        sent + safe
    }

    /// Schedules `key`'s next renewal (or deadline check) at `at`.
    pub fn schedule(&self, key: &LockKey, at: Instant) {
        let first = {
            let mut t = self.lock();
            t.schedule.insert((at, key.clone()));
            t.schedule
                .first()
                .is_some_and(|(f, k)| *f == at && k == key)
        };
        if first {
            self.earlier.notify_one();
        }
    }

    /// The earliest scheduled time, if any.
    pub fn next_due(&self) -> Option<Instant> {
        self.lock().schedule.first().map(|(at, _)| *at)
    }

    /// Returns when the first scheduled renewal is due, when one is
    /// scheduled ahead of it, or after `idle` with nothing scheduled.
    pub async fn until_due(&self, idle: Duration) {
        let earlier = self.earlier.notified();
        tokio::pin!(earlier);
        earlier.as_mut().enable();
        let wake = self.next_due().unwrap_or_else(|| Instant::now() + idle);
        tokio::select! {
            _ = tokio::time::sleep_until(wake) => {}
            _ = earlier => {}
        }
    }

    /// Up to `limit` held, sidecar-renewed leases whose time has come.
    pub fn take_due(&self, now: Instant, limit: usize) -> Vec<LeaseRecord> {
        let mut t = self.lock();
        let mut out: Vec<LeaseRecord> = Vec::new();
        while out.len() < limit {
            let Some((at, _)) = t.schedule.first() else {
                break;
            };
            if *at > now {
                break;
            }
            let (_, key) = t.schedule.pop_first().expect("checked above");
            if let Some(rec) = t.current.get(&key) {
                if rec.is_held()
                    && rec.renewal != Renewal::Manual
                    && !out.iter().any(|r| r.key == key)
                {
                    out.push(rec.clone());
                }
            }
        }
        out
    }

    /// The application showed activity on `key` (keepalive for auto-renew).
    pub fn touch(&self, key: &LockKey, lease: Option<&LeaseId>, now: Instant) -> bool {
        let mut t = self.lock();
        match t.current.get_mut(key) {
            Some(rec) if rec.is_held() && lease.is_none_or(|l| rec.answers_to(l)) => {
                rec.last_activity = now;
                true
            }
            _ => false,
        }
    }

    /// Number of records (held and recently lost).
    pub fn len(&self) -> usize {
        self.lock().current.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records a fresh lease. Returns the record it replaced, if that one was
    /// still believed held (the backend gave the key to us again, so the old
    /// lease is gone).
    pub fn insert(&self, record: LeaseRecord) -> Option<LeaseRecord> {
        let mut t = self.lock();
        t.by_lease
            .insert(record.lease_id.clone(), record.key.clone());
        let new_lease = record.lease_id.clone();
        let old = t.current.insert(record.key.clone(), record)?;
        if old.lease_id != new_lease {
            t.by_lease.remove(&old.lease_id);
        }
        t.retire(&old, Instant::now(), self.retention, self.retired_cap);
        old.is_held().then_some(old)
    }

    /// The key `lease` holds here (held or recently lost), if any.
    pub fn key_of(&self, lease: &LeaseId) -> Option<LockKey> {
        self.lock().by_lease.get(lease).cloned()
    }

    /// Whether `lease` ended here (released, lost or replaced) and must not
    /// come back.
    pub fn retired(&self, lease: &LeaseId) -> bool {
        self.lock().retired.contains_key(lease)
    }

    /// The record for `key`, with its state brought up to date.
    pub fn get(&self, key: &LockKey, now: Instant) -> (Option<LeaseRecord>, Option<Lost>) {
        let mut t = self.lock();
        let Some(rec) = t.current.get_mut(key) else {
            return (None, None);
        };
        let lost = expire(rec, now);
        (Some(rec.clone()), lost)
    }

    /// Brings `key`'s state up to date without copying its record: the
    /// lost event, if its deadline just passed.
    pub fn refresh(&self, key: &LockKey, now: Instant) -> Option<Lost> {
        let mut t = self.lock();
        expire(t.current.get_mut(key)?, now)
    }

    /// Applies a successful renewal sent at `sent` with `ttl`, if `lease`
    /// is still the current, held lease of `key` and the reply is in time.
    /// The new deadline is computed from this renewal alone (capped by the
    /// TTL of any renewal whose outcome stayed unknown), never kept from
    /// an earlier, longer one.
    pub fn renewed(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        sent: Instant,
        ttl: Duration,
    ) -> Result<LeaseRecord, NotRenewed> {
        let mut t = self.lock();
        let rec = t
            .current
            .get_mut(key)
            .filter(|r| &r.lease_id == lease)
            .ok_or(NotRenewed::Gone)?;
        // A reply can arrive after the deadline it would extend: too late.
        if !rec.is_held() || Instant::now() >= rec.deadline {
            return Err(NotRenewed::Late);
        }
        let effective = rec.ttl_floor.map_or(ttl, |f| f.min(ttl));
        let deadline = self.deadline(sent, effective);
        rec.deadline = if crate::mutants::active("renew_keeps_old_deadline") {
            rec.deadline.max(deadline)
        } else {
            deadline
        };
        rec.ttl = ttl;
        Ok(rec.clone())
    }

    /// A renewal sent at `sent` with `ttl` whose outcome is unknown: the
    /// backend may have applied it (or may still), so the lease may end at
    /// `sent + ttl` — earlier than its deadline if `ttl` is shorter.
    pub fn renewal_unknown(&self, key: &LockKey, lease: &LeaseId, sent: Instant, ttl: Duration) {
        let mut t = self.lock();
        if let Some(rec) = t
            .current
            .get_mut(key)
            .filter(|r| &r.lease_id == lease && r.is_held())
        {
            rec.ttl_floor = Some(rec.ttl_floor.map_or(ttl, |f| f.min(ttl)));
            rec.deadline = rec.deadline.min(self.deadline(sent, ttl));
        }
    }

    /// Marks `key`'s lease lost (if it is `lease` and still held).
    pub fn mark_lost(&self, key: &LockKey, lease: &LeaseId, reason: LostReason) -> Option<Lost> {
        let now = Instant::now();
        let mut t = self.lock();
        let rec = t
            .current
            .get_mut(key)
            .filter(|r| &r.lease_id == lease && r.is_held())?;
        rec.state = LeaseState::Lost { reason, at: now };
        Some(Lost::of(rec, reason, now))
    }

    /// Marks `lease`'s held record of `key` as being released (no lost
    /// event: the application asked for it). Returns the record as it was.
    pub fn releasing(&self, key: &LockKey, lease: &LeaseId) -> Option<LeaseRecord> {
        let mut t = self.lock();
        let rec = t
            .current
            .get_mut(key)
            .filter(|r| &r.lease_id == lease && r.is_held())?;
        let before = rec.clone();
        rec.state = LeaseState::Lost {
            reason: LostReason::Released,
            at: Instant::now(),
        };
        Some(before)
    }

    /// Removes `key`'s record if it belongs to `lease`.
    pub fn remove(&self, key: &LockKey, lease: &LeaseId) -> Option<LeaseRecord> {
        let mut t = self.lock();
        if t.current.get(key).is_some_and(|r| &r.lease_id == lease) {
            let rec = t.current.remove(key)?;
            t.by_lease.remove(&rec.lease_id);
            t.retire(&rec, Instant::now(), self.retention, self.retired_cap);
            return Some(rec);
        }
        None
    }

    /// Up to `limit` records sorted by key, with states brought up to date.
    pub fn list(&self, now: Instant, limit: usize) -> (Vec<LeaseRecord>, usize, Vec<Lost>) {
        let mut t = self.lock();
        let mut lost = Vec::new();
        for rec in t.current.values_mut() {
            lost.extend(expire(rec, now));
        }
        let total = t.current.len();
        let mut recs: Vec<LeaseRecord> = t.current.values().cloned().collect();
        recs.sort_by(|a, b| a.key.cmp(&b.key));
        recs.truncate(limit);
        (recs, total, lost)
    }

    /// Expires overdue leases, moves lost ones older than the retention to
    /// the retired set, and forgets retired ones whose time is up.
    pub fn sweep(&self, now: Instant) -> (Vec<Lost>, Vec<LockKey>) {
        let retention = self.retention;
        let mut t = self.lock();
        let mut lost = Vec::new();
        for rec in t.current.values_mut() {
            lost.extend(expire(rec, now));
        }
        let forgotten: Vec<LockKey> = t
            .current
            .values()
            .filter(|r| match r.state {
                LeaseState::Held => false,
                LeaseState::Lost { at, .. } => now.saturating_duration_since(at) >= retention,
            })
            .map(|r| r.key.clone())
            .collect();
        for key in forgotten {
            if let Some(rec) = t.current.remove(&key) {
                t.by_lease.remove(&rec.lease_id);
                t.retire(&rec, now, retention, self.retired_cap);
            }
        }
        t.forget_retired(now);
        let held = t
            .current
            .values()
            .filter(|r| r.is_held())
            .map(|r| r.key.clone())
            .collect();
        (lost, held)
    }

    /// Every held lease, for release on shutdown.
    pub fn drain_held(&self) -> Vec<LeaseRecord> {
        let mut t = self.lock();
        let held: Vec<LeaseRecord> = t
            .current
            .values()
            .filter(|r| r.is_held())
            .cloned()
            .collect();
        t.current.clear();
        t.by_lease.clear();
        held
    }

    /// `(key, lease, token)` of every held lease.
    pub fn held(&self) -> Vec<(LockKey, LeaseId, u64)> {
        self.lock()
            .current
            .values()
            .filter(|r| r.is_held())
            .map(|r| (r.key.clone(), r.lease_id.clone(), r.token))
            .collect()
    }

    /// Whether `lease` holds `key` here, and how ([`Holding`]); without
    /// copying its record (every release asks).
    pub fn holding(&self, key: &LockKey, lease: &LeaseId) -> Option<Holding> {
        self.lock()
            .current
            .get(key)
            .filter(|r| &r.lease_id == lease && r.is_held())
            .map(|r| r.holds)
    }

    /// An adopted lease may be reentrant: its count is the backend's.
    pub fn holds_unknown(&self, key: &LockKey, lease: &LeaseId) {
        if let Some(rec) = self
            .lock()
            .current
            .get_mut(key)
            .filter(|r| &r.lease_id == lease && r.holds == Holding::No)
        {
            rec.holds = Holding::Unknown;
        }
    }

    /// Sets a reentrant lease's hold count (and owner) as the backend
    /// confirmed it; `None` if the lease no longer holds the key here.
    /// Marks `lease`'s record of `key` as one key of multi-key lease
    /// `group`: the record, or `None` if it is no longer held.
    pub fn set_group(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        group: &LeaseId,
    ) -> Option<LeaseRecord> {
        let mut t = self.lock();
        let rec = t
            .current
            .get_mut(key)
            .filter(|r| &r.lease_id == lease && r.is_held())?;
        rec.group = Some(group.clone());
        Some(rec.clone())
    }

    pub fn set_holds(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        holds: u32,
        owner: &str,
    ) -> Option<LeaseRecord> {
        let mut t = self.lock();
        let rec = t
            .current
            .get_mut(key)
            .filter(|r| &r.lease_id == lease && r.is_held())?;
        rec.holds = Holding::Count(holds);
        rec.owner = Some(owner.to_owned());
        Some(rec.clone())
    }

    /// The record of `lease` on `key`, whatever its state.
    pub fn record_of(&self, key: &LockKey, lease: &LeaseId) -> Option<LeaseRecord> {
        self.lock()
            .current
            .get(key)
            .filter(|r| &r.lease_id == lease)
            .cloned()
    }
}

/// Moves a held record past its deadline to lost.
fn expire(rec: &mut LeaseRecord, now: Instant) -> Option<Lost> {
    if rec.is_held() && now >= rec.deadline {
        rec.state = LeaseState::Lost {
            reason: LostReason::Deadline,
            at: now,
        };
        return Some(Lost::of(rec, LostReason::Deadline, now));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::LostReason;

    /// Every loss is counted from zero (`fencer_lost_leases_total` is
    /// created for each reason at start-up). A new variant stops this match
    /// compiling until it is sorted in.
    #[test]
    fn every_loss_reason_exists_at_zero() {
        use LostReason::*;
        for r in [Deadline, Backend, Failover, Released] {
            let a_loss = match r {
                Deadline | Backend | Failover => true,
                Released => false,
            };
            assert_eq!(
                crate::metrics::sidecar::LOST_REASONS.contains(&r.as_str()),
                a_loss,
                "{r:?}"
            );
        }
    }
}
