//! `fencer demo`: the seeds' hot-account incident, run three ways on the
//! in-process stack, side by side. Every number printed is counted in the
//! run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tokio_util::sync::CancellationToken;

use crate::dev::{free_addr, Stack};
use crate::hotaccount::{Via, Worker, WorkerArgs, WriteResult};
use crate::settings::Settings;
use crate::start::StartError;

#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Concurrent workers on the one account.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(2..=64))]
    pub workers: u32,
    /// Lock TTL in ms.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(100..=10_000))]
    pub ttl_ms: u64,
    /// Seconds per run (three runs).
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u64).range(1..=120))]
    pub seconds: u64,
    /// Share of cycles in which the worker pauses (like a GC pause) between
    /// its read and its write, for 1.0-1.3 x TTL.
    #[arg(long, default_value_t = 0.25)]
    pub pause_ratio: f64,
}

#[derive(Debug, Default, Clone)]
pub struct RunReport {
    pub accepted: u64,
    pub stale: u64,
    pub lease_lost: u64,
    pub skipped: u64,
    pub pauses: u64,
    pub balance: i64,
}

impl RunReport {
    pub fn lost_updates(&self) -> i64 {
        self.accepted as i64 - self.balance
    }
}

/// One run: a fresh stack, `workers` workers for `seconds`.
pub async fn run_once(args: &DemoArgs, via: Via) -> Result<RunReport, StartError> {
    // A port found free can be taken by another process before the stack
    // binds it (tests run side by side): such a start is tried again on
    // other ports, a few times.
    let mut tries = 0;
    let stack = loop {
        let mut settings = Settings::default();
        settings.sidecar.listen = free_addr();
        settings.proxy.listen = free_addr();
        settings.gateway.listen = free_addr();
        settings.storage.listen = free_addr();
        settings.admin.listen = free_addr();
        let shutdown = CancellationToken::new();
        match Stack::start(settings, shutdown.clone()).await {
            Ok(stack) => break stack,
            Err(StartError::Bind { source, .. })
                if source.kind() == std::io::ErrorKind::AddrInUse && tries < 4 =>
            {
                shutdown.cancel();
                tries += 1;
            }
            Err(e) => return Err(e),
        }
    };
    let target = match via {
        Via::Direct => format!("http://{}", stack.storage),
        Via::Gateway => format!("http://{}", stack.gateway),
        Via::Proxy => format!("http://{}", stack.proxy),
    };
    let storage = format!("http://{}", stack.storage);
    let counters: Arc<[AtomicU64; 5]> = Arc::new(Default::default());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.seconds);
    let mut tasks = Vec::new();
    for _ in 0..args.workers {
        let worker = Worker::new(WorkerArgs {
            api: format!("http://{}", stack.api),
            target: target.clone(),
            via: via.clone(),
            key: "account:hot".into(),
            path: "accounts/hot".into(),
            ttl_ms: args.ttl_ms,
            cycles: u64::MAX,
            read_target: None,
            think_ms: 5,
        });
        let counters = counters.clone();
        let (ttl, ratio) = (args.ttl_ms, args.pause_ratio);
        tasks.push(tokio::spawn(async move {
            while tokio::time::Instant::now() < deadline {
                let pause = rand::rng().random_bool(ratio.clamp(0.0, 1.0));
                let counters2 = counters.clone();
                let (result, _) = worker
                    .cycle(|_| async move {
                        if pause {
                            counters2[4].fetch_add(1, Ordering::Relaxed);
                            let factor = rand::rng().random_range(1.0..1.3);
                            tokio::time::sleep(Duration::from_millis(ttl).mul_f64(factor)).await;
                        } else {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                    })
                    .await;
                let i = match result {
                    WriteResult::Accepted => 0,
                    WriteResult::Stale => 1,
                    WriteResult::LeaseLost => 2,
                    WriteResult::Skipped => 3,
                };
                counters[i].fetch_add(1, Ordering::Relaxed);
            }
            worker
        }));
    }
    let mut last = None;
    for t in tasks {
        last = t.await.ok();
    }
    let balance = match &last {
        Some(w) => w.balance(&storage).await,
        None => 0,
    };
    stack.stop().await;
    let c = |i: usize| counters[i].load(Ordering::Relaxed);
    Ok(RunReport {
        accepted: c(0),
        stale: c(1),
        lease_lost: c(2),
        skipped: c(3),
        pauses: c(4),
        balance,
    })
}

pub async fn run(args: DemoArgs) -> Result<(), StartError> {
    crate::outln!(
        "hot-account demo: {} workers increment one balance (lock -> read -> +1 -> write -> release),\n\
         lock TTL {} ms, {} s per run; in ~{:.0}% of cycles a worker pauses 1.0-1.3 x TTL between read and write.\n",
        args.workers,
        args.ttl_ms,
        args.seconds,
        args.pause_ratio * 100.0
    );
    let mut reports = Vec::new();
    for (via, label) in [
        (Via::Direct, "locks only (no fencing)"),
        (Via::Gateway, "token checked at the gateway"),
        (Via::Proxy, "fencer: proxy + gateway"),
    ] {
        crate::errln!("running: {label} ...");
        reports.push((label, run_once(&args, via).await?));
    }
    crate::outln!(
        "{:<34}{:>26}{:>30}{:>26}",
        "",
        reports[0].0,
        reports[1].0,
        reports[2].0
    );
    type Row = (&'static str, fn(&RunReport) -> i64);
    let rows: [Row; 7] = [
        ("pauses injected", |r| r.pauses as i64),
        ("writes accepted", |r| r.accepted as i64),
        ("final balance", |r| r.balance),
        ("LOST UPDATES", |r| r.lost_updates()),
        ("stale writes rejected (gateway)", |r| r.stale as i64),
        ("writes refused (lease lost)", |r| r.lease_lost as i64),
        ("cycles without a write", |r| r.skipped as i64),
    ];
    for (name, f) in rows {
        crate::outln!(
            "{:<34}{:>26}{:>30}{:>26}",
            name,
            f(&reports[0].1),
            f(&reports[1].1),
            f(&reports[2].1)
        );
    }
    crate::outln!(
        "\nLost updates = writes accepted - final balance: each accepted write was +1 of the balance it read.\n\
         With fencing, a paused worker's write is refused (by the gateway's token check, or earlier by its\n\
         sidecar once its lease is lost), so every accepted increment survives."
    );
    Ok(())
}
