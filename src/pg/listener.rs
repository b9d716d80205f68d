//! Notifications over LISTEN/NOTIFY, for the lock backend's wake-ups and the
//! gateway's cross-replica hand-overs.
//!
//! A dedicated connection (a pooled one would hide notifications from
//! whoever holds it next). Each watched key has its own channel,
//! `<prefix>_<16 hex of sha256(key)>`, LISTENed while something in this
//! process watches it ([`Channels`]). On reconnect every channel is LISTENed
//! again and every waiter re-checks, since notifications sent meanwhile are
//! lost. Every network call has a timeout and none is made while holding the
//! channel registry's lock.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, Client};

use super::Tls;
use crate::lock::channels::{ChannelWatch, Channels};
use crate::lock::WakeSink;

const JANITOR_INTERVAL: Duration = Duration::from_secs(10);
const PING_INTERVAL: Duration = Duration::from_secs(5);
/// Bound on one LISTEN, UNLISTEN or ping.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// The notification channel of a key (a safe identifier: hex only).
pub fn channel(prefix: &str, key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}_{hex}")
}

pub struct Listener {
    prefix: &'static str,
    channels: Channels<Arc<Client>>,
}

async fn listen(client: Arc<Client>, channel: String) -> Result<(), String> {
    client
        .batch_execute(&format!("LISTEN \"{channel}\""))
        .await
        .map_err(|e| e.to_string())
}

async fn unlisten(client: Arc<Client>, channel: String) -> Result<(), String> {
    client
        .batch_execute(&format!("UNLISTEN \"{channel}\""))
        .await
        .map_err(|e| e.to_string())
}

impl Listener {
    /// Starts the connection task. `prefix` names the channels (`fencer`
    /// for lock releases, `fencer_gw` for the gateway's fence rows).
    pub fn start(
        prefix: &'static str,
        config: tokio_postgres::Config,
        tls: Tls,
        wake: Arc<dyn WakeSink>,
    ) -> Listener {
        let channels = Channels::new();
        tokio::spawn(run(config, tls, wake, channels.clone()));
        Listener { prefix, channels }
    }

    /// LISTENs on `key`'s channel (when connected) before returning,
    /// waiting at most `timeout` for it.
    pub async fn watch(&self, key: &str, timeout: Duration) -> ChannelWatch<Arc<Client>> {
        self.channels
            .watch(
                channel(self.prefix, key),
                key,
                listen,
                timeout.min(CALL_TIMEOUT),
            )
            .await
    }

    pub fn channel(&self, key: &str) -> String {
        channel(self.prefix, key)
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
        let connect = tokio::time::timeout(CALL_TIMEOUT * 2, config.connect(tls.clone())).await;
        let (client, mut connection) = match connect {
            Ok(Ok(c)) => c,
            failed => {
                tracing::debug!(error = ?failed.map(|r| r.err()), "listener connect failed");
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
        if !channels
            .connected(client.clone(), listen, CALL_TIMEOUT)
            .await
        {
            driver.abort();
            channels.disconnected();
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
                    if let Some(key) = channels.key_of(&name) {
                        wake.released(&key);
                    }
                }
                _ = ping.tick() => {
                    // A silently dead connection would leave waiters deaf.
                    let alive = tokio::time::timeout(CALL_TIMEOUT, client.simple_query("SELECT 1")).await;
                    if !matches!(alive, Ok(Ok(_))) {
                        break;
                    }
                }
                _ = janitor.tick() => {
                    for key in channels.sweep_idle(unlisten, listen, CALL_TIMEOUT).await {
                        wake.released(&key);
                    }
                }
            }
        }
        driver.abort();
        channels.disconnected();
        tracing::warn!("LISTEN connection lost; reconnecting");
    }
}
