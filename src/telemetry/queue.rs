//! The log queue: every log line goes through a bounded in-memory queue to
//! one writer thread, which alone writes to stderr.
//!
//! Why: stderr is usually a pipe (`| logger`, `| tee`, the container
//! runtime, a journal). Written directly, a pipe whose reader has stopped
//! reading blocks the writer once its 64 KiB fill up — and on the
//! sidecar's one-thread runtime that froze the lock API and the SIGTERM
//! handler with it; a pipe whose reader has gone fails every write with
//! EPIPE, which `tracing-subscriber` reported with `eprintln!`, a panic
//! that killed the task doing the logging (the signal task: SIGTERM was
//! then ignored and leases were kept until SIGKILL). Here a log call only
//! copies its line into the queue and returns; when the queue holds
//! [`QUEUE_LIMIT_BYTES`] the line is dropped, and a write that fails is
//! dropped too. Both are counted (`fencer_log_lines_dropped_total`), and
//! the next line that reaches stderr is followed by a warning saying how
//! many were lost. Logging can lose lines; it can never stop fencer.

use std::io::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::metrics::LOG_LINES_DROPPED;

/// Bytes of log lines waiting for stderr before new lines are dropped:
/// a few seconds of debug logging under load, so a brief stall of the
/// reader (a journal restart) loses nothing, while a stopped reader costs
/// at most this much memory.
pub const QUEUE_LIMIT_BYTES: usize = 256 * 1024;

struct Queue {
    tx: Sender<Vec<u8>>,
    /// Bytes sent and not yet written (or failed).
    queued: AtomicUsize,
    /// Lines dropped since the last warning about it.
    unreported: AtomicU64,
}

static QUEUE: OnceLock<Queue> = OnceLock::new();

/// Starts the writer thread (once; later calls do nothing).
pub fn start() {
    let mut rx = None;
    QUEUE.get_or_init(|| {
        let (tx, r) = mpsc::channel();
        rx = Some(r);
        Queue {
            tx,
            queued: AtomicUsize::new(0),
            unreported: AtomicU64::new(0),
        }
    });
    if let Some(rx) = rx {
        let spawned = std::thread::Builder::new()
            .name("fencer-log".into())
            .spawn(move || write_loop(rx));
        if spawned.is_err() {
            // No thread: lines stay unwritten (and are counted as dropped
            // once the queue is full); fencer itself runs on.
            drop_line("write_failed");
        }
    }
}

fn drop_line(reason: &'static str) {
    LOG_LINES_DROPPED.with_label_values(&[reason]).inc();
    if let Some(q) = QUEUE.get() {
        q.unreported.fetch_add(1, Ordering::Relaxed);
    }
}

/// Queues one line for stderr; never blocks, never fails. Before
/// [`start`] (a configuration error) the line is written directly.
pub fn push(line: &[u8]) {
    let Some(q) = QUEUE.get() else {
        let _ = std::io::stderr().write_all(line);
        return;
    };
    let n = line.len();
    if q.queued.fetch_add(n, Ordering::Relaxed) + n > QUEUE_LIMIT_BYTES {
        q.queued.fetch_sub(n, Ordering::Relaxed);
        drop_line("queue_full");
        return;
    }
    if q.tx.send(line.to_vec()).is_err() {
        q.queued.fetch_sub(n, Ordering::Relaxed);
        drop_line("write_failed");
    }
}

/// Waits up to `limit` for the queued lines to reach stderr, so the last
/// lines before an exit (the shutdown summary, an error) are not lost —
/// and gives up after it, so a stalled reader cannot hold the exit.
pub fn flush(limit: Duration) {
    let Some(q) = QUEUE.get() else { return };
    let deadline = Instant::now() + limit;
    while q.queued.load(Ordering::Relaxed) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn write_loop(rx: Receiver<Vec<u8>>) {
    let Some(q) = QUEUE.get() else { return };
    let stderr = std::io::stderr();
    for line in rx {
        let written = stderr.lock().write_all(&line).is_ok();
        q.queued.fetch_sub(line.len(), Ordering::Relaxed);
        if !written {
            drop_line("write_failed");
            continue;
        }
        // stderr takes lines again: say how many it missed, through the
        // same queue (a line that is itself dropped is counted again, and
        // reported after the next line that gets through).
        let dropped = q.unreported.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            tracing::warn!(
                dropped,
                "log lines dropped: stderr could not keep up or was closed"
            );
        }
    }
}

/// The `tracing` writer: each event's formatted line goes to the queue.
pub struct QueueWriter;

impl Write for QueueWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        push(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
