//! The lock API's HTTP surface (axum): routes, extraction, responses.
//!
//! Handlers are thin: they validate input (see [`super::request`]) and call
//! the [`LockManager`]. Every rejection, including axum's own (bad path
//! encoding, oversized body, unknown route), becomes the JSON error shape.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, RawQuery, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use super::api_state::ApiState;
use super::request;
use crate::error::ApiError;
use crate::settings::limits::MAX_BODY_BYTES;

type St = State<Arc<ApiState>>;

/// The lock API, with `extra` routes (the Dapr lock API) under the same
/// body limit, request counting and JSON fallbacks; passed in so this
/// module need not import their handlers.
pub fn router(state: Arc<ApiState>, extra: Router<Arc<ApiState>>) -> Router {
    Router::new()
        .route("/v1/locks", get(list))
        .route("/v1/locks/{key}", get(get_one))
        .route("/v1/locks/{key}/acquire", post(acquire))
        .route("/v1/locks/{key}/renew", post(renew))
        .route("/v1/locks/{key}/release", post(release))
        .route("/v1/locks/{key}/hold", post(hold))
        .route("/v1/locks/{key}/keepalive", post(keepalive))
        .route("/openapi.json", get(openapi))
        .merge(extra)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .layer(middleware::from_fn(crate::telemetry::spans::lock_api))
        .with_state(state)
}

async fn count_requests(State(state): St, req: Request, next: Next) -> Response {
    // MatchedPath is a shared string: cloning it does not allocate.
    let route = req.extensions().get::<MatchedPath>().cloned();
    let response = next.run(req).await;
    state
        .metrics
        .http_requests
        .with_label_values(&[
            route.as_ref().map_or("unmatched", |p| p.as_str()),
            response.status().as_str(),
        ])
        .inc();
    response
}

/// The OpenAPI 3.1 description of this API (docs/openapi.json, compiled
/// in; tests/openapi.rs keeps it and the routes above in step).
pub const OPENAPI: &str = include_str!("../../docs/openapi.json");

async fn openapi() -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        OPENAPI,
    )
        .into_response()
}

async fn not_found() -> ApiError {
    ApiError::not_found(
        "no such route; the lock API is /v1/locks/{key}/acquire|renew|release (percent-encode `/` in keys)",
    )
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "method not allowed on this route",
    )
}

fn path_key(path: Result<Path<String>, PathRejection>) -> Result<crate::lock::LockKey, ApiError> {
    let Path(raw) = path.map_err(|e| ApiError::invalid("key", format!("bad key in path: {e}")))?;
    decoded_key(&raw)
}

/// The lock key of a percent-decoded path segment.
pub(super) fn decoded_key(raw: &str) -> Result<crate::lock::LockKey, ApiError> {
    let key = request::key(raw)?;
    crate::telemetry::spans::lock(key.as_str(), None);
    Ok(key)
}

pub(super) fn body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            too_large()
        } else {
            ApiError::invalid("body", format!("cannot read body: {e}"))
        }
    })
}

/// A body above [`MAX_BODY_BYTES`].
pub(super) fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
        format!("request body larger than {MAX_BODY_BYTES} bytes"),
    )
}

async fn acquire(
    State(state): St,
    path: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let Path(key) = path.map_err(|e| ApiError::invalid("key", format!("bad key in path: {e}")))?;
    acquire_key(&state, &key, &body(raw)?).await
}

/// `POST /v1/locks/{key}/acquire` once the key is percent-decoded and the
/// body read: shared by the router and [`super::api_hot`].
pub(super) async fn acquire_key(
    state: &ApiState,
    raw_key: &str,
    body: &[u8],
) -> Result<Response, ApiError> {
    let key = decoded_key(raw_key)?;
    let req = request::acquire(body, &state.defaults, false)?;
    let key = mode_key(state, key, req.mode)?;
    let view = state.locks.acquire(req.into_acquire(key)).await?;
    crate::telemetry::spans::lock(&view.key, Some(view.token));
    Ok(json_200(&Acquired {
        key: view.key,
        token: view.token,
        fencing_token: view.fencing_token,
        lease_id: view.lease_id,
        // The time left as the answer goes out, never the TTL asked for
        // (PITFALLS 12): the pre-registration or the backend may have
        // spent part of it.
        ttl_ms: view.remaining_ms,
        remaining_ms: view.remaining_ms,
        holds: view.holds,
        mode: view.mode,
    }))
}

/// The key an acquire of `mode` takes: a read lease's own reader key.
fn mode_key(
    state: &ApiState,
    key: crate::lock::LockKey,
    mode: crate::token::Mode,
) -> Result<crate::lock::LockKey, ApiError> {
    match mode {
        crate::token::Mode::Write => Ok(key),
        crate::token::Mode::Read => Ok(state.locks.reader_key(&key)?),
    }
}

/// A 200 JSON answer of the hot routes, serialized into a buffer sized for
/// it: axum's `Json` starts at 128 bytes and grows, a reallocation and a
/// copy on every acquire (its token alone is ~100 bytes).
pub(super) fn json_200<T: serde::Serialize>(value: &T) -> Response {
    let mut buf = Vec::with_capacity(384);
    match serde_json::to_writer(&mut buf, value) {
        Ok(()) => (
            [(
                axum::http::header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("application/json"),
            )],
            buf,
        )
            .into_response(),
        // Strings and numbers only: cannot fail; answered as `Json` would.
        Err(_) => Json(value).into_response(),
    }
}

/// The acquire response. Typed rather than `json!`: serialized straight to
/// bytes, without building a map on the hot path.
#[derive(serde::Serialize)]
struct Acquired {
    key: String,
    token: u64,
    fencing_token: String,
    lease_id: String,
    ttl_ms: u64,
    remaining_ms: u64,
    /// A reentrant lease's hold count.
    #[serde(skip_serializing_if = "Option::is_none")]
    holds: Option<u32>,
    /// `read` for a read lease.
    #[serde(skip_serializing_if = "Option::is_none")]
    mode: Option<&'static str>,
}

/// The release response.
#[derive(serde::Serialize)]
struct Released<'a> {
    /// False while a reentrant lease keeps holds.
    released: bool,
    key: &'a str,
    lease_id: &'a str,
    /// A reentrant lease's holds left.
    #[serde(skip_serializing_if = "Option::is_none")]
    holds: Option<u32>,
}

async fn renew(
    State(state): St,
    path: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let key = path_key(path)?;
    let req = request::lease(&body(raw)?, true)?;
    let key = state.locks.lease_key(&key, &req.lease_id);
    state.locks.touch(&key, Some(&req.lease_id));
    // Without `ttl_ms` the lease keeps its own TTL (issue 9 item 2).
    let view = state.locks.renew(key, req.lease_id, req.ttl).await?;
    Ok(Json(view).into_response())
}

async fn release(
    State(state): St,
    path: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let Path(key) = path.map_err(|e| ApiError::invalid("key", format!("bad key in path: {e}")))?;
    release_key(&state, &key, &body(raw)?).await
}

/// `POST /v1/locks/{key}/release`, as [`acquire_key`].
pub(super) async fn release_key(
    state: &ApiState,
    raw_key: &str,
    body: &[u8],
) -> Result<Response, ApiError> {
    let key = decoded_key(raw_key)?;
    let req = request::lease(body, false)?;
    let key = state.locks.lease_key(&key, &req.lease_id);
    let left = match state
        .locks
        .release_hold(key.clone(), req.lease_id.clone())
        .await?
    {
        super::locks::Released::Freed => None,
        super::locks::Released::StillHeld(n) => Some(n),
    };
    Ok(json_200(&Released {
        released: left.is_none(),
        key: key.as_str(),
        lease_id: req.lease_id.as_str(),
        holds: left,
    }))
}

/// `GET /v1/locks/{key}`: this sidecar's lease on the key (`scope=local`,
/// the default), or what the backend records for it, whichever sidecar's
/// lease it is (`scope=backend`, rate-limited: [`super::locks::view`]).
async fn get_one(
    State(state): St,
    path: Result<Path<String>, PathRejection>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    get_key(&state, path_key(path)?, query).await
}

/// `GET /v1/locks/{key}` once the key is parsed: also the answer for the
/// keys spelled like the multi-key routes (`acquire`, `renew`…).
pub(super) async fn get_key(
    state: &ApiState,
    key: crate::lock::LockKey,
    query: Option<String>,
) -> Result<Response, ApiError> {
    let mut backend = false;
    for (_, value) in query_params(&query, "scope")? {
        backend = match value {
            "local" => false,
            "backend" => true,
            _ => {
                return Err(ApiError::invalid(
                    "scope",
                    "`scope` must be `local` (this sidecar's lease) or `backend`",
                ))
            }
        };
    }
    if !backend {
        return Ok(Json(state.locks.get(&key)?.status()).into_response());
    }
    let found = state.locks.backend_view(&key).await?;
    Ok(Json(backend_view_json(&key, state.locks.backend().name(), found)).into_response())
}

/// The backend view's answer: never the holder's lease id (a credential),
/// only its tag.
fn backend_view_json(
    key: &crate::lock::LockKey,
    backend: &str,
    found: super::locks::view::BackendView,
) -> serde_json::Value {
    let v = found.view;
    let mut out = json!({"key": key.as_str(), "scope": "backend", "backend": backend});
    let state = match (&v.holder, v.delayed, v.split) {
        (Some(h), _, _) => {
            out["token"] = json!(h.token);
            out["lease_tag"] = json!(crate::token::lease_tag(&h.lease));
            out["held_here"] = json!(found.held_here);
            if let Some(left) = h.remaining {
                out["remaining_ms"] = json!(left.as_millis() as u64);
            }
            "held"
        }
        (None, _, true) => "split",
        (None, _, false) if v.readers.is_some_and(|n| n > 0) => "read",
        (None, Some(d), _) => {
            out["retry_after_ms"] = json!(d.as_millis() as u64);
            "delayed"
        }
        (None, None, false) => "free",
    };
    out["state"] = json!(state);
    if let Some(t) = v.last_token {
        out["last_token"] = json!(t);
    }
    if let Some(n) = v.waiting {
        out["waiting"] = json!(n);
    }
    if let Some(n) = v.readers {
        out["readers"] = json!(n);
    }
    out
}

/// `POST /v1/locks/{key}/hold`: acquire, then stream the lease's life.
async fn hold(
    State(state): St,
    path: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let key = path_key(path)?;
    let req = request::acquire(&body(raw)?, &state.defaults, true)?;
    let key = mode_key(&state, key, req.mode)?;
    let view = state.locks.acquire(req.into_acquire(key)).await?;
    Ok(hold_stream(&state, view))
}

/// The NDJSON stream of a held lease's life ([`super::hold`]).
pub(super) fn hold_stream(state: &ApiState, view: super::leases::LeaseView) -> Response {
    let body = super::hold::stream(
        state.locks.clone(),
        view,
        state.hold_heartbeat,
        state.shutdown.clone(),
    );
    Response::builder()
        .header(axum::http::header::CONTENT_TYPE, "application/x-ndjson")
        .header(axum::http::header::CACHE_CONTROL, "no-cache")
        .body(body)
        .expect("static response parts")
}

/// `POST /v1/locks/{key}/keepalive` `{"lease_id"}`: the application is alive.
async fn keepalive(
    State(state): St,
    path: Result<Path<String>, PathRejection>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let key = path_key(path)?;
    let req = request::lease(&body(raw)?, false)?;
    let key = state.locks.lease_key(&key, &req.lease_id);
    if !state.locks.touch(&key, Some(&req.lease_id)) {
        return Err(super::locks::LockError::LeaseLost(key).into());
    }
    Ok(Json(
        json!({"key": key.as_str(), "lease_id": req.lease_id.as_str(), "alive": true}),
    ))
}

/// A query string's `name=value` pairs, all named `allowed` (a route here
/// takes one parameter); anything else is refused with the field `query`.
fn query_params<'q>(
    query: &'q Option<String>,
    allowed: &str,
) -> Result<Vec<(&'q str, &'q str)>, ApiError> {
    query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((name, value)) if name == allowed => Ok((name, value)),
            _ => Err(ApiError::invalid(
                "query",
                format!("unknown query parameter `{pair}`; allowed: {allowed}"),
            )),
        })
        .collect()
}

const DEFAULT_LIST_LIMIT: usize = 1_000;
const MAX_LIST_LIMIT: usize = 10_000;

async fn list(State(state): St, RawQuery(query): RawQuery) -> Result<Response, ApiError> {
    let mut limit = DEFAULT_LIST_LIMIT;
    for (_, v) in query_params(&query, "limit")? {
        limit = v
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_LIST_LIMIT).contains(n))
            .ok_or_else(|| {
                ApiError::invalid(
                    "limit",
                    format!("`limit` must be an integer between 1 and {MAX_LIST_LIMIT}"),
                )
            })?;
    }
    let (leases, total) = state.locks.list(limit);
    let leases: Vec<_> = leases.iter().map(|l| l.status()).collect();
    Ok(Json(json!({
        "leases": leases,
        "count": leases.len(),
        "total": total,
        "truncated": total > leases.len(),
    }))
    .into_response())
}
