//! How long a key's token counter outlives its last write (issue 27 item 6).
//!
//! Redis and RedLock keep one counter key per lock key (`…:token`). Kept
//! forever, a service that locks per order id grows Redis without bound.
//! With `hybrid_clock` tokens a counter is only needed while it is ahead of
//! the server clock's floor (`TIME` in ms × 1024, the least the acquire
//! script mints): once that floor has passed the counter, a fresh counter
//! mints above it anyway. So every write of a counter also sets its expiry
//! to `now + max(idle, floor(counter / 1024) + 2 − now)` ms on the server's
//! own clock (`PEXPIREAT`, see [`super::scripts`]): never before the floor
//! is above the value — exact for any value, including one a repair raised
//! up to 2^40 (~12.4 days of floor) ahead — and not before `idle` ms
//! without an acquisition. The floor and the expiry read the same clock,
//! and `PEXPIREAT` replicates as an absolute time, so a replica promoted
//! with the counter expires it only when its own floor is past it.
//!
//! What `idle` buys is tolerance for that clock stepping back: a counter
//! that expired is replaced by the floor, so a step back of more than
//! `idle` ms (minus the counter's lead on the floor, normally under 1 ms)
//! after a key's last acquisition could mint a token again. Below
//! [`MIN_IDLE_TTL_MS`] an ordinary NTP step (ntpd steps offsets above
//! 128 ms) would do it; the default allows a step of a day.
//!
//! Not for `counter` tokens (plain `INCR`): they carry no clock, so nothing
//! can pass an expired counter short of one record every acquire of a
//! deployment writes — a hot key that Redis Cluster cannot even reach from
//! a script of another slot. Counters are kept forever there (docs/backends.md).
//! Nor with `allow_eviction`: a counter with a TTL is evictable under
//! `volatile-*`, and an evicted counter the floor has not passed yet lets
//! tokens go back; counters without a TTL are only evicted by `allkeys-*`.

use crate::settings::check::{invalid, ConfigError};

/// A day: tokens survive a server clock step back of up to a day.
pub const DEFAULT_IDLE_TTL_MS: u64 = 86_400_000;

/// One second (see the module comment).
pub const MIN_IDLE_TTL_MS: u64 = 1_000;

/// Thirty days; longer is `0` (never).
pub const MAX_IDLE_TTL_MS: u64 = 30 * 86_400_000;

/// What the counters of one backend need to know.
pub struct CounterPolicy {
    /// `backend.redis.counter_idle_ttl_ms` or the RedLock one.
    pub field: &'static str,
    /// The setting as given (`None`: not set).
    pub configured: Option<u64>,
    /// Tokens have the clock floor (`hybrid_clock`, RedLock).
    pub clock_floor: bool,
    /// `allow_eviction`, and its setting's name.
    pub allow_eviction: bool,
    pub eviction_field: &'static str,
}

impl CounterPolicy {
    /// Idle expiry in ms; 0 = counters never expire. Unset: the default
    /// where it is safe, never otherwise.
    pub fn idle_ttl_ms(&self) -> u64 {
        match self.configured {
            Some(ms) => ms,
            None if self.clock_floor && !self.allow_eviction => DEFAULT_IDLE_TTL_MS,
            None => 0,
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let Some(ms) = self.configured.filter(|ms| *ms > 0) else {
            return Ok(());
        };
        if !self.clock_floor {
            return Err(invalid(
                self.field,
                "`counter` tokens have no clock floor: an expired counter starts again at 1 and hands out old tokens again; leave it unset or 0 (counters kept forever), or use token_mode = \"hybrid_clock\"",
            ));
        }
        if self.allow_eviction {
            return Err(invalid(
                self.field,
                format!(
                    "with {} = true a counter with a TTL can be evicted (volatile-*) before the clock floor passes it, and tokens go back; leave it unset or 0 (counters kept forever)",
                    self.eviction_field
                ),
            ));
        }
        if !(MIN_IDLE_TTL_MS..=MAX_IDLE_TTL_MS).contains(&ms) {
            return Err(invalid(
                self.field,
                format!(
                    "must be 0 (never expire) or between {MIN_IDLE_TTL_MS} and {MAX_IDLE_TTL_MS}: it is how far back the Redis server clock may step after a key's last acquisition without a token being minted again"
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(configured: Option<u64>, clock_floor: bool, allow_eviction: bool) -> CounterPolicy {
        CounterPolicy {
            field: "backend.redis.counter_idle_ttl_ms",
            configured,
            clock_floor,
            allow_eviction,
            eviction_field: "backend.redis.allow_eviction",
        }
    }

    #[test]
    fn the_default_expires_only_where_the_floor_covers_it() {
        assert_eq!(policy(None, true, false).idle_ttl_ms(), DEFAULT_IDLE_TTL_MS);
        assert_eq!(policy(None, false, false).idle_ttl_ms(), 0);
        assert_eq!(policy(None, true, true).idle_ttl_ms(), 0);
        assert_eq!(policy(Some(0), true, false).idle_ttl_ms(), 0);
        for p in [policy(None, false, true), policy(Some(0), false, true)] {
            assert!(p.validate().is_ok());
        }
    }

    #[test]
    fn unsafe_or_out_of_range_values_are_refused() {
        assert!(policy(Some(5_000), false, false).validate().is_err());
        assert!(policy(Some(5_000), true, true).validate().is_err());
        assert!(policy(Some(MIN_IDLE_TTL_MS - 1), true, false)
            .validate()
            .is_err());
        assert!(policy(Some(MAX_IDLE_TTL_MS + 1), true, false)
            .validate()
            .is_err());
        assert!(policy(Some(MIN_IDLE_TTL_MS), true, false)
            .validate()
            .is_ok());
    }
}
