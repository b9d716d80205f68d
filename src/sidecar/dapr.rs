//! Dapr's distributed-lock API (`/v1.0-alpha1/lock/{store}`,
//! `/v1.0-alpha1/unlock/{store}`) on the lock API listener, so applications
//! written against Dapr's lock building block run on fencer unchanged —
//! and get what Dapr's lock does not have: a fencing token (response
//! headers `Fencing-Token`, `Fencing-Lease`) that the egress proxy and the
//! gateway enforce.
//!
//! Dapr's model is an owner string, not a lease id: `lock` takes
//! `{resourceId, lockOwner, expiryInSeconds}` and answers `{success}`
//! (never waits); `unlock` takes `{resourceId, lockOwner}` and answers
//! `{status}`: 0 unlocked, 1 the lock does not exist, 2 it belongs to
//! another owner, 3 internal error. A store name maps to this sidecar's
//! backend with a key prefix (`[[sidecar.dapr_lock_stores]]`), so two
//! stores never share keys. Errors keep Dapr's status codes (400 malformed
//! request or unknown store, 500 backend) and carry both Dapr's
//! `errorCode` and fencer's `{"error", "message"}`.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use super::api_state::ApiState;
use super::leases::{LostReason, Renewal};
use super::locks::{Acquire, LockError};
use crate::error::ApiError;
use crate::lock::LockKey;
use crate::settings::limits::{MAX_OWNER_BYTES, MAX_TTL_MS};

/// Dapr's two lock routes, for [`super::api::router`] to serve beside the
/// lock API.
pub fn routes() -> axum::Router<Arc<ApiState>> {
    use axum::routing::post;
    axum::Router::new()
        .route("/v1.0-alpha1/lock/{store}", post(lock))
        .route("/v1.0-alpha1/unlock/{store}", post(unlock))
}

/// A Dapr-shaped error: Dapr's `errorCode` beside fencer's fields.
pub struct DaprError {
    dapr_code: &'static str,
    err: ApiError,
}

impl DaprError {
    /// The metric's result label.
    fn result(&self) -> &'static str {
        if self.err.status.is_client_error() {
            "bad_request"
        } else {
            "error"
        }
    }
}

impl IntoResponse for DaprError {
    fn into_response(self) -> Response {
        self.err.with("errorCode", self.dapr_code).into_response()
    }
}

fn dapr_error(status: StatusCode, dapr_code: &'static str, mut err: ApiError) -> DaprError {
    err.status = status;
    DaprError { dapr_code, err }
}

fn malformed(message: impl Into<String>) -> DaprError {
    dapr_error(
        StatusCode::BAD_REQUEST,
        "ERR_MALFORMED_REQUEST",
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message),
    )
}

fn count(state: &ApiState, op: &str, result: &str) {
    state
        .metrics
        .dapr_requests
        .with_label_values(&[op, result])
        .inc();
}

/// The store's key for `resource`, or the Dapr error to answer.
fn key_in(state: &ApiState, store: &str, resource: &str) -> Result<LockKey, DaprError> {
    let Some(s) = state.dapr_stores.iter().find(|s| s.name == store) else {
        let names: Vec<&str> = state.dapr_stores.iter().map(|s| s.name.as_str()).collect();
        return Err(dapr_error(
            StatusCode::BAD_REQUEST,
            "ERR_LOCK_STORE_NOT_FOUND",
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "lock_store_not_found",
                format!("lock store `{store}` is not configured; configured: {names:?}"),
            ),
        ));
    };
    if resource.is_empty() {
        return Err(malformed("resourceId is empty"));
    }
    LockKey::parse(&format!("{}{resource}", s.prefix()))
        .map_err(|e| malformed(format!("resourceId: {e}")))
}

/// The body as an object with only `allowed` fields (a misspelt
/// `expiryInSecond` is refused, not silently defaulted).
fn object(
    raw: Result<Bytes, BytesRejection>,
    allowed: &[&str],
) -> Result<Map<String, Value>, DaprError> {
    let body = raw.map_err(|e| malformed(format!("cannot read body: {e}")))?;
    let value: Value = serde_json::from_slice(&body)
        .map_err(|e| malformed(format!("body is not valid JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(malformed("body must be a JSON object"));
    };
    if let Some(k) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(malformed(format!(
            "unknown field `{k}`; allowed: {}",
            allowed.join(", ")
        )));
    }
    Ok(map)
}

fn string<'a>(map: &'a Map<String, Value>, field: &str) -> Result<&'a str, DaprError> {
    match map.get(field) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s),
        Some(Value::String(_)) | None => Err(malformed(format!("{field} is empty"))),
        Some(_) => Err(malformed(format!("{field} must be a string"))),
    }
}

fn owner(map: &Map<String, Value>) -> Result<&str, DaprError> {
    let owner = string(map, "lockOwner")?;
    if owner.len() > MAX_OWNER_BYTES {
        return Err(malformed(format!(
            "lockOwner is at most {MAX_OWNER_BYTES} bytes"
        )));
    }
    Ok(owner)
}

pub async fn lock(
    State(state): State<Arc<ApiState>>,
    store: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Response {
    let result = try_lock(&state, store, raw).await;
    match result {
        Ok(r) => r,
        Err(e) => {
            count(&state, "lock", e.result());
            e.into_response()
        }
    }
}

async fn try_lock(
    state: &ApiState,
    store: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, DaprError> {
    let Path(store) = store.map_err(|e| malformed(format!("bad store name: {e}")))?;
    let map = object(raw, &["resourceId", "lockOwner", "expiryInSeconds"])?;
    let key = key_in(state, &store, string(&map, "resourceId")?)?;
    let owner = owner(&map)?;
    let max_s = MAX_TTL_MS / 1000;
    let ttl_s = match map.get("expiryInSeconds").and_then(Value::as_i64) {
        Some(s) if s >= 1 && s <= max_s as i64 => s as u64,
        _ => {
            return Err(malformed(format!(
                "expiryInSeconds must be an integer between 1 and {max_s}"
            )))
        }
    };
    let acquire = Acquire {
        key,
        ttl: Duration::from_secs(ttl_s),
        // Dapr's TryLock never waits.
        wait: Duration::ZERO,
        owner: Some(owner.to_owned()),
        renewal: Renewal::Manual,
        dapr_store: Some(store.clone()),
    };
    match state.locks.acquire(acquire).await {
        Ok(view) => {
            count(state, "lock", "success");
            tracing::debug!(store = %store, key = %view.key, token = view.token, "dapr lock acquired");
            let mut response = Json(json!({"success": true})).into_response();
            let headers = response.headers_mut();
            // The lease and its signed token: send storage writes through
            // the egress proxy with `Fencing-Lease`, as for /v1/locks.
            for (name, value) in [
                ("fencing-lease", view.lease_id.as_str()),
                ("fencing-token", view.fencing_token.as_str()),
                ("fencing-key", view.key.as_str()),
            ] {
                if let Ok(v) = HeaderValue::from_str(value) {
                    headers.insert(name, v);
                }
            }
            Ok(response)
        }
        Err(LockError::Held(_)) => {
            count(state, "lock", "held");
            Ok(Json(json!({"success": false})).into_response())
        }
        Err(e @ LockError::TtlTooLong { .. }) => Err(malformed(e.to_string())),
        Err(e) => {
            tracing::warn!(store = %store, error = %e, "dapr lock failed");
            Err(dapr_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "ERR_TRY_LOCK",
                ApiError::from(e),
            ))
        }
    }
}

/// Dapr's unlock statuses.
const UNLOCKED: u8 = 0;
const NOT_FOUND: u8 = 1;
const OTHER_OWNER: u8 = 2;
const INTERNAL: u8 = 3;

pub async fn unlock(
    State(state): State<Arc<ApiState>>,
    store: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Response {
    match try_unlock(&state, store, raw).await {
        Ok(status) => {
            let result = match status {
                UNLOCKED => "success",
                NOT_FOUND => "not_found",
                _ => "other_owner",
            };
            count(&state, "unlock", result);
            Json(json!({ "status": status })).into_response()
        }
        Err(e) => {
            count(&state, "unlock", e.result());
            e.into_response()
        }
    }
}

async fn try_unlock(
    state: &ApiState,
    store: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<u8, DaprError> {
    let Path(store) = store.map_err(|e| malformed(format!("bad store name: {e}")))?;
    let map = object(raw, &["resourceId", "lockOwner"])?;
    let key = key_in(state, &store, string(&map, "resourceId")?)?;
    let owner = owner(&map)?;
    // Only this sidecar's leases are known here: a key held through
    // another sidecar answers 1 (does not exist), not 2 — the caller did
    // not hold it either way, and finding out would take a backend read
    // that not every backend offers.
    let record = match state.locks.record(&key) {
        // Held, or released with the backend's answer still unknown (a
        // failed unlock that Dapr's client retries).
        Ok(r) if r.is_held() || r.lost_reason() == Some(LostReason::Released) => r,
        Ok(_) | Err(LockError::NotFound(_)) => return Ok(NOT_FOUND),
        Err(e) => return Err(internal(e)),
    };
    // Only a lease taken through this very store is released by owner: a
    // `/v1/locks` lease (owner names are visible to every local client)
    // or another store's answers "another owner" (issue 26 item 10).
    if record.owner.as_deref() != Some(owner) || record.dapr_store.as_deref() != Some(&store) {
        return Ok(OTHER_OWNER);
    }
    let lease = record.lease_id;
    match state.locks.release(key, lease).await {
        Ok(()) => Ok(UNLOCKED),
        Err(LockError::LeaseLost(_)) => Ok(NOT_FOUND),
        Err(LockError::NotOwner(_)) => Ok(OTHER_OWNER),
        Err(e) => Err(internal(e)),
    }
}

fn internal(e: impl std::fmt::Display) -> DaprError {
    tracing::warn!(error = %e, "dapr unlock failed");
    let err = ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "backend_unavailable",
        e.to_string(),
    )
    .with("status", INTERNAL);
    dapr_error(StatusCode::INTERNAL_SERVER_ERROR, "ERR_UNLOCK", err)
}
