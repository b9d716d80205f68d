//! `fencer lock KEY [--ttl D] [--wait D] [--api URL] [--grace D] [--owner O] -- CMD [ARGS…]`:
//! run a command while holding a lock, for shell scripts and cron jobs
//! that cannot speak HTTP themselves (like `flock`, `etcdctl lock`,
//! `consul lock`), and with a fencing token in the command's environment.
//!
//! How: the key is acquired through the sidecar's **hold stream**
//! (`POST /v1/locks/{key}/hold`), whose open connection *is* the lease —
//! the sidecar renews while it is open and releases when it closes, so a
//! `fencer lock` killed with SIGKILL still frees the key at once. CMD runs
//! directly (no shell) with `FENCER_KEY`, `FENCER_LEASE`, `FENCER_TOKEN`
//! and `FENCER_FENCING_TOKEN` set and the terminal's stdin/stdout/stderr.
//!
//! - CMD exits → an explicit release (so the key is free when `fencer lock`
//!   returns, not a moment later when the sidecar notices the closed
//!   socket), then the stream is closed and CMD's status is ours.
//! - The lease is lost (a `lost` line, the stream ends or breaks, or no
//!   line for longer than the TTL — a sidecar that stopped answering can no
//!   longer be renewing) → CMD gets SIGTERM, then SIGKILL after `--grace`,
//!   and `fencer lock` exits 70: work done after the loss is no longer
//!   protected by the lock (the gateway refuses its writes; anything else
//!   it touches is not fenced), so it is stopped rather than left running.
//! - `fencer lock` itself killed (SIGKILL) → the sidecar releases as the
//!   socket closes, and CMD gets SIGTERM from the kernel (Linux).
//! - SIGTERM, SIGINT or SIGHUP to `fencer lock` → forwarded to CMD; once
//!   CMD has exited, released as above. (A terminal's Ctrl-C reaches CMD
//!   directly too, as it shares the process group.)
//!
//! Signals go to CMD's pid only: a shell script as CMD should `exec` its
//! last command or pass the signal on itself.
//!
//! Exit codes (sysexits where one fits, the shell's for CMD itself):
//!
//! | code | meaning |
//! |---|---|
//! | 64 | usage: bad flags, a duration or URL that does not parse, a key the sidecar refuses (400) |
//! | 69 | the sidecar is unreachable or answered unexpectedly (including 503 `backend_unavailable`) |
//! | 70 | the lease was lost while CMD ran; CMD was stopped |
//! | 75 | the key is held: not acquired within `--wait` (`--wait 0` fails at once) |
//! | 126 | CMD exists but cannot be executed |
//! | 127 | CMD not found |
//! | other | CMD's own status; 128+N when signal N ended it |
//!
//! Logs are quiet (warnings only): the command's output is the user's.
//! `RUST_LOG=fencer=debug` shows each step. User docs: docs/lock-command.md.

mod args;
mod child;
mod client;
mod exit;
mod stream;

use std::process::ExitCode;
use std::time::Duration;

use serde_json::{json, Map, Value};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::time::Instant;

pub use args::{ApiAddr, LockArgs};
pub use exit::{LockCmdError, KEY_HELD, LEASE_LOST, NOT_EXECUTABLE, NOT_FOUND, UNAVAILABLE, USAGE};

use child::Cmd;
use client::Api;
use stream::{Event, HoldStream, Lease};

/// Bound on the hold's first line once its headers have arrived (the
/// sidecar sends it at once).
const FIRST_LINE_TIMEOUT: Duration = Duration::from_secs(10);
/// Added to `--wait` for the hold's answer: the sidecar's own overhead.
const ANSWER_MARGIN: Duration = Duration::from_secs(10);

/// Runs `fencer lock`; the exit code is the table above.
pub async fn run(args: LockArgs) -> ExitCode {
    let code = match lock_and_run(&args).await {
        Ok(code) => code,
        Err(e) => {
            crate::errln!("fencer lock: {e}");
            e.exit_code()
        }
    };
    ExitCode::from(code)
}

/// Why supervision ended.
enum Outcome {
    Exited(std::process::ExitStatus),
    Lost(String),
}

async fn lock_and_run(args: &LockArgs) -> Result<u8, LockCmdError> {
    // Installed before anything is acquired: from here on a SIGTERM is ours
    // to handle (before CMD runs: give up; while it runs: forward).
    let mut signals = Signals::install();
    let api = Api::new(args.api.clone());
    let within = args
        .wait
        .unwrap_or(Duration::from_millis(crate::settings::limits::MAX_WAIT_MS))
        + ANSWER_MARGIN;
    let wait_text = match args.wait {
        Some(w) => format!("--wait {}ms", w.as_millis()),
        None => "the sidecar's default wait".to_owned(),
    };
    tracing::debug!(key = %args.key, api = %args.api, "acquiring through the hold stream");
    let body = hold_body(args);
    let answer = tokio::select! {
        answer = api.hold(&args.key, &body, within, &wait_text) => answer?,
        sig = signals.recv() => {
            tracing::debug!(sig, "signal while acquiring: giving up");
            return Ok(128 + sig as u8);
        }
    };
    let mut stream = HoldStream::new(answer.body, answer.conn);
    let lease = match tokio::time::timeout(FIRST_LINE_TIMEOUT, stream.next()).await {
        Ok(Ok(Some(Event::Acquired(lease)))) => lease,
        Ok(Ok(Some(Event::Lost { reason }))) => {
            return Err(LockCmdError::Protocol(format!(
                "the lease was lost before CMD started ({reason})"
            )))
        }
        Ok(Ok(other)) => {
            return Err(LockCmdError::Protocol(format!(
                "the hold stream did not start with `acquired`: {other:?}"
            )))
        }
        Ok(Err(e)) => return Err(LockCmdError::Protocol(e)),
        Err(_) => {
            return Err(LockCmdError::Protocol(format!(
                "no `acquired` line within {}s",
                FIRST_LINE_TIMEOUT.as_secs()
            )))
        }
    };
    tracing::debug!(key = %lease.key, token = lease.token, ttl_ms = lease.ttl_ms, "acquired");
    let mut cmd = match Cmd::spawn(&args.command, &lease) {
        Ok(cmd) => cmd,
        Err(e) => {
            release(&api, &lease, stream).await;
            return Err(e);
        }
    };
    tracing::debug!(pid = cmd.pid(), "CMD started");
    let silence = Duration::from_millis(lease.ttl_ms);
    match supervise(&mut cmd, &mut stream, &mut signals, silence).await {
        Outcome::Exited(status) => {
            tracing::debug!(%status, "CMD exited");
            release(&api, &lease, stream).await;
            Ok(exit::status_code(status))
        }
        Outcome::Lost(reason) => {
            tracing::debug!(%reason, grace_ms = args.grace.as_millis() as u64, "lease lost: stopping CMD");
            let status = cmd.stop(args.grace).await;
            drop(stream);
            crate::errln!(
                "fencer lock: lease on {} lost ({reason}); stopped CMD ({status})",
                lease.key
            );
            Ok(LEASE_LOST)
        }
    }
}

/// The hold request: only what the user gave, so the sidecar's configured
/// defaults apply to the rest.
fn hold_body(args: &LockArgs) -> Value {
    let mut body = Map::new();
    if let Some(ttl) = args.ttl {
        body.insert("ttl_ms".into(), json!(ttl.as_millis() as u64));
    }
    if let Some(wait) = args.wait {
        body.insert("wait_ms".into(), json!(wait.as_millis() as u64));
    }
    let owner = args
        .owner
        .clone()
        .unwrap_or_else(|| format!("fencer lock (pid {})", std::process::id()));
    body.insert("owner".into(), json!(owner));
    Value::Object(body)
}

/// Waits for CMD's exit or the lease's loss, forwarding signals meanwhile.
/// `silence` is the TTL: a stream quiet for that long means a sidecar that
/// may no longer be renewing.
async fn supervise(
    cmd: &mut Cmd,
    stream: &mut HoldStream,
    signals: &mut Signals,
    silence: Duration,
) -> Outcome {
    let mut deadline = Instant::now() + silence;
    loop {
        tokio::select! {
            // CMD's exit first: a CMD that finished as the lease went has
            // its own status, not a loss.
            biased;
            status = cmd.wait() => return Outcome::Exited(status),
            sig = signals.recv() => {
                tracing::debug!(sig, "forwarding signal to CMD");
                cmd.signal(sig);
            }
            event = stream.next() => match event {
                Ok(Some(Event::Heartbeat)) => deadline = Instant::now() + silence,
                Ok(Some(Event::Lost { reason })) => {
                    return Outcome::Lost(format!("sidecar reported \"{reason}\""))
                }
                Ok(Some(Event::Released { reason })) => {
                    return Outcome::Lost(format!("sidecar ended the hold: {reason}"))
                }
                Ok(Some(Event::Acquired(_))) => {
                    return Outcome::Lost("hold stream broke: a second `acquired` line".into())
                }
                Ok(None) => return Outcome::Lost("sidecar closed the hold stream".into()),
                Err(e) => return Outcome::Lost(format!("hold stream broke: {e}")),
            },
            _ = tokio::time::sleep_until(deadline) => {
                return Outcome::Lost(format!("no word from the sidecar for {}ms, the lease's TTL", silence.as_millis()))
            }
        }
    }
}

/// Releases explicitly, then closes the stream. If the release call fails,
/// closing the stream still makes the sidecar release (a moment later).
async fn release(api: &Api, lease: &Lease, stream: HoldStream) {
    match api.release(&lease.key, &lease.lease_id).await {
        Ok(true) => tracing::debug!(key = %lease.key, "released"),
        Ok(false) => tracing::debug!(key = %lease.key, "lease already gone at release"),
        Err(e) => {
            tracing::warn!(key = %lease.key, error = %e, "release failed; closing the hold stream instead")
        }
    }
    drop(stream);
}

/// The signals `fencer lock` takes over from their default (terminate) to
/// pass on to CMD.
struct Signals {
    term: Signal,
    int: Signal,
    hup: Signal,
}

impl Signals {
    fn install() -> Signals {
        let on = |kind| signal(kind).expect("signal handler");
        Signals {
            term: on(SignalKind::terminate()),
            int: on(SignalKind::interrupt()),
            hup: on(SignalKind::hangup()),
        }
    }

    /// The next signal's number. Cancel-safe (tokio's `Signal::recv`).
    async fn recv(&mut self) -> i32 {
        tokio::select! {
            Some(()) = self.term.recv() => libc::SIGTERM,
            Some(()) = self.int.recv() => libc::SIGINT,
            Some(()) = self.hup.recv() => libc::SIGHUP,
            // Only if tokio's signal driver went away: no more signals.
            else => std::future::pending::<i32>().await,
        }
    }
}
