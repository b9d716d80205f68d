//! Logging setup: `tracing` with a text or JSON formatter.

use tracing_subscriber::EnvFilter;

use crate::settings::{LogFormat, LogSettings};

/// Installs the global subscriber. `RUST_LOG`, when set, wins over the
/// configured level so an operator can raise verbosity without a new config.
pub fn init(settings: &LogSettings, format_override: Option<LogFormat>) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&settings.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = match format_override.unwrap_or(settings.format) {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder.try_init(),
    };
    // A second init (tests, `dev`) keeps the first subscriber.
    let _ = result;
}
