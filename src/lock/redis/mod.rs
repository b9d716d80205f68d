//! The Redis lock backend (single instance; `redis://` or `rediss://`).
//!
//! Each operation is one `EVALSHA` of a preloaded script over a multiplexed,
//! auto-reconnecting connection (redis-rs `ConnectionManager`, which
//! pipelines concurrent requests from all API handlers onto one socket).
//! The connection manager does not retry a command whose reply was lost;
//! the sidecar retries acquires itself, which is safe because the acquire
//! script is idempotent per lease id.

pub mod keys;
pub mod scripts;
pub mod settings;
pub mod subscriber;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use self::keys::RedisKeys;
use self::scripts::Scripts;
use self::subscriber::Subscriber;
use super::{
    Attempt, BackendError, LeaseId, LockBackend, LockKey, Ownership, WakeSink, WatchGuard,
};
use crate::settings::{RedisSettings, TokenMode};

pub struct RedisBackend {
    conn: ConnectionManager,
    scripts: Arc<Scripts>,
    prefix: String,
    timeout: Duration,
    token_mode: &'static str,
    lock_delay_ms: u64,
    subscriber: Subscriber,
}

impl RedisBackend {
    /// Creates the backend without waiting for Redis: a sidecar starts (and
    /// reports not-ready) while Redis is down, and connects when it is up.
    pub fn new(
        settings: &RedisSettings,
        lock_delay: Duration,
        wake: Arc<dyn WakeSink>,
    ) -> Result<RedisBackend, BackendError> {
        let client = match &settings.ca_file {
            None => redis::Client::open(settings.url.as_str()),
            Some(path) => {
                let pem = std::fs::read(path)
                    .map_err(|e| BackendError::Unavailable(format!("CA file {path}: {e}")))?;
                redis::Client::build_with_tls(
                    settings.url.as_str(),
                    redis::TlsCertificates {
                        client_tls: None,
                        root_cert: Some(pem),
                    },
                )
            }
        }
        .map_err(|e| BackendError::Unavailable(format!("invalid redis url: {e}")))?;
        let timeout = Duration::from_millis(settings.request_timeout_ms);
        let connect_timeout = Duration::from_millis(settings.connect_timeout_ms);
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(timeout))
            .set_connection_timeout(Some(connect_timeout))
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(Duration::from_secs(1));
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), config)
            .map_err(|e| BackendError::Unavailable(e.to_string()))?;
        let subscriber =
            Subscriber::start(client, settings.key_prefix.clone(), connect_timeout, wake);
        let backend = RedisBackend {
            conn,
            scripts: Arc::new(Scripts::new()),
            prefix: settings.key_prefix.clone(),
            timeout,
            token_mode: match settings.token_mode {
                TokenMode::HybridClock => "hybrid",
                TokenMode::Counter => "counter",
            },
            lock_delay_ms: lock_delay.as_millis() as u64,
            subscriber,
        };
        backend.spawn_preload();
        Ok(backend)
    }

    /// Loads the scripts as soon as Redis answers, so the first acquire is a
    /// plain `EVALSHA`. (A Redis restart flushes the script cache; calls then
    /// reload on `NOSCRIPT`.)
    fn spawn_preload(&self) {
        let mut conn = self.conn.clone();
        let scripts = self.scripts.clone();
        tokio::spawn(async move {
            let mut delay = Duration::from_millis(50);
            loop {
                let mut ok = true;
                for script in scripts.all() {
                    if let Err(e) = script.load_async(&mut conn).await {
                        tracing::debug!(error = %e, "script preload failed; retrying");
                        ok = false;
                        break;
                    }
                }
                if ok {
                    tracing::debug!("redis scripts preloaded");
                    return;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        });
    }

    fn keys(&self, key: &LockKey) -> RedisKeys {
        RedisKeys::new(&self.prefix, key)
    }

    async fn invoke(
        &self,
        inv: redis::ScriptInvocation<'_>,
    ) -> Result<(i64, String), BackendError> {
        let mut conn = self.conn.clone();
        match tokio::time::timeout(self.timeout, inv.invoke_async::<(i64, String)>(&mut conn)).await
        {
            Err(_) => Err(BackendError::Unavailable("redis request timed out".into())),
            Ok(Err(e)) => Err(classify(e)),
            Ok(Ok(v)) => Ok(v),
        }
    }
}

/// An error after which the command may or may not have run (I/O, a
/// dropped connection, a timeout) is `Unavailable`; an error reply from
/// Redis (the script refused, `READONLY`, `OOM`) is a known failure.
fn classify(e: redis::RedisError) -> BackendError {
    if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal() {
        BackendError::Unavailable(e.to_string())
    } else {
        BackendError::Protocol(e.to_string())
    }
}

fn parse_token(raw: &str) -> Result<u64, BackendError> {
    raw.parse::<u64>()
        .ok()
        .filter(|t| *t > 0)
        .ok_or_else(|| BackendError::Protocol(format!("bad token {raw:?} in lock entry")))
}

fn ownership(status: i64, value: &str) -> Result<Ownership, BackendError> {
    match status {
        1 => Ok(Ownership::Owned {
            token: parse_token(value)?,
        }),
        0 => Ok(Ownership::Free),
        -1 => Ok(Ownership::OtherHolder),
        other => Err(BackendError::Protocol(format!("unknown status {other}"))),
    }
}

#[async_trait]
impl LockBackend for RedisBackend {
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn try_acquire(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Attempt, BackendError> {
        let k = self.keys(key);
        let mut inv = self.scripts.acquire.prepare_invoke();
        inv.key(k.lock())
            .key(k.counter())
            .key(k.delay())
            .arg(lease.as_str())
            .arg(ttl.as_millis() as u64)
            .arg(self.token_mode)
            .arg(self.lock_delay_ms);
        let (status, value) = self.invoke(inv).await?;
        match status {
            1 => Ok(Attempt::Acquired {
                token: parse_token(&value)?,
            }),
            -1 => {
                // PTTL: -1 no expiry (never set by fencer), -2 vanished meanwhile.
                let pttl: i64 = value.parse().unwrap_or(-2);
                Ok(Attempt::Held {
                    remaining: (pttl >= 0).then(|| Duration::from_millis(pttl as u64)),
                })
            }
            other => Err(BackendError::Protocol(format!(
                "unknown acquire status {other}"
            ))),
        }
    }

    async fn renew(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Ownership, BackendError> {
        let k = self.keys(key);
        let mut inv = self.scripts.renew.prepare_invoke();
        inv.key(k.lock())
            .key(k.delay())
            .arg(lease.as_str())
            .arg(ttl.as_millis() as u64)
            .arg(self.lock_delay_ms);
        let (status, value) = self.invoke(inv).await?;
        ownership(status, &value)
    }

    async fn release(&self, key: &LockKey, lease: &LeaseId) -> Result<Ownership, BackendError> {
        let k = self.keys(key);
        let mut inv = self.scripts.release.prepare_invoke();
        inv.key(k.lock())
            .key(k.delay())
            .arg(lease.as_str())
            .arg(k.channel());
        let (status, value) = self.invoke(inv).await?;
        ownership(status, &value)
    }

    async fn renew_many(
        &self,
        items: &[(LockKey, LeaseId, Duration)],
    ) -> Result<Vec<Ownership>, BackendError> {
        let mut inv = self.scripts.renew_many.prepare_invoke();
        for (key, lease, ttl) in items {
            let k = self.keys(key);
            inv.key(k.lock())
                .key(k.delay())
                .arg(lease.as_str())
                .arg(ttl.as_millis() as u64);
        }
        inv.arg(self.lock_delay_ms);
        let mut conn = self.conn.clone();
        let reply = tokio::time::timeout(
            self.timeout,
            inv.invoke_async::<Vec<redis::Value>>(&mut conn),
        )
        .await
        .map_err(|_| BackendError::Unavailable("redis request timed out".into()))?
        .map_err(classify)?;
        if reply.len() != items.len() * 2 {
            return Err(BackendError::Protocol(format!(
                "renew_many returned {} values",
                reply.len()
            )));
        }
        reply
            .chunks(2)
            .map(|pair| {
                let status: i64 = redis::from_redis_value(pair[0].clone())
                    .map_err(|e| BackendError::Protocol(e.to_string()))?;
                let token: String = redis::from_redis_value(pair[1].clone())
                    .map_err(|e| BackendError::Protocol(e.to_string()))?;
                ownership(status, &token)
            })
            .collect()
    }

    async fn raise_token_floor(&self, key: &LockKey, floor: u64) -> Result<(), BackendError> {
        let k = self.keys(key);
        let mut inv = self.scripts.raise_floor.prepare_invoke();
        inv.key(k.counter()).arg(floor.to_string());
        self.invoke(inv).await.map(|_| ())
    }

    async fn watch(&self, key: &LockKey, timeout: Duration) -> WatchGuard {
        WatchGuard::new(
            self.subscriber
                .watch(self.keys(key).channel(), key.as_str(), timeout)
                .await,
        )
    }

    async fn ping(&self) -> Result<(), BackendError> {
        let mut conn = self.conn.clone();
        let reply = tokio::time::timeout(
            self.timeout,
            redis::cmd("PING").query_async::<String>(&mut conn),
        )
        .await;
        match reply {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(BackendError::Unavailable(e.to_string())),
            Err(_) => Err(BackendError::Unavailable("redis ping timed out".into())),
        }
    }
}
