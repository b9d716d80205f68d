//! Statements that no cancelled caller can leave half-done — the MySQL
//! twin of [`crate::pg::runner`], for the same reason (PITFALLS 9; issue 10
//! items 1 and 4): a dropped future leaves its statement running on the
//! server and its connection in the pool mid-statement.
//!
//! Every statement runs in a task that owns its connection. When the caller
//! stops waiting (timeout or drop) before the answer, the task:
//! 1. sends `KILL QUERY <connection id>` on another connection,
//! 2. waits (bounded) until the statement has really ended,
//! 3. runs the caller's compensation on the *same* connection if the
//!    statement succeeded after all (releases a lock granted to an
//!    abandoned acquire),
//! 4. closes the connection instead of returning it to the pool.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use mysql_async::{Conn, Pool};
use tokio::sync::oneshot;

/// How long an abandoned statement may take to end after its kill request.
const CANCEL_GRACE: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// No answer within the caller's timeout; the statement may still be
    /// applied (the runner kills it and compensates if it was).
    #[error("mysql request timed out")]
    Timeout,
    #[error("no mysql connection: {0}")]
    Pool(String),
    #[error("mysql: {}", super::describe(.0))]
    Db(mysql_async::Error),
}

/// What to do on the statement's connection if it succeeded after its
/// caller stopped waiting.
pub type Compensation<T> =
    Box<dyn FnOnce(Conn, T) -> Pin<Box<dyn Future<Output = Conn> + Send>> + Send>;

/// Runs statements on a pool, each in a task that owns its connection.
#[derive(Clone)]
pub struct Runner {
    pool: Pool,
    timeout: Duration,
}

impl Runner {
    /// `timeout` bounds how long callers wait, pool checkout included.
    pub fn new(pool: Pool, timeout: Duration) -> Runner {
        Runner { pool, timeout }
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Runs `work` (given the connection, handing it back with the result)
    /// in its own task; see the module comment for what happens when the
    /// caller stops waiting.
    pub async fn run<T, W, F>(
        &self,
        work: W,
        compensate: Option<Compensation<T>>,
    ) -> Result<T, RunError>
    where
        T: Send + 'static,
        W: FnOnce(Conn) -> F + Send + 'static,
        F: Future<Output = (Conn, Result<T, mysql_async::Error>)> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        tokio::spawn(statement_task(self.pool.clone(), work, compensate, tx));
        match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) | Err(_) => Err(RunError::Timeout),
        }
    }
}

async fn kill_query(pool: &Pool, id: u32) {
    let kill = async {
        let mut c = pool.get_conn().await?;
        mysql_async::prelude::Queryable::query_drop(&mut c, format!("KILL QUERY {id}")).await
    };
    match tokio::time::timeout(CANCEL_GRACE, kill).await {
        Ok(Ok(())) => {}
        // 1094: the statement already ended.
        Ok(Err(e)) if super::server_code(&e) == Some(1094) => {}
        other => tracing::warn!(conn = id, result = ?other.map(|r| r.err()), "KILL QUERY failed"),
    }
}

async fn statement_task<T, W, F>(
    pool: Pool,
    work: W,
    compensate: Option<Compensation<T>>,
    mut tx: oneshot::Sender<Result<T, RunError>>,
) where
    T: Send + 'static,
    W: FnOnce(Conn) -> F + Send + 'static,
    F: Future<Output = (Conn, Result<T, mysql_async::Error>)> + Send + 'static,
{
    let conn = tokio::select! {
        c = pool.get_conn() => match c {
            Ok(c) => c,
            Err(e) => {
                let _ = tx.send(Err(RunError::Pool(super::describe(&e))));
                return;
            }
        },
        _ = tx.closed() => return,
    };
    if tx.is_closed() {
        return;
    }
    let id = conn.id();
    let fut = work(conn);
    tokio::pin!(fut);
    let abandoned_mid_statement;
    let (conn, result) = tokio::select! {
        r = &mut fut => { abandoned_mid_statement = false; r }
        _ = tx.closed() => {
            abandoned_mid_statement = true;
            kill_query(&pool, id).await;
            match tokio::time::timeout(CANCEL_GRACE, &mut fut).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::warn!(conn = id, "abandoned mysql statement did not end after KILL QUERY; connection dropped");
                    return;
                }
            }
        }
    };
    let suspect = matches!(&result, Err(e) if super::connection_suspect(e));
    let leftover = if abandoned_mid_statement {
        Some(result)
    } else {
        match tx.send(result.map_err(RunError::Db)) {
            Ok(()) => None,
            Err(Ok(v)) => Some(Ok(v)),
            Err(Err(_)) => None,
        }
    };
    match leftover {
        None if !suspect => drop(conn), // back to the pool
        None => {
            let _ = tokio::time::timeout(CANCEL_GRACE, conn.disconnect()).await;
        }
        Some(outcome) => {
            let conn = match (outcome, compensate) {
                (Ok(value), Some(comp)) => {
                    tracing::info!("compensating a mysql statement whose caller gave up");
                    match tokio::time::timeout(CANCEL_GRACE, comp(conn, value)).await {
                        Ok(conn) => conn,
                        Err(_) => return,
                    }
                }
                _ => conn,
            };
            // Never pool a connection that was abandoned mid-statement.
            let _ = tokio::time::timeout(CANCEL_GRACE, conn.disconnect()).await;
        }
    }
}
