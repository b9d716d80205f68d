//! The fence store's health as a series: a ping once a second sets
//! `fencer_gateway_fence_store_up`, so the dashboard's overview and the
//! `FencerFenceStoreDown` alert see a store outage even while no fenced
//! request arrives to fail on it. (`/readyz` pings the store too, but only
//! the kubelet reads that, and only the answer of the moment.)

use std::sync::Arc;
use std::time::Duration;

use prometheus::IntGauge;
use tokio_util::sync::CancellationToken;

use super::fence_store::FenceStore;

/// How often the store is pinged.
const INTERVAL: Duration = Duration::from_secs(1);
/// A ping slower than this counts as down: a store that takes seconds to
/// answer `SELECT 1` fails fenced requests too.
const PING_TIMEOUT: Duration = Duration::from_secs(2);

/// Pings `store` every [`INTERVAL`] until `shutdown`, setting `up` to 1 or 0.
pub(super) fn spawn(store: Arc<dyn FenceStore>, up: IntGauge, shutdown: CancellationToken) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let ok = matches!(
                        tokio::time::timeout(PING_TIMEOUT, store.ping()).await,
                        Ok(Ok(()))
                    );
                    up.set(i64::from(ok));
                }
                _ = shutdown.cancelled() => return,
            }
        }
    });
}
