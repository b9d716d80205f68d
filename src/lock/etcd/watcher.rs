//! Release notifications for one key: a watch on its queue that wakes the
//! key's waiters here at every deletion under it — a holder's release or
//! expiry, a place that lapsed, a waiter that gave up. A waiter woken
//! tries again; the try finds whether it is first now.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::etcd::watch::Watch;
use crate::etcd::wire::EventType;
use crate::etcd::EtcdClient;
use crate::lock::{LockKey, WakeSink};

/// A watch that broke is opened again after this (each opening bounded
/// by it too).
const REOPEN_AFTER: Duration = Duration::from_millis(200);
const REOPEN_WITHIN: Duration = Duration::from_secs(2);

/// One key's watch, shared by every waiter of the key here (each holds
/// it in its `WatchGuard`); it ends when the last one lets go.
pub(super) struct Shared(tokio::task::AbortHandle);

impl Drop for Shared {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Watches `queue` from `start` (0: now), in effect when this returns —
/// unless opening it takes past `until`: then nothing is watched (`None`)
/// and the waiter relies on its fallback re-check.
pub(super) async fn start(
    client: Arc<EtcdClient>,
    queue: Vec<u8>,
    key: LockKey,
    start: i64,
    until: Instant,
    wake: Arc<dyn WakeSink>,
) -> Option<Arc<Shared>> {
    match client.watch_prefix(&queue, start, until).await {
        Ok(first) => {
            let task = tokio::spawn(follow(client, queue, key, first, start, wake));
            Some(Arc::new(Shared(task.abort_handle())))
        }
        Err(e) => {
            tracing::debug!(key = %key, error = %e, "etcd: watching the key's queue failed; the waiter re-checks on its timer");
            None
        }
    }
}

async fn follow(
    client: Arc<EtcdClient>,
    queue: Vec<u8>,
    key: LockKey,
    mut watch: Watch,
    start: i64,
    wake: Arc<dyn WakeSink>,
) {
    let mut next = start;
    loop {
        match watch.next().await {
            Ok(answer) if answer.canceled => {
                // Compacted past where it started: what it missed is
                // unknown, so the waiters try again, and it goes on from now.
                tracing::debug!(key = %key, reason = %answer.cancel_reason, "etcd: a queue watch was cancelled");
                wake.released(key.as_str());
                next = 0;
            }
            Ok(answer) => {
                if answer.header.revision > 0 {
                    next = answer.header.revision + 1;
                }
                if answer.events.iter().any(|e| e.kind == EventType::Delete) {
                    wake.released(key.as_str());
                }
                continue;
            }
            Err(e) => {
                tracing::debug!(key = %key, error = %e, "etcd: a queue watch broke; opening it again");
            }
        }
        loop {
            tokio::time::sleep(REOPEN_AFTER).await;
            match client
                .watch_prefix(&queue, next, Instant::now() + REOPEN_WITHIN)
                .await
            {
                Ok(w) => {
                    watch = w;
                    break;
                }
                Err(e) => {
                    tracing::debug!(key = %key, error = %e, "etcd: opening a queue watch again failed");
                }
            }
        }
    }
}
