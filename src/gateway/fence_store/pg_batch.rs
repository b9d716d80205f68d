//! The PostgreSQL fence store's two group-committed operations
//! ([`crate::pg::group`]): admissions and the clearings of their stamps.
//!
//! Every fenced write is admitted by a transaction that must be durable
//! before the write is forwarded: its commit waits for a WAL flush. Then,
//! when the storage has answered, another transaction clears its stamp.
//! One gateway sees every fenced write of the keys it serves, so admissions
//! (and clearings) of different keys that arrive together share one
//! statement, one transaction and one flush (`fencer_gw_admit_many_v1`,
//! `fencer_gw_finish_many_v1`, which run each item through the very
//! function a single call uses). Items are the keys' current turns in this
//! gateway ([`super::super::key_queue`]), so a key appears at most once in
//! a statement.
//!
//! Neither operation has an undo: a failed or abandoned admission's
//! outcome is unknown exactly as for a single one that timed out — the
//! stamp, if it was committed, keeps the key blocked until it runs out.

use async_trait::async_trait;

use super::sql;
use crate::pg::group::Batched;
use crate::pg::runner::Params;
use crate::pg::{RunError, Runner};

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
    /// A read lease's token (on a read).
    pub read: bool,
}

/// `(outcome, mark token, mark lease, mark seq, busy ms, read token)`, as
/// `fencer_gw_admit_v2` answers.
pub type AdmitRow = (
    i32,
    Option<i64>,
    Option<String>,
    Option<i64>,
    i64,
    Option<i64>,
);

/// One clearing's arguments, as `fencer_gw_finish_v1` takes them.
#[derive(Debug, Clone)]
pub struct FinishArgs {
    pub key: String,
    pub stamp: String,
    pub channel: String,
}

/// Admissions (`fencer_gw_admit_v2` / `_many_v2`).
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
            Box::new(a.read),
        ];
        let rows = runner.query(sql::CALL_ADMIT, params, None).await?;
        let row = only_row(&rows)?;
        Ok((
            row.get(0),
            row.get(1),
            row.get(2),
            row.get(3),
            row.get(4),
            row.get(5),
        ))
    }

    async fn many(runner: &Runner, args: Vec<AdmitArgs>) -> Result<Vec<(i32, AdmitRow)>, RunError> {
        let mut c = (vec![], vec![], vec![], vec![], vec![], vec![]);
        let mut reads = vec![];
        for a in args {
            c.0.push(a.key);
            c.1.push(a.token);
            c.2.push(a.lease);
            c.3.push(a.seq);
            c.4.push(a.stamp);
            c.5.push(a.hold_ms);
            reads.push(a.read);
        }
        let params: Params = vec![
            Box::new(c.0),
            Box::new(c.1),
            Box::new(c.2),
            Box::new(c.3),
            Box::new(c.4),
            Box::new(c.5),
            Box::new(reads),
        ];
        let rows = runner.query(sql::CALL_ADMIT_MANY, params, None).await?;
        Ok(rows
            .iter()
            .map(|r| {
                let row = (r.get(1), r.get(2), r.get(3), r.get(4), r.get(5), r.get(6));
                (r.get(0), row)
            })
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
