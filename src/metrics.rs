//! Prometheus metrics of the sidecar.
//!
//! Labels are bounded: a lock key is never a label. Keys map to a *group*
//! (the part before the first separator, e.g. `account` for `account:42`),
//! and at most `max_groups` distinct groups are reported; later ones are
//! folded into `other`.

use std::collections::HashSet;
use std::sync::Mutex;

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

pub struct Groups {
    separator: String,
    max: usize,
    seen: Mutex<HashSet<String>>,
}

impl Groups {
    pub fn new(settings: &MetricsSettings) -> Groups {
        Groups {
            separator: settings.group_separator.clone(),
            max: settings.max_groups,
            seen: Mutex::new(HashSet::new()),
        }
    }

    /// The bounded label value for `key`.
    pub fn of(&self, key: &str) -> String {
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

pub struct Metrics {
    pub registry: Registry,
    pub groups: Groups,
    pub acquisitions: IntCounterVec,
    pub acquire_wait: HistogramVec,
    pub hold_time: HistogramVec,
    pub leases_held: IntGauge,
    pub waiters: IntGaugeVec,
    pub waiter_wakeups: IntCounterVec,
    pub renewals: IntCounterVec,
    pub releases: IntCounterVec,
    pub lost_leases: IntCounterVec,
    pub backend_duration: HistogramVec,
    pub backend_errors: IntCounterVec,
    pub acquire_retries: IntCounterVec,
    pub http_requests: IntCounterVec,
}

impl Metrics {
    pub fn new(settings: &MetricsSettings, backend: &str) -> Metrics {
        let registry = Registry::new();
        macro_rules! reg {
            ($m:expr) => {{
                let m = $m;
                registry
                    .register(Box::new(m.clone()))
                    .expect("metric registered once");
                m
            }};
        }
        let build = reg!(IntGaugeVec::new(
            Opts::new("fencer_build_info", "Build information; always 1."),
            &["version", "backend"]
        )
        .unwrap());
        build
            .with_label_values(&[env!("CARGO_PKG_VERSION"), backend])
            .set(1);
        #[cfg(target_os = "linux")]
        {
            let pc = prometheus::process_collector::ProcessCollector::for_self();
            let _ = registry.register(Box::new(pc));
        }
        Metrics {
            groups: Groups::new(settings),
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
            leases_held: reg!(IntGauge::new(
                "fencer_leases_held",
                "Leases this sidecar currently holds."
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
            registry,
        }
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is utf-8")
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
        });
        assert_eq!(g.of("account:1"), "account");
        assert_eq!(g.of("order:9"), "order");
        assert_eq!(g.of("user:3"), "other");
        assert_eq!(g.of("account:2"), "account");
        assert_eq!(g.of("we ird\n"), "other");
    }
}
