//! Command line: `fencer sidecar | gateway | dev | check-config | lock …`.

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
    /// Run a command while holding a lock (`fencer lock KEY -- CMD`); the
    /// lease lives exactly as long as the command.
    Lock(crate::lock_command::LockArgs),
}

impl Cli {
    /// Parses the command line. A usage error of `fencer lock` exits 64
    /// (EX_USAGE): scripts and cron jobs run it, and tell its exit codes
    /// apart; every other command keeps clap's 2.
    pub fn parse_args() -> Cli {
        Cli::try_parse().unwrap_or_else(|e| {
            if e.use_stderr() && is_lock(std::env::args_os().skip(1)) {
                let _ = e.print();
                std::process::exit(crate::lock_command::USAGE.into());
            }
            e.exit()
        })
    }
}

/// Whether the subcommand in `args` (argv without the program) is `lock`:
/// the first word that is neither an option nor a global option's value.
fn is_lock(args: impl IntoIterator<Item = std::ffi::OsString>) -> bool {
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        match arg.to_str() {
            Some("--config" | "-c" | "--log-format") => {
                args.next();
            }
            Some(a) if a.starts_with('-') => {}
            other => return other == Some("lock"),
        }
    }
    false
}

#[cfg(test)]
mod tests {
    #[test]
    fn finds_the_lock_subcommand() {
        let is_lock = |a: &[&str]| super::is_lock(a.iter().map(std::ffi::OsString::from));
        assert!(is_lock(&["lock", "k", "--", "true"]));
        assert!(is_lock(&["-c", "f.toml", "--log-format", "json", "lock"]));
        assert!(is_lock(&["--config=f.toml", "lock"]));
        assert!(!is_lock(&["sidecar"]));
        assert!(!is_lock(&["-c", "lock", "sidecar"]));
        assert!(!is_lock(&[]));
    }
}
