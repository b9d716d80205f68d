//! Release notifications from Redis pub/sub, shared by all waiters of a sidecar.
//!
//! One dedicated pub/sub connection per sidecar (a subscribed connection
//! cannot run other commands). Channels are reference-counted by the
//! waiters that watch them, so N waiters on one key cost one subscription.
//! A channel whose last watcher left is unsubscribed lazily by a janitor, so
//! a hot key under contention is not subscribed and unsubscribed per request.
//!
//! If the connection drops, messages may have been published while we were
//! away: on reconnect every watched channel is re-subscribed and every queue
//! is told to re-check ([`WakeSink::resync`]). While disconnected, waiters
//! keep working on their fallback timers.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::PubSubSink;
use tokio::sync::Mutex;

use super::keys::RedisKeys;
use crate::lock::WakeSink;

const PING_INTERVAL: Duration = Duration::from_secs(5);
const JANITOR_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Channel {
    watchers: usize,
    subscribed: bool,
}

#[derive(Default)]
struct State {
    sink: Option<PubSubSink>,
    channels: HashMap<String, Channel>,
}

pub struct Subscriber {
    state: Arc<Mutex<State>>,
}

/// Drops a watcher's reference to its channel.
pub struct ChannelWatch {
    state: Arc<Mutex<State>>,
    channel: String,
}

impl Drop for ChannelWatch {
    fn drop(&mut self) {
        let state = self.state.clone();
        let channel = std::mem::take(&mut self.channel);
        // Decrement without blocking the dropping task; the janitor
        // unsubscribes later if nobody came back.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let mut st = state.lock().await;
                if let Some(ch) = st.channels.get_mut(&channel) {
                    ch.watchers = ch.watchers.saturating_sub(1);
                }
            });
        }
    }
}

impl Subscriber {
    pub fn start(
        client: redis::Client,
        prefix: String,
        connect_timeout: Duration,
        wake: Arc<dyn WakeSink>,
    ) -> Subscriber {
        let state = Arc::new(Mutex::new(State::default()));
        tokio::spawn(run(client, prefix, connect_timeout, wake, state.clone()));
        Subscriber { state }
    }

    /// Ensures `channel` is subscribed (when connected) before returning.
    pub async fn watch(&self, channel: String) -> ChannelWatch {
        let mut st = self.state.lock().await;
        let entry = st.channels.entry(channel.clone()).or_default();
        entry.watchers += 1;
        if !entry.subscribed {
            if let Some(sink) = st.sink.as_mut() {
                match sink.subscribe(&channel).await {
                    Ok(()) => {
                        if let Some(ch) = st.channels.get_mut(&channel) {
                            ch.subscribed = true;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "pub/sub subscribe failed; waiters fall back to re-checks");
                    }
                }
            }
        }
        ChannelWatch {
            state: self.state.clone(),
            channel,
        }
    }
}

async fn run(
    client: redis::Client,
    prefix: String,
    connect_timeout: Duration,
    wake: Arc<dyn WakeSink>,
    state: Arc<Mutex<State>>,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let connected = tokio::time::timeout(connect_timeout, client.get_async_pubsub()).await;
        let pubsub = match connected {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "pub/sub connect failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
            Err(_) => {
                tracing::debug!("pub/sub connect timed out");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        let (mut sink, mut stream) = pubsub.split();
        {
            let mut st = state.lock().await;
            let mut ok = true;
            let names: Vec<String> = st
                .channels
                .iter()
                .filter(|(_, c)| c.watchers > 0)
                .map(|(n, _)| n.clone())
                .collect();
            for ch in st.channels.values_mut() {
                ch.subscribed = false;
            }
            if !names.is_empty() {
                ok = sink.subscribe(&names).await.is_ok();
                if ok {
                    for n in &names {
                        if let Some(ch) = st.channels.get_mut(n) {
                            ch.subscribed = true;
                        }
                    }
                }
            }
            if !ok {
                continue;
            }
            st.sink = Some(sink.clone());
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
                _ = janitor.tick() => {
                    let mut st = state.lock().await;
                    let idle: Vec<String> = st
                        .channels
                        .iter()
                        .filter(|(_, c)| c.watchers == 0)
                        .map(|(n, _)| n.clone())
                        .collect();
                    for n in idle {
                        st.channels.remove(&n);
                        let _ = sink.unsubscribe(&n).await;
                    }
                }
            }
        }
        state.lock().await.sink = None;
        tracing::warn!("pub/sub connection lost");
    }
}
