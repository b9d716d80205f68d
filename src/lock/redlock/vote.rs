//! Counting a RedLock round: the majority, the validity left, the token.
//!
//! Pure functions, so the rules are tested apart from any Redis.

use std::time::Duration;

use crate::lock::redis::inspect::Record;
use crate::lock::{HolderView, KeyView};

/// Masters that make a majority of `n`.
pub fn quorum(n: usize) -> usize {
    n / 2 + 1
}

/// What is left of a `ttl` lock taken in a round that took `elapsed`,
/// after the masters' clocks may have run `drift_ratio` fast (plus 2 ms for
/// their clocks' granularity): `None` when nothing is.
pub fn validity(ttl: Duration, elapsed: Duration, drift_ratio: f64) -> Option<Duration> {
    let drift = ttl.mul_f64(drift_ratio) + Duration::from_millis(2);
    ttl.checked_sub(elapsed)?
        .checked_sub(drift)
        .filter(|v| !v.is_zero())
}

/// One master's answer to `LOCK`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Vote {
    /// This lease holds the key there. `token`: already written back there
    /// by an earlier try of the same lease (0: not yet).
    Granted {
        counter: u64,
        token: u64,
        floor: u64,
    },
    /// Another lease holds it there (for `pttl`, when known) — or, with
    /// `delayed`, nobody does but the key is in its lock-delay there.
    Held {
        pttl: Option<Duration>,
        delayed: bool,
    },
    /// No answer in time, or an error: it may or may not hold it.
    Unknown,
    /// The master has not kept its data for the restart quarantine yet: it
    /// took nothing and counts for nobody, for `remaining` more.
    Abstain { remaining: Duration },
}

/// The outcome of a round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tally {
    /// A majority granted: write `token` back to them (indices).
    Majority { token: u64, granted: Vec<usize> },
    /// A majority is held by another lease; look again after `remaining`.
    /// `delayed`: on every master that said so, by a lock-delay alone (the
    /// last lease expired; nobody holds the key).
    Held {
        remaining: Option<Duration>,
        delayed: bool,
    },
    /// Nobody has a majority for sure (split vote): release, retry later.
    Split,
    /// Too many masters did not answer to tell.
    Undecided,
    /// Too many masters abstain (restart quarantine) for any majority; the
    /// first enough of them are back in `remaining`.
    Quarantined { remaining: Duration },
}

pub fn tally(votes: &[Vote], quorum: usize) -> Result<Tally, String> {
    let granted: Vec<usize> = votes
        .iter()
        .enumerate()
        .filter(|(_, v)| matches!(v, Vote::Granted { .. }))
        .map(|(i, _)| i)
        .collect();
    let held: Vec<Option<Duration>> = votes
        .iter()
        .filter_map(|v| match v {
            Vote::Held { pttl, .. } => Some(*pttl),
            _ => None,
        })
        .collect();
    let delayed = votes.iter().all(|v| match v {
        Vote::Held { delayed, .. } => *delayed,
        _ => true,
    });
    let unknown = votes.iter().filter(|v| **v == Vote::Unknown).count();
    let mut abstaining: Vec<Duration> = votes
        .iter()
        .filter_map(|v| match v {
            Vote::Abstain { remaining } => Some(*remaining),
            _ => None,
        })
        .collect();
    if granted.len() >= quorum {
        return Ok(Tally::Majority {
            token: mint(votes, &granted)?,
            granted,
        });
    }
    if held.len() >= quorum {
        // The earliest moment the key can be free on a majority.
        let remaining = held.iter().flatten().min().copied();
        return Ok(Tally::Held { remaining, delayed });
    }
    if votes.len() - abstaining.len() < quorum {
        // Enough must come back for the voters to make a majority.
        abstaining.sort();
        let needed = quorum - (votes.len() - abstaining.len());
        return Ok(Tally::Quarantined {
            remaining: abstaining[needed - 1],
        });
    }
    if granted.len() + unknown >= quorum || held.len() + unknown >= quorum {
        return Ok(Tally::Undecided);
    }
    Ok(Tally::Split)
}

/// The key as a majority of masters records it, from each master's record
/// (`None`: no answer): held by a lease whose entry is on a majority (its
/// token the highest written back; its time left until fewer than a
/// majority keep it), free — or in lock-delay until a majority is past
/// theirs — when a majority has no entry, else split.
pub fn inspect(records: &[Option<Record>], quorum: usize) -> Result<KeyView, String> {
    let answered: Vec<&Record> = records.iter().flatten().collect();
    if answered.len() < quorum {
        return Err(format!(
            "{} of {} masters answered; {quorum} are needed to tell",
            answered.len(),
            records.len()
        ));
    }
    let last_token = answered.iter().filter_map(|r| r.counter).max();
    let mut leases: Vec<&str> = answered
        .iter()
        .filter_map(|r| r.entry.as_ref().map(|(l, _)| l.as_str()))
        .collect();
    leases.sort_unstable();
    leases.dedup();
    for lease in leases {
        let mine: Vec<&&Record> = answered
            .iter()
            .filter(|r| r.entry.as_ref().is_some_and(|(l, _)| l == lease))
            .collect();
        if mine.len() >= quorum {
            let mut left: Vec<Duration> = mine.iter().filter_map(|r| r.pttl).collect();
            left.sort_unstable_by(|a, b| b.cmp(a));
            return Ok(KeyView {
                holder: Some(HolderView {
                    lease: lease.to_owned(),
                    token: mine
                        .iter()
                        .filter_map(|r| r.entry.as_ref())
                        .map(|e| e.1)
                        .max()
                        .unwrap_or(0),
                    remaining: left.get(quorum - 1).copied(),
                }),
                last_token,
                ..KeyView::default()
            });
        }
    }
    let free: Vec<&&Record> = answered.iter().filter(|r| r.entry.is_none()).collect();
    if free.len() < quorum {
        return Ok(KeyView {
            last_token,
            split: true,
            ..KeyView::default()
        });
    }
    let mut delays: Vec<Duration> = free.iter().map(|r| r.delay.unwrap_or_default()).collect();
    delays.sort_unstable();
    Ok(KeyView {
        delayed: Some(delays[quorum - 1]).filter(|d| !d.is_zero()),
        last_token,
        ..KeyView::default()
    })
}

/// The token for a majority: above every counter of the granting masters
/// and at least their clock floor — or, for a retry of the same lease, the
/// token it already wrote back, if that is still above every counter.
fn mint(votes: &[Vote], granted: &[usize]) -> Result<u64, String> {
    let (mut counter, mut floor, mut earlier) = (0u64, 0u64, 0u64);
    for &i in granted {
        if let Vote::Granted {
            counter: c,
            token: t,
            floor: f,
        } = votes[i]
        {
            counter = counter.max(c);
            floor = floor.max(f);
            earlier = earlier.max(t);
        }
    }
    if earlier > 0 && earlier >= counter {
        return Ok(earlier);
    }
    let next = counter.checked_add(1).ok_or("token counter at u64::MAX")?;
    Ok(next.max(floor))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(counter: u64, token: u64, floor: u64) -> Vote {
        Vote::Granted {
            counter,
            token,
            floor,
        }
    }

    fn held(ms: u64) -> Vote {
        Vote::Held {
            pttl: Some(Duration::from_millis(ms)),
            delayed: false,
        }
    }

    fn delayed(ms: u64) -> Vote {
        Vote::Held {
            pttl: Some(Duration::from_millis(ms)),
            delayed: true,
        }
    }

    #[test]
    fn a_majority_in_lock_delay_alone_is_delayed_and_one_holder_makes_it_held() {
        assert_eq!(
            tally(&[delayed(300), delayed(200), g(1, 0, 0)], 2),
            Ok(Tally::Held {
                remaining: Some(Duration::from_millis(200)),
                delayed: true
            })
        );
        assert_eq!(
            tally(&[delayed(300), held(200), g(1, 0, 0)], 2),
            Ok(Tally::Held {
                remaining: Some(Duration::from_millis(200)),
                delayed: false
            })
        );
    }

    fn rec(entry: Option<(&str, u64)>, pttl: u64, delay: u64) -> Option<Record> {
        Some(Record {
            entry: entry.map(|(l, t)| (l.to_owned(), t)),
            pttl: entry.map(|_| Duration::from_millis(pttl)),
            delay: (delay > 0).then(|| Duration::from_millis(delay)),
            counter: Some(7),
            readers: None,
        })
    }

    #[test]
    fn inspection_names_a_holder_only_with_a_majority() {
        let held = inspect(
            &[
                rec(Some(("A", 7)), 900, 0),
                rec(Some(("A", 0)), 500, 0),
                rec(None, 0, 0),
            ],
            2,
        )
        .unwrap();
        let h = held.holder.unwrap();
        // Token: the one written back; time left: until fewer than 2 keep it.
        assert_eq!((h.lease.as_str(), h.token), ("A", 7));
        assert_eq!(h.remaining, Some(Duration::from_millis(500)));
        let split = inspect(
            &[
                rec(Some(("A", 7)), 900, 0),
                rec(Some(("B", 8)), 500, 0),
                rec(None, 0, 0),
            ],
            2,
        )
        .unwrap();
        assert!(split.split && split.holder.is_none());
        let delayed = inspect(&[rec(None, 0, 300), rec(None, 0, 100), rec(None, 0, 0)], 2).unwrap();
        assert_eq!(delayed.delayed, Some(Duration::from_millis(100)));
        assert_eq!(delayed.last_token, Some(7));
        let free = inspect(&[rec(None, 0, 300), rec(None, 0, 0), rec(None, 0, 0)], 2).unwrap();
        assert_eq!(free.delayed, None);
        assert!(inspect(&[rec(None, 0, 0), None, None], 2).is_err());
    }

    #[test]
    fn quorum_is_a_strict_majority() {
        assert_eq!(quorum(3), 2);
        assert_eq!(quorum(5), 3);
        assert_eq!(quorum(7), 4);
    }

    #[test]
    fn validity_subtracts_elapsed_and_drift() {
        let ttl = Duration::from_millis(1000);
        assert_eq!(
            validity(ttl, Duration::from_millis(100), 0.01),
            Some(Duration::from_millis(888))
        );
        assert_eq!(validity(ttl, Duration::from_millis(988), 0.01), None);
        assert_eq!(validity(ttl, Duration::from_secs(2), 0.01), None);
    }

    #[test]
    fn a_majority_mints_above_every_counter_of_its_masters() {
        let votes = [g(7, 0, 5), g(9, 0, 5), held(100), g(3, 0, 5), Vote::Unknown];
        assert_eq!(
            tally(&votes, 3),
            Ok(Tally::Majority {
                token: 10,
                granted: vec![0, 1, 3]
            })
        );
        // The clock floor wins over small counters.
        let votes = [g(7, 0, 5000), g(9, 0, 4000), g(1, 0, 0)];
        assert_eq!(
            tally(&votes, 2),
            Ok(Tally::Majority {
                token: 5000,
                granted: vec![0, 1, 2]
            })
        );
    }

    #[test]
    fn a_retry_keeps_its_token_unless_a_counter_passed_it() {
        // Written back to two masters (their counters are 12), not the third.
        let votes = [g(12, 12, 0), g(12, 12, 0), g(4, 0, 0)];
        assert_eq!(
            tally(&votes, 2),
            Ok(Tally::Majority {
                token: 12,
                granted: vec![0, 1, 2]
            })
        );
        // A master minted past it meanwhile (restarted empty, say): mint anew.
        let votes = [g(12, 12, 0), g(20, 0, 0), g(4, 0, 0)];
        assert_eq!(
            tally(&votes, 2),
            Ok(Tally::Majority {
                token: 21,
                granted: vec![0, 1, 2]
            })
        );
    }

    #[test]
    fn abstaining_masters_count_for_nobody() {
        let q = |ms| Vote::Abstain {
            remaining: Duration::from_millis(ms),
        };
        // One of five abstains: the other four still make a majority.
        assert_eq!(
            tally(&[q(900), g(1, 0, 0), g(2, 0, 0), g(3, 0, 0), held(7)], 3),
            Ok(Tally::Majority {
                token: 4,
                granted: vec![1, 2, 3]
            })
        );
        // Three of five abstain: no majority until the first of them is back.
        assert_eq!(
            tally(&[q(900), q(300), q(600), g(1, 0, 0), g(2, 0, 0)], 3),
            Ok(Tally::Quarantined {
                remaining: Duration::from_millis(300)
            })
        );
        // A fresh deployment: all abstain; three must come back.
        assert_eq!(
            tally(&[q(5), q(4), q(3), q(2), q(1)], 3),
            Ok(Tally::Quarantined {
                remaining: Duration::from_millis(3)
            })
        );
    }

    #[test]
    fn held_split_and_undecided() {
        assert_eq!(
            tally(&[held(300), held(200), g(1, 0, 0)], 2),
            Ok(Tally::Held {
                remaining: Some(Duration::from_millis(200)),
                delayed: false
            })
        );
        assert_eq!(
            tally(&[g(1, 0, 0), g(1, 0, 0), held(5), held(5), held(9)], 3),
            Ok(Tally::Held {
                remaining: Some(Duration::from_millis(5)),
                delayed: false
            })
        );
        assert_eq!(
            tally(
                &[g(1, 0, 0), g(1, 0, 0), held(5), held(5), Vote::Unknown],
                3
            ),
            Ok(Tally::Undecided)
        );
        assert_eq!(
            tally(
                &[g(1, 0, 0), g(1, 0, 0), held(5), held(5), g(1, 0, 0)][..4],
                3
            ),
            Ok(Tally::Split)
        );
        assert_eq!(
            tally(&[Vote::Unknown, Vote::Unknown, g(1, 0, 0)], 2),
            Ok(Tally::Undecided)
        );
    }
}
