//! Prometheus metrics: the process-wide registry and label bounds here,
//! each role's series in its own module ([`sidecar`], [`gateway`]).
//!
//! Labels are bounded: a lock key is never a label. Keys map to a *group*
//! (the part before the first separator, e.g. `account` for `account:42`),
//! and at most `max_groups` distinct groups are reported; later ones are
//! folded into `other`.

use std::collections::HashSet;
use std::sync::Mutex;

pub mod etcd;
pub mod gateway;
pub mod inject;
pub mod mysql;
pub mod redis;
pub mod redlock;
pub mod sidecar;
pub mod sql;
pub mod tls;
pub mod zookeeper;

use prometheus::{Encoder, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

pub use self::gateway::GatewayMetrics;
pub use self::inject::INJECT;
pub use self::sidecar::Metrics;
pub use self::tls::TLS;

use crate::settings::common::MetricsSettings;

/// Lock waits span sub-millisecond local handoffs to minutes-long queues.
pub(crate) const WAIT_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0,
];
pub(crate) const BACKEND_BUCKETS: &[f64] = &[
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
    /// Connections the server closed for silence or to make room
    /// ([`crate::http::conn::Close`]).
    pub closed: IntCounterVec,
    /// Connections accepted only to be closed at once: no descriptor left
    /// and no silent connection to shed ([`crate::http::pressure`]).
    pub refused: IntCounterVec,
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
        closed: IntCounterVec::new(
            Opts::new(
                "fencer_http_connections_closed_total",
                "Connections the server closed, by listener and reason: first_byte_timeout (no byte within http.first_byte_timeout_ms), idle_timeout (no request in flight for http.idle_timeout_ms), shed (closed before its first byte to make room at the descriptor or connection limit).",
            ),
            &["listener", "reason"],
        )
        .expect("valid metric"),
        refused: IntCounterVec::new(
            Opts::new(
                "fencer_http_connections_refused_total",
                "Connections accepted and closed at once, by listener and reason: fd_limit (no file descriptor left and no silent connection to shed).",
            ),
            &["listener", "reason"],
        )
        .expect("valid metric"),
    }
});

/// Log lines that never reached stderr, by reason: `queue_full` (stderr
/// did not keep up — a reader that stopped reading — and the log queue
/// was full) or `write_failed` (the write failed: the reader has gone).
/// Process-wide, like [`SERVER`]: logging is ([`crate::telemetry::queue`]).
pub static LOG_LINES_DROPPED: std::sync::LazyLock<IntCounterVec> = std::sync::LazyLock::new(|| {
    IntCounterVec::new(
        Opts::new(
            "fencer_log_lines_dropped_total",
            "Log lines dropped instead of blocking fencer: queue_full (stderr did not keep up), write_failed (stderr closed).",
        ),
        &["reason"],
    )
    .expect("valid metric")
});

/// Spans handed to the OTLP exporter, by result: `exported` (the collector
/// took them) or `failed` (the export failed after its retries: the spans
/// are gone). Zero while tracing is off.
pub static OTEL_SPANS: std::sync::LazyLock<IntCounterVec> = std::sync::LazyLock::new(|| {
    IntCounterVec::new(
        Opts::new(
            "fencer_otel_spans_total",
            "Spans given to the OTLP exporter, by result: exported, failed (lost with their export request).",
        ),
        &["result"],
    )
    .expect("valid metric")
});

/// OTLP export requests that failed (collector down, slow or refusing).
pub static OTEL_EXPORT_FAILURES: std::sync::LazyLock<prometheus::IntCounter> =
    std::sync::LazyLock::new(|| {
        prometheus::IntCounter::new(
            "fencer_otel_export_failures_total",
            "OTLP span export requests that failed after their retries; their spans are dropped.",
        )
        .expect("valid metric")
    });

pub fn registry(role: &str, backend: &str) -> Registry {
    let registry = Registry::new();
    registry
        .register(Box::new(SERVER.open.clone()))
        .expect("registered once per registry");
    registry
        .register(Box::new(SERVER.limit_waits.clone()))
        .expect("registered once per registry");
    registry
        .register(Box::new(SERVER.closed.clone()))
        .expect("registered once per registry");
    registry
        .register(Box::new(SERVER.refused.clone()))
        .expect("registered once per registry");
    for reason in ["queue_full", "write_failed"] {
        // Both series from the start: a rate() alert needs the zero.
        LOG_LINES_DROPPED.with_label_values(&[reason]);
    }
    registry
        .register(Box::new(LOG_LINES_DROPPED.clone()))
        .expect("registered once per registry");
    TLS.register(&registry);
    for result in ["exported", "failed"] {
        OTEL_SPANS.with_label_values(&[result]);
    }
    registry
        .register(Box::new(OTEL_SPANS.clone()))
        .expect("registered once per registry");
    registry
        .register(Box::new(OTEL_EXPORT_FAILURES.clone()))
        .expect("registered once per registry");
    sql::SQL.init_known();
    for c in [&sql::SQL.abandoned, &sql::SQL.undos, &sql::SQL.retries] {
        registry
            .register(Box::new(c.clone()))
            .expect("registered once per registry");
    }
    registry
        .register(Box::new(sql::SQL.items_per_statement.clone()))
        .expect("registered once per registry");
    let build = IntGaugeVec::new(
        Opts::new("fencer_build_info", "Build information; always 1."),
        &["version", "commit", "role", "backend"],
    )
    .expect("valid metric");
    build
        .with_label_values(&[
            env!("CARGO_PKG_VERSION"),
            env!("FENCER_GIT_COMMIT"),
            role,
            backend,
        ])
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

/// The group of keys beyond `metrics.max_groups` distinct ones.
pub const OTHER: &str = "other";

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
        self.classify(key).0
    }

    /// The groups known before any key is seen: `other` and every
    /// `metrics.group_rules` group. Their series are created at zero on
    /// start-up, so a sum over groups has a value (0) before the first event.
    pub fn known(&self) -> Vec<String> {
        let mut known = vec![OTHER.to_owned()];
        for (_, group) in &self.rules {
            if !known.contains(group) {
                known.push(group.clone());
            }
        }
        known
    }

    /// The label value for `key`; `init` runs with it first when the group
    /// is new, to create its series at zero (see [`Groups::classify`]).
    pub fn of_init(&self, key: &str, init: impl FnOnce(&str)) -> String {
        let (group, new) = self.classify(key);
        if new {
            init(&group);
        }
        group
    }

    /// The label value for `key`, and whether this is the first time it
    /// was handed out (the caller then creates the group's series at zero:
    /// `increase()` cannot see a series' first sample, so a counter that
    /// appears at 1 hides its first event).
    pub fn classify(&self, key: &str) -> (String, bool) {
        if let Some((_, group)) = self.rules.iter().find(|(re, _)| re.is_match(key)) {
            return (group.clone(), false);
        }
        let group = key.split(self.separator.as_str()).next().unwrap_or(key);
        // Group names are user data too: bound their length and charset.
        let allowed = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
        let group: String = if group.len() <= 48 && group.chars().all(allowed) {
            // The common case, on every lock operation: nothing to replace,
            // one copy instead of a char-by-char rebuild.
            group.to_owned()
        } else {
            group
                .chars()
                .take(48)
                .map(|c| if allowed(c) { c } else { '_' })
                .collect()
        };
        let mut seen = self.seen.lock().expect("groups poisoned");
        if seen.contains(&group) {
            return (group, false);
        }
        if seen.len() < self.max {
            seen.insert(group.clone());
            return (group, true);
        }
        (OTHER.to_owned(), false)
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
            group_rules: vec![crate::settings::common::GroupRule {
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
        assert_eq!(g.known(), ["other", "orders"]);
    }

    #[test]
    fn a_group_is_new_once() {
        let g = Groups::new(&MetricsSettings {
            group_separator: ":".into(),
            max_groups: 1,
            group_rules: vec![],
        });
        assert_eq!(g.classify("account:1"), ("account".into(), true));
        assert_eq!(g.classify("account:2"), ("account".into(), false));
        // Past the limit: `other`, which is known from the start.
        assert_eq!(g.classify("user:1"), ("other".into(), false));
    }

    #[test]
    fn group_names_are_cut_to_48_safe_characters() {
        let g = Groups::new(&MetricsSettings {
            group_separator: ":".into(),
            max_groups: 10,
            group_rules: vec![],
        });
        let long = "a".repeat(60);
        assert_eq!(g.of(&format!("{long}:1")), "a".repeat(48));
        assert_eq!(g.of("a.b c:1"), "a_b_c");
        assert_eq!(g.of("ü-x_9:1"), "_-x_9");
        assert_eq!(
            g.of(&format!("{}é:1", "b".repeat(47))),
            format!("{}_", "b".repeat(47))
        );
        assert_eq!(g.of("plain-Key_1:2"), "plain-Key_1");
    }
}
