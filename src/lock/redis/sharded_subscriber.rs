//! Release notifications in cluster mode: sharded pub/sub.
//!
//! A release `SPUBLISH`es on its lock's channel, which shares the lock's
//! hash tag, so the message stays on that shard instead of being broadcast
//! over the whole cluster bus. The cluster connection (RESP3) sends each
//! `SSUBSCRIBE` to the shard that owns the channel and subscribes again
//! after a reconnect; messages arrive as pushes. Whatever was published
//! while a shard connection was down, or while a shard failed over, is
//! lost, so a disconnection push or a slot-map change makes every queue
//! re-check ([`WakeSink::resync`]).

use std::sync::Arc;
use std::time::Duration;

use redis::cluster_async::ClusterConnection;
use redis::{PushInfo, PushKind};
use tokio::sync::mpsc;

use super::cluster::ClusterTopology;
use super::keys::RedisKeys;
use crate::lock::channels::{ChannelWatch, Channels};
use crate::lock::WakeSink;

const JANITOR_INTERVAL: Duration = Duration::from_secs(10);

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
    ) -> ShardedSubscriber {
        let channels = Channels::new();
        tokio::spawn(run(
            topology,
            pushes,
            prefix,
            call_timeout,
            wake,
            channels.clone(),
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
) {
    let conn = loop {
        if let Some(conn) = topology.conn() {
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
                    PushKind::Disconnection => {
                        tracing::warn!("a cluster node connection dropped; waiters re-check");
                        wake.resync();
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
