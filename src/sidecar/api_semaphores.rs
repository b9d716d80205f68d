//! The semaphore API: `/v1/semaphores/{name}/acquire|renew|release|keepalive|hold`.
//!
//! A permit is a lease on a slot key `name#slot` ([`super::locks`]'s
//! `semaphore`), so past the acquire every route is the lock route of that
//! key: the answer names it (`key`, `slot`), the lock API works on it too
//! (`/v1/locks/name%23slot/…`), and the egress proxy fences a write with
//! it as with any key. Here the slot is found from the lease id, or from
//! `slot` in the body when the lease is not known here (a sidecar that
//! restarted and has not adopted it yet).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Map, Value};

use super::api::{body, decoded_key, hold_stream, json_200};
use super::api_state::ApiState;
use super::locks::{slot_of, LockError, PermitRequest, Released};
use super::request;
use crate::error::ApiError;
use crate::lock::{LeaseId, LockKey};

type St = State<Arc<ApiState>>;

pub fn routes() -> Router<Arc<ApiState>> {
    Router::new()
        .route("/v1/semaphores/{name}/acquire", post(acquire))
        .route("/v1/semaphores/{name}/hold", post(hold))
        .route("/v1/semaphores/{name}/renew", post(renew))
        .route("/v1/semaphores/{name}/release", post(release))
        .route("/v1/semaphores/{name}/keepalive", post(keepalive))
}

/// The longest name: room for `#255` within a lock key.
const MAX_NAME_BYTES: usize = crate::settings::limits::MAX_KEY_BYTES - 4;

fn path_name(path: Result<Path<String>, PathRejection>) -> Result<LockKey, ApiError> {
    let Path(raw) =
        path.map_err(|e| ApiError::invalid("name", format!("bad name in path: {e}")))?;
    if raw.len() > MAX_NAME_BYTES {
        return Err(ApiError::invalid(
            "name",
            format!("a semaphore's name is at most {MAX_NAME_BYTES} bytes (its slot keys are lock keys)"),
        ));
    }
    decoded_key(&raw)
}

/// The acquire answer: the lock's, with the semaphore's name, the slot and
/// the count.
#[derive(serde::Serialize)]
struct PermitAcquired {
    semaphore: String,
    slot: u32,
    permits: u32,
    key: String,
    token: u64,
    fencing_token: String,
    lease_id: String,
    ttl_ms: u64,
    remaining_ms: u64,
}

async fn granted(
    state: &ApiState,
    name: LockKey,
    raw: &[u8],
    hold: bool,
) -> Result<(super::leases::LeaseView, u32, u32), ApiError> {
    let (permits, req) = request::permit(raw, &state.defaults, hold)?;
    let lease = req.into_acquire(name.clone());
    let permit = state
        .locks
        .acquire_permit(PermitRequest {
            name,
            permits,
            lease,
        })
        .await?;
    crate::telemetry::spans::lock(&permit.view.key, Some(permit.view.token));
    Ok((permit.view, permit.slot, permits))
}

async fn acquire(
    State(state): St,
    path: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let name = path_name(path)?;
    let (view, slot, permits) = granted(&state, name.clone(), &body(raw)?, false).await?;
    Ok(json_200(&PermitAcquired {
        semaphore: name.as_str().to_owned(),
        slot,
        permits,
        key: view.key,
        token: view.token,
        fencing_token: view.fencing_token,
        lease_id: view.lease_id,
        ttl_ms: view.remaining_ms,
        remaining_ms: view.remaining_ms,
    }))
}

/// `POST /v1/semaphores/{name}/hold`: a permit, then its lease's life as a
/// stream (the lock's hold stream).
async fn hold(
    State(state): St,
    path: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let name = path_name(path)?;
    let (view, _, _) = granted(&state, name, &body(raw)?, true).await?;
    Ok(hold_stream(&state, view))
}

/// A permit route's body: `lease_id`, optional `slot`, and `extra`.
struct PermitLease {
    key: LockKey,
    slot: u32,
    lease: LeaseId,
    map: Map<String, Value>,
}

impl PermitLease {
    /// The answer naming the permit, with `flag` (`released`, `alive`).
    fn answer(&self, name: &LockKey, flag: &str, value: bool) -> Response {
        let mut out = json!({
            "semaphore": name.as_str(),
            "slot": self.slot,
            "key": self.key.as_str(),
            "lease_id": self.lease.as_str(),
        });
        out[flag] = json!(value);
        Json(out).into_response()
    }
}

/// The slot key `lease` holds of `name`: from `slot` in the body, else
/// from this sidecar's record of the lease.
fn permit_lease(
    state: &ApiState,
    name: &LockKey,
    raw: &[u8],
    extra: &[&str],
) -> Result<PermitLease, ApiError> {
    let mut allowed = vec!["lease_id", "slot"];
    allowed.extend_from_slice(extra);
    let map = request::object(raw, &allowed)?;
    let lease = request::lease_id(&map)?;
    let key = match map.get("slot") {
        None | Some(Value::Null) => state.locks.key_of_lease(&lease).ok_or_else(|| {
            ApiError::not_found(format!(
                "this sidecar knows no permit of semaphore `{name}` under that lease; send `slot` (from the acquire's answer) when the sidecar restarted since"
            ))
            .with("key", name.as_str())
        })?,
        Some(v) => {
            let slot = v
                .as_u64()
                .filter(|n| *n < u64::from(super::locks::MAX_PERMITS))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "slot",
                        format!(
                            "`slot` must be an integer below {}",
                            super::locks::MAX_PERMITS
                        ),
                    )
                })?;
            request::key(&format!("{name}#{slot}"))?
        }
    };
    let slot = slot_of(name, &key).ok_or_else(|| {
        ApiError::new(
            axum::http::StatusCode::CONFLICT,
            "not_owner",
            format!("the lease holds `{key}`, no permit of semaphore `{name}`"),
        )
        .with("key", name.as_str())
    })?;
    Ok(PermitLease {
        key,
        slot,
        lease,
        map,
    })
}

async fn renew(
    State(state): St,
    path: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let name = path_name(path)?;
    let p = permit_lease(&state, &name, &body(raw)?, &["ttl_ms"])?;
    let ttl = request::ttl(&p.map)?;
    state.locks.touch(&p.key, Some(&p.lease));
    let view = state.locks.renew(p.key, p.lease, ttl).await?;
    Ok(Json(view).into_response())
}

async fn release(
    State(state): St,
    path: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let name = path_name(path)?;
    let p = permit_lease(&state, &name, &body(raw)?, &[])?;
    let released = state
        .locks
        .release_hold(p.key.clone(), p.lease.clone())
        .await?;
    Ok(p.answer(&name, "released", matches!(released, Released::Freed)))
}

async fn keepalive(
    State(state): St,
    path: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let name = path_name(path)?;
    let p = permit_lease(&state, &name, &body(raw)?, &[])?;
    if !state.locks.touch(&p.key, Some(&p.lease)) {
        return Err(LockError::LeaseLost(p.key).into());
    }
    Ok(p.answer(&name, "alive", true))
}
