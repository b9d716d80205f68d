//! The work a live sidecar does on its places between calls, every
//! [`EVERY`]:
//! - a holder whose TTL passed without a renewal is ended on time: its
//!   place deleted, or — with a lock-delay — marked expired, and deleted
//!   when the delay ends (the place's etcd lease would end it too, but
//!   only after whole seconds, and it is kept for the delay);
//! - a waiting place's etcd lease is kept alive every third of its TTL;
//! - a waiter's place whose deletion failed is deleted.
//!
//! Each action runs as a task of its own holding its key's slot, so an
//! unanswered call delays no other key; a slot busy with a call is looked
//! at on the next sweep.

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::Instant;

use super::{lease_gone, Inner, Op, Slot, State};

/// How often places are looked at. A lease is ended at most this late
/// (later is the safe side: the key stays closed a little longer).
const EVERY: Duration = Duration::from_millis(50);

pub(super) fn spawn(inner: Weak<Inner>) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(EVERY).await;
            let Some(inner) = inner.upgrade() else { return };
            sweep(&inner);
        }
    });
}

fn sweep(inner: &Arc<Inner>) {
    let now = Instant::now();
    let slots: Vec<Slot> = inner
        .slots
        .lock()
        .expect("slots")
        .values()
        .cloned()
        .collect();
    let mut waiting = 0;
    for slot in slots {
        let Ok(e) = slot.0.entry.clone().try_lock_owned() else {
            continue;
        };
        let due = match e.state {
            State::Held { expires, .. } => expires <= now,
            State::Expired { until } => until <= now,
            State::Waiting => {
                let kept = e.created.is_some() && e.etcd_lease.is_some();
                waiting += usize::from(kept);
                kept && now >= e.kept_at + e.etcd_lease.map_or(Duration::ZERO, |(_, g)| g / 3)
            }
        };
        if due {
            let inner = inner.clone();
            tokio::spawn(async move { act(&inner, slot, e).await });
        }
    }
    inner.metrics.queue_places.set(waiting as i64);
    let doomed: Vec<_> = std::mem::take(&mut *inner.doomed.lock().expect("doomed"));
    if !doomed.is_empty() {
        let inner = inner.clone();
        tokio::spawn(async move {
            for d in doomed {
                let deadline = Instant::now() + inner.timeout;
                let done = match d.created {
                    Some(created) => inner
                        .client
                        .txn(
                            &[crate::etcd::wire::Compare::created(&d.place, created)],
                            &[Op::Delete {
                                key: d.place.clone(),
                            }],
                            &[],
                            deadline,
                            crate::etcd::Retry::Idempotent,
                        )
                        .await
                        .map(drop),
                    None => inner.client.delete(&d.place, deadline).await.map(drop),
                };
                if done.is_err() && Instant::now() < d.until {
                    inner.event("cleanup_retry");
                    inner.doomed.lock().expect("doomed").push(d);
                }
            }
        });
    }
}

async fn act(inner: &Inner, slot: Slot, mut e: tokio::sync::OwnedMutexGuard<super::Entry>) {
    if e.gone {
        return;
    }
    let deadline = Instant::now() + inner.timeout;
    match e.state {
        State::Held { expires, .. } if !inner.lock_delay.is_zero() => {
            let (etcd_lease, _) = e.etcd_lease.unwrap_or((0, Duration::ZERO));
            let mut value = e.value.clone();
            value.expired = true;
            let put = Op::Put {
                key: e.place.clone(),
                value: value.encode(),
                lease: etcd_lease,
            };
            match inner.on_place(&e, &[put], deadline).await {
                Ok(t) if t.succeeded => {
                    inner.event("expired");
                    tracing::info!(key = %e.key, delay_ms = inner.lock_delay.as_millis() as u64,
                        "etcd: a lease's TTL passed without a renewal; the key stays closed for the lock-delay");
                    e.value = value;
                    e.state = State::Expired {
                        until: expires + inner.lock_delay,
                    };
                }
                Ok(_) => gone(inner, &slot, &mut e),
                Err(err) if lease_gone(&err) => gone(inner, &slot, &mut e),
                Err(err) => {
                    inner.event("cleanup_retry");
                    tracing::warn!(key = %e.key, error = %err, "etcd: ending an expired lease failed; trying again");
                }
            }
        }
        State::Held { .. } | State::Expired { .. } => {
            let was_held = matches!(e.state, State::Held { .. });
            let delete = Op::Delete {
                key: e.place.clone(),
            };
            match inner.on_place(&e, &[delete], deadline).await {
                Ok(t) => {
                    if t.succeeded {
                        inner.spare_lease(&e);
                    }
                    if was_held {
                        inner.event("expired");
                        tracing::info!(key = %e.key, "etcd: a lease's TTL passed without a renewal; its place is deleted");
                    }
                    gone(inner, &slot, &mut e);
                }
                Err(err) => {
                    inner.event("cleanup_retry");
                    tracing::warn!(key = %e.key, error = %err, "etcd: deleting an ended lease's place failed; trying again");
                }
            }
        }
        State::Waiting => {
            let Some((id, _)) = e.etcd_lease else { return };
            let sent = Instant::now();
            match inner.client.keep_alive(id, deadline).await {
                Ok(kept) if kept.ttl > 0 => {
                    inner.metrics.keepalives.with_label_values(&["ok"]).inc();
                    e.kept_at = sent;
                }
                Ok(_) => {
                    inner.metrics.keepalives.with_label_values(&["gone"]).inc();
                    inner.lapsed(&mut e);
                }
                Err(err) => {
                    inner.metrics.keepalives.with_label_values(&["error"]).inc();
                    tracing::warn!(key = %e.key, error = %err, "etcd: keeping a waiting place's lease alive failed; trying again");
                }
            }
        }
    }
}

/// The place is gone (deleted now, or found gone): the slot goes, and the
/// key's waiters here try.
fn gone(inner: &Inner, slot: &Slot, e: &mut super::Entry) {
    inner.forget(e, slot);
    inner.wake.released(e.key.as_str());
}
