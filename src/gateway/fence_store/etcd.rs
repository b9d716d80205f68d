//! The fence store on etcd (`gateway.fence_store = "etcd"`, issue 34): a
//! replicated, linearizable home for the marks, so a gateway fleet
//! survives losing a member with no stale write accepted.
//!
//! Per key, two etcd keys under `gateway.etcd_prefix`:
//!
//! ```text
//! <prefix>/fence/marks/<key>   "<token> <seq> <read token> <lease tag>"
//! <prefix>/fence/stamps/<key>  "<stamp id> <hold ms>"   (while in flight)
//! ```
//!
//! **Admission** reads both at one revision, applies [`super::decide`] in
//! this process, and writes the new mark and the stamp in one transaction
//! that holds only if the mark is unchanged since the read (its
//! `mod_revision`) and no stamp appeared: compare-and-swap, tried again
//! when another replica got there first. A refused request writes
//! nothing. Every read is linearizable (etcd's default), so a decision is
//! never made on a mark a member has not caught up with.
//!
//! **Stamps** are attached to this gateway's etcd *session lease*, kept
//! alive every [`KEEPALIVE_EVERY`]: a gateway that dies leaves its stamps
//! until the lease runs out. The lease's TTL is the stamp hold plus one
//! request timeout and three keepalive periods, and a stamp is written only
//! while the lease is known
//! to last past the stamp's hold (from the send time of its last answered
//! keepalive), so a stamp never goes before its hold is over — the time by
//! which its forwarded write has landed or died. A waiting replica also
//! deletes a stamp it has seen unchanged for the hold recorded in it (on
//! its own clock, counted from when it first saw it: never early), with a
//! compare on its revision. A waiter watches the stamp and is woken when
//! it is cleared ([`FenceStore::finish`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use super::{decide, Admitted, Decision, FenceError, FenceStore, Mark, Mode, Presented, Stamp};
use crate::etcd::wire::{Compare, KeyValue, Op, OpResponse};
use crate::etcd::{EtcdClient, EtcdError, Retry};

/// How often the session lease is kept alive.
pub const KEEPALIVE_EVERY: Duration = Duration::from_secs(1);

pub struct EtcdFenceOptions {
    pub client: EtcdClient,
    /// Prefix of every key this store writes (`gateway.etcd_prefix`).
    pub prefix: String,
    /// Bound on one etcd call.
    pub request_timeout: Duration,
    /// The stamp hold of this gateway (`GatewaySettings::stamp_hold_ms`).
    pub stamp_hold: Duration,
    /// How long to keep trying to reach etcd at start.
    pub startup: Duration,
}

pub struct EtcdFences {
    client: Arc<EtcdClient>,
    marks: String,
    stamps: String,
    timeout: Duration,
    session: Arc<Session>,
    remote_waits: Option<prometheus::IntCounterVec>,
    events: Events,
}

/// `fencer_gateway_etcd_events_total{event}`, once registered: a lost
/// compare-and-swap (another replica admitted first), a stamp cleared
/// after its hold, the session lease's keepalive failing or the lease
/// replaced.
#[derive(Clone, Default)]
struct Events(Option<prometheus::IntCounterVec>);

impl Events {
    fn count(&self, event: &str) {
        if let Some(c) = &self.0 {
            c.with_label_values(&[event]).inc();
        }
    }
}

/// This gateway's session lease: its id, and until when it surely lasts.
struct Session {
    ttl: Duration,
    state: Mutex<(i64, Instant)>,
    /// The store's events, for the keepalive task.
    events: Mutex<Events>,
}

/// A key's mark as stored, with the revision it was read at.
struct Stored {
    token: u64,
    seq: u64,
    read_token: u64,
    lease: String,
    mod_revision: i64,
}

fn unavailable(e: EtcdError) -> FenceError {
    FenceError::Unavailable(e.to_string())
}

impl Stored {
    fn parse(kv: &KeyValue) -> Result<Stored, FenceError> {
        let text = std::str::from_utf8(&kv.value)
            .map_err(|_| FenceError::Unavailable("a mark that is no text".into()))?;
        let mut f = text.splitn(4, ' ');
        let mut num = || -> Result<u64, FenceError> {
            f.next()
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| FenceError::Unavailable(format!("a mark that is not one: {text:?}")))
        };
        Ok(Stored {
            token: num()?,
            seq: num()?,
            read_token: num()?,
            lease: f.next().unwrap_or("").to_owned(),
            mod_revision: kv.mod_revision,
        })
    }

    fn encode(token: u64, seq: u64, read_token: u64, lease: &str) -> String {
        format!("{token} {seq} {read_token} {lease}")
    }

    fn mark(&self) -> Mark<'_> {
        Mark {
            token: self.token,
            lease: &self.lease,
            seq: self.seq,
            read_token: self.read_token,
        }
    }
}

impl EtcdFences {
    /// Opens the session lease (retrying until `startup` passes) and starts
    /// keeping it alive.
    pub async fn connect(options: EtcdFenceOptions) -> Result<EtcdFences, String> {
        let EtcdFenceOptions {
            client,
            prefix,
            request_timeout,
            stamp_hold,
            startup,
        } = options;
        let client = Arc::new(client);
        // A stamp is written only while the lease lasts past its hold and
        // the call that writes it (`lease_for`): with keepalives every
        // second it always does, with two to spare.
        let ttl = stamp_hold + request_timeout + 3 * KEEPALIVE_EVERY;
        let ttl = Duration::from_secs(ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0));
        let give_up = Instant::now() + startup;
        let (id, until) = loop {
            let sent = Instant::now();
            match client.grant(ttl, sent + request_timeout).await {
                Ok(g) => break (g.id, sent + Duration::from_secs(g.ttl.max(0) as u64)),
                Err(e) if Instant::now() >= give_up => {
                    return Err(format!("etcd fence store: no session lease: {e}"))
                }
                Err(e) => {
                    tracing::warn!(error = %e, "etcd fence store: no session lease yet; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        };
        let session = Arc::new(Session {
            ttl,
            state: Mutex::new((id, until)),
            events: Mutex::new(Events::default()),
        });
        keep_alive(Arc::downgrade(&session), client.clone(), request_timeout);
        let prefix = prefix.trim_end_matches('/');
        Ok(EtcdFences {
            client,
            marks: format!("{prefix}/fence/marks/"),
            stamps: format!("{prefix}/fence/stamps/"),
            timeout: request_timeout,
            session,
            remote_waits: None,
            events: Events::default(),
        })
    }

    /// Counts waits for another replica (`fencer_gateway_remote_waits_total`)
    /// and registers `fencer_gateway_etcd_events_total` in `registry`.
    pub fn with_metrics(
        mut self,
        remote_waits: prometheus::IntCounterVec,
        registry: &prometheus::Registry,
    ) -> EtcdFences {
        self.remote_waits = Some(remote_waits);
        let events = crate::metrics::register(
            registry,
            prometheus::IntCounterVec::new(
                prometheus::Opts::new(
                    "fencer_gateway_etcd_events_total",
                    "What the etcd fence store met, by event: cas_conflict (another replica admitted on the key between our read and write: decided again), stale_stamp_cleared (a stamp seen unchanged for its hold: its gateway died mid-forward), keepalive_failed, session_replaced (the session lease ran out and a new one was opened).",
                ),
                &["event"],
            )
            .expect("valid metric"),
        );
        for e in [
            "cas_conflict",
            "stale_stamp_cleared",
            "keepalive_failed",
            "session_replaced",
        ] {
            events.with_label_values(&[e]);
        }
        self.events = Events(Some(events));
        *self.session.events.lock().expect("events") = self.events.clone();
        self
    }

    fn count_wait(&self, result: &str) {
        if let Some(c) = &self.remote_waits {
            c.with_label_values(&[result]).inc();
        }
    }

    /// The session lease to attach a stamp of `hold` to: only one known to
    /// last past the stamp's hold (and the call that writes it).
    fn lease_for(&self, hold: Duration) -> Result<i64, FenceError> {
        let (id, until) = *self.session.state.lock().expect("session");
        if Instant::now() + hold + self.timeout > until {
            return Err(FenceError::Unavailable(
                "etcd fence store: the session lease is not known to outlast a stamp's hold (keepalives failing)".into(),
            ));
        }
        Ok(id)
    }

    fn bound(&self, deadline: Instant) -> Instant {
        deadline.min(Instant::now() + self.timeout)
    }
}

/// Keeps the session lease alive until the store is dropped; a lease that
/// ran out (etcd unreachable past its TTL) is replaced by a new one.
fn keep_alive(session: std::sync::Weak<Session>, client: Arc<EtcdClient>, timeout: Duration) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(KEEPALIVE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(s) = session.upgrade() else {
                return;
            };
            let (id, _) = *s.state.lock().expect("session");
            let sent = Instant::now();
            match client.keep_alive(id, sent + timeout).await {
                Ok(k) if k.ttl > 0 => {
                    s.state.lock().expect("session").1 = sent + Duration::from_secs(k.ttl as u64);
                }
                Ok(_) => {
                    s.events.lock().expect("events").count("session_replaced");
                    tracing::warn!(
                        lease = id,
                        "etcd fence store: the session lease ran out; its stamps are gone; opening a new one"
                    );
                    if let Ok(g) = client.grant(s.ttl, sent + timeout).await {
                        *s.state.lock().expect("session") =
                            (g.id, sent + Duration::from_secs(g.ttl.max(0) as u64));
                    }
                }
                Err(e) => {
                    s.events.lock().expect("events").count("keepalive_failed");
                    tracing::warn!(lease = id, error = %e, "etcd fence store: session keepalive failed; retrying");
                }
            }
        }
    });
}

#[async_trait]
impl FenceStore for EtcdFences {
    fn name(&self) -> &'static str {
        "etcd"
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
        let mark_key = format!("{}{key}", self.marks);
        let stamp_key = format!("{}{key}", self.stamps);
        // Another request's stamp: its revision, when we first saw it, and
        // the hold it records.
        let mut waiting: Option<(i64, Instant, Duration)> = None;
        loop {
            let read = self
                .client
                .txn(
                    &[],
                    &[
                        Op::Get {
                            key: mark_key.clone().into_bytes(),
                        },
                        Op::Get {
                            key: stamp_key.clone().into_bytes(),
                        },
                    ],
                    &[],
                    self.bound(deadline),
                    Retry::Idempotent,
                )
                .await
                .map_err(unavailable)?;
            let found = |i: usize| match read.responses.get(i) {
                Some(OpResponse::Range(r)) => r.kvs.first().cloned(),
                _ => None,
            };
            let (mark, in_flight) = (found(0), found(1));
            if let Some(s) = in_flight {
                let hold = std::str::from_utf8(&s.value)
                    .ok()
                    .and_then(|t| t.split(' ').nth(1))
                    .and_then(|ms| ms.parse().ok())
                    .map_or(Duration::ZERO, Duration::from_millis);
                let now = Instant::now();
                let since = match waiting {
                    Some((rev, since, _)) if rev == s.mod_revision => since,
                    _ => now,
                };
                waiting = Some((s.mod_revision, since, hold));
                // Mutant: a waiter clears a stamp as soon as it sees it.
                let hold = if crate::mutants::active("etcd_stamp_early") {
                    Duration::ZERO
                } else {
                    hold
                };
                if now >= since + hold {
                    // Seen unchanged for its whole hold: its gateway died
                    // mid-forward and the write has landed or died.
                    self.events.count("stale_stamp_cleared");
                    tracing::warn!(
                        key,
                        hold_ms = hold.as_millis() as u64,
                        "etcd fence store: an in-flight stamp outlived its hold; clearing it"
                    );
                    self.client
                        .txn(
                            &[Compare::unchanged(&s.key, s.mod_revision)],
                            &[Op::Delete { key: s.key.clone() }],
                            &[],
                            self.bound(deadline),
                            Retry::Idempotent,
                        )
                        .await
                        .map_err(unavailable)?;
                    continue;
                }
                if now >= deadline {
                    self.count_wait("timeout");
                    return Err(FenceError::Busy);
                }
                let until = deadline.min(since + hold);
                if let Ok(mut w) = self
                    .client
                    .watch(&s.key, read.header.revision + 1, self.bound(until))
                    .await
                {
                    let _ = tokio::time::timeout_at(until, w.next()).await;
                } else {
                    tokio::time::sleep_until(until.min(now + Duration::from_millis(50))).await;
                }
                if Instant::now() >= deadline {
                    self.count_wait("timeout");
                    return Err(FenceError::Busy);
                }
                continue;
            }
            let stored = mark.as_ref().map(Stored::parse).transpose()?;
            let previous = stored.as_ref().map(|m| m.mark().highest());
            let decision = decide(stored.as_ref().map(Stored::mark), token, lease, seq, mode);
            if waiting.take().is_some() {
                self.count_wait("admitted");
            }
            if !decision.accepted() {
                return Ok(Admitted { decision, previous });
            }
            let mut ops = Vec::new();
            if decision.writes_mark(seq) {
                let old = stored.as_ref();
                let value = match mode {
                    Mode::Read => Stored::encode(
                        old.map_or(0, |m| m.token),
                        old.map_or(0, |m| m.seq),
                        token,
                        old.map_or("", |m| m.lease.as_str()),
                    ),
                    Mode::Write if decision == Decision::Advanced => Stored::encode(
                        token,
                        seq.unwrap_or(0),
                        old.map_or(0, |m| m.read_token),
                        lease,
                    ),
                    Mode::Write => Stored::encode(
                        old.map_or(0, |m| m.token),
                        seq.unwrap_or(0),
                        old.map_or(0, |m| m.read_token),
                        old.map_or("", |m| m.lease.as_str()),
                    ),
                };
                ops.push(Op::Put {
                    key: mark_key.clone().into_bytes(),
                    value: value.into_bytes(),
                    lease: 0,
                });
            }
            if let Some(s) = stamp {
                ops.push(Op::Put {
                    key: stamp_key.clone().into_bytes(),
                    value: format!("{} {}", s.id, s.hold.as_millis()).into_bytes(),
                    lease: self.lease_for(s.hold)?,
                });
            }
            if ops.is_empty() {
                return Ok(Admitted { decision, previous });
            }
            let mut compare = vec![
                Compare::unchanged(
                    mark_key.as_bytes(),
                    stored.as_ref().map_or(0, |m| m.mod_revision),
                ),
                Compare::absent(stamp_key.as_bytes()),
            ];
            if crate::mutants::active("etcd_mark_blind_write") {
                compare.clear(); // write whatever another replica did meanwhile
            }
            let written = self
                .client
                .txn(&compare, &ops, &[], self.bound(deadline), Retry::Once)
                .await
                .map_err(unavailable)?;
            if written.succeeded {
                return Ok(Admitted { decision, previous });
            }
            // Another replica moved the mark or stamped the key between
            // our read and our write: decide again on what it left.
            self.events.count("cas_conflict");
            tracing::debug!(
                key,
                "etcd fence store: another replica admitted first; deciding again"
            );
        }
    }

    async fn finish(&self, key: &str, stamp_id: &str) -> Result<(), FenceError> {
        let stamp_key = format!("{}{key}", self.stamps);
        let deadline = Instant::now() + self.timeout;
        let found = self
            .client
            .get(stamp_key.as_bytes(), deadline)
            .await
            .map_err(unavailable)?;
        let Some(s) = found.kvs.first() else {
            return Ok(());
        };
        if s.value.split(|b| *b == b' ').next() != Some(stamp_id.as_bytes()) {
            return Ok(()); // another request's (ours ran out and was cleared)
        }
        self.client
            .txn(
                &[Compare::unchanged(&s.key, s.mod_revision)],
                &[Op::Delete { key: s.key.clone() }],
                &[],
                deadline,
                Retry::Idempotent,
            )
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn highest(&self, key: &str) -> Result<Option<(u64, String)>, FenceError> {
        let found = self
            .client
            .get(
                format!("{}{key}", self.marks).as_bytes(),
                Instant::now() + self.timeout,
            )
            .await
            .map_err(unavailable)?;
        let Some(kv) = found.kvs.first() else {
            return Ok(None);
        };
        let m = Stored::parse(kv)?;
        Ok((!m.lease.is_empty()).then_some((m.token, m.lease)))
    }

    async fn ping(&self) -> Result<(), FenceError> {
        self.client
            .get(
                format!("{}ping", self.marks).as_bytes(),
                Instant::now() + self.timeout,
            )
            .await
            .map(|_| ())
            .map_err(unavailable)
    }
}
