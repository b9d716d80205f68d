//! What the lock API's handlers share (the lock manager, metrics, request
//! defaults): its own module, so the lock API and the Dapr API both use it
//! without importing each other.

use std::sync::Arc;
use std::time::Duration;

use super::dapr_store::DaprLockStore;
use super::locks::LockManager;
use super::request;
use crate::metrics::Metrics;

pub struct ApiState {
    pub locks: Arc<LockManager>,
    pub metrics: Arc<Metrics>,
    pub defaults: request::Defaults,
    pub hold_heartbeat: Duration,
    pub shutdown: tokio_util::sync::CancellationToken,
    /// Dapr lock stores served at `/v1.0-alpha1/{lock,unlock}/{store}`.
    pub dapr_stores: Vec<DaprLockStore>,
    /// The sidecar's `/readyz`, also Dapr's `/v1.0/healthz`.
    pub readiness: Arc<dyn crate::admin::Readiness>,
}
