//! A small key-value HTTP storage for demos and tests (`fencer storage`).
//!
//! `GET/PUT/DELETE /kv/{path}` with a JSON value per path. It trusts nothing
//! and checks nothing: it is the kind of storage the gateway protects. It
//! records, per path, the fencing token that came with each write
//! (`GET /_log/{path}`), so tests can check the order of accepted writes.

pub mod settings;
mod store;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

pub use self::store::{KvStore, MemoryKv, PgKv};
use crate::error::ApiError;
use crate::gateway::settings::FenceStoreKind;
use crate::settings::Settings;
use crate::start::StartError;

const MAX_VALUE_BYTES: usize = 1 << 20;

type St = State<Arc<dyn KvStore>>;

pub fn router(store: Arc<dyn KvStore>) -> Router {
    Router::new()
        .route("/kv/{*path}", get(read).put(write).delete(remove))
        .route("/_log/{*path}", get(log))
        .route("/healthz", get(|| async { Json(json!({"status": "ok"})) }))
        .fallback(|| async { ApiError::not_found("routes: /kv/{path}, /_log/{path}") })
        .layer(DefaultBodyLimit::max(MAX_VALUE_BYTES))
        .with_state(store)
}

/// The integer token inside a `Fencing-Token` header (unverified: this is
/// only for the write log).
fn token_of(headers: &HeaderMap) -> Option<i64> {
    headers
        .get("fencing-token")?
        .to_str()
        .ok()?
        .split('.')
        .nth(2)?
        .parse()
        .ok()
}

fn unavailable(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "storage_unavailable",
        e.to_string(),
    )
}

async fn read(State(store): St, Path(path): Path<String>) -> Result<Json<Value>, ApiError> {
    match store.get(&path).await.map_err(unavailable)? {
        Some((value, version)) => Ok(Json(
            json!({"path": path, "value": value, "version": version}),
        )),
        None => Err(ApiError::not_found(format!("no value at `{path}`"))),
    }
}

async fn write(
    State(store): St,
    Path(path): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let value: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::invalid("body", format!("not JSON: {e}")))?;
    let version = store
        .put(&path, value, token_of(&headers))
        .await
        .map_err(unavailable)?;
    Ok(Json(json!({"path": path, "version": version})))
}

async fn remove(State(store): St, Path(path): Path<String>) -> Result<Json<Value>, ApiError> {
    let existed = store.delete(&path).await.map_err(unavailable)?;
    Ok(Json(json!({"path": path, "deleted": existed})))
}

async fn log(State(store): St, Path(path): Path<String>) -> Result<Json<Value>, ApiError> {
    let writes = store.log(&path).await.map_err(unavailable)?;
    let writes: Vec<Value> = writes
        .into_iter()
        .map(|(version, token)| json!({"version": version, "token": token}))
        .collect();
    Ok(Json(json!({"path": path, "writes": writes})))
}

pub async fn build(settings: &Settings) -> Result<Arc<dyn KvStore>, StartError> {
    Ok(match settings.storage.backend {
        FenceStoreKind::Memory => Arc::new(MemoryKv::default()),
        FenceStoreKind::Postgres => Arc::new(
            PgKv::connect(
                &settings.storage.postgres_url,
                settings.storage.postgres_ca_file.as_deref(),
            )
            .await
            .map_err(|e| StartError::Store(e.to_string()))?,
        ),
        // Refused by `StorageSettings::validate`; the demo storage has no
        // MySQL engine.
        FenceStoreKind::Mysql | FenceStoreKind::Etcd => {
            return Err(StartError::config(
                "storage.backend",
                "the demo storage supports `memory` and `postgres`",
            ))
        }
    })
}

/// `fencer storage`.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> Result<(), StartError> {
    let store = build(&settings).await?;
    let listener = crate::http::listen::bind("storage", settings.storage.listen).await?;
    tracing::info!(listen = %settings.storage.listen, backend = settings.storage.backend.as_str(), "demo storage listening");
    let silence = settings.http.silence();
    crate::http::listen::serve("storage", listener, router(store), silence, shutdown).await;
    Ok(())
}
