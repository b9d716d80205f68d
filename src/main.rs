// Printing goes through `outln!`/`errln!`: `println!` panics when stdout's
// reader has gone.
#![deny(clippy::print_stdout, clippy::print_stderr)]

use std::process::ExitCode;

use tokio_util::sync::CancellationToken;

use fencer::cli::{Cli, Command};
use fencer::settings::Settings;
use fencer::start::StartError;
use fencer::{dev, errln, gateway, sidecar, storage, telemetry};

/// mimalloc: the lock API's hot path is many small, short-lived allocations
/// (request parsing, keys, JSON); glibc malloc spent ~17% of the sidecar's
/// CPU on them under `fencer bench` (docs/performance.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Exit code for configuration errors (distinct from runtime failures).
const EXIT_CONFIG: u8 = 2;

/// How long the exit waits for queued log lines to reach stderr: enough
/// for a reader that keeps up, short enough that a stalled one does not
/// hold the process (its leases are already released by then).
const LOG_FLUSH: std::time::Duration = std::time::Duration::from_secs(1);

fn main() -> ExitCode {
    let code = run();
    telemetry::flush(LOG_FLUSH);
    code
}

fn run() -> ExitCode {
    // One TLS crypto provider for every client (rediss://, PostgreSQL TLS).
    fencer::pg::install_crypto_provider();
    let cli = Cli::parse_args();
    let settings = match Settings::load(cli.config.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            errln!("fencer: configuration error: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if let Command::CheckConfig(args) = &cli.command {
        return fencer::check_config::run(&settings, cli.config.as_deref(), args);
    }
    let mut log = settings.log.clone();
    if matches!(
        cli.command,
        Command::HotAccountWorker(_) | Command::Bench(_) | Command::Top(_) | Command::Lock(_)
    ) {
        // These print their own report; keep the stack's logs to problems.
        log.level = "warn".into();
    }
    if matches!(cli.command, Command::Demo(_)) {
        // The demo's stack warns on purpose (every refused stale write is
        // a warning worth logging in production): ~76 lines that buried
        // its table. Only errors reach the screen.
        log.level = "error".into();
    }
    // Worker threads named for the role (`top -H`, `perf` by thread name).
    let role = match &cli.command {
        Command::Sidecar => "sidecar",
        Command::Gateway => "gateway",
        Command::Storage => "storage",
        Command::Inject => "inject",
        Command::Dev => "dev",
        _ => "worker",
    };
    telemetry::init(
        &log,
        cli.log_format.map(Into::into),
        &settings.tracing,
        role,
    );
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
    let runtime = builder
        .thread_name(format!("fencer-{role}"))
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        // Registered here, before any role binds a listener; the spawned
        // task only waits.
        let signals = StopSignals::register();
        tokio::spawn(signals.wait(shutdown.clone()));
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
                        errln!("fencer top: {e}");
                        ExitCode::FAILURE
                    }
                };
            }
            Command::Bench(args) => {
                return match fencer::bench::run(args).await {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        errln!("fencer bench: {e}");
                        ExitCode::FAILURE
                    }
                };
            }
            Command::Lock(args) => return fencer::lock_command::run(args).await,
            Command::CheckConfig(_) => unreachable!("handled above"),
        };
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e @ StartError::Config(_)) => {
                errln!("fencer: configuration error: {e}");
                ExitCode::from(EXIT_CONFIG)
            }
            Err(e) => {
                errln!("fencer: {e}");
                ExitCode::FAILURE
            }
        }
    })
}

/// SIGTERM and SIGINT, registered synchronously. A spawned task that
/// registered them on its first poll left a window on a busy machine: the
/// gateway, its listeners bound by the main thread, answered its health
/// check while no worker had yet polled that task, and a SIGTERM sent then
/// killed it outright (no drain, no release; seen once in CI as
/// `tests/log_pipe.rs` reading no exit code). Registering before the role
/// starts makes "listening" imply "obeys SIGTERM".
struct StopSignals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Needs the runtime's context (its signal driver).
    fn register() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            StopSignals {
                term: signal(SignalKind::terminate()).expect("SIGTERM handler"),
                int: signal(SignalKind::interrupt()).expect("SIGINT handler"),
            }
        }
        #[cfg(not(unix))]
        StopSignals {}
    }

    async fn wait(self, shutdown: CancellationToken) {
        #[cfg(unix)]
        {
            let StopSignals { mut term, mut int } = self;
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = self;
            let _ = tokio::signal::ctrl_c().await;
        }
        // Cancel first: shutdown must not depend on logging (a log line that
        // panicked here once left SIGTERM ignored and every lease held).
        shutdown.cancel();
        tracing::info!("signal received");
    }
}
