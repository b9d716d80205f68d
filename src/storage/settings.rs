//! `[storage]`: the demo key-value storage.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::settings::check::{invalid, ConfigError};

use crate::gateway::settings::FenceStoreKind;

/// The demo key-value storage (`fencer storage`, and inside `fencer dev`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StorageSettings {
    pub listen: SocketAddr,
    pub backend: FenceStoreKind,
    pub postgres_url: String,
    pub postgres_ca_file: Option<String>,
}

impl Default for StorageSettings {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8081".parse().expect("static addr"),
            backend: FenceStoreKind::Memory,
            postgres_url: String::new(),
            postgres_ca_file: None,
        }
    }
}

impl StorageSettings {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if matches!(self.backend, FenceStoreKind::Mysql | FenceStoreKind::Etcd) {
            return Err(invalid(
                "storage.backend",
                format!(
                    "the demo storage supports `memory` and `postgres`, not `{}`",
                    self.backend.as_str()
                ),
            ));
        }
        if self.backend == FenceStoreKind::Postgres && self.postgres_url.is_empty() {
            return Err(invalid(
                "storage.postgres_url",
                "required when storage.backend = \"postgres\"",
            ));
        }
        Ok(())
    }
}
