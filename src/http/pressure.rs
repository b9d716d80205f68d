//! Serving at the descriptor limit: which connection gives way, and how a
//! server that cannot accept stays responsive.
//!
//! When `accept` fails with EMFILE/ENFILE the pending connection stays in
//! the kernel's backlog and the listener stays readable: a loop that just
//! retries spins, one that sleeps leaves every new client hanging until
//! some connection closes on its own — with silent connections holding the
//! descriptors, that was never (issue 27). So, in this order:
//!
//! 1. **shed** the oldest connection that has not sent a byte ([`Silent`]):
//!    it has cost nothing yet and is the likeliest to be an idle or
//!    hostile socket; its descriptor serves the client that waits;
//! 2. otherwise **refuse**: release a reserve descriptor, accept the
//!    waiting connection and close it at once ([`Reserve`]) — the client
//!    learns immediately instead of timing out;
//! 3. otherwise back off briefly (the reserve could not be reopened).
//!
//! Each is counted and logged at most every [`WARN_EVERY`].

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// At most one warning per listener this often; the counts in between are
/// in the metrics and in the next warning.
pub const WARN_EVERY: Duration = Duration::from_secs(10);
/// How long a shedder waits for the shed connection to let go of its
/// descriptor (its task only has to notice the cancellation).
const SHED_WAIT: Duration = Duration::from_secs(1);
/// A connection is not shed before it has been silent this long: one
/// accepted a moment ago may have sent its request already, unread only
/// because the accept loop runs ahead of the connections' tasks (a burst
/// of honest clients must not shed each other). A flood's oldest sockets
/// are far older.
pub const SHED_MIN_SILENCE: Duration = Duration::from_millis(250);
/// Back-off when nothing can be shed or refused.
const BACKOFF: Duration = Duration::from_millis(50);

/// The connections of one listener that have not sent a byte yet, oldest
/// first.
#[derive(Default)]
pub struct Silent {
    inner: Mutex<SilentInner>,
}

#[derive(Default)]
struct SilentInner {
    next: u64,
    conns: BTreeMap<u64, Entry>,
}

struct Entry {
    since: Instant,
    shed: CancellationToken,
    closed: oneshot::Receiver<()>,
}

/// A connection's place in [`Silent`]: `shed` fires when it must give way;
/// drop `closed` once its descriptor is closed.
pub struct Registration {
    pub id: u64,
    pub shed: CancellationToken,
    pub closed: oneshot::Sender<()>,
}

impl Silent {
    /// Registers a new connection (before its task runs, so it can never
    /// speak before it is registered).
    pub fn register(&self) -> Registration {
        let shed = CancellationToken::new();
        let (closed, rx) = oneshot::channel();
        let mut inner = self.inner.lock().expect("never poisoned");
        let id = inner.next;
        inner.next += 1;
        inner.conns.insert(
            id,
            Entry {
                since: Instant::now(),
                shed: shed.clone(),
                closed: rx,
            },
        );
        Registration { id, shed, closed }
    }

    /// The connection sent its first byte (or ended). `false` if it had
    /// been shed meanwhile: then it must close as promised.
    pub fn spoke(&self, id: u64) -> bool {
        let mut inner = self.inner.lock().expect("never poisoned");
        inner.conns.remove(&id).is_some()
    }

    /// Tells the oldest silent connection to close and waits (bounded)
    /// until it has; `false` when there is none silent for at least
    /// [`SHED_MIN_SILENCE`].
    pub async fn shed_oldest(&self) -> bool {
        let entry = {
            let mut inner = self.inner.lock().expect("never poisoned");
            match inner.conns.first_entry() {
                Some(e) if e.get().since.elapsed() >= SHED_MIN_SILENCE => Some(e.remove()),
                _ => None,
            }
        };
        let Some(entry) = entry else {
            return false;
        };
        entry.shed.cancel();
        let _ = tokio::time::timeout(SHED_WAIT, entry.closed).await;
        true
    }
}

/// One descriptor held back (`/dev/null`) so that a server out of
/// descriptors can still accept a connection — to close it.
pub struct Reserve(Option<std::fs::File>);

impl Reserve {
    pub fn new() -> Reserve {
        Reserve(Self::open())
    }

    fn open() -> Option<std::fs::File> {
        std::fs::File::open("/dev/null").ok()
    }

    /// Frees the reserve descriptor for `f`, then takes it back (if some
    /// other task took the descriptor meanwhile, on a later call). `f`
    /// must have closed what it opened by the time it resolves. `None`
    /// when there was no reserve to free.
    pub async fn release_for<T>(&mut self, f: impl std::future::Future<Output = T>) -> Option<T> {
        let file = self.0.take().or_else(Self::open)?;
        drop(file);
        let out = f.await;
        self.0 = Self::open();
        Some(out)
    }
}

impl Default for Reserve {
    fn default() -> Self {
        Reserve::new()
    }
}

/// Is this `accept` error the descriptor limit (process or system)?
pub fn is_fd_limit(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE))
}

/// Is it worth a pause before the next `accept` (the kernel is short of
/// memory)? Other errors concern one connection only (it was aborted
/// before we took it) and the next `accept` may succeed at once.
pub fn needs_backoff(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOBUFS) | Some(libc::ENOMEM))
}

pub async fn backoff() {
    tokio::time::sleep(BACKOFF).await;
}

/// A warning that is logged at most every [`WARN_EVERY`], with how many
/// occurrences it stands for.
#[derive(Default)]
pub struct RateLimited {
    last: Option<Instant>,
    pending: u64,
}

impl RateLimited {
    /// Counts an occurrence; `Some(n)` when it is time to log the `n`
    /// occurrences since the last warning.
    pub fn tick(&mut self) -> Option<u64> {
        self.pending += 1;
        let due = self.last.is_none_or(|t| t.elapsed() >= WARN_EVERY);
        if !due {
            return None;
        }
        self.last = Some(Instant::now());
        Some(std::mem::take(&mut self.pending))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_oldest_silent_connection_is_shed_and_one_that_spoke_never_is() {
        let silent = Silent::default();
        let a = silent.register();
        let b = silent.register();
        let c = silent.register();
        assert!(silent.spoke(a.id), "a spoke first");
        assert!(!silent.shed_oldest().await, "too young to shed");
        tokio::time::advance(SHED_MIN_SILENCE).await;
        drop(b.closed);
        assert!(silent.shed_oldest().await);
        assert!(b.shed.is_cancelled(), "b is the oldest still silent");
        assert!(!a.shed.is_cancelled() && !c.shed.is_cancelled());
        assert!(!silent.spoke(b.id), "b was shed: it must close");
        assert!(silent.spoke(c.id));
        assert!(!silent.shed_oldest().await, "nobody left to shed");
    }

    #[test]
    fn warnings_are_rate_limited_and_carry_the_count() {
        let mut w = RateLimited::default();
        assert_eq!(w.tick(), Some(1));
        assert_eq!(w.tick(), None);
        assert_eq!(w.tick(), None);
        w.last = Some(Instant::now() - WARN_EVERY);
        assert_eq!(w.tick(), Some(3));
    }
}
