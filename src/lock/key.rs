//! Validated lock keys.

use std::fmt;

use crate::settings::limits::MAX_KEY_BYTES;

/// A lock key: 1–512 bytes of UTF-8 without control characters.
///
/// Keys arrive percent-decoded from the URL path. Control characters are
/// refused because keys end up in logs, Redis key names and headers, where
/// a newline or NUL would be an injection vector.
///
/// Shared, not copied: a held lease's key sits in the lease table, its
/// lease-id index and the renewal schedule, and a clone is a reference
/// count, not an allocation (100 000 leases: docs/performance.md).
///
/// **Readers.** A read lease of a read-write lock shares its key with
/// other readers, yet the sidecar tracks each lease by its key (lease
/// table, renewal schedule). So a read lease's key is the lock key plus a
/// reader number unique in this process ([`LockKey::reader`]): equal
/// [`LockKey::as_str`], a key of its own everywhere the sidecar tells
/// leases apart, and a backend that keeps reader sets sees from
/// [`LockKey::is_reader`] which set a call is about. No parsed key is ever
/// a reader's.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey(std::sync::Arc<str>, Option<u64>);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("key must not be empty")]
    Empty,
    #[error("key is {0} bytes; at most {MAX_KEY_BYTES} allowed")]
    TooLong(usize),
    #[error("key contains a control character at byte {0}")]
    ControlChar(usize),
}

impl LockKey {
    pub fn parse(raw: &str) -> Result<LockKey, KeyError> {
        if raw.is_empty() {
            return Err(KeyError::Empty);
        }
        if raw.len() > MAX_KEY_BYTES {
            return Err(KeyError::TooLong(raw.len()));
        }
        if let Some((pos, _)) = raw.char_indices().find(|(_, c)| c.is_control()) {
            return Err(KeyError::ControlChar(pos));
        }
        Ok(LockKey(raw.into(), None))
    }

    /// The lock key itself (a reader's: the key it reads).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Read lease number `n` of this key (see the type's doc).
    pub fn reader(&self, n: u64) -> LockKey {
        LockKey(self.0.clone(), Some(n))
    }

    /// Whether this is a read lease's key.
    pub fn is_reader(&self) -> bool {
        self.1.is_some()
    }

    /// The lock key itself, without a reader number.
    pub fn base(&self) -> LockKey {
        LockKey(self.0.clone(), None)
    }

    /// The mode of the lease this key is tracked under.
    pub fn mode(&self) -> crate::token::Mode {
        match self.1 {
            Some(_) => crate::token::Mode::Read,
            None => crate::token::Mode::Write,
        }
    }
}

/// The lock key only: a reader's number is the sidecar's business and
/// never shown.
impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_keys() {
        assert!(LockKey::parse("account:42").is_ok());
        assert!(LockKey::parse("a/b{c}").is_ok());
        assert!(LockKey::parse(&"k".repeat(512)).is_ok());
        assert!(LockKey::parse("счёт:1").is_ok());
    }

    #[test]
    fn a_readers_key_is_its_own_yet_names_the_lock() {
        let k = LockKey::parse("account:1").unwrap();
        let (r1, r2) = (k.reader(1), k.reader(2));
        assert_ne!(r1, k);
        assert_ne!(r1, r2);
        assert_eq!(
            (r1.as_str(), r1.to_string()),
            ("account:1", "account:1".into())
        );
        assert!(r1.is_reader() && !k.is_reader());
        assert_eq!(r1.base(), k);
        assert_eq!(r1.mode(), crate::token::Mode::Read);
    }

    #[test]
    fn rejects_bad_keys() {
        assert_eq!(LockKey::parse(""), Err(KeyError::Empty));
        assert_eq!(
            LockKey::parse(&"k".repeat(513)),
            Err(KeyError::TooLong(513))
        );
        assert_eq!(LockKey::parse("a\nb"), Err(KeyError::ControlChar(1)));
        assert_eq!(LockKey::parse("a\u{7f}"), Err(KeyError::ControlChar(1)));
    }
}
