//! Fence stores: where the gateway keeps, per key, the highest token it has
//! accepted, the lease that token belongs to (by its tag) and that lease's
//! highest write sequence — and, for a store shared by several replicas,
//! which request is in flight on the key right now.
//!
//! **Two marks per key** (read-write locks). The mark above is a *write
//! lease's* (every lease but a reader's); beside it each store keeps the
//! highest *read lease's* token it admitted (`read_token`). Readers share
//! their key, each with its own token, so a reader's token is held to the
//! write mark only: readers do not fence each other. A write lease's token
//! is held to both, so a writer that paused past its lease is fenced by
//! any later reader's read as by any later writer — and a reader whose
//! lease ended is fenced by the next writer's first request. A read lease's
//! token never writes: the gateway refuses that before it asks the store.
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

pub mod etcd;
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
    /// A read lease's read, above the write mark but not above the
    /// highest read token already admitted (another reader's, or its own):
    /// accepted, and nothing is recorded.
    Shared,
}

impl Decision {
    /// Whether the request may be forwarded.
    pub fn accepted(&self) -> bool {
        matches!(self, Decision::Advanced | Decision::Same | Decision::Shared)
    }

    /// Whether the stored mark changes (token or sequence; for a read
    /// lease, the read token).
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

/// A key's marks: the highest write lease's token (0: none yet), its
/// lease's tag, the lease's last sequence (0 = none seen), and the highest
/// read lease's token (0: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark<'a> {
    pub token: u64,
    pub lease: &'a str,
    pub seq: u64,
    pub read_token: u64,
}

impl Mark<'_> {
    /// The highest token of either mode admitted for the key.
    pub fn highest(&self) -> u64 {
        self.token.max(self.read_token)
    }
}

pub use crate::token::Mode;

/// What a request presents for its key: its token, its lease's tag, its
/// write sequence (if numbered) and its lease's mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Presented<'a> {
    pub token: u64,
    pub lease: &'a str,
    pub seq: Option<u64>,
    pub mode: Mode,
}

impl<'a> Presented<'a> {
    pub fn new(token: u64, lease: &'a str, seq: Option<u64>, mode: Mode) -> Presented<'a> {
        Presented {
            token,
            lease,
            seq,
            mode,
        }
    }
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

    /// Checks what a request presents against the key's marks with
    /// [`decide`] and records it if it moves them — one atomic step. When the
    /// request is accepted and `stamp` is given, the key is also marked in
    /// flight (shared stores). Waits until `deadline` for a request that
    /// another replica has in flight on the key. The caller holds the key's
    /// turn in this process.
    async fn admit(
        &self,
        key: &str,
        presented: Presented<'_>,
        stamp: Option<&Stamp>,
        deadline: Instant,
    ) -> Result<Admitted, FenceError>;

    /// Clears the in-flight stamp `stamp_id` of `key` (if it is still
    /// there), letting the next request in, here or in another replica.
    async fn finish(&self, key: &str, stamp_id: &str) -> Result<(), FenceError>;

    /// The key's highest accepted write lease's token and that lease's
    /// tag, if any (a read lease's token is no mark of a holder).
    async fn highest(&self, key: &str) -> Result<Option<(u64, String)>, FenceError>;

    async fn ping(&self) -> Result<(), FenceError>;
}

/// What a SQL store's admission function answered, as a decision: its
/// outcome code (0 advanced, 1 same, 2 stale, 3 stale sequence, 5
/// duplicate sequence, 6 shared; 4, busy, never gets here) and the key's
/// marks as they were (`None`: a new key).
pub(crate) fn admitted(
    code: i64,
    token: Option<i64>,
    seq: Option<i64>,
    read_token: Option<i64>,
    asked_seq: i64,
    mode: Mode,
) -> Admitted {
    let write_mark = token.unwrap_or(0) as u64;
    let read_mark = read_token.unwrap_or(0) as u64;
    let decision = match code {
        0 => Decision::Advanced,
        1 => Decision::Same,
        3 => Decision::StaleSeq {
            last: seq.unwrap_or(0) as u64,
        },
        5 => Decision::DuplicateSeq {
            seq: asked_seq as u64,
        },
        6 => Decision::Shared,
        // A reader is held to the write mark, a writer to both.
        _ => Decision::Stale {
            highest: match mode {
                Mode::Read => write_mark,
                Mode::Write => write_mark.max(read_mark),
            },
        },
    };
    Admitted {
        decision,
        previous: token.map(|t| (t as u64).max(read_mark)),
    }
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

/// The decision rule every store applies to the stored marks. The
/// PostgreSQL and MySQL stores apply the same rule inside the database
/// (`sql::ADMIT`, `mysql_sql::ADMIT`); their tests run one table of cases
/// against the database and this function.
///
/// A read lease's token (only ever on a read) is held to the write mark:
/// above it, accepted (and recorded if it is the highest read token yet);
/// at or below it, a writer came after the reader's lease: stale.
pub fn decide(
    stored: Option<Mark<'_>>,
    token: u64,
    lease: &str,
    seq: Option<u64>,
    mode: Mode,
) -> Decision {
    let Some(mark) = stored else {
        return Decision::Advanced;
    };
    if mode == Mode::Read {
        return if token <= mark.token && !crate::mutants::active("readers_unfenced") {
            Decision::Stale {
                highest: mark.token,
            }
        } else if token > mark.read_token {
            Decision::Advanced
        } else {
            Decision::Shared
        };
    }
    // A writer is held to every reader's token too (unless the mutant
    // forgets the readers).
    let read_mark = if crate::mutants::active("writers_ignore_readers") {
        0
    } else {
        mark.read_token
    };
    if token > mark.token && token > read_mark {
        return Decision::Advanced;
    }
    let same_lease = mark.lease == lease || crate::mutants::active("equal_token_any_lease");
    if token < mark.token || token <= read_mark || !same_lease {
        return Decision::Stale {
            highest: mark.token.max(read_mark),
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
        Some(Mark {
            token,
            lease,
            seq,
            read_token: 0,
        })
    }

    fn decide(m: Option<Mark<'_>>, token: u64, lease: &str, seq: Option<u64>) -> Decision {
        super::decide(m, token, lease, seq, Mode::Write)
    }

    #[test]
    fn readers_are_held_to_the_write_mark_and_writers_to_both() {
        let marks = |token, read_token| {
            Some(Mark {
                token,
                lease: "w",
                seq: 3,
                read_token,
            })
        };
        let read = |m, t| super::decide(m, t, "r", None, Mode::Read);
        // Readers: above the write mark, in any order among themselves.
        assert_eq!(read(None, 7), Decision::Advanced);
        assert_eq!(read(marks(5, 0), 7), Decision::Advanced);
        assert_eq!(read(marks(5, 8), 7), Decision::Shared);
        assert_eq!(read(marks(5, 8), 8), Decision::Shared);
        assert_eq!(read(marks(5, 8), 9), Decision::Advanced);
        // A reader whose lease a writer has followed: stale.
        assert_eq!(read(marks(9, 8), 8), Decision::Stale { highest: 9 });
        assert_eq!(read(marks(9, 0), 9), Decision::Stale { highest: 9 });
        // A writer below a reader's token: its lease ended before that
        // reader's began.
        let write = |m, t, lease, seq| super::decide(m, t, lease, seq, Mode::Write);
        assert_eq!(
            write(marks(5, 8), 6, "x", None),
            Decision::Stale { highest: 8 }
        );
        assert_eq!(
            write(marks(5, 8), 5, "w", Some(4)),
            Decision::Stale { highest: 8 }
        );
        assert_eq!(write(marks(5, 8), 9, "x", Some(1)), Decision::Advanced);
        // The current writer, with readers all older than it, goes on.
        assert_eq!(write(marks(9, 8), 9, "w", Some(4)), Decision::Same);
        assert_eq!(write(marks(9, 8), 9, "w", None), Decision::Same);
        assert!(Decision::Shared.accepted());
        assert!(!Decision::Shared.writes_mark(None));
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
    fn sql_outcomes_map_to_decisions() {
        let w = |code, token, seq, asked| admitted(code, token, seq, Some(0), asked, Mode::Write);
        assert_eq!(w(0, None, None, -1).decision, Decision::Advanced);
        assert_eq!(w(0, None, None, -1).previous, None);
        assert_eq!(w(1, Some(34), Some(1), 2).decision, Decision::Same);
        assert_eq!(
            w(2, Some(34), Some(0), -1).decision,
            Decision::Stale { highest: 34 }
        );
        assert_eq!(
            w(3, Some(34), Some(2), 1).decision,
            Decision::StaleSeq { last: 2 }
        );
        assert_eq!(
            w(5, Some(34), Some(2), 2).decision,
            Decision::DuplicateSeq { seq: 2 }
        );
        // Stale against a reader's mark: the higher of the two is named
        // to a writer, the write mark to a reader.
        let stale = admitted(2, Some(5), Some(0), Some(8), -1, Mode::Write);
        assert_eq!(stale.decision, Decision::Stale { highest: 8 });
        assert_eq!(stale.previous, Some(8));
        let stale = admitted(2, Some(9), Some(0), Some(8), -1, Mode::Read);
        assert_eq!(stale.decision, Decision::Stale { highest: 9 });
        let shared = admitted(6, Some(5), Some(0), Some(8), -1, Mode::Read);
        assert_eq!(shared.decision, Decision::Shared);
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
