//! Group commit of acquires and releases (single and sentinel modes).
//!
//! One sidecar sees every lock operation of its pod, so concurrent calls
//! for different keys can share one round trip and one Lua call: the
//! read, parse and script entry are paid once per batch (the commands
//! inside the script stay per item; measured in docs/performance.md). A
//! worker task per operation takes calls off a bounded
//! queue. When nothing is in flight a call goes out at once, alone, with
//! the single-item script, from the caller's own task (no added latency,
//! no hop through the worker, today's command exactly);
//! calls that arrive while one is in flight queue and go
//! together in the next one (at most [`MAX_ITEMS`]), as one `_MANY` script
//! ([`super::scripts::ACQUIRE_MANY`]), then `WAIT` once when replicas are
//! required. The script runs each item as the single script would, so a
//! batch changes how many calls Redis parses, not what any item does.
//!
//! A batch is one [`Runner::exec`]: the same budget, transient retries,
//! `NOSCRIPT` fallback and sentinel master-change abort as a single call,
//! and a batch that fails answers every item with the error a single call
//! would have had (an unknown outcome stays `Unavailable`, so the sidecar
//! retries the acquire with the same lease id, which the script answers
//! idempotently). Each caller does its own post-processing (a `WAIT`
//! shortfall → undo) as before.
//!
//! A caller waits at most the single call's budget from the moment it
//! queued; one that gave up (or whose task was dropped) has closed its
//! reply channel, and an item whose channel is closed when the batch is
//! formed is never sent. A reply to a closed channel is dropped: the worker
//! never blocks on a caller.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use redis::Value;
use tokio::sync::{mpsc, oneshot, Notify};

use super::conn::Call;
use super::runner::{copy_error, Replicated, Runner};
use super::scripts::{Lua, Scripts};
use crate::lock::BackendError;
use crate::metrics::redis::RedisMetrics;

/// Items per batch: bounds one script's run time on Redis (other clients
/// wait while it runs) and the reply a caller waits for.
pub const MAX_ITEMS: usize = 64;

/// Calls waiting for the next batch; beyond this a call goes out alone.
const QUEUE: usize = 1024;

/// The batched operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Acquire,
    Release,
}

impl Op {
    /// The `op` label.
    pub fn name(self) -> &'static str {
        match self {
            Op::Acquire => "acquire",
            Op::Release => "release",
        }
    }

    fn keys_per_item(self) -> usize {
        match self {
            Op::Acquire => 5,
            Op::Release => 2,
        }
    }

    /// The single-item script and the batch script.
    fn scripts(self, scripts: &Scripts) -> (&Lua, &Lua) {
        match self {
            Op::Acquire => (&scripts.acquire, &scripts.acquire_many),
            Op::Release => (&scripts.release, &scripts.release_many),
        }
    }
}

/// One call: its keys and its own arguments, laid out as in the single
/// script (the arguments every item shares are the batcher's `tail`).
pub struct Item {
    pub keys: Vec<String>,
    pub args: Vec<String>,
}

/// One item's answer: the script's `{status, value}` and the replicas
/// `WAIT` counted after its batch (`None`: no `WAIT`).
#[derive(Debug)]
pub struct ItemReply {
    pub status: i64,
    pub value: String,
    pub replicas: Option<i64>,
}

type Answer = Result<ItemReply, BackendError>;

struct Queued {
    item: Item,
    reply: oneshot::Sender<Answer>,
}

/// What a batch needs; shared by the callers (for the overflow path) and
/// the worker.
struct Shared {
    op: Op,
    /// The arguments after the items' own (token mode, lock-delay, counter
    /// expiry for acquires; the publish command for releases).
    tail: Vec<String>,
    replicated: Replicated,
    runner: Arc<Runner>,
    scripts: Arc<Scripts>,
    metrics: Arc<RedisMetrics>,
    /// A script call of this operation is on its way (a batch or a direct
    /// call): one at a time, so calls arriving meanwhile gather into the
    /// next batch.
    busy: AtomicBool,
    /// Notified when `busy` clears: the worker waits on it for its turn.
    idle: Notify,
    /// Calls queued for the worker and not yet answered: while any wait,
    /// a new call queues behind them instead of going out directly, so
    /// direct calls cannot keep the worker from its turn.
    pending: AtomicUsize,
}

pub struct Batcher {
    queue: mpsc::Sender<Queued>,
    shared: Arc<Shared>,
}

impl Batcher {
    /// Starts the worker (needs a Tokio runtime). It ends when the batcher
    /// is dropped.
    pub fn start(
        op: Op,
        tail: Vec<String>,
        replicated: Replicated,
        runner: Arc<Runner>,
        scripts: Arc<Scripts>,
        metrics: Arc<RedisMetrics>,
    ) -> Batcher {
        let shared = Arc::new(Shared {
            op,
            tail,
            replicated,
            runner,
            scripts,
            metrics,
            busy: AtomicBool::new(false),
            idle: Notify::new(),
            pending: AtomicUsize::new(0),
        });
        let (queue, rx) = mpsc::channel(QUEUE);
        tokio::spawn(work(shared.clone(), rx));
        Batcher { queue, shared }
    }

    /// Runs `item` in the next batch and answers it alone. With nothing in
    /// flight it goes out at once from the caller's own task, as the single
    /// script: no hop through the worker, so one client pays nothing for
    /// the batching (two callers that both see nothing in flight both go
    /// out alone, as before batching existed).
    pub async fn call(&self, item: Item) -> Answer {
        if self.shared.pending.load(Ordering::Acquire) == 0 {
            if let Some(turn) = self.shared.try_turn() {
                return self
                    .shared
                    .run(std::slice::from_ref(&item), Some(turn))
                    .await
                    .pop()
                    .expect("one answer per item");
            }
        }
        let (tx, rx) = oneshot::channel();
        self.shared.pending.fetch_add(1, Ordering::AcqRel);
        if let Err(e) = self.queue.try_send(Queued { item, reply: tx }) {
            self.shared.pending.fetch_sub(1, Ordering::AcqRel);
            // Queue full (or worker gone): this call goes out by itself,
            // beside whatever is in flight, rather than wait or fail.
            let queued = match e {
                mpsc::error::TrySendError::Full(q) | mpsc::error::TrySendError::Closed(q) => q,
            };
            tracing::debug!(
                op = self.shared.op.name(),
                "redis batch queue full; sent alone"
            );
            return self
                .shared
                .run(std::slice::from_ref(&queued.item), None)
                .await
                .pop()
                .expect("one answer per item");
        }
        let budget = self.shared.runner.budget(self.shared.replicated);
        match tokio::time::timeout(budget, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(BackendError::Unavailable(format!(
                "{}: redis batch worker ended",
                self.shared.runner.target
            ))),
            // The item may be in a batch in flight: outcome unknown, as a
            // single call timing out.
            Err(_) => Err(BackendError::Unavailable(format!(
                "{}: request timed out",
                self.shared.runner.target
            ))),
        }
    }
}

/// Takes what the queue holds (up to [`MAX_ITEMS`]), waits for its turn,
/// runs it as one batch, answers each caller; again.
async fn work(shared: Arc<Shared>, mut rx: mpsc::Receiver<Queued>) {
    let mut batch: Vec<Queued> = Vec::with_capacity(MAX_ITEMS);
    while rx.recv_many(&mut batch, MAX_ITEMS).await > 0 {
        // A direct call may be on its way: what arrives while it is goes
        // along in this batch.
        let turn = shared.turn().await;
        while batch.len() < MAX_ITEMS {
            match rx.try_recv() {
                Ok(q) => batch.push(q),
                Err(_) => break,
            }
        }
        // No longer pending once answered (or found abandoned).
        let _pending = Pending(&shared.pending, batch.len());
        // A caller that gave up: its item is not sent.
        batch.retain(|q| !q.reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        let items: Vec<Item> = batch
            .iter_mut()
            .map(|q| Item {
                keys: std::mem::take(&mut q.item.keys),
                args: std::mem::take(&mut q.item.args),
            })
            .collect();
        let answers = shared.run(&items, Some(turn)).await;
        for (q, answer) in batch.drain(..).zip(answers) {
            // The caller may be gone meanwhile; nothing waits on it.
            let _ = q.reply.send(answer);
        }
    }
}

impl Shared {
    /// One script call for `items`: the single script for one item, the
    /// batch script for more. One answer per item, in order.
    /// `turn`: this call's turn, given back when it ends however it ends
    /// (a direct caller's task may be dropped mid-call); `None` for a call
    /// that overflowed the queue.
    async fn run(&self, items: &[Item], turn: Option<Turn<'_>>) -> Vec<Answer> {
        let _turn = turn;
        let op = self.op.name();
        let started = Instant::now();
        let (single, many) = self.op.scripts(&self.scripts);
        let mut call = Call::default();
        for item in items {
            debug_assert_eq!(item.keys.len(), self.op.keys_per_item());
            call.keys.extend(item.keys.iter().cloned());
            call.args.extend(item.args.iter().cloned());
        }
        call.args.extend(self.tail.iter().cloned());
        let lua = if items.len() == 1 { single } else { many };
        self.metrics.batches.with_label_values(&[op]).inc();
        self.metrics
            .batched_calls
            .with_label_values(&[op])
            .inc_by(items.len() as u64);
        let reply = match self.runner.exec(lua, &call, self.replicated).await {
            Ok(reply) => reply,
            Err(e) => {
                tracing::warn!(op, items = items.len(), error = %e,
                    "redis batch failed; each of its calls gets the error");
                return items.iter().map(|_| Err(copy_error(&e))).collect();
            }
        };
        tracing::debug!(
            op,
            items = items.len(),
            took_us = started.elapsed().as_micros() as u64,
            "redis batch"
        );
        let replicas = reply.replicas;
        let pairs = if items.len() == 1 {
            pair(reply.value).map(|p| vec![p])
        } else {
            pairs(reply.value, items.len())
        };
        let pairs = match pairs {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(op, items = items.len(), error = %e, "redis batch reply unreadable");
                return items.iter().map(|_| Err(copy_error(&e))).collect();
            }
        };
        let n = pairs.len();
        let shifted = crate::mutants::active("batch_replies_shifted");
        (0..n)
            .map(|i| {
                // Mutant: item i answered with its neighbour's reply.
                let (status, value) = pairs[if shifted { (i + 1) % n } else { i }].clone();
                if status == -2 {
                    return Err(BackendError::Protocol(value));
                }
                Ok(ItemReply {
                    status,
                    value,
                    replicas,
                })
            })
            .collect()
    }
}

impl Shared {
    /// The turn to send, if nothing is on its way.
    fn try_turn(&self) -> Option<Turn<'_>> {
        self.busy
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| Turn(self))
    }

    /// Waits for the turn to send.
    async fn turn(&self) -> Turn<'_> {
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if let Some(turn) = self.try_turn() {
                return turn;
            }
            idle.await;
        }
    }
}

/// The one script call of an operation on its way; given back (and the
/// worker woken) when dropped.
struct Turn<'a>(&'a Shared);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::Release);
        self.0.idle.notify_one();
    }
}

/// Queued calls taken by the worker, no longer pending once dropped.
struct Pending<'a>(&'a AtomicUsize, usize);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::AcqRel);
    }
}

fn protocol(e: impl std::fmt::Display) -> BackendError {
    BackendError::Protocol(e.to_string())
}

/// `{status, value}`.
fn pair(value: Value) -> Result<(i64, String), BackendError> {
    redis::from_redis_value(value).map_err(protocol)
}

/// `{status, value, status, value, …}`, one pair per item.
fn pairs(value: Value, items: usize) -> Result<Vec<(i64, String)>, BackendError> {
    let reply: Vec<Value> = redis::from_redis_value(value).map_err(protocol)?;
    if reply.len() != items * 2 {
        return Err(BackendError::Protocol(format!(
            "batch script returned {} values for {items} items",
            reply.len()
        )));
    }
    let mut out = Vec::with_capacity(items);
    let mut values = reply.into_iter();
    while let (Some(status), Some(value)) = (values.next(), values.next()) {
        out.push((
            redis::from_redis_value(status).map_err(protocol)?,
            redis::from_redis_value(value).map_err(protocol)?,
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(items: &[(i64, &str)]) -> Value {
        Value::Array(
            items
                .iter()
                .flat_map(|(s, v)| [Value::Int(*s), Value::BulkString(v.as_bytes().to_vec())])
                .collect(),
        )
    }

    #[test]
    fn replies_keep_their_items_order() {
        let got = pairs(flat(&[(1, "7"), (-1, "300"), (-2, "boom")]), 3).unwrap();
        assert_eq!(
            got,
            vec![(1, "7".into()), (-1, "300".into()), (-2, "boom".into())]
        );
    }

    #[test]
    fn a_reply_of_the_wrong_length_fails_the_batch() {
        let err = pairs(flat(&[(1, "7")]), 2).unwrap_err();
        assert!(matches!(err, BackendError::Protocol(_)), "{err:?}");
    }
}
