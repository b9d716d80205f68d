//! The Redis lock backend: one server, a Sentinel-managed master, or a
//! Cluster (`backend.redis.mode`).
//!
//! Each operation is one `EVALSHA` of a preloaded script ([`scripts`]) on
//! the Redis that owns the key ([`topology`], [`conn`], [`runner`]),
//! optionally followed by `WAIT` on the same connection. In single and
//! sentinel modes, concurrent acquires (and releases) share one script
//! call ([`batch`]); in cluster mode each goes alone. Connections are multiplexed
//! and reconnect by themselves; a command whose reply was lost is not
//! retried here — the sidecar retries acquires itself, which is safe
//! because the acquire script is idempotent per lease id (and so is the
//! cluster client's own retry of a network error).
//!
//! Failovers (sentinel, cluster) are published by [`LockBackend::failovers`];
//! the sidecar then re-verifies its leases with [`LockBackend::check_many`].
//!
//! Every master in use must say `maxmemory-policy noeviction` before an
//! acquire is sent to it ([`eviction`]): Redis would otherwise evict the
//! lock entries and the token counters (which expire when idle,
//! [`counters`]), fencer's keys with a TTL, first.

pub mod batch;
pub mod client;
pub mod cluster;
pub mod conn;
pub mod counters;
pub mod eviction;
pub mod inspect;
pub mod keys;
pub mod runner;
pub mod scripts;
pub mod sentinel;
pub mod settings;
pub mod sharded_subscriber;
pub mod subscriber;
pub mod topology;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::ConnectionManager;
use tokio::sync::watch;

use self::batch::{Batcher, Item, Op};
use self::client::{open_client, sentinel_url, ClientTls};
use self::cluster::{ClusterConfig, ClusterTopology};
use self::conn::{Call, Reply, Target, Wait};
use self::eviction::{EvictionGuard, Wording};
use self::keys::RedisKeys;
use self::runner::{Replicated, Runner};
use self::scripts::{Lua, Scripts};
use self::sentinel::{SentinelConfig, SentinelMaster};
use self::settings::{RedisMode, RedisSettings, TokenMode};
use self::sharded_subscriber::ShardedSubscriber;
use self::subscriber::{Source, Subscriber};
use self::topology::Topology;
use super::{
    Attempt, BackendError, Holds, HoldsChange, KeyView, LeaseId, LockBackend, LockKey, Ownership,
    WakeSink, WatchGuard,
};
use crate::metrics::redis::RedisMetrics;

/// Release notifications, by mode.
enum Watcher {
    Node(Subscriber),
    Sharded(ShardedSubscriber),
}

pub struct RedisBackend {
    /// Where calls go and how one is run (topology, budget, `WAIT`).
    runner: Arc<Runner>,
    scripts: Arc<Scripts>,
    prefix: String,
    token_mode: &'static str,
    /// Token counters expire this long after their last write, and never
    /// before the clock floor passed them (0: never; [`counters`]).
    counter_idle_ms: u64,
    lock_delay_ms: u64,
    /// `PUBLISH`, or `SPUBLISH` in cluster mode.
    publish: &'static str,
    watcher: Watcher,
    metrics: Arc<RedisMetrics>,
    /// Refuses acquires while a master may evict lock entries.
    eviction: Arc<EvictionGuard>,
    /// Group commit of acquires and releases ([`batch`]); `None` in
    /// cluster mode (one script may only touch one slot).
    batchers: Option<Batchers>,
}

struct Batchers {
    acquire: Batcher,
    release: Batcher,
}

impl RedisBackend {
    /// Creates the backend without waiting for Redis: a sidecar starts (and
    /// reports not-ready) while Redis is down, and connects when it is up.
    pub fn new(
        settings: &RedisSettings,
        lock_delay: Duration,
        wake: Arc<dyn WakeSink>,
        registry: &prometheus::Registry,
    ) -> Result<RedisBackend, BackendError> {
        let tls = ClientTls::from_file(settings.ca_file.as_deref())?;
        let mode = settings.mode.as_str();
        let metrics = Arc::new(RedisMetrics::new(registry, mode));
        let timeout = Duration::from_millis(settings.request_timeout_ms);
        let connect_timeout = Duration::from_millis(settings.connect_timeout_ms);
        let check_interval = Duration::from_millis(settings.topology_check_interval_ms);
        let eviction = EvictionGuard::start(
            Wording {
                what: "redis",
                setting: "backend.redis.allow_eviction",
            },
            settings.allow_eviction,
            None,
            timeout,
            Duration::from_millis(settings.eviction_check_interval_ms),
            metrics.eviction.clone(),
        );
        let bad_url =
            |e: redis::RedisError| BackendError::Unavailable(format!("invalid redis url: {e}"));
        let (topology, watcher) = match settings.mode {
            RedisMode::Single => {
                let client = open_client(&settings.url, &tls).map_err(bad_url)?;
                let address = match url::Url::parse(&settings.url) {
                    Ok(url) => {
                        let address = format!(
                            "{}:{}",
                            url.host_str().unwrap_or_default(),
                            url.port().unwrap_or(6379)
                        );
                        metrics.master.with_label_values(&[&address]).set(1);
                        address
                    }
                    Err(_) => crate::settings::check::redact_url(&settings.url),
                };
                let config = client::manager_config(timeout, connect_timeout);
                let conn = ConnectionManager::new_lazy_with_config(client.clone(), config)
                    .map_err(|e| BackendError::Unavailable(e.to_string()))?;
                eviction.set_servers(vec![(address, mode.to_owned(), Target::Node(conn.clone()))]);
                let subscriber = Subscriber::start(
                    Source::Fixed(Box::new(client)),
                    settings.key_prefix.clone(),
                    connect_timeout,
                    wake,
                );
                (Topology::Single(conn), Watcher::Node(subscriber))
            }
            RedisMode::Sentinel => {
                let sentinels = settings
                    .sentinels
                    .iter()
                    .map(|s| {
                        sentinel_url(
                            s,
                            settings.sentinel_tls,
                            settings.sentinel_username.as_deref(),
                            settings.sentinel_password.as_deref(),
                        )
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let node_url = url::Url::parse(&settings.url)
                    .map_err(|e| BackendError::Unavailable(format!("invalid redis url: {e}")))?;
                let master = SentinelMaster::start(
                    SentinelConfig {
                        sentinels,
                        master_name: settings.master_name.clone(),
                        node_url,
                        tls,
                        request_timeout: timeout,
                        connect_timeout,
                        check_interval,
                    },
                    metrics.clone(),
                    eviction.clone(),
                );
                let subscriber = Subscriber::start(
                    Source::Master(master.clone()),
                    settings.key_prefix.clone(),
                    connect_timeout,
                    wake,
                );
                (Topology::Sentinel(master), Watcher::Node(subscriber))
            }
            RedisMode::Cluster => {
                let (pushes, received) = tokio::sync::mpsc::unbounded_channel();
                let cluster = ClusterTopology::start(
                    ClusterConfig {
                        nodes: settings.nodes.clone(),
                        tls,
                        request_timeout: timeout,
                        connect_timeout,
                        check_interval,
                    },
                    metrics.clone(),
                    eviction.clone(),
                    pushes,
                )
                .map_err(bad_url)?;
                let subscriber = ShardedSubscriber::start(
                    cluster.clone(),
                    received,
                    settings.key_prefix.clone(),
                    connect_timeout,
                    wake,
                    metrics.clone(),
                );
                (Topology::Cluster(cluster), Watcher::Sharded(subscriber))
            }
        };
        let cluster = topology.is_cluster();
        let runner = Arc::new(Runner {
            target: target(settings),
            topology,
            timeout,
            wait: (settings.wait_replicas > 0).then_some(Wait {
                replicas: settings.wait_replicas,
                timeout_ms: settings.wait_timeout_ms,
            }),
            eviction: eviction.clone(),
        });
        let mut backend = RedisBackend {
            publish: if cluster { "SPUBLISH" } else { "PUBLISH" },
            runner,
            scripts: Arc::new(Scripts::new()),
            prefix: settings.key_prefix.clone(),
            token_mode: match settings.token_mode {
                TokenMode::HybridClock => "hybrid",
                TokenMode::Counter => "counter",
            },
            counter_idle_ms: settings.counters().idle_ttl_ms(),
            lock_delay_ms: lock_delay.as_millis() as u64,
            watcher,
            metrics,
            eviction,
            batchers: None,
        };
        if !cluster {
            let batcher = |op, tail, replicated| {
                Batcher::start(
                    op,
                    tail,
                    replicated,
                    backend.runner.clone(),
                    backend.scripts.clone(),
                    backend.metrics.clone(),
                )
            };
            let batchers = Batchers {
                acquire: batcher(
                    Op::Acquire,
                    backend.acquire_tail(),
                    Replicated::Required("acquire"),
                ),
                release: batcher(Op::Release, backend.release_tail(), Replicated::No),
            };
            backend.batchers = Some(batchers);
        }
        if let RedisMode::Single = settings.mode {
            backend.spawn_preload();
        }
        tracing::info!(
            token_mode = backend.token_mode,
            counter_idle_ttl_ms = backend.counter_idle_ms,
            "token counters expire after this long without an acquisition, never before the clock floor passed them (0: never)"
        );
        Ok(backend)
    }

    /// Loads the scripts as soon as Redis answers, so the first acquire is a
    /// plain `EVALSHA`. (A restarted or newly promoted server does not have
    /// them; calls then fall back to `EVAL` once, which caches them.)
    fn spawn_preload(&self) {
        let Ok(mut target) = self.runner.topology.target() else {
            return;
        };
        let scripts = self.scripts.clone();
        let runner = self.runner.clone();
        tokio::spawn(async move {
            let mut delay = Duration::from_millis(50);
            loop {
                let mut ok = true;
                for lua in scripts.all() {
                    let mut cmd = redis::cmd("SCRIPT");
                    cmd.arg("LOAD").arg(lua.body);
                    if let Err(e) = target.command::<String>(&cmd).await {
                        // On the connection lock calls share: a drop seen
                        // here is one the next acquire would not see (the
                        // connection reconnects quietly), and the server
                        // behind the new one may evict — read its policy
                        // again (redis_policies::a_reconnect_reads_the_
                        // policy_again failed when this error was eaten).
                        runner.saw_error(&e);
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

    /// Runs one script on the key's Redis, with `WAIT` when `replicated`
    /// requires it and `backend.redis.wait_replicas` is set.
    async fn exec(
        &self,
        lua: &Lua,
        call: &Call,
        replicated: Replicated,
    ) -> Result<Reply, BackendError> {
        self.runner.exec(lua, call, replicated).await
    }

    /// The acquire script's arguments after the item's own (lease id, ttl):
    /// token mode, lock-delay ms, counter idle expiry ms.
    fn acquire_tail(&self) -> Vec<String> {
        vec![
            self.token_mode.to_owned(),
            self.lock_delay_ms.to_string(),
            self.counter_idle_ms.to_string(),
        ]
    }

    /// The release script's argument after the item's own (lease id,
    /// channel): the publish command.
    fn release_tail(&self) -> Vec<String> {
        vec![self.publish.to_owned()]
    }

    /// Runs one acquire or release: through its batcher, or (cluster mode)
    /// as a call of its own. `(status, value, replicas WAIT counted)`.
    async fn run_item(
        &self,
        op: Op,
        item: Item,
    ) -> Result<(i64, String, Option<i64>), BackendError> {
        if let Some(b) = &self.batchers {
            let batcher = match op {
                Op::Acquire => &b.acquire,
                Op::Release => &b.release,
            };
            let r = batcher.call(item).await?;
            return Ok((r.status, r.value, r.replicas));
        }
        let (lua, tail, replicated) = match op {
            Op::Acquire => (
                &self.scripts.acquire,
                self.acquire_tail(),
                Replicated::Required("acquire"),
            ),
            Op::Release => (&self.scripts.release, self.release_tail(), Replicated::No),
        };
        let mut call = Call {
            keys: item.keys,
            args: item.args,
        };
        call.args.extend(tail);
        let reply = self.exec(lua, &call, replicated).await?;
        let (status, value) = pair(reply.value)?;
        Ok((status, value, reply.replicas))
    }

    /// `true` when `WAIT` counted fewer replicas than required (counted in
    /// `fencer_redis_wait_shortfalls_total`).
    fn short(&self, replicas: Option<i64>, replicated: Replicated) -> bool {
        let (Some(wait), Some(acked), Replicated::Required(op)) =
            (self.runner.wait, replicas, replicated)
        else {
            return false;
        };
        if acked >= i64::from(wait.replicas) || crate::mutants::active("ignore_wait_shortfall") {
            return false;
        }
        self.metrics.wait_shortfalls.with_label_values(&[op]).inc();
        tracing::warn!(
            op,
            acked,
            wanted = wait.replicas,
            "redis replicas did not confirm the lock write in time; not granted, releasing"
        );
        true
    }

    /// Releases after a replication shortfall. `Err` when the release itself
    /// failed: the caller then reports an unknown outcome, and the sidecar
    /// releases the lease again later.
    async fn undo(&self, key: &LockKey, lease: &LeaseId) -> Result<(), BackendError> {
        self.release(key, lease).await.map(|_| ())
    }

    /// Indices of `items` grouped so each group's keys share a Cluster slot
    /// (one script may only touch one slot); a single group otherwise.
    fn slot_groups(&self, locks: &[String]) -> Vec<Vec<usize>> {
        if !self.runner.topology.is_cluster() {
            return vec![(0..locks.len()).collect()];
        }
        let mut groups: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
        for (i, name) in locks.iter().enumerate() {
            groups.entry(cluster::slot(name)).or_default().push(i);
        }
        groups.into_values().collect()
    }
}

/// The configured Redis, as connection errors name it (passwords
/// redacted): the URL, the sentinels and master name, or the seed nodes.
fn target(settings: &RedisSettings) -> String {
    use crate::settings::check::redact_url;
    match settings.mode {
        RedisMode::Single => format!("redis {}", redact_url(&settings.url)),
        RedisMode::Sentinel => format!(
            "redis master `{}` of sentinels {}",
            settings.master_name,
            settings.sentinels.join(",")
        ),
        RedisMode::Cluster => format!(
            "redis cluster {}",
            settings
                .nodes
                .iter()
                .map(|n| redact_url(n))
                .collect::<Vec<_>>()
                .join(",")
        ),
    }
}

fn parse_token(raw: &str) -> Result<u64, BackendError> {
    raw.parse::<u64>()
        .ok()
        .filter(|t| *t > 0)
        .ok_or_else(|| BackendError::Protocol(format!("bad token {raw:?} in lock entry")))
}

fn pair(value: redis::Value) -> Result<(i64, String), BackendError> {
    redis::from_redis_value(value).map_err(|e| BackendError::Protocol(e.to_string()))
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

/// Puts each slot group's results back at its items' positions.
fn scatter(
    items: usize,
    groups: &[Vec<usize>],
    results: Vec<Result<Vec<Ownership>, BackendError>>,
) -> Result<Vec<Ownership>, BackendError> {
    let mut out = vec![Ownership::Free; items];
    for (group, result) in groups.iter().zip(results) {
        for (&i, found) in group.iter().zip(result?) {
            out[i] = found;
        }
    }
    Ok(out)
}

/// `{status, token, status, token, …}` → one [`Ownership`] per item.
fn ownerships(value: redis::Value, items: usize) -> Result<Vec<Ownership>, BackendError> {
    let reply: Vec<redis::Value> =
        redis::from_redis_value(value).map_err(|e| BackendError::Protocol(e.to_string()))?;
    if reply.len() != items * 2 {
        return Err(BackendError::Protocol(format!(
            "batch script returned {} values for {items} items",
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
        // Nothing is written to a Redis that may evict the entry (and so
        // grant the key again while this lease holds it).
        self.eviction.admit().await?;
        let k = self.keys(key);
        let (status, value, replicas) = if key.is_reader() {
            let mut call = Call::default();
            call.key(k.lock())
                .key(k.counter())
                .key(k.delay())
                .key(k.readers())
                .key(k.writer_wait())
                .arg(lease.as_str())
                .arg(ttl.as_millis() as u64)
                .arg(self.token_mode)
                .arg(self.counter_idle_ms);
            let reply = self
                .exec(
                    &self.scripts.read_acquire,
                    &call,
                    Replicated::Required("acquire"),
                )
                .await?;
            let (status, value) = pair(reply.value)?;
            (status, value, reply.replicas)
        } else {
            let item = Item {
                keys: vec![
                    k.lock(),
                    k.counter(),
                    k.delay(),
                    k.readers(),
                    k.writer_wait(),
                ],
                args: vec![lease.as_str().to_owned(), ttl.as_millis().to_string()],
            };
            self.run_item(Op::Acquire, item).await?
        };
        let short = self.short(replicas, Replicated::Required("acquire"));
        match status {
            1 if short => {
                self.undo(key, lease).await?;
                Err(BackendError::NotReplicated(format!(
                    "fewer than {} replicas confirmed the acquire within {} ms",
                    self.runner.wait.map_or(0, |w| w.replicas),
                    self.runner.wait.map_or(0, |w| w.timeout_ms)
                )))
            }
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
            -3 => Ok(Attempt::Delayed {
                remaining: Duration::from_millis(value.parse().unwrap_or(0)),
            }),
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
        let mut call = Call::default();
        let replicated = Replicated::Required("renew");
        let reply = if key.is_reader() {
            call.key(k.lock())
                .key(k.readers())
                .arg(lease.as_str())
                .arg(ttl.as_millis() as u64);
            self.exec(&self.scripts.read_renew, &call, replicated)
                .await?
        } else {
            call.key(k.lock())
                .key(k.delay())
                .arg(lease.as_str())
                .arg(ttl.as_millis() as u64)
                .arg(self.lock_delay_ms);
            self.exec(&self.scripts.renew, &call, replicated).await?
        };
        let short = self.short(reply.replicas, replicated);
        let (status, value) = pair(reply.value)?;
        let found = ownership(status, &value)?;
        if short && matches!(found, Ownership::Owned { .. }) {
            // Not granted: the lease ends here rather than live on a write
            // a failover could lose.
            self.undo(key, lease).await?;
            return Ok(Ownership::Free);
        }
        Ok(found)
    }

    async fn release(&self, key: &LockKey, lease: &LeaseId) -> Result<Ownership, BackendError> {
        let k = self.keys(key);
        if key.is_reader() {
            let mut call = Call::default();
            call.key(k.readers())
                .arg(lease.as_str())
                .arg(k.channel())
                .arg(self.publish);
            let reply = self
                .exec(&self.scripts.read_release, &call, Replicated::No)
                .await?;
            let (status, value) = pair(reply.value)?;
            return ownership(status, &value);
        }
        let item = Item {
            keys: vec![k.lock(), k.delay()],
            args: vec![lease.as_str().to_owned(), k.channel()],
        };
        let (status, value, _) = self.run_item(Op::Release, item).await?;
        ownership(status, &value)
    }

    async fn renew_many(
        &self,
        items: &[(LockKey, LeaseId, Duration)],
    ) -> Result<Vec<Ownership>, BackendError> {
        if items.iter().any(|(k, _, _)| k.is_reader()) {
            return crate::lock::readers_apart(
                items,
                |(k, _, _)| k.is_reader(),
                |batch| async move { self.renew_many(&batch).await },
                |(k, l, t)| self.renew(k, l, *t),
            )
            .await;
        }
        let locks: Vec<String> = items.iter().map(|(k, _, _)| self.keys(k).lock()).collect();
        let groups = self.slot_groups(&locks);
        let runs = groups.iter().map(|group| async move {
            let mut call = Call::default();
            for &i in group {
                let (key, lease, ttl) = &items[i];
                call.key(self.keys(key).lock())
                    .key(self.keys(key).delay())
                    .arg(lease.as_str())
                    .arg(ttl.as_millis() as u64);
            }
            call.arg(self.lock_delay_ms);
            let replicated = Replicated::Required("renew");
            let reply = self
                .exec(&self.scripts.renew_many, &call, replicated)
                .await?;
            let short = self.short(reply.replicas, replicated);
            let mut found = ownerships(reply.value, group.len())?;
            if short {
                for (slot, &i) in found.iter_mut().zip(group) {
                    if matches!(slot, Ownership::Owned { .. }) {
                        self.undo(&items[i].0, &items[i].1).await?;
                        *slot = Ownership::Free;
                    }
                }
            }
            Ok::<_, BackendError>(found)
        });
        scatter(
            items.len(),
            &groups,
            futures_util::future::join_all(runs).await,
        )
    }

    async fn check_many(
        &self,
        items: &[(LockKey, LeaseId)],
    ) -> Result<Vec<Ownership>, BackendError> {
        if items.iter().any(|(k, _)| k.is_reader()) {
            return crate::lock::readers_apart(
                items,
                |(k, _)| k.is_reader(),
                |batch| async move { self.check_many(&batch).await },
                |(k, l)| async move {
                    let mut call = Call::default();
                    call.key(self.keys(k).readers()).arg(l.as_str());
                    let reply = self
                        .exec(&self.scripts.read_check, &call, Replicated::No)
                        .await?;
                    let (status, value) = pair(reply.value)?;
                    ownership(status, &value)
                },
            )
            .await;
        }
        let locks: Vec<String> = items.iter().map(|(k, _)| self.keys(k).lock()).collect();
        let groups = self.slot_groups(&locks);
        let runs = groups.iter().map(|group| {
            let locks = &locks;
            async move {
                let mut call = Call::default();
                for &i in group {
                    call.key(locks[i].clone()).arg(items[i].1.as_str());
                }
                let reply = self
                    .exec(&self.scripts.check_many, &call, Replicated::No)
                    .await?;
                ownerships(reply.value, group.len())
            }
        });
        scatter(
            items.len(),
            &groups,
            futures_util::future::join_all(runs).await,
        )
    }

    /// One multiplexed connection carries every lock call of single and
    /// sentinel mode, in order. Not claimed for a cluster (a key's calls
    /// follow its slot, which can move between them).
    fn orders_calls(&self) -> bool {
        !self.runner.topology.is_cluster()
    }

    fn failovers(&self) -> Option<watch::Receiver<u64>> {
        self.runner.topology.failovers()
    }

    async fn raise_token_floor(&self, key: &LockKey, floor: u64) -> Result<(), BackendError> {
        // The counter gets an expiry: not on a Redis that may evict it
        // before the clock floor passes it.
        self.eviction.admit().await?;
        let k = self.keys(key);
        let mut call = Call::default();
        call.key(k.counter()).arg(floor).arg(self.counter_idle_ms);
        self.exec(&self.scripts.raise_floor, &call, Replicated::No)
            .await
            .map(|_| ())
    }

    async fn watch(&self, key: &LockKey, timeout: Duration) -> WatchGuard {
        let channel = self.keys(key).channel();
        match &self.watcher {
            Watcher::Node(s) => WatchGuard::new(s.watch(channel, key.as_str(), timeout).await),
            Watcher::Sharded(s) => WatchGuard::new(s.watch(channel, key.as_str(), timeout).await),
        }
    }

    /// Reachable, and every master in use says `noeviction` (or
    /// `allow_eviction`): a Redis that may evict lock entries is not ready.
    fn supports_reentrancy(&self) -> bool {
        true
    }

    fn supports_read_locks(&self) -> bool {
        true
    }

    async fn holds(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        change: HoldsChange<'_>,
    ) -> Result<Holds, BackendError> {
        let k = self.keys(key);
        let mut call = Call::default();
        call.key(k.lock()).key(k.holds()).arg(lease.as_str());
        let replicated = match change {
            HoldsChange::Read => {
                call.arg("").arg("").arg("").arg("");
                Replicated::No
            }
            HoldsChange::Set {
                expect,
                to,
                owner,
                op,
            } => {
                call.arg(expect).arg(to).arg(op).arg(owner);
                Replicated::Required("holds")
            }
        };
        let reply = self.exec(&self.scripts.holds, &call, replicated).await?;
        if self.short(reply.replicas, replicated) {
            return Err(BackendError::NotReplicated(
                "the hold count did not reach enough replicas".into(),
            ));
        }
        inspect::holds(reply.value)
    }

    async fn fix_permits(&self, name: &LockKey, permits: u32) -> Result<u32, BackendError> {
        let mut call = Call::default();
        call.key(self.keys(name).permits()).arg(permits);
        // Replicated as a lease is: a record lost in a failover could be
        // fixed again at another count.
        let replicated = Replicated::Required("permits");
        let reply = self.exec(&self.scripts.permits, &call, replicated).await?;
        if self.short(reply.replicas, replicated) {
            return Err(BackendError::NotReplicated(
                "the semaphore's permit count did not reach enough replicas".into(),
            ));
        }
        inspect::permits(reply.value)
    }

    async fn inspect(&self, key: &LockKey) -> Result<KeyView, BackendError> {
        let k = self.keys(key);
        let mut call = Call::default();
        call.key(k.lock())
            .key(k.delay())
            .key(k.counter())
            .key(k.readers());
        let reply = self
            .exec(&self.scripts.inspect, &call, Replicated::No)
            .await?;
        Ok(inspect::record(reply.value)?.view())
    }

    async fn ping(&self) -> Result<(), BackendError> {
        let mut target = self.runner.topology.target()?;
        let reply = tokio::time::timeout(
            self.runner.timeout,
            target.command::<String>(&redis::cmd("PING")),
        )
        .await;
        match reply {
            Ok(Ok(_)) => self.eviction.admit().await.map(|_| ()),
            Ok(Err(e)) => {
                self.runner.saw_error(&e);
                Err(BackendError::Unavailable(format!(
                    "{}: {e}",
                    self.runner.target
                )))
            }
            Err(_) => {
                self.runner.saw_timeout();
                Err(BackendError::Unavailable(format!(
                    "{}: ping timed out",
                    self.runner.target
                )))
            }
        }
    }
}
