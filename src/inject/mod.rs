//! `fencer inject`: a mutating admission webhook that adds fencer as a
//! native sidecar to pods annotated `fencer.dev/inject: "true"`.
//!
//! Layout: [`settings`] (the `[inject]` section), [`annotations`] (what one
//! pod asks for), [`mutate`] (the pod change, pure), [`review`]
//! (AdmissionReview v1 in and out), [`tls`] (the certificate, reloaded on
//! change), [`body`] (reading a review within its time and the shared
//! byte budget) and [`server`] (HTTPS and the `/mutate` route).
//!
//! It fails open by default: a pod the injector cannot make sense of is
//! admitted unchanged, with a warning kubectl shows and a log line; an
//! injector that refused pods it did not understand would take a cluster's
//! deployments down with it. `fail_closed = true` refuses them instead.

pub mod annotations;
pub mod body;
pub mod mutate;
pub mod quantity;
pub mod review;
pub mod server;
pub mod settings;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::admin::{AdminState, Readiness, ReadyFuture};
use crate::settings::Settings;
use crate::start::StartError;

/// Why a pod that asked for injection did not get it, or why a request
/// was not a review at all.
#[derive(Debug, thiserror::Error)]
pub enum InjectError {
    #[error("annotation {annotation}: {message}")]
    BadAnnotation { annotation: String, message: String },
    #[error("{0}")]
    Clash(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("malformed pod: {0}")]
    Malformed(String),
    #[error("{0}")]
    BadReview(String),
}

impl InjectError {
    /// Bounded label / log field for the kind of failure.
    pub fn code(&self) -> &'static str {
        match self {
            InjectError::BadAnnotation { .. } => "bad_annotation",
            InjectError::Clash(_) => "clash",
            InjectError::Unsupported(_) => "unsupported",
            InjectError::Malformed(_) => "malformed_pod",
            InjectError::BadReview(_) => "bad_review",
        }
    }
}

struct Ready;

impl Readiness for Ready {
    fn check(&self) -> ReadyFuture {
        // Serving at all means the certificate loaded.
        Box::pin(async { Ok(()) })
    }
}

pub async fn run(settings: Settings, shutdown: CancellationToken) -> Result<(), StartError> {
    let inject = Arc::new(settings.inject.clone());
    let cert =
        crate::http::tls_cert::ReloadingCert::load(&inject.tls_cert_file, &inject.tls_key_file)
            .map_err(|e| StartError::config("inject.tls_cert_file", e))?;
    let registry = crate::metrics::registry("inject", "none");
    crate::metrics::INJECT.register(&registry);
    let listener = crate::http::listen::bind("inject", inject.listen).await?;
    let admin = crate::http::listen::bind("admin", settings.admin.listen).await?;
    tracing::info!(
        listen = %inject.listen, image = %inject.image, fail_closed = inject.fail_closed,
        "injector listening"
    );
    let admin_task = tokio::spawn(crate::http::listen::serve(
        "admin",
        admin,
        crate::admin::router(Arc::new(AdminState {
            registry,
            readiness: Arc::new(Ready),
        })),
        settings.http.silence(),
        shutdown.clone(),
    ));
    tokio::spawn(cert.clone().watch(
        "inject",
        crate::metrics::INJECT.tls_reloads.clone(),
        shutdown.clone(),
    ));
    server::serve(listener, cert, inject, settings.http.silence(), shutdown).await;
    let _ = tokio::time::timeout(Duration::from_secs(1), admin_task).await;
    Ok(())
}
