//! Fence stores: where the gateway keeps, per key, the highest token it has
//! accepted (and the lease that token belongs to), and how it serializes
//! fenced requests per key.
//!
//! `enter` is check-and-advance under the key's exclusive guard. The caller
//! forwards the request while holding the guard and drops it only when the
//! upstream has finished with the request, so a request with a lower token
//! that passed an earlier check can never be delivered after a higher one.

pub mod memory;
pub mod postgres;

use std::time::Duration;

use async_trait::async_trait;

/// The outcome of presenting `(token, lease)` for a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// A new highest token; it is recorded (durably, for PostgreSQL) before
    /// the request is forwarded.
    Advanced,
    /// The highest token again, from the same lease (one holder writing
    /// several times).
    Same,
    /// Lower than the highest, or equal but from another lease.
    Stale { highest: u64 },
}

#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    #[error("timed out waiting for the previous request on this key")]
    Busy,
    #[error("fence store unavailable: {0}")]
    Unavailable(String),
}

/// Keeps the key serialized until dropped.
pub struct KeyGuard(#[allow(dead_code)] Box<dyn Send + Sync>);

impl KeyGuard {
    pub fn new(inner: impl Send + Sync + 'static) -> KeyGuard {
        KeyGuard(Box::new(inner))
    }
}

#[async_trait]
pub trait FenceStore: Send + Sync + 'static {
    fn name(&self) -> &'static str;

    /// Waits at most `wait` for exclusive use of `key`, then checks `token`
    /// against the key's mark and advances it if higher. The guard is
    /// returned whatever the decision; dropping it lets the next request in.
    async fn enter(
        &self,
        key: &str,
        token: u64,
        lease: &str,
        wait: Duration,
    ) -> Result<(Decision, KeyGuard), FenceError>;

    /// The key's highest accepted token and its lease, if any.
    async fn highest(&self, key: &str) -> Result<Option<(u64, String)>, FenceError>;

    async fn ping(&self) -> Result<(), FenceError>;
}

/// The decision rule every store applies to the stored mark.
pub fn decide(stored: Option<(u64, &str)>, token: u64, lease: &str) -> Decision {
    match stored {
        None => Decision::Advanced,
        Some((high, _)) if token > high => Decision::Advanced,
        Some((high, held_by)) if token == high && held_by == lease => Decision::Same,
        Some((high, _)) => Decision::Stale { highest: high },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decision_rule() {
        assert_eq!(decide(None, 1, "a"), Decision::Advanced);
        assert_eq!(decide(Some((33, "a")), 34, "b"), Decision::Advanced);
        assert_eq!(decide(Some((34, "b")), 34, "b"), Decision::Same);
        assert_eq!(
            decide(Some((34, "b")), 34, "c"),
            Decision::Stale { highest: 34 }
        );
        assert_eq!(
            decide(Some((34, "b")), 33, "a"),
            Decision::Stale { highest: 34 }
        );
    }
}
