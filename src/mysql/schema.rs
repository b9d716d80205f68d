//! Creating what is missing of a MySQL schema, without DDL on an
//! up-to-date database — the MySQL twin of [`crate::pg::schema`].
//!
//! DDL takes metadata locks that queue behind any long reader of the
//! table, and every later statement queues behind the DDL; so start-up
//! reads the catalog first and runs DDL only for what is missing,
//! serialized between starting processes by a named lock (`GET_LOCK`) and
//! re-checked under it.

use mysql_async::prelude::Queryable;
use mysql_async::Conn;

/// One piece of a schema: a name for logs, a query returning 1 when the
/// piece exists, and the DDL that creates it.
pub type Piece = (&'static str, String, &'static str);

/// `SELECT COUNT(*)` of table `name` in the current database.
pub fn table_exists(name: &str) -> String {
    format!(
        "SELECT COUNT(*) FROM information_schema.tables \
         WHERE table_schema = DATABASE() AND table_name = '{name}'"
    )
}

/// `SELECT COUNT(*)` of column `column` of table `table` in the current
/// database.
pub fn column_exists(table: &str, column: &str) -> String {
    format!(
        "SELECT COUNT(*) FROM information_schema.columns \
         WHERE table_schema = DATABASE() AND table_name = '{table}' AND column_name = '{column}'"
    )
}

/// `SELECT COUNT(*)` of routine `name` in the current database.
pub fn routine_exists(name: &str) -> String {
    format!(
        "SELECT COUNT(*) FROM information_schema.routines \
         WHERE routine_schema = DATABASE() AND routine_name = '{name}'"
    )
}

async fn exists(conn: &mut Conn, piece: &Piece) -> Result<bool, mysql_async::Error> {
    Ok(conn.query_first::<i64, _>(piece.1.as_str()).await? == Some(1))
}

/// Creates the pieces that do not exist yet, in order, under the named
/// lock `lock`; returns how many were created (0, with no DDL and no lock
/// taken, on an up-to-date database). The named lock is released before
/// returning.
pub async fn ensure(
    conn: &mut Conn,
    pieces: &[Piece],
    lock: &str,
) -> Result<usize, mysql_async::Error> {
    let mut complete = true;
    for p in pieces {
        if !exists(conn, p).await? {
            complete = false;
            break;
        }
    }
    if complete {
        return Ok(0);
    }
    let locked: Option<i64> = conn.exec_first("SELECT GET_LOCK(?, 10)", (lock,)).await?;
    if locked != Some(1) {
        return Err(mysql_async::Error::Other("schema lock not granted".into()));
    }
    let result = async {
        let mut created = 0;
        for p in pieces {
            if !exists(conn, p).await? {
                tracing::info!(piece = p.0, "creating schema piece");
                conn.query_drop(p.2).await?;
                created += 1;
            }
        }
        Ok(created)
    }
    .await;
    let _ = conn.exec_drop("DO RELEASE_LOCK(?)", (lock,)).await;
    result
}
