//! Cluster mode: the cluster connection, the slot a lock lives in, and
//! watching the slot map for shard failovers.
//!
//! The redis-rs cluster client routes each `EVALSHA` by its first key (all
//! keys of one lock share a hash tag, so they share a slot) and follows
//! `MOVED`/`ASK` itself. Its defaults do not suit leases — 16 retries at
//! least 1.28 s apart and no response timeout — so fencer bounds both: a
//! lock call fails within its budget instead of outliving the lease.
//!
//! A shard failover is invisible through that client, so a watcher reads
//! `CLUSTER NODES` every `topology_check_interval_ms` and trusts the view
//! with the highest config epoch seen (a node that has not heard of a
//! promotion yet shows an older one). A change of the master of any slot
//! bumps the failover epoch, and the sidecar re-verifies its leases. Every
//! master of a new map has its eviction policy read before acquires go on.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{ProtocolVersion, PushInfo};
use tokio::sync::{mpsc, watch};

use super::client::{check_min_replicas, manager_config, open_client, ClientTls};
use super::conn::Target;
use super::eviction::EvictionGuard;
use crate::metrics::redis::RedisMetrics;

pub struct ClusterConfig {
    pub nodes: Vec<String>,
    pub tls: ClientTls,
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    pub check_interval: Duration,
}

pub struct ClusterTopology {
    config: ClusterConfig,
    /// Lock scripts only: never subscribed to anything.
    conn: RwLock<Option<ClusterConnection>>,
    /// Sharded pub/sub only. redis-rs takes every `sunsubscribe` push as
    /// the reply to the oldest command in flight on its node connection —
    /// also the one a node sends by itself when a slot moves away — and
    /// every later reply on that connection then answers the command
    /// before it. On a connection that also ran lock scripts, a script's
    /// caller got the push as its reply (a 503, seen in CI in
    /// `cluster_slot_move_under_a_waiter_keeps_its_wakeup`) and the next
    /// script the script's reply. So subscriptions live on a connection of
    /// their own, where only (un)subscriptions can be mistaken.
    pubsub: RwLock<Option<ClusterConnection>>,
    epoch: watch::Sender<u64>,
    metrics: Arc<RedisMetrics>,
    eviction: Arc<EvictionGuard>,
    /// A connection of its own to each master, for reading its eviction
    /// policy: the cluster client reaches a node by address only once it
    /// has connected to it itself, which for a just-promoted replica may be
    /// after the first lock command goes there — and none goes there until
    /// its policy was read.
    node_conns: Mutex<HashMap<String, ConnectionManager>>,
}

/// Slot ranges to the master serving them, as `host:port`.
type SlotMap = BTreeMap<(u16, u16), String>;

impl ClusterTopology {
    /// Connects in the background (a sidecar starts while the cluster is
    /// down). Pushes (sharded pub/sub messages, disconnections) go to
    /// `pushes`.
    pub fn start(
        config: ClusterConfig,
        metrics: Arc<RedisMetrics>,
        eviction: Arc<EvictionGuard>,
        pushes: mpsc::UnboundedSender<PushInfo>,
    ) -> Result<Arc<ClusterTopology>, redis::RedisError> {
        let client = Self::client(&config, None)?;
        let pubsub = Self::client(&config, Some(pushes))?;
        let (epoch, _) = watch::channel(0);
        let me = Arc::new(ClusterTopology {
            config,
            conn: RwLock::new(None),
            pubsub: RwLock::new(None),
            epoch,
            metrics,
            eviction,
            node_conns: Mutex::new(HashMap::new()),
        });
        tokio::spawn(me.clone().run(client));
        tokio::spawn(me.clone().run_pubsub(pubsub));
        Ok(me)
    }

    /// A cluster client with fencer's bounds; `pushes`: the one that
    /// subscribes, its pushes (messages, disconnections) sent there.
    fn client(
        config: &ClusterConfig,
        pushes: Option<mpsc::UnboundedSender<PushInfo>>,
    ) -> Result<redis::cluster::ClusterClient, redis::RedisError> {
        let mut builder = ClusterClientBuilder::new(config.nodes.clone())
            .use_protocol(ProtocolVersion::RESP3)
            .connection_timeout(config.connect_timeout)
            .response_timeout(config.request_timeout)
            .tcp_settings(super::client::tcp_settings())
            // Enough for one MOVED/ASK hop and a reconnect to a promoted
            // replica, not enough to outlive a lease.
            .retries(2)
            .min_retry_wait(10)
            .max_retry_wait(100);
        if let Some(pushes) = pushes {
            builder = builder.push_sender(pushes);
        }
        if let Some(certs) = config.tls.certificates() {
            if config.nodes.iter().any(|n| n.starts_with("rediss://")) {
                builder = builder.certs(certs);
            }
        }
        builder.build()
    }

    /// The connection lock scripts run on.
    pub fn conn(&self) -> Option<ClusterConnection> {
        self.conn.read().expect("cluster lock").clone()
    }

    /// The connection sharded subscriptions live on.
    pub fn pubsub_conn(&self) -> Option<ClusterConnection> {
        self.pubsub.read().expect("cluster lock").clone()
    }

    /// Connects `client`, retrying with a backoff until it does.
    async fn connect(
        &self,
        client: &redis::cluster::ClusterClient,
        what: &str,
    ) -> ClusterConnection {
        let mut backoff = Duration::from_millis(50);
        loop {
            let attempt = tokio::time::timeout(
                self.config.connect_timeout * 2 + self.config.request_timeout,
                client.get_async_connection(),
            )
            .await;
            match attempt {
                Ok(Ok(conn)) => return conn,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, connection = what, "cannot reach the redis cluster yet")
                }
                Err(_) => tracing::warn!(
                    connection = what,
                    "connecting to the redis cluster timed out"
                ),
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    async fn run_pubsub(self: Arc<Self>, client: redis::cluster::ClusterClient) {
        let conn = self.connect(&client, "pubsub").await;
        *self.pubsub.write().expect("cluster lock") = Some(conn);
    }

    pub fn failovers(&self) -> watch::Receiver<u64> {
        self.epoch.subscribe()
    }

    async fn run(self: Arc<Self>, client: redis::cluster::ClusterClient) {
        let conn = self.connect(&client, "scripts").await;
        tracing::info!("redis cluster connected");
        *self.conn.write().expect("cluster lock") = Some(conn.clone());
        let mut seen: Option<(u64, SlotMap)> = None;
        let mut tick = tokio::time::interval(self.config.check_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some((epoch, map)) = self.read_slots(&conn).await else {
                continue;
            };
            // A view with slots nobody serves (a master marked failing, the
            // promotion not done yet) is not a new map: the failover counts,
            // and leases are re-verified, once every slot has a live master
            // again — the new one.
            if !covers_every_slot(&map) {
                continue;
            }
            match &seen {
                Some((old_epoch, _)) if epoch < *old_epoch => continue,
                Some((_, old)) if *old == map => continue,
                _ => {}
            }
            let first = seen.is_none();
            if let Some((_, old)) = &seen {
                for addr in old.values() {
                    if !map.values().any(|a| a == addr) {
                        self.metrics.master.with_label_values(&[addr]).set(0);
                    }
                }
                let moved = old
                    .iter()
                    .any(|(range, addr)| map.get(range).is_none_or(|a| a != addr));
                if moved {
                    self.metrics.failovers.inc();
                    self.metrics
                        .topology_refreshes
                        .with_label_values(&["check"])
                        .inc();
                    self.epoch.send_modify(|e| *e += 1);
                    tracing::warn!(
                        masters = ?map.values().collect::<Vec<_>>(),
                        "redis cluster slot map changed; re-verifying every lease"
                    );
                }
            }
            for addr in map.values() {
                self.metrics.master.with_label_values(&[addr]).set(1);
            }
            let masters: Vec<String> = {
                let mut v: Vec<String> = map.values().cloned().collect();
                v.sort();
                v.dedup();
                v
            };
            seen = Some((epoch, map));
            self.eviction.set_servers(self.policy_targets(&masters));
            if first {
                let targets = masters
                    .iter()
                    .filter_map(|a| {
                        let (h, p) = a.rsplit_once(':')?;
                        Some(Target::ClusterNode(
                            conn.clone(),
                            h.to_owned(),
                            p.parse().ok()?,
                        ))
                    })
                    .collect();
                tokio::spawn(check_min_replicas(
                    targets,
                    self.metrics.clone(),
                    self.config.request_timeout,
                ));
            }
        }
    }

    /// Each master's own connection (made on first use, with the scheme,
    /// credentials and TLS of the first configured node), for the eviction
    /// guard; connections of masters no longer in the map are dropped.
    fn policy_targets(&self, masters: &[String]) -> Vec<(String, String, Target)> {
        let mut conns = self.node_conns.lock().expect("cluster lock");
        conns.retain(|a, _| masters.contains(a));
        let mut out = Vec::with_capacity(masters.len());
        for address in masters {
            let conn = match conns.get(address) {
                Some(c) => c.clone(),
                None => match self.node_conn(address) {
                    Ok(c) => {
                        conns.insert(address.clone(), c.clone());
                        c
                    }
                    Err(e) => {
                        tracing::warn!(address, error = %e, "cannot build a connection to a cluster master");
                        continue;
                    }
                },
            };
            out.push((address.clone(), "cluster".to_owned(), Target::Node(conn)));
        }
        out
    }

    fn node_conn(&self, address: &str) -> Result<ConnectionManager, String> {
        let (host, port) = address
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
            .ok_or_else(|| format!("bad address {address}"))?;
        let template = self
            .config
            .nodes
            .first()
            .ok_or_else(|| "no configured node".to_owned())?;
        let mut url = url::Url::parse(template).map_err(|e| e.to_string())?;
        url.set_host(Some(host)).map_err(|e| e.to_string())?;
        url.set_port(Some(port))
            .map_err(|_| "bad port".to_owned())?;
        let client = open_client(url.as_str(), &self.config.tls).map_err(|e| e.to_string())?;
        let config = manager_config(self.config.request_timeout, self.config.connect_timeout);
        ConnectionManager::new_lazy_with_config(client, config).map_err(|e| e.to_string())
    }

    /// `CLUSTER NODES` from a random node: the highest config epoch in it
    /// and the slot map of its masters that are not marked failed.
    async fn read_slots(&self, conn: &ClusterConnection) -> Option<(u64, SlotMap)> {
        let mut conn = conn.clone();
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("NODES");
        let reply = tokio::time::timeout(
            self.config.request_timeout,
            conn.route_command(cmd, RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random)),
        )
        .await
        .ok()?
        .ok()?;
        let text: String = redis::from_redis_value(reply).ok()?;
        Some(parse_nodes(&text))
    }
}

/// Parses `CLUSTER NODES`: `<id> <ip:port@cport[,host]> <flags> <master>
/// <ping> <pong> <config-epoch> <link> <slot>…`.
fn parse_nodes(text: &str) -> (u64, SlotMap) {
    let mut max_epoch = 0;
    let mut map = SlotMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 8 {
            continue;
        }
        let epoch: u64 = f[6].parse().unwrap_or(0);
        max_epoch = max_epoch.max(epoch);
        let flags = f[2];
        if !flags.split(',').any(|x| x == "master") || flags.contains("fail") {
            continue;
        }
        let addr = f[1].split('@').next().unwrap_or(f[1]).to_owned();
        for slot in &f[8..] {
            if slot.starts_with('[') {
                continue; // a slot being migrated
            }
            let range = match slot.split_once('-') {
                Some((a, b)) => (a.parse().ok(), b.parse().ok()),
                None => (slot.parse().ok(), slot.parse().ok()),
            };
            if let (Some(a), Some(b)) = range {
                map.insert((a, b), addr.clone());
            }
        }
    }
    (max_epoch, map)
}

/// Whether the ranges cover slots 0..=16383 without a gap.
fn covers_every_slot(map: &SlotMap) -> bool {
    let mut next: u32 = 0;
    for &(a, b) in map.keys() {
        if u32::from(a) > next {
            return false;
        }
        next = next.max(u32::from(b) + 1);
    }
    next == 16384
}

/// The Redis Cluster slot of `key`: CRC16 (XMODEM) of its hash tag, mod
/// 16384. Used to group batched renewals, since one script may only touch
/// keys of one slot.
pub fn slot(key: &str) -> u16 {
    let b = key.as_bytes();
    let tagged = b.iter().position(|&c| c == b'{').and_then(|open| {
        let len = b[open + 1..].iter().position(|&c| c == b'}')?;
        (len > 0).then(|| &b[open + 1..open + 1 + len])
    });
    crc16(tagged.unwrap_or(b)) % 16384
}

fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_the_cluster_specification() {
        // Values from the Redis Cluster specification and CLUSTER KEYSLOT.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        assert_eq!(slot("foo{}{bar}"), slot("foo{}{bar}"));
        assert_ne!(slot("foo{}{bar}"), slot("bar"));
        assert_eq!(slot("foo{{bar}}zap"), slot("{bar"));
        assert_eq!(slot("foo{bar}{zap}"), slot("bar"));
    }

    #[test]
    fn nodes_output_gives_live_masters_and_the_newest_epoch() {
        let text = "\
a1 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:7002@17002 master - 0 0 2 connected 5461-10922
c3 127.0.0.1:7003@17003 master,fail - 0 0 3 disconnected 10923-16383
d4 127.0.0.1:7004@17004 master - 0 0 7 connected 10923-16383 [5->-x]
e5 127.0.0.1:7005@17005 slave a1 0 0 1 connected
";
        let (epoch, map) = parse_nodes(text);
        assert!(covers_every_slot(&map));
        assert_eq!(epoch, 7);
        assert_eq!(map.len(), 3);
        assert_eq!(map[&(10923, 16383)], "127.0.0.1:7004");
        assert_eq!(map[&(0, 5460)], "127.0.0.1:7001");
        // The failing master's slots before the promotion: a gap.
        let (_, gap) = parse_nodes(&text.replace(
            "d4 127.0.0.1:7004@17004 master",
            "d4 127.0.0.1:7004@17004 master,fail?",
        ));
        assert!(!covers_every_slot(&gap));
    }
}
