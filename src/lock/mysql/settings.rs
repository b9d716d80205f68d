//! `[backend.mysql]`: the MySQL/MariaDB lock table's connection, upkeep and
//! wake-up connections.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::settings::check::{check_range, invalid, ConfigError};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MySqlSettings {
    /// `mysql://user:password@host:port/db` (`?require_ssl=true` for TLS).
    pub url: String,
    /// Statement connections (acquire, renew, release).
    pub pool_size: usize,
    /// Connections that wait in `GET_LOCK` for a remote holder's release,
    /// one per key being waited for; beyond them waiters fall back to the
    /// lease's expiry timer.
    pub wake_connections: usize,
    /// Connections holding this sidecar's "bells" (one named lock per held
    /// key, released when the lease ends, which wakes remote waiters).
    pub bell_connections: usize,
    /// Bound on one statement as the caller sees it: pool checkout and
    /// connecting included (the driver has no separate connect timeout).
    pub request_timeout_ms: u64,
    /// Rows of keys free and untouched this long are deleted (their tokens
    /// live on in the token floor).
    pub idle_cleanup_after_ms: u64,
    pub cleanup_interval_ms: u64,
    /// PEM CA certificate(s) that sign the server's certificate; setting it
    /// turns TLS on (verified: chain and host name).
    pub ca_file: Option<String>,
}

impl Default for MySqlSettings {
    fn default() -> Self {
        Self {
            url: "mysql://fencer@127.0.0.1:3306/fencer".into(),
            pool_size: 16,
            wake_connections: 16,
            bell_connections: 2,
            request_timeout_ms: 2_000,
            idle_cleanup_after_ms: 7 * 24 * 3_600_000,
            cleanup_interval_ms: 60_000,
            ca_file: None,
        }
    }
}

impl MySqlSettings {
    /// The server-side bound on a statement: below the caller's timeout,
    /// so the server ends a stuck statement with a known failure first.
    pub fn statement_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms).mul_f64(0.8)
    }

    /// `selected`: as for [`crate::lock::settings::RedisSettings::validate`].
    pub(crate) fn validate(&self, selected: bool) -> Result<(), ConfigError> {
        if selected {
            crate::mysql::opts(&crate::mysql::MyOptions {
                url: &self.url,
                ca_file: None,
                pool_size: 1,
                statement_timeout: Duration::from_secs(1),
            })
            .map_err(|e| invalid("backend.mysql.url", e))?;
            if let Some(ca) = &self.ca_file {
                std::fs::metadata(ca)
                    .map_err(|e| invalid("backend.mysql.ca_file", format!("{ca}: {e}")))?;
            }
        }
        check_range("backend.mysql.pool_size", self.pool_size as u64, 1, 1024)?;
        check_range(
            "backend.mysql.wake_connections",
            self.wake_connections as u64,
            0,
            1024,
        )?;
        check_range(
            "backend.mysql.bell_connections",
            self.bell_connections as u64,
            1,
            64,
        )?;
        check_range(
            "backend.mysql.request_timeout_ms",
            self.request_timeout_ms,
            100,
            60_000,
        )?;
        check_range(
            "backend.mysql.idle_cleanup_after_ms",
            self.idle_cleanup_after_ms,
            1_000,
            31_536_000_000,
        )?;
        check_range(
            "backend.mysql.cleanup_interval_ms",
            self.cleanup_interval_ms,
            100,
            86_400_000,
        )?;
        Ok(())
    }
}
