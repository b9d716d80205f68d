//! Creating what is missing of a schema, without freezing the database.
//!
//! `CREATE … IF NOT EXISTS` and `ALTER TABLE … ADD COLUMN IF NOT EXISTS`
//! take their locks even when there is nothing to do: `ADD COLUMN` wants
//! ACCESS EXCLUSIVE, so behind one long reader (a `pg_dump`, a report) it
//! waits — and every later statement on the table queues behind it. One pod
//! restart then stalled every acquire, renew and probe of every sidecar
//! (issue 10 item 5). So start-up first *reads the catalog* (no table lock)
//! and runs DDL only for what is missing; that DDL runs in one transaction
//! under a short `lock_timeout`, serialized between starting processes by an
//! advisory lock, re-checking the catalog under it.

use std::time::Duration;

use deadpool_postgres::GenericClient;

/// One piece of a schema: how to tell it exists, and how to create it.
pub struct Piece {
    /// For logs.
    pub name: &'static str,
    /// A query returning one boolean: does the piece exist?
    pub exists: String,
    /// The statements that create it (run only when it does not exist).
    pub create: String,
}

/// How long a start-up DDL statement may wait for a table lock.
pub const DDL_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

async fn exists(conn: &impl GenericClient, piece: &Piece) -> Result<bool, tokio_postgres::Error> {
    Ok(conn.query_one(piece.exists.as_str(), &[]).await?.get(0))
}

/// Creates the pieces that do not exist yet, in order. Returns how many
/// were created (0 on an up-to-date database, with no table lock taken).
/// Each piece is checked after the ones before it exist, so a check may
/// read a table an earlier piece creates.
pub async fn ensure(
    conn: &mut deadpool_postgres::Object,
    pieces: &[Piece],
    advisory_lock: i64,
) -> Result<usize, tokio_postgres::Error> {
    let mut complete = true;
    for p in pieces {
        if !exists(&*conn, p).await? {
            complete = false;
            break;
        }
    }
    if complete {
        return Ok(0);
    }
    let tx = conn.transaction().await?;
    tx.batch_execute(&format!(
        "SET LOCAL lock_timeout = '{}ms'",
        DDL_LOCK_TIMEOUT.as_millis()
    ))
    .await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&advisory_lock])
        .await?;
    // Checked again under the lock: another process may have done it.
    let mut created = 0;
    for p in pieces {
        if !exists(&tx, p).await? {
            tracing::info!(piece = p.name, "creating schema piece");
            tx.batch_execute(&p.create).await?;
            created += 1;
        }
    }
    tx.commit().await?;
    Ok(created)
}

/// Whether relation (table, index) `name` exists in the search path.
pub fn relation_exists(name: &str) -> String {
    format!("SELECT to_regclass('{name}') IS NOT NULL")
}

/// Whether `table` (in the current schema) has `column`.
pub fn column_exists(table: &str, column: &str) -> String {
    format!(
        "SELECT EXISTS (SELECT 1 FROM information_schema.columns
          WHERE table_schema = current_schema() AND table_name = '{table}' AND column_name = '{column}')"
    )
}

/// Whether function `name` exists in the current schema.
pub fn function_exists(name: &str) -> String {
    format!(
        "SELECT EXISTS (SELECT 1 FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
          WHERE n.nspname = current_schema() AND p.proname = '{name}')"
    )
}
