//! Release notifications over LISTEN/NOTIFY.
//!
//! A dedicated connection (a pooled one would hide notifications from
//! whoever holds it next). Each watched key has its own channel,
//! `fencer_<16 hex of sha256(key)>`, LISTENed while a waiter of this sidecar
//! watches it ([`Channels`]). On reconnect every channel is LISTENed again
//! and every queue re-checks, since notifications sent meanwhile are lost.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, Client};

use crate::lock::channels::{ChannelWatch, Channels};
use crate::lock::WakeSink;
use crate::pg::Tls;

const JANITOR_INTERVAL: Duration = Duration::from_secs(10);
const PING_INTERVAL: Duration = Duration::from_secs(5);

/// The notification channel of a key (a safe identifier: hex only).
pub fn channel(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("fencer_{hex}")
}

pub struct Listener {
    channels: Channels<Arc<Client>>,
}

async fn listen(client: Arc<Client>, channel: String) -> Result<(), String> {
    client
        .batch_execute(&format!("LISTEN \"{channel}\""))
        .await
        .map_err(|e| e.to_string())
}

impl Listener {
    pub fn start(config: tokio_postgres::Config, tls: Tls, wake: Arc<dyn WakeSink>) -> Listener {
        let channels = Channels::new();
        tokio::spawn(run(config, tls, wake, channels.clone()));
        Listener { channels }
    }

    /// LISTENs on `key`'s channel (when connected) before returning.
    pub async fn watch(&self, key: &str) -> ChannelWatch<Arc<Client>> {
        self.channels.watch(channel(key), key, listen).await
    }
}

async fn run(
    config: tokio_postgres::Config,
    tls: Tls,
    wake: Arc<dyn WakeSink>,
    channels: Channels<Arc<Client>>,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let (client, mut connection) = match config.connect(tls.clone()).await {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "listener connect failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        let (tx, mut rx) = mpsc::unbounded_channel::<String>();
        let driver = tokio::spawn(async move {
            let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(msg) = messages.next().await {
                match msg {
                    Ok(AsyncMessage::Notification(n)) => {
                        let _ = tx.send(n.channel().to_owned());
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "listener connection failed");
                        break;
                    }
                }
            }
        });
        let client = Arc::new(client);
        if !channels.connected(client.clone(), listen).await {
            driver.abort();
            continue;
        }
        tracing::info!("LISTEN connection established");
        wake.resync();

        let mut janitor = tokio::time::interval(JANITOR_INTERVAL);
        janitor.tick().await;
        let mut ping = tokio::time::interval(PING_INTERVAL);
        ping.tick().await;
        loop {
            tokio::select! {
                msg = rx.recv() => {
                    let Some(name) = msg else { break };
                    if let Some(key) = channels.key_of(&name).await {
                        wake.released(&key);
                    }
                }
                _ = ping.tick() => {
                    // A silently dead connection would leave waiters deaf.
                    let alive = tokio::time::timeout(Duration::from_secs(5), client.simple_query("SELECT 1")).await;
                    if !matches!(alive, Ok(Ok(_))) {
                        break;
                    }
                }
                _ = janitor.tick() => {
                    for name in channels.take_idle().await {
                        let _ = client.batch_execute(&format!("UNLISTEN \"{name}\"")).await;
                    }
                }
            }
        }
        driver.abort();
        channels.disconnected().await;
        tracing::warn!("LISTEN connection lost; reconnecting");
    }
}
