//! Reading what one Redis records for a key ([`super::scripts::INSPECT`]),
//! for `GET /v1/locks/{key}?scope=backend` — shared with RedLock, which
//! reads each master with the same script and counts the answers — and a
//! reentrant lease's hold count ([`super::scripts::HOLDS`]).

use std::time::Duration;

use crate::lock::{BackendError, HolderView, Holds, KeyView};

/// One server's record of a key: the lock entry's lease and token (`0`:
/// a RedLock entry before its token's write-back), its PTTL, the delay
/// marker's PTTL, the counter, and the live read leases (where the script
/// was given the readers hash: not on RedLock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub entry: Option<(String, u64)>,
    pub pttl: Option<Duration>,
    pub delay: Option<Duration>,
    pub counter: Option<u64>,
    pub readers: Option<u64>,
}

/// PTTL: -1 no expiry (fencer always sets one), -2 no such key.
fn pttl(v: &str) -> Option<Duration> {
    v.parse::<i64>()
        .ok()
        .filter(|ms| *ms >= 0)
        .map(|ms| Duration::from_millis(ms as u64))
}

/// A permit count as the `PERMITS` script answers it.
pub fn permits(value: redis::Value) -> Result<u32, BackendError> {
    let n: i64 =
        redis::from_redis_value(value).map_err(|e| BackendError::Protocol(e.to_string()))?;
    u32::try_from(n)
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| BackendError::Protocol(format!("semaphore permit count {n}")))
}

/// The script's `{entry, pttl, delay pttl, counter[, readers]}`.
pub fn record(value: redis::Value) -> Result<Record, BackendError> {
    let parts: Vec<String> =
        redis::from_redis_value(value).map_err(|e| BackendError::Protocol(e.to_string()))?;
    let (entry, lock_pttl, delay_pttl, counter, readers) = match parts.as_slice() {
        [e, p, d, c] => (e.clone(), p, d, c, None),
        [e, p, d, c, r] => (e.clone(), p, d, c, r.parse().ok()),
        _ => {
            return Err(BackendError::Protocol(format!(
                "key record of {} parts",
                parts.len()
            )))
        }
    };
    let entry = match entry.split_once(' ') {
        _ if entry.is_empty() => None,
        Some((lease, token)) => Some((
            lease.to_owned(),
            token
                .parse()
                .map_err(|_| BackendError::Protocol(format!("lock entry with token {token:?}")))?,
        )),
        None => return Err(BackendError::Protocol("lock entry without a token".into())),
    };
    Ok(Record {
        entry,
        pttl: pttl(lock_pttl),
        delay: pttl(delay_pttl),
        readers,
        // A counter at 2^53 and beyond is printed exactly by Redis; a
        // non-number (never written by fencer) is left out.
        counter: (!counter.is_empty())
            .then(|| counter.parse().ok())
            .flatten(),
    })
}

impl Record {
    /// The key as this one server sees it.
    pub fn view(self) -> KeyView {
        let holder = self.entry.map(|(lease, token)| HolderView {
            lease,
            token,
            remaining: self.pttl,
        });
        let reading = self.readers.is_some_and(|n| n > 0);
        KeyView {
            delayed: if holder.is_none() && !reading {
                self.delay
            } else {
                None
            },
            holder,
            last_token: self.counter,
            readers: self.readers,
            ..KeyView::default()
        }
    }
}

/// The hold-count script's `{status, holds, owner, applied}`.
pub fn holds(value: redis::Value) -> Result<Holds, BackendError> {
    let (status, holds, owner, applied): (i64, u32, String, i64) =
        redis::from_redis_value(value).map_err(|e| BackendError::Protocol(e.to_string()))?;
    Ok(match status {
        1 => Holds::Owned {
            holds,
            owner: (!owner.is_empty()).then_some(owner),
            applied: applied == 1,
        },
        0 => Holds::Free,
        _ => Holds::OtherHolder,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(parts: [&str; 4]) -> redis::Value {
        redis::Value::Array(
            parts
                .iter()
                .map(|p| redis::Value::BulkString(p.as_bytes().to_vec()))
                .collect(),
        )
    }

    #[test]
    fn a_held_key_a_delayed_key_and_a_free_one() {
        let held = record(reply(["L1 42", "900", "1900", "42"]))
            .unwrap()
            .view();
        assert_eq!(
            held.holder,
            Some(HolderView {
                lease: "L1".into(),
                token: 42,
                remaining: Some(Duration::from_millis(900))
            })
        );
        assert_eq!((held.delayed, held.last_token), (None, Some(42)));
        let delayed = record(reply(["", "-2", "700", "42"])).unwrap().view();
        assert_eq!(
            (delayed.holder, delayed.delayed),
            (None, Some(Duration::from_millis(700)))
        );
        let free = record(reply(["", "-2", "-2", ""])).unwrap().view();
        assert_eq!(free, KeyView::default());
    }

    #[test]
    fn readers_holding_the_key_are_counted_and_hide_the_delay() {
        let parts = ["", "-2", "700", "42", "3"].map(|p| redis::Value::BulkString(p.into()));
        let read = record(redis::Value::Array(parts.to_vec())).unwrap().view();
        assert_eq!(
            (read.holder, read.readers, read.delayed),
            (None, Some(3), None)
        );
    }

    #[test]
    fn an_entry_that_is_not_fencers_is_a_protocol_error() {
        assert!(record(reply(["L1", "900", "-2", ""])).is_err());
        assert!(record(reply(["L1 x", "900", "-2", ""])).is_err());
    }
}
