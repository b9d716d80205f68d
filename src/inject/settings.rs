//! `[inject]`: the admission webhook that adds fencer to annotated pods.
//!
//! Everything the injected sidecar needs that is the same for every pod of
//! a cluster lives here (image, names of the ConfigMap and Secrets each app
//! namespace holds, ports, resources); what differs per pod comes from the
//! pod's `fencer.dev/*` annotations (see [`super::annotations`]).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::settings::check::{check_range, invalid, ConfigError};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct InjectSettings {
    /// HTTPS listener for AdmissionReview requests (`/mutate`).
    pub listen: SocketAddr,
    /// PEM certificate chain and private key. Re-read when they change on
    /// disk (cert-manager rotates the Secret in place).
    pub tls_cert_file: String,
    pub tls_key_file: String,
    /// What to answer for a pod asking for injection that the injector
    /// cannot make sense of (a bad annotation, a port clash): `false` admits
    /// it unchanged and logs a warning (the pod runs without fencer, which
    /// its lock calls will show at once); `true` refuses the pod.
    pub fail_closed: bool,
    /// The injected sidecar's image.
    pub image: String,
    pub image_pull_policy: String,
    /// ConfigMap (key `fencer.toml`) the sidecar reads, in the pod's
    /// namespace; `fencer.dev/config` overrides it per pod.
    pub config_map: String,
    /// Secret with the token-signing key (key `signing_key_id`), in the
    /// pod's namespace: pods can mount only their own namespace's Secrets.
    pub signing_secret: String,
    pub signing_key_id: String,
    /// Optional Secret whose keys are `FENCER__*` variables for the sidecar
    /// (backend URLs with passwords); empty = none.
    pub env_secret: String,
    /// The gateway the proxy forwards to and pre-registers tokens with,
    /// e.g. `http://fencer-gateway.fencer.svc:8080`; empty keeps the
    /// ConfigMap's values.
    pub gateway_url: String,
    /// Default ports (loopback lock API and proxy, pod-IP admin port);
    /// `fencer.dev/{lock-api,proxy,admin}-port` override them per pod.
    pub lock_api_port: u16,
    pub proxy_port: u16,
    pub admin_port: u16,
    /// Default resources; `fencer.dev/{cpu,memory}-{request,limit}`
    /// override them per pod.
    pub cpu_request: String,
    pub cpu_limit: String,
    pub memory_request: String,
    pub memory_limit: String,
    /// The sidecar's user and group (the image's non-root user).
    pub run_as_user: i64,
    /// A review's whole body must arrive within this, from its headers
    /// (the API server sends it at once; a stalled client is cut).
    pub body_timeout_ms: u64,
    /// Bytes all reviews in flight may hold together: their bodies and
    /// their parsed form (see `fencer::inject::body`). Beyond it a review
    /// is refused with 503. The injector's memory limit must exceed this
    /// plus its baseline (docs/kubernetes.md).
    pub max_buffered_bytes: u64,
}

impl Default for InjectSettings {
    fn default() -> Self {
        InjectSettings {
            listen: "0.0.0.0:8443".parse().expect("valid address"),
            tls_cert_file: "/etc/fencer/tls/tls.crt".into(),
            tls_key_file: "/etc/fencer/tls/tls.key".into(),
            fail_closed: false,
            image: "fencer:latest".into(),
            image_pull_policy: "IfNotPresent".into(),
            config_map: "fencer-sidecar-config".into(),
            signing_secret: "fencer-signing".into(),
            signing_key_id: "k1".into(),
            env_secret: String::new(),
            gateway_url: String::new(),
            lock_api_port: 7411,
            proxy_port: 7412,
            admin_port: 9411,
            cpu_request: "50m".into(),
            cpu_limit: "1".into(),
            memory_request: "32Mi".into(),
            memory_limit: "256Mi".into(),
            run_as_user: 65532,
            body_timeout_ms: 10_000,
            max_buffered_bytes: 32 * 1024 * 1024,
        }
    }
}

impl InjectSettings {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.image.trim().is_empty() || self.image.chars().any(char::is_whitespace) {
            return Err(invalid("inject.image", "must be an image reference"));
        }
        if !matches!(
            self.image_pull_policy.as_str(),
            "Always" | "IfNotPresent" | "Never"
        ) {
            return Err(invalid(
                "inject.image_pull_policy",
                "allowed: Always, IfNotPresent, Never",
            ));
        }
        for (field, name) in [
            ("inject.config_map", &self.config_map),
            ("inject.signing_secret", &self.signing_secret),
        ] {
            if !is_dns_subdomain(name) {
                return Err(invalid(field, "must be a Kubernetes object name"));
            }
        }
        if !self.env_secret.is_empty() && !is_dns_subdomain(&self.env_secret) {
            return Err(invalid(
                "inject.env_secret",
                "must be a Kubernetes object name or empty",
            ));
        }
        if !is_secret_key(&self.signing_key_id) {
            return Err(invalid(
                "inject.signing_key_id",
                "must be a Secret key (letters, digits, '-', '_', '.')",
            ));
        }
        if !self.gateway_url.is_empty() {
            crate::settings::check::check_http_url("inject.gateway_url", &self.gateway_url)?;
        }
        let ports = [
            ("inject.lock_api_port", self.lock_api_port),
            ("inject.proxy_port", self.proxy_port),
            ("inject.admin_port", self.admin_port),
        ];
        for (field, port) in ports {
            check_range(field, u64::from(port), 1, 65535)?;
        }
        if self.lock_api_port == self.proxy_port
            || self.lock_api_port == self.admin_port
            || self.proxy_port == self.admin_port
        {
            return Err(invalid(
                "inject.admin_port",
                "the lock API, proxy and admin ports must differ",
            ));
        }
        for (field, q, memory) in [
            ("inject.cpu_request", &self.cpu_request, false),
            ("inject.cpu_limit", &self.cpu_limit, false),
            ("inject.memory_request", &self.memory_request, true),
            ("inject.memory_limit", &self.memory_limit, true),
        ] {
            super::quantity::parse(q, memory).map_err(|m| invalid(field, m))?;
        }
        super::quantity::check_request_within_limit(&self.cpu_request, &self.cpu_limit, false)
            .map_err(|m| invalid("inject.cpu_request", m))?;
        super::quantity::check_request_within_limit(&self.memory_request, &self.memory_limit, true)
            .map_err(|m| invalid("inject.memory_request", m))?;
        check_range("inject.body_timeout_ms", self.body_timeout_ms, 100, 30_000)?;
        check_range(
            "inject.max_buffered_bytes",
            self.max_buffered_bytes,
            super::body::MAX_REVIEW_COST as u64,
            1 << 30,
        )?;
        if self.run_as_user <= 0 {
            return Err(invalid(
                "inject.run_as_user",
                "must be a non-root user id (> 0)",
            ));
        }
        Ok(())
    }
}

/// RFC 1123 subdomain, as Kubernetes requires of ConfigMap and Secret names.
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

/// A Secret or ConfigMap data key.
pub fn is_secret_key(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s != "."
        && s != ".."
}
