//! MySQL and MariaDB connections, shared by the lock backend and the
//! gateway's fence store: one place that builds pools, TLS and the session
//! settings fencer's correctness depends on.
//!
//! Every session is pinned, whatever the server, database or account
//! defaults say:
//! - `READ COMMITTED`: the lock procedures and the fence store's
//!   check-and-advance read the row they lock *now*; under the server's
//!   default REPEATABLE READ a plain read inside the same transaction could
//!   see an older snapshot than the row lock (the PostgreSQL backend found
//!   tokens going backwards that way).
//! - `time_zone = '+00:00'`: expiries are `DATETIME(6)` values computed by
//!   the server (`SYSDATE(6)`); in a zone with daylight saving an hour
//!   repeats and leases would live an hour too long.
//! - `sql_mode` strict: a value that does not fit is an error, never a
//!   silent truncation (two long keys truncated alike would share a lock).
//! - a lock-wait and (MariaDB) statement time bound below the caller's
//!   timeout, so the server ends a stuck statement with a known failure
//!   before the caller gives up on it.
//!
//! `prefer_socket` is off: the driver would otherwise switch a loopback URL
//! to the server's Unix socket, bypassing what the URL names (a proxy, a
//! TLS port).
//!
//! TLS: `require_ssl=true` in the URL (or `backend.mysql.ca_file`) connects
//! with TLS and always verifies the server certificate (chain and host
//! name) against the CA file, or the public web roots if none is given.
//! There is no unverified mode.

pub mod runner;
pub mod schema;

use std::time::Duration;

use mysql_async::{Opts, OptsBuilder, Pool, PoolConstraints, PoolOpts, SslOpts};

pub use self::runner::{RunError, Runner};

pub struct MyOptions<'a> {
    pub url: &'a str,
    pub ca_file: Option<&'a str>,
    pub pool_size: usize,
    /// Server-side bound on waiting for a row lock and on any statement.
    pub statement_timeout: Duration,
}

/// The statements every connection runs first (see the module comment).
pub fn session_init(statement_timeout: Duration) -> Vec<String> {
    let lock_wait_s = statement_timeout.as_secs().max(1);
    vec![
        "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED".into(),
        "SET SESSION time_zone = '+00:00'".into(),
        "SET SESSION sql_mode = 'STRICT_ALL_TABLES,NO_ENGINE_SUBSTITUTION,NO_AUTO_VALUE_ON_ZERO'"
            .into(),
        format!("SET SESSION innodb_lock_wait_timeout = {lock_wait_s}"),
        // MariaDB only (`/*M!` is executed by MariaDB, ignored by MySQL).
        format!(
            "/*M!100108 SET SESSION max_statement_time = {:.3} */",
            statement_timeout.as_secs_f64()
        ),
    ]
}

/// Parses `url` and applies fencer's settings.
pub fn opts(o: &MyOptions<'_>) -> Result<Opts, String> {
    let parsed = Opts::from_url(o.url).map_err(|e| format!("not a MySQL URL: {e}"))?;
    let tls_asked = parsed.ssl_opts().is_some() || o.ca_file.is_some();
    let mut builder = OptsBuilder::from_opts(parsed)
        .prefer_socket(false)
        .tcp_nodelay(true)
        .init(session_init(o.statement_timeout))
        .pool_opts(
            PoolOpts::default()
                .with_constraints(
                    PoolConstraints::new(0, o.pool_size.max(1))
                        .ok_or_else(|| "bad pool size".to_string())?,
                )
                .with_reset_connection(false),
        );
    if tls_asked {
        crate::pg::install_crypto_provider();
        let mut ssl = SslOpts::default();
        if let Some(ca) = o.ca_file {
            std::fs::metadata(ca).map_err(|e| format!("CA file {ca}: {e}"))?;
            ssl = ssl.with_root_certs(vec![std::path::PathBuf::from(ca).into()]);
        }
        builder = builder.ssl_opts(ssl);
    }
    Ok(builder.into())
}

pub fn pool(o: &MyOptions<'_>) -> Result<Pool, String> {
    Ok(Pool::new(opts(o)?))
}

/// A statement error with the server's code and message.
pub fn describe(e: &mysql_async::Error) -> String {
    match e {
        mysql_async::Error::Server(s) => format!("{} ({}): {}", s.code, s.state, s.message),
        other => other.to_string(),
    }
}

/// Whether a failed statement may have left its connection in an unknown
/// state (I/O, driver): such a connection is discarded. A server error
/// (with a code) leaves the connection usable.
pub fn connection_suspect(e: &mysql_async::Error) -> bool {
    !matches!(e, mysql_async::Error::Server(_))
}

/// Whether the server rolled the statement's transaction back so that it
/// can be tried again: a deadlock victim (1213) or any error with SQLSTATE
/// `40001` (serialization failure; the fence store signals it when a row
/// vanished under it). Two first acquires of one key are the common case:
/// under REPEATABLE READ each `SELECT … FOR UPDATE` of the missing row
/// takes a gap lock, and each INSERT then waits for the other's. Every
/// procedure of ours rolls back on any error (its EXIT HANDLER), so
/// nothing of the failed try applied and a new try starts clean.
pub fn retryable(e: &mysql_async::Error) -> bool {
    match e {
        mysql_async::Error::Server(s) => s.code == 1213 || s.state == "40001",
        _ => false,
    }
}

/// The pause before retry `n` (0-based) of a rolled-back statement:
/// doubling from 2 ms, capped at 50 ms, drawn from its upper half so that
/// the two sides of a deadlock do not collide again in lockstep.
pub fn retry_pause(n: u32) -> Duration {
    use rand::Rng;
    let step = (2u64 << n.min(5)).min(50);
    Duration::from_micros(rand::rng().random_range(step * 500..=step * 1000))
}

/// The server's error code, if it answered with one.
pub fn server_code(e: &mysql_async::Error) -> Option<u16> {
    match e {
        mysql_async::Error::Server(s) => Some(s.code),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_and_pinned() {
        let o = opts(&MyOptions {
            url: "mysql://fencer:pw@127.0.0.1:3307/fencer",
            ca_file: None,
            pool_size: 4,
            statement_timeout: Duration::from_millis(1600),
        })
        .unwrap();
        assert!(!o.prefer_socket());
        assert!(o.ssl_opts().is_none());
        assert_eq!(o.pool_opts().constraints().max(), 4);
        let init = o.init().join(";");
        assert!(init.contains("READ COMMITTED"));
        assert!(init.contains("time_zone = '+00:00'"));
        assert!(init.contains("max_statement_time = 1.600"));
        assert!(init.contains("innodb_lock_wait_timeout = 1"));
        assert!(opts(&MyOptions {
            url: "postgres://x@y/z",
            ca_file: None,
            pool_size: 1,
            statement_timeout: Duration::from_secs(1),
        })
        .is_err());
        let tls = opts(&MyOptions {
            url: "mysql://u@db.example:3306/f?require_ssl=true",
            ca_file: None,
            pool_size: 1,
            statement_timeout: Duration::from_secs(1),
        })
        .unwrap();
        let ssl = tls.ssl_opts().expect("TLS on");
        assert!(!ssl.accept_invalid_certs() && !ssl.skip_domain_validation());
    }
}
