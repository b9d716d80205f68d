//! The RedLock backend: a lock held on a majority of independent Redis
//! masters — with a fencing token that strictly increases per key.
//!
//! RedLock as published gives no token, and its safety rests on timing
//! (Kleppmann's critique). Here every acquisition is two rounds over all
//! masters at once ([`scripts`]): `LOCK` takes the key and reports each
//! master's token counter; once a majority granted with validity left, a
//! token above every counter of that majority is minted ([`vote`]) and
//! written back to a majority (`STAMP`) before it is handed out. Any later
//! majority shares a master with that one, so it mints higher — unless that
//! master lost its data (restart without `appendfsync always`), which is
//! what the hybrid clock floor (`TIME` × 1024 in every token), the
//! gateway's marks and pre-registration repair are for (docs/backends.md, "RedLock").
//!
//! - A master that lost its data could grant a lock it already granted;
//!   with `restart_quarantine_ms` a master votes only once it has kept its
//!   data (an age marker, gone with the data) that long, and no lease may
//!   be longer ([`LockBackend::max_ttl`]).
//! - A round that got no majority releases what it took, on every master,
//!   before it answers; a split vote answers "held" with a retry after
//!   `retry_delay_ms` + jitter.
//! - Renewal extends on every master and counts only with a majority and
//!   validity left; release runs on every master, each publishing the
//!   wake-up, and waiters listen on every master.
//! - The sidecar's local deadline is computed from the send time with the
//!   larger of its own and RedLock's drift ratio (`sidecar/mod.rs`): the
//!   RedLock validity, never the requested TTL.
//! - A master that may evict lock entries forgets grants like one restarted
//!   empty, so every master must say `maxmemory-policy noeviction`
//!   ([`super::redis::eviction`]): one that says otherwise stops acquires;
//!   one not checked yet (unreachable, just reconnected) does not vote.

pub mod scripts;
pub mod settings;
pub mod vote;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures_util::future::join_all;
use rand::Rng;
use redis::aio::ConnectionManager;

use self::settings::RedLockSettings;
use self::vote::{quorum, tally, validity, Tally, Vote};
use super::redis::client::{manager_config, open_client, ClientTls};
use super::redis::conn::{self, Call, Target};
use super::redis::eviction::{EvictionGuard, Wording};
use super::redis::inspect::{self, Record};
use super::redis::keys::RedisKeys;
use super::redis::scripts::{Lua, Scripts};
use super::redis::subscriber::{Source, Subscriber};
use super::{
    Attempt, BackendError, KeyView, LeaseId, LockBackend, LockKey, Ownership, WakeSink, WatchGuard,
};
use crate::metrics::redlock::RedLockMetrics;

struct Master {
    /// `host:port`, for messages.
    name: String,
    conn: ConnectionManager,
    subscriber: Subscriber,
}

pub struct RedLockBackend {
    masters: Vec<Master>,
    quorum: usize,
    scripts: Scripts,
    lock: Lua,
    stamp: Lua,
    prefix: String,
    /// Bound on one call to one master.
    timeout: Duration,
    drift_ratio: f64,
    retry_delay: Duration,
    retry_jitter: Duration,
    /// Token counters expire this long after their last write, and never
    /// before their master's clock floor passed them (0: never;
    /// `lock::redis::counters`).
    counter_idle_ms: u64,
    /// `backend.redlock.restart_quarantine_ms` (zero: off).
    quarantine: Duration,
    /// The marker whose age tells a master kept its data (see `LOCK`).
    age_key: String,
    lock_delay_ms: u64,
    metrics: RedLockMetrics,
    /// Which masters may vote, by their eviction policy.
    eviction: Arc<EvictionGuard>,
}

/// What one master answered to a renewal or release script.
#[derive(Debug, Clone, Copy)]
enum Found {
    Owned(u64),
    Free,
    Other,
}

impl RedLockBackend {
    /// Connects lazily: a sidecar starts (not ready) while masters are down.
    pub fn new(
        settings: &RedLockSettings,
        lock_delay: Duration,
        wake: Arc<dyn WakeSink>,
        registry: &prometheus::Registry,
    ) -> Result<RedLockBackend, BackendError> {
        let tls = ClientTls::from_file(settings.ca_file.as_deref())?;
        let timeout = Duration::from_millis(settings.request_timeout_ms);
        let connect_timeout = Duration::from_millis(settings.connect_timeout_ms);
        let mut masters = Vec::with_capacity(settings.urls.len());
        for url in &settings.urls {
            let client = open_client(url, &tls)
                .map_err(|e| BackendError::Unavailable(format!("invalid redlock url: {e}")))?;
            let config = manager_config(timeout, connect_timeout);
            let conn = ConnectionManager::new_lazy_with_config(client.clone(), config)
                .map_err(|e| BackendError::Unavailable(e.to_string()))?;
            let subscriber = Subscriber::start(
                Source::Fixed(Box::new(client)),
                settings.key_prefix.clone(),
                connect_timeout,
                wake.clone(),
            );
            let name = match url::Url::parse(url) {
                Ok(u) => format!(
                    "{}:{}",
                    u.host_str().unwrap_or_default(),
                    u.port().unwrap_or(6379)
                ),
                Err(_) => crate::settings::check::redact_url(url),
            };
            masters.push(Master {
                name,
                conn,
                subscriber,
            });
        }
        let metrics = RedLockMetrics::new(registry, masters.len());
        let eviction = EvictionGuard::start(
            Wording {
                what: "redlock master",
                setting: "backend.redlock.allow_eviction",
            },
            settings.allow_eviction,
            Some(quorum(masters.len())),
            timeout,
            Duration::from_millis(settings.eviction_check_interval_ms),
            metrics.eviction.clone(),
        );
        eviction.set_servers(
            masters
                .iter()
                .enumerate()
                .map(|(i, m)| (m.name.clone(), i.to_string(), Target::Node(m.conn.clone())))
                .collect(),
        );
        Ok(RedLockBackend {
            quorum: quorum(masters.len()),
            metrics,
            eviction,
            masters,
            scripts: Scripts::new(),
            lock: Lua::new(scripts::LOCK),
            stamp: Lua::new(scripts::STAMP),
            prefix: settings.key_prefix.clone(),
            timeout,
            drift_ratio: settings.clock_drift_ratio,
            retry_delay: Duration::from_millis(settings.retry_delay_ms),
            retry_jitter: Duration::from_millis(settings.retry_jitter_ms),
            quarantine: Duration::from_millis(settings.restart_quarantine_ms),
            counter_idle_ms: settings.counters().idle_ttl_ms(),
            age_key: format!("{}redlock:data-age", settings.key_prefix),
            lock_delay_ms: lock_delay.as_millis() as u64,
        })
    }

    fn keys(&self, key: &LockKey) -> RedisKeys {
        RedisKeys::new(&self.prefix, key)
    }

    /// Runs `lua` with `call` on the masters `which`, all at once, each
    /// bounded by the per-master timeout. `None` for a master that failed
    /// or did not answer in time.
    async fn on(&self, which: &[usize], lua: &Lua, call: &Call) -> Vec<Option<redis::Value>> {
        let runs = which.iter().map(|&i| async move {
            let mut target = Target::Node(self.masters[i].conn.clone());
            let reply =
                tokio::time::timeout(self.timeout, conn::run(&mut target, lua, call, None)).await;
            match reply {
                Ok(Ok(r)) => Some(r.value),
                failed => {
                    self.metrics
                        .master_errors
                        .with_label_values(&[&i.to_string()])
                        .inc();
                    let error = match failed {
                        Err(_) => {
                            // No answer in time: the error that would say
                            // whether it reconnects went with the call.
                            self.eviction.invalidate(Some(&self.masters[i].name));
                            "timed out".to_owned()
                        }
                        Ok(Err(e)) => {
                            if crate::lock::redis::conn::may_reconnect(&e) {
                                // It reconnects to a server whose policy
                                // must be read again before it votes.
                                self.eviction.invalidate(Some(&self.masters[i].name));
                            }
                            e.to_string()
                        }
                        Ok(Ok(_)) => unreachable!(),
                    };
                    tracing::debug!(master = i, error, "redlock master call failed");
                    None
                }
            }
        });
        join_all(runs).await
    }

    /// Each master's record of `key` (`None`: no answer).
    async fn records(&self, key: &LockKey) -> Vec<Option<Record>> {
        let k = self.keys(key);
        let mut call = Call::default();
        call.key(k.lock()).key(k.delay()).key(k.counter());
        self.on(&self.all(), &self.scripts.inspect, &call)
            .await
            .into_iter()
            .map(|v| v.and_then(|v| inspect::record(v).ok()))
            .collect()
    }

    fn all(&self) -> Vec<usize> {
        (0..self.masters.len()).collect()
    }

    /// Releases `lease` on every master; the result per master.
    async fn release_everywhere(&self, key: &LockKey, lease: &LeaseId) -> Vec<Option<Found>> {
        let k = self.keys(key);
        let mut call = Call::default();
        call.key(k.lock())
            .key(k.delay())
            .arg(lease.as_str())
            .arg(k.channel())
            .arg("PUBLISH");
        self.on(&self.all(), &self.scripts.release, &call)
            .await
            .into_iter()
            .map(|v| v.and_then(found))
            .collect()
    }

    fn split_retry(&self) -> Duration {
        let jitter = if self.retry_jitter.is_zero() {
            Duration::ZERO
        } else {
            rand::rng().random_range(Duration::ZERO..=self.retry_jitter)
        };
        self.retry_delay + jitter
    }

    fn round(&self, op: &str, outcome: &str) {
        self.metrics.rounds.with_label_values(&[op, outcome]).inc();
    }
}

/// `{1, counter, token, floor}`, `{-1, pttl}` or `{-3, pttl}` (lock-delay)
/// → a vote.
fn vote(value: Option<redis::Value>) -> Vote {
    let Some(value) = value else {
        return Vote::Unknown;
    };
    let Ok(fields) = redis::from_redis_value::<Vec<redis::Value>>(value) else {
        return Vote::Unknown;
    };
    let num = |i: usize| -> Option<i64> {
        fields
            .get(i)
            .and_then(|v| redis::from_redis_value::<String>(v.clone()).ok())
            .and_then(|s| s.parse().ok())
    };
    match num(0) {
        Some(0) => Vote::Abstain {
            remaining: Duration::from_millis(num(1).unwrap_or(0).max(0) as u64),
        },
        Some(1) => match (num(1), num(2), num(3)) {
            (Some(c), Some(t), Some(f)) if c >= 0 && t >= 0 && f >= 0 => Vote::Granted {
                counter: c as u64,
                token: t as u64,
                floor: f as u64,
            },
            _ => Vote::Unknown,
        },
        Some(status @ (-1 | -3)) => Vote::Held {
            pttl: num(1)
                .filter(|p| *p >= 0)
                .map(|p| Duration::from_millis(p as u64)),
            delayed: status == -3,
        },
        _ => Vote::Unknown,
    }
}

/// `{status, "token"}` from the renew and release scripts (the token is
/// `0` on a master the write-back did not reach).
fn found(value: redis::Value) -> Option<Found> {
    let (status, token): (i64, String) = redis::from_redis_value(value).ok()?;
    match status {
        1 => Some(Found::Owned(token.parse().ok()?)),
        0 => Some(Found::Free),
        -1 => Some(Found::Other),
        _ => None,
    }
}

/// Renewal or release results of every master → one answer: owned when a
/// majority holds the lease (with the highest token seen), free or other
/// when a majority can no longer hold it, unknown otherwise.
fn decide(results: &[Option<Found>], quorum: usize) -> Option<Ownership> {
    let owned: Vec<u64> = results
        .iter()
        .filter_map(|r| match r {
            Some(Found::Owned(t)) => Some(*t),
            _ => None,
        })
        .collect();
    let other = results
        .iter()
        .filter(|r| matches!(r, Some(Found::Other)))
        .count();
    let answered_not = results
        .iter()
        .filter(|r| matches!(r, Some(Found::Free | Found::Other)))
        .count();
    if owned.len() >= quorum {
        let token = owned.into_iter().max().unwrap_or(0);
        return (token > 0).then_some(Ownership::Owned { token });
    }
    if answered_not > results.len() - quorum {
        return Some(if other > 0 {
            Ownership::OtherHolder
        } else {
            Ownership::Free
        });
    }
    None
}

#[async_trait]
impl LockBackend for RedLockBackend {
    fn name(&self) -> &'static str {
        "redlock"
    }

    async fn try_acquire(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Attempt, BackendError> {
        let k = self.keys(key);
        let started = Instant::now();
        let mut call = Call::default();
        call.key(k.lock())
            .key(k.counter())
            .key(k.delay())
            .key(self.age_key.clone())
            .arg(lease.as_str())
            .arg(ttl.as_millis() as u64)
            .arg(self.lock_delay_ms)
            .arg(if crate::mutants::active("redlock_no_quarantine") {
                0
            } else {
                self.quarantine.as_millis() as u64
            });
        // Masters whose eviction policy is not known to be safe do not
        // vote: their answer is "unknown", as if they had not answered.
        let usable = self.eviction.admit().await?;
        let voters: Vec<usize> = self
            .all()
            .into_iter()
            .filter(|&i| usable.get(i).copied().unwrap_or(false))
            .collect();
        let mut answers = self.on(&voters, &self.lock, &call).await.into_iter();
        let votes: Vec<Vote> = self
            .all()
            .into_iter()
            .map(|i| {
                if voters.contains(&i) {
                    vote(answers.next().flatten())
                } else {
                    Vote::Unknown
                }
            })
            .collect();
        let outcome = tally(&votes, self.quorum).map_err(BackendError::Protocol)?;
        let (token, granted) = match outcome {
            Tally::Majority { token, granted } => (token, granted),
            Tally::Held { remaining, delayed } => {
                self.round("acquire", "held");
                // Masters where this lease did get the key: give it back now,
                // or they would stay taken for the TTL.
                if votes.iter().any(|v| matches!(v, Vote::Granted { .. })) {
                    self.release_everywhere(key, lease).await;
                }
                return Ok(match remaining {
                    Some(remaining) if delayed => Attempt::Delayed { remaining },
                    _ => Attempt::Held { remaining },
                });
            }
            Tally::Split => {
                self.round("acquire", "split");
                self.release_everywhere(key, lease).await;
                return Ok(Attempt::Held {
                    remaining: Some(self.split_retry()),
                });
            }
            Tally::Quarantined { remaining } => {
                self.round("acquire", "quarantined");
                if votes.iter().any(|v| matches!(v, Vote::Granted { .. })) {
                    self.release_everywhere(key, lease).await;
                }
                return Err(BackendError::Refused(format!(
                    "redlock: too many masters are in their restart quarantine (backend.redlock.restart_quarantine_ms) for a majority; enough are back in {} ms",
                    remaining.as_millis()
                )));
            }
            Tally::Undecided => {
                self.round("acquire", "undecided");
                self.release_everywhere(key, lease).await;
                return Err(BackendError::Unavailable(format!(
                    "redlock: too few of {} masters answered to decide",
                    self.masters.len()
                )));
            }
        };
        if validity(ttl, started.elapsed(), self.drift_ratio).is_none() {
            self.round("acquire", "validity_exhausted");
            self.release_everywhere(key, lease).await;
            return Err(BackendError::Unavailable(format!(
                "redlock: a majority granted, but after {} ms nothing of the {} ms TTL was left",
                started.elapsed().as_millis(),
                ttl.as_millis()
            )));
        }
        let mut stamp = Call::default();
        stamp
            .key(k.lock())
            .key(k.counter())
            .arg(lease.as_str())
            .arg(token)
            .arg(self.counter_idle_ms);
        let written = self
            .on(&granted, &self.stamp, &stamp)
            .await
            .into_iter()
            .filter(|v| {
                v.as_ref()
                    .and_then(|v| redis::from_redis_value::<i64>(v.clone()).ok())
                    == Some(1)
            })
            .count();
        if written < self.quorum {
            self.round("acquire", "writeback_short");
            self.release_everywhere(key, lease).await;
            return Err(BackendError::Unavailable(format!(
                "redlock: the token reached {written} of {} masters, fewer than a majority",
                self.masters.len()
            )));
        }
        if validity(ttl, started.elapsed(), self.drift_ratio).is_none() {
            self.round("acquire", "validity_exhausted");
            self.release_everywhere(key, lease).await;
            return Err(BackendError::Unavailable(
                "redlock: the token write-back used up the lock's validity".into(),
            ));
        }
        self.round("acquire", "majority");
        Ok(Attempt::Acquired { token })
    }

    async fn renew(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Ownership, BackendError> {
        let results = self
            .renew_many(&[(key.clone(), lease.clone(), ttl)])
            .await?;
        Ok(results[0])
    }

    /// One `RENEW_MANY` per master for the whole batch, all masters at once;
    /// each lease counts as renewed only with a majority and validity left.
    async fn renew_many(
        &self,
        items: &[(LockKey, LeaseId, Duration)],
    ) -> Result<Vec<Ownership>, BackendError> {
        let started = Instant::now();
        let mut call = Call::default();
        for (key, lease, ttl) in items {
            let k = self.keys(key);
            call.key(k.lock())
                .key(k.delay())
                .arg(lease.as_str())
                .arg(ttl.as_millis() as u64);
        }
        call.arg(self.lock_delay_ms);
        let per_master: Vec<Vec<Option<Found>>> = self
            .on(&self.all(), &self.scripts.renew_many, &call)
            .await
            .into_iter()
            .map(|v| {
                let pairs = v
                    .and_then(|v| redis::from_redis_value::<Vec<redis::Value>>(v).ok())
                    .filter(|p| p.len() == items.len() * 2);
                match pairs {
                    Some(p) => p
                        .chunks(2)
                        .map(|c| found(redis::Value::Array(c.to_vec())))
                        .collect(),
                    None => vec![None; items.len()],
                }
            })
            .collect();
        let elapsed = started.elapsed();
        let mut out = Vec::with_capacity(items.len());
        let mut undecided = false;
        for (i, (_, _, ttl)) in items.iter().enumerate() {
            let column: Vec<Option<Found>> = per_master.iter().map(|m| m[i]).collect();
            match decide(&column, self.quorum) {
                Some(Ownership::Owned { token }) => {
                    if validity(*ttl, elapsed, self.drift_ratio).is_some() {
                        self.round("renew", "majority");
                        out.push(Ownership::Owned { token });
                    } else {
                        self.round("renew", "validity_exhausted");
                        undecided = true;
                        out.push(Ownership::Free);
                    }
                }
                Some(other) => {
                    self.round("renew", "lost");
                    out.push(other);
                }
                None => {
                    self.round("renew", "undecided");
                    undecided = true;
                    out.push(Ownership::Free);
                }
            }
        }
        if undecided && items.len() == 1 {
            // A single renewal the masters could not decide: its outcome
            // is unknown (the sidecar then caps the lease's deadline).
            return Err(BackendError::Unavailable(
                "redlock: no majority answered the renewal in time".into(),
            ));
        }
        Ok(out)
    }

    async fn release(&self, key: &LockKey, lease: &LeaseId) -> Result<Ownership, BackendError> {
        let results = self.release_everywhere(key, lease).await;
        if let Some(token) = results
            .iter()
            .filter_map(|r| match r {
                Some(Found::Owned(t)) => Some(*t),
                _ => None,
            })
            .max()
        {
            return Ok(Ownership::Owned { token });
        }
        decide(&results, self.quorum).ok_or_else(|| {
            BackendError::Unavailable("redlock: too few masters answered the release".into())
        })
    }

    /// Fixed on every master; the count a majority answers stands (two
    /// first uses with different counts racing can leave no majority:
    /// unavailable, and the next call finds the count the race settled on
    /// where it did).
    async fn fix_permits(&self, name: &LockKey, permits: u32) -> Result<u32, BackendError> {
        let mut call = Call::default();
        call.key(self.keys(name).permits()).arg(permits);
        let answers: Vec<u32> = self
            .on(&self.all(), &self.scripts.permits, &call)
            .await
            .into_iter()
            .flatten()
            .filter_map(|v| inspect::permits(v).ok())
            .collect();
        let mut counts = std::collections::BTreeMap::new();
        for n in answers {
            *counts.entry(n).or_insert(0usize) += 1;
        }
        counts
            .into_iter()
            .find(|(_, votes)| *votes >= self.quorum)
            .map(|(n, _)| n)
            .ok_or_else(|| {
                BackendError::Unavailable(format!(
                    "redlock: no majority of {} masters agrees on the semaphore's permit count",
                    self.masters.len()
                ))
            })
    }

    async fn raise_token_floor(&self, key: &LockKey, floor: u64) -> Result<(), BackendError> {
        let k = self.keys(key);
        let mut call = Call::default();
        call.key(k.counter()).arg(floor).arg(self.counter_idle_ms);
        // Only masters known not to evict get a counter with an expiry
        // (as only they vote).
        let usable = self.eviction.admit().await?;
        let writable: Vec<usize> = self
            .all()
            .into_iter()
            .filter(|&i| usable.get(i).copied().unwrap_or(false))
            .collect();
        let raised = self
            .on(&writable, &self.scripts.raise_floor, &call)
            .await
            .into_iter()
            .flatten()
            .count();
        if raised >= self.quorum {
            Ok(())
        } else {
            Err(BackendError::Unavailable(format!(
                "redlock: the token floor reached {raised} of {} masters",
                self.masters.len()
            )))
        }
    }

    fn max_ttl_why(&self) -> &'static str {
        "backend.redlock.restart_quarantine_ms"
    }

    fn max_ttl(&self) -> Option<Duration> {
        (!self.quarantine.is_zero()).then_some(self.quarantine)
    }

    async fn watch(&self, key: &LockKey, timeout: Duration) -> WatchGuard {
        let channel = self.keys(key).channel();
        let guards = join_all(
            self.masters
                .iter()
                .map(|m| m.subscriber.watch(channel.clone(), key.as_str(), timeout)),
        )
        .await;
        WatchGuard::new(guards)
    }

    async fn inspect(&self, key: &LockKey) -> Result<KeyView, BackendError> {
        let records = self.records(key).await;
        vote::inspect(&records, self.quorum).map_err(BackendError::Unavailable)
    }

    async fn ping(&self) -> Result<(), BackendError> {
        let answers = join_all(self.masters.iter().map(|m| async {
            let mut target = Target::Node(m.conn.clone());
            tokio::time::timeout(
                self.timeout.max(Duration::from_millis(200)),
                target.command::<String>(&redis::cmd("PING")),
            )
            .await
            .is_ok_and(|r| r.is_ok())
        }))
        .await;
        let up = answers.iter().filter(|a| **a).count();
        self.metrics.masters_up.set(up as i64);
        if up >= self.quorum {
            // A master that answered with an eviction policy other than
            // noeviction stops the backend, and a majority must be known
            // safe to vote.
            let safe = self.eviction.admit().await?.iter().filter(|u| **u).count();
            if safe >= self.quorum {
                Ok(())
            } else {
                Err(BackendError::Unavailable(format!(
                    "redlock: {safe} of {} masters checked maxmemory-policy noeviction, fewer than a majority",
                    self.masters.len()
                )))
            }
        } else {
            Err(BackendError::Unavailable(format!(
                "redlock: {up} of {} masters answer, fewer than a majority",
                self.masters.len()
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_renewal_counts_with_a_majority_only() {
        let o = |t| Some(Found::Owned(t));
        let free = Some(Found::Free);
        let other = Some(Found::Other);
        assert_eq!(
            decide(&[o(5), o(5), free, None, o(5)], 3),
            Some(Ownership::Owned { token: 5 })
        );
        // Two of five: not renewed, but not known lost either.
        assert_eq!(decide(&[o(5), o(5), None, None, free], 3), None);
        // Three of five said no: it cannot hold a majority.
        assert_eq!(
            decide(&[o(5), o(5), free, free, other], 3),
            Some(Ownership::OtherHolder)
        );
        assert_eq!(
            decide(&[free, free, free, None, None], 3),
            Some(Ownership::Free)
        );
    }
}
