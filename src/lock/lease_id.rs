//! Lease identifiers: the secret that proves who holds a lock.

use std::fmt;

use base64::Engine;
use rand::RngCore;

/// 128 random bits, base64url without padding (22 characters).
///
/// The lease id is the value stored in the backend's lock entry, so renew and
/// release can be compare-and-set on it. It is a bearer credential: whoever
/// knows it can release the lock, so it is random, not a counter. Shared
/// like [`super::LockKey`]: clones are reference counts.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(std::sync::Arc<str>);

impl LeaseId {
    pub fn generate() -> LeaseId {
        let mut bytes = [0u8; 16];
        rand::rng().fill_bytes(&mut bytes);
        LeaseId(
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .encode(bytes)
                .into(),
        )
    }

    /// Accepts ids from clients: 1–64 characters of `[A-Za-z0-9_-]`. The
    /// charset guarantees the id never contains the backend's separator.
    pub fn parse(raw: &str) -> Option<LeaseId> {
        let ok = !raw.is_empty()
            && raw.len() <= 64
            && raw
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        ok.then(|| LeaseId(raw.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id's one-way tag: what tokens, logs, webhooks and the gateway
    /// carry instead of the id, which is a credential
    /// ([`crate::token::lease_tag`]).
    pub fn tag(&self) -> String {
        crate::token::lease_tag(&self.0)
    }
}

/// A fresh id for one backend call of an acquire: 16 hex digits of a
/// process-wide counter, so the ids of one lease's tries sort in the order
/// they were sent (ids of different leases never meet: every use pairs the
/// attempt with its lease id).
///
/// Stored with the grant so that the undo of an abandoned attempt can name
/// the attempt rather than the lease: retries of one lease share its lease
/// id, and an undo keyed by that id alone released the lease a retry had
/// just handed out (PITFALLS 11, issue 26 item 1). Ordered because a try's
/// *request* can reach the server after the retry that replaced it (issue
/// 27 item 3): the row then keeps the later attempt, and the late try's
/// undo finds nothing of its own to release.
pub fn attempt_id() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    format!(
        "{:016x}",
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_are_unique_and_parse() {
        let a = LeaseId::generate();
        let b = LeaseId::generate();
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), 22);
        assert_eq!(LeaseId::parse(a.as_str()), Some(a));
    }

    #[test]
    fn attempt_ids_sort_in_the_order_they_were_made() {
        let a = attempt_id();
        let b = attempt_id();
        assert_eq!(a.len(), 16);
        assert!(a < b, "{a} {b}");
    }

    #[test]
    fn rejects_bad_ids() {
        assert!(LeaseId::parse("").is_none());
        assert!(LeaseId::parse("a b").is_none());
        assert!(LeaseId::parse(&"a".repeat(65)).is_none());
    }
}
