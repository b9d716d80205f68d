use std::process::ExitCode;

use clap::Parser;
use tokio_util::sync::CancellationToken;

use fencer::cli::{Cli, Command};
use fencer::settings::Settings;
use fencer::start::StartError;
use fencer::{dev, gateway, sidecar, storage, telemetry};

/// mimalloc: the lock API's hot path is many small, short-lived allocations
/// (request parsing, keys, JSON); glibc malloc spent ~17% of the sidecar's
/// CPU on them under `fencer bench` (docs/performance.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Exit code for configuration errors (distinct from runtime failures).
const EXIT_CONFIG: u8 = 2;

fn main() -> ExitCode {
    // One TLS crypto provider for every client (rediss://, PostgreSQL TLS).
    fencer::pg::install_crypto_provider();
    let cli = Cli::parse();
    let settings = match Settings::load(cli.config.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fencer: configuration error: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if let Command::CheckConfig = cli.command {
        // A file that names a lock backend is a sidecar's.
        if settings.backend.kind.is_some() {
            if let Err(e) = settings.validate_sidecar() {
                eprintln!("fencer: configuration error: {e}");
                return ExitCode::from(EXIT_CONFIG);
            }
        }
        println!("configuration ok");
        // Passwords in URLs are replaced: this output lands in CI logs.
        println!("{:#?}", settings.redacted());
        return ExitCode::SUCCESS;
    }
    let mut log = settings.log.clone();
    if matches!(
        cli.command,
        Command::Demo(_) | Command::HotAccountWorker(_) | Command::Bench(_) | Command::Top(_)
    ) {
        // These print their own report; keep the stack's logs to problems.
        log.level = "warn".into();
    }
    telemetry::init(&log, cli.log_format.map(Into::into));
    let threads = match (settings.runtime.worker_threads, &cli.command) {
        (0, Command::Sidecar) => 1,
        (0, _) => std::thread::available_parallelism().map_or(2, |n| n.get()),
        (n, _) => n,
    };
    // One thread: a current-thread runtime, so a request never crosses
    // threads between its connection task, the Redis connection task and
    // the timers (each crossing is a futex wake-up and a context switch).
    let mut builder = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    };
    // Worker threads named for the role (`top -H`, `perf` by thread name).
    let role = match &cli.command {
        Command::Sidecar => "sidecar",
        Command::Gateway => "gateway",
        Command::Storage => "storage",
        Command::Inject => "inject",
        _ => "worker",
    };
    let runtime = builder
        .thread_name(format!("fencer-{role}"))
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        tokio::spawn(wait_for_signal(shutdown.clone()));
        let result = match cli.command {
            Command::Sidecar => sidecar::run(settings, shutdown).await,
            Command::Gateway => gateway::run(settings, shutdown).await,
            Command::Storage => storage::run(settings, shutdown).await,
            Command::Inject => fencer::inject::run(settings, shutdown).await,
            Command::Dev => dev::run(settings, shutdown).await,
            Command::Demo(args) => fencer::demo::run(args).await,
            Command::HotAccountWorker(args) => {
                fencer::hotaccount::run_worker(args).await;
                Ok(())
            }
            Command::Top(args) => {
                return match fencer::top::run(args).await {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("fencer top: {e}");
                        ExitCode::FAILURE
                    }
                };
            }
            Command::Bench(args) => {
                return match fencer::bench::run(args).await {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("fencer bench: {e}");
                        ExitCode::FAILURE
                    }
                };
            }
            Command::CheckConfig => unreachable!("handled above"),
        };
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e @ StartError::Config(_)) => {
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
