//! The OpenTelemetry tracer: spans batched in a bounded queue and exported
//! over OTLP/HTTP (protobuf) by the SDK's batch processor.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider, SpanData, SpanExporter,
};
use opentelemetry_sdk::Resource;

use super::otlp_client::ExportClient;
use super::settings::TracingSettings;
use crate::metrics::{OTEL_EXPORT_FAILURES, OTEL_SPANS};

#[derive(Debug, thiserror::Error)]
pub enum TracerError {
    #[error("cannot start the OTLP export thread: {0}")]
    Thread(#[from] std::io::Error),
    #[error("cannot build the OTLP exporter: {0}")]
    Exporter(String),
}

/// The provider (kept for the flush at exit) and a tracer of it.
pub fn build(
    settings: &TracingSettings,
    endpoint: &str,
    service_name: String,
) -> Result<(SdkTracerProvider, opentelemetry_sdk::trace::Tracer), TracerError> {
    let timeout = Duration::from_millis(settings.export_timeout_ms);
    let client = ExportClient::start(timeout)?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_endpoint(TracingSettings::traces_url(endpoint))
        .with_timeout(timeout)
        .build()
        .map_err(|e| TracerError::Exporter(e.to_string()))?;
    let batch = BatchConfigBuilder::default()
        .with_max_queue_size(settings.max_queue_size)
        .with_max_export_batch_size(settings.max_export_batch_size)
        .with_scheduled_delay(Duration::from_millis(settings.export_interval_ms))
        .build();
    let processor = BatchSpanProcessor::builder(Counted::new(exporter))
        .with_batch_config(batch)
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        // An incoming `traceparent` decides for its trace (the app's
        // tracer sampled it or not); the ratio applies to new traces.
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            settings.sampling_ratio,
        ))))
        .with_resource(
            Resource::builder()
                .with_service_name(service_name.clone())
                .build(),
        )
        .build();
    let tracer = provider.tracer(service_name);
    Ok((provider, tracer))
}

/// The OTLP exporter, counting what it sends (`fencer_otel_spans_total`,
/// `fencer_otel_export_failures_total`) and logging when exports start or
/// stop failing — once per change, not once per batch, so a collector
/// that is down costs one warning.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    failing: Arc<AtomicBool>,
}

impl<E> Counted<E> {
    fn new(inner: E) -> Counted<E> {
        Counted {
            inner,
            failing: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len() as u64;
        let result = self.inner.export(batch).await;
        match &result {
            Ok(()) => {
                OTEL_SPANS.with_label_values(&["exported"]).inc_by(spans);
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!("OTLP span export works again");
                }
            }
            Err(e) => {
                OTEL_SPANS.with_label_values(&["failed"]).inc_by(spans);
                OTEL_EXPORT_FAILURES.inc();
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, spans, "OTLP span export failed; spans are dropped until the collector answers");
                }
            }
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}
