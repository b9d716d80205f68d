//! The etcd backend: etcd's own lock recipe (the `concurrency` package's
//! queue, lowest creation revision holds) with the fencing token etcd's
//! documentation recommends — the holder key's creation revision.
//!
//! A contender puts a key of its own, a *place*, under the lock key's
//! queue ([`place`]) with a transaction that creates it only if absent,
//! and reads the queue's first place in the same transaction. The place
//! created first holds; the others wait for a deletion under the queue
//! ([`watcher`]) and try again. Revisions are assigned by the leader in
//! commit order and never go back while the cluster keeps its data, so a
//! holder's creation revision is above that of every place that held
//! before it: token = creation revision + the token offset in force when
//! the place was created (a repair raises the offset, `raise_token_floor`;
//! a cluster restored from an old snapshot starts its revisions over below
//! tokens already issued, and pre-registration raises the offset past the
//! gateway's marks).
//!
//! **Why an etcd lease per place, not one per sidecar session.** etcd's
//! recipe attaches every key of a client to one session lease. Then a
//! sidecar that dies (`kill -9`, a lost node) keeps its locks for the
//! session TTL, whatever their own TTL — and etcd's keys carry no server
//! time from which other sidecars could tell a dead holder's TTL has
//! passed (ZooKeeper's `mtime` lets fencer do that there). Here each place
//! has an etcd lease of its own, granted for the lease's TTL plus the
//! lock-delay (rounded up to etcd's whole seconds): a dead sidecar's keys
//! are free after that, on etcd's clock. A live sidecar ends a lease
//! precisely on its own clock ([`sweeper`]): it deletes the place when the
//! TTL passes without a renewal — or, with a lock-delay, marks it expired
//! and deletes it when the delay ends. A waiting place's etcd lease is
//! kept alive by its sidecar while it waits; a holder's only by renewals,
//! so it can never outlive the lease by more than the rounding.
//!
//! Every acquisition rests on writes sent during the try that returns it:
//! a grant or keepalive of the place's etcd lease (so it lasts the TTL and
//! delay from the try's start), then the transaction that writes the
//! place. A read alone could be answered by a member cut off from the
//! leader; a write commits through the leader. Every write to a place
//! compares its creation revision, so it never touches a place made again
//! under the same name.
//!
//! One acquire try, renewal or release is bounded as a whole by
//! `request_timeout_ms`. A sidecar keeps at most one place per key: its
//! local FIFO sends only the head waiter to the backend and each try uses
//! a new lease id, so a place belongs to the newest lease id that tried it,
//! and releasing an older id leaves it alone
//! ([`LockBackend::held_keeps_a_place`]).

pub mod place;
pub mod settings;
mod sweeper;
mod watcher;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use self::place::Value;
use self::settings::EtcdSettings;
use super::{
    Attempt, BackendError, HolderView, Holds, HoldsChange, KeyView, LeaseId, LockBackend, LockKey,
    Ownership, WakeSink, WatchGuard,
};
use crate::etcd::wire::{Compare, KeyValue, Op, OpResponse, RangeResponse, TxnResponse};
use crate::etcd::{EtcdClient, EtcdError, Retry};
use crate::metrics::etcd::EtcdLockMetrics;

/// Creates and rewrites retried within one try when the queue changed
/// under it (its place lapsed, the offset moved).
const ROUNDS: usize = 4;

pub struct EtcdBackend {
    inner: Arc<Inner>,
}

struct Inner {
    client: Arc<EtcdClient>,
    root: String,
    timeout: Duration,
    lock_delay: Duration,
    /// This sidecar's place per key (at most one).
    slots: Mutex<HashMap<LockKey, Slot>>,
    /// Each key's watch, shared by its waiters here: one stream per key,
    /// not one per waiter (with many waiters on one key, a stream opened
    /// at every handover).
    watches: Mutex<HashMap<LockKey, std::sync::Weak<watcher::Shared>>>,
    /// Places to delete whose deletion failed, until their etcd lease
    /// would have lapsed anyway.
    doomed: Mutex<Vec<Doomed>>,
    /// The token offset as last seen: its key's last write and its value.
    offset: Mutex<(i64, u64)>,
    /// etcd leases whose one place was deleted (confirmed by the delete's
    /// comparison): the next place takes one with a keepalive — handled
    /// by the leader alone — instead of a grant, a replicated write; and
    /// no lease is left to lapse and be revoked (another replicated
    /// write) per lock cycle. Never a lease whose place's fate is unknown:
    /// keeping it alive could keep a forgotten place alive with it.
    spare: Mutex<Vec<Spare>>,
    wake: Arc<dyn WakeSink>,
    metrics: Arc<EtcdLockMetrics>,
}

/// One key's place, its calls one at a time; the newest revision a try
/// saw of its queue, where a watch starts so it misses nothing after it.
#[derive(Clone)]
struct Slot(Arc<SlotInner>);

struct SlotInner {
    entry: Arc<tokio::sync::Mutex<Entry>>,
    seen_revision: AtomicI64,
    /// A lease of this sidecar holds the key (or its place stands for its
    /// lock-delay): read without waiting for the entry, by `watch`.
    held_here: AtomicBool,
}

/// This sidecar's place in one key's queue.
struct Entry {
    key: LockKey,
    queue: Vec<u8>,
    place: Vec<u8>,
    /// The etcd lease the place is attached to and the TTL granted.
    etcd_lease: Option<(i64, Duration)>,
    /// The place's creation revision, once a create or a read showed it.
    created: Option<i64>,
    /// The etcd lease the place is on as this process last wrote or read
    /// it (0: not known). Every write compares it: a sidecar that adopted
    /// the lease id while this process lives (a client that renewed
    /// through it) moves the place to an etcd lease of its own, and this
    /// process's sweeper, drain or late call must not end the place it
    /// now answers for.
    on_lease: i64,
    /// The newest lease id that tried the place: only it may release it.
    lease: LeaseId,
    /// What the place says, as last written.
    value: Value,
    state: State,
    /// When the etcd lease was last granted or kept alive (a waiting
    /// place's is kept alive every third of its TTL).
    kept_at: Instant,
    /// Taken out of the map: a call that held it must not use it again.
    gone: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    Held {
        token: u64,
        expires: Instant,
    },
    /// The holder's TTL passed without a renewal; the place stays, marked
    /// expired, until the lock-delay ends.
    Expired {
        until: Instant,
    },
}

/// An etcd lease with no key on it, and when it was last kept alive.
struct Spare {
    id: i64,
    granted: Duration,
    kept_at: Instant,
}

/// Spare leases kept at most (the rest lapse on their own).
const SPARES: usize = 64;

struct Doomed {
    place: Vec<u8>,
    created: Option<i64>,
    until: Instant,
}

fn unavailable(e: EtcdError) -> BackendError {
    match e {
        EtcdError::Protocol(m) => BackendError::Protocol(format!("etcd: {m}")),
        other => BackendError::Unavailable(other.to_string()),
    }
}

/// Whether etcd refused a write because its lease is gone (the place
/// attached to it went with it).
fn lease_gone(e: &EtcdError) -> bool {
    matches!(e, EtcdError::Rejected { message, .. } if message.contains("lease not found"))
}

/// An etcd lease long enough for `life`: whole seconds, rounded up.
fn lease_secs(life: Duration) -> Duration {
    Duration::from_secs((life.as_millis().div_ceil(1000)).max(1) as u64)
}

fn token_of(created: i64, value: &Value) -> u64 {
    if crate::mutants::active("etcd_token_per_place") {
        return value.offset + 1;
    }
    if crate::mutants::active("etcd_token_ignores_offset") {
        return created.max(0) as u64;
    }
    (created.max(0) as u64).saturating_add(value.offset)
}

/// When a lease taken or renewed by a call sent at `sent` ends here.
fn expiry(sent: Instant, ttl: Duration) -> Instant {
    if crate::mutants::active("etcd_early_expiry") {
        return sent + ttl / 2;
    }
    sent + ttl
}

/// The range answer at `at` of a transaction's branch.
fn range_at(t: &TxnResponse, at: usize) -> Result<&RangeResponse, BackendError> {
    match t.responses.get(at) {
        Some(OpResponse::Range(r)) => Ok(r),
        other => Err(BackendError::Protocol(format!(
            "etcd: a transaction answered {other:?} where a range was asked"
        ))),
    }
}

/// What the first place of a queue tells a try that is not it.
fn not_first(first: Option<&KeyValue>) -> Attempt {
    match first.and_then(|kv| Value::parse(&kv.value)) {
        Some(v) if v.expired => Attempt::Delayed {
            remaining: v.delay.max(Duration::from_millis(1)),
        },
        Some(v) => Attempt::Held {
            remaining: Some(v.ttl),
        },
        None => Attempt::Held { remaining: None },
    }
}

impl EtcdBackend {
    pub fn new(
        settings: &EtcdSettings,
        lock_delay: Duration,
        wake: Arc<dyn WakeSink>,
        registry: &prometheus::Registry,
    ) -> Result<EtcdBackend, BackendError> {
        let config = settings
            .client_config()
            .map_err(|e| BackendError::Protocol(e.to_string()))?;
        let client = EtcdClient::new(&config).map_err(BackendError::Protocol)?;
        let inner = Arc::new(Inner {
            client: Arc::new(client),
            root: settings.prefix.clone(),
            timeout: settings.request_timeout(),
            lock_delay,
            slots: Mutex::new(HashMap::new()),
            watches: Mutex::new(HashMap::new()),
            doomed: Mutex::new(Vec::new()),
            offset: Mutex::new((0, 0)),
            spare: Mutex::new(Vec::new()),
            wake,
            metrics: Arc::new(EtcdLockMetrics::new(registry)),
        });
        sweeper::spawn(Arc::downgrade(&inner));
        Ok(EtcdBackend { inner })
    }
}

impl Inner {
    fn slot(&self, key: &LockKey) -> Option<Slot> {
        self.slots.lock().expect("slots").get(key).cloned()
    }

    /// This key's slot, made for `lease` if there is none.
    fn slot_or_new(&self, key: &LockKey, lease: &LeaseId) -> Slot {
        let mut slots = self.slots.lock().expect("slots");
        slots
            .entry(key.clone())
            .or_insert_with(|| {
                let queue = place::queue(&self.root, key.as_str());
                Slot::new(Entry {
                    key: key.clone(),
                    place: place::new_place(&queue),
                    queue,
                    etcd_lease: None,
                    created: None,
                    on_lease: 0,
                    lease: lease.clone(),
                    value: Value::new(0, lease.as_str(), Duration::ZERO, Duration::ZERO),
                    state: State::Waiting,
                    kept_at: Instant::now(),
                    gone: false,
                })
            })
            .clone()
    }

    /// Takes `e`'s slot out of the map (if it is still there).
    fn forget(&self, e: &mut Entry, slot: &Slot) {
        e.gone = true;
        slot.0.held_here.store(false, Ordering::Relaxed);
        let mut slots = self.slots.lock().expect("slots");
        if slots
            .get(&e.key)
            .is_some_and(|s| Arc::ptr_eq(&s.0, &slot.0))
        {
            slots.remove(&e.key);
        }
    }

    /// Deletes `e`'s place later (a waiter's release that failed): the
    /// sweeper tries until the place's etcd lease would have lapsed.
    fn doom(&self, e: &Entry) {
        let granted = e.etcd_lease.map_or(Duration::ZERO, |(_, g)| g);
        self.doomed.lock().expect("doomed").push(Doomed {
            place: e.place.clone(),
            created: e.created,
            until: e.kept_at + granted,
        });
    }

    fn event(&self, event: &str) {
        self.metrics.events.with_label_values(&[event]).inc();
    }

    /// What a write on a held place came to: `true` written; `false` the
    /// place is gone (lapsed with its etcd lease, or deleted) and the slot
    /// with it.
    fn settle(
        &self,
        e: &mut Entry,
        slot: &Slot,
        answer: Result<TxnResponse, EtcdError>,
    ) -> Result<bool, BackendError> {
        let written = match answer {
            Ok(t) => t.succeeded,
            Err(err) if lease_gone(&err) => false,
            Err(err) => return Err(unavailable(err)),
        };
        if !written {
            self.lapsed(e);
            self.forget(e, slot);
        }
        Ok(written)
    }

    /// Runs `ops` if `e`'s place is still the one it created, on the etcd
    /// lease it left it on.
    async fn on_place(
        &self,
        e: &Entry,
        ops: &[Op],
        deadline: Instant,
    ) -> Result<TxnResponse, EtcdError> {
        let created = Compare::created(&e.place, e.created.unwrap_or(0));
        let compares = match e.on_lease {
            0 => vec![created],
            id => vec![created, Compare::leased(&e.place, id)],
        };
        self.client
            .txn(&compares, ops, &[], deadline, Retry::Idempotent)
            .await
    }

    /// The etcd lease `e`'s place is to be written with, to last `life`
    /// from now: the one it has or a spare, with the keepalive that makes
    /// it last still to be sent (`Some(id)`: sent beside the write, one
    /// round trip for both), or a new one granted now (`None`).
    async fn lease_for(
        &self,
        e: &mut Entry,
        life: Duration,
        deadline: Instant,
    ) -> Result<Option<i64>, BackendError> {
        match e.etcd_lease {
            Some((id, granted)) if granted >= life => return Ok(Some(id)),
            None => {
                if let Some((id, granted)) = self.take_spare(life) {
                    e.etcd_lease = Some((id, granted));
                    return Ok(Some(id));
                }
            }
            Some(_) => {}
        }
        let sent = Instant::now();
        self.grant(e, life, deadline).await?;
        e.kept_at = sent;
        Ok(None)
    }

    /// Runs `write` beside the keepalive of `keep` (from
    /// [`Self::lease_for`]); the keepalive's answer: `Ok(None)` when none
    /// was sent, `Ok(Some((id, ttl, sent)))` with the TTL it gave (0: the
    /// lease had lapsed — and the place with it, whatever the write
    /// answered). An unanswered keepalive is an error even when the write
    /// went through: the place may not last its TTL.
    async fn kept_while<T>(
        &self,
        keep: Option<i64>,
        deadline: Instant,
        write: impl std::future::Future<Output = T>,
    ) -> (T, Result<Option<(i64, i64, Instant)>, BackendError>) {
        let Some(id) = keep else {
            return (write.await, Ok(None));
        };
        let sent = Instant::now();
        let (answer, kept) = tokio::join!(write, self.client.keep_alive(id, deadline));
        (
            answer,
            kept.map(|k| Some((id, k.ttl, sent))).map_err(unavailable),
        )
    }

    /// Records a keepalive's answer on `e`; `false`: the lease had lapsed.
    fn kept(e: &mut Entry, kept: Option<(i64, i64, Instant)>) -> bool {
        match kept {
            None => true,
            Some((_, ttl, _)) if ttl <= 0 => false,
            Some((id, ttl, sent)) => {
                e.etcd_lease = Some((id, Duration::from_secs(ttl as u64)));
                e.kept_at = sent;
                true
            }
        }
    }

    async fn grant(
        &self,
        e: &mut Entry,
        life: Duration,
        deadline: Instant,
    ) -> Result<(), BackendError> {
        let g = self
            .client
            .grant(lease_secs(life), deadline)
            .await
            .map_err(unavailable)?;
        e.etcd_lease = Some((g.id, Duration::from_secs(g.ttl.max(0) as u64)));
        Ok(())
    }

    /// A spare lease granted for at least `life` — and at most twice what
    /// a grant for it would ask, so a dead sidecar's key is not blocked
    /// far longer than its TTL — with at least half its TTL left (one
    /// closer to lapsing may lapse before its keepalive).
    fn take_spare(&self, life: Duration) -> Option<(i64, Duration)> {
        let now = Instant::now();
        let most = lease_secs(life) * 2;
        let mut spare = self.spare.lock().expect("spare");
        spare.retain(|s| s.kept_at + s.granted / 2 > now);
        let at = spare
            .iter()
            .rposition(|s| s.granted >= life && s.granted <= most)?;
        let s = spare.swap_remove(at);
        Some((s.id, s.granted))
    }

    /// `e`'s place was deleted — by a comparison on its creation revision
    /// that held, so no other place is on its lease: the lease is spare.
    fn spare_lease(&self, e: &Entry) {
        if let Some((id, granted)) = e.etcd_lease.filter(|(_, g)| !g.is_zero()) {
            let mut spare = self.spare.lock().expect("spare");
            if spare.len() < SPARES {
                spare.push(Spare {
                    id,
                    granted,
                    kept_at: e.kept_at,
                });
            }
        }
    }

    /// The place lapsed with its etcd lease (or was deleted): the next
    /// round creates a new one, at the end of the queue.
    fn lapsed(&self, e: &mut Entry) {
        if e.created.is_some() {
            self.event("lapsed");
            tracing::warn!(key = %e.key, "etcd: this sidecar's place in the lock queue lapsed with its etcd lease, or another process of this sidecar took it over; looking again");
        }
        e.created = None;
        e.etcd_lease = None;
        e.on_lease = 0;
    }

    /// Records in `e.on_lease` what a write of `e`'s place attached to
    /// `lease` came to: written, the place is on `lease`; unanswered, on
    /// it or on the one before — unknown, unless they are the same (the
    /// next write then compares the creation revision alone).
    fn wrote(e: &mut Entry, lease: i64, answer: &Result<TxnResponse, EtcdError>) {
        match answer {
            Ok(t) if t.succeeded => e.on_lease = lease,
            Ok(_) => {}
            Err(_) if e.on_lease != lease => e.on_lease = 0,
            Err(_) => {}
        }
    }

    /// One round of a try: the place's lease made to last, then the place
    /// written (created if it does not exist) with the queue's first place
    /// read at the same revision. `None`: the place changed under the try
    /// (lapsed, found from an earlier create, the offset moved): again.
    async fn round(
        &self,
        slot: &Slot,
        e: &mut Entry,
        lease: &LeaseId,
        ttl: Duration,
        sent: Instant,
        deadline: Instant,
    ) -> Result<Option<Attempt>, BackendError> {
        let keep = self.lease_for(e, ttl + self.lock_delay, deadline).await?;
        let (etcd_lease, _) = e.etcd_lease.expect("a lease");
        let offset_key = place::offset(&self.root);
        let (offset_rev, offset) = *self.offset.lock().expect("offset");
        let offset = e.created.map_or(offset, |_| e.value.offset);
        let value = Value::new(offset, lease.as_str(), ttl, self.lock_delay);
        let put = Op::Put {
            key: e.place.clone(),
            value: value.encode(),
            lease: etcd_lease,
        };
        let first = Op::First {
            prefix: e.queue.clone(),
        };
        let write = async {
            match e.created {
                Some(_) => self.on_place(e, &[put, first], deadline).await,
                None => {
                    self.client
                        .txn(
                            &[
                                Compare::absent(&e.place),
                                Compare::unchanged(&offset_key, offset_rev),
                            ],
                            &[put, first],
                            &[
                                Op::Get {
                                    key: e.place.clone(),
                                },
                                Op::Get { key: offset_key },
                            ],
                            deadline,
                            Retry::Idempotent,
                        )
                        .await
                }
            }
        };
        let (answer, kept) = self.kept_while(keep, deadline, write).await;
        Self::wrote(e, etcd_lease, &answer);
        if !Self::kept(e, kept?) {
            self.lapsed(e);
            return Ok(None);
        }
        let t = match answer {
            Ok(t) => t,
            Err(err) if lease_gone(&err) => {
                self.lapsed(e);
                return Ok(None);
            }
            Err(err) => return Err(unavailable(err)),
        };
        if !t.succeeded {
            if e.created.is_some() {
                self.lapsed(e);
                return Ok(None);
            }
            // Our place exists already (a create whose answer was lost),
            // or the offset moved.
            if let Some(kv) = range_at(&t, 1)?.kvs.first() {
                let now = (
                    kv.mod_revision,
                    std::str::from_utf8(&kv.value)
                        .ok()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0),
                );
                if now.0 != offset_rev {
                    self.event("offset_conflict");
                }
                *self.offset.lock().expect("offset") = now;
            } else {
                *self.offset.lock().expect("offset") = (0, 0);
            }
            if let Some(kv) = range_at(&t, 0)?.kvs.first() {
                e.created = Some(kv.create_revision);
                e.on_lease = kv.lease;
                if let Some(v) = Value::parse(&kv.value) {
                    e.value = v;
                }
                if Some(kv.lease) != e.etcd_lease.map(|(id, _)| id) {
                    // Made under a lease this entry no longer names: the
                    // next round moves it to a new one.
                    e.etcd_lease = None;
                }
            }
            return Ok(None);
        }
        let created = e.created.unwrap_or(t.header.revision);
        if e.created.is_none() {
            self.event("created");
        }
        e.created = Some(created);
        e.value = value;
        slot.0
            .seen_revision
            .fetch_max(t.header.revision, Ordering::Relaxed);
        let first = range_at(&t, 1)?.kvs.first();
        if first.is_some_and(|kv| kv.key == e.place) {
            let token = token_of(created, &e.value);
            e.state = State::Held {
                token,
                expires: expiry(sent, ttl),
            };
            slot.0.held_here.store(true, Ordering::Relaxed);
            return Ok(Some(Attempt::Acquired { token }));
        }
        Ok(Some(not_first(first)))
    }

    /// The slot of `lease` on `key`: this process's, or — a lease of an
    /// earlier process of this sidecar (a restart), found by its id as the
    /// queue's first place — adopted. `Err`: the lease holds nothing here.
    /// `renewing`: the caller writes the place at once, and its write's
    /// comparisons decide; a lease whose place still stands is adopted for
    /// it, however little of its TTL is known to be left (etcd tells a
    /// lease's time in whole seconds: a short TTL would never be).
    async fn holder_slot(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        deadline: Instant,
        renewing: bool,
    ) -> Result<Result<Slot, Ownership>, BackendError> {
        // This process's slot answers for the key, whichever lease it is.
        if let Some(slot) = self.slot(key) {
            return Ok(Ok(slot));
        }
        let queue = place::queue(&self.root, key.as_str());
        let r = self
            .client
            .first(&queue, deadline)
            .await
            .map_err(unavailable)?;
        let Some(kv) = r.kvs.first() else {
            return Ok(Err(Ownership::Free));
        };
        let Some(value) = Value::parse(&kv.value) else {
            return Ok(Err(Ownership::OtherHolder));
        };
        if value.lease != lease.as_str() {
            return Ok(Err(Ownership::OtherHolder));
        }
        if value.expired {
            return Ok(Err(Ownership::Free));
        }
        // The earlier process's deadline is not written anywhere; the
        // place's etcd lease tells when the place goes: it was granted or
        // kept alive for the TTL plus the lock-delay (and rounding) at the
        // last renewal, so that much before its end the TTL ran out. Never
        // later than the place lasts, whoever renews it no more.
        let left = self
            .client
            .time_to_live(kv.lease, deadline)
            .await
            .map_err(unavailable)?;
        // -1: the lease is gone (its place with it); 0: under a second left.
        if left.ttl < 0 {
            return Ok(Err(Ownership::Free));
        }
        let after_ttl =
            Duration::from_secs(left.granted_ttl.max(0) as u64).saturating_sub(value.ttl);
        let held_for = match Duration::from_secs(left.ttl as u64).checked_sub(after_ttl) {
            Some(d) => d,
            None if renewing => Duration::ZERO,
            None => return Ok(Err(Ownership::Free)),
        };
        let token = token_of(kv.create_revision, &value);
        let entry = Entry {
            key: key.clone(),
            queue,
            place: kv.key.clone(),
            // Its grant is unknown: the first renewal moves the place to a
            // lease of its own.
            etcd_lease: Some((kv.lease, Duration::ZERO)),
            created: Some(kv.create_revision),
            on_lease: kv.lease,
            lease: lease.clone(),
            value: value.clone(),
            state: State::Held {
                token,
                expires: Instant::now() + held_for.min(value.ttl),
            },
            kept_at: Instant::now(),
            gone: false,
        };
        self.event("adopted");
        tracing::info!(key = %key, lease = %lease.tag(), "etcd: adopted a lease of an earlier process of this sidecar");
        // Should a waiter of this process have taken the key's slot
        // meanwhile, that one answers (the adopted lease is then told it
        // holds nothing: lost early, the safe side).
        let slot = Slot::new(entry);
        slot.0.held_here.store(true, Ordering::Relaxed);
        let mut slots = self.slots.lock().expect("slots");
        Ok(Ok(slots.entry(key.clone()).or_insert(slot).clone()))
    }
}

impl Slot {
    fn new(entry: Entry) -> Slot {
        Slot(Arc::new(SlotInner {
            entry: Arc::new(tokio::sync::Mutex::new(entry)),
            seen_revision: AtomicI64::new(0),
            held_here: AtomicBool::new(false),
        }))
    }
}

/// `slot`'s entry, once the calls before this one on its key are done —
/// within `deadline`.
async fn lock(
    slot: &Slot,
    deadline: Instant,
) -> Result<tokio::sync::MutexGuard<'_, Entry>, BackendError> {
    tokio::time::timeout_at(deadline, slot.0.entry.lock())
        .await
        .map_err(|_| {
            BackendError::Unavailable(
                "etcd: an earlier call on this key took the request's budget (backend.etcd.request_timeout_ms)"
                    .into(),
            )
        })
}

#[async_trait]
impl LockBackend for EtcdBackend {
    fn name(&self) -> &'static str {
        "etcd"
    }

    async fn try_acquire(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Attempt, BackendError> {
        let i = &self.inner;
        let sent = Instant::now();
        let deadline = sent + i.timeout;
        // Twice: the slot found may be taken out of the map meanwhile.
        for _ in 0..2 {
            let slot = i.slot_or_new(key, lease);
            let mut e = lock(&slot, deadline).await?;
            if e.gone {
                continue;
            }
            match e.state {
                State::Held { token, expires } if e.lease == *lease && expires > sent => {
                    return Ok(Attempt::Acquired { token });
                }
                // Another lease of this sidecar holds it (or this one, past
                // its TTL: the sweeper ends it next).
                State::Held { expires, .. } => {
                    return Ok(Attempt::Held {
                        remaining: Some(expires.saturating_duration_since(Instant::now())),
                    });
                }
                State::Expired { until } => {
                    return Ok(Attempt::Delayed {
                        remaining: until
                            .saturating_duration_since(Instant::now())
                            .max(Duration::from_millis(1)),
                    });
                }
                State::Waiting => {}
            }
            e.lease = lease.clone();
            for _ in 0..ROUNDS {
                if let Some(attempt) = i.round(&slot, &mut e, lease, ttl, sent, deadline).await? {
                    return Ok(attempt);
                }
            }
            return Err(BackendError::Unavailable(
                "etcd: the key's queue kept changing under the try".into(),
            ));
        }
        Err(BackendError::Unavailable(
            "etcd: the key's place kept being removed under the try".into(),
        ))
    }

    async fn renew(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Ownership, BackendError> {
        let i = &self.inner;
        let sent = Instant::now();
        let deadline = sent + i.timeout;
        // Twice: a place another process of this sidecar moved to an etcd
        // lease of its own (it adopted the lease id: the client renewed
        // through it) is looked up again and adopted back.
        for _ in 0..2 {
            let slot = match i.holder_slot(key, lease, deadline, true).await? {
                Ok(slot) => slot,
                Err(found) => return Ok(found),
            };
            let mut e = lock(&slot, deadline).await?;
            if e.gone {
                return Ok(Ownership::Free);
            }
            let token = match e.state {
                // Past its TTL on this clock: never brought back (the sweeper
                // ends it, with its lock-delay).
                State::Held { expires, .. } if e.lease == *lease && expires <= sent => {
                    return Ok(Ownership::Free)
                }
                State::Held { token, .. } if e.lease == *lease => token,
                State::Held { .. } => return Ok(Ownership::OtherHolder),
                _ if e.lease == *lease => return Ok(Ownership::Free),
                _ => return Ok(Ownership::OtherHolder),
            };
            let keep = i.lease_for(&mut e, ttl + i.lock_delay, deadline).await?;
            let (etcd_lease, _) = e.etcd_lease.expect("a lease");
            let mut value = e.value.clone();
            value.ttl = ttl;
            let put = Op::Put {
                key: e.place.clone(),
                value: value.encode(),
                lease: etcd_lease,
            };
            let (answer, kept) = i
                .kept_while(keep, deadline, i.on_place(&e, &[put], deadline))
                .await;
            Inner::wrote(&mut e, etcd_lease, &answer);
            if !Inner::kept(&mut e, kept?) {
                i.lapsed(&mut e);
                i.forget(&mut e, &slot);
                return Ok(Ownership::Free);
            }
            if !i.settle(&mut e, &slot, answer)? {
                continue;
            }
            e.value = value;
            e.state = State::Held {
                token,
                expires: expiry(sent, ttl),
            };
            return Ok(Ownership::Owned { token });
        }
        Ok(Ownership::Free)
    }

    async fn release(&self, key: &LockKey, lease: &LeaseId) -> Result<Ownership, BackendError> {
        let i = &self.inner;
        let deadline = Instant::now() + i.timeout;
        // Twice, as for a renewal: a place another process moved to an
        // etcd lease of its own is looked up again.
        for _ in 0..2 {
            let slot = match i.holder_slot(key, lease, deadline, false).await? {
                Ok(slot) => slot,
                Err(found) => return Ok(found),
            };
            let mut e = lock(&slot, deadline).await?;
            if e.gone {
                return Ok(Ownership::Free);
            }
            if e.lease != *lease {
                // A newer try of this sidecar owns the place now.
                return Ok(match e.state {
                    State::Held { .. } => Ownership::OtherHolder,
                    _ => Ownership::Free,
                });
            }
            return match e.state {
                // Its TTL passed: the lock-delay stands (the sweeper ends a
                // lease just past its TTL within a sweep).
                State::Expired { .. } => Ok(Ownership::Free),
                State::Held { expires, .. } if expires <= Instant::now() => Ok(Ownership::Free),
                State::Held { token, .. } => {
                    let delete = Op::Delete {
                        key: e.place.clone(),
                    };
                    let t = i
                        .on_place(&e, &[delete], deadline)
                        .await
                        .map_err(unavailable)?;
                    i.forget(&mut e, &slot);
                    i.wake.released(key.as_str());
                    if !t.succeeded {
                        // Gone, or moved by another process of this sidecar
                        // that adopted the lease id: looked up again.
                        continue;
                    }
                    i.spare_lease(&e);
                    return Ok(Ownership::Owned { token });
                }
                State::Waiting => {
                    // A waiter that gave up: its place goes, now or later.
                    if e.etcd_lease.is_some() && !crate::mutants::active("etcd_waiter_place_left") {
                        let done = match e.created {
                            Some(_) => {
                                let delete = Op::Delete {
                                    key: e.place.clone(),
                                };
                                i.on_place(&e, &[delete], deadline).await.map(|t| {
                                    if t.succeeded {
                                        i.spare_lease(&e);
                                    }
                                })
                            }
                            // A create may have been sent: delete by name.
                            None => i.client.delete(&e.place, deadline).await.map(drop),
                        };
                        if let Err(err) = done {
                            i.event("cleanup_retry");
                            tracing::warn!(key = %key, error = %err, "etcd: deleting a waiter's place failed; the sweeper tries again");
                            i.doom(&e);
                        }
                    }
                    i.forget(&mut e, &slot);
                    Ok(Ownership::Free)
                }
            };
        }
        Ok(Ownership::Free)
    }

    async fn watch(&self, key: &LockKey, timeout: Duration) -> WatchGuard {
        let i = &self.inner;
        // A lease of this sidecar holds the key: its end — a release, or
        // the sweeper's delete — wakes the waiters here directly, so no
        // watch stream is opened (one per handover, with many waiters on
        // one key here). Once another sidecar holds it, the waiter's next
        // try finds it held and watches.
        if i.slot(key)
            .is_some_and(|s| s.0.held_here.load(Ordering::Relaxed))
        {
            return WatchGuard::none();
        }
        // Another waiter here watches the key already: its stream, opened
        // earlier and followed since, sees every deletion from now on.
        let live = i
            .watches
            .lock()
            .expect("watches")
            .get(key)
            .and_then(|w| w.upgrade());
        if let Some(shared) = live {
            return WatchGuard::new(shared);
        }
        let queue = place::queue(&i.root, key.as_str());
        // From just after what this sidecar's last try saw: a deletion
        // between that try and now is not missed. Else from now.
        let seen = i
            .slot(key)
            .map_or(0, |s| s.0.seen_revision.load(Ordering::Relaxed));
        let start = if seen > 0 { seen + 1 } else { 0 };
        let Some(shared) = watcher::start(
            i.client.clone(),
            queue,
            key.clone(),
            start,
            Instant::now() + timeout,
            i.wake.clone(),
        )
        .await
        else {
            return WatchGuard::none();
        };
        let mut watches = i.watches.lock().expect("watches");
        watches.retain(|_, w| w.strong_count() > 0);
        watches.insert(key.clone(), Arc::downgrade(&shared));
        WatchGuard::new(shared)
    }

    async fn raise_token_floor(&self, _key: &LockKey, floor: u64) -> Result<(), BackendError> {
        let i = &self.inner;
        let deadline = Instant::now() + i.timeout;
        let key = place::offset(&i.root);
        for _ in 0..ROUNDS {
            let r = i.client.get(&key, deadline).await.map_err(unavailable)?;
            let (rev, now) = r.kvs.first().map_or((0, 0), |kv| {
                let v = std::str::from_utf8(&kv.value)
                    .ok()
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
                (kv.mod_revision, v)
            });
            // Every place created after the write below has a revision
            // above the one read now, so its token is above `floor`.
            let want = floor.saturating_sub(r.header.revision.max(0) as u64);
            if now >= want {
                *i.offset.lock().expect("offset") = (rev, now);
                return Ok(());
            }
            let t = i
                .client
                .txn(
                    &[Compare::unchanged(&key, rev)],
                    &[Op::Put {
                        key: key.clone(),
                        value: want.to_string().into_bytes(),
                        lease: 0,
                    }],
                    &[],
                    deadline,
                    Retry::Idempotent,
                )
                .await
                .map_err(unavailable)?;
            if t.succeeded {
                tracing::info!(offset = want, floor, "etcd: token offset raised");
                *i.offset.lock().expect("offset") = (t.header.revision, want);
                return Ok(());
            }
        }
        Err(BackendError::Unavailable(
            "etcd: the token offset kept changing".into(),
        ))
    }

    fn held_keeps_a_place(&self) -> bool {
        true
    }

    fn supports_reentrancy(&self) -> bool {
        true
    }

    async fn holds(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        change: HoldsChange<'_>,
    ) -> Result<Holds, BackendError> {
        let i = &self.inner;
        let deadline = Instant::now() + i.timeout;
        let slot = match i.holder_slot(key, lease, deadline, false).await? {
            Ok(slot) => slot,
            Err(Ownership::OtherHolder) => return Ok(Holds::OtherHolder),
            Err(_) => return Ok(Holds::Free),
        };
        let mut e = lock(&slot, deadline).await?;
        if e.gone {
            return Ok(Holds::Free);
        }
        match e.state {
            State::Held { expires, .. } if e.lease == *lease && expires <= Instant::now() => {
                return Ok(Holds::Free)
            }
            State::Held { .. } if e.lease == *lease => {}
            State::Held { .. } => return Ok(Holds::OtherHolder),
            _ if e.lease == *lease => return Ok(Holds::Free),
            _ => return Ok(Holds::OtherHolder),
        }
        let owner_of = |v: &Value| (!v.owner.is_empty()).then(|| v.owner.clone());
        let holds = e.value.holds.max(1);
        let HoldsChange::Set {
            expect,
            to,
            owner,
            op,
        } = change
        else {
            return Ok(Holds::Owned {
                holds,
                owner: owner_of(&e.value),
                applied: false,
            });
        };
        if e.value.op == op || holds != expect {
            return Ok(Holds::Owned {
                holds: if e.value.op == op {
                    e.value.holds
                } else {
                    holds
                },
                owner: owner_of(&e.value),
                applied: e.value.op == op,
            });
        }
        let mut value = e.value.clone();
        value.holds = to;
        value.op = op.to_owned();
        value.owner = owner.to_owned();
        let (etcd_lease, _) = e.etcd_lease.ok_or_else(|| {
            BackendError::Protocol("etcd: a held place without an etcd lease".into())
        })?;
        let put = Op::Put {
            key: e.place.clone(),
            value: value.encode(),
            lease: etcd_lease,
        };
        let answer = i.on_place(&e, &[put], deadline).await;
        Inner::wrote(&mut e, etcd_lease, &answer);
        if !i.settle(&mut e, &slot, answer)? {
            return Ok(Holds::Free);
        }
        e.value = value;
        Ok(Holds::Owned {
            holds: to,
            owner: Some(owner.to_owned()),
            applied: true,
        })
    }

    async fn inspect(&self, key: &LockKey) -> Result<KeyView, BackendError> {
        let i = &self.inner;
        let deadline = Instant::now() + i.timeout;
        let queue = place::queue(&i.root, key.as_str());
        let r = i
            .client
            .first(&queue, deadline)
            .await
            .map_err(unavailable)?;
        let Some(kv) = r.kvs.first() else {
            return Ok(KeyView {
                waiting: Some(0),
                ..KeyView::default()
            });
        };
        let waiting = Some((r.count - 1).max(0) as u64);
        let value = Value::parse(&kv.value).ok_or_else(|| {
            BackendError::Protocol(format!(
                "etcd: a place that is not fencer's: {:?}",
                String::from_utf8_lossy(&kv.value)
            ))
        })?;
        Ok(if value.expired {
            KeyView {
                delayed: Some(value.delay),
                waiting,
                ..KeyView::default()
            }
        } else {
            KeyView {
                holder: Some(HolderView {
                    token: token_of(kv.create_revision, &value),
                    lease: value.lease,
                    remaining: None,
                }),
                waiting,
                ..KeyView::default()
            }
        })
    }

    async fn fix_permits(&self, name: &LockKey, permits: u32) -> Result<u32, BackendError> {
        let i = &self.inner;
        let deadline = Instant::now() + i.timeout;
        let key = place::permits(&i.root, name.as_str());
        let t = i
            .client
            .txn(
                &[Compare::absent(&key)],
                &[Op::Put {
                    key: key.clone(),
                    value: permits.to_string().into_bytes(),
                    lease: 0,
                }],
                &[Op::Get { key }],
                deadline,
                Retry::Idempotent,
            )
            .await
            .map_err(unavailable)?;
        if t.succeeded {
            return Ok(permits);
        }
        let kv = range_at(&t, 0)?.kvs.first().ok_or_else(|| {
            BackendError::Unavailable("etcd: a semaphore's count vanished".into())
        })?;
        std::str::from_utf8(&kv.value)
            .ok()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| {
                BackendError::Protocol("etcd: a semaphore's count is not a number".into())
            })
    }

    async fn ping(&self) -> Result<(), BackendError> {
        let i = &self.inner;
        i.client
            .get(&place::offset(&i.root), Instant::now() + i.timeout)
            .await
            .map(drop)
            .map_err(unavailable)
    }
}
