//! Per key, the bell holder the last `Held` answer reported, kept for the
//! `watch` that follows it (the waiter then blocks on that holder's bell).
//!
//! A try-lock (`wait_ms` 0) gets a `Held` answer and never watches, so its
//! hint is never taken. Hints are therefore dated and pruned: a watch
//! follows its `Held` answer within milliseconds, so a hint older than
//! [`MAX_AGE`] is one nobody will take, and the map stays bounded by the
//! keys answered `Held` in the last few seconds instead of every key ever
//! try-locked.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Age after which a hint is dropped (and not used if still present).
pub const MAX_AGE: Duration = Duration::from_secs(5);
/// Size above which recording a hint first drops the expired ones.
pub const PRUNE_ABOVE: usize = 1024;

#[derive(Default)]
pub struct HolderHints {
    hints: Mutex<Hints>,
}

#[derive(Default)]
struct Hints {
    map: HashMap<String, (u32, Instant)>,
    /// The size that triggers the next prune: twice what the last prune
    /// kept (at least [`PRUNE_ABOVE`]), so the scans cost O(1) amortized
    /// per insertion even when many hints are young.
    prune_at: usize,
}

impl HolderHints {
    pub fn record(&self, key: &str, holder: u32) {
        self.record_at(key, holder, Instant::now());
    }

    pub fn record_at(&self, key: &str, holder: u32, now: Instant) {
        let mut hints = self.hints.lock().expect("holder hints poisoned");
        if hints.map.len() >= hints.prune_at.max(PRUNE_ABOVE) {
            hints
                .map
                .retain(|_, (_, at)| now.saturating_duration_since(*at) < MAX_AGE);
            hints.prune_at = 2 * hints.map.len();
        }
        hints.map.insert(key.to_owned(), (holder, now));
    }

    /// The hint for `key`, removed; `None` if absent or expired.
    pub fn take(&self, key: &str) -> Option<u32> {
        self.take_at(key, Instant::now())
    }

    pub fn take_at(&self, key: &str, now: Instant) -> Option<u32> {
        let (holder, at) = self
            .hints
            .lock()
            .expect("holder hints poisoned")
            .map
            .remove(key)?;
        (now.saturating_duration_since(at) < MAX_AGE).then_some(holder)
    }

    pub fn forget(&self, key: &str) {
        self.hints
            .lock()
            .expect("holder hints poisoned")
            .map
            .remove(key);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.hints.lock().expect("holder hints poisoned").map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hint_is_taken_once() {
        let h = HolderHints::default();
        h.record("k", 7);
        assert_eq!(h.take("k"), Some(7));
        assert_eq!(h.take("k"), None);
        h.record("k", 8);
        h.forget("k");
        assert_eq!(h.take("k"), None);
    }

    #[test]
    fn many_try_locked_keys_do_not_grow_the_map_without_bound() {
        let h = HolderHints::default();
        let start = Instant::now();
        // 100 000 distinct keys answered Held and never watched, 1 000 a
        // second for 100 s.
        for i in 0..100_000u64 {
            let now = start + Duration::from_millis(i);
            h.record_at(&format!("key:{i}"), 1, now);
        }
        // At most twice the young ones (5 s at 1 000/s) between prunes.
        let bound = 2 * (PRUNE_ABOVE + 1_000 * MAX_AGE.as_secs() as usize);
        assert!(h.len() <= bound, "{} hints kept (bound {bound})", h.len());
        // A recent one is still there for its watch; an old one is gone.
        let end = start + Duration::from_millis(100_000);
        assert_eq!(h.take_at("key:99999", end), Some(1));
        assert_eq!(h.take_at("key:10", end), None);
    }

    #[test]
    fn an_expired_hint_is_not_used() {
        let h = HolderHints::default();
        let t = Instant::now();
        h.record_at("k", 3, t);
        assert_eq!(h.take_at("k", t + MAX_AGE), None);
    }
}
