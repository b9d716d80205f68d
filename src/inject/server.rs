//! The webhook's HTTPS listener and its one route, `POST /mutate`.
//!
//! TLS is handshaken lazily inside the connection's task
//! ([`crate::http::tls_listen`]), so one slow or half-open client never
//! holds up the accept loop, and the shared server
//! ([`crate::http::server::serve_service`]) bounds connections, header
//! time and the drain as for every other listener.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::body::{self, BodyError, Budget};
use super::review::{self, answer};
use super::settings::InjectSettings;
use crate::error::ApiError;
use crate::http::tls_cert::ReloadingCert;
use crate::http::tls_listen::TlsListener;
use crate::metrics::INJECT;

pub use super::body::MAX_REVIEW_BYTES;
/// Open connections at most. The API server reaches a replica over a few
/// (h2) connections; each open one costs buffers outside the body budget
/// (TLS records, HTTP reads: up to ~100 KiB), so this bound is part of
/// the memory arithmetic in docs/kubernetes.md.
pub const MAX_CONNECTIONS: usize = 256;
/// The API server gives a webhook at most 30 s (10 s by default); the
/// handshake must be well inside that.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

pub async fn serve(
    listener: TcpListener,
    cert: Arc<ReloadingCert>,
    settings: Arc<InjectSettings>,
    silence: crate::http::conn::Silence,
    shutdown: CancellationToken,
) {
    let tls = TlsListener::new(
        listener,
        cert.server_config(),
        HANDSHAKE_TIMEOUT,
        handshake_failed,
    );
    let service = hyper_util::service::TowerToHyperService::new(router(settings));
    let limits = crate::http::server::Limits {
        listener: "inject",
        header_read_timeout: Duration::from_secs(10),
        max_connections: MAX_CONNECTIONS,
        drain: Duration::from_secs(10),
        silence,
    };
    crate::http::server::serve_service(tls, service, shutdown, limits).await;
}

/// The route's state: the settings and the byte budget every review in
/// flight draws from.
struct Webhook {
    settings: Arc<InjectSettings>,
    budget: Budget,
    body_timeout: Duration,
}

pub fn router(settings: Arc<InjectSettings>) -> Router {
    let webhook = Webhook {
        budget: Budget::new(usize::try_from(settings.max_buffered_bytes).unwrap_or(usize::MAX)),
        body_timeout: Duration::from_millis(settings.body_timeout_ms),
        settings,
    };
    Router::new()
        .route("/mutate", post(mutate))
        .fallback(|| async { ApiError::not_found("injector routes: POST /mutate") })
        .with_state(Arc::new(webhook))
}

async fn mutate(State(webhook): State<Arc<Webhook>>, request: Request) -> Response {
    let started = Instant::now();
    let declared = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let read = body::read(
        request.into_body(),
        declared,
        &webhook.budget,
        webhook.body_timeout,
    )
    .await;
    // Held until the answer is built: the parsed review is in memory
    // until then.
    let (bytes, _held) = match read {
        Ok(b) => b,
        Err(e) => return refuse(e),
    };
    let response = match answer(&bytes, &webhook.settings) {
        Ok(a) => {
            INJECT.reviews.with_label_values(&[a.result.as_str()]).inc();
            log(&a);
            Json(a.body).into_response()
        }
        Err(e) => {
            INJECT.reviews.with_label_values(&["bad_request"]).inc();
            tracing::warn!(error = %e, "request is not an AdmissionReview");
            ApiError::new(StatusCode::BAD_REQUEST, "bad_review", e.to_string()).into_response()
        }
    };
    INJECT
        .review_seconds
        .observe(started.elapsed().as_secs_f64());
    response
}

fn log(a: &review::Answer) {
    let (ns, pod, result) = (&a.namespace, &a.pod, a.result.as_str());
    match (&a.error, a.result) {
        (Some(e), _) => tracing::warn!(
            namespace = %ns, pod = %pod, result, reason = e.code(), error = %e,
            "pod asked for the fencer sidecar and did not get it"
        ),
        (None, review::Result::Injected) => {
            tracing::info!(namespace = %ns, pod = %pod, result, "fencer sidecar injected")
        }
        (None, _) => tracing::debug!(namespace = %ns, pod = %pod, result, "review answered"),
    }
}

/// The answer to a body that was not read whole (or not parsed: too many
/// values): a JSON error, counted and logged, with `Connection: close` —
/// the rest of the body was not read, so the connection cannot carry
/// another request; without it the client reuses the connection just as
/// the server closes it (IncompleteMessage on its next call).
fn refuse(e: BodyError) -> Response {
    let (status, code) = match &e {
        BodyError::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
        BodyError::TooComplex => (StatusCode::PAYLOAD_TOO_LARGE, "review_too_complex"),
        BodyError::Unreadable(_) => (StatusCode::BAD_REQUEST, "body_unreadable"),
        BodyError::Timeout(_) => (StatusCode::REQUEST_TIMEOUT, "body_timeout"),
        BodyError::OverBudget(_) => (StatusCode::SERVICE_UNAVAILABLE, "injector_busy"),
    };
    match &e {
        BodyError::Timeout(_) | BodyError::OverBudget(_) => {
            let reason = if matches!(e, BodyError::Timeout(_)) {
                "body_timeout"
            } else {
                "over_budget"
            };
            INJECT.refused.with_label_values(&[reason]).inc();
            tracing::warn!(reason, error = %e, "review refused before it was read");
        }
        _ => INJECT.reviews.with_label_values(&["bad_request"]).inc(),
    }
    let mut response = ApiError::new(status, code, e.to_string()).into_response();
    response.headers_mut().insert(
        axum::http::header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    response
}

/// Counts and logs a failed webhook handshake (`None`: timed out).
fn handshake_failed(error: Option<&std::io::Error>) {
    INJECT.handshake_failures.inc();
    match error {
        Some(e) => tracing::debug!(error = %e, "webhook TLS handshake failed"),
        None => tracing::debug!("webhook TLS handshake timed out"),
    }
}
