//! Group commit of the PostgreSQL fence store's statements.
//!
//! Every fenced write is admitted by a transaction that must be durable
//! before the write is forwarded: its commit waits for a WAL flush. Then,
//! when the storage has answered, another transaction clears its stamp.
//! One gateway sees every fenced write of the keys it serves, so admissions
//! (and clearings) of different keys that arrive together can share one
//! statement, one transaction and one flush (`fencer_gw_admit_many_v1`,
//! `fencer_gw_finish_many_v1`, which run each item through the very
//! function a single call uses). This is what lifts the fence store above
//! the database's commit rate per connection (docs/performance.md,
//! "PostgreSQL fence store").
//!
//! Per operation, one statement is on its way at a time. When none is, a call
//! goes out at once, alone, from the caller's own task — today's statement
//! exactly, no added latency. Calls that arrive meanwhile queue; when the
//! statement in flight has answered, everything queued (at most
//! [`MAX_ITEMS`]) goes out together from a task of its own. Its items are
//! the keys' current turns in this gateway ([`super::super::key_queue`]),
//! so a key appears at most once in a statement; the functions lock the
//! rows in key order, so two statements (of any replica, either operation)
//! cannot deadlock.
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

use async_trait::async_trait;
use tokio::sync::oneshot;

use super::{sql, FenceError};
use crate::pg::runner::Params;
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

/// One clearing's arguments, as `fencer_gw_finish_v1` takes them.
#[derive(Debug, Clone)]
pub struct FinishArgs {
    pub key: String,
    pub stamp: String,
    pub channel: String,
}

/// An operation that can go alone or several at once.
#[async_trait]
pub trait Batched: Send + Sync + 'static {
    type Args: Send + 'static;
    type Row: Send + 'static;
    /// The `op` label.
    const OP: &'static str;
    async fn one(runner: &Runner, args: Self::Args) -> Result<Self::Row, RunError>;
    /// Rows with the 1-based index of the item each answers.
    async fn many(
        runner: &Runner,
        args: Vec<Self::Args>,
    ) -> Result<Vec<(i32, Self::Row)>, RunError>;
}

/// Admissions (`fencer_gw_admit_v1` / `_many_v1`).
pub struct Admit;

#[async_trait]
impl Batched for Admit {
    type Args = AdmitArgs;
    type Row = AdmitRow;
    const OP: &'static str = "admit";

    async fn one(runner: &Runner, a: AdmitArgs) -> Result<AdmitRow, RunError> {
        let params: Params = vec![
            Box::new(a.key),
            Box::new(a.token),
            Box::new(a.lease),
            Box::new(a.seq),
            Box::new(a.stamp),
            Box::new(a.hold_ms),
        ];
        let rows = runner.query(sql::CALL_ADMIT, params, None).await?;
        let row = only_row(&rows)?;
        Ok((row.get(0), row.get(1), row.get(2), row.get(3), row.get(4)))
    }

    async fn many(runner: &Runner, args: Vec<AdmitArgs>) -> Result<Vec<(i32, AdmitRow)>, RunError> {
        let mut c = (vec![], vec![], vec![], vec![], vec![], vec![]);
        for a in args {
            c.0.push(a.key);
            c.1.push(a.token);
            c.2.push(a.lease);
            c.3.push(a.seq);
            c.4.push(a.stamp);
            c.5.push(a.hold_ms);
        }
        let params: Params = vec![
            Box::new(c.0),
            Box::new(c.1),
            Box::new(c.2),
            Box::new(c.3),
            Box::new(c.4),
            Box::new(c.5),
        ];
        let rows = runner.query(sql::CALL_ADMIT_MANY, params, None).await?;
        Ok(rows
            .iter()
            .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3), r.get(4), r.get(5))))
            .collect())
    }
}

/// Clearings of in-flight stamps (`fencer_gw_finish_v1` / `_many_v1`):
/// whether the stamp was still there.
pub struct Finish;

#[async_trait]
impl Batched for Finish {
    type Args = FinishArgs;
    type Row = bool;
    const OP: &'static str = "finish";

    async fn one(runner: &Runner, a: FinishArgs) -> Result<bool, RunError> {
        let params: Params = vec![Box::new(a.key), Box::new(a.stamp), Box::new(a.channel)];
        let rows = runner.query(sql::CALL_FINISH, params, None).await?;
        Ok(only_row(&rows)?.get(0))
    }

    async fn many(runner: &Runner, args: Vec<FinishArgs>) -> Result<Vec<(i32, bool)>, RunError> {
        let mut c = (vec![], vec![], vec![]);
        for a in args {
            c.0.push(a.key);
            c.1.push(a.stamp);
            c.2.push(a.channel);
        }
        let params: Params = vec![Box::new(c.0), Box::new(c.1), Box::new(c.2)];
        let rows = runner.query(sql::CALL_FINISH_MANY, params, None).await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }
}

/// The one row a single call's function answers.
fn only_row(rows: &[tokio_postgres::Row]) -> Result<&tokio_postgres::Row, RunError> {
    rows.first().ok_or(RunError::NoRow)
}

type Answer<R> = Result<R, FenceError>;

struct Queued<B: Batched> {
    args: B::Args,
    reply: oneshot::Sender<Answer<B::Row>>,
}

/// How a call goes out.
enum Entry<B: Batched> {
    /// Now, alone, as the statement on its way.
    Lead(B::Args),
    /// Now, alone, beside the statement on its way (the queue is full).
    Alone(B::Args),
    /// In the next shared statement.
    Queued(oneshot::Receiver<Answer<B::Row>>),
}

struct State<B: Batched> {
    /// A statement of this operation is on its way.
    busy: bool,
    waiting: Vec<Queued<B>>,
}

/// One operation's group commit.
pub struct Group<B: Batched> {
    runner: Runner,
    /// The statement's budget: how long a queued caller waits at most.
    budget: Duration,
    state: Mutex<State<B>>,
    /// Items per statement (`fencer_gateway_fence_items_per_statement`).
    per_statement: Option<prometheus::Histogram>,
}

impl<B: Batched> Group<B> {
    pub fn new(runner: Runner, budget: Duration) -> Group<B> {
        Group {
            runner,
            budget,
            state: Mutex::new(State {
                busy: false,
                waiting: Vec::new(),
            }),
            per_statement: None,
        }
    }

    pub fn set_metrics(&mut self, per_statement: prometheus::Histogram) {
        self.per_statement = Some(per_statement);
    }

    /// One call: alone when none of this operation is on its way, else in
    /// the next shared statement.
    pub async fn call(self: &Arc<Self>, args: B::Args) -> Answer<B::Row> {
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

    fn enter(&self, args: B::Args) -> Entry<B> {
        let mut st = self.state.lock().expect("group commit poisoned");
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

    async fn single(&self, args: B::Args) -> Answer<B::Row> {
        self.observe(1);
        B::one(&self.runner, args).await.map_err(run_error)
    }

    /// The statement on its way has answered: send what queued meanwhile,
    /// or stand idle.
    fn next(self: &Arc<Self>) {
        let batch = {
            let mut st = self.state.lock().expect("group commit poisoned");
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
            self.state.lock().expect("group commit poisoned").busy = false;
            return;
        };
        let me = self.clone();
        rt.spawn(async move {
            let _turn = Turn(me.clone());
            me.send(batch).await;
        });
    }

    async fn send(&self, batch: Vec<Queued<B>>) {
        if batch.len() == 1 {
            let q = batch.into_iter().next().expect("one item");
            let _ = q.reply.send(self.single(q.args).await);
            return;
        }
        self.observe(batch.len());
        let n = batch.len();
        let (args, replies): (Vec<_>, Vec<_>) =
            batch.into_iter().map(|q| (q.args, q.reply)).unzip();
        match B::many(&self.runner, args).await {
            Ok(rows) => {
                let mut replies: Vec<_> = replies.into_iter().map(Some).collect();
                let shifted = crate::mutants::active("fence_batch_replies_shifted");
                for (idx, row) in rows {
                    // Mutant: item i answered with its neighbour's row.
                    let idx = if shifted { idx % n as i32 + 1 } else { idx };
                    let Some(reply) = usize::try_from(idx)
                        .ok()
                        .and_then(|i| i.checked_sub(1))
                        .and_then(|i| replies.get_mut(i))
                        .and_then(Option::take)
                    else {
                        continue;
                    };
                    let _ = reply.send(Ok(row));
                }
                // The function answers every item; one it did not is an
                // unknown outcome.
                for reply in replies.into_iter().flatten() {
                    tracing::error!(
                        op = B::OP,
                        "a batched fence-store call got no row; answered as unknown"
                    );
                    let _ = reply.send(Err(FenceError::Unavailable(
                        "batched fence-store call got no answer".into(),
                    )));
                }
            }
            Err(e) => {
                let msg = e.to_string();
                tracing::warn!(op = B::OP, items = n, error = %msg, "batched fence-store call failed");
                for reply in replies {
                    let _ = reply.send(Err(FenceError::Unavailable(msg.clone())));
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

/// The operation's turn: passed on when its holder is done or dropped.
struct Turn<B: Batched>(Arc<Group<B>>);

impl<B: Batched> Drop for Turn<B> {
    fn drop(&mut self) {
        self.0.next();
    }
}

fn run_error(e: RunError) -> FenceError {
    FenceError::Unavailable(e.to_string())
}
