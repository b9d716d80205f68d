//! Group commit of PostgreSQL admissions.
//!
//! Every fenced write is admitted by a transaction that must be durable
//! before the write is forwarded: its commit waits for a WAL flush. One
//! gateway sees every fenced write of the keys it serves, so admissions of
//! different keys that arrive together can share one statement, one
//! transaction and one flush (`fencer_gw_admit_many_v1`, which runs each
//! item through the very function a single admission calls). This is what
//! lifts the fence store above the database's commit rate per connection
//! (docs/performance.md, "PostgreSQL fence store").
//!
//! One admission statement is on its way at a time. When none is, a call
//! goes out at once, alone, from the caller's own task — today's statement
//! exactly, no added latency. Calls that arrive meanwhile queue; when the
//! statement in flight has answered, everything queued (at most
//! [`MAX_ITEMS`]) goes out together from a task of its own. Its items are
//! the keys' current turns in this gateway ([`super::super::key_queue`]),
//! so a key appears at most once in a statement; the function locks the
//! rows in key order, so two replicas' statements cannot deadlock.
//!
//! Bounds: a queued caller waits at most the single statement's budget (a
//! caller that gave up has closed its reply channel, and an item whose
//! channel is closed when the statement is formed is never sent);
//! [`MAX_QUEUED`] calls at most wait, beyond that a call goes out alone. A
//! statement that fails answers each of its items with the error a single
//! statement would have had — the outcome is then unknown, exactly as for a
//! single admission that timed out: the stamp, if it was committed, keeps
//! the key blocked until it runs out.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;

use super::{sql, FenceError};
use crate::pg::runner::Lent;
use crate::pg::{RunError, Runner};

/// Items per statement: bounds how long one transaction holds its rows'
/// locks (another replica's admission of one of them waits for the commit).
pub const MAX_ITEMS: usize = 64;

/// Calls waiting for the next statement; beyond this a call goes out alone.
const MAX_QUEUED: usize = 1024;

/// One admission's arguments, as `fencer_gw_admit_v1` takes them.
#[derive(Debug, Clone)]
pub struct AdmitArgs {
    pub key: String,
    pub token: i64,
    pub lease: String,
    /// -1: the request carries no sequence.
    pub seq: i64,
    pub stamp: String,
    /// 0: no stamp.
    pub hold_ms: i64,
}

/// `(outcome, mark token, mark lease, mark seq, busy ms)`, as
/// `fencer_gw_admit_v1` answers.
pub type AdmitRow = (i32, Option<i64>, Option<String>, Option<i64>, i64);

type Answer = Result<AdmitRow, FenceError>;

struct Queued {
    args: AdmitArgs,
    reply: oneshot::Sender<Answer>,
}

/// How a call goes out.
enum Entry {
    /// Now, alone, as the statement on its way.
    Lead(AdmitArgs),
    /// Now, alone, beside the statement on its way (the queue is full).
    Alone(AdmitArgs),
    /// In the next shared statement.
    Queued(oneshot::Receiver<Answer>),
}

#[derive(Default)]
struct State {
    /// An admission statement is on its way.
    busy: bool,
    waiting: Vec<Queued>,
}

pub struct Admissions {
    runner: Runner,
    /// The statement's budget: how long a queued caller waits at most.
    budget: Duration,
    state: Mutex<State>,
    /// Items per statement (`fencer_gateway_fence_admissions_per_statement`).
    per_statement: Option<prometheus::Histogram>,
}

impl Admissions {
    pub fn new(runner: Runner, budget: Duration) -> Admissions {
        Admissions {
            runner,
            budget,
            state: Mutex::new(State::default()),
            per_statement: None,
        }
    }

    pub fn set_metrics(&mut self, per_statement: prometheus::Histogram) {
        self.per_statement = Some(per_statement);
    }

    /// Admits one request: alone when no admission is on its way, else in
    /// the next shared statement.
    pub async fn admit(self: &Arc<Self>, args: AdmitArgs) -> Answer {
        let rx = match self.enter(args) {
            Entry::Lead(args) => {
                // Ours is the statement on its way; whatever becomes of
                // this future (answered, or dropped mid-way), the turn
                // passes on.
                let _turn = Turn(self.clone());
                return self.single(args).await;
            }
            Entry::Alone(args) => return self.single(args).await,
            Entry::Queued(rx) => rx,
        };
        match tokio::time::timeout(self.budget, rx).await {
            Ok(Ok(answer)) => answer,
            // The statement's task ended without answering (a panic).
            Ok(Err(_)) => Err(run_error(RunError::Timeout)),
            Err(_) => Err(run_error(RunError::Timeout)),
        }
    }

    fn enter(&self, args: AdmitArgs) -> Entry {
        let mut st = self.state.lock().expect("admissions poisoned");
        if !st.busy {
            st.busy = true;
            return Entry::Lead(args);
        }
        if st.waiting.len() >= MAX_QUEUED {
            return Entry::Alone(args);
        }
        let (tx, rx) = oneshot::channel();
        st.waiting.push(Queued { args, reply: tx });
        Entry::Queued(rx)
    }

    async fn single(&self, args: AdmitArgs) -> Answer {
        self.observe(1);
        self.runner
            .run(
                move |conn: Lent| async move {
                    let r = async {
                        let stmt = conn.prepare_cached(sql::CALL_ADMIT).await?;
                        conn.query_one(
                            &stmt,
                            &[
                                &args.key,
                                &args.token,
                                &args.lease,
                                &args.seq,
                                &args.stamp,
                                &args.hold_ms,
                            ],
                        )
                        .await
                    }
                    .await;
                    (conn, r)
                },
                None,
            )
            .await
            .map_err(run_error)
            .map(|row| (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4)))
    }

    /// The statement on its way has answered: send what queued meanwhile,
    /// or stand idle.
    fn next(self: &Arc<Self>) {
        let batch = {
            let mut st = self.state.lock().expect("admissions poisoned");
            // Callers that gave up are not sent.
            st.waiting.retain(|q| !q.reply.is_closed());
            if st.waiting.is_empty() {
                st.busy = false;
                return;
            }
            let n = st.waiting.len().min(MAX_ITEMS);
            st.waiting.drain(..n).collect::<Vec<_>>()
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            // Dropped outside the runtime (shutting down): nobody to send.
            self.state.lock().expect("admissions poisoned").busy = false;
            return;
        };
        let me = self.clone();
        rt.spawn(async move {
            let _turn = Turn(me.clone());
            me.send(batch).await;
        });
    }

    async fn send(&self, batch: Vec<Queued>) {
        if batch.len() == 1 {
            let q = batch.into_iter().next().expect("one item");
            let _ = q.reply.send(self.single(q.args).await);
            return;
        }
        self.observe(batch.len());
        let mut cols = Columns::default();
        for q in &batch {
            cols.push(&q.args);
        }
        let answer = self
            .runner
            .run(
                move |conn: Lent| async move {
                    let r = async {
                        let stmt = conn.prepare_cached(sql::CALL_ADMIT_MANY).await?;
                        conn.query(
                            &stmt,
                            &[
                                &cols.keys,
                                &cols.tokens,
                                &cols.leases,
                                &cols.seqs,
                                &cols.stamps,
                                &cols.holds,
                            ],
                        )
                        .await
                    }
                    .await;
                    (conn, r)
                },
                None,
            )
            .await;
        match answer {
            Ok(rows) => {
                let mut replies: Vec<Option<oneshot::Sender<Answer>>> =
                    batch.into_iter().map(|q| Some(q.reply)).collect();
                for row in rows {
                    let idx: i32 = row.get(0);
                    let Some(reply) = usize::try_from(idx)
                        .ok()
                        .and_then(|i| i.checked_sub(1))
                        .and_then(|i| replies.get_mut(i))
                        .and_then(Option::take)
                    else {
                        continue;
                    };
                    let _ = reply.send(Ok((
                        row.get(1),
                        row.get(2),
                        row.get(3),
                        row.get(4),
                        row.get(5),
                    )));
                }
                // Every item is answered by the function; one that was not
                // is an unknown outcome.
                for reply in replies.into_iter().flatten() {
                    tracing::error!("batched admission got no row; answered as unknown");
                    let _ = reply.send(Err(FenceError::Unavailable(
                        "batched admission got no answer".into(),
                    )));
                }
            }
            Err(e) => {
                let msg = e.to_string();
                tracing::warn!(items = batch.len(), error = %msg, "batched admission failed");
                for q in batch {
                    let _ = q.reply.send(Err(FenceError::Unavailable(msg.clone())));
                }
            }
        }
    }

    fn observe(&self, items: usize) {
        if let Some(h) = &self.per_statement {
            h.observe(items as f64);
        }
    }
}

/// The admission statement's turn: passed on when its holder is done or
/// dropped.
struct Turn(Arc<Admissions>);

impl Drop for Turn {
    fn drop(&mut self) {
        self.0.next();
    }
}

/// A statement's items as the function's array parameters.
#[derive(Default)]
struct Columns {
    keys: Vec<String>,
    tokens: Vec<i64>,
    leases: Vec<String>,
    seqs: Vec<i64>,
    stamps: Vec<String>,
    holds: Vec<i64>,
}

impl Columns {
    fn push(&mut self, a: &AdmitArgs) {
        self.keys.push(a.key.clone());
        self.tokens.push(a.token);
        self.leases.push(a.lease.clone());
        self.seqs.push(a.seq);
        self.stamps.push(a.stamp.clone());
        self.holds.push(a.hold_ms);
    }
}

fn run_error(e: RunError) -> FenceError {
    FenceError::Unavailable(e.to_string())
}
