//! The RedLock backend's series: how rounds end, which masters fail.

use std::sync::Arc;

use prometheus::{IntCounterVec, IntGauge, Opts, Registry};

use super::redis::EvictionMetrics;
use super::register;

pub struct RedLockMetrics {
    /// Rounds by operation (acquire, renew) and outcome.
    pub rounds: IntCounterVec,
    /// Calls to one master that failed or timed out, by its index in
    /// `backend.redlock.urls` (a handful of values).
    pub master_errors: IntCounterVec,
    /// Masters that answered the last ping.
    pub masters_up: IntGauge,
    /// Each master's eviction policy (`master` = index in `urls`).
    pub eviction: Arc<EvictionMetrics>,
}

impl RedLockMetrics {
    pub fn new(registry: &Registry, masters: usize) -> RedLockMetrics {
        let indices: Vec<String> = (0..masters).map(|i| i.to_string()).collect();
        let m = RedLockMetrics {
            eviction: Arc::new(EvictionMetrics::new(
                registry,
                "fencer_redlock",
                "master",
                &indices,
            )),
            rounds: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_redlock_rounds_total",
                        "RedLock rounds by operation and outcome: majority, held, split (nobody got a majority: released, retried after retry_delay), undecided (too few masters answered), quarantined (too many masters in their restart quarantine), validity_exhausted (a majority, but too late), writeback_short (the token reached too few masters), lost (renewal: no majority holds the lease any more).",
                    ),
                    &["op", "outcome"],
                )
                .expect("valid metric"),
            ),
            master_errors: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_redlock_master_errors_total",
                        "Calls to one RedLock master that failed or timed out, by the master's index in backend.redlock.urls.",
                    ),
                    &["master"],
                )
                .expect("valid metric"),
            ),
            masters_up: register(
                registry,
                IntGauge::new(
                    "fencer_redlock_masters_up",
                    "RedLock masters that answered the last ping (a majority is needed).",
                )
                .expect("valid metric"),
            ),
        };
        for i in 0..masters {
            m.master_errors.with_label_values(&[&i.to_string()]);
        }
        for (op, outcomes) in [
            (
                "acquire",
                &[
                    "majority",
                    "held",
                    "split",
                    "undecided",
                    "validity_exhausted",
                    "writeback_short",
                    "quarantined",
                ][..],
            ),
            (
                "renew",
                &["majority", "lost", "undecided", "validity_exhausted"][..],
            ),
        ] {
            for o in outcomes {
                m.rounds.with_label_values(&[op, o]);
            }
        }
        m
    }
}
