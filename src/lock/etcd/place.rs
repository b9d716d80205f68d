//! Where the etcd backend keeps things, and what a lock key's value says.
//!
//! - `<prefix>/locks/<hex of the lock key>/<ticket>`: one contender's
//!   place in the key's queue (a sidecar has at most one per key). The
//!   place created first — the lowest creation revision — holds.
//! - `<prefix>/offset`: the token offset, raised by `raise_token_floor`.
//! - `<prefix>/permits/<hex of the semaphore>`: a semaphore's fixed count.
//!
//! The lock key is hex-encoded so that no key can name a path inside
//! another key's queue (`a/b` and `a` stay apart).

use std::time::Duration;

use rand::RngCore;

/// The queue of `key`: every place of it starts with this.
pub fn queue(root: &str, key: &str) -> Vec<u8> {
    format!("{root}/locks/{}/", hex(key.as_bytes())).into_bytes()
}

/// A new place's name in `queue`: 16 random hex digits, so a retry of a
/// create whose answer was lost finds its own place by name.
pub fn new_place(queue: &[u8]) -> Vec<u8> {
    let mut ticket = [0u8; 8];
    rand::rng().fill_bytes(&mut ticket);
    let mut key = queue.to_vec();
    key.extend_from_slice(hex(&ticket).as_bytes());
    key
}

pub fn offset(root: &str) -> Vec<u8> {
    format!("{root}/offset").into_bytes()
}

pub fn permits(root: &str, name: &str) -> Vec<u8> {
    format!("{root}/permits/{}", hex(name.as_bytes())).into_bytes()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A place's value: `<offset> <lease id> <ttl ms> <delay ms> <expired>
/// <holds> <change id> <owner>`.
///
/// - `offset`: the token offset in force when the place was created (its
///   token is its creation revision plus this);
/// - the lease id of the newest try that wrote it — the holder's, once
///   it holds (a sidecar restarted meanwhile finds its leases by it);
/// - the lease's TTL and lock-delay, for other sidecars' answers;
/// - `expired` 1: the lease's TTL passed without a renewal and the place
///   stays for the lock-delay (others are told `lock_delayed`);
/// - a reentrant lease's hold count (0: none recorded), the id of the
///   change that set it (`-`: none) and its owner (may hold spaces).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Value {
    pub offset: u64,
    pub lease: String,
    pub ttl: Duration,
    pub delay: Duration,
    pub expired: bool,
    pub holds: u32,
    pub op: String,
    pub owner: String,
}

impl Value {
    /// A fresh value for `lease`: nothing expired, no count.
    pub fn new(offset: u64, lease: &str, ttl: Duration, delay: Duration) -> Value {
        Value {
            offset,
            lease: lease.to_owned(),
            ttl,
            delay,
            expired: false,
            holds: 0,
            op: "-".into(),
            owner: String::new(),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        format!(
            "{} {} {} {} {} {} {} {}",
            self.offset,
            self.lease,
            self.ttl.as_millis(),
            self.delay.as_millis(),
            u8::from(self.expired),
            self.holds,
            self.op,
            self.owner
        )
        .into_bytes()
    }

    pub fn parse(data: &[u8]) -> Option<Value> {
        let text = std::str::from_utf8(data).ok()?;
        let mut f = text.splitn(8, ' ');
        let mut num = || f.next()?.parse::<u64>().ok();
        let offset = num()?;
        let lease = f.next()?.to_owned();
        let mut num = || f.next()?.parse::<u64>().ok();
        let ttl = Duration::from_millis(num()?);
        let delay = Duration::from_millis(num()?);
        let expired = num()? == 1;
        let holds = u32::try_from(num()?).ok()?;
        Some(Value {
            offset,
            lease,
            ttl,
            delay,
            expired,
            holds,
            op: f.next()?.to_owned(),
            owner: f.next().unwrap_or("").to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_with_spaces_in_the_owner() {
        let mut v = Value::new(7, "L1", Duration::from_millis(1500), Duration::ZERO);
        assert_eq!(Value::parse(&v.encode()), Some(v.clone()));
        v.holds = 3;
        v.op = "op-9".into();
        v.owner = "billing job 2".into();
        v.expired = true;
        assert_eq!(Value::parse(&v.encode()), Some(v));
        assert_eq!(Value::parse(b"7 L1 x 0 0 0 - "), None);
        assert_eq!(Value::parse(b"7 L1"), None);
    }

    #[test]
    fn queues_of_different_keys_never_nest() {
        let a = queue("/f", "a");
        let ab = queue("/f", "a/b");
        assert!(!ab.starts_with(&a) && !a.starts_with(&ab));
        let p = new_place(&a);
        assert!(p.starts_with(&a) && p.len() == a.len() + 16);
        assert_ne!(new_place(&a), p);
    }
}
