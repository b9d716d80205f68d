//! The sidecar role: the lock API beside an application.

pub mod api;
pub mod api_hot;
pub mod api_multi;
pub mod api_semaphores;
pub mod api_state;
pub mod dapr;
pub mod dapr_grpc;
pub mod dapr_lock;
pub mod dapr_meta;
pub mod dapr_store;
pub mod egress;
pub mod hold;
pub mod leases;
pub mod locks;
pub mod preregister;
pub mod request;
pub mod sequence;
pub mod settings;
pub mod waiters;
pub mod webhook;

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use self::egress::Egress;
use self::leases::LeaseTable;
use self::locks::{LockManager, LockManagerConfig};
use self::preregister::Preregistrar;
use self::waiters::WaitQueues;
use crate::admin::{AdminState, Readiness, ReadyFuture};
use crate::http::listen::{bind, bind_unix, serve, serve_unix, UnixSocket};
use crate::lock::etcd::EtcdBackend;
use crate::lock::memory::MemoryBackend;
use crate::lock::mysql::MySqlBackend;
use crate::lock::postgres::PgBackend;
use crate::lock::redis::RedisBackend;
use crate::lock::redlock::RedLockBackend;
use crate::lock::settings::BackendKind;
use crate::lock::zookeeper::ZooKeeperBackend;
use crate::lock::{DynBackend, WakeSink};
use crate::metrics::Metrics;
use crate::proxy::forward::Forwarder;
use crate::routes::Routes;
use crate::settings::Settings;
use crate::start::StartError;
use crate::token::Signer;

pub fn build_backend(
    settings: &Settings,
    wake: Arc<dyn WakeSink>,
    registry: &prometheus::Registry,
) -> Result<DynBackend, StartError> {
    let delay = Duration::from_millis(settings.sidecar.lock_delay_ms);
    Ok(match backend_kind(settings)? {
        BackendKind::Memory => Arc::new(MemoryBackend::new(delay, wake)),
        BackendKind::Redis => Arc::new(RedisBackend::new(
            &settings.backend.redis,
            delay,
            wake,
            registry,
        )?),
        BackendKind::RedLock => Arc::new(RedLockBackend::new(
            &settings.backend.redlock,
            delay,
            wake,
            registry,
        )?),
        BackendKind::Postgres => Arc::new(PgBackend::new(&settings.backend.postgres, delay, wake)?),
        BackendKind::MySql => Arc::new(MySqlBackend::new(
            &settings.backend.mysql,
            delay,
            wake,
            registry,
        )?),
        BackendKind::Etcd => Arc::new(EtcdBackend::new(
            &settings.backend.etcd,
            delay,
            wake,
            registry,
        )?),
        BackendKind::ZooKeeper => Arc::new(ZooKeeperBackend::new(
            &settings.backend.zookeeper,
            delay,
            wake,
            registry,
        )?),
    })
}

/// The configured lock backend. None is a configuration error, not the
/// memory backend: locks that vanish with the process must be chosen.
pub fn backend_kind(settings: &Settings) -> Result<BackendKind, StartError> {
    settings.backend.kind.ok_or_else(|| {
        StartError::config(
            "backend.kind",
            "required: redis, redlock, postgres, zookeeper, mysql, etcd, or memory (development only: locks vanish with the process)",
        )
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
    /// The backend has answered at least once since start.
    reached: Arc<std::sync::atomic::AtomicBool>,
}

/// The sidecar's `/readyz`: not ready until the backend has answered once
/// (start-up), then ready until shutdown.
///
/// A native sidecar's readiness counts for its pod's, so a readiness that
/// followed the backend took every application pod out of its Services
/// whenever Redis restarted (issue 10 item 9) — including pods that use
/// locks for a fraction of their work. After start-up a backend outage shows
/// where it belongs: acquires answer 503 `backend_unavailable`,
/// `fencer_backend_up` drops to 0 and the `FencerBackendErrors` alert fires.
/// `/readyz?backend=1` still reports the backend's state now.
struct BackendReady {
    locks: Arc<LockManager>,
    shutdown: CancellationToken,
    reached: Arc<std::sync::atomic::AtomicBool>,
}

impl Readiness for BackendReady {
    fn check(&self) -> ReadyFuture {
        self.check_with(false)
    }

    fn check_with(&self, backend_now: bool) -> ReadyFuture {
        use std::sync::atomic::Ordering;
        let locks = self.locks.clone();
        let shutting_down = self.shutdown.is_cancelled();
        let reached = self.reached.clone();
        Box::pin(async move {
            if shutting_down {
                return Err("shutting down".into());
            }
            if reached.load(Ordering::Relaxed) && !backend_now {
                return Ok(());
            }
            locks.backend().ping().await.map_err(|e| e.to_string())?;
            reached.store(true, Ordering::Relaxed);
            Ok(())
        })
    }
}

impl Sidecar {
    /// Builds the sidecar; its metrics go to `registry` (a fresh one for the
    /// sidecar role, shared with the other roles in `fencer dev`).
    pub fn new(
        settings: Settings,
        shutdown: CancellationToken,
        registry: Option<prometheus::Registry>,
    ) -> Result<Sidecar, StartError> {
        settings.validate_sidecar()?;
        let s = &settings.sidecar;
        let waiters = Arc::new(WaitQueues::new(s.max_waiters));
        let kind = settings.backend.kind.map_or("none", |k| k.as_str());
        let registry = registry.unwrap_or_else(|| crate::metrics::registry("sidecar", kind));
        let backend = build_backend(&settings, waiters.clone(), &registry)?;
        let groups = Arc::new(crate::metrics::Groups::new(&settings.metrics));
        let metrics = Arc::new(Metrics::new(&registry, groups));
        metrics.init_known(backend.name());
        // With RedLock the deadline is the RedLock validity: TTL less the
        // masters' possible drift (and 2 ms of their clock granularity),
        // counted from the send time.
        let (drift, margin) = match settings.backend.kind {
            Some(BackendKind::RedLock) => (
                s.clock_drift_ratio
                    .max(settings.backend.redlock.clock_drift_ratio),
                s.safety_margin_ms + 2,
            ),
            _ => (s.clock_drift_ratio, s.safety_margin_ms),
        };
        let leases = LeaseTable::new(
            drift,
            Duration::from_millis(margin),
            s.max_leases,
            Duration::from_millis(s.lost_lease_retention_ms),
        );
        let locks = Arc::new(LockManager::new(
            backend,
            leases,
            waiters,
            signer(&settings)?,
            metrics.clone(),
            LockManagerConfig {
                preregister: (!s.preregister_url.is_empty())
                    .then(|| {
                        Preregistrar::new(
                            &s.preregister_url,
                            &s.preregister_tls,
                            Duration::from_millis(s.preregister_timeout_ms),
                        )
                        .map_err(|e| config_err("sidecar.preregister_url", e))
                    })
                    .transpose()?,
                max_hold: (s.max_hold_ms > 0).then(|| Duration::from_millis(s.max_hold_ms)),
                webhook: (!s.lost_lease_webhook.is_empty()).then(|| {
                    webhook::Webhook::start(
                        s.lost_lease_webhook.clone(),
                        Duration::from_millis(s.webhook_timeout_ms),
                        metrics.webhook_deliveries.clone(),
                    )
                }),
                max_leases: s.max_leases,
                backend_view_per_second: s.backend_view_per_second,
                max_fallback: Duration::from_millis(s.max_fallback_ms),
                default_ttl: Duration::from_millis(s.default_ttl_ms),
            },
            shutdown.clone(),
        ));
        Ok(Sidecar {
            locks,
            metrics,
            settings,
            shutdown,
            reached: Default::default(),
        })
    }

    pub fn readiness(&self) -> Arc<dyn Readiness> {
        Arc::new(BackendReady {
            locks: self.locks.clone(),
            shutdown: self.shutdown.clone(),
            reached: self.reached.clone(),
        })
    }

    pub fn admin_state(&self) -> Arc<AdminState> {
        Arc::new(AdminState {
            registry: self.metrics.registry.clone(),
            readiness: self.readiness(),
        })
    }

    /// What the lock API's and the Dapr APIs' handlers share.
    fn api_state(&self) -> Arc<api_state::ApiState> {
        let s = &self.settings.sidecar;
        Arc::new(api_state::ApiState {
            locks: self.locks.clone(),
            metrics: self.metrics.clone(),
            defaults: request::Defaults {
                ttl_ms: s.default_ttl_ms,
                wait_ms: s.default_wait_ms,
                keepalive_ms: s.keepalive_ms,
            },
            hold_heartbeat: Duration::from_millis(s.hold_heartbeat_ms),
            shutdown: self.shutdown.clone(),
            dapr_stores: s.dapr_lock_stores.clone(),
            readiness: self.readiness(),
        })
    }

    pub fn api_service(&self) -> api_hot::LockApiService {
        let state = self.api_state();
        api_hot::LockApiService::new(
            api::router(
                state.clone(),
                dapr::routes()
                    .merge(api_semaphores::routes())
                    .merge(api_multi::routes()),
            ),
            state,
        )
    }

    /// The egress proxy, if enabled.
    pub fn egress(&self) -> Result<Option<Arc<Egress>>, StartError> {
        let p = &self.settings.proxy;
        if !p.enabled {
            return Ok(None);
        }
        let forwarder = Forwarder::new(
            &p.upstream,
            (crate::http::tls_client::PROXY, &p.upstream_tls),
            Duration::from_millis(p.connect_timeout_ms),
            Duration::from_millis(p.upstream_timeout_ms),
        )
        .map_err(|e| config_err("proxy.upstream", e))?;
        let reservations = self.metrics.sequence_reservations.clone();
        let sequencer = match self.settings.sidecar.state_dir.as_str() {
            "" => sequence::Sequencer::unpersisted(reservations),
            dir => sequence::Sequencer::open(std::path::Path::new(dir), reservations)
                .map_err(|e| config_err("sidecar.state_dir", e))?,
        };
        Ok(Some(Arc::new(Egress {
            sequencer: Arc::new(sequencer),
            locks: self.locks.clone(),
            order_wait: std::time::Duration::from_millis(
                p.upstream_timeout_ms + p.connect_timeout_ms,
            ),
            forwarder,
            routes: Routes::compile(&p.routes).map_err(|e| config_err("proxy.routes", e))?,
            read_methods: crate::proxy::headers::methods(&p.read_methods),
            require_lock_for_writes: p.require_lock_for_writes,
            require_lease: p.require_lease,
            metrics: self.metrics.clone(),
        })))
    }

    /// Re-verifies every lease each time the backend fails over (Redis
    /// Sentinel and Cluster; the other backends have no failovers of their
    /// own).
    pub fn spawn_failover_watch(&self) {
        let Some(mut failovers) = self.locks.backend().failovers() else {
            return;
        };
        let locks = self.locks.clone();
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    changed = failovers.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        locks.reverify_after_failover().await;
                    }
                    _ = shutdown.cancelled() => return,
                }
            }
        });
    }

    /// Renews sidecar-renewed leases (auto-renew, hold) as they come due.
    pub fn spawn_renewer(&self) {
        let locks = self.locks.clone();
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            // Asleep until the first renewal is due (an idle sidecar wakes
            // once a minute, not every 10 ms), then at most every 10 ms:
            // renewals due within a few ms of each other go out as one
            // batch, and renewals are due at a third of the TTL (≥ 33 ms),
            // so 10 ms of lateness is small against the other two thirds.
            let mut pace = tokio::time::interval(Duration::from_millis(10));
            pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = async {
                        locks.until_renewal_due(Duration::from_secs(60)).await;
                        pace.tick().await;
                    } => locks.renew_due().await,
                    _ = shutdown.cancelled() => return,
                }
            }
        });
    }

    /// Once a second until shutdown: expires overdue leases and pings the
    /// backend for `fencer_backend_up`.
    pub fn spawn_sweeper(&self) {
        let locks = self.locks.clone();
        let shutdown = self.shutdown.clone();
        let reached = self.reached.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            let name = locks.backend().name();
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        locks.sweep();
                        let up = locks.backend().ping().await.is_ok();
                        if up {
                            reached.store(true, std::sync::atomic::Ordering::Relaxed);
                        }
                        locks.metrics().backend_up.with_label_values(&[name]).set(i64::from(up));
                    }
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

fn config_err(field: &'static str, message: impl std::fmt::Display) -> StartError {
    StartError::config(field, message)
}

/// Serves the egress proxy until `shutdown`.
pub async fn serve_egress(
    egress: Arc<Egress>,
    listener: TcpListener,
    silence: crate::http::conn::Silence,
    shutdown: CancellationToken,
) {
    let handler = Arc::new(move |req| {
        let egress = egress.clone();
        crate::telemetry::spans::serve("proxy.request", req, move |req| egress.handle(req))
    });
    let drain = Duration::from_secs(5);
    crate::http::server::serve("proxy", listener, handler, shutdown, drain, silence).await;
}

/// `fencer sidecar`: runs until `shutdown` fires, then releases every lease.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> Result<(), StartError> {
    let sidecar = Sidecar::new(settings, shutdown.clone(), None)?;
    // Every listener is bound before any is served: once /healthz answers,
    // the lock API and the proxy accept connections too.
    let listeners = sidecar.bind().await?;
    let admin = bind("admin", sidecar.settings.admin.listen).await?;
    let admin_task = tokio::spawn(serve(
        "admin",
        admin,
        crate::admin::router(sidecar.admin_state()),
        sidecar.settings.http.silence(),
        shutdown.clone(),
    ));
    run_with(sidecar, listeners, shutdown).await?;
    let _ = tokio::time::timeout(Duration::from_secs(1), admin_task).await;
    Ok(())
}

/// The sidecar's bound lock-API and (if enabled) proxy and Dapr gRPC
/// listeners.
pub struct Listeners {
    api: TcpListener,
    api_unix: Option<UnixSocket>,
    proxy: Option<(Arc<Egress>, TcpListener)>,
    dapr_grpc: Option<TcpListener>,
}

impl Listeners {
    /// Where Dapr's gRPC API listens, if it does.
    pub fn dapr_grpc_addr(&self) -> Option<std::net::SocketAddr> {
        self.dapr_grpc.as_ref().and_then(|l| l.local_addr().ok())
    }
}

/// Whether a Dapr gRPC address that cannot be bound stops the start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DaprGrpcBind {
    /// `fencer sidecar`: a configured listener is part of the contract.
    Required,
    /// `fencer dev`, which takes Dapr's default port unasked: a port that
    /// is taken (a real daprd, another `fencer dev`) turns the gRPC API
    /// off, with an error saying so, rather than the whole stack.
    BestEffort,
}

impl Sidecar {
    /// Binds the lock API, the egress proxy and Dapr's gRPC API (all that
    /// are configured); a listener that cannot be bound stops the start.
    pub async fn bind(&self) -> Result<Listeners, StartError> {
        self.bind_with(DaprGrpcBind::Required).await
    }

    /// [`Self::bind`], with the Dapr gRPC listener `required` or not.
    pub async fn bind_with(&self, dapr_grpc: DaprGrpcBind) -> Result<Listeners, StartError> {
        let api = bind("lock API", self.settings.sidecar.listen).await?;
        let api_unix = match self.settings.sidecar.listen_unix.as_str() {
            "" => None,
            path => Some(bind_unix("lock API", path)?),
        };
        let proxy = match self.egress()? {
            Some(egress) => Some((
                egress,
                bind("egress proxy", self.settings.proxy.listen).await?,
            )),
            None => None,
        };
        let dapr_grpc = match self.settings.sidecar.dapr_grpc_addr()? {
            None => None,
            Some(addr) => match bind("Dapr gRPC API", addr).await {
                Ok(l) => Some(l),
                Err(e) if dapr_grpc == DaprGrpcBind::BestEffort => {
                    tracing::error!(error = %e, "Dapr gRPC API off: its port is taken");
                    crate::errln!(
                        "fencer dev: {e}. Dapr's gRPC API is off (is a daprd or another fencer dev running?); \
                         set FENCER__SIDECAR__DAPR_GRPC_LISTEN to a free address to serve it."
                    );
                    None
                }
                Err(e) => return Err(e),
            },
        };
        Ok(Listeners {
            api,
            api_unix,
            proxy,
            dapr_grpc,
        })
    }
}

/// Runs the lock API and egress proxy of a built sidecar until `shutdown`,
/// then releases every lease.
pub async fn run_with(
    sidecar: Sidecar,
    listeners: Listeners,
    shutdown: CancellationToken,
) -> Result<(), StartError> {
    let api_addr = sidecar.settings.sidecar.listen;
    let silence = sidecar.settings.http.silence();
    let api = listeners.api;
    let proxy_task = match listeners.proxy {
        Some((egress, listener)) => {
            let addr = sidecar.settings.proxy.listen;
            tracing::info!(proxy = %addr, upstream = %sidecar.settings.proxy.upstream, "egress proxy listening");
            Some(tokio::spawn(serve_egress(
                egress,
                listener,
                silence,
                shutdown.clone(),
            )))
        }
        None => None,
    };
    tracing::info!(
        api = %api_addr,
        backend = sidecar.locks.backend().name(),
        preregister = %sidecar.settings.sidecar.preregister_url,
        "sidecar listening"
    );
    for w in sidecar.settings.sidecar_warnings() {
        tracing::warn!(warning = %w, "configuration: tokens can go back");
    }
    sidecar.spawn_sweeper();
    sidecar.spawn_renewer();
    sidecar.spawn_failover_watch();
    let api_task = tokio::spawn(serve(
        "api",
        api,
        sidecar.api_service(),
        silence,
        shutdown.clone(),
    ));
    let grpc_task = listeners.dapr_grpc.map(|listener| {
        tracing::info!(dapr_grpc = %sidecar.settings.sidecar.dapr_grpc_listen, "Dapr gRPC API listening");
        tokio::spawn(serve(
            "dapr_grpc",
            listener,
            dapr_grpc::router(sidecar.api_state()),
            silence,
            shutdown.clone(),
        ))
    });
    let unix_task = listeners.api_unix.map(|socket| {
        tracing::info!(api_unix = %sidecar.settings.sidecar.listen_unix, "lock API on unix socket");
        tokio::spawn(serve_unix(
            socket,
            sidecar.api_service(),
            silence,
            shutdown.clone(),
        ))
    });
    shutdown.cancelled().await;
    // Waiters were cancelled by the token; let in-flight calls finish so an
    // acquire that completes now is released below, not left to its TTL.
    let _ = tokio::time::timeout(Duration::from_secs(2), api_task).await;
    for task in [unix_task, grpc_task].into_iter().flatten() {
        let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
    }
    if let Some(task) = proxy_task {
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    }
    tracing::info!("shutting down: releasing leases");
    sidecar.release_all().await;
    Ok(())
}
