//! TLS handshakes that failed, on every link that speaks TLS besides the
//! injector's own listener: the upstream links (proxy, pre-registration,
//! gateway → storage) and the gateway's listener. Process-wide, like
//! [`super::SERVER`]: one connector type serves every link.

use prometheus::{IntCounterVec, Opts, Registry};

pub struct TlsMetrics {
    /// By link (`proxy_upstream`, `preregister`, `gateway_upstream`,
    /// `gateway_listener`) and reason
    /// ([`crate::http::tls_client::FAILURE_REASONS`]).
    pub handshake_failures: IntCounterVec,
    /// The gateway listener's certificate reloads by result (ok, error).
    pub gateway_cert_reloads: IntCounterVec,
}

/// The links, each registered at zero with every reason.
pub const LINKS: &[&str] = &[
    "proxy_upstream",
    "preregister",
    "gateway_upstream",
    "gateway_listener",
];

pub static TLS: std::sync::LazyLock<TlsMetrics> = std::sync::LazyLock::new(|| {
    TlsMetrics {
    handshake_failures: IntCounterVec::new(
        Opts::new(
            "fencer_tls_handshake_failures_total",
            "TLS handshakes that failed, by link (proxy_upstream, preregister, gateway_upstream, gateway_listener) and reason (unknown_ca, name_mismatch, expired, bad_certificate, alert_received, timeout, io, other).",
        ),
        &["link", "reason"],
    )
    .expect("valid metric"),
    gateway_cert_reloads: IntCounterVec::new(
        Opts::new(
            "fencer_gateway_tls_reloads_total",
            "Gateway listener certificate reloads after its files changed, by result: ok, error (the previous certificate stays).",
        ),
        &["result"],
    )
    .expect("valid metric"),
}
});

impl TlsMetrics {
    pub fn register(&self, registry: &Registry) {
        for link in LINKS {
            for reason in crate::http::tls_client::FAILURE_REASONS {
                self.handshake_failures.with_label_values(&[link, reason]);
            }
        }
        for result in ["ok", "error"] {
            self.gateway_cert_reloads.with_label_values(&[result]);
        }
        for c in [&self.handshake_failures, &self.gateway_cert_reloads] {
            registry
                .register(Box::new(c.clone()))
                .expect("registered once per registry");
        }
    }
}
