//! The sidecar's series: lock API, leases, waiters, backend, proxy.

use std::sync::Arc;

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use super::{register, render, Groups, BACKEND_BUCKETS, WAIT_BUCKETS};

/// The `reason` values of `fencer_lost_leases_total`: the losses of
/// `LostReason` in the sidecar's lease table (a test there keeps them equal).
pub const LOST_REASONS: [&str; 3] = ["deadline", "backend", "failover"];

/// The `result` values of `fencer_acquisitions_total`.
const ACQUIRE_RESULTS: [&str; 4] = ["acquired", "timeout", "delayed", "error"];

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
    /// Acquires granted by the backend whose lease ran out before the
    /// answer (slow pre-registration, slow backend, frozen process).
    pub acquire_expired_before_answer: IntCounter,
    pub http_requests: IntCounterVec,
    pub proxy_requests: IntCounterVec,
    pub proxy_duration: HistogramVec,
    /// Write-sequence reservations written to the state directory, by
    /// result (written, failed).
    pub sequence_reservations: IntCounterVec,
    pub preregistrations: IntCounterVec,
    pub webhook_deliveries: IntCounterVec,
    pub hold_streams: IntGauge,
    pub backend_up: IntGaugeVec,
    /// Leases released because nobody held them any more (a cancelled
    /// acquire's, a renewal reply after the deadline).
    pub orphan_releases: IntCounterVec,
    /// Dapr API calls by protocol, op and result.
    pub dapr_requests: IntCounterVec,
    /// `GET /v1/locks/{key}?scope=backend` reads, by what they found.
    pub backend_views: IntCounterVec,
    /// Reentrant leases' hold-count changes, by what became of them.
    pub hold_changes: IntCounterVec,
    /// Semaphore permit acquisitions, by result.
    pub semaphore_acquisitions: IntCounterVec,
    /// Multi-key acquisitions, by result.
    pub multi_acquisitions: IntCounterVec,
    /// Read leases' acquisitions (read-write locks), by result.
    pub read_acquisitions: IntCounterVec,
    /// Slots tried by semaphore acquisitions (one backend acquire each).
    pub semaphore_slot_tries: prometheus::IntCounter,
}

/// The `result` values of `fencer_semaphore_acquisitions_total`.
const SEMAPHORE_RESULTS: [&str; 4] = ["acquired", "timeout", "permits_mismatch", "error"];

/// The `result` values of `fencer_hold_changes_total`.
const HOLD_CHANGE_RESULTS: [&str; 4] = ["entered", "left", "conflict", "undone"];

/// The `result` values of `fencer_backend_views_total`.
const VIEW_RESULTS: [&str; 6] = ["held", "free", "delayed", "split", "error", "rate_limited"];

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
                    "Times a queued waiter re-tried, by cause: release (pushed notification), resync (after a reconnect), promoted (moved to the head of the queue), fallback (timer at the holder's remaining TTL), backend_error (again after a try that found the backend unavailable) or early_release (this sidecar's holder's release was on its way on the same connection)."
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
            dapr_requests: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_dapr_requests_total",
                    "Dapr lock API calls by protocol (http, grpc), op (lock, unlock, lease: fencer's lease look-up) and result: success, held (lock refused: held), not_found, other_owner, bad_request, error, unimplemented (a Dapr method fencer does not serve), busy (over the gRPC concurrency bound), deadline."
                ),
                &["protocol", "op", "result"]
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
            acquire_expired_before_answer: reg!(IntCounter::new(
                "fencer_acquire_expired_before_answer_total",
                "Acquires whose lease ran out between the grant and the answer: refused (503), never answered as held."
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
            sequence_reservations: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_proxy_sequence_reservations_total",
                    "Write-sequence reservations written to sidecar.state_dir, by result (written, failed). A failed one leaves adopted leases' writes to the wall clock after a restart."
                ),
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
            backend_views: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_backend_views_total",
                    "Reads of what the backend records for a key (GET /v1/locks/{key}?scope=backend), by result (held, free, delayed, split, error, rate_limited)."
                ),
                &["result"]
            )
            .unwrap()),
            hold_changes: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_hold_changes_total",
                    "Reentrant leases' hold-count changes, by result (entered: one hold more, left: one hold given back, conflict: the backend counted otherwise, undone: its caller went away before the answer)."
                ),
                &["result"]
            )
            .unwrap()),
            semaphore_acquisitions: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_semaphore_acquisitions_total",
                    "Semaphore permit acquisitions, by result (acquired; timeout: every permit stayed held for wait_ms; permits_mismatch: the name's count is fixed at another; error)."
                ),
                &["result"]
            )
            .unwrap()),
            multi_acquisitions: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_multi_acquisitions_total",
                    "Multi-key acquisitions (every key or none), by result (acquired; timeout: a key stayed held for wait_ms, the keys taken were given back; error)."
                ),
                &["result"]
            )
            .unwrap()),
            read_acquisitions: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_read_acquisitions_total",
                    "Read leases' acquisitions (read-write locks, \"mode\": \"read\"), by result (acquired; timeout: a write lease held the key, or a writer waited for it, for wait_ms; delayed; error). Also counted in fencer_acquisitions_total."
                ),
                &["result"]
            )
            .unwrap()),
            semaphore_slot_tries: reg!(prometheus::IntCounter::new(
                "fencer_semaphore_slot_tries_total",
                "Permit slots tried by semaphore acquisitions, one backend acquire each: against fencer_semaphore_acquisitions_total, how full semaphores run."
            )
            .unwrap()),
            orphan_releases: reg!(IntCounterVec::new(
                Opts::new(
                    "fencer_orphan_releases_total",
                    "Leases released in the backend because nobody holds them any more (an acquire whose client went away, a renewal answered after the local deadline), by result (released, not_held, error)."
                ),
                &["result"]
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

    /// The bounded group of `key`; a group seen for the first time gets
    /// its series at zero first.
    pub fn group(&self, key: &str) -> String {
        self.groups.of_init(key, |g| self.init_group(g))
    }

    /// A group's series that panels and alerts sum or take `increase()` of.
    fn init_group(&self, group: &str) {
        for reason in LOST_REASONS {
            self.lost_leases.with_label_values(&[group, reason]);
        }
        for result in ACQUIRE_RESULTS {
            self.acquisitions.with_label_values(&[group, result]);
        }
        self.leases_held.with_label_values(&[group]);
        self.waiters.with_label_values(&[group]);
    }

    /// Creates the series whose label values are known up front at zero,
    /// so dashboards and alerts see "none yet" instead of "no data".
    pub fn init_known(&self, backend: &str) {
        for group in self.groups.known() {
            self.init_group(&group);
        }
        for r in ["ok", "stale", "error"] {
            self.preregistrations.with_label_values(&[r]);
        }
        for r in ["delivered", "failed", "dropped"] {
            self.webhook_deliveries.with_label_values(&[r]);
        }
        for r in VIEW_RESULTS {
            self.backend_views.with_label_values(&[r]);
        }
        for r in HOLD_CHANGE_RESULTS {
            self.hold_changes.with_label_values(&[r]);
        }
        for r in ["acquired", "timeout", "error"] {
            self.multi_acquisitions.with_label_values(&[r]);
        }
        for r in ["acquired", "timeout", "delayed", "error"] {
            self.read_acquisitions.with_label_values(&[r]);
        }
        for r in SEMAPHORE_RESULTS {
            self.semaphore_acquisitions.with_label_values(&[r]);
        }
        self.acquire_retries.with_label_values(&[backend]);
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
        for r in ["written", "failed"] {
            self.sequence_reservations.with_label_values(&[r]);
        }
        for c in [
            "release",
            "resync",
            "promoted",
            "fallback",
            "backend_error",
            "early_release",
        ] {
            self.waiter_wakeups.with_label_values(&[c]);
        }
        self.backend_up.with_label_values(&[backend]);
        for r in ["released", "not_held", "error"] {
            self.orphan_releases.with_label_values(&[r]);
        }
    }
}
