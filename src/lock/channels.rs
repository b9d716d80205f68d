//! Reference-counted notification channels, shared by the Redis pub/sub
//! subscriber, the PostgreSQL LISTEN connection of the lock backend and the
//! gateway's fence store.
//!
//! Each watched key has one channel per process, however many waiters watch
//! it. A channel whose last watcher left stays subscribed until the next
//! [`Channels::sweep_idle`] (a janitor tick, every 10 s), so a hot key is not
//! subscribed and unsubscribed per request. `C` is the connection handle
//! used to subscribe (a pub/sub sink, a client).
//!
//! Two rules keep waiters from going deaf or hanging (issue 9 item 5, issue
//! 10 item 7):
//! - the registry's mutex is never held across a network call, and every
//!   subscribe and unsubscribe has a timeout, so a half-open connection
//!   delays one waiter by at most that timeout and never blocks the
//!   reconnect;
//! - an unsubscribe by the janitor can race a new watcher's subscribe of
//!   the same channel (the server may apply the new SUBSCRIBE first, then
//!   the UNSUBSCRIBE). After unsubscribing, the janitor therefore
//!   subscribes again every channel that was watched anew meanwhile, and
//!   wakes those keys' waiters to re-check what they may have missed.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::OnceCell;

struct Entry {
    key: String,
    watchers: usize,
    /// Set once the channel is subscribed on the current connection.
    ready: Arc<OnceCell<()>>,
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

/// What [`Channels::resubscribe`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Resubscribed {
    /// Subscribed again: wake `key`'s waiters to re-check.
    Done { key: String },
    /// Nobody watches the channel any more (or no connection): nothing to do.
    Gone,
    /// The subscribe failed; try again later.
    Failed(String),
}

/// One watcher's reference to a channel; dropping it releases the reference.
pub struct ChannelWatch<C: Send + 'static> {
    channels: Channels<C>,
    channel: String,
}

impl<C: Send + 'static> Drop for ChannelWatch<C> {
    fn drop(&mut self) {
        let mut inner = self.channels.lock();
        if let Some(e) = inner.entries.get_mut(&self.channel) {
            e.watchers = e.watchers.saturating_sub(1);
        }
    }
}

fn fresh() -> Arc<OnceCell<()>> {
    Arc::new(OnceCell::new())
}

impl<C> Channels<C> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<C>> {
        self.inner.lock().expect("channel registry poisoned")
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

    /// Adds a watcher to `channel` (for `key`) and, when connected, makes
    /// sure it is subscribed before returning — so a notification sent
    /// after this returns is received. Waits at most `timeout` for the
    /// subscription; after that the watcher relies on its fallback timer.
    pub async fn watch<F, Fut>(
        &self,
        channel: String,
        key: &str,
        subscribe: F,
        timeout: Duration,
    ) -> ChannelWatch<C>
    where
        F: FnOnce(C, String) -> Fut,
        Fut: Future<Output = Result<(), String>>,
    {
        let (conn, ready) = {
            let mut inner = self.lock();
            let conn = inner.conn.clone();
            let entry = inner
                .entries
                .entry(channel.clone())
                .or_insert_with(|| Entry {
                    key: key.to_owned(),
                    watchers: 0,
                    ready: fresh(),
                });
            entry.watchers += 1;
            (conn, entry.ready.clone())
        };
        // Counted before the first await: a watch() dropped mid-way still
        // gives its reference back.
        let watch = ChannelWatch {
            channels: self.clone(),
            channel: channel.clone(),
        };
        let timeout = if crate::mutants::active("subscribe_without_timeout") {
            Duration::from_secs(86_400)
        } else {
            timeout
        };
        if let Some(conn) = conn {
            let subscribed =
                tokio::time::timeout(timeout, ready.get_or_try_init(|| subscribe(conn, channel)))
                    .await;
            match subscribed {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "subscribe failed; waiters fall back to re-checks")
                }
                Err(_) => tracing::warn!(
                    timeout_ms = timeout.as_millis() as u64,
                    "subscribe timed out; waiters fall back to re-checks"
                ),
            }
        }
        watch
    }

    /// A new connection: makes it current, then subscribes every watched
    /// channel on it. Returns false if a subscription failed (the caller
    /// reconnects).
    pub async fn connected<F, Fut>(&self, conn: C, subscribe: F, timeout: Duration) -> bool
    where
        F: Fn(C, String) -> Fut,
        Fut: Future<Output = Result<(), String>>,
    {
        let watched: Vec<(String, Arc<OnceCell<()>>)> = {
            let mut inner = self.lock();
            inner.conn = Some(conn.clone());
            inner
                .entries
                .iter_mut()
                .filter_map(|(name, e)| {
                    e.ready = fresh();
                    (e.watchers > 0).then(|| (name.clone(), e.ready.clone()))
                })
                .collect()
        };
        for (name, ready) in watched {
            let ok = tokio::time::timeout(
                timeout,
                ready.get_or_try_init(|| subscribe(conn.clone(), name)),
            )
            .await;
            if !matches!(ok, Ok(Ok(_))) {
                return false;
            }
        }
        true
    }

    pub fn disconnected(&self) {
        let mut inner = self.lock();
        inner.conn = None;
        for e in inner.entries.values_mut() {
            e.ready = fresh();
        }
    }

    /// The server dropped `channel`'s subscription on its own (a Redis
    /// Cluster slot moved away: `sunsubscribe`): it is no longer ready, so
    /// a new watcher subscribes it again. Returns its key when somebody
    /// watches it (the caller re-subscribes, then wakes the key's waiters:
    /// a release in between was not heard); `None` for a channel nobody
    /// watches or that is not registered (our own janitor's unsubscribe).
    pub fn unsubscribed(&self, channel: &str) -> Option<String> {
        let mut inner = self.lock();
        let e = inner.entries.get_mut(channel)?;
        e.ready = fresh();
        (e.watchers > 0).then(|| e.key.clone())
    }

    /// The connection may have lost subscriptions (a cluster node's link
    /// dropped) while it stays the current one: every channel is marked
    /// not ready; returns the watched channels, to subscribe again.
    pub fn unsubscribed_all(&self) -> Vec<String> {
        let mut inner = self.lock();
        inner
            .entries
            .iter_mut()
            .filter_map(|(name, e)| {
                e.ready = fresh();
                (e.watchers > 0).then(|| name.clone())
            })
            .collect()
    }

    /// Subscribes `channel` again after [`Channels::unsubscribed`] (or
    /// `unsubscribed_all`), within `timeout`. [`Resubscribed::Gone`] when
    /// nobody watches it any more or there is no connection (a reconnect
    /// subscribes every watched channel anyway).
    pub async fn resubscribe<F, Fut>(
        &self,
        channel: &str,
        subscribe: F,
        timeout: Duration,
    ) -> Resubscribed
    where
        F: FnOnce(C, String) -> Fut,
        Fut: Future<Output = Result<(), String>>,
    {
        let (conn, ready, key) = {
            let inner = self.lock();
            let Some(e) = inner.entries.get(channel).filter(|e| e.watchers > 0) else {
                return Resubscribed::Gone;
            };
            let Some(conn) = inner.conn.clone() else {
                return Resubscribed::Gone;
            };
            (conn, e.ready.clone(), e.key.clone())
        };
        let subscribed = tokio::time::timeout(
            timeout,
            ready.get_or_try_init(|| subscribe(conn, channel.to_owned())),
        )
        .await;
        match subscribed {
            Ok(Ok(_)) => Resubscribed::Done { key },
            Ok(Err(e)) => Resubscribed::Failed(e),
            Err(_) => Resubscribed::Failed(format!("timed out after {} ms", timeout.as_millis())),
        }
    }

    /// The key a notification on `channel` is about.
    pub fn key_of(&self, channel: &str) -> Option<String> {
        self.lock().entries.get(channel).map(|e| e.key.clone())
    }

    /// The janitor: forgets channels nobody watches and unsubscribes them,
    /// then re-subscribes any of those that a new watcher took up meanwhile
    /// (see the module comment). Returns the keys whose waiters must
    /// re-check, because a notification may have been missed.
    pub async fn sweep_idle<U, UF, S, SF>(
        &self,
        unsubscribe: U,
        subscribe: S,
        timeout: Duration,
    ) -> Vec<String>
    where
        U: Fn(C, String) -> UF,
        UF: Future<Output = Result<(), String>>,
        S: Fn(C, String) -> SF,
        SF: Future<Output = Result<(), String>>,
    {
        let (conn, idle) = {
            let mut inner = self.lock();
            let idle: Vec<String> = inner
                .entries
                .iter()
                .filter(|(_, e)| e.watchers == 0)
                .map(|(n, _)| n.clone())
                .collect();
            for name in &idle {
                inner.entries.remove(name);
            }
            (inner.conn.clone(), idle)
        };
        let Some(conn) = conn else { return Vec::new() };
        for name in &idle {
            let _ = tokio::time::timeout(timeout, unsubscribe(conn.clone(), name.clone())).await;
        }
        let retaken: Vec<(String, String, Arc<OnceCell<()>>)> = {
            let mut inner = self.lock();
            idle.iter()
                .filter_map(|name| {
                    let e = inner.entries.get_mut(name)?;
                    e.ready = fresh();
                    Some((name.clone(), e.key.clone(), e.ready.clone()))
                })
                .collect()
        };
        let mut recheck = Vec::with_capacity(retaken.len());
        for (name, key, ready) in retaken {
            let _ = tokio::time::timeout(
                timeout,
                ready.get_or_try_init(|| subscribe(conn.clone(), name)),
            )
            .await;
            recheck.push(key);
        }
        recheck
    }

    /// Channels currently registered (watched or lingering).
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<C: Clone + Send + 'static> Default for Channels<C> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A "connection" that records the order of (un)subscribe calls.
    #[derive(Clone, Default)]
    struct Log(Arc<Mutex<Vec<String>>>);

    impl Log {
        fn push(&self, s: String) {
            self.0.lock().unwrap().push(s);
        }
        fn all(&self) -> Vec<String> {
            self.0.lock().unwrap().clone()
        }
    }

    async fn sub(c: Log, ch: String) -> Result<(), String> {
        c.push(format!("sub {ch}"));
        Ok(())
    }

    async fn unsub(c: Log, ch: String) -> Result<(), String> {
        c.push(format!("unsub {ch}"));
        Ok(())
    }

    const T: Duration = Duration::from_millis(200);

    #[tokio::test]
    async fn a_hanging_subscribe_is_bounded_and_does_not_block_others() {
        let chans: Channels<Log> = Channels::new();
        chans.connected(Log::default(), sub, T).await;
        let started = tokio::time::Instant::now();
        let hang = |_c: Log, _ch: String| std::future::pending::<Result<(), String>>();
        let _w = chans.watch("a".into(), "a", hang, T).await;
        assert!(started.elapsed() < Duration::from_secs(1));
        // The registry is free: another channel subscribes at once, and a
        // reconnect goes through.
        let _v = chans.watch("b".into(), "b", sub, T).await;
        assert!(chans.connected(Log::default(), sub, T).await);
    }

    #[tokio::test]
    async fn one_subscribe_per_channel_and_watchers_counted() {
        let log = Log::default();
        let chans: Channels<Log> = Channels::new();
        chans.connected(log.clone(), sub, T).await;
        let calls = Arc::new(AtomicUsize::new(0));
        let mut ws = Vec::new();
        for _ in 0..3 {
            let calls = calls.clone();
            ws.push(
                chans
                    .watch(
                        "k".into(),
                        "k",
                        move |c, ch| {
                            calls.fetch_add(1, Ordering::SeqCst);
                            sub(c, ch)
                        },
                        T,
                    )
                    .await,
            );
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        drop(ws);
        let recheck = chans.sweep_idle(unsub, sub, T).await;
        assert!(recheck.is_empty());
        assert_eq!(log.all(), vec!["sub k", "unsub k"]);
        assert!(chans.is_empty());
    }

    #[tokio::test]
    async fn a_channel_the_server_dropped_is_subscribed_again_while_watched() {
        let log = Log::default();
        let chans: Channels<Log> = Channels::new();
        chans.connected(log.clone(), sub, T).await;
        let w = chans.watch("k".into(), "key-k", sub, T).await;
        drop(chans.watch("idle".into(), "key-idle", sub, T).await);
        // Not registered (our own janitor's unsubscribe) or not watched:
        // nothing to re-subscribe.
        assert_eq!(chans.unsubscribed("other"), None);
        assert_eq!(chans.unsubscribed("idle"), None);
        assert_eq!(chans.unsubscribed("k"), Some("key-k".to_owned()));
        assert_eq!(
            chans.resubscribe("k", sub, T).await,
            Resubscribed::Done {
                key: "key-k".to_owned()
            }
        );
        let fail = |_c: Log, _ch: String| async { Err::<(), _>("MOVED".to_owned()) };
        assert_eq!(chans.unsubscribed_all(), vec!["k".to_owned()]);
        assert_eq!(
            chans.resubscribe("k", fail, T).await,
            Resubscribed::Failed("MOVED".to_owned())
        );
        // A failed try leaves it unsubscribed: the next one subscribes.
        assert!(matches!(
            chans.resubscribe("k", sub, T).await,
            Resubscribed::Done { .. }
        ));
        drop(w);
        assert_eq!(chans.resubscribe("k", sub, T).await, Resubscribed::Gone);
        assert_eq!(log.all(), vec!["sub k", "sub idle", "sub k", "sub k"]);
    }

    #[tokio::test]
    async fn a_channel_taken_up_during_the_sweep_is_subscribed_again() {
        let log = Log::default();
        let chans: Channels<Log> = Channels::new();
        chans.connected(log.clone(), sub, T).await;
        drop(chans.watch("k".into(), "key-k", sub, T).await);
        // The janitor's unsubscribe is slow; a new watcher arrives meanwhile
        // and subscribes before the unsubscribe lands.
        let c2 = chans.clone();
        let slow_unsub = move |c: Log, ch: String| {
            let c2 = c2.clone();
            async move {
                let w = c2.watch(ch.clone(), "key-k", sub, T).await;
                std::mem::forget(w);
                c.push(format!("unsub {ch}"));
                Ok(())
            }
        };
        let recheck = chans.sweep_idle(slow_unsub, sub, T).await;
        assert_eq!(recheck, vec!["key-k".to_owned()]);
        assert_eq!(log.all(), vec!["sub k", "sub k", "unsub k", "sub k"]);
    }
}
