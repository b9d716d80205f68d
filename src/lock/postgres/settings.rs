//! `[backend.postgres]`: the PostgreSQL lock table's connection and upkeep.

use serde::{Deserialize, Serialize};

use crate::settings::check::{check_range, invalid, ConfigError};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PostgresSettings {
    /// `postgres://user:password@host:port/db` (libpq-style key=value works too).
    pub url: String,
    pub pool_size: usize,
    pub request_timeout_ms: u64,
    pub connect_timeout_ms: u64,
    /// Rows of keys free and untouched this long are deleted (their tokens
    /// live on in the token floor).
    pub idle_cleanup_after_ms: u64,
    pub cleanup_interval_ms: u64,
    /// PEM CA certificate(s) that sign the server's certificate, for
    /// `sslmode=require` (default: the public web roots).
    pub ca_file: Option<String>,
    /// Concurrent acquires (and releases) of different keys share one
    /// statement and one commit ([`crate::pg::group`]). `false`: every call
    /// is its own statement (the comparison `fencer bench` draws).
    pub group_commit: bool,
}

impl Default for PostgresSettings {
    fn default() -> Self {
        Self {
            url: "postgres://postgres@127.0.0.1:5432/postgres".into(),
            pool_size: 16,
            request_timeout_ms: 2_000,
            connect_timeout_ms: 2_000,
            idle_cleanup_after_ms: 7 * 24 * 3_600_000,
            cleanup_interval_ms: 60_000,
            ca_file: None,
            group_commit: true,
        }
    }
}

impl PostgresSettings {
    /// `selected`: as for [`crate::lock::settings::RedisSettings::validate`].
    pub(crate) fn validate(&self, selected: bool) -> Result<(), ConfigError> {
        if selected {
            self.url.parse::<tokio_postgres::Config>().map_err(|e| {
                invalid("backend.postgres.url", format!("not a PostgreSQL URL: {e}"))
            })?;
        }
        check_range("backend.postgres.pool_size", self.pool_size as u64, 1, 1024)?;
        check_range(
            "backend.postgres.request_timeout_ms",
            self.request_timeout_ms,
            10,
            60_000,
        )?;
        check_range(
            "backend.postgres.connect_timeout_ms",
            self.connect_timeout_ms,
            10,
            60_000,
        )?;
        check_range(
            "backend.postgres.idle_cleanup_after_ms",
            self.idle_cleanup_after_ms,
            1_000,
            31_536_000_000,
        )?;
        check_range(
            "backend.postgres.cleanup_interval_ms",
            self.cleanup_interval_ms,
            100,
            86_400_000,
        )?;
        Ok(())
    }
}
