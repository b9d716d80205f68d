//! Durable fence store on MySQL or MariaDB, shared by every gateway
//! replica: the twin of [`super::postgres`], with the same semantics.
//!
//! Per key, `fencer_fences` holds the mark and the in-flight stamp (see
//! [`super`] and [`super::mysql_sql`]). A request is admitted by one stored
//! procedure call — one round trip — that locks the key's row for the call
//! only: check the stamp, check and advance the mark, stamp the key in
//! flight, `COMMIT` — before the request is forwarded, so a crash cannot
//! forget that a higher token may have written, nor that a write may still
//! be on its way. The stamp lives in the table, not in a session: a gateway
//! that crashes mid-forward, or whose connection drops, leaves it until it
//! runs out. [`FenceStore::finish`] clears it, and only it (the key *and*
//! the stamp id must match).
//!
//! Every statement runs through [`crate::mysql::Runner`]: a caller that
//! gives up (timeout, dropped future) never leaves a statement running on a
//! pooled connection. The runner kills it; if the admission committed after
//! all, its stamp is cleared on the same connection (the request it
//! belonged to is answered 503 and never forwarded); the connection is then
//! closed, which rolls back anything the procedure had not committed.
//!
//! **Waiting for another replica.** MySQL has no LISTEN/NOTIFY. A replica
//! that finds the key stamped by another asks again after a short sleep:
//! 2 ms, doubling to at most [`POLL_CAP`] (50 ms, with jitter), and never
//! past the stamp's end (its gateway died) nor the request's deadline. No
//! connection is held while it sleeps. The choice, against named-lock
//! (`GET_LOCK`) wake-ups: a named lock lives in a session, so the stamp's
//! owner would have to hold a connection for the whole forward (issue 9
//! item 9: one hot key would take the pool) or hand its lock to a separate
//! bell connection, whose loss must then be detected and fall back to a
//! timer anyway. A bounded poll has one failure mode — it is late by at
//! most one step — and costs at most one short `CALL` every 50 ms per
//! waiting replica and key (inside one replica only the key's turn-holder
//! waits: [`crate::gateway::key_queue`]). Waits are counted in
//! `fencer_gateway_remote_waits_total{result}` as on PostgreSQL, and the
//! re-asks in `fencer_gateway_mysql_polls_total`.
//!
//! **Durability.** An acknowledged admission is a committed InnoDB
//! transaction; it survives a server crash only with the server's
//! `innodb_flush_log_at_trx_commit = 1` (the default; `0` or `2` can lose
//! the last second of marks, and a lost mark lets an older token write
//! again). With replication, a failover to a replica that had not received
//! the mark loses it the same way: use semi-synchronous replication or
//! Galera's synchronous commit for a replicated fence store.

use std::time::Duration;

use async_trait::async_trait;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts, Row};
use rand::Rng;
use tokio::time::Instant;

use super::mysql_sql as sql;
use super::{Admitted, FenceError, FenceStore, Mode, Presented, Stamp};
use crate::mysql::runner::{Compensation, Lent};
use crate::mysql::{MyOptions, RunError, Runner};

/// Bound on one readiness probe (below the kubelet's default 1 s).
const PROBE_TIMEOUT: Duration = Duration::from_millis(800);

/// The first re-ask of a key stamped by another replica.
const POLL_FIRST: Duration = Duration::from_millis(2);

/// The longest sleep between two re-asks: what a remote hand-over can cost
/// at most over PostgreSQL's NOTIFY. Far below any stamp hold (seconds).
pub const POLL_CAP: Duration = Duration::from_millis(50);

pub struct MyFences {
    runner: Runner,
    /// A fresh connection per readiness probe: `/readyz` must answer within
    /// the kubelet's timeout even when every pooled connection is busy
    /// (issue 10 item 8).
    probe: Opts,
    /// Counts waits for another replica's request, by how they ended.
    remote_waits: Option<prometheus::IntCounterVec>,
    /// Counts re-asks while waiting.
    polls: Option<prometheus::IntCounter>,
}

pub struct MyFenceOptions<'a> {
    pub url: &'a str,
    pub ca_file: Option<&'a str>,
    pub pool_size: usize,
    /// Bound on one call to the database (pool checkout included).
    pub request_timeout: Duration,
    /// How long start-up keeps retrying while the server is not reachable.
    pub startup: Duration,
}

impl MyFenceOptions<'_> {
    /// The server-side bound on a statement and on a row-lock wait: below
    /// the caller's timeout, so the server ends a stuck statement with a
    /// known failure before the caller gives up on it.
    pub fn statement_timeout(&self) -> Duration {
        self.request_timeout.mul_f64(0.8)
    }
}

fn unavailable(e: impl std::fmt::Display) -> FenceError {
    FenceError::Unavailable(e.to_string())
}

fn run_error(e: RunError) -> FenceError {
    FenceError::Unavailable(e.to_string())
}

fn int(row: &Row, i: usize) -> Result<Option<i64>, FenceError> {
    row.get_opt::<Option<i64>, _>(i)
        .and_then(|r| r.ok())
        .ok_or_else(|| unavailable(format!("admit: column {i} is not an integer")))
}

/// One admission's answer: outcome, the mark as it was, busy ms.
/// `(outcome, mark token, mark seq, busy ms, read token)`.
type AdmitRow = (i64, Option<i64>, Option<i64>, i64, Option<i64>);

fn parse_admit(row: Option<Row>) -> Result<AdmitRow, FenceError> {
    let row = row.ok_or_else(|| unavailable("admit returned no row"))?;
    Ok((
        int(&row, 0)?.ok_or_else(|| unavailable("admit: no outcome"))?,
        int(&row, 1)?,
        int(&row, 3)?,
        int(&row, 4)?.unwrap_or(0),
        int(&row, 5)?,
    ))
}

/// Clears, on the admission's own connection, the stamp of an admission
/// whose caller gave up but which committed after all: its request is
/// never forwarded, so nothing may keep the key.
fn clear_if_stamped(key: Vec<u8>, stamp_id: Vec<u8>) -> Compensation<Option<Row>> {
    Box::new(move |mut conn: Lent, row: Option<Row>| {
        Box::pin(async move {
            let stamped = matches!(parse_admit(row), Ok((0 | 1, ..)));
            if stamped && !stamp_id.is_empty() {
                if let Err(e) = conn.exec_drop(sql::FINISH, (key, stamp_id)).await {
                    tracing::warn!(error = %crate::mysql::describe(&e),
                        "could not clear the stamp of an abandoned admission; it runs out");
                }
            }
            conn
        })
    })
}

impl MyFences {
    /// Connects and creates what is missing of the schema, retrying for up
    /// to `o.startup` while the server is not reachable yet.
    pub async fn connect(o: &MyFenceOptions<'_>) -> Result<MyFences, FenceError> {
        let options = |pool_size| MyOptions {
            url: o.url,
            ca_file: o.ca_file,
            pool_size,
            statement_timeout: o.statement_timeout(),
        };
        let pool = crate::mysql::pool(&options(o.pool_size)).map_err(FenceError::Unavailable)?;
        let probe = crate::mysql::opts(&options(1)).map_err(FenceError::Unavailable)?;
        let store = MyFences {
            runner: Runner::new(
                pool,
                crate::mysql::pool(&options(2)).map_err(FenceError::Unavailable)?,
                o.request_timeout,
                o.url,
            ),
            probe,
            remote_waits: None,
            polls: None,
        };
        let deadline = Instant::now() + o.startup;
        loop {
            let attempt = tokio::time::timeout(Duration::from_secs(30), store.migrate()).await;
            match attempt.unwrap_or_else(|_| Err(unavailable("schema check timed out"))) {
                Ok(()) => return Ok(store),
                Err(e) if Instant::now() < deadline => {
                    tracing::warn!(error = %e, "fence store not ready; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Counts waits for another replica (`fencer_gateway_remote_waits_total`)
    /// and registers `fencer_gateway_mysql_polls_total` in `registry`.
    pub fn with_metrics(
        mut self,
        remote_waits: prometheus::IntCounterVec,
        registry: &prometheus::Registry,
    ) -> MyFences {
        self.remote_waits = Some(remote_waits);
        self.polls = Some(crate::metrics::register(
            registry,
            prometheus::IntCounter::new(
                "fencer_gateway_mysql_polls_total",
                "Re-asks of the MySQL fence store while another gateway replica had a request in flight on the key (MySQL has no LISTEN/NOTIFY; the waiter polls with backoff capped at 50 ms).",
            )
            .expect("valid metric"),
        ));
        self
    }

    /// Creates what is missing of the schema on a connection of its own,
    /// serialized between starting gateways by a named lock. The catalog is
    /// read first: a start against an up-to-date database runs no DDL.
    async fn migrate(&self) -> Result<(), FenceError> {
        let describe = |e: mysql_async::Error| {
            unavailable(format!(
                "{}: {}",
                self.runner.target(),
                crate::mysql::describe(&e)
            ))
        };
        let mut conn = Conn::new(self.probe.clone()).await.map_err(describe)?;
        let result = crate::mysql::schema::ensure(&mut conn, &sql::pieces(), sql::MIGRATE_LOCK)
            .await
            .map(|_| ());

        // Closing the session frees the named lock too.
        let _ = tokio::time::timeout(Duration::from_secs(2), conn.disconnect()).await;
        result.map_err(describe)
    }

    async fn call_admit(
        &self,
        key: &str,
        token: i64,
        lease: &str,
        seq: i64,
        read: bool,
        stamp: (&str, i64),
    ) -> Result<AdmitRow, FenceError> {
        let key = key.as_bytes().to_vec();
        let stamp_id = stamp.0.as_bytes().to_vec();
        let lease = lease.as_bytes().to_vec();
        let deadline = self.runner.deadline();
        let mut retries = 0u32;
        let row = loop {
            let compensate = (stamp.1 > 0).then(|| clear_if_stamped(key.clone(), stamp_id.clone()));
            let params = (
                key.clone(),
                token,
                lease.clone(),
                seq,
                stamp_id.clone(),
                stamp.1,
                i8::from(read),
            );
            let result = self
                .runner
                .run_until(
                    deadline,
                    move |mut conn: Lent| async move {
                        let r = conn.exec_first::<Row, _, _>(sql::CALL_ADMIT, params).await;
                        (conn, r)
                    },
                    compensate,
                )
                .await;
            // Two replicas creating one key's row can deadlock on its gap
            // lock; the server rolled the loser back, so it asks again.
            let pause = crate::mysql::retry_pause(retries);
            match result {
                Err(RunError::Db(e))
                    if crate::mysql::retryable(&e) && Instant::now() + pause < deadline =>
                {
                    crate::metrics::sql::SQL
                        .retries
                        .with_label_values(&["mysql"])
                        .inc();
                    tracing::debug!(retries, error = %crate::mysql::describe(&e), "mysql rolled the admission back; asking again");
                    tokio::time::sleep(pause).await;
                    retries += 1;
                }
                other => break other.map_err(run_error)?,
            }
        };
        parse_admit(row)
    }

    fn count_wait(&self, result: &str) {
        if let Some(c) = &self.remote_waits {
            c.with_label_values(&[result]).inc();
        }
    }
}

/// The next sleep between re-asks: doubling from [`POLL_FIRST`] to
/// [`POLL_CAP`], the actual sleep drawn from its upper three quarters so
/// that replicas waiting on one key do not ask in lockstep.
fn next_poll(step: Duration) -> (Duration, Duration) {
    let sleep = step.mul_f64(rand::rng().random_range(0.75..=1.0));
    (sleep, (step * 2).min(POLL_CAP))
}

#[async_trait]
impl FenceStore for MyFences {
    fn name(&self) -> &'static str {
        "mysql"
    }

    async fn admit(
        &self,
        key: &str,
        presented: Presented<'_>,
        stamp: Option<&Stamp>,
        deadline: Instant,
    ) -> Result<Admitted, FenceError> {
        let Presented {
            token,
            lease,
            seq,
            mode,
        } = presented;
        let token_i = i64::try_from(token).map_err(|_| unavailable("token above i64 range"))?;
        let seq_i = match seq {
            Some(s) => i64::try_from(s).map_err(|_| unavailable("sequence above i64 range"))?,
            None => -1,
        };
        let (stamp_id, hold_ms) = match stamp {
            Some(s) => (
                s.id.as_str(),
                s.hold.as_millis().clamp(1, i64::MAX as u128) as i64,
            ),
            None => ("", 0),
        };
        let mut waited = false;
        let mut step = POLL_FIRST;
        loop {
            let read = mode == Mode::Read;
            let (code, mark_token, mark_seq, busy_ms, read_token) = self
                .call_admit(key, token_i, lease, seq_i, read, (stamp_id, hold_ms))
                .await?;
            if code != 4 {
                if waited {
                    self.count_wait("admitted");
                }
                return Ok(super::admitted(
                    code, mark_token, mark_seq, read_token, seq_i, mode,
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                self.count_wait("timeout");
                return Err(FenceError::Busy);
            }
            waited = true;
            // Asked again when the step is over, or when the stamp runs
            // out (its gateway died), whichever is first.
            let (sleep, next) = next_poll(step);
            step = next;
            let stamp_end = now + Duration::from_millis(busy_ms.max(1) as u64);
            tokio::time::sleep_until((now + sleep).min(stamp_end).min(deadline)).await;
            if let Some(p) = &self.polls {
                p.inc();
            }
        }
    }

    async fn finish(&self, key: &str, stamp_id: &str) -> Result<(), FenceError> {
        let params = (key.as_bytes().to_vec(), stamp_id.as_bytes().to_vec());
        self.runner
            .run(
                move |mut conn: Lent| async move {
                    let r = conn.exec_drop(sql::FINISH, params).await;
                    (conn, r)
                },
                None,
            )
            .await
            .map_err(run_error)
    }

    async fn highest(&self, key: &str) -> Result<Option<(u64, String)>, FenceError> {
        let key = key.as_bytes().to_vec();
        let row: Option<(i64, Vec<u8>)> = self
            .runner
            .run(
                move |mut conn: Lent| async move {
                    let r = conn.exec_first(sql::HIGHEST, (key,)).await;
                    (conn, r)
                },
                None,
            )
            .await
            .map_err(run_error)?;
        Ok(row.map(|(t, lease)| (t as u64, String::from_utf8_lossy(&lease).into_owned())))
    }

    async fn ping(&self) -> Result<(), FenceError> {
        let probe = async {
            let mut conn = Conn::new(self.probe.clone()).await.map_err(|e| {
                unavailable(format!(
                    "{}: {}",
                    self.runner.target(),
                    crate::mysql::describe(&e)
                ))
            })?;
            let r = conn
                .query_drop(sql::PROBE)
                .await
                .map_err(|e| unavailable(crate::mysql::describe(&e)));
            let _ = conn.disconnect().await;
            r
        };
        tokio::time::timeout(PROBE_TIMEOUT, probe)
            .await
            .map_err(|_| unavailable("readiness probe timed out"))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polls_back_off_to_the_cap_and_stay_below_it() {
        let mut step = POLL_FIRST;
        let mut total = Duration::ZERO;
        for _ in 0..20 {
            let (sleep, next) = next_poll(step);
            assert!(sleep <= step && sleep >= step.mul_f64(0.75));
            assert!(next <= POLL_CAP && next >= step);
            total += sleep;
            step = next;
        }
        assert_eq!(step, POLL_CAP);
        // 20 re-asks span well under a second: a stamp's hold is seconds.
        assert!(total < Duration::from_secs(1), "{total:?}");
    }

    #[test]
    fn keys_fit_the_longest_lock_key() {
        assert!(sql::FENCES.contains(&format!(
            "fence_key      VARBINARY({})",
            crate::settings::limits::MAX_KEY_BYTES
        )));
        assert!(sql::ADMIT.contains("SYSDATE(6)") && !sql::ADMIT.contains("NOW("));
    }
}
