//! Configuration: defaults < TOML file < `FENCER__SECTION__FIELD` environment.
//!
//! Every field has a default so `fencer dev` runs with no file at all. The
//! structs deny unknown fields so a typo in a config file is an error at
//! start-up, not a silently ignored setting. Semantic checks (ranges,
//! cross-field rules) live in [`Settings::validate`] and name the offending
//! field, because an operator reading `exit 2` in a crash-looping pod needs
//! to know exactly which line to fix.

use std::path::Path;

use serde::{Deserialize, Serialize};

pub mod check;
pub mod common;
pub mod env_lists;
mod keys_dir;
mod suggest;

pub use crate::gateway::settings::{FenceStoreKind, GatewayKey, GatewaySettings, VerifyKey};
pub use crate::inject::settings::InjectSettings;
pub use crate::lock::settings::{
    BackendKind, BackendSettings, PostgresSettings, RedLockSettings, RedisMode, RedisSettings,
    TokenMode,
};
pub use crate::sidecar::settings::{ProxySettings, SidecarSettings};
pub use crate::storage::settings::StorageSettings;
pub use crate::telemetry::settings::TracingSettings;
use check::{invalid, read_secret};
pub use check::{redact_url, ConfigError};
pub use common::{
    AdminSettings, GroupRule, HttpSettings, LogFormat, LogSettings, MetricsSettings,
    RuntimeSettings, SigningSettings,
};

/// Hard bounds shared by config validation and request validation.
pub mod limits;

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    pub sidecar: SidecarSettings,
    pub proxy: ProxySettings,
    pub gateway: GatewaySettings,
    pub storage: StorageSettings,
    pub inject: InjectSettings,
    pub backend: BackendSettings,
    pub admin: AdminSettings,
    pub http: HttpSettings,
    pub signing: SigningSettings,
    pub log: LogSettings,
    /// OpenTelemetry span export (off unless an endpoint is named).
    pub tracing: TracingSettings,
    pub metrics: MetricsSettings,
    pub runtime: RuntimeSettings,
    /// A secret given in code (`fencer dev`, `fencer demo`): never from a file.
    #[serde(skip)]
    pub signing_secret_override: Option<Vec<u8>>,
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
        // The lists of tables (keys, routes) are parsed here, not by the
        // generic source, which reads only scalars and lists of scalars.
        let mut env = process_env()?;
        let lists = env_lists::EnvLists::take(&mut env)?;
        let otel_endpoint = env
            .get(crate::telemetry::settings::OTEL_ENDPOINT_ENV)
            .cloned();
        builder = builder.add_source(
            config::Environment::with_prefix("FENCER")
                .source(Some(env))
                .prefix_separator("__")
                .separator("__")
                .try_parsing(true)
                // The few list settings an operator sets per environment:
                // `FENCER__BACKEND__REDIS__SENTINELS=s1:26379,s2:26379`.
                .list_separator(",")
                .with_list_parse_key("backend.redis.sentinels")
                .with_list_parse_key("backend.redis.nodes")
                .with_list_parse_key("backend.redlock.urls")
                .with_list_parse_key("gateway.etcd_endpoints")
                .with_list_parse_key("backend.etcd.endpoints"),
        );
        let raw = builder
            .build()
            .map_err(|e| ConfigError::Load(e.to_string()))?;
        let mut settings: Settings = raw
            .try_deserialize()
            .map_err(|e| ConfigError::Load(suggest::explain(&e)))?;
        lists.apply(&mut settings);
        // The standard OpenTelemetry variable, when fencer's own setting is
        // unset: validated and printed (check-config) like the setting.
        if settings.tracing.otlp_endpoint.is_none() {
            settings.tracing.otlp_endpoint = otel_endpoint.filter(|e| !e.trim().is_empty());
        }
        settings.validate()?;
        Ok(settings)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        self.runtime.validate()?;
        self.sidecar.validate()?;
        self.backend.validate()?;
        self.signing.validate()?;
        self.proxy.validate()?;
        self.gateway.validate()?;
        self.storage.validate()?;
        self.inject.validate()?;
        self.metrics.validate()?;
        self.http.validate()?;
        self.tracing.validate()?;
        let rl = &self.backend.redlock;
        if self.backend.kind == Some(BackendKind::RedLock)
            && rl.request_timeout_ms * 10 > self.sidecar.default_ttl_ms
        {
            // A round that may take the per-master timeout must leave most
            // of the TTL as validity.
            return Err(invalid(
                "backend.redlock.request_timeout_ms",
                format!(
                    "must be at most a tenth of sidecar.default_ttl_ms ({} ms)",
                    self.sidecar.default_ttl_ms
                ),
            ));
        }
        if self.backend.kind == Some(BackendKind::RedLock)
            && rl.restart_quarantine_ms > 0
            && self.sidecar.default_ttl_ms > rl.restart_quarantine_ms
        {
            return Err(invalid(
                "sidecar.default_ttl_ms",
                format!(
                    "must not exceed backend.redlock.restart_quarantine_ms ({} ms): a longer lease is not safe from a master restarting empty",
                    rl.restart_quarantine_ms
                ),
            ));
        }
        let zk = &self.backend.zookeeper;
        let zk_max = crate::lock::zookeeper::settings::max_lease(
            zk.session_timeout(),
            std::time::Duration::from_millis(self.sidecar.lock_delay_ms),
        );
        if self.backend.kind == Some(BackendKind::ZooKeeper)
            && u128::from(self.sidecar.default_ttl_ms) > zk_max.as_millis()
        {
            return Err(invalid(
                "sidecar.default_ttl_ms",
                format!(
                    "must not exceed {} ms with ZooKeeper: 45% of backend.zookeeper.session_timeout_ms ({} ms) minus sidecar.lock_delay_ms — a lease must end before its session could expire (raise the session timeout for longer leases)",
                    zk_max.as_millis(),
                    zk.session_timeout_ms
                ),
            ));
        }
        Ok(())
    }

    /// A copy safe to print or log: passwords in backend URLs and any
    /// in-code secret replaced (`fencer check-config` printed them).
    pub fn redacted(&self) -> Settings {
        let mut s = self.clone();
        s.signing_secret_override = None;
        s.backend.redis.url = redact_url(&s.backend.redis.url);
        if s.backend.redis.sentinel_password.is_some() {
            s.backend.redis.sentinel_password = Some("REDACTED".into());
        }
        for node in &mut s.backend.redis.nodes {
            *node = redact_url(node);
        }
        for url in &mut s.backend.redlock.urls {
            *url = redact_url(url);
        }
        if s.backend.etcd.password.is_some() {
            s.backend.etcd.password = Some("REDACTED".into());
        }
        if s.backend.zookeeper.auth_digest.is_some() {
            s.backend.zookeeper.auth_digest = Some("REDACTED".into());
        }
        s.backend.postgres.url = redact_url(&s.backend.postgres.url);
        s.backend.mysql.url = redact_url(&s.backend.mysql.url);
        s.gateway.postgres_url = redact_url(&s.gateway.postgres_url);
        s.gateway.mysql_url = redact_url(&s.gateway.mysql_url);
        s.storage.postgres_url = redact_url(&s.storage.postgres_url);
        // HTTP URLs rarely carry a password, but one that does must not be
        // printed; one that does not is left exactly as written.
        for url in [
            &mut s.proxy.upstream,
            &mut s.gateway.upstream,
            &mut s.sidecar.preregister_url,
            &mut s.sidecar.lost_lease_webhook,
            &mut s.inject.gateway_url,
        ] {
            if url::Url::parse(url).is_ok_and(|u| u.password().is_some()) {
                *url = redact_url(url);
            }
        }
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

    /// Valid settings that leave a guarantee to a condition the operator
    /// must know about: printed by `check-config`, logged when a sidecar
    /// starts. Today one: a lock backend that can lose its token counter
    /// (tokens then start over below what the gateway has accepted) without
    /// `sidecar.preregister_url`, the only thing that repairs it forward.
    pub fn sidecar_warnings(&self) -> Vec<String> {
        if !self.sidecar.preregister_url.is_empty() {
            return Vec::new();
        }
        let loses = match self.backend.kind {
            Some(BackendKind::ZooKeeper) => {
                "backend.kind = \"zookeeper\" mints tokens from creation zxids, which start over when the ensemble is rebuilt from empty (data directories lost)"
            }
            Some(BackendKind::Etcd) => {
                "backend.kind = \"etcd\" mints tokens from creation revisions, which go back when the cluster is restored from an old snapshot or rebuilt from empty"
            }
            Some(BackendKind::Redis) if self.backend.redis.token_mode == TokenMode::Counter => {
                "backend.redis.token_mode = \"counter\" keeps the token counter in Redis, which a restart without persistence, a FLUSHALL or a failover to a replica that missed writes loses"
            }
            Some(BackendKind::Memory) => {
                "backend.kind = \"memory\" keeps its token counters in the process, which a restart loses"
            }
            _ => return Vec::new(),
        };
        vec![format!(
            "{loses}; without sidecar.preregister_url nothing repairs the counter forward: tokens go back below the gateway's marks, and the gateway refuses every write under them (409 stale_fencing_token) until the counter passes the mark. Set sidecar.preregister_url (docs/guarantees.md: \"Tokens are repaired forward\")"
        )]
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

    /// The gateway's accepted `(key id, secret, allowed key prefixes)`:
    /// `[[gateway.keys]]` (or `FENCER__GATEWAY__KEYS`) and every key of
    /// `gateway.keys_dir`; neither given, the `[signing]` key.
    pub fn gateway_keys(&self) -> Result<Vec<GatewayKey>, ConfigError> {
        let dir = match &self.gateway.keys_dir {
            Some(dir) => keys_dir::read(dir)?,
            None => Vec::new(),
        };
        if self.gateway.keys.is_empty() && dir.is_empty() {
            let secret = self.signing_secret()?.ok_or_else(|| {
                invalid(
                    "gateway.keys",
                    "the gateway needs the token-signing secret: set [signing] secret_file/secret_env, [[gateway.keys]] or gateway.keys_dir",
                )
            })?;
            return Ok(vec![(self.signing.key_id.clone(), secret, Vec::new())]);
        }
        let mut keys = self
            .gateway
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
            .collect::<Result<Vec<GatewayKey>, ConfigError>>()?;
        for key in dir {
            if keys.iter().any(|k| k.0 == key.0) {
                return Err(invalid(
                    "gateway.keys_dir",
                    format!(
                        "key id `{}` is both in [[gateway.keys]] and a file of gateway.keys_dir; each key id names one secret",
                        key.0
                    ),
                ));
            }
            keys.push(key);
        }
        Ok(keys)
    }
}

/// The process environment as the `config` crate would read it: names
/// that are not Unicode are skipped (no setting has one); a `FENCER__`
/// variable whose value is not Unicode is an error, as it is there.
fn process_env() -> Result<std::collections::HashMap<String, String>, ConfigError> {
    let mut env = std::collections::HashMap::new();
    for (name, value) in std::env::vars_os() {
        let Ok(name) = name.into_string() else {
            continue;
        };
        match value.into_string() {
            Ok(value) => {
                env.insert(name, value);
            }
            Err(_) if name.to_ascii_uppercase().starts_with("FENCER__") => {
                return Err(ConfigError::Load(format!(
                    "environment variable {name} is not valid UTF-8"
                )));
            }
            Err(_) => {}
        }
    }
    Ok(env)
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
