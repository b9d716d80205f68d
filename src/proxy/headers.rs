//! The `Fencing-*` headers, shared by the egress proxy (which sets them)
//! and the gateway (which checks them), and the configured write methods.

use hyper::Method;

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

/// The HTTP methods named in a configuration (validated upper-case names).
pub fn methods(names: &[String]) -> Vec<Method> {
    names
        .iter()
        .filter_map(|m| Method::from_bytes(m.as_bytes()).ok())
        .collect()
}
