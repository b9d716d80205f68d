//! The waiting side of the bells ([`super::bell`]): a sidecar waiting for
//! a key held by another sidecar blocks in `GET_LOCK(bell, …)` on a
//! connection of its own, and tells its queue when the bell is free.
//!
//! Wake connections are a bounded pool (`backend.mysql.wake_connections`):
//! one per key being waited for, not per waiter (the sidecar's own FIFO
//! queue wakes its waiters one by one). When none is free the waiter relies
//! on its fallback timer (the lease's remaining time). A wait is cut into
//! one-second `GET_LOCK` calls, so a watch that is no longer wanted frees
//! its connection within a second.

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

    /// Waits (in the background) for `bell` to be free, then wakes `key`'s
    /// queue. One task per key however many guards want it.
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
    let result = wait(&pool, &bell, &watch).await;
    watch.done.store(true, Ordering::Release);
    metrics.watch_results.with_label_values(&[result]).inc();
    if result == "woken" {
        tracing::debug!(key = %key, "bell free: waking the key's queue");
        sink.released(&key);
    }
}

async fn wait(pool: &Pool, bell: &str, watch: &Watch) -> &'static str {
    // A free wake connection, or none within a short bound: the waiter's
    // fallback timer covers it.
    let conn = tokio::time::timeout(Duration::from_millis(200), pool.get_conn()).await;
    let Ok(Ok(mut conn)) = conn else {
        return "no_connection";
    };
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
                if !matches!(passed, Ok(Ok(()))) {
                    // Closing the connection frees the name.
                    let _ = conn.disconnect().await;
                }
                return "woken";
            }
            Ok(Ok(Some(Some(0)))) => continue,
            _ => {
                let _ = tokio::time::timeout(CALL_TIMEOUT, conn.disconnect()).await;
                return "failed";
            }
        }
    }
}
