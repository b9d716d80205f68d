//! The backend: PostgreSQL-like, one key. The key's row carries the lease,
//! the acquire attempt that last granted or confirmed it, its expiry on the
//! backend's clock and the key's token counter; voided attempts leave
//! tombstones (`src/lock/postgres/sql.rs`). Each statement is atomic.

use super::config::Config;
use super::network::{AcqReply, Msg};
use super::state::{AttemptNo, LeaseId, Time, Token};

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Backend {
    /// `(lease, attempt, expires_at)` of the row, if a lease is on it.
    pub holder: Option<(LeaseId, AttemptNo, Time)>,
    /// The row's token column: the key's counter.
    pub token: Token,
    /// Tombstones of voided attempts (sorted).
    pub voids: Vec<(LeaseId, AttemptNo)>,
}

impl Backend {
    /// The live holder at backend time `now` (an expired row is free).
    pub fn live(&self, now: Time) -> Option<(LeaseId, AttemptNo)> {
        self.holder
            .filter(|(_, _, exp)| *exp > now)
            .map(|(l, a, _)| (l, a))
    }

    /// The backend's clock advanced `by`.
    pub fn age(&mut self, by: i8) {
        if let Some((_, _, exp)) = self.holder.as_mut() {
            *exp -= by;
        }
    }

    /// An expired row is a free row (every statement reads it so).
    pub fn normalize(&mut self) {
        if self.live(0).is_none() {
            self.holder = None;
        }
    }

    /// Applies one message that reached the backend at its time `now`;
    /// returns the reply, if the statement has one anybody reads.
    pub fn apply(&mut self, cfg: &Config, now: Time, m: &Msg) -> Option<Msg> {
        match *m {
            // sql::ACQUIRE: live → up | ins | again | held.
            Msg::Acquire { s, lease, attempt } => {
                let reply = if self.voids.contains(&(lease, attempt)) {
                    AcqReply::Voided
                } else {
                    match self.live(now) {
                        None => {
                            self.token += 1;
                            self.holder = Some((lease, attempt, now + cfg.ttl as i8));
                            AcqReply::Acquired(self.token)
                        }
                        Some((l, a)) if l == lease => {
                            // GREATEST(attempt): a late earlier try does not
                            // take the lease back from its retry.
                            let exp = self.holder.unwrap().2;
                            self.holder = Some((l, a.max(attempt), exp));
                            AcqReply::Acquired(self.token)
                        }
                        Some(_) => AcqReply::Held,
                    }
                };
                Some(Msg::AcquireReply {
                    s,
                    lease,
                    attempt,
                    reply,
                })
            }
            // sql::VOID_ATTEMPT_FN: tombstone, then release only if the row
            // still carries this very attempt.
            Msg::VoidAttempt { lease, attempt, .. } => {
                if !self.voids.contains(&(lease, attempt)) {
                    self.voids.push((lease, attempt));
                    self.voids.sort();
                }
                if self.live(now) == Some((lease, attempt)) {
                    self.holder = None;
                }
                None
            }
            // sql::RELEASE: compare-and-delete by lease id.
            Msg::Release { s, lease } => {
                let owned = self.live(now).is_some_and(|(l, _)| l == lease);
                if owned {
                    self.holder = None;
                }
                Some(Msg::ReleaseReply { s, lease, owned })
            }
            // sql::RENEW: compare-and-extend.
            Msg::Renew { s, lease, sent } => {
                let owned = self.live(now).is_some_and(|(l, _)| l == lease);
                if owned {
                    let (l, a, _) = self.holder.unwrap();
                    self.holder = Some((l, a, now + cfg.ttl as i8));
                }
                Some(Msg::RenewReply {
                    s,
                    lease,
                    sent,
                    owned,
                })
            }
            _ => unreachable!("not a backend message: {m:?}"),
        }
    }
}
