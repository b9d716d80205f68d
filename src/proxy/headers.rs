//! The `Fencing-*` headers, shared by the egress proxy (which sets them)
//! and the gateway (which checks them), and the configured methods.
//!
//! Both refuse a request that carries any `Fencing-*` header twice: a
//! header map answers `get` with the first value while the forward carries
//! every value, so a checked first `Fencing-Token` could travel with an
//! unchecked second one to a storage that reads the last (issue 26 item 9).

use hyper::header::{HeaderMap, HeaderName};
use hyper::{Method, StatusCode};

use crate::error::ApiError;

/// The signed fencing token.
pub const TOKEN: &str = "fencing-token";
/// The lock key the token is for.
pub const KEY: &str = "fencing-key";
/// The per-lease write sequence the proxy numbers (PITFALLS 5).
pub const SEQ: &str = "fencing-seq";
/// The application names the lock of a proxied request.
pub const LOCK: &str = "fencing-lock";
/// The application names the lease a proxied request was computed under.
pub const LEASE: &str = "fencing-lease";

/// The prefix every header of ours starts with (header names are lower
/// case in a `HeaderMap`).
const PREFIX: &str = "fencing-";

/// The HTTP methods named in a configuration (validated upper-case names).
pub fn methods(names: &[String]) -> Vec<Method> {
    names
        .iter()
        .filter_map(|m| Method::from_bytes(m.as_bytes()).ok())
        .collect()
}

/// The first `Fencing-*` header that appears more than once, if any.
pub fn duplicated(headers: &HeaderMap) -> Option<HeaderName> {
    if crate::mutants::active("duplicate_header_first_wins") {
        // As before issue 26: nothing is refused, `get` reads the first
        // value and the forward carries every value.
        return None;
    }
    headers
        .keys()
        .filter(|n| n.as_str().starts_with(PREFIX))
        .find(|n| headers.get_all(*n).iter().nth(1).is_some())
        .cloned()
}

/// The answer to a request with a `Fencing-*` header twice: 400
/// `duplicate_fencing_header`, naming it.
pub fn duplicate_error(name: &HeaderName) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "duplicate_fencing_header",
        format!("`{name}` appears more than once; send each Fencing-* header once"),
    )
    .with("header", name.as_str())
}

/// The methods that were writes before issue 26 (`write_methods`'s old
/// default): with the `unknown_methods_passed` mutant, every other method
/// outside the read list is a read again.
const OLD_WRITE_METHODS: [Method; 4] = [Method::PUT, Method::POST, Method::PATCH, Method::DELETE];

/// Whether `method` is a read: one of `read_methods` (compared exactly;
/// every other method, whatever its case, is a write — PITFALLS 13).
pub fn is_read(read_methods: &[Method], method: &Method) -> bool {
    if read_methods.contains(method) {
        return true;
    }
    crate::mutants::active("unknown_methods_passed") && !OLD_WRITE_METHODS.contains(method)
}

/// Removes every `Fencing-*` header except those named in `keep`.
pub fn strip_fencing(headers: &mut HeaderMap, keep: &[&str]) {
    let ours: Vec<HeaderName> = headers
        .keys()
        .filter(|n| n.as_str().starts_with(PREFIX) && !keep.contains(&n.as_str()))
        .cloned()
        .collect();
    for name in ours {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;

    #[test]
    fn duplicates_are_found_and_foreign_headers_stripped() {
        let mut h = HeaderMap::new();
        h.append("fencing-token", HeaderValue::from_static("a"));
        h.append("x-other", HeaderValue::from_static("1"));
        h.append("x-other", HeaderValue::from_static("2"));
        assert_eq!(duplicated(&h), None);
        h.append("Fencing-Seq", HeaderValue::from_static("1"));
        h.append("fencing-seq", HeaderValue::from_static("2"));
        assert_eq!(duplicated(&h).as_ref().map(HeaderName::as_str), Some(SEQ));
        h.append("fencing-key", HeaderValue::from_static("k"));
        h.append("fencing-whatever", HeaderValue::from_static("k"));
        strip_fencing(&mut h, &[TOKEN]);
        let mut left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["fencing-token", "x-other"]);
    }
}
