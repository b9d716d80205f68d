//! Prometheus metrics of the sidecar.
//!
//! Labels are bounded: a lock key is never a label. Keys map to a *group*
//! (the part before the first separator, e.g. `account` for `account:42`),
//! and at most `max_groups` distinct groups are reported; later ones are
//! folded into `other`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

use crate::settings::MetricsSettings;

/// Lock waits span sub-millisecond local handoffs to minutes-long queues.
const WAIT_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0,
];
const BACKEND_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// A registry with the process-wide series (build info, process metrics).
/// Every role in a process registers into the same one, so `fencer dev`
/// serves all of them from one `/metrics`.
/// Connections of every HTTP server in the process, by listener (`api`,
/// `api_unix`, `admin`, `proxy`, `gateway`, `storage`). Process-wide because
/// one server function serves them all; registered into each role's
/// registry by [`registry`].
pub struct ServerMetrics {
    pub open: IntGaugeVec,
    pub limit_waits: IntCounterVec,
}

pub static SERVER: std::sync::LazyLock<ServerMetrics> = std::sync::LazyLock::new(|| {
    ServerMetrics {
        open: IntGaugeVec::new(
            Opts::new(
                "fencer_http_connections",
                "Open HTTP connections by listener.",
            ),
            &["listener"],
        )
        .expect("valid metric"),
        limit_waits: IntCounterVec::new(
            Opts::new(
                "fencer_http_connection_limit_reached_total",
                "Times a listener reached its connection limit and stopped accepting until a connection closed.",
            ),
            &["listener"],
        )
        .expect("valid metric"),
    }
});

pub fn registry(role: &str, backend: &str) -> Registry {
    let registry = Registry::new();
    registry
        .register(Box::new(SERVER.open.clone()))
        .expect("registered once per registry");
    registry
        .register(Box::new(SERVER.limit_waits.clone()))
        .expect("registered once per registry");
    let build = IntGaugeVec::new(
        Opts::new("fencer_build_info", "Build information; always 1."),
        &["version", "role", "backend"],
    )
    .expect("valid metric");
    build
        .with_label_values(&[env!("CARGO_PKG_VERSION"), role, backend])
        .set(1);
    registry.register(Box::new(build)).expect("registered once");
    #[cfg(target_os = "linux")]
    {
        let pc = prometheus::process_collector::ProcessCollector::for_self();
        let _ = registry.register(Box::new(pc));
    }
    registry
}

/// Renders a registry in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut buf = Vec::new();
    TextEncoder::new()
        .encode(&registry.gather(), &mut buf)
        .expect("text encoding cannot fail");
    String::from_utf8(buf).expect("prometheus text is utf-8")
}

/// Registers a collector and hands it back.
pub(crate) fn register<T: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    metric: T,
) -> T {
    registry
        .register(Box::new(metric.clone()))
        .expect("metric registered once");
    metric
}

pub struct Groups {
    separator: String,
    max: usize,
    rules: Vec<(regex::Regex, String)>,
    seen: Mutex<HashSet<String>>,
}

impl Groups {
    pub fn new(settings: &MetricsSettings) -> Groups {
        Groups {
            separator: settings.group_separator.clone(),
            max: settings.max_groups,
            // Validated with the configuration.
            rules: settings
                .group_rules
                .iter()
                .filter_map(|r| Some((regex::Regex::new(&r.pattern).ok()?, r.group.clone())))
                .collect(),
            seen: Mutex::new(HashSet::new()),
        }
    }

    /// The bounded label value for `key`.
    pub fn of(&self, key: &str) -> String {
        if let Some((_, group)) = self.rules.iter().find(|(re, _)| re.is_match(key)) {
            return group.clone();
        }
        let group = key.split(self.separator.as_str()).next().unwrap_or(key);
        // Group names are user data too: bound their length and charset.
        let group: String = group
            .chars()
            .take(48)
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let mut seen = self.seen.lock().expect("groups poisoned");
        if seen.contains(&group) {
            return group;
        }
        if seen.len() < self.max {
            seen.insert(group.clone());
            return group;
        }
        "other".to_owned()
    }
}

/// The sidecar's series.
pub struct Metrics {
    pub registry: Registry,
    pub groups: Arc<Groups>,
    pub acquisitions: IntCounterVec,
    pub acquire_wait: HistogramVec,
    pub hold_time: HistogramVec,
    pub leases_held: IntGaugeVec,
    pub waiters: IntGaugeVec,
    pub waiter_wakeups: IntCounterVec,
    pub renewals: IntCounterVec,
    pub releases: IntCounterVec,
    pub lost_leases: IntCounterVec,
    pub backend_duration: HistogramVec,
    pub backend_errors: IntCounterVec,
    pub acquire_retries: IntCounterVec,
    pub http_requests: IntCounterVec,
    pub proxy_requests: IntCounterVec,
    pub proxy_duration: HistogramVec,
    pub preregistrations: IntCounterVec,
    pub webhook_deliveries: IntCounterVec,
    pub hold_streams: IntGauge,
    pub backend_up: IntGaugeVec,
}

/// The gateway's series.
pub struct GatewayMetrics {
    pub groups: Arc<Groups>,
    pub requests: IntCounterVec,
    pub token_advances: IntCounterVec,
    pub fence_store_duration: HistogramVec,
    pub serialization_wait: HistogramVec,
    pub upstream_duration: HistogramVec,
    pub in_flight_keys: IntGauge,
}

impl GatewayMetrics {
    pub fn new(registry: &Registry, groups: Arc<Groups>) -> GatewayMetrics {
        GatewayMetrics {
            groups,
            requests: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_gateway_requests_total",
                        "Gateway requests by lock group, kind (write, read, preregister) and result (accepted, replay, stale, stale_sequence, invalid_token, invalid_sequence, missing_token, key_mismatch, busy, store_error, upstream_error, unchecked, unenforced).",
                    ),
                    &["group", "kind", "result"],
                )
                .expect("valid metric"),
            ),
            token_advances: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_gateway_token_advances_total",
                        "Times a key's highest accepted token moved up.",
                    ),
                    &["group"],
                )
                .expect("valid metric"),
            ),
            fence_store_duration: register(
                registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "fencer_gateway_fence_store_duration_seconds",
                        "Fence store operations (check_and_advance) by store.",
                    )
                    .buckets(BACKEND_BUCKETS.to_vec()),
                    &["store", "op"],
                )
                .expect("valid metric"),
            ),
            serialization_wait: register(
                registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "fencer_gateway_serialization_wait_seconds",
                        "Time a fenced request waited for the previous request on its key to finish.",
                    )
                    .buckets(WAIT_BUCKETS.to_vec()),
                    &["group"],
                )
                .expect("valid metric"),
            ),
            upstream_duration: register(
                registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "fencer_gateway_upstream_duration_seconds",
                        "Upstream (storage) time to response headers, by outcome (ok, error, timeout).",
                    )
                    .buckets(BACKEND_BUCKETS.to_vec()),
                    &["outcome"],
                )
                .expect("valid metric"),
            ),
            in_flight_keys: register(
                registry,
                IntGauge::new(
                    "fencer_gateway_fenced_in_flight",
                    "Fenced requests currently holding their key's serialization.",
                )
                .expect("valid metric"),
            ),
        }
    }
}

impl Metrics {
    pub fn new(registry: &Registry, groups: Arc<Groups>) -> Metrics {
        let registry = registry.clone();
        macro_rules! reg {
            ($m:expr) => {
                register(&registry, $m)
            };
        }
        Metrics {
            groups,
            acquisitions: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_acquisitions_total",
                    "Acquire requests by lock group and result (acquired, timeout, error)."
                ),
                &["group", "result"]
            )
            .unwrap()),
            acquire_wait: reg!(HistogramVec::new(
                HistogramOpts::new(
                    "fencer_acquire_wait_seconds",
                    "Time from an acquire request to its outcome."
                )
                .buckets(WAIT_BUCKETS.to_vec()),
                &["group", "result"]
            )
            .unwrap()),
            hold_time: reg!(HistogramVec::new(
                HistogramOpts::new(
                    "fencer_hold_seconds",
                    "How long leases were held, from acquisition to release or loss."
                )
                .buckets(WAIT_BUCKETS.to_vec()),
                &["group"]
            )
            .unwrap()),
            leases_held: reg!(IntGaugeVec::new(
                Opts::new("fencer_leases_held", "Leases this sidecar currently holds, by lock group."),
                &["group"]
            )
            .unwrap()),
            waiters: reg!(IntGaugeVec::new(
                Opts::new("fencer_waiters", "Acquire requests queued waiting for a lock."),
                &["group"]
            )
            .unwrap()),
            waiter_wakeups: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_waiter_wakeups_total",
                    "Times a queued waiter re-tried, by cause: release (pushed notification), resync (after a reconnect) or fallback (timer at the holder's remaining TTL)."
                ),
                &["cause"]
            )
            .unwrap()),
            renewals: reg!(IntCounterVec::new(
                Opts::new("fencer_renewals_total", "Renew requests by result."),
                &["result"]
            )
            .unwrap()),
            releases: reg!(IntCounterVec::new(
                Opts::new("fencer_releases_total", "Release requests by result."),
                &["result"]
            )
            .unwrap()),
            lost_leases: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_lost_leases_total",
                    "Leases lost before release, by group and reason."
                ),
                &["group", "reason"]
            )
            .unwrap()),
            backend_duration: reg!(HistogramVec::new(
                HistogramOpts::new(
                    "fencer_backend_request_duration_seconds",
                    "Lock backend round trips by backend and operation."
                )
                .buckets(BACKEND_BUCKETS.to_vec()),
                &["backend", "op"]
            )
            .unwrap()),
            backend_errors: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_backend_errors_total",
                    "Failed lock backend requests by backend and operation."
                ),
                &["backend", "op"]
            )
            .unwrap()),
            acquire_retries: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_acquire_retries_total",
                    "Acquire attempts repeated with the same lease id after an unknown outcome."
                ),
                &["backend"]
            )
            .unwrap()),
            http_requests: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_http_requests_total",
                    "Lock API requests by route and status code."
                ),
                &["route", "status"]
            )
            .unwrap()),
            proxy_requests: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_proxy_requests_total",
                    "Egress proxy requests by result (forwarded, passthrough, lock_not_held, lease_lost, lease_busy, bad_request, upstream_error)."
                ),
                &["result"]
            )
            .unwrap()),
            proxy_duration: reg!(HistogramVec::new(
                HistogramOpts::new(
                    "fencer_proxy_request_duration_seconds",
                    "Egress proxy requests from arrival to upstream response headers, by result."
                )
                .buckets(BACKEND_BUCKETS.to_vec()),
                &["result"]
            )
            .unwrap()),
            webhook_deliveries: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_webhook_deliveries_total",
                    "Lost-lease webhook deliveries by result (delivered, failed, dropped)."
                ),
                &["result"]
            )
            .unwrap()),
            backend_up: reg!(IntGaugeVec::new(
                Opts::new(
                    "fencer_backend_up",
                    "1 when the lock backend answered the last periodic ping, else 0."
                ),
                &["backend"]
            )
            .unwrap()),
            hold_streams: reg!(IntGauge::new(
                "fencer_hold_streams",
                "Open hold connections (locks bound to a connection)."
            )
            .unwrap()),
            preregistrations: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_preregistrations_total",
                    "Tokens pre-registered at the gateway on acquisition, by result (ok, stale, error)."
                ),
                &["result"]
            )
            .unwrap()),
            registry,
        }
    }

    pub fn render(&self) -> String {
        render(&self.registry)
    }

    /// Creates the series whose label values are known up front at zero,
    /// so dashboards and alerts see "none yet" instead of "no data".
    pub fn init_known(&self, backend: &str) {
        for op in ["acquire", "renew", "renew_many", "release", "raise_floor"] {
            self.backend_errors.with_label_values(&[backend, op]);
        }
        for r in ["renewed", "lease_lost", "not_owner", "error"] {
            self.renewals.with_label_values(&[r]);
        }
        for r in ["released", "lease_lost", "not_owner", "error"] {
            self.releases.with_label_values(&[r]);
        }
        for r in [
            "forwarded",
            "passthrough",
            "lock_not_held",
            "lease_lost",
            "bad_request",
            "upstream_error",
        ] {
            self.proxy_requests.with_label_values(&[r]);
        }
        for c in ["release", "resync", "promoted", "fallback"] {
            self.waiter_wakeups.with_label_values(&[c]);
        }
        self.backend_up.with_label_values(&[backend]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_bounded() {
        let g = Groups::new(&MetricsSettings {
            group_separator: ":".into(),
            max_groups: 2,
            group_rules: vec![crate::settings::GroupRule {
                pattern: "^tenant-[0-9]+/orders/".into(),
                group: "orders".into(),
            }],
        });
        assert_eq!(g.of("tenant-7/orders/99"), "orders");
        assert_eq!(g.of("account:1"), "account");
        assert_eq!(g.of("order:9"), "order");
        assert_eq!(g.of("user:3"), "other");
        assert_eq!(g.of("account:2"), "account");
        assert_eq!(g.of("we ird\n"), "other");
    }
}
