//! The gateway role: a reverse proxy in front of the storage that enforces
//! fencing tokens.
//!
//! - [`handler`] — what a request is (fenced or not), where it goes;
//! - [`verify`] — token signature, key and path binding;
//! - [`fenced`] — admission and forward of a fenced request, in its own task;
//! - [`key_queue`] — per-key turns inside one process;
//! - [`fence_store`] — marks and in-flight stamps (memory, PostgreSQL,
//!   MySQL/MariaDB);
//! - [`preregister`] — the sidecars' token pre-registration endpoint;
//! - [`store_health`] — the fence store's periodic ping, as a gauge.

pub mod fence_store;
mod fenced;
pub mod handler;
pub mod key_queue;
mod preregister;
pub mod settings;
mod state;
mod store_health;
mod verify;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use self::fence_store::etcd::{EtcdFenceOptions, EtcdFences};
use self::fence_store::memory::MemoryFences;
use self::fence_store::mysql::{MyFenceOptions, MyFences};
use self::fence_store::postgres::{PgFenceOptions, PgFences};
use self::fence_store::FenceStore;
use self::key_queue::KeyQueue;
use self::state::Gateway;
use crate::admin::{AdminState, Readiness, ReadyFuture};
use crate::gateway::settings::{FenceStoreKind, GatewaySettings};
use crate::http::tls_cert::ReloadingCert;
use crate::metrics::{GatewayMetrics, Groups};
use crate::proxy::forward::Forwarder;
use crate::routes::Routes;
use crate::settings::Settings;
use crate::start::StartError;
use crate::token::Keyring;

fn config_err(field: &'static str, message: impl std::fmt::Display) -> StartError {
    StartError::config(field, message)
}

/// The configured fence store. None is a configuration error, not the
/// memory store: marks lost on restart must be chosen.
pub fn fence_store_kind(settings: &Settings) -> Result<FenceStoreKind, StartError> {
    settings.gateway.fence_store.ok_or_else(|| {
        config_err(
            "gateway.fence_store",
            "required: `postgres`, `mysql` or `etcd` (durable, shared by replicas) or `memory` (development only: marks are lost on restart)",
        )
    })
}

/// Builds the gateway (connects the fence store, creating what is missing
/// of its schema).
pub async fn build(
    settings: &Settings,
    registry: &prometheus::Registry,
) -> Result<Arc<Gateway>, StartError> {
    let g = &settings.gateway;
    let keyring = Keyring::with_prefixes(&settings.gateway_keys()?);
    let groups = Arc::new(Groups::new(&settings.metrics));
    let metrics = Arc::new(GatewayMetrics::new(registry, groups));
    let kind = if crate::mutants::active("marks_in_memory") {
        FenceStoreKind::Memory
    } else {
        fence_store_kind(settings)?
    };
    let store: Arc<dyn FenceStore> = match kind {
        FenceStoreKind::Memory => Arc::new(MemoryFences::default()),
        FenceStoreKind::Postgres => Arc::new(
            PgFences::connect(&PgFenceOptions {
                url: &g.postgres_url,
                ca_file: g.postgres_ca_file.as_deref(),
                pool_size: g.postgres_pool_size,
                request_timeout: Duration::from_millis(g.postgres_request_timeout_ms),
                startup: Duration::from_secs(30),
            })
            .await
            .map_err(|e| StartError::Store(e.to_string()))?
            .with_metrics(metrics.remote_waits.clone(), &metrics.items_per_statement),
        ),
        FenceStoreKind::Mysql => Arc::new(
            MyFences::connect(&MyFenceOptions {
                url: &g.mysql_url,
                ca_file: g.mysql_ca_file.as_deref(),
                pool_size: g.mysql_pool_size,
                request_timeout: Duration::from_millis(g.mysql_request_timeout_ms),
                startup: Duration::from_secs(30),
            })
            .await
            .map_err(|e| StartError::Store(e.to_string()))?
            .with_metrics(metrics.remote_waits.clone(), registry),
        ),
        FenceStoreKind::Etcd => Arc::new(
            EtcdFences::connect(EtcdFenceOptions {
                client: crate::etcd::EtcdClient::new(
                    &g.etcd_client_config()
                        .map_err(|e| StartError::Store(e.to_string()))?,
                )
                .map_err(|e| config_err("gateway.etcd_endpoints", e))?,
                prefix: g.etcd_prefix.clone(),
                request_timeout: Duration::from_millis(g.etcd_request_timeout_ms),
                stamp_hold: Duration::from_millis(g.stamp_hold_ms()),
                startup: Duration::from_secs(30),
            })
            .await
            .map_err(StartError::Store)?
            .with_metrics(metrics.remote_waits.clone(), registry),
        ),
    };
    metrics.init_known(store.name());
    let forwarder = Forwarder::new(
        &g.upstream,
        (crate::http::tls_client::GATEWAY, &g.upstream_tls),
        Duration::from_millis(g.connect_timeout_ms),
        Duration::from_millis(g.upstream_timeout_ms),
    )
    .map_err(|e| config_err("gateway.upstream", e))?;
    Ok(Arc::new(Gateway {
        forwarder,
        store,
        keys: Arc::new(KeyQueue::default()),
        keyring,
        routes: Routes::compile(&g.routes).map_err(|e| config_err("gateway.routes", e))?,
        read_methods: crate::proxy::headers::methods(&g.read_methods),
        require_token_for_reads: g.require_token_for_reads,
        enforce: g.enforce,
        fence_prefix: g.fence_api_prefix.clone(),
        serialize_timeout: Duration::from_millis(g.serialize_timeout_ms),
        upstream_timeout: Duration::from_millis(g.upstream_timeout_ms),
        uncertain_hold: Duration::from_millis(g.uncertain_hold_ms),
        stamp_hold: Duration::from_millis(g.stamp_hold_ms()),
        metrics,
        tasks: tokio_util::task::TaskTracker::new(),
    }))
}

struct StoreReady(Arc<dyn FenceStore>);

impl Readiness for StoreReady {
    fn check(&self) -> ReadyFuture {
        let store = self.0.clone();
        Box::pin(async move { store.ping().await.map_err(|e| e.to_string()) })
    }
}

pub fn readiness(gateway: &Gateway) -> Arc<dyn Readiness> {
    Arc::new(StoreReady(gateway.store.clone()))
}

/// How long a client may take over the TLS handshake on the gateway's
/// listener: well inside the proxy's connect timeout would be too tight
/// for a loaded gateway; a half-open client must not hold a slot longer.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The gateway listener's TLS (`gateway.tls_cert_file`, `tls_key_file`,
/// `tls_client_ca_file`), files read now; `None` when not configured.
pub fn tls_config(
    g: &GatewaySettings,
) -> Result<Option<(Arc<ReloadingCert>, rustls::ServerConfig)>, StartError> {
    let (Some(cert_file), Some(key_file)) = (&g.tls_cert_file, &g.tls_key_file) else {
        return Ok(None);
    };
    let cert = ReloadingCert::load(cert_file, key_file)
        .map_err(|e| config_err("gateway.tls_cert_file", e))?;
    let config = cert
        .server_config_with(g.tls_client_ca_file.as_deref())
        .map_err(|e| config_err("gateway.tls_client_ca_file", e))?;
    Ok(Some((cert, config)))
}

/// Counts and logs a failed handshake on the gateway's listener
/// (`None`: timed out): a client without the CA, without a client
/// certificate when one is required, a port scanner.
fn handshake_failed(error: Option<&std::io::Error>) {
    let reason = error.map_or("timeout", crate::http::tls_client::failure_reason);
    crate::metrics::TLS
        .handshake_failures
        .with_label_values(&["gateway_listener", reason])
        .inc();
    match error {
        Some(e) => {
            tracing::warn!(reason, error = %e, "TLS handshake on the gateway listener failed")
        }
        None => tracing::warn!(reason, "TLS handshake on the gateway listener timed out"),
    }
}

/// Serves the gateway on `listener` until `shutdown`: over TLS when `tls`
/// is given (its certificate re-read when the files change).
pub async fn serve_maybe_tls(
    gateway: Arc<Gateway>,
    listener: tokio::net::TcpListener,
    tls: Option<(Arc<ReloadingCert>, rustls::ServerConfig)>,
    silence: crate::http::conn::Silence,
    shutdown: CancellationToken,
) {
    match tls {
        None => serve(gateway, listener, silence, shutdown).await,
        Some((cert, config)) => {
            tokio::spawn(cert.watch(
                "gateway",
                crate::metrics::TLS.gateway_cert_reloads.clone(),
                shutdown.clone(),
            ));
            let listener = crate::http::tls_listen::TlsListener::new(
                listener,
                config,
                HANDSHAKE_TIMEOUT,
                handshake_failed,
            );
            serve(gateway, listener, silence, shutdown).await;
        }
    }
}

/// Serves the gateway on its listener until `shutdown`.
pub async fn serve<L: crate::http::server::Accept>(
    gateway: Arc<Gateway>,
    listener: L,
    silence: crate::http::conn::Silence,
    shutdown: CancellationToken,
) {
    let tasks = gateway.tasks.clone();
    let wait = gateway.stamp_hold;
    store_health::spawn(
        gateway.store.clone(),
        gateway
            .metrics
            .fence_store_up
            .with_label_values(&[gateway.store.name()]),
        shutdown.clone(),
    );
    let handler = Arc::new(move |req| {
        let gateway = gateway.clone();
        crate::telemetry::spans::serve("gateway.request", req, move |req| gateway.handle(req))
    });
    crate::http::server::serve(
        "gateway",
        listener,
        handler,
        shutdown,
        Duration::from_secs(10),
        silence,
    )
    .await;
    // Forwards still running finish and clear their stamps; otherwise a
    // restart would leave their keys blocked until the stamps run out.
    tasks.close();
    if tokio::time::timeout(wait, tasks.wait()).await.is_err() {
        tracing::warn!(
            left = tasks.len(),
            "shutdown: fenced forwards still running"
        );
    }
}

/// `fencer gateway`.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> Result<(), StartError> {
    if !settings.gateway.enforce {
        tracing::warn!("gateway.enforce = false: fencing tokens are NOT checked");
    }
    if !settings.gateway.write_methods.is_empty() {
        tracing::warn!(
            read_methods = ?settings.gateway.read_methods,
            "gateway.write_methods is deprecated and ignored: every method outside gateway.read_methods is a write"
        );
    }
    let store_name = settings.gateway.fence_store.map_or("unset", |k| k.as_str());
    let registry = crate::metrics::registry("gateway", store_name);
    let tls = tls_config(&settings.gateway)?;
    let gateway = build(&settings, &registry).await?;
    let listener = crate::http::listen::bind("gateway", settings.gateway.listen).await?;
    let admin = crate::http::listen::bind("admin", settings.admin.listen).await?;
    tracing::info!(
        listen = %settings.gateway.listen, tls = tls.is_some(), upstream = %settings.gateway.upstream,
        store = gateway.store.name(), enforce = gateway.enforce, "gateway listening"
    );
    let admin_state = Arc::new(AdminState {
        registry,
        readiness: readiness(&gateway),
    });
    let admin_task = tokio::spawn(crate::http::listen::serve(
        "admin",
        admin,
        crate::admin::router(admin_state),
        settings.http.silence(),
        shutdown.clone(),
    ));
    serve_maybe_tls(gateway, listener, tls, settings.http.silence(), shutdown).await;
    let _ = tokio::time::timeout(Duration::from_secs(1), admin_task).await;
    Ok(())
}
