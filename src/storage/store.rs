//! Storage engines of the demo storage: in memory or a PostgreSQL table.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::Pool;
use serde_json::Value;

pub type StoreError = Box<dyn std::error::Error + Send + Sync>;

/// Writes logged per path, at most (oldest dropped first).
const LOG_CAP: usize = 100_000;

#[async_trait]
pub trait KvStore: Send + Sync + 'static {
    async fn get(&self, path: &str) -> Result<Option<(Value, i64)>, StoreError>;
    /// Stores `value`, returns the new version; logs the write's token.
    async fn put(&self, path: &str, value: Value, token: Option<i64>) -> Result<i64, StoreError>;
    async fn delete(&self, path: &str) -> Result<bool, StoreError>;
    /// `(version, token)` of the writes to `path`, oldest first.
    async fn log(&self, path: &str) -> Result<Vec<(i64, Option<i64>)>, StoreError>;
}

#[derive(Default)]
struct MemoryInner {
    values: HashMap<String, (Value, i64)>,
    log: HashMap<String, Vec<(i64, Option<i64>)>>,
}

#[derive(Default)]
pub struct MemoryKv {
    inner: Mutex<MemoryInner>,
}

#[async_trait]
impl KvStore for MemoryKv {
    async fn get(&self, path: &str) -> Result<Option<(Value, i64)>, StoreError> {
        Ok(self
            .inner
            .lock()
            .expect("kv poisoned")
            .values
            .get(path)
            .cloned())
    }

    async fn put(&self, path: &str, value: Value, token: Option<i64>) -> Result<i64, StoreError> {
        let mut inner = self.inner.lock().expect("kv poisoned");
        let version = inner.values.get(path).map_or(1, |(_, v)| v + 1);
        inner.values.insert(path.to_owned(), (value, version));
        let log = inner.log.entry(path.to_owned()).or_default();
        if log.len() >= LOG_CAP {
            log.remove(0);
        }
        log.push((version, token));
        Ok(version)
    }

    async fn delete(&self, path: &str) -> Result<bool, StoreError> {
        Ok(self
            .inner
            .lock()
            .expect("kv poisoned")
            .values
            .remove(path)
            .is_some())
    }

    async fn log(&self, path: &str) -> Result<Vec<(i64, Option<i64>)>, StoreError> {
        Ok(self
            .inner
            .lock()
            .expect("kv poisoned")
            .log
            .get(path)
            .cloned()
            .unwrap_or_default())
    }
}

pub struct PgKv {
    pool: Pool,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS fencer_demo_kv (
  path    text PRIMARY KEY,
  value   jsonb NOT NULL,
  version bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS fencer_demo_kv_log (
  id      bigserial PRIMARY KEY,
  path    text NOT NULL,
  version bigint NOT NULL,
  token   bigint
);
CREATE INDEX IF NOT EXISTS fencer_demo_kv_log_path ON fencer_demo_kv_log (path, id);";

impl PgKv {
    pub async fn connect(url: &str, ca_file: Option<&str>) -> Result<PgKv, StoreError> {
        let (_, _, pool) = crate::pg::pool(&crate::pg::PgOptions {
            url,
            application_name: "fencer-demo-storage",
            ca_file,
            pool_size: 16,
            connect_timeout: Duration::from_secs(5),
            wait_timeout: Duration::from_secs(5),
            statement_timeout: None,
            lock_timeout: None,
        })?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let attempt = async {
                let conn = pool.get().await?;
                conn.batch_execute(SCHEMA).await?;
                Ok::<(), StoreError>(())
            };
            match attempt.await {
                Ok(()) => return Ok(PgKv { pool }),
                Err(e) if tokio::time::Instant::now() < deadline => {
                    tracing::warn!(error = %e, "demo storage database not ready; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

#[async_trait]
impl KvStore for PgKv {
    async fn get(&self, path: &str) -> Result<Option<(Value, i64)>, StoreError> {
        let conn = self.pool.get().await?;
        let row = conn
            .query_opt(
                "SELECT value, version FROM fencer_demo_kv WHERE path = $1",
                &[&path],
            )
            .await?;
        Ok(row.map(|r| (r.get(0), r.get(1))))
    }

    async fn put(&self, path: &str, value: Value, token: Option<i64>) -> Result<i64, StoreError> {
        let mut conn = self.pool.get().await?;
        let tx = conn.transaction().await?;
        let version: i64 = tx
            .query_one(
                "INSERT INTO fencer_demo_kv (path, value, version) VALUES ($1, $2, 1)
                 ON CONFLICT (path) DO UPDATE SET value = EXCLUDED.value, version = fencer_demo_kv.version + 1
                 RETURNING version",
                &[&path, &value],
            )
            .await?
            .get(0);
        tx.execute(
            "INSERT INTO fencer_demo_kv_log (path, version, token) VALUES ($1, $2, $3)",
            &[&path, &version, &token],
        )
        .await?;
        tx.commit().await?;
        Ok(version)
    }

    async fn delete(&self, path: &str) -> Result<bool, StoreError> {
        let conn = self.pool.get().await?;
        Ok(conn
            .execute("DELETE FROM fencer_demo_kv WHERE path = $1", &[&path])
            .await?
            > 0)
    }

    async fn log(&self, path: &str) -> Result<Vec<(i64, Option<i64>)>, StoreError> {
        let conn = self.pool.get().await?;
        let rows = conn
            .query(
                "SELECT version, token FROM (SELECT id, version, token FROM fencer_demo_kv_log
                  WHERE path = $1 ORDER BY id DESC LIMIT 100000) newest ORDER BY id",
                &[&path],
            )
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }
}
