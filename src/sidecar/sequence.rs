//! Write sequence numbers (`Fencing-Seq`) that keep increasing across a
//! sidecar restart, whatever the wall clock did meanwhile.
//!
//! The gateway refuses a lease's request numbered at or below one it
//! already accepted (PITFALLS 5). A lease adopted after a restart therefore
//! needs numbers above everything the earlier process sent. Deriving them
//! from the wall clock alone (`unix_ms × 2^20`) fails when the clock steps:
//! a restart 10 minutes back in time, or after a process whose clock ran an
//! hour ahead, has every write of its adopted leases refused with
//! `stale_sequence` until the clock catches up (issue 27 item 7).
//!
//! So the process *reserves* numbers in a file before it hands them out, in
//! the way ID allocators reserve blocks: the file holds a number R that no
//! number given out so far exceeds, written (and fsynced) before any larger
//! one leaves. A new process starts every lease's numbers above the R it
//! finds, so the file, not the clock, carries the order across restarts;
//! the clock only makes the numbers larger. Reservations run a minute of
//! clock ahead, refreshed in the background when half of it is used, so the
//! proxy's path waits for the disk only when it outruns a reservation.
//!
//! Without a state directory the numbers follow the wall clock as before:
//! a clock stepped back across a restart makes the adopted leases' writes
//! wait for it. Losing a reservation is never a safety problem — the
//! gateway still refuses a reused number — only an availability one, so a
//! failed write of the file is counted and logged and the number still
//! goes out.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use prometheus::IntCounterVec;

/// Numbers per millisecond of wall clock (see the module comment).
const PER_MS: u32 = 20;
/// A reservation covers this much wall-clock time ahead of what it must.
const AHEAD_MS: u64 = 60_000;
/// The file's first word and format version.
const MAGIC: &str = "fencer-write-sequence-v1";
/// The file's name in the state directory.
pub const FILE_NAME: &str = "write-sequence";

/// Why the reservation file cannot be used at start.
#[derive(Debug, thiserror::Error)]
pub enum SequenceError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a write-sequence file of this format: {found:?}")]
    Format { path: PathBuf, found: String },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Hands out the proxy's write sequence numbers.
pub struct Sequencer {
    /// Above every number an earlier process with this state could have
    /// handed out.
    floor: u64,
    /// Numbers up to this are covered by the reservation on disk, or by
    /// a failed attempt at one (retried at half the window, not per
    /// request); `u64::MAX` without a file: nothing to reserve.
    reserved: AtomicU64,
    file: Option<PathBuf>,
    /// One reservation write at a time.
    writing: tokio::sync::Mutex<()>,
    /// A background refresh is on its way.
    refreshing: AtomicBool,
    /// `fencer_proxy_sequence_reservations_total{result}`.
    reservations: IntCounterVec,
}

fn clock_number() -> u64 {
    let unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    unix_ms << PER_MS
}

const AHEAD: u64 = AHEAD_MS << PER_MS;

impl Sequencer {
    /// Numbers from the wall clock only (no state directory).
    pub fn unpersisted(reservations: IntCounterVec) -> Sequencer {
        Sequencer {
            floor: 0,
            reserved: AtomicU64::new(u64::MAX),
            file: None,
            writing: tokio::sync::Mutex::new(()),
            refreshing: AtomicBool::new(false),
            reservations,
        }
    }

    /// Reads the reservation in `dir` (none yet: a first start), then
    /// reserves ahead of this process's first numbers before it serves.
    pub fn open(dir: &Path, reservations: IntCounterVec) -> Result<Sequencer, SequenceError> {
        let path = dir.join(FILE_NAME);
        let stored = match std::fs::read_to_string(&path) {
            Ok(text) => parse(&text).ok_or_else(|| SequenceError::Format {
                path: path.clone(),
                found: text.chars().take(80).collect(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(source) => return Err(SequenceError::Read { path, source }),
        };
        let floor = stored.saturating_add(1);
        let first = floor.max(clock_number()).saturating_add(AHEAD);
        write_reservation(&path, first).map_err(|source| SequenceError::Write {
            path: path.clone(),
            source,
        })?;
        tracing::info!(
            path = %path.display(), floor, clock_behind = clock_number() < floor,
            "write sequences continue above the earlier process's reservation"
        );
        Ok(Sequencer {
            floor,
            reserved: AtomicU64::new(first),
            file: Some(path),
            writing: tokio::sync::Mutex::new(()),
            refreshing: AtomicBool::new(false),
            reservations,
        })
    }

    /// The number after `last` for a lease: above `last`, above every
    /// number of an earlier process, and following the clock when it is
    /// ahead. Waits for the disk only when the number is not reserved yet.
    pub async fn next(self: &Arc<Self>, last: u64) -> u64 {
        let n = last.saturating_add(1).max(clock_number()).max(self.floor);
        let reserved = self.reserved.load(Ordering::Acquire);
        if n > reserved {
            self.reserve(n).await;
        } else if reserved - n < AHEAD / 2 && !self.refreshing.swap(true, Ordering::AcqRel) {
            let me = self.clone();
            tokio::spawn(async move {
                me.reserve(n).await;
                me.refreshing.store(false, Ordering::Release);
            });
        }
        n
    }

    /// Makes the reservation cover `n` and a minute of clock beyond it.
    async fn reserve(&self, n: u64) {
        let Some(path) = self.file.clone() else {
            return;
        };
        let _one = self.writing.lock().await;
        let current = self.reserved.load(Ordering::Acquire);
        if n <= current && current - n >= AHEAD / 2 {
            return; // Another call reserved meanwhile.
        }
        let target = n.max(current).saturating_add(AHEAD);
        let written = {
            let path = path.clone();
            tokio::task::spawn_blocking(move || write_reservation(&path, target)).await
        };
        match written {
            Ok(Ok(())) => {
                self.reserved.store(target, Ordering::Release);
                self.reservations.with_label_values(&["written"]).inc();
                tracing::debug!(reserved = target, "write sequences reserved ahead");
            }
            Ok(Err(e)) => {
                // Not tried again before the next half of this window: a
                // broken disk must not put a write (and a warning) in
                // front of every proxied request.
                self.reserved.store(target, Ordering::Release);
                self.reservations.with_label_values(&["failed"]).inc();
                tracing::warn!(
                    path = %path.display(), error = %e,
                    "cannot reserve write sequences: after a restart with the clock stepped back, adopted leases' writes may be refused until it catches up"
                );
            }
            Err(e) => {
                self.reservations.with_label_values(&["failed"]).inc();
                tracing::warn!(error = %e, "write-sequence reservation task failed");
            }
        }
    }
}

fn parse(text: &str) -> Option<u64> {
    let mut words = text.split_whitespace();
    if words.next()? != MAGIC {
        return None;
    }
    let n = words.next()?.parse().ok()?;
    words.next().is_none().then_some(n)
}

/// Writes the reservation durably: a temporary file, fsynced, renamed over
/// the old one, and the directory fsynced, so a crash leaves either the
/// old reservation or the new one, never a torn file.
fn write_reservation(path: &Path, reserved: u64) -> std::io::Result<()> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        writeln!(f, "{MAGIC} {reserved}")?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counter() -> IntCounterVec {
        IntCounterVec::new(prometheus::Opts::new("t", "t"), &["result"]).unwrap()
    }

    #[tokio::test]
    async fn numbers_increase_and_start_above_the_clock() {
        let s = Arc::new(Sequencer::unpersisted(counter()));
        let before = clock_number();
        let a = s.next(0).await;
        assert!(a >= before && a > 1 << 60, "{a}");
        // Gateways store sequence numbers as signed 64-bit integers.
        assert!(a <= i64::MAX as u64);
        let b = s.next(a).await;
        assert!(b > a);
        assert_eq!(s.next(u64::MAX >> 2).await, (u64::MAX >> 2) + 1);
    }

    #[tokio::test]
    async fn a_restart_continues_above_the_reservation_whatever_the_clock() {
        let dir = tempfile::tempdir().unwrap();
        // An earlier process whose clock ran an hour ahead reserved up to here.
        let ahead = clock_number() + ((3_600_000u64) << PER_MS);
        write_reservation(&dir.path().join(FILE_NAME), ahead).unwrap();
        let s = Arc::new(Sequencer::open(dir.path(), counter()).unwrap());
        let n = s.next(0).await;
        assert!(n > ahead, "{n} not above the earlier reservation {ahead}");
        // And the file now covers what this process hands out.
        let stored = parse(&std::fs::read_to_string(dir.path().join(FILE_NAME)).unwrap()).unwrap();
        assert!(stored >= n);
        // A number beyond the reservation is reserved before it is returned.
        let far = stored + 5;
        let m = s.next(far).await;
        let stored = parse(&std::fs::read_to_string(dir.path().join(FILE_NAME)).unwrap()).unwrap();
        assert!(
            stored >= m,
            "{m} handed out beyond the reservation {stored}"
        );
    }

    #[tokio::test]
    async fn a_failing_disk_is_tried_once_per_window_not_per_request() {
        let dir = tempfile::tempdir().unwrap();
        let reservations = counter();
        let s = Arc::new(Sequencer::open(dir.path(), reservations.clone()).unwrap());
        std::fs::remove_dir_all(dir.path()).unwrap();
        let far = s.reserved.load(Ordering::Acquire) + 1;
        let mut n = s.next(far).await;
        assert!(n >= far, "the number still goes out");
        for _ in 0..100 {
            n = s.next(n).await;
        }
        assert_eq!(reservations.with_label_values(&["failed"]).get(), 1);
    }

    #[test]
    fn a_foreign_file_is_refused_not_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FILE_NAME), "hello").unwrap();
        assert!(matches!(
            Sequencer::open(dir.path(), counter()),
            Err(SequenceError::Format { .. })
        ));
        assert_eq!(
            std::fs::read_to_string(dir.path().join(FILE_NAME)).unwrap(),
            "hello"
        );
    }
}
