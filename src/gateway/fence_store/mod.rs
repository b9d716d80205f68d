//! Fence stores: where the gateway keeps, per key, the highest token it has
//! accepted, the lease that token belongs to (by its tag) and that lease's
//! highest write sequence — and, for a store shared by several replicas,
//! which request is in flight on the key right now.
//!
//! The sequence closes the hole that equal tokens leave open (PITFALLS 5,
//! Kafka's KIP-890): one holder writes many times with the same token, so
//! equal must pass — but then a delayed or retried write of the lease could
//! land after a later write of the same lease. The sidecar's proxy numbers
//! every request of a lease (`Fencing-Seq`, increasing in the order it sends
//! them, one at a time); the gateway requires `(token, seq)` to increase. A
//! second request with the sequence of the last accepted one is refused as
//! a duplicate: the first delivery is the one that counts, and the gateway
//! cannot tell an exact retry from a different request that reuses the
//! number (issue 9 item 7).
//!
//! **Serialization.** Inside one gateway process the key's turn comes from
//! [`super::key_queue`]; the store then *admits* the request: check and
//! advance the mark in one atomic step and, for a shared store, stamp the
//! key "in flight until T". Other replicas see the stamp and wait for it to
//! be cleared ([`FenceStore::finish`]) or to run out. The stamp lives in the
//! database, not in a session: a gateway that crashes mid-forward, or whose
//! database connection drops, leaves the stamp in place until T — the time
//! by which the forwarded write has landed or died — so no newer write can
//! overtake it (issue 9 item 1). No database connection is held while a
//! request is forwarded or waits its turn (issue 9 item 9).

pub mod memory;
pub mod mysql;
mod mysql_sql;
mod pg_batch;
pub mod postgres;
mod sql;

use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

/// The outcome of presenting `(token, lease, seq)` for a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// A new highest token; it is recorded (durably, for PostgreSQL) before
    /// the request is forwarded.
    Advanced,
    /// The highest token again, from the same lease (one holder writing
    /// several times), with a higher write sequence or none.
    Same,
    /// Lower than the highest, or equal but from another lease.
    Stale { highest: u64 },
    /// The highest token and its lease, but a sequence below one already
    /// accepted: a delayed or duplicated earlier write of this lease.
    StaleSeq { last: u64 },
    /// The sequence of the lease's last accepted request again.
    DuplicateSeq { seq: u64 },
}

impl Decision {
    /// Whether the request may be forwarded.
    pub fn accepted(&self) -> bool {
        matches!(self, Decision::Advanced | Decision::Same)
    }

    /// Whether the stored mark changes (token or sequence).
    pub fn writes_mark(&self, seq: Option<u64>) -> bool {
        match self {
            Decision::Advanced => true,
            Decision::Same => seq.is_some(),
            _ => false,
        }
    }
}

/// A decision and the highest token the key had before it (`None`: a new
/// key), for the token-jump alarm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    pub decision: Decision,
    pub previous: Option<u64>,
}

pub use crate::token::TOKEN_JUMP;

/// A key's mark: highest token, its lease's tag, and the lease's last
/// sequence (0 = none seen).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark<'a> {
    pub token: u64,
    pub lease: &'a str,
    pub seq: u64,
}

/// An accepted request's claim on its key, for stores shared by replicas:
/// in flight until `hold` has passed or [`FenceStore::finish`] clears it.
#[derive(Debug, Clone)]
pub struct Stamp {
    /// Unique per request.
    pub id: String,
    /// Long enough for the forwarded write to have landed or died, were
    /// this gateway to crash right after admitting it.
    pub hold: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    #[error("timed out waiting for the previous request on this key")]
    Busy,
    #[error("fence store unavailable: {0}")]
    Unavailable(String),
}

#[async_trait]
pub trait FenceStore: Send + Sync + 'static {
    fn name(&self) -> &'static str;

    /// Checks `(token, lease, seq)` against the key's mark with [`decide`]
    /// and records it if it moves the mark — one atomic step. When the
    /// request is accepted and `stamp` is given, the key is also marked in
    /// flight (shared stores). Waits until `deadline` for a request that
    /// another replica has in flight on the key. The caller holds the key's
    /// turn in this process.
    async fn admit(
        &self,
        key: &str,
        token: u64,
        lease: &str,
        seq: Option<u64>,
        stamp: Option<&Stamp>,
        deadline: Instant,
    ) -> Result<Admitted, FenceError>;

    /// Clears the in-flight stamp `stamp_id` of `key` (if it is still
    /// there), letting the next request in, here or in another replica.
    async fn finish(&self, key: &str, stamp_id: &str) -> Result<(), FenceError>;

    /// The key's highest accepted token and its lease's tag, if any.
    async fn highest(&self, key: &str) -> Result<Option<(u64, String)>, FenceError>;

    async fn ping(&self) -> Result<(), FenceError>;
}

/// Counts and logs a token that advanced the mark by more than
/// [`TOKEN_JUMP`].
pub fn jump_alarm(
    metrics: &crate::metrics::GatewayMetrics,
    group: &str,
    claim: &crate::token::Claim,
    a: &Admitted,
) {
    if let (Decision::Advanced, Some(prev)) = (&a.decision, a.previous) {
        if claim.token.saturating_sub(prev) > TOKEN_JUMP {
            metrics.token_jumps.with_label_values(&[group]).inc();
            tracing::error!(
                key = %claim.key, token = claim.token, previous = prev, lease_tag = %claim.lease,
                "fencing token jumped far above the key's mark: a leaked signing secret, a corrupted counter or a clock far ahead"
            );
        }
    }
}

/// The decision rule every store applies to the stored mark. The
/// PostgreSQL store applies the same rule inside the database
/// (`sql::ADMIT`); `tests/fencing.rs` runs one table of cases against both.
pub fn decide(stored: Option<Mark<'_>>, token: u64, lease: &str, seq: Option<u64>) -> Decision {
    let Some(mark) = stored else {
        return Decision::Advanced;
    };
    if token > mark.token {
        return Decision::Advanced;
    }
    let same_lease = mark.lease == lease || crate::mutants::active("equal_token_any_lease");
    if token < mark.token || !same_lease {
        return Decision::Stale {
            highest: mark.token,
        };
    }
    match seq {
        // A client that does not number its writes (it carries its token to
        // the gateway itself): equal passes, as without sequences.
        None => Decision::Same,
        Some(s) if s > mark.seq => Decision::Same,
        Some(s) if s == mark.seq => Decision::DuplicateSeq { seq: s },
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
        assert_eq!(
            decide(mark(34, "b", 2), 34, "b", Some(2)),
            Decision::DuplicateSeq { seq: 2 }
        );
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
        assert!(!Decision::DuplicateSeq { seq: 2 }.accepted());
    }
}
