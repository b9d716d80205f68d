//! Read leases of read-write locks (`"mode": "read"`).
//!
//! A read lease shares its key with other readers, and a write lease (the
//! exclusive lease every other acquire takes) excludes them all; the
//! backend keeps the reader set beside the key's lease, with writer
//! preference ([`crate::lock::LockBackend::supports_read_locks`]). Here a
//! read lease is an ordinary lease tracked under a reader key of its own
//! ([`LockKey::reader`]), so renewal, keepalive, hold streams, the
//! clean-up of an acquire whose client left and the proxy's lease binding
//! are the lock's. Its token comes from the key's one counter and is
//! signed with the read mode: the gateway admits reads with it and refuses
//! writes (`read_lease`). A reader waits in the key's queue here like a
//! writer; when it gets in, the next waiter tries at once instead of
//! waiting for its release.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{LockError, LockManager};
use crate::lock::{LeaseId, LockKey};

/// Numbers this process's read leases: each gets a key of its own.
#[derive(Default)]
pub(super) struct ReaderNumbers(AtomicU64);

impl LockManager {
    /// The key a new read lease of `key` is tracked under, or why this
    /// backend has none.
    pub fn reader_key(&self, key: &LockKey) -> Result<LockKey, LockError> {
        if !self.backend.supports_read_locks() {
            return Err(LockError::Unsupported {
                feature: "read-write",
                backend: self.backend.name(),
            });
        }
        Ok(key.reader(self.readers.0.fetch_add(1, Ordering::Relaxed)))
    }

    /// The key `lease` is tracked under when a request names lock `key`:
    /// a read lease's own key if `lease` is a reader of `key` here, else
    /// `key` itself.
    pub fn lease_key(&self, key: &LockKey, lease: &LeaseId) -> LockKey {
        match self.leases.key_of(lease) {
            Some(k) if k.is_reader() && k.as_str() == key.as_str() => k,
            _ => key.clone(),
        }
    }
}
