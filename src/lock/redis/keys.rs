//! Redis key names for one lock.
//!
//! The lock entry, its token counter and its release channel share a Cluster
//! hash tag (`{…}`) so one Lua script may touch both keys in Cluster mode.
//! Braces and `%` inside user keys are percent-escaped: an unescaped `}` at
//! the start of a user key would end the tag early and scatter the two keys
//! over different slots.

use crate::lock::LockKey;

/// The names of one lock's keys, built on demand: each operation needs
/// only two or three of them, and this runs on every lock request.
#[derive(Debug, Clone)]
pub struct RedisKeys {
    /// `<prefix>{<escaped key>}`.
    tagged: String,
}

/// Appends `key` with `%`, `{` and `}` percent-escaped.
fn escape_into(out: &mut String, key: &str) {
    if !key.contains(['%', '{', '}']) {
        out.push_str(key);
        return;
    }
    for ch in key.chars() {
        match ch {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
}

impl RedisKeys {
    pub fn new(prefix: &str, key: &LockKey) -> RedisKeys {
        let mut tagged = String::with_capacity(prefix.len() + key.as_str().len() + 2);
        tagged.push_str(prefix);
        tagged.push('{');
        escape_into(&mut tagged, key.as_str());
        tagged.push('}');
        RedisKeys { tagged }
    }

    fn with(&self, suffix: &str) -> String {
        let mut name = String::with_capacity(self.tagged.len() + suffix.len());
        name.push_str(&self.tagged);
        name.push_str(suffix);
        name
    }

    /// The lock entry: `"<lease id> <token>"` with the lease's TTL.
    pub fn lock(&self) -> String {
        self.with(":lock")
    }

    /// The key's token counter: expires after `counter_idle_ttl_ms` without
    /// an acquisition, never before the clock floor is above it
    /// ([`super::counters`]); never in `counter` token mode.
    pub fn counter(&self) -> String {
        self.with(":token")
    }

    /// Reentrancy: `"<lease id> <holds> <owner>"`, valid only while that
    /// lease holds the lock (no expiry: a renewal must not outlive it);
    /// deleted when the count drops to 0, overwritten by the next lease.
    pub fn holds(&self) -> String {
        self.with(":holds")
    }

    /// A semaphore's permit count, when this key names the semaphore (not
    /// one of its slots): fixed at first use, no expiry.
    pub fn permits(&self) -> String {
        self.with(":permits")
    }

    /// Read-write locks: the key's read leases, a hash of lease id →
    /// `"<token> <expiry ms>"` (server clock), living as long as the latest.
    pub fn readers(&self) -> String {
        self.with(":readers")
    }

    /// Read-write locks: set while a writer waits for the readers to leave;
    /// no new reader gets in meanwhile (writer preference).
    pub fn writer_wait(&self) -> String {
        self.with(":wwait")
    }

    /// Lock-delay marker: outlives a lock that expired without a release.
    pub fn delay(&self) -> String {
        self.with(":delay")
    }

    /// The pub/sub channel a release publishes on.
    pub fn channel(&self) -> String {
        self.with(":released")
    }

    /// Inverse of the channel name, for routing a pub/sub message to the
    /// waiters of its key.
    pub fn key_from_channel(prefix: &str, channel: &str) -> Option<String> {
        let tag = channel
            .strip_prefix(prefix)?
            .strip_prefix('{')?
            .strip_suffix("}:released")?;
        percent_encoding::percent_decode_str(tag)
            .decode_utf8()
            .ok()
            .map(|s| s.into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash_tag(name: &str) -> &str {
        // Redis Cluster rule: content between the first `{` and the next `}`,
        // if non-empty; otherwise the whole name.
        if let Some(open) = name.find('{') {
            if let Some(len) = name[open + 1..].find('}') {
                if len > 0 {
                    return &name[open + 1..open + 1 + len];
                }
            }
        }
        name
    }

    #[test]
    fn lock_and_counter_share_a_slot_for_hostile_keys() {
        for raw in ["plain", "}x", "{", "a}b{c", "%7D", "}{", "{}"] {
            let key = LockKey::parse(raw).unwrap();
            let k = RedisKeys::new("fencer:", &key);
            assert_eq!(hash_tag(&k.lock()), hash_tag(&k.counter()), "key {raw:?}");
            assert_ne!(hash_tag(&k.lock()), k.lock(), "key {raw:?} must be tagged");
            assert_eq!(
                RedisKeys::key_from_channel("fencer:", &k.channel()).as_deref(),
                Some(raw)
            );
        }
    }

    #[test]
    fn escaping_is_injective() {
        let a = RedisKeys::new("p:", &LockKey::parse("%7B").unwrap());
        let b = RedisKeys::new("p:", &LockKey::parse("{").unwrap());
        assert_ne!(a.lock(), b.lock());
    }
}
