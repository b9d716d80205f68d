//! `[backend.redis]`: where the Redis is and how tokens are minted there.

use serde::Deserialize;

use crate::settings::{config_enum, invalid, ConfigError};

/// How Redis mints fencing tokens.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(try_from = "String")]
pub enum TokenMode {
    /// `INCR` of a per-key counter: small tokens (1, 2, 3 …), but a Redis that
    /// loses the counter (no persistence, failover to a lagging replica)
    /// reissues old values.
    Counter,
    /// `max(counter + 1, server_time_ms * 1024)`: tokens move forward even
    /// when the counter is lost, as long as the Redis server clock does not
    /// step back and a key averages under ~1M acquisitions per second.
    HybridClock,
}
config_enum!(TokenMode { Counter => "counter", HybridClock => "hybrid_clock" });

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisSettings {
    /// `redis://[:password@]host:port/db` or `rediss://` for TLS.
    pub url: String,
    pub key_prefix: String,
    pub request_timeout_ms: u64,
    pub connect_timeout_ms: u64,
    pub token_mode: TokenMode,
    /// PEM CA certificate(s) for `rediss://` with a private CA (default:
    /// the public web roots).
    pub ca_file: Option<String>,
}

impl Default for RedisSettings {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379/0".into(),
            key_prefix: "fencer:".into(),
            request_timeout_ms: 1_000,
            connect_timeout_ms: 1_000,
            token_mode: TokenMode::HybridClock,
            ca_file: None,
        }
    }
}

impl RedisSettings {
    /// `selected`: this is the configured backend, so its URL must parse
    /// (an unused section keeps its default and is not checked).
    pub(crate) fn validate(&self, selected: bool) -> Result<(), ConfigError> {
        if selected {
            let url = url::Url::parse(&self.url).map_err(|e| {
                invalid(
                    "backend.redis.url",
                    format!("not a URL ({e}); expected redis://host:port/db or rediss://…"),
                )
            })?;
            if !matches!(url.scheme(), "redis" | "rediss") {
                return Err(invalid(
                    "backend.redis.url",
                    format!(
                        "scheme `{}` not allowed; allowed: redis, rediss",
                        url.scheme()
                    ),
                ));
            }
        }
        if self.key_prefix.len() > 64 || self.key_prefix.contains(['{', '}']) {
            return Err(invalid(
                "backend.redis.key_prefix",
                "at most 64 bytes and no `{` or `}` (they would break the Cluster hash tag)",
            ));
        }
        if !(10..=60_000).contains(&self.request_timeout_ms) {
            return Err(invalid(
                "backend.redis.request_timeout_ms",
                "must be between 10 and 60000",
            ));
        }
        if !(10..=60_000).contains(&self.connect_timeout_ms) {
            return Err(invalid(
                "backend.redis.connect_timeout_ms",
                "must be between 10 and 60000",
            ));
        }
        Ok(())
    }
}
