//! Release notifications from Redis pub/sub, shared by all waiters of a sidecar.
//!
//! One dedicated pub/sub connection per sidecar (a subscribed connection
//! cannot run other commands), with one reference-counted channel per
//! watched key ([`Channels`]). If the connection drops, messages may have
//! been published while we were away: on reconnect every watched channel is
//! re-subscribed and every queue is told to re-check
//! ([`WakeSink::resync`]). While disconnected, waiters keep working on
//! their fallback timers.
//!
//! In sentinel mode the connection follows the master: when the master
//! changes, the subscriber reconnects to the new one (a release runs there,
//! and a demoted master cut off from it would never relay the message).

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::PubSubSink;

use super::keys::RedisKeys;
use super::sentinel::SentinelMaster;
use crate::lock::channels::{ChannelWatch, Channels};
use crate::lock::WakeSink;

/// Where the pub/sub connection goes.
pub enum Source {
    Fixed(Box<redis::Client>),
    Master(Arc<SentinelMaster>),
}

impl Source {
    fn client(&self) -> Option<redis::Client> {
        match self {
            Source::Fixed(c) => Some((**c).clone()),
            Source::Master(m) => m.current().map(|m| m.client),
        }
    }

    /// Resolves when the master changes (never for a fixed server).
    async fn moved(&self, seen: &mut Option<tokio::sync::watch::Receiver<u64>>) {
        match seen {
            Some(rx) => {
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending::<()>().await,
        }
    }

    fn failovers(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        match self {
            Source::Fixed(_) => None,
            Source::Master(m) => Some(m.failovers()),
        }
    }
}

const PING_INTERVAL: Duration = Duration::from_secs(5);
const JANITOR_INTERVAL: Duration = Duration::from_secs(10);

pub struct Subscriber {
    channels: Channels<PubSubSink>,
    /// Bound on one SUBSCRIBE, UNSUBSCRIBE or PING.
    call_timeout: Duration,
}

async fn subscribe(mut sink: PubSubSink, channel: String) -> Result<(), String> {
    sink.subscribe(&channel).await.map_err(|e| e.to_string())
}

async fn unsubscribe(mut sink: PubSubSink, channel: String) -> Result<(), String> {
    sink.unsubscribe(&channel).await.map_err(|e| e.to_string())
}

impl Subscriber {
    pub fn start(
        source: Source,
        prefix: String,
        connect_timeout: Duration,
        wake: Arc<dyn WakeSink>,
    ) -> Subscriber {
        let channels = Channels::new();
        tokio::spawn(run(source, prefix, connect_timeout, wake, channels.clone()));
        Subscriber {
            channels,
            call_timeout: connect_timeout,
        }
    }

    /// Ensures `key`'s channel is subscribed (when connected) before
    /// returning, waiting at most `timeout` (and the call timeout) for it.
    pub async fn watch(
        &self,
        channel: String,
        key: &str,
        timeout: Duration,
    ) -> ChannelWatch<PubSubSink> {
        self.channels
            .watch(channel, key, subscribe, timeout.min(self.call_timeout))
            .await
    }
}

async fn run(
    source: Source,
    prefix: String,
    connect_timeout: Duration,
    wake: Arc<dyn WakeSink>,
    channels: Channels<PubSubSink>,
) {
    let mut backoff = Duration::from_millis(50);
    let mut failovers = source.failovers();
    loop {
        if let Some(rx) = &mut failovers {
            rx.mark_unchanged();
        }
        let Some(client) = source.client() else {
            // Sentinel mode before the first master is known.
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
            continue;
        };
        let pubsub = match tokio::time::timeout(connect_timeout, client.get_async_pubsub()).await {
            Ok(Ok(p)) => p,
            failed => {
                let error = failed.map_or_else(
                    |_| "timed out".to_owned(),
                    |r| r.err().map(|e| e.to_string()).unwrap_or_default(),
                );
                tracing::debug!(error, "pub/sub connect failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        let (mut sink, mut stream) = pubsub.split();
        if !channels
            .connected(sink.clone(), subscribe, connect_timeout)
            .await
        {
            channels.disconnected();
            continue;
        }
        tracing::info!("pub/sub connected");
        // Anything published while we were disconnected is lost.
        wake.resync();

        let mut ping = tokio::time::interval(PING_INTERVAL);
        ping.tick().await;
        let mut janitor = tokio::time::interval(JANITOR_INTERVAL);
        janitor.tick().await;
        loop {
            tokio::select! {
                msg = stream.next() => {
                    let Some(msg) = msg else { break };
                    if let Some(key) = RedisKeys::key_from_channel(&prefix, msg.get_channel_name()) {
                        wake.released(&key);
                    }
                }
                _ = ping.tick() => {
                    // A half-open TCP connection would otherwise leave us
                    // deaf to releases with no error.
                    let ok = tokio::time::timeout(connect_timeout, sink.ping::<redis::Value>()).await;
                    if !matches!(ok, Ok(Ok(_))) {
                        tracing::warn!("pub/sub ping failed; reconnecting");
                        break;
                    }
                }
                _ = source.moved(&mut failovers) => {
                    tracing::info!("redis master changed; moving the pub/sub connection");
                    break;
                }
                _ = janitor.tick() => {
                    for key in channels.sweep_idle(unsubscribe, subscribe, connect_timeout).await {
                        wake.released(&key);
                    }
                }
            }
        }
        channels.disconnected();
        tracing::warn!("pub/sub connection lost");
    }
}
