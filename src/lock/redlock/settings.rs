//! `[backend.redlock]`: the independent Redis masters a RedLock spans, and
//! the timing rules that make a majority grant worth anything.

use serde::{Deserialize, Serialize};

use crate::lock::redis::counters::CounterPolicy;
use crate::settings::check::{check_range, invalid, ConfigError};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedLockSettings {
    /// `redis://[user:password@]host:port/db` (or `rediss://`) of each
    /// independent master: an odd number, at least 3 (5 is usual). Not
    /// replicas of each other: RedLock's safety comes from independence.
    pub urls: Vec<String>,
    /// Bound on one call to one master. Far below the lease TTL: a grant
    /// counts only if the majority answered with validity left
    /// (`ttl − elapsed − drift`).
    pub request_timeout_ms: u64,
    pub connect_timeout_ms: u64,
    /// The masters' clocks may run this much faster than ours: validity =
    /// `ttl − elapsed − ttl × clock_drift_ratio − 2 ms`.
    pub clock_drift_ratio: f64,
    /// After a split vote (no contender got a majority) each contender
    /// releases what it got and tries again after this delay plus up to
    /// `retry_jitter_ms`, so they do not collide again in lockstep.
    pub retry_delay_ms: u64,
    pub retry_jitter_ms: u64,
    /// A master that lost its data (a restart without `appendfsync always`)
    /// could grant a lock it had already granted to a lease still alive on
    /// other masters. So a master votes only once it has kept its data this
    /// long: a marker key written at its first vote, gone with its data,
    /// starts the quarantine again. Leases longer than this are refused.
    /// 0 = off: only with `appendfsync always` on every master.
    pub restart_quarantine_ms: u64,
    pub key_prefix: String,
    /// A key's token counter on each master expires this long after the
    /// last token written to it (and never before that master's clock
    /// floor has passed it): see `lock::redis::counters`. Unset: a day
    /// (never with `allow_eviction`); 0 = never.
    pub counter_idle_ttl_ms: Option<u64>,
    /// Every master's `maxmemory-policy` must be `noeviction`: a master that
    /// evicts a live lock entry forgets a grant, like one restarted empty,
    /// and with it a second client can reach a "majority". Until every
    /// master that answers says `noeviction` the backend is not ready and
    /// acquires answer 503; a master not yet checked (unreachable, just
    /// reconnected) does not vote. `true` turns the refusal into a warning
    /// at every check.
    pub allow_eviction: bool,
    /// How often every master's eviction policy is read again, besides at
    /// start and after a master reconnects.
    pub eviction_check_interval_ms: u64,
    /// PEM CA for `rediss://` masters with a private CA.
    pub ca_file: Option<String>,
}

impl Default for RedLockSettings {
    fn default() -> Self {
        Self {
            urls: Vec::new(),
            request_timeout_ms: 50,
            connect_timeout_ms: 200,
            clock_drift_ratio: 0.01,
            retry_delay_ms: 50,
            retry_jitter_ms: 50,
            restart_quarantine_ms: 60_000,
            key_prefix: "fencer:".into(),
            counter_idle_ttl_ms: None,
            allow_eviction: false,
            eviction_check_interval_ms: 10_000,
            ca_file: None,
        }
    }
}

impl RedLockSettings {
    /// How the masters' token counters expire (RedLock tokens always have
    /// the clock floor).
    pub fn counters(&self) -> CounterPolicy {
        CounterPolicy {
            field: "backend.redlock.counter_idle_ttl_ms",
            configured: self.counter_idle_ttl_ms,
            clock_floor: true,
            allow_eviction: self.allow_eviction,
            eviction_field: "backend.redlock.allow_eviction",
        }
    }

    /// `selected`: this is the configured backend, so it needs its masters.
    pub(crate) fn validate(&self, selected: bool) -> Result<(), ConfigError> {
        if selected && (self.urls.len() < 3 || self.urls.len() % 2 == 0) {
            return Err(invalid(
                "backend.redlock.urls",
                format!(
                    "RedLock needs an odd number of independent masters, at least 3 (got {})",
                    self.urls.len()
                ),
            ));
        }
        check_range(
            "backend.redlock.urls (count)",
            self.urls.len() as u64,
            0,
            15,
        )?;
        for (i, u) in self.urls.iter().enumerate() {
            let url = url::Url::parse(u)
                .map_err(|e| invalid("backend.redlock.urls", format!("`{u}`: not a URL ({e})")))?;
            if !matches!(url.scheme(), "redis" | "rediss")
                || url.host_str().is_none_or(str::is_empty)
            {
                return Err(invalid(
                    "backend.redlock.urls",
                    format!("`{u}`: expected redis://host:port or rediss://host:port"),
                ));
            }
            let same = |o: &String| {
                url::Url::parse(o)
                    .is_ok_and(|o| o.host_str() == url.host_str() && o.port() == url.port())
            };
            if self.urls[..i].iter().any(same) {
                return Err(invalid(
                    "backend.redlock.urls",
                    format!("`{u}` is listed twice: each master must be a different server"),
                ));
            }
        }
        check_range(
            "backend.redlock.request_timeout_ms",
            self.request_timeout_ms,
            1,
            10_000,
        )?;
        check_range(
            "backend.redlock.connect_timeout_ms",
            self.connect_timeout_ms,
            10,
            60_000,
        )?;
        if !(0.0..0.5).contains(&self.clock_drift_ratio) {
            return Err(invalid(
                "backend.redlock.clock_drift_ratio",
                "must be at least 0.0 and below 0.5",
            ));
        }
        check_range(
            "backend.redlock.retry_delay_ms",
            self.retry_delay_ms,
            0,
            10_000,
        )?;
        check_range(
            "backend.redlock.retry_jitter_ms",
            self.retry_jitter_ms,
            0,
            10_000,
        )?;
        if self.key_prefix.len() > 64 || self.key_prefix.contains(['{', '}']) {
            return Err(invalid(
                "backend.redlock.key_prefix",
                "at most 64 bytes and no `{` or `}`",
            ));
        }
        check_range(
            "backend.redlock.eviction_check_interval_ms",
            self.eviction_check_interval_ms,
            100,
            600_000,
        )?;
        self.counters().validate()?;
        Ok(())
    }
}
