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
    pub proxy: ProxySettings,
    pub gateway: GatewaySettings,
    pub storage: StorageSettings,
    pub backend: BackendSettings,
    pub admin: AdminSettings,
    pub signing: SigningSettings,
    pub log: LogSettings,
    pub metrics: MetricsSettings,
    pub runtime: RuntimeSettings,
    /// A secret given in code (`fencer dev`, `fencer demo`): never from a file.
    #[serde(skip)]
    pub signing_secret_override: Option<Vec<u8>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SidecarSettings {
    /// Lock API listener. Keep it on loopback: the API is unauthenticated
    /// by design (it is reachable only from the application's pod/host).
    pub listen: SocketAddr,
    /// The lock API on a Unix socket as well (empty = off), e.g. in a volume
    /// shared with the application container. Cheaper than loopback TCP:
    /// no TCP/IP stack per message (docs/performance.md).
    pub listen_unix: String,
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
    /// Gateway base URL (`http://gateway:8080`) at which each new token is
    /// registered before the acquire returns, so no earlier holder's write
    /// can land after the new holder's first read. Empty: off.
    pub preregister_url: String,
    pub preregister_timeout_ms: u64,
    /// Auto-renewed leases stop being renewed after this much silence from
    /// the application (default for `keepalive_ms` in acquire).
    pub keepalive_ms: u64,
    /// Cap on every lease's life however it is renewed; 0 = no cap.
    pub max_hold_ms: u64,
    /// How often a hold stream sends a heartbeat line.
    pub hold_heartbeat_ms: u64,
    /// After a lease ends without a release (expired or lost), nobody can
    /// acquire the key for this long (Chubby's lock-delay); 0 = off.
    /// Enforced by the backend, so it holds across sidecars.
    pub lock_delay_ms: u64,
    /// POSTed a JSON body for every lease lost without a release. Empty: off.
    pub lost_lease_webhook: String,
    pub webhook_timeout_ms: u64,
}

impl Default for SidecarSettings {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7411".parse().expect("static addr"),
            listen_unix: String::new(),
            default_ttl_ms: 10_000,
            default_wait_ms: 0,
            safety_margin_ms: 20,
            clock_drift_ratio: 0.01,
            max_leases: 200_000,
            max_waiters: 10_000,
            max_fallback_ms: 30_000,
            shutdown_release_timeout_ms: 5_000,
            lost_lease_retention_ms: 60_000,
            preregister_url: String::new(),
            // Above the gateway's wait for a busy key (5 s by default).
            preregister_timeout_ms: 7_000,
            keepalive_ms: 30_000,
            max_hold_ms: 0,
            hold_heartbeat_ms: 1_000,
            lock_delay_ms: 0,
            lost_lease_webhook: String::new(),
            webhook_timeout_ms: 2_000,
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
    Postgres,
}
config_enum!(BackendKind { Memory => "memory", Redis => "redis", Postgres => "postgres" });

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct BackendSettings {
    /// Required for `fencer sidecar`: `memory` must be chosen explicitly,
    /// never fallen into (its locks vanish with the process).
    pub kind: Option<BackendKind>,
    pub redis: RedisSettings,
    pub postgres: PostgresSettings,
}

#[derive(Debug, Clone, Deserialize)]
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

/// The sidecar's egress proxy: the application's storage writes go through
/// it and leave with the lease's signed token.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProxySettings {
    pub enabled: bool,
    pub listen: SocketAddr,
    /// Where requests go (normally the gateway): `http://host:port`.
    pub upstream: String,
    /// Writes that name no lock are refused with 428 instead of passed on.
    pub require_lock_for_writes: bool,
    /// A request under a lock must name the lease it was computed under
    /// (`Fencing-Lease: <lease_id>`). Off, a request naming only the key
    /// goes out with whatever lease holds the key *now* — with several
    /// workers sharing a sidecar, a paused worker's write would go out with
    /// another worker's token (issue 10 item 2).
    pub require_lease: bool,
    pub write_methods: Vec<String>,
    /// Map request paths to lock keys when `Fencing-Lock` is absent.
    pub routes: Vec<crate::routes::RouteSpec>,
    pub connect_timeout_ms: u64,
    pub upstream_timeout_ms: u64,
}

impl Default for ProxySettings {
    fn default() -> Self {
        Self {
            enabled: true,
            listen: "127.0.0.1:7412".parse().expect("static addr"),
            upstream: "http://127.0.0.1:8080".into(),
            require_lock_for_writes: false,
            require_lease: true,
            write_methods: default_write_methods(),
            routes: Vec::new(),
            connect_timeout_ms: 1_000,
            // Above the gateway's whole budget (wait for the key 5 s +
            // connect 1 s + storage 10 s): the proxy must not give up on a
            // request the gateway is still working on.
            upstream_timeout_ms: 20_000,
        }
    }
}

fn default_write_methods() -> Vec<String> {
    ["PUT", "POST", "PATCH", "DELETE"]
        .map(String::from)
        .to_vec()
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(try_from = "String")]
pub enum FenceStoreKind {
    Memory,
    Postgres,
}
config_enum!(FenceStoreKind { Memory => "memory", Postgres => "postgres" });

/// One accepted signing key of the gateway (several during a rotation).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifyKey {
    pub key_id: String,
    pub secret_file: Option<String>,
    pub secret_env: Option<String>,
    /// Lock keys this key may sign, by prefix (e.g. `["team-a/"]`); empty:
    /// any key. Give each team (namespace, application) its own key id and
    /// prefix, and a leaked secret signs only that team's keys.
    #[serde(default)]
    pub key_prefixes: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewaySettings {
    pub listen: SocketAddr,
    /// The storage: `http://host:port`.
    pub upstream: String,
    /// Off: a plain reverse proxy that checks nothing (for comparisons and
    /// staged roll-outs). Never run production writes with it off.
    pub enforce: bool,
    pub write_methods: Vec<String>,
    /// Refuse (428) requests of *every* method without a token, not only
    /// writes: by default a read without a token is forwarded unchecked,
    /// from whoever can reach the gateway.
    pub require_token_for_reads: bool,
    /// Bind paths to keys: a write to `/accounts/7` must carry a token for
    /// `account:7`.
    pub routes: Vec<crate::routes::RouteSpec>,
    /// Accepted signing keys. Empty: the `[signing]` key.
    pub keys: Vec<VerifyKey>,
    /// Required for `fencer gateway`: `postgres`, or `memory` chosen
    /// explicitly for development (marks are lost on restart).
    pub fence_store: Option<FenceStoreKind>,
    pub postgres_url: String,
    pub postgres_ca_file: Option<String>,
    pub postgres_pool_size: usize,
    /// Bound on one fence-store call (check-and-advance, clearing a stamp).
    pub postgres_request_timeout_ms: u64,
    /// How long a fenced request waits for the previous one on its key.
    pub serialize_timeout_ms: u64,
    pub connect_timeout_ms: u64,
    pub upstream_timeout_ms: u64,
    /// After a forwarded write's outcome is unknown (timeout, reset), its key
    /// stays blocked this long, because the write may still land.
    pub uncertain_hold_ms: u64,
    /// Where sidecars pre-register tokens: `POST <prefix><key>`.
    pub fence_api_prefix: String,
}

impl Default for GatewaySettings {
    fn default() -> Self {
        Self {
            listen: "0.0.0.0:8080".parse().expect("static addr"),
            upstream: "http://127.0.0.1:8081".into(),
            enforce: true,
            write_methods: default_write_methods(),
            require_token_for_reads: false,
            routes: Vec::new(),
            keys: Vec::new(),
            fence_store: None,
            postgres_url: String::new(),
            postgres_ca_file: None,
            postgres_pool_size: 32,
            postgres_request_timeout_ms: 2_000,
            serialize_timeout_ms: 5_000,
            connect_timeout_ms: 1_000,
            upstream_timeout_ms: 10_000,
            uncertain_hold_ms: 10_000,
            fence_api_prefix: "/_fencer/v1/fences/".into(),
        }
    }
}

impl GatewaySettings {
    /// How long a fenced request's in-flight stamp keeps other replicas
    /// off its key were this gateway to die mid-forward: connecting,
    /// waiting for the storage, the uncertain hold, and clearing the stamp
    /// (two store calls), plus a second of slack.
    pub fn stamp_hold_ms(&self) -> u64 {
        self.connect_timeout_ms
            + self.upstream_timeout_ms
            + self.uncertain_hold_ms
            + 2 * self.postgres_request_timeout_ms
            + 1_000
    }

    /// The longest a request can spend in the gateway before the storage
    /// answers: waiting for its key, connecting, the storage's time. The
    /// sidecar's proxy must wait longer than this (`proxy.upstream_timeout_ms`).
    pub fn answer_budget_ms(&self) -> u64 {
        self.serialize_timeout_ms + self.connect_timeout_ms + self.upstream_timeout_ms
    }
}

/// The demo key-value storage (`fencer storage`, and inside `fencer dev`).
#[derive(Debug, Clone, Deserialize)]
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

/// The async runtime.
#[derive(Debug, Clone, Deserialize, Default)]
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
    /// Lock keys become a bounded `group` label: the group of the first
    /// rule whose regex matches the key, else the part before the first
    /// `group_separator`. At most `max_groups` distinct groups; the rest are
    /// reported as `other`.
    pub group_separator: String,
    pub max_groups: usize,
    pub group_rules: Vec<GroupRule>,
}

/// `{ pattern = "^tenant-[0-9]+/orders/", group = "orders" }`
#[derive(Debug, Clone, Deserialize)]
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

/// One key the gateway accepts: key id, secret, allowed key prefixes.
pub type GatewayKey = (String, Vec<u8>, Vec<String>);

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
        if self.runtime.worker_threads > RuntimeSettings::MAX_WORKER_THREADS {
            return Err(invalid(
                "runtime.worker_threads",
                format!(
                    "must be between 0 (role default) and {}",
                    RuntimeSettings::MAX_WORKER_THREADS
                ),
            ));
        }
        let s = &self.sidecar;
        if !s.listen_unix.is_empty()
            && (!s.listen_unix.starts_with('/') || s.listen_unix.len() > 100)
        {
            return Err(invalid(
                "sidecar.listen_unix",
                "must be an absolute path of at most 100 bytes (or empty)",
            ));
        }
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
        if self.backend.kind == Some(BackendKind::Redis) {
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
        let pg = &self.backend.postgres;
        if self.backend.kind == Some(BackendKind::Postgres) {
            pg.url.parse::<tokio_postgres::Config>().map_err(|e| {
                invalid("backend.postgres.url", format!("not a PostgreSQL URL: {e}"))
            })?;
        }
        check_range("backend.postgres.pool_size", pg.pool_size as u64, 1, 1024)?;
        check_range(
            "backend.postgres.request_timeout_ms",
            pg.request_timeout_ms,
            10,
            60_000,
        )?;
        check_range(
            "backend.postgres.connect_timeout_ms",
            pg.connect_timeout_ms,
            10,
            60_000,
        )?;
        check_range(
            "backend.postgres.idle_cleanup_after_ms",
            pg.idle_cleanup_after_ms,
            1_000,
            31_536_000_000,
        )?;
        check_range(
            "backend.postgres.cleanup_interval_ms",
            pg.cleanup_interval_ms,
            100,
            86_400_000,
        )?;
        check_key_id("signing.key_id", &self.signing.key_id)?;
        if self.signing.secret_file.is_some() && self.signing.secret_env.is_some() {
            return Err(invalid(
                "signing.secret_file",
                "set either signing.secret_file or signing.secret_env, not both",
            ));
        }
        if !(100..=60_000).contains(&s.preregister_timeout_ms) {
            return Err(invalid(
                "sidecar.preregister_timeout_ms",
                "must be between 100 and 60000",
            ));
        }
        check_range(
            "sidecar.keepalive_ms",
            s.keepalive_ms,
            MIN_TTL_MS,
            MAX_TTL_MS,
        )?;
        check_range("sidecar.max_hold_ms", s.max_hold_ms, 0, 30 * 86_400_000)?;
        check_range(
            "sidecar.hold_heartbeat_ms",
            s.hold_heartbeat_ms,
            10,
            600_000,
        )?;
        check_range("sidecar.lock_delay_ms", s.lock_delay_ms, 0, MAX_TTL_MS)?;
        check_range(
            "sidecar.webhook_timeout_ms",
            s.webhook_timeout_ms,
            10,
            60_000,
        )?;
        if !s.lost_lease_webhook.is_empty() {
            let ok = url::Url::parse(&s.lost_lease_webhook)
                .is_ok_and(|u| u.scheme() == "http" && u.host_str().is_some());
            if !ok {
                return Err(invalid(
                    "sidecar.lost_lease_webhook",
                    "expected an http:// URL",
                ));
            }
        }
        if !s.preregister_url.is_empty() {
            let ok = url::Url::parse(&s.preregister_url).is_ok_and(|u| {
                u.scheme() == "http" && u.host_str().is_some() && u.path().ends_with('/')
            });
            if !ok {
                return Err(invalid(
                    "sidecar.preregister_url",
                    "expected the gateway's fence API prefix, e.g. http://gateway:8080/_fencer/v1/fences/",
                ));
            }
        }
        let p = &self.proxy;
        check_http_url("proxy.upstream", &p.upstream)?;
        check_methods("proxy.write_methods", &p.write_methods)?;
        crate::routes::Routes::compile(&p.routes)
            .map_err(|e| invalid("proxy.routes", e.to_string()))?;
        check_range("proxy.connect_timeout_ms", p.connect_timeout_ms, 10, 60_000)?;
        check_range(
            "proxy.upstream_timeout_ms",
            p.upstream_timeout_ms,
            10,
            600_000,
        )?;
        let g = &self.gateway;
        check_http_url("gateway.upstream", &g.upstream)?;
        check_methods("gateway.write_methods", &g.write_methods)?;
        crate::routes::Routes::compile(&g.routes)
            .map_err(|e| invalid("gateway.routes", e.to_string()))?;
        for (i, k) in g.keys.iter().enumerate() {
            check_key_id("gateway.keys.key_id", &k.key_id)?;
            if g.keys[..i].iter().any(|o| o.key_id == k.key_id) {
                return Err(invalid(
                    "gateway.keys.key_id",
                    format!(
                        "key id `{}` is listed twice; each key id names one secret",
                        k.key_id
                    ),
                ));
            }
            if k.secret_file.is_some() == k.secret_env.is_some() {
                return Err(invalid(
                    "gateway.keys",
                    format!(
                        "key `{}`: set exactly one of secret_file, secret_env",
                        k.key_id
                    ),
                ));
            }
        }
        if g.fence_store == Some(FenceStoreKind::Postgres) && g.postgres_url.is_empty() {
            return Err(invalid(
                "gateway.postgres_url",
                "required when gateway.fence_store = \"postgres\"",
            ));
        }
        check_range(
            "gateway.postgres_pool_size",
            g.postgres_pool_size as u64,
            1,
            1024,
        )?;
        check_range(
            "gateway.serialize_timeout_ms",
            g.serialize_timeout_ms,
            10,
            600_000,
        )?;
        check_range(
            "gateway.connect_timeout_ms",
            g.connect_timeout_ms,
            10,
            60_000,
        )?;
        check_range(
            "gateway.upstream_timeout_ms",
            g.upstream_timeout_ms,
            10,
            600_000,
        )?;
        check_range(
            "gateway.uncertain_hold_ms",
            g.uncertain_hold_ms,
            0,
            3_600_000,
        )?;
        check_range(
            "gateway.postgres_request_timeout_ms",
            g.postgres_request_timeout_ms,
            10,
            60_000,
        )?;
        if !g.fence_api_prefix.starts_with('/') || !g.fence_api_prefix.ends_with('/') {
            return Err(invalid(
                "gateway.fence_api_prefix",
                "must start and end with `/`",
            ));
        }
        if self.storage.backend == FenceStoreKind::Postgres && self.storage.postgres_url.is_empty()
        {
            return Err(invalid(
                "storage.postgres_url",
                "required when storage.backend = \"postgres\"",
            ));
        }
        for rule in &self.metrics.group_rules {
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
        if self.metrics.group_separator.is_empty() {
            return Err(invalid("metrics.group_separator", "must not be empty"));
        }
        if !(1..=10_000).contains(&self.metrics.max_groups) {
            return Err(invalid("metrics.max_groups", "must be between 1 and 10000"));
        }
        Ok(())
    }

    /// A copy safe to print or log: passwords in backend URLs and any
    /// in-code secret replaced (`fencer check-config` printed them).
    pub fn redacted(&self) -> Settings {
        let mut s = self.clone();
        s.signing_secret_override = None;
        s.backend.redis.url = redact_url(&s.backend.redis.url);
        s.backend.postgres.url = redact_url(&s.backend.postgres.url);
        s.gateway.postgres_url = redact_url(&s.gateway.postgres_url);
        s.storage.postgres_url = redact_url(&s.storage.postgres_url);
        s
    }

    /// Checks that only concern a sidecar: how its proxy and its
    /// pre-registration wait compare with the gateway it talks to (the
    /// `[gateway]` values in a sidecar's file describe that gateway).
    /// Run by `fencer sidecar` and `fencer dev`, and by `check-config` for a
    /// file that names a lock backend.
    pub fn validate_sidecar(&self) -> Result<(), ConfigError> {
        let (s, p, g) = (&self.sidecar, &self.proxy, &self.gateway);
        // A proxy that gives up first drops its connection while the
        // gateway still works on the request; its next request of the
        // lease then races the first (issue 9 item 1).
        if p.enabled && p.upstream_timeout_ms <= g.answer_budget_ms() {
            return Err(invalid(
                "proxy.upstream_timeout_ms",
                format!(
                    "must be above the gateway's answer budget, gateway.serialize_timeout_ms + connect_timeout_ms + upstream_timeout_ms = {} ms (set the gateway's values in this file too if your gateway uses others)",
                    g.answer_budget_ms()
                ),
            ));
        }
        if !s.preregister_url.is_empty() && s.preregister_timeout_ms <= g.serialize_timeout_ms {
            return Err(invalid(
                "sidecar.preregister_timeout_ms",
                format!(
                    "must be above gateway.serialize_timeout_ms ({} ms): the gateway may wait that long for a busy key before answering",
                    g.serialize_timeout_ms
                ),
            ));
        }
        Ok(())
    }

    /// The token-signing secret, read from the configured file or variable.
    /// `None` when neither is configured (callers decide whether that is ok).
    pub fn signing_secret(&self) -> Result<Option<Vec<u8>>, ConfigError> {
        if let Some(secret) = &self.signing_secret_override {
            return Ok(Some(secret.clone()));
        }
        read_secret(
            ("signing.secret_file", "signing.secret_env"),
            self.signing.secret_file.as_deref(),
            self.signing.secret_env.as_deref(),
        )
    }

    /// The gateway's accepted `(key id, secret, allowed key prefixes)`.
    pub fn gateway_keys(&self) -> Result<Vec<GatewayKey>, ConfigError> {
        if self.gateway.keys.is_empty() {
            let secret = self.signing_secret()?.ok_or_else(|| {
                invalid(
                    "gateway.keys",
                    "the gateway needs the token-signing secret: set [signing] secret_file/secret_env or [[gateway.keys]]",
                )
            })?;
            return Ok(vec![(self.signing.key_id.clone(), secret, Vec::new())]);
        }
        self.gateway
            .keys
            .iter()
            .map(|k| {
                let fields = ("gateway.keys.secret_file", "gateway.keys.secret_env");
                let secret =
                    read_secret(fields, k.secret_file.as_deref(), k.secret_env.as_deref())?
                        .ok_or_else(|| {
                            invalid("gateway.keys", format!("key `{}` has no secret", k.key_id))
                        })?;
                Ok((k.key_id.clone(), secret, k.key_prefixes.clone()))
            })
            .collect()
    }
}

/// A URL (or libpq `key=value` string) with its password replaced.
pub fn redact_url(raw: &str) -> String {
    const MASK: &str = "REDACTED";
    if let Ok(mut url) = url::Url::parse(raw) {
        if url.password().is_some() {
            let _ = url.set_password(Some(MASK));
        }
        if url
            .query_pairs()
            .any(|(k, _)| k.eq_ignore_ascii_case("password"))
        {
            let pairs: Vec<(String, String)> = url
                .query_pairs()
                .map(|(k, v)| {
                    let v = if k.eq_ignore_ascii_case("password") {
                        MASK.to_owned()
                    } else {
                        v.into_owned()
                    };
                    (k.into_owned(), v)
                })
                .collect();
            url.query_pairs_mut().clear().extend_pairs(pairs);
        }
        return url.to_string();
    }
    static KV: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"(?i)(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)").expect("valid regex")
    });
    KV.replace_all(raw, format!("${{1}}{MASK}")).into_owned()
}

/// Reads a secret from a file or an environment variable; `fields` name the
/// two settings for error messages.
fn read_secret(
    fields: (&'static str, &'static str),
    file: Option<&str>,
    env: Option<&str>,
) -> Result<Option<Vec<u8>>, ConfigError> {
    if let Some(path) = file {
        let data = std::fs::read(path)
            .map_err(|e| invalid(fields.0, format!("cannot read {path}: {e}")))?;
        return check_secret(fields.0, data.trim_ascii().to_vec()).map(Some);
    }
    if let Some(var) = env {
        let value = std::env::var(var)
            .map_err(|_| invalid(fields.1, format!("environment variable {var} is not set")))?;
        // Trimmed like a file: a Kubernetes secret mounted as a variable
        // often ends with a newline the other side does not have.
        return check_secret(fields.1, value.trim_ascii().as_bytes().to_vec()).map(Some);
    }
    Ok(None)
}

fn check_range(field: &'static str, value: u64, min: u64, max: u64) -> Result<(), ConfigError> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(invalid(field, format!("must be between {min} and {max}")))
    }
}

fn check_key_id(field: &'static str, kid: &str) -> Result<(), ConfigError> {
    if kid.is_empty()
        || kid.len() > 32
        || !kid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(invalid(field, "1 to 32 characters from [A-Za-z0-9_-]"));
    }
    Ok(())
}

fn check_http_url(field: &'static str, value: &str) -> Result<(), ConfigError> {
    let url = url::Url::parse(value)
        .map_err(|e| invalid(field, format!("not a URL ({e}); expected http://host:port")))?;
    if url.scheme() != "http" || url.host_str().is_none() {
        return Err(invalid(field, "expected http://host:port"));
    }
    if !matches!(url.path(), "" | "/") || url.query().is_some() {
        return Err(invalid(
            field,
            "give scheme, host and port only (no path or query)",
        ));
    }
    Ok(())
}

fn check_methods(field: &'static str, methods: &[String]) -> Result<(), ConfigError> {
    for m in methods {
        if m.is_empty() || !m.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(invalid(
                field,
                format!("`{m}` is not an upper-case HTTP method"),
            ));
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn passwords_are_redacted_in_every_url_form() {
        assert_eq!(
            redact_url("postgres://fencer:s3cret@db:5432/fencer"),
            "postgres://fencer:REDACTED@db:5432/fencer"
        );
        assert_eq!(
            redact_url("redis://:hunter2@127.0.0.1:6379/0"),
            "redis://:REDACTED@127.0.0.1:6379/0"
        );
        let q = redact_url("postgres://db/fencer?user=u&password=p%40ss&sslmode=require");
        assert!(
            !q.contains("p%40ss") && q.contains("sslmode=require"),
            "{q}"
        );
        assert_eq!(
            redact_url("host=db user=u password='a b' dbname=x"),
            "host=db user=u password=REDACTED dbname=x"
        );
        assert_eq!(
            redact_url("redis://127.0.0.1:6379/0"),
            "redis://127.0.0.1:6379/0"
        );
    }
}
