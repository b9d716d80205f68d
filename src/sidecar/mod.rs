//! The sidecar role: the lock API beside an application.

pub mod api;
pub mod leases;
pub mod locks;
pub mod request;
pub mod waiters;

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use self::leases::LeaseTable;
use self::locks::{LockManager, LockManagerConfig};
use self::waiters::WaitQueues;
use crate::admin::{AdminState, Readiness, ReadyFuture};
use crate::lock::memory::MemoryBackend;
use crate::lock::redis::RedisBackend;
use crate::lock::{DynBackend, WakeSink};
use crate::metrics::Metrics;
use crate::settings::{BackendKind, Settings};
use crate::token::Signer;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        what: &'static str,
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Config(#[from] crate::settings::ConfigError),
    #[error("backend: {0}")]
    Backend(#[from] crate::lock::BackendError),
}

pub fn build_backend(
    settings: &Settings,
    wake: Arc<dyn WakeSink>,
) -> Result<DynBackend, StartError> {
    Ok(match settings.backend.kind {
        BackendKind::Memory => Arc::new(MemoryBackend::new(wake)),
        BackendKind::Redis => Arc::new(RedisBackend::new(&settings.backend.redis, wake)?),
    })
}

/// The signer for fencing tokens: the configured secret, or (with a warning)
/// a random one that no gateway can verify.
pub fn signer(settings: &Settings) -> Result<Signer, StartError> {
    let secret = match settings.signing_secret()? {
        Some(s) => s,
        None => {
            tracing::warn!(
                "no signing secret configured (signing.secret_file or signing.secret_env); \
                 using a random one: gateways cannot verify this sidecar's tokens"
            );
            let mut s = vec![0u8; 32];
            rand::RngCore::fill_bytes(&mut rand::rng(), &mut s);
            s
        }
    };
    Ok(Signer::new(&settings.signing.key_id, &secret))
}

/// A running sidecar's parts, for `run` and for `dev`.
pub struct Sidecar {
    pub locks: Arc<LockManager>,
    pub metrics: Arc<Metrics>,
    settings: Settings,
    shutdown: CancellationToken,
}

struct BackendReady {
    locks: Arc<LockManager>,
    shutdown: CancellationToken,
}

impl Readiness for BackendReady {
    fn check(&self) -> ReadyFuture {
        let locks = self.locks.clone();
        let shutting_down = self.shutdown.is_cancelled();
        Box::pin(async move {
            if shutting_down {
                return Err("shutting down".into());
            }
            locks.backend().ping().await.map_err(|e| e.to_string())
        })
    }
}

impl Sidecar {
    pub fn new(settings: Settings, shutdown: CancellationToken) -> Result<Sidecar, StartError> {
        let s = &settings.sidecar;
        let waiters = Arc::new(WaitQueues::new(s.max_waiters));
        let backend = build_backend(&settings, waiters.clone())?;
        let metrics = Arc::new(Metrics::new(&settings.metrics, backend.name()));
        let leases = LeaseTable::new(
            s.clock_drift_ratio,
            Duration::from_millis(s.safety_margin_ms),
            s.max_leases,
        );
        let locks = Arc::new(LockManager::new(
            backend,
            leases,
            waiters,
            signer(&settings)?,
            metrics.clone(),
            LockManagerConfig {
                max_leases: s.max_leases,
                max_fallback: Duration::from_millis(s.max_fallback_ms),
                lost_retention: Duration::from_millis(s.lost_lease_retention_ms),
            },
            shutdown.clone(),
        ));
        Ok(Sidecar {
            locks,
            metrics,
            settings,
            shutdown,
        })
    }

    pub fn admin_state(&self) -> Arc<AdminState> {
        Arc::new(AdminState {
            metrics: self.metrics.clone(),
            readiness: Arc::new(BackendReady {
                locks: self.locks.clone(),
                shutdown: self.shutdown.clone(),
            }),
        })
    }

    pub fn api_router(&self) -> axum::Router {
        api::router(Arc::new(api::ApiState {
            locks: self.locks.clone(),
            metrics: self.metrics.clone(),
            default_ttl_ms: self.settings.sidecar.default_ttl_ms,
            default_wait_ms: self.settings.sidecar.default_wait_ms,
        }))
    }

    /// Expires overdue leases once a second until shutdown.
    pub fn spawn_sweeper(&self) {
        let locks = self.locks.clone();
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = tick.tick() => locks.sweep(),
                    _ = shutdown.cancelled() => return,
                }
            }
        });
    }

    /// Releases everything this sidecar holds, bounded by the configured time.
    pub async fn release_all(&self) {
        let limit = Duration::from_millis(self.settings.sidecar.shutdown_release_timeout_ms);
        let (released, total) = self.locks.release_all(limit).await;
        tracing::info!(released, total, "released leases on shutdown");
    }
}

pub async fn bind(
    what: &'static str,
    addr: std::net::SocketAddr,
) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { what, addr, source })
}

/// Serves `router` on `listener` until `shutdown`, then drains in-flight requests.
pub async fn serve(listener: TcpListener, router: axum::Router, shutdown: CancellationToken) {
    let result = axum::serve(listener, router)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await;
    if let Err(e) = result {
        tracing::error!(error = %e, "server error");
    }
}

/// `fencer sidecar`: runs until `shutdown` fires, then releases every lease.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> Result<(), StartError> {
    let api_addr = settings.sidecar.listen;
    let admin_addr = settings.admin.listen;
    let sidecar = Sidecar::new(settings, shutdown.clone())?;
    let api = bind("lock API", api_addr).await?;
    let admin = bind("admin", admin_addr).await?;
    tracing::info!(
        api = %api.local_addr().map_err(|source| StartError::Bind { what: "lock API", addr: api_addr, source })?,
        admin = %admin_addr,
        backend = sidecar.locks.backend().name(),
        "sidecar listening"
    );
    sidecar.spawn_sweeper();
    let api_task = tokio::spawn(serve(api, sidecar.api_router(), shutdown.clone()));
    let admin_task = tokio::spawn(serve(
        admin,
        crate::admin::router(sidecar.admin_state()),
        shutdown.clone(),
    ));
    shutdown.cancelled().await;
    // Waiters were cancelled by the token; let in-flight calls finish so an
    // acquire that completes now is released below, not left to its TTL.
    let _ = tokio::time::timeout(Duration::from_secs(2), api_task).await;
    tracing::info!("shutting down: releasing leases");
    sidecar.release_all().await;
    let _ = tokio::time::timeout(Duration::from_secs(1), admin_task).await;
    Ok(())
}
