//! Statements that no cancelled caller can leave half-done.
//!
//! In tokio a caller that times out or whose HTTP client went away drops its
//! future at the current `.await`. A statement whose future is dropped keeps
//! running on the server, and its pooled connection goes back to the pool
//! with that statement still in progress: a lock it waits for is granted
//! later to a session nobody watches, a row it would update changes after
//! the caller reported failure (PITFALLS 9; issue 10 items 1 and 4).
//!
//! So every statement runs in a task of its own that owns the connection.
//! The caller only waits for the task's answer, bounded by its timeout.
//! When the caller stops waiting before the answer — timeout or drop — the
//! task (not the caller) decides what happens:
//!
//! 1. it sends PostgreSQL a cancel request for the running statement,
//! 2. waits (bounded) until the statement has really ended,
//! 3. runs the caller's compensation on the *same* connection if the
//!    statement succeeded after all (e.g. releases a lock that was granted
//!    to an abandoned acquire) — on the same connection so it cannot be
//!    ordered before the statement it undoes,
//! 4. discards the connection instead of returning it to the pool.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use tokio::sync::oneshot;

use super::Tls;

/// How long an abandoned statement may take to end after its cancel
/// request before its connection is closed regardless.
const CANCEL_GRACE: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// No answer within the caller's timeout. The statement may still be
    /// applied; the runner cancels it and compensates if it was.
    #[error("postgres request timed out")]
    Timeout,
    #[error("no postgres connection: {0}")]
    Pool(String),
    #[error("postgres: {}", super::describe(.0))]
    Db(#[from] tokio_postgres::Error),
}

/// What to do on the statement's connection if it succeeded after its
/// caller stopped waiting.
pub type Compensation<T> =
    Box<dyn FnOnce(Object, T) -> Pin<Box<dyn Future<Output = Object> + Send>> + Send>;

/// Runs statements on a pool, each in a task that owns its connection.
#[derive(Clone)]
pub struct Runner {
    pool: Pool,
    tls: Tls,
    timeout: Duration,
}

impl Runner {
    /// `timeout` bounds how long callers wait, pool checkout included.
    pub fn new(pool: Pool, tls: Tls, timeout: Duration) -> Runner {
        Runner { pool, tls, timeout }
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Runs `work` (given the connection, handing it back with the result)
    /// in its own task. If the caller stops waiting before the result is
    /// known, `compensate` runs on the same connection when `work` turns
    /// out to have succeeded.
    pub async fn run<T, W, F>(
        &self,
        work: W,
        compensate: Option<Compensation<T>>,
    ) -> Result<T, RunError>
    where
        T: Send + 'static,
        W: FnOnce(Object) -> F + Send + 'static,
        F: Future<Output = (Object, Result<T, tokio_postgres::Error>)> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let pool = self.pool.clone();
        let tls = self.tls.clone();
        tokio::spawn(statement_task(pool, tls, work, compensate, tx));
        match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(result)) => result,
            // The task ended without an answer (it panicked, or its
            // connection was closed while abandoned): unknown outcome.
            Ok(Err(_)) => Err(RunError::Timeout),
            // Dropping `rx` tells the task its caller is gone.
            Err(_) => Err(RunError::Timeout),
        }
    }
}

async fn statement_task<T, W, F>(
    pool: Pool,
    tls: Tls,
    work: W,
    compensate: Option<Compensation<T>>,
    mut tx: oneshot::Sender<Result<T, RunError>>,
) where
    T: Send + 'static,
    W: FnOnce(Object) -> F + Send + 'static,
    F: Future<Output = (Object, Result<T, tokio_postgres::Error>)> + Send + 'static,
{
    let conn = tokio::select! {
        c = pool.get() => match c {
            Ok(c) => c,
            Err(e) => {
                let _ = tx.send(Err(RunError::Pool(e.to_string())));
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
    let fut = work(conn);
    tokio::pin!(fut);
    let abandoned_mid_statement;
    let (conn, result) = tokio::select! {
        r = &mut fut => { abandoned_mid_statement = false; r }
        _ = tx.closed(), if !crate::mutants::active("fresh_send_time") => {
            abandoned_mid_statement = true;
            let _ = tokio::time::timeout(CANCEL_GRACE, cancel.cancel_query(tls)).await;
            match tokio::time::timeout(CANCEL_GRACE, &mut fut).await {
                Ok(r) => r,
                Err(_) => {
                    // Still not ended: dropping the future closes the
                    // connection; the server ends the statement at its
                    // statement_timeout at the latest.
                    tracing::warn!("abandoned postgres statement did not end after cancel; connection closed");
                    return;
                }
            }
        }
    };
    let suspect = match &result {
        Err(e) => super::connection_suspect(e),
        Ok(_) => false,
    };
    let result = if abandoned_mid_statement {
        Err(result)
    } else {
        match tx.send(result.map_err(RunError::Db)) {
            Ok(()) => Ok(()),
            // The caller left between the answer and its delivery.
            Err(Ok(v)) => Err(Ok(v)),
            Err(Err(_)) => Ok(()),
        }
    };
    let result = match result {
        // Mutant: no compensation either; the connection goes back.
        Err(_) if crate::mutants::active("fresh_send_time") => Ok(()),
        other => other,
    };
    match result {
        Ok(()) if !suspect => drop(conn), // back to the pool
        Ok(()) => drop(Object::take(conn)),
        Err(outcome) => {
            let conn = match (outcome, compensate) {
                (Ok(value), Some(comp)) => {
                    tracing::info!("compensating a postgres statement whose caller gave up");
                    match tokio::time::timeout(CANCEL_GRACE, comp(conn, value)).await {
                        Ok(conn) => conn,
                        Err(_) => return,
                    }
                }
                _ => conn,
            };
            // Never pool a connection that was abandoned mid-statement.
            drop(Object::take(conn));
        }
    }
}
