//! What Dapr's lock calls mean on fencer, whatever carried them: the HTTP
//! routes ([`super::dapr`]) and the gRPC service ([`super::dapr_grpc`])
//! both parse their wire form into [`TryLock`] / [`Unlock`] and call here,
//! so the checks, bounds, metric and log lines are one implementation.
//!
//! Dapr's model is an owner string, not a lease id: `TryLock` takes
//! `(store, resourceId, lockOwner, expiryInSeconds)` and answers held or
//! not (it never waits); `Unlock` answers 0 unlocked, 1 the lock does not
//! exist, 2 it belongs to another owner, 3 internal error. A store maps to
//! this sidecar's backend with a key prefix (`[[sidecar.dapr_lock_stores]]`).
//!
//! The owner string is therefore a Dapr lease's credential (it unlocks), so
//! [`lease_of`] hands the lease id and signed token — what the egress proxy
//! needs — to whoever presents (store, resourceId, lockOwner) of a lease
//! held now, and to nobody else: SDKs hide the response headers that carry
//! them.

use std::time::Duration;

use axum::http::StatusCode;

use super::api_state::ApiState;
use super::leases::{LeaseView, LostReason, Renewal};
use super::locks::{Acquire, LockError};
use crate::error::ApiError;
use crate::lock::LockKey;
use crate::settings::limits::{MAX_OWNER_BYTES, MAX_TTL_MS};

/// The wire a call came over: the metric's `protocol` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Http,
    Grpc,
}

impl Protocol {
    fn as_str(self) -> &'static str {
        match self {
            Protocol::Http => "http",
            Protocol::Grpc => "grpc",
        }
    }
}

/// Dapr's `TryLockRequest`, as received (checked by [`try_lock`]).
#[derive(Debug, Clone)]
pub struct TryLock {
    pub store: String,
    pub resource_id: String,
    pub owner: String,
    pub expiry_in_seconds: i64,
}

/// Dapr's `UnlockRequest` (and the lease look-up's request), as received.
#[derive(Debug, Clone)]
pub struct Unlock {
    pub store: String,
    pub resource_id: String,
    pub owner: String,
}

/// Dapr's unlock statuses (`UnlockResponse.Status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum UnlockStatus {
    Success = 0,
    LockDoesNotExist = 1,
    LockBelongsToOthers = 2,
}

impl UnlockStatus {
    fn result(self) -> &'static str {
        match self {
            UnlockStatus::Success => "success",
            UnlockStatus::LockDoesNotExist => "not_found",
            UnlockStatus::LockBelongsToOthers => "other_owner",
        }
    }
}

/// `INTERNAL_ERROR`, which Dapr answers beside an error, never alone.
pub const UNLOCK_INTERNAL: i32 = 3;

/// Why a Dapr call failed, for each protocol to map to its own status.
#[derive(Debug, thiserror::Error)]
pub enum DaprFailure {
    /// The request breaks a rule (HTTP 400, gRPC INVALID_ARGUMENT).
    #[error("{0}")]
    Malformed(String),
    /// No such store here (HTTP 400, gRPC INVALID_ARGUMENT).
    #[error("lock store `{store}` is not configured; configured: {configured:?}")]
    StoreNotFound {
        store: String,
        configured: Vec<String>,
    },
    /// The backend failed (HTTP 500, gRPC INTERNAL / UNAVAILABLE).
    #[error(transparent)]
    Backend(LockError),
}

impl DaprFailure {
    /// Dapr's `errorCode` for this failure of `op`.
    pub fn dapr_code(&self, op: Op) -> &'static str {
        match (self, op) {
            (DaprFailure::StoreNotFound { .. }, _) => "ERR_LOCK_STORE_NOT_FOUND",
            (DaprFailure::Malformed(_), _) => "ERR_MALFORMED_REQUEST",
            (DaprFailure::Backend(_), Op::Lock) => "ERR_TRY_LOCK",
            (DaprFailure::Backend(_), Op::Unlock) => "ERR_UNLOCK",
            (DaprFailure::Backend(_), _) => "ERR_INTERNAL",
        }
    }

    /// fencer's JSON error for it (the HTTP answer's body).
    pub fn api_error(&self) -> ApiError {
        match self {
            DaprFailure::Malformed(m) => {
                ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", m.clone())
            }
            DaprFailure::StoreNotFound { .. } => ApiError::new(
                StatusCode::BAD_REQUEST,
                "lock_store_not_found",
                self.to_string(),
            ),
            DaprFailure::Backend(e @ LockError::TtlTooLong { .. }) => {
                ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", e.to_string())
            }
            DaprFailure::Backend(e) => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "backend_unavailable",
                e.to_string(),
            ),
        }
    }

    /// A fault of the caller's request (vs. of fencer or its backend).
    pub fn is_client_error(&self) -> bool {
        self.api_error().status.is_client_error()
    }

    fn result(&self) -> &'static str {
        if self.is_client_error() {
            "bad_request"
        } else {
            "error"
        }
    }
}

/// Which Dapr call: the metric's `op` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Lock,
    Unlock,
    Lease,
    /// gRPC `GetMetadata`.
    Metadata,
    /// A Dapr method fencer does not serve.
    Other,
}

impl Op {
    fn as_str(self) -> &'static str {
        match self {
            Op::Lock => "lock",
            Op::Unlock => "unlock",
            Op::Lease => "lease",
            Op::Metadata => "metadata",
            Op::Other => "other",
        }
    }
}

pub fn malformed(message: impl Into<String>) -> DaprFailure {
    DaprFailure::Malformed(message.into())
}

/// Counts one answered call in `fencer_dapr_requests_total`.
pub fn count(state: &ApiState, protocol: Protocol, op: Op, result: &str) {
    state
        .metrics
        .dapr_requests
        .with_label_values(&[protocol.as_str(), op.as_str(), result])
        .inc();
}

/// Counts (and logs, when it is fencer's fault) a failed call; gives it back.
pub fn failed(state: &ApiState, protocol: Protocol, op: Op, e: DaprFailure) -> DaprFailure {
    count(state, protocol, op, e.result());
    if !e.is_client_error() {
        tracing::warn!(protocol = protocol.as_str(), op = op.as_str(), error = %e, "dapr call failed");
    }
    e
}

/// The store's key for `resource`.
fn key_in(state: &ApiState, store: &str, resource: &str) -> Result<LockKey, DaprFailure> {
    let Some(s) = state.dapr_stores.iter().find(|s| s.name == store) else {
        return Err(DaprFailure::StoreNotFound {
            store: store.chars().take(64).collect(),
            configured: state.dapr_stores.iter().map(|s| s.name.clone()).collect(),
        });
    };
    if resource.is_empty() {
        return Err(malformed("resourceId is empty"));
    }
    LockKey::parse(&format!("{}{resource}", s.prefix()))
        .map_err(|e| malformed(format!("resourceId: {e}")))
}

fn check_owner(owner: &str) -> Result<(), DaprFailure> {
    if owner.is_empty() {
        return Err(malformed("lockOwner is empty"));
    }
    if owner.len() > MAX_OWNER_BYTES {
        return Err(malformed(format!(
            "lockOwner is at most {MAX_OWNER_BYTES} bytes"
        )));
    }
    Ok(())
}

/// Dapr's TryLock: the lease when acquired, `None` when another owner
/// holds the lock. Counted and logged here.
pub async fn try_lock(
    state: &ApiState,
    protocol: Protocol,
    req: TryLock,
) -> Result<Option<LeaseView>, DaprFailure> {
    let result = try_lock_inner(state, &req).await;
    match result {
        Ok(Some(view)) => {
            count(state, protocol, Op::Lock, "success");
            tracing::debug!(protocol = protocol.as_str(), store = %req.store, key = %view.key, token = view.token, "dapr lock acquired");
            Ok(Some(view))
        }
        Ok(None) => {
            count(state, protocol, Op::Lock, "held");
            Ok(None)
        }
        Err(e) => Err(failed(state, protocol, Op::Lock, e)),
    }
}

async fn try_lock_inner(state: &ApiState, req: &TryLock) -> Result<Option<LeaseView>, DaprFailure> {
    let key = key_in(state, &req.store, &req.resource_id)?;
    check_owner(&req.owner)?;
    let max_s = (MAX_TTL_MS / 1000) as i64;
    if !(1..=max_s).contains(&req.expiry_in_seconds) {
        return Err(malformed(format!(
            "expiryInSeconds must be an integer between 1 and {max_s}"
        )));
    }
    let acquire = Acquire {
        reentrant: false,
        key,
        ttl: Duration::from_secs(req.expiry_in_seconds as u64),
        // Dapr's TryLock never waits.
        wait: Duration::ZERO,
        owner: Some(req.owner.clone()),
        renewal: Renewal::Manual,
        dapr_store: Some(req.store.clone()),
    };
    match state.locks.acquire(acquire).await {
        Ok(view) => Ok(Some(view)),
        Err(LockError::Held(_) | LockError::Delayed { .. }) => Ok(None),
        Err(e) => Err(DaprFailure::Backend(e)),
    }
}

/// Dapr's Unlock. Counted and logged here.
pub async fn unlock(
    state: &ApiState,
    protocol: Protocol,
    req: Unlock,
) -> Result<UnlockStatus, DaprFailure> {
    match unlock_inner(state, &req).await {
        Ok(status) => {
            count(state, protocol, Op::Unlock, status.result());
            Ok(status)
        }
        Err(e) => Err(failed(state, protocol, Op::Unlock, e)),
    }
}

async fn unlock_inner(state: &ApiState, req: &Unlock) -> Result<UnlockStatus, DaprFailure> {
    let key = key_in(state, &req.store, &req.resource_id)?;
    check_owner(&req.owner)?;
    // Only this sidecar's leases are known here: a key held through
    // another sidecar answers 1 (does not exist), not 2 — the caller did
    // not hold it either way, and finding out would take a backend read
    // that not every backend offers.
    let record = match state.locks.record(&key) {
        // Held, or released with the backend's answer still unknown (a
        // failed unlock that Dapr's client retries).
        Ok(r) if r.is_held() || r.lost_reason() == Some(LostReason::Released) => r,
        Ok(_) | Err(LockError::NotFound(_)) => return Ok(UnlockStatus::LockDoesNotExist),
        Err(e) => return Err(DaprFailure::Backend(e)),
    };
    // Only a lease taken through this very store is released by owner: a
    // `/v1/locks` lease or another store's answers "another owner" (issue
    // 26 item 10).
    if record.owner.as_deref() != Some(req.owner.as_str())
        || record.dapr_store.as_deref() != Some(req.store.as_str())
    {
        return Ok(UnlockStatus::LockBelongsToOthers);
    }
    match state.locks.release(key, record.lease_id).await {
        Ok(()) => Ok(UnlockStatus::Success),
        Err(LockError::LeaseLost(_)) => Ok(UnlockStatus::LockDoesNotExist),
        Err(LockError::NotOwner(_)) => Ok(UnlockStatus::LockBelongsToOthers),
        Err(e) => Err(DaprFailure::Backend(e)),
    }
}

/// The lease `(store, resourceId, lockOwner)` holds now, for an SDK user
/// whose SDK hid the `Fencing-Lease` header: `None` unless a lease taken
/// through this store by this very owner holds the key here — an
/// allow-list, the same proof Dapr's unlock takes, and nothing a lease's
/// holder did not already have.
pub fn lease_of(
    state: &ApiState,
    protocol: Protocol,
    req: &Unlock,
) -> Result<Option<LeaseView>, DaprFailure> {
    let found = (|| -> Result<Option<LeaseView>, DaprFailure> {
        let key = key_in(state, &req.store, &req.resource_id)?;
        check_owner(&req.owner)?;
        match state.locks.get(&key) {
            Ok(view) => Ok(Some(view)),
            Err(LockError::NotFound(_)) => Ok(None),
            Err(e) => Err(DaprFailure::Backend(e)),
        }
    })();
    let owned = |v: &LeaseView| {
        v.state == "held"
            && v.owner.as_deref() == Some(req.owner.as_str())
            && v.dapr_store.as_deref() == Some(req.store.as_str())
    };
    match found {
        Ok(Some(view)) if owned(&view) => {
            count(state, protocol, Op::Lease, "success");
            Ok(Some(view))
        }
        Ok(_) => {
            count(state, protocol, Op::Lease, "not_found");
            Ok(None)
        }
        Err(e) => Err(failed(state, protocol, Op::Lease, e)),
    }
}
