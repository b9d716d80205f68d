//! `[sidecar]` (the lock API and lease rules) and `[proxy]` (the egress
//! proxy that injects tokens).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::http::tls_client::{UpstreamTls, PREREGISTER, PROXY};
use crate::settings::check::{
    check_methods, check_range, check_upstream_url, invalid, ConfigError,
};
use crate::settings::limits::*;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SidecarSettings {
    /// Lock API listener. Keep it on loopback: the API is unauthenticated
    /// by design (it is reachable only from the application's pod/host).
    pub listen: SocketAddr,
    /// The lock API on a Unix socket as well (empty = off), e.g. in a volume
    /// shared with the application container. Cheaper than loopback TCP:
    /// no TCP/IP stack per message (docs/performance.md).
    pub listen_unix: String,
    pub default_ttl_ms: u64,
    pub default_wait_ms: u64,
    /// Local deadline = send time + ttl * (1 - clock_drift_ratio) - safety_margin_ms.
    pub safety_margin_ms: u64,
    pub clock_drift_ratio: f64,
    /// Upper bound on leases one sidecar tracks (memory bound).
    pub max_leases: usize,
    /// Upper bound on requests queued waiting for locks.
    pub max_waiters: usize,
    /// Cap on the fallback re-check interval of a waiter (used when a lock
    /// expires without a release, which publishes nothing).
    pub max_fallback_ms: u64,
    /// How long SIGTERM waits for leases to be released before exiting.
    pub shutdown_release_timeout_ms: u64,
    /// How long a lost lease stays visible in `GET /v1/locks/{key}`.
    pub lost_lease_retention_ms: u64,
    /// Gateway base URL (`http://gateway:8080`) at which each new token is
    /// registered before the acquire returns, so no earlier holder's write
    /// can land after the new holder's first read. Empty: off.
    /// `https://` speaks TLS, configured by `preregister_tls`.
    pub preregister_url: String,
    /// TLS to the gateway for an `https://` `preregister_url`: CA, client
    /// certificate, server name (docs/tls.md).
    pub preregister_tls: UpstreamTls,
    pub preregister_timeout_ms: u64,
    /// Auto-renewed leases stop being renewed after this much silence from
    /// the application (default for `keepalive_ms` in acquire).
    pub keepalive_ms: u64,
    /// Cap on every lease's life however it is renewed; 0 = no cap.
    pub max_hold_ms: u64,
    /// How often a hold stream sends a heartbeat line.
    pub hold_heartbeat_ms: u64,
    /// After a lease ends without a release (expired or lost), nobody can
    /// acquire the key for this long (Chubby's lock-delay); 0 = off.
    /// Enforced by the backend, so it holds across sidecars.
    pub lock_delay_ms: u64,
    /// `GET /v1/locks/{key}?scope=backend` reads the backend: at most this
    /// many such reads per second from this sidecar (a burst of as many),
    /// four at a time; more answer 429 `rate_limited`. 0 = off (400).
    pub backend_view_per_second: u32,
    /// POSTed a JSON body for every lease lost without a release. Empty: off.
    pub lost_lease_webhook: String,
    pub webhook_timeout_ms: u64,
    /// Dapr lock stores served by the lock API (`/v1.0-alpha1/lock/{name}`),
    /// each a key prefix on this sidecar's backend. Empty: the Dapr API
    /// answers 400 ERR_LOCK_STORE_NOT_FOUND.
    pub dapr_lock_stores: Vec<super::dapr_store::DaprLockStore>,
    /// Dapr's gRPC API (`TryLockAlpha1`, `UnlockAlpha1`, `GetMetadata` of
    /// `dapr.proto.runtime.v1.Dapr`) on this address, e.g.
    /// `127.0.0.1:50001` (Dapr's default gRPC port, which `fencer dev`
    /// takes). Empty: off. Keep it on loopback, like the lock API.
    pub dapr_grpc_listen: String,
    /// A directory that survives a restart of this sidecar (in Kubernetes:
    /// an `emptyDir`, which the injector mounts), where the proxy reserves
    /// write sequence numbers ahead of handing them out. With it, leases
    /// adopted after a restart write on at once even when the wall clock
    /// stepped back meanwhile; without it (empty), their writes are refused
    /// (`stale_sequence`) until the clock is past the earlier process's.
    pub state_dir: String,
}

impl Default for SidecarSettings {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7411".parse().expect("static addr"),
            listen_unix: String::new(),
            default_ttl_ms: 10_000,
            default_wait_ms: 0,
            safety_margin_ms: 20,
            clock_drift_ratio: 0.01,
            max_leases: 200_000,
            max_waiters: 10_000,
            max_fallback_ms: 30_000,
            shutdown_release_timeout_ms: 5_000,
            lost_lease_retention_ms: 60_000,
            preregister_url: String::new(),
            preregister_tls: UpstreamTls::default(),
            // Above the gateway's wait for a busy key (5 s by default).
            preregister_timeout_ms: 7_000,
            keepalive_ms: 30_000,
            max_hold_ms: 0,
            hold_heartbeat_ms: 1_000,
            lock_delay_ms: 0,
            backend_view_per_second: 20,
            lost_lease_webhook: String::new(),
            webhook_timeout_ms: 2_000,
            dapr_lock_stores: Vec::new(),
            dapr_grpc_listen: String::new(),
            state_dir: String::new(),
        }
    }
}

/// The sidecar's egress proxy: the application's storage writes go through
/// it and leave with the lease's signed token.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProxySettings {
    pub enabled: bool,
    pub listen: SocketAddr,
    /// Where requests go (normally the gateway): `http://host:port`, or
    /// `https://host:port` with TLS configured by `upstream_tls`.
    pub upstream: String,
    /// TLS to an `https://` upstream: CA, client certificate, server name
    /// (docs/tls.md).
    pub upstream_tls: UpstreamTls,
    /// Writes that name no lock are refused with 428 instead of passed on.
    pub require_lock_for_writes: bool,
    /// A request under a lock must name the lease it was computed under
    /// (`Fencing-Lease: <lease_id>`). Off, a request naming only the key
    /// goes out with whatever lease holds the key *now* — with several
    /// workers sharing a sidecar, a paused worker's write would go out with
    /// another worker's token (issue 10 item 2).
    pub require_lease: bool,
    /// The reads: methods known not to change the storage. Every other
    /// method — any case, any extension method — is a write (needs a lock
    /// with `require_lock_for_writes`, is put in normal form): an
    /// allow-list, as at the gateway (issue 26 item 7, PITFALLS 13).
    pub read_methods: Vec<String>,
    /// Deprecated and ignored (every method outside `read_methods` is a
    /// write); still accepted so older files load, but a method listed
    /// here and in `read_methods` is a configuration error.
    pub write_methods: Vec<String>,
    /// Map request paths to lock keys when `Fencing-Lock` is absent.
    pub routes: Vec<crate::routes::RouteSpec>,
    pub connect_timeout_ms: u64,
    pub upstream_timeout_ms: u64,
}

impl Default for ProxySettings {
    fn default() -> Self {
        Self {
            enabled: true,
            listen: "127.0.0.1:7412".parse().expect("static addr"),
            upstream: "http://127.0.0.1:8080".into(),
            upstream_tls: UpstreamTls::default(),
            require_lock_for_writes: false,
            require_lease: true,
            read_methods: vec!["GET".into(), "HEAD".into()],
            write_methods: Vec::new(),
            routes: Vec::new(),
            connect_timeout_ms: 1_000,
            // Above the gateway's whole budget (wait for the key 5 s +
            // connect 1 s + storage 10 s): the proxy must not give up on a
            // request the gateway is still working on.
            upstream_timeout_ms: 20_000,
        }
    }
}

impl SidecarSettings {
    /// `dapr_grpc_listen` as an address; `None` when off.
    pub fn dapr_grpc_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        if self.dapr_grpc_listen.is_empty() {
            return Ok(None);
        }
        self.dapr_grpc_listen.parse().map(Some).map_err(|_| {
            invalid(
                "sidecar.dapr_grpc_listen",
                "must be host:port with a literal IP (e.g. 127.0.0.1:50001), or empty for off",
            )
        })
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let s = self;
        super::dapr_store::validate(&s.dapr_lock_stores)?;
        if let Some(addr) = s.dapr_grpc_addr()? {
            if addr == s.listen {
                return Err(invalid(
                    "sidecar.dapr_grpc_listen",
                    "must differ from sidecar.listen (gRPC has a listener of its own)",
                ));
            }
        }
        if !s.listen_unix.is_empty()
            && (!s.listen_unix.starts_with('/') || s.listen_unix.len() > 100)
        {
            return Err(invalid(
                "sidecar.listen_unix",
                "must be an absolute path of at most 100 bytes (or empty)",
            ));
        }
        if !(MIN_TTL_MS..=MAX_TTL_MS).contains(&s.default_ttl_ms) {
            return Err(invalid(
                "sidecar.default_ttl_ms",
                format!("must be between {MIN_TTL_MS} and {MAX_TTL_MS}"),
            ));
        }
        if s.default_wait_ms > MAX_WAIT_MS {
            return Err(invalid(
                "sidecar.default_wait_ms",
                format!("must be between 0 and {MAX_WAIT_MS}"),
            ));
        }
        if !(0.0..0.5).contains(&s.clock_drift_ratio) {
            return Err(invalid(
                "sidecar.clock_drift_ratio",
                "must be at least 0.0 and below 0.5",
            ));
        }
        // The margin must leave a usable lease even at the smallest TTL.
        let min_lease = MIN_TTL_MS as f64 * (1.0 - s.clock_drift_ratio);
        if s.safety_margin_ms as f64 >= min_lease / 2.0 {
            return Err(invalid(
                "sidecar.safety_margin_ms",
                format!(
                    "must be below {} (half the smallest lease after drift)",
                    (min_lease / 2.0) as u64
                ),
            ));
        }
        if !(1..=10_000_000).contains(&s.max_leases) {
            return Err(invalid(
                "sidecar.max_leases",
                "must be between 1 and 10000000",
            ));
        }
        if !(1..=1_000_000).contains(&s.max_waiters) {
            return Err(invalid(
                "sidecar.max_waiters",
                "must be between 1 and 1000000",
            ));
        }
        if !(10..=600_000).contains(&s.max_fallback_ms) {
            return Err(invalid(
                "sidecar.max_fallback_ms",
                "must be between 10 and 600000",
            ));
        }
        if s.shutdown_release_timeout_ms > 600_000 {
            return Err(invalid(
                "sidecar.shutdown_release_timeout_ms",
                "must be between 0 and 600000",
            ));
        }
        if s.lost_lease_retention_ms > 86_400_000 {
            return Err(invalid(
                "sidecar.lost_lease_retention_ms",
                "must be between 0 and 86400000",
            ));
        }
        if !(100..=60_000).contains(&s.preregister_timeout_ms) {
            return Err(invalid(
                "sidecar.preregister_timeout_ms",
                "must be between 100 and 60000",
            ));
        }
        check_range(
            "sidecar.keepalive_ms",
            s.keepalive_ms,
            MIN_TTL_MS,
            MAX_TTL_MS,
        )?;
        check_range("sidecar.max_hold_ms", s.max_hold_ms, 0, 30 * 86_400_000)?;
        check_range(
            "sidecar.hold_heartbeat_ms",
            s.hold_heartbeat_ms,
            10,
            600_000,
        )?;
        check_range("sidecar.lock_delay_ms", s.lock_delay_ms, 0, MAX_TTL_MS)?;
        check_range(
            "sidecar.backend_view_per_second",
            u64::from(s.backend_view_per_second),
            0,
            10_000,
        )?;
        check_range(
            "sidecar.webhook_timeout_ms",
            s.webhook_timeout_ms,
            10,
            60_000,
        )?;
        if !s.lost_lease_webhook.is_empty() {
            let ok = url::Url::parse(&s.lost_lease_webhook)
                .is_ok_and(|u| u.scheme() == "http" && u.host_str().is_some());
            if !ok {
                return Err(invalid(
                    "sidecar.lost_lease_webhook",
                    "expected an http:// URL",
                ));
            }
        }
        let mut scheme = "";
        if !s.preregister_url.is_empty() {
            let url = url::Url::parse(&s.preregister_url).ok().filter(|u| {
                matches!(u.scheme(), "http" | "https")
                    && u.host_str().is_some()
                    && u.path().ends_with('/')
            });
            let Some(url) = url else {
                return Err(invalid(
                    "sidecar.preregister_url",
                    "expected the gateway's fence API prefix, e.g. http://gateway:8080/_fencer/v1/fences/ (or https://)",
                ));
            };
            scheme = if url.scheme() == "https" {
                "https"
            } else {
                "http"
            };
        }
        s.preregister_tls.validate(PREREGISTER, scheme)
    }
}

impl ProxySettings {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let p = self;
        let scheme = check_upstream_url("proxy.upstream", &p.upstream)?;
        p.upstream_tls.validate(PROXY, scheme)?;
        check_methods("proxy.read_methods", &p.read_methods)?;
        check_methods("proxy.write_methods", &p.write_methods)?;
        if let Some(m) = p.write_methods.iter().find(|m| p.read_methods.contains(m)) {
            return Err(invalid(
                "proxy.write_methods",
                format!(
                    "`{m}` is in both proxy.read_methods and proxy.write_methods; write_methods is deprecated (every method outside read_methods is a write): remove it"
                ),
            ));
        }
        crate::routes::Routes::compile(&p.routes)
            .map_err(|e| invalid("proxy.routes", e.to_string()))?;
        check_range("proxy.connect_timeout_ms", p.connect_timeout_ms, 10, 60_000)?;
        check_range(
            "proxy.upstream_timeout_ms",
            p.upstream_timeout_ms,
            10,
            600_000,
        )?;
        Ok(())
    }
}
