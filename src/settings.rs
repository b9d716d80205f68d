//! Configuration: defaults < TOML file < `FENCER__SECTION__FIELD` environment.
//!
//! Every field has a default so `fencer dev` runs with no file at all. The
//! structs deny unknown fields so a typo in a config file is an error at
//! start-up, not a silently ignored setting. Semantic checks (ranges,
//! cross-field rules) live in [`Settings::validate`] and name the offending
//! field, because an operator reading `exit 2` in a crash-looping pod needs
//! to know exactly which line to fix.

use std::net::SocketAddr;
use std::path::Path;

use serde::Deserialize;

/// Hard bounds shared by config validation and request validation.
pub mod limits {
    pub const MIN_TTL_MS: u64 = 100;
    pub const MAX_TTL_MS: u64 = 3_600_000;
    pub const MAX_WAIT_MS: u64 = 300_000;
    pub const MAX_KEY_BYTES: usize = 512;
    pub const MAX_OWNER_BYTES: usize = 256;
    pub const MAX_BODY_BYTES: usize = 16 * 1024;
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    pub sidecar: SidecarSettings,
    pub backend: BackendSettings,
    pub admin: AdminSettings,
    pub signing: SigningSettings,
    pub log: LogSettings,
    pub metrics: MetricsSettings,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SidecarSettings {
    /// Lock API listener. Keep it on loopback: the API is unauthenticated
    /// by design (it is reachable only from the application's pod/host).
    pub listen: SocketAddr,
    pub default_ttl_ms: u64,
    pub default_wait_ms: u64,
    /// Local deadline = send time + ttl * (1 - clock_drift_ratio) - safety_margin_ms.
    pub safety_margin_ms: u64,
    pub clock_drift_ratio: f64,
    /// Upper bound on leases one sidecar tracks (memory bound).
    pub max_leases: usize,
    /// Upper bound on requests queued waiting for locks.
    pub max_waiters: usize,
    /// Cap on the fallback re-check interval of a waiter (used when a lock
    /// expires without a release, which publishes nothing).
    pub max_fallback_ms: u64,
    /// How long SIGTERM waits for leases to be released before exiting.
    pub shutdown_release_timeout_ms: u64,
    /// How long a lost lease stays visible in `GET /v1/locks/{key}`.
    pub lost_lease_retention_ms: u64,
}

impl Default for SidecarSettings {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7411".parse().expect("static addr"),
            default_ttl_ms: 10_000,
            default_wait_ms: 0,
            safety_margin_ms: 20,
            clock_drift_ratio: 0.01,
            max_leases: 200_000,
            max_waiters: 10_000,
            max_fallback_ms: 30_000,
            shutdown_release_timeout_ms: 5_000,
            lost_lease_retention_ms: 60_000,
        }
    }
}

/// Implements `TryFrom<String>` for a config enum so that an unknown value
/// is reported with the list of allowed ones.
macro_rules! config_enum {
    ($ty:ident { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl TryFrom<String> for $ty {
            type Error = String;
            fn try_from(value: String) -> Result<Self, String> {
                match value.as_str() {
                    $($name => Ok($ty::$variant),)+
                    other => Err(format!(
                        "unknown value `{other}`; allowed: {}",
                        [$($name),+].join(", ")
                    )),
                }
            }
        }
        impl $ty {
            pub fn as_str(self) -> &'static str {
                match self { $($ty::$variant => $name,)+ }
            }
        }
    };
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(try_from = "String")]
pub enum BackendKind {
    Memory,
    Redis,
}
config_enum!(BackendKind { Memory => "memory", Redis => "redis" });

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BackendSettings {
    pub kind: BackendKind,
    pub redis: RedisSettings,
}

impl Default for BackendSettings {
    fn default() -> Self {
        Self {
            kind: BackendKind::Memory,
            redis: RedisSettings::default(),
        }
    }
}

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
}

impl Default for RedisSettings {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379/0".into(),
            key_prefix: "fencer:".into(),
            request_timeout_ms: 1_000,
            connect_timeout_ms: 1_000,
            token_mode: TokenMode::HybridClock,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
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

/// Where the HMAC secret that signs fencing tokens comes from. Never inline:
/// a committed config file must not carry a secret.
#[derive(Debug, Clone, Deserialize)]
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

#[derive(Debug, Clone, Deserialize)]
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

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSettings {
    /// Lock keys become a bounded `group` label: the part before the first
    /// `group_separator`. At most `max_groups` distinct groups; the rest are
    /// reported as `other`.
    pub group_separator: String,
    pub max_groups: usize,
}

impl Default for MetricsSettings {
    fn default() -> Self {
        Self {
            group_separator: ":".into(),
            max_groups: 64,
        }
    }
}

/// A configuration error: which field, and what is allowed.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{0}")]
    Load(String),
    #[error("invalid value for `{field}`: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
}

fn invalid(field: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        message: message.into(),
    }
}

impl Settings {
    /// Loads defaults, then `path` (if any), then `FENCER__…` variables.
    pub fn load(path: Option<&Path>) -> Result<Settings, ConfigError> {
        let mut builder = config::Config::builder();
        if let Some(path) = path {
            if !path.exists() {
                return Err(ConfigError::Load(format!(
                    "config file {} does not exist",
                    path.display()
                )));
            }
            builder = builder.add_source(
                config::File::from(path)
                    .format(config::FileFormat::Toml)
                    .required(true),
            );
        }
        builder = builder.add_source(
            config::Environment::with_prefix("FENCER")
                .prefix_separator("__")
                .separator("__")
                .try_parsing(true),
        );
        let raw = builder
            .build()
            .map_err(|e| ConfigError::Load(e.to_string()))?;
        let settings: Settings = raw
            .try_deserialize()
            .map_err(|e| ConfigError::Load(e.to_string()))?;
        settings.validate()?;
        Ok(settings)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        use limits::*;
        let s = &self.sidecar;
        if !(MIN_TTL_MS..=MAX_TTL_MS).contains(&s.default_ttl_ms) {
            return Err(invalid(
                "sidecar.default_ttl_ms",
                format!("must be between {MIN_TTL_MS} and {MAX_TTL_MS}"),
            ));
        }
        if s.default_wait_ms > MAX_WAIT_MS {
            return Err(invalid(
                "sidecar.default_wait_ms",
                format!("must be between 0 and {MAX_WAIT_MS}"),
            ));
        }
        if !(0.0..0.5).contains(&s.clock_drift_ratio) {
            return Err(invalid(
                "sidecar.clock_drift_ratio",
                "must be at least 0.0 and below 0.5",
            ));
        }
        // The margin must leave a usable lease even at the smallest TTL.
        let min_lease = MIN_TTL_MS as f64 * (1.0 - s.clock_drift_ratio);
        if s.safety_margin_ms as f64 >= min_lease / 2.0 {
            return Err(invalid(
                "sidecar.safety_margin_ms",
                format!(
                    "must be below {} (half the smallest lease after drift)",
                    (min_lease / 2.0) as u64
                ),
            ));
        }
        if !(1..=10_000_000).contains(&s.max_leases) {
            return Err(invalid(
                "sidecar.max_leases",
                "must be between 1 and 10000000",
            ));
        }
        if !(1..=1_000_000).contains(&s.max_waiters) {
            return Err(invalid(
                "sidecar.max_waiters",
                "must be between 1 and 1000000",
            ));
        }
        if !(10..=600_000).contains(&s.max_fallback_ms) {
            return Err(invalid(
                "sidecar.max_fallback_ms",
                "must be between 10 and 600000",
            ));
        }
        if s.shutdown_release_timeout_ms > 600_000 {
            return Err(invalid(
                "sidecar.shutdown_release_timeout_ms",
                "must be between 0 and 600000",
            ));
        }
        if s.lost_lease_retention_ms > 86_400_000 {
            return Err(invalid(
                "sidecar.lost_lease_retention_ms",
                "must be between 0 and 86400000",
            ));
        }
        let r = &self.backend.redis;
        if self.backend.kind == BackendKind::Redis {
            let url = url::Url::parse(&r.url).map_err(|e| {
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
        if r.key_prefix.len() > 64 || r.key_prefix.contains(['{', '}']) {
            return Err(invalid(
                "backend.redis.key_prefix",
                "at most 64 bytes and no `{` or `}` (they would break the Cluster hash tag)",
            ));
        }
        if !(10..=60_000).contains(&r.request_timeout_ms) {
            return Err(invalid(
                "backend.redis.request_timeout_ms",
                "must be between 10 and 60000",
            ));
        }
        if !(10..=60_000).contains(&r.connect_timeout_ms) {
            return Err(invalid(
                "backend.redis.connect_timeout_ms",
                "must be between 10 and 60000",
            ));
        }
        let kid = &self.signing.key_id;
        if kid.is_empty()
            || kid.len() > 32
            || !kid
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(invalid(
                "signing.key_id",
                "1 to 32 characters from [A-Za-z0-9_-]",
            ));
        }
        if self.signing.secret_file.is_some() && self.signing.secret_env.is_some() {
            return Err(invalid(
                "signing.secret_file",
                "set either signing.secret_file or signing.secret_env, not both",
            ));
        }
        if self.metrics.group_separator.is_empty() {
            return Err(invalid("metrics.group_separator", "must not be empty"));
        }
        if !(1..=10_000).contains(&self.metrics.max_groups) {
            return Err(invalid("metrics.max_groups", "must be between 1 and 10000"));
        }
        Ok(())
    }

    /// The token-signing secret, read from the configured file or variable.
    /// `None` when neither is configured (callers decide whether that is ok).
    pub fn signing_secret(&self) -> Result<Option<Vec<u8>>, ConfigError> {
        if let Some(path) = &self.signing.secret_file {
            let data = std::fs::read(path)
                .map_err(|e| invalid("signing.secret_file", format!("cannot read {path}: {e}")))?;
            let trimmed = data.trim_ascii().to_vec();
            return check_secret("signing.secret_file", trimmed).map(Some);
        }
        if let Some(var) = &self.signing.secret_env {
            let value = std::env::var(var).map_err(|_| {
                invalid(
                    "signing.secret_env",
                    format!("environment variable {var} is not set"),
                )
            })?;
            return check_secret("signing.secret_env", value.into_bytes()).map(Some);
        }
        Ok(None)
    }
}

fn check_secret(field: &'static str, secret: Vec<u8>) -> Result<Vec<u8>, ConfigError> {
    if secret.len() < 32 {
        return Err(invalid(
            field,
            "the signing secret must be at least 32 bytes",
        ));
    }
    Ok(secret)
}
