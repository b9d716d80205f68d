//! PostgreSQL connections, shared by the lock backend, the gateway's fence
//! store and the demo storage: one place that builds pools, TLS and the
//! session settings fencer's correctness depends on.
//!
//! TLS follows the URL's `sslmode`: `require` connects with TLS and always
//! verifies the server certificate (chain and host name) against the
//! configured CA file, or the public web roots if none is given; `disable`
//! and `prefer` (the default) connect in plain text. fencer does not do
//! libpq's unverified opportunistic TLS: encryption without authentication
//! would only look safe.
//!
//! Every session is pinned to `READ COMMITTED` and `synchronous_commit = on`
//! whatever the server, database or role defaults say: the floor read of the
//! lock backend and the fence store's check-and-advance are written for
//! READ COMMITTED (a REPEATABLE READ snapshot let tokens go backwards), and a
//! token or a mark that was acknowledged but not flushed could be handed out
//! again after a crash. Startup-packet options take precedence over
//! `ALTER ROLE`/`ALTER DATABASE` settings, so an operator cannot weaken them
//! by accident.

pub mod group;
pub mod listener;
pub mod runner;
pub mod schema;

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres_rustls::MakeRustlsConnect;

pub use self::runner::{RunError, Runner};

pub type Tls = MakeRustlsConnect;

pub struct PgOptions<'a> {
    pub url: &'a str,
    pub application_name: &'a str,
    pub ca_file: Option<&'a str>,
    pub pool_size: usize,
    pub connect_timeout: Duration,
    /// How long a caller waits for a pooled connection.
    pub wait_timeout: Duration,
    /// Server-side bound on any one statement (`statement_timeout`): the
    /// backstop for a statement whose client gave up and whose cancel
    /// request was lost. `None`: the server's default.
    pub statement_timeout: Option<Duration>,
    /// Server-side bound on waiting for a lock (`lock_timeout`).
    pub lock_timeout: Option<Duration>,
}

/// The session settings every fencer connection starts with (see the
/// module comment), in the startup packet's `options` syntax.
fn session_options(o: &PgOptions<'_>) -> String {
    let mut opts =
        String::from("-c default_transaction_isolation=read\\ committed -c synchronous_commit=on");
    let statement_timeout = o
        .statement_timeout
        .filter(|_| !crate::mutants::active("fresh_send_time"));
    let lock_timeout = o
        .lock_timeout
        .filter(|_| !crate::mutants::active("fresh_send_time"));
    if let Some(t) = statement_timeout {
        opts.push_str(&format!(" -c statement_timeout={}", t.as_millis().max(1)));
    }
    if let Some(t) = lock_timeout {
        opts.push_str(&format!(" -c lock_timeout={}", t.as_millis().max(1)));
    }
    opts
}

/// Installs the process-wide TLS crypto provider (ring). Idempotent.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

pub fn tls(ca_file: Option<&str>) -> Result<Tls, String> {
    install_crypto_provider();
    let roots = crate::http::tls_roots::roots(ca_file)?;
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
}

/// The parsed connection config (with application name and the pinned
/// session settings) and a pool over it.
pub fn pool(o: &PgOptions<'_>) -> Result<(tokio_postgres::Config, Tls, Pool), String> {
    let mut config: tokio_postgres::Config = o
        .url
        .parse()
        .map_err(|e| format!("bad PostgreSQL URL: {e}"))?;
    config
        .connect_timeout(o.connect_timeout)
        .application_name(o.application_name)
        .options(session_options(o));
    if config.get_ssl_mode() != tokio_postgres::config::SslMode::Require {
        config.ssl_mode(tokio_postgres::config::SslMode::Disable);
    }
    let tls = tls(o.ca_file)?;
    let manager = Manager::from_config(
        config.clone(),
        tls.clone(),
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let pool = Pool::builder(manager)
        .max_size(o.pool_size)
        .wait_timeout(Some(o.wait_timeout))
        .create_timeout(Some(o.connect_timeout))
        .runtime(Runtime::Tokio1)
        .build()
        .map_err(|e| e.to_string())?;
    Ok((config, tls, pool))
}

/// A pool's failure to hand out a connection, naming the server it tried
/// (`target`: the URL with its password redacted) and the cause deadpool
/// wraps: its own text is "error connecting to server" without the
/// address or the refusal under it.
pub fn pool_error(target: &str, e: &deadpool_postgres::PoolError) -> String {
    format!("{target}: {}", crate::error_chain::chain(e))
}

/// A statement error with the server's own message (tokio-postgres prints
/// only "db error" for those).
pub fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{}: {}", db.code().code(), db.message()),
        None => e.to_string(),
    }
}

/// Whether a failed statement may have left its connection in an unknown
/// state (closed, or an error without a server SQLSTATE, e.g. I/O): such a
/// connection is discarded instead of going back to the pool.
pub fn connection_suspect(e: &tokio_postgres::Error) -> bool {
    e.is_closed() || e.code().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_options_pin_isolation_and_durability() {
        let o = PgOptions {
            url: "postgres://x@127.0.0.1/db",
            application_name: "t",
            ca_file: None,
            pool_size: 1,
            connect_timeout: Duration::from_secs(1),
            wait_timeout: Duration::from_secs(1),
            statement_timeout: Some(Duration::from_millis(1500)),
            lock_timeout: None,
        };
        let s = session_options(&o);
        assert!(s.contains("default_transaction_isolation=read\\ committed"));
        assert!(s.contains("synchronous_commit=on"));
        assert!(s.contains("statement_timeout=1500"));
        assert!(!s.contains("lock_timeout"));
    }
}
