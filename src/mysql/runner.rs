//! Statements that no cancelled caller can leave half-done — the MySQL
//! twin of [`crate::pg::runner`], for the same reason (PITFALLS 9; issue 10
//! items 1 and 4): a dropped future leaves its statement running on the
//! server and its connection in the pool mid-statement.
//!
//! Every statement runs in a task that owns its connection, and the caller
//! waits for its answer until a deadline: one budget for pool checkout,
//! connecting and the statement ([`Runner::run_until`]). When the caller
//! stops waiting (deadline or drop) before the answer, the task:
//! 1. sends `KILL QUERY <connection id>` from a *side* pool of its own, in
//!    a task of its own: the statement pool may be full of the very
//!    statements that are stuck, and a kill that waited for one of their
//!    connections took up to 10 s more (issue 27 item 4);
//! 2. waits (bounded) until the statement has really ended,
//! 3. runs the caller's compensation on the *same* connection if the
//!    statement succeeded after all (releases a lock granted to an
//!    abandoned acquire),
//! 4. discards the connection ([`Lent`]), whether it ended or not: a
//!    connection abandoned mid-statement never goes back to the pool.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use mysql_async::{Conn, Pool};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::metrics::sql::SQL;

/// How long an abandoned statement may take to end after its kill request.
const CANCEL_GRACE: Duration = Duration::from_secs(5);
/// Bound on closing a discarded connection.
const DISCONNECT_TIMEOUT: Duration = Duration::from_secs(2);

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
    Box<dyn FnOnce(Lent, T) -> Pin<Box<dyn Future<Output = Lent> + Send>> + Send>;

/// A pooled connection lent to one statement: unless handed back with
/// [`Lent::into_pool`], dropping it disconnects it (in a task of its own),
/// so it leaves the pool for good — a connection dropped mid-statement
/// would otherwise go back with the statement's answer still to come.
pub struct Lent(Option<Conn>);

impl Lent {
    pub fn into_pool(mut self) {
        drop(self.0.take());
    }
}

impl std::ops::Deref for Lent {
    type Target = Conn;
    fn deref(&self) -> &Conn {
        self.0.as_ref().expect("lent connection present")
    }
}

impl std::ops::DerefMut for Lent {
    fn deref_mut(&mut self) -> &mut Conn {
        self.0.as_mut().expect("lent connection present")
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        let Some(conn) = self.0.take() else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // `disconnect` marks the connection closed before it writes: even
        // cut short by the timeout, the pool then drops it.
        rt.spawn(async move {
            let _ = tokio::time::timeout(DISCONNECT_TIMEOUT, conn.disconnect()).await;
        });
    }
}

/// Runs statements on a pool, each in a task that owns its connection.
#[derive(Clone)]
pub struct Runner {
    pool: Pool,
    /// Connections for `KILL QUERY` only (see the module comment).
    side: Pool,
    timeout: Duration,
    /// The server's URL, password redacted: a connection error names it.
    target: Arc<str>,
}

impl Runner {
    /// `timeout` bounds how long callers of [`Runner::run`] wait, pool
    /// checkout included; `side` is a small pool for kills; `url` is the
    /// server, named (redacted) by connection errors.
    pub fn new(pool: Pool, side: Pool, timeout: Duration, url: &str) -> Runner {
        Runner {
            pool,
            side,
            timeout,
            target: crate::settings::check::redact_url(url).into(),
        }
    }

    /// The server as errors name it (URL, password redacted).
    pub fn target(&self) -> &str {
        &self.target
    }

    /// The deadline of a call started now: [`Runner::run`]'s, for callers
    /// that try more than once within one budget.
    pub fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// [`Runner::run_until`] with the runner's own timeout from now.
    pub async fn run<T, W, F>(
        &self,
        work: W,
        compensate: Option<Compensation<T>>,
    ) -> Result<T, RunError>
    where
        T: Send + 'static,
        W: FnOnce(Lent) -> F + Send + 'static,
        F: Future<Output = (Lent, Result<T, mysql_async::Error>)> + Send + 'static,
    {
        self.run_until(Instant::now() + self.timeout, work, compensate)
            .await
    }

    /// Runs `work` (given the connection, handing it back with the result)
    /// in its own task, waiting for the answer until `deadline`; see the
    /// module comment for what happens when the caller stops waiting.
    pub async fn run_until<T, W, F>(
        &self,
        deadline: Instant,
        work: W,
        compensate: Option<Compensation<T>>,
    ) -> Result<T, RunError>
    where
        T: Send + 'static,
        W: FnOnce(Lent) -> F + Send + 'static,
        F: Future<Output = (Lent, Result<T, mysql_async::Error>)> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        tokio::spawn(statement_task(
            self.pool.clone(),
            self.side.clone(),
            self.target.clone(),
            work,
            compensate,
            tx,
        ));
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) | Err(_) => Err(RunError::Timeout),
        }
    }
}

/// `KILL QUERY id` from the side pool, bounded; runs in a task of its own.
async fn kill_query(side: Pool, id: u32) {
    let kill = async {
        let mut c = side.get_conn().await?;
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
    side: Pool,
    target: Arc<str>,
    work: W,
    compensate: Option<Compensation<T>>,
    mut tx: oneshot::Sender<Result<T, RunError>>,
) where
    T: Send + 'static,
    W: FnOnce(Lent) -> F + Send + 'static,
    F: Future<Output = (Lent, Result<T, mysql_async::Error>)> + Send + 'static,
{
    let conn = tokio::select! {
        c = pool.get_conn() => match c {
            Ok(c) => c,
            Err(e) => {
                let _ = tx.send(Err(RunError::Pool(format!("{target}: {}", super::describe(&e)))));
                return;
            }
        },
        _ = tx.closed() => return,
    };
    if tx.is_closed() {
        return;
    }
    let id = conn.id();
    let fut = work(Lent(Some(conn)));
    tokio::pin!(fut);
    let abandoned_mid_statement;
    let (conn, result) = tokio::select! {
        r = &mut fut => { abandoned_mid_statement = false; r }
        _ = tx.closed() => {
            abandoned_mid_statement = true;
            SQL.abandoned.with_label_values(&["mysql"]).inc();
            tokio::spawn(kill_query(side, id));
            match tokio::time::timeout(CANCEL_GRACE, &mut fut).await {
                Ok(r) => r,
                Err(_) => {
                    if compensate.is_some() {
                        SQL.undos.with_label_values(&["mysql", "failed"]).inc();
                    }
                    tracing::warn!(conn = id, "abandoned mysql statement did not end after KILL QUERY; connection discarded");
                    return; // dropping `fut` discards the connection
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
            Err(Ok(v)) => {
                SQL.abandoned.with_label_values(&["mysql"]).inc();
                Some(Ok(v))
            }
            Err(Err(_)) => None,
        }
    };
    match leftover {
        None if !suspect => conn.into_pool(),
        None => drop(conn), // discarded
        Some(outcome) => {
            if let (Ok(value), Some(comp)) = (outcome, compensate) {
                tracing::info!(
                    conn = id,
                    "compensating a mysql statement whose caller gave up"
                );
                if tokio::time::timeout(CANCEL_GRACE, comp(conn, value))
                    .await
                    .is_err()
                {
                    SQL.undos.with_label_values(&["mysql", "failed"]).inc();
                }
            }
            // Never pool a connection that was abandoned mid-statement:
            // `Lent` discards it when dropped.
        }
    }
}
