//! Dapr's HTTP API on the lock API listener, so applications written
//! against Dapr's lock building block — and Dapr's SDKs, which check the
//! sidecar before their first call — run on fencer unchanged:
//! - the lock calls `/v1.0-alpha1/lock/{store}` and `/unlock/{store}`
//!   (their meaning, shared with the gRPC service, is [`super::dapr_lock`]),
//!   answered with what Dapr's lock does not have: a fencing token
//!   (response headers `Fencing-Token`, `Fencing-Lease`) that the egress
//!   proxy and the gateway enforce;
//! - `GET /v1.0/metadata` (the Node SDK's start-up check), listing every
//!   configured store as a `lock.<backend>` component, and
//!   `GET /v1.0/healthz[/outbound]` (the Python SDK's), 204 once the
//!   sidecar can serve;
//! - `POST /v1/dapr/{store}/lease`, fencer's own: the lease an owner holds,
//!   for SDK users whose SDK hides the headers (docs/dapr.md).
//!
//! Errors keep Dapr's status codes (400 malformed request or unknown store,
//! 500 backend) and carry both Dapr's `errorCode` and fencer's
//! `{"error", "message"}`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use super::api_state::ApiState;
use super::dapr_lock::{self, malformed, DaprFailure, Op, Protocol, TryLock, Unlock};
use super::leases::LeaseView;
use crate::error::ApiError;

/// Dapr's routes and the lease look-up, for [`super::api::router`] to
/// serve beside the lock API.
pub fn routes() -> axum::Router<Arc<ApiState>> {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/v1.0-alpha1/lock/{store}", post(lock))
        .route("/v1.0-alpha1/unlock/{store}", post(unlock))
        .route("/v1.0/metadata", get(metadata))
        .route("/v1.0/healthz", get(healthz))
        .route("/v1.0/healthz/outbound", get(healthz))
        .route("/v1/dapr/{store}/lease", post(lease))
}

/// A failure as Dapr's HTTP API answers it: Dapr's `errorCode` beside
/// fencer's fields (and unlock's `status` 3 for a backend failure).
fn answer(op: Op, e: DaprFailure) -> Response {
    let code = e.dapr_code(op);
    let mut err = e.api_error();
    if op == Op::Unlock && !e.is_client_error() {
        err = err.with("status", dapr_lock::UNLOCK_INTERNAL);
    }
    err.with("errorCode", code).into_response()
}

/// A request refused before it reached [`dapr_lock`]: counted there.
fn refused(state: &ApiState, op: Op, e: DaprFailure) -> Response {
    answer(op, dapr_lock::failed(state, Protocol::Http, op, e))
}

/// The body as an object with only `allowed` fields (a misspelt
/// `expiryInSecond` is refused, not silently defaulted).
fn object(
    raw: Result<Bytes, BytesRejection>,
    allowed: &[&str],
) -> Result<Map<String, Value>, DaprFailure> {
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

fn string(map: &Map<String, Value>, field: &str) -> Result<String, DaprFailure> {
    match map.get(field) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(Value::String(_)) | None => Err(malformed(format!("{field} is empty"))),
        Some(_) => Err(malformed(format!("{field} must be a string"))),
    }
}

fn store_of(store: Result<Path<String>, PathRejection>) -> Result<String, DaprFailure> {
    store
        .map(|Path(s)| s)
        .map_err(|e| malformed(format!("bad store name: {e}")))
}

/// `{resourceId, lockOwner}` of `store`: unlock's request and the look-up's.
fn owner_request(
    store: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Unlock, DaprFailure> {
    let store = store_of(store)?;
    let map = object(raw, &["resourceId", "lockOwner"])?;
    Ok(Unlock {
        store,
        resource_id: string(&map, "resourceId")?,
        owner: string(&map, "lockOwner")?,
    })
}

fn lock_request(
    store: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<TryLock, DaprFailure> {
    let store = store_of(store)?;
    let map = object(raw, &["resourceId", "lockOwner", "expiryInSeconds"])?;
    Ok(TryLock {
        store,
        resource_id: string(&map, "resourceId")?,
        owner: string(&map, "lockOwner")?,
        // Not an integer: out of range, refused by the shared check.
        expiry_in_seconds: map
            .get("expiryInSeconds")
            .and_then(Value::as_i64)
            .unwrap_or(0),
    })
}

pub async fn lock(
    State(state): State<Arc<ApiState>>,
    store: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Response {
    let req = match lock_request(store, raw) {
        Ok(r) => r,
        Err(e) => return refused(&state, Op::Lock, e),
    };
    match dapr_lock::try_lock(&state, Protocol::Http, req).await {
        Ok(Some(view)) => {
            let mut response = Json(json!({"success": true})).into_response();
            let headers = response.headers_mut();
            // The lease and its signed token: send storage writes through
            // the egress proxy with `Fencing-Lease`, as for /v1/locks.
            for (name, value) in fencing_headers(&view) {
                if let Ok(v) = HeaderValue::from_str(value) {
                    headers.insert(name, v);
                }
            }
            response
        }
        Ok(None) => Json(json!({"success": false})).into_response(),
        Err(e) => answer(Op::Lock, e),
    }
}

/// What a Dapr acquire answers besides `success`, as header (HTTP) or
/// metadata (gRPC) names and values.
pub fn fencing_headers(view: &LeaseView) -> [(&'static str, &str); 3] {
    [
        ("fencing-lease", view.lease_id.as_str()),
        ("fencing-token", view.fencing_token.as_str()),
        ("fencing-key", view.key.as_str()),
    ]
}

pub async fn unlock(
    State(state): State<Arc<ApiState>>,
    store: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Response {
    let req = match owner_request(store, raw) {
        Ok(r) => r,
        Err(e) => return refused(&state, Op::Unlock, e),
    };
    match dapr_lock::unlock(&state, Protocol::Http, req).await {
        Ok(status) => Json(json!({ "status": status as i32 })).into_response(),
        Err(e) => answer(Op::Unlock, e),
    }
}

/// `POST /v1/dapr/{store}/lease` `{resourceId, lockOwner}`: the lease that
/// owner holds through that store, or 404 `lease_not_found`.
pub async fn lease(
    State(state): State<Arc<ApiState>>,
    store: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Response {
    let req = match owner_request(store, raw) {
        Ok(r) => r,
        Err(e) => return refused(&state, Op::Lease, e),
    };
    match dapr_lock::lease_of(&state, Protocol::Http, &req) {
        Ok(Some(view)) => Json(view).into_response(),
        Ok(None) => ApiError::new(
            StatusCode::NOT_FOUND,
            "lease_not_found",
            "this owner holds no lease on this resource through this store here",
        )
        .into_response(),
        Err(e) => answer(Op::Lease, e),
    }
}

/// `GET /v1.0/metadata` in Dapr's shape.
async fn metadata(State(state): State<Arc<ApiState>>) -> Response {
    let components: Vec<Value> = super::dapr_meta::components(&state)
        .into_iter()
        .map(|c| json!({"name": c.name, "type": c.kind, "version": c.version}))
        .collect();
    let mut body = json!({
        "id": super::dapr_meta::APP_ID,
        "runtimeVersion": super::dapr_meta::runtime_version(),
        "extended": super::dapr_meta::extended(&state),
        "appConnectionProperties": {},
        "actorRuntime": {"runtimeStatus": "DISABLED", "hostReady": false},
    });
    // Dapr leaves an empty list out.
    if !components.is_empty() {
        body["components"] = Value::Array(components);
    }
    Json(body).into_response()
}

/// `GET /v1.0/healthz` and `/v1.0/healthz/outbound`: 204 once the sidecar
/// can serve (its `/readyz`), else Dapr's 500 `ERR_HEALTH_NOT_READY`.
async fn healthz(State(state): State<Arc<ApiState>>) -> Response {
    match state.readiness.check().await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(why) => {
            tracing::debug!(reason = %why, "dapr healthz: not ready");
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "not_ready",
                format!("the sidecar is not ready: {why}"),
            )
            .with("errorCode", "ERR_HEALTH_NOT_READY")
            .into_response()
        }
    }
}
