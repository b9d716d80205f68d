//! Reference-counted notification channels, shared by the Redis pub/sub
//! subscriber and the PostgreSQL LISTEN connection.
//!
//! Each watched key has one channel per sidecar, however many waiters watch
//! it. A channel whose last watcher left stays subscribed until the next
//! [`Channels::take_idle`] (a janitor tick), so a hot key is not subscribed
//! and unsubscribed per request. `C` is the connection handle used to
//! subscribe (a pub/sub sink, a client).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use tokio::sync::Mutex;

struct Entry {
    key: String,
    watchers: usize,
    subscribed: bool,
}

struct Inner<C> {
    conn: Option<C>,
    entries: HashMap<String, Entry>,
}

pub struct Channels<C> {
    inner: Arc<Mutex<Inner<C>>>,
}

impl<C> Clone for Channels<C> {
    fn clone(&self) -> Self {
        Channels {
            inner: self.inner.clone(),
        }
    }
}

/// One watcher's reference to a channel; dropping it releases the reference.
pub struct ChannelWatch<C: Send + 'static> {
    channels: Channels<C>,
    channel: String,
}

impl<C: Send + 'static> Drop for ChannelWatch<C> {
    fn drop(&mut self) {
        let inner = self.channels.inner.clone();
        let channel = std::mem::take(&mut self.channel);
        // Decrement without blocking the dropping task.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                if let Some(e) = inner.lock().await.entries.get_mut(&channel) {
                    e.watchers = e.watchers.saturating_sub(1);
                }
            });
        }
    }
}

impl<C: Clone + Send + 'static> Channels<C> {
    pub fn new() -> Channels<C> {
        Channels {
            inner: Arc::new(Mutex::new(Inner {
                conn: None,
                entries: HashMap::new(),
            })),
        }
    }

    /// Adds a watcher to `channel` (for `key`) and, when connected and not
    /// yet subscribed, subscribes before returning — so a notification sent
    /// after this returns is received.
    pub async fn watch<F, Fut>(&self, channel: String, key: &str, subscribe: F) -> ChannelWatch<C>
    where
        F: FnOnce(C, String) -> Fut,
        Fut: Future<Output = Result<(), String>>,
    {
        let mut inner = self.inner.lock().await;
        let conn = inner.conn.clone();
        let entry = inner
            .entries
            .entry(channel.clone())
            .or_insert_with(|| Entry {
                key: key.to_owned(),
                watchers: 0,
                subscribed: false,
            });
        entry.watchers += 1;
        if !entry.subscribed {
            if let Some(conn) = conn {
                match subscribe(conn, channel.clone()).await {
                    Ok(()) => entry.subscribed = true,
                    Err(e) => {
                        tracing::warn!(error = %e, "subscribe failed; waiters fall back to re-checks")
                    }
                }
            }
        }
        ChannelWatch {
            channels: self.clone(),
            channel,
        }
    }

    /// A new connection: re-subscribes every watched channel, then makes
    /// the connection current. Returns false if re-subscribing failed.
    pub async fn connected<F, Fut>(&self, conn: C, subscribe: F) -> bool
    where
        F: Fn(C, String) -> Fut,
        Fut: Future<Output = Result<(), String>>,
    {
        let mut inner = self.inner.lock().await;
        for (name, entry) in inner.entries.iter_mut() {
            entry.subscribed = false;
            if entry.watchers > 0 {
                if subscribe(conn.clone(), name.clone()).await.is_err() {
                    return false;
                }
                entry.subscribed = true;
            }
        }
        inner.conn = Some(conn);
        true
    }

    pub async fn disconnected(&self) {
        self.inner.lock().await.conn = None;
    }

    /// The key a notification on `channel` is about.
    pub async fn key_of(&self, channel: &str) -> Option<String> {
        self.inner
            .lock()
            .await
            .entries
            .get(channel)
            .map(|e| e.key.clone())
    }

    /// Forgets channels nobody watches and returns them, to unsubscribe.
    pub async fn take_idle(&self) -> Vec<String> {
        let mut inner = self.inner.lock().await;
        let idle: Vec<String> = inner
            .entries
            .iter()
            .filter(|(_, e)| e.watchers == 0)
            .map(|(n, _)| n.clone())
            .collect();
        for name in &idle {
            inner.entries.remove(name);
        }
        idle
    }
}

impl<C: Clone + Send + 'static> Default for Channels<C> {
    fn default() -> Self {
        Self::new()
    }
}
