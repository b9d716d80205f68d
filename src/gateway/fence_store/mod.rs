//! Fence stores: where the gateway keeps, per key, the highest token it has
//! accepted, the lease that token belongs to and that lease's highest write
//! sequence, and how it serializes fenced requests per key.
//!
//! The sequence closes the hole that equal tokens leave open (PITFALLS 5,
//! Kafka's KIP-890): one holder writes many times with the same token, so
//! equal must pass — but then a delayed or retried write of the lease could
//! land after a later write of the same lease. The sidecar's proxy numbers
//! every request of a lease (`Fencing-Seq`, 1, 2, 3, … in the order it sends
//! them, one at a time); the gateway requires `(token, seq)` to increase and
//! lets an exact replay of the last one through (idempotent).
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
    /// several times), with a higher write sequence or none.
    Same,
    /// The same lease's last write again, same sequence: a retry of the
    /// write just accepted, let through (idempotent).
    Replay,
    /// Lower than the highest, or equal but from another lease.
    Stale { highest: u64 },
    /// The highest token and its lease, but a sequence below one already
    /// accepted: a delayed or duplicated earlier write of this lease.
    StaleSeq { last: u64 },
}

impl Decision {
    /// Whether the stored mark changes (token or sequence).
    pub fn writes_mark(&self, seq: Option<u64>) -> bool {
        match self {
            Decision::Advanced => true,
            Decision::Same => seq.is_some(),
            _ => false,
        }
    }
}

/// A key's mark: highest token, its lease, and the lease's last sequence
/// (0 = none seen).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark<'a> {
    pub token: u64,
    pub lease: &'a str,
    pub seq: u64,
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

    /// Waits at most `wait` for exclusive use of `key`, then checks
    /// `(token, lease, seq)` against the key's mark with [`decide`] and
    /// records it if it moves the mark. The guard is returned whatever the
    /// decision; dropping it lets the next request in.
    async fn enter(
        &self,
        key: &str,
        token: u64,
        lease: &str,
        seq: Option<u64>,
        wait: Duration,
    ) -> Result<(Decision, KeyGuard), FenceError>;

    /// The key's highest accepted token and its lease, if any.
    async fn highest(&self, key: &str) -> Result<Option<(u64, String)>, FenceError>;

    async fn ping(&self) -> Result<(), FenceError>;
}

/// The decision rule every store applies to the stored mark.
pub fn decide(stored: Option<Mark<'_>>, token: u64, lease: &str, seq: Option<u64>) -> Decision {
    let Some(mark) = stored else {
        return Decision::Advanced;
    };
    if token > mark.token {
        return Decision::Advanced;
    }
    if token < mark.token || mark.lease != lease {
        return Decision::Stale {
            highest: mark.token,
        };
    }
    match seq {
        // A client that does not number its writes (it carries its token to
        // the gateway itself): equal passes, as without sequences.
        None => Decision::Same,
        Some(s) if s > mark.seq => Decision::Same,
        Some(s) if s == mark.seq => Decision::Replay,
        Some(_) => Decision::StaleSeq { last: mark.seq },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(token: u64, lease: &str, seq: u64) -> Option<Mark<'_>> {
        Some(Mark { token, lease, seq })
    }

    #[test]
    fn decision_rule() {
        assert_eq!(decide(None, 1, "a", None), Decision::Advanced);
        assert_eq!(decide(mark(33, "a", 0), 34, "b", None), Decision::Advanced);
        assert_eq!(decide(mark(34, "b", 0), 34, "b", None), Decision::Same);
        assert_eq!(
            decide(mark(34, "b", 0), 34, "c", None),
            Decision::Stale { highest: 34 }
        );
        assert_eq!(
            decide(mark(34, "b", 0), 33, "a", None),
            Decision::Stale { highest: 34 }
        );
    }

    #[test]
    fn sequence_rule_inside_one_lease() {
        // A new token starts its lease's sequence afresh.
        assert_eq!(
            decide(mark(33, "a", 9), 34, "b", Some(1)),
            Decision::Advanced
        );
        assert_eq!(decide(mark(34, "b", 1), 34, "b", Some(2)), Decision::Same);
        assert_eq!(decide(mark(34, "b", 2), 34, "b", Some(2)), Decision::Replay);
        assert_eq!(
            decide(mark(34, "b", 2), 34, "b", Some(1)),
            Decision::StaleSeq { last: 2 }
        );
        // Another lease with the same token is stale whatever its sequence.
        assert_eq!(
            decide(mark(34, "b", 2), 34, "c", Some(3)),
            Decision::Stale { highest: 34 }
        );
        assert!(Decision::Same.writes_mark(Some(3)));
        assert!(!Decision::Same.writes_mark(None));
        assert!(!Decision::Replay.writes_mark(Some(2)));
    }
}
