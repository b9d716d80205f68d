//! Series of the SQL statement runners ([`crate::pg::runner`],
//! [`crate::mysql::runner`]), shared by the sidecar's lock backends and the
//! gateway's fence stores. Process-wide, like [`super::SERVER`]: a runner
//! has no registry of its own; [`super::registry`] registers these in each.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts};

pub struct SqlMetrics {
    /// Statements whose caller gave up before their answer, by database
    /// (`postgres`, `mysql`). Each one's connection is discarded, never
    /// pooled again.
    pub abandoned: IntCounterVec,
    /// Undos of abandoned statements, by database and outcome: `released`
    /// (the statement had taken something; given back), `voided` (nothing
    /// to give back; on PostgreSQL the statement can no longer take
    /// effect), `failed` (could not run in time: what the statement took,
    /// if anything, stays until its TTL).
    pub undos: IntCounterVec,
    /// Statements the server rolled back to break a deadlock (or as a
    /// serialization failure) and that were tried again, by database.
    pub retries: IntCounterVec,
    /// Lock operations a SQL lock backend's group commit
    /// ([`crate::pg::group`]) sent together in one statement, by database
    /// and `op` (acquire, release); 1: alone.
    pub items_per_statement: HistogramVec,
}

pub static SQL: std::sync::LazyLock<SqlMetrics> = std::sync::LazyLock::new(|| {
    SqlMetrics {
    abandoned: IntCounterVec::new(
        Opts::new(
            "fencer_sql_abandoned_statements_total",
            "SQL statements whose caller gave up before the answer; each one's connection was discarded, never pooled again.",
        ),
        &["db"],
    )
    .expect("valid metric"),
    undos: IntCounterVec::new(
        Opts::new(
            "fencer_sql_undos_total",
            "Undos of abandoned SQL statements: released (it had taken something), voided (nothing to give back), failed (could not run in time).",
        ),
        &["db", "outcome"],
    )
    .expect("valid metric"),
    retries: IntCounterVec::new(
        Opts::new(
            "fencer_sql_retries_total",
            "SQL statements the server rolled back to break a deadlock (or as a serialization failure) and that were tried again within their budget; nothing of a rolled-back try applied.",
        ),
        &["db"],
    )
    .expect("valid metric"),
    items_per_statement: HistogramVec::new(
        HistogramOpts::new(
            "fencer_sql_lock_items_per_statement",
            "Lock operations a SQL lock backend's group commit sent together in one statement (1: alone), by db and op (acquire, release).",
        )
        .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]),
        &["db", "op"],
    )
    .expect("valid metric"),
}
});

impl SqlMetrics {
    /// Both databases' series at zero: the runners are process-wide, so
    /// which of them a process will use is not known here, and a zero
    /// series is true for the unused one.
    pub fn init_known(&self) {
        for db in ["postgres", "mysql"] {
            self.abandoned.with_label_values(&[db]);
            self.retries.with_label_values(&[db]);
            for outcome in ["released", "voided", "failed"] {
                self.undos.with_label_values(&[db, outcome]);
            }
        }
        // Only PostgreSQL's lock backend group-commits.
        for op in ["acquire", "release"] {
            self.items_per_statement
                .with_label_values(&["postgres", op]);
        }
    }
}
