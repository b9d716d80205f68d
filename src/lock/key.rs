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
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey(std::sync::Arc<str>);

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
        Ok(LockKey(raw.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

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
