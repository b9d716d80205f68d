//! Dapr lock stores as configured (`[[sidecar.dapr_lock_stores]]`): their
//! names and key prefixes, and the checks on them. A leaf module, so the
//! configuration and the API state can name a store without importing the
//! Dapr request handlers.

use serde::{Deserialize, Serialize};

use crate::settings::check::{invalid, ConfigError};

/// One Dapr lock store: the name applications use, and the prefix that
/// keeps its keys apart from other stores' and from `/v1/locks` keys.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DaprLockStore {
    pub name: String,
    /// Unset: `dapr/<name>/`, a namespace of the store's own, so neither
    /// another store nor a `/v1/locks` client shares its keys (issue 26
    /// item 10). `""` shares the `/v1/locks` namespace on purpose (a Dapr
    /// application and a native one contending for the same keys).
    #[serde(default)]
    pub key_prefix: Option<String>,
}

impl DaprLockStore {
    /// The prefix that puts a resource id in this store's namespace.
    pub fn prefix(&self) -> std::borrow::Cow<'_, str> {
        match &self.key_prefix {
            Some(p) => std::borrow::Cow::Borrowed(p),
            None => std::borrow::Cow::Owned(format!("dapr/{}/", self.name)),
        }
    }
}

/// At most this many stores (they are looked up per request, linearly).
pub const MAX_STORES: usize = 64;

pub fn validate(stores: &[DaprLockStore]) -> Result<(), ConfigError> {
    const FIELD: &str = "sidecar.dapr_lock_stores";
    if stores.len() > MAX_STORES {
        return Err(invalid(FIELD, format!("at most {MAX_STORES} stores")));
    }
    for (i, s) in stores.iter().enumerate() {
        let ok = !s.name.is_empty()
            && s.name.len() <= 64
            && s.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !ok {
            return Err(invalid(
                FIELD,
                format!(
                    "store name `{}` must be 1-64 characters of [A-Za-z0-9._-]",
                    s.name
                ),
            ));
        }
        if stores[..i].iter().any(|o| o.name == s.name) {
            return Err(invalid(
                FIELD,
                format!("store `{}` is listed twice", s.name),
            ));
        }
        if s.key_prefix.as_ref().is_some_and(|p| p.len() > 128) {
            return Err(invalid(FIELD, "key_prefix is at most 128 bytes"));
        }
    }
    Ok(())
}
