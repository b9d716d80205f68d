//! The PostgreSQL lock backend: leases on the server's clock, tokens from
//! the key's row, wake-ups by LISTEN/NOTIFY.
//!
//! It keeps what database locks are good at (durable, strongly consistent,
//! tokens that never go backwards, including across a failover of a
//! synchronously replicated PostgreSQL) and avoids their usual flaws: no
//! transaction or row lock is held while the application works (each
//! operation is one autocommit statement on a pooled connection), leases
//! expire by themselves, and waiters are woken by NOTIFY, not polling.

mod batch;
pub mod settings;
pub mod sql;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::Pool;

use super::{
    Attempt, BackendError, Holds, HoldsChange, KeyView, LeaseId, LockBackend, LockKey, Ownership,
    WakeSink, WatchGuard,
};
use crate::lock::settings::PostgresSettings;
use crate::pg::group::Group;
use crate::pg::listener::Listener;
use crate::pg::runner::Undo;
use crate::pg::{RunError, Runner};

/// Prefix of the NOTIFY channels of lock releases.
const CHANNEL_PREFIX: &str = "fencer";

use crate::pg::runner::Params;

/// Every statement runs through a [`Runner`]: in a task that owns its
/// connection, so a caller that times out or is cancelled never returns a
/// connection to the pool with its statement still running, and an
/// acquire whose caller gave up is undone — voided if it has not reached
/// the server yet, released if it has (issue 10 items 1 and 4, issue 27
/// item 3). The server's own `statement_timeout` (below the request
/// timeout) ends a stuck statement with a known failure first.
pub struct PgBackend {
    runner: Runner,
    /// Acquires and releases, group-committed ([`batch`]).
    acquires: Arc<Group<batch::Acquire>>,
    releases: Arc<Group<batch::Release>>,
    lock_delay_ms: i64,
    listener: Listener,
}

fn unavailable(e: impl std::fmt::Display) -> BackendError {
    BackendError::Unavailable(e.to_string())
}

impl PgBackend {
    /// Creates the backend without waiting for PostgreSQL: the schema is
    /// created by a background task as soon as the server answers, and the
    /// sidecar reports not-ready until then.
    pub fn new(
        settings: &PostgresSettings,
        lock_delay: Duration,
        wake: Arc<dyn WakeSink>,
    ) -> Result<PgBackend, BackendError> {
        let timeout = Duration::from_millis(settings.request_timeout_ms);
        let (mut config, tls, pool) = crate::pg::pool(&crate::pg::PgOptions {
            url: &settings.url,
            application_name: "fencer-sidecar",
            ca_file: settings.ca_file.as_deref(),
            pool_size: settings.pool_size,
            connect_timeout: Duration::from_millis(settings.connect_timeout_ms),
            wait_timeout: timeout,
            // The server gives up first, with a known failure.
            statement_timeout: Some(timeout.mul_f64(0.8)),
            lock_timeout: Some(timeout / 2),
        })
        .map_err(BackendError::Unavailable)?;
        config.application_name("fencer-listener");
        let runner = Runner::new(pool.clone(), tls.clone(), timeout, &settings.url);
        let metric = |op| {
            crate::metrics::sql::SQL
                .items_per_statement
                .with_label_values(&["postgres", op])
        };
        let mut acquires = Group::new(runner.clone(), timeout);
        acquires.set_metrics(metric("acquire"));
        let mut releases = Group::new(runner.clone(), timeout);
        releases.set_metrics(metric("release"));
        if !settings.group_commit {
            acquires.disable();
            releases.disable();
        }
        if crate::mutants::active("fresh_send_time")
            || crate::mutants::active("readers_ignore_writers")
            || crate::mutants::active("writers_skip_readers")
        {
            // The mutant's statement is the lone one's text; the shared
            // function runs the real one.
            acquires.disable();
        }
        let backend = PgBackend {
            runner,
            acquires: Arc::new(acquires),
            releases: Arc::new(releases),
            lock_delay_ms: ms(lock_delay),
            listener: Listener::start(CHANNEL_PREFIX, config, tls, wake),
        };
        tokio::spawn(maintain(
            pool,
            Duration::from_millis(settings.idle_cleanup_after_ms),
            Duration::from_millis(settings.cleanup_interval_ms),
        ));
        Ok(backend)
    }

    /// Runs one statement through the runner; `undo` undoes it if its
    /// caller gives up before the answer.
    async fn query(
        &self,
        statement: &'static str,
        params: Params,
        undo: Option<Undo>,
    ) -> Result<Vec<tokio_postgres::Row>, BackendError> {
        self.runner
            .query(statement, params, undo)
            .await
            .map_err(backend_error)
    }
}

/// A statement's failure as the lock manager sees it.
fn backend_error(e: RunError) -> BackendError {
    match e {
        // The server refused or cancelled it: not applied.
        RunError::Db(e) if !crate::pg::connection_suspect(&e) => {
            BackendError::Protocol(crate::pg::describe(&e))
        }
        // A shared statement failed as a whole (one item's row lock timed
        // out, say): nothing of it applied, and the fault may not be this
        // item's — worth another try, which the lock manager makes for
        // `Unavailable`.
        other => unavailable(other),
    }
}

/// The undo of an acquire attempt whose caller gave up: voids the attempt
/// and releases what it took, in whichever order it and the attempt reach
/// the server ([`sql::VOID_ATTEMPT`] says how).
fn void_attempt(key: &LockKey, lease: &LeaseId, channel: String, attempt: String) -> Undo {
    if crate::mutants::active("undo_by_lease") {
        // Mutant: undo by lease id alone, after the late answer, as before
        // issue 26.
        return Undo {
            statement: sql::RELEASE,
            params: vec![key.as_str().to_owned(), lease.as_str().to_owned(), channel],
            after_answer: true,
        };
    }
    Undo {
        statement: sql::VOID_ATTEMPT,
        params: vec![
            key.as_str().to_owned(),
            lease.as_str().to_owned(),
            channel,
            attempt,
        ],
        after_answer: false,
    }
}

/// The acquire statement; for the `fresh_send_time` mutant, the variant
/// that fixes a lease's expiry when the statement starts (`now()`), before
/// any wait for the row's lock — as before issue 10.
fn acquire_sql() -> &'static str {
    if crate::mutants::active("writers_skip_readers") {
        // Mutant: a writer takes the key whatever readers hold it.
        static SKIP: std::sync::LazyLock<&'static str> = std::sync::LazyLock::new(|| {
            Box::leak(
                sql::ACQUIRE
                    .replace(
                        "AND (l.read_until IS NULL OR l.read_until <= clock_timestamp())",
                        "",
                    )
                    .into_boxed_str(),
            )
        });
        return *SKIP;
    }
    if crate::mutants::active("readers_ignore_writers") {
        // Mutant: a writer held off by readers keeps no new reader out.
        static NO_WAIT: std::sync::LazyLock<&'static str> = std::sync::LazyLock::new(|| {
            Box::leak(
                sql::ACQUIRE
                    .replace(
                        "SET write_wait = LEAST(l.read_until, clock_timestamp() + interval '1 second')",
                        "SET write_wait = NULL --",
                    )
                    .into_boxed_str(),
            )
        });
        return *NO_WAIT;
    }
    if crate::mutants::active("fresh_send_time") {
        static OLD: std::sync::LazyLock<&'static str> = std::sync::LazyLock::new(|| {
            Box::leak(
                sql::ACQUIRE
                    .replace(
                        "expires_at = clock_timestamp() + $4",
                        "expires_at = now() + $4",
                    )
                    .into_boxed_str(),
            )
        });
        *OLD
    } else {
        sql::ACQUIRE
    }
}

fn ms(d: Duration) -> i64 {
    d.as_millis().min(i64::MAX as u128) as i64
}

fn ownership(rows: &[tokio_postgres::Row]) -> Result<Ownership, BackendError> {
    let Some(row) = rows.first() else {
        return Ok(Ownership::Free);
    };
    let status: i32 = row.get(0);
    let token: i64 = row.get(1);
    Ok(match status {
        1 => Ownership::Owned {
            token: token as u64,
        },
        0 => Ownership::Free,
        _ => Ownership::OtherHolder,
    })
}

/// Creates the schema once reachable, then periodically deletes rows of
/// keys idle for `idle` (bounded batches), keeping tokens monotonic.
async fn maintain(pool: Pool, idle: Duration, every: Duration) {
    let mut delay = Duration::from_millis(50);
    loop {
        match migrate(&pool).await {
            Ok(()) => break,
            Err(e) => {
                tracing::debug!(error = %e, "postgres schema not created yet; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
    tracing::info!("postgres lock schema ready");
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tick.tick().await;
        match cleanup(&pool, idle).await {
            Ok(Some(0)) => {}
            Ok(Some(n)) => tracing::info!(rows = n, "deleted idle lock rows"),
            Ok(None) => tracing::debug!("idle lock clean-up skipped: new keys being created"),
            Err(e) => tracing::warn!(error = %e, "idle lock clean-up failed"),
        }
        if let Err(e) = cleanup_voids(&pool).await {
            tracing::warn!(error = %e, "clean-up of voided attempts failed");
        }
    }
}

/// Deletes tombstones of voided attempts past [`sql::VOID_RETENTION`]
/// (bounded batch per round).
async fn cleanup_voids(pool: &Pool) -> Result<u64, BackendError> {
    let conn = pool.get().await.map_err(unavailable)?;
    let voids = conn
        .execute(sql::CLEANUP_VOIDS, &[&ms(sql::VOID_RETENTION), &1000i64])
        .await
        .map_err(|e| unavailable(crate::pg::describe(&e)))?;
    // Expired read leases' rows (released ones are gone already).
    let readers = conn
        .execute(sql::CLEANUP_READERS, &[&1000i64])
        .await
        .map_err(|e| unavailable(crate::pg::describe(&e)))?;
    Ok(voids + readers)
}

async fn migrate(pool: &Pool) -> Result<(), BackendError> {
    let mut conn = pool.get().await.map_err(unavailable)?;
    crate::pg::schema::ensure(&mut conn, &sql::pieces(), sql::MIGRATE_LOCK)
        .await
        .map(|_| ())
        .map_err(|e| unavailable(crate::pg::describe(&e)))
}

/// One clean-up round; `Ok(None)` when skipped because acquires were
/// creating rows (the floor's lock was taken).
pub async fn cleanup(pool: &Pool, idle: Duration) -> Result<Option<i64>, BackendError> {
    let mut conn = pool.get().await.map_err(unavailable)?;
    let tx = conn.transaction().await.map_err(unavailable)?;
    let locked: bool = tx
        .query_one("SELECT pg_try_advisory_xact_lock($1)", &[&sql::FLOOR_LOCK])
        .await
        .map_err(unavailable)?
        .get(0);
    if !locked {
        return Ok(None);
    }
    let row = tx
        .query_one(sql::CLEANUP, &[&ms(idle), &1000i64])
        .await
        .map_err(unavailable)?;
    tx.commit().await.map_err(unavailable)?;
    Ok(Some(row.get(0)))
}

impl PgBackend {
    /// A read lease's acquire ([`sql::READ_ACQUIRE`]), undone like a
    /// writer's if its caller gives up before the answer.
    async fn try_read(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Attempt, BackendError> {
        let attempt = crate::lock::lease_id::attempt_id();
        let channel = self.listener.channel(key.as_str());
        let undo = Undo {
            statement: if crate::mutants::active("read_attempt_not_voided") {
                // Mutant: the undo of an abandoned read attempt does nothing.
                "SELECT length($1 || $2 || $3 || $4)"
            } else {
                sql::VOID_READ
            },
            params: vec![
                key.as_str().to_owned(),
                lease.as_str().to_owned(),
                channel,
                attempt.clone(),
            ],
            after_answer: false,
        };
        let rows = self
            .query(
                sql::READ_ACQUIRE,
                vec![
                    Box::new(key.as_str().to_owned()),
                    Box::new(lease.as_str().to_owned()),
                    Box::new(ms(ttl)),
                    Box::new(attempt),
                ],
                Some(undo),
            )
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| BackendError::Protocol("read acquire answered no row".into()))?;
        let (status, token, remaining): (i32, i64, i64) = (row.get(0), row.get(1), row.get(2));
        let remaining = Duration::from_millis(remaining.max(0) as u64);
        Ok(match status {
            1 => Attempt::Acquired {
                token: token as u64,
            },
            -2 => return Err(unavailable("acquire attempt voided by its undo")),
            -3 => Attempt::Delayed { remaining },
            _ => Attempt::Held {
                remaining: Some(remaining),
            },
        })
    }
}

#[async_trait]
impl LockBackend for PgBackend {
    fn name(&self) -> &'static str {
        "postgres"
    }

    async fn try_acquire(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Attempt, BackendError> {
        if key.is_reader() {
            return self.try_read(key, lease, ttl).await;
        }
        // No row comes back when the key's row was inserted by a
        // transaction our statement's snapshot cannot see: it waited for
        // that insert to commit, then had nothing to update. The insert may
        // be this lease's own earlier try (its reply late, the caller gone:
        // a retry racing it was answered "held by another lease", seen in
        // CI as `seams::postgres_a_late_first_reply…`). Once more, then,
        // with a fresh snapshot that sees the committed row: "already ours"
        // or a true "held".
        let mut row = None;
        for _ in 0..2 {
            row = self
                .acquires
                .call(batch::AcquireArgs {
                    key: key.clone(),
                    lease: lease.clone(),
                    ttl_ms: ms(ttl),
                    delay_ms: self.lock_delay_ms,
                    attempt: crate::lock::lease_id::attempt_id(),
                    channel: self.listener.channel(key.as_str()),
                })
                .await
                .map_err(backend_error)?;
            if row.is_some() {
                break;
            }
        }
        let Some((status, token, remaining)) = row else {
            // Still not visible: held by a concurrent first acquire.
            return Ok(Attempt::Held { remaining: None });
        };
        if status == -2 {
            // Voided by the undo of a caller that gave up: never answered.
            return Err(unavailable("acquire attempt voided by its undo"));
        }
        let remaining = Duration::from_millis(remaining.max(0) as u64);
        Ok(match status {
            1 => Attempt::Acquired {
                token: token as u64,
            },
            -3 => Attempt::Delayed { remaining },
            _ => Attempt::Held {
                remaining: Some(remaining),
            },
        })
    }

    async fn renew(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Ownership, BackendError> {
        let statement = if key.is_reader() {
            sql::READ_RENEW
        } else {
            sql::RENEW
        };
        let rows = self
            .query(
                statement,
                vec![
                    Box::new(key.as_str().to_owned()),
                    Box::new(lease.as_str().to_owned()),
                    Box::new(ms(ttl)),
                ],
                None,
            )
            .await?;
        ownership(&rows)
    }

    fn supports_reentrancy(&self) -> bool {
        true
    }

    fn supports_read_locks(&self) -> bool {
        true
    }

    async fn holds(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        change: HoldsChange<'_>,
    ) -> Result<Holds, BackendError> {
        let (expect, to, owner, op): (Option<i32>, i32, Option<String>, Option<String>) =
            match change {
                HoldsChange::Read => (None, 0, None, None),
                HoldsChange::Set {
                    expect,
                    to,
                    owner,
                    op,
                } => (
                    Some(expect as i32),
                    to as i32,
                    Some(owner.to_owned()),
                    Some(op.to_owned()),
                ),
            };
        let rows = self
            .query(
                sql::HOLDS,
                vec![
                    Box::new(key.as_str().to_owned()),
                    Box::new(lease.as_str().to_owned()),
                    Box::new(expect),
                    Box::new(to),
                    Box::new(owner),
                    Box::new(op),
                ],
                None,
            )
            .await?;
        let Some(row) = rows.first() else {
            return Ok(Holds::Free);
        };
        let (status, holds, owner, applied): (i32, i32, Option<String>, bool) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        Ok(match status {
            1 => Holds::Owned {
                holds: holds.max(0) as u32,
                owner,
                applied,
            },
            0 => Holds::Free,
            _ => Holds::OtherHolder,
        })
    }

    async fn inspect(&self, key: &LockKey) -> Result<KeyView, BackendError> {
        let rows = self
            .query(sql::INSPECT, vec![Box::new(key.as_str().to_owned())], None)
            .await?;
        let Some(row) = rows.first() else {
            return Ok(KeyView::default());
        };
        Ok(KeyView::of_row(
            row.get(0),
            row.get(1),
            row.get(2),
            (row.get(3), row.get(4)),
            row.get(5),
        ))
    }

    async fn release(&self, key: &LockKey, lease: &LeaseId) -> Result<Ownership, BackendError> {
        if key.is_reader() {
            let rows = self
                .query(
                    sql::READ_RELEASE,
                    vec![
                        Box::new(key.as_str().to_owned()),
                        Box::new(lease.as_str().to_owned()),
                        Box::new(self.listener.channel(key.as_str())),
                    ],
                    None,
                )
                .await?;
            return ownership(&rows);
        }
        let row = self
            .releases
            .call(batch::ReleaseArgs {
                key: key.clone(),
                lease: lease.clone(),
                channel: self.listener.channel(key.as_str()),
            })
            .await
            .map_err(backend_error)?;
        Ok(match row {
            Some((1, token)) => Ownership::Owned {
                token: token as u64,
            },
            None | Some((0, _)) => Ownership::Free,
            Some(_) => Ownership::OtherHolder,
        })
    }

    async fn renew_many(
        &self,
        items: &[(LockKey, LeaseId, Duration)],
    ) -> Result<Vec<Ownership>, BackendError> {
        if items.iter().any(|(k, _, _)| k.is_reader()) {
            // Read leases renew one by one (their statement locks the
            // key's row and their own); the writers' batch goes as one.
            return crate::lock::readers_apart(
                items,
                |(k, _, _)| k.is_reader(),
                |batch| async move { self.renew_many(&batch).await },
                |(k, l, t)| self.renew(k, l, *t),
            )
            .await;
        }
        let keys: Vec<String> = items
            .iter()
            .map(|(k, _, _)| k.as_str().to_owned())
            .collect();
        let leases: Vec<String> = items
            .iter()
            .map(|(_, l, _)| l.as_str().to_owned())
            .collect();
        let ttls: Vec<i64> = items.iter().map(|(_, _, t)| ms(*t)).collect();
        let rows = self
            .query(
                sql::RENEW_MANY,
                vec![Box::new(keys), Box::new(leases), Box::new(ttls)],
                None,
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| {
                if r.get::<_, bool>(0) {
                    Ownership::Owned {
                        token: r.get::<_, i64>(1) as u64,
                    }
                } else {
                    Ownership::Free
                }
            })
            .collect())
    }

    async fn raise_token_floor(&self, key: &LockKey, floor: u64) -> Result<(), BackendError> {
        let floor = i64::try_from(floor)
            .map_err(|_| BackendError::Protocol("floor out of range".into()))?;
        self.query(
            sql::RAISE_FLOOR,
            vec![Box::new(key.as_str().to_owned()), Box::new(floor)],
            None,
        )
        .await
        .map(|_| ())
    }

    async fn watch(&self, key: &LockKey, timeout: Duration) -> WatchGuard {
        WatchGuard::new(self.listener.watch(key.as_str(), timeout).await)
    }

    async fn fix_permits(&self, name: &LockKey, permits: u32) -> Result<u32, BackendError> {
        let asked = i32::try_from(permits)
            .map_err(|_| BackendError::Protocol("permits out of range".into()))?;
        for _ in 0..2 {
            let rows = self
                .query(
                    sql::PERMITS,
                    vec![Box::new(name.as_str().to_owned()), Box::new(asked)],
                    None,
                )
                .await?;
            if let Some(row) = rows.first() {
                let n: i32 = row.get(0);
                return u32::try_from(n)
                    .map_err(|_| BackendError::Protocol(format!("semaphore permit count {n}")));
            }
        }
        Err(BackendError::Unavailable(
            "the semaphore's permit count was not readable twice in a row".into(),
        ))
    }

    async fn ping(&self) -> Result<(), BackendError> {
        self.query("SELECT 1 FROM fencer_locks LIMIT 0", Vec::new(), None)
            .await
            .map(|_| ())
    }
}
