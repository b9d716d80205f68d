//! Group commit: statements of one kind that arrive together share one
//! statement, one transaction and one WAL flush.
//!
//! One process sees every call of its kind (the gateway every fenced write
//! of the keys it serves, the sidecar every lock operation of its pod), so
//! calls for different keys that arrive while one is on its way can go
//! together in the next statement (`fencer_gw_admit_many_v1`,
//! `fencer_acquire_many_v1`, …), which runs each item through the very SQL a
//! single call runs. This is what lifts a store above the database's commit
//! rate per connection (docs/performance.md, "Group commit").
//!
//! Per operation, one statement is on its way at a time. When none is, a
//! call goes out at once, alone, from the caller's own task — the single
//! statement exactly (with its own undo, [`super::runner`]), no added
//! latency. Calls that arrive meanwhile queue; when the statement in flight
//! has answered, everything queued (at most [`MAX_ITEMS`]) goes out
//! together from a task of its own. The `_many` functions lock rows in key
//! order, so two statements (of any process, either operation) cannot
//! deadlock.
//!
//! Bounds: a queued caller waits at most the group's budget (a caller that
//! gave up has closed its reply channel, and an item whose channel is
//! closed when the statement is formed is never sent); [`MAX_QUEUED`] calls
//! at most wait, beyond that a call goes out alone; and once the statement
//! on its way is older than [`ALONE_AFTER`] (slow: a row-lock wait, a
//! stalled connection), new calls go out alone rather than queue behind it.
//! Calls that queued while it was young still wait for it (at most their
//! budget): taking them back out of the queue is not built.
//!
//! A caller that gave up after its item was sent is the seam between this
//! group and the runner's undo: the shared statement is not cancelled for
//! one caller (the others still want it), so the group undoes that item
//! itself — when its row shows it took effect ([`Batched::took`]), or when
//! the statement's outcome is unknown (it timed out or the connection
//! failed), exactly as the runner undoes a lone statement whose caller gave
//! up. A statement that fails answers each item with the error a lone
//! statement would have had: [`RunError::Shared`], which says whether the
//! server refused it (nothing applied) or the outcome is unknown.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::oneshot;

use super::runner::Undo;
use super::{RunError, Runner};

/// Items per statement: bounds how long one transaction holds its rows'
/// locks (another process's call for one of them waits for the commit).
pub const MAX_ITEMS: usize = 64;

/// Calls waiting for the next statement; beyond this a call goes out alone.
const MAX_QUEUED: usize = 1024;

/// A statement on its way longer than this is slow (a row-lock wait, a
/// stalled connection): calls that arrive meanwhile go out alone, on
/// connections of their own, instead of queueing behind it — so one slow
/// key holds the others up for this long at most, not for the database's
/// `lock_timeout` or the request budget. Far above a healthy statement (a
/// few ms, its commit's flush included; 8 ms p99 with 64 writers), so a
/// loaded database does not tip the group into one statement per call,
/// which would load it further.
const ALONE_AFTER: Duration = Duration::from_millis(250);

/// An operation that can go alone or several at once.
#[async_trait]
pub trait Batched: Send + Sync + 'static {
    type Args: Send + 'static;
    type Row: Send + 'static;
    /// The `op` label.
    const OP: &'static str;
    /// The single statement, with its own undo if it has one.
    async fn one(runner: &Runner, args: Self::Args) -> Result<Self::Row, RunError>;
    /// Rows with the 1-based index of the item each answers.
    async fn many(
        runner: &Runner,
        args: Vec<Self::Args>,
    ) -> Result<Vec<(i32, Self::Row)>, RunError>;
    /// What undoes this item if its caller gave up after it was sent.
    /// `None`: nothing to undo (the operation only gives back).
    fn undo(_args: &Self::Args) -> Option<Undo> {
        None
    }
    /// Whether the row says the item took something that [`Self::undo`]
    /// must give back when nobody is told.
    fn took(_row: &Self::Row) -> bool {
        false
    }
}

type Answer<R> = Result<R, RunError>;

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
    /// A statement of this operation is on its way, since then.
    busy: Option<Instant>,
    waiting: Vec<Queued<B>>,
}

/// One operation's group commit.
pub struct Group<B: Batched> {
    runner: Runner,
    /// How long a queued caller waits at most.
    budget: Duration,
    state: Mutex<State<B>>,
    /// Items per statement.
    per_statement: Option<prometheus::Histogram>,
    /// `false`: every call goes alone (a mutant run of a single statement
    /// the shared function does not follow).
    enabled: bool,
}

impl<B: Batched> Group<B> {
    pub fn new(runner: Runner, budget: Duration) -> Group<B> {
        Group {
            runner,
            budget,
            state: Mutex::new(State {
                busy: None,
                waiting: Vec::new(),
            }),
            per_statement: None,
            enabled: true,
        }
    }

    pub fn set_metrics(&mut self, per_statement: prometheus::Histogram) {
        self.per_statement = Some(per_statement);
    }

    /// Every call alone, never shared.
    pub fn disable(&mut self) {
        self.enabled = false;
    }

    /// One call: alone when none of this operation is on its way, else in
    /// the next shared statement.
    pub async fn call(self: &Arc<Self>, args: B::Args) -> Answer<B::Row> {
        let undo = B::undo(&args);
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
        let mut waiting = Waiting::<B> {
            rx: Some(rx),
            undo,
            runner: &self.runner,
        };
        let rx = waiting.rx.as_mut().expect("receiver present");
        let answer = match tokio::time::timeout(self.budget, rx).await {
            Ok(Ok(answer)) => answer,
            // The statement's task ended without answering (a panic).
            Ok(Err(_)) => Err(RunError::Timeout),
            // An answer that came just as the budget ran out is still the
            // answer; else the item is undone by whoever holds it last.
            Err(_) => waiting.last_word().unwrap_or(Err(RunError::Timeout)),
        };
        waiting.rx = None;
        answer
    }

    fn enter(&self, args: B::Args) -> Entry<B> {
        if !self.enabled {
            return Entry::Alone(args);
        }
        let mut st = self.state.lock().expect("group commit poisoned");
        let Some(since) = st.busy else {
            st.busy = Some(Instant::now());
            return Entry::Lead(args);
        };
        if st.waiting.len() >= MAX_QUEUED || since.elapsed() > ALONE_AFTER {
            return Entry::Alone(args);
        }
        let (tx, rx) = oneshot::channel();
        st.waiting.push(Queued { args, reply: tx });
        Entry::Queued(rx)
    }

    async fn single(&self, args: B::Args) -> Answer<B::Row> {
        self.observe(1);
        B::one(&self.runner, args).await
    }

    /// The statement on its way has answered: send what queued meanwhile,
    /// or stand idle.
    fn next(self: &Arc<Self>) {
        let batch = {
            let mut st = self.state.lock().expect("group commit poisoned");
            // Callers that gave up are not sent.
            st.waiting.retain(|q| !q.reply.is_closed());
            if st.waiting.is_empty() {
                st.busy = None;
                return;
            }
            st.busy = Some(Instant::now());
            let n = st.waiting.len().min(MAX_ITEMS);
            st.waiting.drain(..n).collect::<Vec<_>>()
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            // Dropped outside the runtime (shutting down): nobody to send.
            self.state.lock().expect("group commit poisoned").busy = None;
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
            // Alone after all: the single statement. Its runner's caller is
            // this task, not the item's, so an item whose caller gave up
            // meanwhile is undone here, as a shared item is — except after
            // the runner's own timeout, when the runner has undone it.
            let q = batch.into_iter().next().expect("one item");
            let undo = B::undo(&q.args);
            let result = self.single(q.args).await;
            let undo_if_unheard = match &result {
                Ok(row) => B::took(row),
                Err(RunError::Timeout) => false,
                Err(e) => !e.refused(),
            };
            if q.reply.send(result).is_err() && undo_if_unheard {
                self.undo(undo);
            }
            return;
        }
        self.observe(batch.len());
        let n = batch.len();
        let undos: Vec<Option<Undo>> = batch.iter().map(|q| B::undo(&q.args)).collect();
        let (args, replies): (Vec<_>, Vec<_>) =
            batch.into_iter().map(|q| (q.args, q.reply)).unzip();
        let mut replies: Vec<_> = replies.into_iter().map(Some).collect();
        match B::many(&self.runner, args).await {
            Ok(rows) => {
                let shifted = crate::mutants::active("fence_batch_replies_shifted");
                for (idx, row) in rows {
                    // Mutant: item i answered with its neighbour's row.
                    let idx = if shifted { idx % n as i32 + 1 } else { idx };
                    let Some(i) = usize::try_from(idx).ok().and_then(|i| i.checked_sub(1)) else {
                        continue;
                    };
                    let Some(reply) = replies.get_mut(i).and_then(Option::take) else {
                        continue;
                    };
                    let took = B::took(&row);
                    if reply.send(Ok(row)).is_err() && took {
                        // Its caller gave up while the statement ran.
                        self.undo(undos[i].clone());
                    }
                }
                // The function answers every item; one it did not is an
                // unknown outcome.
                for (i, reply) in replies.into_iter().enumerate() {
                    let Some(reply) = reply else { continue };
                    tracing::error!(
                        op = B::OP,
                        "a shared statement's item got no row; answered as unknown"
                    );
                    let unknown = RunError::Shared {
                        message: "shared statement gave this item no answer".into(),
                        refused: false,
                    };
                    if reply.send(Err(unknown)).is_err() {
                        self.undo(undos[i].clone());
                    }
                }
            }
            Err(e) => {
                let refused = e.refused();
                let message = e.to_string();
                tracing::warn!(op = B::OP, items = n, error = %message, refused,
                    "shared statement failed");
                for (i, reply) in replies.into_iter().enumerate() {
                    let reply = reply.expect("no reply taken yet");
                    let failed = RunError::Shared {
                        message: message.clone(),
                        refused,
                    };
                    // The caller decides on a known failure; an unknown
                    // outcome nobody hears of is undone here.
                    if reply.send(Err(failed)).is_err() && !refused {
                        self.undo(undos[i].clone());
                    }
                }
            }
        }
    }

    fn undo(&self, undo: Option<Undo>) {
        undo_item(&self.runner, undo);
    }

    fn observe(&self, items: usize) {
        if let Some(h) = &self.per_statement {
            h.observe(items as f64);
        }
    }
}

/// A queued caller's side of its reply. Whichever of the caller and the
/// group is last to hold the answer undoes an item that took effect: the
/// group when its send fails (the caller is gone), this guard when the
/// caller is dropped or gives up after the answer was sent but before it
/// was read (the reply that arrives after the caller gave up).
struct Waiting<'a, B: Batched> {
    rx: Option<oneshot::Receiver<Answer<B::Row>>>,
    undo: Option<Undo>,
    runner: &'a Runner,
}

impl<B: Batched> Waiting<'_, B> {
    /// Closes the channel (a later send fails, and the group undoes) and
    /// takes an answer that was already sent.
    fn last_word(&mut self) -> Option<Answer<B::Row>> {
        let mut rx = self.rx.take()?;
        rx.close();
        rx.try_recv().ok()
    }
}

impl<B: Batched> Drop for Waiting<'_, B> {
    fn drop(&mut self) {
        if let Some(Ok(row)) = self.last_word() {
            if B::took(&row) {
                undo_item(self.runner, self.undo.take());
            }
        }
    }
}

/// Undoes one item of a shared statement whose caller is gone.
fn undo_item(runner: &Runner, undo: Option<Undo>) {
    // Mutant: the shared statement's abandoned items are left to their TTL.
    if crate::mutants::active("pg_group_undo_skipped") {
        return;
    }
    if let Some(undo) = undo {
        runner.spawn_undo(undo);
    }
}

/// The operation's turn: passed on when its holder is done or dropped.
struct Turn<B: Batched>(Arc<Group<B>>);

impl<B: Batched> Drop for Turn<B> {
    fn drop(&mut self) {
        self.0.next();
    }
}
