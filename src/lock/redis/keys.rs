//! Redis key names for one lock.
//!
//! The lock entry, its token counter and its release channel share a Cluster
//! hash tag (`{…}`) so one Lua script may touch both keys in Cluster mode.
//! Braces and `%` inside user keys are percent-escaped: an unescaped `}` at
//! the start of a user key would end the tag early and scatter the two keys
//! over different slots.

use crate::lock::LockKey;

#[derive(Debug, Clone)]
pub struct RedisKeys {
    pub lock: String,
    pub counter: String,
    /// Lock-delay marker: outlives a lock that expired without a release.
    pub delay: String,
    pub channel: String,
}

pub fn escape(key: &str) -> String {
    let mut out = String::with_capacity(key.len() + 2);
    for ch in key.chars() {
        match ch {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
    out
}

impl RedisKeys {
    pub fn new(prefix: &str, key: &LockKey) -> RedisKeys {
        let tag = escape(key.as_str());
        RedisKeys {
            lock: format!("{prefix}{{{tag}}}:lock"),
            counter: format!("{prefix}{{{tag}}}:token"),
            delay: format!("{prefix}{{{tag}}}:delay"),
            channel: format!("{prefix}{{{tag}}}:released"),
        }
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
            assert_eq!(hash_tag(&k.lock), hash_tag(&k.counter), "key {raw:?}");
            assert_ne!(hash_tag(&k.lock), k.lock, "key {raw:?} must be tagged");
            assert_eq!(
                RedisKeys::key_from_channel("fencer:", &k.channel).as_deref(),
                Some(raw)
            );
        }
    }

    #[test]
    fn escaping_is_injective() {
        let a = RedisKeys::new("p:", &LockKey::parse("%7B").unwrap());
        let b = RedisKeys::new("p:", &LockKey::parse("{").unwrap());
        assert_ne!(a.lock, b.lock);
    }
}
