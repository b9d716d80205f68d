//! Which lock backend a sidecar uses, and each backend's own section.

use serde::{Deserialize, Serialize};

pub use super::etcd::settings::EtcdSettings;
pub use super::mysql::settings::MySqlSettings;
pub use super::postgres::settings::PostgresSettings;
pub use super::redis::settings::{RedisMode, RedisSettings, TokenMode};
pub use super::redlock::settings::RedLockSettings;
pub use super::zookeeper::settings::ZooKeeperSettings;
use crate::settings::check::{config_enum, ConfigError};

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(try_from = "String")]
pub enum BackendKind {
    Memory,
    Redis,
    /// A lock on a majority of independent Redis masters.
    RedLock,
    Postgres,
    /// Curator's lock recipe on a ZooKeeper ensemble.
    ZooKeeper,
    /// A lock table in MySQL or MariaDB.
    MySql,
    /// etcd's lock recipe, the holder's creation revision as the token.
    Etcd,
}
config_enum!(BackendKind { Memory => "memory", Redis => "redis", RedLock => "redlock", Postgres => "postgres", ZooKeeper => "zookeeper", MySql => "mysql", Etcd => "etcd" });

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct BackendSettings {
    /// Required for `fencer sidecar`: `memory` must be chosen explicitly,
    /// never fallen into (its locks vanish with the process).
    pub kind: Option<BackendKind>,
    pub redis: RedisSettings,
    pub redlock: RedLockSettings,
    pub postgres: PostgresSettings,
    pub zookeeper: ZooKeeperSettings,
    pub mysql: MySqlSettings,
    pub etcd: EtcdSettings,
}

impl BackendSettings {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        self.redis.validate(self.kind == Some(BackendKind::Redis))?;
        self.redlock
            .validate(self.kind == Some(BackendKind::RedLock))?;
        self.postgres
            .validate(self.kind == Some(BackendKind::Postgres))?;
        self.zookeeper
            .validate(self.kind == Some(BackendKind::ZooKeeper))?;
        self.mysql.validate(self.kind == Some(BackendKind::MySql))?;
        self.etcd.validate(self.kind == Some(BackendKind::Etcd))?;
        Ok(())
    }
}
