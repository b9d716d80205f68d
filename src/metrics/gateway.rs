//! The gateway's series: fenced requests, fence store, upstream.

use std::sync::Arc;

use prometheus::{
    HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use super::{register, Groups, BACKEND_BUCKETS, WAIT_BUCKETS};

/// The gateway's series.
pub struct GatewayMetrics {
    pub groups: Arc<Groups>,
    pub requests: IntCounterVec,
    pub token_advances: IntCounterVec,
    pub fence_store_duration: HistogramVec,
    pub serialization_wait: HistogramVec,
    pub upstream_duration: HistogramVec,
    pub in_flight_keys: IntGauge,
    /// Forwards whose outcome was unknown (the key stayed blocked).
    pub uncertain: IntCounterVec,
    /// Fenced requests whose client went away before the storage answered;
    /// the forward went on without it.
    pub client_gone: prometheus::IntCounter,
    /// Waits for a request another replica had in flight on the key.
    pub remote_waits: IntCounterVec,
    /// Calls a shared fence store sent per statement (group commit: one
    /// transaction and one WAL flush for all of them).
    pub items_per_statement: HistogramVec,
    /// Tokens that advanced a mark by more than 2^40 (an alarm).
    pub token_jumps: IntCounterVec,
    /// In-flight stamps that could not be cleared (the key stays blocked
    /// until the stamp runs out).
    pub finish_errors: prometheus::IntCounter,
    /// 1 when the fence store answered the last periodic ping: without it
    /// every fenced request fails (a series for the dashboard and alert;
    /// `/readyz` answers only for the moment it is asked).
    pub fence_store_up: IntGaugeVec,
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
                        "Gateway requests by lock group, kind (write, read, preregister) and result (accepted, stale, stale_sequence, duplicate_sequence, invalid_token, invalid_sequence, invalid_path, path_parameters, path_not_routed, duplicate_header, missing_token, key_mismatch, busy, store_error, upstream_error, client_gone, unchecked, unenforced).",
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
                        "Fence store calls by store and op (admit: check-and-advance with the in-flight stamp, including any wait for another replica's request).",
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
            uncertain: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_gateway_uncertain_outcomes_total",
                        "Forwards whose outcome at the storage was unknown (timeout, reset, body not delivered), after which the key stayed blocked for gateway.uncertain_hold_ms, by cause.",
                    ),
                    &["cause"],
                )
                .expect("valid metric"),
            ),
            client_gone: register(
                registry,
                prometheus::IntCounter::new(
                    "fencer_gateway_client_gone_total",
                    "Fenced requests whose client disconnected before the storage answered; the forward completed without it and the key stayed serialized until then.",
                )
                .expect("valid metric"),
            ),
            items_per_statement: register(
                registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "fencer_gateway_fence_items_per_statement",
                        "Calls a shared fence store committed together in one statement (1: alone), by store and op (admit, finish).",
                    )
                    .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]),
                    &["store", "op"],
                )
                .expect("valid metric"),
            ),
            remote_waits: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_gateway_remote_waits_total",
                        "Waits for a request another gateway replica had in flight on the same key, by how they ended (admitted, timeout).",
                    ),
                    &["result"],
                )
                .expect("valid metric"),
            ),
            token_jumps: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_gateway_token_jumps_total",
                        "Validly signed tokens that moved a key's mark up by more than 2^40 at once: not how fencer mints tokens (a leaked signing secret, a corrupted counter, a clock far ahead).",
                    ),
                    &["group"],
                )
                .expect("valid metric"),
            ),
            finish_errors: register(
                registry,
                prometheus::IntCounter::new(
                    "fencer_gateway_stamp_clear_errors_total",
                    "In-flight stamps that could not be cleared in the fence store; the key stays blocked for other replicas until the stamp runs out.",
                )
                .expect("valid metric"),
            ),
            fence_store_up: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "fencer_gateway_fence_store_up",
                        "1 when the gateway's fence store answered the last periodic ping (every second), else 0; fenced requests answer 503 while it is 0.",
                    ),
                    &["store"],
                )
                .expect("valid metric"),
            ),
        }
    }
}

impl GatewayMetrics {
    /// The bounded group of `key`; a group seen for the first time gets
    /// its series at zero first.
    pub fn group(&self, key: &str) -> String {
        self.groups.of_init(key, |g| self.init_group(g))
    }

    /// A group's series that panels and alerts take `increase()` of: the
    /// refusals of stale tokens, store failures and token jumps.
    fn init_group(&self, group: &str) {
        for (kind, result) in [
            ("write", "stale"),
            ("write", "stale_sequence"),
            ("write", "store_error"),
            ("read", "stale"),
            ("read", "store_error"),
            ("preregister", "stale"),
            ("preregister", "store_error"),
        ] {
            self.requests.with_label_values(&[group, kind, result]);
        }
        self.token_jumps.with_label_values(&[group]);
    }

    /// Creates the series whose label values are known up front at zero;
    /// `store` is the fence store's name, whose `fence_store_up` reads 0
    /// until the first ping answers.
    pub fn init_known(&self, store: &str) {
        for group in self.groups.known() {
            self.init_group(&group);
        }
        self.fence_store_up.with_label_values(&[store]);
        for c in ["timeout", "error", "request_body"] {
            self.uncertain.with_label_values(&[c]);
        }
        for r in ["admitted", "timeout"] {
            self.remote_waits.with_label_values(&[r]);
        }
    }
}
