//! The gateway role: a reverse proxy in front of the storage that enforces
//! fencing tokens.

pub mod fence_store;
pub mod handler;

use std::sync::Arc;
use std::time::Duration;

use hyper::Method;
use tokio_util::sync::CancellationToken;

use self::fence_store::memory::MemoryFences;
use self::fence_store::postgres::PgFences;
use self::fence_store::FenceStore;
use self::handler::Gateway;
use crate::admin::{AdminState, Readiness, ReadyFuture};
use crate::metrics::{GatewayMetrics, Groups};
use crate::proxy::forward::Forwarder;
use crate::routes::Routes;
use crate::settings::{FenceStoreKind, Settings};
use crate::sidecar::StartError;
use crate::token::Keyring;

pub fn methods(names: &[String]) -> Vec<Method> {
    names
        .iter()
        .filter_map(|m| Method::from_bytes(m.as_bytes()).ok())
        .collect()
}

fn config_err(field: &'static str, message: impl std::fmt::Display) -> StartError {
    StartError::config(field, message)
}

/// Builds the gateway (connects the fence store, creating its schema).
pub async fn build(
    settings: &Settings,
    registry: &prometheus::Registry,
) -> Result<Arc<Gateway>, StartError> {
    let g = &settings.gateway;
    let keyring = Keyring::new(&settings.gateway_keys()?);
    let store: Arc<dyn FenceStore> = match g.fence_store {
        FenceStoreKind::Memory => Arc::new(MemoryFences::default()),
        FenceStoreKind::Postgres => Arc::new(
            PgFences::connect(
                &g.postgres_url,
                g.postgres_ca_file.as_deref(),
                g.postgres_pool_size,
                Duration::from_millis(g.serialize_timeout_ms),
                Duration::from_secs(30),
            )
            .await
            .map_err(|e| StartError::Store(e.to_string()))?,
        ),
    };
    let forwarder = Forwarder::new(
        &g.upstream,
        Duration::from_millis(g.connect_timeout_ms),
        Duration::from_millis(g.upstream_timeout_ms),
    )
    .map_err(|e| config_err("gateway.upstream", e))?;
    let groups = Arc::new(Groups::new(&settings.metrics));
    Ok(Arc::new(Gateway {
        forwarder,
        store,
        keyring,
        routes: Routes::compile(&g.routes).map_err(|e| config_err("gateway.routes", e))?,
        write_methods: methods(&g.write_methods),
        enforce: g.enforce,
        fence_prefix: g.fence_api_prefix.clone(),
        serialize_timeout: Duration::from_millis(g.serialize_timeout_ms),
        uncertain_hold: Duration::from_millis(g.uncertain_hold_ms),
        metrics: Arc::new(GatewayMetrics::new(registry, groups)),
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

/// Serves the gateway on its listener until `shutdown`.
pub async fn serve(
    gateway: Arc<Gateway>,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) {
    let handler = Arc::new(move |req| gateway.clone().handle(req));
    crate::proxy::server::serve(
        "gateway",
        listener,
        handler,
        shutdown,
        Duration::from_secs(10),
    )
    .await;
}

/// `fencer gateway`.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> Result<(), StartError> {
    if !settings.gateway.enforce {
        tracing::warn!("gateway.enforce = false: fencing tokens are NOT checked");
    }
    let registry = crate::metrics::registry("gateway", settings.gateway.fence_store.as_str());
    let gateway = build(&settings, &registry).await?;
    let listener = crate::sidecar::bind("gateway", settings.gateway.listen).await?;
    let admin = crate::sidecar::bind("admin", settings.admin.listen).await?;
    tracing::info!(
        listen = %settings.gateway.listen, upstream = %settings.gateway.upstream,
        store = gateway.store.name(), enforce = gateway.enforce, "gateway listening"
    );
    let admin_state = Arc::new(AdminState {
        registry,
        readiness: readiness(&gateway),
    });
    let admin_task = tokio::spawn(crate::sidecar::serve(
        "admin",
        admin,
        crate::admin::router(admin_state),
        shutdown.clone(),
    ));
    serve(gateway, listener, shutdown).await;
    let _ = tokio::time::timeout(Duration::from_secs(1), admin_task).await;
    Ok(())
}
