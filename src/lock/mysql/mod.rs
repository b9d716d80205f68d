//! The MySQL / MariaDB lock backend: the seeds' first design (a lock row in
//! the database the application already has), made safe.
//!
//! What a naive database lock gets wrong, and what this one does instead:
//! - **No transaction held while the application works.** Each operation
//!   is one stored-procedure call: a short transaction that locks the
//!   key's row, decides, and commits ([`sql`]). A lease is a row with an
//!   expiry, not an open transaction or a `GET_LOCK` on a connection that
//!   dies with it.
//! - **Leases on the server's clock** (`SYSDATE(6)` in UTC), never the
//!   sidecar's, counted from the moment the row lock is granted.
//! - **Tokens never go back**, including after idle rows are deleted: a
//!   new row starts above the token floor, which the clean-up raises first.
//! - **Idempotent acquire**: a retry with the same lease id after an
//!   unknown outcome gets the same token, and a statement whose caller
//!   gave up is killed and, if it was granted anyway, released on its own
//!   connection ([`crate::mysql::runner`]).
//! - **Wake-ups without polling**: the sidecar's FIFO per key, plus bells
//!   ([`bell`], [`wake`]): named locks that wake other sidecars the moment
//!   a lease ends; the fallback timer only for leases that expire.

pub mod bell;
mod holders;
pub mod settings;
pub mod sql;
pub mod wake;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use mysql_async::prelude::Queryable;
use mysql_async::{Params, Pool, Row, Value};
use tokio::time::Instant;

use self::bell::Bells;
use self::settings::MySqlSettings;
use self::wake::Waker;
use super::{
    Attempt, BackendError, Holds, HoldsChange, KeyView, LeaseId, LockBackend, LockKey, Ownership,
    WakeSink, WatchGuard,
};
use crate::metrics::mysql::MySqlMetrics;
use crate::metrics::sql::SQL;
use crate::mysql::runner::{Compensation, Lent};
use crate::mysql::{MyOptions, RunError, Runner};

pub struct MySqlBackend {
    runner: Runner,
    /// Each try of a call — bell and statement — comes out of this one
    /// budget (`request_timeout_ms`).
    request_timeout: Duration,
    lock_delay_ms: i64,
    bells: Arc<Bells>,
    waker: Waker,
    wake: Arc<dyn WakeSink>,
    metrics: Arc<MySqlMetrics>,
    /// Per key, the bell holder (connection id, 0: none) the last `Held`
    /// answer reported, for the `watch` that follows it (dated, pruned).
    holders: holders::HolderHints,
    ready: Arc<AtomicBool>,
}

fn unavailable(e: impl std::fmt::Display) -> BackendError {
    BackendError::Unavailable(e.to_string())
}

/// The TTL written into a lease row; for the `mysql_early_expiry` mutant,
/// half of it (the row expires before the holder's local deadline).
fn server_ttl_ms(ttl: Duration) -> i64 {
    if crate::mutants::active("mysql_early_expiry") {
        ms(ttl / 2)
    } else {
        ms(ttl)
    }
}

fn ms(d: Duration) -> i64 {
    d.as_millis().min(i64::MAX as u128) as i64
}

fn int(row: &Row, i: usize) -> Result<i64, BackendError> {
    row.get_opt::<Option<i64>, _>(i)
        .and_then(|r| r.ok())
        .map(|v| v.unwrap_or(0))
        .ok_or_else(|| BackendError::Protocol(format!("column {i} is not an integer")))
}

/// Frees the bell's pending slot of an acquire that ends without the key
/// (answered `Held`, failed, or its caller went away).
struct PendingBell<'a> {
    bells: &'a Bells,
    key: &'a str,
    armed: bool,
}

impl Drop for PendingBell<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.bells.not_acquired(self.key);
        }
    }
}

impl MySqlBackend {
    /// Creates the backend without waiting for the server: the schema is
    /// created by a background task as soon as it answers, and the sidecar
    /// reports not-ready until then.
    pub fn new(
        settings: &MySqlSettings,
        lock_delay: Duration,
        wake: Arc<dyn WakeSink>,
        registry: &prometheus::Registry,
    ) -> Result<MySqlBackend, BackendError> {
        let metrics = Arc::new(MySqlMetrics::new(registry));
        let options = |pool_size| MyOptions {
            url: &settings.url,
            ca_file: settings.ca_file.as_deref(),
            pool_size,
            statement_timeout: settings.statement_timeout(),
        };
        let pool = crate::mysql::pool(&options(settings.pool_size)).map_err(unavailable)?;
        let wake_pool = (settings.wake_connections > 0)
            .then(|| crate::mysql::pool(&options(settings.wake_connections)))
            .transpose()
            .map_err(unavailable)?;
        let bell_opts = crate::mysql::opts(&options(1)).map_err(unavailable)?;
        let ready = Arc::new(AtomicBool::new(false));
        tokio::spawn(maintain(
            pool.clone(),
            ready.clone(),
            metrics.clone(),
            Duration::from_millis(settings.idle_cleanup_after_ms),
            Duration::from_millis(settings.cleanup_interval_ms),
        ));
        // Two connections of their own for `KILL QUERY`: the statement pool
        // may be full of the very statements that are stuck.
        let kill_pool = crate::mysql::pool(&options(2)).map_err(unavailable)?;
        let request_timeout = Duration::from_millis(settings.request_timeout_ms);
        Ok(MySqlBackend {
            runner: Runner::new(pool, kill_pool, request_timeout, &settings.url),
            request_timeout,
            lock_delay_ms: ms(lock_delay),
            bells: Bells::start(bell_opts, settings.bell_connections, metrics.clone()),
            waker: Waker::new(wake_pool, wake.clone(), metrics.clone()),
            metrics,
            wake,
            holders: holders::HolderHints::default(),
            ready,
        })
    }

    /// Runs one statement through the runner (first result set's rows),
    /// within the request timeout from now.
    async fn call(
        &self,
        statement: &'static str,
        params: Vec<Value>,
    ) -> Result<Vec<Row>, BackendError> {
        self.call_until(Instant::now() + self.request_timeout, statement, || {
            (params.clone(), None)
        })
        .await
    }

    /// Runs one statement through the runner, answering by `deadline`.
    /// `attempt` gives each try its parameters and the compensation that
    /// undoes it if it succeeds after its caller gave up. A try the server
    /// rolled back to break a deadlock ([`crate::mysql::retryable`]) is
    /// tried again, with fresh parameters, while the deadline allows: the
    /// server asks for exactly that, and nothing of the try applied.
    async fn call_until(
        &self,
        deadline: Instant,
        statement: &'static str,
        mut attempt: impl FnMut() -> (Vec<Value>, Option<Compensation<Vec<Row>>>),
    ) -> Result<Vec<Row>, BackendError> {
        let mut retries = 0u32;
        loop {
            let (params, compensate) = attempt();
            let result = self
                .runner
                .run_until(
                    deadline,
                    move |mut conn: Lent| async move {
                        let r = conn
                            .exec::<Row, _, _>(statement, Params::Positional(params))
                            .await;
                        (conn, r)
                    },
                    compensate,
                )
                .await;
            let pause = crate::mysql::retry_pause(retries);
            return match result {
                Err(RunError::Db(e))
                    if crate::mysql::retryable(&e) && Instant::now() + pause < deadline =>
                {
                    SQL.retries.with_label_values(&["mysql"]).inc();
                    tracing::debug!(statement, retries, error = %crate::mysql::describe(&e), "mysql rolled the statement back; trying again");
                    tokio::time::sleep(pause).await;
                    retries += 1;
                    continue;
                }
                Ok(rows) => Ok(rows),
                // The server refused it: not applied.
                Err(RunError::Db(e)) if !crate::mysql::connection_suspect(&e) => {
                    Err(BackendError::Protocol(crate::mysql::describe(&e)))
                }
                Err(other) => Err(unavailable(other)),
            };
        }
    }

    fn ownership(&self, rows: &[Row]) -> Result<Ownership, BackendError> {
        let Some(row) = rows.first() else {
            return Err(BackendError::Protocol("no status row".into()));
        };
        Ok(match int(row, 0)? {
            1 => Ownership::Owned {
                token: int(row, 1)? as u64,
            },
            0 => Ownership::Free,
            _ => Ownership::OtherHolder,
        })
    }
}

fn key_value(key: &LockKey) -> Value {
    Value::Bytes(key.as_str().as_bytes().to_vec())
}

fn lease_value(lease: &LeaseId) -> Value {
    Value::Bytes(lease.as_str().as_bytes().to_vec())
}

/// How soon a waiter re-checks a key held without a bell.
const NO_BELL_RECHECK: Duration = Duration::from_millis(500);

const ACQUIRE: &str = "CALL fencer_lock_acquire_v5(?, ?, ?, ?, ?, ?)";
const READ_ACQUIRE: &str = "CALL fencer_lock_read_acquire_v2(?, ?, ?, ?, ?)";
const READ_RENEW: &str = "CALL fencer_lock_read_renew_v1(?, ?, ?)";
const READ_RELEASE: &str = "CALL fencer_lock_read_release_v1(?, ?, ?)";
const RENEW: &str = "CALL fencer_lock_renew_v1(?, ?, ?)";
const RENEW_MANY: &str = "CALL fencer_lock_renew_many_v1(?)";
const RELEASE: &str = "CALL fencer_lock_release_v1(?, ?)";
const RELEASE_ATTEMPT: &str = "CALL fencer_lock_release_attempt_v1(?, ?, ?)";
const HOLDS: &str = "CALL fencer_lock_holds_v1(?, ?, ?, ?, ?, ?)";
/// The key's row, read without a lock (a consistent read: no writer waits
/// for it): held, lease, token (the key's counter), ms left on the lease
/// and on its lock-delay, on the server's clock.
const INSPECT: &str =
    "SELECT IF(lease_id IS NOT NULL AND expires_at > SYSDATE(6), 1, 0), lease_id, token,
  COALESCE(GREATEST(0, TIMESTAMPDIFF(MICROSECOND, SYSDATE(6), expires_at) DIV 1000), 0),
  COALESCE(GREATEST(0, TIMESTAMPDIFF(MICROSECOND, SYSDATE(6),
                        TIMESTAMPADD(MICROSECOND, delay_ms * 1000, expires_at)) DIV 1000), 0),
  (SELECT COUNT(*) FROM fencer_readers r
    WHERE r.lock_key = fencer_locks.lock_key AND r.expires_at > SYSDATE(6))
  FROM fencer_locks WHERE lock_key = ?";

/// Releases, on the acquire's own connection, a lock that an acquire
/// attempt whose caller gave up was granted after all — only while the
/// row still carries that attempt (`sql::ADD_ATTEMPT` says why: a retry of
/// the same lease may have been answered meanwhile, and then the lease is
/// the application's).
fn release_if_granted(key: Value, lease: Value, attempt: Value) -> Compensation<Vec<Row>> {
    // Mutant: undo by lease id alone, as before issue 26.
    let (statement, params) = if crate::mutants::active("undo_by_lease") {
        (RELEASE, vec![key, lease])
    } else {
        (RELEASE_ATTEMPT, vec![key, lease, attempt])
    };
    undo_if_granted(statement, params, "acquire")
}

/// [`release_if_granted`] for a read acquire: removes the reader row only
/// while it still carries this attempt.
fn release_read_if_granted(key: Value, lease: Value, attempt: Value) -> Compensation<Vec<Row>> {
    if crate::mutants::active("read_attempt_not_voided") {
        // Mutant: the compensation of a read attempt does nothing.
        return Box::new(|conn: Lent, _rows: Vec<Row>| Box::pin(async move { conn }));
    }
    undo_if_granted(READ_RELEASE, vec![key, lease, attempt], "read acquire")
}

/// Runs `statement` (answering `(status, token)`) on the acquire's own
/// connection when its late answer says it granted the lease; counted in
/// `fencer_sql_undos_total`.
fn undo_if_granted(
    statement: &'static str,
    params: Vec<Value>,
    what: &'static str,
) -> Compensation<Vec<Row>> {
    Box::new(move |mut conn: Lent, rows: Vec<Row>| {
        Box::pin(async move {
            if rows.first().is_some_and(|r| int(r, 0).ok() == Some(1)) {
                let r = conn
                    .exec_first::<(i64, i64), _, _>(statement, Params::Positional(params))
                    .await;
                let outcome = match &r {
                    Ok(Some((1, _))) => "released",
                    Ok(_) => "voided",
                    Err(_) => "failed",
                };
                SQL.undos.with_label_values(&["mysql", outcome]).inc();
                tracing::info!(
                    outcome,
                    what,
                    "compensation of an attempt whose caller gave up"
                );
            }
            conn
        })
    })
}

/// Creates the schema once reachable, then periodically deletes rows of
/// keys idle for `idle` (bounded batches), keeping tokens monotonic.
async fn maintain(
    pool: Pool,
    ready: Arc<AtomicBool>,
    metrics: Arc<MySqlMetrics>,
    idle: Duration,
    every: Duration,
) {
    let mut delay = Duration::from_millis(50);
    loop {
        match tokio::time::timeout(Duration::from_secs(30), migrate(&pool)).await {
            Ok(Ok(())) => break,
            failed => {
                tracing::debug!(error = ?failed.map(|r| r.err()), "mysql schema not created yet; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
    ready.store(true, Ordering::Release);
    tracing::info!("mysql lock schema ready");
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tick.tick().await;
        match tokio::time::timeout(Duration::from_secs(30), cleanup(&pool, idle)).await {
            Ok(Ok(Some(0))) => {}
            Ok(Ok(Some(n))) => {
                metrics.cleanup_rows.inc_by(n as u64);
                tracing::info!(rows = n, "deleted idle lock rows");
            }
            Ok(Ok(None)) => tracing::debug!("idle lock clean-up skipped: new keys being created"),
            Ok(Err(e)) => tracing::warn!(error = %e, "idle lock clean-up failed"),
            Err(_) => tracing::warn!("idle lock clean-up timed out"),
        }
    }
}

/// Creates what is missing of the schema, serialized between starting
/// sidecars by a named lock. The catalog is read first: a start against an
/// up-to-date database runs no DDL (no metadata lock on the busy table).
pub async fn migrate(pool: &Pool) -> Result<(), mysql_async::Error> {
    let mut conn = pool.get_conn().await?;
    crate::mysql::schema::ensure(&mut conn, &sql::pieces(), "fencer:schema")
        .await
        .map(|_| ())
}

/// One clean-up round ([`sql::CLEANUP_LOCK`]); `Ok(None)` when skipped
/// because acquires were creating rows (the floor's lock was taken).
pub async fn cleanup(pool: &Pool, idle: Duration) -> Result<Option<i64>, mysql_async::Error> {
    let mut conn = pool.get_conn().await?;
    let mut tx = conn
        .start_transaction(mysql_async::TxOpts::default())
        .await?;
    match tx.query_drop(sql::CLEANUP_LOCK).await {
        Ok(()) => {}
        // 1205 / 3572: lock wait timeout / NOWAIT refused.
        Err(e) if matches!(crate::mysql::server_code(&e), Some(1205 | 3572)) => {
            tx.rollback().await?;
            return Ok(None);
        }
        Err(e) => return Err(e),
    }
    let idle_ms = ms(idle);
    let any: Option<i64> = tx.exec_first(sql::cleanup_count(), (idle_ms,)).await?;
    if any != Some(1) {
        tx.commit().await?;
        return Ok(Some(0));
    }
    tx.query_drop(sql::CLEANUP_RAISE).await?;
    tx.exec_drop(sql::cleanup_delete(), (idle_ms, 1000i64))
        .await?;
    let n = tx.affected_rows() as i64;
    tx.commit().await?;
    conn.exec_drop(sql::CLEANUP_READERS, (1000i64,)).await?;
    Ok(Some(n))
}

impl MySqlBackend {
    /// A read lease's acquire (`fencer_lock_read_acquire_v2`). A reader
    /// takes no bell: a writer it holds off re-checks within
    /// [`NO_BELL_RECHECK`] (or at once, in this sidecar, on its release);
    /// a reader held off by a writer watches the writer's bell as any
    /// waiter does.
    async fn try_read(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Attempt, BackendError> {
        let deadline = Instant::now() + self.request_timeout;
        let bell = self.bells.name_of(key.as_str());
        let rows = self
            .call_until(deadline, READ_ACQUIRE, || {
                let attempt = Value::Bytes(crate::lock::lease_id::attempt_id().into_bytes());
                (
                    vec![
                        key_value(key),
                        lease_value(lease),
                        Value::Int(server_ttl_ms(ttl)),
                        Value::Bytes(bell.clone().into_bytes()),
                        attempt.clone(),
                    ],
                    Some(release_read_if_granted(
                        key_value(key),
                        lease_value(lease),
                        attempt,
                    )),
                )
            })
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| BackendError::Protocol("read acquire returned no row".into()))?;
        let (status, token, remaining, holder) =
            (int(row, 0)?, int(row, 1)?, int(row, 2)?, int(row, 3)?);
        let remaining = Duration::from_millis(remaining.max(0) as u64);
        match status {
            1 => Ok(Attempt::Acquired {
                token: token as u64,
            }),
            -3 => Ok(Attempt::Delayed { remaining }),
            _ => {
                let holder = holder.clamp(0, u32::MAX as i64) as u32;
                self.holders.record(key.as_str(), holder);
                Ok(Attempt::Held {
                    remaining: Some(if holder == 0 {
                        remaining.min(NO_BELL_RECHECK)
                    } else {
                        remaining
                    }),
                })
            }
        }
    }
}

#[async_trait]
impl LockBackend for MySqlBackend {
    fn name(&self) -> &'static str {
        "mysql"
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
        // One budget for the whole try (issue 27 item 4): the bell may take
        // a quarter of it at most — it only speeds up other sidecars'
        // waiters, and one not taken in time is retried in the background —
        // and the statement (pool checkout included) has the rest.
        let started = Instant::now();
        let deadline = started + self.request_timeout;
        self.bells
            .before_acquire(key.as_str(), started + self.request_timeout / 4)
            .await;
        let mut pending = PendingBell {
            bells: &self.bells,
            key: key.as_str(),
            armed: true,
        };
        let bell = self.bells.name_of(key.as_str());
        // Each try (a rolled-back one is tried again) has its own attempt
        // id, so an undo only ever names the try it belongs to.
        let rows = self
            .call_until(deadline, ACQUIRE, || {
                let attempt = Value::Bytes(crate::lock::lease_id::attempt_id().into_bytes());
                (
                    vec![
                        key_value(key),
                        lease_value(lease),
                        Value::Int(server_ttl_ms(ttl)),
                        Value::Int(self.lock_delay_ms),
                        Value::Bytes(bell.clone().into_bytes()),
                        attempt.clone(),
                    ],
                    Some(release_if_granted(
                        key_value(key),
                        lease_value(lease),
                        attempt,
                    )),
                )
            })
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| BackendError::Protocol("acquire returned no row".into()))?;
        let (status, token, remaining, holder) =
            (int(row, 0)?, int(row, 1)?, int(row, 2)?, int(row, 3)?);
        if status == 1 {
            pending.armed = false;
            self.holders.forget(key.as_str());
            self.bells
                .acquired(key.as_str(), lease.as_str(), started + ttl);
            return Ok(Attempt::Acquired {
                token: token as u64,
            });
        }
        let mut holder = holder.clamp(0, u32::MAX as i64) as u32;
        let mut remaining = Duration::from_millis(remaining.max(0) as u64);
        if status == -3 {
            // Nobody holds it: the lock-delay of an expired lease, with
            // nothing to ring at its end.
            return Ok(Attempt::Delayed { remaining });
        }
        if holder != 0 && self.bells.is_ours(holder) && !self.bells.has_lease(key.as_str()) {
            // Our bell, but only because our own tries took it (concurrent
            // first acquires: ours took the bell, another sidecar's got the
            // row and its bell later). No release here will ring for the
            // real holder: as for a lease without a bell, re-check soon —
            // by then its sidecar has the bell, and the waiter watches it.
            holder = 0;
        }
        if holder == 0 {
            // Held without a bell: its sidecar is gone (the server freed
            // its bell) or has not taken it yet. Nothing will ring; re-check
            // within a bounded time instead of only at the lease's expiry.
            self.metrics
                .watch_results
                .with_label_values(&["no_bell"])
                .inc();
            remaining = remaining.min(NO_BELL_RECHECK);
        } else if !self.bells.is_ours(holder) {
            // A watch that already woke its queue waits for this holder.
            self.waker.rearm(key.as_str());
        }
        self.holders.record(key.as_str(), holder);
        Ok(Attempt::Held {
            remaining: Some(remaining),
        })
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
        let deadline = Instant::now() + self.request_timeout;
        let (expect, to, owner, op) = match change {
            HoldsChange::Read => (Value::NULL, Value::Int(0), Value::NULL, Value::NULL),
            HoldsChange::Set {
                expect,
                to,
                owner,
                op,
            } => (
                Value::Int(i64::from(expect)),
                Value::Int(i64::from(to)),
                Value::Bytes(owner.as_bytes().to_vec()),
                Value::Bytes(op.as_bytes().to_vec()),
            ),
        };
        let rows = self
            .call_until(deadline, HOLDS, || {
                (
                    vec![
                        key_value(key),
                        lease_value(lease),
                        expect.clone(),
                        to.clone(),
                        owner.clone(),
                        op.clone(),
                    ],
                    None,
                )
            })
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| BackendError::Protocol("holds returned no row".into()))?;
        Ok(match int(row, 0)? {
            1 => Holds::Owned {
                holds: int(row, 1)?.clamp(0, i64::from(u32::MAX)) as u32,
                owner: row
                    .get_opt::<Option<Vec<u8>>, _>(2)
                    .and_then(|r| r.ok())
                    .flatten()
                    .map(|b| String::from_utf8_lossy(&b).into_owned()),
                applied: int(row, 3)? == 1,
            },
            0 => Holds::Free,
            _ => Holds::OtherHolder,
        })
    }

    async fn inspect(&self, key: &LockKey) -> Result<KeyView, BackendError> {
        let deadline = Instant::now() + self.request_timeout;
        let rows = self
            .call_until(deadline, INSPECT, || (vec![key_value(key)], None))
            .await?;
        let Some(row) = rows.first() else {
            return Ok(KeyView::default());
        };
        let held = int(row, 0)? == 1;
        let lease = row
            .get_opt::<Option<Vec<u8>>, _>(1)
            .and_then(|r| r.ok())
            .flatten()
            .map(|b| String::from_utf8_lossy(&b).into_owned());
        Ok(KeyView::of_row(
            held,
            lease,
            int(row, 2)?,
            (int(row, 3)?, int(row, 4)?),
            int(row, 5)?,
        ))
    }

    async fn renew(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Ownership, BackendError> {
        let started = Instant::now();
        let deadline = started + self.request_timeout;
        if key.is_reader() {
            let rows = self
                .call_until(deadline, READ_RENEW, || {
                    let params = vec![
                        key_value(key),
                        lease_value(lease),
                        Value::Int(server_ttl_ms(ttl)),
                    ];
                    (params, None)
                })
                .await?;
            return self.ownership(&rows);
        }
        let rows = self
            .call_until(deadline, RENEW, || {
                (
                    vec![
                        key_value(key),
                        lease_value(lease),
                        Value::Int(server_ttl_ms(ttl)),
                    ],
                    None,
                )
            })
            .await?;
        let o = self.ownership(&rows)?;
        match o {
            Ownership::Owned { .. } => {
                self.bells
                    .renewed(key.as_str(), lease.as_str(), started + ttl)
            }
            _ => {
                self.bells
                    .ended(key.as_str(), lease.as_str(), deadline)
                    .await
            }
        }
        Ok(o)
    }

    async fn renew_many(
        &self,
        items: &[(LockKey, LeaseId, Duration)],
    ) -> Result<Vec<Ownership>, BackendError> {
        if items.iter().any(|(k, _, _)| k.is_reader()) {
            return crate::lock::readers_apart(
                items,
                |(k, _, _)| k.is_reader(),
                |batch| async move { self.renew_many(&batch).await },
                |(k, l, t)| self.renew(k, l, *t),
            )
            .await;
        }
        let started = Instant::now();
        let deadline = started + self.request_timeout;
        let json: Vec<(String, &str, i64)> = items
            .iter()
            .map(|(k, l, t)| (hex(k.as_str().as_bytes()), l.as_str(), server_ttl_ms(*t)))
            .collect();
        let json =
            serde_json::to_string(&json).map_err(|e| BackendError::Protocol(e.to_string()))?;
        let rows = self
            .call_until(deadline, RENEW_MANY, || {
                (vec![Value::Bytes(json.clone().into_bytes())], None)
            })
            .await?;
        if rows.len() != items.len() {
            return Err(BackendError::Protocol(format!(
                "renewed {} of {} leases",
                rows.len(),
                items.len()
            )));
        }
        let mut out = Vec::with_capacity(items.len());
        for (row, (key, lease, ttl)) in rows.iter().zip(items) {
            if int(row, 0)? == 1 {
                self.bells
                    .renewed(key.as_str(), lease.as_str(), started + *ttl);
                out.push(Ownership::Owned {
                    token: int(row, 1)? as u64,
                });
            } else {
                self.bells
                    .ended(key.as_str(), lease.as_str(), deadline)
                    .await;
                out.push(Ownership::Free);
            }
        }
        Ok(out)
    }

    async fn release(&self, key: &LockKey, lease: &LeaseId) -> Result<Ownership, BackendError> {
        let deadline = Instant::now() + self.request_timeout;
        if key.is_reader() {
            let rows = self
                .call_until(deadline, READ_RELEASE, || {
                    (vec![key_value(key), lease_value(lease), Value::NULL], None)
                })
                .await?;
            let o = self.ownership(&rows)?;
            if matches!(o, Ownership::Owned { .. }) {
                // Waiters of this sidecar; other sidecars' writers re-check
                // (a reader rings no bell).
                self.wake.released(key.as_str());
            }
            return Ok(o);
        }
        let rows = self
            .call_until(deadline, RELEASE, || {
                (vec![key_value(key), lease_value(lease)], None)
            })
            .await?;
        let o = self.ownership(&rows)?;
        // Rings the bell: remote waiters wake.
        self.bells
            .ended(key.as_str(), lease.as_str(), deadline)
            .await;
        if matches!(o, Ownership::Owned { .. }) {
            // Waiters of this sidecar.
            self.wake.released(key.as_str());
        }
        Ok(o)
    }

    async fn raise_token_floor(&self, key: &LockKey, floor: u64) -> Result<(), BackendError> {
        let floor = i64::try_from(floor)
            .map_err(|_| BackendError::Protocol("floor out of range".into()))?;
        self.call(sql::RAISE_FLOOR, vec![key_value(key), Value::Int(floor)])
            .await
            .map(|_| ())
    }

    async fn fix_permits(&self, name: &LockKey, permits: u32) -> Result<u32, BackendError> {
        let rows = self
            .call(
                sql::PERMITS,
                vec![key_value(name), Value::Int(i64::from(permits))],
            )
            .await?;
        let n: Option<i64> = rows.first().and_then(|r| r.get(0));
        n.and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| BackendError::Protocol(format!("semaphore permit count {n:?}")))
    }

    async fn watch(&self, key: &LockKey, _timeout: Duration) -> WatchGuard {
        let holder = self.holders.take(key.as_str());
        match holder {
            // Another sidecar's bell: wait on it.
            Some(id) if id != 0 && !self.bells.is_ours(id) => {
                match self
                    .waker
                    .watch(key.as_str(), self.bells.name_of(key.as_str()))
                {
                    Some(g) => WatchGuard::new(g),
                    None => WatchGuard::none(),
                }
            }
            // Ours (this sidecar's release wakes its own queue), or none
            // (the lease is waited out on the fallback timer).
            _ => WatchGuard::none(),
        }
    }

    async fn ping(&self) -> Result<(), BackendError> {
        if !self.ready.load(Ordering::Acquire) {
            return Err(unavailable(format!(
                "mysql {}: lock schema not created yet (server not reached, or the schema check failed: see the log at debug level)",
                self.runner.target()
            )));
        }
        self.call("SELECT 1", Vec::new()).await.map(|_| ())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
