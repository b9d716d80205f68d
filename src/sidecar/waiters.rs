//! Per-key FIFO wait queues for blocking acquires.
//!
//! Only the head of a key's queue talks to the backend; everyone behind it
//! sleeps on its own `Notify`. That makes waiting O(1) backend calls per
//! handoff instead of N pollers stampeding, and it serves waiters of one
//! sidecar in arrival order.
//!
//! Wake-ups are pushed: the backend's release notification (Redis pub/sub,
//! or the in-process memory backend) calls [`WaitQueues::released`], which
//! wakes the head. Nothing here sleeps on a poll interval; the only timer is
//! the caller's fallback re-check at the holder's remaining TTL, for locks
//! that expire without a release.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use crate::lock::WakeSink;

/// Why a waiter was woken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// The key was released (push notification).
    Release,
    /// Notifications may have been lost (backend reconnect); re-check.
    Resync,
    /// The previous head left without the lock; the new head should try.
    Promoted,
    /// The previous head got the lock, which it holds for (at most) the
    /// given time; the new head waits for its release.
    PromotedBehindHolder(Duration),
    /// This sidecar's holder of the key is releasing it, and its release
    /// is already on its way on the connection the head's try will follow
    /// it on: trying now costs one round trip instead of two.
    EarlyRelease,
}

impl Wake {
    pub fn cause(self) -> &'static str {
        match self {
            Wake::Release => "release",
            Wake::Resync => "resync",
            Wake::Promoted | Wake::PromotedBehindHolder(_) => "promoted",
            Wake::EarlyRelease => "early_release",
        }
    }
}

const RELEASE: u8 = 1;
const RESYNC: u8 = 2;
const PROMOTED: u8 = 3;
const PROMOTED_BEHIND: u8 = 4;
const EARLY_RELEASE: u8 = 5;

struct Slot {
    id: u64,
    notify: Notify,
    cause: AtomicU8,
    /// With PROMOTED_BEHIND: the holder's TTL in ms.
    hint_ms: AtomicU64,
}

impl Slot {
    fn wake(&self, cause: u8, hint_ms: u64) {
        self.hint_ms.store(hint_ms, Ordering::Relaxed);
        self.cause.store(cause, Ordering::Release);
        self.notify.notify_one();
    }
}

#[derive(Default)]
struct Inner {
    queues: HashMap<String, VecDeque<Arc<Slot>>>,
    total: usize,
    next_id: u64,
}

pub struct WaitQueues {
    inner: Mutex<Inner>,
    max: usize,
}

#[derive(Debug, thiserror::Error)]
#[error("too many queued waiters ({0})")]
pub struct QueueFull(pub usize);

impl WaitQueues {
    pub fn new(max: usize) -> WaitQueues {
        WaitQueues {
            inner: Mutex::new(Inner::default()),
            max,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("wait queues poisoned")
    }

    pub fn has_waiters(&self, key: &str) -> bool {
        self.lock().queues.contains_key(key)
    }

    pub fn total(&self) -> usize {
        self.lock().total
    }

    /// Joins the back of `key`'s queue.
    pub fn enqueue(self: &Arc<Self>, key: &str) -> Result<Ticket, QueueFull> {
        let mut inner = self.lock();
        if inner.total >= self.max {
            return Err(QueueFull(self.max));
        }
        inner.total += 1;
        inner.next_id += 1;
        let slot = Arc::new(Slot {
            id: inner.next_id,
            notify: Notify::new(),
            cause: AtomicU8::new(0),
            hint_ms: AtomicU64::new(0),
        });
        inner
            .queues
            .entry(key.to_owned())
            .or_default()
            .push_back(slot.clone());
        Ok(Ticket {
            queues: self.clone(),
            key: key.to_owned(),
            slot,
            holder_ttl: None,
        })
    }

    /// Wakes `key`'s head to try now, while this sidecar's release of the
    /// key is on its way ([`Wake::EarlyRelease`]). The release's own
    /// notification still wakes the head when it comes: if the early try
    /// got the key, its ticket is gone by then and the next head waits
    /// behind the new holder; if not, it tries again.
    pub fn released_early(&self, key: &str) {
        self.wake_head(key, EARLY_RELEASE);
        self.wake_semaphore(key, EARLY_RELEASE);
    }

    /// A slot key `name#n` was released: the head of semaphore `name`'s
    /// queue may take it.
    fn wake_semaphore(&self, key: &str, cause: u8) {
        if let Some((name, slot)) = key.rsplit_once('#') {
            if !slot.is_empty() && slot.bytes().all(|b| b.is_ascii_digit()) {
                self.wake_head(&semaphore_queue(name), cause);
            }
        }
    }

    fn wake_head(&self, key: &str, cause: u8) {
        let inner = self.lock();
        if let Some(head) = inner.queues.get(key).and_then(|q| q.front()) {
            head.wake(cause, 0);
        }
    }

    fn leave(&self, key: &str, slot: &Arc<Slot>, holder_ttl: Option<Duration>) {
        let mut inner = self.lock();
        let Some(queue) = inner.queues.get_mut(key) else {
            return;
        };
        let was_head = queue.front().is_some_and(|h| h.id == slot.id);
        queue.retain(|s| s.id != slot.id);
        let now_empty = queue.is_empty();
        if was_head {
            if let Some(next) = queue.front() {
                match holder_ttl {
                    Some(ttl) => next.wake(PROMOTED_BEHIND, ttl.as_millis() as u64),
                    None => next.wake(PROMOTED, 0),
                }
            }
        }
        if now_empty {
            inner.queues.remove(key);
        }
        inner.total -= 1;
    }
}

/// The queue of semaphore `name`'s waiters: a name no lock key can have
/// (lock keys hold no control character).
pub fn semaphore_queue(name: &str) -> String {
    let mut q = String::with_capacity(name.len() + 1);
    q.push('\u{1}');
    q.push_str(name);
    q
}

impl WakeSink for WaitQueues {
    fn released(&self, key: &str) {
        self.wake_head(key, RELEASE);
        self.wake_semaphore(key, RELEASE);
    }

    fn resync(&self) {
        let inner = self.lock();
        for queue in inner.queues.values() {
            if let Some(head) = queue.front() {
                head.wake(RESYNC, 0);
            }
        }
    }
}

/// A place in a key's queue; leaving (drop) hands the head position on.
pub struct Ticket {
    queues: Arc<WaitQueues>,
    key: String,
    slot: Arc<Slot>,
    holder_ttl: Option<Duration>,
}

impl Ticket {
    pub fn is_head(&self) -> bool {
        let inner = self.queues.lock();
        inner
            .queues
            .get(&self.key)
            .and_then(|q| q.front())
            .is_some_and(|h| h.id == self.slot.id)
    }

    /// Waits for the next wake-up addressed to this waiter. A wake-up sent
    /// before this is awaited is not lost (`Notify` keeps a permit).
    pub async fn woken(&self) -> Wake {
        self.slot.notify.notified().await;
        match self.slot.cause.load(Ordering::Acquire) {
            RELEASE => Wake::Release,
            RESYNC => Wake::Resync,
            EARLY_RELEASE => Wake::EarlyRelease,
            PROMOTED_BEHIND => Wake::PromotedBehindHolder(Duration::from_millis(
                self.slot.hint_ms.load(Ordering::Relaxed),
            )),
            _ => Wake::Promoted,
        }
    }

    /// Marks that this waiter got the lock (held for `ttl`): the next head is
    /// told to wait for a release instead of trying at once.
    pub fn acquired(mut self, ttl: Duration) {
        self.holder_ttl = Some(ttl);
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.queues.leave(&self.key, &self.slot, self.holder_ttl);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn fifo_head_and_promotion() {
        let q = Arc::new(WaitQueues::new(10));
        let a = q.enqueue("k").unwrap();
        let b = q.enqueue("k").unwrap();
        assert!(a.is_head());
        assert!(!b.is_head());
        q.released("k");
        assert_eq!(a.woken().await, Wake::Release);
        a.acquired(Duration::from_millis(500));
        assert!(b.is_head());
        assert_eq!(
            b.woken().await,
            Wake::PromotedBehindHolder(Duration::from_millis(500))
        );
        drop(b);
        assert!(!q.has_waiters("k"));
        assert_eq!(q.total(), 0);
    }

    #[tokio::test]
    async fn a_released_slot_wakes_its_semaphores_head() {
        let q = Arc::new(WaitQueues::new(10));
        let a = q.enqueue(&semaphore_queue("pool")).unwrap();
        q.released("pool#x");
        q.released("other#1");
        q.released("pool#3");
        assert_eq!(a.woken().await, Wake::Release);
        q.released_early("pool#0");
        assert_eq!(a.woken().await, Wake::EarlyRelease);
    }

    #[tokio::test]
    async fn bounded() {
        let q = Arc::new(WaitQueues::new(1));
        let _a = q.enqueue("k").unwrap();
        assert!(q.enqueue("j").is_err());
    }

    #[tokio::test]
    async fn head_leaving_without_lock_promotes_next() {
        let q = Arc::new(WaitQueues::new(10));
        let a = q.enqueue("k").unwrap();
        let b = q.enqueue("k").unwrap();
        drop(a);
        assert_eq!(b.woken().await, Wake::Promoted);
    }
}
