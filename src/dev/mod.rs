//! `fencer dev`: sidecar (memory locks) + gateway (memory fences) + demo
//! storage in one process, wired together, with one metrics endpoint.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::admin::AdminState;
use crate::gateway::settings::FenceStoreKind;
use crate::http::listen::{bind, serve};
use crate::lock::settings::BackendKind;
use crate::settings::Settings;
use crate::sidecar::Sidecar;
use crate::start::StartError;

pub struct Stack {
    pub api: SocketAddr,
    pub proxy: SocketAddr,
    pub gateway: SocketAddr,
    pub storage: SocketAddr,
    pub admin: SocketAddr,
    /// Dapr's gRPC API, unless it is off or its port was taken.
    pub dapr_grpc: Option<SocketAddr>,
    pub shutdown: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// A free loopback port (for stacks started by `fencer demo`).
pub fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("loopback is available")
}

impl Stack {
    /// Starts the three roles on the addresses in `settings`, forcing the
    /// in-process backends and wiring proxy → gateway → storage.
    pub async fn start(
        mut settings: Settings,
        shutdown: CancellationToken,
    ) -> Result<Stack, StartError> {
        settings.backend.kind = Some(BackendKind::Memory);
        settings.gateway.fence_store = Some(FenceStoreKind::Memory);
        settings.storage.backend = FenceStoreKind::Memory;
        if settings.signing_secret()?.is_none() {
            let mut secret = vec![0u8; 32];
            rand::RngCore::fill_bytes(&mut rand::rng(), &mut secret);
            settings.signing_secret_override = Some(secret);
        }
        let gateway_addr = settings.gateway.listen;
        let storage_addr = settings.storage.listen;
        if settings.sidecar.dapr_lock_stores.is_empty() {
            // The store name Dapr's quickstarts use.
            settings
                .sidecar
                .dapr_lock_stores
                .push(crate::sidecar::dapr_store::DaprLockStore {
                    name: "lockstore".into(),
                    // Shared with /v1/locks on purpose: the walkthrough's
                    // routes map storage paths to these very keys.
                    key_prefix: Some(String::new()),
                });
        }
        settings.proxy.enabled = true;
        settings.proxy.upstream = format!("http://{gateway_addr}");
        settings.gateway.upstream = format!("http://{storage_addr}");
        settings.sidecar.preregister_url =
            format!("http://{gateway_addr}{}", settings.gateway.fence_api_prefix);
        settings.validate()?;

        let registry = crate::metrics::registry("dev", "memory");
        let mut tasks = Vec::new();

        let store = crate::storage::build(&settings).await?;
        let storage_listener = bind("storage", storage_addr).await?;
        tasks.push(tokio::spawn(serve(
            "storage",
            storage_listener,
            crate::storage::router(store),
            settings.http.silence(),
            shutdown.clone(),
        )));

        let gateway = crate::gateway::build(&settings, &registry).await?;
        let gateway_listener = bind("gateway", gateway_addr).await?;
        tasks.push(tokio::spawn(crate::gateway::serve(
            gateway,
            gateway_listener,
            settings.http.silence(),
            shutdown.clone(),
        )));

        let silence = settings.http.silence();
        let (api, proxy, admin) = (
            settings.sidecar.listen,
            settings.proxy.listen,
            settings.admin.listen,
        );
        let sidecar = Sidecar::new(settings, shutdown.clone(), Some(registry.clone()))?;
        let admin_state = Arc::new(AdminState {
            registry,
            readiness: sidecar.readiness(),
        });
        let admin_listener = bind("admin", admin).await?;
        tasks.push(tokio::spawn(serve(
            "admin",
            admin_listener,
            crate::admin::router(admin_state),
            silence,
            shutdown.clone(),
        )));
        let listeners = sidecar
            .bind_with(crate::sidecar::DaprGrpcBind::BestEffort)
            .await?;
        let dapr_grpc = listeners.dapr_grpc_addr();
        let sc_shutdown = shutdown.clone();
        tasks.push(tokio::spawn(async move {
            if let Err(e) = crate::sidecar::run_with(sidecar, listeners, sc_shutdown).await {
                tracing::error!(error = %e, "sidecar failed");
            }
        }));
        Ok(Stack {
            api,
            proxy,
            gateway: gateway_addr,
            storage: storage_addr,
            admin,
            dapr_grpc,
            shutdown,
            tasks,
        })
    }

    /// Stops every role (the sidecar releases its leases) and waits.
    pub async fn stop(self) {
        self.shutdown.cancel();
        for task in self.tasks {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(10), task).await;
        }
    }
}

/// `fencer dev`: loopback defaults for every listener unless configured.
pub async fn run(mut settings: Settings, shutdown: CancellationToken) -> Result<(), StartError> {
    let loopback = |var: &str, addr: &mut SocketAddr, default: &str| {
        if std::env::var(var).is_err() {
            *addr = default.parse().expect("static addr");
        }
    };
    loopback(
        "FENCER__ADMIN__LISTEN",
        &mut settings.admin.listen,
        "127.0.0.1:9411",
    );
    loopback(
        "FENCER__GATEWAY__LISTEN",
        &mut settings.gateway.listen,
        "127.0.0.1:8080",
    );
    // Dapr's default gRPC port, where Dapr's SDKs look first (taken
    // already: served without it, see `DaprGrpcBind::BestEffort`).
    if std::env::var("FENCER__SIDECAR__DAPR_GRPC_LISTEN").is_err()
        && settings.sidecar.dapr_grpc_listen.is_empty()
    {
        settings.sidecar.dapr_grpc_listen = DAPR_GRPC_DEFAULT.into();
    }
    let stack = Stack::start(settings, shutdown.clone()).await?;
    let (api, proxy, gw, st, admin) = (
        stack.api,
        stack.proxy,
        stack.gateway,
        stack.storage,
        stack.admin,
    );
    let dapr_grpc = stack
        .dapr_grpc
        .map_or_else(|| "off".to_owned(), |a| a.to_string());
    crate::outln!(
        "fencer dev is running (in-process locks, fences and storage):
  lock API       http://{api}   (also Dapr's HTTP API: DAPR_HTTP_PORT={})
  Dapr gRPC API  {dapr_grpc}   (store \"lockstore\"; docs/dapr.md)
  egress proxy   http://{proxy}   -> gateway http://{gw} -> storage http://{st}
  metrics        http://{admin}/metrics

The fencing story, in another terminal (needs curl and jq):

{}
Ctrl-C to stop.",
        api.port(),
        walkthrough(&[api, proxy, gw, st, admin])
    );
    shutdown.cancelled().await;
    stack.stop().await;
    Ok(())
}

/// Dapr's default gRPC address, which `fencer dev` takes when it is free.
pub const DAPR_GRPC_DEFAULT: &str = "127.0.0.1:50001";

/// The README's quick start (between its `walkthrough` markers, compared by
/// tests/dev.rs), written for the default ports.
pub const WALKTHROUGH: &str = include_str!("walkthrough.sh");

/// The default address of each role, in the order [`walkthrough`] takes
/// them: lock API, proxy, gateway, storage, metrics.
const DEFAULT_PORTS: [u16; 5] = [7411, 7412, 8080, 8081, 9411];

/// [`WALKTHROUGH`] for the addresses this stack listens on: text a person
/// can paste as printed, identical to README's on the default ports.
pub fn walkthrough(addrs: &[SocketAddr; 5]) -> String {
    let mut text = WALKTHROUGH.to_string();
    for (port, addr) in DEFAULT_PORTS.iter().zip(addrs) {
        let at_default =
            addr.port() == *port && (addr.ip().is_loopback() || addr.ip().is_unspecified());
        if !at_default {
            text = text.replace(&format!("localhost:{port}/"), &format!("{addr}/"));
        }
    }
    text
}
