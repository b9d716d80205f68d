//! Lock backends: where locks and their fencing tokens actually live.
//!
//! Every backend implements [`LockBackend`] with the same semantics, so the
//! sidecar's lock logic (queues, deadlines, the HTTP API) never depends on
//! which one is configured, and one behavioural test suite covers them all.
//!
//! The contract each backend keeps:
//! - `try_acquire` is atomic and **idempotent per lease id**: calling it again
//!   with the same lease id while that lease holds the key returns the same
//!   token instead of a second one. That lets the caller retry when it cannot
//!   tell whether a request reached the backend.
//! - tokens strictly increase per key and are never reset by fencer;
//! - `renew` and `release` act only when the key is held by that lease id;
//! - expiry is enforced by the backend's own clock, never the sidecar's;
//! - a release wakes waiters through a [`WakeSink`] (pub/sub for Redis).

pub mod channels;
pub mod etcd;
pub mod key;
pub mod lease_id;
pub mod memory;
pub mod mysql;
pub mod postgres;
pub mod redis;
pub mod redlock;
pub mod settings;
pub mod zookeeper;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

pub use key::LockKey;
pub use lease_id::LeaseId;

/// The result of one acquisition attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// This lease now holds the key with this fencing token.
    Acquired { token: u64 },
    /// Someone else holds it; `remaining` is the backend's remaining TTL when
    /// known (used to schedule the fallback re-check of waiters).
    Held { remaining: Option<Duration> },
    /// Nobody holds the key, but the lease that last held it ended without
    /// a release (it expired) and the key stays closed for
    /// `sidecar.lock_delay_ms` after that; free again in `remaining`. The
    /// caller is told so (`lock_delayed` with `retry_after_ms`), not "held".
    Delayed { remaining: Duration },
}

impl Attempt {
    /// The wait the backend knows of before the key could be taken:
    /// a holder's TTL left, or the lock-delay left.
    pub fn remaining(&self) -> Option<Duration> {
        match self {
            Attempt::Acquired { .. } => None,
            Attempt::Held { remaining } => *remaining,
            Attempt::Delayed { remaining } => Some(*remaining),
        }
    }
}

/// What a conditional operation (renew, release) found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ownership {
    /// The lease held the key; the operation was applied. Carries the token.
    Owned { token: u64 },
    /// Nobody holds the key (the lease expired or was released).
    Free,
    /// Another lease holds the key.
    OtherHolder,
}

/// What the backend itself records for a key, whoever's lease it is
/// (`GET /v1/locks/{key}?scope=backend`). Read-only: reading it changes
/// nothing and takes no lock a writer would wait for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyView {
    /// The lease holding the key now, if any.
    pub holder: Option<HolderView>,
    /// Nobody holds the key but its lock-delay lasts this much longer.
    pub delayed: Option<Duration>,
    /// The key's token counter: the highest token issued for it, where the
    /// backend keeps one (ZooKeeper's tokens are zxids: none).
    pub last_token: Option<u64>,
    /// Leases queued for the key in the backend, where it keeps a queue
    /// (ZooKeeper); elsewhere waiters wait in their own sidecars.
    pub waiting: Option<u64>,
    /// The masters disagree (RedLock): no lease has a majority's entries.
    pub split: bool,
    /// Read leases holding the key now (read-write locks), where the
    /// backend keeps reader sets; none while a write lease holds it.
    pub readers: Option<u64>,
}

impl KeyView {
    /// A SQL backend's row for the key: whether a lease holds it, that
    /// lease, the key's counter, the ms left on the lease and on its
    /// lock-delay (server clock), and the live read leases.
    pub fn of_row(
        held: bool,
        lease: Option<String>,
        token: i64,
        (left_ms, delay_left_ms): (i64, i64),
        readers: i64,
    ) -> KeyView {
        let millis = |ms: i64| Duration::from_millis(ms.max(0) as u64);
        KeyView {
            holder: lease.filter(|_| held).map(|lease| HolderView {
                lease,
                token: token as u64,
                remaining: Some(millis(left_ms)),
            }),
            delayed: (!held && delay_left_ms > 0 && readers == 0).then(|| millis(delay_left_ms)),
            last_token: Some(token as u64),
            readers: Some(readers.max(0) as u64),
            ..KeyView::default()
        }
    }
}

/// The holder of a key, as the backend records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolderView {
    /// The lease id — a credential: the API shows only its tag.
    pub lease: String,
    pub token: u64,
    /// Time left on the backend's clock, where it can be read.
    pub remaining: Option<Duration>,
}

/// A reentrant lease's hold count and owner as the backend records them
/// with the lease (`reentrant: true` acquires): the count survives a
/// sidecar restart, and so does the owner that may take the key again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holds {
    /// The lease holds the key; its count (1 if none was recorded), owner
    /// (if recorded), and whether the change asked for is in effect — made
    /// now, or by an earlier call of the same change (its `op`).
    Owned {
        holds: u32,
        owner: Option<String>,
        applied: bool,
    },
    /// Nobody holds the key.
    Free,
    /// Another lease holds it.
    OtherHolder,
}

/// What [`LockBackend::holds`] does besides reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldsChange<'a> {
    Read,
    /// Compare-and-set: only if the count is `expect` now, make it `to`
    /// and record `owner` — and `op`, the change's id: a retry after an
    /// unknown outcome names the same `op` and is told `applied` rather
    /// than applied twice, and a count some other change moved (a change
    /// nobody learned of) is told apart from this one having been made.
    Set {
        expect: u32,
        to: u32,
        owner: &'a str,
        op: &'a str,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The backend could not be reached or did not answer in time. The
    /// operation may or may not have been applied.
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    /// The backend answered something fencer does not understand.
    #[error("unexpected backend reply: {0}")]
    Protocol(String),
    /// The backend refused for now and did nothing (e.g. RedLock masters
    /// in their restart quarantine).
    #[error("backend refused: {0}")]
    Refused(String),
    /// The write reached the backend but not enough replicas
    /// (`backend.redis.wait_replicas`); it was undone.
    #[error("not replicated: {0}")]
    NotReplicated(String),
}

/// Receives release notifications from a backend. The sidecar's wait queues
/// implement it; a backend calls it from its notification path.
pub trait WakeSink: Send + Sync + 'static {
    /// `key` was released: wake the first waiter for it.
    fn released(&self, key: &str);
    /// Notifications may have been missed (e.g. a reconnect): every queue
    /// re-checks.
    fn resync(&self);
}

/// Keeps release notifications for one key flowing while it lives.
pub struct WatchGuard(#[allow(dead_code)] Option<Box<dyn Send + Sync>>);

impl WatchGuard {
    pub fn none() -> Self {
        WatchGuard(None)
    }
    pub fn new(inner: impl Send + Sync + 'static) -> Self {
        WatchGuard(Some(Box::new(inner)))
    }
    /// Whether nothing is watched: the waiter asks again after its next
    /// try found the key held (the holder may now be one that can be
    /// watched).
    pub fn is_none(&self) -> bool {
        self.0.is_none()
    }
}

#[async_trait]
pub trait LockBackend: Send + Sync + 'static {
    /// A short stable name for metrics and logs ("memory", "redis").
    fn name(&self) -> &'static str;

    async fn try_acquire(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Attempt, BackendError>;

    /// Compare-and-extend: sets the remaining TTL to `ttl` if `lease` holds `key`.
    async fn renew(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Ownership, BackendError>;

    /// Renews many leases in as few round trips as the backend allows
    /// (sidecar-driven renewal). One result per item, in order; a lease
    /// that is not renewed is reported `Free` or `OtherHolder`.
    async fn renew_many(
        &self,
        items: &[(LockKey, LeaseId, Duration)],
    ) -> Result<Vec<Ownership>, BackendError> {
        let mut out = Vec::with_capacity(items.len());
        for (key, lease, ttl) in items {
            out.push(self.renew(key, lease, *ttl).await?);
        }
        Ok(out)
    }

    /// Whether each lease still holds its key, changing nothing (after a
    /// failover: does the new master have it?). Only backends that report
    /// [`LockBackend::failovers`] need it.
    async fn check_many(
        &self,
        items: &[(LockKey, LeaseId)],
    ) -> Result<Vec<Ownership>, BackendError> {
        let _ = items;
        Err(BackendError::Protocol(format!(
            "{} does not re-verify leases",
            self.name()
        )))
    }

    /// Bumped each time the backend switched to another server that may
    /// not have every lock write (a Sentinel or Cluster failover). `None`:
    /// the backend has no failovers of its own.
    fn failovers(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }

    /// Compare-and-delete, then notify waiters.
    async fn release(&self, key: &LockKey, lease: &LeaseId) -> Result<Ownership, BackendError>;

    /// Whether a call this sidecar sends reaches the backend after every
    /// call it sent before (one connection, in order): then a waiter here
    /// may try as soon as a release here is on its way, and its try runs
    /// after the release. A hint for speed only — the try is the same
    /// atomic acquire, and one that runs first is answered "held".
    fn orders_calls(&self) -> bool {
        false
    }

    /// Subscribes to release notifications for `key` until the guard drops.
    /// Must be in effect when it returns, so a release that happens after a
    /// failed `try_acquire` is never missed — unless subscribing takes longer
    /// than `timeout`, after which it returns anyway (the waiter then relies
    /// on its fallback timer).
    async fn watch(&self, key: &LockKey, timeout: Duration) -> WatchGuard;

    /// Raises `key`'s token counter to at least `floor`, so the next token
    /// is above a mark the gateway has already seen (repair after the
    /// backend lost its counter).
    async fn raise_token_floor(&self, key: &LockKey, floor: u64) -> Result<(), BackendError>;

    /// Whether a `Held` answer may leave the lease id queued in the
    /// backend (ZooKeeper: its node stays in the key's queue to keep its
    /// place). Such a lease id is released like a holder's when its acquire
    /// ends without the lock, so no queue entry outlives its waiter.
    fn held_keeps_a_place(&self) -> bool {
        false
    }

    /// The longest lease TTL this backend can keep safe (RedLock: its
    /// restart quarantine); longer acquires and renewals are refused.
    fn max_ttl(&self) -> Option<Duration> {
        None
    }

    /// What sets [`LockBackend::max_ttl`], for the error that refuses a
    /// longer lease.
    fn max_ttl_why(&self) -> &'static str {
        ""
    }

    /// Whether the backend keeps reader sets (read-write locks): a call
    /// whose key [`LockKey::is_reader`] acts on the key's readers — an
    /// acquire joins them unless a write lease holds the key or a writer
    /// waits for it (writer preference), renew and release act on the
    /// lease's reader entry — and a write lease's acquire finds the key
    /// held while any reader holds it. A reader's token comes from the
    /// key's one counter, and the last reader's release wakes the key's
    /// waiters.
    fn supports_read_locks(&self) -> bool {
        false
    }

    /// Whether [`LockBackend::holds`] is implemented (reentrant acquires).
    fn supports_reentrancy(&self) -> bool {
        false
    }

    /// Reads, or compare-and-sets, the hold count recorded with `lease` on
    /// `key` (reentrancy; see [`HoldsChange`]). Only while `lease` holds
    /// the key; a count recorded for an earlier lease counts as none.
    async fn holds(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        change: HoldsChange<'_>,
    ) -> Result<Holds, BackendError> {
        let _ = (key, lease, change);
        Err(BackendError::Protocol(format!(
            "{} keeps no hold counts",
            self.name()
        )))
    }

    /// What the backend records for `key` now ([`KeyView`]), read in one
    /// request bounded by the backend's request timeout.
    async fn inspect(&self, key: &LockKey) -> Result<KeyView, BackendError>;

    /// Fixes semaphore `name`'s permit count at `permits` unless it is
    /// fixed already, and answers the count that stands (the first one
    /// recorded). Never expires: a smaller count fixed later while a
    /// permit above it is still held would let more holders in than the
    /// new count ([`crate::sidecar`]'s semaphores).
    async fn fix_permits(&self, name: &LockKey, permits: u32) -> Result<u32, BackendError>;

    /// Cheap reachability check for `/readyz`.
    async fn ping(&self) -> Result<(), BackendError>;
}

pub type DynBackend = Arc<dyn LockBackend>;

/// A batch operation (`renew_many`, `check_many`) over `items` of which
/// some are read leases' ([`LockKey::is_reader`]): the others go through
/// `batch` as one, each reader's through `one` — a backend whose batch
/// statement knows only write leases. Results in `items`' order.
pub async fn readers_apart<'a, T, B, O, FB, FO>(
    items: &'a [T],
    is_reader: impl Fn(&T) -> bool,
    batch: B,
    one: O,
) -> Result<Vec<Ownership>, BackendError>
where
    T: Clone,
    B: FnOnce(Vec<T>) -> FB,
    FB: std::future::Future<Output = Result<Vec<Ownership>, BackendError>>,
    O: Fn(&'a T) -> FO,
    FO: std::future::Future<Output = Result<Ownership, BackendError>>,
{
    let (readers, writers): (Vec<_>, Vec<_>) =
        items.iter().enumerate().partition(|(_, t)| is_reader(t));
    let mut out = vec![Ownership::Free; items.len()];
    let rest: Vec<T> = writers.iter().map(|(_, t)| (*t).clone()).collect();
    if !rest.is_empty() {
        for ((i, _), o) in writers.iter().zip(batch(rest).await?) {
            out[*i] = o;
        }
    }
    for (i, t) in readers {
        out[i] = one(t).await?;
    }
    Ok(out)
}
