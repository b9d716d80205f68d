//! Durable fence store on PostgreSQL, shared by every gateway replica.
//!
//! Per key, `fencer_fences` holds the highest accepted token, its lease and
//! that lease's last write sequence.
//! Serialization across replicas uses a session-level advisory lock on a
//! hash of the key, held on a pooled connection for the whole forward:
//!
//! 1. `pg_advisory_lock(h)` — waits (bounded by `lock_timeout`) for the
//!    request in flight on this key, in any replica;
//! 2. one autocommit statement checks and advances the mark, so the new
//!    mark is **durable before the request is forwarded** (a crash mid-way
//!    cannot forget that a higher token may have written);
//! 3. forward; 4. `pg_advisory_unlock(h)` when the upstream is done.
//!
//! If the gateway dies while holding the lock, PostgreSQL ends the session
//! and releases it. A hash collision between two keys only serializes them
//! together; it never weakens a check. (Advisory locks need a session:
//! do not put a transaction-pooling PgBouncer between gateway and database.)

use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Object, Pool};
use sha2::{Digest, Sha256};
use tokio_postgres::error::SqlState;

use super::{decide, Decision, FenceError, FenceStore, KeyGuard, Mark};

/// Created on start-up (and the `seq` column added to tables of earlier
/// versions). The same table serves `deploy/sql/fencer_fence.sql`.
pub const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS fencer_fences (
  key        text PRIMARY KEY,
  token      bigint NOT NULL,
  lease_id   text NOT NULL DEFAULT '',
  seq        bigint NOT NULL DEFAULT 0,
  updated_at timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE fencer_fences ADD COLUMN IF NOT EXISTS seq bigint NOT NULL DEFAULT 0;";

/// Check-and-advance in one statement: the mark as it was (`old`, from the
/// statement's snapshot) and whether the upsert moved it — to a higher
/// token, or to a higher sequence of the same token and lease. `$4` is the
/// sequence, -1 when the request has none (never moves a sequence).
const ADVANCE: &str = "
WITH old AS (SELECT token, lease_id, seq FROM fencer_fences WHERE key = $1),
up AS (
  INSERT INTO fencer_fences AS f (key, token, lease_id, seq, updated_at)
  VALUES ($1, $2, $3, GREATEST($4::bigint, 0), now())
  ON CONFLICT (key) DO UPDATE
    SET token = EXCLUDED.token, lease_id = EXCLUDED.lease_id, seq = EXCLUDED.seq,
        updated_at = now()
    WHERE f.token < EXCLUDED.token
       OR (f.token = EXCLUDED.token AND f.lease_id = EXCLUDED.lease_id AND f.seq < $4::bigint)
  RETURNING 1
)
SELECT (SELECT token FROM old), (SELECT lease_id FROM old), (SELECT seq FROM old),
       (SELECT count(*) FROM up)";

pub struct PgFences {
    pool: Pool,
}

fn unavailable(e: impl std::fmt::Display) -> FenceError {
    FenceError::Unavailable(e.to_string())
}

/// The advisory lock id of a key.
fn lock_id(key: &str) -> i64 {
    let digest = Sha256::digest(key.as_bytes());
    i64::from_be_bytes(digest[..8].try_into().expect("8 bytes"))
}

impl PgFences {
    /// Connects and creates the schema, retrying for up to `startup` while
    /// PostgreSQL is not reachable yet.
    pub async fn connect(
        url: &str,
        ca_file: Option<&str>,
        pool_size: usize,
        serialize_timeout: Duration,
        startup: Duration,
    ) -> Result<PgFences, FenceError> {
        let (_, _, pool) = crate::pg::pool(&crate::pg::PgOptions {
            url,
            application_name: "fencer-gateway",
            ca_file,
            pool_size,
            connect_timeout: Duration::from_secs(5),
            wait_timeout: serialize_timeout,
            // Bounds the wait for the advisory lock (and any row lock).
            server_options: Some(format!("-c lock_timeout={}", serialize_timeout.as_millis())),
        })
        .map_err(FenceError::Unavailable)?;
        let store = PgFences { pool };
        let deadline = tokio::time::Instant::now() + startup;
        loop {
            match store.migrate().await {
                Ok(()) => return Ok(store),
                Err(e) if tokio::time::Instant::now() < deadline => {
                    tracing::warn!(error = %e, "fence store not ready; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn migrate(&self) -> Result<(), FenceError> {
        let conn = self.pool.get().await.map_err(unavailable)?;
        conn.batch_execute(SCHEMA).await.map_err(unavailable)
    }

    async fn conn(&self) -> Result<Object, FenceError> {
        self.pool.get().await.map_err(|e| match e {
            deadpool_postgres::PoolError::Timeout(_) => FenceError::Busy,
            other => unavailable(other),
        })
    }
}

/// Holds the key's advisory lock; dropping it unlocks (in the background).
struct PgGuard {
    conn: Option<Object>,
    lock_id: i64,
}

impl Drop for PgGuard {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else { return };
        let lock_id = self.lock_id;
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            let unlocked = conn
                .query_one("SELECT pg_advisory_unlock($1)", &[&lock_id])
                .await
                .map(|row| row.get::<_, bool>(0));
            if !matches!(unlocked, Ok(true)) {
                // Never return a connection that may still hold the lock to
                // the pool (advisory locks are re-entrant per session):
                // closing the session releases it.
                tracing::warn!(?unlocked, "advisory unlock failed; discarding connection");
                drop(Object::take(conn));
            }
        });
    }
}

#[async_trait]
impl FenceStore for PgFences {
    fn name(&self) -> &'static str {
        "postgres"
    }

    async fn enter(
        &self,
        key: &str,
        token: u64,
        lease: &str,
        seq: Option<u64>,
        wait: Duration,
    ) -> Result<(Decision, KeyGuard), FenceError> {
        let token_i = i64::try_from(token).map_err(|_| unavailable("token above i64 range"))?;
        let seq_i = match seq {
            Some(s) => i64::try_from(s).map_err(|_| unavailable("sequence above i64 range"))?,
            None => -1,
        };
        let conn = tokio::time::timeout(wait, self.conn())
            .await
            .map_err(|_| FenceError::Busy)??;
        let id = lock_id(key);
        let lock_stmt = conn
            .prepare_cached("SELECT pg_advisory_lock($1)")
            .await
            .map_err(unavailable)?;
        if let Err(e) = conn.execute(&lock_stmt, &[&id]).await {
            let busy = e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE)
                || e.code() == Some(&SqlState::QUERY_CANCELED);
            if !busy {
                drop(Object::take(conn));
                return Err(unavailable(e));
            }
            return Err(FenceError::Busy);
        }
        let guard = PgGuard {
            conn: Some(conn),
            lock_id: id,
        };
        let conn = guard.conn.as_ref().expect("just set");
        let advance = conn.prepare_cached(ADVANCE).await.map_err(unavailable)?;
        let row = conn
            .query_one(&advance, &[&key, &token_i, &lease, &seq_i])
            .await
            .map_err(unavailable)?;
        let (old_token, old_lease, old_seq, moved): (
            Option<i64>,
            Option<String>,
            Option<i64>,
            i64,
        ) = (row.get(0), row.get(1), row.get(2), row.get(3));
        let stored = old_token.map(|t| Mark {
            token: t as u64,
            lease: old_lease.as_deref().unwrap_or(""),
            seq: old_seq.unwrap_or(0) as u64,
        });
        let mut decision = decide(stored, token, lease, seq);
        if decision.writes_mark(seq) && moved == 0 {
            // The row changed between the snapshot and the upsert (only
            // possible when something else than a gateway — e.g.
            // fencer_fence() — writes the same key): refuse, never guess.
            decision = Decision::Stale {
                highest: old_token.unwrap_or(0) as u64,
            };
        }
        Ok((decision, KeyGuard::new(guard)))
    }

    async fn highest(&self, key: &str) -> Result<Option<(u64, String)>, FenceError> {
        let conn = self.conn().await?;
        let row = conn
            .query_opt(
                "SELECT token, lease_id FROM fencer_fences WHERE key = $1",
                &[&key],
            )
            .await
            .map_err(unavailable)?;
        Ok(row.map(|r| (r.get::<_, i64>(0) as u64, r.get::<_, String>(1))))
    }

    async fn ping(&self) -> Result<(), FenceError> {
        let conn = self.conn().await?;
        conn.simple_query("SELECT 1").await.map_err(unavailable)?;
        Ok(())
    }
}
