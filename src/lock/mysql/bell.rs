//! Cross-sidecar wake-ups without polling: per-key "bells" made of MySQL
//! named locks (`GET_LOCK`), because MySQL has no LISTEN/NOTIFY.
//!
//! While this sidecar holds a lease on a key, one of its bell connections
//! holds the key's named lock (`fencer:<hash of the database and the key>`:
//! named locks are server-wide, and two deployments on different databases
//! of one server must not wake each other's waiters — issue 27 item 4). A
//! sidecar
//! waiting for the key blocks in `GET_LOCK` on that name on a wake
//! connection of its own; when the lease ends here, the bell is released
//! and the server hands the named lock to the first blocked waiter at
//! once. That waiter releases it immediately (`RELEASE_LOCK`), which hands
//! it to the next — every waiting sidecar wakes, one round trip apart, and
//! retries its acquire.
//!
//! Why it cannot lose a wake-up: the bell is level-triggered. A waiter
//! that reaches `GET_LOCK` after the release finds the name free and
//! returns at once; it does not need to have been waiting at the moment
//! of the release. Why it does not spin: the acquire statement reports who
//! holds the bell (`IS_USED_LOCK`); a waiter only waits on a bell that
//! another sidecar's connection holds. A lease without a bell (its
//! sidecar died and the server released its bell, or it could not take
//! it) is waited out on the lease's expiry timer, the bounded fallback.
//! If a bell connection drops, the server frees its names (waiters wake,
//! find the key still held, and wait again); it reconnects and re-takes
//! the bells of the leases still held.
//!
//! The bell is taken *before* the acquire statement, so by the time any
//! other sidecar can see the lease, its bell is normally already held. Its
//! wait comes out of the acquire's own budget ([`Bells::before_acquire`]
//! is given a deadline): a stalled server must not add a fixed bell
//! timeout to every try (issue 27 item 4). A bell not taken in time is
//! retried in the background while the lease lasts ("missed").
//! A lease outlives its bell only by the janitor's period: bells of
//! leases whose deadline passed without renewal or release are freed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts};
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::metrics::mysql::MySqlMetrics;

/// Bound on one bell statement on its connection (beyond it the
/// connection is presumed broken and reconnected). Callers wait less: until
/// their own deadline.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
const JANITOR_INTERVAL: Duration = Duration::from_millis(500);
/// How long a bell that could not be taken is retried in the background.
const RETAKE_EVERY: Duration = Duration::from_millis(20);

/// The named lock of `key` for sidecars whose lock table is in `database`
/// (≤ 64 characters, MySQL's limit). The database is part of the hash:
/// named locks are server-wide, so sidecars of another deployment on the
/// same server (another database) must not share a key's bell. Lowercased:
/// with `lower_case_table_names` one database may be named in either case,
/// and a bell shared too widely costs a spurious wake-up, never a missed one.
pub fn bell_name(database: &str, key: &str) -> String {
    let database = database.to_ascii_lowercase();
    let mut h = Sha256::new();
    h.update((database.len() as u64).to_be_bytes());
    h.update(database.as_bytes());
    h.update(key.as_bytes());
    let digest = h.finalize();
    let hex: String = digest[..20].iter().map(|b| format!("{b:02x}")).collect();
    format!("fencer:{hex}")
}

enum Command {
    /// `GET_LOCK(name, 0)`; answers whether it is held now. Skipped when
    /// its requester stopped waiting (the deadline passed) before its turn.
    Take(String, Instant, oneshot::Sender<bool>),
    /// `RELEASE_LOCK(name)`; answers when done (or failed).
    Free(String, Option<oneshot::Sender<()>>),
}

struct Entry {
    name: String,
    /// Leases of this sidecar on the key, with their local deadlines.
    leases: HashMap<String, Instant>,
    /// Acquires in progress that took (or share) the bell.
    pending: usize,
    held: bool,
}

struct Shard {
    tx: mpsc::UnboundedSender<Command>,
    /// The shard connection's id on the server (0 while disconnected).
    conn_id: Arc<std::sync::atomic::AtomicU32>,
}

pub struct Bells {
    /// The database of the lock table: part of every bell's name.
    database: String,
    shards: Vec<Shard>,
    entries: Mutex<HashMap<String, Entry>>,
    metrics: Arc<MySqlMetrics>,
}

impl Bells {
    /// Bells on `opts`' server, named for `opts`' database.
    pub fn start(opts: Opts, shards: usize, metrics: Arc<MySqlMetrics>) -> Arc<Bells> {
        let mut list = Vec::new();
        let mut rxs = Vec::new();
        for _ in 0..shards.max(1) {
            let (tx, rx) = mpsc::unbounded_channel();
            list.push(Shard {
                tx,
                conn_id: Arc::new(std::sync::atomic::AtomicU32::new(0)),
            });
            rxs.push(rx);
        }
        let bells = Arc::new(Bells {
            database: opts.db_name().unwrap_or_default().to_owned(),
            shards: list,
            entries: Mutex::new(HashMap::new()),
            metrics,
        });
        for (i, rx) in rxs.into_iter().enumerate() {
            tokio::spawn(shard_task(
                Arc::downgrade(&bells),
                i,
                opts.clone(),
                rx,
                bells.shards[i].conn_id.clone(),
            ));
        }
        tokio::spawn(janitor(Arc::downgrade(&bells)));
        bells
    }

    /// The bell's name of `key` ([`bell_name`] in this sidecar's database).
    pub fn name_of(&self, key: &str) -> String {
        bell_name(&self.database, key)
    }

    fn shard_of(&self, name: &str) -> usize {
        let h = name
            .bytes()
            .fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(b as usize));
        h % self.shards.len()
    }

    /// Whether `conn_id` (from `IS_USED_LOCK`) is one of ours.
    pub fn is_ours(&self, conn_id: u32) -> bool {
        self.shards
            .iter()
            .any(|s| s.conn_id.load(std::sync::atomic::Ordering::Relaxed) == conn_id)
    }

    /// Whether a lease of this sidecar holds `key` (its bell then rings
    /// when that lease ends here).
    pub fn has_lease(&self, key: &str) -> bool {
        self.entries
            .lock()
            .expect("bells poisoned")
            .get(key)
            .is_some_and(|e| !e.leases.is_empty())
    }

    /// Before an acquire: makes sure this sidecar holds the key's bell
    /// (shared by its leases on the key), waiting for it until `until` at
    /// most. Pair with [`Bells::acquired`] or [`Bells::not_acquired`].
    pub async fn before_acquire(&self, key: &str, until: Instant) {
        let name = {
            let mut entries = self.entries.lock().expect("bells poisoned");
            let e = entries.entry(key.to_owned()).or_insert_with(|| Entry {
                name: bell_name(&self.database, key),
                leases: HashMap::new(),
                pending: 0,
                held: false,
            });
            e.pending += 1;
            if e.held {
                return;
            }
            e.name.clone()
        };
        let held = self.take(&name, until).await;
        if held {
            self.took(key, name);
        }
    }

    /// Records that the shard took `name` for `key`'s entry. A named lock
    /// is counted per connection (MySQL 5.7+, MariaDB): concurrent first
    /// acquires of one key each send a take before any of them has
    /// marked the bell held, and every take that succeeds adds one to the
    /// count — so one release at the end left the bell held for good, and
    /// other sidecars' waiters slept until the lease's expiry timer (their
    /// wait, if shorter, ran out; found by
    /// `mysql_backend::first_acquires_that_deadlock_in_innodb_are_tried_again`).
    /// A take beyond the first is given back at once.
    fn took(&self, key: &str, name: String) {
        let mut entries = self.entries.lock().expect("bells poisoned");
        let extra = match entries.get_mut(key) {
            Some(e) if e.name == name && !e.held => {
                e.held = true;
                false
            }
            // Held already (or, which cannot happen while `pending` keeps
            // the entry, nobody wants it): never leave a count behind.
            _ => true,
        };
        drop(entries);
        if extra {
            self.metrics
                .bell_events
                .with_label_values(&["given_back"])
                .inc();
            let shard = self.shard_of(&name);
            let _ = self.shards[shard].tx.send(Command::Free(name, None));
        }
    }

    /// The acquire succeeded: the lease keeps the bell until `deadline`
    /// (moved by renewals). A bell that could not be taken is retried.
    pub fn acquired(self: &Arc<Self>, key: &str, lease: &str, deadline: Instant) {
        let retake = {
            let mut entries = self.entries.lock().expect("bells poisoned");
            let Some(e) = entries.get_mut(key) else {
                return;
            };
            e.pending = e.pending.saturating_sub(1);
            e.leases.insert(lease.to_owned(), deadline);
            (!e.held).then(|| e.name.clone())
        };
        if let Some(name) = retake {
            self.metrics
                .bell_events
                .with_label_values(&["missed"])
                .inc();
            let bells = self.clone();
            let key = key.to_owned();
            tokio::spawn(async move { bells.retake(key, name).await });
        }
    }

    /// The acquire did not get the key (or failed).
    pub fn not_acquired(&self, key: &str) {
        let mut entries = self.entries.lock().expect("bells poisoned");
        if let Some(e) = entries.get_mut(key) {
            e.pending = e.pending.saturating_sub(1);
        }
        self.settle(&mut entries, key);
    }

    /// A renewal moved the lease's deadline.
    pub fn renewed(&self, key: &str, lease: &str, deadline: Instant) {
        let mut entries = self.entries.lock().expect("bells poisoned");
        if let Some(d) = entries.get_mut(key).and_then(|e| e.leases.get_mut(lease)) {
            *d = deadline;
        }
    }

    /// The lease ended here (released, found lost): rings the bell if no
    /// other lease of this sidecar holds the key, and returns once it has
    /// rung — so a next acquire right after (here or anywhere) finds the
    /// bell free to take — or at `until`, the caller's deadline (it rings
    /// all the same, a little later).
    pub async fn ended(&self, key: &str, lease: &str, until: Instant) {
        let name = {
            let mut entries = self.entries.lock().expect("bells poisoned");
            if let Some(e) = entries.get_mut(key) {
                e.leases.remove(lease);
            }
            self.unused(&mut entries, key)
        };
        if let Some(name) = name {
            let (tx, rx) = oneshot::channel();
            self.send_free(name, Some(tx));
            let _ = tokio::time::timeout_at(until.min(Instant::now() + CALL_TIMEOUT), rx).await;
        }
    }

    /// Frees the bell of an entry nobody uses any more.
    fn settle(&self, entries: &mut HashMap<String, Entry>, key: &str) {
        if let Some(name) = self.unused(entries, key) {
            self.send_free(name, None);
        }
    }

    /// Removes `key`'s entry if nobody uses it; its bell's name if held.
    fn unused(&self, entries: &mut HashMap<String, Entry>, key: &str) -> Option<String> {
        let unused = entries
            .get(key)
            .is_some_and(|e| e.leases.is_empty() && e.pending == 0);
        if !unused {
            return None;
        }
        let e = entries.remove(key).expect("checked");
        e.held.then_some(e.name)
    }

    fn send_free(&self, name: String, done: Option<oneshot::Sender<()>>) {
        self.metrics.bell_events.with_label_values(&["rung"]).inc();
        let shard = self.shard_of(&name);
        let _ = self.shards[shard].tx.send(Command::Free(name, done));
    }

    /// Takes bell `name`, waiting until `until` at most. A take that
    /// completes after its caller stopped waiting is undone by the shard.
    async fn take(&self, name: &str, until: Instant) -> bool {
        let (tx, rx) = oneshot::channel();
        let shard = self.shard_of(name);
        if self.shards[shard]
            .tx
            .send(Command::Take(name.to_owned(), until, tx))
            .is_err()
        {
            return false;
        }
        matches!(tokio::time::timeout_at(until, rx).await, Ok(Ok(true)))
    }

    /// Retries taking a bell a lease holds without one (a waiter was just
    /// passing it on), while the lease lasts.
    async fn retake(self: Arc<Self>, key: String, name: String) {
        loop {
            tokio::time::sleep(RETAKE_EVERY).await;
            {
                let entries = self.entries.lock().expect("bells poisoned");
                match entries.get(&key) {
                    Some(e) if !e.held && e.name == name => {}
                    _ => return,
                }
            }
            if self.take(&name, Instant::now() + CALL_TIMEOUT).await {
                self.took(&key, name);
                return;
            }
        }
    }

    /// Frees bells of leases whose deadline passed (no renewal, no release
    /// seen: the lease is over, whatever the application thinks).
    fn sweep(&self) {
        let now = Instant::now();
        let mut entries = self.entries.lock().expect("bells poisoned");
        let keys: Vec<String> = entries
            .iter_mut()
            .filter_map(|(k, e)| {
                e.leases.retain(|_, d| *d > now);
                (e.leases.is_empty() && e.pending == 0).then(|| k.clone())
            })
            .collect();
        for k in keys {
            self.settle(&mut entries, &k);
        }
    }

    /// The names a reconnected shard must take again.
    fn held_names(&self, shard: usize) -> Vec<String> {
        let mut entries = self.entries.lock().expect("bells poisoned");
        entries
            .values_mut()
            .filter(|e| self.shard_of(&e.name) == shard)
            .map(|e| {
                e.held = false;
                e.name.clone()
            })
            .collect()
    }

    fn mark_held(&self, name: &str) {
        let mut entries = self.entries.lock().expect("bells poisoned");
        if let Some(e) = entries.values_mut().find(|e| e.name == name) {
            e.held = true;
        }
    }
}

async fn janitor(bells: std::sync::Weak<Bells>) {
    let mut tick = tokio::time::interval(JANITOR_INTERVAL);
    loop {
        tick.tick().await;
        let Some(b) = bells.upgrade() else { return };
        b.sweep();
    }
}

async fn connect(opts: &Opts) -> Option<Conn> {
    match tokio::time::timeout(CALL_TIMEOUT * 2, Conn::new(opts.clone())).await {
        Ok(Ok(c)) => Some(c),
        failed => {
            tracing::debug!(error = ?failed.map(|r| r.err()), "bell connection failed");
            None
        }
    }
}

async fn get_lock(conn: &mut Conn, name: &str) -> Result<bool, ()> {
    let r = tokio::time::timeout(
        CALL_TIMEOUT,
        conn.exec_first::<Option<i64>, _, _>("SELECT GET_LOCK(?, 0)", (name,)),
    )
    .await;
    match r {
        Ok(Ok(Some(v))) => Ok(v == Some(1)),
        _ => Err(()),
    }
}

/// Serves one bell connection: takes and frees names in order, reconnects
/// (re-taking the bells still wanted) when the connection fails.
async fn shard_task(
    bells: std::sync::Weak<Bells>,
    shard: usize,
    opts: Opts,
    mut rx: mpsc::UnboundedReceiver<Command>,
    conn_id: Arc<std::sync::atomic::AtomicU32>,
) {
    let mut backoff = Duration::from_millis(50);
    'connect: loop {
        conn_id.store(0, std::sync::atomic::Ordering::Relaxed);
        let Some(mut conn) = connect(&opts).await else {
            // Answer what queued meanwhile: not held.
            while let Ok(cmd) = rx.try_recv() {
                if let Command::Take(_, _, reply) = cmd {
                    let _ = reply.send(false);
                }
            }
            if bells.upgrade().is_none() {
                return;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
            continue;
        };
        backoff = Duration::from_millis(50);
        conn_id.store(conn.id(), std::sync::atomic::Ordering::Relaxed);
        if let Some(b) = bells.upgrade() {
            for name in b.held_names(shard) {
                match get_lock(&mut conn, &name).await {
                    Ok(true) => b.mark_held(&name),
                    Ok(false) => {}
                    Err(()) => continue 'connect,
                }
            }
            b.metrics
                .bell_events
                .with_label_values(&["reconnected"])
                .inc();
        }
        while let Some(cmd) = rx.recv().await {
            match cmd {
                Command::Take(_, until, reply) if reply.is_closed() || Instant::now() >= until => {
                    // Its requester went on without it: not taken.
                    let _ = reply.send(false);
                }
                Command::Take(name, _, reply) => match get_lock(&mut conn, &name).await {
                    Ok(held) => {
                        if reply.send(held).is_err() && held {
                            // Taken after its requester stopped waiting:
                            // it counts the bell as not held, so give it back
                            // (a name taken twice needs two releases).
                            let r = tokio::time::timeout(
                                CALL_TIMEOUT,
                                conn.exec_drop("DO RELEASE_LOCK(?)", (name,)),
                            )
                            .await;
                            if !matches!(r, Ok(Ok(()))) {
                                tracing::warn!("bell release failed; reconnecting");
                                continue 'connect;
                            }
                        }
                    }
                    Err(()) => {
                        let _ = reply.send(false);
                        tracing::warn!("bell connection failed; reconnecting");
                        continue 'connect;
                    }
                },
                Command::Free(name, done) => {
                    let r = tokio::time::timeout(
                        CALL_TIMEOUT,
                        conn.exec_drop("DO RELEASE_LOCK(?)", (name,)),
                    )
                    .await;
                    if let Some(done) = done {
                        let _ = done.send(());
                    }
                    if !matches!(r, Ok(Ok(()))) {
                        // Dropping the connection frees all its names.
                        tracing::warn!("bell release failed; reconnecting");
                        continue 'connect;
                    }
                }
            }
        }
        return;
    }
}
