//! Release notifications in cluster mode: sharded pub/sub.
//!
//! A release `SPUBLISH`es on its lock's channel, which shares the lock's
//! hash tag, so the message stays on that shard instead of being broadcast
//! over the whole cluster bus. A cluster connection of its own (RESP3; lock
//! scripts never run on it, see [`super::cluster`]) sends each
//! `SSUBSCRIBE` to the shard that owns the channel and subscribes again
//! after a reconnect; messages arrive as pushes. Whatever was published
//! while a shard connection was down, or while a shard failed over, is
//! lost, so a disconnection push or a slot-map change makes every queue
//! re-check ([`WakeSink::resync`]).
//!
//! Redis also drops sharded subscriptions by itself (issue 27 item 9):
//! when a slot moves to another master, the node that lost it sends
//! `sunsubscribe` for every channel of the slot, and the client forgets
//! them (its re-subscription after a reconnect or a slot-map change covers
//! only what it still tracks). A waiter would then hear no release until
//! its fallback timer at the holder's TTL. So a `sunsubscribe` for a
//! watched channel — and a dropped node link, for every watched channel —
//! hands the channel to [`resubscriber`], which sends `SSUBSCRIBE` again
//! through the cluster connection (routed by the slot map, `MOVED` followed
//! to the slot's new owner, the map refreshed), retrying while anyone
//! watches it, and then wakes the key's first waiter to re-check: a release
//! between the drop and the new subscription was not heard. Counted in
//! `fencer_redis_resubscriptions_total{cause,result}`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::cluster_async::ClusterConnection;
use redis::{PushInfo, PushKind};
use tokio::sync::mpsc;

use super::cluster::ClusterTopology;
use super::keys::RedisKeys;
use crate::lock::channels::{ChannelWatch, Channels, Resubscribed};
use crate::lock::WakeSink;
use crate::metrics::redis::RedisMetrics;

const JANITOR_INTERVAL: Duration = Duration::from_secs(10);

/// First and longest pause between re-subscription rounds of channels
/// whose `SSUBSCRIBE` failed (the slot mid-move, its node down).
const RETRY_FIRST: Duration = Duration::from_millis(20);
const RETRY_MAX: Duration = Duration::from_secs(1);

/// `SSUBSCRIBE`s of one round in flight at once (a dropped link may take
/// every watched channel with it).
const RESUBSCRIBE_CONCURRENCY: usize = 32;

/// Why a channel is subscribed again (the metric's `cause`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    SlotMoved,
    ConnectionLost,
}

impl Cause {
    fn label(self) -> &'static str {
        match self {
            Cause::SlotMoved => "slot_moved",
            Cause::ConnectionLost => "connection_lost",
        }
    }
}

pub struct ShardedSubscriber {
    channels: Channels<ClusterConnection>,
    call_timeout: Duration,
}

async fn ssubscribe(mut conn: ClusterConnection, channel: String) -> Result<(), String> {
    conn.ssubscribe(&channel).await.map_err(|e| e.to_string())
}

async fn sunsubscribe(mut conn: ClusterConnection, channel: String) -> Result<(), String> {
    conn.sunsubscribe(&channel).await.map_err(|e| e.to_string())
}

impl ShardedSubscriber {
    pub fn start(
        topology: Arc<ClusterTopology>,
        pushes: mpsc::UnboundedReceiver<PushInfo>,
        prefix: String,
        call_timeout: Duration,
        wake: Arc<dyn WakeSink>,
        metrics: Arc<RedisMetrics>,
    ) -> ShardedSubscriber {
        let channels = Channels::new();
        tokio::spawn(run(
            topology,
            pushes,
            prefix,
            call_timeout,
            wake,
            channels.clone(),
            metrics,
        ));
        ShardedSubscriber {
            channels,
            call_timeout,
        }
    }

    pub async fn watch(
        &self,
        channel: String,
        key: &str,
        timeout: Duration,
    ) -> ChannelWatch<ClusterConnection> {
        self.channels
            .watch(channel, key, ssubscribe, timeout.min(self.call_timeout))
            .await
    }
}

async fn run(
    topology: Arc<ClusterTopology>,
    mut pushes: mpsc::UnboundedReceiver<PushInfo>,
    prefix: String,
    call_timeout: Duration,
    wake: Arc<dyn WakeSink>,
    channels: Channels<ClusterConnection>,
    metrics: Arc<RedisMetrics>,
) {
    let conn = loop {
        if let Some(conn) = topology.pubsub_conn() {
            break conn;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // The cluster connection re-subscribes by itself after reconnects, so
    // it is "connected" once for good.
    while !channels
        .connected(conn.clone(), ssubscribe, call_timeout)
        .await
    {
        channels.disconnected();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    wake.resync();
    let (again, queue) = mpsc::unbounded_channel();
    tokio::spawn(resubscriber(
        channels.clone(),
        queue,
        call_timeout,
        wake.clone(),
        metrics,
    ));
    let mut failovers = topology.failovers();
    let mut janitor = tokio::time::interval(JANITOR_INTERVAL);
    janitor.tick().await;
    loop {
        tokio::select! {
            push = pushes.recv() => {
                let Some(push) = push else { return };
                match push.kind {
                    PushKind::SMessage | PushKind::Message => {
                        let channel = push
                            .data
                            .first()
                            .and_then(|v| redis::from_redis_value::<String>(v.clone()).ok());
                        if let Some(key) = channel
                            .as_deref()
                            .and_then(|c| RedisKeys::key_from_channel(&prefix, c))
                        {
                            wake.released(&key);
                        }
                    }
                    PushKind::SUnsubscribe => {
                        // Our own janitor's unsubscribes come back here too;
                        // they are of channels it has already forgotten.
                        let channel = push
                            .data
                            .first()
                            .and_then(|v| redis::from_redis_value::<String>(v.clone()).ok());
                        if let Some(channel) = channel {
                            if let Some(key) = channels.unsubscribed(&channel) {
                                tracing::info!(
                                    key = %key,
                                    "sharded subscription dropped by redis (its slot moved); subscribing on the slot's new owner"
                                );
                                let _ = again.send((channel, Cause::SlotMoved));
                            }
                        }
                    }
                    PushKind::Disconnection => {
                        let watched = channels.unsubscribed_all();
                        tracing::warn!(
                            watched = watched.len(),
                            "a cluster node connection dropped; waiters re-check and their channels are subscribed again"
                        );
                        wake.resync();
                        for channel in watched {
                            let _ = again.send((channel, Cause::ConnectionLost));
                        }
                    }
                    _ => {}
                }
            }
            changed = failovers.changed() => {
                if changed.is_err() {
                    return;
                }
                wake.resync();
            }
            _ = janitor.tick() => {
                for key in channels.sweep_idle(sunsubscribe, ssubscribe, call_timeout).await {
                    wake.released(&key);
                }
            }
        }
    }
}

/// Subscribes again the channels Redis dropped (see the module comment):
/// rounds of at most [`RESUBSCRIBE_CONCURRENCY`] `SSUBSCRIBE`s at once,
/// each bounded by `call_timeout`; what failed is retried after a pause
/// that doubles up to [`RETRY_MAX`], for as long as anyone watches it.
async fn resubscriber(
    channels: Channels<ClusterConnection>,
    mut queue: mpsc::UnboundedReceiver<(String, Cause)>,
    call_timeout: Duration,
    wake: Arc<dyn WakeSink>,
    metrics: Arc<RedisMetrics>,
) {
    let mut pending: HashMap<String, Cause> = HashMap::new();
    let mut pause = RETRY_FIRST;
    loop {
        if pending.is_empty() {
            let Some((channel, cause)) = queue.recv().await else {
                return;
            };
            pending.insert(channel, cause);
            pause = RETRY_FIRST;
        }
        while let Ok((channel, cause)) = queue.try_recv() {
            pending.entry(channel).or_insert(cause);
        }
        let round: Vec<(String, Cause)> = pending.drain().collect();
        let results: Vec<(String, Cause, Resubscribed)> = futures_util::stream::iter(round)
            .map(|(channel, cause)| {
                let channels = channels.clone();
                async move {
                    let done = channels
                        .resubscribe(&channel, ssubscribe, call_timeout)
                        .await;
                    (channel, cause, done)
                }
            })
            .buffer_unordered(RESUBSCRIBE_CONCURRENCY)
            .collect()
            .await;
        let mut failed = 0usize;
        let mut last_error = String::new();
        for (channel, cause, done) in results {
            match done {
                Resubscribed::Done { key } => {
                    metrics
                        .resubscriptions
                        .with_label_values(&[cause.label(), "ok"])
                        .inc();
                    tracing::info!(
                        key = %key,
                        cause = cause.label(),
                        "sharded subscription made again; the key's waiters re-check"
                    );
                    wake.released(&key);
                }
                Resubscribed::Gone => {}
                Resubscribed::Failed(e) => {
                    metrics
                        .resubscriptions
                        .with_label_values(&[cause.label(), "error"])
                        .inc();
                    failed += 1;
                    last_error = e;
                    pending.insert(channel, cause);
                }
            }
        }
        if failed > 0 {
            tracing::warn!(
                channels = failed,
                error = %last_error,
                retry_ms = pause.as_millis() as u64,
                "sharded re-subscription failed; waiters keep their fallback timers until it works"
            );
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(RETRY_MAX);
        }
    }
}
