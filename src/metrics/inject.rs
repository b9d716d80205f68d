//! The injector's series: reviews by how they ended, how long they took,
//! and certificate reloads. Process-wide (one injector per process), like
//! [`super::SERVER`].

use prometheus::{Histogram, HistogramOpts, IntCounterVec, Opts, Registry};

pub struct InjectMetrics {
    /// AdmissionReviews by result: injected, not_requested,
    /// already_injected, ignored (not a pod CREATE), failed_open (asked for
    /// injection, could not get it, admitted unchanged), refused (the same
    /// with fail_closed), bad_request (not an AdmissionReview).
    pub reviews: IntCounterVec,
    pub review_seconds: Histogram,
    /// Certificate reloads after the files changed: ok, error.
    pub tls_reloads: IntCounterVec,
    /// TLS handshakes that failed or timed out (a client without the CA,
    /// a port scanner, a half-open connection).
    pub handshake_failures: prometheus::IntCounter,
    /// Reviews refused before they were read whole: body_timeout (the
    /// body did not arrive within inject.body_timeout_ms), over_budget
    /// (inject.max_buffered_bytes in use by other reviews).
    pub refused: IntCounterVec,
    /// Bytes reserved right now by reviews in flight (bodies and their
    /// parsed form), out of inject.max_buffered_bytes.
    pub buffered_bytes: prometheus::IntGauge,
}

pub static INJECT: std::sync::LazyLock<InjectMetrics> = std::sync::LazyLock::new(|| {
    InjectMetrics {
    reviews: IntCounterVec::new(
        Opts::new(
            "fencer_inject_reviews_total",
            "AdmissionReviews answered by the injector, by result: injected, not_requested, already_injected, ignored, failed_open, refused, bad_request.",
        ),
        &["result"],
    )
    .expect("valid metric"),
    review_seconds: Histogram::with_opts(
        HistogramOpts::new(
            "fencer_inject_review_duration_seconds",
            "Time to answer one AdmissionReview, from its body read to the answer.",
        )
        .buckets(super::BACKEND_BUCKETS.to_vec()),
    )
    .expect("valid metric"),
    tls_reloads: IntCounterVec::new(
        Opts::new(
            "fencer_inject_tls_reloads_total",
            "Webhook certificate reloads after its files changed, by result: ok, error (the previous certificate stays).",
        ),
        &["result"],
    )
    .expect("valid metric"),
    handshake_failures: prometheus::IntCounter::new(
        "fencer_inject_tls_handshake_failures_total",
        "TLS handshakes on the webhook listener that failed or timed out.",
    )
    .expect("valid metric"),
    refused: IntCounterVec::new(
        Opts::new(
            "fencer_inject_refused_total",
            "Reviews refused before they were read whole, by reason: body_timeout (408: the body did not arrive within inject.body_timeout_ms), over_budget (503: inject.max_buffered_bytes held by other reviews).",
        ),
        &["reason"],
    )
    .expect("valid metric"),
    buffered_bytes: prometheus::IntGauge::new(
        "fencer_inject_buffered_bytes",
        "Bytes reserved by reviews in flight (bodies and their parsed form), out of inject.max_buffered_bytes.",
    )
    .expect("valid metric"),
}
});

impl InjectMetrics {
    /// Registers the series, each label value at zero: an alert or panel
    /// on `result="error"` then has a series before the first error.
    pub fn register(&self, registry: &Registry) {
        for result in [
            "injected",
            "not_requested",
            "already_injected",
            "ignored",
            "failed_open",
            "refused",
            "bad_request",
        ] {
            self.reviews.with_label_values(&[result]);
        }
        for result in ["ok", "error"] {
            self.tls_reloads.with_label_values(&[result]);
        }
        for reason in ["body_timeout", "over_budget"] {
            self.refused.with_label_values(&[reason]);
        }
        registry
            .register(Box::new(self.reviews.clone()))
            .expect("registered once");
        registry
            .register(Box::new(self.review_seconds.clone()))
            .expect("registered once");
        registry
            .register(Box::new(self.tls_reloads.clone()))
            .expect("registered once");
        registry
            .register(Box::new(self.handshake_failures.clone()))
            .expect("registered once");
        registry
            .register(Box::new(self.refused.clone()))
            .expect("registered once");
        registry
            .register(Box::new(self.buffered_bytes.clone()))
            .expect("registered once");
    }
}
