//! Logging and tracing setup: `tracing` with a text or JSON formatter,
//! written to stderr through [`queue`] so that logging never blocks and
//! never fails; and, when `[tracing]` names a collector, OpenTelemetry
//! spans of fencer's hops ([`spans`]) exported over OTLP ([`otlp`]) with
//! W3C trace context carried across them ([`propagation`]).

pub mod otlp;
pub mod otlp_client;
pub mod propagation;
pub mod queue;
pub mod settings;
pub mod spans;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::settings::common::{LogFormat, LogSettings};
use settings::TracingSettings;

/// Set once spans are exported: [`spans`] and [`propagation`] do nothing
/// until then (no span built, no header touched).
static TRACING: AtomicBool = AtomicBool::new(false);

/// The tracer provider, kept for the flush at exit.
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// Whether spans are exported (tracing on and started).
pub fn tracing_enabled() -> bool {
    TRACING.load(Ordering::Relaxed)
}

/// Installs the global subscriber. `RUST_LOG`, when set, wins over the
/// configured level so an operator can raise verbosity without a new config.
/// `role` names the service when `tracing.service_name` does not
/// (`fencer-<role>`).
pub fn init(
    settings: &LogSettings,
    format_override: Option<LogFormat>,
    tracing_settings: &TracingSettings,
    role: &str,
) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&settings.level))
        .unwrap_or_else(|_| EnvFilter::new("info"))
        // The hop spans are for the tracer only: log lines keep their shape.
        .add_directive(
            format!("{}=off", spans::TARGET)
                .parse()
                .expect("static directive"),
        );
    queue::start();
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(|| queue::QueueWriter)
        // Colour codes only for a person at a terminal: piped into a file,
        // `less` or a log shipper they are noise (issue 30).
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        // Its report of a failed write is an `eprintln!`, which panics on
        // a closed stderr; the queue's writer never fails anyway.
        .log_internal_errors(false);
    let fmt = match format_override.unwrap_or(settings.format) {
        LogFormat::Json => fmt.json().flatten_event(true).with_filter(filter).boxed(),
        LogFormat::Text => fmt.with_filter(filter).boxed(),
    };
    let mut layers = vec![fmt];
    let started = match otel_layer(tracing_settings, role) {
        Ok(Some((layer, provider))) => {
            layers.push(layer);
            Some(provider)
        }
        Ok(None) => None,
        Err(e) => {
            // Not fatal: locks and writes matter more than their traces.
            crate::errln!("fencer: tracing disabled: {e}");
            None
        }
    };
    // A second init (tests, `dev`) keeps the first subscriber.
    if tracing_subscriber::registry()
        .with(layers)
        .try_init()
        .is_ok()
    {
        if let Some(provider) = started {
            let _ = PROVIDER.set(provider);
            TRACING.store(true, Ordering::Relaxed);
            tracing::info!(
                endpoint = tracing_settings.otlp_endpoint.as_deref().unwrap_or(""),
                sampling_ratio = tracing_settings.sampling_ratio,
                "tracing: exporting spans over OTLP/HTTP"
            );
        }
    }
}

/// The roles whose requests make spans.
const TRACED_ROLES: [&str; 3] = ["sidecar", "gateway", "dev"];

type BoxedLayer = Box<dyn Layer<tracing_subscriber::Registry> + Send + Sync>;

/// The OpenTelemetry layer, if `[tracing]` names an endpoint.
fn otel_layer(
    s: &TracingSettings,
    role: &str,
) -> Result<Option<(BoxedLayer, SdkTracerProvider)>, otlp::TracerError> {
    // Only the roles with hops to trace: a CLI command (`lock`, `bench`)
    // run where `OTEL_EXPORTER_OTLP_ENDPOINT` is set starts no exporter.
    let Some(endpoint) = s.endpoint().filter(|_| TRACED_ROLES.contains(&role)) else {
        return Ok(None);
    };
    let service = s
        .service_name
        .clone()
        .unwrap_or_else(|| format!("fencer-{role}"));
    let (provider, tracer) = otlp::build(s, endpoint, service)?;
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_tracked_inactivity(false)
        // The hop spans, and warnings logged inside them as span events.
        .with_filter(
            Targets::new()
                .with_target(spans::TARGET, LevelFilter::TRACE)
                .with_default(LevelFilter::WARN),
        )
        .boxed();
    Ok(Some((layer, provider)))
}

/// Before exit: exports the spans still queued and lets queued log lines
/// reach stderr, each for at most `limit`.
pub fn flush(limit: Duration) {
    if let Some(provider) = PROVIDER.get() {
        if let Err(e) = provider.shutdown_with_timeout(limit) {
            tracing::warn!(error = %e, "tracing: spans still queued at exit were not exported");
        }
    }
    queue::flush(limit);
}
