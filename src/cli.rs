//! Command line: `fencer sidecar | gateway | dev | check-config`.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use crate::settings::common::LogFormat;

#[derive(Debug, Parser)]
#[command(
    name = "fencer",
    version = crate::VERSION,
    about = "Distributed locks with fencing tokens, enforced at the storage"
)]
pub struct Cli {
    /// TOML configuration file; `FENCER__SECTION__FIELD` variables override it.
    #[arg(long, short, global = true, env = "FENCER_CONFIG")]
    pub config: Option<PathBuf>,

    /// Log format (overrides `log.format`).
    #[arg(long, global = true, value_enum)]
    pub log_format: Option<LogFormatArg>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormatArg {
    Text,
    Json,
}

impl From<LogFormatArg> for LogFormat {
    fn from(a: LogFormatArg) -> LogFormat {
        match a {
            LogFormatArg::Text => LogFormat::Text,
            LogFormatArg::Json => LogFormat::Json,
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the lock API beside an application.
    Sidecar,
    /// Run the storage gateway that enforces fencing tokens.
    Gateway,
    /// Run the demo key-value storage (the kind of upstream the gateway protects).
    Storage,
    /// The admission webhook that adds fencer as a native sidecar to pods
    /// annotated `fencer.dev/inject: "true"` (HTTPS, `POST /mutate`).
    Inject,
    /// Everything in one process on embedded defaults: sidecar (memory
    /// locks) + gateway (memory fences) + demo storage.
    Dev,
    /// The hot-account incident, with and without fencing, side by side.
    Demo(crate::demo::DemoArgs),
    /// One hot-account worker process (for fault tests that pause it).
    #[command(hide = true)]
    HotAccountWorker(crate::hotaccount::WorkerArgs),
    /// Check the configuration for a role (its rules and the files it
    /// reads) and print the effective settings as TOML; `--live` connects
    /// to what the role uses.
    CheckConfig(crate::check_config::CheckArgs),
    /// Live terminal view of a running sidecar or gateway.
    Top(crate::top::TopArgs),
    /// Drive a running sidecar's lock API and report throughput and latency.
    Bench(crate::bench::BenchArgs),
}
