//! `GET /v1/locks/{key}?scope=backend`: what the backend records for a key,
//! whichever sidecar's lease holds it — rate-limited, so an operator's
//! `fencer top` or a careless poller cannot load the backend the locks of
//! every pod depend on.
//!
//! Two bounds: a token bucket (`sidecar.backend_view_per_second`, a burst
//! of as many) and four reads at a time; the read itself is bounded by the
//! backend's request timeout. Over either bound the answer is 429
//! `rate_limited` with the time until a read would be let through.

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::{LockError, LockManager};
use crate::lock::{KeyView, LeaseId, LockKey};

/// Backend reads of this kind in flight at once, per sidecar.
const AT_ONCE: usize = 4;

/// The bounds on backend views.
pub struct ViewLimits {
    per_second: u32,
    bucket: Mutex<Bucket>,
    at_once: Semaphore,
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

impl ViewLimits {
    /// `per_second` 0: the view is off.
    pub fn new(per_second: u32) -> ViewLimits {
        ViewLimits {
            per_second,
            bucket: Mutex::new(Bucket {
                tokens: f64::from(per_second),
                at: Instant::now(),
            }),
            at_once: Semaphore::new(AT_ONCE),
        }
    }

    /// Takes one read from the bucket, or says how long until one is there.
    fn take(&self, now: Instant) -> Result<(), Duration> {
        let rate = f64::from(self.per_second);
        let mut b = self.bucket.lock().expect("view bucket");
        let refill = now.saturating_duration_since(b.at).as_secs_f64() * rate;
        b.tokens = (b.tokens + refill).min(rate);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            return Ok(());
        }
        Err(Duration::from_secs_f64((1.0 - b.tokens) / rate))
    }
}

/// A backend view and whether its holder is a lease of this sidecar.
pub struct BackendView {
    pub view: KeyView,
    pub held_here: bool,
}

impl LockManager {
    /// What the backend records for `key` now, within the view's bounds.
    pub async fn backend_view(&self, key: &LockKey) -> Result<BackendView, LockError> {
        let limits = &self.views;
        if limits.per_second == 0 {
            return Err(LockError::ViewOff);
        }
        let counted = |result: &str| {
            self.metrics
                .backend_views
                .with_label_values(&[result])
                .inc();
        };
        let refused = |retry_after: Duration| {
            counted("rate_limited");
            tracing::debug!(key = %key, retry_after_ms = retry_after.as_millis() as u64,
                "backend view refused: over sidecar.backend_view_per_second or four at a time");
            LockError::RateLimited { retry_after }
        };
        let Ok(_slot) = limits.at_once.try_acquire() else {
            return Err(refused(Duration::from_millis(100)));
        };
        limits.take(Instant::now()).map_err(refused)?;
        match self.call("inspect", self.backend.inspect(key)).await {
            Ok(view) => {
                counted(match (&view.holder, view.delayed, view.split) {
                    (Some(_), _, _) => "held",
                    (None, _, true) => "split",
                    (None, Some(_), _) => "delayed",
                    (None, None, false) => "free",
                });
                let held_here = view.holder.as_ref().is_some_and(|h| {
                    LeaseId::parse(&h.lease).is_some_and(|l| self.leases.knows(key, &l))
                });
                Ok(BackendView { view, held_here })
            }
            Err(e) => {
                counted("error");
                tracing::warn!(key = %key, error = %e, "backend view failed");
                Err(e.into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_bucket_lets_a_burst_through_then_one_per_interval() {
        let limits = ViewLimits::new(4);
        let t0 = Instant::now();
        for _ in 0..4 {
            assert!(limits.take(t0).is_ok());
        }
        let wait = limits.take(t0).unwrap_err();
        assert_eq!(wait, Duration::from_millis(250));
        assert!(limits.take(t0 + Duration::from_millis(249)).is_err());
        assert!(limits.take(t0 + Duration::from_millis(500)).is_ok());
    }
}
