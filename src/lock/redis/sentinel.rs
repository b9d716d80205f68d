//! Sentinel mode: which server is the master now, followed through
//! failovers.
//!
//! redis-rs resolves a Sentinel master once and keeps writing to that
//! address; a demoted master can go on accepting writes for seconds (tokens
//! 1 → 45 on it while the promoted replica held 2, measured). So fencer
//! follows the master itself:
//!
//! - **Resolution** asks every sentinel `SENTINEL MASTER <name>` at once
//!   and tries the addresses newest `config-epoch` first (a sentinel cut off
//!   from the others keeps reporting the master it knew; the failover that
//!   replaced it carries a newer epoch), most-named first within an epoch,
//!   after the address a `+switch-master` message announced; the first that
//!   says `ROLE` master is used. The epoch alone is not enough: while it
//!   reconfigures the replicas, the sentinel that led a failover already
//!   reports the new epoch with the old master's address (measured by the
//!   fault suite: sidecars ~1.1 s late on every failover it led).
//! - **Triggers**: a `+switch-master` message on any sentinel's pub/sub
//!   (the normal path, within milliseconds of the promotion); an error that
//!   says "not the master" or "gone" (`READONLY`, `NOREPLICAS`,
//!   `MASTERDOWN`, a dropped connection); a `ROLE` check of the current
//!   master every `topology_check_interval_ms`; and a full resolution every
//!   ten checks, which catches a master that was demoted while we could not
//!   hear the sentinels.
//! - **A change of master** bumps the epoch published on a watch channel:
//!   the sidecar then re-verifies every lease on the new master (leases the
//!   new master does not have are lost) and waiters re-check. The new
//!   master's eviction policy is read before an acquire goes to it (a
//!   promoted replica need not be configured like the old master).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::ConnectionManager;
use tokio::sync::{watch, Notify};

use super::client::{manager_config, open_client, ClientTls};
use super::conn::Target;
use super::eviction::EvictionGuard;
use crate::metrics::redis::RedisMetrics;

/// The master in use.
#[derive(Clone)]
pub struct Master {
    pub address: String,
    pub client: redis::Client,
    pub conn: ConnectionManager,
}

/// How to reach the sentinels and the servers they name.
pub struct SentinelConfig {
    /// `redis[s]://[user:password@]host:port` of each sentinel.
    pub sentinels: Vec<String>,
    pub master_name: String,
    /// The data nodes' URL; its host and port are replaced by the master's.
    pub node_url: url::Url,
    pub tls: ClientTls,
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    pub check_interval: Duration,
}

pub struct SentinelMaster {
    config: SentinelConfig,
    current: RwLock<Option<Master>>,
    epoch: watch::Sender<u64>,
    refresh: Notify,
    /// The new master's address from the last `+switch-master` message,
    /// tried first by the next resolution.
    hint: Mutex<Option<String>>,
    metrics: Arc<RedisMetrics>,
    eviction: Arc<EvictionGuard>,
}

impl SentinelMaster {
    /// Starts following the master in the background; until the first
    /// resolution, [`SentinelMaster::current`] is `None` and lock calls fail
    /// as unavailable.
    pub fn start(
        config: SentinelConfig,
        metrics: Arc<RedisMetrics>,
        eviction: Arc<EvictionGuard>,
    ) -> Arc<SentinelMaster> {
        let (epoch, _) = watch::channel(0);
        let me = Arc::new(SentinelMaster {
            config,
            current: RwLock::new(None),
            epoch,
            refresh: Notify::new(),
            hint: Mutex::new(None),
            metrics,
            eviction,
        });
        tokio::spawn(me.clone().follow());
        for sentinel in me.config.sentinels.clone() {
            tokio::spawn(me.clone().listen(sentinel));
        }
        me
    }

    pub fn current(&self) -> Option<Master> {
        self.current.read().expect("master lock").clone()
    }

    /// Master changes so far (0 before the first one).
    pub fn failovers(&self) -> watch::Receiver<u64> {
        self.epoch.subscribe()
    }

    /// A lock call failed in a way that may mean the master moved.
    pub fn suspect(&self, e: &redis::RedisError) {
        let moved = e.is_io_error()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || matches!(e.code(), Some("READONLY" | "NOREPLICAS" | "MASTERDOWN"));
        if moved {
            self.metrics
                .topology_refreshes
                .with_label_values(&["error"])
                .inc();
            self.refresh.notify_one();
        }
    }

    /// Resolves, then re-resolves on every trigger, until the process ends.
    async fn follow(self: Arc<Self>) {
        let mut checks = 0u32;
        let mut backoff = Duration::from_millis(50);
        loop {
            let resolved = if self.current().is_none() || checks % 10 == 0 {
                self.resolve().await
            } else {
                match self.role_of_current().await {
                    Some(true) => true,
                    _ => {
                        self.metrics
                            .topology_refreshes
                            .with_label_values(&["check"])
                            .inc();
                        self.resolve().await
                    }
                }
            };
            checks = checks.wrapping_add(1);
            if resolved && crate::mutants::active("sentinel_resolve_once") {
                return;
            }
            let pause = if resolved {
                backoff = Duration::from_millis(50);
                self.config.check_interval
            } else {
                backoff = (backoff * 2).min(self.config.check_interval);
                backoff
            };
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = self.refresh.notified() => {
                    // Force a full resolution, but not more often than every
                    // 50 ms however many calls fail at once.
                    checks = 0;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// `Some(true)` when the current master still says it is one.
    async fn role_of_current(&self) -> Option<bool> {
        let mut conn = self.current()?.conn;
        let role = tokio::time::timeout(
            self.config.request_timeout,
            redis::cmd("ROLE").query_async::<Vec<redis::Value>>(&mut conn),
        )
        .await
        .ok()?
        .ok()?;
        Some(role_is_master(&role))
    }

    /// Asks the sentinels, verifies the answer, adopts it. `false` when no
    /// master could be confirmed (the current one, if any, is kept).
    async fn resolve(&self) -> bool {
        let answers: Vec<(u64, String)> = futures_util::future::join_all(
            self.config.sentinels.iter().map(|s| self.ask_sentinel(s)),
        )
        .await
        .into_iter()
        .flatten()
        .collect();
        let hint = self.hint.lock().expect("hint lock").take();
        let candidates = candidates(hint, &answers);
        if candidates.is_empty() {
            tracing::warn!(
                master = %self.config.master_name,
                "no sentinel named a master; keeping the current one"
            );
            return false;
        }
        for address in candidates {
            if self.current().is_some_and(|m| m.address == address) {
                if self.role_of_current().await == Some(true) {
                    return true;
                }
                continue;
            }
            match self.connect_master(&address).await {
                Ok(master) => {
                    self.adopt(master);
                    return true;
                }
                Err(e) => {
                    tracing::debug!(address, error = %e, "a server a sentinel names is not (yet) a master");
                }
            }
        }
        tracing::warn!(
            master = %self.config.master_name,
            "no server the sentinels name says it is the master; keeping the current one"
        );
        false
    }

    /// `(config-epoch, "host:port")` from one sentinel.
    async fn ask_sentinel(&self, sentinel: &str) -> Option<(u64, String)> {
        let client = open_client(sentinel, &self.config.tls).ok()?;
        let reply = tokio::time::timeout(
            self.config.connect_timeout + self.config.request_timeout,
            async {
                let mut conn = client.get_multiplexed_async_connection().await?;
                redis::cmd("SENTINEL")
                    .arg("MASTER")
                    .arg(&self.config.master_name)
                    .query_async::<HashMap<String, String>>(&mut conn)
                    .await
            },
        )
        .await;
        match reply {
            Ok(Ok(fields)) => {
                let ip = fields.get("ip")?;
                let port = fields.get("port")?;
                let epoch = fields
                    .get("config-epoch")
                    .and_then(|e| e.parse().ok())
                    .unwrap_or(0);
                Some((epoch, format!("{ip}:{port}")))
            }
            Ok(Err(e)) => {
                tracing::debug!(sentinel = %redact(sentinel), error = %e, "sentinel query failed");
                None
            }
            Err(_) => {
                tracing::debug!(sentinel = %redact(sentinel), "sentinel query timed out");
                None
            }
        }
    }

    async fn connect_master(&self, address: &str) -> Result<Master, String> {
        let (host, port) = address
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
            .ok_or_else(|| format!("bad address {address}"))?;
        let mut url = self.config.node_url.clone();
        url.set_host(Some(host)).map_err(|e| e.to_string())?;
        url.set_port(Some(port))
            .map_err(|_| "bad port".to_owned())?;
        let client = open_client(url.as_str(), &self.config.tls).map_err(|e| e.to_string())?;
        let config = manager_config(self.config.request_timeout, self.config.connect_timeout);
        let mut conn = tokio::time::timeout(
            self.config.connect_timeout + self.config.request_timeout,
            ConnectionManager::new_with_config(client.clone(), config),
        )
        .await
        .map_err(|_| "connect timed out".to_owned())?
        .map_err(|e| e.to_string())?;
        let role = tokio::time::timeout(
            self.config.request_timeout,
            redis::cmd("ROLE").query_async::<Vec<redis::Value>>(&mut conn),
        )
        .await
        .map_err(|_| "ROLE timed out".to_owned())?
        .map_err(|e| e.to_string())?;
        if !role_is_master(&role) {
            return Err("ROLE is not master".into());
        }
        Ok(Master {
            address: address.to_owned(),
            client,
            conn,
        })
    }

    fn adopt(&self, master: Master) {
        let address = master.address.clone();
        // The guard learns of the new master before any command can reach
        // it: an acquire in between reads its policy first.
        self.eviction.set_servers(vec![(
            address.clone(),
            "sentinel".to_owned(),
            Target::Node(master.conn.clone()),
        )]);
        let previous = self
            .current
            .write()
            .expect("master lock")
            .replace(master)
            .map(|m| m.address);
        self.metrics.master.with_label_values(&[&address]).set(1);
        match &previous {
            Some(old) => {
                self.metrics.master.with_label_values(&[old]).set(0);
                self.metrics.failovers.inc();
                self.epoch.send_modify(|e| *e += 1);
                tracing::warn!(
                    master = %self.config.master_name,
                    from = %old,
                    to = %address,
                    "redis master changed; re-verifying every lease on the new master"
                );
            }
            None => {
                tracing::info!(master = %self.config.master_name, address, "redis master found")
            }
        }
        if let Some(m) = self.current() {
            tokio::spawn(super::client::check_min_replicas(
                vec![super::conn::Target::Node(m.conn)],
                self.metrics.clone(),
                self.config.request_timeout,
            ));
        }
    }

    /// Listens for `+switch-master` on one sentinel, reconnecting forever.
    async fn listen(self: Arc<Self>, sentinel: String) {
        let mut backoff = Duration::from_millis(100);
        loop {
            let connected = async {
                let client = open_client(&sentinel, &self.config.tls)?;
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe("+switch-master").await?;
                Ok::<_, redis::RedisError>(pubsub)
            };
            match tokio::time::timeout(
                self.config.connect_timeout + self.config.request_timeout,
                connected,
            )
            .await
            {
                Ok(Ok(pubsub)) => {
                    backoff = Duration::from_millis(100);
                    let mut stream = pubsub.into_on_message();
                    while let Some(msg) = stream.next().await {
                        let payload: String = msg.get_payload().unwrap_or_default();
                        // "<name> <old ip> <old port> <new ip> <new port>"
                        let f: Vec<&str> = payload.split(' ').collect();
                        if f.first() == Some(&self.config.master_name.as_str()) {
                            if let [_, _, _, ip, port] = f[..] {
                                *self.hint.lock().expect("hint lock") =
                                    Some(format!("{ip}:{port}"));
                            }
                            tracing::info!(event = %payload, "sentinel announced a failover");
                            self.metrics
                                .topology_refreshes
                                .with_label_values(&["event"])
                                .inc();
                            self.refresh.notify_one();
                        }
                    }
                    tracing::debug!(sentinel = %redact(&sentinel), "sentinel event stream ended");
                }
                _ => {
                    tracing::debug!(sentinel = %redact(&sentinel), "cannot subscribe to sentinel events")
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
}

/// The addresses to try, in order: the `+switch-master` hint, then the
/// sentinels' answers by config epoch (newest first) and, within one epoch,
/// by how many sentinels give that address. During a failover the leading
/// sentinel already reports the new epoch while it still names the old
/// master (until it has reconfigured the replicas), so neither the epoch
/// nor one sentinel decides alone: each candidate must also say `ROLE`
/// master before it is used.
fn candidates(hint: Option<String>, answers: &[(u64, String)]) -> Vec<String> {
    let mut ranked: Vec<(u64, usize, &str)> = Vec::new();
    for (epoch, address) in answers {
        match ranked
            .iter_mut()
            .find(|(e, _, a)| e == epoch && a == address)
        {
            Some(r) => r.1 += 1,
            None => ranked.push((*epoch, 1, address)),
        }
    }
    ranked.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)));
    let mut out: Vec<String> = hint.into_iter().collect();
    for (_, _, address) in ranked {
        if !out.iter().any(|o| o == address) {
            out.push(address.to_owned());
        }
    }
    out
}

fn role_is_master(role: &[redis::Value]) -> bool {
    role.first()
        .and_then(|v| redis::from_redis_value::<String>(v.clone()).ok())
        .is_some_and(|r| r == "master")
}

fn redact(url: &str) -> String {
    crate::settings::check::redact_url(url)
}

#[cfg(test)]
mod tests {
    use super::candidates;

    #[test]
    fn the_hint_then_newest_epoch_then_most_sentinels() {
        let answers = vec![
            (3, "old:1".to_owned()),
            (4, "old:1".to_owned()),
            (4, "new:2".to_owned()),
            (4, "new:2".to_owned()),
            (2, "older:3".to_owned()),
        ];
        assert_eq!(candidates(None, &answers), ["new:2", "old:1", "older:3"]);
        assert_eq!(
            candidates(Some("hint:9".into()), &answers),
            ["hint:9", "new:2", "old:1", "older:3"]
        );
        assert!(candidates(None, &[]).is_empty());
    }
}
