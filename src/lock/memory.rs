//! In-process lock backend for `fencer dev` and tests.
//!
//! Same semantics as the real backends (idempotent acquire, per-key token
//! counters that never reset, compare-and-set renew/release, wake on
//! release), but nothing survives the process: not for production.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use super::{
    Attempt, BackendError, HolderView, Holds, HoldsChange, KeyView, LeaseId, LockBackend, LockKey,
    Ownership, WakeSink, WatchGuard,
};

struct Entry {
    lease: LeaseId,
    token: u64,
    expires: Instant,
    /// Reentrancy: hold count and owner (a fresh grant has one hold).
    holds: u32,
    owner: Option<String>,
    /// The last hold-count change made (its id).
    holds_op: Option<String>,
}

#[derive(Default)]
struct State {
    locks: HashMap<LockKey, Entry>,
    /// Lock-delay: keys that may not be acquired before this instant.
    delayed: HashMap<LockKey, Instant>,
    /// Token counters outlive their locks, as in Redis.
    counters: HashMap<LockKey, u64>,
    /// Semaphores' permit counts, fixed at first use.
    permits: HashMap<LockKey, u32>,
    /// Read-write locks: each key's read leases, by lease id.
    readers: HashMap<LockKey, HashMap<LeaseId, Reader>>,
    /// Writer preference: a write lease found readers and waits for them
    /// to leave; no new reader gets in before this.
    writer_waits: HashMap<LockKey, Instant>,
}

struct Reader {
    token: u64,
    expires: Instant,
}

/// Writer preference without a queue of writers in the backend: a writer
/// held off by readers marks the key, and no new reader gets in while the
/// mark lasts. It re-checks at least this often while readers hold the key
/// (sooner at the soonest reader's expiry, or on a release), renewing the
/// mark; the mark lasts [`WRITER_WAIT_GRACE`] past the re-check, so a
/// writer that gave up (its client left, its wait ran out) keeps readers
/// out for at most this plus the grace. The same figures on every backend.
pub const WRITER_RECHECK: Duration = Duration::from_secs(1);
/// See [`WRITER_RECHECK`].
pub const WRITER_WAIT_GRACE: Duration = Duration::from_secs(1);

impl State {
    /// `key`'s live readers, the expired ones dropped first.
    fn live_readers(
        &mut self,
        key: &LockKey,
        now: Instant,
    ) -> Option<&mut HashMap<LeaseId, Reader>> {
        let set = self.readers.get_mut(key)?;
        set.retain(|_, r| r.expires > now);
        if set.is_empty() {
            self.readers.remove(key);
            return None;
        }
        self.readers.get_mut(key)
    }

    fn next_token(&mut self, key: &LockKey) -> u64 {
        let counter = self.counters.entry(key.clone()).or_insert(0);
        *counter += 1;
        *counter
    }
}

#[derive(Default)]
pub struct MemoryBackend {
    state: Mutex<State>,
    wake: OnceLock<Arc<dyn WakeSink>>,
    lock_delay: Duration,
}

impl MemoryBackend {
    pub fn new(lock_delay: Duration, wake: Arc<dyn WakeSink>) -> MemoryBackend {
        let backend = MemoryBackend {
            lock_delay,
            ..MemoryBackend::default()
        };
        let _ = backend.wake.set(wake);
        backend
    }

    /// A read lease's acquire on `key` (see
    /// [`LockBackend::supports_read_locks`]).
    fn try_read(&self, key: &LockKey, lease: &LeaseId, ttl: Duration) -> Attempt {
        let now = Instant::now();
        let mut state = self.state.lock().expect("memory backend poisoned");
        if let Some(r) = state.live_readers(key, now).and_then(|set| set.get(lease)) {
            return Attempt::Acquired { token: r.token };
        }
        if let Some(entry) = Self::live_entry(&mut state, key, now) {
            return Attempt::Held {
                remaining: Some(entry.expires - now),
            };
        }
        if let Some(until) = state.writer_waits.get(key).copied() {
            if until > now {
                return Attempt::Held {
                    remaining: Some(until - now),
                };
            }
            state.writer_waits.remove(key);
        }
        if let Some(until) = state.delayed.get(key).copied() {
            if until > now {
                return Attempt::Delayed {
                    remaining: until - now,
                };
            }
        }
        let token = state.next_token(key);
        state.readers.entry(key.clone()).or_default().insert(
            lease.clone(),
            Reader {
                token,
                expires: now + ttl,
            },
        );
        Attempt::Acquired { token }
    }

    /// Renews (`ttl`) or releases (`None`) read lease `lease` of `key`;
    /// the last reader's release wakes the key's waiters.
    fn reader_op(&self, key: &LockKey, lease: &LeaseId, ttl: Option<Duration>) -> Ownership {
        let now = Instant::now();
        let (outcome, last) = {
            let mut state = self.state.lock().expect("memory backend poisoned");
            let writer = Self::live_entry(&mut state, key, now).is_some();
            let readers = state.live_readers(key, now);
            let found = readers
                .as_ref()
                .and_then(|set| set.get(lease))
                .map(|r| r.token);
            match (found, readers, ttl) {
                (Some(token), Some(set), Some(ttl)) => {
                    set.get_mut(lease).expect("found").expires = now + ttl;
                    (Ownership::Owned { token }, false)
                }
                (Some(token), Some(set), None) => {
                    set.remove(lease);
                    let last = set.is_empty();
                    if last {
                        state.readers.remove(key);
                    }
                    (Ownership::Owned { token }, last)
                }
                _ if writer => (Ownership::OtherHolder, false),
                _ => (Ownership::Free, false),
            }
        };
        if last {
            if let Some(wake) = self.wake.get() {
                wake.released(key.as_str());
            }
        }
        outcome
    }

    /// Drops expired entries so a long-running dev process stays bounded.
    fn live_entry<'a>(state: &'a mut State, key: &LockKey, now: Instant) -> Option<&'a mut Entry> {
        if state.locks.get(key).is_some_and(|e| e.expires <= now) {
            state.locks.remove(key);
        }
        state.locks.get_mut(key)
    }
}

#[async_trait]
impl LockBackend for MemoryBackend {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn try_acquire(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Attempt, BackendError> {
        if key.is_reader() {
            return Ok(self.try_read(&key.base(), lease, ttl));
        }
        let now = Instant::now();
        let mut state = self.state.lock().expect("memory backend poisoned");
        if let Some(entry) = Self::live_entry(&mut state, key, now) {
            if &entry.lease == lease {
                return Ok(Attempt::Acquired { token: entry.token });
            }
            return Ok(Attempt::Held {
                remaining: Some(entry.expires - now),
            });
        }
        if let Some(until) = state.delayed.get(key).copied() {
            if until > now {
                return Ok(Attempt::Delayed {
                    remaining: until - now,
                });
            }
            state.delayed.remove(key);
        }
        if let Some(readers) = state.live_readers(key, now) {
            let soonest = readers
                .values()
                .map(|r| r.expires)
                .min()
                .expect("not empty");
            // Tried again by then: the mark is renewed while it waits.
            let again = (soonest - now).min(WRITER_RECHECK);
            if !crate::mutants::active("readers_ignore_writers") {
                state
                    .writer_waits
                    .insert(key.clone(), now + again + WRITER_WAIT_GRACE);
            }
            return Ok(Attempt::Held {
                remaining: Some(again),
            });
        }
        state.writer_waits.remove(key);
        let token = state.next_token(key);
        if !self.lock_delay.is_zero() {
            state
                .delayed
                .insert(key.clone(), now + ttl + self.lock_delay);
        }
        state.locks.insert(
            key.clone(),
            Entry {
                lease: lease.clone(),
                token,
                expires: now + ttl,
                holds: 1,
                owner: None,
                holds_op: None,
            },
        );
        Ok(Attempt::Acquired { token })
    }

    async fn renew(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Ownership, BackendError> {
        if key.is_reader() {
            return Ok(self.reader_op(&key.base(), lease, Some(ttl)));
        }
        let now = Instant::now();
        let mut state = self.state.lock().expect("memory backend poisoned");
        Ok(match Self::live_entry(&mut state, key, now) {
            None => Ownership::Free,
            Some(entry) if &entry.lease != lease => Ownership::OtherHolder,
            Some(entry) => {
                entry.expires = now + ttl;
                let token = entry.token;
                if !self.lock_delay.is_zero() {
                    state
                        .delayed
                        .insert(key.clone(), now + ttl + self.lock_delay);
                }
                Ownership::Owned { token }
            }
        })
    }

    async fn release(&self, key: &LockKey, lease: &LeaseId) -> Result<Ownership, BackendError> {
        if key.is_reader() {
            return Ok(self.reader_op(&key.base(), lease, None));
        }
        let now = Instant::now();
        let outcome = {
            let mut state = self.state.lock().expect("memory backend poisoned");
            match Self::live_entry(&mut state, key, now) {
                None => Ownership::Free,
                Some(entry) if &entry.lease != lease => Ownership::OtherHolder,
                Some(entry) => {
                    let token = entry.token;
                    state.locks.remove(key);
                    state.delayed.remove(key);
                    Ownership::Owned { token }
                }
            }
        };
        if matches!(outcome, Ownership::Owned { .. }) {
            if let Some(wake) = self.wake.get() {
                wake.released(key.as_str());
            }
        }
        Ok(outcome)
    }

    async fn raise_token_floor(&self, key: &LockKey, floor: u64) -> Result<(), BackendError> {
        let mut state = self.state.lock().expect("memory backend poisoned");
        let counter = state.counters.entry(key.base()).or_insert(0);
        *counter = (*counter).max(floor);
        Ok(())
    }

    async fn watch(&self, _key: &LockKey, _timeout: Duration) -> WatchGuard {
        // Releases notify the sink directly; nothing to subscribe to.
        WatchGuard::none()
    }

    fn supports_reentrancy(&self) -> bool {
        true
    }

    fn supports_read_locks(&self) -> bool {
        true
    }

    async fn holds(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        change: HoldsChange<'_>,
    ) -> Result<Holds, BackendError> {
        let now = Instant::now();
        let mut state = self.state.lock().expect("memory backend poisoned");
        Ok(match Self::live_entry(&mut state, key, now) {
            None => Holds::Free,
            Some(e) if &e.lease != lease => Holds::OtherHolder,
            Some(e) => {
                let mut applied = false;
                if let HoldsChange::Set {
                    expect,
                    to,
                    owner,
                    op,
                } = change
                {
                    applied = e.holds_op.as_deref() == Some(op);
                    if !applied && e.holds == expect {
                        e.holds = to;
                        e.owner = Some(owner.to_owned());
                        e.holds_op = Some(op.to_owned());
                        applied = true;
                    }
                }
                Holds::Owned {
                    holds: e.holds,
                    owner: e.owner.clone(),
                    applied,
                }
            }
        })
    }

    async fn inspect(&self, key: &LockKey) -> Result<KeyView, BackendError> {
        let now = Instant::now();
        let mut state = self.state.lock().expect("memory backend poisoned");
        let holder = Self::live_entry(&mut state, key, now).map(|e| HolderView {
            lease: e.lease.as_str().to_owned(),
            token: e.token,
            remaining: Some(e.expires - now),
        });
        let delayed = match (&holder, state.delayed.get(key)) {
            (None, Some(until)) if *until > now => Some(*until - now),
            _ => None,
        };
        let readers = state.live_readers(key, now).map_or(0, |set| set.len()) as u64;
        Ok(KeyView {
            holder,
            delayed: delayed.filter(|_| readers == 0),
            last_token: state.counters.get(key).copied(),
            readers: Some(readers),
            ..KeyView::default()
        })
    }

    async fn fix_permits(&self, name: &LockKey, permits: u32) -> Result<u32, BackendError> {
        let mut state = self.state.lock().expect("memory backend poisoned");
        Ok(*state.permits.entry(name.clone()).or_insert(permits))
    }

    async fn ping(&self) -> Result<(), BackendError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Wakes(Mutex<Vec<String>>);

    impl WakeSink for Wakes {
        fn released(&self, key: &str) {
            self.0.lock().unwrap().push(key.to_owned());
        }
        fn resync(&self) {}
    }

    fn lease() -> LeaseId {
        LeaseId::generate()
    }

    const TTL: Duration = Duration::from_secs(10);

    /// The reader set at the backend, with what no sidecar queue can give:
    /// a writer waiting in *another* sidecar keeps new readers out
    /// (mutant `readers_ignore_writers`).
    #[tokio::test(start_paused = true)]
    async fn readers_share_writers_exclude_and_a_waiting_writer_keeps_readers_out() {
        let wakes = Arc::new(Wakes::default());
        let b = MemoryBackend::new(Duration::ZERO, wakes.clone());
        let key = LockKey::parse("rw").unwrap();
        let (r1, r2, r3, w) = (lease(), lease(), lease(), lease());
        let t1 = b.try_acquire(&key.reader(1), &r1, TTL).await.unwrap();
        let t2 = b.try_acquire(&key.reader(2), &r2, TTL).await.unwrap();
        let (Attempt::Acquired { token: t1 }, Attempt::Acquired { token: t2 }) = (t1, t2) else {
            panic!("readers share");
        };
        assert!(t2 > t1);
        // Idempotent per lease, as every acquire.
        assert_eq!(
            b.try_acquire(&key.reader(1), &r1, TTL).await.unwrap(),
            Attempt::Acquired { token: t1 }
        );
        // The writer is held off, and from now on so are new readers.
        assert!(matches!(
            b.try_acquire(&key, &w, TTL).await.unwrap(),
            Attempt::Held { .. }
        ));
        assert!(
            matches!(
                b.try_acquire(&key.reader(3), &r3, TTL).await.unwrap(),
                Attempt::Held { .. }
            ),
            "a reader got in while a writer waited"
        );
        // Renewal and release act on the reader's own entry.
        assert_eq!(
            b.renew(&key.reader(1), &r1, TTL).await.unwrap(),
            Ownership::Owned { token: t1 }
        );
        assert_eq!(
            b.release(&key.reader(9), &r3,).await.unwrap(),
            Ownership::Free
        );
        assert_eq!(
            b.release(&key.reader(1), &r1).await.unwrap(),
            Ownership::Owned { token: t1 }
        );
        assert!(wakes.0.lock().unwrap().is_empty(), "a reader still holds");
        assert_eq!(
            b.release(&key.reader(2), &r2).await.unwrap(),
            Ownership::Owned { token: t2 }
        );
        assert_eq!(*wakes.0.lock().unwrap(), vec!["rw".to_owned()]);
        let Attempt::Acquired { token: tw } = b.try_acquire(&key, &w, TTL).await.unwrap() else {
            panic!("the writer gets in once the readers left");
        };
        assert!(tw > t2);
        // The writer excludes readers; a reader's renew sees it.
        assert!(matches!(
            b.try_acquire(&key.reader(3), &r3, TTL).await.unwrap(),
            Attempt::Held { .. }
        ));
        assert_eq!(
            b.renew(&key.reader(3), &r3, TTL).await.unwrap(),
            Ownership::OtherHolder
        );
        b.release(&key, &w).await.unwrap();
        let Attempt::Acquired { token: t3 } =
            b.try_acquire(&key.reader(3), &r3, TTL).await.unwrap()
        else {
            panic!("a reader gets in after the writer");
        };
        assert!(t3 > tw);
    }

    /// Readers that expire let the writer in; a writer that stopped waiting
    /// keeps readers out no longer than the grace past the soonest reader's
    /// expiry.
    #[tokio::test(start_paused = true)]
    async fn expired_readers_and_an_abandoned_writer_wait_hold_nothing_for_good() {
        let b = MemoryBackend::new(Duration::ZERO, Arc::new(Wakes::default()));
        let key = LockKey::parse("rw").unwrap();
        let (r1, r2, w) = (lease(), lease(), lease());
        b.try_acquire(&key.reader(1), &r1, Duration::from_millis(500))
            .await
            .unwrap();
        let Attempt::Held { remaining } = b.try_acquire(&key, &w, TTL).await.unwrap() else {
            panic!("held by the reader");
        };
        assert_eq!(remaining, Some(Duration::from_millis(500)));
        tokio::time::advance(Duration::from_millis(501)).await;
        // The reader expired; the waiting writer's mark still keeps a new
        // reader out, for the grace.
        assert!(matches!(
            b.try_acquire(&key.reader(2), &r2, TTL).await.unwrap(),
            Attempt::Held { .. }
        ));
        tokio::time::advance(WRITER_WAIT_GRACE).await;
        assert!(matches!(
            b.try_acquire(&key.reader(2), &r2, TTL).await.unwrap(),
            Attempt::Acquired { .. }
        ));
        // Readers of long leases: the writer re-checks within a second,
        // and once it stops, new readers wait no longer than that and the
        // grace — not until the readers' leases end.
        let (r3, w2) = (lease(), lease());
        let Attempt::Held { remaining } = b.try_acquire(&key, &w2, TTL).await.unwrap() else {
            panic!("held by the reader");
        };
        assert_eq!(remaining, Some(WRITER_RECHECK));
        tokio::time::advance(WRITER_RECHECK + WRITER_WAIT_GRACE).await;
        assert!(matches!(
            b.try_acquire(&key.reader(3), &r3, TTL).await.unwrap(),
            Attempt::Acquired { .. }
        ));
    }
}
