//! Which role a configuration is for, and that role's start-up checks.
//!
//! The promise: `check-config` exit 0 for a role means `fencer <role>`
//! with the same configuration does not exit 2. So each check below calls
//! what the role's start calls (`validate_sidecar`, `signing_secret`,
//! `gateway_keys`, the forwarders' URL parsing, the TLS loaders) rather
//! than a second copy of the rules; what the start only learns by
//! connecting is `--live`'s job.

use std::collections::BTreeSet;
use std::time::Duration;

use clap::ValueEnum;

use super::files::Findings;
use crate::gateway::settings::FenceStoreKind;
use crate::http::tls_client::{self, Link, UpstreamTls};
use crate::lock::settings::BackendKind;
use crate::settings::{ConfigError, Settings};
use crate::start::StartError;

/// The role a configuration is checked for (`--role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Role {
    Sidecar,
    Gateway,
    Inject,
    Storage,
    Dev,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Sidecar => "sidecar",
            Role::Gateway => "gateway",
            Role::Inject => "inject",
            Role::Storage => "storage",
            Role::Dev => "dev",
        }
    }

    /// The role a configuration is for when `--role` is not given, and
    /// why. `sections` are the top-level sections the file or a
    /// `FENCER__` variable names. First match wins:
    /// `backend.kind` set: sidecar (only a sidecar holds locks);
    /// `gateway.fence_store` set: gateway; `[gateway]` without `[sidecar]`,
    /// `[proxy]` or `[backend]`: gateway (a sidecar's file carries the
    /// gateway's timeouts in `[gateway]`); `[inject]`: inject; `[storage]`:
    /// storage. Otherwise none: only the checks every role shares run.
    pub fn infer(settings: &Settings, sections: &BTreeSet<String>) -> Option<(Role, &'static str)> {
        let named = |s: &str| sections.contains(s);
        if settings.backend.kind.is_some() {
            Some((Role::Sidecar, "backend.kind is set"))
        } else if settings.gateway.fence_store.is_some() {
            Some((Role::Gateway, "gateway.fence_store is set"))
        } else if named("gateway") && !named("sidecar") && !named("proxy") && !named("backend") {
            Some((
                Role::Gateway,
                "[gateway] without [sidecar], [proxy] or [backend]",
            ))
        } else if named("inject") {
            Some((Role::Inject, "[inject] is set"))
        } else if named("storage") {
            Some((Role::Storage, "[storage] is set"))
        } else {
            None
        }
    }
}

/// A start-up check's error as the configuration error it stands for.
fn config(e: StartError) -> ConfigError {
    match e {
        StartError::Config(c) => c,
        other => ConfigError::Load(other.to_string()),
    }
}

/// The checks `fencer <role>` runs before it connects anything.
/// `read_files`: false skips the secret and certificate files and secret
/// variables (a manifest checked on a machine without its mounts).
/// Returns every failure found.
pub(crate) fn check(settings: &Settings, role: Role, read_files: bool) -> Vec<ConfigError> {
    let mut f = Findings::default();
    match role {
        Role::Sidecar => sidecar(settings, read_files, &mut f),
        Role::Gateway => gateway(settings, read_files, &mut f),
        Role::Inject => {
            let i = &settings.inject;
            if read_files {
                f.certs("inject.tls_cert_file", Some(&i.tls_cert_file));
                f.key("inject.tls_key_file", Some(&i.tls_key_file));
                // The pair together, as the injector loads it (a key that
                // does not match its certificate fails here).
                if f.errors.is_empty() {
                    f.check(
                        crate::http::tls_cert::ReloadingCert::load(
                            &i.tls_cert_file,
                            &i.tls_key_file,
                        )
                        .map_err(|e| invalid("inject.tls_cert_file", e)),
                    );
                }
            }
        }
        Role::Storage => {
            let s = &settings.storage;
            if read_files && s.backend == FenceStoreKind::Postgres {
                f.certs("storage.postgres_ca_file", s.postgres_ca_file.as_deref());
            }
        }
        Role::Dev => {
            // `fencer dev` forces the in-process stores and reads only the
            // signing secret, when one is configured.
            if read_files {
                f.check(settings.signing_secret());
            }
        }
    }
    f.errors
}

fn invalid(field: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        message: message.into(),
    }
}

/// An upstream URL as the proxy's and the gateway's forwarder takes it,
/// and with `read_files` its TLS files as the forwarder loads them.
fn upstream(
    field: &'static str,
    url: &str,
    (link, tls, read_files): (Link, &UpstreamTls, bool),
    connect_ms: u64,
    timeout_ms: u64,
) -> Result<(), ConfigError> {
    let unread = UpstreamTls::default();
    crate::proxy::forward::Forwarder::new(
        url,
        (link, if read_files { tls } else { &unread }),
        Duration::from_millis(connect_ms),
        Duration::from_millis(timeout_ms),
    )
    .map(|_| ())
    .map_err(|e| invalid(field, e.to_string()))
}

fn sidecar(settings: &Settings, read_files: bool, f: &mut Findings) {
    f.check(crate::sidecar::backend_kind(settings).map_err(config));
    f.check(settings.validate_sidecar());
    let p = &settings.proxy;
    if p.enabled {
        f.check(upstream(
            "proxy.upstream",
            &p.upstream,
            (tls_client::PROXY, &p.upstream_tls, read_files),
            p.connect_timeout_ms,
            p.upstream_timeout_ms,
        ));
        let dir = &settings.sidecar.state_dir;
        if !dir.is_empty() && read_files {
            // The proxy writes its sequence reservation there at start.
            let ok =
                std::fs::metadata(dir).is_ok_and(|m| m.is_dir() && !m.permissions().readonly());
            if !ok {
                f.check::<()>(Err(invalid(
                    "sidecar.state_dir",
                    format!("{dir}: not a writable directory"),
                )));
            }
        }
    }
    if !read_files {
        return;
    }
    let s = &settings.sidecar;
    if !s.preregister_url.is_empty() {
        // The TLS files of an https:// pre-registration, as the sidecar
        // loads them.
        f.check(
            crate::sidecar::preregister::Preregistrar::new(
                &s.preregister_url,
                &s.preregister_tls,
                Duration::from_millis(s.preregister_timeout_ms),
            )
            .map_err(|e| invalid("sidecar.preregister_tls", e)),
        );
    }
    // Optional for a sidecar (without one it signs with a random secret
    // no gateway accepts, and warns), but if set it must load.
    f.check(settings.signing_secret());
    let b = &settings.backend;
    match b.kind {
        Some(BackendKind::Redis) => f.certs("backend.redis.ca_file", b.redis.ca_file.as_deref()),
        Some(BackendKind::RedLock) => {
            f.certs("backend.redlock.ca_file", b.redlock.ca_file.as_deref())
        }
        Some(BackendKind::Postgres) => {
            f.certs("backend.postgres.ca_file", b.postgres.ca_file.as_deref())
        }
        Some(BackendKind::MySql) => f.certs("backend.mysql.ca_file", b.mysql.ca_file.as_deref()),
        Some(BackendKind::ZooKeeper) => {
            let z = &b.zookeeper;
            f.certs("backend.zookeeper.ca_file", z.ca_file.as_deref());
            f.certs("backend.zookeeper.cert_file", z.cert_file.as_deref());
            f.key("backend.zookeeper.key_file", z.key_file.as_deref());
        }
        Some(BackendKind::Etcd) => {
            // The password file and the TLS files, as the sidecar reads them.
            f.check(b.etcd.client_config());
            f.certs("backend.etcd.tls.ca_file", b.etcd.tls.ca_file.as_deref());
            f.check(
                b.etcd
                    .tls
                    .client_config()
                    .map(|_| ())
                    .map_err(|e| invalid("backend.etcd.tls", e)),
            );
        }
        Some(BackendKind::Memory) | None => {}
    }
}

fn gateway(settings: &Settings, read_files: bool, f: &mut Findings) {
    let g = &settings.gateway;
    f.check(crate::gateway::fence_store_kind(settings).map_err(config));
    f.check(upstream(
        "gateway.upstream",
        &g.upstream,
        (tls_client::GATEWAY, &g.upstream_tls, read_files),
        g.connect_timeout_ms,
        g.upstream_timeout_ms,
    ));
    if read_files {
        // Every accepted key's secret, read and length-checked as the
        // gateway reads it.
        f.check(settings.gateway_keys());
        if let (Some(cert), Some(key)) = (&g.tls_cert_file, &g.tls_key_file) {
            f.certs("gateway.tls_cert_file", Some(cert));
            f.key("gateway.tls_key_file", Some(key));
            f.certs(
                "gateway.tls_client_ca_file",
                g.tls_client_ca_file.as_deref(),
            );
            // Together, as the gateway loads them.
            if f.errors.is_empty() {
                f.check(crate::gateway::tls_config(g).map_err(config));
            }
        }
        match g.fence_store {
            Some(FenceStoreKind::Postgres) => {
                f.certs("gateway.postgres_ca_file", g.postgres_ca_file.as_deref())
            }
            Some(FenceStoreKind::Mysql) => {
                f.certs("gateway.mysql_ca_file", g.mysql_ca_file.as_deref())
            }
            Some(FenceStoreKind::Etcd) => {
                // The password file and the TLS files, as the gateway
                // reads them.
                f.check(g.etcd_client_config());
                f.certs("gateway.etcd_tls.ca_file", g.etcd_tls.ca_file.as_deref());
                f.check(
                    g.etcd_tls
                        .client_config()
                        .map(|_| ())
                        .map_err(|e| invalid("gateway.etcd_tls", e)),
                );
            }
            _ => {}
        }
    } else if g.keys.is_empty()
        && settings.signing.secret_file.is_none()
        && settings.signing.secret_env.is_none()
    {
        // Not read, but it must at least be configured.
        f.check(settings.gateway_keys());
    }
}
