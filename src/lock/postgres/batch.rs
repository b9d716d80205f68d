//! The PostgreSQL lock backend's group-committed operations
//! ([`crate::pg::group`]): acquires and releases of different keys that
//! arrive together share one statement, one transaction and one WAL flush
//! (`fencer_acquire_many_v1`, `fencer_release_many_v1`, which run each item
//! through [`super::sql::ACQUIRE`] or [`super::sql::RELEASE`] itself).
//!
//! An acquire carries its undo ([`super::void_attempt`]): a lone acquire's
//! runner runs it when its caller gives up; a shared one's group runs it
//! for the item whose caller gave up after it was sent and whose row says
//! it took the key, or when the shared statement's outcome is unknown. A
//! release gives back only, so it needs none.

use async_trait::async_trait;

use super::sql;
use crate::lock::{LeaseId, LockKey};
use crate::pg::group::Batched;
use crate::pg::runner::{Params, Undo};
use crate::pg::{RunError, Runner};

/// One acquire attempt's arguments.
#[derive(Debug, Clone)]
pub struct AcquireArgs {
    pub key: LockKey,
    pub lease: LeaseId,
    pub ttl_ms: i64,
    pub delay_ms: i64,
    /// This attempt's id: what its undo voids.
    pub attempt: String,
    /// The key's NOTIFY channel (the undo's release wakes waiters).
    pub channel: String,
}

/// `(status, token, remaining ms)` as [`sql::ACQUIRE`] answers, `None`
/// when it answered no row.
pub type AcquireRow = Option<(i32, i64, i64)>;

pub struct Acquire;

#[async_trait]
impl Batched for Acquire {
    type Args = AcquireArgs;
    type Row = AcquireRow;
    const OP: &'static str = "acquire";

    async fn one(runner: &Runner, a: AcquireArgs) -> Result<AcquireRow, RunError> {
        let undo = Self::undo(&a);
        let params: Params = vec![
            Box::new(a.key.as_str().to_owned()),
            Box::new(a.lease.as_str().to_owned()),
            Box::new(None::<String>),
            Box::new(a.ttl_ms),
            Box::new(a.delay_ms),
            Box::new(a.attempt),
        ];
        let rows = runner.query(super::acquire_sql(), params, undo).await?;
        Ok(rows.first().map(|r| (r.get(0), r.get(1), r.get(2))))
    }

    async fn many(
        runner: &Runner,
        args: Vec<AcquireArgs>,
    ) -> Result<Vec<(i32, AcquireRow)>, RunError> {
        // One lock-delay per backend: every item carries the same.
        let delay = args.first().map_or(0, |a| a.delay_ms);
        let mut c = (vec![], vec![], vec![], vec![]);
        for a in args {
            c.0.push(a.key.as_str().to_owned());
            c.1.push(a.lease.as_str().to_owned());
            c.2.push(a.ttl_ms);
            c.3.push(a.attempt);
        }
        let params: Params = vec![
            Box::new(c.0),
            Box::new(c.1),
            Box::new(c.2),
            Box::new(delay),
            Box::new(c.3),
        ];
        // No undo of the shared statement as a whole: the group undoes
        // item by item (module comment).
        let rows = runner.query(sql::ACQUIRE_MANY, params, None).await?;
        Ok(rows
            .iter()
            .map(|r| {
                let status: i32 = r.get(1);
                let row = (status != 0).then(|| (status, r.get(2), r.get(3)));
                (r.get(0), row)
            })
            .collect())
    }

    fn undo(a: &AcquireArgs) -> Option<Undo> {
        Some(super::void_attempt(
            &a.key,
            &a.lease,
            a.channel.clone(),
            a.attempt.clone(),
        ))
    }

    fn took(row: &AcquireRow) -> bool {
        matches!(row, Some((1, _, _)))
    }
}

/// One release's arguments.
#[derive(Debug, Clone)]
pub struct ReleaseArgs {
    pub key: LockKey,
    pub lease: LeaseId,
    pub channel: String,
}

/// `(status, token)` as [`sql::RELEASE`] answers; `None`: the key has no
/// row (free).
pub type ReleaseRow = Option<(i32, i64)>;

pub struct Release;

#[async_trait]
impl Batched for Release {
    type Args = ReleaseArgs;
    type Row = ReleaseRow;
    const OP: &'static str = "release";

    async fn one(runner: &Runner, a: ReleaseArgs) -> Result<ReleaseRow, RunError> {
        let params: Params = vec![
            Box::new(a.key.as_str().to_owned()),
            Box::new(a.lease.as_str().to_owned()),
            Box::new(a.channel),
        ];
        let rows = runner.query(sql::RELEASE, params, None).await?;
        Ok(rows.first().map(|r| (r.get(0), r.get(1))))
    }

    async fn many(
        runner: &Runner,
        args: Vec<ReleaseArgs>,
    ) -> Result<Vec<(i32, ReleaseRow)>, RunError> {
        let mut c = (vec![], vec![], vec![]);
        for a in args {
            c.0.push(a.key.as_str().to_owned());
            c.1.push(a.lease.as_str().to_owned());
            c.2.push(a.channel);
        }
        let params: Params = vec![Box::new(c.0), Box::new(c.1), Box::new(c.2)];
        let rows = runner.query(sql::RELEASE_MANY, params, None).await?;
        Ok(rows
            .iter()
            .map(|r| {
                // Status 0: free (also when the key had no row).
                (r.get(0), Some((r.get(1), r.get(2))))
            })
            .collect())
    }
}
