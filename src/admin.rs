//! The admin listener: `/healthz`, `/readyz`, `/metrics`.
//!
//! Kept off the lock API port so probes and scrapes never queue behind lock
//! traffic, and so the API port can stay bound to loopback while the
//! metrics port is reachable by Prometheus.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use crate::error::ApiError;

pub type ReadyFuture = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// Something whose readiness `/readyz` reports.
pub trait Readiness: Send + Sync + 'static {
    fn check(&self) -> ReadyFuture;

    /// `/readyz?backend=1`: the state of what the role depends on right now,
    /// where `check` may deliberately not follow it (the sidecar).
    fn check_with(&self, _dependencies_now: bool) -> ReadyFuture {
        self.check()
    }
}

pub struct AdminState {
    /// Every role of this process registers here: one scrape per process.
    pub registry: prometheus::Registry,
    pub readiness: Arc<dyn Readiness>,
}

pub fn router(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::not_found("admin routes: /healthz, /readyz, /metrics") })
        .with_state(state)
}

async fn readyz(
    State(state): State<Arc<AdminState>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    let now = query.as_deref() == Some("backend=1");
    match state.readiness.check_with(now).await {
        Ok(()) => Json(json!({"status": "ready"})).into_response(),
        Err(reason) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "not_ready", reason).into_response()
        }
    }
}

async fn metrics(State(state): State<Arc<AdminState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        crate::metrics::render(&state.registry),
    )
        .into_response()
}
