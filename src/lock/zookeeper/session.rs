//! The one ZooKeeper session a sidecar keeps, and what happens when it ends.
//!
//! Every lock node is ephemeral: it lives exactly as long as this session.
//! The client library moves a session between the ensemble's members on its
//! own (a disconnect is not an expiry), so a supervisor only acts on the
//! terminal states: on `Expired` (or `AuthFailed`) it opens a new session
//! with a new *generation* number and bumps the failover counter, and the
//! sidecar re-checks every lease (`check_many`): those of the old
//! generation all answer `Free`, so they are reported lost at once, not one
//! by one as renewals fail.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::watch;
use zookeeper_client as zk;

use super::expiry::ServerTime;
use super::settings::ZooKeeperSettings;
use crate::lock::{BackendError, WakeSink};
use crate::metrics::zookeeper::ZooKeeperMetrics;

/// One established session.
pub struct Session {
    pub client: zk::Client,
    /// Counts sessions since start; nodes and local state are tagged with it.
    pub generation: u64,
    /// The offset added to every creation zxid, and its node's version
    /// (see `raise_token_floor`), as last read.
    pub offset: Mutex<(u64, i32)>,
    /// The ensemble time stamped on our newest write, and when its answer
    /// came: to schedule checks of other nodes' lease-expiry records
    /// ([`super::expiry`]), never to decide them.
    pub clock: Mutex<Option<(ServerTime, tokio::time::Instant)>>,
}

impl Session {
    /// Records the time the leader stamped on a write of ours that was just
    /// answered; returns it.
    pub fn saw(&self, stat: &zk::Stat) -> ServerTime {
        let t = ServerTime::of(stat);
        let now = tokio::time::Instant::now();
        let mut clock = self.clock.lock().expect("clock");
        if clock.is_none_or(|(old, _)| (t.epoch, t.ms) >= (old.epoch, old.ms)) {
            *clock = Some((t, now));
        }
        t
    }

    /// The newest write's time and when its answer came.
    pub fn clock(&self) -> Option<(ServerTime, tokio::time::Instant)> {
        *self.clock.lock().expect("clock")
    }
}

/// The current session, if any, and the supervisor's outputs.
pub struct Sessions {
    current: RwLock<Option<Arc<Session>>>,
    /// Bumped when a session ended (see the module comment).
    pub failovers: watch::Sender<u64>,
    /// The granted session timeout in ms (the asked one until connected).
    pub granted_ms: AtomicU64,
    /// The ensemble (`host:port,…`), named when there is no session.
    hosts: String,
}

impl Sessions {
    pub fn current(&self) -> Result<Arc<Session>, BackendError> {
        self.current
            .read()
            .expect("session lock")
            .clone()
            .ok_or_else(|| {
                BackendError::Unavailable(format!("no ZooKeeper session with {}", self.hosts))
            })
    }

    pub fn generation(&self) -> Option<u64> {
        self.current
            .read()
            .expect("session lock")
            .as_ref()
            .map(|s| s.generation)
    }
}

/// What a connection needs besides the address.
pub struct Connect {
    pub settings: ZooKeeperSettings,
    pub root: String,
    pub offset_path: String,
    pub acls: zk::Acls<'static>,
}

impl Connect {
    async fn open(&self) -> Result<zk::Client, BackendError> {
        let s = &self.settings;
        let mut connector = zk::Client::connector().with_session_timeout(s.session_timeout());
        if let Some(d) = &s.auth_digest {
            connector = connector.with_auth("digest", d.as_bytes());
        }
        let hosts = s.hosts().join(",");
        let connecting = async move {
            if s.tls {
                let tls = tls_options(s).map_err(|e| {
                    BackendError::Unavailable(format!("ZooKeeper TLS settings: {e}"))
                })?;
                connector.with_tls(tls).secure_connect(&hosts).await
            } else {
                connector.connect(&hosts).await
            }
            .map_err(|e| BackendError::Unavailable(format!("ZooKeeper {hosts}: connect: {e}")))
        };
        tokio::time::timeout(s.connect_timeout(), connecting)
            .await
            .map_err(|_| {
                BackendError::Unavailable(format!(
                    "ZooKeeper {}: connect timed out",
                    s.hosts().join(",")
                ))
            })?
    }

    /// Creates the root, its `locks` child and the token-offset node when
    /// missing (persistent; concurrent sidecars may race, NodeExists is fine).
    async fn prepare(&self, client: &zk::Client) -> Result<(u64, i32), BackendError> {
        let t = self.settings.request_timeout();
        let persistent = zk::CreateMode::Persistent.with_acls(self.acls);
        let mut path = String::new();
        let locks = format!("{}/locks", self.root);
        for seg in locks[1..].split('/') {
            path.push('/');
            path.push_str(seg);
            match call(t, client.create(&path, b"", &persistent)).await {
                Ok(_) | Err(Failed::Zk(zk::Error::NodeExists)) => {}
                Err(e) => return Err(e.into_backend("create root")),
            }
        }
        match call(t, client.create(&self.offset_path, b"0", &persistent)).await {
            Ok(_) | Err(Failed::Zk(zk::Error::NodeExists)) => {}
            Err(e) => return Err(e.into_backend("create token offset")),
        }
        read_offset(client, &self.offset_path, t).await
    }
}

fn tls_options(s: &ZooKeeperSettings) -> Result<zk::TlsOptions, zk::Error> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let read = |p: &str| {
        std::fs::read_to_string(p).map_err(|e| zk::Error::UnexpectedError(format!("{p}: {e}")))
    };
    let mut tls = zk::TlsOptions::new();
    if let Some(ca) = &s.ca_file {
        tls = tls.with_pem_ca(&read(ca)?)?;
    }
    if let (Some(c), Some(k)) = (&s.cert_file, &s.key_file) {
        tls = tls.with_pem_identity(&read(c)?, &read(k)?)?;
    }
    Ok(tls)
}

/// Reads the token offset and its version.
pub async fn read_offset(
    client: &zk::Client,
    path: &str,
    t: Duration,
) -> Result<(u64, i32), BackendError> {
    let (data, stat) = call(t, client.get_data(path))
        .await
        .map_err(|e| e.into_backend("read token offset"))?;
    let offset = std::str::from_utf8(&data)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .ok_or_else(|| {
            BackendError::Protocol(format!(
                "{path} holds no number: {:?}",
                String::from_utf8_lossy(&data)
            ))
        })?;
    Ok((offset, stat.version))
}

/// Opens sessions until the backend is dropped; see the module comment.
pub fn supervise(
    connect: Connect,
    sessions: Arc<Sessions>,
    wake: Arc<dyn WakeSink>,
    metrics: Arc<ZooKeeperMetrics>,
) {
    let weak = Arc::downgrade(&sessions);
    drop(sessions);
    tokio::spawn(async move {
        let mut generation = 0;
        let mut backoff = Duration::from_millis(100);
        loop {
            let opened = match connect.open().await {
                Ok(client) => match connect.prepare(&client).await {
                    Ok(offset) => Ok((client, offset)),
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            };
            let Some(sessions) = weak.upgrade() else {
                return;
            };
            let (client, offset) = match opened {
                Ok(x) => x,
                Err(e) => {
                    metrics
                        .session_events
                        .with_label_values(&["connect_failed"])
                        .inc();
                    tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64,
                        "ZooKeeper session could not be established");
                    drop(sessions);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            backoff = Duration::from_millis(100);
            generation += 1;
            let granted = client.session_timeout();
            sessions
                .granted_ms
                .store(granted.as_millis() as u64, Ordering::Relaxed);
            metrics.session_timeout.set(granted.as_secs_f64());
            metrics.session_up.set(1);
            metrics
                .session_events
                .with_label_values(&["connected"])
                .inc();
            tracing::info!(session = %client.session_id(), generation,
                granted_ms = granted.as_millis() as u64, "ZooKeeper session established");
            let asked = connect.settings.session_timeout();
            if granted < asked {
                // Leases longer than 45% of the granted session are now
                // refused (400 ttl_too_long), the default TTL included if
                // it no longer fits: the ensemble's maxSessionTimeout.
                tracing::warn!(granted_ms = granted.as_millis() as u64,
                    asked_ms = asked.as_millis() as u64,
                    "ZooKeeper granted a shorter session than backend.zookeeper.session_timeout_ms asks (the ensemble's maxSessionTimeout): leases are capped at 45% of the granted one");
            }
            let mut states = client.state_watcher();
            *sessions.current.write().expect("session lock") = Some(Arc::new(Session {
                client,
                generation,
                offset: Mutex::new(offset),
                clock: Mutex::new(None),
            }));
            if generation > 1 {
                // The previous session's leases are gone: let the sidecar
                // find them (check_many) and waiters re-queue.
                sessions.failovers.send_modify(|n| *n += 1);
                wake.resync();
            }
            drop(sessions);
            let ended = loop {
                let state = states.changed().await;
                if weak.strong_count() == 0 {
                    return;
                }
                match state {
                    zk::SessionState::Disconnected => {
                        metrics.session_up.set(0);
                        metrics
                            .session_events
                            .with_label_values(&["disconnected"])
                            .inc();
                        tracing::warn!(
                            generation,
                            "ZooKeeper disconnected; the session lives on until it expires"
                        );
                    }
                    zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly => {
                        metrics.session_up.set(1);
                        metrics
                            .session_events
                            .with_label_values(&["reconnected"])
                            .inc();
                        tracing::info!(generation, "ZooKeeper reconnected with the same session");
                        wake.resync();
                    }
                    zk::SessionState::Expired => break "expired",
                    zk::SessionState::AuthFailed => break "auth_failed",
                    zk::SessionState::Closed => break "expired",
                }
            };
            metrics.session_up.set(0);
            metrics.session_events.with_label_values(&[ended]).inc();
            tracing::error!(
                generation,
                reason = ended,
                "ZooKeeper session ended: every lease it held is lost"
            );
            let Some(sessions) = weak.upgrade() else {
                return;
            };
            *sessions.current.write().expect("session lock") = None;
            sessions.failovers.send_modify(|n| *n += 1);
        }
    });
}

impl Sessions {
    /// `hosts`: the ensemble as errors name it (`host:port,…`).
    pub fn new(asked: Duration, hosts: String) -> Arc<Sessions> {
        Arc::new(Sessions {
            current: RwLock::new(None),
            failovers: watch::channel(0).0,
            granted_ms: AtomicU64::new(asked.as_millis() as u64),
            hosts,
        })
    }
}

/// Why a bounded request failed.
#[derive(Debug)]
pub enum Failed {
    /// No answer in time: the outcome is unknown.
    Timeout,
    Zk(zk::Error),
}

impl Failed {
    pub fn into_backend(self, what: &str) -> BackendError {
        match self {
            Failed::Timeout => BackendError::Unavailable(format!("ZooKeeper {what}: timed out")),
            Failed::Zk(e) => BackendError::Unavailable(format!("ZooKeeper {what}: {e}")),
        }
    }
}

/// Runs one request with a bound.
pub async fn call<T>(
    t: Duration,
    fut: impl std::future::Future<Output = Result<T, zk::Error>>,
) -> Result<T, Failed> {
    match tokio::time::timeout(t, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Failed::Zk(e)),
        Err(_) => Err(Failed::Timeout),
    }
}
