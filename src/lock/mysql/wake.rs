//! The waiting side of the bells ([`super::bell`]): a sidecar waiting for
//! a key held by another sidecar blocks in `GET_LOCK(bell, …)` on a
//! connection of its own, and tells its queue when the bell is free.
//!
//! Wake connections are a bounded pool (`backend.mysql.wake_connections`):
//! one per key being waited for, not per waiter (the sidecar's own FIFO
//! queue wakes its waiters one by one). When none is free (or the one it
//! had failed) the watch polls: it wakes the key's queue to re-check every
//! second at most until a connection is free — the waiter's fallback timer
//! (the holder's remaining lease) alone would leave a released key unseen
//! for up to a whole TTL. A wait is cut into
//! one-second `GET_LOCK` calls, so a watch that is no longer wanted frees
//! its connection within a second.
//!
//! A watch lasts as long as its waiter waits, through several hand-overs:
//! after a wake-up it is *re-armed* only when a new acquire attempt reports
//! the key held under another sidecar's bell ([`Waker::rearm`]). Waiting
//! again at once would find the bell free (the new holder may not have
//! taken it yet) and wake the queue in a loop.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::Pool;

use crate::lock::WakeSink;
use crate::metrics::mysql::MySqlMetrics;

/// One `GET_LOCK` call waits at most this long.
const CHUNK_S: i64 = 1;
/// Bound on a call (chunk plus network).
const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a watch waits for a free wake connection before it polls.
const CONNECTION_WAIT: Duration = Duration::from_millis(200);
/// A watch without a connection wakes its queue to re-check after this
/// long, doubling up to [`POLL_MAX`]: a release is seen within about a
/// second, not at the holder's lease expiry.
const POLL_FIRST: Duration = Duration::from_millis(250);
const POLL_MAX: Duration = Duration::from_secs(1);

pub struct Waker {
    pool: Option<Pool>,
    sink: Arc<dyn WakeSink>,
    /// Keys with a wake task running, and how many guards want it.
    watching: Arc<Mutex<HashMap<String, Arc<Watch>>>>,
    metrics: Arc<MySqlMetrics>,
}

struct Watch {
    wanted: std::sync::atomic::AtomicUsize,
    done: AtomicBool,
    /// Wait for the bell again (a new holder was seen), or, with `wanted`
    /// at 0, stop.
    rearm: tokio::sync::Notify,
}

/// Keeps a key's wake task wanted while it lives.
pub struct Guard {
    key: String,
    watch: Arc<Watch>,
    watching: Arc<Mutex<HashMap<String, Arc<Watch>>>>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        if self.watch.wanted.fetch_sub(1, Ordering::AcqRel) == 1 {
            let mut w = self.watching.lock().expect("waker poisoned");
            if w.get(&self.key)
                .is_some_and(|x| Arc::ptr_eq(x, &self.watch))
            {
                w.remove(&self.key);
            }
            self.watch.rearm.notify_one();
        }
    }
}

impl Waker {
    /// `pool`: `None` when `wake_connections` is 0 (timers only).
    pub fn new(pool: Option<Pool>, sink: Arc<dyn WakeSink>, metrics: Arc<MySqlMetrics>) -> Waker {
        Waker {
            pool,
            sink,
            watching: Arc::new(Mutex::new(HashMap::new())),
            metrics,
        }
    }

    /// A new attempt found `key` held under another sidecar's bell: a
    /// watch that already woke its queue waits for the bell again.
    pub fn rearm(&self, key: &str) {
        let w = self.watching.lock().expect("waker poisoned");
        if let Some(watch) = w.get(key) {
            watch.rearm.notify_one();
        }
    }

    /// Waits (in the background) for `bell` to be free, then wakes `key`'s
    /// queue, again after each [`Waker::rearm`]. One task per key however
    /// many guards want it.
    pub fn watch(&self, key: &str, bell: String) -> Option<Guard> {
        let pool = self.pool.clone()?;
        let mut w = self.watching.lock().expect("waker poisoned");
        if let Some(existing) = w.get(key).filter(|x| !x.done.load(Ordering::Acquire)) {
            existing.wanted.fetch_add(1, Ordering::AcqRel);
            return Some(Guard {
                key: key.to_owned(),
                watch: existing.clone(),
                watching: self.watching.clone(),
            });
        }
        let watch = Arc::new(Watch {
            wanted: std::sync::atomic::AtomicUsize::new(1),
            done: AtomicBool::new(false),
            rearm: tokio::sync::Notify::new(),
        });
        w.insert(key.to_owned(), watch.clone());
        drop(w);
        tokio::spawn(wait_for_bell(
            pool,
            key.to_owned(),
            bell,
            watch.clone(),
            self.sink.clone(),
            self.metrics.clone(),
        ));
        Some(Guard {
            key: key.to_owned(),
            watch,
            watching: self.watching.clone(),
        })
    }
}

async fn wait_for_bell(
    pool: Pool,
    key: String,
    bell: String,
    watch: Arc<Watch>,
    sink: Arc<dyn WakeSink>,
    metrics: Arc<MySqlMetrics>,
) {
    let mut pause = POLL_FIRST;
    // Whether a release may have gone unseen: no connection was listening
    // to the bell for a while (none free, or the last one failed).
    let mut blind = false;
    while watch.wanted.load(Ordering::Acquire) > 0 {
        let conn = tokio::time::timeout(CONNECTION_WAIT, pool.get_conn()).await;
        let Ok(Ok(mut conn)) = conn else {
            // Every wake connection is busy (or the server is away). The
            // holder's lease expiry alone would leave a released key
            // unseen for up to its whole TTL, so the key's queue re-checks
            // now and then until a connection frees up.
            metrics
                .watch_results
                .with_label_values(&["no_connection"])
                .inc();
            if !blind {
                tracing::debug!(key = %key, "no wake connection: the key's waiters re-check every second until one is free");
            }
            blind = true;
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(POLL_MAX);
            if !recheck(&key, &watch, &*sink).await {
                break;
            }
            continue;
        };
        pause = POLL_FIRST;
        // A release may have come and gone while nobody listened.
        if std::mem::take(&mut blind) && !recheck(&key, &watch, &*sink).await {
            break;
        }
        let healthy = loop {
            let result = wait(&mut conn, &bell, &watch).await;
            metrics.watch_results.with_label_values(&[result]).inc();
            if result != "woken" {
                break result == "abandoned";
            }
            tracing::debug!(key = %key, "bell free: waking the key's queue");
            if !recheck(&key, &watch, &*sink).await {
                break true;
            }
        };
        if !healthy {
            // Closing the connection frees any name it might hold; the
            // watch goes on blind until another connection is had.
            let _ = tokio::time::timeout(CALL_TIMEOUT, conn.disconnect()).await;
            blind = true;
            tokio::time::sleep(pause).await;
            continue;
        }
        break;
    }
    watch.done.store(true, Ordering::Release);
}

/// Wakes `key`'s queue to re-check the key, then waits until an attempt
/// found it held under another sidecar's bell again ([`Waker::rearm`]) —
/// waiting for the bell at once would find it free before the new holder
/// takes it, and wake the queue in a loop. False when nobody wants the
/// watch any more.
async fn recheck(key: &str, watch: &Watch, sink: &dyn WakeSink) -> bool {
    sink.released(key);
    watch.rearm.notified().await;
    watch.wanted.load(Ordering::Acquire) > 0
}

/// Blocks in `GET_LOCK` until the bell is free ("woken"), the watch is no
/// longer wanted ("abandoned") or the connection fails ("failed").
async fn wait(conn: &mut mysql_async::Conn, bell: &str, watch: &Watch) -> &'static str {
    loop {
        if watch.wanted.load(Ordering::Acquire) == 0 {
            return "abandoned";
        }
        let r = tokio::time::timeout(
            CALL_TIMEOUT,
            conn.exec_first::<Option<i64>, _, _>("SELECT GET_LOCK(?, ?)", (bell, CHUNK_S)),
        )
        .await;
        match r {
            Ok(Ok(Some(Some(1)))) => {
                // Pass it on at once: the next waiting sidecar wakes.
                let passed = tokio::time::timeout(
                    CALL_TIMEOUT,
                    conn.exec_drop("DO RELEASE_LOCK(?)", (bell,)),
                )
                .await;
                return if matches!(passed, Ok(Ok(()))) {
                    "woken"
                } else {
                    "failed"
                };
            }
            Ok(Ok(Some(Some(0)))) => continue,
            _ => return "failed",
        }
    }
}
