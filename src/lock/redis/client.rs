//! Building redis-rs clients from fencer's settings, and the start-up check
//! of the masters' `min-replicas-to-write`.

use std::sync::Arc;
use std::time::Duration;

use super::conn::Target;
use crate::lock::BackendError;
use crate::metrics::redis::RedisMetrics;

/// The CA certificates trusted for `rediss://` (none: the public web roots).
#[derive(Clone, Default)]
pub struct ClientTls {
    pub ca_pem: Option<Vec<u8>>,
}

impl ClientTls {
    pub fn from_file(path: Option<&str>) -> Result<ClientTls, BackendError> {
        let ca_pem = path
            .map(|p| {
                std::fs::read(p).map_err(|e| BackendError::Unavailable(format!("CA file {p}: {e}")))
            })
            .transpose()?;
        Ok(ClientTls { ca_pem })
    }

    pub fn certificates(&self) -> Option<redis::TlsCertificates> {
        self.ca_pem.as_ref().map(|pem| redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(pem.clone()),
        })
    }
}

/// How every connection to one Redis server (single, a Sentinel-named
/// master, a RedLock master) is kept: each call bounded by
/// `response_timeout`, each (re)connect by `connect_timeout`, reconnects
/// backing off from 20 ms to 1 s.
pub fn manager_config(
    response_timeout: Duration,
    connect_timeout: Duration,
) -> redis::aio::ConnectionManagerConfig {
    redis::aio::ConnectionManagerConfig::new()
        .set_response_timeout(Some(response_timeout))
        .set_connection_timeout(Some(connect_timeout))
        .set_min_delay(Duration::from_millis(20))
        .set_max_delay(Duration::from_secs(1))
}

/// A client for `url`, trusting `tls`'s CA when the URL is `rediss://`. The
/// CA is ignored for a plain `redis://` URL, so one `ca_file` can serve,
/// say, TLS sentinels in front of plain data nodes.
///
/// Connections set TCP_NODELAY, which redis-rs leaves off: the sidecar
/// pipelines many callers' scripts on one connection, and with Nagle on a
/// script written while an earlier one is unacknowledged waits for that
/// ACK (docs/performance.md).
pub fn open_client(url: &str, tls: &ClientTls) -> redis::RedisResult<redis::Client> {
    use redis::IntoConnectionInfo;
    let info = url.into_connection_info()?.set_tcp_settings(tcp_settings());
    match tls.certificates() {
        Some(certs) if url.starts_with("rediss://") => redis::Client::build_with_tls(info, certs),
        _ => redis::Client::open(info),
    }
}

/// The TCP settings of every connection to Redis: TCP_NODELAY on (see
/// [`open_client`]).
pub fn tcp_settings() -> redis::io::tcp::TcpSettings {
    redis::io::tcp::TcpSettings::default().set_nodelay(true)
}

/// `redis[s]://[user:password@]host:port` for one sentinel.
pub fn sentinel_url(
    address: &str,
    tls: bool,
    username: Option<&str>,
    password: Option<&str>,
) -> Result<String, BackendError> {
    let scheme = if tls { "rediss" } else { "redis" };
    let mut url = url::Url::parse(&format!("{scheme}://{address}"))
        .map_err(|e| BackendError::Unavailable(format!("sentinel {address}: {e}")))?;
    if let Some(u) = username {
        let _ = url.set_username(u);
    }
    if let Some(p) = password {
        let _ = url.set_password(Some(p));
    }
    Ok(url.into())
}

/// Reads `min-replicas-to-write` from each master and warns when one is 0:
/// after a failover such a master, demoted but not yet told, keeps
/// accepting lock writes (and minting tokens) that the new master never
/// sees. Sets `fencer_redis_min_replicas_to_write` to the smallest value.
pub async fn check_min_replicas(
    targets: Vec<Target>,
    metrics: Arc<RedisMetrics>,
    timeout: Duration,
) {
    let mut smallest: Option<i64> = None;
    for mut target in targets {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("GET").arg("min-replicas-to-write");
        let reply = tokio::time::timeout(
            timeout,
            target.command::<std::collections::HashMap<String, String>>(&cmd),
        )
        .await;
        match reply {
            Ok(Ok(pair)) => {
                if let Some(v) = pair
                    .get("min-replicas-to-write")
                    .and_then(|v| v.parse::<i64>().ok())
                {
                    smallest = Some(smallest.map_or(v, |s| s.min(v)));
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot read min-replicas-to-write (CONFIG may be renamed or denied)");
            }
            Err(_) => tracing::warn!("reading min-replicas-to-write timed out"),
        }
    }
    match smallest {
        Some(0) => {
            metrics.min_replicas_to_write.set(0);
            tracing::warn!(
                "redis master has min-replicas-to-write 0: after a failover the old master may accept lock writes for seconds; set min-replicas-to-write 1 and min-replicas-max-lag 1 (docs/backends.md, Redis topologies)"
            );
        }
        Some(v) => metrics.min_replicas_to_write.set(v),
        None => metrics.min_replicas_to_write.set(-1),
    }
}
