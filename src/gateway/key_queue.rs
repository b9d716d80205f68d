//! Per-key turns inside one gateway process.
//!
//! Fenced requests of one key go through this process one at a time, in
//! arrival order (tokio's mutex is fair). Waiting here costs a queue slot in
//! memory, never a database connection: a hot key cannot drain the fence
//! store's pool for every other key (issue 9 item 9).
//!
//! The map holds a key only while a request holds or waits for its turn,
//! so it stays as small as the number of keys in flight.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;

type Slot = Arc<tokio::sync::Mutex<()>>;

#[derive(Default)]
pub struct KeyQueue {
    slots: Mutex<HashMap<String, Slot>>,
}

/// A request's turn on its key; the next request's turn starts when this
/// is dropped.
pub struct KeyTurn {
    queue: Arc<KeyQueue>,
    key: String,
    slot: Slot,
    guard: Option<OwnedMutexGuard<()>>,
}

impl KeyQueue {
    fn slot(&self, key: &str) -> Slot {
        self.slots
            .lock()
            .expect("key queue poisoned")
            .entry(key.to_owned())
            .or_default()
            .clone()
    }

    /// Drops the key's slot when the map holds the last reference besides
    /// `slot`. Every clone is made under the map's lock, so the count
    /// cannot grow behind our back.
    fn forget(&self, key: &str, slot: &Slot) {
        let mut slots = self.slots.lock().expect("key queue poisoned");
        if Arc::strong_count(slot) == 2 && slots.get(key).is_some_and(|s| Arc::ptr_eq(s, slot)) {
            slots.remove(key);
        }
    }

    /// Waits for `key`'s turn until `deadline`; `None` if it did not come.
    pub async fn turn(self: &Arc<Self>, key: &str, deadline: Instant) -> Option<KeyTurn> {
        let slot = self.slot(key);
        let mut turn = KeyTurn {
            queue: self.clone(),
            key: key.to_owned(),
            slot: slot.clone(),
            guard: None,
        };
        // On timeout (or if this future is dropped) `turn` is dropped
        // without a guard, which forgets the slot if nobody else uses it.
        let guard = tokio::time::timeout_at(deadline, slot.lock_owned())
            .await
            .ok()?;
        turn.guard = Some(guard);
        Some(turn)
    }

    /// Keys with a request holding or waiting for their turn.
    pub fn len(&self) -> usize {
        self.slots.lock().expect("key queue poisoned").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for KeyTurn {
    fn drop(&mut self) {
        drop(self.guard.take());
        self.queue.forget(&self.key, &self.slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn one_turn_at_a_time_and_the_map_empties() {
        let q = Arc::new(KeyQueue::default());
        let far = Instant::now() + Duration::from_secs(5);
        let a = q.turn("k", far).await.unwrap();
        let soon = Instant::now() + Duration::from_millis(20);
        assert!(q.turn("k", soon).await.is_none());
        assert!(q.turn("other", soon).await.is_some());
        assert_eq!(q.len(), 1);
        let q2 = q.clone();
        let waiter = tokio::spawn(async move { q2.turn("k", far).await.is_some() });
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(a);
        assert!(waiter.await.unwrap());
        assert!(q.is_empty());
    }
}
