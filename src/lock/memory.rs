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
        let counter = state.counters.entry(key.clone()).or_insert(0);
        *counter += 1;
        let token = *counter;
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
        let counter = state.counters.entry(key.clone()).or_insert(0);
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
        Ok(KeyView {
            holder,
            delayed,
            last_token: state.counters.get(key).copied(),
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
