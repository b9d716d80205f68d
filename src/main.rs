use std::process::ExitCode;

use clap::Parser;
use tokio_util::sync::CancellationToken;

use fencer::cli::{Cli, Command};
use fencer::settings::{BackendKind, Settings};
use fencer::{sidecar, telemetry};

/// Exit code for configuration errors (distinct from runtime failures).
const EXIT_CONFIG: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let settings = match Settings::load(cli.config.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fencer: configuration error: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if let Command::CheckConfig = cli.command {
        println!("configuration ok");
        println!("{settings:#?}");
        return ExitCode::SUCCESS;
    }
    telemetry::init(&settings.log, cli.log_format.map(Into::into));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        tokio::spawn(wait_for_signal(shutdown.clone()));
        let result = match cli.command {
            Command::Sidecar => sidecar::run(settings, shutdown).await,
            Command::Dev => run_dev(settings, shutdown).await,
            Command::Gateway => {
                eprintln!("fencer: the gateway role is not available in this build yet");
                return ExitCode::from(EXIT_CONFIG);
            }
            Command::CheckConfig => unreachable!("handled above"),
            Command::Bench(args) => {
                return match fencer::bench::run(args).await {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("fencer bench: {e}");
                        ExitCode::FAILURE
                    }
                };
            }
        };
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e @ sidecar::StartError::Config(_)) => {
                eprintln!("fencer: configuration error: {e}");
                ExitCode::from(EXIT_CONFIG)
            }
            Err(e) => {
                eprintln!("fencer: {e}");
                ExitCode::FAILURE
            }
        }
    })
}

/// `fencer dev`: the sidecar on the memory backend with loopback defaults.
async fn run_dev(
    mut settings: Settings,
    shutdown: CancellationToken,
) -> Result<(), sidecar::StartError> {
    settings.backend.kind = BackendKind::Memory;
    if std::env::var("FENCER__ADMIN__LISTEN").is_err() {
        settings.admin.listen = "127.0.0.1:9411".parse().expect("static addr");
    }
    let api = settings.sidecar.listen;
    let admin = settings.admin.listen;
    println!(
        "fencer dev: lock API http://{api}  metrics http://{admin}/metrics\n\
         try:\n  \
         curl -s -XPOST http://{api}/v1/locks/account:1/acquire -d '{{\"ttl_ms\":30000}}'\n  \
         curl -s http://{api}/v1/locks\n  \
         curl -s -XPOST http://{api}/v1/locks/account:1/release -d '{{\"lease_id\":\"<lease_id from acquire>\"}}'\n\
         Ctrl-C to stop."
    );
    sidecar::run(settings, shutdown).await
}

async fn wait_for_signal(shutdown: CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("signal received");
    shutdown.cancel();
}
