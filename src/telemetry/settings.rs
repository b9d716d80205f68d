//! `[tracing]`: OpenTelemetry span export over OTLP/HTTP (protobuf).
//!
//! Off unless an endpoint is named — by `tracing.otlp_endpoint` (or
//! `FENCER__TRACING__OTLP_ENDPOINT`), else by the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT` — so a process without a collector never
//! tries to reach one, and its proxied requests carry no `traceparent` of
//! fencer's making.

use serde::{Deserialize, Serialize};

use crate::settings::check::{check_range, invalid, ConfigError};

/// The variable every OpenTelemetry SDK reads for its collector's base URL.
pub const OTEL_ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// The OTLP/HTTP path for traces, appended to the base URL (OTLP spec).
pub const TRACES_PATH: &str = "/v1/traces";

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TracingSettings {
    /// Base URL of an OTLP/HTTP collector, `http://host:4318`; spans go to
    /// `<base>/v1/traces`. Unset: tracing is off (unless
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` names one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the spans; unset: `fencer-<role>`
    /// (`fencer-sidecar`, `fencer-gateway`, …).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_name: Option<String>,
    /// Share of new traces recorded (0.0–1.0). A request that arrives with
    /// a `traceparent` follows its caller's sampling decision instead.
    pub sampling_ratio: f64,
    /// Finished spans waiting for export; past it new spans are dropped,
    /// never waited for: tracing must not slow a lock or a write.
    pub max_queue_size: usize,
    /// Spans sent in one export request.
    pub max_export_batch_size: usize,
    /// How often the queue is exported when it is not full.
    pub export_interval_ms: u64,
    /// One export request's bound (connect, send, answer).
    pub export_timeout_ms: u64,
}

impl Default for TracingSettings {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            service_name: None,
            sampling_ratio: 1.0,
            max_queue_size: 2048,
            max_export_batch_size: 512,
            export_interval_ms: 1000,
            export_timeout_ms: 5000,
        }
    }
}

impl TracingSettings {
    /// Upper bound on `max_queue_size`: 64 Ki spans of a few hundred bytes
    /// each is the most memory tracing may hold while a collector is away.
    pub const MAX_QUEUE: u64 = 65_536;

    /// The base URL spans go to, if tracing is on (`Settings::load` fills
    /// the setting from `OTEL_EXPORTER_OTLP_ENDPOINT` when it is unset).
    pub fn endpoint(&self) -> Option<&str> {
        self.otlp_endpoint
            .as_deref()
            .filter(|e| !e.trim().is_empty())
    }

    /// `<base>/v1/traces`.
    pub fn traces_url(base: &str) -> String {
        format!("{}{TRACES_PATH}", base.trim_end_matches('/'))
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if let Some(e) = self.otlp_endpoint.as_deref().filter(|e| !e.is_empty()) {
            check_endpoint("tracing.otlp_endpoint", e)?;
        }
        if let Some(name) = &self.service_name {
            if name.is_empty() || name.len() > 128 || name.chars().any(char::is_control) {
                return Err(invalid(
                    "tracing.service_name",
                    "1 to 128 characters, no control characters",
                ));
            }
        }
        if !(0.0..=1.0).contains(&self.sampling_ratio) {
            return Err(invalid(
                "tracing.sampling_ratio",
                "must be between 0.0 and 1.0",
            ));
        }
        check_range(
            "tracing.max_queue_size",
            self.max_queue_size as u64,
            1,
            Self::MAX_QUEUE,
        )?;
        check_range(
            "tracing.max_export_batch_size",
            self.max_export_batch_size as u64,
            1,
            self.max_queue_size as u64,
        )?;
        check_range(
            "tracing.export_interval_ms",
            self.export_interval_ms,
            10,
            60_000,
        )?;
        check_range(
            "tracing.export_timeout_ms",
            self.export_timeout_ms,
            100,
            60_000,
        )
    }
}

/// `http://host:port` with an optional path prefix; no query. The exporter
/// speaks plain HTTP: a collector across the network sits behind a local
/// agent or a mesh.
pub fn check_endpoint(field: &'static str, value: &str) -> Result<(), ConfigError> {
    let url = url::Url::parse(value)
        .map_err(|e| invalid(field, format!("not a URL ({e}); expected http://host:4318")))?;
    if url.scheme() != "http" || url.host_str().is_none() {
        return Err(invalid(field, "expected http://host:port (OTLP/HTTP)"));
    }
    if url.query().is_some() || url.fragment().is_some() || url.password().is_some() {
        return Err(invalid(
            field,
            "give scheme, host, port and at most a path prefix",
        ));
    }
    Ok(())
}
