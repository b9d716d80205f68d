//! Statements that no cancelled caller can leave half-done.
//!
//! In tokio a caller that times out or whose HTTP client went away drops its
//! future at the current `.await`. A statement whose future is dropped keeps
//! running on the server — or has not even reached it yet: its bytes may
//! still be in a socket buffer, a proxy or a stalled network, and arrive
//! seconds later (PITFALLS 9; issue 10 items 1 and 4, issue 27 item 3).
//!
//! So every statement runs in a task of its own that owns the connection.
//! The caller only waits for the task's answer, bounded by its timeout.
//! When the caller stops waiting before the answer — timeout or drop — the
//! task (not the caller) decides what happens:
//!
//! 1. it sends PostgreSQL a cancel request for the running statement (a
//!    statement that is running ends with a known failure; one that has
//!    not arrived yet is not touched by it);
//! 2. it takes the connection out of the pool at once ([`Lent`]): a
//!    connection with a statement in flight is never handed to another
//!    caller, who would wait behind it (the client is dropped; its socket
//!    closes once the server has answered what it was sent);
//! 3. it runs the caller's [`Undo`], if any, on another connection —
//!    retried in the background until it ran (bounded). An undo is written
//!    to be right *whatever the order* in which it and the abandoned
//!    statement reach the server: it releases what the statement took, and
//!    leaves a tombstone that the statement honours if it comes later
//!    ([`crate::lock::postgres::sql::VOID_ATTEMPT`]).

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::Tls;
use crate::metrics::sql::SQL;

/// Bound on the cancel request of an abandoned statement.
const CANCEL_GRACE: Duration = Duration::from_secs(5);
/// How long an undo that could not run is retried: longer than any
/// plausible delay of the abandoned statement on its way to the server (a
/// stall of the network or of the server itself); after that it is
/// counted `failed` and logged.
pub const UNDO_RETRY_FOR: Duration = Duration::from_secs(15 * 60);
const UNDO_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Undos being retried at once, at most; beyond, a new one is counted
/// `failed` at once (memory stays bounded through a long outage).
const MAX_PENDING_UNDOS: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// No answer within the caller's timeout. The statement may still be
    /// applied; the runner cancels it and runs its undo.
    #[error("postgres request timed out")]
    Timeout,
    #[error("no postgres connection: {0}")]
    Pool(String),
    /// A statement that always answers one row answered none.
    #[error("postgres: the statement answered no row")]
    NoRow,
    #[error("postgres: {}", super::describe(.0))]
    Db(#[from] tokio_postgres::Error),
    /// The shared statement of a group commit ([`super::group`]) failed;
    /// each of its items is answered with this.
    #[error("postgres (shared statement): {message}")]
    Shared {
        message: String,
        /// The server refused it or it was never sent: nothing applied.
        refused: bool,
    },
}

impl RunError {
    /// Whether nothing of the statement was applied: the server refused
    /// it (an error with an SQLSTATE on a sound connection), or no
    /// connection was had. Otherwise the outcome is unknown.
    pub fn refused(&self) -> bool {
        match self {
            RunError::Db(e) => !super::connection_suspect(e),
            RunError::Pool(_) => true,
            RunError::Shared { refused, .. } => *refused,
            RunError::Timeout | RunError::NoRow => false,
        }
    }
}

/// What undoes a statement whose caller gave up: one statement whose
/// first column (int) is how many things it gave back. It must be right in
/// any order with the statement it undoes — before it, after it, or while
/// it runs — since it runs on another connection (see the module comment).
#[derive(Clone, Debug)]
pub struct Undo {
    pub statement: &'static str,
    pub params: Vec<String>,
    /// Mutant `undo_by_lease` only: run the undo on the statement's own
    /// connection once its late answer arrives, as before issue 27.
    pub after_answer: bool,
}

/// A pooled connection lent to one statement: unless handed back with
/// [`Lent::into_pool`], dropping it takes the connection out of the pool
/// for good, so a connection whose statement was abandoned mid-flight is
/// never reused (issue 27 item 3: the runner said "closed" and pooled it).
pub struct Lent(Option<Object>);

impl Lent {
    /// Gives the connection back to the pool (its statement has ended).
    pub fn into_pool(mut self) {
        drop(self.0.take());
    }

    fn into_inner(mut self) -> Object {
        self.0.take().expect("lent connection present")
    }
}

impl std::ops::Deref for Lent {
    type Target = Object;
    fn deref(&self) -> &Object {
        self.0.as_ref().expect("lent connection present")
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(obj) = self.0.take() {
            // Mutant: the abandoned connection goes back, as before issue 10.
            if crate::mutants::active("fresh_send_time") {
                return;
            }
            drop(Object::take(obj));
        }
    }
}

/// A statement's parameters, owned (they go to the statement's task).
pub type Params = Vec<Box<dyn tokio_postgres::types::ToSql + Sync + Send>>;

/// Runs statements on a pool, each in a task that owns its connection.
#[derive(Clone)]
pub struct Runner {
    pool: Pool,
    tls: Tls,
    timeout: Duration,
    pending_undos: Arc<AtomicUsize>,
    /// The server's URL, password redacted: a connection error names it.
    target: Arc<str>,
}

impl Runner {
    /// `timeout` bounds how long callers wait, pool checkout included;
    /// `url` is the pool's server, named (redacted) by connection errors.
    pub fn new(pool: Pool, tls: Tls, timeout: Duration, url: &str) -> Runner {
        Runner {
            pool,
            tls,
            timeout,
            pending_undos: Arc::new(AtomicUsize::new(0)),
            target: crate::settings::check::redact_url(url).into(),
        }
    }

    /// The pool's server as errors name it (URL, password redacted).
    pub fn target(&self) -> &str {
        &self.target
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Runs `work` (given the connection, handing it back with the result)
    /// in its own task. If the caller stops waiting before the result is
    /// known, `undo` runs (see the module comment).
    pub async fn run<T, W, F>(&self, work: W, undo: Option<Undo>) -> Result<T, RunError>
    where
        T: Send + 'static,
        W: FnOnce(Lent) -> F + Send + 'static,
        F: Future<Output = (Lent, Result<T, tokio_postgres::Error>)> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        tokio::spawn(statement_task(self.clone(), work, undo, tx));
        match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(result)) => result,
            // The task ended without an answer (it panicked): unknown outcome.
            Ok(Err(_)) => Err(RunError::Timeout),
            // Dropping `rx` tells the task its caller is gone.
            Err(_) => Err(RunError::Timeout),
        }
    }

    /// Runs one prepared (and cached) `statement` with `params`: [`Runner::run`]
    /// for the common case.
    pub async fn query(
        &self,
        statement: &'static str,
        params: Params,
        undo: Option<Undo>,
    ) -> Result<Vec<tokio_postgres::Row>, RunError> {
        self.run(
            move |conn: Lent| async move {
                let result = async {
                    let stmt = conn.prepare_cached(statement).await?;
                    let refs: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params
                        .iter()
                        .map(|p| p.as_ref() as &(dyn tokio_postgres::types::ToSql + Sync))
                        .collect();
                    conn.query(&stmt, &refs).await
                }
                .await;
                (conn, result)
            },
            undo,
        )
        .await
    }

    /// Runs `undo` on a connection of the pool until it ran, retrying
    /// (bounded) while the database cannot be reached.
    pub(crate) fn spawn_undo(&self, undo: Undo) {
        if self.pending_undos.fetch_add(1, Ordering::AcqRel) >= MAX_PENDING_UNDOS {
            self.pending_undos.fetch_sub(1, Ordering::AcqRel);
            SQL.undos.with_label_values(&["postgres", "failed"]).inc();
            tracing::error!(
                "too many postgres undos pending; an abandoned statement is left to its TTL"
            );
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            me.undo_until_done(undo).await;
            me.pending_undos.fetch_sub(1, Ordering::AcqRel);
        });
    }

    async fn undo_until_done(&self, undo: Undo) {
        let started = Instant::now();
        let mut backoff = Duration::from_millis(50);
        let mut tries = 0u32;
        loop {
            tries += 1;
            let once = async {
                // An undo cut short by the timeout is itself abandoned:
                // `Lent` keeps its connection out of the pool.
                let conn =
                    Lent(Some(self.pool.get().await.map_err(|e| {
                        RunError::Pool(super::pool_error(&self.target, &e))
                    })?));
                let r = run_undo(&conn, &undo).await;
                match &r {
                    Err(e) if super::connection_suspect(e) => drop(conn),
                    _ => conn.into_pool(),
                }
                r.map_err(RunError::Db)
            };
            match tokio::time::timeout(self.timeout, once).await {
                Ok(Ok(n)) => {
                    let outcome = if n > 0 { "released" } else { "voided" };
                    SQL.undos.with_label_values(&["postgres", outcome]).inc();
                    tracing::info!(
                        outcome,
                        tries,
                        "undo of a postgres statement whose caller gave up"
                    );
                    return;
                }
                failed => {
                    let error = match failed {
                        Ok(Err(e)) => e.to_string(),
                        _ => "timed out".to_owned(),
                    };
                    if started.elapsed() >= UNDO_RETRY_FOR {
                        SQL.undos.with_label_values(&["postgres", "failed"]).inc();
                        tracing::error!(%error, tries,
                            "undo of an abandoned postgres statement failed; what it took stays until its TTL");
                        return;
                    }
                    tracing::warn!(%error, tries, "undo of an abandoned postgres statement failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(UNDO_BACKOFF_MAX);
                }
            }
        }
    }
}

/// Runs the undo statement; how many things it gave back.
async fn run_undo(conn: &Object, undo: &Undo) -> Result<i64, tokio_postgres::Error> {
    let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = undo
        .params
        .iter()
        .map(|p| p as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect();
    let rows = conn.query(undo.statement, &params).await?;
    Ok(rows
        .first()
        .map(|r| i64::from(r.get::<_, i32>(0)))
        .unwrap_or(0))
}

async fn statement_task<T, W, F>(
    runner: Runner,
    work: W,
    undo: Option<Undo>,
    mut tx: oneshot::Sender<Result<T, RunError>>,
) where
    T: Send + 'static,
    W: FnOnce(Lent) -> F + Send + 'static,
    F: Future<Output = (Lent, Result<T, tokio_postgres::Error>)> + Send + 'static,
{
    let conn = tokio::select! {
        c = runner.pool.get() => match c {
            Ok(c) => c,
            Err(e) => {
                let _ = tx.send(Err(RunError::Pool(super::pool_error(&runner.target, &e))));
                return;
            }
        },
        // The caller gave up while we waited for a slot: nothing was sent.
        _ = tx.closed() => return,
    };
    if tx.is_closed() {
        return; // the connection goes back to the pool unused
    }
    let cancel = conn.cancel_token();
    let fut = work(Lent(Some(conn)));
    tokio::pin!(fut);
    let (conn, result) = tokio::select! {
        r = &mut fut => r,
        _ = tx.closed() => {
            SQL.abandoned.with_label_values(&["postgres"]).inc();
            // Mutant: neither cancelled nor undone, as before issue 10.
            if crate::mutants::active("fresh_send_time") {
                return;
            }
            let tls = runner.tls.clone();
            tokio::spawn(async move {
                let _ = tokio::time::timeout(CANCEL_GRACE, cancel.cancel_query(tls)).await;
            });
            match undo {
                Some(u) if u.after_answer => {
                    // Mutant `undo_by_lease`: wait for the late answer and
                    // undo on the same connection, as before issue 27.
                    if let Ok((conn, Ok(_))) = tokio::time::timeout(CANCEL_GRACE, &mut fut).await {
                        let _ = tokio::time::timeout(CANCEL_GRACE, run_undo(&conn, &u)).await;
                    }
                }
                Some(u) => {
                    tracing::warn!(
                        "postgres statement abandoned by its caller: cancelled, connection discarded, undo sent"
                    );
                    runner.spawn_undo(u);
                }
                None => tracing::warn!(
                    "postgres statement abandoned by its caller: cancelled, connection discarded"
                ),
            }
            // Dropping the statement's future drops its connection, which
            // `Lent` takes out of the pool.
            return;
        }
    };
    let suspect = match &result {
        Err(e) => super::connection_suspect(e),
        Ok(_) => false,
    };
    match tx.send(result.map_err(RunError::Db)) {
        Ok(()) if !suspect => conn.into_pool(),
        Ok(()) => drop(conn), // discarded
        // The caller left between the answer and its delivery: a success
        // is undone like an abandoned statement.
        Err(Ok(_)) => {
            SQL.abandoned.with_label_values(&["postgres"]).inc();
            // Mutant: no undo either; the connection goes back.
            if crate::mutants::active("fresh_send_time") {
                conn.into_pool();
                return;
            }
            if let Some(u) = undo {
                if u.after_answer {
                    let conn = conn.into_inner();
                    let _ = tokio::time::timeout(CANCEL_GRACE, run_undo(&conn, &u)).await;
                    drop(Object::take(conn));
                    return;
                }
                runner.spawn_undo(u);
            }
            drop(conn);
        }
        Err(Err(_)) => drop(conn),
    }
}
