//! Logging setup: `tracing` with a text or JSON formatter, written to
//! stderr through [`queue`] so that logging never blocks and never fails.

pub mod queue;

use std::time::Duration;

use tracing_subscriber::EnvFilter;

use crate::settings::common::{LogFormat, LogSettings};

/// Installs the global subscriber. `RUST_LOG`, when set, wins over the
/// configured level so an operator can raise verbosity without a new config.
pub fn init(settings: &LogSettings, format_override: Option<LogFormat>) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&settings.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    queue::start();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| queue::QueueWriter)
        // Colour codes only for a person at a terminal: piped into a file,
        // `less` or a log shipper they are noise (issue 30).
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        // Its report of a failed write is an `eprintln!`, which panics on
        // a closed stderr; the queue's writer never fails anyway.
        .log_internal_errors(false);
    let result = match format_override.unwrap_or(settings.format) {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder.try_init(),
    };
    // A second init (tests, `dev`) keeps the first subscriber.
    let _ = result;
}

/// Before exit: lets queued log lines reach stderr, for at most `limit`.
pub fn flush(limit: Duration) {
    queue::flush(limit);
}
