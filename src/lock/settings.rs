//! Which lock backend a sidecar uses, and each backend's own section.

use serde::Deserialize;

pub use super::postgres::settings::PostgresSettings;
pub use super::redis::settings::{RedisMode, RedisSettings, TokenMode};
pub use super::redlock::settings::RedLockSettings;
use crate::settings::{config_enum, ConfigError};

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(try_from = "String")]
pub enum BackendKind {
    Memory,
    Redis,
    /// A lock on a majority of independent Redis masters.
    RedLock,
    Postgres,
}
config_enum!(BackendKind { Memory => "memory", Redis => "redis", RedLock => "redlock", Postgres => "postgres" });

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct BackendSettings {
    /// Required for `fencer sidecar`: `memory` must be chosen explicitly,
    /// never fallen into (its locks vanish with the process).
    pub kind: Option<BackendKind>,
    pub redis: RedisSettings,
    pub redlock: RedLockSettings,
    pub postgres: PostgresSettings,
}

impl BackendSettings {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        self.redis.validate(self.kind == Some(BackendKind::Redis))?;
        self.redlock
            .validate(self.kind == Some(BackendKind::RedLock))?;
        self.postgres
            .validate(self.kind == Some(BackendKind::Postgres))?;
        Ok(())
    }
}
