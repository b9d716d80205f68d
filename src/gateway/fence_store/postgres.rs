//! Durable fence store on PostgreSQL, shared by every gateway replica.
//!
//! Per key, `fencer_fences` holds the mark and the in-flight stamp (see
//! [`super`] and [`super::sql`]). A request is admitted by one function
//! call that locks the key's row for the call only: check the stamp, check
//! and advance the mark, stamp the key in flight — committed before the
//! request is forwarded, so a crash cannot forget that a higher token may
//! have written, nor that a write may still be on its way. The stamp is
//! cleared by another call when the storage has answered (or after the
//! uncertain hold), which NOTIFYs a replica that waits for the key.
//!
//! A replica that finds the key stamped by another waits without holding a
//! database connection: it LISTENs on the key's channel and asks again when
//! notified, or when the stamp runs out (the other gateway died), bounded by
//! the serialization timeout.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::pg::runner::Lent;
use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::pg_batch::{Admit, AdmitArgs, AdmitRow, Finish, FinishArgs};
use super::{sql, Admitted, FenceError, FenceStore, Mode, Presented, Stamp};
use crate::lock::WakeSink;
use crate::pg::group::{Batched, Group};
use crate::pg::listener::Listener;
use crate::pg::{RunError, Runner};

/// Bound on one readiness probe (below the kubelet's default 1 s).
const PROBE_TIMEOUT: Duration = Duration::from_millis(800);

/// Prefix of the NOTIFY channels of fence rows.
const CHANNEL_PREFIX: &str = "fencer_gw";

pub struct PgFences {
    runner: Runner,
    /// Admissions and clearings, group-committed ([`super::pg_batch`]).
    admissions: Arc<Group<Admit>>,
    finishes: Arc<Group<Finish>>,
    /// A fresh connection per readiness probe: `/readyz` must answer within
    /// the kubelet's timeout even when every pooled connection is busy
    /// (issue 10 item 8).
    probe: (tokio_postgres::Config, crate::pg::Tls),
    listener: Listener,
    wakeups: Arc<KeyWakeups>,
    /// Counts waits for another replica's request, by how they ended.
    remote_waits: Option<prometheus::IntCounterVec>,
}

pub struct PgFenceOptions<'a> {
    pub url: &'a str,
    pub ca_file: Option<&'a str>,
    pub pool_size: usize,
    /// Bound on one call to the database (pool checkout included).
    pub request_timeout: Duration,
    /// How long start-up keeps retrying while PostgreSQL is not reachable.
    pub startup: Duration,
}

fn unavailable(e: impl std::fmt::Display) -> FenceError {
    FenceError::Unavailable(e.to_string())
}

fn run_error(e: RunError) -> FenceError {
    FenceError::Unavailable(e.to_string())
}

/// One wake-up slot per key a local request waits on: the LISTEN
/// connection's notifications land here.
#[derive(Default)]
struct KeyWakeups {
    slots: Mutex<HashMap<String, Arc<Notify>>>,
}

impl KeyWakeups {
    fn slot(&self, key: &str) -> Arc<Notify> {
        self.slots
            .lock()
            .expect("wake-up slots poisoned")
            .entry(key.to_owned())
            .or_default()
            .clone()
    }

    fn forget(&self, key: &str, slot: &Arc<Notify>) {
        let mut slots = self.slots.lock().expect("wake-up slots poisoned");
        // Ours and the map's: nobody else waits on it.
        if slots.get(key).is_some_and(|s| Arc::ptr_eq(s, slot)) && Arc::strong_count(slot) == 2 {
            slots.remove(key);
        }
    }
}

impl WakeSink for KeyWakeups {
    fn released(&self, key: &str) {
        if let Some(slot) = self.slots.lock().expect("poisoned").get(key) {
            slot.notify_one();
        }
    }

    fn resync(&self) {
        for slot in self.slots.lock().expect("poisoned").values() {
            slot.notify_one();
        }
    }
}

impl PgFences {
    /// Connects and creates what is missing of the schema, retrying for up
    /// to `o.startup` while PostgreSQL is not reachable yet.
    pub async fn connect(o: &PgFenceOptions<'_>) -> Result<PgFences, FenceError> {
        let (config, tls, pool) = crate::pg::pool(&crate::pg::PgOptions {
            url: o.url,
            application_name: "fencer-gateway",
            ca_file: o.ca_file,
            pool_size: o.pool_size,
            connect_timeout: Duration::from_secs(5),
            wait_timeout: o.request_timeout,
            // The backstop for a statement whose caller gave up and whose
            // cancel request was lost.
            statement_timeout: Some(o.request_timeout * 2),
            lock_timeout: Some(o.request_timeout),
        })
        .map_err(FenceError::Unavailable)?;
        let mut probe_config = config.clone();
        probe_config
            .application_name("fencer-gateway-probe")
            .connect_timeout(PROBE_TIMEOUT);
        let mut listen_config = config.clone();
        listen_config.application_name("fencer-gateway-listener");
        let wakeups = Arc::new(KeyWakeups::default());
        let runner = Runner::new(pool, tls.clone(), o.request_timeout, o.url);
        let store = PgFences {
            admissions: Arc::new(Group::new(runner.clone(), o.request_timeout)),
            finishes: Arc::new(Group::new(runner.clone(), o.request_timeout)),
            runner,
            probe: (probe_config, tls.clone()),
            listener: Listener::start(CHANNEL_PREFIX, listen_config, tls, wakeups.clone()),
            wakeups,
            remote_waits: None,
        };
        let deadline = Instant::now() + o.startup;
        loop {
            match store.migrate().await {
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
    /// and calls per statement (`fencer_gateway_fence_items_per_statement`).
    pub fn with_metrics(
        mut self,
        remote_waits: prometheus::IntCounterVec,
        per_statement: &prometheus::HistogramVec,
    ) -> PgFences {
        self.remote_waits = Some(remote_waits);
        let h = |op| per_statement.with_label_values(&["postgres", op]);
        if let Some(a) = Arc::get_mut(&mut self.admissions) {
            a.set_metrics(h(Admit::OP));
        }
        if let Some(f) = Arc::get_mut(&mut self.finishes) {
            f.set_metrics(h(Finish::OP));
        }
        self
    }

    /// Creates what is missing of the schema (see [`crate::pg::schema`]):
    /// a start-up against an up-to-date database takes no table lock.
    async fn migrate(&self) -> Result<(), FenceError> {
        let mut conn = self
            .runner
            .pool()
            .get()
            .await
            .map_err(|e| unavailable(crate::pg::pool_error(self.runner.target(), &e)))?;
        let created = crate::pg::schema::ensure(&mut conn, &sql::pieces(), sql::MIGRATE_LOCK)
            .await
            .map_err(|e| unavailable(crate::pg::describe(&e)))?;
        if created > 0 {
            tracing::info!(created, "fence store schema updated");
        }
        Ok(())
    }

    async fn call_admit(&self, args: AdmitArgs) -> Result<AdmitRow, FenceError> {
        self.admissions.call(args).await.map_err(run_error)
    }

    fn count_wait(&self, result: &str) {
        if let Some(c) = &self.remote_waits {
            c.with_label_values(&[result]).inc();
        }
    }
}

#[async_trait]
impl FenceStore for PgFences {
    fn name(&self) -> &'static str {
        "postgres"
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
        // Watching starts before the second call, so a NOTIFY sent between
        // a "busy" answer and our wait is not missed.
        let mut watching = None;
        loop {
            let (code, mark_token, _lease, mark_seq, busy_ms, read_token) = self
                .call_admit(AdmitArgs {
                    key: key.to_owned(),
                    token: token_i,
                    lease: lease.to_owned(),
                    seq: seq_i,
                    stamp: stamp_id.to_owned(),
                    hold_ms,
                    read: mode == Mode::Read,
                })
                .await?;
            if code != 4 {
                if let Some((slot, _watch)) = watching.take() {
                    self.wakeups.forget(key, &slot);
                    self.count_wait("admitted");
                }
                return Ok(super::admitted(
                    code.into(),
                    mark_token,
                    mark_seq,
                    read_token,
                    seq_i,
                    mode,
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                if let Some((slot, _)) = watching.take() {
                    self.wakeups.forget(key, &slot);
                }
                self.count_wait("timeout");
                return Err(FenceError::Busy);
            }
            match &watching {
                None => {
                    let slot = self.wakeups.slot(key);
                    let watch = self.listener.watch(key, deadline - now).await;
                    watching = Some((slot, watch));
                    // Ask again at once: the stamp may have been cleared
                    // before we listened.
                }
                Some((slot, _)) => {
                    // Woken by the NOTIFY of the stamp's owner, or when the
                    // stamp runs out (its gateway died).
                    let until = (now + Duration::from_millis(busy_ms as u64)).min(deadline);
                    tokio::select! {
                        _ = slot.notified() => {}
                        _ = tokio::time::sleep_until(until) => {}
                    }
                }
            }
        }
    }

    async fn finish(&self, key: &str, stamp_id: &str) -> Result<(), FenceError> {
        self.finishes
            .call(FinishArgs {
                key: key.to_owned(),
                stamp: stamp_id.to_owned(),
                channel: self.listener.channel(key),
            })
            .await
            .map(|_| ())
            .map_err(run_error)
    }

    async fn highest(&self, key: &str) -> Result<Option<(u64, String)>, FenceError> {
        let key = key.to_owned();
        let row = self
            .runner
            .run(
                move |conn: Lent| async move {
                    let r = conn.query_opt(sql::HIGHEST, &[&key]).await;
                    (conn, r)
                },
                None,
            )
            .await
            .map_err(run_error)?;
        Ok(row.map(|r| (r.get::<_, i64>(0) as u64, r.get::<_, String>(1))))
    }

    async fn ping(&self) -> Result<(), FenceError> {
        let (config, tls) = &self.probe;
        let probe = async {
            let (client, conn) = config
                .connect(tls.clone())
                .await
                .map_err(|e| unavailable(format!("{}: {e}", self.runner.target())))?;
            let driver = tokio::spawn(conn);
            let r = client
                .simple_query("SELECT 1 FROM fencer_fences LIMIT 0")
                .await
                .map(|_| ())
                .map_err(unavailable);
            drop(client);
            let _ = driver.await;
            r
        };
        tokio::time::timeout(PROBE_TIMEOUT, probe)
            .await
            .map_err(|_| {
                unavailable(format!(
                    "{}: readiness probe timed out",
                    self.runner.target()
                ))
            })?
    }
}
