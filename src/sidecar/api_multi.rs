//! The multi-key lock API: `POST /v1/locks/acquire|renew|release|keepalive`
//! with `keys` ([`super::locks`]'s `multi`): one lease id, the group's,
//! for every key.
//!
//! These paths are also `GET /v1/locks/{key}` for the keys spelled
//! `acquire`, `renew`, `release` and `keepalive`: a static route wins over
//! the key's, so their `GET` is answered here as the key's would be.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use super::api::{body, get_key, json_200};
use super::api_state::ApiState;
use super::locks::{AcquireMany, GroupView};
use super::request;
use crate::error::ApiError;
use crate::lock::LockKey;

type St = State<Arc<ApiState>>;

pub fn routes() -> Router<Arc<ApiState>> {
    let literal = |name: &'static str| {
        move |State(state): St, RawQuery(query): RawQuery| async move {
            let key = LockKey::parse(name).expect("a valid key");
            get_key(&state, key, query).await
        }
    };
    Router::new()
        .route("/v1/locks/acquire", post(acquire))
        .route("/v1/locks/renew", post(renew))
        .route("/v1/locks/release", post(release))
        .route("/v1/locks/keepalive", post(keepalive))
        .route("/v1/locks/acquire", get(literal("acquire")))
        .route("/v1/locks/renew", get(literal("renew")))
        .route("/v1/locks/release", get(literal("release")))
        .route("/v1/locks/keepalive", get(literal("keepalive")))
}

/// The group's answer: its lease id, each key's lease (key, token, signed
/// token, time left) and the least time left, the group's.
fn group_json(group: &GroupView) -> Value {
    let keys: Vec<Value> = group
        .keys
        .iter()
        .map(|v| {
            json!({"key": v.key, "token": v.token, "fencing_token": v.fencing_token,
                   "remaining_ms": v.remaining_ms})
        })
        .collect();
    let left = group.remaining_ms();
    json!({"lease_id": group.lease_id.as_str(), "keys": keys, "ttl_ms": left, "remaining_ms": left})
}

async fn acquire(
    State(state): St,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (keys, req) = request::multi(&body(raw)?, &state.defaults)?;
    let first = keys[0].clone();
    let lease = req.into_acquire(first);
    let group = state
        .locks
        .acquire_many(AcquireMany { keys, lease })
        .await?;
    Ok(json_200(&group_json(&group)))
}

async fn renew(State(state): St, raw: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req = request::lease(&body(raw)?, true)?;
    let group = state.locks.renew_many_keys(&req.lease_id, req.ttl).await?;
    Ok(json_200(&group_json(&group)))
}

async fn release(
    State(state): St,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req = request::lease(&body(raw)?, false)?;
    let keys = state.locks.release_many_keys(&req.lease_id).await?;
    let keys: Vec<&str> = keys.iter().map(LockKey::as_str).collect();
    Ok(
        Json(json!({"released": true, "lease_id": req.lease_id.as_str(), "keys": keys}))
            .into_response(),
    )
}

async fn keepalive(
    State(state): St,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req = request::lease(&body(raw)?, false)?;
    state.locks.touch_group(&req.lease_id)?;
    Ok(Json(json!({"lease_id": req.lease_id.as_str(), "alive": true})).into_response())
}
