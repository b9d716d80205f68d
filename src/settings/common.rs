//! Sections every role shares: admin listener, token signing, logs,
//! metrics labels, the async runtime.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::check::config_enum;
use super::check::{check_key_id, invalid, ConfigError};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminSettings {
    /// `/healthz`, `/readyz`, `/metrics`.
    pub listen: SocketAddr,
}

impl Default for AdminSettings {
    fn default() -> Self {
        Self {
            listen: "0.0.0.0:9411".parse().expect("static addr"),
        }
    }
}

/// `[http]`: how long a connection may stay silent, on every HTTP
/// listener of the process (lock API, proxy, gateway, admin, storage,
/// injector). Without these bounds a client that connects and sends
/// nothing — or only the h2 preface — holds a descriptor forever.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpSettings {
    /// From accept to the connection's first byte (TLS: its first
    /// decrypted byte).
    pub first_byte_timeout_ms: u64,
    /// With no request in flight, from the first byte or the last
    /// response's end to the close (h2: GOAWAY). A request in flight —
    /// a blocking acquire, a `/hold` stream — is never cut. HTTP/1
    /// keep-alive connections are also closed by the header timeout.
    pub idle_timeout_ms: u64,
}

impl Default for HttpSettings {
    fn default() -> Self {
        let d = crate::http::conn::Silence::default();
        Self {
            first_byte_timeout_ms: d.first_byte.as_millis() as u64,
            idle_timeout_ms: d.idle.as_millis() as u64,
        }
    }
}

impl HttpSettings {
    pub fn silence(&self) -> crate::http::conn::Silence {
        crate::http::conn::Silence {
            first_byte: std::time::Duration::from_millis(self.first_byte_timeout_ms),
            idle: std::time::Duration::from_millis(self.idle_timeout_ms),
        }
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        super::check::check_range(
            "http.first_byte_timeout_ms",
            self.first_byte_timeout_ms,
            100,
            300_000,
        )?;
        super::check::check_range("http.idle_timeout_ms", self.idle_timeout_ms, 100, 3_600_000)
    }
}

/// Where the HMAC secret that signs fencing tokens comes from. Never inline:
/// a committed config file must not carry a secret.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SigningSettings {
    pub key_id: String,
    pub secret_file: Option<String>,
    pub secret_env: Option<String>,
}

impl Default for SigningSettings {
    fn default() -> Self {
        Self {
            key_id: "k1".into(),
            secret_file: None,
            secret_env: None,
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(try_from = "String")]
pub enum LogFormat {
    Text,
    Json,
}
config_enum!(LogFormat { Text => "text", Json => "json" });

/// The async runtime.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeSettings {
    /// Worker threads; 0 = the role's default: one for `sidecar` (a sidecar
    /// shares its pod's CPU with the application, and on loopback one
    /// thread avoids cross-thread wake-ups: measured ~15–40% more lock
    /// cycles per CPU in `fencer bench`, docs/performance.md), one per core
    /// for every other role.
    pub worker_threads: usize,
}

impl RuntimeSettings {
    /// Upper bound on `worker_threads`.
    pub const MAX_WORKER_THREADS: usize = 256;
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogSettings {
    /// A `tracing` filter (`info`, `fencer=debug,warn`); `RUST_LOG` wins.
    pub level: String,
    pub format: LogFormat,
}

impl Default for LogSettings {
    fn default() -> Self {
        Self {
            level: "info".into(),
            format: LogFormat::Text,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSettings {
    /// Lock keys become a bounded `group` label: the group of the first
    /// rule whose regex matches the key, else the part before the first
    /// `group_separator`. At most `max_groups` distinct groups; the rest are
    /// reported as `other`.
    pub group_separator: String,
    pub max_groups: usize,
    pub group_rules: Vec<GroupRule>,
}

/// `{ pattern = "^tenant-[0-9]+/orders/", group = "orders" }`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupRule {
    pub pattern: String,
    pub group: String,
}

impl Default for MetricsSettings {
    fn default() -> Self {
        Self {
            group_separator: ":".into(),
            max_groups: 64,
            group_rules: Vec::new(),
        }
    }
}

impl SigningSettings {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        check_key_id("signing.key_id", &self.key_id)?;
        if self.secret_file.is_some() && self.secret_env.is_some() {
            return Err(invalid(
                "signing.secret_file",
                "set either signing.secret_file or signing.secret_env, not both",
            ));
        }
        Ok(())
    }
}

impl RuntimeSettings {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.worker_threads > Self::MAX_WORKER_THREADS {
            return Err(invalid(
                "runtime.worker_threads",
                format!(
                    "must be between 0 (role default) and {}",
                    Self::MAX_WORKER_THREADS
                ),
            ));
        }
        Ok(())
    }
}

impl MetricsSettings {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        for rule in &self.group_rules {
            regex::Regex::new(&rule.pattern).map_err(|e| {
                invalid(
                    "metrics.group_rules",
                    format!("pattern `{}`: {e}", rule.pattern),
                )
            })?;
            if rule.group.is_empty()
                || rule.group.len() > 48
                || !rule
                    .group
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            {
                return Err(invalid(
                    "metrics.group_rules",
                    format!(
                        "group `{}`: 1 to 48 characters from [A-Za-z0-9_-]",
                        rule.group
                    ),
                ));
            }
        }
        if self.group_separator.is_empty() {
            return Err(invalid("metrics.group_separator", "must not be empty"));
        }
        if !(1..=10_000).contains(&self.max_groups) {
            return Err(invalid("metrics.max_groups", "must be between 1 and 10000"));
        }
        Ok(())
    }
}
