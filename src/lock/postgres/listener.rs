//! Release notifications over LISTEN/NOTIFY.
//!
//! A dedicated connection (a pooled one would hide notifications from
//! whoever holds it next). Each watched key has its own channel,
//! `fencer_<16 hex of sha256(key)>`, LISTENed while a waiter of this sidecar
//! watches it (reference-counted, unlistened lazily). On reconnect every
//! channel is LISTENed again and every queue re-checks, since notifications
//! sent meanwhile are lost.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, Mutex};
use tokio_postgres::{AsyncMessage, Client};

use crate::pg::Tls;

use crate::lock::WakeSink;

const JANITOR_INTERVAL: Duration = Duration::from_secs(10);
const PING_INTERVAL: Duration = Duration::from_secs(5);

/// The notification channel of a key (a safe identifier: hex only).
pub fn channel(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("fencer_{hex}")
}

#[derive(Default)]
struct Channel {
    key: String,
    watchers: usize,
    listening: bool,
}

#[derive(Default)]
struct State {
    client: Option<Arc<Client>>,
    channels: HashMap<String, Channel>,
}

pub struct Listener {
    state: Arc<Mutex<State>>,
}

pub struct ChannelWatch {
    state: Arc<Mutex<State>>,
    channel: String,
}

impl Drop for ChannelWatch {
    fn drop(&mut self) {
        let state = self.state.clone();
        let channel = std::mem::take(&mut self.channel);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                if let Some(ch) = state.lock().await.channels.get_mut(&channel) {
                    ch.watchers = ch.watchers.saturating_sub(1);
                }
            });
        }
    }
}

async fn listen(client: &Client, channel: &str) -> Result<(), tokio_postgres::Error> {
    client.batch_execute(&format!("LISTEN \"{channel}\"")).await
}

impl Listener {
    pub fn start(config: tokio_postgres::Config, tls: Tls, wake: Arc<dyn WakeSink>) -> Listener {
        let state = Arc::new(Mutex::new(State::default()));
        tokio::spawn(run(config, tls, wake, state.clone()));
        Listener { state }
    }

    /// LISTENs on `key`'s channel (when connected) before returning.
    pub async fn watch(&self, key: &str) -> ChannelWatch {
        let name = channel(key);
        let mut st = self.state.lock().await;
        let client = st.client.clone();
        let entry = st.channels.entry(name.clone()).or_default();
        entry.key = key.to_owned();
        entry.watchers += 1;
        if !entry.listening {
            if let Some(client) = client {
                match listen(&client, &name).await {
                    Ok(()) => entry.listening = true,
                    Err(e) => {
                        tracing::warn!(error = %e, "LISTEN failed; waiters fall back to re-checks")
                    }
                }
            }
        }
        ChannelWatch {
            state: self.state.clone(),
            channel: name,
        }
    }
}

async fn run(
    config: tokio_postgres::Config,
    tls: Tls,
    wake: Arc<dyn WakeSink>,
    state: Arc<Mutex<State>>,
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
        {
            let mut st = state.lock().await;
            let mut ok = true;
            for (name, ch) in st.channels.iter_mut() {
                ch.listening = false;
                if ch.watchers > 0 {
                    ok = listen(&client, name).await.is_ok();
                    ch.listening = ok;
                    if !ok {
                        break;
                    }
                }
            }
            if !ok {
                driver.abort();
                continue;
            }
            st.client = Some(client.clone());
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
                    let key = state.lock().await.channels.get(&name).map(|c| c.key.clone());
                    if let Some(key) = key {
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
                    let mut st = state.lock().await;
                    let idle: Vec<String> = st
                        .channels
                        .iter()
                        .filter(|(_, c)| c.watchers == 0)
                        .map(|(n, _)| n.clone())
                        .collect();
                    for name in idle {
                        st.channels.remove(&name);
                        let _ = client.batch_execute(&format!("UNLISTEN \"{name}\"")).await;
                    }
                }
            }
        }
        driver.abort();
        state.lock().await.client = None;
        tracing::warn!("LISTEN connection lost; reconnecting");
    }
}
