//! The etcd lock backend's series: its places in lock queues and what
//! happened to them.

use prometheus::{IntCounterVec, IntGauge, Opts, Registry};

use super::register;

pub struct EtcdLockMetrics {
    /// What happened to this sidecar's places: `created`, `lapsed` (its
    /// etcd lease ran out under a waiter or holder: etcd deleted it),
    /// `expired` (a holder's TTL passed without a renewal: this sidecar
    /// ended it), `adopted` (a lease of an earlier process of this sidecar,
    /// found by its id), `cleanup_retry` (a delete that failed, tried
    /// again), `offset_conflict` (the token offset moved under a create).
    pub events: IntCounterVec,
    /// Keepalives of waiting places' etcd leases, by result: `ok`,
    /// `gone` (the lease had lapsed), `error`.
    pub keepalives: IntCounterVec,
    /// This sidecar's places standing in lock queues (waiting, not holding).
    pub queue_places: IntGauge,
}

impl EtcdLockMetrics {
    pub fn new(registry: &Registry) -> EtcdLockMetrics {
        let m = EtcdLockMetrics {
            events: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_etcd_lock_events_total",
                        "What happened to this sidecar's places in etcd lock queues: created, lapsed (their etcd lease ran out: etcd deleted them), expired (a holder's TTL passed without a renewal), adopted (a lease of an earlier process found by its id), cleanup_retry, offset_conflict.",
                    ),
                    &["event"],
                )
                .expect("valid metric"),
            ),
            keepalives: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_etcd_lock_keepalives_total",
                        "Keepalives of waiting places' etcd leases, by result: ok, gone (the lease had lapsed: the waiter queues again), error.",
                    ),
                    &["result"],
                )
                .expect("valid metric"),
            ),
            queue_places: register(
                registry,
                IntGauge::new(
                    "fencer_etcd_lock_queue_places",
                    "This sidecar's places waiting in etcd lock queues.",
                )
                .expect("valid metric"),
            ),
        };
        // Every series from the start, at 0: a rate over an event that has
        // not happened yet is 0, not absent.
        for event in EVENTS {
            m.events.with_label_values(&[event]);
        }
        for result in ["ok", "gone", "error"] {
            m.keepalives.with_label_values(&[result]);
        }
        m
    }
}

/// The `event` label's values.
const EVENTS: [&str; 6] = [
    "created",
    "lapsed",
    "expired",
    "adopted",
    "cleanup_retry",
    "offset_conflict",
];
