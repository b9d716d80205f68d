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

async fn missing(
    conn: &impl GenericClient,
    pieces: &[Piece],
) -> Result<Vec<usize>, tokio_postgres::Error> {
    let mut out = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        let row = conn.query_one(p.exists.as_str(), &[]).await?;
        if !row.get::<_, bool>(0) {
            out.push(i);
        }
    }
    Ok(out)
}

/// Creates the pieces that do not exist yet, in order. Returns how many
/// were created (0 on an up-to-date database, with no table lock taken).
pub async fn ensure(
    conn: &mut deadpool_postgres::Object,
    pieces: &[Piece],
    advisory_lock: i64,
) -> Result<usize, tokio_postgres::Error> {
    if missing(&*conn, pieces).await?.is_empty() {
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
    // Again under the lock: another process may have done it meanwhile.
    let todo = missing(&tx, pieces).await?;
    for &i in &todo {
        tracing::info!(piece = pieces[i].name, "creating schema piece");
        tx.batch_execute(&pieces[i].create).await?;
    }
    tx.commit().await?;
    Ok(todo.len())
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
